"""The prefill attention: many query rows, FlashAttention-2 tiles (`_flash_kernel`), or the Hopper
kernel of flash_sm90.py where it applies."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....options import DEFAULT_CUDA, CudaOptions
from ..pdl import pdl_args, pdl_enter


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
                USE_TMA: tl.constexpr, PRECISION: tl.constexpr, ks_base=None, vs_base=None, sks_t=0, svs_t=0,
                CODES: tl.constexpr = False):
    """The online softmax over key tiles start, start + BLOCK_N, .. < stop (log2 units).

    CODES: K and V are an int8 cache's codes (exact in any float dtype), ks/vs_base their rows' scales:
    each key's score and each value's weight multiplied by its row's scale, tile by tile.

    MASKED=False: every row of the block sees every key of every tile (tiles below the causal
    diagonal, inside the length, no mask): no score masking, no bounds on the key rows, and no
    guard against an all -inf row (each tile gives every row a finite maximum).
    MASKED=True: key bounds, the causal limit and the optional additive mask; a row may have seen
    no key yet, so the maximum is guarded (m_safe)."""
    for n0 in range(start, stop, BLOCK_N):
        kt = _flash_tile(k_base, k_desc, n0, sk_t, stop, D, BLOCK_N, BLOCK_D, MASKED, EVEN_D, USE_TMA)
        if PRECISION == "bf16":   # float32 keys rounded to bfloat16 in registers (q was, once)
            kt = kt.to(tl.bfloat16)
        elif PRECISION == "f16":  # or to float16
            kt = kt.to(tl.float16)
        else:                     # a 16-bit cache under float32 queries: widened, exactly
            kt = kt.to(q.dtype)
        qk = tl.dot(q, tl.trans(kt), input_precision=PRECISION if PRECISION != "bf16" and PRECISION != "f16" else None)
        if CODES:
            offs_c = n0 + tl.arange(0, BLOCK_N)
            ks = tl.load(ks_base + offs_c * sks_t, mask=offs_c < stop, other=0.0)
            vs = tl.load(vs_base + offs_c * svs_t, mask=offs_c < stop, other=0.0)
            qk = qk * ks[None, :]
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
        elif CODES:   # the rows' scales already in qk: no sign to fold
            s = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
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
        if CODES:
            p = p * vs[None, :]
        if PRECISION == "bf16":
            acc = tl.dot(p.to(tl.bfloat16), vt.to(tl.bfloat16), acc)
        elif PRECISION == "f16":
            acc = tl.dot(p.to(tl.float16), vt.to(tl.float16), acc)
        else:
            vt = vt.to(q.dtype)
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
                  EVEN_D: tl.constexpr = False, SCALE_NONNEG: tl.constexpr = True, PDL: tl.constexpr = False,
                  ks_ptr=None, vs_ptr=None, sks_b=0, sks_h=0, sks_t=0, svs_b=0, svs_h=0, svs_t=0,
                  CODES: tl.constexpr = False):
    """One BLOCK_M block of query rows of one (batch, query head) against the keys it may see.

    SPLIT_STAGES: the key tiles every row sees run unmasked, then the diagonal / tail tiles masked
    (a mask keeps all tiles masked). HEAVY_FIRST (causal): the blocks with the most keys start first
    so the short ones fill the last wave. HEADS_ON_AXIS0: grid (B*Hq, blocks) instead of (blocks, B*Hq).
    USE_TMA: Q/K/V tiles through on-device tensor descriptors (16-byte aligned rows; the wrapper checks).
    EVEN_D: D == BLOCK_D and DV == BLOCK_DV (no column masks). CODES: an int8 cache, its row scales
    ks/vs [B, Hk, TBUF, 1] (`_flash_keys`)."""
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
    if PRECISION == "bf16":
        q = q.to(tl.bfloat16)
    elif PRECISION == "f16":
        q = q.to(tl.float16)
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
    ks_base = ks_ptr + b * sks_b + hk * sks_h if CODES else ks_ptr
    vs_base = vs_ptr + b * svs_b + hk * svs_h if CODES else vs_ptr
    acc, l_i, m_i = _flash_keys(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, mask_base, qk_scale,
                                offs_m, m_ok, limit, 0, lo, D, DV, sk_t, sv_t, sm_t, sm_n,
                                False, CAUSAL, HAS_MASK, SCALE_NONNEG, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D,
                                USE_TMA, PRECISION, ks_base, vs_base, sks_t, svs_t, CODES)
    acc, l_i, m_i = _flash_keys(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, mask_base, qk_scale,
                                offs_m, m_ok, limit, lo, hi, D, DV, sk_t, sv_t, sm_t, sm_n,
                                True, CAUSAL, HAS_MASK, SCALE_NONNEG, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D,
                                USE_TMA, PRECISION, ks_base, vs_base, sks_t, svs_t, CODES)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ok = m_ok[:, None]
    if not EVEN_D:
        o_ok = o_ok & (offs_dv < DV)[None, :]
    tl.store(out_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=o_ok)


def _flash_config(f32: bool, block_d: int, block_m: int | None, block_n: int | None, num_warps: int | None,
                  num_stages: int | None, bf16_dots: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of the flash kernel; the arguments given win. 16-bit d <= 128
    (Hopper): two warpgroups of 64 query rows each. f32 (tf32x3: three dots and the split operands
    in registers) and d > 128: tiles that ptxas (sm_90a) compiles without spills (d 128 f32: 32x16;
    64x64 spilled ~370 bytes; d 256 f32 16x16 still spills ~100)."""
    if f32 and bf16_dots and block_d <= 128:   # float32 tiles loaded, bfloat16 dots: 16-bit tiles, two stages
        bm, bn, warps, stages = 64, 64, 4, 2
    elif f32:
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


# The Hopper prefill kernel (`flash_sm90`: softmax overlapped with the tensor cores), `CudaOptions.
# prefill_hopper` "auto": from prefill_hopper_min_rows (2048) query rows at head dim 128. H200, causal
# bf16 d 128, 32 heads, TFLOP/s of the Hopper kernel against the Triton kernel in one run
# (`cuda_kernels.py --only prefill`): 8192 rows 543.8 against 422.5, 4096 507.2 / 413.5, 2048 450.7 /
# 378.2, 1024 297.4 / 308.1 (torch SDPA 546.7, 487.1, 405.1, 272.6). Not causal, 16 heads x 4096 rows:
# 591.2 / 481.4 (torch 631.1). Head dim 64 loses (2 x 32 heads, 4096 rows causal: 384.7 against 405.3).


def prefill_attention(p, causal: bool, mask: torch.Tensor | None, precision: str | None, block_n: int | None,
            num_warps: int | None, block_m: int | None, num_stages: int | None, split_stages: bool,
            heavy_first: bool, heads_on_axis0: bool, tma: bool, gluon: bool | dict | None,
            options: CudaOptions = DEFAULT_CUDA) -> torch.Tensor:
    """The flash kernel (or the Hopper one) for `attention` (its arguments; p: the `Problem` it built)."""
    q4, k4, v4, o4, nb, hq, group, tq, tbuf, d, dv = p.q4, p.k4, p.v4, p.o4, p.nb, p.hq, p.group, p.tq, p.tbuf, p.d, p.dv
    block_d, block_dv, f32 = p.block_d, p.block_dv, p.f32
    mask4 = q4  # unused pointer
    strides = (0, 0, 0, 0)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
        mask = mask.to(torch.float32)
        while mask.dim() < len(p.batch) + 3:
            mask = mask.unsqueeze(0)
        mask4 = mask.expand(*p.batch, hq, tq, mask.shape[-1]).reshape(nb, hq, tq, mask.shape[-1])
        strides = (mask4.stride(0), mask4.stride(1), mask4.stride(2), mask4.stride(3) if mask.shape[-1] != 1 else 0)
    if gluon is None:
        gluon = options.prefill_hopper == "always" or (options.prefill_hopper == "auto" and d == 128
                                                       and tq >= options.prefill_hopper_min_rows)
    if precision is None:
        precision = options.prefill_precision if f32 else "tf32"
        if precision == "f16" and k4.dtype == torch.bfloat16:   # a bfloat16 cache keeps bf16 dots (its range)
            precision = "bf16"
    sixteen = precision in ("bf16", "f16")
    # float32 queries over a 16-bit cache with 16-bit dots: the Hopper kernel on a 16-bit copy of q (the
    # chunk's rows; the cache is read where it lies), its output widened into the float32 result
    widen = f32 and sixteen and k4.dtype == v4.dtype and k4.dtype in (torch.bfloat16, torch.float16)
    codes = {}
    if p.scales is not None:   # an int8 cache: the Triton kernel reads its codes and row scales
        ks4, vs4 = p.scales
        gluon, tma = False, False
        codes = dict(ks_ptr=ks4, vs_ptr=vs4, sks_b=ks4.stride(0), sks_h=ks4.stride(1), sks_t=ks4.stride(2),
                     svs_b=vs4.stride(0), svs_h=vs4.stride(1), svs_t=vs4.stride(2), CODES=True)
    if gluon and mask is None and (not f32 or widen):
        from .. import flash_sm90
        q16 = q4.to(k4.dtype) if widen else q4
        if flash_sm90.supported(q16, k4, v4, mask, p.qk_scale):
            _ensure_allocator(q4.device)
            o16 = torch.empty(o4.shape, dtype=k4.dtype, device=o4.device) if widen else o4
            flash_sm90.flash_sm90(q16, k4, v4, o16, p.len_ptr, p.len_const, p.from_ptr, group, p.qk_scale, causal,
                                  **(gluon if isinstance(gluon, dict) else {}))
            if widen:
                o4.copy_(o16)
            return p.result
    block_m, bn, warps, stages = _flash_config(f32, max(block_d, block_dv), block_m, block_n, num_warps, num_stages,
                                               sixteen)
    use_tma = tma and _tma_ok(q4, k4, v4)
    if use_tma:
        _ensure_allocator(q4.device)
    num_m = triton.cdiv(tq, block_m)
    grid = (nb * hq, num_m) if heads_on_axis0 else (num_m, nb * hq)
    _flash_kernel[grid](
        q4, k4, v4, p.len_ptr, mask4, o4, p.len_const, hq, group, tq, tbuf, d, dv, p.qk_scale,
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2), *strides,
        LEN_FROM_PTR=p.from_ptr, CAUSAL=causal, HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_D=block_d, BLOCK_DV=block_dv, PRECISION=precision,
        SPLIT_STAGES=split_stages, HEAVY_FIRST=heavy_first, HEADS_ON_AXIS0=heads_on_axis0, USE_TMA=use_tma,
        EVEN_D=d == block_d and dv == block_dv, SCALE_NONNEG=p.qk_scale >= 0,
        num_warps=warps, num_stages=stages, **codes, **pdl_args(q4.device))
    return p.result
