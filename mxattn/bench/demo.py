"""``mxattn demo``: MXFP8 attention end to end on whatever machine this is.

Makes BF16 inputs, quantizes them to MXFP8 (q, k along the head dim, v along the sequence), runs attention
forward and backward, and prints SQNR (dB) and cosine against an fp64 truth for out, dQ, dK, dV: MXFP8 next to
BF16 and per-tensor FP8.  On a CUDA machine the MXFP8 row is the GPU kernel (``mxfp8_attn_func``) and the demo
adds its speed against ``F.scaled_dot_product_attention`` (cuDNN and flash backends); on the CPU it runs the
reference (``mxattn.reference``), which defines what the kernels compute, and says so.
Writes JSON (``mxattn.bench.results``) and PNG files under the output folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from mxattn.bench import accuracy, speed
from mxattn.bench.accuracy import AccShape
from mxattn.bench.results import write_result

__all__ = ["run_demo", "demo_speed_shapes"]

DEMO_TENSORS = ("out", "dq", "dk", "dv")
LABELS = {
    "mxfp8_kernel": "MXFP8 (GPU kernel)",
    "mxfp8_ref": "MXFP8 (reference emul.)",
    "fp8_per_tensor": "FP8 per-tensor (emul.)",
    "bf16": "BF16 (torch SDPA)",
}


def demo_speed_shapes(quick: bool) -> list[speed.Shape]:
    """B2 H16 S4096 d128, non-causal (and causal unless quick)."""
    return speed.grid_shapes(2, 16, None, (128,), (4096,), (False,) if quick else (False, True))


def _print_quantization(shape: AccShape, device: str, seed: int) -> None:
    """Show what the MXFP8 operands are: shapes, scale layout and round-trip error of each."""
    from mxattn.formats import quantize_mxfp8
    from mxattn.reference import sqnr_db

    x = accuracy.make_inputs("gaussian", shape, seed, device)
    print(f"inputs: q, k, v, dO of shape (B, S, H, D) = {tuple(x.q.shape)}, bf16 values")
    for name, t, dim, orient in (("q", x.q, 3, "head dim"), ("k", x.k, 3, "head dim"), ("v", x.v, 1, "sequence")):
        m = quantize_mxfp8(t, dim=dim)
        print(
            f"  {name}: MXFP8 along the {orient:<9} data {str(m.data.dtype):<20} scale {tuple(m.scale.shape)} "
            f"{m.scale.dtype}; round trip {sqnr_db(m.dequantize(torch.float64), t):.1f} dB"
        )


def _table(rows: list[dict]) -> str:
    head = "".join(f"{t + ' dB':>9}" for t in DEMO_TENSORS) + "".join(f"{t + ' cos':>10}" for t in DEMO_TENSORS)
    lines = []
    for family in dict.fromkeys(r["family"] for r in rows):
        lines.append(f"{family} inputs, against fp64 attention on the same inputs")
        lines.append(f"  {'method':<22}{head}")
        for r in rows:
            if r["family"] != family or r["truth"] != "fp64":
                continue
            db = "".join(f"{accuracy.fmt_metric(r['sqnr_db'].get(t), 'sqnr_db'):>9}" for t in DEMO_TENSORS)
            cos = "".join(f"{accuracy.fmt_metric(r['cosine'].get(t), 'cosine'):>10}" for t in DEMO_TENSORS)
            lines.append(f"  {LABELS.get(r['method'], r['method']):<22}{db}{cos}")
            if r.get("error"):
                lines.append(f"    ({r['error'][:100]})")
    return "\n".join(lines)


def run_demo(
    out: str | Path = "out",
    quick: bool = False,
    device: Optional[str] = None,
    shape: Optional[AccShape] = None,
    seed: int = 0,
    speed_shapes: Optional[list] = None,
    progress: bool = True,
    plot: bool = True,
) -> dict:
    """Run the demo; returns {"accuracy": rows, "attn_fwd": rows, "attn_bwd": rows, "files": [paths]}."""
    from mxattn.bench.plots import plot_accuracy, plot_speed

    t_start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    shape = shape or accuracy.default_shape(device, quick)
    families = ["gaussian"] if quick else ["gaussian", "outlier_channels"]
    if device == "cuda":
        print(f"mxattn demo on {torch.cuda.get_device_name()}: the MXFP8 GPU kernel against fp64, BF16 and FP8")
    else:
        print(
            "mxattn demo on the CPU: no CUDA GPU here, so this runs the CPU reference of MXFP8 attention\n"
            "(mxattn.reference: the exact semantics the GPU kernels are tested against). It shows accuracy;\n"
            "speed needs a GPU (see README: 'On a GPU machine')."
        )
    print(f"shape {shape}, families: {', '.join(families)}")
    _print_quantization(shape, device, seed)

    res: dict = {"files": []}
    rows = accuracy.run_accuracy(families, accuracy.default_methods(device), shape, device, seed, progress)
    print()
    print(_table(rows))
    extra = {"source": "mxattn demo", "shape": str(shape)}
    res["accuracy"] = rows
    res["files"].append(write_result("accuracy", rows, out, extra))
    if plot:
        res["files"].append(plot_accuracy(rows, out / "demo-accuracy.png", tensors=DEMO_TENSORS))

    if device == "cuda":
        from mxattn.interface import has_fast_backward

        bwd = has_fast_backward(torch.device(device))
        print(f"\nspeed against F.scaled_dot_product_attention (BF16){'' if bwd else ', forward only (no fast backward kernel yet)'}")
        methods = [m for m in ("mxattn", "sdpa_cudnn_bf16", "sdpa_flash_bf16") if speed.METHODS[m].available() is None]
        fwd_rows, bwd_rows = speed.run_speed(
            speed_shapes or demo_speed_shapes(quick), methods, device, backward=True, seed=seed, progress=progress
        )
        print(speed.format_speed_table(fwd_rows, "forward"))
        for r in fwd_rows:
            if r["ratio_vs_sdpa_cudnn_bf16"] is not None:
                print(f"  mxattn / SDPA cuDNN BF16 ({'causal' if r['causal'] else 'non-causal'}): "
                      f"{r['ratio_vs_sdpa_cudnn_bf16']:.2f}x")
        print(speed.format_speed_table(bwd_rows, "backward"))
        res["attn_fwd"], res["attn_bwd"] = fwd_rows, bwd_rows
        res["files"].append(write_result("attn_fwd", fwd_rows, out, extra))
        res["files"].append(write_result("attn_bwd", bwd_rows, out, extra))
        if plot:
            res["files"].extend(plot_speed(fwd_rows, bwd_rows, out / "demo-speed", "mxattn demo"))

    print(f"\nwrote {', '.join(str(p) for p in res['files'])}")
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return res
