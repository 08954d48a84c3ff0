"""Triton kernels (Hopper FP8 path and Blackwell block-scaled path), one op family per file."""
