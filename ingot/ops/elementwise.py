"""Elementwise ops: NumPy broadcasting, no implicit dtype promotion."""
from __future__ import annotations

import math
from functools import cache

import numpy as np

from .. import dtypes as dt
from ..ir import GroupOp, Op, TensorType
from . import broadcast_shapes, fail, register


@cache
def _erf_ufunc():
    import numba  # on first use: importing numba costs a third of a second

    return numba.vectorize(["float32(float32)", "float64(float64)"], cache=True)(lambda x: math.erf(x))


def erf(x):
    """erf elementwise (NumPy has none; numba's math.erf is the C library's)."""
    return _erf_ufunc()(x)


def _lowp(fn):
    """Compute float16/bfloat16 in float32 and round back, as the GPU kernels do."""
    def wrapped(*xs):
        x0 = xs[0]
        # (itemsize first: dtype.name runs Python code in NumPy, ~2 us a call, 30+ with cold caches)
        if x0.dtype.itemsize == 2 and (x0.dtype == np.float16 or x0.dtype.name == "bfloat16"):
            out = fn(*(x.astype(np.float32) if x.dtype == x0.dtype else x for x in xs))
            return np.asarray(out).astype(x0.dtype)
        return fn(*xs)
    return wrapped


def _gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))
    return 0.5 * x * (1.0 + erf(x / np.float32(math.sqrt(2.0))))


def _sigmoid(x):
    # numerically stable for large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def divide(a, b):
    """True division for floats; integers divide rounding toward zero (C, ONNX Div, CUDA), keeping their dtype."""
    if a.dtype.kind not in "iu":
        return np.divide(a, b)
    with np.errstate(divide="ignore"):
        q = np.floor_divide(a, b)
        return q + ((np.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)


# NumPy ufuncs (the CPU backend calls them with out=); the references below differ only for integer DIV
BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide, Op.POW: np.power,
    Op.MAXIMUM: np.maximum, Op.MINIMUM: np.minimum,
}
BINARY_REFERENCE = {**BINARY, Op.DIV: divide}
COMPARE = {
    Op.EQUAL: np.equal, Op.NOT_EQUAL: np.not_equal, Op.LESS: np.less, Op.LESS_EQUAL: np.less_equal,
    Op.GREATER: np.greater, Op.GREATER_EQUAL: np.greater_equal,
}
LOGICAL = {Op.LOGICAL_AND: np.logical_and, Op.LOGICAL_OR: np.logical_or, Op.LOGICAL_XOR: np.logical_xor}
UNARY = {
    Op.NEG: np.negative, Op.ABS: np.abs, Op.EXP: np.exp, Op.LOG: np.log, Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1 / np.sqrt(x), Op.TANH: np.tanh, Op.SIGMOID: _sigmoid,
    Op.SILU: lambda x: x * _sigmoid(x), Op.ERF: erf, Op.SIN: np.sin, Op.COS: np.cos,
}
FLOAT_ONLY = {Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.TANH, Op.SIGMOID, Op.SILU, Op.GELU, Op.ERF, Op.SIN, Op.COS}
NUMERIC_ONLY = {Op.NEG, Op.ABS}  # not bool: use logical_not
COMPLEX_OK = {Op.NEG, Op.EXP, Op.ABS, Op.SIN, Op.COS, Op.SQRT, Op.LOG}


def _no_packed(op, types):
    if any(t.dtype.packed for t in types):
        raise fail(op, types, "unpacked dtypes (dequantize or cast 4-bit tensors first)")


def _binary_rule(op):
    def rule(types, attrs):
        _no_packed(op, types)
        if types[0].dtype != types[1].dtype:
            raise fail(op, types, "two inputs of the same dtype")
        if types[0].dtype == dt.bool_ and op not in (Op.MAXIMUM, Op.MINIMUM) and op not in GroupOp.Compare:
            raise fail(op, types, "numeric inputs (logical ops take bools)")
        shape = broadcast_shapes(op, types)
        return TensorType(shape, dt.bool_ if op in GroupOp.Compare or op in GroupOp.Logical else types[0].dtype)
    return rule


def _logical_rule(op):
    def rule(types, attrs):
        if any(t.dtype != dt.bool_ for t in types):
            raise fail(op, types, "bool inputs")
        return TensorType(broadcast_shapes(op, types), dt.bool_)
    return rule


def _unary_rule(op):
    def rule(types, attrs):
        (t,) = types
        _no_packed(op, types)
        if op == Op.LOGICAL_NOT:
            if t.dtype != dt.bool_:
                raise fail(op, types, "a bool input")
            return t
        if op in NUMERIC_ONLY and t.dtype == dt.bool_:
            raise fail(op, types, "a numeric input (logical_not negates bools)")
        if op in FLOAT_ONLY and not t.dtype.is_float and not (t.dtype == dt.complex64 and op in COMPLEX_OK):
            raise fail(op, types, "a floating-point input")
        if op == Op.ABS and t.dtype == dt.complex64:
            return TensorType(t.shape, dt.float32)
        return t
    return rule


for _op, _fn in BINARY_REFERENCE.items():
    register(_op, _binary_rule(_op), lambda xs, a, _fn=_fn: _lowp(_fn)(xs[0], xs[1]))
for _op, _fn in COMPARE.items():
    register(_op, _binary_rule(_op), lambda xs, a, _fn=_fn: _fn(xs[0], xs[1]))
for _op, _fn in LOGICAL.items():
    register(_op, _logical_rule(_op), lambda xs, a, _fn=_fn: _fn(xs[0], xs[1]))
for _op, _fn in UNARY.items():
    register(_op, _unary_rule(_op), lambda xs, a, _fn=_fn: np.asarray(_lowp(_fn)(xs[0])))
register(Op.GELU, _unary_rule(Op.GELU), lambda xs, a: _lowp(lambda x: _gelu(x, a.get("approximate", "none")))(xs[0]))
register(Op.LOGICAL_NOT, _unary_rule(Op.LOGICAL_NOT), lambda xs, a: np.logical_not(xs[0]))


def _cast_rule(types, attrs):
    (t,) = types
    if t.dtype.packed or attrs["dtype"].packed:
        raise fail(Op.CAST, types, "no 4-bit types (use quantize and dequantize for those)")
    return TensorType(t.shape, attrs["dtype"])


def _cast(xs, attrs):
    (x,) = xs
    target: dt.DType = attrs["dtype"]
    if target == dt.bool_:
        return x != 0
    if x.dtype.kind == "c" and target != dt.complex64:
        x = x.real
    return x.astype(target.numpy)


register(Op.CAST, _cast_rule, _cast)


def _where_rule(types, attrs):
    c, a, b = types
    if c.dtype != dt.bool_:
        raise fail(Op.WHERE, types, "a bool condition")
    if a.dtype != b.dtype:
        raise fail(Op.WHERE, types, "two branches of the same dtype")
    return TensorType(broadcast_shapes(Op.WHERE, types), a.dtype)


register(Op.WHERE, _where_rule, lambda xs, a: np.where(xs[0], xs[1], xs[2]))


def _complex_part_rule(types, attrs):
    (t,) = types
    if t.dtype != dt.complex64:
        raise fail("real/imag", types, "a complex64 input")
    return TensorType(t.shape, dt.float32)


register(Op.REAL, _complex_part_rule, lambda xs, a: np.ascontiguousarray(xs[0].real))
register(Op.IMAG, _complex_part_rule, lambda xs, a: np.ascontiguousarray(xs[0].imag))


def _complex_rule(types, attrs):
    if any(t.dtype != dt.float32 for t in types):
        raise fail(Op.COMPLEX, types, "two float32 inputs (real, imaginary)")
    return TensorType(broadcast_shapes(Op.COMPLEX, types), dt.complex64)


register(Op.COMPLEX, _complex_rule, lambda xs, a: (xs[0] + 1j * xs[1]).astype(np.complex64))


# -- ONNX breadth: more unary math, bitwise ops, and casts to formats Ingot stores wider --------------

MORE_UNARY = {
    Op.FLOOR: np.floor, Op.CEIL: np.ceil, Op.ROUND: np.round,   # np.round: halves to even, as ONNX Round
    Op.TAN: np.tan, Op.ASIN: np.arcsin, Op.ACOS: np.arccos, Op.ATAN: np.arctan, Op.SINH: np.sinh, Op.COSH: np.cosh,
    Op.ASINH: np.arcsinh, Op.ACOSH: np.arccosh, Op.ATANH: np.arctanh,
}


def _float_unary_rule(op):
    def rule(types, attrs):
        (t,) = types
        if not t.dtype.is_float:
            raise fail(op, types, "a floating-point input")
        return t
    return rule


for _op, _fn in MORE_UNARY.items():
    register(_op, _float_unary_rule(_op), lambda xs, a, _fn=_fn: np.asarray(_lowp(_fn)(xs[0])))

BITWISE = {Op.BITWISE_AND: np.bitwise_and, Op.BITWISE_OR: np.bitwise_or, Op.BITWISE_XOR: np.bitwise_xor}


def _bitwise_rule(op):
    def rule(types, attrs):
        _no_packed(op, types)
        if any(not t.dtype.is_int for t in types) or len({t.dtype for t in types}) != 1:
            raise fail(op, types, "integer inputs of one dtype")
        return TensorType(broadcast_shapes(op, types), types[0].dtype)
    return rule


def _shift(left: bool):
    """Shifts as ONNX BitShift defines them: attrs["bits"] is the width of the values when they are held
    in a wider dtype (ONNX's uint16 in int32), attrs["signed"] whether they are signed (default: the
    dtype's). Left shifts wrap; right shifts of signed values are arithmetic; a shift by a negative
    amount or by the width or more gives 0 (-1 for a negative value shifted right)."""
    def ref(xs, attrs):
        x, n = np.broadcast_arrays(*(np.asarray(v) for v in xs))
        full = 8 * x.dtype.itemsize
        width = attrs.get("bits") or full
        signed = attrs.get("signed", x.dtype.kind == "i")
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        valid = (n >= 0) & (n < width)
        amount = np.where(valid, n, 0).astype(unsigned)
        if left:
            out = np.left_shift(x.astype(unsigned), amount)
            if width < full:
                out &= unsigned.type((1 << width) - 1)
                if signed:   # sign-extend the narrow value into the wide dtype
                    sign = unsigned.type(1 << (width - 1))
                    out = (out ^ sign).astype(x.dtype) - x.dtype.type(1 << (width - 1))
            return np.where(valid, out.astype(x.dtype), x.dtype.type(0))
        if signed:
            return np.where(valid, np.right_shift(x, amount.astype(x.dtype)), np.where(x < 0, x.dtype.type(-1), x.dtype.type(0)))
        return np.where(valid, np.right_shift(x.astype(unsigned), amount).astype(x.dtype), x.dtype.type(0))
    return ref


def _mod(xs, attrs):
    a, b = xs
    return (np.fmod if attrs.get("fmod") else np.mod)(a, b)


register(Op.MOD, _binary_rule(Op.MOD), lambda xs, a: np.asarray(_lowp(lambda p, q: _mod((p, q), a))(xs[0], xs[1])))


for _op, _fn in BITWISE.items():
    register(_op, _bitwise_rule(_op), lambda xs, a, _fn=_fn: _fn(xs[0], xs[1]))
register(Op.BITWISE_NOT, lambda types, a: _bitwise_rule(Op.BITWISE_NOT)(types, a), lambda xs, a: np.invert(xs[0]))
register(Op.SHIFT_LEFT, _bitwise_rule(Op.SHIFT_LEFT), _shift(True))
register(Op.SHIFT_RIGHT, _bitwise_rule(Op.SHIFT_RIGHT), _shift(False))


NARROW_FORMATS = {   # format -> the Ingot dtype its values are held in
    "float8_e4m3fn": dt.float32, "float8_e4m3fnuz": dt.float32, "float8_e5m2": dt.float32,
    "float8_e5m2fnuz": dt.float32, "float8_e8m0fnu": dt.float32, "float4_e2m1fn": dt.float32,
    "int4": dt.int8, "uint4": dt.uint8, "int2": dt.int8, "uint2": dt.uint8,
}


def _narrow_cast_rule(types, attrs):
    (t,) = types
    _no_packed(Op.NARROW_CAST, types)
    if attrs["format"] not in NARROW_FORMATS:
        raise fail(Op.NARROW_CAST, types, f"a format of {sorted(NARROW_FORMATS)}, not {attrs['format']!r}")
    if t.dtype == dt.complex64:
        raise fail(Op.NARROW_CAST, types, "a real input")
    return TensorType(t.shape, NARROW_FORMATS[attrs["format"]])


def _to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float32 -> float8_e8m0fnu (a power of two: the float32 exponent alone), rounding the mantissa
    away by round_mode ("up", "down" or "nearest"); NaN and infinity become NaN (its one special)."""
    import ml_dtypes

    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    mantissa = bits & 0x7FFFFF
    special = exponent == 0xFF
    if round_mode == "up":
        up = mantissa > 0
    elif round_mode == "nearest":   # halfway rounds up unless the exponent is 0 (even)
        half = (mantissa & 0x400000) > 0
        up = half & (((mantissa & 0x3FFFFF) > 0) | (exponent > 0))
    else:
        up = np.zeros_like(special)
    if saturate:
        up &= exponent != 0xFE
    exponent = np.where(special, 0xFF, np.minimum(exponent + up, 0xFF))
    return exponent.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def narrow_cast(x: np.ndarray, format: str, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """x's values as the narrow `format` (an ml_dtypes name) represents them, as ONNX Cast defines:
    float8 formats saturate to their largest finite value when `saturate` (else overflow to
    infinity, or NaN where the format has none); integers wrap as NumPy's cast does."""
    import ml_dtypes

    target = np.dtype(getattr(ml_dtypes, format))
    if x.dtype.kind == "V" or x.dtype == np.float16 or x.dtype.name == "bfloat16":
        x = x.astype(np.float32)
    if format == "float8_e8m0fnu":
        y = _to_e8m0(x, saturate, round_mode)
    elif saturate and format.startswith("float8"):
        info = ml_dtypes.finfo(target)
        y = np.clip(x, info.min, info.max).astype(target)
    else:
        y = x.astype(target)
    return y.astype(NARROW_FORMATS[format].numpy)


register(Op.NARROW_CAST, _narrow_cast_rule,
         lambda xs, a: narrow_cast(xs[0], a["format"], a.get("saturate", True), a.get("round_mode", "up")))


def _bitcast_rule(types, attrs):
    """bitcast: attrs "source" and "target" name the NumPy dtypes whose bits are reinterpreted (the same
    size); "dtype" is the Ingot dtype that holds the result (an ONNX uint16 in int32, say)."""
    (t,) = types
    source, target = np.dtype(attrs["source"]), np.dtype(attrs["target"])
    if t.dtype.packed or source.itemsize != target.itemsize:
        raise fail(Op.BITCAST, types, f"types of one size, not {source} and {target}")
    return TensorType(t.shape, attrs["dtype"])


register(Op.BITCAST, _bitcast_rule, lambda xs, a: np.array(xs[0], copy=True).astype(a["source"]).view(a["target"])
         .astype(a["dtype"].storage))
