"""Linear + MXFP8 quantize for Hopper in Gluon: persistent, warp-specialized FP8 GEMM (the ``tl`` kernel's
semantics, ``kernels.linear_quant``; the K-dim scales are re-expressed as row exponents, DESIGN §3).

One CTA per SM walks the output tiles (BLOCK_M x BLOCK_N, BLOCK_M = 128) in the ``tl`` kernel's band order
(``band_tile``: GROUP_M row tiles per band, the band's weight columns stay in L2), tile t = pid + i * grid.
Partitions (``GluonLinearConfig.epi_partition``, default on):
  producer    1 warp: TMA loads of the x tile (two 64-row boxes) and the W tile (BLOCK_N x BLOCK_K) of every
              K-step into a ring of STAGES buffers, one ready and one empty mbarrier per buffer.  It runs ahead
              across tile boundaries.
  consumer 0  the default partition (one warpgroup): rows 0..63 of each tile.
  consumer 1  a 4-warp worker: rows 64..127.
  epilogue    a 4-warp worker: quantizes the accumulators the consumers leave in shared memory (one fp32 slot
              per consumer, an acc_ready / acc_empty mbarrier pair each) while they run the next tile's main
              loop.  Without it (``GluonLinearConfig.inline()``) each consumer quantizes its own accumulator
              and only the producer's run-ahead overlaps the epilogue.
Each consumer issues async ``warpgroup_mma`` (m64nBLOCK_Nk32 e4m3, fp32 accumulator) per K-step, waits for it in
the same iteration (a chain left in flight across the loop edge made ptxas serialize every wgmma, C7514) and
releases the ring buffer; the two consumers' chains interleave on the tensor cores.

Tile widths (``GluonLinearConfig.block_n`` 64 / 128 / 256, ``validate``): 128 is the default.  256 (fast
accumulation only: a K-step partial beside the running accumulator would take 256 registers) comes as
``wide()`` (one m64n256k32 per k32 step, no epilogue partition: ptxas builds that wgmma only with >= 154
registers at launch, C7602, and the 16-warp launch of the epilogue partition has 128), ``wide_epi()`` (the 4-warp
epilogue partition kept, each consumer issuing two m64n128k32 on the W tile's row halves, ``mma_n``) and
``wide_epi2()`` (one m64n256k32, a 2-warp epilogue sharing the producer's warpgroup: 12 warps at maxnreg 168).
The epilogues skip the 64-column parts that lie wholly past N.

Accumulation (``PRECISE``, ``LinearTile.precise_acc``): each K-step's wgmma chain starts from zero and its
result is added into the fp32 accumulator with an ordinary fp32 add, in K order.  That is what Triton lowers
the ``tl`` kernel's ``tl.dot(..., max_num_imprecise_acc=BLOCK_K)`` to (a zeroed partial accumulator per
BLOCK_K elements, then an add), so both kernels compute the same fp32 sums; without ``PRECISE`` the wgmma
chain accumulates across all of K in the tensor core's adder (Triton's default, and the ``tl`` kernel's
``precise_acc=False``).

Epilogue (64 rows x 64 columns at a time): ``y = (acc * 2^Ex) * 2^Ew (+ bias)``, rows past the batch's S
and columns past N zeroed (the ``tl`` kernel's fp32 operations in its order), then quantized in a blocked
layout (4 tokens x 8 channels per thread, 32-token and 32-channel blocks reduced inside a warp) by the
arithmetic helpers of the ``tl`` path (``quantize._hdim_mx``, ``_mx_exponent``, ``_e4m3_bytes``,
``rmsnorm_quant._pack4``: plain ``@triton.jit`` functions that create no index tensors, so Gluon calls them);
``_emit_mx_gl`` repeats ``rmsnorm_quant._emit_mx``'s offsets, masks and stores with Gluon layouts.  M tiles
never cross a batch boundary (row tiles are (batch, 128-token block)); x rows past a batch's end read the next
batch (or TMA zero fill) and are zeroed before quantization.  K past the end and W rows past N are TMA zero
fill (exact zeros in the sums).

Requirements (``gluon_eligible``): sm_90, x and W rows 16-byte aligned (K % 16 == 0 for contiguous data),
data pointers 16-byte aligned.  Notes and numbers: docs/perf-notes-producers.md.  Compile check without a GPU:
``python scripts/compile_check_linear_gluon.py`` (triton 3.6).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mxattn.kernels.launch import cdiv, fast_launcher, nvmma_fp8_layout
from mxattn.kernels.linear_quant import _pow2_wide, band_tile
from mxattn.kernels.quantize import _e4m3_bytes, _hdim_mx, _mx_exponent, _nan_bytes, _pow2, _tiled_offset, _to_f32
from mxattn.kernels.rmsnorm_quant import _pack4

# a barrier of the calling partition's warps: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# a TMA tile load into shared memory: tma.async_copy_global_to_shared in triton 3.6, tma.async_load later (the old
# name raises there)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

WG_ROWS = gl.constexpr(64)  # rows per consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(128)  # rows per tile: two consumer warpgroups


BLOCK_NS = (64, 128, 256)  # wgmma N of a consumer (whole 64-column epilogue parts; powers of two for Triton)
SMEM_BYTES = 227 * 1024  # dynamic shared memory per CTA on sm_90
SMEM_RESERVE = 1024  # barriers and alignment


@dataclass(frozen=True)
class GluonLinearConfig:
    """Tile and partition choice.  ``validate(precise)`` raises ValueError for a combination that cannot build or
    run (the launcher calls it before any launch); ``inline()``, ``wide()``, ``wide_epi()`` and ``wide_epi2()``
    are the other points the bench measures (docs/perf-notes-producers.md, sessions 8 and 14)."""

    block_n: int = 128  # wgmma N: 64, 128 or 256 (BLOCK_NS); 64 fp32 accumulator registers per thread at 128
    block_k: int = 128  # K per ring buffer and per precise-accumulation step
    stages: int = 4  # ring depth: 4 x (16 KB x + 16 KB W) = 128 KB, + 64 KB of accumulator slots (epilogue partition)
    group_m: int = 8  # row tiles per band (as the tl kernel)
    # a fourth partition (one warpgroup) quantizes the accumulators that the consumers leave in shared memory,
    # while they run the next tile's main loop; False: each consumer quantizes its own tile (no overlap but the
    # producer's run-ahead)
    epi_partition: bool = True
    # registers per thread: at launch (maxnreg, all warps), then per partition (setmaxnreg).  Triton pads each
    # partition to whole warpgroups (the producer's one warp counts as four: the launch is 16 warps with the
    # epilogue partition, 12 without) and gives the default partition (consumer 0) what is left:
    # 4 * maxnreg - consumer - producer - epilogue per thread (triton 3.6, read off the PTX).  With the epilogue
    # partition: 16 * 32 * 128 = 64K at launch; consumers 144 (accumulator + one K-step partial + addresses; no
    # spills), producer 24, epilogue 200 (compile check: 160 / 168 spilled ~700 bytes in the epilogue with both
    # orientations, 144 / 200 ~560, 136 / 216 ~290 but the consumers start spilling).  Without: 12 * 32 * 168
    # <= 64K; consumers 240, producer 24.
    maxnreg: int = 128
    consumer_regs: int = 144
    producer_regs: int = 24
    epi_regs: int = 200
    # warps of the epilogue partition: 4 (a warpgroup of its own, 16 warps launched) or 2 (sharing the producer's
    # warpgroup: 12 warps launched, so maxnreg 168; the producer then gets epi_regs, Triton's rule for partitions
    # that share a warpgroup); 2 warps quantize 64 x 32 parts
    epi_warps: int = 4
    # wgmma N (0: block_n).  block_n 256 with mma_n 128: two m64n128k32 per k32 step per consumer (A read twice
    # from shared memory) instead of one m64n256k32, which ptxas refuses at the 16-warp launch's maxnreg 128
    # (C7602: that instruction needs >= 154 registers at launch), so the 4-warp epilogue partition stays
    mma_n: int = 0

    def mma_cols(self) -> int:
        return self.mma_n or self.block_n

    def warps(self) -> int:
        """Warps launched: four warpgroups with the epilogue partition, three without (the producer's one warp
        padded to a warpgroup)."""
        return 16 if self.epi_partition and self.epi_warps == 4 else 12

    def worker_group_regs(self) -> list[int]:
        """setmaxnreg of each worker warpgroup: consumer 1, then the producer and the epilogue (apart, or one
        warpgroup at the larger request with a 2-warp epilogue)."""
        if not self.epi_partition:
            return [self.consumer_regs, self.producer_regs]
        if self.epi_warps == 4:
            return [self.consumer_regs, self.producer_regs, self.epi_regs]
        return [self.consumer_regs, max(self.producer_regs, self.epi_regs)]

    def default_partition_regs(self) -> int:
        return min(256, self.warps() * self.maxnreg // 4 - sum(self.worker_group_regs()))

    def smem_bytes(self) -> int:
        """Shared memory the kernel allocates: the ring (x as two 64-row boxes + W per stage, e4m3), the fp32
        accumulator slots of the epilogue partition (both consumers' whole tiles), or without it the layout
        conversion scratch of one 64 x 64 fp32 part, and the barriers."""
        ring = self.stages * (int(BLOCK_M.value) + self.block_n) * self.block_k
        extra = 2 * int(WG_ROWS.value) * self.block_n * 4 if self.epi_partition else int(WG_ROWS.value) * 64 * 4
        return ring + extra + SMEM_RESERVE

    def validate(self, precise: bool | None = None) -> "GluonLinearConfig":
        """Raise ValueError unless the config builds and fits (``precise``: the accumulation mode it is to run
        with, None: not checked).  Returns self."""
        def bad(why):
            raise ValueError(f"GluonLinearConfig: {why} ({self})")

        if self.block_n not in BLOCK_NS:
            bad(f"block_n must be one of {BLOCK_NS}")
        if self.block_k not in (64, 128):
            bad("block_k must be 64 or 128 (whole wgmma k32 steps, TMA rows of 64 / 128 bytes: the compiled ones)")
        if self.stages < 2 or self.group_m < 1:
            bad("stages must be >= 2 and group_m >= 1")
        if self.mma_cols() not in (self.block_n, 128) or self.block_n % self.mma_cols():
            bad("mma_n must be 0 (block_n) or 128 with block_n 256")
        if self.mma_cols() > 128 and self.maxnreg < 160:
            bad("a m64n256k32 wgmma needs maxnreg >= 160 at launch (ptxas C7602 below 154): the 16-warp launch "
                "(epilogue partition of 4 warps) takes mma_n 128")
        if precise and self.block_n > 128:
            # the K-step partial beside the running accumulator: 2 x 128 fp32 registers per thread at 256
            bad("block_n 256 runs with fast accumulation only (precise_acc=False)")
        if self.epi_warps not in (2, 4):
            bad("epi_warps must be 4 or 2")
        regs = [self.default_partition_regs()] + self.worker_group_regs()
        if self.maxnreg * 32 * self.warps() > 65536 or self.maxnreg % 8:
            bad(f"maxnreg {self.maxnreg} x {self.warps()} warps exceeds the register file or is not a multiple of 8")
        if any(r % 8 or not 24 <= r <= 256 for r in regs) or 128 * sum(regs) > 65536:
            bad(f"partition registers {regs} (multiples of 8 in 24..256, 128 threads each, <= 64K in all)")
        if regs[0] < self.consumer_regs:
            bad(f"the default partition (consumer 0) gets {regs[0]} registers, fewer than consumer 1's")
        if self.block_n == 256 and self.consumer_regs < 160:
            bad("block_n 256: the 128-register accumulator needs consumer_regs >= 160")
        if self.smem_bytes() > SMEM_BYTES:
            bad(f"{self.smem_bytes()} bytes of shared memory (at most {SMEM_BYTES})")
        return self

    def inline(self) -> "GluonLinearConfig":
        """The variant without the epilogue partition, with its register split."""
        return GluonLinearConfig(self.block_n, self.block_k, self.stages, self.group_m, False, 168, 240, 24, 0, 4,
                                 self.mma_n)

    @staticmethod
    def wide() -> "GluonLinearConfig":
        """The 128 x 256 tile: one m64n256k32 accumulator (128 fp32 registers) per consumer, fast accumulation
        only, no epilogue partition (12 warps, maxnreg 168: consumers 240, producer 24), 4 x 48 KB ring."""
        return GluonLinearConfig(256, 128, 4, 8, False, 168, 240, 24, 0, 4, 0)

    @staticmethod
    def wide_epi() -> "GluonLinearConfig":
        """The 128 x 256 tile with the 4-warp epilogue partition (16 warps, maxnreg 128): each consumer issues two
        m64n128k32 per k32 step (one m64n256k32 does not build at that launch, ``mma_n``); consumers 160
        (two 64-register accumulators and addresses), producer 24, epilogue 168 (64 x 64 parts).  The
        accumulator slots take 128 KB, so the ring is 4 x 24 KB of K = 64."""
        return GluonLinearConfig(256, 64, 4, 8, True, 128, 160, 24, 168, 4, 128)

    @staticmethod
    def wide_epi2() -> "GluonLinearConfig":
        """The 128 x 256 tile, one m64n256k32 per consumer and k32 step, with an epilogue partition of 2 warps
        that shares the producer's warpgroup: 12 warps at maxnreg 168; consumers 168, producer + epilogue 168
        (64 x 32 parts from shared memory, one 32 x 32 block per warp).  Ring 4 x 24 KB of K = 64."""
        return GluonLinearConfig(256, 64, 4, 8, True, 168, 168, 24, 168, 2, 0)


CONFIG_OVERRIDE: GluonLinearConfig | None = None  # tests and benchmarks: e.g. GluonLinearConfig().inline()
# the config of fast-accumulation launches without an override (None: GluonLinearConfig(), as precise ones);
# docs/perf-notes-producers.md "Session 14" says when a 256 config takes this place
FAST_DEFAULT: GluonLinearConfig | None = None


def default_config(precise: bool) -> GluonLinearConfig:
    """The config a launch without ``config`` / ``CONFIG_OVERRIDE`` takes."""
    return FAST_DEFAULT if FAST_DEFAULT is not None and not precise else GluonLinearConfig()
_SM_COUNT: dict = {}
_MAJOR: dict = {}


def _major(dev: torch.device) -> int:
    """Compute capability major of ``dev``, once per device (linear_quant_fwd asks on every call)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _MAJOR:
        _MAJOR[i] = torch.cuda.get_device_capability(i)[0]
    return _MAJOR[i]


def _sm_count(dev: torch.device) -> int:
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


# ------------------------------------------------------------------------------------------------- layouts
@gluon.constexpr_function
def _mma_layout(n):
    # one warpgroup, wgmma m64nNk32 (k = 256 bits of 8-bit operands)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.constexpr_function
def _epi_layout(nb, nw=4):
    """(64 / 32 seq blocks, 32 tokens, nb channel blocks, 32 channels): a thread holds 4 consecutive tokens (one
    packed word per channel) of 8 consecutive channels; a 32-token block spans 8 lanes and a 32-channel block
    4 lanes, so both block maxima are reduced inside one warp."""
    wn = 2 if nb >= 2 else 1
    return gl.BlockedLayout(size_per_thread=[1, 4, 1, 8], threads_per_warp=[1, 8, 1, 4],
                            warps_per_cta=[nw // wn, 1, wn, 1], order=[3, 2, 1, 0])


@gluon.constexpr_function
def _axis_layout(dim, parent):
    """The 1-D layout whose expand_dims along every other axis, in increasing order, gives ``parent``."""
    lay = parent
    for d in reversed(range(4)):
        if d != dim:
            lay = gl.SliceLayout(d, lay)
    return lay


@gluon.jit
def _coord(n: gl.constexpr, DIM: gl.constexpr, layout: gl.constexpr):
    """arange(n) placed along axis DIM of a 4-D tensor of ``layout`` (size 1 on the other axes)."""
    v = gl.arange(0, n, layout=_axis_layout(DIM, layout))
    for d in gl.static_range(4):
        if d != DIM:
            v = gl.expand_dims(v, d)
    return v


# ------------------------------------------------------------------------------------------------- epilogue
@gluon.jit
def _emit_mx_gl(y, s0, n0, b64, S, N, S_pad, hd_ptr, hs_ptr, cd_ptr, cs_ptr,
                MB: gl.constexpr, MI: gl.constexpr, NB: gl.constexpr,
                HDIM: gl.constexpr, SEQ: gl.constexpr, RCEIL: gl.constexpr, SOFT: gl.constexpr,
                SWZ: gl.constexpr):
    """``rmsnorm_quant._emit_mx`` (ROWSCALED False) for a (MB, MI = 32, NB, 32) fp32 tile in ``_epi_layout``:
    the same offsets, masks and arithmetic helpers."""
    L4: gl.constexpr = y.type.layout
    mb = _coord(MB, 0, L4)
    mi = _coord(MI, 1, L4)
    nb = _coord(NB, 2, L4)
    nj = _coord(32, 3, L4)
    sl = mb * MI + mi
    nl = nb * 32 + nj
    s = s0 + sl
    n = n0 + nl
    mag = y.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    bad = gl.max(gl.reshape(mag, [MB * MI * NB * 32]), 0) >= 0x7F800000
    if HDIM:
        row = b64 * S + s0
        hd = hd_ptr + row * N + n0
        out, sc = _hdim_mx(y, y, mag, bad, RCEIL, SOFT)
        gl.store(hd + sl * N + nl, out, mask=(s < S) & (n < N))
        NBH = (N + 31) // 32
        if SWZ:
            tiled = hs_ptr + _tiled_offset(row + sl, n0 // 32 + nb, (NBH + 3) // 4)
            gl.store(tiled, sc, mask=(s < S) & (n0 // 32 + nb < NBH))
        else:
            hs = hs_ptr + row * NBH + n0 // 32
            gl.store(hs + sl * NBH + nb, sc, mask=(s < S) & (n0 // 32 + nb < NBH))
    if SEQ:
        amax = gl.max(mag, axis=1, keep_dims=True)  # one per 32 tokens and channel
        e = _mx_exponent(amax, RCEIL)
        out = _e4m3_bytes(y * _pow2(-e), SOFT)
        if bad:
            out = gl.where(mag > 0x7F800000, _nan_bytes(y), out)
        NSB = (S + 31) // 32
        sb = s0 // 32 + mb
        sc = gl.where(amax < 0x7F800000, e + 127, 255).to(gl.uint8)
        gl.store(cs_ptr + (b64 * NSB + sb) * N + n, sc, mask=(sb < NSB) & (n < N))
        words = _pack4(out, MB, MI, NB)  # (MB * MI / 4, NB * 32) int32
        WL: gl.constexpr = words.type.layout
        wl = gl.expand_dims(gl.arange(0, MB * MI // 4, layout=gl.SliceLayout(1, WL)), 1)
        cl = gl.expand_dims(gl.arange(0, NB * 32, layout=gl.SliceLayout(0, WL)), 0)
        row_w = S_pad // 4
        cbase = cd_ptr + (b64 * N + n0) * row_w + s0 // 4
        gl.store(cbase + cl.to(gl.int64) * row_w + wl, words, mask=(s0 // 4 + wl < row_w) & (n0 + cl < N))


@gluon.constexpr_function
def _part_layout(w, nw=4):
    """2-D (64, w) layout over ``nw`` warps whose reshape to (2, 32, w / 32, 32) is ``_epi_layout(w / 32, nw)``
    register for register (4 tokens x 8 channels per thread; (64, 64) on 4 warps or (64, 32) on 2: one 32 x 32
    block per warp)."""
    wn = 2 if w >= 64 else 1
    return gl.BlockedLayout(size_per_thread=[4, 8], threads_per_warp=[8, 4], warps_per_cta=[nw // wn, wn],
                            order=[1, 0])


@gluon.jit
def _quantize_part(raw, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                   HAS_BIAS: gl.constexpr, HDIM: gl.constexpr, SEQ: gl.constexpr, RCEIL: gl.constexpr,
                   SOFT: gl.constexpr, SWZ: gl.constexpr):
    """Raw accumulator columns n0 .. n0 + W - 1 of 64 rows (``_part_layout(W)``) -> scale, bias and mask as
    ``_linear_quant_kernel`` (the same fp32 operations in the same order), then ``_emit_mx_gl``."""
    W: gl.constexpr = raw.shape[1]
    lay: gl.constexpr = raw.type.layout
    rm = s0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, lay))
    rn = n0 + gl.arange(0, W, layout=gl.SliceLayout(0, lay))
    row = b64 * S + gl.minimum(rm, S - 1)
    col = gl.minimum(rn, N - 1).to(gl.int64)
    ex = gl.load(xe_ptr + row)
    ew = gl.load(we_ptr + col)
    y = (raw * gl.expand_dims(_pow2_wide(ex), 1)) * gl.expand_dims(_pow2_wide(ew), 0)
    if HAS_BIAS:
        y = y + gl.expand_dims(_to_f32(gl.load(b_ptr + col)), 0)
    y = gl.where(gl.expand_dims(rm < S, 1) & gl.expand_dims(rn < N, 0), y, 0.0)
    y4 = gl.convert_layout(gl.reshape(y, [WG_ROWS // 32, 32, W // 32, 32]),
                           _epi_layout(W // 32, gl.num_warps()))
    _emit_mx_gl(y4, s0, n0, b64, S, N, S_pad, hd_ptr, hs_ptr, cd_ptr, cs_ptr,
                WG_ROWS // 32, 32, W // 32, HDIM, SEQ, RCEIL, SOFT, SWZ)


@gluon.jit
def _halves(acc):
    """(64, BN) -> its two column halves.  Column bit log2(BN/2) is a register bit of the wgmma layout, so the
    split moves no data."""
    HN: gl.constexpr = acc.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(acc, [WG_ROWS, 2, HN]), (0, 2, 1)))


@gluon.jit
def _quantize_live(part, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                   HAS_BIAS: gl.constexpr, HDIM: gl.constexpr, SEQ: gl.constexpr, RCEIL: gl.constexpr,
                   SOFT: gl.constexpr, SWZ: gl.constexpr):
    """A 64 x 64 part of a consumer's accumulator (wgmma layout), quantized unless it lies wholly past N."""
    if n0 < N:
        _quantize_part(gl.convert_layout(part, _part_layout(64)), xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr,
                       cs_ptr, b64, s0, n0, S, N, S_pad, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)


@gluon.jit
def _quarters(acc, acc1):
    """The four 64-column parts of a consumer's 64 x 256 tile: halves of the halves of one m64n256 accumulator
    (acc1 unused), or the halves of two m64n128 ones."""
    if acc.shape[1] == 256:
        lo, hi = _halves(acc)
        q0, q1 = _halves(lo)
        q2, q3 = _halves(hi)
    else:
        q0, q1 = _halves(acc)
        q2, q3 = _halves(acc1)
    return q0, q1, q2, q3


@gluon.jit
def _epilogue_inline(acc, acc1, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                     BN: gl.constexpr, HAS_BIAS: gl.constexpr, HDIM: gl.constexpr, SEQ: gl.constexpr,
                     RCEIL: gl.constexpr, SOFT: gl.constexpr, SWZ: gl.constexpr):
    """The consumer quantizes its own 64 x BN accumulator, 64 columns at a time (the whole tile in the blocked
    layout plus the seq path's temporaries spilled ~900 bytes with both orientations, triton 3.6), skipping the
    parts wholly past N."""
    if BN == 64:
        _quantize_live(acc, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
    elif BN == 128:
        lo, hi = _halves(acc)
        _quantize_live(lo, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
        _quantize_live(hi, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0 + 64, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
    else:  # 256 (column bits 7 and 6 are register bits of the wgmma layouts)
        q0, q1, q2, q3 = _quarters(acc, acc1)
        _quantize_live(q0, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
        _quantize_live(q1, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0 + 64, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
        _quantize_live(q2, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0 + 128, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
        _quantize_live(q3, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b64, s0, n0 + 192, S, N, S_pad,
                       HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)


@gluon.jit
def _store64(part, acc_smem, i, PW: gl.constexpr):
    """A 64 x 64 accumulator part to slot i (PW 64) or to slots 2i, 2i + 1 (PW 32)."""
    if PW == 64:
        acc_smem.index(i).store(part)
    else:
        lo, hi = _halves(part)
        acc_smem.index(2 * i).store(lo)
        acc_smem.index(2 * i + 1).store(hi)


@gluon.jit
def _handoff(acc, acc1, acc_smem, acc_ready, acc_empty, j, WG: gl.constexpr, BN: gl.constexpr,
             PW: gl.constexpr):
    """EPI_PARTITION: the consumer's j-th accumulator to its shared-memory slots (parts of PW columns, consumer
    WG's at WG * BN / PW ...), for the epilogue partition.  Waits until the epilogue has read the slots' previous
    tile."""
    mbarrier.wait(acc_empty.index(WG), (j & 1) ^ 1)
    P64: gl.constexpr = BN // 64  # 64-column parts per consumer
    if BN == 64:
        _store64(acc, acc_smem, WG, PW)
    elif BN == 128:
        lo, hi = _halves(acc)
        _store64(lo, acc_smem, 2 * WG, PW)
        _store64(hi, acc_smem, 2 * WG + 1, PW)
    else:  # 256
        q0, q1, q2, q3 = _quarters(acc, acc1)
        _store64(q0, acc_smem, P64 * WG, PW)
        _store64(q1, acc_smem, P64 * WG + 1, PW)
        _store64(q2, acc_smem, P64 * WG + 2, PW)
        _store64(q3, acc_smem, P64 * WG + 3, PW)
    _cta_barrier()  # every warp's stores before the one arrival
    mbarrier.arrive(acc_ready.index(WG), count=1)


@gluon.jit
def _epilogue_partition(acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr,
                        S, N, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
                        BN: gl.constexpr, GROUP_M: gl.constexpr, HAS_BIAS: gl.constexpr, HDIM: gl.constexpr,
                        SEQ: gl.constexpr, RCEIL: gl.constexpr, SOFT: gl.constexpr, SWZ: gl.constexpr,
                        W: gl.constexpr):
    """EPI_PARTITION: one warpgroup (or 2 warps, ``GluonLinearConfig.epi_warps``) quantizes both consumers'
    accumulators of every tile while the consumers run the next tile's main loop, W (64 / 32) columns at a time;
    parts wholly past N are neither read nor quantized (the slots are released after the last part read)."""
    NP: gl.constexpr = BN // W
    NW: gl.constexpr = gl.num_warps()
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        b, s0, n0 = _tile_coords(t, S, n_m_tiles, n_row_tiles, n_col_tiles, BN, GROUP_M)
        for c in gl.static_range(2):
            mbarrier.wait(acc_ready.index(c), j & 1)
            for h in gl.static_range(NP):
                if n0 + h * W < N:
                    raw = acc_smem.index(NP * c + h).load(_part_layout(W, NW))
                    if h == NP - 1:
                        _cta_barrier()  # every warp has read the slot
                        mbarrier.arrive(acc_empty.index(c), count=1)
                    _quantize_part(raw, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b.to(gl.int64),
                                   s0 + c * WG_ROWS, n0 + h * W, S, N, S_pad, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
                elif h == NP - 1:
                    _cta_barrier()  # (the parts read before this one)
                    mbarrier.arrive(acc_empty.index(c), count=1)
        j += 1


# ------------------------------------------------------------------------------------------------- partitions
@gluon.jit
def _tile_coords(t, S, n_m_tiles, n_row_tiles, n_col_tiles, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile t -> (batch, first token within the batch, first channel)."""
    pid_m, pid_n = band_tile(t, n_row_tiles, n_col_tiles, GROUP_M)
    return pid_m // n_m_tiles, (pid_m % n_m_tiles) * BLOCK_M, pid_n * BN


@gluon.jit
def _producer(x_desc, w_desc, a_smem, b_smem, ready, empty, S, K, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
              BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    k_tiles = gl.cdiv(K, BK)
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        b, s0, n0 = _tile_coords(t, S, n_m_tiles, n_row_tiles, n_col_tiles, BN, GROUP_M)
        row = b * S + s0
        for kk in range(k_tiles):
            s = it % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(x_desc, [row, kk * BK], ready.index(s), a_smem.index(2 * s))
            _tma_load(x_desc, [row + WG_ROWS, kk * BK], ready.index(s), a_smem.index(2 * s + 1))
            _tma_load(w_desc, [n0, kk * BK], ready.index(s), b_smem.index(s))
            it += 1


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr,
              S, N, K, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
              WG: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              PRECISE: gl.constexpr, HAS_BIAS: gl.constexpr, HDIM: gl.constexpr, SEQ: gl.constexpr,
              RCEIL: gl.constexpr, SOFT: gl.constexpr, SWZ: gl.constexpr, EPI_PARTITION: gl.constexpr,
              EPI_WARPS: gl.constexpr, MMA_N: gl.constexpr):
    mma: gl.constexpr = _mma_layout(MMA_N)
    zero = gl.zeros([WG_ROWS, MMA_N], gl.float32, layout=mma)
    k_tiles = gl.cdiv(K, BK)
    it = 0
    j = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        b, s0, n0 = _tile_coords(t, S, n_m_tiles, n_row_tiles, n_col_tiles, BN, GROUP_M)
        acc = zero
        acc1 = zero  # columns MMA_N .. BN - 1 when the tile takes two wgmma per k32 step (MMA_N < BN)
        for kk in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            b_op = b_smem.index(s).permute((1, 0))
            if PRECISE:
                # the K-step's own chain from zero, waited in this iteration, then an fp32 add (module docstring)
                part = warpgroup_mma(a_smem.index(2 * s + WG), b_op, zero, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + part
            elif MMA_N == BN:
                acc = warpgroup_mma(a_smem.index(2 * s + WG), b_op, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(s), count=1)
            else:  # two m64nMMA_Nk32 chains on the W tile's row halves (each instruction fits the 16-warp launch)
                w_s = b_smem.index(s)
                acc = warpgroup_mma(a_smem.index(2 * s + WG), w_s.slice(0, MMA_N).permute((1, 0)), acc,
                                    is_async=True)
                acc1 = warpgroup_mma(a_smem.index(2 * s + WG), w_s.slice(MMA_N, MMA_N).permute((1, 0)), acc1,
                                     is_async=True)
                acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
                mbarrier.arrive(empty.index(s), count=1)
            it += 1
        if EPI_PARTITION:
            _handoff(acc, acc1, acc_smem, acc_ready, acc_empty, j, WG, BN, 64 if EPI_WARPS == 4 else 32)
        else:
            _epilogue_inline(acc, acc1, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr, b.to(gl.int64),
                             s0 + WG * WG_ROWS, n0, S, N, S_pad, BN, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ)
        j += 1


@gluon.jit
def _linear_quant_ws_kernel(
    x_desc, w_desc, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr, cs_ptr,
    S, N, K, S_pad, n_m_tiles, n_row_tiles,
    BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    PRECISE: gl.constexpr, HAS_BIAS: gl.constexpr, HDIM: gl.constexpr, SEQ: gl.constexpr,
    RCEIL: gl.constexpr, SOFT: gl.constexpr, SWZ: gl.constexpr, EPI_PARTITION: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, EPI_REGS: gl.constexpr, EPI_WARPS: gl.constexpr,
    MMA_N: gl.constexpr,
):
    n_col_tiles = gl.cdiv(N, BN)
    n_tiles = n_row_tiles * n_col_tiles
    a_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(acc_ready.index(i), count=1)
        mbarrier.init(acc_empty.index(i), count=1)
    # accumulator slots of the epilogue partition: per consumer, its 64 x BN fp32 tile as 64-column parts
    # (a one-element placeholder without the partition)
    W: gl.constexpr = 64 if EPI_WARPS == 4 else 32  # columns per slot: one 32 x 32 block per epilogue warp
    SLOTS: gl.constexpr = 2 * (BN // W) if EPI_PARTITION else 1
    acc_smem = gl.allocate_shared_memory(gl.float32, [SLOTS, WG_ROWS if EPI_PARTITION else 1,
                                                      W if EPI_PARTITION else 1], _acc_smem_layout())
    if EPI_PARTITION:
        gl.warp_specialize([
            (_consumer, (a_smem, b_smem, ready, empty, acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr,
                         hs_ptr, cd_ptr, cs_ptr, S, N, K, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
                         0, BN, BK, GROUP_M, STAGES, PRECISE, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ, True, EPI_WARPS, MMA_N)),
            (_consumer, (a_smem, b_smem, ready, empty, acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr,
                         hs_ptr, cd_ptr, cs_ptr, S, N, K, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
                         1, BN, BK, GROUP_M, STAGES, PRECISE, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ, True, EPI_WARPS, MMA_N)),
            (_producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, S, K, n_m_tiles, n_row_tiles, n_col_tiles,
                         n_tiles, BN, BK, GROUP_M, STAGES)),
            (_epilogue_partition, (acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr, hs_ptr, cd_ptr,
                                   cs_ptr, S, N, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles, BN, GROUP_M,
                                   HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ, W)),
        ], [4, 1, EPI_WARPS], [CONSUMER_REGS, PRODUCER_REGS, EPI_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_smem, b_smem, ready, empty, acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr,
                         hs_ptr, cd_ptr, cs_ptr, S, N, K, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
                         0, BN, BK, GROUP_M, STAGES, PRECISE, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ, False, EPI_WARPS, MMA_N)),
            (_consumer, (a_smem, b_smem, ready, empty, acc_smem, acc_ready, acc_empty, xe_ptr, we_ptr, b_ptr, hd_ptr,
                         hs_ptr, cd_ptr, cs_ptr, S, N, K, S_pad, n_m_tiles, n_row_tiles, n_col_tiles, n_tiles,
                         1, BN, BK, GROUP_M, STAGES, PRECISE, HAS_BIAS, HDIM, SEQ, RCEIL, SOFT, SWZ, False, EPI_WARPS, MMA_N)),
            (_producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, S, K, n_m_tiles, n_row_tiles, n_col_tiles,
                         n_tiles, BN, BK, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.constexpr_function
def _acc_smem_layout():
    # rows of 64 fp32 (256 bytes): 16-byte vectors XOR-swizzled by row, so that the wgmma layout's stores (8 rows
    # per instruction at the same columns) spread over the banks
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


# ------------------------------------------------------------------------------------------------- launcher
def gluon_eligible(xd: torch.Tensor, wd: torch.Tensor, block_n: int = 128) -> bool:
    """Whether the Gluon kernel takes these FP8 operands: a CUDA sm_90 device, unit stride along K, row pitches
    of at least a row and 16-byte aligned, base pointers too (TMA), no empty dimension, BLOCK_N a multiple of 32."""
    if xd.device.type != "cuda" or _major(xd.device) != 9 or block_n % 32:
        return False
    for t in (xd, wd):
        if (t.dim() != 2 or 0 in t.shape or t.stride(-1) != 1 or t.stride(0) % 16 or t.stride(0) < t.shape[1]
                or t.data_ptr() % 16):  # (rows apart by at least a row: no broadcast or overlapping rows)
            return False
    return True


@functools.lru_cache(maxsize=None)
def _layouts(block_n: int, block_k: int):
    return nvmma_fp8_layout(WG_ROWS.value, block_k), nvmma_fp8_layout(block_n, block_k)


@functools.lru_cache(maxsize=64)
def _validated(cfg: GluonLinearConfig, precise: bool) -> GluonLinearConfig:
    """``cfg.validate(precise)`` once per (config, mode): the launcher asks on every call."""
    return cfg.validate(precise)


def linear_quant_fwd_gluon(xd, xe, wd, we, bias, hd, hs, cd, cs, B: int, S: int, s_pad: int, *, hdim: bool,
                           seq: bool, rceil: bool, soft: bool, precise: bool, tiled_scales: bool,
                           config: GluonLinearConfig | None = None) -> None:
    """Launch on prepared operands and outputs (``linear_quant.linear_quant_fwd`` allocates them and checks
    ``gluon_eligible``): xd (B*S, K) / wd (N, K) e4m3, xe (B*S,) / we (N,) int32, outputs as ``_emit_mx``."""
    cfg = _validated(config or CONFIG_OVERRIDE or default_config(precise), precise)
    M, K = xd.shape
    N = wd.shape[0]
    la, lb = _layouts(cfg.block_n, cfg.block_k)
    x_desc = TensorDescriptor(xd, [M, K], [xd.stride(0), 1], [WG_ROWS.value, cfg.block_k], la)
    w_desc = TensorDescriptor(wd, [N, K], [wd.stride(0), 1], [cfg.block_n, cfg.block_k], lb)
    n_m_tiles = cdiv(S, BLOCK_M.value)
    n_row_tiles = B * n_m_tiles
    n_tiles = n_row_tiles * cdiv(N, cfg.block_n)
    grid = (min(n_tiles, _sm_count(xd.device)),)
    fast_launcher(_linear_quant_ws_kernel)[grid](
        x_desc, w_desc, xe, we, bias if bias is not None else xe, hd, hs, cd, cs,
        S, N, K, s_pad, n_m_tiles, n_row_tiles,
        BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages, PRECISE=precise,
        HAS_BIAS=bias is not None, HDIM=hdim, SEQ=seq, RCEIL=rceil, SOFT=soft, SWZ=tiled_scales,
        EPI_PARTITION=cfg.epi_partition, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        EPI_REGS=cfg.epi_regs, EPI_WARPS=cfg.epi_warps, MMA_N=cfg.mma_cols(),
        num_warps=4, maxnreg=cfg.maxnreg,
    )
