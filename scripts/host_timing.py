"""Host (CPU) microseconds per call of each layer of the attention call stack (GPU machine).

    PYTHONPATH=. python scripts/host_timing.py [--calls N] [--profile K]

``--profile K``: also cProfile each layer's calls and print its K costliest functions (own time), to see where the
host time of a layer goes (Python wrapper, JIT dispatch, allocations, driver launch).

The shape is tiny (B1 S128 H2 D128), so the GPU finishes each kernel long before the CPU launches the next and
the time per call is the host's. Layers, innermost first: one quantize launch, the forward kernel on prepared
operands, the backward kernels on prepared operands, the custom ops, the public call, forward+backward.
"""

from __future__ import annotations

import argparse
import time

import torch


def host_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / calls * 1e6


def profile_calls(fn, calls: int, top: int) -> None:
    """cProfile ``calls`` calls of ``fn`` (after a warm-up) and print the ``top`` functions by own time."""
    import cProfile
    import pstats

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    # cProfile sees this thread only: autograd runs a CUDA backward on its device thread; torch's profiler sees both
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70))


def triton_dispatch(fn):
    """``fn`` through Triton's own dispatch (mxattn/kernels/launch.py's fast path off), in the same process."""
    from mxattn.kernels.launch import triton_dispatch as off

    def run():
        with off():
            fn()

    return run


def direct_launch(jit_fn, launch):
    """A callable that re-launches the kernel ``launch()`` launches through ``jit_fn``, straight through Triton's
    ``CompiledKernel`` runner with the same bound arguments: what a launch costs without the JIT's dispatch
    (binding, specialization key, cache lookup).  Uses triton 3.x internals (``run``, ``device_caches``); a
    diagnostic only."""
    from mxattn.kernels.launch import triton_dispatch as off

    captured = {}
    orig = jit_fn.run

    def spy(*args, grid, warmup, **kwargs):
        captured.update(args=args, kwargs=kwargs, grid=grid)
        return orig(*args, grid=grid, warmup=warmup, **kwargs)

    jit_fn.run = spy
    try:
        with off():  # through jit_fn.run, where the spy sees the arguments
            launch()
    finally:
        del jit_fn.run
    args, kwargs, grid = captured["args"], captured["kwargs"], tuple(captured["grid"])
    bound, _, _ = jit_fn.device_caches[torch.cuda.current_device()][4](*args, **kwargs)
    kernel = jit_fn.run(*args, grid=grid, warmup=True, **kwargs)  # the cached compiled kernel, not launched
    values = list(bound.values())
    runner = kernel[grid + (1,) * (3 - len(grid))]  # the runner reads grid[0..2]
    return lambda: runner(*values)


def jagged_new_lengths(calls: int, spec_table: bool, backward: bool, same: bool = False, shift: int = 1) -> float:
    """Median host us per jagged call (``mxfp8_attn_varlen_func``, 2 sequences, H2 D128) when every call brings a
    token count not seen before, as packed training steps do: each launch then misses the by-value launch table.
    A warm pass over ``calls`` batches compiles what they need; the timed pass shifts every length by
    ``2048 * shift`` (give each row its own ``shift``: a length another row timed would hit the by-value table),
    which changes each int argument's value and keeps its Triton features, so no call compiles and every launch
    asks the second table (``spec_table``) or Triton's dispatch.  ``same``: the timed pass repeats one batch
    (by-value hits: the floor).  ``cu_seqlens`` are CPU tensors, one per batch for q and k: a CUDA one not seen
    before is read back by the jagged API's length checks, a sync that would put the GPU's time into the host's
    (a repeated one is not: ``interface._cu_host_and_device``)."""
    from mxattn import mxfp8_attn_varlen_func
    from mxattn.kernels import launch

    def batch(n: int):
        lens = [n, 67]
        x = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16)
        q, k, v = (x.clone().requires_grad_(backward) for _ in range(3))
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)  # on the CPU: no read-back sync per call
        return q, k, v, cu, max(lens)

    def call(b):
        q, k, v, cu, m = b
        if backward:
            mxfp8_attn_varlen_func(q, k, v, cu, cu, m, m).sum().backward()
        else:
            with torch.no_grad():
                mxfp8_attn_varlen_func(q, k, v, cu, cu, m, m)

    warm = [batch(131 + 16 * j) for j in range(calls)]
    timed = [warm[0]] * calls if same else [batch(131 + 16 * j + 2048 * shift) for j in range(calls)]
    for b in warm:
        call(b)
    torch.cuda.synchronize()
    was, launch.SPEC_TABLE[0] = launch.SPEC_TABLE[0], spec_table
    try:
        ts = []
        for b in timed:
            t0 = time.perf_counter()
            call(b)
            ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    finally:
        launch.SPEC_TABLE[0] = was
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, help="print the K costliest functions of each layer")
    ap.add_argument("--out", default=None, help="folder for host_timing-<gpu>-<date>.json (rows: layer, us)")
    ap.add_argument("--only", default=None, help="time only the rows whose name contains one of these "
                    "(comma-separated)")
    args = ap.parse_args(argv)
    from mxattn import mxfp8_attn_func
    from mxattn.interface import attn_bwd_op, attn_fwd_op
    from mxattn.kernels.attn_bwd import Q_EXP_GROUP, attn_bwd_hopper, attn_bwd_preprocess
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton

    B, S, H, D = 1, 128, 2, 128
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    qr, kr, vr = row_scaled_triton(q, "q"), row_scaled_triton(k, "k"), row_scaled_triton(v, "v")
    out, lse = attn_fwd_hopper(qr, kr, vr)
    qb, vh, qs, ks = (row_scaled_triton(q, "k", k_group=Q_EXP_GROUP), row_scaled_triton(v, "k"),
                      row_scaled_triton(q, "v"), row_scaled_triton(k, "v"))
    scale = D ** -0.5
    cases = [
        ("torch.empty_like", lambda: torch.empty_like(q)),
        ("bf16 add (one ATen kernel)", lambda: q + k),
        ("row_scaled_triton q (1 launch)", lambda: row_scaled_triton(q, "q")),
        ("row_scaled_triton k (1 launch)", lambda: row_scaled_triton(k, "k")),
        ("row_scaled_triton v (2 launches)", lambda: row_scaled_triton(v, "v")),
        ("attn_fwd_hopper (1 launch)", lambda: attn_fwd_hopper(qr, kr, vr)),
        ("attn_bwd_preprocess", lambda: attn_bwd_preprocess(out, do)),
        ("attn_bwd_hopper atomic", lambda: attn_bwd_hopper(qb, kr, vh, qs, ks, out, do, lse)),
        ("attn_bwd_hopper deterministic", lambda: attn_bwd_hopper(qb, kr, vh, qs, ks, out, do, lse,
                                                                  deterministic=True)),
        ("attn_fwd_op", lambda: attn_fwd_op(q, k, v, False, scale, "rceil", False)),
        ("attn_bwd_op", lambda: attn_bwd_op(do, q, k, v, out, lse, False, scale, "rceil", False)),
        ("mxfp8_attn_func no_grad", lambda: torch.no_grad()(mxfp8_attn_func)(q, k, v)),
        ("mxfp8_attn_func with grad (fwd only)", lambda: mxfp8_attn_func(qg, kg, vg)),
        ("mxfp8_attn_func fwd+bwd", lambda: mxfp8_attn_func(qg, kg, vg).backward(do)),
    ]
    # the backward alone as `mxattn bench` times it (autograd.grad of a retained graph), beside SDPA's (session 21:
    # the fwd+bwd row exceeded the forward and attn_bwd_op together by ~800 us on the H100 host)
    import torch.nn.functional as F

    kept = mxfp8_attn_func(qg, kg, vg)
    t = [x.transpose(1, 2) for x in (qg, kg, vg)]
    kept_sdpa = F.scaled_dot_product_attention(*t)
    do_t = do.transpose(1, 2)
    cases += [
        ("mxfp8_attn_func backward only (autograd.grad, retained graph)",
         lambda: torch.autograd.grad(kept, (qg, kg, vg), do, retain_graph=True)),
        ("sdpa (default backend) fwd+bwd", lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(*t), (qg, kg, vg), do_t)),
        ("sdpa (default backend) backward only (autograd.grad, retained graph)",
         lambda: torch.autograd.grad(kept_sdpa, (qg, kg, vg), do_t, retain_graph=True)),
        ("mxfp8_attn_func fwd+bwd (autograd.grad)",
         lambda: torch.autograd.grad(mxfp8_attn_func(qg, kg, vg), (qg, kg, vg), do)),
    ]
    try:  # the Gluon forward (d128 from S 2k / 4k on Hopper): its launch plan against its checked path (session 19)
        from mxattn.kernels import attn_fwd_gluon as g

        cases += [
            ("attn_fwd_gluon (1 launch, launch plan)", lambda: g.attn_fwd_gluon(qr, kr, vr)),
            ("attn_fwd_gluon (1 launch, checked path)",
             lambda: g.attn_fwd_gluon(qr, kr, vr, config=g.default_config(D, False))),
            ("mxfp8_attn_func no_grad, Gluon forward",
             lambda: torch.no_grad()(mxfp8_attn_func)(q, k, v, backend="gluon")),
            ("mxfp8_attn_func with grad (fwd only), Gluon forward",
             lambda: mxfp8_attn_func(qg, kg, vg, backend="gluon")),
        ]
    except Exception as e:  # no Gluon here
        print(f"(no Gluon rows: {type(e).__name__}: {e})")
    cases += [(name + ", Triton's own dispatch", triton_dispatch(fn)) for name, fn in cases
              if name.startswith(("attn_fwd_hopper", "row_scaled_triton q", "attn_bwd_hopper atomic", "mxfp8_attn_func"))]
    try:  # the forward kernel without the JIT's dispatch: how much a leaner launch path could save per launch
        from mxattn.kernels.attn_fwd import _attn_fwd_kernel

        cases.insert(6, ("attn_fwd kernel, CompiledKernel runner (no JIT dispatch)",
                         direct_launch(_attn_fwd_kernel, lambda: attn_fwd_hopper(qr, kr, vr))))
    except Exception as e:  # triton internals moved: report and go on
        print(f"(no direct-launch row: {type(e).__name__}: {e})")
    for bwd in (False, True):  # jagged batches whose token count changes every call (the second launch table)
        what = "fwd+bwd" if bwd else "no_grad fwd"
        cases += [
            (f"jagged {what}, the same lengths every call (median)",
             lambda bwd=bwd: jagged_new_lengths(args.calls, True, bwd, same=True)),
            (f"jagged {what}, new lengths every call, second launch table (median)",
             lambda bwd=bwd: jagged_new_lengths(args.calls, True, bwd, shift=1 + 2 * bwd)),
            (f"jagged {what}, new lengths every call, Triton's dispatch on a miss (median)",
             lambda bwd=bwd: jagged_new_lengths(args.calls, False, bwd, shift=2 + 2 * bwd)),
        ]
    if args.only:
        cases = [(name, fn) for name, fn in cases if any(w in name for w in args.only.split(","))]
    print(f"host us per call, B{B} S{S} H{H} D{D}, {args.calls} calls each")
    rows = []
    for name, fn in cases:
        try:
            us = fn() if name.startswith("jagged") else host_us(fn, args.calls)
        except Exception as e:  # one broken row does not hide the others
            print(f"   failed  {name}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{us:9.1f}  {name}", flush=True)
        rows.append({"layer": name, "host_us_per_call": us})
    from mxattn.kernels import launch

    print("\nfast launch path, per kernel: hits (of them second-table hits) / misses over the whole run (a miss per "
          "call would mean a key that changes every call)")
    for fl in launch._LAUNCHERS.values():
        if fl.hits or fl.misses:
            print(f"{fl.hits:8d} ({fl.spec_hits:6d}) / {fl.misses:<6d} {getattr(fl.jit_fn, '__name__', fl.jit_fn)}")
    if args.out:
        from mxattn.bench.results import write_result

        print(write_result("host_timing", rows, args.out, extra={
            "shape": f"B{B} S{S} H{H} D{D} (GPU work negligible: time per call is the host's)",
            "command": "PYTHONPATH=. python scripts/host_timing.py", "calls": args.calls,
            "fast_launch": {getattr(fl.jit_fn, "__name__", "?"): [fl.hits, fl.misses, fl.spec_hits]
                            for fl in launch._LAUNCHERS.values() if fl.hits or fl.misses}}))
    if args.profile:
        for name, fn in cases:
            if name.startswith("jagged"):  # each of these times a whole pass itself
                continue
            print(f"\n--- {name}: {args.profile} costliest functions (own time), {args.calls} calls")
            try:
                profile_calls(fn, args.calls, args.profile)
            except Exception as e:
                print(f"   failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
