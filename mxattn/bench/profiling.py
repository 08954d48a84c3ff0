"""Device time per CUDA kernel from ``torch.profiler`` (scripts/profile_attn.py, ``mxattn.distributed``'s ring
benchmark)."""

from __future__ import annotations

from typing import Callable


def kernel_table(prof, calls: int) -> list[dict]:
    """Kernels of a finished ``torch.profiler.profile`` sorted by device time: {kernel (name, cut at 90 characters),
    us_per_call, launches_per_call}, per call of the profiled function (``calls`` of them ran)."""
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:  # older torch
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us <= 0:
            continue
        rows.append({"kernel": ev.key[:90], "us_per_call": dev_us / calls, "launches_per_call": ev.count / calls})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows


def profile_kernels(fn: Callable[[], object], calls: int = 2, top: int = 30) -> dict:
    """Run ``fn`` once to warm up, then ``calls`` times under the profiler (CPU and CUDA activities); returns
    {device_us_per_call (sum over kernels: overlapping streams count twice), kernels (the ``top`` first rows of
    ``kernel_table``)}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = kernel_table(prof, calls)
    return {"device_us_per_call": sum(r["us_per_call"] for r in table), "kernels": table[:top]}
