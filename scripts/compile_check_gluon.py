"""Compile the Gluon attention forward for sm_90a without a GPU and check what came out.

    python scripts/compile_check_gluon.py [--dump DIR] [--only d128,d128_causal] [--stages N] [--exp2-fma P]
        [--persistent] [--timeline] [--out-store mma|rows] [--mask select|lean]

Needs triton 3.6 (the GPU machine's version; Gluon's API moves between releases).  No CUDA device is touched:
the kernel goes through ``triton.compile`` with an explicit ``GPUTarget("cuda", 90, 32)``, and the cubin through
the ``ptxas`` / ``cuobjdump`` that ship inside the triton wheel.  For each variant (head dim x causal x ping-pong)
it prints registers (launch budget and the highest register the SASS touches), spill bytes, shared memory, the
``setmaxnreg`` values, the wgmma instructions, the SASS of the consumers' KV loop (instruction mix, wgmma waits), and
fails on what must not be there: spills, local memory, wgmma other than m64nNk32 e4m3, ptxas serializing the wgmma
pipeline (C7514 / C7512), more than two ``WARPGROUP.DEPBAR`` per loop iteration.  Exit status 1 when a
check fails.  ``--dump DIR`` writes the TTGIR, PTX and SASS of each variant.
The build a launch makes (its ints specialized by the JIT): ``scripts/compile_launched.py``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def fp8_desc(block_shape, layout_for) -> tuple:
    """(block shape, NVMMA shared layout) of an e4m3 TMA descriptor argument, for ``compile_sm90``."""
    return list(block_shape), layout_for(list(block_shape))


def compile_sm90(fn, consts: dict, descs: dict, ptrs: dict, floats: tuple, num_warps: int, maxnreg: int):
    """``triton.compile`` of the Gluon kernel ``fn`` for sm_90a without a GPU.  Arguments by name: ``consts``
    constexpr values, ``descs`` TMA descriptors (name -> (block shape, layout), e4m3, or (block shape, layout,
    element type) such as "fp32"), ``ptrs`` pointer types (with 16-byte divisibility, as the launchers' tensors
    have), ``floats`` fp32 scalars; every other argument is i32."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in descs:
            shape, layout, *elem = descs[name]
            sig[name] = f"tensordesc<{elem[0] if elem else 'fp8e4nv'}[{', '.join(map(str, shape))}],{layout!r}>"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": maxnreg})


def compile_variant(head_dim: int, causal: bool, pingpong: bool, block_n: int = 128, stages: int | None = None,
                    module=None, k_perm: bool = True, p_carry: str | None = None, maxnreg: int | None = None,
                    exp2_fma: int | None = None, persistent: bool = False, timeline: bool = False,
                    out_store: str | None = None, mask: str | None = None):
    """The forward kernel as the launcher builds it.  ``k_perm``: K through the 5-D key-permuted descriptor
    (``K_PERM``, the launcher's path when Sk % 16 == 0), else the 2-D one (its fallback)."""
    from triton.experimental.gluon import language as gl

    import torch

    from mxattn.kernels import launch

    if module is None:
        from mxattn.kernels import attn_fwd_gluon as module
    m = module

    cfg = m.default_config(head_dim, causal)
    stages = stages or cfg.stages
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv)  # noqa: E731
    k_box = [block_n // 16, 2, 4, 2, head_dim] if k_perm else [block_n, head_dim]
    descs = {"q_desc": fp8_desc([m.WG_ROWS.value, head_dim], lay), "k_desc": fp8_desc(k_box, lay),
             "v_desc": fp8_desc([head_dim, block_n], lay)}
    ptrs = {"QE": "*i32", "KE": "*i32", "VE": "*i32", "O": "*bf16", "LSE": "*fp32"}
    consts = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong,
                  CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, K_PERM=k_perm)
    if "P_CARRY" in m._attn_fwd_ws_kernel.arg_names:
        consts["P_CARRY"] = p_carry or cfg.p_carry
    if "EXP2_FMA" in m._attn_fwd_ws_kernel.arg_names:
        consts["EXP2_FMA"] = cfg.exp2_fma if exp2_fma is None else exp2_fma
    if "OUT_ROWS" in m._attn_fwd_ws_kernel.arg_names:
        consts["OUT_ROWS"] = (out_store or cfg.out_store) == "rows"
    if "LEAN_MASK" in m._attn_fwd_ws_kernel.arg_names:
        consts["LEAN_MASK"] = (mask or cfg.mask) == "lean"
    if "LPT_SECTION" in m._attn_fwd_ws_kernel.arg_names:  # the causal CTA order (132 SMs, the CPU stand-in's)
        consts["LPT_SECTION"] = launch.lpt_section(causal, cfg.causal_lpt, True, launch.sm_count(torch.device("cpu")))
    if "TIMES" in m._attn_fwd_ws_kernel.arg_names:
        if timeline:  # the timing probe's build (scripts/fwd_timeline.py)
            ptrs["TIMES"] = "*i64"
        else:
            consts["TIMES"] = None  # None in every real launch
    fn = m._attn_fwd_ws_kernel
    if persistent:  # GluonFwdConfig.persistent: the same partitions looping over work items (no ping-pong)
        fn = m._attn_fwd_ws_persistent_kernel
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    return compile_sm90(fn, consts, descs, ptrs, ("qk_scale",), 4, maxnreg or cfg.maxnreg)


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    res = {}
    for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("shared", r"SHARED:(\d+)"),
                     ("local", r"LOCAL:(\d+)")):
        mm = re.search(pat, out)
        res[key] = int(mm.group(1)) if mm else None
    return res | {"sass": sass, "raw": out.strip()}


def _ptxas_verbose(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run([_bin("ptxas"), "-arch=sm_90a", "-v", p, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        return (r.stdout + r.stderr).strip()


def _sass_instrs(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if mm:
            out.append((int(mm.group(1), 16), mm.group(2)))
    return out


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]


_PV = r"GMMA\S*\s+R\d+,\s*R\d+,"  # wgmma with a register A operand (P V)
_SMEM_A = r"GMMA\S*\s+R\d+,\s*gdesc"  # wgmma with A from shared memory


def sass_loops(sass: str, body_ok, anchor: str) -> list[dict]:
    """Backward branches whose body passes ``body_ok`` (list of SASS instruction texts) and holds no
    ``USETMAXREG`` (the warp dispatch loop of a warp-specialized region), reduced to the smallest such loop
    around each instruction matching ``anchor``: the out-of-line retry paths of mbarrier waits branch back into
    a loop from far below and make larger spurious ranges.  Per loop: start (hex) and end address, instructions,
    opcode counts, wgmma count, ``WARPGROUP.DEPBAR`` count, ``SHFL.IDX`` count."""
    ins = _sass_instrs(sass)
    pos = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for a, t in ins:
        if _opcode(t) != "BRA":
            continue
        mm = re.search(r"BRA[^0-9]*(0x[0-9a-f]+)", t)
        if not mm or int(mm.group(1), 16) >= a:
            continue
        body = ins[pos[int(mm.group(1), 16)]: pos[a] + 1]
        texts = [x for _, x in body]
        if not body_ok(texts) or any("USETMAXREG" in x for x in texts):
            continue
        loops.append({"start": body[0][0], "end": a, "instrs": len(body),
                      "counts": collections.Counter(_opcode(x) for x in texts),
                      "gmma": sum(1 for x in texts if "GMMA" in x and "DEPBAR" not in x),
                      "depbar": sum(1 for x in texts if "WARPGROUP.DEPBAR" in x),
                      "shfl_idx": sum(1 for x in texts if "SHFL.IDX" in x)})
    inner = []
    for a, t in ins:
        if re.search(anchor, t):
            around = [lp for lp in loops if lp["start"] <= a <= lp["end"]]
            if around:
                best = min(around, key=lambda lp: lp["instrs"])
                if best not in inner:
                    inner.append(best)
    return [lp | {"start": hex(lp["start"])} for lp in inner]


def steady_loops(sass: str) -> list[dict]:
    """The consumers' KV loops: one KV iteration issues both products (Q Kᵀ: A from shared memory, P V: A from
    registers).  Per loop (``sass_loops``): instructions in the body (both softmax paths, masked and not), opcode
    counts, the ``WARPGROUP.DEPBAR`` count (2 per iteration when the wgmma pipeline is intact; one per QGMMA when
    ptxas serialized it) and ``SHFL.IDX`` (P's quad shuffles; the reductions use BFLY)."""
    def both(texts):
        return any(re.search(_PV, x) for x in texts) and any(re.search(_SMEM_A, x) for x in texts)

    return sass_loops(sass, both, _PV)


def step_path(sass: str, loop: dict) -> dict:
    """Instructions of one consumer loop (``steady_loops``) on a common step's path: the loop less the regions its
    predicated forward branches skip (rare branches: head change, mask, rescale; of an if / else the branch skips
    one side and the other is counted), except a region holding an mbarrier arrive (the backward kernels' stage
    release ``if j > 0``, taken by every step after the first).  The method of perf-notes-attn-bwd.md's session 7
    step counts.  Returns the count and the opcodes that mark the step's synchronisation and reductions."""
    ins = _sass_instrs(sass)
    pos = {a: i for i, (a, _) in enumerate(ins)}
    lo, hi = pos[int(loop["start"], 16)], pos[loop["end"]]
    skip = set()
    for i in range(lo, hi + 1):
        a, t = ins[i]
        if _opcode(t) != "BRA" or not re.match(r"^@!?U?P", t):
            continue
        mm = re.search(r"BRA[^0-9]*(0x[0-9a-f]+)", t)
        tgt = int(mm.group(1), 16) if mm else -1
        if tgt <= a or tgt not in pos or pos[tgt] > hi + 1:
            continue
        region = range(i + 1, pos[tgt])
        if any("SYNCS.ARRIVE" in ins[j][1] for j in region):
            continue
        skip.update(region)
    path = [ins[i][1] for i in range(lo, hi + 1) if i not in skip]
    c = collections.Counter(_opcode(t) for t in path)
    return {"instrs": len(path), "BAR.SYNC": sum(1 for t in path if "BAR.SYNC" in t), "STS": c["STS"],
            "LDS": c["LDS"], "SHFL": c["SHFL"], "FMUL": c["FMUL"], "FMNMX": c["FMNMX"], "LDG": c["LDG"],
            "DEPBAR": sum(1 for t in path if "WARPGROUP.DEPBAR" in t)}


def check(k, name: str, dump: str | None, max_depbar: int = 2, allowed_spill_bytes: int | None = 0,
          allowed_loop_local: int = 0, loops_fn=None, max_step_bar: int | None = None) -> bool:
    """Print the report of one compiled variant; False when a rule fails: spills above ``allowed_spill_bytes``
    (ptxas -v, stores + loads; None: any number of bytes, as long as at most ``allowed_loop_local`` LDL / STL lie
    inside the consumer loops, i.e. mostly loop-invariant values such as the epilogue's pointers are spilled),
    local memory in the PTX, no setmaxnreg, a wgmma other than m64nNk32 e4m3, ptxas
    serializing the wgmma pipeline, no consumer loop found, more than ``max_depbar`` WARPGROUP.DEPBAR per loop,
    more than ``max_step_bar`` (when given) BAR.SYNC on a common step's path (``step_path``).
    ``loops_fn``: SASS -> the loops to check (dicts as ``steady_loops``'s; default ``steady_loops``, the attention
    KV loops, which also get the P conversion and step-path lines)."""
    ptx = k.asm["ptx"]
    usage = _resource_usage(k.asm["cubin"])
    ptxas = _ptxas_verbose(ptx)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    spill_bytes = sum(int(a) + int(b) for a, b in spills)
    setmaxnreg = collections.Counter(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))
    local = len(re.findall(r"\b(?:ld|st)\.local", ptx))
    serialized = [ln.strip() for ln in ptxas.splitlines() if "Potential Performance Loss" in ln]
    loops = (loops_fn or steady_loops)(usage["sass"])
    max_reg = max((int(r) for _, t in _sass_instrs(usage["sass"]) for r in re.findall(r"\bR(\d+)\b", t)),
                  default=-1)
    bad_wgmma = [w for w in wgmma if not re.fullmatch(r"m64n\d+k32\.f32\.e4m3\.e4m3", w)]
    loop_local = sum(lp["counts"]["LDL"] + lp["counts"]["STL"] for lp in loops)
    steps = [step_path(usage["sass"], lp) for lp in loops]
    step_bar_ok = max_step_bar is None or all(st["BAR.SYNC"] <= max_step_bar for st in steps)
    spill_ok = loop_local <= allowed_loop_local if allowed_spill_bytes is None else spill_bytes <= allowed_spill_bytes
    ok = (spill_ok and local == 0 and bool(setmaxnreg) and bool(wgmma) and not bad_wgmma
          and not serialized and bool(loops) and all(lp["depbar"] <= max_depbar for lp in loops) and step_bar_ok)
    print(f"== {name}: {'OK' if ok else 'FAIL'}")
    print(f"   registers: launch {usage['regs']}/thread (maxnreg), highest register used in SASS R{max_reg}; "
          f"stack {usage['stack']}, local {usage['local']}")
    allowed = (f"outside the loops, {allowed_loop_local} LDL/STL inside" if allowed_spill_bytes is None
               else allowed_spill_bytes)
    print(f"   spills (ptxas -v): {spill_bytes} bytes (allowed {allowed}), LDL/STL inside the consumer loops: "
          f"{loop_local}; ld/st.local in PTX: {local}")
    print(f"   shared memory: {k.metadata.shared} bytes")
    print(f"   setmaxnreg (kind, regs): {dict(setmaxnreg)}")
    print(f"   wgmma: {dict(wgmma)}" + (f"  NOT e4m3 k32: {bad_wgmma}" if bad_wgmma else ""))
    print(f"   ptxas wgmma serialization: {serialized or 'none'}")
    if not loops:
        print("   FAIL: no consumer loop found in the SASS")
    for lp in loops:
        top = ", ".join(f"{op} {c}" for op, c in lp["counts"].most_common(12))
        paths = " (masked + unmasked paths)" if loops_fn is None else ""
        print(f"   consumer loop at {lp['start']}: {lp['instrs']} SASS instrs{paths}, "
              f"WARPGROUP.DEPBAR {lp['depbar']} (max {max_depbar}); {top}")
        c = lp["counts"]
        if loops_fn is not None:
            continue
        print(f"      P conversion ops in the loop (both paths): SHFL.IDX {lp['shfl_idx']} (all SHFL {c['SHFL']}), "
              f"SEL {c['SEL']}, PRMT {c['PRMT']}, F2FP {c['F2FP']}")
        st = step_path(usage["sass"], lp)
        limit = "" if max_step_bar is None else f" (max BAR.SYNC {max_step_bar})"
        print("      common step path: " + ", ".join(f"{op} {n}" for op, n in st.items()) + limit)
    counts = {label: len(re.findall(pat, ptx)) for label, pat in (
        ("ex2", r"ex2\.approx"), ("tma", r"cp\.async\.bulk\.tensor"), ("mbar_wait", r"mbarrier\.try_wait"),
        ("mbar_arrive", r"mbarrier\.arrive"), ("bar_sync", r"\bbar\.sync|barrier\.sync"), ("shfl", r"shfl\.sync"),
        ("st_shared", r"st\.shared"), ("ld_shared", r"ld\.shared"), ("prmt", r"\bprmt"))}
    print("   PTX counts (whole kernel): " + ", ".join(f"{a}={c}" for a, c in counts.items()))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", k.asm["ttgir"]), ("ptx", ptx), ("sass", usage["sass"]), ("ptxas.txt", ptxas)):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="write TTGIR / PTX / SASS per variant here")
    ap.add_argument("--only", help="comma list of variant names to compile (default: all)")
    ap.add_argument("--stages", type=int, help="K/V ring depth (default: the launcher's default_config)")
    ap.add_argument("--timeline", action="store_true", help="the timing probe's build (TIMES buffer, "
                    "scripts/fwd_timeline.py)")
    ap.add_argument("--persistent", action="store_true", help="the persistent kernel (GluonFwdConfig.persistent); "
                    "its variants are the no-ping-pong ones.  With this script's all-i32 signature it spills and its "
                    "item loop trips the DEPBAR rule; scripts/compile_launched.py fwd-gluon builds what a launch builds "
                    "(the persistent kernel, the default since session 19: no spills)")
    ap.add_argument("--exp2-fma", type=int, help="percent of the unmasked tiles' exp2 on the FMA pipe (0, 25, 50; "
                    "default: the launcher's default_config)")
    ap.add_argument("--out-store", choices=("mma", "rows"), help="how the output tile is stored "
                    "(GluonFwdConfig.out_store; default: the launcher's default_config)")
    ap.add_argument("--mask", choices=("select", "lean"), help="the masked tiles' arithmetic (GluonFwdConfig.mask; "
                    "default: the launcher's default_config)")
    args = ap.parse_args(argv)
    if not triton.__version__.startswith("3.6"):
        print(f"warning: triton {triton.__version__}; this check targets triton 3.6 (the GPU machine's version)")
    variants = []  # K key-permuted (the launcher's path when Sk % 16 == 0), then the 2-D K fallback (_k2d)
    for kp in (True, False):
        for d in (128, 64):
            for causal in (False, True):
                for pp in (True, False):
                    variants.append((f"d{d}{'_causal' if causal else ''}{'' if pp else '_nopingpong'}"
                                     f"{'' if kp else '_k2d'}", d, causal, pp, kp))
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    ok = True
    for name, d, causal, pp, kp in variants:
        try:
            if args.persistent and pp:
                continue
            k = compile_variant(d, causal, pp, stages=args.stages, k_perm=kp, exp2_fma=args.exp2_fma,
                                persistent=args.persistent, timeline=args.timeline, out_store=args.out_store,
                                mask=args.mask)
        except Exception as e:  # noqa: BLE001 - report every variant
            print(f"== {name}: COMPILE ERROR\n{type(e).__name__}: {e}")
            ok = False
            continue
        ok = check(k, name, args.dump) and ok
    print("all variants OK" if ok else "some variants FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
