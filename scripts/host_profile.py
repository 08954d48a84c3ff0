"""Host (CPU) time of one public attention call on the GPU machine, by Python function (cProfile).

    PYTHONPATH=. python scripts/host_profile.py [--shape B,H,S,D] [--calls N] [--top N]

The GPU work of a small call (S 2k) takes ~0.1-0.2 ms; when the Python side that launches it takes longer, the
call is host-bound and the GPU idles. This prints, for the forward and for forward+backward: the CPU time per
call when nothing waits for the GPU, and the functions where that time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,16,2048,128")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    from mxattn import mxfp8_attn_func

    B, H, S, D = (int(x) for x in args.shape.split(","))
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            mxfp8_attn_func(q, k, v)

    def fwd_bwd():
        mxfp8_attn_func(qg, kg, vg).backward(do)

    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"===== {name}: {host:.0f} us of host time per call (B{B} H{H} S{S} D{D})")
        print(s.getvalue())
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
