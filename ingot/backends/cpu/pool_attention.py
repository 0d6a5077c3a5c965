"""The CPU lowering of pool_attention (ops/pool.py): the new rows written into the pools in place
(when the inplace pass allowed it), then each row's attention by the SDPA reference. The CPU server
keeps its own rows decoder (per-row caches, backends/cpu/rows_attention.py); this runs the pool
decoder on the CPU for tests and packages."""
from __future__ import annotations

import numpy as np

from ...ir import Node
from ...ops.nn import sdpa
from ...ops.pool import pool_attention


def pool_attention_lowering(node: Node, out):
    a = node.attrs
    scale, window, softcap = a.get("scale"), a.get("window", 0), a.get("softcap", 0.0)
    if not a.get("inplace") or len(node.src) == 9:   # (an int8 pool: quantized and read by the reference, in place)
        inplace = bool(a.get("inplace"))
        return lambda *xs: pool_attention(*xs, scale=scale, window=window, softcap=softcap, inplace=inplace)

    def step(q, k, v, k_pool, v_pool, slots, positions):
        n_slots, context = k_pool.shape[0], k_pool.shape[2]
        rows = [(r, int(s), int(p)) for r, (s, p) in enumerate(zip(slots, positions)) if 0 <= s < n_slots and 0 <= p < context]
        for r, s, p in rows:
            k_pool[s, :, p] = k[r]
            v_pool[s, :, p] = v[r]
        result = np.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
        for r, s, p in rows:
            result[r] = sdpa(q[r][None, :, None, :], k_pool[s:s + 1, :, :p + 1], v_pool[s:s + 1, :, :p + 1], scale=scale,
                             causal=True, window=window, softcap=softcap)[0, :, 0]
        return result, k_pool, v_pool
    return step
