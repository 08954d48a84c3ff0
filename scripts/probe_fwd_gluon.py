"""Cost split of the Gluon forward's consumer loop (timing only; the probe builds give wrong outputs).

    MXATTN_FWD_PROBE=<0..4> PYTHONPATH=. python3 scripts/probe_fwd_gluon.py [--compile-only] OUT.jsonl

Probe (attn_fwd_gluon.FWD_PROBE): 0 the real kernel, 1 no exp2 on the scores, 2 no O rescale, 3 no row max,
4 no softmax (P = S).  Appends one JSON line per shape: TFLOP/s of the Gluon kernel on FP8 operands (the same
timing as tests/test_attn_fwd_gluon.bench_gluon_vs_tl), and for probe 0 the `tl` kernel's and SDPA cuDNN BF16's
from the same run."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SHAPES = ((2, 16, 8192, 128, False), (2, 16, 8192, 128, True), (2, 16, 4096, 128, False), (2, 16, 8192, 64, False))


def main():
    import torch

    from mxattn.bench.speed import Shape
    from test_attn_fwd_gluon import bench_gluon_vs_tl

    compile_only = "--compile-only" in sys.argv
    out = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    probe = int(os.environ.get("MXATTN_FWD_PROBE", "0"))
    if compile_only:
        from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon
        from mxattn.kernels.quantize import row_scaled_triton

        for D in (128, 64):
            for causal in (False, True):
                x = torch.randn(1, 256, 2, D, device="cuda", dtype=torch.bfloat16)
                attn_fwd_gluon(row_scaled_triton(x, "q"), row_scaled_triton(x, "k"), row_scaled_triton(x, "v"),
                               causal=causal)
        torch.cuda.synchronize()
        return
    shapes = [Shape(B, H, H, S, S, D, c) for B, H, S, D, c in SHAPES]
    for row in bench_gluon_vs_tl(shapes, progress=False):
        t = row["tflops"]
        keep = {"probe": probe, "S": row.get("Sq"), "D": row.get("D"), "causal": row.get("causal"),
                "gluon_tflops": t.get("mxattn_gluon")}
        if probe == 0:
            keep |= {"tl_tflops": t.get("mxattn_tl"), "cudnn_bf16_tflops": t.get("sdpa_cudnn_bf16")}
        print(json.dumps(keep), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(keep) + "\n")


if __name__ == "__main__":
    main()
