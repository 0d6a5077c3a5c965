"""One converter per ONNX op: (Context, OnnxNode) -> the node's outputs as Ingot tensors.

A converter builds plain Ingot ops with the builder API. Operands that ONNX passes as tensors but
that Ingot needs as attributes (shapes, axes, slice bounds, pads) are read with `ctx.constant`,
which works because every input shape is fixed at import and shape arithmetic is computed as the
graph is built. What a converter cannot express raises `ctx.fail(node, why)` (UnsupportedOnnx).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ir import Op
from ..ops import normalize_axis
from .onnx import ONNX_DTYPES, ONNX_TYPE_NAMES, Context, Converter, OnnxNode, as_ingot_array

CONVERTERS: dict[tuple[str, str], Converter] = {}


def converter(*op_types: str, domain: str = ""):
    def deco(fn: Converter) -> Converter:
        for op in op_types:
            CONVERTERS[(domain, op)] = fn
        return fn
    return deco


def _scalar(ctx: Context, value, like: Tensor) -> Tensor:
    return ctx.g.constant(np.asarray(value, like.dtype.numpy))


def _float(ctx: Context, node: OnnxNode, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise ctx.fail(node, f"input of type {x.dtype.name} (Ingot computes this op on floats)")


def _attr_or_input(ctx: Context, node: OnnxNode, name: str, index: int, default=None):
    """An operand that older opsets give as an attribute and newer ones as an (optional) input."""
    if name in node.attrs:
        return node.attrs[name]
    if node.input(index) is not None:
        return ctx.constant(node, index, name).tolist()
    return default


# -- elementwise ----------------------------------------------------------------------------------

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Equal": "equal", "Less": "less",
           "LessOrEqual": "less_equal", "Greater": "greater", "GreaterOrEqual": "greater_equal",
           "And": "logical_and", "Or": "logical_or", "Xor": "logical_xor"}


@converter(*_BINARY)
def _binary(ctx: Context, node: OnnxNode):
    a, b = node.inputs[:2]
    return [getattr(ctx.g, _BINARY[node.op_type])(a, b)]


@converter("Pow")
def _pow(ctx: Context, node: OnnxNode):
    x, y = node.inputs
    if x.dtype.is_int and y.dtype.is_float:  # an integer base to a float power: computed in floats
        return [ctx.g.cast(ctx.g.pow(ctx.g.cast(x, dt.float32), ctx.g.cast(y, dt.float32) if y.dtype != dt.float32 else y), x.dtype)]
    if y.dtype != x.dtype:
        y = ctx.g.cast(y, x.dtype)
    if not (x.dtype.is_float or x.dtype.is_int):
        raise ctx.fail(node, f"base of type {x.dtype.name}")
    v = ctx.value(y)
    if v is not None and v.size == 1 and float(v.reshape(-1)[0]) == 2.0 and v.ndim <= x.ndim:
        return [x * x]  # the common square, exact and cheaper than pow
    return [ctx.g.pow(x, y)]


_UNARY = {"Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Tanh": "tanh", "Sigmoid": "sigmoid",
          "Erf": "erf", "Sin": "sin", "Cos": "cos", "Not": "logical_not"}


@converter(*_UNARY)
def _unary(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    if node.op_type in ("Abs", "Neg") and x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    return [getattr(ctx.g, _UNARY[node.op_type])(x)]


@converter("Identity")
def _identity(ctx: Context, node: OnnxNode):
    return [node.inputs[0]]


@converter("Reciprocal")
def _reciprocal(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    _float(ctx, node, x)
    return [ctx.g.div(_scalar(ctx, 1, x), x)]


@converter("Relu")
def _relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.maximum(x, _scalar(ctx, 0, x))]


@converter("LeakyRelu")
def _leaky_relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 0.01)
    return [g.where(x < _scalar(ctx, 0, x), x * _scalar(ctx, alpha, x), x)]


@converter("PRelu")
def _prelu(ctx: Context, node: OnnxNode):
    x, slope = node.inputs
    g = ctx.g
    return [g.where(x < _scalar(ctx, 0, x), x * slope, x)]


@converter("Elu")
def _elu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 1.0)
    return [g.where(x < _scalar(ctx, 0, x), (g.exp(x) - _scalar(ctx, 1, x)) * _scalar(ctx, alpha, x), x)]


@converter("Selu")
def _selu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    alpha, gamma = node.attr("alpha", 1.67326319217681884765625), node.attr("gamma", 1.05070102214813232421875)
    neg = g.exp(x) * _scalar(ctx, alpha, x) - _scalar(ctx, alpha, x)
    return [g.where(x <= _scalar(ctx, 0, x), neg, x) * _scalar(ctx, gamma, x)]


@converter("Celu")
def _celu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 1.0)
    neg = (g.exp(x / _scalar(ctx, alpha, x)) - _scalar(ctx, 1, x)) * _scalar(ctx, alpha, x)
    return [g.maximum(x, _scalar(ctx, 0, x)) + g.minimum(neg, _scalar(ctx, 0, x))]


@converter("HardSigmoid")
def _hard_sigmoid(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [_hard_sigmoid_of(ctx, x, node.attr("alpha", 0.2), node.attr("beta", 0.5))]


def _hard_sigmoid_of(ctx: Context, x: Tensor, alpha: float, beta: float) -> Tensor:
    g = ctx.g
    y = x * _scalar(ctx, alpha, x) + _scalar(ctx, beta, x)
    return g.maximum(g.minimum(y, _scalar(ctx, 1, x)), _scalar(ctx, 0, x))


@converter("HardSwish")
def _hard_swish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x * _hard_sigmoid_of(ctx, x, 1.0 / 6.0, 0.5)]


def _softplus_of(ctx: Context, x: Tensor) -> Tensor:
    g = ctx.g  # max(x, 0) + log(1 + exp(-|x|)): no overflow for large |x|
    return g.maximum(x, _scalar(ctx, 0, x)) + g.log(g.exp(g.neg(g.abs(x))) + _scalar(ctx, 1, x))


@converter("Softplus")
def _softplus(ctx: Context, node: OnnxNode):
    return [_softplus_of(ctx, node.inputs[0])]


@converter("Softsign")
def _softsign(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x / (ctx.g.abs(x) + _scalar(ctx, 1, x))]


@converter("Mish")
def _mish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x * ctx.g.tanh(_softplus_of(ctx, x))]


@converter("ThresholdedRelu")
def _thresholded_relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.where(x > _scalar(ctx, node.attr("alpha", 1.0), x), x, _scalar(ctx, 0, x))]


@converter("Gelu")
def _gelu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    _float(ctx, node, x)
    return [ctx.g.gelu(x, approximate=node.attr("approximate", "none"))]


@converter("Sign")
def _sign(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    zero, one = _scalar(ctx, 0, x), _scalar(ctx, 1, x)
    if x.dtype.kind == "u":
        return [g.where(x > zero, one, zero)]
    return [g.where(x > zero, one, g.where(x < zero, _scalar(ctx, -1, x), zero))]


@converter("IsNaN")
def _isnan(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.not_equal(x, x)]


@converter("IsInf")
def _isinf(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    pos, neg = g.equal(x, _scalar(ctx, np.inf, x)), g.equal(x, _scalar(ctx, -np.inf, x))
    want_pos, want_neg = node.attr("detect_positive", 1), node.attr("detect_negative", 1)
    if want_pos and want_neg:
        return [g.logical_or(pos, neg)]
    if want_pos:
        return [pos]
    if want_neg:
        return [neg]
    return [g.logical_and(pos, neg)]


@converter("Clip")
def _clip(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if node.opset < 11:
        lo, hi = node.attr("min"), node.attr("max")
        lo = None if lo is None else _scalar(ctx, lo, x)
        hi = None if hi is None else _scalar(ctx, hi, x)
    else:
        lo, hi = node.input(1), node.input(2)
    if lo is not None:
        x = g.maximum(x, lo)
    if hi is not None:
        x = g.minimum(x, hi)
    return [x]


def _in_float32(fn):
    """Compute a composite activation of a float16/bfloat16 input in float32 and round once, as
    ONNX's reference does (rounding every step loses a bfloat16 ulp or two)."""
    def convert(ctx: Context, node: OnnxNode):
        x = node.inputs[0]
        if x.dtype not in (dt.float16, dt.bfloat16):
            return fn(ctx, node)
        wide = OnnxNode(node.op_type, node.domain, node.name, [ctx.g.cast(t, dt.float32) if t is not None and t.dtype == x.dtype
                                                                 else t for t in node.inputs], node.attrs, node.outputs, node.opset)
        return [ctx.g.cast(y, x.dtype) for y in fn(ctx, wide)]
    return convert


for _op in ("LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Mish",
            "ThresholdedRelu"):
    CONVERTERS[("", _op)] = _in_float32(CONVERTERS[("", _op)])


def _variadic(fn):
    def convert(ctx: Context, node: OnnxNode):
        out = node.inputs[0]
        for other in node.inputs[1:]:
            out = fn(ctx.g, out, other)
        if len(node.inputs) == 1:
            out = fn(ctx.g, out, None) if fn is _mean_step else out
        return [out]
    return convert


def _mean_step(g, a, b):
    return a if b is None else a + b


CONVERTERS[("", "Max")] = _variadic(lambda g, a, b: g.maximum(a, b))
CONVERTERS[("", "Min")] = _variadic(lambda g, a, b: g.minimum(a, b))
CONVERTERS[("", "Sum")] = _variadic(lambda g, a, b: g.add(a, b))


@converter("Mean")
def _mean(ctx: Context, node: OnnxNode):
    out = node.inputs[0]
    for other in node.inputs[1:]:
        out = out + other
    return [out / _scalar(ctx, len(node.inputs), out)]


@converter("Where")
def _where(ctx: Context, node: OnnxNode):
    c, a, b = node.inputs
    return [ctx.g.where(c, a, b)]


def onnx_to_ingot_dtype(ctx: Context, node: OnnxNode, elem_type: int) -> dt.DType:
    if elem_type not in ONNX_DTYPES:
        raise ctx.fail(node, f"type {ONNX_TYPE_NAMES.get(elem_type, elem_type)} is not one Ingot computes")
    return ONNX_DTYPES[elem_type][0]


@converter("Cast")
def _cast(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    target = onnx_to_ingot_dtype(ctx, node, node.attr("to"))
    if x.dtype == target:
        return [x]
    if x.dtype == dt.complex64:
        raise ctx.fail(node, "a complex input")
    if node.attr("saturate", 1) == 0:
        raise ctx.fail(node, "saturate=0")
    return [ctx.g.cast(x, target)]


@converter("CastLike")
def _cast_like(ctx: Context, node: OnnxNode):
    x, like = node.inputs
    return [x if x.dtype == like.dtype else ctx.g.cast(x, like.dtype)]


# -- matmul and friends ---------------------------------------------------------------------------

def _split_swap(g, b: Tensor) -> Tensor:
    """A transpose feeding a matmul's right side that also swaps the last two axes, written as a
    transpose then that swap, so the attention pattern (matmul(q, swap(k))) sees its swap."""
    node = b.node
    if node.op != Op.TRANSPOSE or b.ndim < 3:
        return b
    perm = tuple(node.attrs["perm"])
    r = len(perm)
    swap = tuple(range(r - 2)) + (r - 1, r - 2)
    if perm == swap or perm[-1] > perm[-2]:
        return b
    inner = perm[:-2] + (perm[-1], perm[-2])
    src = Tensor(g, node.src[0])
    return g.transpose(g.transpose(src, inner), swap)


def _quantized_weight(ctx: Context, b: Tensor, transposed: bool) -> Tensor | None:
    """With --quantize: a constant 2-D float weight as dequantize(quantized) (transposed back), which
    the compiler fuses with its matmul; None where the weight is not one to quantize."""
    fmt = ctx.quantize
    w = ctx.value(b) if fmt is not None and b.ndim == 2 and b.dtype == dt.float32 else None
    if w is None or min(w.shape) < 16:
        return None
    from ..quant import quantize
    rows_out = w if transposed else w.T                       # [outputs, reduction]
    if fmt.qdtype.packed and rows_out.shape[1] % 2:
        return None
    t = quantize(rows_out, fmt)
    g = ctx.g
    q = g.constant(t.q, dtype=t.qdtype) if t.qdtype.packed else g.constant(t.q)
    if t.lut is not None:
        deq = g.dequantize(q, lut=g.constant(t.lut))
    else:
        param = lambda p: None if p is None else g.constant(p.astype(np.float32))  # noqa: E731
        deq = g.dequantize(q, scale=param(t.scale), zero_point=param(t.zero_point), bias=param(t.bias))
    return g.transpose(deq)


@converter("MatMul")
def _matmul(ctx: Context, node: OnnxNode):
    a, b = node.inputs
    if a.dtype == dt.bool_:
        raise ctx.fail(node, "bool inputs")
    weight = _quantized_weight(ctx, b, transposed=False) if a.dtype == dt.float32 else None
    return [ctx.g.matmul(a, weight if weight is not None else _split_swap(ctx.g, b))]


@converter("Gemm")
def _gemm(ctx: Context, node: OnnxNode):
    a, b, c = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    if node.attr("transA", 0):
        a = g.transpose(a)
    weight = _quantized_weight(ctx, b, transposed=bool(node.attr("transB", 0))) if a.dtype == dt.float32 else None
    if weight is not None:
        b = weight
    elif node.attr("transB", 0):
        b = g.transpose(b)
    y = g.matmul(a, b)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if alpha != 1.0:
        y = y * _scalar(ctx, alpha, y)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * _scalar(ctx, beta, c))
    return [y]


# -- normalisation --------------------------------------------------------------------------------

@converter("Softmax", "LogSoftmax")
def _softmax(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    fn = g.softmax if node.op_type == "Softmax" else g.log_softmax
    if node.opset >= 13:
        return [fn(x, axis=node.attr("axis", -1))]
    axis = normalize_axis("softmax", node.attr("axis", 1), x.ndim)  # older opsets: over the flattened tail
    if axis == x.ndim - 1:
        return [fn(x, axis=-1)]
    shape = x.shape
    flat = g.reshape(x, (int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))))
    return [g.reshape(fn(flat, axis=-1), shape)]


@converter("LayerNormalization")
def _layer_norm(ctx: Context, node: OnnxNode):
    x, scale, bias = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    _float(ctx, node, x)
    axis = normalize_axis("LayerNormalization", node.attr("axis", -1), x.ndim)
    eps = node.attr("epsilon", 1e-5)
    wants = [bool(o) for o in node.outputs]
    last = x.shape[-1:]
    if axis == x.ndim - 1 and not any(wants[1:]) and scale.shape == last and (bias is None or bias.shape == last):
        return [g.layer_norm(x, scale, bias, eps=eps)]
    axes = tuple(range(axis, x.ndim))
    stash = onnx_to_ingot_dtype(ctx, node, node.attr("stash_type", 1))
    xs = x if x.dtype == stash else g.cast(x, stash)
    mean = g.mean(xs, axes, keepdims=True)
    d = xs - mean
    inv = g.rsqrt(g.mean(d * d, axes, keepdims=True) + _scalar(ctx, eps, xs))
    y = d * inv
    if y.dtype != x.dtype:
        y = g.cast(y, x.dtype)
    y = y * scale
    if bias is not None:
        y = y + bias
    return [y, mean, inv]


@converter("RMSNormalization")
def _rms_norm(ctx: Context, node: OnnxNode):
    x, scale = node.inputs[:2]
    g = ctx.g
    _float(ctx, node, x)
    axis = normalize_axis("RMSNormalization", node.attr("axis", -1), x.ndim)
    eps = node.attr("epsilon", 1e-5)
    if axis == x.ndim - 1 and scale.shape == x.shape[-1:]:
        return [g.rms_norm(x, scale, eps=eps)]
    axes = tuple(range(axis, x.ndim))
    xs = x if x.dtype == dt.float32 else g.cast(x, dt.float32)
    y = xs * g.rsqrt(g.mean(xs * xs, axes, keepdims=True) + _scalar(ctx, eps, xs))
    if y.dtype != x.dtype:
        y = g.cast(y, x.dtype)
    return [y * scale]


def _per_channel(g, p: Tensor, rank: int) -> Tensor:
    """A [C] parameter shaped to broadcast over [N, C, ...]."""
    return g.reshape(p, (p.shape[0],) + (1,) * (rank - 2))


@converter("BatchNormalization")
def _batch_norm(ctx: Context, node: OnnxNode):
    x, scale, bias, mean, var = node.inputs[:5]
    g = ctx.g
    eps = node.attr("epsilon", 1e-5)
    if node.attr("training_mode", 0):  # batch statistics, and the running ones updated by momentum
        axes = (0,) + tuple(range(2, x.ndim))
        batch_mean = g.mean(x, axes)
        d = x - _per_channel(g, batch_mean, x.ndim)
        batch_var = g.mean(d * d, axes)
        inv = g.rsqrt(batch_var + _scalar(ctx, eps, batch_var)) * scale
        y = d * _per_channel(g, inv, x.ndim) + _per_channel(g, bias, x.ndim)
        momentum = node.attr("momentum", 0.9)
        keep, take = _scalar(ctx, momentum, mean), _scalar(ctx, 1 - momentum, mean)
        return [y, mean * keep + batch_mean * take, var * keep + batch_var * take]
    if sum(1 for o in node.outputs if o) > 1:
        raise ctx.fail(node, "running statistics outside training mode")
    values = [ctx.value(t) for t in (scale, bias, mean, var)]
    if all(v is not None for v in values):  # fold into one multiply-add per channel
        s, b, m, v = (a.astype(np.float64) for a in values)
        a = s / np.sqrt(v + eps)
        shift = b - m * a
        mul = g.constant(a.astype(x.dtype.numpy))
        add = g.constant(shift.astype(x.dtype.numpy))
        return [x * _per_channel(g, mul, x.ndim) + _per_channel(g, add, x.ndim)]
    inv = g.rsqrt(var + _scalar(ctx, eps, var)) * scale
    return [(x - _per_channel(g, mean, x.ndim)) * _per_channel(g, inv, x.ndim) + _per_channel(g, bias, x.ndim)]


@converter("InstanceNormalization")
def _instance_norm(ctx: Context, node: OnnxNode):
    x, scale, bias = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    axes = tuple(range(2, x.ndim))
    mean = g.mean(x, axes, keepdims=True)
    d = x - mean
    y = d * g.rsqrt(g.mean(d * d, axes, keepdims=True) + _scalar(ctx, node.attr("epsilon", 1e-5), x))
    return [y * _per_channel(g, scale, x.ndim) + _per_channel(g, bias, x.ndim)]


@converter("GroupNormalization")
def _group_norm(ctx: Context, node: OnnxNode):
    x, scale, bias = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    groups = node.attr("num_groups")
    n, c = x.shape[:2]
    if node.opset < 21:
        raise ctx.fail(node, "opset 18 GroupNormalization (per-group scale), deprecated by ONNX")
    grouped = g.reshape(x, (n, groups, -1))
    mean = g.mean(grouped, (2,), keepdims=True)
    d = grouped - mean
    y = g.reshape(d * g.rsqrt(g.mean(d * d, (2,), keepdims=True) + _scalar(ctx, node.attr("epsilon", 1e-5), x)), x.shape)
    return [y * _per_channel(g, scale, x.ndim) + _per_channel(g, bias, x.ndim)]


# -- shape ops ------------------------------------------------------------------------------------

def _ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


@converter("Shape")
def _shape(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    shape = list(x.shape)
    r = len(shape)
    start, end = node.attr("start", 0), node.attr("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    return [ctx.g.constant(np.array(shape[start:end], np.int64))]


@converter("Size")
def _size(ctx: Context, node: OnnxNode):
    return [ctx.g.constant(np.array(node.inputs[0].type.size, np.int64))]


@converter("Reshape")
def _reshape(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    target = _ints(ctx.constant(node, 1, "shape"))
    if not node.attr("allowzero", 0):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
        target = [x.type.size // known if d == -1 and known else d for d in target]
    if int(np.prod(target, dtype=np.int64)) != x.type.size:
        raise IngotError(f"shape {target} does not hold the {x.type.size} elements of {x.type}")
    return [ctx.g.reshape(x, target)]


@converter("Flatten")
def _flatten(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    axis = node.attr("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    lead = int(np.prod(x.shape[:axis], dtype=np.int64))
    return [ctx.g.reshape(x, (lead, int(np.prod(x.shape[axis:], dtype=np.int64))))]


@converter("Transpose")
def _transpose(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    perm = node.attr("perm")
    return [ctx.g.transpose(x, None if perm is None else tuple(perm))]


@converter("Squeeze")
def _squeeze(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    axes = _attr_or_input(ctx, node, "axes", 1)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if axes is None else [normalize_axis("Squeeze", a, x.ndim) for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        raise IngotError(f"axes {axes} of shape {list(x.shape)} are not all of size 1")
    return [ctx.g.reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))]


@converter("Unsqueeze")
def _unsqueeze(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    axes = _attr_or_input(ctx, node, "axes", 1)
    rank = x.ndim + len(axes)
    axes = sorted(normalize_axis("Unsqueeze", a, rank) for a in axes)
    shape, it = [], iter(x.shape)
    for i in range(rank):
        shape.append(1 if i in axes else next(it))
    return [ctx.g.reshape(x, shape)]


@converter("Concat")
def _concat(ctx: Context, node: OnnxNode):
    parts = [t for t in node.inputs if t is not None]
    if len(parts) == 1:
        return parts
    return [ctx.g.concat(parts, axis=node.attr("axis"))]


@converter("Split")
def _split(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    axis = normalize_axis("Split", node.attr("axis", 0), x.ndim)
    n = x.shape[axis]
    count = len(node.outputs)
    sizes = node.attr("split") if node.opset < 13 else (_ints(ctx.constant(node, 1, "split")) if node.input(1) is not None else None)
    if sizes is None:
        parts = node.attr("num_outputs", count)
        chunk = -(-n // parts)
        sizes = [min(chunk, n - i * chunk) for i in range(parts)]
    return ctx.g.split(x, [int(s) for s in sizes], axis=axis)


def _onnx_slice(dim: int, start: int, end: int, step: int) -> tuple[int, int | None, int]:
    """ONNX Slice's clamping rules for one axis, as a Python slice."""
    if step == 0:
        raise IngotError("a step of 0")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return min(max(start, 0), dim), min(max(end, 0), dim), step
    start = min(max(start, 0), dim - 1)
    end = min(max(end, -1), dim - 1)
    if start < 0:  # an empty axis
        return 0, 0, 1
    return start, (None if end < 0 else end), step


@converter("Slice")
def _slice(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    if node.opset < 10:
        starts, ends = node.attr("starts"), node.attr("ends")
        axes, steps = node.attr("axes"), None
    else:
        starts = _ints(ctx.constant(node, 1, "starts"))
        ends = _ints(ctx.constant(node, 2, "ends"))
        axes = _ints(ctx.constant(node, 3, "axes")) if node.input(3) is not None else None
        steps = _ints(ctx.constant(node, 4, "steps")) if node.input(4) is not None else None
    axes = list(range(len(starts))) if axes is None else [normalize_axis("Slice", a, x.ndim) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    start, end, step = [0] * x.ndim, [None] * x.ndim, [1] * x.ndim
    for a, s, e, st in zip(axes, starts, ends, steps):
        start[a], end[a], step[a] = _onnx_slice(x.shape[a], s, e, st)
    return [ctx.g.slice(x, start, end, step)]


@converter("Gather")
def _gather(ctx: Context, node: OnnxNode):
    x, idx = node.inputs
    axis = normalize_axis("Gather", node.attr("axis", 0), x.ndim)
    v = ctx.value(idx)
    if v is not None and v.size and (v.min() < -x.shape[axis] or v.max() >= x.shape[axis]):
        raise IngotError(f"indices {v.min()}..{v.max()} are out of range for axis {axis} of {x.type}")
    if v is not None and v.size and v.min() < 0:
        idx = ctx.g.constant(np.where(v < 0, v + x.shape[axis], v).astype(v.dtype))
    if idx.dtype not in (dt.int32, dt.int64):
        idx = ctx.g.cast(idx, dt.int64)
    return [ctx.g.gather(x, idx, axis=axis)]


@converter("Expand")
def _expand(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    shape = _ints(ctx.constant(node, 1, "shape"))
    try:
        out = np.broadcast_shapes(tuple(x.shape), tuple(shape))
    except ValueError:
        raise IngotError(f"shape {shape} does not broadcast with {list(x.shape)}") from None
    if tuple(out) == tuple(x.shape):
        return [x]
    return [ctx.g.broadcast_to(x, out)]


@converter("Tile")
def _tile(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    reps = _ints(ctx.constant(node, 1, "repeats"))
    if all(r == 1 for r in reps):
        return [x]
    interleaved = tuple(v for d in x.shape for v in (1, d))
    spread = tuple(v for r, d in zip(reps, x.shape) for v in (r, d))
    y = g.broadcast_to(g.reshape(x, interleaved), spread)
    return [g.reshape(y, tuple(r * d for r, d in zip(reps, x.shape)))]


@converter("Range")
def _range(ctx: Context, node: OnnxNode):
    start, limit, delta = (ctx.constant(node, i, w) for i, w in enumerate(("start", "limit", "delta")))
    dtype = node.inputs[0].dtype.storage
    count = max(int(math.ceil((float(limit) - float(start)) / float(delta))), 0)
    return [ctx.g.constant((start + np.arange(count) * delta).astype(dtype))]


@converter("ConstantOfShape")
def _constant_of_shape(ctx: Context, node: OnnxNode):
    shape = _ints(ctx.constant(node, 0, "shape"))
    value = node.attr("value")
    fill = np.zeros(1, np.float32) if value is None else as_ingot_array(value)
    return [ctx.g.constant(np.full(shape, fill.reshape(-1)[0], fill.dtype))]


@converter("Constant")
def _constant(ctx: Context, node: OnnxNode):
    a = node.attrs
    if "value" in a:
        value = a["value"]
    elif "value_float" in a:
        value = np.array(a["value_float"], np.float32)
    elif "value_floats" in a:
        value = np.array(a["value_floats"], np.float32)
    elif "value_int" in a:
        value = np.array(a["value_int"], np.int64)
    elif "value_ints" in a:
        value = np.array(a["value_ints"], np.int64)
    else:
        raise ctx.fail(node, f"a constant given as {sorted(a)} (strings and sparse tensors are not supported)")
    return [ctx.g.constant(as_ingot_array(value))]


@converter("EyeLike")
def _eye_like(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    dtype = x.dtype if node.attr("dtype") is None else onnx_to_ingot_dtype(ctx, node, node.attr("dtype"))
    return [ctx.g.constant(np.eye(x.shape[0], x.shape[1], k=node.attr("k", 0), dtype=dtype.numpy))]


@converter("Trilu")
def _trilu(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    k = int(ctx.constant(node, 1, "k")) if node.input(1) is not None else 0
    rows, cols = x.shape[-2:]
    ones = np.ones((rows, cols), bool)
    mask = np.triu(ones, k) if node.attr("upper", 1) else np.tril(ones, k)
    return [ctx.g.where(ctx.g.constant(mask), x, _scalar(ctx, 0, x))]


@converter("Pad")
def _pad(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    mode = node.attr("mode", "constant")
    if node.opset < 11:
        pads, value, axes = node.attr("pads"), node.attr("value", 0.0), None
    else:
        pads = _ints(ctx.constant(node, 1, "pads"))
        value = ctx.constant(node, 2, "constant_value").reshape(-1)[0] if node.input(2) is not None else 0
        axes = _ints(ctx.constant(node, 3, "axes")) if node.input(3) is not None else None
    axes = list(range(x.ndim)) if axes is None else [normalize_axis("Pad", a, x.ndim) for a in axes]
    n = len(axes)
    before, after = [0] * x.ndim, [0] * x.ndim
    for i, a in enumerate(axes):
        before[a], after[a] = pads[i], pads[i + n]
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise ctx.fail(node, f"mode {mode!r}")
    if any(p < 0 for p in before + after):  # negative pads crop
        x = g.slice(x, [-p if p < 0 else 0 for p in before], [d + p if p < 0 else None for d, p in zip(x.shape, after)])
        before, after = [max(p, 0) for p in before], [max(p, 0) for p in after]
    if not any(before + after):
        return [x]
    if x.dtype == dt.bool_ or not (x.dtype.is_float or x.dtype.is_int):
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    if mode == "wrap":  # the far end of each axis before it, the near end after it
        for a, (lo, hi) in enumerate(zip(before, after)):
            if lo or hi:
                d = x.shape[a]
                if lo > d or hi > d:
                    raise ctx.fail(node, f"wrap padding longer than the axis ({d})")
                parts = [g.slice(x, [0] * a + [d - lo], [None] * a + [None])] if lo else []
                parts.append(x)
                if hi:
                    parts.append(g.slice(x, [0] * x.ndim, [None] * a + [hi]))
                x = g.concat(parts, axis=a)
        return [x]
    return [g.pad(x, list(zip(before, after)), mode=mode, value=float(value))]


# -- reductions -----------------------------------------------------------------------------------

def _reduce_axes(ctx: Context, node: OnnxNode, x: Tensor, input_since: int) -> tuple[int, ...] | None:
    """The axes to reduce, or None for 'no reduction' (noop_with_empty_axes)."""
    if node.opset >= input_since:
        axes = _ints(ctx.constant(node, 1, "axes")) if node.input(1) is not None else []
    else:
        axes = list(node.attr("axes", []) or [])
    if not axes:
        return None if node.attr("noop_with_empty_axes", 0) else tuple(range(x.ndim))
    return tuple(sorted({normalize_axis(node.op_type, a, x.ndim) for a in axes}))


_EMPTY_REDUCTION = {"ReduceMax": -np.inf, "ReduceMin": np.inf, "ReduceSum": 0, "ReduceMean": np.nan, "ReduceProd": 1,
                    "ReduceL1": 0, "ReduceL2": 0, "ReduceSumSquare": 0, "ReduceLogSum": -np.inf,
                    "ReduceLogSumExp": -np.inf}


@converter(*_EMPTY_REDUCTION)
def _reduce(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    axes = _reduce_axes(ctx, node, x, 13 if node.op_type == "ReduceSum" else 18)
    keep = bool(node.attr("keepdims", 1))
    op = node.op_type
    if axes is None:
        if op in ("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"):
            return [{"ReduceL1": g.abs, "ReduceL2": g.abs, "ReduceSumSquare": lambda t: t * t, "ReduceLogSum": g.log,
                     "ReduceLogSumExp": lambda t: t}[op](x)]
        return [x]
    if any(x.shape[a] == 0 for a in axes):
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes)
        fill = _EMPTY_REDUCTION[op]
        if x.dtype == dt.bool_:
            fill = op == "ReduceMin"
        elif x.dtype.is_int and not np.isfinite(fill):
            info = np.iinfo(x.dtype.numpy)
            fill = info.min if fill < 0 else info.max
        return [g.constant(np.full(shape, fill, x.dtype.numpy))]
    if op == "ReduceProd":
        raise ctx.fail(node, "products (Ingot has no product reduction)")
    if x.dtype == dt.bool_ and op in ("ReduceMax", "ReduceMin"):
        wide = g.cast(x, dt.int32)
        return [g.cast(g.max(wide, axes, keep) if op == "ReduceMax" else g.min(wide, axes, keep), dt.bool_)]
    if x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    if op == "ReduceMean" and not x.dtype.is_float:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    if op == "ReduceSum":
        return [g.sum(x, axes, keep)]
    if op == "ReduceMean":
        return [g.mean(x, axes, keep)]
    if op == "ReduceMax":
        return [g.max(x, axes, keep)]
    if op == "ReduceMin":
        return [g.min(x, axes, keep)]
    if op == "ReduceL1":
        return [g.sum(g.abs(x), axes, keep)]
    if op == "ReduceSumSquare":
        return [g.sum(x * x, axes, keep)]
    if op == "ReduceL2":
        _float(ctx, node, x)
        return [g.sqrt(g.sum(x * x, axes, keep))]
    _float(ctx, node, x)
    if op == "ReduceLogSum":
        return [g.log(g.sum(x, axes, keep))]
    top = g.max(x, axes, keepdims=True)  # ReduceLogSumExp, shifted by the max so exp cannot overflow
    out = g.log(g.sum(g.exp(x - top), axes, keepdims=True)) + top
    return [out if keep else g.reshape(out, tuple(d for i, d in enumerate(x.shape) if i not in axes))]


@converter("ArgMax", "ArgMin")
def _arg(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    axis = normalize_axis(node.op_type, node.attr("axis", 0), x.ndim)
    keep = bool(node.attr("keepdims", 1))
    fn = g.argmax if node.op_type == "ArgMax" else g.argmin
    if x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    if node.attr("select_last_index", 0):
        n = x.shape[axis]
        step = [1] * x.ndim
        step[axis] = -1
        flipped = g.slice(x, [None] * x.ndim, [None] * x.ndim, step)
        idx = _scalar(ctx, n - 1, fn(flipped, axis, keep)) - fn(flipped, axis, keep)
    else:
        idx = fn(x, axis, keep)
    return [g.cast(idx, dt.int64)]


# -- convolution and pooling ------------------------------------------------------------------------

def _window_pads(node: OnnxNode, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                 dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    k = len(spatial)
    auto = node.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        before, after = [], []
        for d, kk, s, dil in zip(spatial, kernel, strides, dilations):
            total = max(0, (-(-d // s) - 1) * s + (kk - 1) * dil + 1 - d)
            small = total // 2
            before.append(small if auto == "SAME_UPPER" else total - small)
            after.append(total - before[-1])
        return before, after
    if auto == "VALID":
        return [0] * k, [0] * k
    pads = list(node.attr("pads", [0] * 2 * k))
    return pads[:k], pads[k:]


def _windows(g, x: Tensor, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int], out: Sequence[int],
             lead: Sequence[int]) -> Tensor:
    """A strided view [*lead, *kernel, *out] of a contiguous [*lead, *spatial] tensor (no copy)."""
    spatial = x.shape[len(lead):]
    k = len(spatial)
    inner = [int(np.prod(spatial[i + 1:], dtype=np.int64)) for i in range(k)]
    lead_strides = [int(np.prod(x.shape[i + 1:], dtype=np.int64)) for i in range(len(lead))]
    shape = tuple(lead) + tuple(kernel) + tuple(out)
    strides_ = tuple(lead_strides) + tuple(d * s for d, s in zip(dilations, inner)) + tuple(st * s for st, s in zip(strides, inner))
    return g.array_view(x, shape, strides_)


def _out_size(padded: int, kernel: int, stride: int, dilation: int, ceil: bool = False) -> int:
    span = padded - dilation * (kernel - 1) - 1
    return (-(-span // stride) if ceil else span // stride) + 1


@converter("Conv")
def _conv(ctx: Context, node: OnnxNode):
    x, w, b = node.input(0), node.input(1), node.input(2)
    _float(ctx, node, x)
    k = x.ndim - 2
    kernel = list(node.attr("kernel_shape", w.shape[2:]))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    before, after = _window_pads(node, x.shape[2:], kernel, strides, dilations)
    return [_convolve(ctx.g, x, w, b, kernel, strides, dilations, node.attr("group", 1), before, after)]


def _convolve(g, x: Tensor, w: Tensor, b: Tensor | None, kernel, strides, dilations, groups: int, before, after) -> Tensor:
    """N-d convolution as columns (a strided view of the padded input) times the weights, per group."""
    n, c = x.shape[:2]
    m = w.shape[0]
    if any(before + after):
        x = g.pad(x, [(0, 0), (0, 0)] + list(zip(before, after)))
    padded = x.shape[2:]
    out = [_out_size(p, kk, s, d) for p, kk, s, d in zip(padded, kernel, strides, dilations)]
    # columns [N, G, C/G, *kernel, *out] -> [N, G, C/G * K, L]; weights [G, M/G, C/G * K]
    grouped = g.reshape(x, (n, groups, c // groups) + tuple(padded))
    cols = _windows(g, grouped, kernel, strides, dilations, out, (n, groups, c // groups))
    kk = int(np.prod(kernel, dtype=np.int64))
    length = int(np.prod(out, dtype=np.int64))
    cols = g.reshape(cols, (n, groups, (c // groups) * kk, length))
    wg = g.reshape(w, (groups, m // groups, (c // groups) * kk))
    y = g.reshape(g.matmul(wg, cols), (n, m) + tuple(out))
    if b is not None:
        y = y + _per_channel(g, b, y.ndim)
    return y


@converter("ConvTranspose")
def _conv_transpose(ctx: Context, node: OnnxNode):
    """The gradient of a convolution: zeros between the input's elements (stride), then a stride-1
    convolution with the flipped kernel, input and output channels swapped per group."""
    x, w, b = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    _float(ctx, node, x)
    n, c = x.shape[:2]
    spatial = list(x.shape[2:])
    k = len(spatial)
    groups = node.attr("group", 1)
    kernel = list(node.attr("kernel_shape", w.shape[2:]))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    extra = list(node.attr("output_padding", [0] * k))
    span = [(kk - 1) * d + 1 for kk, d in zip(kernel, dilations)]
    full = [(d - 1) * s + sp + e for d, s, sp, e in zip(spatial, strides, span, extra)]  # before any padding is cut
    auto = node.attr("auto_pad", "NOTSET")
    shape_attr = node.attr("output_shape")
    if auto in ("SAME_UPPER", "SAME_LOWER"):  # padding split to give output_shape (default: input * stride)
        target = list(shape_attr)[-k:] if shape_attr is not None else [d * s for d, s in zip(spatial, strides)]
        total = [f - t for f, t in zip(full, target)]
        pads_begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        pads_end = [t - pb for t, pb in zip(total, pads_begin)]
    else:  # explicit pads (none for VALID); an output_shape then only sets where the output ends
        pads = [0] * 2 * k if auto == "VALID" else list(node.attr("pads", [0] * 2 * k))
        pads_begin, pads_end = pads[:k], pads[k:]
        if shape_attr is not None:
            pads_end = [f - pb - t for f, pb, t in zip(full, pads_begin, list(shape_attr)[-k:])]
    # zeros between elements: [.., d] -> [.., d, s] (pad) -> [.., d * s] -> keep (d - 1) * s + 1
    y = x
    if any(s > 1 for s in strides):
        inter = (n, c) + tuple(v for d in spatial for v in (d, 1))
        y = g.reshape(y, inter)
        y = g.pad(y, [(0, 0), (0, 0)] + [p for s in strides for p in ((0, 0), (0, s - 1))])
        y = g.reshape(y, (n, c) + tuple(d * s for d, s in zip(spatial, strides)))
        y = g.slice(y, [0] * (k + 2), [None, None] + [(d - 1) * s + 1 for d, s in zip(spatial, strides)])
    # the stride-1 convolution's own padding: the kernel's span less the cut, plus output_padding
    before = [sp - 1 - pb for sp, pb in zip(span, pads_begin)]
    after = [sp - 1 - pe + e for sp, pe, e in zip(span, pads_end, extra)]
    if any(v < 0 for v in before + after):  # padding larger than the span crops the result
        y = g.slice(y, [0, 0] + [max(0, -v) for v in before], [None, None] + [d + min(0, v) for d, v in zip(y.shape[2:], after)])
        before, after = [max(0, v) for v in before], [max(0, v) for v in after]
    m = w.shape[1] * groups
    wv = ctx.value(w)
    if wv is not None:  # [C, M/G, *k] -> [M, C/G, *k], flipped
        wg = wv.reshape((groups, c // groups, m // groups) + tuple(kernel)).swapaxes(1, 2).reshape((m, c // groups) + tuple(kernel))
        flipped = g.constant(np.ascontiguousarray(wg[(slice(None), slice(None)) + (slice(None, None, -1),) * k]))
    else:
        wg = g.reshape(g.transpose(g.reshape(w, (groups, c // groups, m // groups) + tuple(kernel)),
                                   (0, 2, 1) + tuple(range(3, 3 + k))), (m, c // groups) + tuple(kernel))
        flipped = g.slice(wg, [None] * (k + 2), [None] * (k + 2), [1, 1] + [-1] * k)
    return [_convolve(g, y, flipped, b, kernel, [1] * k, dilations, groups, before, after)]


def _pool_counts(spatial, before, after, kernel, strides, dilations, out, include_pad: bool) -> np.ndarray:
    """How many elements each average-pool window counts (the divisor), computed in NumPy."""
    mask = np.ones(spatial, np.float32)
    explicit = np.pad(mask, list(zip(before, after)), constant_values=1.0 if include_pad else 0.0)
    need = [(o - 1) * s + d * (kk - 1) + 1 for o, s, d, kk in zip(out, strides, dilations, kernel)]
    extra = [max(0, nd - p) for nd, p in zip(need, explicit.shape)]
    full = np.pad(explicit, [(0, e) for e in extra], constant_values=0.0)
    counts = np.zeros(out, np.float64)
    for offset in np.ndindex(*kernel):
        index = tuple(slice(o * d, o * d + (n - 1) * s + 1, s) for o, d, n, s in zip(offset, dilations, out, strides))
        counts += full[index]
    return counts


@converter("MaxPool", "AveragePool")
def _pool(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if node.op_type != "MaxPool" or x.dtype == dt.bool_:
        _float(ctx, node, x)
    wants_indices = len(node.outputs) > 1 and bool(node.outputs[1])
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    k = len(spatial)
    kernel = list(node.attr("kernel_shape"))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    before, after = _window_pads(node, spatial, kernel, strides, dilations)
    ceil = bool(node.attr("ceil_mode", 0))
    padded = [d + b + a for d, b, a in zip(spatial, before, after)]
    out = [_out_size(p, kk, s, d, ceil) for p, kk, s, d in zip(padded, kernel, strides, dilations)]
    if ceil:  # a last window must start inside the input or its left padding
        out = [o - 1 if (o - 1) * s >= d + b else o for o, s, d, b in zip(out, strides, spatial, before)]
    need = [(o - 1) * s + d * (kk - 1) + 1 for o, s, d, kk in zip(out, strides, dilations, kernel)]
    after = [a + max(0, nd - p) for a, nd, p in zip(after, need, padded)]
    is_max = node.op_type == "MaxPool"
    if any(before + after):
        fill = (-np.inf if x.dtype.is_float else float(np.iinfo(x.dtype.numpy).min)) if is_max else 0.0
        x = g.pad(x, [(0, 0), (0, 0)] + list(zip(before, after)), value=fill)
    view = _windows(g, x, kernel, strides, dilations, out, (n, c))
    axes = tuple(range(2, 2 + k))
    if is_max and wants_indices:
        return [g.max(view, axes), _pool_indices(ctx, node, view, spatial, before, kernel, strides, dilations, out)]
    if is_max:
        return [g.max(view, axes)]
    explicit_after = [a - max(0, nd - p) for a, nd, p in zip(after, need, padded)]
    counts = _pool_counts(spatial, before, explicit_after, kernel, strides, dilations, out,
                          bool(node.attr("count_include_pad", 0)))
    total = g.sum(view, axes)
    if np.all(counts == counts.reshape(-1)[0]):
        return [total / _scalar(ctx, counts.reshape(-1)[0], total)]
    return [total / g.constant(counts.astype(x.dtype.numpy))]


def _pool_indices(ctx: Context, node: OnnxNode, view: Tensor, spatial, before, kernel, strides, dilations, out) -> Tensor:
    """MaxPool's Indices: the flat index in the input (row- or column-major, storage_order) of each
    window's first maximum: argmax over the window, then a NumPy table from window slot to index."""
    g = ctx.g
    n, c = view.shape[:2]
    k = len(spatial)
    kk = int(np.prod(kernel, dtype=np.int64))
    windows = g.reshape(g.transpose(view, (0, 1) + tuple(range(2 + k, 2 + 2 * k)) + tuple(range(2, 2 + k))),
                        (n, c) + tuple(out) + (kk,))
    slot = g.argmax(windows, -1, keepdims=True)                     # [N, C, *out, 1]
    column_major = bool(node.attr("storage_order", 0))
    table = np.zeros(tuple(out) + (kk,), np.int64)
    for o in np.ndindex(*out):
        for j, offset in enumerate(np.ndindex(*kernel)):
            pos = [oi * s - b + ki * d for oi, s, b, ki, d in zip(o, strides, before, offset, dilations)]
            if all(0 <= p < dim for p, dim in zip(pos, spatial)):
                table[o + (j,)] = (np.ravel_multi_index(pos, spatial, order="F" if column_major else "C"))
    hot = g.equal(slot, g.constant(np.arange(kk, dtype=np.int32)))
    index = g.sum(g.where(hot, g.constant(table), g.constant(np.zeros((), np.int64))), (2 + k,))
    base = (np.arange(n * c, dtype=np.int64) * int(np.prod(spatial, dtype=np.int64))).reshape((n, c) + (1,) * k)
    return index + g.constant(base)


@converter("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    _float(ctx, node, x)
    axes = tuple(range(2, x.ndim))
    fn = ctx.g.mean if node.op_type == "GlobalAveragePool" else ctx.g.max
    return [fn(x, axes, keepdims=True)]


# -- dropout and friends ----------------------------------------------------------------------------

@converter("Dropout")
def _dropout(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    training = ctx.value(node.input(2)) if node.input(2) is not None else None
    if node.input(2) is not None and (training is None or bool(training)):
        raise ctx.fail(node, "training mode")
    outs = [x]
    if len(node.outputs) > 1 and node.outputs[1]:
        outs.append(ctx.g.constant(np.ones(x.shape, bool)))
    return outs


# -- signal processing ------------------------------------------------------------------------------

def _window_values(node: OnnxNode, size: int) -> np.ndarray:
    periodic = node.attr("periodic", 1)
    n = size if periodic else size - 1
    i = np.arange(size, dtype=np.float64)
    if node.op_type == "HannWindow":
        w = np.sin(np.pi * i / n) ** 2
    elif node.op_type == "HammingWindow":
        a0 = 25.0 / 46.0
        w = a0 - (1 - a0) * np.cos(2 * np.pi * i / n)
    else:  # Blackman
        w = 0.42 - 0.5 * np.cos(2 * np.pi * i / n) + 0.08 * np.cos(4 * np.pi * i / n)
    return w


@converter("HannWindow", "HammingWindow", "BlackmanWindow")
def _window(ctx: Context, node: OnnxNode):
    size = int(ctx.constant(node, 0, "size"))
    dtype = onnx_to_ingot_dtype(ctx, node, node.attr("output_datatype", 1))
    return [ctx.g.constant(_window_values(node, size).astype(dtype.numpy))]


def _complex_out(g, y: Tensor) -> Tensor:
    """complex64 [...] -> float32 [..., 2] (real, imaginary), ONNX's layout."""
    shape = tuple(y.shape) + (1,)
    return g.concat([g.reshape(g.real(y), shape), g.reshape(g.imag(y), shape)], axis=-1)


def _complex_in(g, x: Tensor) -> Tensor:
    """ONNX [..., 1] (real) or [..., 2] (real, imaginary) -> float32 [...] or complex64 [...]."""
    shape = tuple(x.shape[:-1])
    if x.shape[-1] == 1:
        return g.reshape(x, shape)
    re, im = g.split(x, 2, axis=-1)
    return g.complex(g.reshape(re, shape), g.reshape(im, shape))


@converter("DFT")
def _dft(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype != dt.float32:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    if node.opset >= 20:
        axis = int(ctx.constant(node, 2, "axis")) if node.input(2) is not None else -2
    else:
        axis = node.attr("axis", 1)
    axis = normalize_axis("DFT", axis, x.ndim)
    if axis == x.ndim - 1:
        raise IngotError("the last axis holds (real, imaginary) and cannot be transformed")
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    signal = _complex_in(g, x)
    n = x.shape[axis]
    if node.input(1) is not None and not (inverse and onesided):
        length = int(ctx.constant(node, 1, "dft_length"))
        if length < n:
            signal = g.slice(signal, [0] * signal.ndim, [None if i != axis else length for i in range(signal.ndim)])
        elif length > n:
            pads = [(0, 0)] * signal.ndim
            pads[axis] = (0, length - n)
            signal = g.pad(signal, pads) if signal.dtype == dt.float32 else g.complex(
                g.pad(g.real(signal), pads), g.pad(g.imag(signal), pads))
    if inverse and onesided:  # Hermitian bins -> a real signal [..., n, 1]
        if signal.dtype != dt.complex64:
            raise ctx.fail(node, "a one-sided inverse of a real input")
        n = int(ctx.constant(node, 1, "dft_length")) if node.input(1) is not None else 2 * (x.shape[axis] - 1)
        y = g.irfft(_complex_in(g, x), axes=(axis,), norm="size", n=n)
        return [g.reshape(y, tuple(y.shape) + (1,))]
    if inverse:
        y = g.ifft(signal, axes=(axis,), norm="size")
    elif onesided and signal.dtype == dt.float32:
        y = g.rfft(signal, axes=(axis,))
    else:
        y = g.fft(signal, axes=(axis,))
        if onesided:
            half = signal.shape[axis] // 2 + 1
            y = g.slice(y, [0] * y.ndim, [None if i != axis else half for i in range(y.ndim)])
    return [_complex_out(g, y)]


@converter("STFT")
def _stft(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype != dt.float32:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    step = int(ctx.constant(node, 1, "frame_step"))
    window = node.input(2)
    if node.input(3) is not None:
        frame = int(ctx.constant(node, 3, "frame_length"))
    elif window is not None:
        frame = window.shape[0]
    else:
        raise IngotError("neither a window nor a frame_length")
    onesided = bool(node.attr("onesided", 1))
    batch, length = x.shape[:2]
    frames = 1 + (length - frame) // step
    signal = _complex_in(g, x)  # [B, L] real or complex
    if signal.dtype == dt.complex64:
        re = g.array_view(g.real(signal), (batch, frames, frame), (length, step, 1))
        im = g.array_view(g.imag(signal), (batch, frames, frame), (length, step, 1))
        if window is not None:
            re, im = re * window, im * window
        y = g.fft(g.complex(re, im), axes=(2,))
        if onesided:
            y = g.slice(y, [0, 0, 0], [None, None, frame // 2 + 1])
        return [_complex_out(g, y)]
    framed = g.array_view(signal, (batch, frames, frame), (length, step, 1))
    if window is not None:
        framed = framed * window
    y = g.rfft(framed, axes=(2,)) if onesided else g.fft(framed, axes=(2,))
    return [_complex_out(g, y)]


# -- quantization -----------------------------------------------------------------------------------

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
    if q.dtype not in (dt.int8, dt.uint8, dt.int4, dt.uint4):
        if q.dtype in (dt.int32, dt.int64) and scale.ndim <= 1:  # int16/uint16/int32 tensors: in floats
            p = scale if scale.ndim == 0 or scale.type.size == 1 else _axis_param(g, scale, node, q)
            y = g.cast(q, dt.float32)
            if zero is not None:
                zp = zero if zero.ndim == 0 or zero.type.size == 1 else _axis_param(g, zero, node, q)
                y = y - g.cast(zp, dt.float32)
            y = y * (p if p.dtype == dt.float32 else g.cast(p, dt.float32))
            return [y if scale.dtype == dt.float32 else g.cast(y, scale.dtype)]
        raise ctx.fail(node, f"input of type {q.dtype.name}")
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


def _axis_param(g, p: Tensor, node: OnnxNode, x: Tensor) -> Tensor:
    axis = normalize_axis(node.op_type, node.attr("axis", 1), x.ndim)
    shape = [1] * x.ndim
    shape[axis] = p.shape[0]
    return g.reshape(p, shape)


@converter("QuantizeLinear")
def _quantize_linear(ctx: Context, node: OnnxNode):
    x, scale, zero = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    _float(ctx, node, x)
    target = zero.dtype if zero is not None else dt.uint8
    if node.attr("output_dtype", 0):
        target = onnx_to_ingot_dtype(ctx, node, node.attr("output_dtype"))
    if target not in (dt.int8, dt.uint8):
        raise ctx.fail(node, f"output type {target.name}")
    if node.attr("saturate", 1) == 0 or node.attr("precision", 0):
        raise ctx.fail(node, "saturate=0 or precision")
    axis, _ = _quant_params(ctx, node, x, scale)
    if scale.dtype != x.dtype:
        scale = g.cast(scale, x.dtype)
    if scale.ndim == 1 and scale.shape[0] == 1 and x.ndim != 1:
        scale = g.reshape(scale, ())
        zero = None if zero is None else g.reshape(zero, ())
    return [g.quantize(x, target, scale=scale, zero_point=zero, axis=axis)]


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


# -- attention --------------------------------------------------------------------------------------

@converter("Attention")
def _attention(ctx: Context, node: OnnxNode):
    """ONNX Attention (opset 23+) as Ingot's SDPA where it can be (no softcap, no QK output), else
    written out (matmul, softcap, bias, softmax, matmul). Causal, sliding-window and padding masks
    are constants built here; a KV cache (past -> present) is a concat."""
    q, k, v = node.inputs[:3]
    mask, past_k, past_v = node.input(3), node.input(4), node.input(5)
    nonpad = node.input(6)
    g = ctx.g
    _float(ctx, node, q)
    three_d = q.ndim == 3
    if three_d:  # [B, T, H*D] -> [B, H, T, D]
        hq, hk = node.attr("q_num_heads"), node.attr("kv_num_heads")
        if not hq or not hk:
            raise IngotError("3-D inputs without q_num_heads and kv_num_heads")
        split = lambda t, h: g.transpose(g.reshape(t, (t.shape[0], t.shape[1], h, t.shape[2] // h)), (0, 2, 1, 3))  # noqa: E731
        q, k, v = split(q, hq), split(k, hk), split(v, hk)
    if past_k is not None:
        k, v = g.concat([past_k, k], axis=2), g.concat([past_v, v], axis=2)
    tq, tk = q.shape[2], k.shape[2]
    # the constant part of the bias: causal and sliding-window frontiers, padded keys
    allowed = np.ones((1, 1, tq, tk), bool)
    if nonpad is not None and past_k is None:
        lengths = np.asarray(ctx.constant(node, 6, "nonpad_kv_seqlen")).reshape(-1).astype(np.int64)
        offset = (lengths - tq).reshape(-1, 1, 1, 1)
        allowed = allowed & (np.arange(tk).reshape(1, 1, 1, tk) < lengths.reshape(-1, 1, 1, 1))
    else:
        offset = np.array(past_k.shape[2] if past_k is not None else 0).reshape(1, 1, 1, 1)
    diff = np.arange(tq).reshape(1, 1, tq, 1) + offset - np.arange(tk).reshape(1, 1, 1, tk)  # query position - key
    if node.attr("is_causal", 0):
        allowed = allowed & (diff >= 0)
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left is not None and left >= 0:
        allowed = allowed & (diff <= left)
    if right is not None and right >= 0:
        allowed = allowed & (-diff <= right)
    bias = None
    if mask is not None:
        if mask.shape[-1] < tk:  # a mask shorter than the keys: the rest is masked
            pads = [(0, 0)] * (mask.ndim - 1) + [(0, tk - mask.shape[-1])]
            mask = g.pad(g.cast(mask, dt.int32), pads) if mask.dtype == dt.bool_ else g.pad(mask, pads, value=-np.inf)
            mask = g.cast(mask, dt.bool_) if mask.dtype == dt.int32 else mask
        if mask.dtype == dt.bool_:
            mask = g.where(mask, _scalar(ctx, 0, q), _scalar(ctx, -np.inf, q))
        elif mask.dtype != q.dtype:
            mask = g.cast(mask, q.dtype)
        bias = mask
    if not allowed.all():
        constant = g.constant(np.where(allowed, 0, -np.inf).astype(q.dtype.numpy))
        bias = constant if bias is None else bias + constant
    scale = node.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    softcap = node.attr("softcap", 0.0) or 0.0
    mode = node.attr("qk_matmul_output_mode", 0)
    wants_qk = len(node.outputs) > 3 and bool(node.outputs[3])
    if softcap <= 0 and not wants_qk:
        y = g.scaled_dot_product_attention(q, k, v, mask=bias, scale=scale)
        qk = None
    else:
        y, qk = _attention_written_out(ctx, q, k, v, bias, scale, softcap, mode)
    if three_d:
        y = g.reshape(g.transpose(y, (0, 2, 1, 3)), (y.shape[0], y.shape[2], y.shape[1] * y.shape[3]))
    return [y, k, v] + ([qk] if wants_qk else [])


def _attention_written_out(ctx: Context, q, k, v, bias, scale, softcap, mode):
    g = ctx.g
    b, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    if hq != hk:  # each K/V head serves a group of query heads
        grow = lambda t: g.reshape(g.broadcast_to(g.reshape(t, (b, hk, 1) + tuple(t.shape[2:])),  # noqa: E731
                                                  (b, hk, hq // hk) + tuple(t.shape[2:])), (b, hq) + tuple(t.shape[2:]))
        k, v = grow(k), grow(v)
    root = _scalar(ctx, math.sqrt(scale), q)
    scores = g.matmul(q * root, g.swapaxes(k, -1, -2) * root)
    if softcap > 0:
        c = _scalar(ctx, softcap, scores)
        scores = g.tanh(scores / c) * c
    with_bias = scores if bias is None else scores + bias
    qk = with_bias if mode == 2 else scores
    dead = None
    if bias is not None:  # rows whose bias masks every key give zeros, not NaN
        dead = g.equal(g.max(g.broadcast_to(bias, tuple(with_bias.shape)) if bias.ndim < 4 or bias.shape != with_bias.shape
                             else bias, (3,), keepdims=True), _scalar(ctx, -np.inf, q))
        with_bias = g.where(dead, _scalar(ctx, 0, q), with_bias)
    probs = g.softmax(with_bias, axis=-1)
    if dead is not None:
        probs = g.where(dead, _scalar(ctx, 0, q), probs)
    if mode == 3:
        qk = probs
    return g.matmul(probs, v), qk


# -- more elementwise and index ops ---------------------------------------------------------------

@converter("Mod")
def _mod(ctx: Context, node: OnnxNode):
    a, b = node.inputs
    g = ctx.g
    fmod = node.attr("fmod", 0)
    if a.dtype.is_float:
        if not fmod:
            raise IngotError("fmod=0 on floats (ONNX requires fmod=1)")
        quotient = g.cast(g.cast(a / b, dt.int64), a.dtype)  # truncated toward zero
        return [a - quotient * b]
    if not a.dtype.is_int:
        raise ctx.fail(node, f"input of type {a.dtype.name}")
    r = a - g.div(a, b) * b  # Ingot's integer division truncates: r takes the dividend's sign (C's %)
    if fmod:
        return [r]
    zero = _scalar(ctx, 0, r)
    wrong_sign = g.logical_and(g.not_equal(r, zero), g.logical_xor(r < zero, b < _scalar(ctx, 0, b)))
    return [g.where(wrong_sign, r + b, r)]


@converter("Swish")
def _swish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    _float(ctx, node, x)
    alpha = node.attr("alpha", 1.0)
    return [x * ctx.g.sigmoid(x if alpha == 1.0 else x * _scalar(ctx, alpha, x))]


@converter("LpNormalization")
def _lp_normalization(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    axis, p = node.attr("axis", -1), node.attr("p", 2)
    if p not in (1, 2):
        raise ctx.fail(node, f"p={p}")
    norm = g.sum(g.abs(x), axis, keepdims=True) if p == 1 else g.sqrt(g.sum(x * x, axis, keepdims=True))
    zero = _scalar(ctx, 0, x)
    return [g.where(g.equal(norm, zero), zero, x / norm)]


def _positions(ctx: Context, n: int, rank: int, axis: int, dtype: dt.DType) -> Tensor:
    """arange(n) shaped to lie along `axis` of a rank-`rank` tensor."""
    shape = [1] * rank
    shape[axis] = n
    return ctx.g.constant(np.arange(n, dtype=dtype.numpy).reshape(shape))


@converter("Hardmax")
def _hardmax(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    if node.opset < 13:
        raise ctx.fail(node, "opset < 13 (over the flattened tail)")
    axis = normalize_axis("Hardmax", node.attr("axis", -1), x.ndim)
    first = g.argmax(x, axis, keepdims=True)
    return [g.cast(g.equal(first, _positions(ctx, x.shape[axis], x.ndim, axis, dt.int32)), x.dtype)]


@converter("OneHot")
def _one_hot(ctx: Context, node: OnnxNode):
    indices, values = node.inputs[0], node.inputs[2]
    g = ctx.g
    depth = int(np.asarray(ctx.constant(node, 1, "depth")).reshape(-1)[0])
    idx = indices if indices.dtype == dt.int64 else g.cast(indices, dt.int64)
    idx = g.where(idx < _scalar(ctx, 0, idx), idx + _scalar(ctx, depth, idx), idx)
    rank = idx.ndim + 1
    axis = normalize_axis("OneHot", node.attr("axis", -1), rank)
    shape = list(idx.shape)
    shape.insert(axis, 1)
    hot = g.equal(g.reshape(idx, shape), _positions(ctx, depth, rank, axis, dt.int64))
    off, on = g.split(values, 2, axis=0)
    return [g.where(hot, g.reshape(on, ()), g.reshape(off, ()))]


@converter("CumSum")
def _cumsum(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    axis = normalize_axis("CumSum", int(np.asarray(ctx.constant(node, 1, "axis")).reshape(-1)[0]), x.ndim)
    n = x.shape[axis]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    exclusive, reverse = node.attr("exclusive", 0), node.attr("reverse", 0)
    take = (i > j if exclusive else i >= j) if reverse else (i < j if exclusive else i <= j)  # y_j = sum_i x_i take[i, j]
    perm = [a for a in range(x.ndim) if a != axis] + [axis]
    moved = x if axis == x.ndim - 1 else g.transpose(x, perm)
    y = g.matmul(moved, g.constant(take.astype(x.dtype.numpy)))
    return [y if axis == x.ndim - 1 else g.transpose(y, [perm.index(a) for a in range(x.ndim)])]


@converter("SpaceToDepth")
def _space_to_depth(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    perm = (0, 3, 5, 1, 2, 4) if node.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    y = g.transpose(g.reshape(x, (n, c, h // b, b, w // b, b)), perm)
    return [g.reshape(y, (n, c * b * b, h // b, w // b))]


@converter("DepthToSpace")
def _depth_to_space(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "DCR":
        y = g.transpose(g.reshape(x, (n, b, b, c // (b * b), h, w)), (0, 3, 4, 1, 5, 2))
    else:
        y = g.transpose(g.reshape(x, (n, c // (b * b), b, b, h, w)), (0, 1, 4, 2, 5, 3))
    return [g.reshape(y, (n, c // (b * b), h * b, w * b))]


@converter("GatherElements")
def _gather_elements(ctx: Context, node: OnnxNode):
    """out[..., i, ...] = data[..., idx[..., i, ...], ...] along axis, as a one-hot select and a sum
    (memory grows with len(axis) times the output: fine for the small gathers models do with it)."""
    data, idx = node.inputs
    g = ctx.g
    axis = normalize_axis("GatherElements", node.attr("axis", 0), data.ndim)
    n = data.shape[axis]
    if data.dtype == dt.bool_ or idx.ndim != data.ndim:
        raise ctx.fail(node, "bool data or indices of another rank")
    d = g.slice(data, [0] * data.ndim, [None if a == axis else idx.shape[a] for a in range(data.ndim)])
    perm = [a for a in range(data.ndim) if a != axis] + [axis]
    back = [perm.index(a) for a in range(data.ndim)]
    idx = idx if idx.dtype == dt.int64 else g.cast(idx, dt.int64)
    idx = g.where(idx < _scalar(ctx, 0, idx), idx + _scalar(ctx, n, idx), idx)
    d_t, i_t = g.transpose(d, perm), g.transpose(idx, perm)          # [*other, n], [*other, m]
    hot = g.equal(g.reshape(i_t, tuple(i_t.shape) + (1,)), g.constant(np.arange(n, dtype=np.int64)))  # [*other, m, n]
    picked = g.where(hot, g.reshape(d_t, tuple(d_t.shape[:-1]) + (1, n)), _scalar(ctx, 0, d_t))
    return [g.transpose(g.sum(picked, (picked.ndim - 1,)), back)]


@converter("Attention", domain="com.microsoft")
def _ms_attention(ctx: Context, node: OnnxNode):
    """com.microsoft Attention (onnxruntime's fused BERT attention): the QKV projection, then SDPA
    with the padding mask (raw [B, T] / [B, S, T] or lengths [B]) as mask_filter_value where masked."""
    x, weights, bias, mask_index = node.input(0), node.input(1), node.input(2), node.input(3)
    g = ctx.g
    if node.input(4) is not None or (len(node.outputs) > 1 and node.outputs[1]) or node.input(6) is not None:
        raise ctx.fail(node, "a KV cache (past/present)")
    if node.attr("do_rotary", 0):
        raise ctx.fail(node, "do_rotary")
    _float(ctx, node, x)
    heads = node.attr("num_heads")
    sizes = list(node.attr("qkv_hidden_sizes", []) or [weights.shape[1] // 3] * 3)
    b, s, _ = x.shape
    qkv = g.matmul(x, weights)
    if bias is not None:
        qkv = qkv + bias
    q, k, v = g.split(qkv, sizes, axis=2)
    heads_of = lambda t: g.transpose(g.reshape(t, (b, s, heads, t.shape[2] // heads)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = heads_of(q), heads_of(k), heads_of(v)
    filter_value = node.attr("mask_filter_value", -10000.0)
    masked, keep = _scalar(ctx, filter_value, q), _scalar(ctx, 0, q)
    mask = None
    if mask_index is not None:
        if mask_index.ndim == 2 and mask_index.shape == (b, s):       # raw: 1 attend, 0 masked
            mask = g.reshape(g.where(g.equal(mask_index, _scalar(ctx, 0, mask_index)), masked, keep), (b, 1, 1, s))
        elif mask_index.ndim == 3:                                      # [B, S, T]
            mask = g.reshape(g.where(g.equal(mask_index, _scalar(ctx, 0, mask_index)), masked, keep), (b, 1, s, s))
        elif mask_index.ndim == 1 and mask_index.shape[0] == b:         # right padding: valid lengths
            lengths = g.reshape(mask_index, (b, 1))
            inside = g.less(g.constant(np.arange(s, dtype=mask_index.dtype.numpy)), lengths)
            mask = g.reshape(g.where(inside, keep, masked), (b, 1, 1, s))
        else:
            raise ctx.fail(node, f"a mask_index of shape {list(mask_index.shape)}")
    if node.attr("unidirectional", 0):
        causal = g.constant(np.where(np.tril(np.ones((s, s), bool)), 0.0, filter_value).astype(q.dtype.numpy))
        mask = causal if mask is None else mask + causal
    if node.input(5) is not None:
        mask = node.input(5) if mask is None else mask + node.input(5)
    y = g.scaled_dot_product_attention(q, k, v, mask=mask, scale=node.attr("scale"))
    return [g.reshape(g.transpose(y, (0, 2, 1, 3)), (b, s, y.shape[1] * y.shape[3]))]


# -- resize ---------------------------------------------------------------------------------------

def _resize_matrix(n_in: int, n_out: int, scale: float, roi, fct, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """The interpolation along one axis as a matrix [n_out, n_in] (and which outputs are extrapolated),
    from ONNX's own reference: resizing the identity gives the weights, resizing zeros the outside."""
    from onnx.reference.ops.op_resize import _interpolate_1d_along_axis

    weights = _interpolate_1d_along_axis(np.eye(n_in), 0, scale, n_out, fct, roi=roi, extrapolation_value=0.0, **kwargs)
    outside = _interpolate_1d_along_axis(np.zeros((n_in, 1)), 0, scale, n_out, fct, roi=roi, extrapolation_value=1.0, **kwargs)
    return np.asarray(weights, np.float64), np.asarray(outside, np.float64).reshape(-1)


def _resize_coefficients(node: OnnxNode):
    """ONNX's reference coefficient function for the node's mode (nearest, linear, cubic; antialias)."""
    try:
        from onnx.reference.ops import op_resize as ref
    except ImportError:  # pragma: no cover
        raise IngotError("Resize needs onnx's reference implementation (onnx >= 1.13)") from None
    mode, antialias = node.attr("mode", "nearest"), node.attr("antialias", 0)
    if mode == "nearest":
        nearest = node.attr("nearest_mode", "round_prefer_floor")
        return lambda x, scale: ref._nearest_coeffs(x, mode=nearest)
    if mode == "linear":
        return ref._linear_coeffs_antialias if antialias else ref._linear_coeffs
    if mode == "cubic":
        a = node.attr("cubic_coeff_a", -0.75)
        fn = ref._cubic_coeffs_antialias if antialias else ref._cubic_coeffs
        return lambda x, scale: fn(x, scale, A=a)
    raise IngotError(f"mode {mode!r}")


@converter("Resize")
def _resize(ctx: Context, node: OnnxNode):
    """Resize as one small matmul per resized axis with weights from ONNX's reference (exact
    gathers for nearest on integers), so every mode, coordinate transform and antialias is ONNX's."""
    x = node.inputs[0]
    g = ctx.g
    r = x.ndim
    if node.opset < 11:
        roi, scales, sizes = None, ctx.constant(node, 1, "scales").astype(np.float64), None
    else:
        roi = ctx.constant(node, 1, "roi").astype(np.float64) if node.input(1) is not None else None
        scales = ctx.constant(node, 2, "scales").astype(np.float64) if node.input(2) is not None else None
        sizes = ctx.constant(node, 3, "sizes").astype(np.int64) if node.input(3) is not None else None
    if scales is not None and scales.size == 0:
        scales = None
    if roi is not None and roi.size == 0:
        roi = None
    axes = node.attr("axes")
    axes = list(range(r)) if axes is None else [normalize_axis("Resize", a, r) for a in axes]
    full_scales, full_sizes, full_roi = [1.0] * r, list(x.shape), ([0.0] * r) + ([1.0] * r)
    for i, a in enumerate(axes):
        if scales is not None:
            full_scales[a] = float(scales[i])
        if sizes is not None:
            full_sizes[a] = int(sizes[i])
        if roi is not None:
            full_roi[a], full_roi[r + a] = float(roi[i]), float(roi[len(axes) + i])
    policy = node.attr("keep_aspect_ratio_policy", "stretch")
    if sizes is not None:
        full_scales = [full_sizes[i] / x.shape[i] for i in range(r)]
        if policy != "stretch":
            scale = min(full_scales[a] for a in axes) if policy == "not_larger" else max(full_scales[a] for a in axes)
            full_scales = [scale if i in axes else 1.0 for i in range(r)]
            full_sizes = [int(scale * x.shape[i] + 0.5) if i in axes else x.shape[i] for i in range(r)]
    elif scales is not None:
        full_sizes = [int(s * d) for s, d in zip(full_scales, x.shape)]
    else:
        raise IngotError("neither scales nor sizes")
    fct = _resize_coefficients(node)
    transform = node.attr("coordinate_transformation_mode", "half_pixel" if node.opset >= 11 else "asymmetric")
    kwargs = dict(coordinate_transformation_mode=transform, exclude_outside=bool(node.attr("exclude_outside", 0)))
    extrapolation = node.attr("extrapolation_value", 0.0)
    nearest = node.attr("mode", "nearest") == "nearest"
    if not (x.dtype.is_float or (nearest and x.dtype.is_int)):
        raise ctx.fail(node, f"mode {node.attr('mode', 'nearest')!r} on {x.dtype.name}")
    y = x
    for a in range(r):
        axis_roi = [full_roi[a], full_roi[a + r]]
        identity = (math.isclose(full_scales[a], 1.0) and full_sizes[a] == x.shape[a]
                    and math.isclose(axis_roi[0], 0.0) and math.isclose(axis_roi[1], 1.0))
        if identity:
            continue
        weights, outside = _resize_matrix(x.shape[a], full_sizes[a], full_scales[a], axis_roi if transform == "tf_crop_and_resize" else None,
                                          fct, **kwargs)
        if nearest and np.all((weights == 0) | (weights == 1)) and np.all(weights.sum(axis=1)[outside == 0] == 1):
            index = np.argmax(weights, axis=1).astype(np.int64)
            y = g.gather(y, g.constant(index), axis=a)
        else:
            perm = [i for i in range(r) if i != a] + [a]
            moved = y if a == r - 1 else g.transpose(y, perm)
            moved = g.matmul(moved, g.constant(weights.T.astype(y.dtype.numpy)))
            y = moved if a == r - 1 else g.transpose(moved, [perm.index(i) for i in range(r)])
        if outside.any():
            shape = [1] * r
            shape[a] = full_sizes[a]
            inside = g.constant((outside == 0).reshape(shape))
            y = g.where(inside, y, _scalar(ctx, extrapolation, y))
    return [y]


# -- einsum ---------------------------------------------------------------------------------------

def _einsum_terms(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """The operand and output letters with '...' spelled out as fresh letters (right-aligned)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise IngotError(f"equation {equation!r} names {len(terms)} operands, not {len(ranks)}")
    spare = [chr(c) for c in range(ord("A"), ord("Z") + 1) if chr(c) not in eq]
    width = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = "".join(spare[:width])
    expanded = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            n = r - len(t.replace("...", ""))
            t = t.replace("...", ellipsis[width - n:])
        if len(t) != r:
            raise IngotError(f"term {t!r} of {equation!r} does not fit an operand of rank {r}")
        expanded.append(t)
    if arrow:
        out = rhs.replace("...", ellipsis)
    else:
        counts = {c: sum(t.count(c) for t in expanded) for c in "".join(expanded)}
        out = ellipsis + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ellipsis))
    return expanded, out


def _einsum_diagonal(g, x: Tensor, letters: str) -> tuple[Tensor, str]:
    """A letter repeated in one operand takes the diagonal (times an identity mask, summed)."""
    while len(set(letters)) < len(letters):
        c = next(c for c in letters if letters.count(c) > 1)
        p = letters.index(c)
        q = letters.index(c, p + 1)
        n = x.shape[p]
        shape = [1] * x.ndim
        shape[p], shape[q] = n, n
        eye = g.constant(np.eye(n, dtype=x.dtype.numpy).reshape(shape))
        x = g.sum(x * eye, (q,))
        letters = letters[:q] + letters[q + 1:]
    return x, letters


@converter("Einsum")
def _einsum(ctx: Context, node: OnnxNode):
    """Einsum as diagonals, sums, and one batched matmul per pair of operands."""
    g = ctx.g
    operands = list(node.inputs)
    if any(t.dtype == dt.bool_ for t in operands):
        raise ctx.fail(node, "bool operands")
    terms, out = _einsum_terms(node.attr("equation"), [t.ndim for t in operands])
    items = [_einsum_diagonal(g, t, s) for t, s in zip(operands, terms)]

    def needed(skip: set[int]) -> set[str]:
        return set(out).union(*(set(items[i][1]) for i in range(len(items)) if i not in skip))

    # letters only one operand has and the result does not keep are summed away first
    for i, (t, s) in enumerate(items):
        gone = [a for a, c in enumerate(s) if c not in needed({i})]
        if gone:
            items[i] = (g.sum(t, tuple(gone)), "".join(c for c in s if c not in set(s[a] for a in gone)))
    a, sa = items[0]
    for index in range(1, len(items)):
        b, sb = items[index]
        later = set(out).union(*(set(s) for _, s in items[index + 1:]))
        batch = [c for c in sa if c in sb and c in later]
        contract = [c for c in sa if c in sb and c not in later]
        left = [c for c in sa if c not in sb]
        right = [c for c in sb if c not in sa]
        size = {c: max(d for d in (a.shape[sa.index(c)] if c in sa else 1, b.shape[sb.index(c)] if c in sb else 1))
                for c in set(sa) | set(sb)}
        at = g.transpose(a, [sa.index(c) for c in batch + left + contract])
        bt = g.transpose(b, [sb.index(c) for c in batch + contract + right])
        want_a = tuple(size[c] if c in batch else d for c, d in zip(batch + left + contract, at.shape))
        want_b = tuple(size[c] if c in batch else d for c, d in zip(batch + contract + right, bt.shape))
        at = at if tuple(at.shape) == want_a else g.broadcast_to(at, want_a)
        bt = bt if tuple(bt.shape) == want_b else g.broadcast_to(bt, want_b)
        prod = lambda cs: int(np.prod([size[c] for c in cs], dtype=np.int64))  # noqa: E731
        y = g.matmul(g.reshape(at, (prod(batch), prod(left), prod(contract))),
                     g.reshape(bt, (prod(batch), prod(contract), prod(right))))
        a, sa = g.reshape(y, tuple(size[c] for c in batch + left + right)), "".join(batch + left + right)
    gone = tuple(i for i, c in enumerate(sa) if c not in out)
    if gone:
        a, sa = g.sum(a, gone), "".join(c for c in sa if c in out)
    if sa != out:
        a = g.transpose(a, [sa.index(c) for c in out])
    return [a]


# -- rotary embeddings, gathers, integer matmuls ------------------------------------------------------

@converter("RotaryEmbedding")
def _rotary_embedding(ctx: Context, node: OnnxNode):
    """ONNX RotaryEmbedding (opset 23) with its cos/sin caches: the rotation written out (the caches
    are the model's own, so Ingot's rope op, which makes its own, is not used)."""
    x, cos, sin, positions = node.input(0), node.input(1), node.input(2), node.input(3)
    g = ctx.g
    _float(ctx, node, x)
    four_d = x.ndim == 4
    if four_d:  # [B, H, S, D] -> [B, S, H, D]
        y = g.transpose(x, (0, 2, 1, 3))
    else:
        heads = node.attr("num_heads", 0)
        if not heads:
            raise IngotError("3-D input without num_heads")
        y = g.reshape(x, (x.shape[0], x.shape[1], heads, x.shape[2] // heads))
    head = y.shape[3]
    rd = node.attr("rotary_embedding_dim", 0) or head
    if positions is not None:
        cos, sin = g.gather(cos, positions, axis=0), g.gather(sin, positions, axis=0)   # [B, S, rd/2]
    shape = tuple(cos.shape[:-1]) + (1, rd // 2)
    cos, sin = g.reshape(cos, shape), g.reshape(sin, shape)
    rotate = y if rd == head else g.slice(y, [0, 0, 0, 0], [None, None, None, rd])
    if node.attr("interleaved", 0):
        x1 = g.slice(rotate, [0, 0, 0, 0], [None] * 4, [1, 1, 1, 2])
        x2 = g.slice(rotate, [0, 0, 0, 1], [None] * 4, [1, 1, 1, 2])
    else:
        x1, x2 = g.split(rotate, 2, axis=3)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if node.attr("interleaved", 0):
        pair = tuple(real.shape) + (1,)
        rotated = g.reshape(g.concat([g.reshape(real, pair), g.reshape(imag, pair)], axis=4), tuple(rotate.shape))
    else:
        rotated = g.concat([real, imag], axis=3)
    if rd != head:
        rotated = g.concat([rotated, g.slice(y, [0, 0, 0, rd], [None] * 4)], axis=3)
    return [g.transpose(rotated, (0, 2, 1, 3)) if four_d else g.reshape(rotated, tuple(x.shape))]


@converter("GatherND")
def _gather_nd(ctx: Context, node: OnnxNode):
    """GatherND as one gather from the flattened leading axes (flat index = index . strides)."""
    data, idx = node.inputs
    g = ctx.g
    batch = node.attr("batch_dims", 0)
    depth = idx.shape[-1]
    lead = data.shape[batch:batch + depth]
    rest = tuple(data.shape[batch + depth:])
    strides = np.array([int(np.prod(lead[i + 1:], dtype=np.int64)) for i in range(depth)], np.int64)
    idx = idx if idx.dtype == dt.int64 else g.cast(idx, dt.int64)
    idx = g.where(idx < _scalar(ctx, 0, idx), idx + g.constant(np.array(lead, np.int64)), idx)
    flat_index = g.sum(idx * g.constant(strides), (idx.ndim - 1,))                   # [*batch, *rows]
    nb = int(np.prod(data.shape[:batch], dtype=np.int64))
    flat = g.reshape(data, (nb * int(np.prod(lead, dtype=np.int64)),) + rest)
    if batch:  # each batch element reads its own block of rows
        offsets = (np.arange(nb, dtype=np.int64) * int(np.prod(lead, dtype=np.int64))).reshape(
            tuple(data.shape[:batch]) + (1,) * (flat_index.ndim - batch))
        flat_index = flat_index + g.constant(offsets)
    return [g.gather(flat, flat_index, axis=0)]


@converter("LpPool")
def _lp_pool(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    _float(ctx, node, x)
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    k = len(spatial)
    kernel = list(node.attr("kernel_shape"))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    p = float(node.attr("p", 2))
    before, after = _window_pads(node, spatial, kernel, strides, dilations)
    ceil = bool(node.attr("ceil_mode", 0))
    padded = [d + b + a for d, b, a in zip(spatial, before, after)]
    out = [_out_size(q, kk, s, d, ceil) for q, kk, s, d in zip(padded, kernel, strides, dilations)]
    need = [(o - 1) * s + d * (kk - 1) + 1 for o, s, d, kk in zip(out, strides, dilations, kernel)]
    after = [a + max(0, nd - q) for a, nd, q in zip(after, need, padded)]
    powered = g.pow(g.abs(x), _scalar(ctx, p, x)) if p != 2 else x * x
    if any(before + after):
        powered = g.pad(powered, [(0, 0), (0, 0)] + list(zip(before, after)))
    total = g.sum(_windows(g, powered, kernel, strides, dilations, out, (n, c)), tuple(range(2, 2 + k)))
    return [g.sqrt(total) if p == 2 else g.pow(total, _scalar(ctx, 1.0 / p, total))]


@converter("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: Context, node: OnnxNode):
    """uint8 quantization with the scale and zero point of x's own range (which includes 0)."""
    (x,) = node.inputs
    g = ctx.g
    _float(ctx, node, x)
    zero = _scalar(ctx, 0, x)
    lo = g.minimum(g.min(x, tuple(range(x.ndim))), zero)
    hi = g.maximum(g.max(x, tuple(range(x.ndim))), zero)
    scale = (hi - lo) / _scalar(ctx, 255, x)
    zero_point = g.quantize(g.neg(lo) / scale, dt.uint8, scale=_scalar(ctx, 1, x))   # saturate(round(-lo / scale))
    y = g.quantize(x, dt.uint8, scale=scale, zero_point=zero_point)
    return [y, scale, zero_point]


def _integer_operand(g, t: Tensor, zero: Tensor | None, axis: int | None) -> Tensor:
    """An 8-bit matmul operand as int32 with its zero point taken away (per tensor or per axis)."""
    wide = g.cast(t, dt.int32)
    if zero is None:
        return wide
    z = g.cast(zero, dt.int32)
    if z.ndim == 1 and z.shape[0] != 1 and axis is not None:
        shape = [1] * t.ndim
        shape[axis] = z.shape[0]
        z = g.reshape(z, shape)
    elif z.ndim == 1:
        z = g.reshape(z, ())
    return wide - z


@converter("MatMulInteger")
def _matmul_integer(ctx: Context, node: OnnxNode):
    a, b = node.input(0), node.input(1)
    g = ctx.g
    ai = _integer_operand(g, a, node.input(2), a.ndim - 2 if a.ndim >= 2 else None)
    bi = _integer_operand(g, b, node.input(3), b.ndim - 1)
    return [g.matmul(ai, bi)]


@converter("QLinearMatMul")
def _qlinear_matmul(ctx: Context, node: OnnxNode):
    """Dequantize both sides, multiply in float, quantize the result (a DequantizeLinear -> MatMul
    pattern the compiler fuses where the weight side is constant)."""
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = node.inputs
    g = ctx.g
    if a.dtype not in (dt.int8, dt.uint8) or b.dtype not in (dt.int8, dt.uint8):
        raise ctx.fail(node, f"inputs of type {a.dtype.name} and {b.dtype.name}")

    def dequantized(q, scale, zero, axis):
        scale = scale if scale.dtype == dt.float32 else g.cast(scale, dt.float32)
        per_axis = scale.ndim == 1 and scale.shape[0] != 1
        scale = scale if per_axis else g.reshape(scale, ())
        zero = None if zero is None else (zero if per_axis else g.reshape(zero, ()))
        return g.dequantize(q, scale=scale, zero_point=zero, axis=axis if per_axis else None)

    af = dequantized(a, a_scale, a_zero, a.ndim - 2)
    bf = dequantized(b, b_scale, b_zero, b.ndim - 1)
    y = g.matmul(af, bf)
    ys = g.reshape(y_scale if y_scale.dtype == dt.float32 else g.cast(y_scale, dt.float32), ())
    return [g.quantize(y, y_zero.dtype, scale=ys, zero_point=g.reshape(y_zero, ()))]
