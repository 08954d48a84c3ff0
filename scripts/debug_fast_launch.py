"""Which launches differ between the fast launch path and Triton's own (GPU diagnostic for mxattn/kernels/launch.py).

    PYTHONPATH=. python scripts/debug_fast_launch.py

Runs the backward's tl dQ / dK-dV kernels on one case through both paths and prints, per kernel, hits, misses and
whether the outputs agree bit for bit.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")


def main() -> None:
    from test_attn_bwd_dq_gluon import _gpu_inputs, _tl_deterministic_dq

    from mxattn.kernels import attn_bwd_dq_gluon as m
    from mxattn.kernels import launch as L

    case = (2, 113, 203, 4, 4, 128, False)
    q, k, v, dout = _gpu_inputs(case, 1234)

    def both():
        ops, out = m.dq_operands(q, k, v, dout, False)
        a = m._tl_dq(**ops, causal=False)
        b = _tl_deterministic_dq(q, k, v, dout, ops, out, False)
        c = m._tl_dq(**ops, causal=False)
        torch.cuda.synchronize()
        return ops, a, b, c

    runs = {}
    for mode in ("fast", "fast2", "triton"):
        if mode == "triton":
            L._LAUNCHERS.clear()
            L._ENABLED = False
        runs[mode] = both()
        print(mode, "tl_dq == attn_bwd_hopper dq:", torch.equal(runs[mode][1], runs[mode][2]),
              "tl_dq twice equal:", torch.equal(runs[mode][1], runs[mode][3]))
    for name in ("q", "k", "v_hdim", "k_seq", "dout_hdim", "lse", "delta"):
        x, y = runs["fast2"][0][name], runs["triton"][0][name]
        xs = [x.data, x.exp] if hasattr(x, "exp") else [x]
        ys = [y.data, y.exp] if hasattr(y, "exp") else [y]
        print("operand", name, [torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                                            if b.dtype.itemsize == 1 else b) for a, b in zip(xs, ys)])
    for i, what in ((1, "tl_dq"), (2, "attn_bwd_hopper dq"), (3, "tl_dq again")):
        print(what, "fast2 == triton:", torch.equal(runs["fast2"][i], runs["triton"][i]))


if __name__ == "__main__":
    main()
