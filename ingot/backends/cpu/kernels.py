"""Compiled CPU kernels (numba) for what NumPy cannot do fast: quantized GEMV and GEMM straight from
packed weights, the worker pool they split over, and the warm-up of every kernel. The row-wise
transformer kernels (attention, norms, RoPE) are in nn_kernels.py. Each is tested
against the NumPy reference of its op (tests/test_cpu_kernels.py).
"""
from __future__ import annotations

import dataclasses
import os
import weakref

import numpy as np
from numba import njit

from ... import dtypes as dt
from ...ir import Node
from ...ops import quant as quant_ops
from ...options import usable_cores
from . import decode_attention, rows_gemv, team, vnni
from .block_params import F16C, half_to_float, param, param_blocks, param_rows  # noqa: F401  (the kernels' reads)
from .nn_kernels import (XQ_BLOCK, _layer_norm_rows, _rms_norm_rows, attention, erf_rows, layer_norm, rms_norm,
                         rope_rows, rope_write_attend, round_rows)

GEMV_MAX_ROWS = 16  # up to this many rows of x the packed kernel runs; above, tiles of W go through BLAS
VNNI_ROWS = 64      # rows of x per call of the VNNI kernel past GEMV_MAX_ROWS (prefill, int8 activations)


def _kmajor_packed4(x, q, scale, offset, has_offset, flip, b0, b1, c0, c1, out):
    """out[:, c0:c1] = x[:, rows of blocks b0..b1) @ W[those rows, c0:c1] for a k-major 4-bit W:
    q [K, N/2] (low nibble = even column), scale and offset [K / block, N] (w = q * scale + offset),
    float32 or float16 bits (see param); c0, c1 even. int4 weights are read as uint4 (flip =
    0x88 turns each two's-complement nibble n into n + 8) with -8 * scale folded into the offset by
    the caller. Vectorised across output columns (8 bytes -> 8 int32 lanes -> float), one row of W
    at a time (streams best from memory; tiles of columns that kept the sums in L1 were slower from
    memory: a tile's run of each row is a page or less, and the prefetcher stops at pages); within a
    block of W every row of x in turn, so that W is read once however many rows x has (a server's batch)."""
    m_rows, k = x.shape
    nb = param_blocks(scale)
    bs = k // nb
    h0 = c0 // 2
    w = c1 // 2 - h0
    low, shift = np.uint32(15), np.uint32(4)
    acc_e = np.empty(w, np.float32)
    acc_o = np.empty(w, np.float32)
    res_e = np.zeros((m_rows, w), np.float32)
    res_o = np.zeros((m_rows, w), np.float32)
    for b in range(b0, b1):
        k0 = b * bs
        srow = param_rows(scale, b, 2 * h0, 2 * (h0 + w))
        orow = param_rows(offset, b if has_offset else 0, 2 * h0, 2 * (h0 + w))   # (read only when has_offset)
        for m in range(m_rows):
            acc_e[:] = 0
            acc_o[:] = 0
            for kk in range(k0, k0 + bs):
                xv = x[m, kk]
                row = q[kk, h0:h0 + w]   # a view: indices from 0 let LLVM vectorise (no wrap-around test)
                for i in range(w):  # int32 lanes: numba would widen uint8 arithmetic to int64
                    v = np.uint32(row[i]) ^ flip
                    acc_e[i] += np.float32(np.int32(v & low)) * xv
                    acc_o[i] += np.float32(np.int32(v >> shift)) * xv
            re, ro = res_e[m], res_o[m]
            for i in range(w):
                re[i] += acc_e[i] * param(srow, 2 * i)
                ro[i] += acc_o[i] * param(srow, 2 * i + 1)
            if has_offset:
                xs = np.float32(0.0)
                for kk in range(k0, k0 + bs):
                    xs += x[m, kk]
                for i in range(w):
                    re[i] += param(orow, 2 * i) * xs
                    ro[i] += param(orow, 2 * i + 1) * xs
    for m in range(m_rows):
        om = out[m, 2 * h0:2 * (h0 + w)]
        for i in range(w):
            om[2 * i] = res_e[m, i]
            om[2 * i + 1] = res_o[m, i]


def _kmajor_int8(x, q, scale, offset, has_offset, b0, b1, c0, c1, out):
    """out[:, c0:c1] = x[:, rows of blocks b0..b1) @ W[those rows, c0:c1] for a k-major 8-bit W:
    q [K, N], scale and offset [K / block, N]; int32 lanes, four rows of W per pass over the sums
    (1.4x faster than one row at a time); a column range and rows of x as in _kmajor_packed4."""
    m_rows, k = x.shape
    nb = param_blocks(scale)
    bs = k // nb
    t0, w = c0, c1 - c0
    acc = np.empty(w, np.float32)
    res = np.zeros((m_rows, w), np.float32)
    for b in range(b0, b1):
        k0 = b * bs
        k4 = k0 + bs // 4 * 4
        srow = param_rows(scale, b, t0, t0 + w)
        orow = param_rows(offset, b if has_offset else 0, t0, t0 + w)   # (read only when has_offset)
        for m in range(m_rows):
            acc[:] = 0
            for kk in range(k0, k4, 4):
                x0, x1, x2, x3 = x[m, kk], x[m, kk + 1], x[m, kk + 2], x[m, kk + 3]
                r0, r1 = q[kk, t0:t0 + w], q[kk + 1, t0:t0 + w]
                r2, r3 = q[kk + 2, t0:t0 + w], q[kk + 3, t0:t0 + w]
                for i in range(w):
                    acc[i] += (np.float32(np.int32(r0[i])) * x0 + np.float32(np.int32(r1[i])) * x1
                               + np.float32(np.int32(r2[i])) * x2 + np.float32(np.int32(r3[i])) * x3)
            for kk in range(k4, k0 + bs):
                xv = x[m, kk]
                row = q[kk, t0:t0 + w]
                for i in range(w):
                    acc[i] += np.float32(np.int32(row[i])) * xv
            r = res[m]
            for i in range(w):
                r[i] += acc[i] * param(srow, i)
            if has_offset:
                xs = np.float32(0.0)
                for kk in range(k0, k0 + bs):
                    xs += x[m, kk]
                for i in range(w):
                    r[i] += param(orow, i) * xs
    for m in range(m_rows):
        out[m, t0:t0 + w] = res[m, :w]


def _kmajor_packed4_xq(x, q, scale, offset, has_offset, flip, center, s0, s1, c0, c1, out):
    """_kmajor_packed4 with integer activations: x rounded to int8 per block of 32 k (round_rows),
    each 32-row block of W multiplied as int8 x (nibble - 8) in int16 lanes (|sum| <= 32 * 127 * 8
    < 2**15), then out += scale * (d * dot + center * xsum) + offset * xsum in float32. center is 8
    for uint4 (w = (u - 8) * scale + 8 * scale + offset) and 0 for int4 read through flip = 0x88
    (u - 8 is then the signed value). s0..s1: blocks of 32 k; the weight's own block (its scale row)
    is a multiple of 32. Columns c0..c1 (even) in tiles, every row of x per block of W."""
    m_rows, k = x.shape
    bs = k // param_blocks(scale)
    h0 = c0 // 2
    w = c1 // 2 - h0
    xq = np.empty((m_rows, k), np.int16)   # int16 lanes below
    xd = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    xs = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    xi = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    round_rows(x, s0, s1, xq, xd, xs, xi)
    acc_e = np.empty(w, np.int16)
    acc_o = np.empty(w, np.int16)
    res_e = np.zeros((m_rows, w), np.float32)
    res_o = np.zeros((m_rows, w), np.float32)
    low, shift, eight = np.uint8(15), np.uint8(4), np.int16(8)
    for sb in range(s0, s1):
        k0 = sb * XQ_BLOCK
        b = k0 // bs
        srow = param_rows(scale, b, 2 * h0, 2 * (h0 + w))
        orow = param_rows(offset, b if has_offset else 0, 2 * h0, 2 * (h0 + w))   # (read only when has_offset)
        for m in range(m_rows):
            acc_e[:] = 0
            acc_o[:] = 0
            for j in range(XQ_BLOCK):
                xv = xq[m, k0 + j]
                row = q[k0 + j, h0:h0 + w]
                for i in range(w):  # int16 lanes (the np.int16 casts let LLVM narrow numba's int64)
                    v = row[i] ^ flip
                    acc_e[i] += np.int16(xv * (np.int16(v & low) - eight))
                    acc_o[i] += np.int16(xv * (np.int16(v >> shift) - eight))
            d = xd[m, sb]
            cx = center * xs[m, sb]
            re, ro = res_e[m], res_o[m]
            for i in range(w):
                re[i] += param(srow, 2 * i) * (np.float32(acc_e[i]) * d + cx)
                ro[i] += param(srow, 2 * i + 1) * (np.float32(acc_o[i]) * d + cx)
            if has_offset:
                xsum = xs[m, sb]
                for i in range(w):
                    re[i] += param(orow, 2 * i) * xsum
                    ro[i] += param(orow, 2 * i + 1) * xsum
    for m in range(m_rows):
        om = out[m, 2 * h0:2 * (h0 + w)]
        for i in range(w):
            om[2 * i] = res_e[m, i]
            om[2 * i + 1] = res_o[m, i]


def _kmajor_int8_xq(x, q, scale, offset, has_offset, flip, center, s0, s1, c0, c1, out):
    """_kmajor_int8 with integer activations: x rounded as in _kmajor_packed4_xq, int8 x int8 dot
    products per block of 32 k (two rows' products summed in int16 lanes, then int32), then
    out += scale * (d * dot + center * xsum) + offset * xsum. A uint8 W is read as int8 through
    flip = 0x80 (u - 128) with center 128; an int8 W has flip 0, center 0. Columns c0..c1."""
    m_rows, k = x.shape
    bs = k // param_blocks(scale)
    xq = np.empty((m_rows, k), np.int16)   # int16 lanes below
    xd = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    xs = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    xi = np.empty((m_rows, k // XQ_BLOCK), np.float32)
    round_rows(x, s0, s1, xq, xd, xs, xi)
    t0, w = c0, c1 - c0
    acc = np.empty(w, np.int32)
    res = np.zeros((m_rows, w), np.float32)
    for sb in range(s0, s1):
        k0 = sb * XQ_BLOCK
        b = k0 // bs
        srow = param_rows(scale, b, t0, t0 + w)
        orow = param_rows(offset, b if has_offset else 0, t0, t0 + w)   # (read only when has_offset)
        for m in range(m_rows):
            acc[:] = 0
            for j in range(0, XQ_BLOCK, 4):  # products of two rows fit int16: |2 * 127 * 128| < 2**15
                x0, x1, x2, x3 = xq[m, k0 + j], xq[m, k0 + j + 1], xq[m, k0 + j + 2], xq[m, k0 + j + 3]
                r0, r1 = q[k0 + j, t0:t0 + w], q[k0 + j + 1, t0:t0 + w]
                r2, r3 = q[k0 + j + 2, t0:t0 + w], q[k0 + j + 3, t0:t0 + w]
                for i in range(w):
                    w0, w1 = np.int16(np.int8(r0[i] ^ flip)), np.int16(np.int8(r1[i] ^ flip))
                    w2, w3 = np.int16(np.int8(r2[i] ^ flip)), np.int16(np.int8(r3[i] ^ flip))
                    acc[i] += np.int32(np.int16(x0 * w0 + x1 * w1)) + np.int32(np.int16(x2 * w2 + x3 * w3))
            d = xd[m, sb]
            cx = center * xs[m, sb]
            r = res[m]
            for i in range(w):
                r[i] += param(srow, i) * (np.float32(acc[i]) * d + cx)
            if has_offset:
                xsum = xs[m, sb]
                for i in range(w):
                    r[i] += param(orow, i) * xsum
    for m in range(m_rows):
        out[m, t0:t0 + w] = res[m, :w]


def _scaled_tile_packed4(q, scale, k0, k1, block, flip, i0, i1, out):
    """out[k - k0, :] = (q[k, i0:i1] ^ flip) * scale[k // block, 2 * i0:2 * i1] for a k-major 4-bit
    weight (byte columns i0..i1: output columns 2 * i0..2 * i1), read as _kmajor_packed4 reads it
    (the offset is added by the caller); q the k-major array or a dt.TiledWeight's tiles (the same
    values), read in runs of at most 16 bytes (a tile's row)."""
    low, shift = np.uint32(15), np.uint32(4)
    k_step, c_step, r_step = rows_gemv.tile_strides(q, 16)
    flat = q.reshape(q.size)
    for b in range(k0 // block, (k1 + block - 1) // block):
        srow = param_rows(scale, b, 2 * i0, 2 * i1)
        for k in range(max(k0, b * block), min(k1, b * block + block)):
            o = out[k - k0]
            at = k // 32 * k_step + k % 32 * r_step
            for g in range(i0 // 16, (i1 + 15) // 16):
                lo, hi = max(i0, 16 * g), min(i1, 16 * g + 16)
                row = flat[at + g * c_step + lo - 16 * g:at + g * c_step + hi - 16 * g]
                for j in range(hi - lo):
                    i = lo - i0 + j
                    v = np.uint32(row[j]) ^ flip
                    o[2 * i] = np.float32(np.int32(v & low)) * param(srow, 2 * i)
                    o[2 * i + 1] = np.float32(np.int32(v >> shift)) * param(srow, 2 * i + 1)


def _scaled_tile_int8(q, scale, k0, k1, block, i0, i1, out):
    """out[k - k0, :] = q[k, i0:i1] * scale[k // block, i0:i1] for a k-major 8-bit weight: the array,
    or a dt.TiledWeight's tiles (the same values), read in runs of at most 32 bytes (a tile's row)."""
    k_step, c_step, r_step = rows_gemv.tile_strides(q, 32)
    flat = q.reshape(q.size)
    for b in range(k0 // block, (k1 + block - 1) // block):
        srow = param_rows(scale, b, i0, i1)
        for k in range(max(k0, b * block), min(k1, b * block + block)):
            o = out[k - k0]
            at = k // 32 * k_step + k % 32 * r_step
            for g in range(i0 // 32, (i1 + 31) // 32):
                lo, hi = max(i0, 32 * g), min(i1, 32 * g + 32)
                row = flat[at + g * c_step + lo - 32 * g:at + g * c_step + hi - 32 * g]
                for j in range(hi - lo):
                    o[lo - i0 + j] = np.float32(np.int32(row[j])) * param(srow, lo - i0 + j)


_serial = dict(fastmath=True, cache=True, nogil=True)
scaled_tile_packed4 = njit(**_serial)(_scaled_tile_packed4)
scaled_tile_int8 = njit(**_serial)(_scaled_tile_int8)
GEMM_TILE_ELEMENTS = 1 << 21  # 8 MB of float32 per dequantized tile
kmajor_packed4 = njit(**_serial)(_kmajor_packed4)
kmajor_int8 = njit(**_serial)(_kmajor_int8)
kmajor_packed4_xq = njit(**_serial)(_kmajor_packed4_xq)
kmajor_int8_xq = njit(**_serial)(_kmajor_int8_xq)
PARALLEL_MIN_GEMM = 1 << 22     # multiply-adds from which a GEMM splits its columns over the pool


_blas = {"threads": None, "libraries": None}


def blas_threads(n: int) -> None:
    """Set the BLAS libraries' threads (OpenBLAS under NumPy and SciPy: the prefill GEMMs) to n,
    the one CPU thread setting (`CpuOptions.threads`) that the GEMV pool also follows, so BLAS never
    runs more threads than that beside it. A no-op when n is already set or threadpoolctl is missing."""
    if _blas["threads"] == n:
        return
    if _blas["libraries"] is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas["libraries"] = ThreadpoolController().select(user_api="blas").lib_controllers
        except Exception:   # not installed, or a BLAS it cannot drive: BLAS keeps its own setting
            _blas["libraries"] = []
    for library in _blas["libraries"]:
        library.set_num_threads(n)
    _blas["threads"] = n


@njit(**_serial)
def packed4_chunks(head, plan, outs, out, ctrl, gen, lead):
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        kmajor_packed4(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


@njit(**_serial)
def int8_chunks(head, plan, outs, out, ctrl, gen, lead):
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        kmajor_int8(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


@njit(**_serial)
def packed4_xq_chunks(head, plan, outs, out, ctrl, gen, lead):
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        kmajor_packed4_xq(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


@njit(**_serial)
def int8_xq_chunks(head, plan, outs, out, ctrl, gen, lead):
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        kmajor_int8_xq(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


team.DRIVERS.update({kmajor_packed4: (packed4_chunks, False), kmajor_int8: (int8_chunks, False),
                     kmajor_packed4_xq: (packed4_xq_chunks, False), kmajor_int8_xq: (int8_xq_chunks, False)})
split_blocks = team.split_blocks




def _kmajor_params(params, attrs, n: int):
    """(scale, offset) as [nb, N] with w = q * scale + offset per block: the constants themselves
    when they already have that form (no copy; float16 ones stay float16), offset None when there is
    none."""
    def full(p):
        if p.dtype != np.float16 or p.shape[1] != n:
            p = p.astype(np.float32, copy=False)
        if p.shape[1] == 1:
            p = np.broadcast_to(p, (p.shape[0], n))
        elif p.shape[1] != n:  # blocked along the output axis too
            p = np.repeat(p, n // p.shape[1], axis=1)
        return np.ascontiguousarray(p)
    scale = full(params[0])
    i = 1
    zero_point = params[i] if attrs.get("has_zero_point") else None
    i += zero_point is not None
    bias = params[i] if attrs.get("has_bias") else None
    nb = max(p.shape[0] for p in params)
    if scale.shape[0] != nb:
        scale = np.ascontiguousarray(np.broadcast_to(scale, (nb, n)))
    offset = None if bias is None else np.ascontiguousarray(np.broadcast_to(full(bias), (nb, n)))
    if zero_point is not None:
        shift = -np.broadcast_to(full(zero_point), (nb, n)).astype(np.float32) * scale
        offset = shift if offset is None else offset + shift
    return scale, offset, nb


def tile_weight(t):
    """A k-major 4- or 8-bit affine weight that rows_gemv's float32 GEMVs multiply (an AVX-512 CPU, K
    and N multiples of 32, blocks of 32 k or a multiple, parameters as arrays) as a dt.TiledWeight:
    they read a tile of W as one run (SmolLM2's decode step 13.3 -> 10.5 ms), the prefill GEMM's
    dequantized tiles and gathers (a tied embedding) read it too, and the weight is held once. A 4-bit
    weight's float32 parameters go to float16 where it holds them exactly (a GGUF's Q4_0 / Q4_1 come
    so): a third of its bytes read, 14 MB less of SmolLM2 held. Anything else comes back as it is
    (llm.package.storage_form's finish: each weight converted as it comes, not all of them twice).

        >>> tensors = storage_form(cfg, model.tensors, finish=tile_weight)   # doctest: +SKIP
    """
    from ...quant.formats import QuantizedTensor, TwoLevelParams
    if not (vnni.AVAILABLE and isinstance(t, QuantizedTensor) and t.block_axis == 0 and t.qdtype.bits in (4, 8)
            and t.lut is None and isinstance(t.q, np.ndarray) and dt.TiledWeight.fits(t.q, t.qdtype.bits)
            and t.block_size % XQ_BLOCK == 0 and t.scale is not None):
        return t
    if isinstance(t.scale, TwoLevelParams) or isinstance(t.bias, TwoLevelParams):
        # the :k formats: their products as float16 arrays where float16 holds them exactly (the same
        # parameters; +0.5 bits a weight in memory), so rows_gemv takes the weight as tiles: Gemma 3's
        # 640 x 262,144 tied head went through the k-major kernel, code x unit widened per column
        # (15.3 ms a token against 4.8 as uint4:32:f16; the layers 2.24 against 1.79 ms)
        scale, bias = _exact_half(t.scale), _exact_half(t.bias)
        if scale is None or (t.bias is not None and bias is None):
            return t
        t = dataclasses.replace(t, scale=scale, bias=bias)
    if not all(p is None or isinstance(p, np.ndarray) for p in (t.scale, t.bias, t.zero_point)):
        return t
    if t.qdtype.bits == 4 and t.zero_point is None:
        scale, bias = _array_half(t.scale), _array_half(t.bias)
        if scale is not None and (t.bias is None or bias is not None):
            t = dataclasses.replace(t, scale=scale, bias=bias)
    return dataclasses.replace(t, q=dt.TiledWeight.from_k_major(t.q, t.qdtype.bits))


def _array_half(p: np.ndarray | None) -> np.ndarray | None:
    """A float32 array as float16 where float16 holds every value exactly, else None (None and float16
    arrays as they are)."""
    if p is None or p.dtype == np.float16:
        return p
    if p.dtype != np.float32:
        return None
    half = p.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), p) else None


def _exact_half(p):
    """Two-level parameters as their float16 products where float16 holds every one exactly, else None;
    anything else as it is."""
    from ...quant.formats import TwoLevelParams
    return _array_half(np.asarray(p, np.float32)) if isinstance(p, TwoLevelParams) else p


def _half_if_exact(p: np.ndarray | None) -> np.ndarray | None:
    """p in the kernels' float16 form when float16 holds it exactly, else as _kernel_form gives it."""
    half = _array_half(p)
    return _kernel_form(p if half is None else half)


def _kernel_param(p):
    """Parameters as the kernels take them: two-level ones (a tuple) as they are, arrays in _kernel_form."""
    return p if isinstance(p, tuple) else _kernel_form(p)


def _kernel_form(p: np.ndarray | None) -> np.ndarray | None:
    """What the kernels take: float32, or float16 as its uint16 bits (see param); always as a
    read-only view, so that constants from a package's memory map (read-only) and built ones share
    one compiled specialisation, the one warm_up compiles."""
    if p is None:
        return None
    p = p.view(np.uint16) if p.dtype == np.float16 else p.view()
    p.flags.writeable = False
    return p


def _two_level_form(codes: np.ndarray, units: np.ndarray, per_super: int) -> tuple:
    """The kernels' form of two-level parameters (see param_rows): read-only views of the codes and
    of the float16 units' bits, and S."""
    return (_kernel_form(codes), _kernel_form(np.asarray(units, np.float16)), np.int64(per_super))


def _products(p):
    """Parameters as an array: two-level ones' float32 products, others as they are (None stays None)."""
    if isinstance(p, tuple):
        return _param_columns(p, 0, p[0].shape[1])
    return p


def _param_columns(p, c0: int, c1: int) -> np.ndarray:
    """Columns c0..c1 of parameters [nb, N] as an array (two-level ones multiplied out, float32)."""
    if isinstance(p, tuple):
        codes, units, per_super = p
        return codes[:, c0:c1].astype(np.float32) * np.repeat(units[:, c0:c1].view(np.float16).astype(np.float32),
                                                               per_super, axis=0)
    return p[:, c0:c1]


_REPACKED: dict[tuple[int, int, int], np.ndarray] = {}


def _repacked(q: np.ndarray, flip: int, bits: int) -> np.ndarray:
    """The VNNI layout of the weight q, made once per weight array and shared by every executable that
    multiplies by it (a server compiles ~14 over the same arrays: prefill lengths, row counts; each
    repacked its own copy on its first run, ~2 s and the weights' size again each), dropped with the
    array: vnni.repack (bits 4, packed q read as q ^ flip), repack8 (bits 8, q ^ flip), repack_bits
    (bits 5 and 6: an 8-bit q whose values fit, as the codes q + flip)."""
    key = (id(q), flip, bits)
    hit = _REPACKED.get(key)
    if hit is None:
        if bits in (5, 6):
            layout = vnni.repack_bits((np.asarray(q).astype(np.int16) + flip).astype(np.uint8), bits)
        else:
            layout = (vnni.repack if bits == 4 else vnni.repack8)(np.asarray(q), flip)   # (a TiledWeight: k-major)
        hit = _REPACKED[key] = _kernel_form(layout)
        weakref.finalize(q, _REPACKED.pop, key, None)
    return hit


def _vnni_weight(q: np.ndarray, qdtype) -> tuple[np.ndarray, np.float32, int]:
    """(layout, center, bits) of a k-major weight for vnni.gemv in the fewest bits that hold it: 4
    for packed weights; an 8-bit one whose values fit 5 or 6 bits (GGUF's Q5 and Q6_K types, which
    import as 8-bit integers) in that many, else 8. Codes are the value + 2**(bits - 1) for a signed
    weight (center 0), the value for an unsigned one (center 2**(bits - 1))."""
    unsigned = qdtype.kind == "u"
    if qdtype.packed:
        return _repacked(q, 0 if unsigned else 0x88, 4), np.float32(8 if unsigned else 0), 4
    lo, hi = _value_range(q)
    for bits in (5, 6):
        half = 1 << (bits - 1)
        if (0 <= lo and hi < 2 * half) if unsigned else (-half <= lo and hi < half):
            return _repacked(q, 0 if unsigned else half, bits), np.float32(half if unsigned else 0), bits
    return _repacked(q, 0 if unsigned else 0x80, 8), np.float32(128 if unsigned else 0), 8


_RANGES: dict[int, tuple[int, int]] = {}


def _value_range(q: np.ndarray) -> tuple[int, int]:
    """(min, max) of an integer weight array, once per array."""
    hit = _RANGES.get(id(q))
    if hit is None:
        values = q.tiles if isinstance(q, dt.TiledWeight) else q
        hit = _RANGES[id(q)] = (int(values.min()), int(values.max())) if q.size else (0, 0)
        weakref.finalize(q, _RANGES.pop, id(q), None)
    return hit


def _grouped(p):
    """Parameters in the kernels' form, grouped as vnni.gemv reads them fastest (vnni.group_params)."""
    if isinstance(p, tuple):
        return tuple(_kernel_form(a) for a in vnni.group_params(p)[:2]) + (p[2],)
    return _kernel_form(vnni.group_params(p))


def quantized_matmul_step(node: Node, out, threads: int = 1, activations: str = "float32"):
    """quantized_matmul on the CPU: the packed GEMV kernels for up to GEMV_MAX_ROWS rows of a k-major
    (transpose=False) affine weight (split over `threads`), a tiled dequantize + BLAS GEMM above that;
    the reference otherwise. activations="int8" (`CpuOptions.gemv_activations`): the GEMV rounds x to
    int8 per block of 32 k and multiplies in integers (the *_xq kernels), where the weight's block is
    a multiple of 32; the GEMM stays float32."""
    attrs = node.attrs
    qdtype = attrs["qdtype"]
    fast = attrs["mode"] == "affine" and not attrs.get("transpose") and node.dtype.name == "float32"
    reference = quant_ops.quantized_matmul_reference
    prepared: dict = {}
    no_offset = np.zeros((1, 1), np.float32)
    no_offset_bits = np.zeros((1, 1), np.uint16)

    def prepare(q, params):
        key = (id(q),) + tuple(id(p) for p in params)
        hit = prepared.get(key)
        if hit is None:
            # a dt.TiledWeight (the LLM loaders' form on AVX-512): its tiles for the readers of tiles,
            # the k-major array (a copy) for the others, which its loader's tests never choose
            tiles = _kernel_form(q.tiles) if isinstance(q, dt.TiledWeight) else None
            k_major = lambda: _kernel_form(np.asarray(q))  # noqa: E731
            n = q.shape[1] * (2 if qdtype.packed else 1)
            per_super = attrs.get("two_level")
            if per_super and all(p.shape[1] == n for p in params):   # codes x units, read as they are
                scale = _two_level_form(params[0], params[1], per_super)
                offset = _two_level_form(params[2], params[3], per_super) if attrs.get("has_bias") else None
                nb = params[0].shape[0]
                ks = scale
            else:
                scale, offset, nb = _kmajor_params(quant_ops.two_level_products(params, attrs), attrs, n)
                ks = _kernel_form(scale)
            k = q.shape[0]
            absent = no_offset if isinstance(ks, tuple) or ks.dtype == np.float32 else no_offset_bits
            block = k // nb
            rows_args = None   # rows_gemv's arguments (2..GEMV_MAX_ROWS rows), where it takes the weight
            if activations == "int8" and k % XQ_BLOCK == 0 and (block == 16 or block % XQ_BLOCK == 0) \
                    and vnni.AVAILABLE and n % vnni.GROUP == 0:
                weight, center, bits = _vnni_weight(q, qdtype)
                # parameters that came from float16 (GGUF's) go back to it: a third of the bytes read;
                # two-level ones stay codes and units
                if isinstance(scale, tuple):
                    vs, vo = scale, offset
                else:
                    vs, vo = _half_if_exact(scale), _half_if_exact(offset)
                vo = vo if offset is not None else vs
                gemv = (vnni.gemv, (_grouped(vs), _grouped(vo), offset is not None, center), k // XQ_BLOCK, weight)
                if bits in (4, 8) and block % XQ_BLOCK == 0 and not isinstance(vs, tuple):
                    rows_args = (vs, vo, offset is not None, center)
            elif activations == "int8" and k % XQ_BLOCK == 0 and block % XQ_BLOCK == 0:
                unsigned = qdtype.kind == "u"   # read as signed through flip, the difference in center
                weight = k_major()
                if qdtype.packed:
                    kernel = kmajor_packed4_xq
                    args = (np.uint8(0 if unsigned else 0x88), np.float32(8 if unsigned else 0))
                else:
                    kernel = kmajor_int8_xq
                    args = (np.uint8(0x80), np.float32(128)) if unsigned else (np.int8(0), np.float32(0))
                gemv = (kernel, (ks, _kernel_param(offset if offset is not None else absent), offset is not None)
                        + args, k // XQ_BLOCK, weight)
            else:
                gemv = None
            signed4 = qdtype.packed and qdtype.kind == "i"
            if signed4:  # read as uint4 n ^ 8 = value + 8: the -8 goes into the offset
                if isinstance(scale, tuple) and offset is None:   # -8 * unit: a float16 exactly
                    offset = _two_level_form(scale[0], np.float32(-8) * scale[1].view(np.float16), per_super)
                else:
                    shift = np.float32(-8) * _products(scale).astype(np.float32)
                    offset = shift if offset is None else _products(offset).astype(np.float32) + shift
            flip = np.uint32(0x88 if signed4 else 0)
            ko = _kernel_param(offset if offset is not None else absent)
            if gemv is None:
                if qdtype.packed and vnni.AVAILABLE and n % rows_gemv.TILE_COLUMNS == 0 and (k // nb) % XQ_BLOCK == 0 \
                        and not isinstance(ks, tuple) and not isinstance(ko, tuple):
                    # AVX-512, parameters as arrays: W unpacked once for all rows, any row count alike (rows_gemv.py)
                    gemv = (rows_gemv.gemv_rows_float4, (ks, ko, offset is not None, flip), nb,
                            k_major() if tiles is None else tiles)
                elif qdtype.packed:
                    gemv = (kmajor_packed4, (ks, ko, offset is not None, flip), nb, k_major())
                elif tiles is not None and vnni.AVAILABLE and (k // nb) % XQ_BLOCK == 0 \
                        and not isinstance(ks, tuple) and not isinstance(ko, tuple):
                    # 8-bit tiles: one read of W for up to 8 rows, any row count alike (rows_gemv.py)
                    gemv = (rows_gemv.gemv_rows_float8, (ks, ko, offset is not None), nb, tiles)
                else:
                    gemv = (kmajor_int8, (ks, ko, offset is not None), nb, k_major())
            hit = prepared[key] = (gemv, scale, offset, flip, nb, n, k_major() if tiles is None else tiles, rows_args,
                                   (q, params))  # kept: ids stay valid
        return hit

    def step(x, q, *params):
        if not fast:
            return reference((x, np.asarray(q)) + params, attrs)
        (kernel, args, parts, weight), scale, offset, flip, nb, n, stored, rows_args, _ = prepare(q, params)
        k = x.shape[-1]
        if k % nb:
            return reference((x, np.asarray(q)) + params, attrs)
        x2 = x.reshape(-1, k)
        rows = x2.shape[0]
        if not x2.flags.c_contiguous or x2.dtype != np.float32:
            x2 = np.ascontiguousarray(x2, dtype=np.float32)
        if rows > GEMV_MAX_ROWS and kernel is vnni.gemv:
            # int8 activations on VNNI: the GEMV kernel in blocks of rows (each block of W once from
            # L1 for all of them) beats dequantized tiles + BLAS: 576 x 3072 x 512 rows 11.8 ms
            # against ~20 ms (one thread, float32 BLAS)
            result = np.empty((rows, n), np.float32)
            for r0 in range(0, rows, VNNI_ROWS):
                split_blocks(kernel, (x2[r0:r0 + VNNI_ROWS], weight) + args, parts, result[r0:r0 + VNNI_ROWS],
                             k * n * min(VNNI_ROWS, rows - r0), threads)
            return result.reshape(x.shape[:-1] + (n,))
        if rows > GEMV_MAX_ROWS:
            xsum = x2.reshape(rows, nb, k // nb).sum(axis=2)
            return gemm(x2, xsum, stored, scale, offset, flip, k // nb, n).reshape(x.shape[:-1] + (n,))
        result = np.empty((rows, n), np.float32)
        if rows > 1 and rows_args is not None:
            # a server's batch: each block of W once for all rows (rows_gemv.py: 4- and 8-bit weights,
            # parameters as arrays; vnni.gemv takes the others' rows itself)
            kernel, args = rows_gemv.gemv_rows, rows_args
        # a column-split kernel's rows are work of their own (a server's batch: 8 rows of 576 x 960 are worth
        # the team where one is not), and its split changes no result; a split along k does (partial sums), so
        # there the rows do not count and a row's result never depends on how many came with it
        work = k * n * (rows if team.DRIVERS[kernel][1] else 1)
        split_blocks(kernel, (x2, weight) + args, parts, result, work, threads)
        return result.reshape(x.shape[:-1] + (n,)) if x.ndim != 2 else result

    def gemm(x2, xsum, q, scale, offset, flip, block, n):
        """Many rows: dequantize K-tiles of q * scale into a float buffer, multiply with BLAS; the
        offsets add xsum @ offset, one more small matmul. Tiles hold at most GEMM_TILE_ELEMENTS
        weights, so there is never a float copy of a big weight. On `threads` threads the output
        columns are split over the GEMV pool, each part dequantizing and multiplying its own columns
        with BLAS on one thread: the pool's threads wait without spinning, where BLAS's own threads
        spin and collapse when a busy neighbour takes a core."""
        width = n // 2 if qdtype.packed else n   # byte columns (two output columns each for 4 bits)
        parts = min(threads, width // 64) if x2.shape[0] * x2.shape[1] * n >= PARALLEL_MIN_GEMM else 1
        result = np.empty((x2.shape[0], n), np.float32)
        bounds = [width * i // max(parts, 1) for i in range(max(parts, 1) + 1)]
        argsets = [(x2, xsum, q, scale, offset, flip, block, i0, i1, result) for i0, i1 in zip(bounds, bounds[1:])]
        if parts <= 1:
            gemm_columns(*argsets[0])
            return result
        team.run_parallel(gemm_columns, argsets)   # BLAS on one thread in such programs (CpuPlan.blas)
        return result

    def gemm_columns(x2, xsum, q, scale, offset, flip, block, i0, i1, result):
        per = 2 if qdtype.packed else 1
        c0, c1 = i0 * per, i1 * per
        k = x2.shape[1]
        tile_k = max(block, min(k, GEMM_TILE_ELEMENTS // max(c1 - c0, 1)) // block * block)
        tile = np.empty((min(tile_k, k), c1 - c0), np.float32)
        acc = None
        for k0 in range(0, k, tile_k):
            k1 = min(k, k0 + tile_k)
            t = tile[: k1 - k0]
            if qdtype.packed:
                scaled_tile_packed4(q, _kernel_param(scale), k0, k1, block, flip, i0, i1, t)
            else:
                scaled_tile_int8(q, _kernel_param(scale), k0, k1, block, i0, i1, t)
            part = x2[:, k0:k1] @ t  # (matmul with out= is slower in NumPy for these shapes)
            if acc is None:
                acc = part
            else:
                acc += part
        if offset is not None:
            acc += xsum @ _param_columns(offset, c0, c1)
        result[:, c0:c1] = acc
    return step


def warm_up(int8_activations: bool = True, two_level: bool = True) -> None:
    """Compile (or load from numba's cache) every kernel for the types the LLM path uses, so the
    first real call is not the one that pays for it. int8_activations=False leaves out the GEMVs of
    int8 activations (CpuOptions.gemv_activations "float32"), two_level=False those of two-level
    parameters (only an Ingot package's :k weights have them, never a GGUF file's): each loaded
    specialisation holds ~2.5 MB of code and LLVM state, and the default model's load held 50 MB of
    ones it never calls (SmolLM2 generating: 288 MB anonymous, 226 with only the kernels it ran).
    A kernel left out still loads when first called, as any other does.

    When numba's cache is empty (the first run after an install or an edit), the compiling happens
    in a child process that fills the cache (every kernel): LLVM keeps tens of MB of its working
    memory in the process that compiles, which would otherwise stay resident beside the model."""
    if _cache_is_cold():
        import subprocess
        import sys
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, "-c", "from ingot.backends.cpu.kernels import _warm_up; _warm_up()"],
                       env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _warm_up(int8_activations, two_level)


def release_compiler_pages() -> None:
    """Hand back the resident pages of LLVM's library (libllvmlite, ~180 MB, of which numba's
    import faults in 60-120 MB) once the kernels are loaded: nothing calls into it again unless a
    new specialisation must compile, and then the pages fault back in from the page cache.
    Linux 5.4+ (MADV_PAGEOUT); elsewhere a no-op."""
    try:
        import ctypes
        madvise = ctypes.CDLL("libc.so.6").madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as maps:
            spans = [line.split()[0] for line in maps if line.rstrip().endswith("libllvmlite.so")]
        for span in spans:
            start, end = (int(v, 16) for v in span.split("-"))
            madvise(start, end - start, 21)  # MADV_PAGEOUT
    except (OSError, AttributeError, ValueError):
        pass


def _cache_is_cold() -> bool:
    """True when some kernel has no usable entry in numba's on-disk cache (numba internals: any
    surprise counts as warm, and the kernels compile here as before)."""
    kernels = [kmajor_packed4, kmajor_int8, kmajor_packed4_xq, kmajor_int8_xq, scaled_tile_packed4, scaled_tile_int8,
               attention, rope_rows, _rms_norm_rows, _layer_norm_rows, erf_rows, rope_write_attend,
               decode_attention.decode_attention, decode_attention.decode_chunks]
    if vnni.AVAILABLE:   # _warm_up compiles these only where the CPU has VNNI: elsewhere never cached
        kernels += [vnni.gemv, rows_gemv.gemv_rows, rows_gemv.gemv_rows_float4, rows_gemv.gemv_rows_float8]
    try:
        return any(not d._cache._cache_file._load_index() for d in kernels)
    except Exception:
        return False


def _warm_k_major(x, weights, s, o, has: bool, out, int8_activations: bool) -> None:
    """The k-major GEMVs of weights (packed 4-bit, int8, uint8) for parameters s, o: float32 activations'
    and, where asked, int8 activations'."""
    kmajor_packed4(x, weights[0], s, o, has, np.uint32(0), 0, 1, 0, 4, out)
    kmajor_int8(x, weights[1], s, o, has, 0, 1, 0, 4, out)
    kmajor_int8(x, weights[2], s, o, has, 0, 1, 0, 4, out)
    if int8_activations:
        kmajor_packed4_xq(x, weights[0], s, o, has, np.uint8(0), np.float32(8), 0, 1, 0, 4, out)
        kmajor_int8_xq(x, weights[1], s, o, has, np.int8(0), np.float32(0), 0, 1, 0, 4, out)
        kmajor_int8_xq(x, weights[2], s, o, has, np.uint8(0x80), np.float32(128), 0, 1, 0, 4, out)


def _warm_up(int8_activations: bool = True, two_level: bool = True) -> None:
    f32 = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    x, out = f32(1, 32), f32(1, 4)
    weights = [_kernel_form(np.zeros((32, n), t)) for n, t in ((2, np.uint8), (4, np.int8), (4, np.uint8))]
    for params in (f32(1, 4), np.ones((1, 4), np.float16)):   # the weight, scale and offset as prepared
        s, o = _kernel_form(params), _kernel_form(params)
        _warm_k_major(x, weights, s, o, True, out, int8_activations)
        if vnni.AVAILABLE and int8_activations:
            wide = _kernel_form(np.ones((1, 16), params.dtype))
            grouped = _grouped(wide)   # as quantized_matmul_step hands them to it ([blocks, N] ones: rows_gemv)
            vnni.gemv(x, _kernel_form(np.zeros((1, 1, 256), np.uint8)), grouped, grouped, True, np.float32(8), 0, 1,
                      0, 16, f32(1, 16))
            rows_gemv.gemv_rows(f32(2, 32), _kernel_form(np.zeros((1, 1, 256), np.uint8)), wide, wide, True,
                                np.float32(8), 0, 1, 0, 16, f32(2, 16))
        scaled_tile_packed4(weights[0], s, 0, 32, 32, np.uint32(0), 0, 2, f32(32, 4))
        scaled_tile_packed4(_kernel_form(np.zeros((1, 1, 512), np.uint8)), _kernel_form(np.ones((1, 32), params.dtype)),
                            0, 32, 32, np.uint32(0), 0, 16, f32(32, 32))   # a TiledWeight's tiles
        scaled_tile_int8(weights[1], s, 0, 32, 32, 0, 4, f32(32, 4))
        scaled_tile_int8(weights[2], s, 0, 32, 32, 0, 4, f32(32, 4))
    # two-level parameters (the :k formats read as stored), with their absent offset (float32)
    if two_level:
        codes = _kernel_form(np.ones((1, 4), np.uint8))
        two = (codes, _kernel_form(np.ones((1, 4), np.float16)), np.int64(1))
        absent = _kernel_form(f32(1, 1))
        for o, has in ((two, True), (absent, False)):
            _warm_k_major(x, weights, two, o, has, out, int8_activations)
        if vnni.AVAILABLE and int8_activations:
            wide = (_kernel_form(np.ones((1, 16), np.uint8)), _kernel_form(np.ones((1, 16), np.float16)), np.int64(1))
            grouped = _grouped(wide)
            vnni.gemv(x, _kernel_form(np.zeros((1, 1, 256), np.uint8)), grouped, grouped, True, np.float32(8), 0, 1, 0, 16,
                      f32(1, 16))
        scaled_tile_packed4(weights[0], two, 0, 32, 32, np.uint32(0), 0, 2, f32(32, 4))
        scaled_tile_int8(weights[1], two, 0, 32, 32, 0, 4, f32(32, 4))
        scaled_tile_int8(weights[2], two, 0, 32, 32, 0, 4, f32(32, 4))
    q = f32(1, 2, 1, 8)
    attention(q, f32(1, 1, 4, 8), f32(1, 1, 4, 8), 4, np.float32(1), True, 0, np.float32(0), f32(1, 2, 1, 8))
    rope_rows(f32(2, 1, 8), np.zeros(1, np.int64), f32(4), True, 8, f32(2, 1, 8))
    rope_rows(f32(2, 1, 8), np.zeros(1, np.int64), f32(4), False, 8, f32(2, 1, 8))
    rms_norm(f32(1, 8), f32(8), np.float32(1e-5))
    inv = f32(4)
    inv.flags.writeable = False
    rope_write_attend(q, f32(1, 1, 1, 8), f32(1, 1, 1, 8), f32(1, 1, 4, 8), f32(1, 1, 4, 8), 0, 1, inv, True, 8,
                      np.float32(1), True, 0, np.float32(0), True, f32(1, 2, 1, 8), f32(1, 2, 1, 8))
    erf_rows(f32(4), f32(4))
    layer_norm(f32(1, 8), f32(8), f32(8), np.float32(1e-5))
    decode_attention.warm_up()   # the decode step's attention (batch-1 and ingot serve's rows)
    if vnni.AVAILABLE:
        rows_gemv.warm_up()    # the float32-activation GEMV of 4-bit weights on AVX-512
