"""Compile the Gluon linear + MXFP8 quantize kernel for sm_90a without a GPU and check what came out.

    python scripts/compile_check_linear_gluon.py [--dump DIR] [--only NAME,...] [--stages N]

Needs triton 3.6 (the GPU machine's version).  Same machinery as ``compile_check_gluon.py`` (``triton.compile``
for ``GPUTarget("cuda", 90, 32)``, the triton wheel's ptxas / cuobjdump).  For each variant (orientations x
bias x precise accumulation) it prints registers, spill bytes, shared memory, setmaxnreg, the wgmma shapes, the
consumers' K loop (SASS instructions, ``WARPGROUP.DEPBAR`` per iteration) and fails on spill code inside a K
loop (LDL / STL; spills of tile-invariant epilogue values outside it are reported, not failed), local memory,
a wgmma other than m64nNk32 e4m3, ptxas serializing the wgmma pipeline (C7514 / C7512), no K loop found, or
more than one ``WARPGROUP.DEPBAR`` per K-step.  Then (full run) it compiles the ``tl`` kernel too and checks
that both accumulation modes are the same arithmetic in both (``check_same_accumulation``).  Exit status 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from compile_check_gluon import _SMEM_A, _resource_usage, compile_sm90, sass_loops  # noqa: E402
from compile_check_gluon import check as check_gluon  # noqa: E402


def config(name: str):
    """The GluonLinearConfig of a variant's config name: default, inline, wide (128 x 256, no epilogue partition),
    wide_epi (128 x 256 with the 4-warp epilogue partition, two m64n128k32 per step), wide_epi2 (m64n256k32 and a
    2-warp epilogue), n64."""
    from mxattn.kernels import linear_quant_gluon as m

    base = m.GluonLinearConfig()
    return {"default": base, "inline": base.inline(), "wide": base.wide(), "wide_epi": base.wide_epi(),
            "wide_epi2": base.wide_epi2(), "n64": m.GluonLinearConfig(block_n=64)}[name]


def compile_variant(hdim: bool, seq: bool, bias: bool, precise: bool, swz: bool = False, stages: int | None = None,
                    block_n: int | None = None, aligned: bool = True, epi_partition: bool = True,
                    cfg_name: str | None = None):
    """The kernel as ``linear_quant_fwd_gluon`` launches it (default config, or ``cfg_name``'s; ``epi_partition``
    False: its ``inline()``).  ``aligned``: N, K and S_pad specialized as multiples of 16 (what the launcher's JIT
    does for such sizes), else plain i32.  The config is validated first (as the launcher does)."""
    from triton.experimental.gluon import language as gl

    from mxattn.kernels import linear_quant_gluon as m

    cfg = config(cfg_name or "default")
    if not epi_partition:
        cfg = cfg.inline()
    bn = block_n or cfg.block_n
    m.GluonLinearConfig(**{**vars(cfg), "block_n": bn, "stages": stages or cfg.stages}).validate(precise)
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv)  # noqa: E731
    descs = {"x_desc": ([m.WG_ROWS.value, cfg.block_k], lay([m.WG_ROWS.value, cfg.block_k])),
             "w_desc": ([bn, cfg.block_k], lay([bn, cfg.block_k]))}
    ptrs = {"xe_ptr": "*i32", "we_ptr": "*i32", "b_ptr": "*bf16", "hd_ptr": "*u8", "hs_ptr": "*u8",
            "cd_ptr": "*i32", "cs_ptr": "*u8"}
    if aligned:  # the launcher's specialization of N, K, S_pad divisible by 16 (the benchmark shapes)
        ptrs |= {"N": "i32", "K": "i32", "S_pad": "i32"}
    consts = dict(BN=bn, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=stages or cfg.stages, PRECISE=precise,
                  HAS_BIAS=bias, HDIM=hdim, SEQ=seq, RCEIL=True, SOFT=False, SWZ=swz,
                  EPI_PARTITION=cfg.epi_partition, CONSUMER_REGS=cfg.consumer_regs,
                  PRODUCER_REGS=cfg.producer_regs, EPI_REGS=cfg.epi_regs, EPI_WARPS=cfg.epi_warps,
                  MMA_N=m.GluonLinearConfig(**{**vars(cfg), "block_n": bn}).mma_cols())
    return compile_sm90(m._linear_quant_ws_kernel, consts, descs, ptrs, (), 4, cfg.maxnreg)


def k_loops(sass: str) -> list[dict]:
    """The consumers' K loops: the innermost loops around wgmma with A from shared memory (``sass_loops``)."""
    return sass_loops(sass, lambda texts: any(re.search(_SMEM_A, x) for x in texts), _SMEM_A)


def check(k, name: str, dump: str | None) -> bool:
    """``compile_check_gluon.check`` on the K loops: spills tolerated outside them (tile-invariant epilogue
    offsets that the persistent loop keeps), no LDL / STL inside, at most one WARPGROUP.DEPBAR per K-step."""
    return check_gluon(k, name, dump, max_depbar=1, allowed_spill_bytes=None, allowed_loop_local=0, loops_fn=k_loops)


def compile_tl(precise: bool):
    """The ``tl`` kernel (``linear_quant._linear_quant_kernel``, default ``LinearTile``, hdim) for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import mxattn.kernels.linear_quant as kl

    fn, t = kl._linear_quant_kernel, kl.LinearTile(precise_acc=precise)
    consts = dict(BM=t.block_m, BN=t.block_n, BK=t.block_k, GROUP_M=t.group_m, EVEN_K=True, PRECISE=precise,
                  HAS_BIAS=False, HDIM=True, SEQ=False, RCEIL=True, SOFT=False, SWZ=False)
    ptrs = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xe_ptr": "*i32", "we_ptr": "*i32", "b_ptr": "*bf16",
            "hd_ptr": "*u8", "hs_ptr": "*u8", "cd_ptr": "*i32", "cs_ptr": "*u8"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "i32")
        if name in ptrs or name in ("sxm", "swn", "N", "K", "S_pad"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": t.num_warps, "num_stages": t.num_stages})


def wgmma_chains(ptx: str) -> set:
    """The distinct wgmma chains of the PTX: runs that start with a wgmma whose scale-d is 0 (a fresh
    accumulator), as tuples of (shape, fresh) per instruction."""
    chains, cur = [], []
    for shape, scale_d in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)\s+\{[^}]*\},\s*%rd\d+,\s*%rd\d+,\s*"
                                     r"([^,]+),", ptx):
        fresh = scale_d.strip() == "0"
        if fresh and cur:
            chains.append(tuple(cur))
            cur = []
        cur.append((shape, fresh))
    if cur:
        chains.append(tuple(cur))
    return set(chains)


def check_same_accumulation() -> bool:
    """Both accumulation modes compile to the same arithmetic in the tl and Gluon kernels (the basis of the
    byte-equality tests).  Precise: every K-step is one chain of 4 wgmma m64n128k32 from a zero accumulator, added
    to the fp32 accumulator by the K loop (64 FADD per thread and K-step).  Fast: only wgmma m64n128k32 onto the
    running accumulator (zero-initialized registers at a tile's start), no FADD in the K loop."""
    from mxattn.kernels import linear_quant_gluon as m

    steps = m.GluonLinearConfig().block_k // 32
    shape = "m64n128k32.f32.e4m3.e4m3"
    ok = True
    for precise in (True, False):
        tl_k = compile_tl(precise)
        gl_k = compile_variant(True, False, False, precise)
        tl_chains, gl_chains = wgmma_chains(tl_k.asm["ptx"]), wgmma_chains(gl_k.asm["ptx"])
        if precise:
            want = {tuple([(shape, True)] + [(shape, False)] * (steps - 1))}
        else:  # one chain over all of K: compare the instructions (none starts from zero), not their grouping
            tl_chains, gl_chains = ({i for c in ch for i in c} for ch in (tl_chains, gl_chains))
            want = {(shape, False)}
        fadd = [[lp["counts"]["FADD"] for lp in k_loops(_resource_usage(k.asm["cubin"])["sass"])] for k in (tl_k, gl_k)]
        per = 64 if precise else 0
        good = tl_chains == gl_chains == want and all(f and all(x == per for x in f) for f in fadd)
        ok = ok and good
        print(f"== {'precise' if precise else 'fast'} accumulation, tl vs Gluon: {'OK' if good else 'FAIL'}")
        print(f"   wgmma chains: tl {sorted(tl_chains)}\n                 Gluon {sorted(gl_chains)}")
        print(f"   FADD per K loop (tl, Gluon): {fadd}")
    return ok


VARIANTS = {  # name: (hdim, seq, bias, precise, swz, config name: see config())
    "hdim": (True, False, False, True, False, "default"),
    "both": (True, True, False, True, False, "default"),
    "seq_bias": (False, True, True, True, False, "default"),
    "both_bias_imprecise": (True, True, True, False, False, "default"),
    "hdim_tiled_scales": (True, False, False, True, True, "default"),
    "hdim_inline": (True, False, False, True, False, "inline"),
    "both_inline": (True, True, False, True, False, "inline"),
    # session 14: the tile width (fast accumulation: what 256 runs with, and the 128 rows it is compared to)
    "hdim_fast": (True, False, False, False, False, "default"),
    "both_fast": (True, True, False, False, False, "default"),
    "hdim_n64": (True, False, False, True, False, "n64"),
    "hdim_wide": (True, False, False, False, False, "wide"),
    "both_wide": (True, True, False, False, False, "wide"),
    "both_bias_wide": (True, True, True, False, False, "wide"),
    "hdim_wide_epi": (True, False, False, False, False, "wide_epi"),
    "both_wide_epi": (True, True, False, False, False, "wide_epi"),
    "hdim_wide_epi2": (True, False, False, False, False, "wide_epi2"),
    "both_wide_epi2": (True, True, False, False, False, "wide_epi2"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="write TTGIR / PTX / SASS per variant here")
    ap.add_argument("--only", help="comma list of variant names (default: all)")
    ap.add_argument("--stages", type=int, help="ring depth (default: GluonLinearConfig)")
    args = ap.parse_args(argv)
    if not triton.__version__.startswith("3.6"):
        print(f"warning: triton {triton.__version__}; this check targets triton 3.6 (the GPU machine's version)")
    names = args.only.split(",") if args.only else list(VARIANTS)
    ok = True
    for name in names:
        try:
            *flags, cfg_name = VARIANTS[name]
            k = compile_variant(*flags, stages=args.stages, cfg_name=cfg_name)
        except Exception as e:  # noqa: BLE001 - report every variant
            print(f"== {name}: COMPILE ERROR\n{type(e).__name__}: {e}")
            ok = False
            continue
        ok = check(k, name, args.dump) and ok
    if not args.only:
        ok = check_same_accumulation() and ok
    print("all variants OK" if ok else "some variants FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
