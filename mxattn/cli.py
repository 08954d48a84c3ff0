"""The ``mxattn`` command (also ``python -m mxattn``).

    mxattn demo      [--out DIR] [--quick] [--device cpu|cuda] [shape options]
    mxattn bench     [--out DIR] [--quick] [--methods ...] [--seqlens ...] [--head-dims ...] [--no-backward] ...
    mxattn accuracy  [--out DIR] [--quick] [--families ...] [--methods ...] [shape options]
    mxattn report    [--results DIR] [--readme README.md] [--check]

Every command that measures writes JSON (``<what>-<gpu>-<date>.json``) and PNG files under ``--out``
(default ``out/``).  Recorded results live in ``benchmarks/results/``: copy a GPU run's JSON there and run
``mxattn report --readme README.md`` to regenerate the README's tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]


def _ints(text: str) -> list[int]:
    """``"1024,2k,4K"`` -> ``[1024, 2048, 4096]``."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        mult = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(part[:-1] if mult > 1 else part) * mult)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers (1024 or 1k), got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def _names(text: str) -> list[str]:
    return [p for p in text.replace(" ", "").split(",") if p]


def _causal(text: str) -> tuple[bool, ...]:
    choices = {"both": (False, True), "yes": (True,), "no": (False,), "true": (True,), "false": (False,)}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"--causal takes both, yes or no, got {text!r}")
    return choices[text.lower()]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("out"), help="folder for JSON and PNG output (default: out/)")
    p.add_argument("--quick", action="store_true", help="a smaller run (seconds on a CPU, a minute on a GPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plot", action="store_true", help="write JSON only")


def _acc_shape_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shape (default: small on the CPU, larger on a GPU)")
    g.add_argument("--batch", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seqlen", type=int)
    g.add_argument("--head-dim", type=int, choices=(64, 128))
    g.add_argument("--causal", action="store_true", help="causal attention (long_causal always is)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxattn", description="MXFP8 attention for PyTorch: demo, speed and accuracy benchmarks, README report."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("demo", help="end to end: quantize, attention forward and backward, error table (and speed on GPU)")
    _common(p)
    _acc_shape_args(p)

    p = sub.add_parser("bench", help="attention speed: TFLOP/s of mxattn against SDPA (cuDNN, flash) and cuDNN FP8")
    _common(p)
    g = p.add_argument_group("shapes (default: the issue-6 grid; any option here builds a grid from these instead)")
    g.add_argument("--batch", type=int, help="default 2")
    g.add_argument("--heads", type=int, help="query heads, default 16")
    g.add_argument("--kv-heads", type=int, help="key/value heads (GQA), default = --heads")
    g.add_argument("--head-dims", type=_ints, help="e.g. 128 or 64,128 (default 128)")
    g.add_argument("--seqlens", type=_ints, help="e.g. 1k,2k,4k,8k,16k")
    g.add_argument("--causal", type=_causal, help="both (default), yes or no")
    p.add_argument("--methods", type=_names, help="comma-separated, from: mxattn, sdpa_cudnn_bf16, sdpa_flash_bf16, "
                   "sdpa_bf16, cudnn_fp8 (default: all that run here)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time forward and backward as CUDA-graph replays (GPU work without host launch overhead; "
                        "forward+backward not timed); JSON what=attn_fwd_cuda_graph / attn_bwd_cuda_graph")
    p.add_argument("--quantize", action="store_true", help="also run mxattn.bench.quantize_bench when it exists "
                   "(what=quantize; scripts/gpu_check.sh runs it as its own stage)")

    p = sub.add_parser("accuracy", help="SQNR / cosine / max relative error against fp64 on several input families")
    _common(p)
    _acc_shape_args(p)
    p.add_argument("--families", type=_names, help="comma-separated, from: gaussian, outlier_channels, heavy_tailed, "
                   "attention_sink, long_causal (default: all)")
    p.add_argument("--methods", type=_names, help="comma-separated, from: mxfp8_ref, mxfp8_kernel (CUDA), "
                   "fp8_per_tensor, bf16 (default: all that run here)")

    p = sub.add_parser("report", help="README tables from benchmarks/results/*.json")
    p.add_argument("--results", type=Path, default=None, help="folder of result JSON (default benchmarks/results)")
    p.add_argument("--readme", type=Path, default=None, help="rewrite this README's generated section")
    p.add_argument("--check", action="store_true", help="with --readme: exit 1 if the README is out of date")
    return parser


def _device(args) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mxattn: --device cuda, but torch sees no CUDA GPU")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _acc_shape(args, device: str):
    from mxattn.bench.accuracy import AccShape, default_shape

    base = default_shape(device, args.quick)
    return AccShape(
        args.batch or base.B, args.heads or base.H, args.seqlen or base.S, args.head_dim or base.D, bool(args.causal)
    )


def _cmd_demo(args) -> int:
    from mxattn.bench.demo import run_demo

    device = _device(args)
    run_demo(args.out, args.quick, device, _acc_shape(args, device), args.seed, progress=not args.no_progress,
             plot=not args.no_plot)
    return 0


def _cmd_bench(args) -> int:
    from mxattn.bench import speed
    from mxattn.bench.results import write_result

    device = _device(args)
    grid = (args.batch, args.heads, args.kv_heads, args.head_dims, args.seqlens, args.causal)
    if any(v is not None for v in grid):
        shapes = speed.grid_shapes(
            args.batch or 2, args.heads or 16, args.kv_heads, args.head_dims or (128,),
            args.seqlens or (1024, 2048, 4096, 8192, 16384), args.causal or (False, True),
        )
    else:
        shapes = speed.default_shapes(args.quick, device)
    if device == "cpu":
        print("mxattn bench: no CUDA GPU, so this times the CPU reference and torch's CPU SDPA on tiny shapes.\n"
              "It checks the benchmark runs; its numbers say nothing about GPU kernels.")
    methods = args.methods or speed.default_methods(device)
    why_not = speed.METHODS["cudnn_fp8"].available()
    if device == "cuda" and not args.methods and why_not:
        print(f"mxattn bench: leaving out cudnn_fp8: {why_not} (README: 'cuDNN FP8 baseline')")
    if args.cuda_graph:
        if device != "cuda":
            raise SystemExit("mxattn bench: --cuda-graph needs a CUDA device")
    fwd, bwd = speed.run_speed(shapes, methods, device, not args.no_backward, args.seed, not args.no_progress,
                               cuda_graph=args.cuda_graph)
    print(speed.format_speed_table(fwd, "forward" + (" (CUDA-graph replays)" if args.cuda_graph else "")))
    files = [write_result("attn_fwd_cuda_graph" if args.cuda_graph else "attn_fwd", fwd, args.out,
                          {"methods": methods, "timing": "cuda_graph_replay" if args.cuda_graph else "eager"})]
    if not args.no_backward and args.cuda_graph:
        print(speed.format_speed_table(bwd, "backward (CUDA-graph replays)"))
        files.append(write_result("attn_bwd_cuda_graph", bwd, args.out,
                                  {"methods": methods, "timing": "cuda_graph_replay"}))
    elif not args.no_backward:
        print(speed.format_speed_table(bwd, "backward"))
        print(speed.format_speed_table(bwd, "forward+backward", key="tflops_fwd_bwd"))
        files.append(write_result("attn_bwd", bwd, args.out, {"methods": methods}))
    if not args.no_plot:
        from mxattn.bench.plots import plot_speed

        files += plot_speed(fwd, [] if args.no_backward else bwd, args.out / "attn-speed")
    if args.quantize:
        try:
            rows = speed.run_quantize_hook(device, args.quick, not args.no_progress)
            if rows is None:
                print("mxattn bench: --quantize: mxattn.bench.quantize_bench is not there (yet)")
            else:
                files.append(write_result("quantize", rows, args.out))
        except Exception as e:  # the attention results above stand on their own
            print(f"mxattn bench: the quantization benchmark failed: {type(e).__name__}: {e}")
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _cmd_accuracy(args) -> int:
    from mxattn.bench import accuracy
    from mxattn.bench.results import write_result

    device = _device(args)
    shape = _acc_shape(args, device)
    rows = accuracy.run_accuracy(args.families, args.methods, shape, device, args.seed, not args.no_progress)
    print(accuracy.format_accuracy_table(rows, "fp64"))
    if any(r["truth"] == "fp64_mx" for r in rows):
        print(accuracy.format_accuracy_table(rows, "fp64_mx"))
    files = [write_result("accuracy", rows, args.out, {"shape": str(shape)})]
    if not args.no_plot:
        from mxattn.bench.plots import plot_accuracy

        files.append(plot_accuracy(rows, args.out / "accuracy.png"))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _cmd_report(args) -> int:
    from mxattn.bench import report

    results = args.results or report.DEFAULT_RESULTS
    if args.readme is None:
        print(report.render_results(results))
        return 0
    changed = report.update_readme(args.readme, results, check=args.check)
    if args.check:
        print(f"{args.readme}: {'out of date: run mxattn report --readme ' + str(args.readme) if changed else 'up to date'}")
        return 1 if changed else 0
    print(f"{args.readme}: {'updated' if changed else 'already up to date'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"demo": _cmd_demo, "bench": _cmd_bench, "accuracy": _cmd_accuracy, "report": _cmd_report}
    return handler[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
