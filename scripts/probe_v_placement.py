"""Does the placement of V's MX input against its output change the speed of V from MX (``row_scaled_triton(mx,
"v")``)?  Session 16 saw that path bimodal (~82 % or ~34 % of copy) between bench calls whatever the tile, while
dequantize of the same input was steady: a partition-camping suspect (channel-major rows read and written at the same
offsets of two buffers).  This times the call on one MX tensor copied into one buffer at several byte offsets
(the library's output buffer stays where the caching allocator put it), each twice, and prints ms and the input's
address against the output's.

    PYTHONPATH=. python3 scripts/probe_v_placement.py [OUT.json] [B S H D]
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

from mxattn import formats as F
from mxattn.kernels import quantize as kq


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    B, S, H, D = (int(v) for v in sys.argv[2:6]) if len(sys.argv) > 5 else (8, 8192, 16, 128)
    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    mx = kq.quantize_mxfp8_triton(x, "seq")
    s_pad = -(-S // 16) * 16
    n = B * H * D * s_pad
    src = mx.data.permute(0, 2, 3, 1)  # (B, H, D, S) view of the channel-major buffer
    big = torch.empty(n + (64 << 20), dtype=torch.uint8, device="cuda")
    rows = []
    ref = None
    for off in (0, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 3 << 20, 16 << 20, 33 << 20, 0, 1 << 20):
        buf = big[off:off + n].view(B, H, D, s_pad)
        buf[..., :S].copy_(src.view(torch.uint8))
        m = F.MXTensor(buf[..., :S].permute(0, 3, 1, 2).view(torch.float8_e4m3fn), mx.scale, 1)
        r = kq.row_scaled_triton(m, "v")
        if ref is None:
            ref = r
        assert torch.equal(r.data.view(torch.uint8), ref.data.view(torch.uint8)), "placement changed the bytes"
        ms = triton.testing.do_bench(lambda: kq.row_scaled_triton(m, "v"), warmup=25, rep=100, return_mode="median")
        o = r.data.untyped_storage().data_ptr()
        i = buf.data_ptr()
        row = {"offset": off, "ms": ms, "in_minus_out_mod_2MB": (i - o) % (2 << 20), "in_minus_out": i - o,
               "pct_of_copy_bytes": None}
        rows.append(row)
        print(f"offset {off >> 10:>6} KB  {ms:.4f} ms  (in - out) = {i - o:>14}  mod 2 MB {(i - o) % (2 << 20):>8}",
              flush=True)
    if out_path:
        json.dump({"shape": [B, S, H, D], "rows": rows}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
