"""Compile-only probe: how can the e4m3 probabilities P_{j-1} cross the KV loop edge packed (4 e4m3 per 32-bit
register) in a Gluon Hopper kernel, and what does the wgmma A operand then cost?  (triton 3.6, sm_90a, no GPU)

    PYTHONPATH=. /tmp/g36/bin/python scripts/p8_carry_probe.py [--only MODE,...] [--n 128,256] [--dump DIR]
    PYTHONPATH=. /tmp/g36/bin/python scripts/p8_carry_probe.py real [--carry fp32,i32br] [--n 128,256] [--d 64]
        [--causal] [--k2d] [--regs 200]     (the real forward, attn_fwd_gluon.P_CARRY, with the compile check)

One warpgroup (4 warps), one loop with the forward's FA3 shape: issue S_j = Q K_jᵀ (A from shared memory), turn
the carried P_{j-1} into wgmma's e4m3 A operand, issue O += P_{j-1} V_{j-1}, wait for S_j, p_j = exp2 of it
(a stand-in softmax: scale/shift FMA, exp2, row sum), wait for P V, rescale O, and carry p_j in the MODE's form:

  fp32      p_j in fp32 (S accumulator layout); e4m3 conversion at the top of the next iteration (today's kernel)
  e4m3      p_j converted to the e4m3 A-operand tensor after the softmax and carried as that tensor (the notes'
            "64 loose bytes" case)
  i32split  e4m3 A-operand tensor -> reshape [64, N/4, 4] -> split/split -> 4 byte tensors -> shifts/ors -> int32
            [64, N/4] carried; top: shifts/truncs -> join/join -> reshape -> e4m3 A operand (pure Gluon)
  i32asm    e4m3 A-operand tensor -> inline asm (pack=4: the 4 bytes arrive in one b32) copied into an int32
            [64, N, ] tensor, 4 copies per word -> reshape [64, N/4, 4] -> reduce keeping the first -> int32
            [64, N/4] carried; top: expand_dims + broadcast to [64, N/4, 4] -> inline asm (pack=4, int32 in,
            e4m3 out packed in one b32) -> reshape -> e4m3 A operand (assert_trivial)
  i32cvt    as i32asm, but the pack is one inline-asm block straight from fp32 (2 x cvt.rn.satfinite.e4m3x2.f32
            + one mov.b32 {lo, hi}): fp32 in the A-operand layout -> packed int32 word
  regs      no P at all in the loop (O += Q-free product of a constant A): register floor of the skeleton

The fp32 P is relabelled into the A operand's layout as the real kernel's K_PERM path does (a layout change only,
asserted trivial), so every mode converts without shuffles.  Per mode and BLOCK_N: registers (ptxas REG), spills,
ptxas wgmma serialization warnings, the loop's SASS instruction count and the opcodes of the conversion
(F2FP, PRMT, LOP3, SHF, IMAD.U32/MOV), and the WARPGROUP.DEPBAR count.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from scripts.compile_check_gluon import _ptxas_verbose, _resource_usage, compile_sm90, sass_loops  # noqa: E402
from mxattn.kernels.attn_fwd_gluon import _pack_e4m3_words as _pack_asm  # noqa: E402
from mxattn.kernels.attn_fwd_gluon import _pack_f32_words as _pack_cvt  # noqa: E402
from mxattn.kernels.attn_fwd_gluon import _unpack_p as _unpack_asm  # noqa: E402

MODES = ("fp32", "e4m3", "i32split", "i32asm", "i32asm_late", "i32cvt", "i32cvt_late", "i32cvt_copy", "i32cvt_x2",
         "regs")


@gluon.constexpr_function
def _mma_layout(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


# ---------------------------------------------------------------------------------------------- P forms
@gluon.jit
def _relabel(p):
    """S accumulator layout -> the A operand's element order (the kernel's K_PERM relabel, layout change only)."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    q = gl.reshape(p, [M, N // 16, 2, 4, 2])
    q = gl.permute(q, (0, 1, 3, 2, 4))
    return gl.reshape(q, [M, N])


@gluon.jit
def _pack_split(p8):
    """e4m3 [M, N] (A-operand layout) -> int32 [M, N/4]: byte k of word g is key 4g + k.  Pure Gluon."""
    M: gl.constexpr = p8.shape[0]
    N: gl.constexpr = p8.shape[1]
    b = gl.reshape(p8.to(gl.uint8, bitcast=True), [M, N // 4, 2, 2])
    b01, b23 = gl.split(b)  # [M, N/4, 2] each: keys (0, 1) and (2, 3) of the word
    b0, b1 = gl.split(b01)
    b2, b3 = gl.split(b23)
    w = b0.to(gl.uint32) | (b1.to(gl.uint32) << 8) | (b2.to(gl.uint32) << 16) | (b3.to(gl.uint32) << 24)
    return w.to(gl.int32, bitcast=True)


@gluon.jit
def _unpack_split(w, p_layout: gl.constexpr):
    M: gl.constexpr = w.shape[0]
    N: gl.constexpr = w.shape[1] * 4
    u = w.to(gl.uint32, bitcast=True)
    b0 = u.to(gl.uint8)
    b1 = (u >> 8).to(gl.uint8)
    b2 = (u >> 16).to(gl.uint8)
    b3 = (u >> 24).to(gl.uint8)
    b = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [M, N/4, 2, 2]
    p8 = gl.reshape(b, [M, N]).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(p8, p_layout, assert_trivial=True)


@gluon.jit
def _make_carry(p, p_layout: gl.constexpr, MODE: gl.constexpr):
    """p (fp32, S accumulator layout) -> the loop-carried form of MODE."""
    if MODE == "fp32":
        return p
    elif MODE == "e4m3":
        return gl.convert_layout(_relabel(p).to(gl.float8e4nv), p_layout, assert_trivial=True)
    elif MODE == "i32split":
        return _pack_split(gl.convert_layout(_relabel(p).to(gl.float8e4nv), p_layout, assert_trivial=True))
    elif MODE == "i32asm":
        return _pack_asm(gl.convert_layout(_relabel(p).to(gl.float8e4nv), p_layout, assert_trivial=True))
    else:  # i32cvt
        return _pack_cvt(gl.convert_layout(_relabel(p), p_layout, assert_trivial=True))


@gluon.jit
def _operand(c, p_layout: gl.constexpr, MODE: gl.constexpr):
    """The loop-carried form -> e4m3 A operand of P V."""
    if MODE == "fp32":
        return gl.convert_layout(_relabel(c).to(gl.float8e4nv), p_layout, assert_trivial=True)
    elif MODE == "e4m3":
        return c
    elif MODE == "i32split":
        return _unpack_split(c, p_layout)
    else:  # i32asm, i32cvt
        return _unpack_asm(c, p_layout)


# ---------------------------------------------------------------------------------------------- the kernel
@gluon.jit
def _load_smem(ptr, S: gl.constexpr, R: gl.constexpr, C: gl.constexpr):
    """S tiles [R, C] e4m3 from global (tile-major) into an NVMMA-swizzled shared buffer [S, R, C]."""
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, blk))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, blk))
    smem = gl.allocate_shared_memory(gl.float8e4nv, [S, R, C],
                                     gl.NVMMASharedLayout.get_default_for([R, C], gl.float8e4nv))
    for i in gl.static_range(S):
        smem.index(i).store(gl.load(ptr + i * R * C + gl.expand_dims(r, 1) * C + gl.expand_dims(c, 0)))
    return smem


@gluon.jit
def _step(q_s, k_smem, v_smem, j, acc, l_i, c, s_zero, scale, p_layout: gl.constexpr, o_layout: gl.constexpr,
          MODE: gl.constexpr, PLACE: gl.constexpr):
    """One KV step of the probe: issue S_j, P_{j-1} (carried form c) -> A operand, issue P_{j-1} V_{j-1}, wait S_j,
    stand-in softmax, make the next carried form (PLACE: "early" under the P V product, "late" after its wait,
    "copy" early into fresh registers then copied after the wait), wait P V, rescale O."""
    k_s = k_smem.index(j & 1)
    v_s = v_smem.index((j - 1) & 1)
    qk = warpgroup_mma(q_s, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if MODE == "regs":
        a = c
    else:
        a = _operand(c, p_layout, MODE)
    acc = warpgroup_mma(a, v_s.permute((1, 0)), acc, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
    m = gl.max(qk, 1)
    p = gl.exp2(gl.fma(qk, scale, gl.expand_dims(-m, 1)))
    alpha = gl.exp2(m * 0.5)
    l_i = l_i * alpha + gl.sum(p, 1)
    if MODE == "fp32":
        c = p
    elif MODE != "regs":
        if PLACE != "late":
            c = _make_carry(p, p_layout, MODE)  # pack under the P V product, before its wait
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if MODE != "fp32":
        if MODE != "regs":
            if PLACE == "late":
                c = _make_carry(p, p_layout, MODE)  # pack after P_{j-1} V_{j-1} has read its registers
            elif PLACE == "copy":
                c = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [c], dtype=c.dtype, is_pure=False, pack=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, l_i, c


@gluon.jit
def p8_probe_kernel(Q, K, V, O, L, n_iter, scale,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, MODE: gl.constexpr, PLACE: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    q_s = _load_smem(Q, 1, 64, HEAD_DIM).index(0)
    k_smem = _load_smem(K, 2, BLOCK_N, HEAD_DIM)
    v_smem = _load_smem(V, 2, HEAD_DIM, BLOCK_N)
    fence_async_shared()
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, s_layout))
    qk = warpgroup_mma(q_s, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    p = gl.exp2(gl.fma(qk, scale, -3.0))
    l_i = l_i + gl.sum(p, 1)
    if MODE == "regs":
        c = gl.zeros([64, BLOCK_N], gl.float8e4nv, layout=p_layout)
    else:
        c = _make_carry(p, p_layout, MODE)
    if PLACE == "x2":
        for j in range(1, n_iter, 2):
            acc, l_i, c = _step(q_s, k_smem, v_smem, j, acc, l_i, c, s_zero, scale, p_layout, o_layout, MODE, "early")
            acc, l_i, c = _step(q_s, k_smem, v_smem, j + 1, acc, l_i, c, s_zero, scale, p_layout, o_layout, MODE,
                                "early")
    else:
        for j in range(1, n_iter):
            acc, l_i, c = _step(q_s, k_smem, v_smem, j, acc, l_i, c, s_zero, scale, p_layout, o_layout, MODE, PLACE)
    a = _operand(c, p_layout, MODE) if MODE != "regs" else c
    acc = warpgroup_mma(a, v_smem.index(1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0), acc)
    gl.store(L + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), l_i)


def build(mode: str, block_n: int, head_dim: int = 128, maxnreg: int = 240):
    """mode: one of MODES, optionally with a suffix "_late", "_copy" or "_x2" (where P_j is packed: _step; x2: the
    loop unrolled by two, early packs, so that consecutive P live in distinct SSA values)."""
    mode, _, place = mode.partition("_")
    place = place or "early"
    ptrs = {n: "*fp8e4nv" for n in ("Q", "K", "V")} | {"O": "*fp32", "L": "*fp32"}
    return compile_sm90(p8_probe_kernel, dict(BLOCK_N=block_n, HEAD_DIM=head_dim, MODE=mode, PLACE=place), {}, ptrs,
                        ("scale",), 4, maxnreg)


CONV_OPS = ("F2FP", "PRMT", "LOP3", "SHF", "IMAD", "MOV", "SEL", "BFE", "I2F", "SHFL")


def report(k, name: str, dump: str | None = None) -> dict:
    usage = _resource_usage(k.asm["cubin"])
    ptxas = _ptxas_verbose(k.asm["ptx"])
    spills = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas))
    serial = sorted(set(re.findall(r"C75\d\d", ptxas)))
    loops = sass_loops(usage["sass"], lambda texts: any("GMMA" in x and "DEPBAR" not in x for x in texts),
                       r"GMMA\S*\s+R\d+,\s*R\d+,")
    row = {"name": name, "regs": usage["regs"], "spill_bytes": spills, "serial": ",".join(serial) or "-"}
    if loops:
        lp = max(loops, key=lambda x: x["instrs"])
        c = lp["counts"]
        row |= {"loop_instrs": lp["instrs"], "gmma": lp["gmma"], "depbar": lp["depbar"]}
        row |= {op: c[op] for op in CONV_OPS}
    else:
        row |= {"loop_instrs": None}
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", k.asm["ttgir"]), ("llir", k.asm["llir"]), ("ptx", k.asm["ptx"]),
                          ("sass", usage["sass"]), ("ptxas.txt", ptxas)):
            with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                f.write(text)
    return row


def print_table(rows):
    cols = ["name", "regs", "spill_bytes", "serial", "loop_instrs", "gmma", "depbar", *CONV_OPS]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(MODES))
    ap.add_argument("--n", default="128,256", help="BLOCK_N values (powers of 2: Gluon tensors)")
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--maxnreg", type=int, default=240)
    ap.add_argument("--dump")
    args = ap.parse_args(argv)
    rows = []
    for n in map(int, args.n.split(",")):
        for mode in args.only.split(","):
            name = f"{mode}_n{n}_d{args.d}"
            try:
                rows.append(report(build(mode, n, args.d, args.maxnreg), name, args.dump))
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()
                print(f"{name}: COMPILE ERROR {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}")
                rows.append({"name": name, "regs": "ERR"})
    print_table(rows)
    return 0




# ---------------------------------------------------------------------------------------------- the real forward
def real(carries, block_ns, head_dim: int, causal: bool, k_perm: bool, consumer_regs: int | None, dump):
    """Build the forward (mxattn/kernels/attn_fwd_gluon.py, P_CARRY = each of ``carries``) with the compile check's
    rules (scripts/compile_check_gluon.py ``check``), and print the common step's opcode counts."""
    import collections
    import dataclasses

    from mxattn.kernels import attn_fwd_gluon as m
    from scripts.compile_check_gluon import _opcode, _resource_usage, check, compile_variant, step_path  # noqa
    from scripts.compile_check_gluon import _sass_instrs, steady_loops

    orig = m.default_config
    if consumer_regs:
        m.default_config = lambda d, c: dataclasses.replace(orig(d, c), consumer_regs=consumer_regs)
    try:
        for n in block_ns:
            for pc in carries:
                name = (f"fwd_{pc}_n{n}_d{head_dim}{'_causal' if causal else ''}{'' if k_perm else '_k2d'}"
                        f"{f'_r{consumer_regs}' if consumer_regs else ''}")
                try:
                    k = compile_variant(head_dim, causal, False, block_n=n, k_perm=k_perm, p_carry=pc)
                except Exception as e:  # noqa: BLE001
                    print(f"== {name}: COMPILE ERROR {str(e).strip().splitlines()[-1][:300]}")
                    continue
                check(k, name, dump)
                sass = _resource_usage(k.asm["cubin"])["sass"]
                for lp in steady_loops(sass)[:1]:
                    ins = _sass_instrs(sass)
                    pos = {a: i for i, (a, _) in enumerate(ins)}
                    st = step_path(sass, lp)
                    # the step path's opcode mix (same rule as step_path: rare forward-branch regions skipped)
                    lo, hi = pos[int(lp["start"], 16)], pos[lp["end"]]
                    skip = set()
                    for i in range(lo, hi + 1):
                        a, t = ins[i]
                        mm = re.search(r"BRA[^0-9]*(0x[0-9a-f]+)", t)
                        if _opcode(t) != "BRA" or not re.match(r"^@!?U?P", t) or not mm:
                            continue
                        tgt = int(mm.group(1), 16)
                        if tgt <= a or tgt not in pos or pos[tgt] > hi + 1:
                            continue
                        region = range(i + 1, pos[tgt])
                        if not any("SYNCS.ARRIVE" in ins[j][1] for j in region):
                            skip.update(region)
                    c = collections.Counter(_opcode(ins[i][1]) for i in range(lo, hi + 1) if i not in skip)
                    print(f"   step path {st['instrs']} instrs: " + ", ".join(
                        f"{op} {c[op]}" for op in ("F2FP", "PRMT", "LOP3", "SEL", "SHFL", "LDL", "STL")))
    finally:
        m.default_config = orig


def main_real(argv) -> int:
    ap = argparse.ArgumentParser(description="build the real forward with P_CARRY variants")
    ap.add_argument("--carry", default="fp32,i32,i32early,i32copy,i32xor,i32br")
    ap.add_argument("--n", default="128")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--k2d", action="store_true", help="K not key-permuted (P conversion with shuffles)")
    ap.add_argument("--regs", type=int, help="consumer registers (setmaxnreg; default 240)")
    ap.add_argument("--dump")
    a = ap.parse_args(argv)
    real(a.carry.split(","), [int(x) for x in a.n.split(",")], a.d, a.causal, not a.k2d, a.regs, a.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main_real(sys.argv[2:]) if sys.argv[1:2] == ["real"] else main())
