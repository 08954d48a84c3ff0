"""The causal CTA order (kernels/cta_order.py): a permutation of the grid with sections heaviest first, and the
``tl`` build of the same source gives what the host gives (interpreter on the CPU, compiled on a GPU); the Gluon
build is compared through its kernels' bit-identity tests (test_attn_bwd_dq_gluon.py, test_attn_bwd_dkdv_gluon.py,
test_attn_fwd_gluon.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mxattn.kernels.cta_order import causal_cta_order, cta_order_tl


@pytest.mark.parametrize("heavy_last", [False, True])
@pytest.mark.parametrize("n_blocks,n_bh,section", [(33, 6, 264), (20, 12, 264), (1, 5, 264), (7, 3, 0), (16, 64, 264),
                                                   (5, 9, 8), (32, 32, 264), (8, 3, 17)])
def test_causal_cta_order_is_a_permutation(n_blocks, n_bh, section, heavy_last):
    """``causal_cta_order`` (``cta_order`` on the host): every (block, head) exactly once;
    section 0 keeps head-by-head order; otherwise sections of g = cdiv(section, blocks) heads, the remainder heads
    in the last one, each section's heaviest block of every head before any lighter one."""
    order = causal_cta_order(n_blocks, n_bh, section, heavy_last)
    assert sorted(order) == [(b, h) for b in range(n_blocks) for h in range(n_bh)]
    weight = [(b if heavy_last else n_blocks - 1 - b) for b, _ in order]  # larger = heavier
    if section == 0:
        assert [h for _, h in order] == [h for h in range(n_bh) for _ in range(n_blocks)]
        return
    g = -(-section // n_blocks)
    heads = [list(range(s, s + g)) for s in range(0, n_bh - n_bh % g if n_bh >= g else 0, g)] or [[]]
    heads[-1] += list(range(len(heads) * g if n_bh >= g else 0, n_bh))  # the remainder joins the last section
    start = 0
    for hs in heads:
        sec = order[start:start + len(hs) * n_blocks]
        assert {h for _, h in sec} == set(hs)
        w = weight[start:start + len(hs) * n_blocks]
        assert w == sorted(w, reverse=True)  # heaviest first within the section
        start += len(hs) * n_blocks
    assert start == len(order)


@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
def test_causal_lpt_launch_constexpr(kernel, monkeypatch):
    """``causal_lpt`` of the Gluon dQ / dK-dV configs reaches the kernel as LPT_SECTION = two waves (2 x the SM
    count; 132 SMs for the CPU stand-in) on causal launches only (the launch recorded, not run)."""
    import test_attn_bwd_dkdv_gluon as dkdv_tests
    import test_attn_bwd_dq_gluon as dq_tests

    tests = dq_tests if kernel == "dq" else dkdv_tests
    m = tests._mod()
    monkeypatch.setattr(m, "_PLANS", {})
    ops = tests._cpu_operands()
    launch = m.attn_bwd_dq_gluon if kernel == "dq" else m.attn_bwd_dkdv_gluon
    config = m.GluonDqConfig if kernel == "dq" else m.GluonDkdvConfig
    for causal, lpt, want in ((True, True, 264), (True, False, 0), (False, True, 0)):
        cfg = config(split=True, causal_lpt=lpt)
        (grid, _, kw), = dkdv_tests._recorded_launches(monkeypatch, lambda: launch(**ops, causal=causal, config=cfg),
                                                       n=1)
        assert kw.get("LPT_SECTION", 0) == want
        assert grid == ((2, 4) if kernel == "dq" else (2, 2))  # (blocks, B * heads) as before


def test_causal_lpt_defaults(monkeypatch):
    """The measured rules (``launch.causal_lpt``): under MXATTN_CAUSAL_LPT=auto the Gluon forward's causal default
    config is the per-block kernel (which takes the order), non-causal the persistent one; "0" keeps the persistent
    kernel for both.  The persistent dK/dV kernel (its own order) never gets LPT_SECTION."""
    import test_attn_bwd_dkdv_gluon as dkdv_tests

    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import attn_fwd_gluon as fwd
    from mxattn.kernels import launch

    for mode, causal, persistent in (("auto", True, False), ("auto", False, True), ("0", True, True),
                                     ("1", False, True)):
        monkeypatch.setattr(launch, "CAUSAL_LPT", mode)
        assert fwd.default_config(128, causal).persistent is (persistent and fwd.PERSISTENT_DEFAULT), (mode, causal)
    monkeypatch.setattr(launch, "CAUSAL_LPT", "1")
    m = dkdv_tests._mod()
    monkeypatch.setattr(m, "_PLANS", {})
    ops = dkdv_tests._cpu_operands()
    cfg = m.GluonDkdvConfig(split=True, persistent=True)
    (_, _, kw), = dkdv_tests._recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, causal=True,
                                                                                            config=cfg), n=1)
    assert "LPT_SECTION" not in kw


def test_cta_order_tl_matches_the_host():
    """``cta_order_tl`` in a kernel gives each CTA of a (blocks, heads) grid the (block, head) ``causal_cta_order``
    lists for its launch position, for both heavy ends (interpreter on the CPU; not marked ``gpu``:
    scripts/gpu_check.sh's lpt stages run it on the GPU by name)."""
    from conftest import require_kernels

    dev = require_kernels()
    for nb, n_bh, section in ((5, 7, 12), (3, 4, 0), (4, 9, 1), (6, 5, 100), (33, 6, 264)):
        for heavy_last in (False, True):
            out = torch.full((nb * n_bh, 2), -1, dtype=torch.int32, device=dev)
            _probe[(nb, n_bh)](out, section, heavy_last)
            assert out.cpu().tolist() == [list(t) for t in causal_cta_order(nb, n_bh, section, heavy_last)]



@triton.jit
def _probe(OUT, LPT_SECTION: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """Each CTA's ``cta_order_tl`` at its launch position."""
    blk, bh = cta_order_tl(tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1), LPT_SECTION,
                           HEAVY_LAST)
    lin = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(OUT + 2 * lin, blk)
    tl.store(OUT + 2 * lin + 1, bh)
