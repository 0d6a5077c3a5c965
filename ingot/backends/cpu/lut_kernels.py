"""numba kernels for quantized_matmul with lookup-table (LUT) weights on the CPU.

The weight is k-major (transpose=False): q [K, N] indices (4-bit packed two per byte along N, or
8-bit), one table per group of output columns: lut [1, G, 2**bits] (G divides N; one table per
tensor is G = 1). A GEMV turns, for every k, the tables into the 2**bits products x[k] * table
(G * 2**bits multiplies) and then adds one product per weight: a table lookup and an add, no
per-weight multiply. Many rows (prefill) dequantize K-tiles through the tables and use BLAS.
Tested against the NumPy reference of quantized_matmul (tests/test_quant_lut_kernels.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...ir import Node
from ...ops import quant as quant_ops

GEMV_MAX_ROWS = 16
TILE_ELEMENTS = 1 << 21
_opts = dict(fastmath=True, cache=True, nogil=True)


@njit(**_opts)
def lut_gemv_packed4(x, q, tables, out):
    """out[m, n] = sum_k x[m, k] * tables[n // (N / G), q[k, n]]; q [K, N/2] packed, tables [G, 16].
    Groups of >= 16 columns: per k, the G x 16 products x[k] * table, then one lookup and add per
    weight; narrower groups (one table per column or two): a lookup and a multiply-add per weight."""
    m_rows, k = x.shape
    half = q.shape[1]
    groups = tables.shape[0]
    width = 2 * half // groups                       # output columns per table
    pairs = max(width // 2, 1)                       # bytes per table when width is even
    prod = np.empty((groups, 16), np.float32)
    acc_e = np.empty(half, np.float32)
    acc_o = np.empty(half, np.float32)
    for m in range(m_rows):
        acc_e[:] = 0
        acc_o[:] = 0
        for kk in range(k):
            xv = x[m, kk]
            row = q[kk]
            if width >= 16 and width % 2 == 0:
                for g in range(groups):
                    for v in range(16):
                        prod[g, v] = tables[g, v] * xv
                for g in range(groups):
                    p = prod[g]
                    for i in range(g * pairs, (g + 1) * pairs):
                        byte = row[i]
                        acc_e[i] += p[byte & np.uint8(15)]
                        acc_o[i] += p[byte >> np.uint8(4)]
            else:
                for i in range(half):
                    byte = row[i]
                    acc_e[i] += tables[(2 * i) // width, byte & np.uint8(15)] * xv
                    acc_o[i] += tables[(2 * i + 1) // width, byte >> np.uint8(4)] * xv
        for i in range(half):
            out[m, 2 * i] = acc_e[i]
            out[m, 2 * i + 1] = acc_o[i]


@njit(**_opts)
def lut_gemv_int8(x, q, tables, out):
    """out[m, n] = sum_k x[m, k] * tables[n // (N / G), q[k, n]]; q [K, N] uint8, tables [G, 256]."""
    m_rows, k = x.shape
    n = q.shape[1]
    groups, entries = tables.shape
    width = n // groups
    acc = np.empty(n, np.float32)
    for m in range(m_rows):
        acc[:] = 0
        for kk in range(k):
            xv = x[m, kk]
            row = q[kk]
            for g in range(groups):
                t = tables[g]
                for i in range(g * width, (g + 1) * width):
                    acc[i] += t[row[i]] * xv
        for i in range(n):
            out[m, i] = acc[i]


@njit(**_opts)
def lut_tile(q, tables, packed, k0, k1, out):
    """out[k - k0, n] = tables[n // width, q[k, n]] for k in k0..k1."""
    groups = tables.shape[0]
    n = out.shape[1]
    width = n // groups
    for kk in range(k0, k1):
        row = q[kk]
        for i in range(n):
            if packed:
                byte = row[i // 2]
                v = (byte >> np.uint8(4)) if i % 2 else (byte & np.uint8(15))
            else:
                v = row[i]
            out[kk - k0, i] = tables[i // width, v]


def lut_matmul_step(node: Node, out):
    """A step for a k-major LUT quantized_matmul with one table per column group, or None (the
    caller then uses the reference)."""
    attrs = node.attrs
    if attrs.get("mode") != "lut" or attrs.get("transpose") or node.dtype.name != "float32":
        return None
    if attrs["qdtype"].name not in ("uint4", "uint8"):
        return None
    packed = attrs["qdtype"].packed
    reference = quant_ops.quantized_matmul_reference
    prepared: dict = {}

    def step(x, q, lut):
        if lut.ndim != 3 or lut.shape[0] != 1:
            return reference((x, q, lut), attrs)
        tables = prepared.get(id(lut))
        if tables is None:
            tables = prepared[id(lut)] = (np.ascontiguousarray(lut[0], dtype=np.float32), lut)
        tables = tables[0]
        k = x.shape[-1]
        n = q.shape[1] * (2 if packed else 1)
        x2 = x.reshape(-1, k)
        if not x2.flags.c_contiguous or x2.dtype != np.float32:
            x2 = np.ascontiguousarray(x2, dtype=np.float32)
        rows = x2.shape[0]
        if rows <= GEMV_MAX_ROWS:
            result = np.empty((rows, n), np.float32)
            (lut_gemv_packed4 if packed else lut_gemv_int8)(x2, q, tables, result)
        else:
            tile_k = max(1, min(k, TILE_ELEMENTS // n))
            tile = np.empty((tile_k, n), np.float32)
            result = None
            for k0 in range(0, k, tile_k):
                k1 = min(k, k0 + tile_k)
                t = tile[: k1 - k0]
                lut_tile(q, tables, packed, k0, k1, t)
                part = x2[:, k0:k1] @ t
                result = part if result is None else result + part
        return result.reshape(x.shape[:-1] + (n,))
    return step


# -- scaled lookup tables (GGUF's IQ types, MXFP4): w = table[q] * scale[block] ----------------------


def _scaled_lut_gemv_packed4(x, q, table, scale, b0, b1, out):
    """out[m, :] = x[m, rows of blocks b0..b1) @ W[those rows] for a k-major scaled-table weight:
    q [K, N/2] 4-bit codes (low nibble = even column), table [16], scale [K / block, N] float32.
    Per row k of W: the 16 products x[k] * table, then a lookup and an add per weight; per block
    the sums are scaled once (as _kmajor_packed4 does with integers)."""
    m_rows, k = x.shape
    half = q.shape[1]
    nb = scale.shape[0]
    bs = k // nb
    prod = np.empty(16, np.float32)
    acc_e = np.empty(half, np.float32)
    acc_o = np.empty(half, np.float32)
    res_e = np.empty(half, np.float32)
    res_o = np.empty(half, np.float32)
    for m in range(m_rows):
        res_e[:] = 0
        res_o[:] = 0
        for b in range(b0, b1):
            acc_e[:] = 0
            acc_o[:] = 0
            for kk in range(b * bs, b * bs + bs):
                xv = x[m, kk]
                for v in range(16):
                    prod[v] = table[v] * xv
                row = q[kk]
                for i in range(half):
                    byte = np.uint32(row[i])
                    acc_e[i] += prod[byte & np.uint32(15)]
                    acc_o[i] += prod[byte >> np.uint32(4)]
            srow = scale[b]
            for i in range(half):
                res_e[i] += acc_e[i] * srow[2 * i]
                res_o[i] += acc_o[i] * srow[2 * i + 1]
        for i in range(half):
            out[m, 2 * i] = res_e[i]
            out[m, 2 * i + 1] = res_o[i]


scaled_lut_gemv_packed4 = njit(**_opts)(_scaled_lut_gemv_packed4)


@njit(**_opts)
def scaled_lut_tile_packed4(q, table, scale, k0, k1, block, out):
    """out[k - k0, n] = table[q[k, n]] * scale[k // block, n] for k in k0..k1 (4-bit codes)."""
    half = q.shape[1]
    for kk in range(k0, k1):
        row = q[kk]
        srow = scale[kk // block]
        for i in range(half):
            byte = np.uint32(row[i])
            out[kk - k0, 2 * i] = table[byte & np.uint32(15)] * srow[2 * i]
            out[kk - k0, 2 * i + 1] = table[byte >> np.uint32(4)] * srow[2 * i + 1]


def scaled_lut_matmul_step(node: Node, out):
    """A step for a k-major scaled-table quantized_matmul (4-bit codes, one table, a scale per block
    of K rows and output column), or None (the caller then uses the reference)."""
    from . import kernels

    attrs = node.attrs
    if attrs.get("mode") != "scaled_lut" or attrs.get("transpose") or node.dtype.name != "float32" \
            or attrs["qdtype"].name not in ("uint4", "int4"):
        return None
    reference = quant_ops.quantized_matmul_reference
    prepared: dict = {}

    def prepare(q, lut, scale):
        key = (id(q), id(lut), id(scale))
        hit = prepared.get(key)
        if hit is None:
            n = q.shape[1] * 2
            table = None
            if lut.ndim == 3 and lut.shape[:2] == (1, 1) and scale.ndim == 2 and scale.shape[1] in (1, n):
                # (int4 codes are read as raw nibbles: nibble 15 is code -1, which indexes
                # table[-1] = table[15] in the reference too)
                table = np.ascontiguousarray(lut.reshape(16), dtype=np.float32)
                full = np.ascontiguousarray(np.broadcast_to(scale.astype(np.float32, copy=False), (scale.shape[0], n)))
                table.flags.writeable = False
                full.flags.writeable = False
                qv = q.view(np.uint8)
                qv.flags.writeable = False
                table = (table, full, qv)
            hit = prepared[key] = (table, (q, lut, scale))  # the arrays kept: ids stay valid
        return hit[0]

    def step(x, q, lut, scale):
        ready = prepare(q, lut, scale)
        k = x.shape[-1]
        if ready is None or k % ready[1].shape[0]:
            return reference((x, q, lut, scale), attrs)
        table, full, qv = ready
        nb, n = full.shape
        x2 = x.reshape(-1, k)
        if not x2.flags.c_contiguous or x2.dtype != np.float32:
            x2 = np.ascontiguousarray(x2, dtype=np.float32)
        rows = x2.shape[0]
        if rows <= GEMV_MAX_ROWS:
            result = np.empty((rows, n), np.float32)
            kernels.split_blocks(scaled_lut_gemv_packed4, (x2, qv, table, full), nb, result, k * n)
        else:
            block = k // nb
            tile_k = max(block, min(k, TILE_ELEMENTS // n) // block * block)
            tile = np.empty((min(tile_k, k), n), np.float32)
            result = None
            for k0 in range(0, k, tile_k):
                k1 = min(k, k0 + tile_k)
                t = tile[: k1 - k0]
                scaled_lut_tile_packed4(qv, table, full, k0, k1, block, t)
                part = x2[:, k0:k1] @ t
                result = part if result is None else result + part
        return result.reshape(x.shape[:-1] + (n,))
    return step
