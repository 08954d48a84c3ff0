"""Fused producers (``mxattn.producers``): RMSNorm + MXFP8 quantize and linear + MXFP8 quantize.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (``producers._KERNELS_ON_CPU``) at
tiny shapes; with CUDA the same tests run compiled on the GPU, and the tests marked ``gpu`` add large shapes,
both GPU rounding paths and a smoke run of ``bench_producers``.  The references are in ``mxattn.producers``.
What is checked:
* rmsnorm_quant: rstd, data bytes, scale bytes / row exponents bit-exact against ``rmsnorm_reference`` +
  ``quantize_mxfp8`` (+ ``to_row_scaled``), hdim / seq / both, RCEIL / FLOOR, chunked and one-chunk tiles,
  NaN / Inf / zero / tiny rows (NaN positions compared, not NaN signs);
* the backward: dx and dweight bit-exact against ``rmsnorm_backward_reference`` with the kernel's plan, from a
  float dy and from an MX dy; autograd through ``dequantize()`` (STE);
* linear_quant: the row re-expression bit-exact; the product against ``linear_quant_reference`` with the
  stated bound (>= 99.9 % of data bytes equal, every element within one e4m3 step at the larger block scale);
* input checks: TypeError / ValueError naming the argument, raised before any launch.

    PYTHONPATH=. python -m pytest tests/test_producers.py            # CPU: interpreter
    PYTHONPATH=. python -m pytest -m gpu tests/test_producers.py    # H200
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import mxattn.kernels.linear_quant as kl  # noqa: E402  (after TRITON_INTERPRET)
import mxattn.kernels.quantize as kq  # noqa: E402
import mxattn.kernels.rmsnorm_quant as kr  # noqa: E402
from mxattn import formats as F  # noqa: E402
from mxattn import producers as P  # noqa: E402

ACC_REL = 2.0 ** -12  # twice the ~2^-13 of sum |x_k w_k| that Hopper FP8 wgmma accumulation keeps

if not torch.cuda.is_available() and type(kr._rmsnorm_quant_fwd_kernel).__name__ != "InterpretedFunction":
    kq = importlib.reload(kq)  # imported earlier without the interpreter
    kr = importlib.reload(kr)
    kl = importlib.reload(kl)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
U8 = torch.uint8


@pytest.fixture
def kernels(monkeypatch):
    """Route the public functions to the kernels (CPU tensors too, under the interpreter)."""
    monkeypatch.setattr(P, "_KERNELS_ON_CPU", True)
    monkeypatch.setattr(kr, "TILE_OVERRIDES", {})
    monkeypatch.setattr(kl, "TILE_OVERRIDE", None if CUDA else kl.LinearTile(32, 32, 32, 2, 4, 2, True))
    yield


# ----------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(U8) if t.dtype != U8 else t.detach().cpu().contiguous()


def _first_diff(got, want, what):
    bad = got != want
    idx = bad.nonzero()[0].tolist()
    g, w = got[tuple(idx)].item(), want[tuple(idx)].item()
    return f"{what}: {int(bad.sum())} of {bad.numel()} differ; first at {idx}: got {g!r}, want {w!r}"


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str, nan_sign: bool = True) -> None:
    """Equal bytes; with ``nan_sign=False`` e4m3 NaN bytes (0x7F / 0xFF) compare equal to each other."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = _u8(got), _u8(want)
    if not nan_sign:
        g = torch.where((g & 0x7F) == 0x7F, torch.full_like(g, 0x7F), g)
        w = torch.where((w & 0x7F) == 0x7F, torch.full_like(w, 0x7F), w)
    if not torch.equal(g, w):
        raise AssertionError(_first_diff(g, w, what))


def assert_same_float(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits, NaN at the same places (payloads not compared)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gn, wn = got.isnan(), want.isnan()
    if not torch.equal(gn, wn):
        raise AssertionError(_first_diff(gn, wn, f"{what} NaN positions"))
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    gi = torch.where(gn, torch.zeros_like(got), got).view(ints)
    wi = torch.where(wn, torch.zeros_like(want), want).view(ints)
    if not torch.equal(gi, wi):
        raise AssertionError(_first_diff(got, want, what) + f" (max |diff| {(got.float() - want.float()).abs().max()})")


def assert_same_out(got, want, what: str) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_out(g, w, f"{what}[{i}]")
        return
    assert type(got).__name__.endswith(type(want).__name__), f"{what}: {type(got).__name__} vs {type(want).__name__}"
    assert got.dim == want.dim, f"{what}: dim {got.dim} != {want.dim}"
    assert_same_bytes(got.data, want.data, f"{what} data", nan_sign=False)
    if isinstance(want, F.MXTensor):
        assert_same_bytes(got.scale, want.scale, f"{what} scale")
    else:
        assert torch.equal(got.exp.cpu(), want.exp.cpu()), _first_diff(got.exp.cpu(), want.exp.cpu(), f"{what} exp")


def _e4m3_step(mag: torch.Tensor) -> torch.Tensor:
    """Spacing of the e4m3 grid at magnitude ``mag`` (in units of the block scale), 2^-9 below 2^-6."""
    e = torch.floor(torch.log2(mag.clamp(min=2.0 ** -6)))
    return torch.exp2(e - 3)


def assert_mx_close(got: F.MXTensor, want: F.MXTensor, what: str, min_equal: float = 0.999,
                    acc_abs: Optional[torch.Tensor] = None) -> dict:
    """The linear_quant bound: >= ``min_equal`` of data bytes equal, >= 99 % of scale bytes equal, and every
    element within one e4m3 step (at the larger of the two block scales) of the reference, plus, when
    ``acc_abs`` (the fp32 tensor ``ACC_REL * |x| @ |W|^T``, laid out like the output) is given, the
    accumulation error of a hardware FP8 MMA: Hopper's wgmma adds FP8 products with about 14 significant bits
    (DeepSeek-V3 report, sec. 3.3.2), so an element that cancels to far below its block's maximum can be many
    e4m3 steps off while the sum as a whole is accurate to 2^-13 of sum |x_k w_k|."""
    assert got.dim == want.dim and tuple(got.shape) == tuple(want.shape), what
    gd, wd = _u8(got.data), _u8(want.data)
    eq = (gd == wd).double().mean().item()
    seq_ = (_u8(got.scale) == _u8(want.scale)).double().mean().item()
    vg, vw = got.dequantize(torch.float64).cpu(), want.dequantize(torch.float64).cpu()
    eg = F._expand_scales(_u8(got.scale).to(torch.int32), got.dim, got.shape[got.dim]).to(torch.float64)
    ew = F._expand_scales(_u8(want.scale).to(torch.int32), want.dim, want.shape[want.dim]).to(torch.float64)
    sc = torch.maximum(eg, ew)
    mag = torch.maximum(vg.abs(), vw.abs()) / sc
    err = (vg - vw).abs()
    tol = _e4m3_step(mag) * sc
    if acc_abs is not None:
        tol = tol + acc_abs.to(torch.float64).cpu()
    worst = (err / tol).max().item() if err.numel() else 0.0
    stats = {"data_equal": eq, "scale_equal": seq_, "worst_in_steps": worst}
    assert torch.isfinite(vg).all(), f"{what}: non-finite output"
    assert eq >= min_equal, f"{what}: only {eq:.5f} of data bytes equal ({stats})"
    assert seq_ >= 0.99, f"{what}: only {seq_:.5f} of scale bytes equal ({stats})"
    assert worst <= 1.0, f"{what}: an element is {worst:.2f} e4m3 steps off ({stats})"
    return stats


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------------------------
# reference semantics
# ----------------------------------------------------------------------------------------------


def test_pairwise_sum_is_the_stated_tree(gen):
    v = torch.randn(3, 11, generator=gen)
    p = torch.nn.functional.pad(v, (0, 5))  # 16 wide
    for _ in range(4):
        p = p[:, 0::2] + p[:, 1::2]
    assert torch.equal(P.pairwise_sum(v), p[:, 0])
    # zero padding to any power of two is the same tree
    assert torch.equal(P.pairwise_sum(torch.nn.functional.pad(v, (0, 53))), p[:, 0])
    assert torch.equal(P.pairwise_sum(v.T, dim=0), p[:, 0])
    assert torch.equal(P.pairwise_sum(torch.ones(1, 1)), torch.ones(1))


def test_rmsnorm_reference_is_rmsnorm(gen):
    x = torch.randn(4, 96, generator=gen, dtype=torch.float64)
    w = torch.randn(96, generator=gen, dtype=torch.float64)
    y, rstd = P.rmsnorm_reference(x.float(), w.float(), 1e-5)
    r64 = 1 / torch.sqrt((x.float().double() ** 2).mean(-1) + 1e-5)
    torch.testing.assert_close(rstd.double(), r64, rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), x.float().double() * r64[:, None] * w.float().double(), rtol=1e-6, atol=1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (4,)


def test_rmsnorm_backward_reference_is_the_gradient(gen):
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    y = x * torch.rsqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * w
    y.backward(dy)
    _, rstd = P.rmsnorm_reference(x.detach().float(), w.detach().float())
    dx, dw = P.rmsnorm_backward_reference(dy.float(), x.detach().float(), w.detach().float(), rstd)
    torch.testing.assert_close(dx.double(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), w.grad, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# rmsnorm_quant forward
# ----------------------------------------------------------------------------------------------


def _ref_rmsnorm_quant(x, w, eps, orient, mode, row_scaled):
    y, rstd = P.rmsnorm_reference(x.cpu(), w.cpu(), eps)
    outs = []
    if orient in ("hdim", "both"):
        mx = F.quantize_mxfp8(y, -1, mode)
        outs.append(F.to_row_scaled(mx) if row_scaled else mx)
    if orient in ("seq", "both"):
        outs.append(F.quantize_mxfp8(y, y.ndim - 2, mode))
    return (outs[0] if len(outs) == 1 else tuple(outs)), rstd


def _check_rmsnorm(x, w, eps, orient, mode, row_scaled, what):
    got = P.rmsnorm_quant(x, w, eps, orient, mode, row_scaled)
    want, rstd = _ref_rmsnorm_quant(x, w, eps, orient, mode, row_scaled)
    assert_same_float(got.rstd, rstd, f"{what} rstd")
    assert_same_out(got.out, want, what)
    return got


RMS_CASES = [
    # shape, dtype, orientations, row_scaled, scale_mode
    ((5, 96), torch.bfloat16, "hdim", False, "rceil"),
    ((3, 7, 200), torch.float32, "hdim", True, "floor"),
    ((2, 45, 96), torch.float16, "both", False, "rceil"),
    ((40, 64), torch.bfloat16, "seq", False, "floor"),
    ((1, 33, 50), torch.bfloat16, "both", True, "rceil"),
    ((9, 1), torch.float32, "hdim", False, "rceil"),
]


@pytest.mark.parametrize("shape,dtype,orient,row_scaled,mode", RMS_CASES)
def test_rmsnorm_quant_bit_exact(kernels, gen, shape, dtype, orient, row_scaled, mode):
    x = _rand(shape, dtype, gen, 3.0)
    w = _rand(shape[-1:], dtype, gen)
    _check_rmsnorm(x, w, 1e-5, orient, mode, row_scaled, f"{shape} {dtype} {orient}")


@pytest.mark.parametrize("orient,row_scaled,tile", [
    ("both", True, kr.FwdTile(32, 64, 4)),  # seq path, 3 chunks: scratch tree, exponent pass, reverse pass
    ("hdim", True, kr.FwdTile(4, 32, 4)),  # hdim-only, 5 chunks
    ("seq", False, kr.FwdTile(64, 32, 4)),  # two seq blocks per program
])
def test_rmsnorm_quant_chunked_bit_exact(kernels, gen, orient, row_scaled, tile):
    kr.TILE_OVERRIDES["fwd"] = tile
    x = _rand((2, 37, 160), torch.bfloat16, gen, 2.0)
    w = _rand((160,), torch.bfloat16, gen)
    _check_rmsnorm(x, w, 1e-6, orient, "rceil", row_scaled, f"chunked {orient} {tile}")


@pytest.mark.parametrize("orient", ["hdim", "both"])
def test_rmsnorm_quant_special_values(kernels, gen, orient):
    x = torch.randn(40, 64, generator=gen) * 2
    x[0] = 0.0  # zero row: rstd = 1/sqrt(eps), y = 0, scale byte 127
    x[1, 5] = float("nan")  # NaN row: every block NaN
    x[2, 7] = float("inf")  # Inf row: rstd = 0, y NaN at the Inf, 0 elsewhere
    x[3] = 1e-30  # tiny row
    x[4] = 3e38  # x*x overflows: rstd = 0, y = 0
    x[5, :32] = 1e-12  # a block far below the row maximum (re-expression flushes it)
    x = x.to(DEVICE)
    w = _rand((64,), torch.float32, gen)
    w[9] = 0.0
    for mode in ("rceil", "floor"):
        for rs in (False, True):
            _check_rmsnorm(x, w, 1e-6, orient, mode, rs, f"special {orient} {mode} rs={rs}")


def test_rmsnorm_quant_layouts(kernels, gen):
    """Kernel outputs: hdim contiguous like x; seq data a view of a channel-major buffer; rstd x.shape[:-1];
    non-contiguous x accepted."""
    x = _rand((2, 40, 64), torch.bfloat16, gen)
    w = _rand((64,), torch.bfloat16, gen)
    (h, s), rstd = P.rmsnorm_quant(x, w, orientations="both")
    assert h.data.shape == (2, 40, 64) and h.scale.shape == (2, 40, 2) and h.dim == 2
    assert s.data.shape == (2, 40, 64) and s.scale.shape == (2, 2, 64) and s.dim == 1
    assert s.data.stride(1) == 1 and s.data.stride(2) == 48  # (B, N, S_pad = 48)
    assert rstd.shape == (2, 40) and rstd.dtype == torch.float32
    xt = _rand((64, 40), torch.bfloat16, gen).T  # non-contiguous rows
    _check_rmsnorm(xt, w, 1e-6, "hdim", "rceil", False, "transposed x")
    r = P.rmsnorm_quant(x[0], w, orientations="seq")
    assert r.out.data.shape == (40, 64) and r.out.dim == 0 and r.out.scale.shape == (2, 64)


def test_rmsnorm_quant_cpu_path_same_api(gen):
    """CPU tensors without the kernels: the reference composition, same shapes and types."""
    x = torch.randn(2, 40, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, generator=gen).to(torch.bfloat16)
    (h, s), rstd = P.rmsnorm_quant(x, w, orientations="both")
    want, r = _ref_rmsnorm_quant(x, w, 1e-6, "both", "rceil", False)
    assert_same_out((h, s), want, "cpu")
    assert torch.equal(rstd, r)
    rs = P.rmsnorm_quant(x, w, row_scaled=True).out
    assert isinstance(rs, F.RowScaledFP8) and rs.exp.shape == (2, 40, 1)


# ----------------------------------------------------------------------------------------------
# rmsnorm_quant forward: the row-set kernel (seq / both orientations, MX scales; FwdTile(rowsets=True))
# ----------------------------------------------------------------------------------------------

# chunks of 32 / 64 columns so that the tiny shapes below have several (N = 160: 5 / 3 chunks); on the GPU the
# bench's tiles (producers.ROWSET_TILES)
ROWSET_CPU_TILES = [kr.FwdTile(32, 32, 4, rowsets=True), kr.FwdTile(32, 64, 4, rowsets=True)]
# the token-block kernel (FwdTile(token_blocks=True), opt-in since session 17) emits the same outputs: the row-set
# tests run it too
BLOCK_CPU_TILES = [kr.FwdTile(32, 32, 1, token_blocks=True), kr.FwdTile(32, 64, 2, token_blocks=True)]
SEQ_CPU_TILES = ROWSET_CPU_TILES + BLOCK_CPU_TILES

ROWSET_CASES = [
    # shape, dtype, orientations, scale_mode
    ((2, 37, 160), torch.bfloat16, "both", "rceil"),  # two batches, each with a 5-token block; N = 5 blocks
    ((40, 64), torch.bfloat16, "seq", "floor"),  # 2-D x: one full block and 8 tokens
    ((1, 33, 50), torch.float16, "both", "rceil"),  # N not a multiple of 32; a one-token block
    ((3, 5, 96), torch.float32, "seq", "floor"),  # S < 32: every block partial
    ((1, 96, 1), torch.bfloat16, "both", "rceil"),  # N = 1
    ((64, 200), torch.bfloat16, "both", "floor"),  # whole blocks, N % 64 = 8
]


def _tile_id(t) -> str:
    kind = "token_blocks-" if t.token_blocks else ""
    return kind + f"{t.block_m}x{t.block_n}x{t.num_warps}" + (f"r{t.maxnreg}" if t.maxnreg else "")


def _seq_padding(t: F.MXTensor) -> torch.Tensor:
    """Bytes of the tokens [S, S_pad) of a seq output's channel-major buffer (its data is the (.., S, N) view)."""
    d = t.data.view(U8)
    S, N, s_pad = d.shape[-2], d.shape[-1], d.stride(-1)
    full = torch.as_strided(d, (*d.shape[:-2], N, s_pad), (*d.stride()[:-2], s_pad, 1), d.storage_offset())
    return full[..., S:]


def _check_rowsets(x, w, eps, orient, mode, what):
    got = _check_rmsnorm(x, w, eps, orient, mode, False, what)
    s = got.out[1] if orient == "both" else got.out
    pad = _seq_padding(s)
    assert int(pad.count_nonzero()) == 0, f"{what}: {int(pad.count_nonzero())} nonzero padding bytes"


@pytest.mark.parametrize("tile", SEQ_CPU_TILES, ids=_tile_id)
@pytest.mark.parametrize("shape,dtype,orient,mode", ROWSET_CASES, ids=str)
def test_rmsnorm_quant_rowsets_bit_exact(kernels, gen, tile, shape, dtype, orient, mode):
    kr.TILE_OVERRIDES["fwd"] = tile
    x = _rand(shape, dtype, gen, 3.0)
    w = _rand(shape[-1:], dtype, gen)
    w[::7] = -w[::7].abs()  # negative weights: padding tokens must still come out as +0 bytes
    _check_rowsets(x, w, 1e-5, orient, mode, f"rowsets {_tile_id(tile)} {shape} {dtype} {orient} {mode}")


def _special_rows(gen) -> torch.Tensor:
    """70 tokens (blocks of 32, 32, 6) x 64: Inf / NaN / zero / tiny / overflowing rows in the first two blocks,
    the third block finite (the kernel then takes its finite path there)."""
    x = torch.randn(70, 64, generator=gen) * 2
    x[0] = 0.0  # zero row: rstd = 1/sqrt(eps) (Inf with eps = 0: NaN row), scale byte 127
    x[1, 5] = float("nan")  # NaN row: every block NaN
    x[2, 7] = float("inf")  # Inf row: rstd = 0, y NaN at the Inf, 0 elsewhere
    x[3] = 1e-30  # tiny row
    x[4] = 3e38  # x*x overflows: rstd = 0, y = 0
    x[5, :32] = 1e-12  # a block far below the row maximum
    x[40, 3] = -float("inf")  # second block
    x[66, :] = 0.0  # a zero row in the finite block
    return x


@pytest.mark.parametrize("tile", [SEQ_CPU_TILES[0], BLOCK_CPU_TILES[0]], ids=_tile_id)
@pytest.mark.parametrize("orient", ["seq", "both"])
def test_rmsnorm_quant_rowsets_special_values(kernels, gen, orient, tile):
    """Inf / NaN / zero / tiny / overflowing rows, eps 0, zero weights (the token-block kernel has no branch for
    these: its exponent select, the conversion and the padding tokens' rstd of 0 must give the same bytes)."""
    kr.TILE_OVERRIDES["fwd"] = tile
    x = _special_rows(gen).to(DEVICE)
    w = _rand((64,), torch.float32, gen)
    w[9] = 0.0
    w[11] = -w[11].abs()
    for mode in ("rceil", "floor"):
        for eps in (1e-6, 0.0):  # eps = 0: the zero rows get rstd = Inf, so y = 0 * Inf = NaN
            _check_rowsets(x, w, eps, orient, mode, f"rowsets special {orient} {mode} eps={eps}")


@pytest.mark.parametrize("tile", [SEQ_CPU_TILES[0], BLOCK_CPU_TILES[0]], ids=_tile_id)
@pytest.mark.parametrize("orient", ["seq", "both"])
def test_rmsnorm_quant_rowsets_weights_decide_the_nan_path(kernels, gen, orient, tile):
    """Rows all finite: a weight at or above 2^120 sends the program to the NaN-handling path (here y overflows
    to Inf, its blocks must get scale 255), one just below keeps the finite path (y cannot overflow)."""
    kr.TILE_OVERRIDES["fwd"] = tile
    x = _rand((2, 40, 64), torch.float32, gen, 2.0)
    for big, what in ((3e38, "overflowing weight"), (2.0 ** 119 * 1.99, "largest finite-path weight"),
                      (float("inf"), "Inf weight"), (float("nan"), "NaN weight")):
        w = _rand((64,), torch.float32, gen)
        w[3] = big
        got = _check_rmsnorm(x, w, 1e-6, orient, "rceil", False, f"rowsets {what} {orient}")
        s = got.out[1] if orient == "both" else got.out
        if big == 3e38:
            assert int((_u8(s.scale) == 255).sum()) > 0, "the overflow case made no NaN block: not a test"


def test_fwd_tile_defaults():
    """seq / both with MX scales take the row-set tiles the session-12 bench chose; row-scaled output and rows
    narrower than the tile's chunk keep the 4-D tile kernel; hdim-only is unchanged."""
    seq, both = kr.ROWSET_DEFAULTS["seq"], kr.ROWSET_DEFAULTS["both"]
    assert seq.rowsets and both.rowsets
    for N in (4096, 8192, 16384):
        assert kr.fwd_tile(N, True) == seq
        assert kr.fwd_tile(N, True, hdim=True) == both
        assert not kr.fwd_tile(N, True, row_scaled=True, hdim=True).rowsets
        assert not kr.fwd_tile(N, False).rowsets
        assert not kr.fwd_tile(N, True).token_blocks  # opt-in
    assert not kr.fwd_tile(seq.block_n - 1, True).rowsets
    assert not kr.fwd_tile(both.block_n - 1, True, hdim=True).rowsets
    with pytest.raises(ValueError, match="row-set tile"):
        kr.rmsnorm_quant_fwd(torch.zeros(1, 4, 64), torch.ones(64), 1e-6, hdim=True, seq=True, row_scaled=True,
                             rceil=True, tile=kr.FwdTile(32, 64, 4, rowsets=True))
    for seq, rs, n in ((False, False, 64), (True, True, 64), (True, False, 64 * 64 * 2)):
        with pytest.raises(ValueError, match="token-block tile"):
            kr.rmsnorm_quant_fwd(torch.zeros(1, 4, n), torch.ones(n), 1e-6, hdim=True, seq=seq, row_scaled=rs,
                                 rceil=True, tile=kr.FwdTile(32, 64, 2, token_blocks=True))


@triton.jit
def _exponents_kernel(a_ptr, out_ptr, n, RCEIL: tl.constexpr):
    i = tl.arange(0, 64)
    ok = i < n
    amax = tl.load(a_ptr + i, mask=ok, other=0)
    e_exact = kq._mx_exponent(amax, RCEIL)
    e_fast = kr._finite_exponent(amax, RCEIL)
    tl.store(out_ptr + i, e_exact, mask=ok)
    tl.store(out_ptr + 64 + i, tl.where(amax == 0, e_exact, e_fast), mask=ok)
    tl.store(out_ptr + 128 + i, tl.where(amax < 0x7F800000, e_exact + 127, 255), mask=ok)
    tl.store(out_ptr + 192 + i, kr._finite_scale(amax, e_fast).to(tl.int32), mask=ok)


@pytest.mark.parametrize("rceil", [True, False], ids=["rceil", "floor"])
def test_finite_exponent_is_mx_exponent(rceil):
    """The row-set kernel's finite-tile exponent and scale byte against ``_mx_exponent``'s on block maxima around
    every rounding edge: zero, fp32 subnormals, mantissas 1.75 -> next (RCEIL's step), powers of two, the
    largest finite value."""
    mags = [0, 1, 0x7FFFFF, 0x600000, 0x600001, 0x800000, 0xDFFFFF, 0xE00000, 0xE00001, 0x3F800000, 0x3FE00000,
            0x3FE00001, 0x43E00000, 0x43E00001, 0x43FFFFFF, 0x7F000000, 0x7F600000, 0x7F600001, 0x7F7FFFFF]
    a = torch.tensor(mags, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    _exponents_kernel[(1,)](a, out, len(mags), RCEIL=rceil)
    o = out.cpu()
    n = len(mags)
    assert torch.equal(o[64:64 + n], o[:n]), f"exponents differ: {o[:n].tolist()} vs {o[64:64 + n].tolist()}"
    assert torch.equal(o[192:192 + n], o[128:128 + n]), "scale bytes differ"


# ----------------------------------------------------------------------------------------------
# rmsnorm backward and autograd
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dtype,mx_dy", [
    ((37, 96), torch.bfloat16, False),
    ((3, 5, 200), torch.float32, False),
    ((9, 64), torch.float16, True),
    ((37, 96), torch.bfloat16, True),
])
def test_rmsnorm_backward_bit_exact(kernels, gen, shape, dtype, mx_dy):
    kr.TILE_OVERRIDES.update({"bwd_block_m": 4, "bwd_programs": 3})  # several programs, several tiles each
    x = _rand(shape, dtype, gen, 2.0)
    w = _rand(shape[-1:], dtype, gen)
    dy = _rand(shape, dtype, gen)
    if mx_dy:
        dy = F.quantize_mxfp8(dy.float(), -1)
    rstd = P.rmsnorm_quant(x, w).rstd
    dx, dw = P.rmsnorm_quant_backward(dy, x, w, rstd)
    N = shape[-1]
    plan = kr.bwd_plan(x.numel() // N, N, x.device)
    assert -(-(x.numel() // N) // plan.rows_per_prog) > 1  # several partials
    rdx, rdw = P.rmsnorm_backward_reference(dy.to("cpu") if mx_dy else dy.cpu(), x.cpu(), w.cpu(), rstd.cpu(), plan)
    assert_same_float(dx, rdx.to(dtype), "dx")
    assert_same_float(dw, rdw.to(dtype), "dweight")


def test_rmsnorm_backward_deterministic(kernels, gen):
    kr.TILE_OVERRIDES.update({"bwd_block_m": 2, "bwd_programs": 4})
    x = _rand((21, 64), torch.float32, gen)
    w = _rand((64,), torch.float32, gen)
    dy = _rand((21, 64), torch.float32, gen)
    rstd = P.rmsnorm_quant(x, w).rstd
    a = P.rmsnorm_quant_backward(dy, x, w, rstd)
    b = P.rmsnorm_quant_backward(dy, x, w, rstd)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("orient,row_scaled", [("hdim", False), ("both", False), ("hdim", True)])
def test_rmsnorm_quant_autograd_ste(kernels, gen, orient, row_scaled):
    """loss(dequantize(out)).backward() gives the RMSNorm gradients of the upstream gradient (STE)."""
    x = _rand((2, 33, 64), torch.float32, gen).requires_grad_(True)
    w = _rand((64,), torch.float32, gen).requires_grad_(True)
    gh = _rand((2, 33, 64), torch.float32, gen)
    gs = _rand((2, 33, 64), torch.float32, gen)
    res = P.rmsnorm_quant(x, w, orientations=orient, row_scaled=row_scaled)
    outs = res.out if isinstance(res.out, tuple) else (res.out,)
    assert all(isinstance(o, (P.GradMXTensor, P.GradRowScaledFP8)) for o in outs)
    loss = (outs[0].dequantize() * gh).sum()
    dy = gh
    if len(outs) == 2:
        loss = loss + (outs[1].dequantize() * gs).sum()
        dy = gh + gs
    # the forward value is the dequantized quantization of y
    y, _ = P.rmsnorm_reference(x.detach().cpu(), w.detach().cpu())
    torch.testing.assert_close(outs[0].dequantize().detach().cpu(), y, rtol=2 ** -3, atol=1e-3)
    loss.backward()
    rdx, rdw = P.rmsnorm_backward_reference(dy.cpu(), x.detach().cpu(), w.detach().cpu(), res.rstd.detach().cpu())
    torch.testing.assert_close(x.grad.cpu(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.cpu(), rdw, rtol=1e-4, atol=1e-4)
    assert not res.rstd.requires_grad


def test_rmsnorm_quant_no_grad_gives_plain(kernels, gen):
    x = _rand((4, 32), torch.float32, gen).requires_grad_(True)
    w = _rand((32,), torch.float32, gen)
    with torch.no_grad():
        r = P.rmsnorm_quant(x, w)
    assert type(r.out) is F.MXTensor


# ----------------------------------------------------------------------------------------------
# linear_quant
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R,K,chunk", [(7, 160, 2048), (5, 176, 64), (3, 96, 32)])
def test_row_scaled_rows_bit_exact(kernels, gen, monkeypatch, R, K, chunk):
    monkeypatch.setattr(kl, "ROWS_CHUNK", chunk)
    x = torch.randn(R, K, generator=gen) * 3
    x[0, :40] = 0.0  # leading zero blocks: not counted in the row exponent
    x[1, 3] = float("nan")
    x[2, 40:] = 1e-9  # blocks far below the row maximum
    x = x.to(torch.bfloat16).to(DEVICE)
    got = kl.row_scaled_rows(x, True)
    want = F.row_scaled_from_float(x.cpu(), -1)
    assert_same_out(got, want, "from float")
    mx = F.quantize_mxfp8(x.cpu(), -1, "floor")
    got = kl.row_scaled_rows(mx.to(DEVICE), True)
    assert_same_out(got, F.to_row_scaled(mx), "from MX")


def _operand(kind, t, gen):
    if kind == "float":
        return t
    if kind == "mx":
        return F.quantize_mxfp8(t, -1)
    if kind == "rs":
        return F.row_scaled_from_float(t, -1)
    if kind == "rs_tensor":  # one exponent for the whole tensor
        rows = F.row_scaled_from_float(t, -1)
        e = rows.exp.max()
        mx = F.quantize_mxfp8(t, -1)
        full = F.to_row_scaled(mx, group_dim=0, group=t.shape[0])
        assert full.exp.max() == e
        return full
    raise ValueError(kind)


@pytest.mark.parametrize("xkind,wkind,bias", [
    ("float", "float", True),
    ("mx", "rs", False),
    ("rs", "rs_tensor", True),
])
def test_linear_quant_against_reference(kernels, gen, xkind, wkind, bias):
    M, K, N = 199, 160, 96
    x = _rand((M, K), torch.bfloat16, gen)
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    b = _rand((N,), torch.float32, gen) if bias else None
    xo, wo = _operand(xkind, x, gen), _operand(wkind, w, gen)
    got = P.linear_quant(xo, wo, b)
    want = P.linear_quant_reference(_to_cpu(xo), _to_cpu(wo), None if b is None else b.cpu())
    assert got.data.shape == (M, N) and got.scale.shape == (M, 3)
    assert_mx_close(got, want, f"linear {xkind} x {wkind}")


def _to_cpu(t):
    if isinstance(t, torch.Tensor):
        return t.cpu()
    if isinstance(t, F.MXTensor):
        return t.to("cpu")
    return F.RowScaledFP8(t.data.cpu(), t.exp.cpu(), t.dim, t.group_dim, t.group)


@pytest.mark.parametrize("shape,orient,N", [((2, 45, 64), "both", 64), ((70, 32), "seq", 80), ((3, 5, 48), "hdim", 40)])
def test_linear_quant_orientations(kernels, gen, shape, orient, N):
    x = _rand(shape, torch.float16, gen)
    w = _rand((N, shape[-1]), torch.float32, gen, 0.2)
    got = P.linear_quant(x, w, orientations=orient)
    want = P.linear_quant_reference(x.cpu(), w.cpu(), orientations=orient)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, wt in zip(got, want):
        assert_mx_close(g, wt, f"{shape} {orient} dim={wt.dim}")
    if orient != "hdim":
        s = got[-1]
        assert s.dim == len(shape) - 2 and s.data.stride(-2) == 1  # channel-major


def test_linear_quant_chain_from_rmsnorm(kernels, gen):
    """rmsnorm_quant(row_scaled=True) feeds linear_quant directly; the forward equals the reference
    composition and gradients reach x, the norm weight and the projection weight (STE, BF16 backward)."""
    x = _rand((2, 40, 64), torch.float32, gen).requires_grad_(True)
    g = _rand((64,), torch.float32, gen).requires_grad_(True)
    W = _rand((96, 64), torch.float32, gen, 0.125).requires_grad_(True)
    xn = P.rmsnorm_quant(x, g, row_scaled=True).out
    assert isinstance(xn, P.GradRowScaledFP8)
    out = P.linear_quant(xn, W, orientations="hdim")
    want = P.linear_quant_reference(_to_cpu(xn.plain()), W.detach().cpu())
    assert_mx_close(out, want, "chain forward")
    up = _rand((2, 40, 96), torch.float32, gen)
    (out.dequantize() * up).sum().backward()
    # expected grads: STE through both quantizers
    wr = F.row_scaled_from_float(W.detach().cpu(), -1).dequantize()
    xr = xn.plain().dequantize().cpu()
    dxn = up.cpu() @ wr
    torch.testing.assert_close(W.grad.cpu(), up.cpu().reshape(-1, 96).T @ xr.reshape(-1, 64), rtol=1e-4, atol=1e-4)
    _, rstd = P.rmsnorm_reference(x.detach().cpu(), g.detach().cpu())
    rdx, rdg = P.rmsnorm_backward_reference(dxn, x.detach().cpu(), g.detach().cpu(), rstd)
    torch.testing.assert_close(x.grad.cpu(), rdx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g.grad.cpu(), rdg, rtol=1e-4, atol=1e-4)


def test_linear_quant_bias_grad_and_cpu_path(gen):
    x = torch.randn(8, 32, generator=gen, requires_grad=True)
    w = torch.randn(16, 32, generator=gen)
    b = torch.randn(16, generator=gen, requires_grad=True)
    out = P.linear_quant(x, w, b)
    assert isinstance(out, P.GradMXTensor)
    out.dequantize().sum().backward()
    torch.testing.assert_close(b.grad, torch.full((16,), 8.0))
    wr = F.row_scaled_from_float(w, -1).dequantize()
    torch.testing.assert_close(x.grad, torch.ones(8, 16) @ wr)


@pytest.mark.parametrize("use_kernels", [False, True])
def test_empty_inputs(monkeypatch, use_kernels):
    monkeypatch.setattr(P, "_KERNELS_ON_CPU", use_kernels)
    monkeypatch.setattr(kl, "TILE_OVERRIDE", kl.LinearTile(32, 32, 32, 2, 4, 2, True))
    w = torch.randn(64, device=DEVICE)
    r = P.rmsnorm_quant(torch.randn(0, 64, device=DEVICE), w)
    assert r.out.data.shape == (0, 64) and r.out.scale.shape == (0, 2) and r.rstd.shape == (0,)
    (h, s), rstd = P.rmsnorm_quant(torch.randn(2, 0, 64, device=DEVICE), w, orientations="both")
    assert h.data.shape == s.data.shape == (2, 0, 64) and s.scale.shape == (2, 0, 64) and rstd.shape == (2, 0)
    dx, dw = P.rmsnorm_quant_backward(torch.randn(0, 64, device=DEVICE), torch.randn(0, 64, device=DEVICE), w,
                                      torch.randn(0, device=DEVICE))
    assert dx.shape == (0, 64) and torch.equal(dw.cpu(), torch.zeros(64))
    o = P.linear_quant(torch.randn(2, 0, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE), orientations="both")
    assert o[0].data.shape == o[1].data.shape == (2, 0, 16) and o[1].scale.shape == (2, 0, 16)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous tensor (every other element along the last dim of a wider buffer)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    buf[..., ::2] = t
    return buf[..., ::2]


@pytest.mark.parametrize("use_kernels", [False, True])
def test_strided_operands_give_the_contiguous_result(monkeypatch, use_kernels, gen):
    """Non-contiguous x, weight, bias, dy and rstd (weight and bias: read by the kernels at unit stride, so the
    producer makes them contiguous) give the contiguous copies' outputs bit for bit."""
    monkeypatch.setattr(P, "_KERNELS_ON_CPU", use_kernels)
    monkeypatch.setattr(kl, "TILE_OVERRIDE", None if CUDA else kl.LinearTile(32, 32, 32, 2, 4, 2, True))
    x = _rand((2, 40, 64), torch.bfloat16, gen)
    w = _rand((64,), torch.bfloat16, gen)
    W = _rand((48, 64), torch.bfloat16, gen)
    b = _rand((48,), torch.bfloat16, gen)
    xs, ws, Ws, bs = (_strided(t) for t in (x, w, W, b))
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # a column-major x as well
    assert not any(t.is_contiguous() for t in (xs, ws, Ws, bs, xt))
    want = P.rmsnorm_quant(x, w, orientations="both")
    for xx in (xs, xt):
        got = P.rmsnorm_quant(xx, ws, orientations="both")
        assert_same_out(got.out, want.out, "rmsnorm_quant")
        assert_same_float(got.rstd, want.rstd, "rstd")
    dy = _rand((2, 40, 64), torch.bfloat16, gen)
    for g, e, name in zip(P.rmsnorm_quant_backward(_strided(dy), xs, ws, _strided(want.rstd)),
                          P.rmsnorm_quant_backward(dy, x, w, want.rstd), ("dx", "dweight")):
        assert_same_float(g, e, name)
    want = P.linear_quant(x, W, b, orientations="both")
    for xx in (xs, xt):
        assert_same_out(P.linear_quant(xx, Ws, bs, orientations="both"), want, "linear_quant")


# ----------------------------------------------------------------------------------------------
# input checks (before any launch)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel or reference ran before the input checks")

    monkeypatch.setattr(P, "_rmsnorm_quant_impl", boom)
    monkeypatch.setattr(P, "_rmsnorm_backward_impl", boom)
    monkeypatch.setattr(P, "_linear_quant_impl", boom)


def test_rmsnorm_quant_input_checks(no_launch):
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with pytest.raises(TypeError, match="x must be"):
        P.rmsnorm_quant(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="x must be"):
        P.rmsnorm_quant(x.numpy(), w)
    with pytest.raises(TypeError, match="weight"):
        P.rmsnorm_quant(x, w.double())
    with pytest.raises(ValueError, match="weight must have shape"):
        P.rmsnorm_quant(x, torch.randn(32))
    with pytest.raises(ValueError, match="orientations"):
        P.rmsnorm_quant(x, w, orientations="rows")
    with pytest.raises(ValueError, match="x must be .S, N. or .B, S, N."):
        P.rmsnorm_quant(torch.randn(2, 2, 4, 64), w, orientations="seq")
    with pytest.raises(ValueError, match="scale_mode"):
        P.rmsnorm_quant(x, w, scale_mode="up")
    with pytest.raises(ValueError, match="eps"):
        P.rmsnorm_quant(x, w, eps=-1.0)
    for eps in (float("inf"), float("nan"), 10**400):
        with pytest.raises(ValueError, match="eps must be finite and >= 0"):
            P.rmsnorm_quant(x, w, eps=eps)
    for eps in (True, "1e-6", torch.tensor(1e-6)):
        with pytest.raises(TypeError, match="eps must be a float"):
            P.rmsnorm_quant(x, w, eps=eps)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        P.rmsnorm_quant(x, w.to("meta"))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        P.rmsnorm_quant(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match="x: the normalized size"):
        P.rmsnorm_quant(torch.randn(2, P.MAX_N + 32), torch.randn(P.MAX_N + 32))
    with pytest.raises(TypeError, match="row_scaled"):
        P.rmsnorm_quant(x, w, row_scaled=1)
    with pytest.raises(ValueError, match="row_scaled=True changes the hdim output"):
        P.rmsnorm_quant(x, w, orientations="seq", row_scaled=True)
    with pytest.raises(ValueError, match="dy must have"):
        P.rmsnorm_quant_backward(torch.randn(4, 32), x, w, torch.ones(4))
    with pytest.raises(ValueError, match="dy must be an MXTensor blocked along N"):
        P.rmsnorm_quant_backward(F.quantize_mxfp8(x, 0), x, w, torch.ones(4))
    with pytest.raises(TypeError, match="rstd"):
        P.rmsnorm_quant_backward(x, x, w, torch.ones(4, dtype=torch.float64))


def test_linear_quant_input_checks(no_launch):
    x = torch.randn(8, 64)
    w = torch.randn(32, 64)
    with pytest.raises(TypeError, match="x must be"):
        P.linear_quant(x.to(torch.int8), w)
    with pytest.raises(TypeError, match="weight must be"):
        P.linear_quant(x, w.to(torch.float64))
    with pytest.raises(ValueError, match="x: the contraction size K"):
        P.linear_quant(torch.randn(8, 40), torch.randn(32, 40))
    with pytest.raises(ValueError, match="weight must be .N, K."):
        P.linear_quant(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="x must be an MXTensor blocked along K"):
        P.linear_quant(F.quantize_mxfp8(x, 0), w)
    with pytest.raises(ValueError, match="weight must be a RowScaledFP8 with dim=-1"):
        P.linear_quant(x, F.row_scaled_from_float(w, 0))
    with pytest.raises(ValueError, match="x must be .S, K. or .B, S, K."):
        P.linear_quant(torch.randn(2, 2, 8, 64), w, orientations="seq")
    with pytest.raises(ValueError, match="bias must have shape"):
        P.linear_quant(x, w, torch.randn(31))
    with pytest.raises(TypeError, match="bias must be"):
        P.linear_quant(x, w, torch.randn(32).to(torch.int32))
    with pytest.raises(ValueError, match="orientations"):
        P.linear_quant(x, w, orientations="cols")
    with pytest.raises(ValueError, match="x must be a RowScaledFP8 with one exponent per row"):
        P.linear_quant(F.row_scaled_from_float(x, -1, group_dim=0, group=4), w)


# ----------------------------------------------------------------------------------------------
# GPU (H200)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("M,N,orient,row_scaled", [
    (4096, 4096, "hdim", False), (2048, 8192, "hdim", True), (1024, 4096, "both", False),
    (777, 16384, "hdim", True), (3 * 333, 1000, "both", True),
])
def test_gpu_rmsnorm_quant_bit_exact(kernels, gen, monkeypatch, soft, M, N, orient, row_scaled):
    monkeypatch.setattr(kq, "SOFT_ROUND_ON_GPU", soft)
    x = _rand((3, M // 3, N) if orient != "hdim" else (M, N), torch.bfloat16, gen, 4.0)
    w = _rand((N,), torch.bfloat16, gen)
    _check_rmsnorm(x, w, 1e-6, orient, "rceil", row_scaled, f"gpu M{M} N{N} {orient} soft={soft}")


def _gpu_rowset_tiles():
    """Every row-set tile the session-12 bench compares with the defaults (producers.ROWSET_TILES) and every
    token-block tile of session 17 (producers.TOKEN_BLOCK_TILES): whichever becomes a default has passed these."""
    return [pytest.param(orient, t, id=f"{orient}-{_tile_id(t)}") for orient in P.ROWSET_TILES
            for t in P.rowset_tiles(orient) + P.token_block_tiles()]


@pytest.mark.gpu
@pytest.mark.parametrize("orient,tile", _gpu_rowset_tiles())
@pytest.mark.parametrize("M,N", [(2048, 4096), (3 * 341, 8192), (999, 1000), (513, 16384), (96, 100)])
def test_gpu_rmsnorm_quant_rowsets_bit_exact(kernels, gen, orient, tile, M, N):
    kr.TILE_OVERRIDES["fwd"] = tile
    x = _rand((3, M // 3, N), torch.bfloat16, gen, 4.0)
    w = _rand((N,), torch.bfloat16, gen)
    w[::7] = -w[::7].abs()
    _check_rowsets(x, w, 1e-6, orient, "rceil", f"gpu rowsets {_tile_id(tile)} M{M} N{N} {orient}")


def _gpu_first_rowset_tiles():
    """The first row-set tile and the first token-block tile of each orientation (``_gpu_rowset_tiles``'
    parameters)."""
    return [p for p in _gpu_rowset_tiles()
            if p.values[1] in (P.rowset_tiles(p.values[0])[0], P.token_block_tiles()[0])]


@pytest.mark.gpu
@pytest.mark.parametrize("orient,tile", _gpu_first_rowset_tiles())
def test_gpu_rmsnorm_quant_rowsets_soft_floor_and_dtypes(kernels, gen, monkeypatch, orient, tile):
    """The explicit fp32 rounding (``SOFT_ROUND_ON_GPU``), FLOOR, and fp16 / fp32 inputs through the row-set
    kernel on the GPU (one tile per orientation: each combination is a build of its own, ~3 s on the GPU
    machine; the tiles differ in layout, which every test of the other GPU tests runs)."""
    kr.TILE_OVERRIDES["fwd"] = tile
    for soft, mode, dtype in ((True, "rceil", torch.bfloat16), (False, "floor", torch.float16),
                              (True, "floor", torch.float32)):
        monkeypatch.setattr(kq, "SOFT_ROUND_ON_GPU", soft)
        x = _rand((2, 777, 1024), dtype, gen, 4.0)
        w = _rand((1024,), dtype, gen)
        _check_rowsets(x, w, 1e-6, orient, mode, f"gpu rowsets {_tile_id(tile)} soft={soft} {mode} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("orient,tile", _gpu_rowset_tiles())
def test_gpu_rmsnorm_quant_rowsets_special_values(kernels, gen, orient, tile):
    """Inf / NaN / zero / overflowing rows and huge weights on the GPU: the NaN path's bytes come from the
    hardware conversion OR'ed with 0x7F, the finite path skips it (a finite block beside the bad ones)."""
    kr.TILE_OVERRIDES["fwd"] = tile
    bf = torch.bfloat16  # the builds of test_gpu_rmsnorm_quant_rowsets_bit_exact (and bf16 holds 3e38)
    x = _special_rows(gen).to(bf).to(DEVICE)
    w = _rand((64,), bf, gen)
    w[9] = 0.0
    for mode in ("rceil", "floor"):
        for eps in (1e-6, 0.0):
            _check_rowsets(x, w, eps, orient, mode, f"gpu rowsets special {_tile_id(tile)} {mode} eps={eps}")
    x2 = _rand((2, 40, 300), bf, gen, 2.0)
    for big in (3e38, 2.0 ** 119 * 1.99, float("inf"), float("nan")):
        w2 = _rand((300,), bf, gen)
        w2[3] = big
        _check_rowsets(x2, w2, 1e-6, orient, "rceil", f"gpu rowsets weight {big} {_tile_id(tile)}")


@triton.jit
def _packing_kernel(y_ptr, words_ptr, runs_ptr, SOFT: tl.constexpr):
    """The row-set kernel's two e4m3 packers against Triton's own cast of the same values."""
    i = tl.arange(0, 1024)
    y0 = tl.load(y_ptr + i)
    y1 = tl.load(y_ptr + 1024 + i)
    y2 = tl.load(y_ptr + 2048 + i)
    y3 = tl.load(y_ptr + 3072 + i)
    tl.store(words_ptr + i, kr._e4m3_word(y0, y1, y2, y3, SOFT))
    plain = (kq._e4m3_bytes(y0, SOFT).to(tl.int32) | (kq._e4m3_bytes(y1, SOFT).to(tl.int32) << 8)
             | (kq._e4m3_bytes(y2, SOFT).to(tl.int32) << 16) | (kq._e4m3_bytes(y3, SOFT).to(tl.int32) << 24))
    tl.store(words_ptr + 1024 + i, plain)
    tl.store(runs_ptr + i, kr._e4m3_run(y0, SOFT))
    tl.store(runs_ptr + 1024 + i, kq._e4m3_bytes(y0, SOFT))


@pytest.mark.gpu
def test_gpu_rmsnorm_rowsets_packers_equal_the_cast(gen):
    """``_e4m3_word`` / ``_e4m3_run`` (inline cvt.rn.satfinite.e4m3x2 on the GPU) give the bytes of the e4m3
    cast, in the stated byte order, on random values and every special one (+-0, subnormals, halfway cases,
    448 / 464 / 480, Inf, NaN)."""
    y = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-12, 10, (4096,), generator=gen).float())
    specials = torch.tensor([0.0, -0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6, 0.9375 * 2.0 ** -6,
                             448.0, -448.0, 464.0, 480.0, 1e30, float("inf"), -float("inf"), float("nan"),
                             1.0625, 1.1875, 17.0, -17.0])
    y[:len(specials)] = specials
    y[1024:1024 + len(specials)] = specials.flip(0)
    y = y.to(DEVICE)
    words = torch.empty(2048, dtype=torch.int32, device=DEVICE)
    runs = torch.empty(2048, dtype=torch.uint8, device=DEVICE)
    _packing_kernel[(1,)](y, words, runs, SOFT=False)
    assert_same_bytes(words[:1024].view(U8), words[1024:].view(U8), "e4m3 words", nan_sign=False)
    assert_same_bytes(runs[:1024], runs[1024:], "e4m3 runs", nan_sign=False)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,dtype", [(4096, 4096, torch.bfloat16), (1000, 8192, torch.float32), (513, 16384, torch.bfloat16)])
def test_gpu_rmsnorm_backward_bit_exact(kernels, gen, M, N, dtype):
    x = _rand((M, N), dtype, gen, 2.0)
    w = _rand((N,), dtype, gen)
    dy = _rand((M, N), dtype, gen)
    rstd = P.rmsnorm_quant(x, w).rstd
    dx, dw = P.rmsnorm_quant_backward(dy, x, w, rstd)
    plan = kr.bwd_plan(M, N, x.device)
    rdx, rdw = P.rmsnorm_backward_reference(dy.cpu(), x.cpu(), w.cpu(), rstd.cpu(), plan)
    assert_same_float(dx, rdx.to(dtype), "dx")
    assert_same_float(dw, rdw.to(dtype), "dweight")


@pytest.mark.gpu
@pytest.mark.parametrize("precise", [True, False])
@pytest.mark.parametrize("M,K,N,orient", [(2048, 4096, 1024, "hdim"), (2 * 1000, 1024, 3 * 512, "both"), (199, 160, 96, "both")])
def test_gpu_linear_quant_against_reference(gen, monkeypatch, precise, M, K, N, orient):
    monkeypatch.setattr(kl, "TILE_OVERRIDE", kl.LinearTile(precise_acc=precise))
    shape = (2, M // 2, K) if orient != "hdim" else (M, K)
    x = _rand(shape, torch.bfloat16, gen)
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    b = _rand((N,), torch.bfloat16, gen)
    xr = P.rmsnorm_quant(x, torch.ones(K, device=DEVICE, dtype=torch.bfloat16), row_scaled=True).out
    got = P.linear_quant(xr, w, b, orientations=orient)
    want = P.linear_quant_reference(_to_cpu(xr), w.cpu(), b.cpu(), orientations=orient)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    # |x| @ |W|^T from the row-scaled operands the kernel multiplies: the bound on the FP8 MMA's accumulation
    xr2, wr2 = P._as_row_scaled(P._flatten_rows(_to_cpu(xr), K), "rceil"), P._as_row_scaled(w.cpu(), "rceil")
    # without promotion (precise=False) the partial sums of all of K stay in the wgmma's ~14-bit adder: 2x more
    acc_abs = ACC_REL * (1 if precise else 2) * (xr2.dequantize(torch.float64).abs() @ wr2.dequantize(torch.float64).abs().T)
    acc_abs = acc_abs.reshape(*shape[:-1], N)  # both orientations dequantize to this layout
    for g, wt in zip(got, want):
        stats = assert_mx_close(g, wt, f"gpu linear {M}x{K}x{N} {orient} precise={precise}",
                                min_equal=0.99 if precise else 0.95, acc_abs=acc_abs)
        print(f"linear {M}x{K}x{N} {orient} dim={wt.dim} precise={precise}: {stats}")


@pytest.mark.skipif(CUDA, reason="checks the CPU refusal")
def test_bench_producers_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        P.bench_producers()


@pytest.mark.gpu
def test_gpu_bench_producers_smoke():
    out = P.bench_producers(quick=True, rep_ms=20, rms_sizes=((2048, 4096),), linear_sizes=((2048, 1024, 1024),),
                            progress=False)
    assert out["rmsnorm_quant"] and out["linear_quant"]
    assert all(r["gbps"] > 0 for r in out["rmsnorm_quant"])
    hopper = torch.cuda.get_device_capability()[0] == 9
    for r in out["linear_quant"]:
        assert r["tflops"]["mxattn_tl"] > 0
        assert ("mxattn_gluon" in r["tflops"]) == hopper and ("gluon_ratio_vs_scaled_mm_fp8" in r) == hopper


# ----------------------------------------------------------------------------------------------
# scale_layout="blackwell": the feature-blocked output's scales straight in the 128x4-tiled layout
# ----------------------------------------------------------------------------------------------


def _assert_tiled_matches(tiled, plain):
    """Same data bytes; tiled scale bytes (padding included) = the converter on the plain (rows, cols) scales."""
    assert isinstance(tiled, F.MXTensorTiled) and not tiled.per_head
    assert torch.equal(_u8(tiled.data), _u8(plain.data))
    cols = plain.scale.shape[-1]
    want = F.to_blackwell_scale_layout(plain.scale_bytes.reshape(-1, cols).cpu())
    assert torch.equal(_u8(tiled.scale_tiled), want)
    mx = tiled.to_mx()
    assert torch.equal(_u8(mx.scale), _u8(plain.scale))


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "reference"])
@pytest.mark.parametrize("shape", [(2, 37, 96), (130, 64), (3, 200)], ids=str)
def test_rmsnorm_quant_blackwell_scale_layout(use_kernels, shape, gen, monkeypatch):
    monkeypatch.setattr(P, "_KERNELS_ON_CPU", use_kernels)
    monkeypatch.setattr(kr, "TILE_OVERRIDES", {})
    x = _rand(shape, torch.float32, gen)
    w = _rand((shape[-1],), torch.float32, gen)
    plain = P.rmsnorm_quant(x, w).out
    tiled = P.rmsnorm_quant(x, w, scale_layout="blackwell").out
    _assert_tiled_matches(tiled, plain)


def test_linear_quant_blackwell_scale_layout(kernels, gen):
    x = _rand((2, 37, 64), torch.float32, gen)
    w = _rand((96, 64), torch.float32, gen)
    b = _rand((96,), torch.float32, gen)
    plain = P.linear_quant(x, w, b)
    tiled = P.linear_quant(x, w, b, scale_layout="blackwell")
    _assert_tiled_matches(tiled, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 1000, 4096), (4097, 1024), (3, 129, 160)], ids=str)
def test_gpu_producers_blackwell_scale_layout(kernels, gen, shape):
    """On the GPU (the kernels' compiled paths): rmsnorm_quant and linear_quant with scale_layout="blackwell" write
    the same data bytes as the plain layout and the converter's 128x4-tiled scales, padding included."""
    x = _rand(shape, torch.bfloat16, gen)
    w = _rand((shape[-1],), torch.bfloat16, gen)
    _assert_tiled_matches(P.rmsnorm_quant(x, w, scale_layout="blackwell").out, P.rmsnorm_quant(x, w).out)
    wl = _rand((3 * 256, shape[-1]), torch.bfloat16, gen)
    b = _rand((3 * 256,), torch.bfloat16, gen)
    _assert_tiled_matches(P.linear_quant(x, wl, b, scale_layout="blackwell"), P.linear_quant(x, wl, b))


def test_blackwell_scale_layout_autograd_and_checks(kernels, gen):
    """The tiled outputs stay in the autograd graph (STE, same gradients as the plain layout's); the tiled layout
    is refused where it is not produced (token-blocked or row-scaled outputs, unknown names)."""
    x = _rand((2, 33, 64), torch.float32, gen)
    w = _rand((64,), torch.float32, gen)
    wl = _rand((32, 64), torch.float32, gen)
    g = _rand((2, 33, 32), torch.float32, gen)
    grads = []
    for layout in ("plain", "blackwell"):
        xs = x.clone().requires_grad_(True)
        h = P.rmsnorm_quant(xs, w, scale_layout=layout).out
        y = P.linear_quant(h, wl, scale_layout=layout)
        assert isinstance(y, P.GradMXTensorTiled if layout == "blackwell" else P.GradMXTensor)
        (y.dequantize() * g).sum().backward()
        grads.append(xs.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale_layout"):
        P.rmsnorm_quant(x, w, orientations="both", scale_layout="blackwell")
    with pytest.raises(ValueError, match="scale_layout"):
        P.rmsnorm_quant(x, w, row_scaled=True, scale_layout="blackwell")
    with pytest.raises(ValueError, match="scale_layout"):
        P.linear_quant(x, wl, scale_layout="tiled")
