"""Shared test fixtures.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module imports a kernel, so the
``tl`` kernels run on the CPU interpreter at tiny shapes.

``seed``: a per-test seed derived from the test id (each parametrisation draws different inputs),
shifted by ``MXATTN_SEED``: drawn fresh for every session unless set (the header prints it, so
``MXATTN_SEED=N pytest ...`` reproduces a run); torch's global RNG is seeded
with it and it is attached to the report.  ``gen``: a CPU ``torch.Generator`` seeded the same way.
Tests marked ``gpu`` are skipped when CUDA is unavailable.
"""

import collections
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


def triton_version() -> str:
    """The installed triton's version, "" without triton."""
    try:
        import triton

        return triton.__version__
    except ImportError:
        return ""


def import_gluon_module(name: str):
    """``mxattn.kernels.<name>`` (a Gluon kernel module), or a skip when this triton's Gluon cannot load it (only
    allowed off triton 3.6, the version the kernels target)."""
    import importlib

    pytest.importorskip("triton")
    try:
        return importlib.import_module(f"mxattn.kernels.{name}")
    except Exception as e:  # noqa: BLE001
        if triton_version().startswith("3.6"):
            raise
        pytest.skip(f"{name} targets triton 3.6's Gluon; triton {triton_version()} cannot load it: {e}")


class MBarrierModel:
    """An mbarrier for the protocol-model tests of the Gluon kernels: pending arrivals and transaction units,
    completed phases.  ``ready(P)`` is true iff the phase with parity P has completed, i.e. iff ``phases & 1 != P``
    (a fresh barrier passes ``wait(1)``)."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def ready(self, parity):
        return (self.phases & 1) != parity

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def arrive(self):
        assert self.pending > 0, "more arrivals than the barrier's count"
        self.pending -= 1
        self._maybe_complete()

    def expect_arrive(self, tx):
        self.tx += tx
        self.arrive()

    def complete_tx(self, tx=1):
        self.tx -= tx
        assert self.tx >= 0, "more transactions landed than expected"
        self._maybe_complete()


class SharedTilesModel:
    """Shared-memory buffers, asynchronous TMA loads and wgmma reads for the protocol-model tests: ``tma`` starts a
    load (landing later, in a random order, and completing a transaction on its ``MBarrierModel``), ``start_read`` /
    ``done_read`` bracket a wgmma reading a buffer (any number of readers).  ``run(actors, rng)`` interleaves the
    actors (generators yielding ("step",) or ("wait", barrier, parity)) with the landings at random.  Checks: no
    deadlock, each read sees the tile it expects, no TMA is issued into or lands in a buffer being read."""

    def __init__(self, buffers):
        self.content = {b: None for b in buffers}
        self.reading = collections.Counter()
        self.in_flight = []  # (buffer, tile, barrier) not landed yet
        self.log = []

    def tma(self, buf, tile, bar):
        assert buf not in self.reading, f"TMA into {buf} while a wgmma reads it"
        self.in_flight.append((buf, tile, bar))

    def start_read(self, buf, tile):
        assert self.content[buf] == tile, f"wgmma reads {buf} expecting tile {tile}, holds {self.content[buf]}"
        self.reading[buf] += 1
        self.log.append(("read", buf, tile))

    def done_read(self, buf):
        self.reading[buf] -= 1
        if not self.reading[buf]:
            del self.reading[buf]

    def run(self, actors: dict, rng) -> list:
        waits = {name: ("step",) for name in actors}
        while actors or self.in_flight:
            runnable = [n for n in actors if waits[n][0] == "step" or waits[n][1].ready(waits[n][2])]
            choices = runnable + (["tma"] if self.in_flight else [])
            assert choices, f"deadlock: waits {[(n, waits[n]) for n in actors]}"
            pick = rng.choice(choices)
            if pick == "tma":
                buf, tile, bar = self.in_flight.pop(rng.randrange(len(self.in_flight)))
                assert buf not in self.reading, f"TMA landed in {buf} while a wgmma reads it"
                self.content[buf] = tile
                bar.complete_tx()
                continue
            try:
                waits[pick] = next(actors[pick])
            except StopIteration:
                del actors[pick]
        return self.log


def assert_same_up_to_summation_order(got: torch.Tensor, want: torch.Tensor, name: str, block: int = 128,
                                       rel: float = 1e-2, floor: float = 1e-6) -> None:
    """Two kernels with the same rounded operands (P, dS bits) whose results differ only by fp32 summation order:
    no NaN, same shape/dtype, contiguous, and within ``rel`` of the reference both over the whole tensor and per
    (batch, ``block`` rows of dim 1, head) block, so that a fault confined to one tile cannot hide in the norm of a
    large tensor.  Blocks (and tensors) whose reference is all zero must match to ``floor`` in absolute terms."""
    from mxattn import reference

    assert not torch.isnan(got).any(), f"{name}: NaN"
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), name
    g, w = got.double(), want.double()
    diff, ref = (g - w).norm().item(), w.norm().item()
    assert diff <= rel * ref or diff <= floor, f"{name}: SQNR {reference.sqnr_db(g, w):.1f} dB"
    if g.dim() == 4 and g.shape[1] > 0:  # (B, S, H, D): blocks of rows along S
        B, S, H, D = g.shape
        pad = (-S) % block
        d = torch.nn.functional.pad(g - w, (0, 0, 0, 0, 0, pad)).view(B, -1, block, H, D)
        r = torch.nn.functional.pad(w, (0, 0, 0, 0, 0, pad)).view(B, -1, block, H, D)
        dn, rn = d.pow(2).sum(dim=(2, 4)).sqrt(), r.pow(2).sum(dim=(2, 4)).sqrt()  # (B, S/block, H)
        bad = dn > rel * rn + floor
        if bad.any():
            b, sb, h = (int(x) for x in bad.nonzero()[0])
            raise AssertionError(f"{name}: block (b={b}, rows {sb * block}.., h={h}) differs by {dn[b, sb, h]:.3g} "
                                 f"against a reference norm of {rn[b, sb, h]:.3g} ({int(bad.sum())} blocks)")


@pytest.fixture
def seed(request) -> int:
    s = stable_seed(request.node.nodeid, SESSION_SEED)
    torch.manual_seed(s)
    request.node.add_report_section("call", "seed", f"seed={s} (MXATTN_SEED={SESSION_SEED})")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _shard(spec: str) -> tuple[int, int]:
    """MXATTN_TEST_SHARD "i/n" -> (i, n), 0 <= i < n."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"MXATTN_TEST_SHARD must be 'i/n', got {spec!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"MXATTN_TEST_SHARD {spec!r}: need 0 <= i < n")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m / -k deselection, so the shards split the tests that run
def pytest_collection_modifyitems(config, items):
    # MXATTN_TEST_SHARD=i/n keeps every n-th test from the i-th (collection order), so that one slow file can run
    # as n processes side by side (scripts/gpu_check.sh: "file@n" in MXATTN_TEST_FILES)
    spec = os.environ.get("MXATTN_TEST_SHARD")
    if spec:
        i, n = _shard(spec)
        drop = [it for k, it in enumerate(items) if k % n != i]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [it for k, it in enumerate(items) if k % n == i]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
