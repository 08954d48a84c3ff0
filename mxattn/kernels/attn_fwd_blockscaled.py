"""MXFP8 attention forward for Blackwell in Triton ``tl``: both products on MX operands with ``tl.dot_scaled``.

No re-expression (compare ``kernels/attn_fwd.py``, the Hopper path): the MX block scales go into the products
as they are, which is what the block-scaled MMA of sm_100 (tcgen05 ``kind::mxf8f6f4``) does in hardware.

  S = Q Kᵀ   ``tl.dot_scaled(q, q_scale, "e4m3", kᵀ, k_scale, "e4m3")``
             Q (BM, D) with its plain scales (BM, D/32); Kᵀ (D, BN) with K's plain scales (BN, D/32): tl.dot_scaled
             wants the rhs scale as (N, K/32) for an rhs of (K, N), i.e. one row per key, which is exactly K's
             ``hdim`` scale tensor (B, Sk, Hkv, D/32) — no transpose.
  O = P V    ``tl.dot_scaled(p8, 119, "e4m3", v, v_scale, "e4m3", acc)``
             P (BM, BN) e4m3 with the constant scale 2^-8 (byte 127 - 8 = 119, one per 32 keys; DESIGN §1); V (BN, D)
             blocked along the sequence with its scales read as (D, BN/32) from the plain ``seq`` scale tensor
             (B, ceil(Sk/32), Hkv, D): element [d, j] is the scale of keys start_n + 32 j .. + 31 of channel d.
The rhs-scale convention ((N, K/group) for an rhs of (K, N), "do NOT transpose") is the docstring of
``tl.dot_scaled`` in triton 3.6 and in 3.9 alike (checked in both installs).

Scale layouts: the kernel reads the *plain* layouts of ``formats.MXTensor`` (one byte per block, the data's shape
with the blocked dim divided by 32) through ordinary strided loads; Triton stages them for the MMA itself.  The
128x4 swizzled layout that cuBLAS/cuDNN want (``to_blackwell_scale_layout`` below) is for producers that feed
those libraries; this kernel does not need it.

Online softmax and P: as the Hopper kernel (same helpers).  ``p = exp2(s - (m - 8)) <= 256`` is cast to e4m3 and
enters P·V with the scale 2^-8, so the MMA sees ``p / 256``; the row sum ``l`` adds the fp32 ``p`` (P never
saturates, so the rounding is unbiased noise) and the epilogue divides by ``l / 256``.  Earlier tiles are rescaled
in fp32 through the accumulator when the running max grows, never re-quantized.  Under TRITON_INTERPRET=1 the
fp32->e4m3 cast mis-rounds (DESIGN §5), so ``p`` is first rounded to the e4m3 grid with ``_round_e4m3_nonneg``.

Partial tiles: keys at or past Sk load data 0 and scale byte 127 (2^0), so neither a stale scale (byte 255 is NaN)
nor garbage enters a product; their scores are -inf before the row max, so they do not move ``m``, and p = 0.
V scale blocks past ceil(Sk/32) load 127 too.  Causal masks are aligned bottom-right (query i sees key j iff
j <= i + Sk - Sq); a row with nothing to attend gives out = 0 and lse = -inf.

Speed: on sm_100 ``tl.dot_scaled`` with e4m3 operands lowers to the native block-scaled MMA.  On Hopper (sm_90)
Triton lowers it by upcasting the operands to bf16 and running bf16 wgmma (~122 TFLOP/s on an 8192^3 product on
the H200, DESIGN §3), so this kernel is correct but slow there by construction: on Hopper it is a test vehicle,
the fast path is ``attn_fwd.py``.  The tile choice below is not tuned on any GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from mxattn.formats import MXTensor, from_blackwell_scale_layout, to_blackwell_scale_layout  # noqa: F401 (re-export)
from mxattn.kernels.attn_fwd import LOG2E, FwdConfig, _round_e4m3_nonneg, alloc_fwd_outputs
from mxattn.kernels.launch import cdiv, fast_launcher

__all__ = [
    "attn_fwd_blockscaled",
    "default_config",
    "to_blackwell_scale_layout",
    "from_blackwell_scale_layout",
    "P_SCALE_BYTE",
]

P_SCALE_BYTE = 127 - 8  # E8M0 byte of P's constant scale 2^-8
_P_SCALE_BYTE = tl.constexpr(P_SCALE_BYTE)
_NEUTRAL_SCALE = tl.constexpr(127)  # E8M0 byte of 2^0: what masked-off scale loads read


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


# Triton 3.6 fails to compile S = Q Kᵀ for sm_100 when dot_scaled gets the implicit zero accumulator
# ("'ttng.tmem_alloc' op uninitialized alloc must have a mutable memdesc type" in TritonGPUOptimizeAccumulatorInit);
# an accumulator of zeros the compiler cannot fold (zeros * a runtime scalar, made once per program) avoids that pass
# and compiles to the same tcgen05 block-scaled MMA (checked by compiling for sm_100 without a GPU; cost, one TMEM
# store of the zeros per tile, not measured).  Triton 3.9 compiles the plain form, so the workaround applies below 3.9.
_QK_ZERO_ACC = _triton_version() < (3, 9)


def default_config(head_dim: int, causal: bool) -> FwdConfig:
    """Untuned: 128 query rows (the tcgen05 MMA's M) by 64 keys, 8 warps.  Not measured on any GPU yet."""
    return FwdConfig(128, 64, 8, 2)


@triton.jit
def _bs_tile(
    acc, l_i, m_i, qk_zero, q, q_sc, k_ptrs, ks_ptrs, v_ptrs, vs_ptrs, offs_m, offs_n_base, offs_b_base, start_n,
    Sk, NSB, causal_off, qk_scale, stride_kn, stride_ksn, stride_vn, stride_vsb,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, QK_ZERO_ACC: tl.constexpr,
):
    """One K/V tile of the online softmax.  ``MASKED`` tiles check key bounds (data and scales) and the diagonal."""
    offs_n = start_n + offs_n_base
    offs_b = start_n // 32 + offs_b_base  # V scale blocks of this tile
    if MASKED:
        kt = tl.load(k_ptrs + start_n * stride_kn, mask=offs_n[None, :] < Sk, other=0.0)
        k_sc = tl.load(ks_ptrs + start_n * stride_ksn, mask=offs_n[:, None] < Sk, other=_NEUTRAL_SCALE)
        vt = tl.load(v_ptrs + start_n * stride_vn, mask=offs_n[:, None] < Sk, other=0.0)
        v_sc = tl.load(vs_ptrs + (start_n // 32) * stride_vsb, mask=offs_b[None, :] < NSB, other=_NEUTRAL_SCALE)
    else:
        kt = tl.load(k_ptrs + start_n * stride_kn)
        k_sc = tl.load(ks_ptrs + start_n * stride_ksn)
        vt = tl.load(v_ptrs + start_n * stride_vn)
        v_sc = tl.load(vs_ptrs + (start_n // 32) * stride_vsb)
    # (BM, BN) fp32, MX scales applied per 32 of D
    if QK_ZERO_ACC:  # triton < 3.9 on sm_100: a non-constant zero accumulator (see _QK_ZERO_ACC)
        qk = tl.dot_scaled(q, q_sc, "e4m3", kt, k_sc, "e4m3", qk_zero)
    else:
        qk = tl.dot_scaled(q, q_sc, "e4m3", kt, k_sc, "e4m3")
    s = qk * qk_scale  # log2 units
    if MASKED:
        keep = offs_n[None, :] < Sk
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: p = 0, not NaN
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - (m_new - 8.0)[:, None])  # <= 256: e4m3 without saturation, scale 2^-8 below
    if EXPLICIT_ROUND:
        p = _round_e4m3_nonneg(p)
    p8 = p.to(tl.float8e4nv)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    p_sc = tl.full([BLOCK_M, BLOCK_N // 32], _P_SCALE_BYTE, tl.uint8)
    acc = tl.dot_scaled(p8, p_sc, "e4m3", vt, v_sc, "e4m3", acc)  # acc += (p / 256) V, V scales per 32 keys
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_blockscaled_kernel(
    Q, QS, K, KS, V, VS, O, LSE,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_qsb, stride_qsm, stride_qsh, stride_qsd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_ksb, stride_ksn, stride_ksh, stride_ksd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_vsb_, stride_vsblk, stride_vsh, stride_vsd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    Hq, Sq, Sk, NSB, group_size, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EXPLICIT_ROUND: tl.constexpr, QK_ZERO_ACC: tl.constexpr,
):
    # heaviest query blocks first when causal (they see the most keys)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group_size
    b64 = b.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dblk = tl.arange(0, HEAD_DIM // 32)
    offs_nblk = tl.arange(0, BLOCK_N // 32)
    rows = offs_m[:, None].to(tl.int64)

    q = tl.load(Q + b64 * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :] * stride_qd,
                mask=offs_m[:, None] < Sq, other=0.0)
    q_sc = tl.load(QS + b64 * stride_qsb + h * stride_qsh + rows * stride_qsm + offs_dblk[None, :] * stride_qsd,
                   mask=offs_m[:, None] < Sq, other=_NEUTRAL_SCALE)

    # Kᵀ as (D, BN); K's scales (BN, D/32) = the rhs scale layout of tl.dot_scaled
    k_ptrs = K + b64 * stride_kb + hk * stride_kh + offs_d[:, None] * stride_kd + offs_n[None, :].to(tl.int64) * stride_kn
    ks_ptrs = (KS + b64 * stride_ksb + hk * stride_ksh + offs_n[:, None].to(tl.int64) * stride_ksn
               + offs_dblk[None, :] * stride_ksd)
    # V as (BN, D); V's scales (D, BN/32): [d, j] = scale of channel d, key block start_n/32 + j
    v_ptrs = V + b64 * stride_vb + hk * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd
    vs_ptrs = (VS + b64 * stride_vsb_ + hk * stride_vsh + offs_d[:, None] * stride_vsd
               + offs_nblk[None, :].to(tl.int64) * stride_vsblk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) * qk_scale  # zeros the compiler cannot fold (QK_ZERO_ACC)

    causal_off = Sk - Sq
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + causal_off, 0))
        full_end = tl.minimum((Sk // BLOCK_N) * BLOCK_N, (tl.maximum(start_m + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        full_end = (Sk // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _bs_tile(
            acc, l_i, m_i, qk_zero, q, q_sc, k_ptrs, ks_ptrs, v_ptrs, vs_ptrs, offs_m, offs_n, offs_nblk, start_n,
            Sk, NSB, causal_off, qk_scale, stride_kn, stride_ksn, stride_vn, stride_vsblk,
            BLOCK_M, BLOCK_N, False, CAUSAL, EXPLICIT_ROUND, QK_ZERO_ACC,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc, l_i, m_i = _bs_tile(
            acc, l_i, m_i, qk_zero, q, q_sc, k_ptrs, ks_ptrs, v_ptrs, vs_ptrs, offs_m, offs_n, offs_nblk, start_n,
            Sk, NSB, causal_off, qk_scale, stride_kn, stride_ksn, stride_vn, stride_vsblk,
            BLOCK_M, BLOCK_N, True, CAUSAL, EXPLICIT_ROUND, QK_ZERO_ACC,
        )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (256.0 / l_safe)[:, None]  # acc holds sum (p / 256) v; l sums p
    o_ptrs = O + b64 * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < Sq)
    lse = tl.where(empty, float("-inf"), (m_i - 8.0 + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + offs_m * stride_lm, lse, mask=offs_m < Sq)


def _check_operands(qm: MXTensor, km: MXTensor, vm: MXTensor) -> None:
    for name, t, want in (("q", qm, 3), ("k", km, 3), ("v", vm, 1)):
        if not isinstance(t, MXTensor):
            raise TypeError(f"{name} must be an MXTensor, got {type(t).__name__}")
        if t.data.ndim != 4:
            raise ValueError(f"{name} must be (B, S, H, D), got {tuple(t.data.shape)}")
        if t.dim % 4 != want:
            raise ValueError(f"{name} must be blocked along dim {want}, got dim={t.dim}")
    B, Sq, Hq, D = qm.data.shape
    if D not in (64, 128):
        raise ValueError(f"head dim must be 64 or 128, got {D}")
    if tuple(km.data.shape) != tuple(vm.data.shape) or km.data.shape[0] != B or km.data.shape[3] != D:
        raise ValueError(f"k {tuple(km.data.shape)} and v {tuple(vm.data.shape)} must be (B, Sk, Hkv, D) with q's "
                         f"B={B}, D={D}")
    Hkv = km.data.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")


def attn_fwd_blockscaled(qm: MXTensor, km: MXTensor, vm: MXTensor, causal: bool = False,
                         softmax_scale: float | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                         config: FwdConfig | None = None):
    """MXFP8 attention forward with ``tl.dot_scaled`` on MX operands in their plain layouts.

    qm: (B, Sq, Hq, D) blocked along D (dim 3); km: (B, Sk, Hkv, D) along D (dim 3); vm: (B, Sk, Hkv, D) along
    the sequence (dim 1).  D in {64, 128}, Hq a multiple of Hkv, any Sq, Sk >= 0, any strides.
    Returns out (B, Sq, Hq, D) in ``out_dtype`` and lse (B, Hq, Sq) fp32 (natural log; -inf and out = 0 for rows
    that see no key), as ``attn_fwd_hopper``.  Semantics: ``reference.attention_forward(qm, km, vm,
    quantize_p=True)`` up to the running max (module docstring).  ``config.block_n`` must be a multiple of 32.
    """
    _check_operands(qm, km, vm)
    B, Sq, Hq, D = qm.data.shape
    Sk, Hkv = km.data.shape[1], km.data.shape[2]
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    cfg = config or default_config(D, causal)
    if cfg.block_n % 32 or cfg.block_m < 16:
        raise ValueError(f"block_n must be a multiple of 32 and block_m >= 16, got {cfg}")
    out, lse = alloc_fwd_outputs(qm.data, out_dtype)
    if out.numel() == 0:
        return out, lse
    qs, ks, vs = (t.scale.view(torch.uint8) for t in (qm, km, vm))
    NSB = vs.shape[1]
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    grid = (cdiv(Sq, cfg.block_m), B * Hq)
    fast_launcher(_attn_fwd_blockscaled_kernel)[grid](
        qm.data, qs, km.data, ks, vm.data, vs, out, lse,
        *qm.data.stride(), *qs.stride(),
        *km.data.stride(), *ks.stride(),
        *vm.data.stride(), *vs.stride(),
        *out.stride(), *lse.stride(),
        Hq, Sq, Sk, NSB, Hq // Hkv, softmax_scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), EXPLICIT_ROUND=interp,
        QK_ZERO_ACC=_QK_ZERO_ACC,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


# The 128x4 swizzled scale layout of cuBLAS / cuDNN block-scaled MMA (for producers targeting Blackwell) lives in
# mxattn.formats (``to_blackwell_scale_layout``, ``from_blackwell_scale_layout``), re-exported here.


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed): what the kernel lowers to on a given architecture
# ----------------------------------------------------------------------------------------------


def compile_for(capability: int, head_dim: int = 128, causal: bool = False, config: FwdConfig | None = None,
                out_dtype: str = "bf16"):
    """Compile the kernel for ``GPUTarget("cuda", capability, 32)`` without launching it (needs no GPU, only
    Triton's bundled ptxas; not under TRITON_INTERPRET=1).  Returns the ``CompiledKernel``: ``.asm["ttgir"]``,
    ``.asm["ptx"]``.  On 100 the PTX holds ``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (native MX products);
    on 90 bf16 ``wgmma`` (dot_scaled upcast)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = config or default_config(head_dim, causal)
    kern = _attn_fwd_blockscaled_kernel
    ptrs = {"Q": "*fp8e4nv", "QS": "*u8", "K": "*fp8e4nv", "KS": "*u8", "V": "*fp8e4nv", "VS": "*u8",
            "O": f"*{out_dtype}", "LSE": "*fp32"}
    const = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
                 EXPLICIT_ROUND=False, QK_ZERO_ACC=_QK_ZERO_ACC)
    names = kern.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32") for n in names}
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
