"""ONNX converters for shape ops: Shape, Reshape, Slice, Gather, Concat, Pad, Tile, Range, Constant, ...

Shapes, axes and bounds are read at import (ctx.constant); every input shape is static by then."""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ops import normalize_axis
from .onnx_ops import Context, OnnxNode, as_ingot_array, attr_or_input, converter, ints, onnx_to_ingot_dtype, scalar


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
    target = ints(ctx.constant(node, 1, "shape"))
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
    axes = attr_or_input(ctx, node, "axes", 1)
    axes = [i for i, d in enumerate(x.shape) if d == 1] if axes is None else [normalize_axis("Squeeze", a, x.ndim) for a in ints(axes)]
    if any(x.shape[a] != 1 for a in axes):
        raise IngotError(f"axes {axes} of shape {list(x.shape)} are not all of size 1")
    return [ctx.g.reshape(x, tuple(d for i, d in enumerate(x.shape) if i not in axes))]


@converter("Unsqueeze")
def _unsqueeze(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    axes = ints(attr_or_input(ctx, node, "axes", 1))   # (a scalar axes tensor names one axis)
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
    sizes = node.attr("split") if node.opset < 13 else (ints(ctx.constant(node, 1, "split")) if node.input(1) is not None else None)
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
        starts = ints(ctx.constant(node, 1, "starts"))
        ends = ints(ctx.constant(node, 2, "ends"))
        axes = ints(ctx.constant(node, 3, "axes")) if node.input(3) is not None else None
        steps = ints(ctx.constant(node, 4, "steps")) if node.input(4) is not None else None
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
    shape = ints(ctx.constant(node, 1, "shape"))
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
    reps = ints(ctx.constant(node, 1, "repeats"))
    if all(r == 1 for r in reps):
        return [x]
    interleaved = tuple(v for d in x.shape for v in (1, d))
    spread = tuple(v for r, d in zip(reps, x.shape) for v in (r, d))
    y = g.broadcast_to(g.reshape(x, interleaved), spread)
    return [g.reshape(y, tuple(r * d for r, d in zip(reps, x.shape)))]


@converter("Range")
def _range(ctx: Context, node: OnnxNode):
    start, limit, delta = (ctx.constant(node, i, w) for i, w in enumerate(("start", "limit", "delta")))
    if any(np.size(v) != 1 for v in (start, limit, delta)):
        raise IngotError(f"start, limit and delta of shapes {[list(np.shape(v)) for v in (start, limit, delta)]} (scalars)")
    start, limit, delta = (np.asarray(v).reshape(()) for v in (start, limit, delta))   # (one-element tensors as scalars)
    dtype = node.inputs[0].dtype.storage
    span = (float(limit) - float(start)) / float(delta) if float(delta) else math.inf
    if not math.isfinite(span):
        raise IngotError(f"start {start}, limit {limit} and delta {delta} give no finite number of values")
    count = max(int(math.ceil(span)), 0)
    ctx.check_elements(node, count)
    return [ctx.g.constant((start + np.arange(count) * delta).astype(dtype))]


@converter("ConstantOfShape")
def _constant_of_shape(ctx: Context, node: OnnxNode):
    shape = ints(ctx.constant(node, 0, "shape"))
    if any(d < 0 for d in shape):
        raise IngotError(f"shape {shape} has a negative dimension")
    ctx.check_elements(node, shape)
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
    ctx.check_elements(node, x.shape[:2])
    return [ctx.g.constant(np.eye(x.shape[0], x.shape[1], k=node.attr("k", 0), dtype=dtype.numpy))]


@converter("Trilu")
def _trilu(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    k = int(ctx.constant(node, 1, "k")) if node.input(1) is not None else 0
    rows, cols = x.shape[-2:]
    ones = np.ones((rows, cols), bool)
    mask = np.triu(ones, k) if node.attr("upper", 1) else np.tril(ones, k)
    return [ctx.g.where(ctx.g.constant(mask), x, scalar(ctx, 0, x))]


@converter("Pad")
def _pad(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    mode = node.attr("mode", "constant")
    if node.opset < 11:
        pads, value, axes = node.attr("pads"), node.attr("value", 0.0), None
    else:
        pads = ints(ctx.constant(node, 1, "pads"))
        value = ctx.constant(node, 2, "constant_value").reshape(-1)[0] if node.input(2) is not None else 0
        axes = ints(ctx.constant(node, 3, "axes")) if node.input(3) is not None else None
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


@converter("Dropout")
def _dropout(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    if node.input(2) is not None and bool(np.asarray(ctx.constant(node, 2, "training mode")).reshape(-1)[0]):
        ratio = 0.5 if node.input(1) is None else float(np.asarray(ctx.constant(node, 1, "ratio")).reshape(-1)[0])
        if ratio != 0:   # random masks: a training-time op, not one of inference
            raise ctx.fail(node, f"training mode with ratio {ratio}")
    outs = [x]
    if len(node.outputs) > 1 and node.outputs[1]:
        outs.append(ctx.g.constant(np.ones(x.shape, bool)))
    return outs


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
    idx = g.where(idx < scalar(ctx, 0, idx), idx + scalar(ctx, n, idx), idx)
    d_t, i_t = g.transpose(d, perm), g.transpose(idx, perm)          # [*other, n], [*other, m]
    hot = g.equal(g.reshape(i_t, tuple(i_t.shape) + (1,)), g.constant(np.arange(n, dtype=np.int64)))  # [*other, m, n]
    picked = g.where(hot, g.reshape(d_t, tuple(d_t.shape[:-1]) + (1, n)), scalar(ctx, 0, d_t))
    return [g.transpose(g.sum(picked, (picked.ndim - 1,)), back)]


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
    idx = g.where(idx < scalar(ctx, 0, idx), idx + g.constant(np.array(lead, np.int64)), idx)
    flat_index = g.sum(idx * g.constant(strides), (idx.ndim - 1,))                   # [*batch, *rows]
    nb = int(np.prod(data.shape[:batch], dtype=np.int64))
    flat = g.reshape(data, (nb * int(np.prod(lead, dtype=np.int64)),) + rest)
    if batch:  # each batch element reads its own block of rows
        offsets = (np.arange(nb, dtype=np.int64) * int(np.prod(lead, dtype=np.int64))).reshape(
            tuple(data.shape[:batch]) + (1,) * (flat_index.ndim - batch))
        flat_index = flat_index + g.constant(offsets)
    return [g.gather(flat, flat_index, axis=0)]


def _scatter_rows(ctx: Context, node: OnnxNode, data: Tensor, hot: Tensor, updates: Tensor) -> Tensor:
    """data [..., R, C] with rows replaced (or combined, by `reduction`) where hot [..., M, R] says
    which of the updates [..., M, C] go: a one-hot product, for the small scatters models make."""
    g = ctx.g
    reduction = node.attr("reduction", "none")
    m_axis = hot.ndim - 2
    hit = g.cast(g.max(g.cast(hot, dt.int32), (m_axis,)), dt.bool_)                # [..., R]
    hit = g.reshape(hit, tuple(hit.shape) + (1,))
    if reduction in ("none", "add"):
        wide = data.dtype if data.dtype.is_float else dt.float32 if data.dtype != dt.int64 else dt.int64
        placed = g.matmul(g.swapaxes(g.cast(hot, wide), -1, -2), updates if updates.dtype == wide else g.cast(updates, wide))
        placed = placed if placed.dtype == data.dtype else g.cast(placed, data.dtype)
        return g.where(hit, placed, data) if reduction == "none" else data + placed
    if reduction in ("max", "min"):
        fill = scalar(ctx, -np.inf if reduction == "max" else np.inf, updates) if updates.dtype.is_float else \
            scalar(ctx, np.iinfo(updates.dtype.numpy).min if reduction == "max" else np.iinfo(updates.dtype.numpy).max, updates)
        spread = g.where(g.reshape(hot, tuple(hot.shape) + (1,)), g.reshape(updates, tuple(updates.shape[:-1]) + (1, updates.shape[-1])), fill)
        best = (g.max if reduction == "max" else g.min)(spread, (m_axis,))          # [..., R, C]
        combined = (g.maximum if reduction == "max" else g.minimum)(data, best)
        return g.where(hit, combined, data)
    if reduction == "mul" and hot.shape[m_axis] <= 64:  # a product over the (few) updates, one at a time
        out = data
        count = hot.shape[m_axis]
        for j in range(count):
            one_hot = g.slice(hot, [0] * m_axis + [j, 0], [None] * m_axis + [j + 1, None])              # [..., 1, R]
            one = g.slice(updates, [0] * m_axis + [j, 0], [None] * m_axis + [j + 1, None])              # [..., 1, C]
            out = out * g.where(g.swapaxes(one_hot, -1, -2), one, scalar(ctx, 1, updates))
        return out
    raise ctx.fail(node, f"reduction {reduction!r}")


@converter("ScatterND")
def _scatter_nd(ctx: Context, node: OnnxNode):
    data, idx, updates = node.inputs
    g = ctx.g
    if data.dtype == dt.bool_:
        raise ctx.fail(node, "bool data")
    depth = idx.shape[-1]
    lead = data.shape[:depth]
    rows = int(np.prod(lead, dtype=np.int64))
    rest = int(np.prod(data.shape[depth:], dtype=np.int64))
    count = int(np.prod(idx.shape[:-1], dtype=np.int64))
    strides = np.array([int(np.prod(lead[i + 1:], dtype=np.int64)) for i in range(depth)], np.int64)
    idx = idx if idx.dtype == dt.int64 else g.cast(idx, dt.int64)
    idx = g.where(idx < scalar(ctx, 0, idx), idx + g.constant(np.array(lead, np.int64)), idx)
    flat = g.reshape(g.sum(idx * g.constant(strides), (idx.ndim - 1,)), (count, 1))
    hot = g.equal(flat, g.constant(np.arange(rows, dtype=np.int64)))                       # [M, R]
    out = _scatter_rows(ctx, node, g.reshape(data, (rows, rest)), hot, g.reshape(updates, (count, rest)))
    return [g.reshape(out, tuple(data.shape))]


@converter("ScatterElements", "Scatter")
def _scatter_elements(ctx: Context, node: OnnxNode):
    data, idx, updates = node.inputs
    g = ctx.g
    axis = normalize_axis("ScatterElements", node.attr("axis", 0), data.ndim)
    if data.dtype == dt.bool_ or idx.shape != updates.shape or any(
            i != d for a, (i, d) in enumerate(zip(idx.shape, data.shape)) if a != axis):
        raise ctx.fail(node, "bool data, or indices that cover only part of the other axes")
    n = data.shape[axis]
    perm = [a for a in range(data.ndim) if a != axis] + [axis]
    back = [perm.index(a) for a in range(data.ndim)]
    idx = idx if idx.dtype == dt.int64 else g.cast(idx, dt.int64)
    idx = g.where(idx < scalar(ctx, 0, idx), idx + scalar(ctx, n, idx), idx)
    d_t, i_t, u_t = (g.transpose(t, perm) for t in (data, idx, updates))                    # [*other, n|m]
    hot = g.equal(g.reshape(i_t, tuple(i_t.shape) + (1,)), g.constant(np.arange(n, dtype=np.int64)))  # [*other, m, n]
    out = _scatter_rows(ctx, node, g.reshape(d_t, tuple(d_t.shape) + (1,)), hot, g.reshape(u_t, tuple(u_t.shape) + (1,)))
    return [g.transpose(g.reshape(out, tuple(d_t.shape)), back)]


@converter("Compress")
def _compress(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    keep = np.flatnonzero(np.asarray(ctx.constant(node, 1, "condition")).reshape(-1))
    g = ctx.g
    if node.attr("axis") is None:
        flat = g.reshape(x, (int(np.prod(x.shape)),))
        keep = keep[keep < flat.shape[0]]
        return [g.gather(flat, g.constant(keep.astype(np.int64)), axis=0)]
    axis = normalize_axis("Compress", node.attr("axis"), x.ndim)
    keep = keep[keep < x.shape[axis]]
    return [g.gather(x, g.constant(keep.astype(np.int64)), axis=axis)]


@converter("ReverseSequence")
def _reverse_sequence(ctx: Context, node: OnnxNode):
    """y[b, t] = x[b, len_b - 1 - t] for t < len_b, else x[b, t]: one gather over (batch, time) pairs."""
    x = node.inputs[0]
    g = ctx.g
    lengths = ints(ctx.constant(node, 1, "sequence_lens"))
    batch_axis, time_axis = node.attr("batch_axis", 1), node.attr("time_axis", 0)
    batch, steps = x.shape[batch_axis], x.shape[time_axis]
    if len(lengths) != batch or any(not 0 <= n <= steps for n in lengths):
        raise IngotError(f"sequence_lens {lengths} for {batch} sequences of {steps} steps")
    rest = [a for a in range(x.ndim) if a not in (batch_axis, time_axis)]
    moved = g.transpose(x, [batch_axis, time_axis] + rest)
    flat = g.reshape(moved, (batch * steps,) + tuple(moved.shape[2:]))
    source = [b * steps + (n - 1 - t if t < n else t) for b, n in enumerate(lengths) for t in range(steps)]
    out = g.reshape(g.gather(flat, g.constant(np.array(source, np.int64)), axis=0), moved.shape)
    inverse = np.argsort([batch_axis, time_axis] + rest)
    return [g.transpose(out, [int(a) for a in inverse])]


@converter("Upsample")
def _upsample(ctx: Context, node: OnnxNode):
    """Upsample (deprecated; Resize replaces it), nearest mode: y[i] = x[floor(i / scale)] per axis."""
    x = node.inputs[0]
    g = ctx.g
    if node.attr("mode", "nearest") != "nearest":
        raise ctx.fail(node, f"mode {node.attr('mode')!r} (Ingot converts nearest)")
    scales = node.attr("scales") if node.attr("scales") is not None else np.asarray(ctx.constant(node, 1, "scales")).reshape(-1)
    if len(scales) != x.ndim:
        raise IngotError(f"{len(scales)} scales for an input of rank {x.ndim}")
    y = x
    for axis, scale in enumerate(scales):
        size = int(np.floor(x.shape[axis] * float(scale)))
        if size == x.shape[axis] and float(scale) == 1.0:
            continue
        ctx.check_elements(node, [size if a == axis else d for a, d in enumerate(y.shape)])
        index = np.minimum(np.floor(np.arange(size) / float(scale)).astype(np.int64), x.shape[axis] - 1)
        y = g.gather(y, g.constant(index), axis=axis)
    return [y]


@converter("TensorScatter")
def _tensor_scatter(ctx: Context, node: OnnxNode):
    """A cache update: each batch row's update written into the past cache along `axis` from its write
    index (wrapping around for mode circular). The indices must be known at import (from_onnx compiles
    per value); each row is one gather from [past; update] along the axis."""
    past, update, where = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    axis = normalize_axis("TensorScatter", node.attr("axis", -2), past.ndim)
    if axis == 0 or update.ndim != past.ndim:
        raise IngotError(f"axis {axis} of a past cache of rank {past.ndim} and an update of rank {update.ndim}")
    batch, size, count = past.shape[0], past.shape[axis], update.shape[axis]
    starts = [0] * batch if where is None else ints(ctx.constant(node, 2, "write_indices"))
    circular = node.attr("mode", "linear") == "circular"
    joined = g.concat([past, update], axis)
    rows = []
    for b, start in enumerate(starts):
        source = np.arange(size)
        for j in range(count):
            p = (start + j) % size if circular else start + j
            if not 0 <= p < size:
                raise IngotError(f"write index {start} + {count} updates runs past the cache's {size} positions")
            source[p] = size + j
        lo, hi = [0] * past.ndim, list(joined.shape)
        lo[0], hi[0] = b, b + 1
        rows.append(g.gather(g.slice(joined, lo, hi), g.constant(source.astype(np.int64)), axis=axis))
    return [g.concat(rows, 0) if len(rows) > 1 else rows[0]]
