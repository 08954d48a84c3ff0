"""Fused QKV projection producing the attention forward's MXFP8 operands (issue 7, third bullet).

    xn = rmsnorm_quant(x, g, row_scaled=True).out            # RowScaledFP8 (B, S, K): FP8 + one exponent per row
    q, k, v = qkv_proj(xn, Wqkv, n_heads=16, n_kv_heads=4, head_dim=128, rotary=(cos, sin))
    o = mxfp8_attn_func(q, k, v, causal=True)                 # no BF16 q/k/v ever in memory

``qkv_proj`` is one Triton kernel (``mxattn/kernels/qkv_proj.py``): FP8 GEMM main loop (``linear_quant``'s),
and an epilogue that adds the bias, applies the rotary embedding to q and k heads on the fp32 accumulator and
MX-quantizes each head straight into the orientation the attention forward wants.  What the forward consumes
(``interface._check_attention_inputs`` / ``_mx_forward``, DESIGN §1 table: S = Q Kᵀ contracts the head dim,
O = P V the key sequence):

* ``q``: ``MXTensor`` (B, S, Hq, D), ``dim=3`` (blocked along the head dim, ``hdim``), data contiguous,
  scale (B, S, Hq, D/32);
* ``k``: ``MXTensor`` (B, S, Hkv, D), ``dim=3`` (``hdim``), the same layout;
* ``v``: ``MXTensor`` (B, S, Hkv, D), ``dim=1`` (blocked along the sequence, ``seq``; blocks are 32 tokens of
  one batch, the last one partial), scale (B, ceil(S/32), Hkv, D).  On CUDA the data is the (B, S, Hkv, D) view
  of a channel-major (B, Hkv, D, S_pad) buffer (S_pad = S rounded up to 16, zero padding): the K-major layout
  the P·V product needs, which ``row_scaled_triton(v, "v")`` reads with unit stride along S.

CPU tensors run the reference composition (``qkv_proj_reference``'s math on the same operands), same API.
Every argument is checked before any launch (``TypeError`` / ``ValueError`` naming it).

Autograd: differentiable w.r.t. a float ``x`` (or the producer behind a ``GradRowScaledFP8`` / ``GradMXTensor``
x, e.g. ``rmsnorm_quant`` of a tensor that requires grad), a float ``weight`` and ``bias``, exactly as
``linear_quant``: the outputs are then ``GradMXTensor`` whose ``dequantize()`` is a straight-through estimator,
and the backward undoes the rotary (its transpose) and runs two matmuls on the dequantized FP8 operands.  The
rotary tables get no gradient.  ``mxfp8_attn_func`` on MXTensors is forward-only, so gradients reach the
projection only through ``q.dequantize()`` & co., not through the attention.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from mxattn import formats
from mxattn import producers as P
from mxattn.formats import MXTensor, RowScaledFP8, ScaleMode

__all__ = ["qkv_proj", "qkv_proj_reference", "rotary_tables", "bench_qkv_chain", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (64, 128)  # the attention's; the kernel needs D % 64 == 0 (two halves of whole MX blocks)

Operand = Union[torch.Tensor, MXTensor, RowScaledFP8]


# ----------------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------------


def rotary_tables(S: int, head_dim: int, base: float = 10000.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` fp32 (S, head_dim) of ``mxattn.nn.RotaryEmbedding`` (positions 0..S-1, halves layout:
    both halves hold the same angles)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(torch.arange(S, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)


def _bcast(t: torch.Tensor) -> torch.Tensor:
    """(S, D) -> (1, S, 1, D); (B, S, D) -> (B, S, 1, D)."""
    return t[None, :, None, :] if t.ndim == 2 else t[:, :, None, :]


def _rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``y * cos + rotate_half(y) * sin`` in fp32 on (B, S, H, D), rotate_half(y) = (-y_hi, y_lo): the products
    of ``nn.RotaryEmbedding.forward``."""
    y1, y2 = y.chunk(2, dim=-1)
    return y * _bcast(cos) + torch.cat((-y2, y1), dim=-1) * _bcast(sin)


def _rope_transpose(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_rope`` w.r.t. y: ``g * cos + rotate_half^T(g * sin)``, rotate_half^T(u) = (u_hi, -u_lo)."""
    u = g * _bcast(sin)
    u1, u2 = u.chunk(2, dim=-1)
    return g * _bcast(cos) + torch.cat((u2, -u1), dim=-1)


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _check_count(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    return v


def _check_qkv(x, weight, bias, n_heads, n_kv_heads, head_dim, rotary, scale_mode):
    Hq, Hkv, D = (_check_count(v, n) for v, n in ((n_heads, "n_heads"), (n_kv_heads, "n_kv_heads"),
                                                   (head_dim, "head_dim")))
    if Hq % Hkv:
        raise ValueError(f"n_heads ({Hq}) must be a multiple of n_kv_heads ({Hkv})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} (the attention's), got {D}")
    if isinstance(x, (torch.Tensor, MXTensor, RowScaledFP8)) and len(x.shape) != 3:
        raise ValueError(f"x must be (B, S, K), got shape {tuple(x.shape)}")
    _orient, mode, kx, kw = P._check_linear(x, weight, bias, "hdim", scale_mode)
    N = (Hq + 2 * Hkv) * D
    if weight.shape[0] != N:
        raise ValueError(f"weight must have (n_heads + 2 * n_kv_heads) * head_dim = {N} rows (q heads, then k, "
                         f"then v), got {weight.shape[0]}")
    B, S, _K = x.shape
    cos = sin = None
    if rotary is not None:
        if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
            raise TypeError(f"rotary must be None or a pair (cos, sin) of tensors, got {type(rotary).__name__}")
        cos, sin = rotary
        for name, t in (("rotary[0] (cos)", cos), ("rotary[1] (sin)", sin)):
            P._check_float_tensor(t, name)
            if tuple(t.shape) not in ((S, D), (B, S, D)):
                raise ValueError(f"{name} must have shape (S, head_dim) = {(S, D)} or (B, S, head_dim) = "
                                 f"{(B, S, D)}, got {tuple(t.shape)}")
            P._check_device(t, name, x.device)
        if cos.shape != sin.shape:
            raise ValueError(f"rotary: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return Hq, Hkv, D, mode, kx, kw, cos, sin


# ----------------------------------------------------------------------------------------------
# Reference and implementation
# ----------------------------------------------------------------------------------------------


def _from_rows(xr: RowScaledFP8, wr: RowScaledFP8, bias, B, S, Hq, Hkv, D, cos, sin, mode) -> list[MXTensor]:
    """The reference math on row-scaled (rows, K) operands: fp32 matmul, bias, rotary in fp32, quantize."""
    y = xr.dequantize(torch.float32) @ wr.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    q, k, v = y.reshape(B, S, Hq + 2 * Hkv, D).split((Hq, Hkv, Hkv), dim=2)
    if cos is not None:
        cf, sf = cos.to(torch.float32), sin.to(torch.float32)
        q, k = _rope(q, cf, sf), _rope(k, cf, sf)
    return [formats.quantize_mxfp8(q, 3, mode), formats.quantize_mxfp8(k, 3, mode), formats.quantize_mxfp8(v, 1, mode)]


def qkv_proj_reference(
    x: Operand,
    weight: Operand,
    bias: Optional[torch.Tensor] = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rotary: Optional[Sequence[torch.Tensor]] = None,
    scale_mode: Union[str, ScaleMode] = "rceil",
) -> tuple[MXTensor, MXTensor, MXTensor]:
    """What the fused kernel computes, in plain PyTorch: x and W as ``RowScaledFP8`` (one exponent per token row /
    output channel; float inputs through ``row_scaled_from_float``, MX inputs through ``to_row_scaled``, as
    ``linear_quant_reference``), dequantized, ``y = x W^T (+ bias)`` in fp32, split into heads (q, k, v), the
    rotary ``y * cos + rotate_half(y) * sin`` on q and k in fp32, then ``quantize_mxfp8`` of q, k along the
    head dim (dim=3) and of v along the sequence (dim=1).  Data contiguous (B, S, H, D)."""
    Hq, Hkv, D, mode, _kx, _kw, cos, sin = _check_qkv(x, weight, bias, n_heads, n_kv_heads, head_dim, rotary,
                                                      scale_mode)
    B, S, K = x.shape
    xr = P._as_row_scaled(P._flatten_rows(x, K), mode)
    wr = P._as_row_scaled(weight, mode)
    return tuple(_from_rows(xr, wr, bias, B, S, Hq, Hkv, D, cos, sin, mode))


def _rotary_fp32(cos, sin):
    if cos is None:
        return None, None
    return cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()


def _qkv_impl(x, weight, bias, Hq, Hkv, D, cos, sin, mode, kx, kw):
    """([q, k, v] MXTensors, x operand, weight operand)."""
    xr = P._row_scaled_2d(x, kx, mode)
    wr = P._row_scaled_2d(weight, kw, mode)
    B, S, _K = x.shape
    if not P._use_kernels(xr.device):
        return _from_rows(xr, wr, bias, B, S, Hq, Hkv, D, cos, sin, mode), xr, wr
    from mxattn.kernels.qkv_proj import qkv_proj_fwd

    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias at unit stride
    r = qkv_proj_fwd(xr, wr, bias, cos, sin, B, S, Hq, Hkv, D, rceil=mode is ScaleMode.RCEIL)
    f8 = torch.float8_e4m3fn
    q = MXTensor(r["qd"].view(f8), r["qs"], 3)
    k = MXTensor(r["kd"].view(f8), r["ks"], 3)
    v = MXTensor(r["vd"][..., :S].permute(0, 3, 1, 2).view(f8), r["vs"], 1)
    return [q, k, v], xr, wr


class _QKVProjFn(torch.autograd.Function):
    """Inputs: the tensor carrying x's gradient (x, the carrier of a Grad* x, or None), the float weight (or
    None), bias (or None); the FP8 operands travel in ``args``.  Outputs: three zero-storage carriers."""

    @staticmethod
    def forward(ctx, xg, wg, bias, args, box):
        x, weight, Hq, Hkv, D, cos, sin, mode, kx, kw, out_dtype = args
        outs, xr, wr = _qkv_impl(x, weight, bias, Hq, Hkv, D, cos, sin, mode, kx, kw)
        box.extend(outs)
        ctx.xr, ctx.wr, ctx.cos, ctx.sin = xr, wr, cos, sin
        ctx.x_shape, ctx.heads = tuple(x.shape), (Hq, Hkv, D)
        ctx.xg_dtype = xg.dtype if xg is not None else None
        ctx.wg_dtype = wg.dtype if wg is not None else None
        ctx.has_bias = bias is not None
        ctx.set_materialize_grads(False)
        return tuple(P._carrier(o.shape, out_dtype, xr.device) for o in outs)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        if gq is None and gk is None and gv is None:
            return None, None, None, None, None
        Hq, Hkv, D = ctx.heads
        B, S, K = ctx.x_shape
        ref = next(g for g in (gq, gk, gv) if g is not None)
        dev = ref.device
        dt = ref.dtype if dev.type == "cuda" else torch.float32
        parts = []
        for g, h, rot in ((gq, Hq, True), (gk, Hkv, True), (gv, Hkv, False)):
            if g is None:
                g = torch.zeros(B, S, h, D, dtype=torch.float32, device=dev)
            g = g.to(torch.float32)
            if rot and ctx.cos is not None:
                g = _rope_transpose(g, ctx.cos.to(torch.float32), ctx.sin.to(torch.float32))
            parts.append(g)
        dy2 = torch.cat(parts, dim=2).reshape(B * S, (Hq + 2 * Hkv) * D)
        dx = dw = db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        dy2 = dy2.to(dt)
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ RowScaledFP8.dequantize(ctx.wr, dt)).reshape(ctx.x_shape).to(ctx.xg_dtype)
        if ctx.needs_input_grad[1]:
            dw = (dy2.T @ RowScaledFP8.dequantize(ctx.xr, dt)).to(ctx.wg_dtype)
        return dx, dw, db, None, None


def qkv_proj(
    x: Operand,
    weight: Operand,
    bias: Optional[torch.Tensor] = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    rotary: Optional[Sequence[torch.Tensor]] = None,
    scale_mode: Union[str, ScaleMode] = "rceil",
) -> tuple[MXTensor, MXTensor, MXTensor]:
    """Fused QKV projection: ``y = x @ weight.T (+ bias)``, rotary on q and k, MXFP8 q, k, v for the attention.

    Args:
        x: (B, S, K), K % 16 == 0: ``RowScaledFP8`` with one exponent per row (``rmsnorm_quant(...,
            row_scaled=True).out``: used as is), ``MXTensor`` blocked along K, or a bf16/fp16/fp32 tensor
            (re-expressed / quantized per call, one pass, like ``linear_quant``).
        weight: ((n_heads + 2 n_kv_heads) head_dim, K): rows of the q heads, then the k heads, then the v heads
            (``nn.MXFP8Attention.qkv``'s layout); ``RowScaledFP8`` (dim=-1), ``MXTensor`` (dim=-1) or float
            (quantized per call: pass ``kernels.linear_quant.row_scaled_rows(W)`` to do that once).
        bias: None or a float tensor of weight's row count, added in fp32 before the rotary.
        n_heads, n_kv_heads, head_dim: query heads, key/value heads (n_heads % n_kv_heads == 0), head dim (64
            or 128).
        rotary: None, or ``(cos, sin)`` float tensors (S, head_dim) or (B, S, head_dim) applied to q and k in
            fp32 before quantization, ``y * cos + rotate_half(y) * sin`` with rotate_half(y) = (-y[D/2:], y[:D/2])
            (``nn.RotaryEmbedding``'s halves convention; ``rotary_tables`` makes its tables).
        scale_mode: "rceil" (default) or "floor".
    Returns:
        ``(q, k, v)`` MXTensors: q (B, S, n_heads, head_dim) and k (B, S, n_kv_heads, head_dim) blocked along the
        head dim (dim=3); v (B, S, n_kv_heads, head_dim) blocked along the sequence (dim=1), on CUDA a view of a
        channel-major buffer.  Exactly what ``mxfp8_attn_func(q, k, v, ...)`` takes.
    Values: ``qkv_proj_reference`` up to the FP8 accumulation order (not bit-exact; tests bound it).
    Differentiable (straight-through) w.r.t. a float x or the producer behind a Grad* x, a float weight and bias:
    the outputs are then ``GradMXTensor`` (module docstring)."""
    Hq, Hkv, D, mode, kx, kw, cos, sin = _check_qkv(x, weight, bias, n_heads, n_kv_heads, head_dim, rotary,
                                                    scale_mode)
    cos, sin = _rotary_fp32(cos, sin)
    xg = x if kx == "float" else getattr(x, "carrier", None)
    wg = weight if kw == "float" else None
    needs = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (xg, wg, bias))
    if not needs:
        outs, _, _ = _qkv_impl(x, weight, bias, Hq, Hkv, D, cos, sin, mode, kx, kw)
        return tuple(outs)
    if xg is not None:
        out_dtype = xg.dtype
    else:
        out_dtype = wg.dtype if wg is not None else torch.bfloat16
    xplain = x.plain() if isinstance(x, (P.GradMXTensor, P.GradRowScaledFP8)) else x
    box: list = []
    carriers = _QKVProjFn.apply(xg, wg, bias, (xplain, weight, Hq, Hkv, D, cos, sin, mode, kx, kw, out_dtype), box)
    return tuple(P._attach(o, c) for o, c in zip(box, carriers))


# ----------------------------------------------------------------------------------------------
# Benchmark (GPU)
# ----------------------------------------------------------------------------------------------


def bench_qkv_chain(
    B: int = 2,
    S: int = 4096,
    dim: int = 2048,
    n_heads: int = 16,
    kv_heads: Sequence[int] = (16, 4),
    causal: bool = True,
    rep_ms: int = 100,
    outdir=None,
    what: str = "qkv_chain",
    progress: bool = True,
    tiles: Sequence = (None,),
) -> dict:
    """Forward time and peak memory of the MXFP8 chain ``rmsnorm_quant(row_scaled) -> qkv_proj(rotary) ->
    mxfp8_attn_func`` against the BF16 chain ``F.rms_norm -> F.linear -> rotary (nn.RotaryEmbedding's fp32 math)
    -> F.scaled_dot_product_attention`` (torch's backend choice, ``enable_gqa`` for GQA), one row per
    ``kv_heads`` entry and ``tiles`` entry (``kernels.qkv_proj.QKVTile``; None = the default), bf16 x (B, S, dim),
    head dim dim / n_heads (defaults: MHA 16/16 and GQA 16/4 at B2 S4096 dim 2048, D = 128).

    Methods: ``mxattn`` (the projection weight pre-quantized once, as a deployed model would keep it),
    ``mxattn_bf16_weight`` (bf16 weight quantized inside every call), ``bf16``.  Times: median ms
    (``triton.testing.do_bench``); peak memory: ``max_memory_allocated`` during one call above what was allocated
    before it (inputs, weights and tables excluded), in MiB.  ``tflops``: (projection 2 B S dim N + attention
    4 B Hq S^2 D, halved when causal) / time.  Returns ``{"rows": [...]}``; with ``outdir`` writes the rows with
    ``mxattn.bench.results.write_result(what, ...)`` and adds ``"file"``.  ``what`` defaults to ``"qkv_chain"``.  Needs CUDA (RuntimeError otherwise); importable anywhere."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_qkv_chain needs a CUDA device")
    import torch.nn.functional as F
    import triton.testing

    import mxattn.kernels.qkv_proj as kqp
    from mxattn.interface import mxfp8_attn_func
    from mxattn.kernels.linear_quant import row_scaled_rows

    dev = "cuda"
    if dim % n_heads:
        raise ValueError(f"dim ({dim}) must be a multiple of n_heads ({n_heads})")
    D = dim // n_heads

    def ms(fn):
        fn()
        return float(triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))

    def peak_mib(fn):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        p = torch.cuda.max_memory_allocated() - base
        del out
        return p / 2**20

    rows = []
    for Hkv in kv_heads:
        gen = torch.Generator(device=dev).manual_seed(0)
        N = (n_heads + 2 * Hkv) * D
        x = torch.randn(B, S, dim, device=dev, dtype=torch.bfloat16, generator=gen)
        g = (1 + 0.1 * torch.randn(dim, device=dev, generator=gen)).to(torch.bfloat16)
        W = (torch.randn(N, dim, device=dev, generator=gen) * dim ** -0.5).to(torch.bfloat16)
        Wr = row_scaled_rows(W)
        cos, sin = rotary_tables(S, D, device=dev)
        kw = dict(n_heads=n_heads, n_kv_heads=Hkv, head_dim=D, rotary=(cos, sin))

        def mx(weight=Wr):
            xn = P.rmsnorm_quant(x, g, row_scaled=True).out
            return mxfp8_attn_func(*qkv_proj(xn, weight, **kw), causal=causal)

        def bf():
            h = F.rms_norm(x, (dim,), g, 1e-6)
            q, k, v = F.linear(h, W).view(B, S, n_heads + 2 * Hkv, D).split((n_heads, Hkv, Hkv), dim=2)
            q, k = (_rope(t.float(), cos, sin).to(torch.bfloat16) for t in (q, k))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=Hkv != n_heads)
            return o.transpose(1, 2)

        flop = 2.0 * B * S * dim * N + 4.0 * B * n_heads * S * S * D * (0.5 if causal else 1.0)
        with torch.no_grad():
            base_ms, base_mem = ms(bf), peak_mib(bf)
            for tile in tiles:
                saved = kqp.TILE_OVERRIDE
                kqp.TILE_OVERRIDE = tile
                try:
                    methods = {"mxattn": mx, "mxattn_bf16_weight": lambda: mx(W)}
                    t = {name: ms(fn) for name, fn in methods.items()}
                    mem = {name: peak_mib(fn) for name, fn in methods.items()}
                finally:
                    kqp.TILE_OVERRIDE = saved
                t["bf16"], mem["bf16"] = base_ms, base_mem
                row = {"B": B, "S": S, "dim": dim, "Hq": n_heads, "Hkv": Hkv, "D": D, "causal": causal,
                       "tile": None if tile is None else vars(tile),
                       "ms": t, "peak_mib": mem, "tflops": {k: flop / v / 1e9 for k, v in t.items()},
                       "speedup_vs_bf16": t["bf16"] / t["mxattn"],
                       "peak_mem_ratio_vs_bf16": mem["mxattn"] / mem["bf16"]}
                rows.append(row)
                if progress:
                    print(f"  qkv chain B{B} S{S} dim{dim} H{n_heads}/{Hkv} D{D} causal={causal} tile={tile}: "
                          + ", ".join(f"{k} {v:.3f} ms / {mem[k]:.0f} MiB" for k, v in t.items())
                          + f"; speedup {row['speedup_vs_bf16']:.2f}x", flush=True)
        torch.cuda.empty_cache()
    out = {"rows": rows}
    if outdir is not None:
        from mxattn.bench.results import write_result

        out["file"] = str(write_result(what, rows, outdir, extra={"bench": "qkv_chain"}))
    return out
