"""A leaner launch path for Triton kernels: the compiled kernel looked up by a cheap key, then launched directly.

Triton's own launch (``kernel[grid](*args)``) binds the arguments, computes each one's specialization, builds a
cache key from them and the options, and checks the kernel's globals: about 60 us of host time per launch on the
GPU machine's CPU for a kernel of ~40 arguments, against ~17 us for the compiled kernel's own launcher
(``benchmarks/results/host_timing-*-s6.json``).  A call of the public attention API launches 5 kernels forward and
~18 forward+backward, so at S <= 4k the calls were bound by the host, not the GPU.

``fast_launcher(jit_fn)[grid](*args, **constexprs)`` launches the same compiled kernel as ``jit_fn[grid](...)``:

- The key holds every argument by value (ints, floats, None, bools, strings, constexprs, launch options) except
  tensors, which count by dtype and whether their address is 16-byte aligned, and Gluon ``TensorDescriptor``s, by
  their tensor's dtype and alignment, shape, strides, block shape, layout and padding.  Triton specializes on no
  more than that (ints on ``== 1``, ``% 16 == 0`` and their range; floats not at all), so the key can only be finer
  than Triton's and a hit never takes a kernel compiled for other specializations.  A miss goes through
  ``jit_fn.run`` (Triton compiles or finds the kernel and launches it) and records the kernel it returned; a cache
  grown past ``MAX_ENTRIES`` (shapes that keep changing) starts over.
- A miss of that table asks a second one, keyed by Triton's own specialization of the call: the list Triton's
  binder makes (each argument's type and specialization, constexprs by value) and the launch options.  It holds
  the kernel for every call whose arguments differ only in values Triton does not specialize on (a jagged batch's
  token count, a new sequence length that keeps the same divisibility), so such a call skips Triton's cache-key
  and launch-metadata work and pays only the binder (the gain per launch is not yet measured).  The entry is
  Triton's own choice for that specialization, recorded when Triton launched it, so the second table cannot take
  another kernel than Triton would.  A Triton whose JITFunction has no binder where this expects it skips the table.
- Arguments the key cannot hash, the interpreter (``TRITON_INTERPRET=1``) and ``MXATTN_FAST_LAUNCH=0`` take
  Triton's own path.
- ``MXATTN_FAST_LAUNCH=check`` asks Triton for the kernel on every hit too (``warmup=True``: no launch) and raises
  if it is not the recorded one: the GPU tests run once that way (``scripts/gpu_check.sh``, stage ``tests``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Callable, Optional

import torch
import triton

MAX_ENTRIES = 1024  # distinct keys per kernel before its cache starts over
_MODE = os.environ.get("MXATTN_FAST_LAUNCH", "1").lower()
_ENABLED = _MODE not in ("0", "false", "off") and os.environ.get("TRITON_INTERPRET", "0") != "1"
_CHECK = _MODE == "check"
_BYPASS = [False]  # set by ``triton_dispatch()``: every launcher takes Triton's own path
# MXATTN_LAUNCH_PLANS=0: no launch plans anywhere (quantize wrappers, the tl and Gluon forwards, the Gluon backward
# launchers): every call takes its checked path, for telling a plan's fault from a kernel's
PLANS = os.environ.get("MXATTN_LAUNCH_PLANS", "1").lower() not in ("0", "false", "off")
# MXATTN_CAUSAL_LPT (read once at import): how the kernels' ``causal_lpt = None`` resolves (``causal_lpt``).
# Causal grids then run their CTAs heaviest block first over sections of heads (kernels/cta_order.py)
# instead of head by head.  "auto" (default): where it measured faster (docs/perf-notes-attn-bwd.md, session 24);
# "1" / "0": everywhere / nowhere.  It also picks the Gluon forward's causal kernel: the per-block one where the order
# is on (``attn_fwd_gluon.default_config``), the persistent one with "0"
CAUSAL_LPT = os.environ.get("MXATTN_CAUSAL_LPT", "auto").lower()
if CAUSAL_LPT not in ("auto", "0", "1"):
    raise ValueError(f"MXATTN_CAUSAL_LPT must be auto, 0 or 1, got {CAUSAL_LPT!r}")
# MXATTN_FAST_LAUNCH_SPEC=0: no second table (a by-value miss goes through Triton's dispatch); read at each miss
SPEC_TABLE = [os.environ.get("MXATTN_FAST_LAUNCH_SPEC", "1").lower() not in ("0", "false", "off")]
_Tensor = torch.Tensor
try:  # the C functions behind torch.cuda.current_device() / current_stream() (absent from CPU-only builds)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
    from torch._C import _cuda_getDevice as _raw_device
except ImportError:
    _raw_device = _raw_stream = None


def current_device() -> int:
    """The current CUDA device's index, as ``torch.cuda.current_device()`` without its Python wrapper: that wrapper
    took 3.6 us a call on the H200 machine's host (session 22, ``timeit``), where a plan key or a launch asks it on
    every call.  Only for callers whose tensors are on a CUDA device (so CUDA is initialized); CPU-only builds (and
    the CPU host harness's stub) take ``torch.cuda.current_device``."""
    if _raw_device is None:
        return torch.cuda.current_device()
    return _raw_device()


def current_stream():
    """The current stream's handle as a compiled kernel's runner takes it (``stream=``), or None (CPU-only builds) to
    let the runner ask: the runner's own lookup goes through ``torch.cuda.current_device()`` on every launch."""
    return None if _raw_stream is None else _raw_stream(_raw_device())


try:  # the Gluon host-side TMA descriptor (triton >= 3.5)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDesc
except ImportError:  # pragma: no cover - older triton
    class _GluonDesc:  # never a launch argument's type
        pass


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of the device (132 for a CPU stand-in: an H100 / H200 SXM, as scripts/compile_launched.py builds)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def causal_lpt(value: Optional[bool], measured_faster: bool) -> bool:
    """A config's ``causal_lpt`` resolved: its own True / False, else (None) MXATTN_CAUSAL_LPT's "1" / "0", else
    ("auto") ``measured_faster``, the kernel's measured rule."""
    if value is not None:
        return bool(value)
    return measured_faster if CAUSAL_LPT == "auto" else CAUSAL_LPT == "1"


def lpt_section(causal: bool, value: Optional[bool], measured_faster: bool, sms: int, ctas_per_sm: int = 1) -> int:
    """A causal launch's LPT_SECTION (kernels/cta_order.py): two waves of CTAs (2 x ctas_per_sm x sms) where the
    order is on (``causal_lpt``), else 0 (head by head, the kernel's default)."""
    return 2 * ctas_per_sm * sms if causal and causal_lpt(value, measured_faster) else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: that one is a ``constexpr_function`` whose call unwraps its arguments and
    re-imports on every call (~6-12 us of host time each on the GPU machine; the wrappers made dozens per call)."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (same bit trick, same results, without its ``constexpr_function``
    call cost)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


@functools.lru_cache(maxsize=None)
def nvmma_fp8_layout(rows: int, cols: int):
    """Gluon's default NVMMA shared layout of an e4m3 (rows, cols) TMA block, built once per shape: the host
    wrappers of the Gluon kernels asked for six per backward call (~10 us each of host time)."""
    from triton.experimental import gluon  # noqa: F401  (the package must load before its language module)
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


def _desc_feature(d) -> tuple:
    b = d.base
    return (_GluonDesc, b.dtype, b.data_ptr() & 15 == 0, tuple(d.shape), tuple(d.strides), tuple(d.block_shape),
            d.layout, d.padding)


class FastLauncher:
    """``fast_launcher(jit_fn)``: ``[grid](*args, **kwargs)`` as ``jit_fn[grid](...)``, with a cheaper host path."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.enabled = _ENABLED and isinstance(jit_fn, triton.runtime.JITFunction)
        self._cache: dict = {}
        self._spec_cache: dict = {}  # Triton's specialization of a call -> kernel, asked on a by-value miss
        self._binder_ok = self.enabled  # False once the binder is missing or fails: the second table is skipped
        self._sig = inspect.signature(jit_fn.fn) if self.enabled else None
        self.hits = 0
        self.spec_hits = 0  # hits of the second table (counted in ``hits`` too)
        self.misses = 0

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one launcher per kernel, kept for the process anyway)
    def _rest(self, n_args: int) -> tuple[tuple, frozenset]:
        """The parameters after the first ``n_args`` with their defaults, and those without one. The launcher takes
        every parameter in signature order (constexprs included, it skips them): after the positional ones, each
        comes from the call's keywords or its default, never from the values of an earlier call."""
        empty = inspect.Parameter.empty
        params = list(self._sig.parameters.items())[n_args:]
        return (tuple((name, None if p.default is empty else p.default) for name, p in params),
                frozenset(name for name, p in params if p.default is empty))

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    @staticmethod
    def _key(args, kwargs):
        # one pass, one type test per argument: the key's cost is most of what is left of a launch's host time
        feats = tuple((a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor) else
                      (_desc_feature(a) if type(a) is _GluonDesc else a) for a in args)
        kw = tuple(kwargs.items())
        if any(isinstance(v, (_Tensor, _GluonDesc)) for _, v in kw):  # never hold a tensor in the cache's keys
            kw = tuple((k, (v.dtype, v.data_ptr() & 15 == 0) if isinstance(v, _Tensor) else
                        (_desc_feature(v) if type(v) is _GluonDesc else v)) for k, v in kw)
        return (current_device(), feats, kw)

    def _binder(self, device: int):
        """Triton's argument binder for ``device`` (``JITFunction.device_caches[device][4]`` in triton 3.6-3.9):
        ``binder(*args, **kwargs) -> (bound_args, specialization, options)``."""
        return self.jit_fn.device_caches[device][4]

    def _spec_key(self, args, kwargs):
        """The second table's key: the current device, Triton's specialization list of the call and its launch
        options; None where the binder is unavailable (then the table is skipped for good), or where this call's
        arguments do not bind or its key is unhashable (this call only: Triton's own path reports a bad call)."""
        if not (self._binder_ok and SPEC_TABLE[0]):
            return None
        dev = current_device()
        try:
            binder = self._binder(dev)
        except Exception:  # noqa: BLE001  (no binder where expected: another Triton's internals)
            self._binder_ok = False
            return None
        try:
            _, spec, options = binder(*args, **kwargs)
            key = (dev, tuple(spec), tuple(options.items()))
            hash(key)
        except Exception:  # noqa: BLE001  (an argument Triton refuses, or an unhashable specialization value)
            return None
        return key

    def _record(self, table: dict, key, entry) -> None:
        if len(table) >= MAX_ENTRIES:
            table.clear()
        table[key] = entry

    def launch(self, grid, args, kwargs) -> None:
        if not self.enabled or _BYPASS[0] or callable(grid):  # a grid function takes Triton's bound arguments
            self.jit_fn[grid](*args, **kwargs)
            return
        try:
            key = self._key(args, kwargs)
            entry = self._cache.get(key)
        except TypeError:  # an argument the key cannot hash
            self.jit_fn[grid](*args, **kwargs)
            return
        g = tuple(grid)
        if entry is None:
            rest, required = self._rest(len(args))
            spec_key = self._spec_key(args, kwargs) if required.issubset(kwargs) else None
            spec_entry = self._spec_cache.get(spec_key) if spec_key is not None else None
            if spec_entry is None:
                kernel = self.jit_fn.run(*args, grid=g, warmup=False, **kwargs)
                self.misses += 1
                if kernel is None or hasattr(kernel, "result"):
                    return  # compiled asynchronously: leave it to Triton next time too
                if required.issubset(kwargs):  # (Triton raised already if not)
                    self._record(self._cache, key, (kernel, rest))
                    if spec_key is not None:
                        self._record(self._spec_cache, spec_key, kernel)
                return
            entry = (spec_entry, rest)
            self._record(self._cache, key, entry)
            self.spec_hits += 1
        kernel, rest = entry
        if _CHECK:
            ref = self.jit_fn.run(*args, grid=g, warmup=True, **kwargs)
            if ref is not kernel:
                raise RuntimeError(f"fast launch of {getattr(self.jit_fn, '__name__', self.jit_fn)}: key {key} maps "
                                   "to another kernel than Triton's own dispatch")
        self.hits += 1
        kernel[g + (1,) * (3 - len(g))](*args, *[kwargs.get(name, default) for name, default in rest],
                                         stream=current_stream())


class BoundLaunch:
    """One launch site with everything but its tensors fixed, for host paths that repeat with the same shapes.

    ``BoundLaunch(launcher, grid, args, kwargs)`` launches ``launcher[grid](*args, **kwargs)`` once (compiling or
    finding the kernel) and keeps the compiled kernel's runner.  ``bound(*args)`` then launches that kernel with new
    positional arguments and the same keywords, skipping the launcher's key.  The caller guarantees that the new
    arguments key the same kernel: equal non-tensor values, tensors of the same dtypes and 16-byte alignment (a plan
    cache keyed on shapes, strides, dtypes and the input's alignment, whose other tensors are fresh allocations).
    Where the launcher would not have cached the kernel (interpreter, ``MXATTN_FAST_LAUNCH=0``, an asynchronous
    compile), and under ``triton_dispatch()``, each call takes ``launcher.launch``; ``MXATTN_FAST_LAUNCH=check``
    asks Triton's own dispatch for the kernel on each call and raises if it is not the bound one.
    """

    __slots__ = ("launcher", "grid", "kwargs", "kernel", "runner", "rest")

    def __init__(self, launcher: "FastLauncher", grid, args: tuple, kwargs: dict):
        self.launcher, self.grid, self.kwargs = launcher, tuple(grid), kwargs
        self.kernel = self.runner = None
        self.rest = ()
        self._launch_and_bind(args)

    def _launch_and_bind(self, args: tuple) -> None:
        """Launch through the launcher, then bind the kernel it cached (not under ``triton_dispatch()``: a later
        call binds then)."""
        launcher, kwargs = self.launcher, self.kwargs
        launcher.launch(self.grid, args, kwargs)
        if not launcher.enabled or _BYPASS[0]:
            return
        try:
            entry = launcher._cache.get(launcher._key(args, kwargs))
        except TypeError:
            return
        if entry is not None:
            self.kernel, rest = entry
            self.runner = self.kernel[self.grid + (1,) * (3 - len(self.grid))]
            self.rest = tuple(kwargs.get(name, default) for name, default in rest)

    def __call__(self, *args) -> None:
        if _BYPASS[0]:
            self.launcher.launch(self.grid, args, self.kwargs)
            return
        if self.runner is None:
            self._launch_and_bind(args)
            return
        if _CHECK:  # Triton's own dispatch must pick the bound kernel for these arguments
            ref = self.launcher.jit_fn.run(*args, grid=self.grid, warmup=True, **self.kwargs)
            if ref is not self.kernel:
                raise RuntimeError(f"bound launch of {getattr(self.launcher.jit_fn, '__name__', '?')}: these "
                                   "arguments key another kernel than the one bound (a plan key misses something)")
        self.launcher.hits += 1
        self.runner(*args, *self.rest, stream=current_stream())


def rebased(desc, base):
    """A copy of the Gluon ``TensorDescriptor`` ``desc`` over ``base``, without its constructor's checks: for a launch
    plan whose template descriptor was built (and checked) on a tensor of the same dtype, shape, strides and 16-byte
    alignment as ``base``."""
    try:
        d = object.__new__(type(desc))
        d.__dict__.update(desc.__dict__)
    except (AttributeError, TypeError):  # a descriptor class without a __dict__: build it the checked way
        return dataclasses.replace(desc, base=base)
    d.base = base
    return d


def unbased(descs) -> tuple:
    """Gluon descriptors as a launch plan keeps them: without their tensors (``rebased`` over ``None``), so a plan
    holds no call's operands alive; a plan hit rebases each over that call's tensors."""
    return tuple(rebased(d, None) for d in descs)


def tensor_sig(t: torch.Tensor) -> tuple:
    """What a launch plan's key holds of a tensor argument: dtype, shape, strides, 16-byte alignment."""
    return (t.dtype, t.shape, t.stride(), t.data_ptr() & 15)


@contextlib.contextmanager
def triton_dispatch():
    """Within the block every launch takes Triton's own dispatch (``jit_fn[grid](...)``): host-time comparisons in
    one process (scripts/host_timing.py) and tests of the fast path against Triton's."""
    was, _BYPASS[0] = _BYPASS[0], True
    try:
        yield
    finally:
        _BYPASS[0] = was


def fast_launcher(jit_fn) -> FastLauncher:
    """The ``FastLauncher`` of ``jit_fn`` (one per kernel, kept on the module's table)."""
    fl = _LAUNCHERS.get(id(jit_fn))
    if fl is None or fl.jit_fn is not jit_fn:
        fl = _LAUNCHERS[id(jit_fn)] = FastLauncher(jit_fn)
    return fl


_LAUNCHERS: dict[int, FastLauncher] = {}
