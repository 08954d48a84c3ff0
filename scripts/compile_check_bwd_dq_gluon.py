"""Compile the Gluon backward dQ kernel (``mxattn/kernels/attn_bwd_dq_gluon.py``) for sm_90a without a GPU.

    python scripts/compile_check_bwd_dq_gluon.py [--dump DIR] [--only d128,d64_causal] [--stages N] [--split] [--varlen]
                                                 [--block-n 128] [--regs CONSUMER,MAXNREG,PRODUCER]

Needs triton 3.6 (the GPU machine's version).  Same approach and the same pass / fail rules as
``scripts/compile_check_gluon.py`` (whose public ``check`` it reuses): ``triton.compile(GluonASTSource(...),
target=GPUTarget("cuda", 90, 32))`` with TMA descriptor signatures, then the ``ptxas`` / ``cuobjdump`` of the triton
wheel.  Fails on spills, local memory, wgmma other than m64nNk32 e4m3, ptxas wgmma serialization (C7514 / C7512),
more than two ``WARPGROUP.DEPBAR`` per key-loop iteration.  It also prints the registers per partition (the
``setmaxnreg`` values in the PTX) and the named barriers the 8-warp consumer partition uses (its tile-wide dS
amax is a cross-warp reduction: the barrier must count the partition's 256 threads, not the CTA's).
``--varlen`` builds the jagged mode (``VARLEN``: tile table, packed operands), as ``attn_bwd_dq_gluon_varlen``
launches it.  ``--block-n 128`` builds the 128-key step (``GluonDqConfig(block_n=128)``; the launcher takes it at
d64 only, so a d128 variant with it is built for the record but not required to pass).  ``--regs`` overrides the
register split (``consumer_regs`` of the split build's second warpgroup, ``maxnreg``, ``producer_regs``).  Exit
status 1 when a check fails.
The build a launch makes (its ints specialized by the JIT): ``scripts/compile_launched.py``.
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

from compile_check_gluon import check, compile_sm90, fp8_desc  # noqa: E402


def compile_variant(head_dim: int, causal: bool, stages: int | None = None, split: bool = False,
                    varlen: bool = False, block_n: int | None = None, regs: tuple | None = None):
    """triton.compile of ``_attn_bwd_dq_ws_kernel`` for sm_90a, with the launcher's constexprs and options
    (``varlen``: the jagged build, SLOTS a pointer; ``block_n``: the key step, default the config's; ``regs``:
    (consumer_regs, maxnreg, producer_regs) instead of the config's)."""
    import dataclasses

    from triton.experimental.gluon import language as gl

    from mxattn.kernels import attn_bwd_dq_gluon as m
    import torch

    from mxattn.kernels import launch

    cfg = m.default_config(head_dim, causal)
    if block_n is not None:
        cfg = dataclasses.replace(cfg, block_n=block_n)
    if regs is not None:
        cfg = dataclasses.replace(cfg, consumer_regs=regs[0], maxnreg=regs[1], producer_regs=regs[2])
    stages = stages or cfg.stages
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv)  # noqa: E731
    bm, bn = (m.WG_ROWS if split else m.BLOCK_M).value, cfg.block_n
    # dense launches take the key-permuted K / V boxes (Sk % 16 == 0, the usual case); the jagged launcher the 2-D
    # ones.  Every constexpr is named below: one left out would compile as a runtime i32 with both its branches
    k_perm = cfg.k_perm and not varlen
    row = fp8_desc([bm, head_dim], lay)
    key = fp8_desc([bn // 16, 2, 4, 2, head_dim] if k_perm else [bn, head_dim], lay)
    descs = {"q_desc": row, "do_desc": row, "k_desc": key, "v_desc": key, "ks_desc": fp8_desc([head_dim, bn], lay)}
    ptrs = {"QE": "*i32", "DOE": "*i32", "KE": "*i32", "VE": "*i32", "KSE": "*i32", "LSE": "*fp32",
            "DELTA": "*fp32", "DQ": "*bf16"}
    consts = dict(HEAD_DIM=head_dim, STAGES=stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs, SPLIT=split,
                  CONSUMER_REGS=cfg.consumer_regs, BLOCK_N=cfg.block_n, VARLEN=varlen,
                  K_PERM=k_perm, AMAX_SLOTS=cfg.amax_slots,
                  # the causal CTA order of dense launches (an H100 / H200's 132 SMs, the CPU stand-in's count)
                  LPT_SECTION=0 if varlen else launch.lpt_section(causal, cfg.causal_lpt, True,
                                                                  launch.sm_count(torch.device("cpu"))))
    if varlen:
        ptrs["SLOTS"] = "*i32"
    else:
        consts["SLOTS"] = None
    return compile_sm90(m._attn_bwd_dq_ws_kernel, consts, descs, ptrs, ("qk_scale", "grad_scale"),
                        4 if split else 8, cfg.maxnreg)


def partition_report(k, consumer_threads: int = 256) -> bool:
    """Registers per partition and the named barriers; False when a partition-local barrier counts other than
    ``consumer_threads`` (one 8-warp consumer: 256; split into warpgroups: 128)."""
    ptx = k.asm["ptx"]
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    bars = collections.Counter(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?", ptx))
    print(f"   setmaxnreg sequence (PTX order): {[f'{a} {b}' for a, b in regs]}")
    print("   bar.sync (id, threads): " + ", ".join(f"({i}, {n or 'all'}) x{c}" for (i, n), c in bars.items()))
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))
    print(f"   wgmma instructions (PTX, whole kernel): {dict(wgmma)}")
    # the count-less ``barrier.sync 1`` are the warp_specialize entry / exit of all warps; every other barrier is a
    # consumer partition's (8 warps = 256 threads, or a 4-warp warpgroup = 128): a count of the whole CTA there
    # would wait for the producer warp
    bad = [(i, n) for (i, n) in bars if i != "1" and n != str(consumer_threads)]
    if bad:
        print(f"   FAIL: consumer barriers with a thread count other than {consumer_threads}: {bad}")
    return not bad


def run_variants(argv, doc: str, compile_variant, check_fn, consumer_threads: int = 256) -> int:
    """The command line of the backward kernels' compile checks: compile d128/d64 x causal (``--only``,
    ``--stages``), report each with ``check_fn`` and ``partition_report``, ``--dump`` the code.  Exit status 1
    when a variant fails."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
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
        ok = check_fn(k, name, args.dump) and ok
        ok = partition_report(k, consumer_threads) and ok
    print("all variants OK" if ok else "some variants FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = "--split" in argv  # the split variant (GluonDqConfig(split=True): two 4-warp consumers of 64 rows)
    if split:
        argv.remove("--split")
    varlen = "--varlen" in argv  # the jagged build (VARLEN)
    if varlen:
        argv.remove("--varlen")
    block_n = regs = None
    for flag in ("--block-n", "--regs"):  # flags of this script only (run_variants parses the shared ones)
        if flag in argv:
            i = argv.index(flag)
            val = argv[i + 1]
            del argv[i:i + 2]
            if flag == "--block-n":
                block_n = int(val)
            else:
                regs = tuple(int(x) for x in val.split(","))
    return run_variants(argv, __doc__, lambda d, c, st: compile_variant(d, c, st, split=split, varlen=varlen,
                                                                        block_n=block_n, regs=regs), check,
                        consumer_threads=128 if split else 256)


if __name__ == "__main__":
    sys.exit(main())
