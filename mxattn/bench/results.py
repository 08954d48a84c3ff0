"""Recorded results: one JSON file per benchmark run (DESIGN §6).

A file is named ``<what>-<gpu-slug>-<date>.json`` (``-2``, ``-3``... when that name is taken) and holds::

    {"what": "attn_fwd", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "<sha>",
     "date": "YYYY-MM-DD", "timestamp": "...", ..., "rows": [{...}, ...]}

``what`` is one of ``WHATS``.  Speed rows carry ``tflops`` per method, accuracy rows ``sqnr_db`` per
tensor.  Floats that are not finite are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so that
the files stay strict JSON and a NaN stays visible.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch

__all__ = ["WHATS", "env_info", "gpu_slug", "write_result", "load_results", "latest_by_what", "to_float"]

WHATS = (
    "attn_fwd",
    "attn_fwd_cuda_graph",
    "attn_bwd_cuda_graph",
    "attn_bwd",
    "attn_bwd_kernels",
    "attn_bwd_fused_dq",
    "profile_attn",
    "host_timing",
    "memory",
    "quantize",
    "quantize_sweep",
    "rmsnorm_quant",
    "rmsnorm_quant_sweep",
    "linear_quant",
    "varlen_fwd",
    "varlen_bwd",
    "accuracy",
    "train",
    "qkv_chain",
    "ring_attn",
    "blockscaled",
    "cost_probe",
    "eager_gap",
)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _git_commit() -> tuple[str, Optional[bool]]:
    """(sha, dirty) of the checkout mxattn runs from; ``MXATTN_COMMIT`` wins (machines without ``.git``)."""
    env = os.environ.get("MXATTN_COMMIT")
    if env:
        return env.strip(), None
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return sha or "unknown", bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def _triton_version() -> Optional[str]:
    try:
        import triton
    except Exception:  # not installed, or broken on this platform
        return None
    return getattr(triton, "__version__", None)


def env_info(device: Union[str, torch.device, None] = None) -> dict:
    """Where a result was measured: GPU name (or ``"cpu"``), versions, git commit, date.

    ``device`` defaults to the current CUDA device when there is one, else the CPU.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    now = _dt.datetime.now(_dt.timezone.utc)
    sha, dirty = _git_commit()
    info = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "python": platform.python_version(),
        "commit": sha,
        "dirty": dirty,
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
    }
    if device.type == "cpu":
        info["cpu"] = platform.processor() or platform.machine()
    # build switches read at import that change what the kernels compute or how fast (recorded when set)
    knobs = {k: v for k, v in os.environ.items() if k in _RECORDED_KNOBS}
    if knobs:
        info["knobs"] = knobs
    return info


_RECORDED_KNOBS = ("MXATTN_EXP2_FMA", "MXATTN_FWD_PERSISTENT", "MXATTN_FWD_MASK", "MXATTN_BWD_OUT_ROWS",
                   "MXATTN_FWD_PROBE",
                   "MXATTN_DKDV_PROBE", "MXATTN_DQ_PROBE",
                   "MXATTN_BWD_FUSED_DQ", "MXATTN_BWD_PERSISTENT", "MXATTN_BWD_KERNEL", "MXATTN_LINEAR_KERNEL")


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _strict(x: Any) -> Any:
    """Make ``x`` strict-JSON: non-finite floats become strings, tuples lists, tensors numbers."""
    if isinstance(x, dict):
        return {str(k): _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _strict(x.item() if x.numel() == 1 else x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def to_float(x: Any) -> Optional[float]:
    """A number read back from a result file (``"nan"``/``"inf"`` strings included); None stays None."""
    if x is None:
        return None
    return float(x)


def write_result(
    what: str,
    rows: Iterable[dict],
    outdir: Union[str, Path],
    extra: Optional[dict] = None,
    env: Optional[dict] = None,
) -> Path:
    """Write one run's rows to ``outdir/<what>-<gpu-slug>-<date>.json`` and return the path.

    ``env`` defaults to ``env_info()``; ``extra`` adds top-level keys (settings of the run, notes).
    An existing file is never overwritten: the name gets ``-2``, ``-3``...
    """
    if what not in WHATS:
        raise ValueError(f"what must be one of {WHATS}, got {what!r}")
    env = dict(env_info() if env is None else env)
    doc = {"what": what, **env, **(extra or {}), "rows": list(rows)}
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = f"{what}-{gpu_slug(str(doc['gpu']))}-{doc['date']}"
    path = outdir / f"{stem}.json"
    n = 2
    while path.exists():
        path = outdir / f"{stem}-{n}.json"
        n += 1
    text = json.dumps(_strict(doc), indent=1, allow_nan=False)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
    return path


def load_results(directory: Union[str, Path], what: Optional[str] = None) -> list[dict]:
    """All result files in ``directory`` (optionally of one ``what``), oldest first.

    Each dict gets ``"_path"``.  Files that are not valid JSON or have no ``what``/``rows`` are skipped
    with a warning on stderr, so that one bad file does not hide the rest.
    """
    import sys

    out = []
    for p in sorted(Path(directory).glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            print(f"mxattn: skipping {p}: {e}", file=sys.stderr)
            continue
        if not isinstance(doc, dict) or "what" not in doc or not isinstance(doc.get("rows"), list):
            print(f"mxattn: skipping {p}: not a result file (needs 'what' and 'rows')", file=sys.stderr)
            continue
        if what is not None and doc["what"] != what:
            continue
        doc["_path"] = str(p)
        out.append(doc)
    out.sort(key=_age)
    return out


def _age(doc: dict) -> tuple:
    """Sort key, oldest first: date, timestamp, then the ``-N`` that ``write_result`` adds to a taken name."""
    m = re.search(r"\d{4}-\d{2}-\d{2}(?:-(\d+))?\.json$", doc["_path"])
    n = int(m.group(1)) if m and m.group(1) else 1
    return str(doc.get("date", "")), str(doc.get("timestamp", "")), n, doc["_path"]


def latest_by_what(docs: Iterable[dict]) -> dict[tuple[str, str], dict]:
    """The newest document for each (what, gpu) among ``docs`` (as sorted by ``load_results``)."""
    latest: dict[tuple[str, str], dict] = {}
    for d in docs:
        latest[(d["what"], str(d.get("gpu", "?")))] = d
    return latest
