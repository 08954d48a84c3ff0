"""Minimal ``gl.warp_specialize`` kernel: the control for racecheck on the Gluon forward (docs/racecheck-gluon.md).

Two partitions, neither of which touches shared memory: the default partition (the launch's 4 warps) writes
``idx`` to elements 0..127 of its program's slice of an int32 output, one worker partition of 1 warp writes
``idx + WORKER_TAG`` to elements 128..159.  Whatever shared memory the kernel uses is Triton's own
warp-specialization bookkeeping (the per-warp partition-state bytes, the explicit-capture slot).  So a racecheck
hazard reported on this kernel comes from Triton's lowering, not from a kernel's buffers.
Run by ``scripts/sanitize_driver.py wsprobe``.  Needs triton's Gluon (3.6 on the GPU machine; 3.9 has the same
``warp_specialize`` call) and an sm_90 / sm_100 GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

DEFAULT_WARPS = 4
WORKER_WARPS = 1
DEFAULT_ELEMS = 32 * DEFAULT_WARPS  # one element per thread
WORKER_ELEMS = 32 * WORKER_WARPS
SLICE = DEFAULT_ELEMS + WORKER_ELEMS  # elements per program
WORKER_TAG = 1 << 20  # added by the worker, so that a value tells which partition wrote it
WORKER_REGS = 24  # the mxattn producer's budget; Triton needs one per worker (setmaxnreg)


@gluon.jit
def _default_part(out_ptr, SLICE: gl.constexpr, N: gl.constexpr, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.program_id(0) * SLICE + gl.arange(0, N, layout=layout)
    gl.store(out_ptr + idx, idx)


@gluon.jit
def _worker_part(out_ptr, SLICE: gl.constexpr, OFFSET: gl.constexpr, N: gl.constexpr, WARPS: gl.constexpr,
                 TAG: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.program_id(0) * SLICE + OFFSET + gl.arange(0, N, layout=layout)
    gl.store(out_ptr + idx, idx + TAG)


@gluon.jit
def ws_probe_kernel(out_ptr, SLICE: gl.constexpr, DEFAULT_ELEMS: gl.constexpr, DEFAULT_WARPS: gl.constexpr,
                    WORKER_ELEMS: gl.constexpr, WORKER_WARPS: gl.constexpr, WORKER_TAG: gl.constexpr,
                    WORKER_REGS: gl.constexpr):
    # worker partitions take no distributed tensors: a pointer and constexprs only
    gl.warp_specialize([
        (_default_part, (out_ptr, SLICE, DEFAULT_ELEMS, DEFAULT_WARPS)),
        (_worker_part, (out_ptr, SLICE, DEFAULT_ELEMS, WORKER_ELEMS, WORKER_WARPS, WORKER_TAG)),
    ], [WORKER_WARPS], [WORKER_REGS])


@gluon.jit
def _worker_part_captured(out_ptr, base, SLICE: gl.constexpr, OFFSET: gl.constexpr, N: gl.constexpr,
                          WARPS: gl.constexpr, TAG: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.program_id(0) * SLICE + OFFSET + gl.arange(0, N, layout=layout)
    gl.store(out_ptr + idx, idx + TAG + base)


@gluon.jit
def ws_probe_mbar_kernel(out_ptr, base_in, SLICE: gl.constexpr, DEFAULT_ELEMS: gl.constexpr,
                         DEFAULT_WARPS: gl.constexpr, WORKER_ELEMS: gl.constexpr, WORKER_WARPS: gl.constexpr,
                         WORKER_TAG: gl.constexpr, WORKER_REGS: gl.constexpr):
    """The probe plus the two things the mxattn kernels do before ``gl.warp_specialize`` and the plain probe does
    not (docs/racecheck-gluon.md): an mbarrier initialised in shared memory (Triton follows it with a barrier of
    the default warps only) and a runtime value captured by the worker partition (an explicit-capture slot)."""
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    base = base_in + gl.program_id(0) * 0  # a runtime scalar for the worker to capture (0 at launch)
    gl.warp_specialize([
        (_default_part, (out_ptr, SLICE, DEFAULT_ELEMS, DEFAULT_WARPS)),
        (_worker_part_captured, (out_ptr, base, SLICE, DEFAULT_ELEMS, WORKER_ELEMS, WORKER_WARPS, WORKER_TAG)),
    ], [WORKER_WARPS], [WORKER_REGS])
    mbarrier.invalidate(bar.index(0))


def constexprs() -> dict:
    """The kernel's constexpr arguments (the launch and an offline ``triton.compile`` use the same)."""
    return dict(SLICE=SLICE, DEFAULT_ELEMS=DEFAULT_ELEMS, DEFAULT_WARPS=DEFAULT_WARPS, WORKER_ELEMS=WORKER_ELEMS,
                WORKER_WARPS=WORKER_WARPS, WORKER_TAG=WORKER_TAG, WORKER_REGS=WORKER_REGS)


def expected(programs: int) -> torch.Tensor:
    """What the launch must leave in the output (int32, on the CPU)."""
    idx = torch.arange(programs * SLICE, dtype=torch.int32)
    return torch.where(idx % SLICE < DEFAULT_ELEMS, idx, idx + WORKER_TAG)


def run(programs: int = 2, device: str = "cuda", mbar: bool = False) -> torch.Tensor:
    """One launch over ``programs`` CTAs on an output filled with -1 (so an element nobody wrote shows); ``mbar``:
    the variant with an mbarrier and a captured value (``ws_probe_mbar_kernel``; same expected output)."""
    out = torch.full((programs * SLICE,), -1, dtype=torch.int32, device=device)
    if mbar:
        ws_probe_mbar_kernel[(programs,)](out, 0, **constexprs(), num_warps=DEFAULT_WARPS)
    else:
        ws_probe_kernel[(programs,)](out, **constexprs(), num_warps=DEFAULT_WARPS)
    return out
