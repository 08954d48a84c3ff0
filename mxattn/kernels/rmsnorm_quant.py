"""Fused RMSNorm + MXFP8 quantization (forward) and the fused RMSNorm backward, in Triton ``tl``.

The forward reads ``x`` once and writes only FP8 data, E8M0 scales (or int32 row exponents) and the fp32
``rstd`` of each row: the normalized ``y`` never exists in memory.  Semantics (bit for bit, both on the GPU
and under ``TRITON_INTERPRET=1``): ``mxattn.producers.rmsnorm_reference`` followed by
``formats.quantize_mxfp8`` (or ``formats.to_row_scaled`` of it).  The fp32 operations and their order:

    xf   = float32(x)                       exact
    sq   = xf * xf                          one rounding per element
    ss   = pairwise_sum(sq)                 the row padded with zeros to a power of two, then adjacent pairs
                                            added level by level (a fixed binary tree; zeros change nothing)
    ms   = ss / N                           correctly rounded division (``tl.div_rn``)
    rstd = 1 / sqrt(ms + eps)               add, correctly rounded sqrt (``tl.sqrt_rn``), division (``div_rn``)
    y    = (xf * rstd) * float32(weight)    two roundings, in that order
    MX quantization of y (fp32, not rounded to the input dtype first)

Kernels are launched with ``enable_fp_fusion=False`` so that no multiply and add are contracted into an FMA
(which would round once instead of twice and break the equality).  Every sum whose order matters is a
sequence of reductions over an axis of size 2 (``tl.sum`` of two values is one addition, whatever layout the
compiler picks), so the tree above is the one the hardware evaluates.

Launchers (all checks on shapes and dtypes are done by ``mxattn.producers``; these take canonical views):

``rmsnorm_quant_fwd(x3, weight, eps, hdim, seq, row_scaled, rceil)``
    ``x3``: (B, S, N), unit stride along N.  Emits
    * hdim (``row_scaled`` False): data (B, S, N) u8, scales (B, S, ceil(N/32)) u8;
    * hdim (``row_scaled`` True): data (B, S, N) u8 re-expressed to one int32 exponent per row, exp (B, S, 1);
    * seq: data in a channel-major (B, N, S_pad) u8 buffer (S_pad = S rounded up to 16, zero padding, the
      layout of ``kernels.quantize``), scales (B, ceil(S/32), N) u8 (blocks of 32 tokens within a batch);
    * rstd (B, S) fp32.
``rmsnorm_bwd(dy, x2, weight, rstd, dy_scale=None)``
    dx (M, N) in x's dtype and dweight (N,) in weight's dtype, from dy (M, N) float, or from MX bytes ``dy``
    (u8 (M, N)) with ``dy_scale`` (u8 (M, ceil(N/32))) dequantized on load.  dweight is reduced over rows
    in two stages with a fixed order (``BwdPlan``), so it is deterministic and equal to
    ``producers.rmsnorm_backward_reference(..., plan=...)`` bit for bit.

Work split.  Forward, hdim only: a program owns ``block_m`` whole rows (N <= 8192: one chunk, x stays in
registers).  With a seq orientation a program owns 32 tokens of one batch (one seq block) and walks N in
chunks of ``block_n``: pass 1 sums squares chunk by chunk (each chunk a subtree of the pairwise tree, the
chunk sums placed in a small vector that is tree-reduced at the end), pass 2 (only for row-scaled hdim output
in chunked mode) finds the row exponents, the last pass re-reads the chunks **in reverse order** (the most
recently read chunks are the likeliest to still be in L2) and quantizes.  Seq and "both" output with MX scales
take the row-set kernel instead (``_rmsnorm_quant_rowset_kernel``, ``FwdTile(rowsets=True)``): the same passes, the
last one reading the 32 tokens as four row sets so that seq words pack in registers and both block reductions stay
inside a warp.  Tiles: ``fwd_tile``/``bwd_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from mxattn.formats import blackwell_scale_bytes
from mxattn.kernels.launch import cdiv, fast_launcher, next_pow2
from mxattn.kernels.quantize import (
    SEQ_ALIGN,
    _e4m3_bytes,
    _hdim_mx,
    _hdim_rows,
    _max_keep_nan,
    _mx_exponent,
    _nan_bytes,
    _pow2,
    _reexpress,
    _soft,
    _tiled_offset,
    _to_f32,
)

__all__ = [
    "FwdTile",
    "BwdPlan",
    "fwd_tile",
    "bwd_plan",
    "rmsnorm_quant_fwd",
    "rmsnorm_bwd",
    "MAX_N_BWD",
    "TILE_OVERRIDES",
]

_NO_EXP = tl.constexpr(-(1 << 20))  # "no nonzero block" sentinel of exponent maxima (quantize.py's)
MAX_N_BWD = 16384  # the backward keeps one whole row of x, dy, weight and the dweight partial in registers
_SINGLE_CHUNK_MAX = 8192  # hdim-only forward: whole rows in registers up to this (padded) width


# ----------------------------------------------------------------------------------------------
# Tiles (one spot).  Both kernels are memory bound (bf16 forward, hdim: 2 B read + ~1 B written per element;
# backward: 4 B read + 2 B written); the aim is ~8K elements per program (quantize.py's sweep found small
# programs with many resident per SM best) and 16-byte accesses.  Defaults are predictions for the H200,
# to be replaced by the sweep in ``bench_producers`` (docs/perf-notes-producers.md).
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FwdTile:
    block_m: int  # rows per program: a power of two; a multiple of 32 when a seq orientation is emitted
    block_n: int  # columns per chunk: a power of two >= 32
    num_warps: int
    # register cap per thread (ptxas ``.maxnreg``), None = the compiler's choice.  The sm_90a builds of one
    # 4096/8192-wide row per program take 95/96 registers: 5 CTAs of 4 warps / 2 CTAs of 8 warps per SM, while the
    # kernel is latency-bound (docs/perf-notes-producers.md, session 7); 80 costs one spilled word.
    maxnreg: Optional[int] = None
    # seq / both orientations with MX scales only (block_m 32): the row-set kernel (``_rmsnorm_quant_rowset_kernel``)
    # instead of the 4-D tile one
    rowsets: bool = False
    # seq orientation (with or without hdim), MX scales, block_m 32 (one seq block), block_n the chunk width of the
    # (8, 4, block_n) tile: the token-block kernel (``_rmsnorm_quant_blocks_kernel``)
    token_blocks: bool = False


@dataclass(frozen=True)
class BwdPlan:
    """How the backward splits rows: program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog),
    walked in tiles of ``block_m`` rows; its dweight partial is (0 + T_0) + T_1 + ... where T_i is the
    pairwise sum of tile i's rows; the partials are then summed in program order (0 + P_0) + P_1 + ..."""

    block_m: int
    rows_per_prog: int
    num_warps: int


# {"fwd": FwdTile(...), "bwd_block_m": int, "bwd_programs": int} for experiments and CPU tests
TILE_OVERRIDES: dict = {}


def _np2(n: int) -> int:
    return max(32, next_pow2(n))


def _warps(elems: int) -> int:
    return 4 if elems <= 4096 else (8 if elems <= 8192 else 16)


# seq / "both" with MX scales: the row-set kernel, as the session-12 bench on the H200 found
# (benchmarks/results/rmsnorm_quant-nvidia-h200-2026-12-01-s12.json, M 16384 bf16, N 4096 / 8192):
# seq (32, 512, 16) 0.119 / 0.222 ms against the 4-D tile kernel's 0.132 (session 11; this run's 4096 default row is
# an outlier, docs/perf-notes-producers.md) / 0.249; both (32, 128, 4, maxnreg 128) 0.142 / 0.281 against
# 0.338 / 0.661.  Row-scaled hdim output, and rows narrower than a chunk (not measured), keep the 4-D kernel.
ROWSET_DEFAULTS = {"seq": FwdTile(32, 512, 16, rowsets=True), "both": FwdTile(32, 128, 4, 128, rowsets=True)}


def fwd_tile(N: int, seq: bool, row_scaled: bool = False, hdim: bool = False) -> FwdTile:
    """Forward tile for rows of N elements.  hdim only: whole rows (one chunk) up to N = 8192, ``block_m`` rows
    so that a program holds ~4K elements; wider rows go through chunks of 8192.  With a seq orientation (``hdim``
    too: "both"): the row-set tile of ``ROWSET_DEFAULTS`` when the output has MX scales (not ``row_scaled``) and
    N is at least its chunk width, else 32 tokens x chunks of at most 256 columns (8K elements)."""
    if "fwd" in TILE_OVERRIDES:
        return TILE_OVERRIDES["fwd"]
    np2 = _np2(N)
    if seq:
        rowset = ROWSET_DEFAULTS["both" if hdim else "seq"]
        if not row_scaled and N >= rowset.block_n:
            return rowset
        # 4 warps: 0.131 / 0.250 ms against 0.185 / 0.380 at 8 warps (N 4096 / 8192, M 16384; the sweep in
        # rmsnorm_quant_sweep-nvidia-h200-2026-11-30-s8.json): more resident programs hide the serial chain
        bn = min(np2, 256)
        return FwdTile(32, bn, 4)
    bn = min(np2, _SINGLE_CHUNK_MAX)
    bm = max(1, 4096 // bn)
    if bm * bn <= 8192:
        # whole rows up to 8192 wide on 4 warps; a cap of 80 registers (one spilled word) where a program holds
        # <= 4096 elements: 0.075 ms against 0.137 (N 4096), and 0.150 against 0.176 at 8 warps (N 8192), same sweep
        return FwdTile(bm, bn, 4, 80 if bm * bn <= 4096 else None)
    return FwdTile(bm, bn, _warps(bm * bn))


def bwd_plan(M: int, N: int, device: torch.device) -> BwdPlan:
    """Backward split: tiles of ~4K elements (whole rows), and about 4 programs per SM (132 SMs on the H200;
    4 programs under the interpreter so that CPU tests cover several partials)."""
    np2 = _np2(N)
    bm = TILE_OVERRIDES.get("bwd_block_m", max(1, 4096 // np2))
    if device.type == "cuda":
        n_prog = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        n_prog = 4
    n_prog = TILE_OVERRIDES.get("bwd_programs", n_prog)
    tiles = max(1, cdiv(M, bm))
    rpp = cdiv(tiles, max(1, min(n_prog, tiles))) * bm
    return BwdPlan(bm, rpp, _warps(bm * np2 * 2))


# ----------------------------------------------------------------------------------------------
# Device helpers (the shared MX tile emitter is also used by linear_quant's epilogue)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pairwise_rows(v, R: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr):
    """Pairwise sum along axis 1 of an (R, C) fp32 tile, C = 2^LOG_C: level i adds columns 2j and 2j + 1.
    Returns (R,)."""
    for i in tl.static_range(LOG_C):
        v = tl.sum(tl.reshape(v, (R, C >> (i + 1), 2)), axis=2)
    return tl.reshape(v, (R,))


@triton.jit
def _pairwise_cols(v, R: tl.constexpr, C: tl.constexpr, LOG_R: tl.constexpr):
    """Pairwise sum along axis 0 of an (R, C) fp32 tile, R = 2^LOG_R (rows 2j and 2j + 1 first).  Returns (C,)."""
    for i in tl.static_range(LOG_R):
        v = tl.sum(tl.reshape(v, (R >> (i + 1), 2, C)), axis=1)
    return tl.reshape(v, (C,))


@triton.jit
def _bf16_rne(y):
    """fp32 -> bf16, round to nearest even in the bits (NaN stays NaN); exact on the GPU and under the
    interpreter (whose fp32 -> bf16 cast truncates)."""
    yb = y.to(tl.int32, bitcast=True)
    yb = tl.where(y != y, 0x7FC00000, yb + 0x7FFF + ((yb >> 16) & 1))
    return (yb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_out(y, OUT_BF16: tl.constexpr, out_ptr):
    """fp32 ``y`` in the element type of ``out_ptr`` (bf16 through ``_bf16_rne``; fp16/fp32 casts round
    to nearest even on the GPU and under the interpreter)."""
    if OUT_BF16:
        r = _bf16_rne(y)
    else:
        r = y.to(out_ptr.dtype.element_ty)
    return r


@triton.jit
def _row_exponent(y, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """Largest block exponent among the hdim blocks (axis 3) of each row of the 4-D tile that quantize to
    something nonzero (``_NO_EXP`` where none does): ``formats.to_row_scaled``'s E, before the sentinel -> 0."""
    mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    _q, _e, _f, nz = _hdim_rows(y, mag, RCEIL, SOFT)
    return tl.max(nz, axis=2, keep_dims=True)


@triton.jit
def _pack4(bytes_, MB: tl.constexpr, MI: tl.constexpr, NB: tl.constexpr):
    """(MB, MI, NB, 32) bytes (token-major) -> (MB * MI / 4, NB * 32) int32 words, word = 4 consecutive tokens
    of one channel, little-endian: the channel-major store then moves 4-byte words (quantize.py measured
    3.6x over byte stores)."""
    BM: tl.constexpr = MB * MI
    BN: tl.constexpr = NB * 32
    t = tl.reshape(bytes_.to(tl.int32), (BM // 4, 4, BN))
    t = tl.reshape(tl.permute(t, (0, 2, 1)), (BM // 4, BN, 2, 2))
    a, b = tl.split(t)  # k = 0, 2 and k = 1, 3
    k0, k2 = tl.split(a)
    k1, k3 = tl.split(b)
    return k0 | (k1 << 8) | (k2 << 16) | (k3 << 24)


@triton.jit
def _emit_mx(
    y,  # (MB, MI, NB, 32) fp32, zero outside the valid rows and columns
    s0, n0, b64, S, N, S_pad,  # first token (within batch b) and channel of the tile; sizes
    hd_ptr, hs_ptr, cd_ptr, cs_ptr,  # hdim data / scales (or row exponents), seq channel-major words / scales
    E,  # (MB, MI, 1, 1) int32 row exponents (row-scaled hdim output), else unused
    MB: tl.constexpr, MI: tl.constexpr, NB: tl.constexpr,
    HDIM: tl.constexpr, SEQ: tl.constexpr, ROWSCALED: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
    SWZ: tl.constexpr = False,
):
    """Quantize and store one tile of y in the orientations asked for.  Rows are tokens s0 + mb * MI + mi of
    batch b (MI = 32 when SEQ: one seq block per mb), columns are channels n0 + nb * 32 + j.

    hdim: data at ((b S + s) N + n), scales at ((b S + s) ceil(N/32) + n / 32), or (ROWSCALED) bytes
    re-expressed to E; seq: 32-bit words of the channel-major (B, N, S_pad) buffer at
    ((b N + n) S_pad + s) / 4, scales at ((b ceil(S/32) + s / 32) N + n).  Tokens in [S, S_pad) are stored as
    zero bytes (the buffer's padding).  ``SWZ``: the hdim scales go to the 128x4-tiled layout of Blackwell MMA
    instead, one (B S, ceil(N/32)) matrix (``formats.to_blackwell_scale_layout``; the buffer comes zeroed)."""
    mb = tl.arange(0, MB)[:, None, None, None]
    mi = tl.arange(0, MI)[None, :, None, None]
    nb = tl.arange(0, NB)[None, None, :, None]
    nj = tl.arange(0, 32)[None, None, None, :]
    sl = mb * MI + mi  # local token (MB, MI, 1, 1)
    nl = nb * 32 + nj  # local channel (1, 1, NB, 32)
    s = s0 + sl
    n = n0 + nl
    mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = tl.max(mag) >= 0x7F800000  # the tile holds NaN/Inf: take the patching branches
    if HDIM:
        row = b64 * S + s0  # int64 scalar
        hd = hd_ptr + row * N + n0
        ok = (s < S) & (n < N)
        if ROWSCALED:
            q, e, fin, _nz = _hdim_rows(y, mag, RCEIL, SOFT)
            tl.store(hd + sl * N + nl, _reexpress(q, e, E, fin, bad, SOFT), mask=ok)
        else:
            out, sc = _hdim_mx(y, y, mag, bad, RCEIL, SOFT)
            tl.store(hd + sl * N + nl, out, mask=ok)
            NBH = (N + 31) // 32
            if SWZ:
                tiled = hs_ptr + _tiled_offset(row + sl, n0 // 32 + nb, (NBH + 3) // 4)
                tl.store(tiled, sc, mask=(s < S) & (n0 // 32 + nb < NBH))
            else:
                hs = hs_ptr + row * NBH + n0 // 32
                tl.store(hs + sl * NBH + nb, sc, mask=(s < S) & (n0 // 32 + nb < NBH))
    if SEQ:
        amax = tl.max(mag, axis=1, keep_dims=True)  # (MB, 1, NB, 32): one per 32 tokens and channel
        e = _mx_exponent(amax, RCEIL)
        out = _e4m3_bytes(y * _pow2(-e), SOFT)
        if bad:
            out = tl.where(mag > 0x7F800000, _nan_bytes(y), out)
        NSB = (S + 31) // 32
        sb = s0 // 32 + mb  # (MB, 1, 1, 1)
        sc = tl.where(amax < 0x7F800000, e + 127, 255).to(tl.uint8)
        tl.store(cs_ptr + (b64 * NSB + sb) * N + n, sc, mask=(sb < NSB) & (n < N))
        words = _pack4(out, MB, MI, NB)  # (MB * MI / 4, NB * 32)
        wl = tl.arange(0, MB * MI // 4)[:, None]
        cl = tl.arange(0, NB * 32)[None, :]
        row_w = S_pad // 4
        cbase = cd_ptr + (b64 * N + n0) * row_w + s0 // 4
        tl.store(cbase + cl.to(tl.int64) * row_w + wl, words, mask=(s0 // 4 + wl < row_w) & (n0 + cl < N))


@triton.jit
def _load_chunk(xp, sxs, w_ptr, sl, nl, n0, S_rem, N):
    """x (raw and fp32) and weight (fp32) of one chunk; zero outside rows < S_rem, columns < N."""
    n = n0 + nl
    okn = n < N
    xr = tl.load(xp + sl * sxs + n, mask=(sl < S_rem) & okn, other=0.0)
    wf = _to_f32(tl.load(w_ptr + n, mask=okn, other=0.0))
    return xr, _to_f32(xr), wf


@triton.jit
def _normalize(xf, rstd, wf, ok):
    return tl.where(ok, (xf * rstd) * wf, 0.0)


@triton.jit
def _rmsnorm_quant_fwd_kernel(
    x_ptr, sxb, sxs,  # x (B, S, N), unit stride along N
    w_ptr, rstd_ptr,  # weight (N,); rstd fp32 (B, S)
    scr_ptr,  # fp32 scratch (programs, BM, NPC) for the chunk sums (chunked mode only)
    hd_ptr, hs_ptr, cd_ptr, cs_ptr,  # outputs (see _emit_mx); hs is int32 (B, S) row exponents when ROWSCALED
    S, N, S_pad, n_s_tiles, eps, n_f,  # n_f: float(N) (an int argument equal to 1 would be a constexpr)
    MB: tl.constexpr, MI: tl.constexpr, BLOCK_N: tl.constexpr, LOG_BN: tl.constexpr,
    NCHUNK: tl.constexpr, NPC: tl.constexpr, LOG_NPC: tl.constexpr,
    HDIM: tl.constexpr, SEQ: tl.constexpr, ROWSCALED: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
    SWZ: tl.constexpr = False,  # hdim scales in the 128x4-tiled layout (_emit_mx)
):
    BM: tl.constexpr = MB * MI
    NB: tl.constexpr = BLOCK_N // 32
    pid = tl.program_id(0)
    b = pid // n_s_tiles
    s0 = (pid % n_s_tiles) * BM
    b64 = b.to(tl.int64)
    xp = x_ptr + b64 * sxb + s0.to(tl.int64) * sxs
    sl = tl.arange(0, MB)[:, None, None, None] * MI + tl.arange(0, MI)[None, :, None, None]
    nl = tl.arange(0, NB)[None, None, :, None] * 32 + tl.arange(0, 32)[None, None, None, :]
    S_rem = S - s0
    row_ok = sl < S_rem

    # pass 1: sum of squares, one pairwise tree per row
    if NCHUNK == 1:
        xr, xf, wf = _load_chunk(xp, sxs, w_ptr, sl, nl, 0, S_rem, N)
        ss = _pairwise_rows(tl.reshape(xf * xf, (BM, BLOCK_N)), BM, BLOCK_N, LOG_BN)
    else:
        # chunk sums go through a small scratch row (BM x NPC fp32 per program, L2-resident) and are
        # tree-reduced once all are in: an in-register (BM, NPC) matrix filled by `where` gets a replicated
        # layout and spills (seen in the sm_90 compile)
        rl = tl.arange(0, BM)
        scr = scr_ptr + pid.to(tl.int64) * (BM * NPC)
        for c in range(NCHUNK):
            _r, xf_c, _w = _load_chunk(xp, sxs, w_ptr, sl, nl, c * BLOCK_N, S_rem, N)
            sc = _pairwise_rows(tl.reshape(xf_c * xf_c, (BM, BLOCK_N)), BM, BLOCK_N, LOG_BN)
            tl.store(scr + rl * NPC + c, sc)
        tl.debug_barrier()  # the chunk sums written by some threads are read by others
        col = tl.arange(0, NPC)[None, :]
        part = tl.load(scr + rl[:, None] * NPC + col, mask=col < NCHUNK, other=0.0)
        ss = _pairwise_rows(part, BM, NPC, LOG_NPC)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, n_f) + eps))  # (BM,)
    rl = tl.arange(0, BM)
    tl.store(rstd_ptr + b64 * S + s0 + rl, rstd, mask=rl < S_rem)
    rstd4 = tl.reshape(rstd, (MB, MI, 1, 1))

    # row exponents of the re-expressed hdim output
    E = tl.zeros((MB, MI, 1, 1), tl.int32)
    if ROWSCALED:
        if NCHUNK == 1:
            E = _row_exponent(_normalize(xf, rstd4, wf, row_ok & (nl < N)), RCEIL, SOFT)
        else:
            E = tl.full((MB, MI, 1, 1), _NO_EXP, tl.int32)
            for c in range(NCHUNK):
                _r, xf_c, wf_c = _load_chunk(xp, sxs, w_ptr, sl, nl, c * BLOCK_N, S_rem, N)
                y = _normalize(xf_c, rstd4, wf_c, row_ok & (c * BLOCK_N + nl < N))
                E = tl.maximum(E, _row_exponent(y, RCEIL, SOFT))
        E = tl.where(E == _NO_EXP, 0, E)
        tl.store(hs_ptr + b64 * S + s0 + sl, E, mask=row_ok)

    # last pass: normalize, quantize, store
    if NCHUNK == 1:
        y = _normalize(xf, rstd4, wf, row_ok & (nl < N))
        _emit_mx(y, s0, 0, b64, S, N, S_pad, hd_ptr, hs_ptr, cd_ptr, cs_ptr, E,
                 MB, MI, NB, HDIM, SEQ, ROWSCALED, RCEIL, SOFT, SWZ)
    else:
        for c in range(NCHUNK):
            n0 = (NCHUNK - 1 - c) * BLOCK_N  # reverse order: the last chunks read are the likeliest in L2
            _r, xf_c, wf_c = _load_chunk(xp, sxs, w_ptr, sl, nl, n0, S_rem, N)
            y = _normalize(xf_c, rstd4, wf_c, row_ok & (n0 + nl < N))
            _emit_mx(y, s0, n0, b64, S, N, S_pad, hd_ptr, hs_ptr, cd_ptr, cs_ptr, E,
                     MB, MI, NB, HDIM, SEQ, ROWSCALED, RCEIL, SOFT, SWZ)


# ----------------------------------------------------------------------------------------------
# Row-set forward (seq / both orientations with MX scales)
# ----------------------------------------------------------------------------------------------

_INF_BITS = tl.constexpr(0x7F800000)
# bits of 2^120: a weight below it in magnitude keeps y = (x rstd) w finite, because |x rstd| <= sqrt(N) (1 + 2^-20)
# <= 2^7 (1 + 2^-20) for every element of a row whose sum of squares and rstd are finite (ss >= x_i^2 and every
# rounding on the way to rstd is monotone), so |y| < 2^127.01 < FLT_MAX
_W_SMALL_BITS = tl.constexpr(0x7B800000)


@triton.jit
def _rowset_cols(n0, NB: tl.constexpr):
    """Channels of a row-set tile, (1, NB, 32): n0 + 32 nb + j."""
    return n0 + tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]


@triton.jit
def _rowset_load(xp, sxs, k: tl.constexpr, n0, S_rem, N, NB: tl.constexpr, EVICT: tl.constexpr):
    """Raw x of row set ``k`` of the chunk that starts at column ``n0``: rows 4w + k (w = 0..7) of the program's 32
    tokens, shape (8, NB, 32), channel n0 + 32 nb + j at [w, nb, j].  Zero past S_rem rows and N columns.

    Axis order matters: Triton orders the dims of a load by contiguity, ties by lower dim first, and fills lanes in
    that order, so this gets 8 channels per thread, 4 lanes along j, 8 lanes along w and the warps along nb: the
    hdim (axis 2) and seq (axis 0) reductions stay inside a warp."""
    w = tl.arange(0, 8)[:, None, None]
    c = _rowset_cols(n0, NB)
    r = 4 * w + k
    return tl.load(xp + r * sxs + c, mask=(r < S_rem) & (c < N), other=0.0, eviction_policy=EVICT)


@triton.jit
def _rowset_weight(w_ptr, n0, N, NB: tl.constexpr):
    """fp32 weight of a chunk broadcast over the 8 words, (8, NB, 32): loaded at the row sets' shape so that it
    gets their layout (a (1, NB, 32) load gets one element per thread and a whole-tile layout conversion)."""
    c = _rowset_cols(n0, NB) + tl.zeros((8, 1, 1), tl.int32)
    return _to_f32(tl.load(w_ptr + c, mask=c < N, other=0.0))


@triton.jit
def _block_sums(v, NB: tl.constexpr):
    """(8, NB, 32) -> (8, NB): the pairwise sum of each block of 32 (levels 1-5 of ``_rowset_tree``)."""
    for i in tl.static_range(5):
        v = tl.sum(tl.reshape(v, (8, NB, 16 >> i, 2)), axis=3)
    return tl.reshape(v, (8, NB))


@triton.jit
def _rowset_tree(v0, v1, v2, v3, NB: tl.constexpr, LOG_NB: tl.constexpr):
    """Pairwise sums over the NB * 32 columns of four row-set tiles (8, NB, 32) fp32 -> (8, 2, 2): [w, a, b] is row
    set k = 2a + b, i.e. row 4w + k.  Column 32 nb + j: levels 1-5 pair j's (within a warp), the next ones pair
    blocks; the four row sets are joined before those (they cross warps), so each is one reduction."""
    v = tl.join(tl.join(_block_sums(v0, NB), _block_sums(v2, NB)), tl.join(_block_sums(v1, NB), _block_sums(v3, NB)))
    for i in tl.static_range(LOG_NB):
        v = tl.sum(tl.reshape(v, (8, NB >> (i + 1), 2, 2, 2)), axis=2)
    return tl.reshape(v, (8, 2, 2))


@triton.jit
def _chunk_rows(xp, sxs, n0, S_rem, N, BN: tl.constexpr, EVICT: tl.constexpr):
    """Raw x of the program's 32 rows at columns n0 .. n0 + BN as a plain (32, BN) tile (a row's chunk lies in one
    warp, so its pairwise sum needs no shared memory); zero past S_rem rows and N columns."""
    r = tl.arange(0, 32)[:, None]
    c = n0 + tl.arange(0, BN)[None, :]
    return tl.load(xp + r * sxs + c, mask=(r < S_rem) & (c < N), other=0.0, eviction_policy=EVICT)


@triton.jit
def _store_chunk_sums(part, c, xr, NPC, BN: tl.constexpr, LOG_BN: tl.constexpr):
    """Chunk c's pairwise sums of squares of the 32 rows of ``xr`` (32, BN) into part[row, c]: the subtree of each
    row's tree that covers the chunk (its start is a multiple of BN)."""
    xf = _to_f32(xr)
    tl.store(part + tl.arange(0, 32) * NPC + c, _pairwise_rows(xf * xf, 32, BN, LOG_BN))


@triton.jit
def _all_chunk_sums(xp, sxs, w_ptr, part, S_rem, N, NCHUNK, NPC, BN: tl.constexpr, LOG_BN: tl.constexpr,
                    EVICT: tl.constexpr):
    """Every chunk's sums of squares into ``part`` (the next chunk's loads issued before the current one's sums),
    and the largest weight magnitude bits per column slot, (BN,)."""
    cl = tl.arange(0, BN)
    wmax = tl.zeros((BN,), tl.int32)
    xr = _chunk_rows(xp, sxs, 0, S_rem, N, BN, EVICT)
    for c in range(NCHUNK):
        xn = _chunk_rows(xp, sxs, tl.minimum(c + 1, NCHUNK - 1) * BN, S_rem, N, BN, EVICT)  # the last trip: again
        _store_chunk_sums(part, c, xr, NPC, BN, LOG_BN)
        wv = _to_f32(tl.load(w_ptr + c * BN + cl, mask=c * BN + cl < N, other=0.0))
        wmax = tl.maximum(wmax, wv.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        xr = xn
    return wmax


@triton.jit
def _rowset_rstd(part, eps, n_f, NCHUNK, NPC, NB: tl.constexpr, LOG_NB: tl.constexpr):
    """Sums of squares and rstd of the program's 32 rows, each (8, 2, 2) as ``_rowset_tree`` returns them, from
    the chunk sums part[row, c]: the top of each row's tree.  The chunk sums are read as (8, NB, 32) tiles (chunk c
    at column c, NCHUNK <= NB * 32; zero past NCHUNK, which leaves every sum as it is), so the tree is
    ``_rowset_tree``, in the row sets' layout, with the four row sets' cross-warp levels joined (an (8, NPC) tile
    per row set is a layout of its own; in a straight-line kernel Triton then converted the x tiles into it rather
    than convert rstd, docs/perf-notes-producers.md, session 12).  Read past L1 (``.cg``): other threads wrote
    them."""
    w = tl.arange(0, 8)[:, None, None]
    c = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    pk = part + (4 * w) * NPC + c
    ok = c < NCHUNK
    p0 = tl.load(pk, mask=ok, other=0.0, cache_modifier=".cg")
    p1 = tl.load(pk + NPC, mask=ok, other=0.0, cache_modifier=".cg")
    p2 = tl.load(pk + 2 * NPC, mask=ok, other=0.0, cache_modifier=".cg")
    p3 = tl.load(pk + 3 * NPC, mask=ok, other=0.0, cache_modifier=".cg")
    ss = _rowset_tree(p0, p1, p2, p3, NB, LOG_NB)
    return ss, tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, n_f) + eps))


@triton.jit
def _row_sets(v):
    """(8, 2, 2) [w, a, b] -> the four row sets' (8, 1, 1) columns, k = 2a + b."""
    e, o = tl.split(v)  # b = 0, 1
    v0, v2 = tl.split(e)
    v1, v3 = tl.split(o)
    return (tl.reshape(v0, (8, 1, 1)), tl.reshape(v1, (8, 1, 1)), tl.reshape(v2, (8, 1, 1)),
            tl.reshape(v3, (8, 1, 1)))


@triton.jit
def _finite(v):
    return (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < _INF_BITS


@triton.jit
def _rowset_y(xr, rstd, wf, live):
    """y = (x rstd) w of one row set (rstd (8, 1, 1)) and its magnitude bits, zero on padding rows (live 0)."""
    y = (_to_f32(xr) * rstd) * wf
    return y, y.to(tl.int32, bitcast=True) & live


@triton.jit
def _nan_fill(mag):
    """0x7F where the magnitude bits are a NaN's, else 0: OR'ed into e4m3 bytes it makes them NaN (S1111111)
    whatever the conversion gave (the interpreter's rounding clamps NaN)."""
    return tl.where(mag > _INF_BITS, 0x7F, 0)


# cvt.rn.satfinite.e4m3x2 (what Triton's fp32 -> e4m3 cast compiles to on sm_90) of two pairs, the two 16-bit
# halves moved into one register: bytes 0..3 = e4m3($1), e4m3($2), e4m3($3), e4m3($4) (the cvt puts its first
# operand in the high byte)
_E4M3X4_ASM = tl.constexpr("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                           "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")


@triton.jit
def _e4m3_word(y0, y1, y2, y3, SOFT: tl.constexpr):
    """int32 words whose byte k is the e4m3 byte of y_k (RNE, saturated to +-448).  On the GPU two conversions and
    one move per word; the shifts and ORs of bytes that Triton makes of the plain form cost ~8 instructions."""
    if SOFT:
        wd = _e4m3_bytes(y0, SOFT).to(tl.int32)
        wd |= _e4m3_bytes(y1, SOFT).to(tl.int32) << 8
        wd |= _e4m3_bytes(y2, SOFT).to(tl.int32) << 16
        wd |= _e4m3_bytes(y3, SOFT).to(tl.int32) << 24
    else:
        wd = tl.inline_asm_elementwise(_E4M3X4_ASM, "=r,r,r,r,r", [y0, y1, y2, y3], dtype=tl.int32, is_pure=True,
                                       pack=1)
    return wd


@triton.jit
def _e4m3_run(y, SOFT: tl.constexpr):
    """e4m3 bytes (uint8) of y, converted 4 register-consecutive elements at a time on the GPU (a thread's 8
    consecutive channels: the bytes land in store order)."""
    if SOFT:
        out = _e4m3_bytes(y, SOFT)
    else:
        out = tl.inline_asm_elementwise(_E4M3X4_ASM, "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
    return out


@triton.jit
def _finite_exponent(amax, RCEIL: tl.constexpr):
    """``_mx_exponent`` of blocks known to be finite, in three instructions: the biased exponent of the maximum
    (for RCEIL with 0x1FFFFF added first, which carries into the exponent exactly when the mantissa is above
    1.75), minus 135, at least -127 (fp32 subnormal maxima land there as in ``_mx_exponent``; finite maxima never
    reach +127).  Zero blocks get -127 instead of 0: their data is 0 with any exponent, and their scale byte is
    set apart (``_finite_scale``)."""
    if RCEIL:
        eb = (amax + 0x1FFFFF) >> 23
    else:
        eb = amax >> 23
    return tl.maximum(eb - 135, -127)


@triton.jit
def _finite_scale(amax, e):
    return tl.where(amax == 0, 127, e + 127).to(tl.uint8)


@triton.jit
def _rowset_hdim(y, mag, hd, ok, BAD: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """hdim blocks (axis 2: 32 channels) of one row set: bytes to ``hd`` (8, NB, 32); returns the scale bytes
    (8, NB, 1).  ``BAD``: the tile may hold Inf / NaN (the exact exponent rule and the NaN bytes)."""
    amax = tl.max(mag, axis=2, keep_dims=True)
    if BAD:
        e = _mx_exponent(amax, RCEIL)
        tl.store(hd, _e4m3_run(y * _pow2(-e), SOFT) | _nan_fill(mag).to(tl.uint8), mask=ok)
        sc = tl.where(amax < _INF_BITS, e + 127, 255).to(tl.uint8)
    else:
        e = _finite_exponent(amax, RCEIL)
        tl.store(hd, _e4m3_run(y * _pow2(-e), SOFT), mask=ok)
        sc = _finite_scale(amax, e)
    return sc


@triton.jit
def _rowset_seq(y0, y1, y2, y3, m0, m1, m2, m3, word_live, cw, cs, ok, blk_ok,
                BAD: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """seq blocks (the 32 tokens: the four row sets and axis 0) of one chunk: int32 words of 4 consecutive tokens
    of a channel (byte k = row set k) to the channel-major ``cw`` (8, NB, 32), scale bytes to ``cs`` (1, NB, 32).
    ``word_live`` (8, 1, 1) clears the bytes of padding tokens; ``BAD`` as in ``_rowset_hdim``."""
    amax = tl.max(tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3)), axis=0, keep_dims=True)
    if BAD:
        e = _mx_exponent(amax, RCEIL)
        p = _pow2(-e)
        nan = _nan_fill(m0) | (_nan_fill(m1) << 8) | (_nan_fill(m2) << 16) | (_nan_fill(m3) << 24)
        tl.store(cw, (_e4m3_word(y0 * p, y1 * p, y2 * p, y3 * p, SOFT) & word_live) | nan, mask=ok)
        tl.store(cs, tl.where(amax < _INF_BITS, e + 127, 255).to(tl.uint8), mask=blk_ok)
    else:
        e = _finite_exponent(amax, RCEIL)
        p = _pow2(-e)
        tl.store(cw, _e4m3_word(y0 * p, y1 * p, y2 * p, y3 * p, SOFT) & word_live, mask=ok)
        tl.store(cs, _finite_scale(amax, e), mask=blk_ok)


@triton.jit
def _rowset_emit(x0, x1, x2, x3, wf, n0, R0, R1, R2, R3, b64, s0, S, N, S_pad,
                 hd_ptr, hs_ptr, cw_ptr, cs_ptr, NB: tl.constexpr, HDIM: tl.constexpr, SEQ: tl.constexpr,
                 BAD: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """Normalize, quantize and store one chunk (the four raw row sets, the weight ``wf`` (8, NB, 32) fp32, the
    rows' rstd R0..R3 (8, 1, 1)) in the orientations asked for; layouts as in ``_emit_mx``.  ``BAD``: the chunk
    may hold Inf / NaN (a constexpr: the caller branches once, outside its chunk loop)."""
    w = tl.arange(0, 8)[:, None, None]
    c = _rowset_cols(n0, NB)
    col_ok = c < N
    S_rem = S - s0
    ok0 = 4 * w < S_rem
    ok1 = 4 * w + 1 < S_rem
    ok2 = 4 * w + 2 < S_rem
    ok3 = 4 * w + 3 < S_rem
    y0, m0 = _rowset_y(x0, R0, wf, tl.where(ok0, 0x7FFFFFFF, 0))
    y1, m1 = _rowset_y(x1, R1, wf, tl.where(ok1, 0x7FFFFFFF, 0))
    y2, m2 = _rowset_y(x2, R2, wf, tl.where(ok2, 0x7FFFFFFF, 0))
    y3, m3 = _rowset_y(x3, R3, wf, tl.where(ok3, 0x7FFFFFFF, 0))
    if HDIM:
        row = b64 * S + s0  # int64 scalar
        hd = hd_ptr + row * N + c + 4 * w * N
        sc0 = _rowset_hdim(y0, m0, hd, ok0 & col_ok, BAD, RCEIL, SOFT)
        sc1 = _rowset_hdim(y1, m1, hd + N, ok1 & col_ok, BAD, RCEIL, SOFT)
        sc2 = _rowset_hdim(y2, m2, hd + 2 * N, ok2 & col_ok, BAD, RCEIL, SOFT)
        sc3 = _rowset_hdim(y3, m3, hd + 3 * N, ok3 & col_ok, BAD, RCEIL, SOFT)
        # the four row sets' scale bytes joined, [w, nb, 0, a, b] = row 4w + 2a + b: one store (one layout
        # conversion) instead of four
        sc = tl.join(tl.join(sc0, sc2), tl.join(sc1, sc3))
        NBH = (N + 31) // 32
        nb = n0 // 32 + tl.arange(0, NB)[None, :, None, None, None]
        srow = (4 * tl.arange(0, 8)[:, None, None, None, None] + 2 * tl.arange(0, 2)[None, None, None, :, None]
                + tl.arange(0, 2)[None, None, None, None, :])
        tl.store(hs_ptr + row * NBH + srow * NBH + nb, sc, mask=(srow < S_rem) & (nb < NBH))
    if SEQ:
        live = tl.where(ok0, 0xFF, 0) | tl.where(ok1, 0xFF00, 0) | tl.where(ok2, 0xFF0000, 0)
        live |= tl.where(ok3, 0xFF, 0) << 24
        row_w = S_pad // 4  # int32 words per channel-major row
        cw = cw_ptr + b64 * N * row_w + s0 // 4 + c.to(tl.int64) * row_w + w
        NSB = (S + 31) // 32  # > s0 // 32: the launcher's blocks start below S (S_pad <= S rounded up to 32)
        cs = cs_ptr + (b64 * NSB + s0 // 32) * N + c
        _rowset_seq(y0, y1, y2, y3, m0, m1, m2, m3, live, cw, cs, (s0 // 4 + w < row_w) & col_ok, col_ok,
                    BAD, RCEIL, SOFT)


@triton.jit
def _rowset_reread(xp, sxs, w_ptr, R0, R1, R2, R3, b64, s0, S, N, S_pad, NCHUNK, hd_ptr, hs_ptr, cw_ptr, cs_ptr,
                   NB: tl.constexpr, HDIM: tl.constexpr, SEQ: tl.constexpr, BAD: tl.constexpr,
                   RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """The last pass of the re-reading kernel: the chunks in reverse order (the last ones summed are the likeliest
    still in L2), each chunk's loads issued before the previous chunk's work."""
    BN: tl.constexpr = NB * 32
    S_rem = S - s0
    last = (NCHUNK - 1) * BN
    x0 = _rowset_load(xp, sxs, 0, last, S_rem, N, NB, "evict_first")
    x1 = _rowset_load(xp, sxs, 1, last, S_rem, N, NB, "evict_first")
    x2 = _rowset_load(xp, sxs, 2, last, S_rem, N, NB, "evict_first")
    x3 = _rowset_load(xp, sxs, 3, last, S_rem, N, NB, "evict_first")
    for i in range(NCHUNK):
        n0 = (NCHUNK - 1 - i) * BN
        nxt = tl.maximum(n0 - BN, 0)  # the next chunk (the last trip loads chunk 0 again)
        y0 = _rowset_load(xp, sxs, 0, nxt, S_rem, N, NB, "evict_first")
        y1 = _rowset_load(xp, sxs, 1, nxt, S_rem, N, NB, "evict_first")
        y2 = _rowset_load(xp, sxs, 2, nxt, S_rem, N, NB, "evict_first")
        y3 = _rowset_load(xp, sxs, 3, nxt, S_rem, N, NB, "evict_first")
        wf = _rowset_weight(w_ptr, n0, N, NB)
        _rowset_emit(x0, x1, x2, x3, wf, n0, R0, R1, R2, R3, b64, s0, S, N, S_pad,
                     hd_ptr, hs_ptr, cw_ptr, cs_ptr, NB, HDIM, SEQ, BAD, RCEIL, SOFT)
        x0, x1, x2, x3 = y0, y1, y2, y3


@triton.jit
def _rmsnorm_quant_rowset_kernel(
    x_ptr, sxb, sxs,  # x (B, S, N), unit stride along N
    w_ptr, rstd_ptr,  # weight (N,); rstd fp32 (B, S)
    part_ptr,  # fp32 (programs, 32, NPC): the chunk sums of each row
    hd_ptr, hs_ptr, cw_ptr, cs_ptr,  # hdim data / scales, seq channel-major int32 words / scales (see _emit_mx)
    S, N, S_pad, n_s_tiles, eps, n_f,
    NCHUNK, NPC,  # chunks of NB * 32 columns (<= NB * 32 of them), NCHUNK rounded up to a power of two
    NB: tl.constexpr, LOG_NB: tl.constexpr,
    HDIM: tl.constexpr, SEQ: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
):
    """RMSNorm + MX quantization of one token block (32 tokens of one batch), with a seq orientation.

    Pass 1 sums each chunk of BN = NB * 32 columns of the 32 rows (plain (32, BN) tiles, the next chunk's loads
    issued before the current one's sums) into ``part``: chunk subtrees of each row's fixed tree (module docstring),
    whose top ``_rowset_rstd`` sums.  The last pass re-reads the chunks in reverse order (the last ones summed are
    the likeliest still in L2) as four row sets (rows 4w + k, ``_rowset_load``): a thread holds the same 8 channels
    of 4 consecutive tokens, packs their seq bytes into one int32 word in registers, and both block reductions stay
    inside a warp (hdim: 8 values x 4 lanes; seq: 4 row sets x 8 lanes).  Whether the program can meet Inf / NaN
    is decided once, from its rows' sums and rstd and the weights, before the last pass: finite programs run a
    loop without the NaN handling (``_rowset_reread`` with BAD False)."""
    BN: tl.constexpr = NB * 32
    pid = tl.program_id(0)
    b = pid // n_s_tiles
    s0 = (pid % n_s_tiles) * 32
    b64 = b.to(tl.int64)
    xp = x_ptr + b64 * sxb + s0.to(tl.int64) * sxs
    S_rem = S - s0
    part = part_ptr + pid.to(tl.int64) * (32 * NPC)

    wmax = _all_chunk_sums(xp, sxs, w_ptr, part, S_rem, N, NCHUNK, NPC, BN, LOG_NB + 5, "evict_last")
    tl.debug_barrier()  # the chunk sums written by some threads are read by others
    ss, rstd = _rowset_rstd(part, eps, n_f, NCHUNK, NPC, NB, LOG_NB)
    rows = 4 * tl.arange(0, 8)[:, None, None] + 2 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(rstd_ptr + b64 * S + s0 + rows, rstd, mask=rows < S_rem)
    # y can only be non-finite where a row's ss or rstd is (x holds Inf / NaN, or eps = 0 on a zero row) or a
    # weight is huge (_W_SMALL_BITS); elsewhere the NaN patching and the exact exponent rule are skipped
    rows_fin = tl.min(((_finite(ss) & _finite(rstd)) | (rows >= S_rem)).to(tl.int32))
    R0, R1, R2, R3 = _row_sets(rstd)
    if (tl.max(wmax) >= _W_SMALL_BITS) | (rows_fin == 0):
        _rowset_reread(xp, sxs, w_ptr, R0, R1, R2, R3, b64, s0, S, N, S_pad, NCHUNK, hd_ptr, hs_ptr, cw_ptr, cs_ptr,
                       NB, HDIM, SEQ, True, RCEIL, SOFT)
    else:
        _rowset_reread(xp, sxs, w_ptr, R0, R1, R2, R3, b64, s0, S, N, S_pad, NCHUNK, hd_ptr, hs_ptr, cw_ptr, cs_ptr,
                       NB, HDIM, SEQ, False, RCEIL, SOFT)


# ----------------------------------------------------------------------------------------------
# Token-block forward (seq orientation, with or without hdim; MX scales)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_load(ptr, ok, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """A load of the token-block kernel: unmasked when the launch has no partial block or chunk (``EVEN``), so that
    the registers need no zeroing and the masks no computing."""
    if EVEN:
        v = tl.load(ptr, eviction_policy=EVICT)
    else:
        v = tl.load(ptr, mask=ok, other=0.0, eviction_policy=EVICT)
    return v


@triton.jit
def _block_exponent(amax, RCEIL: tl.constexpr):
    """``_mx_exponent`` by the finite rule (``_finite_exponent``: zero blocks get -127, which changes no byte) and one
    select for the non-finite blocks, whose exponent is 0."""
    return tl.where(amax >= _INF_BITS, 0, _finite_exponent(amax, RCEIL))


@triton.jit
def _block_scale(amax, e):
    """E8M0 bytes of blocks of maximum bits ``amax`` and exponent ``e`` (``_block_exponent``): 255 for non-finite
    blocks, 127 for zero blocks."""
    return tl.where(amax >= _INF_BITS, 255, _finite_scale(amax, e)).to(tl.uint8)


@triton.jit
def _token_split(t, NG: tl.constexpr):
    """(8, NG, 4, 32) -> its four (8, NG, 32) token slices k = 0..3 (k is in registers: a relabelling)."""
    a, b = tl.split(tl.reshape(tl.permute(t, (0, 1, 3, 2)), (8, NG, 32, 2, 2)))  # k = 0, 2 and k = 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _blocks_rows(xrow, c: tl.constexpr, CH: tl.constexpr, S_rem, N, NW: tl.constexpr, EVEN: tl.constexpr,
                 EVICT: tl.constexpr):
    """Pass 1's raw x of chunk ``c`` of the program's 32 tokens as (NW, 32 / NW, CH) (``xrow``: the (NW, 32 / NW, 1)
    row pointers): token (32 / NW) w + k at [w, k], channel c CH + j at [.., j].  With NW the launch's warps, Triton
    lays j over the lanes (8 a thread), w over the warps and k in registers: a token's chunk stays in one warp, so
    its pairwise sum takes shuffles only."""
    j = c * CH + tl.arange(0, CH)[None, None, :]
    r = (32 // NW) * tl.arange(0, NW)[:, None, None] + tl.arange(0, 32 // NW)[None, :, None]
    return _tile_load(xrow + j, (r < S_rem) & (j < N), EVEN, EVICT)


@triton.jit
def _blocks_chunk(xrow, w_ptr, rs, hd_base, hs_base, cw_base, cs_base, c: tl.constexpr, S_rem, N, NBH, row_w,
                  w_left, NG: tl.constexpr, HDIM: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
                  EVEN: tl.constexpr):
    """Pass 2 of the token-block kernel on chunk ``c`` (NG * 32 channels), as an (8, NG, 4, 32) tile: token 4 w + k at
    [w, :, k], channel c NG 32 + 32 g + j at [:, g, :, j] (``xrow``: the (8, 1, 4, 1) row pointers, ``rs`` their rstd).
    Triton lays j over 4 lanes (8 a thread), w over 8 lanes, g over the warps and k in registers, so both blocks stay
    inside a warp: an hdim block (a token's 32 channels) is 8 values x 4 lanes, a seq block (a channel's 32 tokens)
    4 registers x 8 lanes.  The stores go through pointers laid out as their values are, so that Triton keeps the
    values' layout: the hdim bytes 8 a thread, the seq scale bytes from the first of 8 lanes, the channel-major words
    4 bytes a thread, 8 lanes writing 32 consecutive bytes of a channel's row (``row_w`` words a row, ``w_left`` of
    them from this block on).  Only the hdim scale bytes are still converted through shared memory (two barriers a
    chunk, sm_90a build): their pointers (quad lane, w, g, k) did not get the quad axis ordered first."""
    CH: tl.constexpr = NG * 32
    w = tl.arange(0, 8)[:, None, None, None]
    g = tl.arange(0, NG)[None, :, None, None]
    k = tl.arange(0, 4)[None, None, :, None]
    j = tl.arange(0, 32)[None, None, None, :]
    ch = c * CH + g * 32 + j  # (1, NG, 1, 32)
    tok = 4 * w + k  # (8, 1, 4, 1)
    xf = _to_f32(_tile_load(xrow + ch, (tok < S_rem) & (ch < N), EVEN, "evict_first"))
    wf = _to_f32(_tile_load(w_ptr + ch + w * 0, ch < N, EVEN, "evict_last"))  # (8, NG, 1, 32)
    y = (xf * rs) * wf  # (8, NG, 4, 32)
    if HDIM:
        a4 = tl.reduce(tl.abs(tl.reshape(y, (8, NG, 4, 4, 8))), 4, _max_keep_nan)  # (8, NG, 4, quad lane)
        amax = tl.reduce(a4, 3, _max_keep_nan, keep_dims=True).to(tl.int32, bitcast=True)  # (8, NG, 4, 1)
        e = _block_exponent(amax, RCEIL)
        out = _e4m3_run(y * _pow2(-e), SOFT)
        if SOFT:
            out |= _nan_fill(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.uint8)
        hoff = tl.max_contiguous(tok * N + ch, [1, 1, 1, 8])
        tl.store(hd_base + hoff, out, mask=(tok < S_rem) & (ch < N))
        sc = tl.broadcast_to(_block_scale(amax, e), (8, NG, 4, 4))  # over the quad lanes: (w, g, k, quad lane)
        q = tl.arange(0, 4)[:, None, None, None]  # (quad lane, w, g, k)
        tq = 4 * tl.arange(0, 8)[None, :, None, None] + tl.arange(0, 4)[None, None, None, :]
        bq = c * NG + tl.arange(0, NG)[None, None, :, None]
        soff = tl.max_contiguous(tq * NBH + bq + q * 0, [1, 1, 1, 1])
        tl.store(hs_base + soff, tl.permute(sc, (3, 0, 1, 2)), mask=(q == 0) & (tq < S_rem) & (bq < NBH))
    # seq: a channel's 32 tokens (k in registers, w over 8 lanes)
    m = tl.reduce(tl.reduce(tl.abs(y), 2, _max_keep_nan, keep_dims=True), 0, _max_keep_nan, keep_dims=True)
    amax_s = m.to(tl.int32, bitcast=True)  # (1, NG, 1, 32)
    e_s = _block_exponent(amax_s, RCEIL)
    sc_s = _block_scale(amax_s, e_s)
    coff = tl.max_contiguous(ch + w * 0, [1, 1, 1, 8])
    tl.store(cs_base + coff, tl.broadcast_to(sc_s, (8, NG, 1, 32)), mask=(w == 0) & (ch < N))
    ys = y * _pow2(-e_s)
    y0, y1, y2, y3 = _token_split(ys, NG)
    wd = _e4m3_word(y0, y1, y2, y3, SOFT)  # (8, NG, 32): a word's byte k is token 4 w + k
    if SOFT:
        m0, m1, m2, m3 = _token_split(_nan_fill(ys.to(tl.int32, bitcast=True) & 0x7FFFFFFF), NG)
        wd |= m0 | (m1 << 8) | (m2 << 16) | (m3 << 24)
    # (quad lane, w, g, channel in the thread): the words' own layout
    wq = tl.arange(0, 8)[None, :, None, None]
    cq = c * CH + tl.arange(0, NG)[None, None, :, None] * 32 + tl.arange(0, 4)[:, None, None, None] * 8 \
        + tl.arange(0, 8)[None, None, None, :]
    if not EVEN:  # bytes of tokens past S are 0 (the buffer's padding)
        n_real = S_rem - 4 * tl.arange(0, 8)[:, None, None]
        wd = tl.where(n_real >= 4, wd, wd & ((1 << (8 * tl.maximum(n_real, 0))) - 1))
    woff = tl.max_contiguous(cq.to(tl.int64) * row_w + wq, [1, 1, 1, 1])
    tl.store(cw_base + woff, tl.permute(tl.reshape(wd, (8, NG, 4, 8)), (2, 0, 1, 3)),
             mask=(wq < w_left) & (cq < N))


@triton.jit
def _pairwise_merge(v, c: tl.constexpr, t0, t1, t2, t3, t4, t5):
    """Chunk c's sum ``v`` into the pairwise tree (a binary counter: it joins the partial sums whose subtrees it
    completes, left + right), so the top of each row's tree is the fixed tree of the module docstring.  Returns the
    merged value and the updated levels; after the last chunk (a power of two of them, at most 64) the merged value
    is the whole sum."""
    if c % 2 == 0:
        t0 = v
    else:
        v = t0 + v
        if (c // 2) % 2 == 0:
            t1 = v
        else:
            v = t1 + v
            if (c // 4) % 2 == 0:
                t2 = v
            else:
                v = t2 + v
                if (c // 8) % 2 == 0:
                    t3 = v
                else:
                    v = t3 + v
                    if (c // 16) % 2 == 0:
                        t4 = v
                    else:
                        v = t4 + v
                        if (c // 32) % 2 == 0:
                            t5 = v
                        else:
                            v = t5 + v
    return v, t0, t1, t2, t3, t4, t5


@triton.jit
def _rmsnorm_quant_blocks_kernel(
    x_ptr, sxb, sxs,  # x (B, S, N), unit stride along N
    w_ptr, rstd_ptr,  # weight (N,); rstd fp32 (B, S)
    hd_ptr, hs_ptr, cw_ptr, cs_ptr,  # hdim data / scales; seq channel-major int32 words / scales (see _emit_mx)
    S, N, S_pad, n_s_tiles, eps, n_f,
    NCH: tl.constexpr, CH: tl.constexpr, LOG_CH: tl.constexpr,
    HDIM: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
    EVEN: tl.constexpr,  # S % 32 == 0 and N == NCH * CH: no partial token block or chunk
    NW: tl.constexpr,  # the launch's warps (a power of two up to 32): pass 1 gives each warp 32 / NW tokens
):
    """RMSNorm + MX quantization of one token block (32 tokens of one batch) in the seq orientation, and in the hdim
    one too with ``HDIM``.

    Pass 1 walks the chunks (the next one's loads first) as (NW, 32 / NW, CH) tiles (``_blocks_rows``: a token's
    chunk inside one warp) and sums each token's chunk as a subtree of its pairwise tree (shuffles only), joining the
    chunk sums into the tree top as they come (``_pairwise_merge``, in registers).  Pass 2 (``_blocks_chunk``) walks
    the chunks again in reverse order (the last read are the likeliest in L2) as (8, CH / 32, 4, 32) tiles, the
    row-set kernel's layout: both blocks inside a warp (hdim: 8 values x 4 lanes; seq: 4 registers x 8 lanes), a
    thread's 4 tokens of a channel one channel-major word (two cvt), every store in its values' own layout.  No branch
    for Inf / NaN: the finite exponent rule with non-finite blocks set to 0, and the cvt's NaN and saturation."""
    pid = tl.program_id(0)
    b = pid // n_s_tiles
    st = pid % n_s_tiles
    s0 = st * 32
    b64 = b.to(tl.int64)
    S_rem = S - s0
    RW: tl.constexpr = 32 // NW  # pass 1: tokens a warp
    r1 = RW * tl.arange(0, NW)[:, None, None] + tl.arange(0, RW)[None, :, None]  # (NW, RW, 1) token of the block
    xrow = x_ptr + b64 * sxb + (s0 + r1).to(tl.int64) * sxs

    # pass 1: each token's sum of squares, in chunks of CH1 <= 256 columns (32 lanes x 8: a token's chunk in one warp)
    CH1: tl.constexpr = CH if CH < 256 else 256
    NCH1: tl.constexpr = NCH * (CH // CH1)
    LOG_CH1: tl.constexpr = LOG_CH if CH < 256 else 8
    t0 = tl.zeros((32,), tl.float32)
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    x_n = _blocks_rows(xrow, 0, CH1, S_rem, N, NW, EVEN, "evict_last")
    for c in tl.static_range(NCH1):
        x_c = x_n
        if c + 1 < NCH1:
            x_n = _blocks_rows(xrow, c + 1, CH1, S_rem, N, NW, EVEN, "evict_last")
        xf = _to_f32(x_c)
        ss = _pairwise_rows(tl.reshape(xf * xf, (32, CH1)), 32, CH1, LOG_CH1)
        ss, t0, t1, t2, t3, t4, t5 = _pairwise_merge(ss, c, t0, t1, t2, t3, t4, t5)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, n_f) + eps))  # (32,) in token order
    tl.store(rstd_ptr + b64 * S + s0 + tl.arange(0, 32), rstd, mask=tl.arange(0, 32) < S_rem)
    # padding tokens get rstd 0: y = 0 there (or NaN where w is Inf, and then every real token's y is non-finite too),
    # so they do not reach the seq maxima
    r = 4 * tl.arange(0, 8)[:, None, None] + tl.arange(0, 4)[None, :, None]  # (8, 4, 1): pass 2's token 4 w + k
    rs = tl.where(r < S_rem, tl.reshape(rstd, (8, 4, 1)), 0.0)

    # pass 2: normalize, quantize, store (``_blocks_chunk``); chunks in reverse order
    NG: tl.constexpr = CH // 32
    NBH = (N + 31) // 32
    NSB = (S + 31) // 32
    row_w = S_pad // 4  # int32 words per channel-major row
    rs2 = tl.reshape(tl.permute(rs, (0, 2, 1)), (8, 1, 4, 1))  # rstd at (w, 1, k, 1), 0 for padding tokens
    xrow2 = x_ptr + b64 * sxb + (s0 + 4 * tl.arange(0, 8)[:, None, None, None]
                                 + tl.arange(0, 4)[None, None, :, None]).to(tl.int64) * sxs
    hd_base = hd_ptr + (b64 * S + s0) * N
    hs_base = hs_ptr + (b64 * S + s0) * NBH
    cw_base = cw_ptr + b64 * N * row_w + s0 // 4
    cs_base = cs_ptr + (b64 * NSB + st) * N
    for i in tl.static_range(NCH):
        _blocks_chunk(xrow2, w_ptr, rs2, hd_base, hs_base, cw_base, cs_base, NCH - 1 - i, S_rem, N, NBH,
                      row_w, row_w - s0 // 4, NG, HDIM, RCEIL, SOFT, EVEN)


@triton.jit
def _rmsnorm_bwd_kernel(
    x_ptr, sxm, dy_ptr, sdym, dys_ptr, sdysm,  # x (M, N); dy (M, N) float or MX bytes; dy scales (M, ceil(N/32))
    w_ptr, rstd_ptr, dx_ptr, part_ptr,  # weight (N,); rstd (M,); dx (M, N) contiguous; partials fp32 (P, N)
    M, N, rows_per_prog, n_f,
    BLOCK_M: tl.constexpr, LOG_BM: tl.constexpr, BLOCK_N: tl.constexpr, LOG_BN: tl.constexpr,
    DY_MX: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """dx = ((g - xhat * c) * rstd) with xhat = x * rstd, g = dy * w, c = pairwise_sum(g * xhat) / N;
    the program's dweight partial = (0 + T_0) + T_1 + ..., T_i = pairwise sum over the rows of tile i of
    dy * xhat."""
    pid = tl.program_id(0)
    r0 = pid * rows_per_prog
    rl = tl.arange(0, BLOCK_M)[:, None]
    nl = tl.arange(0, BLOCK_N)[None, :]
    okn = nl < N
    wf = _to_f32(tl.load(w_ptr + nl, mask=okn, other=0.0))
    acc = tl.zeros((BLOCK_N,), tl.float32)
    r_end = tl.minimum(r0 + rows_per_prog, M)
    # fixed trip count (the last program's tiles past M are fully masked and add +0: the value is unchanged)
    for t in range(0, rows_per_prog, BLOCK_M):
        r = r0 + t + rl
        ok = (r < r_end) & okn
        r64 = r.to(tl.int64)
        xf = _to_f32(tl.load(x_ptr + r64 * sxm + nl, mask=ok, other=0.0))
        if DY_MX:
            qb = tl.load(dy_ptr + r64 * sdym + nl, mask=ok, other=0)
            sb = tl.load(dys_ptr + r64 * sdysm + nl // 32, mask=ok, other=127).to(tl.int32)
            q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            # 2^(byte - 127) (byte 0: the fp32 subnormal 2^-127); NaN for scale 255 and NaN data (the
            # interpreter decodes e4m3 NaN as 480)
            sf = tl.where(sb == 0, 0x400000, sb << 23)
            sf = tl.where((sb == 255) | ((qb & 0x7F) == 0x7F), 0x7FC00000, sf).to(tl.float32, bitcast=True)
            dyf = q * sf
        else:
            dyf = _to_f32(tl.load(dy_ptr + r64 * sdym + nl, mask=ok, other=0.0))
        rstd = tl.load(rstd_ptr + r, mask=r < r_end, other=0.0)  # (BLOCK_M, 1)
        xhat = xf * rstd
        g = dyf * wf
        c = tl.div_rn(_pairwise_rows(g * xhat, BLOCK_M, BLOCK_N, LOG_BN), n_f)
        dx = (g - xhat * c[:, None]) * rstd
        tl.store(dx_ptr + r64 * N + nl, _cast_out(dx, OUT_BF16, dx_ptr), mask=ok)
        acc = acc + _pairwise_cols(tl.where(ok, dyf * xhat, 0.0), BLOCK_M, BLOCK_N, LOG_BM)
    n1 = tl.arange(0, BLOCK_N)
    tl.store(part_ptr + pid.to(tl.int64) * N + n1, acc, mask=n1 < N)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, P, N, BLOCK_N: tl.constexpr, OUT_BF16: tl.constexpr):
    """out[n] = (0 + part[0, n]) + part[1, n] + ... in program order."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for p in range(P):
        acc = acc + tl.load(part_ptr + p * N + n, mask=ok, other=0.0)
    tl.store(out_ptr + n, _cast_out(acc, OUT_BF16, out_ptr), mask=ok)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _log2(n: int) -> int:
    return int(n).bit_length() - 1


def rmsnorm_quant_fwd(
    x3: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    hdim: bool,
    seq: bool,
    row_scaled: bool,
    rceil: bool,
    tile: Optional[FwdTile] = None,
    tiled_scales: bool = False,
) -> dict:
    """Run the forward kernel on canonical (B, S, N) ``x3`` (unit stride along N).  Returns a dict with
    ``rstd`` (B, S) fp32 and, as asked, ``hd`` (B, S, N) u8 with ``hs`` (B, S, ceil(N/32)) u8 or ``he``
    (B, S, 1) int32 (row-scaled), ``cd`` (B, N, S_pad) u8 channel-major with ``cs`` (B, ceil(S/32), N) u8.
    ``tiled_scales``: ``hs`` is instead the 128x4-tiled layout of one (B S, ceil(N/32)) matrix (flat u8)."""
    B, S, N = x3.shape
    dev = x3.device
    tile = tile or fwd_tile(N, seq, row_scaled, hdim)
    if tile.token_blocks and (not seq or row_scaled or tiled_scales or tile.block_m != 32 or tile.block_n < 32
                              or _np2(N) > 64 * min(tile.block_n, 256) or tile.num_warps not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"a token-block tile emits a seq orientation with MX scales from 32-token programs, rows of "
                         f"at most 64 chunks of min(block_n, 256) columns: got {tile} for N {N}, seq={seq}, "
                         f"row_scaled={row_scaled}")
    if seq and tile.block_m % 32:
        raise ValueError(f"a seq orientation needs block_m to be a multiple of 32, got {tile.block_m}")
    rowsets = tile.rowsets
    if rowsets and (not seq or row_scaled or tile.block_m != 32):
        raise ValueError(f"a row-set tile emits a seq orientation with MX scales from 32-token programs: got {tile} "
                         f"for seq={seq}, row_scaled={row_scaled}")
    if rowsets and (tile.block_n < 32 or cdiv(N, tile.block_n) > tile.block_n):
        raise ValueError(f"a row-set tile needs block_n >= 32 and at most block_n chunks (N <= block_n^2): got "
                         f"block_n {tile.block_n} for N {N}")
    out = {"rstd": torch.empty(B, S, dtype=torch.float32, device=dev)}
    dummy = torch.empty(16, dtype=torch.uint8, device=dev)
    hd = hs = cd = cs = dummy
    s_pad = SEQ_ALIGN
    if hdim:
        hd = out["hd"] = torch.empty(B, S, N, dtype=torch.uint8, device=dev)
        if row_scaled:
            hs = out["he"] = torch.empty(B, S, 1, dtype=torch.int32, device=dev)
        elif tiled_scales:
            hs = out["hs"] = torch.zeros(blackwell_scale_bytes(B * S, cdiv(N, 32)), dtype=torch.uint8,
                                         device=dev)
        else:
            hs = out["hs"] = torch.empty(B, S, cdiv(N, 32), dtype=torch.uint8, device=dev)
    if seq:
        s_pad = cdiv(max(S, 1), SEQ_ALIGN) * SEQ_ALIGN
        cd = out["cd"] = torch.empty(B, N, s_pad, dtype=torch.uint8, device=dev)
        cs = out["cs"] = torch.empty(B, cdiv(S, 32), N, dtype=torch.uint8, device=dev)
    # seq outputs cover the zero padding up to s_pad, so tiles then run over max(S, s_pad)
    s_cover = max(S, s_pad) if seq else S
    if B == 0 or s_cover == 0 or N == 0:
        if seq and B * N:
            cd.zero_()
        return out
    bm, bn = tile.block_m, tile.block_n
    mi = 32 if seq else bm
    nchunk = cdiv(N, bn)
    npc = next_pow2(nchunk)
    n_s_tiles = cdiv(s_cover, bm)
    if tile.token_blocks:
        _launch_token_blocks(x3, weight, eps, out, hd, hs, cd, cs, s_pad, n_s_tiles, tile, hdim, rceil)
        return out
    if rowsets:
        _launch_rowsets(x3, weight, eps, out, hd, hs, cd, cs, s_pad, n_s_tiles, nchunk, npc, tile, hdim, rceil)
        return out
    scr = torch.empty(B * n_s_tiles * bm * npc if nchunk > 1 else 1, dtype=torch.float32, device=dev)
    fast_launcher(_rmsnorm_quant_fwd_kernel)[(B * n_s_tiles,)](
        x3, x3.stride(0), x3.stride(1), weight, out["rstd"], scr,
        hd, hs, cd.view(torch.int32) if seq else dummy, cs,
        S, N, s_pad, n_s_tiles, float(eps), float(N),
        MB=bm // mi, MI=mi, BLOCK_N=bn, LOG_BN=_log2(bn), NCHUNK=nchunk, NPC=npc, LOG_NPC=_log2(npc),
        HDIM=hdim, SEQ=seq, ROWSCALED=row_scaled, RCEIL=rceil, SOFT=_soft(dev), SWZ=tiled_scales,
        num_warps=tile.num_warps, enable_fp_fusion=False, **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
    )
    return out


def _launch_token_blocks(x3, weight, eps, out, hd, hs, cd, cs, s_pad, n_s_tiles, tile, hdim, rceil) -> None:
    """``_rmsnorm_quant_blocks_kernel`` for ``rmsnorm_quant_fwd`` (seq orientation, MX scales, 32-token programs)."""
    B, S, N = x3.shape
    np2 = _np2(N)
    ch = min(tile.block_n, np2)
    fast_launcher(_rmsnorm_quant_blocks_kernel)[(B * n_s_tiles,)](
        x3, x3.stride(0), x3.stride(1), weight, out["rstd"], hd, hs, cd.view(torch.int32), cs,
        S, N, s_pad, n_s_tiles, float(eps), float(N),
        NCH=np2 // ch, CH=ch, LOG_CH=_log2(ch), HDIM=hdim, RCEIL=rceil,
        SOFT=_soft(x3.device), EVEN=S % 32 == 0 and s_pad == S and N == np2, NW=tile.num_warps,
        num_warps=tile.num_warps, enable_fp_fusion=False, **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
    )


def _launch_rowsets(x3, weight, eps, out, hd, hs, cd, cs, s_pad, n_s_tiles, nchunk, npc, tile, hdim, rceil) -> None:
    """``_rmsnorm_quant_rowset_kernel`` for ``rmsnorm_quant_fwd`` (seq orientation, MX scales, 32-token groups)."""
    B, S, N = x3.shape
    dev = x3.device
    groups = B * n_s_tiles
    part = torch.empty(groups * 32 * npc, dtype=torch.float32, device=dev)
    fast_launcher(_rmsnorm_quant_rowset_kernel)[(groups,)](
        x3, x3.stride(0), x3.stride(1), weight, out["rstd"], part,
        hd, hs, cd.view(torch.int32), cs, S, N, s_pad, n_s_tiles, float(eps), float(N), nchunk, npc,
        NB=tile.block_n // 32, LOG_NB=_log2(tile.block_n // 32),
        HDIM=hdim, SEQ=True, RCEIL=rceil, SOFT=_soft(dev),
        num_warps=tile.num_warps, enable_fp_fusion=False, **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
    )


def rmsnorm_bwd(
    dy: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy_scale: Optional[torch.Tensor] = None,
    plan: Optional[BwdPlan] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (M, N) in ``x2.dtype`` and dweight (N,) in ``weight.dtype``.  ``x2``, ``dy``: (M, N) with unit stride
    along N; ``dy`` float, or u8 MX data with ``dy_scale`` u8 (M, ceil(N/32)) (unit stride along its last dim);
    ``rstd`` (M,) fp32 contiguous."""
    M, N = x2.shape
    dev = x2.device
    if N > MAX_N_BWD:
        raise ValueError(f"the fused backward keeps whole rows in registers: N must be <= {MAX_N_BWD}, got {N}")
    dx = torch.empty(M, N, dtype=x2.dtype, device=dev)
    plan = plan or bwd_plan(M, N, dev)
    n_prog = max(1, cdiv(M, plan.rows_per_prog))
    part = torch.zeros(n_prog, N, dtype=torch.float32, device=dev)
    dw = torch.empty(N, dtype=weight.dtype, device=dev)
    if N == 0:
        return dx, dw
    if M > 0:
        np2 = _np2(N)
        fast_launcher(_rmsnorm_bwd_kernel)[(n_prog,)](
            x2, x2.stride(0), dy, dy.stride(0), dy_scale if dy_scale is not None else dy,
            dy_scale.stride(0) if dy_scale is not None else 0,
            weight, rstd, dx, part, M, N, plan.rows_per_prog, float(N),
            BLOCK_M=plan.block_m, LOG_BM=_log2(plan.block_m), BLOCK_N=np2, LOG_BN=_log2(np2),
            DY_MX=dy_scale is not None, OUT_BF16=x2.dtype == torch.bfloat16,
            num_warps=plan.num_warps, enable_fp_fusion=False,
        )
    bn = 1024
    fast_launcher(_sum_partials_kernel)[(cdiv(N, bn),)](
        part, dw, n_prog, N, BLOCK_N=bn, OUT_BF16=weight.dtype == torch.bfloat16, num_warps=4,
        enable_fp_fusion=False,
    )
    return dx, dw
