"""MXFP8 attention backward for Hopper in Triton ``tl``: the five products in plain FP8, MX scales folded.

Operands (``formats.RowScaledFP8``, DESIGN §1 table and §3), all (B, S, H, D) logical shape:

  product          operands (orientation)           exponents and where they go
  S  = Q Kᵀ        q (hdim), k (hdim)               q per 128 queries (or per row), k per 128 keys -> S's scale
  dV = Pᵀ dO       P e4m3 x 2^-8, dout_seq (seq)    dO per (head, channel) -> dV's epilogue
  dP = dO Vᵀ       dout_hdim (hdim), v_hdim (hdim)  dO per 128 queries, V per 128 keys -> dP's scale
  dK = dSᵀ Q       dS e4m3 (see below), q_seq (seq) dS per tile -> dK accumulator, Q per (head, channel) -> epilogue
  dQ = dS K        dS e4m3 (see below), k_seq (seq) dS per tile -> dQ tile, K per channel -> epilogue

seq operands are channel-major (the (B, S, H, D) view of a (B, H, D, S_pad) buffer), so that the contraction
dim (the sequence) is contiguous, as FP8 wgmma needs for its shared-memory operands.

Structure (FlashAttention-2): a preprocess computes ``delta = rowsum(dO ∘ O)`` from the hdim-quantized dO (the
dO of dP, so that each row of dS sums to zero as the gradient of that dO does) and quantizes dO both ways.
The main kernel runs one program per BLOCK_N keys of one (b, kv head); it loops over the query heads of the GQA
group and over query tiles, recomputes ``Sᵀ = K Qᵀ`` (keys on rows, so Pᵀ and dSᵀ are ready as the register
A operand of dV and dK), P = exp2(S·log2e·scale − lse·log2e) times 256, and accumulates dV and dK in registers.
dQ is either added per (kv tile, q tile) with fp32 atomics from the same program (default), or, with
``deterministic=True``, computed by a second kernel that loops over the kv tiles of one query tile (S, P, dP
and dS recomputed: 8 products instead of 5, no float atomics, bit-identical over runs).

dS quantization (docs/perf-notes-attn-bwd.md has the measurements): one RCEIL power of two per (keys x queries)
tile, one e4m3 cast for both products.  The dK accumulator is kept in units of the current exponent and rescaled by
2^(e_old − e_new) (exact) when it changes, like the online softmax rescales O; with hysteresis (``_sticky_exp``)
that is a skipped branch on most tiles.  The atomic dQ tile is multiplied by 2^e before its add; the deterministic
dQ kernel keeps its accumulator like dK, along the kv tiles.  Because e4m3 rounding is relative, the block size of
a power-of-two scale only matters for elements that fall to subnormals: this scheme and the reference's MX blocks
of 32 give gradients that agree to ~100 dB, i.e. the same dS.  ``BwdConfig(ds_tile_scale=False)`` uses one scale
per key and query tile (a quad-shuffle row reduction of the dSᵀ tile, no hysteresis, dK rescaled per row every tile;
the rule of the Gluon dK/dV kernel's ``ds_exp="key"``, whose twin it is) for dK instead, and a separate per-tile
cast for dQ; ``reference.attention_backward(..., ds_q_block=block_m)`` emulates it.

P·256 is at most 256 (P <= 1): e4m3 without saturation, the constant 2^-8 folds into dV's epilogue.  dS is also
computed from the fp32 P·256 (as the reference, which keeps P unrounded for dS); its 256 folds into dK and dQ.

Causal masks are aligned bottom-right (query i sees key j iff j <= i + Sk − Sq).  Rows that see nothing
(lse = −inf) get P = 0: the additive term of the exponent is set to −inf there, never −inf − (−inf).

Jagged batches (``VARLEN``, launcher ``attn_bwd_hopper_varlen``, operands ``kernels.varlen.varlen_bwd_operands``) run
the same three kernels: each program reads its sequence's offsets (``CU_*``), moves its base pointers there, sets
``Sq``, ``Sk`` to the sequence's lengths and exits when its tile is past them; the rest is the dense code at batch 0.
The dense launches pass None for the offsets (constexpr), so the dense kernels compile to the same code as before
(TTGIR and PTX compared for sm90: docs/perf-notes-varlen.md).  On Hopper the
jagged backward takes the Gluon kernels' jagged mode by default ("auto", ``varlen_backward_kernel``); these ``tl``
kernels run it elsewhere and for operands the Gluon kernels do not take.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from mxattn.formats import RowScaledFP8
from mxattn.kernels.launch import BoundLaunch, cdiv, fast_launcher, tensor_sig
from mxattn.kernels.quantize import _round_to_e4m3_grid, row_scaled_triton, row_scaled_triton_both

__all__ = [
    "BwdConfig", "backward_kernel", "default_config", "DO_EXP_GROUP", "Q_EXP_GROUP", "attn_bwd_hopper", "attn_bwd_preprocess",
    "attn_bwd_hopper_varlen", "attn_bwd_preprocess_varlen", "bench_attn_bwd", "varlen_backward_kernel",
]

LOG2E = 1.4426950408889634
P_SCALE_LOG2 = 8  # P enters dV as e4m3(P * 2^8)
DS_HYSTERESIS = 2  # binades a dS tile may sit below its accumulator's exponent before the exponent follows it
EXP_GROUP = 128  # keys sharing one exponent in k and v_hdim (formats.RowScaledFP8 K layout)
DO_EXP_GROUP = 128  # query rows sharing one exponent in the hdim dO made here (a multiple of every BLOCK_M)
Q_EXP_GROUP = 128  # the same for the q operand the caller should pass (row_scaled_triton(q, "k", k_group=128))


# ----------------------------------------------------------------------------------------------
# Tile choices (one spot)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the dK/dV kernel (``block_m`` queries x ``block_n`` keys per step) and of the deterministic dQ
    kernel (``dq_block_m`` x ``dq_block_n``).  block_n and dq_block_n must divide 128 (the exponent group of K
    and V); block_m and dq_block_m should divide the row group of q and dO (128), else per-row exponents are
    used (correct, slower)."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 2
    ds_tile_scale: bool = True  # one dS scale per tile; False: per key and q tile for dK (module docstring)
    # dQ from the second kernel (the deterministic path) even when atomics are allowed: faster for some shapes
    dq_kernel: bool = False


def default_config(head_dim: int, causal: bool, group: int = 1) -> BwdConfig:
    """Tiles chosen from ptxas register reports of the sm_90a build with triton 3.6 (docs/perf-notes-attn-bwd.md),
    to be confirmed by GPU sweeps (``bench_attn_bwd``):

    * dK/dV: 128 keys x 64 queries, 8 warps.  Sᵀ = K Qᵀ puts the keys on the MMA's M dim, so the two warpgroups
      split 128 rows (no duplicated work) and Pᵀ, dSᵀ are the register A operand of dV, dK with no transpose.
      The dK, dV fp32 accumulators take 128 registers a thread at D=128; BM=64 keeps Sᵀ, dPᵀ, dSᵀ at 32 each.
      BM=32 spills less but issues ~1.5x the instructions per score; 4 warps x 64 keys spills more.
    * dQ (deterministic): 128 queries x 64 keys, 8 warps, like the forward: 201 registers, no spills.  64 rows
      with 8 warps would make Triton give both warpgroups the same 64 rows (twice the exp2 and MMA work).
    * ``dq_kernel`` (``group`` = Hq / Hkv): measured on the H200 (``attn_bwd_kernels`` results, B2 H16 S8k d128,
      same run), the separate dQ kernel beats fp32 atomics at d128 when not causal (9.6 vs 12.1 ms) and with GQA
      (Hkv 2, causal: 6.0 vs 8.1 ms), loses when causal without GQA (6.6 vs 5.4 ms) and at d64 (B8 S2k: 2.2 vs
      1.9 ms).  Every dq_kernel path is the one the deterministic GPU tests run.
    """
    return BwdConfig(dq_kernel=head_dim == 128 and (not causal or group > 1))


INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
BWD_KERNELS = ("auto", "tl", "gluon")


@functools.lru_cache(maxsize=None)
def _gluon_runs_on(device_index: int) -> bool:
    """Hopper (sm_90) and a Triton with Gluon's Hopper module on which the Gluon kernels were verified
    (``kernels.gluon_verified``): where the automatic choice takes the Gluon backward kernels."""
    from mxattn.kernels import gluon_verified

    if torch.cuda.get_device_capability(device_index) != (9, 0) or not gluon_verified():
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def backward_kernel(device: Optional[torch.device] = None) -> str:
    """The dense backward's kernels on ``device``: ``MXATTN_BWD_KERNEL`` = "auto" (default), "tl" or "gluon".

    "gluon": the warp-specialized kernels of attn_bwd_dkdv_gluon.py and attn_bwd_dq_gluon.py (deterministic, no
    atomics; 1.20-1.28x the tl dQ kernel and 1.25-1.65x the tl dK/dV kernel at B2 H16 S8k d128 on the H200,
    benchmarks/results/attn_bwd_kernels-*-s4*.json).  "auto" takes them on a Hopper GPU when Triton has Gluon (a
    version they were verified on, ``kernels.GLUON_VERIFIED_TRITON``), and
    ``attn_bwd_hopper`` falls back to "tl" for operands they do not take; an explicit "gluon" raises there
    instead.  Read at each call; an explicit ``config`` keeps the ``tl`` kernels."""
    choice = os.environ.get("MXATTN_BWD_KERNEL", "auto")
    if choice not in BWD_KERNELS:
        raise ValueError(f"MXATTN_BWD_KERNEL must be one of {', '.join(BWD_KERNELS)}, got {choice!r}")
    if choice != "auto":
        return choice
    on_gpu = device is not None and device.type == "cuda" and not INTERPRETER
    return "gluon" if on_gpu and _gluon_runs_on(device.index if device.index is not None else 0) else "tl"


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pow2(e):
    """Exact fp32 2^e for int32 e, clamped to [-126, 127]."""
    e = tl.minimum(tl.maximum(e, -126), 127)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rceil_exp(amax, keep):
    """Smallest e with amax * 2^-e <= 448 (RCEIL, as formats.mx_block_exponents), clamped to [-126, 126];
    ``keep`` where amax is 0 (nothing to scale: the previous exponent stays and no rescale happens)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - (127 + 8) + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    return tl.where(amax > 0.0, e, keep)


@triton.jit
def _row_exp(E, b64, h, s_eb, s_et, s_eh, start_m, offs_m, row_ok, GROUP: tl.constexpr):
    """Exponents of query rows: a vector (one per row, GROUP == 1) or the tile's scalar (its rows share one
    exponent group of GROUP >= BLOCK_M rows: the backward's Q and dO layouts, which need no per-query vector
    in registers)."""
    if GROUP == 1:
        e = tl.load(E + b64 * s_eb + h * s_eh + offs_m.to(tl.int64) * s_et, mask=row_ok, other=0)
    else:
        e = tl.load(E + b64 * s_eb + h * s_eh + (start_m // GROUP) * s_et)
    return e


@triton.jit
def _sticky_exp(e_tile, e_prev):
    """The exponent a tile is quantized with, given the tile's own RCEIL exponent and the one the accumulator
    is in: keep ``e_prev`` unless the tile needs more (would saturate) or is DS_HYSTERESIS binades smaller.  The
    accumulator then rarely needs rescaling; the cost is at most DS_HYSTERESIS binades of e4m3's 17 (normal and
    subnormal) at the bottom of the tile's range."""
    keep = (e_tile <= e_prev) & (e_tile >= e_prev - 2)
    return tl.where(keep, e_prev, e_tile)


@triton.jit
def _bounded_exp(e, e_hi):
    """``e`` raised to at least ``e_hi - 64``, where ``e_hi`` is the largest exponent the accumulator has been in.
    Each downward move rescales the fp32 accumulator by 2^(e_old - e_new); bounding the total drop keeps it finite
    (its magnitude in units of 2^e is below ~2^31 at e_hi, so below ~2^95 after the drop), and a tile more than
    64 binades below what the accumulator already holds is under its fp32 resolution anyway (its dS flush to 0)."""
    return tl.maximum(e, e_hi - 64)


@triton.jit
def _to_e4m3(x, EXPLICIT_ROUND: tl.constexpr):
    """fp32 (|x| <= 448) to e4m3, nearest even.  The interpreter's cast mis-rounds (DESIGN §5), so it rounds
    in fp32 first; on the GPU the cast is one cvt.rn.satfinite."""
    if EXPLICIT_ROUND:
        x = _round_to_e4m3_grid(x)
    return x.to(tl.float8e4nv)


# ----------------------------------------------------------------------------------------------
# Preprocess: delta = rowsum(dO * O)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _delta_kernel(
    DO, DOE, O, DELTA,
    s_dob, s_dos, s_doh, s_dod,
    s_deb, s_des, s_deh,
    s_ob, s_os, s_oh, s_od,
    s_lb, s_lh, s_ls,
    Sq, Hq, n_rows,
    CU_Q, CU_DOE,  # varlen: (B + 1) int32 offsets of the q rows and of dO's exponent rows
    # dense, when the Gluon dK/dV kernel follows: its step rows (``attn_bwd_dkdv_gluon._step_rows``) written here
    # from the same δ and the forward's lse (None: not written); BROW / NDL are (B, Hq, COLS) fp32, contiguous;
    # programs from n_main on write their columns past Sq
    LSE_R, BROW, NDL, s_rlb, s_rlh, s_rls, COLS, n_main,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, DO_GROUP: tl.constexpr, VARLEN: tl.constexpr = False,
    CU_DCOL=None,  # varlen: sequence b's delta at columns CU_DCOL[b] + s (a padded layout) instead of q rows
    LSE=None,  # varlen with CU_DCOL: the packed lse (Hq, Tq) (head stride s_lseh, unit row stride), copied into
    LSE_PAD=None,  # the padded layout of DELTA (same strides): the jagged dK/dV kernel's TMA boxes need aligned starts
    s_lseh=0,
):
    """One program per BLOCK_R rows of the flattened (B, Sq, Hq): delta = 2^e * sum_d dO8 * O (fp32), e the
    exponent of the row's group of DO_GROUP rows.  VARLEN: one program per BLOCK_R rows of one sequence's
    flattened (len_q, Hq) (``Sq`` = max_seqlen_q, ``n_rows`` = cdiv(Sq * Hq, BLOCK_R) programs per sequence)."""
    if VARLEN:
        b = tl.program_id(0) // n_rows
        q_start = tl.load(CU_Q + b)
        len_q = tl.load(CU_Q + b + 1) - q_start
        r = (tl.program_id(0) % n_rows) * BLOCK_R + tl.arange(0, BLOCK_R)
        if (tl.program_id(0) % n_rows) * BLOCK_R >= len_q * Hq:
            return
        ok = r < len_q * Hq
        h = (r % Hq).to(tl.int64)
        s = r // Hq
        q_start = q_start.to(tl.int64)
        DO += q_start * s_dos
        O += q_start * s_os
        if CU_DCOL is None:
            DELTA += q_start * s_ls
        else:
            dcol = tl.load(CU_DCOL + b).to(tl.int64) * s_ls
            DELTA += dcol
            if LSE is not None:
                LSE += q_start
                LSE_PAD += dcol
        DOE += tl.load(CU_DOE + b).to(tl.int64) * s_des
        b = 0
    else:
        if BROW is not None:
            if tl.program_id(0) >= n_main:  # the step rows past Sq: b = −inf (P = 0), −δ = +0
                pad = COLS - Sq
                i = (tl.program_id(0) - n_main).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
                at = (i // pad) * COLS + Sq + i % pad
                keep = i < (n_rows // Sq).to(tl.int64) * pad  # n_rows // Sq = B * Hq
                tl.store(BROW + at, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=keep)
                tl.store(NDL + at, tl.zeros([BLOCK_R], tl.float32), mask=keep)
                return
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = r < n_rows
        h = r % Hq
        s = (r // Hq) % Sq
        b = (r // (Hq * Sq)).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    do = tl.load(DO + (b * s_dob + s * s_dos + h * s_doh)[:, None] + d[None, :] * s_dod, mask=ok[:, None], other=0.0)
    o = tl.load(O + (b * s_ob + s * s_os + h * s_oh)[:, None] + d[None, :] * s_od, mask=ok[:, None], other=0.0)
    e = tl.load(DOE + b * s_deb + (s // DO_GROUP) * s_des + h * s_deh, mask=ok, other=0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1) * _pow2(e)
    tl.store(DELTA + b * s_lb + h * s_lh + s * s_ls, delta, mask=ok)
    if BROW is not None:  # as ``_step_rows_kernel`` computes them, from the δ just stored
        lse = tl.load(LSE_R + b * s_rlb + h * s_rlh + s * s_rls, mask=ok, other=0.0)
        at = (b * Hq + h) * COLS + s
        tl.store(BROW + at, tl.where(lse == float("-inf"), float("-inf"), tl.fma(lse, -1.4426950408889634, 8.0)),
                 mask=ok)
        tl.store(NDL + at, -delta, mask=ok)
    if LSE is not None:
        tl.store(LSE_PAD + h * s_lh + s * s_ls, tl.load(LSE + h * s_lseh + s, mask=ok), mask=ok)


# ----------------------------------------------------------------------------------------------
# dK / dV (and atomic dQ): one program per BLOCK_N keys of one (b, kv head)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _kv_step(
    dk, dv, dk_e, dk_hi, k8, vh8, ks8, ke, ve, offs_n, start_m, h, b64, Sq, Sk, causal_off, qk_scale, dq_colscale,
    lim_qs, lim_dos, Q, QE, QS, DOH, DOE, DOS, LSE, DELTA, DQ,
    s_qb, s_qm, s_qh, s_qd, s_qeb, s_qem, s_qeh,
    s_qsb, s_qsm, s_qsh, s_qsd,
    s_dob, s_dom, s_doh, s_dod, s_deb, s_dem, s_deh,
    s_dsb, s_dsm, s_dsh, s_dsd,
    s_lb, s_lh, s_lm,
    s_dqb, s_dqm, s_dqh, s_dqd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DS_TILE_SCALE: tl.constexpr,
    Q_GROUP: tl.constexpr, DO_GROUP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
):
    """One query tile against the program's keys: dV += Pᵀ dO, dK += dSᵀ Q (dK rescaled to the new dS
    exponents), and dQ += dS K by atomics when ATOMIC_DQ.  ``ke``, ``ve``: the tile's K and V exponents."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    om64 = offs_m.to(tl.int64)
    # query-side tiles: Qᵀ and dOᵀ (D, BM) from hdim rows (D contiguous); Q and dO seq (BM, D) channel-major
    qT = tl.load(Q + b64 * s_qb + h * s_qh + offs_d[:, None] * s_qd + om64[None, :] * s_qm,
                 mask=row_ok[None, :], other=0.0)
    qe = _row_exp(QE, b64, h, s_qeb, s_qem, s_qeh, start_m, offs_m, row_ok, Q_GROUP)
    lse = tl.load(LSE + b64 * s_lb + h * s_lh + om64 * s_lm, mask=row_ok, other=float("-inf"))
    # exponent of p*256: s*log2e*scale - lse*log2e + 8; rows that see nothing (lse = -inf) and rows past Sq get -inf
    a_q = qk_scale * _pow2(qe + ke)
    b_row = tl.where(lse == float("-inf"), float("-inf"), 8.0 - lse * 1.4426950408889634)
    sT = tl.dot(k8, qT)  # (BN, BM) fp32
    if Q_GROUP == 1:
        sT = sT * a_q[None, :] + b_row[None, :]
    else:
        sT = sT * a_q + b_row[None, :]
    if MASKED:
        keep = offs_n[:, None] < Sk
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_off)
        sT = tl.where(keep, sT, float("-inf"))
    pT = tl.exp2(sT)  # P * 256 <= 256 (up to the forward's lse rounding), 0 where masked
    p8 = _to_e4m3(pT, EXPLICIT_ROUND)
    dos = tl.load(DOS + b64 * s_dsb + h * s_dsh + om64[:, None] * s_dsm + offs_d[None, :] * s_dsd,
                  mask=(offs_m < lim_dos)[:, None], other=0.0)
    dv = tl.dot(p8, dos, dv)
    doT = tl.load(DOH + b64 * s_dob + h * s_doh + offs_d[:, None] * s_dod + om64[None, :] * s_dom,
                  mask=row_ok[None, :], other=0.0)
    doe = _row_exp(DOE, b64, h, s_deb, s_dem, s_deh, start_m, offs_m, row_ok, DO_GROUP)
    delta = tl.load(DELTA + b64 * s_lb + h * s_lh + om64 * s_lm, mask=row_ok, other=0.0)
    dpT = tl.dot(vh8, doT)  # (BN, BM) fp32, in units 2^-(doe + ve)
    if DO_GROUP == 1:
        dsT = pT * (dpT * _pow2(doe + ve)[None, :] - delta[None, :])  # 256 * dS
    else:
        dsT = pT * (dpT * _pow2(doe + ve) - delta[None, :])

    qs = tl.load(QS + b64 * s_qsb + h * s_qsh + om64[:, None] * s_qsm + offs_d[None, :] * s_qsd,
                 mask=(offs_m < lim_qs)[:, None], other=0.0)
    absds = tl.abs(dsT)
    if DS_TILE_SCALE:  # one scale for the tile (with hysteresis), one cast for both products
        e_k = _bounded_exp(_sticky_exp(_rceil_exp(tl.max(tl.max(absds, 1), 0), dk_e), dk_e), dk_hi)
        dk_hi = tl.maximum(dk_hi, e_k)
        dsk8 = _to_e4m3(dsT * _pow2(-e_k), EXPLICIT_ROUND)
        if e_k != dk_e:  # rare: dK is rescaled only when the tile's exponent leaves the hysteresis window
            dk = dk * _pow2(dk_e - e_k)
        dk = tl.dot(dsk8, qs, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dsk8), ks8)  # (BM, D)
            dq = dq * (dq_colscale * _pow2(e_k))[None, :]
    else:  # dK: one scale per key (rows of dSᵀ: a quad-shuffle reduction); dQ: one per tile
        amax_k = tl.max(absds, 1)
        e_k = _bounded_exp(_rceil_exp(amax_k, dk_e), dk_hi)
        # a key whose dS is all zero in this tile leaves its bound (and, by _rceil_exp's keep, its exponent): the
        # Gluon twin's split build visits such tiles (causal, before a warpgroup's keys) where this kernel with
        # 64-key blocks does not, and both must see the same exponent sequence
        dk_hi = tl.where(amax_k > 0.0, tl.maximum(dk_hi, e_k), dk_hi)
        dsk8 = _to_e4m3(dsT * _pow2(-e_k)[:, None], EXPLICIT_ROUND)
        dk = dk * _pow2(dk_e - e_k)[:, None]
        dk = tl.dot(dsk8, qs, dk)
        if ATOMIC_DQ:
            e_q = _rceil_exp(tl.max(amax_k, 0), 0)
            dsq8 = _to_e4m3(dsT * _pow2(-e_q), EXPLICIT_ROUND)
            dq = tl.dot(tl.trans(dsq8), ks8)  # (BM, D)
            dq = dq * (dq_colscale * _pow2(e_q))[None, :]
    dk_e = e_k
    if ATOMIC_DQ:
        dq_ptrs = DQ + b64 * s_dqb + h * s_dqh + om64[:, None] * s_dqm + offs_d[None, :] * s_dqd
        tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv, dk_e, dk_hi


@triton.jit
def _bwd_dkdv_kernel(
    Q, QE, K, KE, VH, VE, QS, QSE, KS, KSE, DOH, DOE, DOS, DOSE, LSE, DELTA, DQ, DK, DV,
    s_qb, s_qm, s_qh, s_qd, s_qeb, s_qem, s_qeh,
    s_kb, s_kn, s_kh, s_kd, s_keb, s_ket, s_keh,
    s_vb, s_vn, s_vh, s_vd, s_veb, s_vet, s_veh,
    s_qsb, s_qsm, s_qsh, s_qsd, s_qseb, s_qseh, s_qsed,
    s_ksb, s_ksn, s_ksh, s_ksd, s_kseb, s_kseh, s_ksed,
    s_dob, s_dom, s_doh, s_dod, s_deb, s_dem, s_deh,
    s_dsb, s_dsm, s_dsh, s_dsd, s_dseb, s_dseh, s_dsed,
    s_lb, s_lh, s_lm,
    s_dqb, s_dqm, s_dqh, s_dqd,
    s_dkb, s_dkn, s_dkh, s_dkd,
    s_dvb, s_dvn, s_dvh, s_dvd,
    Hkv, Sq, Sk, group_size, qk_scale, grad_scale, lim_qs, lim_dos,
    CU_Q, CU_K, CU_QE, CU_DOE, CU_KG, CU_QV, CU_KV,  # varlen offsets (attn_bwd_hopper_varlen); None when dense
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DS_TILE_SCALE: tl.constexpr, Q_GROUP: tl.constexpr, DO_GROUP: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, VARLEN: tl.constexpr = False,
):
    # program order: kv tiles fastest within one (b, kv head), so the heaviest causal tiles (first keys) start
    # first and neighbouring programs stream the same query-side tiles through L2
    if VARLEN:  # 1-D grid: cdiv(max_seqlen_k, BLOCK_N) kv tiles (fastest) x B x Hkv
        n_n = tl.cdiv(Sk, BLOCK_N)
        start_n = (tl.program_id(0) % n_n) * BLOCK_N
        pid_bh = tl.program_id(0) // n_n
    else:
        start_n = tl.program_id(0) * BLOCK_N
        pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    b64 = b.to(tl.int64)
    if VARLEN:
        # sequence b: keys CU_K[b]:CU_K[b+1] and queries CU_Q[b]:CU_Q[b+1] of the packed tensors; exponent rows of
        # the grouped hdim operands from CU_QE (q), CU_DOE (dO), CU_KG (k, v_hdim); columns of the channel-major
        # seq operands from CU_QV (q_seq, dO_seq) and CU_KV (k_seq), per-channel exponents row b.  The base
        # pointers move to the sequence, after which the code is the dense code with batch 0.
        k_start = tl.load(CU_K + b)
        Sk = tl.load(CU_K + b + 1) - k_start
        if start_n >= Sk:
            return
        q_start = tl.load(CU_Q + b)
        Sq = tl.load(CU_Q + b + 1) - q_start
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
        Q += q_start * s_qm
        DOH += q_start * s_dom
        DQ += q_start * s_dqm
        LSE += q_start * s_lm
        DELTA += q_start * s_lm
        QE += tl.load(CU_QE + b).to(tl.int64) * s_qem
        DOE += tl.load(CU_DOE + b).to(tl.int64) * s_dem
        K += k_start * s_kn
        VH += k_start * s_vn
        DK += k_start * s_dkn
        DV += k_start * s_dvn
        kg = tl.load(CU_KG + b).to(tl.int64)
        KE += kg * s_ket
        VE += kg * s_vet
        qv = tl.multiple_of(tl.load(CU_QV + b), 16).to(tl.int64)
        QS += qv * s_qsm
        DOS += qv * s_dsm
        KS += tl.multiple_of(tl.load(CU_KV + b), 16).to(tl.int64) * s_ksn
        QSE += b64 * s_qseb
        DOSE += b64 * s_dseb
        KSE += b64 * s_kseb
        b64 = 0
        hk = hk.to(tl.int64)  # head offsets of the channel-major operands and of lse grow with the whole batch
        lim_qs = (Sq + 15) // 16 * 16  # seq columns of a sequence are zero-padded to 16 (kernels/varlen.py)
        lim_dos = lim_qs
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    on64 = offs_n.to(tl.int64)
    key_ok = offs_n < Sk

    k8 = tl.load(K + b64 * s_kb + hk * s_kh + on64[:, None] * s_kn + offs_d[None, :] * s_kd,
                 mask=key_ok[:, None], other=0.0)
    vh8 = tl.load(VH + b64 * s_vb + hk * s_vh + on64[:, None] * s_vn + offs_d[None, :] * s_vd,
                  mask=key_ok[:, None], other=0.0)
    ke = tl.load(KE + b64 * s_keb + hk * s_keh + (start_n // 128) * s_ket)
    ve = tl.load(VE + b64 * s_veb + hk * s_veh + (start_n // 128) * s_vet)
    if ATOMIC_DQ:
        ks8 = tl.load(KS + b64 * s_ksb + hk * s_ksh + on64[:, None] * s_ksn + offs_d[None, :] * s_ksd,
                      mask=key_ok[:, None], other=0.0)
        kse = tl.load(KSE + b64 * s_kseb + hk * s_kseh + offs_d * s_ksed)
        dq_colscale = _pow2(kse) * grad_scale
    else:
        ks8 = k8  # unused
        dq_colscale = tl.zeros([HEAD_DIM], tl.float32)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if DS_TILE_SCALE:
        dk_e = 0
        dk_hi = -1000  # no bound until the accumulator holds something (_bounded_exp)
    else:
        dk_e = tl.zeros([BLOCK_N], tl.int32)
        dk_hi = tl.full([BLOCK_N], -1000, tl.int32)

    causal_off = Sk - Sq
    m_end = tl.cdiv(Sq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (tl.maximum(start_n - causal_off, 0) // BLOCK_M) * BLOCK_M
        # from mid on, every row of a q tile sees all BLOCK_N keys
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    if start_n + BLOCK_N > Sk:
        mid = m_end  # a partial kv tile masks its missing keys everywhere
    lo = tl.minimum(lo, m_end)
    mid = tl.minimum(tl.maximum(mid, lo), m_end)

    # the exponents of the seq operands are per (query head, channel): dK and dV are kept in units of the current
    # head's exponents and rescaled (exactly, by powers of two) when the head changes
    h0 = hk * group_size
    qse_prev = tl.load(QSE + b64 * s_qseb + h0 * s_qseh + offs_d * s_qsed)
    dose_prev = tl.load(DOSE + b64 * s_dseb + h0 * s_dseh + offs_d * s_dsed)
    for h in range(h0, h0 + group_size):
        qse = tl.load(QSE + b64 * s_qseb + h * s_qseh + offs_d * s_qsed)
        dose = tl.load(DOSE + b64 * s_dseb + h * s_dseh + offs_d * s_dsed)
        dk = dk * _pow2(qse_prev - qse)[None, :]
        dv = dv * _pow2(dose_prev - dose)[None, :]
        qse_prev = qse
        dose_prev = dose
        for start_m in range(lo, mid, BLOCK_M):
            dk, dv, dk_e, dk_hi = _kv_step(
                dk, dv, dk_e, dk_hi, k8, vh8, ks8, ke, ve, offs_n, start_m, h, b64, Sq, Sk, causal_off, qk_scale,
                dq_colscale, lim_qs, lim_dos, Q, QE, QS, DOH, DOE, DOS, LSE, DELTA, DQ,
                s_qb, s_qm, s_qh, s_qd, s_qeb, s_qem, s_qeh, s_qsb, s_qsm, s_qsh, s_qsd,
                s_dob, s_dom, s_doh, s_dod, s_deb, s_dem, s_deh, s_dsb, s_dsm, s_dsh, s_dsd,
                s_lb, s_lh, s_lm, s_dqb, s_dqm, s_dqh, s_dqd,
                HEAD_DIM, BLOCK_M, BLOCK_N, True, CAUSAL, ATOMIC_DQ, DS_TILE_SCALE, Q_GROUP, DO_GROUP,
                EXPLICIT_ROUND,
            )
        for start_m in range(mid, m_end, BLOCK_M):
            dk, dv, dk_e, dk_hi = _kv_step(
                dk, dv, dk_e, dk_hi, k8, vh8, ks8, ke, ve, offs_n, start_m, h, b64, Sq, Sk, causal_off, qk_scale,
                dq_colscale, lim_qs, lim_dos, Q, QE, QS, DOH, DOE, DOS, LSE, DELTA, DQ,
                s_qb, s_qm, s_qh, s_qd, s_qeb, s_qem, s_qeh, s_qsb, s_qsm, s_qsh, s_qsd,
                s_dob, s_dom, s_doh, s_dod, s_deb, s_dem, s_deh, s_dsb, s_dsm, s_dsh, s_dsd,
                s_lb, s_lh, s_lm, s_dqb, s_dqm, s_dqh, s_dqd,
                HEAD_DIM, BLOCK_M, BLOCK_N, False, CAUSAL, ATOMIC_DQ, DS_TILE_SCALE, Q_GROUP, DO_GROUP,
                EXPLICIT_ROUND,
            )

    if DS_TILE_SCALE:
        dk = dk * (_pow2(qse_prev) * (grad_scale * _pow2(dk_e)))[None, :]
    else:
        dk = dk * _pow2(dk_e)[:, None] * (_pow2(qse_prev) * grad_scale)[None, :]
    dv = dv * (_pow2(dose_prev) * 0.00390625)[None, :]  # 2^-8: P entered as P * 256
    tl.store(DK + b64 * s_dkb + hk * s_dkh + on64[:, None] * s_dkn + offs_d[None, :] * s_dkd,
             dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + b64 * s_dvb + hk * s_dvh + on64[:, None] * s_dvn + offs_d[None, :] * s_dvd,
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Deterministic dQ: one program per BLOCK_M queries of one (b, query head), looping over kv tiles
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dq_step(
    acc, acc_e, acc_hi, q8, do8, a_row, b_row, dscale_row, delta, offs_m, start_n, hk, b64, Sk, causal_off, lim_ks,
    K, KE, VH, VE, KS,
    s_kb, s_kn, s_kh, s_kd, s_keb, s_ket, s_keh,
    s_vb, s_vn, s_vh, s_vd, s_veb, s_vet, s_veh,
    s_ksb, s_ksn, s_ksh, s_ksd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    Q_GROUP: tl.constexpr, DO_GROUP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    on64 = offs_n.to(tl.int64)
    if MASKED:
        key_ok = offs_n < Sk
        kT = tl.load(K + b64 * s_kb + hk * s_kh + offs_d[:, None] * s_kd + on64[None, :] * s_kn,
                     mask=key_ok[None, :], other=0.0)
        vT = tl.load(VH + b64 * s_vb + hk * s_vh + offs_d[:, None] * s_vd + on64[None, :] * s_vn,
                     mask=key_ok[None, :], other=0.0)
        ks8 = tl.load(KS + b64 * s_ksb + hk * s_ksh + on64[:, None] * s_ksn + offs_d[None, :] * s_ksd,
                      mask=(offs_n < lim_ks)[:, None], other=0.0)
    else:
        kT = tl.load(K + b64 * s_kb + hk * s_kh + offs_d[:, None] * s_kd + on64[None, :] * s_kn)
        vT = tl.load(VH + b64 * s_vb + hk * s_vh + offs_d[:, None] * s_vd + on64[None, :] * s_vn)
        ks8 = tl.load(KS + b64 * s_ksb + hk * s_ksh + on64[:, None] * s_ksn + offs_d[None, :] * s_ksd)
    ke = tl.load(KE + b64 * s_keb + hk * s_keh + (start_n // 128) * s_ket)
    ve = tl.load(VE + b64 * s_veb + hk * s_veh + (start_n // 128) * s_vet)
    s = tl.dot(q8, kT)  # (BM, BN)
    if Q_GROUP == 1:
        s = s * (a_row * _pow2(ke))[:, None] + b_row[:, None]
    else:
        s = s * (a_row * _pow2(ke)) + b_row[:, None]
    if MASKED:
        keep = offs_n[None, :] < Sk
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        s = tl.where(keep, s, float("-inf"))
    p = tl.exp2(s)  # P * 256
    dp = tl.dot(do8, vT)
    if DO_GROUP == 1:
        ds = p * (dp * (dscale_row * _pow2(ve))[:, None] - delta[:, None])  # 256 * dS
    else:
        ds = p * (dp * (dscale_row * _pow2(ve)) - delta[:, None])
    # one scale per tile with hysteresis (the atomic path's scheme, here along the kv tiles of one query tile)
    e_new = _bounded_exp(_sticky_exp(_rceil_exp(tl.max(tl.max(tl.abs(ds), 1), 0), acc_e), acc_e), acc_hi)
    ds8 = _to_e4m3(ds * _pow2(-e_new), EXPLICIT_ROUND)
    if e_new != acc_e:
        acc = acc * _pow2(acc_e - e_new)
    acc = tl.dot(ds8, ks8, acc)
    return acc, e_new, tl.maximum(acc_hi, e_new)


@triton.jit
def _bwd_dq_kernel(
    Q, QE, K, KE, VH, VE, KS, KSE, DOH, DOE, LSE, DELTA, DQ,
    s_qb, s_qm, s_qh, s_qd, s_qeb, s_qem, s_qeh,
    s_kb, s_kn, s_kh, s_kd, s_keb, s_ket, s_keh,
    s_vb, s_vn, s_vh, s_vd, s_veb, s_vet, s_veh,
    s_ksb, s_ksn, s_ksh, s_ksd, s_kseb, s_kseh, s_ksed,
    s_dob, s_dom, s_doh, s_dod, s_deb, s_dem, s_deh,
    s_lb, s_lh, s_lm,
    s_dqb, s_dqm, s_dqh, s_dqd,
    Hq, Sq, Sk, group_size, qk_scale, grad_scale, lim_ks,
    CU_Q, CU_K, CU_QE, CU_DOE, CU_KG, CU_KV,  # varlen offsets (attn_bwd_hopper_varlen); None when dense
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    Q_GROUP: tl.constexpr, DO_GROUP: tl.constexpr, EXPLICIT_ROUND: tl.constexpr, VARLEN: tl.constexpr = False,
):
    # heaviest causal query tiles (the last ones) first
    if VARLEN:  # 1-D grid: cdiv(max_seqlen_q, BLOCK_M) q tiles (fastest) x B x Hq
        n_m = tl.cdiv(Sq, BLOCK_M)
        pid_m = n_m - 1 - tl.program_id(0) % n_m if CAUSAL else tl.program_id(0) % n_m
        pid_bh = tl.program_id(0) // n_m
    else:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group_size
    b64 = b.to(tl.int64)
    start_m = pid_m * BLOCK_M
    if VARLEN:  # sequence b's offsets, as in _bwd_dkdv_kernel
        q_start = tl.load(CU_Q + b)
        Sq = tl.load(CU_Q + b + 1) - q_start
        if start_m >= Sq:
            return
        k_start = tl.load(CU_K + b)
        Sk = tl.load(CU_K + b + 1) - k_start
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
        Q += q_start * s_qm
        DOH += q_start * s_dom
        DQ += q_start * s_dqm
        LSE += q_start * s_lm
        DELTA += q_start * s_lm
        QE += tl.load(CU_QE + b).to(tl.int64) * s_qem
        DOE += tl.load(CU_DOE + b).to(tl.int64) * s_dem
        K += k_start * s_kn
        VH += k_start * s_vn
        kg = tl.load(CU_KG + b).to(tl.int64)
        KE += kg * s_ket
        VE += kg * s_vet
        KS += tl.multiple_of(tl.load(CU_KV + b), 16).to(tl.int64) * s_ksn
        KSE += b64 * s_kseb
        b64 = 0
        h = h.to(tl.int64)
        hk = hk.to(tl.int64)
        lim_ks = (Sk + 15) // 16 * 16
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    om64 = offs_m.to(tl.int64)
    row_ok = offs_m < Sq

    q8 = tl.load(Q + b64 * s_qb + h * s_qh + om64[:, None] * s_qm + offs_d[None, :] * s_qd,
                 mask=row_ok[:, None], other=0.0)
    do8 = tl.load(DOH + b64 * s_dob + h * s_doh + om64[:, None] * s_dom + offs_d[None, :] * s_dod,
                  mask=row_ok[:, None], other=0.0)
    qe = _row_exp(QE, b64, h, s_qeb, s_qem, s_qeh, start_m, offs_m, row_ok, Q_GROUP)
    doe = _row_exp(DOE, b64, h, s_deb, s_dem, s_deh, start_m, offs_m, row_ok, DO_GROUP)
    lse = tl.load(LSE + b64 * s_lb + h * s_lh + om64 * s_lm, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + b64 * s_lb + h * s_lh + om64 * s_lm, mask=row_ok, other=0.0)
    a_row = qk_scale * _pow2(qe)  # (BM) or scalar
    b_row = tl.where(lse == float("-inf"), float("-inf"), 8.0 - lse * 1.4426950408889634)
    dscale_row = _pow2(doe)  # (BM) or scalar

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc_e = 0
    acc_hi = -1000  # no bound until the accumulator holds something (_bounded_exp)
    causal_off = Sk - Sq
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + causal_off, 0))
        full_end = tl.minimum((Sk // BLOCK_N) * BLOCK_N,
                              (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        full_end = (Sk // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, acc_e, acc_hi = _dq_step(
            acc, acc_e, acc_hi, q8, do8, a_row, b_row, dscale_row, delta, offs_m, start_n, hk, b64, Sk, causal_off, lim_ks,
            K, KE, VH, VE, KS, s_kb, s_kn, s_kh, s_kd, s_keb, s_ket, s_keh, s_vb, s_vn, s_vh, s_vd,
            s_veb, s_vet, s_veh, s_ksb, s_ksn, s_ksh, s_ksd,
            HEAD_DIM, BLOCK_N, False, CAUSAL, Q_GROUP, DO_GROUP, EXPLICIT_ROUND,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc, acc_e, acc_hi = _dq_step(
            acc, acc_e, acc_hi, q8, do8, a_row, b_row, dscale_row, delta, offs_m, start_n, hk, b64, Sk, causal_off, lim_ks,
            K, KE, VH, VE, KS, s_kb, s_kn, s_kh, s_kd, s_keb, s_ket, s_keh, s_vb, s_vn, s_vh, s_vd,
            s_veb, s_vet, s_veh, s_ksb, s_ksn, s_ksh, s_ksd,
            HEAD_DIM, BLOCK_N, True, CAUSAL, Q_GROUP, DO_GROUP, EXPLICIT_ROUND,
        )
    kse = tl.load(KSE + b64 * s_kseb + hk * s_kseh + offs_d * s_ksed)
    colscale = _pow2(kse) * grad_scale
    dq = acc * (colscale * _pow2(acc_e))[None, :]
    tl.store(DQ + b64 * s_dqb + h * s_dqh + om64[:, None] * s_dqm + offs_d[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _seq_load_bound(data: torch.Tensor) -> int:
    """How far along S a seq operand may be read: to S_pad for a channel-major view (its padding is zeros, as
    ``formats.channel_major`` and the quantize kernels write it), so that the load mask is constant over 16
    bytes along the contiguous dim and the loads pipeline as 16-byte cp.async; else S."""
    S = data.shape[1]
    pad = data.stride(3)
    if data.stride(1) == 1 and pad >= S and pad % 16 == 0:
        return pad
    return S


def _exp_strides3(e: torch.Tensor, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    st = e.stride()
    return st[dims[0]], st[dims[1]], st[dims[2]]


def _row_group(t: RowScaledFP8, name: str) -> int:
    """Rows per exponent of an hdim operand whose exponents run along the sequence: 1 (one per row, the Q
    layout) or the group of a grouped layout (the K layout: ``group_dim`` 1)."""
    B, S, H, _ = t.data.shape
    if t.group_dim is None or t.group == 1:
        want = (B, S, H, 1)
        g = 1
    else:
        if t.group_dim != 1:
            raise ValueError(f"{name}: exponents must be grouped along the sequence (group_dim=1), got {t.group_dim}")
        g = t.group
        want = (B, cdiv(S, g), H, 1)
    if t.dim != 3 or tuple(t.exp.shape) != want:
        raise ValueError(f"{name}: exp {tuple(t.exp.shape)} (dim={t.dim}), expected {want} blocked along the head dim")
    return g


def attn_bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, dout_hdim: Optional[RowScaledFP8] = None,
                        dout_seq: Optional[RowScaledFP8] = None):
    """dO in both orientations and ``delta = rowsum(dO_hdim ∘ O)`` (B, Hq, Sq) fp32.

    ``dout_hdim``: blocked along the head dim, one exponent per ``DO_EXP_GROUP`` rows by default
    (``row_scaled_triton(dout, "k", k_group=128)``; the per-row Q layout works too, slower);
    ``dout_seq``: the V layout (``row_scaled_triton(dout, "v")``, channel-major).  Either may be given (e.g. by a
    fused producer); the missing ones are made from ``dout`` here.  Returns (dout_hdim, dout_seq, delta)."""
    return _preprocess(out, dout, dout_hdim, dout_seq)[:3]  # (no lse: no step rows)


def _preprocess(out, dout, dout_hdim, dout_seq, bind: bool = False, lse: Optional[torch.Tensor] = None):
    """``attn_bwd_preprocess``: (dout_hdim, dout_seq, delta, bound, rows).  With ``bind`` also the δ launch for a
    plan: (the kernel's ``BoundLaunch``, the arguments between the four leading tensors and lse with the two
    step-row tensors, those after them), None for an empty ``out`` (nothing launched).  With ``lse`` (the forward's, for the
    dense Gluon dK/dV kernel) the same launch also writes its step rows, ``rows`` = (b, −δ) as
    ``attn_bwd_dkdv_gluon._step_rows(lse, delta)`` makes them, bit for bit (one launch less); else rows is None."""
    dout_hdim, dout_seq = _dout_operands(dout, dout_hdim, dout_seq)
    g = _row_group(dout_hdim, "dout_hdim")
    B, Sq, Hq, D = out.shape
    delta = torch.empty(B, Hq, Sq, dtype=torch.float32, device=out.device)
    bound = rows = None
    if B * Sq * Hq:
        block_r = max(1, min(128, 8192 // D))
        n_main = cdiv(B * Sq * Hq, block_r)
        tail, n_pad = (0, 0, 0, 0, n_main), 0
        if lse is not None:
            from mxattn.kernels.attn_bwd_dkdv_gluon import step_rows_empty

            rows = step_rows_empty(B, Hq, Sq, out.device)
            cols = rows[0].shape[2]
            tail, n_pad = (*lse.stride(), cols, n_main), B * Hq * (cols - Sq)
        dd, de = dout_hdim.data, dout_hdim.exp
        mid = (*dd.stride(), de.stride(0), de.stride(1), de.stride(2), *out.stride(), *delta.stride(), Sq, Hq,
               B * Sq * Hq, None, None)
        args = (dd, de, out, delta, *mid, lse, *(rows or (None, None)), *tail)
        grid = (n_main + cdiv(n_pad, block_r),)
        kwargs = dict(HEAD_DIM=D, BLOCK_R=block_r, DO_GROUP=g, num_warps=4)
        if bind:
            bound = (BoundLaunch(fast_launcher(_delta_kernel), grid, args, kwargs), mid, tail)
        else:
            fast_launcher(_delta_kernel)[grid](*args, **kwargs)
    return dout_hdim, dout_seq, delta, bound, rows


def _dout_operands(dout: torch.Tensor, dout_hdim: Optional[RowScaledFP8], dout_seq: Optional[RowScaledFP8]):
    """``attn_bwd_preprocess``'s dO operands: the given ones, the missing ones made from ``dout``."""
    if dout_hdim is None and dout_seq is None:
        return row_scaled_triton_both(dout, k_group=DO_EXP_GROUP)  # one read of dO for both
    if dout_hdim is None:
        dout_hdim = row_scaled_triton(dout, "k", k_group=DO_EXP_GROUP)
    if dout_seq is None:
        dout_seq = row_scaled_triton(dout, "v")
    return dout_hdim, dout_seq


def _check_operands(q, k, v_hdim, q_seq, k_seq, out, dout, lse, cfg: BwdConfig) -> int:
    """Validate shapes and layouts; returns Q's rows per exponent."""
    for name, t in (("q", q), ("k", k), ("v_hdim", v_hdim), ("q_seq", q_seq), ("k_seq", k_seq)):
        if not isinstance(t, RowScaledFP8):
            raise TypeError(f"{name} must be a RowScaledFP8, got {type(t).__name__}")
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    for name, t, ds in (("k", k, (B, Sk, Hkv, D)), ("v_hdim", v_hdim, (B, Sk, Hkv, D)),
                        ("q_seq", q_seq, (B, Sq, Hq, D)), ("k_seq", k_seq, (B, Sk, Hkv, D))):
        if tuple(t.data.shape) != ds:
            raise ValueError(f"{name}: data {tuple(t.data.shape)}, expected {ds}")
    qg = _row_group(q, "q")
    for name, t in (("k", k), ("v_hdim", v_hdim)):
        if _row_group(t, name) != EXP_GROUP:
            raise ValueError(f"{name}: needs one exponent per {EXP_GROUP} keys (the K layout), got exp "
                             f"{tuple(t.exp.shape)}")
    for name, t in (("q_seq", q_seq), ("k_seq", k_seq)):
        want = (B, 1, t.data.shape[2], D)
        if t.dim != 1 or tuple(t.exp.shape) != want:
            raise ValueError(f"{name}: exp {tuple(t.exp.shape)} (dim={t.dim}), expected {want}: one exponent per "
                             f"channel, blocked along the sequence (the V layout)")
    if tuple(out.shape) != (B, Sq, Hq, D) or tuple(dout.shape) != (B, Sq, Hq, D):
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be {(B, Sq, Hq, D)}")
    if tuple(lse.shape) != (B, Hq, Sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {(B, Hq, Sq)}, got {lse.dtype} {tuple(lse.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {D} must be a power of two in [16, 256]")
    for bn in (cfg.block_n, cfg.dq_block_n):
        if EXP_GROUP % bn:
            raise ValueError(f"block_n={bn} must divide the exponent group {EXP_GROUP}")
    return qg


def _tile_group(g: int, cfg: BwdConfig) -> int:
    """The kernels' GROUP constexpr for query-row exponents with ``g`` rows per exponent: ``g`` when every query
    tile lies inside one group (a scalar per tile), else 1 (the per-row path; a grouped tensor is expanded)."""
    if g > 1 and g % cfg.block_m == 0 and g % cfg.dq_block_m == 0:
        return g
    return 1


def _expand_rows(t: RowScaledFP8) -> torch.Tensor:
    """Per-row int32 exponents (B, S, H, 1) of a grouped hdim operand."""
    return t.exp.repeat_interleave(t.group, dim=1)[:, : t.data.shape[1]].contiguous()


def grad_outputs(dk_out: Optional[torch.Tensor], dv_out: Optional[torch.Tensor], shape, dtype: torch.dtype,
                 device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK and dV tensors a backward launcher writes: new (B, Sk, Hkv, D) tensors, or the caller's ``dk_out`` /
    ``dv_out`` (both or neither; that shape, ``dtype``, ``device``, equal strides, D contiguous; views are fine, e.g.
    slices of one flat buffer as the ring's).  The kernels store every element, so they need no initialisation."""
    if dk_out is None and dv_out is None:
        return (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
    device = torch.device(device)
    for name, t in (("dk_out", dk_out), ("dv_out", dv_out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (give both dk_out and dv_out, or neither)")
        same_device = t.device.type == device.type and (device.index is None or t.device.index == device.index)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not same_device:
            raise ValueError(f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        if t.stride(3) != 1 or 0 in t.stride()[:3]:
            raise ValueError(f"{name} must be contiguous along the head dim with no broadcast (zero-stride) dim, got "
                             f"strides {t.stride()}")
    if dk_out.stride() != dv_out.stride():
        raise ValueError(f"dk_out and dv_out must have the same strides, got {dk_out.stride()} and {dv_out.stride()}")
    if dk_out.numel() and _overlap(dk_out, dv_out):
        raise ValueError("dk_out and dv_out must not overlap in memory (their first-to-last element spans)")
    return dk_out, dv_out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors (first to last element) intersect."""
    def span(t):
        lo = t.data_ptr()
        return lo, lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def varlen_backward_kernel(device: Optional[torch.device] = None) -> str:
    """The jagged backward's kernels on ``device``: ``MXATTN_VARLEN_BWD_KERNEL`` = "auto" (default), "tl" or
    "gluon".  "auto" follows the dense choice (``backward_kernel``, i.e. ``MXATTN_BWD_KERNEL``): the Gluon kernels'
    jagged mode on Hopper with a verified Triton, and ``attn_bwd_hopper_varlen`` falls back to the ``tl`` kernels
    for operands the Gluon kernels do not take; an explicit "gluon" raises there instead.  "tl" runs the ``tl``
    kernels (``VARLEN=True``).  Read at each call.
    The Gluon jagged mode measured 1.01x / 1.10x the dense kernel's rate on real tokens (non-causal / causal, B16 H16
    d128, mean length 2048) against the tl path's 0.59x / 0.71x (session 11, ``varlen_bwd-*-s11-lean.json``); its
    own GPU tests and those of tests/test_varlen_bwd.py pass under it (docs/perf-notes-varlen.md)."""
    choice = os.environ.get("MXATTN_VARLEN_BWD_KERNEL", "auto")
    if choice not in BWD_KERNELS:
        raise ValueError(f"MXATTN_VARLEN_BWD_KERNEL must be one of {', '.join(BWD_KERNELS)}, got {choice!r}")
    return backward_kernel(device) if choice == "auto" else choice


def gluon_split() -> bool:
    """Whether the Gluon backward runs its split variants (two 4-warp consumers per CTA, dS exponent per 64 x 64
    tile): the default, since they measured 1.14-1.20x the whole-tile kernels at S 8k d128 (perf-notes-attn-bwd.md);
    MXATTN_BWD_GLUON_SPLIT=0 takes the whole-tile kernels."""
    value = os.environ.get("MXATTN_BWD_GLUON_SPLIT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"MXATTN_BWD_GLUON_SPLIT must be 0 or 1, got {value!r}")
    return value == "1"


def persistent_dkdv() -> bool:
    """Whether the Gluon backward's split dK/dV kernel runs persistent (``GluonDkdvConfig.persistent``, session 20:
    one CTA per SM walking the key blocks): opt-in with MXATTN_BWD_PERSISTENT=1 until measured on a GPU."""
    value = os.environ.get("MXATTN_BWD_PERSISTENT", "0")
    if value not in ("0", "1"):
        raise ValueError(f"MXATTN_BWD_PERSISTENT must be 0 or 1, got {value!r}")
    return value == "1"


def fused_dq() -> bool:
    """Whether the Gluon backward at D = 64 forms dQ inside the dK/dV kernel (``GluonDkdvConfig.fuse_dq``, session 13:
    five products instead of seven, dQ added with atomics) instead of running the dQ kernel: opt-in with
    MXATTN_BWD_FUSED_DQ=1, and never for a ``deterministic`` call."""
    value = os.environ.get("MXATTN_BWD_FUSED_DQ", "0")
    if value not in ("0", "1"):
        raise ValueError(f"MXATTN_BWD_FUSED_DQ must be 0 or 1, got {value!r}")
    return value == "1"


# Gluon backward plans per call signature (``_gluon_plan_key``): what ``attn_bwd_hopper`` checked and chose on the
# first call of a signature (operands, kernels, configs), kept as the δ kernel's bound launch and the two Gluon
# launchers' plans, so that a repeated call (every training step's backward) skips the operand checks, the kernel
# choice, the config objects and the launchers' keys.  The CPU harness (scripts/host_overhead_cpu.py) measured
# the Gluon backward's Python at 98 -> 51 us per call (docs/perf-notes-host.md).
_GLUON_PLANS: dict = {}
_MAX_GLUON_PLANS = 256


def _rs_sig(t) -> Optional[tuple]:
    """What a plan key holds of a ``RowScaledFP8`` operand (None for anything else)."""
    if type(t) is not RowScaledFP8:
        return None
    return tensor_sig(t.data), tensor_sig(t.exp), t.dim, t.group_dim, t.group


def _gluon_plan_key(q, k, v_hdim, q_seq, k_seq, out, dout, lse, dout_hdim, dout_seq, causal, softmax_scale,
                    deterministic, grad_dtype, defer_dq) -> Optional[tuple]:
    """A plan's key, asked where ``backward_kernel`` says "gluon": every operand's dtype, shape, strides and 16-byte
    alignment (``launch.tensor_sig``), the RowScaledFP8 layouts, the devices, the options, the build choices
    (``gluon_split``'s and ``fused_dq``'s variables: the fused path makes no plan, so with it on no plan is found)
    and the current device; None for arguments a plan cannot take (the checked path
    then says what is wrong) or with ``MXATTN_LAUNCH_PLANS=0``."""
    from mxattn.kernels import launch

    ops = tuple(_rs_sig(t) for t in (q, k, v_hdim, q_seq, k_seq))
    dos = tuple(None if t is None else _rs_sig(t) or False for t in (dout_hdim, dout_seq))
    if None in ops or False in dos or not launch.PLANS:
        return None
    try:
        plain = tuple((tensor_sig(t), t.device) for t in (out, dout, lse))
    except AttributeError:  # not tensors
        return None
    dev = launch.current_device() if q.data.is_cuda else -1
    return (ops, dos, plain, q.data.device, causal, softmax_scale, deterministic, grad_dtype, defer_dq,
            os.environ.get("MXATTN_BWD_GLUON_SPLIT"), os.environ.get("MXATTN_BWD_FUSED_DQ"),
            os.environ.get("MXATTN_BWD_PERSISTENT"), launch.CAUSAL_LPT, dev)


def _run_gluon_plan(plan, q, k, v_hdim, q_seq, k_seq, out, dout, lse, dout_hdim, dout_seq, defer_dq):
    """``attn_bwd_hopper``'s Gluon path on a call of a plan's signature: dO's missing operands, δ, dK/dV and dQ
    launched as the first call of the signature launched them, on this call's tensors."""
    (delta_launch, mid, tail), (run_dkdv, dkdv_plan), (run_dq, dq_plan), grad_dtype = plan
    doh, dos = _dout_operands(dout, dout_hdim, dout_seq)
    B, Sq, Hq, _ = out.shape
    _, Sk, Hkv, D = k.data.shape
    dev = q.data.device
    delta = torch.empty(B, Hq, Sq, dtype=torch.float32, device=dev)
    from mxattn.kernels.attn_bwd_dkdv_gluon import step_rows_empty

    rows = step_rows_empty(B, Hq, Sq, dev)  # δ's launch writes the dK/dV kernel's step rows too
    delta_launch(doh.data, doh.exp, out, delta, *mid, lse, *rows, *tail)
    dk = torch.empty(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    dv = torch.empty(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    run_dkdv(dkdv_plan, q, k, v_hdim, q_seq, doh, dos, lse, delta, dk, dv, rows)

    def gluon_dq():
        return run_dq(dq_plan, q, k, v_hdim, k_seq, doh, lse, delta, grad_dtype)

    return (gluon_dq if defer_dq else gluon_dq()), dk, dv


def attn_bwd_hopper(
    q: RowScaledFP8,
    k: RowScaledFP8,
    v_hdim: RowScaledFP8,
    q_seq: RowScaledFP8,
    k_seq: RowScaledFP8,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    deterministic: bool = False,
    grad_dtype: torch.dtype = torch.bfloat16,
    dout_hdim: Optional[RowScaledFP8] = None,
    dout_seq: Optional[RowScaledFP8] = None,
    config: Optional[BwdConfig] = None,
    defer_dq: bool = False,
    dk_out: Optional[torch.Tensor] = None,
    dv_out: Optional[torch.Tensor] = None,
):
    """Gradients (dq, dk, dv) of MXFP8 attention on row-scaled FP8 operands (``formats.RowScaledFP8``).

    q:      Q blocked along the head dim, data (B, Sq, Hq, D) D-contiguous.  Fastest with one exponent per 128 rows
            (``Q_EXP_GROUP``): ``row_scaled_triton(q, "k", k_group=128)``, exp (B, ceil(Sq/128), Hq, 1), so that a
            query tile's scale is one number; the forward's per-row operand (``row_scaled_triton(q, "q")``) works
            too, slower (per-query vectors cost 16 registers each in the dK/dV kernel's transposed tiles).
    k:      the forward's K operand: ``row_scaled_triton(k, "k")``, exp (B, ceil(Sk/128), Hkv, 1).
    v_hdim: V blocked along the head dim, K layout: ``row_scaled_triton(v, "k")`` (one exponent per 128 keys).
    q_seq:  Q blocked along the sequence, V layout: ``row_scaled_triton(q, "v")``, exp (B, 1, Hq, D), data the
            (B, Sq, Hq, D) view of a channel-major (B, Hq, D, S_pad) buffer whose padding is zero.
    k_seq:  K blocked along the sequence, V layout: ``row_scaled_triton(k, "v")``, exp (B, 1, Hkv, D), channel-major.
    out:    the forward output (B, Sq, Hq, D), bf16/fp16/fp32, any strides.
    dout:   its gradient, same shape; quantized here (``attn_bwd_preprocess``) unless ``dout_hdim`` (hdim, grouped
            like q) and ``dout_seq`` (V layout, channel-major) are given.
    lse:    the forward's (B, Hq, Sq) float32 natural-log sum of exp (-inf for rows that see nothing).
    Data strides are free, but the kernels are fast only with the layouts above (D contiguous for hdim, S for seq).
    deterministic: dQ from a second kernel instead of fp32 atomics (bit-identical over runs, 8 products per tile
    pair instead of 5).  ``config.dq_kernel`` (``default_config`` sets it where it measured faster) takes that
    path without being asked.
    Returns dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D) in ``grad_dtype``, contiguous.  dK and dV are summed over
    the query heads of each kv head's group.  Semantics: ``reference.attention_backward`` with quantize_p,
    quantize_ds and quantize_do on, up to the dS/dO scale granularity described in the module docstring.
    defer_dq: return a callable in place of dq that launches the dQ kernel (where dQ has its own kernel) and
    returns dq, so that a caller can act on dk, dv first (the ring sends them on while dQ runs).
    dk_out, dv_out: where to write dK and dV (``grad_outputs``), e.g. straight into the ring's traveling buffer.
    A call that runs the Gluon kernels without ``config``, ``dk_out`` or ``dv_out`` makes a plan of its signature
    (``_gluon_plan_key``); a later call of that signature launches the same kernels with the same arguments on its
    own tensors without the checks and choices (``_run_gluon_plan``).
    """
    key = None
    if config is None and dk_out is None and dv_out is None and type(q) is RowScaledFP8 \
            and backward_kernel(q.data.device) == "gluon":
        key = _gluon_plan_key(q, k, v_hdim, q_seq, k_seq, out, dout, lse, dout_hdim, dout_seq, causal, softmax_scale,
                              deterministic, grad_dtype, defer_dq)
        plan = _GLUON_PLANS.get(key)
        if plan is not None:
            return _run_gluon_plan(plan, q, k, v_hdim, q_seq, k_seq, out, dout, lse, dout_hdim, dout_seq, defer_dq)
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    cfg = config or default_config(D, causal, Hq // max(Hkv, 1))
    qg = _check_operands(q, k, v_hdim, q_seq, k_seq, out, dout, lse, cfg)
    fuse = not deterministic and D == 64 and fused_dq()  # (before the override below: the caller's flag)
    deterministic = deterministic or cfg.dq_kernel  # from here on: "dQ from the second kernel"
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    dev = q.data.device
    use_gluon = config is None and backward_kernel(dev) == "gluon"
    if use_gluon:  # checked before any launch
        dg = _row_group(dout_hdim, "dout_hdim") if dout_hdim is not None else DO_EXP_GROUP
        fits = D in (64, 128) and qg % 128 == 0 and dg % 128 == 0
        if os.environ.get("MXATTN_BWD_KERNEL") == "gluon":  # asked for by name: refuse what they cannot do
            if not fits:
                raise ValueError(f"MXATTN_BWD_KERNEL=gluon needs D 64 or 128 and q / dO grouped by a multiple of "
                                 f"128 rows (got D={D}, q rows per exponent {qg}, dO {dg})")
            if INTERPRETER or dev.type != "cuda":
                raise RuntimeError("MXATTN_BWD_KERNEL=gluon: the Gluon kernels need a Hopper GPU (no interpreter path)")
        use_gluon = fits  # "auto": the tl kernels take the rest
    dk, dv = grad_outputs(dk_out, dv_out, (B, Sk, Hkv, D), grad_dtype, dev)
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        dk.zero_()
        dv.zero_()
        dq = torch.zeros(B, Sq, Hq, D, dtype=grad_dtype, device=dev)
        return ((lambda: dq) if defer_dq else dq), dk, dv
    split = use_gluon and gluon_split()
    dense_rows = use_gluon and not (split and fuse)  # the dK/dV launch below reads step rows
    doh, dos, delta, delta_launch, rows = _preprocess(out, dout, dout_hdim, dout_seq,
                                                      bind=dense_rows and key is not None,
                                                      lse=lse if dense_rows else None)
    if use_gluon:
        from mxattn.kernels import attn_bwd_dkdv_gluon as dkdv_gluon
        from mxattn.kernels import attn_bwd_dq_gluon as dq_gluon

        # split builds (the default); at D = 64 the 128-key dQ step and the 128-query dK/dV step (session 11,
        # S 8k d64: dQ 1.67 / 0.86 ms against 2.24 / 1.17, dK/dV 2.20 / 1.38 against 2.54 / 1.40, non-causal / causal)
        wide = D == 64
        if split and fuse:  # dQ inside the dK/dV kernel (opt-in, ``fused_dq``; no plan is made of it)
            dq, dk, dv = dkdv_gluon.attn_bwd_dkdv_dq_gluon(q, k, v_hdim, q_seq, k_seq, doh, dos, lse, delta,
                                                           causal=causal, softmax_scale=softmax_scale,
                                                           grad_dtype=grad_dtype, dk_out=dk, dv_out=dv)
            return ((lambda: dq) if defer_dq else dq), dk, dv
        dkdv_cfg = (dkdv_gluon.GluonDkdvConfig(split=True, block_m=128 if wide else 64, persistent=persistent_dkdv())
                    if split else None)
        dq_cfg = dq_gluon.GluonDqConfig(split=True, block_n=128 if wide else 64) if split else None
        dkdv_args = (q, k, v_hdim, q_seq, doh, dos, lse, delta)
        dkdv_kw = dict(causal=causal, softmax_scale=softmax_scale, grad_dtype=grad_dtype, config=dkdv_cfg,
                       dk_out=dk, dv_out=dv)
        dk, dv = dkdv_gluon.attn_bwd_dkdv_gluon(*dkdv_args, **dkdv_kw, step_rows=rows)
        dq_args = (q, k, v_hdim, k_seq, doh, lse, delta)
        dq_kw = dict(causal=causal, softmax_scale=softmax_scale, grad_dtype=grad_dtype, config=dq_cfg)

        def gluon_dq():
            dq = dq_gluon.attn_bwd_dq_gluon(*dq_args, **dq_kw)
            if delta_launch is not None:  # the plan, once both launchers have theirs
                dkdv_plan, dq_plan = dkdv_gluon.plan_for(*dkdv_args, **dkdv_kw), dq_gluon.plan_for(*dq_args, **dq_kw)
                if dkdv_plan is not None and dq_plan is not None:
                    if len(_GLUON_PLANS) >= _MAX_GLUON_PLANS:
                        _GLUON_PLANS.clear()
                    _GLUON_PLANS[key] = (delta_launch, (dkdv_gluon.run_plan, dkdv_plan), (dq_gluon.run_plan, dq_plan),
                                         grad_dtype)
            return dq

        return (gluon_dq if defer_dq else gluon_dq()), dk, dv
    q_group = _tile_group(qg, cfg)
    qe = q.exp if q_group > 1 or qg == 1 else _expand_rows(q)
    dg = _row_group(doh, "dout_hdim")
    do_group = _tile_group(dg, cfg)
    dhe = doh.exp if do_group > 1 or dg == 1 else _expand_rows(doh)
    group = Hq // Hkv
    grad_scale = softmax_scale * 2.0**-P_SCALE_LOG2  # dS entered the products as 256 * dS
    qk_scale = softmax_scale * LOG2E
    if deterministic:
        dq = torch.empty(B, Sq, Hq, D, dtype=grad_dtype, device=dev)
        dq_acc = dq  # unused by the dK/dV kernel
    else:
        dq_acc = torch.zeros(B, Sq, Hq, D, dtype=torch.float32, device=dev)

    qd, kd, ke, vd, ve = q.data, k.data, k.exp, v_hdim.data, v_hdim.exp
    qsd, qse, ksd, kse = q_seq.data, q_seq.exp, k_seq.data, k_seq.exp
    dhd, dsd, dse = doh.data, dos.data, dos.exp
    row_e = lambda e: _exp_strides3(e, (0, 1, 2))  # (B, S or groups, H)
    chan_e = lambda e: _exp_strides3(e, (0, 2, 3))  # (B, H, D)
    common = dict(HEAD_DIM=D, CAUSAL=causal, Q_GROUP=q_group, DO_GROUP=do_group, EXPLICIT_ROUND=INTERPRETER)
    fast_launcher(_bwd_dkdv_kernel)[(cdiv(Sk, cfg.block_n), B * Hkv)](
        qd, qe, kd, ke, vd, ve, qsd, qse, ksd, kse, dhd, dhe, dsd, dse, lse, delta, dq_acc, dk, dv,
        *qd.stride(), *row_e(qe), *kd.stride(), *row_e(ke), *vd.stride(), *row_e(ve),
        *qsd.stride(), *chan_e(qse), *ksd.stride(), *chan_e(kse),
        *dhd.stride(), *row_e(dhe), *dsd.stride(), *chan_e(dse),
        *lse.stride(), *dq_acc.stride(), *dk.stride(), *dv.stride(),
        Hkv, Sq, Sk, group, qk_scale, grad_scale, _seq_load_bound(qsd), _seq_load_bound(dsd),
        None, None, None, None, None, None, None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ATOMIC_DQ=not deterministic, DS_TILE_SCALE=cfg.ds_tile_scale,
        **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

    def tl_dq():  # the second kernel's dQ, or the atomics' fp32 sums in grad_dtype
        if not deterministic:
            return dq_acc.to(grad_dtype)
        fast_launcher(_bwd_dq_kernel)[(cdiv(Sq, cfg.dq_block_m), B * Hq)](
            qd, qe, kd, ke, vd, ve, ksd, kse, dhd, dhe, lse, delta, dq,
            *qd.stride(), *row_e(qe), *kd.stride(), *row_e(ke), *vd.stride(), *row_e(ve),
            *ksd.stride(), *chan_e(kse), *dhd.stride(), *row_e(dhe), *lse.stride(), *dq.stride(),
            Hq, Sq, Sk, group, qk_scale, grad_scale, _seq_load_bound(ksd), None, None, None, None, None, None,
            BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, **common,
            num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages,
        )
        return dq

    return (tl_dq if defer_dq else tl_dq()), dk, dv


# ----------------------------------------------------------------------------------------------
# Jagged (varlen) batches: the same kernels with VARLEN=True
# ----------------------------------------------------------------------------------------------


def _varlen_row_group(t, name: str) -> int:
    """Rows per exponent of a varlen hdim operand (``kernels.varlen.VarlenFP8``): 1 for the Q layout (role "q"),
    128 for the K layout (role "k": groups of 128 rows from each sequence's start)."""
    from mxattn.kernels.varlen import K_GROUP, VarlenFP8

    if not isinstance(t, VarlenFP8):
        raise TypeError(f"{name} must be a VarlenFP8, got {type(t).__name__}")
    if t.role not in ("q", "k"):
        raise ValueError(f"{name}: role {t.role!r}, expected an hdim operand (role 'q' or 'k')")
    T, H, D = t.data.shape
    if t.role == "q":
        if tuple(t.exp.shape) != (T, H, 1):
            raise ValueError(f"{name}: exp {tuple(t.exp.shape)}, expected {(T, H, 1)}")
        return 1
    if t.exp.ndim != 3 or tuple(t.exp.shape[1:]) != (H, 1) or t.cu_exp is None:
        raise ValueError(f"{name}: exp {tuple(t.exp.shape)}, expected (G, {H}, 1) with group offsets cu_exp")
    return K_GROUP


def _check_varlen_seq(t, name: str, H: int, D: int, B: int) -> None:
    from mxattn.kernels.varlen import VarlenFP8

    if not isinstance(t, VarlenFP8):
        raise TypeError(f"{name} must be a VarlenFP8, got {type(t).__name__}")
    if t.role != "v" or t.data.ndim != 3 or tuple(t.data.shape[:2]) != (H, D) or t.data.stride(2) != 1:
        raise ValueError(f"{name}: needs the V layout (role 'v', channel-major data ({H}, {D}, Tv)), got role "
                         f"{t.role!r}, data {tuple(t.data.shape)}")
    if tuple(t.exp.shape) != (B, H, D):
        raise ValueError(f"{name}: exp {tuple(t.exp.shape)}, expected {(B, H, D)}")


def attn_bwd_preprocess_varlen(out: torch.Tensor, dout: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                               dout_hdim=None, dout_seq=None, delta_padded: bool = False,
                               lse: Optional[torch.Tensor] = None, offsets_of: tuple = (None, None)):
    """``attn_bwd_preprocess`` for a jagged batch: dO (Tq, Hq, D) in both orientations as ``VarlenFP8`` (hdim in
    the K layout: one exponent per 128 rows from each sequence's start, ``varlen_k_operand``; seq in the V layout
    with 64-aligned sequence starts, ``varlen_v_operand(align=BWD_SEQ_ALIGN)``) and ``delta`` (Hq, Tq) fp32,
    contiguous like the forward's lse.
    ``delta_padded`` (the Gluon backward's layout): delta (Hq, Tv) in dout_seq's columns (sequence b at columns
    ``dout_seq.cu_data[b]``, 64-aligned), zero in each sequence's padding, so that a 64-wide box of it past a
    sequence's end reads 0 (never another sequence's value: a NaN there would survive P = 0).
    ``lse`` (only with ``delta_padded``): the forward's packed (Hq, Tq) fp32 lse, also moved into those columns in
    the same launch (zero in the padding; ``attn_bwd_dkdv_gluon.padded_lse`` is its PyTorch twin): the jagged dK/dV
    kernel's lse boxes must start 16-byte aligned, which packed sequence starts are not.
    ``offsets_of`` (hdim, seq): operands over the same ``cu_seqlens_q`` tensor whose offsets dO's producers take
    (``varlen_k_operand`` / ``varlen_v_operand``'s ``offsets_of``; the backward passes q and q_seq, ``_dout_offsets``):
    the same values without the offset arithmetic's small launches.
    Returns (dout_hdim, dout_seq, delta), and the padded lse fourth when ``lse`` is given."""
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN, varlen_k_operand, varlen_v_operand

    if dout_hdim is None:
        dout_hdim = varlen_k_operand(dout, cu_seqlens_q, max_seqlen_q, offsets_of=offsets_of[0])
    if dout_seq is None:  # q_seq's column layout (varlen_bwd_operands), which the Gluon kernels need
        dout_seq = varlen_v_operand(dout, cu_seqlens_q, max_seqlen_q, align=BWD_SEQ_ALIGN, offsets_of=offsets_of[1])
    g = _varlen_row_group(dout_hdim, "dout_hdim")
    Tq, Hq, D = out.shape
    B = cu_seqlens_q.numel() - 1
    if lse is not None:
        if not delta_padded:
            raise ValueError("lse is moved into the padded columns only with delta_padded=True")
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or tuple(lse.shape) != (Hq, Tq) \
                or lse.device != out.device or lse.stride(1) != 1:
            raise ValueError(f"lse must be the forward's float32 ({Hq}, {Tq}) with unit row stride on {out.device}, "
                             f"got {getattr(lse, 'dtype', type(lse).__name__)} {tuple(getattr(lse, 'shape', ()))}")
    if delta_padded:  # delta and (if asked) lse side by side: one allocation
        pad = torch.zeros(2 if lse is not None else 1, Hq, dout_seq.data.shape[2], dtype=torch.float32,
                          device=out.device)
        delta = pad[0]
        lse_pad = pad[1] if lse is not None else None
    else:
        delta = torch.empty(Hq, Tq, dtype=torch.float32, device=out.device)
        lse_pad = None
    block_r = max(1, min(128, 8192 // D))
    n_c = cdiv(max_seqlen_q * Hq, block_r)
    if Tq * Hq and B * n_c:
        dd, de = dout_hdim.data, dout_hdim.exp
        fast_launcher(_delta_kernel)[(B * n_c,)](
            dd, de, out, delta, 0, *dd.stride(), 0, de.stride(0), de.stride(1), 0, *out.stride(),
            0, *delta.stride(), max_seqlen_q, Hq, n_c, cu_seqlens_q, dout_hdim.cu_exp,
            None, None, None, 0, 0, 0, 0, 0, HEAD_DIM=D, BLOCK_R=block_r, DO_GROUP=g, VARLEN=True, num_warps=4,
            CU_DCOL=dout_seq.cu_data if delta_padded else None,
            LSE=lse, LSE_PAD=lse_pad, s_lseh=lse.stride(0) if lse is not None else 0,
        )
    if lse is not None:
        return dout_hdim, dout_seq, delta, lse_pad
    return dout_hdim, dout_seq, delta


def _dout_offsets(q, q_seq) -> tuple:
    """(hdim, seq): q and q_seq where dO's producers can take their offsets (``attn_bwd_preprocess_varlen``'s
    ``offsets_of``: same cu_seqlens tensor, q in the K layout, q_seq in 64-aligned rows), else None."""
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN

    hdim = q if q.role == "k" and q.cu_exp is not None else None
    seq = q_seq if (q_seq.role == "v" and q_seq.align == BWD_SEQ_ALIGN and not q_seq.v_blocks
                    and q_seq.cu_seqlens is q.cu_seqlens) else None
    return hdim, seq


def attn_bwd_hopper_varlen(
    q, k, v_hdim, q_seq, k_seq, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    deterministic: bool = False,
    grad_dtype: torch.dtype = torch.bfloat16,
    dout_hdim=None,
    dout_seq=None,
    config: Optional[BwdConfig] = None,
):
    """Gradients (dq, dk, dv) of jagged MXFP8 attention (``attn_fwd.attn_fwd_hopper_varlen``'s) on
    ``kernels.varlen.VarlenFP8`` operands: the dense kernels with ``VARLEN=True`` (each program finds its sequence
    from the offsets, moves its base pointers there and exits when its tile is past the sequence's end).

    q:      Q along the head dim, data (Tq, Hq, D).  Fast: the K layout over cu_seqlens_q (one exponent per 128
            rows from each sequence's start): ``varlen_k_operand(q, cu_seqlens_q, max_seqlen_q)``; the forward's Q
            layout (``varlen_q_operand``, per row) works too, slower.
    k:      the forward's K operand (``varlen_k_operand(k, cu_seqlens_k, max_seqlen_k)``).
    v_hdim: V along the head dim, K layout: ``varlen_k_operand(v, cu_seqlens_k, max_seqlen_k)`` (k's group
            offsets ``k.cu_exp`` are used for it).
    q_seq:  Q along the sequence, V layout over cu_seqlens_q (``varlen_v_operand(q, cu_seqlens_q, max_seqlen_q)``:
            channel-major (Hq, D, Tqv), 64-aligned sequence starts (BWD_SEQ_ALIGN; the tl kernels take 16), zero
            tails, exp (B, Hq, D)).  The Gluon kernels (below) need the 64-aligned layout.
    k_seq:  K along the sequence, V layout over cu_seqlens_k.
    out, dout: (Tq, Hq, D); lse: (Hq, Tq) float32 (the varlen forward's).  dO is quantized here
            (``attn_bwd_preprocess_varlen``) unless ``dout_hdim`` (K or Q layout over cu_seqlens_q) and ``dout_seq``
            (V layout with q_seq's column offsets) are given.
    All operands' ``cu_seqlens`` are the same two offset arrays; ``max_seqlen`` at least the longest sequence
    (they size the grids).  ``varlen.varlen_bwd_operands`` makes q, k, v_hdim, q_seq, k_seq in one call.
    Causal masks are bottom-right per sequence; rows that see no key get dq = 0, keys that no query sees dk = dv = 0.
    Returns dq (Tq, Hq, D), dk, dv (Tk, Hkv, D) in ``grad_dtype``, contiguous.  Every sequence's gradients are
    those of ``attn_bwd_hopper`` on that sequence alone (same tiles, same arithmetic).
    Kernels (``varlen_backward_kernel``; "auto" by default): with "auto" or "gluon" on Hopper the warp-specialized
    Gluon kernels in their jagged mode (``attn_bwd_dkdv_gluon_varlen``, ``attn_bwd_dq_gluon_varlen``; always deterministic, split
    variants unless ``MXATTN_BWD_GLUON_SPLIT=0``) when ``config`` is None, D is 64 or 128, q / dout_hdim have the K
    layout and the seq operands 64-aligned columns (``varlen_bwd_operands`` makes them so); else the ``tl``
    kernels with ``VARLEN=True``.  Each sequence's gradients are then those of the dense Gluon backward on it: the
    jagged dK/dV kernel gets the dense dispatch's config, so its dS exponent is per key (``GluonDkdvConfig``'s
    default ``ds_exp="key"``), whose tl twin is ``ds_tile_scale=False`` (``attn_bwd_dkdv_gluon.tl_twin_config``);
    the tl path keeps its config's rule (per tile by default).
    """
    Tq, Hq, D = q.data.shape
    Tk, Hkv = k.data.shape[0], k.data.shape[1]
    cfg = config or default_config(D, causal, Hq // max(Hkv, 1))
    deterministic = deterministic or cfg.dq_kernel  # from here on: "dQ from the second kernel"
    qg = _varlen_row_group(q, "q")
    if _varlen_row_group(k, "k") == 1 or _varlen_row_group(v_hdim, "v_hdim") == 1:
        raise ValueError(f"k and v_hdim need the K layout (one exponent per {EXP_GROUP} keys, role 'k')")
    B = q.cu_seqlens.numel() - 1
    if k.cu_seqlens.numel() - 1 != B:
        raise ValueError(f"q has {B} sequences, k has {k.cu_seqlens.numel() - 1}")
    for name, t, want in (("k", k, (Tk, Hkv, D)), ("v_hdim", v_hdim, (Tk, Hkv, D))):
        if tuple(t.data.shape) != want:
            raise ValueError(f"{name}: data {tuple(t.data.shape)}, expected {want}")
    _check_varlen_seq(q_seq, "q_seq", Hq, D, B)
    _check_varlen_seq(k_seq, "k_seq", Hkv, D, B)
    if tuple(out.shape) != (Tq, Hq, D) or tuple(dout.shape) != (Tq, Hq, D):
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be {(Tq, Hq, D)}")
    if tuple(lse.shape) != (Hq, Tq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {(Hq, Tq)}, got {lse.dtype} {tuple(lse.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim {D} must be a power of two in [16, 256]")
    for bn in (cfg.block_n, cfg.dq_block_n):
        if EXP_GROUP % bn:
            raise ValueError(f"block_n={bn} must divide the exponent group {EXP_GROUP}")
    if qg > 1 and _tile_group(qg, cfg) == 1:
        raise ValueError(f"block_m={cfg.block_m} and dq_block_m={cfg.dq_block_m} must divide {qg} (q's rows per "
                         f"exponent) for a jagged batch; use the per-row Q layout otherwise")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    dev = q.data.device
    use_gluon = config is None and varlen_backward_kernel(dev) == "gluon"
    if use_gluon:  # checked before any launch
        from mxattn.kernels.varlen import BWD_SEQ_ALIGN

        seqs = [t for t in (q_seq, k_seq, dout_seq) if t is not None]
        fits = (D in (64, 128) and qg == EXP_GROUP
                and (dout_hdim is None or _varlen_row_group(dout_hdim, "dout_hdim") == EXP_GROUP)
                and all(t.align % BWD_SEQ_ALIGN == 0 and not t.v_blocks for t in seqs))
        if "gluon" in (os.environ.get("MXATTN_VARLEN_BWD_KERNEL"), os.environ.get("MXATTN_BWD_KERNEL")):
            if not fits:
                raise ValueError(f"the Gluon jagged backward needs D 64 or 128, q / dout_hdim in the K layout and "
                                 f"seq operands with {BWD_SEQ_ALIGN}-aligned columns (varlen_bwd_operands); got "
                                 f"D={D}, q rows per exponent {qg}, seq aligns {[t.align for t in seqs]}")
            if INTERPRETER or dev.type != "cuda":
                raise RuntimeError("the Gluon backward kernels need a Hopper GPU (no interpreter path)")
        use_gluon = fits  # "auto": the tl kernels take the rest
    n_n = cdiv(k.max_seqlen, cfg.block_n)
    n_m = cdiv(q.max_seqlen, cfg.dq_block_m)
    if Tq == 0 or Tk == 0 or B * Hq == 0 or n_n == 0 or n_m == 0:
        return (torch.zeros(Tq, Hq, D, dtype=grad_dtype, device=dev),
                torch.zeros(Tk, Hkv, D, dtype=grad_dtype, device=dev),
                torch.zeros(Tk, Hkv, D, dtype=grad_dtype, device=dev))
    lse = lse.contiguous()
    if use_gluon:
        from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, attn_bwd_dkdv_gluon_varlen
        from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon_varlen

        # δ and lse in dout_seq's padded columns (zero past each sequence's end: what the kernels' 64-wide boxes read)
        doh, dos, delta, lse_pad = attn_bwd_preprocess_varlen(out, dout, q.cu_seqlens, q.max_seqlen, dout_hdim,
                                                              dout_seq, delta_padded=True, lse=lse,
                                                              offsets_of=_dout_offsets(q, q_seq))
        split = gluon_split()
        dk, dv = attn_bwd_dkdv_gluon_varlen(q, k, v_hdim, q_seq, doh, dos, lse_pad, delta, causal=causal,
                                            softmax_scale=softmax_scale, grad_dtype=grad_dtype,
                                            config=GluonDkdvConfig(split=True) if split else None)
        dq = attn_bwd_dq_gluon_varlen(q, k, v_hdim, k_seq, doh, lse, delta, dos.cu_data, causal=causal,
                                      softmax_scale=softmax_scale, grad_dtype=grad_dtype,
                                      config=GluonDqConfig(split=True) if split else None)
        return dq, dk, dv
    doh, dos, delta = attn_bwd_preprocess_varlen(out, dout, q.cu_seqlens, q.max_seqlen, dout_hdim, dout_seq,
                                                 offsets_of=_dout_offsets(q, q_seq))
    dg = _varlen_row_group(doh, "dout_hdim")
    if dg > 1 and _tile_group(dg, cfg) == 1:
        raise ValueError(f"block_m={cfg.block_m} and dq_block_m={cfg.dq_block_m} must divide {dg} (dO's rows per "
                         f"exponent) for a jagged batch")
    _check_varlen_seq(dos, "dout_seq", Hq, D, B)
    dk = torch.empty(Tk, Hkv, D, dtype=grad_dtype, device=dev)
    dv = torch.empty(Tk, Hkv, D, dtype=grad_dtype, device=dev)
    if deterministic:
        dq = torch.empty(Tq, Hq, D, dtype=grad_dtype, device=dev)
        dq_acc = dq  # unused by the dK/dV kernel
    else:
        dq_acc = torch.zeros(Tq, Hq, D, dtype=torch.float32, device=dev)
    group = Hq // Hkv
    grad_scale = softmax_scale * 2.0**-P_SCALE_LOG2
    qk_scale = softmax_scale * LOG2E

    qd, qe, kd, ke, vd, ve = q.data, q.exp, k.data, k.exp, v_hdim.data, v_hdim.exp
    qsd, qse, ksd, kse = q_seq.data, q_seq.exp, k_seq.data, k_seq.exp
    dhd, dhe, dsd, dse = doh.data, doh.exp, dos.data, dos.exp
    tok = lambda t: (0, *t.stride())  # packed (T, H, D) data as (B=0-stride, S, H, D)
    row_e = lambda e: (0, e.stride(0), e.stride(1))  # (rows or groups, H, 1) exponents
    seq_d = lambda t: (0, t.stride(2), t.stride(0), t.stride(1))  # channel-major (H, D, Tv) as (B, S, H, D)
    chan_e = lambda e: (e.stride(0), e.stride(1), e.stride(2))  # (B, H, D)
    lse_s = (0, lse.stride(0), lse.stride(1))
    cu_q, cu_k = q.cu_seqlens, k.cu_seqlens
    common = dict(HEAD_DIM=D, CAUSAL=causal, Q_GROUP=qg, DO_GROUP=dg, EXPLICIT_ROUND=INTERPRETER, VARLEN=True)
    fast_launcher(_bwd_dkdv_kernel)[(n_n * B * Hkv,)](
        qd, qe, kd, ke, vd, ve, qsd, qse, ksd, kse, dhd, dhe, dsd, dse, lse, delta, dq_acc, dk, dv,
        *tok(qd), *row_e(qe), *tok(kd), *row_e(ke), *tok(vd), *row_e(ve),
        *seq_d(qsd), *chan_e(qse), *seq_d(ksd), *chan_e(kse),
        *tok(dhd), *row_e(dhe), *seq_d(dsd), *chan_e(dse),
        *lse_s, *tok(dq_acc), *tok(dk), *tok(dv),
        Hkv, q.max_seqlen, k.max_seqlen, group, qk_scale, grad_scale, 0, 0,
        cu_q, cu_k, q.cu_exp, doh.cu_exp, k.cu_exp, q_seq.cu_data, k_seq.cu_data,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ATOMIC_DQ=not deterministic, DS_TILE_SCALE=cfg.ds_tile_scale,
        **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if deterministic:
        fast_launcher(_bwd_dq_kernel)[(n_m * B * Hq,)](
            qd, qe, kd, ke, vd, ve, ksd, kse, dhd, dhe, lse, delta, dq,
            *tok(qd), *row_e(qe), *tok(kd), *row_e(ke), *tok(vd), *row_e(ve),
            *seq_d(ksd), *chan_e(kse), *tok(dhd), *row_e(dhe), *lse_s, *tok(dq),
            Hq, q.max_seqlen, k.max_seqlen, group, qk_scale, grad_scale, 0,
            cu_q, cu_k, q.cu_exp, doh.cu_exp, k.cu_exp, k_seq.cu_data,
            BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, **common,
            num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages,
        )
    else:
        dq = dq_acc.to(grad_dtype)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Benchmark entry
# ----------------------------------------------------------------------------------------------


def bench_attn_bwd(shapes: Sequence[tuple], *, configs: Optional[Sequence[Optional[BwdConfig]]] = None,
                   modes: Sequence[bool] = (False, True), with_sdpa: bool = True, rep_ms: int = 200) -> list[dict]:
    """Time the backward on the GPU: ``shapes`` are (B, Hq, Hkv, S, D, causal) tuples, ``modes`` the values of
    ``deterministic`` to time.

    For each shape: the kernels alone on prepared operands (``bwd_ms``: preprocess + dK/dV (+ dQ) kernels, i.e.
    dO quantization and delta included, operand preparation of q/k/v excluded), the operand preparation
    (``prep_ms``: q grouped by 128 rows, q_seq, k_seq, v_hdim from bf16), and SDPA cuDNN / flash BF16 backward in
    the same run.
    TFLOP/s count 2.5 * 4 * B * Hq * S^2 * D (half when causal).  Returns one dict per (shape, mode, config)."""
    from mxattn.kernels.attn_fwd import attn_fwd_hopper

    rows = []
    for B, Hq, Hkv, S, D, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda H: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
        qr, kr, vr = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        out, lse = attn_fwd_hopper(qr, kr, vr, causal=causal)
        prep = lambda: (row_scaled_triton(q, "k", k_group=Q_EXP_GROUP), row_scaled_triton(v, "k"),
                        row_scaled_triton(q, "v"), row_scaled_triton(k, "v"))
        qb, vh, qs, ks = prep()
        flops = 2.5 * 4 * B * Hq * S * S * D * (0.5 if causal else 1.0)
        tf = lambda ms: None if ms is None else flops / ms / 1e9
        base = {"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": S, "Sk": S, "D": D, "causal": causal}
        peers = {}
        if with_sdpa:
            for name, be in (("sdpa_cudnn_bf16", "CUDNN_ATTENTION"), ("sdpa_flash_bf16", "FLASH_ATTENTION")):
                peers[name] = tf(_time_sdpa_bwd(q, k, v, dout, causal, be, rep_ms))
        prep_ms = triton.testing.do_bench(prep, warmup=10, rep=rep_ms, return_mode="median")
        for det, cfg in [(d, c) for d in modes for c in (configs or [None])]:
            row = {**base, "deterministic": det, "config": repr(cfg or default_config(D, causal, Hq // Hkv))}
            try:
                ms = triton.testing.do_bench(
                    lambda: attn_bwd_hopper(qb, kr, vh, qs, ks, out, dout, lse, causal=causal,
                                            deterministic=det, config=cfg),
                    warmup=10, rep=rep_ms, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is recorded, the sweep goes on
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            tflops = {"mxattn": tf(ms), **peers}
            cu = peers.get("sdpa_cudnn_bf16")
            rows.append({**row, "bwd_ms": ms, "prep_ms": prep_ms, "tflops": tflops,
                         "tflops_with_prep": tf(ms + prep_ms),
                         "ratio_vs_sdpa_cudnn_bf16": (tf(ms) / cu) if cu else None})
    return rows


def _time_sdpa_bwd(q, k, v, dout, causal, backend, rep_ms):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
            do = dout.transpose(1, 2)
            fn = lambda: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True)
            return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    except Exception:  # noqa: BLE001 - a backend that refuses the shape is recorded as None
        return None


SWEEP_CONFIGS = (
    BwdConfig(),
    BwdConfig(ds_tile_scale=False),
    BwdConfig(num_stages=3),
    BwdConfig(32, 128, 8, 3),
    BwdConfig(64, 64, 4, 2),
    BwdConfig(dq_block_m=64, dq_block_n=64, dq_num_warps=4, dq_num_stages=3),
)


def _main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m mxattn.kernels.attn_bwd --out DIR [--sweep]``: time the backward (both dQ modes) against SDPA
    and write ``attn_bwd-<gpu>-<date>.json``; ``--sweep`` times ``SWEEP_CONFIGS`` on two shapes instead."""
    import argparse

    from mxattn.bench.results import write_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    if args.sweep:
        shapes = [(2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True)]
        rows = bench_attn_bwd(shapes, configs=SWEEP_CONFIGS, rep_ms=100)
        what_note = "tile sweep"
    else:
        shapes = [(2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True), (2, 16, 16, 4096, 128, False),
                  (8, 16, 16, 2048, 64, False), (2, 16, 2, 8192, 128, True)]
        rows = bench_attn_bwd(shapes)
        what_note = "kernels on prepared FP8 operands; bwd_ms includes dO quantization and delta"
    for r in rows:
        print({k: r.get(k) for k in ("Sq", "D", "causal", "Hkv", "deterministic", "config", "tflops",
                                      "ratio_vs_sdpa_cudnn_bf16", "error")}, flush=True)
    print(write_result("attn_bwd_kernels", rows, args.out, extra={"notes": what_note}))


if __name__ == "__main__":
    _main()
