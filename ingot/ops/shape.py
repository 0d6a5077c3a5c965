"""Shape ops: reshape, transpose, broadcast, concat, pad, gather, slice, slice_update, array_view.

Views (reshape of contiguous data, transpose, broadcast_to, static slices, array_view) never copy
in the references: NumPy returns views, and the CPU backend keeps them.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Op, Ref, TensorType
from . import broadcast_shapes, fail, register, resolve


def _no_packed(op, types):
    if any(t.dtype.packed for t in types):
        raise fail(op, types, "unpacked dtypes (4-bit tensors are only read by dequantize and quantized ops)")


def _reshape_rule(types, attrs):
    (t,) = types
    _no_packed(Op.RESHAPE, types)
    target = tuple(attrs["shape"])
    if sum(1 for d in target if d == -1) > 1 or any(d < -1 for d in target):
        raise fail(Op.RESHAPE, types, f"a target shape with at most one -1, not {target}")
    known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
    if t.static:
        if -1 in target:
            if known == 0 or t.size % known:
                raise fail(Op.RESHAPE, types, f"a size that {target} can hold")
            return TensorType(tuple(t.size // known if d == -1 else d for d in target), t.dtype)
        if known != t.size:
            raise fail(Op.RESHAPE, types, f"{known} elements for shape {target}")
    return TensorType(tuple(None if d == -1 else d for d in target), t.dtype)


register(Op.RESHAPE, _reshape_rule, lambda xs, a: np.reshape(xs[0], a["shape"]))


def _transpose_rule(types, attrs):
    (t,) = types
    _no_packed(Op.TRANSPOSE, types)
    perm = tuple(attrs["perm"])
    if sorted(perm) != list(range(t.rank)):
        raise fail(Op.TRANSPOSE, types, f"a permutation of {t.rank} axes, not {perm}")
    return TensorType(tuple(t.shape[p] for p in perm), t.dtype)


register(Op.TRANSPOSE, _transpose_rule, lambda xs, a: np.transpose(xs[0], a["perm"]))


def _broadcast_rule(types, attrs):
    (t,) = types
    _no_packed(Op.BROADCAST_TO, types)
    target = tuple(attrs["shape"])
    try:
        out = broadcast_shapes(Op.BROADCAST_TO, [t, TensorType(target, t.dtype)])
    except IngotError:  # said below, without presenting the target as an input
        out = None
    if out != target or t.rank > len(target):
        raise fail(Op.BROADCAST_TO, types, f"a shape that broadcasts to {target}")
    return TensorType(target, t.dtype)


register(Op.BROADCAST_TO, _broadcast_rule, lambda xs, a: np.broadcast_to(xs[0], a["shape"]))


def _concat_rule(types, attrs):
    _no_packed(Op.CONCAT, types)
    axis = attrs["axis"]
    first = types[0]
    if not types or any(t.rank != first.rank or t.dtype != first.dtype for t in types) or not 0 <= axis < first.rank:
        raise fail(Op.CONCAT, types, f"tensors of one rank and dtype, concatenated along axis {axis}")
    shape = list(first.shape)
    for i in range(first.rank):
        if i == axis:
            dims = [t.shape[i] for t in types]
            shape[i] = None if None in dims else sum(dims)
            continue
        known = {t.shape[i] for t in types} - {None}
        if len(known) > 1:
            raise fail(Op.CONCAT, types, f"equal sizes off axis {axis}")
        shape[i] = known.pop() if known else None
    return TensorType(shape, first.dtype)


register(Op.CONCAT, _concat_rule, lambda xs, a: np.concatenate(xs, axis=a["axis"]))


def _pad_rule(types, attrs):
    (t,) = types
    _no_packed(Op.PAD, types)
    pads = attrs["pads"]
    if len(pads) != t.rank or any(lo < 0 or hi < 0 for lo, hi in pads):
        raise fail(Op.PAD, types, f"{t.rank} non-negative (before, after) pairs, not {pads}")
    mode = attrs.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "symmetric"):
        raise fail(Op.PAD, types, f"mode constant, reflect, symmetric or edge, not {mode!r}")
    if mode == "reflect":
        for d, (lo, hi) in zip(t.shape, pads):
            if d is not None and (lo >= d or hi >= d) and (lo or hi):
                raise fail(Op.PAD, types, f"reflect padding smaller than the axis ({d}), not {(lo, hi)}")
    return TensorType(tuple(None if d is None else d + lo + hi for d, (lo, hi) in zip(t.shape, pads)), t.dtype)


def _pad(xs, attrs):
    mode = attrs.get("mode", "constant")
    if mode == "constant":
        return np.pad(xs[0], attrs["pads"], mode="constant", constant_values=attrs.get("value", 0))
    return np.pad(xs[0], attrs["pads"], mode=mode)


register(Op.PAD, _pad_rule, _pad)


def _gather_rule(types, attrs):
    x, idx = types
    _no_packed(Op.GATHER, [x])
    axis = attrs["axis"]
    if idx.dtype not in (dt.int32, dt.int64) or not 0 <= axis < x.rank:
        raise fail(Op.GATHER, types, f"int32/int64 indices and an axis within rank {x.rank}")
    return TensorType(x.shape[:axis] + idx.shape + x.shape[axis + 1:], x.dtype)


def _gather(xs, attrs):
    x, idx = xs
    axis = attrs["axis"]
    n = x.shape[axis]
    if idx.ndim == 0:   # one index (a state's direction, say): no reductions over it (3.3 us against 1.4)
        i = int(idx)
        if not -n <= i < n:
            raise IngotError(f"gather: index {i} but axis {axis} has {n} entries.")
        return np.take(x, i, axis=axis)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IngotError(f"gather: indices span {idx.min()}..{idx.max()} but axis {axis} has {n} entries.")
    return np.take(x, idx, axis=axis)


register(Op.GATHER, _gather_rule, _gather)


def slice_extent(dim, start, end, step, size=None):
    """Length of x[start:end:step] along one axis; None when not known before run time."""
    if size is not None:
        return size
    if dim is None or isinstance(start, Ref) or isinstance(end, Ref):
        return None
    return len(range(*slice(start, end, step).indices(dim)))


def _slice_rule(types, attrs):
    x = types[0]
    _no_packed(Op.SLICE, [x])
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    size = attrs.get("size") or (None,) * x.rank
    if not len(start) == len(end) == len(step) == len(size) == x.rank:
        raise fail(Op.SLICE, types, f"start, end and step for each of {x.rank} axes")
    if any(s == 0 for s in step if not isinstance(s, Ref)):
        raise fail(Op.SLICE, types, "non-zero steps")
    if any(sz is not None and (sz < 0 or st != 1) for sz, st in zip(size, step)):
        raise fail(Op.SLICE, types, f"sizes >= 0, and only on axes of step 1, not size {tuple(size)} with step {tuple(step)}")
    for ref in [v for v in (*start, *end) if isinstance(v, Ref)]:
        t = types[ref.index]
        if t.rank != 0 or not t.dtype.is_int:
            raise fail(Op.SLICE, types, "scalar integer tensors for runtime starts and ends")
    shape = tuple(slice_extent(d, s, e, st, sz) for d, s, e, st, sz in zip(x.shape, start, end, step, size))
    return TensorType(shape, x.dtype)


def slice_index(shape, start, end, step, size) -> tuple[slice, ...]:
    """The NumPy index of a slice with resolved starts and ends, on an input of `shape`."""
    size = size or (None,) * len(shape)
    index = []
    for axis, (d, s, e, st, sz) in enumerate(zip(shape, start, end, step, size)):
        if sz is not None:
            s = s + d if s < 0 else s
            if not 0 <= s <= d - sz:
                raise IngotError(f"slice: start {s} with size {sz} does not fit axis {axis} of length {d}.")
            e = s + sz
        index.append(slice(s, e, st))
    return tuple(index)


def _slice(xs, attrs):
    x = xs[0]
    return x[slice_index(x.shape, resolve(attrs["start"], xs), resolve(attrs["end"], xs), attrs["step"], attrs.get("size"))]


register(Op.SLICE, _slice_rule, _slice)


def _slice_update_rule(types, attrs):
    x, u = types[0], types[1]
    _no_packed(Op.SLICE_UPDATE, [x, u])
    start = attrs["start"]
    # a float update into a float buffer of another dtype is rounded as it is written (a bfloat16 KV cache)
    if (x.dtype != u.dtype and not (x.dtype.is_float and u.dtype.is_float)) or x.rank != u.rank or len(start) != x.rank:
        raise fail(Op.SLICE_UPDATE, types, "an update of the same rank and dtype (or both float), and a start per axis")
    for d, s, n in zip(x.shape, start, u.shape):
        if isinstance(s, Ref):
            if types[s.index].rank != 0 or not types[s.index].dtype.is_int:
                raise fail(Op.SLICE_UPDATE, types, "scalar integer tensors for runtime starts")
            if d is not None and n is not None and n > d:
                raise fail(Op.SLICE_UPDATE, types, f"an update that fits: length {n} exceeds {d} at any start")
            continue
        if d is not None and n is not None and not 0 <= s <= d - n:
            raise fail(Op.SLICE_UPDATE, types, f"an update that fits: start {s} + {n} exceeds {d}")
    return x


def update_index(x_shape, u_shape, start, axis_names=None):
    index = []
    for axis, (d, s, n) in enumerate(zip(x_shape, start, u_shape)):
        if not 0 <= s <= d - n:
            raise IngotError(f"slice_update: start {s} + update length {n} does not fit axis {axis} of length {d}.")
        index.append(slice(s, s + n))
    return tuple(index)


def slice_update_into(x: np.ndarray, u: np.ndarray, start) -> np.ndarray:
    """Write u into x at start, in place; returns x."""
    x[update_index(x.shape, u.shape, start)] = u
    return x


def _slice_update(xs, attrs):
    x, u = xs[0], xs[1]
    return slice_update_into(np.array(x, copy=True), u, resolve(attrs["start"], xs))


register(Op.SLICE_UPDATE, _slice_update_rule, _slice_update)


def _array_view_rule(types, attrs):
    (x,) = types
    _no_packed(Op.ARRAY_VIEW, types)
    shape, strides, offset = tuple(attrs["shape"]), tuple(attrs["strides"]), attrs.get("offset", 0)
    if len(shape) != len(strides) or any(d < 0 for d in shape) or offset < 0:
        raise fail(Op.ARRAY_VIEW, types, f"a shape and strides of one length and offset >= 0, not {shape}, {strides}, {offset}")
    if x.static and all(d > 0 for d in shape):
        lo = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
        hi = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
        if lo < 0 or hi >= x.size:
            raise fail(Op.ARRAY_VIEW, types, f"a view inside the input's {x.size} elements (it reaches {lo}..{hi})")
    return TensorType(shape, x.dtype)


def array_view(x: np.ndarray, shape, strides, offset=0) -> np.ndarray:
    """A strided view of x's contiguous storage; element strides. Never copies a contiguous input."""
    flat = np.ascontiguousarray(x).reshape(-1)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(shape),
                                           strides=tuple(s * item for s in strides), writeable=False)


register(Op.ARRAY_VIEW, _array_view_rule, lambda xs, a: array_view(xs[0], a["shape"], a["strides"], a.get("offset", 0)))
