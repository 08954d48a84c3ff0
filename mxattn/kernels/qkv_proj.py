"""Fused QKV projection: FP8 GEMM, bias, rotary embedding and MXFP8 quantization in one Triton ``tl`` kernel.

``Y = x W^T (+ bias)`` for the stacked projection weight ``W`` ((Hq + 2 Hkv) * D, K): rows of q heads, then k
heads, then v heads.  One N tile of the GEMM is one head (``block_n = D``), so the epilogue of a program knows
its role from ``pid_n`` alone and writes straight into the layouts the attention forward consumes
(``mxattn.interface._mx_forward``):

* q heads (pid_n < Hq): rotary on the fp32 tile, MX-quantized along the head dim (``hdim``): data (B, S, Hq, D)
  contiguous = (B*S, Hq*D), scales (B, S, Hq, D/32);
* k heads: the same into (B, S, Hkv, D);
* v heads: no rotary, MX-quantized along the sequence (``seq``, 32 tokens of one batch per block; M tiles never
  cross a batch boundary): data in a channel-major (B, Hkv, D, S_pad) buffer (S_pad = S rounded up to 16, zero
  padding; the layout ``kernels.quantize`` and the attention's V operand use), scales (B, ceil(S/32), Hkv, D).

Main loop: ``linear_quant``'s (DESIGN §3 re-expression: x and W as ``RowScaledFP8``, one power-of-two exponent
per token row and per output channel, plain FP8 ``tl.dot``, exponents folded into the fp32 accumulator in the
epilogue).  Rotary (rotate-half / GPT-NeoX convention of ``mxattn.nn.RotaryEmbedding``: channel i pairs with
i + D/2) needs both halves of a head in one program: the program keeps **two half-width accumulators**, the
dot of x with W's rows [n0, n0 + D/2) and with [n0 + D/2, n0 + D), so that

    out_lo = y_lo * cos_lo - y_hi * sin_lo        out_hi = y_hi * cos_hi + y_lo * sin_hi

is elementwise on tiles of one layout (no reshape / permute of an MMA-layout accumulator, which the
interpreter accepts but sm_90 would pay for with layout conversions through shared memory).  Each half is
then quantized by ``rmsnorm_quant._emit_mx`` on its own: hdim blocks (32 channels) never straddle the halves
because D/2 is a multiple of 32, and seq blocks are per channel.  The cost of the split: the x tile in shared
memory is read by two wgmma (n = D/2 each) instead of one (n = D).

The epilogue is compiled without FMA contraction (``enable_fp_fusion=False``): exponent fold, bias and rotary
round each operation like the reference, so when the accumulation is exact (products that sum exactly in fp32
in any order) the bytes equal ``qkv_proj_reference``'s; otherwise only the accumulation order differs.

Launcher: ``qkv_proj_fwd(xr, wr, bias, cos, sin, B, S, Hq, Hkv, D, rceil)``; checks are done by
``mxattn.qkv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from mxattn.formats import RowScaledFP8
from mxattn.kernels.launch import cdiv, fast_launcher
from mxattn.kernels.linear_quant import _pow2_wide, band_tile
from mxattn.kernels.quantize import SEQ_ALIGN, _soft, _to_f32
from mxattn.kernels.rmsnorm_quant import _emit_mx

__all__ = ["QKVTile", "qkv_tile", "qkv_proj_fwd", "TILE_OVERRIDE"]


@dataclass(frozen=True)
class QKVTile:
    block_m: int = 128  # multiple of 32 (whole seq blocks for V)
    block_k: int = 128
    group_m: int = 8  # M tiles per band of the L2-friendly program order
    num_warps: int = 8
    num_stages: int = 4
    precise_acc: bool = True  # promote the wgmma partial sums every block_k elements (linear_quant's default)


TILE_OVERRIDE: Optional[QKVTile] = None


def qkv_tile(D: int) -> QKVTile:
    """Predicted tiles (not swept on a GPU; compiled for sm_90a on the CPU with triton 3.9, ptxas -v):
    128 x D x 128, 8 warps, 4 stages for D = 64 and 128 (wgmma m64n32 / m64n64 per half).  Registers: D = 64
    153 (rotary) / 99, D = 128 255 with ~300 B of epilogue spill (rotary) / 171 without.  The spill-free
    alternative for D = 128 with rotary, ``QKVTile(block_m=64)`` (152 registers, but m64n32 wgmma and twice the W
    traffic per token), is for ``bench_qkv_chain(tiles=...)`` to decide."""
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    return QKVTile()


@triton.jit
def _half_dot(a, b_ptrs, K, kt, BK: tl.constexpr, rk, acc, EVEN_K: tl.constexpr, PRECISE: tl.constexpr):
    if EVEN_K:
        bt = tl.load(b_ptrs)
    else:
        bt = tl.load(b_ptrs, mask=rk[:, None] < K - kt * BK, other=0.0)
    if PRECISE:
        acc = tl.dot(a, bt, acc, max_num_imprecise_acc=BK)
    else:
        acc = tl.dot(a, bt, acc)
    return acc


@triton.jit
def _qkv_proj_kernel(
    x_ptr, sxm, xe_ptr,  # x' fp8 (B*S, K), unit stride along K; Ex int32 (B*S,)
    w_ptr, swn, we_ptr,  # W' fp8 (N, K), unit stride along K, N = (Hq + 2 Hkv) D; Ew int32 (N,)
    b_ptr,  # bias (N,) (HAS_BIAS)
    cos_ptr, sin_ptr, s_rb, s_rs,  # fp32 (B or 1, S, D), unit stride along D; batch stride s_rb (0: shared)
    qd_ptr, qs_ptr, kd_ptr, ks_ptr,  # u8 q data (B*S, Hq D), scales (B*S, Hq D / 32); k the same with Hkv
    vd_ptr, vs_ptr,  # int32 words of the channel-major (B, Hkv D, S_pad) u8 buffer; scales u8 (B, ceil(S/32), Hkv D)
    S, K, S_pad, Hq, Hkv, n_m_tiles, n_row_tiles,
    D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROT: tl.constexpr,
    RCEIL: tl.constexpr, SOFT: tl.constexpr,
):
    HD: tl.constexpr = D // 2
    # program -> (row tile, head), GROUP_M row tiles per band (linear_quant's order)
    pid_m, head = band_tile(tl.program_id(0), n_row_tiles, Hq + 2 * Hkv, GROUP_M)
    b = pid_m // n_m_tiles
    s0 = (pid_m % n_m_tiles) * BM
    n0 = head * D
    b64 = b.to(tl.int64)

    rm = s0 + tl.arange(0, BM)
    sc = tl.minimum(rm, S - 1)  # clamped: rows past S read valid memory and are zeroed below
    row = b64 * S + sc
    cl = tl.arange(0, HD)
    col_lo = (n0 + cl).to(tl.int64)
    col_hi = col_lo + HD
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + row[:, None] * sxm + rk[None, :]
    blo_ptrs = w_ptr + col_lo[None, :] * swn + rk[:, None]  # (BK, D/2) views of K-major W
    bhi_ptrs = w_ptr + col_hi[None, :] * swn + rk[:, None]
    acc_lo = tl.zeros((BM, HD), tl.float32)
    acc_hi = tl.zeros((BM, HD), tl.float32)
    for kt in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - kt * BK, other=0.0)
        acc_lo = _half_dot(a, blo_ptrs, K, kt, BK, rk, acc_lo, EVEN_K, PRECISE)
        acc_hi = _half_dot(a, bhi_ptrs, K, kt, BK, rk, acc_hi, EVEN_K, PRECISE)
        a_ptrs += BK
        blo_ptrs += BK
        bhi_ptrs += BK

    # epilogue: exponents (two exact power-of-two multiplies, linear_quant's order), bias, rotary
    ex = _pow2_wide(tl.load(xe_ptr + row))[:, None]
    y_lo = (acc_lo * ex) * _pow2_wide(tl.load(we_ptr + col_lo))[None, :]
    y_hi = (acc_hi * ex) * _pow2_wide(tl.load(we_ptr + col_hi))[None, :]
    if HAS_BIAS:
        y_lo = y_lo + _to_f32(tl.load(b_ptr + col_lo))[None, :]
        y_hi = y_hi + _to_f32(tl.load(b_ptr + col_hi))[None, :]
    if HAS_ROT:
        if head < Hq + Hkv:
            rp = b64 * s_rb + sc.to(tl.int64)[:, None] * s_rs + cl[None, :]
            c_lo = tl.load(cos_ptr + rp)
            c_hi = tl.load(cos_ptr + rp + HD)
            s_lo = tl.load(sin_ptr + rp)
            s_hi = tl.load(sin_ptr + rp + HD)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x_hi, x_lo): nn.RotaryEmbedding's products
            r_lo = y_lo * c_lo + (-y_hi) * s_lo
            r_hi = y_hi * c_hi + y_lo * s_hi
            y_lo = r_lo
            y_hi = r_hi
    live = (rm < S)[:, None]
    y_lo = tl.where(live, y_lo, 0.0)
    y_hi = tl.where(live, y_hi, 0.0)
    y4_lo = tl.reshape(y_lo, (BM // 32, 32, HD // 32, 32))
    y4_hi = tl.reshape(y_hi, (BM // 32, 32, HD // 32, 32))
    dummy_e = tl.zeros((BM // 32, 32, 1, 1), tl.int32)
    if head < Hq:
        Nq = Hq * D
        _emit_mx(y4_lo, s0, n0, b64, S, Nq, S_pad, qd_ptr, qs_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, True, False, False, RCEIL, SOFT)
        _emit_mx(y4_hi, s0, n0 + HD, b64, S, Nq, S_pad, qd_ptr, qs_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, True, False, False, RCEIL, SOFT)
    elif head < Hq + Hkv:
        Nk = Hkv * D
        nk0 = n0 - Hq * D
        _emit_mx(y4_lo, s0, nk0, b64, S, Nk, S_pad, kd_ptr, ks_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, True, False, False, RCEIL, SOFT)
        _emit_mx(y4_hi, s0, nk0 + HD, b64, S, Nk, S_pad, kd_ptr, ks_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, True, False, False, RCEIL, SOFT)
    else:
        Nv = Hkv * D
        nv0 = n0 - (Hq + Hkv) * D
        _emit_mx(y4_lo, s0, nv0, b64, S, Nv, S_pad, qd_ptr, qs_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, False, True, False, RCEIL, SOFT)
        _emit_mx(y4_hi, s0, nv0 + HD, b64, S, Nv, S_pad, qd_ptr, qs_ptr, vd_ptr, vs_ptr, dummy_e,
                 BM // 32, 32, HD // 32, False, True, False, RCEIL, SOFT)


def qkv_proj_fwd(
    xr: RowScaledFP8,
    wr: RowScaledFP8,
    bias: Optional[torch.Tensor],
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    B: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    *,
    rceil: bool,
    tile: Optional[QKVTile] = None,
) -> dict:
    """The fused projection on row-scaled operands.  ``xr`` (B*S, K) with one exponent per row, ``wr``
    ((Hq + 2 Hkv) D, K) with one per output channel; ``cos``/``sin`` fp32 (S, D) or (B, S, D), unit stride along
    D (or None); ``bias`` ((Hq + 2 Hkv) D,) or None.  Returns u8 buffers: ``qd`` (B, S, Hq, D), ``qs``
    (B, S, Hq, D/32), ``kd``/``ks`` the same with Hkv, ``vd`` channel-major (B, Hkv, D, S_pad), ``vs``
    (B, ceil(S/32), Hkv, D)."""
    xd, wd = xr.data, wr.data
    if xd.stride(-1) != 1:
        xd = xd.contiguous()
    if wd.stride(-1) != 1:
        wd = wd.contiguous()
    xe = xr.expanded_exp().reshape(xd.shape[0]).contiguous()
    we = wr.expanded_exp().reshape(wd.shape[0]).contiguous()
    M, K = xd.shape
    assert M == B * S and wd.shape[0] == (Hq + 2 * Hkv) * D and D % 64 == 0, (M, B, S, wd.shape, D)
    dev = xd.device
    tile = tile or qkv_tile(D)
    if tile.block_m % 32:
        raise ValueError(f"block_m must be a multiple of 32, got {tile}")
    s_pad = cdiv(max(S, 1), SEQ_ALIGN) * SEQ_ALIGN
    nb = D // 32
    out = {
        "qd": torch.empty(B, S, Hq, D, dtype=torch.uint8, device=dev),
        "qs": torch.empty(B, S, Hq, nb, dtype=torch.uint8, device=dev),
        "kd": torch.empty(B, S, Hkv, D, dtype=torch.uint8, device=dev),
        "ks": torch.empty(B, S, Hkv, nb, dtype=torch.uint8, device=dev),
        "vd": torch.empty(B, Hkv, D, s_pad, dtype=torch.uint8, device=dev),
        "vs": torch.empty(B, cdiv(S, 32), Hkv, D, dtype=torch.uint8, device=dev),
    }
    if B * S == 0:
        out["vd"].zero_()
        return out
    dummy = torch.empty(16, dtype=torch.float32, device=dev)
    has_rot = cos is not None
    if has_rot:
        s_rb = cos.stride(0) if cos.ndim == 3 else 0
        s_rs = cos.stride(-2)
        assert sin.stride() == cos.stride() and cos.stride(-1) == 1
    else:
        s_rb = s_rs = 0
    n_m_tiles = cdiv(S, tile.block_m)
    n_row_tiles = B * n_m_tiles
    grid = (n_row_tiles * (Hq + 2 * Hkv),)
    fast_launcher(_qkv_proj_kernel)[grid](
        xd, xd.stride(0), xe, wd, wd.stride(0), we, bias if bias is not None else dummy,
        cos if has_rot else dummy, sin if has_rot else dummy, s_rb, s_rs,
        out["qd"], out["qs"], out["kd"], out["ks"], out["vd"].view(torch.int32), out["vs"],
        S, K, s_pad, Hq, Hkv, n_m_tiles, n_row_tiles,
        D=D, BM=tile.block_m, BK=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=K % tile.block_k == 0, PRECISE=tile.precise_acc, HAS_BIAS=bias is not None, HAS_ROT=has_rot,
        RCEIL=rceil, SOFT=_soft(dev),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        enable_fp_fusion=False,  # the epilogue rounds each product and sum as the reference does (no FMA)
    )
    return out
