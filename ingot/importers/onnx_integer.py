"""ONNX's integer ops: MatMulInteger, ConvInteger (int32 sums of 8-bit products less zero points) and
QLinearMatMul, QLinearConv (those sums, plus an int32 bias, requantized to 8 bits), matching
onnxruntime exactly.

The sums run through the float kernels (BLAS matmul, the CPU conv), exactly: a float32 sum of whole
numbers is exact while every partial sum stays below 2**24. With |x - x_zero| <= 255, a weight whose
column sums S = sum |w - w_zero| (known when w is a constant; 255 * K otherwise) keep 255 * S below
2**24 is one float32 op, where a matmul's weight stays 8-bit (dequantize(w, scale=1, w_zero) becomes
quantized_matmul; a conv's is dequantized once at compile). Past that, x - x_zero is split into
16 * high + low digits (|digit| <= 16: two ops, exact while 16 * S < 2**24), and past that the weight
too (four ops, K < 65536); the parts are summed in int32.
Requantizing does what onnxruntime's MlasRequantizeOutput does: float32(sum) * (x_scale * w_scale /
y_scale) in float32, rounded half to even, plus the output zero point, saturated.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ir import Op
from .onnx_nn import _as
from .onnx_ops import Context, OnnxNode, converter

EXACT_FLOAT32 = 2 ** 24   # every whole number of magnitude up to this is a float32
EIGHT_BIT = (dt.int8, dt.uint8)
DIGIT = 16                # x - x_zero = DIGIT * high + low, |high| <= 16, 0 <= low < 16


def _weight_offsets(ctx: Context, w: Tensor, zero: Tensor | None, out_axis: int) -> np.ndarray | None:
    """w - zero as int64 when both are known at import, else None."""
    wv = ctx.value(w)
    zv = np.zeros((), np.int64) if zero is None else ctx.value(zero)
    if wv is None or zv is None or w.dtype.packed:
        return None
    shape = [1] * wv.ndim
    shape[out_axis] = zv.size
    return wv.astype(np.int64) - zv.astype(np.int64).reshape(shape if zv.size > 1 else ())


def _offset(ctx: Context, t: Tensor, zero: Tensor | None, axis: int | None) -> Tensor:
    """t - zero as whole float32 numbers; zero per tensor, or one per index of `axis`."""
    g = ctx.g
    y = g.cast(t, dt.float32)
    if zero is None:
        return y
    z = g.cast(zero, dt.float32)
    if z.ndim == 1 and z.shape[0] != 1 and axis is not None:
        shape = [1] * t.ndim
        shape[axis] = z.shape[0]
        z = g.reshape(z, shape)
    elif z.ndim >= 1:
        z = g.reshape(z, ())
    return y - z


def _digits(ctx: Context, t: Tensor) -> list[tuple[int, Tensor]]:
    """t (whole numbers in [-255, 255]) as DIGIT * high + low."""
    g = ctx.g
    high = g.op(Op.FLOOR, [t / g.constant(np.float32(DIGIT))])
    return [(DIGIT, high), (1, t - high * g.constant(np.float32(DIGIT)))]


def _exact_weight(ctx: Context, w: Tensor, zero: Tensor | None, axis: int) -> Tensor:
    """w - zero in float32 as a dequantize (scale 1) of the 8-bit constant, which the compiler keeps 8-bit
    under a matmul and computes once under a conv."""
    g = ctx.g
    z = None
    if zero is not None and np.any(ctx.value(zero)):
        zv = ctx.value(zero).astype(np.float32)
        z = g.constant(zv.reshape(())) if zv.size == 1 else g.constant(zv)
    per_axis = z is not None and z.ndim == 1
    return g.dequantize(w, scale=g.constant(np.float32(1)), zero_point=z, axis=axis if per_axis else None)


def integer_sum(ctx: Context, x: Tensor, x_zero: Tensor | None, x_axis: int | None, w: Tensor, w_zero: Tensor | None,
                out_axis: int, reduce: tuple[int, ...], bias: Tensor | None, apply: Callable[..., Tensor]) -> Tensor:
    """apply(x - x_zero, w - w_zero[, bias]) for a linear op `apply` (matmul, conv), exactly: a float32
    tensor of whole numbers, or an int32 one where the sum had to be split. The zero points are per
    tensor or along x_axis and out_axis; the weight's sums run along `reduce`."""
    g = ctx.g
    offsets = _weight_offsets(ctx, w, w_zero, out_axis)
    bias_value = np.zeros(1) if bias is None else ctx.value(bias)
    taps = int(np.prod([w.shape[a] for a in reduce]))
    column_sums = 255.0 * taps if offsets is None else float(np.abs(offsets).sum(axis=reduce).max(initial=0))
    xs = _offset(ctx, x, x_zero, x_axis)
    if offsets is not None and bias_value is not None and \
            255 * column_sums + float(np.abs(bias_value).max(initial=0)) < EXACT_FLOAT32:
        return apply(xs, _exact_weight(ctx, w, w_zero, out_axis), None if bias is None else g.cast(bias, dt.float32))
    if DIGIT * column_sums < EXACT_FLOAT32:
        ws = _offset(ctx, w, w_zero, out_axis) if offsets is None else _exact_weight(ctx, w, w_zero, out_axis)
        pairs = [(cx, px, 1, ws) for cx, px in _digits(ctx, xs)]
    elif DIGIT * DIGIT * taps < EXACT_FLOAT32:
        ws = _offset(ctx, w, w_zero, out_axis)
        pairs = [(cx, px, cw, pw) for cx, px in _digits(ctx, xs) for cw, pw in _digits(ctx, ws)]
    else:
        raise IngotError(f"an integer sum over {taps} products: Ingot sums fewer than 65536 exactly")
    total = None
    for cx, px, cw, pw in pairs:
        part = g.cast(apply(px, pw, None), dt.int32)
        part = part if cx * cw == 1 else part * g.constant(np.int32(cx * cw))
        total = part if total is None else total + part
    return total if bias is None else total + g.cast(bias, dt.int32)


def integer_matmul(ctx: Context, a: Tensor, a_zero: Tensor | None, b: Tensor, b_zero: Tensor | None) -> Tensor:
    """sum_k (a - a_zero)(b - b_zero), exact (float32 or int32)."""
    return integer_sum(ctx, a, a_zero, a.ndim - 2, b, b_zero, b.ndim - 1, (b.ndim - 2,), None,
                       lambda x, w, _: ctx.g.matmul(x, w))


def integer_conv(ctx: Context, node: OnnxNode, x: Tensor, x_zero: Tensor | None, w: Tensor, w_zero: Tensor | None,
                 bias: Tensor | None) -> Tensor:
    """The convolution of (x - x_zero) by (w - w_zero) (+ an int32 bias), exact (float32 or int32)."""
    attrs = dict(node.attrs)

    def conv(xs: Tensor, ws: Tensor, b: Tensor | None) -> Tensor:
        return _as(ctx, node, "Conv", [xs, ws] + ([] if b is None else [b]), attrs)[0]
    return integer_sum(ctx, x, x_zero, None, w, w_zero, 0, tuple(range(1, w.ndim)), bias, conv)


def requantize(ctx: Context, total: Tensor, x_scale: Tensor, w_scale: Tensor, y_scale: Tensor, y_zero: Tensor | None,
               channel_axis: int) -> Tensor:
    """saturate(round_half_even(float32(total) * (x_scale * w_scale / y_scale)) + y_zero), as onnxruntime."""
    g = ctx.g
    f32 = [s if s.dtype == dt.float32 else g.cast(s, dt.float32) for s in (x_scale, w_scale, y_scale)]
    x_scale, w_scale, y_scale = (g.reshape(s, ()) if s.ndim and s.type.size == 1 else s for s in f32)
    multiplier = x_scale * w_scale / y_scale
    if multiplier.ndim == 1:
        shape = [1] * total.ndim
        shape[channel_axis] = multiplier.shape[0]
        multiplier = g.reshape(multiplier, shape)
    scaled = (total if total.dtype == dt.float32 else g.cast(total, dt.float32)) * multiplier   # int32 -> float32: RNE
    target = dt.uint8 if y_zero is None else y_zero.dtype
    zero = None if y_zero is None else g.reshape(y_zero, ())
    return g.quantize(scaled, target, scale=g.constant(np.float32(1)), zero_point=zero)


def _check_8_bit(ctx: Context, node: OnnxNode, *ts: Tensor) -> None:
    if any(t.dtype not in EIGHT_BIT for t in ts):
        raise ctx.fail(node, f"inputs of type {', '.join(t.dtype.name for t in ts)} (Ingot takes int8 and uint8)")


@converter("MatMulInteger")
def _matmul_integer(ctx: Context, node: OnnxNode):
    a, b = node.input(0), node.input(1)
    _check_8_bit(ctx, node, a, b)
    return [ctx.g.cast(integer_matmul(ctx, a, node.input(2), b, node.input(3)), dt.int32)]


@converter("ConvInteger")
def _conv_integer(ctx: Context, node: OnnxNode):
    x, w = node.input(0), node.input(1)
    _check_8_bit(ctx, node, x, w)
    return [ctx.g.cast(integer_conv(ctx, node, x, node.input(2), w, node.input(3), None), dt.int32)]


@converter("QLinearMatMul")
def _qlinear_matmul(ctx: Context, node: OnnxNode):
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = node.inputs
    _check_8_bit(ctx, node, a, b)
    total = integer_matmul(ctx, a, a_zero, b, b_zero)
    return [requantize(ctx, total, a_scale, b_scale, y_scale, y_zero, total.ndim - 1)]


@converter("QLinearConv")
def _qlinear_conv(ctx: Context, node: OnnxNode):
    x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero = (node.input(i) for i in range(8))
    _check_8_bit(ctx, node, x, w)
    total = integer_conv(ctx, node, x, x_zero, w, w_zero, node.input(8))
    return [requantize(ctx, total, x_scale, w_scale, y_scale, y_zero, 1)]
