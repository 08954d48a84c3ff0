"""MXFP8 attention backward, dK/dV part, for Hopper in Gluon: warp-specialized (DESIGN §3, perf-notes-attn-bwd.md
"Plan for the warp-specialized backward").

It replaces the ``tl`` kernel ``attn_bwd._bwd_dkdv_kernel`` on the "dQ from a separate kernel" path
(``ATOMIC_DQ=False``; ``DS_TILE_SCALE`` False for ``ds_exp="key"``, True for "tile") with the same operands and
the same arithmetic.  Per 128 keys of one
(batch, kv head), looping over the query heads of the GQA group and, per head, over query tiles of BLOCK_M = 64
(the default; 128 at d64 as an option, ``GluonDkdvConfig.block_m``, "128-query step" below):

  Sᵀ  = K Qᵀ            k (hdim, one exponent per 128 keys) x q (hdim, one exponent per 64+ rows), FP8 wgmma
  Pᵀ  = 2^(Sᵀ·2^(qe+ke)·scale·log2e + 8 − lse·log2e)      (P·256 <= 256; rows that see nothing: P = 0)
  dV += e4m3(Pᵀ) dO_seq   register A operand x channel-major dO_seq, FP8 wgmma
  dPᵀ = V dOᵀ           v_hdim (one exponent per 128 keys) x dout_hdim (one per 64+ rows), FP8 wgmma
  dSᵀ = Pᵀ ∘ (dPᵀ·2^(doe+ve) − δ)                          (256·dS, fp32)
  dK += e4m3(dSᵀ·2^-e) Q_seq                                register A operand x channel-major q_seq, FP8 wgmma
  dk = dK · 2^e · 2^qse[channel] · scale · 2^-8,  dv = dV · 2^dose[channel] · 2^-8   (epilogue, grad_dtype)
  (e: one per key, a vector over dK's rows, with ``ds_exp="key"``; one scalar per tile with "tile")

Keys are on the MMA's M dimension, so Pᵀ and dSᵀ are ready as register A operands: no transpose, no shared
memory round trip.  The dS exponent ``e`` is the ``tl`` kernel's rule, per ``GluonDkdvConfig.ds_exp``:
  "key" (default since session 8): one RCEIL power of two per key (row of dSᵀ = output row of dK) and query tile,
        with a bounded total drop per key (``_key_exp``), no hysteresis; dK's rows rescaled by 2^(e_old − e_new)
        (exact) every step.  A per-row power of two commutes with dK = dSᵀ Q_seq (it scales an output row), so it
        is exact to factor out (DESIGN §3), and its amax is a row reduction inside the quad of threads that holds
        the row: no shared memory, no barrier.  The tl twin: ``BwdConfig(ds_tile_scale=False)``.
  "tile": one per (128 keys x 64 queries) tile (64 keys split), kept with hysteresis (``_sticky_exp``) and a
        bounded total drop (``_bounded_exp``), the dK accumulator rescaled by 2^(e_old − e_new) (exact) when it
        changes; its amax is a cross-warp reduction (shared memory, two named barriers per step).  Compiles to the
        same SASS as before session 8.
The seq operands' exponents are per
(query head, channel): dK and dV are kept in units of the current head's and rescaled by 2^(prev − new) per channel
when the head changes, as the ``tl`` kernel does.  The query tiles are visited in the ``tl`` kernel's order (heads
h0 .. h0+G-1; per head the masked tiles lo .. mid, then the unmasked mid .. m_end, i.e. increasing start_m), so the
exponent sequence and every e4m3 P and dS value are the ``tl`` kernel's: the results agree up to the fp32
summation order of the products (and 1-ulp FMA contraction differences in Sᵀ and dSᵀ).

One CTA per (128 keys, batch * kv head), two partitions:
  producer  1 warp, 24 registers: TMA loads of the K and V_hdim tiles (128 x D, once) and, per query step, into
            one STAGES-deep ring with one ready and one empty mbarrier per stage: Q and dO_hdim (64 x D), Q_seq and
            dO_seq (D x 64 of the channel-major buffers), and the tile's lse and δ (64 fp32 each).
  consumer  the default partition: 8 warps = two warpgroups.  With the wgmma layout ``warps_per_cta=[8, 1]`` each
            warpgroup issues m64 wgmma over its own 64 keys (keys 0..63 and 64..127 of the CTA).
The consumers read lse and δ from the ring's shared memory (since session 7; before, 16 + 16 predicated scalar
global loads per thread and step sat on each step's serial chain) and load only the scalar exponents qe, doe with
gl.load.
Deviation from the brief's "consumer warpgroups ... own 64 keys" as separate partitions: as in attn_bwd_dq_gluon,
the two warpgroups are one 8-warp partition in the whole-tile build, because the "tile" dS exponent is a maximum
over the whole 128-key x 64-query tile (the ``tl`` kernel's rule, kept for equal numerics): the tile-wide ``gl.max``
is the compiler's cross-warp reduction (shared memory + a named barrier of the partition's 256 threads).  The split
build (below) and the per-key exponent (``ds_exp="key"``, the ``tl`` kernel's ``ds_tile_scale=False`` rule for dK)
each remove that coupling.

Consumer step j (query tile j of the flattened (head, start_m) sequence; stage s = j % STAGES), with dK deferred
one step (``DEFER_DK``, the default since session 7; ``GluonDkdvConfig(defer_dk=False)`` for the step before it):
  1. e4m3 dSᵀ_{j-1} in the A layout (carried as fp32 dSᵀ_{j-1}·2^-e_{j-1}; zeros at j = 0); dK's pending rescales
     of step j-1 (head change: dK *= 2^(qse_prev − qse) per channel; then 2^(e_{j-2} − e_{j-1}) if the tile
     exponent moved); head change at j (j > 0): dV *= 2^(dose_prev − dose) per channel;
  2. wait for stage s (all six loads of tile j); lse_j from shared memory; issue Sᵀ_j = K Q_jᵀ and dPᵀ_j = V dO_jᵀ
     (A = K, V from shared memory), then dK += dSᵀ_{j-1} Q_seq_{j-1} (stage j-1; step 0: zeros on stage 0);
  3. wait for Sᵀ_j only (dPᵀ_j and dK_{j-1} run on); Pᵀ_j (masked or not: the branches join fp32 values); δ_j from
     shared memory;
  4. wait for dPᵀ_j (dK_{j-1} runs on); dSᵀ_j (fp32), then e4m3 Pᵀ_j in the A layout; issue dV += Pᵀ_j dO_seq_j;
  5. the tile's dS amax and exponent e_j (per key with ``ds_exp="key"``: row maxima), dSᵀ_j·2^-e_j (fp32,
     carried), while dV's and dK_{j-1}'s products run;
  6. wait for everything (dV_j, dK_{j-1}); release stage j-1 (j > 0: its Q_seq was dK_{j-1}'s last read); dK's
     rescales of step j (head change at j, exponent move) become pending for step 1 of j + 1 (per key: the row
     factors 2^(e_{j-1} − e_j), applied every step after the head rescale, before Sᵀ_{j+1}'s wgmma, where ptxas
     issues most of the 64 FMUL (d128) between Sᵀ's k-steps).
  After the loop: step n-1's pending rescales, dK += dSᵀ_{n-1} Q_seq_{n-1}, wait, release.
dK therefore sees the undeferred order (dK_{j-1} added, head rescale, exponent rescale, dK_j added) with the same
operands and the same multiplications, so dK / dV are bit-identical to the undeferred kernel's.  The rescales are
applied at the top of the next step, after dSᵀ's fp32 tile became 8 e4m3 registers: at step 6 with the fp32 tile
live, the exponent vectors of a head change made d128 spill inside the loop.  Stage j stays taken until step j+1's
end, so prefetching needs 3 stages (j-1, j, j+1; the default); 2 work without prefetch, and 1 would deadlock
(``GluonDkdvConfig.defers_dk`` is False there: the undeferred step).
The undeferred step (DEFER_DK False) is as before session 7's deferral: head change rescales dK and dV at step 1,
no dK product in step 2, step 5 also the dK rescale and e4m3 dSᵀ_j, step 6 issues dK += dSᵀ_j Q_seq_j, waits for
everything and releases stage s.
One ready / one empty barrier per stage (until session 7 Q / dO and Q_seq / dO_seq had a ring each, Q / dO
released after step 5): each wait and release in a consumer partition costs a named barrier of the partition
around it, so the merged ring has 4 ``BAR.SYNC`` per step instead of 6; a stage now stays taken until the step's
end, which with 2 stages still leaves the producer a whole step to refill it.
Every wgmma is waited in the step that issued it (perf-notes-attn-fwd-gluon.md: in flight across the loop edge
made ptxas serialize all wgmma); three ``WARPGROUP.DEPBAR`` per step (the forward and dQ kernels have two).  The
overlap is the exp2 of Pᵀ under dPᵀ's product and the dS math under dV's, and (deferred) dK_{j-1}'s product under
both; before the deferral dK's product was fully exposed at the step's end.  dSᵀ crosses the loop edge as its fp32
tile (32 registers per thread; e4m3 tensors crossing a loop edge are moved as loose bytes), converted first thing
in the next step.

TMA views (2-D, 16-byte aligned row strides): Q and dO as (B*Sq, Hq*D), K and V_hdim as (B*Sk, Hkv*D), Q_seq and
dO_seq as (B*Hq*D, Sq) over the channel-major buffers (row stride S_pad).  Query rows past Sq read the next
sequence in Q / dO (or TMA zero fill) and are zero-filled in the seq operands: their lse is taken as −inf, so
P = dS = 0 there.  Per query the dense kernel reads step rows (``_step_rows``, session 20; one small launch,
or, through ``attn_bwd.attn_bwd_hopper``, written by δ's launch since session 21): b = 8 − lse·log2e (−inf where
lse is −inf and past Sq) and −δ (+0 past Sq), (B*Hq, Sq rounded up to 128) with [1, BLOCK_M] boxes, so a step
spends no compares, selects or negations on them.  The jagged kernel reads lse
and δ themselves (columns past Sq: TMA zero fill, lse replaced by −inf there); their row pitch must be a multiple
of 4 elements: the launcher uses them in place when it is, else copies them with padded rows (``_vector_rows``).
Keys past Sk read the next sequence (masked: every step of a partial key block takes the masked path, as in the
``tl`` kernel) and are not stored.  Keys that no query sees get dk = dv = 0 (no step, or P = 0).

Layout requirements (``attn_bwd_dkdv_gluon`` raises ValueError otherwise): q and dout_hdim grouped along the
sequence with a group that is a multiple of the query step, 64 or 128 (one scalar exponent per query tile; the
fast layout ``row_scaled_triton(x, "k", k_group=128)``, which ``attn_bwd.attn_bwd_preprocess`` makes for dout_hdim), k and
v_hdim the K layout (128 keys per exponent), q_seq and dout_seq the V layout (channel-major, one exponent per
(head, channel)).  D is 64 or 128.

Compile check without a GPU (triton 3.6): ``python scripts/compile_check_bwd_dkdv_gluon.py [--split] [--no-defer]
[--ds-exp=key|tile] [--varlen]``.
Per-key dS exponent (session 8, deferred dK, 3 stages; not yet run on a GPU), before (tile) -> after (key): a
common step's named barriers 4 -> 2, STS 2 -> 0, LDS 18 -> 16, SHFL 25 -> 20, FMUL 65 -> 129 (d128; 97 at d64);
step SASS 648-654 -> 707-712 (split d128), 668-669 -> 722-723 (split d128 causal), 627-629 -> 656 (split d64),
663 -> 720 (whole d128); highest register and shared memory unchanged (R237 at d128), split spills 24 -> 56 B at
d128 and 64 -> 56 B at d128 causal, all outside the loops; three ``WARPGROUP.DEPBAR`` per step as before.
Deferred dK (session 7, 3 stages; GPU tests pass, 3.41 vs 3.72 ms undeferred at B2 H16 S8k d128,
`attn_bwd_kernels-…-s8.json`): highest register R237 (d128, d128 causal) / R181 (d64) /
R195 (d64 causal), no spill whole-tile; split 24 B (d128) / 64 B (d128 causal) spilled outside the loops, no
LDL / STL inside; shared memory 132 988 B (d128) / 67 452 B (d64), split 133 136 / 67 600; 4 + 4 + 2 + 2 wgmma per
step and warpgroup at d128 (dK's from the previous step), three ``WARPGROUP.DEPBAR``, 4 ``BAR.SYNC``, 663 SASS
instructions on a common step's path at d128 (648-654 split).  The numbers below are the undeferred kernel's
(``--no-defer``, before session 7's deferral): sm_90a, 2 stages,
maxnreg 168 -> setmaxnreg 240 (consumers) / 24 (producer); highest SASS register R237 (d128, d128 causal) / R172
(d64) / R184 (d64 causal); spills 0 (before session 7's lse / δ through TMA: 16 bytes at d128 causal, one value
stored and two reloaded per step); shared memory 99 676 B (d128) / 50 524 B (d64); per query step and warpgroup
4 + 4 ``m64n64k32`` (Sᵀ, dPᵀ; 2 + 2 at d64) and 2 + 2 ``m64nDk32`` (dV, dK) e4m3 wgmma, three
``WARPGROUP.DEPBAR`` per step; a step without head change, mask or dK rescale executes 636 SASS instructions at
d128 (730 before session 7), 4 ``BAR.SYNC``, 2 LDG (qe, doe), 16 LDS.64 (lse, δ).  Register savings that made
d128 fit: unit strides specialized (the launcher makes exponents contiguous, ``UNIT_STRIDES``), one stride set
for each same-shape pair, q / dO exponents expanded to one per 64-row tile (no group division in the loop), the
key bound dropped from the causal mask (implied), Pᵀ cast to e4m3 only after dSᵀ took its fp32 value.
Run on the H200 since session 4 (all GPU tests pass; 1.25x / 1.66x the tl kernel at S8k d128, non-causal /
causal); the default of ``attn_bwd_hopper`` on Hopper.  Costs to look at first (``gpu_check.sh OUT ncu``): the
head-change rescale loads 4 x D exponents in the loop body (a rare branch), the tile-wide dS max (256-thread barriers) once per step, and no cross-step overlap of
the two consumer warpgroups (no ping-pong: the tile exponent couples them every step).

Jagged mode (``VARLEN``, launcher ``attn_bwd_dkdv_gluon_varlen``, session 8; docs/perf-notes-varlen.md): grid (rows
of a heaviest-first table of (sequence, 128-key tile), Hkv); each CTA reads its row once, then runs the dense code
at its sequence's Sq, Sk on packed operands (2-D TMA views; Q_seq / dO_seq in (Hq·D, Tv) rows with 64-aligned,
zero-padded sequence starts; lse and δ in dO_seq's padded columns (``padded_lse``), so the boxes past a sequence's end
read zeros, never the next sequence's δ).  The sequence's offsets reach the consumers as integers (qe_row, de_row,
seq_h, key_row) added at their uses, with uniform base pointers: pointers moved by table values made the split
d128 build spill in the loop.  The dense build is unchanged (compile reports compared with main).  Both dS rules
(``ds_exp``) build in the jagged mode from the same code (the per-key rule's head rescale, exponent rescale and
epilogue take the sequence's head row seq_h as the tile rule's do); the tl twin of a jagged build is the tl jagged
kernel with ``tl_twin_config(cfg)``, as for the dense build.

Split variant (``GluonDkdvConfig(split=True)``; the default of ``attn_bwd_hopper`` since session 5, where it measured
1.14-1.20x the whole-tile kernel at S8k d128, ``MXATTN_BWD_GLUON_SPLIT=0`` for the latter): the two consumer
warpgroups become two 4-warp partitions (the default partition and a worker, as in attn_fwd_gluon), each over 64
of the CTA's 128 keys with its own K / V_hdim tile (two 64-key TMA boxes each), its own dK / dV and its own dS
exponent per (64 keys x 64 queries) tile, i.e. the tl kernel with 64-key blocks (``split_tl_config``), which the GPU
tests compare it with.  The ring of query-side tiles is shared: its empty barriers count two arrivals.  The point:
the unsplit consumer's warpgroups meet at the tile-wide dS max and at each ring release (256-thread partition
barriers, several per step), so one's exp2 / dS math cannot run under the other's products; split, only the shared
tiles couple them.  Per-warp instructions per step are the same (1270-1272 SASS per loop at d128, both paths; 616-618
on a common step's path); triton 3.6 spills 40 B of loop-invariant values at d128 causal (outside the loop) and
nothing else (before session 7: 72 B at d128, and at d128 causal 11 LDL/STL per step inside the loop).  Found on
the way: a tuple of partition arguments held in a variable turns its constexprs into runtime values, so each
partition's tuple is written out in the call.

128-query step (``GluonDkdvConfig(block_m=128)``, session 9; this module's default stays 64, the public backward
(``attn_bwd.attn_bwd_hopper``) takes it at D = 64 since session 11: 2.20 / 1.38 ms against 2.54 / 1.40 at S 8k):
BLOCK_M is a kernel constexpr, so every step covers 128 queries at D = 64 (FA3's d64 tile), dense launches only
(``check_launch``; the jagged mode keeps 64).  Per warpgroup and step: Sᵀ and dPᵀ as 64 x 128 tiles (2 + 2
``m64n128k32``, 64 registers each), dV and dK with K = 128 (4 + 4 ``m64n64k32``); Q / dO boxes [128, D], Q_seq /
dO_seq [D, 128], lse / δ [1, 128]; one q / dO exponent per step (the operands' own 128-row groups); the dS exponent
per key (or tile) and 128-query step, so the tl twin runs with block_m = 128 (``tl_twin_config``).  What the
registers asked for (triton 3.6, sm_90a; the split build at its 240): the step is not deferred (``defers_dk``: the
fp32 dSᵀ carry would be 64 registers, and the build spilled ~1 KB inside the loop), ke / doe / ve / lse / δ are
loaded where they are used, and the rows past Sq read b = −inf from the step rows (``_step_rows``), so the consumer
needs no query-row mask.  The default builds (BLOCK_M = 64) compile to the same SASS as before the constexpr (compared
byte for byte, all dense and jagged builds).  A common step then issues 953-970 SASS instructions for 64 x 128
scores (15.0 thread-instructions per score, per-key rule) where two 64-query steps issued 2 x 656 (20.5);
perf-notes-attn-bwd.md, "Session 9: a 128-query step at d64".

Fused dQ (``GluonDkdvConfig(fuse_dq=True)``, launcher ``attn_bwd_dkdv_dq_gluon``, session 13; opt-in through
``attn_bwd.fused_dq``): the split build's warpgroups also form their keys' part of dQ per step (dS cast again with one
exponent per tile, staged in shared memory, a sixth wgmma against a K_seq tile loaded once, fp32 atomics), so the dQ
kernel and its recomputed Sᵀ and dPᵀ are not needed.  Correct on the H200, and 0.66-0.79x the two kernels at d64;
halving the atomics' operations or bytes did not change that, so the staging and the extra product on each step's
chain are what to look at next (perf-notes-attn-bwd.md, "Session 13").

Session 20 (perf-notes-attn-bwd.md, "Session 20"): on dense launches with Sq % 16 == 0 the Q and dO_hdim tiles come
through the forward's 5-D permuted boxes over the queries (``GluonDkdvConfig.q_perm``), so Pᵀ and dSᵀ reach the A
operands of dV and dK by a relabel; lse and δ are replaced by the step rows (``_step_rows``: b = 8 − lse·log2e and
−δ, made once per backward); the d128 step went from 672 to 521 SASS instructions, the kernel 1.06-1.18x faster on
an H100.  Opt-in: the persistent kernel (``GluonDkdvConfig.persistent``, ``_attn_bwd_dkdv_ws_persistent_kernel``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxattn.formats import RowScaledFP8
from mxattn.kernels.attn_bwd import grad_outputs
from mxattn.kernels.attn_fwd_gluon import (_cta_order, _k_operand, _key_of_column, _pack_p, _sm_count, _unpack_p,
                                           k_perm_ok, permuted_rows_descriptor)
from mxattn.kernels.attn_bwd_dq_gluon import (
    OUT_ROWS_DKDV,
    _store_tile_rows,
    _hdim_view,
    _is_rs,
    _mma_layout,
    _pow2,
    _rceil_exp,
    _check_seq_layout,
    _row_group,
    _static_tiles,
    _sticky_exp,
    _tile_row,
    backward_operands,
    split_tl_config,
    time_against_tl,
)
from mxattn.kernels import launch
from mxattn.kernels.launch import (BoundLaunch, cdiv, fast_launcher, nvmma_fp8_layout, rebased, tensor_sig,
                                   unbased)

__all__ = ["GluonDkdvConfig", "default_config", "tl_twin_config", "attn_bwd_dkdv_gluon", "attn_bwd_dkdv_dq_gluon",
           "attn_bwd_dkdv_gluon_varlen", "bench_attn_bwd_dkdv_gluon", "dkdv_operands"]

LOG2E = 1.4426950408889634
P_SCALE_LOG2 = 8  # P enters dV as e4m3(P * 2^8); dS enters dK as 256 * dS
BLOCK_N = gl.constexpr(128)  # keys per CTA: two warpgroups of 64 (the tl kernel's block_n: the dS exponent tile)
# queries per step: the kernel's constexpr BLOCK_M, chosen by ``GluonDkdvConfig.block_m``.  64 (the default) is the tl
# kernel's block_m; 128 (session 9, FA3's d64 tile) halves the steps of a d64 launch, dense launches only
BLOCK_M_DEFAULT = 64
BLOCK_MS = (64, 128)
KV_EXP_GROUP = 128  # keys sharing one exponent in k and v_hdim (== BLOCK_N: one scalar per CTA)
ROW_GROUP = 64  # q / dout_hdim rows per exponent must be a multiple of this, and of block_m (one scalar per step)
DS_EXPS = ("key", "tile")  # GluonDkdvConfig.ds_exp

# kernel arguments the launcher guarantees to be 1 (contiguous exponents, dk, dv): the JIT specializes them as
# constexpr, which turns the per-channel vector addresses into one base plus immediates
UNIT_STRIDES = ("stride_qeh", "stride_deh", "stride_keh", "stride_veh", "stride_qsed", "stride_dkd")


@dataclass(frozen=True)
class GluonDkdvConfig:
    """Ring depth and register split (not tuned on the GPU yet)."""

    stages: int = 3  # ring depth (Q, dO, Q_seq, dO_seq, lse, δ: 4 x 8 KB + 512 B per stage at d128)
    # dK_j's product issued in step j+1 with Sᵀ_{j+1} / dPᵀ_{j+1} (session 7); stage j stays taken until then, so
    # the producer prefetches only with stages >= 3.  Ignored (not deferred) with stages = 1, which would deadlock
    maxnreg: int = 168  # 12 warps (8 consumers + the producer's warpgroup) * 32 * 168 <= 65536
    producer_regs: int = 24
    # split: the two consumer warpgroups as two 4-warp partitions, 64 keys each, with a dS exponent per
    # (64 keys x 64 queries) tile, i.e. the tl kernel with block_n=64 (``split_tl_config``).  They share the ring
    # (empty barriers count two arrivals) but meet at no barrier, so one's exp2 / dS math can run under the
    # other's products.  The API's default (``attn_bwd.gluon_split``) since it measured faster.
    split: bool = False
    consumer_regs: int = 240  # registers per thread of consumer warpgroup 1 (a worker partition) when split
    defer_dk: bool = True
    # the dS exponent of dK's product (session 8): "key", one RCEIL power of two per key (row of dSᵀ, output row
    # of dK) and query tile, a row reduction inside each quad of threads, dK rescaled per row every step; "tile",
    # one per (keys x 64 queries) tile with hysteresis, a cross-warp reduction (the rule before session 8).  The
    # tl twin of each: ``tl_twin_config``
    ds_exp: str = "key"
    # queries per step (the kernel's BLOCK_M, session 9): 64, the tl kernel's block_m; 128, FA3's tile at d64: half
    # the steps, each over a 64-key x 128-query Sᵀ per warpgroup (m64n128k32 Sᵀ / dPᵀ, K = 128 dV / dK), so the
    # step's fixed work (ring waits and releases, scalars, exponent logic) is paid once per 128 queries.  128 needs
    # D = 64 (at d128 the accumulators do not fit 240 registers) and a dense launch (the jagged mode's tile table and
    # exponent rows are per 64 rows); ``check_launch`` refuses the rest.  The dS exponent is then one per key (or
    # tile) and 128-query step, and the tl twin runs with block_m = 128 (``tl_twin_config``)
    block_m: int = BLOCK_M_DEFAULT
    # dQ in this kernel (session 13, opt-in): each warpgroup also forms its 64 keys' part of dQ per step, dS·K_seq
    # (a sixth wgmma, dS cast again with one exponent per tile), and adds it to an fp32 buffer with atomics, so the
    # separate dQ kernel (which recomputes Sᵀ and dPᵀ: 7 products in all where 5 are needed) is not run.  Split,
    # dense launches; the steps are then not deferred (``defers_dk``); not deterministic
    fuse_dq: bool = False
    # fused dQ's product 64 queries at a time (half the accumulator); None: the launcher's rule (causal builds,
    # where the whole 128-query product spilled inside the loop, triton 3.6)
    dq_halves: Optional[bool] = None
    # Q and dO_hdim loaded query-permuted (session 20; the forward's K_PERM boxes applied to the queries, the N of
    # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ) on dense launches with Sq % 16 == 0, not with fuse_dq: Sᵀ's and dPᵀ's column c then
    # holds query sigma(c) (``attn_fwd_gluon._key_of_column``), Pᵀ and dSᵀ reach the A operands of dV and dK by a
    # relabel (no quad shuffles or byte permutes), lse and δ are read from shared memory in that order
    # (``_col_vector``).  The same values in the same wgmma positions: bit-identical to False
    q_perm: bool = True
    # one CTA per SM walking the key blocks (session 20, opt-in until measured on a GPU; split, dense, not with
    # fuse_dq): a block's K / V and first query stages load under the previous block's epilogue, and no CTA is
    # launched per key block (``_attn_bwd_dkdv_ws_persistent_kernel``)
    persistent: bool = False
    # causal launches: CTAs heaviest key block first over sections of about two waves of kv heads
    # (kernels/cta_order.py) instead of head by head, which leaves heavy blocks of the last heads for the grid's
    # tail.  The same CTAs computing the same tiles: bit-identical.  None: MXATTN_CAUSAL_LPT's choice
    # (``launch.causal_lpt``), by default on for the 64-query build and off for the 128-query one (session 24,
    # H100, kernel alone: d128 S 4k / 8k 1.115x / 1.066x; d64 S 8k, block_m 128, 0.957x;
    # `attn_bwd_kernels-…-s24-lpt-dkdv.json`).  Not with ``persistent`` (its own order)
    causal_lpt: Optional[bool] = None

    def __post_init__(self):
        if self.ds_exp not in DS_EXPS:
            raise ValueError(f"ds_exp must be one of {DS_EXPS}, got {self.ds_exp!r}")
        if type(self.block_m) is not int or self.block_m not in BLOCK_MS:
            raise ValueError(f"block_m must be one of {BLOCK_MS}, got {self.block_m!r}")

    def check_launch(self, head_dim: Optional[int], varlen: bool = False) -> None:
        """ValueError where this config cannot build: block_m = 128 only at head dim 64 (None: not checked) and in
        dense launches."""
        if self.block_m == 128 and varlen:
            raise ValueError("block_m=128 is not supported by the jagged (varlen) Gluon dK/dV kernel: its tile table "
                             "and q / dO exponent rows are per 64 queries; use block_m=64")
        if self.fuse_dq and (varlen or not self.split):
            raise ValueError("fuse_dq needs a dense launch of the split build (split=True)")
        if self.persistent and (varlen or not self.split or self.fuse_dq):
            raise ValueError("persistent needs a dense launch of the split build (split=True) without fuse_dq")
        if self.block_m == 128 and head_dim is not None and head_dim != 64:
            raise ValueError(f"block_m=128 needs head dim 64 (got {head_dim}): at d128 the 64 x 128 Sᵀ / dPᵀ tiles "
                             f"and the dK / dV accumulators do not fit the consumers' 240 registers; use block_m=64")

    @property
    def defers_dk(self) -> bool:
        """Whether the kernel is built with DEFER_DK (the deferral needs two stages: j − 1's and j's).  Not with
        block_m = 128: the deferred dSᵀ crosses the loop edge as its fp32 tile, 64 registers a thread there, and
        the build spilled 0.9-1.4 KB with ~200 LDL / STL per step inside the loop (triton 3.6, session 9)."""
        return self.defer_dk and self.stages >= 2 and self.block_m == 64 and not self.fuse_dq

    @property
    def key_exp(self) -> bool:
        """Whether the kernel is built with DS_KEY_EXP (one dS exponent per key and query tile)."""
        return self.ds_exp == "key"


def default_config(head_dim: int, causal: bool) -> GluonDkdvConfig:
    return GluonDkdvConfig()


def tl_twin_config(config: Optional[GluonDkdvConfig] = None):
    """The ``attn_bwd.BwdConfig`` whose dK/dV kernel has this Gluon build's numerics (the same tile visits, dS
    exponents and e4m3 P / dS values; only the fp32 summation order differs): 128-key blocks on 8 warps, or 64-key
    blocks (``split_tl_config``) for the split build; ``ds_tile_scale`` False for ``ds_exp="key"``; the build's
    query step as ``block_m`` (the dS exponent's query extent: per key and step, or per tile; with the per-key
    rule ``reference.attention_backward(..., ds_q_block=block_m)`` emulates it)."""
    from mxattn.kernels.attn_bwd import BwdConfig

    cfg = config or default_config(128, False)
    base = split_tl_config() if cfg.split else BwdConfig()
    return replace(base, ds_tile_scale=not cfg.key_exp, block_m=cfg.block_m)


# ------------------------------------------------------------------------------------------------- helpers
BLOCK_N_WG = gl.constexpr(64)  # keys per consumer warpgroup when split
# Cost-split builds of the fused dQ (``fuse_dq``), for timing only: their dq is wrong.  Read once at import from
# MXATTN_DQ_PROBE (scripts/probe_fused_dq.py runs one process per value): 0 (default) the real kernel; 1 no dS
# store into shared memory; 3 the adds replaced by plain stores under a mask that never holds (their addressing
# and issue, no memory traffic); 4 only dS's exponent (no store, no product, no add).  (2, no product and no add
# but the store, crashed ptxas 12.8 at d64 and is not offered.)  Builds without fuse_dq never read it.
DQ_PROBE = gl.constexpr(int(os.environ.get("MXATTN_DQ_PROBE", "0")))
if DQ_PROBE.value not in (0, 1, 3, 4):
    raise ValueError(f"MXATTN_DQ_PROBE must be 0, 1, 3 or 4, got {DQ_PROBE.value}")
# Cost-split builds of the dK / dV step (no fused dQ), for timing only: their gradients are wrong.  Read once at
# import from MXATTN_DKDV_PROBE (scripts/probe_bwd_gluon.py, one process per value): 0 (default) the real kernel;
# 1 no exp2 on the unmasked tiles (Pᵀ = x); 2 no dS exponent with ``ds_exp="key"`` (the keys' exponents stay: no
# amax, no dK row rescale).  (Builds without one of the products would serialize the wgmma pipeline, as the
# forward's did: not offered.)
DKDV_PROBE = gl.constexpr(int(os.environ.get("MXATTN_DKDV_PROBE", "0")))
if DKDV_PROBE.value not in range(3):
    raise ValueError(f"MXATTN_DKDV_PROBE must be 0, 1 or 2, got {DKDV_PROBE.value}")


@gluon.jit
def _p_tile(s, a, b_row, m0, key_lim, diag, MASKED: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
            BLOCK_M: gl.constexpr, Q_PERM: gl.constexpr):
    """Pᵀ·256 of one (ROWS keys x BLOCK_M queries) tile from the raw Sᵀ accumulator (attn_bwd._kv_step):
    x = Sᵀ·a + b_row (−inf where masked), P = 2^x.  Local indices against scalar bounds (32-bit compares)."""
    x = gl.fma(s, a, gl.expand_dims(b_row, 0))
    if MASKED:
        rows = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, s.type.layout)), 1)
        if CAUSAL:
            # key n0 + r <= query m0 + c + Sk - Sq implies n0 + r < Sk for every query row c < Sq; the rows past Sq
            # have P = 0 from lse = -inf.  So the key bound of the tl kernel's mask is implied (one compare, and
            # the registers it saves keep d128 causal free of spills)
            cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s.type.layout))
            if Q_PERM:
                cols = _key_of_column(cols)  # column c holds query sigma(c)
            keep = rows <= gl.expand_dims(cols, 0) + (m0 + diag)
        else:
            keep = rows < key_lim
        x = gl.where(keep, x, float("-inf"))
    elif DKDV_PROBE == 1:
        return x
    return gl.exp2(x)  # P * 256, 0 where masked or where the query row sees nothing


@gluon.jit
def _p_step(s, a, b_row, m0, key_lim, diag, masked, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
            BLOCK_M: gl.constexpr, Q_PERM: gl.constexpr):
    """The masked / unmasked choice made at run time (the branches join fp32 values only)."""
    if masked:
        p = _p_tile(s, a, b_row, m0, key_lim, diag, True, CAUSAL, ROWS, BLOCK_M, Q_PERM)
    else:
        p = _p_tile(s, a, b_row, m0, key_lim, diag, False, CAUSAL, ROWS, BLOCK_M, Q_PERM)
    return p


@gluon.jit
def _col_vector(buf, col_s: gl.constexpr, N: gl.constexpr, Q_PERM: gl.constexpr):
    """A [N] fp32 shared-memory vector in natural query order (lse or δ of a step) as the [N] tensor in ``col_s``
    (Sᵀ's column layout) whose element c is the value of the query column c holds: sigma(c) with Q_PERM, else c.
    Q_PERM: loaded in the layout whose relabel by sigma is ``col_s`` (``col_s``'s own positions relabelled the other
    way), so each thread reads its values straight from shared memory (four consecutive queries per 16-query
    group) and the relabel afterwards is a change of layout only (asserted)."""
    if Q_PERM:
        c = gl.arange(0, N, layout=col_s)
        inv = gl.reshape(gl.permute(gl.reshape(c, [N // 16, 2, 4, 2]), (0, 2, 1, 3)), [N])
        v = buf.load(inv.type.layout)  # v[n] = buf[n], where col_s keeps column sigma^-1(n)
        x = gl.reshape(gl.permute(gl.reshape(v, [N // 16, 4, 2, 2]), (0, 2, 1, 3)), [N])  # x[c] = v[sigma(c)]
        return gl.convert_layout(x, col_s, assert_trivial=True)
    else:
        return buf.load(col_s)


@gluon.jit
def _operand(x, a_layout: gl.constexpr, Q_PERM: gl.constexpr):
    """Pᵀ·256 or dSᵀ·2^-e (fp32, Sᵀ's accumulator layout) -> e4m3 in the A operand layout of dV's / dK's product.
    Q_PERM: relabelled by query and cast a word of four queries at a time (``attn_fwd_gluon._pack_p`` /
    ``_unpack_p``: no byte permutes or shuffles); otherwise the compiler's conversion."""
    if Q_PERM:
        return _unpack_p(_pack_p(x, a_layout, True), a_layout)
    else:
        return gl.convert_layout(x.to(gl.float8e4nv), a_layout)


@gluon.jit
def _head_rescale(dk, dv, QSE, DOSE, stride_qseh, stride_qsed, hh,
                  o_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """dK and dV from units of head hh-1's seq exponents to head hh's (exact, per channel; attn_bwd's head loop)."""
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    qse_prev = gl.load(QSE + (hh - 1) * stride_qseh + offs_d * stride_qsed)
    qse = gl.load(QSE + hh * stride_qseh + offs_d * stride_qsed)
    dose_prev = gl.load(DOSE + (hh - 1) * stride_qseh + offs_d * stride_qsed)
    dose = gl.load(DOSE + hh * stride_qseh + offs_d * stride_qsed)
    dk = dk * gl.expand_dims(_pow2(qse_prev - qse), 0)
    dv = dv * gl.expand_dims(_pow2(dose_prev - dose), 0)
    return dk, dv


@gluon.jit
def _lse_row(lse_smem, st, m0, Sq, col_s: gl.constexpr, BLOCK_M: gl.constexpr, Q_PERM: gl.constexpr):
    """Exponent offsets of one query tile's P·256 = 2^(s·log2e·scale − lse·log2e + 8), from lse in stage st's
    shared memory: −inf for rows that see nothing (lse = −inf) and for rows past Sq (TMA's zero fill there, made
    −inf as the masked global load had it).  The query-row mask only on the tile that reaches past Sq (a uniform
    branch: its compares and selects are not paid on the other steps)."""
    lse = _col_vector(lse_smem.index(st).reshape([BLOCK_M]), col_s, BLOCK_M, Q_PERM)
    if m0 + BLOCK_M > Sq:
        offs_m = gl.arange(0, BLOCK_M, layout=col_s)
        if Q_PERM:
            offs_m = _key_of_column(offs_m)  # column c holds query sigma(c)
        lse = gl.where(m0 + offs_m < Sq, lse, float("-inf"))
    return gl.where(lse == float("-inf"), float("-inf"), 8.0 - lse * 1.4426950408889634)


@gluon.jit
def _chan_rescale(acc, E, stride_qseh, stride_qsed, hh, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """One accumulator of ``_head_rescale``: acc * 2^(E[hh − 1] − E[hh]) per channel (the same two loads and
    multiply), for the deferred dK, whose head rescale waits for dK_{j−1}."""
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    prev = gl.load(E + (hh - 1) * stride_qseh + offs_d * stride_qsed)
    cur = gl.load(E + hh * stride_qseh + offs_d * stride_qsed)
    return acc * gl.expand_dims(_pow2(prev - cur), 0)


@gluon.jit
def _dk_pending(dk, dk_hh, dk_sh, QSE, stride_qseh, stride_qsed, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr):
    """DEFER_DK: a step's dK rescales, once the previous step's deferred product is in: to head dk_hh's seq
    exponents (dk_hh >= 0: the step began a head), then by 2^dk_sh (the tile exponent moved) — the undeferred
    step's order (head rescale, then exponent rescale), both rare branches."""
    if dk_hh >= 0:
        dk = _chan_rescale(dk, QSE, stride_qseh, stride_qsed, dk_hh, o_layout, HEAD_DIM)
    if dk_sh != 0:
        dk = dk * _pow2(dk_sh)
    return dk


@gluon.jit
def _key_exp(ds, dk_e, dk_hi):
    """DS_KEY_EXP: the dS exponent of each key (row of the 256·dSᵀ tile ``ds``) for this query tile, with the row
    bounds: (e, dk_hi).  e = RCEIL of the row's amax (``dk_e``, the row's previous exponent, where the row is all
    zero), raised to at least dk_hi − 64 (``attn_bwd._bounded_exp``, per row).  A row that is all zero (no query
    of the tile sees the key, or P = 0) changes nothing: e stays dk_e (>= dk_hi − 64 by construction), dk_hi stays,
    so tiles a kernel visits and its twin does not (split, causal: tiles wholly before a warpgroup's keys) leave
    the row's sequence as the twin's.  The amax is a reduction over the row's 64 queries: in the wgmma layout a row
    lives in one quad of threads (16 values each), so it is 15 FMNMX and two quad shuffles, no shared memory and
    no barrier.  No hysteresis: dK is rescaled per row every step anyway (a per-row branch does not exist in
    Gluon, and a partition-wide "any row moved" would be the cross-warp reduction this mode removes), so the
    exponent may as well follow each row's amax exactly."""
    amax = gl.max(gl.abs(ds), 1)
    e = gl.maximum(_rceil_exp(amax, dk_e), dk_hi - 64)
    dk_hi = gl.where(amax > 0.0, gl.maximum(dk_hi, e), dk_hi)
    return e, dk_hi


@gluon.jit
def _row_scale(acc, f, o_layout: gl.constexpr):
    """acc * f per row (f: [rows] fp32 in the dSᵀ tile's row layout; the same rows in the accumulator's)."""
    return acc * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, o_layout)), 1)


# ------------------------------------------------------------------------------------------------- producer
@gluon.jit
def _step_barriers(STAGES: gl.constexpr, SPLIT: gl.constexpr):
    """The kernel's mbarriers: one for the K / V_hdim tiles (loaded once) and one ready / one empty per ring stage
    (ready: count 1 with expect-tx, all six loads of a query step on it; empty: one arrival per consumer
    partition, the 8-warp consumer or each warpgroup when split).  Returns (kv_bar, ready, empty)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if SPLIT else 1)
    return kv_bar, ready, empty


@gluon.jit
def _producer_steps(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, q_smem, do_smem, qs_smem, dos_smem,
                    lse_smem, dl_smem, ready, empty, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m,
                    n_steps, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr,
                    BLOCK_M: gl.constexpr, Q_PERM: gl.constexpr, it0=0):
    """Per query step, into stage i % STAGES of the ring, all on its one ready barrier: Q and dO_hdim (BLOCK_M x D),
    Q_seq and dO_seq (D x BLOCK_M), and the tile's BLOCK_M lse and δ (fp32 rows of the (B*Hq, Sq) views; columns past
    Sq are TMA zero fill).  seq_col / vec_col / dl_col: the first column of the seq operands / lse / δ (0 dense;
    jagged: the sequence's first seq column and its first column of the padded lse and δ (twice: lse and δ share it),
    whose columns past the sequence's end are zero)."""
    if not VARLEN:  # the dense build: literal zeros (not captured values the partition cannot fold)
        seq_col = 0
        vec_col = 0
        dl_col = 0
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + qs_desc.block_type.nbytes
                            + dos_desc.block_type.nbytes + lse_desc.block_type.nbytes + dl_desc.block_type.nbytes)
    for i in range(n_steps):
        s = (it0 + i) % STAGES
        hh = h0 + i // n_m
        m0 = lo + (i % n_m) * BLOCK_M
        bar = ready.index(s)
        # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
        mbarrier.wait(empty.index(s), (((it0 + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(lse_desc, [vec_row + hh, vec_col + m0], bar, lse_smem.index(s))
        tma.async_copy_global_to_shared(dl_desc, [vec_row + hh, dl_col + m0], bar, dl_smem.index(s))
        if Q_PERM:  # the 5-D query-permuted boxes, by 16-query group (q_row = b * Sq, Sq % 16 == 0)
            g = (q_row + m0) // 16
            tma.async_copy_global_to_shared(q_desc, [g, 0, 0, 0, hh * HEAD_DIM], bar, q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [g, 0, 0, 0, hh * HEAD_DIM], bar, do_smem.index(s))
        else:
            tma.async_copy_global_to_shared(q_desc, [q_row + m0, hh * HEAD_DIM], bar, q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [q_row + m0, hh * HEAD_DIM], bar, do_smem.index(s))
        tma.async_copy_global_to_shared(qs_desc, [seq_row + hh * HEAD_DIM, seq_col + m0], bar, qs_smem.index(s))
        tma.async_copy_global_to_shared(dos_desc, [seq_row + hh * HEAD_DIM, seq_col + m0], bar, dos_smem.index(s))


@gluon.jit
def _producer(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem, do_smem, qs_smem,
              dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, ready, empty,
              k_row, k_col, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m, n_steps,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr, BLOCK_M: gl.constexpr,
              Q_PERM: gl.constexpr):
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, k_col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [k_row, k_col], kv_bar, v_smem)
    _producer_steps(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, q_smem, do_smem, qs_smem, dos_smem,
                    lse_smem, dl_smem, ready, empty, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m,
                    n_steps, HEAD_DIM, STAGES, VARLEN, BLOCK_M, Q_PERM)


@gluon.jit
def _producer_split(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem, do_smem,
                    qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, ready, empty,
                    k_row, k_col, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m, n_steps,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, VARLEN: gl.constexpr, BLOCK_M: gl.constexpr,
                    Q_PERM: gl.constexpr):
    """The split kernel's producer: a 64-key K and V tile per consumer warpgroup, then the same query steps."""
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [k_row + w * BLOCK_N_WG, k_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [k_row + w * BLOCK_N_WG, k_col], kv_bar, v_smem.index(w))
    _producer_steps(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, q_smem, do_smem, qs_smem, dos_smem,
                    lse_smem, dl_smem, ready, empty, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m,
                    n_steps, HEAD_DIM, STAGES, VARLEN, BLOCK_M, Q_PERM)


@gluon.jit
def _producer_split_dq(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, ks_desc, q_smem, do_smem,
                       qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, ks_smem, kv_bar, ready, empty,
                       k_row, k_col, ks_row, ks_col, q_row, seq_row, vec_row, h0, lo, n_m, n_steps,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
    """The fused-dQ build's producer (dense, split): ``_producer_split`` and each warpgroup's K_seq tile (D x 64 keys
    of the channel-major K, the B operand of its dQ product) on the same once-only barrier."""
    mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes + ks_desc.block_type.nbytes))
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [k_row + w * BLOCK_N_WG, k_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [k_row + w * BLOCK_N_WG, k_col], kv_bar, v_smem.index(w))
        tma.async_copy_global_to_shared(ks_desc, [ks_row, ks_col + w * BLOCK_N_WG], kv_bar, ks_smem.index(w))
    _producer_steps(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, q_smem, do_smem, qs_smem, dos_smem,
                    lse_smem, dl_smem, ready, empty, q_row, seq_row, 0, vec_row, 0, 0, h0, lo, n_m,
                    n_steps, HEAD_DIM, STAGES, False, BLOCK_M, False)


@gluon.jit
def _dq_stage(ds, dsq_smem):
    """Fused dQ (``GluonDkdvConfig.fuse_dq``), first part: this warpgroup's keys' dS for the step's dQ product into
    ``dsq_smem`` (BLOCK_M x 64, keys contiguous: the K-major A operand of dS[queries, keys] K[keys, :]); returns
    the tile's exponent.

    ds: 256·dSᵀ (64 keys x BLOCK_M queries, fp32).  dQ's product runs over keys, so dK's per-key exponent cannot be
    factored out of it: dS is cast a second time, with one RCEIL power of two for the whole tile (its amax; the dQ
    kernel's rule without the hysteresis, which only serves an accumulator kept across tiles).  An all-zero tile
    gets −127 (``_dq_add`` skips it)."""
    e = _rceil_exp(gl.max(gl.max(gl.abs(ds), 1), 0), -127)
    if DQ_PROBE != 1 and DQ_PROBE != 4:
        dsq_smem.permute((1, 0)).store((ds * _pow2(-e)).to(gl.float8e4nv))
        fence_async_shared()
    return e


@gluon.jit
def _dq_issue(dsq_smem, ks_tile, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Fused dQ, second part: issue dS (``dsq_smem``) times ``ks_tile`` (K_seq, D x 64, keys contiguous: B is its
    transpose) into a fresh accumulator."""
    return warpgroup_mma(dsq_smem, ks_tile.permute((1, 0)),
                         gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=_mma_layout(HEAD_DIM, 4)), use_acc=False,
                         is_async=True)


@gluon.jit
def _dq_add(dq, e, DQ_b, hh, m0, Sq, stride_dqm, stride_dqh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Fused dQ, last part: dQ[m0 + i, head hh, :] += dq[i, :] · 2^e into the fp32 (B, Sq, Hq, D) buffer ``DQ_b``
    (moved to the batch), relaxed atomic adds, rows past Sq masked.  The per-channel factor 2^kse[d] · scale · 2^-8
    is the same for every tile of a head (K_seq's exponents of its kv head), so the launcher applies it once, when it
    turns the buffer into dq.
    Tiles that were all zero (e = −127: causal tiles before these keys, rows that see nothing) are skipped.  Not
    deterministic: the two warpgroups and the key blocks add in any order."""
    if e > -127:
        d_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, d_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
        ptrs = (DQ_b + hh * stride_dqh + gl.expand_dims(rows.to(gl.int64) * stride_dqm, 1)
                + gl.expand_dims(offs_d, 0))
        if DQ_PROBE == 3:  # cost-split build: the adds' addressing and issue without their memory traffic (plain
            # stores under a mask that never holds: e <= 127 < rows + 1000)
            gl.store(ptrs, dq * _pow2(e), mask=gl.expand_dims(rows < e - 1000, 1))
        else:
            gl.atomic_add(ptrs, dq * _pow2(e), mask=gl.expand_dims(rows < Sq, 1), sem="relaxed")


# ------------------------------------------------------------------------------------------------- consumer
@gluon.jit
def _consumer(q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_tile, v_tile, kv_bar, ready, empty,
              QE, DOE, QSE, DOSE, DK, DV,
              stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn, stride_dkd,
              KE, VE, key_lim, diag, Sq, h0, h_last, lo, mid, n_m, n_steps, qk_scale, grad_scale,
              qe_row, de_row, seq_h, key_row,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
              WARPS: gl.constexpr, DEFER_DK: gl.constexpr, DS_KEY_EXP: gl.constexpr, VARLEN: gl.constexpr,
              BLOCK_M: gl.constexpr, Q_PERM: gl.constexpr, ks_tile=None, dsq_smem=None, DQ_b=None, stride_dqm=0,
              stride_dqh=0, FUSE_DQ: gl.constexpr = False, DQ_HALVES: gl.constexpr = False, it0=0, kv_ph=0,
              kv_empty=None):
    """Keys n0 .. n0 + ROWS − 1 of one (b, hk), ROWS = 128 on 8 warps (the whole CTA's keys) or 64 on one warpgroup
    (split: keys n0 + 64·w ..); k_tile / v_tile their K and V_hdim tiles.  Pointers already moved to b (QE, DOE,
    QSE, DOSE) and to (b, hk, first key) (DK, DV); lse and δ of each query tile come through the ring
    (lse_smem, dl_smem: [STAGES, 1, BLOCK_M] fp32, zero past Sq).  key_lim = Sk − first key (local keys below it
    exist), diag = Sk − Sq − first key (local key r sees local query c of the tile at m0 iff r − c <= m0 + diag).
    The dS exponent is one per (ROWS keys x BLOCK_M queries) tile: the tl kernel's with block_n = ROWS; with DS_KEY_EXP
    one per key and query tile (``_key_exp``): the tl kernel's ``DS_TILE_SCALE=False`` rule for dK.
    qe_row, de_row, seq_h, key_row (VARLEN only; the dense build never reads them): the sequence's parts of the
    offsets as integers (first 64-row exponent tile of q / dO, first head row b * Hq of the seq exponents, first
    key row of dk / dv), added where they are used: pointers moved by values loaded from the tile table would be
    per-thread registers live across the loop (the dense kernel's are uniform), and made the split d128 build
    spill inside it.  (The dense build gets literal zeros here, used only behind VARLEN: a zero passed to a
    partition becomes a captured runtime value, which changed the dense split build.)

    Split, warpgroup 1's first causal query tiles of each head can lie wholly before its keys (the tl kernel with
    64-key blocks starts later): P = dS = 0 there, the exponent stays (amax 0 keeps it) and the bound of
    ``_bounded_exp`` is not started by them, so the exponent sequence is the tl kernel's.

    DEFER_DK: dK_j += dSᵀ_j Q_seq_j is issued in step j + 1 after Sᵀ_{j+1} and dPᵀ_{j+1} (and after the loop for
    the last step) and waited with dV_{j+1} at that step's end; stage j is released then.  dK's head rescale and
    tile-exponent rescale of step j + 1 follow that wait, so dK sees the same operations in the same order as
    without the deferral (add dK_j, head rescale, exponent rescale, add dK_{j+1}): bit-identical results.
    DS_KEY_EXP deferred: the per-row exponent rescale of step j (a factor per row, every step) is applied at the
    top of step j + 1 after the head rescale, before Sᵀ_{j+1}'s wgmma: the same order as the undeferred step.

    FUSE_DQ (undeferred steps only, ``GluonDkdvConfig.fuse_dq``): each step also stages its keys' dS for dQ in
    shared memory under dV's and dK's products (``_dq_stage``), then, once they are in, multiplies it by K_seq
    (``_dq_issue``) and adds the result to memory (``_dq_add``), 64 queries at a time with DQ_HALVES; dK and dV are
    unchanged."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    if VARLEN:
        h_sh = seq_h
        qe_0 = qe_row
        de_0 = de_row
        n_sh = key_row
    else:
        h_sh = 0
        qe_0 = 0
        de_0 = 0
        n_sh = 0
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    if DS_KEY_EXP:  # per key (row): exponent, bound (_key_exp), and the pending rescale factor of DEFER_DK
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dk_e = gl.full([ROWS], 0, gl.int32, layout=row_s)
        dk_hi = gl.full([ROWS], -1000, gl.int32, layout=row_s)
        dk_f = gl.full([ROWS], 1.0, gl.float32, layout=row_s)
    else:
        dk_e = 0
        dk_hi = -1000  # no bound until the accumulator holds something (_bounded_exp)
    # DEFER_DK: dSᵀ_{j-1}·2^-e_{j-1} (fp32, the value the undeferred step casts to e4m3), zeros before step 0 (whose
    # deferred product, on stage 0's Q_seq, adds exact zeros); and dK's rescales of step j-1 that wait for
    # dK_{j-2}: the head to rescale to (-1: none) and the exponent shift e_{j-2} − e_{j-1}
    dsc = s_zero
    dk_hh = -1
    dk_sh = 0
    if BLOCK_M == 64:  # (BLOCK_M = 128: loaded where used, see below)
        ke = gl.load(KE)
        ve = gl.load(VE)
    mbarrier.wait(kv_bar, kv_ph)
    for j in range(n_steps):
        st = (it0 + j) % STAGES
        ph = ((it0 + j) // STAGES) & 1
        t = j // n_m
        hh = h0 + t
        m0 = lo + (j - t * n_m) * BLOCK_M
        if DEFER_DK:
            # e4m3 dSᵀ_{j-1} first: its fp32 tile is then dead before the rescales' exponent vectors load and
            # before Sᵀ_j / dPᵀ_j take their accumulators (with both live, d128 spills inside the loop)
            ds8 = _operand(dsc, a_layout, Q_PERM)
            if DS_KEY_EXP:
                # the head rescale, then the rows to e_{j-1} (64 FMUL a thread at d128, every step).  Here, before
                # Sᵀ_j's wgmma, ptxas (triton 3.6, sm_90a) issues most of them between Sᵀ_j's first k-steps, under
                # its product.  Tried and worse: between the issue of Sᵀ_j / dPᵀ_j and dK's (ptxas then waits for
                # Sᵀ_j and dPᵀ_j before issuing dK: a fourth WARPGROUP.DEPBAR, Pᵀ_j's exp2 behind dPᵀ_j); at the
                # end of step j after dK_{j-1}'s wait, under dV_j (ptxas sinks them below the final wait, onto the
                # step's tail, and with the wait before dV_j's issue it hoists that wait up to dPᵀ_j's)
                dk = _dk_pending(dk, dk_hh, 0, QSE, stride_qseh, stride_qsed, o_layout, HEAD_DIM)
                if DKDV_PROBE != 2:
                    dk = _row_scale(dk, dk_f, o_layout)
            else:
                dk = _dk_pending(dk, dk_hh, dk_sh, QSE, stride_qseh, stride_qsed, o_layout, HEAD_DIM)
            if j - t * n_m == 0:
                if j > 0:  # dV's head rescale; dK's waits for dK_{j-1} (applied at the top of step j + 1)
                    dv = _chan_rescale(dv, DOSE, stride_qseh, stride_qsed, h_sh + hh, o_layout, HEAD_DIM)
        else:
            if j - t * n_m == 0:
                if j > 0:
                    dk, dv = _head_rescale(dk, dv, QSE, DOSE, stride_qseh, stride_qsed, h_sh + hh,
                                           o_layout, HEAD_DIM)
        # query-side scalars of this tile (before the wait: their latency hides under it)
        if BLOCK_M == 64:
            qe = gl.load(QE + hh * stride_qeh + (qe_0 + m0 // BLOCK_M) * stride_qeg)
            doe = gl.load(DOE + hh * stride_deh + (de_0 + m0 // BLOCK_M) * stride_deg)
            a = qk_scale * _pow2(qe + ke)
        else:
            # the 128-query step, where Sᵀ and dPᵀ take 64 registers each and the split build sits at its 240:
            # the same values, placed where the registers are (each change below took in-loop LDL / STL away,
            # triton 3.6, sm_90a; session 9): ke loaded here every step (an L1 hit under the ready wait; held
            # across the loop, it was the value ptxas spilled and reloaded every step), doe / ve / lse after Sᵀ's
            # wait, δ after dPᵀ's, and no query-row mask: the step rows are −inf past Sq (``_step_rows``; before
            # session 20 the launcher padded lse's rows the same way), so P = 0 where the mask put it (the 32
            # per-thread column compares of a 128-query tile cost ~120 instructions a step)
            qe = gl.load(QE + hh * stride_qeh + (qe_0 + m0 // BLOCK_M) * stride_qeg)
            a = qk_scale * _pow2(qe + gl.load(KE))

        mbarrier.wait(ready.index(st), ph)  # Q, dO, Q_seq, dO_seq, lse, δ of tile j
        if BLOCK_M == 64:
            if VARLEN:  # raw lse (the δ kernel's padded layout)
                b_row = _lse_row(lse_smem, st, m0, Sq, col_s, BLOCK_M, Q_PERM)
            else:  # the launcher's step rows (``_step_rows``): the exponent offsets themselves, −inf past Sq
                b_row = _col_vector(lse_smem.index(st).reshape([BLOCK_M]), col_s, BLOCK_M, Q_PERM)
        s = warpgroup_mma(k_tile, _k_operand(q_smem.index(st), BLOCK_M, HEAD_DIM, Q_PERM), s_zero, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(v_tile, _k_operand(do_smem.index(st), BLOCK_M, HEAD_DIM, Q_PERM), s_zero, use_acc=False,
                           is_async=True)
        if DEFER_DK:
            # dK_{j-1} += dSᵀ_{j-1} Q_seq_{j-1} behind them (step 0: zeros on stage 0): it runs under Pᵀ's exp2 and
            # the dSᵀ math and is waited with dV_j at the step's end
            sp = (it0 + gl.maximum(j - 1, 0)) % STAGES
            dk = warpgroup_mma(ds8, qs_smem.index(sp).permute((1, 0)), dk, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))  # Sᵀ_j; dPᵀ_j and dK_{j-1} run on
        else:
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # Sᵀ_j; dPᵀ_j runs on
        if BLOCK_M > 64:  # (see the top of the step)
            b_row = _col_vector(lse_smem.index(st).reshape([BLOCK_M]), col_s, BLOCK_M, Q_PERM)  # (dense only)
            doe = gl.load(DOE + hh * stride_deh + (de_0 + m0 // BLOCK_M) * stride_deg)
            ve = gl.load(VE)
        p = _p_step(s, a, b_row, m0, key_lim, diag, m0 < mid, CAUSAL, ROWS, BLOCK_M, Q_PERM)
        if BLOCK_M == 64:
            delta = _col_vector(dl_smem.index(st).reshape([BLOCK_M]), col_s, BLOCK_M, Q_PERM)  # 0.0 past Sq
        if DEFER_DK:
            dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))  # dPᵀ_j; dK_{j-1} runs on
        else:
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))  # dPᵀ_j
        if BLOCK_M > 64:
            delta = _col_vector(dl_smem.index(st).reshape([BLOCK_M]), col_s, BLOCK_M, Q_PERM)  # (TMA zero fill)
        if VARLEN:
            ds = p * gl.fma(dp, _pow2(doe + ve), -gl.expand_dims(delta, 0))  # 256 * dSᵀ
        else:  # the step rows hold −δ
            ds = p * gl.fma(dp, _pow2(doe + ve), gl.expand_dims(delta, 0))
        # Pᵀ to e4m3 only now (after dSᵀ took its fp32 value): Pᵀ, dPᵀ and the e4m3 Pᵀ are never live together
        p8 = _operand(p, a_layout, Q_PERM)
        dv = warpgroup_mma(p8, dos_smem.index(st).permute((1, 0)), dv, is_async=True)
        # the tile's exponent (a cross-warp max) or the keys' (DS_KEY_EXP: row maxima), its e4m3 dSᵀ and the dK
        # rescale (rare per tile, every step per key), under dV's product
        if DS_KEY_EXP:
            if DKDV_PROBE == 2:
                e = dk_e
            else:
                e, dk_hi = _key_exp(ds, dk_e, dk_hi)  # the bound too (all-zero rows leave it: no split special case)
        else:
            amax = gl.max(gl.max(gl.abs(ds), 1), 0)
            e = gl.maximum(_sticky_exp(_rceil_exp(amax, dk_e), dk_e), dk_hi - 64)  # _bounded_exp(_sticky_exp(...))
            if ROWS == 64 and CAUSAL:
                # split: a query tile wholly before this warpgroup's keys (local key 0 does not see query 63) is
                # one the tl kernel's 64-key block does not visit: all masked (amax 0 keeps e), it must not start
                # the bound
                if m0 + diag > -BLOCK_M:
                    dk_hi = gl.maximum(dk_hi, e)
            else:
                dk_hi = gl.maximum(dk_hi, e)
        if DEFER_DK:
            if DS_KEY_EXP:
                dsc = ds * gl.expand_dims(_pow2(-e), 1)  # cast to e4m3 and multiplied in step j + 1
            else:
                dsc = ds * _pow2(-e)  # cast to e4m3 and multiplied in step j + 1
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))  # dV_j, dK_{j-1}
            if j > 0:
                mbarrier.arrive(empty.index(sp), count=1)  # stage j-1 free: its Q_seq was dK_{j-1}'s last read
            # this step's dK rescales (head change, exponent move), in the undeferred order: after dK_{j-1} is in,
            # before dK_j is added; applied at the top of step j + 1 (or before the flush)
            dk_hh = -1
            if j - t * n_m == 0:
                if j > 0:
                    dk_hh = h_sh + hh
            if DS_KEY_EXP:
                dk_f = _pow2(dk_e - e)
            else:
                dk_sh = dk_e - e
            dk_e = e
        else:
            if DS_KEY_EXP:
                ds8 = _operand(ds * gl.expand_dims(_pow2(-e), 1), a_layout, Q_PERM)
                if DKDV_PROBE != 2:
                    dk = _row_scale(dk, _pow2(dk_e - e), o_layout)
            else:
                ds8 = _operand(ds * _pow2(-e), a_layout, Q_PERM)
                if e != dk_e:  # rare: only when the tile's exponent leaves the hysteresis window
                    dk = dk * _pow2(dk_e - e)
            dk_e = e
            dk = warpgroup_mma(ds8, qs_smem.index(st).permute((1, 0)), dk, is_async=True)
            if FUSE_DQ:  # dQ's product behind dK's (dS staged under dV's and dK's), the first waited with them
                dq_e = _dq_stage(ds, dsq_smem)
                # DQ_HALVES: 64 queries at a time, half the accumulator registers (causal builds)
                DQ_ROWS: gl.constexpr = BLOCK_M // 2 if DQ_HALVES else BLOCK_M
                if DQ_PROBE == 2 or DQ_PROBE == 4:
                    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                    mbarrier.arrive(empty.index(st), count=1)
                else:
                    for part in gl.static_range(BLOCK_M // DQ_ROWS):
                        dq = _dq_issue(dsq_smem.slice(part * DQ_ROWS, DQ_ROWS), ks_tile, HEAD_DIM, DQ_ROWS)
                        if part == 0:
                            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                            mbarrier.arrive(empty.index(st), count=1)
                        else:
                            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
                        _dq_add(dq, dq_e, DQ_b, hh, m0 + part * DQ_ROWS, Sq, stride_dqm, stride_dqh, HEAD_DIM, DQ_ROWS)
            else:
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                mbarrier.arrive(empty.index(st), count=1)  # stage st free: every read of it is done
    if DEFER_DK:
        if n_steps > 0:  # the last step's deferred dK (n_steps >= 1 whenever Sq >= 1)
            sp = (it0 + n_steps - 1) % STAGES
            ds8 = _operand(dsc, a_layout, Q_PERM)
            if DS_KEY_EXP:
                dk = _dk_pending(dk, dk_hh, 0, QSE, stride_qseh, stride_qsed, o_layout, HEAD_DIM)
                if DKDV_PROBE != 2:
                    dk = _row_scale(dk, dk_f, o_layout)
            else:
                dk = _dk_pending(dk, dk_hh, dk_sh, QSE, stride_qseh, stride_qsed, o_layout, HEAD_DIM)
            dk = warpgroup_mma(ds8, qs_smem.index(sp).permute((1, 0)), dk, is_async=True)
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            mbarrier.arrive(empty.index(sp), count=1)
    if kv_empty is not None:  # persistent: this warpgroup's K / V tiles are free for the next item's (under the epilogue)
        mbarrier.arrive(kv_empty, count=1)

    # ---- epilogue (attn_bwd._bwd_dkdv_kernel): the last head's seq exponents, dK's tile exponent, 2^-8 of P
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    qse = gl.load(QSE + (h_sh + h_last) * stride_qseh + offs_d * stride_qsed)
    if DS_KEY_EXP:  # the tl kernel's order: rows by 2^e, then channels by 2^qse · scale · 2^-8
        dk = _row_scale(dk, _pow2(dk_e), o_layout) * gl.expand_dims(_pow2(qse) * grad_scale, 0)
    else:
        dk = dk * gl.expand_dims(_pow2(qse) * (grad_scale * _pow2(dk_e)), 0)
    if OUT_ROWS_DKDV > 0 and BLOCK_M >= OUT_ROWS_DKDV:  # (MXATTN_BWD_OUT_ROWS, attn_bwd_dq_gluon)
        _store_tile_rows(DK, dk.to(DK.dtype.element_ty), n_sh, n_sh + key_lim, stride_dkn, stride_dkd, ROWS,
                         HEAD_DIM, WARPS)
        # (loading dO's exponents before dK's arithmetic kept 32 more registers live: the d128 causal build then
        # spilled inside its loop)
        dose = gl.load(DOSE + (h_sh + h_last) * stride_qseh + offs_d * stride_qsed)
        dv = dv * gl.expand_dims(_pow2(dose) * 0.00390625, 0)  # 2^-8: P entered as P * 256
        _store_tile_rows(DV, dv.to(DV.dtype.element_ty), n_sh, n_sh + key_lim, stride_dkn, stride_dkd, ROWS,
                         HEAD_DIM, WARPS)
    else:
        offs_n = gl.arange(0, ROWS, layout=row_o)
        key_ok = gl.expand_dims(offs_n < key_lim, 1)
        ptrs = (DK + gl.expand_dims((n_sh + offs_n).to(gl.int64) * stride_dkn, 1)
                + gl.expand_dims(offs_d * stride_dkd, 0))
        gl.store(ptrs, dk.to(DK.dtype.element_ty), mask=key_ok)
        dose = gl.load(DOSE + (h_sh + h_last) * stride_qseh + offs_d * stride_qsed)
        dv = dv * gl.expand_dims(_pow2(dose) * 0.00390625, 0)  # 2^-8: P entered as P * 256
        ptrs = (DV + gl.expand_dims((n_sh + offs_n).to(gl.int64) * stride_dkn, 1)
                + gl.expand_dims(offs_d * stride_dkd, 0))
        gl.store(ptrs, dv.to(DV.dtype.element_ty), mask=key_ok)



# ------------------------------------------------------------------------------------------------- kernel
@gluon.jit
def _query_range(n0, Sq, Sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """The query tiles key block n0 visits (attn_bwd._bwd_dkdv_kernel): (lo, mid, tiles per head); lo .. mid masked,
    mid .. the last tile not."""
    causal_off = Sk - Sq
    m_end = gl.cdiv(Sq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (gl.maximum(n0 - causal_off, 0) // BLOCK_M) * BLOCK_M
        mid = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - causal_off, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    if n0 + BLOCK_N > Sk:
        mid = m_end  # a partial key block masks its missing keys everywhere
    lo = gl.minimum(lo, m_end)
    mid = gl.minimum(gl.maximum(mid, lo), m_end)
    return lo, mid, (m_end - lo) // BLOCK_M


@gluon.jit
def _attn_bwd_dkdv_ws_kernel(
    q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, QE, DOE, KE, VE, QSE, DOSE, DK, DV,
    stride_qeb, stride_qeg, stride_qeh,
    stride_deb, stride_deg, stride_deh,
    stride_keb, stride_ket, stride_keh,
    stride_veb, stride_vet, stride_veh,
    stride_qseb, stride_qseh, stride_qsed,  # q_seq's and dout_seq's exponents (same shape, contiguous)
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,  # dk's and dv's
    Hq, Hkv, Sq, Sk, group_size, qk_scale, grad_scale,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, DEFER_DK: gl.constexpr, DS_KEY_EXP: gl.constexpr,
    BLOCK_M: gl.constexpr,  # queries per step (GluonDkdvConfig.block_m): 64, or 128 at D = 64 (dense only)
    SLOTS=None,  # jagged: the (rows, SLOT_COLS) int32 tile table of kernels/bwd_varlen_tiles.py (None: dense)
    VARLEN: gl.constexpr = False,
    # fused dQ (GluonDkdvConfig.fuse_dq; dense, split, undeferred): K_seq's descriptor ((B*Hkv*D, Sk), [D, 64]
    # boxes) and the fp32 dQ buffer (B, Sq, Hq, D) the atomics add into
    ks_desc=None, DQ=None, stride_dqb=0, stride_dqm=0, stride_dqh=0,
    FUSE_DQ: gl.constexpr = False,
    DQ_HALVES: gl.constexpr = False,  # fused dQ's product 64 queries at a time (GluonDkdvConfig.dq_halves)
    Q_PERM: gl.constexpr = False,  # Q and dO_hdim through the 5-D query-permuted boxes (GluonDkdvConfig.q_perm)
    LPT_SECTION: gl.constexpr = 0,  # causal CTA order by sections of heads (GluonDkdvConfig.causal_lpt)
):
    """Dense: grid (cdiv(Sk, 128), B * Hkv).  Jagged (VARLEN): grid (table rows, Hkv); CTA (r, hk) computes the
    key tile of row r of SLOTS (heaviest first) for kv head hk, on packed operands: k / v_hdim (Tk, Hkv, D) and
    q / dout_hdim (Tq, Hq, D) as 2-D TMA views; q's / dout_hdim's exponents expanded to one per 64-row tile
    ((2 G, Hq, 1): the sequence's tiles from row 2 SLOTS[r, 6] / 2 SLOTS[r, 9]), k's / v_hdim's (G, Hkv, 1) from
    row SLOTS[r, 7]; q_seq / dout_seq channel-major (Hq, D, Tv) with the sequence's 64-aligned, zero-padded
    columns from SLOTS[r, 8] (so no box reads another sequence), their exponents (B, Hq, D); lse and δ (Hq, Tv) both
    in the padded layout (``padded_lse``) from column SLOTS[r, 10] (zero past the
    sequence's end); dk / dv (Tk, Hkv, D).  After the prologue the code is the dense code at that sequence's Sq,
    Sk; the Q / dO boxes of the last query tile hold the next sequence's rows past Sq: lse = −inf there (the
    consumer's row_ok), so P = 0, and δ = 0, Q_seq = dO_seq = 0 in the padding."""
    if VARLEN:
        # the tile table and the per-64-row exponent rows (qe_row, de_row below) are 64-query steps
        gl.static_assert(BLOCK_M == 64, "the jagged dK/dV kernel steps over 64 queries (GluonDkdvConfig.block_m)")
        # key tiles heaviest first across the batch
        b, n0, q_start, Sq, k_start, Sk, qg_start, kg_start, seq_col, dog_start, dl_col = _tile_row(SLOTS)
        if n0 >= Sk:  # rows past the real tiles are zero: 0 >= 0
            return
        hk = gl.program_id(1)
        pid_n = n0 // BLOCK_N
    else:
        # key blocks fastest within one (b, kv head), as the tl kernel: the heaviest causal blocks (first keys)
        # start first and neighbouring CTAs stream the same query-side tiles through L2; LPT_SECTION: heaviest first
        # over sections of kv heads (kernels/cta_order.py)
        pid_n, pid_bh = _cta_order(gl.program_id(0), gl.program_id(1), gl.num_programs(0), gl.num_programs(1),
                                   LPT_SECTION, False)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        n0 = pid_n * BLOCK_N

    causal_off = Sk - Sq
    lo, mid, n_m = _query_range(n0, Sq, Sk, CAUSAL, BLOCK_M)
    n_steps = group_size * n_m
    h0 = hk * group_size

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    qs_smem = gl.allocate_shared_memory(qs_desc.dtype, [STAGES] + qs_desc.block_type.shape, qs_desc.layout)
    dos_smem = gl.allocate_shared_memory(dos_desc.dtype, [STAGES] + dos_desc.block_type.shape, dos_desc.layout)
    # lse and δ of each step's query tile: [1, BLOCK_M] fp32 boxes of the (B*Hq, Sq) views (4 BLOCK_M B each per stage)
    lse_smem = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    dl_smem = gl.allocate_shared_memory(dl_desc.dtype, [STAGES] + dl_desc.block_type.shape, dl_desc.layout)
    k_smem, v_smem = _static_tiles(k_desc, v_desc, SPLIT)  # 64-key boxes when split
    kv_bar, ready, empty = _step_barriers(STAGES, SPLIT)

    if VARLEN:
        k_row = k_start + n0
        q_row = q_start
        seq_row = 0
        vec_row = 0
        # lse in δ's padded columns (``padded_lse``): a TMA box's first column must be 16-byte aligned (the H200
        # faults with "illegal instruction" at a packed row start such as 129), and δ's columns are 64-aligned
        vec_col = dl_col
        # the consumers' pointers stay uniform (moved by the kv head only); the sequence's parts are integers
        qe_row = 2 * qg_start  # one exponent per 64 rows: two per group of 128
        de_row = 2 * dog_start
        seq_h = b * Hq  # seq exponents (B, Hq, D) contiguous: row b * Hq + hh
        key_row = k_start + n0
        QE_b = QE
        DOE_b = DOE
        QSE_b = QSE
        DOSE_b = DOSE
        KE_t = KE + hk * stride_keh + (kg_start + pid_n) * stride_ket  # BLOCK_N == KV_EXP_GROUP
        VE_t = VE + hk * stride_veh + (kg_start + pid_n) * stride_vet
        DK_t = DK + hk * stride_dkh
        DV_t = DV + hk * stride_dkh
    else:
        k_row = b * Sk + n0
        q_row = b * Sq
        seq_row = b * Hq * HEAD_DIM
        seq_col = 0
        vec_row = b * Hq
        vec_col = 0
        dl_col = 0
        b64 = b.to(gl.int64)
        QE_b = QE + b64 * stride_qeb
        DOE_b = DOE + b64 * stride_deb
        KE_t = KE + b64 * stride_keb + hk * stride_keh + pid_n * stride_ket  # BLOCK_N == KV_EXP_GROUP
        VE_t = VE + b64 * stride_veb + hk * stride_veh + pid_n * stride_vet
        DK_t = DK + b64 * stride_dkb + hk * stride_dkh + n0.to(gl.int64) * stride_dkn
        DV_t = DV + b64 * stride_dkb + hk * stride_dkh + n0.to(gl.int64) * stride_dkn
        QSE_b = QSE + b64 * stride_qseb
        DOSE_b = DOSE + b64 * stride_qseb
        qe_row = 0
        de_row = 0
        seq_h = 0
        key_row = 0
    wg_off = BLOCK_N_WG * stride_dkn  # (split: the second warpgroup's first key row of dk / dv)
    # The three calls below differ in a few arguments, but each partition's argument tuple has to be written out at
    # its call: a tuple held in a variable turns its constexprs into runtime values.  The fused-dQ build has its own
    # call so that the other builds get no captured extra arguments (which changed the dense split build before).
    if FUSE_DQ:
        gl.static_assert(SPLIT and not VARLEN and not DEFER_DK, "fused dQ: split, dense, undeferred builds only")
        gl.static_assert(not Q_PERM, "fused dQ stages dS by natural query order: no query-permuted boxes")
        ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [2] + ks_desc.block_type.shape, ks_desc.layout)
        dsq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N_WG], gl.float8e4nv)
        dsq_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N_WG], dsq_layout)
        DQ_b = DQ + b.to(gl.int64) * stride_dqb
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(0), v_smem.index(0),
                         kv_bar, ready, empty, QE_b, DOE_b, QSE_b, DOSE_b, DK_t, DV_t,
                         stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn,
                         stride_dkd, KE_t, VE_t, Sk - n0, causal_off - n0, Sq, h0,
                         h0 + group_size - 1, lo, mid, n_m, n_steps, qk_scale, grad_scale,
                         qe_row, de_row, seq_h, key_row, HEAD_DIM, STAGES, CAUSAL, 64, 4, DEFER_DK, DS_KEY_EXP,
                         VARLEN, BLOCK_M, False, ks_smem.index(0), dsq_smem.index(0), DQ_b, stride_dqm, stride_dqh,
                         FUSE_DQ, DQ_HALVES)),
            (_consumer, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(1), v_smem.index(1),
                         kv_bar, ready, empty, QE_b, DOE_b, QSE_b, DOSE_b, DK_t + wg_off, DV_t + wg_off,
                         stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn,
                         stride_dkd, KE_t, VE_t, Sk - n0 - BLOCK_N_WG,
                         causal_off - n0 - BLOCK_N_WG, Sq, h0, h0 + group_size - 1, lo, mid, n_m, n_steps,
                         qk_scale, grad_scale, qe_row, de_row, seq_h, key_row,
                         HEAD_DIM, STAGES, CAUSAL, 64, 4, DEFER_DK, DS_KEY_EXP, VARLEN, BLOCK_M, False, ks_smem.index(1),
                         dsq_smem.index(1), DQ_b, stride_dqm, stride_dqh, FUSE_DQ, DQ_HALVES)),
            (_producer_split_dq, (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, ks_desc,
                                  q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, ks_smem,
                                  kv_bar, ready, empty, k_row, hk * HEAD_DIM, (b * Hkv + hk) * HEAD_DIM, n0, q_row,
                                  seq_row, vec_row, h0, lo, n_m, n_steps, HEAD_DIM, STAGES, BLOCK_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif SPLIT:
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(0), v_smem.index(0),
                         kv_bar, ready, empty, QE_b, DOE_b, QSE_b, DOSE_b, DK_t, DV_t,
                         stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn,
                         stride_dkd, KE_t, VE_t, Sk - n0, causal_off - n0, Sq, h0,
                         h0 + group_size - 1, lo, mid, n_m, n_steps, qk_scale, grad_scale,
                         qe_row, de_row, seq_h, key_row, HEAD_DIM, STAGES, CAUSAL, 64, 4, DEFER_DK, DS_KEY_EXP,
                         VARLEN, BLOCK_M, Q_PERM)),
            (_consumer, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(1), v_smem.index(1),
                         kv_bar, ready, empty, QE_b, DOE_b, QSE_b, DOSE_b, DK_t + wg_off, DV_t + wg_off,
                         stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn,
                         stride_dkd, KE_t, VE_t, Sk - n0 - BLOCK_N_WG,
                         causal_off - n0 - BLOCK_N_WG, Sq, h0, h0 + group_size - 1, lo, mid, n_m, n_steps,
                         qk_scale, grad_scale, qe_row, de_row, seq_h, key_row,
                         HEAD_DIM, STAGES, CAUSAL, 64, 4, DEFER_DK, DS_KEY_EXP, VARLEN, BLOCK_M, Q_PERM)),
            (_producer_split, (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem,
                               do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, ready, empty,
                               k_row, hk * HEAD_DIM, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo,
                               n_m, n_steps, HEAD_DIM, STAGES, VARLEN, BLOCK_M, Q_PERM)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, ready,
                         empty, QE_b, DOE_b, QSE_b, DOSE_b, DK_t, DV_t,
                         stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn,
                         stride_dkd, KE_t, VE_t, Sk - n0, causal_off - n0, Sq, h0,
                         h0 + group_size - 1, lo, mid, n_m, n_steps, qk_scale, grad_scale,
                         qe_row, de_row, seq_h, key_row, HEAD_DIM, STAGES, CAUSAL, 128, 8, DEFER_DK, DS_KEY_EXP,
                         VARLEN, BLOCK_M, Q_PERM)),
            (_producer, (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem, do_smem,
                         qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, ready, empty,
                         k_row, hk * HEAD_DIM, q_row, seq_row, seq_col, vec_row, vec_col, dl_col, h0, lo, n_m,
                         n_steps, HEAD_DIM, STAGES, VARLEN, BLOCK_M, Q_PERM)),
        ], [1], [PRODUCER_REGS])


# Triton's JIT turns integer arguments equal to 1 into constants.  With triton 3.6, Sq and group_size both the
# constant 1 (one query row, no GQA: a one-step loop) hits an LLVM assertion while lowering to LLVM IR
# (``PassManager::run failed`` in make_llir; found by scripts/sanitize.sh's gluonbwd case).  Launches with Sq == 1
# take this twin, the same kernel with Sq never specialized; every other launch keeps the GPU-tested one.
_attn_bwd_dkdv_ws_kernel_sq1 = gluon.jit(do_not_specialize=["Sq"])(_attn_bwd_dkdv_ws_kernel.fn)


# ------------------------------------------------------------------------------------------------- persistent kernel
# ``GluonDkdvConfig.persistent`` (session 20, opt-in until measured): one CTA per SM walks the key blocks (the
# per-block grid's order, key blocks fastest within one (b, kv head)), so that a block's prologue (its K / V tiles,
# the first query stages) loads under the previous block's epilogue (dK / dV arithmetic and stores) and no CTA is
# launched per block.  A causal key block has half a non-causal one's query steps on average, so its fixed cost
# weighs twice as much: the causal kernel paid 1.22x the non-causal one per FLOP at S 8k d128 (H100, session 20).
# Dense split builds without fused dQ only.  The ring runs on across items (a running step count ``it``, as the
# forward's persistent kernel); K / V are single-buffered with an "empty" barrier both warpgroups arrive at once
# their last product is in (``_consumer``'s ``kv_empty``), before their epilogue.
@gluon.jit
def _dkdv_item(w, n_kb, Hkv, group_size, Sq, Sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work item w -> (b, kv head, first key, lo, mid, query tiles per head, steps): the per-block kernel's
    prologue for its program (w % n_kb, w // n_kb)."""
    pid_n = w % n_kb
    bh = w // n_kb
    n0 = pid_n * BLOCK_N
    lo, mid, n_m = _query_range(n0, Sq, Sk, CAUSAL, BLOCK_M)
    return bh // Hkv, bh % Hkv, n0, lo, mid, n_m, group_size * n_m


@gluon.jit
def _producer_persistent(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem, do_smem,
                         qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, kv_empty, ready, empty,
                         Hq, Hkv, group_size, Sq, Sk, n_kb, n_work,
                         HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                         Q_PERM: gl.constexpr):
    it = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        b, hk, n0, lo, mid, n_m, n_steps = _dkdv_item(w, n_kb, Hkv, group_size, Sq, Sk, CAUSAL, BLOCK_M)
        mbarrier.wait(kv_empty, (k & 1) ^ 1)  # both warpgroups are done with the last item's K / V (fresh: no wait)
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for wg in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [b * Sk + n0 + wg * BLOCK_N_WG, hk * HEAD_DIM], kv_bar,
                                            k_smem.index(wg))
            tma.async_copy_global_to_shared(v_desc, [b * Sk + n0 + wg * BLOCK_N_WG, hk * HEAD_DIM], kv_bar,
                                            v_smem.index(wg))
        _producer_steps(q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, q_smem, do_smem, qs_smem, dos_smem,
                        lse_smem, dl_smem, ready, empty, b * Sq, b * Hq * HEAD_DIM, 0, b * Hq, 0, 0,
                        hk * group_size, lo, n_m, n_steps, HEAD_DIM, STAGES, False, BLOCK_M, Q_PERM, it)
        it += n_steps
        k += 1


@gluon.jit
def _consumer_persistent(q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_tile, v_tile, kv_bar, kv_empty,
                         ready, empty, QE, DOE, KE, VE, QSE, DOSE, DK, DV,
                         stride_qeb, stride_qeg, stride_qeh, stride_deb, stride_deg, stride_deh,
                         stride_keb, stride_ket, stride_keh, stride_veb, stride_vet, stride_veh,
                         stride_qseb, stride_qseh, stride_qsed, stride_dkb, stride_dkn, stride_dkh, stride_dkd,
                         Hq, Hkv, group_size, Sq, Sk, n_kb, n_work, qk_scale, grad_scale,
                         WG: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         DEFER_DK: gl.constexpr, DS_KEY_EXP: gl.constexpr, BLOCK_M: gl.constexpr,
                         Q_PERM: gl.constexpr):
    """Warpgroup WG's keys (n0 + 64 WG ..) of each work item: the split kernel's consumer, its pointers and query
    range per item as the per-block kernel's dense prologue makes them, the ring from position ``it``."""
    it = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        b, hk, n0, lo, mid, n_m, n_steps = _dkdv_item(w, n_kb, Hkv, group_size, Sq, Sk, CAUSAL, BLOCK_M)
        b64 = b.to(gl.int64)
        pid_n = n0 // BLOCK_N
        h0 = hk * group_size
        row0 = (n0 + WG * BLOCK_N_WG).to(gl.int64) * stride_dkn
        _consumer(q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_tile, v_tile, kv_bar, ready, empty,
                  QE + b64 * stride_qeb, DOE + b64 * stride_deb, QSE + b64 * stride_qseb, DOSE + b64 * stride_qseb,
                  DK + b64 * stride_dkb + hk * stride_dkh + row0, DV + b64 * stride_dkb + hk * stride_dkh + row0,
                  stride_qeg, stride_qeh, stride_deg, stride_deh, stride_qseh, stride_qsed, stride_dkn, stride_dkd,
                  KE + b64 * stride_keb + hk * stride_keh + pid_n * stride_ket,
                  VE + b64 * stride_veb + hk * stride_veh + pid_n * stride_vet,
                  Sk - n0 - WG * BLOCK_N_WG, Sk - Sq - n0 - WG * BLOCK_N_WG, Sq, h0, h0 + group_size - 1, lo, mid,
                  n_m, n_steps, qk_scale, grad_scale, 0, 0, 0, 0,
                  HEAD_DIM, STAGES, CAUSAL, 64, 4, DEFER_DK, DS_KEY_EXP, False, BLOCK_M, Q_PERM,
                  it0=it, kv_ph=k & 1, kv_empty=kv_empty)
        it += n_steps
        k += 1


@gluon.jit
def _attn_bwd_dkdv_ws_persistent_kernel(
    q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, QE, DOE, KE, VE, QSE, DOSE, DK, DV,
    stride_qeb, stride_qeg, stride_qeh,
    stride_deb, stride_deg, stride_deh,
    stride_keb, stride_ket, stride_keh,
    stride_veb, stride_vet, stride_veh,
    stride_qseb, stride_qseh, stride_qsed,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    Hq, Hkv, Sq, Sk, group_size, qk_scale, grad_scale, n_kb, n_work,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, DEFER_DK: gl.constexpr, DS_KEY_EXP: gl.constexpr, BLOCK_M: gl.constexpr,
    Q_PERM: gl.constexpr,
):
    """Grid (min(SMs, n_work),): program p takes work items p, p + grid, ... of the n_work = n_kb * B * Hkv key
    blocks (``_dkdv_item``).  The split kernel's shared memory and ring, plus one mbarrier for K / V's release."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    qs_smem = gl.allocate_shared_memory(qs_desc.dtype, [STAGES] + qs_desc.block_type.shape, qs_desc.layout)
    dos_smem = gl.allocate_shared_memory(dos_desc.dtype, [STAGES] + dos_desc.block_type.shape, dos_desc.layout)
    lse_smem = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    dl_smem = gl.allocate_shared_memory(dl_desc.dtype, [STAGES] + dl_desc.block_type.shape, dl_desc.layout)
    k_smem, v_smem = _static_tiles(k_desc, v_desc, True)
    kv_bar, ready, empty = _step_barriers(STAGES, True)
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_empty, count=2)  # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_consumer_persistent, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(0),
                                v_smem.index(0), kv_bar, kv_empty, ready, empty, QE, DOE, KE, VE, QSE, DOSE, DK, DV,
                                stride_qeb, stride_qeg, stride_qeh, stride_deb, stride_deg, stride_deh,
                                stride_keb, stride_ket, stride_keh, stride_veb, stride_vet, stride_veh,
                                stride_qseb, stride_qseh, stride_qsed, stride_dkb, stride_dkn, stride_dkh, stride_dkd,
                                Hq, Hkv, group_size, Sq, Sk, n_kb, n_work, qk_scale, grad_scale,
                                0, HEAD_DIM, STAGES, CAUSAL, DEFER_DK, DS_KEY_EXP, BLOCK_M, Q_PERM)),
        (_consumer_persistent, (q_smem, do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem.index(1),
                                v_smem.index(1), kv_bar, kv_empty, ready, empty, QE, DOE, KE, VE, QSE, DOSE, DK, DV,
                                stride_qeb, stride_qeg, stride_qeh, stride_deb, stride_deg, stride_deh,
                                stride_keb, stride_ket, stride_keh, stride_veb, stride_vet, stride_veh,
                                stride_qseb, stride_qseh, stride_qsed, stride_dkb, stride_dkn, stride_dkh, stride_dkd,
                                Hq, Hkv, group_size, Sq, Sk, n_kb, n_work, qk_scale, grad_scale,
                                1, HEAD_DIM, STAGES, CAUSAL, DEFER_DK, DS_KEY_EXP, BLOCK_M, Q_PERM)),
        (_producer_persistent, (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc, q_smem,
                                do_smem, qs_smem, dos_smem, lse_smem, dl_smem, k_smem, v_smem, kv_bar, kv_empty,
                                ready, empty, Hq, Hkv, group_size, Sq, Sk, n_kb, n_work,
                                HEAD_DIM, STAGES, CAUSAL, BLOCK_M, Q_PERM)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------- launcher
def _check_row_groups(q, dout_hdim, block_m: int) -> None:
    """q's and dout_hdim's rows per exponent: a multiple of the query step (one scalar exponent per step)."""
    rows = max(ROW_GROUP, block_m)
    for name, t in (("q", q), ("dout_hdim", dout_hdim)):
        g = _row_group(t, name)
        if g % rows:
            raise ValueError(f"{name}: {g} rows per exponent; the Gluon dK/dV kernel needs a multiple of {rows} "
                             f"(row_scaled_triton(x, 'k', k_group=128)); use attn_bwd's tl kernel otherwise")


def _check(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, grad_dtype):
    ops = (("q", q), ("k", k), ("v_hdim", v_hdim), ("q_seq", q_seq), ("dout_hdim", dout_hdim),
           ("dout_seq", dout_seq))
    for name, t in ops:
        if not _is_rs(t):
            raise TypeError(f"{name} must be a RowScaledFP8, got {type(t).__name__}")
        if t.data.ndim != 4:
            raise ValueError(f"{name}: data must be (B, S, H, D), got {tuple(t.data.shape)}")
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    if D not in (64, 128):
        raise ValueError(f"head dim {D} not supported by the Gluon dK/dV kernel (64 or 128)")
    for name, t, want in (("k", k, (B, Sk, Hkv, D)), ("v_hdim", v_hdim, (B, Sk, Hkv, D)),
                          ("q_seq", q_seq, (B, Sq, Hq, D)), ("dout_hdim", dout_hdim, (B, Sq, Hq, D)),
                          ("dout_seq", dout_seq, (B, Sq, Hq, D))):
        if tuple(t.data.shape) != want:
            raise ValueError(f"{name}: data {tuple(t.data.shape)}, expected {want}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    _check_row_groups(q, dout_hdim, ROW_GROUP)
    for name, t in (("k", k), ("v_hdim", v_hdim)):
        if _row_group(t, name) != KV_EXP_GROUP:
            raise ValueError(f"{name}: needs one exponent per {KV_EXP_GROUP} keys (the K layout), got group "
                             f"{t.group}")
    for name, t in (("q_seq", q_seq), ("dout_seq", dout_seq)):
        _check_seq_layout(name, t, B, Sq, Hq, D)
    for name, t in (("lse", lse), ("delta", delta)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (B, Hq, Sq):
            raise ValueError(f"{name} must be a float32 tensor {(B, Hq, Sq)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if grad_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"grad_dtype must be bfloat16, float16 or float32, got {grad_dtype}")
    devs = {t.data.device for _, t in ops} | {lse.device, delta.device}
    if len(devs) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devs))}")


def _tile_exps(t: RowScaledFP8, Sq: int, block_m: int = BLOCK_M_DEFAULT) -> torch.Tensor:
    """Contiguous (B, n, H, 1) int32 exponents, one per block_m-row query tile (row m0 // block_m), of an operand
    grouped by a multiple of block_m; n >= ceil(Sq / block_m) (the last group's tiles past Sq are never read).  With
    block_m = 128 and the usual 128-row groups that is the operand's own exponents, one per step.  One copy kernel (an
    expanded view made contiguous), or none when the groups are the tiles: the host launches as few ATen kernels
    as it can (``repeat_interleave`` + slice + copy took three)."""
    e = t.exp
    r = t.group // block_m
    if r == 1:
        return e.contiguous()
    B, G, H, one = e.shape
    return e.unsqueeze(2).expand(B, G, r, H, one).reshape(B, G * r, H, one)


def _descriptors(q, k, v_hdim, q_seq, dout_hdim, dout_seq, split: bool = False, bm: int = BLOCK_M_DEFAULT,
                 q_perm: bool = False):
    """(q, dout_hdim, q_seq, dout_seq, k, v_hdim) TMA descriptors; with ``q_perm`` (the caller checked
    ``k_perm_ok(Sq, bm)``) Q's and dO_hdim's over the 5-D query-permuted view (B*Sq/16, 2, 4, 2, Hq*D), the
    forward's K boxes applied to the queries."""
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    qd = _hdim_view(q.data, "q")
    dd = _hdim_view(dout_hdim.data, "dout_hdim")
    kd = _hdim_view(k.data, "k")
    vd = _hdim_view(v_hdim.data, "v_hdim")
    bn = (BLOCK_N_WG if split else BLOCK_N).value
    row_layout = nvmma_fp8_layout(bm, D)
    key_layout = nvmma_fp8_layout(bn, D)
    seq_layout = nvmma_fp8_layout(D, bm)
    if q_perm:
        q_desc = permuted_rows_descriptor(qd, B * Sq, Hq * D, bm, D)
        do_desc = permuted_rows_descriptor(dd, B * Sq, Hq * D, bm, D)
    else:
        q_desc = TensorDescriptor(qd, [B * Sq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
        do_desc = TensorDescriptor(dd, [B * Sq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
    qsd, dsd = q_seq.data, dout_seq.data
    qs_desc = TensorDescriptor(qsd, [B * Hq * D, Sq], [qsd.stride(3), 1], [D, bm], seq_layout)
    dos_desc = TensorDescriptor(dsd, [B * Hq * D, Sq], [dsd.stride(3), 1], [D, bm], seq_layout)
    k_desc = TensorDescriptor(kd, [B * Sk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
    v_desc = TensorDescriptor(vd, [B * Sk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
    return q_desc, do_desc, qs_desc, dos_desc, k_desc, v_desc


VEC_PITCH = 4  # fp32 elements per 16 bytes: a TMA row stride is a multiple of this


@functools.lru_cache(maxsize=None)
def _vector_layout():
    """The shared layout of a [1, block_m] fp32 lse / δ box: unswizzled (one 256- or 512-byte row, read back as a
    vector)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _row_pitch(t: torch.Tensor) -> Optional[int]:
    """Row pitch (elements) of a (B, H, S) tensor seen as B*H rows of S, if TMA can read it in place: one pitch
    between all rows, a multiple of VEC_PITCH (16-byte strides), rows not overlapping, unit element stride, base
    16-byte aligned; else None."""
    B, H, S = t.shape
    if S > 1 and t.stride(2) != 1:
        return None
    if H > 1:
        pitch = t.stride(1)
        if B > 1 and t.stride(0) != H * pitch:
            return None
    elif B > 1:
        pitch = t.stride(0)
    else:
        pitch = cdiv(S, VEC_PITCH) * VEC_PITCH  # one row: any pitch will do
    if pitch % VEC_PITCH or pitch < S or t.data_ptr() % 16:
        return None
    return pitch


def _vector_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor, pitch): ``t`` itself where ``_row_pitch`` allows, else a copy of it, the (B, H, S) view of a buffer
    whose rows are padded to a multiple of VEC_PITCH elements.  The copy (the launch's only one: B*H*S*4 bytes read and written, ~2 MB and a
    few microseconds for lse and δ together at B2 H16 S8k, against a kernel of milliseconds) happens for S not a
    multiple of 4 on the contiguous lse / δ the forward and attn_bwd_preprocess make, and for views TMA cannot
    address (misaligned or strided slices); the padding columns are never read (TMA zero fills past S)."""
    pitch = _row_pitch(t)
    if pitch is not None:
        return t, pitch
    B, H, S = t.shape
    pitch = cdiv(S, VEC_PITCH) * VEC_PITCH
    rows = torch.empty(B, H, pitch, dtype=t.dtype, device=t.device)[:, :, :S]
    rows.copy_(t)
    return rows, pitch


def padded_lse(lse: torch.Tensor, cu_seqlens: torch.Tensor, cu_cols: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The jagged batch's lse (Hq, Tq), packed, moved to the padded column layout of δ and the seq operands:
    (Hq, n_cols) fp32, sequence b's rows at columns ``cu_cols[b]`` on (64-aligned), zero in the padding (rows the
    consumer masks).  The jagged dK/dV kernel reads lse in [1, 64] TMA boxes from a sequence's first column, and
    a box must start 16-byte aligned, which a packed start (any row) is not.  Device ops only, no host sync.
    ``cu_seqlens[0]`` must be 0 (rows before it would map to negative columns).  The backward's dispatch gets the
    padded lse from the δ kernel instead (``attn_bwd_preprocess_varlen(lse=...)``, no extra launch); this is the
    PyTorch twin for direct callers and tests."""
    Hq, Tq = lse.shape
    out = lse.new_zeros(Hq, n_cols)
    if Tq and Hq:
        rows = torch.arange(Tq, device=lse.device)
        b = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)  # the sequence of each packed row
        out.index_copy_(1, cu_cols.long()[b] + rows - cu_seqlens.long()[b], lse)
    return out


def _lse_rows(lse: torch.Tensor, bm: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, pitch, columns) of the lse rows the producer reads: ``_vector_rows(lse)`` and its Sq columns, or,
    for 128-query steps with Sq % 128 != 0, a copy whose rows are padded with −inf to a multiple of 128 columns,
    all of them in the descriptor: the last step's box then reads lse = −inf past Sq (P = 0 there) instead of TMA's
    zero fill, and the consumer needs no query-row mask.  The copy is B*Hq*Sq*4 bytes (~1 MB at B2 H16 S8k, a few
    microseconds) and happens only for lengths that are not a multiple of 128."""
    B, H, S = lse.shape
    if bm == BLOCK_M_DEFAULT or S % bm == 0:
        base, pitch = _vector_rows(lse)
        return base, pitch, S
    cols = cdiv(S, bm) * bm
    rows = torch.full((B, H, cols), float("-inf"), dtype=lse.dtype, device=lse.device)
    rows[:, :, :S].copy_(lse)
    return rows, cols, cols


STEP_ROW_ALIGN = 128  # the step rows' columns: Sq rounded up to a multiple of this (both query steps)


@triton.jit
def _step_rows_kernel(LSE, DELTA, BROW, NDL, H, S, cols, s_lb, s_lh, s_ls, s_db, s_dh, s_ds,
                      BLOCK: tl.constexpr):
    """Row b*H + h of the step rows (``_step_rows``), columns of block program_id(1)."""
    r = tl.program_id(0)
    b = (r // H).to(tl.int64)
    h = r % H
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < S
    lse = tl.load(LSE + b * s_lb + h * s_lh + c * s_ls, mask=ok, other=float("-inf"))
    dl = tl.load(DELTA + b * s_db + h * s_dh + c * s_ds, mask=ok, other=0.0)
    brow = tl.where(lse == float("-inf"), float("-inf"), tl.fma(lse, -1.4426950408889634, 8.0))
    out = r.to(tl.int64) * cols + c
    tl.store(BROW + out, brow, mask=c < cols)
    tl.store(NDL + out, tl.where(ok, -dl, 0.0), mask=c < cols)  # +0 past S (3.6's -0.0 is 0 - 0 = +0)


def step_rows_empty(B: int, H: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized step rows (b, −δ) for (B, H, S) queries: two contiguous (B, H, cols) fp32 tensors of one
    allocation (a 16-byte-aligned second half: cols is a multiple of ``STEP_ROW_ALIGN``), for a launch that writes
    them (``_step_rows_kernel``, or ``attn_bwd``'s δ kernel)."""
    cols = cdiv(max(S, 1), STEP_ROW_ALIGN) * STEP_ROW_ALIGN
    brow, ndl = torch.empty(2, B, H, cols, dtype=torch.float32, device=device).unbind(0)
    return brow, ndl


def _check_step_rows(rows, lse: torch.Tensor) -> None:
    """Step rows given to the launcher must be ``step_rows_empty``'s shape for lse's (B, Hq, Sq)."""
    B, H, S = lse.shape
    want = (B, H, cdiv(max(S, 1), STEP_ROW_ALIGN) * STEP_ROW_ALIGN)
    if len(rows) != 2 or any(not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != torch.float32
                             or not t.is_contiguous() or t.device != lse.device for t in rows):
        raise ValueError(f"step_rows: two contiguous float32 tensors of shape {want} on {lse.device} expected")


def _step_rows(lse: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dense dK/dV kernel reads per query in place of lse and δ (session 20): (b, −δ), two contiguous
    (B, Hq, cols) fp32 tensors, cols = Sq rounded up to a multiple of ``STEP_ROW_ALIGN`` (a 16-byte row pitch, and
    whole boxes for both query steps).  b = 8 − lse·log2e (one fma, as the kernel computed it), −inf where lse is
    −inf and past Sq (P = 0 there: the query-row mask); −δ, and +0 past Sq (what the kernel made of the TMA zero fill:
    triton 3.6 negates as 0 − x; written explicitly, whatever a version's negation of zero).
    Each step then reads the exponent offsets of P·256 and dS's δ term without its 16 compares, selects, fmas
    and negations a step and thread (d128: 64 of 656 SASS instructions).  One launch of B·Hq·Sq·8 bytes read and
    16 written (~3 MB at B2 H16 S8k); on CPU tensors (host-side tests) the same values from PyTorch ops in
    float64."""
    B, H, S = lse.shape
    cols = cdiv(max(S, 1), STEP_ROW_ALIGN) * STEP_ROW_ALIGN
    if not lse.is_cuda:
        brow = torch.full((B, H, cols), float("-inf"), dtype=torch.float32)
        ndl = torch.zeros(B, H, cols, dtype=torch.float32)
        v = (8.0 - lse.double() * float(torch.tensor(1.4426950408889634, dtype=torch.float32))).float()
        brow[..., :S] = torch.where(lse == float("-inf"), float("-inf"), v)
        ndl[..., :S] = -delta
        return brow, ndl
    brow, ndl = step_rows_empty(B, H, S, lse.device)
    if B * H:
        block = 1024
        fast_launcher(_step_rows_kernel)[(B * H, cdiv(cols, block))](
            lse, delta, brow, ndl, H, S, cols, *lse.stride(), *delta.stride(), BLOCK=block, num_warps=4)
    return brow, ndl


def _step_row_descriptors(brow: torch.Tensor, ndl: torch.Tensor, bm: int = BLOCK_M_DEFAULT):
    """TMA descriptors of the step rows (``_step_rows``) as (B*Hq, cols) with [1, bm] boxes: the producer loads row
    b*Hq + h, columns m0 .. m0+bm-1 per query step."""
    B, H, cols = brow.shape
    return (TensorDescriptor(brow, [B * H, cols], [cols, 1], [1, bm], _vector_layout()),
            TensorDescriptor(ndl, [B * H, cols], [cols, 1], [1, bm], _vector_layout()))


def _vector_descriptors(lse: torch.Tensor, delta: torch.Tensor, bm: int = BLOCK_M_DEFAULT):
    """TMA descriptors of lse and δ themselves, (B, Hq, Sq) fp32, as (B*Hq, Sq) with [1, bm] boxes (the jagged
    kernel's, which reads raw lse and δ): the producer loads row b*Hq + h, columns m0 .. m0+bm-1 per query step;
    columns past Sq read as 0.0 (TMA zero fill), except lse's with bm = 128, which read −inf (``_lse_rows``)."""
    B, H, S = delta.shape
    lse_base, lse_pitch, lse_cols = _lse_rows(lse, bm)
    dl_base, dl_pitch = _vector_rows(delta)
    return (TensorDescriptor(lse_base, [B * H, lse_cols], [lse_pitch, 1], [1, bm], _vector_layout()),
            TensorDescriptor(dl_base, [B * H, S], [dl_pitch, 1], [1, bm], _vector_layout()))


# Launch plans per call signature (the operands' dtypes, shapes, strides and alignment, the options, the current
# device): a repeated call skips the checks, the descriptors' constructors (each validates its arguments) and the
# launcher's key over 40 arguments; it rebuilds the descriptors over its own tensors (``launch.rebased``) and
# launches the bound kernel.  The backward of a training step calls this launcher once per step with the same
# signature, so the first call pays for the rest.
_PLANS: dict = {}
_MAX_PLANS = 256


def _launch_key(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, causal, softmax_scale, grad_dtype, config,
                dk_out, dv_out):
    ops = tuple((tensor_sig(t.data), tensor_sig(t.exp), t.dim, t.group_dim, t.group) if isinstance(t, RowScaledFP8)
                else None for t in (q, k, v_hdim, q_seq, dout_hdim, dout_seq))
    if None in ops or not isinstance(lse, torch.Tensor) or not isinstance(delta, torch.Tensor) or not launch.PLANS:
        return None  # (bad operands: the checks on the slow path say what is wrong)
    outs = tuple(tensor_sig(t) if isinstance(t, torch.Tensor) else t for t in (dk_out, dv_out))
    dev = launch.current_device() if q.data.is_cuda else -1
    return (ops, tensor_sig(lse), tensor_sig(delta), causal, softmax_scale, grad_dtype, config, outs, dev,
            launch.CAUSAL_LPT)


def plan_for(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, *, causal=False, softmax_scale=None,
             grad_dtype=torch.bfloat16, config=None, dk_out=None, dv_out=None):
    """The launch plan ``attn_bwd_dkdv_gluon`` made for a call with these arguments (None if it made none), for
    ``run_plan``: a caller that keeps it (``attn_bwd.attn_bwd_hopper``'s own plans) skips this launcher's key."""
    return _PLANS.get(_launch_key(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, causal, softmax_scale,
                                  grad_dtype, config, dk_out, dv_out))


def run_plan(plan, q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, dk, dv, step_rows=None) -> None:
    """Launch ``plan`` (``plan_for``) on a call of its signature, writing ``dk`` and ``dv`` (new tensors, or outputs
    of the signature's): the descriptors rebuilt over this call's tensors (``launch.rebased``), the bound kernel.
    ``step_rows`` as ``attn_bwd_dkdv_gluon``'s.  Unchecked: the plan's signature was checked when it was made."""
    bound, templates, scalars, bm = plan
    Sq = q.data.shape[1]
    bases = (_hdim_view(q.data, "q"), _hdim_view(dout_hdim.data, "dout_hdim"), q_seq.data, dout_seq.data,
             *(step_rows or _step_rows(lse, delta)), _hdim_view(k.data, "k"), _hdim_view(v_hdim.data, "v_hdim"))
    bound(*(rebased(t, b) for t, b in zip(templates, bases)), _tile_exps(q, Sq, bm), _tile_exps(dout_hdim, Sq, bm),
          k.exp.contiguous(), v_hdim.exp.contiguous(), q_seq.exp.contiguous(), dout_seq.exp.contiguous(), dk, dv,
          *scalars)


def _exps_and_scalars(q, k, v_hdim, q_seq, dout_hdim, dout_seq, dk, dv, bm: int, softmax_scale: float):
    """The kernel's exponent tensors (QE, DOE, KE, VE, QSE, DOSE) and its integer / float scalars (strides, sizes,
    scales) for a launch with query step ``bm``, as both dense launchers pass them.

    The exponents are contiguous: the unit strides the compiled variant is specialized for (UNIT_STRIDES).  q's and
    dout_hdim's are expanded to one per query step of bm rows (their groups are multiples of bm): the kernel indexes
    them by m0 // BLOCK_M, with no per-operand group argument (fewer live scalars in the consumer); with bm = 128
    and 128-row groups they are the operands' own."""
    B, Sq, Hq, _ = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    qe, de = (_tile_exps(t, Sq, bm) for t in (q, dout_hdim))
    ke, ve = (t.exp.contiguous() for t in (k, v_hdim))
    qse, dse = q_seq.exp.contiguous(), dout_seq.exp.contiguous()
    # the kernel takes one set of strides for q_seq's / dout_seq's exponents and for dk / dv
    assert qse.stride() == dse.stride() and dk.stride() == dv.stride()
    row_e = lambda e: (e.stride(0), e.stride(1), e.stride(2))  # noqa: E731  (B, S or groups, H)
    chan_e = lambda e: (e.stride(0), e.stride(2), e.stride(3))  # noqa: E731  (B, H, D)
    scalars = (*row_e(qe), *row_e(de), *row_e(ke), *row_e(ve), *chan_e(qse), *dk.stride(),
               Hq, Hkv, Sq, Sk, Hq // Hkv, softmax_scale * LOG2E, softmax_scale * 2.0**-P_SCALE_LOG2)
    return (qe, de, ke, ve, qse, dse), scalars


def attn_bwd_dkdv_gluon(q: RowScaledFP8, k: RowScaledFP8, v_hdim: RowScaledFP8, q_seq: RowScaledFP8,
                        dout_hdim: RowScaledFP8, dout_seq: RowScaledFP8, lse: torch.Tensor, delta: torch.Tensor, *,
                        causal: bool = False, softmax_scale: Optional[float] = None,
                        grad_dtype: torch.dtype = torch.bfloat16, config: Optional[GluonDkdvConfig] = None,
                        dk_out: Optional[torch.Tensor] = None, dv_out: Optional[torch.Tensor] = None,
                        step_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
    """(dk, dv) of MXFP8 attention with the warp-specialized Gluon kernel: the operands ``attn_bwd.attn_bwd_hopper``
    passes to its dK/dV kernel on the "dQ from a separate kernel" path.

    q:         (B, Sq, Hq, D) blocked along the head dim, grouped along the sequence by a multiple of 64 rows
               (``row_scaled_triton(q, "k", k_group=128)``).
    k, v_hdim: (B, Sk, Hkv, D), the K layout (``row_scaled_triton(x, "k")``).
    q_seq:     Q blocked along the sequence, the V layout (``row_scaled_triton(q, "v")``: channel-major).
    dout_hdim, dout_seq, delta: from ``attn_bwd.attn_bwd_preprocess(out, dout)`` (dO grouped like q, dO channel-
               major, (B, Hq, Sq) float32 rowsum(dO_hdim ∘ O)).
    lse:       the forward's (B, Hq, Sq) float32 natural-log sum of exp (−inf for rows that see nothing).
    step_rows: the step rows of these lse and delta (``_step_rows``), made by the caller (``attn_bwd``'s δ launch
               writes them, ``step_rows_empty``); None: made here, one launch.
    D is 64 or 128, Hq a multiple of Hkv (dk, dv summed over the query heads of each group); causal masks are
    aligned bottom-right.  Returns dk, dv (B, Sk, Hkv, D) in ``grad_dtype``, contiguous, or ``dk_out`` / ``dv_out``
    written in place (``attn_bwd.grad_outputs``).  Needs an sm_90 GPU and triton 3.6's Gluon.
    """
    key = _launch_key(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, causal, softmax_scale, grad_dtype,
                      config, dk_out, dv_out)
    plan = _PLANS.get(key)
    if step_rows is not None:  # (not in the plan key: checked on every call)
        _check_step_rows(step_rows, lse)
    if plan is not None:  # a signature seen before: checked then
        B, Sk, Hkv, D = k.data.shape
        dk, dv = grad_outputs(dk_out, dv_out, (B, Sk, Hkv, D), grad_dtype, q.data.device)
        run_plan(plan, q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, dk, dv, step_rows)
        return dk, dv
    _check(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, grad_dtype)
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    cfg = config or default_config(D, causal)
    if cfg.stages < 1:
        raise ValueError(f"stages must be >= 1, got {cfg.stages}")
    cfg.check_launch(D)
    bm = cfg.block_m
    if bm != ROW_GROUP:
        _check_row_groups(q, dout_hdim, bm)
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    dev = q.data.device
    dk, dv = grad_outputs(dk_out, dv_out, (B, Sk, Hkv, D), grad_dtype, dev)
    if Sq == 0 or B * Hkv == 0 or Sk == 0:
        return dk.zero_(), dv.zero_()
    q_perm = cfg.q_perm and not cfg.fuse_dq and k_perm_ok(Sq, bm)
    q_desc, do_desc, qs_desc, dos_desc, k_desc, v_desc = _descriptors(q, k, v_hdim, q_seq, dout_hdim, dout_seq,
                                                                     cfg.split, bm, q_perm)
    lse_desc, dl_desc = _step_row_descriptors(*(step_rows or _step_rows(lse, delta)), bm)
    grid = (cdiv(Sk, BLOCK_N.value), B * Hkv)
    kernel = _attn_bwd_dkdv_ws_kernel_sq1 if Sq == 1 else _attn_bwd_dkdv_ws_kernel
    descs = (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc)
    exps, scalars = _exps_and_scalars(q, k, v_hdim, q_seq, dout_hdim, dout_seq, dk, dv, bm, softmax_scale)
    constexprs = dict(HEAD_DIM=D, STAGES=cfg.stages, CAUSAL=causal, PRODUCER_REGS=cfg.producer_regs,
                      SPLIT=cfg.split, CONSUMER_REGS=cfg.consumer_regs, DEFER_DK=cfg.defers_dk, DS_KEY_EXP=cfg.key_exp,
                      BLOCK_M=bm, Q_PERM=q_perm, num_warps=4 if cfg.split else 8, maxnreg=cfg.maxnreg)
    section = launch.lpt_section(causal, cfg.causal_lpt, bm == 64, _sm_count(dev))
    if section and not (cfg.persistent and Sq > 1):  # (the persistent kernel has its own order)
        constexprs["LPT_SECTION"] = section
    if cfg.persistent and Sq > 1:  # (Sq == 1 keeps the per-block kernel's unspecialized twin)
        n_work = grid[0] * grid[1]
        grid = (min(_sm_count(dev), n_work),)
        kernel = _attn_bwd_dkdv_ws_persistent_kernel
        scalars = (*scalars, cdiv(Sk, BLOCK_N.value), n_work)
        del constexprs["SPLIT"]
    args = (*descs, *exps, dk, dv, *scalars)
    if key is None:
        fast_launcher(kernel)[grid](*args, **constexprs)
        return dk, dv
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (BoundLaunch(fast_launcher(kernel), grid, args, constexprs), unbased(descs), scalars, bm)
    return dk, dv


def _check_k_seq(k_seq, B: int, Sk: int, Hkv: int, D: int) -> None:
    """k_seq: the V layout of k (channel-major, one exponent per (kv head, channel)), as q_seq."""
    if not _is_rs(k_seq):
        raise TypeError(f"k_seq must be a RowScaledFP8, got {type(k_seq).__name__}")
    if k_seq.data.ndim != 4 or tuple(k_seq.data.shape) != (B, Sk, Hkv, D):
        raise ValueError(f"k_seq: data {tuple(k_seq.data.shape)}, expected {(B, Sk, Hkv, D)}")
    _check_seq_layout("k_seq", k_seq, B, Sk, Hkv, D)


def attn_bwd_dkdv_dq_gluon(q: RowScaledFP8, k: RowScaledFP8, v_hdim: RowScaledFP8, q_seq: RowScaledFP8,
                           k_seq: RowScaledFP8, dout_hdim: RowScaledFP8, dout_seq: RowScaledFP8, lse: torch.Tensor,
                           delta: torch.Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                           grad_dtype: torch.dtype = torch.bfloat16, config: Optional[GluonDkdvConfig] = None,
                           dk_out: Optional[torch.Tensor] = None, dv_out: Optional[torch.Tensor] = None):
    """(dq, dk, dv) from one launch of the split kernel with dQ fused (``GluonDkdvConfig.fuse_dq``, session 13):
    the operands of ``attn_bwd_dkdv_gluon`` plus ``k_seq`` (k in the V layout, as the dQ kernels take it).

    dk and dv are those of ``attn_bwd_dkdv_gluon`` with the same config without ``fuse_dq`` (the same kernel code
    for them).  dq: each CTA's warpgroups add dS·K over their keys into an fp32 (B, Sq, Hq, D) buffer (zeroed
    here) with atomics, dS cast to e4m3 with one exponent per (64 keys x query step) tile; then one pass applies
    the per-channel factor 2^kse · scale · 2^-8 and casts to ``grad_dtype``.  Not deterministic (the order of the
    adds).  ``config``: default ``GluonDkdvConfig(split=True, block_m=128 at D = 64 else 64, defer_dk=False,
    fuse_dq=True)``; ``dq_halves`` (the dQ product 64 queries at a time) defaults to the causal builds, where the
    whole 128-query product spilled.  dk_out / dv_out as ``attn_bwd_dkdv_gluon``'s.  Needs an sm_90 GPU and triton
    3.6's Gluon."""
    _check(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, grad_dtype)
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    _check_k_seq(k_seq, B, Sk, Hkv, D)
    cfg = config or GluonDkdvConfig(split=True, block_m=128 if D == 64 else 64, defer_dk=False, fuse_dq=True)
    if not cfg.fuse_dq:
        raise ValueError("attn_bwd_dkdv_dq_gluon needs a config with fuse_dq=True")
    cfg.check_launch(D)
    bm = cfg.block_m
    if bm != ROW_GROUP:
        _check_row_groups(q, dout_hdim, bm)
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    dev = q.data.device
    dk, dv = grad_outputs(dk_out, dv_out, (B, Sk, Hkv, D), grad_dtype, dev)
    dq_acc = torch.zeros(B, Sq, Hq, D, dtype=torch.float32, device=dev)
    if Sq == 0 or B * Hkv == 0 or Sk == 0:
        return dq_acc.to(grad_dtype), dk.zero_(), dv.zero_()
    tiles = _descriptors(q, k, v_hdim, q_seq, dout_hdim, dout_seq, True, bm)
    descs = (*tiles[:4], *_step_row_descriptors(*_step_rows(lse, delta), bm), *tiles[4:])
    ksd = k_seq.data
    ks_desc = TensorDescriptor(ksd, [B * Hkv * D, Sk], [ksd.stride(3), 1], [D, BLOCK_N_WG.value],
                               nvmma_fp8_layout(D, BLOCK_N_WG.value))
    exps, scalars = _exps_and_scalars(q, k, v_hdim, q_seq, dout_hdim, dout_seq, dk, dv, bm, softmax_scale)
    kernel = _attn_bwd_dkdv_ws_kernel_sq1 if Sq == 1 else _attn_bwd_dkdv_ws_kernel
    halves = cfg.dq_halves if cfg.dq_halves is not None else causal
    # everything positional (the fused-dQ arguments follow SLOTS / VARLEN), the launch options as keywords
    args = (*descs, *exps, dk, dv, *scalars, D, cfg.stages, causal, cfg.producer_regs, True, cfg.consumer_regs, False, cfg.key_exp, bm, None, False,
            ks_desc, dq_acc, dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2), True, bool(halves))
    fast_launcher(kernel)[(cdiv(Sk, BLOCK_N.value), B * Hkv)](*args, num_warps=4, maxnreg=cfg.maxnreg)
    # dQ rows of query head h hold K_seq's exponents of kv head h // G: one per-channel factor per (b, kv head)
    col = torch.exp2(k_seq.exp.to(torch.float32)) * (softmax_scale * 2.0**-P_SCALE_LOG2)  # (B, 1, Hkv, D)
    G = Hq // Hkv
    dq = (dq_acc.view(B, Sq, Hkv, G, D) * col.view(B, 1, Hkv, 1, D)).view(B, Sq, Hq, D).to(grad_dtype)
    return dq, dk, dv


# Launch plans of the jagged launcher, as the dense one's (_PLANS above): keyed on every operand's signature
# (``attn_bwd_dq_gluon.varlen_sig``: dtypes, shapes, strides, alignment, sequence count, max_seqlen, layout), which
# fixes the grid and every scalar; a hit skips the checks, the eight descriptors' constructors and the launcher's
# key, and still builds the call's own tile table (one launch: the offsets' values are not in the key).  The tile
# table and the constexprs go positionally (the bound launch keeps only its keywords, the launch options, fixed).
_VARLEN_PLANS: dict = {}


def _varlen_launch_key(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, causal, softmax_scale, grad_dtype,
                       config):
    from mxattn.kernels.attn_bwd_dq_gluon import varlen_sig

    ops = tuple(varlen_sig(t) for t in (q, k, v_hdim, q_seq, dout_hdim, dout_seq))
    if None in ops or not isinstance(lse, torch.Tensor) or not isinstance(delta, torch.Tensor) or not launch.PLANS:
        return None  # (bad operands: the checks on the slow path say what is wrong)
    dev = launch.current_device() if q.data.is_cuda else -1
    return (ops, tensor_sig(lse), lse.device, tensor_sig(delta), delta.device, causal, softmax_scale, grad_dtype,
            config, dev)


def attn_bwd_dkdv_gluon_varlen(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse: torch.Tensor, delta: torch.Tensor, *,
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               grad_dtype: torch.dtype = torch.bfloat16, config: Optional[GluonDkdvConfig] = None):
    """(dk, dv) of a jagged batch with the warp-specialized Gluon kernel in its jagged mode (``VARLEN``): the
    operands ``attn_bwd.attn_bwd_hopper_varlen`` passes to it (``kernels.varlen.VarlenFP8``).

    q, dout_hdim:     (Tq, Hq, D), the K layout over cu_seqlens_q (``varlen_k_operand``);
    k, v_hdim:        (Tk, Hkv, D), the K layout over cu_seqlens_k;
    q_seq, dout_seq:  channel-major (Hq, D, Tv) with 64-aligned, zero-padded sequence starts
                      (``varlen_v_operand(..., align=BWD_SEQ_ALIGN)``; the same column offsets for both);
    lse:              (Hq, Tq) float32, the jagged forward's, or already in the padded columns (Hq, Tv)
                      (``attn_bwd_preprocess_varlen(..., lse=lse)``; else ``padded_lse`` moves it, ~10 small launches);
    delta:            (Hq, Tv) float32 in dout_seq's columns, zero in the padding
                      (``attn_bwd_preprocess_varlen(..., delta_padded=True)``).
    One CTA per (key tile of 128 keys of one sequence, kv head), tiles heaviest first
    (``bwd_varlen_tiles.bwd_tile_slots``).  dK and dV are summed over the query heads of each kv head's group.
    ``config`` as for the dense launcher (split, stages, deferred dK, the dS rule ``ds_exp``); the tl jagged
    kernel with ``tl_twin_config(config)`` has the same numerics.
    Returns dk, dv (Tk, Hkv, D) in ``grad_dtype``; each sequence's rows are ``attn_bwd_dkdv_gluon`` on that
    sequence alone (same tiles, same arithmetic).  Needs an sm_90 GPU and triton 3.6's Gluon."""
    from mxattn.kernels.attn_bwd_dq_gluon import _packed_view, check_varlen_operands
    from mxattn.kernels.bwd_varlen_tiles import bwd_tile_slots, tile_rows_bound

    key = _varlen_launch_key(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, causal, softmax_scale,
                             grad_dtype, config)
    plan = _VARLEN_PLANS.get(key)
    if plan is None:  # first call of this signature: every check
        if config is not None:  # before the operands: a 128-query step is refused whatever they are
            config.check_launch(None, varlen=True)
        Tq, Hq, _ = q.data.shape
        Tk, Hkv, _ = k.data.shape
        B, D = check_varlen_operands(dict(q=q, k=k, v_hdim=v_hdim, dout_hdim=dout_hdim),
                                     dict(q_seq=q_seq, dout_seq=dout_seq), {}, Hq, Hkv, grad_dtype)
        Tv = q_seq.data.shape[2]
        # lse packed (Hq, Tq), or already in the padded columns (Hq, Tv) (``attn_bwd_preprocess_varlen(lse=...)``).
        # Tv == Tq only when every sequence's length is a multiple of the alignment, and then the two layouts are one.
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or lse.dim() != 2 or lse.shape[0] != Hq \
                or lse.shape[1] not in (Tq, Tv) or lse.device != q.data.device:
            raise ValueError(f"lse must be float32 ({Hq}, {Tq}) (packed) or ({Hq}, {Tv}) (padded) on {q.data.device}, "
                             f"got {getattr(lse, 'dtype', type(lse).__name__)} {tuple(getattr(lse, 'shape', ()))}")
        if dout_seq.data.shape[2] != Tv or q_seq.align != dout_seq.align:
            raise ValueError(f"q_seq and dout_seq must share one column layout (Tv {Tv} / {dout_seq.data.shape[2]}, "
                             f"align {q_seq.align} / {dout_seq.align})")
        if not isinstance(delta, torch.Tensor) or delta.dtype != torch.float32 or tuple(delta.shape) != (Hq, Tv):
            raise ValueError(f"delta must be the padded float32 {(Hq, Tv)} (attn_bwd_preprocess_varlen(delta_padded="
                             f"True)), got {getattr(delta, 'dtype', type(delta).__name__)} "
                             f"{tuple(getattr(delta, 'shape', ()))}")
        # 64-query steps whatever the dense default becomes (the jagged tile table and exponent rows are per 64 rows)
        cfg = config or replace(default_config(D, causal), block_m=BLOCK_M_DEFAULT)
        if cfg.stages < 1:
            raise ValueError(f"stages must be >= 1, got {cfg.stages}")
        cfg.check_launch(D, varlen=True)
        if Tq == 0 or Tk == 0 or B * Hkv == 0:  # no query anywhere: no key is seen (no plan: nothing to launch)
            z = torch.zeros(Tk, Hkv, D, dtype=grad_dtype, device=q.data.device)
            return z, z.clone()
    else:
        cfg = plan[4]
    Tq, Hq, D = q.data.shape
    Tk, Hkv, _ = k.data.shape
    Tv = q_seq.data.shape[2]
    dev = q.data.device
    dk = torch.empty(Tk, Hkv, D, dtype=grad_dtype, device=dev)
    dv = torch.empty(Tk, Hkv, D, dtype=grad_dtype, device=dev)
    slots = bwd_tile_slots(q.cu_seqlens, k.cu_seqlens, q.cu_exp, k.cu_exp, q_seq.cu_data, dout_hdim.cu_exp,
                           dout_seq.cu_data, k.max_seqlen, key_tiles=True, causal=causal)
    bm = cfg.block_m
    # lse and δ both (Hq, Tv) in dout_seq's padded columns, as (B=1, H, S) rows for the [1, 64] boxes
    if lse.shape[1] != Tv:
        lse = padded_lse(lse.contiguous(), q.cu_seqlens, dout_seq.cu_data, Tv)
    lse3, dl3 = lse.unsqueeze(0), delta.unsqueeze(0)
    qd, dd = _packed_view(q.data, "q"), _packed_view(dout_hdim.data, "dout_hdim")
    kd, vd = _packed_view(k.data, "k"), _packed_view(v_hdim.data, "v_hdim")
    # exponents: q's / dout_hdim's one per 64-row tile (each group of 128 rows from a sequence's start is two
    # tiles: rows 2 cu_exp[b] + m0 / 64); all contiguous (the kernel's UNIT_STRIDES)
    qe, de = (t.exp.repeat_interleave(2, dim=0) for t in (q, dout_hdim))
    ke, ve = (t.exp.contiguous() for t in (k, v_hdim))
    qse, dse = q_seq.exp.contiguous(), dout_seq.exp.contiguous()
    tensors = (qe, de, ke, ve, qse, dse, dk, dv)
    if plan is not None:  # a signature seen before: checked then; the descriptors rebuilt over today's tensors
        bound, templates, scalars, consts, _ = plan
        bases = (qd, dd, q_seq.data, dout_seq.data, _lse_rows(lse3, bm)[0], _vector_rows(dl3)[0], kd, vd)
        bound(*(rebased(t, b) for t, b in zip(templates, bases)), *tensors, *scalars, *consts, slots, True)
        return dk, dv
    bn = (BLOCK_N_WG if cfg.split else BLOCK_N).value
    row_layout, key_layout, seq_layout = nvmma_fp8_layout(bm, D), nvmma_fp8_layout(bn, D), nvmma_fp8_layout(D, bm)
    q_desc = TensorDescriptor(qd, [Tq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
    do_desc = TensorDescriptor(dd, [Tq, Hq * D], [Hq * D, 1], [bm, D], row_layout)
    qs_desc = TensorDescriptor(q_seq.data, [Hq * D, Tv], [Tv, 1], [D, bm], seq_layout)
    dos_desc = TensorDescriptor(dout_seq.data, [Hq * D, Tv], [Tv, 1], [D, bm], seq_layout)
    k_desc = TensorDescriptor(kd, [Tk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
    v_desc = TensorDescriptor(vd, [Tk, Hkv * D], [Hkv * D, 1], [bn, D], key_layout)
    lse_desc, dl_desc = _vector_descriptors(lse3, dl3)
    descs = (q_desc, do_desc, qs_desc, dos_desc, lse_desc, dl_desc, k_desc, v_desc)
    grp = lambda e: (0, e.stride(0), e.stride(1))  # noqa: E731  (groups, H, 1), no batch dim
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    scalars = (*grp(qe), *grp(de), *grp(ke), *grp(ve), *qse.stride(), 0, *dk.stride(),
               Hq, Hkv, 0, 0, Hq // Hkv, scale * LOG2E, scale * 2.0**-P_SCALE_LOG2)
    # HEAD_DIM .. BLOCK_M in signature order, then SLOTS and VARLEN
    consts = (D, cfg.stages, causal, cfg.producer_regs, cfg.split, cfg.consumer_regs, cfg.defers_dk, cfg.key_exp, bm)
    grid = (tile_rows_bound(Tk, q.batch, k.max_seqlen), Hkv)
    options = dict(num_warps=4 if cfg.split else 8, maxnreg=cfg.maxnreg)
    args = (*descs, *tensors, *scalars, *consts, slots, True)
    if key is None:
        fast_launcher(_attn_bwd_dkdv_ws_kernel)[grid](*args, **options)
        return dk, dv
    if len(_VARLEN_PLANS) >= _MAX_PLANS:
        _VARLEN_PLANS.clear()
    bound = BoundLaunch(fast_launcher(_attn_bwd_dkdv_ws_kernel), grid, args, options)
    _VARLEN_PLANS[key] = (bound, unbased(descs), scalars, consts, cfg)
    return dk, dv


# ------------------------------------------------------------------------------------------------- GPU timing
def _tl_dkdv(q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta, *, causal=False, softmax_scale=None,
             grad_dtype=torch.bfloat16, tl_config=None):
    """The ``tl`` dK/dV kernel (``attn_bwd._bwd_dkdv_kernel``, ``ATOMIC_DQ=False``) alone, launched as
    ``attn_bwd_hopper`` launches it on the deterministic path (default tiles 64 x 128, 8 warps, 2 stages, dS
    exponent per tile, or ``tl_config``: ``tl_twin_config(cfg)`` is the twin of the Gluon build ``cfg``), on grouped
    q / dO operands."""
    from mxattn.kernels import attn_bwd as ab

    cfg = tl_config or ab.BwdConfig()
    B, Sq, Hq, D = q.data.shape
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    dev = q.data.device
    dk = torch.empty(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    dv = torch.empty(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    qd, qe, kd, ke, vd, ve = q.data, q.exp, k.data, k.exp, v_hdim.data, v_hdim.exp
    qsd, qse, dhd, dhe, dsd, dse = q_seq.data, q_seq.exp, dout_hdim.data, dout_hdim.exp, dout_seq.data, dout_seq.exp
    row_e = lambda e: (e.stride(0), e.stride(1), e.stride(2))  # noqa: E731
    chan_e = lambda e: (e.stride(0), e.stride(2), e.stride(3))  # noqa: E731
    fast_launcher(ab._bwd_dkdv_kernel)[(cdiv(Sk, cfg.block_n), B * Hkv)](
        qd, qe, kd, ke, vd, ve, qsd, qse, kd, ke, dhd, dhe, dsd, dse, lse, delta, dk, dk, dv,
        *qd.stride(), *row_e(qe), *kd.stride(), *row_e(ke), *vd.stride(), *row_e(ve),
        *qsd.stride(), *chan_e(qse), *kd.stride(), 0, 0, 0,
        *dhd.stride(), *row_e(dhe), *dsd.stride(), *chan_e(dse),
        *lse.stride(), *dk.stride(), *dk.stride(), *dv.stride(),
        Hkv, Sq, Sk, Hq // Hkv, softmax_scale * LOG2E, softmax_scale * 2.0**-P_SCALE_LOG2,
        ab._seq_load_bound(qsd), ab._seq_load_bound(dsd), None, None, None, None, None, None, None,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, ATOMIC_DQ=False,
        DS_TILE_SCALE=cfg.ds_tile_scale, Q_GROUP=q.group, DO_GROUP=dout_hdim.group, EXPLICIT_ROUND=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dk, dv


def dkdv_operands(q, k, v, dout, causal: bool):
    """``backward_operands`` for the dK/dV kernel: q, k, v_hdim, q_seq, dout_hdim, dout_seq, lse, delta (and the
    forward's out)."""
    return backward_operands(q, k, v, dout, causal,
                             ("q", "k", "v_hdim", "q_seq", "dout_hdim", "dout_seq", "lse", "delta"))


def bench_attn_bwd_dkdv_gluon(shapes: Sequence[tuple] = ((2, 16, 16, 8192, 128, False),
                                                          (2, 16, 16, 8192, 128, True)),
                              rep_ms: int = 200, config: Optional[GluonDkdvConfig] = None) -> list[dict]:
    """Time the Gluon dK/dV kernel against the ``tl`` dK/dV-only kernel on the same prepared operands (GPU,
    ``attn_bwd_dq_gluon.time_against_tl``).  TFLOP/s count the kernel's 4 products (Sᵀ, dPᵀ, dV, dK):
    4 * 2 * B * Hq * S^2 * D, half when causal."""
    tl_config = tl_twin_config(config)
    return time_against_tl(shapes, dkdv_operands, lambda **ops: attn_bwd_dkdv_gluon(**ops, config=config),
                           lambda **ops: _tl_dkdv(**ops, tl_config=tl_config), products=4, rep_ms=rep_ms)
