"""The Gluon linear + MXFP8 quantize kernel's tile widths side by side (docs/perf-notes-producers.md, session 14).

    PYTHONPATH=. python scripts/bench_linear_tiles.py [--out FILE.json] [--warm-only] [--n 4096,12288]

M 16384, K 4096, N 4096 and 12288, orientations hdim and both: the Gluon kernel with each config of ``VARIANTS``
(forced through ``linear_quant_fwd`` on prepared row-scaled operands, as ``bench_producers``'s ``mxattn_gluon``
row), cuBLAS FP8 (``torch._scaled_mm``, per-tensor scales, with and without fast accumulation) and BF16 GEMM +
the MXFP8 quantize, all in the same process.  Every case is timed in ``--rounds`` rounds that visit the cases in
turn (the run-to-run spread of one case timed alone was up to 15 % in session 11), each round one CUDA-event
interval over enough calls for ~``--interval-ms``; the row gives the median round.  Prints one compact table
(variant, N, orientation, ms, TFLOP/s, ratio to cuBLAS FP8) and writes the rows as JSON.  ``--warm-only``: one
call of every case (compiles into Triton's cache; meant to run beside the GPU tests, so that the timed run
compiles nothing).  MXATTN_DEADLINE (epoch seconds): cases left when fewer than 10 s remain are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

M, K = 16384, 4096


def variants():
    """name: (GluonLinearConfig, precise accumulation)."""
    from mxattn.kernels.linear_quant_gluon import GluonLinearConfig as C

    return {
        "gluon128_precise": (C(), True),  # today's default
        "gluon128_fast": (C(), False),
        "gluon256_inline": (C.wide(), False),
        "gluon256_epi": (C.wide_epi(), False),  # 4-warp epilogue partition, two m64n128k32 per step
        "gluon256_epi2": (C.wide_epi2(), False),  # one m64n256k32 per step, 2-warp epilogue
    }


def _cases(N: int):
    """(name, orientation, fn) of one N; the operands are made once per N."""
    from mxattn.kernels import linear_quant as kl
    from mxattn.kernels import linear_quant_gluon as kg
    from mxattn.kernels.quantize import quantize_mxfp8_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
    xr, wr = kl.row_scaled_rows(x), kl.row_scaled_rows(w)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    x8, w8 = xr.data, wr.data

    def gluon(cfg, precise, orient):
        def fn():
            kl.KERNEL_OVERRIDE, kg.CONFIG_OVERRIDE = "gluon", cfg
            try:
                kl.linear_quant_fwd(xr, wr, None, 1, M, hdim=True, seq=orient == "both", rceil=True,
                                    tile=kl.LinearTile(precise_acc=precise))
            finally:
                kl.KERNEL_OVERRIDE, kg.CONFIG_OVERRIDE = None, None
        return fn

    out = [("cublas_fp8", "-", lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16)),
           ("cublas_fp8_fast", "-", lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                             use_fast_accum=True)),
           ("bf16_gemm", "-", lambda: x @ w.t()),
           ("bf16_gemm+quantize", "hdim", lambda: quantize_mxfp8_triton((x @ w.t()).view(1, M, N // 128, 128),
                                                                         "hdim"))]
    for orient in ("hdim", "both"):
        for name, (cfg, precise) in variants().items():
            out.append((name, orient, gluon(cfg, precise, orient)))
    return out


def _interval_ms(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _left() -> float:
    dl = os.environ.get("MXATTN_DEADLINE")
    return float("inf") if not dl else float(dl) - time.time()


def _report(rows: list, args, failed: list) -> None:
    """Print the rows of the last N (ratios to that N's cuBLAS FP8 row) and write every row so far."""
    refs = {r["N"]: r["tflops"] for r in rows if r["variant"] == "cublas_fp8"}
    last = rows[-1]["N"] if rows else None
    for r in rows:
        r["ratio_vs_cublas_fp8"] = r["tflops"] / refs[r["N"]] if r["N"] in refs else None
        if r["N"] != last:
            continue
        ratio = f"{r['ratio_vs_cublas_fp8']:.3f}" if r["ratio_vs_cublas_fp8"] else "-"
        spread = (max(r["rounds_ms"]) - min(r["rounds_ms"])) / r["ms"] * 100
        print(f"{r['variant']:<20} {r['N']:>6} {r['orientation']:<6} {r['ms']:8.4f} {r['tflops']:8.1f} "
              f"{ratio:>8}  (spread {spread:.1f} %)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "failed": failed, "device": torch.cuda.get_device_name(),
                       "commit": os.environ.get("MXATTN_COMMIT"),
                       "variants": {k: [dataclasses.asdict(c), p] for k, (c, p) in variants().items()}}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for the rows (rewritten after each N)")
    ap.add_argument("--warm-only", action="store_true", help="one call per case (compile), no timing")
    ap.add_argument("--n", default="4096,12288", help="comma list of N")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--interval-ms", type=float, default=30.0)
    ap.add_argument("--skip", default="", help="comma list of variant names not to run (e.g. a config whose tests "
                                               "failed)")
    args = ap.parse_args(argv)
    skip = {v for v in args.skip.split(",") if v}
    rows, failed = [], []
    if not args.warm_only:
        print(f"{'variant':<20} {'N':>6} {'orient':<6} {'ms':>8} {'TFLOP/s':>8} {'x cuBLAS':>8}  (M {M}, K {K}; "
              f"median of {args.rounds} rounds)", flush=True)
    for N in (int(v) for v in args.n.split(",")):
        cases = []
        for name, orient, fn in _cases(N):
            if name in skip:
                continue
            if _left() < 10:
                print(f"!! deadline: skipped {name} N{N} {orient}")
                continue
            try:
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                first = time.time() - t0
            except Exception as e:  # noqa: BLE001 - report the case, time the others
                failed.append(f"{name} N{N} {orient}: {type(e).__name__}: {str(e)[:300]}")
                print(f"!! {failed[-1]}", flush=True)
                continue
            if args.warm_only:
                print(f"warm {name} N{N} {orient}: first call {first:.1f} s", flush=True)
                continue
            ms = _interval_ms(fn, 3)
            cases.append([name, orient, fn, max(2, int(args.interval_ms / max(ms, 1e-3))), []])
        for _ in range(args.rounds):
            if _left() < 10:
                break
            for c in cases:
                c[4].append(_interval_ms(c[2], c[3]))
        for name, orient, _fn, calls, times in cases:
            if times:
                ms = sorted(times)[len(times) // 2]
                rows.append({"variant": name, "M": M, "K": K, "N": N, "orientation": orient, "ms": ms,
                             "tflops": 2.0 * M * N * K / ms / 1e9, "rounds_ms": times, "calls_per_round": calls})
        if not args.warm_only:
            _report(rows, args, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
