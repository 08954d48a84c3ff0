"""PNG plots of benchmark rows (matplotlib, Agg backend: no screen needed).

``plot_speed``: TFLOP/s against sequence length, one line per method; panels forward / backward (rows) by
non-causal / causal (columns); one figure per (B, Hq, Hkv, D).
``plot_accuracy``: SQNR (dB) bars per input family and method, one panel per tensor.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence, Union

from mxattn.bench.results import to_float

__all__ = ["plot_speed", "plot_accuracy"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: Sequence[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """method -> (seqlens, values) over rows sorted by Sk, skipping missing values."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["Sk"]):
        for m, v in r.get(key, {}).items():
            xs, ys = out.setdefault(m, ([], []))
            if v is not None:
                xs.append(r["Sk"])
                ys.append(to_float(v))
    return out


def plot_speed(
    fwd_rows: Sequence[dict],
    bwd_rows: Sequence[dict],
    out_stem: Union[str, Path],
    title: str = "",
) -> list[Path]:
    """One PNG per (B, Hq, Hkv, D) group, named ``<out_stem>-b<B>-h<Hq>[-kv<Hkv>]-d<D>.png``; returns the paths.

    The backward row of panels uses ``tflops`` of ``bwd_rows`` (forward+backward as dashed lines when present).
    """
    plt = _pyplot()
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: {"fwd": [], "bwd": []})
    for kind, rows in (("fwd", fwd_rows), ("bwd", bwd_rows)):
        for r in rows:
            groups[(r["B"], r["Hq"], r["Hkv"], r["D"])][kind].append(r)
    paths = []
    out_stem = Path(out_stem)
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    for (B, Hq, Hkv, D), kinds in sorted(groups.items()):
        has_bwd = any(v is not None for r in kinds["bwd"] for v in r.get("tflops", {}).values())
        nrows = 2 if has_bwd else 1
        fig, axes = plt.subplots(nrows, 2, figsize=(11, 4 * nrows), squeeze=False, sharex=True)
        panels = [("forward", kinds["fwd"], "tflops")] + ([("backward", kinds["bwd"], "tflops")] if has_bwd else [])
        for i, (name, rows, key) in enumerate(panels):
            for j, causal in enumerate((False, True)):
                ax = axes[i][j]
                sel = [r for r in rows if bool(r["causal"]) == causal]
                for m, (xs, ys) in sorted(_series(sel, key).items()):
                    if xs:
                        line, = ax.plot(xs, ys, marker="o", label=m)
                        if name == "backward":
                            fx, fy = _series(sel, "tflops_fwd_bwd").get(m, ([], []))
                            if fx:
                                ax.plot(fx, fy, marker="x", ls="--", color=line.get_color(), label=f"{m} fwd+bwd")
                ax.set_title(f"{name}, {'causal' if causal else 'non-causal'}")
                ax.set_xscale("log", base=2)
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=7)
                if i == nrows - 1:
                    ax.set_xlabel("sequence length")
        kv = f" Hkv{Hkv}" if Hkv != Hq else ""
        fig.suptitle(f"{title} B{B} H{Hq}{kv} d{D}".strip())
        fig.tight_layout()
        path = out_stem.parent / f"{out_stem.name}-b{B}-h{Hq}{f'-kv{Hkv}' if Hkv != Hq else ''}-d{D}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_accuracy(
    rows: Sequence[dict],
    path: Union[str, Path],
    truth: str = "fp64",
    tensors: Optional[Sequence[str]] = None,
    title: str = "",
) -> Path:
    """Bar chart of ``sqnr_db`` against ``truth``: one panel per tensor, families on x, one bar per method."""
    plt = _pyplot()
    import numpy as np

    sel = [r for r in rows if r.get("truth") == truth]
    families = list(dict.fromkeys(r["family"] for r in sel))
    methods = list(dict.fromkeys(r["method"] for r in sel))
    if tensors is None:
        tensors = [t for t in ("out", "lse", "dq", "dk", "dv")
                   if any(r["sqnr_db"].get(t) is not None for r in sel)]
    tensors = list(tensors) or ["out"]
    fig, axes = plt.subplots(1, len(tensors), figsize=(3.2 * len(tensors) + 1.5, 4), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    x = np.arange(len(families))
    for ax, t in zip(axes[0], tensors):
        for i, m in enumerate(methods):
            vals = []
            for f in families:
                v = next((r["sqnr_db"].get(t) for r in sel if r["family"] == f and r["method"] == m), None)
                vals.append(np.nan if v is None else to_float(v))
            ax.bar(x + (i - (len(methods) - 1) / 2) * width, vals, width, label=m)
        ax.set_title(t)
        ax.set_xticks(x)
        ax.set_xticklabels(families, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"SQNR vs {truth} (dB)")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(len(methods), 1), fontsize=8, frameon=False)
    fig.suptitle(title or f"accuracy: SQNR against {truth} (higher is better)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
