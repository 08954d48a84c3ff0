"""The Triton quantize / dequantize / Hopper-operand kernels against ``mxattn.formats``, byte for byte.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set here, before the kernels are imported) on
tiny shapes; with CUDA every test runs compiled on the GPU, and the tests marked ``gpu`` add larger shapes,
both GPU rounding paths (hardware cvt and the explicit fp32 rounding) and a tensor past 2^31 elements.
The reference always runs on the CPU, so NaN signs follow one definition.  Seeds: ``conftest.seed``.

    PYTHONPATH=. python -m pytest tests/test_quantize_kernels.py            # CPU: interpreter
    PYTHONPATH=. python -m pytest -m gpu tests/test_quantize_kernels.py    # H200
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import mxattn.kernels.quantize as kq  # noqa: E402  (after TRITON_INTERPRET)
from mxattn import formats as F  # noqa: E402

if not torch.cuda.is_available() and type(kq._quantize_kernel).__name__ != "InterpretedFunction":
    kq = importlib.reload(kq)  # imported earlier without the interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("rceil", "floor")
U8 = torch.uint8


# ----------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(U8) if t.dtype != U8 else t.detach().cpu().contiguous()


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = _u8(got), _u8(want)
    bad = g != w
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        n = int(bad.sum())
        raise AssertionError(
            f"{what}: {n} of {bad.numel()} bytes differ; first at {idx}: got {g[tuple(idx)].item():#04x}, "
            f"want {w[tuple(idx)].item():#04x}"
        )


def assert_same_int(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu(), want.cpu()
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = got != want
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} differ; first at {idx}: got {got[tuple(idx)].item()}, "
                             f"want {want[tuple(idx)].item()}")


def assert_same_mx(got: F.MXTensor, want: F.MXTensor, what: str) -> None:
    assert got.dim == want.dim, f"{what}: dim {got.dim} != {want.dim}"
    assert_same_bytes(got.data, want.data, f"{what} data")
    assert_same_bytes(got.scale, want.scale, f"{what} scale")


def assert_same_rs(got: F.RowScaledFP8, want: F.RowScaledFP8, what: str) -> None:
    assert (got.dim, got.group_dim, got.group) == (want.dim, want.group_dim, want.group), what
    assert_same_int(got.exp, want.exp, f"{what} exp")
    assert_same_bytes(got.data, want.data, f"{what} data")


def assert_same_float(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits where finite or infinite, NaN at the same places (payloads are not compared)."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn != wn).sum())} places)"
    iv = {2: torch.int16, 4: torch.int32}[got.element_size()]
    bad = (got.view(iv) != want.view(iv)) & ~wn
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} values differ; first at {idx}: got {got[tuple(idx)].item()!r}, "
                             f"want {want[tuple(idx)].item()!r}")


def assert_channel_major(data: torch.Tensor, packed: bool = False) -> None:
    """``data`` is the (B, S, H, D) view of a zero-padded (B, H, D, S_pad) buffer, S_pad % 16 == 0."""
    d4 = data.unsqueeze(0) if packed else data
    B, S, H, D = d4.shape
    assert d4.stride(1) == 1 or S <= 1, f"seq data must be channel-major, strides {d4.stride()}"
    s_pad = d4.stride(3)
    assert s_pad % 16 == 0 and s_pad >= S and s_pad - S < 16, f"S_pad {s_pad} for S={S}"
    assert d4.stride(2) == D * s_pad and (B == 1 or d4.stride(0) == H * D * s_pad), d4.stride()
    buf = torch.as_strided(d4, (B, H, D, s_pad), (H * D * s_pad, D * s_pad, s_pad, 1))
    assert not _u8(buf[..., S:]).any(), "channel-major padding must be zeros"


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def _bits_f32(v: int) -> float:
    return torch.tensor([v], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def make_input(shape, dtype, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Float test tensors (made on the CPU).  ``kind``:
    random: gaussian with per-element magnitudes over ~2^±8; outliers: a few channels x 2^10;
    adversarial: zero blocks, -0, ties of the e4m3 grid, e4m3-subnormal results, fp32/bf16 subnormals,
    the 2^-127 clamp, values near the dtype's max, and NaN/+-Inf of both signs in a few blocks."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 9, shape, generator=gen).float())
    if kind == "random":
        return x.to(dtype)
    D = shape[-1]
    if kind == "outliers":
        ch = torch.randint(0, D, (max(1, D // 16),), generator=gen)
        x[..., ch] *= 1024.0
        return x.to(dtype)
    assert kind == "adversarial"
    flat = x.view(-1, D)  # rows = (token, head) pairs in order
    n = flat.shape[0]
    r = lambda k, hi: torch.randint(0, hi, (k,), generator=gen)  # noqa: E731
    # ties: grid points of e4m3 and their midpoints, scaled by a common power of two per row
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2
    pool = torch.cat([grid, mids, -grid, -mids])
    rows = r(max(1, n // 4), n)
    flat[rows] = pool[r(rows.numel() * D, pool.numel())].view(-1, D) * torch.exp2(
        torch.randint(-20, 21, (rows.numel(), 1), generator=gen).float())
    # subnormal e4m3 results: a big element and small ones in one block
    rows = r(max(1, n // 8), n)
    flat[rows] = torch.randn(rows.numel(), D, generator=gen) * 2.0**-10
    flat[rows, 0] = 300.0
    # zero blocks and -0
    flat[r(max(1, n // 8), n)] = 0.0
    flat[r(max(1, n // 8), n), : min(32, D)] = -0.0
    limit = {torch.bfloat16: 2.0**127 * 1.5, torch.float16: 60000.0, torch.float32: 2.0**127 * 1.9}[dtype]
    tiny = {torch.bfloat16: 2.0**-130, torch.float16: 2.0**-24, torch.float32: 2.0**-145}[dtype]
    # huge and tiny scales (2^-127 clamp with fp32/bf16 subnormals)
    rows = r(max(1, n // 8), n)
    flat[rows] = torch.randn(rows.numel(), D, generator=gen).clamp(-1.3, 1.3) * limit / 1.3
    rows = r(max(1, n // 8), n)
    flat[rows] = torch.randint(-8, 9, (rows.numel(), D), generator=gen).float() * tiny
    rows = r(max(1, n // 8), n)
    flat[rows] = torch.randn(rows.numel(), D, generator=gen) * 2.0**-118
    x = flat.view(shape).to(dtype)
    # NaN of both signs and +-Inf, written as bits so that the sign survives the dtype
    xf = x.view(-1)
    k = max(1, xf.numel() // 500)
    if dtype == torch.float32:
        specials = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0x7F800000, 0xFF800000 - 2**32],
                                dtype=torch.int32).view(torch.float32)
    elif dtype == torch.bfloat16:
        specials = torch.tensor([0x7FC0, 0xFFC0 - 2**16, 0x7F81, 0x7F80, 0xFF80 - 2**16], dtype=torch.int16
                                ).view(torch.bfloat16)
    else:
        specials = torch.tensor([0x7E00, 0xFE00 - 2**16, 0x7C01, 0x7C00, 0xFC00 - 2**16], dtype=torch.int16
                                ).view(torch.float16)
    pos = r(k, xf.numel())
    xf[pos] = specials[r(k, specials.numel())]
    return x


def ref_rs(x: torch.Tensor, role: str, group: int = 128, seq_dim: int = 1) -> F.RowScaledFP8:
    if role == "q":
        return F.to_row_scaled(F.quantize_mxfp8(x, -1))
    if role == "k":
        return F.to_row_scaled(F.quantize_mxfp8(x, -1), seq_dim, group)
    return F.to_row_scaled(F.quantize_mxfp8(x, seq_dim))


def ref_rs_mode(x, role, mode, group=128, seq_dim=1):
    dim = seq_dim if role == "v" else -1
    mx = F.quantize_mxfp8(x, dim, mode)
    return F.to_row_scaled(mx, seq_dim if role == "k" else None, group if role == "k" else 1)


# ----------------------------------------------------------------------------------------------
# checks shared by the CPU (interpreter) and GPU tests
# ----------------------------------------------------------------------------------------------


def check_quantize(shape, dtype, mode, kind, gen, orientations="both"):
    x = make_input(shape, dtype, kind, gen)
    packed = len(shape) == 3
    sd = 0 if packed else 1
    out = kq.quantize_mxfp8_triton(x.to(DEVICE), orientations, mode, seq_dim=sd)
    outs = out if isinstance(out, tuple) else (out,)
    names = {"both": ("hdim", "seq"), "hdim": ("hdim",), "seq": ("seq",)}[orientations]
    for name, got in zip(names, outs):
        want = F.quantize_mxfp8(x, -1 if name == "hdim" else sd, mode)
        assert_same_mx(got, want, f"{name} {dtype} {mode} {kind} {shape}")
        if name == "hdim":
            assert got.data.is_contiguous() and got.scale.is_contiguous()
        else:
            assert_channel_major(got.data, packed)
    return outs


def check_row_scaled(shape, dtype, mode, kind, role, gen, group=128):
    x = make_input(shape, dtype, kind, gen)
    packed = len(shape) == 3
    sd = 0 if packed else 1
    want = ref_rs_mode(x, role, mode, group, sd)
    got = kq.row_scaled_triton(x.to(DEVICE), role, mode, seq_dim=sd, k_group=group)
    assert_same_rs(got, want, f"{role} from float {dtype} {mode} {kind} {shape}")
    if role == "v":
        assert_channel_major(got.data, packed)
    else:
        assert got.data.is_contiguous()
    # from an MXTensor made by the kernel (channel-major for V) and by formats (contiguous)
    mx_k = kq.quantize_mxfp8_triton(x.to(DEVICE), "seq" if role == "v" else "hdim", mode, seq_dim=sd)
    mx_f = F.quantize_mxfp8(x, sd if role == "v" else -1, mode).to(DEVICE)
    for src, mx in (("kernel MX", mx_k), ("formats MX", mx_f)):
        got = kq.row_scaled_triton(mx, role, seq_dim=sd, k_group=group)
        assert_same_rs(got, want, f"{role} from {src} {dtype} {mode} {kind} {shape}")


# ----------------------------------------------------------------------------------------------
# CPU-sized tests (interpreter on CPU; compiled when CUDA is present)
# ----------------------------------------------------------------------------------------------

SMALL = [(1, 1, 1, 64), (1, 31, 2, 64), (2, 33, 1, 128), (1, 100, 1, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SMALL, ids=str)
def test_quantize_both_adversarial(shape, dtype, mode, gen):
    check_quantize(shape, dtype, mode, "adversarial", gen)


@pytest.mark.parametrize("orientations", ["hdim", "seq"])
@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_quantize_one_orientation(orientations, kind, gen):
    check_quantize((2, 45, 2, 64), torch.bfloat16, "rceil", kind, gen, orientations)


def check_tiled_scales(shape, mode, kind, gen, orientations="both"):
    """``scale_layout="blackwell"``: the data bytes are the plain call's, and the tiled scale bytes (padding
    included) equal ``formats.to_blackwell_scale_layout`` of the reference's per-(batch, head) scale matrices:
    (tokens, D/32) for the head-dim orientation, (channels, S/32) for the sequence one."""
    x = make_input(shape, torch.bfloat16, kind, gen)
    packed = len(shape) == 3
    sd = 0 if packed else 1
    out = kq.quantize_mxfp8_triton(x.to(DEVICE), orientations, mode, seq_dim=sd, scale_layout="blackwell")
    outs = out if isinstance(out, tuple) else (out,)
    names = {"both": ("hdim", "seq"), "hdim": ("hdim",), "seq": ("seq",)}[orientations]
    for name, got in zip(names, outs):
        assert isinstance(got, F.MXTensorTiled), type(got)
        want = F.quantize_mxfp8(x, -1 if name == "hdim" else sd, mode)
        sc = want.scale_bytes.unsqueeze(0) if packed else want.scale_bytes  # packed: B = 1
        # (B, S, H, ND) -> (B, H, S, ND); (B, NSB, H, D) -> (B, H, D, NSB)
        mat = sc.permute(0, 2, 1, 3) if name == "hdim" else sc.permute(0, 2, 3, 1)
        tiled = F.to_blackwell_scale_layout(mat.contiguous())
        assert_same_bytes(got.scale_tiled, tiled[0] if packed else tiled, f"tiled {name} {mode} {kind} {shape}")
        assert_same_mx(got.to_mx(), want, f"tiled {name} to_mx {shape}")


@pytest.mark.parametrize("orientations", ["both", "hdim", "seq"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 45, 2, 64), (1, 300, 1, 128), (1, 40, 2, 256), (70, 2, 96)],
                         ids=str)
def test_quantize_blackwell_scale_layout(shape, orientations, gen):
    check_tiled_scales(shape, "rceil", "adversarial", gen, orientations)


def test_tiled_container_validation():
    data = torch.zeros(1, 64, 2, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_tiled"):
        F.MXTensorTiled(data, torch.zeros(1, 2, 100, dtype=U8), 3)
    with pytest.raises(ValueError, match="dim"):
        F.MXTensorTiled(data, torch.zeros(1, 2, 512, dtype=U8), 2)
    with pytest.raises(ValueError, match="scale_layout"):
        kq.quantize_mxfp8_triton(torch.zeros(1, 4, 1, 64, device=DEVICE), scale_layout="swizzled")


@pytest.mark.parametrize("D", [32, 48, 256])
def test_quantize_head_dims(D, gen):
    check_quantize((1, 40, 1, D), torch.float32, "rceil", "adversarial", gen)


def test_quantize_packed(gen):
    check_quantize((70, 2, 64), torch.bfloat16, "rceil", "adversarial", gen)


def test_quantize_strided_input(gen):
    # q of a fused (B, S, 3, H, D) projection, and a D-transposed view (copied to unit stride)
    qkv = make_input((2, 37, 3, 2, 64), torch.bfloat16, "random", gen)
    x = qkv[:, :, 0]
    h, s = kq.quantize_mxfp8_triton(x.to(DEVICE), "both")
    assert_same_mx(h, F.quantize_mxfp8(x, -1), "hdim of strided q")
    assert_same_mx(s, F.quantize_mxfp8(x, 1), "seq of strided q")
    xt = make_input((1, 33, 1, 64), torch.float32, "random", gen).transpose(1, 3).contiguous().transpose(1, 3)
    assert_same_mx(kq.quantize_mxfp8_triton(xt.to(DEVICE), "hdim"), F.quantize_mxfp8(xt, -1), "hdim of D-strided")


def test_int64_tile_offsets(gen, monkeypatch):
    """The IDX64 variants (tile-local offsets in int64, chosen for huge strides) give the same bytes."""
    monkeypatch.setattr(kq, "_needs_i64", lambda *a: True)
    x = make_input((1, 45, 2, 64), torch.bfloat16, "adversarial", gen)
    h, s = kq.quantize_mxfp8_triton(x.to(DEVICE), "both")
    assert_same_mx(h, F.quantize_mxfp8(x, -1), "hdim IDX64")
    assert_same_mx(s, F.quantize_mxfp8(x, 1), "seq IDX64")
    for role in "qkv":
        assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), role), ref_rs(x, role), f"{role} IDX64")
        assert_same_rs(kq.row_scaled_triton(s if role == "v" else h, role), ref_rs(x, role), f"{role} from MX IDX64")
    assert_same_float(kq.dequantize_mxfp8_triton(s), F.dequantize_mxfp8(s.to("cpu"), torch.bfloat16), "dequant IDX64")


def test_quantize_pinned_bytes():
    """A table of semantic cases, bytes written out (scale byte, first data byte) for RCEIL and FLOOR."""
    cases = [  # (block amax placed at element 0, other elements 0) -> (rceil scale, rceil byte, floor scale, floor byte)
        (448.0, 127, 0x7E, 127, 0x7E),
        (449.0, 128, 0x76, 127, 0x7E),  # RCEIL: 224.5 -> 224; FLOOR saturates
        (1.0, 119, 0x78, 119, 0x78),
        (1.75 * 2.0**-130, 0, 0x26, 0, 0x26),  # fp32 subnormal: 2^-127 clamp, data 1.75*2^-3
        (0.0, 127, 0x00, 127, 0x00),
        (-0.0, 127, 0x80, 127, 0x80),
        (float("inf"), 255, 0x7E, 255, 0x7E),
        (float("nan"), 255, 0x7F, 255, 0x7F),
        (_bits_f32(0x7F7FFFFF), 247, 0x78, 246, 0x7E),  # fp32 max: e = 120 (RCEIL, data 256), 119 (FLOOR)
    ]
    x = torch.zeros(len(cases), 1, 1, 32)
    for i, c in enumerate(cases):
        x[i, 0, 0, 0] = c[0]
    for j, mode in enumerate(MODES):
        got = kq.quantize_mxfp8_triton(x.to(DEVICE), "hdim", mode)
        for i, c in enumerate(cases):
            sc, byte = c[1 + 2 * j], c[2 + 2 * j]
            assert _u8(got.scale)[i, 0, 0, 0].item() == sc, f"{mode} amax {c[0]}: scale"
            assert _u8(got.data)[i, 0, 0, 0].item() == byte, f"{mode} amax {c[0]}: data"
        assert_same_mx(got, F.quantize_mxfp8(x, -1, mode), f"pinned table {mode}")


def check_row_scaled_both(shape, mode, kind, gen, group=128):
    """``row_scaled_triton_both`` equals the two single-role operands (K layout, V layout) bit for bit."""
    x = make_input(shape, torch.bfloat16, kind, gen)
    sd = 0 if len(shape) == 3 else 1
    hdim, seq = kq.row_scaled_triton_both(x.to(DEVICE), mode, seq_dim=sd, k_group=group)
    assert_same_rs(hdim, ref_rs_mode(x, "k", mode, group, sd), f"both: K layout {mode} {kind} {shape}")
    assert_same_rs(seq, ref_rs_mode(x, "v", mode, group, sd), f"both: V layout {mode} {kind} {shape}")
    assert_channel_major(seq.data, sd == 0)
    assert hdim.data.is_contiguous()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,group", [((1, 33, 2, 64), 128), ((2, 130, 1, 96), 32), ((70, 2, 64), 64)], ids=str)
def test_row_scaled_both(shape, group, mode, gen):
    check_row_scaled_both(shape, mode, "adversarial", gen, group)


def test_row_scaled_both_no_tokens():
    x = torch.empty(2, 0, 3, 64, dtype=torch.bfloat16, device=DEVICE)
    hdim, seq = kq.row_scaled_triton_both(x)
    for got, want in ((hdim, kq.row_scaled_triton(x, "k")), (seq, kq.row_scaled_triton(x, "v"))):
        assert got.data.shape == want.data.shape and torch.equal(got.exp, want.exp)


@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 33, 2, 64), (2, 130, 1, 96)], ids=str)
def test_row_scaled_adversarial(shape, mode, role, gen):
    check_row_scaled(shape, torch.bfloat16, mode, "adversarial", role, gen)


@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_row_scaled_dtypes(dtype, role, gen):
    check_row_scaled((1, 31, 1, 64), dtype, "rceil", "adversarial", role, gen)


@pytest.mark.parametrize("role", ["k", "v"])
def test_row_scaled_outliers_packed(role, gen):
    check_row_scaled((100, 2, 64), torch.bfloat16, "rceil", "outliers", role, gen)


@pytest.mark.parametrize("group", [32, 64, 256])
def test_row_scaled_k_groups(group, gen):
    check_row_scaled((1, 100, 1, 64), torch.bfloat16, "rceil", "adversarial", "k", gen, group)


def test_row_scaled_zero_rows_and_tiny(gen):
    """Rows that are all zero (E = 0) and blocks whose elements all quantize to 0 at the 2^-127 clamp."""
    x = torch.zeros(1, 40, 2, 64)
    x[0, 3, 0, 5] = 2.0**-149  # e = -127, q = 2^-22 -> 0: the block holds no nonzero element
    x[0, 3, 0, 40] = 1.0
    x[0, 7, 1, :] = 2.0**-140
    x[0, 9, 1, 33] = 3.0 * 2.0**-138  # nonzero e4m3 subnormal at e = -127
    for role in "qkv":
        got = kq.row_scaled_triton(x.to(DEVICE), role)
        assert_same_rs(got, ref_rs(x, role), f"{role} zero/tiny")


def test_row_scaled_nan_data_in_finite_block():
    """An MXTensor with NaN data bytes under a finite scale (not made by quantize, but a legal MXTensor)."""
    mx = F.quantize_mxfp8(torch.randn(1, 64, 1, 64), -1)
    d = mx.data.view(U8).clone()
    d[0, 3, 0, 7] = 0xFF
    d[0, 5, 0, 40] = 0x7F
    mx = F.MXTensor(d.view(torch.float8_e4m3fn), mx.scale, -1)
    for role in "qk":
        want = F.to_row_scaled(mx, 1 if role == "k" else None, 128 if role == "k" else 1)
        assert_same_rs(kq.row_scaled_triton(mx.to(DEVICE), role), want, f"{role} NaN data")


def random_mx(shape, dim, gen, extremes=True) -> F.MXTensor:
    """An MXTensor of random bytes (every e4m3 code incl. NaN, every scale byte incl. 0, 254, 255)."""
    data = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(U8)
    sshape = list(shape)
    sshape[dim] = -(-sshape[dim] // 32)
    lo, hi = (0, 256) if extremes else (110, 145)
    scale = torch.randint(lo, hi, sshape, generator=gen, dtype=torch.int32).to(U8)
    return F.MXTensor(data.view(torch.float8_e4m3fn), scale, dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape,dim", [((1, 40, 2, 64), 3), ((1, 40, 2, 64), 1), ((2, 3, 40, 32), 2),
                                       ((40, 3, 8, 2), 0), ((70, 3, 96), 0), ((5, 200), 1), ((300,), 0)], ids=str)
def test_dequantize_random_bytes(shape, dim, dtype, gen):
    mx = random_mx(shape, dim, gen)
    got = kq.dequantize_mxfp8_triton(mx.to(DEVICE), dtype)
    assert_same_float(got, F.dequantize_mxfp8(mx, dtype), f"dequantize {shape} dim={dim} {dtype}")


def test_dequantize_channel_major(gen):
    x = make_input((2, 45, 2, 64), torch.bfloat16, "adversarial", gen)
    h, s = kq.quantize_mxfp8_triton(x.to(DEVICE), "both")
    for t, name in ((h, "hdim"), (s, "seq")):
        assert_same_float(kq.dequantize_mxfp8_triton(t), F.dequantize_mxfp8(t.to("cpu"), torch.bfloat16), name)


def channel_major_mx(shape, gen, s_pad=None, device="cpu") -> F.MXTensor:
    """``random_mx`` blocked along S with its data in a channel-major (B, H, D, s_pad) buffer of random bytes (the
    padding too) on ``device``, viewed as (B, S, H, D); ``s_pad`` defaults to S rounded up to 16.  (``MXTensor.to``
    would not keep the layout: a copy of a view with gaps is made contiguous.)"""
    B, S, H, D = shape
    s_pad = s_pad or -(-S // 16) * 16
    buf = torch.randint(0, 256, (B, H, D, s_pad), generator=gen, dtype=torch.int32).to(U8).to(device)
    mx = random_mx(shape, 1, gen)
    return F.MXTensor(buf[..., :S].permute(0, 3, 1, 2).view(torch.float8_e4m3fn), mx.scale.to(device), 1)


# S: partial blocks and words, whole tiles (the EVEN builds at d64 / d128), S % 4 with the padding to read
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 45, 2, 64), (2, 128, 1, 64), (1, 96, 2, 128), (1, 33, 1, 96), (2, 7, 3, 32),
                                   (1, 70, 1, 256)], ids=str)
def test_dequantize_seq_words(shape, dtype, gen):
    """The channel-major word kernel (``_seq_dequant_kernel``): random data bytes (NaN codes included) and scale bytes
    (0, 254, 255 included); the row padding holds random bytes, which must not reach the output."""
    mx = channel_major_mx(shape, gen, device=DEVICE)
    assert kq._mx_seq_words_spec(mx.data.view(U8), mx.scale) is not None
    got = kq.dequantize_mxfp8_triton(mx, dtype)
    assert_same_float(got, F.dequantize_mxfp8(mx.to("cpu"), dtype), f"dequantize seq words {shape} {dtype}")


@pytest.mark.parametrize("layout", ["unpadded", "unpadded_s4", "odd_stride", "packed"])
def test_dequantize_seq_word_layouts(layout, gen):
    """Which channel-major layouts take the word kernel: rows without padding take it when S % 4 == 0 (the last word
    stays inside the row), not otherwise, nor with strides that are not whole words; packed (T, H, D) data takes it."""
    shape = {"unpadded": (1, 45, 2, 64), "unpadded_s4": (1, 44, 2, 64), "odd_stride": (1, 45, 2, 64),
             "packed": (1, 70, 3, 64)}[layout]
    s_pad = {"unpadded": 45, "unpadded_s4": 44, "odd_stride": 47}.get(layout)
    mx = channel_major_mx(shape, gen, s_pad, DEVICE)
    if layout == "packed":
        mx = F.MXTensor(mx.data[0], mx.scale[0], 0)
    q8, sc = mx.data.view(U8), mx.scale
    if layout == "packed":
        q8, sc = q8.unsqueeze(0), sc.unsqueeze(0)
    words = kq._mx_seq_words_spec(q8, sc)
    assert (words is not None) == (layout in ("unpadded_s4", "packed")), layout
    got = kq.dequantize_mxfp8_triton(mx)
    assert_same_float(got, F.dequantize_mxfp8(mx.to("cpu"), torch.bfloat16), f"dequantize seq {layout}")


@pytest.mark.parametrize("shape,s_pad", [((1, 45, 2, 64), None), ((2, 128, 1, 64), None), ((1, 96, 2, 128), None),
                                         ((1, 33, 1, 96), None), ((2, 7, 3, 32), None), ((1, 70, 1, 256), None),
                                         ((1, 44, 2, 64), 44), ((1, 45, 2, 64), 45)], ids=str)
def test_v_from_channel_major_mx(shape, s_pad, gen):
    """V from an MXTensor blocked along S with channel-major data of random bytes (NaN codes, scale bytes 0 / 254 /
    255) and random row padding: the word kernel (``_seq_rescale_kernel``; EVEN at (2, 128, 1, 64)), and the generic
    one for rows of S % 4 bytes without padding; the output's padding is zeros."""
    mx = channel_major_mx(shape, gen, s_pad, DEVICE)
    words = kq._mx_seq_words_spec(mx.data.view(U8), mx.scale) is not None
    assert words == (shape[1] % 4 == 0 or s_pad is None)
    got = kq.row_scaled_triton(mx, "v")
    assert_same_rs(got, F.to_row_scaled(mx.to("cpu")), f"v from channel-major MX {shape} pad {s_pad}")
    assert_channel_major(got.data)


# ----------------------------------------------------------------------------------------------
# input validation (raised before any launch)
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# session 12 paths: the head-dim kernel (MX, Q, K), the row-set kernel's tiles (J groups, EVEN tiles), V's exponent
# pass (running maximum, per-block pass for NaN/Inf chunks), the head-dim kernels from MX (words) and dequantize
# ----------------------------------------------------------------------------------------------

# S a multiple of every default tile along S (seq: 8192 elements; K groups 128): the EVEN builds, no row masks
EVEN_SHAPES = [(1, 128, 2, 128), (2, 128, 1, 64), (1, 256, 1, 32)]
# row-set tiles (BLOCK_S, warps, J) the benchmark's sweep may pick: each must be bit-exact
ROWSET_TILES = [(32, 4, 1), (32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SMALL + EVEN_SHAPES, ids=str)
def test_quantize_hdim_adversarial(shape, dtype, mode, gen):
    """The head-dim kernel alone (rows of a contiguous tensor as one run): zeros, -0, ties, e4m3 subnormals,
    fp32/bf16 subnormals, the 2^-127 clamp, values near the dtype's max, NaN/Inf of both signs."""
    check_quantize(shape, dtype, mode, "adversarial", gen, "hdim")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", EVEN_SHAPES, ids=str)
def test_even_tiles(shape, mode, gen):
    """Tiles whose every row exists (the EVEN builds): MX both orientations, V, and the fused K+V layouts."""
    check_quantize(shape, torch.bfloat16, mode, "adversarial", gen)
    check_row_scaled(shape, torch.bfloat16, mode, "adversarial", "v", gen)
    check_row_scaled_both(shape, mode, "adversarial", gen)


@pytest.mark.parametrize("tile", ROWSET_TILES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64, 2, 64), (2, 45, 1, 128)], ids=str)
def test_row_set_tiles(shape, tile, gen, monkeypatch):
    """Every row-set tile of the sweep (one or two groups of four row sets, 4 or 8 warps), even and partial tiles."""
    kq._PLANS.clear()
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seq", kq.Tile(*tile))
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seq_k", kq.Tile(64, tile[1], tile[2]))
    check_quantize(shape, torch.bfloat16, "rceil", "adversarial", gen)
    check_row_scaled(shape, torch.float32, "floor", "adversarial", "v", gen)
    check_row_scaled_both(shape, "rceil", "adversarial", gen, group=64)


@pytest.mark.parametrize("stages", [1, 3])
def test_v_exponent_chunks(stages, gen, monkeypatch):
    """V's exponent pass with many S tiles per program: chunks without NaN/Inf (the running maximum) and chunks with
    them (read again block by block, non-finite blocks left out), the channel maximum in another block of the chunk
    than the NaN/Inf."""
    monkeypatch.setattr(kq, "VEXP_MIN_PROGRAMS", 1)
    monkeypatch.setattr(kq, "VEXP_STAGES", stages)
    kq._PLANS.clear()
    x = make_input((2, 300, 2, 64), torch.bfloat16, "random", gen)
    x[0, 10, 0, 3] = float("nan")  # channel 3: its largest element lies in another block of the chunk
    x[0, 200, 0, 3] = 1.0e4
    x[0, 50, 1, 7] = -float("inf")  # channel 7: only the block with the Inf holds nonzero elements
    x[0, :, 1, 7] = torch.where(torch.arange(300) // 32 == 50 // 32, x[0, :, 1, 7], torch.zeros(()))
    x[1, :, 0, 9] = 0.0
    x[1, 299, 0, 9] = float("nan")  # channel 9: a NaN in the last, partial block, zeros elsewhere
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dt)
        assert_same_rs(kq.row_scaled_triton(xd.to(DEVICE), "v"), ref_rs(xd, "v"), f"V chunks {dt} stages={stages}")
        hdim, seq = kq.row_scaled_triton_both(xd.to(DEVICE))
        assert_same_rs(seq, ref_rs(xd, "v"), f"both: V layout, chunks {dt}")


@pytest.mark.parametrize("min_tiles", [2, 3])
def test_v_exponent_min_tiles(min_tiles, gen, monkeypatch):
    """V's exponent pass with a floor on S tiles per program (``VEXP_MIN_TILES``): the grid's count of programs no
    longer decides it; a last chunk shorter than the others (5 tiles of 64 tokens in chunks of 3), NaN/Inf chunks."""
    monkeypatch.setattr(kq, "VEXP_MIN_PROGRAMS", 1 << 20)
    monkeypatch.setattr(kq, "VEXP_MIN_TILES", min_tiles)
    monkeypatch.setitem(kq.TILE_OVERRIDES, "vexp", kq.Tile(64, 4))  # 64-token tiles whatever VEXP_ELEMS says
    kq._PLANS.clear()
    x = make_input((2, 300, 2, 64), torch.bfloat16, "random", gen)
    x[1, 290, 1, 5] = float("nan")
    x[0, 70, 0, 6] = 3.0e3
    spec = kq._v_exponents_spec(x, None, from_mx=False, rceil=True)
    assert spec[3][1] == min_tiles, "tiles per program"
    assert spec[0][0] == 2 * 2 * -(-5 // min_tiles), "programs"
    assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), "v"), ref_rs(x, "v"), f"V min_tiles={min_tiles}")
    assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), "v", "floor"), ref_rs_mode(x, "v", "floor"), "V floor")


@pytest.mark.parametrize("stages,min_tiles", [(1, 1), (3, 2), (2, 3)])
def test_v_exponent_from_mx_chunks(stages, min_tiles, gen, monkeypatch):
    """V's exponent pass from MX with several S tiles per program, pipelined or not (``SEQEXP_STAGES``,
    ``SEQEXP_MIN_TILES``): random bytes (NaN codes, scale bytes 0 / 254 / 255), a last chunk shorter than the others,
    channel-major and contiguous data."""
    monkeypatch.setattr(kq, "MX_VEXP_PASS", "data")
    monkeypatch.setattr(kq, "SEQEXP_STAGES", stages)
    monkeypatch.setattr(kq, "SEQEXP_MIN_TILES", min_tiles)
    monkeypatch.setattr(kq, "SEQEXP_MIN_PROGRAMS", 1 << 20)
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seqexp", kq.Tile(32, 4))
    mx = channel_major_mx((2, 230, 2, 64), gen, None, DEVICE)
    assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx.to("cpu")), "v from channel-major MX")
    mxc = random_mx((1, 170, 2, 64), 1, gen)
    assert_same_rs(kq.row_scaled_triton(mxc.to(DEVICE), "v"), F.to_row_scaled(mxc), "v from contiguous MX")


def _zero_top_blocks(mx: F.MXTensor, channels, device="cpu") -> F.MXTensor:
    """``mx`` (blocked along S, (B, S, H, D)) with every block that carries the largest finite scale byte of each
    (b, h, d) in ``channels`` zeroed (some +0, some -0), so that the scales-first V pass must read those channels in
    full; on ``device``, its data in a fresh channel-major buffer (random padding) when the input's is channel-major."""
    data = mx.data.view(U8).clone()
    sc = mx.scale_bytes
    B, S, H, D = data.shape
    for b, h, d in channels:
        col = sc[b, :, h, d].to(torch.int32)
        top = torch.where(col != 255, col, -1).max()
        for k in torch.nonzero(col == top).flatten().tolist():
            data[b, 32 * k:32 * k + 32, h, d] = 0x80 if k % 2 else 0
    if mx.data.stride(1) == 1:
        buf = torch.randint(0, 256, (B, H, D, -(-S // 16) * 16), dtype=torch.int32).to(U8).to(device)
        buf[..., :S] = data.permute(0, 2, 3, 1).to(device)
        data = buf[..., :S].permute(0, 3, 1, 2)
    return F.MXTensor(data.to(device).view(torch.float8_e4m3fn), mx.scale.to(device), mx.dim)


@pytest.mark.parametrize("layout", ["channel_major", "contiguous"])
def test_v_exponent_scales_first(layout, gen, monkeypatch):
    """V's exponent pass from MX, scales first (``MX_VEXP_PASS = "scales"``): random bytes (NaN codes, scale bytes
    0 / 254 / 255); channels whose largest-scale blocks are all zero (the full re-read: the answer is then a lower
    scale, or none), a channel of NaN scales only, several channel groups and scale steps (small ``CG`` / ``SB``)."""
    monkeypatch.setattr(kq, "MX_VEXP_PASS", "scales")
    monkeypatch.setattr(kq, "MX_VEXP_CHANNELS", 16)
    monkeypatch.setattr(kq, "MX_VEXP_SCALE_BLOCKS", 2)
    shape = (2, 230, 2, 40)
    mx = channel_major_mx(shape, gen) if layout == "channel_major" else random_mx(shape, 1, gen)
    mx.scale_bytes[1, :, 0, 7] = 255  # no candidate at all: the channel's exponent is 0
    mx = _zero_top_blocks(mx, [(0, 0, 3), (0, 1, 17), (1, 1, 39), (1, 0, 0)])
    mx.data.view(U8)[1, :, 1, 20] = 0  # a channel of zeros: every block re-read, no exponent
    want = F.to_row_scaled(mx)
    got = kq.row_scaled_triton(mx.to(DEVICE), "v")
    assert_same_rs(got, want, f"v from {layout} MX, scales first")
    # the re-read found lower scales where the top blocks were zeroed (the test would pass vacuously otherwise)
    sb = mx.scale_bytes.to(torch.int32)
    top = torch.where(sb != 255, sb, -1).amax(1)
    assert int(want.exp[0, 0, 0, 3]) < int(top[0, 0, 3]) - 127
    monkeypatch.setattr(kq, "MX_VEXP_PASS", "data")
    assert_same_rs(kq.row_scaled_triton(mx.to(DEVICE), "v"), want, f"v from {layout} MX, data first")


@pytest.mark.parametrize("tile", [(64, 4), (128, 8)], ids=str)
def test_v_rescale_tiles(tile, gen, monkeypatch):
    """V's pass 2 from channel-major MX (``_seq_rescale_kernel``) at other tiles (``mx_seq_v``): S not a multiple of
    the tile, random row padding (cleared in the output), d64 and d96."""
    monkeypatch.setattr(kq, "MX_SEQ_V_ROWS", None)  # the tokens x all-channels kernel
    monkeypatch.setitem(kq.TILE_OVERRIDES, "mx_seq_v", kq.Tile(*tile))
    for shape in ((2, 230, 2, 64), (1, 300, 1, 96)):
        mx = channel_major_mx(shape, gen)
        assert kq._mx_seq_words_spec(mx.data.view(U8), mx.scale, kind="mx_seq_v")[1] == tile[0]
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx), f"v rescale tile {tile} {shape}")


@pytest.mark.parametrize("rows", [(64, 32, 4), (128, 16, 4), (32, 64, 8)], ids=str)
def test_v_rescale_rows(rows, gen, monkeypatch):
    """V's pass 2 from channel-major MX on rows of channels (``MX_SEQ_V_ROWS``: ``_seq_rescale_rows_kernel``): S and
    D not multiples of the tile (random row padding, cleared in the output), and a shape with no masks (EVEN)."""
    monkeypatch.setattr(kq, "MX_SEQ_V_ROWS", rows)
    for shape in ((2, 230, 2, 40), (1, 300, 1, 96), (1, 256, 2, 64)):
        mx = channel_major_mx(shape, gen)
        mx.data.view(U8)[0, 5, 0, 1] = 0x7F  # a NaN byte in a finite block stays as it is
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx), f"v rescale rows {rows} {shape}")


def test_v_exponent_pass_knob():
    mx = random_mx((1, 40, 1, 32), 1, torch.Generator().manual_seed(0))
    kq_pass = kq.MX_VEXP_PASS
    try:
        kq.MX_VEXP_PASS = "bytes"
        with pytest.raises(ValueError, match="MX_VEXP_PASS"):
            kq.row_scaled_triton(mx.to(DEVICE), "v")
    finally:
        kq.MX_VEXP_PASS = kq_pass


@pytest.mark.parametrize("k_warps", [None, 8])
@pytest.mark.parametrize("k_launch", ["first", "second"])
def test_forward_operands_k_launch(k_launch, k_warps, gen, monkeypatch):
    """The no-grad forward's fused launches with K's job in either launch and at 4 or 8 warps (``FWD_K_LAUNCH``,
    ``FWD_K_WARPS``) against the reference, two calls of one signature (the second takes the plan)."""
    monkeypatch.setattr(kq, "FWD_K_LAUNCH", k_launch)
    monkeypatch.setattr(kq, "FWD_K_WARPS", k_warps)
    kq._PLANS.clear()
    for i in range(2):
        kind = "adversarial" if i == 0 else "random"
        q, k, v = (make_input(s, torch.bfloat16, kind, gen) for s in ((1, 70, 2, 64), (1, 150, 2, 64),
                                                                         (1, 150, 2, 64)))
        qr, kr, vr, kv = kq.forward_operands_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
        assert_same_rs(qr, ref_rs(q, "q"), f"call {i}: Q")
        assert_same_rs(kr, ref_rs(k, "k"), f"call {i}: K")
        assert_same_rs(vr, ref_rs(v, "v"), f"call {i}: V")
    with pytest.raises(ValueError, match="FWD_K_LAUNCH"):
        monkeypatch.setattr(kq, "FWD_K_LAUNCH", "third")
        kq._PLANS.clear()
        kq.forward_operands_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))


def test_nonzero_threshold():
    """A block is nonzero iff its maximum exceeds 2^-137 (fp32 bits 0x1000; 2^-10 ties to 0 at the -127 clamp)."""
    x = torch.zeros(1, 64, 1, 64)
    x[0, 0, 0, 0] = _bits_f32(0x1000)  # rounds to 0: a zero block, no exponent
    x[0, 33, 0, 1] = _bits_f32(0x1001)  # rounds to 2^-9
    x[0, 2, 0, 40] = _bits_f32(0x1000)
    x[0, 40, 0, 41] = _bits_f32(0x0FFF)
    for role in "qkv":
        assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), role), ref_rs(x, role), f"{role} threshold")
    check_quantize_x(x, "threshold")


def check_quantize_x(x, what):
    h, s = kq.quantize_mxfp8_triton(x.to(DEVICE), "both")
    assert_same_mx(h, F.quantize_mxfp8(x, -1), f"{what} hdim")
    assert_same_mx(s, F.quantize_mxfp8(x, 1), f"{what} seq")


@pytest.mark.parametrize("groups", [2, 4])
def test_k_from_mx_groups(groups, gen, monkeypatch):
    """K from MX with several exponent groups per program (``MX_K_GROUPS``): the last program holds fewer groups and a
    partial one; NaN codes and scale bytes 0 / 254 / 255."""
    monkeypatch.setattr(kq, "MX_K_GROUPS", groups)
    mx = random_mx((2, 150, 3, 64), 3, gen)
    want = F.to_row_scaled(mx, 1, 32)
    assert_same_rs(kq.row_scaled_triton(mx.to(DEVICE), "k", k_group=32), want, f"K from MX, {groups} groups")
    mxs = F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale.transpose(1, 2).contiguous()
                     .transpose(1, 2), 3)
    assert_same_rs(kq.row_scaled_triton(mxs.to(DEVICE), "k", k_group=32), want, "strided")


@pytest.mark.parametrize("role", ["q", "k"])
@pytest.mark.parametrize("layout", ["rows", "strided", "odd_d", "d40", "d128"])
def test_from_mx_random_bytes(layout, role, gen):
    """Q/K from MXTensors of random bytes (every e4m3 code, NaN data in finite blocks, scale bytes 0, 254, 255): the
    head-dim kernel on words (contiguous, and per head for a strided tensor; d40: a block of 2 words, whose scale byte
    is loaded at each of them), and the generic kernel (D % 4 != 0)."""
    D = {"odd_d": 70, "d40": 40, "d128": 128}.get(layout, 64)
    mx = random_mx((2, 70, 3, D), 3, gen)
    if layout == "strided":  # (B, S, H, D) seen through a (B, H, S, D) buffer: rows not evenly spaced
        mx = F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale.transpose(1, 2).contiguous()
                        .transpose(1, 2), 3)
    want = F.to_row_scaled(mx, 1 if role == "k" else None, 64 if role == "k" else 1)
    got = kq.row_scaled_triton(mx.to(DEVICE), role, k_group=64)
    assert_same_rs(got, want, f"{role} from random MX {layout}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "strided", "padded"])
def test_dequantize_hdim_layouts(layout, dtype, gen):
    """The head-dim dequantize kernel on a run of rows, per head (strided rows) and on rows with padding."""
    mx = random_mx((2, 45, 3, 96), 3, gen)
    if layout == "strided":
        mx = F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale, 3)
    elif layout == "padded":
        wide = torch.zeros(2, 45, 3, 128, dtype=U8)
        wide[..., :96] = mx.data.view(U8)
        mx = F.MXTensor(wide[..., :96].view(torch.float8_e4m3fn), mx.scale, 3)
    assert_same_float(kq.dequantize_mxfp8_triton(mx.to(DEVICE), dtype), F.dequantize_mxfp8(mx, dtype),
                      f"dequantize hdim {layout} {dtype}")


def test_hdim_padded_rows(gen):
    """Rows evenly spaced but padded (a (B, S, H, 64) slice of a 96-wide buffer): the head-dim kernel takes them as one
    run of rows with a row stride of 96; MX and Q, and the plan's second call on fresh data."""
    kq._PLANS.clear()
    for i in range(2):
        wide = make_input((2, 37, 3, 96), torch.bfloat16, "adversarial", gen)
        x = wide[..., :64]
        assert kq._rows_view(x) is not None and kq._rows_view(x).stride(1) == 96
        assert_same_mx(kq.quantize_mxfp8_triton(x.to(DEVICE), "hdim"), F.quantize_mxfp8(x, -1), f"padded hdim {i}")
        assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), "q"), ref_rs(x, "q"), f"padded q {i}")


@pytest.mark.parametrize("role", ["q", "k"])
def test_row_scaled_strided_rows(role, gen):
    """Q/K of a fused (B, S, 3, H, D) projection: rows not evenly spaced, so the head-dim kernel works per head."""
    qkv = make_input((2, 70, 3, 2, 64), torch.bfloat16, "adversarial", gen)
    x = qkv[:, :, 1]
    assert_same_rs(kq.row_scaled_triton(x.to(DEVICE), role, k_group=64), ref_rs_mode(x, role, "rceil", 64),
                   f"{role} strided rows")


def test_validation():
    x = torch.randn(1, 8, 1, 64, device=DEVICE)
    with pytest.raises(TypeError, match="x must be"):
        kq.quantize_mxfp8_triton(x.to(torch.int32))
    with pytest.raises(TypeError, match="x must be"):
        kq.quantize_mxfp8_triton(x.double())
    with pytest.raises(TypeError, match="x must be"):
        kq.quantize_mxfp8_triton(x.numpy() if DEVICE == "cpu" else [1.0])
    with pytest.raises(ValueError, match="x must be"):
        kq.quantize_mxfp8_triton(x[0, 0])
    with pytest.raises(ValueError, match="x must be"):
        kq.quantize_mxfp8_triton(x[None])
    with pytest.raises(ValueError, match="head dim"):
        kq.quantize_mxfp8_triton(torch.randn(1, 4, 1, 512, device=DEVICE))
    with pytest.raises(ValueError, match="orientations"):
        kq.quantize_mxfp8_triton(x, "rows")
    with pytest.raises(ValueError, match="scale_mode"):
        kq.quantize_mxfp8_triton(x, "hdim", "up")
    with pytest.raises(ValueError, match="seq_dim"):
        kq.quantize_mxfp8_triton(x, "seq", seq_dim=2)
    with pytest.raises(ValueError, match="seq_dim"):
        kq.quantize_mxfp8_triton(x[0], "seq", seq_dim=1)
    with pytest.raises(ValueError, match="role"):
        kq.row_scaled_triton(x, "o")
    with pytest.raises(ValueError, match="k_group"):
        kq.row_scaled_triton(x, "k", k_group=100)
    mx = kq.quantize_mxfp8_triton(x, "hdim")
    with pytest.raises(ValueError, match="blocked along seq"):
        kq.row_scaled_triton(mx, "v")
    with pytest.raises(TypeError, match="MXTensor"):
        kq.dequantize_mxfp8_triton(x)
    with pytest.raises(TypeError, match="dtype"):
        kq.dequantize_mxfp8_triton(mx, torch.int8)
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    with pytest.raises(ValueError, match="CUDA"):
        kq.quantize_mxfp8_triton(x.cpu())


def test_empty():
    x = torch.zeros(2, 0, 3, 64, device=DEVICE)
    h, s = kq.quantize_mxfp8_triton(x, "both")
    assert h.data.shape == (2, 0, 3, 64) and s.scale.shape == (2, 0, 3, 64)
    v = kq.row_scaled_triton(x, "v")
    assert v.exp.shape == (2, 1, 3, 64) and not v.exp.any()


# ----------------------------------------------------------------------------------------------
# GPU: larger shapes, both rounding paths, >2^31 elements
# ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(2, 1000, 4, 128), (1, 4097, 8, 64), (3, 513, 2, 256), (1, 2048, 16, 96), (5000, 4, 128)]


@pytest.fixture(params=[False, True], ids=["hw_cvt", "soft_round"])
def gpu_rounding(request, monkeypatch):
    monkeypatch.setattr(kq, "SOFT_ROUND_ON_GPU", request.param)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_quantize(shape, dtype, mode, gpu_rounding, gen):
    check_quantize(shape, dtype, mode, "adversarial", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_quantize_blackwell_scale_layout(shape, mode, gen):
    check_tiled_scales(shape, mode, "adversarial", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["adversarial", "outliers"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_row_scaled(shape, kind, mode, role, gpu_rounding, gen):
    check_row_scaled(shape, torch.bfloat16, mode, kind, role, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["adversarial", "outliers"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_row_scaled_both(shape, kind, mode, gpu_rounding, gen):
    check_row_scaled_both(shape, mode, kind, gen)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim", [((2, 1000, 4, 128), 3), ((2, 1000, 4, 128), 1), ((3, 4000, 96), 0),
                                       ((777, 4096), 1)], ids=str)
def test_gpu_dequantize(shape, dim, dtype, gen):
    mx = random_mx(shape, dim, gen)
    assert_same_float(kq.dequantize_mxfp8_triton(mx.to(DEVICE), dtype), F.dequantize_mxfp8(mx, dtype), "dequantize")


GPU_EVEN_SHAPES = [(2, 1024, 4, 128), (1, 2048, 8, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:4] + GPU_EVEN_SHAPES + [(1, 1002, 2, 64)], ids=str)
def test_gpu_v_from_channel_major_mx(shape, gpu_rounding, gen):
    """V from channel-major MX data on the GPU (``_seq_rescale_kernel``, both roundings): random bytes with random
    row padding, whose output padding must be zeros."""
    mx = channel_major_mx(shape, gen, device=DEVICE)
    got = kq.row_scaled_triton(mx, "v")
    assert_same_rs(got, F.to_row_scaled(mx.to("cpu")), f"v from channel-major MX {shape}")
    assert_channel_major(got.data)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES[:4] + GPU_EVEN_SHAPES + [(1, 1002, 2, 64)], ids=str)
def test_gpu_dequantize_seq_words(shape, dtype, gen):
    """The channel-major word kernel on the GPU (its inline PTX for bf16 / fp16): random bytes, and the seq
    orientation of ``quantize_mxfp8_triton`` (whose padding is zeros)."""
    mx = channel_major_mx(shape, gen, device=DEVICE)
    assert kq._mx_seq_words_spec(mx.data.view(U8), mx.scale) is not None
    assert_same_float(kq.dequantize_mxfp8_triton(mx, dtype), F.dequantize_mxfp8(mx.to("cpu"), dtype),
                      f"dequantize seq words {shape} {dtype}")
    s = kq.quantize_mxfp8_triton(make_input(shape, torch.bfloat16, "adversarial", gen).to(DEVICE), "seq")
    assert_same_float(kq.dequantize_mxfp8_triton(s, dtype), F.dequantize_mxfp8(s.to("cpu"), dtype),
                      f"dequantize quantized seq {shape} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", GPU_SHAPES + GPU_EVEN_SHAPES, ids=str)
def test_gpu_quantize_hdim(shape, dtype, mode, gpu_rounding, gen):
    """The head-dim kernel alone (``test_gpu_quantize`` runs both orientations, the row-set kernel)."""
    check_quantize(shape, dtype, mode, "adversarial", gen, "hdim")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", GPU_EVEN_SHAPES, ids=str)
def test_gpu_even_tiles(shape, mode, gpu_rounding, gen):
    for dtype in DTYPES:
        check_quantize(shape, dtype, mode, "adversarial", gen)
    for role in "qkv":
        check_row_scaled(shape, torch.bfloat16, mode, "adversarial", role, gen)
    check_row_scaled_both(shape, mode, "adversarial", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ROWSET_TILES, ids=str)
@pytest.mark.parametrize("shape", [(2, 1000, 4, 128), (2, 1024, 4, 128), (1, 2048, 4, 64)], ids=str)
def test_gpu_row_set_tiles(shape, tile, gen, monkeypatch):
    kq._PLANS.clear()
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seq", kq.Tile(*tile))
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seq_k", kq.Tile(128, max(tile[1], 8), tile[2]))
    check_quantize(shape, torch.bfloat16, "rceil", "adversarial", gen)
    check_row_scaled(shape, torch.bfloat16, "floor", "outliers", "v", gen)
    check_row_scaled_both(shape, "rceil", "adversarial", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("min_programs", [1024, 4096])
def test_gpu_v_exponent_pass(stages, min_programs, gen, monkeypatch):
    monkeypatch.setattr(kq, "VEXP_STAGES", stages)
    monkeypatch.setattr(kq, "VEXP_MIN_PROGRAMS", min_programs)
    kq._PLANS.clear()
    for kind in ("adversarial", "random"):
        check_row_scaled((2, 3000, 4, 128), torch.bfloat16, "rceil", kind, "v", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(32, 4), (64, 4), (64, 8)], ids=lambda t: f"t{t[0]}x{t[1]}")
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("min_tiles", [1, 3, 4, 16])
def test_gpu_v_exponent_min_tiles(min_tiles, stages, tile, gen, monkeypatch):
    """Session 14's sweep of V's exponent pass: tiles per program, stages, tiles; partial last chunks."""
    monkeypatch.setattr(kq, "VEXP_STAGES", stages)
    monkeypatch.setattr(kq, "VEXP_MIN_TILES", min_tiles)
    monkeypatch.setitem(kq.TILE_OVERRIDES, "vexp", kq.Tile(*tile))
    kq._PLANS.clear()
    for kind in ("adversarial", "random"):
        check_row_scaled((2, 3000, 4, 128), torch.bfloat16, "rceil", kind, "v", gen)
    check_row_scaled((1, 777, 3, 64), torch.float16, "floor", "adversarial", "v", gen)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(32, 4), (64, 4), (128, 4)], ids=lambda t: f"t{t[0]}x{t[1]}")
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("min_tiles", [1, 3, 4])
def test_gpu_v_exponent_from_mx(min_tiles, stages, tile, gen, monkeypatch):
    """Session 14's sweep of V's exponent pass from MX (``SWEEP_SEQEXP``): random channel-major bytes, partial last
    chunks, and the seq orientation the kernels make."""
    monkeypatch.setattr(kq, "MX_VEXP_PASS", "data")
    monkeypatch.setattr(kq, "SEQEXP_STAGES", stages)
    monkeypatch.setattr(kq, "SEQEXP_MIN_TILES", min_tiles)
    monkeypatch.setitem(kq.TILE_OVERRIDES, "seqexp", kq.Tile(*tile))
    for shape in ((2, 3000, 4, 128), (1, 1002, 2, 64)):
        mx = channel_major_mx(shape, gen, device=DEVICE)
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx.to("cpu")), f"v from MX {shape}")
    mxc = random_mx((2, 777, 3, 128), 1, gen)
    assert_same_rs(kq.row_scaled_triton(mxc.to(DEVICE), "v"), F.to_row_scaled(mxc), "v from contiguous MX")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 4), (64, 8), (128, 8), (128, 16), (256, 16)], ids=str)
def test_gpu_v_rescale_tiles(tile, gen, monkeypatch):
    """V's pass 2 from channel-major MX at session 16's sweep tiles (``mx_seq_v``)."""
    monkeypatch.setattr(kq, "MX_SEQ_V_ROWS", None)  # the tokens x all-channels kernel
    monkeypatch.setitem(kq.TILE_OVERRIDES, "mx_seq_v", kq.Tile(*tile))
    for shape in ((2, 3000, 4, 128), (1, 1002, 2, 64), (1, 77, 3, 96)):
        mx = channel_major_mx(shape, gen, device=DEVICE)
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx.to("cpu")), f"v rescale {tile} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [(512, 32, 4), (256, 32, 4), (1024, 16, 4), (512, 64, 8), (256, 64, 4), (1024, 32, 8)],
                         ids=str)
def test_gpu_v_rescale_rows(rows, gen, monkeypatch):
    """V's pass 2 from channel-major MX on rows of channels (``MX_SEQ_V_ROWS``) at session 16's sweep tiles."""
    monkeypatch.setattr(kq, "MX_SEQ_V_ROWS", rows)
    for shape in ((2, 3000, 4, 128), (1, 1002, 2, 64), (1, 77, 3, 96), (1, 2048, 2, 128)):
        mx = channel_major_mx(shape, gen, device=DEVICE)
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx.to("cpu")), f"v rescale rows {rows} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("channels,blocks", [(32, 128), (16, 2), (64, 64)], ids=lambda v: str(v))
def test_gpu_v_exponent_scales_first(channels, blocks, gen, monkeypatch):
    """V's exponent pass from MX, scales first, on the GPU: random channel-major and contiguous bytes (NaN codes,
    scale bytes 0 / 254 / 255), partial last blocks, channels whose largest-scale blocks are all zero (the re-read),
    the seq orientation the kernels make (nonzero maxima, the path every real input takes)."""
    monkeypatch.setattr(kq, "MX_VEXP_PASS", "scales")
    monkeypatch.setattr(kq, "MX_VEXP_CHANNELS", channels)
    monkeypatch.setattr(kq, "MX_VEXP_SCALE_BLOCKS", blocks)
    for shape in ((2, 3000, 4, 128), (1, 1002, 2, 64), (1, 77, 3, 96)):
        mx = _zero_top_blocks(channel_major_mx(shape, gen), [(0, 0, 3), (0, 1, shape[3] - 1)], DEVICE)
        assert mx.data.stride(1) == 1, "channel-major on the device"
        assert_same_rs(kq.row_scaled_triton(mx, "v"), F.to_row_scaled(mx.to("cpu")), f"v from MX {shape}")
    mxc = random_mx((2, 777, 3, 128), 1, gen)
    assert_same_rs(kq.row_scaled_triton(mxc.to(DEVICE), "v"), F.to_row_scaled(mxc), "v from contiguous MX")
    x = make_input((2, 4100, 4, 128), torch.bfloat16, "adversarial", gen)
    seq = kq.quantize_mxfp8_triton(x.to(DEVICE), "seq")
    assert_same_rs(kq.row_scaled_triton(seq, "v"), F.to_row_scaled(seq.to("cpu")), "v from the seq orientation")


@pytest.mark.gpu
@pytest.mark.parametrize("k_warps", [None, 8])
@pytest.mark.parametrize("k_launch", ["first", "second"])
@pytest.mark.parametrize("dims", [(2, 1000, 1000, 4, 4, 128), (1, 517, 2048, 4, 2, 64), (2, 256, 300, 2, 2, 128)],
                         ids=str)
def test_gpu_forward_operands_k_launch(dims, k_launch, k_warps, gen, monkeypatch):
    monkeypatch.setattr(kq, "FWD_K_LAUNCH", k_launch)
    monkeypatch.setattr(kq, "FWD_K_WARPS", k_warps)
    kq._PLANS.clear()
    B, Sq, Sk, Hq, Hkv, D = dims
    for i in range(2):
        kind = "adversarial" if i == 0 else "random"
        q, k, v = (make_input(s, torch.bfloat16, kind, gen) for s in ((B, Sq, Hq, D), (B, Sk, Hkv, D),
                                                                         (B, Sk, Hkv, D)))
        qr, kr, vr, _ = kq.forward_operands_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
        assert_same_rs(qr, ref_rs(q, "q"), f"call {i}: Q")
        assert_same_rs(kr, ref_rs(k, "k"), f"call {i}: K")
        assert_same_rs(vr, ref_rs(v, "v"), f"call {i}: V")
        _, _, vr2, kv = kq.forward_operands_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), keep_kv=True)
        assert_same_rs(vr2, ref_rs(v, "v"), f"call {i}: V (keep_kv)")


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["q", "k"])
@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_gpu_from_mx_random_bytes(layout, role, gpu_rounding, gen):
    mx = random_mx((2, 1000, 4, 128), 3, gen)
    if layout == "strided":
        mx = F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale.transpose(1, 2).contiguous()
                        .transpose(1, 2), 3)
    want = F.to_row_scaled(mx, 1 if role == "k" else None, 128 if role == "k" else 1)
    assert_same_rs(kq.row_scaled_triton(mx.to(DEVICE), role), want, f"{role} from random MX {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("groups,warps", [(2, 4), (2, 8), (4, 8)])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_k_from_mx_groups(D, groups, warps, gen, monkeypatch):
    """K from MX with several exponent groups per program (``MX_K_GROUPS``): random bytes, S not a multiple of the
    tile (a last program with fewer groups, a partial group), strided rows, k_group 64 and 128."""
    monkeypatch.setattr(kq, "MX_K_GROUPS", groups)
    for S, group in ((1000, 128), (777, 64)):
        mx = random_mx((2, S, 4, D), 3, gen)
        for m in (mx, F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2),
                                 mx.scale.transpose(1, 2).contiguous().transpose(1, 2), 3)):
            monkeypatch.setitem(kq.TILE_OVERRIDES, "mx_hdim_k", kq.Tile(group * groups, warps))
            want = F.to_row_scaled(m, 1, group)
            assert_same_rs(kq.row_scaled_triton(m.to(DEVICE), "k", k_group=group), want, f"K from MX {S} {group}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_gpu_dequantize_hdim_layouts(layout, dtype, gen):
    mx = random_mx((2, 1000, 4, 96), 3, gen)
    if layout == "strided":
        mx = F.MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale, 3)
    assert_same_float(kq.dequantize_mxfp8_triton(mx.to(DEVICE), dtype), F.dequantize_mxfp8(mx, dtype),
                      f"dequantize hdim {layout} {dtype}")


@pytest.mark.gpu
def test_gpu_beyond_int32_offsets(gen):
    """A (B, S, H, D) tensor of more than 2^31 elements: the last batch entry must still be right
    (blocks are local, so the reference runs on that slice)."""
    B, S, H, D = 131, 8192, 16, 128  # 2.2e9 elements, 4.4 GB of bf16
    assert B * S * H * D > 2**31
    x = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
    tail = make_input((1, S, H, D), torch.bfloat16, "adversarial", gen)
    x[-1:].copy_(tail)
    h, s = kq.quantize_mxfp8_triton(x, "both")
    assert_same_mx(F.MXTensor(h.data[-1:], h.scale[-1:], 3), F.quantize_mxfp8(tail, -1), "hdim tail")
    assert_same_mx(F.MXTensor(s.data[-1:], s.scale[-1:], 1), F.quantize_mxfp8(tail, 1), "seq tail")
    del h
    v = kq.row_scaled_triton(x, "v")
    want = ref_rs(tail, "v")
    assert_same_int(v.exp[-1:], want.exp, "v exp tail")
    assert_same_bytes(v.data[-1:], want.data, "v data tail")
    del v
    deq = kq.dequantize_mxfp8_triton(s)
    assert_same_float(deq[-1:], F.dequantize_mxfp8(F.quantize_mxfp8(tail, 1), torch.bfloat16), "dequant tail")


# ----------------------------------------------------------------------------------------------
# host fast path: per-signature plans (row_scaled_triton / row_scaled_triton_both on float input)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["q", "k", "v", "both"])
@pytest.mark.parametrize("layout", ["bshd", "packed", "strided"])
def test_row_scaled_plan_repeats_with_fresh_data(role, layout, gen):
    """The second and third calls of one signature take the recorded plan: each equals the reference on its own
    (new) data, so nothing of the first call's tensors or values leaks into the next."""
    kq._PLANS.clear()
    shape = (70, 2, 64) if layout == "packed" else (2, 45, 3, 64)
    sd = 0 if layout == "packed" else 1
    for i in range(3):
        x = make_input(shape, torch.bfloat16, "adversarial" if i % 2 else "random", gen)
        xd = x.to(DEVICE)
        if layout == "strided":  # D not unit-stride: the plan repeats _check_float_input's copy
            xd = xd.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert xd.stride(-1) != 1
        if role == "both":
            hdim, seq = kq.row_scaled_triton_both(xd, "rceil", seq_dim=sd, k_group=64)
            assert_same_rs(hdim, ref_rs_mode(x, "k", "rceil", 64, sd), f"plan call {i}: both K layout")
            assert_same_rs(seq, ref_rs_mode(x, "v", "rceil", 64, sd), f"plan call {i}: both V layout")
            assert_channel_major(seq.data, layout == "packed")
        else:
            got = kq.row_scaled_triton(xd, role, "rceil", seq_dim=sd, k_group=64)
            assert_same_rs(got, ref_rs_mode(x, role, "rceil", 64, sd), f"plan call {i}: {role} {layout}")
        assert len(kq._PLANS) == 1, "one signature, one plan"


def test_row_scaled_plan_keys_and_validation(gen):
    """A plan never answers for another signature: dtype, shape, mode and group each make their own (or fail
    validation on the slow path first); bad arguments raise on every call; tile overrides bypass the plans."""
    kq._PLANS.clear()
    x = make_input((1, 40, 2, 64), torch.bfloat16, "random", gen).to(DEVICE)
    kq.row_scaled_triton(x, "k")
    kq.row_scaled_triton(x.float(), "k")
    kq.row_scaled_triton(x, "k", "floor")
    kq.row_scaled_triton(x, "k", k_group=64)
    kq.row_scaled_triton(x[:, :33], "k")
    assert len(kq._PLANS) == 5
    for _ in range(2):
        with pytest.raises(ValueError, match="scale_mode"):
            kq.row_scaled_triton(x, "k", "nearest")
        with pytest.raises(ValueError, match="k_group"):
            kq.row_scaled_triton(x, "k", k_group=48)
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            kq.row_scaled_triton(x.to(torch.int32), "q")
    n = len(kq._PLANS)
    kq.TILE_OVERRIDES["quant"] = kq.Tile(64, 4)
    try:
        got = kq.row_scaled_triton(x, "q")
        assert_same_rs(got, ref_rs(x.cpu(), "q"), "q under a tile override")
        assert len(kq._PLANS) == n, "no plan is made while tiles are overridden"
    finally:
        kq.TILE_OVERRIDES.clear()


def _same_rs_layout(got, want, what):
    assert (got.dim, got.group_dim, got.group) == (want.dim, want.group_dim, want.group), what
    assert got.data.shape == want.data.shape and got.data.stride() == want.data.stride(), what
    assert_same_bytes(got.data, want.data, what)
    assert_same_int(got.exp, want.exp, what)


@pytest.mark.parametrize("keep_kv", [False, True])
@pytest.mark.parametrize("dims", [(1, 37, 70, 4, 2, 64), (2, 130, 33, 2, 1, 128), (1, 1, 5, 3, 3, 64),
                                  (1, 64, 128, 2, 2, 128)], ids=str)
def test_forward_operands_in_two_launches(dims, keep_kv, gen):
    """``forward_operands_triton`` (Q, K and V's exponents in one launch, V in the next; with ``keep_kv`` the
    backward's K/V orientations too) equals the single passes bit for bit, on fresh data at each call of one
    signature (the second and third take the plan), NaN/Inf blocks included."""
    B, Sq, Sk, Hq, Hkv, D = dims
    kq._PLANS.clear()
    for i in range(3):
        kind = "adversarial" if i == 1 else "random"
        q, k, v = (make_input(s, torch.bfloat16, kind, gen).to(DEVICE)
                   for s in ((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)))
        qr, kr, vr, kv = kq.forward_operands_triton(q, k, v, keep_kv=keep_kv)
        _same_rs_layout(qr, kq.row_scaled_triton(q, "q"), f"call {i}: Q")
        _same_rs_layout(kr, kq.row_scaled_triton(k, "k"), f"call {i}: K")
        _same_rs_layout(vr, kq.row_scaled_triton(v, "v"), f"call {i}: V")
        if keep_kv:
            for got, want, name in zip(kv, (*kq.row_scaled_triton_both(k), kq.row_scaled_triton_both(v)[0]),
                                       ("K hdim", "K seq", "V hdim")):
                _same_rs_layout(got, want, f"call {i}: kept {name}")
        else:
            assert kv is None


def test_forward_operands_checks_its_inputs(gen):
    q = make_input((1, 16, 2, 64), torch.bfloat16, "random", gen).to(DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        kq.forward_operands_triton(q, q.float(), q)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        kq.forward_operands_triton(q, q, q[:, :8])
    with pytest.raises(ValueError, match="k_group"):
        kq.forward_operands_triton(q, q, q, k_group=3)
    out = kq.forward_operands_triton(q[:, :0], q, q)  # no query: the single passes
    assert out[0].data.shape == (1, 0, 2, 64)


@pytest.mark.parametrize("shape", [(1, 37, 4, 64), (2, 130, 2, 128)], ids=str)
def test_both_pair_in_two_launches(shape, gen):
    """``row_scaled_triton_both_pair`` (the backward's q and dO: both exponent passes in one launch, both quantize
    passes in the next) equals two ``row_scaled_triton_both`` calls bit for bit, at every call of one signature."""
    kq._PLANS.clear()
    for i in range(3):
        x, y = (make_input(shape, torch.bfloat16, "adversarial" if i == 1 else "random", gen).to(DEVICE)
                for _ in range(2))
        got = kq.row_scaled_triton_both_pair(x, y, k_group=128)
        for t, pair, name in ((x, got[0], "x"), (y, got[1], "y")):
            for g, w, o in zip(pair, kq.row_scaled_triton_both(t, k_group=128), ("hdim", "seq")):
                _same_rs_layout(g, w, f"call {i}: {name} {o}")
    with pytest.raises(ValueError, match="one shape"):
        kq.row_scaled_triton_both_pair(x, y[:, :5])


def test_plan_hit_still_refuses_a_float_group(gen):
    """k_group=128.0 equals 128 as a key: plans only serve int groups, so the slow path's check still runs."""
    kq._PLANS.clear()
    x = make_input((1, 40, 2, 64), torch.bfloat16, "random", gen).to(DEVICE)
    kq.row_scaled_triton(x, "k", k_group=128)
    with pytest.raises(ValueError, match="k_group"):
        kq.row_scaled_triton(x, "k", k_group=128.0)
    with pytest.raises(ValueError, match="k_group"):
        kq.row_scaled_triton_both_pair(x, x, k_group=128.0)


def test_channel_major_buffer_survives_a_copying_hook(gen):
    """The eager training path saves K seq as its whole (B, H, D, S_pad) buffer: a contiguous copy of that (what
    save_on_cpu makes) still gives the channel-major view back, unlike a copy of the (B, S, H, D) view."""
    from mxattn.interface import _channel_major_buffer_of

    x = make_input((2, 37, 3, 64), torch.bfloat16, "random", gen).to(DEVICE)
    seq = kq.row_scaled_triton(x, "v")
    buf = _channel_major_buffer_of(seq.data)
    assert buf.is_contiguous() and buf.data_ptr() == seq.data.data_ptr() and buf.shape[-1] % 16 == 0
    copied = buf.clone()
    view = copied[..., :37].permute(0, 3, 1, 2)
    assert view.stride() == seq.data.stride()
    assert torch.equal(view.view(torch.uint8), seq.data.view(torch.uint8))
    assert seq.data.contiguous().stride() != seq.data.stride()  # what saving the view itself would have given
    with pytest.raises(RuntimeError, match="fresh channel-major buffer"):
        _channel_major_buffer_of(x.view(torch.uint8).view(torch.float8_e4m3fn))


def test_launch_plans_switch_off(monkeypatch, gen):
    """MXATTN_LAUNCH_PLANS=0 (``launch.PLANS``): no plan is made, the checked path runs every call."""
    from mxattn.kernels import launch as L

    monkeypatch.setattr(L, "PLANS", False)
    kq._PLANS.clear()
    x = make_input((1, 40, 2, 64), torch.bfloat16, "random", gen).to(DEVICE)
    for _ in range(2):
        assert_same_rs(kq.row_scaled_triton(x, "k"), ref_rs(x.cpu(), "k"), "k without plans")
        kq.forward_operands_triton(x, x, x)
    assert not kq._PLANS
