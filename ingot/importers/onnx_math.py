"""ONNX converters for elementwise math, activations, reductions, index arithmetic (Mod, OneHot,
CumSum, Hardmax) and Einsum."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ir import Op
from ..ops import normalize_axis
from .onnx_ops import (CONVERTERS, NARROW_TYPES, ONNX_DTYPES, Context, OnnxNode, converter, ints, need_float, onnx_to_ingot_dtype,
                       scalar)

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
    if v is not None and v.size == 1 and float(v.reshape(-1)[0]) == 3.0 and v.ndim <= x.ndim and x.dtype.is_float:
        return [x * x * x]  # GELU's cube (T5, GPT-2) as onnxruntime computes it: libm's powf took 60 ns an element
    return [ctx.g.pow(x, y)]


_UNARY = {"Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Tanh": "tanh", "Sigmoid": "sigmoid",
          "Erf": "erf", "Sin": "sin", "Cos": "cos", "Not": "logical_not"}


@converter(*_UNARY)
def _unary(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    if node.op_type in ("Abs", "Neg") and x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    return [getattr(ctx.g, _UNARY[node.op_type])(x)]


_MORE_UNARY = {"Floor": Op.FLOOR, "Ceil": Op.CEIL, "Round": Op.ROUND, "Tan": Op.TAN, "Asin": Op.ASIN, "Acos": Op.ACOS,
               "Atan": Op.ATAN, "Sinh": Op.SINH, "Cosh": Op.COSH, "Asinh": Op.ASINH, "Acosh": Op.ACOSH, "Atanh": Op.ATANH}


@converter(*_MORE_UNARY)
def _more_unary(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    need_float(ctx, node, x)
    return [ctx.g.op(_MORE_UNARY[node.op_type], [x])]


_BITWISE = {"BitwiseAnd": Op.BITWISE_AND, "BitwiseOr": Op.BITWISE_OR, "BitwiseXor": Op.BITWISE_XOR}


@converter(*_BITWISE, "BitwiseNot", "BitShift")
def _bitwise(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    if not x.dtype.is_int:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    if node.op_type == "BitwiseNot":
        return [ctx.g.op(Op.BITWISE_NOT, [x])]
    y = node.inputs[1]
    if node.op_type in _BITWISE:
        return [ctx.g.op(_BITWISE[node.op_type], [x, y])]
    direction = node.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.fail(node, f"direction {direction!r} (LEFT or RIGHT)")
    # ONNX shifts unsigned integers only; uint16/uint32/uint64 are held in int32/int64: shift their bits
    declared = ctx.onnx_dtype(x)
    attrs = {"bits": 8 * declared.itemsize, "signed": declared.kind == "i"} if declared != x.dtype.storage else {}
    return [ctx.g.op(Op.SHIFT_LEFT if direction == "LEFT" else Op.SHIFT_RIGHT, [x, y], attrs)]


@converter("Identity")
def _identity(ctx: Context, node: OnnxNode):
    return [node.inputs[0]]


@converter("Reciprocal")
def _reciprocal(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    need_float(ctx, node, x)
    return [ctx.g.div(scalar(ctx, 1, x), x)]


@converter("Relu")
def _relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.maximum(x, scalar(ctx, 0, x))]


@converter("LeakyRelu")
def _leaky_relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 0.01)
    return [g.where(x < scalar(ctx, 0, x), x * scalar(ctx, alpha, x), x)]


@converter("PRelu")
def _prelu(ctx: Context, node: OnnxNode):
    x, slope = node.inputs
    g = ctx.g
    return [g.where(x < scalar(ctx, 0, x), x * slope, x)]


@converter("Elu")
def _elu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 1.0)
    return [g.where(x < scalar(ctx, 0, x), (g.exp(x) - scalar(ctx, 1, x)) * scalar(ctx, alpha, x), x)]


@converter("Selu")
def _selu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    alpha, gamma = node.attr("alpha", 1.67326319217681884765625), node.attr("gamma", 1.05070102214813232421875)
    neg = g.exp(x) * scalar(ctx, alpha, x) - scalar(ctx, alpha, x)
    return [g.where(x <= scalar(ctx, 0, x), neg, x) * scalar(ctx, gamma, x)]


@converter("Celu")
def _celu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g, alpha = ctx.g, node.attr("alpha", 1.0)
    neg = (g.exp(x / scalar(ctx, alpha, x)) - scalar(ctx, 1, x)) * scalar(ctx, alpha, x)
    return [g.maximum(x, scalar(ctx, 0, x)) + g.minimum(neg, scalar(ctx, 0, x))]


@converter("HardSigmoid")
def _hard_sigmoid(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [_hard_sigmoid_of(ctx, x, node.attr("alpha", 0.2), node.attr("beta", 0.5))]


def _hard_sigmoid_of(ctx: Context, x: Tensor, alpha: float, beta: float) -> Tensor:
    g = ctx.g
    y = x * scalar(ctx, alpha, x) + scalar(ctx, beta, x)
    return g.maximum(g.minimum(y, scalar(ctx, 1, x)), scalar(ctx, 0, x))


@converter("HardSwish")
def _hard_swish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x * _hard_sigmoid_of(ctx, x, 1.0 / 6.0, 0.5)]


def _softplus_of(ctx: Context, x: Tensor) -> Tensor:
    g = ctx.g  # max(x, 0) + log(1 + exp(-|x|)): no overflow for large |x|
    return g.maximum(x, scalar(ctx, 0, x)) + g.log(g.exp(g.neg(g.abs(x))) + scalar(ctx, 1, x))


@converter("Softplus")
def _softplus(ctx: Context, node: OnnxNode):
    return [_softplus_of(ctx, node.inputs[0])]


@converter("Softsign")
def _softsign(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x / (ctx.g.abs(x) + scalar(ctx, 1, x))]


@converter("Mish")
def _mish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [x * ctx.g.tanh(_softplus_of(ctx, x))]


@converter("ThresholdedRelu")
def _thresholded_relu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.where(x > scalar(ctx, node.attr("alpha", 1.0), x), x, scalar(ctx, 0, x))]


@converter("Gelu")
def _gelu(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    need_float(ctx, node, x)
    return [ctx.g.gelu(x, approximate=node.attr("approximate", "none"))]


@converter("Sign")
def _sign(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    zero, one = scalar(ctx, 0, x), scalar(ctx, 1, x)
    if x.dtype.kind == "u":
        return [g.where(x > zero, one, zero)]
    return [g.where(x > zero, one, g.where(x < zero, scalar(ctx, -1, x), zero))]


@converter("IsNaN")
def _isnan(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    return [ctx.g.not_equal(x, x)]


@converter("IsInf")
def _isinf(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    pos, neg = g.equal(x, scalar(ctx, np.inf, x)), g.equal(x, scalar(ctx, -np.inf, x))
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
        lo = None if lo is None else scalar(ctx, lo, x)
        hi = None if hi is None else scalar(ctx, hi, x)
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
    return [out / scalar(ctx, len(node.inputs), out)]


@converter("Where")
def _where(ctx: Context, node: OnnxNode):
    c, a, b = node.inputs
    return [ctx.g.where(c, a, b)]


WEIGHT_ELEMENTS = 4096   # an 8-bit constant matrix this large is a weight


@converter("Cast")
def _cast(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    elem = node.attr("to")
    target = onnx_to_ingot_dtype(ctx, node, elem, narrow=True)
    if x.node.op == Op.CONSTANT and x.dtype in (dt.int8, dt.uint8) and x.ndim == 2 and x.type.size >= WEIGHT_ELEMENTS \
            and target == dt.float32 and elem not in NARROW_TYPES and ctx.onnx_dtype(x) == x.dtype.storage:
        # an 8-bit weight widened by hand (weight-only quantization written as Cast, then Mul by its scales): a
        # dequantize, which the compiler keeps 8-bit under a matmul (passes/fuse_dequant.py takes the Mul in)
        return [ctx.g.dequantize(x, scale=ctx.g.constant(np.float32(1)))]
    return [ctx.declare(_cast_to(ctx, node, x, target, NARROW_TYPES.get(elem)), elem)]


@converter("CastLike")
def _cast_like(ctx: Context, node: OnnxNode):
    x, like = node.inputs
    return [ctx.declare(_cast_to(ctx, node, x, like.dtype, ctx.narrow_format(like)), ctx.onnx_dtype(like))]


def _cast_to(ctx: Context, node: OnnxNode, x: Tensor, target: dt.DType, narrow: str | None) -> Tensor:
    """x cast to `target`; to the values of a narrow format (float8, int4, ...) held in `target` when
    `narrow` names one (ONNX's saturate and round_mode attributes apply to those)."""
    if x.dtype == dt.complex64:
        raise ctx.fail(node, "a complex input")
    if narrow is None:
        return x if x.dtype == target else ctx.g.cast(x, target)
    if ctx.narrow_format(x) == narrow:
        return x
    return ctx.g.op(Op.NARROW_CAST, [x], {"format": narrow, "saturate": bool(node.attr("saturate", 1)),
                                           "round_mode": node.attr("round_mode", "up")})


def _reduce_axes(ctx: Context, node: OnnxNode, x: Tensor, input_since: int) -> tuple[int, ...] | None:
    """The axes to reduce, or None for 'no reduction' (noop_with_empty_axes)."""
    if node.opset >= input_since:
        axes = ints(ctx.constant(node, 1, "axes")) if node.input(1) is not None else []
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
        if x.dtype == dt.bool_:
            raise ctx.fail(node, "a bool input")
        return [g.op(Op.PROD, [x], {"axes": axes, "keepdims": keep})]
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
        need_float(ctx, node, x)
        return [g.sqrt(g.sum(x * x, axes, keep))]
    need_float(ctx, node, x)
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
        idx = scalar(ctx, n - 1, fn(flipped, axis, keep)) - fn(flipped, axis, keep)
    else:
        idx = fn(x, axis, keep)
    return [g.cast(idx, dt.int64)]


@converter("Mod")
def _mod(ctx: Context, node: OnnxNode):
    a, b = node.inputs
    g = ctx.g
    fmod = node.attr("fmod", 0)
    if a.dtype.is_float:   # fmod: C's fmod (the dividend's sign); else Python's % (the divisor's)
        return [g.op(Op.MOD, [a, b], {"fmod": bool(fmod)})]
    if not a.dtype.is_int:
        raise ctx.fail(node, f"input of type {a.dtype.name}")
    r = a - g.div(a, b) * b  # Ingot's integer division truncates: r takes the dividend's sign (C's %)
    if fmod:
        return [r]
    zero = scalar(ctx, 0, r)
    wrong_sign = g.logical_and(g.not_equal(r, zero), g.logical_xor(r < zero, b < scalar(ctx, 0, b)))
    return [g.where(wrong_sign, r + b, r)]


@converter("Swish")
def _swish(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    need_float(ctx, node, x)
    alpha = node.attr("alpha", 1.0)
    return [x * ctx.g.sigmoid(x if alpha == 1.0 else x * scalar(ctx, alpha, x))]


@converter("LpNormalization")
def _lp_normalization(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
    axis, p = node.attr("axis", -1), node.attr("p", 2)
    if p not in (1, 2):
        raise ctx.fail(node, f"p={p}")
    norm = g.sum(g.abs(x), axis, keepdims=True) if p == 1 else g.sqrt(g.sum(x * x, axis, keepdims=True))
    zero = scalar(ctx, 0, x)
    return [g.where(g.equal(norm, zero), zero, x / norm)]


def _positions(ctx: Context, n: int, rank: int, axis: int, dtype: dt.DType) -> Tensor:
    """arange(n) shaped to lie along `axis` of a rank-`rank` tensor."""
    shape = [1] * rank
    shape[axis] = n
    ctx.g.check_elements(n, f"{ctx.what}: a table of {n} positions")
    return ctx.g.constant(np.arange(n, dtype=dtype.numpy).reshape(shape))


@converter("Hardmax")
def _hardmax(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
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
    if depth < 1:
        raise IngotError(f"depth {depth} is not positive")
    ctx.check_elements(node, list(indices.shape) + [depth])
    idx = indices if indices.dtype == dt.int64 else g.cast(indices, dt.int64)
    idx = g.where(idx < scalar(ctx, 0, idx), idx + scalar(ctx, depth, idx), idx)
    rank = idx.ndim + 1
    axis = normalize_axis("OneHot", node.attr("axis", -1), rank)
    shape = list(idx.shape)
    shape.insert(axis, 1)
    hot = g.equal(g.reshape(idx, shape), _positions(ctx, depth, rank, axis, dt.int64))
    off, on = g.split(values, 2, axis=0)
    return [g.where(hot, g.reshape(on, ()), g.reshape(off, ()))]


@converter("CumProd")
def _cumprod(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    if x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    axis = normalize_axis("CumProd", int(np.asarray(ctx.constant(node, 1, "axis")).reshape(-1)[0]), x.ndim)
    return [ctx.g.op(Op.CUMPROD, [x], {"axis": axis, "exclusive": bool(node.attr("exclusive", 0)),
                                       "reverse": bool(node.attr("reverse", 0))})]


@converter("Det")
def _det(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    need_float(ctx, node, x)
    return [ctx.g.op(Op.DET, [x])]


@converter("BitCast")
def _bitcast(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    elem = node.attr("to")
    target = onnx_to_ingot_dtype(ctx, node, elem)
    source_type, target_type = ctx.onnx_dtype(x), ONNX_DTYPES[elem][1]
    if source_type.itemsize != target_type.itemsize or (source_type.kind == "f" and x.dtype.storage != source_type):
        # a double held in float32 has lost the bits a bitcast would read
        raise ctx.fail(node, f"a bitcast from {source_type} to {target_type}")
    y = ctx.g.op(Op.BITCAST, [x], {"source": source_type.name, "target": target_type.name, "dtype": target})
    return [ctx.declare(y, elem)]


@converter("CumSum")
def _cumsum(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype == dt.bool_:
        raise ctx.fail(node, "a bool input")
    axis = normalize_axis("CumSum", int(np.asarray(ctx.constant(node, 1, "axis")).reshape(-1)[0]), x.ndim)
    n = x.shape[axis]
    ctx.check_elements(node, (n, n), "its summation matrix")
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    exclusive, reverse = node.attr("exclusive", 0), node.attr("reverse", 0)
    take = (i > j if exclusive else i >= j) if reverse else (i < j if exclusive else i <= j)  # y_j = sum_i x_i take[i, j]
    perm = [a for a in range(x.ndim) if a != axis] + [axis]
    moved = x if axis == x.ndim - 1 else g.transpose(x, perm)
    y = g.matmul(moved, g.constant(take.astype(x.dtype.numpy)))
    return [y if axis == x.ndim - 1 else g.transpose(y, [perm.index(a) for a in range(x.ndim)])]


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


@converter("TopK")
def _top_k(ctx: Context, node: OnnxNode):
    """TopK for small k as k rounds of arg-max (or min): take the best, mask it out, repeat. Ties
    go to the lower index, as ONNX asks; the result is sorted."""
    x = node.inputs[0]
    g = ctx.g
    k = int(np.asarray(ctx.constant(node, 1, "K")).reshape(-1)[0]) if node.opset >= 10 else node.attr("k")
    axis = normalize_axis("TopK", node.attr("axis", -1), x.ndim)
    largest = bool(node.attr("largest", 1))
    if k > 64 or not (x.dtype.is_float or x.dtype.is_int) or not node.attr("sorted", 1):
        raise ctx.fail(node, f"k={k} > 64, a {x.dtype.name} input or sorted=0")
    n = x.shape[axis]
    positions = _positions(ctx, n, x.ndim, axis, dt.int32)
    spent = scalar(ctx, (-np.inf if largest else np.inf) if x.dtype.is_float else
                   (np.iinfo(x.dtype.numpy).min if largest else np.iinfo(x.dtype.numpy).max), x)
    values, indices, rest = [], [], x
    for _ in range(k):
        best = (g.argmax if largest else g.argmin)(rest, axis, keepdims=True)         # int32 [.., 1, ..]
        hot = g.equal(best, positions)
        values.append(g.sum(g.where(hot, x, scalar(ctx, 0, x)), (axis,), keepdims=True))
        indices.append(g.cast(best, dt.int64))
        rest = g.where(hot, spent, rest)
    if k == 0:
        shape = tuple(0 if a == axis else d for a, d in enumerate(x.shape))
        return [g.constant(np.zeros(shape, x.dtype.numpy)), g.constant(np.zeros(shape, np.int64))]
    return [g.concat(values, axis) if k > 1 else values[0], g.concat(indices, axis) if k > 1 else indices[0]]


# -- losses ---------------------------------------------------------------------------------------

def _nll(ctx: Context, node: OnnxNode, x: Tensor, target: Tensor, weight: Tensor | None) -> Tensor:
    """ONNX's negative log-likelihood over [N, C, d...] (the class picked by a one-hot, not a gather)."""
    g = ctx.g
    c = x.shape[1]
    ignore = node.attr("ignore_index")
    reduction = node.attr("reduction", "mean")
    target = target if target.dtype == dt.int64 else g.cast(target, dt.int64)
    hot = g.equal(g.reshape(target, (target.shape[0], 1) + tuple(target.shape[1:])), _positions(ctx, c, x.ndim, 1, dt.int64))
    zero = scalar(ctx, 0, x)
    loss = g.neg(g.sum(g.where(hot, x, zero), (1,)))                                     # [N, d...]
    valid = None if ignore is None else g.not_equal(target, scalar(ctx, ignore, target))
    if weight is not None:
        per_class = g.reshape(weight, (1, c) + (1,) * (x.ndim - 2))
        taken = g.sum(g.where(hot, g.broadcast_to(per_class, tuple(x.shape)), zero), (1,))
        taken = taken if valid is None else g.where(valid, taken, zero)
        loss = loss * taken
    else:
        taken = g.cast(valid, x.dtype) if valid is not None else None
        if valid is not None:
            loss = g.where(valid, loss, zero)
    axes = tuple(range(loss.ndim))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return g.sum(loss, axes)
    if taken is None or (weight is None and ignore == -1):  # ONNX's reference averages over every element then
        return g.mean(loss, axes)
    return g.sum(loss, axes) / g.sum(taken, axes)


@converter("NegativeLogLikelihoodLoss")
def _nll_loss(ctx: Context, node: OnnxNode):
    x, target, weight = node.input(0), node.input(1), node.input(2)
    need_float(ctx, node, x)
    if x.ndim < 2:
        raise IngotError(f"an input of rank {x.ndim} (need [N, C, ...])")
    return [_nll(ctx, node, x, target, weight)]


@converter("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(ctx: Context, node: OnnxNode):
    scores, labels, weight = node.input(0), node.input(1), node.input(2)
    need_float(ctx, node, scores)
    log_prob = ctx.g.log_softmax(scores, axis=1)
    return [_nll(ctx, node, log_prob, labels, weight), log_prob]
