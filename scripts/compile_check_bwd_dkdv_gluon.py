"""Compile the Gluon backward dK/dV kernel (``mxattn/kernels/attn_bwd_dkdv_gluon.py``) for sm_90a without a GPU.

    python scripts/compile_check_bwd_dkdv_gluon.py [--dump DIR] [--only d128,d64_causal] [--stages N]

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
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from compile_check_bwd_dq_gluon import partition_report  # noqa: E402
from compile_check_gluon import _ptxas_verbose, _resource_usage, _sass_instrs, steady_loops  # noqa: E402

MAX_DEPBAR = 3
# spill bytes (ptxas -v, stores + loads) accepted per variant, each explained; anything above fails.  d128 causal:
# one 32-bit value stored and two reloaded per query step (1 STL + 2 LDL in the loop's SASS, L1 hits), at 240
# registers with both 64 x 128 fp32 accumulators live; the masked diagonal path is where it runs out.
SPILL_ALLOWANCE = {"d128_causal": 16}


def _desc_sig(block_shape, layout) -> str:
    return f"tensordesc<fp8e4nv[{', '.join(map(str, block_shape))}],{layout!r}>"


def compile_variant(head_dim: int, causal: bool, stages: int | None = None):
    """triton.compile of ``_attn_bwd_dkdv_ws_kernel`` for sm_90a, with the launcher's constexprs and options."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mxattn.kernels import attn_bwd_dkdv_gluon as m

    cfg = m.default_config(head_dim, causal)
    stages = stages or cfg.stages
    f8 = gl.float8e4nv
    bm, bn = m.BLOCK_M.value, m.BLOCK_N.value
    row = ([bm, head_dim], gl.NVMMASharedLayout.get_default_for([bm, head_dim], f8))
    key = ([bn, head_dim], gl.NVMMASharedLayout.get_default_for([bn, head_dim], f8))
    seq = ([head_dim, bm], gl.NVMMASharedLayout.get_default_for([head_dim, bm], f8))
    descs = {"q_desc": row, "do_desc": row, "qs_desc": seq, "dos_desc": seq, "k_desc": key, "v_desc": key}
    ptrs = {"QE": "*i32", "DOE": "*i32", "KE": "*i32", "VE": "*i32", "QSE": "*i32", "DOSE": "*i32",
            "LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16"}
    consts = dict(HEAD_DIM=head_dim, STAGES=stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs)
    # the JIT specializes integer arguments equal to 1 as constexpr; the launcher makes these strides 1 (contiguous
    # exponent tensors, lse, delta, dk, dv), so every launch compiles this variant
    consts |= {name: 1 for name in m.UNIT_STRIDES}
    fn = m._attn_bwd_dkdv_ws_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = _desc_sig(*descs[name])
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "grad_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "maxnreg": cfg.maxnreg})


def check(k, name: str, dump: str | None, max_depbar: int = MAX_DEPBAR, spill_allowance: int | None = None) -> bool:
    """``compile_check_gluon.check``'s rules with ``max_depbar`` DEPBARs per loop iteration; prints the report."""
    ptx = k.asm["ptx"]
    usage = _resource_usage(k.asm["cubin"])
    ptxas = _ptxas_verbose(ptx)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    spill_bytes = sum(int(a) + int(b) for a, b in spills)
    setmaxnreg = collections.Counter(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))
    local = len(re.findall(r"\b(?:ld|st)\.local", ptx))
    serialized = [ln.strip() for ln in ptxas.splitlines() if "Potential Performance Loss" in ln]
    loops = steady_loops(usage["sass"])
    max_reg = max((int(r) for _, t in _sass_instrs(usage["sass"]) for r in re.findall(r"\bR(\d+)\b", t)),
                  default=-1)
    bad_wgmma = [w for w in wgmma if not re.fullmatch(r"m64n\d+k32\.f32\.e4m3\.e4m3", w)]
    allowed = SPILL_ALLOWANCE.get(name, 0) if spill_allowance is None else spill_allowance
    ok = (spill_bytes <= allowed and local == 0 and bool(setmaxnreg) and bool(wgmma) and not bad_wgmma
          and not serialized and bool(loops) and all(lp["depbar"] <= max_depbar for lp in loops))
    print(f"== {name}: {'OK' if ok else 'FAIL'}")
    print(f"   registers: launch {usage['regs']}/thread (maxnreg), highest register used in SASS R{max_reg}; "
          f"stack {usage['stack']}, local {usage['local']}")
    print(f"   spills (ptxas -v): {spill_bytes} bytes (allowed {allowed}); ld/st.local in PTX: {local}")
    print(f"   shared memory: {k.metadata.shared} bytes")
    print(f"   setmaxnreg (kind, regs): {dict(setmaxnreg)}")
    print(f"   wgmma: {dict(wgmma)}" + (f"  NOT e4m3 k32: {bad_wgmma}" if bad_wgmma else ""))
    print(f"   ptxas wgmma serialization: {serialized or 'none'}")
    if not loops:
        print("   FAIL: no consumer loop found in the SASS")
    for lp in loops:
        top = ", ".join(f"{op} {c}" for op, c in lp["counts"].most_common(12))
        print(f"   consumer loop at {lp['start']}: {lp['instrs']} SASS instrs (masked + unmasked paths), "
              f"WARPGROUP.DEPBAR {lp['depbar']} (max {max_depbar}); {top}")
    counts = {label: len(re.findall(pat, ptx)) for label, pat in (
        ("ex2", r"ex2\.approx"), ("tma", r"cp\.async\.bulk\.tensor"), ("mbar_wait", r"mbarrier\.try_wait"),
        ("mbar_arrive", r"mbarrier\.arrive"), ("bar_sync", r"\bbar\.sync|barrier\.sync"), ("shfl", r"shfl\.sync"),
        ("st_shared", r"st\.shared"), ("ld_shared", r"ld\.shared"), ("prmt", r"\bprmt"))}
    print("   PTX counts (whole kernel): " + ", ".join(f"{a}={c}" for a, c in counts.items()))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", ptx), ("sass", usage["sass"]), ("ptxas.txt", ptxas)):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="write TTGIR / PTX / SASS per variant here")
    ap.add_argument("--only", help="comma list of variant names (d128, d128_causal, d64, d64_causal)")
    ap.add_argument("--stages", type=int, help="ring depth (default: the launcher's default_config)")
    args = ap.parse_args(argv)
    if not triton.__version__.startswith("3.6"):
        print(f"warning: triton {triton.__version__}; this check targets triton 3.6 (the GPU machine's version)")
    variants = [(f"d{d}{'_causal' if c else ''}", d, c) for d in (128, 64) for c in (False, True)]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    ok = True
    for name, d, causal in variants:
        try:
            k = compile_variant(d, causal, args.stages)
        except Exception as e:  # noqa: BLE001 - report every variant
            print(f"== {name}: COMPILE ERROR\n{type(e).__name__}: {e}")
            ok = False
            continue
        ok = check(k, name, args.dump) and ok
        ok = partition_report(k) and ok
    print("all variants OK" if ok else "some variants FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
