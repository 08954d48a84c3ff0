"""Cost split of the fused-dQ dK/dV kernel (timing only; the probe builds give wrong dq).

    MXATTN_DQ_PROBE=<0..4> PYTHONPATH=. python3 scripts/probe_fused_dq.py [--compile-only] OUT.jsonl

Probe (attn_bwd_dkdv_gluon.DQ_PROBE): 0 as built, 1 no dS store, 3 the adds as never-taken plain stores,
4 nothing but the exponent (2 crashed ptxas).  Appends one JSON line per shape: fused_ms, and for probe 0 also
split_ms and dkdv_only_ms (scripts/bench_fused_dq.kernel_row)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused_dq import _ms, kernel_row, prepared_operands  # noqa: E402

SHAPES = [(2, 16, 8192, 64, False), (2, 16, 8192, 64, True), (8, 12, 2048, 64, True)]


def main():
    compile_only = "--compile-only" in sys.argv
    out = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    probe = int(os.environ.get("MXATTN_DQ_PROBE", "0"))
    from mxattn.kernels.attn_bwd_dkdv_gluon import attn_bwd_dkdv_dq_gluon
    for B, H, S, D, causal in ([(1, 2, 256, 64, False), (1, 2, 256, 64, True)] if compile_only else SHAPES):
        if probe == 0 and not compile_only:
            row = kernel_row(B, H, S, D, causal)
        else:
            ops, dkdv = prepared_operands(B, H, S, D, causal)
            fn = lambda: attn_bwd_dkdv_dq_gluon(**dkdv, k_seq=ops["k_seq"], causal=causal)  # noqa: E731
            if compile_only:
                fn()
                torch.cuda.synchronize()
                continue
            row = {"B": B, "H": H, "S": S, "D": D, "causal": causal, "fused_ms": _ms(fn)}
        row["probe"] = probe
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
