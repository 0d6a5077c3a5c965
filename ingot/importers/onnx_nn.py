"""ONNX converters for the network layers: MatMul/Gemm (optionally quantized), the normalisations,
Conv/ConvTranspose (a strided view of the input times the weights), pooling, Resize."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ir import Op
from ..ops import normalize_axis
from .onnx_ops import Context, OnnxNode, UnsupportedOnnx, converter, ints, need_float, onnx_to_ingot_dtype, scalar


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
        y = y * scalar(ctx, alpha, y)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * scalar(ctx, beta, c))
    return [y]


@converter("Softmax", "LogSoftmax")
def _softmax(ctx: Context, node: OnnxNode):
    (x,) = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
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
    need_float(ctx, node, x)
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
    inv = g.rsqrt(g.mean(d * d, axes, keepdims=True) + scalar(ctx, eps, xs))
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
    need_float(ctx, node, x)
    axis = normalize_axis("RMSNormalization", node.attr("axis", -1), x.ndim)
    eps = node.attr("epsilon", 1e-5)
    if axis == x.ndim - 1 and scale.shape == x.shape[-1:]:
        return [g.rms_norm(x, scale, eps=eps)]
    axes = tuple(range(axis, x.ndim))
    xs = x if x.dtype == dt.float32 else g.cast(x, dt.float32)
    y = xs * g.rsqrt(g.mean(xs * xs, axes, keepdims=True) + scalar(ctx, eps, xs))
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
        inv = g.rsqrt(batch_var + scalar(ctx, eps, batch_var)) * scale
        y = d * _per_channel(g, inv, x.ndim) + _per_channel(g, bias, x.ndim)
        momentum = node.attr("momentum", 0.9)
        keep, take = scalar(ctx, momentum, mean), scalar(ctx, 1 - momentum, mean)
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
    inv = g.rsqrt(var + scalar(ctx, eps, var)) * scale
    return [(x - _per_channel(g, mean, x.ndim)) * _per_channel(g, inv, x.ndim) + _per_channel(g, bias, x.ndim)]


@converter("InstanceNormalization")
def _instance_norm(ctx: Context, node: OnnxNode):
    x, scale, bias = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
    axes = tuple(range(2, x.ndim))
    mean = g.mean(x, axes, keepdims=True)
    d = x - mean
    y = d * g.rsqrt(g.mean(d * d, axes, keepdims=True) + scalar(ctx, node.attr("epsilon", 1e-5), x))
    return [y * _per_channel(g, scale, x.ndim) + _per_channel(g, bias, x.ndim)]


@converter("GroupNormalization")
def _group_norm(ctx: Context, node: OnnxNode):
    x, scale, bias = node.inputs
    g = ctx.g
    need_float(ctx, node, x)
    groups = node.attr("num_groups")
    n, c = x.shape[:2]
    if node.opset < 21:
        raise ctx.fail(node, "opset 18 GroupNormalization (per-group scale), deprecated by ONNX")
    grouped = g.reshape(x, (n, groups, -1))
    mean = g.mean(grouped, (2,), keepdims=True)
    d = grouped - mean
    y = g.reshape(d * g.rsqrt(g.mean(d * d, (2,), keepdims=True) + scalar(ctx, node.attr("epsilon", 1e-5), x)), x.shape)
    return [y * _per_channel(g, scale, x.ndim) + _per_channel(g, bias, x.ndim)]


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
    need_float(ctx, node, x)
    k = x.ndim - 2
    kernel = list(node.attr("kernel_shape", w.shape[2:]))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    before, after = _window_pads(node, x.shape[2:], kernel, strides, dilations)
    return [_convolve(ctx.g, x, w, b, kernel, strides, dilations, node.attr("group", 1), before, after)]


def _convolve(g, x: Tensor, w: Tensor, b: Tensor | None, kernel, strides, dilations, groups: int, before, after) -> Tensor:
    """N-d convolution: one CONV op (padding as its attribute, not a padded copy)."""
    if tuple(w.shape[2:]) != tuple(kernel):
        raise IngotError(f"Conv: kernel_shape {list(kernel)} does not match the weights' {list(w.shape[2:])}.")
    return g.conv(x, w, b, strides, dilations, list(zip(before, after)), groups)


def _unshuffled_transpose(g, x: Tensor, w: np.ndarray, b: Tensor | None, kernel) -> Tensor:
    """A 2-D transposed convolution whose kernel equals its stride (no overlap, no padding): every input
    pixel writes its own kh x kw block, so it is a 1x1 convolution to M * kh * kw channels followed by
    a depth-to-space shuffle, with no zeros inserted or multiplied."""
    n, c, h, wd = x.shape
    m, (kh, kw) = w.shape[1], kernel
    pointwise = np.ascontiguousarray(w.reshape(c, m * kh * kw).T).reshape(m * kh * kw, c, 1, 1)
    y = g.conv(x, g.constant(pointwise))                                        # [N, M*kh*kw, H, W]
    y = g.transpose(g.reshape(y, (n, m, kh, kw, h, wd)), (0, 1, 4, 2, 5, 3))    # [N, M, H, kh, W, kw]
    y = g.reshape(y, (n, m, h * kh, wd * kw))
    return y + _per_channel(g, b, 4) if b is not None else y


@converter("ConvTranspose")
def _conv_transpose(ctx: Context, node: OnnxNode):
    """The gradient of a convolution: zeros between the input's elements (stride), then a stride-1
    convolution with the flipped kernel, input and output channels swapped per group."""
    x, w, b = node.input(0), node.input(1), node.input(2)
    g = ctx.g
    need_float(ctx, node, x)
    n, c = x.shape[:2]
    spatial = list(x.shape[2:])
    k = len(spatial)
    groups = node.attr("group", 1)
    kernel = list(node.attr("kernel_shape", w.shape[2:]))
    strides = list(node.attr("strides", [1] * k))
    dilations = list(node.attr("dilations", [1] * k))
    extra = list(node.attr("output_padding", [0] * k))
    wv = ctx.value(w)
    if k == 2 and groups == 1 and kernel == strides and dilations == [1, 1] and not any(extra) and wv is not None \
            and node.attr("auto_pad", "NOTSET") in ("NOTSET", "VALID") and not any(node.attr("pads", [0] * 4)) \
            and node.attr("output_shape") is None and None not in spatial:
        return [_unshuffled_transpose(g, x, wv, b, kernel)]
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
        need_float(ctx, node, x)
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
        return [total / scalar(ctx, counts.reshape(-1)[0], total)]
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
    need_float(ctx, node, x)
    axes = tuple(range(2, x.ndim))
    fn = ctx.g.mean if node.op_type == "GlobalAveragePool" else ctx.g.max
    return [fn(x, axes, keepdims=True)]


RESIZE_BLOCK_ELEMENTS = 1 << 20   # float64s of the reference's temporaries while Resize weights are computed


def _resize_matrix(n_in: int, n_out: int, scale: float, roi, fct, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """The interpolation along one axis as a matrix [n_out, n_in] (and which outputs are extrapolated),
    from ONNX's own reference: resizing the identity gives the weights, resizing zeros the outside."""
    try:
        from onnx.reference.ops.op_resize import _interpolate_1d_along_axis
    except ImportError:  # older onnx: its reference resized element by element
        import onnx
        raise UnsupportedOnnx(f"Resize needs the separable reference of a newer onnx (onnx {onnx.__version__} lacks it)") from None

    # The reference gathers [n_out, taps, columns] of its input: the identity goes in blocks of columns small
    # enough that this stays near RESIZE_BLOCK_ELEMENTS (a whole identity of 5,792 peaked at 2.9 GB), and the
    # per-output coefficients, the same for every block, are computed once.
    memo: dict = {}

    def coefficients(ratio, scale_factor):
        key = (ratio, scale_factor)
        if key not in memo:
            memo[key] = np.asarray(fct(ratio, scale_factor))
        return memo[key]

    taps = len(coefficients(0.5, scale))
    block = max(1, RESIZE_BLOCK_ELEMENTS // max(1, n_out * taps))
    weights = np.empty((n_out, n_in), np.float64)
    for start in range(0, n_in, block):
        width = min(block, n_in - start)
        identity = np.zeros((n_in, width))
        identity[np.arange(start, start + width), np.arange(width)] = 1.0
        weights[:, start:start + width] = _interpolate_1d_along_axis(identity, 0, scale, n_out, coefficients, roi=roi,
                                                                     extrapolation_value=0.0, **kwargs)
    outside = _interpolate_1d_along_axis(np.zeros((n_in, 1)), 0, scale, n_out, coefficients, roi=roi, extrapolation_value=1.0,
                                         **kwargs)
    return weights, np.asarray(outside, np.float64).reshape(-1)


REMEMBERED_RESIZE_ELEMENTS = 1 << 18   # an interpolation matrix this small is kept (2 MB; 32 of them at most)


def _resize_matrix_of(n_in: int, n_out: int, scale: float, roi: tuple | None, mode: tuple, transform: str,
                      exclude_outside: bool) -> tuple[np.ndarray, np.ndarray]:
    """_resize_matrix for the coefficients of `mode` (_resize_mode's); a small one remembered (read only):
    a model compiled per input shape resizes the same sizes again (PP-OCRv4's detector: 12 an import, ~1 ms)."""
    make = _remembered_resize_matrix if n_in * n_out <= REMEMBERED_RESIZE_ELEMENTS else _made_resize_matrix
    return make(n_in, n_out, scale, roi, mode, transform, exclude_outside)


def _made_resize_matrix(n_in, n_out, scale, roi, mode, transform, exclude_outside) -> tuple[np.ndarray, np.ndarray]:
    made = _resize_matrix(n_in, n_out, scale, None if roi is None else list(roi), _resize_coefficients(*mode),
                          coordinate_transformation_mode=transform, exclude_outside=exclude_outside)
    for array in made:
        array.flags.writeable = False
    return made


_remembered_resize_matrix = functools.lru_cache(maxsize=32)(_made_resize_matrix)


def _resize_mode(node: OnnxNode) -> tuple:
    """What picks the node's coefficient function: (mode, nearest_mode, antialias, cubic_coeff_a)."""
    return (node.attr("mode", "nearest"), node.attr("nearest_mode", "round_prefer_floor"), bool(node.attr("antialias", 0)),
            float(node.attr("cubic_coeff_a", -0.75)))


def _resize_coefficients(mode: str, nearest: str, antialias: bool, a: float):
    """ONNX's reference coefficient function for the mode (nearest, linear, cubic; antialias)."""
    try:
        from onnx.reference.ops import op_resize as ref
    except ImportError:  # pragma: no cover
        raise IngotError("Resize needs onnx's reference implementation (onnx >= 1.13)") from None
    if mode == "nearest":
        return lambda x, scale: ref._nearest_coeffs(x, mode=nearest)
    if mode == "linear":
        return ref._linear_coeffs_antialias if antialias else ref._linear_coeffs
    if mode == "cubic":
        fn = ref._cubic_coeffs_antialias if antialias else ref._cubic_coeffs
        return lambda x, scale: fn(x, scale, A=a)
    raise IngotError(f"mode {mode!r}")


def _interpolate_axis(g, y: Tensor, a: int, weights: np.ndarray) -> Tensor:
    """y resized along axis a by weights [n_out, n_in]: a sum over the few taps of each output (a gather
    and a multiply each) when rows are sparse, as for nearest, linear and cubic, else one matmul. (As
    one matmul, an upscale of a 4,096-wide axis costs 8,192 x 4,096 multiply-adds per row: a fuzzed
    255 x 6 x 4,096 image ran for minutes.)"""
    r = y.ndim
    rows, cols = np.nonzero(weights)
    counts = np.bincount(rows, minlength=weights.shape[0])
    taps = int(counts.max(initial=0))
    if 0 < taps <= 8 and 4 * taps <= weights.shape[1]:
        at = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)   # each nonzero's place in its row
        index = np.zeros((weights.shape[0], taps), np.int64)
        coeff = np.zeros((weights.shape[0], taps), np.float64)
        index[rows, at], coeff[rows, at] = cols, weights[rows, cols]
        shape = [1] * r
        shape[a] = weights.shape[0]
        out = None
        for k in range(taps):
            term = g.gather(y, g.constant(index[:, k]), axis=a) * g.constant(coeff[:, k].reshape(shape).astype(y.dtype.numpy))
            out = term if out is None else out + term
        return out
    perm = [i for i in range(r) if i != a] + [a]
    moved = y if a == r - 1 else g.transpose(y, perm)
    moved = g.matmul(moved, g.constant(weights.T.astype(y.dtype.numpy)))
    return moved if a == r - 1 else g.transpose(moved, [perm.index(i) for i in range(r)])


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
    if any(d < 0 for d in full_sizes) or not all(math.isfinite(v) and v > 0 for v in full_scales):
        raise IngotError(f"scales {full_scales} / sizes {full_sizes} are not positive")
    ctx.check_elements(node, full_sizes)
    for a in range(r):
        ctx.check_elements(node, (full_sizes[a], x.shape[a]), f"its interpolation matrix along axis {a}")
    mode = _resize_mode(node)
    _resize_coefficients(*mode)   # (an unknown mode refused here, resized axes or not)
    transform = node.attr("coordinate_transformation_mode", "half_pixel" if node.opset >= 11 else "asymmetric")
    exclude_outside = bool(node.attr("exclude_outside", 0))
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
        weights, outside = _resize_matrix_of(x.shape[a], full_sizes[a], full_scales[a],
                                             tuple(axis_roi) if transform == "tf_crop_and_resize" else None, mode, transform,
                                             exclude_outside)
        if nearest and np.all((weights == 0) | (weights == 1)) and np.all(weights.sum(axis=1)[outside == 0] == 1):
            index = np.argmax(weights, axis=1).astype(np.int64)
            y = g.gather(y, g.constant(index), axis=a)
        else:
            y = _interpolate_axis(g, y, a, weights)
        if outside.any():
            shape = [1] * r
            shape[a] = full_sizes[a]
            inside = g.constant((outside == 0).reshape(shape))
            y = g.where(inside, y, scalar(ctx, extrapolation, y))
    return [y]


@converter("LpPool")
def _lp_pool(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    need_float(ctx, node, x)
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
    powered = g.pow(g.abs(x), scalar(ctx, p, x)) if p != 2 else x * x
    if any(before + after):
        powered = g.pad(powered, [(0, 0), (0, 0)] + list(zip(before, after)))
    total = g.sum(_windows(g, powered, kernel, strides, dilations, out, (n, c)), tuple(range(2, 2 + k)))
    return [g.sqrt(total) if p == 2 else g.pow(total, scalar(ctx, 1.0 / p, total))]


_GRID_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}


@converter("GridSample")
def _grid_sample(ctx: Context, node: OnnxNode):
    x, grid = node.inputs
    need_float(ctx, node, x)
    mode = _GRID_MODES.get(node.attr("mode", "linear" if node.opset >= 20 else "bilinear"))
    if mode is None:
        raise ctx.fail(node, f"mode {node.attr('mode')!r}")
    if grid.dtype != x.dtype:
        grid = ctx.g.cast(grid, x.dtype)
    return [ctx.g.op(Op.GRID_SAMPLE, [x, grid], {"mode": mode, "padding": node.attr("padding_mode", "zeros"),
                                                 "align_corners": bool(node.attr("align_corners", 0))})]


@converter("LRN")
def _lrn(ctx: Context, node: OnnxNode):
    """y = x / (bias + alpha / size * sum of x^2 over the channels c - (size-1)//2 .. c + size//2) ** beta."""
    (x,) = node.inputs
    need_float(ctx, node, x)
    g = ctx.g
    size = int(node.attr("size"))
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    channels = x.shape[1]
    before, after = (size - 1) // 2, size // 2
    square = x * x
    pads = [(0, 0)] * x.ndim
    pads[1] = (before, after)
    padded = g.pad(square, pads)
    total = None
    for k in range(size):
        start = [0] * x.ndim
        end = list(padded.shape)
        start[1], end[1] = k, k + channels
        part = g.slice(padded, start, end)
        total = part if total is None else total + part
    denominator = g.pow(scalar(ctx, bias, x) + scalar(ctx, alpha / size, x) * total, scalar(ctx, beta, x))
    return [x / denominator]


def _as(ctx: Context, node: OnnxNode, op_type: str, inputs, attrs=None) -> list:
    """Convert as another ONNX op would be (ConvInteger as Conv, MaxUnpool as ScatterND)."""
    from .onnx_ops import CONVERTERS, OnnxNode as Node

    other = Node(op_type, "", node.name, list(inputs), dict(node.attrs if attrs is None else attrs), node.outputs,
                 ctx.opsets.get("", node.opset))
    return list(CONVERTERS[("", op_type)](ctx, other))


@converter("MaxUnpool")
def _max_unpool(ctx: Context, node: OnnxNode):
    """Each value written at its index (flat over the whole output, as MaxPool's Indices give it) in zeros."""
    x, indices = node.input(0), node.input(1)
    g = ctx.g
    k = x.ndim - 2
    kernel = list(node.attr("kernel_shape"))
    strides = list(node.attr("strides", [1] * k))
    pads = list(node.attr("pads", [0] * (2 * k)))
    inferred = list(x.shape[:2]) + [(x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[k + i] + kernel[i] for i in range(k)]
    shape = inferred if node.input(2) is None else ints(ctx.constant(node, 2, "output_shape"))
    if len(shape) != x.ndim or any(s < i for s, i in zip(shape, inferred)):
        raise IngotError(f"output_shape {shape} smaller than the unpooled shape {inferred}")
    ctx.check_elements(node, shape)
    zeros = g.constant(np.zeros((int(np.prod(inferred)),), x.dtype.storage))
    idx = g.reshape(indices if indices.dtype == dt.int64 else g.cast(indices, dt.int64), (int(np.prod(x.shape)), 1))
    (flat,) = _as(ctx, node, "ScatterND", [zeros, idx, g.reshape(x, (int(np.prod(x.shape)),))], {})
    y = g.reshape(flat, tuple(inferred))
    if shape != inferred:   # a larger output_shape: the unpooled values in its leading corner, zeros after
        y = g.pad(y, [(0, s - i) for s, i in zip(shape, inferred)])
    return [y]
