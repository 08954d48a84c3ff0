"""The jagged mode of the Gluon backward kernels (``VARLEN`` in attn_bwd_dq_gluon / attn_bwd_dkdv_gluon, launchers
``attn_bwd_{dq,dkdv}_gluon_varlen``, dispatch in ``attn_bwd.attn_bwd_hopper_varlen``).

CPU: the host side that the kernels rely on — the heaviest-first tile tables (Triton ranking kernel under the
interpreter against its PyTorch twin, and the twin against the definition), the 64-aligned zero-padded seq
operands, the padded δ, the invariant that no 64-wide box of a tile ever leaves its sequence's padded columns, and
the dispatch switch.  GPU (``gpu`` marker; two tiny cases first so that a barrier bug shows as a short timeout):
the Gluon jagged backward against the tl jagged backward with the Gluon kernels' twin tiles, against the dense
Gluon backward run on each sequence alone (bit for bit), against the reference (test_varlen_bwd's bound), and
bitwise over repeats.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import require_kernels
from test_varlen import _cu, _packed, _same_bytes, _seq_slices  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def _tiles():
    from mxattn.kernels import bwd_varlen_tiles

    return bwd_varlen_tiles


def _offsets(lq, lk, device="cpu"):
    """The offset arrays the launchers give the tile table: cu_q, cu_k, q / k exponent groups, the seq operand's
    64-aligned columns (k_seq's for dQ tiles, q_seq's for dK/dV), dout_hdim's groups, the padded δ's columns."""
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN, cu_blocks

    cq, ck = _cu(lq, device), _cu(lk, device)
    col_q = BWD_SEQ_ALIGN * cu_blocks(cq, BWD_SEQ_ALIGN)
    col_k = BWD_SEQ_ALIGN * cu_blocks(ck, BWD_SEQ_ALIGN)
    return cq, ck, cu_blocks(cq, 128), cu_blocks(ck, 128), col_q, col_k


def _table(lq, lk, key_tiles, causal, twin=False, device="cpu"):
    T = _tiles()
    cq, ck, gq, gk, col_q, col_k = _offsets(lq, lk, device)
    fn = T.bwd_tile_slots_torch if twin else T.bwd_tile_slots
    ms = max(lk if key_tiles else lq, default=0)
    return fn(cq, ck, gq, gk, col_q if key_tiles else col_k, gq, col_q, ms, key_tiles, causal)


def _work(lq, lk, b, t0, key_tiles, causal):
    """A tile's loop count as the kernels compute it (written out once more, in plain Python)."""
    sq, sk = lq[b], lk[b]
    if key_tiles:
        m_end = -(-sq // 64) * 64
        lo = min(max(t0 - (sk - sq), 0) // 64 * 64, m_end) if causal else 0
        return (m_end - lo) // 64
    hi = min(sk, max(t0 + 128 + sk - sq, 0)) if causal else sk
    return -(-hi // 64)


LENGTH_SETS = [
    ([0, 1, 31, 33, 127, 129, 4095, 300], None),
    ([5, 0, 33, 70, 1, 2, 700], [9, 4, 0, 40, 129, 1, 300]),
    ([1], None),
    ([0, 0], [3, 0]),
]


@pytest.mark.parametrize("lens", LENGTH_SETS, ids=lambda c: f"{len(c[0])}seq")
@pytest.mark.parametrize("key_tiles", [False, True], ids=["dq", "dkdv"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_table_is_every_tile_heaviest_first(lens, key_tiles, causal):
    """The twin's table: its first rows are exactly the real tiles (every (sequence, 128-block) below the tiled
    side's length, once), in decreasing work with ties by (sequence, tile); each row carries its sequence's offsets;
    every later row is zero (the kernels' exit test 0 >= 0); ``tile_rows_bound`` covers the real rows."""
    T = _tiles()
    lq, lk = lens[0], lens[1] or lens[0]
    table = _table(lq, lk, key_tiles, causal, twin=True)
    cq, ck, gq, gk, col_q, col_k = (c.tolist() for c in _offsets(lq, lk))
    tiled = lk if key_tiles else lq
    want = [(b, t0) for b, n in enumerate(tiled) for t0 in range(0, n, 128)]
    want.sort(key=lambda bt: (-_work(lq, lk, bt[0], bt[1], key_tiles, causal), bt[0], bt[1]))
    n = len(want)
    assert table.shape == (len(lq) * max(1, -(-max(tiled) // 128)), T.SLOT_COLS) and table.dtype == torch.int32
    for r, (b, t0) in enumerate(want):
        col = col_q[b] if key_tiles else col_k[b]
        expect = [b, t0, cq[b], cq[b + 1], ck[b], ck[b + 1], gq[b], gk[b], col, gq[b], col_q[b]]
        assert table[r, : len(expect)].tolist() == expect, f"row {r}: {table[r].tolist()} != {expect}"
        assert not table[r, len(expect):].any()
    assert not table[n:].any(), "rows past the real tiles must be zero"
    assert n <= T.tile_rows_bound(sum(tiled), len(tiled), max(tiled)) <= table.shape[0]


@pytest.mark.parametrize("key_tiles", [False, True], ids=["dq", "dkdv"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_table_kernel_equals_twin(key_tiles, causal, seed):
    """The Triton ranking kernel (interpreter on the CPU) writes the twin's table, row for row."""
    require_kernels()
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        B = int(torch.randint(1, 9, (), generator=g))
        lq = torch.randint(0, 600, (B,), generator=g).tolist()
        lk = torch.randint(0, 600, (B,), generator=g).tolist() if seed % 2 else lq
        lq[0] = 0  # an empty sequence always
        got = _table(lq, lk, key_tiles, causal, device=DEV).cpu()
        want = _table(lq, lk, key_tiles, causal, twin=True)
        assert torch.equal(got, want), f"lq={lq} lk={lk}"


def test_tile_table_above_rank_max_takes_the_twin(monkeypatch):
    """Past RANK_MAX candidates the table comes from the argsort path: same table."""
    require_kernels()
    T = _tiles()
    lq, lk = [700, 5, 129, 0, 257], [300, 900, 1, 64, 257]
    want = _table(lq, lk, True, True, twin=True)
    monkeypatch.setattr(T, "RANK_MAX", 4)
    assert torch.equal(_table(lq, lk, True, True, device=DEV).cpu(), want)


def test_tile_boxes_stay_in_their_sequence():
    """The layout invariant the kernels need: for every tile row and every 64-wide step it takes, the box of the
    seq operand (dQ: K_seq at col + n0; dK/dV: Q_seq and dO_seq at col + m0) and of the padded δ lies inside the
    sequence's own padded columns [cu_data[b], cu_data[b + 1]), so padding (zeros) and never another sequence's
    data fills the columns past its end."""
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN, cu_blocks

    lq, lk = [5, 0, 33, 70, 1, 2, 700, 4095, 64, 128], [9, 4, 0, 40, 129, 1, 300, 4095, 63, 129]
    col_q = (BWD_SEQ_ALIGN * cu_blocks(_cu(lq, "cpu"), BWD_SEQ_ALIGN)).tolist()
    col_k = (BWD_SEQ_ALIGN * cu_blocks(_cu(lk, "cpu"), BWD_SEQ_ALIGN)).tolist()
    for causal in (False, True):
        for key_tiles in (False, True):
            table = _table(lq, lk, key_tiles, causal, twin=True)
            for row in table.tolist():
                b, t0, q0, q1, k0, k1, _, _, col, _, dcol = row[:11]
                sq, sk = q1 - q0, k1 - k0
                if t0 >= (sk if key_tiles else sq):
                    continue
                steps = _work(lq, lk, b, t0, key_tiles, causal)
                if key_tiles:  # query steps of 64 from lo
                    m_end = -(-sq // 64) * 64
                    lo = min(max(t0 - (sk - sq), 0) // 64 * 64, m_end) if causal else 0
                    for m0 in range(lo, lo + 64 * steps, 64):
                        for c in (col, dcol):
                            assert col_q[b] <= c + m0 and c + m0 + 64 <= col_q[b + 1], (b, t0, m0)
                else:  # key tiles of 64 from 0
                    for n0 in range(0, 64 * steps, 64):
                        assert col_k[b] <= col + n0 and col + n0 + 64 <= col_k[b + 1], (b, t0, n0)


def test_seq_operands_are_64_aligned_and_zero_padded(seed):
    """varlen_bwd_operands' q_seq / k_seq and varlen_dout_operands' dO_seq: 64-aligned sequence starts, bytes equal
    to the PyTorch twin, zeros in every sequence's padding, also next to a sequence holding NaN and Inf; a
    sequence reads back as the dense producer's operand (the payload did not move within the sequence)."""
    require_kernels()
    from mxattn.kernels import varlen as V
    from mxattn.kernels.quantize import row_scaled_triton

    lens = [0, 1, 31, 33, 127, 129, 65]
    x = _packed(lens, 2, 64, seed, device="cpu", dtype=torch.float32, spread=8)
    x[40, 1, 3] = float("nan")  # sequence 3
    x[41, 0, 9] = float("inf")
    cu = _cu(lens, "cpu")
    got = V.varlen_v_operand(x.to(DEV), cu.to(DEV), max(lens), align=V.BWD_SEQ_ALIGN)
    want = V.varlen_v_operand_torch(x, cu, max(lens), align=V.BWD_SEQ_ALIGN)
    assert got.align == want.align == 64
    cols = got.cu_data.cpu()
    assert torch.equal(cols, want.cu_data) and (cols % 64 == 0).all()
    used = int(cols[-1])
    _same_bytes(got.data[:, :, :used], want.data[:, :, :used], "64-aligned seq data (zero padding included)")
    data = got.data.cpu().view(torch.uint8)
    for b, n in enumerate(lens):
        c0, c1 = int(cols[b]), int(cols[b + 1])
        assert c1 - c0 == -(-n // 64) * 64
        assert not data[:, :, c0 + n : c1].any(), f"sequence {b}: padding not zero"
    for b, s in enumerate(_seq_slices(cu)):
        if s.stop > s.start and b != 3:
            dense = row_scaled_triton(x[s].unsqueeze(0).to(DEV), "v")
            _same_bytes(got.sequence(b).data, dense.data, f"sequence {b} vs the dense producer")
    q = _packed(lens, 2, 64, seed + 1, device=DEV)
    ops = V.varlen_bwd_operands(q, q, q, cu.to(DEV), cu.to(DEV), max(lens), max(lens))
    _, dos = V.varlen_dout_operands(q, cu.to(DEV), max(lens))
    for name, op in (("q_seq", ops[3]), ("k_seq", ops[4]), ("dout_seq", dos)):
        assert op.align == V.BWD_SEQ_ALIGN and torch.equal(op.cu_data.cpu(), cols), name


def test_padded_delta(seed):
    """attn_bwd_preprocess_varlen(delta_padded=True): δ in dout_seq's columns equals the packed δ of the tl path,
    and is 0.0 in every sequence's padding; with lse= the same launch moves lse there too (= padded_lse)."""
    require_kernels()
    from mxattn.kernels.attn_bwd import attn_bwd_preprocess_varlen

    lens = [3, 0, 64, 65, 130]
    out = _packed(lens, 2, 64, seed, device=DEV)
    do = _packed(lens, 2, 64, seed + 1, device=DEV)
    cu = _cu(lens, DEV)
    _, _, packed = attn_bwd_preprocess_varlen(out, do, cu, max(lens))
    _, dos, padded = attn_bwd_preprocess_varlen(out, do, cu, max(lens), delta_padded=True)
    assert padded.shape == (2, dos.data.shape[2]) and padded.dtype == torch.float32
    cols, c = dos.cu_data.tolist(), cu.tolist()
    keep = torch.zeros(padded.shape[1], dtype=torch.bool)
    for b, n in enumerate(lens):
        torch.testing.assert_close(padded[:, cols[b] : cols[b] + n].cpu(), packed[:, c[b] : c[b + 1]].cpu(),
                                   rtol=0, atol=0)
        keep[cols[b] : cols[b] + n] = True
    assert not padded.cpu()[:, ~keep].any(), "padding of the padded δ must be 0.0"
    # lse moved into the same columns by the same launch: equal to padded_lse, δ unchanged
    from mxattn.kernels.attn_bwd_dkdv_gluon import padded_lse

    lse = torch.randn(2, sum(lens), generator=torch.Generator().manual_seed(seed)).to(DEV)
    _, _, delta2, lse_pad = attn_bwd_preprocess_varlen(out, do, cu, max(lens), delta_padded=True, lse=lse)
    assert torch.equal(delta2.cpu(), padded.cpu())
    assert torch.equal(lse_pad.cpu(), padded_lse(lse, cu, dos.cu_data, padded.shape[1]).cpu())
    with pytest.raises(ValueError, match="delta_padded"):
        attn_bwd_preprocess_varlen(out, do, cu, max(lens), lse=lse)
    with pytest.raises(ValueError, match="lse must be"):
        attn_bwd_preprocess_varlen(out, do, cu, max(lens), delta_padded=True, lse=lse[:, 1:])


def test_padded_lse_shares_the_padded_delta_columns(seed):
    """padded_lse: the packed lse moved to dout_seq's 64-aligned columns (the jagged dK/dV kernel's lse boxes must
    start 16-byte aligned: a packed start such as row 129 faulted on the H200), 0.0 in the padding; every
    sequence's first column is a multiple of 4 fp32 elements."""
    from mxattn.kernels.attn_bwd_dkdv_gluon import padded_lse
    from mxattn.kernels.varlen import BWD_SEQ_ALIGN, varlen_v_operand_torch

    lens = [2, 0, 129, 1, 4095, 33]
    cu = _cu(lens, "cpu")
    x = _packed(lens, 3, 64, seed, device="cpu")
    cols = varlen_v_operand_torch(x, cu, max(lens), align=BWD_SEQ_ALIGN).cu_data
    n_cols = int(cols[-1])  # (B + 1) offsets: the last is the padded total
    lse = torch.randn(3, sum(lens), generator=torch.Generator().manual_seed(seed))
    got = padded_lse(lse, cu, cols, n_cols)
    assert got.shape == (3, n_cols) and got.dtype == torch.float32
    keep = torch.zeros(n_cols, dtype=torch.bool)
    for b, n in enumerate(lens):
        c0, p0 = int(cols[b]), int(cu[b])
        assert c0 % BWD_SEQ_ALIGN == 0
        assert torch.equal(got[:, c0 : c0 + n], lse[:, p0 : p0 + n])
        keep[c0 : c0 + n] = True
    assert not got[:, ~keep].any()
    assert padded_lse(lse[:, :0], cu.new_zeros(1), cols[:1], 64).abs().sum() == 0  # no rows: zeros


def test_tl_varlen_bwd_same_on_16_and_64_aligned_seq_operands(seed):
    """The tl jagged kernels (the fallback) give the same bits on the new 64-aligned seq operands as on the
    16-aligned ones they were written for."""
    require_kernels()
    from mxattn.kernels import attn_bwd
    from mxattn.kernels import varlen as V

    lq, lk = [33, 0, 70], [40, 5, 129]
    q, do = _packed(lq, 2, 64, seed), _packed(lq, 2, 64, seed + 3)
    k, v = _packed(lk, 1, 64, seed + 1), _packed(lk, 1, 64, seed + 2)
    cq, ck = _cu(lq, q.device), _cu(lk, q.device)
    mq, mk = max(lq), max(lk)
    make_v = V.varlen_v_operand if q.is_cuda else V.varlen_v_operand_torch
    make_k = V.varlen_k_operand if q.is_cuda else V.varlen_k_operand_torch
    hd = (make_k(q, cq, mq), make_k(k, ck, mk), make_k(v, ck, mk))
    out = _packed(lq, 2, 64, seed + 4)
    lse = 4.0 + torch.randn(2, sum(lq), device=q.device).abs()  # P = 2^(...) well below 1
    res = []
    for align in (16, 64):
        seq = (make_v(q, cq, mq, align=align), make_v(k, ck, mk, align=align))
        dout = dict(dout_hdim=make_k(do, cq, mq), dout_seq=make_v(do, cq, mq, align=align))
        res.append(attn_bwd.attn_bwd_hopper_varlen(*hd, *seq, out, do, lse, deterministic=True,
                                                   config=attn_bwd.BwdConfig(), **dout))
    for a, b, name in zip(*res, ("dq", "dk", "dv")):
        _same_bytes(a, b, name)


def test_varlen_backward_kernel_switch(monkeypatch):
    """MXATTN_VARLEN_BWD_KERNEL: auto by default (the dense choice: tl without a Hopper GPU, Gluon on one), tl when
    asked, a bad value is refused, and "gluon" without a GPU raises before any launch (no silent fallback when asked
    by name)."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels import varlen as V

    monkeypatch.delenv("MXATTN_BWD_KERNEL", raising=False)
    monkeypatch.delenv("MXATTN_VARLEN_BWD_KERNEL", raising=False)  # the default: auto, i.e. the dense choice
    for dev in (torch.device("cpu"), torch.device("cuda", 0)):
        assert attn_bwd.varlen_backward_kernel(dev) == attn_bwd.backward_kernel(dev)
    assert attn_bwd.varlen_backward_kernel(torch.device("cpu")) == "tl"
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "gluon")  # auto follows an explicit dense choice
    assert attn_bwd.varlen_backward_kernel(torch.device("cpu")) == "gluon"
    monkeypatch.delenv("MXATTN_BWD_KERNEL")
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "auto")
    assert attn_bwd.varlen_backward_kernel(torch.device("cpu")) == "tl"
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "tl")
    assert attn_bwd.varlen_backward_kernel(torch.device("cuda", 0)) == "tl"
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "fast")
    with pytest.raises(ValueError, match="MXATTN_VARLEN_BWD_KERNEL"):
        attn_bwd.varlen_backward_kernel(torch.device("cpu"))
    if ON_GPU:
        return
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "gluon")
    lens = [3, 5]
    x = _packed(lens, 1, 64, 0, device="cpu")
    cu = _cu(lens, "cpu")
    ops = V.varlen_bwd_operands_torch(x, x, x, cu, cu, 5, 5)
    with pytest.raises(RuntimeError, match="Hopper"):
        attn_bwd.attn_bwd_hopper_varlen(*ops, x, x, torch.zeros(1, 8))
    ops16 = ops[:3] + (V.varlen_v_operand_torch(x, cu, 5), ops[4])  # a 16-aligned q_seq: not for Gluon
    with pytest.raises(ValueError, match="64-aligned"):
        attn_bwd.attn_bwd_hopper_varlen(*ops16, x, x, torch.zeros(1, 8))


@pytest.mark.slow
@pytest.mark.parametrize("part", ["dq", "dkdv"])
def test_jagged_builds_compile_for_sm90_without_gpu(part):
    """Where triton 3.6 is installed, the jagged builds (``VARLEN``) compile for sm_90a and pass the compile
    checks of scripts/compile_check_bwd_{dq,dkdv}_gluon.py --varlen (whole-tile and split, d128 causal and d64;
    dK/dV with both dS rules, ``--ds-exp=key`` the default and ``tile``).  The script runs in a subprocess without
    TRITON_INTERPRET, as test_attn_bwd_dkdv_gluon.test_compiles_for_sm90_without_gpu does: conftest sets it on
    machines without CUDA, and under it ``gl.max``'s combine function is an interpreter object that Gluon cannot
    compile (in-process the check passed only where triton's cache already held the kernel)."""
    import subprocess
    import sys

    from conftest import triton_version

    if not triton_version().startswith("3.6"):
        pytest.skip(f"compile check targets triton 3.6 (installed: {triton_version() or 'none'})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    runs = [["--only", "d128_causal,d64"], ["--split", "--only", "d128,d128_causal"]]
    if part == "dkdv":
        runs = [r + [f"--ds-exp={m}"] for m in ("key", "tile") for r in runs]
    for args in runs:
        r = subprocess.run([sys.executable, os.path.join(root, "scripts", f"compile_check_bwd_{part}_gluon.py"),
                            "--varlen", *args], capture_output=True, text=True, env=env, cwd=root)
        assert r.returncode == 0 and "all variants OK" in r.stdout, (args, r.stdout[-4000:], r.stderr[-2000:])


# ---------------------------------------------------------------------------------------------- host path (CPU)
def _host_case(lens, Hq=4, Hkv=2, D=128, seed=0):
    """Packed inputs and torch-twin operands of a jagged batch on the CPU (the launchers' host side only)."""
    from mxattn.kernels import varlen as V

    q, do, out = (_packed(lens, Hq, D, seed + i, device="cpu") for i in range(3))
    k, v = (_packed(lens, Hkv, D, seed + 3 + i, device="cpu") for i in range(2))
    cu = _cu(lens, "cpu")
    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(Hq, sum(lens), generator=g)
    return V.varlen_bwd_operands_torch(q, k, v, cu, cu, max(lens), max(lens)), out, do, lse


def _gluon_host_call(ops, out, do, lse, causal=False):
    """What ``attn_bwd_hopper_varlen`` runs on its Gluon path, launches included (recorded by the caller)."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, attn_bwd_dkdv_gluon_varlen
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon_varlen

    q, k, v_hdim, q_seq, k_seq = ops
    doh, dos, delta, lse_pad = attn_bwd.attn_bwd_preprocess_varlen(
        out, do, q.cu_seqlens, q.max_seqlen, delta_padded=True, lse=lse, offsets_of=attn_bwd._dout_offsets(q, q_seq))
    attn_bwd_dkdv_gluon_varlen(q, k, v_hdim, q_seq, doh, dos, lse_pad, delta, causal=causal,
                               config=GluonDkdvConfig(split=True))
    attn_bwd_dq_gluon_varlen(q, k, v_hdim, k_seq, doh, lse, delta, dos.cu_data, causal=causal,
                             config=GluonDqConfig(split=True))


def _record(monkeypatch):
    from mxattn.kernels import launch as L

    seen = []
    monkeypatch.setattr(L.FastLauncher, "launch",
                        lambda self, grid, args, kwargs: seen.append((self.jit_fn.__name__, grid, args, kwargs)))
    return seen


def _arg_sig(x):
    """A launch argument as a plan must repeat it: tensors by dtype / shape / strides, descriptors by every field
    (base by dtype / shape / strides), the rest by value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.stride())
    if hasattr(x, "block_shape"):
        f = dict(vars(x))
        b = f.pop("base")
        return ("desc", b.dtype, tuple(b.shape), b.stride(), tuple(map(tuple, (x.shape, x.strides))),
                tuple(x.block_shape), repr(x.layout), x.padding)
    return x


def _first_jagged_call(monkeypatch):
    """Both jagged launchers' plan tables emptied, then one recorded call on a four-sequence batch: (dK/dV module,
    dQ module, the case, the recorded launches)."""
    kv = pytest.importorskip("mxattn.kernels.attn_bwd_dkdv_gluon")
    dqm = pytest.importorskip("mxattn.kernels.attn_bwd_dq_gluon")
    kv._VARLEN_PLANS.clear()
    dqm._VARLEN_PLANS.clear()
    case = _host_case([900, 300, 70, 1049])
    seen = _record(monkeypatch)
    _gluon_host_call(*case)
    return kv, dqm, case, seen


def test_gluon_jagged_launch_plans(monkeypatch):
    """The jagged launchers keep a plan per operand signature: the second call of a signature skips the checks
    (check_varlen_operands would fail here) and the descriptors' constructors, and launches what the first call
    launched (same grid, options, scalars, constexprs, descriptors over the same tensors), with its own tile table
    (positional: a bound launch fixes only its keywords).  A batch of other lengths with the same token count,
    sequence count and longest sequence takes the same plans (the lengths are read on the device only)."""
    kv, dqm, case, seen = _first_jagged_call(monkeypatch)
    first = [s for s in seen if s[0].startswith("_attn_bwd")]
    assert len(kv._VARLEN_PLANS) == 1 and len(dqm._VARLEN_PLANS) == 1
    monkeypatch.setattr(dqm, "check_varlen_operands", lambda *a, **k: pytest.fail("a plan hit runs no checks"))
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    monkeypatch.setattr(TensorDescriptor, "__post_init__", lambda self: pytest.fail("a plan hit builds no descriptor"))
    seen.clear()
    _gluon_host_call(*case)
    second = [s for s in seen if s[0].startswith("_attn_bwd")]
    tables = [s for s in seen if s[0] == "_bwd_tile_slots_kernel"]
    assert len(second) == 2 and len(tables) == 2, "each call builds its own two tile tables"
    for (n1, g1, a1, k1), (n2, g2, a2, k2) in zip(first, second):
        assert (n1, tuple(g1), k1) == (n2, tuple(g2), k2) and len(a1) == len(a2)
        assert [_arg_sig(x) for x in a1] == [_arg_sig(x) for x in a2], n1
        assert a2[-1] is True and a2[-2] is tables[first.index((n1, g1, a1, k1))][2][7], "VARLEN, today's table"
        assert a2[0].base.data_ptr() == case[0][0].data.data_ptr(), "the q descriptor reads the call's q"
    assert k1["num_warps"] == 4 and set(k1) <= {"num_warps", "maxnreg", "AMAX_SLOTS"}, k1
    seen.clear()
    _gluon_host_call(*_host_case([1049, 70, 300, 900], seed=5))  # other lengths, same T, B and max_seqlen
    assert len(kv._VARLEN_PLANS) == 1 and len(dqm._VARLEN_PLANS) == 1
    assert len([s for s in seen if s[0].startswith("_attn_bwd")]) == 2


def test_gluon_jagged_plans_hold_no_operand(monkeypatch):
    """A plan keeps its descriptors without their tensors (``launch.unbased``): once the caller drops a call's
    operands they are freed, although the plan stays (packed training makes a plan per new batch shape)."""
    import gc
    import weakref

    kv, dqm, case, seen = _first_jagged_call(monkeypatch)
    assert len(kv._VARLEN_PLANS) == 1 and len(dqm._VARLEN_PLANS) == 1
    refs = [weakref.ref(t) for t in (case[0][0].data, case[0][1].data, case[0][3].data, case[0][4].data)]
    seen.clear()
    del case
    gc.collect()
    assert all(r() is None for r in refs), "a plan kept a call's operand alive"
    for plans in (kv._VARLEN_PLANS, dqm._VARLEN_PLANS):
        for plan in plans.values():
            assert all(d.base is None for d in plan[1])


def test_gluon_jagged_plan_launch_equals_the_checked_launch(monkeypatch):
    """With plans off (MXATTN_LAUNCH_PLANS=0: every call checked, descriptors built) the launches carry the same
    arguments as the plan's, bound to the kernels' parameter names (the constexprs go positionally on both)."""
    import inspect

    from mxattn.kernels import launch as L

    kv = pytest.importorskip("mxattn.kernels.attn_bwd_dkdv_gluon")
    dqm = pytest.importorskip("mxattn.kernels.attn_bwd_dq_gluon")
    case = _host_case([5, 130, 64], Hq=2, Hkv=1, D=64)

    def bound(plans: bool):
        monkeypatch.setattr(L, "PLANS", plans)
        seen = _record(monkeypatch)
        for _ in range(2):
            _gluon_host_call(*case, causal=True)
        out = []
        for name, grid, args, kw in (s for s in seen if s[0].startswith("_attn_bwd")):
            fn = (kv._attn_bwd_dkdv_ws_kernel if "dkdv" in name else dqm._attn_bwd_dq_ws_kernel).fn
            b = inspect.signature(fn).bind(*args)
            out.append((name, tuple(grid), kw, {k: (v if k == "SLOTS" else _arg_sig(v)) for k, v in b.arguments.items()}))
        return out

    kv._VARLEN_PLANS.clear()
    dqm._VARLEN_PLANS.clear()
    checked = bound(False)
    assert not kv._VARLEN_PLANS and not dqm._VARLEN_PLANS
    planned = bound(True)
    assert len(checked) == len(planned) == 4
    for c, p in zip(checked, planned):
        assert c[:3] == p[:3]
        assert {k: v for k, v in c[3].items() if k != "SLOTS"} == {k: v for k, v in p[3].items() if k != "SLOTS"}
        assert c[3]["VARLEN"] is True and c[3]["SLOTS"].shape == p[3]["SLOTS"].shape


def test_gluon_jagged_host_path_does_not_sync(monkeypatch):
    """The Gluon jagged backward's host side (dO producers, δ / lse padding, tile tables, both launchers), first
    call and plan hit, reads no device value on the host: no item / tolist / cpu / numpy / int / bool of a tensor,
    no op that syncs on CUDA (``_local_scalar_dense``, ``nonzero``, tensor-``repeats`` ``repeat_interleave``, copies
    to another device).  The launches themselves are recorded, not run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    pytest.importorskip("mxattn.kernels.attn_bwd_dkdv_gluon")
    case = _host_case([900, 300, 70, 1049])
    _record(monkeypatch)
    bad = []

    def refuse(name):
        return lambda self, *a, **k: bad.append(name) or pytest.fail(f"host read of a tensor: Tensor.{name}")

    class Syncs(TorchDispatchMode):
        SYNC = ("_local_scalar_dense", "nonzero", "repeat_interleave.Tensor", "masked_select", "unique", "_unique")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if any(s in name for s in self.SYNC) or (name.startswith("aten._to_copy") and "device" in (kwargs or {})):
                bad.append(name)
            return func(*args, **(kwargs or {}))

    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    with Syncs():
        _gluon_host_call(*case)  # checked path (or a plan from an earlier test)
        _gluon_host_call(*case)  # plan hit
    monkeypatch.undo()
    assert not bad, bad


def test_dout_producers_take_the_offsets_of_q(seed):
    """dO's producers with ``offsets_of`` (the backward passes q and q_seq: same cu_seqlens tensor) give the bytes
    of the producers that compute their offsets (in the sequences' columns), and refuse an operand of another layout or other sequences."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels import varlen as V

    lens = [5, 0, 130, 64, 1]
    do = _packed(lens, 2, 64, seed, device=DEV, spread=2)
    cu = _cu(lens, DEV)
    q, q_seq = V.varlen_k_operand(do * 3, cu, 130), V.varlen_v_operand(do * 3, cu, 130, align=V.BWD_SEQ_ALIGN)
    for ref, got in ((V.varlen_k_operand(do, cu, 130), V.varlen_k_operand(do, cu, 130, offsets_of=q)),
                     (V.varlen_v_operand(do, cu, 130, align=V.BWD_SEQ_ALIGN),
                      V.varlen_v_operand(do, cu, 130, align=V.BWD_SEQ_ALIGN, offsets_of=q_seq))):
        if ref.role == "v":  # the columns of the sequences (the tail past the last one is never written or read)
            n = int(ref.cu_data[-1])
            _same_bytes(got.data[..., :n], ref.data[..., :n], "v")
            assert got.data.shape == ref.data.shape
        else:
            _same_bytes(got.data, ref.data, ref.role)
        assert torch.equal(ref.exp, got.exp)
        assert torch.equal(ref.cu_data, got.cu_data) and (ref.cu_exp is None) == (got.cu_exp is None)
        assert ref.cu_exp is None or torch.equal(ref.cu_exp, got.cu_exp)
    assert attn_bwd._dout_offsets(q, q_seq) == (q, q_seq)
    q16 = V.varlen_v_operand(do, cu, 130)  # 16-aligned: not dO's layout
    assert attn_bwd._dout_offsets(q, q16) == (q, None)
    with pytest.raises(ValueError, match="offsets_of"):
        V.varlen_v_operand(do, cu, 130, align=V.BWD_SEQ_ALIGN, offsets_of=q16)
    with pytest.raises(ValueError, match="offsets_of"):
        V.varlen_k_operand(do, cu.clone(), 130, offsets_of=q)  # other offsets tensor
    with pytest.raises(ValueError, match="offsets_of"):
        V.varlen_k_operand(do, cu, 130, offsets_of=q_seq)


def test_bench_parts_time_each_piece(monkeypatch):
    """``bench_varlen_bwd``'s ``parts_ms`` (``varlen._varlen_bwd_parts``) times the tl preprocessing, and on the Gluon
    path the padded preprocessing, both tile tables and each launcher: run here on the CPU with do_bench calling its
    function once and the launches recorded."""
    import triton.testing

    from mxattn.kernels import varlen as V

    pytest.importorskip("mxattn.kernels.attn_bwd_dkdv_gluon")
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, *a, **k: calls.append(fn()) or 1.0)
    seen = _record(monkeypatch)
    ops, out, do, lse = _host_case([70, 300, 5])
    assert V._varlen_bwd_parts(ops, out, do, lse, True, gluon=False) == {"preprocess": 1.0}
    seen.clear()
    parts = V._varlen_bwd_parts(ops, out, do, lse, True, gluon=True)
    assert list(parts) == ["preprocess", "gluon_preprocess", "tile_tables", "gluon_dkdv", "gluon_dq"]
    names = [s[0] for s in seen]
    assert names.count("_attn_bwd_dkdv_ws_kernel") == 1 and names.count("_attn_bwd_dq_ws_kernel") == 1
    assert names.count("_bwd_tile_slots_kernel") == 4  # two in tile_tables, one per launcher


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Hopper) for the Gluon kernels")


def _gluon_env(monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward kernels are built for sm_90")
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "gluon")


def _twin_config():
    """The tl tiles whose numerics the Gluon kernels the dispatch runs reproduce (split: 64 x 64 dS tiles) and the
    dS rule of the dK/dV config it passes (``tl_twin_config``: ``ds_tile_scale=False`` for the default per-key
    exponent), with the separate dQ kernel (the tl dQ kernel has no per-key rule: dQ's tiles alone decide it)."""
    from dataclasses import replace

    from mxattn.kernels import attn_bwd
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, tl_twin_config

    # the dK/dV config attn_bwd_hopper_varlen passes to attn_bwd_dkdv_gluon_varlen
    return replace(tl_twin_config(GluonDkdvConfig(split=True) if attn_bwd.gluon_split() else None), dq_kernel=True)


def _run_both(lq, lk, Hq, Hkv, D, causal, seed, monkeypatch):
    """(gluon grads, tl grads with the twin tiles, inputs) on the same operands."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels import varlen as V
    from mxattn.kernels.attn_fwd import attn_fwd_hopper_varlen

    q, k, v, do = (_packed(l, h, D, seed + i, spread=2 * (i > 0)) for i, (l, h) in
                   enumerate(((lq, Hq), (lk, Hkv), (lk, Hkv), (lq, Hq))))
    cq, ck = _cu(lq), _cu(lk)
    mq, mk = max(lq), max(lk)
    out, lse = attn_fwd_hopper_varlen(*V.varlen_operands(q, k, v, cq, ck, mq, mk), causal=causal)
    ops = V.varlen_bwd_operands(q, k, v, cq, ck, mq, mk)
    _gluon_env(monkeypatch)
    g = attn_bwd.attn_bwd_hopper_varlen(*ops, out, do, lse, causal=causal)
    t = attn_bwd.attn_bwd_hopper_varlen(*ops, out, do, lse, causal=causal, deterministic=True, config=_twin_config())
    torch.cuda.synchronize()
    return g, t, (q, k, v, do, out, lse, ops, cq, ck)


def _close(g, t, name, what):
    """Agreement up to the fp32 summation order of the products (what the dense Gluon tests allow)."""
    gd, td = g.double(), t.double()
    assert torch.isfinite(gd).all(), f"{what} {name}: non-finite values"
    err = (gd - td).norm().item()
    ref = td.norm().item()
    assert err <= 2e-2 * ref + 1e-6, f"{what} {name}: relative error {err / max(ref, 1e-30):.3g} against the tl kernel"


TINY = [([1], [2], 1, 1, 64, True), ([2, 3], None, 2, 1, 128, False)]
CASES = [
    ([0, 1, 31, 33, 127, 129, 4095, 2048], None, 4, 2, 128, False),
    ([0, 1, 31, 33, 127, 129, 4095, 2048], None, 4, 2, 128, True),
    ([5, 0, 33, 70, 1, 2, 700, 1500], [9, 4, 0, 40, 129, 1, 300, 1800], 8, 1, 64, True),
    ([5, 0, 33, 70, 1, 2, 700, 1500], [9, 4, 0, 40, 129, 1, 300, 1800], 2, 2, 64, False),
    ([3000, 64, 65, 1, 128], None, 2, 1, 64, True),
]


def _cid(c):
    return f"{len(c[0])}seq-h{c[2]}/{c[3]}-d{c[4]}" + ("c" if c[5] else "")


@gpu
@needs_cuda
@pytest.mark.parametrize("case", TINY + CASES, ids=_cid)
def test_gluon_varlen_bwd_matches_tl_varlen_bwd(case, seed, monkeypatch):
    """Gluon jagged backward against the tl jagged backward with the Gluon kernels' twin tiles: same dS tiles and
    exponents, so the results agree up to the fp32 summation order; rows / keys that see nothing are exact 0."""
    lq, lk, Hq, Hkv, D, causal = case
    lk = lk or lq
    g, t, _ = _run_both(lq, lk, Hq, Hkv, D, causal, seed, monkeypatch)
    for name, a, b in zip(("dq", "dk", "dv"), g, t):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        _close(a, b, name, _cid(case))
    for bi, (sq, sk) in enumerate(zip(_seq_slices(_cu(lq, "cpu")), _seq_slices(_cu(lk, "cpu")))):
        if sk.stop == sk.start and sq.stop > sq.start:
            assert not g[0][sq].any(), f"sequence {bi}: dq of rows without keys must be 0"
        if sq.stop == sq.start and sk.stop > sk.start:
            assert not g[1][sk].any() and not g[2][sk].any(), f"sequence {bi}: dk / dv of unseen keys must be 0"


@gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES[:3] + CASES[4:], ids=_cid)
def test_gluon_varlen_bwd_is_the_dense_gluon_bwd_per_sequence(case, seed, monkeypatch):
    """Each sequence's gradients equal, bit for bit, the dense Gluon kernels' on that sequence alone (batch 1,
    the dense producers' operands, which equal the jagged ones per sequence): the jagged mode is the dense code
    after its prologue, and the rows past a sequence's end that its boxes read contribute exact zeros."""
    from mxattn.kernels import attn_bwd
    from mxattn.kernels.quantize import row_scaled_triton

    lq, lk, Hq, Hkv, D, causal = case
    lk = lk or lq
    g, _, (q, k, v, do, out, lse, _, cq, ck) = _run_both(lq, lk, Hq, Hkv, D, causal, seed, monkeypatch)
    monkeypatch.setenv("MXATTN_BWD_KERNEL", "gluon")
    for bi, (sq, sk) in enumerate(zip(_seq_slices(cq.cpu()), _seq_slices(ck.cpu()))):
        if sq.stop == sq.start or sk.stop == sk.start:
            continue
        one = lambda t, s: t[s].unsqueeze(0)  # noqa: E731
        qb, kb, vb = one(q, sq), one(k, sk), one(v, sk)
        dense = attn_bwd.attn_bwd_hopper(
            row_scaled_triton(qb, "k", k_group=attn_bwd.Q_EXP_GROUP), row_scaled_triton(kb, "k"),
            row_scaled_triton(vb, "k"), row_scaled_triton(qb, "v"), row_scaled_triton(kb, "v"),
            one(out, sq), one(do, sq), lse[:, sq].unsqueeze(0).contiguous(), causal=causal)
        for name, a, b, s in zip(("dq", "dk", "dv"), g, dense, (sq, sk, sk)):
            _same_bytes(a[s], b[0], f"sequence {bi} (len_q {sq.stop - sq.start}, len_k {sk.stop - sk.start}) {name}")


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=_cid)
def test_gluon_varlen_bwd_against_the_reference(case, seed, monkeypatch):
    """test_varlen_bwd's accuracy bound (kernel error <= 2x the emulation's per sequence, +0.5 dB on the batch)
    with the dispatch's Gluon kernels, emulated with their twin tiles."""
    from test_varlen_bwd import _check_varlen_bwd

    lq, lk, Hq, Hkv, D, causal = case
    _gluon_env(monkeypatch)
    _check_varlen_bwd(lq, lk or lq, Hq, Hkv, D, causal, True, seed, config=_twin_config(), kernel_config=None)


@gpu
@needs_cuda
def test_gluon_varlen_bwd_deterministic_bitwise(seed, monkeypatch):
    """Three calls on the same operands give the same bits (no atomics), causal and GQA."""
    from mxattn.kernels import attn_bwd

    lq = [0, 1, 31, 33, 127, 129, 4095, 2048, 900]
    _, _, (q, k, v, do, out, lse, ops, _, _) = _run_both(lq, lq, 4, 2, 128, True, seed, monkeypatch)
    runs = [attn_bwd.attn_bwd_hopper_varlen(*ops, out, do, lse, causal=True) for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], r):
            _same_bytes(a, b, f"{name} over repeats")


@gpu
@needs_cuda
@pytest.mark.parametrize("split", ["0", "1"])
def test_gluon_varlen_bwd_both_builds(split, seed, monkeypatch):
    """Whole-tile and split builds (MXATTN_BWD_GLUON_SPLIT) both match their tl twins on a mixed batch."""
    monkeypatch.setenv("MXATTN_BWD_GLUON_SPLIT", split)
    g, t, _ = _run_both([70, 0, 129, 1000, 1], [300, 5, 129, 1000, 64], 4, 2, 128, True, seed, monkeypatch)
    for name, a, b in zip(("dq", "dk", "dv"), g, t):
        _close(a, b, name, f"split={split}")


@gpu
@needs_cuda
def test_public_varlen_function_takes_the_gluon_kernels(seed, monkeypatch):
    """mxfp8_attn_varlen_func's loss.backward() on Hopper runs the Gluon jagged kernels (their launchers are
    called) and agrees with the tl path (MXATTN_VARLEN_BWD_KERNEL=tl) within the twins' tolerance."""
    import mxattn
    from mxattn.kernels import attn_bwd_dkdv_gluon as K
    from mxattn.kernels import attn_bwd_dq_gluon as Q

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward kernels are built for sm_90")
    lens = [100, 0, 257, 33]
    x = [_packed(lens, h, 64, seed + i).requires_grad_() for i, h in enumerate((4, 2, 2))]
    cu = _cu(lens)
    calls = []
    for mod, name in ((K, "attn_bwd_dkdv_gluon_varlen"), (Q, "attn_bwd_dq_gluon_varlen")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    grads = {}
    for kernel in ("gluon", "tl"):
        monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", kernel)
        o = mxattn.mxfp8_attn_varlen_func(*x, cu, cu, max(lens), max(lens), causal=True)
        gr = torch.autograd.grad(o.float().square().sum(), x)
        grads[kernel] = gr
    assert sorted(set(calls)) == ["attn_bwd_dkdv_gluon_varlen", "attn_bwd_dq_gluon_varlen"]
    for name, a, b in zip(("dq", "dk", "dv"), grads["gluon"], grads["tl"]):
        assert torch.isfinite(a).all(), name
        rel = (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-30)
        assert rel < 0.1, f"{name}: Gluon vs tl jagged backward differ by {rel:.3g}"


@gpu
@needs_cuda
def test_bench_varlen_bwd_gluon_row(monkeypatch):
    """bench_varlen_bwd times the Gluon jagged path when asked (MXATTN_VARLEN_BWD_KERNEL=gluon; the default is tl
    until the Gluon jagged mode passes on the GPU), names it and times its parts.  A smoke test: at this size
    (2949 tokens, 4 heads) every path is host-bound (its host_ms is about its ms); the speed rows are
    bench_varlen_bwd's defaults (B 16, H 16, mean length 2048: gpu_check.sh's varlenbwd stage)."""
    from mxattn.kernels.varlen import bench_varlen_bwd

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward kernels are built for sm_90")
    monkeypatch.setenv("MXATTN_VARLEN_BWD_KERNEL", "gluon")
    row = bench_varlen_bwd(batch=4, mean_len=512, heads_q=4, heads_kv=4, with_sdpa=False)
    assert row["varlen_kernel"] == "gluon" and row["ms"]["varlen"] > 0 and row["ms"]["varlen_tl"] > 0
    assert set(row["parts_ms"]) == {"preprocess", "gluon_preprocess", "tile_tables", "gluon_dkdv", "gluon_dq"}
    assert set(row["host_ms"]) == {"varlen", "varlen_tl", "dense_padded", "dense_mean"}
    print(row)
