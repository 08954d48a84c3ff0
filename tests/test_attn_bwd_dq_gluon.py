"""The warp-specialized Gluon dQ kernel of the backward (``mxattn/kernels/attn_bwd_dq_gluon.py``).

CPU: the module imports (under triton 3.6 it must; under another triton Gluon's API may differ and the tests skip);
the launcher rejects bad operands before any launch; a pure-Python model of the kernel's mbarrier protocol (the
producer's K/V and K_seq rings, the consumer's order of waits and releases, same parity formulas) runs under
random interleavings without deadlock and never lets TMA overwrite a buffer a wgmma still reads; and, where
triton 3.6 is installed, the kernel compiles for sm_90a with the rules of ``scripts/compile_check_bwd_dq_gluon.py``
(marker ``slow``).

GPU (marker ``gpu``): dq against the ``tl`` kernel's (``attn_bwd_hopper(..., deterministic=True)``) on the same
operands: the same dS exponents and e4m3 values, so only the fp32 summation order differs (SQNR > 40 dB, no NaN,
rows that see no key exactly 0); and the timing helper ``bench_attn_bwd_dq_gluon`` (Gluon vs ``tl`` dQ kernel, B2
H16 S8k d128, causal and not), printed.
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
    return import_gluon_module("attn_bwd_dq_gluon")


# ---------------------------------------------------------------------------------------------------- CPU
def test_module_imports():
    m = _mod()
    assert callable(m.attn_bwd_dq_gluon) and callable(m.bench_attn_bwd_dq_gluon)
    assert m.BLOCK_M.value == 128 and m.BLOCK_N.value == 64  # the tl dQ kernel's tiles (same dS exponent tiles)
    from mxattn.kernels import attn_bwd

    assert attn_bwd.BwdConfig().dq_block_m == m.BLOCK_M.value and attn_bwd.BwdConfig().dq_block_n == m.BLOCK_N.value


def _cpu_operands(B=1, Sq=130, Sk=200, Hq=4, Hkv=2, D=64, q_rows=128):
    from mxattn import formats

    g = torch.Generator().manual_seed(0)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g)  # noqa: E731
    q, k, v, do = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)
    grp = lambda x, n: formats.row_scaled_from_float(x, -1, group_dim=1, group=n)  # noqa: E731
    ks = formats.row_scaled_from_float(k, 1)
    ops = dict(
        q=grp(q, q_rows) if q_rows > 1 else formats.row_scaled_from_float(q, -1),
        k=grp(k, 128), v_hdim=grp(v, 128),
        k_seq=formats.RowScaledFP8(formats.channel_major(ks.data), ks.exp, ks.dim),
        dout_hdim=grp(do, 128),
        lse=torch.zeros(B, Hq, Sq), delta=torch.zeros(B, Hq, Sq),
    )
    return ops


def test_launcher_rejects_bad_operands():
    m = _mod()
    from mxattn import formats

    ok = _cpu_operands()
    bad = [
        (dict(q=_cpu_operands(q_rows=1)["q"]), "grouped along the sequence"),  # the per-row Q layout
        (dict(q=_cpu_operands(q_rows=64)["q"]), "multiple of 128"),
        (dict(k=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1)), "grouped along the sequence"),
        (dict(v_hdim=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1, group_dim=1, group=256)),
         "one exponent per 128 keys"),
        (dict(k_seq=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), 1)), "channel-major"),
        (dict(lse=torch.zeros(1, 4, 129)), "lse"),
        (dict(delta=torch.zeros(1, 4, 130, dtype=torch.float64)), "delta"),
        (dict(dout_hdim=_cpu_operands(Sq=131)["dout_hdim"]), "dout_hdim"),
        (dict(k=torch.zeros(1)), "RowScaledFP8"),
    ]
    for change, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            m.attn_bwd_dq_gluon(**(ok | change))
    d32 = _cpu_operands(D=32)
    with pytest.raises(ValueError, match="head dim"):
        m.attn_bwd_dq_gluon(**d32)
    gqa = _cpu_operands(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        m.attn_bwd_dq_gluon(**gqa)
    with pytest.raises(ValueError, match="stages"):
        m.attn_bwd_dq_gluon(**ok, config=m.GluonDqConfig(stages=0))
    with pytest.raises(ValueError, match="grad_dtype"):
        m.attn_bwd_dq_gluon(**ok, grad_dtype=torch.int8)


@pytest.mark.slow
def test_compiles_for_sm90_without_gpu(capsys):
    """Where triton 3.6 is installed (the GPU machine), the d128 causal and d64 kernels compile for sm_90a with the
    checks of ``scripts/compile_check_bwd_dq_gluon.py`` (no spills, e4m3 k32 wgmma, no ptxas serialization)."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    _mod()
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "scripts"))
    import compile_check_bwd_dq_gluon as cc

    for d, causal, split in ((128, True, False), (64, False, False), (128, False, True), (128, True, True)):
        kernel = cc.compile_variant(d, causal, split=split)
        name = f"d{d}{'_causal' if causal else ''}"
        assert cc.check(kernel, name, None) and cc.partition_report(kernel, 128 if split else 256), \
            capsys.readouterr().out


def _protocol_model(n_tiles: int, stages: int, rng: random.Random, mutant: str = "", consumers: int = 1):
    """Run the kernel's protocol (``_producer`` and ``_dq_loop``; ``consumers=2``: the split kernel, two warpgroup
    partitions on one ring, empty barriers counting two arrivals) under a random interleaving
    (``conftest.SharedTilesModel``); returns the log of reads."""
    S = stages
    empty_count = 1 if mutant == "split_empty_count_1" else consumers
    bars = {name: [MBarrierModel(empty_count if name.endswith("empty") else 1) for _ in range(S)]
            for name in ("kv_ready", "kv_empty", "ks_ready", "ks_empty")}
    smem = SharedTilesModel([(r, s) for r in ("kv", "ks") for s in range(S)])

    def producer():
        for i in range(n_tiles):
            s = i % S
            ph = ((i // S) & 1) ^ 1
            if mutant != "no_kv_empty_wait":
                yield ("wait", bars["kv_empty"][s], ph)
            bars["kv_ready"][s].expect_arrive(2)  # K and V_hdim
            smem.tma(("kv", s), i, bars["kv_ready"][s])
            smem.tma(("kv", s), i, bars["kv_ready"][s])
            yield ("wait", bars["ks_empty"][s], ph)
            bars["ks_ready"][s].expect_arrive(1)
            smem.tma(("ks", s), i, bars["ks_ready"][s])

    def consumer():
        yield ("wait", bars["kv_ready"][0], 0)
        smem.start_read(("kv", 0), 0)
        yield ("step",)
        smem.done_read(("kv", 0))
        bars["kv_empty"][0].arrive()
        for j in range(1, n_tiles):
            st, sp = j % S, (j - 1) % S
            yield ("wait", bars["kv_ready"][st], (j // S) & 1)
            yield ("wait", bars["ks_ready"][sp], ((j if mutant == "ks_parity" else j - 1) // S) & 1)
            smem.start_read(("kv", st), j)
            smem.start_read(("ks", sp), j - 1)
            yield ("step",)  # wait(1): S_j, dP_j done
            smem.done_read(("kv", st))
            bars["kv_empty"][st].arrive()
            yield ("step",)  # wait(0): dQ_{j-1} done
            smem.done_read(("ks", sp))
            bars["ks_empty"][sp].arrive()
        sp = (n_tiles - 1) % S
        yield ("wait", bars["ks_ready"][sp], ((n_tiles - 1) // S) & 1)
        smem.start_read(("ks", sp), n_tiles - 1)
        yield ("step",)
        smem.done_read(("ks", sp))
        bars["ks_empty"][sp].arrive()

    return smem.run({"producer": producer(), **{f"consumer{c}": consumer() for c in range(consumers)}}, rng)


@pytest.mark.parametrize("consumers", [1, 2], ids=["whole", "split"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_barrier_protocol_model(stages, consumers, seed):
    rng = random.Random(seed)
    for n_tiles in (1, 2, 3, stages, stages + 1, 2 * stages + 3, 17):
        for _ in range(30):
            log = _protocol_model(n_tiles, stages, rng, consumers=consumers)
            for ring in ("kv", "ks"):
                assert sorted(t for kind, buf, t in log if buf[0] == ring) == sorted(list(range(n_tiles)) * consumers)


@pytest.mark.parametrize("mutant,consumers", [("no_kv_empty_wait", 1), ("ks_parity", 1), ("no_kv_empty_wait", 2),
                                              ("split_empty_count_1", 2)])
def test_barrier_protocol_model_catches_mutants(mutant, consumers, seed):
    """The model is not vacuous: a producer that does not wait for the K/V release, a consumer waiting K_seq with
    the wrong parity, or (split) empty barriers counting one arrival for two warpgroups, is caught (deadlock, a TMA
    into a buffer being read, a wgmma reading the wrong tile, or too many arrivals)."""
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
    (2, 113, 203, 4, 4, 128, False),
    (2, 113, 203, 4, 2, 64, True),
    (1, 1023, 1024, 4, 4, 128, True),
    (1, 1023, 1024, 4, 4, 64, False),
    (1, 300, 3000, 2, 2, 128, True),  # Sq < Sk, bottom-right
    (1, 3000, 300, 2, 2, 128, True),  # Sq > Sk: rows that see no key
    (2, 1000, 1000, 16, 2, 128, True),  # GQA 8:1
    (2, 1000, 1000, 16, 2, 64, False),  # GQA 8:1
    (3, 129, 257, 2, 1, 128, False),  # MQA; 128-row block and 64-key tile boundaries, TMA rows into the next batch
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + ("c" if c[6] else "")


def _gpu_inputs(case, seed):
    B, Sq, Sk, Hq, Hkv, D, causal = case
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


def _tl_deterministic_dq(q, k, v, dout, ops, out, causal):
    from mxattn.kernels.attn_bwd import BwdConfig, attn_bwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton as rs

    # an explicit config keeps attn_bwd_hopper on the tl kernels (without one it takes the Gluon kernels on Hopper)
    dq, _, _ = attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], rs(q, "v"), ops["k_seq"], out, dout, ops["lse"],
                               causal=causal, deterministic=True, dout_hdim=ops["dout_hdim"], config=BwdConfig())
    return dq


def _assert_agree(got, want, name):
    assert_same_up_to_summation_order(got, want, name)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_matches_tl(case, split, seed):
    """Against the tl dQ kernel on the same operands, equal up to fp32 summation order (the same P and dS bits);
    rows that see no key exactly 0.  ``split`` (``GluonDqConfig(split=True)``: two 4-warp consumer partitions of 64
    rows, dS exponent per 64 x 64 tile) against the tl dQ kernel with 64-row blocks."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    causal = case[6]
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, out = m.dq_operands(q, k, v, dout, causal)
    dq = m.attn_bwd_dq_gluon(**ops, causal=causal, config=m.GluonDqConfig(split=split))
    torch.cuda.synchronize()
    if split:
        want = m._tl_dq(**ops, causal=causal, tl_config=m.split_tl_config())
    else:
        want = _tl_deterministic_dq(q, k, v, dout, ops, out, causal)
        # the tl dQ kernel launched alone (the bench's baseline) is the same kernel
        assert torch.equal(m._tl_dq(**ops, causal=causal).view(torch.int16), want.view(torch.int16))
    _assert_agree(dq, want, _case_id(case) + (" split" if split else ""))
    Sq, Sk = case[1], case[2]
    if causal and Sq > Sk:  # bottom-right: the first Sq - Sk rows see no key
        assert dq[:, : Sq - Sk].abs().max().item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(stages=2), dict(stages=4)], ids=str)
def test_attn_bwd_dq_gluon_configs(variant, seed):
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    for D, causal in ((128, True), (64, False)):
        case = (1, 700, 1200, 4, 2, D, causal)
        q, k, v, dout = _gpu_inputs(case, seed + D)
        ops, out = m.dq_operands(q, k, v, dout, causal)
        dq = m.attn_bwd_dq_gluon(**ops, causal=causal, config=m.GluonDqConfig(**variant))
        _assert_agree(dq, _tl_deterministic_dq(q, k, v, dout, ops, out, causal), f"{variant} d{D}")


@pytest.mark.gpu
def test_attn_bwd_dq_gluon_exponent_moves(seed):
    """dS magnitudes that change by many binades along the keys: the exponent leaves the hysteresis window and
    the accumulator is rescaled (both ways), and the output scale / grad dtype options are passed through."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    case = (1, 256, 2048, 2, 2, 128, False)
    q, k, v, dout = _gpu_inputs(case, seed)
    ramp = torch.logspace(-6, 3, 2048, base=2.0, device="cuda").view(1, -1, 1, 1)
    v = (v.float() * ramp.flip(1) * ramp.roll(700, 1)).to(torch.bfloat16)
    ops, out = m.dq_operands(q, k, v, dout, False)
    dq = m.attn_bwd_dq_gluon(**ops, grad_dtype=torch.float32)
    want = _tl_deterministic_dq(q, k, v, dout, ops, out, False).float()
    _assert_agree(dq, want, "exponent moves")


@pytest.mark.gpu
def test_bench_attn_bwd_dq_gluon():
    """Prints Gluon vs tl dQ kernel time at B2 H16 S8k d128 (causal and not); asserts only that both ran."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    rows = m.bench_attn_bwd_dq_gluon(rep_ms=100)
    for r in rows:
        print(f"\nbench dQ B{r['B']} H{r['Hq']}/{r['Hkv']} S{r['S']} d{r['D']} causal={r['causal']}: "
              f"gluon {r.get('gluon_ms', float('nan')):.3f} ms ({r.get('gluon_tflops', 0):.0f} TFLOP/s), "
              f"tl {r.get('tl_ms', float('nan')):.3f} ms ({r.get('tl_tflops', 0):.0f} TFLOP/s), "
              f"speedup {r.get('speedup', float('nan')):.2f}x {r.get('gluon_error', '')}")
    assert all(r.get("gluon_ms") and r.get("tl_ms") for r in rows), rows


def test_launch_plan_repeats_the_checked_launch(monkeypatch):
    """As the dK/dV launcher's plans: later calls of one signature launch what the first (checked) call launched,
    with descriptors over their own tensors, and run no checks."""
    from test_attn_bwd_dkdv_gluon import _recorded_launches, _same_launch

    m = _mod()
    m._PLANS.clear()
    ops = _cpu_operands()
    seen = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dq_gluon(**ops, causal=True), n=2)
    assert len(m._PLANS) == 1
    _same_launch(seen[0], seen[1])
    monkeypatch.setattr(m, "_check", lambda *a: pytest.fail("a plan hit runs no checks"))
    other = _cpu_operands()
    seen2 = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dq_gluon(**other, causal=True), n=1)
    _same_launch(seen[0], seen2[0])
    assert seen2[0][1][0].base.data_ptr() == other["q"].data.data_ptr()
