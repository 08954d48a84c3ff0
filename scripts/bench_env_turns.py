"""Time a kernel under two settings of an import-time environment variable, in turns (GPU).

    PYTHONPATH=. python3 scripts/bench_env_turns.py OUTDIR --var MXATTN_CAUSAL_LPT [--values 0 1]
        [--kernel fwd-gluon | fwd-tl | dq | dkdv | bwd] [--turns 3]
    PYTHONPATH=. python3 scripts/bench_env_turns.py OUTDIR --values A=0,B=1 A=1,B=0   (each value its own settings)

Some kernel options are module constants read once at import (``launch.CAUSAL_LPT``, ``attn_fwd_gluon.FWD_PROBE``), so a
process can time only one setting.  Each turn runs one child process per value (this file with ``--child``), in
the same order every turn; a child times every shape with ``triton.testing.do_bench`` (median) and prints one JSON
line.  Rows: per shape, each value's ms over the turns, the median, ``speedup`` against the first value and
whether it was faster in every turn.  Kernels:
- ``fwd-gluon``: the Gluon forward on FP8 operands, the API's default config, B2 H16 d128 S 4k / 8k / 16k;
- ``fwd-tl``: the tl forward, its default config, on the same operands at d128 S 2k and d64 S 4k / 8k;
- ``dq`` / ``dkdv``: the Gluon dQ / dK-dV kernel, the API's build, at d128 S 4k / 8k and d64 S 8k;
- ``bwd``: the public backward from BF16 (``autograd.grad``) at the ``dq`` shapes, with SDPA cuDNN BF16's timed in
  the same child (rows keep the ratio).
Every shape both masks.  One JSON under OUTDIR (``cost_probe``, ``attn_bwd_kernels`` or ``attn_bwd_env_turns``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPES = {"fwd-gluon": [(2, 16, S, 128, c) for S in (4096, 8192, 16384) for c in (False, True)],
          "fwd-tl": [(2, 16, S, D, c) for S, D in ((2048, 128), (4096, 64), (8192, 64)) for c in (False, True)],
          "dq": [(2, 16, S, D, c) for S, D in ((4096, 128), (8192, 128), (8192, 64)) for c in (False, True)],
          "bwd": [(2, 16, S, D, c) for S, D in ((4096, 128), (8192, 128), (8192, 64)) for c in (False, True)],
          "dkdv": [(2, 16, S, D, c) for S, D in ((4096, 128), (8192, 128), (8192, 64)) for c in (False, True)]}


def _digest(outputs) -> int:
    """A checksum of every output's bits (out and lse; dk and dv; dq, dk and dv): equal between settings that
    compute the same results."""
    import torch

    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    total = 0
    for i, t in enumerate(outputs):
        bits = t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16).to(torch.int64)
        total += (i + 1) * int(bits.sum())
    return total


def child(kernel: str, rep_ms: int) -> None:
    import torch
    import triton

    rows = []
    for B, H, S, D, causal in SHAPES[kernel]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
        if kernel == "bwd":  # the public backward (autograd.grad of mxfp8_attn_func) from bf16, beside SDPA cuDNN's
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from mxattn import mxfp8_attn_func
            leaves = [t.detach().requires_grad_() for t in x[:3]]
            out_m = mxfp8_attn_func(*leaves, causal=causal)
            fn = lambda: torch.autograd.grad(out_m, leaves, x[3], retain_graph=True)  # noqa: E731
            lt = [t.transpose(1, 2).detach().requires_grad_() for t in x[:3]]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out_c = torch.nn.functional.scaled_dot_product_attention(*lt, is_causal=causal)
            sdpa = lambda: torch.autograd.grad(out_c, lt, x[3].transpose(1, 2), retain_graph=True)  # noqa: E731
            products = 5
            digest = _digest(fn())
            ms = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
            ms_c = triton.testing.do_bench(sdpa, warmup=10, rep=rep_ms, return_mode="median")
            flops = products * 2 * B * H * S * S * D * (0.5 if causal else 1.0)
            rows.append({"B": B, "Hq": H, "Hkv": H, "S": S, "D": D, "causal": causal, "ms": ms,
                         "tflops": flops / ms / 1e9, "digest": digest, "sdpa_cudnn_ms": ms_c,
                         "ratio_vs_sdpa_cudnn_bf16": ms_c / ms})
            continue
        if kernel in ("fwd-gluon", "fwd-tl"):
            from mxattn.kernels.quantize import row_scaled_triton
            ops = (row_scaled_triton(x[0], "q"), row_scaled_triton(x[1], "k"), row_scaled_triton(x[2], "v"))
            if kernel == "fwd-gluon":
                from mxattn.kernels import attn_fwd_gluon as m
                cfg = m.default_config(D, causal)
                fn = lambda: m.attn_fwd_gluon(*ops, causal=causal, config=cfg)  # noqa: E731
            else:
                from mxattn.kernels import attn_fwd as m
                cfg = m.default_config(D, causal)
                fn = lambda: m.attn_fwd_hopper(*ops, causal=causal, config=cfg)  # noqa: E731
            products = 2
        elif kernel == "dkdv":
            from mxattn.kernels import attn_bwd_dkdv_gluon as m
            ops, _ = m.dkdv_operands(*x, causal)
            cfg = m.GluonDkdvConfig(split=True, block_m=128 if D == 64 else 64)
            fn = lambda: m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=cfg)  # noqa: E731
            products = 4
        else:
            from mxattn.kernels import attn_bwd_dq_gluon as m
            ops, _ = m.dq_operands(*x, causal)
            cfg = m.GluonDqConfig(split=True, block_n=128 if D == 64 else 64)
            fn = lambda: m.attn_bwd_dq_gluon(**ops, causal=causal, config=cfg)  # noqa: E731
            products = 3
        digest = _digest(fn())  # bit changes between settings show here
        ms = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
        flops = products * 2 * B * H * S * S * D * (0.5 if causal else 1.0)
        rows.append({"B": B, "Hq": H, "Hkv": H, "S": S, "D": D, "causal": causal, "ms": ms,
                     "tflops": flops / ms / 1e9, "digest": digest})
    print("ROWS " + json.dumps(rows), flush=True)


def settings(var, value: str) -> dict:
    """The environment one value stands for: ``var=value``, or, where the value holds "=", its own comma-separated
    assignments (``MXATTN_FWD_PERSISTENT=0,MXATTN_CAUSAL_LPT=1``)."""
    if "=" not in value:
        return {var: value}
    return dict(kv.split("=", 1) for kv in value.split(","))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--var", required=False)
    ap.add_argument("--values", nargs="+", default=["0", "1"])
    ap.add_argument("--kernel", choices=sorted(SHAPES), default="fwd-gluon")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.kernel, args.rep_ms)
        return
    if not args.var and not all("=" in v for v in args.values):
        ap.error("--var is required (the import-time variable whose values take turns), unless every value is a "
                 "setting of its own (VAR=x[,VAR2=y])")
    runs = {v: [] for v in args.values}
    label = lambda v: v if "=" in v else f"{args.var}={v}"  # noqa: E731
    for t in range(args.turns):
        for v in args.values:
            env = dict(os.environ, **settings(args.var, v))
            r = subprocess.run([sys.executable, __file__, "--child", "--kernel", args.kernel, "--rep-ms",
                                str(args.rep_ms)], env=env, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("ROWS ")]
            if r.returncode or not line:
                print(f"turn {t} {label(v)}: failed (rc {r.returncode})\n{r.stderr[-3000:]}", flush=True)
                continue
            runs[v].append(json.loads(line[0][5:]))
            print(f"turn {t} {label(v)}: " + ", ".join(f"{x['ms']:.3f}" for x in runs[v][-1]), flush=True)
    base = args.values[0]
    rows = []
    for i, (B, H, S, D, causal) in enumerate(SHAPES[args.kernel]):
        ms = {v: [run[i]["ms"] for run in runs[v]] for v in args.values if runs[v]}
        if base not in ms:
            break
        med = {v: statistics.median(x) for v, x in ms.items()}
        digests = {v: sorted({run[i]["digest"] for run in runs[v]}) for v in ms}
        row = {"B": B, "Hq": H, "Hkv": H, "S": S, "D": D, "causal": causal, "kernel": args.kernel,
               "variable": args.var, "turns_ms": ms, "ms": med, "tflops": {v: run_tf for v, run_tf in (
                   (v, statistics.median([run[i]["tflops"] for run in runs[v]])) for v in ms)},
               "speedup": {v: med[base] / x for v, x in med.items()},
               "faster_every_turn": {v: all(b > x for b, x in zip(ms[base], ms[v])) for v in ms},
               "same_output": len({d for x in digests.values() for d in x}) == 1}
        if args.kernel == "bwd":
            row["ratio_vs_sdpa_cudnn_bf16"] = {v: statistics.median([run[i]["ratio_vs_sdpa_cudnn_bf16"]
                                                                     for run in runs[v]]) for v in ms}
        print(f"B{B} H{H} S{S} d{D} causal={causal}: " + ", ".join(
            f"{label(v)} {med[v]:.3f} ms {row['speedup'][v]:.3f}x{'*' if row['faster_every_turn'][v] else ''}"
            for v in ms) + f", same output {row['same_output']}", flush=True)
        rows.append(row)
    if args.out and rows:
        from mxattn.bench.results import write_result
        what = {"fwd-gluon": "cost_probe", "fwd-tl": "cost_probe", "dq": "attn_bwd_kernels", "dkdv": "attn_bwd_kernels",
                "bwd": "attn_bwd_env_turns"}[args.kernel]  # (not "attn_bwd": the README grid's table)
        print(write_result(what, rows, args.out, extra={"variable": args.var, "values": args.values,
                                                         "turns": args.turns}))


if __name__ == "__main__":
    main()
