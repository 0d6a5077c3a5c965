"""The CUDA lowering of pool_attention (ops/pool.py): one decode step of R independent sequences over
a KV pool, every row with its own pool entry (slot) and length, in two Triton launches per layer.

- `_pool_write_kernel`, one program per (row, KV head): the row's new k and v written at its position
  of its entry, rounded to the pool's dtype (bf16/f16 pools hold many sequences).
- `_pool_decode_kernel`, one program per (row, KV head, split of the keys): the Hq/Hk query heads of
  the group share every K/V tile load (a tile widened to float32 in registers, as the decode kernel
  of attention/decode.py does), online softmax in log2 units; with one split it writes the output,
  else `_pool_combine_kernel` merges the splits' partial softmaxes.

Slots and positions are device tensors read by the kernels, the split count depends only on shapes,
and the workspaces come from the plan's stream: a captured CUDA graph replays any slot combination.
Registered by importing this module (backends/cuda/__init__.py).

    >>> out = pool_attention(q, k, v, k_pool, v_pool, slots, positions)   # doctest: +SKIP
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...ir import Op
from ...options import DEFAULT_CUDA, CudaOptions
from .attention.decode import _dot, _merge_part, _sm_count, quantize_row
from .lowerings import Lowering, StepFn, lowering

LOG2E = 1.4426950408889634
MAX_SPLIT = 32


@triton.jit
def _pool_write_row(x_ptr, pool_ptr, scale_ptr, WIDTH, BLOCK_W: tl.constexpr, CODES: tl.constexpr):
    """One new row into its place: rounded to the pool's dtype, or (CODES) an int8 pool's codes and row scale."""
    offs = tl.arange(0, BLOCK_W)
    x = tl.load(x_ptr + offs, mask=offs < WIDTH, other=0.0)
    if CODES:
        codes, row_scale = quantize_row(x.to(tl.float32), offs < WIDTH)
        tl.store(pool_ptr + offs, codes, mask=offs < WIDTH)
        tl.store(scale_ptr, row_scale)
    else:
        tl.store(pool_ptr + offs, x.to(pool_ptr.dtype.element_ty), mask=offs < WIDTH)


@triton.jit
def _pool_write_kernel(k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, pos_ptr, S, C, D, DV,
                       sk_r, sk_h, sv_r, sv_h, skp_s, skp_h, skp_c, svp_s, svp_h, svp_c,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ksp_ptr=None, vsp_ptr=None,
                       sksp_s=0, sksp_h=0, sksp_c=0, svsp_s=0, svsp_h=0, svsp_c=0, CODES: tl.constexpr = False):
    """pool[slots[r], h, positions[r], :] = new row r's k / v (rows outside the pool write nothing); CODES:
    int8 pools, each row's codes and scale (ksp/vsp [S, Hk, C, 1]) as ops.nn.quantized_rows makes them."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + r)
    pos = tl.load(pos_ptr + r)
    if (slot >= 0) & (slot < S) & (pos >= 0) & (pos < C):
        slot64 = slot.to(tl.int64)
        _pool_write_row(k_ptr + r * sk_r + h * sk_h, kp_ptr + slot64 * skp_s + h * skp_h + pos * skp_c,
                        ksp_ptr + slot64 * sksp_s + h * sksp_h + pos * sksp_c, D, BLOCK_D, CODES)
        _pool_write_row(v_ptr + r * sv_r + h * sv_h, vp_ptr + slot64 * svp_s + h * svp_h + pos * svp_c,
                        vsp_ptr + slot64 * svsp_s + h * svsp_h + pos * svsp_c, DV, BLOCK_DV, CODES)


@triton.jit
def _pool_decode_kernel(q_ptr, kp_ptr, vp_ptr, slot_ptr, pos_ptr, out_ptr, o_part_ptr, ml_part_ptr,
                        S, C, HK, G, D, DV, scale, softcap, window,
                        sq_r, sq_h, skp_s, skp_h, skp_c, svp_s, svp_h, svp_c, so_r, so_h,
                        SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                        PRECISION: tl.constexpr, ksp_ptr=None, vsp_ptr=None, sksp_s=0, sksp_h=0, sksp_c=0,
                        svsp_s=0, svsp_h=0, svsp_c=0, CODES: tl.constexpr = False):
    """Row r's G query heads of KV head hk over the keys of split sp of its entry's first positions[r] + 1
    (the last `window` of them with WINDOW), scores scale * q.k (softcap * tanh(s / softcap) with SOFTCAP).
    CODES: int8 pools; each key's dot product and each value's weight times its row's scale."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    r = pid // HK
    hk = pid % HK
    slot = tl.load(slot_ptr + r)
    pos = tl.load(pos_ptr + r)
    ok = (slot >= 0) & (slot < S) & (pos >= 0) & (pos < C)
    length = tl.where(ok, pos + 1, 0)
    first = 0
    if WINDOW:
        first = tl.maximum(length - window, 0)
    chunk = ((length - first + SPLIT - 1) // SPLIT + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = first + sp * chunk
    end = tl.minimum(start + chunk, length)
    heads = tl.arange(0, BLOCK_G)
    h_ok = heads < G
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + r * sq_r + (hk * G + heads)[:, None] * sq_h + offs_d[None, :],
                mask=h_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    slot64 = tl.where(ok, slot, 0).to(tl.int64)
    k_base = kp_ptr + slot64 * skp_s + hk * skp_h
    v_base = vp_ptr + slot64 * svp_s + hk * svp_h
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kt = tl.load(k_base + offs_n[:, None] * skp_c + offs_d[None, :], mask=n_ok[:, None] & (offs_d < D)[None, :],
                     other=0.0).to(tl.float32)
        vt = tl.load(v_base + offs_n[:, None] * svp_c + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                     other=0.0).to(tl.float32)
        if CODES:
            ks = tl.load(ksp_ptr + slot64 * sksp_s + hk * sksp_h + offs_n * sksp_c, mask=n_ok, other=0.0)
            s = _dot(q, tl.trans(kt), PRECISION, True) * (ks * scale)[None, :]   # [G, N]
        else:
            s = _dot(q, tl.trans(kt), PRECISION) * scale                   # [G, N]
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
        s = tl.where(n_ok[None, :], s * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if CODES:
            p = p * tl.load(vsp_ptr + slot64 * svsp_s + hk * svsp_h + offs_n * svsp_c, mask=n_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + _dot(p, vt, PRECISION, CODES)   # (codes: exact in tf32)
        m_i = m_new
    if SPLIT == 1:
        o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + r * so_r + (hk * G + heads)[:, None] * so_h + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & (offs_dv < DV)[None, :])
    else:
        part = (pid * SPLIT + sp) * BLOCK_G + heads
        tl.store(o_part_ptr + part[:, None] * BLOCK_DV + offs_dv[None, :], acc)
        tl.store(ml_part_ptr + part * 2, m_i)
        tl.store(ml_part_ptr + part * 2 + 1, l_i)


@triton.jit
def _pool_combine_kernel(o_part_ptr, ml_part_ptr, out_ptr, HK, G, DV, so_r, so_h,
                         SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Merge the SPLIT partial softmaxes of one (row, KV head): weights exp2(m_s - max); a split that saw
    no key holds m -inf, l 0 and adds nothing; a row that saw none is zeros."""
    pid = tl.program_id(0)
    r = pid // HK
    hk = pid % HK
    heads = tl.arange(0, BLOCK_G)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_G], tl.float32)
    o_all = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for sp in range(0, SPLIT):
        part = (pid * SPLIT + sp) * BLOCK_G + heads
        m_s = tl.load(ml_part_ptr + part * 2)
        l_s = tl.load(ml_part_ptr + part * 2 + 1)
        o_s = tl.load(o_part_ptr + part[:, None] * BLOCK_DV + offs_dv[None, :])
        m_all, l_all, o_all = _merge_part(m_all, l_all, o_all, m_s, l_s, o_s)
    o = tl.where(l_all[:, None] > 0, o_all / tl.where(l_all > 0, l_all, 1.0)[:, None], 0.0)
    tl.store(out_ptr + r * so_r + (hk * G + heads)[:, None] * so_h + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(heads < G)[:, None] & (offs_dv < DV)[None, :])


def pool_split(rows: int, kv_heads: int, context: int, device, block_n: int = 64) -> int:
    """Splits of the keys per (row, KV head): about two programs per SM over all of them, at most one
    per key tile of the context and MAX_SPLIT (H200, 132 SMs: 32 rows x 8 KV heads -> 2; 1 row -> 32)."""
    return max(1, min(triton.cdiv(2 * _sm_count(device), max(rows * kv_heads, 1)), triton.cdiv(context, block_n),
                      MAX_SPLIT))


def pool_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, scale: float | None = None, window: int = 0,
                   softcap: float = 0.0, split: int | None = None, block_n: int = 64, out: torch.Tensor | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   options: CudaOptions = DEFAULT_CUDA) -> torch.Tensor:
    """ops/pool.py's pool_attention with the pools written in place: q [R, Hq, D], k [R, Hk, D],
    v [R, Hk, Dv], k_pool [S, Hk, C, D], v_pool [S, Hk, C, Dv] (float32, bfloat16 or float16; or int8
    with `scales`, their row scales [S, Hk, C, 1] float32, written in place too), slots and
    positions int32 [R] on the device -> out [R, Hq, Dv] (q's dtype)."""
    rows, hq, d = q.shape
    hk, dv = k.shape[1], v.shape[2]
    n_slots, _, context, _ = k_pool.shape
    assert k.shape == (rows, hk, d) and v.shape[:2] == (rows, hk) and k_pool.shape[1:] == (hk, context, d) \
        and v_pool.shape == (n_slots, hk, context, dv) and hq % hk == 0, "pool_attention: shapes do not fit"
    assert slots.shape == positions.shape == (rows,) and slots.dtype == positions.dtype == torch.int32
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1, "pool_attention: pools with unit last stride"
    out = out if out is not None else torch.empty((rows, hq, dv), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    codes = dict(ksp_ptr=k_pool, vsp_ptr=v_pool)   # (stand-ins the write kernel never stores through)
    if scales is not None:
        ksp, vsp = scales
        assert k_pool.dtype == v_pool.dtype == torch.int8 and ksp.shape == (n_slots, hk, context, 1) and \
            vsp.shape == ksp.shape and ksp.dtype == vsp.dtype == torch.float32, "pool_attention: int8 pools' scales"
        codes = dict(ksp_ptr=ksp, vsp_ptr=vsp, sksp_s=ksp.stride(0), sksp_h=ksp.stride(1), sksp_c=ksp.stride(2),
                     svsp_s=vsp.stride(0), svsp_h=vsp.stride(1), svsp_c=vsp.stride(2), CODES=True)
    _pool_write_kernel[(rows, hk)](
        k, v, k_pool, v_pool, slots, positions, n_slots, context, d, dv, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1),
        v_pool.stride(2), BLOCK_D=block_d, BLOCK_DV=block_dv, **codes)
    group = hq // hk
    block_g = max(16, triton.next_power_of_2(group))
    split = split or pool_split(rows, hk, context if not window else min(context, window), q.device, block_n)
    if split > 1:
        o_part = torch.empty((rows * hk * split * block_g, block_dv), dtype=torch.float32, device=q.device)
        ml_part = torch.empty((rows * hk * split * block_g, 2), dtype=torch.float32, device=q.device)
    else:
        o_part = ml_part = out
    precision = options.decode_precision if q.dtype == torch.float32 else "tf32"
    _pool_decode_kernel[(rows * hk, split)](
        q, k_pool, v_pool, slots, positions, out, o_part, ml_part, n_slots, context, hk, group, d, dv,
        float(scale if scale is not None else 1.0 / math.sqrt(d)), float(softcap or 1.0), int(window),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0),
        v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
        SPLIT=split, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, SOFTCAP=bool(softcap),
        WINDOW=bool(window), PRECISION=precision, num_warps=4, **codes)
    if split > 1:
        _pool_combine_kernel[(rows * hk,)](o_part, ml_part, out, hk, group, dv, out.stride(0), out.stride(1),
                                           SPLIT=split, BLOCK_G=block_g, BLOCK_DV=block_dv, num_warps=4)
    return out


@lowering(Op.POOL_ATTENTION)
def _pool_attention(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    scale, window, softcap, inplace = a.get("scale"), int(a.get("window", 0)), float(a.get("softcap", 0.0)), \
        bool(a.get("inplace"))
    options = ctx.cuda
    ctx.plan.fusions.append("pool write + rows decode attention")

    def step(q, k, v, k_pool, v_pool, slots, positions, *scales):
        pools = (k_pool, v_pool) + scales   # an int8 pool's row scales after the pools
        if not inplace:   # copy semantics: a variable something else reads keeps its value
            pools = tuple(x.clone() for x in pools)
        out = pool_attention(q, k, v, pools[0], pools[1], slots, positions, scale=scale, window=window, softcap=softcap,
                             scales=pools[2:] or None, options=options)
        return (out, *pools)
    return step
