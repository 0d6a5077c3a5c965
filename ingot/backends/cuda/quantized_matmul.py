"""Quantized matmul on the GPU: y = x @ W with W kept as packed 4-bit or 8-bit integers.

Layout on the device (re-packed once at load from Ingot's k-major form, see `prepare_weight`):
W is stored *n-major*, one row per output column, packed along the reduction axis K:

    q:     uint8 [N, Kp / 2] (4-bit, low nibble = even k) or uint8 [N, Kp] (8-bit)
    scale: [N, Kp / GROUP]  float32 (float16 when that is lossless, as for GGUF's f16 scales)
    bias:  [N, Kp / GROUP]  w = v * scale + bias, v the *unsigned* stored integer

Signed integers and zero points are folded into the bias at load (int4: v_u = v_s + 8, so
bias' = bias - (zero_point + 8) * scale), so one kernel serves int4/uint4/int8/uint8 affine.
Lookup tables (LUT-4, LUT-8) index the raw unsigned bits, as the NumPy reference does.

Why n-major: a program reads 16 contiguous bytes = 32 nibbles = one whole block of K per thread,
so the block sum is formed in registers and the scale is applied once per block, not per weight.

Two kernels, each in the shape of STYLE.md (kernel -> wrapper -> test -> benchmark):
- `_qgemv_kernel`: 1-16 rows of x, streams the weights once (split-K with atomics when N is small);
- `_qgemm_kernel`: more rows (prefill): dequantizes a [BLOCK_N, BLOCK_K] tile in registers and
  multiplies on the tensor cores (tf32x3 for float32 inputs: float32-level accuracy).

    >>> w = prepare_weight(q, [scale, bias], attrs)          # doctest: +SKIP
    >>> y = quantized_matmul(x, w)                            # doctest: +SKIP
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 16
MAGIC_CONVERT = os.environ.get("INGOT_CUDA_MAGIC", "1") == "1"   # int -> float by exponent bits, off the slow I2F unit
PARAMS_F16 = os.environ.get("INGOT_CUDA_F16_PARAMS", "1") == "1"  # store scale/bias as f16 where that is exact


@triton.jit
def _to_float(v, MAGIC: tl.constexpr):
    """Unsigned integers < 2**23 to float32 exactly. MAGIC: OR the value into the mantissa of 2**23 and
    subtract 2**23 (one logic op and one add) instead of the int-to-float unit, which runs at 1/4 rate."""
    if MAGIC:
        return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        return v.to(tl.float32)


@triton.jit
def _load_values(q_ptr, offs_n, n_mask, k0, stride_qn, KPB, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The unsigned integers of W[offs_n, k0:k0+BLOCK_K] as a [BLOCK_N, BLOCK_K] tensor (0 past the end)."""
    if BITS == 4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :],
                         mask=n_mask[:, None] & (offs_b < KPB)[None, :], other=0)
        return tl.join(packed & 0xF, packed >> 4).reshape([BLOCK_N, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :],
                       mask=n_mask[:, None] & (offs_k < KPB)[None, :], other=0)


@triton.jit
def _qgemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                  M, N, K, KPB, KB, k_per_split,
                  stride_xm, stride_qn, stride_sn, stride_ym,
                  lut_block_n, lut_block_k, stride_ln, stride_lk,
                  BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                  MAGIC: tl.constexpr):
    """y[m, n] (+)= sum_k x[m, k] * W[n, k] for BLOCK_M rows, BLOCK_N columns, one split of K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    NG: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N, NG], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < k_stop)[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        v = _load_values(q_ptr, offs_n, n_mask, k0, stride_qn, KPB, BITS, BLOCK_N, BLOCK_K)   # [BN, BK]
        if LUT:
            lut_off = (offs_n // lut_block_n)[:, None] * stride_ln + (offs_k // lut_block_k)[None, :] * stride_lk
            w = tl.load(lut_ptr + lut_off + v.to(tl.int32), mask=n_mask[:, None], other=0.0)
            prod = w[None, :, :] * x[:, None, :]
            acc += tl.reshape(prod, [BLOCK_M, BLOCK_N, NG, GROUP]).sum(axis=3)
        else:
            vf = _to_float(v, MAGIC)
            prod = vf[None, :, :] * x[:, None, :]                                        # [BM, BN, BK]
            part = tl.reshape(prod, [BLOCK_M, BLOCK_N, NG, GROUP]).sum(axis=3)           # block sums
            offs_g = k0 // GROUP + tl.arange(0, NG)
            g_mask = n_mask[:, None] & (offs_g < KB)[None, :]
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            acc += part * s[None, :, :]
            if HAS_BIAS:
                b = tl.load(b_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
                xs = tl.reshape(x, [BLOCK_M, NG, GROUP]).sum(axis=2)                    # [BM, NG]
                acc += b[None, :, :] * xs[:, None, :]
    y = tl.sum(acc, axis=2)
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, y, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                  M, N, K, KPB, KB,
                  stride_xm, stride_qn, stride_sn, stride_ym,
                  lut_block_n, lut_block_k, stride_ln, stride_lk,
                  BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr):
    """y = x @ W.T over [BLOCK_M, BLOCK_N] tiles; W dequantized tile by tile in registers, tensor-core dot."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n                   # grouped order: neighbouring programs share W tiles in L2
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        v = _load_values(q_ptr, offs_n, n_mask, k0, stride_qn, KPB, BITS, BLOCK_N, BLOCK_K)
        if LUT:
            lut_off = (offs_n // lut_block_n)[:, None] * stride_ln + (offs_k // lut_block_k)[None, :] * stride_lk
            w = tl.load(lut_ptr + lut_off + v.to(tl.int32), mask=n_mask[:, None], other=0.0)
        else:
            g = (offs_k // GROUP)[None, :]
            g_mask = n_mask[:, None] & (g < KB)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g, mask=g_mask, other=0.0).to(tl.float32)
            w = v.to(tl.float32) * s
            if HAS_BIAS:
                w += tl.load(b_ptr + offs_n[:, None] * stride_sn + g, mask=g_mask, other=0.0).to(tl.float32)
        if x.dtype == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- the weight as the kernels read it -------------------------------------------------------------

@dataclass
class QuantizedWeight:
    """A quantized [K, N] weight re-packed n-major for the kernels (see the module docstring)."""

    q: torch.Tensor                 # uint8 [N, Kp/2] or [N, Kp]
    scale: torch.Tensor | None      # [N, KB] (affine)
    bias: torch.Tensor | None       # [N, KB] (affine, None when zero)
    lut: torch.Tensor | None        # float32 [pN, pK, 2**bits] (lookup table)
    lut_block_n: int
    lut_block_k: int
    bits: int
    group: int                      # K elements per parameter row (a power of two)
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.bias, self.lut) if t is not None)

    def values(self) -> torch.Tensor:
        """The unsigned stored integers [N, K] (tests, gather)."""
        if self.bits == 4:
            return torch.stack([self.q & 0xF, self.q >> 4], dim=-1).reshape(self.n, -1)[:, : self.k]
        return self.q[:, : self.k]


def _pow2_factor(n: int, cap: int) -> int:
    f = 1
    while n % (f * 2) == 0 and f * 2 <= cap:
        f *= 2
    return f


def _expand(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A block-broadcast [a, b] parameter repeated up to `shape`."""
    for axis in range(2):
        if p.shape[axis] != shape[axis]:
            p = p.repeat_interleave(shape[axis] // p.shape[axis], dim=axis)
    return p


def _maybe_f16(p: torch.Tensor) -> torch.Tensor:
    if PARAMS_F16:
        h = p.to(torch.float16)
        if torch.isfinite(h).all() and torch.equal(h.to(torch.float32), p):
            return h
    return p


def prepare_weight(q: np.ndarray, params: list[np.ndarray], attrs: dict, device) -> QuantizedWeight:
    """Re-pack a quantized_matmul/quantized_gather weight (Ingot's layout, numpy) for the kernels.

    transpose=False: q is the logical [K, N] weight (4-bit packed along N); transpose=True: q is [N, K]
    (4-bit packed along K). Parameters are block-broadcast with q's rank; a LUT has an extra last axis.
    """
    qdtype = attrs["qdtype"]
    bits = 4 if qdtype.packed else 8
    signed = qdtype.kind == "i"
    lut_mode = attrs["mode"] == "lut"
    transpose = bool(attrs.get("transpose"))
    qt = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    if bits == 4:
        values = torch.stack([qt & 0xF, qt >> 4], dim=-1).reshape(qt.shape[0], -1)  # raw nibbles
    else:
        values = qt.view(torch.uint8)
    if not transpose:
        values = values.t()                                   # -> [N, K]
    n, k = values.shape
    # parameters in n-major orientation: [pN, pK] (+ table axis)
    tparams = [torch.from_numpy(np.ascontiguousarray(p)).to(device=device, dtype=torch.float32) for p in params]
    if not transpose:
        tparams = [p.transpose(0, 1) for p in tparams]
    if lut_mode:
        lut = tparams[0].contiguous()                          # [pN, pK, 2**bits]
        group = _pow2_factor(k // lut.shape[1], 64) if lut.shape[1] > 1 else _pow2_factor(k, 64)
        kp = -(-k // (2 * group)) * (2 * group)
        qn = torch.zeros((n, kp), dtype=torch.uint8, device=device)
        qn[:, :k] = values
        qn = _pack(qn, bits)
        return QuantizedWeight(qn, None, None, lut, n // lut.shape[0], k // lut.shape[1], bits, group, n, k)
    pk = max(p.shape[1] for p in tparams)
    block_k = k // pk
    group = _pow2_factor(block_k, 128)
    kp = -(-k // (2 * group)) * (2 * group)
    kb = kp // group
    it = iter(tparams)
    scale = next(it)
    zero_point = next(it) if attrs.get("has_zero_point") else None
    bias = next(it) if attrs.get("has_bias") else None
    # per-group parameters [N, KB]: group g covers k in [g*group, (g+1)*group), inside one parameter block
    block_of_group = torch.clamp(torch.arange(kb, device=device) * group // block_k, max=pk - 1)
    valid = (torch.arange(kb, device=device) * group < k)[None, :]

    def per_group(p):
        p = _expand(p, (n, pk))
        return torch.where(valid, p[:, block_of_group], torch.zeros((), device=device))

    s = per_group(scale)
    b = per_group(bias) if bias is not None else torch.zeros_like(s)
    shift = (8.0 if bits == 4 else 128.0) if signed else 0.0
    if zero_point is not None or shift:
        z = per_group(zero_point) if zero_point is not None else torch.zeros_like(s)
        b = b - (z + shift) * s
    has_bias = bias is not None or zero_point is not None or shift != 0.0
    if signed:
        values = values ^ (0x8 if bits == 4 else 0x80)          # two's complement -> offset binary
    qn = torch.zeros((n, kp), dtype=torch.uint8, device=device)
    qn[:, :k] = values
    qn = _pack(qn, bits)
    return QuantizedWeight(qn, _maybe_f16(s.contiguous()), _maybe_f16(b.contiguous()) if has_bias else None,
                           None, 1, 1, bits, group, n, k)


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return values.contiguous()
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


# -- the wrapper ----------------------------------------------------------------------------------

def _split_k(programs_n: int, k: int, block_k: int, sms: int) -> int:
    """How many K splits fill the chip (about 4 programs per multiprocessor)."""
    want = max(1, (4 * sms) // max(programs_n, 1))
    return int(max(1, min(want, triton.cdiv(k, block_k), 32)))


_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[device]


def gemv_config(m: int, w: QuantizedWeight) -> dict:
    block_m = max(1, triton.next_power_of_2(m))
    block_k = 256 if block_m <= 2 else (128 if block_m <= 8 else 64)
    block_k = max(block_k, w.group)
    block_n = 32 if block_m == 1 else 16
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor | None = None,
                     config: dict | None = None, precision: str = "tf32x3") -> torch.Tensor:
    """y = x @ W for x [..., K] (float32/float16/bfloat16); y [..., N] of x's dtype.

    Up to GEMV_MAX_ROWS rows: the streaming GEMV kernel; more: the tensor-core GEMM kernel.
    """
    assert x.shape[-1] == w.k, f"quantized_matmul: x has K={x.shape[-1]}, the weight K={w.k}"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    lut = w.lut if w.lut is not None else x2            # unused pointer when not LUT
    s = w.scale if w.scale is not None else x2
    b = w.bias if w.bias is not None else s
    stride_ln, stride_lk = (w.lut.stride(0), w.lut.stride(1)) if w.lut is not None else (0, 0)
    kpb = w.q.shape[1]
    kb = w.scale.shape[1] if w.scale is not None else 0
    stride_sn = w.scale.stride(0) if w.scale is not None else 0
    common = dict(BITS=w.bits, LUT=w.lut is not None, GROUP=w.group, HAS_BIAS=w.bias is not None)
    if m == 0:
        return y.reshape(*lead, w.n)
    if m <= GEMV_MAX_ROWS:
        cfg = {**gemv_config(m, w), **(config or {})}
        block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        magic = cfg.pop("MAGIC", MAGIC_CONVERT)
        split = cfg.pop("SPLIT", None)
        programs_n = triton.cdiv(w.n, block_n)
        if split is None:
            split = _split_k(programs_n, w.k, block_k, _sm_count(x.device))
        k_per_split = triton.cdiv(triton.cdiv(w.k, split), block_k) * block_k
        split = triton.cdiv(w.k, k_per_split)
        atomic = split > 1
        target = y
        if atomic and y.dtype != torch.float32:
            target = torch.zeros((m, w.n), dtype=torch.float32, device=x.device)
        elif atomic:
            y.zero_()
        for m0 in range(0, m, block_m):
            rows = min(block_m, m - m0)
            _qgemv_kernel[(programs_n, split)](
                x2[m0:], w.q, s, b, lut, target[m0:], rows, w.n, w.k, kpb, kb, k_per_split,
                x2.stride(0), w.q.stride(0), stride_sn, target.stride(0),
                w.lut_block_n, w.lut_block_k, stride_ln, stride_lk,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=atomic, MAGIC=magic, **common, **cfg)
        if target is not y:
            y.copy_(target)
    else:
        cfg = dict(config or {})
        block_m = cfg.pop("BLOCK_M", 64 if m <= 64 else 128)
        block_n = cfg.pop("BLOCK_N", 128)
        block_k = cfg.pop("BLOCK_K", 64 if x.dtype == torch.float32 else 64)
        block_k = max(block_k, 16)
        cfg.setdefault("num_warps", 8 if block_m * block_n >= 128 * 128 else 4)
        cfg.setdefault("num_stages", 3)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(w.n, block_n),)
        _qgemm_kernel[grid](
            x2, w.q, s, b, lut, y, m, w.n, w.k, kpb, kb,
            x2.stride(0), w.q.stride(0), stride_sn, y.stride(0),
            w.lut_block_n, w.lut_block_k, stride_ln, stride_lk,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, PRECISION=precision, **common, **cfg)
    return y.reshape(*lead, w.n)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight (tests only: the kernels never build it)."""
    v = w.values().to(torch.float32)
    if w.lut is not None:
        rows = torch.arange(w.n, device=v.device) // w.lut_block_n
        cols = torch.arange(w.k, device=v.device) // w.lut_block_k
        return w.lut[rows[:, None], cols[None, :], v.long()]
    g = torch.arange(w.k, device=v.device) // w.group
    out = v * w.scale.float()[:, g]
    if w.bias is not None:
        out = out + w.bias.float()[:, g]
    return out


def bytes_read(w: QuantizedWeight) -> int:
    return w.nbytes


__all__ = ["QuantizedWeight", "prepare_weight", "quantized_matmul", "dequantize", "GEMV_MAX_ROWS", "math"]
