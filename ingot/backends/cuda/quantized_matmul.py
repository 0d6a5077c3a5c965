"""Quantized matmul on the GPU: y = x @ W with W kept as packed 4-bit or 8-bit integers.

Layout on the device: Ingot's k-major form (logical W [K, N], 4-bit packed along N, low nibble =
even column), made *unsigned* once at load (see `prepare_weight`):

    q:     uint8 [Kp, Np / 2] (4-bit) or uint8 [Kp, Np] (8-bit)
    scale: [Kp / GROUP, Np]  float32 (float16 where that is exact, as GGUF's f16 scales are)
    bias:  [Kp / GROUP, Np]  w = v * scale + bias, v the unsigned stored integer

Signed integers and zero points fold into the bias (int4: v_u = v_s + 8, so bias' = bias -
(zero_point + 8) * scale): one kernel serves int4/uint4/int8/uint8 affine. Lookup tables (LUT-4,
LUT-8) index the raw unsigned bits, as the NumPy reference does. GROUP is a power of two dividing
the parameter block, so a tile of at most GROUP rows of K shares one row of parameters.

Kernels, each in the shape of STYLE.md (kernel -> wrapper -> test -> benchmark):
- `_qgemv_kernel` (one row of x): [BLOCK_K, BLOCK_N] tiles along the contiguous N axis, the
  nibbles split in registers, w = v * s + b applied per element, products accumulated in a 2-D
  register tile and summed over K once at the end; split-K with atomics when N alone does not
  fill the chip.
- `_qgemm_kernel` (2 rows and more; for word-layout weights, more than WORDS_MAX_ROWS): the same
  dequantized tile fed to tl.dot (tensor cores; tf32x3 for float32 inputs, float32-level accuracy).
- `_qgemv_words_kernel` (1-16 rows, up to 4 a program; 4-bit affine weights re-packed with
  `words=True`, the default for matmul weights): int32 words of 8 consecutive k per column, x
  rounded to integers of LIMBS bytes (default 2: 16 bits with a float scale per block of 32; 3: 22
  bits per tile; 1: 8 bits), `dp4a` dot products; optional SiLU(gate)*x prologue, RMSNorm prologue
  (`rms_norm_matmul`: x = rms_norm(x [+ y]) * g, the row's 1 / rms multiplying the sums; x + y stored on the way) and residual
  epilogue. x is rounded once per GEMV by `_quantize_x_kernel` (XQ) instead of by every thread (the
  GLU and norm prologues then run there; with the norm, each of its programs stores its blocks' sum of
  squares and the GEMV multiplies its sums by the row's 1 / rms, XQ_RMS); or, for small weights whose output the launch ahead zeroes,
  by each program for its own split of K into its column block's copy (XQ_SELF: no quantize launch).
  Each row's x is handled in the weight tile's own register layout (`_row_dot`), so the tile never
  passes through shared memory (`scripts/sm90_compile_check.py --sass` shows barriers and
  instructions per loop).

    >>> w = prepare_weight(q, [scale, bias], attrs, "cuda")     # doctest: +SKIP
    >>> y = quantized_matmul(x, w)                                # doctest: +SKIP
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from . import timeline
from .pdl import pdl_args, pdl_enter
from .timeline import now, stamp

GEMV_MAX_ROWS = 1                                                 # more rows: the tensor-core kernel
MAGIC_CONVERT = os.environ.get("INGOT_CUDA_MAGIC", "1") == "1"   # int -> float through exponent bits
PARAMS_F16 = os.environ.get("INGOT_CUDA_F16_PARAMS", "1") == "1"  # scale/bias as f16 where that is exact


@triton.jit
def _to_float(v, MAGIC: tl.constexpr):
    """Unsigned integers < 2**23 to float32 exactly. MAGIC: OR the value into the mantissa of 2**23 and
    subtract 2**23 (a logic op and an add) instead of the int-to-float unit, which runs at 1/4 rate."""
    if MAGIC:
        return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        return v.to(tl.float32)


@triton.jit
def _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
               WORDS: tl.constexpr = False):
    """The unsigned integers of W[offs_k, n0:n0+BLOCK_N] as [BLOCK_K, BLOCK_N] (0 past the ends)."""
    k_ok = (offs_k < K)[:, None]
    if WORDS:  # word row k // 8; nibble k % 4 of the low (k % 8 < 4) or high half of each byte
        offs_n = n0 + tl.arange(0, BLOCK_N)
        words = tl.load(q_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :], mask=k_ok & (offs_n < NQ)[None, :],
                        other=0)
        shift = ((offs_k % 4) * 8 + ((offs_k // 4) % 2) * 4)[:, None]
        return (words >> shift) & 0xF
    elif BITS == 4:
        offs_b = n0 // 2 + tl.arange(0, BLOCK_N // 2)
        packed = tl.load(q_ptr + offs_k[:, None] * stride_qk + offs_b[None, :], mask=k_ok & (offs_b < NQ)[None, :], other=0)
        return tl.join(packed & 0xF, packed >> 4).reshape([BLOCK_K, BLOCK_N])
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        return tl.load(q_ptr + offs_k[:, None] * stride_qk + offs_n[None, :], mask=k_ok & (offs_n < NQ)[None, :], other=0)


@triton.jit
def _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                     stride_lk, stride_ln, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_K: tl.constexpr, MAGIC: tl.constexpr):
    """float32 weights of a [BLOCK_K, BLOCK_N] tile of unsigned integers."""
    if LUT:
        off = (offs_k // lut_block_k)[:, None] * stride_lk + (offs_n // lut_block_n)[None, :] * stride_ln
        return tl.load(lut_ptr + off + v.to(tl.int32), mask=(offs_k < K)[:, None] & n_mask[None, :], other=0.0)
    else:
        vf = _to_float(v, MAGIC)
        if BLOCK_K <= GROUP:        # one parameter row for the whole tile
            g = k0 // GROUP
            s = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            w = vf * s[None, :]
            if HAS_BIAS:
                w += tl.load(b_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            g = (offs_k // GROUP)[:, None]
            ok = (offs_k < K)[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + g * stride_sk + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
            w = vf * s
            if HAS_BIAS:
                w += tl.load(b_ptr + g * stride_sk + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        return w


@triton.jit
def _qgemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                  N, K, NQ, k_per_split, stride_qk, stride_sk,
                  lut_block_k, lut_block_n, stride_lk, stride_ln,
                  BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, MAGIC: tl.constexpr,
                  PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    """y[n] (+)= sum_k x[k] * W[k, n] over BLOCK_N columns and one split of K.

    BLOCK_N is sized so a warp's threads lie along N (16 bytes each): the BLOCK_K rows of a tile sit in
    each thread's registers, many 16-byte loads in flight per thread, and the sum over K is formed
    in-thread: block sums sum_k v*x, then one multiply by the row's scale (and bias * sum_k x).
    PREFETCH issues the next tile's loads before this tile's arithmetic."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_K)
    if PREFETCH:
        v_next = _load_tile(q_ptr, k_start + rows, n0, k_stop, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + rows
        if PREFETCH:
            v = v_next
            v_next = _load_tile(q_ptr, offs_k + BLOCK_K, n0, k_stop, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
        else:
            v = _load_tile(q_ptr, offs_k, n0, k_stop, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
        x = tl.load(x_ptr + offs_k, mask=offs_k < k_stop, other=0.0).to(tl.float32)
        if LUT:
            off = (offs_k // lut_block_k)[:, None] * stride_lk + (offs_n // lut_block_n)[None, :] * stride_ln
            w = tl.load(lut_ptr + off + v.to(tl.int32), mask=(offs_k < k_stop)[:, None] & n_mask[None, :], other=0.0)
            acc += tl.sum(w * x[:, None], axis=0)
        else:
            part = tl.sum(_to_float(v, MAGIC) * x[:, None], axis=0)         # [BLOCK_N] block sums
            g = k0 // GROUP                                                    # BLOCK_K <= GROUP: one row
            s = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += part * s
            if HAS_BIAS:
                b = tl.load(b_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                acc += b * tl.sum(x, axis=0)
    if ATOMIC:
        tl.atomic_add(y_ptr + offs_n, acc, mask=n_mask, sem="relaxed")
    else:
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the dot product of the four bytes of a (unsigned) with those of b (signed if SIGNED), per element."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:  # Triton's interpreter runs no PTX: byte by byte
        total = c
        for i in tl.static_range(4):
            if SIGNED:
                bb = (b << (24 - 8 * i)) >> 24
            else:
                bb = (b >> (8 * i)) & 0xFF
            total += ((a >> (8 * i)) & 0xFF) * bb
        return total


@triton.jit
def _limb_words(X, shifts, LIMB: tl.constexpr):
    """Byte LIMB of each integer of X [a, b, c, 4], four along the last axis packed into one word."""
    return tl.reduce(((X >> (8 * LIMB)) & 0xFF) << shifts, 3, _or)


@triton.jit
def _load_x(x_ptr, x2_ptr, offs, mask, GLU: tl.constexpr):
    """x, or silu(x) * x2 (the gated unit of an MLP, computed as the region kernel computes it)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GLU:
        x = (x * tl.sigmoid(x)) * tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _load_norm_x(x_ptr, x2_ptr, g_ptr, offs, k, mask, ADD: tl.constexpr, HAS_G: tl.constexpr):
    """(x [+ x2]) * g[k]: an RMSNorm's input times its weight, before the row's factor 1 / rms (which
    multiplies the GEMV's sums instead, a common factor of the row)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        x = x * tl.load(g_ptr + k, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _row_rms(x_ptr, x2_ptr, h_ptr, offs_m, m_mask, stride_xm, K, eps, WRITE, ADD: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """1 / sqrt(mean(h**2) + eps) [ROWS] of the rows offs_m of h = x (+ x2 with ADD), read whole; with ADD,
    h is also stored to h_ptr where WRITE (one program per row does it: the residual stream's next value)."""
    ss = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        offs = offs_m[:, None] * stride_xm + k[None, :]
        mask = m_mask[:, None] & (k < K)[None, :]
        h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            h = h + tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + offs, h, mask=mask & WRITE)
        ss += h * h
    return 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _pow2_scale(top):
    """(2**(148 - e), its inverse) for |x| <= top < 2**(e - 126): x * scale rounds to |X| < 2**22."""
    e = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_scale = tl.minimum(tl.maximum(275 - e, 1), 254)
    scale = (e_scale << 23).to(tl.float32, bitcast=True)
    inv = (tl.maximum(254 - e_scale, 0) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _block_scale(top, LIMBS: tl.constexpr):
    """(d, 1 / d) with d = top / qmax, qmax = 127 (LIMBS 1) or 32767 (LIMBS 2): |round(x / d)| <= qmax, so
    a block sum of 32 products with 4-bit weights stays below 32767 * 15 * 32 < 2**24 (exact in int32)."""
    top = tl.maximum(top, 1e-30)                 # an all-zero block: X = 0, not 0 * inf
    if LIMBS == 1:
        return top * (1.0 / 127.0), 127.0 / top
    else:
        return top * (1.0 / 32767.0), 32767.0 / top


@triton.jit
def _round_to_int(x, scale):
    """x * scale rounded to the nearest integer (|x * scale| < 2**22) through the exponent bits of 1.5 * 2**23."""
    return (x * scale + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def store_xq(o, b, head0, row_ok, xq_ptr, xd_ptr, xs_ptr, stride_xqm, stride_xdm, LIMBS: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """o [BLOCK_R, BLOCK_DV] stored as `_quantize_x_kernel` stores row b of x for the word GEMV (LIMBS 1
    or 2): limb words, block scales d and block sums of the rounded x, o's row r holding x[b, (head0 +
    r) * BLOCK_DV ...] in blocks of 32 (the decode attention: the query heads of one token)."""
    NB: tl.constexpr = BLOCK_DV // 32
    x = tl.reshape(o, [BLOCK_R, NB, 4, 2, 4])                        # k = 32 nb + 8 j + 4 h + i
    top = tl.max(tl.max(tl.max(tl.abs(x), axis=4), axis=3), axis=2)   # [R, NB]
    d, scale = _block_scale(top, LIMBS)
    X = _round_to_int(x, scale[:, :, None, None, None])
    blk = (head0 + tl.arange(0, BLOCK_R))[:, None] * NB + tl.arange(0, NB)[None, :]   # [R, NB]
    out = (xq_ptr + b * stride_xqm + blk[:, :, None, None] * (8 * LIMBS) + tl.arange(0, 4)[None, None, :, None]
           + tl.arange(0, 2)[None, None, None, :] * 4)                                 # [R, NB, 4 (j), 2 (h)]
    shifts = tl.arange(0, 4)[None, None, None, None, :] * 8
    for limb in tl.static_range(LIMBS):
        tl.store(out + limb * 8, tl.reduce(((X >> (8 * limb)) & 0xFF) << shifts, 4, _or), mask=row_ok[:, None, None, None])
    x_sum = tl.sum(tl.sum(tl.sum(X, axis=4), axis=3), axis=2).to(tl.float32) * d
    tl.store(xd_ptr + b * stride_xdm + blk, d, mask=row_ok[:, None])
    tl.store(xs_ptr + b * stride_xdm + blk, x_sum, mask=row_ok[:, None])


@triton.jit
def _quantize_x_kernel(x_ptr, x2_ptr, xq_ptr, xd_ptr, xs_ptr, K, KB, stride_xm, stride_xqm, stride_xdm,
                       LIMBS: tl.constexpr, BLOCKS: tl.constexpr, GLU: tl.constexpr,
                       g_ptr=None, h_ptr=None, eps=0.0, NORM: tl.constexpr = False, ADD: tl.constexpr = False,
                       HAS_G: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 16, PDL: tl.constexpr = False,
                       z_ptr=None, Z=0, ZERO: tl.constexpr = False, stamp_ptr=None, STAMP: tl.constexpr = 0,
                       PARTS: tl.constexpr = False, ssq_ptr=None):
    """x [M, K] -> what `_qgemv_words_kernel` with XQ loads, for BLOCKS blocks of 32 k of one row:

        xq int32 [M, KB, LIMBS, 2, 4]: word (b, l, h, j) = byte l of X[32b + 8j + 4h + i] at bits 8i (i = 0..3),
                                       h the low (k % 8 < 4) or high half of weight word j of the block
        xd float32 [M, KB]: the block's scale d, x ~ X * d
        xs float32 [M, KB]: the block's sum of x (for bias * sum x)

    X = round(x / d): LIMBS 1/2 with d = max|x_block| / qmax (`_block_scale`), LIMBS 3 with a power of
    two per block (`_pow2_scale`, |X| < 2**22). Lower limbs unsigned, the top one signed. K past the end
    reads as 0. GLU: x = silu(x) * x2, as `_load_x`. xs sums the rounded x (X * d) for LIMBS 1/2, so the
    GEMV computes (X * d) @ W, and x itself for LIMBS 3, as the GEMV without XQ does.

    NORM: x = rms_norm(x [+ x2 with ADD]) * g: (x [+ x2]) * g is rounded, and the row's 1 / rms
    (`_row_rms`, the whole row read by every program) multiplies d and the block sums, so the GEMV
    is unchanged. With ADD the first program of a row stores x + x2 to h_ptr. NORM and PARTS: each
    program reads only its own blocks, stores their sum of squares of x [+ x2] to ssq [M, programs a row],
    and the scales and sums without 1 / rms: the GEMV (XQ_RMS) adds the row's parts and multiplies its
    sums by it. With ADD, each program stores its own blocks of x + x2.

    ZERO: the programs also zero z [Z] (float32, contiguous), the output the GEMV after this kernel
    adds its splits into atomically: no memset between the two, which would keep the GEMV from
    starting while this kernel runs (programmatic dependent launch). STAMP: timeline.py."""
    me = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    t0 = now(STAMP)
    pdl_enter(PDL)
    t1 = now(STAMP)
    pid_b = tl.program_id(0)
    m = tl.program_id(1)
    if ZERO:
        _zero_share(z_ptr, Z, m * tl.num_programs(0) + pid_b, tl.num_programs(0) * tl.num_programs(1))
    r = 1.0
    if NORM and not PARTS:
        rows = m + tl.arange(0, 1)
        r = _row_rms(x_ptr, x2_ptr, h_ptr, rows, rows >= 0, stride_xm, K, eps, pid_b == 0, ADD, 1, NORM_BLOCK)  # [1]
    if PARTS:
        ssq_ptr += m * tl.num_programs(0) + pid_b
    _round_blocks(x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, m, pid_b * BLOCKS + tl.arange(0, BLOCKS), KB, K,
                  stride_xm, stride_xqm, stride_xdm, r, LIMBS, GLU, NORM, ADD, HAS_G, PARTS, h_ptr, ssq_ptr)
    t2 = now(STAMP)
    stamp(stamp_ptr, me, t0, t1, t2, STAMP)


@triton.jit
def _zero_share(z_ptr, Z, index, count):
    """Program `index` of `count` zeroes its share of z [Z] (float32, contiguous)."""
    per = tl.cdiv(Z, count)
    z_start = index * per
    for z0 in range(z_start, z_start + per, 1024):
        offs_z = z0 + tl.arange(0, 1024)
        tl.store(z_ptr + offs_z, tl.zeros([1024], tl.float32), mask=(offs_z < z_start + per) & (offs_z < Z))


@triton.jit
def _round_blocks(x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, m, blk, b_stop, K, stride_xm, stride_xqm, stride_xdm, r,
                  LIMBS: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, HAS_G: tl.constexpr,
                  PARTS: tl.constexpr = False, h_ptr=None, ssq_ptr=None):
    """Blocks blk [BLOCKS] (those below b_stop) of 32 k of row m of x rounded and stored as
    `_quantize_x_kernel` documents, the scales and block sums multiplied by r (the row's 1 / rms, or 1).
    PARTS (with NORM): also the sum of squares of these blocks of h = x [+ x2] stored to ssq_ptr, and with
    ADD h itself to h_ptr (x's row stride)."""
    k = (blk[:, None, None, None] * 32 + tl.arange(0, 4)[None, :, None, None] * 8
         + tl.arange(0, 2)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])   # [BLOCKS, 4 j, 2 h, 4 i]
    if NORM and PARTS:
        ok = (k < K) & (blk < b_stop)[:, None, None, None]
        h = tl.load(x_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            h = h + tl.load(x2_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        x = h
        if HAS_G:
            x = h * tl.load(g_ptr + k, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            tl.store(h_ptr + m * stride_xm + k, h, mask=ok)
        tl.store(ssq_ptr, tl.sum(tl.sum(tl.sum(tl.sum(h * h, axis=3), axis=2), axis=1), axis=0))
    elif NORM:
        x = _load_norm_x(x_ptr, x2_ptr, g_ptr, m * stride_xm + k, k, k < K, ADD, HAS_G)
    else:
        x = _load_x(x_ptr, x2_ptr, m * stride_xm + k, k < K, GLU)
    top = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)                           # [BLOCKS]
    if LIMBS == 3:
        scale, d = _pow2_scale(top)
    else:
        d, scale = _block_scale(top, LIMBS)
    X = _round_to_int(x, scale[:, None, None, None])
    shifts = tl.arange(0, 4)[None, None, None, :] * 8
    b_ok = blk < b_stop
    out = (xq_ptr + m * stride_xqm + blk[:, None, None] * (8 * LIMBS) + tl.arange(0, 4)[None, :, None]
           + tl.arange(0, 2)[None, None, :] * 4)                                              # [BLOCKS, 4 (j), 2 (h)]
    for limb in tl.static_range(LIMBS):
        tl.store(out + limb * 8, _limb_words(X, shifts, limb), mask=b_ok[:, None, None])
    if LIMBS == 3:
        x_sum = tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=1)
    else:   # the sum of the rounded x: y is then exactly (X * d) @ W, whose error follows |W|, not |v * scale|
        x_sum = tl.sum(tl.sum(tl.sum(X, axis=3), axis=2), axis=1).to(tl.float32) * d
    tl.store(xd_ptr + m * stride_xdm + blk, d * r, mask=b_ok)
    tl.store(xs_ptr + m * stride_xdm + blk, x_sum * r, mask=b_ok)


@triton.jit
def _prmt(a, b, SELECT: tl.constexpr):
    """The bytes of (b:a) that SELECT's nibbles pick (PTX prmt), one instruction."""
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECT};", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _x_word(x0, x1, x2, x3, LIMB: tl.constexpr, ASM: tl.constexpr):
    """Byte LIMB of the integers x0..x3 packed into one word (x0 in the low byte): three byte permutes
    (ASM), or shifts and masks."""
    if ASM:
        pair: tl.constexpr = LIMB | ((4 + LIMB) << 4)
        return _prmt(_prmt(x0, x1, pair), _prmt(x2, x3, pair), 0x5410)
    else:
        return (((x0 >> (8 * LIMB)) & 0xFF) | (((x1 >> (8 * LIMB)) & 0xFF) << 8) | (((x2 >> (8 * LIMB)) & 0xFF) << 16)
                | (((x3 >> (8 * LIMB)) & 0xFF) << 24))


@triton.jit
def _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, J: tl.constexpr, EVEN_K: tl.constexpr, GLU: tl.constexpr,
           NORM: tl.constexpr, ADD: tl.constexpr, HAS_G: tl.constexpr):
    """x at k + J (offs + J) as the GEMV multiplies it (`_load_x`, `_load_norm_x`); EVEN_K: no tile
    reaches past K, so only the row is masked."""
    offs += J
    k += J
    mask = m_ok
    if not EVEN_K:
        mask = mask & (k < K)
    if NORM:
        return _load_norm_x(x_ptr, x2_ptr, g_ptr, offs, k, mask, ADD, HAS_G)
    else:
        return _load_x(x_ptr, x2_ptr, offs, mask, GLU)


@triton.jit
def _limb_dot(lo, hi, x_lo_w, x_hi_w, acc, LIMB: tl.constexpr, LIMBS: tl.constexpr, ASM: tl.constexpr):
    """acc + (the dot products of the weight nibbles lo/hi with limb LIMB of x) << 8 * LIMB."""
    p = _dp4a(lo, x_lo_w, tl.zeros_like(lo), LIMB == LIMBS - 1, ASM)
    p = _dp4a(hi, x_hi_w, p, LIMB == LIMBS - 1, ASM)
    return acc + (p << (8 * LIMB))


@triton.jit
def _row_dot(lo, hi, m, m_ok, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, KB, stride_xm,
             stride_xqm, stride_xdm, TB: tl.constexpr, LIMBS: tl.constexpr, ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
             GLU: tl.constexpr, XFREE: tl.constexpr, XQ: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
             HAS_G: tl.constexpr, EVEN_K: tl.constexpr):
    """Row m's sums of one weight tile, per block of 32 k: sum x * v [TB, BLOCK_N] (v the 4-bit values,
    w = v * s + b) and sum x [TB] (for b * sum x; without HAS_BIAS a placeholder). lo/hi [TB, 4, BLOCK_N]
    are the low and high nibbles of TB blocks of 32 k from word row kw0.

    x is handled as [TB, 4, 1] tensors, one word per weight word row, in the weight tile's own layout:
    every thread holds its row's x words (the same in every thread, loads that hit L1), so the weight
    tile is used in the registers it was loaded into. Built the other way (x as [ROWS, TB, 4, 4] and the
    tile broadcast over ROWS), Triton moved each weight tile through shared memory: 36 barriers per
    tile on sm_90a (ptxas, 2026-12-03)."""
    word = tl.arange(0, TB)[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]           # [TB, 4, 1]
    limb_sum = tl.zeros_like(lo)
    if XQ:
        x_ok = m_ok & (blk < KB)[:, None, None]
        xq_words = xq_ptr + m * stride_xqm + blk[:, None, None] * (8 * LIMBS) + tl.arange(0, 4)[None, :, None]
        for limb in tl.static_range(LIMBS):
            limb_sum = _limb_dot(lo, hi, tl.load(xq_words + limb * 8, mask=x_ok, other=0),
                                 tl.load(xq_words + (limb * 8 + 4), mask=x_ok, other=0), limb_sum, limb, LIMBS, ASM)
        d = tl.load(xd_ptr + m * stride_xdm + blk, mask=m_ok & (blk < KB), other=0.0)                   # [TB]
        if HAS_BIAS:
            x_sum = tl.load(xs_ptr + m * stride_xdm + blk, mask=m_ok & (blk < KB), other=0.0)
    elif XFREE:   # for measuring only: x taken as a constant (wrong results)
        for limb in tl.static_range(LIMBS):
            w = tl.full([TB, 4, 1], 0x01010101 + limb, tl.int32)
            limb_sum = _limb_dot(lo, hi, w, w, limb_sum, limb, LIMBS, ASM)
        d = tl.full([TB], 1.0, tl.float32)
        x_sum = d
    else:   # x rounded here: 8 loads of [TB, 4, 1], the k % 8 = j of each word row
        k = kw0 * 8 + word * 8
        offs = m * stride_xm + k
        l0 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 0, EVEN_K, GLU, NORM, ADD, HAS_G)
        l1 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 1, EVEN_K, GLU, NORM, ADD, HAS_G)
        l2 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 2, EVEN_K, GLU, NORM, ADD, HAS_G)
        l3 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 3, EVEN_K, GLU, NORM, ADD, HAS_G)
        h0 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 4, EVEN_K, GLU, NORM, ADD, HAS_G)
        h1 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 5, EVEN_K, GLU, NORM, ADD, HAS_G)
        h2 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 6, EVEN_K, GLU, NORM, ADD, HAS_G)
        h3 = _row_x(x_ptr, x2_ptr, g_ptr, offs, k, m_ok, K, 7, EVEN_K, GLU, NORM, ADD, HAS_G)
        top = tl.maximum(tl.maximum(tl.maximum(tl.abs(l0), tl.abs(l1)), tl.maximum(tl.abs(l2), tl.abs(l3))),
                         tl.maximum(tl.maximum(tl.abs(h0), tl.abs(h1)), tl.maximum(tl.abs(h2), tl.abs(h3))))
        top = tl.max(top, axis=1)                                                                      # [TB, 1]
        if LIMBS == 3:   # one power of two per row and tile
            scale, inv = _pow2_scale(tl.max(top, axis=0))
            d = tl.full([TB], 1.0, tl.float32) * inv
            sc = scale
        else:            # d per row and block
            d2, sc = _block_scale(top, LIMBS)
            d = tl.sum(d2, axis=1)        # [TB, 1] -> [TB] (a sum over one element)
            sc = sc[:, :, None]
        L0 = _round_to_int(l0, sc)
        L1 = _round_to_int(l1, sc)
        L2 = _round_to_int(l2, sc)
        L3 = _round_to_int(l3, sc)
        H0 = _round_to_int(h0, sc)
        H1 = _round_to_int(h1, sc)
        H2 = _round_to_int(h2, sc)
        H3 = _round_to_int(h3, sc)
        for limb in tl.static_range(LIMBS):
            limb_sum = _limb_dot(lo, hi, _x_word(L0, L1, L2, L3, limb, ASM), _x_word(H0, H1, H2, H3, limb, ASM),
                                 limb_sum, limb, LIMBS, ASM)
        if HAS_BIAS:
            if LIMBS == 3:
                x_sum = tl.sum(tl.sum((l0 + l1) + (l2 + l3) + ((h0 + h1) + (h2 + h3)), axis=2), axis=1)
            else:   # of X * d, as XQ
                x_sum = tl.sum(tl.sum((L0 + L1) + (L2 + L3) + ((H0 + H1) + (H2 + H3)), axis=2), axis=1).to(tl.float32) * d
    block_sum = tl.sum(limb_sum, axis=1)                                                     # [TB, BLOCK_N] exact
    if not HAS_BIAS:
        x_sum = d
    return block_sum.to(tl.float32) * d[:, None], x_sum


@triton.jit
def _weight_tile(qw_ptr, rows, kw_stop, stride_qw, nn, n_mask):
    """Word rows `rows` [TB, 4, 1] of the columns nn [1, 1, BLOCK_N] (zero at or past kw_stop)."""
    return tl.load(qw_ptr + rows * stride_qw + nn, mask=(rows < kw_stop) & n_mask[None, None, :], other=0)


@triton.jit
def _block_params(s_ptr, b_ptr, blk, kw_stop, offs_n, n_mask, stride_sk, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The scale and bias [BLOCK_N] (float32) of block blk of 32 k (zero past the split's end)."""
    ok = n_mask & (blk * 4 < kw_stop)
    row = (blk * 32 // GROUP) * stride_sk + offs_n
    s = tl.load(s_ptr + row, mask=ok, other=0.0).to(tl.float32)
    b = s
    if HAS_BIAS:
        b = tl.load(b_ptr + row, mask=ok, other=0.0).to(tl.float32)
    return s, b


@triton.jit
def _scaled(sums, x_sum, s0, b0, s1, b1, TB: tl.constexpr, HAS_BIAS: tl.constexpr):
    """sum over the tile's blocks of sums * s (+ b * x_sum): one [BLOCK_N] vector per block (s0/b0,
    s1/b1), in the layout the tile's columns have (loaded as [TB, BLOCK_N], float16 scales took 8
    columns a thread against the tile's 4, and Triton converted every tile through shared memory)."""
    t = tl.arange(0, TB)[:, None]
    out = tl.sum(tl.where(t == 0, sums, 0.0), axis=0) * s0
    if HAS_BIAS:
        out += b0 * _pick(x_sum, 0)
    if TB > 1:
        out += tl.sum(tl.where(t == 1, sums, 0.0), axis=0) * s1
        if HAS_BIAS:
            out += b1 * _pick(x_sum, 1 % TB)
    return out


@triton.jit
def _pick(v, i: tl.constexpr):
    """Element i of the small vector v, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, v.shape[0]) == i, v, 0.0), axis=0)


@triton.jit
def _row_out(acc, m, M, N, offs_n, n_mask, y_ptr, res_ptr, part, stride_ym, stride_rm, REDUCE: tl.constexpr,
             RESIDUAL: tl.constexpr):
    """Row m's sums [BLOCK_N] of one split: added into y (REDUCE 1), stored as the split's partial
    (REDUCE 2, summed by `_row_total`), or stored (+ the residual) when there is one split."""
    mask = n_mask & (m < M)
    if REDUCE == 1:
        tl.atomic_add(y_ptr + m * stride_ym + offs_n, acc, mask=mask, sem="relaxed")
    elif REDUCE == 2:
        tl.store(part + m * N + offs_n, acc, mask=mask)
    else:
        if RESIDUAL:
            acc += tl.load(res_ptr + m * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_total(m, M, N, offs_n, n_mask, splits, y_ptr, res_ptr, part_ptr, stride_ym, stride_rm, RESIDUAL: tl.constexpr):
    """Row m of y: the splits' partial sums added in order (+ the residual), by the last split to finish."""
    mask = n_mask & (m < M)
    total = tl.zeros(offs_n.shape, dtype=tl.float32)
    for sk in range(0, splits):
        total += tl.load(part_ptr + sk * M * N + m * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    if RESIDUAL:
        total += tl.load(res_ptr + m * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qgemv_words_kernel(x_ptr, x2_ptr, qw_ptr, s_ptr, b_ptr, y_ptr, res_ptr, part_ptr, count_ptr, M, N, K, KW, kw_per_split,
                        stride_xm, stride_qw, stride_sk, stride_ym, stride_rm,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        TB: tl.constexpr, REDUCE: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                        GLU: tl.constexpr = False, RESIDUAL: tl.constexpr = False, XFREE: tl.constexpr = False,
                        xq_ptr=None, xd_ptr=None, xs_ptr=None, KB=0, stride_xqm=0, stride_xdm=0,
                        LIMBS: tl.constexpr = 3, XQ: tl.constexpr = False,
                        g_ptr=None, h_ptr=None, eps=0.0, NORM: tl.constexpr = False, ADD: tl.constexpr = False,
                        HAS_G: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 16, EVEN_K: tl.constexpr = False,
                        PDL: tl.constexpr = False, XQ_SELF: tl.constexpr = False, SELF_BLOCKS: tl.constexpr = 8,
                        copy_q=0, copy_d=0, z_ptr=None, Z=0, ZERO: tl.constexpr = False,
                        EARLY_W: tl.constexpr = False, stamp_ptr=None, STAMP: tl.constexpr = 0,
                        ssq_ptr=None, nparts=0, XQ_RMS: tl.constexpr = False, NPARTS: tl.constexpr = 1):
    """y[m, n] (+)= sum_k x[m, k] * W[k, n] for ROWS rows of x, BLOCK_N columns and one split of K, from
    the word layout (`QuantizedWeight.words`): one int32 holds 8 consecutive k of one column.

    A tile is TB blocks of 32 k: [TB, 4, BLOCK_N] words, each thread 16 bytes (4 columns) of a row.
    x is rounded to integers X and split into LIMBS bytes (lower ones unsigned, the top one signed);
    `dp4a` multiplies four nibbles by four bytes and adds, so 8 weights cost 2 * LIMBS integer dot
    products instead of 8 conversions and 8 multiply-adds. Per block of 32 the limb sums combine
    exactly in int32, then one float multiply by the block's weight scale and x scale (and bias * sum x).

    x scales: LIMBS 3, one power of two per row and tile, |X| < 2**22 (the rounding is below float32's
    on the tile's largest element), bias * the float sum of x; LIMBS 1/2, d = max|x| / 127 or / 32767
    per row and block of 32, bias * the sum of X * d, so y = (X * d) @ W up to float32 rounding.
    XQ: x was quantized once by `_quantize_x_kernel` (limb words xq, scales xd, block sums xs, KB blocks
    per row): a tile loads 2 * LIMBS words per block and row (the same for every thread), no rounding.

    REDUCE: 0 one split, stored; 1 splits added atomically into a zeroed y; 2 each split stores its
    partial sums and the last program of a column (a ticket per column, reset behind it) adds them in
    order (no memset launch, deterministic). GLU: x = silu(x) * x2 (with XQ, done by the quantize
    kernel). RESIDUAL: y = res + x @ W. NORM (not with XQ: the quantize kernel does it): x =
    rms_norm(x [+ x2 with ADD]) * g; (x [+ x2]) * g is rounded, and the sums are multiplied by the row's
    1 / rms (`_row_rms`: every program reads its rows whole; with ADD, the programs of column block 0
    and split 0 store x + x2 to h_ptr, each row once).

    XQ_SELF (with XQ): no quantize launch ahead; each program first rounds the blocks of its own split
    of K (its rows, with the GLU or norm prologue, `_round_blocks`) into xq/xd/xs, then reads them as
    XQ. Each column block has its own copy of xq/xd/xs (copy_q words and copy_d floats apart), so no two
    programs store to the same words; a CTA barrier orders a program's stores before its loads. With
    NORM the scales are stored without 1 / rms, which multiplies the sums at the end as without XQ.
    ZERO: the programs zero z [Z] (float32, apart from every operand), the split-K output of the GEMV
    launched after this one. PREFETCH: each weight tile is loaded a tile ahead of its arithmetic;
    EARLY_W: the first one before `pdl_enter`, while the kernel ahead still runs, only for weights no
    kernel of the stream writes (a replayed graph's constants: `_words_gemv`'s rule). STAMP: timeline.py.
    XQ_RMS (with XQ): x was rounded before an RMSNorm's 1 / rms (the quantize kernel's PARTS): the row's
    nparts sums of squares at ssq_ptr [M, nparts] (NPARTS, a power of two, covers them) give it, and it
    multiplies the sums."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    me = (pid_m * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_n
    t0 = now(STAMP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * ROWS + tl.arange(0, ROWS)
    m_mask = offs_m < M
    KWT: tl.constexpr = 4 * TB
    kw_start = pid_k * kw_per_split
    kw_stop = tl.minimum(kw_start + kw_per_split, KW)
    blocks = tl.arange(0, TB)
    tile_rows = blocks[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]                # [TB, 4, 1]
    nn = offs_n[None, None, :]
    tl.static_assert(ROWS == 1 or ROWS == 2 or ROWS == 4, "the word GEMV takes 1, 2 or 4 rows per program")
    tl.static_assert(TB == 1 or TB == 2, "the word GEMV's tiles are 1 or 2 blocks of 32 k")
    m0 = pid_m * ROWS                                # this program's first row of x
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)   # one accumulator per row: see _row_dot
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH and EARLY_W:   # constant weights: nothing ahead on the stream writes them
        w_next = _weight_tile(qw_ptr, kw_start + tile_rows, kw_stop, stride_qw, nn, n_mask)
    pdl_enter(PDL)   # from here on every other load and store: the kernels ahead may write any of it (pdl.py)
    t1 = now(STAMP)
    if PREFETCH and not EARLY_W:
        w_next = _weight_tile(qw_ptr, kw_start + tile_rows, kw_stop, stride_qw, nn, n_mask)
    if XQ_RMS:   # the row's 1 / rms from the quantize kernel's parts
        parts = tl.arange(0, NPARTS)
        ss = tl.load(ssq_ptr + offs_m[:, None] * nparts + parts[None, :], mask=m_mask[:, None] & (parts < nparts)[None, :],
                     other=0.0)
        r = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)                                    # [ROWS]
    if ZERO:
        _zero_share(z_ptr, Z, me, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2))
    if XQ_SELF:   # this split's blocks of x rounded, for the loop's XQ loads
        xq_ptr += pid_n * copy_q
        xd_ptr += pid_n * copy_d
        xs_ptr += pid_n * copy_d
        b_stop = tl.minimum(tl.cdiv(kw_stop, 4), KB)
        for i in tl.static_range(ROWS):
            if m0 + i < M:
                for b0 in range(kw_start // 4, b_stop, SELF_BLOCKS):
                    _round_blocks(x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, m0 + i, b0 + tl.arange(0, SELF_BLOCKS),
                                  b_stop, K, stride_xm, stride_xqm, stride_xdm, 1.0, LIMBS, GLU, NORM, ADD, HAS_G)
    if NORM:   # after the first weight tile's loads are issued: the row's sum of squares hides their latency
        r = _row_rms(x_ptr, x2_ptr, h_ptr, offs_m, m_mask, stride_xm, K, eps, (pid_n == 0) & (pid_k == 0), ADD, ROWS,
                     NORM_BLOCK)                                                             # [ROWS]
    if XQ_SELF:
        tl.debug_barrier()                                    # every thread's rounded x is stored
    for kw0 in range(kw_start, kw_stop, KWT):
        rows = kw0 + tile_rows
        if PREFETCH:
            w = w_next
            w_next = _weight_tile(qw_ptr, rows + KWT, kw_stop, stride_qw, nn, n_mask)
        else:
            w = _weight_tile(qw_ptr, rows, kw_stop, stride_qw, nn, n_mask)
        blk = kw0 // 4 + blocks                                                               # blocks of 32 k
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        s0, b0 = _block_params(s_ptr, b_ptr, kw0 // 4, kw_stop, offs_n, n_mask, stride_sk, GROUP, HAS_BIAS)
        s1, b1 = s0, b0
        if TB > 1:
            s1, b1 = _block_params(s_ptr, b_ptr, kw0 // 4 + 1, kw_stop, offs_n, n_mask, stride_sk, GROUP, HAS_BIAS)
        sums, x_sum = _row_dot(lo, hi, m0, m0 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, KB,
                               stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XFREE, XQ, NORM, ADD,
                               HAS_G, EVEN_K)
        acc0 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
        if ROWS > 1:
            sums, x_sum = _row_dot(lo, hi, m0 + 1, m0 + 1 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XFREE, XQ, NORM,
                                   ADD, HAS_G, EVEN_K)
            acc1 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
        if ROWS > 2:
            sums, x_sum = _row_dot(lo, hi, m0 + 2, m0 + 2 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XFREE, XQ, NORM,
                                   ADD, HAS_G, EVEN_K)
            acc2 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
            sums, x_sum = _row_dot(lo, hi, m0 + 3, m0 + 3 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XFREE, XQ, NORM,
                                   ADD, HAS_G, EVEN_K)
            acc3 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
    t2 = now(STAMP)
    if NORM or XQ_RMS:
        acc0 *= _pick(r, 0)
        acc1 *= _pick(r, 1 % ROWS)
        acc2 *= _pick(r, 2 % ROWS)
        acc3 *= _pick(r, 3 % ROWS)
    # each row's sums written on their own, in the accumulators' layout
    part = part_ptr + pid_k * M * N
    _row_out(acc0, m0, M, N, offs_n, n_mask, y_ptr, res_ptr, part, stride_ym, stride_rm, REDUCE, RESIDUAL)
    if ROWS > 1:
        _row_out(acc1, m0 + 1, M, N, offs_n, n_mask, y_ptr, res_ptr, part, stride_ym, stride_rm, REDUCE, RESIDUAL)
    if ROWS > 2:
        _row_out(acc2, m0 + 2, M, N, offs_n, n_mask, y_ptr, res_ptr, part, stride_ym, stride_rm, REDUCE, RESIDUAL)
        _row_out(acc3, m0 + 3, M, N, offs_n, n_mask, y_ptr, res_ptr, part, stride_ym, stride_rm, REDUCE, RESIDUAL)
    if REDUCE == 2:
        splits = tl.num_programs(1)
        tl.debug_barrier()                                        # every thread's partial is written
        ticket = tl.atomic_add(count_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if ticket == splits - 1:                                  # the last split of this column: sum in order
            for i in tl.static_range(ROWS):
                _row_total(m0 + i, M, N, offs_n, n_mask, splits, y_ptr, res_ptr, part_ptr, stride_ym, stride_rm,
                           RESIDUAL)
            tl.atomic_xchg(count_ptr + pid_m * tl.num_programs(0) + pid_n, 0, sem="relaxed")   # ready for the next launch
    stamp(stamp_ptr, me, t0, t1, t2, STAMP)


@triton.jit
def _qgemv_words_nloop_kernel(x_ptr, qw_ptr, s_ptr, b_ptr, y_ptr, M, N, K, KW, n_per_program,
                              stride_xm, stride_qw, stride_sk, stride_ym,
                              GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                              TB: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """`_qgemv_words_kernel` turned around: a program owns one tile of K (TB blocks of 32) and walks
    along N, so x is turned into integers once and stays in registers; each [TB, 4, BLOCK_N] weight
    tile is prefetched one step ahead, and its partial sums go to y by atomic adds."""
    pdl_enter(PDL)
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * ROWS + tl.arange(0, ROWS)
    m_mask = offs_m < M
    KWT: tl.constexpr = 4 * TB
    kw0 = pid_k * KWT
    blocks = tl.arange(0, TB)
    rows = kw0 + blocks[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]                # [TB, 4, 1]
    r_ok = rows < KW
    blk = kw0 // 4 + blocks
    b_ok = (blk * 4 < KW)[:, None]
    prow = (blk * 32 // GROUP)[:, None] * stride_sk
    x_rel = (tl.arange(0, TB)[None, :, None, None] * 32 + tl.arange(0, 4)[None, None, :, None] * 8
             + tl.arange(0, 4)[None, None, None, :])
    shifts = tl.arange(0, 4)[None, None, None, :] * 8
    x_rows = x_ptr + offs_m[:, None, None, None] * stride_xm
    kl = kw0 * 8 + x_rel
    xm = m_mask[:, None, None, None]
    x_lo = tl.load(x_rows + kl, mask=xm & (kl < K), other=0.0).to(tl.float32)
    x_hi = tl.load(x_rows + kl + 4, mask=xm & (kl + 4 < K), other=0.0).to(tl.float32)
    top = tl.max(tl.max(tl.max(tl.maximum(tl.abs(x_lo), tl.abs(x_hi)), axis=3), axis=2), axis=1)
    e = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_scale = tl.minimum(tl.maximum(275 - e, 1), 254)
    scale = (e_scale << 23).to(tl.float32, bitcast=True)
    inv = (tl.maximum(254 - e_scale, 0) << 23).to(tl.float32, bitcast=True)
    sc = scale[:, None, None, None]
    X_lo = (x_lo * sc + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    X_hi = (x_hi * sc + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    shape: tl.constexpr = [ROWS, TB, 4, BLOCK_N]
    l0 = tl.broadcast_to(_limb_words(X_lo, shifts, 0)[:, :, :, None], shape)
    h0 = tl.broadcast_to(_limb_words(X_hi, shifts, 0)[:, :, :, None], shape)
    l1 = tl.broadcast_to(_limb_words(X_lo, shifts, 1)[:, :, :, None], shape)
    h1 = tl.broadcast_to(_limb_words(X_hi, shifts, 1)[:, :, :, None], shape)
    l2 = tl.broadcast_to(_limb_words(X_lo, shifts, 2)[:, :, :, None], shape)
    h2 = tl.broadcast_to(_limb_words(X_hi, shifts, 2)[:, :, :, None], shape)
    x_sum = tl.sum(tl.sum(x_lo + x_hi, axis=3), axis=2)                                       # [ROWS, TB]
    zero = tl.zeros(shape, dtype=tl.int32)
    n_start = pid_n * n_per_program
    n_stop = tl.minimum(n_start + n_per_program, N)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    w_next = tl.load(qw_ptr + rows * stride_qw + offs_n[None, None, :], mask=r_ok & (offs_n < n_stop)[None, None, :], other=0)
    for n0 in range(n_start, n_stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_stop
        w = w_next
        nxt = offs_n + BLOCK_N
        w_next = tl.load(qw_ptr + rows * stride_qw + nxt[None, None, :], mask=r_ok & (nxt < n_stop)[None, None, :], other=0)
        s = tl.load(s_ptr + prow + offs_n[None, :], mask=b_ok & n_mask[None, :], other=0.0).to(tl.float32)
        lo = tl.broadcast_to((w & 0x0F0F0F0F)[None, :, :, :], shape)
        hi = tl.broadcast_to(((w >> 4) & 0x0F0F0F0F)[None, :, :, :], shape)
        p0 = _dp4a(hi, h0, _dp4a(lo, l0, zero, False, ASM), False, ASM)
        p1 = _dp4a(hi, h1, _dp4a(lo, l1, zero, False, ASM), False, ASM)
        p2 = _dp4a(hi, h2, _dp4a(lo, l2, zero, True, ASM), True, ASM)
        block_sum = tl.sum(p0 + (p1 << 8) + (p2 << 16), axis=2)
        part = tl.sum(block_sum.to(tl.float32) * s[None, :, :], axis=1) * inv[:, None]
        if HAS_BIAS:
            b = tl.load(b_ptr + prow + offs_n[None, :], mask=b_ok & n_mask[None, :], other=0.0).to(tl.float32)
            part += tl.sum(b[None, :, :] * x_sum[:, :, None], axis=1)
        tl.atomic_add(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], part, mask=m_mask[:, None] & n_mask[None, :],
                      sem="relaxed")


@triton.jit
def _qgemv_small_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                        N, K, NQ, k_per_split, stride_qk, stride_sk,
                        lut_block_k, lut_block_n, stride_lk, stride_ln,
                        BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, MAGIC: tl.constexpr,
                        WORDS: tl.constexpr = False, PDL: tl.constexpr = False):
    """The GEMV for small weights (a few MB, latency-bound): [BLOCK_K, BLOCK_N] tiles spread over the
    threads, w = v * s + b per element into a 2-D accumulator, one sum over K at the end. Measured
    faster than `_qgemv_kernel` below about 8 MB (SmolLM2's layers), slower above."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k, mask=offs_k < k_stop, other=0.0).to(tl.float32)
        v = _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N, WORDS)
        w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                             stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K, MAGIC)
        acc += w * x[:, None]
    y = tl.sum(acc, axis=0)
    if ATOMIC:
        tl.atomic_add(y_ptr + offs_n, y, mask=n_mask, sem="relaxed")
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                  M, N, K, NQ, stride_xm, stride_qk, stride_sk, stride_ym,
                  lut_block_k, lut_block_n, stride_lk, stride_ln,
                  BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, MAGIC: tl.constexpr, WORDS: tl.constexpr = False, PDL: tl.constexpr = False):
    """y = x @ W over [BLOCK_M, BLOCK_N] tiles; W dequantized tile by tile in registers, tensor-core dot."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n                   # grouped order: neighbouring programs share W tiles in L2
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        v = _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N, WORDS)
        w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                             stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K, MAGIC)
        if x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- the weight as the kernels read it -------------------------------------------------------------

@dataclass
class QuantizedWeight:
    """A quantized logical [K, N] weight in the kernels' k-major unsigned form (module docstring)."""

    q: torch.Tensor                 # uint8 [Kp, Np/2] or [Kp, Np]
    scale: torch.Tensor | None      # [Kp/GROUP, Np] (affine)
    bias: torch.Tensor | None       # [Kp/GROUP, Np] (affine; None when zero)
    lut: torch.Tensor | None        # float32 [pK, pN, 2**bits] (lookup table)
    lut_block_k: int
    lut_block_n: int
    bits: int
    group: int                      # K rows per parameter row (a power of two)
    k: int
    n: int
    words: bool = False             # 4-bit affine in the word layout: q int32 [Kp/8, Np] (prepare_weight)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.bias, self.lut) if t is not None)

    @property
    def nq(self) -> int:
        """Columns of q (bytes per row)."""
        return self.q.shape[1]

    def values(self) -> torch.Tensor:
        """The unsigned stored integers [K, N] (tests, dequantize)."""
        if self.words:
            shifts = torch.tensor([0, 8, 16, 24, 4, 12, 20, 28], dtype=torch.int32, device=self.q.device)
            v = (self.q[:, None, :] >> shifts[None, :, None]) & 0xF            # [Kp/8, 8, Np]
            return v.reshape(-1, self.q.shape[1]).to(torch.uint8)[: self.k, : self.n]
        if self.bits == 4:
            return torch.stack([self.q & 0xF, self.q >> 4], dim=-1).reshape(self.q.shape[0], -1)[: self.k, : self.n]
        return self.q[: self.k, : self.n]


def _pow2_factor(n: int, cap: int) -> int:
    f = 1
    while n % (f * 2) == 0 and f * 2 <= cap:
        f *= 2
    return f


def _expand(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A block-broadcast [a, b] parameter repeated up to `shape`."""
    for axis in range(2):
        if p.shape[axis] != shape[axis]:
            p = p.repeat_interleave(shape[axis] // p.shape[axis], dim=axis)
    return p


def _maybe_f16(p: torch.Tensor) -> torch.Tensor:
    if PARAMS_F16:
        h = p.to(torch.float16)
        if torch.isfinite(h).all() and torch.equal(h.to(torch.float32), p):
            return h
    return p


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return values.contiguous()
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def prepare_weight(q: np.ndarray, params: list[np.ndarray], attrs: dict, device, words: bool = False) -> QuantizedWeight:
    """Re-pack a quantized_matmul/quantized_gather weight (Ingot's layout, numpy) for the kernels.

    transpose=False: q is the logical [K, N] weight (4-bit packed along N); transpose=True: q is
    [N, K] (4-bit packed along K). Parameters are block-broadcast with q's rank; a LUT has an extra
    last axis of 2**bits entries.

    words: 4-bit affine weights whose parameter groups span 32 k or more are stored in the word
    layout that `_qgemv_words_kernel` streams: int32 [Kp/8, Np], the word of (r, n) holding
    W[8r + b, n] in the low nibble of byte b and W[8r + 4 + b, n] in its high nibble (b = 0..3), so
    one 16-byte load is 8 k by 4 columns and the nibbles of a byte half line up with 4 consecutive k.
    """
    if attrs["mode"] not in ("affine", "lut"):  # e.g. "scaled_lut" (GGUF's IQ types, MXFP4): no kernel yet
        from ...errors import IngotError
        raise IngotError(f"quantized_matmul: the CUDA backend has no kernel for mode {attrs['mode']!r} "
                         f"({attrs['qdtype'].name} weights) yet; run this model on the CPU.")
    qdtype = attrs["qdtype"]
    bits = 4 if qdtype.packed else 8
    signed = qdtype.kind == "i"
    transpose = bool(attrs.get("transpose"))
    qt = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    if bits == 4:
        values = torch.stack([qt & 0xF, qt >> 4], dim=-1).reshape(qt.shape[0], -1)  # raw nibbles
    else:
        values = qt.view(torch.uint8)
    tparams = [torch.from_numpy(np.ascontiguousarray(p)).to(device=device, dtype=torch.float32) for p in params]
    if transpose:                                              # -> k-major [K, N]
        values = values.t()
        tparams = [p.transpose(0, 1) for p in tparams]
    k, n = values.shape
    np_ = n + (n % 2 if bits == 4 else 0)
    if attrs["mode"] == "lut":
        lut = tparams[0].contiguous()                          # [pK, pN, 2**bits]
        block_k = k // lut.shape[0]
        group = _pow2_factor(block_k, 64)
        kp = -(-k // group) * group
        qk = torch.zeros((kp, np_), dtype=torch.uint8, device=device)
        qk[:k, :n] = values
        return QuantizedWeight(_pack(qk, bits), None, None, lut, block_k, n // lut.shape[1], bits, group, k, n)
    pk = max(p.shape[0] for p in tparams)
    block_k = k // pk
    group = _pow2_factor(block_k, 128)
    kp = -(-k // group) * group
    kb = kp // group
    it = iter(tparams)
    scale = next(it)
    zero_point = next(it) if attrs.get("has_zero_point") else None
    bias = next(it) if attrs.get("has_bias") else None
    # parameters per group of `group` rows: group g covers k in [g*group, (g+1)*group), inside one block
    block_of_group = torch.clamp(torch.arange(kb, device=device) * group // block_k, max=pk - 1)
    valid = (torch.arange(kb, device=device) * group < k)[:, None]

    def per_group(p):
        p = _expand(p, (pk, n))[block_of_group]
        p = torch.where(valid, p, torch.zeros((), device=device))
        return torch.nn.functional.pad(p, (0, np_ - n))

    s = per_group(scale)
    b = per_group(bias) if bias is not None else torch.zeros_like(s)
    shift = (8.0 if bits == 4 else 128.0) if signed else 0.0
    if zero_point is not None or shift:
        z = per_group(zero_point) if zero_point is not None else torch.zeros_like(s)
        b = b - (z + shift) * s
    has_bias = bias is not None or zero_point is not None or shift != 0.0
    if signed:
        values = values ^ (0x8 if bits == 4 else 0x80)          # two's complement -> offset binary
    qk = torch.zeros((kp, np_), dtype=torch.uint8, device=device)
    qk[:k, :n] = values
    words = words and bits == 4 and group % 32 == 0
    packed = _words(qk) if words else _pack(qk, bits)
    return QuantizedWeight(packed, _maybe_f16(s.contiguous()), _maybe_f16(b.contiguous()) if has_bias else None,
                           None, 1, 1, bits, group, k, n, words)


def _words(values: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [Kp, Np] (Kp a multiple of 8) in the word layout (prepare_weight) as int32 [Kp/8, Np]."""
    kp, np_ = values.shape
    v = values.reshape(kp // 8, 2, 4, np_)
    packed = (v[:, 0] | (v[:, 1] << 4)).permute(0, 2, 1).contiguous()     # [Kp/8, Np, 4] bytes
    return packed.view(torch.int32).reshape(kp // 8, np_)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Weights of one kind side by side along N (one GEMV for sibling matmuls), or None."""
    w0 = parts[0]
    if any(p.lut is not None or p.bits != w0.bits or p.group != w0.group or p.k != w0.k or p.q.shape[0] != w0.q.shape[0]
           or p.words != w0.words
           or p.scale.dtype != w0.scale.dtype or (p.bits == 4 and p.n % 2) for p in parts):
        return None
    has_bias = any(p.bias is not None for p in parts)
    biases = [p.bias if p.bias is not None else torch.zeros_like(p.scale) for p in parts]
    if has_bias and len({b.dtype for b in biases}) > 1:
        biases = [b.float() for b in biases]
    return QuantizedWeight(torch.cat([p.q for p in parts], dim=1), torch.cat([p.scale for p in parts], dim=1),
                           torch.cat(biases, dim=1) if has_bias else None, None, 1, 1, w0.bits, w0.group, w0.k,
                           sum(p.n for p in parts), w0.words)


# -- the wrapper ----------------------------------------------------------------------------------

_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[device]


SMALL_GEMV_BYTES = 8 << 20   # below: the latency-bound kernel (measured on the H200, 2026-12-02)


def small_gemv_config(w: QuantizedWeight, sms: int) -> dict:
    block_k = min(w.group, 32)
    block_n = 256 if w.bits == 4 else 128
    while block_n > 32 and triton.cdiv(w.n, block_n) < sms:
        block_n //= 2
    split = max(1, min((4 * sms) // triton.cdiv(w.n, block_n), triton.cdiv(w.k, block_k), 32))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=4, KERNEL="small")


def gemv_config(w: QuantizedWeight, sms: int, num_warps: int | None = None, waves: int = 8) -> dict:
    """Tiles and K splits for one row: a warp's 32 threads side by side along N, 16 bytes each (so a
    tile's rows stay in registers), at most GROUP rows per tile (one parameter row), and enough
    programs for about `waves` warps per multiprocessor."""
    block_k = min(w.group, 8)
    per_warp = 32 * (32 if w.bits == 4 else 16)            # columns a warp covers with 16-byte loads
    if w.lut is not None:   # table lookups: 64 values per thread (ptxas, sm_90a: 16-byte tiles of 8 rows spill
        block_k, per_warp = min(w.group, 4), 512   # 4-16 KB per thread; 512 x 4 spills nothing), not measured yet
    warps = num_warps or (4 if w.n >= 8 * per_warp else 1)
    block_n = per_warp * warps
    while block_n > 64 and block_n // 2 >= w.n:            # small N: narrower tiles, threads share rows
        block_n //= 2
    programs_n = triton.cdiv(w.n, block_n)
    split = max(1, min((waves * sms) // (programs_n * warps), triton.cdiv(w.k, block_k * 2)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=warps, PREFETCH=True)


# more rows: the tensor-core kernel. Up to 16 rows the word GEMV (4 rows a program, the weight read once
# per 4 rows) beats it: H200, 2026-12-04, Llama-3-8B gate+up at 8 and 16 rows 283 us through tensor cores,
# down 452 us, against 37.2 / 21.5 us for one group of 4 rows; the Llama-3-8B step at batch 16 8469 us
# (1889 tok/s) against 31715 (504), at batch 8 4838 us (1654 tok/s). A kernel reading the weight once for
# all 16 rows would do better still.
WORDS_MAX_ROWS = int(os.environ.get("INGOT_CUDA_WORDS_ROWS", "16"))
DP4A = os.environ.get("TRITON_INTERPRET") != "1"                          # the interpreter runs no inline PTX


def resident_programs(regs: int, warps: int) -> int:
    """Programs of `warps` warps at `regs` registers a thread that one Hopper multiprocessor holds at
    once: 64K registers allocated 256 to a warp, at most 64 warps and 32 programs."""
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * warps), 64 // warps, 32))


# warps a multiprocessor the word GEMV's split-K aims at; 0 (the default): exactly one wave of
# programs from the kernel's registers (about 16 warps at 100 registers). H200, 2026-12-03: Llama-3-8B
# gate+up 23.73 us against 24.65 at 32, down 14.53 against 15.24; the whole Llama step 2426 us
# replayed against 2468.
WORDS_WAVES = int(os.environ.get("INGOT_CUDA_GEMV_WAVES", "0"))
# blocks of 32 k per tile: 2, 1, or "auto" (the default: 1 for latency-bound GEMVs, whose programs'
# serial work on x halves; SmolLM2's qkv 702 instructions a program instead of 1439 in ptxas).
# H200, 2026-12-03: SmolLM2 step 840 us replayed against 925 with 2 everywhere.
WORDS_TB = os.environ.get("INGOT_CUDA_GEMV_TB", "auto")
_WORDS_REGS: dict = {}   # the word GEMV's registers a thread, per compiled variant (from its first launch)


def words_gemv_config(w: QuantizedWeight, m: int, sms: int, waves: int = 32, num_warps: int | None = None,
                      rows: int | None = None, regs: int | None = None, tb: int | str | None = None) -> dict:
    """The word-layout GEMV: a warp's threads side by side along N (4 columns each, one 16-byte load
    per row of a tile), ROWS rows of x per program (default 1: more spilled registers), and
    split-K until about `waves` warps per multiprocessor are resident. waves=0: split-K until the
    programs fill the multiprocessors exactly once at `regs` registers a thread (`resident_programs`;
    32 warps while regs is not known yet). tb: blocks of 32 k a tile (1 or 2; default WORDS_TB); "auto":
    1 where even one tile per program leaves multiprocessors idle (a latency-bound GEMV: each program's
    serial work, x rounded by every thread, halves)."""
    rows = rows or 1   # one row per program (the weight read once per row): 4 rows in registers spilled (406 us vs 155)
    warps = num_warps or (4 if w.n >= 4 * 128 * 16 else (2 if w.n >= 2 * 128 * 8 else 1))
    block_n = 128 * warps
    programs = triton.cdiv(w.n, block_n) * triton.cdiv(m, rows)
    tb = tb or WORDS_TB
    if tb == "auto":
        tb = 1 if ((waves or 32) * sms) // (programs * warps) > triton.cdiv(w.q.shape[0], 8) else 2
    tb = int(tb)
    tiles = triton.cdiv(w.q.shape[0], 4 * tb)
    if waves == 0 and regs:
        split = max(1, min(resident_programs(regs, warps) * sms // programs, tiles))
    else:
        split = max(1, min(((waves or 32) * sms) // (programs * warps), tiles))
    return dict(BLOCK_N=block_n, TB=tb, ROWS=rows, SPLIT=split, num_warps=warps, PREFETCH=True)


def _words_nloop_gemv(x2: torch.Tensor, w: QuantizedWeight, y: torch.Tensor, config: dict) -> None:
    m = x2.shape[0]
    rows, tb = config.pop("ROWS", min(triton.next_power_of_2(m), 4)), config.pop("TB", 4)
    warps = config.pop("num_warps", 4 if w.n >= 4 * 128 * 16 else 1)
    block_n = config.pop("BLOCK_N", 128 * warps)
    k_programs = triton.cdiv(w.q.shape[0], 4 * tb)
    waves = config.pop("WAVES", 16)
    chunks = max(1, min(triton.cdiv(w.n, block_n), (waves * _sm_count(x2.device)) // (k_programs * warps * triton.cdiv(m, rows))))
    n_per = triton.cdiv(triton.cdiv(w.n, chunks), block_n) * block_n
    target = y if y.dtype == torch.float32 and y.stride(1) == 1 else torch.empty((m, w.n), dtype=torch.float32, device=x2.device)
    target.zero_()
    b = w.bias if w.bias is not None else w.scale
    _qgemv_words_nloop_kernel[(k_programs, triton.cdiv(w.n, n_per), triton.cdiv(m, rows))](
        x2, w.q, w.scale, b, target, m, w.n, w.k, w.q.shape[0], n_per, x2.stride(0), w.q.stride(0), w.scale.stride(0),
        target.stride(0), GROUP=w.group, HAS_BIAS=w.bias is not None, ROWS=rows, BLOCK_N=block_n, TB=tb,
        ASM=config.pop("ASM", DP4A), num_warps=warps, **config, **pdl_args(x2.device))
    if target is not y:
        y.copy_(target)


# y zeroed by x's quantize kernel rather than a memset between it and the GEMV (H200, 2026-12-03,
# Llama-3-8B step: 2271 us against 2448 with the memset)
ZERO_IN_XQ = os.environ.get("INGOT_CUDA_XQ_ZERO", "1") == "1"


def _overlaps(a: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a's bytes meet any of others' (each spanning its first to its last element)."""
    def span(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    lo, hi = span(a)
    return any(o is not None and o.numel() and span(o)[0] < hi and lo < span(o)[1] for o in others)


# 1: atomics into a zeroed y (a memset launch); 2: tickets, no memset, but the last split's serial sum
# made every shape slower on the H200 (2026-12-02: Llama-3-8B gate+up 48.0 vs 43.4 us, qkv 17.2 vs 12.2)
SPLIT_REDUCE = int(os.environ.get("INGOT_CUDA_SPLIT_REDUCE", "1"))
# Measured and removed (H200, 2026-12-04): a stream-K word GEMV for one row with x pre-quantized (the
# whole GEMV's tiles, in column-block order, cut into equal runs, one per program of one wave, a run
# adding its sums into y where it leaves a column block), so every multiprocessor had the same work
# (gate+up now runs 616 programs, 3 to 5 on a multiprocessor). Llama-3-8B's step 1938.6 us against
# 1793.5 (1941.7 held to 96 registers, 2001.8 to 104; ptxas chose 128 against the split-K's 96); in the
# timeline every GEMV was slower (gate+up 20.99 us against 19.78, down 11.18 / 10.67, qkv 6.35 / 5.66,
# o 4.62 / 2.69) and the tails no shorter (gate+up 2.83 against 1.98).
_WORKSPACE: dict = {}


def _stream_key(device) -> tuple:
    return (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


def _workspace(device, floats: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums and per-column tickets of the split-K GEMV, one pair per device and stream (kernels
    of one stream run in order; every launch leaves the tickets at zero). Sized generously at first
    use, which is an eager run, so a CUDA-graph capture never allocates."""
    key = _stream_key(device)
    have = _WORKSPACE.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < tickets:
        floats = max(floats, 1 << 22, have[0].numel() if have else 0)
        tickets = max(tickets, 1 << 16, have[1].numel() if have else 0)
        have = _WORKSPACE[key] = (torch.empty(floats, dtype=torch.float32, device=device),
                                  torch.zeros(tickets, dtype=torch.int32, device=device))
    return have


# x quantized once per GEMV (`_quantize_x_kernel`) above this many weight bytes: the extra launch
# (a few us) only pays where the GEMV's own x work is larger. LIMBS: bytes per rounded x (2 * LIMBS dp4a
# per weight word): 1 (x to 8 bits per block of 32), 2 (16 bits), 3 (22 bits, float32-level).
GEMV_LIMBS = int(os.environ.get("INGOT_CUDA_GEMV_LIMBS", "2"))
XQ_MIN_BYTES = int(os.environ.get("INGOT_CUDA_GEMV_XQ_BYTES", "0"))   # H200, 2026-12-03: Llama-3-8B qkv
# (15.7 MB) 10.0 us with XQ against 11.2 rounding in the GEMV, o (10.5 MB) 7.9 against 8.7; the step 2469 us against
# 2587. With programmatic dependent launch the quantize launch pays even for SmolLM2's small weights (0.3-3.5 MB):
# a step 740.7 us with XQ for every GEMV against 779.7 with the 8 MiB threshold (eighth session)
XQ_BLOCKS = int(os.environ.get("INGOT_CUDA_XQ_BLOCKS", "4"))   # blocks of 32 k per program of `_quantize_x_kernel`
# floats of a row per step of `_quantize_x_kernel`'s sum of squares (its own, as its rows are one each):
# one step where the row fits, so its loads are in flight together rather than one step after another
XQ_NORM_BLOCK = int(os.environ.get("INGOT_CUDA_XQ_NORM_BLOCK", "4096"))   # Llama-3-8B: 324 us of these launches
# a step at 4096 against 348 at 1024 (H200, eighth session)
# its warps with a norm: Llama-3-8B's step 1905.0 / 1905.7 us at 8 against 1919.9 / 1918.7 at 4 (H200,
# fourteenth session, two calls)
XQ_NORM_WARPS = int(os.environ.get("INGOT_CUDA_XQ_NORM_WARPS", "8"))
# with a norm over rows of XQ_NORM_PARTS_K and more, each program of the quantize launch rounds only its
# own blocks and stores their sum of squares; the GEMV adds a row's parts for 1 / rms (XQ_RMS). H200,
# 2026-12-04 (cuda_timeline.py): Llama-3-8B's launch that read the whole 4096-float row in every program
# was busy 3.6 us of a layer's ~58, twice a layer; by parts 1.4, the step 1821.7-1827.9 us against 1882.4.
# SmolLM2's one such launch (576 floats, before the lm_head) lost by parts: 498.4-499.2 against 496.3
XQ_NORM_PARTS = os.environ.get("INGOT_CUDA_XQ_NORM_PARTS", "1") == "1"
XQ_NORM_PARTS_K = int(os.environ.get("INGOT_CUDA_XQ_NORM_PARTS_K", "1024"))
_XQ_WORKSPACE: dict = {}


def _xq_workspace(device, words: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-quantized x of the word GEMV (`_quantize_x_kernel`): limb words (int32) and per-block scale
    and sum (float32, 2 * blocks), one pair per device and stream (the quantize kernel and the GEMV that
    reads it run in order on that stream). Allocated at the first call, an eager run, and grown only
    when too small. A capture on a stream that has none yet (torch captures on a side stream) allocates
    it from the graph's pool, as `_workspace` does; the minimum size (4 MB of words: 4 rows of K up to
    80k in three limbs, or 16 column blocks' copies of 4 rows of K 16k in two, XQ_SELF) means it is not
    grown again for decode shapes, so no buffer a captured kernel reads is dropped."""
    key = _stream_key(device)
    have = _XQ_WORKSPACE.get(key)
    if have is None or have[0].numel() < words or have[1].numel() < 2 * blocks:
        words = max(words, 1 << 20, have[0].numel() if have else 0)
        floats = max(2 * blocks, 1 << 17, have[1].numel() if have else 0)
        have = _XQ_WORKSPACE[key] = (torch.empty(words, dtype=torch.int32, device=device),
                                     torch.empty(floats, dtype=torch.float32, device=device))
    return have


@dataclass
class NormPrologue:
    """x = rms_norm(x [+ add]) * weight, computed as the word GEMV loads x (see `rms_norm_matmul`); with
    `add`, x + add is stored to `total` [M, K] (float32, x's row stride) on the way."""
    weight: torch.Tensor | None
    eps: float
    add: torch.Tensor | None = None
    total: torch.Tensor | None = None

    def kernel_args(self, x2: torch.Tensor) -> dict:
        m, k = x2.shape
        if self.add is not None:
            assert self.add.shape == x2.shape and self.total is not None and self.total.shape == x2.shape
            assert m == 1 or x2.stride() == self.add.stride() == self.total.stride(), "x, add and total share strides"
            assert self.total.dtype == torch.float32
        if self.weight is not None:
            assert self.weight.shape == (k,) and self.weight.stride(0) == 1
        return dict(g_ptr=self.weight if self.weight is not None else x2, h_ptr=self.total if self.total is not None else x2,
                    eps=float(self.eps), NORM=True, ADD=self.add is not None, HAS_G=self.weight is not None,
                    NORM_BLOCK=min(triton.next_power_of_2(k), NORM_BLOCK))


NORM_BLOCK = 1024        # floats of a row per step of the norm prologue's sum of squares (`_row_rms`)


def _quantize_x(x2: torch.Tensor, x_gate: torch.Tensor | None, limbs: int, norm: NormPrologue | None = None,
                zero: torch.Tensor | None = None) -> dict:
    """x2 (silu(x_gate) * x2 when x_gate is given; rms_norm(x2 [+ add]) * weight with `norm`) [M, K]
    quantized for the word GEMV's XQ path: the kernel arguments xq_ptr/xd_ptr/xs_ptr (views of the
    stream's workspace) and their sizes. `zero` (float32, contiguous, apart from every input): zeroed
    by the same launch."""
    m, k = x2.shape
    args = xq_buffers(m, k, limbs, x2.device)
    xq, xd, xs, kb = args["xq_ptr"], args["xd_ptr"], args["xs_ptr"], args["KB"]
    first, second = (x_gate, x2) if x_gate is not None else (x2, x2)
    if x_gate is not None:
        assert x_gate.stride() == x2.stride() and x_gate.shape == x2.shape and norm is None
    extra, gemv, warps = {}, {}, 1
    grid = (triton.cdiv(kb, XQ_BLOCKS), m)
    if norm is not None:
        extra = norm.kernel_args(x2)
        extra["NORM_BLOCK"] = min(triton.next_power_of_2(k), XQ_NORM_BLOCK)
        second = norm.add if norm.add is not None else x2
        if XQ_NORM_PARTS and k >= XQ_NORM_PARTS_K:   # each program its own blocks; the GEMV adds the parts
            floats = _xq_workspace(x2.device, 1, kb * m)[1]
            parts = floats[floats.numel() - m * grid[0]:]
            assert floats.numel() - parts.numel() >= 2 * m * kb, "the parts overlap the scales"
            extra.update(PARTS=True, ssq_ptr=parts)
            gemv = dict(XQ_RMS=True, ssq_ptr=parts, nparts=grid[0], NPARTS=triton.next_power_of_2(grid[0]),
                        eps=float(norm.eps))
        else:   # the whole row is read for its sum of squares in every program: more threads for it
            warps = XQ_NORM_WARPS
    kind = "glu" if x_gate is not None else ("norm" if norm is not None else "x")
    _quantize_x_kernel[grid](
        first, second, xq, xd, xs, k, kb, x2.stride(0), xq.stride(0), xd.stride(0), LIMBS=limbs, BLOCKS=XQ_BLOCKS,
        GLU=x_gate is not None, num_warps=warps, **extra, **pdl_args(x2.device),
        **(dict(z_ptr=zero, Z=zero.numel(), ZERO=True) if zero is not None else {}),
        **timeline.args(f"quantize {kind} {k}", grid[0] * grid[1], x2.device))
    return {**args, **gemv}


def xq_buffers(m: int, k: int, limbs: int, device, copies: int = 1) -> dict:
    """The word GEMV's pre-quantized x [M, K] in the stream's workspace, as its kernel arguments: limb
    words xq_ptr [M, KB * 8 * limbs], block scales xd_ptr and sums xs_ptr [M, KB] (KB = ceil(K / 32)).
    `_quantize_x` fills them, or a kernel before the GEMV that stores the same (`attention(..., xq=)`).
    copies > 1: that many such sets, copy_q words and copy_d floats apart (XQ_SELF: one per column
    block), the first one where a single set would be."""
    kb = triton.cdiv(k, 32)
    words, floats = _xq_workspace(device, copies * m * kb * 8 * limbs, copies * m * kb)
    xq = words[: m * kb * 8 * limbs].view(m, kb * 8 * limbs)
    xd, xs = floats[: m * kb].view(m, kb), floats[m * kb: 2 * m * kb].view(m, kb)
    return dict(xq_ptr=xq, xd_ptr=xd, xs_ptr=xs, KB=kb, stride_xqm=xq.stride(0), stride_xdm=xd.stride(0),
                **(dict(copy_q=m * kb * 8 * limbs, copy_d=2 * m * kb) if copies > 1 else {}))


# a word GEMV of a weight smaller than this rounds its own x (XQ_SELF) where the kernel ahead can zero its
# split-K output: no quantize launch. H200 (tenth session), per GEMV with its quantize launch against without:
# SmolLM2 qkv with its norm 2.12 us against 3.37, gate+up 2.63 / 3.16, down 1.85 / 2.80; Llama-3-8B qkv with
# its norm 10.31 against 8.50 (every program reads the 4096-float row for its rms), down 12.70 / 12.23
SELF_XQ_BYTES = int(os.environ.get("INGOT_CUDA_SELF_XQ_BYTES", str(4 << 20)))
# in a captured graph, the word GEMV's first weight tile loaded before the wait on the kernel ahead
# (`_qgemv_words_kernel`'s EARLY_W). H200, steps replayed: SmolLM2 533.5-534.3 us against 552.4-552.8
# without (two calls); Llama-3-8B 2001.7 against 2078.7, 2012.0 against 2078.4 (each pair one call).
# Slower variants, measured and removed: the first tile's scales early too, and the loop's scales a tile
# ahead (SmolLM2 548.8, twice); weights 2 or 3 tiles ahead, as many early (Llama-3-8B 2089.8 and 2312.0
# against 1996.6: 177 registers a thread against 128 at 3)
EARLY_WEIGHTS = os.environ.get("INGOT_CUDA_GEMV_EARLY_W", "1") == "1"


def rounds_own_x(m: int, w: QuantizedWeight) -> bool:
    """Whether the word GEMV of m rows of w rounds its own x by default where its output can come zeroed
    (`_words_gemv`'s XQ_SELF and ZEROED): weights under SELF_XQ_BYTES that take x pre-quantized."""
    return w.nbytes < SELF_XQ_BYTES and gemv_takes_xq(m, w) > 0


def gemv_takes_xq(m: int, w: QuantizedWeight, config: dict | None = None) -> int:
    """The limbs of x's pre-quantization the word GEMV uses for m rows of w by default (0: none, the
    GEMV rounds x itself or another kernel runs): what a kernel ahead of it may store (`xq_buffers`)."""
    config = config or {}
    if not w.words or m > WORDS_MAX_ROWS or config.get("NLOOP") or config.get("XFREE"):
        return 0
    return config.get("LIMBS", GEMV_LIMBS) if config.get("XQ", w.nbytes >= XQ_MIN_BYTES) else 0


def _words_gemv(x2: torch.Tensor, w: QuantizedWeight, y: torch.Tensor, config: dict, x_gate: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, norm: NormPrologue | None = None, quantize=None,
                zero: torch.Tensor | None = None) -> None:
    """y = x2 @ W (x2 = silu(x_gate) * x2 when x_gate is given; rms_norm(x2 [+ norm.add]) * norm.weight
    with `norm`; + residual when given).

    config keys override `words_gemv_config`'s choice, and LIMBS (1-3, default GEMV_LIMBS) and XQ
    (x quantized by its own launch first; default: weights of XQ_MIN_BYTES and more). `quantize` replaces
    that launch (`_quantize_x`'s signature and result): a kernel computing x that also stores it rounded.
    XQ_SELF (with XQ, no `quantize`): no quantize launch; every program rounds its own split of x
    (`_qgemv_words_kernel`). ZEROED: y (float32, contiguous) is zero already, the kernel ahead zeroed it
    (`zero`), so split-K adds into it without a memset. `zero` (float32, contiguous, apart from every
    operand): zeroed by this launch, the output of the GEMV after it (`ZEROED`). EARLY_W (default
    EARLY_WEIGHTS while a CUDA graph is captured, where the weights are constants prepared before the
    capture; off otherwise): the first weight tile loaded before the wait on the kernel ahead."""
    m = x2.shape[0]
    assert norm is None or (x_gate is None and x2.dtype == torch.float32), "the norm prologue: float32 x, no GLU"
    if config.pop("NLOOP", False):
        assert x_gate is None and residual is None and norm is None
        for key in ("LIMBS", "XQ", "XQ_SELF", "ZEROED"):   # the N-loop kernel rounds x to 22 bits once per program
            config.pop(key, None)
        if zero is not None:
            zero.zero_()
        return _words_nloop_gemv(x2, w, y, config)
    xq = config.pop("XQ", w.nbytes >= XQ_MIN_BYTES) and not config.get("XFREE", False)
    if "EARLY_W" not in config and EARLY_WEIGHTS and x2.is_cuda and torch.cuda.is_current_stream_capturing():
        config["EARLY_W"] = True
    self_round = config.pop("XQ_SELF", False) and xq and quantize is None
    zeroed = config.pop("ZEROED", False)
    assert norm is None or not config.get("XFREE", False)
    # with x pre-quantized, all (<= 4) rows in one program read the weight once: H200, Llama-3-8B
    # gate+up at 4 rows 87.0 us vs 105.4 one row per program (2026-12-03); without, 4 rows spill
    rows = config.get("ROWS") or (min(triton.next_power_of_2(m), 4) if xq else None)
    waves, tb = config.pop("WAVES", WORDS_WAVES), config.pop("TB", None)
    # EARLY_W is left out of the key: it is set only while a graph is captured, where the variant's first
    # launch is too late to learn its registers (until 2026-12-04 the captured GEMVs split as for 32 warps a
    # multiprocessor: gate+up and down ran in two waves, cuda_timeline.py)
    variant = (w.n, m, w.group, w.bias is not None, xq, rows, tb, x_gate is not None, norm is not None,
               residual is not None, tuple(sorted((k, v) for k, v in config.items() if k != "EARLY_W")))
    cfg = {**words_gemv_config(w, m, _sm_count(x2.device), waves, config.get("num_warps"), rows,
                               _WORDS_REGS.get(variant), tb), **config}
    block_n, tb, rows, split = cfg.pop("BLOCK_N"), cfg.pop("TB"), cfg.pop("ROWS"), cfg.pop("SPLIT")
    limbs = cfg.pop("LIMBS", GEMV_LIMBS)
    assert limbs in (1, 2, 3), f"LIMBS={limbs}: x in 1, 2 or 3 bytes"
    kw = w.q.shape[0]
    kw_per_split = triton.cdiv(triton.cdiv(kw, split), 4 * tb) * 4 * tb
    split = triton.cdiv(kw, kw_per_split)
    reduce = cfg.pop("REDUCE", SPLIT_REDUCE)
    reduce = (reduce or SPLIT_REDUCE) if split > 1 else 0
    if residual is not None and reduce == 1:
        reduce = 2
    grid = (triton.cdiv(w.n, block_n), split, triton.cdiv(m, rows))
    target = y
    part, tickets = y, y
    zero_in_xq = False
    if reduce == 1:
        target = y if y.dtype == torch.float32 and y.stride(1) == 1 else torch.empty((m, w.n), dtype=torch.float32,
                                                                                      device=x2.device)
        inputs = (x2, x_gate) + ((norm.add, norm.total, norm.weight) if norm is not None else ())
        zero_in_xq = xq and not self_round and ZERO_IN_XQ and target.is_contiguous() and not _overlaps(target, *inputs)
        if not zero_in_xq and not (zeroed and target is y and y.is_contiguous()):
            target.zero_()
    elif reduce == 2:
        part, tickets = _workspace(x2.device, split * m * w.n, grid[0] * grid[2])
    b = w.bias if w.bias is not None else w.scale
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
        assert not _overlaps(zero, x2, x_gate, y, target, *((norm.add, norm.total, norm.weight) if norm else ()))
        cfg.update(z_ptr=zero, Z=zero.numel(), ZERO=True)
    if self_round:
        cfg.update(xq_buffers(m, w.k, limbs, x2.device, copies=grid[0]), XQ_SELF=True)
        cfg.setdefault("SELF_BLOCKS", 2 * cfg.get("num_warps", 4))
    elif xq:
        cfg.update((quantize or _quantize_x)(x2, x_gate, limbs, norm, zero=target if zero_in_xq else None))
        x_gate = norm = None      # applied by the quantize kernel
    gate = x_gate if x_gate is not None else x2
    if norm is not None:
        cfg.update(norm.kernel_args(x2))
        if norm.add is not None:
            gate = norm.add       # the kernel reads x_ptr + x2_ptr
    if x_gate is not None:
        assert x_gate.stride() == x2.stride() and x_gate.shape == x2.shape
        x2, gate = gate, x2       # the kernel reads silu(x_ptr) * x2_ptr
    res = residual if residual is not None else y
    stamps = timeline.args(f"gemv {w.k}x{w.n}", grid[0] * grid[1] * grid[2], x2.device)
    if stamps.get("STAMP") == 1 and _WORDS_REGS.get(variant):
        # end stamps only: held to the registers of the same kernel without them, which its split assumed
        # (ptxas gave the 4-warp kernel with XQ_RMS 142 against 96 for one more store, without spills at 96)
        cfg["maxnreg"] = _WORDS_REGS[variant]
    compiled = _qgemv_words_kernel[grid](
        x2, gate, w.q, w.scale, b, target, res, part, tickets, m, w.n, w.k, kw, kw_per_split, x2.stride(0),
        w.q.stride(0), w.scale.stride(0), target.stride(0), res.stride(0), GROUP=w.group, HAS_BIAS=w.bias is not None,
        ROWS=rows, BLOCK_N=block_n, TB=tb, REDUCE=reduce, ASM=cfg.pop("ASM", DP4A), GLU=x_gate is not None,
        RESIDUAL=residual is not None, LIMBS=limbs, XQ=xq, EVEN_K=w.k == kw * 8 and w.k % (32 * tb) == 0, **cfg,
        **pdl_args(x2.device), **stamps)
    if waves == 0 and not stamps and isinstance(getattr(compiled, "n_regs", None), int):   # none under the interpreter
        _WORDS_REGS[variant] = max(compiled.n_regs, _WORDS_REGS.get(variant, 0))
    if target is not y:
        y.copy_(target)


def rms_norm_matmul(x: torch.Tensor, w: QuantizedWeight, norm_weight: torch.Tensor | None, eps: float,
                    add: torch.Tensor | None = None, config: dict | None = None, zero: torch.Tensor | None = None,
                    out: torch.Tensor | None = None):
    """rms_norm(x [+ add]) * norm_weight @ W in one word-layout GEMV launch (two with XQ), for float32 x
    [..., K] of at most WORDS_MAX_ROWS rows: the norm is the GEMV's prologue. Returns y [..., N], or
    (x + add, y) with `add` (the sum is stored by the same launch, for the residual stream). `zero`:
    see `_words_gemv`. `out`: y [M, N] (float32, contiguous) to write.

        >>> h, y = rms_norm_matmul(x, w, g, 1e-5, add=attn_out)           # doctest: +SKIP
    """
    assert w.words and x.shape[-1] == w.k and x.dtype == torch.float32, "a word-layout weight and float32 x [..., K]"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    m = x2.shape[0]
    assert m <= WORDS_MAX_ROWS, f"rms_norm_matmul: {m} rows, the word GEMV takes up to {WORDS_MAX_ROWS}"
    add2 = total = None
    if add is not None:
        assert add.shape == x.shape and add.dtype == torch.float32
        add2 = add.reshape(-1, w.k).contiguous()
        total = torch.empty_like(x2)
    if norm_weight is not None:
        norm_weight = norm_weight.reshape(-1).to(torch.float32).contiguous()
    y = out if out is not None else torch.empty((m, w.n), dtype=torch.float32, device=x.device)
    assert y.shape == (m, w.n) and y.dtype == torch.float32 and y.is_contiguous()
    _words_gemv(x2, w, y, dict(config or {}), norm=NormPrologue(norm_weight, eps, add2, total), zero=zero)
    y = y.reshape(*lead, w.n)
    return (total.reshape(x.shape), y) if add is not None else y


def gemm_config(m: int, w: QuantizedWeight, dtype: torch.dtype) -> dict:
    block_m = 16 if m <= 16 else (64 if m <= 128 else 128)
    block_k = 32 if dtype == torch.float32 else 64
    if w.lut is None and w.group >= 16:
        block_k = min(block_k, w.group)
    block_n = 64 if m <= 16 else 128
    stages = 2 if dtype == torch.float32 else 3
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_m * block_n <= 64 * 128 else 8,
                num_stages=stages)


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None = None,
                     config: dict | None = None, precision: str = "tf32x3") -> torch.Tensor:
    """y = x @ W for x [..., K] (float32/float16/bfloat16); y [..., N] of x's dtype.

    Word-layout weights: the dp4a GEMV up to WORDS_MAX_ROWS rows; else one row: the k-major GEMV
    kernels; more: the tensor-core kernel (config={"BLOCK_M": ...} forces it).
    """
    assert x.shape[-1] == w.k, f"quantized_matmul: x has K={x.shape[-1]}, the weight K={w.k}"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    lut = w.lut if w.lut is not None else w.q
    s = w.scale if w.scale is not None else w.q
    b = w.bias if w.bias is not None else s
    stride_lk, stride_ln = (w.lut.stride(0), w.lut.stride(1)) if w.lut is not None else (0, 0)
    stride_sk = w.scale.stride(0) if w.scale is not None else 0
    common = dict(BITS=w.bits, LUT=w.lut is not None, GROUP=w.group, HAS_BIAS=w.bias is not None)
    if m == 0:
        return y.reshape(*lead, w.n)
    config = dict(config or {})
    if w.words and (m <= WORDS_MAX_ROWS or config.get("KERNEL") == "words") and config.get("KERNEL", "words") == "words" \
            and "BLOCK_M" not in config:
        config.pop("KERNEL", None)
        _words_gemv(x2, w, y, config)
        return y.reshape(*lead, w.n)
    assert config.get("KERNEL") != "words", "the words kernel needs a weight prepared with words=True"
    if m <= GEMV_MAX_ROWS and "BLOCK_M" not in config:
        config = dict(config or {})
        waves = config.pop("WAVES", 8)
        small = config.get("KERNEL", "small" if w.nbytes < SMALL_GEMV_BYTES else "stream") == "small"
        base = small_gemv_config(w, _sm_count(x.device)) if small else \
            gemv_config(w, _sm_count(x.device), config.get("num_warps"), waves)
        cfg = {**base, **config}
        kernel = _qgemv_small_kernel if cfg.pop("KERNEL", "stream") == "small" else _qgemv_kernel
        if kernel is _qgemv_small_kernel:
            cfg.pop("PREFETCH", None)
            cfg["WORDS"] = w.words
        else:
            assert not w.words, "the streaming k-major kernel reads no word layout"
        block_n, block_k, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT")
        magic = cfg.pop("MAGIC", MAGIC_CONVERT)
        assert block_k <= w.group or w.lut is not None
        k_per_split = triton.cdiv(triton.cdiv(w.k, split), block_k) * block_k
        split = triton.cdiv(w.k, k_per_split)
        atomic = split > 1
        target = y
        if atomic:
            target = y if y.dtype == torch.float32 and y.is_contiguous() else torch.empty((m, w.n), dtype=torch.float32,
                                                                                          device=x.device)
            target.zero_()
        for row in range(m):
            kernel[(triton.cdiv(w.n, block_n), split)](
                x2[row], w.q, s, b, lut, target[row], w.n, w.k, w.nq, k_per_split, w.q.stride(0), stride_sk,
                w.lut_block_k, w.lut_block_n, stride_lk, stride_ln,
                BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=atomic, MAGIC=magic, **common, **cfg,
                **pdl_args(x.device))
        if target is not y:
            y.copy_(target)
    else:
        cfg = {**gemm_config(m, w, x.dtype), **(config or {})}
        block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        magic = cfg.pop("MAGIC", MAGIC_CONVERT)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n),)
        _qgemm_kernel[grid](
            x2, w.q, s, b, lut, y, m, w.n, w.k, w.nq, x2.stride(0), w.q.stride(0), stride_sk, y.stride(0),
            w.lut_block_k, w.lut_block_n, stride_lk, stride_ln,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, PRECISION=precision, MAGIC=magic,
            WORDS=w.words, **common, **cfg, **pdl_args(x.device))
    return y.reshape(*lead, w.n)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [K, N] weight (tests and benchmarks only: the kernels never build it)."""
    v = w.values().to(torch.float32)
    if w.lut is not None:
        rows = torch.arange(w.k, device=v.device) // w.lut_block_k
        cols = torch.arange(w.n, device=v.device) // w.lut_block_n
        return w.lut[rows[:, None], cols[None, :], v.long()]
    g = torch.arange(w.k, device=v.device) // w.group
    out = v * w.scale.float()[g, : w.n]
    if w.bias is not None:
        out = out + w.bias.float()[g, : w.n]
    return out


__all__ = ["QuantizedWeight", "prepare_weight", "quantized_matmul", "rms_norm_matmul", "dequantize", "concatenate",
           "GEMV_MAX_ROWS", "WORDS_MAX_ROWS"]
