"""Shared test fixtures.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module imports a kernel, so the
``tl`` kernels run on the CPU interpreter at tiny shapes.

``seed``: a per-test seed derived from the test id (each parametrisation draws different inputs),
shifted by ``MXATTN_SEED``: drawn fresh for every session unless set (the header prints it, so
``MXATTN_SEED=N pytest ...`` reproduces a run); torch's global RNG is seeded
with it and it is attached to the report.  ``gen``: a CPU ``torch.Generator`` seeded the same way.
Tests marked ``gpu`` are skipped when CUDA is unavailable.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = os.environ.get("MXATTN_SEED") or str(int.from_bytes(os.urandom(3), "little"))


def pytest_report_header(config):
    return f"mxattn: MXATTN_SEED={SESSION_SEED} (fresh inputs each session; set it to reproduce)"


def stable_seed(*parts) -> int:
    """A 31-bit seed from strings (stable across runs and processes, unlike ``hash``)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def require_kernels() -> str:
    """Skip unless the ``tl`` kernels can run here (TRITON_INTERPRET=1, set above on machines without CUDA, or a
    GPU); returns the device their tests use."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without a GPU (conftest sets it)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def seed(request) -> int:
    s = stable_seed(request.node.nodeid, SESSION_SEED)
    torch.manual_seed(s)
    request.node.add_report_section("call", "seed", f"seed={s} (MXATTN_SEED={SESSION_SEED})")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
