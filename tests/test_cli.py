"""The measuring instrument: `mxattn` CLI, results files, accuracy and speed harness, plots, README report.

CPU tests run the reference on tiny shapes; the GPU test (marker ``gpu``) runs the demo with the kernel and SDPA.
"""

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mxattn.bench import accuracy, report, results, speed
from mxattn.bench.accuracy import AccShape

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "mxattn", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_demo_quick_cpu_writes_json_and_png(tmp_path):
    proc = _run_cli("demo", "--quick", "--device", "cpu", "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU reference" in proc.stdout
    files = list(tmp_path.glob("accuracy-cpu-*.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    doc = json.loads(files[0].read_text())
    assert doc["what"] == "accuracy" and doc["gpu"] == "cpu"
    for key in ("torch", "commit", "date", "triton"):
        assert key in doc
    methods = {r["method"] for r in doc["rows"] if r["truth"] == "fp64"}
    assert methods == {"mxfp8_ref", "fp8_per_tensor", "bf16"}
    for r in doc["rows"]:
        assert "error" not in r, r
        for t in ("out", "dq", "dk", "dv"):
            assert _finite(r["sqnr_db"][t]), (r["method"], t, r["sqnr_db"][t])
            assert _finite(r["cosine"][t])
    assert (tmp_path / "demo-accuracy.png").read_bytes().startswith(PNG_MAGIC)


def test_python_m_mxattn_help():
    proc = _run_cli("--help", timeout=60)
    assert proc.returncode == 0
    for cmd in ("demo", "bench", "accuracy", "report"):
        assert cmd in proc.stdout


def test_accuracy_tiny_shape_orders_methods(seed):
    rows = accuracy.run_accuracy(shape=AccShape(1, 1, 64, 64), device="cpu", seed=seed, progress=False)
    got = {(r["family"], r["method"], r["truth"]): r for r in rows}
    assert {f for f, _, _ in got} == set(accuracy.FAMILIES)
    for family in accuracy.FAMILIES:
        mx, mx_deq = got[(family, "mxfp8_ref", "fp64")], got[(family, "mxfp8_ref", "fp64_mx")]
        bf16 = got[(family, "bf16", "fp64")]
        for t in ("out", "dq", "dk", "dv"):
            assert _finite(mx["sqnr_db"][t]) and _finite(bf16["sqnr_db"][t])
            # BF16 keeps ~8 bits, e4m3 ~4: BF16 is far closer to the truth (DESIGN §2: 47 vs 23 dB)
            assert bf16["sqnr_db"][t] > mx["sqnr_db"][t] + 10, (family, t)
        # against the MX-dequantized inputs only the P/dS/dO steps remain: closer than against the raw inputs
        assert mx_deq["sqnr_db"]["out"] > mx["sqnr_db"]["out"], family
        assert bf16["sqnr_db"]["lse"] is None
    g = got[("gaussian", "mxfp8_ref", "fp64")]["sqnr_db"]
    assert 18 < g["out"] < 35, g  # DESIGN §2 measured 23.1 dB at S=2048, d=128
    assert all(r["seconds"] >= 0 for r in rows)


def test_accuracy_families_shapes_and_bf16_exact():
    shape = AccShape(2, 4, 64, 64)
    for family in accuracy.FAMILIES:
        x = accuracy.make_inputs(family, shape, seed=1)
        assert x.q.dtype == torch.float64
        for t in (x.q, x.k, x.v, x.dout):
            assert torch.equal(t, t.to(torch.bfloat16).to(torch.float64)), family
            assert torch.isfinite(t).all()
    assert accuracy.make_inputs("long_causal", shape).shape == AccShape(1, 1, 256, 64, True)
    sink = accuracy.make_inputs("attention_sink", shape)
    logits = torch.einsum("bshd,bthd->bhst", sink.q, sink.k) / math.sqrt(64)
    assert (logits.argmax(-1) == 0).float().mean() > 0.9  # key 0 wins nearly every row
    with pytest.raises(ValueError, match="unknown family"):
        accuracy.make_inputs("uniform", shape)


def test_per_tensor_fp8_roundtrip():
    x = torch.tensor([0.0, 1.0, -3.0, 448.0 * 2, 1e-3], dtype=torch.float64)
    y = accuracy.quantize_per_tensor_fp8(x)
    assert y[3] == x[3] and y[0] == 0  # amax maps to 448 exactly
    assert torch.allclose(y, x, rtol=2**-4, atol=896 * 2**-9 / 448)
    assert accuracy.quantize_per_tensor_fp8(torch.zeros(4)).eq(0).all()


def test_results_roundtrip(tmp_path):
    rows = [{"B": 1, "tflops": {"a": 1.5, "b": None, "c": float("nan")}, "x": (1, 2)}]
    env = results.env_info("cpu")
    assert env["gpu"] == "cpu" and env["torch"] == torch.__version__
    assert len(env["date"]) == 10 and env["commit"]
    p1 = results.write_result("attn_fwd", rows, tmp_path, extra={"note": "t"})
    p2 = results.write_result("attn_fwd", rows, tmp_path)
    assert p1.name == f"attn_fwd-cpu-{env['date']}.json"
    assert p2.name == f"attn_fwd-cpu-{env['date']}-2.json"  # never overwritten
    json.loads(p1.read_text())  # strict JSON: NaN is written as a string
    docs = results.load_results(tmp_path)
    assert [d["_path"] for d in docs] == [str(p1), str(p2)]
    d = docs[0]
    assert d["what"] == "attn_fwd" and d["note"] == "t" and d["gpu"] == "cpu"
    assert d["rows"][0]["tflops"] == {"a": 1.5, "b": None, "c": "nan"}
    assert math.isnan(results.to_float(d["rows"][0]["tflops"]["c"]))
    assert d["rows"][0]["x"] == [1, 2]
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    assert len(results.load_results(tmp_path)) == 2
    assert results.load_results(tmp_path, what="accuracy") == []
    assert list(results.latest_by_what(docs)) == [("attn_fwd", "cpu")]
    assert results.latest_by_what(docs)[("attn_fwd", "cpu")]["_path"] == str(p2)
    with pytest.raises(ValueError, match="what must be one of"):
        results.write_result("speed", rows, tmp_path)
    assert results.gpu_slug("NVIDIA H200") == "nvidia-h200"


def test_results_commit_override(monkeypatch):
    monkeypatch.setenv("MXATTN_COMMIT", "abc123")
    assert results.env_info("cpu")["commit"] == "abc123"


def _speed_rows():
    fwd, bwd = [], []
    for causal in (False, True):
        for s in (1024, 2048, 4096):
            shape = speed.Shape(2, 16, 16, s, s, 128, causal)
            fwd.append({**shape.as_row(), "tflops": {"mxattn": 600.0, "sdpa_cudnn_bf16": 580.0 + s / 1024},
                        "ratio_vs_sdpa_cudnn_bf16": 1.03})
            bwd.append({**shape.as_row(), "tflops": {"mxattn": None, "sdpa_cudnn_bf16": 500.0},
                        "tflops_fwd_bwd": {"mxattn": None, "sdpa_cudnn_bf16": 520.0}, "ratio_vs_sdpa_cudnn_bf16": None})
    return fwd, bwd


def test_plots_write_png(tmp_path):
    from mxattn.bench.plots import plot_accuracy, plot_speed

    fwd, bwd = _speed_rows()
    paths = plot_speed(fwd, bwd, tmp_path / "speed")
    assert [p.name for p in paths] == ["speed-b2-h16-d128.png"]
    assert paths[0].read_bytes().startswith(PNG_MAGIC)
    rows = [{"family": f, "method": m, "truth": "fp64", "sqnr_db": {"out": 20.0, "dq": None, "lse": "nan"}}
            for f in ("gaussian", "outlier_channels") for m in ("mxfp8_ref", "bf16")]
    p = plot_accuracy(rows, tmp_path / "acc.png")
    assert p.read_bytes().startswith(PNG_MAGIC)


def test_speed_shapes_and_flops():
    s = speed.Shape(2, 16, 16, 8192, 8192, 128, False)
    assert s.fwd_flops() == 4 * 2 * 16 * 8192 * 8192 * 128
    assert speed.Shape(2, 16, 16, 8192, 8192, 128, True).fwd_flops() == s.fwd_flops() / 2
    assert s.bwd_flops() == 2.5 * s.fwd_flops()
    grid = speed.default_shapes()
    assert len(grid) == 2 * 2 * 5 + 2
    assert speed.Shape(2, 64, 8, 8192, 8192, 128, False) in grid
    assert {x.D for x in grid} == {64, 128}
    assert speed.n_copies(2**40, torch.device("cpu")) == 1
    assert speed.n_copies(2**20, torch.device("cpu")) > 1


def test_speed_cpu_records_failures_and_continues(monkeypatch):
    def boom(q, k, v, causal, gqa):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(speed.METHODS, "boom", speed.Method("boom", boom, ("cpu",), "fails"))
    shapes = [speed.Shape(1, 2, 1, 64, 64, 64, True)]  # GQA: sdpa_bf16 runs with enable_gqa
    fwd, bwd = speed.run_speed(shapes, ["boom", "sdpa_bf16", "mxattn"], "cpu", seed=0, progress=False)
    f, b = fwd[0], bwd[0]
    assert f["tflops"]["boom"] is None and "no kernel" in f["errors"]["boom"]
    assert f["tflops"]["sdpa_bf16"] > 0 and b["tflops"]["sdpa_bf16"] > 0 and b["tflops_fwd_bwd"]["sdpa_bf16"] > 0
    assert f["tflops"]["mxattn"] > 0  # the CPU reference behind mxfp8_attn_func
    assert b["tflops"]["mxattn"] is None and "backward" in b["errors"]["mxattn"]  # no fast backward: not timed
    assert f["ratio_vs_sdpa_cudnn_bf16"] is None  # no cuDNN on the CPU
    assert "sdpa_cudnn_bf16" not in f["tflops"]
    json.dumps(fwd + bwd)


def test_cli_bench_cpu(tmp_path):
    from mxattn.cli import main

    rc = main(["bench", "--device", "cpu", "--batch", "1", "--heads", "1", "--head-dims", "64", "--seqlens", "64",
               "--causal", "no", "--methods", "sdpa_bf16", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    fwd = results.load_results(tmp_path, "attn_fwd")
    assert len(fwd) == 1 and fwd[0]["rows"][0]["Sq"] == 64 and fwd[0]["methods"] == ["sdpa_bf16"]
    assert len(results.load_results(tmp_path, "attn_bwd")) == 1
    assert list(tmp_path.glob("attn-speed-*.png"))


def test_cli_parsers():
    from mxattn.cli import _causal, _ints, build_parser

    assert _ints("1k,2K,4096") == [1024, 2048, 4096]
    assert _causal("both") == (False, True) and _causal("yes") == (True,)
    args = build_parser().parse_args(["accuracy", "--families", "gaussian,attention_sink"])
    assert args.families == ["gaussian", "attention_sink"] and args.out == Path("out")


def test_quantize_hook(monkeypatch):
    fake = types.ModuleType("mxattn.bench.quantize_bench")
    fake.run_quantize_bench = lambda quick=False: {"rows": [{"quick": quick}]}  # takes no device: none passed
    monkeypatch.setitem(sys.modules, "mxattn.bench.quantize_bench", fake)
    assert speed.run_quantize_hook("cuda", True) == [{"quick": True}]
    monkeypatch.setitem(sys.modules, "mxattn.bench.quantize_bench", None)  # not importable
    assert speed.run_quantize_hook("cuda", True) is None


def test_report_renders_and_updates_readme(tmp_path):
    assert report.render_results(tmp_path / "none") == report.EMPTY
    fwd, bwd = _speed_rows()
    env = {**results.env_info("cpu"), "gpu": "NVIDIA H200", "commit": "0123456789abcdef"}
    results.write_result("attn_fwd", fwd, tmp_path, env=env)
    results.write_result("attn_bwd", bwd, tmp_path, env=env)
    results.write_result("quantize", [{"op": "q", "gbps": 3000.25, "shape": [1, 2]}], tmp_path, env=env)
    acc = [{"family": "gaussian", "method": "mxfp8_ref", "truth": "fp64", "B": 1, "H": 1, "S": 64, "D": 64,
            "causal": False, "sqnr_db": {"out": 25.04, "dq": 23.0}}]
    results.write_result("accuracy", acc, tmp_path, env=env)
    text = report.render_results(tmp_path)
    assert "Attention forward, TFLOP/s — NVIDIA H200" in text and "`0123456789`" in text
    assert "| B2 H16 S1024 d128 | 600.0 | 581.0 | 1.03× |" in text
    assert "| gaussian | mxfp8_ref | 25.0 | 23.0 |" in text
    assert "3000.25" in text
    assert text.index("forward") < text.index("backward") < text.index("Accuracy") < text.index("quantize")
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\ntail\n")
    assert report.update_readme(readme, tmp_path, check=True)
    assert report.update_readme(readme, tmp_path)
    assert not report.update_readme(readme, tmp_path, check=True)
    assert readme.read_text().endswith("tail\n") and "600.0" in readme.read_text()


def test_readme_results_section_is_generated():
    """README's results come from benchmarks/results/*.json: regenerate with `python -m mxattn report --readme README.md`."""
    stale = report.update_readme(ROOT / "README.md", ROOT / "benchmarks" / "results", check=True)
    assert not stale, "README.md's results section is stale: run `python -m mxattn report --readme README.md`"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_gpu(tmp_path):
    from mxattn.bench.demo import run_demo

    res = run_demo(tmp_path, quick=True, device="cuda", shape=AccShape(1, 2, 512, 128),
                   speed_shapes=[speed.Shape(1, 4, 4, 1024, 1024, 128, False)], progress=False)
    rows = {(r["family"], r["method"], r["truth"]): r for r in res["accuracy"]}
    kernel, emu = rows[("gaussian", "mxfp8_kernel", "fp64_mx")], rows[("gaussian", "mxfp8_ref", "fp64_mx")]
    assert _finite(kernel["sqnr_db"]["out"])
    # DESIGN §2's rule is 0.5 dB (the kernel's own tests hold it); here one seed, so a looser 1 dB
    assert kernel["sqnr_db"]["out"] >= emu["sqnr_db"]["out"] - 1.0
    fwd = res["attn_fwd"][0]
    assert fwd["tflops"]["mxattn"] and fwd["tflops"]["sdpa_cudnn_bf16"]
    assert any(p.name.startswith("attn_fwd-") for p in res["files"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["mxattn", "sdpa_cudnn_bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graphed_backward_replays_the_eager_gradients(method, causal):
    """``bench --cuda-graph`` times the backward as replays of a captured ``autograd.grad``: each replay must
    compute what the eager backward computes (not nothing, not stale buffers), on every input copy."""
    shape = speed.Shape(1, 4, 4, 1000, 1000, 128, causal)
    x = speed._make_inputs(shape, torch.device("cuda"), int(torch.randint(0, 2**31 - 1, ()).item()))
    attn = speed.METHODS[method].attn
    replay = speed.cuda_graphed_backward(attn, x, causal, False, torch.device("cuda"))
    for i in reversed(range(len(x.q))):
        leaves = [t.detach().requires_grad_(True) for t in (x.q[i], x.k[i], x.v[i])]
        want = torch.autograd.grad(attn(*leaves, causal, False), leaves, x.dout[i])
        got = [g.clone() for g in replay(i)]
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            # the same kernels on the same inputs (the dQ atomics' order aside): equal to bf16 rounding
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


def test_every_result_kind_written_by_the_code_is_accepted(tmp_path):
    """The ``what`` names the benchmarks write (``bench --cuda-graph``, the qkv chain, the ring) are in WHATS, so a
    GPU run cannot end in a ValueError after its timing is done."""
    from mxattn.bench.results import WHATS, write_result

    for what in ("attn_fwd_cuda_graph", "attn_bwd_cuda_graph", "qkv_chain", "ring_attn", "varlen_bwd"):
        assert what in WHATS
        assert write_result(what, [{"x": 1}], tmp_path).exists()


def test_kernel_table_sorts_and_divides_by_calls():
    """``bench.profiling.kernel_table`` (profile_attn, the ring benchmark's --profile): per-call device time and
    launch counts, slowest first, events without device time left out, names cut at 90 characters."""
    from types import SimpleNamespace

    from mxattn.bench.profiling import kernel_table

    events = [SimpleNamespace(key="a" * 100, self_device_time_total=30.0, count=4),
              SimpleNamespace(key="cpu_op", self_device_time_total=0.0, count=9),
              SimpleNamespace(key="b", self_device_time_total=90.0, count=2)]
    rows = kernel_table(SimpleNamespace(key_averages=lambda: events), calls=2)
    assert [r["kernel"] for r in rows] == ["b", "a" * 90]
    assert rows[0]["us_per_call"] == 45.0 and rows[0]["launches_per_call"] == 1.0
    assert rows[1]["us_per_call"] == 15.0 and rows[1]["launches_per_call"] == 2.0
