"""Bandwidth of the quantize / dequantize / Hopper-operand kernels against a device copy of the same bytes.

    python -c "from mxattn.bench.quantize_bench import run_quantize_bench, format_quantize_table; \
               print(format_quantize_table(run_quantize_bench()))"

Every row times one kernel with ``triton.testing.do_bench`` (median, L2 flushed between runs) on an input of
at least 256 MB, and a ``torch`` device-to-device copy of the input in the same run.  GB/s counts bytes read +
bytes written; ``bytes_moved`` is what the kernel really moves (V from a float tensor reads its input twice),
``bytes_min`` what one read and one write of the operands take.  ``pct_of_copy`` compares ``bytes_moved``
rates, ``pct_of_copy_min`` the ``bytes_min`` rate (the end-to-end figure).  Importable without CUDA.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

__all__ = ["DEFAULT_SIZES", "QUICK_SIZES", "KERNELS", "run_quantize_bench", "run_tile_sweep", "format_quantize_table",
           "SWEEP_PLAN"]

# (B, S, H, D): 268 MB of bf16 each (B*S*H*D = 2^27)
DEFAULT_SIZES = ((8, 8192, 16, 128), (16, 8192, 16, 64))
QUICK_SIZES = ((8, 8192, 16, 128),)
KERNELS = (
    "quant_hdim", "quant_seq", "quant_both", "quant_both_fp32",
    "rs_q", "rs_k", "rs_v", "rs_q_from_mx", "rs_k_from_mx", "rs_v_from_mx",
    "dequant_hdim", "dequant_seq",
    "fwd_operands", "rs_both",
)
# rows for tile sweeps only: V's exponent pass alone; the training forward's operands (keep_kv)
SWEEP_ONLY = ("rs_v_exps", "fwd_operands_kv")
# the attention forward's shape that session 14's profile was taken at (33.5 MB of bf16 per tensor)
PUBLIC_SIZE = (2, 4096, 16, 128)


def _bytes(kernel: str, B: int, S: int, H: int, D: int) -> tuple[int, int, int]:
    """(bytes read, bytes written, bytes moved) of one call; read+written is the minimum traffic."""
    n = B * S * H * D
    nb = -(-D // 32) * B * S * H  # hdim scale bytes
    sb = -(-S // 32) * B * H * D  # seq scale bytes
    s_pad = -(-S // 16) * 16
    cm = B * H * D * s_pad  # channel-major data bytes
    if kernel == "quant_hdim":
        r, w = 2 * n, n + nb
    elif kernel == "quant_seq":
        r, w = 2 * n, cm + sb
    elif kernel == "quant_both":
        r, w = 2 * n, n + nb + cm + sb
    elif kernel == "quant_both_fp32":
        r, w = 4 * n, n + nb + cm + sb
    elif kernel == "rs_q":
        r, w = 2 * n, n + 4 * B * S * H
    elif kernel == "rs_k":
        r, w = 2 * n, n + 4 * B * -(-S // 128) * H
    elif kernel == "rs_v":
        r, w = 2 * n, cm + 4 * B * H * D
        return r, w, r + w + 2 * n  # the exponent pass reads the input once more
    elif kernel == "rs_q_from_mx":
        r, w = n + nb, n + 4 * B * S * H
    elif kernel == "rs_k_from_mx":
        r, w = n + nb, n + 4 * B * -(-S // 128) * H
    elif kernel == "rs_v_from_mx":
        from mxattn.kernels import quantize as kq

        r, w = cm + sb, cm + 4 * B * H * D
        if kq.MX_VEXP_PASS == "scales":  # pass 1 reads the scales and one 32-byte block per channel
            return r, w, r + w + sb + 32 * B * H * D
        return r, w, r + w + cm + sb  # pass 1 reads data and scales
    elif kernel == "dequant_hdim":
        r, w = n + nb, 2 * n
    elif kernel == "dequant_seq":
        r, w = cm + sb, 2 * n
    elif kernel == "fwd_operands":  # Q, K, V of this shape each (forward_operands_triton): V's input read twice
        r = 3 * 2 * n
        w = (n + 4 * B * S * H) + (n + 4 * B * -(-S // 128) * H) + (cm + 4 * B * H * D)
        return r, w, r + w + 2 * n
    elif kernel == "fwd_operands_kv":  # forward_operands_triton(keep_kv=True): K and V exponents, both layouts
        cmx = cm + 4 * B * H * D
        kh = n + 4 * B * -(-S // 128) * H
        r = 3 * 2 * n
        w = (n + 4 * B * S * H) + 2 * (kh + cmx)
        return r, w, r + w + 4 * n
    elif kernel == "rs_both":  # row_scaled_triton_both: K and V layouts, the input read twice
        r, w = 2 * n, n + 4 * B * -(-S // 128) * H + cm + 4 * B * H * D
        return r, w, r + w + 2 * n
    elif kernel == "rs_v_exps":  # V's exponent pass alone (read only)
        r, w = 2 * n, 4 * B * H * D
    else:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
    return r, w, r + w


def _make_call(kernel: str, x: torch.Tensor):
    from mxattn.kernels import quantize as kq

    if kernel == "quant_hdim":
        return lambda: kq.quantize_mxfp8_triton(x, "hdim")
    if kernel == "quant_seq":
        return lambda: kq.quantize_mxfp8_triton(x, "seq")
    if kernel == "quant_both":
        return lambda: kq.quantize_mxfp8_triton(x, "both")
    if kernel == "quant_both_fp32":
        xf = x.float()
        return lambda: kq.quantize_mxfp8_triton(xf, "both")
    if kernel in ("rs_q", "rs_k", "rs_v"):
        role = kernel[-1]
        return lambda: kq.row_scaled_triton(x, role)
    if kernel in ("rs_q_from_mx", "rs_k_from_mx"):
        mx = kq.quantize_mxfp8_triton(x, "hdim")
        role = kernel[3]
        return lambda: kq.row_scaled_triton(mx, role)
    if kernel == "rs_v_from_mx":
        mx = kq.quantize_mxfp8_triton(x, "seq")
        return lambda: kq.row_scaled_triton(mx, "v")
    if kernel == "dequant_hdim":
        mx = kq.quantize_mxfp8_triton(x, "hdim")
        return lambda: kq.dequantize_mxfp8_triton(mx, torch.bfloat16)
    if kernel == "dequant_seq":
        mx = kq.quantize_mxfp8_triton(x, "seq")
        return lambda: kq.dequantize_mxfp8_triton(mx, torch.bfloat16)
    if kernel == "fwd_operands":
        k, v = torch.randn_like(x), torch.randn_like(x)
        return lambda: kq.forward_operands_triton(x, k, v)
    if kernel == "fwd_operands_kv":
        k, v = torch.randn_like(x), torch.randn_like(x)
        return lambda: kq.forward_operands_triton(x, k, v, keep_kv=True)
    if kernel == "rs_both":
        return lambda: kq.row_scaled_triton_both(x)
    if kernel == "rs_v_exps":
        return lambda: kq._v_exponents(x, None, from_mx=False, rceil=True)
    raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")


def _graph_ms(fn, rep_ms: int) -> float:
    """``_median_ms`` of the replay of a CUDA graph holding one ``fn()`` (captured after warm-up calls on a side
    stream, as torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = _median_ms(graph.replay, rep_ms)
    del graph
    return ms


def _median_ms(fn, rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))


def run_quantize_bench(
    sizes: Optional[Iterable[tuple[int, int, int, int]]] = None,
    progress: bool = True,
    quick: bool = False,
    device: str = "cuda",
    kernels: Iterable[str] = KERNELS,
    soft_round: Iterable[bool] = (False,),
    rep_ms: int = 200,
    timing: str = "eager",
) -> list[dict]:
    """Time each kernel on bf16 (B, S, H, D) inputs of ``sizes`` (>= 256 MB each by default) on CUDA.

    Rows: ``kernel``, ``B, S, H, D``, ``soft_round`` (explicit fp32 rounding instead of the hardware cvt),
    ``ms``, ``bytes_read``, ``bytes_written``, ``bytes_moved``, ``gbps`` (bytes_moved / time),
    ``gbps_min`` ((read + written) / time), ``copy_gbps`` (device copy of the input, same run),
    ``pct_of_copy``, ``pct_of_copy_min``, ``timing``.  ``quick`` takes one size and a shorter repetition.
    ``timing="graph"`` times CUDA-graph replays of each call (and of the copy): the GPU's time without the host's,
    which a call of ~0.1 ms can exceed (the eager rows then measure the host: session 16, docs/perf-notes-quantize.md)."""
    if timing not in ("eager", "graph"):
        raise ValueError(f"timing must be 'eager' or 'graph', got {timing!r}")
    if device != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("run_quantize_bench needs a CUDA device")
    from mxattn.kernels import quantize as kq

    sizes = tuple(sizes) if sizes is not None else (QUICK_SIZES if quick else DEFAULT_SIZES)
    rep = max(50, rep_ms // 2) if quick else rep_ms
    kernels = tuple(kernels)
    for k in kernels:
        if k not in KERNELS + SWEEP_ONLY:
            raise ValueError(f"unknown kernel {k!r}; choose from {KERNELS}")
    rows = []
    saved = kq.SOFT_ROUND_ON_GPU
    try:
        for B, S, H, D in sizes:
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            dst = torch.empty_like(x)
            timed = _median_ms if timing == "eager" else _graph_ms
            copy_ms = timed(lambda: dst.copy_(x), rep)
            copy_gbps = 2 * x.numel() * x.element_size() / copy_ms / 1e6
            del dst
            for soft in soft_round:
                kq.SOFT_ROUND_ON_GPU = bool(soft)
                for k in kernels:
                    fn = _make_call(k, x)
                    fn()  # compile
                    ms = timed(fn, rep)
                    r, w, moved = _bytes(k, B, S, H, D)
                    row = {
                        "kernel": k, "B": B, "S": S, "H": H, "D": D, "dtype": "float32" if k.endswith("fp32") else "bfloat16",
                        "soft_round": bool(soft), "ms": ms, "bytes_read": r, "bytes_written": w, "bytes_moved": moved,
                        "gbps": moved / ms / 1e6, "gbps_min": (r + w) / ms / 1e6, "copy_gbps": copy_gbps,
                        "timing": timing,
                    }
                    row["pct_of_copy"] = 100.0 * row["gbps"] / copy_gbps
                    row["pct_of_copy_min"] = 100.0 * row["gbps_min"] / copy_gbps
                    rows.append(row)
                    if progress:
                        print(f"  {k:<16} B{B} S{S} H{H} D{D} soft={int(bool(soft))}: {ms:7.3f} ms "
                              f"{row['gbps']:7.0f} GB/s = {row['pct_of_copy']:5.1f}% of copy ({copy_gbps:.0f} GB/s)",
                              flush=True)
                    del fn
                    torch.cuda.empty_cache()
            del x
    finally:
        kq.SOFT_ROUND_ON_GPU = saved
    return rows


def format_quantize_table(rows: list[dict]) -> str:
    head = f"{'kernel':<16}{'shape':>22}{'soft':>5}{'ms':>9}{'GB/s':>8}{'% copy':>8}{'% copy (min bytes)':>20}"
    lines = [head]
    for r in rows:
        shape = f"{r['B']}x{r['S']}x{r['H']}x{r['D']}"
        lines.append(f"{r['kernel']:<16}{shape:>22}{int(r['soft_round']):>5}{r['ms']:>9.3f}{r['gbps']:>8.0f}"
                     f"{r['pct_of_copy']:>8.1f}{r['pct_of_copy_min']:>20.1f}")
    return "\n".join(lines)


# Per tile kind of ``quantize._tile``: the rows that use it and the tiles (block_s, num_warps[, row_groups]) swept
# (K kinds: block_s is the exponent group, 128).  The session-12 sweep (benchmarks/results, docs/perf-notes-quantize.md)
# picked the defaults from these.
SWEEP_PLAN = {
    "hdim": (("quant_hdim", "rs_q"), ((32, 4), (64, 4), (128, 4), (128, 8))),
    "hdim_k": (("rs_k",), ((128, 4), (128, 8), (128, 16))),
    "seq": (("quant_seq", "quant_both", "rs_v"),
            ((32, 4, 1), (32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 8, 2), (128, 8, 2))),
    "seq_k": (("rs_both",), ((128, 8, 1), (128, 8, 2), (128, 16, 2))),
    "mx_hdim": (("rs_q_from_mx", "dequant_hdim"), ((32, 4), (64, 4), (128, 8))),
    "mx_hdim_k": (("rs_k_from_mx",), ((128, 4), (128, 8))),
    "mx_seq": (("dequant_seq",), ((32, 4), (64, 4), (64, 8), (128, 8))),
    "mx_seq_v": (("rs_v_from_mx",), ((32, 4), (64, 4), (64, 8), (128, 8), (128, 16), (256, 16))),
}
# V's exponent pass: (tile, VEXP_MIN_PROGRAMS, VEXP_STAGES[, VEXP_MIN_TILES]) combinations (session 12's six, then
# session 14's tiles-per-program floor, which decides the small inputs)
SWEEP_VEXP = (((32, 4), 1024, 1), ((32, 4), 4096, 1), ((32, 4), 16384, 1), ((32, 4), 1024, 3), ((32, 4), 4096, 3),
              ((64, 8), 4096, 1))
SWEEP_VEXP_S14 = (((32, 4), 4096, 3, 1), ((32, 4), 4096, 3, 2), ((32, 4), 4096, 3, 4), ((32, 4), 4096, 3, 8),
                  ((32, 4), 4096, 3, 16), ((32, 4), 4096, 2, 4), ((32, 4), 4096, 4, 4), ((64, 4), 4096, 3, 4),
                  ((64, 8), 4096, 3, 4))
# V's exponent pass from MX (rows rs_v_from_mx, both passes): (``seqexp`` tile, SEQEXP_MIN_PROGRAMS, SEQEXP_STAGES,
# SEQEXP_MIN_TILES); the first is the pass before session 14
SWEEP_SEQEXP = (((64, 4), 1024, 1, 1), ((64, 4), 4096, 3, 4), ((64, 4), 1024, 3, 4), ((64, 4), 4096, 2, 4),
                ((64, 4), 4096, 4, 4), ((128, 4), 2048, 3, 4), ((32, 4), 8192, 3, 4))
# the no-grad forward's fused launches: (FWD_K_LAUNCH, FWD_K_WARPS)
SWEEP_FWD = (("first", None), ("first", 8), ("second", None), ("second", 8))


def run_tile_sweep(
    size: tuple[int, int, int, int] = (8, 8192, 16, 128),
    plan: Optional[dict] = None,
    vexp: Iterable = SWEEP_VEXP,
    progress: bool = True,
    rep_ms: int = 100,
    fwd: Iterable = (),
    seqexp: Iterable = (),
    mx_vexp_passes: Iterable = (),
    mx_v_rows: Iterable = (),
) -> list[dict]:
    """Rows of ``run_quantize_bench`` at ``size`` for every tile of ``plan`` (default ``SWEEP_PLAN``; rows get
    ``tile_kind``, ``block_s``, ``num_warps``, ``row_groups``), for V's exponent pass alone over ``vexp``
    (``vexp_min_programs``, ``vexp_stages``, ``vexp_min_tiles``) and for the forward's fused launches over ``fwd``
    ((``FWD_K_LAUNCH``, ``FWD_K_WARPS``): row fwd_operands) and for V's exponent pass from MX over ``seqexp``
    (``SWEEP_SEQEXP``'s knobs: row rs_v_from_mx) and over ``mx_vexp_passes`` (``MX_VEXP_PASS``: row rs_v_from_mx,
    side by side) and over ``mx_v_rows`` (``MX_SEQ_V_ROWS``: row rs_v_from_mx).  Every knob is restored afterwards."""
    from mxattn.kernels import quantize as kq

    plan = plan if plan is not None else SWEEP_PLAN
    rows = []
    saved = (dict(kq.TILE_OVERRIDES), kq.VEXP_MIN_PROGRAMS, kq.VEXP_STAGES, kq.VEXP_MIN_TILES, kq.FWD_K_LAUNCH,
             kq.FWD_K_WARPS, kq.SEQEXP_MIN_PROGRAMS, kq.SEQEXP_STAGES, kq.SEQEXP_MIN_TILES)
    saved_pass, saved_rows = kq.MX_VEXP_PASS, kq.MX_SEQ_V_ROWS

    def bench(kernels, **tags):
        for r in run_quantize_bench([size], progress=False, kernels=kernels, rep_ms=rep_ms):
            r.update(tags)
            rows.append(r)
            if progress:
                print(f"  {tags} {r['kernel']:<14} {r['ms']:7.3f} ms {r['pct_of_copy']:5.1f}% of copy", flush=True)

    try:
        for kind, (kernels, tiles) in plan.items():
            for t in tiles:
                kq.TILE_OVERRIDES.clear()
                kq.TILE_OVERRIDES[kind] = kq.Tile(*t)
                bench(kernels, tile_kind=kind, block_s=t[0], num_warps=t[1], row_groups=t[2] if len(t) > 2 else 1)
        kq.TILE_OVERRIDES.clear()
        for t, programs, stages, *more in vexp:
            kq.TILE_OVERRIDES["vexp"] = kq.Tile(*t)
            kq.VEXP_MIN_PROGRAMS, kq.VEXP_STAGES = programs, stages
            kq.VEXP_MIN_TILES = more[0] if more else 1
            bench(("rs_v_exps",), tile_kind="vexp", block_s=t[0], num_warps=t[1], vexp_min_programs=programs,
                  vexp_stages=stages, vexp_min_tiles=kq.VEXP_MIN_TILES)
        kq.TILE_OVERRIDES.clear()
        kq.VEXP_MIN_PROGRAMS, kq.VEXP_STAGES, kq.VEXP_MIN_TILES = saved[1:4]
        for launch, warps in fwd:
            kq.FWD_K_LAUNCH, kq.FWD_K_WARPS = launch, warps
            bench(("fwd_operands",), tile_kind="fwd", fwd_k_launch=launch, fwd_k_warps=warps)
        kq.FWD_K_LAUNCH, kq.FWD_K_WARPS = saved[4:6]
        for t, programs, stages, tiles in seqexp:
            kq.TILE_OVERRIDES["seqexp"] = kq.Tile(*t)
            kq.SEQEXP_MIN_PROGRAMS, kq.SEQEXP_STAGES, kq.SEQEXP_MIN_TILES = programs, stages, tiles
            bench(("rs_v_from_mx",), tile_kind="seqexp", block_s=t[0], num_warps=t[1], seqexp_min_programs=programs,
                  seqexp_stages=stages, seqexp_min_tiles=tiles)
        kq.TILE_OVERRIDES.clear()
        kq.SEQEXP_MIN_PROGRAMS, kq.SEQEXP_STAGES, kq.SEQEXP_MIN_TILES = saved[6:9]
        for p in mx_vexp_passes:
            kq.MX_VEXP_PASS = p
            bench(("rs_v_from_mx",), tile_kind="mx_vexp_pass", mx_vexp_pass=p)
        kq.MX_VEXP_PASS = saved_pass
        for vr in mx_v_rows:
            kq.MX_SEQ_V_ROWS = vr
            bench(("rs_v_from_mx",), tile_kind="mx_v_rows", mx_v_rows=list(vr) if vr else None)
    finally:
        kq.MX_VEXP_PASS, kq.MX_SEQ_V_ROWS = saved_pass, saved_rows
        kq.TILE_OVERRIDES.clear()
        kq.TILE_OVERRIDES.update(saved[0])
        (kq.VEXP_MIN_PROGRAMS, kq.VEXP_STAGES, kq.VEXP_MIN_TILES, kq.FWD_K_LAUNCH, kq.FWD_K_WARPS,
         kq.SEQEXP_MIN_PROGRAMS, kq.SEQEXP_STAGES, kq.SEQEXP_MIN_TILES) = saved[1:]
    return rows
