"""The MXFP8 format contract (DESIGN §1) and the Hopper row-scaled operand format.

The byte table pins every scale and rounding rule; expected bytes were worked out by hand
(e4m3fn byte = sign | 4-bit exponent, bias 7 | 3-bit mantissa; 0x7E = 448, 0x7F = NaN;
subnormals are m * 2^-9 with byte m).  Property tests check the algebra on random inputs.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxattn.formats import (
    MXTensor,
    RowScaledFP8,
    channel_major,
    dequantize_mxfp8,
    quantize_mxfp8,
    row_scaled_from_float,
    to_row_scaled,
)

MODES = ("rceil", "floor")
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Largest magnitude whose MX value stays inside fp32 after rounding (above it RCEIL can round a
# block maximum up to 256 * 2^120 = 2^128).
FP32_SAFE_MAX = 1.75 * 2.0**127

# ----------------------------------------------------------------------------------------------
# byte table: (case, block values (rest of the 32-block is zero), {mode: (scale byte, data bytes)})
# ----------------------------------------------------------------------------------------------
BOTH = object()  # same expectation for both modes

TABLE = [
    ("zero block", [0.0, 0.0], {BOTH: (127, [0x00, 0x00])}),
    # amax 448 = 1.75 * 2^8 -> e = 0 in both modes; 1.0 = 0x38, -2.0 = 0xC0
    ("amax 448", [448.0, 1.0, -2.0], {BOTH: (127, [0x7E, 0x38, 0xC0])}),
    # 449 = 1.7539 * 2^8: RCEIL e = 1 (449/2 = 224.5 -> 224 = 0x76, 0.5 = 0x30); FLOOR e = 0, 449 -> 448
    ("amax 449", [449.0, 1.0], {"rceil": (128, [0x76, 0x30]), "floor": (127, [0x7E, 0x38])}),
    ("amax -449", [-449.0, 1.0], {"rceil": (128, [0xF6, 0x30]), "floor": (127, [0xFE, 0x38])}),
    # amax exactly 1.75 * 2^-20: e = -28 (byte 99) in both; 2^-30 * 2^28 = 0.25 = 0x28
    ("1.75*2^-20", [1.75 * 2.0**-20, 2.0**-30], {BOTH: (99, [0x7E, 0x28])}),
    # one fp32 ulp above: RCEIL e = -27 (byte 100), (1.75 + 2^-23) * 2^7 -> 224, 2^-3 = 0x20;
    # FLOOR keeps e = -28 and 448.00003 saturates
    ("1.75*2^-20 + ulp", [(1.75 + 2.0**-23) * 2.0**-20, 2.0**-30],
     {"rceil": (100, [0x76, 0x20]), "floor": (99, [0x7E, 0x28])}),
    # 1.75 * 2^100 -> e = 92 (byte 219); -2^95 * 2^-92 = -8: sign | exponent 10 | m 0 = 0xD0
    ("1.75*2^100", [1.75 * 2.0**100, -(2.0**95)], {BOTH: (219, [0x7E, 0xD0])}),
    # amax 448 (e = 0 in both) with the interesting elements at scale 1:
    ("grid at scale 1",
     [448.0, 2.0**-6, 2.0**-9, 3 * 2.0**-10, 2.0**-10, 2.0**-10 + 2.0**-20, -(2.0**-10), 5 * 2.0**-10,
      7 * 2.0**-9, 7 * 2.0**-10, 1.0625, 1.1875, 272.0, 304.0, -304.0, 300.0, 2.0**-6 - 2.0**-10],
     {BOTH: (127, [
         0x7E,  # 448
         0x08,  # smallest normal 2^-6: exponent field 1
         0x01,  # smallest subnormal 2^-9
         0x02,  # 1.5 * 2^-9: tie, to even -> 2 * 2^-9
         0x00,  # 0.5 * 2^-9: tie, to even -> 0
         0x01,  # just above the tie -> 2^-9
         0x80,  # -0.5 * 2^-9 -> -0
         0x02,  # 2.5 * 2^-9 -> 2
         0x07,  # largest subnormal 7 * 2^-9
         0x04,  # 3.5 * 2^-9 -> 4
         0x38,  # 1 + 1/16: tie between 1.0 (m=0) and 1.125 (m=1) -> 1.0
         0x3A,  # 1 + 3/16: tie between m=1 and m=2 -> m=2
         0x78,  # 272: tie between 256 (m=0) and 288 (m=1) -> 256
         0x7A,  # 304: tie between 288 (m=1) and 320 (m=2) -> 320
         0xFA,  # -304 -> -320
         0x79,  # 300 -> 288
         0x08,  # 2^-6 - 2^-10 = 7.5 * 2^-9: tie between 7 * 2^-9 and 8 * 2^-9 -> 8 = 2^-6
     ])}),
    # 464 = 1.8125 * 2^8, 480 = 1.875 * 2^8: RCEIL e = 1 (232 -> tie -> 224 = 0x76; 240 = 0x77);
    # FLOOR e = 0 and both saturate to 448
    ("464", [464.0], {"rceil": (128, [0x76]), "floor": (127, [0x7E])}),
    ("480", [480.0, -480.0], {"rceil": (128, [0x77, 0xF7]), "floor": (127, [0x7E, 0xFE])}),
    # 500, 300: RCEIL e = 1, 250 -> 256 = 0x78, 150 -> 144 = 0x71; FLOOR e = 0, 500 saturates, 300 -> 288
    ("500, 300", [500.0, 300.0], {"rceil": (128, [0x78, 0x71]), "floor": (127, [0x7E, 0x79])}),
    # 512 = 2^9: both e = 1 -> 256 = 0x78
    ("512", [512.0], {BOTH: (128, [0x78])}),
    # Inf / NaN blocks: byte 255, data = elements at scale 1 (saturated, NaN kept)
    ("+inf block", [float("inf"), 1.0, 500.0, -float("inf")], {BOTH: (255, [0x7E, 0x38, 0x7E, 0xFE])}),
    ("nan block", [float("nan"), 2.0], {BOTH: (255, [0x7F, 0x40])}),
    # exponent clamp at -127: amax 2^-136 wants e = -144 -> byte 0; 2^-136 * 2^127 = 2^-9 = 0x01,
    # 2^-140 -> 2^-13 -> 0
    ("clamp -127", [2.0**-136, 2.0**-140], {BOTH: (0, [0x01, 0x00])}),
    ("fp32 subnormal amax", [2.0**-149, -(2.0**-140)], {BOTH: (0, [0x00, 0x80])}),
    ("fp32 min normal", [2.0**-126], {BOTH: (0, [0x40])}),  # 2^-126 * 2^127 = 2 = 0x40
    # huge: 1.5 * 2^127 -> e = 119 (byte 246), 384 = 0x7C.  31/16 * 2^127: RCEIL e = 120 (byte 247),
    # 248 -> tie between 240 (m=7) and 256 (m=0) -> 256 = 0x78; FLOOR e = 119, 496 saturates.
    ("1.5*2^127", [1.5 * 2.0**127], {BOTH: (246, [0x7C])}),
    ("31/16*2^127", [1.9375 * 2.0**127], {"rceil": (247, [0x78]), "floor": (246, [0x7E])}),
    ("fp32 max", [torch.finfo(torch.float32).max], {"rceil": (247, [0x78]), "floor": (246, [0x7E])}),
]


def _expect(table_modes, mode):
    return table_modes.get(BOTH, table_modes.get(mode))


def _bytes(t: torch.Tensor) -> list:
    return t.view(torch.uint8).flatten().tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case,values,modes", TABLE, ids=[row[0] for row in TABLE])
def test_byte_table(case, values, modes, mode):
    scale_byte, data_bytes = _expect(modes, mode)
    x = torch.zeros(32)
    x[: len(values)] = torch.tensor(values, dtype=torch.float32)
    t = quantize_mxfp8(x, scale_mode=mode)
    want_data = torch.tensor(data_bytes + [0] * (32 - len(values)), dtype=torch.uint8)
    torch.testing.assert_close(t.scale_bytes, torch.tensor([scale_byte], dtype=torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(t.data.view(torch.uint8), want_data, rtol=0, atol=0)
    deq = t.dequantize(torch.float64)
    if scale_byte == 255:
        assert torch.isnan(deq).all(), "a NaN-scale block must dequantize to NaN everywhere"
    else:
        assert torch.isfinite(deq).all()


# partial last blocks: (length, values, {mode: (scale bytes, data bytes)})
PARTIAL = [
    # block 0: amax 1 -> e = -8 (byte 119), 1 * 2^8 = 256 = 0x78; block 1 (1 element): as "amax 449"
    (33, [1.0] * 32 + [449.0], {"rceil": ([119, 128], [0x78] * 32 + [0x76]),
                                "floor": ([119, 127], [0x78] * 32 + [0x7E])}),
    # 3 = 1.5 * 2: e = -7 (byte 120), 3 * 2^7 = 384 = 0x7C
    (1, [3.0], {BOTH: ([120], [0x7C])}),
    # amax 7 = 1.75 * 4 -> e = -6 (byte 121); 2^-3 * 2^6 = 8 = 0x50, -7 * 2^6 = -448 = 0xFE
    (31, [0.125] * 30 + [-7.0], {BOTH: ([121], [0x50] * 30 + [0xFE])}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n,values,modes", PARTIAL, ids=[f"len{p[0]}" for p in PARTIAL])
def test_partial_blocks(n, values, modes, mode, dim):
    scales, data = _expect(modes, mode)
    col = torch.tensor(values, dtype=torch.float32)
    x = torch.stack([col, -col], dim=1 - dim)  # the block dim holds the values, the other dim 2 rows
    t = quantize_mxfp8(x, dim=dim, scale_mode=mode)
    assert t.data.shape == x.shape and t.scale.shape[dim] == -(-n // 32)
    row0 = [slice(None), slice(None)]
    row0[1 - dim] = 0
    torch.testing.assert_close(t.scale_bytes[tuple(row0)], torch.tensor(scales, dtype=torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(t.data[tuple(row0)].view(torch.uint8), torch.tensor(data, dtype=torch.uint8),
                               rtol=0, atol=0)
    # missing elements count as zero: same bytes as the zero-padded tensor, cut back
    padded = torch.nn.functional.pad(x.movedim(dim, -1), (0, 64 - n)).movedim(-1, dim)
    tp = quantize_mxfp8(padded, dim=dim, scale_mode=mode)
    torch.testing.assert_close(t.data.view(torch.uint8), tp.data.narrow(dim, 0, n).view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(t.scale_bytes, tp.scale_bytes.narrow(dim, 0, t.scale.shape[dim]), rtol=0, atol=0)


def test_rceil_is_not_byte_idempotent_at_224():
    """q(dq(q(x))) can differ from q(x) in bytes under RCEIL (same values): 449 -> 224 * 2^1 = 448,
    which requantizes to 448 * 2^0."""
    t = quantize_mxfp8(torch.tensor([449.0]))
    t2 = quantize_mxfp8(t.dequantize())
    assert _bytes(t.scale) == [128] and _bytes(t.data) == [0x76]
    assert _bytes(t2.scale) == [127] and _bytes(t2.data) == [0x7E]
    assert torch.equal(t.dequantize(), t2.dequantize())


def test_dequantize_fp64_does_not_overflow():
    t = quantize_mxfp8(torch.tensor([1.9375 * 2.0**127]))  # 256 * 2^120 = 2^128
    assert t.dequantize(torch.float64).item() == 2.0**128
    assert math.isinf(t.dequantize(torch.float32).item())


# ----------------------------------------------------------------------------------------------
# property tests
# ----------------------------------------------------------------------------------------------


@st.composite
def mx_inputs(draw, max_rank=3, max_size=70):
    """(x, dim): fp32 values spread over many binades (per-element and per-block exponents),
    with zeros and exact powers of two sprinkled in; any dim, partial blocks."""
    rank = draw(st.integers(1, max_rank))
    shape = draw(st.lists(st.integers(1, max_size), min_size=rank, max_size=rank))
    dim = draw(st.integers(-rank, rank - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    centre = draw(st.integers(-140, 120))
    spread = draw(st.integers(0, 30))
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    e = centre + torch.randint(-spread, spread + 1, (n,), generator=g)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.pow(2.0, e.double())
    kind = torch.rand(n, generator=g)
    x = torch.where(kind < 0.1, torch.zeros_like(x), x)
    x = torch.where((kind >= 0.1) & (kind < 0.2), torch.pow(2.0, e.double()), x)
    x = x.clamp(-FP32_SAFE_MAX, FP32_SAFE_MAX).float().reshape(shape)
    return x, dim


def _block_exp(t: MXTensor) -> torch.Tensor:
    """Per-element unbiased exponent from the scale bytes (finite blocks only)."""
    n = t.data.shape[t.dim]
    return (t.scale_bytes.long() - 127).repeat_interleave(32, dim=t.dim).narrow(t.dim, 0, n)


@PROPS
@given(mx_inputs(), st.sampled_from(MODES))
def test_requantize_is_identity(xd, mode):
    """q(dq(q(x))) == q(x) on bytes, except for the two cases where one MX value has two encodings:
    RCEIL blocks whose maximum rounded down to 224 (they requantize one exponent lower, data
    doubled) and blocks that underflowed to all zeros under a clamped exponent (byte 127 again).
    The dequantized values are always identical."""
    x, dim = xd
    t = quantize_mxfp8(x, dim, mode)
    t2 = quantize_mxfp8(t.dequantize(), dim, mode)
    assert torch.equal(t.dequantize(), t2.dequantize())
    amax_byte = t.data.view(torch.uint8).bitwise_and(0x7F).movedim(dim, -1)
    pad = (-amax_byte.shape[-1]) % 32
    amax_byte = torch.nn.functional.pad(amax_byte, (0, pad)).unflatten(-1, (-1, 32)).amax(-1).movedim(-1, dim)
    at_224 = amax_byte == 0x76
    zeroed = amax_byte == 0
    canonical = ~at_224 & ~zeroed
    s1, s2 = t.scale_bytes.long(), t2.scale_bytes.long()
    assert torch.equal(s1[canonical], s2[canonical])
    if mode == "floor":
        assert not (at_224 & (s1 != s2)).any()
    assert torch.equal(s2[at_224 & (s1 != s2)], s1[at_224 & (s1 != s2)] - 1)
    assert (s2[zeroed] == 127).all()
    same_block = (s1 == s2).repeat_interleave(32, dim=dim).narrow(dim, 0, x.shape[dim])
    assert torch.equal(t.data.view(torch.uint8)[same_block], t2.data.view(torch.uint8)[same_block])


@PROPS
@given(mx_inputs(max_rank=3, max_size=40), st.sampled_from(MODES))
def test_dim_equals_transpose(xd, mode):
    x, dim = xd
    dim %= x.ndim
    t = quantize_mxfp8(x, dim, mode)
    tt = quantize_mxfp8(x.movedim(dim, -1), -1, mode)
    assert torch.equal(t.data.view(torch.uint8), tt.data.view(torch.uint8).movedim(-1, dim))
    assert torch.equal(t.scale_bytes, tt.scale_bytes.movedim(-1, dim))


@PROPS
@given(mx_inputs(), st.sampled_from(MODES))
def test_error_within_half_step(xd, mode):
    """Normal, unsaturated values: |dq - x| <= half an e4m3 step; subnormals: <= 2^-10 (scaled)."""
    x, dim = xd
    t = quantize_mxfp8(x, dim, mode)
    e = _block_exp(t).double()
    v = x.double() * torch.pow(2.0, -e)  # exact scaled value
    err = (t.dequantize(torch.float64) * torch.pow(2.0, -e) - v).abs()
    normal = (v.abs() >= 2.0**-6) & (v.abs() <= 448)
    step = torch.pow(2.0, torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)
    assert (err[normal] <= step[normal] / 2).all()
    sub = v.abs() < 2.0**-6
    assert (err[sub] <= 2.0**-10).all()
    if mode == "rceil":
        assert (v.abs() <= 448).all(), "RCEIL must never saturate"


@PROPS
@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.data())
def test_mxtensor_validation(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    good = list(shape)
    good[dim] = -(-shape[dim] // 32)
    fp8 = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    scale = torch.full(good, 127, dtype=torch.uint8)
    MXTensor(fp8, scale, dim)  # valid; uint8 scale accepted
    with pytest.raises(TypeError):
        MXTensor(fp8.float(), scale, dim)
    with pytest.raises(TypeError):
        MXTensor(fp8, scale.float(), dim)
    bad = list(good)
    which = data.draw(st.integers(0, len(bad) - 1))
    bad[which] += data.draw(st.integers(1, 3))
    with pytest.raises(ValueError):
        MXTensor(fp8, torch.full(bad, 127, dtype=torch.uint8), dim)
    with pytest.raises(ValueError):
        MXTensor(fp8, torch.full(good + [1], 127, dtype=torch.uint8), dim)


def _mx44():
    return quantize_mxfp8(torch.randn(4, 40), dim=1)


FORMAT_BAD = [
    # (description, call, exception, words in the message)
    ("MXTensor data list", lambda: MXTensor([0.0], _mx44().scale, 1), TypeError, "MXTensor.data must be a torch.Tensor"),
    ("MXTensor scale list", lambda: MXTensor(_mx44().data, [127, 127], 1), TypeError,
     "MXTensor.scale must be a torch.Tensor"),
    ("MXTensor data e5m2", lambda: MXTensor(_mx44().data.view(torch.float8_e5m2), _mx44().scale, 1), TypeError,
     "MXTensor.data must be torch.float8_e4m3fn"),
    ("MXTensor scale int8", lambda: MXTensor(_mx44().data, _mx44().scale.view(torch.int8), 1), TypeError,
     "MXTensor.scale must be torch.float8_e8m0fnu or uint8"),
    ("MXTensor dim float", lambda: MXTensor(_mx44().data, _mx44().scale, 1.0), TypeError, "dim must be an int, got float"),
    ("MXTensor dim bool", lambda: MXTensor(_mx44().data, _mx44().scale, True), TypeError, "dim must be an int, got bool"),
    ("MXTensor dim range", lambda: MXTensor(_mx44().data, _mx44().scale, 2), ValueError, "dim=2 is out of range"),
    ("MXTensor scale count", lambda: MXTensor(_mx44().data, _mx44().scale[:, :1], 1), ValueError,
     r"MXTensor.scale has shape \(4, 1\), expected \(4, 2\)"),
    ("MXTensor orientation", lambda: MXTensor(_mx44().data, _mx44().scale, 0), ValueError,
     r"expected \(1, 40\) for data of shape \(4, 40\) blocked along dim 0"),
    ("MXTensor block 16", lambda: MXTensor(_mx44().data, _mx44().scale, 1, 16), ValueError, "block_size=32"),
    ("MXTensor scale device", lambda: MXTensor(_mx44().data, _mx44().scale.to("meta"), 1), ValueError,
     "MXTensor.scale is on meta but data is on cpu"),
    ("quantize list", lambda: quantize_mxfp8([1.0, 2.0]), TypeError, "expects a torch.Tensor, got list"),
    ("quantize int", lambda: quantize_mxfp8(torch.ones(4, dtype=torch.int32)), TypeError, "got torch.int32"),
    ("quantize e4m3", lambda: quantize_mxfp8(torch.ones(4).to(torch.float8_e4m3fn)), TypeError,
     "got torch.float8_e4m3fn"),
    ("quantize e4m3fnuz", lambda: quantize_mxfp8(torch.ones(4).to(torch.float8_e4m3fnuz)), TypeError,
     "got torch.float8_e4m3fnuz"),
    ("quantize e8m0", lambda: quantize_mxfp8(torch.ones(4).to(torch.float8_e8m0fnu)), TypeError,
     "got torch.float8_e8m0fnu"),
    ("quantize complex", lambda: quantize_mxfp8(torch.ones(4, dtype=torch.complex64)), TypeError, "got torch.complex64"),
    ("quantize rank 0", lambda: quantize_mxfp8(torch.tensor(1.0)), ValueError, "rank >= 1"),
    ("quantize dim float", lambda: quantize_mxfp8(torch.ones(4, 4), dim=1.0), TypeError, "dim must be an int"),
    ("quantize dim range", lambda: quantize_mxfp8(torch.ones(4, 4), dim=2), ValueError, "dim=2 is out of range"),
    ("quantize scale_mode", lambda: quantize_mxfp8(torch.ones(4), scale_mode="up"), ValueError, "scale_mode"),
    ("dequantize tensor", lambda: dequantize_mxfp8(torch.ones(4)), TypeError, "expects an MXTensor, got Tensor"),
    ("dequantize int dtype", lambda: dequantize_mxfp8(_mx44(), torch.int32), TypeError,
     "dtype must be float32, float16, bfloat16 or float64, got torch.int32"),
    ("to_row_scaled tensor", lambda: to_row_scaled(torch.ones(4, 32)), TypeError, "expects an MXTensor, got Tensor"),
    ("RowScaledFP8 data list", lambda: RowScaledFP8([0.0], torch.zeros(4, 1, dtype=torch.int32), 1), TypeError,
     "RowScaledFP8.data must be a torch.Tensor, got list"),
    ("RowScaledFP8 exp int64", lambda: RowScaledFP8(_mx44().data, torch.zeros(4, 1, dtype=torch.int64), 1), TypeError,
     "RowScaledFP8.exp must be int32"),
    ("RowScaledFP8 exp shape", lambda: RowScaledFP8(_mx44().data, torch.zeros(4, 2, dtype=torch.int32), 1), ValueError,
     r"RowScaledFP8.exp has shape \(4, 2\), expected \(4, 1\)"),
    ("RowScaledFP8 group 0", lambda: RowScaledFP8(_mx44().data, torch.zeros(1, 1, dtype=torch.int32), 1, 0, 0),
     ValueError, "RowScaledFP8.group must be a positive int, got 0"),
    ("RowScaledFP8 group_dim = dim", lambda: RowScaledFP8(_mx44().data, torch.zeros(4, 1, dtype=torch.int32), 1, 1, 2),
     ValueError, "group_dim must differ from dim"),
]


@pytest.mark.parametrize("case", FORMAT_BAD, ids=[c[0] for c in FORMAT_BAD])
def test_bad_format_input_is_refused_with_a_clear_message(case):
    _, call, exc, words = case
    with pytest.raises(exc, match=words):
        call()


def test_dim_accepts_integer_likes():
    """dim may be any ``__index__`` integer (a NumPy int, say), normalized to a plain int."""
    import numpy as np

    t = quantize_mxfp8(torch.randn(4, 40), dim=np.int64(-1))
    assert t.dim == 1 and type(t.dim) is int
    assert MXTensor(t.data, t.scale, np.int32(1)).dim == 1


# ----------------------------------------------------------------------------------------------
# Hopper row-scaled format
# ----------------------------------------------------------------------------------------------


def _block_varied(shape, gen, outlier_dim=None):
    """Gaussian values times 2^u per element (u in [-14, 2]) so that blocks of one row have very
    different exponents; optional outlier channels x30 along the last dim."""
    x = torch.randn(shape, generator=gen) * torch.pow(2.0, torch.randint(-14, 3, shape, generator=gen).float())
    if outlier_dim is not None:
        x[..., :: outlier_dim] *= 30
    return x


def _expected_row_exp(t: MXTensor) -> torch.Tensor:
    """Largest exponent among the blocks of each row that hold a nonzero, non-NaN element (0 if none)."""
    sb = t.scale_bytes.long().movedim(t.dim, -1)
    d = t.data.float().movedim(t.dim, -1)
    pad = (-d.shape[-1]) % 32
    nonzero = torch.nn.functional.pad(d, (0, pad)).unflatten(-1, (-1, 32)).ne(0).any(-1) & (sb != 255)
    e = torch.where(nonzero, sb - 127, torch.full_like(sb, -10**6)).amax(-1, keepdim=True)
    return torch.where(e < -1000, torch.zeros_like(e), e).movedim(-1, t.dim)


LAYOUTS = {  # name: (quantize dim, group_dim, group) for (B, S, H, D) tensors
    "q_hdim": (-1, None, 1),
    "k_hdim_group128": (-1, 1, 128),
    "v_seq": (1, None, 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("S", [1, 200, 257])
def test_row_scaled_error_bound(layout, S, gen):
    dim, gdim, group = LAYOUTS[layout]
    x = _block_varied((2, S, 3, 96), gen)
    x[0, :, 0, :] = 0  # an all-zero row group
    x[1, :, 1, 40:80] = 0  # zero blocks inside rows
    t = quantize_mxfp8(x, dim)
    rs = to_row_scaled(t, group_dim=gdim, group=group)
    assert isinstance(rs, RowScaledFP8) and rs.data.dtype == torch.float8_e4m3fn
    want = list(x.shape)
    want[dim] = 1
    if gdim is not None:
        want[gdim] = -(-S // group)
    assert list(rs.exp.shape) == want
    e_row = _expected_row_exp(t)
    if gdim is not None:
        er = e_row.movedim(gdim, -1)
        er = torch.nn.functional.pad(er, (0, (-S) % group), value=-(10**6)).unflatten(-1, (-1, group)).amax(-1)
        e_row = er.movedim(-1, gdim)
    assert torch.equal(rs.exp.long(), e_row)
    err = (rs.dequantize(torch.float64) - t.dequantize(torch.float64)).abs()
    bound = torch.pow(2.0, rs.expanded_exp().double() - 10)
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3g}"
    assert torch.equal(row_scaled_from_float(x, dim, gdim, group).data.view(torch.uint8), rs.data.view(torch.uint8))


def test_row_scaled_nan_and_zero_blocks(gen):
    x = torch.randn(4, 96, generator=gen) * 2.0**-5  # block exponents around -10
    x[1, 35] = float("inf")  # block 1 of row 1 -> NaN block
    x[2, 64:] = 0  # zero block (byte 127, e = 0) must not raise the row exponent
    x[3] = 0
    t = quantize_mxfp8(x)
    assert t.scale_bytes[1, 1] == 255 and t.scale_bytes[2, 2] == 127
    rs = to_row_scaled(t)
    deq = rs.dequantize(torch.float64)
    assert torch.isnan(deq[1, 32:64]).all() and not torch.isnan(deq[1, :32]).any()
    assert not torch.isnan(deq[[0, 2, 3]]).any()
    e = (t.scale_bytes.long() - 127)
    assert rs.exp[2, 0] == e[2, :2].max() < 0
    assert rs.exp[1, 0] == torch.stack([e[1, 0], e[1, 2]]).max()
    assert rs.exp[3, 0] == 0 and (deq[3] == 0).all()


def _attention64(q, k, v):
    """Plain fp64 softmax(Q K^T / sqrt(d)) V on (B, S, H, D)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (p @ v).transpose(1, 2)


def _sqnr(a, e):
    """SQNR in dB (``reference.sqnr_db``): +inf when ``a`` equals ``e`` exactly, as some draws re-express without
    any loss (MXATTN_SEED=3414747 divided by zero here before)."""
    from mxattn.reference import sqnr_db

    return sqnr_db(a, e)


def _realistic(shape, gen):
    """Gaussian with 3% outlier channels x30 and lognormal token norms (DESIGN §2 families)."""
    x = torch.randn(shape, generator=gen)
    x[..., ::33] *= 30
    return x * torch.exp(torch.randn((*shape[:-1], 1), generator=gen))


@pytest.mark.parametrize("family", ["realistic", "adversarial"])
def test_row_scaled_attention_sqnr(family, gen):
    """Attention on the Hopper operand format vs on the exact MX inputs (fp64).  Realistic inputs: >= 80 dB
    (measured 117-128).  Adversarial per-element 2^u spreads over 16 octaves push many elements of a row to
    e4m3 subnormals after re-expression: measured 75-92 dB, bound 65."""
    B, S, H, D = 1, 300, 2, 64
    if family == "realistic":
        q, k, v = (_realistic((B, S, H, D), gen) for _ in range(3))
    else:
        q, k, v = (_block_varied((B, S, H, D), gen, outlier_dim=11) for _ in range(3))
    qm, km, vm = quantize_mxfp8(q), quantize_mxfp8(k), quantize_mxfp8(v, dim=1)
    qr = to_row_scaled(qm)
    kr = to_row_scaled(km, group_dim=1, group=128)
    vr = to_row_scaled(vm)
    exact = _attention64(*(t.dequantize(torch.float64) for t in (qm, km, vm)))
    rowsc = _attention64(*(t.dequantize(torch.float64) for t in (qr, kr, vr)))
    assert _sqnr(rowsc, exact) >= (80 if family == "realistic" else 65)


@pytest.mark.parametrize("S", [1, 16, 45])
def test_channel_major(S, gen):
    B, H, D = 2, 3, 40
    x = torch.randn(B, S, H, D, generator=gen).to(torch.float8_e4m3fn)
    y = channel_major(x)
    s_pad = -(-S // 16) * 16
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    assert y.stride() == (H * D * s_pad, 1, D * s_pad, s_pad)
    assert y.untyped_storage().nbytes() == B * H * D * s_pad * y.element_size()
    buf = y.as_strided((B, H, D, s_pad), (H * D * s_pad, D * s_pad, s_pad, 1))
    assert (buf[..., S:].view(torch.uint8) == 0).all()
    with pytest.raises(ValueError):
        channel_major(x[0])
