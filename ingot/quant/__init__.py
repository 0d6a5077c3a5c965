"""Quantized weight formats and quantizers."""
from .formats import QuantizedTensor  # noqa: F401
