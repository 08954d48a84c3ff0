"""Compile the quantize kernels' launched variants for sm_90a without a GPU and look for the ptxas 12.x fold hazard.

    python scripts/compile_check_quantize.py [--d 64,128] [--dump DIR]

Needs triton 3.6 (its bundled ptxas 12.8 is the one that miscompiles; docs/quantize-both-byte3.md).  Builds, through
``triton.compile`` with ``GPUTarget("cuda", 90, 32)``, the variants the attention path launches: the single-pass
``_quantize_kernel`` (Q, K, V, K+V "both") and ``_operands_kernel`` (the forward's two launches, with and without the
backward's K/V orientations).  For each it prints registers, spills and the findings of
``scripts/qboth_byte3_probe.py``'s checks: PTX registers read but never written, cvt-pack fold hazards, and SASS
``F2FP...MERGE_C`` reading a register that holds no conversion.  Exit status 1 when any is found.

Integer arguments: Triton's JIT specializes every int argument divisible by 16 (``tt.divisibility``), and that
changes the code (16-byte vector loads and stores instead of 2-byte ones). ``--ints`` picks which launched
specializations to build: ``lengths`` (strides, sizes and S_pad divisible by 16, sequence lengths and tile counts
not: an odd S), ``all`` (every int divisible: power-of-two shapes such as B2 S8192 H16), ``none`` (nothing known,
the build before session 9, which no launch makes: strides are multiples of H·D).  Default ``lengths,all``.
These are approximations of a launch's specialization; ``scripts/compile_launched.py quant-forward`` builds the
exact one for a given shape (at S 4095 even the tile counts happen to be multiples of 16).
The build a launch makes (its ints specialized by the JIT): ``scripts/compile_launched.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TRITON_INTERPRET", "0")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from compile_check_gluon import _resource_usage  # noqa: E402
from qboth_byte3_probe import ptx_findings, sass_phantoms  # noqa: E402

import mxattn.kernels.quantize as kq  # noqa: E402

PTRS_U8 = "*u8"
# int arguments that are sequence lengths or counts of tiles / groups / programs (the rest are strides or sizes that
# are multiples of H·D or of 32): divisible by 16 only at some shapes
# (S_pad is not one: every launch pads S to SEQ_ALIGN = 16, so the JIT always marks it divisible)
_LENGTH_INTS = {"S", "S_ld", "n_s_tiles", "n_groups", "n_tiles", "NSB", "n_a", "n_b", "n_e", "eper", "fper"}
_LENGTH_INTS |= {f"{j}{n}" for j in "abef" for n in ("S", "NSB", "n_tiles", "n_groups")}
_UNIT_INTS = {"esxd", "fsxd"}  # the V-exponent jobs' channel stride: 1 in every launch, which the JIT makes a constant
INTS = "all"  # which int arguments are marked divisible by 16 (``--ints``): "none", "lengths" or "all"


def compile_tl(fn, consts: dict, ptrs: dict, num_warps: int):
    """``triton.compile`` of the ``tl`` kernel ``fn`` for sm_90a: ``consts`` constexpr values, ``ptrs`` pointer
    types (16-byte divisible, as fresh allocations are); every other argument i32, divisible by 16 as ``INTS``
    says (the JIT's specialization of a launch)."""
    sig, attrs, cvals = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            cvals[(i,)] = consts[name]
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _UNIT_INTS and INTS != "none":
            sig[name] = "constexpr"
            cvals[(i,)] = 1
        else:
            sig[name] = "i32"
            if INTS == "all" or (INTS == "lengths" and name not in _LENGTH_INTS):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, sig, cvals, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def quantize_variant(D: int, kind: str):
    """The single-pass launch of a role at the default tiles: Q and K on ``_hdim_kernel``, V and K+V ("both") on
    ``_quantize_kernel`` (partial tiles: EVEN off)."""
    dp = kq._d_pad(D)
    ptrs = {"x_ptr": "*bf16", "hd_ptr": PTRS_U8, "he_ptr": "*i32", "cw_ptr": "*i32", "ce_ptr": "*i32"}
    if kind in ("q", "k"):
        tile = kq._tile("hdim_k" if kind == "k" else "hdim", dp, 128)
        consts = dict(D=D, NDP=dp // 32, BLOCK_S=tile.block_s, GROUP=128 if kind == "k" else 1, RCEIL=True,
                      SOFT=False, IDX64=False, SWZ=False)
        return compile_tl(kq._hdim_kernel, consts, ptrs, tile.num_warps)
    flags = {"v": dict(HDIM=False, SEQ=True, HDIM_GROUP=0, SEQ_RS=True),
             "both": dict(HDIM=True, SEQ=True, HDIM_GROUP=128, SEQ_RS=True)}[kind]
    tile = kq._tile("seq_k" if kind == "both" else "seq", dp, 128)
    consts = dict(D=D, NDP=dp // 32, BLOCK_S=tile.block_s, RCEIL=True, SOFT=False, IDX64=False, SWZ=False, EVEN=False,
                  J=tile.row_groups, **flags)
    return compile_tl(kq._quantize_kernel, consts, ptrs, tile.num_warps)


def operands_variant(D: int, launch: str):
    """``_operands_kernel`` as ``forward_operands_triton`` launches it: "first" (Q, K hdim; V exponents), "second"
    (V seq), "first_keep" (Q; K and V exponents), "second_keep" (K and V in both orientations).  Tiles as the plan
    picks them (the first launch at K's warps), partial tiles (EVEN off)."""
    dp = kq._d_pad(D)
    kt = kq._tile("hdim_k", dp, 128)
    warps_first = kt.num_warps
    off = dict(BS=32, HDIM=False, SEQ=False, GROUP=0, RS=False, ROWSET=True, J=1)
    q = dict(BS=kq._tile("hdim", dp, warps=warps_first).block_s, HDIM=True, SEQ=False, GROUP=1, RS=False, ROWSET=False,
             J=1)
    q_keep = dict(q, BS=kq._tile("hdim", dp).block_s)
    k = dict(BS=128, HDIM=True, SEQ=False, GROUP=128, RS=False, ROWSET=False, J=1)
    vt = kq._tile("seq", dp)
    v = dict(BS=vt.block_s, HDIM=False, SEQ=True, GROUP=0, RS=True, ROWSET=True, J=vt.row_groups)
    bt = kq._tile("seq_k", dp, 128)
    both = dict(BS=128, HDIM=True, SEQ=True, GROUP=128, RS=True, ROWSET=True, J=bt.row_groups)
    a, b, e, f, warps = {"first": (q, k, True, False, warps_first), "second": (v, None, False, False, vt.num_warps),
                         "first_keep": (q_keep, None, True, True, 4),
                         "second_keep": (both, both, False, False, bt.num_warps)}[launch]
    ebs = kq._tile("vexp", dp, warps=warps).block_s
    consts = dict(D=D, NDP=dp // 32, RCEIL=True, SOFT=False, IDX64=False, E=e, E_BS=ebs, E_STAGES=kq.VEXP_STAGES, F=f,
                  F_BS=ebs, F_STAGES=kq.VEXP_STAGES)
    for tag, job in (("A", a), ("B", b)):
        j = job or off
        consts.update({tag: job is not None, f"{tag}_BS": j["BS"], f"{tag}_HDIM": j["HDIM"], f"{tag}_SEQ": j["SEQ"],
                       f"{tag}_GROUP": j["GROUP"], f"{tag}_RS": j["RS"], f"{tag}_ROWSET": j["ROWSET"],
                       f"{tag}_EVEN": False, f"{tag}_J": j["J"]})
    ptrs = {n: "*bf16" for n in ("ax", "bx", "ex", "fx")}
    ptrs.update({n: PTRS_U8 for n in ("ahd", "bhd")})
    ptrs.update({n: "*i32" for n in ("ahe", "ace", "acw", "bhe", "bce", "bcw", "eexp", "fexp")})
    return compile_tl(kq._operands_kernel, consts, ptrs, warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--ints", default="lengths,all", help="comma list of none / lengths / all (module docstring)")
    args = ap.parse_args(argv)
    global INTS
    bad = 0
    builds = []
    for ints in args.ints.split(","):
        if ints not in ("none", "lengths", "all"):
            ap.error(f"--ints: {ints!r} is not none, lengths or all")
        for D in (int(x) for x in args.d.split(",")):
            builds += [(f"quantize {kind} d{D} ints={ints}", ints,
                        lambda D=D, kind=kind: quantize_variant(D, kind)) for kind in ("q", "k", "v", "both")]
            builds += [(f"_operands_kernel {launch} d{D} ints={ints}", ints,
                        lambda D=D, launch=launch: operands_variant(D, launch))
                       for launch in ("first", "second", "first_keep", "second_keep")]
    for name, ints, build in builds:
        INTS = ints
        ck = build()
        res = _resource_usage(ck.asm["cubin"])
        never, hazards = ptx_findings(ck.asm["ptx"])
        phantoms = sass_phantoms(res["sass"])
        ok = not hazards and not phantoms
        bad += not ok
        mem = {}
        for op in re.findall(r"\b(?:LDG|STG)[A-Z0-9._]*", res["sass"]):
            mem[op] = mem.get(op, 0) + 1
        print(f"{'ok ' if ok else 'BAD'} {name}: regs {res['regs']}, stack {res['stack']}, local {res['local']}; "
              f"never-written regs {len(never)}, fold hazards {len(hazards)}, phantom MERGE_C {len(phantoms)}; "
              f"global access {dict(sorted(mem.items()))}", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            stem = os.path.join(args.dump, name.replace(" ", "_"))
            for ext, text in (("ptx", ck.asm["ptx"]), ("sass", res["sass"])):
                with open(f"{stem}.{ext}", "w") as fh:
                    fh.write(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
