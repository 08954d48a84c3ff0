"""Triton kernels (Hopper FP8 path and Blackwell block-scaled path), one op family per file."""

# Triton versions on which the Gluon kernels (attn_fwd_gluon, attn_bwd_dq_gluon, attn_bwd_dkdv_gluon) ran their GPU
# tests.  Gluon is experimental and its API moves between releases, so the automatic kernel choice takes them only
# there; MXATTN_FWD_KERNEL=gluon / MXATTN_BWD_KERNEL=gluon still ask for them on any version.
GLUON_VERIFIED_TRITON = ("3.6.",)


def gluon_verified() -> bool:
    """True when the installed Triton is one the Gluon kernels were verified on (``GLUON_VERIFIED_TRITON``)."""
    import triton

    return triton.__version__.startswith(GLUON_VERIFIED_TRITON)
