"""Which (block, batch * head) a CTA of a causal grid computes: one function for the host, ``tl`` and Gluon.

A grid (blocks, B * H) hands its CTAs out in launch order (program_id(1) * blocks + program_id(0)) as SMs come free.
Head by head, the heaviest block of each head comes first only within its head, so the last heads' heavy blocks
start when most SMs are idle: a list-scheduling model puts the longest SM at 1.13x the mean at B2 H16 S 4k (32
blocks, 132 SMs), 1.06x at S 8k.  With ``section`` > 0 the CTAs walk sections of g = cdiv(section, blocks) heads
(the remainder heads join the last section) and, inside a section, rank by rank: rank 0, the heaviest block, of
every head of the section first.  The launchers pass two waves (2 x the SM count): the model then stays within
1-2 % of heaviest-first over all heads, while the heads in flight stay few (their operands shared through L2;
rank-major order over all 32 heads measured 11 % slower in the forward at S 8k).  docs/perf-notes-attn-bwd.md,
session 24.

``cta_order`` uses operators only, so the same source runs on Python ints (``causal_cta_order``, the tests' twin),
as ``cta_order_tl`` in the ``tl`` kernels and as ``attn_fwd_gluon._cta_order`` in the Gluon ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["cta_order", "cta_order_tl", "causal_cta_order"]


def cta_order(pid0, pid1, nb, n_bh, LPT_SECTION: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(block, batch * head) of CTA (pid0, pid1) in a grid (nb, n_bh): head by head when LPT_SECTION is 0, else by
    sections of heads (module docstring); HEAVY_LAST: the heaviest block is the last one (causal query blocks)
    rather than the first (causal key blocks).  A permutation of the grid."""
    if LPT_SECTION > 0:
        g = (LPT_SECTION + nb - 1) // nb  # heads per section
        full = n_bh // g
        last = full - 1 + (full < 1)  # the last section (max(full, 1) - 1), which takes the remainder heads
        lin = pid1 * nb + pid0
        sec = lin // (g * nb)
        sec = sec + (last - sec) * (sec > last)  # min(sec, last)
        first = sec * g
        width = g + (sec == last) * (n_bh - first - g)
        within = lin - first * nb
        rank = within // width
        bh = first + within - rank * width
    else:
        rank = pid0
        bh = pid1
    if HEAVY_LAST:
        rank = nb - 1 - rank
    return rank, bh


cta_order_tl = triton.jit(cta_order)


def causal_cta_order(n_blocks: int, n_bh: int, section: int, heavy_last: bool) -> list[tuple[int, int]]:
    """The (block, batch * head) of each CTA in launch order (``cta_order`` on the host)."""
    return [cta_order(p0, p1, n_blocks, n_bh, section, heavy_last) for p1 in range(n_bh) for p0 in range(n_blocks)]
