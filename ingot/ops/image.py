"""Sampling images at given points: grid_sample (ONNX GridSample, torch's grid_sample).

    x [N, C, D1..Dr]   grid [N, O1..Ok, r] (points in [-1, 1], the last spatial axis first)
    -> y [N, C, O1..Ok]

attrs: mode ("linear", "nearest" (halves to even) or "cubic": Keys' kernel, a = -0.75), padding
("zeros", "border" or "reflection") and align_corners (whether -1 and 1 are the centres of the edge
pixels, else their outer edges). Points outside the image are first clamped (border) or reflected
(reflection) into it; taps outside it then read 0 (zeros), the edge pixel (border) or their mirror
(reflection). Separable: the value is the sum over the taps of each axis of the product of the
axes' weights.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..ir import Op, TensorType
from . import compute_dtype, fail, register

MODES = ("linear", "nearest", "cubic")
PADDINGS = ("zeros", "border", "reflection")


def _grid_sample_rule(types, attrs):
    x, grid = types
    r = x.rank - 2
    if r < 1 or not x.dtype.is_float or grid.dtype != x.dtype or grid.rank != r + 2 or grid.shape[-1] != r \
            or grid.shape[0] != x.shape[0]:
        raise fail(Op.GRID_SAMPLE, types, "float x [N, C, spatial...] and a grid [N, out..., rank of spatial] of its dtype")
    if attrs.get("mode", "linear") not in MODES or attrs.get("padding", "zeros") not in PADDINGS:
        raise fail(Op.GRID_SAMPLE, types, f"a mode among {MODES} and a padding among {PADDINGS}")
    if attrs.get("mode") == "cubic" and r != 2:
        raise fail(Op.GRID_SAMPLE, types, "two spatial axes for cubic sampling")
    return TensorType((x.shape[0], x.shape[1], *grid.shape[1:-1]), x.dtype)


def _reflect(v, lo: float, hi: float):
    """v folded into [lo, hi] by reflecting at the nearer border, as often as it takes."""
    span = hi - lo
    if span <= 0:
        return np.full_like(v, lo)
    below, above = v < lo, v > hi
    d = np.where(below, lo - v, np.where(above, v - hi, 0))
    n = np.floor(d / span)
    rest = d - n * span
    even = n % 2 == 0
    return np.where(below, np.where(even, lo + rest, hi - rest), np.where(above, np.where(even, hi - rest, lo + rest), v))


def _cubic_weights(t):
    a = -0.75
    t1, t2, t3 = t + 1, 1 - t, 2 - t
    return [((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a, ((a + 2) * t - (a + 3)) * t * t + 1,
            ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1, ((a * t3 - 5 * a) * t3 + 8 * a) * t3 - 4 * a]


def grid_sample(x: np.ndarray, grid: np.ndarray, mode: str = "linear", padding: str = "zeros",
                align_corners: bool = False) -> np.ndarray:
    dtype = x.dtype
    xc, gc = x.astype(compute_dtype(x)), grid.astype(compute_dtype(grid))
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    r = len(spatial)
    out_shape = (n, c, *grid.shape[1:-1])
    if 0 in out_shape:
        return np.zeros(out_shape, dtype)
    points = gc[..., ::-1]                        # [N, O..., r], spatial axis order
    taps_per_axis = []
    for axis, size in enumerate(spatial):
        g = points[..., axis]
        v = (g + 1) / 2 * (size - 1) if align_corners else ((g + 1) * size - 1) / 2
        lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        if mode == "nearest":
            v = np.rint(v)
        if padding == "border":
            v = np.where((v < lo) | (v > hi), np.clip(v, 0, size - 1), v)
        elif padding == "reflection":
            v = _reflect(v, lo, hi)
        if mode == "nearest":
            starts, weights = [np.trunc(v)], [np.ones_like(v)]
        else:
            base = np.floor(v)
            t = v - base
            offsets = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
            starts = [base + o for o in offsets]
            weights = [1 - t, t] if mode == "linear" else _cubic_weights(t)
        taps = []
        for index, weight in zip(starts, weights):
            valid = np.ones(index.shape, bool)
            if padding == "zeros":
                valid = (index >= 0) & (index < size)
            elif padding == "border":
                index = np.clip(index, 0, size - 1)
            else:
                index = np.trunc(_reflect(index, lo, hi))
            taps.append((np.clip(index, 0, size - 1).astype(np.int64), np.where(valid, weight, 0)))
        taps_per_axis.append(taps)
    channels_last = np.moveaxis(xc, 1, -1)       # [N, spatial..., C]
    batch = np.arange(n).reshape((n,) + (1,) * (points.ndim - 2))
    out = np.zeros(points.shape[:-1] + (c,), xc.dtype)
    for combo in itertools.product(*taps_per_axis):
        weight = np.prod([w for _, w in combo], axis=0)
        out += weight[..., None] * channels_last[(batch, *[i for i, _ in combo])]
    return np.moveaxis(out, -1, 1).astype(dtype)


register(Op.GRID_SAMPLE, _grid_sample_rule, lambda xs, a: grid_sample(
    xs[0], xs[1], a.get("mode", "linear"), a.get("padding", "zeros"), bool(a.get("align_corners", False))))
