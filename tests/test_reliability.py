"""Reliability (issue 10): fuzzed shapes, edge values, memory.  Rules and coverage: docs/reliability.md.

CPU: the ``tl`` forward under TRITON_INTERPRET=1 (conftest) and the public API (the reference emulation).
GPU (marker ``gpu``): the same edge-value tests on CUDA tensors, a forward+backward memory check at S=32k.

* Fuzzing (hypothesis, seeded by the session seed ``MXATTN_SEED``): random attention shapes through
  ``attn_fwd_hopper`` against the reference with the calibrated bound of tests/test_attn_fwd.py, and the Triton
  quantizer / dequantizer / Hopper-operand kernels against ``mxattn.formats`` byte for byte on random shapes,
  dtypes and NaN/Inf sprinkles (tests/test_formats.py fuzzes the PyTorch format itself; not repeated here).
* Edge values: NaN / ±Inf per MX block, huge logits, 2^±100 input scales, a row max that arrives late,
  rows with nothing to attend, determinism.  Each test runs on "cpu" (public API and the interpreted kernel)
  and on "cuda" (public API, marker gpu).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from conftest import SESSION_SEED
from mxattn import formats, interface, reference
from mxattn.interface import mxfp8_attn_func
from test_attn_fwd import BF16_FLOOR, MARGIN_DB, _check_against_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FUZZ = settings(
    max_examples=int(os.environ.get("MXATTN_FUZZ_EXAMPLES", "24")), deadline=None, derandomize=False,
    print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SEEDED = hypothesis_seed(int(SESSION_SEED))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


needs_kernels = pytest.mark.skipif(
    not (_interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 (CPU) or a GPU"
)


def _randn(shape, g, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _qkv(g, B=1, Sq=48, Sk=48, Hq=2, Hkv=1, D=64):
    return _randn((B, Sq, Hq, D), g), _randn((B, Sk, Hkv, D), g), _randn((B, Sk, Hkv, D), g)


def _kernel(q, k, v, causal, softmax_scale=None, config=None):
    """The ``tl`` forward on the Hopper operands made by ``formats`` (fp32 out, so nothing is lost to bf16)."""
    from mxattn.kernels.attn_fwd import attn_fwd_hopper

    ops = interface.hopper_operands(*interface.quantize_qkv(q, k, v))
    out, lse = attn_fwd_hopper(*ops, causal=causal, softmax_scale=softmax_scale, out_dtype=torch.float32,
                               config=config)
    return out.cpu(), lse.cpu()


def _interpreter_loads_e4m3_nan() -> bool:
    """Whether the Triton interpreter reads the e4m3 NaN byte (0x7F) as NaN.  triton 3.9's interpreter reads it as
    480 (no NaN in its e4m3 conversion), so NaN data never reaches the interpreted kernel's arithmetic."""
    import triton
    import triton.language as tl

    @triton.jit
    def _load(X, Y):
        tl.store(Y, tl.load(X).to(tl.float32))

    x = torch.full((1,), float("nan")).to(torch.float8_e4m3fn)
    y = torch.zeros(1)
    _load[(1,)](x, y)
    return bool(torch.isnan(y).all())


def _paths(q, k, v, causal, device, softmax_scale=None, nonfinite=False):
    """(name, out, lse) on CPU tensors for every path under test on ``device``: the public API, plus on the
    CPU the interpreted kernel (the CPU API runs the reference emulation, so the kernel is checked apart).
    The interpreted kernel is left out for ``nonfinite`` inputs while the interpreter reads e4m3 NaN as 480
    (test_interpreter_reads_e4m3_nan pins that) and for Sk = 0 (formats.to_row_scaled needs a block)."""
    dev = torch.device(device)
    out, lse = mxfp8_attn_func(q.to(dev), k.to(dev), v.to(dev), causal=causal, softmax_scale=softmax_scale,
                               return_lse=True)
    res = [("api-" + dev.type, out.cpu(), lse.cpu())]
    if (dev.type == "cpu" and _interpreting() and k.shape[1] > 0
            and not (nonfinite and not _interpreter_loads_e4m3_nan())):
        res.append(("tl-interp", *_kernel(q, k, v, causal, softmax_scale)))
    return res


def _visible(Sq, Sk, causal) -> torch.Tensor:
    """(Sq, Sk) bool: query i sees key j (bottom-right causal alignment)."""
    i = torch.arange(Sq).unsqueeze(1)
    j = torch.arange(Sk).unsqueeze(0)
    return (j <= i + (Sk - Sq)) if causal else torch.ones(Sq, Sk, dtype=torch.bool)


def _within_calibrated_bound(name, out, q, k, v, causal, softmax_scale=None):
    """test_attn_fwd's rule for any output (API or kernel): error against fp64 on the MX-dequantized inputs no
    worse than the reference emulation's by 0.5 dB, plus the bf16 floor."""
    qm, km, vm = interface.quantize_qkv(q, k, v)
    truth, _ = reference.attention_forward(qm, km, vm, causal=causal, softmax_scale=softmax_scale)
    emul, _ = reference.attention_forward(qm, km, vm, causal=causal, softmax_scale=softmax_scale, quantize_p=True)
    out = out.double()
    assert torch.isfinite(out).all(), f"{name}: non-finite output where the truth is finite"
    err_k, err_e = (out - truth).norm().item(), (emul - truth).norm().item()
    bound = err_e * 10 ** (MARGIN_DB / 20) + BF16_FLOOR * truth.norm().item()
    assert err_k <= bound, (f"{name}: {reference.sqnr_db(out, truth):.2f} dB vs emulation "
                            f"{reference.sqnr_db(emul, truth):.2f} dB (err {err_k:.3g} > bound {bound:.3g})")
    return truth


# ==============================================================================================
# 1. fuzzing
# ==============================================================================================


@st.composite
def attn_shapes(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    # small tiles so that an 80-key row crosses several of them: 16-row/key tiles in the interpreter; on the GPU
    # the tuning table's tiles (an FP8 P V product needs BLOCK_N >= 32 there)
    tiles = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)] if torch.cuda.is_available() else [
        (16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)]
    config = draw(st.sampled_from([None] + tiles))
    return dict(
        B=draw(st.integers(1, 2)), Sq=draw(st.integers(1, 80)), Sk=draw(st.integers(1, 80)),
        Hq=Hkv * draw(st.sampled_from([1, 2, 4])), Hkv=Hkv, causal=draw(st.booleans()),
        q_gain=draw(st.sampled_from([0.25, 1.0, 4.0])), config=config, seed=draw(st.integers(0, 2**31 - 1)),
    )


@needs_kernels
@FUZZ
@SEEDED
@given(attn_shapes())
def test_fuzz_attn_fwd_against_reference(c):
    """Random shapes (B 1-2, Sq/Sk 1-80, GQA 1/2/4, D 64, causal or not, default or small tiles so that an
    80-key row crosses several tiles) against the reference: test_attn_fwd's calibrated bound, lse, empty rows."""
    from mxattn.kernels.attn_fwd import FwdConfig

    g = torch.Generator().manual_seed(c["seed"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (_randn(s, g, gain).to(dev) for s, gain in (((c["B"], c["Sq"], c["Hq"], 64), c["q_gain"]),
                                                          ((c["B"], c["Sk"], c["Hkv"], 64), 1.0),
                                                          ((c["B"], c["Sk"], c["Hkv"], 64), 1.0)))
    cfg = None if c["config"] is None else FwdConfig(*c["config"])
    _check_against_reference(q, k, v, c["causal"], config=cfg)


@st.composite
def quant_inputs(draw):
    """(x, mode): (B, S, H, D) with values over many binades, zeros, and (sometimes) NaN / ±Inf."""
    B, S, H = draw(st.integers(1, 2)), draw(st.integers(1, 80)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([1, 16, 31, 32, 33, 64, 100, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    centre = draw(st.integers(-20, 10)) if dtype == torch.float16 else draw(st.integers(-120, 100))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = B * S * H * D
    e = centre + torch.randint(-8, 9, (n,), generator=g)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.pow(2.0, e.double())
    kind = torch.rand(n, generator=g)
    x = torch.where(kind < 0.1, torch.zeros_like(x), x)
    if draw(st.booleans()):
        for val, lo in ((float("nan"), 0.1), (float("inf"), 0.102), (float("-inf"), 0.104)):
            x = torch.where((kind >= lo) & (kind < lo + 0.002), torch.full_like(x, val), x)
    return x.to(dtype).reshape(B, S, H, D), draw(st.sampled_from(["rceil", "floor"]))


def _same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


@needs_kernels
@FUZZ
@SEEDED
@given(quant_inputs(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_fuzz_quantize_kernels_round_trip(xm, out_dtype):
    """Triton quantize ("both") == formats.quantize_mxfp8 byte for byte (hdim along D, seq along S); Triton
    dequantize of each == formats.dequantize_mxfp8 (NaN where the scale byte is 255); the Hopper operands
    (roles q, k, v) == formats.to_row_scaled of the MX tensors.  Random shapes, dtypes, scale modes, NaN/Inf."""
    from mxattn.kernels.quantize import dequantize_mxfp8_triton, quantize_mxfp8_triton, row_scaled_triton

    x, mode = xm
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, s = quantize_mxfp8_triton(x.to(dev), "both", scale_mode=mode)
    for got, dim, name in ((h, 3, "hdim"), (s, 1, "seq")):
        want = formats.quantize_mxfp8(x, dim, mode)
        _same_bytes(got.data, want.data, f"{name} data")
        _same_bytes(got.scale, want.scale, f"{name} scale")
        dq = dequantize_mxfp8_triton(got, out_dtype).cpu()
        torch.testing.assert_close(dq, formats.dequantize_mxfp8(want, out_dtype), rtol=0, atol=0, equal_nan=True)
        nan_block = (want.scale_bytes == formats.E8M0_NAN).repeat_interleave(32, dim).narrow(dim, 0, x.shape[dim])
        assert torch.isnan(dq[nan_block]).all() and not torch.isnan(dq[~nan_block]).any()
    if x.shape[3] in (64, 128):
        for role, dim, group in (("q", 3, None), ("k", 3, 128), ("v", 1, None)):
            got = row_scaled_triton(x.to(dev), role, scale_mode=mode)
            want = formats.to_row_scaled(formats.quantize_mxfp8(x, dim, mode), 1 if group else None, group or 1)
            _same_bytes(got.data, want.data, f"row-scaled {role} data")
            assert torch.equal(got.exp.cpu(), want.exp), f"row-scaled {role} exponents"


# ==============================================================================================
# 2. edge values
# ==============================================================================================


def _poison(q, k, v, which: str, value: float):
    """Put ``value`` in one element of q, k or v; return the tensors and where the MX block lands."""
    q, k, v = q.clone(), k.clone(), v.clone()
    if which == "q":
        q[0, 7, 1, 40] = value  # block: token 7, head 1, channels 32..63
    elif which == "k":
        k[0, 20, 0, 3] = value  # block: key 20, kv head 0, channels 0..31
    else:
        v[0, 33, 0, 5] = value  # block: keys 32..63, kv head 0, channel 5
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nonfinite_input_poisons_exactly_its_mx_block(which, value, causal, device, seed):
    """A NaN or ±Inf element makes its MX block's scale byte 255 (NaN block), and the output is NaN exactly where
    that block is used: a q block -> its (token, head) row; a k block -> every row (all heads of the GQA group)
    that sees the key, while rows that cannot see it (causal) stay finite; a v block (32 keys x 1 channel) ->
    that channel of every row that sees one of its keys, other channels finite.  Rows that see none of a NaN v
    block's keys are unspecified (P = 0 times NaN, as in FlashAttention): not checked."""
    g = torch.Generator().manual_seed(seed)
    S, Hq = 48, 2
    q, k, v = _poison(*_qkv(g, Sq=S, Sk=S, Hq=Hq), which, value)
    qm, km, vm = interface.quantize_qkv(q, k, v)
    dim_blocks = {"q": (qm, (0, 7, 1, 1)), "k": (km, (0, 20, 0, 0)), "v": (vm, (0, 1, 0, 5))}
    mx, idx = dim_blocks[which]
    assert mx.scale_bytes[idx].item() == formats.E8M0_NAN
    assert (mx.scale_bytes == formats.E8M0_NAN).sum().item() == 1
    if device == "cuda":  # the GPU producers agree on the byte
        from mxattn.kernels.quantize import quantize_mxfp8_triton

        t = {"q": q, "k": k, "v": v}[which].cuda()
        got = quantize_mxfp8_triton(t, "seq" if which == "v" else "hdim")
        assert torch.equal(got.scale_bytes.cpu(), mx.scale_bytes)

    vis = _visible(S, S, causal)  # (Sq, Sk)
    nan_out = torch.zeros(1, S, Hq, 64, dtype=torch.bool)
    unspecified = torch.zeros_like(nan_out)
    nan_lse = torch.zeros(1, Hq, S, dtype=torch.bool)
    if which == "q":
        nan_out[0, 7, 1, :] = True
        nan_lse[0, 1, 7] = True
    elif which == "k":
        rows = vis[:, 20]
        nan_out[0, rows] = True
        nan_lse[0, :, rows] = True
    else:
        rows = vis[:, 32:48].any(dim=1)
        nan_out[0, rows, :, 5] = True
        unspecified[0, ~rows, :, 5] = True
    for name, out, lse in _paths(q, k, v, causal, device, nonfinite=True):
        isnan = torch.isnan(out)
        assert not torch.isinf(out).any(), f"{name}: Inf in the output"
        assert isnan[nan_out].all(), f"{name}: {int((~isnan[nan_out]).sum())} outputs finite where the block is NaN"
        assert not isnan[~nan_out & ~unspecified].any(), (
            f"{name}: NaN leaked to {int(isnan[~nan_out & ~unspecified].sum())} outputs outside the block's reach")
        assert torch.equal(torch.isnan(lse), nan_lse), f"{name}: lse NaN pattern"


@pytest.mark.skipif(not _interpreting(), reason="interpreter only")
@pytest.mark.xfail(strict=True, reason="triton 3.9 interpreter reads e4m3 0x7F as 480, not NaN; when this passes, "
                                       "the NaN tests above check the interpreted kernel too")
def test_interpreter_reads_e4m3_nan():
    assert _interpreter_loads_e4m3_nan()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_logits_stay_finite(causal, device, seed):
    """Logits ~1e4 (each query aligned with one visible key, |k| ~ 35 per channel): exp must not overflow and the
    row must not underflow to an empty row; out equals the argmax key's value, lse the max logit (to e4m3/fp32
    rounding).  The rows' winners are clear by thousands, so Hopper's ~14-bit FP8 accumulation cannot flip them."""
    g = torch.Generator().manual_seed(seed)
    S, H, D = 64, 2, 64
    k = _randn((1, S, H, D), g, 35.0)
    v = _randn((1, S, H, D), g)
    vis = _visible(S, S, causal)
    pick = torch.stack([torch.randint(0, int(vis[i].sum()), (H,), generator=g) + int(vis[i].nonzero()[0])
                        for i in range(S)])  # (S, H): a visible key per row and head
    q = torch.stack([k[0, pick[:, h], h] for h in range(H)], dim=1).unsqueeze(0)
    qm, km, vm = interface.quantize_qkv(q, k, v)
    truth, truth_lse = reference.attention_forward(qm, km, vm, causal=causal)
    assert truth_lse.min() > 4000, "construction: logits must be huge"
    for name, out, lse in _paths(q, k, v, causal, device):
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{name}: non-finite"
        assert reference.sqnr_db(out.double(), truth) > 40, f"{name}: {reference.sqnr_db(out.double(), truth):.1f} dB"
        rel = ((lse.double() - truth_lse) / truth_lse).abs().max().item()
        assert rel < 1e-3, f"{name}: lse relative error {rel:.2g}"


@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_random_logits_kernel_within_bound(causal, seed):
    """Gaussian q, k x 100 (logits ~1e4, near-ties included): the interpreted/compiled kernel against the
    reference with the calibrated bound (the CPU accumulates Q Kᵀ in fp32, so no extra allowance is needed;
    the GPU twin of this one with its looser bound is test_attn_fwd_gpu_large_logits_and_scale)."""
    if torch.cuda.is_available():
        pytest.skip("GPU: FP8 MMA accumulates with ~14 bits; covered with a looser bound in test_attn_fwd")
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, Sq=40, Sk=70, Hq=2, Hkv=2)
    _check_against_reference(q * 100, k * 100, v, causal)


SCALES = [  # exponents (a, b, c): q * 2^a, k * 2^b, v * 2^c
    (100, -100, 0),
    (-100, 100, 0),
    (0, 0, 100),
    (0, 0, -100),
    (100, -100, -100),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("abc", SCALES, ids=lambda s: "q%+d_k%+d_v%+d" % s)
def test_extreme_input_scales_are_exact_powers_of_two(abc, causal, device, seed):
    """Scaling inputs by 2^±100 only moves MX scale bytes (no clamp is reached), so the logits are unchanged and
    the output scales by exactly 2^c: bit for bit, on every path; nothing overflows or underflows."""
    a, b, c = abc
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, Sq=40, Sk=70, Hq=4, Hkv=2)
    sq, sk, sv = (q * 2.0**a, k * 2.0**b, v * 2.0**c)
    for (name, out, lse), (_, out0, lse0) in zip(_paths(sq, sk, sv, causal, device), _paths(q, k, v, causal, device)):
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{name}: non-finite"
        assert (out != 0).any(), f"{name}: output underflowed"
        assert torch.equal(out, out0 * 2.0**c), (
            f"{name}: output is not the unscaled output times 2^{c} (GPU: are the tl.exp2 of integer exponents exact?)")
        assert torch.equal(lse, lse0), f"{name}: lse changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vanishing_logits_give_uniform_attention(causal, device, seed):
    """q and k both x 2^-100: logits ~2^-200 (fp32 zero): uniform attention over the visible keys, i.e. the
    output of q = 0; P does not underflow (lse = log(#visible keys))."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, Sq=40, Sk=70, Hq=4, Hkv=2)
    for (name, out, lse), (_, out0, _) in zip(_paths(q * 2.0**-100, k * 2.0**-100, v, causal, device),
                                              _paths(torch.zeros_like(q), k, v, causal, device)):
        assert reference.sqnr_db(out.double(), out0.double()) > 40, name
        n_vis = _visible(40, 70, causal).sum(dim=1).double()
        assert torch.allclose(lse.double(), n_vis.log().expand_as(lse), atol=1e-5), f"{name}: lse"


def _late_max_inputs(g, kind: str, Sq=16, Sk=80, H=2, D=64):
    """Rows whose running max keeps growing: "last" puts a key 3 logits above the rest at the end (the 79 earlier
    keys still carry ~4x its weight); "ramp" makes the logit grow linearly with the key index (every tile raises
    the max).  Earlier tiles were quantized against a smaller max and must only be rescaled, never biased."""
    direction = _randn((1, 1, H, D), g).double()
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = (_randn((1, Sq, H, D), g).double() * 0.05 + direction * 4.0).to(torch.bfloat16)
    k = _randn((1, Sk, H, D), g).double() * 0.05
    if kind == "last":
        k[:, -1:] += direction * 6.0  # q.k ~ 24 -> 3 logits with softmax_scale 1/8
    else:
        k += direction * torch.linspace(0, 16, Sk, dtype=torch.float64).view(1, Sk, 1, 1)
    return q, k.to(torch.bfloat16), _randn((1, Sk, H, D), g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["last", "ramp"])
def test_row_max_arriving_late_is_unbiased(kind, device, seed):
    """Against fp64 truth: the calibrated bound, and no gain bias: <out, truth> / <truth, truth> within 1 % of 1
    (an inconsistency between the row sum l and what P·V was fed shows up as a gain).  On the CPU the interpreted
    kernel runs with 16-key tiles (5 tiles per row) besides the API; on the GPU the API's default tiles."""
    from mxattn.kernels.attn_fwd import FwdConfig

    g = torch.Generator().manual_seed(seed)
    q, k, v = _late_max_inputs(g, kind)
    outs = [(n, o) for n, o, _ in _paths(q, k, v, False, device)]
    if device == "cpu" and _interpreting():
        outs.append(("tl-interp-16x16", _kernel(q, k, v, False, config=FwdConfig(16, 16, 4, 1))[0]))
    for name, out in outs:
        truth = _within_calibrated_bound(name, out, q, k, v, False)
        gain = (out.double() * truth).sum().item() / (truth * truth).sum().item()
        assert abs(gain - 1) < 0.01, f"{name}: gain {gain:.4f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("Sq,Sk", [(50, 20), (7, 0), (33, 1)])
def test_rows_with_nothing_to_attend(Sq, Sk, device, seed):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key -> out 0 (not NaN) and lse -inf; Sk = 0: every row."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, Sq=Sq, Sk=Sk, Hq=4, Hkv=2)
    n_empty = max(Sq - Sk, 0) if Sk else Sq
    for name, out, lse in _paths(q, k, v, True, device):
        assert (out[:, :n_empty] == 0).all(), f"{name}: empty rows must be exactly zero"
        assert torch.isneginf(lse[..., :n_empty]).all(), f"{name}: empty rows must have lse -inf"
        assert torch.isfinite(out).all() and torch.isfinite(lse[..., n_empty:]).all(), f"{name}: non-finite"


@pytest.mark.parametrize("device", DEVICES)
def test_forward_is_deterministic(device, seed):
    """The forward has no atomics: two calls give bit-identical out and lse (the deterministic=True backward is
    checked in tests/test_interface.py)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(g, Sq=70, Sk=90, Hq=4, Hkv=1)
    for (name, o1, l1), (_, o2, l2) in zip(_paths(q, k, v, True, device), _paths(q, k, v, True, device)):
        assert torch.equal(o1, o2) and torch.equal(l1, l2), name


# ==============================================================================================
# 3. memory (GPU)
# ==============================================================================================

# Bytes per element of q (B*S*H*D, Hq = Hkv) that forward + backward may allocate on top of the inputs and dout:
# FP8 operands (q, k, v hdim/seq: 6), out bf16 (2), dO both ways (2), the fp32 dq accumulator (4), dq/dk/dv bf16
# (6) = 20; 40 leaves room for temporaries of the producers.  An S x S allocation at S = 32k is ~2^30 elements per
# head, i.e. > 100x the bound.
MEM_BYTES_PER_ELEMENT = 40
MEM_FIXED = 64 << 20


def _peak_fwd_bwd(fn, q, k, v, dout) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(q, k, v)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    q.grad = k.grad = v.grad = None
    return peak


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_memory_is_linear_in_sequence_length(causal, seed):
    """Peak memory of forward+backward at S = 16k and 32k (B1 H16 d128) for mxattn and SDPA BF16: mxattn stays
    under MEM_BYTES_PER_ELEMENT * B*S*H*D + MEM_FIXED and doubles (not quadruples) from 16k to 32k.  A row per
    run goes to $MXATTN_RESULTS_DIR/memory-<gpu>-<date>.json when that is set."""
    import torch.nn.functional as Fnn

    B, H, D = 1, 16, 128
    rows = []
    for S in (16384, 32768):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        mx = _peak_fwd_bwd(lambda a, b, c: mxfp8_attn_func(a, b, c, causal=causal), q, k, v, dout)
        sdpa = _peak_fwd_bwd(lambda a, b, c: Fnn.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=causal).transpose(1, 2), q, k, v, dout)
        n = B * S * H * D
        rows.append({"B": B, "Hq": H, "Hkv": H, "Sq": S, "Sk": S, "D": D, "causal": causal,
                     "peak_bytes": {"mxattn": mx, "sdpa_bf16": sdpa},
                     "bytes_per_element": {"mxattn": mx / n, "sdpa_bf16": sdpa / n}})
        del q, k, v, dout
        limit = MEM_BYTES_PER_ELEMENT * n + MEM_FIXED
        assert mx < limit, f"S={S}: mxattn peak {mx / 2**20:.0f} MiB > linear bound {limit / 2**20:.0f} MiB"
    m16, m32 = rows[0]["peak_bytes"]["mxattn"], rows[1]["peak_bytes"]["mxattn"]
    assert m32 <= 2.2 * m16 + MEM_FIXED, f"peak grows faster than S: {m16 / 2**20:.0f} -> {m32 / 2**20:.0f} MiB"
    out_dir = os.environ.get("MXATTN_RESULTS_DIR")
    if out_dir:
        import triton

        os.makedirs(out_dir, exist_ok=True)
        gpu = torch.cuda.get_device_name()
        path = os.path.join(out_dir, f"memory-{gpu.replace(' ', '_')}-{time.strftime('%Y-%m-%d')}.json")
        doc = {"what": "memory", "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
               "commit": os.environ.get("MXATTN_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"), "rows": []}
        if os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
        doc["rows"] += rows
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


# ---------------------------------------------------------------------------------------------- racecheck reports
def _racecheck_classify():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "racecheck_classify.py"
    spec = importlib.util.spec_from_file_location("racecheck_classify", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line_of(path: Path, needle: str, after: int = 0) -> int:
    for i, line in enumerate(path.read_text().splitlines()[after:], start=after + 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in {path.name}")


def _block_header(path: Path, line_no: int) -> int:
    """The 1-based line of the nearest less-indented line above ``line_no``: the header of the block it sits in."""
    text = path.read_text().splitlines()
    indent = len(text[line_no - 1]) - len(text[line_no - 1].lstrip())
    k = line_no - 2
    while k >= 0 and (not text[k].strip() or len(text[k]) - len(text[k].lstrip()) >= indent):
        k -= 1
    return k + 1


def _hazard(addr: str, kernel: str, write: tuple, read: tuple) -> str:
    return (f"========= Error: Potential RAW hazard detected at __shared__ {addr} in block (0,0,0) :\n"
            f"=========     Write Thread (31,0,0) at {kernel}+0x70d0 in {write[0]}:{write[1]}\n"
            f"=========     Read Thread (160,0,0) at {kernel}+0x130 in {read[0]}:{read[1]}\n"
            f"=========     Current Value : 2\n=========\n")


def test_racecheck_classify_sorts_ws_lowering_from_kernel_lines(tmp_path):
    """scripts/racecheck_classify.py (sanitize.sh's racecheck verdict): a report whose two accesses lie on the lines
    Triton's gl.warp_specialize lowering is attributed to (the kernel's def line, the call and the block header
    around it) is "ws_lowering"; one access on a kernel-body line (an mbarrier wait, a tile) makes it "other" and
    the script fail.  Line numbers are found in the current source, as the GPU run's tree has them."""
    rc = _racecheck_classify()
    src = Path(__file__).resolve().parent.parent / "mxattn" / "kernels" / "attn_bwd_dkdv_gluon.py"
    name, kern = src.name, "_attn_bwd_dkdv_ws_kernel"
    def_line = _line_of(src, f"def {kern}(")
    ws_call = _line_of(src, "gl.warp_specialize(", after=def_line)
    header = _block_header(src, ws_call)  # the `if` / `elif` the first call sits in
    assert def_line < header < ws_call
    body = _line_of(src, "mbarrier.wait(")  # a partition's line: never lowering
    ws_log = (_hazard("0xc5e8", kern, (name, header), (name, def_line))
              + _hazard("0xc5e9", kern, (name, ws_call), (name, def_line))
              + f"========= Error: Race reported between Read access at {kern}+0x130 in {name}:{def_line}\n"
                f"=========     and Write access at {kern}+0x70d0 in {name}:{header} [2 hazards]\n"
              + "========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)\n")
    r = rc.classify(ws_log, rc._Sources([src.parent]))
    assert r["hazards"] == {"ws_lowering": 2} and r["summarised_hazards"] == {"ws_lowering": 2}
    (tmp_path / "ws.log").write_text(ws_log)
    assert rc.main([str(tmp_path / "ws.log")]) == 0

    bad_log = ws_log.replace("RACECHECK SUMMARY: 3", "RACECHECK SUMMARY: 4").replace("(3 errors", "(4 errors") \
        + _hazard("0xc100", kern, (name, body), (name, def_line))
    r = rc.classify(bad_log, rc._Sources([src.parent]))
    assert r["hazards"] == {"ws_lowering": 2, "other": 1} and len(r["other_examples"]) == 1
    (tmp_path / "bad.log").write_text(bad_log)
    assert rc.main([str(tmp_path / "bad.log")]) == 1
    # reports cut by --print-limit cannot be cleared
    cut = ws_log.replace("(3 errors", "(176 errors")
    (tmp_path / "cut.log").write_text(cut)
    assert rc.main([str(tmp_path / "cut.log")]) == 1
