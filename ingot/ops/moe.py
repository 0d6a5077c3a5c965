"""Mixture-of-experts routing ops: top_k, take_along_axis, gather_matmul, quantized_gather_matmul.

A mixture-of-experts feed-forward routes each token to k of E experts:

    probs   = softmax(h @ router)                              [T, E]
    chosen  = top_k(probs, k)                                  [T, k] int32, largest first
    weights = take_along_axis(probs, chosen, axis=-1)          [T, k]
    y       = gather_matmul(x, w_experts, chosen)              [T, k, N]   y[t, j] = x[t, j] @ w[chosen[t, j]]

gather_matmul's x is [T, S, K] with S = 1 (every chosen expert reads the token's one row: the gate
and up projections) or S = k (expert j reads row j: the down projection); w is [E, K, N].
quantized_gather_matmul is gather_matmul over dequantize(q, params) (the fuse_dequantize pass forms
it): sources (x, chosen, q, *params), attributes those of the dequantize, q [E, K, N] with its
parameters block-broadcast over it. Its reference dequantizes only the experts some token chose,
one at a time: there is never a float copy of all experts.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Op, TensorType
from . import fail, normalize_axis, register
from .quant import _dequantize_rule, dequantize_values, unpack

INDEX_DTYPES = (dt.int32, dt.int64)


def _top_k_rule(types, attrs):
    (x,) = types
    k = attrs.get("k")
    if not x.dtype.is_float or x.rank < 1 or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise fail(Op.TOP_K, types, "a float tensor of rank >= 1 and k >= 1")
    if x.shape[-1] is not None and k > x.shape[-1]:
        raise fail(Op.TOP_K, types, f"k ({k}) at most the last axis ({x.shape[-1]})")
    return TensorType(x.shape[:-1] + (k,), dt.int32)


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """int32 indices of the k largest entries along the last axis, largest first (ties: lower index first)."""
    return np.argsort(-x.astype(np.float32), axis=-1, kind="stable")[..., :k].astype(np.int32)


register(Op.TOP_K, _top_k_rule, lambda xs, a: top_k(xs[0], a["k"]))


def _take_along_axis_rule(types, attrs):
    x, idx = types
    axis = normalize_axis(Op.TAKE_ALONG_AXIS, attrs["axis"], x.rank)
    if idx.dtype not in INDEX_DTYPES or idx.rank != x.rank or any(
            i != axis and a is not None and b is not None and a != b for i, (a, b) in enumerate(zip(x.shape, idx.shape))):
        raise fail(Op.TAKE_ALONG_AXIS, types, "int32/int64 indices of the input's rank, equal dims off the axis")
    return TensorType(idx.shape, x.dtype)


def take_along_axis(x: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    n = x.shape[axis]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IngotError(f"take_along_axis: indices span {idx.min()}..{idx.max()} but axis {axis} has {n} entries.")
    return np.take_along_axis(x, idx.astype(np.intp), axis=axis)


register(Op.TAKE_ALONG_AXIS, _take_along_axis_rule, lambda xs, a: take_along_axis(xs[0], xs[1], a["axis"]))


def _routed_type(op: Op, types, x: TensorType, w: TensorType, idx: TensorType) -> TensorType:
    """[T, S, K] x [E, K, N] routed by [T, J] -> [T, J, N] (S = 1 or J)."""
    if not x.dtype.is_float or x.rank != 3 or w.rank != 3 or idx.rank != 2 or idx.dtype not in INDEX_DTYPES:
        raise fail(op, types, "x [T, S, K], experts [E, K, N] and int32/int64 choices [T, J]")
    t, s, k = x.shape
    if k is not None and w.shape[1] is not None and k != w.shape[1]:
        raise fail(op, types, f"inner dimensions that agree ({k} vs {w.shape[1]})")
    if t is not None and idx.shape[0] is not None and t != idx.shape[0]:
        raise fail(op, types, f"one row of choices per token ({idx.shape[0]} vs {t})")
    if s is not None and s != 1 and idx.shape[1] is not None and s != idx.shape[1]:
        raise fail(op, types, f"x with 1 or {idx.shape[1]} rows per token, not {s}")
    return TensorType((t if t is not None else idx.shape[0], idx.shape[1], w.shape[2]), x.dtype)


def _gather_matmul_rule(types, attrs):
    x, w, idx = types
    if w.dtype != x.dtype:
        raise fail(Op.GATHER_MATMUL, types, "experts of the input's dtype")
    return _routed_type(Op.GATHER_MATMUL, types, x, w, idx)


def routed_matmul(x: np.ndarray, idx: np.ndarray, experts: int, expert_matmul) -> np.ndarray:
    """out[t, j] = expert_matmul(e, x[t, j or 0] rows) for e = idx[t, j], one call per chosen expert."""
    t, j = idx.shape
    if idx.size and (idx.min() < 0 or idx.max() >= experts):
        raise IngotError(f"gather_matmul: expert choices span {idx.min()}..{idx.max()} but there are {experts} experts.")
    flat = idx.reshape(-1)
    rows = x.reshape(t * x.shape[1], x.shape[2])
    source = np.arange(t * j) if x.shape[1] == j else np.repeat(np.arange(t), j)  # the x row each choice reads
    out = None
    for e in np.unique(flat):
        picks = np.flatnonzero(flat == e)
        y = expert_matmul(int(e), rows[source[picks]])
        if out is None:
            out = np.zeros((t * j, y.shape[-1]), np.float32)
        out[picks] = y
    if out is None:
        raise IngotError("gather_matmul: no token to route.")
    return out.reshape(t, j, -1)


def _gather_matmul(xs, attrs):
    x, w, idx = xs
    return routed_matmul(x.astype(np.float32), idx, w.shape[0],
                         lambda e, rows: rows @ w[e].astype(np.float32)).astype(x.dtype)


register(Op.GATHER_MATMUL, _gather_matmul_rule, _gather_matmul)


def _quantized_gather_matmul_rule(types, attrs):
    x, idx = types[0], types[1]
    w = _dequantize_rule(types[2:], attrs)
    if w.dtype != x.dtype:
        raise fail(Op.QUANTIZED_GATHER_MATMUL, types, "experts that dequantize to the input's dtype")
    return _routed_type(Op.QUANTIZED_GATHER_MATMUL, types, x, w, idx)


def expert_params(params, e: int) -> list[np.ndarray]:
    """Expert e's block-broadcast parameters (2-D, or 3-D for a table): a view, never a copy."""
    return [p[0] if p.shape[0] == 1 else p[e] for p in params]


def quantized_gather_matmul_reference(xs, attrs):
    x, idx, q, params = xs[0], xs[1], xs[2], xs[3:]
    qdtype = attrs["qdtype"]

    def expert(e, rows):   # one expert [K, N], dequantized alone
        w = dequantize_values(unpack(q[e], qdtype), expert_params(params, e), dict(attrs, dtype=dt.float32))
        return rows @ w
    return routed_matmul(x.astype(np.float32), idx, q.shape[0], expert).astype(x.dtype)


register(Op.QUANTIZED_GATHER_MATMUL, _quantized_gather_matmul_rule, quantized_gather_matmul_reference)
