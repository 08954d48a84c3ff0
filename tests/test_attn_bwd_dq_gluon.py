"""The warp-specialized Gluon dQ kernel of the backward (``mxattn/kernels/attn_bwd_dq_gluon.py``).

CPU: the module imports (under triton 3.6 it must; under another triton Gluon's API may differ and the tests skip);
the launcher rejects bad operands before any launch; a pure-Python model of the kernel's mbarrier protocol (the
producer's K/V and K_seq rings, the consumer's order of waits and releases, same parity formulas) runs under
random interleavings without deadlock and never lets TMA overwrite a buffer a wgmma still reads; and, where
triton 3.6 is installed, the kernel compiles for sm_90a with the rules of ``scripts/compile_check_bwd_dq_gluon.py``
(marker ``slow``).  The 128-key step (``GluonDqConfig.block_n``, session 9): its validation, its tl twin
(``tl_twin_config``; the tl kernel with ``dq_block_n=128`` checked against its fp64 emulation under the
interpreter), its launch plan, and its d64 builds' compile check.

GPU (marker ``gpu``): dq against the ``tl`` kernel's (``attn_bwd_hopper(..., deterministic=True)``) on the same
operands: the same dS exponents and e4m3 values, so only the fp32 summation order differs (SQNR > 40 dB, no NaN,
rows that see no key exactly 0), for the 128-key step against the tl kernel with ``dq_block_n=128``
(``-k block_n_128``); and the timing helper ``bench_attn_bwd_dq_gluon`` (Gluon vs ``tl`` dQ kernel, B2
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
    # the tl dQ kernel's tiles (same dS exponent tiles)
    assert m.BLOCK_M.value == 128 and m.GluonDqConfig().block_n == 64
    from mxattn.kernels import attn_bwd

    assert attn_bwd.BwdConfig().dq_block_m == m.BLOCK_M.value
    assert attn_bwd.BwdConfig().dq_block_n == m.GluonDqConfig().block_n


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


def test_block_n_validation():
    """``GluonDqConfig.block_n`` (session 9): 64 always, 128 only at D = 64 on dense launches; anything else is a
    ValueError before a launch (the jagged launcher's own call is checked in ``test_varlen_rejects_block_n_128``)."""
    m = _mod()
    assert m.GluonDqConfig().block_n == 64 and m.default_config(64, True).block_n == 64  # default unchanged
    for bad in (32, 96, 256):
        with pytest.raises(ValueError, match="block_n must be one of"):
            m.GluonDqConfig(block_n=bad)
    for d in (64, 128):
        m.check_block_n(m.GluonDqConfig(), d)
        m.check_block_n(m.GluonDqConfig(), d, varlen=True)
    m.check_block_n(m.GluonDqConfig(block_n=128, split=True), 64)
    with pytest.raises(ValueError, match="head dim 64"):
        m.check_block_n(m.GluonDqConfig(block_n=128), 128)
    with pytest.raises(ValueError, match="jagged"):
        m.check_block_n(m.GluonDqConfig(block_n=128), 64, varlen=True)
    with pytest.raises(ValueError, match="head dim 64"):
        m.attn_bwd_dq_gluon(**_cpu_operands(D=128), config=m.GluonDqConfig(block_n=128))


def test_varlen_rejects_block_n_128(monkeypatch):
    """The jagged launcher checks ``block_n`` after its operand checks (stubbed here) and before any launch."""
    from types import SimpleNamespace

    m = _mod()
    monkeypatch.setattr(m, "check_varlen_operands", lambda *a, **k: (1, 64))
    op = lambda T, H: SimpleNamespace(data=torch.zeros(T, H, 64))  # noqa: E731
    args = (op(130, 4), op(200, 2), op(200, 2), op(200, 2), op(130, 4), torch.zeros(4, 130), torch.zeros(4, 256),
            torch.tensor([0, 130], dtype=torch.int32))
    with pytest.raises(ValueError, match="jagged"):
        m.attn_bwd_dq_gluon_varlen(*args, config=m.GluonDqConfig(block_n=128))
    with pytest.raises(ValueError, match="jagged"):
        m.attn_bwd_dq_gluon_varlen(*args, config=m.GluonDqConfig(block_n=128, split=True))


def test_tl_twin_config():
    """The tl dQ tiles each Gluon build is compared with: the dQ kernel's rows (128 on 8 warps, or 64 on 4 split)
    and ``dq_block_n = block_n``; the 64-key twins are the ones the GPU tests used before (``BwdConfig()``,
    ``split_tl_config()``)."""
    m = _mod()
    from mxattn.kernels.attn_bwd import BwdConfig

    G = m.GluonDqConfig
    assert m.tl_twin_config() == BwdConfig() == m.tl_twin_config(G())
    assert m.tl_twin_config(G(split=True)) == m.split_tl_config()
    whole, split = m.tl_twin_config(G(block_n=128)), m.tl_twin_config(G(split=True, block_n=128))
    assert (whole.dq_block_m, whole.dq_block_n, whole.dq_num_warps) == (128, 128, 8)
    assert (split.dq_block_m, split.dq_block_n, split.dq_num_warps) == (64, 128, 4)
    assert (split.block_m, split.block_n) == (64, 64)  # the dK/dV twin of the split builds is unchanged
    assert m.split_tl_config(dq_block_n=128) == split


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_tl_twin_block_n_128_interpreter(split, seed):
    """The tl dQ kernel takes the twin's 128-key tiles at d64: under the interpreter it matches its fp64 emulation
    with one dS exponent per (rows x 128) tile (``test_attn_bwd._check``, deterministic path; causal with a
    partial 128-key tile and diagonal tiles, GQA 2:1)."""
    m = _mod()
    from test_attn_bwd import _check, _inputs

    from mxattn.kernels.attn_bwd import BwdConfig

    cfg = m.tl_twin_config(m.GluonDqConfig(split=split, block_n=128))
    cfg = BwdConfig(**{**vars(cfg), "dq_kernel": True})
    q, k, v, do = _inputs(1, 150, 300, 2, 1, 64, "cpu", seed)
    _check(q, k, v, do, True, deterministic=True, config=cfg)


def test_launch_plan_block_n(monkeypatch):
    """block_n is part of the plan key (the config) and reaches the launch: BLOCK_N=128 with 128-key K / V_hdim
    boxes and 128-column K_seq boxes; a 64-key call of the same operands makes its own plan."""
    from test_attn_bwd_dkdv_gluon import _recorded_launches

    m = _mod()
    m._PLANS.clear()
    ops = _cpu_operands()
    cfgs = (m.GluonDqConfig(split=True, block_n=128), m.GluonDqConfig(split=True))
    for cfg in cfgs:
        seen = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dq_gluon(**ops, causal=True, config=cfg), n=2)
        (_, args, kw), _ = seen
        assert kw["BLOCK_N"] == cfg.block_n
        q_desc, _, k_desc, v_desc, ks_desc = args[:5]
        assert list(q_desc.block_shape) == [64, 64]
        assert list(k_desc.block_shape) == list(v_desc.block_shape) == [cfg.block_n, 64]
        assert list(ks_desc.block_shape) == [64, cfg.block_n]
    assert len(m._PLANS) == 2


def test_key_permuted_boxes(monkeypatch):
    """Host side of ``GluonDqConfig.k_perm``: where Sk % 16 == 0 the launch takes K_PERM with K and V_hdim through
    the forward's 5-D key-permuted view (rows by 16-key group, dims (G, a, b, e, channel) with strides
    (16r, 2r, 4r, r, 1)); with Sk % 16 != 0 or ``k_perm=False`` the 2-D boxes and K_PERM False."""
    from test_attn_bwd_dkdv_gluon import _recorded_launches, assert_permuted_box

    m = _mod()
    for Sk, cfg, want_perm in ((208, m.GluonDqConfig(split=True), True),
                               (208, m.GluonDqConfig(split=True, block_n=128), True),
                               (208, m.GluonDqConfig(split=True, k_perm=False), False),
                               (200, m.GluonDqConfig(split=True), False)):
        m._PLANS.clear()
        ops = _cpu_operands(B=2, Sk=Sk)
        (_, args, kw), = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dq_gluon(**ops, config=cfg), n=1)
        assert kw["K_PERM"] is want_perm
        k_desc, v_desc = args[2:4]
        r = 2 * 64  # Hkv * D
        for d in (k_desc, v_desc):
            if want_perm:
                assert_permuted_box(d, 2 * Sk, r, cfg.block_n, 64)
            else:
                assert list(d.shape) == [2 * Sk, r] and list(d.block_shape) == [cfg.block_n, 64]


def _compile_check(args):
    """``scripts/compile_check_bwd_dq_gluon.py args`` in a subprocess without TRITON_INTERPRET (conftest sets it on
    machines without a GPU, and a Gluon kernel does not compile under it); a skip off triton 3.6.  Returns the
    CompletedProcess."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    import subprocess

    root = os.path.dirname(_HERE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_check_bwd_dq_gluon.py"), *args],
                          capture_output=True, text=True, env=env, cwd=root, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--only", "d128_causal,d64"], ["--split", "--only", "d128,d128_causal"]],
                         ids=["whole", "split"])
def test_compiles_for_sm90_without_gpu(args):
    """Where triton 3.6 is installed (the GPU machine), the d128 causal and d64 kernels compile for sm_90a with the
    checks of ``scripts/compile_check_bwd_dq_gluon.py`` (no spills, e4m3 k32 wgmma, no ptxas serialization)."""
    r = _compile_check(args)
    assert r.returncode == 0 and "all variants OK" in r.stdout, (r.stdout[-4000:], r.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--split", "--block-n", "128", "--only", "d64_causal"],
                                  ["--block-n", "128", "--only", "d64"]], ids=["causal-split", "whole"])
def test_compiles_block_n_128_for_sm90_without_gpu(args):
    """Where triton 3.6 is installed, the 128-key step at d64 compiles for sm_90a with the same rules (no spills,
    e4m3 k32 wgmma, two WARPGROUP.DEPBAR per step, no ptxas serialization), with m64n128k32 for S / dP."""
    r = _compile_check(args)
    assert r.returncode == 0 and "all variants OK" in r.stdout, (r.stdout[-4000:], r.stderr[-2000:])
    assert "m64n128k32.f32.e4m3.e4m3" in r.stdout


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
    the wrong parity, or (split) empty barriers counting one arrival for two warpgroups is caught (deadlock, a TMA
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


def _gluon_case(case, config, seed):
    """Skips off Hopper; else the Gluon dq of ``case`` with ``config`` on fresh operands: (module, dq, operands,
    the forward's out, the bf16 inputs q, k, v, dout)."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    inputs = _gpu_inputs(case, seed)
    ops, out = m.dq_operands(*inputs, case[6])
    dq = m.attn_bwd_dq_gluon(**ops, causal=case[6], config=config(m))
    torch.cuda.synchronize()
    return m, dq, ops, out, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_matches_tl(case, split, seed):
    """Against the tl dQ kernel on the same operands, equal up to fp32 summation order (the same P and dS bits);
    rows that see no key exactly 0.  ``split`` (``GluonDqConfig(split=True)``: two 4-warp consumer partitions of 64
    rows, dS exponent per 64 x 64 tile) against the tl dQ kernel with 64-row blocks."""
    m, dq, ops, out, (q, k, v, dout) = _gluon_case(case, lambda m: m.GluonDqConfig(split=split), seed)
    causal = case[6]
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


def _ramped_inputs(D, seed):
    """(1, 256, 2048, 2, 2, D) inputs whose V rows change by many binades along the keys (so do dP and dS)."""
    q, k, v, dout = _gpu_inputs((1, 256, 2048, 2, 2, D, False), seed)
    ramp = torch.logspace(-6, 3, 2048, base=2.0, device="cuda").view(1, -1, 1, 1)
    v = (v.float() * ramp.flip(1) * ramp.roll(700, 1)).to(torch.bfloat16)
    return q, k, v, dout


@pytest.mark.gpu
def test_attn_bwd_dq_gluon_exponent_moves(seed):
    """dS magnitudes that change by many binades along the keys: the exponent leaves the hysteresis window and
    the accumulator is rescaled (both ways), and the output scale / grad dtype options are passed through."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    q, k, v, dout = _ramped_inputs(128, seed)
    ops, out = m.dq_operands(q, k, v, dout, False)
    dq = m.attn_bwd_dq_gluon(**ops, grad_dtype=torch.float32)
    want = _tl_deterministic_dq(q, k, v, dout, ops, out, False).float()
    _assert_agree(dq, want, "exponent moves")


# the 128-key step (GluonDqConfig(block_n=128), session 9): d64 only, against the tl dQ kernel with dq_block_n=128
BLOCK_N_128_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (1, 1, 1, 2, 2, 64, True),  # tiny: one query, one key (a 128-key box over one key)
    (2, 113, 203, 4, 2, 64, True),  # partial tiles, TMA rows into the next batch, GQA 2:1
    (1, 1000, 1000, 4, 4, 64, False),  # odd S: a last tile of 104 keys
    (1, 1000, 1000, 4, 4, 64, True),  # diagonal tiles of 128 keys across the two warpgroups' rows
    (2, 1000, 1000, 16, 2, 64, True),  # GQA 8:1
    (1, 1000, 300, 4, 2, 64, True),  # causal Sq > Sk: query rows that see no key
]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", BLOCK_N_128_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_block_n_128_matches_tl(case, split, seed):
    """The 128-key step against its tl twin (``tl_twin_config``: the tl dQ kernel with ``dq_block_n=128``, 128
    rows on 8 warps or 64 rows on 4 split): the same 128-key tiles in the same order and dS exponents per (rows x
    128) tile, so equal up to fp32 summation order."""
    m, dq, ops, _, _ = _gluon_case(case, lambda m: m.GluonDqConfig(split=split, block_n=128), seed)
    want = m._tl_dq(**ops, causal=case[6], tl_config=m.tl_twin_config(m.GluonDqConfig(split=split, block_n=128)))
    _assert_agree(dq, want, _case_id(case) + (" split" if split else "") + " block_n=128")


@pytest.mark.gpu
def test_attn_bwd_dq_gluon_block_n_128_exponent_moves(seed):
    """``test_attn_bwd_dq_gluon_exponent_moves`` at d64 with the split 128-key step: the exponent of each 64 x 128
    tile leaves the hysteresis window both ways and the accumulator is rescaled, as in the tl twin."""
    if not _is_hopper():
        pytest.skip("the Gluon dQ kernel needs an sm_90 GPU")
    m = _mod()
    q, k, v, dout = _ramped_inputs(64, seed)
    ops, _ = m.dq_operands(q, k, v, dout, False)
    cfg = m.GluonDqConfig(split=True, block_n=128)
    dq = m.attn_bwd_dq_gluon(**ops, grad_dtype=torch.float32, config=cfg)
    want = m._tl_dq(**ops, grad_dtype=torch.float32, tl_config=m.tl_twin_config(cfg))
    _assert_agree(dq, want.float(), "exponent moves, block_n=128")


K_PERM_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal (Sk % 16 == 0: the key-permuted boxes)
    (1, 1023, 1024, 4, 4, 128, True),
    (3, 129, 256, 2, 1, 128, False),  # MQA; TMA rows into the next batch
    (1, 300, 3008, 2, 2, 128, True),  # Sq < Sk; a masked last tile of 64 keys (3008 = 47 * 64)
    (2, 1000, 1008, 16, 2, 64, False),  # GQA 8:1; a masked last tile
    (1, 3000, 304, 2, 2, 64, True),  # Sq > Sk: rows that see no key
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(split=False), dict(split=True), dict(split=True, block_n=128)], ids=str)
@pytest.mark.parametrize("case", K_PERM_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_k_perm_bit_identical(case, variant, seed):
    """``k_perm`` (K and V_hdim key-permuted, dS relabelled into the A operand) against the 2-D boxes on the same
    operands: the same S, dP, dS values and e4m3 bits in the same wgmma positions, so dq is bit-identical."""
    if variant.get("block_n") == 128 and case[5] != 64:
        pytest.skip("block_n=128 is a d64 build")
    m, dq, ops, _, _ = _gluon_case(case, lambda m: m.GluonDqConfig(**variant), seed)
    want = m.attn_bwd_dq_gluon(**ops, causal=case[6], config=m.GluonDqConfig(**variant, k_perm=False))
    assert torch.equal(dq.view(torch.int16), want.view(torch.int16)), _case_id(case)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(split=False), dict(split=True), dict(split=True, block_n=128),
                                     dict(split=True, k_perm=False)], ids=["whole", "split", "split-bn128", "split-k2d"])
@pytest.mark.parametrize("case", K_PERM_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_amax_slots_bit_identical(case, variant, seed):
    """``amax_slots`` (the dS tile's maximum through one shared slot per warp) against the compiler's reduction
    across warps: the same maximum, so the same exponents and dq bit for bit."""
    if variant.get("block_n") == 128 and case[5] != 64:
        pytest.skip("block_n=128 is a d64 build")
    m, dq, ops, _, _ = _gluon_case(case, lambda m: m.GluonDqConfig(**variant, amax_slots=True), seed)
    want = m.attn_bwd_dq_gluon(**ops, causal=case[6], config=m.GluonDqConfig(**variant, amax_slots=False))
    assert torch.equal(dq.view(torch.int16), want.view(torch.int16)), _case_id(case)


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
    assert all(d.base is None for d in next(iter(m._PLANS.values()))[1])  # no call's tensors held
    _same_launch(seen[0], seen[1])
    monkeypatch.setattr(m, "_check", lambda *a: pytest.fail("a plan hit runs no checks"))
    other = _cpu_operands()
    seen2 = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dq_gluon(**other, causal=True), n=1)
    _same_launch(seen[0], seen2[0])
    assert seen2[0][1][0].base.data_ptr() == other["q"].data.data_ptr()


# ------------------------------------------------------------------------------------------------- causal CTA order
LPT_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (2, 4224, 4224, 3, 3, 128, True),  # 33 query blocks, 6 heads: one section of all (g = 8 at 132 SMs)
    (3, 2560, 2560, 4, 2, 64, True),  # GQA: 20 blocks, 12 heads, one section (g = 14)
    (1, 3000, 4096, 6, 3, 128, True),  # Sq < Sk (bottom-right): 24 blocks
    (1, 1000, 1000, 2, 2, 128, False),  # non-causal: the order is not changed
]


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 4, 45], ids=["sms", "sms4", "sms45"])
@pytest.mark.parametrize("case", LPT_CASES, ids=_case_id)
def test_attn_bwd_dq_gluon_causal_lpt_bit_identical(case, sms, seed, monkeypatch):
    """``causal_lpt`` (CTAs over sections of heads, heaviest query block first) against head-by-head order: the
    same CTAs on the same tiles, so dq bit for bit.  A stand-in SM count of 4 or 45 makes sections of one to five
    heads with a remainder, as long sequences have.  A CTA order that skipped or repeated a tile leaves rows
    unwritten."""
    m = _mod()
    if sms is not None:
        monkeypatch.setattr(m, "_sm_count", lambda dev: sms)
    monkeypatch.setattr(m, "_PLANS", {})  # (no plan made here outlives the test)
    _, dq, ops, _, _ = _gluon_case(case, lambda m: m.GluonDqConfig(split=True, causal_lpt=True), seed)
    want = m.attn_bwd_dq_gluon(**ops, causal=case[6], config=m.GluonDqConfig(split=True, causal_lpt=False))
    assert torch.equal(dq.view(torch.int16), want.view(torch.int16)), _case_id(case)
