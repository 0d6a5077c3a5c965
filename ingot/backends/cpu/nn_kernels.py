"""Compiled CPU kernels (numba) for the transformer's row-wise ops: decode attention over a cache
prefix (with RoPE and the cache write fused for the decode step, `rope_write_attend`), RMSNorm,
LayerNorm, SiLU, erf and RoPE. Each is tested against the NumPy reference of its op
(tests/test_cpu_kernels.py); kernels.py warms them up with the GEMV kernels.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ...errors import IngotError
from ...ir import Node
from ...ops import nn as nn_ops
from .block_params import F16C

_serial = dict(fastmath=True, cache=True, nogil=True)


# -- a bfloat16 or float16 KV cache: the kernels take it as its bits (numba has neither type), bfloat16
# as uint16 and float16 as int16 (so that the two are told apart when the kernels are typed) ---------

@intrinsic
def _float_of_bits(typingctx, bits):
    """uint32 -> the float32 of the same bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx, x):
    """float32 -> its bits as a uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _float_of_half(typingctx, bits):
    """float16 bits (int16) -> their float32 value (`fpext half`: VCVTPH2PS with F16C, see kernel_cache)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _half_of_float(typingctx, x):
    """float32 -> float16 bits (int16), rounded to nearest even as NumPy rounds it (`fptrunc`)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))
    return types.int16(types.float32), codegen


def widen(x):
    """A cache element as float32: a float32 as it is, bfloat16 bits (uint16) shifted into the high half,
    float16 bits (int16) widened."""


@overload(widen)
def _widen(x):
    if x == types.uint16:
        return lambda x: _float_of_bits(np.uint32(x) << np.uint32(16))
    if x == types.int16:
        return lambda x: _float_of_half(x)
    if x == types.int8:   # an int8 cache's code (times its row's scale: `row_scale`)
        return lambda x: np.float32(x)
    return lambda x: x


def row_scale(scales, b, h, j):
    """The scale of row j of an int8 cache's head (b, h): scales[b, h, j, 0]; 1 where there are none
    (None: a float cache, its values as they are)."""


@overload(row_scale)
def _row_scale(scales, b, h, j):
    if isinstance(scales, (types.NoneType, types.Omitted)):
        return lambda scales, b, h, j: np.float32(1.0)
    return lambda scales, b, h, j: scales[b, h, j, 0]


def put(a, i, x):
    """a[i] = x for a float32 array; for bfloat16 bits (uint16), x rounded to nearest even as ml_dtypes
    rounds it (a NaN stays a quiet NaN, overflow goes to infinity); for float16 bits (int16) as NumPy does."""


@overload(put)
def _put(a, i, x):
    if a.dtype == types.int16:
        def half(a, i, x):
            a[i] = _half_of_float(np.float32(x))
        return half
    if a.dtype == types.uint16:
        def bits(a, i, x):
            b = _bits_of_float(np.float32(x))
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                a[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
            else:
                a[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bits
    def plain(a, i, x):
        a[i] = x
    return plain


@njit(cache=True, nogil=True)
def exact_quotient(a, b):
    """a / b correctly rounded (no fastmath: the kernels' reciprocal multiply rounds differently)."""
    return a / b


def store_row(cache, scales, b, h, p, row):
    """cache[b, h, p, :] = the float32 row (rounded to the cache's dtype, `put`); with an int8 cache's
    scales (not None): the row's codes and scales[b, h, p, 0] as ops.nn.quantized_rows makes them."""


@overload(store_row)
def _store_row(cache, scales, b, h, p, row):
    if isinstance(scales, (types.NoneType, types.Omitted)):
        def plain(cache, scales, b, h, p, row):
            dst = cache[b, h, p]
            for e in range(row.shape[0]):
                put(dst, e, row[e])
        return plain

    def codes(cache, scales, b, h, p, row):
        amax = np.float32(0.0)
        for e in range(row.shape[0]):
            amax = max(amax, abs(row[e]))
        scale = max(exact_quotient(amax, np.float32(127.0)), np.float32(1.1754943508222875e-38))
        scales[b, h, p, 0] = scale
        dst = cache[b, h, p]
        for e in range(row.shape[0]):
            dst[e] = np.int8(min(max(np.rint(exact_quotient(row[e], scale)), np.float32(-127.0)), np.float32(127.0)))
    return codes


def kernel_cache(x: np.ndarray) -> np.ndarray | None:
    """A K/V cache array as the compiled kernels take it: float32 as it is, bfloat16 as its uint16 bits,
    float16 as its int16 bits where the CPU converts float16 in hardware (block_params.F16C) (views: writes
    land in the cache); None for any other dtype (the caller runs the reference)."""
    if x.dtype == np.float32:
        return x
    if x.dtype.name == "bfloat16" and x.dtype.itemsize == 2:
        return x.view(np.uint16)
    if x.dtype == np.float16:
        return x.view(np.int16) if F16C else None
    return None


XQ_BLOCK = 32  # activations rounded to int8 per this many k (CpuOptions.gemv_activations = "int8")


def _round_rows(x, s0, s1, xq, xd, xs, xi):
    """x[:, blocks s0..s1 of 32 k] rounded to int8 as llama.cpp's Q8 blocks are, into xq (int8, or
    int16 for kernels that multiply in int16 lanes): xq[m, k] * xd[m, b] ~ x[m, k], xd = max|x| / 127
    over the block, round half to even; xs[m, b] the block's exact float sum, xi[m, b] the sum of its
    rounded values. Shared by the integer-activation GEMV kernels (kernels.py, vnni.py)."""
    for m in range(x.shape[0]):
        for sb in range(s0, s1):
            k0 = sb * XQ_BLOCK
            amax = np.float32(0.0)
            total = np.float32(0.0)
            for j in range(XQ_BLOCK):
                v = x[m, k0 + j]
                total += v
                amax = max(amax, abs(v))
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            isum = 0
            for j in range(XQ_BLOCK):
                r = np.int32(np.rint(x[m, k0 + j] * inv))
                xq[m, k0 + j] = r
                isum += r
            xd[m, sb] = amax / np.float32(127.0)
            xs[m, sb] = total
            xi[m, sb] = np.float32(isum)


round_rows = njit(inline="always", **_serial)(_round_rows)


def _exp_shifted(scores, first, limit, best):
    """scores[j] = exp(scores[j] - best) for j in first..limit (all <= 0 after the shift), returning
    their sum (exp_negative: a polynomial LLVM vectorises, where numba's exp is a call per element)."""
    total = np.float32(0.0)
    for j in range(first, limit):
        scores[j] = exp_negative(scores[j] - best)
        total += scores[j]
    return total


exp_shifted = njit(inline="always", **_serial)(_exp_shifted)


def _attention(q, k, v, length, scale, causal, window, softcap, out, k_scales=None, v_scales=None):
    """q: [B, Hq, Tq, D]; k, v: [B, Hk, Tk, D] (float32, or bfloat16 as uint16 bits: `kernel_cache`; or
    int8 codes with their row scales k_scales, v_scales [B, Hk, Tk, 1], each key's dot product and
    each value's weight multiplied by its row's scale, so no float row is formed); keys
    >= length ignored; causal aligned to length; window > 0: each query sees its last `window` keys only;
    softcap > 0: s -> softcap * tanh(s / softcap)."""
    nbatch, hq, tq, d = q.shape
    hk = k.shape[1]
    dv = v.shape[3]
    group = hq // hk
    for job in prange(nbatch * hq):
        b = job // hq
        h = job % hq
        kh = h // group
        scores = np.empty(length, np.float32)
        acc = np.empty(dv, np.float32)
        for t in range(tq):
            limit = length
            first = 0
            if causal:
                limit = min(length, t + 1 + length - tq)
                if window > 0:
                    first = max(0, t + 1 + length - tq - window)
            if limit <= first:
                for e in range(dv):
                    out[b, h, t, e] = 0.0
                continue
            qrow = q[b, h, t]
            best = np.float32(-np.inf)   # (a float64 best made exp_shifted's polynomial float64)
            for j in range(first, limit):
                krow = k[b, kh, j]
                s = np.float32(0.0)
                for e in range(d):
                    s += qrow[e] * widen(krow[e])
                s *= scale * row_scale(k_scales, b, kh, j)
                if softcap > 0:
                    s = np.float32(softcap * math.tanh(s / softcap))
                scores[j] = s
                if s > best:
                    best = s
            total = exp_shifted(scores, first, limit, best)
            acc[:] = 0.0
            for j in range(first, limit):
                p = scores[j] * row_scale(v_scales, b, kh, j)
                vrow = v[b, kh, j]
                for e in range(dv):
                    acc[e] += p * widen(vrow[e])
            inv = np.float32(1.0) / total
            for e in range(dv):
                out[b, h, t, e] = acc[e] * inv


attention = njit(**_serial)(_attention)


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "arcp", "nsz", "reassoc", "afn", "nnan"})
def masked_softmax(s, mask, scale, causal):   # (no "ninf": a mask holds -inf)
    """In place over scores s [B, H, Tq, Tk] (contiguous): softmax(s * scale + mask) along Tk, mask a
    contiguous [B|1, H|1, Tq|1, Tk] (broadcast along its 1s); causal: key j seen by query t if j <= t + Tk - Tq.
    A row that sees no key (every score -inf) becomes zeros, as the reference gives. One pass per row where
    NumPy takes ten."""
    nbatch, heads, tq, tk = s.shape
    mb, mh, mt = mask.shape[0] > 1, mask.shape[1] > 1, mask.shape[2] > 1
    for b in range(nbatch):
        for h in range(heads):
            for t in range(tq):
                row = s[b, h, t]
                mrow = mask[b if mb else 0, h if mh else 0, t if mt else 0]
                limit = min(tk, t + 1 + tk - tq) if causal else tk
                best = np.float32(-np.inf)   # (a float64 best made exp_shifted's polynomial float64)
                for j in range(limit):
                    x = row[j] * scale + mrow[j]
                    row[j] = x
                    best = max(best, x)
                if limit <= 0 or best == -np.inf:
                    row[:] = 0.0
                    continue
                inv = np.float32(1.0) / exp_shifted(row, 0, limit, best)
                for j in range(limit):
                    row[j] *= inv
                for j in range(limit, tk):
                    row[j] = 0.0


def _rope_write_attend(q, k, v, k_cache, v_cache, pos, length, inv_freq, interleaved, rd, scale, causal, window,
                       softcap, attend, q_out, out, k_scales=None, v_scales=None):
    """The fused RoPE + KV write + attention of backends/cpu/rope_cache.py:
    k, v [B, Hk, T, D] rotated (k) and written at rows pos.. of the caches (float32, or bfloat16 bits:
    each value rounded as it is written; or int8 codes with their row scales k_scales, v_scales
    [B, Hk, C, 1], each row quantized as written, `store_row`); q [B, Hq, T, D]
    rotated into q_out; then, if attend, the attention of q_out over the caches' first `length` rows
    into out (kernels.attention)."""
    nbatch, hk, t, d = k.shape
    half = rd // 2
    cos = np.empty((t, half), np.float32)
    sin = np.empty((t, half), np.float32)
    for i in range(t):
        for j in range(half):
            angle = np.float64(pos + i) * np.float64(inv_freq[j])
            cos[i, j] = math.cos(angle)
            sin[i, j] = math.sin(angle)
    row = np.empty(d, np.float32)
    for b in range(nbatch):
        for h in range(hk):
            for i in range(t):
                store_row(v_cache, v_scales, b, h, pos + i, v[b, h, i])
                for j in range(half):
                    c, s = cos[i, j], sin[i, j]
                    if interleaved:
                        x0, x1 = k[b, h, i, 2 * j], k[b, h, i, 2 * j + 1]
                        row[2 * j] = x0 * c - x1 * s
                        row[2 * j + 1] = x1 * c + x0 * s
                    else:
                        x0, x1 = k[b, h, i, j], k[b, h, i, j + half]
                        row[j] = x0 * c - x1 * s
                        row[j + half] = x1 * c + x0 * s
                for e in range(rd, d):
                    row[e] = k[b, h, i, e]
                store_row(k_cache, k_scales, b, h, pos + i, row)
        for h in range(q.shape[1]):
            for i in range(t):
                for j in range(half):
                    c, s = cos[i, j], sin[i, j]
                    if interleaved:
                        x0, x1 = q[b, h, i, 2 * j], q[b, h, i, 2 * j + 1]
                        q_out[b, h, i, 2 * j] = x0 * c - x1 * s
                        q_out[b, h, i, 2 * j + 1] = x1 * c + x0 * s
                    else:
                        x0, x1 = q[b, h, i, j], q[b, h, i, j + half]
                        q_out[b, h, i, j] = x0 * c - x1 * s
                        q_out[b, h, i, j + half] = x1 * c + x0 * s
                for e in range(rd, q.shape[3]):
                    q_out[b, h, i, e] = q[b, h, i, e]
    if attend:
        attention(q_out, k_cache, v_cache, length, scale, causal, window, softcap, out, k_scales, v_scales)


rope_write_attend = njit(**_serial)(_rope_write_attend)


SPLIT = {"threads": 1}   # threads attention_blas splits its queries over (CpuPlan.run sets it: its
                        # thread setting where BLAS runs on one thread, else 1)


def attention_blas(q, k, v, length, scale, causal, window=0, softcap=0.0, scales=None):
    """_attention_blas, its queries split over SPLIT["threads"] threads (the GEMM's pool) in parts
    of equal work (a causal row's work grows with its position)."""
    threads, tq = SPLIT["threads"], q.shape[2]
    if threads <= 1 or tq < 64:
        return _attention_blas(q, k, v, length, scale, causal, window, softcap, scales)
    from . import team
    work = np.cumsum(np.arange(length - tq + 1, length + 1) if causal else np.ones(tq))
    cuts = [0] + [int(np.searchsorted(work, work[-1] * i / threads)) for i in range(1, threads)] + [tq]
    out = np.empty(q.shape[:3] + (v.shape[3],), np.float32)

    def part(r0, r1):
        if r1 > r0:
            keys = length - tq + r1 if causal else length   # a causal part sees keys up to its last row
            out[:, :, r0:r1] = _attention_blas(q[:, :, r0:r1], k, v, keys, scale, causal, window, softcap, scales)
    team.run_parallel(part, list(zip(cuts, cuts[1:])))
    return out


CODES_TILE = 1024   # keys of an int8 cache widened at a time for BLAS (prefill)
CAUSAL_CHUNK = 128  # queries per BLAS product in causal prefill attention (keys past the chunk skipped)


def _attention_blas(q, k, v, length, scale, causal, window=0, softcap=0.0, scales=None):
    """Attention for many queries (prefill) with BLAS: each K/V head multiplies its whole group of
    query heads at once (no repeated K/V), causal mask aligned to `length` (within `window` keys when
    window > 0), scores capped by softcap * tanh(s / softcap) when softcap > 0, softmax in place.
    scales: an int8 cache's (k_scales, v_scales) [B, Hk, T, 1]: its codes widened CODES_TILE keys at
    a time, each tile's scores and weights multiplied by the rows' scales (no float copy of the cache)."""
    nbatch, hq, tq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    k, v = k[:, :, :length], v[:, :, :length]
    if k.dtype != np.float32 and scales is None:   # a bfloat16 or float16 cache (its bits): the prefix widened once for BLAS
        k, v = (np.left_shift(x, 16, dtype=np.uint32).view(np.float32) if x.dtype == np.uint16 else
                x.view(np.float16).astype(np.float32) if x.dtype == np.int16 else x.astype(np.float32) for x in (k, v))
    if causal and tq > CAUSAL_CHUNK:   # each chunk of queries against the keys it sees: ~60 % of the products
        out = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
        for r0 in range(0, tq, CAUSAL_CHUNK):
            r1 = min(tq, r0 + CAUSAL_CHUNK)
            hi = length - tq + r1                                    # past the chunk's last query: unseen
            lo = max(0, length - tq + r0 - window + 1) if window else 0   # before its first query's window
            out[:, :, r0:r1] = _attention_blas(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], hi - lo, scale, causal,
                                               window, softcap, scales and tuple(x[:, :, lo:hi] for x in scales))
        return out
    if scales is not None:
        return _attention_codes(q, k, v, scales[0][:, :, :length, 0], scales[1][:, :, :length, 0], length, scale,
                                causal, window, softcap)
    s = np.matmul(q.reshape(nbatch, hk, group * tq, d), k.transpose(0, 1, 3, 2))  # [B, Hk, G*Tq, L]
    return _softmax_times_v(s, v, nbatch, hq, tq, length, scale, causal, window, softcap)


def _attention_codes(q, k, v, k_scales, v_scales, length, scale, causal, window, softcap):
    """_attention_blas over int8 codes k, v [B, Hk, L, D] and row scales [B, Hk, L]."""
    nbatch, hq, tq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    qg = q.reshape(nbatch, hk, group * tq, d)
    s = np.empty((nbatch, hk, group * tq, length), np.float32)
    for j0 in range(0, length, CODES_TILE):
        j1 = min(length, j0 + CODES_TILE)
        np.matmul(qg, k[:, :, j0:j1].astype(np.float32).transpose(0, 1, 3, 2), out=s[..., j0:j1])
        s[..., j0:j1] *= k_scales[:, :, None, j0:j1]
    return _softmax_times_v(s, (v, v_scales), nbatch, hq, tq, length, scale, causal, window, softcap)


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "arcp", "nsz", "reassoc", "afn"})
def scores_softmax(s, tq, length, scale, causal, window, softcap):
    """In place over scores s [B, Hk, G*Tq, L] (contiguous; row r is query r % Tq): softmax(cap(s * scale))
    along L over the keys the query sees (causal: j <= its position, L - Tq + t; with window > 0 also
    j > position - window), the others 0. One pass per row where NumPy took six and a masked store."""
    nbatch, heads, rows, keys = s.shape
    for b in range(nbatch):
        for h in range(heads):
            for r in range(rows):
                row = s[b, h, r]
                first, limit = 0, keys
                if causal:
                    position = r % tq + length - tq
                    limit = min(keys, position + 1)
                    if window > 0:
                        first = max(0, position - window + 1)
                best = np.float32(-np.inf)
                for j in range(first, limit):
                    x = row[j] * scale
                    if softcap > 0:
                        x = np.float32(softcap * math.tanh(x / softcap))
                    row[j] = x
                    best = max(best, x)
                if limit > first:
                    inv = np.float32(1.0) / exp_shifted(row, first, limit, best)
                    for j in range(first, limit):
                        row[j] *= inv
                for j in range(0, first):
                    row[j] = 0.0
                for j in range(max(limit, first), keys):
                    row[j] = 0.0


def _softmax_times_v(s, v, nbatch, hq, tq, length, scale, causal, window, softcap):
    """softmax(cap(s * scale), causal, window) v, in place over the scores s [B, Hk, G*Tq, L]; v float
    [B, Hk, L, Dv], or (int8 codes, row scales [B, Hk, L]) widened CODES_TILE keys at a time."""
    scores_softmax(s, tq, length, scale, causal, window, softcap)
    if not isinstance(v, tuple):
        return np.matmul(s, v).reshape(nbatch, hq, tq, v.shape[3])
    codes, v_scales = v
    out = np.zeros(s.shape[:3] + (codes.shape[3],), np.float32)
    for j0 in range(0, length, CODES_TILE):
        j1 = min(length, j0 + CODES_TILE)
        out += np.matmul(s[..., j0:j1] * v_scales[:, :, None, j0:j1], codes[:, :, j0:j1].astype(np.float32))
    return out.reshape(nbatch, hq, tq, codes.shape[3])


def sdpa_step(node: Node):
    attrs = node.attrs
    scale_attr = attrs.get("scale")
    f32 = node.dtype.name == "float32" and node.type.rank == 4
    window, softcap = int(attrs.get("window", 0)), np.float32(attrs.get("softcap", 0.0))

    codes = bool(attrs.get("kv_scales"))   # an int8 cache: its row scales are the last two sources

    def step(q, k, v, *rest):
        scales = tuple(np.ascontiguousarray(x, np.float32) for x in rest[-2:]) if codes else None
        kc, vc = (k, v) if codes else (kernel_cache(k), kernel_cache(v))
        if attrs.get("has_mask") or not f32 or q.shape[0] != k.shape[0] or kc is None or vc is None or \
                q.dtype != np.float32 or (codes and (k.dtype != np.int8 or scales[0].shape[:2] != k.shape[:2])):
            return nn_ops._sdpa((q, k, v) + rest, attrs)
        k, v = kc, vc
        length = int(rest[0]) if attrs.get("has_length") else k.shape[2]
        if not 0 <= length <= k.shape[2]:  # the kernels index the cache by it, unchecked
            raise IngotError(f"sdpa: attention length {length} is outside 0..{k.shape[2]} (the cache's positions).")
        scale = np.float32(scale_attr if scale_attr is not None else 1.0 / math.sqrt(q.shape[-1]))
        causal = attrs.get("causal", False)
        if q.shape[2] > 16 and length >= q.shape[2]:  # prefill: BLAS
            return attention_blas(q, k, v, length, scale, causal, window, softcap, scales)
        out = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
        if codes:
            attention(q, k, v, length, scale, causal, window, softcap, out, scales[0], scales[1])
        else:
            attention(q, k, v, length, scale, causal, window, softcap, out)
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


@njit(fastmath=True, cache=True)
def _layer_norm_rows(x, w, b, has_w, has_b, eps, out):
    n = x.shape[1]
    for r in range(x.shape[0]):
        mean = np.float32(0.0)
        for i in range(n):
            mean += x[r, i]
        mean /= n
        var = np.float32(0.0)
        for i in range(n):
            d = x[r, i] - mean
            var += d * d
        inv = np.float32(1.0) / np.sqrt(var / n + eps)
        for i in range(n):
            y = (x[r, i] - mean) * inv
            if has_w:
                y *= w[i]
            if has_b:
                y += b[i]
            out[r, i] = y


def layer_norm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: np.float32) -> np.ndarray:
    """LayerNorm over the last axis of a float32 array (two passes per row: mean, then variance)."""
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    none = np.zeros(1, np.float32)
    _layer_norm_rows(x2, none if w is None else w, none if b is None else b, w is not None, b is not None, eps, out)
    return out.reshape(x.shape)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) with NumPy's vectorised exp (numba's scalar exp is slower here)."""
    out = np.negative(x, out=np.empty(np.shape(x), np.float32))  # an array even for 0-d x
    np.exp(out, out=out)
    out += 1
    np.divide(x, out, out=out)
    return out


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def exp_negative(x):
    """exp(x) for x <= 0, zero below -87: a Cephes-style polynomial, relative error ~1e-7, the power of
    two built from its bits, so that LLVM vectorises a loop of it (numba's math.exp is a call per element).
    Zero, not exp(-87), below: a softmax's masked keys scaled by 1 / sum became subnormal, and Intel cores
    take ~100 cycles a subnormal operand (Xeon VM: an encoder's P @ V 28 -> 669 us, 8,192 of them)."""
    low = x < np.float32(-87.0)
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _float_of_bits(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))
    return np.float32(0.0) if low else y


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def sigmoid(x):
    """1 / (1 + exp(-x)), vectorisable (exp of -|x| only: no overflow)."""
    e = exp_negative(-abs(x))
    return (np.float32(1.0) if x >= 0 else e) / (np.float32(1.0) + e)


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def tanh(x):
    """tanh through exp(-2|x|); a cubic below 0.02, where 1 - e would cancel (relative error < 2e-6)."""
    a = abs(x)
    e = exp_negative(np.float32(-2.0) * a)
    t = (np.float32(1.0) - e) / (np.float32(1.0) + e) if a >= np.float32(0.02) else a * (np.float32(1.0) - a * a / np.float32(3.0))
    return t if x >= 0 else -t

@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "arcp", "nsz"})
def gelu_tanh_rows(x, out):
    """out = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) over flat float32 arrays."""
    c = np.float32(0.7978845608028654)
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = np.float32(0.5) * v * (np.float32(1.0) + tanh(c * (v + np.float32(0.044715) * v * v * v)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation of a float32 array (one vectorised pass; NumPy's takes eight)."""
    x = np.asarray(x, dtype=np.float32, order="C")
    out = np.empty(x.shape, np.float32)
    gelu_tanh_rows(x.reshape(-1), out.reshape(-1))
    return out


# erf(x) ~ x P(x^2) / Q(x^2) on x clamped to [-4, 4] (erf(4) = 1 - 1.5e-8): the rational
# approximation Eigen uses for float32; max error 4.5e-7 against float64 erf (tests/test_cpu_kernels.py).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


_P = tuple(np.float32(c) for c in _ERF_P)
_Q = tuple(np.float32(c) for c in _ERF_Q)
_EXACT = dict(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "arcp", "nsz"})
# error_model="numpy": no zero-division check on p / q, which kept LLVM from vectorising the loops
# (10x slower); no fastmath "nnan", which would drop the NaN tests


@njit(inline="always", **_EXACT)
def erf_value(u):
    p0, p1, p2, p3, p4, p5, p6 = _P
    q0, q1, q2, q3, q4 = _Q
    v = min(max(u, np.float32(-4.0)), np.float32(4.0))
    v2 = v * v
    p = ((((((p0 * v2 + p1) * v2 + p2) * v2 + p3) * v2 + p4) * v2 + p5) * v2 + p6) * v
    q = (((q0 * v2 + q1) * v2 + q2) * v2 + q3) * v2 + q4
    return p / q if u == u else u   # NaN stays NaN


@njit(**_EXACT)
def erf_rows(x, out):
    for i in range(x.shape[0]):
        out[i] = erf_value(x[i])


@njit(**_EXACT)
def gelu_rows(x, out):
    """out = 0.5 x (1 + erf(x / sqrt(2))) over flat float32 arrays."""
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = np.float32(0.5) * v * (np.float32(1.0) + erf_value(v * np.float32(0.7071067811865476)))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU (erf form) of a float32 array in one vectorised pass."""
    x = np.asarray(x, dtype=np.float32, order="C")
    out = np.empty(x.shape, np.float32)
    gelu_rows(x.reshape(-1), out.reshape(-1))
    return out


def erf(x: np.ndarray) -> np.ndarray:
    """erf of a float32 array, vectorised (numba's math.erf is a C library call per element)."""
    x = np.asarray(x, dtype=np.float32, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
    out = np.empty(x.shape, np.float32)
    erf_rows(x.reshape(-1), out.reshape(-1))
    return out


def _rope_rows(x, positions, inv_freq, interleaved, rd, out):
    """x, out: [R, T, D] float32; rotate the first rd dims of each row by position * inv_freq."""
    rows, t, d = x.shape
    half = rd // 2
    cos = np.empty((t, half), np.float32)
    sin = np.empty((t, half), np.float32)
    for i in range(t):
        for j in range(half):
            angle = np.float64(positions[i]) * np.float64(inv_freq[j])
            cos[i, j] = math.cos(angle)
            sin[i, j] = math.sin(angle)
    for r in range(rows):
        for i in range(t):
            for j in range(half):
                c, s = cos[i, j], sin[i, j]
                if interleaved:
                    a, b = x[r, i, 2 * j], x[r, i, 2 * j + 1]
                    out[r, i, 2 * j] = a * c - b * s
                    out[r, i, 2 * j + 1] = b * c + a * s
                else:
                    a, b = x[r, i, j], x[r, i, j + half]
                    out[r, i, j] = a * c - b * s
                    out[r, i, j + half] = b * c + a * s
            for j in range(rd, d):
                out[r, i, j] = x[r, i, j]


rope_rows = njit(**_serial)(_rope_rows)


def rope_step(node: Node):
    attrs = node.attrs
    base, interleaved = attrs.get("base", 10000.0), bool(attrs.get("interleaved", False))
    rotary_dims = attrs.get("rotary_dims")
    cache: dict = {}

    def step(x, pos, inv_freq=None):
        d, t = x.shape[-1], x.shape[-2]
        rd = rotary_dims or d
        if inv_freq is None:
            inv_freq = cache.get(rd)
            if inv_freq is None:
                inv_freq = cache[rd] = nn_ops.rope_inv_freq(rd, base)
        if x.dtype != np.float32:
            return nn_ops.rope(x, pos, inv_freq, base, interleaved, rotary_dims)
        positions = np.arange(int(pos), int(pos) + t, dtype=np.int64) if np.ndim(pos) == 0 else np.asarray(pos, np.int64)
        x3 = np.ascontiguousarray(x).reshape(-1, t, d)
        out = np.empty_like(x3)
        rope_rows(x3, positions, inv_freq, interleaved, rd, out)
        return out.reshape(x.shape)
    return step


@njit(fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _row_means(x, out):
    """out[r] = the mean of x[r] (float32 rows, float64 partial sums: as exact as NumPy's pairwise sum)."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        row = x[r]
        total = 0.0
        for i in range(np.uintp(n)):
            total += np.float64(row[i])
        out[r] = np.float32(total / n)


def mean_of_trailing_axes(x: np.ndarray, inner: int, out: np.ndarray) -> np.ndarray:
    """The mean over x's trailing axes (inner values a row) into out (x's leading shape, any keepdims);
    ReduceMean / GlobalAveragePool of a conv model's squeeze-excite block: one pass, no reference copy."""
    x2 = np.ascontiguousarray(x).reshape(-1, inner)
    _row_means(x2, out.reshape(-1))
    return out


@njit(inline="always")
def _nan_max(a, v):
    """max(a, v), a NaN in either kept (as np.max)."""
    return v if v > a or v != v else a


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "arcp", "nsz"})
def _softmax_rows(x, out, log):
    """out[r] = softmax(x[r]) (log: log_softmax) over float32 rows: the max (four running maxima),
    exp(x - max) by exp_negative into out (a vectorised loop: no sum in it), summed in float64 by four
    partial sums (log_softmax's log(1 + small) keeps its digits), one log per row; NaN in a row makes it
    NaN. (Summing inside the exp loop kept LLVM from vectorising it: 80 x 37 logits 13.7 -> 6.7 us.)"""
    n = x.shape[1]
    for r in range(x.shape[0]):
        row, dst = x[r], out[r]
        b0 = b1 = b2 = b3 = row[0]
        i = 0
        while i + 4 <= n:
            b0, b1, b2, b3 = _nan_max(b0, row[i]), _nan_max(b1, row[i + 1]), _nan_max(b2, row[i + 2]), _nan_max(b3, row[i + 3])
            i += 4
        while i < n:
            b0 = _nan_max(b0, row[i])
            i += 1
        best = _nan_max(_nan_max(b0, b1), _nan_max(b2, b3))
        for i in range(n):
            d = row[i] - best
            dst[i] = exp_negative(d) if d >= np.float32(-87.0) else np.float32(0.0)   # -inf (a mask): exactly 0
        t0 = t1 = t2 = t3 = 0.0
        i = 0
        while i + 4 <= n:
            t0 += np.float64(dst[i])
            t1 += np.float64(dst[i + 1])
            t2 += np.float64(dst[i + 2])
            t3 += np.float64(dst[i + 3])
            i += 4
        while i < n:
            t0 += np.float64(dst[i])
            i += 1
        total = (t0 + t1) + (t2 + t3)
        if log:
            shift = np.float64(best) + math.log(total)
            for i in range(n):
                dst[i] = np.float32(row[i] - shift)
        else:
            inverse = np.float32(1.0 / total)
            for i in range(n):
                dst[i] *= inverse


def softmax_last_axis(x: np.ndarray, out: np.ndarray, log: bool) -> np.ndarray:
    """Softmax (log: log_softmax) of float32 x along its last axis into out (x's shape, not empty)."""
    n = x.shape[-1]
    _softmax_rows(np.ascontiguousarray(x).reshape(-1, n), out.reshape(-1, n), log)
    return out
