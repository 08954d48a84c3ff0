"""Time the Gluon backward kernels (dQ, dK/dV and their variants) against their `tl` twins on the same operands.

    PYTHONPATH=. python3 scripts/bench_bwd_gluon_kernels.py OUTDIR [VARIANT ...]

One JSON (`attn_bwd_kernels-*.json`) under OUTDIR; each row names its kernel variant.  dK/dV rows also name their
dS exponent rule (`ds_exp`: "key", one per key and query tile, the default since session 8; "tile", one per keys x 64
queries tile, the rule before it: the `*_dstile` rows), and each is timed against its own tl twin
(`tl_twin_config`), so compare the two rules by `gluon_ms`, not by the ratio to tl.  The `*_d64` rows (B2 H16 S8k
d64, session 9) time the split dK/dV kernel with its default 64-query step and with the 128-query step
(`GluonDkdvConfig(block_m=128)`, `block_m` in each dK/dV row): compare those two by `gluon_ms` too.  VARIANT names
(e.g. `dkdv_split_d64 dkdv_split_d64_bm128`) time only those rows.
"""
import sys

from mxattn.bench.results import write_result
from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, bench_attn_bwd_dkdv_gluon
from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, bench_attn_bwd_dq_gluon


D64 = ((2, 16, 16, 8192, 64, False), (2, 16, 16, 8192, 64, True))


def main(outdir: str, only=()) -> None:
    variants = [
        ("dq", bench_attn_bwd_dq_gluon, None, {}),
        ("dkdv", bench_attn_bwd_dkdv_gluon, None, {}),
        ("dkdv_nodefer", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(defer_dk=False), {}),
        ("dkdv_split", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(split=True), {"tl": "64-key blocks"}),
        ("dkdv_split_dstile", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(split=True, ds_exp="tile"),
         {"tl": "64-key blocks"}),
        ("dkdv_dstile", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(ds_exp="tile"), {}),
        ("dkdv_stages3", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(stages=3), {}),
        ("dq_stages2", bench_attn_bwd_dq_gluon, GluonDqConfig(stages=2), {}),
        ("dq_split", bench_attn_bwd_dq_gluon, GluonDqConfig(split=True), {"tl": "64-row blocks"}),
    ]
    # dQ at d64, 64- vs 128-key step side by side (session 9, branch s9-bwd-d64-dq), split (the API's build); each
    # against its own tl twin (tl_twin_config: dq_block_n = block_n), so compare the two by gluon_ms.  Timed first
    # (rows print as they come), so that a call cut by its time limit still has them
    dq_d64 = lambda **kw: bench_attn_bwd_dq_gluon(  # noqa: E731
        shapes=((2, 16, 16, 8192, 64, False), (2, 16, 16, 8192, 64, True)), **kw)
    # the d64 dK/dV rows (64- vs 128-query step) first too, for the same reason
    variants[:0] = [
        ("dq_split_d64", dq_d64, GluonDqConfig(split=True), {"tl": "64-row blocks", "block_n": 64}),
        ("dq_split_d64_bn128", dq_d64, GluonDqConfig(split=True, block_n=128),
         {"tl": "64-row blocks, 128 keys", "block_n": 128}),
        ("dkdv_split_d64", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(split=True), {"tl": "64-key blocks"}, D64),
        ("dkdv_split_d64_bm128", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(split=True, block_m=128),
         {"tl": "64-key blocks, 128-query steps"}, D64),
    ]
    rows = []
    for name, bench, cfg, extra, *shapes in variants:
        if only and name not in only:
            continue
        kw = ({} if cfg is None else {"config": cfg}) | ({"shapes": shapes[0]} if shapes else {})
        if bench is bench_attn_bwd_dkdv_gluon:
            c = cfg or GluonDkdvConfig()
            extra = dict(extra, ds_exp=c.ds_exp, block_m=c.block_m)
        for r in bench(**kw):
            row = dict(r, kernel=name, **extra)
            print(row, flush=True)
            rows.append(row)
    print(write_result("attn_bwd_kernels", rows, outdir, extra={"note": "Gluon backward kernels vs their tl twins"}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
