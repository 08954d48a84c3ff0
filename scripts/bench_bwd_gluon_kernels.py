"""Time the Gluon backward kernels (dQ, dK/dV and their variants) against their `tl` twins on the same operands.

    PYTHONPATH=. python3 scripts/bench_bwd_gluon_kernels.py OUTDIR

One JSON (`attn_bwd_kernels-*.json`) under OUTDIR; each row names its kernel variant.
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
        ("dkdv_stages3", bench_attn_bwd_dkdv_gluon, GluonDkdvConfig(stages=3), {}),
        ("dq_stages2", bench_attn_bwd_dq_gluon, GluonDqConfig(stages=2), {}),
        ("dq_split", bench_attn_bwd_dq_gluon, GluonDqConfig(split=True), {"tl": "64-row blocks"}),
    ]
    rows = []
    for name, bench, cfg, extra in variants:
        kw = {} if cfg is None else {"config": cfg}
        for r in bench(**kw):
            row = dict(r, kernel=name, **extra)
            print(row, flush=True)
            rows.append(row)
    print(write_result("attn_bwd_kernels", rows, outdir, extra={"note": "Gluon backward kernels vs their tl twins"}))


if __name__ == "__main__":
    main(sys.argv[1])
