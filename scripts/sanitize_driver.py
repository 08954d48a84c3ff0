"""Tiny launches of every mxattn GPU kernel, for compute-sanitizer (scripts/sanitize.sh runs one case per process).

    python scripts/sanitize_driver.py CASE [CASE ...]     # cases: fwd bwd varlen quantize producers gluon gluonbwd, or all
                                                          # of those; wsprobe only when named (below)
    python scripts/sanitize_driver.py --cpu CASE ...      # smoke test of the driver itself without a GPU
                                                          # (TRITON_INTERPRET=1; the CPU API runs the reference)

Shapes are small and odd (lengths 1, 33, 77, 130 next to the tile sizes 64/128; GQA; D 64 and 128; causal and
not), so that masked tails, partial MX blocks and the channel-major padding are all exercised.  Each case checks
its results for NaN (inputs are finite) and synchronizes, so an asynchronous fault is reported inside the case.
Prints one line per case: "case NAME ok (N launches, T s)".  Exit status 0 when every case ran.

wsprobe is not an mxattn kernel: a minimal Gluon ``gl.warp_specialize`` kernel (scripts/ws_probe.py, 4-warp default
partition and a 1-warp worker, each storing to its own slice of an int32 output; no shared memory of its own),
then its variant with an mbarrier and a captured value, the controls for racecheck's hazards on ``gluon`` and
``gluonbwd`` (docs/racecheck-gluon.md).  Like gluon it needs an sm_90 / sm_100
GPU and triton's Gluon; it raises under --cpu.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

DEV = "cuda"
ATTN_SHAPES = [  # B, Sq, Sk, Hq, Hkv, D
    (1, 1, 1, 1, 1, 64),
    (1, 33, 77, 2, 1, 64),
    (2, 77, 33, 4, 2, 128),
    (1, 130, 130, 2, 2, 128),
]


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=grad)


def _finite(name: str, *ts) -> None:
    for t in ts:
        if t is not None and t.is_floating_point() and torch.isnan(t.float()).any():
            raise RuntimeError(f"{name}: NaN in the result")


def case_fwd() -> int:
    from mxattn.interface import mxfp8_attn_func

    n = 0
    for B, Sq, Sk, Hq, Hkv, D in ATTN_SHAPES:
        for causal in (False, True):
            out, lse = mxfp8_attn_func(_t(B, Sq, Hq, D), _t(B, Sk, Hkv, D), _t(B, Sk, Hkv, D), causal=causal,
                                       return_lse=True)
            _finite("fwd", out)
            n += 1
    return n


def _bwd_cases(kernels: str) -> int:
    """Forward+backward through the API on every shape, the backward's kernels chosen by MXATTN_BWD_KERNEL.  The tl
    kernels run with and without ``deterministic`` (two dQ paths); the Gluon ones (whose dQ always has its own
    kernel) as their split and whole-tile variants (MXATTN_BWD_GLUON_SPLIT 1 and 0)."""
    from mxattn.interface import mxfp8_attn_func

    names = ("MXATTN_BWD_KERNEL", "MXATTN_BWD_GLUON_SPLIT")
    before = {name: os.environ.get(name) for name in names}
    os.environ["MXATTN_BWD_KERNEL"] = kernels
    variants = [("1", False), ("0", False)] if kernels == "gluon" else [("1", False), ("1", True)]
    n = 0
    try:
        for B, Sq, Sk, Hq, Hkv, D in ATTN_SHAPES:
            for causal in (False, True):
                for split, deterministic in variants:
                    os.environ["MXATTN_BWD_GLUON_SPLIT"] = split
                    q, k, v = (_t(B, Sq, Hq, D, grad=True), _t(B, Sk, Hkv, D, grad=True),
                               _t(B, Sk, Hkv, D, grad=True))
                    out = mxfp8_attn_func(q, k, v, causal=causal, deterministic=deterministic)
                    out.backward(torch.randn_like(out))  # attn_bwd_hopper
                    _finite(f"bwd ({kernels})", q.grad, k.grad, v.grad)
                    n += 1
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return n


def case_bwd() -> int:
    """The ``tl`` backward kernels (atomic and deterministic dQ)."""
    return _bwd_cases("tl")


def case_gluonbwd() -> int:
    """The warp-specialized Gluon dQ and dK/dV kernels (the default on Hopper); needs sm_90 and triton's Gluon."""
    if DEV != "cuda":
        raise RuntimeError("gluonbwd: Gluon kernels have no CPU / TRITON_INTERPRET path")
    return _bwd_cases("gluon")


def case_varlen() -> int:
    from mxattn.interface import mxfp8_attn_varlen_func

    n = 0
    for lens_q, lens_k in (([1, 0, 33], [5, 7, 0]), ([77, 130], [33, 130])):
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEV)
        for causal in (False, True):
            out = mxfp8_attn_varlen_func(_t(sum(lens_q), 4, 64), _t(sum(lens_k), 2, 64), _t(sum(lens_k), 2, 64),
                                         cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
            _finite("varlen", out)
            n += 1
    return n


def case_quantize() -> int:
    from mxattn.kernels.quantize import dequantize_mxfp8_triton, quantize_mxfp8_triton, row_scaled_triton

    n = 0
    for shape in ((1, 1, 1, 64), (2, 33, 3, 64), (1, 77, 2, 128), (1, 130, 1, 100)):
        x = _t(*shape)
        x[0, 0, 0, 0] = float("inf")  # the non-finite branch (NaN block bytes)
        for mode in ("rceil", "floor"):
            h, s = quantize_mxfp8_triton(x, "both", scale_mode=mode)
            dequantize_mxfp8_triton(h)
            dequantize_mxfp8_triton(s, torch.float32)
            n += 4
            if shape[-1] in (64, 128):
                for role in ("q", "k", "v"):
                    row_scaled_triton(x, role, scale_mode=mode)
                    n += 1
    x = _t(45, 3, 64)  # packed (T, H, D)
    quantize_mxfp8_triton(x, "both", seq_dim=0)
    return n + 1


def case_producers() -> int:
    from mxattn.producers import linear_quant, rmsnorm_quant

    n = 0
    for B, S, N in ((1, 1, 64), (2, 33, 96), (1, 77, 1000)):
        x, w = _t(B, S, N, grad=True), _t(N, grad=True)
        hdim, seq = rmsnorm_quant(x, w, orientations="both").out  # fused RMSNorm + MXFP8 (both orientations)
        (hdim.dequantize() * seq.dequantize()).sum().backward()  # fused RMSNorm backward through the STE
        _finite("rmsnorm_quant", x.grad, w.grad)
        n += 2
    for M, K, N in ((1, 64, 32), (33, 96, 77), (130, 128, 256)):
        hdim, seq = linear_quant(_t(1, M, K), _t(N, K), _t(N), orientations="both")  # FP8 GEMM + MX epilogue
        _finite("linear_quant", hdim.dequantize(), seq.dequantize())
        n += 1
    return n


def case_gluon() -> int:
    from mxattn.interface import _hopper_forward_operands
    from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon

    n = 0
    for B, Sq, Sk, Hq, Hkv, D in ATTN_SHAPES[1:]:
        for causal in (False, True):
            ops = _hopper_forward_operands(_t(B, Sq, Hq, D), _t(B, Sk, Hkv, D), _t(B, Sk, Hkv, D), "rceil")
            out, _ = attn_fwd_gluon(*ops, causal=causal)
            _finite("gluon", out)
            n += 1
    return n


def case_wsprobe() -> int:
    """Control for racecheck on ``gluon``: a minimal ``gl.warp_specialize`` kernel (scripts/ws_probe.py) whose
    partitions touch no shared memory, so its only shared accesses are Triton's warp-specialization bookkeeping
    (docs/racecheck-gluon.md).  One launch; fails unless every element holds what its partition wrote."""
    if DEV != "cuda":
        raise RuntimeError("wsprobe: Gluon kernels have no CPU / TRITON_INTERPRET path; run it on an sm_90 or "
                           "sm_100 GPU")
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        raise RuntimeError(f"wsprobe: gl.warp_specialize needs Hopper or Blackwell (compute capability 9.x or "
                           f"10.x), this GPU is {major}.x")
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # already there when this file runs as a script
        sys.path.insert(0, here)
    try:
        import ws_probe as probe
    except ImportError as e:  # a triton without Gluon
        raise RuntimeError(f"wsprobe: triton's Gluon does not import ({e})") from e
    # the plain probe once (2 CTAs), then the variant with an mbarrier and a captured value (what the mxattn kernels
    # add before gl.warp_specialize) over 8 launches of 132 CTAs: racecheck's flagging varies between launches
    launches = [(False, 2)] + [(True, 132)] * 8
    for mbar, programs in launches:
        out = probe.run(programs, DEV, mbar=mbar)
        torch.cuda.synchronize()
        want = probe.expected(programs)
        got = out.cpu()
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            raise RuntimeError(f"wsprobe (mbar={mbar}): {bad.numel()} of {got.numel()} elements wrong, first at "
                               f"{bad[0].item()}: {got[bad[0]].item()} (want {want[bad[0]].item()})")
    return len(launches)


CASES = {"fwd": case_fwd, "bwd": case_bwd, "varlen": case_varlen, "quantize": case_quantize,
         "producers": case_producers, "gluon": case_gluon, "gluonbwd": case_gluonbwd, "wsprobe": case_wsprobe}
PROBES = ("wsprobe",)  # diagnostics of Triton itself, not mxattn kernels: run only when named, not by "all"


def main(argv: list[str]) -> int:
    global DEV
    if argv[:1] == ["--cpu"]:
        argv, DEV = argv[1:], "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("sanitize_driver: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [c for c in CASES if c not in PROBES] if not argv or argv == ["all"] else argv
    bad = [c for c in names if c not in CASES]
    if bad:
        print(f"unknown case(s) {bad}; known: {' '.join(CASES)}", file=sys.stderr)
        return 2
    torch.manual_seed(int(os.environ.get("MXATTN_SEED", "0")))
    for name in names:
        t0 = time.time()
        n = CASES[name]()
        if DEV == "cuda":
            torch.cuda.synchronize()
        print(f"case {name} ok ({n} launches, {time.time() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
