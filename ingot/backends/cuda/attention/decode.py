"""The decode attention: few query rows over a long cache, split-KV (`_decode_kernel`), the splits'
partial softmaxes merged by the last split (a ticket) or `_combine_kernel`; optionally RoPE and the new
token's K/V write inside (`RopeWrite`), and the output stored rounded for the word GEMV after it."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ....options import DEFAULT_CUDA, CudaOptions
from .. import timeline
from ..pdl import pdl_args, pdl_enter
from ..quantized_matmul import _workspace, _zero_share, store_xq
from ..timeline import now, stamp

DOT16 = os.environ.get("TRITON_INTERPRET") != "1"   # the interpreter's bfloat16 dots are wrong (triton 3.6)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, B_EXACT: tl.constexpr = False):
    """a @ b on tensor cores. PRECISION "tf32x3p": float32 inputs to float32-level accuracy as "tf32x3"
    (a = a_hi + a_lo, a_hi the top 10 mantissa bits; a_hi b_hi + a_lo b_hi + a_hi b_lo, a_lo b_lo
    dropped), but the three products are independent dots summed at the end, where Triton's tf32x3
    chains them through one accumulator (H200: 0.05-0.1 us less a short-cache decode launch, of the
    ~0.7 us single tf32 would save; see CudaOptions.decode_precision). B_EXACT: b has no low part (int8
    codes, a bfloat16 or float16 cache widened): two products. "bf16": a and b rounded to bfloat16, one
    product. Anything else: tl.dot with that input precision."""
    if PRECISION == "bf16":   # both operands rounded to bfloat16, one product (a choice: bf16 activations)
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PRECISION == "tf32x3p" and B_EXACT:   # b exact in tf32 (codes, 16-bit values): a_hi b + a_lo b
        a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        return tl.dot(a_hi, b, input_precision="tf32") + tl.dot(a - a_hi, b, input_precision="tf32")
    elif PRECISION == "tf32x3p":
        a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = tl.dot(a - a_hi, b_hi, input_precision="tf32") + tl.dot(a_hi, b - b_hi, input_precision="tf32")
        return tl.dot(a_hi, b_hi, input_precision="tf32") + lo
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_bf16x3(a, b):
    """a [float32] @ b [bfloat16] to float32-level accuracy: a = hi + mid + lo, three bfloat16 parts (8
    bits of mantissa each, 24 in all), each product exact in the float32 accumulator; b's tile stays
    16-bit, half the shared memory of a widened one, and bfloat16 MMAs run at twice tf32's rate."""
    hi = a.to(tl.bfloat16)
    rest = a - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(hi, b) + tl.dot(mid, b) + tl.dot(lo, b)


@triton.jit
def _merge_part(m_all, l_all, o_all, m_s, l_s, o_s):
    """Online-softmax merge of one split's (running max m_s, sum l_s, unnormalised output o_s) into the
    running (m_all, l_all, o_all), base-2 exponents; rows with no keys yet (max -inf) add nothing."""
    m_new = tl.maximum(m_all, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a_old = tl.exp2(m_all - m_safe)
    a_s = tl.exp2(m_s - m_safe)
    return m_new, l_all * a_old + l_s * a_s, o_all * a_old[:, None] + o_s * a_s[:, None]


@triton.jit
def _decode_chunk(length, SPLIT: tl.constexpr, ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys per split from the runtime length: ceil(length / SPLIT), at least MIN_CHUNK (0: none), a
    multiple of ALIGN keys; and `active`, the splits that see at least one key (0 when length is 0)."""
    chunk = tl.maximum((length + SPLIT - 1) // SPLIT, MIN_CHUNK)
    chunk = (chunk + ALIGN - 1) // ALIGN * ALIGN
    active = tl.where(chunk > 0, (length + chunk - 1) // tl.maximum(chunk, 1), 0)
    return chunk, tl.minimum(active, SPLIT)


@triton.jit
def quantize_row(x, ok):
    """An int8 KV cache's row as ops.nn.quantized_rows stores it: (codes int8, scale) of the float32 row x
    (entries not ok ignored), scale = max(max|x| / 127, 2**-126), codes x / scale rounded to nearest even
    (1.5 * 2**23 added and taken away: |x / scale| <= 127, so the float32 sum rounds at the units)."""
    amax = tl.max(tl.where(ok, tl.abs(x), 0.0), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1.1754943508222875e-38)
    y = tl.math.div_rn(x, scale)
    codes = (y + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _decode_tile(q, kt, vt, offs_n, n_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                 ks=1.0, vs=1.0, CODES: tl.constexpr = False, DOT16: tl.constexpr = True):
    """One key tile of the online softmax: the scores of q [R, D] against kt [N, D] (keys not n_ok, or past
    a row's causal limit, left out), then acc += p vt. A cache of another dtype than q's (bfloat16 or
    float16 K/V under float32 q) is widened here, after the load, or (DOT16) multiplied as bfloat16 tiles
    by q in three bfloat16 parts: the math is q's. CODES: kt and vt are an int8 cache's codes and ks, vs
    [N] their rows' scales: each key's score times its scale, each value's weight times its scale (the
    codes are exact in any float dtype, so the dots stay exact in them)."""
    # float32 q at "tf32x3p" over a bfloat16 cache or int8 codes (exact in bfloat16): three bfloat16
    # products of 16-bit tiles (`_dot_bf16x3`; H100 at 8k keys, Llama's 32/8 heads d 128, bf16: 27.0 us
    # a launch with the tiles widened to float32 and three tf32 products)
    BF16X3: tl.constexpr = DOT16 and PRECISION == "tf32x3p" and (
        CODES or (kt.dtype == tl.bfloat16 and vt.dtype == tl.bfloat16))
    # "bf16" (the bf16-activation choice): the tiles stay 16-bit, q and p rounded by _dot, one product each
    ONE16: tl.constexpr = DOT16 and PRECISION == "bf16"
    # a 16-bit cache widened to float32 is exact in tf32: the dots skip its low part
    K_EXACT: tl.constexpr = kt.dtype == tl.float16 or kt.dtype == tl.bfloat16
    V_EXACT: tl.constexpr = vt.dtype == tl.float16 or vt.dtype == tl.bfloat16
    if BF16X3 or ONE16:
        kt = kt.to(tl.bfloat16)   # (codes: |c| <= 127, exact)
        vt = vt.to(tl.bfloat16)
    else:
        if kt.dtype != q.dtype:
            kt = kt.to(q.dtype)
        if vt.dtype != q.dtype:
            vt = vt.to(q.dtype)
    if BF16X3:
        s = _dot_bf16x3(q, tl.trans(kt))
    else:   # (ONE16: _dot's "bf16", one product of the 16-bit tiles)
        s = _dot(q, tl.trans(kt), PRECISION, CODES or K_EXACT)
    if CODES:
        s = s * (ks * qk_scale)[None, :]   # [R, N], log2 units
    else:
        s = s * qk_scale
    ok = n_ok[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= limit[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if CODES:
        p = p * vs[None, :]
    if BF16X3:
        acc = acc * alpha[:, None] + _dot_bf16x3(p, vt)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRECISION, CODES or V_EXACT)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, ml_part_ptr, out_ptr, ticket_ptr,
                   length_const, HK, G, TQ, TBUF, D, DV, qk_scale,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                   LEN_FROM_PTR: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PRECISION: tl.constexpr, MERGE: tl.constexpr = False,
                   MIN_CHUNK: tl.constexpr = 0, PDL: tl.constexpr = False,
                   pos_ptr=None, inv_ptr=None, kn_ptr=None, vn_ptr=None, HALF=0, skn_b=0, skn_h=0, svn_b=0, svn_h=0,
                   cos_ptr=None, sin_ptr=None, TABLE_ROWS=0, ROPE: tl.constexpr = False,
                   INTERLEAVED: tl.constexpr = False,
                   xq_ptr=None, xd_ptr=None, xs_ptr=None, stride_xqm=0, stride_xdm=0, XQ_LIMBS: tl.constexpr = 0,
                   z_ptr=None, Z=0, ZERO: tl.constexpr = False, len_add=0, FRESH: tl.constexpr = False,
                   EARLY: tl.constexpr = False, CHUNK_ALIGN: tl.constexpr = 64, stamp_ptr=None,
                   STAMP: tl.constexpr = 0, ks_ptr=None, vs_ptr=None, sks_b=0, sks_h=0, sks_t=0, svs_b=0, svs_h=0,
                   svs_t=0, CODES: tl.constexpr = False, DOT16: tl.constexpr = True):
    """One split of the keys for the G * TQ query rows of a KV head. MERGE: the last split to finish (a
    ticket per head, reset behind it) merges the partial softmax of every split that saw keys (a
    short cache: a few, however many splits were launched for the buffer) and writes the output, so
    no combine launch follows.

    Only the `active` splits (those that see keys) run, the others return at once; with one active
    split (or none: length 0) split 0 normalises and writes the output itself, with no partials,
    ticket or merge; with MERGE the ticket counts to `active`. MIN_CHUNK: the fewest keys per split (a
    short cache uses one split). Each V tile is loaded with its K tile, before the softmax math.
    CHUNK_ALIGN: a split's keys are a multiple of it (the wrapper: BLOCK_N unless told). Measured and
    removed: every launched split storing partials, and the V tile loaded after the softmax.

    The caches may be of a narrower float dtype than q (a bfloat16 KV cache): their tiles are widened to
    q's dtype after the load (`_decode_tile`), the new rows rounded to theirs as they are stored.

    ROPE (one query row per head, TQ 1): q is rotated here by the position at pos_ptr (`_rotation`, cos/sin
    from a table), and
    the new token's k (rotated) and v rows (kn/vn [B, Hk, 1, D]) are written into the caches at that
    position by the split whose keys hold it (split 0 when none does), before it reads them: the
    layer's RoPE + KV write launch (`fused.rope_qkv_into`) folded into this one.

    XQ_LIMBS (1 or 2; TQ 1, DV a multiple of 32): the program that writes a head's output also stores
    it rounded for the word GEMV that reads the output as x [B, Hq * DV] (`store_xq`), so no quantize
    launch runs between the two; ZERO: split 0 of each head zeroes its share of z [Z] (float32), the
    output that GEMV's split-K sums are added into.

    FRESH (with ROPE): the new token's key is left out of the key tiles and added to the softmax from
    registers (its score an FMA dot in float32, its k and v rounded as stored), so the first tile's
    K and V loads go out with q's, before the rotation, and nothing waits on the write (no barrier).
    EARLY (with PDL): the length, the position, the first tile and the RoPE table are read before
    `pdl_enter`, while the kernel ahead still runs: the caller promises that kernel writes none of
    them (the caches' rows other than the position, which FRESH never loads, included). STAMP: timeline.py
    (the splits that write the output or merge; the others leave their stamps at zero).

    CODES (not with FRESH): the caches are an int8 cache's codes, ks/vs [B, Hk, TBUF, 1] their row scales,
    read tile by tile with them (`_decode_tile`): no float copy of the cache is made; with ROPE the new
    rows are quantized as they are written (`quantize_row`)."""
    t0 = now(STAMP)
    if not EARLY:
        pdl_enter(PDL)
    t1 = now(STAMP)
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    me = pid_s * tl.num_programs(0) + pid_bh
    b = pid_bh // HK
    hk = pid_bh % HK
    if LEN_FROM_PTR:   # the device scalar + len_add (a decode step's position + 1)
        length = tl.minimum(tl.maximum(tl.load(len_ptr).to(tl.int32) + len_add, 0), TBUF)
    else:
        length = length_const  # clamped by the wrapper
    chunk, active = _decode_chunk(length, SPLIT, CHUNK_ALIGN, MIN_CHUNK)
    if pid_s >= tl.maximum(active, 1):   # sees no key (split 0 stays to write zeros when length is 0)
        return
    start = pid_s * chunk
    stop = tl.minimum(start + chunk, length)

    rows = tl.arange(0, BLOCK_R)
    g = rows // TQ
    t = rows % TQ
    row_ok = rows < G * TQ
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    skip = -1   # FRESH: the key at pos, which this launch writes: left out of the tiles, added from registers
    if ROPE:
        pos = tl.load(pos_ptr).to(tl.int32)
        if FRESH:
            skip = pos
    if FRESH:   # the first tile's loads go out before anything waits on q or the RoPE table
        n0_offs = start + tl.arange(0, BLOCK_N)
        n0_ok = (n0_offs < stop) & (n0_offs != skip)
        kt0 = tl.load(k_base + n0_offs[:, None] * sk_t + offs_d[None, :], mask=n0_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        vt0 = tl.load(v_base + n0_offs[:, None] * sv_t + offs_dv[None, :], mask=n0_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        kn_rot = tl.zeros([BLOCK_D], tl.float32)
        vn_row = tl.zeros([BLOCK_DV], tl.float32)
    if ROPE:
        partner, c, sn = _rotation(pos, inv_ptr, cos_ptr, sin_ptr, TABLE_ROWS, offs_d, HALF, INTERLEAVED)
    if EARLY:   # all of the above reads what no kernel ahead on the stream writes
        pdl_enter(PDL)
        t1 = now(STAMP)
    if ZERO:
        if pid_s == 0:
            _zero_share(z_ptr, Z, pid_bh, tl.num_programs(0))
    q_rows = q_ptr + b * sq_b + (hk * G + g)[:, None] * sq_h + t[:, None] * sq_t
    q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if ROPE:
        q_pair = tl.load(q_rows + partner[None, :], mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        q = (q.to(tl.float32) * c[None, :] + q_pair.to(tl.float32) * sn[None, :]).to(q_ptr.dtype.element_ty)
        writer = tl.where((pos >= 0) & (pos < length), pos // tl.maximum(chunk, 1), 0)   # the split holding pos, or 0
        if pid_s == writer:   # the new token's k and v into the caches (before this split reads them, unless FRESH)
            if (pos >= 0) & (pos < TBUF):
                kn_row = kn_ptr + b * skn_b + hk * skn_h
                kn = tl.load(kn_row + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
                kn_pair = tl.load(kn_row + partner, mask=offs_d < D, other=0.0).to(tl.float32)
                vn = tl.load(vn_ptr + b * svn_b + hk * svn_h + offs_dv, mask=offs_dv < DV, other=0.0)
                if CODES:   # an int8 cache: the rows' codes and scales (not with FRESH)
                    kn_st, k_row_scale = quantize_row(kn * c + kn_pair * sn, offs_d < D)
                    vn_st, v_row_scale = quantize_row(vn.to(tl.float32), offs_dv < DV)
                    tl.store(ks_ptr + b * sks_b + hk * sks_h + pos * sks_t, k_row_scale)
                    tl.store(vs_ptr + b * svs_b + hk * svs_h + pos * svs_t, v_row_scale)
                else:
                    kn_st = (kn * c + kn_pair * sn).to(k_ptr.dtype.element_ty)
                    vn_st = vn.to(v_ptr.dtype.element_ty)
                tl.store(k_base + pos * sk_t + offs_d, kn_st, mask=offs_d < D)
                tl.store(v_base + pos * sv_t + offs_dv, vn_st, mask=offs_dv < DV)
                if FRESH:   # as stored, so later steps read what this one used
                    kn_rot = kn_st.to(tl.float32)
                    vn_row = vn_st.to(tl.float32)
            if not FRESH:
                tl.debug_barrier()   # the CTA's stores are seen by its loads below
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    limit = t + length - TQ                      # causal: the last key each row may see
    first = start
    if FRESH:   # the first tile's K and V were loaded before the rotation; the new key comes from registers
        m_i, l_i, acc = _decode_tile(q, kt0, vt0, n0_offs, n0_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL, PRECISION,
                                     DOT16=DOT16)
        first = start + BLOCK_N
    for n0 in range(first, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        if FRESH:
            n_ok = n_ok & (offs_n != skip)
        kt = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=n_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        # independent of p: both loads in flight together
        vt = tl.load(v_base + offs_n[:, None] * sv_t + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        if CODES:
            ks = tl.load(ks_ptr + b * sks_b + hk * sks_h + offs_n * sks_t, mask=n_ok, other=0.0)
            vs = tl.load(vs_ptr + b * svs_b + hk * svs_h + offs_n * svs_t, mask=n_ok, other=0.0)
            m_i, l_i, acc = _decode_tile(q, kt, vt, offs_n, n_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL, PRECISION,
                                         ks, vs, True, DOT16)
        else:
            m_i, l_i, acc = _decode_tile(q, kt, vt, offs_n, n_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL, PRECISION,
                                         DOT16=DOT16)
    if FRESH:
        if (skip >= start) & (skip < stop):   # the new token's key: its score in float32 from registers
            s_new = tl.sum(q.to(tl.float32) * kn_rot[None, :], axis=1) * qk_scale
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * vn_row[None, :]
            m_i = m_new
    out_offs = out_ptr + b * so_b + (hk * G + g)[:, None] * so_h + t[:, None] * so_t + offs_dv[None, :]
    out_ok = row_ok[:, None] & (offs_dv < DV)[None, :]
    if active <= 1:   # the only split: normalise and write, nothing to merge
        o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_offs, o.to(out_ptr.dtype.element_ty), mask=out_ok)
        if XQ_LIMBS > 0:
            store_xq(o.to(out_ptr.dtype.element_ty).to(tl.float32), b, hk * G, row_ok, xq_ptr, xd_ptr, xs_ptr,
                      stride_xqm, stride_xdm, XQ_LIMBS, BLOCK_R, BLOCK_DV)
        stamp(stamp_ptr, me, t0, t1, t1, STAMP)
        return
    part = (pid_bh * SPLIT + pid_s) * BLOCK_R + rows
    tl.store(o_part_ptr + part[:, None] * BLOCK_DV + offs_dv[None, :], acc)
    tl.store(ml_part_ptr + part * 2, m_i)
    tl.store(ml_part_ptr + part * 2 + 1, l_i)
    if MERGE:
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid_bh, 1, sem="acq_rel")
        if ticket == active - 1:     # only the active splits take a ticket
            m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_all = tl.zeros([BLOCK_R], tl.float32)
            o_all = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
            for sp in range(0, active):
                ps = (pid_bh * SPLIT + sp) * BLOCK_R + rows
                m_s = tl.load(ml_part_ptr + ps * 2, cache_modifier=".cg")
                l_s = tl.load(ml_part_ptr + ps * 2 + 1, cache_modifier=".cg")
                o_s = tl.load(o_part_ptr + ps[:, None] * BLOCK_DV + offs_dv[None, :], cache_modifier=".cg")
                m_all, l_all, o_all = _merge_part(m_all, l_all, o_all, m_s, l_s, o_s)
            o = tl.where(l_all[:, None] > 0, o_all / tl.where(l_all > 0, l_all, 1.0)[:, None], 0.0)
            tl.store(out_offs, o.to(out_ptr.dtype.element_ty), mask=out_ok)
            if XQ_LIMBS > 0:
                store_xq(o.to(out_ptr.dtype.element_ty).to(tl.float32), b, hk * G, row_ok, xq_ptr, xd_ptr, xs_ptr,
                          stride_xqm, stride_xdm, XQ_LIMBS, BLOCK_R, BLOCK_DV)
            tl.atomic_xchg(ticket_ptr + pid_bh, 0, sem="relaxed")
            stamp(stamp_ptr, me, t0, t1, t1, STAMP)


@triton.jit
def _rotation(pos, inv_ptr, cos_ptr, sin_ptr, ROWS, offs_d, HALF, INTERLEAVED: tl.constexpr):
    """RoPE at position pos as y[j] = x[j] * c[j] + x[partner[j]] * sn[j] (sn carrying the sign; c 1 and
    sn 0 past the rotated 2 * HALF dims), cos/sin read from the table [ROWS, HALF] (`rope_table`). A
    position past the table computes them in float64, one angle at a time: the same values, but float64
    sin/cos over the whole vector made the H200's decode kernel slower than a separate RoPE launch
    (13.2 against 6.0 us a Llama-3-8B layer) and pushed it to 255 registers with spills (2026-12-03)."""
    if INTERLEAVED:
        partner = offs_d ^ 1
        idx = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        idx = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
    rot = offs_d < 2 * HALF
    partner = tl.where(rot, partner, offs_d)
    row = tl.minimum(tl.maximum(pos, 0), ROWS - 1).to(tl.int64)
    c = tl.load(cos_ptr + row * HALF + idx, mask=rot, other=1.0)
    s = tl.load(sin_ptr + row * HALF + idx, mask=rot, other=0.0)
    if (pos < 0) | (pos >= ROWS):   # past the table (rare)
        for j in range(HALF):
            angle = pos.to(tl.float64) * tl.load(inv_ptr + j).to(tl.float64)
            c = tl.where(idx == j, tl.cos(angle).to(tl.float32), c)
            s = tl.where(idx == j, tl.sin(angle).to(tl.float32), s)
    c = tl.where(rot, c, 1.0)
    sn = tl.where(rot, s * sign, 0.0)
    return partner, c, sn


@triton.jit
def _combine_kernel(o_part_ptr, ml_part_ptr, out_ptr, len_ptr, length_const, HK, G, TQ, TBUF, DV,
                    so_b, so_h, so_t,
                    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_DV: tl.constexpr, LEN_FROM_PTR: tl.constexpr = False, BLOCK_N: tl.constexpr = 16,
                    MIN_CHUNK: tl.constexpr = 0, PDL: tl.constexpr = False, len_add=0):
    """Merge the splits' partial softmaxes of one query row: weights exp2(m_s - max), CHUNK splits at a time.
    Only the `active` splits stored partials (recomputed here from the length, as the decode kernel
    does); with at most one, that split wrote the output and this program returns."""
    pdl_enter(PDL)
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    g = r // TQ
    t = r % TQ
    if LEN_FROM_PTR:
        length = tl.minimum(tl.maximum(tl.load(len_ptr).to(tl.int32) + len_add, 0), TBUF)
    else:
        length = length_const
    _, active = _decode_chunk(length, SPLIT, BLOCK_N, MIN_CHUNK)   # BLOCK_N: the decode kernel's CHUNK_ALIGN
    if active <= 1:
        return
    n_split = active
    splits = tl.arange(0, SPLIT_P2)
    s_ok = splits < n_split
    part = (pid_bh * SPLIT + splits) * BLOCK_R + r
    m = tl.load(ml_part_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_part_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(tl.where(s_ok, l * tl.exp2(m - m_safe), 0.0), axis=0)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for c0 in tl.static_range(0, SPLIT, CHUNK):
        cs = c0 + tl.arange(0, CHUNK)
        c_ok = cs < n_split
        pc = (pid_bh * SPLIT + cs) * BLOCK_R + r
        mc = tl.load(ml_part_ptr + pc * 2, mask=c_ok, other=float("-inf"))
        wc = tl.where(c_ok, tl.exp2(mc - m_safe), 0.0)
        o = tl.load(o_part_ptr + pc[:, None] * BLOCK_DV + offs_dv[None, :], mask=c_ok[:, None], other=0.0)
        acc += tl.sum(o * wc[:, None], axis=0)
    o = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + b * so_b + (hk * G + g) * so_h + t * so_t + offs_dv, o.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)


# -- the wrapper ----------------------------------------------------------------------------------

DECODE_MAX_ROWS = 64   # G * Tq up to this: the split-KV kernel; above: flash tiles
# The decode tuning (`CudaOptions`), H200. decode_merge_max_splits 32: the last split merges (no combine
# launch) when at most this many splits are launched; it walks the splits that saw keys one after another,
# which made decode attention 2-3x slower with 30-90 busy splits, while a short cache leaves a few busy and
# saves a launch per layer. decode_merge_splits 8: the most splits launched per KV head where they merge in
# the kernel (those past the runtime length exit at once but are launched all the same): SmolLM2's buffer of
# 2048 rows, the step 514.1 us with 8 against 518.6 with 32 (4: 514.1, 16: 514.5). decode_precision
# "tf32x3p" (`_dot`): against Triton's "tf32x3" SmolLM2's attention with RoPE 4.67 / 5.77 / 6.00 us against
# 4.77 / 5.84 / 6.05 at 33 / 100 / 160 keys, the step 523.3 us against 527.1; "tf32x3" against "ieee" (FMA
# units through shared memory) SmolLM2 764 us a step against 826, Llama-3-8B 2114 against 2271.
# decode_fresh_tile_bytes 32 KB: with early loads the new key and value come from registers (`fresh`), so the
# first tile's loads go out before the wait too, where the K+V tile (held in registers through the
# rotation) fits: SmolLM2's attention 4.19 / 5.40 / 5.66 / 8.89 us against 4.31 / 5.51 / 5.77 / 8.92 at
# 33 / 100 / 160 / 1000 keys re-reading the new row. decode_warps 0: 8 with RoPE where the K + V tile is
# too big for `fresh` (float32 d 128: Llama-3-8B's step 1794.0 us against 1817.4 at 4), else 4.
# Measured and removed: the new k and v rows loaded with q (Llama-3-8B's step 1796.5 us against 1797.6),
# K and V tiles loaded together through an opaque copy (1798.0 against 1797.6), early loads off (SmolLM2
# 495.8-496.5 us a step against 551.0 without; Llama-3-8B 1916.1 against 1999.1).


def _decode_min_chunk(d: int, dv: int, element_size: int, kv_bytes: int = 32 << 10) -> int:
    """Fewest keys per decode split: about `kv_bytes` of K+V per split and KV head (f32 d 64: 64 keys,
    16-bit d 128: 64; f32 d 128: 32, one BLOCK_N tile of 64 in practice), so a short cache is read by
    one split, which writes the output. One program is slow over many keys (H200, SmolLM2's 9/3
    heads d 64 f32: 64 keys per split 7.3 us at 100 keys and 7.6 at 160, 128 per split 9.3 and 10.7;
    one split at 64 keys 5.7 us against 7.0 for the old kernel)."""
    return max(16, kv_bytes // max((d + dv) * element_size, 1))


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_attention(p, causal: bool, split: int | None, precision: str | None, block_n: int | None, num_warps: int | None,
           num_stages: int | None, merge: bool | None, min_chunk: int | None,
           rope, xq, zero: torch.Tensor | None, fresh: bool | None, early: bool,
           chunk_align: int | None, options: CudaOptions = DEFAULT_CUDA) -> torch.Tensor:
    """The split-KV kernel for `attention` (its arguments; p: the `Problem` it built; an int8 cache's row
    scales in p.scales)."""
    q4, k4, v4, o4, nb, hk, group, tq, tbuf, d, dv = p.q4, p.k4, p.v4, p.o4, p.nb, p.hk, p.group, p.tq, p.tbuf, p.d, p.dv
    block_d, block_dv, device = p.block_d, p.block_dv, q4.device
    block_r = max(16, triton.next_power_of_2(group * tq))
    bn = block_n or options.decode_block_n or (64 if block_d <= 128 else 32)
    align = chunk_align or options.decode_chunk_align or bn
    if min_chunk is None:
        min_chunk = _decode_min_chunk(d, dv, k4.element_size(), options.decode_chunk_kb << 10)
    merge_split = split   # the merge rule below sees the split count chosen before the min_chunk cap
    if split is None:
        split = merge_split = max(1, min(triton.cdiv(tbuf, bn), (2 * _sm_count(device)) // max(nb * hk, 1), 128))
        if split <= options.decode_merge_max_splits:   # merged in the kernel: fewer, longer splits
            split = merge_split = min(split, options.decode_merge_splits)
        # splits past the whole buffer's last chunk never see keys: at 32k keys of 64-key tiles 33 splits
        # have chunks of 1024, so 32 (H200, 2026-12-03, Llama-shape bf16: 39.4 us against 41.1 in one
        # call, the combine kernel over 32 splits instead of 33)
        chunk = triton.cdiv(max(triton.cdiv(tbuf, split), min_chunk), align) * align
        split = triton.cdiv(tbuf, chunk)
    if num_stages is None and triton.cdiv(max(triton.cdiv(tbuf, split), min_chunk), bn) <= 1:
        num_stages = 1   # one key tile a split at most: no pipelined loads to set up (H200, SmolLM2's
        # 9/3 heads f32 with RoPE and the rounded output: 5.04 us against 5.51 at 33 keys, 6.18 / 6.68 at 100)
    o_part = torch.empty((nb * hk * split * block_r, block_dv), dtype=torch.float32, device=device)
    ml_part = torch.empty((nb * hk * split * block_r, 2), dtype=torch.float32, device=device)
    if merge is None:
        merge = merge_split <= options.decode_merge_max_splits
    tickets = _workspace(device, 0, nb * hk)[1] if merge else ml_part
    extra = {}
    if p.scales is not None:   # an int8 cache: its codes and their row scales [nb, Hk, TBUF, 1]
        fresh = False   # the new rows are read back as stored (codes), after the write
        ks4, vs4 = p.scales
        extra.update(ks_ptr=ks4, vs_ptr=vs4, sks_b=ks4.stride(0), sks_h=ks4.stride(1), sks_t=ks4.stride(2),
                     svs_b=vs4.stride(0), svs_h=vs4.stride(1), svs_t=vs4.stride(2), CODES=True)
    tile_bytes = bn * (block_d + block_dv) * k4.element_size()   # one K + V tile
    precision = precision or (options.decode_precision if p.f32 else "tf32")
    # (an int8 cache at d 128: its widened tiles and the split q held at 4 warps spilled, sm_90a 255 registers;
    # with one bf16 product q is not split: 4 warps, H100 8k keys 19.5 us against 23.2 at 8, cuda_decode_probe.py)
    warps = num_warps or options.decode_warps or (8 if (rope is not None and tile_bytes > options.decode_fresh_tile_bytes)
                                                  or (p.scales is not None and block_d >= 128 and precision != "bf16")
                                                  else 4)
    if rope is not None:
        kn4, vn4 = p.four(rope.k), p.four(rope.v)
        assert kn4.shape[1:] == (hk, 1, d) and vn4.shape[1:] == (hk, 1, dv), "attention: rope's k/v rows [..., Hk, 1, D]"
        extra.update(pos_ptr=rope.pos, inv_ptr=rope.inv_freq, kn_ptr=kn4, vn_ptr=vn4, HALF=rope.inv_freq.shape[0],
                     skn_b=kn4.stride(0), skn_h=kn4.stride(1), svn_b=vn4.stride(0), svn_h=vn4.stride(1), ROPE=True,
                     INTERLEAVED=rope.interleaved)
        cos, sin = rope.cos_sin
        assert cos.shape == sin.shape and cos.shape[1] == rope.inv_freq.shape[0] and cos.dtype == torch.float32
        extra.update(cos_ptr=cos, sin_ptr=sin, TABLE_ROWS=cos.shape[0], EARLY=early)
        if fresh is None:   # with early loads; the first tile held in registers through the rotation
            fresh = early and tile_bytes <= options.decode_fresh_tile_bytes
        extra.update(FRESH=fresh)
    # every output is written by the decode kernel itself (no combine launch): it can round it for the GEMV
    xq_here = xq is not None and merge and tq == 1 and dv == block_dv and dv % 32 == 0 and xq.limbs in (1, 2)
    if xq_here:
        hq = p.hq
        assert xq.xq.shape == (nb, hq * dv // 32 * 8 * xq.limbs) and xq.xd.shape == xq.xs.shape == (nb, hq * dv // 32)
        extra.update(xq_ptr=xq.xq, xd_ptr=xq.xd, xs_ptr=xq.xs, stride_xqm=xq.xq.stride(0), stride_xdm=xq.xd.stride(0),
                     XQ_LIMBS=xq.limbs)
        zero = xq.zero if xq.zero is not None else zero
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
        extra.update(z_ptr=zero, Z=zero.numel(), ZERO=True)
    _decode_kernel[(nb * hk, split)](
        q4, k4, v4, p.len_ptr, o_part, ml_part, o4, tickets, p.len_const, hk, group, tq, tbuf, d, dv, p.qk_scale,
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2),
        LEN_FROM_PTR=p.from_ptr, CAUSAL=causal, SPLIT=split, BLOCK_R=block_r, BLOCK_N=bn,
        BLOCK_D=block_d, BLOCK_DV=block_dv, PRECISION=precision,
        MERGE=merge, MIN_CHUNK=max(min_chunk, 0), DOT16=DOT16,
        len_add=p.length_offset, CHUNK_ALIGN=align, num_warps=warps, **({"num_stages": num_stages} if num_stages else {}),
        **extra, **pdl_args(device), **timeline.args(f"attention {hk}x{group} d{d}", nb * hk * split, device,
                                                     options.timeline))
    if xq_here:
        xq.written = True
    if merge:
        return p.result
    _combine_kernel[(nb * hk, group * tq)](
        o_part, ml_part, o4, p.len_ptr, p.len_const, hk, group, tq, tbuf, dv, o4.stride(0), o4.stride(1), o4.stride(2),
        SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), CHUNK=min(16, triton.next_power_of_2(split)),
        BLOCK_R=block_r, BLOCK_DV=block_dv, LEN_FROM_PTR=p.from_ptr, BLOCK_N=align,
        MIN_CHUNK=max(min_chunk, 0), len_add=p.length_offset, num_warps=4, **pdl_args(device))
    return p.result
