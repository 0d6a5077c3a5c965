"""numba kernels of the table quantizers (quantize.py): the nearest table entry of each weight, and the
two-level line search of lut4:bB:offset:k. A module of their own so that importing ingot.quant (the CLI
does, before it refuses bad arguments) does not import numba."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")   # (a zero scale: inf or NaN, as NumPy divides)
def count_mids_below(blocks, scale, mids, group, codes):
    """codes[r, b, i] = how many of mids[r // group] lie below blocks[r, b, i] / scale[r, b] (NaN: none)."""
    rows, nb, size = blocks.shape
    km = mids.shape[1]
    for r in range(rows):
        m = mids[r // group]
        for b in range(nb):
            s = scale[r, b]
            for i in range(size):
                v = blocks[r, b, i] / s
                c = 0
                for k in range(km):
                    c += v > m[k]
                codes[r, b, i] = c


@njit(cache=True, nogil=True, error_model="numpy")
def best_coded_lines(blocks, weights, tables, mids, group, cs, cm, d, dmin, top, scale, offset):
    """Per block [r, b] the codes (cs + ds, cm + dm), ds and dm in 0, -1, +1 (in that order; the first of
    equal errors kept), whose scale cs * d and offset -cm * dmin give the least error: the sum of
    weights * (w - (table[code] * scale + offset))**2 over the block, each w's code its nearest entry
    of (w - offset) / scale. weights [1 or rows, nb, size]."""
    rows, nb, size = blocks.shape
    km = mids.shape[1]
    for r in range(rows):
        t, m = tables[r // group], mids[r // group]
        wr = weights[r if weights.shape[0] > 1 else 0]
        for b in range(nb):
            best = np.inf
            for ds in (0, -1, 1):
                for dm in (0, -1, 1):
                    sc = np.float32(min(max(cs[r, b] + ds, 1), top) * d[r, b])
                    of = np.float32(-(min(max(cm[r, b] + dm, 0), top) * dmin[r, b]))
                    e = 0.0
                    for i in range(size):
                        x = blocks[r, b, i]
                        v = (x - of) / sc
                        c = 0
                        for j in range(km):
                            c += v > m[j]
                        diff = x - (t[c] * sc + of)
                        e += wr[b, i] * diff * diff
                    if e < best or (ds == 0 and dm == 0):
                        best, scale[r, b], offset[r, b] = e, sc, of
