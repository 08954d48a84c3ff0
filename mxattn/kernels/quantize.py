"""MXFP8 quantize / dequantize kernels and the Hopper operand producers, in Triton ``tl``.

Every kernel is bit-exact with ``mxattn.formats`` (data bytes, scale bytes, exponents), for RCEIL and
FLOOR, including zero blocks, NaN/Inf blocks, subnormal results and the 2^-127 clamp.

Public functions (inputs (B, S, H, D), or packed (T, H, D) with ``seq_dim=0``; D <= 256, any S):

``quantize_mxfp8_triton(x, orientations="hdim"|"seq"|"both", scale_mode="rceil", seq_dim=None)``
    One read of ``x`` (bf16/fp16/fp32) gives
    * ``hdim``: ``MXTensor`` blocked along D (dim=-1): data (B, S, H, D) contiguous, scale (B, S, H, ceil(D/32));
    * ``seq``:  ``MXTensor`` blocked along S (dim=seq_dim): data is the (B, S, H, D) view of a channel-major
      (B, H, D, S_pad) buffer, S_pad = S rounded up to 16 with zero padding (the layout of
      ``formats.channel_major``), scale (B, ceil(S/32), H, D) plain layout;
    * ``both``: the tuple (hdim, seq).
``dequantize_mxfp8_triton(t, dtype=torch.bfloat16)``
    Any ``MXTensor`` of rank 1-4 (any strides, any block dim) to a contiguous tensor of ``dtype``.
``row_scaled_triton(x, role, scale_mode="rceil", seq_dim=None, k_group=128)``
    The Hopper operand format (``RowScaledFP8``) equal to ``to_row_scaled(quantize_mxfp8(x, dim), ...)``,
    from a float tensor in one pass (two reads for V), or from an ``MXTensor`` (``to_row_scaled(mx, ...)``):
    * ``q``: dim=-1, one exponent per token and head, exp (B, S, H, 1), data (B, S, H, D) contiguous;
    * ``k``: dim=-1, one exponent per ``k_group`` tokens and head, exp (B, ceil(S/k_group), H, 1);
    * ``v``: dim=seq, one exponent per channel over the whole sequence, exp (B, 1, H, D), data channel-major
      like the ``seq`` MXTensor above.

How the numbers are made exactly (the same code runs under ``TRITON_INTERPRET=1`` and on the GPU):
* Block exponents come from the bits of the block's |x| maximum, a NaN-propagating float maximum
  (``_abs_max_bits``: >= 0x7F800000 exactly where the block holds NaN/Inf): ``e = k - 8 + (mantissa > 1.75)``
  (RCEIL) or ``k - 8`` (FLOOR), clamped to [-127, 127]; fp32 subnormal maxima have k = -127 from the bits, which
  the clamp makes right.  A block holds a nonzero e4m3 element iff its maximum exceeds 2^-137 (``_nonzero_block``).
* ``x * 2^-e`` is one fp32 multiply by an exact power of two (normal for every reachable e); it is exact,
  or lands below 2^-126 where every later rounding gives zero anyway.  The re-expression of the Hopper operands
  multiplies the e4m3 value by 2^(e - E) in fp16 on the GPU (exact where it matters, ``_rs_bytes``).
* Rounding to e4m3 (RNE, saturating at 448): on the GPU the ``cvt.rn.satfinite`` instructions, as inline PTX
  that also packs the bytes and puts the input's sign on NaN bytes (0x7F with the input's sign, as ``torch`` makes
  them); under the interpreter (whose fp32->fp8 cast mis-rounds, DESIGN §5) ``_round_to_e4m3_grid`` rounds in fp32
  with the add-a-power-of-two trick and ``_e4m3_code`` encodes the on-grid value.  ``SOFT_ROUND_ON_GPU`` switches
  the GPU to the explicit rounding too (the GPU tests run both).  No path branches on NaN/Inf.

Kernels: ``_hdim_kernel`` (head-dim orientation alone: MX, Q, K) takes tiles (BLOCK_S, D/32, 32) of consecutive
rows (the (b, s, h) rows of a contiguous tensor as one run, per (b, h) otherwise); ``_quantize_kernel`` (any seq
orientation) takes one (b, h) pair and ``BLOCK_S`` tokens, read as row sets (rows s0 + 4w + k), each a 4-D tile
(BLOCK_S/32, W, D/32, 32): the S blocks are reductions over axis 1 of the sets' maximum, and the four
seq-orientation bytes of a channel pack into one int32 before the channel-major store.  V's exponent pass keeps a
running maximum over a chunk of S.  Tile sizes are in ``_tile`` with the measurements behind them
(docs/perf-notes-quantize.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from mxattn.formats import E8M0_NAN, MXTensor, MXTensorTiled, RowScaledFP8, ScaleMode, blackwell_scale_bytes
from mxattn.kernels import launch as _launch
from mxattn.kernels.launch import BoundLaunch, cdiv, fast_launcher, next_pow2

__all__ = [
    "quantize_mxfp8_triton",
    "dequantize_mxfp8_triton",
    "row_scaled_triton",
    "row_scaled_triton_both",
    "forward_operands_triton",
    "row_scaled_triton_both_pair",
    "ROLES",
    "SOFT_ROUND_ON_GPU",
]

ROLES = ("q", "k", "v")
MAX_HEAD_DIM = 256
SEQ_ALIGN = 16  # channel-major buffers pad S to this (formats.channel_major's default)
# Explicit fp32 rounding before the e4m3 cast on the GPU as well (the interpreter always uses it).
SOFT_ROUND_ON_GPU = os.environ.get("MXATTN_SOFT_ROUND", "0") == "1"
_NO_EXP_HOST = -(1 << 20)  # "no nonzero block yet" in exponent maxima (formats.to_row_scaled's sentinel)
_NO_EXP = tl.constexpr(_NO_EXP_HOST)
_SCALE_NAN = tl.constexpr(E8M0_NAN)


# ----------------------------------------------------------------------------------------------
# Tile choices (one spot).  Every kernel is memory bound: ~3 bytes per element against ~16 fp32/int
# instructions per element (per orientation), so the aim is enough bytes in flight per SM and
# full-line, 16-byte accesses, not ALU tricks.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    block_s: int  # tokens per program (a multiple of 32: whole seq blocks)
    num_warps: int
    row_groups: int = 1  # ``_quantize_tile``'s J: groups of four row sets (1 or 2)


def _tile(kind: str, d_pad: int, group: int = 0, warps: Optional[int] = None) -> Tile:
    """Tile for a kernel family at padded head dim ``d_pad`` (a power of two times 32); ``warps`` (the kinds sized
    by elements: ``hdim``, ``seq``, ``vexp``, ``mx_hdim``, ``mx_seq``) asks for that many warps at the same elements
    per thread (the fused launches of ``_operands_kernel`` run every job at the launch's warps; dequantize of
    channel-major data takes ``MX_SEQ_DEQUANT_WARPS``).

    Kernels of this module (session 12; docs/perf-notes-quantize.md has the measurements):
    * ``hdim`` (``_hdim_kernel``: MX head-dim, Q): ``HDIM_ELEMS`` elements per 4 warps (``HDIM_ELEMS_BY_D`` at the
      head dims measured apart).  ``hdim_k`` (K): BLOCK_S =
      the exponent group, 4 warps up to ``K_TILE_4WARPS`` elements.
    * ``seq`` (``_quantize_kernel``: seq / both / V pass 2): ``SEQ_ELEMS`` per 4 warps, ``SEQ_GROUPS`` groups of
      row sets.  ``seq_k`` (K+V layouts in one pass): BLOCK_S = the group, ``SEQ_K_GROUPS``.
    * ``vexp`` (V pass 1 on float input): ``VEXP_ELEMS`` per S tile of its loop at 4 warps, several tiles per
      program (``_seq_chunk`` with ``VEXP_MIN_PROGRAMS``), ``VEXP_STAGES`` deep.
    * ``mx_hdim`` (``_hdim_rescale_kernel`` Q, ``_hdim_dequant_kernel``): ``MX_HDIM_ELEMS`` per 4 warps;
      ``mx_hdim_k`` (K from MX) like ``hdim_k``, ``MX_K_GROUPS`` groups per program.
    * ``mx_seq`` (``_seq_dequant_kernel``, ``_seq_rescale_kernel``: channel-major MX data, session 13):
      ``MX_SEQ_ELEMS`` per 4 warps, at least one seq block.
    The sizes and the measurements behind them are at the constants below.
    Older kinds, kept for the kernels that still use them (varlen, from-MX, dequantize; sessions 2-3 sweep, B8 S8192
    H16 D128 bf16): ``quant``, ``rescale``, ``dequant``: 4096 elements per program and 4 warps won there (hdim 69%,
    seq 70%, both 57% of copy against 61/54/49% at 8192 elements and 8 warps); ``k``: BLOCK_S = the group, 8 warps;
    ``seqexp`` (V pass 1 from MX): 8192 elements, 4 warps.
    """
    if kind in TILE_OVERRIDES:
        return TILE_OVERRIDES[kind]
    w4 = (warps or 4) // 4
    if kind == "vexp":
        return Tile(max(32, VEXP_ELEMS * w4 // d_pad), 4 * w4)
    if kind == "hdim":
        return Tile(max(1, HDIM_ELEMS_BY_D.get(d_pad, HDIM_ELEMS) * w4 // d_pad), 4 * w4)
    if kind == "seq":
        return Tile(max(32, SEQ_ELEMS * w4 // d_pad), 4 * w4, SEQ_GROUPS)
    if kind == "mx_hdim":  # MX input blocked along D (from-MX Q, dequantize)
        return Tile(max(1, MX_HDIM_ELEMS * w4 // d_pad), 4 * w4)
    if kind == "mx_seq":  # channel-major MX input blocked along S (dequantize)
        return Tile(max(32, MX_SEQ_ELEMS * w4 // d_pad), 4 * w4)
    if kind == "mx_seq_v":  # the same, V's pass 2 from MX (``_seq_rescale_kernel``)
        elems, w = MX_SEQ_V_BY_D.get(d_pad, MX_SEQ_V_DEFAULT)
        return Tile(max(32, elems // d_pad), w)
    if kind == "mx_hdim_k":  # K from MX: ``MX_K_GROUPS`` exponent groups per program
        bs = group * MX_K_GROUPS
        return Tile(bs, warps or (4 if bs * d_pad <= K_TILE_4WARPS else 8))
    if kind == "hdim_k":
        return Tile(group, warps or (4 if group * d_pad <= K_TILE_4WARPS else 8))
    if kind == "seq_k":
        return Tile(group, warps or max(4, min(16, group * d_pad // 2048)), SEQ_K_GROUPS)
    if kind == "k":
        bs = group
    elif kind == "seqexp":
        bs = max(32, 8192 // d_pad)
    else:
        bs = max(32, 4096 // d_pad)
    elems = bs * d_pad
    if kind == "seqexp":
        warps = 4 if elems <= 8192 else 8
    else:
        warps = 4 if elems <= 4096 else (8 if elems <= 16384 else 16)
    return Tile(bs, warps)


# Elements per 4 warps of the kinds sized by elements (B8 S8192 H16 D128 bf16 sweep, session 12, % of copy):
# ``hdim`` (MX head-dim, Q): 4096 (32 per thread) 96 / 96, 8192 92 / 92, 16384 84 / 93; at d64 (B16 S8192 H16,
# session 12's two calls) 8192 elements 89.8 / 94.0 against 75.0 / 90.4 at 4096: d64 keeps 128 tokens per program.
HDIM_ELEMS = 4096
HDIM_ELEMS_BY_D = {64: 8192}
# ``seq`` (seq, both, V pass 2) with one group of row sets: 4096 88 / 76 / 79 (quant_seq / quant_both / rs_v),
# 8192 83 / 78 / 76; two groups (J = 2) lost at every size (8192: 71 / 69 / 72).
SEQ_ELEMS = 4096
SEQ_GROUPS = 1
# ``seq_k`` (K+V layouts in one pass, BLOCK_S = the group): 8 warps, J = 2: 70% (J = 1 62%, 16 warps 44%).
SEQ_K_GROUPS = 2
# ``vexp`` (V pass 1 on float input): elements per S tile of its loop, 4 warps (8192 at 8 warps: 59%).  Session 15,
# with ``VEXP_MIN_TILES`` 4 (rows side by side, 300 ms each): 64 x 128 at 4 warps 20.6 / 20.8 us at B2 S4096 H16
# d128 against 39.2 / 40.0 us for 32 x 128 with one tile a program, 83.5 % of copy at B8 S8192 against 80.9 %.
VEXP_ELEMS = 8192
# ``mx_hdim`` (from-MX Q, dequantize head-dim): 4096 71 / 90 (rs_q_from_mx / dequant_hdim), 8192 69 / 86.
MX_HDIM_ELEMS = 4096
# ``mx_seq`` (dequantize, V pass 2 from channel-major MX): the row-set kernel's size (``SEQ_ELEMS``) per 4 warps.
# Dequantize takes ``MX_SEQ_DEQUANT_WARPS`` (the same elements per thread over more warps): session 15, dequant_seq
# B8 S8192 H16 d128, 64 x 128 at 8 warps 88.8 / 88.0 / 88.1 % of copy in three runs against 83.9 / 82.9 / 78.3 % for
# 32 x 128 at 4 (64 x 128 at 4 warps 82.1 %).  V pass 2 from MX (~90 %) keeps 4 warps.
MX_SEQ_ELEMS = 4096
MX_SEQ_DEQUANT_WARPS = 8
# V's pass 2 from MX (``mx_seq_v``): (elements per program, warps), by padded head dim.  A 32-token tile at d128 read
# 32 bytes of each channel-major row per program.  Session 16 (stage quant16b, both passes with the scales-first
# pass 1, B8 S8192 H16 d128, % of copy): 32 x 4 36.6 (59.6 in the call before), 64 x 4 72.7, 64 x 8 74.8,
# 128 x 8 80.1, 128 x 16 43.0, 256 x 16 41.3.  d64 (B16): 32-43 % at every tile that call (64 x 4 41.2, 128 x 4 42.6,
# 128 x 8 38.2, 256 x 8 32.3; 75.9 % at 64 x 4 in the call before): not decided, keeps 4096 / 4.
MX_SEQ_V_BY_D = {128: (16384, 8)}
MX_SEQ_V_DEFAULT = (4096, 4)
# ... or (BLOCK_S, CG, warps) of ``_seq_rescale_rows_kernel``: CG channel-major rows x BLOCK_S tokens a program, each
# row in runs of BLOCK_S bytes (None = the tokens x all-channels tile above).  Session 16 (stage quant16c, both
# passes, rows timed in one group, % of copy, d128 / d64): (512, 32, 4) 81.8 / 81.8, (1024, 16, 4) 82.0 / 82.2,
# (256, 64, 4) 82.0 / 81.5, (512, 64, 8) 81.6 / 81.5, (1024, 32, 8) 33.0* / 81.1; the tile above 80.1 (128 x 8) /
# 76.2 (64 x 4).  (* that group's rows were host-bound: eager timing of this path measures the host when the lease's
# CPU is slow; CUDA-graph replays agree with the fast group, ``quantize-…-s16-issue3_graph.json``.)
MX_SEQ_V_ROWS: Optional[tuple] = (512, 32, 4)
# ``mx_hdim_k`` (K from MX): exponent groups per program (session 14: 2 at d64 makes its 8 KB programs 16 KB, as
# d128's; swept by quant14, not yet the default)
MX_K_GROUPS = 1
# K tiles (one exponent group, 128 x D_pad): 4 warps up to 16384 elements (rs_k 94% at d128, against 83% at 8
# warps and 70% at 16), then 8.
K_TILE_4WARPS = 16384

# Tile per kind for experiments (the benchmark's sweeps): {"quant": Tile(128, 8), ...}; K's block_s must
# stay its group.
TILE_OVERRIDES: dict = {}


# V pass 1 from MX (``seqexp`` tiles): at least this many programs (each then loops over several S tiles and issues
# one atomic per channel), at least ``SEQEXP_MIN_TILES`` tiles each, the loop ``SEQEXP_STAGES`` deep (session 14;
# before: 1024 programs, no pipelining, one tile per program allowed).  Before, rs_v_from_mx measured 56% of copy for
# both passes with pass 2 near 90%, which puts this pass near 32%: a serial load -> reduce chain per 8 KB tile, as
# the float pass's was at 1024 programs without pipelining (71%).  Session 15 (both passes, B8 S8192 H16 d128, % of
# moved bytes): 4096 programs / 4 tiles / 2 stages 61.7 / 61.2 % against 55.8 / 55.7 % for the old (1024, 1, 1);
# 4 stages 60.2 %, 3 stages 38.9 %.
SEQEXP_MIN_PROGRAMS = 4096
SEQEXP_MIN_TILES = 4
SEQEXP_STAGES = 2


# V pass 1 on float input (``vexp`` tiles): at least this many programs, and the ``tl.range`` pipelining depth of
# each program's loop over S tiles (cp.async into shared memory).  Measured (B8 S8192 H16 D128 bf16, the pass
# alone): 1024 programs / no pipelining 71% of copy, 4096 / 3 stages 82%, 16384 / none 45%.
VEXP_MIN_PROGRAMS = 4096
VEXP_STAGES = 3
# ... and at least this many S tiles per program (session 14).  Without it a small input got one tile per program
# (B2 H16 S4096 d128: 4096 programs of 8 KB each, the pipelined loop one iteration long, the reductions and the
# atomics paid per 8 KB): 28.8 us for 33.5 MB, 28% of copy.  4 tiles: 1024 programs there (~8 per SM, one wave);
# the bench shape (B8 S8192 H16) keeps its 8 tiles per program.  Session 15 (quant14 sweep, 32 x 128 tiles, 3
# stages, B2 S4096 H16 d128): 1 tile 44.6 us, 2 24.4, 4 33.8, 8 40.6, 16 34.0 (noisy at this size; every
# count >= 2 beat 1); the bench shape 80.5-81.3 % at every count.  4, with the 64 x 128 tile (``VEXP_ELEMS``).
VEXP_MIN_TILES = 4

# The no-grad forward's fused launches (``_ForwardOperandsPlan``, keep_kv False; session 14): which launch K's job
# rides in ("first": with Q and V's exponent pass; "second": with V's quantize pass) and at how many warps (None:
# K's own tile, 4 warps at d128).  A fused launch is compiled for the largest job: K's 128-token tile at 4 warps
# takes 128 registers, which leaves 4 programs of 4 warps per SM for every job of that launch; at 8 warps the launch
# takes 64 registers (4 programs of 8 warps per SM; Q and V's exponent pass on 8-warp tiles).  Session 15, B1 S4096
# H16 d128 (the largest shape that fuses): "first" at 8 warps 66.0 us against 77.9 us at 4 ("second": 121.5 /
# 153.8 us).  At B8, which the public call never fuses, 8 warps measured slower (79 % of copy against 87 %).
FWD_K_LAUNCH = "first"
FWD_K_WARPS: Optional[int] = 8


def _knobs() -> tuple:
    """The module knobs that change a launch (part of every plan cache key)."""
    return (SEQEXP_MIN_PROGRAMS, SEQEXP_MIN_TILES, SEQEXP_STAGES, VEXP_MIN_PROGRAMS, VEXP_STAGES, VEXP_MIN_TILES,
            FWD_K_LAUNCH, FWD_K_WARPS, MX_K_GROUPS, SOFT_ROUND_ON_GPU)


def _seq_chunk(n_rows: int, S: int, block_s: int, min_programs: int = 1024, min_tiles: int = 1) -> int:
    """Tiles of S per program in a V exponent pass: as many as possible (fewer atomics) while the grid
    keeps ``min_programs`` programs (the default is the varlen pass's), at least ``min_tiles``, at most 32."""
    n_tiles = cdiv(S, block_s)
    per = max(1, min_tiles, (n_tiles * n_rows) // min_programs)
    return min(per, n_tiles, 32)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _pow2(e):
    """Exact fp32 2^e for an int32 tensor e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_exponent(amax_bits, RCEIL: tl.constexpr):
    """Shared exponent of blocks whose |x| maximum has fp32 bits ``amax_bits`` (int32, >= 0).

    e = k - 8 (+1 for RCEIL when the mantissa exceeds 1.75), clamped to [-127, 127]; 0 for zero blocks and
    for non-finite blocks (whose data is x / 1).  fp32 subnormal maxima read k = -127: clamped the same."""
    e = (amax_bits >> 23) - (127 + 8)
    if RCEIL:
        e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where((amax_bits == 0) | (amax_bits >= 0x7F800000), 0, e)


@triton.jit
def _round_to_e4m3_grid(y):
    """Saturate fp32 ``y`` to +-448 and round it to the e4m3 grid (nearest even); finite inputs only.

    The grid spacing near |y| is 2^(max(E, -6) - 3); adding c = 2^(max(E, -6) + 20) puts the fp32 ulp
    exactly there, so ``(|y| + c) - c`` is the rounded magnitude (subnormals included).  Sign restored last
    so that -tiny gives -0 like the reference."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    c = (tl.maximum(mag & 0x7F800000, 121 << 23) + (20 << 23)).to(tl.float32, bitcast=True)
    r = (mag.to(tl.float32, bitcast=True) + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(y, SOFT: tl.constexpr):
    """``y`` rounded to e4m3 (RNE, saturated), still in fp32."""
    if SOFT:
        r = _round_to_e4m3_grid(y)
    else:
        r = y.to(tl.float8e4nv).to(tl.float32)
    return r


@triton.jit
def _e4m3_bytes(y, SOFT: tl.constexpr):
    """The e4m3 bytes (uint8) of ``y`` rounded to nearest even and saturated to +-448."""
    if SOFT:
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _row_set_coords(BLOCK_S: tl.constexpr, NDP: tl.constexpr, IDX64: tl.constexpr):
    """Coordinates of a row-set tile: word index w, shape (BLOCK_S/32, 8, 1, 1) (rows s0 + 4w + k, k = 0..3, so
    that one thread holds 4 consecutive tokens of a channel), and channel d, shape (1, 1, NDP, 32): ``_word_coords``
    with all 8 row-set words of each 32-token block in one group."""
    return _word_coords(BLOCK_S, 8, NDP, IDX64)


@triton.jit
def _to_f32(xr):
    """Exact fp32 of a bf16/fp16/fp32 tile; bf16 goes through its bits (the interpreter's bf16 cast drops
    subnormals; on the GPU this is the same shift the cast compiles to)."""
    if xr.dtype == tl.bfloat16:
        f = (xr.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        f = xr.to(tl.float32)
    return f


@triton.jit
def _nan_bytes(xr):
    """0x7F, or 0xFF where the raw input ``xr`` has its sign bit set (what torch makes of -NaN)."""
    if xr.dtype.primitive_bitwidth == 16:
        neg = xr.to(tl.int16, bitcast=True) < 0
    else:
        neg = xr.to(tl.int32, bitcast=True) < 0
    return tl.where(neg, 255, 127).to(tl.uint8)


@triton.jit
def _tile_coords(s0, BLOCK_S: tl.constexpr, NDP: tl.constexpr, IDX64: tl.constexpr):
    """Local token index (BLOCK_S/32, 32, 1, 1) and channel index (1, 1, NDP, 32) of the 4-D tile."""
    sb = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
    si = tl.arange(0, 32)[None, :, None, None]
    db = tl.arange(0, NDP)[None, None, :, None]
    dj = tl.arange(0, 32)[None, None, None, :]
    sl = sb * 32 + si
    d = db * 32 + dj
    if IDX64:
        sl = sl.to(tl.int64)
        d = d.to(tl.int64)
    return sl, d


@triton.jit
def _offs(rows, cols, s_rows, s_cols, UNIT: tl.constexpr):
    """rows * s_rows + cols * s_cols, with the unit stride written as a literal so that the compiler sees
    contiguity (UNIT 1: s_cols == 1, 2: s_rows == 1, 0: neither)."""
    if UNIT == 1:
        o = rows * s_rows + cols
    elif UNIT == 2:
        o = rows + cols * s_cols
    else:
        o = rows * s_rows + cols * s_cols
    return o


@triton.jit
def _load_bytes(ptr, s, S, S_ld, in_d, QU: tl.constexpr):
    """Data bytes at ``ptr`` for tokens ``s``; zero past S.  When S is the unit-stride axis (QU == 2) the
    load runs to S_ld (S rounded up to 16, inside the row padding) so that it vectorizes."""
    if QU == 2:
        qb = tl.load(ptr, mask=(s < S_ld) & in_d, other=0)
        qb = tl.where(s < S, qb, 0).to(tl.uint8)
    else:
        qb = tl.load(ptr, mask=(s < S) & in_d, other=0)
    return qb


@triton.jit
def _split_pid(pid, n_s_tiles, H):
    """Program index -> (b, s tile, h), heads fastest so that neighbouring programs read one token row."""
    h = pid % H
    t = pid // H
    return t // n_s_tiles, t % n_s_tiles, h


@triton.jit
def _pid_bsh(n_s_tiles, H):
    """This program's (b, s tile, h) (``_split_pid`` of its id)."""
    return _split_pid(tl.program_id(0), n_s_tiles, H)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max_bits(xf, axis: tl.constexpr):
    """fp32 bits (int32) of max |xf| along ``axis`` (kept), NaN-propagating: >= 0x7F800000 exactly where the slice
    holds a NaN or an Inf.  One float max per element (``max.NaN`` with the abs folded into its operands), where the
    bits' integer max costs a mask and a max."""
    return tl.reduce(tl.abs(xf), axis, _max_keep_nan, keep_dims=True).to(tl.int32, bitcast=True)


@triton.jit
def _nonzero_block(amax_bits):
    """Whether a block of magnitude maximum ``amax_bits`` quantizes to a nonzero element, from the bits alone.

    Below the -127 clamp of the exponent (amax < 2^-118) the maximum maps to amax * 2^127, which rounds to a nonzero
    e4m3 value iff it exceeds 2^-10 (2^-10 itself ties to 0), i.e. iff amax > 2^-137 (fp32 bits 0x1000); any larger
    block maps to [224, 512).  Non-finite blocks are not nonzero blocks."""
    return (amax_bits > 0x1000) & (amax_bits < 0x7F800000)


# Bytes and words of the outputs.  Each maker has the explicit-rounding path (``SOFT``: plain ``tl``, what the
# interpreter runs) and the hardware path, inline PTX over the cvt instructions: e4m3x2 conversions paired the way the
# bytes are stored, the NaN sign and the packing as one permute and one logic op.  Left to the compiler, the packing
# and sign of each byte took ~5 instructions per element of the ~20 that the seq orientation cost (sm_90a SASS,
# scripts/compile_launched.py quant-bench); the hardware cvt gives 0x7F for any NaN (``y`` is then the canonical
# NaN of the multiply), and the sign is taken from the raw input, as torch keeps it.


@triton.jit
def _sign_byte(xr):
    """0x80 where the raw input ``xr`` has its sign bit set, else 0 (uint8)."""
    if xr.dtype.primitive_bitwidth == 16:
        s = (xr.to(tl.uint16, bitcast=True) >> 8).to(tl.uint8)
    else:
        s = (xr.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)
    return s & 0x80


@triton.jit
def _e4m3_code(r):
    """The e4m3 byte (int32) of an fp32 value on the e4m3 grid (finite, |r| <= 448), by arithmetic on its bits.

    The explicit-rounding paths pack four bytes per word; with cvt instructions there, ptxas 12.8 folds a
    cvt.rn.satfinite.e4m3x2 and the packing ``mov.b32 {lo, hi}`` whose ``hi`` is ``lo >> 8`` and leaves a byte reading
    a register that never holds the conversion (docs/quantize-both-byte3.md; seen again at d256 in
    ``_hdim_rescale_kernel``).  Normal values: exponent field e + 7, the top 3 mantissa bits; subnormal ones
    (k * 2^-9, k < 8): k from the significand."""
    bits = r.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    sub = ((mag & 0x7FFFFF) | 0x800000) >> tl.minimum(tl.maximum(14 - e, 0), 31)
    code = tl.where(e >= -6, ((e + 7) << 3) | ((mag >> 20) & 7), tl.where(mag == 0, 0, sub))
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _soft_e4m3(y):
    """The e4m3 byte (int32) of fp32 ``y`` (finite), rounded to nearest even and saturated, explicitly."""
    return _e4m3_code(_round_to_e4m3_grid(y))


@triton.jit
def _soft_mx_bytes(xr, xf, y):
    """MX data bytes by the explicit rounding: its byte's magnitude, 0x7F for NaN (the rounding does not handle
    NaN), the input's sign (finite and infinite values already carry it: -tiny gives -0, +-Inf saturates)."""
    b = tl.where(xf != xf, 127, _soft_e4m3(tl.where(xf != xf, 0.0, y))).to(tl.uint8)
    return b | _sign_byte(xr)


@triton.jit
def _mx_bytes(xr, xf, y, SOFT: tl.constexpr):
    """MX data bytes of raw inputs ``xr`` (fp32 ``xf``) scaled to ``y = xf * 2^-e``, NaN/Inf included, no branch."""
    if SOFT:
        b = _soft_mx_bytes(xr, xf, y)
    elif xr.dtype.primitive_bitwidth == 16:  # 4 elements: 2 cvt, the 4 sign bytes in one permute
        b = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 s, w; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 w, {lo, hi}; prmt.b32 s, $5, $6, 0x7531; "
            "and.b32 s, s, 0x80808080; or.b32 $0, w, s; }",
            "=r,r,r,r,r,r,r", [y, xr.to(tl.int16, bitcast=True)], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        b = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 s, t, w; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 w, {lo, hi}; prmt.b32 s, $5, $6, 0x73; "
            "prmt.b32 t, $7, $8, 0x73; prmt.b32 s, s, t, 0x5410; and.b32 s, s, 0x80808080; or.b32 $0, w, s; }",
            "=r,r,r,r,r,r,r,r,r", [y, xr.to(tl.int32, bitcast=True)], dtype=tl.uint8, is_pure=True, pack=4)
    return b


@triton.jit
def _rs_shift(e, E):
    """The re-expression shift e - E of a block, clamped to [-20, 0]: from -19 down every e4m3 value rounds to 0."""
    return tl.minimum(tl.maximum(e - E, -20), 0)


@triton.jit
def _rs_bytes(y, e, E, fin, SOFT: tl.constexpr):
    """Row-scaled bytes e4m3(e4m3(y) * 2^(e - E)) of blocks with exponent e (``y`` = x * 2^-e) re-expressed to E;
    0x7F in NaN blocks (``fin`` false).  On the GPU the product is formed in fp16 (e4m3x2 <-> f16x2 are single
    conversions): an e4m3 value times 2^(e - E) >= 2^-20 is exact in fp16 wherever it is >= 2^-14, and below that it
    rounds to 0 in e4m3 either way; NaN blocks multiply by NaN, which converts to 0x7F."""
    m = _pow2(_rs_shift(e, E))
    if SOFT:
        r = tl.where(fin, _soft_e4m3(_round_to_e4m3_grid(tl.where(fin, y, 0.0)) * m), 127).to(tl.uint8)
    else:
        m16 = tl.broadcast_to(tl.where(fin, m, float("nan")).to(tl.float16), y.shape)
        r = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mul.rn.f16x2 a, a, $5; mul.rn.f16x2 b, b, $6; cvt.rn.satfinite.e4m3x2.f16x2 lo, a; "
            "cvt.rn.satfinite.e4m3x2.f16x2 hi, b; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r,r,r", [y, m16], dtype=tl.uint8, is_pure=True, pack=4)
    return r


@triton.jit
def _pack_words(b0, b1, b2, b3):
    """Four byte tensors (tokens 4w .. 4w+3 of a channel) as the int32 words of the channel-major row."""
    return b0.to(tl.int32) | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16) | (b3.to(tl.int32) << 24)


@triton.jit
def _mx_word(y0, y1, y2, y3, r0, r1, r2, r3, x0, x1, x2, x3, SOFT: tl.constexpr):
    """One channel-major word of MX bytes: tokens 4w + k scaled to ``y_k`` (raw ``r_k``, fp32 ``x_k``)."""
    if SOFT:
        wd = _pack_words(_soft_mx_bytes(r0, x0, y0), _soft_mx_bytes(r1, x1, y1), _soft_mx_bytes(r2, x2, y2),
                         _soft_mx_bytes(r3, x3, y3))
    elif r0.dtype.primitive_bitwidth == 16:
        wd = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 s, t, w; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 w, {lo, hi}; mov.b32 s, {$5, $6}; "
            "mov.b32 t, {$7, $8}; prmt.b32 s, s, t, 0x7531; and.b32 s, s, 0x80808080; or.b32 $0, w, s; }",
            "=r,r,r,r,r,h,h,h,h", [y0, y1, y2, y3, r0.to(tl.int16, bitcast=True), r1.to(tl.int16, bitcast=True),
                                   r2.to(tl.int16, bitcast=True), r3.to(tl.int16, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        wd = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 s, t, w; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 w, {lo, hi}; prmt.b32 s, $5, $6, 0x73; "
            "prmt.b32 t, $7, $8, 0x73; prmt.b32 s, s, t, 0x5410; and.b32 s, s, 0x80808080; or.b32 $0, w, s; }",
            "=r,r,r,r,r,r,r,r,r", [y0, y1, y2, y3, r0.to(tl.int32, bitcast=True), r1.to(tl.int32, bitcast=True),
                                   r2.to(tl.int32, bitcast=True), r3.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1)
    return wd


@triton.jit
def _rs_word(y0, y1, y2, y3, e, E, SOFT: tl.constexpr):
    """One channel-major word of row-scaled bytes (``_rs_bytes`` of tokens 4w + k, finite blocks)."""
    m = _pow2(_rs_shift(e, E))
    if SOFT:  # (NaN blocks are replaced by the caller; their bytes here are whatever the rounding makes)
        wd = _pack_words(_soft_e4m3(_round_to_e4m3_grid(y0) * m), _soft_e4m3(_round_to_e4m3_grid(y1) * m),
                         _soft_e4m3(_round_to_e4m3_grid(y2) * m), _soft_e4m3(_round_to_e4m3_grid(y3) * m))
    else:
        m16 = tl.broadcast_to(m.to(tl.float16), y0.shape)
        wd = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b, m; mov.b32 m, {$5, $5}; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mul.rn.f16x2 a, a, m; mul.rn.f16x2 b, b, m; cvt.rn.satfinite.e4m3x2.f16x2 lo, a; "
            "cvt.rn.satfinite.e4m3x2.f16x2 hi, b; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r,h", [y0, y1, y2, y3, m16], dtype=tl.int32, is_pure=True, pack=1)
    return wd


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(xp, sxs, q4, k: tl.constexpr, s0, S, d, in_d):
    """Rows s0 + q4 + k of the tile (q4 = 4 * word index): raw values, fp32, magnitude bits."""
    xr = tl.load(xp + (q4 + k) * sxs + d, mask=(s0 + q4 + k < S) & in_d, other=0.0)
    xf = _to_f32(xr)
    return xr, xf, xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _hdim_mx(xr, xf, mag, bad, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """MX bytes and scale bytes of rows blocked along D (axis 3)."""
    amax = tl.max(mag, axis=3, keep_dims=True)
    e = _mx_exponent(amax, RCEIL)
    out = _e4m3_bytes(xf * _pow2(-e), SOFT)
    if bad:
        out = tl.where(mag > 0x7F800000, _nan_bytes(xr), out)
    sc = tl.where(amax < 0x7F800000, e + 127, 255).to(tl.uint8)
    return out, sc


@triton.jit
def _hdim_rows(xf, mag, RCEIL: tl.constexpr, SOFT: tl.constexpr):
    """Blocks along D: quantized values q (fp32), exponents e, finiteness, and e where the block is nonzero."""
    amax = tl.max(mag, axis=3, keep_dims=True)
    fin = amax < 0x7F800000
    e = _mx_exponent(amax, RCEIL)
    q = _e4m3_value(xf * _pow2(-e), SOFT)
    # a block holds a nonzero element iff its maximum quantizes to nonzero
    nz = fin & (_round_to_e4m3_grid(amax.to(tl.float32, bitcast=True) * _pow2(-e)) != 0.0)
    return q, e, fin, tl.where(nz, e, _NO_EXP)


@triton.jit
def _reexpress(q, e, E, fin, bad, SOFT: tl.constexpr):
    """Bytes of q * 2^(e - E) (e <= E for nonzero blocks; shifts <= -19 round everything to 0)."""
    out = _e4m3_bytes(q * _pow2(tl.minimum(tl.maximum(e - E, -31), 0)), SOFT)
    if bad:
        out = tl.where(fin, out, 127).to(tl.uint8)  # NaN blocks
    return out


@triton.jit
def _seq_bytes(xr, xf, mag, e, E, fin, keep, SEQ_RS: tl.constexpr, SOFT: tl.constexpr):
    """Bytes (int32 0..255) of rows blocked along S: MX (``SEQ_RS`` False) or re-expressed to E.

    No ``if bad:`` branch here (unlike ``_hdim_mx`` / ``_reexpress``): the NaN patch is a select on every
    tile.  With the branch, LLVM carried the bytes through the branch's phi as <2 x i16> pairs
    {cvt, cvt >> 8} of one e4m3x2 conversion; ptxas 12.8 (triton 3.6's) folds such a pair into one
    F2FP.PACK_AB_MERGE_C and leaves the `>> 8` reading a register that never holds the conversion, so on the
    H200 byte 3 of the V words (tokens 4w+3) at 5 channels in 16 came out as a constant garbage byte in the
    fused K+V pass (docs/quantize-both-byte3.md).  Every tile pays one select per byte instead."""
    y = xf * _pow2(-e)
    if SEQ_RS:
        out = _e4m3_bytes(_e4m3_value(y, SOFT) * _pow2(tl.minimum(tl.maximum(e - E, -31), 0)), SOFT).to(tl.int32)
        out = tl.where(fin | keep, out, 127)  # NaN blocks; `keep` = padding stays 0
    else:
        out = _e4m3_bytes(y, SOFT).to(tl.int32)
        out = tl.where(mag > 0x7F800000, _nan_bytes(xr).to(tl.int32), out)
    return out


@triton.jit
def _tiled_offset(r, c, n_col_tiles):
    """Byte offset of scale (r, c) in a 128x4-tiled scale matrix of ``n_col_tiles`` column tiles
    (``formats.to_blackwell_scale_layout``)."""
    return ((r // 128) * n_col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@triton.jit
def _hdim_kernel(
    x_ptr, S, H, sxb, sxs, sxh, hd_ptr, he_ptr, n_s_tiles, n_groups,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr, RCEIL: tl.constexpr,
    SOFT: tl.constexpr, IDX64: tl.constexpr, SWZ: tl.constexpr,
):
    """One ``_hdim_tile`` per program (the arguments are documented there)."""
    _hdim_tile(tl.program_id(0), x_ptr, S, H, sxb, sxs, sxh, hd_ptr, he_ptr, n_s_tiles, n_groups,
               D, NDP, BLOCK_S, GROUP, RCEIL, SOFT, IDX64, SWZ)


@triton.jit
def _hdim_tile(
    pid,  # the tile: (b, s tile, h) = _split_pid(pid, n_s_tiles, H)
    x_ptr, S, H, sxb, sxs, sxh,  # input (B, S, H, D), unit stride along D; the launcher passes a tensor whose
    #                              (b, s, h) rows are evenly spaced as (1, B*S*H, 1, D), so that a tile is one run of rows
    hd_ptr,  # data (B, S, H, D) u8, contiguous
    he_ptr,  # GROUP 0: MX scales u8 (B, S, H, ND) (SWZ: 128x4-tiled per (b, h)); 1: exponents i32 (B, S, H, 1);
    #          > 1: exponents i32 (B, n_groups, H, 1)
    n_s_tiles, n_groups,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,  # 0: MX scales; 1: Q (one exponent per row); > 1: K (one per tile; BLOCK_S == GROUP)
    RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr, SWZ: tl.constexpr,
):
    """Quantize BLOCK_S tokens x D channels of one (b, h) along D: blocks are the tile's last axis.

    The tile is (BLOCK_S, NDP, 32): the block maximum is a reduction over the last axis (4 lanes of 8 elements at
    d128), so loads and data stores are 16-byte vectors and nothing goes through shared memory but the Q/K row and
    group maxima.  NaN/Inf need no branch: the scale byte comes from the NaN-propagating block maximum, the data byte
    from ``_mx_bytes`` (MX) or a select of 0x7F (NaN blocks of the row-scaled operands)."""
    b, st, h = _split_pid(pid, n_s_tiles, H)
    s0 = st * BLOCK_S
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    i = tl.arange(0, BLOCK_S)[:, None, None]
    db = tl.arange(0, NDP)[None, :, None]
    d = db * 32 + tl.arange(0, 32)[None, None, :]
    if IDX64:
        i = i.to(tl.int64)
        d = d.to(tl.int64)
    ND: tl.constexpr = (D + 31) // 32
    in_s = i < S - s0
    in_d = d < D
    xr = tl.load(x_ptr + (b64 * sxb + s0.to(tl.int64) * sxs + h64 * sxh) + i * sxs + d, mask=in_s & in_d, other=0.0)
    xf = _to_f32(xr)
    amax = _abs_max_bits(xf, 2)  # (BLOCK_S, NDP, 1)
    e = _mx_exponent(amax, RCEIL)
    y = xf * _pow2(-e)
    row = (b64 * S + s0) * H + h64  # output row of (b, s0, h) in (B, S, H)
    ri = i * H  # rows of the tile's tokens, relative to row
    if GROUP == 0:
        tl.store(hd_ptr + row * D + (ri * D + d), _mx_bytes(xr, xf, y, SOFT), mask=in_s & in_d)
        sc = tl.where(amax < 0x7F800000, e + 127, 255).to(tl.uint8)
        if SWZ:  # scale matrix (S tokens, ND blocks) of this (b, h), tiled
            NCT: tl.constexpr = (ND + 3) // 4
            ht = he_ptr + (b64 * H + h64) * (tl.cdiv(S, 128) * NCT * 512)
            tl.store(ht + _tiled_offset(s0 + i, db, NCT), sc, mask=in_s & (db < ND))
        else:
            tl.store(he_ptr + row * ND + (ri * ND + db), sc, mask=in_s & (db < ND))
    else:
        en = tl.where(_nonzero_block(amax), e, _NO_EXP)
        if GROUP == 1:
            E = tl.max(en, axis=1, keep_dims=True)  # (BLOCK_S, 1, 1)
        else:
            E = tl.max(en)
        E = tl.where(E == _NO_EXP, 0, E)
        tl.store(hd_ptr + row * D + (ri * D + d), _rs_bytes(y, e, E, amax < 0x7F800000, SOFT), mask=in_s & in_d)
        if GROUP == 1:
            tl.store(he_ptr + row + ri, E, mask=in_s)
        else:
            tl.store(he_ptr + (b64 * n_groups + st) * H + h64, E)


@triton.jit
def _quantize_kernel(
    x_ptr, S, H, sxb, sxs, sxh, hd_ptr, he_ptr, cw_ptr, ce_ptr, S_pad, NSB, n_s_tiles, n_groups,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, HDIM: tl.constexpr, SEQ: tl.constexpr,
    HDIM_GROUP: tl.constexpr, SEQ_RS: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    SWZ: tl.constexpr = False, EVEN: tl.constexpr = False, J: tl.constexpr = 1,
):
    """One ``_quantize_tile`` per program (the arguments are documented there)."""
    _quantize_tile(tl.program_id(0), x_ptr, S, H, sxb, sxs, sxh, hd_ptr, he_ptr, cw_ptr, ce_ptr, S_pad, NSB,
                   n_s_tiles, n_groups, D, NDP, BLOCK_S, HDIM, SEQ, HDIM_GROUP, SEQ_RS, RCEIL, SOFT, IDX64, SWZ, EVEN,
                   J)


@triton.jit
def _row_set(xp, sxs, q4, k: tl.constexpr, s0, S, d, in_d, EVEN: tl.constexpr):
    """Rows s0 + q4 + k of the tile (q4 = 4 * word index): raw values and fp32.  ``EVEN``: every row exists."""
    if EVEN:
        xr = tl.load(xp + (q4 + k) * sxs + d, mask=in_d, other=0.0)
    else:
        xr = tl.load(xp + (q4 + k) * sxs + d, mask=(s0 + q4 + k < S) & in_d, other=0.0)
    return xr, _to_f32(xr)


@triton.jit
def _hdim_row_set(xf, RCEIL: tl.constexpr):
    """Per block along D (axis 3) of one row set: magnitude-maximum bits and exponent."""
    amax = _abs_max_bits(xf, 3)
    return amax, _mx_exponent(amax, RCEIL)


@triton.jit
def _store_hdim_mx(hd, hs, ht, q4, k: tl.constexpr, s0, S, in_d, db, msc, H, D, ND, NCT, xr, xf, RCEIL: tl.constexpr,
                   SOFT: tl.constexpr, SWZ: tl.constexpr, EVEN: tl.constexpr):
    """MX data and scale bytes of row set k, blocked along D."""
    amax, e = _hdim_row_set(xf, RCEIL)
    y = xf * _pow2(-e)
    sc = tl.where(amax < 0x7F800000, e + 127, 255).to(tl.uint8)
    rows = q4 + k
    ok = s0 + rows < S
    _store_rows(hd + rows * (H * D), _mx_bytes(xr, xf, y, SOFT), ok, in_d, EVEN)
    if SWZ:
        _store_rows(ht + _tiled_offset(s0 + rows, db, NCT), sc, ok, msc, EVEN)
    else:
        _store_rows(hs + rows * (H * ND), sc, ok, msc, EVEN)


@triton.jit
def _store_rows(ptr, val, row_ok, col_ok, EVEN: tl.constexpr):
    """``tl.store`` masked to ``row_ok & col_ok``, or to ``col_ok`` alone when every row exists (``EVEN``)."""
    if EVEN:
        tl.store(ptr, val, mask=col_ok)
    else:
        tl.store(ptr, val, mask=row_ok & col_ok)


@triton.jit
def _word_coords(BLOCK_S: tl.constexpr, W: tl.constexpr, NDP: tl.constexpr, IDX64: tl.constexpr):
    """Word index w of the first group of row sets, shape (BLOCK_S/32, W, 1, 1) (the words 8 * block + 0..W-1; the
    tile holds 8 / W such groups, group j at words w + j * W), and channel d, shape (1, 1, NDP, 32)."""
    w = tl.arange(0, BLOCK_S // 32)[:, None, None, None] * 8 + tl.arange(0, W)[None, :, None, None]
    d = tl.arange(0, NDP)[None, None, :, None] * 32 + tl.arange(0, 32)[None, None, None, :]
    if IDX64:
        w = w.to(tl.int64)
        d = d.to(tl.int64)
    return w, d


@triton.jit
def _max4(a, b, c, d):
    """max(|a|, |b|, |c|, |d|), NaN-propagating."""
    n: tl.constexpr = tl.PropagateNan.ALL
    return tl.maximum(tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=n), tl.maximum(tl.abs(c), tl.abs(d),
                                                                                      propagate_nan=n), propagate_nan=n)


@triton.jit
def _k_group_exp(a0, e0, a1, e1, a2, e2, a3, e3):
    """Per block position, the largest exponent among four row sets' nonzero blocks along D (``_NO_EXP`` if none);
    the caller reduces it once over the tile."""
    return tl.maximum(tl.maximum(tl.where(_nonzero_block(a0), e0, _NO_EXP), tl.where(_nonzero_block(a1), e1, _NO_EXP)),
                      tl.maximum(tl.where(_nonzero_block(a2), e2, _NO_EXP), tl.where(_nonzero_block(a3), e3, _NO_EXP)))


@triton.jit
def _store_k_rows(hd, rows, s0, S, in_d, H, D, a, e, xf, E, SOFT: tl.constexpr, EVEN: tl.constexpr):
    """Row-scaled bytes (K layout: exponent E for the tile) of one row set (fp32 ``xf``) blocked along D."""
    _store_rows(hd + rows * (H * D), _rs_bytes(xf * _pow2(-e), e, E, a < 0x7F800000, SOFT), s0 + rows < S, in_d, EVEN)


@triton.jit
def _seq_word(x0r, x0, x1r, x1, x2r, x2, x3r, x3, p, e, E, fin, n_real, SEQ_RS: tl.constexpr, SOFT: tl.constexpr,
              EVEN: tl.constexpr):
    """The channel-major word of four row sets (tokens 4w + k) blocked along S (multiplier ``p`` = 2^-e): MX bytes, or
    re-expressed to the channel's E with 0x7F in NaN blocks for the real tokens (``n_real`` of the word's 4)."""
    if SEQ_RS:
        wd = _rs_word(x0 * p, x1 * p, x2 * p, x3 * p, e, E, SOFT)
        if EVEN:
            nan_word = 0x7F7F7F7F
        else:  # the padding past S stays 0
            nan_word = tl.where(n_real <= 0, 0, 0x7F7F7F7F >> (32 - 8 * tl.minimum(n_real, 4)))
        wd = tl.where(fin, wd, nan_word)
    else:
        wd = _mx_word(x0 * p, x1 * p, x2 * p, x3 * p, x0r, x1r, x2r, x3r, x0, x1, x2, x3, SOFT)
    return wd


@triton.jit
def _quantize_tile(
    pid,  # the tile: (b, s tile, h) = _split_pid(pid, n_s_tiles, H)
    x_ptr, S, H, sxb, sxs, sxh,  # input (B, S, H, D), unit stride along D
    hd_ptr, he_ptr,  # hdim data (B, S, H, D) u8; hdim scales u8 (B, S, H, ND) or exponents i32 (K)
    cw_ptr, ce_ptr,  # seq data: channel-major (B, H, D, S_pad) as int32 words; seq scales u8 (B, NSB, H, D) or V exps
    S_pad, NSB, n_s_tiles, n_groups,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    HDIM: tl.constexpr, SEQ: tl.constexpr,
    HDIM_GROUP: tl.constexpr,  # 0: MX scales; >1: K (exponent per tile = group); Q's layout is _hdim_tile's alone
    SEQ_RS: tl.constexpr,  # False: MX scales; True: V, re-expressed to the per-channel exponents in ce_ptr
    RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    SWZ: tl.constexpr,  # MX scales in the 128x4-tiled layout of Blackwell MMA, per (b, h) (he_ptr, ce_ptr)
    EVEN: tl.constexpr = False,  # every token of every tile exists (S % BLOCK_S == 0 == S_pad - S): no row masks
    J: tl.constexpr = 1,  # groups of four row sets: a thread holds 4 * J tokens of each seq block it touches
):
    """Quantize BLOCK_S tokens x D channels of one (b, h), along S (and along D too when HDIM).

    The tile is read as row sets: group j (of J) is four row sets, rows s0 + 4 (w + j W) + k for k = 0..3
    (w = word index, shape (BLOCK_S/32, W = 8/J, 1, 1); channels d, shape (1, 1, NDP, 32)).  The same thread then holds 4 consecutive tokens of a channel in each group, so the four
    seq-orientation bytes pack into one int32 word of the channel-major row before the transposing store (a 4-byte
    transpose instead of a byte transpose), and with J = 2 it holds 8 tokens of each seq block: the block's exponent
    work and its cross-lane maximum are shared by twice as many elements.  Maxima are NaN-propagating float maxima
    of |x| (``_abs_max_bits``), so no branch is needed for NaN/Inf: MX data bytes take the input's sign
    (``_mx_bytes``, ``_mx_word``), NaN blocks of the row-scaled layouts are one select per word or byte."""
    W: tl.constexpr = 8 // J
    b, st, h = _split_pid(pid, n_s_tiles, H)
    s0 = st * BLOCK_S
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    w, d = _word_coords(BLOCK_S, W, NDP, IDX64)
    q4 = w * 4
    in_d = d < D
    ND: tl.constexpr = (D + 31) // 32
    G1: tl.constexpr = 4 * W  # first row of group 1, relative to q4

    xp = x_ptr + b64 * sxb + s0.to(tl.int64) * sxs + h64 * sxh
    x0r, x0 = _row_set(xp, sxs, q4, 0, s0, S, d, in_d, EVEN)
    x1r, x1 = _row_set(xp, sxs, q4, 1, s0, S, d, in_d, EVEN)
    x2r, x2 = _row_set(xp, sxs, q4, 2, s0, S, d, in_d, EVEN)
    x3r, x3 = _row_set(xp, sxs, q4, 3, s0, S, d, in_d, EVEN)
    if J == 2:
        x4r, x4 = _row_set(xp, sxs, q4, G1, s0, S, d, in_d, EVEN)
        x5r, x5 = _row_set(xp, sxs, q4, G1 + 1, s0, S, d, in_d, EVEN)
        x6r, x6 = _row_set(xp, sxs, q4, G1 + 2, s0, S, d, in_d, EVEN)
        x7r, x7 = _row_set(xp, sxs, q4, G1 + 3, s0, S, d, in_d, EVEN)

    if HDIM:
        hrow = (b64 * S + s0) * H + h64  # row of (b, s0, h) in (B, S, H)
        hd = hd_ptr + hrow * D + d
        if HDIM_GROUP == 0:
            db = tl.arange(0, NDP)[None, None, :, None]
            NCT: tl.constexpr = (ND + 3) // 4
            ht = he_ptr + (b64 * H + h64) * (tl.cdiv(S, 128) * NCT * 512)  # SWZ: scale matrix of this (b, h)
            hs = he_ptr + hrow * ND + db
            msc = db < ND
            _store_hdim_mx(hd, hs, ht, q4, 0, s0, S, in_d, db, msc, H, D, ND, NCT, x0r, x0, RCEIL, SOFT, SWZ, EVEN)
            _store_hdim_mx(hd, hs, ht, q4, 1, s0, S, in_d, db, msc, H, D, ND, NCT, x1r, x1, RCEIL, SOFT, SWZ, EVEN)
            _store_hdim_mx(hd, hs, ht, q4, 2, s0, S, in_d, db, msc, H, D, ND, NCT, x2r, x2, RCEIL, SOFT, SWZ, EVEN)
            _store_hdim_mx(hd, hs, ht, q4, 3, s0, S, in_d, db, msc, H, D, ND, NCT, x3r, x3, RCEIL, SOFT, SWZ, EVEN)
            if J == 2:
                _store_hdim_mx(hd, hs, ht, q4, G1, s0, S, in_d, db, msc, H, D, ND, NCT, x4r, x4, RCEIL, SOFT, SWZ,
                               EVEN)
                _store_hdim_mx(hd, hs, ht, q4, G1 + 1, s0, S, in_d, db, msc, H, D, ND, NCT, x5r, x5, RCEIL, SOFT, SWZ,
                               EVEN)
                _store_hdim_mx(hd, hs, ht, q4, G1 + 2, s0, S, in_d, db, msc, H, D, ND, NCT, x6r, x6, RCEIL, SOFT, SWZ,
                               EVEN)
                _store_hdim_mx(hd, hs, ht, q4, G1 + 3, s0, S, in_d, db, msc, H, D, ND, NCT, x7r, x7, RCEIL, SOFT, SWZ,
                               EVEN)
        else:  # K layout: the tile is the group
            a0, e0 = _hdim_row_set(x0, RCEIL)
            a1, e1 = _hdim_row_set(x1, RCEIL)
            a2, e2 = _hdim_row_set(x2, RCEIL)
            a3, e3 = _hdim_row_set(x3, RCEIL)
            en = _k_group_exp(a0, e0, a1, e1, a2, e2, a3, e3)
            if J == 2:
                a4, e4 = _hdim_row_set(x4, RCEIL)
                a5, e5 = _hdim_row_set(x5, RCEIL)
                a6, e6 = _hdim_row_set(x6, RCEIL)
                a7, e7 = _hdim_row_set(x7, RCEIL)
                en = tl.maximum(en, _k_group_exp(a4, e4, a5, e5, a6, e6, a7, e7))
            E = tl.max(en)
            E = tl.where(E == _NO_EXP, 0, E)
            tl.store(he_ptr + (b64 * n_groups + st) * H + h64, E)
            _store_k_rows(hd, q4, s0, S, in_d, H, D, a0, e0, x0, E, SOFT, EVEN)
            _store_k_rows(hd, q4 + 1, s0, S, in_d, H, D, a1, e1, x1, E, SOFT, EVEN)
            _store_k_rows(hd, q4 + 2, s0, S, in_d, H, D, a2, e2, x2, E, SOFT, EVEN)
            _store_k_rows(hd, q4 + 3, s0, S, in_d, H, D, a3, e3, x3, E, SOFT, EVEN)
            if J == 2:
                _store_k_rows(hd, q4 + G1, s0, S, in_d, H, D, a4, e4, x4, E, SOFT, EVEN)
                _store_k_rows(hd, q4 + G1 + 1, s0, S, in_d, H, D, a5, e5, x5, E, SOFT, EVEN)
                _store_k_rows(hd, q4 + G1 + 2, s0, S, in_d, H, D, a6, e6, x6, E, SOFT, EVEN)
                _store_k_rows(hd, q4 + G1 + 3, s0, S, in_d, H, D, a7, e7, x7, E, SOFT, EVEN)

    if SEQ:
        mall = _max4(x0, x1, x2, x3)
        if J == 2:
            mall = tl.maximum(mall, _max4(x4, x5, x6, x7), propagate_nan=tl.PropagateNan.ALL)
        amax = _abs_max_bits(mall, 1)  # (BS/32, 1, NDP, 32): one per 32 tokens and channel
        fin = amax < 0x7F800000
        e = _mx_exponent(amax, RCEIL)
        p = _pow2(-e)
        E = e
        if SEQ_RS:
            ep = ce_ptr + (b64 * H + h64) * D + d
            if st == 0:  # the sentinel becomes 0 (readers map both the same way)
                E0 = tl.load(ep, mask=in_d, other=0)
                tl.store(ep, tl.where(E0 == _NO_EXP, 0, E0), mask=in_d)
            # loaded at every word of the tile (the same 4 bytes per channel, from L1): a load of the tile's shape
            # takes the tile's layout, where a (1, 1, NDP, 32) load made the compiler move the loaded rows into its
            # layout through shared memory, one 2-byte access per element
            E = tl.load(ep + w * 0, mask=in_d, other=0)
            E = tl.where(E == _NO_EXP, 0, E)
        else:
            sbk = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
            sc = tl.where(fin, e + 127, 255).to(tl.uint8)
            if SWZ:  # scale matrix (D channels, NSB blocks) of this (b, h), tiled
                NCTS = tl.cdiv(NSB, 4)
                st_base = ce_ptr + (b64 * H + h64) * (((D + 127) // 128) * NCTS * 512)
                sp = st_base + _tiled_offset(d, st * (BLOCK_S // 32) + sbk, NCTS)
                tl.store(sp, sc, mask=(st * (BLOCK_S // 32) + sbk < NSB) & in_d)
            else:
                sbase = ce_ptr + ((b64 * NSB + st * (BLOCK_S // 32)) * H + h64) * D
                tl.store(sbase + sbk * (H * D) + d, sc, mask=(st * (BLOCK_S // 32) + sbk < NSB) & in_d)
        row_w = S_pad // 4  # int32 words per channel-major row
        cp = cw_ptr + (b64 * H + h64) * D * row_w + st * (BLOCK_S // 4) + d * row_w + w
        wo = st * (BLOCK_S // 4) + w  # word of the row (the mask keeps 16-byte stores: row_w % 4 == 0)
        wd = _seq_word(x0r, x0, x1r, x1, x2r, x2, x3r, x3, p, e, E, fin, S - (s0 + q4), SEQ_RS, SOFT, EVEN)
        _store_rows(cp, wd, wo < row_w, in_d, EVEN)
        if J == 2:
            wd = _seq_word(x4r, x4, x5r, x5, x6r, x6, x7r, x7, p, e, E, fin, S - (s0 + q4 + G1), SEQ_RS, SOFT, EVEN)
            _store_rows(cp + W, wd, wo + W < row_w, in_d, EVEN)


@triton.jit
def _seq_exponent_kernel(
    x_ptr, S, H, sxb, sxs, sxh, sxd, sc_ptr, scb, scs, sch, scd, exp_ptr, n_s_tiles, tiles_per_prog, S_ld,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    FROM_MX: tl.constexpr, RCEIL: tl.constexpr, IDX64: tl.constexpr, QU: tl.constexpr, SU: tl.constexpr,
    STAGES: tl.constexpr = 1,
):
    """One ``_seq_exponent_tile`` per program (the arguments are documented there)."""
    _seq_exponent_tile(tl.program_id(0), x_ptr, S, H, sxb, sxs, sxh, sxd, sc_ptr, scb, scs, sch, scd, exp_ptr,
                       n_s_tiles, tiles_per_prog, S_ld, D, NDP, BLOCK_S, FROM_MX, RCEIL, IDX64, QU, SU, STAGES)


@triton.jit
def _seq_exponent_tile(
    pid,  # the program's chunk: (b, chunk, h) = _split_pid(pid, n_chunks, H)
    x_ptr, S, H, sxb, sxs, sxh, sxd,  # float input, or MX data bytes (any strides) when FROM_MX
    sc_ptr, scb, scs, sch, scd,  # MX scale bytes (B, NSB, H, D) when FROM_MX
    exp_ptr,  # int32 (B, 1, H, D), pre-filled with _NO_EXP; receives the max exponent of nonzero blocks
    n_s_tiles, tiles_per_prog, S_ld,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    FROM_MX: tl.constexpr, RCEIL: tl.constexpr, IDX64: tl.constexpr, QU: tl.constexpr, SU: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the loop over S tiles (``tl.range``)
):
    """Pass 1 of V: per channel, the largest exponent among the seq blocks that hold a nonzero element."""
    n_chunks = tl.cdiv(n_s_tiles, tiles_per_prog)
    b, ch, h = _split_pid(pid, n_chunks, H)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    sl, d = _tile_coords(0, BLOCK_S, NDP, IDX64)
    in_d = d < D
    t0 = ch * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, n_s_tiles)
    if FROM_MX:
        acc = tl.full((1, 1, NDP, 32), _NO_EXP, tl.int32)
        for t in tl.range(t0, t1, num_stages=STAGES):
            s0 = t * BLOCK_S
            xp = x_ptr + b64 * sxb + s0.to(tl.int64) * sxs + h64 * sxh
            qb = _load_bytes(xp + _offs(sl, d, sxs, sxd, QU), s0 + sl, S, S_ld, in_d, QU)
            anyq = tl.max(qb & 0x7F, axis=1, keep_dims=True) != 0
            sbk = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
            sp = sc_ptr + b64 * scb + (s0 // 32).to(tl.int64) * scs + h64 * sch
            sbyte = tl.load(sp + _offs(sbk, d, scs, scd, SU), mask=(s0 + sbk * 32 < S) & in_d, other=_SCALE_NAN)
            sbyte = sbyte.to(tl.int32)
            eb = tl.where(anyq & (sbyte != 255), sbyte - 127, _NO_EXP)
            acc = tl.maximum(acc, tl.max(eb, axis=0, keep_dims=True))
        tl.atomic_max(exp_ptr + (b64 * H + h64) * D + d, acc, mask=in_d, sem="relaxed")
    else:
        # The largest exponent of a channel's nonzero blocks is the exponent of its largest finite block maximum
        # (the exponent is monotone in the maximum, and a block is nonzero iff its maximum passes a threshold,
        # ``_nonzero_block``), so the loop keeps only a running element-wise maximum: one float max per element, no
        # reduction, no exponent work.  Only where that maximum is NaN/Inf must non-finite blocks be left out: then
        # the chunk is read again block by block (a chunk holding a NaN or an Inf only).
        xp = x_ptr + b64 * sxb + h64 * sxh
        i = tl.arange(0, BLOCK_S)[:, None]
        if IDX64:
            i = i.to(tl.int64)
        c = tl.arange(0, NDP * 32)
        # a 2-D tile (the loop needs no seq blocks) in the input's dtype: the maximum of |x| is exact in it, and
        # for 16-bit inputs it is one packed max.NaN per 2 elements
        run = tl.zeros((BLOCK_S, NDP * 32), x_ptr.dtype.element_ty)
        for t in tl.range(t0, t1, num_stages=STAGES):
            s0 = t * BLOCK_S
            xr = tl.load(xp + s0.to(tl.int64) * sxs + i * sxs + c[None, :], mask=(s0 + i < S) & (c[None, :] < D),
                         other=0.0)
            run = tl.maximum(run, tl.abs(xr), propagate_nan=tl.PropagateNan.ALL).to(xr.dtype)
        cm = tl.reduce(_to_f32(run), 0, _max_keep_nan).to(tl.int32, bitcast=True)  # (D_pad,): channel maxima bits
        if tl.max(cm) >= 0x7F800000:  # the chunk again, one seq block at a time, its non-finite blocks left out
            j = tl.arange(0, 32)[:, None]
            cm = tl.zeros((NDP * 32,), tl.int32)
            for blk in range(t0 * (BLOCK_S // 32), t1 * (BLOCK_S // 32)):
                s0 = blk * 32
                xr = tl.load(xp + s0.to(tl.int64) * sxs + j * sxs + c[None, :], mask=(s0 + j < S) & (c[None, :] < D),
                             other=0.0)
                bm = tl.reduce(tl.abs(_to_f32(xr)), 0, _max_keep_nan).to(tl.int32, bitcast=True)
                cm = tl.maximum(cm, tl.where(bm < 0x7F800000, bm, 0))
        e = tl.where(_nonzero_block(cm), _mx_exponent(cm, RCEIL), _NO_EXP)
        tl.atomic_max(exp_ptr + (b64 * H + h64) * D + c, e, mask=c < D, sem="relaxed")


@triton.jit
def _mx_channel_exponent_kernel(
    q_ptr, sqb, sqs, sqh, sqd,  # MX data bytes (B, S, H, D), blocked along S, any strides
    sc_ptr, scb, scs, sch, scd,  # their scale bytes (B, NSB, H, D)
    exp_ptr,  # int32 (B, 1, H, D) contiguous: each program writes its channels (no atomics, no pre-fill)
    S, S_ld, H, NSB, n_cg,
    D: tl.constexpr, CG: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr,
    QU: tl.constexpr, SU: tl.constexpr, IDX64: tl.constexpr,
):
    """Pass 1 of V from MX, scales first: per channel, the largest exponent among the seq blocks that hold a nonzero
    element, for one (b, h) pair and CG channels over the whole sequence.

    The largest finite scale byte of a channel is its answer unless every block carrying it holds only zero bytes
    (impossible for data an MX quantizer made: a block's maximum maps to at least 2^7 of its scale, RCEIL or FLOOR).
    So the program reads the channel's NSB scale bytes (1/32 of the data), then the 32 data bytes of the first block
    holding the largest one; only if those are all zero (an MXTensor assembled by hand) does it read the channels
    concerned in full, block by block, as the data-first pass did.  NaN scales (255) are no candidates; NaN data
    bytes count as nonzero (``to_row_scaled``: ``data != 0``)."""
    pid = tl.program_id(0)
    g = pid % n_cg
    t = pid // n_cg
    h = t % H
    b = t // H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    d = g * CG + tl.arange(0, CG)  # (CG,)
    in_d = d < D
    if IDX64:
        d = d.to(tl.int64)
    sp = sc_ptr + b64 * scb + h64 * sch
    qp = q_ptr + b64 * sqb + h64 * sqh
    # the largest finite scale byte per channel (-1: none) and the first block holding it
    kb = tl.arange(0, SB)[:, None]
    best = tl.full((CG,), -1, tl.int32)
    first = tl.zeros((CG,), tl.int32)
    for k0 in range(0, NSB, SB):
        blk = k0 + kb
        if IDX64:
            blk = blk.to(tl.int64)
        sbyte = tl.load(sp + _offs(blk, d[None, :], scs, scd, SU), mask=(blk < NSB) & in_d[None, :], other=255)
        fin = tl.where(sbyte != 255, sbyte.to(tl.int32), -1)
        tmax = tl.max(fin, axis=0)
        targ = tl.min(tl.where(fin == tmax[None, :], blk.to(tl.int32), 2147483647), axis=0)
        first = tl.where(tmax > best, targ, first)
        best = tl.maximum(best, tmax)
    has = best >= 0
    # that block's data: is any byte nonzero (|code| != 0)?
    j = tl.arange(0, 32)[:, None]
    s = first[None, :] * 32 + j
    if IDX64:
        s = s.to(tl.int64)
    qb = _load_bytes(qp + _offs(s, d[None, :], sqs, sqd, QU), s, S, S_ld, (in_d & has)[None, :], QU)
    ok = tl.max((qb & 0x7F).to(tl.int32), axis=0) != 0
    e = tl.where(has, best - 127, _NO_EXP)
    redo = has & (ok == 0)
    if tl.max(redo.to(tl.int32), axis=0) != 0:
        # the data-first pass, for the channels whose first largest-scale block is all zero: NB blocks a step
        bi = tl.arange(0, NB)[:, None]
        j3 = tl.arange(0, 32)[None, :, None]
        acc = tl.full((CG,), _NO_EXP, tl.int32)
        for k0 in range(0, NSB, NB):
            blk = k0 + bi  # (NB, 1)
            if IDX64:
                blk = blk.to(tl.int64)
            s3 = blk[:, :, None] * 32 + j3  # (NB, 32, 1)
            q3 = _load_bytes(qp + _offs(s3, d[None, None, :], sqs, sqd, QU), s3, S, S_ld, redo[None, None, :], QU)
            anyq = tl.max((q3 & 0x7F).to(tl.int32), axis=1) != 0  # (NB, CG)
            sbyte = tl.load(sp + _offs(blk, d[None, :], scs, scd, SU), mask=(blk < NSB) & redo[None, :],
                            other=255).to(tl.int32)
            eb = tl.where(anyq & (sbyte != 255), sbyte - 127, _NO_EXP)
            acc = tl.maximum(acc, tl.max(eb, axis=0))
        e = tl.where(redo, acc, e)
    tl.store(exp_ptr + (b64 * H + h64) * D + d, e, mask=in_d)


@triton.jit
def _operands_kernel(
    # two quantize jobs (``_quantize_tile``): A and B
    ax, aS, aH, asxb, asxs, asxh, ahd, ahe, acw, ace, aS_pad, aNSB, an_tiles, an_groups,
    bx, bS, bH, bsxb, bsxs, bsxh, bhd, bhe, bcw, bce, bS_pad, bNSB, bn_tiles, bn_groups,
    # two V-exponent jobs (``_seq_exponent_tile`` on float input): E and F
    ex, eS, eH, esxb, esxs, esxh, esxd, eexp, en_tiles, eper,
    fx, fS, fH, fsxb, fsxs, fsxh, fsxd, fexp, fn_tiles, fper,
    n_a, n_b, n_e,  # programs of A, B and E; F takes the rest of the grid
    D: tl.constexpr, NDP: tl.constexpr, RCEIL: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    A: tl.constexpr, A_BS: tl.constexpr, A_HDIM: tl.constexpr, A_SEQ: tl.constexpr, A_GROUP: tl.constexpr,
    A_RS: tl.constexpr, A_ROWSET: tl.constexpr, A_EVEN: tl.constexpr, A_J: tl.constexpr,
    B: tl.constexpr, B_BS: tl.constexpr, B_HDIM: tl.constexpr, B_SEQ: tl.constexpr, B_GROUP: tl.constexpr,
    B_RS: tl.constexpr, B_ROWSET: tl.constexpr, B_EVEN: tl.constexpr, B_J: tl.constexpr,
    E: tl.constexpr, E_BS: tl.constexpr, E_STAGES: tl.constexpr, F: tl.constexpr, F_BS: tl.constexpr,
    F_STAGES: tl.constexpr,
):
    """Up to four independent jobs of one attention call in one launch (the host's cost is per launch): each
    program runs one tile of one job, the jobs laid end to end on the grid.  A job is exactly the tile its own
    kernel would run (``_quantize_kernel`` when ``*_ROWSET``, else ``_hdim_kernel``; ``_seq_exponent_kernel``), so
    the results are the same bit for bit."""
    pid = tl.program_id(0)
    if pid < n_a:
        if A:
            if A_ROWSET:
                _quantize_tile(pid, ax, aS, aH, asxb, asxs, asxh, ahd, ahe, acw, ace, aS_pad, aNSB, an_tiles,
                               an_groups, D, NDP, A_BS, A_HDIM, A_SEQ, A_GROUP, A_RS, RCEIL, SOFT, IDX64, False,
                               A_EVEN, A_J)
            else:
                _hdim_tile(pid, ax, aS, aH, asxb, asxs, asxh, ahd, ahe, an_tiles, an_groups, D, NDP, A_BS, A_GROUP,
                           RCEIL, SOFT, IDX64, False)
    elif pid < n_a + n_b:
        if B:
            if B_ROWSET:
                _quantize_tile(pid - n_a, bx, bS, bH, bsxb, bsxs, bsxh, bhd, bhe, bcw, bce, bS_pad, bNSB, bn_tiles,
                               bn_groups, D, NDP, B_BS, B_HDIM, B_SEQ, B_GROUP, B_RS, RCEIL, SOFT, IDX64, False,
                               B_EVEN, B_J)
            else:
                _hdim_tile(pid - n_a, bx, bS, bH, bsxb, bsxs, bsxh, bhd, bhe, bn_tiles, bn_groups, D, NDP, B_BS,
                           B_GROUP, RCEIL, SOFT, IDX64, False)
    elif pid < n_a + n_b + n_e:
        if E:
            _seq_exponent_tile(pid - n_a - n_b, ex, eS, eH, esxb, esxs, esxh, esxd, eexp, 0, 0, 0, 0, eexp,
                               en_tiles, eper, eS, D, NDP, E_BS, False, RCEIL, IDX64, 1, 0, E_STAGES)
    else:
        if F:
            _seq_exponent_tile(pid - n_a - n_b - n_e, fx, fS, fH, fsxb, fsxs, fsxh, fsxd, fexp, 0, 0, 0, 0, fexp,
                               fn_tiles, fper, fS, D, NDP, F_BS, False, RCEIL, IDX64, 1, 0, F_STAGES)


@triton.jit
def _mx_rows_coords(pid, S, H, n_s_tiles, BLOCK_S: tl.constexpr, NDP: tl.constexpr, IDX64: tl.constexpr):
    """Tile of ``_hdim_tile``'s shape for MX inputs blocked along D: (b, s tile, h), s0, the token index i
    (BLOCK_S, 1, 1), the block index db (1, NDP, 1) and the channel d (1, NDP, 32)."""
    b, st, h = _split_pid(pid, n_s_tiles, H)
    i = tl.arange(0, BLOCK_S)[:, None, None]
    db = tl.arange(0, NDP)[None, :, None]
    d = db * 32 + tl.arange(0, 32)[None, None, :]
    if IDX64:
        i = i.to(tl.int64)
        d = d.to(tl.int64)
    return b.to(tl.int64), st, h.to(tl.int64), st * BLOCK_S, i, db, d


@triton.jit
def _e4m3_to_f32(qb, SOFT: tl.constexpr):
    """fp32 values of e4m3 bytes ``qb`` (uint8); NaN bytes give NaN (the interpreter decodes them as 480)."""
    q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if SOFT:
        q = tl.where((qb & 0x7F) == 0x7F, float("nan"), q)
    return q


@triton.jit
def _rescale_words(qw, m, fin, SOFT: tl.constexpr):
    """Words of 4 e4m3 bytes ``qw`` (int32) re-expressed: e4m3(q * m), m = 2^(e - E) in [2^-20, 1] (see
    ``_rs_bytes``); NaN data bytes stay as they are in finite blocks, NaN blocks (``fin`` false) become 0x7F bytes."""
    if SOFT:  # (NaN bytes and blocks are replaced below; their bytes here are whatever the rounding makes)
        o = _pack_words(_soft_e4m3(_e4m3_to_f32((qw & 0xFF).to(tl.uint8), False) * m),
                        _soft_e4m3(_e4m3_to_f32(((qw >> 8) & 0xFF).to(tl.uint8), False) * m),
                        _soft_e4m3(_e4m3_to_f32(((qw >> 16) & 0xFF).to(tl.uint8), False) * m),
                        _soft_e4m3(_e4m3_to_f32(((qw >> 24) & 0xFF).to(tl.uint8), False) * m))
    else:
        m16 = tl.broadcast_to(m.to(tl.float16), qw.shape)
        o = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, m; .reg .b32 a, b, mm; mov.b32 {lo, hi}, $1; mov.b32 mm, {$2, $2}; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; mul.rn.f16x2 a, a, mm; mul.rn.f16x2 b, b, mm; "
            "cvt.rn.satfinite.e4m3x2.f16x2 lo, a; cvt.rn.satfinite.e4m3x2.f16x2 hi, b; mov.b32 $0, {lo, hi}; }",
            "=r,r,h", [qw, m16], dtype=tl.int32, is_pure=True, pack=1)
    # 0xFF in the input's NaN bytes (0x7F / 0xFF): (b & 0x7F) + 1 carries into bit 7 of that byte alone
    nan = ((((qw & 0x7F7F7F7F) + 0x01010101) >> 7) & 0x01010101) * 255
    return tl.where(fin, (o & ~nan) | (qw & nan), 0x7F7F7F7F)


@triton.jit
def _hdim_rescale_kernel(
    q_ptr, S, H, sqb, sqs, sqh,  # MX data (B, S, H, D) as int32 words of 4 bytes, unit stride along D (or its
    #                              (1, B*S*H, 1, D/4) view); strides in words
    sc_ptr, scb, scs, sch,  # MX scale bytes (B, S, H, ND), unit stride along ND
    out_ptr, exp_ptr,  # data (B, S, H, D) contiguous, as int32 words; exponents (B, S, H, 1) (Q) or
    #                    (B, n_groups, H, 1) (K)
    n_s_tiles, n_groups,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr, SOFT: tl.constexpr,
    IDX64: tl.constexpr,
):
    """``to_row_scaled`` of an MXTensor blocked along D, for Q (GROUP 1) or K (GROUP = BLOCK_S tokens of one head)
    on ``_hdim_tile``'s tile, in words of 4 bytes (D % 4 == 0): a block is 8 words, whether it holds a nonzero byte
    is a max over (word & 0x7F7F7F7F), and the re-expression converts 4 bytes per word."""
    b, st, h = _split_pid(tl.program_id(0), n_s_tiles, H)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    s0 = st * BLOCK_S
    i = tl.arange(0, BLOCK_S)[:, None, None]
    db = tl.arange(0, NDP)[None, :, None]
    dw = db * 8 + tl.arange(0, 8)[None, None, :]  # word of the row
    if IDX64:
        i = i.to(tl.int64)
        dw = dw.to(tl.int64)
    ND: tl.constexpr = (D + 31) // 32
    DW: tl.constexpr = D // 4
    in_s = i < S - s0
    # The scale bytes are loaded before the words: loaded after them, their (BLOCK_S, NDP, 1) load's layout was the
    # one the compiler built the tile in at d128, and it moved the words into it and back through shared memory (Q:
    # 8 + 8 16-byte shared accesses and 11 barriers per thread, K: 144 registers and 70 barriers); loaded first, the
    # tile stays in the words' layout (Q 32 registers and no 16-byte shared access, K 94 registers and 10 barriers;
    # sm_90a SASS of the launched builds, scripts/compile_launched.py quant-bench).  (Apparently the layout that
    # reaches an op first wins a conflict.)
    sb = tl.load(sc_ptr + (b64 * scb + s0.to(tl.int64) * scs + h64 * sch) + i * scs + db, mask=in_s & (db < ND),
                 other=127).to(tl.int32)
    qw = tl.load(q_ptr + (b64 * sqb + s0.to(tl.int64) * sqs + h64 * sqh) + i * sqs + dw, mask=in_s & (dw < DW),
                 other=0)
    fin = sb != 255
    nz = fin & (tl.max(qw & 0x7F7F7F7F, axis=2, keep_dims=True) != 0)
    en = tl.where(nz, sb - 127, _NO_EXP)
    GP: tl.constexpr = BLOCK_S // GROUP  # K: exponent groups per program (session 14: 2 may win at d64)
    if GROUP == 1:
        E = tl.max(en, axis=1, keep_dims=True)
        E = tl.where(E == _NO_EXP, 0, E)
    elif GP == 1:
        E = tl.max(en)
        E = tl.where(E == _NO_EXP, 0, E)
        tl.store(exp_ptr + (b64 * n_groups + st) * H + h64, E)
    else:  # each group's maximum of the rows' maxima, broadcast back to its rows
        er = tl.max(en, axis=1, keep_dims=True)
        gi = i // GROUP
        E = tl.zeros_like(er)
        for g in tl.static_range(GP):
            eg = tl.max(tl.where(gi == g, er, _NO_EXP))
            eg = tl.where(eg == _NO_EXP, 0, eg)
            E = tl.where(gi == g, eg, E)
            tl.store(exp_ptr + (b64 * n_groups + st * GP + g) * H + h64, eg, mask=st * GP + g < n_groups)
    row = (b64 * S + s0) * H + h64
    out = _rescale_words(qw, _pow2(_rs_shift(sb - 127, E)), fin, SOFT)
    tl.store(out_ptr + row * DW + (i * H * DW + dw), out, mask=in_s & (dw < DW))
    if GROUP == 1:
        tl.store(exp_ptr + row + i * H, E, mask=in_s)


@triton.jit
def _hdim_dequant_kernel(
    q_ptr, S, H, sqb, sqs, sqh,  # MX data bytes (B, S, H, D), unit stride along D (or its row view)
    sc_ptr, scb, scs, sch,  # MX scale bytes (B, S, H, ND), unit stride along ND
    out_ptr,  # (B, S, H, D) contiguous, of the output dtype
    n_s_tiles,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
):
    """``dequantize_mxfp8`` of an MXTensor blocked along D on ``_hdim_tile``'s tile: data * 2^(scale - 127), NaN for
    scale byte 255 and for NaN data."""
    b64, st, h64, s0, i, db, d = _mx_rows_coords(tl.program_id(0), S, H, n_s_tiles, BLOCK_S, NDP, IDX64)
    ND: tl.constexpr = (D + 31) // 32
    in_s = i < S - s0
    qb = tl.load(q_ptr + (b64 * sqb + s0.to(tl.int64) * sqs + h64 * sqh) + i * sqs + d, mask=in_s & (d < D), other=0)
    sb = tl.load(sc_ptr + (b64 * scb + s0.to(tl.int64) * scs + h64 * sch) + i * scs + db, mask=in_s & (db < ND),
                 other=127)
    y = _e4m3_to_f32(qb, SOFT) * _scale_value(sb)
    row = (b64 * S + s0) * H + h64
    tl.store(out_ptr + row * D + (i * H * D + d), _round_out(y, out_ptr.dtype.element_ty, SOFT), mask=in_s & (d < D))


@triton.jit
def _scale_value(sb):
    """fp32 2^(byte - 127) of E8M0 scale bytes ``sb``: byte 0 is the fp32 subnormal 2^-127 (bits 0x400000), byte 255
    is NaN."""
    sb = sb.to(tl.int32)
    return tl.where(sb == 255, 0x7FC00000, tl.where(sb == 0, 0x400000, sb << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _cm_words_coords(cw_ptr, swb, swh, swd, n_s_tiles, H, D: tl.constexpr, BLOCK_S: tl.constexpr, NDP: tl.constexpr,
                     IDX64: tl.constexpr):
    """This program's tile of channel-major words (``_seq_dequant_kernel``, ``_seq_rescale_kernel``): b, h (int64),
    the s tile and its first token, the word index w and channel d (``_row_set_coords``), d < D, and the words'
    addresses."""
    b, st, h = _pid_bsh(n_s_tiles, H)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    w, d = _row_set_coords(BLOCK_S, NDP, IDX64)
    wp = cw_ptr + (b64 * swb + h64 * swh + st * (BLOCK_S // 4)) + d * swd + w
    return b64, h64, st, st * BLOCK_S, w, d, d < D, wp


@triton.jit
def _seq_dequant_kernel(
    cw_ptr, swb, swh, swd,  # MX data (B, H, D, S) with unit stride along S, as int32 words of 4 tokens (the rows
    #                         of a channel-major buffer); strides in words
    sc_ptr, scb, scs, sch, scd,  # MX scale bytes (B, NSB, H, D), any strides
    out_ptr,  # (B, S, H, D) contiguous, of the output dtype
    S, H, n_s_tiles,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    EVEN: tl.constexpr,  # S % BLOCK_S == 0: no row masks
):
    """``dequantize_mxfp8`` of an MXTensor blocked along S whose data is channel-major: BLOCK_S tokens x D channels
    of one (b, h), the inverse of ``_quantize_tile``'s seq orientation.  The tile is loaded as words (tokens 4w..4w+3
    of a channel, shape (BLOCK_S/32, 8, NDP, 32) as ``_row_set_coords``), so the transpose to token rows moves 4-byte
    words; byte k of each word is row set k (rows s0 + 4w + k), stored with unit stride along D."""
    b64, h64, st, s0, w, d, in_d, wp = _cm_words_coords(cw_ptr, swb, swh, swd, n_s_tiles, H, D, BLOCK_S, NDP, IDX64)
    q4 = w * 4
    if EVEN:
        qw = tl.load(wp, mask=in_d, other=0)
    else:  # a word that starts before S lies inside the row (its padding past S is never stored)
        qw = tl.load(wp, mask=(s0 + q4 < S) & in_d, other=0)
    # the scale bytes loaded at every word of their block (from L1): a load of the tile's shape takes the stores'
    # layout, where a (BLOCK_S/32, 1, NDP, 32) load took one of its own and the compiler built the outputs in both
    sbk = w // 8
    sp = sc_ptr + (b64 * scb + (st * (BLOCK_S // 32)).to(tl.int64) * scs + h64 * sch)
    sf = _scale_value(tl.load(sp + sbk * scs + d * scd, mask=(s0 + sbk * 32 < S) & in_d, other=127))
    op = out_ptr + ((b64 * S + s0) * H + h64) * D + d
    y0, y1, y2, y3 = _dequant_words(qw, sf, out_ptr.dtype.element_ty, SOFT)
    _store_rows(op + q4 * (H * D), y0, s0 + q4 < S, in_d, EVEN)
    _store_rows(op + (q4 + 1) * (H * D), y1, s0 + q4 + 1 < S, in_d, EVEN)
    _store_rows(op + (q4 + 2) * (H * D), y2, s0 + q4 + 2 < S, in_d, EVEN)
    _store_rows(op + (q4 + 3) * (H * D), y3, s0 + q4 + 3 < S, in_d, EVEN)


@triton.jit
def _channel_exponents(exp_ptr, b64, h64, H, D: tl.constexpr, d, in_d, st):
    """V's per-channel exponents from pass 1 for channels ``d`` of (b, h), the sentinel read as 0; the program of the
    first S tile writes the 0 back (readers map both the same way)."""
    ep = exp_ptr + (b64 * H + h64) * D + d
    E = tl.load(ep, mask=in_d, other=0)
    E = tl.where(E == _NO_EXP, 0, E)
    if st == 0:
        tl.store(ep, E, mask=in_d)
    return E


@triton.jit
def _store_cm_words(out_ptr, out, b64, h64, H, D: tl.constexpr, S, S_pad, st, s0, w, d, in_d,
                    BLOCK_S: tl.constexpr, EVEN: tl.constexpr):
    """Store words ``w`` of S tile ``st`` of channel-major rows ``d`` of (b, h) (rows of S_pad bytes); the bytes of
    tokens >= S become 0 (NaN blocks' 0x7F bytes too), the row padding included."""
    row_w = S_pad // 4  # words per channel-major row
    wo = st * (BLOCK_S // 4) + w
    op = out_ptr + (b64 * H + h64) * D * row_w + d * row_w + wo
    if EVEN:
        tl.store(op, out, mask=in_d)
    else:
        keep = S - (s0 + w * 4)
        low = (1 << (8 * tl.minimum(tl.maximum(keep, 0), 3))) - 1
        tl.store(op, tl.where(keep >= 4, out, out & low), mask=(wo < row_w) & in_d)


@triton.jit
def _seq_rescale_kernel(
    cw_ptr, swb, swh, swd,  # MX data words, as ``_seq_dequant_kernel``'s
    sc_ptr, scb, scs, sch, scd,  # MX scale bytes (B, NSB, H, D), any strides
    out_ptr, exp_ptr,  # V data: channel-major (B, H, D, S_pad) as int32 words; exponents (B, 1, H, D) from pass 1
    S, H, S_pad, n_s_tiles,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    EVEN: tl.constexpr,  # S % BLOCK_S == 0 == S_pad - S: no row masks
):
    """Pass 2 of V from an MXTensor blocked along S with channel-major data: each block re-expressed to its channel's
    exponent, channel-major in and out, so the tile (``_row_set_coords``' words, tokens 4w..4w+3 of a channel) is
    loaded and stored in one layout, 4 bytes per word converted at once (``_rescale_words``).  Tiles run over S_pad:
    the row padding is written as zeros (bytes past S are cleared, whatever the input's padding holds)."""
    b64, h64, st, s0, w, d, in_d, wp = _cm_words_coords(cw_ptr, swb, swh, swd, n_s_tiles, H, D, BLOCK_S, NDP, IDX64)
    q4 = w * 4
    # the exponents and scale bytes first, then the words: loaded after the words, these (., 1, NDP, 32) loads gave
    # the tile their layout and the words went through shared memory twice (as in ``_hdim_rescale_kernel``)
    E = _channel_exponents(exp_ptr, b64, h64, H, D, d, in_d, st)
    sbk = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
    sp = sc_ptr + (b64 * scb + (st * (BLOCK_S // 32)).to(tl.int64) * scs + h64 * sch) + sbk * scs + d * scd
    if EVEN:
        sb = tl.load(sp, mask=in_d, other=127).to(tl.int32)
        qw = tl.load(wp, mask=in_d, other=0)
    else:
        sb = tl.load(sp, mask=(s0 + sbk * 32 < S) & in_d, other=127).to(tl.int32)
        qw = tl.load(wp, mask=(s0 + q4 < S) & in_d, other=0)
    out = _rescale_words(qw, _pow2(_rs_shift(sb - 127, E)), sb != 255, SOFT)
    _store_cm_words(out_ptr, out, b64, h64, H, D, S, S_pad, st, s0, w, d, in_d, BLOCK_S, EVEN)


@triton.jit
def _seq_rescale_rows_kernel(
    cw_ptr, swb, swh, swd,  # MX data words, as ``_seq_dequant_kernel``'s (channel-major rows, strides in words)
    sc_ptr, scb, scs, sch, scd,  # MX scale bytes (B, NSB, H, D), any strides
    out_ptr, exp_ptr,  # V data: channel-major (B, H, D, S_pad) as int32 words; exponents (B, 1, H, D) from pass 1
    S, H, S_pad, n_s_tiles, n_cg,
    D: tl.constexpr, CG: tl.constexpr, BLOCK_S: tl.constexpr, SOFT: tl.constexpr, IDX64: tl.constexpr,
    EVEN: tl.constexpr,  # S % BLOCK_S == 0 == S_pad - S and D % CG == 0: no masks
):
    """``_seq_rescale_kernel`` on a tile of CG channel-major rows x BLOCK_S tokens (one (b, h)): each row read and
    written in runs of BLOCK_S bytes, the programs of one row set next to each other along S.  The scale byte of
    a word is loaded at each of its block's 8 words (from L1)."""
    pid = tl.program_id(0)
    st = pid % n_s_tiles
    t = pid // n_s_tiles
    g = t % n_cg
    t = t // n_cg
    h = t % H
    b = t // H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    d = g * CG + tl.arange(0, CG)[:, None]
    w = tl.arange(0, BLOCK_S // 4)[None, :]
    if IDX64:
        d = d.to(tl.int64)
        w = w.to(tl.int64)
    in_d = d < D
    s0 = st * BLOCK_S
    q4 = w * 4
    E = _channel_exponents(exp_ptr, b64, h64, H, D, d, in_d, st)
    sp = sc_ptr + (b64 * scb + (st * (BLOCK_S // 32)).to(tl.int64) * scs + h64 * sch) + (w // 8) * scs + d * scd
    wp = cw_ptr + (b64 * swb + h64 * swh + st * (BLOCK_S // 4)) + d * swd + w
    if EVEN:
        sb = tl.load(sp).to(tl.int32)
        qw = tl.load(wp)
    else:
        live = (s0 + q4 < S) & in_d
        sb = tl.load(sp, mask=live, other=127).to(tl.int32)
        qw = tl.load(wp, mask=live, other=0)
    out = _rescale_words(qw, _pow2(_rs_shift(sb - 127, E)), sb != 255, SOFT)
    _store_cm_words(out_ptr, out, b64, h64, H, D, S, S_pad, st, s0, w, d, in_d, BLOCK_S, EVEN)


@triton.jit
def _dequant_words(qw, sf, dtype: tl.constexpr, SOFT: tl.constexpr):
    """Bytes 0..3 of the words ``qw`` (e4m3) times the scales ``sf`` (fp32), rounded to ``dtype``: four tensors.

    On the GPU (bf16 / fp16 out) one inline-PTX op per two elements (two words): the bytes paired by ``prmt``, one
    e4m3x2 -> f16x2 conversion per pair, the products in fp32 and one packing conversion.  Left to the compiler, each
    byte was cut from the word as an i8 tensor, and the layout change of the transpose moved those bytes one at a time
    through shared memory (STS.U8); the op keeps the word whole up to it."""
    if SOFT or dtype == tl.float32:
        y0 = _round_out(_e4m3_to_f32((qw & 0xFF).to(tl.uint8), SOFT) * sf, dtype, SOFT)
        y1 = _round_out(_e4m3_to_f32(((qw >> 8) & 0xFF).to(tl.uint8), SOFT) * sf, dtype, SOFT)
        y2 = _round_out(_e4m3_to_f32(((qw >> 16) & 0xFF).to(tl.uint8), SOFT) * sf, dtype, SOFT)
        y3 = _round_out(_e4m3_to_f32(((qw >> 24) & 0xFF).to(tl.uint8), SOFT) * sf, dtype, SOFT)
    elif dtype == tl.bfloat16:
        y0, y1, y2, y3 = tl.inline_asm_elementwise(
            _DEQUANT_WORDS_BF16, "=r,=r,=r,=r,r,r,r,r", [qw, tl.broadcast_to(sf, qw.shape)],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        y0, y1, y2, y3 = tl.inline_asm_elementwise(
            _DEQUANT_WORDS_F16, "=r,=r,=r,=r,r,r,r,r", [qw, tl.broadcast_to(sf, qw.shape)],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    return y0, y1, y2, y3


def _dequant_words_asm(cvt: str) -> tl.constexpr:
    """``_dequant_words``' PTX for the packing conversion ``cvt``: two words $4, $5 (channels d, d + 1) and their
    scales $6, $7 give $k = byte k of both, each e4m3 -> f16 -> f32, times its scale, packed by ``cvt``."""
    body = "{ .reg .b32 p, q, a; .reg .b16 l0, h0, l1, h1, x, y; .reg .f32 f, g; prmt.b32 p, $4, $5, 0x5140; " \
           "prmt.b32 q, $4, $5, 0x7362; mov.b32 {l0, h0}, p; mov.b32 {l1, h1}, q; "
    for k, src in enumerate(("l0", "h0", "l1", "h1")):
        body += (f"cvt.rn.f16x2.e4m3x2 a, {src}; mov.b32 {{x, y}}, a; cvt.f32.f16 f, x; cvt.f32.f16 g, y; "
                 f"mul.f32 f, f, $6; mul.f32 g, g, $7; {cvt} ${k}, g, f; ")
    return tl.constexpr(body + "}")


_DEQUANT_WORDS_BF16 = _dequant_words_asm("cvt.rn.bf16x2.f32")
_DEQUANT_WORDS_F16 = _dequant_words_asm("cvt.rn.f16x2.f32")


@triton.jit
def _round_out(y, dtype: tl.constexpr, SOFT: tl.constexpr):
    """fp32 ``y`` rounded (nearest even) to the output dtype; NaN stays NaN.  For bf16 the explicit path rounds in
    the bits (the interpreter's fp32->bf16 cast truncates and drops subnormals), the GPU's cvt does the same."""
    if dtype == tl.bfloat16 and SOFT:
        yb = y.to(tl.int32, bitcast=True)
        yb = tl.where(y != y, 0x7FC00000, yb + 0x7FFF + ((yb >> 16) & 1))
        out = (yb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(dtype)
    return out


@triton.jit
def _rescale_mx_kernel(
    q_ptr, sqb, sqs, sqh, sqd,  # MX data bytes, logical (B, S, H, D), any strides
    sc_ptr, scb, scs, sch, scd,  # MX scale bytes in plain layout
    out_ptr, exp_ptr,  # data (contiguous (B,S,H,D) for Q/K; channel-major (B,H,D,S_pad) for V), exponents
    S, H, S_pad, n_s_tiles, n_groups, S_ld,
    D: tl.constexpr, NDP: tl.constexpr, BLOCK_S: tl.constexpr,
    SEQ: tl.constexpr,  # False: hdim MXTensor -> Q/K; True: seq MXTensor -> V (exponents from pass 1)
    GROUP: tl.constexpr,  # Q: 1, K: BLOCK_S (hdim only)
    SOFT: tl.constexpr, IDX64: tl.constexpr, QU: tl.constexpr, SU: tl.constexpr,
):
    """``to_row_scaled`` of an MXTensor: re-express every block to its row's (group's) largest exponent."""
    b, st, h = _pid_bsh(n_s_tiles, H)
    s0 = st * BLOCK_S
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    sl, d = _tile_coords(s0, BLOCK_S, NDP, IDX64)
    s = s0 + sl
    in_s = s < S
    in_d = d < D
    qp = q_ptr + b64 * sqb + s0.to(tl.int64) * sqs + h64 * sqh
    qb = _load_bytes(qp + _offs(sl, d, sqs, sqd, QU), s, S, S_ld, in_d, QU)
    q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    nanq = (qb & 0x7F) == 0x7F
    if SEQ:
        sbk = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
        sp = sc_ptr + b64 * scb + (s0 // 32).to(tl.int64) * scs + h64 * sch
        sbyte = tl.load(sp + _offs(sbk, d, scs, scd, SU), mask=(s0 + sbk * 32 < S) & in_d, other=127).to(tl.int32)
        ep = exp_ptr + (b64 * H + h64) * D + d
        E = tl.load(ep, mask=in_d, other=0)
        E = tl.where(E == _NO_EXP, 0, E)
        if st == 0:
            tl.store(ep, E, mask=in_d)
    else:
        db = tl.arange(0, NDP)[None, None, :, None]
        sp = sc_ptr + b64 * scb + s0.to(tl.int64) * scs + h64 * sch
        sbyte = tl.load(sp + _offs(sl, db, scs, scd, SU), mask=in_s & (db * 32 < D), other=127).to(tl.int32)
        anyq = tl.max(qb & 0x7F, axis=3, keep_dims=True) != 0
        eb = tl.where(anyq & (sbyte != 255), sbyte - 127, _NO_EXP)
        if GROUP == 1:
            E = tl.max(eb, axis=2, keep_dims=True)
        else:
            E = tl.max(eb)
        E = tl.where(E == _NO_EXP, 0, E)
        row = (b64 * S + s0) * H + h64
        if GROUP == 1:
            tl.store(exp_ptr + row + sl * H, E, mask=in_s)
        else:
            tl.store(exp_ptr + (b64 * n_groups + st) * H + h64, E)
    isnan_blk = sbyte == 255
    shift = tl.minimum(tl.maximum(sbyte - 127 - E, -31), 0)
    out = _e4m3_bytes(q * _pow2(shift), SOFT)
    if tl.max(tl.where(nanq, 1, 0)) + tl.max(tl.where(isnan_blk, 1, 0)) > 0:
        # NaN data keeps its sign (torch); NaN blocks become +NaN (formats.to_row_scaled)
        out = tl.where(nanq, qb | 0x7F, out)
        out = tl.where(isnan_blk & in_s, 127, out).to(tl.uint8)
    if SEQ:
        cbase = out_ptr + (b64 * H + h64) * D * S_pad + s0
        tl.store(cbase + d * S_pad + sl, out, mask=(s < S_pad) & in_d)
    else:
        row = (b64 * S + s0) * H + h64
        tl.store(out_ptr + row * D + sl * (H * D) + d, out, mask=in_s & in_d)


@triton.jit
def _dequantize_kernel(
    q_ptr, sqb, sqs, sqh, sqd,  # data bytes, canonical 4-D (B, S, H, D) view, any strides
    sc_ptr, scb, scs, sch, scd,  # scale bytes (plain layout, same canonical axes)
    out_ptr,  # contiguous (B, S, H, D) of the output dtype
    S, H, D, n_s_tiles, n_d_tiles, S_ld,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BDIM: tl.constexpr,  # canonical block dim: 0 (B), 1 (S), 2 (H), 3 (D)
    OUT_BF16: tl.constexpr, IDX64: tl.constexpr, QU: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = pid % n_d_tiles
    t = pid // n_d_tiles
    h = t % H
    t = t // H
    st = t % n_s_tiles
    b = t // n_s_tiles
    s0 = st * BLOCK_S
    d0 = dt * BLOCK_D
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    sl, dl = _tile_coords(s0, BLOCK_S, BLOCK_D // 32, IDX64)
    s = s0 + sl
    d = d0 + dl
    m = (s < S) & (d < D)
    qb = _load_bytes(q_ptr + b64 * sqb + s0.to(tl.int64) * sqs + h64 * sqh + d0.to(tl.int64) * sqd
                     + _offs(sl, dl, sqs, sqd, QU), s, S, S_ld, d < D, QU)
    q = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # scale bytes: index along the block dim divided by 32
    if BDIM == 0:
        sp = sc_ptr + (b64 // 32) * scb + h64 * sch
    elif BDIM == 2:
        sp = sc_ptr + b64 * scb + (h64 // 32) * sch
    else:
        sp = sc_ptr + b64 * scb + h64 * sch
    if BDIM == 1:
        sbk = tl.arange(0, BLOCK_S // 32)[:, None, None, None]
        sp = sp + (s0 // 32).to(tl.int64) * scs + sbk * scs
        ms = s0 + sbk * 32 < S
    else:
        sp = sp + s0.to(tl.int64) * scs + sl * scs
        ms = s < S
    if BDIM == 3:
        dbk = tl.arange(0, BLOCK_D // 32)[None, None, :, None]
        sp = sp + (d0 // 32).to(tl.int64) * scd + dbk * scd
        md = d0 + dbk * 32 < D
    else:
        sp = sp + d0.to(tl.int64) * scd + dl * scd
        md = d < D
    sbyte = tl.load(sp, mask=ms & md, other=127).to(tl.int32)
    # 2^(byte-127): byte 0 is the fp32 subnormal 2^-127 (bits 0x400000), byte 255 is NaN
    # (NaN data is made NaN here too: the interpreter decodes e4m3 NaN as 480)
    sf = tl.where(sbyte == 0, 0x400000, sbyte << 23)
    sf = tl.where((sbyte == 255) | ((qb & 0x7F) == 0x7F), 0x7FC00000, sf).to(tl.float32, bitcast=True)
    y = q * sf
    if OUT_BF16:
        # round to bf16 in the bits (nearest even; NaN stays NaN) and keep the high half: exact everywhere
        # (the interpreter's fp32->bf16 cast truncates and drops subnormals)
        yb = y.to(tl.int32, bitcast=True)
        yb = tl.where(y != y, 0x7FC00000, yb + 0x7FFF + ((yb >> 16) & 1))
        out = (yb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(out_ptr.dtype.element_ty)
    ob = ((b64 * S + s0) * H + h64) * D + d0
    tl.store(out_ptr + ob + sl * (H * D) + dl, out, mask=m)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
_I32_SAFE = 2**31 - 1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _soft(device: torch.device) -> bool:
    return device.type != "cuda" or SOFT_ROUND_ON_GPU


def _check_device(t: torch.Tensor, name: str) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and _interpreting():
        return
    raise ValueError(f"{name} must be a CUDA tensor (or a CPU tensor with TRITON_INTERPRET=1), got {t.device}")


def _canon_bshd(x: torch.Tensor, name: str, seq_dim: Optional[int]) -> tuple[torch.Tensor, bool]:
    """(B, S, H, D) view of ``x`` and whether it was packed (T, H, D)."""
    if x.ndim == 4:
        if seq_dim not in (None, 1, -3):
            raise ValueError(f"{name} is (B, S, H, D): seq_dim must be 1, got {seq_dim}")
        return x, False
    if x.ndim == 3:
        if seq_dim not in (None, 0, -3):
            raise ValueError(f"{name} is packed (T, H, D): seq_dim must be 0, got {seq_dim}")
        return x.unsqueeze(0), True
    raise ValueError(f"{name} must be (B, S, H, D) or packed (T, H, D), got shape {tuple(x.shape)}")


def _check_float_input(x, name: str, seq_dim) -> tuple[torch.Tensor, bool]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_IN:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    x4, packed = _canon_bshd(x, name, seq_dim)
    D = x4.shape[3]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim D={D} is out of range [1, {MAX_HEAD_DIM}]")
    _check_device(x, name)
    if x4.stride(3) != 1:
        x4 = x4.contiguous()
    return x4, packed


def _unit(t: torch.Tensor) -> int:
    """Which of a canonical (B, S, H, D) tensor's tile axes has unit stride: 1 (D), 2 (S) or 0."""
    if t.shape[3] == 1 or t.stride(3) == 1:
        return 1
    if t.shape[1] == 1 or t.stride(1) == 1:
        return 2
    return 0


def _s_load_bound(t4: torch.Tensor) -> int:
    """How far loads along S may run in a canonical tensor whose S axis has unit stride: S rounded up to
    16 when every row has that much padding inside the storage (channel-major buffers do), else S."""
    B, S, H, D = t4.shape
    s_al = -(-S // 16) * 16
    if _unit(t4) != 2 or s_al == S or t4.numel() == 0:
        return S
    row = min((abs(t4.stride(i)) for i in (0, 2, 3) if t4.shape[i] > 1), default=s_al)
    last = t4.storage_offset() + sum((n - 1) * st for n, st in zip(t4.shape, t4.stride()))
    fits = last + (s_al - S) < t4.untyped_storage().nbytes() // t4.element_size()
    return s_al if row >= s_al and fits and min(t4.stride()) >= 0 else S


def _d_pad(D: int) -> int:
    return 32 * next_pow2(cdiv(D, 32))


def _needs_i64(*extents: int) -> bool:
    """Whether tile-local offsets (sums of block extent x stride) may pass int32."""
    return sum(abs(int(e)) for e in extents) > _I32_SAFE


def _channel_major_buffer(B: int, H: int, D: int, S: int, device) -> tuple[torch.Tensor, int]:
    s_pad = cdiv(max(S, 1), SEQ_ALIGN) * SEQ_ALIGN
    return torch.empty(B, H, D, s_pad, dtype=torch.uint8, device=device), s_pad


def _seq_view(buf: torch.Tensor, S: int, packed: bool) -> torch.Tensor:
    v = buf[..., :S].permute(0, 3, 1, 2).view(torch.float8_e4m3fn)
    return v[0] if packed else v


def _unpack(t: torch.Tensor, packed: bool) -> torch.Tensor:
    return t[0] if packed else t


def quantize_mxfp8_triton(
    x: torch.Tensor,
    orientations: str = "hdim",
    scale_mode: Union[str, ScaleMode] = "rceil",
    seq_dim: Optional[int] = None,
    scale_layout: str = "plain",
) -> Union[MXTensor, MXTensorTiled, tuple]:
    """MXFP8-quantize ``x`` along D (``hdim``), along S (``seq``) or both from one read.

    ``x``: bf16/fp16/fp32, (B, S, H, D) (``seq_dim`` 1 or None) or packed (T, H, D) (``seq_dim`` 0 or
    None); 1 <= D <= 256, any S, any strides (D is made unit-stride).  Returns the ``MXTensor`` of the
    orientation asked for, or ``(hdim, seq)`` for ``"both"``; bit-exact with
    ``formats.quantize_mxfp8(x, dim=-1 / seq_dim, scale_mode)``.  Layouts: module docstring.
    ``scale_layout="blackwell"``: the scales are written straight into the 128x4-tiled layout of Blackwell
    block-scaled MMA (cuBLAS / cuDNN), per (batch, head): ``MXTensorTiled`` instead of ``MXTensor``, the same
    data; ``.to_mx()`` of it equals the plain result.
    """
    if orientations not in ("hdim", "seq", "both"):
        raise ValueError(f"orientations must be 'hdim', 'seq' or 'both', got {orientations!r}")
    if scale_layout not in ("plain", "blackwell"):
        raise ValueError(f"scale_layout must be 'plain' or 'blackwell', got {scale_layout!r}")
    tiled = scale_layout == "blackwell"
    mode = ScaleMode.parse(scale_mode)
    x4, packed = _check_float_input(x, "x", seq_dim)
    B, S, H, D = x4.shape
    dev = x4.device
    want_h = orientations in ("hdim", "both")
    want_s = orientations in ("seq", "both")
    ND, NSB = cdiv(D, 32), cdiv(S, 32)
    hd = he = cd = ce = None
    s_pad = SEQ_ALIGN
    if want_h:
        hd = torch.empty(B, S, H, D, dtype=torch.uint8, device=dev)
        if tiled:  # zeros: the padding of the last tiles
            he = torch.zeros(B, H, blackwell_scale_bytes(S, ND), dtype=torch.uint8, device=dev)
        else:
            he = torch.empty(B, S, H, ND, dtype=torch.uint8, device=dev)
    if want_s:
        cd, s_pad = _channel_major_buffer(B, H, D, S, dev)
        if tiled:
            ce = torch.zeros(B, H, blackwell_scale_bytes(D, NSB), dtype=torch.uint8, device=dev)
        else:
            ce = torch.empty(B, NSB, H, D, dtype=torch.uint8, device=dev)
    if x4.numel() > 0 or (want_s and B * H * D > 0):
        _launch_quantize(x4, hd, he, cd, ce, s_pad, HDIM=want_h, SEQ=want_s, HDIM_GROUP=0, SEQ_RS=False,
                         rceil=mode is ScaleMode.RCEIL, group=0, swz=tiled)
    res = []
    sd = 0 if packed else 1
    for data, scale, dim in ((hd, he, x.ndim - 1), (cd, ce, sd)):
        if data is None:
            continue
        data = _unpack(data, packed).view(torch.float8_e4m3fn) if dim == x.ndim - 1 else _seq_view(data, S, packed)
        if tiled:
            res.append(MXTensorTiled(data, scale[0] if packed else scale, dim))
        else:
            res.append(MXTensor(data, _unpack(scale, packed), dim))
    return res[0] if len(res) == 1 else tuple(res)


def _quantize_spec(x4, s_pad, *, HDIM, SEQ, HDIM_GROUP, SEQ_RS, rceil, group, swz=False, warps=None):
    """One quantize launch without its tensors: (grid, the scalars after ``x``, the scalars after the outputs, the
    constexprs, the kernel kind), or None when there is no work.  Kind "hdim": ``_hdim_kernel`` (head-dim orientation
    alone); "hdim_rows": the same on ``_rows_view(x4)``; "rowset": ``_quantize_kernel`` (any seq orientation)."""
    B, S, H, D = x4.shape
    if SEQ and HDIM and HDIM_GROUP == 1:
        raise ValueError("the row-set kernel writes the K layout (a group of rows) or MX scales along D, not Q's")
    if B * H == 0:
        return None
    dp = _d_pad(D)
    rows = None if SEQ else _rows_view(x4)
    if not SEQ:
        if S == 0:
            return None
        # MX and Q tiles may take any run of rows; K tiles are one exponent group of one head, and tiled scales are
        # per (b, h)
        flat = HDIM_GROUP <= 1 and not swz and rows is not None
        xv = rows if flat else x4
        Bv, Sv, Hv, _ = xv.shape
        tile = _tile("hdim_k" if HDIM_GROUP > 1 else "hdim", dp, group, warps)
        bs = tile.block_s
        n_s_tiles = cdiv(Sv, bs)
        sxb, sxs, sxh, _ = xv.stride()
        idx64 = _needs_i64(bs * sxs, dp) or _needs_i64(bs * Hv * D, dp)
        return ((Bv * n_s_tiles * Hv,), (Sv, Hv, sxb, sxs, sxh), (n_s_tiles, cdiv(S, group) if group else 1),
                dict(D=D, NDP=dp // 32, BLOCK_S=bs, GROUP=HDIM_GROUP, RCEIL=rceil, SOFT=_soft(x4.device),
                     IDX64=idx64, SWZ=swz, num_warps=tile.num_warps),
                "hdim_rows" if flat else "hdim")
    tile = _tile("seq_k" if HDIM_GROUP > 1 else "seq", dp, group, warps)
    bs = tile.block_s
    # seq outputs cover the zero padding up to s_pad, so tiles run over max(S, s_pad)
    s_cover = max(S, s_pad)
    n_s_tiles = cdiv(s_cover, bs)
    n_groups = cdiv(S, group) if group else 1
    sxb, sxs, sxh, _ = x4.stride()
    idx64 = _needs_i64(bs * sxs, dp) or _needs_i64(bs * H * D, dp) or _needs_i64(dp * s_pad, bs)
    return ((B * n_s_tiles * H,), (S, H, sxb, sxs, sxh), (s_pad, cdiv(S, 32), n_s_tiles, n_groups),
            dict(D=D, NDP=dp // 32, BLOCK_S=bs, HDIM=HDIM, SEQ=SEQ, HDIM_GROUP=HDIM_GROUP, SEQ_RS=SEQ_RS,
                 RCEIL=rceil, SOFT=_soft(x4.device), IDX64=idx64, SWZ=swz, EVEN=S % bs == 0 and s_pad <= S,
                 J=tile.row_groups, num_warps=tile.num_warps), "rowset")


def _rows_view(x4: torch.Tensor) -> Optional[torch.Tensor]:
    """``x4`` (B, S, H, D) as (1, B*S*H, 1, D) when its (b, s, h) rows are evenly spaced (a contiguous tensor, or one
    whose rows are padded), else None.  The head-dim kernel then takes tiles of consecutive rows: no per-program
    (b, s, h) split and one run of memory per tile, with the same output offsets (outputs are contiguous)."""
    B, S, H, D = x4.shape
    try:
        return x4.view(1, B * S * H, 1, D)
    except RuntimeError:
        return None


def _quantize_args(spec, x4, hd, he, cd, ce, dummy) -> tuple:
    """The positional arguments of the launch ``spec`` describes (``_quantize_spec``) for these tensors."""
    _, head, tail, _, kind = spec
    if kind == "rowset":
        return (x4, *head, hd if hd is not None else dummy, he if he is not None else dummy,
                cd.view(torch.int32) if cd is not None else dummy, ce if ce is not None else dummy, *tail)
    xv = x4.view(1, head[0], 1, x4.shape[3]) if kind == "hdim_rows" else x4
    return (xv, *head, hd, he, *tail)


def _quantize_jit(spec):
    return _quantize_kernel if spec[4] == "rowset" else _hdim_kernel


def _launch_quantize(x4, hd, he, cd, ce, s_pad, **flags):
    spec = _quantize_spec(x4, s_pad, **flags)
    if spec is None:
        return
    dummy = x4.new_empty(4, dtype=torch.uint8)
    fast_launcher(_quantize_jit(spec))[spec[0]](*_quantize_args(spec, x4, hd, he, cd, ce, dummy), **spec[3])


def _v_exponents_spec(src4, sc4, *, from_mx: bool, rceil: bool, warps=None):
    """One ``_seq_exponent_kernel`` launch without its tensors: (grid, the scalars after ``src``, the scale
    strides, the scalars after ``exp``, the constexprs), or None when there is no work."""
    B, S, H, D = src4.shape
    if B * H * S == 0:
        return None
    dp = _d_pad(D)
    tile = _tile("seqexp", dp) if from_mx else _tile("vexp", dp, warps=warps)
    bs = tile.block_s
    n_s_tiles = cdiv(S, bs)
    per = (_seq_chunk(B * H, S, bs, SEQEXP_MIN_PROGRAMS, SEQEXP_MIN_TILES) if from_mx
           else _seq_chunk(B * H, S, bs, VEXP_MIN_PROGRAMS, VEXP_MIN_TILES))
    n_chunks = cdiv(n_s_tiles, per)
    st = src4.stride()
    scs = sc4.stride() if sc4 is not None else (0, 0, 0, 0)
    idx64 = _needs_i64(bs * abs(st[1]), dp * abs(st[3]))
    return ((B * n_chunks * H,), (S, H, *st), tuple(scs), (n_s_tiles, per, _s_load_bound(src4) if from_mx else S),
            dict(D=D, NDP=dp // 32, BLOCK_S=bs, FROM_MX=from_mx, RCEIL=rceil, IDX64=idx64,
                 QU=_unit(src4), SU=_unit(sc4) if sc4 is not None else 0, STAGES=SEQEXP_STAGES if from_mx else VEXP_STAGES,
                 num_warps=tile.num_warps))


def _v_exponents(src4, sc4, *, from_mx: bool, rceil: bool) -> torch.Tensor:
    """Pass 1 of V: int32 (B, 1, H, D) per-channel maxima over S (``_NO_EXP`` where none is nonzero)."""
    B, S, H, D = src4.shape
    exp = torch.full((B, 1, H, D), _NO_EXP_HOST, dtype=torch.int32, device=src4.device)
    spec = _v_exponents_spec(src4, sc4, from_mx=from_mx, rceil=rceil)
    if spec is None:
        return exp
    grid, head, scs, tail, constexprs = spec
    fast_launcher(_seq_exponent_kernel)[grid](
        src4, *head, sc4 if sc4 is not None else exp, *scs, exp, *tail, **constexprs,
    )
    return exp


# V pass 1 from MX: "scales" reads the scale bytes and one block of data per channel
# (``_mx_channel_exponent_kernel``); "data" is the data-first pass (``_seq_exponent_kernel``, every data byte and
# scale byte once; session 15: both passes 61 % of the bytes they move at B8 S8192 H16 d128).
MX_VEXP_PASS = "scales"
MX_VEXP_CHANNELS = 32  # channels per program (CG)
MX_VEXP_SCALE_BLOCKS = 128  # scale rows (seq blocks) per step of the scale loop (SB)
MX_VEXP_REDO_BLOCKS = 4  # seq blocks per step of the full reread (NB), taken only for hand-made all-zero blocks


def _v_exponents_from_mx(q8: torch.Tensor, sc4: torch.Tensor) -> torch.Tensor:
    """Pass 1 of V from MX data bytes ``q8`` (B, S, H, D) and scale bytes ``sc4`` (B, NSB, H, D): int32 (B, 1, H, D)
    per-channel maxima (``_NO_EXP`` where no block is nonzero), by ``MX_VEXP_PASS``."""
    if MX_VEXP_PASS == "data":
        return _v_exponents(q8, sc4, from_mx=True, rceil=True)
    if MX_VEXP_PASS != "scales":
        raise ValueError(f"MX_VEXP_PASS must be 'scales' or 'data', got {MX_VEXP_PASS!r}")
    B, S, H, D = q8.shape
    if B * H * S * D == 0:
        return torch.full((B, 1, H, D), _NO_EXP_HOST, dtype=torch.int32, device=q8.device)
    exp = torch.empty((B, 1, H, D), dtype=torch.int32, device=q8.device)
    nsb = sc4.shape[1]
    cg = MX_VEXP_CHANNELS
    n_cg = cdiv(D, cg)
    sq, ss = q8.stride(), sc4.stride()
    idx64 = _needs_i64(nsb * 32 * abs(sq[1]), cdiv(D, cg) * cg * abs(sq[3])) or _needs_i64(nsb * abs(ss[1]),
                                                                                        n_cg * cg * abs(ss[3]))
    fast_launcher(_mx_channel_exponent_kernel)[(B * H * n_cg,)](
        q8, *sq, sc4, *ss, exp, S, _s_load_bound(q8), H, nsb, n_cg,
        D=D, CG=cg, SB=MX_VEXP_SCALE_BLOCKS, NB=MX_VEXP_REDO_BLOCKS, QU=_unit(q8), SU=_unit(sc4), IDX64=idx64,
        num_warps=4,
    )
    return exp


def _check_group(k_group: int) -> int:
    if not isinstance(k_group, int) or k_group not in (32, 64, 128, 256):
        raise ValueError(f"k_group must be 32, 64, 128 or 256, got {k_group!r}")
    return k_group


# ----------------------------------------------------------------------------------------------
# Host fast path.  The attention API calls these wrappers 3-7 times per call with the same shapes; their
# Python (validation, tile choice, index-width checks, the launcher's key) cost ~40-80 us of host time each on
# the GPU machine, more than the kernels take at S <= 2k.  A plan per call signature keeps everything that
# depends only on the signature; a call with a known signature allocates its outputs and launches.
# ----------------------------------------------------------------------------------------------

_PLANS: dict = {}
_MAX_PLANS = 512  # distinct signatures before the table starts over (shapes that keep changing)
_Tensor = torch.Tensor


def _current_device(x: torch.Tensor) -> int:
    """The current CUDA device for a CUDA tensor (a bound launch runs on it: part of every plan key), else -1."""
    return _launch.current_device() if x.is_cuda else -1


def _plan_key(kind: str, x, scale_mode, seq_dim, k_group):
    """The plan table's key of a float-input call, or None where plans do not apply (another type than a plain
    tensor, a k_group that is not an int (validated on the slow path), tile overrides set for a sweep)."""
    if type(x) is not _Tensor or type(k_group) is not int or TILE_OVERRIDES or not _launch.PLANS:
        return None
    return (kind, x.shape, x.stride(), x.dtype, x.device, _current_device(x), scale_mode, seq_dim, k_group,
            x.data_ptr() & 15, _knobs())


def _trusted_row_scaled(data, exp, dim, group_dim=None, group=1) -> RowScaledFP8:
    """A ``RowScaledFP8`` whose fields a plan has already checked once for this signature (no ``__post_init__``)."""
    r = object.__new__(RowScaledFP8)
    r.data, r.exp, r.dim, r.group_dim, r.group = data, exp, dim, group_dim, group
    return r


class _RowScaledPlan:
    """``row_scaled_triton`` (roles q, k, v) or ``row_scaled_triton_both`` on float input of one signature.

    Built by the validated slow path on its first call, with the values that path computed; ``__call__`` repeats it
    for a tensor of the same signature (``_plan_key``): the same launches, outputs freshly allocated, so every
    tensor argument keeps its dtype and alignment and each ``BoundLaunch`` keys the same kernel."""

    __slots__ = ("kind", "packed", "contig", "B", "S", "H", "D", "dev", "sd", "ndim", "group", "rceil", "s_pad",
                 "qspec", "espec", "qlaunch", "elaunch", "dummy")

    def __init__(self, kind: str, x4: torch.Tensor, packed: bool, contig: bool, ndim: int, rceil: bool, group: int):
        self.kind, self.packed, self.contig, self.ndim, self.rceil, self.group = kind, packed, contig, ndim, rceil, group
        self.B, self.S, self.H, self.D = x4.shape
        self.dev = x4.device
        self.sd = 0 if packed else 1
        self.s_pad = cdiv(max(self.S, 1), SEQ_ALIGN) * SEQ_ALIGN
        v_side = kind in ("v", "both")
        if kind == "v":
            flags = dict(HDIM=False, SEQ=True, HDIM_GROUP=0, SEQ_RS=True, group=0)
        elif kind == "both":
            flags = dict(HDIM=True, SEQ=True, HDIM_GROUP=group, SEQ_RS=True, group=group)
        else:
            flags = dict(HDIM=True, SEQ=False, HDIM_GROUP=group if kind == "k" else 1, SEQ_RS=False,
                         group=group if kind == "k" else 0)
        self.qspec = _quantize_spec(x4, self.s_pad if v_side else SEQ_ALIGN, rceil=rceil, **flags)
        self.espec = _v_exponents_spec(x4, None, from_mx=False, rceil=rceil) if v_side else None
        self.qlaunch = self.elaunch = None
        self.dummy = x4.new_empty(4, dtype=torch.uint8)

    def _quantize(self, x4, hd, he, cd, ce) -> None:
        args = _quantize_args(self.qspec, x4, hd, he, cd, ce, self.dummy)
        if self.qlaunch is None:
            self.qlaunch = BoundLaunch(fast_launcher(_quantize_jit(self.qspec)), self.qspec[0], args, self.qspec[3])
        else:
            self.qlaunch(*args)

    def _v_exponents(self, x4) -> torch.Tensor:
        exp = torch.full((self.B, 1, self.H, self.D), _NO_EXP_HOST, dtype=torch.int32, device=self.dev)
        grid, head, scs, tail, constexprs = self.espec
        args = (x4, *head, exp, *scs, exp, *tail)
        if self.elaunch is None:
            self.elaunch = BoundLaunch(fast_launcher(_seq_exponent_kernel), grid, args, constexprs)
        else:
            self.elaunch(*args)
        return exp

    def __call__(self, x: torch.Tensor):
        x4 = x.unsqueeze(0) if self.packed else x
        if self.contig:
            x4 = x4.contiguous()
        B, S, H, D, dev, packed = self.B, self.S, self.H, self.D, self.dev, self.packed
        kind, sd = self.kind, self.sd
        u8 = torch.uint8
        if kind in ("v", "both"):
            vexp = self._v_exponents(x4)
            cd = torch.empty(B, H, D, self.s_pad, dtype=u8, device=dev)
            hd = kexp = None
            if kind == "both":
                hd = torch.empty(B, S, H, D, dtype=u8, device=dev)
                kexp = torch.empty(B, cdiv(S, self.group), H, 1, dtype=torch.int32, device=dev)
            self._quantize(x4, hd, kexp, cd, vexp)
            seq = _trusted_row_scaled(_seq_view(cd, S, packed), _unpack(vexp, packed), sd)
            if kind == "v":
                return seq
            hdim = _trusted_row_scaled(_unpack(hd, packed).view(torch.float8_e4m3fn), _unpack(kexp, packed),
                                       self.ndim - 1, sd, self.group)
            return hdim, seq
        hd = torch.empty(B, S, H, D, dtype=u8, device=dev)
        rows = S if kind == "q" else cdiv(S, self.group)
        exp = torch.empty(B, rows, H, 1, dtype=torch.int32, device=dev)
        self._quantize(x4, hd, exp, None, None)
        data = _unpack(hd, packed).view(torch.float8_e4m3fn)
        if kind == "q":
            return _trusted_row_scaled(data, _unpack(exp, packed), self.ndim - 1)
        return _trusted_row_scaled(data, _unpack(exp, packed), self.ndim - 1, sd, self.group)


def _new_plan(key, kind: str, x: torch.Tensor, x4: torch.Tensor, packed: bool, rceil: bool, group: int):
    """Record the plan of a validated call (``x4`` the canonical, D-contiguous view of ``x``) and run it."""
    plan = _RowScaledPlan(kind, x4, packed, x.stride(-1) != 1, x.ndim, rceil, group)  # (_check_float_input's copy)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan(x)


def _quant_slot(spec, x4, hd, he, cd, ce, dummy) -> tuple[tuple, dict, int]:
    """A ``_quantize_spec`` as one quantize job of ``_operands_kernel``: (arguments, constexprs, programs)."""
    grid, head, tail, c, kind = spec
    args = _quantize_args(spec, x4, hd, he, cd, ce, dummy)
    if kind != "rowset":  # a head-dim job in the slot's argument list: no seq outputs
        c = dict(c, HDIM=True, SEQ=False, HDIM_GROUP=c["GROUP"], SEQ_RS=False)
        args = (*args[:8], dummy, dummy, 0, 0, *tail)
    return args, dict(c, ROWSET=kind == "rowset"), grid[0]


def _exp_slot(spec, x4, exp) -> tuple[tuple, dict, int]:
    """A ``_v_exponents_spec`` (float input) as one exponent job of ``_operands_kernel``."""
    grid, head, _, tail, c = spec
    return (x4, *head, exp, *tail[:2]), c, grid[0]


# the arguments of an unused job (None: a pointer, given the launch's dummy tensor; the job's code is not compiled)
_NO_QUANT_JOB = (None, 0, 0, 0, 0, 0, None, None, None, None, 0, 0, 0, 0)
_NO_EXP_JOB = (None, 0, 0, 0, 0, 0, 0, None, 0, 0)


def _operands_launch(state: dict, name: str, quant: list, exps: list, D: int, rceil: bool, soft: bool,
                     dummy: torch.Tensor) -> None:
    """Launch up to two quantize jobs and two exponent jobs (``_quant_slot`` / ``_exp_slot`` results) as one
    ``_operands_kernel`` grid, bound in ``state[name]`` by the first call (which also works out the constexprs)."""
    empties = state.get("empty jobs")
    if empties is None:  # the unused jobs' arguments, made once per plan
        empties = state["empty jobs"] = tuple(tuple(dummy if x is None else x for x in e)
                                              for e in (_NO_QUANT_JOB, _NO_EXP_JOB))
    args = []
    n = []
    for jobs, empty in ((quant, empties[0]), (exps, empties[1])):
        for i in range(2):
            if i < len(jobs):
                args += jobs[i][0]
                n.append(jobs[i][2])
            else:
                args += empty
                n.append(0)
    args += n[:3]
    bound = state.get(name)
    if bound is not None:
        bound(*args)
        return args
    qa = list(quant) + [None] * (2 - len(quant))
    ea = list(exps) + [None] * (2 - len(exps))
    present = [j for j in qa + ea if j is not None]
    c = dict(D=D, NDP=_d_pad(D) // 32, RCEIL=rceil, SOFT=soft, IDX64=any(j[1]["IDX64"] for j in present),
             num_warps=max(j[1]["num_warps"] for j in present))
    for tag, job in (("A", qa[0]), ("B", qa[1])):
        jc = job[1] if job is not None else dict(BLOCK_S=32, HDIM=False, SEQ=False, HDIM_GROUP=0, SEQ_RS=False,
                                                 ROWSET=True)
        c.update({tag: job is not None, f"{tag}_BS": jc["BLOCK_S"], f"{tag}_HDIM": jc["HDIM"], f"{tag}_SEQ": jc["SEQ"],
                  f"{tag}_GROUP": jc["HDIM_GROUP"], f"{tag}_RS": jc["SEQ_RS"], f"{tag}_ROWSET": jc["ROWSET"],
                  f"{tag}_EVEN": jc.get("EVEN", False), f"{tag}_J": jc.get("J", 1)})
    for tag, job in (("E", ea[0]), ("F", ea[1])):
        c.update({tag: job is not None, f"{tag}_BS": job[1]["BLOCK_S"] if job is not None else 32,
                  f"{tag}_STAGES": job[1]["STAGES"] if job is not None else 1})
    state[name] = BoundLaunch(fast_launcher(_operands_kernel), (sum(n),), tuple(args), c)
    return args


class _ArgTemplate:
    """A bound launch's positional arguments with the call's tensors as slots (session 22): a plan fills them from the
    call's sources (inputs and fresh outputs) by position instead of assembling the jobs' arguments again, ~10 us of
    Python a forward on the CPU harness.  ``of`` finds each tensor argument among ``sources`` (itself, or a
    ``view`` of one by dtype or by shape, checked by rebuilding it) or among ``constants`` (the plan's own tensors);
    None if any tensor is neither, or if two sources share an address (a later call's would not)."""

    __slots__ = ("const", "slots")

    def __init__(self, const: list, slots: tuple):
        self.const, self.slots = const, slots

    @staticmethod
    def of(args, sources, constants) -> "Optional[_ArgTemplate]":
        ptrs = [t.data_ptr() for t in sources]
        if len(set(ptrs)) != len(ptrs):
            return None
        const, slots = list(args), []
        for i, a in enumerate(args):
            if not isinstance(a, _Tensor) or any(a is c for c in constants):
                continue
            for j, src in enumerate(sources):
                if a is src:
                    slots.append((i, j, None))
                    break
                if a.data_ptr() == ptrs[j] and a.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                    how = a.dtype if a.dtype != src.dtype else tuple(a.shape)
                    try:
                        r = src.view(how)
                    except RuntimeError:
                        return None
                    if (r.dtype, r.shape, r.stride()) != (a.dtype, a.shape, a.stride()):
                        return None
                    slots.append((i, j, how))
                    break
            else:
                return None
            const[i] = None
        return _ArgTemplate(const, tuple(slots))

    def fill(self, sources) -> list:
        args = self.const.copy()
        for i, j, how in self.slots:
            src = sources[j]
            args[i] = src if how is None else src.view(how)
        return args


class _TemplatedLaunches:
    """The two ``_operands_kernel`` launches of a plan (``bound["first"]``, ``bound["second"]``), repeated from
    argument templates (``_ArgTemplate``) once a call has made them."""

    def _init_templates(self) -> None:
        self.bound: dict = {}
        self.templates = None  # the two launches' ``_ArgTemplate``s (``_template``)
        self.tries = 0

    def _template(self, args, srcs) -> None:
        """Make the two launches' templates from a call's arguments (``_ArgTemplate.of``); after two calls that
        could not (inputs sharing an address, an argument it does not know), ``False``: the plan keeps assembling."""
        if self.templates is None and self.bound.get("first") is not None and self.bound.get("second") is not None:
            t = [_ArgTemplate.of(a, srcs, (self.dummy,)) for a in args]
            self.tries += 1
            if all(t):
                self.templates = t
            elif self.tries >= 2:
                self.templates = False

    def _launch_templates(self, srcs) -> None:
        for name, t in zip(("first", "second"), self.templates):
            self.bound[name](*t.fill(srcs))


class _ForwardOperandsPlan(_TemplatedLaunches):
    """``forward_operands_triton`` for one signature of (q, k, v): specs computed once, two launches per call."""

    def __init__(self, q4, k4, v4, rceil: bool, keep_kv: bool, group: int):
        self.rceil, self.keep_kv, self.group = rceil, keep_kv, group
        self.shapes = (q4.shape, k4.shape)
        self.dev = q4.device
        self.D = q4.shape[3]
        self.soft = _soft(self.dev)
        Sk = k4.shape[1]
        self.s_pad = cdiv(max(Sk, 1), SEQ_ALIGN) * SEQ_ALIGN
        if keep_kv:
            warps = None  # first launch: Q and the two exponent passes, all at their own 4 warps
            self.k_exp_spec = _v_exponents_spec(k4, None, from_mx=False, rceil=rceil)
            both = dict(HDIM=True, SEQ=True, HDIM_GROUP=group, SEQ_RS=True, rceil=rceil, group=group)
            self.k_spec = _quantize_spec(k4, self.s_pad, **both)
            self.v_spec = _quantize_spec(v4, self.s_pad, **both)
        else:
            if FWD_K_LAUNCH not in ("first", "second"):
                raise ValueError(f"FWD_K_LAUNCH must be 'first' or 'second', got {FWD_K_LAUNCH!r}")
            self.k_first = FWD_K_LAUNCH == "first"
            self.k_spec = _quantize_spec(k4, SEQ_ALIGN, HDIM=True, SEQ=False, HDIM_GROUP=group, SEQ_RS=False,
                                         rceil=rceil, group=group, warps=FWD_K_WARPS)
            kw = self.k_spec[3]["num_warps"] if self.k_spec is not None else None
            self.v_spec = _quantize_spec(v4, self.s_pad, HDIM=False, SEQ=True, HDIM_GROUP=0, SEQ_RS=True,
                                         rceil=rceil, group=0, warps=None if self.k_first else kw)
            # the launch K rides in runs at K's warps (its tile is a whole exponent group): the other jobs of that
            # launch take tiles of as many warps, at their own elements per thread
            warps = kw if self.k_first else None
        self.q_spec = _quantize_spec(q4, SEQ_ALIGN, HDIM=True, SEQ=False, HDIM_GROUP=1, SEQ_RS=False, rceil=rceil,
                                     group=0, warps=warps)
        self.v_exp_spec = _v_exponents_spec(v4, None, from_mx=False, rceil=rceil, warps=warps)
        self.dummy = q4.new_empty(4, dtype=torch.uint8)
        self._init_templates()

    def __call__(self, q4, k4, v4):
        (B, Sq, Hq, D), (_, Sk, Hkv, _) = self.shapes
        dev, u8, i32, G, dummy = self.dev, torch.uint8, torch.int32, self.group, self.dummy
        qd = torch.empty(B, Sq, Hq, D, dtype=u8, device=dev)
        qe = torch.empty(B, Sq, Hq, 1, dtype=i32, device=dev)
        if self.keep_kv:  # V's and K's sentinel-filled exponents: one allocation and one fill for both
            vexp, kexp_s = torch.full((2, B, 1, Hkv, D), _NO_EXP_HOST, dtype=i32, device=dev).unbind(0)
        else:
            vexp = torch.full((B, 1, Hkv, D), _NO_EXP_HOST, dtype=i32, device=dev)
        kd = torch.empty(B, Sk, Hkv, D, dtype=u8, device=dev)
        ke = torch.empty(B, cdiv(Sk, G), Hkv, 1, dtype=i32, device=dev)
        vcd = torch.empty(B, Hkv, D, self.s_pad, dtype=u8, device=dev)
        f8 = torch.float8_e4m3fn
        if not self.keep_kv:
            srcs = (q4, k4, v4, qd, qe, vexp, kd, ke, vcd)
            if self.templates:
                self._launch_templates(srcs)
            else:
                q_job = _quant_slot(self.q_spec, q4, qd, qe, None, None, dummy)
                k_job = _quant_slot(self.k_spec, k4, kd, ke, None, None, dummy)
                v_job = _quant_slot(self.v_spec, v4, None, None, vcd, vexp, dummy)
                first, second = ([q_job, k_job], [v_job]) if self.k_first else ([q_job], [v_job, k_job])
                args = (_operands_launch(self.bound, "first", first, [_exp_slot(self.v_exp_spec, v4, vexp)], D,
                                         self.rceil, self.soft, dummy),
                        _operands_launch(self.bound, "second", second, [], D, self.rceil, self.soft, dummy))
                self._template(args, srcs)
            return (_trusted_row_scaled(qd.view(f8), qe, 3), _trusted_row_scaled(kd.view(f8), ke, 3, 1, G),
                    _trusted_row_scaled(_seq_view(vcd, Sk, False), vexp, 1), None)
        kcd = torch.empty(B, Hkv, D, self.s_pad, dtype=u8, device=dev)
        vd = torch.empty(B, Sk, Hkv, D, dtype=u8, device=dev)
        ve = torch.empty(B, cdiv(Sk, G), Hkv, 1, dtype=i32, device=dev)
        srcs = (q4, k4, v4, qd, qe, vexp, kexp_s, kd, ke, vcd, kcd, vd, ve)
        if self.templates:
            self._launch_templates(srcs)
        else:
            q_job = _quant_slot(self.q_spec, q4, qd, qe, None, None, dummy)
            args = (_operands_launch(self.bound, "first", [q_job], [_exp_slot(self.k_exp_spec, k4, kexp_s),
                                                                    _exp_slot(self.v_exp_spec, v4, vexp)], D,
                                     self.rceil, self.soft, dummy),
                    _operands_launch(self.bound, "second", [_quant_slot(self.k_spec, k4, kd, ke, kcd, kexp_s, dummy),
                                                            _quant_slot(self.v_spec, v4, vd, ve, vcd, vexp, dummy)],
                                     [], D, self.rceil, self.soft, dummy))
            self._template(args, srcs)
        kr = _trusted_row_scaled(kd.view(f8), ke, 3, 1, G)
        k_seq = _trusted_row_scaled(_seq_view(kcd, Sk, False), kexp_s, 1)
        v_hdim = _trusted_row_scaled(vd.view(f8), ve, 3, 1, G)
        vr = _trusted_row_scaled(_seq_view(vcd, Sk, False), vexp, 1)
        return _trusted_row_scaled(qd.view(f8), qe, 3), kr, vr, (kr, k_seq, v_hdim)


class _BothPairPlan(_TemplatedLaunches):
    """``row_scaled_triton_both_pair`` for one signature: two launches per call."""

    def __init__(self, x4, y4, rceil: bool, group: int):
        self.rceil, self.group = rceil, group
        self.shape = x4.shape
        self.dev = x4.device
        self.soft = _soft(self.dev)
        self.s_pad = cdiv(max(x4.shape[1], 1), SEQ_ALIGN) * SEQ_ALIGN
        both = dict(HDIM=True, SEQ=True, HDIM_GROUP=group, SEQ_RS=True, rceil=rceil, group=group)
        self.specs = [(_v_exponents_spec(t, None, from_mx=False, rceil=rceil), _quantize_spec(t, self.s_pad, **both))
                      for t in (x4, y4)]
        self.dummy = x4.new_empty(4, dtype=torch.uint8)
        self._init_templates()

    def __call__(self, x4, y4):
        B, S, H, D = self.shape
        dev, G, i32, u8 = self.dev, self.group, torch.int32, torch.uint8
        ex, ey = torch.full((2, B, 1, H, D), _NO_EXP_HOST, dtype=i32, device=dev).unbind(0)  # one fill for both
        xd, yd = (torch.empty(B, S, H, D, dtype=u8, device=dev) for _ in range(2))
        xe, ye = (torch.empty(B, cdiv(S, G), H, 1, dtype=i32, device=dev) for _ in range(2))
        xc, yc = (torch.empty(B, H, D, self.s_pad, dtype=u8, device=dev) for _ in range(2))
        srcs = (x4, y4, ex, ey, xd, yd, xe, ye, xc, yc)
        if self.templates:
            self._launch_templates(srcs)
        else:
            (xs, xq), (ys, yq) = self.specs
            args = (_operands_launch(self.bound, "first", [], [_exp_slot(xs, x4, ex), _exp_slot(ys, y4, ey)], D,
                                     self.rceil, self.soft, self.dummy),
                    _operands_launch(self.bound, "second", [_quant_slot(xq, x4, xd, xe, xc, ex, self.dummy),
                                                            _quant_slot(yq, y4, yd, ye, yc, ey, self.dummy)], [],
                                     D, self.rceil, self.soft, self.dummy))
            self._template(args, srcs)
        f8 = torch.float8_e4m3fn
        return ((_trusted_row_scaled(xd.view(f8), xe, 3, 1, G), _trusted_row_scaled(_seq_view(xc, S, False), ex, 1)),
                (_trusted_row_scaled(yd.view(f8), ye, 3, 1, G), _trusted_row_scaled(_seq_view(yc, S, False), ey, 1)))


def row_scaled_triton_both_pair(x: torch.Tensor, y: torch.Tensor, scale_mode: Union[str, ScaleMode] = "rceil",
                                k_group: int = 128):
    """``(row_scaled_triton_both(x), row_scaled_triton_both(y))`` for two float (B, S, H, D) tensors of one shape and
    dtype (the backward's q and dO) in two launches instead of four, bit for bit."""
    key = None
    if type(x) is _Tensor and type(y) is _Tensor and type(k_group) is int and not TILE_OVERRIDES and _launch.PLANS:
        key = _pair_key(x, y, scale_mode, k_group)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(*(t if t.stride(3) == 1 else t.contiguous() for t in (x, y)))
    group = _check_group(k_group)
    mode = ScaleMode.parse(scale_mode)
    x4, px = _check_float_input(x, "x", None)
    y4, py = _check_float_input(y, "y", None)
    if px or py or tuple(x4.shape) != tuple(y4.shape) or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(f"row_scaled_triton_both_pair takes two (B, S, H, D) tensors of one shape, dtype and device, "
                         f"got {tuple(x.shape)} {x.dtype} and {tuple(y.shape)} {y.dtype}")
    if x4.numel() == 0:
        return (row_scaled_triton_both(x, mode, k_group=group), row_scaled_triton_both(y, mode, k_group=group))
    plan = _BothPairPlan(x4, y4, mode is ScaleMode.RCEIL, group)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan(x4, y4)


def _pair_key(x, y, scale_mode, k_group) -> tuple:
    return ("pair", x.shape, x.stride(), y.shape, y.stride(), x.dtype, y.dtype, x.device, y.device,
            _current_device(x), scale_mode, k_group, x.data_ptr() & 15, y.data_ptr() & 15, _knobs())


def both_pair_plan(x: torch.Tensor, y: torch.Tensor, scale_mode, k_group: int):
    """The plan a call of ``row_scaled_triton_both_pair`` with these arguments made, callable as ``plan(x, y)``;
    None if none was made or where the call would copy an input (for ``interface``'s backward call plans)."""
    if x.stride(3) != 1 or y.stride(3) != 1 or TILE_OVERRIDES or not _launch.PLANS:
        return None
    return _PLANS.get(_pair_key(x, y, scale_mode, k_group))


def forward_operands_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_mode, k_group: int,
                          keep_kv: bool):
    """The plan a call of ``forward_operands_triton`` with these arguments made, callable as ``plan(q, k, v)`` on
    tensors of the same signature; None if none was made, or where the call would copy an input (a head dim that
    is not contiguous).  For ``interface``'s call plans, which keep it and skip this function's key."""
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or TILE_OVERRIDES or not _launch.PLANS:
        return None
    return _PLANS.get(_forward_key(q, k, v, scale_mode, k_group, keep_kv))


def _forward_key(q, k, v, scale_mode, k_group, keep_kv) -> tuple:
    return ("forward", keep_kv, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, _current_device(q), scale_mode, k_group, q.data_ptr() & 15,
            k.data_ptr() & 15, v.data_ptr() & 15, _knobs())


def forward_operands_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale_mode: Union[str, ScaleMode] = "rceil", k_group: int = 128, keep_kv: bool = False):
    """The attention forward's three Hopper operands from float (B, S, H, D) q, k, v in two launches instead of
    four: ``(row_scaled_triton(q, "q"), row_scaled_triton(k, "k", k_group=k_group), row_scaled_triton(v, "v"),
    kv)``, bit for bit.  The first launch quantizes Q and K and finds V's per-channel exponents; the second writes V.
    ``keep_kv``: also the backward's K and V operands, ``kv = (K hdim, K seq, V hdim)`` as
    ``row_scaled_triton_both`` makes them (each tensor still read once per pass); else ``kv`` is None."""
    key = None
    if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and type(k_group) is int \
            and not TILE_OVERRIDES and _launch.PLANS:
        key = _forward_key(q, k, v, scale_mode, k_group, keep_kv)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(*(x if x.stride(3) == 1 else x.contiguous() for x in (q, k, v)))
    group = _check_group(k_group)
    mode = ScaleMode.parse(scale_mode)
    q4, pq = _check_float_input(q, "q", None)
    k4, pk = _check_float_input(k, "k", None)
    v4, pv = _check_float_input(v, "v", None)
    if pq or pk or pv or not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("forward_operands_triton takes (B, S, H, D) q, k, v of one dtype on one device")
    if q4.shape[3] != k4.shape[3] or tuple(k4.shape) != tuple(v4.shape) or q4.shape[0] != k4.shape[0]:
        raise ValueError(f"q {tuple(q4.shape)}, k {tuple(k4.shape)}, v {tuple(v4.shape)}: k and v must have one "
                         "shape, q the same batch and head dim")
    if q4.numel() == 0 or k4.numel() == 0:  # nothing to fuse: the single passes handle empty tensors
        qr = row_scaled_triton(q, "q", mode)
        if keep_kv:
            kr, k_seq = row_scaled_triton_both(k, mode, k_group=group)
            v_hdim, vr = row_scaled_triton_both(v, mode, k_group=group)
            return qr, kr, vr, (kr, k_seq, v_hdim)
        return qr, row_scaled_triton(k, "k", mode, k_group=group), row_scaled_triton(v, "v", mode), None
    plan = _ForwardOperandsPlan(q4, k4, v4, mode is ScaleMode.RCEIL, keep_kv, group)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan(q4, k4, v4)


def row_scaled_triton(
    x: Union[torch.Tensor, MXTensor],
    role: str,
    scale_mode: Union[str, ScaleMode] = "rceil",
    seq_dim: Optional[int] = None,
    k_group: int = 128,
) -> RowScaledFP8:
    """The Hopper attention operand (``RowScaledFP8``) for ``role`` ``"q"``, ``"k"`` or ``"v"``.

    ``x``: a bf16/fp16/fp32 tensor (B, S, H, D) / packed (T, H, D) — equal to
    ``formats.row_scaled_from_float(x, dim, group_dim, group, scale_mode)`` — or an ``MXTensor`` of that
    shape blocked along D (q, k) or along S (v) — equal to ``formats.to_row_scaled(x, group_dim, group)``
    (``scale_mode`` is then unused).  Layouts:
      q: dim=-1, exp (B, S, H, 1); k: dim=-1, group_dim=seq, group=k_group, exp (B, ceil(S/k_group), H, 1);
      v: dim=seq, exp (B, 1, H, D), data the (B, S, H, D) view of a channel-major (B, H, D, S_pad) buffer.
    q and k data are contiguous (B, S, H, D).  V takes two passes (exponents, then data).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    key = _plan_key(role, x, scale_mode, seq_dim, k_group)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan(x)
    group = _check_group(k_group) if role == "k" else 1
    if isinstance(x, MXTensor):
        return _row_scaled_from_mx(x, role, seq_dim, group)
    mode = ScaleMode.parse(scale_mode)
    x4, packed = _check_float_input(x, "x", seq_dim)
    B, S, H, D = x4.shape
    dev = x4.device
    rceil = mode is ScaleMode.RCEIL
    if key is not None and B * H * S > 0:
        return _new_plan(key, role, x, x4, packed, rceil, group)
    sd = 0 if packed else 1
    if role == "v":
        exp = _v_exponents(x4, None, from_mx=False, rceil=rceil)
        cd, s_pad = _channel_major_buffer(B, H, D, S, dev)
        _launch_quantize(x4, None, None, cd, exp, s_pad, HDIM=False, SEQ=True, HDIM_GROUP=0, SEQ_RS=True,
                         rceil=rceil, group=0)
        if S == 0:
            exp.fill_(0)
        return RowScaledFP8(_seq_view(cd, S, packed), _unpack(exp, packed), sd)
    hd = torch.empty(B, S, H, D, dtype=torch.uint8, device=dev)
    if role == "q":
        exp = torch.empty(B, S, H, 1, dtype=torch.int32, device=dev)
    else:
        exp = torch.empty(B, cdiv(S, group), H, 1, dtype=torch.int32, device=dev)
    _launch_quantize(x4, hd, exp, None, None, SEQ_ALIGN, HDIM=True, SEQ=False,
                     HDIM_GROUP=group if role == "k" else 1, SEQ_RS=False, rceil=rceil, group=group if role == "k" else 0)
    data = _unpack(hd, packed).view(torch.float8_e4m3fn)
    if role == "q":
        return RowScaledFP8(data, _unpack(exp, packed), x.ndim - 1)
    return RowScaledFP8(data, _unpack(exp, packed), x.ndim - 1, group_dim=sd, group=group)


def row_scaled_triton_both(
    x: torch.Tensor,
    scale_mode: Union[str, ScaleMode] = "rceil",
    seq_dim: Optional[int] = None,
    k_group: int = 128,
) -> tuple[RowScaledFP8, RowScaledFP8]:
    """``(row_scaled_triton(x, "k", k_group=k_group), row_scaled_triton(x, "v"))``, bit for bit, from two
    launches instead of three: the V layout's per-channel exponent pass, then one pass that reads ``x`` once and
    writes both the head-dim (K layout) and the channel-major sequence operand.  The backward needs Q, K and dO
    in both orientations; each launch costs ~70-90 us of host time on the H200 (scripts/host_timing.py), which
    dominates small calls.  Float input only (bf16/fp16/fp32, (B, S, H, D) or packed (T, H, D))."""
    key = _plan_key("both", x, scale_mode, seq_dim, k_group)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan(x)
    group = _check_group(k_group)
    mode = ScaleMode.parse(scale_mode)
    x4, packed = _check_float_input(x, "x", seq_dim)
    B, S, H, D = x4.shape
    if key is not None and B * H * S > 0:
        return _new_plan(key, "both", x, x4, packed, mode is ScaleMode.RCEIL, group)
    if S == 0:  # no token: the fused pass would still cover the seq padding, where the K layout has no group
        return (row_scaled_triton(x, "k", mode, seq_dim, group), row_scaled_triton(x, "v", mode, seq_dim))
    dev = x4.device
    rceil = mode is ScaleMode.RCEIL
    sd = 0 if packed else 1
    vexp = _v_exponents(x4, None, from_mx=False, rceil=rceil)
    cd, s_pad = _channel_major_buffer(B, H, D, S, dev)
    hd = torch.empty(B, S, H, D, dtype=torch.uint8, device=dev)
    kexp = torch.empty(B, cdiv(S, group), H, 1, dtype=torch.int32, device=dev)
    _launch_quantize(x4, hd, kexp, cd, vexp, s_pad, HDIM=True, SEQ=True, HDIM_GROUP=group, SEQ_RS=True,
                     rceil=rceil, group=group)
    hdim = RowScaledFP8(_unpack(hd, packed).view(torch.float8_e4m3fn), _unpack(kexp, packed), x.ndim - 1,
                        group_dim=sd, group=group)
    return hdim, RowScaledFP8(_seq_view(cd, S, packed), _unpack(vexp, packed), sd)


def _row_scaled_from_mx(mx: MXTensor, role: str, seq_dim: Optional[int], group: int) -> RowScaledFP8:
    q4, packed = _canon_bshd(mx.data, "x.data", seq_dim)
    sc4 = mx.scale_bytes.unsqueeze(0) if packed else mx.scale_bytes
    B, S, H, D = q4.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"x.data: head dim D={D} is out of range [1, {MAX_HEAD_DIM}]")
    _check_device(mx.data, "x.data")
    bdim = mx.dim + (1 if packed else 0)
    want = 1 if role == "v" else 3
    if bdim != want:
        orient = "seq (dim=seq_dim)" if role == "v" else "hdim (dim=-1)"
        raise ValueError(f"role {role!r} needs an MXTensor blocked along {orient}, got dim={mx.dim}")
    dev = q4.device
    q8 = q4.view(torch.uint8)
    dp = _d_pad(D)
    sd = 0 if packed else 1
    soft = _soft(dev)
    if role == "v":
        exp = _v_exponents_from_mx(q8, sc4)
        cd, s_pad = _channel_major_buffer(B, H, D, S, dev)
        wspec = _mx_seq_words_spec(q8, sc4, kind="mx_seq_v")
        if wspec is not None and MX_SEQ_V_ROWS is not None and "mx_seq_v" not in TILE_OVERRIDES:  # rows of channels
            qw, _, _, idx = wspec
            bs, cg, warps = MX_SEQ_V_ROWS
            n_tiles, n_cg = cdiv(s_pad, bs), cdiv(D, cg)
            fast_launcher(_seq_rescale_rows_kernel)[(B * H * n_cg * n_tiles,)](
                qw, qw.stride(0), qw.stride(1), qw.stride(2), sc4, *sc4.stride(), cd.view(torch.int32), exp, S, H,
                s_pad, n_tiles, n_cg, D=D, CG=cg, BLOCK_S=bs, SOFT=soft,
                IDX64=idx or _needs_i64(n_cg * cg * s_pad, bs, cdiv(bs, 32) * abs(sc4.stride(1))),
                EVEN=S % bs == 0 and s_pad == S and D % cg == 0, num_warps=warps,
            )
            return RowScaledFP8(_seq_view(cd, S, packed), _unpack(exp, packed), sd)
        if wspec is not None:  # channel-major data in whole words: channel-major words out
            qw, bs, warps, idx = wspec
            n_tiles = cdiv(s_pad, bs)
            fast_launcher(_seq_rescale_kernel)[(B * n_tiles * H,)](
                qw, qw.stride(0), qw.stride(1), qw.stride(2), sc4, *sc4.stride(), cd.view(torch.int32), exp, S, H,
                s_pad, n_tiles, D=D, NDP=dp // 32, BLOCK_S=bs, SOFT=soft, IDX64=idx or _needs_i64(dp * s_pad, bs),
                EVEN=S % bs == 0 and s_pad == S, num_warps=warps,
            )
            return RowScaledFP8(_seq_view(cd, S, packed), _unpack(exp, packed), sd)
        tile = _tile("rescale", dp)
        n_s_tiles = cdiv(max(S, s_pad), tile.block_s)
        if B * H > 0:
            idx = _needs_i64(tile.block_s * abs(q8.stride(1)), dp * abs(q8.stride(3))) or _needs_i64(dp * s_pad, tile.block_s)
            fast_launcher(_rescale_mx_kernel)[(B * n_s_tiles * H,)](
                q8, *q8.stride(), sc4, *sc4.stride(), cd, exp, S, H, s_pad, n_s_tiles, 1, _s_load_bound(q8),
                D=D, NDP=dp // 32, BLOCK_S=tile.block_s, SEQ=True, GROUP=1, SOFT=soft, IDX64=idx,
                QU=_unit(q8), SU=_unit(sc4),
                num_warps=tile.num_warps,
            )
        if S == 0:
            exp.fill_(0)
        return RowScaledFP8(_seq_view(cd, S, packed), _unpack(exp, packed), sd)
    tile = _tile("k" if role == "k" else "rescale", dp, group)
    hd = torch.empty(B, S, H, D, dtype=torch.uint8, device=dev)
    n_groups = cdiv(S, group)
    if role == "q":
        exp = torch.empty(B, S, H, 1, dtype=torch.int32, device=dev)
    else:
        exp = torch.empty(B, n_groups, H, 1, dtype=torch.int32, device=dev)
    n_s_tiles = cdiv(S, tile.block_s)
    hspec = _mx_hdim_spec(q8, sc4, group if role == "k" else 1, words=True)
    if hspec is not None:  # unit stride along D, whole words: the head-dim tile
        (qv, sv, Sv, Hv, n_tiles, bs, warps, idx) = hspec
        fast_launcher(_hdim_rescale_kernel)[(qv.shape[0] * n_tiles * Hv,)](
            qv, Sv, Hv, qv.stride(0), qv.stride(1), qv.stride(2), sv, sv.stride(0), sv.stride(1), sv.stride(2),
            hd.view(torch.int32), exp, n_tiles, n_groups, D=D, NDP=dp // 32, BLOCK_S=bs,
            GROUP=group if role == "k" else 1, SOFT=soft, IDX64=idx, num_warps=warps,
        )
    elif B * H * S > 0:
        idx = _needs_i64(tile.block_s * abs(q8.stride(1)), dp * abs(q8.stride(3))) or _needs_i64(tile.block_s * H * D, dp)
        fast_launcher(_rescale_mx_kernel)[(B * n_s_tiles * H,)](
            q8, *q8.stride(), sc4, *sc4.stride(), hd, exp, S, H, SEQ_ALIGN, n_s_tiles, n_groups, _s_load_bound(q8),
            D=D, NDP=dp // 32, BLOCK_S=tile.block_s, SEQ=False, GROUP=group if role == "k" else 1,
            SOFT=soft, IDX64=idx, QU=_unit(q8), SU=_unit(sc4), num_warps=tile.num_warps,
        )
    data = _unpack(hd, packed).view(torch.float8_e4m3fn)
    if role == "q":
        return RowScaledFP8(data, _unpack(exp, packed), mx.ndim - 1)
    return RowScaledFP8(data, _unpack(exp, packed), mx.ndim - 1, group_dim=sd, group=group)


def _mx_hdim_spec(q8: torch.Tensor, sc4: torch.Tensor, group: int, words: bool = False):
    """For MX data (B, S, H, D) bytes blocked along D with unit stride along D and ND, the head-dim tile's launch:
    (data (as int32 words of 4 bytes when ``words``), scales (their (1, B*S*H, 1, .) row views when both have evenly
    spaced rows and ``group`` <= 1), S, H of those, tiles along S, BLOCK_S, warps, IDX64); None when the strides (or,
    for words, D or the alignment) do not allow it or there is no work."""
    B, S, H, D = q8.shape
    if B * S * H == 0 or (D > 1 and q8.stride(3) != 1) or (sc4.shape[3] > 1 and sc4.stride(3) != 1):
        return None
    if words:
        if D % 4 or q8.storage_offset() % 4 or any(st % 4 for st in q8.stride()[:3]) or q8.data_ptr() % 4:
            return None
        q8 = q8.view(torch.int32)
    qv, sv = q8, sc4
    if group <= 1:
        qr, sr = _rows_view(q8), _rows_view(sc4)
        if qr is not None and sr is not None:
            qv, sv = qr, sr
    dp = _d_pad(D)
    tile = _tile("mx_hdim_k" if group > 1 else "mx_hdim", dp, group)
    if group > 1 and tile.block_s % group:
        raise ValueError(f"a K tile holds whole exponent groups: block_s {tile.block_s}, group {group}")
    _, Sv, Hv, _ = qv.shape
    idx = (_needs_i64(tile.block_s * abs(qv.stride(1)), dp) or _needs_i64(tile.block_s * abs(sv.stride(1)), dp)
           or _needs_i64(tile.block_s * Hv * D, dp))  # (words: offsets in words, counted here as bytes)
    return qv, sv, Sv, Hv, cdiv(Sv, tile.block_s), tile.block_s, tile.num_warps, idx


def _mx_seq_words_spec(q8: torch.Tensor, sc4: torch.Tensor, warps: Optional[int] = None, kind: str = "mx_seq"):
    """For MX data (B, S, H, D) bytes blocked along S with unit stride along S (a channel-major buffer's view), the
    launch of a kernel on ``_row_set_coords``' words (``_seq_dequant_kernel``, ``_seq_rescale_kernel``): (the data as
    int32 words (B, H, D, ceil(S/4)), BLOCK_S, warps, IDX64 for the input and a (B, S, H, D) output); None when the
    other strides or the address are not whole words, when the last word would pass the storage (S % 4 and no row
    padding: ``_s_load_bound``), or there is no work."""
    B, S, H, D = q8.shape
    st = [x if n > 1 else 0 for n, x in zip(q8.shape, q8.stride())]  # (the stride of a length-1 axis is unused)
    if B * S * H * D == 0 or st[1] > 1 or any(x % 4 or x < 0 for x in (st[0], st[2], st[3])):
        return None
    if q8.data_ptr() % 4 or (S % 4 and _s_load_bound(q8) == S):
        return None
    words = torch.empty(0, dtype=torch.int32, device=q8.device).set_(
        q8.untyped_storage(), q8.storage_offset() // 4, (B, H, D, cdiv(S, 4)), (st[0] // 4, st[2] // 4, st[3] // 4, 1))
    dp = _d_pad(D)
    tile = _tile(kind, dp, warps=warps)
    bs = tile.block_s
    idx = (_needs_i64(bs * H * D, dp) or _needs_i64(dp * (st[3] // 4), bs)
           or _needs_i64(bs * abs(sc4.stride(1)), dp * abs(sc4.stride(3))))
    return words, bs, tile.num_warps, idx


def dequantize_mxfp8_triton(t: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``t.data * 2^(scale - 127)`` (NaN for scale byte 255) as a contiguous tensor of ``dtype``.

    ``t``: any ``MXTensor`` of rank 1 to 4, any strides (channel-major data included), blocked along any
    dim.  ``dtype``: bfloat16, float16 or float32.  Bit-exact with ``formats.dequantize_mxfp8(t, dtype)``
    (NaN positions equal; NaN payloads are not compared)."""
    if not isinstance(t, MXTensor):
        raise TypeError(f"t must be an MXTensor, got {type(t).__name__}")
    if dtype not in _FLOAT_OUT:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    if not 1 <= t.ndim <= 4:
        raise ValueError(f"t must have rank 1 to 4, got shape {tuple(t.shape)}")
    _check_device(t.data, "t.data")
    # canonical (B, S, H, D): rank 3 (a, b, c) -> (1, a, b, c); rank 2 (a, b) -> (1, a, 1, b); rank 1 -> (1, 1, 1, a)
    if t.ndim == 4:
        q4, s4, bdim = t.data, t.scale_bytes, t.dim
    elif t.ndim == 3:
        q4, s4, bdim = t.data.unsqueeze(0), t.scale_bytes.unsqueeze(0), t.dim + 1
    elif t.ndim == 2:
        q4, s4 = t.data.unsqueeze(0).unsqueeze(2), t.scale_bytes.unsqueeze(0).unsqueeze(2)
        bdim = 1 if t.dim == 0 else 3
    else:
        q4, s4, bdim = t.data.reshape(1, 1, 1, -1), t.scale_bytes.reshape(1, 1, 1, -1), 3
    B, S, H, D = q4.shape
    out = torch.empty(B, S, H, D, dtype=dtype, device=q4.device)
    if out.numel() == 0:
        return out.reshape(t.shape)
    q8 = q4.view(torch.uint8)
    hspec = _mx_hdim_spec(q8, s4, 1) if bdim == 3 else None
    if hspec is not None:  # blocked along a unit-stride D: the head-dim tile
        (qv, sv, Sv, Hv, n_tiles, bs, warps, idx) = hspec
        fast_launcher(_hdim_dequant_kernel)[(qv.shape[0] * n_tiles * Hv,)](
            qv, Sv, Hv, qv.stride(0), qv.stride(1), qv.stride(2), sv, sv.stride(0), sv.stride(1), sv.stride(2), out,
            n_tiles, D=D, NDP=_d_pad(D) // 32, BLOCK_S=bs, SOFT=_soft(q8.device), IDX64=idx, num_warps=warps,
        )
        return out.reshape(t.shape)
    wspec = _mx_seq_words_spec(q8, s4, warps=MX_SEQ_DEQUANT_WARPS) if bdim == 1 else None
    if wspec is not None:  # channel-major data in whole words: the row-set tile
        qw, bs, warps, idx = wspec
        n_tiles = cdiv(S, bs)
        fast_launcher(_seq_dequant_kernel)[(B * n_tiles * H,)](
            qw, qw.stride(0), qw.stride(1), qw.stride(2), s4, *s4.stride(), out, S, H, n_tiles, D=D,
            NDP=_d_pad(D) // 32, BLOCK_S=bs, SOFT=_soft(q8.device), IDX64=idx, EVEN=S % bs == 0, num_warps=warps,
        )
        return out.reshape(t.shape)
    bd = min(128, 32 * next_pow2(cdiv(D, 32)))
    tile = _tile("dequant", bd)
    bs = tile.block_s
    n_s_tiles, n_d_tiles = cdiv(S, bs), cdiv(D, bd)
    qs, ss = q8.stride(), s4.stride()
    idx = _needs_i64(bs * abs(qs[1]), bd * abs(qs[3])) or _needs_i64(bs * abs(ss[1]), bd * abs(ss[3]))
    idx = idx or _needs_i64(bs * H * D, bd)
    fast_launcher(_dequantize_kernel)[(B * n_s_tiles * H * n_d_tiles,)](
        q8, *qs, s4, *ss, out, S, H, D, n_s_tiles, n_d_tiles, _s_load_bound(q8),
        BLOCK_S=bs, BLOCK_D=bd, BDIM=bdim, OUT_BF16=dtype == torch.bfloat16, IDX64=idx, QU=_unit(q8),
        num_warps=tile.num_warps,
    )
    return out.reshape(t.shape)
