"""Why an eager call reads slower than its CUDA-graph replay: host time, hidden synchronizations, allocator traffic.

    PYTHONPATH=. python scripts/eager_gap.py [OUTDIR] [--shapes B,S,H,D,causal ...]

For each shape and for mxattn's forward (no grad) and backward alone (``autograd.grad`` on a retained graph, as
``mxattn bench`` times them), beside SDPA's default backend:
- ``event_us``: the bench's number (``bench.speed.time_ms``: one pair of CUDA events a call, median);
- ``host_us``: the host's own time per call (perf_counter over back-to-back calls, no synchronization inside);
- ``sync``: whether one call waits for the GPU: a ~20 ms ``torch.cuda._sleep`` is queued first and the call's host
  time is read; a call that synchronizes (``.item()``, a blocking copy, ``cudaFree`` in the allocator) takes the
  sleep's time;
- the caching allocator's device allocations / frees and retries over those calls (``torch.cuda.memory_stats``).
Rows go to OUTDIR/eager_gap.json (``bench.results.write_result``) and a table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mxattn.bench import speed
from mxattn.bench.results import write_result

SLEEP_CYCLES = 40_000_000  # ~20 ms at 1.98 GHz


def _alloc_stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                     "num_sync_all_streams")}


def _host_us(fn, n: int, calls: int = 30) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i % n)
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def _sync_us(fn, n: int) -> float:
    """Host time of one call queued behind a ~20 ms GPU sleep (median of 3)."""
    out = []
    for i in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn(i % n)
        out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def measure(shape: speed.Shape, dev: torch.device) -> list[dict]:
    x = speed._make_inputs(shape, dev, seed=0)
    n = len(x.q)
    rows = []
    for name, attn in (("mxattn", speed._mxattn), ("sdpa", speed._sdpa(None))):
        fwd, bwd, _ = speed._autograd_runners(attn, x, shape.causal, False, True)
        for what, fn in (("fwd", fwd), ("bwd", bwd)):
            for i in range(3):
                fn(i % n)
            torch.cuda.synchronize()
            before = _alloc_stats()
            host = _host_us(fn, n)
            after = _alloc_stats()
            row = dict(shape.as_row(), method=name, direction=what, copies=n,
                       event_us=speed.time_ms(fn, n, dev) * 1e3, host_us=host, sync_probe_us=_sync_us(fn, n),
                       **{k: after[k] - before[k] for k in before})
            row["syncs"] = row["sync_probe_us"] > 0.5 * SLEEP_CYCLES / 2e3  # half the sleep, in us at ~2 GHz
            rows.append(row)
            print(f"{str(shape):28s} {name:7s} {what}  event {row['event_us']:8.1f} us  host {host:8.1f} us  "
                  f"behind a sleep {row['sync_probe_us']:9.1f} us  device allocs/frees/retries "
                  f"{row['num_device_alloc']}/{row['num_device_free']}/{row['num_alloc_retries']}", flush=True)
        del fwd, bwd
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=".")
    ap.add_argument("--shapes", nargs="*", default=["2,2048,16,128,0", "2,2048,16,128,1", "2,2048,16,64,0",
                                                    "2,2048,16,64,1", "2,4096,16,128,0"])
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for s in args.shapes:
        B, S, H, D, c = map(int, s.split(","))
        rows += measure(speed.Shape(B, H, H, S, S, D, bool(c)), dev)
    print(write_result("eager_gap", rows, args.out))


if __name__ == "__main__":
    main()
