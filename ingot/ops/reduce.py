"""Reductions over any axes, and softmax / log_softmax along one axis."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import compute_dtype, fail, register


def _reduce_rule(op):
    def rule(types, attrs):
        (t,) = types
        if t.dtype.packed or t.dtype == dt.complex64 and op not in (Op.SUM, Op.MEAN):
            raise fail(op, types, "a real, unpacked input")
        axes = attrs["axes"]
        if any(not 0 <= a < t.rank for a in axes) or len(set(axes)) != len(axes):
            raise fail(op, types, f"distinct axes within rank {t.rank}, not {axes}")
        if op in (Op.ARGMAX, Op.ARGMIN) and len(axes) != 1:
            raise fail(op, types, "exactly one axis")
        if op == Op.MEAN and not (t.dtype.is_float or t.dtype == dt.complex64):
            raise fail(op, types, "a floating-point input")
        if any(t.shape[a] == 0 for a in axes) and op in (Op.MAX, Op.MIN, Op.ARGMAX, Op.ARGMIN):
            raise fail(op, types, "non-empty reduced axes")
        keep = attrs.get("keepdims", False)
        shape = tuple(1 if i in axes else d for i, d in enumerate(t.shape) if keep or i not in axes)
        dtype = dt.int32 if op in (Op.ARGMAX, Op.ARGMIN) else t.dtype
        if op == Op.SUM and t.dtype == dt.bool_:
            dtype = dt.int32
        return TensorType(shape, dtype)
    return rule


def _reduce_ref(fn, cast_back=True):
    def ref(xs, attrs):
        (x,) = xs
        out = fn(x.astype(compute_dtype(x)), axis=tuple(attrs["axes"]), keepdims=attrs.get("keepdims", False))
        return np.asarray(out).astype(x.dtype if cast_back else np.int32)
    return ref


def _arg_ref(fn):
    def ref(xs, attrs):
        (x,) = xs
        (axis,) = attrs["axes"]
        out = fn(x, axis=axis, keepdims=attrs.get("keepdims", False))
        return np.asarray(out).astype(np.int32)
    return ref


def _sum_ref(xs, attrs):
    (x,) = xs
    out = np.sum(x.astype(compute_dtype(x)), axis=tuple(attrs["axes"]), keepdims=attrs.get("keepdims", False))
    return np.asarray(out).astype(np.int32 if x.dtype == np.bool_ else x.dtype)


register(Op.SUM, _reduce_rule(Op.SUM), _sum_ref)
register(Op.MEAN, _reduce_rule(Op.MEAN), _reduce_ref(np.mean))
register(Op.MAX, _reduce_rule(Op.MAX), _reduce_ref(np.max))
register(Op.MIN, _reduce_rule(Op.MIN), _reduce_ref(np.min))
register(Op.PROD, _reduce_rule(Op.PROD), _reduce_ref(np.prod))
register(Op.ARGMAX, _reduce_rule(Op.ARGMAX), _arg_ref(np.argmax))
register(Op.ARGMIN, _reduce_rule(Op.ARGMIN), _arg_ref(np.argmin))


def _softmax_rule(op):
    def rule(types, attrs):
        (t,) = types
        if not t.dtype.is_float:
            raise fail(op, types, "a floating-point input")
        if not 0 <= attrs["axis"] < t.rank:
            raise fail(op, types, f"an axis within rank {t.rank}")
        return t
    return rule


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xf = x.astype(compute_dtype(x))
    if xf.size == 0:  # an empty tensor (an ONNX Tile by 0, say): nothing to normalise, no max to take
        return np.empty(x.shape, x.dtype)
    e = np.exp(xf - np.max(xf, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(x.dtype)


def log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xf = x.astype(compute_dtype(x))
    if xf.size == 0:
        return np.empty(x.shape, x.dtype)
    shifted = xf - np.max(xf, axis=axis, keepdims=True)
    return (shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))).astype(x.dtype)


register(Op.SOFTMAX, _softmax_rule(Op.SOFTMAX), lambda xs, a: softmax(xs[0], a["axis"]))
register(Op.LOG_SOFTMAX, _softmax_rule(Op.LOG_SOFTMAX), lambda xs, a: log_softmax(xs[0], a["axis"]))


def _cumprod_rule(types, attrs):
    (t,) = types
    if t.dtype.packed or t.dtype == dt.bool_ or not 0 <= attrs["axis"] < max(t.rank, 1):
        raise fail(Op.CUMPROD, types, f"a numeric input with axis {attrs['axis']} within its rank")
    return t


def _cumprod(xs, attrs):
    """Products along an axis: y_i = x_0 ... x_i (exclusive: x_0 ... x_{i-1}, the first 1; reverse: from the end)."""
    (x,) = xs
    axis = attrs["axis"]
    v = np.flip(x, axis) if attrs.get("reverse") else x
    out = np.cumprod(v.astype(compute_dtype(v)), axis=axis)
    if attrs.get("exclusive"):
        ones = np.ones_like(np.take(out, [0], axis=axis))
        out = np.concatenate([ones, np.delete(out, -1, axis=axis)], axis=axis) if out.shape[axis] else out
    out = np.flip(out, axis) if attrs.get("reverse") else out
    return np.ascontiguousarray(out).astype(x.dtype)


register(Op.CUMPROD, _cumprod_rule, _cumprod)
