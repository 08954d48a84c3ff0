"""Sweep forward tile configs on the GPU against SDPA (cuDNN / flash BF16) measured in the same run.

    PYTHONPATH=. python benchmarks/tune_attn_fwd.py --out OUTDIR [--quick]

Times the kernel on prepared FP8 operands (the end-to-end path, producers upstream) and the whole
BF16 -> MXFP8 -> attention path; writes attn_fwd_tune-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess

import torch
import triton
from tqdm import tqdm

from mxattn import interface
from mxattn.kernels.attn_fwd import FwdConfig, attn_fwd_hopper, default_config


def _time(fn, rep_ms=100):
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def _sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shapes = [(2, 16, 16, 4096, 128), (2, 16, 16, 8192, 128), (2, 16, 16, 4096, 64), (2, 16, 16, 2048, 128)]
    if args.quick:
        shapes = shapes[:2]
    cfgs = [FwdConfig(*c) for c in ((64, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2), (128, 64, 4, 3),
                                    (64, 64, 4, 4), (64, 128, 8, 3))]
    rows = []
    dev = torch.cuda.get_device_name()
    for (B, Hq, Hkv, S, D), causal in tqdm(list(itertools.product(shapes, (False, True))), desc="shapes"):
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        flops = 4 * B * Hq * S * S * D * (0.5 if causal else 1.0)
        tf = lambda ms: flops / ms / 1e9
        from mxattn.kernels.quantize import row_scaled_triton

        qr, kr, vr = (row_scaled_triton(t, r) for t, r in ((q, "q"), (k, "k"), (v, "v")))
        prep_ms = _time(lambda: [row_scaled_triton(t, r) for t, r in ((q, "q"), (k, "k"), (v, "v"))])
        res = {}
        for name, be in (("sdpa_cudnn_bf16", "cudnn"), ("sdpa_flash_bf16", "flash")):
            try:
                res[name] = tf(_time(_sdpa(q, k, v, causal, be)))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded as None
                res[name] = None
        best = None
        per_cfg = {}
        for cfg in cfgs:
            try:
                ms = _time(lambda: attn_fwd_hopper(qr, kr, vr, causal=causal, config=cfg))
            except Exception as e:  # noqa: BLE001 - out of resources for this tile; skip it
                continue
            per_cfg[f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"] = tf(ms)
            if best is None or tf(ms) > best[1]:
                best = (cfg, tf(ms))
        dcfg = default_config(D, causal)
        res["mxattn_default"] = tf(_time(lambda: attn_fwd_hopper(qr, kr, vr, causal=causal, config=dcfg)))
        res["mxattn_best"] = best[1]
        res["mxattn_e2e_from_bf16"] = tf(_time(lambda: interface.mxfp8_attn_func(q, k, v, causal=causal)))
        row = dict(B=B, Hq=Hq, Hkv=Hkv, Sq=S, Sk=S, D=D, causal=causal, tflops=res,
                   best_config=str(best[0]), default_config=str(dcfg), per_config=per_cfg, prepare_qkv_ms=prep_ms,
                   ratio_vs_sdpa_cudnn_bf16=(res["mxattn_default"] / res["sdpa_cudnn_bf16"]) if res["sdpa_cudnn_bf16"] else None)
        rows.append(row)
        print(f"S={S} D={D} causal={causal}: default {res['mxattn_default']:.0f} best {best[1]:.0f} ({best[0]}) "
              f"prep {prep_ms:.3f} ms "
              f"e2e {res['mxattn_e2e_from_bf16']:.0f} cudnn {res['sdpa_cudnn_bf16']} flash {res['sdpa_flash_bf16']}", flush=True)
    try:
        commit = os.environ.get("MXATTN_COMMIT") or subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    out = dict(what="attn_fwd_tune", gpu=dev, torch=torch.__version__, triton=triton.__version__, commit=commit,
               date=datetime.date.today().isoformat(), rows=rows)
    path = os.path.join(args.out, f"attn_fwd_tune-{dev.replace(' ', '_')}-{out['date']}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
