"""mxattn: end-to-end MXFP8 attention for PyTorch (fast on Hopper, with a Blackwell path)."""

from mxattn._version import __version__
from mxattn.formats import (
    MXTensor,
    RowScaledFP8,
    ScaleMode,
    dequantize_mxfp8,
    quantize_mxfp8,
    row_scaled_from_float,
    to_row_scaled,
)
from mxattn.interface import MXKVGrads, mxfp8_attn_func, mxfp8_attn_varlen_func
from mxattn.producers import linear_quant, rmsnorm_quant
from mxattn.qkv import qkv_proj

__all__ = [
    "__version__",
    "MXKVGrads",
    "MXTensor",
    "RowScaledFP8",
    "ScaleMode",
    "dequantize_mxfp8",
    "mxfp8_attn_func",
    "mxfp8_attn_varlen_func",
    "rmsnorm_quant",
    "linear_quant",
    "qkv_proj",
    "quantize_mxfp8",
    "row_scaled_from_float",
    "to_row_scaled",
]
