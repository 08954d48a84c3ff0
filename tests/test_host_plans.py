"""Host-path shortcuts of the eager calls (docs/perf-notes-host.md): they must launch exactly what the checked path
launches and refuse bad input as before.

CPU: ``attn_bwd_hopper``'s Gluon plans (the kernel choice forced to "gluon", launches recorded instead of run):
a plan hit launches the checked call's kernels with the same grids, keywords and arguments on its own tensors, and
runs no check; a changed shape, dtype or stride misses the plan, and bad input still raises on the checked path;
the build variable (MXATTN_BWD_GLUON_SPLIT) is part of the plan.  The jagged API's cu_seqlens cache: one read per
tensor, a re-read after an in-place write, values checked on every call, bounded, no reuse of a dead tensor's
entry; the jagged operands' offsets built once per tensor.  ``_EagerAttention`` with an undefined gradient of out.  The CPU harness (scripts/host_overhead_cpu.py)
runs every row, in a process of its own (it needs the fast launch path, which this test session's interpreter turns
off).

GPU (marker ``gpu``): gradients through a plan hit equal the checked path's bit for bit; the cu_seqlens cache with
CUDA and CPU tensors (one read each, outputs equal).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from conftest import import_gluon_module

from mxattn import interface
from mxattn.kernels import attn_bwd

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------- Gluon backward plans
def _operands(Sq=130, Sk=200, Hq=4, Hkv=2, D=64, seed=0):
    """``attn_bwd_hopper``'s arguments on the CPU (torch twins of the producers: the layouts are what matters)."""
    from mxattn import formats

    g = torch.Generator().manual_seed(seed)
    mk = lambda S, H: torch.randn(1, S, H, D, generator=g)  # noqa: E731
    q, k, v, do = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)
    grp = lambda x: formats.row_scaled_from_float(x, -1, group_dim=1, group=128)  # noqa: E731

    def seq(x):  # exponents with the producers' strides (the dK/dV launcher takes one set for q_seq's and dO's)
        s = formats.row_scaled_from_float(x, 1)
        return formats.RowScaledFP8(formats.channel_major(s.data), s.exp.new_empty(s.exp.shape).copy_(s.exp), s.dim)

    return dict(q=grp(q), k=grp(k), v_hdim=grp(v), q_seq=seq(q), k_seq=seq(k), out=torch.randn_like(q),
                dout=do.to(torch.bfloat16), lse=torch.zeros(1, Hq, Sq), dout_hdim=grp(do), dout_seq=seq(do))


@pytest.fixture
def gluon_recorded(monkeypatch):
    """The Gluon backward chosen on the CPU, every launch recorded instead of run; yields the record."""
    from mxattn.kernels import launch

    import_gluon_module("attn_bwd_dkdv_gluon")
    import_gluon_module("attn_bwd_dq_gluon")
    seen = []
    monkeypatch.setattr(launch.FastLauncher, "launch",
                        lambda self, grid, args, kwargs: seen.append((self.jit_fn, grid, args, kwargs)))
    monkeypatch.setattr(attn_bwd, "backward_kernel", lambda device=None: "gluon")
    monkeypatch.delenv("MXATTN_BWD_GLUON_SPLIT", raising=False)
    attn_bwd._GLUON_PLANS.clear()
    return seen


def _call(ops, **kw):
    a = ops
    dq, dk, dv = attn_bwd.attn_bwd_hopper(a["q"], a["k"], a["v_hdim"], a["q_seq"], a["k_seq"], a["out"], a["dout"],
                                          a["lse"], **kw)
    return dq() if callable(dq) else dq, dk, dv


def _same_launches(a, b):
    from test_attn_bwd_dkdv_gluon import _same_launch

    assert [x[0] for x in a] == [y[0] for y in b]  # the same kernels in the same order
    for x, y in zip(a, b):
        _same_launch(x[1:], y[1:])


@pytest.mark.parametrize("given_do", [False, True], ids=["do_made_here", "do_given"])
@pytest.mark.parametrize("defer_dq", [False, True], ids=["dq", "defer_dq"])
def test_plan_hit_launches_what_the_checked_path_launches(gluon_recorded, monkeypatch, given_do, defer_dq):
    """First call: the checked path, which makes a plan; later calls of the signature, on fresh tensors: the plan,
    with no check run, and the same kernels, grids, keywords and arguments (tensors by dtype, shape, strides;
    descriptors by every field), over the new call's own tensors."""
    seen = gluon_recorded
    kw = dict(causal=True, defer_dq=defer_dq)
    extra = lambda ops: dict(dout_hdim=ops["dout_hdim"], dout_seq=ops["dout_seq"]) if given_do else {}  # noqa: E731
    ops = _operands()
    _call(ops, **kw, **extra(ops))
    first = list(seen)
    assert len(attn_bwd._GLUON_PLANS) == 1
    assert len(first) == (3 if given_do else 5)  # (dO's two quantize launches,) δ, dK/dV, dQ
    seen.clear()
    monkeypatch.setattr(attn_bwd, "_check_operands", lambda *a: pytest.fail("a plan hit runs no check"))
    other = _operands(seed=1)  # fresh tensors, the same signature
    _call(other, **kw, **extra(other))
    _same_launches(first, seen)
    delta_args, dkdv_args = seen[-3][2], seen[-2][2]
    assert delta_args[2] is other["out"]  # δ reads this call's out
    assert dkdv_args[0].base.data_ptr() == other["q"].data.data_ptr()  # the descriptors read this call's tensors
    # δ's launch writes the step rows (b, −δ) that the dK/dV kernel's lse / δ descriptors read, in that order
    at = [i for i, t in enumerate(delta_args) if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[2] % 128 == 0]
    assert len(at) == 2 and at[1] == at[0] + 1 and delta_args[at[0] - 1] is other["lse"]
    brow, ndl = delta_args[at[0]], delta_args[at[1]]
    assert (dkdv_args[4].base.data_ptr(), dkdv_args[5].base.data_ptr()) == (brow.data_ptr(), ndl.data_ptr())
    assert len(attn_bwd._GLUON_PLANS) == 1


def test_plan_misses_on_a_changed_signature_and_bad_input_still_raises(gluon_recorded):
    """A changed shape, dtype or stride is another signature: the checked path (a new plan, or its error)."""
    seen = gluon_recorded
    _call(_operands(), causal=True)
    assert len(attn_bwd._GLUON_PLANS) == 1
    _call(_operands(Sq=70), causal=True)  # another shape
    assert len(attn_bwd._GLUON_PLANS) == 2
    ops = _operands()
    ops["dout"] = ops["dout"].float()  # another dtype of dO
    _call(ops, causal=True)
    assert len(attn_bwd._GLUON_PLANS) == 3
    n = len(seen)
    bad = _operands()
    bad["lse"] = bad["lse"].half()  # another dtype: the checks refuse it
    with pytest.raises(ValueError, match="lse must be float32"):
        _call(bad, causal=True)
    bad = _operands()
    bad["lse"] = torch.zeros(1, 4, 260)[:, :, ::2]  # the plan's shape, another stride: checked, accepted
    _call(bad, causal=True)
    assert len(attn_bwd._GLUON_PLANS) == 4
    bad = _operands()
    bad["k"] = bad["k"].data  # not a RowScaledFP8: no plan key, the checks' TypeError
    with pytest.raises(TypeError, match="k must be a RowScaledFP8"):
        _call(bad, causal=True)
    bad = _operands()
    bad["k_seq"].data = bad["k_seq"].data[:, :199]  # a shape the first call never saw: refused by the checks
    with pytest.raises(ValueError, match="k_seq"):
        _call(bad, causal=True)
    assert len(seen) == n + 5 and len(attn_bwd._GLUON_PLANS) == 4  # only the accepted call launched


def test_plan_follows_the_split_variable(gluon_recorded, monkeypatch):
    """MXATTN_BWD_GLUON_SPLIT is read at each call: its value is part of the plan, so the whole-tile build gets a
    plan of its own and launches with SPLIT False."""
    seen = gluon_recorded
    _call(_operands(), causal=True)
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", "0")
    seen.clear()
    _call(_operands(), causal=True)
    _call(_operands(), causal=True)
    assert len(attn_bwd._GLUON_PLANS) == 2
    assert [kw["SPLIT"] for _, _, _, kw in seen if "SPLIT" in kw] == [False] * 4


def test_no_plan_with_outputs_given_or_plans_off(gluon_recorded, monkeypatch):
    """dk_out / dv_out (the ring's buffers) and MXATTN_LAUNCH_PLANS=0 keep the checked path on every call."""
    from mxattn.kernels import launch

    ops = _operands()
    dk, dv = torch.empty(1, 200, 2, 64), torch.empty(1, 200, 2, 64)
    for _ in range(2):
        _call(ops, causal=True, grad_dtype=torch.float32, dk_out=dk, dv_out=dv)
    monkeypatch.setattr(launch, "PLANS", False)
    for _ in range(2):
        _call(ops, causal=True)
    assert not attn_bwd._GLUON_PLANS


# ---------------------------------------------------------------------------------------- cu_seqlens cache
@pytest.fixture
def reads(monkeypatch):
    """The tensors read on the host (``Tensor.tolist``), one entry per read, with an empty cache."""
    seen = []
    tolist = torch.Tensor.tolist

    def counted(self):
        seen.append(self)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    interface._CU_CACHE.clear()
    return seen


def _check(cu, total=14):
    return interface._check_cu_seqlens(cu, "cu_seqlens_q", total, torch.device("cpu"))


def test_cu_seqlens_read_once_per_tensor(reads):
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for _ in range(3):
        dev, host = _check(cu)
        assert host == [0, 5, 5, 14] and torch.equal(dev, cu)
    assert len(reads) == 1
    _check(cu.clone())  # another tensor with the same values: read
    assert len(reads) == 2


def test_cu_seqlens_in_place_write_is_read_again(reads):
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    _check(cu)
    cu[2] = 9
    assert _check(cu)[1] == [0, 5, 9, 14]
    assert _check(cu)[1] == [0, 5, 9, 14]
    cu[1] = 10  # now decreasing: refused on the values read again
    with pytest.raises(ValueError, match="must not decrease"):
        _check(cu)
    assert len(reads) == 3


def test_cu_seqlens_values_checked_on_every_call(reads):
    """A cached tensor is still checked against this call's token count, and bad values stay refused."""
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    _check(cu)
    with pytest.raises(ValueError, match="must end at the number of packed tokens 13, got 14"):
        _check(cu, total=13)
    bad = torch.tensor([0, 6, 4, 14], dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match="must not decrease"):
            _check(bad)
    assert len(reads) == 2


def test_cu_seqlens_cache_is_bounded_and_drops_dead_tensors(reads):
    cus = [torch.tensor([0, i, 14], dtype=torch.int32) for i in range(interface.CU_CACHE_SIZE + 3)]
    for cu in cus:
        _check(cu)
    assert len(interface._CU_CACHE) == interface.CU_CACHE_SIZE
    _check(cus[-1])
    assert len(reads) == len(cus)  # the newest are kept
    _check(cus[0])
    assert len(reads) == len(cus) + 1  # the oldest was dropped
    cu = torch.tensor([0, 3, 14], dtype=torch.int32)
    _check(cu)
    key = id(cu)
    del cu
    gc.collect()
    other = torch.tensor([0, 4, 14], dtype=torch.int32)
    if id(other) == key:  # the dead tensor's id came back: its entry must not answer for the new tensor
        assert _check(other)[1] == [0, 4, 14]


def test_cu_seqlens_inference_tensors_are_read_every_call(reads):
    with torch.inference_mode():
        cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
        for _ in range(2):
            assert _check(cu)[1] == [0, 5, 5, 14]
    assert len(reads) == 2 and not interface._CU_CACHE


def test_jagged_checks_read_cu_seqlens_once(reads):
    """The jagged function's checks, called twice with one cu_seqlens tensor for q and k, read it once (the CPU
    reference behind them reads it itself); the function gives the same output on a cache hit."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(14, 2, 64, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for _ in range(2):
        cu_q, cu_k, mq, mk = interface._check_varlen_inputs(q, k, v, cu, cu, 11, 9, None)
        assert torch.equal(cu_q, cu) and torch.equal(cu_k, cu) and (mq, mk) == (9, 9)
    assert len(reads) == 1
    a = interface.mxfp8_attn_varlen_func(q, k, v, cu, cu, 9, 9)
    assert torch.equal(a, interface.mxfp8_attn_varlen_func(q, k, v, cu, cu, 9, 9))


def test_cu_blocks_made_once_per_tensor():
    """The jagged operands' offsets (``varlen.cu_blocks``) are built once per cu_seqlens tensor, block and scale:
    the same tensor again on a repeat, new values after an in-place write, the values of a fresh build, bounded."""
    from mxattn.kernels import varlen as V

    V._OFFSETS.clear()
    cu = torch.tensor([0, 5, 5, 140, 300], dtype=torch.int32)
    a = V.cu_blocks(cu, 128)
    assert V.cu_blocks(cu, 128) is a and a.tolist() == [0, 1, 1, 3, 5]
    cols = V.cu_blocks(cu, 16, 16)
    assert cols.tolist() == (16 * V.cu_blocks(cu.clone(), 16)).tolist() and V.cu_blocks(cu, 16, 16) is cols
    cu[4] = 600
    assert V.cu_blocks(cu, 128).tolist() == [0, 1, 1, 3, 7]
    alive = [torch.tensor([0, i], dtype=torch.int32) for i in range(V._MAX_OFFSETS + 4)]
    for t in alive:
        V.cu_blocks(t, 128)
    assert len(V._OFFSETS) == V._MAX_OFFSETS
    with torch.inference_mode():
        inf = torch.tensor([0, 300], dtype=torch.int32)
        assert V.cu_blocks(inf, 128).tolist() == [0, 3] and V.cu_blocks(inf, 128) is not V.cu_blocks(inf, 128)


# ---------------------------------------------------------------------------------------- eager autograd
class _NoGrad(torch.autograd.Function):
    """Identity whose backward gives its input no gradient (None)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def test_eager_attention_with_an_undefined_output_gradient():
    """lse's gradient is never materialized (set_materialize_grads(False), dense and jagged Functions); an undefined
    gradient of out (a consumer that gives none) still gives zero gradients to q, k, v."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 64, generator=g).requires_grad_() for _ in range(3))
    out = interface.mxfp8_attn_func(q, k, v)
    (_NoGrad.apply(out).sum() + 0 * q.sum()).backward()
    assert q.grad is not None and not q.grad.any()
    k.grad = v.grad = None
    out, lse = interface.mxfp8_attn_func(q, k, v, return_lse=True)
    out.sum().backward()
    assert k.grad is not None and v.grad is not None
    jq, jk, jv = (torch.randn(9, 2, 64, generator=g).requires_grad_() for _ in range(3))  # the jagged Function too
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = interface.mxfp8_attn_varlen_func(jq, jk, jv, cu, cu, 5, 5)
    (_NoGrad.apply(out).sum() + 0 * jq.sum()).backward()
    assert jq.grad is not None and not jq.grad.any()


def test_plain_float_inputs():
    """The common call's few-reads check says yes only where the full checks pass; the rest gets the full checks."""
    x = torch.zeros(1, 4, 2, 64)
    ok = interface._plain_float_inputs
    assert ok(x, x, x)
    assert not ok(x, x.half(), x) and not ok(x.int(), x.int(), x.int()) and not ok(x, x[0], x)
    assert not ok(x, x, x.to("meta")) and not ok(x, x, torch.nn.Parameter(x))
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        interface.mxfp8_attn_func(x, x.half(), x)


# ---------------------------------------------------------------------------------------- forward call plans
@pytest.mark.parametrize("keep_kv", [False, True])
def test_forward_call_plan_equals_the_checked_path(keep_kv, monkeypatch):
    """The float forward's call plan (``interface._float_forward_cuda``, made by a signature's first call, used from
    its second) gives the checked path's out, lse and kept K / V operands bit for bit on fresh inputs, the operand
    plan's argument templates included; inputs sharing one tensor (self-attention on x) too, and another signature
    misses it.  CPU: the kernels under the interpreter (the GPU runs these through the API's tests)."""
    from conftest import require_kernels

    dev = require_kernels()
    from mxattn.kernels import launch

    def run(q, k, v, plans: bool):
        monkeypatch.setattr(launch, "PLANS", plans)
        out, lse, kv = interface._float_forward_cuda(q, k, v, True, 0.125, "rceil", "auto", keep_kv)
        flat = [out, lse] + ([] if kv is None else [t for r in kv for t in (r.data.view(torch.uint8), r.exp)])
        return [t.clone() for t in flat]

    def check(q, k, v):
        want = run(q, k, v, False)
        got = run(q, k, v, True)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))

    g = torch.Generator().manual_seed(1)
    mk = lambda S, H: torch.randn(1, S, H, 64, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    interface._CALL_PLANS.clear()
    for _ in range(3):  # the first call makes the plan, the next ones run it
        check(mk(37, 4), mk(70, 2), mk(70, 2))
    plans = [p for p in interface._CALL_PLANS.values()]
    assert len(plans) == 1 and isinstance(plans[0], interface._ForwardCall)
    assert plans[0].operands.templates, "the operand plan made its argument templates"
    for _ in range(2):  # a plan (and templates) made on distinct tensors, then one tensor as q, k and v
        check(mk(70, 2), mk(70, 2), mk(70, 2))
    x = mk(70, 2)
    check(x, x, x)
    check(mk(70, 2), mk(70, 2), mk(70, 2))  # and distinct tensors again after it
    check(mk(38, 4), mk(70, 2), mk(70, 2))  # another signature: its own plan
    assert len(interface._CALL_PLANS) == 3


# ---------------------------------------------------------------------------------------- GPU
def _hopper_gluon() -> bool:
    return torch.cuda.is_available() and attn_bwd.backward_kernel(torch.device("cuda", 0)) == "gluon"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_plan_hit_equals_the_checked_path(causal, monkeypatch):
    """On the H200: gradients through a plan hit are the checked path's bit for bit (the Gluon backward is
    deterministic), for the public call and for ``attn_bwd_hopper`` with dO made inside."""
    if not _hopper_gluon():
        pytest.skip("the Gluon backward runs on a Hopper GPU with a verified Triton")
    from mxattn.kernels import launch

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))

    def grads():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        interface.mxfp8_attn_func(qg, kg, vg, causal=causal).backward(do)
        return qg.grad, kg.grad, vg.grad

    attn_bwd._GLUON_PLANS.clear()
    first, hit = grads(), grads()
    assert attn_bwd._GLUON_PLANS
    monkeypatch.setattr(launch, "PLANS", False)
    checked = grads()
    for a, b, c in zip(first, hit, checked):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_call_plans_equal_the_checked_path(causal, monkeypatch):
    """On the H200: the forward's and the eager backward's call plans (``interface._CALL_PLANS``,
    ``_BWD_CALL_PLANS``, session 22) give the checked path's out and gradients bit for bit on fresh inputs of one
    signature, with and without grad, at d128 (the Gluon forward from S 2k) and d64 (the tl one)."""
    if not _hopper_gluon():
        pytest.skip("the Gluon backward runs on a Hopper GPU with a verified Triton")
    from mxattn.kernels import launch

    g = torch.Generator(device="cuda").manual_seed(0)
    for S, D in ((2048, 128), (300, 64)):
        interface._CALL_PLANS.clear()
        interface._BWD_CALL_PLANS.clear()

        def run(q, k, v, do, plans: bool):
            monkeypatch.setattr(launch, "PLANS", plans)
            with torch.no_grad():
                plain = interface.mxfp8_attn_func(q, k, v, causal=causal)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            interface.mxfp8_attn_func(qg, kg, vg, causal=causal).backward(do)
            return plain, qg.grad, kg.grad, vg.grad

        for _ in range(3):  # the first call makes the plans, the next ones run them
            x = [torch.randn(1, S, 4, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
            want, got = run(*x, False), run(*x, True)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert any(isinstance(p, interface._ForwardCall) for p in interface._CALL_PLANS.values())
        assert any(isinstance(p, interface._BackwardCall) for p in interface._BWD_CALL_PLANS.values())


@pytest.mark.gpu
def test_gpu_cu_seqlens_cache(monkeypatch):
    """On the GPU: a CUDA cu_seqlens is read back once over repeated calls; a CPU one goes over through pinned
    memory; both give the output of a fresh tensor's call."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: seen.append(self) or tolist(self))
    interface._CU_CACHE.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    lens = [0, 100, 100, 300]
    cu_gpu = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu_cpu = torch.tensor(lens, dtype=torch.int32)
    outs = [interface.mxfp8_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True)
            for cu in (cu_gpu, cu_gpu, cu_cpu, cu_cpu)]
    assert sum(t is cu_gpu for t in seen) == 1 and sum(t is cu_cpu for t in seen) == 1
    fresh = interface.mxfp8_attn_varlen_func(q, k, v, cu_gpu.clone(), cu_gpu.clone(), 200, 200, causal=True)
    for out in outs:
        assert torch.equal(out, fresh)


# ---------------------------------------------------------------------------------------- the CPU harness
def test_cpu_harness_runs_every_row():
    """scripts/host_overhead_cpu.py, two calls per row, in a process without TRITON_INTERPRET: every row runs."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT
    r = subprocess.run([sys.executable, os.path.join(_ROOT, "scripts", "host_overhead_cpu.py"), "--calls", "2",
                        "--repeats", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "failed" not in r.stdout, r.stdout
    assert r.stdout.count(" launches, ") == 13, r.stdout
