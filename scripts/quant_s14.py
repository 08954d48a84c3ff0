"""Session 14's GPU timing of the quantize kernels (gpu_check.sh stage quant14).

    python scripts/quant_s14.py rows CODE OUT.jsonl      # the bench rows of the mxattn imported (run from a tree)
    python scripts/quant_s14.py sweep OUT.json           # the session's sweeps (this tree's knobs)
    python scripts/quant_s14.py table FILE...            # one line per row: code, kernel, shape, variant, ms, % copy
    python scripts/quant_s14.py passes OUT.json          # session 16: V's pass 1 from MX, data-first vs scales-first
    python scripts/quant_s14.py issue3 OUT.json          # session 16: every kernel issue 3 names, this tree's defaults
    python scripts/quant_s14.py issue3graph OUT.json     # the same as CUDA-graph replays, then eager, per size
    python scripts/quant_s14.py tiles OUT.json           # session 16: V pass 2 from MX, dequant_seq, seq at d64
    python scripts/quant_s14.py vrows OUT.json           # session 16: V pass 2 from MX on rows of channels

``rows`` runs on whatever ``mxattn`` is first on the path, so that a base tree (``_base``) and this tree are timed
in one call; kernels the imported bench does not know are left out.  MXATTN_DEADLINE (epoch seconds) stops a
sweep early with what it has.
"""

from __future__ import annotations

import json
import os
import sys
import time

# rows at the bench's sizes (268 MB of bf16: d128, a few at d64) and at the public forward's shape (33.5 MB per tensor)
BIG_ROWS = ("rs_v_exps", "rs_v", "rs_v_from_mx", "fwd_operands", "fwd_operands_kv", "rs_both", "quant_both",
            "rs_k_from_mx", "dequant_seq")
D64_ROWS = ("rs_v_exps", "rs_v", "rs_v_from_mx", "fwd_operands")
PUBLIC = (2, 4096, 16, 128)
K_TILES = ((128, 4), (128, 8), (256, 4), (256, 8))  # (block_s, warps): 256 = two groups of 128
PUBLIC_ROWS = ("rs_v_exps", "rs_v", "rs_v_from_mx", "fwd_operands", "fwd_operands_kv", "rs_both")


def _left() -> float:
    dl = os.environ.get("MXATTN_DEADLINE")
    return float(dl) - time.time() if dl else 1e9


def rows(code: str, path: str) -> None:
    from mxattn.bench import quantize_bench as qb

    known = set(qb.KERNELS) | set(getattr(qb, "SWEEP_ONLY", ()))
    plan = [((8, 8192, 16, 128), BIG_ROWS), ((16, 8192, 16, 64), D64_ROWS), (PUBLIC, PUBLIC_ROWS)]
    with open(path, "a") as f:
        for size, ks in plan:
            if _left() < 20:
                print("!! deadline: rows stopped", flush=True)
                return
            ks = [k for k in ks if k in known]
            for r in qb.run_quantize_bench([size], kernels=ks, progress=False, rep_ms=100):
                r["code"] = code
                f.write(json.dumps(r) + "\n")
                f.flush()
                print(_line(r), flush=True)


def sweep(path: str) -> None:
    from mxattn.bench import quantize_bench as qb

    out = []
    jobs = [
        ("vexp", PUBLIC, dict(vexp=qb.SWEEP_VEXP_S14)),
        ("vexp", (8, 8192, 16, 128), dict(vexp=qb.SWEEP_VEXP_S14)),
        # the no-grad forward fuses its operands up to 2^25 elements of q + k + v (interface): B1 is the largest
        # such shape at H16 S4096 d128
        ("fwd", (1, 4096, 16, 128), dict(vexp=(), fwd=qb.SWEEP_FWD)),
        ("fwd", PUBLIC, dict(vexp=(), fwd=qb.SWEEP_FWD)),
        ("seqexp", (8, 8192, 16, 128), dict(vexp=(), seqexp=qb.SWEEP_SEQEXP)),
        ("seqexp", PUBLIC, dict(vexp=(), seqexp=qb.SWEEP_SEQEXP)),
        # K from MX with 1 or 2 exponent groups per program (MX_K_GROUPS); dequant_seq's tile at d128
        ("mx_hdim_k", (16, 8192, 16, 64), dict(vexp=(), plan={"mx_hdim_k": (("rs_k_from_mx",), K_TILES)})),
        ("mx_hdim_k", (8, 8192, 16, 128), dict(vexp=(), plan={"mx_hdim_k": (("rs_k_from_mx",), K_TILES[:2] +
                                                                         K_TILES[3:])})),
        ("mx_seq", (8, 8192, 16, 128), dict(vexp=(), plan={"mx_seq": (("dequant_seq",), ((32, 4), (64, 4), (64, 8)))})),
    ]
    for name, size, kw in jobs:
        if _left() < 25:
            print(f"!! deadline: sweep stopped before {name} {size}", flush=True)
            break
        for r in qb.run_tile_sweep(size, **{"plan": {}, **kw}, progress=False, rep_ms=60):
            r["code"] = "sweep"
            out.append(r)
            print(_line(r), flush=True)
        with open(path, "w") as f:  # after every job: a timeout keeps what was measured
            json.dump(out, f, indent=1)


def passes(path: str) -> None:
    """``MX_VEXP_PASS`` "data" and "scales" side by side (each twice, alternating) at the bench sizes and the
    public forward's shape: row rs_v_from_mx (both passes)."""
    from mxattn.bench import quantize_bench as qb

    out = []
    for size in ((8, 8192, 16, 128), (16, 8192, 16, 64), PUBLIC):
        if _left() < 25:
            print(f"!! deadline: passes stopped before {size}", flush=True)
            break
        for r in qb.run_tile_sweep(size, plan={}, vexp=(), mx_vexp_passes=("data", "scales") * 2, progress=False,
                                   rep_ms=100):
            r["code"] = "passes"
            out.append(r)
            print(_line(r), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def tiles(path: str) -> None:
    """Session 16's tile sweeps: V's pass 2 from MX (``mx_seq_v``, row rs_v_from_mx with the scales-first pass 1)
    at d128 and d64, dequantize of channel-major data at larger tiles, the seq kernels at d64."""
    from mxattn.bench import quantize_bench as qb

    d64_v = ((64, 4), (128, 4), (128, 8), (256, 8), (256, 16))
    d64_seq = ((64, 4, 1), (128, 4, 1), (128, 8, 1), (64, 4, 2), (128, 8, 2), (256, 8, 1))
    jobs = [
        ((8, 8192, 16, 128), {"mx_seq_v": qb.SWEEP_PLAN["mx_seq_v"]}),
        ((16, 8192, 16, 64), {"mx_seq_v": (("rs_v_from_mx",), d64_v)}),
        ((8, 8192, 16, 128), {"mx_seq": (("dequant_seq",), ((64, 8), (128, 8), (128, 16)))}),
        ((16, 8192, 16, 64), {"seq": (("quant_seq", "quant_both", "rs_v"), d64_seq)}),
    ]
    out = []
    for size, plan in jobs:
        if _left() < 25:
            print(f"!! deadline: tiles stopped before {size} {list(plan)}", flush=True)
            break
        for r in qb.run_tile_sweep(size, plan=plan, vexp=(), progress=False, rep_ms=100):
            r["code"] = "tiles"
            out.append(r)
            print(_line(r), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


V_ROWS = (None, (512, 32, 4), (256, 32, 4), (1024, 16, 4), (512, 64, 8), (256, 64, 4), (1024, 32, 8))


def v_rows(path: str) -> None:
    """``MX_SEQ_V_ROWS`` (None: the tokens x all-channels tile) at d128 and d64, the list twice (row rs_v_from_mx)."""
    from mxattn.bench import quantize_bench as qb

    out = []
    for size in ((8, 8192, 16, 128), (16, 8192, 16, 64)):
        if _left() < 25:
            print(f"!! deadline: rows stopped before {size}", flush=True)
            break
        for r in qb.run_tile_sweep(size, plan={}, vexp=(), mx_v_rows=V_ROWS * 2, progress=False, rep_ms=100):
            r["code"] = "vrows"
            out.append(r)
            print(_line(r), flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


# every kernel issue 3 names (the quantize orientations, dequantize, the Hopper operands from float and from MX)
ISSUE3_ROWS = ("quant_hdim", "quant_seq", "quant_both", "dequant_hdim", "dequant_seq", "rs_q", "rs_k", "rs_v",
               "rs_both", "rs_q_from_mx", "rs_k_from_mx", "rs_v_from_mx", "fwd_operands")


def issue3(path: str, timings=("eager",)) -> None:
    """The rows of ``ISSUE3_ROWS`` at d128 (B8 S8192 H16) and d64 (B16 S8192 H16), this tree's defaults, one run,
    for each of ``timings`` (``run_quantize_bench``'s eager calls or CUDA-graph replays)."""
    from mxattn.bench import quantize_bench as qb

    out = []
    for size, timing in ((size, t) for size in ((8, 8192, 16, 128), (16, 8192, 16, 64)) for t in timings):
        if _left() < 25:
            print(f"!! deadline: issue3 rows stopped before {size} {timing}", flush=True)
            break
        for r in qb.run_quantize_bench([size], kernels=ISSUE3_ROWS, progress=False, rep_ms=100, timing=timing):
            r["code"] = "issue3-" + timing
            out.append(r)
            print(_line(r), flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)


def _variant(r: dict) -> str:
    kind = r.get("tile_kind")
    if kind == "mx_v_rows":
        return f"rows {r['mx_v_rows']}"
    if kind == "mx_vexp_pass":
        return f"pass1 {r['mx_vexp_pass']}"
    if kind == "vexp":
        return (f"{r['block_s']}x{r['num_warps']} p{r['vexp_min_programs']} st{r['vexp_stages']} "
                f"t{r.get('vexp_min_tiles', 1)}")
    if kind == "seqexp":
        return (f"{r['block_s']}x{r['num_warps']} p{r['seqexp_min_programs']} st{r['seqexp_stages']} "
                f"t{r['seqexp_min_tiles']}")
    if kind in ("mx_hdim_k", "mx_seq", "mx_seq_v"):
        return f"{kind} {r['block_s']}x{r['num_warps']}"
    if kind == "fwd":
        return f"K {r['fwd_k_launch']} w{r['fwd_k_warps']}"
    return "default"


def _line(r: dict) -> str:
    shape = f"B{r['B']}S{r['S']}H{r['H']}D{r['D']}"
    return (f"{str(r.get('code', ''))[:14]:<15}{r['kernel']:<16}{shape:<17}{_variant(r):<24}{r['ms']:8.4f} ms "
            f"{r['pct_of_copy']:6.1f} %")


def table(paths) -> None:
    for p in paths:
        if not os.path.exists(p):
            print(f"!! {p}: missing")
            continue
        text = open(p).read()
        rs = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]
        for r in rs:
            print(_line(r))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "rows":
        rows(sys.argv[2], sys.argv[3])
    elif cmd == "sweep":
        sweep(sys.argv[2])
    elif cmd == "passes":
        passes(sys.argv[2])
    elif cmd == "vrows":
        v_rows(sys.argv[2])
    elif cmd == "tiles":
        tiles(sys.argv[2])
    elif cmd == "issue3":
        issue3(sys.argv[2])
    elif cmd == "issue3graph":  # CUDA-graph replays, then eager calls, per size
        issue3(sys.argv[2], ("graph", "eager"))
    elif cmd == "table":
        table(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
