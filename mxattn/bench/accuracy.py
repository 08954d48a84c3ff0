"""Attention accuracy against an fp64 truth: SQNR, cosine and max relative error of out, lse, dQ, dK, dV (issue 6).

Inputs are made bf16-exact (every method starts from the same BF16 tensors a model would hold) in one of the
input families (``FAMILIES``):
    gaussian          q, k, v, dO ~ N(0, 1).
    outlier_channels  3% of the head-dim channels (at least one) of q, k, v scaled ×30; q and k are then
                      rescaled to unit RMS so that the logits stay a trained model's size rather than one-hot.
    heavy_tailed      every token row scaled by a lognormal factor: exp(N(0, 1)) for v, exp(N(0, 0.5²)) for q and
                      k (their product scales the logits: σ=1 on both makes the softmax so peaky that the
                      gradients measure the problem's conditioning more than the number format).
    attention_sink    queries share a direction u (q += 2u, |u| = 1); key 0 is 5·sqrt(D)·u, so its logit is
                      ~10 for every query, and its value is scaled ×0.1 (trained models' sinks carry little).
    long_causal       causal attention over 4× the sequence (1 batch, a quarter of the heads): long rows.

Methods (``METHODS``):
    mxfp8_ref       the reference emulation of the MXFP8 pipeline (``mxattn.reference``): q, k MX along the head
                    dim, v MX along the sequence, P quantized (constant scale 2^-8); backward with P, dS, dO
                    quantized and the other orientations (q, k along the sequence, v along the head dim).
    mxfp8_kernel    ``mxfp8_attn_func`` on the device (CUDA only: on the CPU it is the reference above).
    fp8_per_tensor  per-tensor FP8 emulated in torch: one fp32 scale per tensor (amax/448), e4m3 data for q, k,
                    v and dO, P quantized with its constant scale (one scale for all of P, which is what a
                    per-tensor P scale is); dS and the output are not quantized.
    bf16            torch ``scaled_dot_product_attention`` in bf16 with autograd (the real BF16 path; no lse).

Truths: ``fp64`` = fp64 attention on the (bf16-exact) inputs; ``fp64_mx`` = fp64 attention on the
MX-dequantized inputs (forward orientations), reported for the MXFP8 methods: it isolates what the kernel adds
to the unavoidable input quantization (DESIGN §2's acceptance rule).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "FAMILIES",
    "METHODS",
    "TENSORS",
    "AccShape",
    "default_shape",
    "make_inputs",
    "quantize_per_tensor_fp8",
    "run_accuracy",
    "format_accuracy_table",
]

FAMILIES = ("gaussian", "outlier_channels", "heavy_tailed", "attention_sink", "long_causal")
METHODS = ("mxfp8_ref", "mxfp8_kernel", "fp8_per_tensor", "bf16")
TENSORS = ("out", "lse", "dq", "dk", "dv")
MX_METHODS = ("mxfp8_ref", "mxfp8_kernel")

OUTLIER_FRACTION, OUTLIER_GAIN = 0.03, 30.0
HEAVY_SIGMA_V, HEAVY_SIGMA_QK = 1.0, 0.5
SINK_QUERY_SHIFT, SINK_KEY_GAIN, SINK_VALUE_GAIN = 2.0, 5.0, 0.1


@dataclass(frozen=True)
class AccShape:
    B: int
    H: int
    S: int
    D: int
    causal: bool = False

    def __str__(self) -> str:
        return f"B{self.B} H{self.H} S{self.S} d{self.D}{' causal' if self.causal else ''}"


def default_shape(device: str, quick: bool = False) -> AccShape:
    """Small enough on the CPU to finish all families in well under a minute on two cores."""
    if device == "cpu":
        return AccShape(1, 2, 256, 64) if quick else AccShape(1, 2, 512, 128)
    return AccShape(1, 4, 1024, 128) if quick else AccShape(2, 8, 2048, 128)


@dataclass
class Inputs:
    q: torch.Tensor  # (B, S, H, D) float64, every value exactly a bf16
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    shape: AccShape


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def make_inputs(family: str, shape: AccShape, seed: int = 0, device="cpu") -> Inputs:
    """q, k, v, dO of one family (module docstring), float64 holding bf16 values."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if family == "long_causal":
        shape = AccShape(1, max(1, shape.H // 4), 4 * shape.S, shape.D, True)
    B, S, H, D = shape.B, shape.S, shape.H, shape.D
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float64)

    q, k, v, dout = (randn(B, S, H, D) for _ in range(4))
    if family == "outlier_channels":
        n = max(1, math.ceil(OUTLIER_FRACTION * D))
        ch = torch.randperm(D, generator=g, device=device)[:n]
        for t in (q, k, v):
            t[..., ch] *= OUTLIER_GAIN
        q = q / q.pow(2).mean().sqrt()
        k = k / k.pow(2).mean().sqrt()
    elif family == "heavy_tailed":
        q, k, v = (t * (sigma * randn(B, S, H, 1)).exp()
                   for t, sigma in ((q, HEAVY_SIGMA_QK), (k, HEAVY_SIGMA_QK), (v, HEAVY_SIGMA_V)))
    elif family == "attention_sink":
        u = randn(B, 1, H, D)
        u = u / u.norm(dim=-1, keepdim=True)
        q = q + SINK_QUERY_SHIFT * u
        k[:, :1] = SINK_KEY_GAIN * math.sqrt(D) * u
        v[:, :1] *= SINK_VALUE_GAIN
    return Inputs(*(_bf16_exact(t) for t in (q, k, v, dout)), shape=shape)


def quantize_per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 (e4m3) round trip: one fp32 scale amax/448 for the whole tensor; returns ``x``'s dtype."""
    from mxattn.formats import round_to_e4m3

    amax = x.abs().amax().to(torch.float32)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    data = round_to_e4m3(x.to(torch.float32) / scale)
    return (data.to(torch.float64) * scale.to(torch.float64)).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Methods: each returns {"out", "lse", "dq", "dk", "dv"} (float64 or None) for Inputs and causal
# ----------------------------------------------------------------------------------------------

Outputs = dict


def _mx_operands(x: Inputs):
    from mxattn.formats import quantize_mxfp8

    fwd = (quantize_mxfp8(x.q, dim=3), quantize_mxfp8(x.k, dim=3), quantize_mxfp8(x.v, dim=1))
    other = dict(q_seq=quantize_mxfp8(x.q, dim=1), k_seq=quantize_mxfp8(x.k, dim=1), v_hdim=quantize_mxfp8(x.v, dim=3))
    return fwd, other


def _fp64_attention(q, k, v, dout, causal: bool) -> Outputs:
    from mxattn.reference import attention_backward, attention_forward

    out, lse = attention_forward(q, k, v, causal=causal)
    dq, dk, dv = attention_backward(q, k, v, out, dout, causal=causal)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _truths(x: Inputs, methods: Sequence[str]) -> dict[str, Outputs]:
    causal = x.shape.causal
    truths = {"fp64": _fp64_attention(x.q, x.k, x.v, x.dout, causal)}
    if any(m in MX_METHODS for m in methods):
        (qm, km, vm), _ = _mx_operands(x)
        deq = [t.dequantize(torch.float64) for t in (qm, km, vm)]
        truths["fp64_mx"] = _fp64_attention(*deq, x.dout, causal)
    return truths


def _mxfp8_ref(x: Inputs) -> Outputs:
    from mxattn.reference import attention_backward, attention_forward

    (qm, km, vm), other = _mx_operands(x)
    causal = x.shape.causal
    out, lse = attention_forward(qm, km, vm, causal=causal, quantize_p=True)
    dq, dk, dv = attention_backward(
        qm, km, vm, out, x.dout, causal=causal, quantize_p=True, quantize_ds=True, quantize_do=True, **other
    )
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _fp8_per_tensor(x: Inputs) -> Outputs:
    from mxattn.reference import attention_backward, attention_forward

    q, k, v, dout = (quantize_per_tensor_fp8(t) for t in (x.q, x.k, x.v, x.dout))
    causal = x.shape.causal
    out, lse = attention_forward(q, k, v, causal=causal, quantize_p=True)
    dq, dk, dv = attention_backward(q, k, v, out, dout, causal=causal, quantize_p=True)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _autograd(fn: Callable, x: Inputs, with_lse: bool) -> Outputs:
    """Run a bf16 (B, S, H, D) attention ``fn(q, k, v, causal)`` forward, then its backward with dO."""
    leaves = [t.to(torch.bfloat16).requires_grad_(True) for t in (x.q, x.k, x.v)]
    res = fn(*leaves, x.shape.causal)
    out, lse = res if with_lse else (res, None)
    got = {"out": out.detach().double(), "lse": None if lse is None else lse.detach().double()}
    try:
        grads = torch.autograd.grad(out, leaves, x.dout.to(out.dtype))
        got.update(zip(("dq", "dk", "dv"), (g.double() for g in grads)))
    except Exception as e:  # a forward without a (working) backward still reports its forward
        got.update(dq=None, dk=None, dv=None, error=f"backward: {type(e).__name__}: {e}")
    return got


def _mxfp8_kernel(x: Inputs) -> Outputs:
    from mxattn.interface import mxfp8_attn_func

    return _autograd(lambda q, k, v, c: mxfp8_attn_func(q, k, v, causal=c, return_lse=True), x, True)


def _bf16(x: Inputs) -> Outputs:
    import torch.nn.functional as F

    def sdpa(q, k, v, causal):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)

    return _autograd(sdpa, x, False)


_RUNNERS: dict[str, Callable[[Inputs], Outputs]] = {
    "mxfp8_ref": _mxfp8_ref,
    "mxfp8_kernel": _mxfp8_kernel,
    "fp8_per_tensor": _fp8_per_tensor,
    "bf16": _bf16,
}


def default_methods(device: str) -> list[str]:
    return [m for m in METHODS if device == "cuda" or m != "mxfp8_kernel"]


# ----------------------------------------------------------------------------------------------
# Metrics and the run
# ----------------------------------------------------------------------------------------------


def _metrics(got: Outputs, truth: Outputs) -> dict[str, dict[str, Optional[float]]]:
    from mxattn.reference import cosine, max_rel_error, sqnr_db

    res: dict[str, dict[str, Optional[float]]] = {"sqnr_db": {}, "cosine": {}, "max_rel_error": {}}
    for t in TENSORS:
        a, e = got.get(t), truth.get(t)
        ok = a is not None and e is not None
        if ok:
            a = a.to(device=e.device, dtype=torch.float64)
            if t == "lse":  # rows with no key (lse = -inf) are equal on both sides and carry no error
                keep = torch.isfinite(e)
                a, e = a[keep], e[keep]
        for name, fn in (("sqnr_db", sqnr_db), ("cosine", cosine), ("max_rel_error", max_rel_error)):
            res[name][t] = float(fn(a, e)) if ok else None
    return res


def run_accuracy(
    families: Optional[Sequence[str]] = None,
    methods: Optional[Sequence[str]] = None,
    shape: Optional[AccShape] = None,
    device: Optional[str] = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Rows: one per (family, method, truth) with the shape, ``sqnr_db`` / ``cosine`` / ``max_rel_error`` per
    tensor (None where a method gives no such tensor), ``seconds`` and ``error`` where a method failed."""
    from tqdm import tqdm

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    families = list(families or FAMILIES)
    methods = list(methods or default_methods(device))
    for name, known, given in (("family", FAMILIES, families), ("method", METHODS, methods)):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"unknown {name} {bad}; known: {', '.join(known)}")
    if "mxfp8_kernel" in methods and device != "cuda":
        raise ValueError("mxfp8_kernel needs a CUDA device (on the CPU it is the reference: use mxfp8_ref)")
    shape = shape or default_shape(device)
    rows = []
    bar = tqdm(total=len(families) * (len(methods) + 1), desc="accuracy", unit="run", disable=not progress,
               file=sys.stderr)
    for fi, family in enumerate(families):
        bar.set_postfix_str(f"{family} fp64 truth")
        x = make_inputs(family, shape, seed + fi, device)
        truths = _truths(x, methods)
        bar.update(1)
        for m in methods:
            bar.set_postfix_str(f"{family} {m}")
            t0 = time.perf_counter()
            try:
                got = _RUNNERS[m](x)
            except Exception as e:  # recorded in the row; the other methods still run
                got = {"error": f"{type(e).__name__}: {e}"}
            secs = time.perf_counter() - t0
            for truth in ("fp64", "fp64_mx") if m in MX_METHODS else ("fp64",):
                row = {"family": family, "method": m, "truth": truth, **asdict(x.shape), "seed": seed + fi,
                       **_metrics(got, truths[truth]), "seconds": round(secs, 3)}
                if got.get("error"):
                    row["error"] = str(got["error"])[:500]
                rows.append(row)
            bar.update(1)
    bar.close()
    return rows


def fmt_metric(v: Optional[float], metric: str) -> str:
    if v is None:
        return "-"
    v = float(v)
    if math.isnan(v):
        return "nan"
    return f"{v:.4f}" if metric == "cosine" else (f"{v:.1f}" if metric == "sqnr_db" else f"{v:.3g}")


def format_accuracy_table(
    rows: Sequence[dict],
    truth: str = "fp64",
    metrics: Sequence[str] = ("sqnr_db", "cosine"),
    tensors: Sequence[str] = TENSORS,
) -> str:
    """Plain-text table against one truth: a block per family, a line per method."""
    sel = [r for r in rows if r["truth"] == truth]
    short = {"sqnr_db": "dB", "cosine": "cos", "max_rel_error": "maxrel"}
    head = "".join(f"{t + ' ' + short[m]:>11}" for m in metrics for t in tensors)
    lines = [f"against {truth} ({'MX-dequantized inputs' if truth == 'fp64_mx' else 'the inputs'}):",
             f"{'family':<18}{'method':<16}{head}"]
    for r in sel:
        cells = "".join(f"{fmt_metric(r[m].get(t), m):>11}" for m in metrics for t in tensors)
        lines.append(f"{r['family']:<18}{r['method']:<16}{cells}" + (f"  [{r['error'][:60]}]" if r.get("error") else ""))
    return "\n".join(lines)
