"""Compiled CPU kernels (numba) for what NumPy cannot do fast: quantized GEMV straight from packed
weights, decode attention over a cache prefix, and row-wise normalisation. Each is tested against the
NumPy reference of its op (tests/test_cpu_kernels.py).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from ...ir import Node
from ...ops import nn as nn_ops
from ...ops import quant as quant_ops

GEMV_MAX_ROWS = 16  # up to this many rows of x the packed kernel runs; above, tiles of W go through BLAS


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_packed4(x_even, x_odd, x_block_sum, q, scale, offset, flip, out):
    """out[m, n] = sum_b scale[n,b] * sum_j q[n,b,j] x[m,b,j] + offset[n,b] * sum_j x[m,b,j].

    q: [N, K/2] bytes, low nibble = even k. x_even/x_odd: [M, K/2] (x deinterleaved).
    flip = 8 makes nibbles signed (int4), 0 leaves them unsigned (uint4).
    """
    m_rows, half = x_even.shape
    n_rows = q.shape[0]
    nb = scale.shape[1]
    bh = half // nb
    for n in prange(n_rows):
        for m in range(m_rows):
            acc = 0.0
            for b in range(nb):
                s = np.float32(0.0)
                base = b * bh
                for j in range(base, base + bh):
                    byte = q[n, j]
                    lo = np.float32(((byte & 15) ^ flip) - flip)
                    hi = np.float32(((byte >> 4) ^ flip) - flip)
                    s += lo * x_even[m, j] + hi * x_odd[m, j]
                acc += scale[n, b] * s + offset[n, b] * x_block_sum[m, b]
            out[m, n] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _gemv_int8(x, x_block_sum, q, scale, offset, out):
    m_rows, k = x.shape
    n_rows = q.shape[0]
    nb = scale.shape[1]
    bs = k // nb
    for n in prange(n_rows):
        for m in range(m_rows):
            acc = 0.0
            for b in range(nb):
                s = np.float32(0.0)
                for j in range(b * bs, (b + 1) * bs):
                    s += np.float32(q[n, j]) * x[m, j]
                acc += scale[n, b] * s + offset[n, b] * x_block_sum[m, b]
            out[m, n] = acc


def _canonical_params(params, attrs, n_rows: int, n_blocks_max: int):
    """scale and offset as [N, nb] (views where possible): w = q * scale + offset per block."""
    scale = params[0]
    i = 1
    zero_point = params[i] if attrs.get("has_zero_point") else None
    i += zero_point is not None
    bias = params[i] if attrs.get("has_bias") else None
    nb = max(p.shape[1] for p in params)
    shape = (n_rows, nb)
    scale_f = np.broadcast_to(scale.astype(np.float32, copy=False), shape)
    offset = np.zeros(shape, np.float32) if bias is None else np.broadcast_to(bias.astype(np.float32, copy=False), shape)
    if zero_point is not None:
        offset = offset - np.broadcast_to(zero_point.astype(np.float32), shape) * scale_f
    return scale_f, offset, nb


def quantized_matmul_step(node: Node, out):
    attrs = node.attrs
    qdtype = attrs["qdtype"]
    fast = attrs["mode"] == "affine" and attrs.get("transpose") and node.dtype.name == "float32"
    reference = quant_ops.quantized_matmul_reference

    def step(x, q, *params):
        rows = int(np.prod(x.shape[:-1]))
        if not fast or rows > GEMV_MAX_ROWS:
            return reference((x, q) + params, attrs)
        n_rows, k = q.shape[0], x.shape[-1]
        scale, offset, nb = _canonical_params(params, attrs, n_rows, k)
        if k % nb or (qdtype.packed and (k // nb) % 2):
            return reference((x, q) + params, attrs)
        x2 = np.ascontiguousarray(x.reshape(rows, k), dtype=np.float32)
        xsum = x2.reshape(rows, nb, k // nb).sum(axis=2)
        result = np.empty((rows, n_rows), np.float32)
        if qdtype.packed:
            _gemv_packed4(np.ascontiguousarray(x2[:, 0::2]), np.ascontiguousarray(x2[:, 1::2]), xsum, q,
                          scale, offset, 8 if qdtype.kind == "i" else 0, result)
        else:
            _gemv_int8(x2, xsum, q, scale, offset, result)
        return result.reshape(x.shape[:-1] + (n_rows,))
    return step


@njit(parallel=True, fastmath=True, cache=True)
def _attention(q, k, v, length, scale, causal, out):
    """q: [B, Hq, Tq, D]; k, v: [B, Hk, Tk, D]; keys >= length ignored; causal aligned to length."""
    nbatch, hq, tq, d = q.shape
    hk = k.shape[1]
    dv = v.shape[3]
    group = hq // hk
    for job in prange(nbatch * hq):
        b = job // hq
        h = job % hq
        kh = h // group
        scores = np.empty(length, np.float32)
        for t in range(tq):
            limit = length
            if causal:
                limit = min(length, t + 1 + length - tq)
            if limit <= 0:
                for e in range(dv):
                    out[b, h, t, e] = 0.0
                continue
            best = -np.inf
            for j in range(limit):
                s = np.float32(0.0)
                for e in range(d):
                    s += q[b, h, t, e] * k[b, kh, j, e]
                s *= scale
                scores[j] = s
                if s > best:
                    best = s
            total = np.float32(0.0)
            for j in range(limit):
                p = math.exp(scores[j] - best)
                scores[j] = p
                total += p
            for e in range(dv):
                out[b, h, t, e] = 0.0
            for j in range(limit):
                p = scores[j] / total
                for e in range(dv):
                    out[b, h, t, e] += p * v[b, kh, j, e]


def sdpa_step(node: Node):
    attrs = node.attrs
    scale_attr = attrs.get("scale")
    f32 = node.dtype.name == "float32" and node.type.rank == 4

    def step(q, k, v, *rest):
        if attrs.get("has_mask") or not f32 or q.shape[0] != k.shape[0]:
            return nn_ops._sdpa((q, k, v) + rest, attrs)
        length = int(rest[0]) if attrs.get("has_length") else k.shape[2]
        scale = np.float32(scale_attr if scale_attr is not None else 1.0 / math.sqrt(q.shape[-1]))
        out = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
        _attention(q, k, v, length, scale, attrs.get("causal", False), out)
        return out
    return step


@njit(fastmath=True, cache=True)
def _rms_norm_rows(x, w, eps, out):
    for r in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(x.shape[1]):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / x.shape[1] + eps)
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * inv * w[i]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rms_norm_rows(x2, w, eps, out)
    return out.reshape(x.shape)


@numba.vectorize(["float32(float32)"], cache=True, fastmath=True)
def silu(x):
    return x / (np.float32(1.0) + math.exp(-x))


def rope_step(node: Node):
    attrs = node.attrs
    base, interleaved = attrs.get("base", 10000.0), attrs.get("interleaved", False)
    rotary_dims = attrs.get("rotary_dims")
    cache: dict = {}

    def step(x, pos, inv_freq=None):
        d = x.shape[-1]
        rd = rotary_dims or d
        if inv_freq is None:
            inv_freq = cache.get(rd)
            if inv_freq is None:
                inv_freq = cache[rd] = nn_ops.rope_inv_freq(rd, base)
        t = x.shape[-2]
        positions = int(pos) + np.arange(t) if np.ndim(pos) == 0 else np.asarray(pos)
        cos, sin = nn_ops.rope_cos_sin(positions, inv_freq)
        if x.dtype != np.float32:
            return nn_ops.rope(x, pos, inv_freq, base, interleaved, rotary_dims)
        out = np.array(x, dtype=np.float32, copy=True)
        if interleaved:
            x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
            out[..., 0:rd:2] = x1 * cos - x2 * sin
            out[..., 1:rd:2] = x2 * cos + x1 * sin
        else:
            h = rd // 2
            x1, x2 = x[..., :h], x[..., h:rd]
            out[..., :h] = x1 * cos - x2 * sin
            out[..., h:rd] = x2 * cos + x1 * sin
        return out
    return step
