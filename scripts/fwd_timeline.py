"""Where a Gluon forward CTA spends its time: the timing probe of ``attn_fwd_gluon`` (its ``TIMES`` buffer).

    python scripts/fwd_timeline.py [--out FILE] [--causal] [--seqlens 2048,4096,8192] [--head-dim 128]
        [--out-store mma,rows] [--persistent]

Each consumer warpgroup of each CTA records clock64 at its start, after Q's wait, after its KV loop and after its
output, plus globaltimer at start and end, its SM and its key tiles.  Per shape (B2 H16, FP8 operands) this prints
the medians over warpgroups: Q wait, KV loop per key tile, output, in SM cycles, and the gaps between one CTA's end
and the next CTA's start on the same SM (ns), then what share of the SMs' time the KV loops fill.  Why: the
session-16 grid fits ~7.5 key tiles of time per CTA outside the steady loop, and a persistent kernel did not
recover it (docs/perf-notes-attn-fwd-gluon.md, session 18); this says which part it is.  Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def timeline(B: int, H: int, S: int, D: int, causal: bool, runs: int = 3, out_store: str = "mma",
             persistent: bool = False) -> dict:
    from mxattn.kernels import attn_fwd_gluon as g
    from mxattn.kernels.quantize import row_scaled_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(B, S, H, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    ops = row_scaled_triton(x[0], "q"), row_scaled_triton(x[1], "k"), row_scaled_triton(x[2], "v")
    n_m = -(-S // 128)
    times = torch.zeros(n_m * B * H, 2, 8, dtype=torch.int64, device="cuda")
    for _ in range(runs):  # the last run's records stay (the first compiles)
        g.attn_fwd_gluon(*ops, causal=causal, _times=times,
                         config=dataclasses.replace(g.default_config(D, causal), out_store=out_store,
                                                    persistent=persistent))
    torch.cuda.synchronize()
    summary = summarize(times.cpu(), torch.cuda.get_device_properties(0).clock_rate)
    return dict(B=B, H=H, S=S, D=D, causal=causal, out_store=out_store, persistent=persistent) | summary


def summarize(t: torch.Tensor, clock_khz: float) -> dict:
    """The probe's records (int64 [CTAs, 2, 8], ``_row_block``'s layout) -> medians over warpgroups, CTA gaps per SM
    and the share of the SMs' time inside the KV loops (loop cycles at the nominal clock)."""
    q_wait = (t[..., 1] - t[..., 0]).flatten().tolist()
    loop = (t[..., 2] - t[..., 1]).flatten()
    tiles = t[..., 6].flatten()
    per_tile = (loop[tiles > 0].double() / tiles[tiles > 0].double()).tolist()
    out = (t[..., 3] - t[..., 2]).flatten().tolist()
    cta_start = t[:, :, 4].min(1).values
    cta_end = t[:, :, 7].max(1).values
    sm = t[:, 0, 5]
    gaps = []
    for s_id in sm.unique().tolist():  # per SM, CTAs in start order: from one's end to the next one's start
        idx = (sm == s_id).nonzero().flatten()
        order = idx[cta_start[idx].argsort()]
        gaps += [(cta_start[b] - cta_end[a]).item() for a, b in zip(order[:-1].tolist(), order[1:].tolist())]
    span = (cta_end.max() - cta_start.min()).item()
    loop_ns = (loop.double() / (clock_khz * 1e3) * 1e9).view(-1, 2).max(1).values.sum().item()
    n_sms = len(sm.unique())

    def med(v):
        return statistics.median(v) if v else None

    return dict(ctas=int(t.shape[0]), sms=n_sms, q_wait_cycles=med(q_wait), loop_cycles_per_tile=med(per_tile),
                output_cycles=med(out), cta_gap_ns=med(gaps),
                cta_gap_ns_p90=sorted(gaps)[int(0.9 * len(gaps))] if gaps else None, kernel_span_ns=span,
                loop_share=loop_ns / (n_sms * span) if span else None, tiles_per_cta=med(tiles.tolist()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out-store", default="mma", help="comma list of GluonFwdConfig.out_store values to probe")
    ap.add_argument("--persistent", action="store_true", help="the persistent kernel: one record per work item, "
                    "and cta_gap_ns is then the idle time between one item's end and the next item's start on an SM")
    args = ap.parse_args(argv)
    rows = []
    for S, st in ((int(s), st) for s in args.seqlens.split(",") for st in args.out_store.split(",")):
        r = timeline(2, 16, S, args.head_dim, args.causal, out_store=st, persistent=args.persistent)
        rows.append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    if args.out:
        from mxattn.bench.results import env_info

        with open(args.out, "w") as f:
            json.dump({"what": "fwd_timeline", **env_info(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
