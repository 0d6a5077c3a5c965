"""ONNX converters for quantization: Quantize/DequantizeLinear (DequantizeLinear -> MatMul becomes
quantized_matmul in the compiler), com.microsoft MatMulNBits, DynamicQuantizeLinear (the integer
ops, MatMulInteger to QLinearConv: onnx_integer.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ir import Op
from ..ops import normalize_axis
from ..ops.elementwise import NARROW_FORMATS
from .onnx_ops import ONNX_DTYPES, Context, OnnxNode, converter, need_float, onnx_to_ingot_dtype, scalar


def _quant_params(ctx: Context, node: OnnxNode, x: Tensor, scale: Tensor):
    axis = node.attr("axis", 1)
    block = node.attr("block_size", 0)
    if scale.ndim == 0 or scale.type.size == 1 and scale.ndim <= 1:
        return None, None
    axis = normalize_axis(node.op_type, axis, x.ndim)
    if block:
        if scale.ndim != x.ndim:
            raise IngotError(f"a blocked scale of rank {scale.ndim} for an input of rank {x.ndim}")
        return None, None  # block-broadcast form already: Ingot takes parameters of the input's rank
    return axis, None


@converter("DequantizeLinear")
def _dequantize_linear(ctx: Context, node: OnnxNode):
    q, scale, zero = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    if q.dtype not in (dt.int8, dt.uint8, dt.int4, dt.uint4) or ctx.narrow_format(q) or ctx.narrow_format(zero):
        # int16/uint16/int32 and the narrow types (float8, float4, int2, ...): (q - zero) * scale in float32
        if not (q.dtype.is_int or q.dtype.is_float) or q.dtype.packed or (zero is not None and zero.dtype.packed):
            raise ctx.fail(node, f"input of type {q.dtype.name}")
        y = g.cast(q, dt.float32) if q.dtype != dt.float32 else q
        if zero is not None:
            y = y - _param(ctx, node, g.cast(zero, dt.float32) if zero.dtype != dt.float32 else zero, q)
        y = y * _param(ctx, node, scale if scale.dtype == dt.float32 else g.cast(scale, dt.float32), q)
        return [y if scale.dtype == dt.float32 else g.cast(y, scale.dtype)]
    if node.attr("output_dtype", 0):
        raise ctx.fail(node, "output_dtype")
    axis, block = _quant_params(ctx, node, q, scale)
    if zero is not None and zero.dtype.packed:
        zv = ctx.value(zero)
        zero = None if zv is None else zero
        if zero is None:
            raise ctx.fail(node, "a 4-bit zero point computed at run time")
    if zero is not None and zero.dtype.packed:
        zero = g.constant(dt.unpack_int4(ctx.g.constants[zero.node.attrs["key"]], zero.shape[-1],
                                         signed=zero.dtype.kind == "i").astype(np.float32))
    if zero is not None and ctx.value(zero) is not None and not np.any(ctx.value(zero)):
        zero = None
    if zero is not None and zero.dtype != scale.dtype:
        zero = g.cast(zero, scale.dtype)
    if scale.ndim == 1 and scale.shape[0] == 1 and q.ndim != 1:
        scale = g.reshape(scale, ())
        zero = None if zero is None else g.reshape(zero, ())
    return [g.dequantize(q, scale=scale, zero_point=zero, axis=axis, dtype=scale.dtype)]


def _param(ctx: Context, node: OnnxNode, p: Tensor, x: Tensor) -> Tensor:
    """A scale or zero point (scalar, per axis, or per block along the axis) broadcast against x."""
    g = ctx.g
    if p.ndim == 0 or p.type.size == 1:
        return g.reshape(p, ())
    axis = normalize_axis(node.op_type, node.attr("axis", 1), x.ndim)
    block = node.attr("block_size", 0)
    if not block:
        return _axis_param(g, p, node, x)
    if p.ndim != x.ndim or x.shape[axis] > p.shape[axis] * block:
        raise IngotError(f"a blocked parameter of shape {list(p.shape)} for an input of shape {list(x.shape)}")
    index = np.minimum(np.arange(x.shape[axis]) // block, p.shape[axis] - 1)
    return g.gather(p, g.constant(index.astype(np.int64)), axis=axis)


def _axis_param(g, p: Tensor, node: OnnxNode, x: Tensor) -> Tensor:
    axis = normalize_axis(node.op_type, node.attr("axis", 1), x.ndim)
    shape = [1] * x.ndim
    shape[axis] = p.shape[0]
    return g.reshape(p, shape)


@converter("QuantizeLinear")
def _quantize_linear(ctx: Context, node: OnnxNode):
    x, scale, zero = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    need_float(ctx, node, x)
    target, declared = dt.uint8, np.dtype(np.uint8)
    if zero is not None:
        target, declared = zero.dtype, ctx.onnx_dtype(zero)
    if node.attr("output_dtype", 0):
        target = onnx_to_ingot_dtype(ctx, node, node.attr("output_dtype"), narrow=True)
        declared = ONNX_DTYPES[node.attr("output_dtype")][1]
    if node.attr("precision", 0):
        raise ctx.fail(node, "precision")
    if target not in (dt.int8, dt.uint8) or declared != target.storage or node.attr("block_size", 0):
        return [ctx.declare(_quantize_generic(ctx, node, x, scale, zero, target, declared), declared)]
    if node.attr("saturate", 1) == 0:
        raise ctx.fail(node, "saturate=0")
    axis, _ = _quant_params(ctx, node, x, scale)
    if scale.dtype != x.dtype:
        scale = g.cast(scale, x.dtype)
    if scale.ndim == 1 and scale.shape[0] == 1 and x.ndim != 1:
        scale = g.reshape(scale, ())
        zero = None if zero is None else g.reshape(zero, ())
    return [g.quantize(x, target, scale=scale, zero_point=zero, axis=axis)]


def _quantize_generic(ctx: Context, node: OnnxNode, x: Tensor, scale: Tensor, zero: Tensor | None, target: dt.DType,
                      declared: np.dtype) -> Tensor:
    """QuantizeLinear to any type, in float32: integers round(x / scale) + zero, saturated to the
    declared type's range; float8 and float4 x / scale + zero, cast to the format (saturating)."""
    g = ctx.g
    xf = x if x.dtype == dt.float32 else g.cast(x, dt.float32)
    y = xf / _param(ctx, node, scale if scale.dtype == dt.float32 else g.cast(scale, dt.float32), x)
    if declared.kind in "iu" or declared.name in ("int4", "uint4", "int2", "uint2"):
        y = g.op(Op.ROUND, [y])
    if zero is not None:
        y = y + _param(ctx, node, zero if zero.dtype == dt.float32 else g.cast(zero, dt.float32), x)
    fmt = declared.name if declared.name in NARROW_FORMATS else None
    if fmt and declared.name.startswith("float"):
        return g.op(Op.NARROW_CAST, [y], {"format": fmt, "saturate": bool(node.attr("saturate", 1))})
    info = ml_dtypes.iinfo(declared)
    y = g.minimum(g.maximum(y, scalar(ctx, info.min, y)), scalar(ctx, info.max, y))
    return g.cast(y, target)


@converter("MatMulNBits", domain="com.microsoft")
def _matmul_nbits(ctx: Context, node: OnnxNode):
    """com.microsoft MatMulNBits: y = x @ W^T with W [N, K] quantized in blocks along K."""
    a, b, scales = node.input(0), node.input(1), node.input(2)
    zero, g_idx, bias = node.input(3), node.input(4), node.input(5)
    g = ctx.g
    bits, block = node.attr("bits", 4), node.attr("block_size")
    k, n = node.attr("K"), node.attr("N")
    if bits not in (4, 8) or g_idx is not None or k % block:
        raise ctx.fail(node, f"bits={bits}, g_idx or K={k} not a multiple of block_size={block} (Ingot takes 4 or 8 bits, "
                             "no g_idx, whole blocks)")
    packed = ctx.value(b)
    scale = ctx.value(scales)
    if packed is None or scale is None:
        raise ctx.fail(node, "weights computed at run time")
    blocks = k // block
    scale = g.constant(scale.reshape(n, blocks))
    if bits == 4:
        qdtype = dt.uint4
        weight = g.constant(np.ascontiguousarray(packed.reshape(n, k // 2)), dtype=dt.uint4)
    else:
        qdtype = dt.uint8
        weight = g.constant(np.ascontiguousarray(packed.reshape(n, k)))
    if zero is None:
        zp = g.constant(np.full((n, 1), 2 ** (bits - 1), np.float32).astype(scale.dtype.numpy))
    else:
        z = ctx.value(zero)
        if z is None:
            raise ctx.fail(node, "zero points computed at run time")
        if z.dtype == np.uint8:
            values = dt.unpack_int4(z.reshape(n, -1), 2 * z.size // n, signed=False)[:, :blocks] if bits == 4 else z.reshape(n, blocks)
            zp = g.constant(values.astype(scale.dtype.numpy))
        else:
            zp = g.constant(z.reshape(n, blocks).astype(scale.dtype.numpy))
    del qdtype
    w = g.dequantize(weight, scale=scale, zero_point=zp, axis=1, block_size=block, dtype=scale.dtype)
    y = g.matmul(a, g.transpose(w))
    if bias is not None:
        y = y + bias
    return [y]


@converter("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: Context, node: OnnxNode):
    """uint8 quantization with the scale and zero point of x's own range (which includes 0); an all-zero
    x gets scale 1, as onnxruntime gives it (the spec's formula would divide 0 by 0)."""
    (x,) = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
    zero = scalar(ctx, 0, x)
    lo = g.minimum(g.min(x, tuple(range(x.ndim))), zero)
    hi = g.maximum(g.max(x, tuple(range(x.ndim))), zero)
    scale = g.where(g.equal(hi, lo), scalar(ctx, 1, x), (hi - lo) / scalar(ctx, 255, x))
    zero_point = g.quantize(g.neg(lo) / scale, dt.uint8, scale=scalar(ctx, 1, x))   # saturate(round(-lo / scale))
    y = g.quantize(x, dt.uint8, scale=scale, zero_point=zero_point)
    return [y, scale, zero_point]
