"""Diagnostic: the dense forward with V channel rows as long as a jagged batch's (B16 S2048 H16 d128); GPU."""
import torch, time
from triton.testing import do_bench
from mxattn.formats import RowScaledFP8
from mxattn.kernels.quantize import row_scaled_triton
from mxattn.kernels.attn_fwd import attn_fwd_hopper
t0 = time.time()
B, S, H, D = 16, 2048, 16, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
qr, kr, vr = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
row = B * S + 16 * B
buf = torch.zeros(B, H, D, row, dtype=torch.uint8, device="cuda")
buf[..., :S] = vr.data.permute(0, 2, 3, 1).view(torch.uint8)
vw = RowScaledFP8(buf[..., :S].permute(0, 3, 1, 2).view(torch.float8_e4m3fn), vr.exp, vr.dim)
o1, _ = attn_fwd_hopper(qr, kr, vr); o2, _ = attn_fwd_hopper(qr, kr, vw)
print("same output:", torch.equal(o1, o2), "compile s", round(time.time() - t0, 1), flush=True)
for rep in range(2):
    a = do_bench(lambda: attn_fwd_hopper(qr, kr, vr), rep=60)
    b = do_bench(lambda: attn_fwd_hopper(qr, kr, vw), rep=60)
    print(f"dense V rows {S}: {a:.4f} ms; V rows {row}: {b:.4f} ms; ratio {a / b:.4f}", flush=True)
