"""Tile tables of a jagged batch for the Gluon backward kernels (``attn_bwd_dq_gluon`` / ``attn_bwd_dkdv_gluon``
with ``VARLEN``), heaviest tile first.

A jagged batch's backward runs one CTA per (tile, head): a tile is 128 query rows of one sequence (the dQ kernel)
or 128 keys of one sequence (the dK/dV kernel).  The grid is (rows, heads); row r of the table says which tile
CTA (r, h) computes and where that tile's sequence lives in every packed operand, so that a CTA reads one
64-byte row once (one round trip) before its first TMA copy.  Rows are sorted by the tile's work, heaviest first
(the key tiles a dQ tile visits, the query steps a dK/dV tile visits), ties by (sequence, tile): the long
programs start first and the grid ends with light ones (a short tail), and for non-causal batches the tiles of one
sequence stay neighbours (they share K / V, or Q / dO, in L2).

Row layout (``SLOT_COLS`` int32; the kernels read columns 0-10):
  0 b        the sequence (row b of the seq operands' per-(sequence, head, channel) exponents)
  1 t0       the tile's first query row (dQ) or key (dK/dV) within its sequence, a multiple of 128
  2, 3       q_start, q_end: the sequence's rows of the packed (Tq, H, D) tensors (cu_seqlens_q[b], [b + 1])
  4, 5       k_start, k_end: the same for the keys
  6 qg       q's exponent groups (one per 128 rows from the sequence's start) begin at row qg (q.cu_exp[b])
  7 kg       the same for k and v_hdim (k.cu_exp[b])
  8 col      the seq operand's columns begin at col (dQ: k_seq.cu_data[b], dK/dV: q_seq.cu_data[b]; 64-aligned)
  9 dog      dout_hdim's exponent groups begin at row dog (dout_hdim.cu_exp[b])
  10 dcol    δ's columns begin at dcol (the padded δ of ``attn_bwd_preprocess_varlen(delta_padded=True)``:
             dout_seq.cu_data[b])
Rows of tiles past their sequence's end (the table has one row per candidate (sequence, tile < max_seqlen / 128))
come last and are all zero: t0 = 0 >= len = 0, the kernel returns at once.  The launch needs only the first
``tile_rows_bound`` rows: at least as many as there are real tiles, computed without a device sync.

Built by one Triton launch (``_bwd_tile_slots_kernel``: each candidate counts the candidates ranked before it,
O(N^2) compares over N = B * ceil(max_seqlen / 128) candidates, ~N^2 / 32 per program), or, above ``RANK_MAX``
candidates, by a stable torch argsort (a dozen small launches) with the same result.  The PyTorch twin
``bwd_tile_slots_torch`` defines the table.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mxattn.kernels.launch import cdiv, fast_launcher

__all__ = ["SLOT_COLS", "TILE", "RANK_MAX", "bwd_tile_slots", "bwd_tile_slots_torch", "tile_rows_bound"]

SLOT_COLS = 16  # int32 per row: 64 bytes
TILE = 128  # query rows of a dQ tile (its BLOCK_M) = keys of a dK/dV tile (its BLOCK_N)
STEP = 64  # the inner step: keys per dQ key tile, queries per dK/dV query step
RANK_MAX = 8192  # candidates ranked by the Triton kernel (N^2 = 67M compares); above: torch argsort
_RANK_BLOCK = 32


@triton.jit
def _tile_candidates(CU_Q, CU_K, idx, N, n_max, KEY_TILES: tl.constexpr, CAUSAL: tl.constexpr):
    """Candidates idx (a vector): tile idx % n_max of sequence idx // n_max.  Returns (b, t0, q0, q1, k0, k1, key)
    with key = the tile's work (visited STEP-tiles, >= 0) for a real tile and -1 for one past its sequence's end
    or idx >= N.  The work counts are the kernels' loop counts (attn_bwd_dq_gluon / attn_bwd_dkdv_gluon)."""
    m = idx < N
    b = idx // n_max
    t0 = (idx - b * n_max) * 128
    q0 = tl.load(CU_Q + b, mask=m, other=0)
    q1 = tl.load(CU_Q + b + 1, mask=m, other=0)
    k0 = tl.load(CU_K + b, mask=m, other=0)
    k1 = tl.load(CU_K + b + 1, mask=m, other=0)
    sq = q1 - q0
    sk = k1 - k0
    if KEY_TILES:  # dK/dV: query steps of 64 from lo to the end of the sequence's queries
        valid = m & (t0 < sk)
        m_end = (sq + 63) // 64 * 64
        if CAUSAL:
            lo = tl.minimum(tl.maximum(t0 - (sk - sq), 0) // 64 * 64, m_end)
        else:
            lo = tl.zeros_like(m_end)
        work = (m_end - lo) // 64
    else:  # dQ: key tiles of 64 up to the last key the tile's rows see
        valid = m & (t0 < sq)
        if CAUSAL:
            hi = tl.minimum(sk, tl.maximum(t0 + 128 + sk - sq, 0))
        else:
            hi = sk
        work = (hi + 63) // 64
    return b, t0, q0, q1, k0, k1, tl.where(valid, work, -1)


@triton.jit
def _bwd_tile_slots_kernel(CU_Q, CU_K, CU_QG, CU_KG, CU_COL, CU_DOG, CU_DCOL, SLOTS, N, n_max,
                           KEY_TILES: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
                           COLS: tl.constexpr):
    """Candidates pid*BLOCK .. +BLOCK-1: each one's rank (candidates with more work, or as much and a lower index,
    come first) and its row of SLOTS at that rank (module docstring)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b, t0, q0, q1, k0, k1, key_i = _tile_candidates(CU_Q, CU_K, i, N, n_max, KEY_TILES, CAUSAL)
    rank = tl.zeros([BLOCK], tl.int32)
    for jb in range(0, tl.cdiv(N, BLOCK)):
        j = jb * BLOCK + tl.arange(0, BLOCK)
        _, _, _, _, _, _, key_j = _tile_candidates(CU_Q, CU_K, j, N, n_max, KEY_TILES, CAUSAL)
        ahead = (key_j[None, :] > key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < N)[None, :]).to(tl.int32), 1)
    mi = i < N
    ok = key_i >= 0
    mb = mi & ok
    zero = tl.zeros([BLOCK], tl.int32)
    row = SLOTS + rank.to(tl.int64) * COLS
    tl.store(row, tl.where(ok, b, 0), mask=mi)
    tl.store(row + 1, tl.where(ok, t0, 0), mask=mi)
    tl.store(row + 2, tl.where(ok, q0, 0), mask=mi)
    tl.store(row + 3, tl.where(ok, q1, 0), mask=mi)
    tl.store(row + 4, tl.where(ok, k0, 0), mask=mi)
    tl.store(row + 5, tl.where(ok, k1, 0), mask=mi)
    tl.store(row + 6, tl.load(CU_QG + b, mask=mb, other=0), mask=mi)
    tl.store(row + 7, tl.load(CU_KG + b, mask=mb, other=0), mask=mi)
    tl.store(row + 8, tl.load(CU_COL + b, mask=mb, other=0), mask=mi)
    tl.store(row + 9, tl.load(CU_DOG + b, mask=mb, other=0), mask=mi)
    tl.store(row + 10, tl.load(CU_DCOL + b, mask=mb, other=0), mask=mi)
    for c in tl.static_range(11, COLS):
        tl.store(row + c, zero, mask=mi)


def _n_max(max_seqlen: int) -> int:
    return max(1, cdiv(max_seqlen, TILE))


def tile_rows_bound(total: int, batch: int, max_seqlen: int) -> int:
    """Rows of the table a launch covers: at least the number of real tiles, sum_b ceil(len_b / 128) <=
    (total + 127 * batch) / 128 (``total`` tokens of the tiled side), and at most the table's rows."""
    return max(1, min(batch * _n_max(max_seqlen), (total + (TILE - 1) * batch) // TILE))


def _check_offsets(*cus: torch.Tensor) -> int:
    B = cus[0].numel() - 1
    for c in cus:
        if c.dtype != torch.int32 or c.ndim != 1 or c.numel() != B + 1 or c.device != cus[0].device:
            raise ValueError(f"offset arrays must be int32 (B + 1,) on one device, got {c.dtype} "
                             f"{tuple(c.shape)} on {c.device}")
    return B


def bwd_tile_slots_torch(cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol, max_seqlen: int, key_tiles: bool,
                         causal: bool) -> torch.Tensor:
    """PyTorch twin of ``bwd_tile_slots`` (and its path above ``RANK_MAX`` candidates): (B * n_max, SLOT_COLS)
    int32, n_max = ceil(max_seqlen / 128), max_seqlen the tiled side's (keys for ``key_tiles``)."""
    B = _check_offsets(cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol)
    n_max = _n_max(max_seqlen)
    dev = cu_q.device
    N = B * n_max
    idx = torch.arange(N, device=dev)
    b = idx // n_max
    t0 = (idx % n_max) * TILE
    q0, q1, k0, k1 = cu_q[:-1][b], cu_q[1:][b], cu_k[:-1][b], cu_k[1:][b]
    sq, sk = (q1 - q0).long(), (k1 - k0).long()
    if key_tiles:
        valid = t0 < sk
        m_end = (sq + 63) // 64 * 64
        lo = torch.minimum((t0 - (sk - sq)).clamp(min=0) // 64 * 64, m_end) if causal else torch.zeros_like(m_end)
        work = (m_end - lo) // 64
    else:
        valid = t0 < sq
        hi = torch.minimum(sk, (t0 + TILE + sk - sq).clamp(min=0)) if causal else sk
        work = (hi + 63) // 64
    key = torch.where(valid, work, torch.full_like(work, -1))
    order = torch.argsort(key, descending=True, stable=True)
    cols = [b, t0, q0, q1, k0, k1, cu_qg[:-1][b], cu_kg[:-1][b], cu_col[:-1][b], cu_dog[:-1][b], cu_dcol[:-1][b]]
    rows = torch.stack([c.to(torch.int32) for c in cols], 1) * valid.to(torch.int32)[:, None]
    table = torch.zeros(N, SLOT_COLS, dtype=torch.int32, device=dev)
    table[:, : len(cols)] = rows[order]
    return table


def bwd_tile_slots(cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol, max_seqlen: int, key_tiles: bool,
                   causal: bool) -> torch.Tensor:
    """The (B * n_max, SLOT_COLS) int32 tile table (module docstring) on the offsets' device, no host sync.

    cu_q, cu_k: the sequences' offsets; cu_qg, cu_kg, cu_dog: the exponent group offsets of q, k (and v_hdim), and
    dout_hdim; cu_col: the seq operand's column offsets (k_seq's for dQ tiles, q_seq's for dK/dV tiles); cu_dcol:
    the padded δ's column offsets (dout_seq's);
    ``max_seqlen`` at least the tiled side's longest sequence (queries for dQ, keys for ``key_tiles``)."""
    B = _check_offsets(cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol)
    N = B * _n_max(max_seqlen)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if N > RANK_MAX or (cu_q.device.type != "cuda" and not interpreting):
        return bwd_tile_slots_torch(cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol, max_seqlen, key_tiles, causal)
    table = torch.empty(N, SLOT_COLS, dtype=torch.int32, device=cu_q.device)
    fast_launcher(_bwd_tile_slots_kernel)[(cdiv(N, _RANK_BLOCK),)](
        cu_q, cu_k, cu_qg, cu_kg, cu_col, cu_dog, cu_dcol, table, N, _n_max(max_seqlen),
        KEY_TILES=key_tiles, CAUSAL=causal, BLOCK=_RANK_BLOCK, COLS=SLOT_COLS,
    )
    return table
