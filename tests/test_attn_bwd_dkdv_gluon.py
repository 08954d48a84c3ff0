"""The warp-specialized Gluon dK/dV kernel of the backward (``mxattn/kernels/attn_bwd_dkdv_gluon.py``).

CPU: the module imports (under triton 3.6 it must; under another triton Gluon's API may differ and the tests skip);
the launcher rejects bad operands before any launch; a pure-Python model of the kernel's mbarrier protocol (the
producer's Q/dO and Q_seq/dO_seq rings, the consumer's order of waits and releases, same parity formulas) runs
under random interleavings without deadlock and never lets TMA overwrite a buffer a wgmma still reads; and, where
triton 3.6 is installed, the kernel compiles for sm_90a with the rules of
``scripts/compile_check_bwd_dkdv_gluon.py`` (marker ``slow``).

GPU (marker ``gpu``): (dk, dv) against the ``tl`` kernel's (``attn_bwd_hopper(..., deterministic=True)``) on the
same operands: the same dS exponents and e4m3 P / dS values, so only the fp32 summation order differs (SQNR > 40 dB,
no NaN, keys no query sees exactly 0); and the timing helper ``bench_attn_bwd_dkdv_gluon`` (Gluon vs the ``tl``
dK/dV-only kernel, B2 H16 S8k d128, causal and not), printed.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from conftest import (
    MBarrierModel,
    SharedTilesModel,
    assert_same_up_to_summation_order,
    import_gluon_module,
    triton_version,
)

_HERE = os.path.dirname(os.path.abspath(__file__))


def _mod():
    return import_gluon_module("attn_bwd_dkdv_gluon")


# ---------------------------------------------------------------------------------------------------- CPU
def test_module_imports():
    m = _mod()
    assert callable(m.attn_bwd_dkdv_gluon) and callable(m.bench_attn_bwd_dkdv_gluon)
    # the tl dK/dV kernel's tiles: the dS exponent is one per (128 keys x 64 queries) tile in both
    assert m.BLOCK_N.value == 128 and m.BLOCK_M.value == 64 and m.KV_EXP_GROUP == m.BLOCK_N.value
    from mxattn.kernels import attn_bwd

    cfg = attn_bwd.BwdConfig()
    assert cfg.block_n == m.BLOCK_N.value and cfg.block_m == m.BLOCK_M.value and cfg.ds_tile_scale


def _cpu_operands(B=1, Sq=130, Sk=200, Hq=4, Hkv=2, D=64, q_rows=128):
    from mxattn import formats

    g = torch.Generator().manual_seed(0)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g)  # noqa: E731
    q, k, v, do = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)
    grp = lambda x, n: formats.row_scaled_from_float(x, -1, group_dim=1, group=n)  # noqa: E731

    def seq(x):
        s = formats.row_scaled_from_float(x, 1)
        return formats.RowScaledFP8(formats.channel_major(s.data), s.exp, s.dim)

    return dict(
        q=grp(q, q_rows) if q_rows > 1 else formats.row_scaled_from_float(q, -1),
        k=grp(k, 128), v_hdim=grp(v, 128), q_seq=seq(q), dout_hdim=grp(do, 128), dout_seq=seq(do),
        lse=torch.zeros(B, Hq, Sq), delta=torch.zeros(B, Hq, Sq),
    )


def test_launcher_rejects_bad_operands():
    m = _mod()
    from mxattn import formats

    ok = _cpu_operands()
    bad = [
        (dict(q=_cpu_operands(q_rows=1)["q"]), "grouped along the sequence"),  # the per-row Q layout
        (dict(q=_cpu_operands(q_rows=32)["q"]), "multiple of 64"),
        (dict(k=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1)), "grouped along the sequence"),
        (dict(v_hdim=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1, group_dim=1, group=256)),
         "one exponent per 128 keys"),
        (dict(q_seq=formats.row_scaled_from_float(torch.randn(1, 130, 4, 64), 1)), "channel-major"),
        (dict(dout_seq=_cpu_operands(Hq=2)["dout_seq"]), "dout_seq"),
        (dict(dout_seq=ok["dout_hdim"]), "dout_seq"),
        (dict(lse=torch.zeros(1, 4, 129)), "lse"),
        (dict(delta=torch.zeros(1, 4, 130, dtype=torch.float64)), "delta"),
        (dict(dout_hdim=_cpu_operands(Sq=131)["dout_hdim"]), "dout_hdim"),
        (dict(k=torch.zeros(1)), "RowScaledFP8"),
    ]
    for change, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            m.attn_bwd_dkdv_gluon(**(ok | change))
    with pytest.raises(ValueError, match="head dim"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(D=32))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(Hq=3, Hkv=2))
    with pytest.raises(ValueError, match="stages"):
        m.attn_bwd_dkdv_gluon(**ok, config=m.GluonDkdvConfig(stages=0))
    with pytest.raises(ValueError, match="grad_dtype"):
        m.attn_bwd_dkdv_gluon(**ok, grad_dtype=torch.int8)


def test_tile_exponents_expand_groups():
    """The launcher's per-64-row exponents (``_tile_exps``) are the grouped operand's, row by row."""
    m = _mod()
    for rows, Sq in ((128, 130), (64, 64), (256, 700)):
        t = _cpu_operands(Sq=Sq, q_rows=rows)["q"]
        te = m._tile_exps(t, Sq)
        assert te.shape == (1, -(-Sq // 64), 4, 1) and te.is_contiguous()
        for i in range(te.shape[1]):
            assert torch.equal(te[:, i], t.exp[:, (i * 64) // rows])


@pytest.mark.slow
def test_compiles_for_sm90_without_gpu(capsys):
    """Where triton 3.6 is installed (the GPU machine), the d128 causal and d64 kernels compile for sm_90a with the
    checks of ``scripts/compile_check_bwd_dkdv_gluon.py`` (spills within the documented allowance, e4m3 k32
    wgmma, no ptxas serialization, at most 3 DEPBAR per step)."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    _mod()
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "scripts"))
    import compile_check_bwd_dkdv_gluon as cc

    for d, causal, split in ((128, True, False), (64, False, False), (128, False, True), (128, True, True)):
        kernel = cc.compile_variant(d, causal, split=split)
        assert cc.check(kernel, f"d{d}{'_causal' if causal else ''}", None, split=split), capsys.readouterr().out


def _protocol_model(n_steps: int, stages: int, rng: random.Random, mutant: str = "", consumers: int = 1):
    """Run the kernel's protocol (``_producer`` and ``_consumer``'s loop; ``consumers=2``: the split kernel, two
    warpgroup partitions on one ring, empty barriers counting two arrivals) under a random interleaving
    (``conftest.SharedTilesModel``); returns the log of reads."""
    S = stages
    empty_count = 1 if mutant == "split_empty_count_1" else consumers
    bars = {name: [MBarrierModel(empty_count if name.endswith("empty") else 1) for _ in range(S)]
            for name in ("qd_ready", "qd_empty", "sq_ready", "sq_empty")}
    kv_bar = MBarrierModel(1)
    smem = SharedTilesModel([(r, s) for r in ("qd", "sq") for s in range(S)] + [("kv", 0)])

    def producer():
        kv_bar.expect_arrive(2 * consumers)  # K and V_hdim, once (a 64-key tile of each per warpgroup when split)
        for _ in range(2 * consumers):
            smem.tma(("kv", 0), 0, kv_bar)
        for i in range(n_steps):
            s = i % S
            ph = ((i // S) & 1) ^ 1
            if mutant != "no_qd_empty_wait":
                yield ("wait", bars["qd_empty"][s], ph)
            bars["qd_ready"][s].expect_arrive(2)  # Q and dO_hdim
            smem.tma(("qd", s), i, bars["qd_ready"][s])
            smem.tma(("qd", s), i, bars["qd_ready"][s])
            yield ("wait", bars["sq_empty"][s], ph)
            bars["sq_ready"][s].expect_arrive(2)  # Q_seq and dO_seq
            smem.tma(("sq", s), i, bars["sq_ready"][s])
            smem.tma(("sq", s), i, bars["sq_ready"][s])

    def consumer():
        yield ("wait", kv_bar, 0)
        assert smem.content[("kv", 0)] == 0
        for j in range(n_steps):
            st, ph = j % S, (j // S) & 1
            yield ("wait", bars["qd_ready"][st], ph)
            smem.start_read(("qd", st), j)  # Sᵀ_j, dPᵀ_j issued
            yield ("step",)  # wait(1): Sᵀ_j; P
            yield ("step",)  # wait(0): dPᵀ_j
            smem.done_read(("qd", st))
            bars["qd_empty"][st].arrive()
            yield ("wait", bars["sq_ready"][st], ((j + 1) // S) & 1 if mutant == "sq_parity" else ph)
            smem.start_read(("sq", st), j)  # dV_j issued, then dK_j
            yield ("step",)  # wait(0): both
            smem.done_read(("sq", st))
            bars["sq_empty"][st].arrive()

    return smem.run({"producer": producer(), **{f"consumer{c}": consumer() for c in range(consumers)}}, rng)


@pytest.mark.parametrize("consumers", [1, 2], ids=["whole", "split"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_barrier_protocol_model(stages, consumers, seed):
    rng = random.Random(seed)
    for n_steps in (0, 1, 2, 3, stages, stages + 1, 2 * stages + 3, 17):
        for _ in range(30):
            log = _protocol_model(n_steps, stages, rng, consumers=consumers)
            for ring in ("qd", "sq"):
                reads = [t for kind, buf, t in log if buf[0] == ring]
                assert sorted(reads) == sorted(list(range(n_steps)) * consumers)


@pytest.mark.parametrize("mutant,consumers", [("no_qd_empty_wait", 1), ("sq_parity", 1), ("no_qd_empty_wait", 2),
                                              ("split_empty_count_1", 2)])
def test_barrier_protocol_model_catches_mutants(mutant, consumers, seed):
    """The model is not vacuous: a producer that does not wait for the Q/dO release, a consumer waiting
    Q_seq/dO_seq with the wrong parity, or (split) empty barriers counting one arrival for two warpgroups, is
    caught (deadlock, a TMA into a buffer being read, a wrong tile, or too many arrivals)."""
    rng = random.Random(seed)
    with pytest.raises(AssertionError):
        for _ in range(200):
            _protocol_model(9, 2, rng, mutant, consumers=consumers)


# ---------------------------------------------------------------------------------------------------- GPU
def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (1, 1, 1, 2, 2, 128, True),
    (1, 1, 77, 2, 2, 64, False),  # Sq = 1 with no GQA: the launch that triton 3.6 cannot lower when Sq is specialized
    (1, 1, 1, 1, 1, 64, False),  # the sanitizer's shape that found it (Hq = Hkv = Sk = 1 specialized too)
    (2, 113, 203, 4, 4, 128, False),
    (2, 113, 203, 4, 2, 64, True),
    (1, 1023, 1024, 4, 4, 128, True),
    (1, 1023, 1024, 4, 4, 64, False),
    (1, 300, 3000, 2, 2, 128, True),  # Sq < Sk, bottom-right
    (1, 3000, 300, 2, 2, 128, True),  # Sq > Sk
    (1, 300, 3000, 2, 2, 64, False),
    (2, 1000, 1000, 16, 2, 128, True),  # GQA 8:1: the head loop and its per-channel rescale
    (2, 1000, 1000, 16, 2, 64, False),
    (3, 129, 257, 2, 1, 128, False),  # MQA; 64-row / 128-key boundaries, TMA rows into the next batch
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + ("c" if c[6] else "")


def _gpu_inputs(case, seed):
    B, Sq, Sk, Hq, Hkv, D, causal = case
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


def _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal, grad_dtype=torch.bfloat16):
    from mxattn.kernels.attn_bwd import BwdConfig, attn_bwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton as rs

    # an explicit config keeps attn_bwd_hopper on the tl kernels (without one it takes the Gluon kernels on Hopper)
    _, dk, dv = attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], rs(k, "v"), out, dout, ops["lse"],
                                causal=causal, deterministic=True, grad_dtype=grad_dtype,
                                dout_hdim=ops["dout_hdim"], dout_seq=ops["dout_seq"], config=BwdConfig())
    return dk, dv


def _assert_agree(got, want, name):
    assert_same_up_to_summation_order(got, want, name)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_matches_tl(case, split, seed):
    """Against the tl dK/dV kernel on the same operands, equal up to fp32 summation order (the same P and dS
    bits); keys no query sees exactly 0.  ``split`` (``GluonDkdvConfig(split=True)``: two 4-warp consumer
    partitions of 64 keys, dS exponent per 64 x 64 tile) against the tl kernel with 64-key blocks."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    causal = case[6]
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, out = m.dkdv_operands(q, k, v, dout, causal)
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(split=split))
    torch.cuda.synchronize()
    name = _case_id(case) + (" split" if split else "")
    if split:
        want_dk, want_dv = m._tl_dkdv(**ops, causal=causal, tl_config=m.split_tl_config())
    else:
        want_dk, want_dv = _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal)
        # the tl dK/dV kernel launched alone (the bench's baseline) is the same kernel as attn_bwd_hopper's
        tdk, tdv = m._tl_dkdv(**ops, causal=causal)
        assert torch.equal(tdk.view(torch.int16), want_dk.view(torch.int16))
        assert torch.equal(tdv.view(torch.int16), want_dv.view(torch.int16))
    _assert_agree(dk, want_dk, name + " dk")
    _assert_agree(dv, want_dv, name + " dv")
    # keys where the tl result is exactly zero in every channel (no query sees them, or P = 0 throughout) are
    # exactly zero here too
    assert (dv[(want_dv == 0).all(dim=-1)] == 0).all() and (dk[(want_dk == 0).all(dim=-1)] == 0).all()


@pytest.mark.gpu
def test_attn_bwd_dkdv_gluon_unseen_keys_zero(seed):
    """Keys that no query sees get dk = dv = 0 exactly: every query row empty (lse = −inf, as the forward returns
    for rows that see nothing).  (Bottom-right causal with Sq >= 1 lets the last query see every key.)"""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    case = (1, 200, 500, 2, 1, 128, True)
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, _ = m.dkdv_operands(q, k, v, dout, True)
    ops["lse"] = torch.full_like(ops["lse"], float("-inf"))
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=True)
    assert dk.abs().max().item() == 0.0 and dv.abs().max().item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(stages=1), dict(stages=3), dict(stages=4)], ids=str)
def test_attn_bwd_dkdv_gluon_configs(variant, seed):
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    for D, causal in ((128, True), (64, False)):
        case = (1, 700, 1200, 4, 2, D, causal)
        q, k, v, dout = _gpu_inputs(case, seed + D)
        ops, out = m.dkdv_operands(q, k, v, dout, causal)
        dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(**variant))
        want_dk, want_dv = _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal)
        _assert_agree(dk, want_dk, f"{variant} d{D} dk")
        _assert_agree(dv, want_dv, f"{variant} d{D} dv")


@pytest.mark.gpu
def test_attn_bwd_dkdv_gluon_exponent_moves(seed):
    """dS magnitudes that change by many binades along the queries: the exponent leaves the hysteresis window
    and the dK accumulator is rescaled (both ways); grad dtype passed through."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    case = (1, 2048, 256, 2, 2, 128, False)
    q, k, v, dout = _gpu_inputs(case, seed)
    ramp = torch.logspace(-6, 3, 2048, base=2.0, device="cuda").view(1, -1, 1, 1)
    dout = (dout.float() * ramp.flip(1) * ramp.roll(700, 1)).to(torch.bfloat16)
    ops, out = m.dkdv_operands(q, k, v, dout, False)
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, grad_dtype=torch.float32)
    want_dk, want_dv = _tl_deterministic_dkdv(q, k, v, dout, ops, out, False, grad_dtype=torch.float32)
    _assert_agree(dk, want_dk, "exponent moves dk")
    _assert_agree(dv, want_dv, "exponent moves dv")


@pytest.mark.gpu
def test_bench_attn_bwd_dkdv_gluon():
    """Prints Gluon vs tl dK/dV kernel time at B2 H16 S8k d128 (causal and not); asserts only that both ran."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    rows = m.bench_attn_bwd_dkdv_gluon(rep_ms=100)
    for r in rows:
        print(f"\nbench dK/dV B{r['B']} H{r['Hq']}/{r['Hkv']} S{r['S']} d{r['D']} causal={r['causal']}: "
              f"gluon {r.get('gluon_ms', float('nan')):.3f} ms ({r.get('gluon_tflops', 0):.0f} TFLOP/s), "
              f"tl {r.get('tl_ms', float('nan')):.3f} ms ({r.get('tl_tflops', 0):.0f} TFLOP/s), "
              f"speedup {r.get('speedup', float('nan')):.2f}x {r.get('gluon_error', '')}")
    assert all(r.get("gluon_ms") and r.get("tl_ms") for r in rows), rows


@pytest.mark.gpu
def test_bench_attn_bwd_dkdv_gluon_split():
    """Prints the split kernel's time against its tl twin (64-key blocks) and the unsplit Gluon kernel's, B2 H16
    S8k d128; asserts only that all ran."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    split = m.bench_attn_bwd_dkdv_gluon(rep_ms=100, config=m.GluonDkdvConfig(split=True))
    whole = m.bench_attn_bwd_dkdv_gluon(rep_ms=100)
    for r, w in zip(split, whole):
        print(f"\nbench dK/dV split, causal={r['causal']}: split {r.get('gluon_ms', float('nan')):.3f} ms, "
              f"unsplit {w.get('gluon_ms', float('nan')):.3f} ms, tl 64-key {r.get('tl_ms', float('nan')):.3f} ms "
              f"{r.get('gluon_error', '')}")
    assert all(r.get("gluon_ms") for r in split + whole), split + whole
