"""The Hopper FP8 attention backward against the reference (DESIGN §2 calibrated bound).

A gradient passes when its error against fp64 exact gradients on the MX-dequantized inputs is no worse than
``reference.attention_backward``'s emulation of the same low-precision steps (P, dS, dO quantized; Q, K along the
sequence and V along the head dim for their products) by more than 0.5 dB, plus a floor of bf16 output rounding.
A second, tighter check compares the kernel with ``_emulate``: the kernel's own arithmetic (row-scaled operands,
dS scales per key / query tile) in fp64, so that a bug cannot hide inside the 0.5 dB.
CPU: the ``tl`` kernels under TRITON_INTERPRET=1 at tiny shapes.  GPU (marker ``gpu``): issue-5 shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import require_kernels

from mxattn import formats, reference
from mxattn.formats import mx_block_exponents, round_to_e4m3

MARGIN_DB = 0.5
BF16_FLOOR = 2.0**-8  # relative error norm floor: the gradients are rounded to bf16
# Kernel against its own fp64 emulation: ~49 dB under the interpreter (bf16 output rounding); on the GPU the FP8
# tensor cores also accumulate with ~14 mantissa bits (DeepSeek-V3 report §3.3.2), which the emulation lacks.
EMUL_MIN_DB = 35.0 if torch.cuda.is_available() else 45.0
GRADS = ("dq", "dk", "dv")


FLIP_ROW_ERR = 2.0**-2  # largest relative error of a row set aside as a rounding flip (see emulation_close)


def emulation_close(g, o, min_db: float, floor: float) -> tuple[bool, str]:
    """Kernel ``g`` against its own emulation ``o``: ``|g - o| <= 10^(-min_db/20) |o| + floor`` over all rows but
    the worst 1% (at least one), each of which must still be within ``FLIP_ROW_ERR`` of its row.

    The emulation rounds in fp64 and the kernel in fp32 (wgmma: ~14 bits), so a P or dS value (or a block's largest,
    which sets its exponent) that lies within that difference of an e4m3 rounding point rounds the other way: one
    FP8 element (or block) moves by one ulp (2^-3 of it). Over a long row that is lost in the bf16 rounding; over a
    row of 31 keys it is a few percent of that row, which alone would cost the whole tensor ~1 dB (seen in CI: one
    row of dq at 6%, 44.5 dB against 45). ``floor`` is the tensor's absolute error-norm floor.
    """
    D = g.shape[-1] if g.dim() else 1
    d, on = (g - o).reshape(-1, D), o.reshape(-1, D)
    err, norm = d.norm(dim=1), on.norm(dim=1)
    rows = err.numel()
    row_floor = floor * math.sqrt(D / max(g.numel(), 1))
    worst = err.topk(min(rows, max(1, rows // 100))).indices if rows else err.new_zeros(0, dtype=torch.long)
    rest = torch.ones(rows, dtype=torch.bool)
    rest[worst] = False
    flips_ok = bool((err[worst] <= FLIP_ROW_ERR * norm[worst] + row_floor).all())
    rest_err = err[rest].pow(2).sum().sqrt().item()
    ok = flips_ok and rest_err <= 10 ** (-min_db / 20) * o.norm().item() + floor
    worst_rel = (err[worst] / norm[worst].clamp_min(1e-300)).max().item() if rows else 0.0
    return ok, f"own emulation without the worst {worst.numel()} rows: err {rest_err:.3g}; worst row {worst_rel:.3g}"


def _bwd():
    from mxattn.kernels import attn_bwd

    return attn_bwd


# ---------------------------------------------------------------- operands and expectations


def _operands(q, k, v, on_gpu: bool, q_rows: int = 128):
    """Forward MX tensors, the reference's backward orientations, and the kernel's row-scaled operands (q with one
    exponent per ``q_rows`` rows: 128 is the fast layout, 1 the forward's)."""
    mx = dict(
        q=formats.quantize_mxfp8(q, 3), k=formats.quantize_mxfp8(k, 3), v=formats.quantize_mxfp8(v, 1),
        q_seq=formats.quantize_mxfp8(q, 1), k_seq=formats.quantize_mxfp8(k, 1), v_hdim=formats.quantize_mxfp8(v, 3),
    )
    if on_gpu:
        from mxattn.kernels.quantize import row_scaled_triton as rs

        qr = rs(q, "q") if q_rows == 1 else rs(q, "k", k_group=q_rows)
        ops = dict(q=qr, k=rs(k, "k"), v_hdim=rs(v, "k"), q_seq=rs(q, "v"), k_seq=rs(k, "v"))
    else:  # the torch twins (bit-exact with the Triton producers, tests/test_quantize_kernels.py): faster here
        seq = lambda x: _channel_major_rs(formats.row_scaled_from_float(x, 1))
        ops = dict(
            q=formats.row_scaled_from_float(q, -1, **({} if q_rows == 1 else dict(group_dim=1, group=q_rows))),
            k=formats.row_scaled_from_float(k, -1, group_dim=1, group=128),
            v_hdim=formats.row_scaled_from_float(v, -1, group_dim=1, group=128),
            q_seq=seq(q), k_seq=seq(k),
        )
    return mx, ops


def _channel_major_rs(t: formats.RowScaledFP8) -> formats.RowScaledFP8:
    return formats.RowScaledFP8(formats.channel_major(t.data), t.exp, t.dim)


def _block_quant(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """e4m3 with one RCEIL power of two per n consecutive elements along ``dim`` (blocks from 0)."""
    x = x.movedim(dim, -1)
    L = x.shape[-1]
    xp = torch.nn.functional.pad(x, (0, (-L) % n)).reshape(*x.shape[:-1], -1, n)
    e = mx_block_exponents(xp.abs().amax(-1, keepdim=True).float()).to(x.dtype)
    qv = round_to_e4m3(xp * torch.exp2(-e)).to(x.dtype) * torch.exp2(e)
    return qv.reshape(*x.shape[:-1], -1)[..., :L].movedim(-1, dim)


def _tile_exps(x: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """RCEIL exponent of each (bm, bn) tile of a 2-D tensor (int64; a huge negative sentinel for zero tiles)."""
    Sq, Sk = x.shape
    xp = torch.nn.functional.pad(x, (0, (-Sk) % bn, 0, (-Sq) % bm))
    amax = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn).abs().amax((1, 3))
    e = mx_block_exponents(amax.float()).long()
    return torch.where(amax > 0, e, torch.full_like(e, _ZERO_TILE))


_ZERO_TILE = -(1 << 40)


def _sticky(e_tile: int, e_prev: int, hyst: int) -> int:
    """attn_bwd._sticky_exp: keep the running exponent unless the tile needs more or is hyst binades smaller."""
    if e_tile == _ZERO_TILE or e_prev - hyst <= e_tile <= e_prev:
        return e_prev
    return e_tile


def _quant_tiles(x: torch.Tensor, e: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """e4m3 of x with the given exponent per (bm, bn) tile."""
    Sq, Sk = x.shape
    ee = e.repeat_interleave(bm, 0)[:Sq].repeat_interleave(bn, 1)[:, :Sk].to(x.dtype)
    return round_to_e4m3(x * torch.exp2(-ee)).to(x.dtype) * torch.exp2(ee)


def _emulate(ops, dout, out, lse, causal, scale, cfg, deterministic):
    """The kernel's arithmetic in fp64 on its own operands: P from the given lse, P·256 in e4m3 for dV, dO
    re-expressed per 64 rows (hdim) / per channel (seq), dS quantized with one power of two per tile, kept with
    hysteresis along the loop that accumulates it (attn_bwd._sticky_exp): the q tiles (all heads of the group)
    of a kv tile for dK and, in the atomic path, dQ; the kv tiles of a q tile in the deterministic dQ kernel.
    ``cfg.ds_tile_scale=False``: dK per key over a q tile, dQ per tile without hysteresis."""
    bwd = _bwd()
    f64 = lambda t: t.dequantize(torch.float64).cpu()
    q, k, vh, qs, ks = (f64(ops[n]) for n in ("q", "k", "v_hdim", "q_seq", "k_seq"))
    doh = f64(formats.row_scaled_from_float(dout.cpu(), -1, group_dim=1, group=bwd.DO_EXP_GROUP))
    dos = f64(formats.row_scaled_from_float(dout.cpu(), 1))
    out, lse = out.cpu().double(), lse.cpu().double()
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    grp = Hq // Hkv
    bm, bn = cfg.block_m, cfg.block_n
    hyst = bwd.DS_HYSTERESIS
    e0 = -bwd.P_SCALE_LOG2  # the kernels start at exponent 0 for 256 * dS
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k)
    for b in range(B):
        ds_all = []
        for h in range(Hq):
            kv = h // grp
            s = q[b, :, h] @ k[b, :, kv].T * scale
            if causal:
                i = torch.arange(Sq)[:, None]
                j = torch.arange(Sk)[None, :]
                s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
            l = lse[b, h][:, None]
            fin = torch.isfinite(l)
            p = torch.where(fin, torch.exp(s - torch.where(fin, l, torch.zeros_like(l))), torch.zeros_like(s))
            dv[b, :, kv] += (round_to_e4m3(p * 256).double() / 256).T @ dos[b, :, h]
            dp = doh[b, :, h] @ vh[b, :, kv].T
            ds_all.append(p * (dp - (doh[b, :, h] * out[b, :, h]).sum(-1, keepdim=True)))
        for kv in range(Hkv):
            heads = range(kv * grp, (kv + 1) * grp)
            if cfg.ds_tile_scale:  # dK (and atomic dQ): the exponent runs along (head, q tile) per kv tile
                et = [_tile_exps(ds_all[h], bm, bn) for h in heads]
                chosen = [torch.empty_like(e) for e in et]
                for j in range(et[0].shape[1]):
                    state = e0
                    for e, c in zip(et, chosen):
                        for i in range(e.shape[0]):
                            state = _sticky(int(e[i, j]), state, hyst)
                            c[i, j] = state
                ds_k = [_quant_tiles(ds_all[h], c, bm, bn) for h, c in zip(heads, chosen)]
                ds_q = ds_k
            else:
                ds_k = [_block_quant(ds_all[h], 0, bm) for h in heads]
                ds_q = []
                for h in heads:
                    e = _tile_exps(ds_all[h], bm, bn)
                    ds_q.append(_quant_tiles(ds_all[h], torch.where(e == _ZERO_TILE, 0, e), bm, bn))
            if deterministic:  # the dQ kernel: along the kv tiles of each query tile
                dbm, dbn = cfg.dq_block_m, cfg.dq_block_n
                ds_q = []
                for h in heads:
                    e = _tile_exps(ds_all[h], dbm, dbn)
                    c = torch.empty_like(e)
                    for i in range(e.shape[0]):
                        state = e0
                        for j in range(e.shape[1]):
                            state = _sticky(int(e[i, j]), state, hyst)
                            c[i, j] = state
                    ds_q.append(_quant_tiles(ds_all[h], c, dbm, dbn))
            for h, dsk, dsq in zip(heads, ds_k, ds_q):
                dq[b, :, h] = dsq @ ks[b, :, kv] * scale
                dk[b, :, kv] += dsk.T @ qs[b, :, h] * scale
    return dq, dk, dv


def zero_gradient_floors(q, k, dout, v_hdim, q_seq, k_seq, scale: float, on_gpu: bool) -> dict:
    """Per-element absolute error floors of dq, dk, dv for gradients that are zero in exact arithmetic.

    With one key, dS = dP - delta = 0, but dP - delta cancels only to the accumulation error of dO . V: ~2^-20 of
    scale * sum_d |dO_d V_d| in fp32 (interpreter) and ~2^-14 on the GPU (FP8 wgmma keeps ~14 bits, see
    EMUL_MIN_DB); twice that per dS element (largest over rows and keys), times the rms of the other operand and
    sqrt of the contraction length for dQ = dS K (keys) and dK = dS^T Q (queries of the group). ``v_hdim``,
    ``q_seq`` and ``k_seq`` are any operand with ``.data`` and ``.dequantize(dtype)`` (MXTensor, RowScaledFP8).
    """
    rms = lambda t: t.dequantize(torch.float32).pow(2).mean().sqrt().item() if t.data.numel() else 0.0
    group = q.shape[2] // max(k.shape[2], 1)
    eps_ds = 0.0
    if dout.numel() and k.shape[1]:
        do_a = dout.float().abs().transpose(1, 2)  # (B, Hq, Sq, D)
        v_a = v_hdim.dequantize(torch.float32).to(dout.device).abs().transpose(1, 2)
        v_a = v_a.repeat_interleave(group, 1)
        eps_ds = (2.0**-13 if on_gpu else 2.0**-19) * scale * (do_a @ v_a.transpose(-1, -2)).amax().item()
    return {"dq": eps_ds * rms(k_seq) * math.sqrt(k.shape[1]),
            "dk": eps_ds * rms(q_seq) * math.sqrt(q.shape[1] * group),
            "dv": 2.0**-16 * (dout.abs().max().item() if dout.numel() else 0.0)}


def _check(q, k, v, dout, causal, *, deterministic=False, softmax_scale=None, config=None, fwd="reference",
           q_rows=128, emul_min_db=EMUL_MIN_DB):
    """Run the kernel and check it against the calibrated bound and its emulation; returns the SQNRs."""
    bwd = _bwd()
    on_gpu = q.is_cuda
    mx, ops = _operands(q, k, v, on_gpu, q_rows)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    out_exact, lse = reference.attention_forward(mx["q"], mx["k"], mx["v"], causal=causal, softmax_scale=scale)
    if fwd == "kernel":
        from mxattn.kernels.attn_fwd import attn_fwd_hopper
        from mxattn.kernels.quantize import row_scaled_triton

        out, lse = attn_fwd_hopper(row_scaled_triton(q, "q"), ops["k"], row_scaled_triton(v, "v"), causal=causal,
                                   softmax_scale=scale)
    else:
        out_p, _ = reference.attention_forward(mx["q"], mx["k"], mx["v"], causal=causal, softmax_scale=scale,
                                               quantize_p=True)
        out = out_p.to(torch.bfloat16)
        lse = lse.float()
    out, lse = out.to(q.device), lse.to(q.device)
    cfg = config or bwd.default_config(D, causal, q.shape[2] // max(k.shape[2], 1))
    grads = bwd.attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, dout, lse,
                                causal=causal, softmax_scale=softmax_scale, deterministic=deterministic, config=cfg)
    truth = reference.attention_backward(mx["q"], mx["k"], mx["v"], out_exact, dout, causal=causal,
                                         softmax_scale=scale)
    # the reference emulates dK's dS with MX blocks of 32 queries per key, or, for the per-key rule
    # (ds_tile_scale=False), with the kernel's blocks: one exponent per key per q tile (ds_q_block)
    emul = reference.attention_backward(
        mx["q"], mx["k"], mx["v"], out, dout, causal=causal, softmax_scale=scale, quantize_p=True, quantize_ds=True,
        quantize_do=True, q_seq=mx["q_seq"], k_seq=mx["k_seq"], v_hdim=mx["v_hdim"],
        ds_q_block=32 if cfg.ds_tile_scale else cfg.block_m)
    own = _emulate(ops, dout, out, lse, causal, scale, cfg, deterministic or cfg.dq_kernel)
    abs_floor = zero_gradient_floors(q, k, dout, ops["v_hdim"], ops["q_seq"], ops["k_seq"], scale, on_gpu)
    res = {}
    for name, g, t, e, o in zip(GRADS, grads, truth, emul, own):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        g, t, e = g.double().cpu(), t.cpu(), e.cpu()
        assert not torch.isnan(g).any(), f"{name} has NaN where the truth is finite"
        floor = abs_floor[name] * math.sqrt(t.numel())
        err_k, err_e, norm = (g - t).norm().item(), (e - t).norm().item(), t.norm().item()
        bound = err_e * 10 ** (MARGIN_DB / 20) + BF16_FLOOR * norm + floor
        i = (g - t).abs().argmax().item()
        msg = (f"{name}: kernel SQNR {reference.sqnr_db(g, t):.2f} dB vs emulation {reference.sqnr_db(e, t):.2f} dB, "
               f"own emulation {reference.sqnr_db(g, o):.2f} dB; max abs err {(g - t).abs().max().item():.3g} "
               f"at flat index {i}")
        assert err_k <= bound, msg
        close, why = emulation_close(g, o, emul_min_db, floor)
        assert close, f"{msg}; {why}"
        res[name] = reference.sqnr_db(g, t)
    # rows that see no key (causal, Sq > Sk) get dq = 0 exactly
    if causal and q.shape[1] > k.shape[1]:
        empty = q.shape[1] - k.shape[1]
        assert grads[0][:, :empty].abs().max().item() == 0.0
    return res


def _inputs(B, Sq, Sk, Hq, Hkv, D, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


# ---------------------------------------------------------------- CPU: interpreter mode, tiny shapes
INTERP_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal, deterministic
    (1, 1, 1, 1, 1, 64, False, False),
    (1, 70, 150, 2, 2, 64, True, False),  # Sq < Sk, partial kv tile, diagonal band
    (1, 150, 37, 4, 2, 64, True, False),  # Sq > Sk: empty rows; GQA
    (2, 65, 130, 2, 1, 64, False, True),  # MQA, partial tiles, deterministic dQ
    (1, 33, 33, 2, 2, 128, True, True),
    (1, 239, 1, 2, 1, 64, False, False),
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + ("c" if c[6] else "") + ("d" if c[7] else "")


@pytest.mark.parametrize("case", INTERP_CASES, ids=_case_id)
def test_attn_bwd_interpreter(case, seed):
    require_kernels()
    B, Sq, Sk, Hq, Hkv, D, causal, det = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(B, Sq, Sk, Hq, Hkv, D, dev, seed)
    _check(q, k, v, do, causal, deterministic=det)


def _kernel_args(Sq, Sk, Hkv, D, seed, B=1, Hq=2):
    """Random inputs on the test device as ``attn_bwd_hopper``'s positional arguments (operands, out, dout, lse)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(B, Sq, Sk, Hq, Hkv, D, dev, seed)
    _, ops = _operands(q, k, v, q.is_cuda)
    out, lse = torch.randn_like(q), torch.rand(B, Hq, Sq, device=dev) + 3.0
    return (ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, do, lse), (q, k, v)


def test_backward_kernel_switch(seed, monkeypatch):
    """MXATTN_BWD_KERNEL: a bad value is refused before any launch; "gluon" is refused where the Gluon kernels cannot
    run (interpreter / CPU) and for layouts they do not take; an explicit config keeps the tl kernels."""
    require_kernels()
    bwd = _bwd()
    args, (q, k, v) = _kernel_args(40, 50, 1, 64, seed)
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "cuda")
    with pytest.raises(ValueError, match="MXATTN_BWD_KERNEL"):
        bwd.attn_bwd_hopper(*args)
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "gluon")
    if not q.is_cuda:
        with pytest.raises(RuntimeError, match="Hopper GPU"):
            bwd.attn_bwd_hopper(*args)
    q1 = _operands(q, k, v, q.is_cuda, q_rows=1)[1]["q"]  # the per-row Q layout: not for the Gluon kernels
    with pytest.raises(ValueError, match="grouped by a multiple of 128"):
        bwd.attn_bwd_hopper(q1, *args[1:])
    a = bwd.attn_bwd_hopper(*args, config=bwd.BwdConfig(dq_kernel=True))  # explicit config: the tl kernels
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "tl")
    b = bwd.attn_bwd_hopper(*args, config=bwd.BwdConfig(dq_kernel=True))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    # "auto" (the default): tl off the GPU, and tl for the per-row Q layout the Gluon kernels do not take
    monkeypatch.delenv("MXATTN_BWD_KERNEL")
    assert bwd.backward_kernel(torch.device("cpu")) == "tl"
    auto = bwd.attn_bwd_hopper(q1, *args[1:], deterministic=True)
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "tl")
    for x, y in zip(auto, bwd.attn_bwd_hopper(q1, *args[1:], deterministic=True)):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_backward_kernel_auto_is_gluon_on_hopper(monkeypatch):
    """Without MXATTN_BWD_KERNEL, a Hopper GPU with a verified Triton's Gluon takes the Gluon backward kernels."""
    bwd = _bwd()
    monkeypatch.delenv("MXATTN_BWD_KERNEL", raising=False)
    dev = torch.device("cuda", torch.cuda.current_device())
    from mxattn.kernels import gluon_verified

    want = "gluon" if torch.cuda.get_device_capability(dev) == (9, 0) and gluon_verified() else "tl"
    assert bwd.backward_kernel(dev) == want


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_backward_kernel_gluon_through_the_api(causal, seed, monkeypatch):
    """MXATTN_BWD_KERNEL=gluon through loss.backward(): the whole-tile Gluon kernels' (MXATTN_BWD_GLUON_SPLIT=0)
    gradients equal the tl dQ-kernel path's up to fp32 summation order (same P and dS bits).  The tl run takes the
    dS rule of the Gluon dK/dV kernel's default (``ds_exp="key"``: ``ds_tile_scale=False``) through a patched
    ``default_config``: the tl path's own default keeps one dS exponent per tile."""
    from dataclasses import replace

    from conftest import assert_same_up_to_summation_order

    from mxattn import mxfp8_attn_func
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig

    bwd = _bwd()
    q, k, v, do = _inputs(2, 700, 900, 8, 2, 128, "cuda", seed)
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", "0")
    tl_default = bwd.default_config
    grads = {}
    for kind in ("tl", "gluon"):
        monkeypatch.setenv("MXATTN_BWD_KERNEL", kind)
        with monkeypatch.context() as mp:
            if kind == "tl":
                mp.setattr(bwd, "default_config", lambda *a, **kw: replace(
                    tl_default(*a, **kw), ds_tile_scale=not GluonDkdvConfig().key_exp))
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            mxfp8_attn_func(*leaves, causal=causal, deterministic=True).backward(do)
        grads[kind] = [t.grad for t in leaves]
    for name, a, b in zip(("dq", "dk", "dv"), grads["gluon"], grads["tl"]):
        assert_same_up_to_summation_order(a, b, name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [128, 64])
def test_backward_gluon_split_equals_tl_64_tiles(D, causal, seed, monkeypatch):
    """MXATTN_BWD_GLUON_SPLIT=1 (the split Gluon dQ and dK/dV kernels, the default) in attn_bwd_hopper equals the
    tl kernels with 64-row / 64-key blocks (``split_tl_config``: the same dS exponent tiles for dQ; for dK the
    rule of the Gluon dK/dV default, ``tl_twin_config``) up to fp32 summation order.  At D = 64 the dispatch takes
    128-query dK/dV steps and 128-key dQ steps, whose twin has ``block_m`` = ``dq_block_n`` = 128."""
    from dataclasses import replace

    from conftest import assert_same_up_to_summation_order

    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, tl_twin_config

    bwd = _bwd()
    q, k, v, do = _inputs(2, 700, 900, 8, 2, D, "cuda", seed)
    _, ops = _operands(q, k, v, True)
    out, lse = torch.randn_like(q), torch.rand(2, 8, 700, device="cuda") + 3.0
    args = (ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, do, lse)
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "gluon")
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", "1")
    got = bwd.attn_bwd_hopper(*args, causal=causal)
    # explicit config: tl kernels
    wide = 128 if D == 64 else 64
    twin = replace(tl_twin_config(GluonDkdvConfig(split=True, block_m=wide)), dq_block_n=wide)
    want = bwd.attn_bwd_hopper(*args, causal=causal, config=twin)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_same_up_to_summation_order(a, b, name)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("split", ["1", "0"])
def test_gluon_dispatch_steps(D, split, seed, monkeypatch):
    """What ``attn_bwd_hopper`` hands the Gluon launchers (recorded on the CPU, not run): the split builds by
    default, with 128-query dK/dV and 128-key dQ steps at D = 64 (session 11's measurement) and 64 at D = 128;
    the whole-tile builds' own defaults (``config=None``) with ``MXATTN_BWD_GLUON_SPLIT=0``."""
    import mxattn.kernels.attn_bwd_dkdv_gluon as kv
    import mxattn.kernels.attn_bwd_dq_gluon as dqm

    bwd = _bwd()
    require_kernels()
    args, _ = _kernel_args(130, 70, 1, D, seed)
    seen = {}

    def dkdv(q, k, *a, config=None, dk_out=None, dv_out=None, **kw):
        seen["dkdv"] = config
        return dk_out, dv_out

    def dq(q, *a, config=None, **kw):
        seen["dq"] = config
        return torch.zeros(q.data.shape, dtype=torch.bfloat16)

    monkeypatch.setattr(bwd, "backward_kernel", lambda dev=None: "gluon")
    monkeypatch.setattr(kv, "attn_bwd_dkdv_gluon", dkdv)
    monkeypatch.setattr(dqm, "attn_bwd_dq_gluon", dq)
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", split)
    bwd.attn_bwd_hopper(*args, causal=True)
    if split == "0":
        assert seen == {"dkdv": None, "dq": None}
        return
    wide = 128 if D == 64 else 64
    assert seen["dkdv"] == kv.GluonDkdvConfig(split=True, block_m=wide)
    assert seen["dq"] == dqm.GluonDqConfig(split=True, block_n=wide)


def test_gluon_split_setting(monkeypatch):
    """The split Gluon backward kernels are the default; MXATTN_BWD_GLUON_SPLIT=0 takes the whole-tile ones and
    anything else is refused by name."""
    bwd = _bwd()
    monkeypatch.delenv("MXATTN_BWD_GLUON_SPLIT", raising=False)
    assert bwd.gluon_split()
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", "0")
    assert not bwd.gluon_split()
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", "yes")
    with pytest.raises(ValueError, match="MXATTN_BWD_GLUON_SPLIT"):
        bwd.gluon_split()


def test_attn_bwd_defer_dq(seed):
    """defer_dq=True returns dq as a callable (the ring launches it after sending dK/dV on) that gives the same
    bits as the plain call; dk, dv are the plain call's."""
    require_kernels()
    bwd = _bwd()
    args, _ = _kernel_args(70, 90, 1, 64, seed)
    plain = bwd.attn_bwd_hopper(*args, causal=True, deterministic=True)
    dq_fn, dk, dv = bwd.attn_bwd_hopper(*args, causal=True, deterministic=True, defer_dq=True)
    assert callable(dq_fn)
    for x, y in zip((dq_fn(), dk, dv), plain):
        assert torch.equal(x, y)


def test_attn_bwd_writes_into_given_grads(seed):
    """dk_out / dv_out (the ring's buffer): dK and dV written into strided views of one flat fp32 buffer (NaN before,
    so an element left unwritten shows) equal the plain call's; bad outputs are refused before any launch."""
    require_kernels()
    bwd = _bwd()
    args, (q, k, v) = _kernel_args(70, 90, 1, 64, seed, B=2)
    plain = bwd.attn_bwd_hopper(*args, causal=True, deterministic=True, grad_dtype=torch.float32)
    flat = torch.full((2 * 2 * 120 * 64,), float("nan"), device=q.device)
    dk_all, dv_all = flat[: flat.numel() // 2].view(2, 120, 1, 64), flat[flat.numel() // 2 :].view(2, 120, 1, 64)
    dk_out, dv_out = dk_all[:, 20:110], dv_all[:, 20:110]  # batch stride 120 rows: not contiguous
    got = bwd.attn_bwd_hopper(*args, causal=True, deterministic=True, grad_dtype=torch.float32, dk_out=dk_out,
                              dv_out=dv_out)
    assert got[1] is dk_out and got[2] is dv_out
    for x, y in zip(got, plain):
        assert torch.equal(x, y)
    for t in (dk_all, dv_all):  # nothing written outside the views
        assert torch.isnan(t[:, :20]).all() and torch.isnan(t[:, 110:]).all()
    wide = torch.zeros(2, 90, 1, 64, device=q.device)
    for bad, match in (({"dk_out": dk_out}, "both"), ({"dk_out": dk_out, "dv_out": dv_out[:, :-1]}, "shape"),
                       ({"dk_out": dk_out, "dv_out": dv_out.double()}, "float32"),
                       ({"dk_out": dk_out, "dv_out": torch.zeros_like(dv_out)}, "same strides"),
                       ({"dk_out": wide, "dv_out": wide}, "overlap"),
                       ({"dk_out": wide[:1].expand(2, -1, -1, -1), "dv_out": wide[1:].expand(2, -1, -1, -1)},
                        "zero-stride")):
        with pytest.raises((TypeError, ValueError), match=match):
            bwd.attn_bwd_hopper(*args, causal=True, grad_dtype=torch.float32, **bad)


@pytest.mark.parametrize("causal,Hkv,D,want", [(False, 2, 128, True), (True, 1, 128, True), (True, 2, 128, False),
                                               (False, 2, 64, False)])
def test_attn_bwd_default_dq_kernel_choice(causal, Hkv, D, want, seed):
    """``default_config`` sends dQ through the second kernel where it measured faster (d128, not causal or GQA):
    there the default call gives the deterministic path's bits; elsewhere it keeps the atomic path."""
    require_kernels()
    bwd = _bwd()
    assert bwd.default_config(D, causal, 2 // Hkv).dq_kernel == want
    if not want:
        return
    args, _ = _kernel_args(70, 90, Hkv, D, seed)
    a = bwd.attn_bwd_hopper(*args, causal=causal)
    b = bwd.attn_bwd_hopper(*args, causal=causal, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_attn_bwd_interpreter_per_key_scale(det, seed):
    """The per-key dS scale for dK (``BwdConfig(ds_tile_scale=False)``) meets the same bound."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 100, 140, 2, 1, 64, dev, seed)
    cfg = bwd.BwdConfig(ds_tile_scale=False)
    _check(q, k, v, do, True, deterministic=det, config=cfg)


@pytest.mark.parametrize("block_n", [128, 64])
def test_attn_bwd_interpreter_per_key_zero_rows_leave_the_bound(block_n, seed):
    """Per-key dS exponents (the Gluon ``ds_exp="key"`` twin): a key whose dS is all zero in a query tile keeps
    its exponent and does not start the bound of ``_bounded_exp``.  dO is 0 for the first 64 queries and ~2^-100
    after: had the zero tile set the key's bound from the initial exponent 0, the tiny dS would be raised to
    exponent -64 and flush to zero (dK = 0); with the rule, dK follows them (against the emulation, at 45 dB)."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 128, 64, 1, 1, 64, dev, seed)
    do[:, :64] = 0.0
    do[:, 64:] *= 2.0**-100
    cfg = bwd.BwdConfig(block_n=block_n, num_warps=4 if block_n == 64 else 8, ds_tile_scale=False)
    _check(q, k, v, do, False, config=cfg, deterministic=True)


def test_attn_bwd_interpreter_per_key_keeps_small_keys(seed):
    """Why one dS exponent per key: keys whose scores sit ~14 below the others' (P, so dS, ~2^-20 of theirs) lose
    their whole dK to one exponent per 128-key tile (flushed below e4m3's subnormals) and keep it per key.  Over
    those keys' rows dK's SQNR against the exact gradients is > 20 dB per key, < 3 dB per tile; over all keys both
    rules pass the calibrated bound (the per-key one against the reference's emulation with 64-query blocks)."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    B, Sq, Sk, D = 1, 96, 80, 64
    q = (torch.randn(B, Sq, 1, D, generator=g).abs() + 1.0).to(dev, torch.bfloat16)
    sign = torch.where(torch.arange(Sk) % 2 == 0, 1.0, -1.0).view(1, Sk, 1, 1)  # odd keys: the small ones
    k = (0.5 * sign + 0.1 * torch.randn(B, Sk, 1, D, generator=g)).to(dev, torch.bfloat16)
    v = torch.randn(B, Sk, 1, D, generator=g).to(dev, torch.bfloat16)
    do = torch.randn(B, Sq, 1, D, generator=g).to(dev, torch.bfloat16)
    mx = _operands(q, k, v, q.is_cuda)[0]
    truth = reference.attention_backward(mx["q"], mx["k"], mx["v"], reference.attention_forward(
        mx["q"], mx["k"], mx["v"])[0], do, quantize_do=True)[1][:, 1::2]
    small = {}
    for tile in (False, True):
        cfg = bwd.BwdConfig(ds_tile_scale=tile)
        _check(q, k, v, do, False, config=cfg, deterministic=True)
        args = _kernel_args_from(q, k, v, do)
        dk = bwd.attn_bwd_hopper(*args, deterministic=True, config=cfg)[1]
        small[tile] = reference.sqnr_db(dk[:, 1::2].double().cpu(), truth)
    assert small[False] > 20.0 and small[True] < 3.0, small


def _kernel_args_from(q, k, v, do):
    """``attn_bwd_hopper``'s positional arguments for these inputs with the reference forward's out and lse."""
    mx, ops = _operands(q, k, v, q.is_cuda)
    out, lse = reference.attention_forward(mx["q"], mx["k"], mx["v"])
    out, lse = out.to(q.device, torch.bfloat16), lse.to(q.device, torch.float32)
    return ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, do, lse


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_attn_bwd_interpreter_ds_exponent_moves(det, seed):
    """dS magnitudes jump by 2^8 between query tiles and by 2^5 between key tiles, so the dS exponents leave the
    hysteresis window and the dK / dQ accumulators are rescaled (up and down) mid-loop."""
    require_kernels()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 200, 200, 2, 1, 64, dev, seed)
    do[:, 64:128] *= 2.0**8
    do[:, 128:] *= 2.0**-8
    v[:, 64:] *= 2.0**5
    _check(q, k, v, do, False, deterministic=det)


@pytest.mark.parametrize("tile_scale", [True, False], ids=["tile_scale", "per_key_scale"])
def test_attn_bwd_interpreter_ds_exponent_drops_120_binades(tile_scale, seed):
    """dO (so dS) drops by 2^120 between query tiles: the dK/dQ accumulators may not follow the exponent all the
    way down (rescaling by 2^120 overflowed fp32 to inf before the bound in ``_bounded_exp``)."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 200, 200, 2, 1, 64, dev, seed)
    do[:, :64] *= 2.0**60
    do[:, 64:] *= 2.0**-60
    _check(q, k, v, do, False, config=bwd.BwdConfig(ds_tile_scale=tile_scale))
    _check(q, k, v, do, False, deterministic=True)


def test_attn_bwd_interpreter_scale_and_smaller_tiles(seed):
    """A non-default softmax scale and BLOCK_N 64 (two tiles share one K/V exponent group)."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 90, 200, 2, 2, 64, dev, seed)
    cfg = bwd.BwdConfig(32, 64, 4, 2, 32, 64, 4, 2)
    _check(q, k, v, do, True, softmax_scale=0.3, config=cfg)
    _check(q, k, v, do, False, softmax_scale=0.3, config=cfg, deterministic=True)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
def test_attn_bwd_interpreter_per_row_q(det, seed):
    """The forward's Q operand (one exponent per row: per-query vectors in the kernels) gives the same numbers."""
    require_kernels()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(1, 80, 100, 2, 1, 64, dev, seed)
    _check(q, k, v, do, True, deterministic=det, q_rows=1)


def test_attn_bwd_preprocess_delta(seed):
    """delta = rowsum(dO_hdim ∘ O) with dO the hdim-quantized gradient (the dO that dP uses); dO's two layouts."""
    require_kernels()
    bwd = _bwd()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, _, _, do = _inputs(2, 45, 1, 3, 1, 64, dev, seed)
    out = torch.randn(2, 45, 3, 64, device=dev).to(torch.bfloat16)
    doh, dos, delta = bwd.attn_bwd_preprocess(out, do)
    want_h = formats.row_scaled_from_float(do.cpu(), -1, group_dim=1, group=bwd.DO_EXP_GROUP)
    want_s = formats.row_scaled_from_float(do.cpu(), 1)
    assert torch.equal(doh.data.cpu().view(torch.uint8), want_h.data.view(torch.uint8))
    assert torch.equal(doh.exp.cpu(), want_h.exp)
    assert torch.equal(dos.data.cpu().view(torch.uint8), want_s.data.view(torch.uint8))
    assert dos.data.stride(1) == 1, "dO seq data must be channel-major"
    ref = (want_h.dequantize(torch.float64) * out.cpu().double()).sum(-1).permute(0, 2, 1)
    torch.testing.assert_close(delta.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_delta_launch_writes_the_step_rows(seed):
    """With lse, δ's launch also writes the dense Gluon dK/dV kernel's step rows (one launch less per backward):
    the same δ, and the rows ``attn_bwd_dkdv_gluon._step_rows(lse, δ)`` makes (its Triton kernel on CUDA: bit for
    bit; its float64 twin on the CPU: −δ exactly, b to one rounding), −inf / +0 in the columns past Sq, strided
    lse, rows whose lse is −inf."""
    require_kernels()
    _check_delta_step_rows("cuda" if torch.cuda.is_available() else "cpu", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 64])
def test_gpu_delta_launch_writes_the_step_rows(D, seed):
    """``test_delta_launch_writes_the_step_rows`` on the GPU (bit for bit against ``_step_rows``' kernel), in the
    GPU runs (``-m gpu``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_delta_step_rows("cuda", seed, D)


def _check_delta_step_rows(dev: str, seed: int, D: int = 64) -> None:
    bwd = _bwd()
    from mxattn.kernels import attn_bwd_dkdv_gluon as dkdv

    _, _, _, do = _inputs(2, 200, 1, 3, 1, D, dev, seed)
    out = torch.randn(2, 200, 3, D, device=dev).to(torch.bfloat16)
    lse = (torch.randn(2, 200, 3, device=dev) * 30).transpose(1, 2)  # (B, Hq, Sq), not contiguous
    lse[1, 2, :17] = float("-inf")
    _, _, want_delta = bwd.attn_bwd_preprocess(out, do)
    _, _, delta, _, rows = bwd._preprocess(out, do, None, None, lse=lse)
    assert torch.equal(delta, want_delta)
    brow, ndl = rows
    assert brow.shape == ndl.shape == (2, 3, 256) and brow.is_contiguous() and ndl.is_contiguous()
    want_b, want_n = dkdv._step_rows(lse, delta)
    assert torch.equal(ndl[..., :200], -delta) and (ndl[..., 200:] == 0).all() and not ndl[..., 200:].signbit().any()
    assert torch.equal(torch.isinf(brow), torch.isinf(want_b)) and (brow[..., 200:] == float("-inf")).all()
    if dev == "cuda":
        for x, y in ((brow, want_b), (ndl, want_n)):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    else:  # the interpreter's fma against float64 rounded once: at most one ulp apart
        fin = torch.isfinite(want_b)
        ulp = torch.finfo(torch.float32).eps * want_b[fin].abs()
        assert (brow[fin] - want_b[fin]).abs().le(ulp).all()


def test_attn_bwd_rejects_bad_operands(seed):
    bwd = _bwd()
    q, k, v, do = _inputs(1, 8, 8, 2, 1, 64, "cpu", seed)
    _, ops = _operands(q, k, v, on_gpu=False)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="v_hdim"):  # per-row V exponents instead of per 128 keys
        bwd.attn_bwd_hopper(ops["q"], ops["k"], formats.row_scaled_from_float(v, -1), ops["q_seq"], ops["k_seq"],
                            do, do, lse)
    with pytest.raises(ValueError, match="lse"):
        bwd.attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], do, do, lse.double())
    with pytest.raises(TypeError, match="q_seq"):
        bwd.attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], q, ops["k_seq"], do, do, lse)


# ---------------------------------------------------------------- GPU
GPU_CASES = [
    (1, 1, 1, 2, 2, 128, True),
    (2, 113, 203, 4, 4, 128, False),
    (2, 113, 203, 4, 4, 128, True),
    (1, 239, 1, 4, 4, 64, False),
    (1, 239, 1, 4, 4, 64, True),
    (1, 1023, 1024, 4, 4, 128, True),
    (1, 1024, 1024, 4, 4, 64, False),
    (2, 1000, 1000, 16, 2, 128, True),  # GQA 8:1
    (1, 2048, 2048, 8, 1, 64, False),  # MQA
    (1, 4096, 4096, 2, 2, 128, True),
    (1, 4096, 4096, 2, 2, 128, False),
    (1, 300, 3000, 2, 2, 128, True),  # Sq < Sk, bottom-right
    (1, 3000, 300, 2, 2, 128, True),  # Sq > Sk: empty rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("c" if c[6] else ""))
def test_attn_bwd_gpu(case, det, seed):
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v, do = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed)
    _check(q, k, v, do, causal, deterministic=det, fwd="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attn_bwd_gpu_deterministic_bitwise(causal, seed):
    """deterministic=True: five runs give bit-identical gradients (no float atomics anywhere)."""
    bwd = _bwd()
    q, k, v, do = _inputs(2, 1500, 1500, 16, 2, 128, "cuda", seed)
    _, ops = _operands(q, k, v, on_gpu=True)
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton

    out, lse = attn_fwd_hopper(row_scaled_triton(q, "q"), ops["k"], row_scaled_triton(v, "v"), causal=causal)
    run = lambda: bwd.attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, do, lse,
                                      causal=causal, deterministic=True)
    first = run()
    for _ in range(4):
        for a, b_ in zip(first, run()):
            assert torch.equal(a.view(torch.int16), b_.view(torch.int16))
    atomic = bwd.attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], ops["k_seq"], out, do, lse,
                                 causal=causal)
    for name, a, b_ in zip(GRADS, first, atomic):  # same dS quantization, only the fp32 summation order differs
        assert reference.sqnr_db(b_.double(), a.double()) > 40, name


@pytest.mark.gpu
def test_attn_bwd_gpu_large_logits(seed):
    q, k, v, do = _inputs(1, 512, 700, 2, 2, 128, "cuda", seed)
    # logits up to ~±180: the wgmma's ~14-bit accumulation of the 16x larger Q K^T products moves the kernel ~33 dB
    # from its fp64 emulation (measured 33.2 dB), while its error against the truth stays within 0.5 dB of the MX
    # emulation's (27.74 vs 27.82 dB), the bound that matters
    _check(q * 4, k * 4, v, do, True, fwd="kernel", emul_min_db=30.0)
    _check(q, k, v * 2.0**-60, do * 2.0**40, False, softmax_scale=0.02, fwd="kernel")


def test_emulation_close_sets_aside_only_rare_flip_rows():
    """The kernel-vs-emulation comparison forgives one rounding flip per 100 rows and nothing broader."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(62, 64, generator=g, dtype=torch.float64)
    assert emulation_close(o, o, 45.0, 0.0)[0]
    one = o.clone()
    one[26] *= 1.06  # one row off by 6%: a flip in a short row
    assert emulation_close(one, o, 45.0, 0.0)[0]
    two = one.clone()
    two[40] *= 1.06  # a second such row in 62 is no longer rare
    assert not emulation_close(two, o, 45.0, 0.0)[0]
    big = o.clone()
    big[3] *= 1.5  # a single row off by 50% is not a one-ulp flip
    assert not emulation_close(big, o, 45.0, 0.0)[0]
    assert not emulation_close(o * 1.01, o, 45.0, 0.0)[0]  # everything 1% off: 40 dB
