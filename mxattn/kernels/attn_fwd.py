"""MXFP8 attention forward for Hopper in Triton ``tl``: plain FP8 tensor-core products, MX scales folded.

Operands come in the Hopper operand format (``formats.RowScaledFP8``, DESIGN §3):
  Q  e4m3 (B, Sq, Hq, D), one exponent per (token, head)              -> folded into the row's softmax scale
  K  e4m3 (B, Sk, Hkv, D), one exponent per 128 keys and head         -> folded into the tile's softmax scale
  V  e4m3 (B, Sk, Hkv, D) view of a channel-major (B, Hkv, D, S_pad) buffer, one exponent per channel
                                                                       -> folded into the epilogue
so ``S = Q Kᵀ`` and ``O = P V`` are plain ``tl.dot`` on e4m3 at full FP8 rate (wgmma needs both operands
K-major: Kᵀ's contraction dim D is contiguous in K; V's contraction dim (keys) is contiguous in the
channel-major buffer).

P is quantized online with the constant scale 2^-8: ``p = exp2(s - (m - 8))`` is at most 256 so it fits e4m3
without saturating, whatever the running max ``m`` does later (earlier tiles are rescaled in fp32 through the
accumulator, never re-quantized).  The row sum ``l`` adds the fp32 ``p`` before rounding: P never saturates,
so the e4m3 rounding is unbiased noise (±2^-4 relative per element) rather than a bias between numerator and
denominator; the 256 cancels in ``acc / l``.

Causal masks are aligned bottom-right (query i sees key j iff j <= i + Sk - Sq), as in FlashAttention.
A row with nothing to attend gives out = 0 and lse = -inf.

Jagged batches (``VARLEN``, launcher ``attn_fwd_hopper_varlen``) run the same kernel: each program reads its
grid slot's row of ``SLOTS`` (the sequence and its offsets, heaviest sequence first), moves the base pointers there
and sets the sequence lengths, after which the code is the dense code (operand layouts: ``kernels/varlen.py``).  The
dense launch passes None for ``SLOTS`` (constexpr), so the dense path compiles to the same PTX as before varlen
existed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from mxattn.kernels import launch as launch_mod
from mxattn.kernels.cta_order import cta_order_tl
from mxattn.kernels.launch import BoundLaunch, cdiv, fast_launcher, sm_count

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
K_EXP_GROUP = 128  # keys sharing one K exponent (formats.RowScaledFP8 K layout); a multiple of every BLOCK_N


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # percent (0, 25, 50) of an unmasked tile's exp2 computed on the FMA pipe instead of MUFU (``_exp2_mixed``);
    # measured 4-17 % slower on an H100 (docs/perf-notes-attn-fwd-gluon.md, session 18), so 0
    exp2_fma: int = 0
    # causal launches: CTAs heaviest query block first over sections of heads (kernels/cta_order.py, as the Gluon
    # kernels' ``causal_lpt``) instead of head by head.  Bit-identical.  None: MXATTN_CAUSAL_LPT's choice
    # (``launch.causal_lpt``), on by default (session 24, H100, kernel alone: causal d128 S 2k 1.110x, d64 S 4k / 8k
    # 1.134x / 1.073x; `cost_probe-…-s24-lpt-fwd-tl.json`)
    causal_lpt: Optional[bool] = None


def _exp2_fma_default() -> int:
    """``MXATTN_EXP2_FMA`` (0, 25 or 50; read at import): the forward kernels' default ``exp2_fma`` (both the
    ``tl`` and the Gluon kernel), so that the public API and ``mxattn bench`` can run the opt-in build."""
    v = os.environ.get("MXATTN_EXP2_FMA", "0")
    if v not in ("0", "25", "50"):
        raise ValueError(f"MXATTN_EXP2_FMA must be 0, 25 or 50, got {v!r}")
    return int(v)


EXP2_FMA_DEFAULT = _exp2_fma_default()


def default_config(head_dim: int, causal: bool) -> FwdConfig:
    """Tile choice measured on the H200 (triton 3.6); see docs/perf-notes-attn.md.

    One warpgroup (4 warps) per 64 query rows: the S tile (64x128 fp32) is 64 registers a thread and the
    d=128 accumulator another 64, leaving room for 3 K/V stages.  Swept over 9 configs in
    benchmarks/tune_attn_fwd.py (results in benchmarks/results/attn_fwd_tune-*.json).
    """
    if head_dim <= 64 and causal:
        return FwdConfig(64, 64, 4, 3, EXP2_FMA_DEFAULT)  # d64 causal: 380 vs 357 TFLOP/s for BN128 (S 4k)
    return FwdConfig(64, 128, 4, 3, EXP2_FMA_DEFAULT)


def varlen_config(head_dim: int, causal: bool) -> FwdConfig:
    """Tile of the jagged forward: ``default_config`` except d64 non-causal, which takes BN 64 like d64 causal.

    Measured on the H200 (B16 H16 mean 2048, lengths uniform in [1, 4095], `varlen_fwd-…-2026-11-30-s7-sweep.json`):
    d64 non-causal jagged 463 TFLOP/s at (64, 64) against 410 at (64, 128), while the dense kernel prefers (64, 128)
    (486 vs 471): every sequence ends in a partial K/V tile, and half a 128-key tile of waste costs d64 more."""
    if head_dim <= 64:
        return FwdConfig(64, 64, 4, 3)
    return default_config(head_dim, causal)


INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_e4m3_nonneg(x):
    """Round non-negative fp32 (<= 448) to the e4m3 grid, nearest even, so the cast that follows is exact.

    Only used under TRITON_INTERPRET=1, whose fp32->e4m3 cast mis-rounds values that round up across a power
    of two (DESIGN §5); on the GPU the cvt.rn.satfinite instruction does this itself."""
    bits = x.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RNE
    sub = (x * 512.0 + 12582912.0) - 12582912.0  # RNE to a multiple of 2^-9 (1.5 * 2^23 trick)
    return tl.where(x >= 0.015625, normal.to(tl.float32, bitcast=True), sub * 0.001953125)


# 2^f on [-1/2, 1/2] as 1 + f (C1 + f (C2 + f C3)), constant term held at 1, least maximum relative error
# (1.014e-4 in fp32 Horner); fitted here by Lawson iteration on 20,001 points.  The Gluon forward uses the same.
EXP2_C1 = tl.constexpr(0.6932829170291438)
EXP2_C2 = tl.constexpr(0.2422106313698579)
EXP2_C3 = tl.constexpr(0.05500868998260835)


@triton.jit
def exp2_fma(x):
    """2^x without MUFU: n = round(x) by adding 1.5 * 2^23, f = x - n in [-1/2, 1/2], 2^f by the degree-3
    polynomial, times 2^n made from n's bits (an FMUL: a NaN x stays NaN).  x is clamped below at -127 (a
    NaN-keeping max): n = -127 makes 2^n's bits 0, so x < -126.5 and -inf give exactly 0, as MUFU's
    flush-to-zero does; otherwise 2^n is a normal float.
    Relative error <= 1.05e-4 (tests/test_attn_fwd.py checks it in the interpreter)."""
    x = tl.maximum(x, -127.0, propagate_nan=tl.PropagateNan.ALL)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = tl.fma(tl.fma(tl.fma(f, EXP2_C3, EXP2_C2), f, EXP2_C1), f, 1.0)
    # t's bits are 0x4B400000 + n: shifted left by 23 they are n << 23 (mod 2^32); plus 127 << 23 that is 2^n
    two_n = ((t.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return p * two_n


@triton.jit
def _exp2_mixed(x, EXP2_FMA: tl.constexpr):
    """exp2 of a [M, N] tile with EXP2_FMA percent (0, 25, 50) of the elements through ``exp2_fma``: the odd
    columns (50), or the odd columns of every other pair of columns (25).  The split follows column bits that
    wgmma's accumulator layout keeps in a thread's registers (bit 0, then bit 3)."""
    if EXP2_FMA == 0:
        return tl.exp2(x)
    else:
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        y = tl.permute(tl.reshape(x, [M, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4))  # [M, g, l, h, e] of c = 16g+8h+2l+e
        y0, y1 = tl.split(y)
        if EXP2_FMA == 50:
            y1 = exp2_fma(y1)
        else:
            tl.static_assert(EXP2_FMA == 25, "exp2_fma must be 0, 25 or 50")
            y10, y11 = tl.split(y1)
            y1 = tl.join(tl.exp2(y10), exp2_fma(y11))
        y = tl.join(tl.exp2(y0), y1)
        return tl.reshape(tl.permute(y, (0, 1, 3, 2, 4)), [M, N])


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, qscale, k_ptrs, v_ptrs, ke_ptr, offs_m, offs_n_base, start_n, Sk, Sv, causal_off,
    stride_kn, stride_vn, stride_ke_tile,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
    EXP2_FMA: tl.constexpr = 0,
):
    """One K/V tile of the online softmax.  ``MASKED`` tiles check key bounds and the causal diagonal.

    ``Sv`` bounds the V rows loaded (keys past ``Sk`` get p = 0): ``Sk`` when dense; ``Sk`` rounded up to 16
    when varlen, whose V rows are zero-padded to 16, so that the mask is constant over 16 keys and the
    (key-contiguous) V load stays 16-byte vectorized."""
    offs_n = start_n + offs_n_base
    if MASKED:
        kt = tl.load(k_ptrs + start_n * stride_kn, mask=offs_n[None, :] < Sk, other=0.0)
        vt = tl.load(v_ptrs + start_n * stride_vn, mask=offs_n[:, None] < Sv, other=0.0)
    else:
        kt = tl.load(k_ptrs + start_n * stride_kn)
        vt = tl.load(v_ptrs + start_n * stride_vn)
    ke = tl.load(ke_ptr + (start_n // 128) * stride_ke_tile)
    qk = tl.dot(q, kt)  # fp8 x fp8 -> fp32, (BM, BN)
    rs = qscale * tl.exp2(ke.to(tl.float32))  # per-row factor to log2 units: 2^(qe + ke) * scale * log2(e) > 0
    if MASKED:
        keep = offs_n[None, :] < Sk
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        s = tl.where(keep, qk * rs[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        x = s - (m_new - 8.0)[:, None]
    else:
        # rs > 0, so the row max of qk * rs is rs * max(qk): one FMA per element below instead of MUL + ADD
        m_new = tl.maximum(m_i, tl.max(qk, 1) * rs)
        x = qk * rs[:, None] - (m_new - 8.0)[:, None]
    alpha = tl.exp2(m_i - m_new)
    # p = 2^x <= 256: fits e4m3 with the constant scale 2^-8.  l adds the unrounded p: P never saturates,
    # so e4m3 rounding is unbiased noise (summing p8.to(fp32) instead gave NaNs on triton 3.6 / sm90).
    if MASKED:
        p = tl.exp2(x)  # -inf where masked: MUFU gives 0
    else:
        p = _exp2_mixed(x, EXP2_FMA)
    if EXPLICIT_ROUND:
        p = _round_e4m3_nonneg(p)
    p8 = p.to(tl.float8e4nv)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p8, vt, acc)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, QE, KE, VE, O, LSE,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_qeb, stride_qem, stride_qeh,
    stride_keb, stride_ket, stride_keh,
    stride_veb, stride_veh, stride_ved,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    Hq, Sq, Sk, group_size, qk_scale,
    SLOTS,  # varlen: (B, 8) int32, row = grid slot (heaviest sequence first), see varlen_slots (None when dense)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, VARLEN: tl.constexpr = False,
    V_BLOCKS: tl.constexpr = False,  # varlen V as one (Hkv, D, round16(len)) block per sequence (kernels/varlen.py)
    EXP2_FMA: tl.constexpr = 0,  # FwdConfig.exp2_fma
    LPT_SECTION: tl.constexpr = 0,  # FwdConfig.causal_lpt: CTAs per section of heads (kernels/cta_order.py)
):
    # heaviest query blocks first when causal (they see the most keys): shorter tail at the end of the grid
    if VARLEN:
        # 1-D grid, q-blocks fastest (cdiv(max_seqlen_q, BLOCK_M) of them, Sq = max_seqlen_q here): as the dense
        # order, without the 65535 limit of grid dim 1 on batch * heads
        n_m = tl.cdiv(Sq, BLOCK_M)
        pid_m = n_m - 1 - tl.program_id(0) % n_m if CAUSAL else tl.program_id(0) % n_m
        pid_bh = tl.program_id(0) // n_m
    else:
        pid_m, pid_bh = cta_order_tl(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1),
                                     LPT_SECTION, CAUSAL)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    if VARLEN:
        # row b of SLOTS: sequence s = SLOTS[b, 0] (grid slots run heaviest sequences first: the long ones do not form
        # the tail) and its offsets: q rows SLOTS[b, 1]:SLOTS[b, 2] of the packed (Tq, Hq, D) tensors, keys
        # SLOTS[b, 3]:SLOTS[b, 4], K exponent groups from SLOTS[b, 5], V columns from SLOTS[b, 6] (16-aligned) of the
        # channel-major (Hkv, D, Tv) buffer, V exponents row s.  The seven loads read one 32-byte row and depend on
        # the program id only: one round trip before the Q and K/V loads (a (B,) order plus the cu arrays took three).
        row = SLOTS + b * 8
        b = tl.load(row)
        q_start = tl.load(row + 1)
        q_end = tl.load(row + 2)
        k_start = tl.load(row + 3)
        k_end = tl.load(row + 4)
        kg_start = tl.load(row + 5)
        v_start = tl.multiple_of(tl.load(row + 6), 16)
        b64 = b.to(tl.int64)
        Sq = q_end - q_start
        Sk = k_end - k_start
        # the exit test reads every loaded value (the second term is false: offsets and lengths are >= 0), so that
        # ptxas cannot sink the later loads below the exit, into a second round trip
        if (start_m >= Sq) | ((b | Sk | kg_start | v_start) < 0):
            return
        q_start = q_start.to(tl.int64)
        Q += q_start * stride_qm
        QE += q_start * stride_qem
        O += q_start * stride_om
        K += k_start.to(tl.int64) * stride_kn
        KE += kg_start.to(tl.int64) * stride_ket
        VE += b64 * stride_veb
        b64 = 0
        if V_BLOCKS:
            # the sequence's own block: rows of its channels are round16(len_k) keys long, not the whole batch's
            # Tv, so a V tile spans 16x fewer DRAM pages when the batch holds 16 sequences
            v_row = tl.multiple_of((Sk + 15) // 16 * 16, 16)
            V += (v_start.to(tl.int64) * (Hq // group_size) + hk.to(tl.int64) * v_row) * HEAD_DIM
            stride_vd = v_row
        else:
            # the head strides of V (D * Tv) and LSE (Tq) grow with the whole batch: head offsets in 64 bits
            V += v_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
        LSE += q_start * stride_lm + h.to(tl.int64) * stride_lh
        stride_vh = 0
        stride_lh = 0

    q_ptrs = Q + b64 * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < Sq, other=0.0)
    qe = tl.load(QE + b64 * stride_qeb + h * stride_qeh + offs_m * stride_qem, mask=offs_m < Sq, other=0)
    qscale = tl.exp2(qe.to(tl.float32)) * qk_scale  # softmax_scale * log2(e) * 2^qe, per row

    # K loaded as (D, BN) = Kᵀ; V as (BN, D) from the channel-major buffer (keys contiguous).
    k_ptrs = K + b64 * stride_kb + hk * stride_kh + offs_d[:, None] * stride_kd + offs_n[None, :].to(tl.int64) * stride_kn
    v_ptrs = V + b64 * stride_vb + hk * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd
    ke_ptr = KE + b64 * stride_keb + hk * stride_keh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    causal_off = Sk - Sq
    if VARLEN:
        Sv = (Sk + 15) // 16 * 16  # V columns of a sequence are zero-padded to 16 (kernels/varlen.py)
    else:
        Sv = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + causal_off, 0))
        full_end = tl.minimum((Sk // BLOCK_N) * BLOCK_N, (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        full_end = (Sk // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, qscale, k_ptrs, v_ptrs, ke_ptr, offs_m, offs_n, start_n, Sk, Sv, causal_off,
            stride_kn, stride_vn, stride_ket, BLOCK_N, False, CAUSAL, EXPLICIT_ROUND, EXP2_FMA,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, qscale, k_ptrs, v_ptrs, ke_ptr, offs_m, offs_n, start_n, Sk, Sv, causal_off,
            stride_kn, stride_vn, stride_ket, BLOCK_N, True, CAUSAL, EXPLICIT_ROUND,
        )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    ve = tl.load(VE + b64 * stride_veb + hk * stride_veh + offs_d * stride_ved)
    out = acc * (1.0 / l_safe)[:, None] * tl.exp2(ve.to(tl.float32))[None, :]
    o_ptrs = O + b64 * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < Sq)
    lse = tl.where(empty, float("-inf"), (m_i - 8.0 + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + offs_m * stride_lm, lse, mask=offs_m < Sq)


@triton.jit
def _varlen_slots_kernel(CU_Q, CU_K, CU_KG, CU_V, SLOTS, B, BLOCK: tl.constexpr):
    """Row r of SLOTS (B, 8) = (s, cu_q[s], cu_q[s+1], cu_k[s], cu_k[s+1], cu_kg[s], cu_v[s], 0) for the sequence s
    of rank r in decreasing len_q * len_k order, ties by index (the order of torch.argsort(stable=True,
    descending=True)).  Program p ranks sequences p*BLOCK .. p*BLOCK+BLOCK-1 against all B: O(B^2 / BLOCK) each."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mi = i < B
    qs = tl.load(CU_Q + i, mask=mi, other=0)
    qe = tl.load(CU_Q + i + 1, mask=mi, other=0)
    ks = tl.load(CU_K + i, mask=mi, other=0)
    ke = tl.load(CU_K + i + 1, mask=mi, other=0)
    wi = (qe - qs).to(tl.int64) * (ke - ks).to(tl.int64)
    rank = tl.zeros([BLOCK], tl.int32)
    for jb in range(0, tl.cdiv(B, BLOCK)):
        j = jb * BLOCK + tl.arange(0, BLOCK)
        mj = j < B
        wj = (tl.load(CU_Q + j + 1, mask=mj, other=0) - tl.load(CU_Q + j, mask=mj, other=0)).to(tl.int64) * \
             (tl.load(CU_K + j + 1, mask=mj, other=0) - tl.load(CU_K + j, mask=mj, other=0)).to(tl.int64)
        ahead = (wj[None, :] > wi[:, None]) | ((wj[None, :] == wi[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & mj[None, :]).to(tl.int32), 1)
    row = SLOTS + rank * 8
    tl.store(row, i, mask=mi)
    tl.store(row + 1, qs, mask=mi)
    tl.store(row + 2, qe, mask=mi)
    tl.store(row + 3, ks, mask=mi)
    tl.store(row + 4, ke, mask=mi)
    tl.store(row + 5, tl.load(CU_KG + i, mask=mi, other=0), mask=mi)
    tl.store(row + 6, tl.load(CU_V + i, mask=mi, other=0), mask=mi)
    tl.store(row + 7, tl.zeros([BLOCK], tl.int32), mask=mi)


def varlen_slots(cu_q: torch.Tensor, cu_k: torch.Tensor, cu_kg: torch.Tensor, cu_v: torch.Tensor) -> torch.Tensor:
    """The (B, 8) int32 ``SLOTS`` table of the jagged forward: one launch, no host sync (the torch ops it replaces,
    diff / to / mul / argsort / to, were about ten small kernels inside every forward call)."""
    B = cu_q.numel() - 1
    slots = torch.empty(B, 8, dtype=torch.int32, device=cu_q.device)
    BLOCK = 32  # (BLOCK, BLOCK) int64 compares: 60 registers at 32, 254 at 64, spills at 128 (sm90, 4 warps)
    fast_launcher(_varlen_slots_kernel)[(cdiv(B, BLOCK),)](cu_q, cu_k, cu_kg, cu_v, slots, B, BLOCK=BLOCK)
    return slots


def alloc_fwd_outputs(q_data: torch.Tensor, out_dtype: torch.dtype):
    """out (B, Sq, Hq, D) in ``out_dtype`` and lse (B, Hq, Sq) fp32 for a (B, Sq, Hq, D) query, shared by the
    forward launchers.  When out is empty there is nothing to launch: lse is then already -inf."""
    B, Sq, Hq, D = q_data.shape
    out = torch.empty(B, Sq, Hq, D, dtype=out_dtype, device=q_data.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q_data.device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
    return out, lse


# Bound launches of the forward per operand signature (shapes, strides, alignment of the six operand tensors, the
# call's options, the current device): a repeated call skips the launcher's key (~20 us of host time for this
# kernel's 46 arguments) and the stride arithmetic.  Only calls without an explicit config take them.
_FWD_BOUND: dict = {}
_MAX_BOUND = 256


def _fwd_bound_key(q, k, v, causal, softmax_scale, out_dtype):
    qd, kd, vd, qe, ke, ve = q.data, k.data, v.data, q.exp, k.exp, v.exp
    if not (qd.is_cuda or INTERPRETER) or not launch_mod.PLANS:  # (interpreter: the bound launch takes the
        return None  # launcher's path, so CPU tests run the plan's arguments)
    dev = launch_mod.current_device() if qd.is_cuda else -1
    return (qd.shape, qd.stride(), kd.shape, kd.stride(), vd.stride(), qe.shape, qe.stride(), ke.shape, ke.stride(),
            ve.shape, ve.stride(), qd.dtype, kd.dtype, vd.dtype, qd.device, dev, causal,
            softmax_scale, out_dtype, qd.data_ptr() & 15, kd.data_ptr() & 15, vd.data_ptr() & 15,
            qe.data_ptr() & 15, ke.data_ptr() & 15, ve.data_ptr() & 15, launch_mod.CAUSAL_LPT)


def bound_plan(q, k, v, causal: bool, softmax_scale, out_dtype):
    """The bound launch a call of ``attn_fwd_hopper`` with these operands and options (default config) made, for
    ``run_bound``; None if none was made (a caller that keeps it skips this function's key, ``interface``'s call
    plans)."""
    key = _fwd_bound_key(q, k, v, causal, softmax_scale, out_dtype)
    return _FWD_BOUND.get(key) if key is not None else None


def run_bound(bound, q, k, v, out_dtype):
    """``attn_fwd_hopper`` on operands of the signature ``bound`` (``bound_plan``) was made for: fresh out / lse,
    one launch, no checks."""
    launch, out_shape, lse_shape, scalars = bound
    qd = q.data
    out = torch.empty(out_shape, dtype=out_dtype, device=qd.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=qd.device)
    launch(qd, k.data, v.data, q.exp, k.exp, v.exp, out, lse, *scalars)
    return out, lse


def attn_fwd_hopper(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    out_dtype: torch.dtype = torch.bfloat16, config: FwdConfig | None = None):
    """Launch the forward on row-scaled FP8 operands (``formats.RowScaledFP8``).

    q: Q layout (exp (B, Sq, Hq, 1)); k: K layout (exp (B, ceil(Sk/128), Hkv, 1), group 128 along dim 1);
    v: V layout (dim 1, exp (B, 1, Hkv, D)).  Shapes are validated by the caller (``interface``).
    Returns out (B, Sq, Hq, D) in ``out_dtype`` and lse (B, Hq, Sq) fp32 (natural log).
    """
    key = _fwd_bound_key(q, k, v, causal, softmax_scale, out_dtype) if config is None else None
    bound = _FWD_BOUND.get(key) if key is not None else None
    if bound is not None:
        return run_bound(bound, q, k, v, out_dtype)
    qd, kd, vd = q.data, k.data, v.data
    qe, ke, ve = q.exp, k.exp, v.exp
    B, Sq, Hq, D = qd.shape
    Sk, Hkv = kd.shape[1], kd.shape[2]
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    cfg = config or default_config(D, causal)
    out, lse = alloc_fwd_outputs(qd, out_dtype)
    if out.numel() == 0:
        return out, lse
    grid = (cdiv(Sq, cfg.block_m), B * Hq)
    scalars = (
        *qd.stride(), *kd.stride(), *vd.stride(),
        qe.stride(0), qe.stride(1), qe.stride(2),
        ke.stride(0), ke.stride(1), ke.stride(2),
        ve.stride(0), ve.stride(2), ve.stride(3),
        *out.stride(), *lse.stride(),
        Hq, Sq, Sk, Hq // Hkv, softmax_scale * LOG2E,
        None,
    )
    if cfg.exp2_fma not in (0, 25, 50):
        raise ValueError(f"exp2_fma must be 0, 25 or 50 (percent), got {cfg.exp2_fma}")
    constexprs = dict(HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                      EXPLICIT_ROUND=INTERPRETER, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # sections of about two waves at two CTAs an SM (the tl builds run 1-3); only where on, so that the other
    # builds keep their specialization
    section = launch_mod.lpt_section(causal, cfg.causal_lpt, True, sm_count(qd.device), ctas_per_sm=2)
    if section:
        constexprs["LPT_SECTION"] = section
    if cfg.exp2_fma:  # only then: the default build's specialization stays the measured one
        constexprs["EXP2_FMA"] = cfg.exp2_fma
        if cfg.num_warps == 4 and D <= 64 and not INTERPRETER:
            # the polynomial's temporaries took the 4-warp d64 build from 162 to 176-179 registers a thread: three
            # CTAs no longer fit an SM's 64 K registers; capped at 168 (= 65536 / 384, rounded down to 8)
            constexprs["maxnreg"] = 168
    args = (qd, kd, vd, qe, ke, ve, out, lse, *scalars)
    if key is None:
        fast_launcher(_attn_fwd_kernel)[grid](*args, **constexprs)
        return out, lse
    launch = BoundLaunch(fast_launcher(_attn_fwd_kernel), grid, args, constexprs)
    if len(_FWD_BOUND) >= _MAX_BOUND:
        _FWD_BOUND.clear()
    # out / lse strides in ``scalars`` are those of every later call's fresh outputs of the same shapes
    _FWD_BOUND[key] = (launch, tuple(out.shape), tuple(lse.shape), scalars)
    return out, lse


def attn_fwd_hopper_varlen(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                           out_dtype: torch.dtype = torch.bfloat16, config: FwdConfig | None = None):
    """Launch the forward on a jagged batch (``kernels.varlen.VarlenFP8`` operands, layouts in that module).

    q: role "q" (data (Tq, Hq, D), exp (Tq, Hq, 1)); k: role "k" (data (Tk, Hkv, D), exp (G, Hkv, 1) with group
    offsets ``k.cu_exp``); v: role "v" (data channel-major (Hkv, D, Tv) with 16-aligned sequence starts
    ``v.cu_data``, exp (B, Hkv, D)).  Grid: cdiv(q.max_seqlen, BLOCK_M) * B * Hq programs, q-blocks fastest,
    sequences in decreasing Sq * Sk order; programs past their sequence's end return at once.  Causal masks are
    bottom-right per sequence.  Shapes and offsets are validated by the caller (``interface``).
    Returns out (Tq, Hq, D) in ``out_dtype`` and lse (Hq, Tq) fp32 (natural log).
    """
    Tq, Hq, D = q.data.shape
    Hkv = k.data.shape[1]
    B = q.cu_data.numel() - 1
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    cfg = config or varlen_config(D, causal)
    out = torch.empty(Tq, Hq, D, dtype=out_dtype, device=q.data.device)
    lse = torch.empty(Hq, Tq, dtype=torch.float32, device=q.data.device)
    n_m = cdiv(q.max_seqlen, cfg.block_m)
    if out.numel() == 0 or B * n_m == 0:
        return out, lse
    if k.data.shape[0] == 0:  # no keys at all: every row sees nothing
        return out.zero_(), lse.fill_(float("-inf"))
    qd, kd, vd = q.data, k.data, v.data
    qe, ke, ve = q.exp, k.exp, v.exp
    # V's strides (key, head, channel): channel-major rows over the whole batch, or per-sequence blocks whose
    # strides the kernel derives from each sequence's length
    v_strides = (1, 0, 0) if v.v_blocks else (vd.stride(2), vd.stride(0), vd.stride(1))
    # heaviest sequences (Sq * Sk) first, on the device (no host sync): a long sequence scheduled last would leave
    # the rest of the GPU idle while its q-blocks finish
    slots = varlen_slots(q.cu_data, k.cu_data, k.cu_exp, v.cu_data)
    fast_launcher(_attn_fwd_kernel)[(n_m * B * Hq,)](
        qd, kd, vd, qe, ke, ve, out, lse,
        0, qd.stride(0), qd.stride(1), qd.stride(2),
        0, kd.stride(0), kd.stride(1), kd.stride(2),
        0, *v_strides,
        0, qe.stride(0), qe.stride(1),
        0, ke.stride(0), ke.stride(1),
        ve.stride(0), ve.stride(1), ve.stride(2),
        0, out.stride(0), out.stride(1), out.stride(2),
        0, lse.stride(0), lse.stride(1),
        Hq, q.max_seqlen, k.max_seqlen, Hq // Hkv, softmax_scale * LOG2E,
        slots,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, EXPLICIT_ROUND=INTERPRETER,
        VARLEN=True, V_BLOCKS=v.v_blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
