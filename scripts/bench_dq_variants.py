"""Time two builds of the Gluon dQ kernel in turns on the same operands (GPU).

    PYTHONPATH=. python3 scripts/bench_dq_variants.py OUTDIR [--turns N] [--rep-ms MS]

The API's build (split, 64-key step at d128, 128-key at d64) without ``amax_slots`` ("base") and with it ("slots",
the API's default since session 23).  (Session 23's "pipe" variants, S and dP issued one tile ahead, measured
slower and were removed; they are in the history at commit a73fb2c.  So was the option of one release per ring
stage for K, V and K_seq, "slots_one" (and "slots_one_st4" with a 4-stage ring): 0.77-0.92x of "slots" on an H100
in session 24, ``attn_bwd_kernels-…-s24-dq-one-empty.json``; its code is in the history at commit 7639a3a.)  Per
shape the variants take turns, each turn a ``triton.testing.do_bench`` median; a row keeps every turn's ms, the
medians over turns, ``speedup`` (base / variant) and whether the variant was faster than base in every turn.
Shapes: B2 H16 d128 S 4k / 8k and d64 S 8k, both masks.  One JSON (``attn_bwd_kernels-…``) under OUTDIR.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import triton

from mxattn.bench.results import write_result
from mxattn.kernels import attn_bwd_dq_gluon as m

SHAPES = [(2, 16, 4096, 128, False), (2, 16, 4096, 128, True), (2, 16, 8192, 128, False),
          (2, 16, 8192, 128, True), (2, 16, 8192, 64, False), (2, 16, 8192, 64, True)]


def api_config(D: int) -> m.GluonDqConfig:
    """The dQ build ``attn_bwd.attn_bwd_hopper`` launches on dense inputs (split; 128 keys a step at d64)."""
    return m.GluonDqConfig(split=True, block_n=128 if D == 64 else 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--variants", nargs="+", choices=["base", "slots"], default=["base", "slots"],
                    help="base is always timed")
    args = ap.parse_args()
    rows = []
    for B, H, S, D, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        ops, _ = m.dq_operands(q, k, v, dout, causal)
        base = api_config(D)
        base = dataclasses.replace(base, amax_slots=False)
        cfgs = {"base": base, "slots": dataclasses.replace(base, amax_slots=True)}
        cfgs = {n: c for n, c in cfgs.items() if n == "base" or n in args.variants}
        outs = {n: m.attn_bwd_dq_gluon(**ops, causal=causal, config=c) for n, c in cfgs.items()}
        same = all(torch.equal(outs["base"].view(torch.int16), o.view(torch.int16)) for o in outs.values())
        ms = {n: [] for n in cfgs}
        for _ in range(args.turns):
            for n, c in cfgs.items():
                ms[n].append(triton.testing.do_bench(lambda: m.attn_bwd_dq_gluon(**ops, causal=causal, config=c),
                                                     warmup=10, rep=args.rep_ms, return_mode="median"))
        med = {n: statistics.median(v) for n, v in ms.items()}
        flops = 3 * 2 * B * H * S * S * D * (0.5 if causal else 1.0)
        row = {"B": B, "Hq": H, "Hkv": H, "S": S, "D": D, "causal": causal, "kernel": "dq", "bit_identical": same,
               "turns_ms": ms, "ms": med, "tflops": {n: flops / v / 1e9 for n, v in med.items()},
               "speedup": {n: med["base"] / v for n, v in med.items()},
               "faster_every_turn": {n: all(b > x for b, x in zip(ms["base"], v)) for n, v in ms.items()}}
        print(f"B{B} H{H} S{S} d{D} causal={causal}: bit-identical {same}; "
              + ", ".join(f"{n} {med[n]:.3f} ms {row['speedup'][n]:.3f}x{'*' if row['faster_every_turn'][n] else ''}"
                          for n in cfgs), flush=True)
        rows.append(row)
    extra = {"variants": "dq: base, amax_slots"}
    print(write_result("attn_bwd_kernels", rows, args.out, extra=extra))


if __name__ == "__main__":
    main()
