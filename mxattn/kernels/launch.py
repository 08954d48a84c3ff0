"""A leaner launch path for Triton kernels: the compiled kernel looked up by a cheap key, then launched directly.

Triton's own launch (``kernel[grid](*args)``) binds the arguments, computes each one's specialization, builds a
cache key from them and the options, and checks the kernel's globals: about 60 us of host time per launch on the
GPU machine's CPU for a kernel of ~40 arguments, against ~17 us for the compiled kernel's own launcher
(``benchmarks/results/host_timing-*-s6.txt``).  A call of the public attention API launches 5 kernels forward and
~18 forward+backward, so at S <= 4k the calls were bound by the host, not the GPU.

``fast_launcher(jit_fn)[grid](*args, **constexprs)`` launches the same compiled kernel as ``jit_fn[grid](...)``:

- The key holds, per argument, everything Triton specializes on and more: constexpr parameters and every keyword
  argument (constexprs, launch options) by value; a tensor's dtype and whether its address is 16-byte aligned; an
  int's ``== 1``, ``% 16 == 0`` and 32/64-bit range; a float's type; None, bools and strings by value; a Gluon ``TensorDescriptor``'s dtype, alignment, shape, strides,
  block shape, layout and padding.  The key can only be finer than Triton's, so a hit never takes a kernel
  compiled for other specializations; it may compile nothing new either: a miss goes through ``jit_fn.run``
  (Triton compiles or finds the kernel and launches it) and records the kernel it returned.
- Arguments of any other type, the interpreter (``TRITON_INTERPRET=1``), a cache grown past ``MAX_ENTRIES``
  and ``MXATTN_FAST_LAUNCH=0`` all take Triton's own path.
- ``MXATTN_FAST_LAUNCH=check`` asks Triton for the kernel on every hit too (``warmup=True``: no launch) and raises
  if it is not the recorded one: the GPU tests run once that way (``scripts/gpu_check.sh``, stage ``tests``).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch
import triton

MAX_ENTRIES = 4096  # distinct keys per kernel before the fast path gives up on it (shapes of descriptors vary)
_MODE = os.environ.get("MXATTN_FAST_LAUNCH", "1").lower()
_ENABLED = _MODE not in ("0", "false", "off") and os.environ.get("TRITON_INTERPRET", "0") != "1"
_CHECK = _MODE == "check"
_I32 = (-(2**31), 2**31)

try:  # the Gluon host-side TMA descriptor (triton >= 3.5)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDesc
except ImportError:  # pragma: no cover - older triton
    _GluonDesc = None


class _Unsupported(Exception):
    """An argument the key does not know how to describe: take Triton's path."""


def _feature(a: Any):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    t = type(a)
    if t is bool or a is None or t is str:
        return a
    if t is int:
        return (a == 1, a & 15 == 0, _I32[0] <= a < _I32[1], a >= 2**63)
    if t is float:
        return float
    if _GluonDesc is not None and t is _GluonDesc:
        b = a.base
        return (_GluonDesc, b.dtype, b.data_ptr() & 15 == 0, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                a.layout, a.padding)
    if isinstance(a, (triton.language.dtype, triton.language.constexpr)):
        return a
    raise _Unsupported(t.__name__)


class FastLauncher:
    """``fast_launcher(jit_fn)``: ``[grid](*args, **kwargs)`` as ``jit_fn[grid](...)``, with a cheaper host path."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.enabled = _ENABLED and isinstance(jit_fn, triton.runtime.JITFunction)
        self._cache: dict = {}
        self._sig = inspect.signature(jit_fn.fn) if self.enabled else None
        # constexpr parameters are keyed by value wherever they are passed (keywords always are)
        self._const_pos = frozenset(p.num for p in getattr(jit_fn, "params", ()) if p.is_constexpr)
        self.hits = 0
        self.misses = 0

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args, kwargs):
        cp = self._const_pos
        feats = tuple(a if i in cp else _feature(a) for i, a in enumerate(args)) if cp else tuple(map(_feature, args))
        return (torch.cuda.current_device(), feats, tuple(kwargs.items()))

    def launch(self, grid, args, kwargs) -> None:
        if not self.enabled:
            self.jit_fn[grid](*args, **kwargs)
            return
        try:
            key = self._key(args, kwargs)
            entry = self._cache.get(key)
        except (_Unsupported, TypeError):  # an argument the key cannot describe or hash
            self.jit_fn[grid](*args, **kwargs)
            return
        g = tuple(grid(kwargs) if callable(grid) else grid)  # a callable grid is given the keyword arguments only
        if entry is None:
            kernel = self.jit_fn.run(*args, grid=g, warmup=False, **kwargs)
            self.misses += 1
            if kernel is None or hasattr(kernel, "result") or len(self._cache) >= MAX_ENTRIES:
                return  # compiled asynchronously, or too many shapes: leave it to Triton next time too
            # the launcher takes every parameter in signature order (constexprs included, it skips them)
            bound = self._sig.bind(*args, **{k: v for k, v in kwargs.items() if k in self._sig.parameters})
            bound.apply_defaults()
            tail = tuple(bound.arguments.values())[len(args):]
            self._cache[key] = (kernel, tail)
            return
        kernel, tail = entry
        if _CHECK:
            ref = self.jit_fn.run(*args, grid=g, warmup=True, **kwargs)
            if ref is not kernel:
                raise RuntimeError(f"fast launch of {self.jit_fn.__name__}: key {key} maps to another kernel than "
                                   "Triton's own dispatch")
        self.hits += 1
        kernel[g + (1,) * (3 - len(g))](*args, *tail)


def fast_launcher(jit_fn) -> FastLauncher:
    """The ``FastLauncher`` of ``jit_fn`` (one per kernel, kept on the module's table)."""
    fl = _LAUNCHERS.get(id(jit_fn))
    if fl is None or fl.jit_fn is not jit_fn:
        fl = _LAUNCHERS[id(jit_fn)] = FastLauncher(jit_fn)
    return fl


_LAUNCHERS: dict[int, FastLauncher] = {}
