"""The MXFP8 format (OCP microscaling, E4M3 elements, E8M0 scales) and the Hopper operand format.

Everything here is plain PyTorch and defines the semantics that every kernel is tested against,
bit for bit.  Nothing in this module imports from the rest of mxattn.

MXFP8 (``MXTensor``)
    ``data``  ``torch.float8_e4m3fn`` (max 448, min normal 2^-6, subnormals down to 2^-9)
    ``scale`` ``torch.float8_e8m0fnu``; the value is 2^(byte - 127); byte 255 is NaN.
    One scale per 32 consecutive elements along one dimension, ``dim``.  The scale tensor is in
    *plain layout*: the data's shape with ``dim`` divided by 32, rounded up.  Any padded or swizzled
    layout a kernel wants is a separate, explicit conversion.

Scale rules (``ScaleMode``), for a block with absolute maximum ``amax``:
    RCEIL (default; cuBLAS, Blackwell hardware, the reference system):
        e = ceil(log2(amax / 448)), so every element fits without saturating.
    FLOOR (OCP spec text, torchao's default):
        e = floor(log2(amax)) - 8; elements above 448 after division saturate to +-448.
    Both clamp e to [-127, 127].  A block of zeros gets e = 0 (byte 127).  A block holding NaN or
    +-Inf gets byte 255 and dequantizes to NaN; its data bytes are those of the elements divided by
    1 (saturated, NaN kept), so that kernels have one bit pattern to match.
    ``data = saturate(x / 2^e)`` to +-448, rounded to nearest even.

    Computed exactly: with ``amax = m * 2^k``, ``1 <= m < 2`` (``frexp``), FLOOR is ``k - 8`` and
    RCEIL is ``k - 8 + (m > 1.75)`` because 448 = 1.75 * 2^8.  No float division is involved, so
    the result does not depend on how a backend rounds ``amax / 448``.

Differences from torchao's ``to_mx`` (torchao.prototype.mx_formats): torchao quantizes along the
last dim only (callers transpose) and needs the length divisible by the block size; here any dim and
any length work (the last block may be partial; missing elements count as zero).  torchao's RCEIL
path computes ``amax / 448`` in fp32 and rounds its exponent up; that is equal to the exact rule
above for every finite fp32 amax.  Blocks containing Inf: torchao's FLOOR path gives a scale of
NaN too, and we pin the data bytes (see above).

Hopper operand format (``RowScaledFP8``)
    Hopper tensor cores multiply FP8 but know nothing of block scales.  The MX blocks of one
    *row* (a token for ``hdim``, a channel for ``seq``) can be rewritten to the row's largest block
    exponent E: ``q' = e4m3(q * 2^(e_b - E))`` (DESIGN §3, "re-expression lemma").  The shift is
    exact while values stay normal; values that fall into e4m3 subnormals lose bits, with absolute
    error at most 2^-10 * 2^E.  ``RowScaledFP8`` holds the FP8 data and one int32 exponent per row
    (or per group of ``group`` consecutive rows along ``group_dim``), so that a kernel can fold the
    exponents into the softmax scale or the epilogue and run plain FP8 matrix products.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ScaleMode",
    "MXTensor",
    "MXTensorTiled",
    "RowScaledFP8",
    "to_blackwell_scale_layout",
    "from_blackwell_scale_layout",
    "blackwell_scale_bytes",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "mx_block_exponents",
    "round_to_e4m3",
    "to_row_scaled",
    "row_scaled_from_float",
]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # 448 = 1.75 * 2^8
E8M0_BIAS = 127
E8M0_NAN = 255
E_MIN, E_MAX = -127, 127


class ScaleMode(str, enum.Enum):
    """How the shared exponent of a block is chosen (see the module docstring for the formulas)."""

    RCEIL = "rceil"  # e = ceil(log2(amax / 448)): no element saturates
    FLOOR = "floor"  # e = floor(log2(amax)) - 8: elements above 448 saturate

    @classmethod
    def parse(cls, mode: Union[str, "ScaleMode"]) -> "ScaleMode":
        if isinstance(mode, ScaleMode):
            return mode
        found = _SCALE_MODES.get(mode) if type(mode) is str else None
        if found is not None:  # the common spellings, without the Enum's own lookup (a few calls per eager call)
            return found
        try:
            return cls(str(mode).lower())
        except ValueError:
            raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {mode!r}") from None


_SCALE_MODES = {m.value: m for m in ScaleMode}


def _norm_dim(dim: int, ndim: int, name: str = "dim") -> int:
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    dim = operator.index(dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor of rank {ndim}")
    return dim % ndim


def is_finite_number(x: Union[int, float]) -> bool:
    """``math.isfinite`` for a Python int or float argument; an int beyond the float range counts as not finite
    (``math.isfinite`` raises OverflowError on it)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass
class MXTensor:
    """An MXFP8 tensor: e4m3 data and one E8M0 scale per 32 elements along ``dim``.

    ``data``: ``float8_e4m3fn``, any shape and strides (a kernel may hand back a transposed view of
    a channel-major buffer).  ``scale``: ``float8_e8m0fnu`` (uint8 accepted and viewed), plain
    layout: ``data.shape`` with ``dim`` replaced by ``ceil(size / 32)``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    dim: int
    block_size: int = BLOCK_SIZE

    def __post_init__(self):
        for name in ("data", "scale"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"MXTensor.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"MXTensor.data must be torch.float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype == torch.uint8:
            self.scale = self.scale.view(torch.float8_e8m0fnu)
        if self.scale.dtype != torch.float8_e8m0fnu:
            raise TypeError(f"MXTensor.scale must be torch.float8_e8m0fnu or uint8, got {self.scale.dtype}")
        if self.block_size != BLOCK_SIZE:
            raise ValueError(f"only block_size={BLOCK_SIZE} is supported, got {self.block_size}")
        self.dim = _norm_dim(self.dim, self.data.ndim)
        want = list(self.data.shape)
        want[self.dim] = -(-want[self.dim] // self.block_size)
        if list(self.scale.shape) != want:
            raise ValueError(
                f"MXTensor.scale has shape {tuple(self.scale.shape)}, expected {tuple(want)} for data of shape "
                f"{tuple(self.data.shape)} blocked along dim {self.dim}"
            )
        if self.scale.device != self.data.device:
            raise ValueError(f"MXTensor.scale is on {self.scale.device} but data is on {self.data.device}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def scale_bytes(self) -> torch.Tensor:
        """The scales as uint8 (biased exponents, 255 = NaN)."""
        return self.scale.view(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp8(self, dtype)

    def to(self, device) -> "MXTensor":
        return MXTensor(self.data.to(device), self.scale.to(device), self.dim, self.block_size)

    def __repr__(self) -> str:
        return f"MXTensor(shape={tuple(self.shape)}, dim={self.dim}, device={self.device})"


# ----------------------------------------------------------------------------------------------
# The 128x4 tiled scale layout of Blackwell block-scaled MMA (cuBLAS / cuDNN)
# ----------------------------------------------------------------------------------------------
#
# Sources (facts only): cuBLAS "1D Block Scaling Factors Layout",
#   https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout
# and cuDNN frontend "MXFP8 scale factor 128x4 layout",
#   https://nvidia.github.io/cudnn-frontend/mxfp8-scale-factor-128x4-layout/
# A scale matrix of R rows (outer dim: M or N) by C columns (one per 32 elements of the contraction dim K) is
# padded to whole 128 x 4 tiles; tiles are stored one after the other, the column-tile index fastest
# (tile (rt, ct) starts at byte (rt * ceil(C/4) + ct) * 512); inside a tile, the 128 rows are four 32-row slabs
# interleaved so that scale (r, c) (r < 128, c < 4 within the tile) lies at byte (r % 32) * 16 + (r // 32) * 4 + c:
# one 16-byte line holds rows r, r+32, r+64, r+96 of all four columns (the 32x4x4 atom).  Padding bytes are 0.

_ATOM_ROWS, _ATOM_COLS = 128, 4


def blackwell_scale_bytes(rows: int, cols: int) -> int:
    """Bytes of one (rows, cols) scale matrix in the 128x4-tiled layout (whole tiles of 512 bytes)."""
    return -(-rows // _ATOM_ROWS) * -(-cols // _ATOM_COLS) * _ATOM_ROWS * _ATOM_COLS


def to_blackwell_scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """Plain (..., R, C) scale bytes (uint8 or float8_e8m0fnu) -> the 128x4-tiled layout, one flat run of
    ``blackwell_scale_bytes(R, C)`` bytes per leading index, in ``scale``'s dtype, padding zero-filled."""
    if scale.ndim < 2:
        raise ValueError(f"scale must be (..., rows, K/32), got shape {tuple(scale.shape)}")
    dtype = scale.dtype
    s = scale.view(torch.uint8) if dtype != torch.uint8 else scale
    *lead, R, C = s.shape
    rt, ct = -(-R // _ATOM_ROWS), -(-C // _ATOM_COLS)
    padded = s.new_zeros(*lead, rt * _ATOM_ROWS, ct * _ATOM_COLS)
    padded[..., :R, :C] = s
    n = len(lead)
    # (..., rt, r//32, r%32, ct, c) -> (..., rt, ct, r%32, r//32, c)
    perm = tuple(range(n)) + tuple(n + i for i in (0, 3, 2, 1, 4))
    tiled = padded.view(*lead, rt, 4, 32, ct, _ATOM_COLS).permute(perm).reshape(*lead, -1)
    return tiled.view(dtype) if dtype != torch.uint8 else tiled


def from_blackwell_scale_layout(tiled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blackwell_scale_layout``: (..., bytes) -> the plain (..., rows, cols) scales."""
    dtype = tiled.dtype
    t = tiled.view(torch.uint8) if dtype != torch.uint8 else tiled
    *lead, nbytes = t.shape
    rt, ct = -(-rows // _ATOM_ROWS), -(-cols // _ATOM_COLS)
    if nbytes != blackwell_scale_bytes(rows, cols):
        raise ValueError(f"expected {blackwell_scale_bytes(rows, cols)} bytes for a ({rows}, {cols}) scale matrix, "
                         f"got {nbytes}")
    n = len(lead)
    perm = tuple(range(n)) + tuple(n + i for i in (0, 3, 2, 1, 4))
    plain = t.reshape(*lead, rt, ct, 32, 4, _ATOM_COLS).permute(perm).reshape(*lead, rt * _ATOM_ROWS,
                                                                             ct * _ATOM_COLS)
    plain = plain[..., :rows, :cols].contiguous()
    return plain.view(dtype) if dtype != torch.uint8 else plain


@dataclass
class MXTensorTiled:
    """MXFP8 data as in ``MXTensor``, its E8M0 scales in the 128x4-tiled layout of Blackwell block-scaled MMA.

    ``per_head=True`` (attention operands, ``quantize_mxfp8_triton(..., scale_layout="blackwell")``): ``data``
    (B, S, H, D) or packed (T, H, D); ``scale_tiled`` (B, H, n) or, packed, (H, n): per (batch, head) the scale
    matrix of the product that consumes the operand.  Blocked along D (``dim`` last): rows are the tokens,
    columns the D/32 blocks (Q, K: the M / N operand of Q Kᵀ).  Blocked along S: rows are the channels, columns
    the S/32 blocks (V: the N operand of P V).
    ``per_head=False`` (GEMM activations: ``rmsnorm_quant`` / ``linear_quant`` with ``scale_layout="blackwell"``):
    ``data`` (..., N) blocked along its last dim; ``scale_tiled`` (n,): one matrix, rows = all leading indices in
    order, columns = the N/32 blocks (the M x K operand of the next GEMM).
    ``to_mx()`` gives the plain ``MXTensor``."""

    data: torch.Tensor
    scale_tiled: torch.Tensor
    dim: int
    per_head: bool = True

    def __post_init__(self):
        nd = self.data.ndim
        if self.per_head and nd not in (3, 4):
            raise ValueError(f"MXTensorTiled.data must be (B, S, H, D) or (T, H, D), got {tuple(self.data.shape)}")
        if nd < 2:
            raise ValueError(f"MXTensorTiled.data must have 2 or more dims, got {tuple(self.data.shape)}")
        self.dim = _norm_dim(self.dim, nd)
        allowed = (nd - 1, nd - 3) if self.per_head else (nd - 1,)
        if self.dim not in allowed:
            raise ValueError(f"MXTensorTiled.dim must be {' or '.join(map(str, allowed))} here, got {self.dim}")
        rows, cols = self._matrix()
        want = [*self._lead(), blackwell_scale_bytes(rows, cols)]
        if list(self.scale_tiled.shape) != want:
            raise ValueError(f"MXTensorTiled.scale_tiled has shape {tuple(self.scale_tiled.shape)}, expected "
                             f"{tuple(want)} for data {tuple(self.data.shape)} blocked along dim {self.dim}")

    def _lead(self) -> list[int]:
        d = self.data
        if not self.per_head:
            return []
        return [d.shape[0], d.shape[2]] if d.ndim == 4 else [d.shape[1]]

    def _matrix(self) -> tuple[int, int]:
        d = self.data
        if not self.per_head:
            return math.prod(d.shape[:-1]), -(-d.shape[-1] // BLOCK_SIZE)
        S, D = d.shape[-3], d.shape[-1]
        if self.dim == d.ndim - 1:
            return S, -(-D // BLOCK_SIZE)
        return D, -(-S // BLOCK_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_mx().dequantize(dtype)

    def to_mx(self) -> "MXTensor":
        rows, cols = self._matrix()
        plain = from_blackwell_scale_layout(self.scale_tiled.view(torch.uint8), rows, cols)  # (*lead, rows, cols)
        if not self.per_head:
            return MXTensor(self.data, plain.reshape(*self.data.shape[:-1], cols), self.dim)
        if self.data.ndim == 3:
            plain = plain.unsqueeze(0)  # (1, H, rows, cols)
        if self.dim == self.data.ndim - 1:  # (B, H, S, ND) -> (B, S, H, ND)
            scale = plain.permute(0, 2, 1, 3)
        else:  # (B, H, D, NSB) -> (B, NSB, H, D)
            scale = plain.permute(0, 3, 1, 2)
        if self.data.ndim == 3:
            scale = scale[0]
        return MXTensor(self.data, scale.contiguous(), self.dim)


def _blocked(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """Move ``dim`` last, zero-pad it to a multiple of 32 and split it: (..., nblocks, 32)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % BLOCK_SIZE
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // BLOCK_SIZE, BLOCK_SIZE), n


def _unblocked(xb: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :n]
    return x.movedim(-1, dim)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e in fp32 for integer e in [-149, 127]."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.to(torch.int32)).to(torch.float32)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturate fp32 values to +-448 and round to the e4m3 grid (RNE); NaN stays NaN."""
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def mx_block_exponents(amax: torch.Tensor, scale_mode: Union[str, ScaleMode] = "rceil") -> torch.Tensor:
    """Shared exponent (int32, unbiased, in [-127, 127]) for blocks with absolute maximum ``amax``.

    Zero blocks give 0.  Non-finite amax is not handled here (callers mark those blocks NaN).
    """
    mode = ScaleMode.parse(scale_mode)
    a = amax.to(torch.float32)
    mant, ex = torch.frexp(a)  # a = mant * 2^ex, 0.5 <= mant < 1
    k = ex.to(torch.int32) - 1  # a = (2 * mant) * 2^k, 1 <= 2*mant < 2
    e = k - E4M3_EMAX
    if mode is ScaleMode.RCEIL:
        e = e + (mant * 2 > 1.75).to(torch.int32)
    e = torch.where(a > 0, e, torch.zeros_like(e))
    return e.clamp(E_MIN, E_MAX)


_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def quantize_mxfp8(
    x: torch.Tensor, dim: int = -1, scale_mode: Union[str, ScaleMode] = "rceil"
) -> MXTensor:
    """Quantize a float tensor to MXFP8 with 32-element blocks along ``dim``.

    Any rank, any dim, any length along ``dim``: the last block may be partial (missing elements
    count as zero for the amax and do not exist in the output).  Returns ``MXTensor`` with ``data``
    of ``x``'s shape (contiguous) and ``scale`` in plain layout.  Semantics: module docstring.
    The work is done on ``x.float()``: fp64 inputs are rounded to fp32 first (finite values beyond
    the fp32 range become +-Inf, so their block is NaN), and the exponent never reaches the +127 clamp.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_mxfp8 expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _QUANTIZABLE:  # an FP8 tensor (e.g. MXTensor.data without its scales) is refused, not re-read
        raise TypeError(f"quantize_mxfp8 expects a float32/float16/bfloat16/float64 tensor, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("quantize_mxfp8 needs a tensor of rank >= 1")
    dim = _norm_dim(dim, x.ndim)
    xb, n = _blocked(x.to(torch.float32), dim)
    finite = torch.isfinite(xb).all(dim=-1, keepdim=True)
    amax = xb.abs().amax(dim=-1, keepdim=True) if xb.numel() else xb.new_zeros(xb.shape[:-1] + (1,))
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    e = mx_block_exponents(amax, scale_mode)
    q = round_to_e4m3(xb * _pow2(-e))
    scale = torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    data = _unblocked(q, n, dim).contiguous()
    scale = scale.squeeze(-1).movedim(-1, dim).contiguous()
    return MXTensor(data, scale.view(torch.float8_e8m0fnu), dim)


def _expand_scales(scale_bytes: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Per-element fp32 scale (NaN for byte 255) from plain-layout bytes."""
    s = _pow2(scale_bytes.to(torch.int32) - E8M0_BIAS)
    s = torch.where(scale_bytes == E8M0_NAN, torch.full_like(s, float("nan")), s)
    return s.repeat_interleave(BLOCK_SIZE, dim=dim).narrow(dim, 0, n)


def _scaled(data: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * s`` in ``dtype``, exact: the product is formed in fp64 when fp64 is asked for, because
    an e4m3 value times 2^e can exceed the fp32 range (256 * 2^120 = 2^128) and would become Inf."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (data.to(wide) * s.to(wide)).to(dtype)


def dequantize_mxfp8(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * 2^(scale - 127)``, NaN where the block's scale byte is 255.

    Exact in fp64; in fp32 the only loss is overflow to Inf of values at or above 2^128."""
    if not isinstance(t, MXTensor):
        raise TypeError(f"dequantize_mxfp8 expects an MXTensor, got {type(t).__name__}")
    if not isinstance(dtype, torch.dtype) or dtype not in _QUANTIZABLE:
        raise TypeError(f"dtype must be float32, float16, bfloat16 or float64, got {dtype}")
    s = _expand_scales(t.scale_bytes, t.dim, t.data.shape[t.dim])
    return _scaled(t.data, s, dtype)


# ----------------------------------------------------------------------------------------------
# Hopper operand format
# ----------------------------------------------------------------------------------------------


@dataclass
class RowScaledFP8:
    """FP8 data with one power-of-two scale per row (or per group of rows): the Hopper operand format.

    ``data``: ``float8_e4m3fn``, the logical shape of the source tensor, any strides (V and the
    backward's ``seq`` operands use a channel-major buffer, see ``channel_major``).
    ``exp``: int32 exponents; shape = ``data.shape`` with ``dim`` (the contraction dim whose MX
    blocks were merged) set to 1, and, when ``group > 1``, ``group_dim`` set to
    ``ceil(size / group)``.  Value of an element: ``data * 2^exp`` (broadcast).

    Layouts mxattn uses for (B, S, H, D) tensors:
      Q hdim: dim=-1, one exponent per token and head, exp (B, S, H, 1)
      K hdim: dim=-1, one exponent per 128 tokens and head (group_dim=1), exp (B, ceil(S/128), H, 1)
      V seq:  dim=1, one exponent per channel over the whole sequence, exp (B, 1, H, D)
    """

    data: torch.Tensor
    exp: torch.Tensor
    dim: int
    group_dim: Optional[int] = None
    group: int = 1

    def __post_init__(self):
        for name in ("data", "exp"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"RowScaledFP8.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"RowScaledFP8.data must be torch.float8_e4m3fn, got {self.data.dtype}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"RowScaledFP8.group must be a positive int, got {self.group!r}")
        if self.exp.dtype != torch.int32:
            raise TypeError(f"RowScaledFP8.exp must be int32, got {self.exp.dtype}")
        self.dim = _norm_dim(self.dim, self.data.ndim)
        if self.group_dim is not None:
            self.group_dim = _norm_dim(self.group_dim, self.data.ndim, "group_dim")
            if self.group_dim == self.dim:
                raise ValueError("group_dim must differ from dim")
        want = list(self.data.shape)
        want[self.dim] = 1
        if self.group_dim is not None:
            want[self.group_dim] = -(-want[self.group_dim] // self.group)
        if list(self.exp.shape) != want:
            raise ValueError(f"RowScaledFP8.exp has shape {tuple(self.exp.shape)}, expected {tuple(want)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def expanded_exp(self) -> torch.Tensor:
        """The exponents broadcast to one per row (``group_dim`` expanded back to its full size)."""
        e = self.exp
        if self.group_dim is not None and self.group > 1:
            e = e.repeat_interleave(self.group, dim=self.group_dim).narrow(
                self.group_dim, 0, self.data.shape[self.group_dim]
            )
        return e

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _scaled(self.data, _pow2(self.expanded_exp()), dtype)


def channel_major(data: torch.Tensor, seq_dim: int = 1, align: int = 16) -> torch.Tensor:
    """Copy (B, S, H, D) ``data`` into a (B, H, D, S_pad) buffer (S padded with zeros to ``align``)
    and return the (B, S, H, D) view of it: the K-major layout FP8 wgmma needs for P V and friends."""
    if data.ndim != 4 or seq_dim != 1:
        raise ValueError("channel_major expects (B, S, H, D) data with seq_dim=1")
    B, S, H, D = data.shape
    s_pad = -(-max(S, 1) // align) * align
    buf = torch.zeros(B, H, D, s_pad, dtype=data.dtype, device=data.device)
    buf[..., :S].copy_(data.permute(0, 2, 3, 1))
    return buf[..., :S].permute(0, 3, 1, 2)


def to_row_scaled(
    t: MXTensor, group_dim: Optional[int] = None, group: int = 1
) -> RowScaledFP8:
    """Re-express an MXTensor with one exponent per row (per ``group`` rows along ``group_dim``).

    E is the largest exponent among the row group's blocks that hold a nonzero element (0 when all
    are zero); ``data' = e4m3(data * 2^(e_b - E))`` with round-to-nearest-even.  Blocks with scale
    byte 255 become NaN data.  The result's data is contiguous in ``t.data``'s shape.
    """
    if not isinstance(t, MXTensor):
        raise TypeError(f"to_row_scaled expects an MXTensor, got {type(t).__name__}")
    dim = t.dim
    n = t.data.shape[dim]
    qb, _ = _blocked(t.data.to(torch.float32), dim)  # (..., nb, 32), dim moved last
    sb = t.scale_bytes.movedim(dim, -1).to(torch.int32)  # (..., nb)
    is_nan = sb == E8M0_NAN
    nonzero = (qb != 0).any(dim=-1) & ~is_nan
    e_b = sb - E8M0_BIAS
    neg = torch.full_like(e_b, -(1 << 20))
    e_row = torch.where(nonzero, e_b, neg).amax(dim=-1, keepdim=True)  # (..., 1)
    if group_dim is not None and group > 1:
        gd = _norm_dim(group_dim, t.data.ndim, "group_dim")
        # position of group_dim after moving dim last
        gd_moved = gd if gd < dim else gd - 1
        size = e_row.shape[gd_moved]
        pad = (-size) % group
        er = e_row.movedim(gd_moved, -1)
        if pad:
            er = torch.nn.functional.pad(er, (0, pad), value=-(1 << 20))
        er = er.reshape(*er.shape[:-1], er.shape[-1] // group, group).amax(dim=-1)
        e_grp = er.movedim(-1, gd_moved)
        e_row = e_grp.repeat_interleave(group, dim=gd_moved).narrow(gd_moved, 0, size)
    else:
        gd, e_grp = None, e_row
    e_row = torch.where(e_row < E_MIN - 1000, torch.zeros_like(e_row), e_row)
    e_grp = torch.where(e_grp < E_MIN - 1000, torch.zeros_like(e_grp), e_grp)
    shift = (e_b - e_row).clamp(min=-160)  # (..., nb): <= 0 for nonzero blocks
    v = qb * _pow2(shift.clamp(max=0)).unsqueeze(-1)
    v = torch.where(is_nan.unsqueeze(-1), torch.full_like(v, float("nan")), v)
    data = _unblocked(round_to_e4m3(v), n, dim).contiguous()
    exp = e_grp.movedim(-1, dim).contiguous().to(torch.int32)
    return RowScaledFP8(data, exp, dim, gd, group)


def row_scaled_from_float(
    x: torch.Tensor,
    dim: int = -1,
    group_dim: Optional[int] = None,
    group: int = 1,
    scale_mode: Union[str, ScaleMode] = "rceil",
) -> RowScaledFP8:
    """The Hopper operand format straight from a float tensor: ``to_row_scaled(quantize_mxfp8(x))``.

    Defined as that composition so that attention on it equals attention on the MX tensor up to the
    lemma's bound; the fused kernels are bit-exact with it."""
    return to_row_scaled(quantize_mxfp8(x, dim, scale_mode), group_dim, group)
