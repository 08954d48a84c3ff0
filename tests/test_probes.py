"""The cost-split probe builds (timing only) are off unless asked for, and a bad value is refused at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBES = [
    ("MXATTN_FWD_PROBE", "mxattn.kernels.attn_fwd_gluon", "FWD_PROBE", "9"),
    ("MXATTN_DKDV_PROBE", "mxattn.kernels.attn_bwd_dkdv_gluon", "DKDV_PROBE", "3"),
    ("MXATTN_DQ_PROBE", "mxattn.kernels.attn_bwd_dkdv_gluon", "DQ_PROBE", "2"),
]


def _import(module: str, attr: str, env: dict) -> subprocess.CompletedProcess:
    code = f"import {module} as m; print(m.{attr}.value)"
    clean = {k: v for k, v in os.environ.items() if not k.endswith("_PROBE")}
    return subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("var, module, attr, bad", PROBES, ids=[p[0] for p in PROBES])
def test_probe_is_off_by_default_and_checked(var, module, attr, bad):
    pytest.importorskip("triton.experimental.gluon")
    ok = _import(module, attr, {})
    assert ok.returncode == 0 and ok.stdout.strip() == "0", ok.stderr[-500:]
    refused = _import(module, attr, {var: bad})
    assert refused.returncode != 0 and f"{var} must be" in refused.stderr


def test_causal_lpt_switch_default_and_checked():
    """MXATTN_CAUSAL_LPT defaults to "auto", takes "1" / "0" and refuses other values at import."""
    clean = {k: v for k, v in os.environ.items() if k != "MXATTN_CAUSAL_LPT"}
    code = "import mxattn.kernels.launch as L; print(L.CAUSAL_LPT)"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True,  # noqa: E731
                                     text=True, timeout=300)
    assert run({}).stdout.split() == ["auto"]
    assert run({"MXATTN_CAUSAL_LPT": "1"}).stdout.split() == ["1"]
    bad = run({"MXATTN_CAUSAL_LPT": "yes"})
    assert bad.returncode != 0 and "MXATTN_CAUSAL_LPT must be" in bad.stderr


def test_bench_env_turns_settings():
    """A value of scripts/bench_env_turns.py is the variable's value, or its own comma-separated settings."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_env_turns.py"
    spec = importlib.util.spec_from_file_location("bench_env_turns", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.settings("V", "1") == {"V": "1"}
    assert mod.settings(None, "A=0,B=x=y") == {"A": "0", "B": "x=y"}
