"""Where the time of one attention call goes, kernel by kernel (GPU only).

    PYTHONPATH=. python scripts/profile_attn.py --out DIR [--shapes B,H,S,D,causal ...]

For each shape: the public ``mxfp8_attn_func`` forward and forward+backward from BF16 inputs, and SDPA cuDNN BF16
in the same run, under ``torch.profiler``. Prints the CUDA kernels sorted by device time (per call) and the wall
time per call, and writes ``profile_attn.json`` with the same numbers.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mxattn.bench.profiling import kernel_table


def _wall_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_shape(B: int, H: int, S: int, D: int, causal: bool, calls: int = 10, ring: bool = False) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from mxattn import mxfp8_attn_func

    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            mxfp8_attn_func(q, k, v, causal=causal)

    def fwd_bwd():
        o = mxfp8_attn_func(qg, kg, vg, causal=causal)
        o.backward(do)

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))

    def sdpa_fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        o.backward(do.transpose(1, 2))

    cases = [("mxattn_fwd", fwd), ("mxattn_fwd_bwd", fwd_bwd), ("sdpa_cudnn_fwd", sdpa_fwd),
             ("sdpa_cudnn_fwd_bwd", sdpa_fwd_bwd)]
    if ring:  # the ring's blocks on one rank (world 1: every block, no wire): its cost over the single call
        from mxattn.distributed import ring_mxfp8_attn_func

        def ring_fwd():
            with torch.no_grad():
                ring_mxfp8_attn_func(q, k, v, causal=causal)

        def ring_fwd_bwd():
            ring_mxfp8_attn_func(qg, kg, vg, causal=causal).backward(do)

        cases += [("ring1_fwd", ring_fwd), ("ring1_fwd_bwd", ring_fwd_bwd)]
    out = {"B": B, "H": H, "S": S, "D": D, "causal": causal}
    for name, fn in cases:
        for _ in range(3):
            fn()
        wall = _wall_us(fn, calls)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        table = kernel_table(prof, calls)
        out[name] = {"wall_us": wall, "device_us": sum(r["us_per_call"] for r in table), "kernels": table}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=["2,16,8192,128,0", "2,16,2048,128,0", "8,16,2048,64,0",
                                                   "2,16,4096,128,1"])
    ap.add_argument("--ring", action="store_true",
                    help="also ring_mxfp8_attn_func on a one-rank nccl group (the ring's per-block cost)")
    args = ap.parse_args(argv)
    if args.ring:
        import torch.distributed as dist

        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    results = []
    for s in args.shapes:
        B, H, S, D, c = (int(x) for x in s.split(","))
        r = profile_shape(B, H, S, D, bool(c), ring=args.ring)
        results.append(r)
        print(f"\n##### B{B} H{H} S{S} D{D} causal={bool(c)}")
        for name in [n for n in r if n.endswith(("_fwd", "_fwd_bwd"))]:
            d = r[name]
            print(f"== {name}: wall {d['wall_us']:.0f} us/call, kernels {d['device_us']:.0f} us/call")
            for row in d["kernels"][:14]:
                print(f"   {row['us_per_call']:9.1f} us  x{row['launches_per_call']:.0f}  {row['kernel']}")
    from mxattn.bench.results import write_result

    print(write_result("profile_attn", results, args.out))


if __name__ == "__main__":
    main()
