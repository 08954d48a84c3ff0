"""MXFP8 attention backward for Blackwell in Triton ``tl``: all five products with ``tl.dot_scaled`` on MX operands.

Stretch goal of issue 12, standalone: not wired into ``interface`` (the API's backward is the Hopper one for every
backend).  Semantics: ``reference.attention_backward(..., quantize_p=True, quantize_ds=True, quantize_do=True,
q_seq=, k_seq=, v_hdim=)`` with P from the forward's lse; every low-precision step of that emulation is done the same
way here (per-32 MX blocks, no tile exponents), so the kernel agrees with it up to fp32 accumulation order.

Products (DESIGN §1 table; lhs (M, K) with scales (M, K/32), rhs (K, N) with scales (N, K/32)):
  kernel dK/dV, one program per (kv tile, batch, kv head), looping over the group's query heads and the q tiles:
    Sᵀ  = K Qᵀ       K hdim (BN, D);            Qᵀ (D, BM), Q hdim scales (BM, D/32)
    dV += P~ᵀ dO     P~ᵀ = e4m3(256 Pᵀ), scale 2^-8 (byte 119);  dO seq (BM, D), its scales read as (D, BM/32)
    dPᵀ = V dOᵀ      V hdim (BN, D);            dOᵀ (D, BM), dO hdim scales (BM, D/32)
    dK += dS~ᵀ Q     dSᵀ = Pᵀ (dPᵀ - Δ) quantized along q (32 q rows per block, RCEIL);  Q seq (BM, D), (D, BM/32)
  kernel dQ, one program per (q tile, batch, head), looping over the kv tiles:
    S = Q Kᵀ, dP = dO Vᵀ as above; dQ += dS~ K with dS quantized along kv (32 keys per block); K seq (BN, D).
dK, dQ are multiplied by the softmax scale at the end (dS is quantized without it, as in the reference).
Δ = rowsum(dO_hdim · O) is computed by the launcher in fp32 from the same MX dO as dP.
Blocks along q start at q row 0 of each batch entry and along kv at key 0, as in the reference: BM and BN are
multiples of 32.  dS quantization runs in fp32 with the exponent from the block maximum's bits (``quantize._mx_exponent``)
and, under TRITON_INTERPRET=1, explicit rounding to the e4m3 grid (``quantize._round_to_e4m3_grid``, DESIGN §5).
Tiles are always masked (bounds, causal diagonal): simple, not fast.  Non-finite inputs are not handled specially.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from mxattn import formats
from mxattn.formats import MXTensor
from mxattn.kernels.attn_fwd import LOG2E
from mxattn.kernels.attn_fwd_blockscaled import _QK_ZERO_ACC
from mxattn.kernels.launch import cdiv, fast_launcher
from mxattn.kernels.quantize import _mx_exponent, _pow2, _round_to_e4m3_grid

__all__ = ["attn_bwd_blockscaled"]

_P_BYTE = tl.constexpr(127 - 8)
_ONE = tl.constexpr(127)


@triton.jit
def _mx_quant_cols(x, R: tl.constexpr, C: tl.constexpr, EXPLICIT_ROUND: tl.constexpr):
    """fp32 (R, C) -> e4m3 (R, C) and E8M0 bytes (R, C/32): RCEIL blocks of 32 along axis 1 (finite inputs)."""
    x3 = tl.reshape(x, (R, C // 32, 32))
    amax = tl.max(x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    e = _mx_exponent(amax, True)
    y = tl.reshape(x3 * _pow2(-e)[:, :, None], (R, C))
    if EXPLICIT_ROUND:
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv), (e + 127).to(tl.uint8)


@triton.jit
def _dkdv_kernel(
    Q, QS, K, KS, V, VS, DOH, DOHS, DOS, DOSS, QQ, QQS, LSE, DELTA, DK, DV,
    sq_b, sq_m, sq_h, sq_d, sqs_b, sqs_m, sqs_h, sqs_d,
    sk_b, sk_n, sk_h, sk_d, sks_b, sks_n, sks_h, sks_d,
    sv_b, sv_n, sv_h, sv_d, svs_b, svs_n, svs_h, svs_d,
    sdh_b, sdh_m, sdh_h, sdh_d, sdhs_b, sdhs_m, sdhs_h, sdhs_d,
    sds_b, sds_m, sds_h, sds_d, sdss_b, sdss_m, sdss_h, sdss_d,
    sqq_b, sqq_m, sqq_h, sqq_d, sqqs_b, sqqs_m, sqqs_h, sqqs_d,
    sl_b, sl_h, sl_m,
    sdk_b, sdk_n, sdk_h, sdk_d,
    Hkv, Sq, Sk, NSBQ, group_size, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, QK_ZERO_ACC: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = pid_bh % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_db = tl.arange(0, HEAD_DIM // 32)
    offs_mb = tl.arange(0, BLOCK_M // 32)
    n64 = offs_n.to(tl.int64)
    in_n = offs_n < Sk
    k = tl.load(K + b * sk_b + hk * sk_h + n64[:, None] * sk_n + offs_d[None, :] * sk_d, mask=in_n[:, None], other=0.0)
    ks = tl.load(KS + b * sks_b + hk * sks_h + n64[:, None] * sks_n + offs_db[None, :] * sks_d,
                 mask=in_n[:, None], other=_ONE)
    v = tl.load(V + b * sv_b + hk * sv_h + n64[:, None] * sv_n + offs_d[None, :] * sv_d, mask=in_n[:, None], other=0.0)
    vs = tl.load(VS + b * svs_b + hk * svs_h + n64[:, None] * svs_n + offs_db[None, :] * svs_d,
                 mask=in_n[:, None], other=_ONE)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    zero_nm = tl.zeros([BLOCK_N, BLOCK_M], tl.float32) * qk_scale
    p_sc = tl.full([BLOCK_N, BLOCK_M // 32], _P_BYTE, tl.uint8)
    causal_off = Sk - Sq
    lo = 0
    if CAUSAL:
        lo = tl.maximum(start_n - causal_off, 0) // BLOCK_M * BLOCK_M
    for g in range(0, group_size):
        h = hk * group_size + g
        for start_m in range(lo, Sq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m64 = offs_m.to(tl.int64)
            in_m = offs_m < Sq
            # Qᵀ (D, BM) and its hdim scales (BM, D/32); dOᵀ likewise
            qT = tl.load(Q + b * sq_b + h * sq_h + m64[None, :] * sq_m + offs_d[:, None] * sq_d,
                         mask=in_m[None, :], other=0.0)
            qsc = tl.load(QS + b * sqs_b + h * sqs_h + m64[:, None] * sqs_m + offs_db[None, :] * sqs_d,
                          mask=in_m[:, None], other=_ONE)
            doT = tl.load(DOH + b * sdh_b + h * sdh_h + m64[None, :] * sdh_m + offs_d[:, None] * sdh_d,
                          mask=in_m[None, :], other=0.0)
            dosc = tl.load(DOHS + b * sdhs_b + h * sdhs_h + m64[:, None] * sdhs_m + offs_db[None, :] * sdhs_d,
                           mask=in_m[:, None], other=_ONE)
            # seq-blocked dO and Q (BM, D) with scales (D, BM/32)
            blk = start_m // 32 + offs_mb
            do_s = tl.load(DOS + b * sds_b + h * sds_h + m64[:, None] * sds_m + offs_d[None, :] * sds_d,
                           mask=in_m[:, None], other=0.0)
            do_ss = tl.load(DOSS + b * sdss_b + h * sdss_h + blk[None, :].to(tl.int64) * sdss_m
                            + offs_d[:, None] * sdss_d, mask=blk[None, :] < NSBQ, other=_ONE)
            q_s = tl.load(QQ + b * sqq_b + h * sqq_h + m64[:, None] * sqq_m + offs_d[None, :] * sqq_d,
                          mask=in_m[:, None], other=0.0)
            q_ss = tl.load(QQS + b * sqqs_b + h * sqqs_h + blk[None, :].to(tl.int64) * sqqs_m
                           + offs_d[:, None] * sqqs_d, mask=blk[None, :] < NSBQ, other=_ONE)
            lse = tl.load(LSE + b * sl_b + h * sl_h + offs_m * sl_m, mask=in_m, other=float("-inf"))
            delta = tl.load(DELTA + b * sl_b + h * sl_h + offs_m * sl_m, mask=in_m, other=0.0)

            if QK_ZERO_ACC:
                sT = tl.dot_scaled(k, ks, "e4m3", qT, qsc, "e4m3", zero_nm)
            else:
                sT = tl.dot_scaled(k, ks, "e4m3", qT, qsc, "e4m3")
            keep = in_n[:, None] & (lse > float("-inf"))[None, :]
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_off)
            lse2 = tl.where(lse > float("-inf"), lse * 1.4426950408889634, 0.0)
            pT = tl.where(keep, tl.exp2(sT * qk_scale - lse2[None, :]), 0.0)
            p256 = pT * 256.0
            if EXPLICIT_ROUND:
                p256 = _round_to_e4m3_grid(p256)
            dv = tl.dot_scaled(p256.to(tl.float8e4nv), p_sc, "e4m3", do_s, do_ss, "e4m3", dv)
            if QK_ZERO_ACC:
                dpT = tl.dot_scaled(v, vs, "e4m3", doT, dosc, "e4m3", zero_nm)
            else:
                dpT = tl.dot_scaled(v, vs, "e4m3", doT, dosc, "e4m3")
            dsT = pT * (dpT - delta[None, :])
            ds8, ds_sc = _mx_quant_cols(dsT, BLOCK_N, BLOCK_M, EXPLICIT_ROUND)
            dk = tl.dot_scaled(ds8, ds_sc, "e4m3", q_s, q_ss, "e4m3", dk)
    o = b * sdk_b + hk * sdk_h + n64[:, None] * sdk_n + offs_d[None, :] * sdk_d
    tl.store(DK + o, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_n[:, None])
    tl.store(DV + o, dv.to(DV.dtype.element_ty), mask=in_n[:, None])


@triton.jit
def _dq_kernel(
    Q, QS, K, KS, V, VS, DOH, DOHS, KK, KKS, LSE, DELTA, DQ,
    sq_b, sq_m, sq_h, sq_d, sqs_b, sqs_m, sqs_h, sqs_d,
    sk_b, sk_n, sk_h, sk_d, sks_b, sks_n, sks_h, sks_d,
    sv_b, sv_n, sv_h, sv_d, svs_b, svs_n, svs_h, svs_d,
    sdh_b, sdh_m, sdh_h, sdh_d, sdhs_b, sdhs_m, sdhs_h, sdhs_d,
    skk_b, skk_n, skk_h, skk_d, skks_b, skks_n, skks_h, skks_d,
    sl_b, sl_h, sl_m,
    sdq_b, sdq_m, sdq_h, sdq_d,
    Hq, Sq, Sk, NSBK, group_size, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, QK_ZERO_ACC: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = h // group_size
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_db = tl.arange(0, HEAD_DIM // 32)
    offs_nb = tl.arange(0, BLOCK_N // 32)
    m64 = offs_m.to(tl.int64)
    in_m = offs_m < Sq
    q = tl.load(Q + b * sq_b + h * sq_h + m64[:, None] * sq_m + offs_d[None, :] * sq_d, mask=in_m[:, None], other=0.0)
    qsc = tl.load(QS + b * sqs_b + h * sqs_h + m64[:, None] * sqs_m + offs_db[None, :] * sqs_d,
                  mask=in_m[:, None], other=_ONE)
    do = tl.load(DOH + b * sdh_b + h * sdh_h + m64[:, None] * sdh_m + offs_d[None, :] * sdh_d,
                 mask=in_m[:, None], other=0.0)
    dosc = tl.load(DOHS + b * sdhs_b + h * sdhs_h + m64[:, None] * sdhs_m + offs_db[None, :] * sdhs_d,
                   mask=in_m[:, None], other=_ONE)
    lse = tl.load(LSE + b * sl_b + h * sl_h + offs_m * sl_m, mask=in_m, other=float("-inf"))
    delta = tl.load(DELTA + b * sl_b + h * sl_h + offs_m * sl_m, mask=in_m, other=0.0)
    lse2 = tl.where(lse > float("-inf"), lse * 1.4426950408889634, 0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    zero_mn = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) * qk_scale
    causal_off = Sk - Sq
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + causal_off, 0))
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n64 = offs_n.to(tl.int64)
        in_n = offs_n < Sk
        kT = tl.load(K + b * sk_b + hk * sk_h + n64[None, :] * sk_n + offs_d[:, None] * sk_d,
                     mask=in_n[None, :], other=0.0)
        ks = tl.load(KS + b * sks_b + hk * sks_h + n64[:, None] * sks_n + offs_db[None, :] * sks_d,
                     mask=in_n[:, None], other=_ONE)
        vT = tl.load(V + b * sv_b + hk * sv_h + n64[None, :] * sv_n + offs_d[:, None] * sv_d,
                     mask=in_n[None, :], other=0.0)
        vs = tl.load(VS + b * svs_b + hk * svs_h + n64[:, None] * svs_n + offs_db[None, :] * svs_d,
                     mask=in_n[:, None], other=_ONE)
        blk = start_n // 32 + offs_nb
        k_s = tl.load(KK + b * skk_b + hk * skk_h + n64[:, None] * skk_n + offs_d[None, :] * skk_d,
                      mask=in_n[:, None], other=0.0)
        k_ss = tl.load(KKS + b * skks_b + hk * skks_h + blk[None, :].to(tl.int64) * skks_n + offs_d[:, None] * skks_d,
                       mask=blk[None, :] < NSBK, other=_ONE)
        if QK_ZERO_ACC:
            s = tl.dot_scaled(q, qsc, "e4m3", kT, ks, "e4m3", zero_mn)
            dp = tl.dot_scaled(do, dosc, "e4m3", vT, vs, "e4m3", zero_mn)
        else:
            s = tl.dot_scaled(q, qsc, "e4m3", kT, ks, "e4m3")
            dp = tl.dot_scaled(do, dosc, "e4m3", vT, vs, "e4m3")
        keep = in_n[None, :] & (lse > float("-inf"))[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        p = tl.where(keep, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        ds8, ds_sc = _mx_quant_cols(ds, BLOCK_M, BLOCK_N, EXPLICIT_ROUND)
        dq = tl.dot_scaled(ds8, ds_sc, "e4m3", k_s, k_ss, "e4m3", dq)
    tl.store(DQ + b * sdq_b + h * sdq_h + m64[:, None] * sdq_m + offs_d[None, :] * sdq_d,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=in_m[:, None])


def _strides(t: MXTensor):
    return (*t.data.stride(), *t.scale.stride())


def _quantize(x: torch.Tensor, dim: int) -> MXTensor:
    if x.is_cuda:
        from mxattn.kernels.quantize import quantize_mxfp8_triton

        return quantize_mxfp8_triton(x, "hdim" if dim == 3 else "seq")
    return formats.quantize_mxfp8(x, dim)


def attn_bwd_blockscaled(q: MXTensor, k: MXTensor, v_hdim: MXTensor, q_seq: MXTensor, k_seq: MXTensor,
                         out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                         softmax_scale: float | None = None, *, do_hdim: MXTensor | None = None,
                         do_seq: MXTensor | None = None, grad_dtype: torch.dtype = torch.bfloat16,
                         block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None):
    """Gradients (dq, dk, dv) from MX operands: q, k, v_hdim blocked along D (dim 3); q_seq, k_seq along the
    sequence (dim 1); out, dout (B, Sq, Hq, D) float; lse (B, Hq, Sq) from the forward.  dO is MX-quantized here
    (both orientations) unless given.  dk, dv are summed over each kv head's query heads.  Untuned, unmeasured.
    Tiles: 128 x 128 with 8 warps on compute capability 10.x (the shape that compiles to the native block-scaled
    MMA; 64 x 64 tiles fall back to bf16 ``kind::f16`` there, seen by ``compile_for``), 64 x 64 with 4 warps elsewhere."""
    B, Sq, Hq, D = q.data.shape
    big = q.data.is_cuda and torch.cuda.get_device_capability(q.data.device)[0] == 10
    block_m = block_m or (128 if big else 64)
    block_n = block_n or (128 if big else 64)
    num_warps = num_warps or (8 if big else 4)
    Sk, Hkv = k.data.shape[1], k.data.shape[2]
    if D not in (64, 128) or block_m % 32 or block_n % 32:
        raise ValueError("D must be 64 or 128 and the blocks multiples of 32")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    do_h = do_hdim if do_hdim is not None else _quantize(dout, 3)
    do_s = do_seq if do_seq is not None else _quantize(dout, 1)
    delta = (do_h.dequantize(torch.float32) * out.float()).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, Sq)
    lse = lse.float().contiguous()
    dev = q.data.device
    dq = torch.zeros(B, Sq, Hq, D, dtype=grad_dtype, device=dev)
    dk = torch.zeros(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    dv = torch.zeros(B, Sk, Hkv, D, dtype=grad_dtype, device=dev)
    if B * Sq * Sk * Hq == 0:
        return dq, dk, dv
    qm, km, vm, qsm, ksm, dhm, dsm = q, k, v_hdim, q_seq, k_seq, do_h, do_s
    sc = lambda t: t.scale.view(torch.uint8)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    meta = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), EXPLICIT_ROUND=interp,
                QK_ZERO_ACC=_QK_ZERO_ACC, num_warps=num_warps)
    fast_launcher(_dkdv_kernel)[(cdiv(Sk, block_n), B * Hkv)](
        qm.data, sc(qm), km.data, sc(km), vm.data, sc(vm), dhm.data, sc(dhm), dsm.data, sc(dsm), qsm.data, sc(qsm),
        lse, delta, dk, dv,
        *_strides(qm), *_strides(km), *_strides(vm), *_strides(dhm), *_strides(dsm), *_strides(qsm),
        *lse.stride(), *dk.stride(),
        Hkv, Sq, Sk, qsm.scale.shape[1], Hq // Hkv, scale * LOG2E, scale, **meta,
    )
    fast_launcher(_dq_kernel)[(cdiv(Sq, block_m), B * Hq)](
        qm.data, sc(qm), km.data, sc(km), vm.data, sc(vm), dhm.data, sc(dhm), ksm.data, sc(ksm), lse, delta, dq,
        *_strides(qm), *_strides(km), *_strides(vm), *_strides(dhm), *_strides(ksm),
        *lse.stride(), *dq.stride(),
        Hq, Sq, Sk, ksm.scale.shape[1], Hq // Hkv, scale * LOG2E, scale, **meta,
    )
    return dq, dk, dv


def compile_for(capability: int, head_dim: int = 128, causal: bool = False, block_m: int = 128, block_n: int = 128,
                num_warps: int = 8):
    """Compile both backward kernels for ``GPUTarget("cuda", capability, 32)`` without a GPU (as
    ``attn_fwd_blockscaled.compile_for``); returns (dkdv, dq) ``CompiledKernel``s."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), EXPLICIT_ROUND=False,
                 QK_ZERO_ACC=_QK_ZERO_ACC)
    fp8 = {"Q", "K", "V", "DOH", "DOS", "QQ", "KK"}
    u8 = {"QS", "KS", "VS", "DOHS", "DOSS", "QQS", "KKS"}
    f32p = {"LSE", "DELTA"}
    res = []
    for kern in (_dkdv_kernel, _dq_kernel):
        names = kern.arg_names
        sig = {}
        for n in names:
            sig[n] = ("*fp8e4nv" if n in fp8 else "*u8" if n in u8 else "*fp32" if n in f32p
                      else "*bf16" if n in ("DK", "DV", "DQ") else "constexpr" if n in const
                      else "fp32" if n in ("qk_scale", "sm_scale") else "i32")
        src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
        res.append(triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=num_warps)))
    return tuple(res)
