"""Linear layer with an FP8 main loop and MXFP8 quantization fused into the epilogue, in Triton ``tl``.

``y = x W^T (+ bias)``, quantized to MXFP8 along N (``hdim``: one scale per token per 32 output channels)
and/or along the tokens (``seq``: one scale per output channel per 32 tokens of one batch), without y ever
reaching memory in a wide format.

Hopper has no block-scaled MMA, so the K-dim scales are re-expressed (DESIGN §3): each row of x and each
row of W (an output channel) is ``RowScaledFP8`` — FP8 data and one power-of-two exponent per row — so that

    y[m, n] = sum_k x'[m, k] 2^Ex[m] * W'[n, k] 2^Ew[n] = 2^(Ex[m] + Ew[n]) * (x' W'^T)[m, n]

The main loop is a plain FP8 ``tl.dot`` (wgmma e4m3 x e4m3 -> fp32); the two exponents are applied to the
fp32 accumulator in the epilogue (two exact power-of-two multiplies), then the bias is added and the tile is
MX-quantized by ``rmsnorm_quant._emit_mx`` (the same emitter as the RMSNorm producer: hdim blocks need
``block_n`` to be a multiple of 32, seq blocks ``block_m``).  Accumulation: by default the dot promotes the
wgmma partial sums into the fp32 accumulator every ``block_k`` elements (``max_num_imprecise_acc=block_k``;
Triton's sm_90 default lets the tensor core accumulate over the whole K with its reduced-precision adder);
``LinearTile.precise_acc=False`` turns that off for speed.

Launchers (inputs checked by ``mxattn.producers``):

``row_scaled_rows(t, rceil)``
    (R, K) float tensor or ``MXTensor`` blocked along K -> ``RowScaledFP8`` (R, K) with exp (R, 1), equal to
    ``formats.row_scaled_from_float(t, -1)`` / ``formats.to_row_scaled(t)`` byte for byte.  Chunks of K: one
    pass when K fits a chunk, else an exponent pass and a data pass.
``linear_quant_fwd(xr, wr, bias, B, S, hdim, seq, rceil)``
    ``xr``: ``RowScaledFP8`` (B*S, K) (one exponent per row), ``wr``: (N, K) (one per output channel).
    Returns ``hd`` (B*S, N) u8 and ``hs`` (B*S, ceil(N/32)) u8 (hdim), ``cd`` (B, N, S_pad) u8 channel-major
    and ``cs`` (B, ceil(S/32), N) u8 (seq).  M tiles never cross a batch boundary.

Kernel choice (``linear_kernel``): ``MXATTN_LINEAR_KERNEL=auto|tl|gluon`` (or ``KERNEL_OVERRIDE``).  ``auto``
takes the persistent warp-specialized Gluon kernel (``kernels.linear_quant_gluon``) on sm_90 with a Triton it was
verified on (``kernels.gluon_verified``) when it takes the operands (TMA alignment, ``gluon_eligible``) and no
``tl`` tile was asked for (``tile`` / ``TILE_OVERRIDE``), else this module's ``tl`` kernel (also under the interpreter and off Hopper); ``gluon`` raises when the Gluon
kernel cannot run.  Same outputs: with ``precise_acc`` (default) both kernels sum per-``block_k`` wgmma partials
into fp32 in K order (the Gluon module docstring says why they agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from mxattn.formats import MXTensor, RowScaledFP8, blackwell_scale_bytes
from mxattn.kernels import gluon_verified
from mxattn.kernels.launch import cdiv, fast_launcher, next_pow2
from mxattn.kernels.quantize import (
    SEQ_ALIGN,
    _e4m3_bytes,
    _hdim_rows,
    _pow2,
    _reexpress,
    _soft,
    _to_f32,
)
from mxattn.kernels.rmsnorm_quant import _emit_mx

__all__ = ["LinearTile", "linear_tile", "row_scaled_rows", "linear_quant_fwd", "linear_kernel", "TILE_OVERRIDE",
           "KERNEL_OVERRIDE"]

_NO_EXP = tl.constexpr(-(1 << 20))


# ----------------------------------------------------------------------------------------------
# Tiles.  The main loop is the matmul tutorial's FP8 Hopper shape (128 x 128 x 128, 8 warps, 4 stages:
# 2 x 16 KB of operands per stage); BN = 128 keeps the fp32 accumulator at 64 registers per thread so the
# quantizing epilogue fits beside it.  To be swept on the H200 (bench_producers).
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearTile:
    block_m: int = 128  # multiple of 32: whole seq blocks
    block_n: int = 128  # multiple of 32: whole hdim blocks
    block_k: int = 128
    group_m: int = 8  # M tiles per band of the L2-friendly program order
    num_warps: int = 8
    num_stages: int = 4
    precise_acc: bool = True  # promote the wgmma partial sums every block_k elements


TILE_OVERRIDE: Optional[LinearTile] = None
KERNEL_OVERRIDE: Optional[str] = None  # "auto" | "tl" | "gluon"; else MXATTN_LINEAR_KERNEL (default auto)
KERNEL_ENV = "MXATTN_LINEAR_KERNEL"
ROWS_CHUNK = 2048  # row re-expression: K elements per chunk (a program owns ROWS_BLOCK_R rows)


def linear_kernel(xd: torch.Tensor, wd: torch.Tensor, tile_asked: bool) -> str:
    """"tl" or "gluon" for these FP8 operands (module docstring)."""
    mode = (KERNEL_OVERRIDE or os.environ.get(KERNEL_ENV) or "auto").lower()
    if mode not in ("auto", "tl", "gluon"):
        raise ValueError(f"{KERNEL_ENV} must be auto, tl or gluon, got {mode!r}")
    if mode == "tl" or (mode == "auto" and tile_asked):
        return "tl"
    ok = xd.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
    if ok and mode == "auto" and not gluon_verified():
        return "tl"  # another Triton: Gluon's API moves between releases (the attention kernels' rule)
    if ok:
        try:
            from mxattn.kernels.linear_quant_gluon import gluon_eligible
        except ImportError:  # a Triton without Gluon's Hopper module
            ok = False
        else:
            ok = gluon_eligible(xd, wd)
    if mode == "gluon" and not ok:
        raise ValueError("the Gluon linear kernel needs an sm_90 CUDA device (not the interpreter) and FP8 "
                         "operands with 16-byte aligned rows and base pointers")
    return "gluon" if ok else "tl"


def linear_tile(M: int, N: int, K: int, seq: bool) -> LinearTile:
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    return LinearTile()


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pow2_wide(e):
    """Exact fp32 2^e for int32 e in [-149, 127] (subnormal below -126)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 1 << tl.maximum(e + 149, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rows_exp_chunk(src_ptr, ssr, sc_ptr, ssc, r, k, ok, kb, okb, FROM_MX: tl.constexpr,
                    RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """Per row (axis 1), the largest exponent of this chunk's blocks that quantize to nonzero (_NO_EXP if none)."""
    if FROM_MX:
        qb = tl.load(src_ptr + r * ssr + k, mask=ok, other=0)
        sb = tl.load(sc_ptr + r * ssc + kb, mask=okb, other=255).to(tl.int32)
        anyq = tl.max(qb & 0x7F, axis=3, keep_dims=True) != 0
        eb = tl.where(anyq & (sb != 255), sb - 127, _NO_EXP)
    else:
        xf = _to_f32(tl.load(src_ptr + r * ssr + k, mask=ok, other=0.0))
        _q, _e, _f, eb = _hdim_rows(xf, xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, RCEIL, SOFT)
    return tl.max(eb, axis=2, keep_dims=True)


@triton.jit
def _rows_bytes_chunk(src_ptr, ssr, sc_ptr, ssc, r, k, ok, kb, okb, E, FROM_MX: tl.constexpr,
                      RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """The chunk's bytes re-expressed to the row exponents E (formats.to_row_scaled)."""
    if FROM_MX:
        qb = tl.load(src_ptr + r * ssr + k, mask=ok, other=0)
        sb = tl.load(sc_ptr + r * ssc + kb, mask=okb, other=127).to(tl.int32)
        q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        out = _e4m3_bytes(q * _pow2(tl.minimum(tl.maximum(sb - 127 - E, -31), 0)), SOFT)
        nanq = (qb & 0x7F) == 0x7F
        isnan_blk = sb == 255
        if tl.max(tl.where(nanq, 1, 0)) + tl.max(tl.where(isnan_blk, 1, 0)) > 0:
            # NaN data keeps its sign (torch); NaN blocks become +NaN (formats.to_row_scaled)
            out = tl.where(nanq, qb | 0x7F, out)
            out = tl.where(isnan_blk & ok, 127, out).to(tl.uint8)
    else:
        xf = _to_f32(tl.load(src_ptr + r * ssr + k, mask=ok, other=0.0))
        mag = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        q, e, fin, _nz = _hdim_rows(xf, mag, RCEIL, SOFT)
        out = _reexpress(q, e, E, fin, tl.max(mag) >= 0x7F800000, SOFT)
    return out


@triton.jit
def _rows_row_scaled_kernel(
    src_ptr, ssr,  # float rows (R, K), or MX data bytes, unit stride along K
    sc_ptr, ssc,  # MX scale bytes (R, ceil(K/32)), unit stride along the blocks (FROM_MX)
    out_ptr, exp_ptr,  # u8 (R, K) contiguous; int32 (R,)
    R, K,
    BR: tl.constexpr, BK: tl.constexpr, NCHUNK: tl.constexpr,
    FROM_MX: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
):
    """One exponent per row: E = the largest exponent among the row's blocks that quantize to nonzero (0 if
    none), data re-expressed to it.  Tile (1, BR, BK/32, 32)."""
    NB: tl.constexpr = BK // 32
    r0 = tl.program_id(0) * BR
    r = (r0 + tl.arange(0, BR)[None, :, None, None]).to(tl.int64)
    kl = tl.arange(0, NB)[None, None, :, None] * 32 + tl.arange(0, 32)[None, None, None, :]
    kbl = tl.arange(0, NB)[None, None, :, None]
    okr = r < R
    E = tl.full((1, BR, 1, 1), _NO_EXP, tl.int32)
    for c in range(NCHUNK):
        k = c * BK + kl
        kb = c * NB + kbl
        E = tl.maximum(E, _rows_exp_chunk(src_ptr, ssr, sc_ptr, ssc, r, k, okr & (k < K), kb,
                                          okr & (kb * 32 < K), FROM_MX, RCEIL, SOFT))
    E = tl.where(E == _NO_EXP, 0, E)
    tl.store(exp_ptr + r, E, mask=okr)
    for c in range(NCHUNK):
        k = c * BK + kl
        kb = c * NB + kbl
        ok = okr & (k < K)
        out = _rows_bytes_chunk(src_ptr, ssr, sc_ptr, ssc, r, k, ok, kb, okr & (kb * 32 < K), E,
                                FROM_MX, RCEIL, SOFT)
        tl.store(out_ptr + r * K + k, out, mask=ok)


@triton.jit
def band_tile(pid, n_row_tiles, n_col_tiles, GROUP_M: tl.constexpr):
    """Program -> (row tile, column tile), GROUP_M row tiles per band, column tiles slower inside a band: the
    band's weight columns stay in L2 while its rows stream (also used by ``kernels.qkv_proj``, heads as columns)."""
    per_band = GROUP_M * n_col_tiles
    first = (pid // per_band) * GROUP_M
    gsz = tl.minimum(n_row_tiles - first, GROUP_M)
    return first + (pid % per_band) % gsz, (pid % per_band) // gsz


@triton.jit
def _linear_quant_kernel(
    x_ptr, sxm, xe_ptr,  # x' fp8 (B*S, K), unit stride along K; Ex int32 (B*S,)
    w_ptr, swn, we_ptr,  # W' fp8 (N, K), unit stride along K; Ew int32 (N,)
    b_ptr,  # bias (N,) (HAS_BIAS)
    hd_ptr, hs_ptr, cd_ptr, cs_ptr,  # outputs (rmsnorm_quant._emit_mx)
    S, N, K, S_pad, n_m_tiles, n_row_tiles,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HDIM: tl.constexpr, SEQ: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr,
    SWZ: tl.constexpr = False,  # hdim scales in the 128x4-tiled layout (rmsnorm_quant._emit_mx)
):
    pid_m, pid_n = band_tile(tl.program_id(0), n_row_tiles, tl.cdiv(N, BN), GROUP_M)
    b = pid_m // n_m_tiles
    s0 = (pid_m % n_m_tiles) * BM
    n0 = pid_n * BN
    b64 = b.to(tl.int64)

    rm = s0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    row = b64 * S + tl.minimum(rm, S - 1)  # clamped: rows past S read valid memory and are zeroed below
    col = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + row[:, None] * sxm + rk[None, :]
    b_ptrs = w_ptr + col[None, :] * swn + rk[:, None]  # (BK, BN) view of K-major W: what wgmma wants
    acc = tl.zeros((BM, BN), tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            bt = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - kt * BK, other=0.0)
            bt = tl.load(b_ptrs, mask=rk[:, None] < K - kt * BK, other=0.0)
        if PRECISE:
            acc = tl.dot(a, bt, acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(a, bt, acc)
        a_ptrs += BK
        b_ptrs += BK

    ex = tl.load(xe_ptr + row)
    ew = tl.load(we_ptr + col)
    y = (acc * _pow2_wide(ex)[:, None]) * _pow2_wide(ew)[None, :]
    if HAS_BIAS:
        y = y + _to_f32(tl.load(b_ptr + col))[None, :]
    y = tl.where((rm < S)[:, None] & (rn < N)[None, :], y, 0.0)
    y4 = tl.reshape(y, (BM // 32, 32, BN // 32, 32))
    dummy_e = tl.zeros((BM // 32, 32, 1, 1), tl.int32)
    _emit_mx(y4, s0, n0, b64, S, N, S_pad, hd_ptr, hs_ptr, cd_ptr, cs_ptr, dummy_e,
             BM // 32, 32, BN // 32, HDIM, SEQ, False, RCEIL, SOFT, SWZ)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _rows_plan(K: int) -> tuple[int, int, int, int]:
    """(rows per program, K chunk, chunks, warps) for the row re-expression: ~4K elements per program."""
    bk = min(max(32, next_pow2(K)), ROWS_CHUNK)
    br = max(1, 4096 // bk)
    return br, bk, cdiv(K, bk), 4 if br * bk <= 4096 else 8


def row_scaled_rows(t, rceil: bool = True) -> RowScaledFP8:
    """(R, K) float tensor or MXTensor (blocked along K) -> RowScaledFP8 with one exponent per row."""
    if isinstance(t, MXTensor):
        src = t.data.view(torch.uint8)
        sc = t.scale_bytes
        if sc.stride(-1) != 1:
            sc = sc.contiguous()
    else:
        src, sc = t, None
    if src.stride(-1) != 1:
        src = src.contiguous()
    R, K = src.shape
    dev = src.device
    out = torch.empty(R, K, dtype=torch.uint8, device=dev)
    exp = torch.empty(R, 1, dtype=torch.int32, device=dev)
    if R and K:
        br, bk, nchunk, warps = _rows_plan(K)
        fast_launcher(_rows_row_scaled_kernel)[(cdiv(R, br),)](
            src, src.stride(0), sc if sc is not None else src, sc.stride(0) if sc is not None else 0,
            out, exp, R, K, BR=br, BK=bk, NCHUNK=nchunk, FROM_MX=sc is not None, RCEIL=rceil, SOFT=_soft(dev),
            num_warps=warps,
        )
    elif R:
        exp.zero_()
    return RowScaledFP8(out.view(torch.float8_e4m3fn), exp, 1)


def linear_quant_fwd(
    xr: RowScaledFP8,
    wr: RowScaledFP8,
    bias: Optional[torch.Tensor],
    B: int,
    S: int,
    *,
    hdim: bool,
    seq: bool,
    rceil: bool,
    tile: Optional[LinearTile] = None,
    tiled_scales: bool = False,
) -> dict:
    """The fused product on row-scaled operands; see the module docstring for the outputs.  ``tiled_scales``:
    ``hs`` in the 128x4-tiled layout of one (M, ceil(N/32)) matrix (flat u8) instead of (M, ceil(N/32))."""
    xd, wd = xr.data, wr.data
    if xd.stride(-1) != 1:
        xd = xd.contiguous()
    if wd.stride(-1) != 1:
        wd = wd.contiguous()
    xe = xr.expanded_exp().reshape(xd.shape[0]).contiguous()
    we = wr.expanded_exp().reshape(wd.shape[0]).contiguous()
    M, K = xd.shape
    N = wd.shape[0]
    assert M == B * S, (M, B, S)
    dev = xd.device
    kernel = linear_kernel(xd, wd, tile is not None or TILE_OVERRIDE is not None)
    tile = tile or linear_tile(M, N, K, seq)
    if tile.block_m % 32 or tile.block_n % 32:
        raise ValueError(f"block_m and block_n must be multiples of 32, got {tile}")
    out = {}
    dummy = torch.empty(16, dtype=torch.uint8, device=dev)
    hd = hs = cd = cs = dummy
    s_pad = SEQ_ALIGN
    if hdim:
        hd = out["hd"] = torch.empty(M, N, dtype=torch.uint8, device=dev)
        if tiled_scales:
            hs = out["hs"] = torch.zeros(blackwell_scale_bytes(M, cdiv(N, 32)), dtype=torch.uint8,
                                         device=dev)
        else:
            hs = out["hs"] = torch.empty(M, cdiv(N, 32), dtype=torch.uint8, device=dev)
    if seq:
        s_pad = cdiv(max(S, 1), SEQ_ALIGN) * SEQ_ALIGN
        cd = out["cd"] = torch.empty(B, N, s_pad, dtype=torch.uint8, device=dev)
        cs = out["cs"] = torch.empty(B, cdiv(S, 32), N, dtype=torch.uint8, device=dev)
    if B * S == 0:
        if seq:
            cd.zero_()
        return out
    if kernel == "gluon":
        from mxattn.kernels.linear_quant_gluon import linear_quant_fwd_gluon

        linear_quant_fwd_gluon(xd, xe, wd, we, bias, hd, hs, cd.view(torch.int32) if seq else dummy, cs, B, S,
                               s_pad, hdim=hdim, seq=seq, rceil=rceil, soft=_soft(dev), precise=tile.precise_acc,
                               tiled_scales=tiled_scales)
        return out
    n_m_tiles = cdiv(S, tile.block_m)
    n_row_tiles = B * n_m_tiles
    grid = (n_row_tiles * cdiv(N, tile.block_n),)
    fast_launcher(_linear_quant_kernel)[grid](
        xd, xd.stride(0), xe, wd, wd.stride(0), we, bias if bias is not None else dummy,
        hd, hs, cd.view(torch.int32) if seq else dummy, cs,
        S, N, K, s_pad, n_m_tiles, n_row_tiles,
        BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=K % tile.block_k == 0, PRECISE=tile.precise_acc, HAS_BIAS=bias is not None,
        HDIM=hdim, SEQ=seq, RCEIL=rceil, SOFT=_soft(dev), SWZ=tiled_scales,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
