"""Compile the launched builds of ``rmsnorm_quant``'s forward for sm_90a without a GPU; count what they execute.

    /tmp/g36/bin/python scripts/compile_check_rmsnorm.py [--m 16384] [--n 4096,8192] [--orient hdim,seq,both]
        [--tile BM,BN,WARPS[,MAXNREG][,rowsets]] [--dump DIR] [--opcodes]

Needs triton 3.6 (the H200's; its bundled ptxas 12.8).  Each build is the one a launch makes: the launcher
``kernels.rmsnorm_quant.rmsnorm_quant_fwd`` runs on CPU tensors of the shape asked for under
``compile_launched.capture`` (nothing runs; the kernel, grid and arguments are recorded) with the GPU's
rounding (``_soft`` answered as on CUDA), and ``compile_launched.compile_launch`` hands the recorded launch to
Triton's own ``JITFunction.run`` (its specialization of every argument, then the compile).

Printed per build: registers, spills (``ptxas -v``), shared memory, SASS memory / barrier / shuffle opcodes, and
the *executed* instruction count per element (``executed_per_thread``): the SASS is cut into basic blocks, its
natural loops found (dominators), each loop costed as its cheapest iteration times the number of chunks (every loop
of these kernels is a pass over N), and the cheapest path from entry to exit through two such passes taken, so the
NaN-patching side of a kernel and the division slow paths are left out; the total per thread is divided by the
elements a thread owns (rows x N / threads).  Budget: the H200 issues ~33 T lane-instructions/s (132 SMs x 4
schedulers x 32 lanes x 1.98 GHz); at the copy rate of 4.27 TB/s a kernel moving b bytes per element has
33.4e12 / (4.27e12 / b) instructions per element, 23.5 for seq (3.03 B) and 31.8 for both (4.06 B).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import compile_launched as cl  # noqa: E402  (sets TRITON_INTERPRET=0 before triton is imported)
import torch  # noqa: E402

from compile_check_gluon import _opcode, _sass_instrs  # noqa: E402

import mxattn.kernels.rmsnorm_quant as kr  # noqa: E402

ISSUE_RATE = 132 * 4 * 32 * 1.98e9  # lane-instructions per second on the H200
COPY_RATE = 4.27e12  # bytes read + written per second (DESIGN §4)
BYTES_PER_ELEMENT = {"hdim": 2 + 1 + 1 / 32, "hdimrs": 3, "seq": 2 + 1 + 1 / 32, "both": 2 + 2 + 2 / 32}


def budget(orient: str) -> float:
    """Instructions per element a kernel may execute and still run at the copy rate."""
    return ISSUE_RATE / (COPY_RATE / BYTES_PER_ELEMENT[orient])


def capture_launch(M: int, N: int, orient: str, tile):
    """The recorded launch of ``rmsnorm_quant_fwd`` for a bf16 (1, M, N) x (``tile`` None: the default)."""
    x3 = torch.empty(1, M, N, dtype=torch.bfloat16)
    w = torch.empty(N, dtype=torch.bfloat16)
    with cl.capture() as launches, cl._patched([(kr, "_soft", lambda device: False)]):
        kr.rmsnorm_quant_fwd(x3, w, 1e-6, hdim=orient != "seq", seq=orient not in ("hdim", "hdimrs"), row_scaled=orient == "hdimrs",
                             rceil=True, tile=tile)
    (lc,) = launches
    return lc


def _branch_target(t: str) -> int | None:
    mm = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", t)
    return int(mm.group(1), 16) if mm else None


def _predicated(t: str) -> bool:
    """A branch that may fall through: a predicate on the instruction or on the branch (``BRA P1, ...``), or a
    ``BRA.DIV`` (taken only when the warp has diverged)."""
    return bool(re.match(r"^@!?U?P", t) or re.search(r"\bBRA(\.DIV)?\s+!?U?P[0-6T]\b", t) or "BRA.DIV" in t)


def cfg(ins: list[tuple[int, str]]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Basic blocks (first, last instruction index) of the kernel's SASS and their successors.  Calls are
    stepped over (the division / square-root slow paths are subroutines); EXIT and RET end a path."""
    pos = {a: i for i, (a, _) in enumerate(ins)}
    leaders = {0}
    for i, (a, t) in enumerate(ins):
        op = _opcode(t)
        if op == "BRA":
            tgt = _branch_target(t)
            if tgt in pos:
                leaders.add(pos[tgt])
        if op in ("BRA", "EXIT", "RET") and i + 1 < len(ins):
            leaders.add(i + 1)
    starts = sorted(leaders)
    blocks = [(b, (starts[k + 1] if k + 1 < len(starts) else len(ins)) - 1) for k, b in enumerate(starts)]
    block_of = {b: k for k, (b, _) in enumerate(blocks)}
    succ = []
    for k, (b, e) in enumerate(blocks):
        t = ins[e][1]
        op = _opcode(t)
        nxt = [k + 1] if k + 1 < len(blocks) else []
        if op == "BRA":
            tgt = _branch_target(t)
            out = [block_of[pos[tgt]]] if tgt in pos else []
            succ.append(out + nxt if _predicated(t) else out)
        elif op in ("EXIT", "RET"):
            succ.append(nxt if _predicated(t) else [])
        else:
            succ.append(nxt)
    return blocks, succ


def natural_loops(succ: list[list[int]]) -> list[tuple[int, set[int]]]:
    """(header, body blocks) of each natural loop (a back edge u -> h with h dominating u), innermost first."""
    n = len(succ)
    pred = [[] for _ in range(n)]
    for u, vs in enumerate(succ):
        for v in vs:
            pred[v].append(u)
    reach, stack = {0}, [0]
    while stack:
        for v in succ[stack.pop()]:
            if v not in reach:
                reach.add(v)
                stack.append(v)
    dom = {v: set(reach) for v in reach}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for v in sorted(reach - {0}):
            ps = [dom[p] for p in pred[v] if p in reach]
            new = ({v} | set.intersection(*ps)) if ps else {v}
            if new != dom[v]:
                dom[v], changed = new, True
    found: dict[int, set[int]] = {}
    for u in reach:
        for h in succ[u]:
            if h in dom[u]:
                body, work = {h, u}, ([u] if u != h else [])
                while work:
                    for p in pred[work.pop()]:
                        if p in reach and p not in body:
                            body.add(p)
                            work.append(p)
                found.setdefault(h, set()).update(body)
    return sorted(found.items(), key=lambda hb: len(hb[1]))


def executed_per_thread(sass: str, trips: int, passes: int = 2) -> tuple[int, list[int]]:
    """Instructions one thread executes on the cheapest path from entry to exit, every loop run ``trips`` times
    (the cheapest path through one iteration, inner loops included): rare branches (the NaN-patching side of a
    kernel, the division slow paths) are off that path; it goes through ``passes`` loops (the kernels' passes over
    the chunks: pass 1 and the last pass).  Also
    returns the instructions of one iteration of each loop, innermost first."""
    ins = _sass_instrs(sass)
    blocks, succ = cfg(ins)
    cost = [e - b + 1 for b, e in blocks]
    node_of = list(range(len(blocks)))  # block -> the (collapsed) node it belongs to
    edges = {k: set(v) for k, v in enumerate(succ)}
    iteration = []
    for h, body in natural_loops(succ):
        nodes = {node_of[b] for b in body}
        # cheapest path header -> header around the loop, inside it
        dist = {h: cost[h]}
        order = [h]
        best_back = None
        while order:
            u = min(order, key=lambda x: dist[x])
            order.remove(u)
            for v in edges[u]:
                if v == h:
                    best_back = dist[u] if best_back is None else min(best_back, dist[u])
                elif v in nodes and dist.get(v, 1 << 60) > dist[u] + cost[v]:
                    dist[v] = dist[u] + cost[v]
                    order.append(v)
        it = best_back or 0
        iteration.append(it)
        exits = set()
        for u in nodes:
            exits |= {v for v in edges[u] if v not in nodes}
        for u in nodes - {h}:
            cost[u], edges[u] = 0, set()
        cost[h] = trips * it
        edges[h] = exits
        for b in range(len(blocks)):
            if node_of[b] in nodes:
                node_of[b] = h
        for u in edges:
            edges[u] = {h if v in nodes else v for v in edges[u]} - ({h} if u == h else set())
    # cheapest entry -> exit path over the collapsed graph through at least ``passes`` loops (with runtime trip
    # counts each loop has a guard that jumps over it; the kernels run every pass, the chunks are never zero)
    headers = {h for h, _ in natural_loops(succ)}
    passes = min(passes, len(headers))  # the one-chunk hdim kernel has no loop
    start = (0, 1 if 0 in headers else 0)
    dist = {start: cost[0]}
    todo = [start]
    best = None
    while todo:
        u = min(todo, key=lambda x: dist[x])
        todo.remove(u)
        node, seen = u
        if not edges[node] and seen >= passes:
            best = dist[u] if best is None else min(best, dist[u])
        for v in edges[node]:
            nv = (v, min(passes, seen + (v in headers)))
            if dist.get(nv, 1 << 60) > dist[u] + cost[v]:
                dist[nv] = dist[u] + cost[v]
                todo.append(nv)
    return best or 0, iteration


def report(M: int, N: int, orient: str, tile, dump: str | None) -> dict:
    lc = capture_launch(M, N, orient, tile)
    k = cl.compile_launch(lc)
    m = cl.metrics(k)
    c = cl._constexprs(lc)
    threads = 32 * cl._options(lc)["num_warps"]
    rows = c["MB"] * c["MI"] if "MB" in c else 32
    block_n = c.get("BLOCK_N", c.get("NB", 0) * 32) or c["NCH"] * c["CH"]  # token blocks: one pass a row
    trips = -(-N // block_n)  # every loop of these kernels is a pass over the row's chunks
    executed, bodies = executed_per_thread(m["_asm"]["sass"], trips)
    per_elem = executed / (rows * N / threads)
    name = f"{orient} M{M} N{N} tile ({rows}, {block_n}, {threads // 32} warps" + (
        f", maxnreg {lc.kwargs['maxnreg']}" if "maxnreg" in lc.kwargs else "") + (
        ", rowsets)" if "NB" in c else ", token blocks)" if "LOG_CH" in c else ")") + f" {lc.name}"
    print(f"\n== {name}: grid {lc.grid}")
    ops = {key: v for key, v in m.items() if key != "_asm" and key.split(".")[0] in cl.MEM_OPS}
    print(f"   registers {m['registers (launch)']}, spills {m['spill stores + loads (ptxas -v, bytes)']}, "
          f"shared {m['shared bytes']} B, SASS {m['SASS instructions']}; loop iterations {bodies} x {trips} trips")
    print(f"   memory / sync ops: {ops}")
    print(f"   executed instructions per thread {executed}, per element {per_elem:.1f} "
          f"(budget at the copy rate {budget(orient):.1f})")
    if dump:
        cl._dump(dump, name.split(":")[0].replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""), m)
    counts = collections.Counter(_opcode(t) for _, t in _sass_instrs(m["_asm"]["sass"]))
    return {"name": name, "per_element": per_elem, "regs": m["registers (launch)"],
            "spills": m["spill stores + loads (ptxas -v, bytes)"], "opcodes": counts}


def _parse_tile(text: str):
    parts = text.split(",")
    nums = [int(p) for p in parts[:3]]
    rest = parts[3:]
    maxnreg = int(rest.pop(0)) if rest and rest[0].isdigit() else None
    extra = {}
    for name in rest:  # flags (rowsets, token_blocks) or key=int fields
        key, _, val = name.partition("=")
        extra[key] = int(val) if val else True
    return kr.FwdTile(*nums, maxnreg, **extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--n", default="4096,8192")
    ap.add_argument("--orient", default="seq,both")
    ap.add_argument("--tile", action="append", type=_parse_tile,
                    help="BM,BN,WARPS[,MAXNREG][,flag...] (FwdTile fields; repeatable); default: the launcher's")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--opcodes", action="store_true", help="print the SASS opcode histogram of each build")
    args = ap.parse_args(argv)
    for N in (int(v) for v in args.n.split(",")):
        for orient in args.orient.split(","):
            for tile in args.tile or [None]:
                r = report(args.m, N, orient, tile, args.dump)
                if args.opcodes:
                    print("   " + ", ".join(f"{op} {n}" for op, n in r["opcodes"].most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
