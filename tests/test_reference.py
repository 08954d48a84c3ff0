"""The reference attention (mxattn.reference) against plain fp64 PyTorch and autograd."""

import math

import pytest
import torch

from mxattn import reference as R
from mxattn.formats import quantize_mxfp8, round_to_e4m3
from mxattn.reference import attention_backward, attention_forward, cosine, max_rel_error, sqnr_db

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def mx_qkv(gen, q_shape, k_shape, dv=None, seq_dim=1):
    """Gaussian Q, K (MX along the head dim) and V (MX along the sequence, dim ``seq_dim``)."""
    v_shape = k_shape[:-1] + (dv or k_shape[-1],)
    q, k, v = (torch.randn(s, generator=gen) for s in (q_shape, k_shape, v_shape))
    return quantize_mxfp8(q), quantize_mxfp8(k), quantize_mxfp8(v, dim=seq_dim)


def deq(*ts):
    return [t.dequantize(F64) for t in ts]


def naive(q, k, v, causal=False, scale=None):
    """fp64 torch.softmax(q k^T * scale) v on (B, S, H, D) with GQA and a bottom-right causal mask.

    Rows that see no key give out 0 and lse -inf; the mask keeps autograd free of NaN."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = torch.ones(Sq, Sk, dtype=torch.bool).tril(Sk - Sq) if causal else torch.ones(Sq, Sk, dtype=torch.bool)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    any_row = visible.any(-1, keepdim=True)
    p = torch.softmax(torch.where(any_row, s, torch.zeros_like(s)), dim=-1) * any_row
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def naive_packed(q, k, v, cu_q, cu_k, causal=False):
    outs, lses = [], []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        o, l = naive(q[None, a:b], k[None, c:d], v[None, c:d], causal)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def assert_rel(actual, expected, tol, floor=1e-14, what=""):
    """max |a - e| <= tol * max|e| + floor, with the worst index in the message."""
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    bound = tol * float(e.abs().max()) + floor if e.numel() else floor
    worst = int(err.argmax()) if err.numel() else 0
    assert err.numel() == 0 or float(err.max()) <= bound, (
        f"{what}: max err {float(err.max()):.3g} at flat index {worst} > {bound:.3g} "
        f"(rel {max_rel_error(a, e):.3g}, sqnr {sqnr_db(a, e):.1f} dB)"
    )


def autograd_grads(qm, km, vm, dout, fn):
    q, k, v = (t.requires_grad_() for t in deq(qm, km, vm))
    out, _ = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


SHAPES = [(1, 1), (113, 203), (239, 1), (64, 64)]
HEADS = [(2, 2), (4, 1), (6, 2)]


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_forward_matches_softmax(sq, sk, causal, heads, gen):
    hq, hkv = heads
    qm, km, vm = mx_qkv(gen, (2, sq, hq, 48), (2, sk, hkv, 48), dv=40)
    out, lse = attention_forward(qm, km, vm, causal=causal)
    want, want_lse = naive(*deq(qm, km, vm), causal)
    assert out.dtype == F64 and out.shape == (2, sq, hq, 40) and lse.shape == (2, hq, sq)
    assert_rel(out, want, 1e-12, what="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert_rel(lse[fin], want_lse[fin], 1e-12, what="lse")


def test_forward_softmax_scale_and_fp32(gen):
    qm, km, vm = mx_qkv(gen, (1, 70, 2, 64), (1, 90, 2, 64))
    want, want_lse = naive(*deq(qm, km, vm), True, scale=0.3)
    out, lse = attention_forward(qm, km, vm, causal=True, softmax_scale=0.3)
    assert_rel(out, want, 1e-12, what="out")
    out32, lse32 = attention_forward(qm, km, vm, causal=True, softmax_scale=0.3, dtype=torch.float32)
    assert out32.dtype == lse32.dtype == torch.float32
    assert_rel(out32, want, 1e-5, what="out fp32")
    assert_rel(lse32, lse, 1e-5, what="lse fp32")
    # plain float inputs are accepted as well
    out_f, _ = attention_forward(*deq(qm, km, vm), causal=True, softmax_scale=0.3)
    assert torch.equal(out_f, out)


def test_rows_that_see_nothing(gen):
    qm, km, vm = mx_qkv(gen, (1, 239, 2, 32), (1, 1, 2, 32))
    out, lse = attention_forward(qm, km, vm, causal=True)
    assert (out[:, :238] == 0).all() and torch.isneginf(lse[..., :238]).all()
    v = vm.dequantize(F64)
    assert_rel(out[:, 238], v[:, 0], 1e-15, what="last row sees the one key")
    assert torch.isfinite(lse[..., 238]).all()
    # no keys at all
    q = qm.dequantize(F64)
    out0, lse0 = attention_forward(q, q[:, :0], q[:, :0])
    assert out0.shape == q.shape and (out0 == 0).all() and torch.isneginf(lse0).all()


PACKED_Q = [5, 0, 1, 40, 17, 3, 0]
PACKED_K = [7, 3, 1, 40, 0, 70, 0]


@pytest.mark.parametrize("causal", [False, True])
def test_forward_packed(causal, gen):
    cq, ck = cu(PACKED_Q), cu(PACKED_K)
    qm, km, vm = mx_qkv(gen, (int(cq[-1]), 4, 64), (int(ck[-1]), 2, 64), seq_dim=0)
    out, lse = attention_forward(qm, km, vm, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck)
    want, want_lse = naive_packed(*deq(qm, km, vm), cq, ck, causal)
    assert out.shape == (int(cq[-1]), 4, 64) and lse.shape == (4, int(cq[-1]))
    assert_rel(out, want, 1e-12, what="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert_rel(lse[fin], want_lse[fin], 1e-12, what="lse")


def test_quantize_p_forward(gen):
    """P in e4m3 with constant scale 2^-8: DESIGN §2 measures ~32 dB against exact-MX attention at
    S=2048; at S=512 it lands in the same band."""
    qm, km, vm = mx_qkv(gen, (1, 512, 2, 128), (1, 512, 2, 128))
    exact, lse = attention_forward(qm, km, vm)
    approx, lse_p = attention_forward(qm, km, vm, quantize_p=True)
    snr = sqnr_db(approx, exact)
    assert 25 <= snr <= 40, snr
    assert cosine(approx, exact) > 0.999
    # each P~ element is within 2^-4 relative of exact, so is their sum: |d lse| <= -log(1 - 2^-4)
    assert float((lse_p - lse).abs().max()) <= -math.log(1 - 2.0**-4)


@pytest.mark.parametrize("causal", [False, True])
def test_quantize_p_rows_sum_to_one(causal, gen):
    qm, km, _ = mx_qkv(gen, (2, 37, 2, 64), (2, 64, 1, 64))
    ones = torch.ones(2, 64, 1, 8, dtype=F64)
    out, _ = attention_forward(qm, km, ones, causal=causal, quantize_p=True)
    assert_rel(out, torch.ones_like(out), 1e-14, what="sum P~ / l")
    # with V = identity, out = P~ / l: rescaled so the max is 256, every entry is on the e4m3 grid
    eye = torch.eye(64, dtype=F64)[None, :, None, :].expand(2, 64, 1, 64)
    p, _ = attention_forward(qm, km, eye, causal=causal, quantize_p=True)
    p = p * (256 / p.amax(dim=-1, keepdim=True))
    assert_rel(p, round_to_e4m3(p).double(), 1e-13, what="P~ on the e4m3 grid")


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


def check_grads(got, want, tol=1e-10):
    """Relative to each gradient's max, with an fp64 rounding floor for gradients that are exactly
    zero in truth (Sk = 1: every dS row is P (dP - D) = 1 * (dP - dP))."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == F64, name
        assert_rel(g, w, tol, floor=1e-12, what=name)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}-{h[1]}")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES + [(97, 61)])
def test_backward_matches_autograd(sq, sk, causal, heads, gen):
    hq, hkv = heads
    qm, km, vm = mx_qkv(gen, (2, sq, hq, 64), (2, sk, hkv, 64))
    out, _ = attention_forward(qm, km, vm, causal=causal)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    want = autograd_grads(qm, km, vm, dout, lambda q, k, v: naive(q, k, v, causal))
    check_grads(attention_backward(qm, km, vm, out, dout, causal=causal), want)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_packed(causal, gen):
    cq, ck = cu(PACKED_Q), cu(PACKED_K)
    qm, km, vm = mx_qkv(gen, (int(cq[-1]), 4, 32), (int(ck[-1]), 1, 32), seq_dim=0)
    kw = dict(causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, _ = attention_forward(qm, km, vm, **kw)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    want = autograd_grads(qm, km, vm, dout, lambda q, k, v: naive_packed(q, k, v, cq, ck, causal))
    check_grads(attention_backward(qm, km, vm, out, dout, **kw), want)


def _emulation_inputs(gen, shape=(1, 256, 2, 64), spread=0):
    """Q, K (hdim), V (seq) and the other orientations the FP8 backward reads (Q, K seq; V hdim).

    Gaussian times 2^u, u uniform in [-spread, 0].  With spread 0 both orientations usually give the
    same values: e4m3 is floating point, so the block exponent only matters for values it pushes into
    subnormals (or saturation), which needs magnitudes varying within a row or column."""
    q, k, v = (torch.randn(shape, generator=gen) * 2.0 ** -torch.randint(0, spread + 1, shape, generator=gen)
               for _ in range(3))
    mx = dict(q=quantize_mxfp8(q), k=quantize_mxfp8(k), v=quantize_mxfp8(v, dim=1))
    other = dict(q_seq=quantize_mxfp8(q, dim=1), k_seq=quantize_mxfp8(k, dim=1), v_hdim=quantize_mxfp8(v))
    return mx, other


SWITCHES = {
    "p": dict(quantize_p=True),
    "do": dict(quantize_do=True),
    "ds": dict(quantize_ds=True),
    "all": dict(quantize_p=True, quantize_do=True, quantize_ds=True),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("switch", SWITCHES)
def test_backward_emulation(switch, causal, gen):
    """Each switch degrades only the gradients it feeds, to tens of dB (DESIGN §2: full FP8
    backward 23.6-24.8 dB against fp64 on the original inputs, 25-29 dB of it from MX inputs)."""
    mx, other = _emulation_inputs(gen)
    out, _ = attention_forward(**mx, causal=causal)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    exact = attention_backward(**mx, out=out, dout=dout, causal=causal)
    extra = other if switch == "all" else {}
    got = attention_backward(**mx, out=out, dout=dout, causal=causal, **SWITCHES[switch], **extra)
    touched = {"p": {"dv"}, "do": {"dq", "dk", "dv"}, "ds": {"dq", "dk"}, "all": {"dq", "dk", "dv"}}[switch]
    for name, g, e in zip(("dq", "dk", "dv"), got, exact):
        assert torch.isfinite(g).all(), name
        snr = sqnr_db(g, e)
        if name in touched:
            assert 20 <= snr <= 45, f"{name}: {snr:.1f} dB"
        else:
            assert snr == math.inf, f"{name} must not change: {snr:.1f} dB"


@pytest.mark.parametrize("causal", [False, True])
def test_quantize_do_is_the_gradient_of_quantized_do(causal, gen):
    """quantize_do: dQ, dK are the exact gradients for dO quantized along the head dim (dP and D
    use the same dO), dV the exact one for dO quantized along the sequence."""
    mx, _ = _emulation_inputs(gen, (2, 70, 2, 64), spread=6)
    out, _ = attention_forward(**mx, causal=causal)
    dout = torch.randn(out.shape, generator=gen, dtype=F64) * 2.0 ** -torch.randint(0, 7, out.shape, generator=gen)
    dq, dk, dv = attention_backward(**mx, out=out, dout=dout, causal=causal, quantize_do=True)
    dq_h, dk_h, _ = attention_backward(**mx, out=out, dout=quantize_mxfp8(dout, -1).dequantize(F64), causal=causal)
    _, _, dv_s = attention_backward(**mx, out=out, dout=quantize_mxfp8(dout, 1).dequantize(F64), causal=causal)
    assert_rel(dq, dq_h, 1e-13, what="dq")
    assert_rel(dk, dk_h, 1e-13, what="dk")
    assert_rel(dv, dv_s, 1e-13, what="dv")


def test_quantize_ds_orientations(gen):
    """quantize_ds: dQ = scale * MX_kv(dS) K and dK = scale * MX_q(dS)^T Q, dS = P * (dP - D)
    unscaled, with MX along the contraction dim of each product."""
    mx, _ = _emulation_inputs(gen, (1, 90, 1, 64))
    scale = 0.125
    out, _ = attention_forward(**mx, softmax_scale=scale)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dq, dk, _ = attention_backward(**mx, out=out, dout=dout, softmax_scale=scale, quantize_ds=True)
    q, k, v = (t[0, :, 0] for t in deq(mx["q"], mx["k"], mx["v"]))
    o, do = out[0, :, 0], dout[0, :, 0]
    p = torch.softmax(q @ k.T * scale, dim=-1)
    ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))
    assert_rel(dq[0, :, 0], scale * quantize_mxfp8(ds, -1).dequantize(F64) @ k, 1e-12, what="dq")
    assert_rel(dk[0, :, 0], scale * quantize_mxfp8(ds, 0).dequantize(F64).T @ q, 1e-12, what="dk")


def test_block_roundtrip_is_mx_at_32_blocks(gen):
    """``_block_roundtrip(x, dim, 32)`` is ``_mx_roundtrip`` bit for bit (its general path: saturation, subnormals,
    zero, NaN and Inf blocks, a partial last block, fp32 and fp64), so any other block length is the same
    arithmetic with other blocks."""
    x = torch.randn(70, 3, generator=gen, dtype=F64) * 2.0 ** torch.randint(-20, 12, (70, 3), generator=gen)
    x[0:32, 0] = 0.0
    x[40, 1] = math.inf
    x[33, 2] = math.nan
    x[65, 2] = 1e-45  # below every e4m3 subnormal of its block
    for t in (x, x.float()):
        for dim in (0, 1):
            a, b = R._block_roundtrip(t, dim, 32), R._mx_roundtrip(t, dim)
            assert a.dtype == t.dtype and torch.equal(a.isnan(), b.isnan())
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), (t.dtype, dim)


def _per_key_tiles(ds: torch.Tensor, n: int) -> torch.Tensor:
    """dS (Sq, Sk) with one RCEIL power of two per key per n queries from query 0, written out per block."""
    out = torch.empty_like(ds)
    for r0 in range(0, ds.shape[0], n):
        blk = ds[r0 : r0 + n].float()
        amax = blk.abs().amax(0).double()
        fl = torch.floor(torch.log2(amax))
        e = fl - 8 + (amax / torch.exp2(fl) > 1.75).double()  # RCEIL: the smallest e with amax / 2^e <= 448
        e = torch.where(amax > 0, e, torch.zeros_like(e))
        out[r0 : r0 + n] = round_to_e4m3(blk * torch.exp2(-e).float()).double() * torch.exp2(e)
    return out


@pytest.mark.parametrize("n", [64, 48])
def test_quantize_ds_q_block(n, gen):
    """ds_q_block=n: dK = scale * Q_n(dS)^T Q with one power of two per key per n queries (blocks from query 0, the
    last one partial: Sq = 150), written out block by block here; dQ is untouched (MX along kv); the default is
    MX (n = 32), and a coarser block loses accuracy only where it pushes values into subnormals: dO rows 32-63 and
    96-127 are 2^-20 of the others, so in 64-query blocks their dS flush to zero or subnormals, in 32-query blocks
    they keep their own exponent (the two give different dK, the same SQNR to 1 dB: those rows are ~nothing)."""
    mx, _ = _emulation_inputs(gen, (1, 150, 1, 64), spread=6)
    scale = 0.125
    out, _ = attention_forward(**mx, softmax_scale=scale)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dout[:, 32:64] *= 2.0**-20
    dout[:, 96:128] *= 2.0**-20
    dq, dk, dv = attention_backward(**mx, out=out, dout=dout, softmax_scale=scale, quantize_ds=True, ds_q_block=n)
    dq32, dk32, dv32 = attention_backward(**mx, out=out, dout=dout, softmax_scale=scale, quantize_ds=True)
    q, k, v = (t[0, :, 0] for t in deq(mx["q"], mx["k"], mx["v"]))
    o, do = out[0, :, 0], dout[0, :, 0]
    p = torch.softmax(q @ k.T * scale, dim=-1)
    ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))
    assert_rel(dk[0, :, 0], scale * _per_key_tiles(ds, n).T @ q, 1e-12, what="dk")
    assert torch.equal(dq, dq32) and torch.equal(dv, dv32)
    assert not torch.equal(dk, dk32)
    exact = attention_backward(**mx, out=out, dout=dout, softmax_scale=scale)[1]
    assert abs(sqnr_db(dk, exact) - sqnr_db(dk32, exact)) < 1.0


def test_quantize_ds_q_block_per_sequence(gen):
    """Packed sequences: dK's dS blocks along q start at each sequence's first query (as the kernels' query
    tiles do), so the packed result is the per-sequence results side by side; chunking the query rows (chunk
    starts on multiples of lcm(32, n)) changes nothing."""
    cq, ck = cu([70, 0, 131]), cu([90, 5, 85])  # the middle sequence has keys and no query
    qm, km, vm = mx_qkv(gen, (201, 2, 32), (180, 1, 32), seq_dim=0)
    kw = dict(quantize_p=True, quantize_ds=True, quantize_do=True, ds_q_block=48)
    out, _ = attention_forward(qm, km, vm, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    packed = attention_backward(qm, km, vm, out, dout, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    q, k, v = deq(qm, km, vm)
    for a, b, c, d in ((0, 70, 0, 90), (70, 201, 95, 180)):
        one = attention_backward(q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b], dout[None, a:b],
                                 causal=True, **kw)
        for x, y in zip(one, (packed[0][a:b], packed[1][c:d], packed[2][c:d])):
            assert torch.equal(x[0], y)
    assert (packed[1][90:95] == 0).all()  # the empty sequence's keys


def test_quantize_ds_q_block_chunking(gen, monkeypatch):
    """Chunks of query rows align to lcm(32, ds_q_block): 48-query blocks give the same gradients with 96-row
    chunks as with one chunk (a 32-row chunking would cut blocks in two)."""
    mx, other = _emulation_inputs(gen, (1, 200, 2, 64), spread=6)
    kw = dict(causal=True, quantize_p=True, quantize_do=True, quantize_ds=True, ds_q_block=48, **other)
    out, _ = attention_forward(**mx, causal=True, quantize_p=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    whole = attention_backward(**mx, out=out, dout=dout, **kw)
    monkeypatch.setattr(R, "_CHUNK_ELEMENTS", 1)
    assert R._row_chunks(200, 200, 96) == [(0, 96), (96, 192), (192, 200)]
    for name, a, b in zip(("dq", "dk", "dv"), attention_backward(**mx, out=out, dout=dout, **kw), whole):
        assert sqnr_db(a, b) > 120, name


@pytest.mark.parametrize("bad", [0, -64, 1.5, True, "64"])
def test_quantize_ds_q_block_rejects(bad, gen):
    mx, _ = _emulation_inputs(gen, (1, 8, 1, 32))
    out, _ = attention_forward(**mx)
    with pytest.raises(ValueError, match="ds_q_block"):
        attention_backward(**mx, out=out, dout=out, quantize_ds=True, ds_q_block=bad)


def test_backward_operand_overrides(gen):
    """q_seq feeds only dK, k_seq only dQ, v_hdim only dP (so dQ and dK, not dV)."""
    mx, other = _emulation_inputs(gen, (1, 80, 2, 32), spread=10)
    out, _ = attention_forward(**mx, causal=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    base = attention_backward(**mx, out=out, dout=dout, causal=True)
    for key, changed in (("q_seq", {1}), ("k_seq", {0}), ("v_hdim", {0, 1})):
        got = attention_backward(**mx, out=out, dout=dout, causal=True, **{key: other[key]})
        for i in range(3):
            assert torch.equal(got[i], base[i]) != (i in changed), (key, i)
    zero = torch.zeros(mx["q"].shape, dtype=F64)
    _, dk, _ = attention_backward(**mx, out=out, dout=dout, causal=True, q_seq=zero)
    assert (dk == 0).all()


def test_chunking_does_not_change_results(gen, monkeypatch):
    """Small chunks (32 query rows) give the same results as one chunk, switches included."""
    mx, other = _emulation_inputs(gen, (1, 150, 2, 64))
    kw = dict(causal=True, quantize_p=True, quantize_do=True, quantize_ds=True, **other)
    out, lse = attention_forward(**mx, causal=True, quantize_p=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    grads = attention_backward(**mx, out=out, dout=dout, **kw)
    monkeypatch.setattr(R, "_CHUNK_ELEMENTS", 1)
    assert len(R._row_chunks(150, 150)) == 5
    out2, lse2 = attention_forward(**mx, causal=True, quantize_p=True)
    assert_rel(out2, out, 1e-13, what="out")
    assert_rel(lse2, lse, 1e-13, what="lse")
    for name, a, b in zip(("dq", "dk", "dv"), attention_backward(**mx, out=out, dout=dout, **kw), grads):
        assert sqnr_db(a, b) > 120, name


# ----------------------------------------------------------------------------------------------
# metrics and input checks
# ----------------------------------------------------------------------------------------------


def test_metrics():
    e = torch.ones(100)
    a = e + 0.1
    assert sqnr_db(a, e) == pytest.approx(20.0)
    assert sqnr_db(e, e) == math.inf
    assert math.isnan(sqnr_db(torch.full((3,), math.nan), torch.ones(3)))
    assert math.isnan(sqnr_db(torch.ones(3), torch.tensor([1.0, math.nan, 1.0])))
    assert cosine(a, e) == pytest.approx(1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == 0.0
    assert cosine(torch.zeros(2), torch.zeros(2)) == 1.0
    assert max_rel_error(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])) == pytest.approx(0.25)
    assert max_rel_error(e, e) == 0.0
    with pytest.raises(ValueError):
        sqnr_db(torch.ones(2), torch.ones(3))


def test_input_checks(gen):
    qm, km, vm = mx_qkv(gen, (1, 8, 3, 32), (1, 8, 2, 32))
    with pytest.raises(ValueError, match="multiple"):
        attention_forward(qm, km, vm)
    q, k, v = deq(*mx_qkv(gen, (10, 2, 32), (10, 2, 32), seq_dim=0))
    good = cu([4, 6])
    with pytest.raises(ValueError):
        attention_forward(q, k, v, cu_seqlens_q=good)
    with pytest.raises(ValueError):
        attention_forward(q, k, v, cu_seqlens_q=good, cu_seqlens_k=good.long())
    with pytest.raises(ValueError):
        attention_forward(q, k, v, cu_seqlens_q=cu([4, 5]), cu_seqlens_k=good)
    with pytest.raises(ValueError):
        attention_forward(q, k, v, cu_seqlens_q=good, cu_seqlens_k=good, dtype=torch.float16)
    with pytest.raises(ValueError):
        attention_backward(q, k, v, q[:5], q, cu_seqlens_q=good, cu_seqlens_k=good)


@pytest.mark.gpu
def test_cuda_matches_cpu(gen):
    qm, km, vm = mx_qkv(gen, (2, 100, 4, 64), (2, 130, 2, 64))
    out, lse = attention_forward(qm, km, vm, causal=True)
    out_c, lse_c = attention_forward(qm.to("cuda"), km.to("cuda"), vm.to("cuda"), causal=True)
    assert out_c.is_cuda and lse_c.is_cuda
    assert_rel(out_c.cpu(), out, 1e-12, what="out")
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    for a, b in zip(attention_backward(qm.to("cuda"), km.to("cuda"), vm.to("cuda"), out_c, dout.cuda(), causal=True),
                    attention_backward(qm, km, vm, out, dout, causal=True)):
        assert_rel(a.cpu(), b, 1e-12)
