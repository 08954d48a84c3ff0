"""Time the Gluon backward kernels (dQ, dK/dV and their variants) against their `tl` twins on the same operands.

    PYTHONPATH=. python3 scripts/bench_bwd_gluon_kernels.py OUTDIR

One JSON (`attn_bwd_kernels-*.json`) under OUTDIR; each row names its kernel variant.  dK/dV rows also name their
dS exponent rule (`ds_exp`: "key", one per key and query tile, the default since session 8; "tile", one per keys x 64
queries tile, the rule before it: the `*_dstile` rows), and each is timed against its own tl twin
(`tl_twin_config`), so compare the two rules by `gluon_ms`, not by the ratio to tl.
"""
import sys

from mxattn.bench.results import write_result
from mxattn.kernels.attn_bwd_dkdv_gluon import GluonDkdvConfig, bench_attn_bwd_dkdv_gluon
from mxattn.kernels.attn_bwd_dq_gluon import GluonDqConfig, bench_attn_bwd_dq_gluon


def main(outdir: str) -> None:
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
    rows = []
    for name, bench, cfg, extra in variants:
        kw = {} if cfg is None else {"config": cfg}
        if bench is bench_attn_bwd_dkdv_gluon:
            extra = dict(extra, ds_exp=(cfg or GluonDkdvConfig()).ds_exp)
        for r in bench(**kw):
            row = dict(r, kernel=name, **extra)
            print(row, flush=True)
            rows.append(row)
    print(write_result("attn_bwd_kernels", rows, outdir, extra={"note": "Gluon backward kernels vs their tl twins"}))


if __name__ == "__main__":
    main(sys.argv[1])
