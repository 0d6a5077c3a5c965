"""Quantized weight formats and quantizers."""
from .formats import QuantizedTensor  # noqa: F401
from .quantize import Format, parse_format, quantize  # noqa: F401
