"""Ground truth: attention forward and backward on MXFP8 (or float) inputs, in plain PyTorch.

Every attention kernel in mxattn is tested against these functions.  They compute in ``dtype``
(fp64 by default, fp32 allowed) on the inputs' device, materialise the score matrix one chunk of
query rows of one head at a time (see ``_CHUNK_ELEMENTS``), and never call autograd.

Layouts
    dense:  q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv); out (B, Sq, Hq, Dv),
            lse (B, Hq, Sq).
    packed: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) with ``cu_seqlens_q`` / ``cu_seqlens_k``
            (int32, length batch + 1, starting at 0, non-decreasing, ending at Tq / Tk); sequence b
            is rows ``cu[b]:cu[b+1]`` and attends only to itself.  out (Tq, Hq, Dv), lse (Hq, Tq).
    q, k, v (and ``out``, ``dout``, ``q_seq``, ``k_seq``, ``v_hdim``) may be float tensors or
    ``MXTensor``; MX inputs are dequantized exactly (``.dequantize(dtype)``).

Semantics (FlashAttention conventions)
    GQA/MQA: Hq is a multiple of Hkv; query head h uses kv head ``h // (Hq // Hkv)``.
    ``softmax_scale`` defaults to ``1 / sqrt(D)``.  ``lse`` is the natural-log sum of
    ``exp(softmax_scale * q.k)`` over the keys a row sees.
    causal: aligned bottom-right, query i sees key j iff ``j <= i + Sk - Sq`` (per sequence when
    packed).  A row that sees no key (causal with Sq > Sk, or Sk = 0) has out = 0 and lse = -inf,
    and contributes nothing to the gradients.

Emulation of the FP8 kernels' low-precision steps (all off by default, which gives exact attention
of the given inputs):
    forward ``quantize_p``: the probabilities enter ``P V`` as ``P~ = e4m3(exp(s - m) * 256)`` with
    m the row max (DESIGN §1: constant scale 2^-8, values <= 256, no saturation), and the row sum
    is accumulated from the same P~: ``l = sum P~``, ``out = P~ V / l``, ``lse = m + log(l / 256)``.
    The final row max is used for every key; a kernel using a running max rescales earlier tiles
    in fp32, so it agrees with this only statistically (same error level), not bit for bit.
    backward switches: see ``attention_backward``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from mxattn.formats import BLOCK_SIZE, MXTensor, mx_block_exponents, quantize_mxfp8, round_to_e4m3

__all__ = ["attention_forward", "attention_backward", "sqnr_db", "cosine", "max_rel_error"]

Operand = Union[torch.Tensor, MXTensor]

# Score-matrix elements per chunk (one head, a run of query rows, all keys).  The backward keeps
# about eight such matrices alive, so 2^21 fp64 elements bound the working set near 150 MB.
_CHUNK_ELEMENTS = 1 << 21
# Query rows per chunk are a multiple of this, so that dS blocks along q never straddle chunks.
_ROW_ALIGN = 32
# P enters the products scaled by 2^8 (constant MX scale 2^-8): max(P) = 1 -> 256 fits e4m3.
_P_SCALE = 256.0


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------


def _as_f64(x: Operand) -> torch.Tensor:
    return x.dequantize(torch.float64) if isinstance(x, MXTensor) else x.detach().to(torch.float64)


def _pair(actual: Operand, expected: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    a, e = _as_f64(actual), _as_f64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {tuple(a.shape)} vs expected {tuple(e.shape)}")
    return a, e.to(a.device)


def sqnr_db(actual: Operand, expected: Operand) -> float:
    """``10 log10(sum(expected^2) / sum((actual - expected)^2))`` in fp64.

    +inf when the two are equal, nan when either holds NaN (or Inf makes the ratio undefined)."""
    a, e = _pair(actual, expected)
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("nan")
    signal = float((e * e).sum())
    noise = float(((a - e) ** 2).sum())
    if math.isnan(noise) or math.isnan(signal) or (math.isinf(noise) and math.isinf(signal)):
        return float("nan")
    if noise == 0.0:
        return float("inf")
    if signal == 0.0 or math.isinf(noise):
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def cosine(actual: Operand, expected: Operand) -> float:
    """Cosine similarity of the flattened tensors in fp64 (1.0 when both are zero, 0.0 when only
    one is, nan when either holds NaN)."""
    a, e = _pair(actual, expected)
    a, e = a.flatten(), e.flatten()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("nan")
    na, ne = float(a.norm()), float(e.norm())
    if na == 0.0 or ne == 0.0:
        return 1.0 if na == ne else 0.0
    return float((a @ e) / (na * ne))


def max_rel_error(actual: Operand, expected: Operand) -> float:
    """``max |actual - expected| / max |expected|`` in fp64 (0.0 when equal, inf when expected is
    all zero and actual is not, nan when either holds NaN)."""
    a, e = _pair(actual, expected)
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("nan")
    if a.numel() == 0:
        return 0.0
    err = float((a - e).abs().max())
    ref = float(e.abs().max())
    if err == 0.0:
        return 0.0
    return err / ref if ref > 0.0 else float("inf")


# ----------------------------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------------------------


def _as_float(x: Operand, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(x, MXTensor):
        return x.dequantize(dtype).to(device)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"expected a float tensor or MXTensor, got {getattr(x, 'dtype', type(x))}")
    return x.detach().to(device=device, dtype=dtype)


def _mx_roundtrip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """MXFP8 (RCEIL) quantize along ``dim`` and dequantize, back in ``x``'s dtype."""
    return quantize_mxfp8(x, dim).dequantize(x.dtype)


def _block_roundtrip(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` quantized along ``dim`` with one RCEIL power of two per ``n`` consecutive elements (blocks from index 0,
    the last one may be partial) and dequantized, in ``x``'s dtype: MXFP8 with ``n``-element blocks, the same
    arithmetic as ``_mx_roundtrip`` (which is ``n = 32``): rounded to fp32 first, a block holding NaN or Inf is NaN.
    """
    if n == BLOCK_SIZE:
        return _mx_roundtrip(x, dim)
    x32 = x.to(torch.float32).movedim(dim, -1)
    L = x32.shape[-1]
    xb = torch.nn.functional.pad(x32, (0, (-L) % n)).reshape(*x32.shape[:-1], -1, n)
    finite = torch.isfinite(xb).all(dim=-1, keepdim=True)
    amax = torch.where(finite, xb.abs().amax(dim=-1, keepdim=True), torch.zeros_like(xb[..., :1]))
    e = mx_block_exponents(amax).to(torch.float64)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = round_to_e4m3(xb * torch.exp2(-e).to(torch.float32)).to(wide) * torch.exp2(e).to(wide)
    q = torch.where(finite, q, torch.full_like(q, float("nan")))
    return q.reshape(*x32.shape[:-1], -1)[..., :L].movedim(-1, dim).to(x.dtype)


def _e4m3_p(p: torch.Tensor) -> torch.Tensor:
    """``e4m3(p * 256)``, in ``p``'s dtype (still scaled by 256)."""
    return round_to_e4m3(p * _P_SCALE).to(p.dtype)


def _sequences(cu_q, cu_k, tq: int, tk: int) -> list[tuple[int, int, int, int]]:
    """(q_start, q_end, k_start, k_end) per packed sequence, after checking cu_seqlens."""
    if cu_q is None or cu_k is None:
        raise ValueError("packed layout needs both cu_seqlens_q and cu_seqlens_k")
    bounds = []
    for name, cu, total in (("cu_seqlens_q", cu_q, tq), ("cu_seqlens_k", cu_k, tk)):
        if not isinstance(cu, torch.Tensor) or cu.ndim != 1 or cu.dtype != torch.int32:
            raise ValueError(f"{name} must be a 1-D int32 tensor")
        c = cu.tolist()
        if len(c) < 1 or c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(f"{name}={c} must start at 0, not decrease and end at {total}")
        bounds.append(c)
    cq, ck = bounds
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries but cu_seqlens_k has {len(ck)}")
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: bool) -> None:
    rank = 3 if packed else 4
    layout = "(T, H, D) with cu_seqlens" if packed else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != rank:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ outside the head dim")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"batch of q ({q.shape[0]}) != batch of k ({k.shape[0]})")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def _split(x: torch.Tensor, packed: bool, seqs, which: int) -> list[torch.Tensor]:
    """Per-sequence (S, H, D) views: batch entries when dense, cu_seqlens slices when packed."""
    if not packed:
        return list(x.unbind(0))
    return [x[s[which] : s[which + 1]] for s in seqs]


def _layout(q: torch.Tensor, k: torch.Tensor, cu_q, cu_k):
    packed = cu_q is not None or cu_k is not None
    seqs = _sequences(cu_q, cu_k, q.shape[0], k.shape[0]) if packed else None
    return packed, seqs


# ----------------------------------------------------------------------------------------------
# one sequence, one head, a chunk of query rows
# ----------------------------------------------------------------------------------------------


def _row_chunks(sq: int, sk: int, align: int = _ROW_ALIGN) -> list[tuple[int, int]]:
    """Query-row chunks ``(r0, r1)``: ``align`` divides every chunk start (blocks along q never straddle chunks)."""
    rows = max(align, (_CHUNK_ELEMENTS // max(sk, 1)) // align * align)
    return [(r, min(r + rows, sq)) for r in range(0, sq, rows)]


def _scores(q_rows: torch.Tensor, k: torch.Tensor, r0: int, sq: int, causal: bool, scale: float):
    """Scaled scores of rows r0.. (of sq) of one head against all keys, -inf where masked."""
    s = (q_rows @ k.T) * scale
    if not causal:
        return s
    i = torch.arange(r0, r0 + q_rows.shape[0], device=s.device).unsqueeze(1)
    j = torch.arange(k.shape[0], device=s.device).unsqueeze(0)
    visible = j <= i + (k.shape[0] - sq)
    return s.masked_fill(~visible, float("-inf"))


def _row_max(s: torch.Tensor) -> torch.Tensor:
    """Row max, with 0 in place of -inf for rows that see nothing (so s - m stays -inf, not NaN)."""
    if s.shape[-1] == 0:
        return s.new_zeros(s.shape[:-1] + (1,))
    m = s.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _lse(s: torch.Tensor) -> torch.Tensor:
    """Exact natural-log row sums, (rows, 1); -inf for rows that see nothing."""
    m = _row_max(s)
    return m + torch.exp(s - m).sum(dim=-1, keepdim=True).log()


def _forward_rows(q_rows, k, v, r0, sq, causal, scale, quantize_p):
    s = _scores(q_rows, k, r0, sq, causal, scale)
    m = _row_max(s)
    p = torch.exp(s - m)  # <= 1, exactly 1 at the max; 0 where masked
    if quantize_p:
        p = _e4m3_p(p)  # <= 256, exactly 256 at the max
        l = p.sum(dim=-1, keepdim=True)
        lse = m + (l / _P_SCALE).log()
    else:
        l = p.sum(dim=-1, keepdim=True)
        lse = m + l.log()
    out = (p @ v) / torch.where(l > 0, l, torch.ones_like(l))
    return out, lse.squeeze(-1)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


def attention_forward(
    q: Operand,
    k: Operand,
    v: Operand,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    quantize_p: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(q k^T * softmax_scale) v`` and its log-sum-exp, in ``dtype``.

    Shapes and conventions: module docstring.  Returns ``(out, lse)``: out in q's layout with v's
    head dim, lse (B, Hq, Sq) dense or (Hq, Tq) packed, natural log.  ``quantize_p`` emulates the
    kernels' e4m3 P with constant scale 2^-8 (module docstring), otherwise the result is exact up to
    ``dtype`` rounding.
    """
    _check_dtype(dtype)
    dev = q.device
    q, k, v = (_as_float(t, dtype, dev) for t in (q, k, v))
    packed, seqs = _layout(q, k, cu_seqlens_q, cu_seqlens_k)
    _check(q, k, v, packed)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv

    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    lse = q.new_full(q.shape[:-1], float("-inf"))  # (B, Sq, Hq) or (Tq, Hq) for now
    for qs, ks, vs, os_, ls in zip(
        _split(q, packed, seqs, 0), _split(k, packed, seqs, 2), _split(v, packed, seqs, 2),
        _split(out, packed, seqs, 0), _split(lse, packed, seqs, 0),
    ):
        sq, sk = qs.shape[0], ks.shape[0]
        for h in range(hq):
            kh, vh = ks[:, h // group], vs[:, h // group]
            for r0, r1 in _row_chunks(sq, sk):
                o, l = _forward_rows(qs[r0:r1, h], kh, vh, r0, sq, causal, scale, quantize_p)
                os_[r0:r1, h] = o
                ls[r0:r1, h] = l
    return out, lse.movedim(-1, -2 if not packed else 0).contiguous()


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


def attention_backward(
    q: Operand,
    k: Operand,
    v: Operand,
    out: Operand,
    dout: Operand,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    quantize_p: bool = False,
    quantize_ds: bool = False,
    quantize_do: bool = False,
    q_seq: Optional[Operand] = None,
    k_seq: Optional[Operand] = None,
    v_hdim: Optional[Operand] = None,
    ds_q_block: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention, written out (no autograd), in ``dtype``.

    Shapes: module docstring; ``out`` and ``dout`` have out's shape, dq/dk/dv those of q/k/v.
    With every switch off these are the exact gradients for the given ``out``:
        P = exp(S - lse) with S = q k^T * scale and lse recomputed exactly here (not taken from a
        forward), dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D),
        dQ = scale * dS K, dK = scale * dS^T Q;
    dK and dV of a kv head are summed over the query heads of its group.  Rows that see no key
    give P = 0.  When ``out`` is the exact forward output, D = rowsum(P * dP) and the gradients are
    those of softmax attention.

    Switches emulating the FP8 backward kernels (DESIGN §1 table for orientations):
      quantize_p:  dV = P~^T dO with P~ = e4m3(P * 256) / 256 (constant scale 2^-8).  dS still uses
                   the unrounded P, as the kernels keep P in fp32 for it.
      quantize_do: dO is MXFP8-quantized (RCEIL) twice: along the head dim for dP = dO V^T and for
                   D = rowsum(dO * O) (the same dO as dP, so that each row of dS sums to zero, as
                   the gradient of the quantized dO would), and along the q sequence for dV.
      quantize_ds: dS (without the softmax scale, which is applied to the fp32 accumulators
                   afterwards) is MXFP8-quantized along kv for dQ = dS K and, separately, along q
                   for dK = dS^T Q.
      ds_q_block:  the block length along q of dK's dS quantization (default 32: MX).  The Hopper
                   dK/dV kernels with one dS exponent per key and query tile (``GluonDkdvConfig(
                   ds_exp="key")``, ``BwdConfig(ds_tile_scale=False)``) are ``ds_q_block=64``: one RCEIL
                   power of two per key per 64 queries (``ds_q_block=128`` at D = 64 through the public
                   backward, whose dK/dV steps cover 128 queries there), tiles from each sequence's first query (their
                   bound on an exponent's drop, 64 binades below the key's largest, is not emulated).
      Sequence-orientation quantizations (dO along q, dS along q) run per sequence: blocks of 32
      start at each sequence's first token (batch entry when dense, cu_seqlens start when packed)
      and the last block of a sequence may be partial.
      q_seq / k_seq / v_hdim: tensors (float or MXTensor, same shape as q / k / v) used in place of
      q in dK = dS^T Q, k in dQ = dS K and v in dP = dO V^T, e.g. Q and K quantized along the
      sequence and V along the head dim.  S is always recomputed from ``q`` and ``k``.
    """
    _check_dtype(dtype)
    dev = q.device
    q, k, v, out, dout = (_as_float(t, dtype, dev) for t in (q, k, v, out, dout))
    q_s = q if q_seq is None else _as_float(q_seq, dtype, dev)
    k_s = k if k_seq is None else _as_float(k_seq, dtype, dev)
    v_h = v if v_hdim is None else _as_float(v_hdim, dtype, dev)
    packed, seqs = _layout(q, k, cu_seqlens_q, cu_seqlens_k)
    _check(q, k, v, packed)
    for name, t, ref in (("out", out, None), ("dout", dout, None), ("q_seq", q_s, q), ("k_seq", k_s, k),
                         ("v_hdim", v_h, v)):
        want = q.shape[:-1] + (v.shape[-1],) if ref is None else ref.shape
        if t.shape != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(want)}")
    if not isinstance(ds_q_block, int) or isinstance(ds_q_block, bool) or ds_q_block < 1:
        raise ValueError(f"ds_q_block must be a positive int, got {ds_q_block!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv
    # chunk starts on multiples of dK's dS blocks along q (and of _ROW_ALIGN, as before)
    align = _ROW_ALIGN * ds_q_block // math.gcd(_ROW_ALIGN, ds_q_block)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    per_seq = zip(
        *(_split(t, packed, seqs, 0) for t in (q, q_s, out, dout, dq)),
        *(_split(t, packed, seqs, 2) for t in (k, k_s, v_h, dk, dv)),
    )
    for qs, qss, os_, dos, dqs, ks, kss, vhs, dks, dvs in per_seq:
        sq, sk = qs.shape[0], ks.shape[0]
        if sq == 0 or sk == 0:
            continue
        do_h = _mx_roundtrip(dos, -1) if quantize_do else dos  # for dP and D
        do_s = _mx_roundtrip(dos, 0) if quantize_do else dos  # for dV, blocks along q
        delta = (do_h * os_).sum(dim=-1)  # (Sq, Hq)
        for h in range(hq):
            kv = h // group
            for r0, r1 in _row_chunks(sq, sk, align):
                s = _scores(qs[r0:r1, h], ks[:, kv], r0, sq, causal, scale)
                lse = _lse(s)
                p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
                p_v = _e4m3_p(p) / _P_SCALE if quantize_p else p
                dvs[:, kv] += p_v.T @ do_s[r0:r1, h]
                dp = do_h[r0:r1, h] @ vhs[:, kv].T
                ds = p * (dp - delta[r0:r1, h, None])
                ds_kv = _mx_roundtrip(ds, -1) if quantize_ds else ds
                ds_q = _block_roundtrip(ds, 0, ds_q_block) if quantize_ds else ds
                dqs[r0:r1, h] = (ds_kv @ kss[:, kv]) * scale
                dks[:, kv] += (ds_q.T @ qss[r0:r1, h]) * scale
    return dq, dk, dv
