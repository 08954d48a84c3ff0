"""Hugging Face ``transformers`` plug-in: ``attn_implementation="mxfp8"`` runs mxattn's MXFP8 attention.

Usage::

    import mxattn.hf
    mxattn.hf.register()                      # once per process; name defaults to "mxfp8"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mxfp8")
    # or, on a loaded model:  model.set_attn_implementation("mxfp8")

Any model that dispatches through ``transformers.AttentionInterface`` (Llama, Mistral, Qwen2/3, ... : the
"functional" attention models) can use it.  ``transformers`` stays an optional dependency of mxattn: only this
module imports it, and only inside :func:`register` (``import mxattn`` does not import this module).

Semantics (see :func:`attention_forward`): the attention is ``mxattn.mxfp8_attn_func`` (MXFP8 quantized Q, K, V;
P in e4m3; FP8 backward), GQA/MQA handled natively, causal from the module (``module.is_causal``, overridden by an
``is_causal`` keyword).  What the MXFP8 kernels cannot express is refused with an error rather than ignored:
padding masks and packed sequences (``ValueError``), attention dropout, sliding windows, logit soft-capping,
position biases and attention sinks (``NotImplementedError``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["register", "attention_forward", "DEFAULT_NAME"]

DEFAULT_NAME = "mxfp8"

# Keyword arguments some transformers models pass to the attention function that mxattn cannot honour.  Each one is
# refused (NotImplementedError) when it is not None; everything else in **kwargs (position_ids, output_attentions,
# cache bookkeeping, ...) is irrelevant to the attention product and ignored, as the sdpa integration does.
_UNSUPPORTED_KWARGS = {
    "sliding_window": "sliding-window (local) attention",
    "softcap": "attention logit soft-capping",
    "position_bias": "additive position biases (T5-style)",
    "s_aux": "attention sinks",
}

_PADDING_HELP = (
    "mxattn's transformers integration (attn_implementation='mxfp8') supports only unpadded batches: no attention "
    "mask, an all-ones mask, or exactly the causal mask.  Run batches without padding (equal-length sequences, "
    "attention_mask=None), or pack the sequences and call mxattn.mxfp8_attn_varlen_func with cu_seqlens directly."
)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "may attend" view of a transformers mask (bool: True = attend; float: additive, 0 = attend)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():  # a 0/1 integer mask, as tokenizers return for 2D padding masks
        return mask != 0
    blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
    if not bool(((mask == 0) | blocked).all()):
        raise ValueError(
            "attention_mask holds additive biases other than 0 / -inf (e.g. ALiBi or a soft mask); mxattn's MXFP8 "
            "attention cannot apply them.  " + _PADDING_HELP
        )
    return mask == 0


def _mask_causality(mask: torch.Tensor, batch: int, sq: int, sk: int, causal: bool) -> bool:
    """The ``causal`` flag equivalent to ``mask``; ValueError when the mask is neither all-visible nor causal.

    2D masks (batch, keys) are padding masks: they must be all ones (over the last ``sk`` keys) and leave ``causal``
    as it is.  4D masks (batch or 1, heads or 1, sq, sk) are the full pattern: all True means bidirectional, the
    bottom-right aligned causal pattern (query i sees key j iff j <= i + sk - sq, what HF builds with a cache and
    what mxattn applies) means causal.  The check costs one elementwise pass over the mask (and one host sync); it
    only runs when transformers materialized a mask, which it does not for unpadded causal batches.
    """
    if mask.dim() == 2:
        if mask.shape[0] not in (1, batch) or mask.shape[1] < sk:
            raise ValueError(f"2D attention_mask of shape {tuple(mask.shape)} does not match batch {batch}, keys {sk}")
        if not bool(_visible(mask[:, -sk:]).all()):
            raise ValueError("attention_mask contains padding (zeros).  " + _PADDING_HELP)
        return causal
    if mask.dim() != 4 or mask.shape[-2:] != (sq, sk) or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} is not a (batch, 1 or heads, {sq}, {sk}) mask for "
            f"{sq} queries and {sk} keys (a static cache's unused slots are not supported).  " + _PADDING_HELP
        )
    vis = _visible(mask)
    if bool(vis.all()):
        return False
    i = torch.arange(sq, device=mask.device)[:, None]
    j = torch.arange(sk, device=mask.device)[None, :]
    if bool((vis == (j <= i + (sk - sq))).all()):
        return True
    raise ValueError(
        "attention_mask masks more than the causal pattern (padding tokens, packed sequences, or a static cache's "
        "unused slots).  " + _PADDING_HELP
    )


_POSITIONS_MEMO: list = [None, -1, False]  # (weakref to the last position_ids checked, its version, result)


def _packed_positions(position_ids, sq: int) -> bool:
    """True when 2D ``position_ids`` (batch or 1, sq) do not advance by one along each row: packed sequences
    (DataCollatorWithFlattening style) that transformers did not turn into a mask (it only does so without a cache).
    One small pass and host sync per forward: the result is remembered for the tensor object every layer shares.
    Skipped while torch.compile traces (the check would break the graph)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != sq:
        return False
    if torch.compiler.is_compiling():
        return False
    ref, version, result = _POSITIONS_MEMO
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return result
    result = bool((position_ids.diff(dim=-1) != 1).any())
    _POSITIONS_MEMO[:] = [weakref.ref(position_ids), position_ids._version, result]
    return result


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function running ``mxattn.mxfp8_attn_func``.

    Args:
        module: the calling attention layer (``module.is_causal`` gives the causality, default True).
        query: (B, Hq, Sq, D); key, value: (B, Hkv, Sk, D), Hq a multiple of Hkv (GQA/MQA without repeating K/V);
            D in {64, 128}; bfloat16, float16 or float32.  CUDA tensors run the Hopper FP8 kernels, CPU tensors the
            reference with the same semantics.
        attention_mask: what transformers' mask function (``sdpa_mask``, registered under the same name) built, or
            a mask the caller passed.  Accepted only when it changes nothing: None, an all-ones mask, or exactly the
            causal pattern (bottom-right aligned).  Padding, packed-sequence (block-diagonal) and static-cache masks
            raise ``ValueError``: use unpadded batches, or ``mxattn.mxfp8_attn_varlen_func`` on packed sequences.
            A mask is never ignored silently.  Checking a materialized mask costs one pass over it per layer; an
            unpadded causal batch has no mask at all (transformers skips building it), so it costs nothing.
        scaling: softmax scale (default 1/sqrt(D)).
        dropout: must be 0; attention dropout raises ``NotImplementedError`` (set ``config.attention_dropout = 0``
            or call ``model.eval()``).
        kwargs: ``is_causal`` overrides ``module.is_causal``; ``sliding_window``, ``softcap``, ``position_bias`` and
            ``s_aux`` (sinks) raise ``NotImplementedError`` when not None; ``cu_seq_lens_q``/``cu_seq_lens_k``
            (packed batches) raise ``ValueError``, and so do 2D ``position_ids`` that restart inside a row when
            no mask separates the sequences (checked once per forward); other keywords are ignored, as in the sdpa integration.

    Causality follows transformers' sdpa path exactly: with no mask, causal attention applies when Sq > 1, and when
    there are more keys than queries (prefill into an empty static cache) only the first Sq keys take part (sdpa's
    top-left ``is_causal``).  Returns ``(out, None)``, out (B, Sq, Hq, D) in query's dtype; no attention weights.
    """
    from mxattn.interface import mxfp8_attn_func

    if dropout is not None and dropout > 0:
        raise NotImplementedError(
            f"mxattn's MXFP8 attention has no attention dropout (got dropout={dropout}); set "
            "config.attention_dropout=0.0 or put the model in eval mode"
        )
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"mxattn's MXFP8 attention does not support {what} ({name}={kwargs[name]!r})")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            "packed sequences (cu_seq_lens_q/cu_seq_lens_k) are not handled by attn_implementation='mxfp8'.  "
            + _PADDING_HELP
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"expected query/key/value of shape (batch, heads, seq, head_dim), got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )

    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    batch, sq, sk = query.shape[0], query.shape[2], key.shape[2]

    if attention_mask is not None:
        causal = _mask_causality(attention_mask, batch, sq, sk, is_causal)
    else:
        if sq > 1 and _packed_positions(kwargs.get("position_ids"), sq):
            raise ValueError(
                "position_ids restart inside a row (packed sequences) but no attention_mask separates them; "
                "attn_implementation='mxfp8' would let the sequences attend to each other.  " + _PADDING_HELP
            )
        # The sdpa integration's rule: is_causal only with several queries (one query sees every key), and
        # top-left alignment when keys outnumber queries, i.e. the keys beyond the first Sq are never seen.
        causal = is_causal and sq > 1
        if causal and sk > sq:
            key, value = key[:, :, :sq], value[:, :, :sq]

    # (B, H, S, D) -> (B, S, H, D): a view; the kernels take any strides with D contiguous.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = mxfp8_attn_func(q, k, v, causal=causal, softmax_scale=None if scaling is None else float(scaling))
    return out, None


def register(name: str = DEFAULT_NAME) -> str:
    """Register mxattn's MXFP8 attention with transformers under ``name`` (default ``"mxfp8"``); returns ``name``.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and, where the installed
    transformers has ``masking_utils.AttentionMaskInterface`` (4.53+), the sdpa mask builder under the same name.
    The mask builder matters: transformers builds no mask at all for an implementation without one, so padding
    would be dropped silently; with sdpa's builder an unpadded causal batch gets no mask (nothing to check) and a
    padded one gets a boolean mask that :func:`attention_forward` rejects.  Idempotent; then use
    ``attn_implementation=name`` in ``from_pretrained``/``from_config`` or ``model.set_attn_implementation(name)``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # transformers is optional for mxattn
        raise ImportError(
            "mxattn.hf.register() needs Hugging Face transformers (pip install 'transformers>=4.56')"
        ) from e
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # transformers without masking_utils: masks reach the attention function as they are
        return name
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
