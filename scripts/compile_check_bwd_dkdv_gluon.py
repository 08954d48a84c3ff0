"""Compile the Gluon backward dK/dV kernel (``mxattn/kernels/attn_bwd_dkdv_gluon.py``) for sm_90a without a GPU.

    python scripts/compile_check_bwd_dkdv_gluon.py [--dump DIR] [--only d128,d64_causal] [--stages N] [--split]
        [--no-defer] [--ds-exp=key|tile] [--varlen] [--block-m 64|128]

``--split`` compiles the split variant (``GluonDkdvConfig(split=True)``: two 4-warp consumer partitions of 64 keys).
``--no-defer`` compiles without the deferred dK product (``GluonDkdvConfig(defer_dk=False)``, the kernel before
session 7's deferral); the default config defers it (with ``--stages 1`` it is never deferred).  ``--ds-exp=tile``
compiles the dS exponent per (keys x 64 queries) tile (the rule before session 8), ``--ds-exp=key`` one per key.
``--varlen`` compiles the jagged mode (``VARLEN``: tile table, packed operands) as ``attn_bwd_dkdv_gluon_varlen``
launches it; it combines with each of the other options.  ``--block-m 128`` compiles the 128-query step
(``GluonDkdvConfig(block_m=128)``, session 9): dense d64 builds only (``--only`` defaults to d64,d64_causal there;
a d128 or jagged build is refused, as the launcher refuses it), with ``--maxnreg`` / ``--consumer-regs`` /
``--producer-regs`` to try other register splits.  Each consumer loop's report ends with its thread-instructions per
score: the common step's path times the warpgroup's 128 threads over its 64 keys x block_m queries.

Needs triton 3.6 (the GPU machine's version).  Same approach as ``scripts/compile_check_bwd_dq_gluon.py``:
``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))`` with TMA descriptor signatures, then the
``ptxas`` / ``cuobjdump`` of the triton wheel (helpers of ``scripts/compile_check_gluon.py``).  Fails on spills
(beyond the per-build ``ALLOWANCE``, explained there),
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
# What each build may spill, each number explained; anything above fails.  One table, keyed by the build:
# (layout: "dense", "jagged" (--varlen) or "fused" (--fuse-dq), split, query step, dS exponent rule) -> {variant:
# n}.  n counts spill bytes (ptxas -v, stores + loads) for a whole-tile build, and LDL / STL inside the query-step
# loops for a split one (ptxas spills a few loop-invariant values of each warpgroup outside them: the epilogue's
# pointers, stored before the loop and reloaded after it, 40 B at d128 causal with triton 3.6 since session 7).
# Absent: 0.  Counted with triton 3.6; since session 23 this script compiles the launch's Q_PERM (a constexpr left
# out compiled as a runtime i32 with both of its branches), which moved several counts.
#
# - dense whole-tile, 64-query step: none since session 7 (lse / δ through TMA freed the registers of the per-thread
#   load addresses; until then d128 causal had 16 B).
# - dense split, 64-query step: none from session 7 until session 20's query-permuted boxes (q_perm, the dense
#   default); the d128 causal build then keeps a few values spilled inside its loops, measured faster all the same
#   (docs/perf-notes-attn-bwd.md "Session 20"): 6 with ds_exp="key", 16 with "tile", both warpgroups together.
#   With session 24's causal CTA order (LPT_SECTION) this script's "key" build keeps 8 (the launched build still 6,
#   as before the order: scripts/compile_launched.py dkdv --causal --shape 2,4096,16,16,128).
# - jagged split (--varlen --split, session 8): the per-sequence scalars (Sq, the key bounds, lo / mid / n_m /
#   n_steps, the offsets) come from the tile table, so they sit in per-thread registers where the dense build keeps
#   kernel arguments in uniform registers; at d128 under 240 registers ptxas reloads loop-invariant values inside
#   the loop: 2 (d128) and 5 (d128 causal) with "key", 3 and 7 with "tile" (docs/perf-notes-varlen.md, session 8).
# - jagged whole-tile (MXATTN_BWD_GLUON_SPLIT=0 only, not a default): d128 causal spills 64 B.
# - 128-query step (--block-m 128, session 9), d64 causal: with "tile" ptxas keeps the shared-memory address of
#   the tile-wide amax's cross-warp scratch spilled and reloads it every step (whole-tile 8 B; split 8 LDL / STL,
#   2 before the launch's Q_PERM); with "key" (the default) this script's build keeps 4 reloads in its split loops
#   and 16 B whole-tile, where the launched build (scripts/compile_launched.py dkdv --shape 2,8192,16,16,64
#   --causal: ints specialized as a launch does) has none, 706 instructions a step.
ALLOWANCE: dict[tuple, dict[str, int]] = {
    ("dense", True, 64, "key"): {"d128_causal": 8},
    ("dense", True, 64, "tile"): {"d128_causal": 16},
    ("jagged", True, 64, "key"): {"d128": 2, "d128_causal": 5},
    ("jagged", True, 64, "tile"): {"d128": 3, "d128_causal": 7},
    ("jagged", False, 64, "key"): {"d128_causal": 64},
    ("jagged", False, 64, "tile"): {"d128_causal": 64},
    ("dense", False, 128, "tile"): {"d64_causal": 8},
    ("dense", True, 128, "tile"): {"d64_causal": 8},
    ("dense", False, 128, "key"): {"d64_causal": 16},
    ("dense", True, 128, "key"): {"d64_causal": 4},
    # fused dQ: see below (4 at d64 causal since session 13; 5 at d64, counted in session 23)
    ("fused", True, 128, "key"): {"d64_causal": 4, "d64": 5},
}
# fused dQ (--fuse-dq, session 13, d64 128-query steps): dS staged in shared memory for the sixth wgmma costs named
# barriers around the store (Triton's shared-memory hazards: the previous step's wgmma read before it, the
# wgmma after it) on top of the ring's two; the causal build runs the dQ product in two 64-query halves (its
# whole 128-query product spilled ~770 B with 132 LDL / STL per step) and then waits four times per step, and
# ptxas keeps one value spilled: 4 LDL / STL per step, both warpgroups together (triton 3.6; ``ALLOWANCE``)
STEP_BAR_FUSED_DQ = 6
FUSED_DQ_MAX_DEPBAR = 4


def compile_variant(head_dim: int, causal: bool, stages: int | None = None, split: bool = False,
                    defer_dk: bool | None = None, ds_exp: str | None = None, varlen: bool = False,
                    block_m: int | None = None, regs: dict | None = None, fuse_dq: bool = False):
    """triton.compile of ``_attn_bwd_dkdv_ws_kernel`` for sm_90a, with the launcher's constexprs and options
    (``varlen``: the jagged build, SLOTS a pointer; ``block_m``: the query step, the config's default when None,
    refused where the launcher refuses it; ``regs``: GluonDkdvConfig register fields to override, e.g.
    ``{"consumer_regs": 232}``; ``fuse_dq``: the fused-dQ build, ``GluonDkdvConfig(fuse_dq=True)``)."""
    from dataclasses import replace

    from triton.experimental.gluon import language as gl

    from mxattn.kernels import attn_bwd_dkdv_gluon as m
    import torch

    from mxattn.kernels import launch

    cfg = m.default_config(head_dim, causal)
    cfg = replace(cfg, **(regs or {}), block_m=block_m or cfg.block_m, split=split, fuse_dq=fuse_dq)
    cfg.check_launch(head_dim, varlen)
    stages = stages or cfg.stages
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv)  # noqa: E731
    bm, bn = cfg.block_m, (m.BLOCK_N_WG if split else m.BLOCK_N).value
    # dense launches take the query-permuted Q / dO boxes (Sq % 16 == 0, the usual case; not with fused dQ); the
    # jagged launcher the 2-D ones
    q_perm = cfg.q_perm and not varlen and not fuse_dq
    row = fp8_desc([bm // 16, 2, 4, 2, head_dim] if q_perm else [bm, head_dim], lay)
    key, seq = fp8_desc([bn, head_dim], lay), fp8_desc([head_dim, bm], lay)
    vec = ([1, bm], m._vector_layout(), "fp32")  # lse and delta rows, as ``_vector_descriptors`` makes them
    descs = {"q_desc": row, "do_desc": row, "qs_desc": seq, "dos_desc": seq, "k_desc": key, "v_desc": key,
             "lse_desc": vec, "dl_desc": vec}
    ptrs = {"QE": "*i32", "DOE": "*i32", "KE": "*i32", "VE": "*i32", "QSE": "*i32", "DOSE": "*i32",
            "DK": "*bf16", "DV": "*bf16"}
    # GluonDkdvConfig.defers_dk (not with one stage, nor with 128-query steps)
    defer = replace(cfg, stages=stages, defer_dk=cfg.defer_dk if defer_dk is None else defer_dk).defers_dk
    if fuse_dq:  # K_seq's (D x 64-key) boxes and the fp32 dQ buffer
        descs["ks_desc"] = fp8_desc([head_dim, bn], lay)
        ptrs["DQ"] = "*fp32"
    key_exp = (ds_exp or cfg.ds_exp) == "key"  # as GluonDkdvConfig.key_exp
    consts = dict(HEAD_DIM=head_dim, STAGES=stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs, SPLIT=split,
                  CONSUMER_REGS=cfg.consumer_regs, DEFER_DK=defer, DS_KEY_EXP=key_exp, VARLEN=varlen, BLOCK_M=bm,
                  FUSE_DQ=fuse_dq, DQ_HALVES=fuse_dq and (causal if cfg.dq_halves is None else cfg.dq_halves),
                  # every constexpr is named: one left out compiles as a runtime i32 with both of its branches (the
                  # jagged whole-tile d128 causal build read 8 B of spills that way, 64 B as launched; session 23)
                  Q_PERM=q_perm,
                  # the causal CTA order of dense per-block launches (132 SMs, the CPU stand-in's; the launcher's rule)
                  LPT_SECTION=0 if varlen or fuse_dq else launch.lpt_section(causal, cfg.causal_lpt, bm == 64,
                                                                             launch.sm_count(torch.device("cpu"))))
    if not fuse_dq:  # the other builds leave the fused-dQ arguments at their defaults
        consts |= {"ks_desc": None, "DQ": None}
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
          split: bool = False, key_exp: bool | None = None, varlen: bool = False, block_m: int = 64,
          fuse_dq: bool = False) -> bool:
    """``compile_check_gluon.check`` with ``max_depbar`` DEPBARs per loop iteration and the build's documented
    allowance (``ALLOWANCE``: spill bytes whole-tile, LDL / STL inside the loops split); prints the report.
    ``key_exp`` (the build's DS_KEY_EXP; the default config's when None): a common step may hold at most
    ``STEP_BAR_KEY`` BAR.SYNC, else ``STEP_BAR_TILE``.  ``block_m``: the build's query step,
    for the per-score line (``per_score``)."""
    if key_exp is None:
        from mxattn.kernels.attn_bwd_dkdv_gluon import default_config

        key_exp = default_config(128, False).key_exp
    layout = "fused" if fuse_dq else "jagged" if varlen else "dense"
    allowed = ALLOWANCE.get((layout, split, block_m, "key" if key_exp else "tile"), {}).get(name, 0)
    if spill_allowance is not None:
        allowed = spill_allowance
    if fuse_dq:
        max_depbar = FUSED_DQ_MAX_DEPBAR
    ok = gluon_check(k, name, dump, max_depbar=max_depbar, allowed_spill_bytes=None if split else allowed,
                     allowed_loop_local=allowed if split else 0,
                     max_step_bar=STEP_BAR_FUSED_DQ if fuse_dq else STEP_BAR_KEY if key_exp else STEP_BAR_TILE)
    for st, score in per_score(k, block_m):
        print(f"      per score: {score:.1f} thread-instr (common step path {st} x 128 threads / (64 keys x {block_m} "
              f"queries))")
    return ok


def per_score(k, block_m: int) -> list[tuple[int, float]]:
    """(common step path, thread-instructions per score) of each consumer loop: a warpgroup's 128 threads run the
    step's path for its 64 keys x ``block_m`` queries (split and whole-tile builds alike; the tables of
    docs/perf-notes-attn-bwd.md count the same way, e.g. 38.8 for the tl kernel's 1243-instruction loop)."""
    from compile_check_gluon import _resource_usage, steady_loops, step_path

    sass = _resource_usage(k.asm["cubin"])["sass"]
    out = []
    for lp in steady_loops(sass):
        n = step_path(sass, lp)["instrs"]
        out.append((n, n * 128 / (64 * block_m)))
    return out


def _flag_value(argv: list, flag: str) -> int | None:
    """The integer after ``flag`` in argv (both removed), or None."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = int(argv[i + 1])
    del argv[i: i + 2]
    return value


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
    fuse_dq = "--fuse-dq" in argv  # GluonDkdvConfig(fuse_dq=True): needs --split and an undeferred step
    if fuse_dq:
        argv.remove("--fuse-dq")
    block_m = _flag_value(argv, "--block-m")  # the query step (GluonDkdvConfig.block_m); None: the default
    regs = {field: v for field, flag in (("maxnreg", "--maxnreg"), ("consumer_regs", "--consumer-regs"),
                                         ("producer_regs", "--producer-regs"))
            if (v := _flag_value(argv, flag)) is not None}
    if block_m == 128 and "--only" not in argv:
        argv += ["--only", "d64,d64_causal"]  # the only head dim the 128-query step builds for
    return run_variants(argv, __doc__, lambda d, c, st: compile_variant(d, c, st, split=split, defer_dk=defer,
                                                                        ds_exp=ds_exp, varlen=varlen,
                                                                        block_m=block_m, regs=regs,
                                                                        fuse_dq=fuse_dq),
                        lambda k, name, dump: check(k, name, dump, split=split, key_exp=key_exp, varlen=varlen,
                                                    block_m=block_m or 64, fuse_dq=fuse_dq),
                        consumer_threads=128 if split else 256)


if __name__ == "__main__":
    sys.exit(main())
