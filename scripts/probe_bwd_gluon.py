"""Cost split of the Gluon dK/dV kernel's step (timing only; the probe builds give wrong gradients).

    MXATTN_DKDV_PROBE=<0..2> [MXATTN_BWD_OUT_ROWS=1] PYTHONPATH=. python3 scripts/probe_bwd_gluon.py \
        [--compile-only] OUT.jsonl

Probe (attn_bwd_dkdv_gluon.DKDV_PROBE): 0 the real kernel, 1 no exp2 on the unmasked tiles, 2 no dS exponent
(the keys' exponents stay: no amax, no dK row rescale).  The API's default dK/dV config per head dim (split;
64-query steps at d128, 128-query steps at d64).  Appends one JSON line per shape with the kernel's ms; probe 0
also times the dK/dV kernel with 2-D Q / dO_hdim boxes (``q_perm=False``, ``dkdv_2d_ms``), the default dQ
kernel on the same operands, and the dQ kernel with 2-D K / V_hdim boxes (``k_perm=False``, ``dq_2d_ms``);
MXATTN_PROBE_PERSISTENT=1 adds the persistent dK/dV kernel (``dkdv_persistent_ms``).  MXATTN_BWD_OUT_ROWS=1: the row-wise epilogue stores of
both kernels (``attn_bwd_dq_gluon.OUT_ROWS``), recorded as ``out_rows``."""
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused_dq import _ms, prepared_operands  # noqa: E402

SHAPES = ((2, 16, 8192, 128, False), (2, 16, 8192, 128, True), (2, 16, 4096, 128, False), (8, 12, 2048, 64, True))


def _config(cls, **kw):
    """cls(**kw) without the fields this tree's config does not have (an older tree on PYTHONPATH, stage bwdbase:
    its defaults are then what it had)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def main():
    from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, attn_bwd_dkdv_gluon
    from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, attn_bwd_dq_gluon
    import mxattn

    tree = os.path.dirname(os.path.dirname(os.path.abspath(mxattn.__file__)))
    variants = hasattr(GluonDqConfig, "k_perm")  # this tree has the permuted boxes (session 20)

    compile_only = "--compile-only" in sys.argv
    out = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    probe = int(os.environ.get("MXATTN_DKDV_PROBE", "0"))
    shapes = ((1, 2, 512, 128, False), (1, 2, 512, 128, True), (1, 2, 512, 64, True)) if compile_only else SHAPES
    for B, H, S, D, causal in shapes:
        ops, dkdv = prepared_operands(B, H, S, D, causal)
        kc = GluonDkdvConfig(split=True, block_m=128 if D == 64 else 64)
        run = lambda: attn_bwd_dkdv_gluon(**dkdv, causal=causal, config=kc)  # noqa: E731
        if compile_only:
            run()
            torch.cuda.synchronize()
            continue
        row = {"probe": probe, "tree": os.path.basename(tree), "out_rows": os.environ.get("MXATTN_BWD_OUT_ROWS", "auto"),
               "B": B, "H": H, "S": S,
               "D": D, "causal": causal, "dkdv_ms": _ms(run)}
        flops = 4 * 4 * B * H * S * S * D * (0.5 if causal else 1.0) / 2  # four products of 2 B H S^2 D
        row["dkdv_tflops"] = flops / row["dkdv_ms"] / 1e9
        if probe == 0 and variants:
            # the dK/dV kernel with 2-D Q / dO_hdim boxes (q_perm=False: the default before session 20)
            kc2 = _config(GluonDkdvConfig, split=True, block_m=128 if D == 64 else 64, q_perm=False)
            row["dkdv_2d_ms"] = _ms(lambda: attn_bwd_dkdv_gluon(**dkdv, causal=causal, config=kc2))
        if probe == 0 and os.environ.get("MXATTN_PROBE_PERSISTENT") == "1":
            # the persistent dK/dV kernel (GluonDkdvConfig.persistent, opt-in since session 20)
            kcp = _config(GluonDkdvConfig, split=True, block_m=128 if D == 64 else 64, persistent=True)
            row["dkdv_persistent_ms"] = _ms(lambda: attn_bwd_dkdv_gluon(**dkdv, causal=causal, config=kcp))
        if probe == 0:
            # the default dQ kernel (key-permuted K / V_hdim since session 20), then the 2-D boxes (dq_2d_ms)
            for name, perm in (("dq_ms", True), ("dq_2d_ms", False))[:2 if variants else 1]:
                qc = _config(GluonDqConfig, split=True, block_n=128 if D == 64 else 64, k_perm=perm)
                row[name] = _ms(lambda: attn_bwd_dq_gluon(ops["q"], ops["k"], ops["v_hdim"], ops["k_seq"],
                                                          ops["dout_hdim"], ops["lse"], ops["delta"], causal=causal,
                                                          config=qc))
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
