"""Shared test fixtures.

``seed``: a per-test seed derived from the test id (each parametrisation draws different inputs),
shifted by ``MXATTN_SEED`` (default 0) for fresh inputs on demand; torch's global RNG is seeded
with it and it is attached to the report.  ``gen``: a CPU ``torch.Generator`` seeded the same way.
Tests marked ``gpu`` are skipped when CUDA is unavailable.
"""

import os
import zlib

import pytest
import torch


def stable_seed(*parts) -> int:
    """A 31-bit seed from strings (stable across runs and processes, unlike ``hash``)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
    s = stable_seed(request.node.nodeid, os.environ.get("MXATTN_SEED", "0"))
    torch.manual_seed(s)
    request.node.add_report_section("call", "seed", f"seed={s} (MXATTN_SEED={os.environ.get('MXATTN_SEED', '0')})")
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
