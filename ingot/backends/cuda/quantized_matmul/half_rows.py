"""float16 operands for the many-row GEMMs (CudaOptions.prefill_precision "f16"): x's rows rounded to float16,
each scaled by a power of two so that nothing overflows.

float16 keeps 11 bits of each operand where bfloat16 keeps 8, so a product of two roundings is about 8x closer
(the default model in transformers with every operand rounded, `benchmarks/lab/rounding_emulation.py`: prefill
logits up to 1.23e-2 off float32 with bf16 operands, 8.3e-4 with f16), at the same tensor-core rate. Its range ends at 65504: an MLP's down projection reads values in the
thousands on real models (3,064 on SmolLM2-135M), and below 6.1e-5 it keeps fewer bits. So a row whose largest
|x| is outside [2^-6, 2^15) is multiplied by 2^-e (exact) before rounding, its largest value landing in
[2^14, 2^15), and the GEMM's row of y by 2^e after it (the kernels' epilogue, or `unscale_rows_` after cuBLAS,
which returns at once for a tile of unscaled rows: the usual case, normed activations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _half_rows_kernel(x_ptr, out_ptr, inv_ptr, K, stride_x, stride_o, BLOCK: tl.constexpr):
    """Row `program_id` of x: its largest |x| (first pass), then x * 2^-e as float16 (second pass; the row is
    in L2), and 2^e into inv. From the float's exponent bits f = floor(log2 max|x|): e = 0 for f in -6..14,
    else f - 14 (every scaled value below 2^15: a finite float16), held to -112..114 (inf); 0 for a row of zeros."""
    row = tl.program_id(0)
    top = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.abs(tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0)))
    biggest = tl.max(top, axis=0)
    f = ((biggest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(((f >= -6) & (f <= 14)) | (biggest == 0.0), 0, tl.minimum(tl.maximum(f - 14, -112), 114))
    scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(inv_ptr + row, ((127 + e) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0)
        tl.store(out_ptr + row * stride_o + offs, (x * scale).to(tl.float16), mask=offs < K)


def half_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x16 [M, K] float16, inv [M] float32): x2 [M, K] float32 (unit last stride) = x16 * inv[:, None]
    up to float16 rounding."""
    m, k = x2.shape
    x16 = torch.empty((m, k), dtype=torch.float16, device=x2.device)
    inv = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m:
        _half_rows_kernel[(m,)](x2, x16, inv, k, x2.stride(0), x16.stride(0), BLOCK=1024, num_warps=4)
    return x16, inv


def half_operand(x2: torch.Tensor, precision: str) -> tuple[torch.Tensor, dict]:
    """(x, the GEMM kernels' row-scale arguments): for precision "f16" a float32 x as `half_rows` and
    dict(rs_ptr=inv, ROW_SCALE=True) for the epilogue; else x as it is and no arguments."""
    if precision != "f16" or x2.dtype != torch.float32:
        return x2, {}
    x16, inv = half_rows(x2)
    return x16, dict(rs_ptr=inv, ROW_SCALE=True)


@triton.jit
def _unscale_rows_kernel(y_ptr, inv_ptr, M, N, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rows, cols] *= inv[rows] for one tile; a tile whose rows were none of them scaled returns after
    reading BLOCK_M floats."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    inv = tl.load(inv_ptr + offs_m, mask=offs_m < M, other=1.0)
    if tl.sum((inv != 1.0).to(tl.int32), axis=0) > 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        ptrs = y_ptr + offs_m[:, None] * stride_y + offs_n[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=ok) * inv[:, None], mask=ok)


def unscale_rows_(y: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """y [M, N] float32 (unit last stride) *= inv[:, None] in place, `half_rows`' inverse scale."""
    m, n = y.shape
    if m and n:
        _unscale_rows_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 256))](y, inv, m, n, y.stride(0), BLOCK_M=32,
                                                                       BLOCK_N=256, num_warps=4)
    return y
