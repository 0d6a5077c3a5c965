"""`quantized_matmul`: the kernel for the rows and the weight's layout."""
from __future__ import annotations

import torch
import triton

from ....options import DEFAULT_CUDA, CudaOptions
from ..pdl import pdl_args
from . import gemv, gguf_kernels
from .buffers import _sm_count, dequantized_workspace, mm_out_dtype
from .half_rows import half_operand, half_rows, unscale_rows_
from .gemm import (GEMV_MAX_ROWS, SMALL_GEMV_BYTES, WORDS_GEMM_MAX_ROWS, _dequantize_kernel, _qgemm_kernel,
                   _qgemm_words_kernel, _qgemv_kernel, _qgemv_small_kernel, gemm_config, gemv_config,
                   small_gemv_config, words_gemm_config)
from .weights import QuantizedWeight


# the largest float32 copy the cuBLAS path makes (Llama-3-8B's gate+up: 470 MB); a larger W (a 128k-vocab
# head with every position's logits) takes the tile kernel rather than a GB-sized workspace
DEQUANTIZED_MAX_BYTES = 512 << 20


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None = None,
                     config: dict | None = None, precision: str | None = None,
                     options: CudaOptions = DEFAULT_CUDA) -> torch.Tensor:
    """y = x @ W for x [..., K] (float32/float16/bfloat16); y [..., N] of x's dtype.

    Word-layout weights: the dp4a GEMV up to options.gemv_rows rows, then up to WORDS_GEMM_MAX_ROWS
    rows of bf16 dots (precision "bf16" or bfloat16 x) the word GEMM; else one row: the k-major GEMV
    kernels; from options.prefill_dequant_rows rows (float32 x): W dequantized once and cuBLAS; else the
    tensor-core kernel (config={"BLOCK_M": ...} forces it). precision (None: options.prefill_precision):
    the many-row dots, "tf32x3" (float32-level), "bf16" (operands rounded to bfloat16, float32 sums) or
    "f16" (float32 x's rows rounded to float16 with power-of-two scales, half_rows.py; W as float16).

        >>> w = prepare_weight(q, [scale, bias], attrs, "cuda", words=True)   # doctest: +SKIP
        >>> y = quantized_matmul(x, w)                                        # doctest: +SKIP
    """
    assert x.shape[-1] == w.k, f"quantized_matmul: x has K={x.shape[-1]}, the weight K={w.k}"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    precision = precision or options.prefill_precision
    if getattr(w, "scaled", False):   # a scaled table (GGUF's IQ types, MXFP4): gguf_kernels.py
        if m:
            gguf_kernels.scaled_matmul(x2, w, y, config or {}, precision)
        return y.reshape(*lead, w.n)
    lut = w.lut if w.lut is not None else w.q
    s = w.scale if w.scale is not None else w.q
    b = w.bias if w.bias is not None else s
    stride_lk, stride_ln = (w.lut.stride(0), w.lut.stride(1)) if w.lut is not None else (0, 0)
    stride_sk = w.scale.stride(0) if w.scale is not None else 0
    common = dict(BITS=w.bits, LUT=w.lut is not None, GROUP=w.group, HAS_BIAS=w.bias is not None)
    if m == 0:
        return y.reshape(*lead, w.n)
    config = dict(config or {})
    if w.words and (m <= options.gemv_rows or config.get("KERNEL") == "words") \
            and config.get("KERNEL", "words") == "words" and "BLOCK_M" not in config:
        config.pop("KERNEL", None)
        gemv._words_gemv(x2, w, y, config, options=options)
        return y.reshape(*lead, w.n)
    assert config.get("KERNEL") != "words", "the words kernel needs a weight prepared with words=True"
    if m <= GEMV_MAX_ROWS and "BLOCK_M" not in config:
        config = dict(config or {})
        waves = config.pop("WAVES", 8)
        small = config.get("KERNEL", "small" if w.nbytes < SMALL_GEMV_BYTES else "stream") == "small"
        base = small_gemv_config(w, _sm_count(x.device)) if small else \
            gemv_config(w, _sm_count(x.device), config.get("num_warps"), waves)
        cfg = {**base, **config}
        kernel = _qgemv_small_kernel if cfg.pop("KERNEL", "stream") == "small" else _qgemv_kernel
        if kernel is _qgemv_small_kernel:
            cfg.pop("PREFETCH", None)
            cfg["WORDS"] = w.words
        else:
            assert not w.words, "the streaming k-major kernel reads no word layout"
        block_n, block_k, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT")
        assert block_k <= w.group or w.lut is not None
        k_per_split = triton.cdiv(triton.cdiv(w.k, split), block_k) * block_k
        split = triton.cdiv(w.k, k_per_split)
        atomic = split > 1
        target = y
        if atomic:
            target = y if y.dtype == torch.float32 and y.is_contiguous() else torch.empty((m, w.n), dtype=torch.float32,
                                                                                          device=x.device)
            target.zero_()
        for row in range(m):
            kernel[(triton.cdiv(w.n, block_n), split)](
                x2[row], w.q, s, b, lut, target[row], w.n, w.k, w.nq, k_per_split, w.q.stride(0), stride_sk,
                w.lut_block_k, w.lut_block_n, stride_lk, stride_ln,
                BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=atomic, **common, **cfg,
                **pdl_args(x.device))
        if target is not y:
            y.copy_(target)
    elif w.words and m <= WORDS_GEMM_MAX_ROWS and "BLOCK_M" not in config and (
            precision in ("bf16", "f16") or x.dtype == torch.bfloat16):   # a batched decode step's bf16 dots
        _words_gemm(x2, w, y, config, precision)
    elif options.prefill_dequant_rows and m >= options.prefill_dequant_rows and "BLOCK_M" not in config \
            and x.dtype == torch.float32 and w.k * w.n * 4 <= DEQUANTIZED_MAX_BYTES:
        y = _dequantized_gemm(x2, w, out, precision)
    else:
        x2, scales = half_operand(x2, precision)
        cfg = {**gemm_config(m, w, x2.dtype, precision, _sm_count(x.device)), **(config or {})}
        block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        k_per_split, split, target = _split_k(w, block_k, cfg.pop("SPLIT_K", 1), y)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n), split)
        _qgemm_kernel[grid](
            x2, w.q, s, b, lut, target, m, w.n, w.k, w.nq, x2.stride(0), w.q.stride(0), stride_sk, target.stride(0),
            w.lut_block_k, w.lut_block_n, stride_lk, stride_ln,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, PRECISION=precision,
            WORDS=w.words, k_per_split=k_per_split, SPLIT_K=split, **common, **cfg, **scales, **pdl_args(x.device))
        if target is not y:
            y.copy_(target)
    return y.reshape(*lead, w.n)


def _split_k(w: QuantizedWeight, block_k: int, split: int, y: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(K rows a split, splits, the tensor the kernel writes): past one split, partial tiles are added into
    a zeroed float32 y (a float32 copy of it where y is another dtype or its rows are strided)."""
    k_per_split = triton.cdiv(triton.cdiv(w.k, split), block_k) * block_k
    split = triton.cdiv(w.k, k_per_split)
    target = y
    if split > 1:
        if not (y.dtype == torch.float32 and y.stride(1) == 1):
            target = torch.empty(y.shape, dtype=torch.float32, device=y.device)
        target.zero_()
    return k_per_split, split, target


def _words_gemm(x2: torch.Tensor, w: QuantizedWeight, y: torch.Tensor, config: dict, precision: str = "bf16") -> None:
    """y = x2 @ W by `_qgemm_words_kernel` (config: its tiles, over `words_gemm_config`'s): bf16 dots, or
    for precision "f16" float16 dots over half_rows.py's rows of x."""
    m = x2.shape[0]
    f16 = precision == "f16" and x2.dtype != torch.bfloat16   # (a bf16 x keeps bf16 dots: its range)
    x2, scales = half_operand(x2, precision)      # (a float16 x: as it is, unscaled)
    cfg = {**words_gemm_config(m, w, _sm_count(x2.device)), **config}
    block_m, block_n, block_k, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    assert block_k <= w.group and block_k % 8 == 0, "the word GEMM's K tile: whole words, one parameter row"
    k_per_split, split, target = _split_k(w, block_k, split, y)
    bias = w.bias if w.bias is not None else w.scale
    _qgemm_words_kernel[(triton.cdiv(w.n, block_n), split, triton.cdiv(m, block_m))](
        x2, w.q, w.scale, bias, target, m, w.n, w.k, x2.stride(0), w.q.stride(0), w.scale.stride(0), target.stride(0),
        k_per_split, GROUP=w.group, HAS_BIAS=w.bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, F16=f16, **cfg, **scales, **pdl_args(x2.device))
    if target is not y:
        y.copy_(target)


def dequantize_into(w: QuantizedWeight, dtype: torch.dtype, block_k: int = 32, block_n: int = 128,
                    num_warps: int = 4) -> torch.Tensor:
    """W as a dense [K, N] `dtype` tensor in the device's dequantization workspace (valid until the next
    call on this stream), one launch."""
    out = dequantized_workspace(w.q.device, w.k * w.n, dtype)[: w.k * w.n].view(w.k, w.n)
    lut = w.lut if w.lut is not None else w.q
    s = w.scale if w.scale is not None else w.q
    b = w.bias if w.bias is not None else s
    stride_lk, stride_ln = (w.lut.stride(0), w.lut.stride(1)) if w.lut is not None else (0, 0)
    _dequantize_kernel[(triton.cdiv(w.k, block_k), triton.cdiv(w.n, block_n))](
        w.q, s, b, lut, out, w.n, w.k, w.nq, w.q.stride(0), w.scale.stride(0) if w.scale is not None else 0,
        out.stride(0), w.lut_block_k, w.lut_block_n, stride_lk, stride_ln,
        BITS=w.bits, LUT=w.lut is not None, GROUP=w.group, HAS_BIAS=w.bias is not None,
        BLOCK_K=block_k, BLOCK_N=block_n, WORDS=w.words, num_warps=num_warps)
    return out


def _dequantized_gemm(x2: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None, precision: str) -> torch.Tensor:
    """Many rows: W dequantized once (bf16 / f16 for precision "bf16" / "f16", else float32) and multiplied
    by cuBLAS (f16: x's rows from half_rows.py, y's rows scaled back where any was scaled),
    (H200, Llama-3-8B shapes, 2,048 rows, bf16: 377-608 TFLOP/s copy included, against 153-220 for
    `_qgemm_kernel` with bf16 dots and 673-800 for cuBLAS on a dense bf16 W); the copy costs one pass over
    K x N 16- or 32-bit values. float32: cuBLAS SGEMM (torch's allow_tf32 flag, off by default, applies).
    A caller's `out` receives a copy of the bf16 path's float32 result (no caller passes one today)."""
    if precision == "bf16":
        wd = dequantize_into(w, torch.bfloat16)
        a = x2.to(torch.bfloat16)
        y = torch.mm(a, wd, out_dtype=torch.float32) if mm_out_dtype(x2.device) else torch.mm(a, wd).float()
        return y if out is None else out.copy_(y)
    if precision == "f16" and mm_out_dtype(x2.device):   # (a float16 y could overflow: no fallback to it)
        wd = dequantize_into(w, torch.float16)
        a, inv = half_rows(x2)
        y = unscale_rows_(torch.mm(a, wd, out_dtype=torch.float32), inv)
        return y if out is None else out.copy_(y)
    wd = dequantize_into(w, torch.float32)
    return torch.mm(x2, wd, out=out) if out is not None else torch.mm(x2, wd)
