"""The warp-specialized Gluon dK/dV kernel of the backward (``mxattn/kernels/attn_bwd_dkdv_gluon.py``).

CPU: the module imports (under triton 3.6 it must; under another triton Gluon's API may differ and the tests skip);
the launcher rejects bad operands before any launch; lse and δ reach the kernel as TMA rows in place or, when their
row pitch is not 16-byte aligned, as padded copies, and a box read through the descriptor (with TMA's zero fill)
gives the values the consumers' masked loads gave before session 7; a pure-Python model of the kernel's mbarrier
protocol (the producer's ring of Q, dO, Q_seq, dO_seq, lse and δ, the consumer's order of waits and releases, same
parity formulas; with dK deferred one step, stage j-1 released at step j's end, and without) runs under random interleavings without deadlock and never lets TMA overwrite a buffer a wgmma or
a shared-memory load still reads; and, where
triton 3.6 is installed, the kernel compiles for sm_90a with the rules of
``scripts/compile_check_bwd_dkdv_gluon.py`` (marker ``slow``).

GPU (marker ``gpu``): (dk, dv) against the ``tl`` kernel's (``attn_bwd_hopper(..., deterministic=True)``) on the
same operands: the same dS exponents and e4m3 P / dS values, so only the fp32 summation order differs (SQNR > 40 dB,
no NaN, keys no query sees exactly 0); and the timing helper ``bench_attn_bwd_dkdv_gluon`` (Gluon vs the ``tl``
dK/dV-only kernel, B2 H16 S8k d128, causal and not), printed.  The 128-query step (``GluonDkdvConfig(block_m=128)``,
d64, session 9; ``-k bm128``) against the tl kernel with BLOCK_M = 128; on the CPU its config, twin, lse boxes and
launch plans, the twin under the interpreter, and its sm_90a builds (``slow``, triton 3.6).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from conftest import (
    MBarrierModel,
    SharedTilesModel,
    assert_same_up_to_summation_order,
    import_gluon_module,
    triton_version,
)

_HERE = os.path.dirname(os.path.abspath(__file__))


def _mod():
    return import_gluon_module("attn_bwd_dkdv_gluon")


# ---------------------------------------------------------------------------------------------------- CPU
def test_module_imports():
    m = _mod()
    assert callable(m.attn_bwd_dkdv_gluon) and callable(m.bench_attn_bwd_dkdv_gluon)
    # the tl dK/dV kernel's tiles: the dS exponent is one per (128 keys x 64 queries) tile in both (64 queries: the
    # default step; 128 is the opt-in step of session 9)
    assert m.BLOCK_N.value == 128 and m.BLOCK_M_DEFAULT == 64 and m.KV_EXP_GROUP == m.BLOCK_N.value
    assert m.BLOCK_MS == (64, 128) and m.GluonDkdvConfig().block_m == m.BLOCK_M_DEFAULT
    from mxattn.kernels import attn_bwd

    cfg = attn_bwd.BwdConfig()
    assert cfg.block_n == m.BLOCK_N.value and cfg.block_m == m.BLOCK_M_DEFAULT and cfg.ds_tile_scale


def test_config_ds_exp_and_tl_twin():
    """``ds_exp`` is "key" (the default on this branch) or "tile", anything else is refused by name; each build's
    tl twin (``tl_twin_config``) has its key block (128, or 64 when split), 64-query tiles, 4 / 8 warps and the
    matching dS rule (``ds_tile_scale`` False for "key")."""
    m = _mod()
    assert m.GluonDkdvConfig().ds_exp == "key" and m.GluonDkdvConfig().key_exp
    assert not m.GluonDkdvConfig(ds_exp="tile").key_exp
    with pytest.raises(ValueError, match="ds_exp"):
        m.GluonDkdvConfig(ds_exp="row")
    for split in (False, True):
        for ds_exp in ("key", "tile"):
            tw = m.tl_twin_config(m.GluonDkdvConfig(split=split, ds_exp=ds_exp))
            assert tw.block_n == (64 if split else 128) and tw.block_m == m.BLOCK_M_DEFAULT
            assert tw.num_warps == (4 if split else 8) and tw.ds_tile_scale == (ds_exp == "tile")
    assert m.tl_twin_config(None) == m.tl_twin_config(m.default_config(128, False))


def test_config_block_m():
    """``block_m`` (the query step, session 9): 64 by default (what users get, at every head dim and mask), 128 as an
    option; anything else is refused by name.  ``check_launch`` allows 128 only at head dim 64 and in dense launches,
    and the 128-query build is never deferred (``defers_dk``: its fp32 dSᵀ carry would spill)."""
    m = _mod()
    for D in (64, 128):
        for causal in (False, True):
            assert m.default_config(D, causal).block_m == 64
    for bad in (32, 96, 256, 0, "128", 128.0, True):
        with pytest.raises(ValueError, match="block_m"):
            m.GluonDkdvConfig(block_m=bad)
    c = m.GluonDkdvConfig(block_m=128)
    c.check_launch(64)
    c.check_launch(None)
    with pytest.raises(ValueError, match="head dim 64"):
        c.check_launch(128)
    with pytest.raises(ValueError, match="jagged"):
        c.check_launch(64, varlen=True)
    m.GluonDkdvConfig().check_launch(128, varlen=True)  # 64: every launch
    assert not c.defers_dk and not m.GluonDkdvConfig(block_m=128, stages=4).defers_dk
    assert m.GluonDkdvConfig().defers_dk and not m.GluonDkdvConfig(stages=1).defers_dk


def test_tl_twin_block_m128():
    """The tl twin of a 128-query build steps over 128 queries too (``block_m``: the dS exponent's query extent, and
    the reference's ``ds_q_block`` for the per-key rule), with the build's key block, warps and dS rule."""
    m = _mod()
    for split in (False, True):
        for ds_exp in ("key", "tile"):
            cfg = m.GluonDkdvConfig(split=split, ds_exp=ds_exp, block_m=128)
            tw = m.tl_twin_config(cfg)
            assert tw.block_m == 128 and tw.block_n == (64 if split else 128)
            assert tw.num_warps == (4 if split else 8) and tw.ds_tile_scale == (ds_exp == "tile")
            # everything but the step equals the 64-query build's twin
            from dataclasses import replace

            assert replace(tw, block_m=64) == m.tl_twin_config(replace(cfg, block_m=64))


@pytest.mark.parametrize("split,causal", [(True, True), (False, False)], ids=["split-causal", "whole"])
def test_tl_twin_block_m128_interpreter(split, causal, seed):
    """The tl kernel runs the 128-query twin (``attn_bwd._bwd_dkdv_kernel`` with BLOCK_M = 128, per-key dS rule,
    d64) under the interpreter within the calibrated bound of the reference emulation with ``ds_q_block=128`` and of
    its own fp64 emulation (``test_attn_bwd._check``): the GPU tests of the 128-query Gluon build compare against
    it.  Odd Sq (not a multiple of 128), GQA, partial key block."""
    from dataclasses import replace

    from conftest import require_kernels
    from test_attn_bwd import _check, _inputs

    require_kernels()
    m = _mod()
    tw = replace(m.tl_twin_config(m.GluonDkdvConfig(split=split, block_m=128)), dq_kernel=True)
    assert tw.block_m == 128 and not tw.ds_tile_scale
    q, k, v, do = _inputs(1, 200, 150, 4, 2, 64, "cpu", seed)
    _check(q, k, v, do, causal, config=tw)


def _cpu_operands(B=1, Sq=130, Sk=200, Hq=4, Hkv=2, D=64, q_rows=128):
    from mxattn import formats

    g = torch.Generator().manual_seed(0)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g)  # noqa: E731
    q, k, v, do = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)
    grp = lambda x, n: formats.row_scaled_from_float(x, -1, group_dim=1, group=n)  # noqa: E731

    def seq(x):
        s = formats.row_scaled_from_float(x, 1)
        return formats.RowScaledFP8(formats.channel_major(s.data), s.exp, s.dim)

    return dict(
        q=grp(q, q_rows) if q_rows > 1 else formats.row_scaled_from_float(q, -1),
        k=grp(k, 128), v_hdim=grp(v, 128), q_seq=seq(q), dout_hdim=grp(do, 128), dout_seq=seq(do),
        lse=torch.zeros(B, Hq, Sq), delta=torch.zeros(B, Hq, Sq),
    )


def test_launcher_rejects_bad_operands():
    m = _mod()
    from mxattn import formats

    ok = _cpu_operands()
    bad = [
        (dict(q=_cpu_operands(q_rows=1)["q"]), "grouped along the sequence"),  # the per-row Q layout
        (dict(q=_cpu_operands(q_rows=32)["q"]), "multiple of 64"),
        (dict(k=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1)), "grouped along the sequence"),
        (dict(v_hdim=formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), -1, group_dim=1, group=256)),
         "one exponent per 128 keys"),
        (dict(q_seq=formats.row_scaled_from_float(torch.randn(1, 130, 4, 64), 1)), "channel-major"),
        (dict(dout_seq=_cpu_operands(Hq=2)["dout_seq"]), "dout_seq"),
        (dict(dout_seq=ok["dout_hdim"]), "dout_seq"),
        (dict(lse=torch.zeros(1, 4, 129)), "lse"),
        (dict(delta=torch.zeros(1, 4, 130, dtype=torch.float64)), "delta"),
        (dict(dout_hdim=_cpu_operands(Sq=131)["dout_hdim"]), "dout_hdim"),
        (dict(k=torch.zeros(1)), "RowScaledFP8"),
    ]
    for change, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            m.attn_bwd_dkdv_gluon(**(ok | change))
    with pytest.raises(ValueError, match="head dim"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(D=32))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(Hq=3, Hkv=2))
    with pytest.raises(ValueError, match="stages"):
        m.attn_bwd_dkdv_gluon(**ok, config=m.GluonDkdvConfig(stages=0))
    with pytest.raises(ValueError, match="grad_dtype"):
        m.attn_bwd_dkdv_gluon(**ok, grad_dtype=torch.int8)


def test_launcher_rejects_block_m128_where_it_cannot_build():
    """block_m=128: refused at head dim 128, for q / dO with fewer than 128 rows per exponent (one exponent per
    step), and in the jagged launcher (before its operands are looked at)."""
    m = _mod()
    cfg = m.GluonDkdvConfig(block_m=128)
    with pytest.raises(ValueError, match="head dim 64"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(D=128), config=cfg)
    with pytest.raises(ValueError, match="multiple of 128"):
        m.attn_bwd_dkdv_gluon(**_cpu_operands(q_rows=64), config=cfg)
    with pytest.raises(ValueError, match="jagged"):
        m.attn_bwd_dkdv_gluon_varlen(*([None] * 8), config=cfg)


def test_fused_dq_config_and_launcher_checks():
    """``fuse_dq``: the steps are never deferred, the whole-tile and jagged builds are refused, and
    ``attn_bwd_dkdv_dq_gluon`` rejects a missing or malformed k_seq and a config without fuse_dq before any launch;
    MXATTN_BWD_FUSED_DQ takes 0 or 1 only."""
    m = _mod()
    from mxattn import formats
    from mxattn.kernels import attn_bwd

    assert not m.GluonDkdvConfig(split=True, fuse_dq=True).defers_dk
    assert m.GluonDkdvConfig(split=True).defers_dk
    with pytest.raises(ValueError, match="split"):
        m.GluonDkdvConfig(fuse_dq=True).check_launch(64)
    with pytest.raises(ValueError, match="dense"):
        m.GluonDkdvConfig(split=True, fuse_dq=True).check_launch(64, varlen=True)
    ops = _cpu_operands()
    s = formats.row_scaled_from_float(torch.randn(1, 200, 2, 64), 1)
    k_seq = formats.RowScaledFP8(formats.channel_major(s.data), s.exp, s.dim)
    with pytest.raises(TypeError, match="k_seq"):
        m.attn_bwd_dkdv_dq_gluon(**ops, k_seq=None)
    with pytest.raises(ValueError, match="k_seq"):
        m.attn_bwd_dkdv_dq_gluon(**ops, k_seq=ops["k"])  # the K layout, not the V layout
    with pytest.raises(ValueError, match="fuse_dq=True"):
        m.attn_bwd_dkdv_dq_gluon(**ops, k_seq=k_seq, config=m.GluonDkdvConfig(split=True, block_m=128))
    for value, want in (("0", False), ("1", True)):
        os.environ["MXATTN_BWD_FUSED_DQ"] = value
        assert attn_bwd.fused_dq() is want
    os.environ["MXATTN_BWD_FUSED_DQ"] = "yes"
    with pytest.raises(ValueError, match="MXATTN_BWD_FUSED_DQ"):
        attn_bwd.fused_dq()
    del os.environ["MXATTN_BWD_FUSED_DQ"]


def test_tile_exponents_expand_groups():
    """The launcher's per-step exponents (``_tile_exps``: one per 64 rows, or per 128 with 128-query steps) are the
    grouped operand's, row by row."""
    m = _mod()
    for bm, rows, Sq in ((64, 128, 130), (64, 64, 64), (64, 256, 700), (128, 128, 130), (128, 128, 1), (128, 256, 700)):
        t = _cpu_operands(Sq=Sq, q_rows=rows)["q"]
        te = m._tile_exps(t, Sq, bm)
        # every tile up to Sq, possibly a few more of the last group (never read); the kernel's unit strides
        assert te.shape[0] == 1 and te.shape[2:] == (4, 1) and -(-Sq // bm) <= te.shape[1] < -(-Sq // bm) + rows // bm
        assert te.is_contiguous()
        for i in range(te.shape[1]):
            assert torch.equal(te[:, i], t.exp[:, (i * bm) // rows])
    assert torch.equal(m._tile_exps(_cpu_operands()["q"], 130), m._tile_exps(_cpu_operands()["q"], 130, 64))


def _tma_box(desc, row: int, col: int) -> torch.Tensor:
    """What TMA loads for a 2-D descriptor's box at (row, col): elements inside ``desc.shape`` read at ``base +
    row * strides[0] + col`` (the descriptor's own view of the memory), the rest zero fill."""
    (rows, cols), (pitch, unit), (br, bc) = desc.shape, desc.strides, desc.block_shape
    assert unit == 1
    flat = desc.base.as_strided((desc.base.untyped_storage().nbytes() // desc.base.element_size(),), (1,), 0)
    out = torch.zeros(br, bc, dtype=desc.base.dtype)
    off = desc.base.storage_offset()
    for r in range(br):
        for c in range(bc):
            if row + r < rows and col + c < cols:
                out[r, c] = flat[off + (row + r) * pitch + col + c]
    return out


def _vectors(B, H, S, pitch=None, offset=0, gen=None):
    """A (B, H, S) fp32 tensor with -inf rows sprinkled in, as a view of a buffer of row pitch ``pitch`` starting
    ``offset`` elements in (a slice such as the ring's per-call lse would be)."""
    pitch = pitch or S
    buf = torch.randn(B * H * pitch + offset + 8, generator=gen)
    t = buf[offset: offset + B * H * pitch].view(B, H, pitch)[:, :, :S]
    t[..., ::7] = float("-inf")
    return t


def test_lse_delta_rows_in_place_or_padded():
    """``_vector_rows``: lse / δ used in place when TMA can address them (B*H rows of one 16-byte-multiple pitch,
    16-byte aligned base), else copied into rows padded to a multiple of 4 elements, values equal."""
    m = _mod()
    g = torch.Generator().manual_seed(1)
    in_place = [
        _vectors(2, 3, 128, gen=g),  # contiguous, S a multiple of 4: the forward's lse at training shapes
        _vectors(2, 3, 130, pitch=132, gen=g),  # a slice of a wider buffer, pitch a multiple of 4
        _vectors(2, 3, 61, pitch=64, offset=4, gen=g),  # ... starting 16 bytes in
        _vectors(1, 1, 5, gen=g),  # one row: any pitch
        _vectors(3, 1, 8, gen=g),  # one head: the batch stride is the pitch
    ]
    copied = [
        _vectors(2, 3, 130, gen=g),  # contiguous, S not a multiple of 4
        _vectors(1, 4, 1, gen=g),  # Sq = 1
        _vectors(2, 3, 64, pitch=64, offset=1, gen=g),  # base not 16-byte aligned
        _vectors(2, 3, 64, pitch=66, gen=g),  # pitch of 264 bytes
        torch.randn(2, 64, 3, generator=g).transpose(1, 2),  # strided along the sequence
        torch.randn(2, 1, 64, generator=g).expand(2, 3, 64),  # heads broadcast (stride 0)
        torch.randn(3, 2, 64, generator=g).transpose(0, 1),  # heads outside batches: no single pitch
    ]
    for t, kept in [(t, True) for t in in_place] + [(t, False) for t in copied]:
        B, H, S = t.shape
        got, pitch = m._vector_rows(t)
        assert got.shape == (B, H, S) and pitch % 4 == 0 and pitch >= S and got.data_ptr() % 16 == 0
        assert torch.equal(got, t)
        if kept:
            assert got is t, tuple(t.stride())
        else:
            assert got.data_ptr() != t.data_ptr() and got.stride() == (H * pitch, pitch, 1), tuple(t.stride())
            assert pitch == -(-S // 4) * 4


@pytest.mark.parametrize("bm,S", [(64, S) for S in (1, 63, 64, 130, 200)]
                         + [(128, S) for S in (1, 127, 128, 130, 256, 300)], ids=str)
def test_lse_delta_descriptor_boxes_match_masked_loads(bm, S):
    """The producer's box for (batch b, head h, query tile at m0), read through ``_vector_descriptors`` with TMA's
    zero fill, and the consumer's rule give, bit for bit, what the masked loads of the kernel before session 7 gave:
    lse[b, h, m0 + c] (−inf past Sq) and δ[b, h, m0 + c] (0.0 past Sq).  64-query steps: the consumer makes lse
    −inf past Sq (its query-row mask).  128-query steps have no such mask, so their lse boxes must read −inf past
    Sq by themselves: ``_vector_descriptors(..., 128)`` gives lse rows padded with −inf to a multiple of 128 columns
    (a copy, only when Sq % 128 != 0; else lse in place, and no box reaches past Sq)."""
    m = _mod()
    g = torch.Generator().manual_seed(S)
    B, H = 2, 3
    lse, delta = _vectors(B, H, S, gen=g), _vectors(B, H, S, pitch=-(-S // 4) * 4 + 4, gen=g)
    lse_desc, dl_desc = m._vector_descriptors(lse, delta, bm)
    lse_cols = S if bm == m.BLOCK_M_DEFAULT else -(-S // bm) * bm
    for d, cols in ((lse_desc, lse_cols), (dl_desc, S)):
        assert list(d.shape) == [B * H, cols] and list(d.block_shape) == [1, bm]
        assert d.strides[0] % 4 == 0 and d.strides[1] == 1 and d.layout.swizzle_byte_width == 0
    if S % bm == 0 and S % 4 == 0:
        assert lse_desc.base is lse
    for b in range(B):
        for h in range(H):
            for m0 in range(0, S, bm):
                cols = m0 + torch.arange(bm)
                row_ok = cols < S
                idx = cols.clamp(max=S - 1)
                want_lse = torch.where(row_ok, lse[b, h, idx], float("-inf"))
                want_dl = torch.where(row_ok, delta[b, h, idx], 0.0)
                got_lse = _tma_box(lse_desc, b * H + h, m0)[0]
                if bm == m.BLOCK_M_DEFAULT:  # the consumer's mask
                    got_lse = torch.where(row_ok, got_lse, float("-inf"))
                got_dl = _tma_box(dl_desc, b * H + h, m0)[0]
                assert torch.equal(got_lse.view(torch.int32), want_lse.view(torch.int32))
                assert torch.equal(got_dl.view(torch.int32), want_dl.view(torch.int32))


@pytest.mark.slow
def test_compiles_for_sm90_without_gpu():
    """Where triton 3.6 is installed (the GPU machine), the d128 causal and d64 kernels compile for sm_90a with the
    checks of ``scripts/compile_check_bwd_dkdv_gluon.py`` (spills within the documented allowance, e4m3 k32
    wgmma, no ptxas serialization, at most 3 DEPBAR per step, and on a common step's path at most 2 named barriers
    with ``ds_exp="key"``, 4 with "tile").  The script runs in a subprocess without TRITON_INTERPRET: conftest sets
    it on machines without CUDA, and under it ``gl.max``'s combine function is an interpreter object that Gluon
    cannot compile (in-process, the check passed only where triton's cache already held the kernel)."""
    for args in (["--only", "d128_causal,d64", "--ds-exp=key"],
                 ["--split", "--only", "d128,d128_causal", "--ds-exp=key"],
                 ["--split", "--only", "d128_causal", "--ds-exp=tile"], ["--only", "d64_causal", "--ds-exp=tile"]):
        r = _compile_check(args)
        assert r.returncode == 0 and "all variants OK" in r.stdout, (args, r.stdout[-4000:], r.stderr[-2000:])


def _compile_check(args):
    """``scripts/compile_check_bwd_dkdv_gluon.py args`` in a subprocess without TRITON_INTERPRET (a skip off triton
    3.6); the CompletedProcess."""
    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    _mod()
    import subprocess

    root = os.path.dirname(_HERE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_check_bwd_dkdv_gluon.py"), *args],
                          capture_output=True, text=True, env=env, cwd=root)


@pytest.mark.slow
def test_compiles_for_sm90_without_gpu_block_m128():
    """Where triton 3.6 is installed, the 128-query builds (``GluonDkdvConfig(block_m=128)``, d64, undeferred)
    compile for sm_90a with the checks of ``scripts/compile_check_bwd_dkdv_gluon.py --block-m 128``: the per-key rule
    split and whole-tile, causal and not, the tile rule split, each within the script's documented in-loop
    allowances (that script writes every int argument as a plain i32; since session 23 it compiles the launch's
    Q_PERM, and its d64 causal builds keep a few reloads in their loops where the launched build, with its
    specialized ints, has none: ``scripts/compile_launched.py dkdv --shape 2,8192,16,16,64 --causal``);
    m64n128k32 Sᵀ / dPᵀ wgmma.  A d128 build is refused (compile error, exit status 1), as the launcher refuses it.
    Subprocesses without TRITON_INTERPRET, as above."""
    for args in (["--split", "--block-m", "128", "--ds-exp=key"], ["--block-m", "128", "--ds-exp=key"],
                 ["--split", "--block-m", "128", "--ds-exp=tile"]):
        r = _compile_check(args)
        assert r.returncode == 0 and "all variants OK" in r.stdout, (args, r.stdout[-4000:], r.stderr[-2000:])
        assert r.stdout.count("== d64") == 2 and "m64n128k32.f32.e4m3.e4m3" in r.stdout, (args, r.stdout[-4000:])
    r = _compile_check(["--block-m", "128", "--only", "d128"])
    assert r.returncode == 1 and "head dim 64" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.slow
def test_compiles_for_sm90_without_gpu_fused_dq():
    """Where triton 3.6 is installed, the fused-dQ builds (``--split --block-m 128 --fuse-dq``, d64 causal and not)
    compile for sm_90a within that script's fused-dQ rules (named barriers, DEPBARs, the causal build's documented
    in-loop reload), with the sixth wgmma (m64n64k32, A from shared memory)."""
    r = _compile_check(["--split", "--block-m", "128", "--fuse-dq"])
    assert r.returncode == 0 and "all variants OK" in r.stdout, (r.stdout[-4000:], r.stderr[-2000:])
    assert r.stdout.count("== d64") == 2, r.stdout[-4000:]


RING = ("q", "do", "lse", "dl", "qs", "dos")  # the six loads of a query step, all on the stage's ready barrier


def _protocol_model(n_steps: int, stages: int, rng: random.Random, mutant: str = "", consumers: int = 1,
                    defer: bool = True):
    """Run the kernel's protocol (``_producer_steps`` and ``_consumer``'s loop; ``consumers=2``: the split kernel,
    two warpgroup partitions on one ring, empty barriers counting two arrivals) under a random interleaving
    (``conftest.SharedTilesModel``); returns the log of reads.  Reads: wgmma (Q, dO, Q_seq, dO_seq) and the
    consumers' shared-memory loads of lse and δ.  ``defer`` (DEFER_DK, the default build): dK_{j-1}'s product reads
    Q_seq of stage j-1 in step j (step 0: stage 0's tile 0 with dS = 0, a logged read), stage j-1 is released at
    step j's end, the last step's dK product after the loop; else the undeferred step (release at its own end)."""
    S = stages
    empty_count = 1 if mutant == "split_empty_count_1" else consumers
    ready = [MBarrierModel(1) for _ in range(S)]
    empty = [MBarrierModel(empty_count) for _ in range(S)]
    kv_bar = MBarrierModel(1)
    smem = SharedTilesModel([(r, s) for r in RING for s in range(S)] + [("kv", 0)])

    def producer():
        kv_bar.expect_arrive(2 * consumers)  # K and V_hdim, once (a 64-key tile of each per warpgroup when split)
        for _ in range(2 * consumers):
            smem.tma(("kv", 0), 0, kv_bar)
        for i in range(n_steps):
            s = i % S
            if mutant != "no_empty_wait":
                yield ("wait", empty[s], ((i // S) & 1) ^ 1)
            ready[s].expect_arrive(len(RING))
            for r in RING:
                smem.tma((r, s), i, ready[s])

    def consumer():
        yield ("wait", kv_bar, 0)
        assert smem.content[("kv", 0)] == 0
        for j in range(n_steps):
            st, ph = j % S, (j // S) & 1
            yield ("wait", ready[st], ((j + 1) // S) & 1 if mutant == "ready_parity" else ph)
            smem.start_read(("lse", st), j)  # lse_j to registers
            smem.done_read(("lse", st))
            smem.start_read(("q", st), j)  # Sᵀ_j, dPᵀ_j issued
            smem.start_read(("do", st), j)
            if defer:
                jp = max(j - 1, 0)
                sp = jp % S
                smem.start_read(("qs", sp), jp)  # dK_{j-1} issued behind them (step 0: zeros on tile 0)
                if mutant == "release_before_dk_wait" and j > 0:
                    empty[sp].arrive()
            yield ("step",)  # wait: Sᵀ_j
            smem.start_read(("dl", st), j)  # δ_j to registers
            smem.done_read(("dl", st))
            yield ("step",)  # wait: dPᵀ_j
            if mutant == "early_release" and not defer:  # the old Q/dO release point, Q_seq / dO_seq still read
                empty[st].arrive()
            smem.start_read(("dos", st), j)  # dV_j issued (undeferred: then dK_j)
            yield ("step",)
            if not defer:
                smem.start_read(("qs", st), j)
                yield ("step",)
            # wait(0): everything issued in this step
            for r in ("q", "do", "dos") if defer else ("q", "do", "qs", "dos"):
                smem.done_read((r, st))
            if defer:
                smem.done_read(("qs", sp))
                if mutant == "early_release":  # the undeferred release point: stage j, whose Q_seq dK_j still reads
                    empty[st].arrive()
                elif j > 0 and mutant != "release_before_dk_wait":
                    empty[sp].arrive()  # stage j-1: its Q_seq was dK_{j-1}'s last read
            elif mutant != "early_release":
                empty[st].arrive()
        if defer and n_steps > 0 and mutant != "no_flush":  # the last step's dK after the loop
            sp = (n_steps - 1) % S
            smem.start_read(("qs", sp), n_steps - 1)
            yield ("step",)
            smem.done_read(("qs", sp))
            empty[sp].arrive()

    return smem.run({"producer": producer(), **{f"consumer{c}": consumer() for c in range(consumers)}}, rng)


def _expected_reads(buf: str, n_steps: int, consumers: int, defer: bool) -> list:
    """Tiles each buffer is read with: every step's once per consumer; deferred, Q_seq's tile 0 once more (step 0's
    product of zeros)."""
    extra = [0] if defer and buf == "qs" and n_steps > 0 else []
    return sorted((list(range(n_steps)) + extra) * consumers)


@pytest.mark.parametrize("defer", [True, False], ids=["defer", "nodefer"])
@pytest.mark.parametrize("consumers", [1, 2], ids=["whole", "split"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_barrier_protocol_model(stages, consumers, defer, seed):
    """The protocol the kernel is built with: DEFER_DK where ``GluonDkdvConfig.defers_dk`` (stages >= 2)."""
    m = _mod()
    defer = m.GluonDkdvConfig(stages=stages, defer_dk=defer).defers_dk
    rng = random.Random(seed)
    for n_steps in (0, 1, 2, 3, stages, stages + 1, 2 * stages + 3, 17):
        for _ in range(30):
            log = _protocol_model(n_steps, stages, rng, consumers=consumers, defer=defer)
            for buf in RING:
                reads = [t for kind, b, t in log if b[0] == buf]
                assert sorted(reads) == _expected_reads(buf, n_steps, consumers, defer), buf


def test_deferred_dk_needs_two_stages(seed):
    """Why ``defers_dk`` is False with one stage: the deferred release of stage j-1 at step j's end deadlocks a
    one-stage ring (the producer waits for step j's release before loading tile j + 1, which step j + 1 needs
    first).  The model finds the deadlock; the config does not defer."""
    m = _mod()
    assert not m.GluonDkdvConfig(stages=1).defers_dk and m.GluonDkdvConfig(stages=2).defers_dk
    assert m.GluonDkdvConfig().defers_dk and m.GluonDkdvConfig().stages == 3
    with pytest.raises(AssertionError, match="deadlock"):
        _protocol_model(3, 1, random.Random(seed), defer=True)


@pytest.mark.parametrize("mutant,consumers,defer",
                         [("no_empty_wait", 1, True), ("ready_parity", 1, True), ("early_release", 1, True),
                          ("release_before_dk_wait", 1, True), ("no_empty_wait", 2, True),
                          ("early_release", 2, True), ("release_before_dk_wait", 2, True),
                          ("split_empty_count_1", 2, True),
                          ("no_empty_wait", 1, False), ("ready_parity", 1, False), ("early_release", 1, False),
                          ("early_release", 2, False), ("split_empty_count_1", 2, False)])
def test_barrier_protocol_model_catches_mutants(mutant, consumers, defer, seed):
    """The model is not vacuous: a producer that does not wait for the stage's release, a consumer waiting with
    the wrong parity, a release before Q_seq / dO_seq were read (deferred: stage j released at step j's end, where
    the undeferred kernel releases it, while dK_j still reads its Q_seq in step j + 1; or stage j-1 released as
    soon as dK_{j-1} is issued; undeferred: where the two-ring kernel released Q / dO), or (split) empty barriers
    counting one arrival for two warpgroups, is caught (deadlock, a TMA into a buffer being read, a wrong tile, or
    too many arrivals)."""
    rng = random.Random(seed)
    with pytest.raises(AssertionError):
        for _ in range(200):
            _protocol_model(9, 2, rng, mutant, consumers=consumers, defer=defer)


def test_barrier_protocol_model_flush_reads_last_tile(seed):
    """Without the flush after the loop the last step's Q_seq is never read by a dK product (the read check of
    ``test_barrier_protocol_model`` catches that)."""
    log = _protocol_model(5, 3, random.Random(seed), "no_flush", defer=True)
    reads = [t for kind, b, t in log if b[0] == "qs"]
    assert sorted(reads) != _expected_reads("qs", 5, 1, True)


# ---------------------------------------------------------------------------------------------------- GPU
def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (1, 1, 1, 2, 2, 128, True),
    (1, 1, 77, 2, 2, 64, False),  # Sq = 1 with no GQA: the launch that triton 3.6 cannot lower when Sq is specialized
    (1, 1, 1, 1, 1, 64, False),  # the sanitizer's shape that found it (Hq = Hkv = Sk = 1 specialized too)
    (2, 113, 203, 4, 4, 128, False),
    (2, 113, 203, 4, 2, 64, True),
    (1, 1023, 1024, 4, 4, 128, True),
    (1, 1023, 1024, 4, 4, 64, False),
    (1, 300, 3000, 2, 2, 128, True),  # Sq < Sk, bottom-right
    (1, 3000, 300, 2, 2, 128, True),  # Sq > Sk
    (1, 300, 3000, 2, 2, 64, False),
    (2, 1000, 1000, 16, 2, 128, True),  # GQA 8:1: the head loop and its per-channel rescale
    (2, 1000, 1000, 16, 2, 64, False),
    (3, 129, 257, 2, 1, 128, False),  # MQA; 64-row / 128-key boundaries, TMA rows into the next batch
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + ("c" if c[6] else "")


def _gpu_inputs(case, seed):
    B, Sq, Sk, Hq, Hkv, D, causal = case
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)


def _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal, grad_dtype=torch.bfloat16, config=None):
    """dk, dv of ``attn_bwd_hopper``'s tl path (deterministic) with the tl twin of the Gluon build ``config``
    (``tl_twin_config``; the default build's when None)."""
    from mxattn.kernels.attn_bwd import attn_bwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton as rs

    # an explicit config keeps attn_bwd_hopper on the tl kernels (without one it takes the Gluon kernels on Hopper)
    _, dk, dv = attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], rs(k, "v"), out, dout, ops["lse"],
                                causal=causal, deterministic=True, grad_dtype=grad_dtype,
                                dout_hdim=ops["dout_hdim"], dout_seq=ops["dout_seq"],
                                config=_mod().tl_twin_config(config))
    return dk, dv


def _assert_agree(got, want, name):
    assert_same_up_to_summation_order(got, want, name)


def _check_against_twin(case, cfg, seed):
    m = _mod()
    causal = case[6]
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, out = m.dkdv_operands(q, k, v, dout, causal)
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=cfg)
    torch.cuda.synchronize()
    name = f"{_case_id(case)} split={cfg.split} ds_exp={cfg.ds_exp} block_m={cfg.block_m}"
    if cfg.split:
        want_dk, want_dv = m._tl_dkdv(**ops, causal=causal, tl_config=m.tl_twin_config(cfg))
    else:
        want_dk, want_dv = _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal, config=cfg)
        # the tl dK/dV kernel launched alone (the bench's baseline) is the same kernel as attn_bwd_hopper's
        tdk, tdv = m._tl_dkdv(**ops, causal=causal, tl_config=m.tl_twin_config(cfg))
        assert torch.equal(tdk.view(torch.int16), want_dk.view(torch.int16))
        assert torch.equal(tdv.view(torch.int16), want_dv.view(torch.int16))
    _assert_agree(dk, want_dk, name + " dk")
    _assert_agree(dv, want_dv, name + " dv")
    # keys where the tl result is exactly zero in every channel (no query sees them, or P = 0 throughout) are
    # exactly zero here too
    assert (dv[(want_dv == 0).all(dim=-1)] == 0).all() and (dk[(want_dk == 0).all(dim=-1)] == 0).all()


# two tiny cases first: a barrier or layout bug of the per-key exponent build shows as a hang (a short timeout) or a
# mismatch before the long list runs
TINY_CASES = [(1, 1, 1, 2, 2, 128, True), (1, 70, 130, 2, 1, 64, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", TINY_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_key_exp_tiny(case, split, seed):
    """``ds_exp="key"`` (one dS exponent per key and query tile) against its tl twin (``BwdConfig(
    ds_tile_scale=False)``, 64- or 128-key blocks) on two tiny shapes: equal up to fp32 summation order."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    _check_against_twin(case, _mod().GluonDkdvConfig(split=split, ds_exp="key"), seed)


@pytest.mark.gpu
@pytest.mark.parametrize("ds_exp", ["key", "tile"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_matches_tl(case, split, ds_exp, seed):
    """Against the tl dK/dV kernel on the same operands, equal up to fp32 summation order (the same P and dS
    bits); keys no query sees exactly 0.  ``split`` (``GluonDkdvConfig(split=True)``: two 4-warp consumer
    partitions of 64 keys) against the tl kernel with 64-key blocks; ``ds_exp`` "tile" (dS exponent per keys x 64
    queries tile, with hysteresis) against the tl kernel's ``ds_tile_scale=True``, "key" (per key and query tile)
    against ``ds_tile_scale=False`` (``tl_twin_config``)."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    _check_against_twin(case, _mod().GluonDkdvConfig(split=split, ds_exp=ds_exp), seed)


# the 128-query step (GluonDkdvConfig(block_m=128), d64 only, session 9): 2 tiny + 8 key + 4 tile cases.  Sq = 1000
# and 300 are not multiples of 128 (the launcher's −inf-padded lse rows stand in for the consumer's query-row mask),
# 1024 is (lse used in place); GQA 8:1 (the head loop and its rescales at 128-query steps); Sq < Sk bottom-right
# causal (lo / mid in steps of 128); MQA with 64- / 128-row boundaries for the tile rule
BM128_TINY = [(1, 70, 130, 2, 1, 64, True)]
BM128_KEY_CASES = [
    (2, 1000, 1000, 16, 2, 64, True),
    (2, 1000, 1000, 16, 2, 64, False),
    (1, 300, 3000, 2, 2, 64, True),
    (1, 1024, 1024, 4, 4, 64, False),
    (1, 1000, 300, 4, 2, 64, True),  # causal Sq > Sk: query rows that see no key (lse -inf inside Sq)
]
BM128_TILE_CASES = [(2, 1000, 1000, 16, 2, 64, True), (3, 129, 257, 2, 1, 64, False)]
# (case, ds_exp, tiny): the tiny case first (-k "bm128 and tiny": a barrier or layout bug shows as a hang or a
# mismatch there, under a short timeout), then the rest (-k "bm128 and not tiny")
BM128_CASES = ([(c, "key", True) for c in BM128_TINY] + [(c, "key", False) for c in BM128_KEY_CASES]
               + [(c, "tile", False) for c in BM128_TILE_CASES])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("case,ds_exp,tiny", BM128_CASES,
                         ids=[f"{'tiny-' if t else ''}{_case_id(c)}-{e}" for c, e, t in BM128_CASES])
def test_attn_bwd_dkdv_gluon_bm128_matches_tl(case, ds_exp, tiny, split, seed):
    """The 128-query build (``block_m=128``) against the tl kernel with BLOCK_M = 128 (``tl_twin_config``), per-key
    dS rule (the default rule) or tile rule (one exponent per keys x 128 queries, with hysteresis): equal up to fp32
    summation order; keys no query sees exactly 0."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    _check_against_twin(case, _mod().GluonDkdvConfig(split=split, ds_exp=ds_exp, block_m=128), seed)


# fused dQ (GluonDkdvConfig(fuse_dq=True), d64 128-query steps, session 13): the tiny case first (a barrier bug of
# the dS staging shows as a hang there), then GQA 8:1 both masks, Sq < Sk and Sq > Sk causal (rows that see no key),
# MQA across 64- / 128-row boundaries, one query row
FUSED_DQ_CASES = [(1, 70, 130, 2, 1, 64, True), (2, 1000, 1000, 16, 2, 64, True), (2, 1000, 1000, 16, 2, 64, False),
                  (1, 300, 3000, 2, 2, 64, True), (1, 1000, 300, 4, 2, 64, True), (3, 129, 257, 2, 1, 64, False),
                  (1, 1, 77, 2, 2, 64, False)]


def _fp64_dq(ops, causal: bool, scale: float) -> torch.Tensor:
    """fp64 dQ of softmax attention on the dequantized FP8 operands (q, k, v_hdim, and dO from dout_hdim): the
    truth both dQ paths are measured against."""
    q = ops["q"].dequantize(torch.float64).requires_grad_()
    k, v, do = (ops[n].dequantize(torch.float64) for n in ("k", "v_hdim", "dout_hdim"))
    Sq, Hq, Sk, Hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:  # bottom-right: query i sees key j iff j <= i + Sk - Sq
        keep = torch.arange(Sk, device=q.device)[None, :] <= torch.arange(Sq, device=q.device)[:, None] + Sk - Sq
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: zero output, zero gradient
    return torch.autograd.grad(torch.einsum("bhqk,bkhd->bqhd", p, v), q, do)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_DQ_CASES, ids=[("tiny-" if i == 0 else "") + _case_id(c)
                                                      for i, c in enumerate(FUSED_DQ_CASES)])
def test_attn_bwd_dkdv_gluon_fused_dq(case, seed):
    """``attn_bwd_dkdv_dq_gluon`` (dQ formed in the dK/dV kernel, added with atomics): dk and dv equal the 128-query
    split build's up to fp32 summation order (the same code for them); dq is as accurate as the dQ kernel's against
    fp64 gradients on the same FP8 operands (SQNR at most 0.5 dB lower), never NaN, and 0 in rows that see no key;
    the public backward under MXATTN_BWD_FUSED_DQ=1 returns the launcher's gradients."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    from mxattn.kernels.attn_bwd import attn_bwd_hopper
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon
    from mxattn.kernels.quantize import row_scaled_triton as rs
    from mxattn.reference import sqnr_db

    m = _mod()
    causal = case[6]
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, out = m.dkdv_operands(q, k, v, dout, causal)
    k_seq = rs(k, "v")
    dq, dk, dv = m.attn_bwd_dkdv_dq_gluon(**ops, k_seq=k_seq, causal=causal)
    dk0, dv0 = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(split=True, block_m=128))
    dq0 = attn_bwd_dq_gluon(ops["q"], ops["k"], ops["v_hdim"], k_seq, ops["dout_hdim"], ops["lse"], ops["delta"],
                            causal=causal, config=GluonDqConfig(split=True, block_n=128))
    torch.cuda.synchronize()
    name = _case_id(case)
    _assert_agree(dk, dk0, name + " dk")
    _assert_agree(dv, dv0, name + " dv")
    assert not torch.isnan(dq).any(), name
    truth = _fp64_dq(ops, causal, case[5] ** -0.5)
    got, want = sqnr_db(dq.double(), truth), sqnr_db(dq0.double(), truth)
    print(f"{name}: dq SQNR fused {got:.2f} dB, dQ kernel {want:.2f} dB")
    assert got >= want - 0.5, f"{name}: fused dq {got:.2f} dB against the dQ kernel's {want:.2f} dB"
    assert (dq[(dq0 == 0).all(dim=-1)] == 0).all(), name  # query rows with no gradient (they see no key)
    os.environ["MXATTN_BWD_FUSED_DQ"] = "1"
    try:
        pq, pk, pv = attn_bwd_hopper(ops["q"], ops["k"], ops["v_hdim"], ops["q_seq"], k_seq, out, dout, ops["lse"],
                                     causal=causal, dout_hdim=ops["dout_hdim"], dout_seq=ops["dout_seq"])
    finally:
        del os.environ["MXATTN_BWD_FUSED_DQ"]
    _assert_agree(pk, dk, name + " public dk")
    _assert_agree(pv, dv, name + " public dv")
    assert sqnr_db(pq.double(), dq.double()) > 30, name  # the same kernel; only the atomics' order differs


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_attn_bwd_dkdv_gluon_key_exp_keeps_small_keys(split, causal, seed):
    """The input on which the two dS rules differ (on ordinary inputs they agree to ~0.01 dB, so the twin tests
    alone would not tell a key build that fell back to one exponent per tile): odd keys score ~14 below even keys
    (P ~2^-20), so with one exponent per tile their dSᵀ flush under e4m3's subnormals.  The key build agrees with its
    tl twin on the odd keys' dK rows alone; the tile build's odd rows are ~0 against them."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 1, 512, 2, 128
    q = torch.randn(B, S, H, D, generator=g).abs() + 1.0
    sign = torch.where(torch.arange(S) % 2 == 0, 1.0, -1.0).view(1, S, 1, 1)
    k = 0.5 * sign + 0.1 * torch.randn(B, S, H, D, generator=g)
    v, dout = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    q, k, v, dout = (t.to("cuda", torch.bfloat16) for t in (q, k, v, dout))
    ops, _ = m.dkdv_operands(q, k, v, dout, causal)
    key = m.GluonDkdvConfig(split=split, ds_exp="key")
    dk, _ = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=key)
    want, _ = m._tl_dkdv(**ops, causal=causal, tl_config=m.tl_twin_config(key))
    dk_tile, _ = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(split=split, ds_exp="tile"))
    torch.cuda.synchronize()
    _assert_agree(dk, want, f"small keys split={split} dk")
    small, small_want = dk[:, 1::2].contiguous(), want[:, 1::2].contiguous()
    _assert_agree(small, small_want, f"small keys split={split} dk, odd rows")
    assert small_want.float().norm() > 0
    assert dk_tile[:, 1::2].float().norm() < 1e-3 * small_want.float().norm()


@pytest.mark.gpu
def test_attn_bwd_dkdv_gluon_unseen_keys_zero(seed):
    """Keys that no query sees get dk = dv = 0 exactly: every query row empty (lse = −inf, as the forward returns
    for rows that see nothing).  (Bottom-right causal with Sq >= 1 lets the last query see every key.)"""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    case = (1, 200, 500, 2, 1, 128, True)
    q, k, v, dout = _gpu_inputs(case, seed)
    ops, _ = m.dkdv_operands(q, k, v, dout, True)
    ops["lse"] = torch.full_like(ops["lse"], float("-inf"))
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=True)
    assert dk.abs().max().item() == 0.0 and dv.abs().max().item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(stages=1), dict(stages=3), dict(stages=4), dict(defer_dk=False),
                                     dict(stages=1, ds_exp="tile"), dict(defer_dk=False, ds_exp="tile"),
                                     dict(split=True, defer_dk=False), dict(split=True, stages=2)], ids=str)
def test_attn_bwd_dkdv_gluon_configs(variant, seed):
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    for D, causal in ((128, True), (64, False)):
        case = (1, 700, 1200, 4, 2, D, causal)
        q, k, v, dout = _gpu_inputs(case, seed + D)
        ops, out = m.dkdv_operands(q, k, v, dout, causal)
        cfg = m.GluonDkdvConfig(**variant)
        dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=cfg)
        if cfg.split:
            want_dk, want_dv = m._tl_dkdv(**ops, causal=causal, tl_config=m.tl_twin_config(cfg))
        else:
            want_dk, want_dv = _tl_deterministic_dkdv(q, k, v, dout, ops, out, causal, config=cfg)
        _assert_agree(dk, want_dk, f"{variant} d{D} dk")
        _assert_agree(dv, want_dv, f"{variant} d{D} dv")


@pytest.mark.gpu
@pytest.mark.parametrize("ds_exp", ["key", "tile"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_attn_bwd_dkdv_gluon_exponent_moves(split, ds_exp, seed):
    """dS magnitudes that change by many binades along the queries: the exponent leaves the hysteresis window
    ("tile") or moves every step ("key") and the dK accumulator is rescaled (both ways; per row with "key");
    grad dtype passed through."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    cfg = m.GluonDkdvConfig(split=split, ds_exp=ds_exp)
    case = (1, 2048, 256, 2, 2, 128, False)
    q, k, v, dout = _gpu_inputs(case, seed)
    ramp = torch.logspace(-6, 3, 2048, base=2.0, device="cuda").view(1, -1, 1, 1)
    dout = (dout.float() * ramp.flip(1) * ramp.roll(700, 1)).to(torch.bfloat16)
    ops, out = m.dkdv_operands(q, k, v, dout, False)
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, grad_dtype=torch.float32, config=cfg)
    want_dk, want_dv = m._tl_dkdv(**ops, grad_dtype=torch.float32, tl_config=m.tl_twin_config(cfg))
    _assert_agree(dk, want_dk, "exponent moves dk")
    _assert_agree(dv, want_dv, "exponent moves dv")


@pytest.mark.gpu
def test_bench_attn_bwd_dkdv_gluon():
    """Prints Gluon vs tl dK/dV kernel time at B2 H16 S8k d128 (causal and not); asserts only that both ran."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    rows = m.bench_attn_bwd_dkdv_gluon(rep_ms=100)
    for r in rows:
        print(f"\nbench dK/dV B{r['B']} H{r['Hq']}/{r['Hkv']} S{r['S']} d{r['D']} causal={r['causal']}: "
              f"gluon {r.get('gluon_ms', float('nan')):.3f} ms ({r.get('gluon_tflops', 0):.0f} TFLOP/s), "
              f"tl {r.get('tl_ms', float('nan')):.3f} ms ({r.get('tl_tflops', 0):.0f} TFLOP/s), "
              f"speedup {r.get('speedup', float('nan')):.2f}x {r.get('gluon_error', '')}")
    assert all(r.get("gluon_ms") and r.get("tl_ms") for r in rows), rows


@pytest.mark.gpu
def test_bench_attn_bwd_dkdv_gluon_split():
    """Prints the split kernel's time against its tl twin (64-key blocks) and the unsplit Gluon kernel's, B2 H16
    S8k d128; asserts only that all ran."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    split = m.bench_attn_bwd_dkdv_gluon(rep_ms=100, config=m.GluonDkdvConfig(split=True))
    whole = m.bench_attn_bwd_dkdv_gluon(rep_ms=100)
    for r, w in zip(split, whole):
        print(f"\nbench dK/dV split, causal={r['causal']}: split {r.get('gluon_ms', float('nan')):.3f} ms, "
              f"unsplit {w.get('gluon_ms', float('nan')):.3f} ms, tl 64-key {r.get('tl_ms', float('nan')):.3f} ms "
              f"{r.get('gluon_error', '')}")
    assert all(r.get("gluon_ms") for r in split + whole), split + whole


def _recorded_launches(monkeypatch, call, n=3):
    """``call()`` n times with every launch recorded instead of run (CPU: the host side of the launcher only)."""
    from mxattn.kernels import launch as L

    seen = []
    monkeypatch.setattr(L.FastLauncher, "launch", lambda self, grid, args, kwargs: seen.append((grid, args, kwargs)))
    for _ in range(n):
        call()
    return seen


def _same_launch(a, b):
    """Two recorded launches carry the same grid, keywords and arguments: tensors by dtype, shape and strides,
    descriptors by every field but the base tensor (compared the same way)."""
    (ga, aa, ka), (gb, ab, kb) = a, b
    assert ga == gb and ka == kb and len(aa) == len(ab)
    for x, y in zip(aa, ab):
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
        elif hasattr(x, "block_shape"):
            fx, fy = dict(vars(x)), dict(vars(y))
            bx, by = fx.pop("base"), fy.pop("base")
            assert fx == fy and (bx.dtype, bx.shape, bx.stride()) == (by.dtype, by.shape, by.stride())
        else:
            assert x == y


def test_launch_plan_repeats_the_checked_launch(monkeypatch):
    """The second and later calls of one signature take the plan (no checks, descriptors rebased, bound launch):
    what they launch equals the first call's, on their own tensors; another signature makes another plan."""
    m = _mod()
    m._PLANS.clear()
    ops = _cpu_operands()
    seen = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, causal=True))
    assert len(seen) == 3 and len(m._PLANS) == 1
    _same_launch(seen[0], seen[1])
    _same_launch(seen[0], seen[2])
    monkeypatch.setattr(m, "_check", lambda *a: pytest.fail("a plan hit runs no checks"))
    other = _cpu_operands()  # fresh tensors, same signature
    seen2 = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**other, causal=True), n=1)
    _same_launch(seen[0], seen2[0])
    assert seen2[0][1][0].base.data_ptr() == other["q"].data.data_ptr()  # the descriptor reads today's q
    monkeypatch.undo()
    ops_nc = _cpu_operands(Sq=70)
    seen3 = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops_nc), n=1)
    assert len(m._PLANS) == 2 and seen3[0][1][-5] == 70  # Sq among the scalars
    for plan in m._PLANS.values():  # the plans hold no call's tensors (launch.unbased)
        assert all(d.base is None for d in plan[1])


def test_launch_plan_keeps_the_query_step(monkeypatch):
    """block_m is part of a plan (the config is in its key): the 128-query launch gets its own plan, BLOCK_M = 128,
    [1, 128] boxes of the step rows (``_step_rows``: 256 columns for Sq = 130, b = −inf and −δ = 0 past Sq) and one
    q / dO exponent per 128 rows, on the first call and on plan hits alike; the default config's launch keeps
    BLOCK_M = 64."""
    m = _mod()
    m._PLANS.clear()
    ops = _cpu_operands()  # Sq = 130, q and dO grouped by 128 rows, D = 64
    cfg = m.GluonDkdvConfig(split=True, block_m=128)
    seen = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, causal=True, config=cfg))
    _same_launch(seen[0], seen[1])
    _same_launch(seen[0], seen[2])
    grid, args, kw = seen[2]
    assert kw["BLOCK_M"] == 128 and not kw["DEFER_DK"] and kw["SPLIT"]
    lse_desc, dl_desc = args[4], args[5]
    assert list(lse_desc.block_shape) == [1, 128] and list(lse_desc.shape) == [4, 256]
    assert list(dl_desc.block_shape) == [1, 128] and list(dl_desc.shape) == [4, 256]
    assert torch.equal(lse_desc.base[..., 130:], torch.full((1, 4, 126), float("-inf")))
    assert torch.equal(dl_desc.base[..., 130:], torch.zeros(1, 4, 126))
    assert list(args[0].block_shape) == [128, 64] and list(args[2].block_shape) == [64, 128]
    assert torch.equal(args[8], ops["q"].exp.contiguous()) and torch.equal(args[9], ops["dout_hdim"].exp.contiguous())
    seen64 = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, causal=True), n=1)
    assert len(m._PLANS) == 2 and seen64[0][2]["BLOCK_M"] == 64 and seen64[0][1][8].shape[1] == 4


def assert_permuted_box(d, rows: int, pitch: int, box_rows: int, D: int):
    """``d`` is ``attn_fwd_gluon.permuted_rows_descriptor``'s 5-D view of (rows, pitch): 16-row groups, strides
    (16r, 2r, 4r, r, 1), boxes of box_rows rows."""
    assert list(d.shape) == [rows // 16, 2, 4, 2, pitch]
    assert list(d.strides) == [16 * pitch, 2 * pitch, 4 * pitch, pitch, 1]
    assert list(d.block_shape) == [box_rows // 16, 2, 4, 2, D]


def test_query_permuted_boxes(monkeypatch):
    """Host side of ``GluonDkdvConfig.q_perm``: where Sq % 16 == 0 (dense, not fuse_dq) the launch takes Q_PERM with
    Q and dO_hdim through the 5-D query-permuted view (rows by 16-query group, strides (16r, 2r, 4r, r, 1)); with
    Sq % 16 != 0 or ``q_perm=False`` the 2-D boxes and Q_PERM False.  The seq operands' boxes are unchanged."""
    m = _mod()
    for Sq, cfg, want_perm in ((208, m.GluonDkdvConfig(split=True), True),
                               (256, m.GluonDkdvConfig(split=True, block_m=128), True),
                               (208, m.GluonDkdvConfig(split=True, q_perm=False), False),
                               (130, m.GluonDkdvConfig(split=True), False)):
        m._PLANS.clear()
        ops = _cpu_operands(B=2, Sq=Sq)
        (_, args, kw), = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, config=cfg), n=1)
        assert kw["Q_PERM"] is want_perm
        r, bm = 4 * 64, cfg.block_m  # Hq * D
        for d in args[:2]:
            if want_perm:
                assert_permuted_box(d, 2 * Sq, r, bm, 64)
            else:
                assert list(d.shape) == [2 * Sq, r] and list(d.block_shape) == [bm, 64]
        assert list(args[2].block_shape) == [64, bm]  # q_seq


# q_perm against the 2-D boxes (Sq % 16 == 0): causal diagonals, a last query tile past Sq (Sq = 1008, 304: the
# query-row mask on permuted columns), GQA 8:1, MQA with TMA rows into the next batch, Sq > Sk (rows that see no key)
Q_PERM_CASES = [
    (1, 1024, 1024, 4, 4, 128, True),
    (2, 1008, 1000, 16, 2, 128, True),
    (2, 1008, 1000, 16, 2, 64, False),
    (3, 144, 257, 2, 1, 128, False),
    (1, 304, 3000, 2, 2, 64, True),
    (1, 3008, 300, 2, 2, 128, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(split=False), dict(split=True), dict(split=True, ds_exp="tile"),
                                     dict(split=True, block_m=128)], ids=str)
@pytest.mark.parametrize("case", Q_PERM_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_q_perm_bit_identical(case, variant, seed):
    """``q_perm`` (Q and dO_hdim query-permuted; Pᵀ, dSᵀ relabelled into the A operands; lse and δ read in the
    permuted order) against the 2-D boxes on the same operands: the same values in the same wgmma positions and
    the same exponents, so dk and dv are bit-identical."""
    if variant.get("block_m") == 128 and case[5] != 64:
        pytest.skip("block_m=128 is a d64 build")
    _assert_configs_bit_identical(case, seed, dict(variant), dict(variant, q_perm=False))


def _assert_configs_bit_identical(case, seed, config: dict, reference: dict) -> None:
    """The dK/dV launcher with ``GluonDkdvConfig(**config)`` and with ``GluonDkdvConfig(**reference)`` on the same
    operands of ``case``: dk and dv bit for bit (a GPU test's body; skips off sm_90)."""
    if not _is_hopper():
        pytest.skip("the Gluon dK/dV kernel needs an sm_90 GPU")
    m = _mod()
    causal = case[6]
    ops, _ = m.dkdv_operands(*_gpu_inputs(case, seed), causal)
    dk, dv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(**config))
    wk, wv = m.attn_bwd_dkdv_gluon(**ops, causal=causal, config=m.GluonDkdvConfig(**reference))
    assert torch.equal(dk.view(torch.int16), wk.view(torch.int16)), _case_id(case) + " dk"
    assert torch.equal(dv.view(torch.int16), wv.view(torch.int16)), _case_id(case) + " dv"


def test_step_rows_values():
    """``_step_rows`` (what the dense kernel reads per query in place of lse and δ): b = 8 − lse·log2e rounded once
    (the fma the kernel computed), −inf where lse is −inf and past Sq; −δ, and −0 past Sq; columns a multiple of
    128; strided inputs read through their strides.  The CUDA path (a Triton kernel) is compared with this one in
    the GPU test below."""
    m = _mod()
    g = torch.Generator().manual_seed(3)
    lse = torch.randn(2, 3, 200, generator=g) * 30
    lse[0, 1, 7] = float("-inf")
    delta = torch.randn(2, 3, 200, generator=g)
    brow, ndl = m._step_rows(lse.transpose(1, 2).contiguous().transpose(1, 2), delta)
    assert brow.shape == ndl.shape == (2, 3, 256) and brow.is_contiguous()
    c = torch.tensor(1.4426950408889634, dtype=torch.float32).double()
    want = (8.0 - lse.double() * c).float()
    want[0, 1, 7] = float("-inf")
    assert torch.equal(brow[..., :200], want) and torch.equal(ndl[..., :200], -delta)
    assert (brow[..., 200:] == float("-inf")).all() and (ndl[..., 200:] == 0).all()


@pytest.mark.gpu
def test_step_rows_cuda_matches_cpu(seed):
    """The step rows' Triton kernel against the CPU path, bit for bit (fma against float64 rounded once), with
    −inf rows, a length that is not a multiple of 128 and strided lse."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 GPU")
    m = _mod()
    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(2, 5, 1000, generator=g) * 40
    lse[1, :, :300] = float("-inf")
    delta = torch.randn(2, 5, 1000, generator=g)
    lse_cuda = lse.cuda().transpose(1, 2).contiguous().transpose(1, 2)
    got = m._step_rows(lse_cuda, delta.cuda())
    want = m._step_rows(lse, delta)
    for x, y in zip(got, want):
        assert torch.equal(x.cpu().view(torch.int32), y.view(torch.int32))


def test_persistent_launch(monkeypatch):
    """Host side of ``GluonDkdvConfig.persistent``: the persistent kernel on min(SMs, key blocks x B x Hkv) programs
    (132 for the CPU stand-in) with the key blocks per head and the item count after the per-block kernel's scalars;
    refused for the whole-tile, fused-dQ and jagged builds; Sq = 1 keeps the per-block kernel."""
    m = _mod()
    with pytest.raises(ValueError, match="persistent"):
        m.GluonDkdvConfig(persistent=True).check_launch(64)
    with pytest.raises(ValueError, match="persistent"):
        m.GluonDkdvConfig(split=True, persistent=True).check_launch(64, varlen=True)
    for B, Sk, want_grid in ((2, 200, (8,)), (4, 4096, (132,))):
        m._PLANS.clear()
        ops = _cpu_operands(B=B, Sk=Sk)
        cfg = m.GluonDkdvConfig(split=True, persistent=True)
        (grid, args, kw), = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, config=cfg), n=1)
        n_kb = -(-Sk // 128)
        assert grid == want_grid and "SPLIT" not in kw and kw["Q_PERM"] is False  # Sq = 130
        assert list(args[-2:]) == [n_kb, n_kb * B * 2]  # Hkv = 2
    m._PLANS.clear()
    ops = _cpu_operands(Sq=1)
    (grid, _, kw), = _recorded_launches(
        monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, config=m.GluonDkdvConfig(split=True, persistent=True)), n=1)
    assert kw["SPLIT"] and len(grid) == 2


# persistent against the per-block kernel: items with no query step (causal Sq < Sk: key blocks past every query's
# reach have steps; Sq > Sk: rows that see no key), many items per program (B2 H16 S2k d128: 512 items), GQA 8:1
# (the head loop inside an item), d64 128-query steps, a partial last key block
PERSISTENT_CASES = [
    (2, 2048, 2048, 16, 16, 128, True),
    (2, 2048, 2048, 16, 16, 128, False),
    (2, 1000, 1000, 16, 2, 128, True),
    (2, 1000, 1000, 16, 2, 64, False),
    (1, 300, 3000, 2, 2, 128, True),
    (1, 3000, 300, 2, 2, 64, True),
    (3, 129, 257, 2, 1, 128, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_persistent_bit_identical(case, seed):
    """``persistent`` against the per-block kernel on the same operands (the API's split config per head dim): each
    item runs the per-block kernel's code with the ring position carried over, so dk and dv are bit-identical."""
    api = dict(split=True, block_m=128 if case[5] == 64 else 64)
    _assert_configs_bit_identical(case, seed, dict(api, persistent=True), api)


LPT_CASES = [
    # B, Sq, Sk, Hq, Hkv, D, causal
    (2, 4224, 4224, 3, 3, 128, True),  # 33 key blocks, 6 kv heads
    (3, 2560, 2560, 8, 2, 64, True),  # GQA 4:1: 20 blocks, 6 kv heads
    (1, 4096, 3000, 4, 4, 128, True),  # Sq > Sk (bottom-right)
    (1, 1000, 1000, 2, 2, 128, False),  # non-causal: the order is not changed
]


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 4, 45], ids=["sms", "sms4", "sms45"])
@pytest.mark.parametrize("case", LPT_CASES, ids=_case_id)
def test_attn_bwd_dkdv_gluon_causal_lpt_bit_identical(case, sms, seed, monkeypatch):
    """``causal_lpt`` (CTAs over sections of kv heads, heaviest key block first) against head-by-head order: the
    same CTAs on the same tiles, so dk and dv bit for bit (a stand-in SM count of 4 or 45: small sections with a
    remainder)."""
    if sms is not None:
        monkeypatch.setattr(_mod(), "_sm_count", lambda dev: sms)
    monkeypatch.setattr(_mod(), "_PLANS", {})  # (no plan made here outlives the test)
    _assert_configs_bit_identical(case, seed, dict(split=True, causal_lpt=True), dict(split=True, causal_lpt=False))


def test_causal_lpt_auto_rule(monkeypatch):
    """``causal_lpt=None`` follows MXATTN_CAUSAL_LPT (``launch.CAUSAL_LPT``): "auto" turns the order on for the
    64-query build and off for the 128-query one (measured slower), "1" / "0" everywhere / nowhere."""
    from mxattn.kernels import launch

    m = _mod()
    ops = _cpu_operands(D=64)
    for mode, bm, want in (("auto", 64, 264), ("auto", 128, 0), ("1", 128, 264), ("0", 64, 0)):
        monkeypatch.setattr(launch, "CAUSAL_LPT", mode)
        monkeypatch.setattr(m, "_PLANS", {})
        cfg = m.GluonDkdvConfig(split=True, block_m=bm)
        (_, _, kw), = _recorded_launches(monkeypatch, lambda: m.attn_bwd_dkdv_gluon(**ops, causal=True, config=cfg),
                                         n=1)
        assert kw.get("LPT_SECTION", 0) == want, (mode, bm)
