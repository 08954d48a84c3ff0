"""Host time per call of the attention API's CUDA-path Python, measured on a machine without a GPU.

    PYTHONPATH=. python scripts/host_overhead_cpu.py [--calls N] [--repeats R] [--profile K] [--only SUBSTR]
        [--predict]

``scripts/host_timing.py`` measures host time per call on the GPU machine, whose time is scarce; this runs the same
Python here, on CPU tensors, with every kernel launch stubbed, so that a change to the host path can be measured
and profiled before a GPU call.  Each row is the best of ``--repeats`` means over ``--calls`` calls (the machine
is shared: short runs, the least disturbed one counts), B1 S128 H2 D128 bf16 as host_timing.py.

How CPU tensors take the CUDA path (``stub_gpu()``; the stubs live here only):

- mxattn is imported before TRITON_INTERPRET=1 is set, so its import-time switches say "GPU" (the fast launch path
  on, the kernels' ``INTERPRETER`` off); the variable set afterwards lets the call-time device checks of the
  quantize launchers accept CPU tensors, as they do under the interpreter;
- ``torch.Tensor.is_cuda`` reads True: the library's "do the CUDA kernels run" tests (``t.is_cuda``) take the CUDA
  branch, while every allocation follows ``t.device``, the CPU;
- ``torch.cuda.current_device`` / ``get_device_capability`` answer 0 / (9, 0), an H200;
- the backward's kernel choice (``attn_bwd.backward_kernel``) is asked about cuda:0 with Gluon available, so the
  Gluon backward runs, as on the H200 with triton 3.6; rows named "tl" set MXATTN_BWD_KERNEL=tl;
- Triton's dispatch (``JITFunction.run``, which would compile and launch) returns a stand-in compiled kernel whose
  runner counts the launch; mxattn's fast launch path, its tables and its bound launches run unchanged on top of
  it.

Not measured here: the driver's part of each launch (the H200's host spends ~10-16 us in a compiled kernel's
launcher, ``host_timing`` row "CompiledKernel runner"), CUDA allocations (a few us each against ~1 us on the CPU)
and the difference in CPU speed; each row counts its launches, allocations and ATen kernels, and ``--predict``
turns them and the time into a rough H200 estimate (``predict``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

B, S, H, D = 1, 128, 2, 128


class StubKernel:
    """Stands in for a ``CompiledKernel``: ``kernel[grid](*args)`` counts the launch in ``stats`` (by kernel name)."""

    def __init__(self, name: str, stats: dict):
        self.name, self.stats = name, stats

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, stream=None):  # (a compiled kernel's runner signature)
        self.stats[self.name] = self.stats.get(self.name, 0) + 1


# every kernel module the measured calls reach (several are imported lazily, at a call)
_KERNEL_MODULES = ("launch", "quantize", "attn_fwd", "attn_bwd", "attn_bwd_dkdv_gluon", "attn_bwd_dq_gluon", "varlen",
                   "bwd_varlen_tiles")


@contextlib.contextmanager
def stub_gpu():
    """Within the block, CPU tensors run mxattn's CUDA-path Python with launches stubbed (module docstring).  Yields
    the launch counts by kernel name."""
    import importlib

    from triton.runtime.jit import JITFunction

    for name in _KERNEL_MODULES:  # before TRITON_INTERPRET is set: JIT functions, import-time switches say "GPU"
        importlib.import_module(f"mxattn.kernels.{name}")

    from mxattn.kernels import attn_bwd, launch

    if not launch._ENABLED:
        raise RuntimeError("mxattn was imported under TRITON_INTERPRET=1 or MXATTN_FAST_LAUNCH=0: the fast launch "
                           "path is off, this would not measure the GPU's host path")
    stats: dict = {}
    kernels: dict = {}  # one stand-in per (JIT function, constexprs and options): the fast path's view of a kernel
    orig_backward_kernel = attn_bwd.backward_kernel

    def run(self, *args, grid, warmup, **kwargs):
        name = getattr(self, "__name__", "?")
        kernel = kernels.setdefault((id(self), tuple(kwargs.items())), StubKernel(name, stats))
        if not warmup:
            kernel[grid](*args, *kwargs.values())
        return kernel

    patched = [(JITFunction, "run"), (torch.Tensor, "is_cuda"), (torch.cuda, "current_device"),
               (torch.cuda, "get_device_capability"), (attn_bwd, "backward_kernel"), (attn_bwd, "_gluon_runs_on")]
    saved = [(owner, name, vars(owner).get(name)) for owner, name in patched]  # None: inherited (TensorBase.is_cuda)
    env = os.environ.get("TRITON_INTERPRET")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ATen ops left on the CPU (gradient sums, the jagged rows' loss) stay off the
    # thread pool, whose waits on a shared machine took milliseconds; on the GPU they are kernel launches
    JITFunction.run = run
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    attn_bwd._gluon_runs_on = lambda index: True
    cuda0 = torch.device("cuda", 0)
    attn_bwd.backward_kernel = lambda device=None: orig_backward_kernel(cuda0)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield stats
    finally:
        torch.set_num_threads(threads)
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env


@contextlib.contextmanager
def env_set(name: str, value):
    """``os.environ[name] = value`` within the block (None: unset)."""
    was = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


# A rough model of the H200 machine's host time per call from this harness's numbers, fitted by hand to session 12's
# host_timing rows (host_timing-nvidia-h200-2026-12-01-s12.txt against this harness on commit fc151a5): the
# compiled kernel's launcher (~16 us, host_timing's "CompiledKernel runner" row), a CUDA allocation (~3 us: its
# torch.empty_like row, less the CPU's), an ATen kernel launch (~8 us: its bf16 add row, less an allocation), and
# the Python here times PY_FACTOR.  The rows give PY_FACTOR 1.9-4.6 (the largest for the public calls, whose
# autograd and CUDA-side work this harness does not see), so a prediction is good to about +-40 %.
PY_FACTOR, LAUNCH_US, ALLOC_US, ATEN_US = 3.0, 16.0, 3.0, 8.0


def predict(us: float, launches: int, allocs: int, aten: int) -> float:
    """Predicted host us per call on the H200 machine (the model above)."""
    return PY_FACTOR * us + LAUNCH_US * launches + ALLOC_US * allocs + ATEN_US * aten


def best_us(fn, calls: int, repeats: int) -> float:
    """Best of ``repeats`` means over ``calls`` calls of ``fn``, in microseconds (after a warm-up)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def cases():
    """(name, callable) of each layer, innermost first; the jagged rows pass CPU cu_seqlens, as host_timing.py."""
    from mxattn import mxfp8_attn_func, mxfp8_attn_varlen_func
    from mxattn.kernels.attn_bwd import Q_EXP_GROUP, attn_bwd_hopper, attn_bwd_preprocess
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, generator=g).to(torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    qr, kr, vr = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
    out, lse = attn_fwd_hopper(qr, kr, vr)
    qb, vh, qs, ks = (row_scaled_triton(q, "k", k_group=Q_EXP_GROUP), row_scaled_triton(v, "k"),
                      row_scaled_triton(q, "v"), row_scaled_triton(k, "v"))
    lens = [S, 67]
    x = torch.randn(sum(lens), H, D, generator=g).to(torch.bfloat16)
    jq, jk, jv = (x.clone() for _ in range(3))
    jqg, jkg, jvg = (t.clone().requires_grad_() for t in (jq, jk, jv))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)

    def tl(fn):
        def run():
            with env_set("MXATTN_BWD_KERNEL", "tl"):
                fn()
        return run

    def bwd(*a, **kw):
        return lambda: attn_bwd_hopper(qb, kr, vh, qs, ks, out, do, lse, *a, **kw)

    kept = mxfp8_attn_func(qg, kg, vg)  # a retained graph: the backward alone, as `mxattn bench` times it
    return [
        ("row_scaled_triton q (1 launch)", lambda: row_scaled_triton(q, "q")),
        ("attn_fwd_hopper (1 launch)", lambda: attn_fwd_hopper(qr, kr, vr)),
        ("attn_bwd_preprocess", lambda: attn_bwd_preprocess(out, do)),
        ("attn_bwd_hopper Gluon", bwd()),
        ("attn_bwd_hopper tl atomic", tl(bwd())),
        ("attn_bwd_hopper tl deterministic", tl(bwd(deterministic=True))),
        ("mxfp8_attn_func no_grad", lambda: torch.no_grad()(mxfp8_attn_func)(q, k, v)),
        ("mxfp8_attn_func with grad (fwd only)", lambda: mxfp8_attn_func(qg, kg, vg)),
        ("mxfp8_attn_func fwd+bwd", lambda: mxfp8_attn_func(qg, kg, vg).backward(do)),
        ("mxfp8_attn_func backward only (autograd.grad)",
         lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True)),
        ("mxfp8_attn_func fwd+bwd, tl backward", tl(lambda: mxfp8_attn_func(qg, kg, vg).backward(do))),
        ("jagged no_grad fwd", lambda: torch.no_grad()(mxfp8_attn_varlen_func)(jq, jk, jv, cu, cu, S, S)),
        ("jagged fwd+bwd", lambda: mxfp8_attn_varlen_func(jqg, jkg, jvg, cu, cu, S, S).sum().backward()),
    ]


def launches_per_call(fn, stats: dict) -> int:
    """How many Triton kernels one call of ``fn`` launches."""
    before = sum(stats.values())
    fn()
    return sum(stats.values()) - before


def aten_per_call(fn) -> tuple[int, int]:
    """(allocations, ATen kernels) of one call of ``fn``: the tensor allocations and the ATen ops that would run a
    device kernel (not views; ``torch.full`` is both), which cost the GPU machine's host a caching-allocator call or
    a kernel launch each, beyond this harness's CPU time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = [0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if not func.is_view and name not in ("detach", "_unsafe_view", "alias", "lift_fresh"):
                in_place = name.endswith("_")  # fill_, copy_, zero_: a kernel into an existing tensor
                empty = name in ("empty", "new_empty", "empty_strided", "empty_like")  # an allocation only
                counts[0] += not in_place
                counts[1] += not empty
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts[0], counts[1]


def profile(fn, calls: int, top: int) -> None:
    """cProfile ``calls`` calls of ``fn`` and print the ``top`` functions by own time and by cumulative time."""
    import cProfile
    import pstats

    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, help="also print each row's K costliest functions")
    ap.add_argument("--only", default=None, help="rows whose name contains this")
    ap.add_argument("--predict", action="store_true", help="also print the H200 host time the model predicts")
    args = ap.parse_args(argv)
    import triton

    with stub_gpu() as stats:
        rows = [(n, f) for n, f in cases() if args.only is None or args.only in n]
        print(f"host us per call, CPU harness (launches stubbed), B{B} S{S} H{H} D{D}, best of {args.repeats} x "
              f"{args.calls} calls, torch {torch.__version__}, triton {triton.__version__}")
        timed = []
        for name, fn in rows:
            try:
                timed.append((name, fn, best_us(fn, args.calls, args.repeats), launches_per_call(fn, stats)))
            except Exception as e:  # one broken row does not hide the others
                print(f"   failed  {name}: {type(e).__name__}: {e}", flush=True)
        # counted after every timing: once a dispatch mode has run, some ATen ops take a slower path for good
        for name, fn, us, n in timed:
            allocs, aten = aten_per_call(fn)
            pred = f"  ~{predict(us, n, allocs, aten):5.0f} predicted" if args.predict else ""
            print(f"{us:9.1f}  {name} ({n} launches, {allocs} allocations, {aten} ATen kernels){pred}", flush=True)
        if args.profile:
            for name, fn in rows:
                print(f"\n--- {name}: {args.profile} costliest functions, {args.calls} calls")
                profile(fn, args.calls, args.profile)


if __name__ == "__main__":
    main()
