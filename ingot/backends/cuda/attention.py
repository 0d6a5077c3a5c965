"""Fused scaled-dot-product attention on the GPU (Triton): decode and prefill, reading the KV cache in place.

Semantics are those of the SDPA op's NumPy reference (ingot/ops/nn.py): q [B, Hq, Tq, D],
k [B, Hk, Tk, D], v [B, Hk, Tk, Dv], Hq a multiple of Hk (GQA); keys at or past `length` are
ignored; `causal` lets query t see key j when j <= t + length - Tq; a row that sees no key is zeros.
The length may be a device scalar, read by the kernels, so a captured CUDA graph serves every
position.

- `_decode_kernel` + `_combine_kernel`: few query rows over a long cache. One program per
  (batch, KV head, split of the keys): the Hq/Hk query heads of a group share every K/V load; the
  keys are split over programs (split-KV, the chunk sized from the runtime length, at least ~32 KB
  of K+V per split), only the splits that see keys run, and the partial softmaxes are merged by the
  last of them (a ticket) or a second kernel. A short cache has one such split, which writes the
  output itself.
- `_flash_kernel`: many query rows (prefill): FlashAttention-2 tiles in two stages (the key tiles
  every row of the block sees without any masking, then the diagonal and tail tiles masked), the
  causal blocks with the most keys first, an optional additive mask read through broadcast strides.

    >>> out = attention(q, k_cache, v_cache, length=pos_plus_one, causal=True)   # doctest: +SKIP
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ...ops.nn import rope_cos_sin
from . import timeline
from .pdl import pdl_args, pdl_enter
from .timeline import now, stamp
from .quantized_matmul import _zero_share, store_xq

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b on tensor cores. PRECISION "tf32x3p": float32 inputs to float32-level accuracy as "tf32x3"
    (a = a_hi + a_lo, a_hi the top 10 mantissa bits; a_hi b_hi + a_lo b_hi + a_hi b_lo, a_lo b_lo
    dropped), but the three products are independent dots summed at the end, where Triton's tf32x3
    chains them through one accumulator (H200: 0.05-0.1 us less a short-cache decode launch, of the
    ~0.7 us single tf32 would save; see DECODE_F32_PRECISION). Anything else: tl.dot with that input
    precision."""
    if PRECISION == "tf32x3p":
        a_hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        b_hi = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = tl.dot(a - a_hi, b_hi, input_precision="tf32") + tl.dot(a_hi, b - b_hi, input_precision="tf32")
        return tl.dot(a_hi, b_hi, input_precision="tf32") + lo
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _decode_chunk(length, SPLIT: tl.constexpr, ALIGN: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys per split from the runtime length: ceil(length / SPLIT), at least MIN_CHUNK (0: none), a
    multiple of ALIGN keys; and `active`, the splits that see at least one key (0 when length is 0)."""
    chunk = tl.maximum((length + SPLIT - 1) // SPLIT, MIN_CHUNK)
    chunk = (chunk + ALIGN - 1) // ALIGN * ALIGN
    active = tl.where(chunk > 0, (length + chunk - 1) // tl.maximum(chunk, 1), 0)
    return chunk, tl.minimum(active, SPLIT)


@triton.jit
def _decode_tile(q, kt, vt, offs_n, n_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                 V_LOADED: tl.constexpr = True, v_mask=None):
    """One key tile of the online softmax: the scores of q [R, D] against kt [N, D] (keys not n_ok, or past
    a row's causal limit, left out), then acc += p vt. vt is the V tile, or (V_LOADED False) its pointers,
    loaded here after the softmax math under v_mask."""
    s = _dot(q, tl.trans(kt), PRECISION) * qk_scale                          # [R, N], log2 units
    ok = n_ok[None, :]
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= limit[:, None])
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if not V_LOADED:
        vt = tl.load(vt, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, ml_part_ptr, out_ptr, ticket_ptr,
                   length_const, HK, G, TQ, TBUF, D, DV, qk_scale,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                   LEN_FROM_PTR: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PRECISION: tl.constexpr, MERGE: tl.constexpr = False, SHORT_PATH: tl.constexpr = False,
                   MIN_CHUNK: tl.constexpr = 0, EARLY_V: tl.constexpr = False, PDL: tl.constexpr = False,
                   pos_ptr=None, inv_ptr=None, kn_ptr=None, vn_ptr=None, HALF=0, skn_b=0, skn_h=0, svn_b=0, svn_h=0,
                   cos_ptr=None, sin_ptr=None, TABLE_ROWS=0, ROPE: tl.constexpr = False,
                   INTERLEAVED: tl.constexpr = False,
                   xq_ptr=None, xd_ptr=None, xs_ptr=None, stride_xqm=0, stride_xdm=0, XQ_LIMBS: tl.constexpr = 0,
                   z_ptr=None, Z=0, ZERO: tl.constexpr = False, len_add=0, FRESH: tl.constexpr = False,
                   EARLY: tl.constexpr = False, CHUNK_ALIGN: tl.constexpr = 64, stamp_ptr=None,
                   STAMP: tl.constexpr = 0):
    """One split of the keys for the G * TQ query rows of a KV head. MERGE: the last split to finish (a
    ticket per head, reset behind it) merges the partial softmax of every split that saw keys (a
    short cache: a few, however many splits were launched for the buffer) and writes the output, so
    no combine launch follows.

    SHORT_PATH: only the `active` splits (those that see keys) run, the others return at once; with
    one active split (or none: length 0) split 0 normalises and writes the output itself, with no
    partials, ticket or merge; with MERGE the ticket counts to `active`. MIN_CHUNK: the fewest keys
    per split (a short cache uses one split). EARLY_V: the V tile is loaded with the K tile, before
    the softmax math. All three off: the kernel as before (every split stores partials). CHUNK_ALIGN:
    a split's keys are a multiple of it (the wrapper: BLOCK_N unless told).

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
    (the splits that write the output or merge; the others leave their stamps at zero)."""
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
    if SHORT_PATH:
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
                kn_st = (kn * c + kn_pair * sn).to(k_ptr.dtype.element_ty)
                tl.store(k_base + pos * sk_t + offs_d, kn_st, mask=offs_d < D)
                vn = tl.load(vn_ptr + b * svn_b + hk * svn_h + offs_dv, mask=offs_dv < DV, other=0.0)
                vn_st = vn.to(v_ptr.dtype.element_ty)
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
        m_i, l_i, acc = _decode_tile(q, kt0, vt0, n0_offs, n0_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL, PRECISION)
        first = start + BLOCK_N
    for n0 in range(first, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        if FRESH:
            n_ok = n_ok & (offs_n != skip)
        kt = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=n_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        if EARLY_V:   # independent of p: both loads in flight together
            vt = tl.load(v_base + offs_n[:, None] * sv_t + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        else:
            vt = v_base + offs_n[:, None] * sv_t + offs_dv[None, :]   # loaded after the softmax math
        m_i, l_i, acc = _decode_tile(q, kt, vt, offs_n, n_ok, limit, m_i, l_i, acc, qk_scale, CAUSAL, PRECISION,
                                     EARLY_V, n_ok[:, None] & (offs_dv < DV)[None, :])
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
    if SHORT_PATH:
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
        if SHORT_PATH:
            last = ticket == active - 1     # only the active splits take a ticket
        else:
            last = ticket == SPLIT - 1
        if last:
            m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_all = tl.zeros([BLOCK_R], tl.float32)
            o_all = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
            for sp in range(0, active):
                ps = (pid_bh * SPLIT + sp) * BLOCK_R + rows
                m_s = tl.load(ml_part_ptr + ps * 2, cache_modifier=".cg")
                l_s = tl.load(ml_part_ptr + ps * 2 + 1, cache_modifier=".cg")
                o_s = tl.load(o_part_ptr + ps[:, None] * BLOCK_DV + offs_dv[None, :], cache_modifier=".cg")
                m_new = tl.maximum(m_all, m_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a_old = tl.exp2(m_all - m_safe)
                a_s = tl.exp2(m_s - m_safe)
                l_all = l_all * a_old + l_s * a_s
                o_all = o_all * a_old[:, None] + o_s * a_s[:, None]
                m_all = m_new
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
                    SHORT_PATH: tl.constexpr = False, MIN_CHUNK: tl.constexpr = 0, PDL: tl.constexpr = False,
                    len_add=0):
    """Merge the splits' partial softmaxes of one query row: weights exp2(m_s - max), CHUNK splits at a time.
    SHORT_PATH: only the `active` splits stored partials (recomputed here from the length, as the
    decode kernel does); with at most one, that split wrote the output and this program returns."""
    pdl_enter(PDL)
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    g = r // TQ
    t = r % TQ
    n_split = SPLIT
    if SHORT_PATH:
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


@triton.jit
def _flash_tile(base_ptr, desc, n0, stride_t, stop, WIDTH,
                BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BOUNDED: tl.constexpr, EVEN_W: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Rows n0 .. n0 + BLOCK_N of a [T, WIDTH] K or V slice. BOUNDED: rows at or past `stop` read as
    zeros (TMA: the descriptor ends at the length, and the caller masks the scores of [stop, length))."""
    if USE_TMA:
        tile = desc.load([n0, 0])
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_W)
        ptrs = base_ptr + offs_n[:, None] * stride_t + offs_w[None, :]
        if BOUNDED:
            ok = (offs_n < stop)[:, None]
            if not EVEN_W:
                ok = ok & (offs_w < WIDTH)[None, :]
            tile = tl.load(ptrs, mask=ok, other=0.0)
        elif EVEN_W:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_w < WIDTH)[None, :], other=0.0)
    return tile


@triton.jit
def _flash_keys(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, mask_base, qk_scale,
                offs_m, m_ok, limit, start, stop, D, DV, sk_t, sv_t, sm_t, sm_n,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, SCALE_NONNEG: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
                USE_TMA: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax over key tiles start, start + BLOCK_N, .. < stop (log2 units).

    MASKED=False: every row of the block sees every key of every tile (tiles below the causal
    diagonal, inside the length, no mask): no score masking, no bounds on the key rows, and no
    guard against an all -inf row (each tile gives every row a finite maximum).
    MASKED=True: key bounds, the causal limit and the optional additive mask; a row may have seen
    no key yet, so the maximum is guarded (m_safe)."""
    for n0 in range(start, stop, BLOCK_N):
        kt = _flash_tile(k_base, k_desc, n0, sk_t, stop, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
        qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION)
        if MASKED:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = qk * qk_scale
            if HAS_MASK:
                bias = tl.load(mask_base + offs_m[:, None] * sm_t + offs_n[None, :] * sm_n,
                               mask=m_ok[:, None] & (offs_n < stop)[None, :], other=0.0)
                s = s + bias * 1.4426950408889634
            ok = (offs_n < stop)[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= limit[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        else:
            if SCALE_NONNEG:   # the scaled maximum from the raw one: the scale folds into one FMA below
                m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.min(qk, axis=1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        vt = _flash_tile(v_base, v_desc, n0, sv_t, stop, DV, BLOCK_N, BLOCK_DV, MASKED, EVEN_D, USE_TMA)
        acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_kernel(q_ptr, k_ptr, v_ptr, len_ptr, mask_ptr, out_ptr,
                  length_const, HQ, G, TQ, TBUF, D, DV, qk_scale,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                  sm_b, sm_h, sm_t, sm_n,
                  LEN_FROM_PTR: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PRECISION: tl.constexpr, SPLIT_STAGES: tl.constexpr = True, HEAVY_FIRST: tl.constexpr = True,
                  HEADS_ON_AXIS0: tl.constexpr = False, USE_TMA: tl.constexpr = False,
                  EVEN_D: tl.constexpr = False, SCALE_NONNEG: tl.constexpr = True, PDL: tl.constexpr = False):
    """One BLOCK_M block of query rows of one (batch, query head) against the keys it may see.

    SPLIT_STAGES: the key tiles every row sees run unmasked, then the diagonal / tail tiles masked
    (a mask keeps all tiles masked). HEAVY_FIRST (causal): the blocks with the most keys start first
    so the short ones fill the last wave. HEADS_ON_AXIS0: grid (B*Hq, blocks) instead of (blocks, B*Hq).
    USE_TMA: Q/K/V tiles through on-device tensor descriptors (16-byte aligned rows; the wrapper checks).
    EVEN_D: D == BLOCK_D and DV == BLOCK_DV (no column masks)."""
    pdl_enter(PDL)
    if HEADS_ON_AXIS0:
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        num_m = tl.num_programs(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        num_m = tl.num_programs(0)
    if HEAVY_FIRST and CAUSAL:
        pid_m = num_m - 1 - pid_m
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // G
    if LEN_FROM_PTR:
        length = tl.minimum(tl.maximum(tl.load(len_ptr).to(tl.int32), 0), TBUF)
    else:
        length = length_const  # clamped by the wrapper
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < TQ
    q_base = q_ptr + b * sq_b + h * sq_h
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[TQ, D], strides=[sq_t, 1], block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(length, 1), D], strides=[sk_t, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(length, 1), DV], strides=[sv_t, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
        q = q_desc.load([m0, 0])
    else:
        k_desc = k_base
        v_desc = v_base
        q_ok = m_ok[:, None]
        if not EVEN_D:
            q_ok = q_ok & (offs_d < D)[None, :]
        q = tl.load(q_base + offs_m[:, None] * sq_t + offs_d[None, :], mask=q_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    limit = offs_m + length - TQ                 # causal: the last key each row may see
    if CAUSAL:
        hi = tl.minimum(length, tl.maximum(tl.minimum(m0 + BLOCK_M, TQ) + length - TQ, 0))
        seen_by_all = tl.minimum(hi, tl.maximum(m0 + 1 + length - TQ, 0))   # keys the block's first row sees
    else:
        hi = length
        seen_by_all = length
    if SPLIT_STAGES and not HAS_MASK:
        lo = seen_by_all // BLOCK_N * BLOCK_N
    else:
        lo = hi * 0
    mask_base = mask_ptr + b * sm_b + h * sm_h
    acc, l_i, m_i = _flash_keys(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, mask_base, qk_scale,
                                offs_m, m_ok, limit, 0, lo, D, DV, sk_t, sv_t, sm_t, sm_n,
                                False, CAUSAL, HAS_MASK, SCALE_NONNEG, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D,
                                USE_TMA, PRECISION)
    acc, l_i, m_i = _flash_keys(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, mask_base, qk_scale,
                                offs_m, m_ok, limit, lo, hi, D, DV, sk_t, sv_t, sm_t, sm_n,
                                True, CAUSAL, HAS_MASK, SCALE_NONNEG, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D,
                                USE_TMA, PRECISION)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ok = m_ok[:, None]
    if not EVEN_D:
        o_ok = o_ok & (offs_dv < DV)[None, :]
    tl.store(out_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=o_ok)


# -- the wrapper ----------------------------------------------------------------------------------

SHORT_PATH = os.environ.get("INGOT_CUDA_DECODE_SHORT", "1") == "1"
DECODE_MAX_ROWS = 64   # G * Tq up to this: the split-KV kernel; above: flash tiles
# the last split merges (no combine launch) when at most this many splits are launched: it walks the
# splits that saw keys one after another, which made decode attention 2-3x slower on the H200 with
# 30-90 busy splits (2026-12-02), while a short cache leaves a few busy and saves a launch per layer.
# INGOT_CUDA_DECODE_MERGE=1 / 0 forces it on / off.
MERGE_MAX_SPLITS = int(os.environ.get("INGOT_CUDA_DECODE_MERGE_SPLITS", "32"))
# the most decode splits launched per KV head where they merge in the kernel (a buffer of at most
# MERGE_MAX_SPLITS key tiles). Every split is a program, and those past the runtime length exit at once,
# but are launched all the same; the last split's merge loops over the active ones. H200, SmolLM2's
# buffer of 2048 rows (32 tiles), twelfth session: the step 514.1 us with 8 against 518.6 with 32 (same
# call; 4: 514.1, 16: 514.5); its attention with RoPE at 1000 keys 9.0 us against 9.55 (4: 10.81).
DECODE_MERGE_SPLITS = int(os.environ.get("INGOT_CUDA_DECODE_MERGE_CAP", "8"))
MERGE_IN_KERNEL = {"1": True, "0": False}.get(os.environ.get("INGOT_CUDA_DECODE_MERGE", ""))
# float32 decode dots: "tf32x3p" (the default: tensor cores, three tf32 passes as independent dots,
# float32-level results, `_dot`), "tf32x3" (Triton's, the passes chained through one accumulator, as
# the prefill kernel and the tensor-core quantized matmul use) or "ieee" (FMA units through shared
# memory: 2920 instructions a 64-key tile at d 128 in ptxas against 1556). H200, 2026-12-03, a step
# replayed: tf32x3 against ieee, SmolLM2 764 us against 826, Llama-3-8B 2114 against 2271; tf32x3p
# against tf32x3 (twelfth session), SmolLM2's attention with RoPE 4.67 / 5.77 / 6.00 us against
# 4.77 / 5.84 / 6.05 at 33 / 100 / 160 keys (677 instructions a tile against 915), the step 523.3 us
# against 527.1.
DECODE_F32_PRECISION = os.environ.get("INGOT_CUDA_DECODE_PRECISION", "tf32x3p")
# a short cache's split size (`_decode_min_chunk`'s K+V bytes) and the keys per tile (0: 64, 32 past d 128):
# smaller ones spread a short cache over more programs, each with less to read one after another
DECODE_CHUNK_KB = int(os.environ.get("INGOT_CUDA_DECODE_CHUNK_KB", "32"))
DECODE_BLOCK_N = int(os.environ.get("INGOT_CUDA_DECODE_BLOCK_N", "0"))
# a split's keys a multiple of this (0: the key tile)
DECODE_CHUNK_ALIGN = int(os.environ.get("INGOT_CUDA_DECODE_CHUNK_ALIGN", "0"))
# `attention(early=True)` honoured (INGOT_CUDA_DECODE_EARLY=0: ignored, for measuring): with RoPE and the
# KV write inside the decode kernel, the length, the position and the RoPE table (and with FRESH the first
# K/V tile) are read before the kernel's wait, while the kernel ahead (the qkv GEMV) still runs. H200,
# 2026-12-03, steps replayed in one call: SmolLM2 int4 495.8-496.5 us against 551.0 without; Llama-3-8B
# int4 1916.1 against 1999.1 (0.619 of copy against 0.593).
# the Hopper prefill kernel (`flash_sm90`: softmax overlapped with the tensor cores) where it applies
# ("auto": for at least PREFILL_GLUON_ROWS query rows; "1" always, "0" never). H200, causal bf16 d 128, 32
# heads, TFLOP/s of the Hopper kernel against the Triton kernel in one run (`cuda_kernels.py --only prefill`,
# sixteenth session): 8192 rows 543.8 against 422.5, 4096 507.2 / 413.5, 2048 450.7 / 378.2, 1024 297.4 /
# 308.1 (torch SDPA 546.7, 487.1, 405.1, 272.6). Not causal, 16 heads x 4096 rows: 591.2 / 481.4 (torch
# 631.1). Head dim 64 loses (2 x 32 heads, 4096 rows causal: 384.7 against 405.3), so "auto" takes d 128 only
PREFILL_GLUON = os.environ.get("INGOT_CUDA_PREFILL_GLUON", "auto")
PREFILL_GLUON_ROWS = int(os.environ.get("INGOT_CUDA_PREFILL_GLUON_ROWS", "2048"))
DECODE_EARLY = os.environ.get("INGOT_CUDA_DECODE_EARLY", "1") == "1"
# with early loads: the new token's key and value used from registers (`attention(fresh=)`), so the
# first tile's loads go out before the wait too, where that K+V tile takes at most FRESH_TILE_BYTES (it
# is held in registers through the rotation; ptxas for sm_90a, 4 warps: SmolLM2's f32 d 64 tile of 64
# keys 246 registers against 158, a 16-bit d 128 tile 241 against 85, f32 d 128 (64 KB) spills 856
# bytes). H200 (`cuda_decode_probe.py`, SmolLM2's attention as the step runs it, 33 / 100 / 160 / 1000
# keys): 4.19 / 5.40 / 5.66 / 8.89 us against 4.31 / 5.51 / 5.77 / 8.92 re-reading the new row, but
# without early loads slower (5.61 / 6.78 / 7.05 / 10.48 against 4.96 / 6.32 / 6.51 / 9.63): the peeled
# tile costs more than the barrier it saves. The steps replayed were the same (495.8 against 495.9-496.5 us).
DECODE_FRESH = os.environ.get("INGOT_CUDA_DECODE_FRESH", "1") == "1"
FRESH_TILE_BYTES = int(os.environ.get("INGOT_CUDA_DECODE_FRESH_BYTES", 32 << 10))
# the decode kernel's warps; 0 (the default): 8 with RoPE where the K + V tile is too big for FRESH (float32
# d 128: Llama-3-8B's caches), else 4. H200, Llama-3-8B int4 step replayed in one call: 1794.0 us against
# 1817.4 at 4 warps; with FRESH forced at 8 warps (144-280 bytes spilled) 1905.3
DECODE_WARPS = int(os.environ.get("INGOT_CUDA_DECODE_WARPS", "0"))
# Measured and removed (H200, 2026-12-04): the new k and v rows loaded with q (one round trip after the
# wait instead of three in ptxas's schedule), Llama-3-8B's step 1796.5 us against 1797.6, the launch alone
# at 33 keys 5.38 against 5.52 (cuda_decode_probe.py --shape 32,8,128); K and V tiles loaded together
# through an opaque copy (205 registers against 174), 1798.0 against 1797.6. Both together 1796.5.


@dataclass
class RopeWrite:
    """What `attention(..., rope=)` rotates and writes: the 0-d integer position (on the device), RoPE's
    inverse frequencies [HALF] (float32; rotary dims 2 * HALF <= D), the new token's k and v rows
    [..., Hk, T, D] (written into the caches at position + t), the pairing (interleaved or halves) and
    the cos/sin table of every cache position (`rope_table`, float32 [rows, HALF] each)."""
    pos: torch.Tensor
    inv_freq: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    interleaved: bool
    cos_sin: tuple[torch.Tensor, torch.Tensor]


@dataclass
class XQTarget:
    """Where `attention(..., xq=)` stores its output rounded as `quantized_matmul._quantize_x` would for
    the word GEMV reading it as x [B, Hq * Dv]: limb words xq [B, KB * 8 * limbs] (int32), block scales
    xd and sums xs [B, KB] (float32), KB = Hq * Dv / 32; `zero`: float32 zeroed by the same launch
    (the GEMV's split-K output). `written` is set when the kernel did it (else the caller quantizes)."""
    xq: torch.Tensor
    xd: torch.Tensor
    xs: torch.Tensor
    limbs: int
    zero: torch.Tensor | None = None
    written: bool = False


def rope_table(inv_freq: np.ndarray, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, HALF] (float32) of positions 0..rows-1, float64 angles as the CPU backend and
    `fused._rope_row` compute them: `RopeWrite.cos_sin`, read by the decode kernel instead of computing them."""
    cos, sin = rope_cos_sin(np.arange(rows), np.asarray(inv_freq))
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def _qmm_workspace(device, floats, tickets):
    from .quantized_matmul import _workspace
    return _workspace(device, floats, tickets)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _decode_min_chunk(d: int, dv: int, element_size: int, kv_bytes: int = 32 << 10) -> int:
    """Fewest keys per decode split: about `kv_bytes` of K+V per split and KV head (f32 d 64: 64 keys,
    16-bit d 128: 64; f32 d 128: 32, one BLOCK_N tile of 64 in practice), so a short cache is read by
    one split, which writes the output. One program is slow over many keys (H200, SmolLM2's 9/3
    heads d 64 f32: 64 keys per split 7.3 us at 100 keys and 7.6 at 160, 128 per split 9.3 and 10.7;
    one split at 64 keys 5.7 us against 7.0 for the old kernel)."""
    return max(16, kv_bytes // max((d + dv) * element_size, 1))


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int | torch.Tensor | None = None,
              scale: float | None = None, causal: bool = False, mask: torch.Tensor | None = None,
              out: torch.Tensor | None = None, split: int | None = None, precision: str | None = None,
              block_n: int | None = None, num_warps: int | None = None, block_m: int | None = None,
              num_stages: int | None = None, merge: bool | None = None, split_stages: bool = True,
              heavy_first: bool = True, heads_on_axis0: bool = True, tma: bool = False,
              short_path: bool | None = None, min_chunk: int | None = None, early_v: bool | None = None,
              rope: RopeWrite | None = None, xq: XQTarget | None = None,
              zero: torch.Tensor | None = None, length_offset: int = 0, fresh: bool | None = None,
              early: bool = False, chunk_align: int | None = None, gluon: bool | dict | None = None) -> torch.Tensor:
    """softmax(q k^T * scale (+ mask), causal) v over the first `length` (+ `length_offset`) keys; GQA by
    head groups.

    q [..., Hq, Tq, D], k [..., Hk, Tk, D], v [..., Hk, Tk, Dv]; length an int or a 0-d integer
    device tensor (read by the kernel: no host sync; the decode kernels add `length_offset` to it
    themselves, so a decode step passes its position and 1, with no launch to add them); mask bool
    or additive, broadcast to the scores.
    Prefill variants (the flash kernel): `split_stages` runs the key tiles below the causal diagonal
    unmasked, `heavy_first` starts the causal query blocks with the most keys first,
    `heads_on_axis0` puts the heads on grid axis 0 (the first wave: the heaviest block of every head;
    H200, causal bf16 T 4096: 421 TFLOP/s against 405 with the blocks on axis 0), `tma` loads Q/K/V
    through tensor descriptors (16-bit inputs with 16-byte aligned rows; otherwise the pointer loads).
    `gluon` (None: PREFILL_GLUON, by default head dim 128 from PREFILL_GLUON_ROWS query rows) runs the
    Hopper kernel of `flash_sm90` where it applies (16-bit, head dim 64 or 128, no mask, sm_90): the
    softmax of a key tile overlaps the tensor cores' P V product of the tile before; a dict passes
    `flash_sm90`'s options (block_n, stages, maxnreg).
    Decode variants (the split-KV kernel): `short_path` runs only the splits that see keys, and with
    one such split writes the output from it (no partials, ticket or merge); `min_chunk` is the
    fewest keys per split (None: about 32 KB of K+V, e.g. 64 keys at f32 d 64; 0 or 1: no minimum);
    `early_v` loads each V tile with its K tile (None: as `short_path`); `chunk_align`: a split's keys
    are a multiple of it (None: INGOT_CUDA_DECODE_CHUNK_ALIGN, else the key tile). short_path None: on unless
    INGOT_CUDA_DECODE_SHORT=0 (for measuring a whole model without it). `short_path=False` with the
    other two left None is the kernel as it was before these switches.

    `rope`: q is RoPE's input, rotated here, and the new token's k and v (`RopeWrite`) are written into
    the caches k and v at its position first: in the decode kernel itself when there is one query row
    (no launch for them), else by `fused.rope_qkv_into` ahead of the attention. There `fresh` (None:
    with `early`, where the first K+V tile is at most FRESH_TILE_BYTES) takes the new key and value from
    registers instead of reading them back, so the cache loads do not wait for the write. `early` (with
    `rope`, on a device with programmatic dependent launch): the length, the position, the caches'
    first key tile and the RoPE table are read while the kernel ahead on the stream still runs; only
    for a caller that knows that kernel writes none of them (the executor's decode step: the caches
    are written by this launch alone).

    `xq`: the output is also stored rounded for the word GEMV that reads it next (`XQTarget`), where the
    decode kernel writes each head's output itself (one query row, no combine launch); `xq.written`
    says whether it did; `xq.zero` is zeroed only where it did. `zero` (float32, contiguous, apart from
    every operand): zero when this returns, whatever `xq` got, the split-K output of the GEMV after the
    attention; the decode kernel zeroes it in its own launch (no memset between the two), other paths
    by a memset.
    """
    assert zero is None or xq is None or xq.zero is None, "attention: zero= or xq.zero, not both"
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if rope is not None and not (mask is None and q.shape[-2] == 1 and q.shape[-3] // k.shape[-3] <= DECODE_MAX_ROWS
                                 and k.shape[:-3] == v.shape[:-3] == batch and q.shape[-1] == k.shape[-1]):
        from .fused import rope_qkv_into
        q = rope_qkv_into(q, rope.k, rope.v, rope.pos, rope.inv_freq, k, v, rope.interleaved)
        rope = None
    short_path = SHORT_PATH if short_path is None else short_path
    hq, tq, d = q.shape[-3:]
    hk, tbuf, _ = k.shape[-3:]
    dv = v.shape[-1]
    assert hq % hk == 0 and k.shape[-1] == d and v.shape[-2] == tbuf, "attention: q/k/v shapes do not fit"
    group = hq // hk
    nb = math.prod(batch)

    def four(x):
        x = x.expand(*batch, *x.shape[-3:]).reshape(nb, *x.shape[-3:])
        return _last_contiguous(x)

    q4, k4, v4 = four(q), four(k), four(v)
    result = out if out is not None else torch.empty((*batch, hq, tq, dv), dtype=q.dtype, device=q.device)
    o4 = result.view(nb, hq, tq, dv)
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    if isinstance(length, torch.Tensor):
        len_ptr, len_const, from_ptr = length, 0, True
        if length_offset and not (mask is None and group * tq <= DECODE_MAX_ROWS):   # the flash kernel: added here
            len_ptr, length_offset = length + length_offset, 0
    else:
        length = tbuf if length is None else int(length) + length_offset
        len_ptr, len_const, from_ptr, length_offset = q4, min(max(length, 0), tbuf), False, 0
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(dv))
    f32 = q.dtype == torch.float32
    if (nb == 0 or tq == 0 or mask is not None or group * tq > DECODE_MAX_ROWS) and zero is not None:
        zero.zero_()
        zero = None
    if nb == 0 or tq == 0:
        return result
    if mask is None and group * tq <= DECODE_MAX_ROWS:
        block_r = max(16, triton.next_power_of_2(group * tq))
        bn = block_n or DECODE_BLOCK_N or (64 if block_d <= 128 else 32)
        align = chunk_align or DECODE_CHUNK_ALIGN or bn
        if min_chunk is None:
            min_chunk = _decode_min_chunk(d, dv, k.element_size(), DECODE_CHUNK_KB << 10) if short_path else 0
        merge_split = split   # the merge rule below sees the split count chosen before the min_chunk cap
        if split is None:
            split = merge_split = max(1, min(triton.cdiv(tbuf, bn), (2 * _sm_count(q.device)) // max(nb * hk, 1), 128))
            if split <= MERGE_MAX_SPLITS:   # merged in the kernel: fewer, longer splits
                split = merge_split = min(split, DECODE_MERGE_SPLITS)
            # splits past the whole buffer's last chunk never see keys: at 32k keys of 64-key tiles 33 splits
            # have chunks of 1024, so 32 (H200, 2026-12-03, Llama-shape bf16: 39.4 us against 41.1 in one
            # call, the combine kernel over 32 splits instead of 33)
            chunk = triton.cdiv(max(triton.cdiv(tbuf, split), min_chunk if short_path else 0), align) * align
            split = triton.cdiv(tbuf, chunk)
        if num_stages is None and triton.cdiv(max(triton.cdiv(tbuf, split), min_chunk), bn) <= 1:
            num_stages = 1   # one key tile a split at most: no pipelined loads to set up (H200, SmolLM2's
            # 9/3 heads f32 with RoPE and the rounded output: 5.04 us against 5.51 at 33 keys, 6.18 / 6.68 at 100)
        o_part = torch.empty((nb * hk * split * block_r, block_dv), dtype=torch.float32, device=q.device)
        ml_part = torch.empty((nb * hk * split * block_r, 2), dtype=torch.float32, device=q.device)
        if merge is None:
            merge = MERGE_IN_KERNEL if MERGE_IN_KERNEL is not None else merge_split <= MERGE_MAX_SPLITS
        tickets = _qmm_workspace(q.device, 0, nb * hk)[1] if merge else ml_part
        extra = {}
        tile_bytes = bn * (block_d + block_dv) * k.element_size()   # one K + V tile
        warps = num_warps or DECODE_WARPS or (8 if rope is not None and tile_bytes > FRESH_TILE_BYTES else 4)
        if rope is not None:
            kn4, vn4 = four(rope.k), four(rope.v)
            assert kn4.shape[1:] == (hk, 1, d) and vn4.shape[1:] == (hk, 1, dv), "attention: rope's k/v rows [..., Hk, 1, D]"
            extra.update(pos_ptr=rope.pos, inv_ptr=rope.inv_freq, kn_ptr=kn4, vn_ptr=vn4, HALF=rope.inv_freq.shape[0],
                         skn_b=kn4.stride(0), skn_h=kn4.stride(1), svn_b=vn4.stride(0), svn_h=vn4.stride(1), ROPE=True,
                         INTERLEAVED=rope.interleaved)
            cos, sin = rope.cos_sin
            assert cos.shape == sin.shape and cos.shape[1] == rope.inv_freq.shape[0] and cos.dtype == torch.float32
            extra.update(cos_ptr=cos, sin_ptr=sin, TABLE_ROWS=cos.shape[0], EARLY=early and DECODE_EARLY)
            if fresh is None:   # with early loads; the first tile held in registers through the rotation
                fresh = DECODE_FRESH and extra["EARLY"] and tile_bytes <= FRESH_TILE_BYTES
            extra.update(FRESH=fresh)
        early_v = short_path if early_v is None else early_v
        # every output is written by the decode kernel itself (no combine launch): it can round it for the GEMV
        xq_here = xq is not None and merge and tq == 1 and dv == block_dv and dv % 32 == 0 and xq.limbs in (1, 2)
        if xq_here:
            assert xq.xq.shape == (nb, hq * dv // 32 * 8 * xq.limbs) and xq.xd.shape == xq.xs.shape == (nb, hq * dv // 32)
            extra.update(xq_ptr=xq.xq, xd_ptr=xq.xd, xs_ptr=xq.xs, stride_xqm=xq.xq.stride(0), stride_xdm=xq.xd.stride(0),
                         XQ_LIMBS=xq.limbs)
            zero = xq.zero if xq.zero is not None else zero
        if zero is not None:
            assert zero.dtype == torch.float32 and zero.is_contiguous()
            extra.update(z_ptr=zero, Z=zero.numel(), ZERO=True)
        _decode_kernel[(nb * hk, split)](
            q4, k4, v4, len_ptr, o_part, ml_part, o4, tickets, len_const, hk, group, tq, tbuf, d, dv, qk_scale,
            q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
            v4.stride(0), v4.stride(1), v4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2),
            LEN_FROM_PTR=from_ptr, CAUSAL=causal, SPLIT=split, BLOCK_R=block_r, BLOCK_N=bn,
            BLOCK_D=block_d, BLOCK_DV=block_dv, PRECISION=precision or (DECODE_F32_PRECISION if f32 else "tf32"), MERGE=merge,
            SHORT_PATH=short_path, MIN_CHUNK=max(min_chunk, 0), EARLY_V=early_v,
            len_add=length_offset, CHUNK_ALIGN=align, num_warps=warps, **({"num_stages": num_stages} if num_stages else {}), **extra,
            **pdl_args(q.device), **timeline.args(f"attention {hk}x{group} d{d}", nb * hk * split, q.device))
        if xq_here:
            xq.written = True
        if merge:
            return result
        _combine_kernel[(nb * hk, group * tq)](
            o_part, ml_part, o4, len_ptr, len_const, hk, group, tq, tbuf, dv, o4.stride(0), o4.stride(1), o4.stride(2),
            SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), CHUNK=min(16, triton.next_power_of_2(split)),
            BLOCK_R=block_r, BLOCK_DV=block_dv, LEN_FROM_PTR=from_ptr, BLOCK_N=align, SHORT_PATH=short_path,
            MIN_CHUNK=max(min_chunk, 0), len_add=length_offset, num_warps=4, **pdl_args(q.device))
        return result
    mask4 = q4  # unused pointer
    strides = (0, 0, 0, 0)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
        mask = mask.to(torch.float32)
        while mask.dim() < len(batch) + 3:
            mask = mask.unsqueeze(0)
        mask4 = mask.expand(*batch, hq, tq, mask.shape[-1]).reshape(nb, hq, tq, mask.shape[-1])
        strides = (mask4.stride(0), mask4.stride(1), mask4.stride(2), mask4.stride(3) if mask.shape[-1] != 1 else 0)
    if gluon is None:
        gluon = PREFILL_GLUON == "1" or (PREFILL_GLUON == "auto" and tq >= PREFILL_GLUON_ROWS and d == 128)
    if gluon and mask is None and not f32:
        from . import flash_sm90
        if flash_sm90.supported(q4, k4, v4, mask, qk_scale):
            _ensure_allocator(q.device)
            flash_sm90.flash_sm90(q4, k4, v4, o4, len_ptr, len_const, from_ptr, group, qk_scale, causal,
                                  **(gluon if isinstance(gluon, dict) else {}))
            return result
    block_m, bn, warps, stages = _flash_config(f32, max(block_d, block_dv), block_m, block_n, num_warps, num_stages)
    use_tma = tma and _tma_ok(q4, k4, v4)
    if use_tma:
        _ensure_allocator(q.device)
    num_m = triton.cdiv(tq, block_m)
    grid = (nb * hq, num_m) if heads_on_axis0 else (num_m, nb * hq)
    _flash_kernel[grid](
        q4, k4, v4, len_ptr, mask4, o4, len_const, hq, group, tq, tbuf, d, dv, qk_scale,
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2), *strides,
        LEN_FROM_PTR=from_ptr, CAUSAL=causal, HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_D=block_d, BLOCK_DV=block_dv, PRECISION=precision or ("tf32x3" if f32 else "tf32"),
        SPLIT_STAGES=split_stages, HEAVY_FIRST=heavy_first, HEADS_ON_AXIS0=heads_on_axis0, USE_TMA=use_tma,
        EVEN_D=d == block_d and dv == block_dv, SCALE_NONNEG=qk_scale >= 0,
        num_warps=warps, num_stages=stages, **pdl_args(q.device))
    return result


def _flash_config(f32: bool, block_d: int, block_m: int | None, block_n: int | None, num_warps: int | None,
                  num_stages: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the flash kernel; the arguments given win. 16-bit d <= 128
    (Hopper): two warpgroups of 64 query rows each. f32 (tf32x3: three dots and the split operands
    in registers) and d > 128: tiles that ptxas (sm_90a) compiles without spills (d 128 f32: 32x16;
    64x64 spilled ~370 bytes; d 256 f32 16x16 still spills ~100)."""
    if f32:
        bm, bn, warps, stages = {64: (64, 32, 4, 2), 128: (32, 16, 4, 2)}.get(max(block_d, 64), (16, 16, 4, 2))
    elif block_d > 128:
        bm, bn, warps, stages = 32, 64, 4, 3
    else:
        bm, bn, warps, stages = 128, 64, 8, 3
    block_m = block_m or bm
    return block_m, block_n or bn, num_warps or (warps if block_m == bm else 4 if block_m <= 64 else 8), num_stages or stages


def _tma_ok(*xs: torch.Tensor) -> bool:
    """Tensor descriptors need 16-bit elements here, and 16-byte aligned bases and row strides."""
    for x in xs:
        size = x.element_size()
        if size != 2 or x.data_ptr() % 16 or any(s * size % 16 for s in x.stride()[:-1]):
            return False
    return True


def _ensure_allocator(device: torch.device) -> None:
    """On-device tensor descriptors need a scratch allocator; set a torch one unless the caller set one
    (torch.empty on the current device, so it also serves a CUDA graph capture)."""
    from triton.runtime import _allocation
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device.type))
