"""The Gluon forward with P carried packed (``GluonFwdConfig.p_carry="i32br"``) beside the fp32 carry, the `tl` kernel
and SDPA cuDNN BF16, one run (tests/test_attn_fwd_gluon.bench_gluon_vs_tl):

    PYTHONPATH=. python3 scripts/bench_p_carry.py OUT.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    from mxattn.bench.speed import Shape
    from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig
    from test_attn_fwd_gluon import bench_gluon_vs_tl

    shapes = [Shape(2, H, H, S, S, D, c) for H, S, D, c in
              ((16, 8192, 128, False), (16, 8192, 128, True), (16, 4096, 128, False), (16, 8192, 64, False))]
    configs = {"i32br": GluonFwdConfig(p_carry="i32br"), "fp32": GluonFwdConfig(p_carry="fp32")}
    rows = bench_gluon_vs_tl(shapes, progress=False, configs=configs)
    for r in rows:
        print(r.get("Sq"), r.get("D"), r.get("causal"), {k: round(v) for k, v in r["tflops"].items() if v}, flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
