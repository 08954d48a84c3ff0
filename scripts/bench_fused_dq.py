"""Time the fused-dQ backward (``GluonDkdvConfig(fuse_dq=True)``, session 13) against the default split kernels, on
the GPU, in one run.

    PYTHONPATH=. python3 scripts/bench_fused_dq.py OUTDIR [B,H,S,D,causal ...]

Per shape (default: B2 H16 S4k / S8k d64 both masks, and the training run's B8 H12 S2k d64 causal):
* kernels on the same prepared operands: ``split_ms`` = the split dK/dV kernel (128-query steps) plus the split dQ
  kernel (128-key steps), the API's default pair at D = 64; ``fused_ms`` = ``attn_bwd_dkdv_dq_gluon`` (dK/dV and
  dQ from one launch, plus its zeroing of the fp32 dQ buffer and the pass that scales it into bf16);
* the public backward through autograd (``torch.autograd.grad`` of the output) from BF16 inputs with
  MXATTN_BWD_FUSED_DQ unset and set, and
  SDPA cuDNN BF16's, the forward outside the timed region (``backward_ms``).
TFLOP/s count 2.5 forward-equivalents (5 products of 2·B·H·S²·D; half when causal) for the whole backward and
for both kernel rows.  One JSON (``attn_bwd_fused_dq-*.json``) under OUTDIR.
"""
from __future__ import annotations

import os
import sys

import torch
import triton


def _ms(fn, rep: int = 200) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def prepared_operands(B, H, S, D, causal) -> tuple[dict, dict]:
    """The backward kernels' operands of seeded random bf16 q, k, v, dO (B, S, H, D): (all of them, the dK/dV
    launcher's keyword arguments)."""
    from mxattn.kernels.attn_bwd_dq_gluon import backward_operands

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    names = ("q", "k", "v_hdim", "q_seq", "k_seq", "dout_hdim", "dout_seq", "lse", "delta")
    ops, _ = backward_operands(q, k, v, dout, causal, names)
    return ops, {n: ops[n] for n in names if n != "k_seq"}


def kernel_row(B, H, S, D, causal) -> dict:
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, attn_bwd_dkdv_dq_gluon, attn_bwd_dkdv_gluon
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon

    ops, dkdv = prepared_operands(B, H, S, D, causal)
    kc, qc = GluonDkdvConfig(split=True, block_m=128), GluonDqConfig(split=True, block_n=128)

    def split():
        attn_bwd_dkdv_gluon(**dkdv, causal=causal, config=kc)
        attn_bwd_dq_gluon(ops["q"], ops["k"], ops["v_hdim"], ops["k_seq"], ops["dout_hdim"], ops["lse"],
                          ops["delta"], causal=causal, config=qc)

    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    row = {"B": B, "H": H, "S": S, "D": D, "causal": causal}
    row["split_ms"] = _ms(split)
    row["fused_ms"] = _ms(lambda: attn_bwd_dkdv_dq_gluon(**dkdv, k_seq=ops["k_seq"], causal=causal))
    row["dkdv_only_ms"] = _ms(lambda: attn_bwd_dkdv_gluon(**dkdv, causal=causal, config=kc))
    for n in ("split", "fused"):
        row[f"{n}_tflops"] = flops / row[f"{n}_ms"] / 1e9
    row["fused_speedup"] = row["split_ms"] / row["fused_ms"]
    return row


def public_row(B, H, S, D, causal) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mxattn import mxfp8_attn_func

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    row = {}

    def bwd_ms(fwd):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fwd(*leaves)
        return _ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))

    for name, fused in (("mxattn", "0"), ("mxattn_fused_dq", "1")):
        os.environ["MXATTN_BWD_FUSED_DQ"] = fused
        row[f"{name}_backward_ms"] = bwd_ms(lambda a, b, c: mxfp8_attn_func(a, b, c, causal=causal))
    os.environ.pop("MXATTN_BWD_FUSED_DQ")

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=causal).transpose(1, 2)

    row["sdpa_cudnn_bf16_backward_ms"] = bwd_ms(sdpa)
    for name in ("mxattn", "mxattn_fused_dq", "sdpa_cudnn_bf16"):
        row[f"{name}_backward_tflops"] = flops / row[f"{name}_backward_ms"] / 1e9
    for name in ("mxattn", "mxattn_fused_dq"):
        row[f"{name}_vs_cudnn"] = row["sdpa_cudnn_bf16_backward_ms"] / row[f"{name}_backward_ms"]
    return row


def main(argv) -> None:
    from mxattn.bench.results import write_result

    out = argv[0]
    shapes = argv[1:] or ["2,16,4096,64,0", "2,16,4096,64,1", "2,16,8192,64,0", "2,16,8192,64,1", "8,12,2048,64,1"]
    rows = []
    for s in shapes:
        B, H, S, D, c = (int(x) for x in s.split(","))
        row = kernel_row(B, H, S, D, bool(c))
        row |= public_row(B, H, S, D, bool(c))
        print(row, flush=True)
        rows.append(row)
    print(write_result("attn_bwd_fused_dq", rows, out, extra={"note": "fused dQ (GluonDkdvConfig.fuse_dq) vs the "
                                                                      "split dK/dV + dQ kernels, and the public "
                                                                      "backward vs SDPA cuDNN BF16, one run"}))


if __name__ == "__main__":
    main(sys.argv[1:])
