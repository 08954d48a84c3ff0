"""GPU probe for the fused K+V quantize (row_scaled_triton_both): which V bytes differ, and whether the launched
kernels carry the ptxas 12.x F2FP-fold hazard (docs/quantize-both-byte3.md).

    PYTHONPATH=. python3 scripts/qboth_byte3_probe.py [--soft] [--shape 2,1000,4,128]

Prints: toolchain versions; K and V of row_scaled_triton_both against the single-role launches
(row_scaled_triton(x, "k") / (x, "v")) and against the CPU reference (mxattn.formats); differing V bytes grouped
by (token % 4, want, got) and by channel; then, per compiled _quantize_kernel variant in Triton's JIT cache,
never-written PTX registers, PTX fold hazards and SASS F2FP.MERGE_C whose C comes from a register that holds no
conversion.  Exit status 1 when a V or K byte differs.
"""
import argparse
import collections
import re
import subprocess
import sys

import torch
import triton

import mxattn.formats as F
import mxattn.kernels.quantize as kq


def make_input(shape, seed=0):
    """Adversarial-ish bf16: wide magnitudes, zero rows, -0, tiny rows, outlier channels, a few NaN/Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())
    D = shape[-1]
    flat = x.view(-1, D)
    n = flat.shape[0]

    def pick(k):
        return torch.randint(0, n, (k,), generator=g)
    flat[pick(n // 8)] = 0.0
    flat[pick(n // 8), : min(32, D)] = -0.0
    flat[pick(n // 8)] *= 2.0 ** -120
    flat[:, torch.randint(0, D, (max(1, D // 16),), generator=g)] *= 1024.0
    x = flat.view(shape).to(torch.bfloat16)
    xf = x.view(-1)
    pos = torch.randint(0, xf.numel(), (max(1, xf.numel() // 2000),), generator=g)
    xf[pos] = torch.tensor([0x7FC0, 0x7F80, 0xFF80 - 2 ** 16], dtype=torch.int16).view(torch.bfloat16)[pos % 3]
    return x


def u8(rs):
    return rs.data.view(torch.uint8).cpu()


def ptx_findings(ptx):
    """(never-written registers read, cvt e4m3x2 results packed as a mov.b32 low half and also read elsewhere)."""
    body = ptx[ptx.index(".entry"):]
    code = "\n".join(l.split("//")[0] for l in body.split("\n") if not l.strip().startswith(".reg"))
    written, read = set(), set()
    for line in code.split("\n"):
        s = re.sub(r"^\s*@!?%p\d+\s+", "", line.strip()).rstrip(";")
        parts = s.split(None, 1)
        if len(parts) < 2 or parts[0].endswith(":"):
            continue
        op, rest = parts
        depth, cut = 0, len(rest)
        for i, c in enumerate(rest):  # first top-level comma ends the destination operand
            depth += (c in "{[") - (c in "}]")
            if c == "," and depth == 0:
                cut = i
                break
        dst, src = rest[:cut], rest[cut:]
        if op.startswith(("st.", "red.", "bar", "bra", "ret")) or dst.lstrip().startswith("["):
            src, dst = rest, ""
        written.update(re.findall(r"%[a-z]+\d+", dst))
        read.update(re.findall(r"%[a-z]+\d+", src))
    never = sorted(read - written)
    cvt = set(re.findall(r"cvt\.rn\.satfinite\.(?:relu\.)?e[45]m[23]x2\.f32\s+(%rs\d+)", code))
    hazards = [m.group(0) for m in re.finditer(r"mov\.b32\s+%r\d+,\s*\{(%rs\d+),\s*%rs\d+\}", code)
               if m.group(1) in cvt and len(re.findall(re.escape(m.group(1)) + r"\b", code)) > 2]
    return never, hazards


def sass_phantoms(sass):
    """F2FP...MERGE_C whose C is (R & 0xffff) >> 8 of a register R last written by something other than an F2FP."""
    ins = [re.sub(r"^[-\w:]*\s+", "", l.strip()).rstrip(";") for l in sass.split("\n") if re.search(r"\bR\d+", l)]

    def writer(i, reg):
        for j in range(i - 1, -1, -1):
            m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s+(R\d+)\b", ins[j])
            if m and m.group(2) == reg:
                return j, ins[j]
        return None, ""
    bad = []
    for i, s in enumerate(ins):
        m = re.search(r"F2FP\.\S*MERGE_C R\d+, R\d+, R\d+, (R\d+)", s)
        if not m:
            continue
        j, w = writer(i, m.group(1))
        if j is None or "SHF.R.U32.HI" not in w:
            continue
        j, w = writer(j, m.group(1))
        m2 = re.search(r"LOP3\.LUT R\d+, (R\d+), 0xffff", w)
        if m2 and "F2FP" not in writer(j, m2.group(1))[1]:
            bad.append(s)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,1000,4,128")
    ap.add_argument("--soft", action="store_true", help="SOFT_ROUND_ON_GPU (explicit fp32 rounding)")
    a = ap.parse_args()
    kq.SOFT_ROUND_ON_GPU = a.soft
    shape = tuple(int(v) for v in a.shape.split(","))
    ptxas = triton.knobs.nvidia.ptxas.path
    print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__} "
          f"gpu {torch.cuda.get_device_name()} ptxas {ptxas}")
    print("  " + subprocess.run([ptxas, "--version"], check=False, capture_output=True, text=True).stdout.strip().split("\n")[-1])
    x = make_input(shape)
    sd = 0 if len(shape) == 3 else 1
    hd, vs = kq.row_scaled_triton_both(x.cuda(), seq_dim=sd)
    k1, v1 = kq.row_scaled_triton(x.cuda(), "k", seq_dim=sd), kq.row_scaled_triton(x.cuda(), "v", seq_dim=sd)
    torch.cuda.synchronize()
    vref = F.to_row_scaled(F.quantize_mxfp8(x, sd))
    failed = False
    for name, got, want in (("K both vs single", u8(hd), u8(k1)), ("V single vs CPU", u8(v1), u8(vref)),
                            ("V both vs CPU", u8(vs), u8(vref)), ("V both vs single", u8(vs), u8(v1))):
        nd = int((got != want).sum())
        print(f"{name:18s}: {nd} of {got.numel()} bytes differ ({100.0 * nd / got.numel():.2f} %)")
        failed |= nd > 0
    print(f"V exponents both == single: {bool(torch.equal(vs.exp.cpu(), v1.exp.cpu()))}")
    got, want = u8(vs), u8(vref)
    idx = (got != want).nonzero()
    if len(idx):
        g4 = got.unsqueeze(0) if len(shape) == 3 else got
        w4 = want.unsqueeze(0) if len(shape) == 3 else want
        ix = idx if len(shape) == 4 else torch.cat([torch.zeros_like(idx[:, :1]), idx], 1)
        gv, wv = g4[tuple(ix.T)].tolist(), w4[tuple(ix.T)].tolist()
        s, d = ix[:, 1].tolist(), ix[:, 3].tolist()
        print(f"first differing [b, s, h, d] = {ix[0].tolist()}")
        print("count  s%4  want  got")
        for (k, w_, g_), c in collections.Counter(zip([v % 4 for v in s], wv, gv)).most_common(25):
            print(f"{c:5d}  {k:3d}   0x{w_:02x}  0x{g_:02x}")
        print("by s%4:", dict(sorted(collections.Counter(v % 4 for v in s).items())))
        print("by d%16:", dict(sorted(collections.Counter(v % 16 for v in d).items())))
        print("by d:", dict(sorted(collections.Counter(d).items())))
    dev = torch.cuda.current_device()
    for ck in kq._quantize_kernel.device_caches[dev][0].values():
        ck = ck.result() if hasattr(ck, "result") else ck
        cst = {k[0] if isinstance(k, tuple) else k: v for k, v in getattr(ck.src, "constants", {}).items()}
        names = kq._quantize_kernel.arg_names
        tag = {names[i]: v for i, v in cst.items() if isinstance(i, int) and names[i] in
               ("D", "BLOCK_S", "HDIM", "SEQ", "HDIM_GROUP", "SEQ_RS", "SOFT")}
        never, hz = ptx_findings(ck.asm["ptx"])
        try:
            ph = sass_phantoms(ck.asm["sass"])
        except Exception as exc:  # noqa: BLE001  (no cuobjdump on the machine)
            ph = [f"(sass unavailable: {exc})"]
        print(f"kernel {tag} warps {ck.metadata.num_warps}: never-written regs {len(never)} {never[:8]}; "
              f"fold hazards {len(hz)}; SASS phantom MERGE_C {len(ph)}")
        for s in hz[:5] + ph[:5]:
            print("    " + s)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
