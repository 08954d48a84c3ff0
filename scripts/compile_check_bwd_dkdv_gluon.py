"""Compile the Gluon backward dK/dV kernel (``mxattn/kernels/attn_bwd_dkdv_gluon.py``) for sm_90a without a GPU.

    python scripts/compile_check_bwd_dkdv_gluon.py [--dump DIR] [--only d128,d64_causal] [--stages N] [--split]
        [--no-defer] [--ds-exp=key|tile] [--varlen]

``--split`` compiles the split variant (``GluonDkdvConfig(split=True)``: two 4-warp consumer partitions of 64 keys).
``--no-defer`` compiles without the deferred dK product (``GluonDkdvConfig(defer_dk=False)``, the kernel before
session 7's deferral); the default config defers it (with ``--stages 1`` it is never deferred).  ``--ds-exp=tile``
compiles the dS exponent per (keys x 64 queries) tile (the rule before session 8), ``--ds-exp=key`` one per key.
``--varlen`` compiles the jagged mode (``VARLEN``: tile table, packed operands) as ``attn_bwd_dkdv_gluon_varlen``
launches it; it combines with each of the other options.

Needs triton 3.6 (the GPU machine's version).  Same approach as ``scripts/compile_check_bwd_dq_gluon.py``:
``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))`` with TMA descriptor signatures, then the
``ptxas`` / ``cuobjdump`` of the triton wheel (helpers of ``scripts/compile_check_gluon.py``).  Fails on spills
(beyond the per-variant ``SPILL_ALLOWANCE``, explained there),
local memory, wgmma other than m64nNk32 e4m3, ptxas wgmma serialization (C7514 / C7512), and more than
``MAX_DEPBAR`` = 3 ``WARPGROUP.DEPBAR`` per query-step iteration: the dK/dV step waits three times (Sᵀ; dPᵀ while
dV's product runs; everything), where the forward and dQ kernels wait twice, so the forward's rule of two would
reject the intended structure, while one DEPBAR per wgmma (ptxas serialization: five) is still caught.  It also
prints the registers per partition (``setmaxnreg`` in the PTX) and the named barriers of the 8-warp consumer
partition (its tile-wide dS amax is a cross-warp reduction: the barrier must count 256 threads, not the CTA).
Exit status 1 when a check fails.
The build a launch makes (its ints specialized by the JIT): ``scripts/compile_launched.py``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)


from compile_check_bwd_dq_gluon import run_variants  # noqa: E402
from compile_check_gluon import check as gluon_check  # noqa: E402
from compile_check_gluon import compile_sm90, fp8_desc  # noqa: E402

MAX_DEPBAR = 3
DS_EXP_FLAGS = ("key", "tile")  # --ds-exp=MODE: GluonDkdvConfig(ds_exp=MODE); default: the config's default
# named barriers (BAR.SYNC) on a common query step's path (``compile_check_gluon.step_path``): the two around the
# ring's mbarrier wait and release, which Triton inserts, plus with ds_exp="tile" the two of the tile-wide dS amax
# (a cross-warp reduction through shared memory); with "key" the amax is a row reduction inside each quad of
# threads, so a barrier more means the reduction crossed warps again
STEP_BAR_KEY = 2
STEP_BAR_TILE = 4
# spill bytes (ptxas -v, stores + loads) accepted per variant, each explained; anything above fails.  None since
# session 7 (lse / δ through TMA freed the registers of the per-thread load addresses): until then d128 causal had
# 16 bytes (1 STL + 2 LDL per query step on the masked diagonal path at 240 registers).
SPILL_ALLOWANCE: dict[str, int] = {}
# split variants (rule: LDL / STL inside the query-step loops, see ``check``): none since session 7 (before: 11 per
# step at d128 causal, both warpgroups together, with triton 3.6).
SPLIT_LOOP_LOCAL_ALLOWANCE: dict[str, int] = {}
# the jagged split builds (--varlen --split, session 8): the per-sequence scalars (Sq, the key bounds, lo / mid /
# n_m / n_steps, the offsets) come from the tile table, so they sit in per-thread registers where the dense build
# keeps kernel arguments in uniform registers; at d128 under 240 registers ptxas then reloads loop-invariant
# values inside the query-step loop: 2 LDL per step (d128), 4 LDL + 1 predicated STL (d128 causal), both warpgroups
# together, with ds_exp="tile"; with "key" (the default; the two branches merged in session 9) 2 at d128 and at d128
# causal, 1 each undeferred.  The whole-tile jagged builds and d64 have none.  Measure before trimming further
# (docs/perf-notes-varlen.md, session 8).
VARLEN_SPLIT_LOOP_LOCAL_ALLOWANCE: dict[str, int] = {"d128": 2, "d128_causal": 5}


def compile_variant(head_dim: int, causal: bool, stages: int | None = None, split: bool = False,
                    defer_dk: bool | None = None, ds_exp: str | None = None, varlen: bool = False):
    """triton.compile of ``_attn_bwd_dkdv_ws_kernel`` for sm_90a, with the launcher's constexprs and options
    (``varlen``: the jagged build, SLOTS a pointer)."""
    from triton.experimental.gluon import language as gl

    from mxattn.kernels import attn_bwd_dkdv_gluon as m

    cfg = m.default_config(head_dim, causal)
    stages = stages or cfg.stages
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv)  # noqa: E731
    bm, bn = m.BLOCK_M.value, (m.BLOCK_N_WG if split else m.BLOCK_N).value
    row, key, seq = fp8_desc([bm, head_dim], lay), fp8_desc([bn, head_dim], lay), fp8_desc([head_dim, bm], lay)
    vec = ([1, bm], m._vector_layout(), "fp32")  # lse and delta rows, as ``_vector_descriptors`` makes them
    descs = {"q_desc": row, "do_desc": row, "qs_desc": seq, "dos_desc": seq, "k_desc": key, "v_desc": key,
             "lse_desc": vec, "dl_desc": vec}
    ptrs = {"QE": "*i32", "DOE": "*i32", "KE": "*i32", "VE": "*i32", "QSE": "*i32", "DOSE": "*i32",
            "DK": "*bf16", "DV": "*bf16"}
    defer = (cfg.defer_dk if defer_dk is None else defer_dk) and stages >= 2  # as GluonDkdvConfig.defers_dk
    key_exp = (ds_exp or cfg.ds_exp) == "key"  # as GluonDkdvConfig.key_exp
    consts = dict(HEAD_DIM=head_dim, STAGES=stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs, SPLIT=split,
                  CONSUMER_REGS=cfg.consumer_regs, DEFER_DK=defer, DS_KEY_EXP=key_exp, VARLEN=varlen)
    if varlen:
        ptrs["SLOTS"] = "*i32"
    else:
        consts["SLOTS"] = None
    # the JIT specializes integer arguments equal to 1 as constexpr; the launcher makes these strides 1 (contiguous
    # exponent tensors, dk, dv), so every launch compiles this variant
    consts |= {name: 1 for name in m.UNIT_STRIDES}
    return compile_sm90(m._attn_bwd_dkdv_ws_kernel, consts, descs, ptrs, ("qk_scale", "grad_scale"),
                        4 if split else 8, cfg.maxnreg)


def check(k, name: str, dump: str | None, max_depbar: int = MAX_DEPBAR, spill_allowance: int | None = None,
          split: bool = False, key_exp: bool | None = None, varlen: bool = False) -> bool:
    """``compile_check_gluon.check`` with ``max_depbar`` DEPBARs per loop iteration and the variant's documented
    spill allowance (``SPILL_ALLOWANCE``); prints the report.  Split variants: ptxas spills a few loop-invariant
    values of each warpgroup (the epilogue's pointers: stored before the query-step loop, reloaded after it; 40 B
    at d128 causal with triton 3.6 since session 7, 72 B at d128 and 184 B at d128 causal before), so the rule there
    is no LDL / STL inside the loops.  ``key_exp`` (the build's DS_KEY_EXP; the default config's when None): a common
    step may hold at most ``STEP_BAR_KEY`` BAR.SYNC, else ``STEP_BAR_TILE``."""
    allowed = SPILL_ALLOWANCE.get(name, 0) if spill_allowance is None else spill_allowance
    if key_exp is None:
        from mxattn.kernels.attn_bwd_dkdv_gluon import default_config

        key_exp = default_config(128, False).key_exp
    loop_local = (VARLEN_SPLIT_LOOP_LOCAL_ALLOWANCE if varlen else SPLIT_LOOP_LOCAL_ALLOWANCE).get(name, 0)
    return gluon_check(k, name, dump, max_depbar=max_depbar, allowed_spill_bytes=None if split else allowed,
                       allowed_loop_local=loop_local if split else 0,
                       max_step_bar=STEP_BAR_KEY if key_exp else STEP_BAR_TILE)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = "--split" in argv
    if split:
        argv.remove("--split")
    defer = None
    if "--no-defer" in argv:
        argv.remove("--no-defer")
        defer = False
    ds_exp = None
    for mode in DS_EXP_FLAGS:
        if f"--ds-exp={mode}" in argv:
            argv.remove(f"--ds-exp={mode}")
            ds_exp = mode
    key_exp = None if ds_exp is None else ds_exp == "key"
    varlen = "--varlen" in argv
    if varlen:
        argv.remove("--varlen")
    return run_variants(argv, __doc__, lambda d, c, st: compile_variant(d, c, st, split=split, defer_dk=defer,
                                                                        ds_exp=ds_exp, varlen=varlen),
                        lambda k, name, dump: check(k, name, dump, split=split, key_exp=key_exp, varlen=varlen),
                        consumer_threads=128 if split else 256)


if __name__ == "__main__":
    sys.exit(main())
