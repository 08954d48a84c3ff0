"""examples/train_gpt.py: the tiny preset of the BF16-vs-MXFP8 training-parity script, both runs in-process on CPU.

One module-scoped run (``--tiny --attention both``: 2 layers, width 128, 2 heads, seq 64, batch 2, 6 steps,
validation at steps 0, 3 and 6; SDPA in float32 against the mxattn reference path, which emulates MXFP8 forward and
backward), then checks on what it wrote.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"

RUN_KEYS = {"attention", "config", "device", "device_name", "torch", "triton", "git_commit", "train_loss",
            "val_steps", "val_loss", "mean_step_ms", "final_val_loss", "data_checksum", "init_checksum"}
SUMMARY_KEYS = {"config", "git_commit", "device_name", "torch", "triton", "runs", "final_val_loss",
                "rel_diff_final_val_loss", "step_time_ratio", "same_data_order", "same_init"}

# Tiny-mode bound on |val_mxfp8 - val_bf16| / val_bf16 after 6 steps.  Both runs start from the same weights and see
# the same batches, so they differ only by the MXFP8 rounding inside attention (e4m3: 3 mantissa bits, relative
# step 2^-3, so up to ~6% per element on Q, K, V, P, dO before the block scales) propagated through 6 AdamW steps.
# Measured: ~1e-4 (0.01%).  1% is ~100x that and still small next to the ~1.5 nats (~28%) the loss falls in the
# 6 steps, so it catches a run that diverges or trains on different data, not small numerical differences.
TINY_REL_BOUND = 0.01


def _load_script():
    spec = importlib.util.spec_from_file_location("train_gpt_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    mod = _load_script()
    out = tmp_path_factory.mktemp("train_gpt")
    summary = mod.main(["--tiny", "--attention", "both", "--out", str(out), "--no-progress"])
    return mod, out, summary


def test_outputs_exist_with_documented_keys(tiny_run):
    _, out, summary = tiny_run
    for name in ("loss-sdpa.json", "loss-mxfp8.json", "parity.json", "loss-curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "loss-curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parity = json.loads((out / "parity.json").read_text())
    assert SUMMARY_KEYS <= parity.keys()
    assert parity["final_val_loss"] == summary["final_val_loss"]
    assert set(parity["runs"]) == {"sdpa", "mxfp8"}
    for att in ("sdpa", "mxfp8"):
        run = json.loads((out / f"loss-{att}.json").read_text())
        assert RUN_KEYS <= run.keys()
        assert run["attention"] == att
        cfg = run["config"]
        assert (cfg["n_layers"], cfg["dim"], cfg["n_heads"], cfg["seq_len"], cfg["batch_size"], cfg["steps"]) == \
            (2, 128, 2, 64, 2, 6)
        assert len(run["train_loss"]) == cfg["steps"]
        assert run["val_steps"] == [0, 3, 6]
        assert len(run["val_loss"]) == 3
        assert run["final_val_loss"] == run["val_loss"][-1]
        assert run["mean_step_ms"] > 0
        assert parity["runs"][att]["final_val_loss"] == run["final_val_loss"]


def test_losses_finite_and_training_reduces_loss(tiny_run):
    _, out, _ = tiny_run
    for att in ("sdpa", "mxfp8"):
        run = json.loads((out / f"loss-{att}.json").read_text())
        losses = run["train_loss"] + run["val_loss"]
        assert all(math.isfinite(x) for x in losses), att
        # initial loss of a byte model with small random weights: ~ln 256 = 5.55
        assert abs(run["train_loss"][0] - math.log(256)) < 0.3, run["train_loss"][0]
        assert run["train_loss"][-1] < run["train_loss"][0] - 0.5, run["train_loss"]
        assert run["val_loss"][-1] < run["val_loss"][0] - 0.5, run["val_loss"]


def test_same_data_and_init_and_close_final_losses(tiny_run):
    _, out, summary = tiny_run
    a = json.loads((out / "loss-sdpa.json").read_text())
    b = json.loads((out / "loss-mxfp8.json").read_text())
    assert a["data_checksum"] == b["data_checksum"]
    assert a["init_checksum"] == b["init_checksum"]
    assert summary["same_data_order"] and summary["same_init"]
    rel = summary["rel_diff_final_val_loss"]
    assert rel == pytest.approx((b["final_val_loss"] - a["final_val_loss"]) / a["final_val_loss"])
    assert abs(rel) < TINY_REL_BOUND, rel
    # the runs really differ (MXFP8 rounding is in the loop), so the comparison is not trivially of one run
    assert a["train_loss"] != b["train_loss"]
    assert summary["step_time_ratio"] == pytest.approx(b["mean_step_ms"] / a["mean_step_ms"])


def test_validation_split_depends_only_on_the_path(tiny_run):
    mod, _, _ = tiny_run
    files = [rel for rel, _ in mod.stdlib_files()]
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any(part in f.split("/") for f in files for part in ("site-packages", "dist-packages"))
    val = {f for f in files if mod.is_validation(f)}
    assert 0 < len(val) < len(files) / 5
    # the tiny selection (first 120 files) puts exactly the validation-hashed files among them in validation
    small = mod.load_corpus(120)
    assert small["n_files"]["val"] == max(1, len(val & set(files[:120])))
    assert small["n_files"]["train"] + small["n_files"]["val"] == min(120, len(files))
    # cached: a second load returns the same tensors
    assert mod.load_corpus(120)["train"] is small["train"]


def test_reuse_loads_finished_runs_and_retrains_on_another_config(tiny_run, capsys):
    """``--reuse`` compares runs made by earlier processes: nothing is trained again when both are finished with
    the same config; a different config (here another seed) trains again."""
    mod, out, _ = tiny_run
    before = json.loads((out / "loss-mxfp8.json").read_text())
    summary = mod.main(["--tiny", "--attention", "both", "--reuse", "--no-progress", "--out", str(out)])
    assert capsys.readouterr().out.count("reusing the finished") == 2
    assert summary["final_val_loss"]["mxfp8"] == before["final_val_loss"]
    cfg = mod.Config(**{**json.loads((out / "loss-sdpa.json").read_text())["config"], "seed": 7})
    assert mod.finished_run(out, "sdpa", cfg) is None
