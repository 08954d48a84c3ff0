"""Training parity: a small byte-level GPT trained with BF16 attention (SDPA) and with MXFP8 attention (mxattn).

Both runs use the same seed, the same initial weights (checked by a checksum), the same batches in the same order
(checked by a checksum of every batch's bytes) and differ only in the attention inside the blocks
(``mxattn.nn.MXFP8TransformerBlock(attention="sdpa" | "mxfp8")``): MXFP8 forward and backward against
``F.scaled_dot_product_attention`` in BF16.

Corpus: the Python standard library's own source, available offline wherever Python is: every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` / ``dist-packages`` / ``__pycache__`` excluded, so installed
packages do not change it), sorted by relative path, bytes joined with a NUL separator, byte tokens (vocab 256).
A file goes to validation when ``md5(relative path) mod 20 == 0``: independent of ordering and of the other files.

Full run (one H200, a few minutes per run)::

    python examples/train_gpt.py --attention both --out runs/parity

or in two processes (a time-limited GPU machine), then the comparison::

    python examples/train_gpt.py --attention sdpa --out runs/parity
    python examples/train_gpt.py --attention mxfp8 --out runs/parity
    python examples/train_gpt.py --attention both --reuse --out runs/parity   # trains nothing when both are done

``--tiny`` is a CPU-sized preset (2 layers, width 128, 2 heads, seq 64, batch 2, 6 steps) used by
``tests/test_train_gpt.py``.  Outputs in ``--out``: ``loss-<attention>.json`` per run and, with
``--attention both``, ``parity.json`` (both runs, relative difference of the final validation losses, step-time
ratio) and ``loss-curves.png``.  See ``docs/training-parity.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mxattn.nn import MXFP8TransformerBlock

VOCAB = 256
SEPARATOR = b"\x00"  # never occurs in the stdlib's source
VAL_MOD = 20  # md5(path) % VAL_MOD == 0 -> validation
ATTENTIONS = ("sdpa", "mxfp8")
LABELS = {"sdpa": "BF16 (SDPA)", "mxfp8": "MXFP8 (mxattn)"}


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

_CORPUS_CACHE: dict = {}


def stdlib_files(root: Optional[str] = None) -> list[tuple[str, Path]]:
    """(relative posix path, absolute path) of every stdlib ``*.py`` file, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                out.append((p.relative_to(root).as_posix(), p))
    out.sort(key=lambda t: t[0])
    return out


def is_validation(relpath: str) -> bool:
    return int.from_bytes(hashlib.md5(relpath.encode()).digest()[:8], "little") % VAL_MOD == 0


def load_corpus(max_files: Optional[int] = None, root: Optional[str] = None) -> dict:
    """Train and validation byte tokens (uint8 CPU tensors), cached in memory per (root, max_files).

    ``max_files`` keeps the first N files in sorted order (tiny mode).  If no file of the selection hashes to
    validation, the last file is moved there so that a validation split always exists."""
    key = (root, max_files)
    if key in _CORPUS_CACHE:
        return _CORPUS_CACHE[key]
    files = stdlib_files(root)
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise RuntimeError(f"no *.py files found under {root or sysconfig.get_paths()['stdlib']}")
    val_flags = [is_validation(rel) for rel, _ in files]
    if not any(val_flags):
        val_flags[-1] = True
    if all(val_flags):
        raise RuntimeError("every selected file hashed to validation; select more files")
    parts = {False: [], True: []}
    for (rel, path), val in zip(files, val_flags):
        parts[val].append(path.read_bytes())
    corpus = {}
    for name, val in (("train", False), ("val", True)):
        data = SEPARATOR.join(parts[val]) + SEPARATOR
        corpus[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    corpus["n_files"] = {"train": len(parts[False]), "val": len(parts[True])}
    corpus["sha256"] = {n: hashlib.sha256(corpus[n].numpy().tobytes()).hexdigest()[:16] for n in ("train", "val")}
    corpus["root"] = str(root or sysconfig.get_paths()["stdlib"])
    _CORPUS_CACHE[key] = corpus
    return corpus


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


class GPT(nn.Module):
    """Token embedding -> ``n_layers`` ``MXFP8TransformerBlock`` (rotary positions, causal) -> RMSNorm -> LM head."""

    def __init__(self, n_layers: int, dim: int, n_heads: int, attention: str, tie_embeddings: bool = False,
                 vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            MXFP8TransformerBlock(dim, n_heads, attention=attention, activation="gelu", causal=True, rotary=True)
            for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 n_layers).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def set_attention(self, kind: str) -> None:
        for b in self.blocks:
            b.attention = kind

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def param_checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass
class Config:
    n_layers: int = 6
    dim: int = 768
    n_heads: int = 12
    seq_len: int = 2048
    batch_size: int = 8
    steps: int = 2000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    tie_embeddings: bool = False
    val_every: int = 100
    val_batches: int = 16
    timing_skip: int = 10  # first steps left out of the mean step time (compilation, autotuning, allocator)
    seed: int = 1234
    max_files: Optional[int] = None
    device: str = "auto"
    dtype: str = "auto"  # compute dtype of the blocks: bf16 autocast on CUDA, float32 on CPU
    compile: bool = False
    # torch.compile mode with --compile: "default", or "reduce-overhead" (CUDA graphs: no host launch cost, so the
    # step times compare the kernels' device time, which at S 2048 the eager host overhead hides)
    compile_mode: str = "default"


TINY = dict(n_layers=2, dim=128, n_heads=2, seq_len=64, batch_size=2, steps=6, lr=3e-3, warmup_steps=2,
            val_every=3, val_batches=2, timing_skip=1, max_files=120, device="cpu")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``min_lr_ratio * lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------


def git_commit() -> Optional[str]:
    if os.environ.get("MXATTN_COMMIT"):  # machines whose checkout has no (or a stale) .git
        return os.environ["MXATTN_COMMIT"].strip()
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"device": str(device), "device_name": name, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "git_commit": git_commit()}


def resolve_device(cfg: Config) -> tuple[torch.device, Optional[torch.dtype]]:
    """The device, and the autocast dtype (None: no autocast, float32 throughout)."""
    dev = cfg.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    dt = cfg.dtype
    if dt == "auto":
        dt = "bf16" if device.type == "cuda" else "fp32"
    if dt not in ("bf16", "fp32"):
        raise ValueError(f"--dtype must be auto, bf16 or fp32, got {dt!r}")
    return device, (torch.bfloat16 if dt == "bf16" else None)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def batch_offsets(n_tokens: int, cfg: Config) -> torch.Tensor:
    """(steps, batch) window starts into the training tokens, drawn once from the seed: the data order."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    hi = n_tokens - cfg.seq_len - 1
    if hi <= 0:
        raise RuntimeError(f"training corpus ({n_tokens} tokens) shorter than seq_len + 1")
    return torch.randint(0, hi, (cfg.steps, cfg.batch_size), generator=g)


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return tokens[idx]


def val_starts(n_tokens: int, cfg: Config) -> torch.Tensor:
    """Fixed validation windows, evenly spaced over the validation tokens (non-overlapping when they fit)."""
    n = cfg.val_batches * cfg.batch_size
    hi = n_tokens - cfg.seq_len - 1
    if hi <= 0:
        raise RuntimeError(f"validation corpus ({n_tokens} tokens) shorter than seq_len + 1")
    return torch.linspace(0, hi, n).long().view(cfg.val_batches, cfg.batch_size)


def _autocast(device: torch.device, dtype: Optional[torch.dtype]):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _loss(model, xy: torch.Tensor, device, amp) -> torch.Tensor:
    xy = xy.to(device, non_blocking=True).long()
    x, y = xy[:, :-1], xy[:, 1:]
    with _autocast(device, amp):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, starts: torch.Tensor, cfg: Config, device, amp) -> float:
    model.eval()
    total = 0.0
    for row in starts:
        total += _loss(model, windows(tokens, row, cfg.seq_len), device, amp).item()
    model.train()
    return total / len(starts)


def run_label(attention: str, amp: Optional[torch.dtype]) -> str:
    """Plot/print label: the SDPA baseline is BF16 under autocast, FP32 without (the CPU default)."""
    if attention == "sdpa" and amp is None:
        return "FP32 (SDPA)"
    return LABELS[attention]


def train_one(attention: str, cfg: Config, corpus: dict, out: Path, progress: bool = True) -> dict:
    device, amp = resolve_device(cfg)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.n_layers, cfg.dim, cfg.n_heads, attention, cfg.tie_embeddings).to(device)
    init_sum = param_checksum(model)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt_kw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        opt_kw["fused"] = True
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], **opt_kw)
    fwd = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model

    train_tok, val_tok = corpus["train"], corpus["val"]
    offsets = batch_offsets(len(train_tok), cfg)
    vstarts = val_starts(len(val_tok), cfg)
    data_hash = hashlib.sha256()
    train_loss, val_loss, val_steps, step_ms = [], [], [], []

    def validate(step: int) -> None:
        val_loss.append(evaluate(fwd, val_tok, vstarts, cfg, device, amp))
        val_steps.append(step)
        if not progress:  # a line per validation instead of the bar (logs of unattended runs)
            recent = step_ms[-cfg.val_every:]
            ms = f", mean step {sum(recent) / len(recent):.1f} ms" if recent else ""
            print(f"{attention}: step {step}/{cfg.steps}, val loss {val_loss[-1]:.4f}{ms}", flush=True)

    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency of mxattn; keep the script usable without it
        tqdm = None
    steps = range(cfg.steps)
    bar = tqdm(steps, desc=f"{attention:>5}", disable=not progress, dynamic_ncols=True) if tqdm else steps

    validate(0)
    model.train()
    for step in bar:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        xy = windows(train_tok, offsets[step], cfg.seq_len)
        data_hash.update(xy.numpy().tobytes())
        loss = _loss(fwd, xy, device, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        lv = loss.item()  # synchronizes
        dt_ms = (time.perf_counter() - t0) * 1e3
        if not math.isfinite(lv):
            raise FloatingPointError(f"{attention}: non-finite training loss {lv} at step {step}")
        train_loss.append(lv)
        step_ms.append(dt_ms)
        if tqdm and progress:
            bar.set_postfix(loss=f"{lv:.4f}", ms=f"{dt_ms:.1f}", gnorm=f"{float(gnorm):.2f}", lr=f"{lr:.2e}")
        if (step + 1) % cfg.val_every == 0 and step + 1 != cfg.steps:
            validate(step + 1)
    validate(cfg.steps)
    if tqdm and progress:
        bar.close()

    timed = step_ms[cfg.timing_skip:] if len(step_ms) > cfg.timing_skip else step_ms
    result = {
        "attention": attention,
        "label": run_label(attention, amp),
        "config": asdict(cfg),
        **environment(device),
        "autocast_dtype": str(amp).replace("torch.", "") if amp else "float32 (no autocast)",
        "n_params": n_params,
        "corpus": {k: corpus[k] for k in ("root", "n_files", "sha256")}
        | {"train_tokens": len(train_tok), "val_tokens": len(val_tok)},
        "init_checksum": init_sum,
        "data_checksum": data_hash.hexdigest()[:16],
        "train_loss": train_loss,
        "val_steps": val_steps,
        "val_loss": val_loss,
        "step_ms": step_ms,
        "mean_step_ms": sum(timed) / len(timed),
        "timing_skip": cfg.timing_skip,
        "tokens_per_s": cfg.batch_size * cfg.seq_len / (sum(timed) / len(timed) / 1e3),
        "final_val_loss": val_loss[-1],
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"loss-{attention}.json").write_text(json.dumps(result, indent=1))
    return result


def run_and_release(attention: str, cfg: Config, corpus: dict, out: Path, progress: bool) -> dict:
    """``train_one``, then give its model's memory back before the next run (so peak memory is per run)."""
    result = train_one(attention, cfg, corpus, out, progress)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def finished_run(out: Path, attention: str, cfg: Config) -> Optional[dict]:
    """The run recorded in ``out/loss-<attention>.json`` when it was made with this exact config (all fields,
    device and seed included) and reached its last step, else None.  ``--reuse`` uses it so that the two runs can
    happen in separate processes (e.g. two calls on a time-limited GPU machine) and still be compared."""
    path = out / f"loss-{attention}.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if r.get("config") != json.loads(json.dumps(asdict(cfg))) or len(r.get("train_loss", [])) != cfg.steps:
        print(f"{path}: made with another config or unfinished, training again", flush=True)
        return None
    print(f"{path}: reusing the finished {attention} run", flush=True)
    return r


def plot(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    both = "sdpa" in runs and "mxfp8" in runs
    fig, axes = plt.subplots(1, 3 if both else 2, figsize=(17 if both else 12, 4.5))
    ax1, ax2 = axes[0], axes[1]
    for att, r in runs.items():
        ax1.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], lw=0.8, alpha=0.85, label=r["label"])
        ax2.plot(r["val_steps"], r["val_loss"], marker="o", ms=3, label=r["label"])
    ax1.set(xlabel="step", ylabel="train loss (nats/byte)", title="training loss")
    ax2.set(xlabel="step", ylabel="validation loss (nats/byte)", title="validation loss")
    if both:  # the curves overlap at this scale: show MXFP8 - BF16
        a, b = runs["sdpa"], runs["mxfp8"]
        diff = [y - x for x, y in zip(a["train_loss"], b["train_loss"])]
        w = max(1, len(diff) // 50)
        smooth = [sum(diff[max(0, i - w + 1):i + 1]) / len(diff[max(0, i - w + 1):i + 1]) for i in range(len(diff))]
        ax3 = axes[2]
        ax3.plot(range(1, len(diff) + 1), smooth, lw=0.8, label=f"train (moving mean of {w})")
        ax3.plot(a["val_steps"], [y - x for x, y in zip(a["val_loss"], b["val_loss"])], marker="o", ms=3,
                 label="validation")
        ax3.axhline(0.0, color="k", lw=0.5)
        ax3.set(xlabel="step", ylabel="loss difference (nats/byte)", title=f"MXFP8 - {a['label'].split()[0]}")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    any_r = next(iter(runs.values()))
    c = any_r["config"]
    fig.suptitle(f"GPT {c['n_layers']}L d{c['dim']} h{c['n_heads']} S{c['seq_len']} B{c['batch_size']} on "
                 f"{any_r['device_name']} (commit {(any_r['git_commit'] or '?')[:7]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(runs: dict) -> dict:
    a, b = runs["sdpa"], runs["mxfp8"]
    return {
        "config": a["config"],
        **{k: a[k] for k in ("device", "device_name", "torch", "triton", "python", "git_commit", "n_params",
                             "corpus")},
        "runs": {att: {k: r[k] for k in ("label", "autocast_dtype", "init_checksum", "data_checksum", "train_loss",
                                          "val_steps", "val_loss", "mean_step_ms", "tokens_per_s",
                                          "final_val_loss", "peak_memory_gb")}
                 for att, r in runs.items()},
        "final_val_loss": {"sdpa": a["final_val_loss"], "mxfp8": b["final_val_loss"]},
        "rel_diff_final_val_loss": (b["final_val_loss"] - a["final_val_loss"]) / a["final_val_loss"],
        "step_time_ratio": b["mean_step_ms"] / a["mean_step_ms"],
        "same_data_order": a["data_checksum"] == b["data_checksum"],
        "same_init": a["init_checksum"] == b["init_checksum"],
    }


def parse_args(argv) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=ATTENTIONS + ("both",), default="both",
                   help="sdpa (BF16 baseline), mxfp8, or both back to back (default)")
    p.add_argument("--out", default="runs/train_gpt", help="output directory (default runs/train_gpt)")
    p.add_argument("--tiny", action="store_true", help="CPU-sized preset for tests (flags given still win)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--reuse", action="store_true",
                   help="load a finished run with the same config from --out instead of training it again")
    d = Config()
    for f in ("n_layers", "dim", "n_heads", "seq_len", "batch_size", "steps", "lr", "min_lr_ratio", "warmup_steps",
              "weight_decay", "grad_clip", "val_every", "val_batches", "timing_skip", "seed", "max_files"):
        default = getattr(d, f)
        typ = type(default) if default is not None else int
        p.add_argument("--" + f.replace("_", "-"), dest=f, type=typ, default=None,
                       help=f"default {default} ({TINY.get(f, default)} with --tiny)")
    p.add_argument("--device", default=None, help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default=None, choices=("auto", "bf16", "fp32"),
                   help="auto: bf16 autocast (fp32 master weights) on CUDA, fp32 on CPU")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--compile-mode", dest="compile_mode", default=None, choices=("default", "reduce-overhead"),
                   help="torch.compile mode with --compile (reduce-overhead: CUDA graphs)")
    args = p.parse_args(argv)
    values = asdict(d)
    if args.tiny:
        values.update(TINY)
    for f in values:
        v = getattr(args, f, None)
        if v is not None:
            values[f] = v
    return Config(**values), args


def main(argv=None) -> dict:
    cfg, args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.max_files)
    print(f"corpus: {corpus['n_files']['train']} train files ({len(corpus['train']) / 1e6:.2f} MB), "
          f"{corpus['n_files']['val']} validation files ({len(corpus['val']) / 1e6:.2f} MB) from {corpus['root']} "
          f"in {time.perf_counter() - t0:.2f} s", flush=True)
    kinds = ATTENTIONS if args.attention == "both" else (args.attention,)
    runs = {}
    for k in kinds:
        runs[k] = (finished_run(out, k, cfg) if args.reuse else None) or \
            run_and_release(k, cfg, corpus, out, progress=not args.no_progress)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "loss-curves.png")
    for k, r in runs.items():
        print(f"{r['label']}: final val loss {r['final_val_loss']:.4f}, mean step {r['mean_step_ms']:.1f} ms")
    if len(runs) < 2:
        return {"runs": runs}
    summary = compare(runs)
    (out / "parity.json").write_text(json.dumps(summary, indent=1))
    base = runs["sdpa"]["label"].split()[0]  # BF16 (FP32 on the CPU preset)
    print(f"final val loss: {base} {summary['final_val_loss']['sdpa']:.4f}, "
          f"MXFP8 {summary['final_val_loss']['mxfp8']:.4f}, "
          f"relative difference {summary['rel_diff_final_val_loss']:+.3%}, "
          f"step-time ratio MXFP8/{base} {summary['step_time_ratio']:.2f}x "
          f"(same data order: {summary['same_data_order']}, same init: {summary['same_init']})", flush=True)
    return summary


if __name__ == "__main__":
    main()
