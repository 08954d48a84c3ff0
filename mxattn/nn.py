"""Modules: an attention layer on MXFP8 attention and a pre-norm transformer block built from it.

``MXFP8Attention``: fused QKV projection (one ``nn.Linear``), optional rotary embedding, ``mxfp8_attn_func``
(causal by default), output projection.  ``MXFP8TransformerBlock``: RMSNorm -> attention -> residual,
RMSNorm -> MLP -> residual, constructed like a GPT block.  ``attention="sdpa"`` swaps the attention for
``F.scaled_dot_product_attention`` in the input dtype (the BF16 baseline), everything else unchanged, so
the two can be compared weight for weight.

Activations are (batch, seqlen, dim).  Both modules trace with ``torch.compile(fullgraph=True)``: the
attention is the ``mxattn::attn_fwd`` custom op (see ``interface``).  The projections are plain
``nn.Linear`` for now: ``producers.linear_quant`` emits MXTensors, which the attention accepts forward-only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mxattn.formats import ScaleMode
from mxattn.interface import SUPPORTED_HEAD_DIMS, mxfp8_attn_func

__all__ = ["ATTENTION_KINDS", "RotaryEmbedding", "MXFP8Attention", "MLP", "MXFP8TransformerBlock"]

ATTENTION_KINDS = ("mxfp8", "sdpa")
_ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), halves layout (GPT-NeoX / Llama): channel i pairs with i + D/2.

    forward(x): x (B, S, H, D) -> same shape and dtype; positions 0..S-1, angles computed in fp32."""

    def __init__(self, head_dim: int, base: float = 10000.0, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        t = torch.arange(S, dtype=torch.float32, device=x.device)
        ang = torch.outer(t, self.inv_freq.to(x.device))  # (S, D/2)
        cos = torch.cat((ang.cos(), ang.cos()), dim=-1)[None, :, None, :]
        sin = torch.cat((ang.sin(), ang.sin()), dim=-1)[None, :, None, :]
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _check_heads(dim: int, n_heads: int, n_kv_heads: int, attention: str) -> int:
    for name, val in (("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if dim % n_heads:
        raise ValueError(f"dim ({dim}) must be a multiple of n_heads ({n_heads})")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    head_dim = dim // n_heads
    if attention == "mxfp8" and head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim dim / n_heads = {head_dim} is not supported by mxfp8 attention; "
                         f"supported: {SUPPORTED_HEAD_DIMS}")
    return head_dim


class MXFP8Attention(nn.Module):
    """Multi-head (GQA when n_kv_heads < n_heads) self-attention with MXFP8 attention inside.

    Args:
        dim: model width; head dim = dim // n_heads, 64 or 128 for ``attention="mxfp8"``.
        n_heads, n_kv_heads: query heads and key/value heads (default n_heads); n_heads % n_kv_heads == 0.
        causal: causal mask (default True).
        rotary: rotary embedding on q and k (default True), ``rope_base`` its base.
        attention: "mxfp8" (``mxfp8_attn_func``) or "sdpa" (``F.scaled_dot_product_attention`` in the input dtype).
        bias: biases in the two projections.
        scale_mode, deterministic: passed to ``mxfp8_attn_func``.

    forward(x): (B, S, dim) -> (B, S, dim).  Parameters: ``qkv`` (dim -> (n_heads + 2 n_kv_heads) head_dim, q rows
    first, then k, then v) and ``proj`` (n_heads head_dim -> dim).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, *, causal: bool = True,
                 rotary: bool = True, rope_base: float = 10000.0, attention: str = "mxfp8", bias: bool = False,
                 scale_mode: str = "rceil", deterministic: bool = False, device=None, dtype=None):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = _check_heads(dim, n_heads, n_kv_heads, attention)
        for name, flag in (("causal", causal), ("rotary", rotary), ("bias", bias), ("deterministic", deterministic)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        ScaleMode.parse(scale_mode)  # refused here rather than at the first forward
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.causal, self.attention, self.scale_mode, self.deterministic = causal, attention, scale_mode, deterministic
        kw = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias, **kw)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=bias, **kw)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base, device=device) if rotary else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[2] != self.qkv.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be (batch, seqlen, dim={self.qkv.in_features}), got {got}")
        B, S, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, S, Hq + 2 * Hkv, D).split((Hq, Hkv, Hkv), dim=2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.attention == "mxfp8":
            o = mxfp8_attn_func(q, k, v, causal=self.causal, scale_mode=self.scale_mode,
                                deterministic=self.deterministic)
        else:
            if Hq != Hkv:  # query head h reads kv head h // (Hq // Hkv), as in mxfp8_attn_func
                k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=self.causal).transpose(1, 2)
        return self.proj(o.reshape(B, S, Hq * D))


class MLP(nn.Module):
    """fc1 (dim -> hidden) -> GELU or SiLU -> fc2 (hidden -> dim)."""

    def __init__(self, dim: int, hidden: int, activation: str = "gelu", bias: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(_ACTIVATIONS)}, got {activation!r}")
        self.act = _ACTIVATIONS[activation]
        self.fc1 = nn.Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MXFP8TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``; RMSNorm with ``norm_eps``.

    Args:
        dim, n_heads, n_kv_heads: as ``MXFP8Attention``.
        mlp_ratio: MLP hidden width = mlp_ratio * dim.
        norm_eps: RMSNorm epsilon.
        attention: "mxfp8" or "sdpa" (the BF16 swap-in for comparison; same parameters, so weights load across).
        activation: "gelu" (GPT) or "silu".
        causal, rotary, bias, scale_mode, deterministic: as ``MXFP8Attention``.

    forward(x): (B, S, dim) -> (B, S, dim), x's dtype (the parameters' dtype).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, mlp_ratio: float = 4,
                 norm_eps: float = 1e-6, *, attention: str = "mxfp8", activation: str = "gelu", causal: bool = True,
                 rotary: bool = True, bias: bool = False, scale_mode: str = "rceil", deterministic: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.RMSNorm(dim, eps=norm_eps, **kw)
        self.attn = MXFP8Attention(dim, n_heads, n_kv_heads, causal=causal, rotary=rotary, attention=attention,
                                   bias=bias, scale_mode=scale_mode, deterministic=deterministic, **kw)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps, **kw)
        self.mlp = MLP(dim, int(mlp_ratio * dim), activation, bias=bias, **kw)

    @property
    def attention(self) -> str:
        return self.attn.attention

    @attention.setter
    def attention(self, kind: str) -> None:
        """Switch the attention in place ("mxfp8" or "sdpa"); the parameters stay."""
        _check_heads(self.norm1.normalized_shape[0], self.attn.n_heads, self.attn.n_kv_heads, kind)
        self.attn.attention = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
