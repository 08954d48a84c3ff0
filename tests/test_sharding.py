"""MXATTN_TEST_SHARD (tests/conftest.py): scripts/gpu_check.sh runs a slow test file as n processes side by side;
the n shards must split the selected tests exactly (each once, none lost)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collect(shard, *args):
    env = dict(os.environ)
    env.pop("MXATTN_TEST_SHARD", None)
    if shard:
        env["MXATTN_TEST_SHARD"] = shard
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/test_launch.py", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       check=False)
    return r.returncode, [ln for ln in r.stdout.splitlines() if "::" in ln], r.stdout + r.stderr


def test_shards_split_the_selected_tests_exactly():
    rc, everything, out = _collect(None, "-k", "not gpu")
    assert rc == 0 and len(everything) > 3, out
    parts = []
    for i in range(3):
        rc, got, out = _collect(f"{i}/3", "-k", "not gpu")
        assert rc in (0, 5), out
        parts.append(got)
    assert sorted(sum(parts, [])) == sorted(everything)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # round robin over the selected tests


@pytest.mark.parametrize("bad", ["3/3", "x/2", "1"])
def test_bad_shard_is_a_usage_error(bad):
    rc, _, out = _collect(bad)
    assert rc != 0 and "MXATTN_TEST_SHARD" in out
