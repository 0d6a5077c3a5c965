"""One converter per ONNX op: (Context, OnnxNode) -> the node's outputs as Ingot tensors.

The table (CONVERTERS) and the helpers every converter uses live here; the converters themselves
are grouped by family in onnx_math, onnx_shape, onnx_nn, onnx_signal, onnx_quant and onnx_attention.

A converter builds plain Ingot ops with the builder API. Operands that ONNX passes as tensors but
that Ingot needs as attributes (shapes, axes, slice bounds, pads) are read with `ctx.constant`,
which works because every input shape is fixed at import and shape arithmetic is computed as the
graph is built. What a converter cannot express raises `ctx.fail(node, why)` (UnsupportedOnnx).
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..graph import Tensor
from .onnx import ONNX_DTYPES, ONNX_TYPE_NAMES, Context, Converter, OnnxNode

CONVERTERS: dict[tuple[str, str], Converter] = {}


def converter(*op_types: str, domain: str = ""):
    def deco(fn: Converter) -> Converter:
        for op in op_types:
            CONVERTERS[(domain, op)] = fn
        return fn
    return deco


def scalar(ctx: Context, value, like: Tensor) -> Tensor:
    return ctx.g.constant(np.asarray(value, like.dtype.numpy))


def need_float(ctx: Context, node: OnnxNode, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise ctx.fail(node, f"input of type {x.dtype.name} (Ingot computes this op on floats)")


def attr_or_input(ctx: Context, node: OnnxNode, name: str, index: int, default=None):
    """An operand that older opsets give as an attribute and newer ones as an (optional) input."""
    if name in node.attrs:
        return node.attrs[name]
    if node.input(index) is not None:
        return ctx.constant(node, index, name).tolist()
    return default


def onnx_to_ingot_dtype(ctx: Context, node: OnnxNode, elem_type: int) -> dt.DType:
    if elem_type not in ONNX_DTYPES:
        raise ctx.fail(node, f"type {ONNX_TYPE_NAMES.get(elem_type, elem_type)} is not one Ingot computes")
    return ONNX_DTYPES[elem_type][0]


def ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


from . import onnx_attention, onnx_math, onnx_nn, onnx_quant, onnx_shape, onnx_signal  # noqa: E402,F401  (registration)
