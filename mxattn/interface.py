"""Public attention functions: input checks, CPU/GPU dispatch, autograd.

Every check runs before any kernel launch and raises ``TypeError`` (wrong type/dtype) or ``ValueError``
(wrong shape, device, orientation, head dim, value) naming the argument.

Layouts: (B, S, H, D) tensors, as ``flash_attn_func``; ``mxfp8_attn_varlen_func``: packed (T, H, D) tensors with
``cu_seqlens_q`` / ``cu_seqlens_k``, as ``flash_attn_varlen_func``.  Orientations of MXFP8 inputs (DESIGN §1):
``q`` and ``k`` blocked along the head dim (``MXTensor.dim == 3``), ``v`` blocked along the sequence
(``dim == 1``).

torch.compile sees float-input attention as two ``torch.library`` custom ops, ``mxattn::attn_fwd`` and
``mxattn::attn_bwd`` (schemas and what the backward keeps: the comment above them).
"""

from __future__ import annotations

import collections
import functools
import importlib
import math
import os
import sys
import weakref
from typing import Optional, Union

import torch

from mxattn import formats
from mxattn.formats import MXTensor, RowScaledFP8

SUPPORTED_HEAD_DIMS = (64, 128)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
K_EXP_GROUP = 128

Operand = Union[torch.Tensor, MXTensor]


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _shape_of(name: str, t: Operand) -> torch.Size:
    if isinstance(t, MXTensor):
        return t.shape
    if isinstance(t, torch.Tensor):
        return t.shape
    raise TypeError(f"{name} must be a torch.Tensor or an MXTensor, got {type(t).__name__}")


def _check_heads(q_shape, k_shape, v_shape) -> None:
    """Checks shared by the dense and the varlen functions (shapes end in (..., heads, head_dim)): v has k's
    shape, q and k share a supported head dim, and the query heads are a multiple of the kv heads."""
    Hq, D = q_shape[-2], q_shape[-1]
    Hkv, Dk = k_shape[-2], k_shape[-1]
    if tuple(v_shape) != tuple(k_shape):
        raise ValueError(f"v must have k's shape {tuple(k_shape)}, got {tuple(v_shape)}")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk} but q has head dim {D}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the number of kv heads ({Hkv})")


def _check_attention_inputs(q: Operand, k: Operand, v: Operand, softmax_scale) -> tuple[bool, torch.device]:
    """Validate (q, k, v) for dense (B, S, H, D) attention; returns (inputs_are_mx, device)."""
    if _plain_float_inputs(q, k, v):
        is_mx, device = False, q.device
    else:
        is_mx, device = _check_operand_kinds(q, k, v)
    _check_heads(q.shape, k.shape, v.shape)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    _check_softmax_scale(softmax_scale)
    return is_mx, device


def _plain_float_inputs(q, k, v) -> bool:
    """Whether q, k, v are the common call's plain 4-D float tensors of one dtype on one device: every check of
    ``_check_operand_kinds`` passes, in a few attribute reads (the whole input check 2.8 -> 1.4 us per call on the
    CPU harness's machine, docs/perf-notes-host.md); a False here leaves the checks, and their messages, to it."""
    Tensor = torch.Tensor
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    dtype = q.dtype
    return (dtype in _FLOAT_DTYPES and k.dtype == dtype and v.dtype == dtype and q.ndim == 4 and k.ndim == 4
            and v.ndim == 4 and q.device == k.device == v.device)


def _check_operand_kinds(q: Operand, k: Operand, v: Operand) -> tuple[bool, torch.device]:
    """Types, dtypes, ranks, MX orientations and devices of (q, k, v); returns (inputs_are_mx, device)."""
    shapes = {n: _shape_of(n, t) for n, t in (("q", q), ("k", k), ("v", v))}
    kinds = {n: isinstance(t, MXTensor) for n, t in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) != 1:
        raise TypeError(
            "q, k and v must all be MXTensors or all be float tensors; got "
            + ", ".join(f"{n}={'MXTensor' if m else 'Tensor'}" for n, m in kinds.items())
        )
    is_mx = kinds["q"]
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not is_mx and t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{n} must be bfloat16, float16 or float32 (or an MXTensor), got {t.dtype}")
        if len(shapes[n]) != 4:
            raise ValueError(f"{n} must have shape (batch, seqlen, nheads, headdim), got {tuple(shapes[n])}")
    if not is_mx and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if is_mx:
        for n, t, want, what in (("q", q, 3, "head dim"), ("k", k, 3, "head dim"), ("v", v, 1, "sequence")):
            if t.dim != want:
                raise ValueError(f"{n} must be MXFP8-blocked along the {what} (MXTensor.dim={want}), got dim={t.dim}")
    devices = {n: t.device for n, t in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) != 1:
        raise ValueError("q, k, v must be on one device, got " + ", ".join(f"{n}: {d}" for n, d in devices.items()))
    return is_mx, devices["q"]


def _check_softmax_scale(softmax_scale) -> None:
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        if not formats.is_finite_number(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")


# ----------------------------------------------------------------------------------------------
# Operand preparation (Hopper operand format)
# ----------------------------------------------------------------------------------------------


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_mode: str = "rceil"):
    """MXFP8 q, k (blocked along the head dim) and v (blocked along the sequence): the forward's orientations."""
    return (
        formats.quantize_mxfp8(q, dim=3, scale_mode=scale_mode),
        formats.quantize_mxfp8(k, dim=3, scale_mode=scale_mode),
        formats.quantize_mxfp8(v, dim=1, scale_mode=scale_mode),
    )


def hopper_operands(qm: MXTensor, km: MXTensor, vm: MXTensor) -> tuple[RowScaledFP8, RowScaledFP8, RowScaledFP8]:
    """Re-express MX operands for the Hopper kernel: Q per (token, head), K per 128 keys, V per channel
    with channel-major data (DESIGN §3, formats.RowScaledFP8)."""
    qr = formats.to_row_scaled(qm)
    kr = formats.to_row_scaled(km, group_dim=1, group=K_EXP_GROUP)
    vr = formats.to_row_scaled(vm)
    vr = RowScaledFP8(formats.channel_major(vr.data), vr.exp, vr.dim)
    return qr, kr, vr


def _default_scale(D: int, softmax_scale) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)


# Float q, k, v up to this many elements together: the forward makes its operands in two launches
# (``forward_operands_triton``); above it, in the three single passes (four launches).  The fused first launch runs
# Q's tile with K's warps and registers: on the H200 (session 9, attn_fwd-...-s9.json against -s8.json) the public
# forward with it took 0.19 ms more at B2 H16 S8k d128 (1.61 -> 1.80 ms; 6.07 vs 5.73 ms at S16k, the FP8-operand
# kernel's rate unchanged), while host-bound calls gained (S2k 0.58 -> 0.22 ms).  2**25 keeps the fused launch up to
# B2 H16 S2k d128 (25M elements); MXATTN_FUSED_OPERANDS_MAX overrides it at each call (the bench's sweep).
FUSED_OPERANDS_MAX_ELEMS = 1 << 25


def _fused_operands_max() -> int:
    value = os.environ.get("MXATTN_FUSED_OPERANDS_MAX")
    if value is None:
        return FUSED_OPERANDS_MAX_ELEMS
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"MXATTN_FUSED_OPERANDS_MAX must be an integer (elements), got {value!r}") from None


def _hopper_forward_operands(q: Operand, k: Operand, v: Operand, scale_mode: str):
    """Float or MX inputs -> the forward's Hopper operands: Q, K hdim; V seq.  Float q, k, v: two launches for the
    three (``forward_operands_triton``) while they are small (``FUSED_OPERANDS_MAX_ELEMS``); larger float inputs
    and MX inputs: one Triton pass each (the same bytes)."""
    from mxattn.kernels.quantize import forward_operands_triton, row_scaled_triton

    if not isinstance(q, MXTensor) and q.numel() + k.numel() + v.numel() <= _fused_operands_max():
        return forward_operands_triton(q, k, v, scale_mode, k_group=K_EXP_GROUP)[:3]
    return (
        row_scaled_triton(q, "q", scale_mode=scale_mode),
        row_scaled_triton(k, "k", scale_mode=scale_mode, k_group=K_EXP_GROUP),
        row_scaled_triton(v, "v", scale_mode=scale_mode),
    )


def _reference_forward(q: Operand, k: Operand, v: Operand, causal: bool, scale: float, scale_mode: str, out_dtype):
    from mxattn import reference

    if not isinstance(q, MXTensor):
        q, k, v = quantize_qkv(q, k, v, scale_mode)
    out, lse = reference.attention_forward(
        q, k, v, causal=causal, softmax_scale=scale, quantize_p=True, dtype=torch.float32
    )
    return out.to(out_dtype), lse.to(torch.float32)


def has_fast_backward(device) -> bool:
    """Whether the backward runs a GPU kernel on this device (CPU tensors run the reference)."""
    return torch.device(device).type == "cuda"


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (what torch.compile sees): float tensors in, float tensors out
# ----------------------------------------------------------------------------------------------
#
# ``mxattn::attn_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, str scale_mode, bool deterministic,
#     str backend="auto") -> (Tensor out, Tensor lse)``
# ``mxattn::attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, float scale,
#     str scale_mode, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)``
#
# q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), one float dtype; out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq)
# float32, dq/dk/dv in q's dtype, all contiguous.  The FP8 operands (``RowScaledFP8``: data + int32 exponents)
# are made inside each op: dataclasses cannot cross the op boundary, and returning their tensors as extra outputs
# would make the schema depend on the layouts (channel-major padded buffers, grouped exponents).
# What the backward keeps: q, k, v (their float dtype), out and lse.  The backward op re-quantizes q, k, v in the
# five orientations it needs (Q, K, V along the head dim; Q, K along the sequence).  Trade-off against saving the
# FP8 operands made in the forward (the autograd.Function this replaced): memory 2 + 2 + 2 bytes per q/k/v
# element (bf16) against 1 + 1 + 1 + 1 + 1 (Q, K in two orientations, V along the head dim), i.e. +20% of the
# saved q/k/v bytes (the output and lse are saved by both); time: a training step runs eight O(S) quantize passes
# instead of six (the forward makes Q, K, V; the backward all five, so Q and K along the head dim twice), each a
# memory-bound read of one input, estimated at a few percent of an O(S^2) backward at S >= 4k (not measured).  An
# op returning the backward's operands could not tell whether a gradient will be asked for, so inference would
# pay for them; here the forward makes only what it uses.  Recomputing also lets the backward take Q with one
# exponent per 128 rows (``Q_EXP_GROUP``, the kernel's fast layout) instead of the forward's per-row Q.
# Eager autograd (``_EagerAttention``, which runs only when a gradient is wanted) does otherwise since session 8:
# its forward makes K and V in both orientations and saves the FP8 operands the backward needs (K hdim, K seq,
# V hdim: 3 bytes per k / v element pair, against bf16's 4) instead of k and v, so the backward quantizes only q
# and dO: fewer launches per step, which matters where the host bounds the step (S <= 4k).
# ``deterministic`` only affects the backward; the forward op takes it so that its autograd formula can pass it on.
# ``backend`` (a str with a default, so older 7-argument calls still bind) only picks the CUDA forward kernel; the
# backward op is the same for every backend (it re-quantizes the saved float q, k, v for the Hopper FP8 backward).
# MXTensor inputs do not go through the ops: they stay on the eager, forward-only ``_mx_forward`` below,
# which torch.compile traces like any Python code.


# The warp-specialized Gluon forward (kernels/attn_fwd_gluon.py) measured faster than the `tl` kernel on the H200 at
# d=128 from S = 8k (1.19-1.29x vs 1.13-1.20x cuDNN BF16, same run), and without a causal mask from S = 4k (682-688
# vs 656-666 TFLOP/s in sessions 8, 9 and 11, `attn_fwd-*-s{8,9,11}.json`); it is slower at d=64, at S 2k and causal
# at S 4k (510-513 vs 560-564) (docs/perf-notes-attn-fwd-gluon.md), so it took those shapes only.  Session 19 (H100,
# the persistent kernel with the row-wise output store, `attn_fwd_gluon_vs_tl-…-s19-*.json`): causal S 4k 631 against
# the `tl` kernel's 558 TFLOP/s, so causal calls take it from S 4k too; without a mask from S 2k (CUDA-graph replays
# 709 against 618, eager 697 against 607; causal S 2k stays on `tl`: eager 359 against 415, the Gluon launcher's
# host time shows in a 55 us kernel).  Session 24: the causal CTA order (kernels/cta_order.py) made both kernels
# faster on causal grids (tl 1.11x at d128 S 2k; causal Gluon launches now the per-block kernel with the order,
# 1.02x the persistent one at S 4k); the causal S 2k choice is not re-measured with both ordered.  Blackwell
# (compute capability 10.x) runs the block-scaled forward (kernels/attn_fwd_blockscaled.py: tl.dot_scaled on the
# MX operands, docs/blackwell.md).
# MXATTN_FWD_KERNEL=tl|gluon|blockscaled|auto overrides the automatic choice; the ``backend`` argument of
# ``mxfp8_attn_func`` overrides both.
GLUON_MIN_SEQ = 4096  # causal
GLUON_MIN_SEQ_NONCAUSAL = 2048
BACKENDS = ("auto", "hopper", "gluon", "blockscaled")
_BACKEND_KERNEL = {"hopper": "tl", "gluon": "gluon", "blockscaled": "blockscaled"}


def _check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return backend


def forward_kernel_for(q_shape, k_shape, device, backend: str = "auto", causal: bool = True) -> str:
    """"tl", "gluon" or "blockscaled": which forward kernel a CUDA call with these (B, S, H, D) shapes runs.

    ``backend`` other than "auto" decides ("hopper" is the `tl` kernel); with "auto", MXATTN_FWD_KERNEL
    (auto | tl | gluon | blockscaled) decides when set to a kernel; otherwise compute capability 10.x gets
    "blockscaled", 9.x "gluon" at d128 from S = 4k (``GLUON_MIN_SEQ``; from 2k without a causal mask,
    ``GLUON_MIN_SEQ_NONCAUSAL``) when Gluon imports, and "tl" below; anything else "tl".  ``causal`` defaults to
    the stricter rule, so a caller that does not say gets a kernel measured fast for either mask."""
    if _check_backend(backend) != "auto":
        return _BACKEND_KERNEL[backend]
    choice = os.environ.get("MXATTN_FWD_KERNEL", "auto")
    if choice not in ("auto", "tl", "gluon", "blockscaled"):
        raise ValueError(f"MXATTN_FWD_KERNEL must be auto, tl, gluon or blockscaled, got {choice!r}")
    if choice != "auto":
        return choice
    if torch.device(device).type != "cuda":
        return "tl"
    major = torch.cuda.get_device_capability(device)[0]
    if major == 10:
        return "blockscaled"
    if major != 9:
        return "tl"
    min_seq = GLUON_MIN_SEQ if causal else GLUON_MIN_SEQ_NONCAUSAL
    if q_shape[3] == 128 and min(q_shape[1], k_shape[1]) >= min_seq and _gluon_importable():
        return "gluon"
    return "tl"


@functools.lru_cache(maxsize=1)
def _gluon_importable() -> bool:
    """Gluon imports and this Triton is one the Gluon kernels were verified on (``kernels.gluon_verified``)."""
    from mxattn.kernels import gluon_verified

    if not gluon_verified():  # another Triton: Gluon's API moves between releases; the tl kernel covers all shapes
        return False
    try:
        importlib.import_module("mxattn.kernels.attn_fwd_gluon")
    except Exception:  # a triton without Gluon, or a Gluon API change: the tl kernel covers every shape
        return False
    return True


def _blockscaled_forward(q: Operand, k: Operand, v: Operand, causal: bool, scale: float, scale_mode: str, out_dtype):
    """CUDA forward on the MX operands themselves (``tl.dot_scaled``): float inputs are MXFP8-quantized in the forward
    orientations (q, k along D; v along S; one Triton pass each), MXTensor inputs go straight in."""
    from mxattn.kernels.attn_fwd_blockscaled import attn_fwd_blockscaled

    if not isinstance(q, MXTensor):
        from mxattn.kernels.quantize import quantize_mxfp8_triton

        q = quantize_mxfp8_triton(q, "hdim", scale_mode=scale_mode)
        k = quantize_mxfp8_triton(k, "hdim", scale_mode=scale_mode)
        v = quantize_mxfp8_triton(v, "seq", scale_mode=scale_mode)
    return attn_fwd_blockscaled(q, k, v, causal, scale, out_dtype)


def _hopper_forward(q: Operand, k: Operand, v: Operand, causal: bool, scale: float, scale_mode: str, out_dtype,
                    backend: str = "auto"):
    """CUDA forward with the kernel ``forward_kernel_for`` picks: the block-scaled one on the MX operands, or the
    Hopper ones on the Hopper operands (one Triton pass each)."""
    kernel = forward_kernel_for(q.shape, k.shape, q.device, backend, causal)
    if kernel == "blockscaled":
        return _blockscaled_forward(q, k, v, causal, scale, scale_mode, out_dtype)
    return _hopper_kernel(kernel, *_hopper_forward_operands(q, k, v, scale_mode), causal, scale, out_dtype)


def _hopper_kernel(kernel: str, qr, kr, vr, causal: bool, scale: float, out_dtype):
    """(out, lse) of the Hopper forward kernel ``kernel`` ("gluon" or "tl") on its operands."""
    if kernel == "gluon":
        from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon as fwd
    else:
        from mxattn.kernels.attn_fwd import attn_fwd_hopper as fwd
    return fwd(qr, kr, vr, causal=causal, softmax_scale=scale, out_dtype=out_dtype)


def _hopper_forward_keeping_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                               scale_mode: str, backend: str = "auto"):
    """The CUDA forward of a call whose gradient will be asked for: (out, lse, kv), where ``kv`` holds the backward's
    K and V operands (``_bwd_impl``'s K hdim, K seq, V hdim) made here from the same single read of k and of v that
    the forward's own K and V come from (``forward_operands_triton(keep_kv=True)``: two launches for all of them, bit
    for bit the separate passes), so that the backward does not read k and v again, and the FP8 operands
    (K in both orientations, V along the head dim: 3 bytes per k / v element pair against bf16's 4) are saved
    instead of k and v.  ``kv`` is None where the block-scaled kernel
    runs (its backward takes the float tensors)."""
    return _float_forward_cuda(q, k, v, causal, scale, scale_mode, backend, True)


def _fwd_impl(q, k, v, causal: bool, scale: float, scale_mode: str, backend: str = "auto"):
    if q.is_cuda:
        return _float_forward_cuda(q, k, v, causal, scale, scale_mode, backend, False)[:2]
    out, lse = _reference_forward(q, k, v, causal, scale, scale_mode, q.dtype)
    return out.contiguous(), lse.contiguous()


# Call plans of the float CUDA forward (session 22).  On the H200 machine's host a no-grad forward took ~290 us
# (tl kernel) of host time at B1 S128 (``scripts/host_timing.py``), against ~55 us of SDPA, and its Python ran
# ~3x slower than on the CPU harness's machine: each layer (the kernel choice, the operands' dispatch, two plan
# keys) cost what its Python costs.  A call plan is keyed once on everything those layers read (the inputs'
# shapes, strides, dtypes, devices and 16-byte alignment, the options, the current device and the module knobs and
# variables that choose a path or a launch) and calls the operands' plan (``quantize.forward_operands_plan``) and
# the kernel's launch plan (``attn_fwd.bound_plan`` / ``attn_fwd_gluon.plan_for``) directly: the same launches with
# the same arguments as the call that made it.  Made after the first call of a signature whose layers all made
# plans (fused operand launches, a plan-able kernel); ``False`` marks a signature that cannot have one.
_CALL_PLANS: dict = {}
_MAX_CALL_PLANS = 256
_KERNEL_MODULES: list = []


def _kernel_modules():
    """(launch, quantize, attn_fwd), imported on the first CUDA call."""
    if not _KERNEL_MODULES:
        from mxattn.kernels import attn_fwd, launch, quantize

        _KERNEL_MODULES.extend((launch, quantize, attn_fwd))
    return _KERNEL_MODULES


def _call_key(q, k, v, causal, scale, scale_mode, backend, keep_kv):
    """The call plan table's key, or None where call plans are off (``MXATTN_LAUNCH_PLANS=0``, quantize tile
    overrides)."""
    launch, quantize, attn_fwd = _kernel_modules()
    if not launch.PLANS or quantize.TILE_OVERRIDES:
        return None
    gluon = sys.modules.get("mxattn.kernels.attn_fwd_gluon")
    env = os.environ
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, launch.current_device() if q.is_cuda else -1, q.data_ptr() & 15,
            k.data_ptr() & 15, v.data_ptr() & 15, causal, scale, scale_mode, backend, keep_kv,
            env.get("MXATTN_FWD_KERNEL"), env.get("MXATTN_FUSED_OPERANDS_MAX"), GLUON_MIN_SEQ, GLUON_MIN_SEQ_NONCAUSAL,
            quantize._knobs(), attn_fwd.EXP2_FMA_DEFAULT, launch.CAUSAL_LPT,
            gluon and (gluon.PERSISTENT_DEFAULT, gluon.MASK_DEFAULT))


class _ForwardCall:
    """One signature's float CUDA forward as its first call ran it: the operands' plan, then the kernel's."""

    __slots__ = ("operands", "run", "plan", "out_dtype")

    def __init__(self, operands, run, plan, out_dtype):
        self.operands, self.run, self.plan, self.out_dtype = operands, run, plan, out_dtype

    def __call__(self, q, k, v):
        qr, kr, vr, kv = self.operands(q, k, v)
        out, lse = self.run(self.plan, qr, kr, vr, self.out_dtype)
        return out, lse, kv


def _make_call_plan(q, k, v, operands, kernel: str, causal: bool, scale: float, scale_mode: str, keep_kv: bool):
    """The ``_ForwardCall`` of the call that just ran (``operands`` its (qr, kr, vr)), or None where one of its
    layers made no plan (unfused operand passes, an input copied for its strides, a kernel plan not made)."""
    _, quantize, _ = _kernel_modules()
    ops = quantize.forward_operands_plan(q, k, v, scale_mode, K_EXP_GROUP, keep_kv)
    if ops is None:
        return None
    if kernel == "gluon":
        from mxattn.kernels.attn_fwd_gluon import plan_for, run_plan as run
    else:
        from mxattn.kernels.attn_fwd import bound_plan as plan_for, run_bound as run
    plan = plan_for(*operands, causal, scale, q.dtype)
    return None if plan is None else _ForwardCall(ops, run, plan, q.dtype)


def _float_forward_cuda(q, k, v, causal: bool, scale: float, scale_mode: str, backend: str, keep_kv: bool):
    """The CUDA forward of float inputs: (out, lse, kv), ``kv`` as ``_hopper_forward_keeping_kv`` describes with
    ``keep_kv`` (else None).  A signature seen before runs its call plan."""
    key = _call_key(q, k, v, causal, scale, scale_mode, backend, keep_kv)
    plan = _CALL_PLANS.get(key) if key is not None else None
    if plan:
        return plan(q, k, v)
    kernel = forward_kernel_for(q.shape, k.shape, q.device, backend, causal)
    if kernel == "blockscaled":
        out, lse = _blockscaled_forward(q, k, v, causal, scale, scale_mode, q.dtype)
        return out, lse, None
    kv = None
    if keep_kv:
        from mxattn.kernels.quantize import forward_operands_triton

        qr, kr, vr, kv = forward_operands_triton(q, k, v, scale_mode, k_group=K_EXP_GROUP, keep_kv=True)
    else:
        qr, kr, vr = _hopper_forward_operands(q, k, v, scale_mode)
    out, lse = _hopper_kernel(kernel, qr, kr, vr, causal, scale, q.dtype)
    if key is not None and plan is None:
        if len(_CALL_PLANS) >= _MAX_CALL_PLANS:
            _CALL_PLANS.clear()
        _CALL_PLANS[key] = _make_call_plan(q, k, v, (qr, kr, vr), kernel, causal, scale, scale_mode, keep_kv) or False
    return out, lse, kv


@torch.library.custom_op("mxattn::attn_fwd", mutates_args=())
def attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, scale_mode: str,
    deterministic: bool, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 attention forward on float (B, S, H, D) tensors: out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) fp32.
    ``backend``: the CUDA forward kernel (``forward_kernel_for``); CPU tensors run the reference whatever it says.
    Unchecked: ``mxfp8_attn_func`` validates the arguments before calling it."""
    return _fwd_impl(q, k, v, causal, scale, scale_mode, backend)


@attn_fwd_op.register_fake
def _attn_fwd_fake(q, k, v, causal, scale, scale_mode, deterministic, backend="auto"):
    B, Sq, Hq, D = q.shape
    return q.new_empty(B, Sq, Hq, D), q.new_empty(B, Hq, Sq, dtype=torch.float32)


def _blockscaled_backward(dout, q, k, v, out, lse, causal: bool, scale: float, scale_mode: str,
                          grad_dtype: Optional[torch.dtype] = None):
    """CUDA backward on ``tl.dot_scaled`` (kernels/attn_bwd_blockscaled.py): Q and K quantized in both orientations
    from one read each, V along the head dim; dO is quantized by the launcher.  Native block-scaled MMA on
    Blackwell; on Hopper Triton upcasts to bf16 (correct, slow)."""
    from mxattn.kernels.attn_bwd_blockscaled import attn_bwd_blockscaled
    from mxattn.kernels.quantize import quantize_mxfp8_triton

    qh, qs = quantize_mxfp8_triton(q, "both", scale_mode=scale_mode)
    kh, ks = quantize_mxfp8_triton(k, "both", scale_mode=scale_mode)
    vh = quantize_mxfp8_triton(v, "hdim", scale_mode=scale_mode)
    return attn_bwd_blockscaled(qh, kh, vh, qs, ks, out, dout.contiguous(), lse, causal=causal, softmax_scale=scale,
                                grad_dtype=grad_dtype or q.dtype)


def _bwd_impl(dout, q, k, v, out, lse, causal: bool, scale: float, scale_mode: str, deterministic: bool,
              backend: str = "auto", kv=None, grad_dtype: Optional[torch.dtype] = None):
    """Gradients on float q, k, v, in ``grad_dtype`` (default q's dtype); ``kv``: the K hdim, K seq and V hdim
    operands the forward kept (``_hopper_forward_keeping_kv``), in which case k and v are not read (they may be
    None)."""
    grad_dtype = grad_dtype or q.dtype
    if kv is not None and not q.is_cuda:
        raise RuntimeError("kept K/V operands come from the CUDA forward only")
    if kv is None and q.is_cuda and forward_kernel_for(q.shape, k.shape, q.device, backend) == "blockscaled":
        return _blockscaled_backward(dout, q, k, v, out, lse, causal, scale, scale_mode, grad_dtype)
    if q.is_cuda:
        key = None
        if kv is not None:
            key = _bwd_call_key(dout, q, out, lse, kv, causal, scale, scale_mode, deterministic, backend, grad_dtype)
            plan = _BWD_CALL_PLANS.get(key) if key is not None else None
            if plan:
                return plan(dout, q, out, lse, kv)
        from mxattn.kernels.attn_bwd import DO_EXP_GROUP, Q_EXP_GROUP, attn_bwd_hopper
        from mxattn.kernels.quantize import row_scaled_triton, row_scaled_triton_both, row_scaled_triton_both_pair

        dout = dout.contiguous()
        doh = dos = None
        if formats.ScaleMode.parse(scale_mode) is formats.ScaleMode.RCEIL and dout.dtype == q.dtype \
                and DO_EXP_GROUP == Q_EXP_GROUP:
            # Q and dO (whose quantization is RCEIL) in both orientations: two launches for the four operands
            (qr, q_seq), (doh, dos) = row_scaled_triton_both_pair(q, dout, scale_mode, k_group=Q_EXP_GROUP)
        else:  # Q in both orientations from one read (attn_bwd_hopper quantizes dO)
            qr, q_seq = row_scaled_triton_both(q, scale_mode, k_group=Q_EXP_GROUP)
        if kv is None:
            kr, k_seq = row_scaled_triton_both(k, scale_mode, k_group=K_EXP_GROUP)
            v_hdim = row_scaled_triton(v, "k", scale_mode=scale_mode, k_group=K_EXP_GROUP)
        else:
            kr, k_seq, v_hdim = kv
        grads = attn_bwd_hopper(
            qr, kr, v_hdim, q_seq, k_seq, out, dout, lse, causal=causal, softmax_scale=scale,
            deterministic=deterministic, grad_dtype=grad_dtype, dout_hdim=doh, dout_seq=dos,
        )
        if key is not None and plan is None:
            if len(_BWD_CALL_PLANS) >= _MAX_CALL_PLANS:
                _BWD_CALL_PLANS.clear()
            _BWD_CALL_PLANS[key] = _make_bwd_call_plan(q, dout, out, lse, kv, (qr, q_seq, doh, dos), causal, scale,
                                                       scale_mode, deterministic, grad_dtype) or False
        return grads
    from mxattn import reference

    qm, km, vm = quantize_qkv(q, k, v, scale_mode)
    grads = reference.attention_backward(
        qm, km, vm, out, dout, causal=causal, softmax_scale=scale,
        quantize_p=True, quantize_ds=True, quantize_do=True, dtype=torch.float32,
        q_seq=formats.quantize_mxfp8(q, dim=1, scale_mode=scale_mode),
        k_seq=formats.quantize_mxfp8(k, dim=1, scale_mode=scale_mode),
        v_hdim=formats.quantize_mxfp8(v, dim=3, scale_mode=scale_mode),
    )
    return tuple(g.to(grad_dtype).contiguous() for g in grads)


# Call plans of the eager CUDA backward (session 22), as the forward's (``_CALL_PLANS``): keyed once on everything
# ``_bwd_impl`` and ``attn_bwd_hopper`` read (dO's, q's, out's and lse's signatures, the kept K / V operands' layouts,
# the options, the current device, the variables that choose the backward's kernels and builds), they call the
# Q / dO pair's plan (``quantize.both_pair_plan``) and the Gluon backward's plan (``attn_bwd._run_gluon_plan``)
# directly.  Made where the backward ran the pair and a Gluon plan (the eager path, which keeps K and V).
_BWD_CALL_PLANS: dict = {}


def _bwd_call_key(dout, q, out, lse, kv, causal, scale, scale_mode, deterministic, backend, grad_dtype):
    launch, quantize, _ = _kernel_modules()
    if not launch.PLANS or quantize.TILE_OVERRIDES or type(dout) is not torch.Tensor:
        return None
    from mxattn.kernels.attn_bwd import _rs_sig

    sig, env = launch.tensor_sig, os.environ
    return (sig(dout), sig(q), sig(out), sig(lse), dout.device, q.device, out.device, lse.device,
            tuple(_rs_sig(t) for t in kv), launch.current_device(), causal, scale, scale_mode, deterministic, backend,
            grad_dtype, env.get("MXATTN_BWD_KERNEL"), env.get("MXATTN_BWD_GLUON_SPLIT"), env.get("MXATTN_BWD_FUSED_DQ"),
            env.get("MXATTN_BWD_PERSISTENT"), env.get("MXATTN_FWD_KERNEL"), quantize._knobs())


class _BackwardCall:
    """One signature's eager CUDA backward as its first call ran it: the Q / dO pair's plan, then the Gluon
    backward's."""

    __slots__ = ("pair", "run", "plan")

    def __init__(self, pair, run, plan):
        self.pair, self.run, self.plan = pair, run, plan  # run: ``attn_bwd._run_gluon_plan``

    def __call__(self, dout, q, out, lse, kv):
        dout = dout.contiguous()  # (as ``_bwd_impl``; the key holds the given dO's strides)
        (qr, q_seq), (doh, dos) = self.pair(q, dout)
        kr, k_seq, v_hdim = kv
        return self.run(self.plan, qr, kr, v_hdim, q_seq, k_seq, out, dout, lse, doh, dos, False)


def _make_bwd_call_plan(q, dout, out, lse, kv, operands, causal, scale, scale_mode, deterministic, grad_dtype):
    """The ``_BackwardCall`` of the backward that just ran (``operands``: its qr, q_seq, doh, dos; None where dO
    took another path than the pair), or None where a layer made no plan (dO or q copied for their strides, the
    ``tl`` kernels, a config the Gluon plans do not take)."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels.quantize import both_pair_plan

    qr, q_seq, doh, dos = operands
    if doh is None:
        return None
    pair = both_pair_plan(q, dout, scale_mode, attn_bwd.Q_EXP_GROUP)
    if pair is None or attn_bwd.backward_kernel(q.device) != "gluon":
        return None
    kr, k_seq, v_hdim = kv
    key = attn_bwd._gluon_plan_key(qr, kr, v_hdim, q_seq, k_seq, out, dout, lse, doh, dos, causal, scale,
                                   deterministic, grad_dtype, False)
    plan = attn_bwd._GLUON_PLANS.get(key) if key is not None else None
    return None if plan is None else _BackwardCall(pair, attn_bwd._run_gluon_plan, plan)


@torch.library.custom_op("mxattn::attn_bwd", mutates_args=())
def attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float, scale_mode: str, deterministic: bool, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of ``attn_fwd`` in q's dtype (dk, dv summed over each kv head's query heads).
    ``backend`` as the forward's: "blockscaled" (explicit, or "auto" on compute capability 10.x) runs the
    ``tl.dot_scaled`` backward; every other choice the Hopper FP8 backward (``deterministic`` applies to it)."""
    return _bwd_impl(dout, q, k, v, out, lse, causal, scale, scale_mode, deterministic, backend)


@attn_bwd_op.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, causal, scale, scale_mode, deterministic, backend="auto"):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def _attn_fwd_setup_context(ctx, inputs, output, save: bool = True):
    q, k, v, causal, scale, scale_mode, deterministic, backend = inputs  # the backward re-quantizes q, k, v
    out, lse = output
    ctx.causal, ctx.scale, ctx.scale_mode, ctx.deterministic = causal, scale, scale_mode, deterministic
    ctx.backend = backend
    if save:
        ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


def _attn_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd_op(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.scale_mode, ctx.deterministic,
                             ctx.backend)
    return dq, dk, dv, None, None, None, None, None


attn_fwd_op.register_autograd(_attn_fwd_backward, setup_context=_attn_fwd_setup_context)


def _channel_major_buffer_of(seq_data: torch.Tensor) -> torch.Tensor:
    """The (B, H, D, S_pad) buffer behind a seq operand's (B, S, H, D) view (``quantize._seq_view``): unit stride
    along S, S_pad = the stride along D; the view's own allocation, so storage offset 0."""
    B, S, H, D = seq_data.shape
    s_pad = seq_data.stride(3)
    want = (H * D * s_pad, 1, D * s_pad, s_pad)
    if seq_data.storage_offset() != 0 or (B * S * H * D and tuple(seq_data.stride()) != want):
        raise RuntimeError(f"a seq operand's data must be the view of a fresh channel-major buffer, got strides "
                           f"{seq_data.stride()} (offset {seq_data.storage_offset()})")
    return seq_data.as_strided((B, H, D, s_pad), (H * D * s_pad, D * s_pad, s_pad, 1))


class _EagerAttention(torch.autograd.Function):
    """The eager path of ``attn_fwd_op`` + its autograd formula, without the custom-op dispatch.

    Measured on the H200 (scripts/host_timing.py, commit 805a087): going through ``torch.library`` costs ~280 us
    of host time per forward and ~400 us per backward on top of the kernels' launches, which made small calls
    (S <= 2k) host-bound.  Eager calls take this Function (same implementation functions); torch.compile
    (``torch.compiler.is_compiling()``) keeps tracing the custom ops.

    On CUDA the forward also keeps the backward's K and V operands (``_hopper_forward_keeping_kv``: this Function
    runs only when a gradient is wanted) and saves them in place of k and v."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, scale_mode, deterministic, backend, mx_kv_grads=None):
        ctx.set_materialize_grads(False)  # lse has no gradient: no zero tensor (and fill launch) made for it
        ctx.mx_kv_grads = mx_kv_grads
        kv = None
        if q.is_cuda:
            out, lse, kv = _hopper_forward_keeping_kv(q, k, v, causal, scale, scale_mode, backend)
        else:
            out, lse = _fwd_impl(q, k, v, causal, scale, scale_mode, backend)
        _attn_fwd_setup_context(ctx, (q, k, v, causal, scale, scale_mode, deterministic, backend), (out, lse),
                                save=kv is None)
        ctx.kv_meta = None
        if kv is not None:  # the FP8 operands instead of k and v: 3 bytes per (k, v) element pair against bf16's 4
            kr, k_seq, v_hdim = kv
            ctx.kv_meta = (kr.group, k_seq.data.shape[1])
            # K seq as its whole channel-major buffer, a contiguous tensor: a saved-tensor hook that copies
            # (save_on_cpu, offloading) keeps its layout, where a copy of the (B, S, H, D) view would not
            ctx.save_for_backward(q, out, lse, kr.data, kr.exp, _channel_major_buffer_of(k_seq.data), k_seq.exp,
                                  v_hdim.data, v_hdim.exp)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if ctx.kv_meta is None:
            q, k, v, out, lse = ctx.saved_tensors
            kv = None
        else:
            from mxattn.kernels.quantize import _trusted_row_scaled

            q, out, lse, kd, ke, ks_buf, kse, vd, ve = ctx.saved_tensors
            k = v = None
            group, Sk = ctx.kv_meta
            ks_data = ks_buf[..., :Sk].permute(0, 3, 1, 2)  # the (B, S, H, D) view of the channel-major buffer
            # the forward's own operands, checked when they were made: rebuilt without RowScaledFP8's checks
            kv = (_trusted_row_scaled(kd, ke, 3, 1, group), _trusted_row_scaled(ks_data, kse, 1),
                  _trusted_row_scaled(vd, ve, 3, 1, group))
        if dout is None:  # (an undefined gradient of out: not materialized since set_materialize_grads(False))
            dout = torch.zeros_like(out)
        sink = ctx.mx_kv_grads
        # dK / dV wanted as MXFP8: the kernels' fp32 gradients, quantized once (no bf16 rounding in between)
        dq, dk, dv = _bwd_impl(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.scale_mode, ctx.deterministic,
                               ctx.backend, kv, grad_dtype=None if sink is None else torch.float32)
        if sink is not None:
            sink._fill(dk, dv)
            dq = dq.to(q.dtype)
            dk, dv = (dk.to(q.dtype), dv.to(q.dtype)) if sink.keep_float_grads else (None, None)
        return (dq, dk, dv, None, None, None, None, None, None)


def _attn_fwd(q, k, v, causal: bool, scale: float, scale_mode: str, deterministic: bool, backend: str,
              mx_kv_grads: Optional["MXKVGrads"] = None):
    """``attn_fwd_op`` under torch.compile, ``_EagerAttention`` otherwise (same results, less host time)."""
    if torch.compiler.is_compiling():
        if mx_kv_grads is not None:
            raise RuntimeError("mx_kv_grads is not supported under torch.compile (the custom op's backward returns "
                               "float gradients); call the layer eagerly or leave mx_kv_grads=None")
        return attn_fwd_op(q, k, v, causal, scale, scale_mode, deterministic, backend)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _EagerAttention.apply(q, k, v, causal, scale, scale_mode, deterministic, backend, mx_kv_grads)
    return _fwd_impl(q, k, v, causal, scale, scale_mode, backend)


class MXKVGrads:
    """Receives dK and dV as MXFP8 when the backward of ``mxfp8_attn_func(..., mx_kv_grads=this)`` runs: the input
    a following MX weight-gradient GEMM takes, with no bf16 gradient in between.

    orientations: ``"seq"`` (default: blocks of 32 tokens along the sequence, dim 1 of (B, Sk, Hkv, D), the
        contraction of the K / V projections' weight gradient dW = dKᵀ X), ``"hdim"`` (blocks along the head dim,
        dim 3: the input gradient dX = dK W) or ``"both"`` (a ``(hdim, seq)`` pair each).
    scale_mode: ``"rceil"`` (default) or ``"floor"``, as ``quantize_mxfp8``.
    keep_float_grads: also return dK / dV to autograd in k's dtype (so ``k.grad`` / ``v.grad`` and the producers
        of k and v get them as usual).  Default False: autograd gets no gradient for k and v, which is the point
        of asking for MXFP8 ones; ``k.grad`` stays None and nothing flows to k's producers.  dQ always flows.

    After each backward, ``dk`` and ``dv`` hold ``MXTensor``s (B, Sk, Hkv, D), summed over each kv head's query
    heads, equal bit for bit to ``quantize_mxfp8`` of the backward's fp32 dK / dV along the orientation's dim; a
    second backward through the same graph overwrites them.  They stay None until a backward runs (no_grad calls,
    inputs that need no gradient).  One instance per attention call of a step.  Eager mode only (a RuntimeError
    under torch.compile); dense calls only (not ``mxfp8_attn_varlen_func``)."""

    def __init__(self, orientations: str = "seq", scale_mode: str = "rceil", keep_float_grads: bool = False):
        if orientations not in ("seq", "hdim", "both"):
            raise ValueError(f"orientations must be 'seq', 'hdim' or 'both', got {orientations!r}")
        formats.ScaleMode.parse(scale_mode)  # ValueError on anything else
        if not isinstance(keep_float_grads, bool):
            raise TypeError(f"keep_float_grads must be a bool, got {type(keep_float_grads).__name__}")
        self.orientations, self.scale_mode, self.keep_float_grads = orientations, scale_mode, keep_float_grads
        self.dk = self.dv = None

    def clear(self) -> None:
        self.dk = self.dv = None

    def _quantize(self, g: torch.Tensor):
        if g.is_cuda:
            from mxattn.kernels.quantize import quantize_mxfp8_triton

            return quantize_mxfp8_triton(g, self.orientations, scale_mode=self.scale_mode)
        if self.orientations == "both":
            return (formats.quantize_mxfp8(g, dim=3, scale_mode=self.scale_mode),
                    formats.quantize_mxfp8(g, dim=1, scale_mode=self.scale_mode))
        return formats.quantize_mxfp8(g, dim=1 if self.orientations == "seq" else 3, scale_mode=self.scale_mode)

    def _fill(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.dk, self.dv = self._quantize(dk), self._quantize(dv)

    def __repr__(self) -> str:
        got = "empty" if self.dk is None else "filled"
        return (f"MXKVGrads(orientations={self.orientations!r}, scale_mode={self.scale_mode!r}, "
                f"keep_float_grads={self.keep_float_grads}, {got})")


def _mx_forward(qkv_mx: tuple[MXTensor, MXTensor, MXTensor], causal: bool, scale: float, scale_mode: str,
                backend: str = "auto"):
    """Forward of MXFP8 attention on MXTensor inputs (the eager path; float inputs go through ``attn_fwd_op``).
    Forward-only: an MXTensor carries no gradient (``producers`` attaches its own straight-through carriers)."""
    if qkv_mx[0].data.is_cuda:
        return _hopper_forward(*qkv_mx, causal, scale, scale_mode, torch.bfloat16, backend)
    return _reference_forward(*qkv_mx, causal, scale, scale_mode, torch.bfloat16)


def _carries_grad(ts) -> bool:
    """Whether an MX operand sits in the autograd graph (a producer's ``GradMXTensor`` whose carrier needs grad)."""
    if not torch.is_grad_enabled():
        return False
    return any(getattr(t, "carrier", None) is not None and t.carrier.requires_grad for t in ts)


def mxfp8_attn_func(
    q: Operand,
    k: Operand,
    v: Operand,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    scale_mode: str = "rceil",
    deterministic: bool = False,
    backend: str = "auto",
    mx_kv_grads: Optional[MXKVGrads] = None,
):
    """MXFP8 attention, ``flash_attn_func`` conventions.

    Args:
        q: (B, Sq, Hq, D) bfloat16/float16/float32, or an ``MXTensor`` blocked along the head dim (dim 3).
        k: (B, Sk, Hkv, D), same kind as q; MXTensor blocked along the head dim (dim 3).
        v: (B, Sk, Hkv, D), same kind as q; MXTensor blocked along the sequence (dim 1).
        causal: mask aligned to the bottom-right corner when Sq != Sk (query i sees key j iff j <= i + Sk - Sq).
        softmax_scale: defaults to 1/sqrt(D).
        return_lse: also return the log-sum-exp, (B, Hq, Sq) float32 (natural log; -inf for empty rows).
        scale_mode: MX scale rule for float inputs, "rceil" (default) or "floor".
        deterministic: backward without float atomics (bit-identical gradients over runs, a little slower).
        backend: the CUDA forward kernel: "auto" (default: ``forward_kernel_for`` — MXATTN_FWD_KERNEL if set, else
            "blockscaled" on compute capability 10.x, the Gluon or `tl` Hopper kernel on 9.x), "hopper" (the `tl`
            kernel on row-scaled FP8 operands), "gluon" (the warp-specialized Hopper kernel) or "blockscaled"
            (``tl.dot_scaled`` on the MX operands: native block-scaled MMA on Blackwell; correct but slow on Hopper,
            where Triton upcasts to bf16).  Any other value raises ValueError.  CPU tensors run the reference
            whatever the backend.  The backward follows it: "blockscaled" runs the ``tl.dot_scaled`` backward
            (kernels/attn_bwd_blockscaled.py), the others the Hopper FP8 backward; both re-quantize the saved
            float q, k, v.
        mx_kv_grads: an ``MXKVGrads`` that receives dK and dV as MXFP8 when the backward runs (for an MX
            weight-gradient GEMM); then k and v get no float gradient unless it was made with
            ``keep_float_grads=True``.  Eager mode, float inputs or producers' MX inputs.

    Float inputs are quantized to MXFP8 on the way in (q, k along D, v along S); MXTensor inputs are the
    end-to-end path.  Hq must be a multiple of Hkv (GQA/MQA); D in {64, 128}.  Returns the output in q's
    dtype (bfloat16 for MXTensor inputs).  CUDA tensors run the FP8 kernel ``backend`` picks; CPU tensors run the
    reference with the same semantics (P quantized to e4m3 with the constant scale 2^-8).
    Gradients flow to float q, k, v through ``loss.backward()`` (FP8 backward kernel on CUDA; all five
    products in FP8, dO and dS quantized, DESIGN §1 table).  MXTensor inputs made by mxattn's producers
    (``rmsnorm_quant``, ``linear_quant``, ``qkv_proj`` on inputs that need grad: ``GradMXTensor``) are
    differentiable too: the gradients reach the producers' inputs (straight-through through the quantization);
    this path passes through the float op (one dequantize and one quantize pass per operand, same forward result).
    A plain ``MXTensor`` carries no gradient.

    ``torch.compile(fullgraph=True)`` traces float inputs: the checks run at trace time and the attention is the
    custom op ``mxattn::attn_fwd`` (backward ``mxattn::attn_bwd``, which re-quantizes the saved q, k, v).  MXTensor
    inputs do not use the ops (the dataclass cannot cross an op boundary): torch.compile traces the eager code
    inside instead (checked on the CPU reference, fullgraph too; not checked on CUDA, where it meets Triton launches).
    """
    is_mx, _ = _check_attention_inputs(q, k, v, softmax_scale)
    backend = _check_backend(backend)
    if mx_kv_grads is not None and not isinstance(mx_kv_grads, MXKVGrads):
        raise TypeError(f"mx_kv_grads must be an mxattn.MXKVGrads or None, got {type(mx_kv_grads).__name__}")
    mode = formats.ScaleMode.parse(scale_mode).value
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    D = q.shape[3]
    scale = _default_scale(D, softmax_scale)
    if is_mx and _carries_grad((q, k, v)):
        # MXFP8 inputs in the autograd graph (producers' GradMXTensor): their values, dequantized with a
        # straight-through gradient to the producer, go through the float op.  Its forward re-quantizes them to the
        # same MXFP8 bytes (an MX-dequantized block's maximum is 2^e * m with 224 < m <= 448, so RCEIL picks e again
        # and every element is already on that grid), so the forward equals the MX path, and the backward runs
        # the FP8 backward kernel from those values.
        qf, kf, vf = (t.dequantize(torch.bfloat16) for t in (q, k, v))
        out, lse = _attn_fwd(qf, kf, vf, causal, scale, mode, deterministic, backend, mx_kv_grads)
    elif is_mx:
        out, lse = _mx_forward((q, k, v), causal, scale, scale_mode, backend)
    else:
        out, lse = _attn_fwd(q, k, v, causal, scale, mode, deterministic, backend, mx_kv_grads)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Jagged batches (packed (T, H, D) with cu_seqlens), flash_attn_varlen_func conventions
# ----------------------------------------------------------------------------------------------


# Host values and device copies of the last CU_CACHE_SIZE cu_seqlens tensors, by identity: id -> (weak reference,
# version counter, device, host values, device copy or None for the tensor itself).  The jagged API checks cu_seqlens
# on the host before any launch; for a GPU tensor that read-back is a device sync, once per layer of a packed
# training step that passes one cu_seqlens to every layer.  A tensor written in place through torch has a new
# ``_version`` and is read again; a write torch does not see (through ``.numpy()`` or a raw pointer) is not seen.
CU_CACHE_SIZE = 8
_CU_CACHE: collections.OrderedDict = collections.OrderedDict()


def _cu_host_and_device(cu: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``cu`` (1-D int32) on ``device``, contiguous, and its values on the host: from ``_CU_CACHE`` when this very
    tensor, unmodified, was seen for ``device`` (no read-back, no copy), else read (one device-to-host copy for a GPU
    tensor) and kept.  A CPU tensor goes to a GPU through pinned memory, ``non_blocking`` (no sync).  Inference
    tensors (no version counter) are read every call."""
    try:
        version = cu._version
    except RuntimeError:  # an inference-mode tensor: no version counter, so nothing can be kept for it
        version = None
    entry = _CU_CACHE.get(id(cu)) if version is not None else None
    if entry is not None and entry[0]() is cu and entry[1] == version and entry[2] == device:
        _CU_CACHE.move_to_end(id(cu))
        return (cu if entry[4] is None else entry[4]), entry[3]
    host = cu.tolist()
    if cu.device == device:
        on_device = cu.contiguous()
    elif cu.device.type == "cpu" and device.type == "cuda":
        on_device = cu.contiguous().pin_memory().to(device, non_blocking=True)
    else:
        on_device = cu.to(device).contiguous()
    if version is not None:
        _CU_CACHE[id(cu)] = (weakref.ref(cu), version, device, host, None if on_device is cu else on_device)
        _CU_CACHE.move_to_end(id(cu))
        while len(_CU_CACHE) > CU_CACHE_SIZE:
            _CU_CACHE.popitem(last=False)
    return on_device, host


def _check_cu_seqlens(cu, name: str, total: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``cu`` on ``device`` and its values on the host (``_cu_host_and_device``: at most one device-to-host copy, the
    only sync of the call, and none for a tensor seen unmodified before), every value checked on every call."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {tuple(cu.shape)}")
    if cu.device.type not in ("cpu", device.type):
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    on_device, c = _cu_host_and_device(cu, device)
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}")
    bad = next((i for i in range(len(c) - 1) if c[i + 1] < c[i]), None)
    if bad is not None:
        raise ValueError(f"{name} must not decrease, got {c[bad]} then {c[bad + 1]} at entries {bad}, {bad + 1}")
    if c[-1] != total:
        raise ValueError(f"{name} must end at the number of packed tokens {total}, got {c[-1]}")
    return on_device, c


def _check_max_seqlen(m, name: str, cu: list[int], cu_name: str) -> int:
    """Check ``m`` against the sequences of ``cu`` (host values); returns the bound the kernels get: the longest
    sequence (at least 1 where ``m`` is), so that a generous ``m`` sizes no idle programs and no oversized grid."""
    if isinstance(m, bool) or not isinstance(m, int):
        raise TypeError(f"{name} must be an int, got {type(m).__name__}")
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if m < longest:
        raise ValueError(f"{name}={m} is less than the longest sequence in {cu_name} ({longest})")
    return max(longest, min(m, 1))


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    """Validate a jagged call; returns cu_seqlens_q and cu_seqlens_k on q's device and the max_seqlen_q,
    max_seqlen_k the kernels get (``_check_max_seqlen``)."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, MXTensor):
            raise TypeError(f"{n}: mxfp8_attn_varlen_func takes float tensors (MXTensor inputs are not supported for "
                            "jagged batches yet)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{n} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.ndim != 3:
            raise ValueError(f"{n} must have shape (total_tokens, nheads, headdim), got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {n: t.device for n, t in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) != 1:
        raise ValueError("q, k, v must be on one device, got " + ", ".join(f"{n}: {d}" for n, d in devices.items()))
    Tq, Tk = q.shape[0], k.shape[0]
    _check_heads(q.shape, k.shape, v.shape)
    _check_softmax_scale(softmax_scale)
    cu_q, cq = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", Tq, q.device)
    cu_k, ck = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", Tk, q.device)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}")
    mq = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", cq, "cu_seqlens_q")
    mk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", ck, "cu_seqlens_k")
    return cu_q, cu_k, mq, mk


def _varlen_mx_values(q, k, v, cu_k, scale_mode: str):
    """What the jagged forward computes on: q, k MXFP8 along the head dim; v along each sequence (blocks from its
    first key, values dequantized)."""
    from mxattn.kernels.varlen import seq_mx_dequantized

    return (
        formats.quantize_mxfp8(q, dim=2, scale_mode=scale_mode),
        formats.quantize_mxfp8(k, dim=2, scale_mode=scale_mode),
        seq_mx_dequantized(v, cu_k, scale_mode),
    )


class _MXFP8VarlenAttention(torch.autograd.Function):
    """Forward and backward of jagged MXFP8 attention.  CUDA: the Hopper kernels (forward ``attn_fwd_hopper_varlen``,
    backward ``attn_bwd_hopper_varlen``, operands re-quantized from the saved q, k, v as the dense backward does: on
    Hopper the Gluon backward kernels' jagged mode (deterministic), else the ``tl`` kernels with ``VARLEN=True``, dQ
    by fp32 atomics or by the deterministic kernel when ``torch.are_deterministic_algorithms_enabled()``).  CPU: the
    reference (FP8 emulation of P, dS, dO in fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, scale_mode):
        ctx.set_materialize_grads(False)  # lse has no gradient: no zero tensor (and fill launch) made for it
        ctx.causal, ctx.scale, ctx.scale_mode = causal, scale, scale_mode
        ctx.max_q, ctx.max_k = max_q, max_k
        if q.is_cuda:
            from mxattn.kernels.attn_fwd import attn_fwd_hopper_varlen
            from mxattn.kernels.varlen import varlen_operands

            ops = varlen_operands(q, k, v, cu_q, cu_k, max_q, max_k, scale_mode)
            out, lse = attn_fwd_hopper_varlen(*ops, causal=causal, softmax_scale=scale, out_dtype=q.dtype)
        else:
            from mxattn import reference

            out, lse = reference.attention_forward(
                *_varlen_mx_values(q, k, v, cu_k, scale_mode), causal=causal, softmax_scale=scale,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, quantize_p=True, dtype=torch.float32,
            )
            out, lse = out.to(q.dtype), lse.to(torch.float32)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
        mode = ctx.scale_mode
        if dout is None:  # (an undefined gradient of out: not materialized since set_materialize_grads(False))
            dout = torch.zeros_like(out)
        if q.is_cuda:
            from mxattn.kernels.attn_bwd import attn_bwd_hopper_varlen
            from mxattn.kernels.varlen import varlen_bwd_operands

            ops = varlen_bwd_operands(q, k, v, cu_q, cu_k, ctx.max_q, ctx.max_k, mode)
            dq, dk, dv = attn_bwd_hopper_varlen(
                *ops, out, dout.contiguous(), lse, causal=ctx.causal, softmax_scale=ctx.scale,
                deterministic=torch.are_deterministic_algorithms_enabled(), grad_dtype=q.dtype,
            )
            return dq, dk, dv, None, None, None, None, None, None, None
        from mxattn import reference
        from mxattn.kernels.varlen import seq_mx_dequantized

        qm, km, vd = _varlen_mx_values(q, k, v, cu_k, mode)
        dq, dk, dv = reference.attention_backward(
            qm, km, vd, out, dout, causal=ctx.causal, softmax_scale=ctx.scale,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, quantize_p=True, quantize_ds=True, quantize_do=True,
            q_seq=seq_mx_dequantized(q, cu_q, mode), k_seq=seq_mx_dequantized(k, cu_k, mode),
            v_hdim=formats.quantize_mxfp8(v, dim=2, scale_mode=mode), dtype=torch.float32,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def mxfp8_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    scale_mode: str = "rceil",
):
    """MXFP8 attention on a jagged (packed) batch, ``flash_attn_varlen_func`` conventions.

    Args:
        q: (total_q, Hq, D) bfloat16/float16/float32, the sequences' tokens one after the other.
        k, v: (total_k, Hkv, D), same dtype and device.
        cu_seqlens_q, cu_seqlens_k: int32, batch + 1 entries: sequence b is q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
            and k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; start at 0, non-decreasing (empty sequences are fine),
            end at total_q / total_k.  On q's device or the CPU.
        max_seqlen_q, max_seqlen_k: ints at least the longest q / k sequence.  The kernels' grids are sized by the
            longest sequence itself, which the check reads from cu_seqlens anyway, so a generous bound costs nothing.
        causal: per sequence, aligned to the bottom-right corner (query i sees key j iff j <= i + len_k - len_q).
        softmax_scale: defaults to 1/sqrt(D).
        return_lse: also return the log-sum-exp, (Hq, total_q) float32 (natural log; -inf for rows that see no key).
        scale_mode: MX scale rule, "rceil" (default) or "floor".

    q and k are MXFP8-quantized along D, v along the sequence with blocks starting at each sequence's first key
    (a block never spans two sequences).  Returns the output (total_q, Hq, D) in q's dtype.  Hq must be a multiple
    of Hkv; D in {64, 128}.  Every argument is checked before any launch (TypeError / ValueError naming it); the
    check reads cu_seqlens on the host (one device sync).

    CUDA: the Hopper FP8 kernel on FP8 data kept at its packed offsets (layouts: ``mxattn/kernels/varlen.py``).
    CPU: the reference with the same semantics (P in e4m3 with the constant scale 2^-8).  Gradients flow to q, k, v
    through ``loss.backward()``: on CUDA the Hopper FP8 backward kernels in their jagged mode
    (``attn_bwd_hopper_varlen``; deterministic dQ when ``torch.are_deterministic_algorithms_enabled()``), on CPU
    the reference backward (FP8 emulation of P, dS, dO).
    """
    cu_q, cu_k, max_seqlen_q, max_seqlen_k = _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k, softmax_scale)
    mode = formats.ScaleMode.parse(scale_mode).value
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    scale = _default_scale(q.shape[2], softmax_scale)
    out, lse = _MXFP8VarlenAttention.apply(
        q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, mode
    )
    return (out, lse) if return_lse else out
