"""pool_attention: one decode step of R independent sequences over a KV pool (`ingot serve`).

    q [R, Hq, D]  k [R, Hk, D]  v [R, Hk, Dv]  k_pool [S, Hk, C, D]  v_pool [S, Hk, C, Dv]
    slots [R] int32  positions [R] int32  ->  (out [R, Hq, Dv], k_pool', v_pool')

Row r's new key and value (already rotated) are written at position positions[r] of pool entry
slots[r] (rounded to the pool's dtype; an int8 pool takes two more sources, its row scales
k_scales [S, Hk, C, 1] and v_scales [S, Hk, C, 1] float32, each row stored as `nn.quantized_rows`
makes it, and gives them back updated too: (out, k_pool', v_pool', k_scales', v_scales')), then row r attends causally over that entry's first
positions[r] + 1 keys (widened to float32), GQA by head groups, with the SDPA op's `scale`,
`window` and `softcap`. Every write happens before any read; a row whose slot or position lies
outside the pool writes nothing and gives zeros. The pools come back updated: a graph assigns them
to the pool variables, and the compiler's inplace pass lets the backends write them in place, so one
executable with fixed buffers serves any combination of slots (a CUDA graph per row count).
"""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import fail, register
from .nn import dequantized_rows, quantized_rows, sdpa


def _pool_attention_rule(types, attrs):
    expect = ("q [R, Hq, D], k [R, Hk, D], v [R, Hk, Dv] of one float dtype, pools [S, Hk, C, D] and "
              "[S, Hk, C, Dv] of one float dtype, int32 slots and positions [R], Hq a multiple of Hk")
    if len(types) not in (7, 9) or any(not isinstance(t, TensorType) for t in types):
        raise fail(Op.POOL_ATTENTION, types, expect)
    q, k, v, kp, vp, slots, positions = types[:7]
    codes = len(types) == 9   # an int8 pool and its row scales
    if (q.rank, k.rank, v.rank, kp.rank, vp.rank, slots.rank, positions.rank) != (3, 3, 3, 4, 4, 1, 1) or \
            not q.dtype.is_float or k.dtype != q.dtype or v.dtype != q.dtype or \
            not (kp.dtype == dt.int8 if codes else kp.dtype.is_float) or \
            vp.dtype != kp.dtype or slots.dtype.name != "int32" or positions.dtype.name != "int32":
        raise fail(Op.POOL_ATTENTION, types, expect)
    if codes and any(s.dtype != dt.float32 or s.shape != p.shape[:3] + (1,) for s, p in zip(types[7:], (kp, vp))):
        raise fail(Op.POOL_ATTENTION, types, "int8 pools with float32 row scales [S, Hk, C, 1]")
    rows = {q.shape[0], k.shape[0], v.shape[0], slots.shape[0], positions.shape[0]} - {None}
    hq, hk, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    if len(rows) > 1 or k.shape[2] != d or v.shape[1] != hk or kp.shape[1:] != (hk, kp.shape[2], d) or \
            vp.shape[:3] != kp.shape[:3] or vp.shape[3] != dv or (hq is not None and hk and hq % hk):
        raise fail(Op.POOL_ATTENTION, types, expect)
    window, softcap, scale = attrs.get("window", 0), attrs.get("softcap", 0.0), attrs.get("scale")
    if not isinstance(window, int) or window < 0 or not isinstance(softcap, (int, float)) or softcap < 0 or \
            (scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale))):
        raise fail(Op.POOL_ATTENTION, types, "window >= 0, softcap >= 0 and a finite scale (or none)")
    return (TensorType((q.shape[0], hq, dv), q.dtype), kp, vp) + tuple(types[7:])


def pool_attention(q, k, v, k_pool, v_pool, slots, positions, k_scales=None, v_scales=None, scale=None, window=0,
                   softcap=0.0, inplace=False):
    """The reference: (out, k_pool', v_pool'[, k_scales', v_scales']), the pools copied (written where
    they lie with inplace, as a backend does)."""
    pools = [k_pool, v_pool] + ([k_scales, v_scales] if k_scales is not None else [])
    if not inplace:
        pools = [p.copy() for p in pools]
    n_slots, context = k_pool.shape[0], k_pool.shape[2]
    valid = [0 <= int(s) < n_slots and 0 <= int(p) < context for s, p in zip(slots, positions)]
    for r, ok in enumerate(valid):
        if not ok:
            continue
        at = (int(slots[r]), slice(None), int(positions[r]))
        if len(pools) == 4:
            (pools[0][at], pools[2][at]), (pools[1][at], pools[3][at]) = quantized_rows(k[r]), quantized_rows(v[r])
        else:
            pools[0][at], pools[1][at] = k[r].astype(k_pool.dtype), v[r].astype(v_pool.dtype)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    for r, ok in enumerate(valid):
        if ok:
            s, end = int(slots[r]), int(positions[r]) + 1
            keys, values = pools[0][s:s + 1, :, :end], pools[1][s:s + 1, :, :end]
            if len(pools) == 4:
                keys, values = dequantized_rows(keys, pools[2][s:s + 1, :, :end]), dequantized_rows(values, pools[3][s:s + 1, :, :end])
            out[r] = sdpa(q[r][None, :, None, :], keys, values, scale=scale, causal=True, window=window,
                          softcap=softcap)[0, :, 0]
    return (out, *pools)


register(Op.POOL_ATTENTION, _pool_attention_rule,
         lambda xs, a: pool_attention(*xs, scale=a.get("scale"), window=a.get("window", 0), softcap=a.get("softcap", 0.0)))
