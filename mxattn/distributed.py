"""Context-parallel (ring) MXFP8 attention over a ``torch.distributed`` process group.

Layout
    Every rank of ``group`` (world size W) holds a shard of the sequence of q, k, v: (B, S_local, H, D).
    ``zigzag=True`` (default, balances causal work): the global sequence is cut into 2W equal chunks of
    c = S / (2W) tokens and rank r holds chunks r and 2W-1-r, concatenated (``zigzag_shard``,
    ``zigzag_unshard``).  ``zigzag=False``: rank r holds the contiguous chunk r of W (c = S / W).
    Constraint: S divisible by 2W (zigzag) or W; every rank has the same S_local.

What travels (forward): K blocked along the head dim and V blocked along the sequence, as MXFP8 bytes
    (e4m3 data + E8M0 scales), each tensor sent as it is (one point-to-point op per tensor in one batch: no packing
    copy; sequence-blocked data keeps its channel-major layout).  V's sequence blocks of 32 start at each *chunk*'s
    first token (the last block of a chunk is partial when c % 32 != 0).  When c is a multiple of 32 this is
    bit-identical to quantizing the whole gathered sequence, so the ring computes on exactly the operands of
    single-process ``mxfp8_attn_func``; the shard is then quantized in one launch per tensor and calls take views
    of it.  Bytes per rank and step: 2N (1 + 1/32) against 4N for a BF16 ring, N = B * S_local * Hkv * D: 0.516x
    (``ring_step_bytes``).  ``KernelBlock(row_scaled_wire=True)`` with c a multiple of 128 sends the Hopper operands
    instead (made once per pass by the owner from the float shard; ``KernelBlock.kv_operands``): 2N plus int32
    exponents, and no visiting rank re-expresses anything.
    The tensors go to rank r+1 with ``batch_isend_irecv`` while rank r computes on the block it holds.

Per step and per (q chunk, k chunk) pair: ``full`` (the q chunk is later in the sequence than the k chunk, or
    not causal), ``diag`` (the same chunk: square causal block) or skipped.  Each computed pair gives a partial
    (out, lse) from a *block function* (``ReferenceBlock`` on the CPU, ``KernelBlock`` with the Hopper kernels
    on CUDA) and partials are merged by log-sum-exp in fp32 (rows that saw nothing have lse = -inf).
    When chunks are a multiple of 32 tokens, the pairs of one step go to the block function as one call
    (``_step_calls``): at step 0 a rank's own zig-zag chunks are causal attention over their concatenation, and
    at every later step the pairs that are not skipped form one rectangle of full blocks (all local queries
    against one visiting chunk, or one local chunk against both): one kernel launch per step instead of up to
    four, and fewer merges.
    The P quantization of each block uses that block's row max (as a kernel with a running max does), so the
    forward agrees with single-process attention statistically, at the same error level, not bit for bit.

Backward (``torch.autograd.Function``): K (head dim and sequence blocked) and V (head dim blocked) circulate
    again (MXFP8, or the Hopper operands as above), and the dK/dV partial sums of the visiting shard (fp32, or bf16
    with ``grad_comm_dtype``) travel with them: a rank's sums for its own shard (step 0) stay with it, the others'
    arrive after W-1 hops and are added to them and cast to the inputs' dtype in one pass.  Each block's gradients
    use the global ``out`` and the global lse (``lse_bwd``: the exact lse on the CPU reference path, which is what
    the single-process reference backward recomputes; the forward lse on the kernel path, which is what the kernel
    backward takes), so they are the block's exact share of the merged softmax's gradients: the result equals the
    single-process backward on the same ``out`` up to accumulation order (c % 32 == 0).

Nothing here is CUDA-specific: on GPUs use the nccl backend (launcher: ``python -m mxattn.distributed``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mxattn import formats, reference
from mxattn.formats import MXTensor, RowScaledFP8

__all__ = [
    "ring_mxfp8_attn_func",
    "zigzag_shard",
    "zigzag_unshard",
    "ReferenceBlock",
    "KernelBlock",
    "RingStats",
    "last_ring_stats",
    "ring_step_bytes",
    "bench_ring",
]

SUPPORTED_HEAD_DIMS = (64, 128)
_TAG_KV, _TAG_GRAD = 0, 1
_FULL, _DIAG, _SKIP = "full", "diag", "skip"


# ----------------------------------------------------------------------------------------------
# Sequence layout
# ----------------------------------------------------------------------------------------------


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zig-zag shard of ``x`` along ``dim``: chunks ``rank`` and ``2*world-1-rank`` of 2*world.

    ``x.shape[dim]`` must be divisible by 2*world.  Returns a new tensor (the two chunks concatenated)."""
    n = x.shape[dim]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if n % (2 * world):
        raise ValueError(f"zig-zag sharding needs the length along dim {dim} ({n}) divisible by 2*world={2 * world}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: the full tensor from the shards of ranks 0..W-1 (in rank order).

    Use ``dim=1`` for (B, S, H, D) tensors and ``dim=2`` for lse (B, H, S)."""
    world = len(shards)
    halves = []
    for s in shards:
        if s.shape[dim] % 2:
            raise ValueError(f"a zig-zag shard has an even length along dim {dim}, got {s.shape[dim]}")
        halves.append(s.chunk(2, dim))
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim)


def _chunk_ids(rank: int, world: int, zigzag: bool) -> tuple[int, ...]:
    """Global chunk indices a rank holds, in local order."""
    return (rank, 2 * world - 1 - rank) if zigzag else (rank,)


def _block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or q_chunk > k_chunk:
        return _FULL
    return _DIAG if q_chunk == k_chunk else _SKIP


# ----------------------------------------------------------------------------------------------
# MXFP8 tensors on the wire
# ----------------------------------------------------------------------------------------------


def _is_channel_major(data: torch.Tensor) -> bool:
    """Whether (B, S, H, D) ``data`` is the view of a channel-major (B, H, D, S_pad) buffer (unit stride along S),
    the layout the Triton quantizer gives sequence-blocked tensors and the Hopper kernels read V in."""
    return data.ndim == 4 and data.shape[1] > 1 and data.stride(1) == 1 and not data.is_contiguous()


def _wire_parts(op) -> tuple[list[torch.Tensor], tuple]:
    """The two contiguous tensors that carry ``op`` (an ``MXTensor``: data, scale bytes; a ``RowScaledFP8``: data,
    int32 exponents) and the spec that rebuilds it (``_rebuild``).  Channel-major data travels in its own
    (B, H, D, S) layout: no copy when the buffer has no padding (S a multiple of 16), no transposition ever."""
    if isinstance(op, MXTensor):
        meta, side = ("mx", op.dim), op.scale_bytes
    else:
        meta, side = ("rs", op.dim, op.group_dim, op.group), op.exp
    cm = _is_channel_major(op.data)
    body = op.data.permute(0, 2, 3, 1) if cm else op.data
    tensors = [body.contiguous(), side.contiguous()]
    return tensors, (meta, cm, [(tuple(t.shape), t.dtype) for t in tensors])


def _rebuild(flat: Sequence[torch.Tensor], spec: tuple):
    """The operand ``_wire_parts`` took apart, viewing the received uint8 tensors ``flat`` (no copy)."""
    meta, cm, shapes = spec
    data, side = (f.view(dt).view(shape) for f, (shape, dt) in zip(flat, shapes))
    if cm:
        data = data.permute(0, 3, 1, 2)
    if meta[0] == "mx":
        return MXTensor(data, side, meta[1])
    return RowScaledFP8(data, side, meta[1], group_dim=meta[2], group=meta[3])


def _to_wire(ops: Sequence[Sequence]) -> tuple[list[torch.Tensor], list]:
    """Flat uint8 views of every part of every role of ``ops`` (``_kv_operands``) and the spec to rebuild them.
    They are sent as they are, one point-to-point op each in one batch (no packing copy)."""
    flat, spec = [], []
    for parts in ops:
        role = []
        for op in parts:
            tensors, s = _wire_parts(op)
            flat += [t.reshape(-1).view(torch.uint8) for t in tensors]
            role.append(s)
        spec.append(role)
    return flat, spec


def _from_wire(flat: Sequence[torch.Tensor], spec: list) -> list[list]:
    """Inverse of ``_to_wire`` on the received tensors: the operands per role, views of ``flat``."""
    it = iter(flat)
    return [[_rebuild([next(it), next(it)], s) for s in role] for role in spec]


def _rows(op, a: int, b: int):
    """Tokens a..b (dim 1) of a (B, S, H, D) ``MXTensor`` or ``RowScaledFP8`` as views (no copy).

    Blocks and exponent groups along the sequence must not straddle a or b (MX sequence blocks: multiples of 32;
    the K layout's groups: multiples of the group).  The V layout's one exponent per channel over the whole
    operand is kept: the slice is re-expressed to the exponent of the whole shard."""
    S = op.data.shape[1]
    if (a, b) == (0, S):
        return op
    data = op.data[:, a:b]
    if isinstance(op, MXTensor):
        if op.dim != 1:
            return MXTensor(data, op.scale[:, a:b], op.dim)
        g = op.block_size
        if a % g or (b % g and b != S):
            raise ValueError(f"tokens {a}..{b} cut MX sequence blocks of {g}")
        return MXTensor(data, op.scale[:, a // g : -(-b // g)], 1)
    if op.dim == 1:
        return RowScaledFP8(data, op.exp, 1)
    g = op.group if op.group_dim == 1 else 1
    if a % g or (b % g and b != S):
        raise ValueError(f"tokens {a}..{b} cut exponent groups of {g}")
    return RowScaledFP8(data, op.exp[:, a // g : -(-b // g)], op.dim, group_dim=op.group_dim, group=op.group)


@dataclass
class RingStats:
    """Bytes this rank sent per ring step in the last call (``last_ring_stats``)."""

    fwd_kv_bytes: list = field(default_factory=list)
    bwd_kv_bytes: list = field(default_factory=list)
    bwd_grad_bytes: list = field(default_factory=list)


_LAST_STATS = RingStats()


def last_ring_stats() -> RingStats:
    """What the last ``ring_mxfp8_attn_func`` forward (and its backward, once run) sent from this process."""
    return RingStats(list(_LAST_STATS.fwd_kv_bytes), list(_LAST_STATS.bwd_kv_bytes), list(_LAST_STATS.bwd_grad_bytes))


class _Pending:
    """A started exchange; holds the send tensors until ``wait`` so that they outlive the transfer."""

    def __init__(self, send: list, recv: list, works: list):
        self.send, self.recv, self.works = send, recv, works

    def wait(self) -> list:
        for w in self.works:
            w.wait()
        return self.recv


class _Ring:
    """Neighbours of this rank in ``group``: sends go to rank+1, receives come from rank-1."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = glob((self.rank + 1) % self.world)
        self.prev = glob((self.rank - 1) % self.world)

    def exchange(self, send: Sequence[torch.Tensor], tag: int, log: list) -> _Pending:
        """Start sending the contiguous tensors ``send`` to the next rank and receiving tensors like them from the
        previous one, all in one batch (one NCCL group); ``wait`` gives the received list."""
        send = list(send)
        log.append(sum(t.numel() * t.element_size() for t in send))
        if self.world == 1:
            return _Pending(send, send, [])
        recv = [torch.empty_like(t) for t in send]
        ops = []
        for i, (s, r) in enumerate(zip(send, recv)):  # distinct tags per tensor (gloo matches on them)
            ops.append(dist.P2POp(dist.isend, s, self.next, self.group, tag + 2 * i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + 2 * i))
        return _Pending(send, recv, dist.batch_isend_irecv(ops))


def ring_step_bytes(batch: int, seqlen_local: int, kv_heads: int, head_dim: int, zigzag: bool = True) -> dict:
    """Bytes one rank sends per ring step, MXFP8 against a BF16 ring (shapes of one rank's k/v shard).

    fwd: K (head-dim blocks) + V (sequence blocks per chunk).  bwd_kv: K in both orientations + V (head dim).
    Gradient partial sums (dK, dV) add 8 bytes per element pair in fp32 (4 in bf16) to either backward.
    ``*_row_scaled``: the same operands in the Hopper format ``KernelBlock`` sends when chunks are a multiple of 128
    tokens (e4m3 data, int32 exponents: one per 128 keys and head for the head-dim orientation, one per channel
    and head for the sequence orientation)."""
    chunks = 2 if zigzag else 1
    c = seqlen_local // chunks
    n = batch * seqlen_local * kv_heads * head_dim
    hdim_scales = batch * seqlen_local * kv_heads * -(-head_dim // 32)
    seq_scales = chunks * batch * -(-c // 32) * kv_heads * head_dim
    fwd = 2 * n + hdim_scales + seq_scales
    bwd_kv = 3 * n + 2 * hdim_scales + seq_scales
    k_exps = 4 * batch * -(-seqlen_local // 128) * kv_heads
    v_exps = 4 * batch * kv_heads * head_dim
    return {
        "fwd_mxfp8": fwd,
        "fwd_bf16": 4 * n,
        "fwd_ratio": fwd / (4 * n),
        "bwd_kv_mxfp8": bwd_kv,
        "bwd_kv_bf16": 4 * n,
        "bwd_grad_fp32": 8 * n,
        "bwd_grad_bf16": 4 * n,
        "fwd_row_scaled": 2 * n + k_exps + v_exps,
        "bwd_kv_row_scaled": 3 * n + 2 * k_exps + v_exps,
    }


# ----------------------------------------------------------------------------------------------
# Block functions: one (q chunk, k chunk) pair on this rank
# ----------------------------------------------------------------------------------------------


def _quantize(x: torch.Tensor, dims: Sequence[int]) -> list[MXTensor]:
    """MXFP8 of a (B, S, H, D) shard along each of ``dims`` (3: head dim, 1: sequence): the Triton quantizer from
    one read on CUDA (bit-exact with ``formats.quantize_mxfp8``), the reference quantizer elsewhere."""
    if x.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        from mxattn.kernels.quantize import quantize_mxfp8_triton

        kind = {(3,): "hdim", (1,): "seq", (3, 1): "both"}[tuple(dims)]
        got = quantize_mxfp8_triton(x, kind, seq_dim=1)
        return list(got) if kind == "both" else [got]
    return [formats.quantize_mxfp8(x, dim=d) for d in dims]


def _roundtrip(x: torch.Tensor, dim: int) -> torch.Tensor:
    return formats.quantize_mxfp8(x, dim).dequantize(x.dtype)


class ReferenceBlock:
    """Block function on the reference (plain PyTorch, any device; the CPU path).

    ``forward(q, k, v, causal, scale)``: q float (B, c, Hq, D), k MXTensor (head dim), v MXTensor (sequence)
    -> out (B, c, Hq, D) fp32, lse (B, Hq, c), lse_bwd (B, Hq, c).  ``causal`` means the square diagonal block.
    ``backward(q, k, k_seq, v_hdim, out, dout, lse_bwd, causal, scale)`` -> dq, dk, dv fp32 of this block,
    with P = exp(S - lse_bwd) for the *global* lse: ``reference.attention_backward``'s formulas and switches,
    restricted to one block (the reference recomputes the lse of whole rows, which one block cannot).

    ``emulate_fp8=True`` (default) emulates the kernels' low-precision steps as ``mxfp8_attn_func`` does on the
    CPU (P in e4m3 in the forward; P, dS, dO in the backward); ``False`` gives exact attention of the MXFP8
    inputs, which lets a test check the ring and the merge to fp32 rounding.
    """

    def __init__(self, emulate_fp8: bool = True):
        self.emulate_fp8 = emulate_fp8

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        """(B, Hq, Sq, Sk) scaled scores, -inf above the diagonal when ``causal`` (square block)."""
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        if causal:
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        return s

    def forward(self, q, k: MXTensor, v: MXTensor, causal: bool, scale: float):
        qm = formats.quantize_mxfp8(q, dim=3)
        out, lse = reference.attention_forward(
            qm, k, v, causal=causal, softmax_scale=scale, quantize_p=self.emulate_fp8, dtype=torch.float32
        )
        if not self.emulate_fp8:
            return out, lse, lse
        s = self._scores(qm.dequantize(), k.dequantize(), causal, scale)
        return out, lse, torch.logsumexp(s, dim=-1)

    def backward(self, q, k: MXTensor, k_seq: MXTensor, v_hdim: MXTensor, out, dout, lse, causal: bool, scale: float):
        f32, e = torch.float32, self.emulate_fp8
        B, _, Hq, _ = q.shape
        Hkv = k.shape[2]
        group = Hq // Hkv
        qh = formats.quantize_mxfp8(q, dim=3).dequantize(f32)
        qs = formats.quantize_mxfp8(q, dim=1).dequantize(f32)
        ks = k_seq.dequantize(f32).repeat_interleave(group, dim=2)
        vh = v_hdim.dequantize(f32).repeat_interleave(group, dim=2)
        out, dout = out.to(f32), dout.to(f32)
        do_h = _roundtrip(dout, 3) if e else dout  # for dP and D
        do_s = _roundtrip(dout, 1) if e else dout  # for dV, blocks along q
        delta = (do_h * out).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, Hq, Sq, 1)
        s = self._scores(qh, k.dequantize(f32), causal, scale)
        lse = lse.to(f32).unsqueeze(-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
        p_v = formats.round_to_e4m3(p * 256.0).to(f32) / 256.0 if e else p
        dp = torch.einsum("bqhd,bkhd->bhqk", do_h, vh)
        ds = p * (dp - delta)
        ds_kv = _roundtrip(ds, -1) if e else ds
        ds_q = _roundtrip(ds, -2) if e else ds
        dq = torch.einsum("bhqk,bkhd->bqhd", ds_kv, ks) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds_q, qs) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p_v, do_s)
        Sk = dk.shape[1]
        dk = dk.reshape(B, Sk, Hkv, group, -1).sum(3)
        dv = dv.reshape(B, Sk, Hkv, group, -1).sum(3)
        return dq, dk, dv


class KernelBlock:
    """Block function on the Hopper FP8 kernels (CUDA): row-scaled operands (``row_scaled_triton``),
    ``attn_fwd_hopper`` / ``attn_fwd_gluon`` / ``attn_bwd_hopper`` with the global out and lse.

    Visiting K/V travel as MXFP8 (FP8 data and one E8M0 scale per 32 elements, 0.516x BF16's bytes) and each call
    re-expresses what it gets.  ``row_scaled_wire=True``, when chunks are a multiple of 128 tokens (``kv_operands``):
    each rank makes the Hopper operands of its own K/V shard once per pass, straight from the float tensors, and
    those travel instead (0.500x BF16's bytes, no per-step re-expression; one exponent per 128 keys for the head-dim
    orientation, one per channel over the shard for the sequence orientation).  On 2 H200 both run at the same speed
    (1.86x one GPU at 64k, ``benchmarks/results/ring_attn-nvidia-h200-x2-2026-11-30-wires.json``), so the default is
    the MX contract's wire.

    The query side (Q per row for the forward; Q and dO in both orientations for the backward) is made once per
    pass for the whole shard and sliced per call (``takes_rows``: the ring passes the full q, out, dout, lse and the
    call's ``rows``); it is kept until ``begin`` (called by the ring at the start of each pass, and ``end`` after
    it).  Rows that cut the backward's 128-row exponent groups get their own operands.  The sequence-orientation
    operands of a slice keep the whole shard's per-channel exponent (re-expression lemma, DESIGN §3).
    The tests compare the two wires.  CPU tests run it through the Triton interpreter (tests/test_distributed.py); on
    GPUs ``python -m mxattn.distributed --check``."""

    takes_rows = True  # forward/backward take the whole shard's q (out, dout, lse) and rows=
    writes_grads_into = True  # backward(..., dk_out=, dv_out=) writes dK, dV there (fp32 views of the ring buffer)

    def __init__(self, row_scaled_wire: bool = False):
        self._cache: dict = {}
        self.row_scaled_wire = row_scaled_wire

    def begin(self) -> None:
        self._cache.clear()

    end = begin

    def _once(self, key: tuple, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def kv_operands(self, k, v, backward: bool, chunk: int):
        """This rank's K/V shard as the operands that travel (whole shard; the ring slices them per call):
        forward [K head-dim (K layout), V sequence (V layout)], backward [K head-dim, K sequence, V head-dim];
        None (MXFP8 travels instead) unless ``row_scaled_wire`` and chunks are a multiple of the 128-key exponent
        group."""
        from mxattn.kernels.attn_bwd import EXP_GROUP
        from mxattn.kernels.attn_fwd import K_EXP_GROUP
        from mxattn.kernels.quantize import row_scaled_triton

        if not self.row_scaled_wire or chunk % EXP_GROUP or chunk % K_EXP_GROUP:
            return None
        if backward:
            return [row_scaled_triton(k, "k"), row_scaled_triton(k, "v"), row_scaled_triton(v, "k")]
        return [row_scaled_triton(k, "k"), row_scaled_triton(v, "v")]

    def forward(self, q, k, v, causal: bool, scale: float, rows: slice | None = None):
        from mxattn.interface import forward_kernel_for
        from mxattn.kernels.attn_fwd import attn_fwd_hopper
        from mxattn.kernels.quantize import row_scaled_triton

        rows = slice(0, q.shape[1]) if rows is None else rows
        full = self._once(("fq", q.data_ptr(), tuple(q.shape)), lambda: row_scaled_triton(q.contiguous(), "q"))
        qr = _rows(full, rows.start, rows.stop)  # one exponent per row: any slice is exact
        kr = k if isinstance(k, RowScaledFP8) else row_scaled_triton(k, "k")
        vr = v if isinstance(v, RowScaledFP8) else row_scaled_triton(v, "v")
        kernel = attn_fwd_hopper
        if q.is_cuda and forward_kernel_for(qr.data.shape, kr.data.shape, q.device) == "gluon":  # single-GPU choice
            from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon as kernel
        out, lse = kernel(qr, kr, vr, causal=causal, softmax_scale=scale, out_dtype=torch.float32)
        return out, lse, lse

    def backward(self, q, k, k_seq, v_hdim, out, dout, lse, causal: bool, scale: float,
                 dk_out=None, dv_out=None, rows: slice | None = None):
        from mxattn.kernels.attn_bwd import DO_EXP_GROUP, Q_EXP_GROUP, attn_bwd_hopper
        from mxattn.kernels.quantize import row_scaled_triton

        S = q.shape[1]
        rows = slice(0, S) if rows is None else rows
        g = math.lcm(Q_EXP_GROUP, DO_EXP_GROUP)
        whole = rows.start % g == 0 and (rows.stop % g == 0 or rows.stop == S)
        src = slice(0, S) if whole else rows  # the rows the query-side operands are made of

        def q_side():
            qc, dc = q[:, src].contiguous(), dout[:, src].contiguous()
            return (row_scaled_triton(qc, "k", k_group=Q_EXP_GROUP), row_scaled_triton(qc, "v"),
                    row_scaled_triton(dc, "k", k_group=DO_EXP_GROUP), row_scaled_triton(dc, "v"))

        made = self._once(("bq", q.data_ptr(), dout.data_ptr(), tuple(q.shape), src.start, src.stop), q_side)
        a, b = (rows.start, rows.stop) if whole else (0, rows.stop - rows.start)
        qh, qs, doh, dos = (_rows(t, a, b) for t in made)
        as_k = lambda t: t if isinstance(t, RowScaledFP8) else row_scaled_triton(t, "k")
        ks = k_seq if isinstance(k_seq, RowScaledFP8) else row_scaled_triton(k_seq, "v")
        # dq as a callable that launches the dQ kernel: the ring sends dK/dV on before it runs
        return attn_bwd_hopper(
            qh, as_k(k), as_k(v_hdim), qs, ks, out[:, rows], dout[:, rows], lse[:, :, rows].contiguous(),
            causal=causal, softmax_scale=scale, grad_dtype=torch.float32, dout_hdim=doh, dout_seq=dos,
            defer_dq=True, dk_out=dk_out, dv_out=dv_out,
        )


# ----------------------------------------------------------------------------------------------
# Ring forward and backward
# ----------------------------------------------------------------------------------------------


def _merge_into(acc, rows: slice, o, lse, lse_bwd, dest: torch.Tensor | None = None) -> None:
    """Log-sum-exp merge of a block's partial (out, lse) over query ``rows`` into the running (out, lse, lse_bwd)
    ``acc`` in place (fp32; out (B, S, H, D), lse (B, H, S)); a side whose lse is -inf (it saw nothing) weighs 0.
    ``dest`` (the rows' final output, any float dtype): the merged rows are written there instead of into acc's
    out (the last merge of those rows: no fp32 store and no separate cast pass; the same numbers, cast once)."""
    out, acc_lse, acc_bwd = acc
    a, al = out[:, rows], acc_lse[:, :, rows]
    lse = lse.float()
    new = torch.logaddexp(al, lse)

    def weight(x):  # (B, H, S) -> (B, S, H, 1)
        w = torch.where(torch.isneginf(x), torch.zeros_like(x), torch.exp(x - new))
        return w.transpose(1, 2).unsqueeze(-1)

    a.mul_(weight(al))
    if dest is None:
        a.addcmul_(o.float(), weight(lse))
    else:
        torch.addcmul(a, o.float(), weight(lse), out=dest)
    al.copy_(new)
    acc_bwd[:, :, rows] = torch.logaddexp(acc_bwd[:, :, rows], lse_bwd.float())


def _chunks(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return list(x.chunk(n, dim)) if n > 1 else [x]


def _cat_mx(parts: Sequence[MXTensor]) -> MXTensor:
    """MXTensors of consecutive chunks as one along the sequence (dim 1; every chunk a multiple of 32 tokens)."""
    if len(parts) == 1:
        return parts[0]
    data = torch.cat([t.data.view(torch.uint8) for t in parts], 1).view(torch.float8_e4m3fn)
    return MXTensor(data, torch.cat([t.scale_bytes for t in parts], 1), parts[0].dim)


def _kv_operands(block, k, v, n: int, c: int, merge: bool, backward: bool) -> list[list]:
    """The K/V operands this rank sends round the ring, per role (forward: K head-dim blocks, V sequence blocks;
    backward: K head-dim, K sequence, V head-dim), each a list of parts.

    With ``merge`` (chunks of a multiple of 32 tokens) one part covers the whole shard: the block's own operands
    (``block.kv_operands``, e.g. ``KernelBlock``'s Hopper format) or MXFP8 of the whole shard from one quantizer
    launch per tensor, byte for byte the per-chunk MXFP8 (sequence blocks start at every chunk border).  Calls take
    views of it (``_cols``).  Otherwise one MXFP8 part per chunk (sequence blocks restart at each chunk)."""
    make = getattr(block, "kv_operands", None)
    if merge and make is not None:
        got = make(k, v, backward, c)
        if got is not None:
            return [[op] for op in got]
    pairs = [(k, v)] if merge else list(zip(_chunks(k, n, 1), _chunks(v, n, 1)))
    roles = [[] for _ in range(3 if backward else 2)]
    for kj, vj in pairs:
        got = _quantize(kj, (3, 1)) + _quantize(vj, (3,)) if backward else _quantize(kj, (3,)) + _quantize(vj, (1,))
        for role, op in zip(roles, got):
            role.append(op)
    return roles


def _cols(parts: Sequence, j0: int, j1: int, c: int):
    """The operand of local chunks j0..j1 of a visiting shard: a view of the whole-shard part, or the chunk's own
    part (a concatenation only if a call ever spanned several per-chunk parts, which ``_step_calls`` never makes)."""
    if len(parts) == 1:
        return _rows(parts[0], j0 * c, j1 * c)
    return parts[j0] if j1 - j0 == 1 else _cat_mx(parts[j0:j1])


def _step_calls(mine: Sequence[int], theirs: Sequence[int], causal: bool, merge: bool) -> list[tuple]:
    """The block-function calls of one ring step, as ((q first, q end), (k first, k end), causal) in local chunk
    indices.  With ``merge`` (chunks of a multiple of 32 tokens, so MX blocks never straddle a chunk border) the
    step's blocks become one call where they can: a rectangle of full blocks is one non-causal call, and a rank's
    own two zig-zag chunks (diag, full, skip, diag) are causal attention over their concatenation.  Otherwise
    one call per block that is not skipped."""
    kinds = {(i, j): _block_kind(qi, kj, causal) for i, qi in enumerate(mine) for j, kj in enumerate(theirs)}
    live = [ij for ij, kind in kinds.items() if kind != _SKIP]
    if merge and live:
        rows = sorted({i for i, _ in live})
        cols = sorted({j for _, j in live})
        span = rows == list(range(rows[0], rows[-1] + 1)) and cols == list(range(cols[0], cols[-1] + 1))
        if span and len(live) == len(rows) * len(cols) and all(kinds[ij] == _FULL for ij in live):
            return [((rows[0], rows[-1] + 1), (cols[0], cols[-1] + 1), False)]
        n = len(mine)
        lower = {(i, j): _DIAG if i == j else (_FULL if i > j else _SKIP) for i in range(n) for j in range(n)}
        if len(theirs) == n and kinds == lower:
            return [((0, n), (0, n), True)]
    return [((i, i + 1), (j, j + 1), kinds[(i, j)] == _DIAG) for i, j in live]


def _empty_state(q: torch.Tensor, head_dim_v: int) -> list[torch.Tensor]:
    """The running (out, lse, lse_bwd) of query rows that have seen no key yet: zeros and -inf, fp32."""
    B, S, H, _ = q.shape
    return [q.new_zeros((B, S, H, head_dim_v), dtype=torch.float32),
            q.new_full((B, H, S), float("-inf"), dtype=torch.float32),
            q.new_full((B, H, S), float("-inf"), dtype=torch.float32)]


def _copy_rows_except(dest: torch.Tensor, src: torch.Tensor, rows: slice) -> None:
    """``dest[:, i] = src[:, i]`` (cast to dest's dtype) for every row i outside ``rows`` (dim 1)."""
    for other in (slice(0, rows.start), slice(rows.stop, src.shape[1])):
        if other.stop > other.start:
            dest[:, other].copy_(src[:, other])


def _ring_forward(q, k, v, ring: _Ring, causal, scale, zigzag, block):
    """This rank's (out in q's dtype, lse, lse_bwd) after W ring steps."""
    W, r = ring.world, ring.rank
    n = 2 if zigzag else 1
    getattr(block, "begin", lambda: None)()
    S = q.shape[1]
    c = S // n
    merge = c % 32 == 0
    mine = _chunk_ids(r, W, zigzag)
    takes_rows = getattr(block, "takes_rows", False)
    ops = _kv_operands(block, k, v, n, c, merge, backward=False)
    wire, spec = _to_wire(ops)
    # the running (out, lse, lse_bwd) of every query row, fp32: the first call that covers every row gives it (a
    # rank's own pair at step 0 when steps are merged: no copy); otherwise it starts empty (zeros, -inf).  The last
    # step's merge writes the output in q's dtype directly when that step is one call (always, with merged steps).
    acc, out = None, None
    for step in range(W):
        pending = ring.exchange(wire, _TAG_KV, _LAST_STATS.fwd_kv_bytes) if step + 1 < W else None
        visiting = ops if step == 0 else _from_wire(wire, spec)
        theirs = _chunk_ids((r - step) % W, W, zigzag)
        calls = _step_calls(mine, theirs, causal, merge)
        for (i0, i1), (j0, j1), diag in calls:
            rows = slice(i0 * c, i1 * c)
            kk, vv = (_cols(visiting[t], j0, j1, c) for t in range(2))
            if takes_rows:
                o, lse, lse_bwd = block.forward(q, kk, vv, diag, scale, rows=rows)
            else:
                o, lse, lse_bwd = block.forward(q[:, rows], kk, vv, diag, scale)
            if acc is None and rows == slice(0, S):
                acc = [o.float(), lse.float(), lse_bwd.float().clone() if lse_bwd is lse else lse_bwd.float()]
                continue
            if acc is None:
                acc = _empty_state(q, v.shape[-1])
            if step == W - 1 and len(calls) == 1:  # the last merge of these rows
                out = torch.empty(acc[0].shape, dtype=q.dtype, device=q.device)
                _merge_into(acc, rows, o, lse, lse_bwd, dest=out[:, rows])
                _copy_rows_except(out, acc[0], rows)
            else:
                _merge_into(acc, rows, o, lse, lse_bwd)
        if pending is not None:
            wire = pending.wait()
    getattr(block, "end", lambda: None)()
    if acc is None:  # no row saw a key
        acc = _empty_state(q, v.shape[-1])
    return (out if out is not None else acc[0].to(q.dtype)), acc[1], acc[2]


def _ring_backward(q, k, v, out, dout, lse_bwd, ring: _Ring, causal, scale, zigzag, block, grad_comm_dtype):
    """dq, dk, dv of this rank's shard, in the inputs' dtypes.

    dK/dV: the partial sums a rank makes for its own shard at step 0 stay with it; at steps 1..W-1 each rank makes
    those of the visiting shard, adds what the previous rank sent for that shard (from step 2) and sends the sum
    on; after step W-1 the sums of every other rank arrive at the owner, which adds its own, cast to the inputs'
    dtype in the same pass.  W-1 hops of partial sums per rank."""
    W, r = ring.world, ring.rank
    n = 2 if zigzag else 1
    getattr(block, "begin", lambda: None)()
    S = q.shape[1]
    c = S // n
    merge = c % 32 == 0
    mine = _chunk_ids(r, W, zigzag)
    takes_rows = getattr(block, "takes_rows", False)
    ops = _kv_operands(block, k, v, n, c, merge, backward=True)
    wire, spec = _to_wire(ops)
    dq = None  # fp32; the first call that covers every query row gives it (a rank's own pair at step 0)
    dq_final = None  # in q's dtype, written by the last step's add when that step is one call
    own = None  # this rank's own dK/dV partial sums (step 0), fp32
    grad_pending = None
    for step in range(W):
        kv_pending = ring.exchange(wire, _TAG_KV, _LAST_STATS.bwd_kv_bytes) if step + 1 < W else None
        visiting = ops if step == 0 else _from_wire(wire, spec)
        theirs = _chunk_ids((r - step) % W, W, zigzag)
        calls = _step_calls(mine, theirs, causal, merge)
        # this step's dK, dV partial sums of the visiting shard, in one flat buffer (the one that travels on).  A
        # block that writes into given tensors (KernelBlock) stores them straight into it when no two calls of the
        # step share key columns (the merged steps: one call); columns no call covers are zeroed.  Otherwise the
        # buffer starts at zero and each call's result is added.
        cols_of = [set(range(j0, j1)) for _, (j0, j1), _ in calls]
        direct = getattr(block, "writes_grads_into", False) and sum(map(len, cols_of)) == len(set().union(*cols_of))
        acc = (torch.empty if direct else torch.zeros)(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
        dk, dv = acc[: k.numel()].view(k.shape), acc[k.numel():].view(v.shape)
        if direct:
            for j in set(range(n)) - set().union(*cols_of):
                dk[:, j * c : (j + 1) * c].zero_()
                dv[:, j * c : (j + 1) * c].zero_()
        dq_parts = []
        for (i0, i1), (j0, j1), diag in calls:
            rows, cols = slice(i0 * c, i1 * c), slice(j0 * c, j1 * c)
            kw = dict(dk_out=dk[:, cols], dv_out=dv[:, cols]) if direct else {}
            kvs = [_cols(visiting[t], j0, j1, c) for t in range(3)]
            if takes_rows:
                bq, bk, bv = block.backward(q, *kvs, out, dout, lse_bwd, diag, scale, rows=rows, **kw)
            else:
                bq, bk, bv = block.backward(q[:, rows], *kvs, out[:, rows], dout[:, rows], lse_bwd[:, :, rows],
                                            diag, scale, **kw)
            if not direct:
                dk[:, cols] += bk
                dv[:, cols] += bv
            dq_parts.append((rows, bq))
        if step == 0:
            own = acc  # stays here: added to the others' sums at the end
        else:
            if grad_pending is not None:  # partial sums of this shard from the ranks it visited before
                acc += grad_pending.wait()[0].float()
            grad_pending = ring.exchange([acc.to(grad_comm_dtype)], _TAG_GRAD, _LAST_STATS.bwd_grad_bytes)
        # dQ after the send: a block may return it as a callable that launches its kernel (KernelBlock), so that
        # the dK/dV hop (the last one is otherwise exposed) travels while dQ is computed
        for rows, bq in dq_parts:
            bq = bq() if callable(bq) else bq
            if dq is None and rows == slice(0, S) and bq.dtype == torch.float32:
                dq = bq  # the first contribution to every row: no zero-fill, no add
                continue
            if dq is None:
                dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            if step == W - 1 and len(dq_parts) == 1:  # the last contribution: add and cast in one pass
                dq_final = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                torch.add(dq[:, rows], bq, out=dq_final[:, rows])
                _copy_rows_except(dq_final, dq, rows)
            else:
                dq[:, rows] += bq
        if kv_pending is not None:
            wire = kv_pending.wait()
    getattr(block, "end", lambda: None)()
    if dq_final is None:
        dq_final = (dq.to(q.dtype) if dq is not None  # (dq None: no call saw a query row, not in self-attention)
                    else torch.zeros(q.shape, dtype=q.dtype, device=q.device))
    grads = torch.empty(k.numel() + v.numel(), dtype=k.dtype, device=k.device)
    if grad_pending is not None:  # the other ranks' sums of this rank's shard, plus its own, cast in one pass
        torch.add(own, grad_pending.wait()[0], out=grads)
    else:
        grads.copy_(own)
    dk, dv = grads.split([k.numel(), v.numel()])
    return dq_final, dk.view(k.shape), dv.view(v.shape)


class _RingMXFP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, zigzag, block, grad_comm_dtype):
        _LAST_STATS.fwd_kv_bytes.clear()
        out, lse, lse_bwd = _ring_forward(q, k, v, ring, causal, scale, zigzag, block)
        out = out.to(q.dtype)
        ctx.ring, ctx.causal, ctx.scale, ctx.zigzag, ctx.block = ring, causal, scale, zigzag, block
        ctx.grad_comm_dtype = grad_comm_dtype
        ctx.save_for_backward(q, k, v, out, lse_bwd)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse_bwd = ctx.saved_tensors
        _LAST_STATS.bwd_kv_bytes.clear()
        _LAST_STATS.bwd_grad_bytes.clear()
        dq, dk, dv = _ring_backward(
            q, k, v, out, dout, lse_bwd, ctx.ring, ctx.causal, ctx.scale, ctx.zigzag, ctx.block, ctx.grad_comm_dtype
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _check_inputs(q, k, v, zigzag, world, softmax_scale, grad_comm_dtype):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (a local shard), got {type(t).__name__}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(f"{name} must have shape (batch, seqlen_local, nheads, headdim), got {tuple(t.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, local length and head dim")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[3]} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"the number of query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"a zig-zag shard holds two equal chunks: seqlen_local must be even, got {q.shape[1]}")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite positive float, got {softmax_scale!r}")
    if grad_comm_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_comm_dtype must be torch.float32 or torch.bfloat16, got {grad_comm_dtype}")


def ring_mxfp8_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    zigzag: bool = True,
    return_lse: bool = False,
    *,
    grad_comm_dtype: torch.dtype = torch.float32,
    block=None,
):
    """Context-parallel MXFP8 attention: each rank of ``group`` passes its sequence shard.

    Args:
        q: (B, S_local, Hq, D) bfloat16/float16/float32, this rank's shard (``zigzag_shard`` layout when
            ``zigzag``, else the contiguous chunk ``rank`` of W).
        k, v: (B, S_local, Hkv, D), same dtype and device; Hq a multiple of Hkv; D in {64, 128}.
        group: a ``torch.distributed`` process group (default: the world).  Every rank calls with the same
            shapes and arguments.
        causal: causal over the *global* sequence (query i sees key j <= i).
        softmax_scale: defaults to 1/sqrt(D).
        zigzag: the layout of the shards (module docstring); True balances causal work over ranks.
        return_lse: also return this shard's lse, (B, Hq, S_local) float32, natural log.
        grad_comm_dtype: dtype of the dK/dV partial sums sent around the ring in the backward (float32 or
            bfloat16; accumulation is fp32 on each rank either way).
        block: the per-block function (``ReferenceBlock``, ``KernelBlock`` or anything with their methods);
            default: ``KernelBlock`` for CUDA tensors, ``ReferenceBlock()`` otherwise.

    Returns this rank's shard of the output (B, S_local, Hq, D) in q's dtype (and the lse).  Gradients flow to
    q, k, v through ``loss.backward()`` (a second ring pass; module docstring).  MXFP8 blocks along the
    sequence (V forward, K backward, Q/dO/dS backward) start at each chunk's first token: with chunks of a
    multiple of 32 tokens the operands are those of single-process ``mxfp8_attn_func`` on the gathered tensors.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_mxfp8_attn_func needs an initialised torch.distributed process group")
    for name, flag in (("causal", causal), ("zigzag", zigzag), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    ring = _Ring(group)
    _check_inputs(q, k, v, zigzag, ring.world, softmax_scale, grad_comm_dtype)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if block is None:
        block = KernelBlock() if q.device.type == "cuda" else ReferenceBlock()
    out, lse = _RingMXFP8Attention.apply(q, k, v, ring, causal, scale, zigzag, block, grad_comm_dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# GPU benchmark (not run here: needs 2-8 GPUs)
# ----------------------------------------------------------------------------------------------


def _time_per_iter(fn, iters: int, together: bool = True) -> float:
    """Seconds per call of ``fn`` on this rank after one warm-up call; ``together``: all ranks start at once
    (a barrier, so every rank must call it)."""
    fn()
    torch.cuda.synchronize()
    if together:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _wire_time(nbytes: int, ring: _Ring, iters: int) -> float:
    """Seconds one ring hop of an ``nbytes`` uint8 buffer takes (all ranks send and receive at once)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    return _time_per_iter(lambda: ring.exchange([buf], _TAG_KV, []).wait(), iters)


def bench_ring(
    seqlens: Sequence[int] = (65536, 131072, 262144),
    batch: int = 1,
    heads: int = 16,
    kv_heads: int = 16,
    head_dim: int = 128,
    causal: bool = True,
    iters: int = 5,
    outdir: Optional[str] = "benchmarks/results",
    single: bool = True,
    progress: bool = True,
    profile: bool = False,
    check_rows: Optional[list[dict]] = None,
    wires: Sequence[str] = ("mxfp8",),
) -> list[dict]:
    """Time ring MXFP8 attention forward and forward+backward on the initialised (nccl) process group.

    Launch (one process per GPU; multicast off, DESIGN/KINDS notes)::

        NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 8 -m mxattn.distributed \\
            --seqlen 65536 131072 262144 --heads 16 --head-dim 128 --causal

    ``seqlens`` are global (all ranks together) and divisible by 2*W*32 (zig-zag chunks of a multiple of 32).
    Rows: per-GPU TFLOP/s (4·B·H·S²·D, half when causal, ×2.5 for the backward, divided by W), milliseconds;
    with ``single``, rank 0 also times single-GPU ``mxfp8_attn_func`` on the whole sequence (the other ranks
    wait) and the row gets ``speedup_vs_1gpu`` = single time / ring time.  Wire: the bytes this rank sent per
    forward step (``last_ring_stats``, measured; ``format``: what traveled, MXFP8 or the Hopper operands of
    ``row_scaled_wire``; the byte key keeps its old name) against a BF16 ring's K+V, and the time of one ring hop
    of each payload.  Rank 0 writes ``ring_attn-<gpu>-x<W>-<date>.json`` to ``outdir``.  With ``profile``, every rank
    also runs two forward+backward passes under ``torch.profiler`` and rank 0's row gets its device time per kernel
    (``profile_fwd_bwd``: where the time over half the single-GPU time goes; NCCL kernels overlap the others).
    ``check_rows`` (``check_ring``'s rows from the same process group) go into the JSON under ``check``.
    ``wires``: one row per wire format and sequence length, all against the same single-GPU time:
    ``"row_scaled"`` (``KernelBlock(row_scaled_wire=True)``: the kernels' operands travel) and ``"mxfp8"``
    (``KernelBlock()``: FP8 with one E8M0 scale per 32 elements travels, each call re-expresses it).
    """
    for w in wires:
        if w not in ("row_scaled", "mxfp8"):
            raise ValueError(f"wire format {w!r}: expected 'row_scaled' or 'mxfp8'")
    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    ring = _Ring(None)
    rows = []
    show = progress and rank == 0
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    todo = tqdm(seqlens, desc=f"ring x{W}", disable=not show) if tqdm else seqlens
    for S in todo:
        if S % (2 * W * 32):
            raise ValueError(f"seqlen {S} must be divisible by 2*world*32 = {2 * W * 32}")
        sl = S // W
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        q, k, v = (
            torch.randn(batch, sl, h, head_dim, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            for h in (heads, kv_heads, kv_heads)
        )
        dout = torch.randn(batch, sl, heads, head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
        bf16_step = 2 * k.numel() * 2
        step_bytes = ring_step_bytes(batch, sl, kv_heads, head_dim)
        flops = 4 * batch * heads * S * S * head_dim * (0.5 if causal else 1.0)
        s_rows = []
        for wire in wires:
            blk = KernelBlock(row_scaled_wire=wire == "row_scaled")

            def ring_call(**kw):
                return ring_mxfp8_attn_func(q, k, v, causal=causal, block=blk, **kw)

            t_fwd = _time_per_iter(ring_call, iters)
            t_all = _time_per_iter(lambda: ring_call().backward(dout), iters)
            # dK/dV partial sums sent as BF16 (half the grad bytes)
            t_bf16 = _time_per_iter(lambda: ring_call(grad_comm_dtype=torch.bfloat16).backward(dout), iters)
            if profile:  # every rank profiles (the ring needs all of them); rank 0 keeps its table
                from mxattn.bench.profiling import profile_kernels

                prof = profile_kernels(lambda: ring_call().backward(dout))
            sent = last_ring_stats().fwd_kv_bytes
            mx_step = max(sent) if sent else 0
            row = {
                "B": batch, "Hq": heads, "Hkv": kv_heads, "S": S, "D": head_dim, "causal": causal, "world": W,
                "wire": wire,
                "ms": {"fwd": t_fwd * 1e3, "fwd_bwd": t_all * 1e3, "fwd_bwd_bf16_grad_comm": t_bf16 * 1e3},
                "tflops_per_gpu": {"fwd": flops / W / t_fwd / 1e12, "fwd_bwd": 3.5 * flops / W / t_all / 1e12},
                "wire_bytes_per_step": step_bytes,
                "wire_measured": {"fwd_step_bytes_mxfp8": mx_step, "fwd_step_bytes_bf16": bf16_step,
                                  "ratio": mx_step / bf16_step,  # what traveled: the Hopper operands or MXFP8
                                  "format": "row_scaled" if mx_step == step_bytes["fwd_row_scaled"] else "mxfp8"},
            }
            if profile:
                row["profile_fwd_bwd"] = prof
            s_rows.append(row)
        q = k = v = dout = None  # free before the single-GPU baseline
        if W > 1:
            for row in s_rows:
                mx_step = row["wire_measured"]["fwd_step_bytes_mxfp8"]
                t_mx = _wire_time(mx_step, ring, iters)
                t_bf = _wire_time(bf16_step, ring, iters)
                row["wire_measured"] |= {"hop_ms_mxfp8": t_mx * 1e3, "hop_ms_bf16": t_bf * 1e3,
                                         "hop_GBps_mxfp8": mx_step / t_mx / 1e9,
                                         "hop_GBps_bf16": bf16_step / t_bf / 1e9}
        if single:
            if rank == 0:
                from mxattn.interface import mxfp8_attn_func

                gq, gk, gv = (torch.randn(batch, S, h, head_dim, device=dev, dtype=torch.bfloat16,
                                          generator=gen).requires_grad_() for h in (heads, kv_heads, kv_heads))
                gd = torch.randn(batch, S, heads, head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
                s_fwd = _time_per_iter(lambda: mxfp8_attn_func(gq, gk, gv, causal=causal), iters, together=False)
                s_all = _time_per_iter(lambda: mxfp8_attn_func(gq, gk, gv, causal=causal).backward(gd), iters,
                                       together=False)
                del gq, gk, gv, gd
                torch.cuda.empty_cache()
                for row in s_rows:
                    row["single_gpu_ms"] = {"fwd": s_fwd * 1e3, "fwd_bwd": s_all * 1e3}
                    row["speedup_vs_1gpu"] = {"fwd": s_fwd * 1e3 / row["ms"]["fwd"],
                                              "fwd_bwd": s_all * 1e3 / row["ms"]["fwd_bwd"]}
            dist.barrier()
        rows.extend(s_rows)
        if show:
            for row in s_rows:
                print(json.dumps(row), flush=True)
    if rank == 0 and outdir:
        from mxattn.bench.results import env_info, gpu_slug

        env = env_info(dev)
        path = os.path.join(outdir, f"ring_attn-{gpu_slug(str(env['gpu']))}-x{W}-{env['date']}.json")
        os.makedirs(outdir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"what": "ring_attn", **env, "rows": rows, **({"check": check_rows} if check_rows else {})},
                      f, indent=1)
    return rows


def check_ring(
    seqlen: int = 8192, batch: int = 1, heads: int = 8, kv_heads: int = 2, head_dim: int = 128, seed: int = 0,
) -> list[dict]:
    """Ring MXFP8 attention on the initialised (nccl) process group against single-GPU ``mxfp8_attn_func``
    (on CPU processes with gloo where there is no GPU: the reference blocks, same bounds).

    Every rank builds the same global q, k, v, dout (seeded on the CPU), runs the ring forward and backward on its
    zig-zag shard (causal) and its contiguous chunk (not causal); rank 0 gathers the shards, runs the single-GPU
    function on the gathered inputs and compares both with fp64 attention on the MX-dequantized inputs.  Pass
    (the bounds of tests/test_distributed.py, measured there on the reference blocks): the ring's output SQNR no
    more than 3 dB below the single-GPU call's, lse within 0.05, and each gradient within 25 dB SQNR of the
    single-GPU autograd gradients (the same FP8 steps, different P rounding per block).  Returns one row per
    case on rank 0 (with ``ok``), raises AssertionError on rank 0 when a bound fails.
    """
    from mxattn.interface import mxfp8_attn_func

    W, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for causal, zigzag in ((True, True), (False, False)):
        g = torch.Generator().manual_seed(seed)
        full = [torch.randn(batch, seqlen, h, head_dim, generator=g).to(dev, torch.bfloat16)
                for h in (heads, kv_heads, kv_heads, heads)]
        shard = (lambda x: zigzag_shard(x, rank, W)) if zigzag else (lambda x: x.chunk(W, 1)[rank])
        ql, kl, vl = (shard(t).contiguous().requires_grad_() for t in full[:3])
        out, lse = ring_mxfp8_attn_func(ql, kl, vl, causal=causal, zigzag=zigzag, return_lse=True)
        out.backward(shard(full[3]).contiguous())

        def gathered(x, dim=1):
            parts = [torch.empty_like(x) for _ in range(W)]
            dist.all_gather(parts, x.contiguous())
            return zigzag_unshard(parts, dim) if zigzag else torch.cat(parts, dim)

        got = [gathered(out), gathered(lse, 2), gathered(ql.grad), gathered(kl.grad), gathered(vl.grad)]
        if rank != 0:
            continue
        q, k, v, dout = full
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        s_out, s_lse = mxfp8_attn_func(qs, ks, vs, causal=causal, return_lse=True)
        s_out.backward(dout)
        qm, km, vm = formats.quantize_mxfp8(q, 3), formats.quantize_mxfp8(k, 3), formats.quantize_mxfp8(v, 1)
        truth, _ = reference.attention_forward(qm, km, vm, causal=causal)
        row = {"S": seqlen, "B": batch, "Hq": heads, "Hkv": kv_heads, "D": head_dim, "causal": causal,
               "zigzag": zigzag, "world": W,
               "out_sqnr_db": {"ring": reference.sqnr_db(got[0], truth), "single": reference.sqnr_db(s_out, truth)},
               "lse_max_diff_vs_single": (got[1] - s_lse).abs().max().item(),
               "grad_sqnr_db_vs_single": {n: reference.sqnr_db(a, b.grad) for n, a, b in
                                          (("dq", got[2], qs), ("dk", got[3], ks), ("dv", got[4], vs))}}
        row["ok"] = (row["out_sqnr_db"]["ring"] > row["out_sqnr_db"]["single"] - 3.0
                     and row["lse_max_diff_vs_single"] < 0.05
                     and all(db > 25.0 for db in row["grad_sqnr_db_vs_single"].values()))
        rows.append(row)
    if rank == 0:
        bad = [r for r in rows if not r["ok"]]
        assert not bad, f"ring attention disagrees with single-GPU mxattn: {json.dumps(bad)}"
    return rows


def _main(argv=None) -> None:
    import argparse

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    p = argparse.ArgumentParser(description="ring MXFP8 attention benchmark (run under torchrun, one GPU per rank)")
    p.add_argument("--seqlen", type=int, nargs="+", default=[65536, 131072, 262144])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--outdir", default="benchmarks/results")
    p.add_argument("--check", action="store_true", help="first check against single-GPU mxattn (check_ring)")
    p.add_argument("--check-only", action="store_true", help="only the check, no timing")
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU baseline on rank 0")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--wire", nargs="+", default=["mxfp8"], choices=["row_scaled", "mxfp8"],
                   help="what travels: the kernels' row-scaled operands or MXFP8 (one row per format)")
    p.add_argument("--profile", action="store_true",
                   help="device time per kernel of one rank's fwd+bwd (torch.profiler)")
    a = p.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        checks = check_ring(head_dim=a.head_dim) if a.check or a.check_only else []
        for row in checks:
            print("check", json.dumps(row))
        if a.check_only:
            return
        bench_ring(a.seqlen, a.batch, a.heads, a.kv_heads or a.heads, a.head_dim, a.causal, a.iters, a.outdir,
                   single=not a.no_single, progress=not a.no_progress, profile=a.profile, check_rows=checks,
                   wires=a.wire)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main()
