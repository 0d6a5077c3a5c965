"""CONV: an N-d convolution (cross-correlation, as ONNX and PyTorch define it) of x [N, C, *spatial] with
w [M, C / groups, *kernel], plus an optional bias [M]; attrs `strides`, `dilations`, `pads` ((before,
after) per spatial axis, zeros) and `groups`. The output is [N, M, *out] with
out = (size + before + after - dilation * (kernel - 1) - 1) // stride + 1.

The reference takes windows of the padded input as a strided view and contracts them with the weights
per group; backends run their own kernels (backends/cpu/conv.py, torch on CUDA).
"""
from __future__ import annotations

import numpy as np

from ..ir import Op, TensorType
from . import fail, register


def out_size(size: int | None, kernel: int, stride: int, dilation: int, before: int, after: int) -> int | None:
    if size is None:
        return None
    return (size + before + after - dilation * (kernel - 1) - 1) // stride + 1


def _conv_rule(types, attrs):
    x, w = types[0], types[1]
    k = x.rank - 2
    expected = "x [N, C, *spatial] and w [M, C / groups, *kernel] of one float dtype, bias [M]"
    if k < 1 or w.rank != x.rank or x.dtype != w.dtype or not x.dtype.is_float or x.dtype.packed:
        raise fail(Op.CONV, types, expected)
    strides, dilations, pads, groups = attrs["strides"], attrs["dilations"], attrs["pads"], attrs["groups"]
    if len(strides) != k or len(dilations) != k or len(pads) != k or groups < 1 \
            or min(strides) < 1 or min(dilations) < 1 or min(min(p) for p in pads) < 0:
        raise fail(Op.CONV, types, f"{k} strides and dilations >= 1, {k} (before, after) pads >= 0 and groups >= 1")
    m, cg, kernel = w.shape[0], w.shape[1], w.shape[2:]
    c = x.shape[1]
    if m is None or cg is None or any(d is None for d in kernel) or m % groups \
            or (c is not None and c != cg * groups):
        raise fail(Op.CONV, types, f"{expected} (groups {groups}, static weights)")
    if len(types) == 3 and (types[2].shape != (m,) or types[2].dtype != x.dtype):
        raise fail(Op.CONV, types, expected)
    out = tuple(out_size(s, kk, st, d, lo, hi) for s, kk, st, d, (lo, hi) in zip(x.shape[2:], kernel, strides, dilations, pads))
    if any(o is not None and o < 1 for o in out):
        raise fail(Op.CONV, types, f"a window that fits the padded input (output size {out})")
    return TensorType((x.shape[0], m) + out, x.dtype)


def conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides, dilations, pads, groups: int) -> np.ndarray:
    k = x.ndim - 2
    n, c = x.shape[:2]
    m, cg, kernel = w.shape[0], w.shape[1], w.shape[2:]
    wide = np.float64 if x.dtype == np.float64 else np.float32
    xp = np.pad(x.astype(wide, copy=False), [(0, 0), (0, 0)] + [tuple(p) for p in pads])
    out = tuple(out_size(s, kk, st, d, 0, 0) for s, kk, st, d in zip(xp.shape[2:], kernel, strides, dilations))
    # windows [N, C, *out, *kernel] as a view: element (o, j) of axis a reads o * stride + j * dilation
    inner = xp.strides[2:]
    view = np.lib.stride_tricks.as_strided(
        xp, (n, c) + out + tuple(kernel),
        xp.strides[:2] + tuple(s * st for s, st in zip(inner, strides)) + tuple(s * d for s, d in zip(inner, dilations)),
        writeable=False)
    mg = m // groups
    y = np.empty((n, m) + out, wide)
    spatial = "".join(chr(ord("p") + i) for i in range(k))
    taps = "".join(chr(ord("h") + i) for i in range(k))
    for g in range(groups):
        part = view[:, g * cg:(g + 1) * cg]
        wg = w[g * mg:(g + 1) * mg].astype(wide, copy=False)
        y[:, g * mg:(g + 1) * mg] = np.einsum(f"nc{spatial}{taps},mc{taps}->nm{spatial}", part, wg, optimize=True)
    if bias is not None:
        y += bias.astype(wide).reshape((m,) + (1,) * k)
    return y.astype(x.dtype, copy=False)


register(Op.CONV, _conv_rule, lambda xs, a: conv(xs[0], xs[1], xs[2] if len(xs) > 2 else None, a["strides"],
                                                 a["dilations"], a["pads"], a["groups"]))

