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
