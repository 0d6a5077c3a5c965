"""Scaled lookup tables on the GPU (mode "scaled_lut": GGUF's IQ4_NL/IQ4_XS, the IQ2/IQ3/IQ1 grids,
MXFP4, and Ingot's lut4:bB[:offset]): y = x @ W with w[k, n] = lut[v[k, n]] * scale[k // block, n]
(+ bias[k // block, n] for :offset), straight from the packed codes, never a float copy of W.

The weight (weights.py's `ScaledTableWeight`, made by `prepare_scaled`, which `prepare_weight` calls for this mode)
keeps the codes as a lookup-table weight (k-major, unsigned, 4-bit packed along N or one code a byte;
the table float32 [pK, pN, 2**bits], one [1, 1, 16] table for every GGUF type) and the scales as an
affine weight's (per GROUP rows of K, float16 where exact), and a bias (lut4:bB:offset) laid out as
the scales. Kernels, each a tile loader (`_scaled_tile`: codes -> table values -> times their scales,
plus their biases: the float32 product gguf forms) and a loop:

- `_scaled_gemv_kernel` (one row): [BLOCK_K, BLOCK_N] tiles, BLOCK_K <= GROUP so a tile shares one
  row of scales: the looked-up values times x summed over the tile, then times the scales, plus the
  tile's sum of x times the biases; split-K with atomics when N alone does not fill the chip. (The bias
  as a small matmul of its own, a pass before the kernels, cost three launches a matmul: 278 against
  648 tok/s for lut4:b64 on the default model, H100, 2026-12-06.)
- `_scaled_gemm_kernel` (2 rows and more): the dequantized tile fed to tl.dot (tensor cores; tf32x3
  for float32 inputs, float32-level accuracy).
- `_scaled_gather_kernel`: rows or columns of the weight (a quantized embedding).

The affine GGUF imports (Q2_K, Q3_K, the K-quants, TQ1_0/TQ2_0, Q4_0..Q8_0) need none of this: they
are affine 4- or 8-bit weights in blocks of 16 to 256 and run `dispatch.quantized_matmul`'s kernels.
The tile sizes are not tuned on a GPU yet (first written 2026-12-05 under Triton's interpreter).

    >>> w = prepare_weight(q, [lut, scale], attrs, "cuda")       # doctest: +SKIP
    >>> y = quantized_matmul(x, w)      # dispatch.py calls scaled_matmul  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .buffers import _sm_count
from .gemm import _load_tile, gathered_codes, grouped_tile
from .half_rows import half_operand
from .weights import ScaledTableWeight, prepare_scaled  # noqa: F401  (the weight's form lives with the others)


@triton.jit
def _scaled_tile(q_ptr, s_ptr, b_ptr, lut_ptr, offs_k, n0, offs_n, n_mask, K, NQ, stride_qk, stride_sk, lut_block_k,
                 lut_block_n, stride_lk, stride_ln, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, SCALE: tl.constexpr = True, HAS_BIAS: tl.constexpr = False):
    """float32 lut[v] (* scale + bias with SCALE) of the [BLOCK_K, BLOCK_N] tile W[offs_k, n0:n0+BLOCK_N]; 0
    past the ends."""
    v = _load_tile(q_ptr, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
    ok = (offs_k < K)[:, None] & n_mask[None, :]
    off = (offs_k // lut_block_k)[:, None] * stride_lk + (offs_n // lut_block_n)[None, :] * stride_ln
    w = tl.load(lut_ptr + off + v.to(tl.int32), mask=ok, other=0.0)
    if SCALE:
        params = (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :]
        w *= tl.load(s_ptr + params, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            w += tl.load(b_ptr + params, mask=ok, other=0.0).to(tl.float32)
    return w


@triton.jit
def _scaled_gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr, N, K, NQ, k_per_split, stride_qk, stride_sk,
                        lut_block_k, lut_block_n, stride_lk, stride_ln,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        ATOMIC: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[n] (+)= sum_k x[k] * W[k, n] over BLOCK_N columns and one split of K (BLOCK_K <= GROUP, and the
    split a multiple of BLOCK_K: a tile's rows share one row of scales, and of biases)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        t = _scaled_tile(q_ptr, s_ptr, b_ptr, lut_ptr, offs_k, n0, offs_n, n_mask, k_stop, NQ, stride_qk, stride_sk,
                         lut_block_k, lut_block_n, stride_lk, stride_ln, BITS, GROUP, BLOCK_K, BLOCK_N, SCALE=False)
        x = tl.load(x_ptr + offs_k, mask=offs_k < k_stop, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + (k0 // GROUP) * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.sum(t * x[:, None], axis=0) * s
        if HAS_BIAS:
            b = tl.load(b_ptr + (k0 // GROUP) * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x, axis=0) * b
    if ATOMIC:
        tl.atomic_add(y_ptr + offs_n, acc, mask=n_mask, sem="relaxed")
    else:
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _scaled_gemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr, M, N, K, NQ, stride_xm, stride_qk, stride_sk,
                        stride_ym, lut_block_k, lut_block_n, stride_lk, stride_ln,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
                        rs_ptr=None, ROW_SCALE: tl.constexpr = False):
    """y = x @ W over [BLOCK_M, BLOCK_N] tiles; W's tile looked up and scaled in registers, tensor-core dot.
    ROW_SCALE: row i of the tile multiplied by rs[i] (half_rows.py's scales of a float16 x)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)
        w = _scaled_tile(q_ptr, s_ptr, b_ptr, lut_ptr, offs_k, n0, offs_n, n_mask, K, NQ, stride_qk, stride_sk,
                         lut_block_k, lut_block_n, stride_lk, stride_ln, BITS, GROUP, BLOCK_K, BLOCK_N,
                         HAS_BIAS=HAS_BIAS)
        if PRECISION == "bf16":       # CudaOptions.prefill_precision, as in gemm.py's kernel
            acc = tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        elif x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if ROW_SCALE:
        acc = acc * tl.load(rs_ptr + offs_m, mask=m_mask, other=1.0)[:, None]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _bias(w: ScaledTableWeight) -> torch.Tensor:
    """The biases (laid out as the scales, the same strides), or the scales as a pointer never read."""
    return w.bias if w.bias is not None else w.scale


def _table_args(w: ScaledTableWeight) -> tuple:
    return (w.lut_block_k, w.lut_block_n, w.lut.stride(0), w.lut.stride(1))


def gemv_config(w: ScaledTableWeight, sms: int) -> dict:
    """One row: 4-bit tiles of 128 columns (64 bytes a row), BLOCK_K rows sharing one row of scales,
    split-K until about 4 programs a multiprocessor."""
    block_k = min(w.group, 32)
    block_n = 128
    while block_n > 32 and block_n // 2 >= w.n:
        block_n //= 2
    split = max(1, min((4 * sms) // triton.cdiv(w.n, block_n), triton.cdiv(w.k, block_k), 64))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=4)


def gemm_config(m: int, dtype: torch.dtype) -> dict:
    block_m = 16 if m <= 16 else (64 if m <= 128 else 128)
    block_n = 64 if m <= 16 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32 if dtype == torch.float32 else 64,
                num_warps=4 if block_m * block_n <= 64 * 128 else 8, num_stages=2 if dtype == torch.float32 else 3)


def scaled_matmul(x2: torch.Tensor, w: ScaledTableWeight, y: torch.Tensor, config: dict,
                  precision: str = "tf32x3") -> None:
    """y [M, N] = x2 [M, K] @ W (`dispatch.quantized_matmul`'s rows, M >= 1). One row: the GEMV; more:
    the tensor-core GEMM (config={"BLOCK_M": ...} forces it, other keys override the tiles)."""
    m = x2.shape[0]
    config = dict(config)
    if m == 1 and "BLOCK_M" not in config:
        cfg = {**gemv_config(w, _sm_count(x2.device)), **config}
        block_n, block_k, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT")
        assert block_k <= w.group, "a GEMV tile's rows share one row of scales"
        k_per_split = triton.cdiv(triton.cdiv(w.k, split), block_k) * block_k
        split = triton.cdiv(w.k, k_per_split)
        target = y
        if split > 1 and not (y.dtype == torch.float32 and y.is_contiguous()):
            target = torch.empty((1, w.n), dtype=torch.float32, device=x2.device)
        if split > 1:
            target.zero_()
        _scaled_gemv_kernel[(triton.cdiv(w.n, block_n), split)](
            x2[0], w.q, w.scale, _bias(w), w.lut, target, w.n, w.k, w.nq, k_per_split, w.q.stride(0), w.scale.stride(0),
            *_table_args(w), BITS=w.bits, GROUP=w.group, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=split > 1,
            HAS_BIAS=w.bias is not None, **cfg)
        if target is not y:
            y.copy_(target)
    else:
        x2, scales = half_operand(x2, precision)   # f16: float16 rows and their scales (half_rows.py)
        cfg = {**gemm_config(m, x2.dtype), **config}
        block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        grid = (triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n),)
        _scaled_gemm_kernel[grid](
            x2, w.q, w.scale, _bias(w), w.lut, y, m, w.n, w.k, w.nq, x2.stride(0), w.q.stride(0), w.scale.stride(0), y.stride(0),
            *_table_args(w), BITS=w.bits, GROUP=w.group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            GROUP_M=8, PRECISION=precision, HAS_BIAS=w.bias is not None, **cfg, **scales)


@triton.jit
def _scaled_gather_kernel(q_ptr, s_ptr, b_ptr, lut_ptr, idx_ptr, out_ptr, EXTENT, LIMIT, stride_qk, stride_sk,
                          lut_block_k, lut_block_n, stride_lk, stride_ln, so_j, so_t,
                          BITS: tl.constexpr, GROUP: tl.constexpr, AXIS: tl.constexpr, BLOCK: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    t, j, k, n, v, ok = gathered_codes(q_ptr, idx_ptr, stride_qk, EXTENT, LIMIT, AXIS, BITS, BLOCK)
    w = tl.load(lut_ptr + (k // lut_block_k) * stride_lk + (n // lut_block_n) * stride_ln + v.to(tl.int64), mask=ok,
                other=0.0)
    w *= tl.load(s_ptr + (k // GROUP) * stride_sk + n, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        w += tl.load(b_ptr + (k // GROUP) * stride_sk + n, mask=ok, other=0.0).to(tl.float32)
    w = tl.where(ok, w, 0.0)
    tl.store(out_ptr + j * so_j + t * so_t, w.to(out_ptr.dtype.element_ty), mask=j < EXTENT)


def scaled_gather(w: ScaledTableWeight, idx: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns (axis=1) or rows (axis=0) of the logical [K, N] weight, as `fused.quantized_gather`;
    out-of-range indices give zeros."""
    flat = idx.reshape(-1)
    t = flat.shape[0]
    extent, limit = (w.k, w.n) if axis == 1 else (w.n, w.k)
    out = torch.empty((extent, t) if axis == 1 else (t, extent), dtype=dtype, device=idx.device)
    so_j, so_t = (out.stride(0), out.stride(1)) if axis == 1 else (out.stride(1), out.stride(0))
    if t and extent:
        block = min(1024, triton.next_power_of_2(extent))
        _scaled_gather_kernel[(t, triton.cdiv(extent, block))](
            w.q, w.scale, _bias(w), w.lut, flat, out, extent, limit, w.q.stride(0), w.scale.stride(0), *_table_args(w),
            so_j, so_t, BITS=w.bits, GROUP=w.group, AXIS=axis, BLOCK=block, HAS_BIAS=w.bias is not None, num_warps=4)
    return out.view(extent, *idx.shape) if axis == 1 else out.view(*idx.shape, extent)
