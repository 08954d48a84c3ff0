"""Which launch of the Gluon jagged backward faults, and how: one subprocess per variant, CUDA_LAUNCH_BLOCKING=1.

    DIAG_LQ=4095,1,129 DIAG_LK=4095,7,129 DIAG_H=8,2 DIAG_D=128 DIAG_CAUSAL=0 \\
    PYTHONPATH=. python scripts/diag_varlen_bwd_gluon.py [--sanitize] [--noblock]

Each variant runs the jagged forward, the padded preprocess, then one launcher (dK/dV whole / split, dS rule key /
tile; dQ whole / split) on a small jagged batch, synchronizing after every step, and prints the step that failed
with its error.  ``--sanitize`` reruns the first failing variant under compute-sanitizer (memcheck) so its report
names the kernel and the faulting instruction.
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["public", "tiles", "dkdv:split:key", "dkdv:split:tile", "dkdv:whole:key", "dkdv:whole:tile", "dq:split", "dq:whole"]


def _packed(lens, heads, dim, seed, spread=0.0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(lens), heads, dim, generator=g, device="cuda")
    if spread:
        x = x * torch.exp2(spread * torch.rand(sum(lens), 1, 1, generator=g, device="cuda"))
    return x.to(torch.bfloat16)


def one(variant: str) -> None:
    lq = [int(x) for x in os.environ.get("DIAG_LQ", "1000,129").split(",")]
    lk = [int(x) for x in os.environ.get("DIAG_LK", ",".join(map(str, lq))).split(",")]
    Hq, Hkv = (int(x) for x in os.environ.get("DIAG_H", "2,1").split(","))
    D, causal = int(os.environ.get("DIAG_D", "128")), os.environ.get("DIAG_CAUSAL", "0") == "1"
    import torch

    from mxattn.kernels import varlen as V
    from mxattn.kernels.attn_bwd import attn_bwd_preprocess_varlen
    from mxattn.kernels.attn_bwd_dkdv_gluon import (
        GluonDkdvConfig,
        attn_bwd_dkdv_gluon_varlen,
    )
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon_varlen
    from mxattn.kernels.attn_fwd import attn_fwd_hopper_varlen

    step = "operands"
    try:
        q, k, v, do = (_packed(ls, h, D, 7 + i, spread=2 * (i > 0))
                       for i, (ls, h) in enumerate(((lq, Hq), (lk, Hkv), (lk, Hkv), (lq, Hq))))
        cq, ck = (torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                  for ls in (lq, lk))
        mq, mk = max(lq), max(lk)
        step = "forward"
        out, lse = attn_fwd_hopper_varlen(*V.varlen_operands(q, k, v, cq, ck, mq, mk), causal=causal)
        torch.cuda.synchronize()
        step = "bwd operands"
        ops = V.varlen_bwd_operands(q, k, v, cq, ck, mq, mk)
        qv, kv, v_hdim, q_seq, k_seq = ops
        torch.cuda.synchronize()
        if variant == "public":  # the dispatch the tests call
            from mxattn.kernels.attn_bwd import attn_bwd_hopper_varlen

            os.environ["MXATTN_VARLEN_BWD_KERNEL"] = "gluon"
            step = "attn_bwd_hopper_varlen"
            dq, dk, dv = attn_bwd_hopper_varlen(*ops, out, do, lse, causal=causal)
            torch.cuda.synchronize()
            print(f"OK public: |dq| {dq.float().norm():.4g} |dk| {dk.float().norm():.4g}")
            return
        step = "preprocess"
        doh, dos, delta = attn_bwd_preprocess_varlen(out, do, cq, mq, delta_padded=True)
        torch.cuda.synchronize()
        kind, *rest = variant.split(":")
        if kind == "tiles":  # the dQ launcher's tile table alone
            from mxattn.kernels.bwd_varlen_tiles import bwd_tile_slots

            step = "tile table"
            slots = bwd_tile_slots(qv.cu_seqlens, kv.cu_seqlens, qv.cu_exp, kv.cu_exp, k_seq.cu_data, doh.cu_exp,
                                   dos.cu_data, qv.max_seqlen, key_tiles=False, causal=causal)
            torch.cuda.synchronize()
            print(f"OK {variant}: {tuple(slots.shape)} {slots[:4].tolist()}")
            return
        if kind == "dkdv":
            step = f"dkdv {rest}"
            extra = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in rest[2:]}  # e.g. stages=1 defer_dk=0
            cfg = GluonDkdvConfig(split=rest[0] == "split", ds_exp=rest[1], **extra)
            dk, dv = attn_bwd_dkdv_gluon_varlen(qv, kv, v_hdim, q_seq, doh, dos, lse, delta, causal=causal, config=cfg)
            torch.cuda.synchronize()
            print(f"OK {variant}: |dk| {dk.float().norm():.4g} |dv| {dv.float().norm():.4g}")
        else:
            step = f"dq {rest}"
            dq = attn_bwd_dq_gluon_varlen(qv, kv, v_hdim, k_seq, doh, lse, delta, dos.cu_data, causal=causal,
                                          config=GluonDqConfig(split=rest[0] == "split"))
            torch.cuda.synchronize()
            print(f"OK {variant}: |dq| {dq.float().norm():.4g}")
    except Exception as e:  # noqa: BLE001 -- report the step, then fail
        print(f"FAIL {variant} at {step}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc(limit=-6)
        sys.exit(1)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2])
        return
    variants = [a for a in sys.argv[1:] if not a.startswith("--")] or VARIANTS
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="0" if "--noblock" in sys.argv else "1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    failed = []
    for v in variants:
        r = subprocess.run([sys.executable, __file__, "--one", v], check=False, capture_output=True, text=True, env=env,
                           timeout=240)
        print(f"--- {v}: rc={r.returncode}\n{r.stdout[-1500:]}{r.stderr[-2500:] if r.returncode else ''}", flush=True)
        if r.returncode:
            failed.append(v)
    print("failed:", failed or "none")
    if failed and "--sanitize" in sys.argv:
        r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "8", sys.executable, __file__,
                            "--one", failed[0]], check=False, capture_output=True, text=True, env=env, timeout=300)
        print(f"--- compute-sanitizer memcheck {failed[0]}: rc={r.returncode}")
        print(r.stdout[-8000:], r.stderr[-3000:])


if __name__ == "__main__":
    main()
