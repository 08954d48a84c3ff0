"""Attention speed: forward, backward and forward+backward TFLOP/s of mxattn against SDPA (issue 6).

Methods (``METHODS``):
    mxattn            ``mxattn.interface.mxfp8_attn_func`` on BF16 (B, S, H, D) inputs: the MXFP8 quantization of
                      q, k, v is inside the timed call, as a user pays for it.  Backward only where
                      ``has_fast_backward(device)`` says a GPU backward kernel exists.
    sdpa_cudnn_bf16   ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``.
    sdpa_flash_bf16   the same under ``SDPBackend.FLASH_ATTENTION`` (FA2 in torch).
    sdpa_bf16         SDPA with torch's own backend choice (the CPU default, where the two above do not exist).
    cudnn_fp8         cuDNN FP8 SDPA with per-tensor scales through the cuDNN frontend (``import cudnn``), FP8 in
                      and FP8 out (Hopper refuses BF16 output); only when that package imports.

SDPA takes (B, H, S, D): the methods pass transposed views of the (B, S, H, D) inputs.  GQA (Hkv < Hq): SDPA
with ``enable_gqa=True``; a method that refuses it is timed again on k, v expanded to Hq heads beforehand
(untimed), and the row says so in ``notes``.

Timing (``time_ms``): CUDA events around each call, median over the repetitions after a warm-up (the first
call also compiles).  Each call reads the next of several copies of the inputs, enough copies that together
they exceed the L2 cache three times over, so that L2 does not serve a call the inputs of the previous one.
FLOPs (DESIGN §4): forward 4·B·Hq·Sq·Sk·D, half of that when causal; backward 2.5× the forward.
A method that fails for a shape records ``None`` (and the error in ``errors``) and the run goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

__all__ = [
    "Shape",
    "METHODS",
    "default_shapes",
    "grid_shapes",
    "default_methods",
    "time_ms",
    "run_speed",
    "run_quantize_hook",
    "format_speed_table",
]

BWD_FLOP_FACTOR = 2.5
L2_BYTES_DEFAULT = 60 * 2**20  # H100/H200: 50-60 MB; read from the device when torch knows it
MAX_COPIES = 16
MAX_COPY_BYTES = 8 * 2**30


@dataclass(frozen=True)
class Shape:
    """One attention problem: (B, Sq, Hq, D) queries against (B, Sk, Hkv, D) keys and values."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    causal: bool

    def fwd_flops(self) -> float:
        f = 4.0 * self.B * self.Hq * self.Sq * self.Sk * self.D
        return f / 2 if self.causal else f

    def bwd_flops(self) -> float:
        return BWD_FLOP_FACTOR * self.fwd_flops()

    def as_row(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        kv = f"/{self.Hkv}" if self.Hkv != self.Hq else ""
        s = f"{self.Sq}" if self.Sq == self.Sk else f"{self.Sq}x{self.Sk}"
        return f"B{self.B} H{self.Hq}{kv} S{s} d{self.D}{' causal' if self.causal else ''}"


def grid_shapes(
    batch: int = 2,
    heads: int = 16,
    kv_heads: Optional[int] = None,
    head_dims: Sequence[int] = (128,),
    seqlens: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
    causal: Sequence[bool] = (False, True),
) -> list[Shape]:
    """Every combination of the given head dims, causal flags and (square) sequence lengths."""
    kv = heads if kv_heads is None else kv_heads
    return [Shape(batch, heads, kv, s, s, d, c) for d in head_dims for c in causal for s in seqlens]


def default_shapes(quick: bool = False, device: str = "cuda") -> list[Shape]:
    """The issue-6 grid: B2 H16 d128 and d64 at S 1k..16k, causal both ways, and GQA Hq64/Hkv8 at S 8k.

    ``quick``: d128 at S 1k and 4k, causal both ways.  On the CPU (no GPU kernels to time) a tiny grid that
    only exercises the machinery.
    """
    if device == "cpu":
        return grid_shapes(1, 2, None, (64,), (128, 256), (False, True))
    if quick:
        return grid_shapes(2, 16, None, (128,), (1024, 4096), (False, True))
    return (
        grid_shapes(2, 16, None, (128, 64))
        + grid_shapes(2, 64, 8, (128,), (8192,))
    )


# ----------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool], torch.Tensor]


def _mxattn(q, k, v, causal, gqa):
    from mxattn.interface import mxfp8_attn_func

    return mxfp8_attn_func(q, k, v, causal=causal)


_PREPARED: dict = {}


def _mxattn_fp8_operands(q, k, v, causal, gqa):
    """The forward kernel alone, on FP8 operands already in the Hopper format (what fused producers hand
    over in the end-to-end path); each input copy is prepared on its first (warm-up) call and reused."""
    from mxattn.kernels.attn_fwd import attn_fwd_hopper
    from mxattn.kernels.quantize import row_scaled_triton

    key = tuple((t.data_ptr(), tuple(t.shape)) for t in (q, k, v))
    if key not in _PREPARED:
        _PREPARED[key] = tuple(row_scaled_triton(t, r) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    return attn_fwd_hopper(*_PREPARED[key], causal=causal)[0]


def _mxattn_gluon_fp8_operands(q, k, v, causal, gqa):
    """The warp-specialized Gluon forward (``kernels.attn_fwd_gluon``) on the same prepared FP8 operands."""
    from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon
    from mxattn.kernels.quantize import row_scaled_triton

    key = tuple((t.data_ptr(), tuple(t.shape)) for t in (q, k, v))
    if key not in _PREPARED:
        _PREPARED[key] = tuple(row_scaled_triton(t, r) for t, r in ((q, "q"), (k, "k"), (v, "v")))
    return attn_fwd_gluon(*_PREPARED[key], causal=causal)[0]


@functools.lru_cache(maxsize=1)
def _gluon_unavailable() -> Optional[str]:
    """Why the Gluon forward cannot run here (None when it can): it needs an sm_90 GPU and triton's Gluon."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm_90 (Hopper) GPU"
    try:
        importlib.import_module("mxattn.kernels.attn_fwd_gluon")
    except Exception as e:  # an older triton without gluon, or an API change
        return f"Gluon forward not importable: {type(e).__name__}: {e}"[:200]
    return None


def _sdpa(backend_name: Optional[str]) -> Attn:
    def attn(q, k, v, causal, gqa):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kw = {"enable_gqa": True} if gqa else {}
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if backend_name is None:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kw)
        else:
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **kw)
        return o.transpose(1, 2)

    return attn


@functools.lru_cache(maxsize=1)
def _cudnn_frontend():
    """The cuDNN frontend module, or None when it is not installed (the method is then left out)."""
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception:
        return None
    return cudnn if hasattr(cudnn, "pygraph") else None


class _CudnnFP8:
    """cuDNN FP8 SDPA, per-tensor scales (one fp32 descale per q, k, v), FP8 output, via graphs built once per
    shape.  Tensors are given to cuDNN as (B, H, S, D) views of our (B, S, H, D) buffers."""

    def __init__(self, shape: Shape):
        self.cudnn = _cudnn_frontend()
        if self.cudnn is None:
            raise RuntimeError("cudnn frontend (nvidia-cudnn-frontend) is not installed")
        self.shape = shape
        self.scale = 1.0 / math.sqrt(shape.D)
        self.fwd_graph = None
        self.bwd_graph = None

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.abs().amax().float().clamp_min(1e-12)
        data = (x.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
        return data, (amax / 448.0).reshape(1, 1, 1, 1)

    def _graph(self):
        c = self.cudnn
        return c.pygraph(
            io_data_type=c.data_type.FP8_E4M3,
            intermediate_data_type=c.data_type.FLOAT,
            compute_data_type=c.data_type.FLOAT,
        )

    def _fp8(self, g, name, t):
        t = t.transpose(1, 2)
        return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=self.cudnn.data_type.FP8_E4M3)

    def _scalar(self, g, name):
        return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=self.cudnn.data_type.FLOAT)

    @staticmethod
    def _build(g):
        import cudnn

        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")

    def forward_setup(self, q8, k8, v8, training: bool):
        """Build the forward graph for these (B, S, H, D) FP8 buffers; returns a runner(q8, k8, v8, dq, dk, dv)."""
        c, s = self.cudnn, self.shape
        g = self._graph()
        tq, tk, tv = self._fp8(g, "q", q8), self._fp8(g, "k", k8), self._fp8(g, "v", v8)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        sc = {n: self._scalar(g, n) for n in names}
        kw = dict(q=tq, k=tk, v=tv, **sc, attn_scale=self.scale, use_causal_mask=s.causal, name="sdpa_fp8")
        try:  # newer frontends name the switch generate_stats, older ones is_inference
            o, stats, amax_s, amax_o = g.sdpa_fp8(**kw, generate_stats=training)
        except TypeError:
            o, stats, amax_s, amax_o = g.sdpa_fp8(**kw, is_inference=not training)
        out = torch.empty_like(q8)
        o.set_output(True).set_dim(list(out.transpose(1, 2).shape)).set_stride(list(out.transpose(1, 2).stride()))
        lse = torch.empty(s.B, s.Hq, s.Sq, 1, dtype=torch.float32, device="cuda")
        if training:
            stats.set_output(True).set_data_type(c.data_type.FLOAT).set_dim(list(lse.shape)).set_stride(
                list(lse.stride())
            )
        amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device="cuda")
        for a in (amax_s, amax_o):
            a.set_output(True).set_data_type(c.data_type.FLOAT).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        ws = self._build(g)
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device="cuda")

        def run(q8, k8, v8, dq, dk, dv):
            pack = {tq: q8, tk: k8, tv: v8, sc["descale_q"]: dq, sc["descale_k"]: dk, sc["descale_v"]: dv,
                    sc["descale_s"]: one, sc["scale_s"]: one, sc["scale_o"]: one, o: out,
                    amax_s: amax[0], amax_o: amax[1]}
            if training:
                pack[stats] = lse
            g.execute(pack, ws)
            return out, lse

        return run

    def backward_setup(self, q8, k8, v8, o8, do8, lse):
        """Build the backward graph; returns a runner(q8, k8, v8, o8, do8, lse, dq, dk, dv, ddo)."""
        c = self.cudnn
        g = self._graph()
        tq, tk, tv = self._fp8(g, "q", q8), self._fp8(g, "k", k8), self._fp8(g, "v", v8)
        to, tdo = self._fp8(g, "o", o8), self._fp8(g, "do", do8)
        tst = g.tensor(name="stats", dim=list(lse.shape), stride=list(lse.stride()), data_type=c.data_type.FLOAT)
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                 "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
        sc = {n: self._scalar(g, n) for n in names}
        dq, dk, dv, *amaxes = g.sdpa_fp8_backward(
            q=tq, k=tk, v=tv, o=to, dO=tdo, stats=tst, **sc, attn_scale=self.scale,
            use_causal_mask=self.shape.causal, name="sdpa_fp8_backward",
        )
        grads = [torch.empty_like(t) for t in (q8, k8, v8)]
        for t, buf in zip((dq, dk, dv), grads):
            bt = buf.transpose(1, 2)
            t.set_output(True).set_dim(list(bt.shape)).set_stride(list(bt.stride())).set_data_type(
                c.data_type.FP8_E4M3
            )
        amax = torch.empty(len(amaxes), 1, 1, 1, 1, dtype=torch.float32, device="cuda")
        for a in amaxes:
            a.set_output(True).set_data_type(c.data_type.FLOAT).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        ws = self._build(g)
        one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device="cuda")

        def run(q8, k8, v8, o8, do8, lse, dsq, dsk, dsv, dsdo):
            pack = {tq: q8, tk: k8, tv: v8, to: o8, tdo: do8, tst: lse, dq: grads[0], dk: grads[1], dv: grads[2]}
            pack.update({sc[n]: one for n in names})
            pack.update({sc["descale_q"]: dsq, sc["descale_k"]: dsk, sc["descale_v"]: dsv, sc["descale_dO"]: dsdo})
            pack.update({a: amax[i] for i, a in enumerate(amaxes)})
            g.execute(pack, ws)
            return grads

        return run


@dataclass(frozen=True)
class Method:
    """A way to run attention.  ``attn`` is an autograd-able (q, k, v, causal, gqa) -> out on (B, S, H, D)
    tensors, or None for methods with their own runners (``cudnn_fp8``)."""

    name: str
    attn: Optional[Attn]
    devices: tuple[str, ...]
    label: str

    def available(self) -> Optional[str]:
        """None when the method can run here, else why not."""
        if self.name == "cudnn_fp8" and _cudnn_frontend() is None:
            return "cudnn frontend not installed (pip package nvidia-cudnn-frontend)"
        if self.name == "mxattn_gluon_fp8_operands":
            return _gluon_unavailable()
        return None


METHODS = {
    m.name: m
    for m in (
        Method("mxattn", _mxattn, ("cuda", "cpu"), "mxattn MXFP8"),
        Method("mxattn_fp8_operands", _mxattn_fp8_operands, ("cuda",), "mxattn kernel on FP8 operands"),
        Method("mxattn_gluon_fp8_operands", _mxattn_gluon_fp8_operands, ("cuda",),
               "mxattn Gluon (warp-specialized) kernel on FP8 operands"),
        Method("sdpa_cudnn_bf16", _sdpa("CUDNN_ATTENTION"), ("cuda",), "SDPA cuDNN BF16"),
        Method("sdpa_flash_bf16", _sdpa("FLASH_ATTENTION"), ("cuda",), "SDPA flash BF16"),
        Method("sdpa_bf16", _sdpa(None), ("cuda", "cpu"), "SDPA BF16 (torch's choice)"),
        Method("cudnn_fp8", None, ("cuda",), "cuDNN FP8 per-tensor"),
    )
}


def default_methods(device: str) -> list[str]:
    if device == "cpu":
        return ["mxattn", "sdpa_bf16"]
    names = ["mxattn", "mxattn_fp8_operands", "mxattn_gluon_fp8_operands", "sdpa_cudnn_bf16", "sdpa_flash_bf16",
             "cudnn_fp8"]
    return [n for n in names if METHODS[n].available() is None]


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[int], object],
    n_inputs: int,
    device: torch.device,
    warmup_ms: float = 50.0,
    rep_ms: float = 300.0,
    min_reps: int = 10,
    max_reps: int = 200,
) -> float:
    """Median milliseconds of ``fn(i)``, i cycling over ``range(n_inputs)`` (the rotated input copies).

    The first call (compilation, autotuning) is not counted; a short estimate then sets the warm-up and
    repetition counts so that each spends about ``warmup_ms`` / ``rep_ms``.  CUDA: one pair of events per
    call; CPU: ``time.perf_counter``.
    """
    device = torch.device(device)
    fn(0)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(3):
        fn(i % n_inputs)
    _sync(device)
    est = max((time.perf_counter() - t0) / 3 * 1e3, 1e-3)
    for i in range(int(min(warmup_ms / est, max_reps))):
        fn(i % n_inputs)
    reps = int(max(min_reps, min(max_reps, rep_ms / est)))
    times = []
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        _sync(device)
        for i, (a, b) in enumerate(ev):
            a.record()
            fn(i % n_inputs)
            b.record()
        _sync(device)
        times = [a.elapsed_time(b) for a, b in ev]
    else:
        for i in range(reps):
            t = time.perf_counter()
            fn(i % n_inputs)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 32 * 2**20
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_BYTES_DEFAULT)


def n_copies(bytes_per_copy: int, device: torch.device) -> int:
    """How many input copies to rotate so that together they are at least three L2 caches."""
    want = math.ceil(3 * _l2_bytes(device) / max(bytes_per_copy, 1))
    cap = max(1, MAX_COPY_BYTES // max(bytes_per_copy, 1))
    return int(max(1, min(want, MAX_COPIES, cap)))


@dataclass
class _Inputs:
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    dout: list[torch.Tensor]

    def expanded(self, groups: int) -> "_Inputs":
        """k, v repeated to Hq heads (for methods that refuse GQA), made once and not timed."""
        rep = [[t.repeat_interleave(groups, dim=2) for t in ts] for ts in (self.k, self.v)]
        return _Inputs(self.q, rep[0], rep[1], self.dout)


def _make_inputs(shape: Shape, device: torch.device, seed: int) -> _Inputs:
    g = torch.Generator(device=device).manual_seed(seed)
    elems = shape.B * shape.D * (2 * shape.Sq * shape.Hq + 2 * shape.Sk * shape.Hkv)
    n = n_copies(2 * elems, device)

    def make(S, H):
        return [torch.randn(shape.B, S, H, shape.D, generator=g, device=device).to(torch.bfloat16) for _ in range(n)]

    return _Inputs(make(shape.Sq, shape.Hq), make(shape.Sk, shape.Hkv), make(shape.Sk, shape.Hkv), make(shape.Sq, shape.Hq))


def _autograd_runners(attn: Attn, x: _Inputs, causal: bool, gqa: bool, with_bwd: bool):
    """(forward, backward, forward+backward) callables of an input index for an autograd-able method."""
    n = len(x.q)

    def fwd(i):
        with torch.no_grad():
            return attn(x.q[i], x.k[i], x.v[i], causal, gqa)

    if not with_bwd:
        return fwd, None, None
    leaves = [[t.detach().requires_grad_(True) for t in (x.q[i], x.k[i], x.v[i])] for i in range(n)]
    # one retained graph per input copy, built here so that the backward timing holds no forward
    graphs = [attn(*leaves[i], causal, gqa) for i in range(n)]

    def bwd(i):
        return torch.autograd.grad(graphs[i], leaves[i], x.dout[i], retain_graph=True)

    def fwd_bwd(i):
        out = attn(*leaves[i], causal, gqa)
        return torch.autograd.grad(out, leaves[i], x.dout[i])

    return fwd, bwd, fwd_bwd


def _cudnn_fp8_runners(shape: Shape, x: _Inputs, with_bwd: bool):
    impl = _CudnnFP8(shape)
    qs = [impl.quantize(t) for t in x.q]
    ks = [impl.quantize(t) for t in x.k]
    vs = [impl.quantize(t) for t in x.v]
    dos = [impl.quantize(t) for t in x.dout]
    run_inf = impl.forward_setup(qs[0][0], ks[0][0], vs[0][0], training=False)

    def fwd(i):
        return run_inf(qs[i][0], ks[i][0], vs[i][0], qs[i][1], ks[i][1], vs[i][1])

    if not with_bwd:
        return fwd, None, None
    run_train = impl.forward_setup(qs[0][0], ks[0][0], vs[0][0], training=True)
    saved = []
    for i in range(len(qs)):
        o, lse = run_train(qs[i][0], ks[i][0], vs[i][0], qs[i][1], ks[i][1], vs[i][1])
        saved.append((o.clone(), lse.clone()))
    run_bwd = impl.backward_setup(qs[0][0], ks[0][0], vs[0][0], saved[0][0], dos[0][0], saved[0][1])

    def bwd(i):
        o, lse = saved[i]
        return run_bwd(qs[i][0], ks[i][0], vs[i][0], o, dos[i][0], lse, qs[i][1], ks[i][1], vs[i][1], dos[i][1])

    def fwd_bwd(i):
        o, lse = run_train(qs[i][0], ks[i][0], vs[i][0], qs[i][1], ks[i][1], vs[i][1])
        return run_bwd(qs[i][0], ks[i][0], vs[i][0], o, dos[i][0], lse, qs[i][1], ks[i][1], vs[i][1], dos[i][1])

    return fwd, bwd, fwd_bwd


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _free(device: torch.device) -> None:
    _PREPARED.clear()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def cuda_graphed(fn: Callable[[int], object], n_inputs: int, device: torch.device) -> Callable[[int], object]:
    """``fn(i)`` captured once per input copy into a CUDA graph; the returned callable replays graph i.

    Timing replays measures the GPU work alone: the Python and launch overhead that an eager call pays on the
    host (tens of microseconds per Triton launch or custom op, comparable to a whole small attention call) is
    gone, as it is for a user who captures the step (``torch.compile(mode="reduce-overhead")``,
    ``torch.cuda.make_graphed_callables``).  Warm-up (compilation, allocation) runs on a side stream first."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(n_inputs):
            fn(i)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graphs, outs = [], []
    for i in range(n_inputs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(fn(i))  # kept alive: the graph's output memory
        graphs.append(g)

    def replay(i):
        graphs[i].replay()
        return outs[i]

    return replay


def cuda_graphed_backward(attn: Attn, x: "_Inputs", causal: bool, gqa: bool,
                          device: torch.device) -> Callable[[int], object]:
    """The backward of ``attn`` alone as CUDA-graph replays: per input copy, the forward (with grad) is captured
    into one graph and ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` into a second graph that
    shares its memory pool; the returned callable replays the second.  This is what the eager backward timing
    measures (a retained graph, the backward kernels only) without the host's Python and launch overhead, as
    ``torch.cuda.make_graphed_callables`` would run it.

    Warm-up (compilation, allocation) and both captures run on one side stream: autograd runs each backward node
    on its forward's stream, so the backward's ops are recorded where the forward's were."""
    n = len(x.q)
    leaves = [[t.detach().requires_grad_(True) for t in (x.q[i], x.k[i], x.v[i])] for i in range(n)]
    graph_cls = torch.cuda.CUDAGraph
    stream = torch.cuda.Stream(device)  # warm-up and both captures
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(n):
            for _ in range(2):
                out = attn(*leaves[i], causal, gqa)
                torch.autograd.grad(out, leaves[i], x.dout[i])
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    keep, graphs = [], []
    for i in range(n):
        gf, gb = graph_cls(), graph_cls()
        with torch.cuda.graph(gf, stream=stream):
            out = attn(*leaves[i], causal, gqa)
        with torch.cuda.graph(gb, pool=gf.pool(), stream=stream):
            grads = torch.autograd.grad(out, leaves[i], x.dout[i], retain_graph=True)
        gf.replay()  # the saved tensors the backward graph reads, made once
        keep.append((gf, out, grads))
        graphs.append(gb)
    torch.cuda.synchronize(device)

    def replay(i):
        graphs[i].replay()
        return keep[i][2]

    return replay


def _time_method(name: str, shape: Shape, x: _Inputs, device: torch.device, with_bwd: bool,
                 cuda_graph: bool = False) -> dict:
    """ms for fwd / bwd / fwd_bwd (None where not run) and the errors met.  ``cuda_graph``: the forward is
    timed as CUDA-graph replays (``cuda_graphed``) and, with ``with_bwd``, the backward too
    (``cuda_graphed_backward``); fwd_bwd is not timed then."""
    res: dict = {"fwd": None, "bwd": None, "fwd_bwd": None, "errors": {}, "notes": []}
    method = METHODS[name]
    bwd_reason = None
    if cuda_graph and with_bwd and method.attn is None:  # the cuDNN frontend's execute() is not captured (below)
        with_bwd, bwd_reason = False, "not timed: a cuDNN frontend graph's execute() is not captured"
    if name == "mxattn" and with_bwd:
        from mxattn.interface import has_fast_backward

        if not has_fast_backward(device):
            with_bwd, bwd_reason = False, "no fast backward kernel on this device yet"
    if name in ("mxattn_fp8_operands", "mxattn_gluon_fp8_operands"):
        with_bwd, bwd_reason = False, "forward kernel only"
    gqa = shape.Hkv != shape.Hq
    attempts = [(x, gqa)] + ([(None, False)] if gqa and method.attn is not None else [])
    for inputs, native in attempts:
        res["errors"].pop("fwd", None)
        try:
            if inputs is None:
                inputs = x.expanded(shape.Hq // shape.Hkv)
                res["notes"].append("k, v expanded to Hq heads (GQA refused)")
            if method.attn is None:
                fwd, _, _ = _cudnn_fp8_runners(shape, inputs, False)
            else:
                fwd, _, _ = _autograd_runners(method.attn, inputs, shape.causal, native, False)
            if cuda_graph and method.attn is None:
                # the cuDNN frontend's execute() is not recorded by torch.cuda.graph: replays would run nothing
                # (session 19 read 2-114 PFLOP/s), so this method is timed eagerly
                res["notes"].append("timed eagerly: a cuDNN frontend graph's execute() is not captured")
            elif cuda_graph:
                fwd = cuda_graphed(fwd, len(inputs.q), device)
            res["fwd"] = time_ms(fwd, len(inputs.q), device)
            del fwd
            break
        except Exception as e:  # any failure of a method for a shape is recorded, never fatal
            res["errors"]["fwd"] = _short(e)
            _free(device)
    if with_bwd and res["fwd"] is not None:
        try:
            if cuda_graph:
                bwd, fb = cuda_graphed_backward(method.attn, inputs, shape.causal, native, device), None
            elif method.attn is None:
                _, bwd, fb = _cudnn_fp8_runners(shape, inputs, True)
            else:
                _, bwd, fb = _autograd_runners(method.attn, inputs, shape.causal, native, True)
            res["bwd"] = time_ms(bwd, len(inputs.q), device)
            del bwd
            if fb is not None:
                res["fwd_bwd"] = time_ms(fb, len(inputs.q), device)
        except Exception as e:
            res["errors"]["bwd"] = _short(e)
    elif bwd_reason:
        res["errors"]["bwd"] = bwd_reason
    _free(device)
    return res


def _tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or not den else num / den


def run_speed(
    shapes: Optional[Iterable[Shape]] = None,
    methods: Optional[Sequence[str]] = None,
    device: Optional[str] = None,
    backward: bool = True,
    seed: int = 0,
    progress: bool = True,
    cuda_graph: bool = False,
) -> tuple[list[dict], list[dict]]:
    """Time every method on every shape; returns (forward rows, backward rows) in the DESIGN §6 shape.

    Forward row: the shape's fields, ``tflops`` and ``ms`` per method, ``ratio_vs_sdpa_cudnn_bf16`` (mxattn's),
    ``ratios_vs_sdpa_cudnn_bf16`` (every method's), ``errors`` and ``notes`` per method where there were any.
    Backward row: the same for the backward, plus ``tflops_fwd_bwd`` / ``ms_fwd_bwd``.
    ``cuda_graph`` (CUDA only): forward and backward timed as CUDA-graph replays (``cuda_graphed``,
    ``cuda_graphed_backward``), forward+backward not timed.
    """
    from tqdm import tqdm

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = list(shapes if shapes is not None else default_shapes(device=dev.type))
    methods = list(methods if methods is not None else default_methods(dev.type))
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    fwd_rows, bwd_rows = [], []
    bar = tqdm(total=len(shapes) * len(methods), desc="attention speed", unit="run", disable=not progress,
               file=sys.stderr)
    for idx, shape in enumerate(shapes):
        fr = {**shape.as_row(), "tflops": {}, "ms": {}, "errors": {}, "notes": {}}
        br = {**shape.as_row(), "tflops": {}, "ms": {}, "tflops_fwd_bwd": {}, "ms_fwd_bwd": {}, "errors": {},
              "notes": {}}
        x = None
        for name in methods:
            bar.set_postfix_str(f"{shape} {name}")
            why_not = METHODS[name].available()
            if dev.type not in METHODS[name].devices:
                why_not = f"not available on {dev.type}"
            if why_not is None and x is None:
                x = _make_inputs(shape, dev, seed + idx)
            res = (
                {"fwd": None, "bwd": None, "fwd_bwd": None, "errors": {"fwd": why_not}, "notes": []}
                if why_not is not None
                else _time_method(name, shape, x, dev, backward, cuda_graph)
            )
            fr["ms"][name], fr["tflops"][name] = res["fwd"], _tflops(shape.fwd_flops(), res["fwd"])
            br["ms"][name], br["tflops"][name] = res["bwd"], _tflops(shape.bwd_flops(), res["bwd"])
            br["ms_fwd_bwd"][name] = res["fwd_bwd"]
            br["tflops_fwd_bwd"][name] = _tflops(shape.fwd_flops() + shape.bwd_flops(), res["fwd_bwd"])
            for row, key in ((fr, "fwd"), (br, "bwd")):
                if res["errors"].get(key):
                    row["errors"][name] = res["errors"][key]
                if res["notes"]:
                    row["notes"][name] = "; ".join(res["notes"])
            bar.update(1)
        del x
        _free(dev)
        for row in (fr, br):
            base = row["tflops"].get("sdpa_cudnn_bf16")
            row["ratios_vs_sdpa_cudnn_bf16"] = {m: _ratio(t, base) for m, t in row["tflops"].items()}
            row["ratio_vs_sdpa_cudnn_bf16"] = row["ratios_vs_sdpa_cudnn_bf16"].get("mxattn")
        fwd_rows.append(fr)
        bwd_rows.append(br)
        if progress:  # a line per shape as it finishes, for long runs watched through a log
            bar.write(format_speed_table([fr], "forward") if idx == 0 else format_speed_table([fr], None))
    bar.close()
    return fwd_rows, bwd_rows


def _fmt_tflops(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def format_speed_table(rows: Sequence[dict], title: Optional[str], key: str = "tflops") -> str:
    """Plain-text table: one line per shape, TFLOP/s per method ("-" where a method did not run), and
    mxattn's ratio to SDPA cuDNN BF16 for the ``tflops`` key."""
    if not rows:
        return ""
    methods = list(rows[0][key])
    ratio = key == "tflops" and "mxattn" in methods and "sdpa_cudnn_bf16" in methods
    lines = []
    if title is not None:
        lines.append(f"{title} TFLOP/s")
        lines.append(f"{'shape':<30}" + "".join(f"{m:>17}" for m in methods) + (f"{'mxattn/cuDNN':>14}" if ratio else ""))
    for r in rows:
        s = Shape(*(r[f] for f in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "causal")))
        cells = "".join(f"{_fmt_tflops(r[key][m]):>17}" for m in methods)
        if ratio:
            x = r.get("ratio_vs_sdpa_cudnn_bf16")
            cells += f"{'-' if x is None else format(x, '.2f') + 'x':>14}"
        lines.append(f"{str(s):<30}{cells}")
    return "\n".join(lines)


def run_quantize_hook(device: str, quick: bool, progress: bool = True) -> Optional[list[dict]]:
    """Rows of ``mxattn.bench.quantize_bench.run_quantize_bench`` when that module exists, else None.

    Keyword arguments it does not take (``quick``, ``device``, ``progress``) are not passed.  A dict result
    is read for its ``"rows"``."""
    import inspect

    try:
        from mxattn.bench.quantize_bench import run_quantize_bench
    except ImportError:
        return None
    params = inspect.signature(run_quantize_bench).parameters
    kwargs = {k: v for k, v in (("quick", quick), ("device", device), ("progress", progress)) if k in params}
    res = run_quantize_bench(**kwargs)
    if isinstance(res, dict):
        res = res.get("rows", [])
    return list(res)
