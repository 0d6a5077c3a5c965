"""The weight as the kernels read it: `QuantizedWeight`, re-packed once at load (`prepare_weight`)."""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
import torch

from .... import dtypes as dt

@dataclass
class QuantizedWeight:
    """A quantized logical [K, N] weight in the kernels' k-major unsigned form (module docstring)."""

    q: torch.Tensor                 # uint8 [Kp, Np/2] or [Kp, Np]
    scale: torch.Tensor | None      # [Kp/GROUP, Np] (affine)
    bias: torch.Tensor | None       # [Kp/GROUP, Np] (affine; None when zero)
    lut: torch.Tensor | None        # float32 [pK, pN, 2**bits] (lookup table)
    lut_block_k: int
    lut_block_n: int
    bits: int
    group: int                      # K rows per parameter row (a power of two)
    k: int
    n: int
    words: bool = False             # 4-bit affine in the word layout: q int32 [Kp/8, Np] (prepare_weight)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.bias, self.lut) if t is not None)

    @property
    def nq(self) -> int:
        """Columns of q (bytes per row)."""
        return self.q.shape[1]

    def values(self) -> torch.Tensor:
        """The unsigned stored integers [K, N] (tests, dequantize)."""
        if self.words:
            shifts = torch.tensor([0, 8, 16, 24, 4, 12, 20, 28], dtype=torch.int32, device=self.q.device)
            v = (self.q[:, None, :] >> shifts[None, :, None]) & 0xF            # [Kp/8, 8, Np]
            return v.reshape(-1, self.q.shape[1]).to(torch.uint8)[: self.k, : self.n]
        if self.bits == 4:
            return torch.stack([self.q & 0xF, self.q >> 4], dim=-1).reshape(self.q.shape[0], -1)[: self.k, : self.n]
        return self.q[: self.k, : self.n]


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
    """p as float16 where that is exact (as GGUF's f16 scales are): half the parameter bytes."""
    h = p.to(torch.float16)
    if torch.isfinite(h).all() and torch.equal(h.to(torch.float32), p):
        return h
    return p


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return values.contiguous()
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def prepare_weight(q: np.ndarray, params: list[np.ndarray], attrs: dict, device, words: bool = False) -> QuantizedWeight:
    """Re-pack a quantized_matmul/quantized_gather weight (Ingot's layout, numpy) for the kernels.

    transpose=False: q is the logical [K, N] weight (4-bit packed along N); transpose=True: q is
    [N, K] (4-bit packed along K). Parameters are block-broadcast with q's rank; a LUT has an extra
    last axis of 2**bits entries.

    words: 4-bit affine weights whose parameter groups span 32 k or more are stored in the word
    layout that `_qgemv_words_kernel` streams: int32 [Kp/8, Np], the word of (r, n) holding
    W[8r + b, n] in the low nibble of byte b and W[8r + 4 + b, n] in its high nibble (b = 0..3), so
    one 16-byte load is 8 k by 4 columns and the nibbles of a byte half line up with 4 consecutive k.
    """
    if attrs["mode"] == "scaled_lut":   # GGUF's IQ types, MXFP4: gguf_kernels.py's kernels
        return prepare_scaled(q, params, attrs, device)
    qdtype = attrs["qdtype"]
    bits = 4 if qdtype.packed else 8
    signed = qdtype.kind == "i"
    transpose = bool(attrs.get("transpose"))
    qt = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    if bits == 4:
        values = torch.stack([qt & 0xF, qt >> 4], dim=-1).reshape(qt.shape[0], -1)  # raw nibbles
    else:
        values = qt.view(torch.uint8)
    tparams = [torch.from_numpy(np.ascontiguousarray(p)).to(device=device, dtype=torch.float32) for p in params]
    if transpose:                                              # -> k-major [K, N]
        values = values.t()
        tparams = [p.transpose(0, 1) for p in tparams]
    k, n = values.shape
    np_ = n + (n % 2 if bits == 4 else 0)
    if attrs["mode"] == "lut":
        lut = tparams[0].contiguous()                          # [pK, pN, 2**bits]
        block_k = k // lut.shape[0]
        group = _pow2_factor(block_k, 64)
        kp = -(-k // group) * group
        qk = torch.zeros((kp, np_), dtype=torch.uint8, device=device)
        qk[:k, :n] = values
        return QuantizedWeight(_pack(qk, bits), None, None, lut, block_k, n // lut.shape[1], bits, group, k, n)
    pk = max(p.shape[0] for p in tparams)
    block_k = k // pk
    group = _pow2_factor(block_k, 128)
    kp = -(-k // group) * group
    kb = kp // group
    it = iter(tparams)
    scale = next(it)
    zero_point = next(it) if attrs.get("has_zero_point") else None
    bias = next(it) if attrs.get("has_bias") else None
    # parameters per group of `group` rows: group g covers k in [g*group, (g+1)*group), inside one block
    block_of_group = torch.clamp(torch.arange(kb, device=device) * group // block_k, max=pk - 1)
    valid = (torch.arange(kb, device=device) * group < k)[:, None]

    def per_group(p):
        p = _expand(p, (pk, n))[block_of_group]
        p = torch.where(valid, p, torch.zeros((), device=device))
        return torch.nn.functional.pad(p, (0, np_ - n))

    s = per_group(scale)
    b = per_group(bias) if bias is not None else torch.zeros_like(s)
    shift = (8.0 if bits == 4 else 128.0) if signed else 0.0
    if zero_point is not None or shift:
        z = per_group(zero_point) if zero_point is not None else torch.zeros_like(s)
        b = b - (z + shift) * s
    has_bias = bias is not None or zero_point is not None or shift != 0.0
    if signed:
        values = values ^ (0x8 if bits == 4 else 0x80)          # two's complement -> offset binary
    qk = torch.zeros((kp, np_), dtype=torch.uint8, device=device)
    qk[:k, :n] = values
    words = words and bits == 4 and group % 32 == 0
    packed = _words(qk) if words else _pack(qk, bits)
    return QuantizedWeight(packed, _maybe_f16(s.contiguous()), _maybe_f16(b.contiguous()) if has_bias else None,
                           None, 1, 1, bits, group, k, n, words)


@dataclass
class ScaledTableWeight:
    """A scaled-table logical [K, N] weight in the kernels' form: q as a lookup-table QuantizedWeight's,
    lut float32 [pK, pN, 2**bits], scale [Kp / group, Np] (float32, or float16 where exact), bias (lut4:bB:offset)
    as the scales or None. Not a
    QuantizedWeight: code that reads those (the word GEMV, concatenation) sees `words` False and a
    table, and leaves it to `scaled_matmul`."""

    q: torch.Tensor
    scale: torch.Tensor
    lut: torch.Tensor
    lut_block_k: int
    lut_block_n: int
    bits: int
    group: int
    k: int
    n: int
    words: bool = False
    bias: torch.Tensor | None = None
    scaled: bool = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.lut, self.bias) if t is not None)

    @property
    def nq(self) -> int:
        return self.q.shape[1]


def prepare_scaled(q: np.ndarray, params: list[np.ndarray], attrs: dict, device) -> ScaledTableWeight:
    """Re-pack a scaled-table quantized_matmul/quantized_gather weight (params [lut, scale] or, for
    lut4:bB:offset, [lut, scale, bias]; Ingot's layout; attrs' transpose as `prepare_weight`'s) for the
    kernels: the scales and biases as an unsigned affine weight's."""
    has_bias = bool(attrs.get("has_bias"))
    table = prepare_weight(q, params[:1], dict(attrs, mode="lut"), device)
    uint = dt.uint4 if attrs["qdtype"].packed else dt.uint8
    scales = prepare_weight(q, params[1:3] if has_bias else params[1:2],
                            dict(attrs, mode="affine", qdtype=uint, has_zero_point=False, has_bias=has_bias), device)
    return ScaledTableWeight(table.q, scales.scale, table.lut, table.lut_block_k, table.lut_block_n, table.bits,
                             scales.group, table.k, table.n, bias=scales.bias)


def _words(values: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [Kp, Np] (Kp a multiple of 8) in the word layout (prepare_weight) as int32 [Kp/8, Np]."""
    kp, np_ = values.shape
    v = values.reshape(kp // 8, 2, 4, np_)
    packed = (v[:, 0] | (v[:, 1] << 4)).permute(0, 2, 1).contiguous()     # [Kp/8, Np, 4] bytes
    return packed.view(torch.int32).reshape(kp // 8, np_)


def concatenate(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Weights of one kind side by side along N (one GEMV for sibling matmuls), or None."""
    w0 = parts[0]
    if any(getattr(p, "scaled", False) for p in parts):
        return _concatenate_scaled(parts)
    if any(p.lut is not None or p.bits != w0.bits or p.group != w0.group or p.k != w0.k or p.q.shape[0] != w0.q.shape[0]
           or p.words != w0.words
           or p.scale.dtype != w0.scale.dtype or (p.bits == 4 and p.n % 2) for p in parts):
        return None
    has_bias = any(p.bias is not None for p in parts)
    biases = [p.bias if p.bias is not None else torch.zeros_like(p.scale) for p in parts]
    if has_bias and len({b.dtype for b in biases}) > 1:
        biases = [b.float() for b in biases]
    return QuantizedWeight(torch.cat([p.q for p in parts], dim=1), torch.cat([p.scale for p in parts], dim=1),
                           torch.cat(biases, dim=1) if has_bias else None, None, 1, 1, w0.bits, w0.group, w0.k,
                           sum(p.n for p in parts), w0.words)


def _concatenate_scaled(parts: list[ScaledTableWeight]) -> ScaledTableWeight | None:
    """Scaled tables side by side along N (q/k/v, gate/up of lut4:bB[:offset] or GGUF's IQ types), or None.
    Their tables are repeated to the columns' greatest common table block: q's one table for 576 columns
    beside k's for 192 becomes three of 192."""
    w0 = parts[0]
    if any(not getattr(p, "scaled", False) or p.bits != w0.bits or p.group != w0.group or p.k != w0.k
           or p.q.shape[0] != w0.q.shape[0] or p.lut_block_k != w0.lut_block_k or p.lut.shape[0] != w0.lut.shape[0]
           or p.n % p.lut_block_n or p.scale.shape[1] != p.n or (p.bias is None) != (w0.bias is None)
           or p.scale.dtype != w0.scale.dtype or (p.bits == 4 and p.n % 2) for p in parts):
        return None
    block_n = math.gcd(*(p.lut_block_n for p in parts))
    luts = [p.lut.repeat_interleave(p.lut_block_n // block_n, dim=1) for p in parts]
    biases = None
    if w0.bias is not None:
        biases = [p.bias for p in parts] if len({p.bias.dtype for p in parts}) == 1 else [p.bias.float() for p in parts]
    return ScaledTableWeight(torch.cat([p.q for p in parts], dim=1), torch.cat([p.scale for p in parts], dim=1),
                             torch.cat(luts, dim=1).contiguous(), w0.lut_block_k, block_n, w0.bits, w0.group, w0.k,
                             sum(p.n for p in parts), bias=None if biases is None else torch.cat(biases, dim=1))


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [K, N] weight (tests and benchmarks only: the kernels never build it)."""
    v = w.values().to(torch.float32)
    if w.lut is not None:
        rows = torch.arange(w.k, device=v.device) // w.lut_block_k
        cols = torch.arange(w.n, device=v.device) // w.lut_block_n
        return w.lut[rows[:, None], cols[None, :], v.long()]
    g = torch.arange(w.k, device=v.device) // w.group
    out = v * w.scale.float()[g, : w.n]
    if w.bias is not None:
        out = out + w.bias.float()[g, : w.n]
    return out
