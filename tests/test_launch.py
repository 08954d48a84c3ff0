"""The fast launch path (mxattn/kernels/launch.py): its key, its cache, its fallbacks.

CPU: the cache logic on a stand-in for a JITFunction (what is launched, with which arguments, when Triton's own
path is taken); the key's features.  GPU: a real kernel launched both ways gives the same bytes, and a kernel
launched with changing specializations (alignment, ints equal to 1) always gets Triton's kernel (check mode).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mxattn.kernels import launch as L


class _FakeKernel:
    def __init__(self, name):
        self.name = name
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.launches.append((grid, args))  # (Triton's runner signature)


class _FakeJit:
    """``run`` as Triton's: compiles (here: makes) one kernel per specialization, launches unless warmup."""

    def __init__(self):
        self.runs = []
        self.kernels = {}

    @staticmethod
    def fn(X, n, scale, BLOCK: int = 16, FLAG: bool = False):
        pass

    __name__ = "fake_kernel"

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((args, kwargs, warmup))
        key = L.FastLauncher._key(args, kwargs)
        return self.kernels.setdefault(key, _FakeKernel(str(len(self.kernels))))


def _launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fl = L.FastLauncher(_FakeJit())
    fl.enabled, fl._sig = True, inspect.signature(_FakeJit.fn)
    return fl


def test_miss_goes_through_triton_then_hits_launch_directly(monkeypatch):
    fl = _launcher(monkeypatch)
    x = torch.zeros(64)
    fl[(4,)](x, 7, 0.5, BLOCK=32)
    assert len(fl.jit_fn.runs) == 1 and fl.misses == 1
    y = torch.ones(64)
    fl[(4,)](y, 7, 0.5, BLOCK=32)  # another tensor of the same dtype and alignment: same key
    fl[(2, 3)](x, 7, 0.5, BLOCK=32)  # another grid
    assert len(fl.jit_fn.runs) == 1 and fl.hits == 2
    (kernel, rest), = fl._cache.values()
    assert rest == (("BLOCK", 16), ("FLAG", False))  # the remaining parameters and their defaults
    assert kernel.launches == [((4, 1, 1), (y, 7, 0.5, 32, False)), ((2, 3, 1), (x, 7, 0.5, 32, False))]


@pytest.mark.parametrize("other", [
    lambda x: ((x, 16, 0.5), {"BLOCK": 32}),  # int % 16 == 0
    lambda x: ((x, 39, 0.5), {"BLOCK": 32}),  # ints count by value (finer than Triton's features)
    lambda x: ((x, 7, 0.25), {"BLOCK": 32}),  # floats too
    lambda x: ((x, 1, 0.5), {"BLOCK": 32}),  # int == 1
    lambda x: ((x, 2**40, 0.5), {"BLOCK": 32}),  # 64-bit int
    lambda x: ((x[1:], 7, 0.5), {"BLOCK": 32}),  # unaligned pointer
    lambda x: ((x.half(), 7, 0.5), {"BLOCK": 32}),  # dtype
    lambda x: ((x, 7, 0.5), {"BLOCK": 48}),  # constexpr value (the same int features as 32)
    lambda x: ((x, 7, 0.5, 48), {}),  # constexpr value passed positionally
    lambda x: ((x, 7, 0.5), {"BLOCK": 32, "FLAG": True}),  # another keyword
    lambda x: ((x, 7, 0.5), {"BLOCK": 32, "num_warps": 8}),  # a launch option
])
def test_any_specialization_change_is_a_miss(monkeypatch, other):
    fl = _launcher(monkeypatch)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, BLOCK=32)
    args, kwargs = other(x)
    fl[(1,)](*args, **kwargs)
    assert fl.misses == 2 and fl.hits == 0 and len(fl._cache) == 2


def test_unhashable_arguments_and_disabled_take_triton_path(monkeypatch):
    fl = _launcher(monkeypatch)
    calls = []
    monkeypatch.setattr(fl, "jit_fn", type("J", (), {"__getitem__": lambda s, g: lambda *a, **k: calls.append(g)})())
    fl[(1,)](torch.zeros(4), [7], 0.5)
    assert calls == [(1,)] and not fl._cache
    grid_fn = lambda meta: (1,)  # noqa: E731
    fl[grid_fn](torch.zeros(4), 7, 0.5)  # a grid function: Triton binds the arguments it reads
    fl.enabled = False
    fl[(2,)](torch.zeros(4), 7, 0.5)
    assert calls == [(1,), grid_fn, (2,)] and not fl._cache


def test_triton_dispatch_bypasses_the_cache(monkeypatch):
    fl = _launcher(monkeypatch)
    calls = []
    monkeypatch.setattr(fl, "jit_fn", type("J", (), {"__getitem__": lambda s, g: lambda *a, **k: calls.append(g)})())
    with L.triton_dispatch():
        fl[(3,)](torch.zeros(4), 7, 0.5)
    assert calls == [(3,)] and not fl._cache and not L._BYPASS[0]


def test_cache_is_bounded(monkeypatch):
    fl = _launcher(monkeypatch)
    monkeypatch.setattr(L, "MAX_ENTRIES", 2)
    x = torch.zeros(64)
    for n in (5, 6, 7, 7):
        fl[(1,)](x, n, 0.5)
    assert len(fl._cache) == 1 and fl.misses == 3 and fl.hits == 1  # full at the third key: started over


def test_check_mode_catches_a_wrong_kernel(monkeypatch):
    fl = _launcher(monkeypatch)
    monkeypatch.setattr(L, "_CHECK", True)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5)
    fl[(1,)](x, 7, 0.5)  # Triton agrees
    key = next(iter(fl._cache))
    fl._cache[key] = (_FakeKernel("stale"), fl._cache[key][1])
    with pytest.raises(RuntimeError, match="another kernel"):
        fl[(1,)](x, 7, 0.5)


def test_keys_hold_no_tensor(monkeypatch):
    """Tensors passed by keyword count by dtype and alignment too: the cache never keeps a tensor alive."""
    import weakref

    fl = _launcher(monkeypatch)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, BLOCK=32)
    y = torch.zeros(64)
    ref = weakref.ref(y)
    fl[(1,)](x, 7, 0.5, BLOCK=32, FLAG=y)
    fl[(1,)](x, 7, 0.5, BLOCK=32, FLAG=torch.ones(64))  # same dtype and alignment: a hit
    assert fl.misses == 2 and fl.hits == 1
    # the hit launched with this call's tensor, not the first call's
    (_, args), = [launch for kernel, _ in fl._cache.values() for launch in kernel.launches]
    assert args[-1] is not None and torch.equal(args[-1], torch.ones(64))
    del y
    fl.jit_fn.runs.clear()  # the stand-in's own record of the calls
    fl.jit_fn.kernels.clear()
    assert ref() is None


def test_one_launcher_per_kernel():
    class J:
        pass

    a, b = J(), J()
    assert L.fast_launcher(a) is L.fast_launcher(a) and L.fast_launcher(a) is not L.fast_launcher(b)
    assert not L.fast_launcher(a).enabled  # not a JITFunction


@pytest.mark.gpu
def test_gpu_fast_launch_matches_triton(monkeypatch):
    """The quantizer launched through the fast path and through Triton's own gives the same bytes, and changing
    alignments (a 2-byte offset) and sizes (ints 1, % 16) always find the kernel Triton would launch (check mode)."""
    from mxattn.kernels.quantize import row_scaled_triton

    monkeypatch.setattr(L, "_CHECK", True)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(2 * 300 * 4 * 128 + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    for off, S, H in ((0, 300, 4), (1, 300, 4), (0, 1, 1), (0, 256, 1), (1, 33, 2)):
        x = base[off:off + 2 * S * H * 128].view(2, S, H, 128)
        for role in ("q", "k", "v"):
            fast = row_scaled_triton(x, role)
            with L.triton_dispatch():  # Triton's own dispatch for the same call
                slow = row_scaled_triton(x, role)
            assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8)), (off, S, H, role)
            assert torch.equal(fast.exp, slow.exp), (off, S, H, role)


def test_nvmma_fp8_layout_is_gluons_default():
    """The cached layout equals the one Gluon builds for the shape (what the Gluon kernels' wrappers asked for)."""
    gl = pytest.importorskip("triton.experimental.gluon.language")
    for rows, cols in ((64, 128), (128, 128), (128, 64), (64, 64)):
        assert L.nvmma_fp8_layout(rows, cols) == gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)
    assert L.nvmma_fp8_layout(64, 128) is L.nvmma_fp8_layout(64, 128)


def test_bound_launch_repeats_the_launch_without_the_key(monkeypatch):
    """``BoundLaunch``: the first call goes through the launcher (a miss), later calls launch the bound kernel with
    the new positional arguments, the keywords and the remaining defaults, on a grid padded to 3 dims."""
    fl = _launcher(monkeypatch)
    x, y = torch.zeros(64), torch.ones(64)
    b = L.BoundLaunch(fl, (4,), (x, 7, 0.5), {"BLOCK": 32})
    assert fl.misses == 1 and len(fl.jit_fn.runs) == 1
    monkeypatch.setattr(L.FastLauncher, "_key", staticmethod(lambda a, k: pytest.fail("bound calls skip the key")))
    b(y, 7, 0.5)
    (kernel, _), = fl._cache.values()
    assert kernel.launches == [((4, 1, 1), (y, 7, 0.5, 32, False))] and fl.hits == 1


def test_bound_launch_binds_after_triton_dispatch(monkeypatch):
    """Made under ``triton_dispatch()`` it takes Triton's path there and binds at its first call outside."""
    fl = _launcher(monkeypatch)
    x = torch.zeros(64)
    with L.triton_dispatch():
        monkeypatch.setattr(fl, "jit_fn", type("J", (), {"__getitem__": lambda s, g: lambda *a, **k: None,
                                                         "run": _FakeJit().run})())
        b = L.BoundLaunch(fl, (2,), (x, 7, 0.5), {})
        assert b.runner is None and not fl._cache
        b(x, 7, 0.5)
        assert b.runner is None
    b(x, 7, 0.5)  # through the launcher (a miss), then bound
    assert b.runner is not None and fl.misses == 1
    b(x, 7, 0.5)
    assert fl.hits == 1


def test_bound_launch_check_mode_catches_a_wrong_kernel(monkeypatch):
    fl = _launcher(monkeypatch)
    x = torch.zeros(64)
    b = L.BoundLaunch(fl, (1,), (x, 7, 0.5), {})
    monkeypatch.setattr(L, "_CHECK", True)
    b(x, 7, 0.5)  # Triton's dispatch agrees with the bound kernel
    b.kernel = _FakeKernel("stale")
    with pytest.raises(RuntimeError, match="another kernel than the one bound"):
        b(x, 7, 0.5)


# ---- the second table: Triton's own specialization of the call ----------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _spec_probe_fn(X, n, scale, m, BLOCK: tl.constexpr = 16):
    pass


# a JITFunction even where the tests run under TRITON_INTERPRET=1 (whose triton.jit makes an InterpretedFunction)
_spec_probe = triton.runtime.jit.JITFunction(_spec_probe_fn)


def _real_binder():
    """Triton's binder for ``_spec_probe`` with the CUDA backend, built on the CPU (no driver needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(_spec_probe.signature, _spec_probe.params,
                                          CUDABackend(GPUTarget("cuda", 90, 32)))


class _SpecJit:
    """A stand-in for a JITFunction whose ``run`` picks kernels exactly as Triton does: one per (specialization,
    options) from Triton's real binder; ``device_caches`` holds that binder where Triton keeps it."""

    def __init__(self):
        binder = _real_binder()
        self.device_caches = {0: (None, None, None, None, binder)}
        self.binder = binder
        self.runs = []
        self.kernels = {}
        self.fn = _spec_probe.fn

    __name__ = "spec_probe"

    def triton_kernel(self, args, kwargs):
        _, spec, options = self.binder(*args, **kwargs)
        key = (tuple(spec), tuple(sorted(options.items())))
        return self.kernels.setdefault(key, _FakeKernel(str(len(self.kernels))))

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((args, kwargs, warmup))
        kernel = self.triton_kernel(args, kwargs)
        if not warmup:  # the kernel's own launcher takes every parameter, the constexpr too
            kernel[grid](*args, kwargs.get("BLOCK", 16))
        return kernel


def _spec_launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fl = L.FastLauncher(_SpecJit())
    fl.enabled, fl._binder_ok, fl._sig = True, True, inspect.signature(_spec_probe.fn)
    return fl


def test_spec_table_hit_when_only_unspecialized_values_change(monkeypatch):
    """A new token count with the same divisibility (7 -> 9, 32 -> 48) finds the kernel in the second table: Triton
    runs once per specialization, and each launch gets its own call's arguments."""
    fl = _spec_launcher(monkeypatch)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, 32, BLOCK=32)
    fl[(1,)](x, 9, 0.25, 48, BLOCK=32)  # ints of the same features, another float: Triton's kernel is the same
    assert len(fl.jit_fn.runs) == 1 and fl.spec_hits == 1 and fl.hits == 1
    (kernel,) = fl.jit_fn.kernels.values()
    assert [a[1:4] for _, a in kernel.launches] == [(7, 0.5, 32), (9, 0.25, 48)]
    fl[(1,)](x, 9, 0.25, 48, BLOCK=32)  # now a by-value hit
    assert fl.hits == 2 and fl.spec_hits == 1


@pytest.mark.parametrize("other", [
    lambda x: ((x, 16, 0.5, 32), {"BLOCK": 32}),  # int % 16 == 0
    lambda x: ((x, 1, 0.5, 32), {"BLOCK": 32}),  # int == 1
    lambda x: ((x, 2**40, 0.5, 32), {"BLOCK": 32}),  # 64-bit int
    lambda x: ((x[1:], 7, 0.5, 32), {"BLOCK": 32}),  # unaligned pointer
    lambda x: ((x.half(), 7, 0.5, 32), {"BLOCK": 32}),  # dtype
    lambda x: ((x, 7, 0.5, 32), {"BLOCK": 64}),  # constexpr value
    lambda x: ((x, 7, 0.5, 32), {"BLOCK": 32, "num_warps": 8}),  # a launch option
])
def test_spec_table_misses_on_any_triton_specialization_change(monkeypatch, other):
    fl = _spec_launcher(monkeypatch)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, 32, BLOCK=32)
    args, kwargs = other(x)
    fl[(1,)](*args, **kwargs)
    assert fl.spec_hits == 0 and fl.misses == 2 and len(fl.jit_fn.runs) == 2


def test_spec_table_launches_tritons_kernel_for_random_calls(monkeypatch):
    """Property: over random calls (ints around 1, multiples of 16 and 2^31, aligned and unaligned pointers,
    constexprs), every launch goes to the kernel Triton's own dispatch would pick, with that call's arguments."""
    import random

    fl = _spec_launcher(monkeypatch)
    log = []  # (kernel, arguments) in launch order, over all kernels
    monkeypatch.setattr(_FakeKernel, "__getitem__", lambda k, grid: lambda *a, stream=None: log.append((k, a)))
    rng = random.Random(1234)
    base = torch.zeros(256)
    ints = [1, 2, 15, 16, 17, 31, 32, 48, 1000, 4096, 2**31 - 16, 2**31, 2**33 + 5]
    for i in range(300):
        args = (base[rng.choice([0, 0, 1, 4]):], rng.choice(ints), rng.choice([0.5, 1.0, 3.0]), rng.choice(ints))
        kwargs = {"BLOCK": rng.choice([16, 32])}
        want = fl.jit_fn.triton_kernel(args, kwargs)
        fl[(1,)](*args, **kwargs)
        kernel, launched = log[-1]
        assert len(log) == i + 1 and kernel is want, (args, kwargs)
        assert launched[0] is args[0] and launched[1:4] == args[1:] and launched[4] == kwargs["BLOCK"]
    assert fl.spec_hits > 50 and len(fl.jit_fn.runs) == fl.misses


def test_spec_table_check_mode_catches_a_wrong_kernel(monkeypatch):
    fl = _spec_launcher(monkeypatch)
    monkeypatch.setattr(L, "_CHECK", True)
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, 32)
    key = next(iter(fl._spec_cache))
    fl._spec_cache[key] = _FakeKernel("stale")
    with pytest.raises(RuntimeError, match="another kernel"):
        fl[(1,)](x, 9, 0.5, 32)  # a by-value miss, a second-table hit on the stale kernel


def test_spec_table_skipped_without_a_binder(monkeypatch):
    """A Triton whose JITFunction keeps no binder where this expects it: the second table is switched off, and
    every by-value miss goes through Triton as before."""
    fl = _spec_launcher(monkeypatch)
    fl.jit_fn.device_caches = {}
    x = torch.zeros(64)
    fl[(1,)](x, 7, 0.5, 32)
    fl[(1,)](x, 9, 0.5, 32)
    assert not fl._binder_ok and fl.spec_hits == 0 and fl.misses == 2 and not fl._spec_cache


@pytest.mark.gpu
def test_gpu_spec_table_matches_triton(monkeypatch):
    """Sequence lengths that change value but not Triton's features (300, 301, 333; 4099, 4115) reach the second
    table, and every such launch is the kernel Triton's own dispatch picks (check mode) and writes the same bytes."""
    from mxattn.kernels.quantize import row_scaled_triton

    monkeypatch.setattr(L, "_CHECK", True)
    g = torch.Generator(device="cuda").manual_seed(1)
    before = sum(fl.spec_hits for fl in L._LAUNCHERS.values())
    for S in (300, 301, 333, 4099, 4115):
        x = torch.randn(2, S, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for role in ("q", "k", "v"):
            fast = row_scaled_triton(x, role)
            with L.triton_dispatch():
                slow = row_scaled_triton(x, role)
            assert torch.equal(fast.data.view(torch.uint8), slow.data.view(torch.uint8)), (S, role)
            assert torch.equal(fast.exp, slow.exp), (S, role)
    assert sum(fl.spec_hits for fl in L._LAUNCHERS.values()) > before
