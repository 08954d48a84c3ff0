"""MXFP8 attention backward, dQ part, for Hopper in Gluon: warp-specialized (DESIGN §3, perf-notes-attn-bwd.md
"Plan for the warp-specialized backward").

It replaces the ``tl`` kernel ``attn_bwd._bwd_dq_kernel`` (the deterministic dQ path) with the same operands and the
same arithmetic.  Per 128 query rows of one (batch, query head), looping over the key tiles of BLOCK_N = 64 keys
(``GluonDqConfig.block_n``; 128 at D = 64 as an option, below):

  S  = Q Kᵀ            q (hdim, one exponent per 128 rows) x k (hdim, one exponent per 128 keys), FP8 wgmma
  P  = 2^(S·2^(qe+ke)·scale·log2e + 8 − lse·log2e)        (P·256 <= 256; rows that see nothing: P = 0)
  dP = dO V_hdimᵀ      dout_hdim (one exponent per 128 rows) x v_hdim (one per 128 keys), FP8 wgmma
  dS = P ∘ (dP·2^(doe+ve) − δ)                            (256·dS, fp32)
  dQ += e4m3(dS·2^-e) K_seq                                (register A operand x channel-major k_seq, FP8 wgmma)
  dq = acc · 2^e · 2^kse[channel] · scale · 2^-8           (epilogue, in grad_dtype)

The dS exponent ``e`` is the ``tl`` kernel's rule, unchanged: one RCEIL power of two per (128 queries x 64 keys)
tile, kept with hysteresis (``_sticky_exp``) and a bounded total drop (``_bounded_exp``); the accumulator is
rescaled by 2^(e_old − e_new) (exact) when it changes.  The key tiles are visited in the same order (0, 1, ...,
unmasked ones first, then the masked diagonal / last ones), so the exponent sequence and every e4m3 dS value are
the ``tl`` kernel's: the results agree up to the fp32 summation order of the products (and 1-ulp FMA contraction
differences in S and dS).

One CTA per (128 query rows, batch * head), two partitions:
  producer  1 warp, 24 registers: TMA loads of the Q and dO tiles (128 x D, once) and, per key tile, K and V_hdim
            (64 x D, one ready / one empty mbarrier per stage) and K_seq (D x 64 of the channel-major buffer, its
            own ready / empty mbarriers: it is read by the later dQ product) into STAGES-deep rings.
  consumer  the default partition: 8 warps = two warpgroups.  With the wgmma layout ``warps_per_cta=[8, 1]`` each
            warpgroup issues m64 wgmma over its own 64 query rows (rows 0..63 and 64..127).
Deviation from the brief's "two consumer partitions" (the forward's structure): the two warpgroups are one
8-warp partition, because the dS exponent is a maximum over the whole 128-row tile (the ``tl`` kernel's rule,
kept for equal numerics).  The tile-wide ``gl.max`` then is the compiler's cross-warp reduction (shared memory +
a named barrier of the partition's 256 threads) instead of a hand-made exchange between two partitions; the two
warpgroups meet there once per key tile anyway.

Consumer iteration j (FA3-style intra-warpgroup overlap, as in attn_fwd_gluon):
  1. dS_{j-1} (fp32, already scaled by 2^-e_{j-1}) -> e4m3 in the A-operand layout; rescale acc if e changed;
  2. wait K_j / V_j ready and K_seq_{j-1} ready;
  3. issue S_j = Q K_jᵀ, dP_j = dO V_jᵀ (A from shared memory) and acc += dS_{j-1} K_seq_{j-1} (A in registers),
     three async wgmma groups;
  4. wait for S_j and dP_j only; release K_j / V_j;
  5. P, dS, the tile's amax and exponent for tile j, while dS_{j-1} K_seq_{j-1} runs on the tensor cores;
  6. wait for it; release K_seq_{j-1}.
Every wgmma is waited in the iteration that issued it (perf-notes-attn-fwd-gluon.md: in flight across the loop
edge made ptxas serialize all wgmma).  dS crosses the loop edge in fp32 (an e4m3 tensor carried by a loop is moved
as loose bytes).

TMA views (2-D, 16-byte aligned row strides), as in the forward: Q and dO as (B*Sq, Hq*D), K and V_hdim as
(B*Sk, Hkv*D), K_seq as (B*Hkv*D, Sk) over the channel-major buffer (row stride S_pad).  Query rows past Sq read
the next sequence (or TMA zero fill): their lse is loaded as −inf, so P = dS = 0 there and they are not stored.
Keys past Sk read the next sequence in K and V_hdim (masked: P = dS = 0) and are zero-filled in K_seq (its
inner extent is Sk).  Only the last (and, causal, the diagonal) tiles are masked.

Layout requirements (``attn_bwd_dq_gluon`` raises ValueError otherwise): q and dout_hdim grouped along the
sequence with a group that is a multiple of 128 (the fast layout: ``row_scaled_triton(x, "k", k_group=128)``;
``attn_bwd.attn_bwd_preprocess`` makes dout_hdim so), k and v_hdim the K layout (128 keys per exponent), k_seq
the V layout (channel-major, one exponent per channel).  D is 64 or 128.

Compile check without a GPU (triton 3.6): ``python scripts/compile_check_bwd_dq_gluon.py``.  sm_90a, 3 stages:
no spills, setmaxnreg 240 (consumers) / 24 (producer), highest SASS register R195 (d128) / R198 (d128 causal) /
R173 / R180 (d64); shared memory 106 876 B (d128) / 53 628 B (d64); per key tile and warpgroup 4 + 4
``m64n64k32`` (S, dP; 2 + 2 at d64) and 2 ``m64nDk32`` (dQ) e4m3 wgmma, two ``WARPGROUP.DEPBAR`` per iteration.
Not run on a GPU yet.  Costs to look at first once it is timed: six 256-thread ``bar.sync`` per key tile (one
before the mbarrier waits and one before each of the two releases, inserted by Triton; three in the compiler's
tile-wide max, which a hand-made exchange of the eight warps' maxima through a double-buffered shared slot would
cut to one), and the tensor cores idle while both warpgroups compute dS (a ping-pong between them, as FA3,
needs the tile exponent exchange to move out of the critical path).

Jagged mode (``VARLEN``, launcher ``attn_bwd_dq_gluon_varlen``, session 8; docs/perf-notes-varlen.md): grid (rows
of a heaviest-first tile table, Hq), each CTA reads its row (sequence, first query row, offsets) once and then runs
the dense code at its sequence's Sq, Sk on packed operands (2-D TMA views of (Tq, Hq·D) / (Tk, Hkv·D); K_seq in
(Hkv·D, Tv) rows with 64-aligned, zero-padded sequence starts; δ in the same padded columns).  The dense build is
unchanged (compile reports compared with main).

Split variant (``GluonDqConfig(split=True)``; the default of ``attn_bwd_hopper`` since session 5, 1.16-1.20x the
whole-tile kernel at S8k d128): the two consumer
warpgroups as two 4-warp partitions of 64 query rows (own Q / dO tiles, accumulator and dS exponent per 64 x 64
tile: the tl dQ kernel with 64-row blocks, ``split_tl_config``), sharing the K / V / K_seq ring (empty barriers
count two arrivals), so that the six 256-thread barriers per key tile become 128-thread ones of each warpgroup
and one warpgroup's dS math can run under the other's products.  No spills; 666-737 SASS per loop and warpgroup.

128-key step (``GluonDqConfig(block_n=128)``, session 9; D = 64, dense only, ``check_block_n``): BLOCK_N is a
kernel constexpr.  The K / V_hdim boxes are 128 x 64, K_seq's 64 x 128, a ring stage 24 KB; S and dP are
m64n128k32 wgmma into 64 x 128 fp32 tiles per warpgroup (64 registers a thread each), dQ += dS K_seq is 4 k-steps
of m64n64k32; one k / v exponent group per step; the dS exponent is one per (rows x 128) tile (the same rule).  The
twin is the tl dQ kernel with ``dq_block_n=128`` (``tl_twin_config``), whose tile order (unmasked tiles, then the
masked ones) and exponent tiles are the same.  Half the steps per score: the per-step waits, barriers, exponent
reduction and loop overhead are paid once per 128 keys.  sm_90a, 3 stages, d64 (split and whole, causal and not):
no spills, highest SASS register R237, 90 656 B shared memory (split), 631-641 SASS on a step's path against
380-382 for 64 keys, i.e. 9.9-10.0 instead of 11.9 instructions per score and thread (perf-notes-attn-bwd.md,
"Session 9").  Measured in session 11 (B2 H16 S8k d64, split): 1.67 / 0.86 ms against 2.24 / 1.17 for 64 keys, so the
public backward (``attn_bwd.attn_bwd_hopper``) takes it at D = 64; this module's ``default_config`` and the jagged
launcher keep 64.  At d128 it spills (80 B, 8 LDL/STL per step).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxattn.formats import RowScaledFP8
from mxattn.kernels.attn_fwd_gluon import (_cta_order, _k_operand, _key_of_column, _pack_p, _sm_count,
                                           _store_tile_rows, _unpack_p, k_perm_ok, permuted_rows_descriptor)
from mxattn.kernels import launch
from mxattn.kernels.launch import (BoundLaunch, cdiv, fast_launcher, nvmma_fp8_layout, rebased, tensor_sig,
                                   unbased)

__all__ = ["GluonDqConfig", "default_config", "check_block_n", "split_tl_config", "tl_twin_config",
           "attn_bwd_dq_gluon", "attn_bwd_dq_gluon_varlen", "check_varlen_operands", "backward_operands",
           "bench_attn_bwd_dq_gluon", "dq_operands", "time_against_tl"]

LOG2E = 1.4426950408889634
P_SCALE_LOG2 = 8  # dS enters the product as 256 * dS (P * 256, as in attn_bwd)
BLOCK_M = gl.constexpr(128)  # query rows per CTA: two warpgroups of 64
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup when split
# keys per step, the kernel's BLOCK_N constexpr (``GluonDqConfig.block_n``): the tl kernel's dq_block_n, i.e. the
# granularity of the dS exponent.  64 by default; 128 only at D = 64 on dense launches (``check_block_n``)
BLOCK_NS = (64, 128)
KV_EXP_GROUP = gl.constexpr(128)  # keys sharing one exponent in k and v_hdim
# How dQ (here) and dK / dV (attn_bwd_dkdv_gluon) reach memory, read once at import from MXATTN_BWD_OUT_ROWS:
# from wgmma's accumulator layout (4 bytes a thread, a warp's store over 8 rows), or each tile moved to whole rows
# through shared memory first (16-byte stores, ``_store_tile_rows``), as the forward's ``out_store="rows"``.  The
# same values are stored.  "auto" (default, session 20's measurement on an H100, bwd_kernels-…-s20.json): rows for
# dQ (2-5 % faster) and for the 128-query dK/dV build (d64, 10 %), the accumulator layout for the 64-query dK/dV
# build (d128: equal non-causal, slower causal, whose build then spills inside its loop); "1" rows everywhere, "0"
# nowhere.
_OUT_ROWS_ENV = os.environ.get("MXATTN_BWD_OUT_ROWS", "auto")
if _OUT_ROWS_ENV not in ("auto", "0", "1"):
    raise ValueError(f"MXATTN_BWD_OUT_ROWS must be auto, 0 or 1, got {_OUT_ROWS_ENV!r}")
OUT_ROWS = gl.constexpr(_OUT_ROWS_ENV != "0")  # dQ
OUT_ROWS_DKDV = gl.constexpr({"auto": 128, "1": 64, "0": 0}[_OUT_ROWS_ENV])  # dK/dV: rows from this query step up
# GluonDqConfig.amax_slots's default, read once at import (MXATTN_DQ_AMAX_SLOTS=0 / 1)
_AMAX_SLOTS = os.environ.get("MXATTN_DQ_AMAX_SLOTS", "1") == "1"
ROW_GROUP = 128  # q / dout_hdim rows per exponent must be a multiple of this (one scalar per 128-row tile)


@dataclass(frozen=True)
class GluonDqConfig:
    """Ring depth and register split (not tuned on the GPU yet)."""

    stages: int = 3  # K / V_hdim / K_seq ring depth (24 KB per stage at d128)
    maxnreg: int = 168  # 12 warps (8 consumers + the producer's warpgroup) * 32 * 168 <= 65536
    producer_regs: int = 24
    # split: the two consumer warpgroups as two 4-warp partitions of 64 query rows, each with its own dS exponent
    # per (64 x 64) tile, i.e. the tl dQ kernel with 64-row blocks (``split_tl_config``); they share the K / V ring
    # (empty barriers count two arrivals).  The API's default (``attn_bwd.gluon_split``) since it measured faster.
    split: bool = False
    consumer_regs: int = 240  # registers per thread of consumer warpgroup 1 (a worker partition) when split
    # keys per step (session 9): 64, or 128 at D = 64 on dense launches (``check_block_n``).  The key tile is also
    # the dS exponent's tile (rows x block_n) and the step of the K / V / K_seq ring; with 128 the S and dP
    # accumulators are 64 x 128 fp32 per warpgroup (64 registers a thread each, against 32 for dQ at d64), and the
    # kernel takes half the steps (barriers, waits and per-step fixed costs) per score.  Twin: ``tl_twin_config``
    block_n: int = 64
    # K and V_hdim loaded key-permuted (the forward's ``K_PERM``, session 20) where Sk % 16 == 0 on dense launches:
    # S's and dP's accumulators then hold dS in the order of dQ's A operand (a relabel of its columns, no quad
    # shuffles or byte permutes: ~33 of the 400 instructions of a d128 step).  The same values in the same places:
    # bit-identical to False (the jagged launcher keeps the 2-D boxes)
    k_perm: bool = True
    # the dS tile's maximum through one shared fp32 slot per warp and one barrier (``_tile_amax``), instead of the
    # compiler's cross-warp reduction (three barriers a step); the same maximum, so bit-identical to False.  The
    # default since session 23 (H100: the dQ kernel 1.049-1.064x at d128 S 4k / 8k, 1.025-1.043x at d64 S 8k,
    # `attn_bwd_kernels-…-s23-dqslots.json`); MXATTN_DQ_AMAX_SLOTS=0 turns it off
    amax_slots: bool = _AMAX_SLOTS
    # causal launches: CTAs heaviest query block first over sections of about two waves of heads
    # (kernels/cta_order.py) instead of head by head, which leaves heavy blocks of the last heads for the grid's
    # tail.  The same CTAs computing the same tiles: bit-identical.  None: MXATTN_CAUSAL_LPT's choice
    # (``launch.causal_lpt``), on by default (session 24, H100, kernel alone: d128 S 4k / 8k 1.066x / 1.009x, d64
    # S 8k 1.032x; `attn_bwd_kernels-…-s24-lpt-dq.json`)
    causal_lpt: Optional[bool] = None

    def __post_init__(self):
        if type(self.block_n) is not int or self.block_n not in BLOCK_NS:
            raise ValueError(f"block_n must be one of {BLOCK_NS}, got {self.block_n!r}")


def default_config(head_dim: int, causal: bool) -> GluonDqConfig:
    return GluonDqConfig()


def check_block_n(cfg: GluonDqConfig, head_dim: int, varlen: bool = False) -> None:
    """ValueError unless the launch takes ``cfg.block_n``: 64 always; 128 only at D = 64 (at D = 128 the S, dP and
    dQ accumulators take 64 + 64 + 64 registers a thread, plus dS crossing the loop edge: the split build spills
    80 B, 8 LDL/STL per step, compile check of session 9) and dense: the
    jagged layout zero-pads each sequence's K_seq columns to 64 (``varlen.BWD_SEQ_ALIGN``), so a 128-key box
    would read the next sequence's columns (dS = 0 there, but 0 x Inf = NaN)."""
    if cfg.block_n == 64:
        return
    if varlen:
        raise ValueError(f"block_n={cfg.block_n}: the jagged (VARLEN) Gluon dQ kernel takes block_n=64 only")
    if head_dim != 64:
        raise ValueError(f"block_n={cfg.block_n} needs head dim 64 (got {head_dim}); use block_n=64")


def split_tl_config(dq_block_n: int = 64):
    """The ``tl`` tiles whose numerics the split Gluon kernels reproduce: 64-row dQ blocks and 64-key dK/dV blocks
    (the dS exponent per 64 x 64 tile in both), 4 warps, the separate dQ kernel.  ``dq_block_n``: the dQ blocks'
    keys (the split dQ build with ``block_n=128``: a 64 x 128 exponent tile)."""
    from mxattn.kernels.attn_bwd import BwdConfig

    return BwdConfig(block_m=64, block_n=64, num_warps=4, dq_block_m=64, dq_block_n=dq_block_n, dq_num_warps=4,
                     dq_kernel=True)


def tl_twin_config(config: Optional[GluonDqConfig] = None):
    """The ``attn_bwd.BwdConfig`` whose dQ kernel (``attn_bwd._bwd_dq_kernel``) has this Gluon build's numerics
    (the same key tiles in the same order, dS exponents and e4m3 dS values; only the fp32 summation order
    differs): 128 rows on 8 warps (``BwdConfig()``'s dQ tiles), or 64 rows on 4 warps (``split_tl_config``) for
    the split build, with ``dq_block_n = config.block_n``."""
    from mxattn.kernels.attn_bwd import BwdConfig

    cfg = config or default_config(128, False)
    if cfg.split:
        return split_tl_config(dq_block_n=cfg.block_n)
    return replace(BwdConfig(), dq_block_n=cfg.block_n)


# ------------------------------------------------------------------------------------------------- helpers
@gluon.constexpr_function
def _mma_layout(n, warps):
    # warps // 4 warpgroups along M (64 rows each), wgmma m64nNk32 per warpgroup
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 32])


@gluon.jit
def _pow2(e):
    """Exact fp32 2^e for an int32 e, clamped to [-126, 127] (attn_bwd._pow2)."""
    e = gl.minimum(gl.maximum(e, -126), 127)
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _rceil_exp(amax, keep):
    """Smallest e with amax * 2^-e <= 448 (RCEIL), clamped to [-126, 126]; ``keep`` where amax == 0."""
    bits = amax.to(gl.int32, bitcast=True)
    e = (bits >> 23) - (127 + 8) + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)
    e = gl.minimum(gl.maximum(e, -126), 126)
    return gl.where(amax > 0.0, e, keep)


@gluon.jit
def _sticky_exp(e_tile, e_prev):
    """Hysteresis: keep e_prev unless the tile would saturate under it or sits DS_HYSTERESIS = 2 binades lower."""
    keep = (e_tile <= e_prev) & (e_tile >= e_prev - 2)
    return gl.where(keep, e_prev, e_tile)


@gluon.jit
def _ds_tile(s, dp, a_q, ke, ve, b_row, delta, dscale, e_prev, e_hi, offs_m, n0, Sk, causal_off, slots,
             MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, K_PERM: gl.constexpr,
             WARPS: gl.constexpr, AMAX_SLOTS: gl.constexpr):
    """dS of one (rows x BLOCK_N) tile from the raw S and dP accumulators -> (dS·2^-e in fp32, e).

    Same arithmetic as attn_bwd._dq_step: x = S·(a_q·2^ke) + b_row (−inf where masked), P = 2^x, dS = P·(dP·c − δ)
    with c = 2^(doe+ve), then the tile's exponent from its amax (both warpgroups' rows: a cross-warp reduction)."""
    a = a_q * _pow2(ke)
    x = gl.fma(s, a, gl.expand_dims(b_row, 1))
    if MASKED:
        # local key index against scalar bounds (32-bit compares)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        if K_PERM:
            cols = _key_of_column(cols)  # column c holds key sigma(c)
        cols = gl.expand_dims(cols, 0)
        keep = cols < Sk - n0
        if CAUSAL:
            keep = keep & (cols <= gl.expand_dims(offs_m + (causal_off - n0), 1))
        x = gl.where(keep, x, float("-inf"))
    p = gl.exp2(x)  # P * 256, 0 where masked or where the row sees nothing
    ds = p * gl.fma(dp, dscale * _pow2(ve), -gl.expand_dims(delta, 1))  # 256 * dS
    amax = _tile_amax(ds, slots, WARPS, AMAX_SLOTS)
    e = gl.maximum(_sticky_exp(_rceil_exp(amax, e_prev), e_prev), e_hi - 64)  # _bounded_exp(_sticky_exp(...))
    return ds * _pow2(-e), e


@gluon.jit
def _tile_amax(ds, slots, WARPS: gl.constexpr, AMAX_SLOTS: gl.constexpr):
    """max |ds| over the whole tile (all warps of the partition).  AMAX_SLOTS: each warp's maximum (quad shuffles,
    then the warp's rows: a reshape that keeps the warp dimension) goes to its fp32 slot in ``slots``, one barrier,
    then every thread reads the WARPS slots; otherwise the compiler's reduction across warps (two barriers through
    its scratch, and one before its first store).  The same maximum either way."""
    if AMAX_SLOTS:
        ROWS: gl.constexpr = ds.shape[0]
        row_max = gl.max(gl.abs(ds), 1)
        warp_max = gl.max(gl.reshape(row_max, [WARPS, ROWS // WARPS]), 1)
        slots.store(warp_max)
        gl.thread_barrier()
        amax = gl.max(slots.load(gl.BlockedLayout([WARPS], [32], [WARPS], [0])), 0)
    else:
        amax = gl.max(gl.max(gl.abs(ds), 1), 0)
    return amax


@gluon.jit
def _ds_step(s, dp, a_q, KE, VE, stride_ket, stride_vet, b_row, delta, dscale, e_prev, e_hi, offs_m, n0, masked,
             Sk, causal_off, slots, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, K_PERM: gl.constexpr,
             WARPS: gl.constexpr, AMAX_SLOTS: gl.constexpr):
    """One tile's dS with the masked / unmasked choice made at run time (the branches join fp32 values only).  The
    k / v exponent of keys n0 .. n0 + BLOCK_N − 1: one group of 128 keys (two 64-key steps share it, or one
    128-key step has it alone)."""
    ke = gl.load(KE + (n0 // KV_EXP_GROUP) * stride_ket)
    ve = gl.load(VE + (n0 // KV_EXP_GROUP) * stride_vet)
    if masked:
        ds, e = _ds_tile(s, dp, a_q, ke, ve, b_row, delta, dscale, e_prev, e_hi, offs_m, n0, Sk, causal_off, slots,
                         True, CAUSAL, BLOCK_N, K_PERM, WARPS, AMAX_SLOTS)
    else:
        ds, e = _ds_tile(s, dp, a_q, ke, ve, b_row, delta, dscale, e_prev, e_hi, offs_m, n0, Sk, causal_off, slots,
                         False, CAUSAL, BLOCK_N, K_PERM, WARPS, AMAX_SLOTS)
    return ds, e


@gluon.jit
def _ds_operand(ds, ds_layout: gl.constexpr, K_PERM: gl.constexpr):
    """dS·2^-e (fp32, S accumulator layout) -> e4m3 in dQ's A operand layout.  K_PERM: relabelled by key (a layout
    change only) and cast a word of four keys at a time (``attn_fwd_gluon._pack_p`` / ``_unpack_p``: 2 F2FP per word,
    no byte permutes); otherwise the compiler's conversion (quad shuffles and byte permutes)."""
    if K_PERM:
        return _unpack_p(_pack_p(ds, ds_layout, True), ds_layout)
    else:
        return gl.convert_layout(ds.to(gl.float8e4nv), ds_layout)


@gluon.jit
def _rescale(acc, acc_e, e_new):
    """The accumulator moved to units of 2^e_new (exact); a skipped branch on most tiles (hysteresis)."""
    if e_new != acc_e:
        acc = acc * _pow2(acc_e - e_new)
    return acc


@gluon.jit
def _static_tiles(a_desc, b_desc, SPLIT: gl.constexpr):
    """Shared memory for the two operand tiles a CTA loads once (Q and dO here, K and V_hdim in the dK/dV kernel):
    one box each, or, split, one box per consumer warpgroup (the descriptors' boxes are then half the rows)."""
    if SPLIT:
        a = gl.allocate_shared_memory(a_desc.dtype, [2] + a_desc.block_type.shape, a_desc.layout)
        b = gl.allocate_shared_memory(b_desc.dtype, [2] + b_desc.block_type.shape, b_desc.layout)
    else:
        a = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
        b = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    return a, b


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The mbarriers of both backward kernels: one for the tiles loaded once, and ready / empty per stage of the two
    rings (count 1 with expect-tx for ready; empty counts one arrival per consumer partition: the 8-warp consumer,
    or each warpgroup when split).  Returns (once, a_ready, a_empty, b_ready, b_empty)."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=2 if SPLIT else 1)
        mbarrier.init(b_empty.index(i), count=2 if SPLIT else 1)
    return once, a_ready, a_empty, b_ready, b_empty


@gluon.jit
def _tile_row(SLOTS):
    """Row ``program_id(0)`` of a jagged tile table (kernels/bwd_varlen_tiles.py; 16 int32 per row), loaded once by
    both backward kernels: (sequence, tile start, q_start, len_q, k_start, len_k, q / k exponent group starts, seq
    column start, dout_hdim group start, δ column start)."""
    row = SLOTS + gl.program_id(0) * 16
    q_start = gl.load(row + 2)
    k_start = gl.load(row + 4)
    return (gl.load(row), gl.load(row + 1), q_start, gl.load(row + 3) - q_start, k_start, gl.load(row + 5) - k_start,
            gl.load(row + 6), gl.load(row + 7), gl.load(row + 8), gl.load(row + 9), gl.load(row + 10))


# ------------------------------------------------------------------------------------------------- producer
@gluon.jit
def _producer_steps(k_desc, v_desc, ks_desc, k_smem, v_smem, ks_smem, kv_ready, kv_empty, ks_ready, ks_empty,
                    k_row, k_col, ks_row, ks_col, n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                    K_PERM: gl.constexpr):
    """Per key tile: K and V_hdim (BLOCK_N x D; K_PERM: the 5-D key-permuted boxes, by 16-key group index) and
    K_seq (D x BLOCK_N, from column ks_col: 0 dense, the sequence's first column when jagged) into the STAGES-deep
    rings."""
    for i in range(n_tiles):
        s = i % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
        ph = ((i // STAGES) & 1) ^ 1
        mbarrier.wait(kv_empty.index(s), ph)
        mbarrier.expect(kv_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        if K_PERM:  # k_row = b * Sk, Sk % 16 == 0
            g = (k_row + i * BLOCK_N) // 16
            tma.async_copy_global_to_shared(k_desc, [g, 0, 0, 0, k_col], kv_ready.index(s), k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [g, 0, 0, 0, k_col], kv_ready.index(s), v_smem.index(s))
        else:
            tma.async_copy_global_to_shared(k_desc, [k_row + i * BLOCK_N, k_col], kv_ready.index(s),
                                            k_smem.index(s))
            tma.async_copy_global_to_shared(v_desc, [k_row + i * BLOCK_N, k_col], kv_ready.index(s),
                                            v_smem.index(s))
        mbarrier.wait(ks_empty.index(s), ph)
        mbarrier.expect(ks_ready.index(s), ks_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ks_desc, [ks_row, ks_col + i * BLOCK_N], ks_ready.index(s), ks_smem.index(s))


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, ks_desc, q_smem, do_smem, k_smem, v_smem, ks_smem,
              q_bar, kv_ready, kv_empty, ks_ready, ks_empty,
              q_row, q_col, k_row, k_col, ks_row, ks_col, n_tiles,
              STAGES: gl.constexpr, BLOCK_N: gl.constexpr, K_PERM: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [q_row, q_col], q_bar, do_smem)
    _producer_steps(k_desc, v_desc, ks_desc, k_smem, v_smem, ks_smem, kv_ready, kv_empty, ks_ready, ks_empty,
                    k_row, k_col, ks_row, ks_col, n_tiles, STAGES, BLOCK_N, K_PERM)


@gluon.jit
def _producer_split(q_desc, do_desc, k_desc, v_desc, ks_desc, q_smem, do_smem, k_smem, v_smem, ks_smem,
                    q_bar, kv_ready, kv_empty, ks_ready, ks_empty,
                    q_row, q_col, k_row, k_col, ks_row, ks_col, n_tiles,
                    STAGES: gl.constexpr, BLOCK_N: gl.constexpr, K_PERM: gl.constexpr):
    """The split kernel's producer: a 64-row Q and dO tile per consumer warpgroup, then the same key tiles."""
    mbarrier.expect(q_bar, 2 * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * WG_ROWS, q_col], q_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [q_row + w * WG_ROWS, q_col], q_bar, do_smem.index(w))
    _producer_steps(k_desc, v_desc, ks_desc, k_smem, v_smem, ks_smem, kv_ready, kv_empty, ks_ready, ks_empty,
                    k_row, k_col, ks_row, ks_col, n_tiles, STAGES, BLOCK_N, K_PERM)


# ------------------------------------------------------------------------------------------------- consumer
@gluon.jit
def _dq_loop(q_smem, do_smem, k_smem, v_smem, ks_smem, kv_ready, kv_empty, ks_ready, ks_empty,
             KE, VE, stride_ket, stride_vet, acc, a_q, b_row, delta, dscale, offs_m, Sk, causal_off, n_tiles, n_full,
             slots, STAGES: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr, ds_layout: gl.constexpr,
             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, K_PERM: gl.constexpr,
             WARPS: gl.constexpr, AMAX_SLOTS: gl.constexpr):
    """The key loop (n_tiles >= 1).  Returns (acc, its exponent).  K_PERM: S and dP column c holds key sigma(c)
    (``attn_fwd_gluon._key_of_column``), and dS reaches dQ's A operand by a relabel (``_ds_operand``)."""
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    # issue block 0: S_0 and dP_0 alone
    mbarrier.wait(kv_ready.index(0), 0)
    s = warpgroup_mma(q_smem, _k_operand(k_smem.index(0), BLOCK_N, HEAD_DIM, K_PERM), s_zero, use_acc=False,
                      is_async=True)
    dp = warpgroup_mma(do_smem, _k_operand(v_smem.index(0), BLOCK_N, HEAD_DIM, K_PERM), s_zero, use_acc=False,
                       is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    mbarrier.arrive(kv_empty.index(0), count=1)
    acc_e = 0
    e_hi = -1000  # no bound until the accumulator holds something
    ds, e = _ds_step(s, dp, a_q, KE, VE, stride_ket, stride_vet, b_row, delta, dscale, acc_e, e_hi, offs_m, 0,
                     n_full == 0, Sk, causal_off, slots, CAUSAL, BLOCK_N, K_PERM, WARPS, AMAX_SLOTS)
    e_hi = gl.maximum(e_hi, e)
    for j in range(1, n_tiles):
        st = j % STAGES
        sp = (j - 1) % STAGES
        ds8 = _ds_operand(ds, ds_layout, K_PERM)
        acc = _rescale(acc, acc_e, e)
        acc_e = e
        mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(ks_ready.index(sp), ((j - 1) // STAGES) & 1)
        s = warpgroup_mma(q_smem, _k_operand(k_smem.index(st), BLOCK_N, HEAD_DIM, K_PERM), s_zero, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_smem, _k_operand(v_smem.index(st), BLOCK_N, HEAD_DIM, K_PERM), s_zero,
                           use_acc=False, is_async=True)
        acc = warpgroup_mma(ds8, ks_smem.index(sp).permute((1, 0)), acc, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))  # S_j, dP_j; dS_{j-1} K_seq_{j-1} runs on
        mbarrier.arrive(kv_empty.index(st), count=1)
        ds, e = _ds_step(s, dp, a_q, KE, VE, stride_ket, stride_vet, b_row, delta, dscale, acc_e, e_hi, offs_m,
                         j * BLOCK_N, j >= n_full, Sk, causal_off, slots, CAUSAL, BLOCK_N, K_PERM, WARPS, AMAX_SLOTS)
        e_hi = gl.maximum(e_hi, e)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(ks_empty.index(sp), count=1)
    # last issue block: acc += dS_{n-1} K_seq_{n-1}
    sp = (n_tiles - 1) % STAGES
    ds8 = _ds_operand(ds, ds_layout, K_PERM)
    acc = _rescale(acc, acc_e, e)
    mbarrier.wait(ks_ready.index(sp), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(ds8, ks_smem.index(sp).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(ks_empty.index(sp), count=1)
    return acc, e


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, ks_smem, q_bar, kv_ready, kv_empty, ks_ready, ks_empty,
              QE, DOE, KE, VE, KSE, LSE, DELTA, DQ,
              stride_ket, stride_vet, stride_ksed, stride_lm, stride_dlm, stride_dqm, stride_dqd,
              start_m, Sq, Sk, causal_off, n_tiles, n_full, qk_scale, grad_scale,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
              WARPS: gl.constexpr, BLOCK_N: gl.constexpr, K_PERM: gl.constexpr, AMAX_SLOTS: gl.constexpr):
    """ROWS query rows start_m .. start_m + ROWS − 1 of one (b, h): 128 on 8 warps (the CTA's rows), or 64 on one
    warpgroup (split); q_smem / do_smem their Q and dO tiles.  Pointers already moved to (b, h) / (b, hk) and, for
    QE / DOE, to the row group of start_m.  The dS exponent is one per (ROWS x BLOCK_N) tile.

    Split, the CTA's key range is warpgroup 1's: causal, warpgroup 0 also walks the tiles past its last row's
    keys (the tl kernel with 64-row blocks stops before them, at 64 or 128 keys a step); they are all masked, so
    P = dS = 0 and the exponent stays (amax 0 keeps it; the bound of ``_bounded_exp`` does not move)."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, WARPS)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    offs_m = start_m + gl.arange(0, ROWS, layout=row_s)
    row_ok = offs_m < Sq
    lse = gl.load(LSE + offs_m * stride_lm, mask=row_ok, other=float("-inf"))
    delta = gl.load(DELTA + offs_m * stride_dlm, mask=row_ok, other=0.0)
    # exponent of P*256 = S*log2e*scale - lse*log2e + 8; rows that see nothing (lse = -inf) and rows past Sq: -inf
    b_row = gl.where(lse == float("-inf"), float("-inf"), 8.0 - lse * 1.4426950408889634)
    a_q = qk_scale * _pow2(gl.load(QE))  # the tile's rows share one exponent group
    dscale = _pow2(gl.load(DOE))

    if AMAX_SLOTS:  # one fp32 per warp: the dS tile's partial maxima (``_tile_amax``)
        slots = gl.allocate_shared_memory(gl.float32, [WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        slots = None
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    acc_e = 0
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        acc, acc_e = _dq_loop(q_smem, do_smem, k_smem, v_smem, ks_smem, kv_ready, kv_empty, ks_ready, ks_empty,
                              KE, VE, stride_ket, stride_vet, acc, a_q, b_row, delta, dscale, offs_m, Sk,
                              causal_off, n_tiles, n_full, slots, STAGES, CAUSAL, s_layout, ds_layout, ROWS,
                              BLOCK_N, HEAD_DIM, K_PERM, WARPS, AMAX_SLOTS)

    # ---- epilogue: dq = acc * 2^acc_e * 2^kse[d] * scale * 2^-8
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    kse = gl.load(KSE + offs_d * stride_ksed)
    colscale = _pow2(kse) * grad_scale * _pow2(acc_e)
    dq = acc * gl.expand_dims(colscale, 0)
    if OUT_ROWS:  # whole rows through shared memory
        _store_tile_rows(DQ, dq.to(DQ.dtype.element_ty), start_m, Sq, stride_dqm, stride_dqd, ROWS, HEAD_DIM, WARPS)
    else:
        offs_mo = start_m + gl.arange(0, ROWS, layout=row_o)
        ptrs = DQ + gl.expand_dims(offs_mo.to(gl.int64) * stride_dqm, 1) + gl.expand_dims(offs_d * stride_dqd, 0)
        gl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=gl.expand_dims(offs_mo < Sq, 1))


# ------------------------------------------------------------------------------------------------- kernel
@gluon.jit
def _attn_bwd_dq_ws_kernel(
    q_desc, do_desc, k_desc, v_desc, ks_desc, QE, DOE, KE, VE, KSE, LSE, DELTA, DQ,
    stride_qeb, stride_qeg, stride_qeh,
    stride_deb, stride_deg, stride_deh,
    stride_keb, stride_ket, stride_keh,
    stride_veb, stride_vet, stride_veh,
    stride_kseb, stride_kseh, stride_ksed,
    stride_lb, stride_lh, stride_lm,
    stride_dlb, stride_dlh, stride_dlm,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    Hq, Hkv, Sq, Sk, group_size, q_group, do_group, qk_scale, grad_scale,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, BLOCK_N: gl.constexpr,
    SLOTS=None,  # jagged: the (rows, SLOT_COLS) int32 tile table of kernels/bwd_varlen_tiles.py (None: dense)
    VARLEN: gl.constexpr = False,
    K_PERM: gl.constexpr = False,  # K and V_hdim through the 5-D key-permuted boxes (dense, Sk % 16 == 0)
    AMAX_SLOTS: gl.constexpr = False,  # the dS tile's maximum through per-warp slots (GluonDqConfig.amax_slots)
    LPT_SECTION: gl.constexpr = 0,  # causal CTA order by sections of heads (GluonDqConfig.causal_lpt)
):
    """Dense: grid (cdiv(Sq, 128), B * Hq).  Jagged (VARLEN): grid (table rows, Hq); CTA (r, h) computes the query
    tile of row r of SLOTS (heaviest first) for query head h, on packed operands: q / dout_hdim (Tq, Hq, D) and k /
    v_hdim (Tk, Hkv, D) as 2-D TMA views, their exponents (groups, H, 1) with the sequence's groups from row
    SLOTS[r, 6] / [9] / [7], k_seq channel-major (Hkv, D, Tv) with the sequence's 64-aligned columns from
    SLOTS[r, 8], zero to the next 64 (so no box reads another sequence), its exponents (B, Hkv, D), lse / dq
    packed (Hq, Tq) / (Tq, Hq, D), δ (Hq, Tv) in the padded layout from column SLOTS[r, 10].  After the prologue the code is the dense code at that sequence's Sq, Sk: rows
    past Sq (next sequence's rows in the Q / dO boxes) get lse = −inf (P = dS = 0) and are not stored, keys past
    Sk are masked in the last tile (and zero in K_seq)."""
    if VARLEN:
        # sequence order and tile order come from the table (no heaviest-first flip here)
        b, start_m, q_start, Sq, k_start, Sk, qg_start, kg_start, ks_col, dog_start, d_col = _tile_row(SLOTS)
        if start_m >= Sq:  # rows past the real tiles are zero: 0 >= 0
            return
        h = gl.program_id(1)
        hk = h // group_size
    else:
        # heaviest causal query blocks (the last ones) first: per head as the tl kernel, or per section of heads
        pid_m, pid_bh = _cta_order(gl.program_id(0), gl.program_id(1), gl.num_programs(0), gl.num_programs(1),
                                   LPT_SECTION, CAUSAL)
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // group_size
        start_m = pid_m * BLOCK_M

    causal_off = Sk - Sq
    if CAUSAL:
        hi = gl.minimum(Sk, gl.maximum(start_m + BLOCK_M + causal_off, 0))
        full_end = gl.minimum((Sk // BLOCK_N) * BLOCK_N,
                              (gl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        full_end = (Sk // BLOCK_N) * BLOCK_N
    n_tiles = gl.cdiv(hi, BLOCK_N)
    n_full = full_end // BLOCK_N

    q_smem, do_smem = _static_tiles(q_desc, do_desc, SPLIT)  # 64-row boxes when split
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES] + ks_desc.block_type.shape, ks_desc.layout)
    q_bar, kv_ready, kv_empty, ks_ready, ks_empty = _ring_barriers(STAGES, SPLIT)

    b64 = b.to(gl.int64)
    if VARLEN:
        h64 = h.to(gl.int64)  # lse / δ head strides are Tq: their products pass 2^31 in large batches
        q_row = q_start + start_m
        k_row = k_start
        ks_row = hk * HEAD_DIM
        QE_t = QE + h * stride_qeh + (qg_start + start_m // q_group) * stride_qeg
        DOE_t = DOE + h * stride_deh + (dog_start + start_m // do_group) * stride_deg
        KE_bh = KE + hk * stride_keh + kg_start * stride_ket
        VE_bh = VE + hk * stride_veh + kg_start * stride_vet
        LSE_bh = LSE + h64 * stride_lh + q_start * stride_lm
        DELTA_bh = DELTA + h64 * stride_dlh + d_col * stride_dlm  # padded δ: the sequence's columns
        DQ_bh = DQ + q_start.to(gl.int64) * stride_dqm + h * stride_dqh
    else:
        q_row = b * Sq + start_m
        k_row = b * Sk
        ks_row = (b * Hkv + hk) * HEAD_DIM
        ks_col = 0
        QE_t = QE + b64 * stride_qeb + h * stride_qeh + (start_m // q_group) * stride_qeg
        DOE_t = DOE + b64 * stride_deb + h * stride_deh + (start_m // do_group) * stride_deg
        KE_bh = KE + b64 * stride_keb + hk * stride_keh
        VE_bh = VE + b64 * stride_veb + hk * stride_veh
        LSE_bh = LSE + b64 * stride_lb + h * stride_lh
        DELTA_bh = DELTA + b64 * stride_dlb + h * stride_dlh
        DQ_bh = DQ + b64 * stride_dqb + h * stride_dqh
    KSE_bh = KSE + b64 * stride_kseb + hk * stride_kseh
    if SPLIT:
        gl.warp_specialize([
            (_consumer, (q_smem.index(0), do_smem.index(0), k_smem, v_smem, ks_smem, q_bar, kv_ready, kv_empty,
                         ks_ready, ks_empty, QE_t, DOE_t, KE_bh, VE_bh, KSE_bh, LSE_bh, DELTA_bh, DQ_bh,
                         stride_ket, stride_vet, stride_ksed, stride_lm, stride_dlm, stride_dqm, stride_dqd,
                         start_m, Sq, Sk, causal_off, n_tiles, n_full, qk_scale, grad_scale,
                         HEAD_DIM, STAGES, CAUSAL, 64, 4, BLOCK_N, K_PERM, AMAX_SLOTS)),
            (_consumer, (q_smem.index(1), do_smem.index(1), k_smem, v_smem, ks_smem, q_bar, kv_ready, kv_empty,
                         ks_ready, ks_empty, QE_t, DOE_t, KE_bh, VE_bh, KSE_bh, LSE_bh, DELTA_bh, DQ_bh,
                         stride_ket, stride_vet, stride_ksed, stride_lm, stride_dlm, stride_dqm, stride_dqd,
                         start_m + WG_ROWS, Sq, Sk, causal_off, n_tiles, n_full, qk_scale, grad_scale,
                         HEAD_DIM, STAGES, CAUSAL, 64, 4, BLOCK_N, K_PERM, AMAX_SLOTS)),
            (_producer_split, (q_desc, do_desc, k_desc, v_desc, ks_desc, q_smem, do_smem, k_smem, v_smem, ks_smem,
                               q_bar, kv_ready, kv_empty, ks_ready, ks_empty, q_row, h * HEAD_DIM,
                               k_row, hk * HEAD_DIM, ks_row, ks_col, n_tiles, STAGES, BLOCK_N, K_PERM)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, ks_smem, q_bar, kv_ready, kv_empty, ks_ready, ks_empty,
                         QE_t, DOE_t, KE_bh, VE_bh, KSE_bh, LSE_bh, DELTA_bh, DQ_bh,
                         stride_ket, stride_vet, stride_ksed, stride_lm, stride_dlm, stride_dqm, stride_dqd,
                         start_m, Sq, Sk, causal_off, n_tiles, n_full, qk_scale, grad_scale,
                         HEAD_DIM, STAGES, CAUSAL, 128, 8, BLOCK_N, K_PERM, AMAX_SLOTS)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, ks_desc, q_smem, do_smem, k_smem, v_smem, ks_smem,
                         q_bar, kv_ready, kv_empty, ks_ready, ks_empty,
                         q_row, h * HEAD_DIM, k_row, hk * HEAD_DIM, ks_row, ks_col, n_tiles,
                         STAGES, BLOCK_N, K_PERM)),
        ], [1], [PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------- launcher
def _is_rs(t) -> bool:
    return isinstance(t, RowScaledFP8)


def _row_group(t: RowScaledFP8, name: str) -> int:
    """Rows per exponent of a grouped hdim operand (group along the sequence), validated."""
    B, S, H, _ = t.data.shape
    if t.dim != 3 or t.group_dim != 1 or t.group < 1:
        raise ValueError(f"{name}: needs exponents blocked along the head dim and grouped along the sequence "
                         f"(dim=3, group_dim=1), got dim={t.dim}, group_dim={t.group_dim}, group={t.group}")
    want = (B, -(-S // t.group), H, 1)
    if tuple(t.exp.shape) != want:
        raise ValueError(f"{name}: exp {tuple(t.exp.shape)}, expected {want}")
    return t.group


def _hdim_view(data: torch.Tensor, name: str) -> torch.Tensor:
    """(B, S, H, D) data usable as a 2-D (B*S, H*D) TMA view (contiguous copy otherwise)."""
    if not data.is_contiguous():  # (one C call: the rows of the 2-D view are H*D apart, what TMA reads)
        data = data.contiguous()
    if data.data_ptr() % 16 or (data.shape[2] * data.shape[3]) % 16:
        raise ValueError(f"{name}: data must be 16-byte aligned for TMA")
    return data


def _check_seq_layout(name: str, t, B: int, S: int, H: int, D: int) -> None:
    """A sequence-blocked operand (q_seq, dout_seq, k_seq): one exponent per (head, channel), data the (B, S, H, D)
    view of a channel-major (B, H, D, S_pad) buffer the TMA boxes can read."""
    want = (B, 1, H, D)
    if t.dim != 1 or tuple(t.exp.shape) != want:
        raise ValueError(f"{name}: exp {tuple(t.exp.shape)} (dim={t.dim}), expected {want}: one exponent per "
                         f"channel, blocked along the sequence (the V layout)")
    sd = t.data
    s_pad = sd.stride(3)
    if (sd.stride(1) != 1 or sd.stride(2) != D * s_pad or sd.stride(0) != H * D * s_pad or s_pad % 16
            or s_pad < S or sd.data_ptr() % 16):
        raise ValueError(f"{name}: data must be the (B, S, H, D) view of a channel-major (B, H, D, S_pad) "
                         f"buffer, S_pad a multiple of 16 (formats.channel_major / row_scaled_triton(x, 'v'))")


def _check(q, k, v_hdim, k_seq, dout_hdim, lse, delta, grad_dtype):
    for name, t in (("q", q), ("k", k), ("v_hdim", v_hdim), ("k_seq", k_seq), ("dout_hdim", dout_hdim)):
        if not _is_rs(t):
            raise TypeError(f"{name} must be a RowScaledFP8, got {type(t).__name__}")
        if t.data.ndim != 4:
            raise ValueError(f"{name}: data must be (B, S, H, D), got {tuple(t.data.shape)}")
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported by the Gluon dQ kernel (64 or 128)")
    for name, t, want in (("k", k, (B, Sk, Hkv, D)), ("v_hdim", v_hdim, (B, Sk, Hkv, D)),
                          ("k_seq", k_seq, (B, Sk, Hkv, D)), ("dout_hdim", dout_hdim, (B, Sq, Hq, D))):
        if tuple(t.data.shape) != want:
            raise ValueError(f"{name}: data {tuple(t.data.shape)}, expected {want}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    for name, t in (("q", q), ("dout_hdim", dout_hdim)):
        g = _row_group(t, name)
        if g % ROW_GROUP:
            raise ValueError(f"{name}: {g} rows per exponent; the Gluon dQ kernel needs a multiple of {ROW_GROUP} "
                             f"(row_scaled_triton(x, 'k', k_group=128)); use attn_bwd's tl kernel otherwise")
    for name, t in (("k", k), ("v_hdim", v_hdim)):
        if _row_group(t, name) != KV_EXP_GROUP.value:
            raise ValueError(f"{name}: needs one exponent per {KV_EXP_GROUP.value} keys (the K layout), got group "
                             f"{t.group}")
    _check_seq_layout("k_seq", k_seq, B, Sk, Hkv, D)
    for name, t in (("lse", lse), ("delta", delta)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (B, Hq, Sq):
            raise ValueError(f"{name} must be a float32 tensor {(B, Hq, Sq)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if grad_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"grad_dtype must be bfloat16, float16 or float32, got {grad_dtype}")
    devs = {t.data.device for t in (q, k, v_hdim, k_seq, dout_hdim)} | {lse.device, delta.device}
    if len(devs) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devs))}")


def _descriptors(q, k, v_hdim, k_seq, dout_hdim, split: bool = False, block_n: int = 64, k_perm: bool = False):
    """(q, dout_hdim, k, v_hdim, k_seq) TMA descriptors; with ``k_perm`` (the caller checked ``k_perm_ok``) K's and
    V_hdim's over the 5-D key-permuted view (B*Sk/16, 2, 4, 2, Hkv*D) of the forward's ``_descriptors``."""
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    qd = _hdim_view(q.data, "q")
    dd = _hdim_view(dout_hdim.data, "dout_hdim")
    kd = _hdim_view(k.data, "k")
    vd = _hdim_view(v_hdim.data, "v_hdim")
    ksd = k_seq.data
    bm, bn = (WG_ROWS if split else BLOCK_M).value, block_n
    row_layout = nvmma_fp8_layout(bm, D)
    key_layout = nvmma_fp8_layout(bn, D)
    ks_layout = nvmma_fp8_layout(D, bn)
    q_desc = TensorDescriptor(qd, [B * Sq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
    do_desc = TensorDescriptor(dd, [B * Sq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
    if k_perm:
        k_desc = permuted_rows_descriptor(kd, B * Sk, Hkv * D, bn, D)
        v_desc = permuted_rows_descriptor(vd, B * Sk, Hkv * D, bn, D)
    else:
        k_desc = TensorDescriptor(kd, [B * Sk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
        v_desc = TensorDescriptor(vd, [B * Sk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
    ks_desc = TensorDescriptor(ksd, [B * Hkv * D, Sk], [ksd.stride(3), 1], [D, bn], ks_layout)
    return q_desc, do_desc, k_desc, v_desc, ks_desc


# Launch plans per call signature, as the dK/dV launcher's (attn_bwd_dkdv_gluon.py): a repeated call rebuilds its
# descriptors over its own tensors and launches the bound kernel, skipping the checks and the launcher's key.
_PLANS: dict = {}
_MAX_PLANS = 256


def _launch_key(q, k, v_hdim, k_seq, dout_hdim, lse, delta, causal, softmax_scale, grad_dtype, config):
    ops = tuple((tensor_sig(t.data), tensor_sig(t.exp), t.dim, t.group_dim, t.group) if _is_rs(t) else None
                for t in (q, k, v_hdim, k_seq, dout_hdim))
    if None in ops or not isinstance(lse, torch.Tensor) or not isinstance(delta, torch.Tensor) or not launch.PLANS:
        return None  # (bad operands: the checks on the slow path say what is wrong)
    dev = launch.current_device() if q.data.is_cuda else -1
    return (ops, tensor_sig(lse), tensor_sig(delta), causal, softmax_scale, grad_dtype, config, dev, launch.CAUSAL_LPT)


def plan_for(q, k, v_hdim, k_seq, dout_hdim, lse, delta, *, causal=False, softmax_scale=None,
             grad_dtype=torch.bfloat16, config=None):
    """The launch plan ``attn_bwd_dq_gluon`` made for a call with these arguments (None if it made none), for
    ``run_plan``: a caller that keeps it (``attn_bwd.attn_bwd_hopper``'s own plans) skips this launcher's key."""
    return _PLANS.get(_launch_key(q, k, v_hdim, k_seq, dout_hdim, lse, delta, causal, softmax_scale, grad_dtype,
                                  config))


def run_plan(plan, q, k, v_hdim, k_seq, dout_hdim, lse, delta, grad_dtype) -> torch.Tensor:
    """Launch ``plan`` (``plan_for``) on a call of its signature and return dq: the descriptors rebuilt over this
    call's tensors (``launch.rebased``), the bound kernel.  Unchecked: the plan's signature was checked when it was
    made."""
    bound, templates, scalars = plan
    dq = torch.empty(q.data.shape, dtype=grad_dtype, device=q.data.device)
    bases = (_hdim_view(q.data, "q"), _hdim_view(dout_hdim.data, "dout_hdim"), _hdim_view(k.data, "k"),
             _hdim_view(v_hdim.data, "v_hdim"), k_seq.data)
    bound(*(rebased(t, b) for t, b in zip(templates, bases)), q.exp, dout_hdim.exp, k.exp, v_hdim.exp, k_seq.exp,
          lse, delta, dq, *scalars)
    return dq


def attn_bwd_dq_gluon(q: RowScaledFP8, k: RowScaledFP8, v_hdim: RowScaledFP8, k_seq: RowScaledFP8,
                      dout_hdim: RowScaledFP8, lse: torch.Tensor, delta: torch.Tensor, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, grad_dtype: torch.dtype = torch.bfloat16,
                      config: Optional[GluonDqConfig] = None) -> torch.Tensor:
    """dQ of MXFP8 attention with the warp-specialized Gluon kernel: the operands ``attn_bwd.attn_bwd_hopper``
    passes to its deterministic dQ kernel.

    q:         (B, Sq, Hq, D) blocked along the head dim, grouped along the sequence by a multiple of 128 rows
               (``row_scaled_triton(q, "k", k_group=128)``).
    k, v_hdim: (B, Sk, Hkv, D), the K layout (``row_scaled_triton(x, "k")``).
    k_seq:     the V layout of K (``row_scaled_triton(k, "v")``: channel-major, one exponent per channel).
    dout_hdim: dO along the head dim, grouped like q (``attn_bwd.attn_bwd_preprocess`` makes it, with ``delta``).
    lse:       the forward's (B, Hq, Sq) float32 natural-log sum of exp (−inf for rows that see nothing).
    delta:     (B, Hq, Sq) float32 rowsum(dO_hdim ∘ O) (``attn_bwd_preprocess``).
    D is 64 or 128, Hq a multiple of Hkv; causal masks are aligned bottom-right.  Returns dq (B, Sq, Hq, D) in
    ``grad_dtype``, contiguous.  Needs an sm_90 GPU and triton 3.6's Gluon.
    """
    key = _launch_key(q, k, v_hdim, k_seq, dout_hdim, lse, delta, causal, softmax_scale, grad_dtype, config)
    plan = _PLANS.get(key)
    if plan is not None:  # a signature seen before: checked then
        return run_plan(plan, q, k, v_hdim, k_seq, dout_hdim, lse, delta, grad_dtype)
    _check(q, k, v_hdim, k_seq, dout_hdim, lse, delta, grad_dtype)
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    cfg = config or default_config(D, causal)
    if cfg.stages < 1:
        raise ValueError(f"stages must be >= 1, got {cfg.stages}")
    check_block_n(cfg, D)
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    dev = q.data.device
    if Sq == 0 or B * Hq == 0 or Sk == 0:
        return torch.zeros(B, Sq, Hq, D, dtype=grad_dtype, device=dev)
    dq = torch.empty(B, Sq, Hq, D, dtype=grad_dtype, device=dev)
    use_perm = cfg.k_perm and k_perm_ok(Sk, cfg.block_n)
    descs = _descriptors(q, k, v_hdim, k_seq, dout_hdim, cfg.split, cfg.block_n, use_perm)
    qe, de, ke, ve, kse = q.exp, dout_hdim.exp, k.exp, v_hdim.exp, k_seq.exp
    grid = (cdiv(Sq, BLOCK_M.value), B * Hq)
    scalars = (
        qe.stride(0), qe.stride(1), qe.stride(2),
        de.stride(0), de.stride(1), de.stride(2),
        ke.stride(0), ke.stride(1), ke.stride(2),
        ve.stride(0), ve.stride(1), ve.stride(2),
        kse.stride(0), kse.stride(2), kse.stride(3),
        *lse.stride(), *delta.stride(), *dq.stride(),
        Hq, Hkv, Sq, Sk, Hq // Hkv, q.group, dout_hdim.group,
        softmax_scale * LOG2E, softmax_scale * 2.0**-P_SCALE_LOG2,
    )
    constexprs = dict(HEAD_DIM=D, STAGES=cfg.stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs,
                      SPLIT=cfg.split, CONSUMER_REGS=cfg.consumer_regs, BLOCK_N=cfg.block_n, K_PERM=use_perm,
                      AMAX_SLOTS=cfg.amax_slots,
                      LPT_SECTION=launch.lpt_section(causal, cfg.causal_lpt, True, _sm_count(dev)),
                      num_warps=4 if cfg.split else 8, maxnreg=cfg.maxnreg)
    args = (*descs, qe, de, ke, ve, kse, lse, delta, dq, *scalars)
    if key is None:
        fast_launcher(_attn_bwd_dq_ws_kernel)[grid](*args, **constexprs)
        return dq
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (BoundLaunch(fast_launcher(_attn_bwd_dq_ws_kernel), grid, args, constexprs), unbased(descs), scalars)
    return dq


# ------------------------------------------------------------------------------------------------- jagged
def _packed_view(data: torch.Tensor, name: str) -> torch.Tensor:
    """Packed (T, H, D) e4m3 data usable as a 2-D (T, H*D) TMA view (contiguous copy otherwise)."""
    if not data.is_contiguous():
        data = data.contiguous()
    T, H, D = data.shape
    if data.data_ptr() % 16 or (H * D) % 16:
        raise ValueError(f"{name}: data must be 16-byte aligned for TMA")
    return data


def varlen_sig(t) -> Optional[tuple]:
    """What a jagged launch plan's key holds of a ``VarlenFP8`` operand (None for anything else): role, layout
    (v_blocks, align, whether it has group offsets), sequence count and max_seqlen (they size the grid), and its data
    and exponents' dtype, shape, strides and 16-byte alignment (``launch.tensor_sig``), with the data's device.  Not
    the offsets' values: they are read on the device only (the tile table)."""
    from mxattn.kernels.varlen import VarlenFP8

    if not isinstance(t, VarlenFP8):
        return None
    return (t.role, t.v_blocks, t.align, t.cu_exp is None, t.batch, t.max_seqlen, tensor_sig(t.data), t.data.device,
            tensor_sig(t.exp))


def check_varlen_operands(hdim: dict, seq: dict, vectors: dict, Hq: int, Hkv: int, grad_dtype) -> tuple[int, int]:
    """The jagged Gluon backward's operand rules (both kernels): ``hdim`` name -> VarlenFP8 in the K layout (one
    exponent per 128 rows from each sequence's start; q and dout_hdim over cu_seqlens_q, k and v_hdim over
    cu_seqlens_k), ``seq`` name -> VarlenFP8 in the V layout with ``varlen.BWD_SEQ_ALIGN``-aligned sequence starts
    (channel-major (H, D, Tv) rows, not per-sequence blocks), ``vectors`` name -> (Hq, Tq) float32 (lse, δ).
    Returns (B, D).  No device sync: offsets are not read."""
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN, K_GROUP, VarlenFP8

    B = D = None
    for name, t in list(hdim.items()) + list(seq.items()):
        if not isinstance(t, VarlenFP8):
            raise TypeError(f"{name} must be a VarlenFP8, got {type(t).__name__}")
        if B is None:
            B = t.batch
        elif t.batch != B:
            raise ValueError(f"{name}: {t.batch} sequences, expected {B}")
    for name, t in hdim.items():
        if t.role != "k" or t.cu_exp is None or t.data.ndim != 3 or t.exp.ndim != 3:
            raise ValueError(f"{name}: needs the K layout (role 'k': one exponent per {K_GROUP} rows from each "
                             f"sequence's start, varlen_k_operand), got role {t.role!r}")
        T, H, d = t.data.shape
        D = d if D is None else D
        if d != D or H != (Hq if name in ("q", "dout_hdim") else Hkv) or tuple(t.exp.shape[1:]) != (H, 1):
            raise ValueError(f"{name}: data {tuple(t.data.shape)}, exp {tuple(t.exp.shape)} do not match "
                             f"Hq={Hq}, Hkv={Hkv}, D={D}")
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported by the Gluon backward kernels (64 or 128)")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    for name, t in seq.items():
        H = Hq if name in ("q_seq", "dout_seq") else Hkv
        if (t.role != "v" or t.v_blocks or t.align % BWD_SEQ_ALIGN or t.data.ndim != 3
                or tuple(t.data.shape[:2]) != (H, D) or not t.data.is_contiguous() or t.data.shape[2] % 16
                or t.data.data_ptr() % 16 or tuple(t.exp.shape) != (B, H, D)):
            raise ValueError(f"{name}: needs the V layout in (H, D, Tv) rows with {BWD_SEQ_ALIGN}-aligned sequence "
                             f"starts (varlen_v_operand(..., align=BWD_SEQ_ALIGN)), got role {t.role!r}, align "
                             f"{t.align}, v_blocks {t.v_blocks}, data {tuple(t.data.shape)}, exp {tuple(t.exp.shape)}")
    Tq = hdim["q"].data.shape[0]
    for name, t in vectors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (Hq, Tq):
            raise ValueError(f"{name} must be a float32 tensor {(Hq, Tq)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if grad_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"grad_dtype must be bfloat16, float16 or float32, got {grad_dtype}")
    devs = {t.data.device for t in list(hdim.values()) + list(seq.values())} | {t.device for t in vectors.values()}
    if len(devs) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devs))}")
    return B, D


# Launch plans of the jagged launcher (as attn_bwd_dkdv_gluon's _VARLEN_PLANS): keyed on the operands'
# ``varlen_sig``s, lse, δ and the options; a hit skips the checks, the five descriptors' constructors and the
# launcher's key, and builds the call's own tile table (one launch).
_VARLEN_PLANS: dict = {}


def _varlen_launch_key(q, k, v_hdim, k_seq, dout_hdim, lse, delta, delta_cols, causal, softmax_scale, grad_dtype,
                       config):
    ops = tuple(varlen_sig(t) for t in (q, k, v_hdim, k_seq, dout_hdim))
    if None in ops or not all(isinstance(t, torch.Tensor) for t in (lse, delta, delta_cols)) or not launch.PLANS:
        return None  # (bad operands: the checks on the slow path say what is wrong)
    dev = launch.current_device() if q.data.is_cuda else -1
    return (ops, tensor_sig(lse), lse.device, tensor_sig(delta), delta.device, delta_cols.dtype, delta_cols.shape,
            causal, softmax_scale, grad_dtype, config, dev)


def attn_bwd_dq_gluon_varlen(q, k, v_hdim, k_seq, dout_hdim, lse: torch.Tensor, delta: torch.Tensor,
                             delta_cols: torch.Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                             grad_dtype: torch.dtype = torch.bfloat16,
                             config: Optional[GluonDqConfig] = None) -> torch.Tensor:
    """dQ of a jagged batch with the warp-specialized Gluon kernel in its jagged mode (``VARLEN``): the operands
    ``attn_bwd.attn_bwd_hopper_varlen`` passes to it (``kernels.varlen.VarlenFP8``).

    q, dout_hdim: (Tq, Hq, D), the K layout over cu_seqlens_q (``varlen_k_operand``; dout_hdim from
                  ``attn_bwd_preprocess_varlen``);  k, v_hdim: (Tk, Hkv, D), the K layout over cu_seqlens_k;
    k_seq:        K along the sequence, channel-major (Hkv, D, Tv) with 64-aligned zero-padded sequence starts
                  (``varlen_v_operand(k, ..., align=BWD_SEQ_ALIGN)``);
    lse:          (Hq, Tq) float32 (the jagged forward's);
    delta, delta_cols: δ (Hq, Tv) float32 in dout_seq's padded columns, sequence b from column delta_cols[b]
                  (``attn_bwd_preprocess_varlen(..., delta_padded=True)`` and ``dout_seq.cu_data``).
    One CTA per (query tile of 128 rows of one sequence, query head), tiles heaviest first
    (``bwd_varlen_tiles.bwd_tile_slots``: one small launch).  Returns dq (Tq, Hq, D) in ``grad_dtype``; each
    sequence's rows are ``attn_bwd_dq_gluon`` on that sequence alone (same tiles, same arithmetic).  Needs an sm_90
    GPU and triton 3.6's Gluon."""
    from mxattn.kernels.bwd_varlen_tiles import bwd_tile_slots, tile_rows_bound

    key = _varlen_launch_key(q, k, v_hdim, k_seq, dout_hdim, lse, delta, delta_cols, causal, softmax_scale,
                             grad_dtype, config)
    plan = _VARLEN_PLANS.get(key)
    if plan is None:  # first call of this signature: every check
        Tq, Hq, _ = q.data.shape
        Hkv = k.data.shape[1]
        B, D = check_varlen_operands(dict(q=q, k=k, v_hdim=v_hdim, dout_hdim=dout_hdim), dict(k_seq=k_seq),
                                     dict(lse=lse), Hq, Hkv, grad_dtype)
        if (not isinstance(delta, torch.Tensor) or delta.dtype != torch.float32 or delta.ndim != 2
                or delta.shape[0] != Hq or delta.device != lse.device):
            raise ValueError(f"delta must be the padded float32 ({Hq}, Tv) of attn_bwd_preprocess_varlen("
                             f"delta_padded=True), got {getattr(delta, 'dtype', type(delta).__name__)} "
                             f"{tuple(getattr(delta, 'shape', ()))}")
        if delta_cols.dtype != torch.int32 or tuple(delta_cols.shape) != (B + 1,):
            raise ValueError(f"delta_cols must be int32 ({B + 1},), got {delta_cols.dtype} {tuple(delta_cols.shape)}")
        Tk = k.data.shape[0]
        cfg = config or default_config(D, causal)
        if cfg.stages < 1:
            raise ValueError(f"stages must be >= 1, got {cfg.stages}")
        check_block_n(cfg, D, varlen=True)
        if Tq == 0 or Tk == 0 or B * Hq == 0:  # no key anywhere: every row sees nothing (no plan: no launch)
            return torch.zeros(Tq, Hq, D, dtype=grad_dtype, device=q.data.device)
    else:
        cfg = plan[4]
    Tq, Hq, D = q.data.shape
    Tk, Hkv, _ = k.data.shape
    dq = torch.empty(Tq, Hq, D, dtype=grad_dtype, device=q.data.device)
    slots = bwd_tile_slots(q.cu_seqlens, k.cu_seqlens, q.cu_exp, k.cu_exp, k_seq.cu_data, dout_hdim.cu_exp,
                           delta_cols, q.max_seqlen, key_tiles=False, causal=causal)
    qd, dd = _packed_view(q.data, "q"), _packed_view(dout_hdim.data, "dout_hdim")
    kd, vd = _packed_view(k.data, "k"), _packed_view(v_hdim.data, "v_hdim")
    ksd = k_seq.data
    bases = (qd, dd, kd, vd, ksd)
    tensors = (q.exp, dout_hdim.exp, k.exp, v_hdim.exp, k_seq.exp, lse, delta, dq)
    if plan is not None:  # a signature seen before: checked then; the descriptors rebuilt over today's tensors
        bound, templates, scalars, consts, _ = plan
        bound(*(rebased(t, b) for t, b in zip(templates, bases)), *tensors, *scalars, *consts, slots, True)
        return dq
    bm, bn = (WG_ROWS if cfg.split else BLOCK_M).value, cfg.block_n
    row_layout, key_layout = nvmma_fp8_layout(bm, D), nvmma_fp8_layout(bn, D)
    Tv = ksd.shape[2]
    descs = (TensorDescriptor(qd, [Tq, Hq * D], [Hq * D, 1], [bm, D], row_layout),
             TensorDescriptor(dd, [Tq, Hq * D], [Hq * D, 1], [bm, D], row_layout),
             TensorDescriptor(kd, [Tk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout),
             TensorDescriptor(vd, [Tk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout),
             TensorDescriptor(ksd, [Hkv * D, Tv], [Tv, 1], [D, bn], nvmma_fp8_layout(D, bn)))
    qe, de, ke, ve, kse = tensors[:5]
    grp = lambda e: (0, e.stride(0), e.stride(1))  # noqa: E731  (groups, H, 1), no batch dim
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    scalars = (*grp(qe), *grp(de), *grp(ke), *grp(ve), *kse.stride(),
               0, *lse.stride(), 0, *delta.stride(), 0, *dq.stride(),
               Hq, Hkv, 0, 0, Hq // Hkv, ROW_GROUP, ROW_GROUP, scale * LOG2E, scale * 2.0**-P_SCALE_LOG2)
    # HEAD_DIM .. BLOCK_N in signature order, then SLOTS and VARLEN
    consts = (D, cfg.stages, causal, cfg.producer_regs, cfg.split, cfg.consumer_regs, cfg.block_n)
    grid = (tile_rows_bound(Tq, q.batch, q.max_seqlen), Hq)
    # the step's options as keywords (a bound launch fixes its keywords; the 2-D boxes: K_PERM's default)
    options = dict(num_warps=4 if cfg.split else 8, maxnreg=cfg.maxnreg, AMAX_SLOTS=cfg.amax_slots)
    args = (*descs, *tensors, *scalars, *consts, slots, True)
    if key is None:
        fast_launcher(_attn_bwd_dq_ws_kernel)[grid](*args, **options)
        return dq
    if len(_VARLEN_PLANS) >= _MAX_PLANS:
        _VARLEN_PLANS.clear()
    bound = BoundLaunch(fast_launcher(_attn_bwd_dq_ws_kernel), grid, args, options)
    _VARLEN_PLANS[key] = (bound, unbased(descs), scalars, consts, cfg)
    return dq


# ------------------------------------------------------------------------------------------------- GPU timing
def _tl_dq(q, k, v_hdim, k_seq, dout_hdim, lse, delta, *, causal=False, softmax_scale=None,
           grad_dtype=torch.bfloat16, tl_config=None):
    """The ``tl`` dQ kernel (``attn_bwd._bwd_dq_kernel``) alone, launched as ``attn_bwd_hopper`` launches it on
    the deterministic path (default tiles 128 x 64, 8 warps, 2 stages, or ``tl_config``: ``split_tl_config()`` is
    the split Gluon kernel's twin), on grouped q / dO operands."""
    from mxattn.kernels import attn_bwd as ab

    cfg = tl_config or ab.BwdConfig()
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    dq = torch.empty(B, Sq, Hq, D, dtype=grad_dtype, device=q.data.device)
    qd, qe, kd, ke, vd, ve = q.data, q.exp, k.data, k.exp, v_hdim.data, v_hdim.exp
    ksd, kse, dhd, dhe = k_seq.data, k_seq.exp, dout_hdim.data, dout_hdim.exp
    row_e = lambda e: (e.stride(0), e.stride(1), e.stride(2))  # noqa: E731
    chan_e = lambda e: (e.stride(0), e.stride(2), e.stride(3))  # noqa: E731
    fast_launcher(ab._bwd_dq_kernel)[(cdiv(Sq, cfg.dq_block_m), B * Hq)](
        qd, qe, kd, ke, vd, ve, ksd, kse, dhd, dhe, lse, delta, dq,
        *qd.stride(), *row_e(qe), *kd.stride(), *row_e(ke), *vd.stride(), *row_e(ve),
        *ksd.stride(), *chan_e(kse), *dhd.stride(), *row_e(dhe), *lse.stride(), *dq.stride(),
        Hq, Sq, Sk, Hq // Hkv, softmax_scale * LOG2E, softmax_scale * 2.0**-P_SCALE_LOG2,
        ab._seq_load_bound(ksd), None, None, None, None, None, None,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, HEAD_DIM=D, CAUSAL=causal, Q_GROUP=q.group,
        DO_GROUP=dout_hdim.group, EXPLICIT_ROUND=False, num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages,
    )
    return dq


def backward_operands(q, k, v, dout, causal: bool, names: Sequence[str]):
    """From bf16 (B, S, H, D) q, k, v, dO: the forward's out / lse (``attn_fwd_hopper``) and, of the operands the
    Gluon backward kernels take (q grouped by 128 rows, k, v_hdim, q_seq, k_seq, dout_hdim, dout_seq, lse, delta),
    the ``names`` asked for.  GPU only (tests and benchmarks of attn_bwd_dq_gluon / attn_bwd_dkdv_gluon)."""
    from mxattn.kernels.attn_bwd import Q_EXP_GROUP, attn_bwd_preprocess
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton as rs

    kr = rs(k, "k")
    out, lse = attn_fwd_hopper(rs(q, "q"), kr, rs(v, "v"), causal=causal)
    doh, dos, delta = attn_bwd_preprocess(out, dout)
    make = dict(q=lambda: rs(q, "k", k_group=Q_EXP_GROUP), k=lambda: kr, v_hdim=lambda: rs(v, "k"),
                q_seq=lambda: rs(q, "v"), k_seq=lambda: rs(k, "v"), dout_hdim=lambda: doh, dout_seq=lambda: dos,
                lse=lambda: lse, delta=lambda: delta)
    return {n: make[n]() for n in names}, out


def dq_operands(q, k, v, dout, causal: bool):
    """``backward_operands`` for the dQ kernel: q, k, v_hdim, k_seq, dout_hdim, lse, delta (and the forward's out)."""
    return backward_operands(q, k, v, dout, causal, ("q", "k", "v_hdim", "k_seq", "dout_hdim", "lse", "delta"))


def time_against_tl(shapes: Sequence[tuple], operands, gluon_fn, tl_fn, products: int, rep_ms: int) -> list[dict]:
    """Time ``gluon_fn(**ops, causal=)`` against ``tl_fn(**ops, causal=)`` on the operands ``operands(q, k, v, dout,
    causal)`` makes from random bf16 inputs, per (B, Hq, Hkv, S, D, causal) shape (GPU).  TFLOP/s count
    ``products`` matrix products of 2 * B * Hq * S^2 * D each (half when causal).  One dict per shape: gluon_ms,
    tl_ms, speedup (tl / gluon), TFLOP/s of both; a failing side is recorded as ``<name>_error``."""
    rows = []
    for B, Hq, Hkv, S, D, causal in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda H: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
        ops, _ = operands(q, k, v, dout, causal)
        flops = products * 2 * B * Hq * S * S * D * (0.5 if causal else 1.0)
        row = {"B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "causal": causal}
        for name, fn in (("gluon", gluon_fn), ("tl", tl_fn)):
            try:
                ms = triton.testing.do_bench(lambda: fn(**ops, causal=causal), warmup=10, rep=rep_ms,
                                             return_mode="median")
                row[f"{name}_ms"] = ms
                row[f"{name}_tflops"] = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001 - record the failure, keep timing
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if row.get("gluon_ms") and row.get("tl_ms"):
            row["speedup"] = row["tl_ms"] / row["gluon_ms"]
        rows.append(row)
    return rows


def bench_attn_bwd_dq_gluon(shapes: Sequence[tuple] = ((2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True)),
                            rep_ms: int = 200, config: Optional[GluonDqConfig] = None) -> list[dict]:
    """Time the Gluon dQ kernel against the ``tl`` dQ kernel on the same prepared operands (GPU,
    ``time_against_tl``).  TFLOP/s count the kernel's 3 products (S, dP, dQ): 3 * 2 * B * Hq * S^2 * D, half when
    causal."""
    tl_config = tl_twin_config(config)
    return time_against_tl(shapes, dq_operands, lambda **ops: attn_bwd_dq_gluon(**ops, config=config),
                           lambda **ops: _tl_dq(**ops, tl_config=tl_config), products=3, rep_ms=rep_ms)
