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
- `_qgemm_kernel` (2 rows and more; for word-layout weights, more than CudaOptions.gemv_rows): the same
  dequantized tile fed to tl.dot (tensor cores; tf32x3 for float32 inputs, float32-level accuracy, or
  bf16 / f16 dots with CudaOptions.prefill_precision "bf16" / "f16": for f16, x's rows are rounded to float16
  with power-of-two scales by half_rows.py, undone in the epilogue). From CudaOptions.prefill_dequant_rows rows W is
  instead dequantized whole by `_dequantize_kernel` into a workspace and multiplied by cuBLAS.
- `_qgemm_words_kernel` (more than CudaOptions.gemv_rows rows, up to 128, of bf16 dots over a word-layout
  weight: a batched decode step): y^T = W^T x^T, each int32 word loaded once and its 8 nibbles split in
  registers, so W's dequantized tile is the dot's long side and x's few rows the narrow one; split-K.
- `_qgemv_words_kernel` (1-16 rows, up to 4 a program; 4-bit affine weights re-packed with
  `words=True`, the default for matmul weights): int32 words of 8 consecutive k per column, x
  rounded to integers of LIMBS bytes (CudaOptions.gemv_limbs, default 2: 16 bits with a float scale per block of 32; 3: 22
  bits per tile; 1: 8 bits), `dp4a` dot products; optional SiLU(gate)*x prologue, RMSNorm prologue
  (`rms_norm_matmul`: x = rms_norm(x [+ y]) * g, the row's 1 / rms multiplying the sums; x + y stored on the way) and residual
  epilogue. x is rounded once per GEMV by `_quantize_x_kernel` (XQ) instead of by every thread (the
  GLU and norm prologues then run there; with the norm, each of its programs stores its blocks' sum of
  squares and the GEMV multiplies its sums by the row's 1 / rms, XQ_RMS); or, for small weights whose output the launch ahead zeroes,
  by each program for its own split of K into its column block's copy (XQ_SELF: no quantize launch).
  Each row's x is handled in the weight tile's own register layout (`_row_dot`), so the tile never
  passes through shared memory (`scripts/sm90_compile_check.py --sass` shows barriers and
  instructions per loop).

The package, along those seams: weights.py (`QuantizedWeight`, `ScaledTableWeight`, `prepare_weight`: the repacking),
gemm.py (the k-major one-row kernels, the tensor-core GEMM and the word GEMM), gguf_kernels.py (scaled lookup tables:
GGUF's IQ types and MXFP4), words_kernel.py and gemv.py (the word
GEMV and its wrapper), xq.py (x rounded for it), buffers.py (scratch), dispatch.py
(`quantized_matmul`). Every function that reads a tuning number takes `options: CudaOptions`
(default: `CudaOptions()`, the H200's numbers).

    >>> w = prepare_weight(q, [scale, bias], attrs, "cuda")     # doctest: +SKIP
    >>> y = quantized_matmul(x, w)                                # doctest: +SKIP
"""
from __future__ import annotations

from ....options import DEFAULT_CUDA
from . import buffers, dispatch, gemm, gemv, gguf_kernels, weights, words_kernel, xq  # noqa: F401
from .buffers import _WORKSPACE, _XQ_WORKSPACE, _overlaps, _sm_count, _stream_key, _workspace, _xq_workspace  # noqa: F401,E501
from .buffers import mm_out_dtype  # noqa: F401
from .dispatch import quantized_matmul  # noqa: F401
from .gemm import GEMV_MAX_ROWS, SMALL_GEMV_BYTES, _qgemm_kernel, _qgemv_kernel, _qgemv_small_kernel  # noqa: F401
from .gemm import gemm_config, gemv_config, small_gemv_config  # noqa: F401
from .gemv import (DP4A, _words_gemv, gemv_takes_xq, resident_programs, rms_norm_matmul, rounds_own_x,  # noqa: F401
                   words_gemv_config)
from .weights import QuantizedWeight, ScaledTableWeight, concatenate, dequantize, prepare_weight  # noqa: F401
from .words_kernel import _qgemv_words_kernel  # noqa: F401
from .xq import (NORM_BLOCK, NormPrologue, _quantize_x, _quantize_x_kernel, _zero_share, store_xq,  # noqa: F401
                 xq_buffers)

# the defaults (`CudaOptions`); a plan passes its own options to the functions above
WORDS_MAX_ROWS = DEFAULT_CUDA.words_max_rows
SELF_XQ_BYTES = DEFAULT_CUDA.self_xq_bytes

__all__ = ["QuantizedWeight", "prepare_weight", "quantized_matmul", "rms_norm_matmul", "dequantize", "concatenate",
           "GEMV_MAX_ROWS", "WORDS_MAX_ROWS"]
