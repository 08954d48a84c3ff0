"""The Gluon linear + MXFP8 quantize kernel (``mxattn.kernels.linear_quant_gluon``) and the kernel switch.

CPU: the switch (``MXATTN_LINEAR_KERNEL`` / ``KERNEL_OVERRIDE``: values, fallbacks, refusals before any launch)
and the config's register budget.  GPU (``-m gpu``, sm_90): the Gluon kernel against the ``tl`` kernel on the
same row-scaled operands, tiny shapes first (a barrier bug shows as a hang: run under ``timeout``), then odd
sizes (M, N, K not multiples of the tile; B > 1 with seq tiles that end inside a batch; bias or not; hdim / seq /
both; the 128x4-tiled hdim scales).  Comparison rule: every output byte equal to the ``tl`` kernel's, with
precise accumulation (the default) and with ``precise_acc=False``.  Both kernels issue the same wgmma
(m64n128k32 e4m3 per warpgroup) on the same operands in the same K order; precise, each 128-K step is a chain
from zero added to the fp32 accumulator, fast, one chain over all of K (``scripts/compile_check_linear_gluon.py``
checks this on the compiled PTX / SASS, ``check_same_accumulation``); the epilogue runs the same helpers on the
same fp32 values.  The fast mode is also compared to ``linear_quant_reference`` with the bound of
``test_producers.test_gpu_linear_quant_against_reference``.

    PYTHONPATH=. python -m pytest tests/test_linear_gluon.py                         # CPU
    timeout 300 python -m pytest -m gpu -x tests/test_linear_gluon.py -k tiny        # H200, first
    PYTHONPATH=. python -m pytest -m gpu tests/test_linear_gluon.py                  # H200
"""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import mxattn.kernels.linear_quant as kl  # noqa: E402
from mxattn import producers as P  # noqa: E402
from test_producers import ACC_REL, _rand, _u8, assert_mx_close, assert_same_bytes  # noqa: E402

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def clean_switch(monkeypatch):
    if HOPPER:
        import mxattn.kernels.linear_quant_gluon as g

        monkeypatch.setattr(g, "CONFIG_OVERRIDE", None)
    monkeypatch.setattr(kl, "KERNEL_OVERRIDE", None)
    monkeypatch.setattr(kl, "TILE_OVERRIDE", None)
    monkeypatch.delenv(kl.KERNEL_ENV, raising=False)
    yield monkeypatch


def _fp8(shape, device):
    return torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)


# ----------------------------------------------------------------------------------------------
# CPU: the switch
# ----------------------------------------------------------------------------------------------


def test_switch_values_and_fallbacks(clean_switch):
    x, w = _fp8((64, 128), "cpu"), _fp8((96, 128), "cpu")
    assert kl.linear_kernel(x, w, False) == "tl"  # auto on CPU: the tl kernel (interpreter)
    clean_switch.setenv(kl.KERNEL_ENV, "TL")
    assert kl.linear_kernel(x, w, False) == "tl"
    clean_switch.setenv(kl.KERNEL_ENV, "cublas")
    with pytest.raises(ValueError, match="auto, tl or gluon"):
        kl.linear_kernel(x, w, False)
    clean_switch.setenv(kl.KERNEL_ENV, "gluon")
    with pytest.raises(ValueError, match="sm_90"):
        kl.linear_kernel(x, w, False)
    clean_switch.setattr(kl, "KERNEL_OVERRIDE", "tl")  # the override wins over the environment
    assert kl.linear_kernel(x, w, False) == "tl"
    clean_switch.setattr(kl, "KERNEL_OVERRIDE", "auto")
    assert kl.linear_kernel(x, w, True) == "tl"  # a tl tile was asked for


def test_auto_keeps_tl_on_an_unverified_triton(clean_switch):
    """auto takes the Gluon kernel only on a Triton it was verified on (``kernels.gluon_verified``, the attention
    kernels' rule): on another release the tl kernel runs, before the Gluon module is even asked."""
    import mxattn.kernels.linear_quant_gluon as lg

    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    clean_switch.setenv("TRITON_INTERPRET", "0")  # (this module sets it on a CPU machine)
    clean_switch.setattr(lg, "gluon_eligible", lambda *a: True)
    clean_switch.setattr(kl, "gluon_verified", lambda: True)
    assert kl.linear_kernel(fake, fake, False) == "gluon"  # the control: verified Triton, operands it takes
    clean_switch.setattr(kl, "gluon_verified", lambda: False)
    clean_switch.setattr(lg, "gluon_eligible", lambda *a: pytest.fail("auto asked the Gluon module"))
    assert kl.linear_kernel(fake, fake, False) == "tl"


class _FakeOperand:
    """What ``gluon_eligible`` reads of an operand, on a CUDA device that this machine need not have."""

    def __init__(self, shape, strides, ptr=0):
        self.shape, self._strides, self._ptr = torch.Size(shape), strides, ptr
        self.device = torch.device("cuda", 0)

    def dim(self):
        return len(self.shape)

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]

    def data_ptr(self):
        return self._ptr


@pytest.mark.parametrize("strides,ptr,ok", [
    ((128, 1), 0, True), ((256, 1), 0, True),
    ((0, 1), 0, False),  # a broadcast row
    ((64, 1), 0, False),  # rows overlapping (pitch under a row)
    ((136, 1), 0, False), ((128, 1), 8, False), ((1, 128), 0, False),  # pitch / base not 16-byte aligned, K strided
])
def test_gluon_eligible_operands(clean_switch, strides, ptr, ok):
    import mxattn.kernels.linear_quant_gluon as lg

    clean_switch.setattr(lg, "_major", lambda dev: 9)
    w = _FakeOperand((96, 128), (128, 1))
    assert lg.gluon_eligible(_FakeOperand((64, 128), strides, ptr), w) is ok


def test_gluon_refused_through_the_api_on_cpu(clean_switch, gen):
    """Forcing the Gluon kernel where it cannot run raises before any launch (CPU tensors, interpreter)."""
    if CUDA:
        pytest.skip("checks the CPU refusal")
    clean_switch.setattr(P, "_KERNELS_ON_CPU", True)
    clean_switch.setenv(kl.KERNEL_ENV, "gluon")
    x = _rand((2, 5, 32), torch.float32, gen)
    w = _rand((32, 32), torch.float32, gen)
    with pytest.raises(ValueError, match="Gluon"):
        P.linear_quant(x, w)


def test_gluon_eligibility_rules():
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels.linear_quant_gluon import gluon_eligible

    assert not gluon_eligible(_fp8((64, 128), "cpu"), _fp8((64, 128), "cpu"))  # not a CUDA device
    if HOPPER:
        dev = "cuda"
        assert gluon_eligible(_fp8((64, 128), dev), _fp8((96, 128), dev))
        assert not gluon_eligible(_fp8((64, 40), dev), _fp8((96, 40), dev))  # 40-byte rows: no TMA
        assert not gluon_eligible(_fp8((64, 160), dev)[:, 8:], _fp8((96, 152), dev))  # base not 16-byte aligned
        assert not gluon_eligible(_fp8((0, 128), dev), _fp8((96, 128), dev))


def _configs():
    from mxattn.kernels import linear_quant_gluon as g

    c = g.GluonLinearConfig()
    return {"default": c, "inline": c.inline(), "n64": g.GluonLinearConfig(block_n=64), "wide": c.wide(),
            "wide_epi": c.wide_epi(), "wide_epi2": c.wide_epi2()}


@pytest.mark.parametrize("name", ["default", "inline", "n64", "wide", "wide_epi", "wide_epi2"])
def test_config_fits_the_register_file_and_shared_memory(name):
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import linear_quant_gluon as g

    c = _configs()[name]
    assert c.validate(precise=c.block_n <= 128) is c
    # Triton pads the partitions to warpgroups: 16 warps with a 4-warp epilogue partition, 12 without it or with
    # the 2-warp one (which shares the producer's warpgroup)
    warps = 16 if c.epi_partition and c.epi_warps == 4 else 12
    assert c.warps() == warps and c.maxnreg * 32 * warps <= 65536, c
    regs = [c.default_partition_regs()] + c.worker_group_regs()
    assert len(regs) == warps // 4
    assert 128 * sum(regs) <= 65536, (c, regs)
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs
    assert c.default_partition_regs() >= c.consumer_regs  # consumer 0 (the default partition) fits too
    ring = c.stages * (g.BLOCK_M.value + c.block_n) * c.block_k  # e4m3 bytes
    handoff = 2 * g.WG_ROWS.value * c.block_n * 4 if c.epi_partition else 0  # fp32 accumulator slots
    assert ring + handoff + 1024 <= c.smem_bytes() <= 227 * 1024, c
    assert c.block_n in g.BLOCK_NS and g.BLOCK_M.value % 32 == 0


def test_wide_is_the_128x256_tile():
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import linear_quant_gluon as g

    w, we, we2 = g.GluonLinearConfig.wide(), g.GluonLinearConfig.wide_epi(), g.GluonLinearConfig.wide_epi2()
    assert w.block_n == we.block_n == we2.block_n == 256 and g.BLOCK_M.value == 128
    # one m64n256k32 per consumer needs maxnreg >= 160 at launch (ptxas C7602): 12 warps
    assert not w.epi_partition and w.maxnreg == 168 and w.mma_cols() == 256 and w.consumer_regs >= 160
    assert we2.epi_partition and we2.epi_warps == 2 and we2.maxnreg == 168 and we2.warps() == 12
    assert we2.mma_cols() == 256
    # the 4-warp epilogue partition (16 warps, maxnreg 128) with two m64n128k32 per consumer and step
    assert we.epi_partition and we.epi_warps == 4 and we.maxnreg == 128 and we.warps() == 16
    assert we.mma_cols() == 128
    assert g.GluonLinearConfig().block_n == 128 and g.GluonLinearConfig().mma_cols() == 128  # default unchanged
    for c in (w, we, we2):
        c.validate(precise=False)
        with pytest.raises(ValueError, match="fast accumulation"):
            c.validate(precise=True)


@pytest.mark.parametrize("change,match", [
    (dict(block_n=192), "block_n"), (dict(block_n=512), "block_n"), (dict(block_n=32), "block_n"),
    (dict(block_k=96), "block_k"), (dict(block_k=256), "block_k"), (dict(block_k=32), "block_k"),
    (dict(stages=1), "stages"), (dict(group_m=0), "group_m"),
    (dict(epi_warps=3), "epi_warps"),
    (dict(maxnreg=136), "maxnreg"),  # 16 warps x 136 > 64K
    (dict(consumer_regs=260), "partition registers"),
    (dict(epi_regs=220), "default partition|partition registers"),  # consumer 0 left with 112 < 144
    (dict(stages=6), "shared memory"),  # 6 x 32 KB + 64 KB of slots
    (dict(block_n=256), "consumer_regs|maxnreg|shared memory"),  # the 16-warp split cannot hold the 256 tile
    (dict(mma_n=64), "mma_n"), (dict(mma_n=256), "mma_n"),
])
def test_validate_rejects(change, match):
    pytest.importorskip("triton.experimental.gluon")
    import dataclasses

    from mxattn.kernels import linear_quant_gluon as g

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(g.GluonLinearConfig(), **change).validate(precise=False)


@pytest.mark.parametrize("change,match", [
    (dict(block_k=128), "shared memory"),  # 4 x 48 KB ring + 128 KB of slots
    (dict(consumer_regs=152), "consumer_regs"),
    (dict(mma_n=0), "m64n256k32 wgmma needs maxnreg"),  # one m64n256k32 at the 16-warp launch: C7602
    (dict(mma_n=64), "mma_n"),
])
def test_validate_rejects_wide_epi(change, match):
    pytest.importorskip("triton.experimental.gluon")
    import dataclasses

    from mxattn.kernels import linear_quant_gluon as g

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(g.GluonLinearConfig.wide_epi(), **change).validate(precise=False)


@pytest.mark.parametrize("change,match", [
    (dict(block_k=128), "shared memory"),
    (dict(maxnreg=176), "maxnreg"),  # 12 warps x 176 > 64K
    (dict(epi_regs=200), "default partition|partition registers"),  # consumer 0 left with 136
])
def test_validate_rejects_wide_epi2(change, match):
    pytest.importorskip("triton.experimental.gluon")
    import dataclasses

    from mxattn.kernels import linear_quant_gluon as g

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(g.GluonLinearConfig.wide_epi2(), **change).validate(precise=False)


def test_default_config_by_accumulation(monkeypatch):
    """Without an override both modes take the 128 default; FAST_DEFAULT (None today) replaces it for fast
    accumulation only."""
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import linear_quant_gluon as g

    monkeypatch.setattr(g, "FAST_DEFAULT", None)
    assert g.default_config(True) == g.default_config(False) == g.GluonLinearConfig()
    monkeypatch.setattr(g, "FAST_DEFAULT", g.GluonLinearConfig.wide_epi())
    assert g.default_config(False) == g.GluonLinearConfig.wide_epi()
    assert g.default_config(True) == g.GluonLinearConfig()


def test_launcher_validates_before_any_launch(clean_switch):
    """A bad config raises in ``linear_quant_fwd_gluon`` before it touches an operand (None here)."""
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import linear_quant_gluon as g

    args = (None,) * 9 + (1, 1, 16)
    kw = dict(hdim=True, seq=False, rceil=True, soft=False, tiled_scales=False)
    with pytest.raises(ValueError, match="fast accumulation"):
        g.linear_quant_fwd_gluon(*args, precise=True, config=g.GluonLinearConfig.wide(), **kw)
    clean_switch.setattr(g, "CONFIG_OVERRIDE", g.GluonLinearConfig(block_n=192))
    with pytest.raises(ValueError, match="block_n"):
        g.linear_quant_fwd_gluon(*args, precise=False, **kw)


# ----------------------------------------------------------------------------------------------
# GPU: Gluon against tl
# ----------------------------------------------------------------------------------------------


def _fwd(kernel, xr, wr, bias, B, S, orient, precise, tiled=False):
    """linear_quant_fwd with the kernel forced (a forced kernel ignores whether a tile was passed; the Gluon
    launch reads only ``precise_acc`` from it)."""
    saved = kl.KERNEL_OVERRIDE
    kl.KERNEL_OVERRIDE = kernel
    try:
        return kl.linear_quant_fwd(xr, wr, bias, B, S, hdim=orient in ("hdim", "both"), seq=orient in ("seq", "both"),
                                   rceil=True, tile=kl.LinearTile(precise_acc=precise), tiled_scales=tiled)
    finally:
        kl.KERNEL_OVERRIDE = saved


def _operands(B, S, K, N, bias, gen):
    x = _rand((B * S, K), torch.bfloat16, gen)
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    b = _rand((N,), torch.bfloat16, gen) if bias else None
    return kl.row_scaled_rows(x), kl.row_scaled_rows(w), b


TINY = [(1, 1, 16, 32), (1, 7, 48, 40), (2, 3, 128, 64)]
# each distinct (orientation, bias, accumulation, variant) and each 16-divisibility pattern of S, N, K is one compile:
# few shapes, each odd in a different way
ODD = [(1, 199, 160, 96), (2, 45, 272, 200), (3, 129, 1040, 136), (1, 1000, 4096, 1000)]


def _inline(monkeypatch):
    """The variant without the epilogue partition (each consumer quantizes its own accumulator)."""
    import mxattn.kernels.linear_quant_gluon as g

    monkeypatch.setattr(g, "CONFIG_OVERRIDE", g.GluonLinearConfig().inline())


def _check_same(B, S, K, N, bias, orient, gen, tiled=False, precise=True):
    xr, wr, b = _operands(B, S, K, N, bias, gen)
    got = _fwd("gluon", xr, wr, b, B, S, orient, precise, tiled)
    want = _fwd("tl", xr, wr, b, B, S, orient, precise, tiled)
    assert sorted(got) == sorted(want)
    for key in want:
        assert_same_bytes(got[key], want[key],
                          f"gluon vs tl {key} B{B} S{S} K{K} N{N} bias={bias} {orient} precise={precise}")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["epi", "inline"])
@pytest.mark.parametrize("orient", ["hdim", "seq", "both"])
@pytest.mark.parametrize("B,S,K,N", TINY, ids=lambda v: str(v))
def test_gpu_gluon_tiny(gen, clean_switch, B, S, K, N, orient, variant):
    if variant == "inline":
        _inline(clean_switch)
    _check_same(B, S, K, N, True, orient, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["epi", "inline"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("orient", ["hdim", "seq", "both"])
@pytest.mark.parametrize("B,S,K,N", ODD, ids=lambda v: str(v))
def test_gpu_gluon_matches_tl(gen, clean_switch, B, S, K, N, orient, bias, variant):
    if variant == "inline":
        _inline(clean_switch)
    _check_same(B, S, K, N, bias, orient, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["epi", "inline"])
@pytest.mark.parametrize("B,S,K,N", [(1, 199, 160, 96), (2, 300, 1040, 200), (1, 2048, 4096, 1024)],
                         ids=lambda v: str(v))
def test_gpu_gluon_fast_accumulation_matches_tl(gen, clean_switch, B, S, K, N, variant):
    if variant == "inline":
        _inline(clean_switch)
    _check_same(B, S, K, N, True, "both", gen, precise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("B,S,K,N", [(1, 199, 160, 96), (2, 1000, 1024, 1536)], ids=lambda v: str(v))
def test_gpu_gluon_tiled_scales(gen, clean_switch, B, S, K, N):
    _check_same(B, S, K, N, True, "hdim", gen, tiled=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["epi", "inline"])
def test_gpu_gluon_many_tiles_per_cta(gen, clean_switch, variant):
    """More tiles than SMs (every CTA walks several tiles; the ring and the accumulator slots wrap across
    tiles), B > 1 with seq."""
    if variant == "inline":
        _inline(clean_switch)
    _check_same(4, 1000, 384, 2048, True, "both", gen)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,K,N,orient", [(199, 160, 96, "both"), (2000, 4096, 1024, "both"), (2048, 1040, 640, "hdim")],
                         ids=lambda v: str(v))
def test_gpu_gluon_imprecise_against_reference(gen, clean_switch, M, K, N, orient):
    """precise_acc=False through the public API, the Gluon kernel forced: the reference within the bound of
    test_producers.test_gpu_linear_quant_against_reference for unpromoted accumulation."""
    clean_switch.setattr(kl, "KERNEL_OVERRIDE", "gluon")
    clean_switch.setattr(kl, "TILE_OVERRIDE", kl.LinearTile(precise_acc=False))
    x = _rand((M, K), torch.bfloat16, gen)
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    b = _rand((N,), torch.bfloat16, gen)
    got = P.linear_quant(x, w, b, orientations=orient)
    want = P.linear_quant_reference(x.cpu(), w.cpu(), b.cpu(), orientations=orient)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    xr2, wr2 = P._as_row_scaled(x.cpu(), "rceil"), P._as_row_scaled(w.cpu(), "rceil")
    acc_abs = 2 * ACC_REL * (xr2.dequantize(torch.float64).abs() @ wr2.dequantize(torch.float64).abs().T)
    for g, wt in zip(got, want):
        stats = assert_mx_close(g, wt, f"gluon imprecise {M}x{K}x{N} {orient}", min_equal=0.95, acc_abs=acc_abs)
        print(f"gluon imprecise {M}x{K}x{N} {orient} dim={wt.dim}: {stats}")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_public_api_takes_gluon_on_hopper(gen, clean_switch):
    """``linear_quant`` with the defaults goes through the Gluon kernel (auto) and gives the tl kernel's bytes."""
    x = _rand((2, 300, 512), torch.bfloat16, gen)
    w = _rand((768, 512), torch.bfloat16, gen, 512 ** -0.5)
    xr = kl.row_scaled_rows(x.reshape(-1, 512))
    assert kl.linear_kernel(xr.data, kl.row_scaled_rows(w).data, False) == "gluon"
    auto = P.linear_quant(x, w, orientations="both")
    clean_switch.setenv(kl.KERNEL_ENV, "tl")
    tl_out = P.linear_quant(x, w, orientations="both")
    for a, t in zip(auto, tl_out):
        assert torch.equal(_u8(a.data), _u8(t.data)) and torch.equal(_u8(a.scale), _u8(t.scale))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["epi", "inline"])
def test_gpu_gluon_special_values(gen, clean_switch, variant):
    """NaN / Inf in x (the epilogue's patching branches: NaN bytes, 255 scales) and all-zero rows: same bytes as tl."""
    if variant == "inline":
        _inline(clean_switch)
    B, S, K, N = 2, 150, 256, 160
    x = _rand((B * S, K), torch.bfloat16, gen)
    x[3, 7] = float("inf")
    x[70, 100] = float("-inf")
    x[200, 5] = float("nan")
    x[120] = 0.0
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    xr, wr = kl.row_scaled_rows(x), kl.row_scaled_rows(w)
    for orient in ("hdim", "seq", "both"):
        got = _fwd("gluon", xr, wr, None, B, S, orient, True)
        want = _fwd("tl", xr, wr, None, B, S, orient, True)
        for key in want:
            assert_same_bytes(got[key], want[key], f"special values {key} {orient}")
        if "hs" in want:
            assert (_u8(want["hs"]) == 255).any()  # the case reached the NaN / Inf path


# ----------------------------------------------------------------------------------------------
# GPU: the tile widths (session 14): 128 and 256 with fast accumulation (256 runs with it only), byte for byte
# against the tl kernel's fast accumulation; N tails that end inside a 64-column part, on a part boundary and
# past whole parts (the epilogue skips parts wholly past N).  Few compiles: every shape below has S, N not
# multiples of 16 except N 96, K multiples of 16.
# ----------------------------------------------------------------------------------------------

TILE_CONFIGS = ["fast128", "n64", "wide", "wide_epi", "wide_epi2"]
TAILS = [(1, 199, 160, 96), (2, 45, 272, 200), (1, 130, 256, 300), (3, 129, 1040, 600), (1, 1000, 4096, 1000)]


def _tile_config(monkeypatch, name):
    import mxattn.kernels.linear_quant_gluon as g

    cfg = {"fast128": g.GluonLinearConfig(), "n64": g.GluonLinearConfig(block_n=64),
           "wide": g.GluonLinearConfig.wide(), "wide_epi": g.GluonLinearConfig.wide_epi(),
           "wide_epi2": g.GluonLinearConfig.wide_epi2()}[name]
    monkeypatch.setattr(g, "CONFIG_OVERRIDE", cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cfg", TILE_CONFIGS)
@pytest.mark.parametrize("B,S,K,N", [(2, 3, 48, 264)], ids=lambda v: str(v))
def test_gpu_tiles_tiny(gen, clean_switch, B, S, K, N, cfg):
    """One compile per config: B 2, K shorter than one ring step, N 264 (the 256 tiles' second column tile holds
    one live 64-column part of four)."""
    _tile_config(clean_switch, cfg)
    _check_same(B, S, K, N, True, "both", gen, precise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cfg", TILE_CONFIGS)
@pytest.mark.parametrize("B,S,K,N", TAILS, ids=lambda v: str(v))
def test_gpu_tiles_tails_match_tl(gen, clean_switch, B, S, K, N, cfg):
    _tile_config(clean_switch, cfg)
    _check_same(B, S, K, N, True, "both", gen, precise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cfg", ["wide", "wide_epi", "wide_epi2"])
@pytest.mark.parametrize("orient", ["hdim", "seq"])
def test_gpu_tiles_one_orientation(gen, clean_switch, orient, cfg):
    _tile_config(clean_switch, cfg)
    _check_same(2, 300, 1040, 600, False, orient, gen, precise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cfg", ["wide", "wide_epi", "wide_epi2"])
def test_gpu_tiles_many_tiles_per_cta(gen, clean_switch, cfg):
    """More 128 x 256 tiles than SMs (the ring and the slots wrap across tiles), B > 1, tiled hdim scales."""
    _tile_config(clean_switch, cfg)
    _check_same(4, 1000, 384, 2600, True, "both", gen, precise=False)
    _check_same(2, 1000, 384, 1000, True, "hdim", gen, tiled=True, precise=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_tiles_special_values(gen, clean_switch):
    """NaN / Inf in x and an all-zero row through the 256 tiles: the tl kernel's bytes."""
    B, S, K, N = 2, 150, 256, 300
    x = _rand((B * S, K), torch.bfloat16, gen)
    x[3, 7] = float("inf")
    x[200, 5] = float("nan")
    x[120] = 0.0
    w = _rand((N, K), torch.bfloat16, gen, K ** -0.5)
    xr, wr = kl.row_scaled_rows(x), kl.row_scaled_rows(w)
    want = _fwd("tl", xr, wr, None, B, S, "both", False)
    for cfg in ("wide", "wide_epi", "wide_epi2"):
        _tile_config(clean_switch, cfg)
        got = _fwd("gluon", xr, wr, None, B, S, "both", False)
        for key in want:
            assert_same_bytes(got[key], want[key], f"special values {key} {cfg}")
