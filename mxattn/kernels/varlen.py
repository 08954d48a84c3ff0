"""Jagged (variable-length) batches for the Hopper forward: operand layouts, producers, and their PyTorch twins.

A jagged batch is packed: q (Tq, Hq, D), k and v (Tk, Hkv, D), with ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32,
batch + 1 entries, starting at 0, non-decreasing, ending at Tq / Tk); sequence b is rows ``cu[b]:cu[b+1]`` and attends
only to itself (``reference.attention_forward`` with cu_seqlens defines the semantics).  The FP8 data stays at its
packed offsets: nothing is padded to ``max_seqlen`` and nothing is gathered.  Only the exponents are laid out per
sequence, plus V's 16-column alignment (below).

Layouts (``VarlenFP8``; B sequences, ``cu_data`` / ``cu_exp`` are (B + 1) int32 on the data's device)
  q  data (Tq, Hq, D) e4m3, contiguous, rows as in the input.
     exp  (Tq, Hq, 1) int32: one exponent per token and head (Q's exponents do not depend on the sequences, so this
     is exactly the dense producer on the packed tensor).  cu_data = cu_exp = cu_seqlens_q.
  k  data (Tk, Hkv, D) e4m3, contiguous, rows as in the input.
     exp  (G, Hkv, 1) int32: one exponent per 128 keys *counted from each sequence's first key* (a group never spans
     two sequences), groups of sequence b at rows ``cu_exp[b] + j``, ``cu_exp`` = exclusive prefix sum of
     ceil(len_b / 128) ("cu_groups_k").  cu_data = cu_seqlens_k.
  v  data channel-major (Hkv, D, Tv) e4m3: sequence b's keys are columns ``cu_data[b] + j``, where ``cu_data`` is the
     exclusive prefix sum of len_b rounded up to 16 ("cu_seqlens_v"), and the up-to-15 columns after a sequence are
     zero.  MX blocks along the sequence start at each sequence's first key (a block never spans two sequences; the
     last block of a sequence may be partial).
     exp  (B, Hkv, D) int32: one exponent per channel over the whole sequence.  cu_exp is None (row b).
     ``v_blocks`` (the forward's V, ``varlen_operands``): the same bytes regrouped per sequence, a flat buffer
     whose sequence b is one (Hkv, D, round16(len_b)) block at element ``cu_data[b] * Hkv * D``, so a V tile's
     channel rows are one sequence long (not Tv: fewer DRAM pages per tile); the backward's channel-major Q, K
     and dO keep the batch-wide rows.
  Sizes do not need a host sync: G = floor((Tk + 127 B) / 128) and Tv = Tk + 15 B rounded up to 16 are upper
  bounds of the rows / columns used (at least 1 / 16); rows and columns past the last sequence are never read
  (K's unused exponent rows are zero, V's unused columns are left unwritten).

Why V's sequences start at multiples of 16 columns.  V is the one operand whose contiguous axis is the key axis
(FP8 wgmma wants P V's contraction dim contiguous).  With a sequence starting at an arbitrary column the compiler
cannot prove any alignment of the tile's base address, so the (BN, D) load of V falls to 1-byte accesses, and
Triton's pipeliner only turns loads of at least 4 bytes into asynchronous copies: V would be loaded synchronously
in every iteration of the key loop.  With 16-aligned starts (``tl.multiple_of``) and a zero-padded tail the V tile
is loaded like the dense one (16-byte vectors, cp.async pipelined) and its masked last tile can read to
len rounded up to 16 (mask constant over 16 keys).  Cost: at most 15 columns per sequence.  Q and K have D
contiguous, so any row offset keeps their loads aligned: they stay exactly at their packed offsets.  (Checked on the
PTX compiled for sm90: docs/perf-notes-varlen.md, and a test in tests/test_varlen.py.)

Producers (Triton: one kernel each for q and k, two for v as in the dense case (per-channel maxima, then data), plus
a few tiny torch ops for the offset arrays)
  ``varlen_q_operand(q, cu_seqlens_q, max_seqlen_q)``, ``varlen_k_operand(k, cu_seqlens_k, max_seqlen_k)``,
  ``varlen_v_operand(v, cu_seqlens_k, max_seqlen_k)``, all three: ``varlen_operands(...)``.
  Inputs bf16/fp16/fp32 (T, H, D), 1 <= D <= 256; ``max_seqlen`` must be at least the longest sequence (it sizes the
  grid: programs (sequence, tile of ``BLOCK_S`` tokens, head), those past their sequence's end return at once).
  Built from the building blocks of ``kernels/quantize.py`` and bit-exact with the PyTorch twins
  ``varlen_{q,k,v}_operand_torch``, which apply ``formats.row_scaled_from_float`` to each sequence alone.  So every
  sequence's operands equal the dense producers' on that sequence by itself (``VarlenFP8.sequence(b)``).

Backward operands (DESIGN §1 table), made by the same producers, so the same rule holds (payload unpadded, only
exponents laid out per sequence): ``varlen_bwd_operands`` gives q and k along the head dim in the K layout (q
grouped per 128 rows from each sequence's start, the backward's fast Q layout), v along the head dim in the K layout,
q and k along the sequence in the V layout; ``varlen_dout_operands`` dO both ways.  PyTorch twins
``varlen_bwd_operands_torch``, ``varlen_dout_operands_torch``.

The backward's seq operands (q_seq, k_seq, dout_seq) use ``align=BWD_SEQ_ALIGN`` (64) instead of 16: the Gluon
backward reads them in 64-column TMA boxes, which must never reach another sequence's columns.

Not here yet: MXTensor inputs (a jagged V blocked along each sequence needs a per-sequence scale layout that
``MXTensor``'s plain layout cannot express).

The attention kernels: ``attn_fwd.attn_fwd_hopper_varlen`` and ``attn_bwd.attn_bwd_hopper_varlen`` (the dense
kernels with ``VARLEN=True``).  Speed helpers: ``bench_varlen``, ``bench_varlen_bwd`` (GPU).
"""

from __future__ import annotations

import collections
import random
import weakref
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from mxattn.formats import RowScaledFP8, ScaleMode, quantize_mxfp8, row_scaled_from_float
from mxattn.kernels.launch import cdiv, fast_launcher
from mxattn.kernels.quantize import (
    _NO_EXP,
    _NO_EXP_HOST,
    _check_float_input,
    _d_pad,
    _hdim_rows,
    _load_rows,
    _mx_exponent,
    _needs_i64,
    _pid_bsh,
    _pow2,
    _reexpress,
    _round_to_e4m3_grid,
    _row_set_coords,
    _seq_bytes,
    _seq_chunk,
    _soft,
    _tile,
    _tile_coords,
    _to_f32,
    row_scaled_triton,
)

__all__ = [
    "K_GROUP",
    "V_ALIGN",
    "BWD_SEQ_ALIGN",
    "VarlenFP8",
    "cu_blocks",
    "varlen_q_operand",
    "varlen_k_operand",
    "varlen_v_operand",
    "varlen_operands",
    "varlen_bwd_operands",
    "varlen_dout_operands",
    "varlen_q_operand_torch",
    "varlen_k_operand_torch",
    "varlen_v_operand_torch",
    "varlen_bwd_operands_torch",
    "varlen_dout_operands_torch",
    "seq_mx_dequantized",
    "jagged_lengths",
    "bench_varlen",
    "bench_varlen_bwd",
]

K_GROUP = 128  # keys per K exponent, counted from each sequence's start (attn_fwd.K_EXP_GROUP)
V_ALIGN = 16  # V columns of each sequence start at a multiple of this (module docstring)
# the backward's seq operands (q_seq, k_seq, dout_seq): sequence starts at multiples of 64 columns, zeros up to there,
# so that a 64-column TMA box of the Gluon backward (attn_bwd_dq_gluon / attn_bwd_dkdv_gluon, jagged mode) never
# reads another sequence's columns (dS = 0 there, but 0 x Inf = NaN); the tl kernels read them as well
BWD_SEQ_ALIGN = 64


@dataclass
class VarlenFP8:
    """One operand of a jagged batch in the Hopper format (layouts: module docstring).

    ``role`` "q", "k" or "v"; ``data`` e4m3 ((T, H, D), or channel-major (H, D, Tv) for v); ``exp`` int32;
    ``cu_seqlens`` the sequences' token offsets in the packed input; ``cu_data`` where sequence b starts along the
    data's token axis; ``cu_exp`` where its exponents start along ``exp``'s first dim (None for v: row b);
    ``max_seqlen`` at least the longest sequence."""

    role: str
    data: torch.Tensor
    exp: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_data: torch.Tensor
    cu_exp: Optional[torch.Tensor]
    max_seqlen: int
    v_blocks: bool = False  # v only: one (H, D, round16(len)) block per sequence at element cu_data[b] * H * D
    align: int = V_ALIGN  # v only: sequence starts (cu_data) are multiples of this, columns up to there are zero

    @property
    def batch(self) -> int:
        return self.cu_seqlens.numel() - 1

    def sequence(self, b: int) -> RowScaledFP8:
        """Sequence ``b`` as a dense ``RowScaledFP8`` of batch 1, in the dense producers' layout (views, no copy
        except the exponent reshape): q exp (1, S, H, 1); k exp (1, ceil(S/128), H, 1); v data the (1, S, H, D)
        view of its channel-major columns, exp (1, 1, H, D)."""
        cu = self.cu_seqlens.tolist()
        t0, t1 = cu[b], cu[b + 1]
        S = t1 - t0
        if self.role == "v":
            c0 = int(self.cu_data[b])
            if self.v_blocks:
                H, D = self.exp.shape[1:]
                s_pad = int(self.cu_data[b + 1]) - c0
                block = self.data[c0 * H * D : (c0 + s_pad) * H * D].view(H, D, s_pad)
                data = block[:, :, :S].permute(2, 0, 1).unsqueeze(0)
            else:
                data = self.data[:, :, c0 : c0 + S].permute(2, 0, 1).unsqueeze(0)
            return RowScaledFP8(data, self.exp[b].unsqueeze(0).unsqueeze(0), 1)
        data = self.data[t0:t1].unsqueeze(0)
        if self.role == "q":
            return RowScaledFP8(data, self.exp[t0:t1].unsqueeze(0), 3)
        g0 = int(self.cu_exp[b])
        n = cdiv(S, K_GROUP)
        return RowScaledFP8(data, self.exp[g0 : g0 + n].unsqueeze(0), 3, group_dim=1, group=K_GROUP)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The packed (T, H, D) values ``data * 2^exp`` (per sequence)."""
        T = int(self.cu_seqlens[-1])
        H, D = self.exp.shape[1:] if self.role == "v" else self.data.shape[1:]
        out = torch.zeros(T, H, D, dtype=dtype, device=self.data.device)
        cu = self.cu_seqlens.tolist()
        for b in range(self.batch):
            if cu[b + 1] > cu[b]:
                out[cu[b] : cu[b + 1]] = self.sequence(b).dequantize(dtype)[0]
        return out


# ----------------------------------------------------------------------------------------------
# Layout helpers (device ops only: no host sync)
# ----------------------------------------------------------------------------------------------


# cu_blocks results of the last _MAX_OFFSETS (tensor, block, scale) by identity and version counter: key -> (weak
# reference, offsets).  A jagged training step builds the same K group and V column offsets in its forward and again
# in its backward, from the cu_seqlens tensor the jagged API hands every layer (its cache keeps one device copy per
# cu_seqlens tensor: interface._cu_host_and_device); each build was five or six ATen kernels, ~40 small launches a
# step, now made once per tensor.  A write through torch bumps the version (a new key); the offsets are shared by
# their users, who only read them.
_OFFSETS: collections.OrderedDict = collections.OrderedDict()
_MAX_OFFSETS = 16


def cu_blocks(cu_seqlens: torch.Tensor, block: int, scale: int = 1) -> torch.Tensor:
    """``scale`` times the exclusive prefix sum of ceil(len_b / block): (B + 1) int32 on cu_seqlens' device, kept for
    this tensor (``_OFFSETS``; inference tensors, without a version counter, are computed every call).

    ``cu_blocks(cu_k, 128)`` is K's group offsets; ``cu_blocks(cu_k, V_ALIGN, V_ALIGN)`` V's column offsets."""
    try:
        key = (id(cu_seqlens), cu_seqlens._version, block, scale)
    except RuntimeError:  # an inference-mode tensor
        key = None
    hit = _OFFSETS.get(key) if key is not None else None
    if hit is not None and hit[0]() is cu_seqlens:
        _OFFSETS.move_to_end(key)
        return hit[1]
    n = (cu_seqlens[1:] - cu_seqlens[:-1] + (block - 1)) // block
    out = torch.zeros_like(cu_seqlens)
    torch.cumsum(n, 0, dtype=torch.int32, out=out[1:])
    if scale != 1:
        out.mul_(scale)
    if key is not None:
        _OFFSETS[key] = (weakref.ref(cu_seqlens), out)
        _OFFSETS.move_to_end(key)
        while len(_OFFSETS) > _MAX_OFFSETS:
            _OFFSETS.popitem(last=False)
    return out


def _k_groups_bound(T: int, B: int) -> int:
    return max(1, (T + (K_GROUP - 1) * B) // K_GROUP)


def _v_columns_bound(T: int, B: int, align: int = V_ALIGN) -> int:
    return max(align, cdiv(T + (align - 1) * B, align) * align)


def _packed_input(x: torch.Tensor, name: str) -> torch.Tensor:
    """(1, T, H, D) view of a packed float input (D made unit-stride), after the producers' checks."""
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise ValueError(f"{name} must be a packed (T, H, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    x4, _ = _check_float_input(x, name, 0)
    return x4


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _k_varlen_kernel(
    x_ptr, sxs, sxh,  # packed (T, H, D) input, unit stride along D
    cu_ptr, cug_ptr,  # token offsets; group offsets (exclusive prefix sum of ceil(len / GROUP))
    out_ptr, exp_ptr,  # data (T, H, D) u8 contiguous; exponents (G, H) i32
    H, n_tiles,
    D: tl.constexpr, NDP: tl.constexpr, GROUP: tl.constexpr,
    RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
):
    """One exponent group (GROUP keys of one sequence from its start, one head): exponent = the largest block
    exponent of its nonzero blocks, data re-expressed to it.  The tile is read as one (GROUP/32, 32, NDP, 32)
    block: hdim blocks are reductions over axis 3."""
    b, j, h = _pid_bsh(n_tiles, H)
    t0 = tl.load(cu_ptr + b)
    S = tl.load(cu_ptr + b + 1) - t0
    s0 = j * GROUP
    if s0 >= S:
        return
    h64 = h.to(tl.int64)
    sl, d = _tile_coords(0, GROUP, NDP, IDX64)
    m = (s0 + sl < S) & (d < D)
    row = (t0 + s0).to(tl.int64)
    xr = tl.load(x_ptr + row * sxs + h64 * sxh + sl * sxs + d, mask=m, other=0.0)
    xf = _to_f32(xr)
    mag = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = tl.max(mag) >= 0x7F800000
    q, e, fin, nz_e = _hdim_rows(xf, mag, RCEIL, SOFT)
    E = tl.max(nz_e)
    E = tl.where(E == _NO_EXP, 0, E)
    tl.store(exp_ptr + (tl.load(cug_ptr + b).to(tl.int64) + j) * H + h64, E)
    tl.store(out_ptr + (row * H + h64) * D + sl * (H * D) + d, _reexpress(q, e, E, fin, bad, SOFT), mask=m)


@triton.jit
def _v_exp_varlen_kernel(
    x_ptr, sxs, sxh,  # packed (T, H, D) input, unit stride along D
    cu_ptr,  # token offsets
    exp_ptr,  # int32 (B, H, D), pre-filled with _NO_EXP; receives the max exponent of nonzero blocks
    H, n_chunks, tiles_per_prog,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, RCEIL: tl.constexpr, IDX64: tl.constexpr,
):
    """V pass 1: per channel, the largest exponent among the sequence's seq blocks (32 keys from the sequence's
    start) that hold a nonzero element.  A program covers ``tiles_per_prog`` tiles of one sequence and head."""
    b, ch, h = _pid_bsh(n_chunks, H)
    t0 = tl.load(cu_ptr + b)
    S = tl.load(cu_ptr + b + 1) - t0
    first = ch * tiles_per_prog
    if first * BLOCK_S >= S:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    sl, d = _tile_coords(0, BLOCK_S, NDP, IDX64)
    in_d = d < D
    acc = tl.full((1, 1, NDP, 32), _NO_EXP, tl.int32)
    last = tl.minimum(first + tiles_per_prog, tl.cdiv(S, BLOCK_S))
    for t in range(first, last):
        s0 = t * BLOCK_S
        xp = x_ptr + (t0 + s0).to(tl.int64) * sxs + h64 * sxh
        xf = _to_f32(tl.load(xp + sl * sxs + d, mask=(s0 + sl < S) & in_d, other=0.0))
        amax = tl.max(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1, keep_dims=True)
        e = _mx_exponent(amax, RCEIL)
        nz = (amax < 0x7F800000) & (_round_to_e4m3_grid(amax.to(tl.float32, bitcast=True) * _pow2(-e)) != 0.0)
        acc = tl.maximum(acc, tl.max(tl.where(nz, e, _NO_EXP), axis=0, keep_dims=True))
    tl.atomic_max(exp_ptr + (b64 * H + h64) * D + d, acc, mask=in_d, sem="relaxed")


@triton.jit
def _v_data_varlen_kernel(
    x_ptr, sxs, sxh,  # packed (T, H, D) input, unit stride along D
    cu_ptr, cuv_ptr,  # token offsets; 16-aligned column offsets
    exp_ptr,  # int32 (B, H, D) from pass 1; the "none" sentinel is rewritten as 0
    cw_ptr,  # channel-major (H, D, Tv) buffer as int32 words
    H, Tv, n_s_tiles,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    V_BLOCKS: tl.constexpr = False,  # one (H, D, S_pad) block per sequence instead of (H, D, Tv) rows
    ALIGN: tl.constexpr = 16,  # sequence starts are multiples of ALIGN columns (16, or BWD_SEQ_ALIGN = 64)
):
    """V pass 2: BLOCK_S keys of one sequence and head, blocked along the sequence from its start, re-expressed to
    the per-channel exponents and stored channel-major, zeros up to the sequence's ALIGN-aligned end.

    As in ``quantize._quantize_kernel``: four row sets (rows s0 + 4w + k), so that a thread holds 4 consecutive
    keys of a channel and stores them as one int32 word (sequences start at multiples of 16 columns, so words stay
    aligned)."""
    b, st, h = _pid_bsh(n_s_tiles, H)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    w, d = _row_set_coords(BLOCK_S, NDP, IDX64)
    in_d = d < D
    ep = exp_ptr + (b64 * H + h64) * D + d
    E = tl.load(ep, mask=in_d, other=0)
    E = tl.where(E == _NO_EXP, 0, E)
    if st == 0:
        tl.store(ep, E, mask=in_d)  # also for empty sequences (readers map the sentinel and 0 the same way)
    t0 = tl.load(cu_ptr + b)
    S = tl.load(cu_ptr + b + 1) - t0
    S_pad = (S + ALIGN - 1) // ALIGN * ALIGN
    s0 = st * BLOCK_S
    if s0 >= S_pad:
        return
    q4 = w * 4
    xp = x_ptr + (t0 + s0).to(tl.int64) * sxs + h64 * sxh
    x0r, x0, m0 = _load_rows(xp, sxs, q4, 0, s0, S, d, in_d)
    x1r, x1, m1 = _load_rows(xp, sxs, q4, 1, s0, S, d, in_d)
    x2r, x2, m2 = _load_rows(xp, sxs, q4, 2, s0, S, d, in_d)
    x3r, x3, m3 = _load_rows(xp, sxs, q4, 3, s0, S, d, in_d)
    mall = tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))
    amax = tl.max(mall, axis=1, keep_dims=True)  # one per 32 keys and channel
    fin = amax < 0x7F800000
    e = _mx_exponent(amax, RCEIL)
    wd = _seq_bytes(x0r, x0, m0, e, E, fin, s0 + q4 >= S, True, SOFT)
    wd |= _seq_bytes(x1r, x1, m1, e, E, fin, s0 + q4 + 1 >= S, True, SOFT) << 8
    wd |= _seq_bytes(x2r, x2, m2, e, E, fin, s0 + q4 + 2 >= S, True, SOFT) << 16
    wd |= _seq_bytes(x3r, x3, m3, e, E, fin, s0 + q4 + 3 >= S, True, SOFT) << 24
    c0 = tl.multiple_of(tl.load(cuv_ptr + b), 16)
    if V_BLOCKS:
        row_w = S_pad // 4  # int32 words per channel row of this sequence's block
        cbase = cw_ptr + (c0.to(tl.int64) * H * D) // 4 + h64 * D * row_w + s0 // 4
    else:
        row_w = Tv // 4  # int32 words per channel row (Tv is a multiple of 16: 16-byte aligned rows)
        cbase = cw_ptr + h64 * D * row_w + ((c0 + s0) // 4).to(tl.int64)
    tl.store(cbase + d * row_w + w, wd, mask=(s0 // 4 + w < S_pad // 4) & in_d)


# ----------------------------------------------------------------------------------------------
# Producers
# ----------------------------------------------------------------------------------------------


def varlen_q_operand(q: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                     scale_mode: Union[str, ScaleMode] = "rceil") -> VarlenFP8:
    """Q of a jagged batch (layout: module docstring): the dense producer on the packed tensor, one pass."""
    x4 = _packed_input(q, "q")
    rs = row_scaled_triton(x4[0], "q", scale_mode=scale_mode, seq_dim=0)
    return VarlenFP8("q", rs.data, rs.exp, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q, max_seqlen_q)


def _offsets_of(like: Optional["VarlenFP8"], role: str, cu_seqlens: torch.Tensor, T: int, align: int = V_ALIGN):
    """``like``'s offsets for an operand of ``role`` over the same sequences (the ``offsets_of`` argument of the
    producers), or None without ``like``.  Its offsets are the ones this producer would compute from ``cu_seqlens``
    (the same tensor, by identity) whenever ``like`` came from a producer; reusing them saves the few small launches
    of ``cu_blocks``."""
    if like is None:
        return None
    if not isinstance(like, VarlenFP8) or like.role != role or like.cu_seqlens is not cu_seqlens or like.v_blocks \
            or (role == "k" and (like.cu_exp is None or like.data.shape[0] != T)) or (role == "v" and like.align != align):
        raise ValueError(f"offsets_of must be a role {role!r} VarlenFP8 over the same cu_seqlens tensor and {T} "
                         f"tokens (align {align}, not v_blocks), got {getattr(like, 'role', type(like).__name__)!r}")
    return like


def varlen_k_operand(k: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int,
                     scale_mode: Union[str, ScaleMode] = "rceil",
                     offsets_of: Optional["VarlenFP8"] = None) -> VarlenFP8:
    """K of a jagged batch (layout: module docstring): one pass, one program per (sequence, 128 keys, head).
    ``offsets_of``: a K-layout operand over the same ``cu_seqlens_k`` tensor and token count (the backward's q, for
    dO) whose group offsets and exponent rows this one takes instead of computing them (same values, fewer
    launches)."""
    rceil = ScaleMode.parse(scale_mode) is ScaleMode.RCEIL
    x4 = _packed_input(k, "k")
    _, T, H, D = x4.shape
    B = cu_seqlens_k.numel() - 1
    dev = x4.device
    like = _offsets_of(offsets_of, "k", cu_seqlens_k, T)
    cu_g = cu_blocks(cu_seqlens_k, K_GROUP) if like is None else like.cu_exp
    data = torch.empty(T, H, D, dtype=torch.uint8, device=dev)
    exp = torch.zeros(_k_groups_bound(T, B) if like is None else like.exp.shape[0], H, 1, dtype=torch.int32,
                      device=dev)
    n_tiles = cdiv(max_seqlen_k, K_GROUP)
    if B * n_tiles * H * T > 0:
        dp = _d_pad(D)
        tile = _tile("k", dp, K_GROUP)
        sxs, sxh = x4.stride(1), x4.stride(2)
        idx64 = _needs_i64(K_GROUP * sxs, dp) or _needs_i64(K_GROUP * H * D, dp)
        fast_launcher(_k_varlen_kernel)[(B * n_tiles * H,)](
            x4, sxs, sxh, cu_seqlens_k, cu_g, data, exp, H, n_tiles,
            D=D, NDP=dp // 32, GROUP=K_GROUP, RCEIL=rceil, SOFT=_soft(dev), IDX64=idx64,
            num_warps=tile.num_warps,
        )
    return VarlenFP8("k", data.view(torch.float8_e4m3fn), exp, cu_seqlens_k, cu_seqlens_k, cu_g, max_seqlen_k)


def varlen_v_operand(v: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int,
                     scale_mode: Union[str, ScaleMode] = "rceil", v_blocks: bool = False,
                     align: int = V_ALIGN, offsets_of: Optional["VarlenFP8"] = None) -> VarlenFP8:
    """V of a jagged batch (layout: module docstring): pass 1 the per-(sequence, head, channel) exponents, pass 2
    the channel-major data with 16-aligned sequence starts: (H, D, Tv) rows over the whole batch, or with
    ``v_blocks`` one (H, D, round16(len)) block per sequence starting at element 16-aligned-start * H * D (the
    forward's layout: a V tile's channel rows are then one sequence long, not the batch's Tv).
    ``align`` (a multiple of 16; rows only): sequence starts at multiples of it, zeros to there
    (``BWD_SEQ_ALIGN`` for the backward's seq operands).
    ``offsets_of`` (rows only): a V-layout operand over the same ``cu_seqlens_k`` tensor with this ``align`` (the
    backward's q_seq, for dO) whose column offsets and width Tv this one takes (same values, fewer launches)."""
    if align % V_ALIGN or align < V_ALIGN or (v_blocks and align != V_ALIGN):
        raise ValueError(f"align must be a multiple of {V_ALIGN} ({V_ALIGN} with v_blocks), got {align}")
    rceil = ScaleMode.parse(scale_mode) is ScaleMode.RCEIL
    x4 = _packed_input(v, "v")
    _, T, H, D = x4.shape
    B = cu_seqlens_k.numel() - 1
    dev = x4.device
    if v_blocks and offsets_of is not None:
        raise ValueError("offsets_of is for the (H, D, Tv) rows layout, not v_blocks")
    like = _offsets_of(offsets_of, "v", cu_seqlens_k, T, align)
    cu_v = cu_blocks(cu_seqlens_k, align, align) if like is None else like.cu_data
    Tv = _v_columns_bound(T, B, align) if like is None else like.data.shape[2]
    buf = torch.empty(H * D * Tv if v_blocks else (H, D, Tv), dtype=torch.uint8, device=dev)
    exp = torch.full((B, H, D), _NO_EXP_HOST, dtype=torch.int32, device=dev)
    if B * H > 0:
        dp = _d_pad(D)
        sxs, sxh = x4.stride(1), x4.stride(2)
        t1 = _tile("seqexp", dp)
        n_s1 = cdiv(max_seqlen_k, t1.block_s)
        if n_s1 > 0:
            per = _seq_chunk(B * H, max_seqlen_k, t1.block_s)
            n_chunks = cdiv(n_s1, per)
            fast_launcher(_v_exp_varlen_kernel)[(B * n_chunks * H,)](
                x4, sxs, sxh, cu_seqlens_k, exp, H, n_chunks, per,
                D=D, NDP=dp // 32, BLOCK_S=t1.block_s, RCEIL=rceil,
                IDX64=_needs_i64(t1.block_s * sxs, dp), num_warps=t1.num_warps,
            )
        t2 = _tile("quant", dp)
        n_s2 = max(1, cdiv(cdiv(max_seqlen_k, align) * align, t2.block_s))
        idx64 = _needs_i64(t2.block_s * sxs, dp) or _needs_i64(dp * Tv, t2.block_s)
        fast_launcher(_v_data_varlen_kernel)[(B * n_s2 * H,)](
            x4, sxs, sxh, cu_seqlens_k, cu_v, exp, buf.view(torch.int32), H, Tv, n_s2,
            D=D, NDP=dp // 32, BLOCK_S=t2.block_s, RCEIL=rceil, SOFT=_soft(dev), IDX64=idx64,
            V_BLOCKS=v_blocks, ALIGN=align, num_warps=t2.num_warps,
        )
    return VarlenFP8("v", buf.view(torch.float8_e4m3fn), exp, cu_seqlens_k, cu_v, None, max_seqlen_k, v_blocks,
                     align)


def varlen_operands(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    scale_mode: Union[str, ScaleMode] = "rceil") -> tuple[VarlenFP8, VarlenFP8, VarlenFP8]:
    """The forward's three operands of a jagged batch from packed float q, k, v (four launches in all); V in
    per-sequence blocks."""
    return (
        varlen_q_operand(q, cu_seqlens_q, max_seqlen_q, scale_mode),
        varlen_k_operand(k, cu_seqlens_k, max_seqlen_k, scale_mode),
        varlen_v_operand(v, cu_seqlens_k, max_seqlen_k, scale_mode, v_blocks=True),
    )


def varlen_bwd_operands(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                        scale_mode: Union[str, ScaleMode] = "rceil") -> tuple[VarlenFP8, ...]:
    """The backward's five operands of a jagged batch (``attn_bwd.attn_bwd_hopper_varlen``; DESIGN §1 table) from
    packed float q, k, v, with the existing producers (seven launches):
      q      along the head dim in the K layout over cu_seqlens_q (one exponent per 128 rows from each sequence's
             start: the backward's fast Q layout, a query tile's scale is one number);
      k      along the head dim, K layout (the forward's K operand);
      v_hdim V along the head dim, K layout (for dP = dO Vᵀ);
      q_seq  Q along the sequence, V layout over cu_seqlens_q (for dK = dSᵀ Q);
      k_seq  K along the sequence, V layout (for dQ = dS K).
    Payload unpadded at the packed offsets (hdim) or ``BWD_SEQ_ALIGN``-aligned columns with zero tails (seq: what
    the Gluon backward's 64-column boxes need; the tl kernels read 16-column steps of it); only exponents are laid
    out per sequence.  dO's two operands are made by the backward (``varlen_dout_operands``)."""
    return (
        varlen_k_operand(q, cu_seqlens_q, max_seqlen_q, scale_mode),
        varlen_k_operand(k, cu_seqlens_k, max_seqlen_k, scale_mode),
        varlen_k_operand(v, cu_seqlens_k, max_seqlen_k, scale_mode),
        varlen_v_operand(q, cu_seqlens_q, max_seqlen_q, scale_mode, align=BWD_SEQ_ALIGN),
        varlen_v_operand(k, cu_seqlens_k, max_seqlen_k, scale_mode, align=BWD_SEQ_ALIGN),
    )


def varlen_dout_operands(dout, cu_seqlens_q, max_seqlen_q: int) -> tuple[VarlenFP8, VarlenFP8]:
    """dO of a jagged batch in both orientations (RCEIL, as the dense backward): along the head dim in the K layout
    (for dP = dO Vᵀ and delta) and along the sequence in the V layout with ``BWD_SEQ_ALIGN`` (for dV = Pᵀ dO)."""
    return (varlen_k_operand(dout, cu_seqlens_q, max_seqlen_q),
            varlen_v_operand(dout, cu_seqlens_q, max_seqlen_q, align=BWD_SEQ_ALIGN))


# ----------------------------------------------------------------------------------------------
# PyTorch twins (the semantics: each sequence on its own through formats.row_scaled_from_float)
# ----------------------------------------------------------------------------------------------


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def varlen_q_operand_torch(q, cu_seqlens_q, max_seqlen_q: int, scale_mode="rceil") -> VarlenFP8:
    """PyTorch twin of ``varlen_q_operand``."""
    rs = row_scaled_from_float(q, dim=-1, scale_mode=scale_mode)
    return VarlenFP8("q", rs.data, rs.exp, cu_seqlens_q, cu_seqlens_q, cu_seqlens_q, max_seqlen_q)


def varlen_k_operand_torch(k, cu_seqlens_k, max_seqlen_k: int, scale_mode="rceil") -> VarlenFP8:
    """PyTorch twin of ``varlen_k_operand``: groups of 128 keys from each sequence's start."""
    T, H, D = k.shape
    B = cu_seqlens_k.numel() - 1
    cu_g = cu_blocks(cu_seqlens_k, K_GROUP)
    data = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=k.device)
    exp = torch.zeros(_k_groups_bound(T, B), H, 1, dtype=torch.int32, device=k.device)
    for (t0, t1), g0 in zip(_bounds(cu_seqlens_k), cu_g.tolist()):
        if t1 > t0:
            rs = row_scaled_from_float(k[t0:t1], dim=-1, group_dim=0, group=K_GROUP, scale_mode=scale_mode)
            data[t0:t1] = rs.data
            exp[g0 : g0 + rs.exp.shape[0]] = rs.exp
    return VarlenFP8("k", data, exp, cu_seqlens_k, cu_seqlens_k, cu_g, max_seqlen_k)


def varlen_v_operand_torch(v, cu_seqlens_k, max_seqlen_k: int, scale_mode="rceil", v_blocks: bool = False,
                           align: int = V_ALIGN) -> VarlenFP8:
    """PyTorch twin of ``varlen_v_operand``: blocks along each sequence from its start, one exponent per channel
    and sequence; unused columns (past the last sequence) are zero here."""
    T, H, D = v.shape
    B = cu_seqlens_k.numel() - 1
    cu_v = cu_blocks(cu_seqlens_k, align, align)
    Tv = _v_columns_bound(T, B, align)
    buf = torch.zeros(H * D * Tv if v_blocks else (H, D, Tv), dtype=torch.float8_e4m3fn, device=v.device)
    exp = torch.zeros(B, H, D, dtype=torch.int32, device=v.device)
    cv = cu_v.tolist()
    for b, (t0, t1) in enumerate(_bounds(cu_seqlens_k)):
        if t1 > t0:
            rs = row_scaled_from_float(v[t0:t1], dim=0, scale_mode=scale_mode)
            c0 = cv[b]
            if v_blocks:
                s_pad = cv[b + 1] - c0
                buf[c0 * H * D : (c0 + s_pad) * H * D].view(H, D, s_pad)[:, :, : t1 - t0] = rs.data.permute(1, 2, 0)
            else:
                buf[:, :, c0 : c0 + t1 - t0] = rs.data.permute(1, 2, 0)
            exp[b] = rs.exp[0]
    return VarlenFP8("v", buf, exp, cu_seqlens_k, cu_v, None, max_seqlen_k, v_blocks, align)


def varlen_bwd_operands_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                              scale_mode="rceil") -> tuple[VarlenFP8, ...]:
    """PyTorch twin of ``varlen_bwd_operands``."""
    return (
        varlen_k_operand_torch(q, cu_seqlens_q, max_seqlen_q, scale_mode),
        varlen_k_operand_torch(k, cu_seqlens_k, max_seqlen_k, scale_mode),
        varlen_k_operand_torch(v, cu_seqlens_k, max_seqlen_k, scale_mode),
        varlen_v_operand_torch(q, cu_seqlens_q, max_seqlen_q, scale_mode, align=BWD_SEQ_ALIGN),
        varlen_v_operand_torch(k, cu_seqlens_k, max_seqlen_k, scale_mode, align=BWD_SEQ_ALIGN),
    )


def varlen_dout_operands_torch(dout, cu_seqlens_q, max_seqlen_q: int) -> tuple[VarlenFP8, VarlenFP8]:
    """PyTorch twin of ``varlen_dout_operands``."""
    return (varlen_k_operand_torch(dout, cu_seqlens_q, max_seqlen_q),
            varlen_v_operand_torch(dout, cu_seqlens_q, max_seqlen_q, align=BWD_SEQ_ALIGN))


def seq_mx_dequantized(x: torch.Tensor, cu_seqlens: torch.Tensor, scale_mode="rceil",
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Packed (T, H, D) ``x`` MXFP8-quantized along the sequence, blocks starting at each sequence's first token
    (``formats.quantize_mxfp8`` on every sequence alone), dequantized to ``dtype``: the V (and backward Q/K seq)
    values that the jagged forward's reference sees."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for t0, t1 in _bounds(cu_seqlens):
        out[t0:t1] = quantize_mxfp8(x[t0:t1], dim=0, scale_mode=scale_mode).dequantize(dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Speed (GPU)
# ----------------------------------------------------------------------------------------------


def jagged_lengths(batch: int, mean: int, seed: int = 0) -> list[int]:
    """``batch`` lengths uniform in [1, 2 mean - 1] (mean ``mean``; a batch padded to its longest sequence is then
    about half real tokens)."""
    rng = random.Random(seed)
    return [rng.randint(1, max(1, 2 * mean - 1)) for _ in range(batch)]


def bench_varlen(batch: int = 16, mean_len: int = 2048, heads_q: int = 16, heads_kv: int = 16, head_dim: int = 128,
                 causal: bool = False, seed: int = 0, lengths: Optional[list[int]] = None,
                 with_sdpa: bool = True, config=None) -> dict:
    """Time the jagged forward on a ~50%-fill batch against the dense kernel (CUDA).

    Lengths uniform in [1, 2 mean_len - 1] (or ``lengths``).  Timed, kernel only (operands made once): the varlen
    kernel; the dense kernel on the batch padded to its longest sequence; the dense kernel on a dense batch of
    (batch, mean_len), i.e. about as many real tokens.  FLOPs are counted on real tokens only:
    sum_b 4 Hq len_b^2 D (half when causal).  Returns a row for ``benchmarks/results`` (what="varlen_fwd"):
    times in ms, TFLOP/s on real FLOPs, ``speedup_vs_padded`` (padded dense time / varlen time) and
    ``rate_vs_dense`` (varlen TFLOP/s / dense TFLOP/s at (batch, mean_len)).  Also the producers' time and, with
    ``with_sdpa``, SDPA cuDNN / flash BF16 on the batch padded to its longest sequence
    (``speedup_vs_sdpa_cudnn_padded``: SDPA time / varlen time).  ``config``: an ``attn_fwd.FwdConfig`` for both
    the jagged and the dense kernel (default: each its own, ``varlen_config`` and ``default_config``); the row
    names them.
    """
    from triton.testing import do_bench

    from mxattn.kernels.attn_fwd import attn_fwd_hopper, attn_fwd_hopper_varlen, default_config, varlen_config

    lens = list(lengths) if lengths is not None else jagged_lengths(batch, mean_len, seed)
    B, D = len(lens), head_dim
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
    q = torch.randn(T, heads_q, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, heads_kv, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, heads_kv, D, device=dev, dtype=torch.bfloat16, generator=g)
    smax = max(lens)
    ops = varlen_operands(q, k, v, cu, cu, smax, smax)
    t_prod = do_bench(lambda: varlen_operands(q, k, v, cu, cu, smax, smax))
    t_var = do_bench(lambda: attn_fwd_hopper_varlen(*ops, causal=causal, config=config))

    def dense_ms(S: int, v_row: Optional[int] = None) -> float:
        shape = lambda h: (B, S, h, D)
        qd = torch.randn(*shape(heads_q), device=dev, dtype=torch.bfloat16, generator=g)
        kd = torch.randn(*shape(heads_kv), device=dev, dtype=torch.bfloat16, generator=g)
        vd = torch.randn(*shape(heads_kv), device=dev, dtype=torch.bfloat16, generator=g)
        vr = row_scaled_triton(vd, "v")
        if v_row is not None:  # the same V bytes, each channel row v_row columns long
            buf = torch.zeros(B, heads_kv, D, max(v_row, S), dtype=torch.uint8, device=dev)
            buf[..., :S] = vr.data.permute(0, 2, 3, 1).view(torch.uint8)
            vr = RowScaledFP8(buf[..., :S].permute(0, 3, 1, 2).view(torch.float8_e4m3fn), vr.exp, vr.dim)
        dops = (row_scaled_triton(qd, "q"), row_scaled_triton(kd, "k"), vr)
        return do_bench(lambda: attn_fwd_hopper(*dops, causal=causal, config=config))

    t_pad = dense_ms(smax)
    t_mean = dense_ms(mean_len)
    # diagnostic: the dense kernel at (batch, mean_len) with V's channel rows as far apart as the jagged V's (one
    # channel row spans every sequence of the batch, Tv columns, instead of one sequence's S): does the longer row
    # stride (DRAM pages, TLB reach of a V tile) cost the jagged kernel its missing few %?
    t_mean_vstride = dense_ms(mean_len, v_row=_v_columns_bound(T, B))  # the jagged V's rows: Tv columns long
    sdpa = {}
    if with_sdpa:  # SDPA BF16 on the same batch padded to its longest sequence (B, H, smax, D)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pad = lambda h: torch.randn(B, h, smax, D, device=dev, dtype=torch.bfloat16, generator=g)
        qp, kp, vp = pad(heads_q), pad(heads_kv), pad(heads_kv)
        for name, be in (("sdpa_cudnn_bf16_padded", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa_flash_bf16_padded", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    sdpa[name] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qp, kp, vp, is_causal=causal, enable_gqa=heads_q != heads_kv))
            except RuntimeError:  # a backend that refuses the shape is left out
                pass
    half = 0.5 if causal else 1.0
    real = sum(4.0 * heads_q * n * n * D for n in lens) * half
    dense_flops = 4.0 * B * heads_q * mean_len * mean_len * D * half
    tf = lambda flops, ms: flops / (ms * 1e-3) / 1e12
    cu_ms = sdpa.get("sdpa_cudnn_bf16_padded")
    return {
        "B": B, "Hq": heads_q, "Hkv": heads_kv, "D": D, "causal": causal, "mean_len": mean_len, "max_len": smax,
        "tokens": T, "fill": T / (B * smax), "seed": seed,
        "config": asdict(config) if config else {"varlen": asdict(varlen_config(D, causal)),
                                                  "dense": asdict(default_config(D, causal))},
        "ms": {"varlen": t_var, "dense_padded": t_pad, "dense_mean": t_mean, "dense_mean_v_row_tv": t_mean_vstride,
               "producers": t_prod, **sdpa},
        "tflops": {"varlen": tf(real, t_var), "dense_padded_real": tf(real, t_pad), "dense_mean": tf(dense_flops, t_mean),
                   **{k + "_real": tf(real, ms) for k, ms in sdpa.items()}},
        "speedup_vs_padded": t_pad / t_var,
        "speedup_vs_sdpa_cudnn_padded": (cu_ms / t_var) if cu_ms else None,
        "rate_vs_dense": tf(real, t_var) / tf(dense_flops, t_mean),
        "dense_rate_v_row_tv": t_mean / t_mean_vstride,  # < 1: the jagged V layout's long rows cost the dense kernel too
    }


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _host_ms(fn, n: int = 20) -> float:
    """Host time (ms) per call of ``fn``: ``n`` calls issued after a sync, clock read before the closing sync (few
    enough launches that the GPU's queue never makes the host wait).  Close to do_bench's time: host-bound."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def _varlen_bwd_parts(ops, out, do, lse, causal: bool, gluon: bool) -> dict:
    """Each piece of the jagged backward timed alone (do_bench, ms) on the dispatch's operands: ``preprocess`` (dO's
    two producers and the δ kernel as the tl path runs them), and with ``gluon`` ``gluon_preprocess`` (the same with
    δ and lse in the padded columns), ``tile_tables`` (both tables), ``gluon_dkdv`` and ``gluon_dq`` (each launcher
    on prepared operands: its tile table, exponent copies and kernel)."""
    from triton.testing import do_bench

    from mxattn.kernels.attn_bwd import _dout_offsets, attn_bwd_preprocess_varlen, gluon_split

    q, k, v_hdim, q_seq, k_seq = ops
    cu, ms, offs = q.cu_seqlens, q.max_seqlen, _dout_offsets(q, q_seq)
    parts = {"preprocess": do_bench(lambda: attn_bwd_preprocess_varlen(out, do, cu, ms, offsets_of=offs))}
    if not gluon:
        return parts
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, attn_bwd_dkdv_gluon_varlen
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon_varlen
    from mxattn.kernels.bwd_varlen_tiles import bwd_tile_slots

    pre = lambda: attn_bwd_preprocess_varlen(out, do, cu, ms, delta_padded=True, lse=lse,  # noqa: E731
                                             offsets_of=offs)
    parts["gluon_preprocess"] = do_bench(pre)
    doh, dos, delta, lse_pad = pre()
    split = gluon_split()
    kv_cfg, dq_cfg = (GluonDkdvConfig(split=True), GluonDqConfig(split=True)) if split else (None, None)

    def tables():
        bwd_tile_slots(cu, k.cu_seqlens, q.cu_exp, k.cu_exp, q_seq.cu_data, doh.cu_exp, dos.cu_data, k.max_seqlen,
                       key_tiles=True, causal=causal)
        bwd_tile_slots(cu, k.cu_seqlens, q.cu_exp, k.cu_exp, k_seq.cu_data, doh.cu_exp, dos.cu_data, ms,
                       key_tiles=False, causal=causal)

    parts["tile_tables"] = do_bench(tables)
    parts["gluon_dkdv"] = do_bench(lambda: attn_bwd_dkdv_gluon_varlen(q, k, v_hdim, q_seq, doh, dos, lse_pad, delta,
                                                                      causal=causal, config=kv_cfg))
    parts["gluon_dq"] = do_bench(lambda: attn_bwd_dq_gluon_varlen(q, k, v_hdim, k_seq, doh, lse, delta, dos.cu_data,
                                                                  causal=causal, config=dq_cfg))
    return parts


def bench_varlen_bwd(batch: int = 16, mean_len: int = 2048, heads_q: int = 16, heads_kv: int = 16, head_dim: int = 128,
                     causal: bool = False, seed: int = 0, lengths: Optional[list[int]] = None,
                     deterministic: bool = False, with_sdpa: bool = True) -> dict:
    """Time the jagged backward on a ~50%-fill batch (CUDA; RuntimeError without it).

    Lengths uniform in [1, 2 mean_len - 1] (or ``lengths``).  Timed, kernels on prepared operands (q/k/v backward
    operands made once, as ``attn_bwd.bench_attn_bwd``; dO quantization and delta included): the varlen backward
    (``attn_bwd_hopper_varlen``); the dense backward (``attn_bwd_hopper``) on the batch padded to its longest
    sequence and on a dense batch of (batch, mean_len) (about as many real tokens); SDPA BF16 backward (cuDNN and
    flash) on the batch padded to its longest sequence, unmasked (the work a padded training step does; padding
    FLOPs wasted); and the operand producers (``varlen_bwd_operands``).  FLOPs are counted on
    real tokens only: 2.5 * sum_b 4 Hq len_b^2 D (half when causal).  Returns a row for ``benchmarks/results``
    (what="varlen_bwd"): times in ms, TFLOP/s on real FLOPs, ``speedup_vs_padded`` (dense padded / varlen),
    ``speedup_vs_sdpa_cudnn_padded`` and ``rate_vs_dense`` (varlen TFLOP/s / dense TFLOP/s at (batch, mean_len)).
    The jagged backward is timed as dispatched (``attn_bwd.varlen_backward_kernel``: on Hopper the Gluon jagged kernels by
    default, the ``tl`` kernels with ``MXATTN_VARLEN_BWD_KERNEL=tl``; named in ``varlen_kernel``) and once more on
    the ``tl`` kernels (``ms["varlen_tl"]``,
    ``rate_vs_dense_tl``), both against the dense default backward (the Gluon kernels on Hopper).
    ``parts_ms`` (``_varlen_bwd_parts``): the pieces of the jagged backward timed alone on the same operands (dO
    producers and δ, tile tables, each Gluon kernel's launcher), so that a slow row says where its time goes.
    ``host_ms`` (``_host_ms``): host time per call of each timed backward; where it is close to the row's ``ms``
    the row measures the host (small batches), not the kernels.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_varlen_bwd needs a CUDA GPU")
    from triton.testing import do_bench

    import os

    from mxattn.kernels.attn_bwd import (
        Q_EXP_GROUP,
        _time_sdpa_bwd,
        attn_bwd_hopper,
        attn_bwd_hopper_varlen,
        varlen_backward_kernel,
    )
    from mxattn.kernels.attn_fwd import attn_fwd_hopper, attn_fwd_hopper_varlen

    lens = list(lengths) if lengths is not None else jagged_lengths(batch, mean_len, seed)
    B, D = len(lens), head_dim
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)
    smax = max(lens)
    cu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(T, heads_q, D), mk(T, heads_kv, D), mk(T, heads_kv, D), mk(T, heads_q, D)
    out, lse = attn_fwd_hopper_varlen(*varlen_operands(q, k, v, cu, cu, smax, smax), causal=causal)
    ops = varlen_bwd_operands(q, k, v, cu, cu, smax, smax)
    t_prod = do_bench(lambda: varlen_bwd_operands(q, k, v, cu, cu, smax, smax))
    run_var = lambda: attn_bwd_hopper_varlen(*ops, out, do, lse, causal=causal, deterministic=deterministic)  # noqa: E731
    kernel = varlen_backward_kernel(torch.device(dev))
    t_var = do_bench(run_var)
    host = {"varlen": _host_ms(run_var)}
    parts = _varlen_bwd_parts(ops, out, do, lse, causal, gluon=kernel == "gluon")
    saved = os.environ.get("MXATTN_VARLEN_BWD_KERNEL")
    os.environ["MXATTN_VARLEN_BWD_KERNEL"] = "tl"
    try:
        t_var_tl = do_bench(run_var)
        host["varlen_tl"] = _host_ms(run_var)
    finally:
        if saved is None:
            os.environ.pop("MXATTN_VARLEN_BWD_KERNEL")
        else:
            os.environ["MXATTN_VARLEN_BWD_KERNEL"] = saved

    def dense(S: int, name: str):
        qd, kd, vd, dod = mk(B, S, heads_q, D), mk(B, S, heads_kv, D), mk(B, S, heads_kv, D), mk(B, S, heads_q, D)
        od, ld = attn_fwd_hopper(row_scaled_triton(qd, "q"), row_scaled_triton(kd, "k"), row_scaled_triton(vd, "v"),
                                 causal=causal)
        bops = (row_scaled_triton(qd, "k", k_group=Q_EXP_GROUP), row_scaled_triton(kd, "k"),
                row_scaled_triton(vd, "k"), row_scaled_triton(qd, "v"), row_scaled_triton(kd, "v"))
        run = lambda: attn_bwd_hopper(*bops, od, dod, ld, causal=causal, deterministic=deterministic)  # noqa: E731
        ms = do_bench(run)
        host[name] = _host_ms(run)
        return ms, (qd, kd, vd, dod)

    t_pad, padded = dense(smax, "dense_padded")
    t_mean, _ = dense(mean_len, "dense_mean")
    sdpa = {}
    if with_sdpa:
        for name, be in (("sdpa_cudnn_bf16_padded", "CUDNN_ATTENTION"), ("sdpa_flash_bf16_padded", "FLASH_ATTENTION")):
            sdpa[name] = _time_sdpa_bwd(padded[0], padded[1], padded[2], padded[3], causal, be, 100)
    half = 0.5 if causal else 1.0
    real = 2.5 * sum(4.0 * heads_q * n * n * D for n in lens) * half
    dense_flops = 2.5 * 4.0 * B * heads_q * mean_len * mean_len * D * half
    tf = lambda flops, ms: None if ms is None else flops / (ms * 1e-3) / 1e12
    cu_ms = sdpa.get("sdpa_cudnn_bf16_padded")
    return {
        "B": B, "Hq": heads_q, "Hkv": heads_kv, "D": D, "causal": causal, "deterministic": deterministic,
        "mean_len": mean_len, "max_len": smax, "tokens": T, "fill": T / (B * smax), "varlen_kernel": kernel,
        "ms": {"varlen": t_var, "varlen_tl": t_var_tl, "dense_padded": t_pad, "dense_mean": t_mean,
               "producers": t_prod, **sdpa},
        "parts_ms": parts, "host_ms": host,
        "tflops": {"varlen": tf(real, t_var), "varlen_tl": tf(real, t_var_tl), "dense_padded_real": tf(real, t_pad),
                   "dense_mean": tf(dense_flops, t_mean), **{k + "_real": tf(real, ms) for k, ms in sdpa.items()}},
        "speedup_vs_padded": t_pad / t_var,
        "speedup_vs_sdpa_cudnn_padded": (cu_ms / t_var) if cu_ms else None,
        "rate_vs_dense": tf(real, t_var) / tf(dense_flops, t_mean),
        "rate_vs_dense_tl": tf(real, t_var_tl) / tf(dense_flops, t_mean),
    }
