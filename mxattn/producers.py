"""Fused producers: RMSNorm + MXFP8 quantize, and linear (FP8 GEMM) + MXFP8 quantize.

FP8 operands for attention and for the next GEMM are made inside the kernel that computes them, never by a
separate cast of a BF16 tensor (issue 7).  CUDA tensors run the Triton kernels (``mxattn/kernels/
rmsnorm_quant.py``, ``mxattn/kernels/linear_quant.py``); CPU tensors run the reference compositions defined
here (same API, same semantics).  Every check runs before any launch: ``TypeError`` for a wrong type or
dtype, ``ValueError`` for a wrong shape, orientation, device or value, naming the argument.

Public functions
----------------
``rmsnorm_quant(x, weight, eps=1e-6, orientations="hdim", scale_mode="rceil", row_scaled=False)``
    ``x`` (..., N) bf16/fp16/fp32 (N <= 16384; (S, N) or (B, S, N) for a ``seq`` orientation), ``weight`` (N,).
    Returns ``RMSNormQuantResult(out, rstd)``: ``out`` is the MX quantization of ``y = rmsnorm(x) * weight``
    (``rmsnorm_reference``) — an ``MXTensor`` blocked along N (``"hdim"``, dim=-1, data shaped like x), blocked
    along the tokens (``"seq"``, dim=-2, data a view of a channel-major (B, N, S_pad) buffer on CUDA), or the
    pair (hdim, seq) for ``"both"``.  With ``row_scaled=True`` the hdim output is the Hopper operand
    ``RowScaledFP8`` (one int32 exponent per row, ``formats.to_row_scaled`` of the MX tensor), the form
    ``linear_quant`` consumes without a conversion pass.  ``rstd`` (x.shape[:-1], fp32) is 1/sqrt(mean(x^2)+eps).
``rmsnorm_quant_backward(dy, x, weight, rstd)``
    ``(dx, dweight)`` from the upstream gradient ``dy`` (float tensor shaped like x, or an ``MXTensor`` blocked
    along N, dequantized on load), in x's and weight's dtypes.
``linear_quant(x, weight, bias=None, orientations="hdim", scale_mode="rceil")``
    ``y = x @ weight.T (+ bias)`` with an FP8 main loop and the MX quantization of y in the epilogue.  Returns
    an ``MXTensor`` (or the (hdim, seq) pair) blocked along N (``"hdim"``, dim=-1) or along the tokens
    (``"seq"``, x must be (S, K) or (B, S, K); blocks of 32 tokens within a batch).  Inputs (K % 16 == 0):
    * ``x``: ``RowScaledFP8`` (dim=-1, one exponent per row; what ``rmsnorm_quant(..., row_scaled=True)``
      makes) — used as is; ``MXTensor`` blocked along K — re-expressed to one exponent per row first
      (``formats.to_row_scaled``, one pass over x); float tensor (..., K) — quantized on the fly
      (``formats.row_scaled_from_float``, one pass).
    * ``weight`` (N, K): ``RowScaledFP8`` (dim=-1; one exponent per output channel, or one per tensor with
      ``group_dim=0, group=N``), ``MXTensor`` blocked along K, or a float tensor (quantized per call).
    * ``bias``: None or a float tensor (N,), added in fp32 before quantization.
    Why these: Hopper has no block-scaled MMA.  A row of x and a row of W (an output channel) re-expressed to
    one power-of-two exponent each (DESIGN §3) make ``x W^T = 2^Ex (x' W'^T) 2^Ew``: the main loop is a plain
    FP8 ``tl.dot`` and the exponents are folded into the fp32 accumulator in the epilogue, for free.

Autograd
--------
When x or weight (or bias) require grad, the outputs are ``GradMXTensor`` / ``GradRowScaledFP8``: the MX
objects above plus a *carrier*, a zero-storage tensor of the output's shape that sits in the autograd graph.
``out.dequantize()`` returns the dequantized value (the forward value of the op) as a tensor whose gradient
goes to the carrier unchanged: the quantizer is a straight-through estimator (STE), d(dequantize(Q(y)))/dy = 1.
``linear_quant`` accepts these objects as x and routes its x gradient to their carrier, so
``linear_quant(rmsnorm_quant(x, w, row_scaled=True).out, W).dequantize().sum().backward()`` reaches x, w and W.
The RMSNorm backward is the fused kernel (dy from all outputs summed); the linear backward is, for now, two
BF16/fp32 ``torch.matmul`` on the dequantized FP8 operands (STE through both quantizers).

Reference semantics (the kernels equal these; see each function)
----------------------------------------------------------------
* ``rmsnorm_reference``: bit-exact with the forward kernel, and ``quantize_mxfp8`` of its y is bit-exact with
  the kernel's MX output (data and scale bytes; NaN positions for non-finite rows).
* ``rmsnorm_backward_reference``: dx bit-exact; dweight bit-exact given the kernel's ``BwdPlan``.
* ``linear_quant_reference``: dequantized operands, fp32 matmul, ``quantize_mxfp8``.  The kernel's FP8
  accumulation order differs, so the comparison is statistical (tests: >= 99.9% of data bytes equal, every
  other element within one e4m3 step at the larger of the two block scales).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import torch

from mxattn import formats
from mxattn.formats import MXTensor, RowScaledFP8, ScaleMode

__all__ = [
    "rmsnorm_quant",
    "rmsnorm_quant_backward",
    "linear_quant",
    "RMSNormQuantResult",
    "GradMXTensor",
    "GradRowScaledFP8",
    "pairwise_sum",
    "rmsnorm_reference",
    "rmsnorm_backward_reference",
    "linear_quant_reference",
    "bench_producers",
    "MAX_N",
]

MAX_N = 16384  # rmsnorm: the fused backward keeps whole rows in registers
ORIENTATIONS = ("hdim", "seq", "both")
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
# Run the kernels on CPU tensors too (tests, under TRITON_INTERPRET=1); otherwise CPU tensors take the reference.
_KERNELS_ON_CPU = False


def _use_kernels(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return _KERNELS_ON_CPU and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Reference semantics (plain PyTorch, fp32)
# ----------------------------------------------------------------------------------------------


def pairwise_sum(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum of fp32 ``v`` along ``dim`` by a fixed binary tree: pad with zeros to a power of two, then add
    elements 2j and 2j + 1, level by level.  Zero padding never changes the result (x + 0 = x), so the tree
    is the same for any power-of-two width that covers the data.  The dim is removed."""
    v = v.to(torch.float32).movedim(dim, -1)
    n = v.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        v = torch.nn.functional.pad(v, (0, width - n))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _nrows(shape) -> int:
    """Rows of a (..., K) shape (explicit, so that empty tensors reshape unambiguously)."""
    return math.prod(tuple(shape)[:-1])


def _div_rn(a: torch.Tensor, b: float) -> torch.Tensor:
    """fp32 a / b correctly rounded: formed in fp64 and rounded once (exact for fp32 operands, since
    53 >= 2 * 24 + 2; torch's fp32 CPU kernels are not all correctly rounded, the GPU's div.rn is)."""
    return (a.to(torch.float64) / b).to(torch.float32)


def _rsqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(t) with two correct roundings in fp32 (sqrt.rn then div.rn), formed in fp64 as above."""
    s = torch.sqrt(t.to(torch.float64)).to(torch.float32)
    return (1.0 / s.to(torch.float64)).to(torch.float32)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` in fp32: the exact operation order of the fused kernel (one rounding per step).

        xf = fp32(x); ss = pairwise_sum(xf * xf); ms = ss / N; rstd = 1 / sqrt(ms + fp32(eps))
        y = (xf * rstd) * fp32(weight)

    Divisions and the square root are correctly rounded; y is not rounded to x's dtype.  ``rstd`` has shape
    ``x.shape[:-1]``."""
    xf = x.to(torch.float32)
    n = xf.shape[-1]
    ss = pairwise_sum(xf * xf)
    ms = _div_rn(ss, n)
    rstd = _rsqrt_rn(ms + torch.tensor(eps, dtype=torch.float32))
    y = (xf * rstd.unsqueeze(-1)) * weight.to(torch.float32)
    return y, rstd


def rmsnorm_backward_reference(
    dy: Union[torch.Tensor, MXTensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    plan=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` in fp32, the fused backward's operation order:

        xhat = xf * rstd; g = dy * w; c = pairwise_sum(g * xhat) / N; dx = (g - xhat * c) * rstd
        dweight = sum over rows of dy * xhat

    ``dy``: a float tensor or an ``MXTensor`` blocked along N (dequantized).  dweight's row order: with
    ``plan`` (a ``kernels.rmsnorm_quant.BwdPlan``: rows_per_prog, block_m) exactly the kernel's two-stage
    order — per program ``(0 + T_0) + T_1 + ...`` over tiles of ``block_m`` rows, T_i the pairwise sum of the
    tile's rows, then ``(0 + P_0) + P_1 + ...`` over programs; without it one pairwise sum over all rows."""
    n = x.shape[-1]
    m = _nrows(x.shape)
    xf = x.reshape(m, n).to(torch.float32)
    dyf = (dy.dequantize(torch.float32) if isinstance(dy, MXTensor) else dy.to(torch.float32)).reshape(m, n)
    r = rstd.reshape(m, 1).to(torch.float32)
    wf = weight.to(torch.float32)
    xhat = xf * r
    g = dyf * wf
    c = _div_rn(pairwise_sum(g * xhat), n)
    dx = (g - xhat * c.unsqueeze(-1)) * r
    contrib = dyf * xhat
    M = contrib.shape[0]
    if plan is None:
        dw = pairwise_sum(contrib, dim=0) if M else torch.zeros(n)
    else:
        dw = torch.zeros(n)
        for p0 in range(0, max(M, 1), plan.rows_per_prog):
            acc = torch.zeros(n)
            end = min(p0 + plan.rows_per_prog, M)
            for t in range(p0, end, plan.block_m):
                tile = contrib[t:min(t + plan.block_m, end)]
                tile = torch.nn.functional.pad(tile, (0, 0, 0, plan.block_m - tile.shape[0]))
                acc = acc + pairwise_sum(tile, dim=0)
            dw = dw + acc
    return dx.reshape(x.shape), dw


def _as_row_scaled(t, scale_mode) -> RowScaledFP8:
    """A 2-D operand (rows, K) as ``RowScaledFP8`` with one exponent per row (reference path)."""
    if isinstance(t, RowScaledFP8):
        return RowScaledFP8(t.data, t.expanded_exp(), t.dim)
    if isinstance(t, MXTensor):
        return formats.to_row_scaled(t)
    return formats.row_scaled_from_float(t, dim=-1, scale_mode=scale_mode)


def linear_quant_reference(
    x: Union[torch.Tensor, MXTensor, RowScaledFP8],
    weight: Union[torch.Tensor, MXTensor, RowScaledFP8],
    bias: Optional[torch.Tensor] = None,
    orientations: str = "hdim",
    scale_mode: Union[str, ScaleMode] = "rceil",
) -> Union[MXTensor, tuple[MXTensor, MXTensor]]:
    """The composition the fused kernel computes: both operands as ``RowScaledFP8`` (one exponent per row
    of x, per output channel of W; float inputs through ``row_scaled_from_float``, MX inputs through
    ``to_row_scaled``), dequantized, ``y = x W^T (+ bias)`` in fp32, then ``quantize_mxfp8`` along N (hdim,
    dim=-1) and/or along the tokens (seq, dim=-2).  Shapes as ``linear_quant``; data contiguous."""
    K = x.shape[-1]
    lead = tuple(x.shape[:-1])
    x2 = _flatten_rows(x, K)
    xr, wr = _as_row_scaled(x2, scale_mode), _as_row_scaled(weight, scale_mode)
    y = xr.dequantize(torch.float32) @ wr.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.reshape(*lead, y.shape[-1])
    return _quantize_out(y, orientations, scale_mode)


def _quantize_out(y: torch.Tensor, orientations: str, scale_mode) -> Union[MXTensor, tuple]:
    res = []
    if orientations in ("hdim", "both"):
        res.append(formats.quantize_mxfp8(y, -1, scale_mode))
    if orientations in ("seq", "both"):
        res.append(formats.quantize_mxfp8(y, y.ndim - 2, scale_mode))
    return res[0] if len(res) == 1 else tuple(res)


def _flatten_rows(t, K: int):
    """(..., K) operand -> (rows, K) operand of the same kind."""
    if isinstance(t, torch.Tensor):
        return t.reshape(_nrows(t.shape), K)
    if isinstance(t, MXTensor):
        m = _nrows(t.shape)
        return MXTensor(t.data.reshape(m, K), t.scale.reshape(m, t.scale.shape[-1]), 1)
    m = _nrows(t.shape)
    return RowScaledFP8(t.data.reshape(m, K), t.expanded_exp().reshape(m, 1), 1)


# ----------------------------------------------------------------------------------------------
# Autograd-carrying outputs
# ----------------------------------------------------------------------------------------------


class _STEDequantize(torch.autograd.Function):
    """Forward: the dequantized value of a quantized tensor.  Backward: the gradient to the carrier, unchanged
    (straight-through estimator)."""

    @staticmethod
    def forward(ctx, carrier, plain, dtype):
        ctx.carrier_dtype = carrier.dtype
        return _dequantize(plain, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.carrier_dtype), None, None


def _dequantize(t: Union[MXTensor, RowScaledFP8], dtype: torch.dtype) -> torch.Tensor:
    if isinstance(t, MXTensor) and t.device.type == "cuda" and 1 <= t.ndim <= 4 and dtype in _FLOAT:
        from mxattn.kernels.quantize import dequantize_mxfp8_triton

        return dequantize_mxfp8_triton(t, dtype)
    if isinstance(t, MXTensor):
        return formats.dequantize_mxfp8(t, dtype)
    return RowScaledFP8.dequantize(t, dtype)


@dataclass
class GradMXTensor(MXTensor):
    """An ``MXTensor`` that sits in the autograd graph: ``dequantize`` is differentiable (STE) and its
    gradient reaches the op that produced it through ``carrier`` (zero storage, the data's shape)."""

    carrier: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def plain(self) -> MXTensor:
        return MXTensor(self.data, self.scale, self.dim, self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _STEDequantize.apply(self.carrier, self.plain(), dtype)


@dataclass
class GradRowScaledFP8(RowScaledFP8):
    """A ``RowScaledFP8`` in the autograd graph (see ``GradMXTensor``)."""

    carrier: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def plain(self) -> RowScaledFP8:
        return RowScaledFP8(self.data, self.exp, self.dim, self.group_dim, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _STEDequantize.apply(self.carrier, self.plain(), dtype)


@dataclass
class GradMXTensorTiled(formats.MXTensorTiled):
    """An ``MXTensorTiled`` in the autograd graph (see ``GradMXTensor``)."""

    carrier: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def plain(self) -> formats.MXTensorTiled:
        return formats.MXTensorTiled(self.data, self.scale_tiled, self.dim, self.per_head)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _STEDequantize.apply(self.carrier, self.to_mx(), dtype)


def _tiled(t: MXTensor) -> formats.MXTensorTiled:
    """The feature-blocked output of a producer with its scales in the 128x4-tiled layout (CPU path: the
    reference's plain scales converted; the kernels write the tiled layout directly)."""
    cols = t.scale.shape[-1]
    flat = formats.to_blackwell_scale_layout(t.scale_bytes.reshape(-1, cols))
    return formats.MXTensorTiled(t.data, flat, t.dim, per_head=False)


def _check_scale_layout(scale_layout, orient: str, row_scaled: bool = False) -> bool:
    """True for the tiled (Blackwell) layout; refuses what it does not cover."""
    if scale_layout not in ("plain", "blackwell"):
        raise ValueError(f"scale_layout must be 'plain' or 'blackwell', got {scale_layout!r}")
    if scale_layout == "plain":
        return False
    if orient != "hdim" or row_scaled:
        raise ValueError("scale_layout='blackwell' is for the feature-blocked MX output only: orientations='hdim', "
                         "row_scaled=False (the token-blocked one stays plain; formats.to_blackwell_scale_layout "
                         "converts it)")
    return True


def _attach(t, carrier: torch.Tensor):
    if isinstance(t, formats.MXTensorTiled):
        return GradMXTensorTiled(t.data, t.scale_tiled, t.dim, t.per_head, carrier=carrier)
    if isinstance(t, MXTensor):
        return GradMXTensor(t.data, t.scale, t.dim, t.block_size, carrier=carrier)
    return GradRowScaledFP8(t.data, t.exp, t.dim, t.group_dim, t.group, carrier=carrier)


def _carrier(shape, dtype, device) -> torch.Tensor:
    """A zero-storage stand-in for a quantized output in the autograd graph (one element, expanded)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _sum_grads(grads) -> Optional[torch.Tensor]:
    gs = [g for g in grads if g is not None]
    if not gs:
        return None
    if len(gs) == 1:
        return gs[0]
    return sum((g.to(torch.float32) for g in gs[1:]), gs[0].to(torch.float32))


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _check_orientations(orientations) -> str:
    if orientations not in ORIENTATIONS:
        raise ValueError(f"orientations must be one of {ORIENTATIONS}, got {orientations!r}")
    return orientations


def _check_float_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def _check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_rmsnorm(x, weight, eps, orientations, scale_mode) -> tuple[str, ScaleMode]:
    _check_float_tensor(x, "x")
    _check_float_tensor(weight, "weight")
    orient = _check_orientations(orientations)
    mode = ScaleMode.parse(scale_mode)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not formats.is_finite_number(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (..., N)")
    N = x.shape[-1]
    if not 1 <= N <= MAX_N:
        raise ValueError(f"x: the normalized size N = x.shape[-1] must be in [1, {MAX_N}], got {N}")
    if orient != "hdim" and x.ndim not in (2, 3):
        raise ValueError(f"x must be (S, N) or (B, S, N) for orientations={orient!r}, got shape {tuple(x.shape)}")
    if tuple(weight.shape) != (N,):
        raise ValueError(f"weight must have shape ({N},) to match x's last dim, got {tuple(weight.shape)}")
    _check_device(weight, "weight", x.device)
    return orient, mode


# ----------------------------------------------------------------------------------------------
# RMSNorm + quantize
# ----------------------------------------------------------------------------------------------


class RMSNormQuantResult(NamedTuple):
    """``out``: MXTensor / RowScaledFP8 (hdim or seq) or the (hdim, seq) pair; ``rstd``: fp32 x.shape[:-1]."""

    out: Union[MXTensor, RowScaledFP8, tuple]
    rstd: torch.Tensor


def _rmsnorm_quant_impl(x, weight, eps, orient, mode, row_scaled, tiled=False) -> tuple[list, torch.Tensor]:
    """The outputs (list: hdim and/or seq) and rstd, from the kernel on CUDA or the reference on CPU."""
    want_h, want_s = orient in ("hdim", "both"), orient in ("seq", "both")
    N = x.shape[-1]
    if not _use_kernels(x.device):
        y, rstd = rmsnorm_reference(x, weight, eps)
        outs = []
        if want_h:
            mx = formats.quantize_mxfp8(y, -1, mode)
            outs.append(formats.to_row_scaled(mx) if row_scaled else _tiled(mx) if tiled else mx)
        if want_s:
            outs.append(formats.quantize_mxfp8(y, y.ndim - 2, mode))
        return outs, rstd
    from mxattn.kernels.rmsnorm_quant import rmsnorm_quant_fwd

    if want_s:
        x3 = x if x.ndim == 3 else x.unsqueeze(0)
    else:
        x3 = x.reshape(1, _nrows(x.shape), N)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    weight = weight.contiguous()  # the kernel reads weight at unit stride
    r = rmsnorm_quant_fwd(x3, weight, eps, hdim=want_h, seq=want_s, row_scaled=row_scaled,
                          rceil=mode is ScaleMode.RCEIL, tiled_scales=tiled)
    lead = tuple(x.shape[:-1])
    outs = []
    if want_h:
        data = r["hd"].view(torch.float8_e4m3fn).reshape(x.shape)
        if row_scaled:
            outs.append(RowScaledFP8(data, r["he"].reshape(*lead, 1), x.ndim - 1))
        elif tiled:
            outs.append(formats.MXTensorTiled(data, r["hs"], x.ndim - 1, per_head=False))
        else:
            outs.append(MXTensor(data, r["hs"].reshape(*lead, -(-N // 32)), x.ndim - 1))
    if want_s:
        B, S, _ = x3.shape
        data = r["cd"][..., :S].permute(0, 2, 1).view(torch.float8_e4m3fn)
        sc = r["cs"]
        if x.ndim == 2:
            data, sc = data[0], sc[0]
        outs.append(MXTensor(data, sc, x.ndim - 2))
    return outs, r["rstd"].reshape(lead)


def _rmsnorm_backward_impl(dy, x, weight, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    N = x.shape[-1]
    if not _use_kernels(x.device):
        dx, dw = rmsnorm_backward_reference(dy, x, weight, rstd)
        return dx.to(x.dtype), dw.to(weight.dtype)
    from mxattn.kernels.rmsnorm_quant import rmsnorm_bwd

    m = _nrows(x.shape)
    x2 = x.reshape(m, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if isinstance(dy, MXTensor):
        dyd = dy.data.reshape(m, N).view(torch.uint8)
        dys = dy.scale_bytes.reshape(m, dy.scale.shape[-1])
        if dyd.stride(-1) != 1:
            dyd = dyd.contiguous()
        if dys.stride(-1) != 1:
            dys = dys.contiguous()
    else:
        dyd, dys = dy.reshape(m, N), None
        if dyd.stride(-1) != 1:
            dyd = dyd.contiguous()
    dx, dw = rmsnorm_bwd(dyd, x2, weight.contiguous(), rstd.reshape(m).contiguous(), dys)  # unit-stride weight
    return dx.reshape(x.shape), dw


class _RMSNormQuantFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, orient, mode, row_scaled, box, tiled):
        outs, rstd = _rmsnorm_quant_impl(x, weight, eps, orient, mode, row_scaled, tiled)
        box.extend(outs)
        ctx.save_for_backward(x, weight, rstd)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(rstd)
        carriers = tuple(_carrier(x.shape, x.dtype, x.device) for _ in outs)
        return (*carriers, rstd)

    @staticmethod
    def backward(ctx, *grads):
        x, weight, rstd = ctx.saved_tensors
        dy = _sum_grads(grads[:-1])
        if dy is None:
            return (None,) * 8
        dx, dw = _rmsnorm_backward_impl(dy, x, weight, rstd)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
                None, None, None, None, None, None)


def rmsnorm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    orientations: str = "hdim",
    scale_mode: Union[str, ScaleMode] = "rceil",
    row_scaled: bool = False,
    scale_layout: str = "plain",
) -> RMSNormQuantResult:
    """RMSNorm followed by MXFP8 quantization, fused: one kernel, one read of ``x``.

    ``x``: (..., N) bf16/fp16/fp32, 1 <= N <= 16384; (S, N) or (B, S, N) when ``orientations`` is "seq" or
    "both" (seq blocks are 32 consecutive tokens of one batch).  ``weight``: (N,) bf16/fp16/fp32.
    ``eps``: added to mean(x^2) in fp32.  ``scale_mode``: "rceil" (default) or "floor".
    Returns ``RMSNormQuantResult(out, rstd)``:
      * "hdim": ``MXTensor`` dim=-1, data shaped like x (contiguous), scale (..., ceil(N/32));
        with ``row_scaled=True`` a ``RowScaledFP8`` dim=-1, exp (..., 1) int32 (the Hopper GEMM operand);
      * "seq": ``MXTensor`` dim=-2 (the token dim), scale (B, ceil(S/32), N); on CUDA the data is the (B, S, N)
        view of a channel-major (B, N, S_pad) buffer (S_pad = S rounded up to 16);
      * "both": ``(hdim, seq)``;
      * ``rstd``: fp32, x.shape[:-1].
    ``scale_layout="blackwell"`` ("hdim", not row-scaled): the scales straight in the 128x4-tiled layout of
    Blackwell block-scaled MMA, one matrix of all rows (``formats.MXTensorTiled``, ``per_head=False``), the
    operand of a following cuBLAS / cuDNN MXFP8 GEMM; ``.to_mx()`` equals the plain output.
    Values: ``quantize_mxfp8(rmsnorm_reference(x, weight, eps)[0])`` (and ``to_row_scaled`` of it), bit-exact.
    Differentiable w.r.t. x and weight (see the module docstring: STE through the quantizer)."""
    orient, mode = _check_rmsnorm(x, weight, eps, orientations, scale_mode)
    if not isinstance(row_scaled, bool):
        raise TypeError(f"row_scaled must be a bool, got {type(row_scaled).__name__}")
    if row_scaled and orient == "seq":
        raise ValueError("row_scaled=True changes the hdim output: use orientations 'hdim' or 'both'")
    tiled = _check_scale_layout(scale_layout, orient, row_scaled)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        box: list = []
        res = _RMSNormQuantFn.apply(x, weight, float(eps), orient, mode, row_scaled, box, tiled)
        outs = [_attach(o, c) for o, c in zip(box, res[:-1])]
        rstd = res[-1]
    else:
        outs, rstd = _rmsnorm_quant_impl(x, weight, float(eps), orient, mode, row_scaled, tiled)
    return RMSNormQuantResult(outs[0] if len(outs) == 1 else tuple(outs), rstd)


def rmsnorm_quant_backward(
    dy: Union[torch.Tensor, MXTensor], x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``y = rmsnorm(x) * weight`` for the upstream gradient ``dy`` w.r.t. y.

    ``dy``: float tensor shaped like x, or an ``MXTensor`` blocked along N (dim=-1), dequantized on load.
    ``rstd``: fp32 x.shape[:-1] from ``rmsnorm_quant``.  Returns dx in x's dtype and dweight (N,) in
    weight's dtype; dweight is reduced over rows in a fixed two-stage order (deterministic)."""
    _check_float_tensor(x, "x")
    _check_float_tensor(weight, "weight")
    N = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or not 1 <= N <= MAX_N:
        raise ValueError(f"x must be (..., N) with 1 <= N <= {MAX_N}, got shape {tuple(x.shape)}")
    if tuple(weight.shape) != (N,):
        raise ValueError(f"weight must have shape ({N},), got {tuple(weight.shape)}")
    if isinstance(dy, MXTensor):
        if dy.dim != dy.ndim - 1:
            raise ValueError(f"dy must be an MXTensor blocked along N (dim=-1), got dim={dy.dim}")
    else:
        _check_float_tensor(dy, "dy")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if not isinstance(rstd, torch.Tensor) or rstd.dtype != torch.float32:
        raise TypeError("rstd must be the float32 tensor returned by rmsnorm_quant")
    if tuple(rstd.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"rstd must have shape {tuple(x.shape[:-1])}, got {tuple(rstd.shape)}")
    for name, t in (("weight", weight), ("dy", dy), ("rstd", rstd)):
        _check_device(t if isinstance(t, torch.Tensor) else t.data, name, x.device)
    return _rmsnorm_backward_impl(dy, x, weight, rstd)


# ----------------------------------------------------------------------------------------------
# Linear + quantize
# ----------------------------------------------------------------------------------------------


def _operand_kind(t, name: str) -> str:
    if isinstance(t, RowScaledFP8):
        return "rs"
    if isinstance(t, MXTensor):
        return "mx"
    _check_float_tensor(t, name)
    return "float"


def _check_linear(x, weight, bias, orientations, scale_mode):
    orient = _check_orientations(orientations)
    mode = ScaleMode.parse(scale_mode)
    kx, kw = _operand_kind(x, "x"), _operand_kind(weight, "weight")
    if len(x.shape) < 2:
        raise ValueError(f"x must be (..., K) with at least one row dimension, got shape {tuple(x.shape)}")
    if orient != "hdim" and len(x.shape) not in (2, 3):
        raise ValueError(f"x must be (S, K) or (B, S, K) for orientations={orient!r}, got shape {tuple(x.shape)}")
    K = x.shape[-1]
    if K == 0 or K % 16:
        raise ValueError(f"x: the contraction size K = x.shape[-1] must be a positive multiple of 16 "
                         f"(16-byte FP8 rows), got {K}")
    if len(weight.shape) != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be (N, K) with K = {K} (x's last dim), got shape {tuple(weight.shape)}")
    N = weight.shape[0]
    if N == 0:
        raise ValueError("weight must have at least one output channel (N > 0)")
    for name, t, kind in (("x", x, kx), ("weight", weight, kw)):
        if kind == "mx" and t.dim != t.ndim - 1:
            raise ValueError(f"{name} must be an MXTensor blocked along K (dim=-1), got dim={t.dim}")
        if kind == "rs" and t.dim != len(t.shape) - 1:
            raise ValueError(f"{name} must be a RowScaledFP8 with dim=-1 (exponents per row), got dim={t.dim}")
    if kx == "rs" and x.group_dim is not None and x.group > 1:
        raise ValueError("x must be a RowScaledFP8 with one exponent per row (group=1)")
    dev = x.device
    _check_device(weight.data if kw != "float" else weight, "weight", dev)
    if bias is not None:
        _check_float_tensor(bias, "bias")
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
        _check_device(bias, "bias", dev)
    return orient, mode, kx, kw


def _row_scaled_2d(t, kind: str, mode: ScaleMode) -> RowScaledFP8:
    """A (rows, K) operand as RowScaledFP8 with one exponent per row, exp (rows, 1)."""
    K = t.shape[-1]
    t2 = _flatten_rows(t, K)
    if kind == "rs":
        return t2
    if not _use_kernels(t2.device if isinstance(t2, torch.Tensor) else t2.data.device):
        return _as_row_scaled(t2, mode)
    from mxattn.kernels.linear_quant import row_scaled_rows

    return row_scaled_rows(t2, rceil=mode is ScaleMode.RCEIL)


def _linear_quant_impl(x, weight, bias, orient, mode, kx, kw, tiled=False):
    """(outputs, x operand, weight operand): the MX outputs and the row-scaled operands the product used."""
    xr = _row_scaled_2d(x, kx, mode)
    wr = _row_scaled_2d(weight, kw, mode)
    K = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if not _use_kernels(xr.device):
        y = xr.dequantize(torch.float32) @ wr.dequantize(torch.float32).T
        if bias is not None:
            y = y + bias.to(torch.float32)
        out = _quantize_out(y.reshape(*lead, y.shape[-1]), orient, mode)
        if tiled:
            out = _tiled(out)
        return (list(out) if isinstance(out, tuple) else [out]), xr, wr
    from mxattn.kernels.linear_quant import linear_quant_fwd

    want_h, want_s = orient in ("hdim", "both"), orient in ("seq", "both")
    if want_s and len(lead) == 2:
        B, S = lead
    else:
        B, S = 1, xr.data.shape[0]
    N = wr.data.shape[0]
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias at unit stride
    r = linear_quant_fwd(xr, wr, bias, B, S, hdim=want_h, seq=want_s, rceil=mode is ScaleMode.RCEIL,
                         tiled_scales=tiled)
    outs = []
    if want_h and tiled:
        outs.append(formats.MXTensorTiled(r["hd"].view(torch.float8_e4m3fn).reshape(*lead, N), r["hs"], len(lead),
                                          per_head=False))
    elif want_h:
        outs.append(MXTensor(r["hd"].view(torch.float8_e4m3fn).reshape(*lead, N),
                             r["hs"].reshape(*lead, -(-N // 32)), len(lead)))
    if want_s:
        data = r["cd"][..., :S].permute(0, 2, 1).view(torch.float8_e4m3fn)
        sc = r["cs"]
        if len(lead) == 1:
            data, sc = data[0], sc[0]
        outs.append(MXTensor(data, sc, len(lead) - 1))
    del K
    return outs, xr, wr


class _LinearQuantFn(torch.autograd.Function):
    """Inputs: the tensor that carries x's gradient (x itself, or the carrier of a Grad* x, or None), the
    float weight (or None), bias (or None); the FP8 operands travel in ``args``."""

    @staticmethod
    def forward(ctx, xg, wg, bias, args, box):
        x, weight, orient, mode, kx, kw, out_dtype, tiled = args
        outs, xr, wr = _linear_quant_impl(x, weight, bias, orient, mode, kx, kw, tiled)
        box.extend(outs)
        ctx.xr, ctx.wr = xr, wr
        ctx.x_shape, ctx.out_dtype = tuple(x.shape), out_dtype
        ctx.xg_dtype = xg.dtype if xg is not None else None
        ctx.wg_dtype = wg.dtype if wg is not None else None
        ctx.has_bias = bias is not None
        ctx.set_materialize_grads(False)
        N = weight.shape[0]
        shape = (*x.shape[:-1], N)
        return tuple(_carrier(shape, out_dtype, xr.device) for _ in outs)

    @staticmethod
    def backward(ctx, *grads):
        dy = _sum_grads(grads)
        if dy is None:
            return None, None, None, None, None
        N = dy.shape[-1]
        dt = dy.dtype if dy.device.type == "cuda" else torch.float32
        dy2 = dy.reshape(_nrows(dy.shape), N).to(dt)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ _dequantize_rows(ctx.wr, dt)).reshape(ctx.x_shape).to(ctx.xg_dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy2.T @ _dequantize_rows(ctx.xr, dt)).to(ctx.wg_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.to(torch.float32).sum(0)
        return dx, dw, db, None, None


def _dequantize_rows(t: RowScaledFP8, dtype: torch.dtype) -> torch.Tensor:
    return RowScaledFP8.dequantize(t, dtype)


def linear_quant(
    x: Union[torch.Tensor, MXTensor, RowScaledFP8],
    weight: Union[torch.Tensor, MXTensor, RowScaledFP8],
    bias: Optional[torch.Tensor] = None,
    orientations: str = "hdim",
    scale_mode: Union[str, ScaleMode] = "rceil",
    scale_layout: str = "plain",
) -> Union[MXTensor, formats.MXTensorTiled, tuple[MXTensor, MXTensor]]:
    """``y = x @ weight.T (+ bias)`` on FP8 operands, MXFP8-quantized in the GEMM's epilogue.

    ``x``: (..., K) — ``RowScaledFP8`` (dim=-1, group 1), ``MXTensor`` (dim=-1; or ``MXTensorTiled``) or
    bf16/fp16/fp32;
    (S, K) or (B, S, K) for "seq"/"both".  ``weight``: (N, K) — ``RowScaledFP8`` (dim=-1), ``MXTensor``
    (dim=-1) or float.  ``bias``: (N,) float or None.  K must be a multiple of 16.
    Returns: "hdim": ``MXTensor`` (..., N) dim=-1, scale (..., ceil(N/32)); "seq": ``MXTensor`` (B, S, N)
    dim=-2, scale (B, ceil(S/32), N), on CUDA a view of a channel-major (B, N, S_pad) buffer; "both": the pair.
    Values: ``linear_quant_reference`` up to the FP8 accumulation order (not bit-exact).  Differentiable
    w.r.t. a float x (or the producer behind a Grad* x), a float weight and bias (STE, BF16 backward).
    ``scale_layout="blackwell"`` ("hdim"): the scales written by the epilogue straight in the 128x4-tiled layout
    of Blackwell block-scaled MMA, one matrix of all rows (``formats.MXTensorTiled``, ``per_head=False``)."""
    if isinstance(x, formats.MXTensorTiled):  # a Blackwell-layout producer output: the plain scales for Hopper
        mx = x.to_mx()
        carrier = getattr(x, "carrier", None)
        x = mx if carrier is None else GradMXTensor(mx.data, mx.scale, mx.dim, mx.block_size, carrier=carrier)
    orient, mode, kx, kw = _check_linear(x, weight, bias, orientations, scale_mode)
    tiled = _check_scale_layout(scale_layout, orient)
    xg = x if kx == "float" else getattr(x, "carrier", None)
    wg = weight if kw == "float" else None
    needs = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (xg, wg, bias))
    if not needs:
        outs, _, _ = _linear_quant_impl(x, weight, bias, orient, mode, kx, kw, tiled)
        return outs[0] if len(outs) == 1 else tuple(outs)
    if xg is not None:
        out_dtype = xg.dtype
    else:
        out_dtype = wg.dtype if wg is not None else torch.bfloat16
    xplain = x.plain() if isinstance(x, (GradMXTensor, GradRowScaledFP8)) else x
    box: list = []
    carriers = _LinearQuantFn.apply(xg, wg, bias, (xplain, weight, orient, mode, kx, kw, out_dtype, tiled), box)
    outs = [_attach(o, c) for o, c in zip(box, carriers)]
    return outs[0] if len(outs) == 1 else tuple(outs)


# ----------------------------------------------------------------------------------------------
# Benchmark (GPU)
# ----------------------------------------------------------------------------------------------


RMS_BENCH_SIZES = ((16384, 4096), (16384, 8192))  # (M tokens, N)
LINEAR_BENCH_SIZES = ((16384, 4096, 4096), (16384, 4096, 3 * 4096))  # (M, K, N): a projection and a fused QKV


def _median_ms(fn, rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _rmsnorm_bytes(M: int, N: int) -> dict:
    """Bytes read + written by ``rmsnorm_quant`` of a bf16 (M, N) x per orientation (x, weight, outputs, rstd)."""
    nb, nsb = -(-N // 32), -(-M // 32)
    return {"hdim": 2 * M * N + 2 * N + M * N + M * nb + 4 * M,
            "hdim_row_scaled": 2 * M * N + 2 * N + M * N + 8 * M,
            "seq": 2 * M * N + 2 * N + M * N + N * nsb + 4 * M,
            "both": 2 * M * N + 2 * N + 2 * M * N + M * nb + N * nsb + 4 * M}


def _bench_rmsnorm(M: int, N: int, rep: int, progress: bool, variants=None, timing: str = "eager") -> list[dict]:
    """One row per orientation with the default tiles, and one per tile of ``variants`` ({case: [FwdTile]}, cases
    as in ``cases`` below), each with the default's time of that orientation (``default_ms``); the device
    copy and the unfused pair (measured once per orientation) in the same run."""
    from mxattn.bench.quantize_bench import _graph_ms
    from mxattn.kernels import rmsnorm_quant as kr
    from mxattn.kernels.quantize import quantize_mxfp8_triton

    timed = _median_ms if timing == "eager" else _graph_ms
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen)
    dst = torch.empty_like(x)
    copy_ms = timed(lambda: dst.copy_(x), rep)
    copy_gbps = 2 * x.numel() * 2 / copy_ms / 1e6
    d = 128 if N % 128 == 0 else N  # quantize_mxfp8_triton wants D <= 256: view rows as (N/128) heads of 128

    def unfused(orient):
        y = torch.nn.functional.rms_norm(x, (N,), w, 1e-6)
        return quantize_mxfp8_triton(y.view(1, M, N // d, d), orient)

    nbytes = _rmsnorm_bytes(M, N)
    cases = {  # name: (callable, orientation of the unfused pair)
        "hdim": (lambda: rmsnorm_quant(x, w), "hdim"),
        "hdim_row_scaled": (lambda: rmsnorm_quant(x, w, row_scaled=True), "hdim"),
        "seq": (lambda: rmsnorm_quant(x, w, orientations="seq"), "seq"),
        "both": (lambda: rmsnorm_quant(x, w, orientations="both"), "both"),
    }
    unfused_ms = {}
    rows = []

    def add_row(name, ms, tile=None, default_ms=None):
        orient = cases[name][1]
        if orient not in unfused_ms:
            un = (lambda o=orient: unfused(o))
            un()
            unfused_ms[orient] = timed(un, rep)
        un_ms = unfused_ms[orient]
        row = {"kernel": name, "M": M, "N": N, "dtype": "bfloat16", "timing": timing, "ms": ms, "bytes": nbytes[name],
               "gbps": nbytes[name] / ms / 1e6, "copy_gbps": copy_gbps, "unfused_ms": un_ms}
        if tile is not None:
            row["tile"] = {"block_m": tile.block_m, "block_n": tile.block_n, "num_warps": tile.num_warps,
                           "maxnreg": tile.maxnreg, "rowsets": tile.rowsets, "token_blocks": tile.token_blocks}
            row["default_ms"] = default_ms
        row["pct_of_copy"] = 100.0 * row["gbps"] / copy_gbps
        row["speedup_vs_unfused"] = un_ms / ms
        rows.append(row)
        if progress:
            label = name if tile is None else f"{name} {row['tile']}"
            print(f"  rmsnorm_quant {label:<16} M{M} N{N}: {ms:7.3f} ms {row['gbps']:6.0f} GB/s = "
                  f"{row['pct_of_copy']:5.1f}% of copy; unfused bf16 rms_norm + quantize {un_ms:7.3f} ms "
                  f"({row['speedup_vs_unfused']:.2f}x)", flush=True)

    default_ms = {}
    for name, (fn, _o) in cases.items():
        fn()
        default_ms[name] = timed(fn, rep)
        add_row(name, default_ms[name])
    saved = kr.TILE_OVERRIDES.get("fwd")
    try:
        for name, tiles in (variants or {}).items():
            fn = cases[name][0]
            for tile in tiles:
                kr.TILE_OVERRIDES["fwd"] = tile
                fn()
                add_row(name, timed(fn, rep), tile, default_ms[name])
    finally:
        kr.TILE_OVERRIDES.pop("fwd", None)
        if saved is not None:
            kr.TILE_OVERRIDES["fwd"] = saved
    return rows


def _bench_linear(M: int, K: int, N: int, rep: int, progress: bool, tiles) -> list[dict]:
    from mxattn.kernels import linear_quant as kl
    from mxattn.kernels.quantize import quantize_mxfp8_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
    xr = kl.row_scaled_rows(x)
    wr = kl.row_scaled_rows(w)
    flop = 2.0 * M * N * K
    x8, w8 = xr.data, wr.data
    one = torch.ones((), device="cuda", dtype=torch.float32)
    sa = torch.ones(M, 1, device="cuda", dtype=torch.float32)
    sb = torch.ones(1, N, device="cuda", dtype=torch.float32)
    d = 128 if N % 128 == 0 else N

    def tf(fn):
        fn()
        return flop / _median_ms(fn, rep) / 1e9

    base = {
        "scaled_mm_fp8": tf(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16)),
        "scaled_mm_fp8_fast_accum": tf(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                                use_fast_accum=True)),
        "scaled_mm_fp8_rowwise": tf(lambda: torch._scaled_mm(x8, w8.t(), sa, sb, out_dtype=torch.bfloat16,
                                                             use_fast_accum=True)),
        "bf16_matmul": tf(lambda: x @ w.t()),
        "bf16_matmul_plus_quantize": tf(lambda: quantize_mxfp8_triton((x @ w.t()).view(1, M, N // d, d), "hdim")),
    }
    rows = []
    saved = kl.TILE_OVERRIDE, kl.KERNEL_OVERRIDE
    try:
        for tile in tiles:
            kl.TILE_OVERRIDE = tile
            for orient in ("hdim", "both"):
                t = {"mxattn": tf(lambda o=orient: linear_quant(xr, wr, orientations=o)),
                     "mxattn_from_bf16_x": tf(lambda o=orient: linear_quant(x, wr, orientations=o))}
                if tile is None:  # the kernels side by side on the same operands (a tl tile sweep times tl only)
                    t.update(_bench_linear_kernels(kl, tf, xr, wr, orient))
                t.update(base)
                row = {"M": M, "K": K, "N": N, "orientations": orient, "tile": None if tile is None else vars(tile),
                       "tflops": t, "ratio_vs_scaled_mm_fp8": t["mxattn"] / t["scaled_mm_fp8"],
                       "ratio_vs_bf16_plus_quantize": t["mxattn"] / t["bf16_matmul_plus_quantize"]}
                if "mxattn_gluon" in t:
                    row["gluon_ratio_vs_scaled_mm_fp8"] = t["mxattn_gluon"] / t["scaled_mm_fp8"]
                    row["gluon_ratio_vs_bf16_plus_quantize"] = t["mxattn_gluon"] / t["bf16_matmul_plus_quantize"]
                rows.append(row)
                if progress:
                    print(f"  linear_quant M{M} K{K} N{N} {orient:<5} tile={tile}: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in t.items()) + " TFLOP/s", flush=True)
    finally:
        kl.TILE_OVERRIDE, kl.KERNEL_OVERRIDE = saved
    return rows


def _bench_linear_kernels(kl, tf, xr, wr, orient) -> dict:
    """TFLOP/s of the tl kernel and of the Gluon kernel (with and without its epilogue partition), each forced
    (``KERNEL_OVERRIDE``); the Gluon rows only where it runs (sm_90, TMA-aligned operands)."""
    out = {}
    kl.KERNEL_OVERRIDE = "tl"
    out["mxattn_tl"] = tf(lambda: linear_quant(xr, wr, orientations=orient))
    kl.KERNEL_OVERRIDE = "auto"
    if kl.linear_kernel(xr.data, wr.data, False) == "gluon":
        from mxattn.kernels import linear_quant_gluon as kg

        kl.KERNEL_OVERRIDE = "gluon"
        saved = kg.CONFIG_OVERRIDE
        try:
            for name, cfg in (("mxattn_gluon", None), ("mxattn_gluon_inline", kg.GluonLinearConfig().inline())):
                kg.CONFIG_OVERRIDE = cfg
                out[name] = tf(lambda: linear_quant(xr, wr, orientations=orient))
        finally:
            kg.CONFIG_OVERRIDE = saved
    kl.KERNEL_OVERRIDE = None
    return out


def bench_producers(
    quick: bool = False,
    rep_ms: int = 100,
    outdir=None,
    rms_sizes=RMS_BENCH_SIZES,
    linear_sizes=LINEAR_BENCH_SIZES,
    linear_tiles=(None,),
    progress: bool = True,
    rms_variants=None,
    timing: str = "eager",
) -> dict:
    """Speed of the fused producers on the GPU, with their baselines measured in the same run.

    rmsnorm_quant (bf16 (M, N)): GB/s of the bytes read + written, against a device copy of x and against
    the unfused path (``torch.nn.functional.rms_norm`` in BF16, then ``quantize_mxfp8_triton``).
    linear_quant (M, K, N): TFLOP/s (2 M N K / time) with x and W as RowScaledFP8 (the chain form) and with
    a BF16 x quantized on the fly, against ``torch._scaled_mm`` FP8 (per-tensor, with and without fast
    accumulation; row-wise) and BF16 matmul followed by ``quantize_mxfp8_triton``; ``mxattn`` is the default
    kernel choice, ``mxattn_tl`` / ``mxattn_gluon`` / ``mxattn_gluon_inline`` each kernel forced on the same
    operands (the Gluon ones on sm_90 only).  ``linear_tiles``: a list of
    ``kernels.linear_quant.LinearTile`` (None = default) to sweep.  ``rms_variants``: {case: [FwdTile]} (cases
    "hdim", "hdim_row_scaled", "seq", "both"), or a callable of N giving that dict, rmsnorm_quant rows with those
    forward tiles beside the defaults' (``_bench_rmsnorm``).  ``timing="graph"`` times the rmsnorm_quant rows (and
    their copy and unfused baselines) as CUDA-graph replays: the GPU's time without the host's launch cost, which at
    M 16k N 4096 (~0.05-0.1 ms) can exceed the kernel's.
    Returns ``{"rmsnorm_quant": rows, "linear_quant": rows}``; with ``outdir``, writes one results file per op
    that has rows (DESIGN §6) and adds the paths under ``"files"``.  Needs CUDA; importable anywhere."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_producers needs a CUDA device")
    if timing not in ("eager", "graph"):
        raise ValueError(f"timing must be 'eager' or 'graph', got {timing!r}")
    rep = max(25, rep_ms // 2) if quick else rep_ms
    rms_sizes = tuple(rms_sizes)[:1] if quick else tuple(rms_sizes)
    linear_sizes = tuple(linear_sizes)[:1] if quick else tuple(linear_sizes)
    out = {"rmsnorm_quant": [], "linear_quant": []}
    for M, N in rms_sizes:
        variants = rms_variants(N) if callable(rms_variants) else rms_variants
        out["rmsnorm_quant"] += _bench_rmsnorm(M, N, rep, progress, variants, timing)
        torch.cuda.empty_cache()
    for M, K, N in linear_sizes:
        out["linear_quant"] += _bench_linear(M, K, N, rep, progress, linear_tiles)
        torch.cuda.empty_cache()
    if outdir is not None:
        from mxattn.bench.results import write_result

        out["files"] = [str(write_result(what, out[what], outdir)) for what in ("rmsnorm_quant", "linear_quant")
                        if out[what]]
    return out


# the row-set tiles the sweep and the session-12 bench compare with the defaults (seq / both orientations):
# 32 tokens x 32 channels per warp and chunk, 4 row sets of 8 channels per thread (kernels.rmsnorm_quant,
# _rmsnorm_quant_rowset_kernel); (32, 512, 16): one 16-warp program per SM, whose 32-token x N working set
# (256 KB at N = 4096) keeps the whole grid's re-read inside L2; "both" at 4 warps takes 168 registers (3 CTAs
# per SM), capped at 128 it spills 16 B for a fourth (docs/perf-notes-producers.md, session 12)
ROWSET_TILES = {
    "seq": ((32, 128, 4, None), (32, 256, 8, None), (32, 512, 16, None)),
    "both": ((32, 128, 4, None), (32, 128, 4, 128), (32, 512, 16, None)),
}


# the token-block tiles (seq / both, _rmsnorm_quant_blocks_kernel): 32 tokens x chunk width x warps, a warp per 32
# channels of a chunk.  Session 17 on an H100 (M 16k N 4096, CUDA-graph timing, docs/perf-notes-producers.md):
# (32, 512, 16) 58.6 / 64.4 % of copy (seq / both) against the row-set defaults' 54.3 / 53.6; (32, 256, 8) 36.7 /
# 37.2 and (32, 256, 4) 21.5 / 23.1 (dropped)
TOKEN_BLOCK_TILES = ((32, 512, 16),)


def token_block_tiles() -> list:
    """``TOKEN_BLOCK_TILES`` as ``FwdTile`` s."""
    from mxattn.kernels.rmsnorm_quant import FwdTile

    return [FwdTile(bm, bn, nw, token_blocks=True) for bm, bn, nw in TOKEN_BLOCK_TILES]


def rmsnorm_kernel_variants(N: int) -> dict:
    """``bench_producers``' ``rms_variants`` (session 17): every token-block tile for seq and both, beside the
    row-set defaults."""
    return {"seq": token_block_tiles(), "both": token_block_tiles()}


def rowset_tiles(orient: str) -> list:
    """``ROWSET_TILES[orient]`` as ``FwdTile`` s."""
    from mxattn.kernels.rmsnorm_quant import FwdTile

    return [FwdTile(bm, bn, nw, mr, rowsets=True) for bm, bn, nw, mr in ROWSET_TILES[orient]]


def sweep_rmsnorm_tiles(M: int = 16384, Ns=(4096, 8192), rep_ms: int = 100, outdir=None,
                        progress: bool = True, orients=("hdim", "seq")) -> list[dict]:
    """GB/s of ``rmsnorm_quant`` (bf16 (M, N) in) per forward tile, per orientation in ``orients`` (GPU).

    The default tile (``kernels.rmsnorm_quant.fwd_tile``) gives a program ~4K elements, i.e. one 4096-wide row:
    at N = 4096 the kernel moved half the bytes of N = 8192 in the same time (31 % vs 57 % of copy), which points
    at per-program latency.  Tried here: 1, 2, 4 (and 8) whole rows per program with 4, 8, 16 warps for hdim,
    32 tokens x 128 / 256 / 512 columns for seq, and the row-set tiles (``ROWSET_TILES``) for seq and "both".
    One row per (N, orientation, tile) with ``pct_of_copy``, the default tile's time as ``default_ms`` and the
    unfused pair's (BF16 rms_norm, then quantize) as ``unfused_ms``; with ``outdir``, written as
    what="rmsnorm_quant_sweep"."""
    from mxattn.kernels import rmsnorm_quant as kr
    from mxattn.kernels.quantize import quantize_mxfp8_triton

    if not torch.cuda.is_available():
        raise RuntimeError("sweep_rmsnorm_tiles needs a CUDA device")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N in Ns:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen)
        dst = torch.empty_like(x)
        copy_gbps = 2 * x.numel() * 2 / _median_ms(lambda: dst.copy_(x), rep_ms) / 1e6
        d = 128 if N % 128 == 0 else N
        bn = min(kr._np2(N), kr._SINGLE_CHUNK_MAX)
        cands = {"hdim": [kr.FwdTile(bm, bn, nw) for bm in (1, 2, 4, 8) if bm * bn <= 32768 for nw in (4, 8, 16)],
                 "seq": [kr.FwdTile(32, c, nw) for c in (128, 256, 512) for nw in (4, 8, 16)] + rowset_tiles("seq"),
                 "both": rowset_tiles("both")}
        # register caps on the default tiles: more CTAs per SM for a latency-bound kernel (80: one spilled word
        # in the sm_90a build of the hdim tile; 72 / 64: 12 / 35 spilled words, L1-resident)
        for orient in ("hdim", "seq"):
            t = kr.fwd_tile(N, orient == "seq")
            cands[orient] += [dataclasses.replace(t, maxnreg=mr) for mr in (80, 72, 64)]
        nbytes = _rmsnorm_bytes(M, N)
        for orient in orients:
            tiles = cands[orient]
            fn = lambda o=orient: rmsnorm_quant(x, w, orientations=o)  # noqa: E731
            un = lambda o=orient: quantize_mxfp8_triton(  # noqa: E731
                torch.nn.functional.rms_norm(x, (N,), w, 1e-6).view(1, M, N // d, d), o)
            un()
            unfused_ms = _median_ms(un, rep_ms)
            kr.TILE_OVERRIDES.pop("fwd", None)
            fn()
            default_ms = _median_ms(fn, rep_ms)
            for tile in tiles:
                kr.TILE_OVERRIDES["fwd"] = tile
                try:
                    fn()
                    ms = _median_ms(fn, rep_ms)
                    err = None
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a row, not a stop
                    ms, err = float("nan"), f"{type(e).__name__}: {e}"[:200]
                finally:
                    kr.TILE_OVERRIDES.pop("fwd", None)
                row = {"kernel": orient, "M": M, "N": N, "tile": [tile.block_m, tile.block_n, tile.num_warps],
                       "maxnreg": tile.maxnreg, "rowsets": tile.rowsets,
                       "ms": ms, "default_ms": default_ms, "unfused_ms": unfused_ms,
                       "gbps": nbytes[orient] / ms / 1e6, "copy_gbps": copy_gbps}
                row["pct_of_copy"] = 100.0 * row["gbps"] / copy_gbps
                row["speedup_vs_unfused"] = unfused_ms / ms
                if err:
                    row["error"] = err
                rows.append(row)
                if progress:
                    print(f"  rmsnorm_quant {orient} N{N} tile {row['tile']} maxnreg {tile.maxnreg} rowsets "
                          f"{tile.rowsets}: {ms:.3f} ms ({row['pct_of_copy']:.1f}% of copy; default {default_ms:.3f}"
                          f" ms, unfused {unfused_ms:.3f} ms)", flush=True)
        del x, dst
        torch.cuda.empty_cache()
    if outdir is not None:
        from mxattn.bench.results import write_result

        print(write_result("rmsnorm_quant_sweep", rows, outdir, extra={"note": "forward tile sweep"}))
    return rows
