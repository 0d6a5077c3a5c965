"""The word-layout GEMV kernel (`_qgemv_words_kernel`): 4-bit weights as int32 words of 8 k, x as
integers of 1-3 bytes, `dp4a` dot products; its wrapper is gemv.py."""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_enter
from ..timeline import now, stamp
from .xq import (_block_scale, _dp4a, _load_norm_x, _load_x, _pow2_scale, _round_blocks, _round_to_int, _row_rms,
                 _zero_share)


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
             GLU: tl.constexpr, XQ: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
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
                        GLU: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
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
                               stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XQ, NORM, ADD,
                               HAS_G, EVEN_K)
        acc0 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
        if ROWS > 1:
            sums, x_sum = _row_dot(lo, hi, m0 + 1, m0 + 1 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XQ, NORM,
                                   ADD, HAS_G, EVEN_K)
            acc1 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
        if ROWS > 2:
            sums, x_sum = _row_dot(lo, hi, m0 + 2, m0 + 2 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XQ, NORM,
                                   ADD, HAS_G, EVEN_K)
            acc2 += _scaled(sums, x_sum, s0, b0, s1, b1, TB, HAS_BIAS)
            sums, x_sum = _row_dot(lo, hi, m0 + 3, m0 + 3 < M, kw0, blk, K, x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr,
                                   KB, stride_xm, stride_xqm, stride_xdm, TB, LIMBS, ASM, HAS_BIAS, GLU, XQ, NORM,
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

