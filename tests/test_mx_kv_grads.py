"""dK / dV as MXFP8 from the backward (``mxfp8_attn_func(..., mx_kv_grads=MXKVGrads(...))``, issue 5): the sink
holds ``quantize_mxfp8`` of the backward's fp32 gradients, k / v get no float gradient unless asked, dq is the
plain call's.  CPU: the reference backward; GPU (marker ``gpu``): the FP8 kernels and the Triton quantizer."""

from __future__ import annotations

import math

import pytest
import torch

from mxattn import MXKVGrads, MXTensor, formats, interface, reference
from mxattn.interface import mxfp8_attn_func

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device, seed, B=2, Sq=40, Sk=56, Hq=4, Hkv=2, D=64):
    g = torch.Generator().manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
    q, k, v = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv)
    return q, k, v, torch.randn(B, Sq, Hq, D, generator=g).to(device=device, dtype=torch.bfloat16)


def _backward(q, k, v, dout, causal, sink=None):
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = mxfp8_attn_func(qg, kg, vg, causal=causal, mx_kv_grads=sink)
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


def _fp32_grads(q, k, v, dout, out, causal):
    """The backward's fp32 gradients, straight from the implementation the autograd function calls."""
    scale = q.shape[-1] ** -0.5
    fwd_out, lse = interface._fwd_impl(q, k, v, causal, scale, "rceil", "auto")
    assert torch.equal(fwd_out, out)
    return interface._bwd_impl(dout, q, k, v, out, lse, causal, scale, "rceil", False, grad_dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("orientations", ["seq", "hdim", "both"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sink_holds_the_quantized_fp32_gradients(device, orientations, causal, seed):
    q, k, v, dout = _inputs(device, seed)
    sink = MXKVGrads(orientations)
    out, dq, dk, dv = _backward(q, k, v, dout, causal, sink)
    assert dk is None and dv is None, "k and v must get no float gradient without keep_float_grads"
    _, dk32, dv32 = _fp32_grads(q, k, v, dout, out, causal)
    dims = {"seq": (1,), "hdim": (3,), "both": (3, 1)}[orientations]
    for name, got, g32 in (("dk", sink.dk, dk32), ("dv", sink.dv, dv32)):
        parts = got if orientations == "both" else (got,)
        assert len(parts) == len(dims)
        for part, dim in zip(parts, dims):
            assert isinstance(part, MXTensor) and part.dim == dim and tuple(part.shape) == tuple(k.shape), name
            want = formats.quantize_mxfp8(g32, dim=dim)
            assert torch.equal(part.dequantize(), want.dequantize()), f"{name} (dim {dim}) is not the quantized fp32 grad"


@pytest.mark.parametrize("device", DEVICES)
def test_dq_and_kept_float_grads_are_the_plain_call_s(device, seed):
    q, k, v, dout = _inputs(device, seed)
    _, dq0, dk0, dv0 = _backward(q, k, v, dout, True)
    sink = MXKVGrads("seq", keep_float_grads=True)
    _, dq1, dk1, dv1 = _backward(q, k, v, dout, True, sink)
    _, dq2, dk2, dv2 = _backward(q, k, v, dout, True, MXKVGrads("seq"))
    for a, b in ((dq0, dq1), (dq0, dq2), (dk0, dk1), (dv0, dv1)):
        assert a.dtype == b.dtype == torch.bfloat16
        if device == "cpu":  # the same fp32 values rounded once to bf16 either way
            assert torch.equal(a, b)
        else:  # the kernels store bf16 directly or fp32 (cast afterwards): at most one bf16 ulp apart
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
    assert sink.dk is not None and sink.dv is not None


@pytest.mark.parametrize("device", DEVICES)
def test_mx_grads_are_as_accurate_as_the_bf16_ones(device, seed):
    """Against fp64 gradients on the MX-dequantized inputs, the sink's dK / dV carry the bf16 gradients' error
    plus their own e4m3 rounding (~31 dB alone), as independent noise powers add, to within 0.5 dB."""
    q, k, v, dout = _inputs(device, seed, B=1, Sq=96, Sk=128, Hq=2, Hkv=1)
    out, _, dk_bf, dv_bf = _backward(q, k, v, dout, False)
    sink = MXKVGrads("seq")
    _backward(q, k, v, dout, False, sink)
    qm, km, vm = (formats.quantize_mxfp8(t, d) for t, d in ((q, 3), (k, 3), (v, 1)))
    extra = dict(q_seq=formats.quantize_mxfp8(q, 1), k_seq=formats.quantize_mxfp8(k, 1),
                 v_hdim=formats.quantize_mxfp8(v, 3))
    _, dk_t, dv_t = reference.attention_backward(qm, km, vm, out, dout, causal=False, **extra)
    for name, mx, bf, t in (("dk", sink.dk, dk_bf, dk_t), ("dv", sink.dv, dv_bf, dv_t)):
        s_mx = reference.sqnr_db(mx.dequantize().double().cpu(), t.cpu())
        s_bf = reference.sqnr_db(bf.double().cpu(), t.cpu())
        s_q = reference.sqnr_db(formats.quantize_mxfp8(bf, dim=1).dequantize().double().cpu(), bf.double().cpu())
        want = -10 * math.log10(10 ** (-s_bf / 10) + 10 ** (-s_q / 10))
        assert s_mx >= want - 0.5, f"{name}: MX {s_mx:.2f} dB vs bf16 {s_bf:.2f} dB + e4m3 {s_q:.2f} dB ({want:.2f})"


def test_gqa_sums_over_the_group_and_a_second_backward_overwrites(seed):
    q, k, v, dout = _inputs("cpu", seed, Hq=6, Hkv=2)
    sink = MXKVGrads("hdim", keep_float_grads=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = mxfp8_attn_func(qg, kg, vg, mx_kv_grads=sink)
    out.backward(dout, retain_graph=True)
    first = sink.dk.dequantize().clone()
    _, dk32, _ = _fp32_grads(q, k, v, dout, out.detach(), False)
    assert tuple(dk32.shape) == tuple(k.shape)  # (B, Sk, Hkv, D): summed over the 3 query heads of each group
    assert torch.equal(first, formats.quantize_mxfp8(dk32, dim=3).dequantize())
    assert torch.equal(kg.grad, dk32.to(torch.bfloat16))
    out.backward(2 * dout)
    assert torch.equal(sink.dk.dequantize(), 2 * first)  # a power-of-two factor moves only the exponents


def test_sink_stays_empty_without_a_backward(seed):
    q, k, v, _ = _inputs("cpu", seed)
    sink = MXKVGrads()
    with torch.no_grad():
        mxfp8_attn_func(q, k, v, mx_kv_grads=sink)
    mxfp8_attn_func(q, k, v, mx_kv_grads=sink)  # nothing needs grad
    assert sink.dk is None and sink.dv is None and "empty" in repr(sink)
    sink.dk = 1
    sink.clear()
    assert sink.dk is None


def test_producer_mx_inputs_fill_the_sink(seed):
    """q, k, v from ``qkv_proj`` on an input that needs grad: the sink is filled and x still gets dQ's share."""
    from mxattn.qkv import qkv_proj

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 40, 64, generator=g).requires_grad_()
    W = torch.randn(4 * 64, 64, generator=g) * 64 ** -0.5
    q, k, v = qkv_proj(x, W, n_heads=2, n_kv_heads=1, head_dim=64)
    sink = MXKVGrads("seq")
    mxfp8_attn_func(q, k, v, causal=True, mx_kv_grads=sink).float().sum().backward()
    assert sink.dk is not None and tuple(sink.dk.shape) == (1, 40, 1, 64) and sink.dk.dim == 1
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(orientations="keys"), ValueError, "orientations"),
    (dict(scale_mode="nearest"), ValueError, "scale_mode"),
    (dict(keep_float_grads=1), TypeError, "keep_float_grads"),
])
def test_bad_sink_arguments_are_refused(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        MXKVGrads(**kwargs)


def test_a_sink_of_the_wrong_type_is_refused_before_any_work(seed):
    q, k, v, _ = _inputs("cpu", seed)
    with pytest.raises(TypeError, match="mx_kv_grads must be an mxattn.MXKVGrads"):
        mxfp8_attn_func(q, k, v, mx_kv_grads={"dk": None})


def test_under_torch_compile_a_sink_is_refused(seed, monkeypatch):
    q, k, v, _ = _inputs("cpu", seed)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="not supported under torch.compile"):
        mxfp8_attn_func(q.requires_grad_(), k, v, mx_kv_grads=MXKVGrads())
