"""The warp-specialized Gluon forward (``mxattn/kernels/attn_fwd_gluon.py``).

CPU: the module imports (under triton 3.6, the GPU machine's version, it must; under another triton it may fail,
Gluon's API moves between releases, and the test then skips); under triton 3.6 the d128 causal kernel compiles for
sm_90a and passes the compile check's rules; and a pure-Python model of the kernel's mbarrier
protocol (producer ring + two ping-ponging consumers, same parity formulas as the kernel) runs under random
interleavings without deadlock, never overwrites a buffer a wgmma still reads, and alternates the issue blocks.
The sm_90a compile check is ``scripts/compile_check_gluon.py`` (needs triton 3.6, no GPU).

GPU (marker ``gpu``): the kernel against the reference with the calibrated bound of ``test_attn_fwd``
(``_check_against_reference``, reused with the Gluon launcher in place of the ``tl`` one), and against the ``tl``
kernel.  ``bench_gluon_vs_tl(shapes)`` times the Gluon kernel, the ``tl`` kernel (both on prepared FP8 operands)
and SDPA cuDNN BF16 in one run; ``python tests/test_attn_fwd_gluon.py [--quick] [--out FILE]`` prints the table
(and writes the rows to a JSON file).
"""

from __future__ import annotations

import collections
import os
import random
import statistics
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # test_attn_fwd (pytest puts it there too)
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(_HERE))  # mxattn, when run as a script from anywhere
from conftest import MBarrierModel, import_gluon_module, triton_version  # noqa: E402
from test_attn_fwd import _check_against_reference, _inputs  # noqa: E402


def _gluon():
    return import_gluon_module("attn_fwd_gluon")


# ---------------------------------------------------------------------------------------------------- CPU
def test_module_imports():
    m = _gluon()
    assert callable(m.attn_fwd_gluon)
    assert m.default_config(128, False).block_n == 128


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--only", "d128_causal,d64_nopingpong"],
                                  ["--only", "d128_nopingpong", "--exp2-fma", "25"],
                                  ["--only", "d128_nopingpong,d64_causal_nopingpong", "--out-store", "rows"]],
                         ids=["default", "exp2_fma", "out_rows"])
def test_compiles_for_sm90_without_gpu(args):
    """Where triton 3.6 is installed (the GPU machine), the kernels compile for sm_90a with the checks of
    ``scripts/compile_check_gluon.py`` (no spills, e4m3 wgmma, no ptxas wgmma serialization, two DEPBAR a step).
    In a subprocess without TRITON_INTERPRET: conftest sets it on machines without CUDA, and the kernels' ``tl``
    helpers are then interpreter objects Gluon cannot compile."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    _gluon()
    import subprocess

    root = os.path.dirname(_HERE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_check_gluon.py"), *args],
                       capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 0 and "all variants OK" in r.stdout, (args, r.stdout[-4000:], r.stderr[-2000:])


def _host_operands(B, Sq, Sk, Hq, Hkv, D, k_heads_alloc=None):
    """CPU operands shaped like the launcher's (only ``.data`` is read by ``_descriptors``); K optionally a
    head slice of a wider buffer (row pitch k_heads_alloc * D > Hkv * D)."""
    from types import SimpleNamespace

    from mxattn.formats import channel_major

    f8 = torch.float8_e4m3fn
    q = torch.zeros(B, Sq, Hq, D, dtype=f8)
    k = torch.zeros(B, Sk, k_heads_alloc or Hkv, D, dtype=f8)[:, :, :Hkv]
    v = channel_major(torch.zeros(B, Sk, Hkv, D, dtype=f8))
    return SimpleNamespace(data=q), SimpleNamespace(data=k), SimpleNamespace(data=v)


def _plan_operands(B=2, Sq=300, Sk=272, Hq=4, Hkv=2, D=128, k_heads_alloc=None):
    """RowScaledFP8 operands in the launcher's layouts (Q rows, K in 128-key groups, V channel-major) on the CPU."""
    from mxattn.formats import RowScaledFP8

    q, k, v = _host_operands(B, Sq, Sk, Hq, Hkv, D, k_heads_alloc)
    i32 = torch.int32
    return (RowScaledFP8(q.data, torch.zeros(B, Sq, Hq, 1, dtype=i32), 3),
            RowScaledFP8(k.data, torch.zeros(B, -(-Sk // 128), Hkv, 1, dtype=i32), 3, 1, 128),
            RowScaledFP8(v.data, torch.zeros(B, 1, Hkv, D, dtype=i32), 1))


def _recorded(monkeypatch):
    from mxattn.kernels import launch as L

    seen = []
    monkeypatch.setattr(L.FastLauncher, "launch", lambda self, grid, args, kwargs: seen.append(
        (self.jit_fn, grid, args, kwargs)))
    return seen


@pytest.mark.parametrize("causal", [False, True])
def test_launch_plan_repeats_the_checked_launch(causal, monkeypatch):
    """A repeated call of one signature takes the launch plan (no descriptor constructors, a bound launch): the same
    kernel, grid, keywords and arguments as the first call's, over the new call's own tensors; another signature,
    an explicit config or a K that needs a copy for TMA takes the checked path."""
    from test_attn_bwd_dkdv_gluon import _same_launch

    m = _gluon()
    m._PLANS.clear()
    seen = _recorded(monkeypatch)
    first = _plan_operands()
    m.attn_fwd_gluon(*first, causal=causal)
    assert len(m._PLANS) == 1
    monkeypatch.setattr(m, "_descriptors", lambda *a, **kw: pytest.fail("a plan hit builds no descriptors"))
    other = _plan_operands()  # fresh tensors, the same signature
    out, lse = m.attn_fwd_gluon(*other, causal=causal)
    assert out.shape == other[0].data.shape and lse.shape == (2, 4, 300)
    assert len(seen) == 2 and seen[0][0] is seen[1][0]
    _same_launch(seen[0][1:], seen[1][1:])
    args = seen[1][2]
    assert [a.base.data_ptr() for a in args[:3]] == [t.data.data_ptr() for t in other]  # this call's tensors
    assert args[3] is other[0].exp and args[6] is out and args[7] is lse
    monkeypatch.undo()
    seen = _recorded(monkeypatch)
    m.attn_fwd_gluon(*_plan_operands(Sq=301), causal=causal)  # another signature: a second plan
    assert len(m._PLANS) == 2
    m.attn_fwd_gluon(*other, causal=causal, config=m.GluonFwdConfig(persistent=False))  # explicit config: no plan
    assert len(m._PLANS) == 2 and seen[-1][0] is m._attn_fwd_ws_kernel
    m._PLANS.clear()
    from mxattn.formats import RowScaledFP8

    q, k, v = _plan_operands()
    k_heads_major = torch.zeros(2, 2, 272, 128, dtype=k.data.dtype).transpose(1, 2)  # heads not adjacent in a row
    k = RowScaledFP8(k_heads_major, k.exp, 3, 1, 128)
    m.attn_fwd_gluon(q, k, v, causal=causal)  # K copied for TMA on every call: no plan
    assert seen[-1][2][1].base is not k.data and len(m._PLANS) == 0


def test_config_values_checked_before_launch(monkeypatch):
    m = _gluon()
    seen = _recorded(monkeypatch)
    ops = _plan_operands()
    for bad, msg in ((dict(mask="fast"), "mask"), (dict(out_store="tma"), "out_store"), (dict(exp2_fma=10), "exp2_fma"),
                     (dict(pingpong=True), "pingpong")):
        with pytest.raises(ValueError, match=msg):
            m.attn_fwd_gluon(*ops, config=m.GluonFwdConfig(**bad))
    assert seen == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lean_mask_arithmetic_matches_select(seed):
    """The identities ``GluonFwdConfig.mask="lean"`` rests on, in torch fp32 on the CPU (the kernel's own bits are
    compared on the GPU): one per-row bound min(row + Sk - Sq - n0, Sk - n0 - 1) keeps exactly the keys the two
    compares keep; the row max of the raw scores times rs > 0 equals the row max of the scaled scores bit for bit
    (rounding is monotonic), subnormal, huge and infinite scores included; and where(keep, 2^x, 0) equals
    where(x == -inf, 0, 2^x) of the select path's x."""
    g = torch.Generator().manual_seed(seed)
    M, N = 64, 128
    for Sq, Sk, n0, row0 in ((2048, 2048, 1920, 1920), (1000, 1003, 896, 960), (5, 300, 256, 0), (300, 40, 0, 256)):
        rows = row0 + torch.arange(M)[:, None]
        cols = torch.arange(N)[None, :]
        two = (cols < Sk - n0) & (cols <= rows + (Sk - Sq) - n0)
        one = cols <= torch.minimum(rows + (Sk - Sq) - n0, torch.tensor(Sk - n0 - 1))
        assert torch.equal(one, two)
    qk = torch.randn(M, N, generator=g) * torch.logspace(-40, 37, M)[:, None]
    qk[0, :7] = torch.tensor([float("inf"), -float("inf"), 1e-45, -1e-45, 3e38, -3e38, 0.0])
    rs = torch.rand(M, generator=g) * torch.logspace(-3, 3, M) + 1e-30  # > 0
    keep = torch.rand(M, N, generator=g) < 0.7
    keep[1] = False  # a row that sees nothing yet
    ninf = torch.tensor(float("-inf"))
    sel = torch.where(keep, qk * rs[:, None], ninf).amax(1)
    lean = torch.where(keep, qk, ninf).amax(1) * rs
    assert torch.equal(sel, lean)
    m_new = torch.where(lean == ninf, torch.tensor(0.0), lean)
    x_lean = torch.addcmul((8.0 - m_new)[:, None], qk, rs[:, None])
    x_sel = torch.where(keep, x_lean, ninf)
    p_sel = torch.where(x_sel == ninf, torch.tensor(0.0), torch.exp2(x_sel))
    p_lean = torch.where(keep, torch.exp2(x_lean), torch.tensor(0.0))
    assert torch.equal(p_sel.nan_to_num(-1.0), p_lean.nan_to_num(-1.0))


def _sigma(c: int) -> int:
    """Key held by S column / K tile row c under K_PERM (mirror of ``_key_of_column``)."""
    return (c & ~15) | (((c >> 1) & 3) << 2) | (((c >> 3) & 1) << 1) | (c & 1)


@pytest.mark.parametrize("B,Sk,Hkv,D,k_heads_alloc,block_n,k_perm,expect_perm", [
    (2, 1024, 2, 128, None, 128, True, True),
    (1, 4224, 2, 64, None, 128, True, True),
    (3, 16, 1, 128, 3, 128, True, True),  # one 16-key group per sequence; padded row pitch (3 heads allocated)
    (2, 1024, 2, 128, None, 64, True, True),
    (2, 1000, 2, 128, None, 128, True, False),  # Sk % 16 = 8: B * Sk % 16 == 0 but odd b starts mid-group
    (1, 203, 4, 64, None, 128, True, False),
    (2, 1024, 2, 128, None, 128, False, False),  # GluonFwdConfig(k_perm=False)
])
def test_k_descriptor_paths(B, Sk, Hkv, D, k_heads_alloc, block_n, k_perm, expect_perm):
    """Host side of K_PERM: which K descriptor the launcher builds (5-D key-permuted when Sk % 16 == 0, else the
    2-D fallback), its shape / strides / block / layout, and that the box's row order is the permutation the kernel
    assumes (masks by ``_key_of_column``, P relabelled into V's natural key order by ``_to_operand``)."""
    m = _gluon()
    q, k, v = _host_operands(B, 5, Sk, Hkv, Hkv, D, k_heads_alloc)
    _, kd, _, use_perm = m._descriptors(q, k, v, block_n, k_perm)
    assert use_perm == expect_perm == (k_perm and m.k_perm_ok(Sk, block_n))
    r = (k_heads_alloc or Hkv) * D  # row pitch of K's (B*Sk, r) view
    assert kd.base.data_ptr() == k.data.data_ptr()  # no copy of K on either path
    if not use_perm:
        assert (list(kd.shape), list(kd.strides), list(kd.block_shape)) == ([B * Sk, r], [r, 1], [block_n, D])
        assert kd.layout.rank == 2
        return
    assert list(kd.shape) == [B * Sk // 16, 2, 4, 2, r]
    assert list(kd.strides) == [16 * r, 2 * r, 4 * r, r, 1]
    assert list(kd.block_shape) == [block_n // 16, 2, 4, 2, D]
    two_d = m.nvmma_fp8_layout(block_n, D)
    assert kd.layout.rank == 5 and kd.layout.swizzle_byte_width == two_d.swizzle_byte_width
    # the box stores its elements row-major: box row c = 16 G + 8 a + 2 b + e reads global row G*16 + 2a + 4b + e
    rows = []
    for G in range(block_n // 16):
        for a in range(2):
            for b in range(4):
                for e in range(2):
                    off = G * kd.strides[0] + a * kd.strides[1] + b * kd.strides[2] + e * kd.strides[3]
                    assert off % r == 0
                    rows.append(off // r)
    assert rows == [_sigma(c) for c in range(block_n)]
    assert sorted(rows) == list(range(block_n))  # a permutation inside the tile: same keys, same K exponent
    assert all(rows[c] // 16 == c // 16 for c in range(block_n))  # inside 16-key groups
    # _to_operand's relabel: reshape [N/16, 2, 4, 2], swap dims 1 and 2, reshape back; new column n takes old
    # column perm[n], which must hold key n (P V then pairs P's key n with V's row n, natural order)
    perm = torch.arange(block_n).reshape(block_n // 16, 2, 4, 2).permute(0, 2, 1, 3).reshape(block_n).tolist()
    assert [_sigma(c) for c in perm] == list(range(block_n))


def _protocol_model(n_tiles: int, stages: int, pingpong: bool, rng: random.Random, items=None,
                    mutant: str = "") -> list:
    """Run producer + consumers 0/1 as generators under a random scheduler; TMA loads land at random later
    times.  Mirrors ``_producer``, ``_attend`` and ``_turn_wait`` / ``_turn_pass``; with ``items`` (key tiles per
    work item) the persistent kernel's ``_producer_persistent`` / ``_consumer_persistent``: the ring position runs
    on across items, Q's buffer is refilled after both consumers arrive on ``q_empty``.  Returns the issue order
    ((wg, j) for one item, (wg, item, j) for several).  ``mutant="no_k_wait"``: the producer loads K without waiting
    for the stage's K release."""
    S = stages
    persistent = items is not None
    items = [n_tiles] if items is None else items
    q_bar = MBarrierModel(1)
    q_empty = MBarrierModel(2)
    k_ready = [MBarrierModel(1) for _ in range(S)]
    v_ready = [MBarrierModel(1) for _ in range(S)]
    k_empty = [MBarrierModel(2) for _ in range(S)]
    v_empty = [MBarrierModel(2) for _ in range(S)]
    turn = [MBarrierModel(1), MBarrierModel(1)]
    k_buf, v_buf = [None] * S, [None] * S  # tile id that landed in each buffer
    q_buf = [None]
    readers = collections.defaultdict(set)  # ("k"|"v", stage) or ("q", 0) -> WGs whose wgmma may still read it
    inflight = []  # pending TMA completions: (bar, nbytes, action)
    issues = []

    def tma(bar, kind, s, tile):
        key = (kind, s)
        assert not readers[key], f"TMA overwrites {key} while WG {readers[key]} may still read it"

        def land():
            {"k": k_buf, "v": v_buf, "q": q_buf}[kind][s] = tile

        inflight.append((bar, 1, land))

    def producer():
        it = 0
        for w, n in enumerate(items):
            if persistent:
                yield lambda: q_empty.ready((w & 1) ^ 1)
            q_bar.expect_arrive(2)
            tma(q_bar, "q", 0, w)
            inflight.append((q_bar, 1, lambda: None))
            for i in range(n):
                g = it + i
                s, ph = g % S, ((g // S) & 1) ^ 1
                if mutant != "no_k_wait":
                    yield lambda: k_empty[s].ready(ph)
                k_ready[s].expect_arrive(1)
                tma(k_ready[s], "k", s, (w, i))
                yield lambda: v_empty[s].ready(ph)
                v_ready[s].expect_arrive(1)
                tma(v_ready[s], "v", s, (w, i))
            it += n

    def turn_wait(wg, k):
        if not pingpong:
            return lambda: True
        if wg == 0:
            return lambda: turn[0].ready((k & 1) ^ 1)
        return lambda: turn[1].ready(((k + 1) & 1) ^ 1)

    def turn_pass(wg):
        if pingpong:
            turn[1 - wg].arrive()

    def read(kind, s, tile, wg):
        buf = {"k": k_buf, "v": v_buf, "q": q_buf}[kind]
        assert buf[s] == tile, f"WG{wg} reads {kind}[{s}] = tile {buf[s]}, wants {tile}"
        readers[(kind, s)].add(wg)

    def release(bar, kind, s, wg):
        readers[(kind, s)].discard(wg)
        if bar is not None:
            bar.arrive()

    def issued(wg, w, j):
        issues.append((wg, w, j) if persistent else (wg, j))

    def consumer(wg):
        it = 0
        for w, n in enumerate(items):
            yield lambda: q_bar.ready(w & 1)
            read("q", 0, w, wg)
            if n:
                yield from attend(wg, w, n, it)
            release(q_empty if persistent else None, "q", 0, wg)
            it += n

    def attend(wg, w, n, it):
        s0 = it % S
        yield lambda: k_ready[s0].ready((it // S) & 1)
        yield turn_wait(wg, 0)
        read("k", s0, (w, 0), wg)
        issued(wg, w, 0)
        turn_pass(wg)
        yield lambda: True  # wgmma wait
        release(k_empty[s0], "k", s0, wg)
        for j in range(1, n):
            g = it + j
            s, sv = g % S, (g - 1) % S
            yield lambda: k_ready[s].ready((g // S) & 1)
            yield lambda: v_ready[sv].ready(((g - 1) // S) & 1)
            yield turn_wait(wg, j)
            read("k", s, (w, j), wg)
            read("v", sv, (w, j - 1), wg)
            issued(wg, w, j)
            turn_pass(wg)
            yield lambda: True  # softmax under the P V product
            release(k_empty[s], "k", s, wg)
            yield lambda: True
            release(v_empty[sv], "v", sv, wg)
        g = it + n - 1
        sv = g % S
        yield lambda: v_ready[sv].ready((g // S) & 1)
        yield turn_wait(wg, n)
        read("v", sv, (w, n - 1), wg)
        issued(wg, w, n)
        turn_pass(wg)
        yield lambda: True
        release(v_empty[sv], "v", sv, wg)

    agents = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {name: (lambda: True) for name in agents}
    for _ in range(100000):
        if not agents and not inflight:
            return issues
        choices = [n for n in agents if waiting[n]()] + (["tma"] if inflight else [])
        assert choices, f"deadlock: agents {list(agents)} all blocked, no TMA in flight"
        pick = rng.choice(choices)
        if pick == "tma":
            bar, nb, land = inflight.pop(rng.randrange(len(inflight)))
            land()
            bar.complete_tx(nb)
            continue
        try:
            waiting[pick] = next(agents[pick])
        except StopIteration:
            del agents[pick]
            del waiting[pick]
    raise AssertionError("model did not finish")


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("pingpong", [True, False])
def test_barrier_protocol_model(stages, pingpong, seed):
    rng = random.Random(seed)
    for n_tiles in [0, 1, 2, 3, 4, 7, 17]:
        for _ in range(20):
            issues = _protocol_model(n_tiles, stages, pingpong, rng)
            blocks = n_tiles + 1 if n_tiles else 0
            assert sorted(issues) == sorted((wg, k) for wg in (0, 1) for k in range(blocks))
            if pingpong:  # issue blocks strictly alternate, WG0 first
                assert issues == [(wg, k) for k in range(blocks) for wg in (0, 1)]


@pytest.mark.parametrize("stages", [2, 3])
def test_barrier_protocol_model_persistent(stages, seed):
    """The persistent kernel's protocol (``GluonFwdConfig.persistent``): work items of any number of key tiles,
    0 included (causal rows that see nothing), one after another through the same ring and Q buffer: no deadlock,
    no TMA into a buffer a wgmma may still read (Q included), every read sees its own item's tile."""
    rng = random.Random(seed)
    for _ in range(60):
        items = [rng.choice([0, 1, 2, 3, 5, 16]) for _ in range(rng.randint(1, 6))]
        issues = _protocol_model(0, stages, False, rng, items=items)
        want = [(wg, w, k) for w, n in enumerate(items) for wg in (0, 1) for k in range(n + 1 if n else 0)]
        assert sorted(issues) == sorted(want)
        for wg in (0, 1):  # each consumer walks the items in order
            assert [i for i in issues if i[0] == wg] == [i for i in want if i[0] == wg]


def test_barrier_protocol_model_catches_a_missing_k_wait(seed):
    """The model is not vacuous: a producer that loads K without waiting for the stage's K release is caught (a TMA
    into a buffer a wgmma still reads, a read of the wrong tile, or an mbarrier phase overrun)."""
    rng = random.Random(seed)
    with pytest.raises(AssertionError):
        for _ in range(300):
            _protocol_model(9, 2, False, rng, mutant="no_k_wait")


# ---------------------------------------------------------------------------------------------------- GPU
def _use_gluon(monkeypatch, config=None):
    """Route ``_check_against_reference`` (which calls ``attn_fwd.attn_fwd_hopper``) to the Gluon launcher."""
    from mxattn.kernels import attn_fwd

    m = _gluon()

    def launch(q, k, v, *, causal=False, softmax_scale=None, out_dtype=torch.bfloat16, config=None):
        return m.attn_fwd_gluon(q, k, v, causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype,
                                config=gluon_config)

    gluon_config = config
    monkeypatch.setattr(attn_fwd, "attn_fwd_hopper", launch)


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (1, 1, 1, 2, 2, 128, False),
    (1, 1, 1, 2, 2, 64, True),
    (2, 113, 203, 4, 4, 128, False),
    (2, 113, 203, 4, 4, 64, True),
    (1, 1023, 1024, 4, 4, 128, True),
    (1, 1023, 1024, 4, 4, 64, False),
    (1, 4224, 4224, 2, 2, 128, False),
    (1, 4224, 4224, 2, 2, 128, True),
    (1, 4224, 4224, 2, 2, 64, True),
    (2, 1000, 1000, 16, 2, 128, True),  # GQA 8:1
    (2, 1000, 1000, 16, 2, 64, False),  # GQA 8:1
    (1, 2048, 2048, 8, 1, 64, False),  # MQA
    (1, 300, 5000, 2, 2, 128, True),  # Sq < Sk, bottom-right
    (1, 5000, 300, 2, 2, 128, True),  # Sq > Sk: empty rows
    (3, 129, 257, 2, 2, 128, False),  # 128-row block boundaries, Q/K TMA rows read into the next sequence
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + ("c" if c[6] else "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_attn_fwd_gluon_gpu(case, seed, monkeypatch):
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    B, Sq, Sk, Hq, Hkv, D, causal = case
    _use_gluon(monkeypatch)
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed)
    _check_against_reference(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(persistent=False, pingpong=True), dict(stages=2), dict(stages=4),
                                     dict(exp2_fma=25), dict(exp2_fma=50), dict(out_store="mma"),
                                     dict(persistent=False), dict(persistent=False, stages=2),
                                     dict(persistent=False, out_store="mma"), dict(mask="lean")],
                         ids=str)
def test_attn_fwd_gluon_gpu_configs(variant, seed, monkeypatch):
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    m = _gluon()
    for D in (64, 128):
        cfg = dataclasses.replace(m.default_config(D, False), **variant)
        _use_gluon(monkeypatch, cfg)
        q, k, v = _inputs(1, 700, 1200, 4, 2, D, "cuda", seed + D)
        for causal in (False, True):
            _check_against_reference(q, k, v, causal)


@pytest.mark.gpu
def test_attn_fwd_gluon_gpu_late_max(seed, monkeypatch):
    """The dominant key comes last: earlier tiles' P was quantized under a smaller running max."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    _use_gluon(monkeypatch)
    q, k, v = _inputs(1, 256, 4096, 2, 2, 128, "cuda", seed)
    direction = torch.randn(1, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    q = 0.3 * q + direction
    k[:, -1:] = 3 * direction
    _check_against_reference(q, k, v, False)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_matches_tl(causal, seed):
    """Same tiles of 128 keys, same running max and e4m3 P as the ``tl`` kernel: outputs agree closely."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    from mxattn import reference
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    q, k, v = _inputs(2, 1500, 1700, 8, 2, 128, "cuda", seed)
    ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
    out_g, lse_g = m.attn_fwd_gluon(*ops, causal=causal)
    out_t, lse_t = attn_fwd_hopper(*ops, causal=causal)
    assert reference.sqnr_db(out_g.double(), out_t.double()) > 35
    fin = torch.isfinite(lse_t)
    assert torch.equal(fin, torch.isfinite(lse_g))
    assert (lse_g[fin] - lse_t[fin]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_k_perm_matches_2d(causal, seed):
    """K_PERM (K key-permuted, Sk % 16 == 0) against the 2-D K path on the same operands: P V's operands are the
    same bytes in the same key order, the row max is exact; only the fp32 row sum adds in another order (ulps)."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    for B, Sq, Sk, D in ((2, 700, 1024, 128), (1, 300, 2064, 64), (3, 129, 48, 128)):
        q, k, v = _inputs(B, Sq, Sk, 4, 2, D, "cuda", seed + Sk)
        ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        cfg = m.default_config(D, causal)
        assert m.k_perm_ok(Sk, cfg.block_n)
        out_p, lse_p = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, k_perm=True))
        out_2, lse_2 = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, k_perm=False))
        fin = torch.isfinite(lse_2)
        assert torch.equal(fin, torch.isfinite(lse_p))
        assert (lse_p[fin] - lse_2[fin]).abs().max().item() < 1e-5
        assert (out_p.float() - out_2.float()).abs().max().item() <= 1e-2 * out_2.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("k_perm", [True, False], ids=["kperm", "k2d"])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_packed_p_carry(causal, k_perm, seed):
    """P carried across the loop edge as packed e4m3 words (``GluonFwdConfig.p_carry="i32br"``) against the fp32
    carry on the same operands: the same e4m3 bytes (RN, satfinite) enter the same P V product and the row sums are
    the same fp32 values in the same order, so out and lse are bit-identical; odd lengths, masked tiles, GQA, d64."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    for B, Sq, Sk, Hq, Hkv, D in ((2, 700, 1024, 4, 2, 128), (1, 300, 2064, 4, 4, 64), (3, 129, 48, 2, 2, 128),
                                  (1, 1000, 1003, 2, 1, 128)):
        q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed + Sk)
        ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        cfg = dataclasses.replace(m.default_config(D, causal), k_perm=k_perm)
        out_f, lse_f = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, p_carry="fp32"))
        out_w, lse_w = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, p_carry="i32br"))
        assert torch.equal(out_w, out_f), f"out {B, Sq, Sk, Hq, Hkv, D}"
        assert torch.equal(lse_w, lse_f), f"lse {B, Sq, Sk, Hq, Hkv, D}"


@pytest.mark.gpu
@pytest.mark.parametrize("exp2_fma", [25, 50])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_exp2_fma_close(causal, exp2_fma, seed):
    """exp2 partly on the FMA pipe against the MUFU-only kernel on the same operands: lse within 2e-4 (the
    polynomial's 1e-4 relative error in the row sums), out within a few e4m3 steps on a few P values (> 40 dB
    SQNR against each other); a NaN key gives NaN in the same places (every row that sees it)."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    from mxattn import reference
    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    for B, Sq, Sk, Hq, Hkv, D in ((2, 700, 1024, 4, 2, 128), (1, 300, 2064, 4, 4, 64), (1, 1000, 1003, 2, 1, 128)):
        q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed + Sk)
        k[0, Sk // 3, 0, 5] = float("nan")
        ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        cfg = m.default_config(D, causal)
        out_0, lse_0 = m.attn_fwd_gluon(*ops, causal=causal, config=cfg)
        out_f, lse_f = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, exp2_fma=exp2_fma))
        nan = torch.isnan(out_0)
        assert nan.any() and torch.equal(nan, torch.isnan(out_f)), f"NaN pattern {B, Sq, Sk, Hq, Hkv, D}"
        assert torch.equal(torch.isnan(lse_0), torch.isnan(lse_f))
        fin = torch.isfinite(lse_0)
        assert torch.equal(fin, torch.isfinite(lse_f))
        if fin.any():  # (every row sees the NaN key when there is one KV head and no mask)
            assert (lse_f[fin] - lse_0[fin]).abs().max().item() < 2e-4
        ok = ~nan
        assert reference.sqnr_db(out_f[ok].double(), out_0[ok].double()) > 40


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(persistent=True), dict(out_store="rows"),
                                     dict(persistent=True, out_store="rows"), dict(mask="lean"),
                                     dict(persistent=True, out_store="rows", mask="lean"), dict(causal_lpt=True)],
                         ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_variant_bit_identical(causal, variant, seed, monkeypatch):
    """The persistent kernel (``GluonFwdConfig.persistent``) computes each work item as the one-CTA-per-block
    kernel does, the row-wise output store (``out_store="rows"``) writes the same values and the lean masked-tile
    arithmetic (``mask="lean"``) computes them, and the per-block kernel's causal CTA order (``causal_lpt``; causal
    only, with a stand-in SM count of 13: at d64 S 700 sections of 5 heads and one of 9) runs the same CTAs: out
    and lse bit-identical, over more work items than SMs (CTAs loop, the ring runs on across items), GQA, odd lengths,
    Sq > Sk causal (items with no key tile), d64, the 2-D K path (Sk % 16 != 0)."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    if "causal_lpt" in variant:
        if not causal:
            pytest.skip("the order changes causal launches only")
        monkeypatch.setattr(m, "_sm_count", lambda device: 13)  # sections of cdiv(26, blocks) heads
        monkeypatch.setattr(m, "_PLANS", {})
    for B, Sq, Sk, Hq, Hkv, D in ((2, 2048, 2048, 16, 16, 128), (2, 1000, 1003, 16, 2, 128), (1, 5000, 300, 4, 4, 128),
                                  (3, 700, 1200, 8, 2, 64), (1, 129, 48, 2, 2, 128)):
        q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed + Sk)
        ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        cfg = dataclasses.replace(m.default_config(D, causal), persistent=False, out_store="mma", mask="select",
                                  causal_lpt=False)
        out_0, lse_0 = m.attn_fwd_gluon(*ops, causal=causal, config=cfg)
        out_p, lse_p = m.attn_fwd_gluon(*ops, causal=causal, config=dataclasses.replace(cfg, **variant))
        assert torch.equal(out_p, out_0), f"out {B, Sq, Sk, Hq, Hkv, D}"
        assert torch.equal(lse_p, lse_0), f"lse {B, Sq, Sk, Hq, Hkv, D}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_attn_fwd_gluon_fp32_out_bit_identical(causal, seed):
    """fp32 output (the context-parallel ring's call, ``mxattn.distributed``): the default build (persistent, or
    per-block with causal_lpt when causal; row-wise store through shared memory, 32-bit elements) writes what the
    per-block kernel's accumulator-layout store writes, bit for bit (its launched build:
    ``scripts/compile_launched.py fwd-gluon-fp32``)."""
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    import dataclasses

    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    for B, Sq, Sk, Hq, Hkv, D in ((2, 1000, 1003, 16, 2, 128), (1, 2048, 2048, 4, 4, 128), (3, 700, 1200, 8, 2, 64)):
        q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, D, "cuda", seed + Sq)
        ops = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
        base = dataclasses.replace(m.default_config(D, causal), persistent=False, out_store="mma")
        out_0, lse_0 = m.attn_fwd_gluon(*ops, causal=causal, out_dtype=torch.float32, config=base)
        out_1, lse_1 = m.attn_fwd_gluon(*ops, causal=causal, out_dtype=torch.float32)
        assert out_1.dtype == torch.float32
        assert torch.equal(out_1, out_0) and torch.equal(lse_1, lse_0), (B, Sq, Sk, Hq, Hkv, D)


# ---------------------------------------------------------------------------------------------------- speed
def test_fwd_timeline_summary():
    """``scripts/fwd_timeline.py``'s reading of the probe's records, on a made-up timeline: 2 SMs, 3 CTAs."""
    sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "scripts"))
    import fwd_timeline

    t = torch.zeros(3, 2, 8, dtype=torch.int64)
    # clock64: start, after Q, after loop, after output; globaltimer start; SM; tiles; globaltimer end
    t[0] = torch.tensor([[0, 100, 2100, 2400, 0, 0, 10, 1000]] * 2)
    t[1] = torch.tensor([[0, 300, 4300, 4600, 1200, 0, 20, 3000]] * 2)  # the same SM, 200 ns after CTA 0
    t[2] = torch.tensor([[0, 100, 2100, 2400, 0, 1, 10, 1000]] * 2)
    r = fwd_timeline.summarize(t, clock_khz=1e6)  # 1 GHz: a cycle is 1 ns
    assert r["ctas"] == 3 and r["sms"] == 2
    assert r["q_wait_cycles"] == 100 and r["loop_cycles_per_tile"] == 200 and r["output_cycles"] == 300
    assert r["cta_gap_ns"] == 200 and r["kernel_span_ns"] == 3000
    assert abs(r["loop_share"] - (2000 + 4000 + 2000) / (2 * 3000)) < 1e-9


def _time_methods(runs: dict, repeats: int, rate) -> tuple[dict, dict, dict]:
    """``rate(fn)`` of every method ``repeats`` times, the methods taking turns -> (median per method, None where it
    failed; max / min of its samples where there are several; error text per failed method).  A method that raises
    is not timed again; the others go on."""
    samples, errors = collections.defaultdict(list), {}
    for _ in range(max(1, repeats)):
        for name, fn in runs.items():
            if name in errors:
                continue
            try:
                samples[name].append(rate(fn))
            except Exception as e:  # noqa: BLE001 - a failing method must not stop the run
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    med = {name: (statistics.median(samples[name]) if samples[name] and name not in errors else None)
           for name in runs}
    spread = {name: max(v) / min(v) for name, v in samples.items() if len(v) > 1 and name not in errors}
    return med, spread, errors


def test_time_methods_takes_turns_and_keeps_the_median():
    order = []
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 5.0, 10.0])}

    def rate(name):
        order.append(name)
        if name == "c":
            raise RuntimeError("no kernel")
        return next(values[name])

    med, spread, errors = _time_methods({"a": "a", "b": "b", "c": "c"}, 3, rate)
    assert order == ["a", "b", "c", "a", "b", "a", "b"]  # turns; "c" is not retried after it failed
    assert med == {"a": 2.0, "b": 5.0, "c": None}
    assert spread == {"a": 3.0, "b": 2.0}
    assert errors["c"].startswith("RuntimeError")


def bench_gluon_vs_tl(shapes, seed: int = 0, progress: bool = True, configs: dict | None = None,
                      tl_variants: dict | None = None, repeats: int = 1, cuda_graph: bool = False) -> list[dict]:
    """TFLOP/s of the Gluon kernel, the ``tl`` kernel (both on FP8 operands prepared once, untimed) and SDPA
    cuDNN BF16, measured in one run per shape (``mxattn.bench.speed.time_ms``: median of CUDA-event timings,
    inputs rotated over enough copies to defeat L2).  ``shapes``: ``mxattn.bench.speed.Shape`` objects.
    ``configs``: extra Gluon variants to time, name -> ``GluonFwdConfig`` (methods ``mxattn_gluon[name]``);
    ``tl_variants``: extra ``tl`` variants, name -> fields replaced in the shape's ``attn_fwd.default_config``
    (methods ``mxattn_tl[name]``).  ``repeats`` > 1: every method is timed that many times, the methods taking
    turns (A B C A B C ...), and the median counts; the row keeps each method's spread (``tflops_spread``: max / min
    of its repeats), since one run's drift (session 18: +-5 % for the same kernel) is as large as the changes
    measured.  ``cuda_graph``: every method timed as CUDA-graph replays (``mxattn.bench.speed.cuda_graphed``), the
    GPU work alone: at S 2k an eager call's host time (the Gluon launcher's Python, ~100 us) is as long as the kernel.
    Returns rows shaped like DESIGN §6 with ``tflops`` per method and the ratios to cuDNN."""
    from mxattn.bench.speed import _sdpa, cuda_graphed, n_copies, time_ms
    import dataclasses

    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.attn_fwd import default_config as tl_default
    from mxattn.kernels.quantize import row_scaled_triton

    m = _gluon()
    dev = torch.device("cuda")
    sdpa = _sdpa("CUDNN_ATTENTION")
    rows = []
    for sh in shapes:
        g = torch.Generator(device=dev).manual_seed(seed)
        elems = sh.B * sh.D * (sh.Sq * sh.Hq + 2 * sh.Sk * sh.Hkv)
        n = n_copies(2 * elems, dev)
        mk = lambda S, H: torch.randn(sh.B, S, H, sh.D, generator=g, device=dev).to(torch.bfloat16)  # noqa: E731
        xs = [(mk(sh.Sq, sh.Hq), mk(sh.Sk, sh.Hkv), mk(sh.Sk, sh.Hkv)) for _ in range(n)]
        ops = [(row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")) for q, k, v in xs]
        gqa = sh.Hkv != sh.Hq
        runs = {
            "mxattn_gluon": lambda i: m.attn_fwd_gluon(*ops[i], causal=sh.causal),
            "mxattn_tl": lambda i: attn_fwd_hopper(*ops[i], causal=sh.causal),
            "sdpa_cudnn_bf16": lambda i: sdpa(*xs[i], sh.causal, gqa),
        }
        for cname, cfg in (configs or {}).items():
            runs[f"mxattn_gluon[{cname}]"] = (lambda c: lambda i: m.attn_fwd_gluon(*ops[i], causal=sh.causal,
                                                                                 config=c))(cfg)
        for cname, fields in (tl_variants or {}).items():
            tcfg = dataclasses.replace(tl_default(sh.D, sh.causal), **fields)
            runs[f"mxattn_tl[{cname}]"] = (lambda c: lambda i: attn_fwd_hopper(*ops[i], causal=sh.causal,
                                                                              config=c))(tcfg)
        if cuda_graph:
            runs = {name: _graphed_or_error(fn, n, dev, cuda_graphed) for name, fn in runs.items()}
        tflops, spread, errors = _time_methods(runs, repeats, lambda fn: sh.fwd_flops() / (time_ms(fn, n, dev) * 1e-3)
                                               / 1e12)
        cudnn = tflops.get("sdpa_cudnn_bf16")
        ratio = {k: (v / cudnn if v and cudnn else None) for k, v in tflops.items() if k != "sdpa_cudnn_bf16"}
        row = sh.as_row() | {
            "tflops": tflops,
            "ratio_vs_sdpa_cudnn_bf16": ratio["mxattn_gluon"],
            "ratio_tl_vs_sdpa_cudnn_bf16": ratio["mxattn_tl"],
        }
        if spread:
            row["tflops_spread"] = spread
        if errors:
            row["errors"] = errors
        rows.append(row)
        if progress:
            cells = "  ".join(f"{k} {v:7.1f}" + (f" ({ratio[k]:.2f}x)" if ratio.get(k) else "") if v else f"{k} failed"
                              for k, v in tflops.items())
            print(f"{str(sh):32s} {cells}", flush=True)
        runs = xs = ops = None  # free this shape's copies before the next one
        torch.cuda.empty_cache()
    return rows


def _graphed_or_error(fn, n: int, dev, graphed):
    """``graphed(fn, n, dev)``, or, where the capture fails, a callable that raises its error when timed (so that
    ``_time_methods`` records it for that method alone)."""
    try:
        return graphed(fn, n, dev)
    except Exception as e:  # noqa: BLE001 - one method's capture must not stop the others
        def failed(i, e=e):
            raise RuntimeError(f"CUDA-graph capture failed: {type(e).__name__}: {e}")
        return failed


def test_graphed_or_error():
    assert _graphed_or_error(lambda i: i, 2, None, lambda fn, n, dev: fn)(1) == 1

    def bad(fn, n, dev):
        raise ValueError("no capture here")

    with pytest.raises(RuntimeError, match="no capture here"):
        _graphed_or_error(lambda i: i, 2, None, bad)(0)


def default_bench_shapes(quick: bool = False):
    from mxattn.bench.speed import Shape, grid_shapes

    if quick:
        return grid_shapes(2, 16, None, (128,), (4096, 8192), (False, True))
    return grid_shapes(2, 16, None, (128, 64), (2048, 4096, 8192, 16384)) + [Shape(2, 64, 8, 8192, 8192, 128, c)
                                                                            for c in (False, True)]


@pytest.mark.gpu
def test_bench_gluon_vs_tl_smoke():
    if not _is_hopper():
        pytest.skip("the Gluon forward needs an sm_90 GPU")
    from mxattn.bench.speed import Shape

    rows = bench_gluon_vs_tl([Shape(1, 4, 4, 1024, 1024, 128, False)], progress=False)
    assert rows[0]["tflops"]["mxattn_gluon"] and rows[0]["tflops"]["mxattn_gluon"] > 0


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Gluon vs tl vs SDPA cuDNN BF16 forward speed (one run)")
    ap.add_argument("--quick", action="store_true", help="d128 at S 4k and 8k only")
    ap.add_argument("--out", help="write the rows and the environment to this JSON file")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every method this many times, taking turns, and keep the median (and the spread)")
    ap.add_argument("--persistent", action="store_true",
                    help="also time the per-block kernel (GluonFwdConfig(persistent=False)) and the persistent "
                         "one with exp2_fma 25 "
                         "(B2 H16 d128 / d64 S 2k / 4k / 8k / 16k, both causal flags, unless --quick)")
    ap.add_argument("--exp2-fma", action="store_true",
                    help="also time exp2_fma 25 and 50 (part of the exp2 on the FMA pipe), Gluon and tl, beside the "
                         "defaults (B2 H16 d128 / d64 S 2k / 8k unless --quick)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time CUDA-graph replays (the GPU work alone; eager calls at S 2k are host-bound)")
    ap.add_argument("--mask", action="store_true",
                    help="also time the lean masked-tile arithmetic (GluonFwdConfig.mask='lean') beside the default "
                         "(B2 H16 d128 / d64 S 2k / 4k / 8k causal, and S 2000 / 4000 without a mask: a masked last "
                         "tile)")
    ap.add_argument("--out-store", action="store_true",
                    help="also time the row-wise output store (GluonFwdConfig.out_store='rows'), per-block and "
                         "persistent (B2 H16 d128 / d64 S 2k / 4k / 8k, both causal flags, unless --quick)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time stages 2/4, ping-pong and the 2-D K path (k_perm off) (d128 S8k, both causal "
                         "flags, unless --quick)")
    args = ap.parse_args()
    bench_configs = None
    bench_shapes = default_bench_shapes(args.quick)
    if args.sweep:
        from mxattn.bench.speed import grid_shapes
        from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig

        bench_configs = {"stages2": GluonFwdConfig(stages=2), "stages4": GluonFwdConfig(stages=4),
                         "pingpong": GluonFwdConfig(pingpong=True, persistent=False),
                         "k2d": GluonFwdConfig(k_perm=False)}
        if not args.quick:
            bench_shapes = grid_shapes(2, 16, None, (128, 64), (8192,))
    if args.exp2_fma:
        from mxattn.bench.speed import grid_shapes
        from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig

        bench_configs = (bench_configs or {}) | {f"exp2_fma{p}": GluonFwdConfig(exp2_fma=p) for p in (25, 50)}
        if not args.quick and not args.sweep:
            bench_shapes = grid_shapes(2, 16, None, (128, 64), (2048, 8192))
    if args.persistent:
        from mxattn.bench.speed import grid_shapes
        from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig

        bench_configs = (bench_configs or {}) | {"per_block": GluonFwdConfig(persistent=False),
                                                 "persistent_exp2_fma25": GluonFwdConfig(persistent=True, exp2_fma=25)}
        if args.quick:
            bench_shapes = grid_shapes(2, 16, None, (128,), (2048, 4096, 8192))
        elif not args.sweep and not args.exp2_fma:
            bench_shapes = grid_shapes(2, 16, None, (128, 64), (2048, 4096, 8192, 16384))
    if args.out_store:
        from mxattn.bench.speed import grid_shapes
        from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig

        bench_configs = (bench_configs or {}) | {
            f"{'persistent' if p else 'block'}_{st}": GluonFwdConfig(persistent=p, out_store=st)
            for p in (False, True) for st in ("mma", "rows")}
        if args.quick:
            bench_shapes = grid_shapes(2, 16, None, (128,), (2048, 4096, 8192))
        elif not (args.sweep or args.exp2_fma or args.persistent):
            bench_shapes = grid_shapes(2, 16, None, (128, 64), (2048, 4096, 8192))
    if args.mask:
        from mxattn.bench.speed import Shape
        from mxattn.kernels.attn_fwd_gluon import GluonFwdConfig

        bench_configs = (bench_configs or {}) | {"lean": GluonFwdConfig(mask="lean")}
        if not (args.sweep or args.exp2_fma or args.persistent or args.out_store):
            bench_shapes = [Shape(2, 16, 16, S, S, D, c) for D in (128, 64) for S, c in
                            ((2048, True), (4096, True), (8192, True), (2000, False), (4000, False))]
    tl_variants = {f"exp2_fma{p}": dict(exp2_fma=p) for p in (25, 50)} if args.exp2_fma else None
    result_rows = bench_gluon_vs_tl(bench_shapes, configs=bench_configs, tl_variants=tl_variants,
                                    repeats=args.repeats, cuda_graph=args.cuda_graph)
    if args.out:
        from mxattn.bench.results import env_info

        doc = {"what": "attn_fwd_gluon_vs_tl", **env_info(), "rows": result_rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(args.out)
