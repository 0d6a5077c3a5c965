"""Small fused Triton kernels for the transformer's glue, and generated kernels for elementwise regions.

- `rms_norm(x, w, eps)` and `add_rms_norm(a, b, w, eps)` (the residual add and the next norm in
  one pass: both results written);
- `rope(x, pos, inv_freq, interleaved, rotary_dims)`: angles in float64 like the reference, the
  position read from device memory (a scalar offset or one position per token);
- `slice_write(dst, src, starts)`: dst[start:start+n, ...] = src with starts that may be device
  scalars (the KV-cache write at the decode position, in place, inside a CUDA graph);
- `quantized_gather(weight, idx, axis)`: rows or columns of a re-packed quantized table (the
  embedding), dequantizing only the entries taken;
- `RegionKernel`: a fused elementwise region (ingot.passes.regions) compiled to one generated
  Triton kernel (SiLU * mul, chains of adds/muls, casts): one read of each input, one write.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import codegen
from ...ir import Node, Op
from .attention.decode import quantize_row
from .pdl import pdl_args, pdl_enter
from .quantized_matmul import _zero_share
from .quantized_matmul.gemm import gathered_codes


# -- RMSNorm --------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, D, sx, sy, so, ss, eps,
                     HAS_WEIGHT: tl.constexpr, ADD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(y_ptr + row * sy + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * ss + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    out = x * inv
    if HAS_WEIGHT:
        out = out * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x**2) + eps) * weight over the last axis, computed in float32."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight if weight is not None else x2, out, out, x2.shape[1],
                                         x2.stride(0), 0, out.stride(0), 0, float(eps), HAS_WEIGHT=weight is not None,
                                         ADD=False, BLOCK_D=triton.next_power_of_2(x2.shape[1]),
                                         num_warps=4 if x2.shape[1] <= 2048 else 8, **pdl_args(x.device))
    return out.view(x.shape)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """(a + b, rms_norm(a + b) * weight) in one pass; a and b of one shape."""
    a2, b2 = _rows(a), _rows(b)
    total = torch.empty(a2.shape, dtype=a.dtype, device=a.device)
    out = torch.empty(a2.shape, dtype=a.dtype, device=a.device)
    if a2.shape[0]:
        _rms_norm_kernel[(a2.shape[0],)](a2, b2, weight if weight is not None else a2, total, out, a2.shape[1],
                                         a2.stride(0), b2.stride(0), out.stride(0), total.stride(0), float(eps),
                                         HAS_WEIGHT=weight is not None, ADD=True,
                                         BLOCK_D=triton.next_power_of_2(a2.shape[1]),
                                         num_warps=4 if a2.shape[1] <= 2048 else 8, **pdl_args(a.device))
    return total.view(a.shape), out.view(a.shape)


# -- RoPE -----------------------------------------------------------------------------------------

@triton.jit
def _rope_kernel(x_ptr, pos_ptr, inv_ptr, out_ptr, T, D, HALF, sx_r, sx_t, so_r, so_t, OUT_ROWS,
                 POS_VECTOR: tl.constexpr, INTERLEAVED: tl.constexpr, AT_POSITION: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One row (r, t) of x rotated by its position; written to out row t, or with AT_POSITION to out row
    `position` (RoPE and the KV-cache write in one pass; positions past the cache are dropped)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    r = row // T
    t = row % T
    if POS_VECTOR:
        p = tl.load(pos_ptr + t).to(tl.int64)
    else:
        p = tl.load(pos_ptr).to(tl.int64) + t
    j = tl.arange(0, BLOCK_H)
    jm = j < HALF
    f = tl.load(inv_ptr + j, mask=jm, other=0.0)
    angle = p.to(tl.float64) * f.to(tl.float64)
    c = tl.cos(angle).to(tl.float32)
    s = tl.sin(angle).to(tl.float32)
    base = x_ptr + r * sx_r + t * sx_t
    if AT_POSITION:
        out = out_ptr + r * so_r + p * so_t
        inside = (p >= 0) & (p < OUT_ROWS)
    else:
        out = out_ptr + r * so_r + t * so_t
        inside = p == p
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + HALF
    a = tl.load(base + i1, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(base + i2, mask=jm, other=0.0).to(tl.float32)
    tl.store(out + i1, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=jm & inside)
    tl.store(out + i2, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=jm & inside)
    d = tl.arange(0, BLOCK_D)
    rest = (d >= 2 * HALF) & (d < D)
    tl.store(out + d, tl.load(base + d, mask=rest, other=0.0).to(out_ptr.dtype.element_ty), mask=rest & inside)


def _launch_rope(x3, pos, inv_freq, out3, interleaved, at_position):
    t, d = x3.shape[1], x3.shape[2]
    half = inv_freq.shape[0]
    rows = x3.shape[0] * t
    if rows:
        _rope_kernel[(rows,)](x3, pos, inv_freq, out3, t, d, half, x3.stride(0), x3.stride(1), out3.stride(0),
                              out3.stride(1), out3.shape[1], POS_VECTOR=pos.dim() == 1, INTERLEAVED=interleaved,
                              AT_POSITION=at_position, BLOCK_H=triton.next_power_of_2(max(half, 1)),
                              BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4,
                              **pdl_args(x3.device))


def _rows3(x: torch.Tensor) -> torch.Tensor:
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first 2 * len(inv_freq) dims of x [..., T, D] by position * inv_freq.

    pos: a 0-d integer tensor (the position of token 0) or one position per token [T].
    """
    x3 = _rows3(x)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    _launch_rope(x3, pos, inv_freq, out, interleaved, False)
    return out.view(x.shape)


def rope_into(cache: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
              interleaved: bool) -> torch.Tensor:
    """cache[..., pos + t, :] = rope(x)[..., t, :] in place (x [..., T, D], cache [..., C, D], pos 0-d)."""
    assert cache.shape[:-2] == x.shape[:-2] and cache.shape[-1] == x.shape[-1] and pos.dim() == 0
    c3 = cache.view(-1, cache.shape[-2], cache.shape[-1])
    _launch_rope(_rows3(x), pos, inv_freq, c3, interleaved, True)
    return cache


@triton.jit
def _rope_qkv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_ptr, qo_ptr, kc_ptr, vc_ptr, Q_ROWS, KV_ROWS, T, D, HALF,
                     sq_r, sq_t, sk_r, sk_t, sv_r, sv_t, sqo_r, sqo_t, skc_r, skc_t, svc_r, svc_t, C,
                     INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                     ks_ptr=None, vs_ptr=None, sks_r=0, sks_t=0, svs_r=0, svs_t=0, CODES: tl.constexpr = False):
    """A decoder layer's q/k/v glue in one launch: programs [0, Q_ROWS) rotate q into qo; the next
    KV_ROWS rotate k into the k cache at row pos + t; the last KV_ROWS copy v into the v cache there
    (rows past the cache are dropped, as slice_write drops them). CODES: int8 caches, each row stored
    as its codes and its scale (ks/vs [rows, C, 1]) as ops.nn.quantized_rows makes them."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    if row < Q_ROWS:
        r = row // T
        t = row % T
        p = tl.load(pos_ptr).to(tl.int64) + t
        _rope_row(q_ptr + r * sq_r + t * sq_t, qo_ptr + r * sqo_r + t * sqo_t, p == p, p, inv_ptr, D, HALF,
                  INTERLEAVED, BLOCK_H, BLOCK_D)
    elif row < Q_ROWS + KV_ROWS:
        r = (row - Q_ROWS) // T
        t = (row - Q_ROWS) % T
        p = tl.load(pos_ptr).to(tl.int64) + t
        if CODES:
            _rope_row_codes(k_ptr + r * sk_r + t * sk_t, kc_ptr + r * skc_r + p * skc_t, ks_ptr + r * sks_r + p * sks_t,
                            (p >= 0) & (p < C), p, inv_ptr, D, HALF, INTERLEAVED, BLOCK_D)
        else:
            _rope_row(k_ptr + r * sk_r + t * sk_t, kc_ptr + r * skc_r + p * skc_t, (p >= 0) & (p < C), p, inv_ptr, D,
                      HALF, INTERLEAVED, BLOCK_H, BLOCK_D)
    else:
        r = (row - Q_ROWS - KV_ROWS) // T
        t = (row - Q_ROWS - KV_ROWS) % T
        p = tl.load(pos_ptr).to(tl.int64) + t
        d = tl.arange(0, BLOCK_D)
        ok = (d < D) & (p >= 0) & (p < C)
        x = tl.load(v_ptr + r * sv_r + t * sv_t + d, mask=d < D, other=0.0)
        if CODES:
            codes, row_scale = quantize_row(x.to(tl.float32), d < D)
            tl.store(vc_ptr + r * svc_r + p * svc_t + d, codes, mask=ok)
            tl.store(vs_ptr + r * svs_r + p * svs_t, row_scale, mask=(p >= 0) & (p < C))
        else:
            tl.store(vc_ptr + r * svc_r + p * svc_t + d, x.to(vc_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_row_codes(base, out, scale_out, inside, p, inv_ptr, D, HALF, INTERLEAVED: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """`_rope_row` into an int8 cache: the whole rotated row (each dim with its partner), then its codes
    and scale (`quantize_row`)."""
    d = tl.arange(0, BLOCK_D)
    rot = d < 2 * HALF
    if INTERLEAVED:
        partner = d ^ 1
        j = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        j = tl.where(d < HALF, d, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    f = tl.load(inv_ptr + j, mask=rot, other=0.0)
    angle = p.to(tl.float64) * f.to(tl.float64)
    c = tl.cos(angle).to(tl.float32)
    s = tl.sin(angle).to(tl.float32)
    x = tl.load(base + d, mask=d < D, other=0.0).to(tl.float32)
    y = tl.load(base + tl.where(rot, partner, d), mask=d < D, other=0.0).to(tl.float32)
    # a * c - b * s for the first of a pair, b * c + a * s for the second (as _rope_row computes them)
    first = tl.where(sign < 0, x * c - y * s, x * c + y * s)
    row = tl.where(rot, first, x)
    codes, row_scale = quantize_row(row, d < D)
    tl.store(out + d, codes, mask=(d < D) & inside)
    tl.store(scale_out, row_scale, mask=inside)


@triton.jit
def _rope_row(base, out, inside, p, inv_ptr, D, HALF, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """One row rotated by position p (angles in float64, as `_rope_kernel` computes them)."""
    j = tl.arange(0, BLOCK_H)
    jm = j < HALF
    f = tl.load(inv_ptr + j, mask=jm, other=0.0)
    angle = p.to(tl.float64) * f.to(tl.float64)
    c = tl.cos(angle).to(tl.float32)
    s = tl.sin(angle).to(tl.float32)
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + HALF
    a = tl.load(base + i1, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(base + i2, mask=jm, other=0.0).to(tl.float32)
    tl.store(out + i1, (a * c - b * s).to(out.dtype.element_ty), mask=jm & inside)
    tl.store(out + i2, (b * c + a * s).to(out.dtype.element_ty), mask=jm & inside)
    d = tl.arange(0, BLOCK_D)
    rest = (d >= 2 * HALF) & (d < D)
    tl.store(out + d, tl.load(base + d, mask=rest, other=0.0).to(out.dtype.element_ty), mask=rest & inside)


def rope_qkv_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, interleaved: bool,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """rope(q), and k_cache[..., pos + t, :] = rope(k), v_cache[..., pos + t, :] = v, in one launch.
    q [..., T, D], k and v [..., T, D] with the caches' leading shape; returns rope(q). scales: int8
    caches' row scales [..., C, 1] (each row written as its codes and scale)."""
    assert k.shape == v.shape and k_cache.shape == v_cache.shape and pos.dim() == 0
    q3, k3, v3 = _rows3(q), _rows3(k), _rows3(v)
    kc3 = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    vc3 = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    codes = {}
    if scales is not None:
        ks3, vs3 = (x.view(-1, x.shape[-2], 1) for x in scales)
        codes = dict(ks_ptr=ks3, vs_ptr=vs3, sks_r=ks3.stride(0), sks_t=ks3.stride(1), svs_r=vs3.stride(0),
                     svs_t=vs3.stride(1), CODES=True)
    out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    t, d = q3.shape[1], q3.shape[2]
    half = inv_freq.shape[0]
    q_rows, kv_rows = q3.shape[0] * t, k3.shape[0] * t
    _rope_qkv_kernel[(q_rows + 2 * kv_rows,)](
        q3, k3, v3, pos, inv_freq, out, kc3, vc3, q_rows, kv_rows, t, d, half, q3.stride(0), q3.stride(1),
        k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), out.stride(0), out.stride(1), kc3.stride(0),
        kc3.stride(1), vc3.stride(0), vc3.stride(1), kc3.shape[1], INTERLEAVED=interleaved,
        BLOCK_H=triton.next_power_of_2(max(half, 1)), BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4,
        **codes, **pdl_args(q.device))
    return out.view(q.shape)


# -- slice write at runtime starts ----------------------------------------------------------------

MAX_RANK = 6


@triton.jit
def _slice_write_kernel(dst_ptr, src_ptr, total,
                        p0, p1, p2, p3, p4, p5, c0, c1, c2, c3, c4, c5,
                        u0, u1, u2, u3, u4, u5, d0, d1, d2, d3, d4, d5, s0, s1, s2, s3, s4, s5,
                        R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                        R4: tl.constexpr, R5: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """dst[start + i] = src[i] over a rank-6 (padded) update; start_a = *p_a if R_a else c_a.
    Elements that would land outside dst are dropped (the host cannot check a device start)."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    v = tl.load(src_ptr + offs, mask=ok)
    rem = offs
    dst_off = tl.zeros([BLOCK], tl.int64)
    for a in tl.static_range(5, -1, -1):
        if a == 0:
            u, dd, st, cst, ptr, R = u0, d0, s0, c0, p0, R0
        elif a == 1:
            u, dd, st, cst, ptr, R = u1, d1, s1, c1, p1, R1
        elif a == 2:
            u, dd, st, cst, ptr, R = u2, d2, s2, c2, p2, R2
        elif a == 3:
            u, dd, st, cst, ptr, R = u3, d3, s3, c3, p3, R3
        elif a == 4:
            u, dd, st, cst, ptr, R = u4, d4, s4, c4, p4, R4
        else:
            u, dd, st, cst, ptr, R = u5, d5, s5, c5, p5, R5
        i = rem % u
        rem = rem // u
        if R:
            j = i.to(tl.int64) + tl.load(ptr).to(tl.int64)
        else:
            j = i.to(tl.int64) + cst
        ok = ok & (j >= 0) & (j < dd)
        dst_off += j * st
    tl.store(dst_ptr + dst_off, v, mask=ok)


def slice_write(dst: torch.Tensor, src: torch.Tensor, starts) -> torch.Tensor:
    """Write src into dst at starts (ints or 0-d device integer tensors), in place; returns dst."""
    rank = dst.dim()
    assert rank <= MAX_RANK and src.dim() == rank, "slice_write: rank up to 6, update of the same rank"
    src = src.to(dst.dtype).contiguous()
    pad = MAX_RANK - rank
    u = [1] * pad + list(src.shape)
    d = [1] * pad + list(dst.shape)
    s = [0] * pad + list(dst.stride())
    starts = [0] * pad + list(starts)
    ptrs = [st if isinstance(st, torch.Tensor) else dst for st in starts]
    consts = [0 if isinstance(st, torch.Tensor) else int(st) for st in starts]
    flags = {f"R{i}": isinstance(st, torch.Tensor) for i, st in enumerate(starts)}
    total = src.numel()
    if total:
        block = 1024
        _slice_write_kernel[(triton.cdiv(total, block),)](dst, src, total, *ptrs, *consts, *u, *d, *s,
                                                          BLOCK=block, num_warps=4, **flags, **pdl_args(dst.device))
    return dst


# -- quantized gather (embedding) -----------------------------------------------------------------

@triton.jit
def _qgather_kernel(q_ptr, s_ptr, b_ptr, lut_ptr, idx_ptr, out_ptr, EXTENT, LIMIT,
                    stride_qk, stride_sk, lut_block_k, lut_block_n, stride_lk, stride_ln, so_j, so_t,
                    BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    AXIS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                    z_ptr=None, Z=0, ZERO: tl.constexpr = False):
    pdl_enter(PDL)
    if ZERO:   # the split-K output of the GEMV after the gather (`quantized_gather`'s zero)
        _zero_share(z_ptr, Z, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                    tl.num_programs(0) * tl.num_programs(1))
    t, j, k, n, v, ok = gathered_codes(q_ptr, idx_ptr, stride_qk, EXTENT, LIMIT, AXIS, BITS, BLOCK)
    if LUT:
        w = tl.load(lut_ptr + (k // lut_block_k) * stride_lk + (n // lut_block_n) * stride_ln + v.to(tl.int64),
                    mask=ok, other=0.0)
    else:
        g = k // GROUP
        w = v.to(tl.float32) * tl.load(s_ptr + g * stride_sk + n, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            w += tl.load(b_ptr + g * stride_sk + n, mask=ok, other=0.0).to(tl.float32)
    w = tl.where(ok, w, 0.0)
    tl.store(out_ptr + j * so_j + t * so_t, w.to(out_ptr.dtype.element_ty), mask=j < EXTENT)


def quantized_gather(weight, idx: torch.Tensor, axis: int, dtype: torch.dtype,
                     zero: torch.Tensor | None = None) -> torch.Tensor:
    """Columns (axis=1) or rows (axis=0) of the logical [K, N] weight; out-of-range indices give zeros.
    `zero` (float32, contiguous, apart from the operands): zeroed by the same launch, the split-K output
    of the GEMV after the gather (a model's first layer), so no memset or quantize launch runs between."""
    flat = idx.reshape(-1)
    t = flat.shape[0]
    extent, limit = (weight.k, weight.n) if axis == 1 else (weight.n, weight.k)
    if axis == 1:
        out = torch.empty((extent, t), dtype=dtype, device=idx.device)
        so_j, so_t = out.stride(0), out.stride(1)
    else:
        out = torch.empty((t, extent), dtype=dtype, device=idx.device)
        so_j, so_t = out.stride(1), out.stride(0)
    if t and extent:
        scale = weight.scale if weight.scale is not None else weight.q
        bias = weight.bias if weight.bias is not None else scale
        lut = weight.lut if weight.lut is not None else weight.q
        sl = (weight.lut.stride(0), weight.lut.stride(1)) if weight.lut is not None else (0, 0)
        block = min(1024, triton.next_power_of_2(extent))
        _qgather_kernel[(t, triton.cdiv(extent, block))](
            weight.q, scale, bias, lut, flat, out, extent, limit, weight.q.stride(0),
            weight.scale.stride(0) if weight.scale is not None else 0, weight.lut_block_k, weight.lut_block_n, *sl,
            so_j, so_t, BITS=weight.bits, LUT=weight.lut is not None, GROUP=weight.group,
            HAS_BIAS=weight.bias is not None, AXIS=axis, BLOCK=block, num_warps=4,
            **(dict(z_ptr=zero, Z=zero.numel(), ZERO=True) if zero is not None else {}), **pdl_args(out.device))
    elif zero is not None:
        zero.zero_()
    if axis == 1:
        return out.view(extent, *idx.shape)
    return out.view(*idx.shape, extent)


# -- generated kernels for elementwise regions -----------------------------------------------------

_FLOAT_EXPR = {
    Op.ADD: "({0} + {1})", Op.SUB: "({0} - {1})", Op.MUL: "({0} * {1})", Op.DIV: "({0} / {1})",
    Op.MAXIMUM: "tl.maximum({0}, {1})", Op.MINIMUM: "tl.minimum({0}, {1})",
    Op.NEG: "(-{0})", Op.ABS: "tl.abs({0})", Op.EXP: "tl.exp({0})", Op.LOG: "tl.log({0})",
    Op.SQRT: "tl.sqrt_rn({0})", Op.RSQRT: "(1.0 / tl.sqrt_rn({0}))", Op.SIGMOID: "tl.sigmoid({0})",
    Op.SILU: "({0} * tl.sigmoid({0}))", Op.SIN: "tl.sin({0})", Op.COS: "tl.cos({0})",
}
REGION_OPS = frozenset(_FLOAT_EXPR) | {Op.CAST}
_TL_DTYPE = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16"}


def region_supported(nodes: list[Node]) -> bool:
    """A region we generate a kernel for: float elementwise ops only, static shapes."""
    for n in nodes:
        if n.op not in REGION_OPS or not n.dtype.is_float or not all(s.dtype.is_float for s in n.src):
            return False
        if n.dtype.name not in ("float32", "float16", "bfloat16"):
            return False
    return True





class RegionKernel:
    """One generated kernel computing a region's last node from the region's external inputs."""

    def __init__(self, nodes: list[Node], torch_dtype_of):
        self.nodes = nodes
        inside = {n.id for n in nodes}
        self.inputs: list[Node] = []
        for n in nodes:
            for s in n.src:
                if s.id not in inside and s not in self.inputs:
                    self.inputs.append(s)
        root = nodes[-1]
        self.shape = tuple(root.shape)
        self.out_dtype = torch_dtype_of(root.dtype)
        names = {s.id: f"in{i}" for i, s in enumerate(self.inputs)}
        body = []
        for n in nodes:
            args = [names[s.id] for s in n.src]
            if n.op == Op.CAST:
                expr = f"{args[0]}.to({_TL_DTYPE[torch_dtype_of(n.dtype)]}).to(tl.float32)"
            else:
                expr = _FLOAT_EXPR[n.op].format(*args)
            names[n.id] = f"v{n.id}"
            body.append(f"    v{n.id} = {expr}")
        rank = len(self.shape)
        params = ", ".join(f"in{i}_ptr" for i in range(len(self.inputs)))
        strides = ", ".join(f"st{i}_{a}" for i in range(len(self.inputs)) for a in range(rank))
        lines = ["import triton", "import triton.language as tl", "", "from ingot.backends.cuda.pdl import pdl_enter", "",
                 "@triton.jit",
                 f"def region_kernel(out_ptr, {params}, total, {strides + ', ' if strides else ''}BLOCK: tl.constexpr, "
                 "PDL: tl.constexpr = False):",
                 "    pdl_enter(PDL)",
                 "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
                 "    mask = offs < total",
                 "    rem = offs"]
        for a in range(rank - 1, -1, -1):
            lines.append(f"    i{a} = rem % {self.shape[a]}")
            lines.append(f"    rem = rem // {self.shape[a]}")
        for i in range(len(self.inputs)):
            off = " + ".join(f"i{a} * st{i}_{a}" for a in range(rank)) or "0"
            lines.append(f"    in{i} = tl.load(in{i}_ptr + {off}, mask=mask, other=0.0).to(tl.float32)")
        lines += body
        lines.append(f"    tl.store(out_ptr + offs, {names[root.id]}.to(out_ptr.dtype.element_ty), mask=mask)")
        source = "\n".join(lines) + "\n"
        self.source = source
        self.kernel = _load_kernel(source)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.out_dtype, device=inputs[0].device)
        total = out.numel()
        strides = [st for x in inputs for st in x.expand(self.shape).stride()]
        if total:
            block = 1024 if total >= 1024 else triton.next_power_of_2(total)
            self.kernel[(triton.cdiv(total, block),)](out, *inputs, total, *strides, BLOCK=block,
                                                      num_warps=4 if block >= 512 else 1, **pdl_args(out.device))
        return out


def _load_kernel(source: str, name: str = "region_kernel"):
    """The jit function `name` of a generated module (Triton reads a kernel's source from its file)."""
    return codegen.load(source, name, "triton_regions")


__all__ = ["rms_norm", "add_rms_norm", "rope", "slice_write", "quantized_gather", "RegionKernel", "region_supported",
           "math"]
