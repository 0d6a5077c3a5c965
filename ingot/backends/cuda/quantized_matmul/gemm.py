"""The k-major kernels: one row of x (`_qgemv_kernel`, `_qgemv_small_kernel`) and the tensor-core
GEMM (`_qgemm_kernel`), for every weight layout (4/8-bit, lookup tables, the word layout read
nibble by nibble), with their tile choices."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import pdl_enter
from .weights import QuantizedWeight

GEMV_MAX_ROWS = 1                                                 # more rows: the tensor-core kernel
SMALL_GEMV_BYTES = 8 << 20   # below: the latency-bound kernel (measured on the H200, 2026-12-02)


@triton.jit
def _to_float(v):
    """Unsigned integers < 2**23 to float32 exactly: OR the value into the mantissa of 2**23 and
    subtract 2**23 (a logic op and an add) instead of the int-to-float unit, which runs at 1/4 rate."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


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
def gathered_codes(q_ptr, idx_ptr, stride_qk, EXTENT, LIMIT, AXIS: tl.constexpr, BITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """A gather program's stored codes (fused.quantized_gather, gguf_kernels.scaled_gather): index t of
    idx, entries j of column idx[t] (AXIS 1) or row idx[t] (AXIS 0) of the logical [K, N] weight, as
    (t, j, k, n, v, ok); ok is False past EXTENT and for an index outside [0, LIMIT)."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.load(idx_ptr + t).to(tl.int64)
    ok = (j < EXTENT) & (i >= 0) & (i < LIMIT)
    zero = tl.zeros([BLOCK], tl.int64)
    if AXIS == 1:          # column i of the logical [K, N] weight
        k = j.to(tl.int64)
        n = zero + i
    else:                  # row i
        k = zero + i
        n = j.to(tl.int64)
    if BITS == 4:
        byte = tl.load(q_ptr + k * stride_qk + n // 2, mask=ok, other=0)
        v = (byte >> ((n % 2) * 4).to(tl.uint8)) & 0xF
    else:
        v = tl.load(q_ptr + k * stride_qk + n, mask=ok, other=0)
    return t, j, k, n, v, ok


@triton.jit
def _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                     stride_lk, stride_ln, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """float32 weights of a [BLOCK_K, BLOCK_N] tile of unsigned integers."""
    if LUT:
        off = (offs_k // lut_block_k)[:, None] * stride_lk + (offs_n // lut_block_n)[None, :] * stride_ln
        return tl.load(lut_ptr + off + v.to(tl.int32), mask=(offs_k < K)[:, None] & n_mask[None, :], other=0.0)
    else:
        vf = _to_float(v)
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
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
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
            part = tl.sum(_to_float(v) * x[:, None], axis=0)         # [BLOCK_N] block sums
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
def _qgemv_small_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                        N, K, NQ, k_per_split, stride_qk, stride_sk,
                        lut_block_k, lut_block_n, stride_lk, stride_ln,
                        BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
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
                             stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K)
        acc += w * x[:, None]
    y = tl.sum(acc, axis=0)
    if ATOMIC:
        tl.atomic_add(y_ptr + offs_n, y, mask=n_mask, sem="relaxed")
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles walk the column
    tiles together, so neighbouring programs share W's tiles in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                  M, N, K, NQ, stride_xm, stride_qk, stride_sk, stride_ym,
                  lut_block_k, lut_block_n, stride_lk, stride_ln,
                  BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, WORDS: tl.constexpr = False, PDL: tl.constexpr = False,
                  k_per_split=0, SPLIT_K: tl.constexpr = 1, rs_ptr=None, ROW_SCALE: tl.constexpr = False):
    """y = x @ W over [BLOCK_M, BLOCK_N] tiles; W dequantized tile by tile in registers, tensor-core dot.
    SPLIT_K > 1: program axis 1 takes k_per_split rows of W (a multiple of BLOCK_K) and adds its partial
    tile into y (float32, zeroed), so few rows still put every multiprocessor to streaming W. ROW_SCALE:
    row i of the tile multiplied by rs[i] (half_rows.py's scales of a float16 x)."""
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_stop = 0, K
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * k_per_split
        k_stop = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        v = _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N, WORDS)
        w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                             stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K)
        if PRECISION == "bf16":       # both operands rounded to bfloat16, float32 accumulation
            acc = tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        elif x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if ROW_SCALE:
        acc = acc * tl.load(rs_ptr + offs_m, mask=m_mask, other=1.0)[:, None]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _words_tile_t(q_ptr, s_ptr, b_ptr, k0, offs_n, n_ok, stride_qk, stride_sk, GROUP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, F16: tl.constexpr = False):
    """W[k0:k0+BLOCK_K, offs_n]^T of a word-layout weight as bfloat16 (F16: float16) [BLOCK_N, BLOCK_K]
    (BLOCK_K <= GROUP: one parameter row): each word loaded once and its 8 nibbles split in registers,
    w = v * s + b in float32 rounded once."""
    words = tl.load(q_ptr + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None] * stride_qk + offs_n[None, :],
                    mask=n_ok[None, :], other=0)
    j = tl.arange(0, 8)
    shift = (j % 4) * 8 + (j // 4) * 4        # k = 8r + j: low nibble of byte j (j < 4), else high of j - 4
    v = tl.reshape((words[:, None, :] >> shift[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
    g = k0 // GROUP
    w = _to_float(v) * tl.load(s_ptr + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        w += tl.load(b_ptr + g * stride_sk + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if F16:
        w16 = w.to(tl.float16)
    else:
        w16 = w.to(tl.bfloat16)
    return tl.trans(w16)


@triton.jit
def _qgemm_words_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qk, stride_sk, stride_ym,
                        k_per_split, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False,
                        rs_ptr=None, F16: tl.constexpr = False, ROW_SCALE: tl.constexpr = False):
    """y = x @ W for a few rows (a batched decode step) of a word-layout 4-bit weight, bf16 dots (F16: a
    float16 x, float16 dots; ROW_SCALE: y's rows multiplied by rs, half_rows.py's scales): computed as y^T = W^T x^T, so
    W's dequantized tile is the dot's first operand (BLOCK_N >= 64 rows of the MMA) and the few rows of x
    its narrow side. SPLIT_K > 1: program axis 1 takes k_per_split rows of W and adds its partial tile
    into y (float32, zeroed)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = tl.program_id(1) * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        wt = _words_tile_t(q_ptr, s_ptr, b_ptr, k0, offs_n, n_ok, stride_qk, stride_sk, GROUP, HAS_BIAS, BLOCK_K,
                           BLOCK_N, F16)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & (offs_k < K)[:, None],
                     other=0.0)
        acc = tl.dot(wt, xt.to(wt.dtype), acc)
    if ROW_SCALE:
        acc = acc * tl.load(rs_ptr + offs_m, mask=m_ok, other=1.0)[None, :]
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=n_ok[:, None] & m_ok[None, :], sem="relaxed")
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, b_ptr, lut_ptr, out_ptr, N, K, NQ, stride_qk, stride_sk, stride_ok,
                       lut_block_k, lut_block_n, stride_lk, stride_ln,
                       BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr = False):
    """out[K, N] = W in out's dtype, a [BLOCK_K, BLOCK_N] tile a program (the GEMM's own tile steps)."""
    k0 = tl.program_id(0) * BLOCK_K
    n0 = tl.program_id(1) * BLOCK_N
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    v = _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N, WORDS)
    w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_ptr, b_ptr, lut_ptr, stride_sk, lut_block_k, lut_block_n,
                         stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_k < K)[:, None] & n_mask[None, :])


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


def gemm_config(m: int, w: QuantizedWeight, dtype: torch.dtype, precision: str = "tf32x3", sms: int = 0) -> dict:
    """Tiles of the tensor-core kernel: float32 dots (tf32x3) hold three products' operands in registers
    (smaller K tiles, two stages); 16-bit dots take wide tiles from 128 rows. Up to 128 rows (a batched
    decode step, a short prompt) with `sms` multiprocessors: K split so that about two programs an SM
    stream W (Llama-3-8B's 4096 x 4096 at 32 rows has 32 tiles; without splits a quarter of an H100 reads
    it), each split at least four K tiles."""
    sixteen = dtype != torch.float32 or precision == "bf16"
    block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 128 else 128))
    block_k = 64 if sixteen else 32
    if w.lut is None and w.group >= 16:
        block_k = min(block_k, w.group)
    block_n = 64 if m <= 16 else 128
    stages = 3 if sixteen else 2
    split = 1
    if sms and m <= 128:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n)
        split = max(1, min((2 * sms) // tiles, w.k // (4 * block_k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_m * block_n <= 64 * 128 else 8,
                num_stages=stages, SPLIT_K=split)


WORDS_GEMM_MAX_ROWS = 128  # rows up to which bf16 dots over a word-layout weight take `_qgemm_words_kernel`
WORDS_GEMM_BLOCK_M = 64    # its row tile at most (a 256 x 128 float32 tile would spill)


def words_gemm_config(m: int, w: QuantizedWeight, sms: int) -> dict:
    """Tiles of `_qgemm_words_kernel`: 256 columns of W a program (the MMA's long side), the rows of x
    in tiles of at most 64, a K tile of 32 (one parameter row), and K split so that about two programs an
    SM stream W. H100, Llama-3-8B shapes at 32 / 64 rows (`benchmarks/lab/cuda_gemm_swap.py`, 2026-12-06):
    57.6-90.5 / 92.3-165.1 TFLOP/s against `_qgemm_kernel`'s 35.2-42.7 / 61.2-77.3 and cuBLAS bf16 on a
    dense W 49.9-81.0 / 98.5-163.7; at 96 / 128 rows (two row tiles) 104-144 / 130-189 against the
    dequantize + cuBLAS route's 84-106 / 108-140 (cuBLAS bf16 on a dense W 153-243 / 193-317)."""
    block_m = max(16, triton.next_power_of_2(min(m, WORDS_GEMM_BLOCK_M)))
    block_n = 256
    tiles = triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n)
    split = max(1, min((2 * sms) // tiles, w.k // 128)) if sms else 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=3)
