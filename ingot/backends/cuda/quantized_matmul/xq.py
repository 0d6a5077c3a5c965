"""x rounded for the word GEMV: `_quantize_x_kernel` (its own launch), the helpers the GEMV uses to
round x itself, and `store_xq` (another kernel storing its output as the GEMV reads x)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ....options import DEFAULT_CUDA, CudaOptions
from ....passes.gemv_rules import GATE_ACTIVATIONS
from .. import timeline
from ..pdl import pdl_args, pdl_enter
from ..timeline import now, stamp
from .buffers import _xq_workspace


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _dp4a(a, b, c, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + the dot product of the four bytes of a (unsigned) with those of b (signed if SIGNED), per element."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:  # Triton's interpreter runs no PTX: byte by byte
        total = c
        for i in tl.static_range(4):
            if SIGNED:
                bb = (b << (24 - 8 * i)) >> 24
            else:
                bb = (b >> (8 * i)) & 0xFF
            total += ((a >> (8 * i)) & 0xFF) * bb
        return total


@triton.jit
def _limb_words(X, shifts, LIMB: tl.constexpr):
    """Byte LIMB of each integer of X [a, b, c, 4], four along the last axis packed into one word."""
    return tl.reduce(((X >> (8 * LIMB)) & 0xFF) << shifts, 3, _or)


@triton.jit
def _load_x(x_ptr, x2_ptr, offs, mask, GLU: tl.constexpr):
    """x, or act(x) * x2 (the gated unit of an MLP): GLU 1 silu (as the region kernel computes it),
    2 gelu with the tanh approximation, 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
    (gemv_rules.GATE_ACTIVATIONS)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GLU == 1:
        x = (x * tl.sigmoid(x)) * tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    elif GLU == 2:
        x = (x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))) * \
            tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _load_norm_x(x_ptr, x2_ptr, g_ptr, offs, k, mask, ADD: tl.constexpr, HAS_G: tl.constexpr):
    """(x [+ x2]) * g[k]: an RMSNorm's input times its weight, before the row's factor 1 / rms (which
    multiplies the GEMV's sums instead, a common factor of the row)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        x = x * tl.load(g_ptr + k, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _row_rms(x_ptr, x2_ptr, h_ptr, offs_m, m_mask, stride_xm, K, eps, WRITE, ADD: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """1 / sqrt(mean(h**2) + eps) [ROWS] of the rows offs_m of h = x (+ x2 with ADD), read whole; with ADD,
    h is also stored to h_ptr where WRITE (one program per row does it: the residual stream's next value)."""
    ss = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        offs = offs_m[:, None] * stride_xm + k[None, :]
        mask = m_mask[:, None] & (k < K)[None, :]
        h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            h = h + tl.load(x2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + offs, h, mask=mask & WRITE)
        ss += h * h
    return 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _pow2_scale(top):
    """(2**(148 - e), its inverse) for |x| <= top < 2**(e - 126): x * scale rounds to |X| < 2**22."""
    e = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e_scale = tl.minimum(tl.maximum(275 - e, 1), 254)
    scale = (e_scale << 23).to(tl.float32, bitcast=True)
    inv = (tl.maximum(254 - e_scale, 0) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _block_scale(top, LIMBS: tl.constexpr):
    """(d, 1 / d) with d = top / qmax, qmax = 127 (LIMBS 1) or 32767 (LIMBS 2): |round(x / d)| <= qmax, so
    a block sum of 32 products with 4-bit weights stays below 32767 * 15 * 32 < 2**24 (exact in int32)."""
    top = tl.maximum(top, 1e-30)                 # an all-zero block: X = 0, not 0 * inf
    if LIMBS == 1:
        return top * (1.0 / 127.0), 127.0 / top
    else:
        return top * (1.0 / 32767.0), 32767.0 / top


@triton.jit
def _round_to_int(x, scale):
    """x * scale rounded to the nearest integer (|x * scale| < 2**22) through the exponent bits of 1.5 * 2**23."""
    return (x * scale + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def store_xq(o, b, head0, row_ok, xq_ptr, xd_ptr, xs_ptr, stride_xqm, stride_xdm, LIMBS: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """o [BLOCK_R, BLOCK_DV] stored as `_quantize_x_kernel` stores row b of x for the word GEMV (LIMBS 1
    or 2): limb words, block scales d and block sums of the rounded x, o's row r holding x[b, (head0 +
    r) * BLOCK_DV ...] in blocks of 32 (the decode attention: the query heads of one token)."""
    NB: tl.constexpr = BLOCK_DV // 32
    x = tl.reshape(o, [BLOCK_R, NB, 4, 2, 4])                        # k = 32 nb + 8 j + 4 h + i
    top = tl.max(tl.max(tl.max(tl.abs(x), axis=4), axis=3), axis=2)   # [R, NB]
    d, scale = _block_scale(top, LIMBS)
    X = _round_to_int(x, scale[:, :, None, None, None])
    blk = (head0 + tl.arange(0, BLOCK_R))[:, None] * NB + tl.arange(0, NB)[None, :]   # [R, NB]
    out = (xq_ptr + b * stride_xqm + blk[:, :, None, None] * (8 * LIMBS) + tl.arange(0, 4)[None, None, :, None]
           + tl.arange(0, 2)[None, None, None, :] * 4)                                 # [R, NB, 4 (j), 2 (h)]
    shifts = tl.arange(0, 4)[None, None, None, None, :] * 8
    for limb in tl.static_range(LIMBS):
        tl.store(out + limb * 8, tl.reduce(((X >> (8 * limb)) & 0xFF) << shifts, 4, _or), mask=row_ok[:, None, None, None])
    x_sum = tl.sum(tl.sum(tl.sum(X, axis=4), axis=3), axis=2).to(tl.float32) * d
    tl.store(xd_ptr + b * stride_xdm + blk, d, mask=row_ok[:, None])
    tl.store(xs_ptr + b * stride_xdm + blk, x_sum, mask=row_ok[:, None])


@triton.jit
def _quantize_x_kernel(x_ptr, x2_ptr, xq_ptr, xd_ptr, xs_ptr, K, KB, stride_xm, stride_xqm, stride_xdm,
                       LIMBS: tl.constexpr, BLOCKS: tl.constexpr, GLU: tl.constexpr,
                       g_ptr=None, h_ptr=None, eps=0.0, NORM: tl.constexpr = False, ADD: tl.constexpr = False,
                       HAS_G: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 16, PDL: tl.constexpr = False,
                       z_ptr=None, Z=0, ZERO: tl.constexpr = False, stamp_ptr=None, STAMP: tl.constexpr = 0,
                       PARTS: tl.constexpr = False, ssq_ptr=None):
    """x [M, K] -> what `_qgemv_words_kernel` with XQ loads, for BLOCKS blocks of 32 k of one row:

        xq int32 [M, KB, LIMBS, 2, 4]: word (b, l, h, j) = byte l of X[32b + 8j + 4h + i] at bits 8i (i = 0..3),
                                       h the low (k % 8 < 4) or high half of weight word j of the block
        xd float32 [M, KB]: the block's scale d, x ~ X * d
        xs float32 [M, KB]: the block's sum of x (for bias * sum x)

    X = round(x / d): LIMBS 1/2 with d = max|x_block| / qmax (`_block_scale`), LIMBS 3 with a power of
    two per block (`_pow2_scale`, |X| < 2**22). Lower limbs unsigned, the top one signed. K past the end
    reads as 0. GLU: x = silu(x) * x2, as `_load_x`. xs sums the rounded x (X * d) for LIMBS 1/2, so the
    GEMV computes (X * d) @ W, and x itself for LIMBS 3, as the GEMV without XQ does.

    NORM: x = rms_norm(x [+ x2 with ADD]) * g: (x [+ x2]) * g is rounded, and the row's 1 / rms
    (`_row_rms`, the whole row read by every program) multiplies d and the block sums, so the GEMV
    is unchanged. With ADD the first program of a row stores x + x2 to h_ptr. NORM and PARTS: each
    program reads only its own blocks, stores their sum of squares of x [+ x2] to ssq [M, programs a row],
    and the scales and sums without 1 / rms: the GEMV (XQ_RMS) adds the row's parts and multiplies its
    sums by it. With ADD, each program stores its own blocks of x + x2.

    ZERO: the programs also zero z [Z] (float32, contiguous), the output the GEMV after this kernel
    adds its splits into atomically: no memset between the two, which would keep the GEMV from
    starting while this kernel runs (programmatic dependent launch). STAMP: timeline.py."""
    me = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    t0 = now(STAMP)
    pdl_enter(PDL)
    t1 = now(STAMP)
    pid_b = tl.program_id(0)
    m = tl.program_id(1)
    if ZERO:
        _zero_share(z_ptr, Z, m * tl.num_programs(0) + pid_b, tl.num_programs(0) * tl.num_programs(1))
    r = 1.0
    if NORM and not PARTS:
        rows = m + tl.arange(0, 1)
        r = _row_rms(x_ptr, x2_ptr, h_ptr, rows, rows >= 0, stride_xm, K, eps, pid_b == 0, ADD, 1, NORM_BLOCK)  # [1]
    if PARTS:
        ssq_ptr += m * tl.num_programs(0) + pid_b
    _round_blocks(x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, m, pid_b * BLOCKS + tl.arange(0, BLOCKS), KB, K,
                  stride_xm, stride_xqm, stride_xdm, r, LIMBS, GLU, NORM, ADD, HAS_G, PARTS, h_ptr, ssq_ptr)
    t2 = now(STAMP)
    stamp(stamp_ptr, me, t0, t1, t2, STAMP)


@triton.jit
def _zero_share(z_ptr, Z, index, count):
    """Program `index` of `count` zeroes its share of z [Z] (float32, contiguous)."""
    per = tl.cdiv(Z, count)
    z_start = index * per
    for z0 in range(z_start, z_start + per, 1024):
        offs_z = z0 + tl.arange(0, 1024)
        tl.store(z_ptr + offs_z, tl.zeros([1024], tl.float32), mask=(offs_z < z_start + per) & (offs_z < Z))


@triton.jit
def _round_blocks(x_ptr, x2_ptr, g_ptr, xq_ptr, xd_ptr, xs_ptr, m, blk, b_stop, K, stride_xm, stride_xqm, stride_xdm, r,
                  LIMBS: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, HAS_G: tl.constexpr,
                  PARTS: tl.constexpr = False, h_ptr=None, ssq_ptr=None):
    """Blocks blk [BLOCKS] (those below b_stop) of 32 k of row m of x rounded and stored as
    `_quantize_x_kernel` documents, the scales and block sums multiplied by r (the row's 1 / rms, or 1).
    PARTS (with NORM): also the sum of squares of these blocks of h = x [+ x2] stored to ssq_ptr, and with
    ADD h itself to h_ptr (x's row stride)."""
    k = (blk[:, None, None, None] * 32 + tl.arange(0, 4)[None, :, None, None] * 8
         + tl.arange(0, 2)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])   # [BLOCKS, 4 j, 2 h, 4 i]
    if NORM and PARTS:
        ok = (k < K) & (blk < b_stop)[:, None, None, None]
        h = tl.load(x_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            h = h + tl.load(x2_ptr + m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        x = h
        if HAS_G:
            x = h * tl.load(g_ptr + k, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            tl.store(h_ptr + m * stride_xm + k, h, mask=ok)
        tl.store(ssq_ptr, tl.sum(tl.sum(tl.sum(tl.sum(h * h, axis=3), axis=2), axis=1), axis=0))
    elif NORM:
        x = _load_norm_x(x_ptr, x2_ptr, g_ptr, m * stride_xm + k, k, k < K, ADD, HAS_G)
    else:
        x = _load_x(x_ptr, x2_ptr, m * stride_xm + k, k < K, GLU)
    top = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)                           # [BLOCKS]
    if LIMBS == 3:
        scale, d = _pow2_scale(top)
    else:
        d, scale = _block_scale(top, LIMBS)
    X = _round_to_int(x, scale[:, None, None, None])
    shifts = tl.arange(0, 4)[None, None, None, :] * 8
    b_ok = blk < b_stop
    out = (xq_ptr + m * stride_xqm + blk[:, None, None] * (8 * LIMBS) + tl.arange(0, 4)[None, :, None]
           + tl.arange(0, 2)[None, None, :] * 4)                                              # [BLOCKS, 4 (j), 2 (h)]
    for limb in tl.static_range(LIMBS):
        tl.store(out + limb * 8, _limb_words(X, shifts, limb), mask=b_ok[:, None, None])
    if LIMBS == 3:
        x_sum = tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=1)
    else:   # the sum of the rounded x: y is then exactly (X * d) @ W, whose error follows |W|, not |v * scale|
        x_sum = tl.sum(tl.sum(tl.sum(X, axis=3), axis=2), axis=1).to(tl.float32) * d
    tl.store(xd_ptr + m * stride_xdm + blk, d * r, mask=b_ok)
    tl.store(xs_ptr + m * stride_xdm + blk, x_sum * r, mask=b_ok)




@dataclass
class NormPrologue:
    """x = rms_norm(x [+ add]) * weight, computed as the word GEMV loads x (see `rms_norm_matmul`); with
    `add`, x + add is stored to `total` [M, K] (float32, x's row stride) on the way."""
    weight: torch.Tensor | None
    eps: float
    add: torch.Tensor | None = None
    total: torch.Tensor | None = None

    def kernel_args(self, x2: torch.Tensor) -> dict:
        m, k = x2.shape
        if self.add is not None:
            assert self.add.shape == x2.shape and self.total is not None and self.total.shape == x2.shape
            assert m == 1 or x2.stride() == self.add.stride() == self.total.stride(), "x, add and total share strides"
            assert self.total.dtype == torch.float32
        if self.weight is not None:
            assert self.weight.shape == (k,) and self.weight.stride(0) == 1
        return dict(g_ptr=self.weight if self.weight is not None else x2, h_ptr=self.total if self.total is not None else x2,
                    eps=float(self.eps), NORM=True, ADD=self.add is not None, HAS_G=self.weight is not None,
                    NORM_BLOCK=min(triton.next_power_of_2(k), NORM_BLOCK))


NORM_BLOCK = 1024        # floats of a row per step of the norm prologue's sum of squares (`_row_rms`)


# The quantize launch's tuning (`CudaOptions`), H200: xq_min_bytes 0, x quantized by its own launch
# for every weight size: Llama-3-8B qkv (15.7 MB) 10.0 us with it against 11.2 rounding in the GEMV, o
# (10.5 MB) 7.9 against 8.7; with programmatic dependent launch even SmolLM2's small weights (0.3-3.5 MB):
# a step 740.7 us against 779.7 with an 8 MiB threshold. xq_norm_block 4096 (Llama-3-8B: 324 us of these
# launches a step against 348 at 1024); xq_norm_warps 8 (the step 1905 us against 1919 at 4). With a
# norm over rows of xq_norm_parts_min_k and more, each program rounds only its own blocks and stores their
# sum of squares, and the GEMV adds a row's parts for 1 / rms (XQ_RMS): Llama-3-8B's launch that read the
# whole 4096-float row in every program was busy 3.6 us of a layer's ~58, twice a layer; by parts 1.4, the
# step 1821.7-1827.9 us against 1882.4. SmolLM2's one such launch (576 floats) lost by parts: 498.4 / 496.3.
def _quantize_x(x2: torch.Tensor, x_gate: torch.Tensor | None, limbs: int, norm: NormPrologue | None = None,
                zero: torch.Tensor | None = None, options: CudaOptions = DEFAULT_CUDA, activation: str = "silu") -> dict:
    """x2 (act(x_gate) * x2 when x_gate is given, act the `activation` silu or gelu_tanh; rms_norm(x2 [+ add]) * weight with `norm`) [M, K]
    quantized for the word GEMV's XQ path: the kernel arguments xq_ptr/xd_ptr/xs_ptr (views of the
    stream's workspace) and their sizes. `zero` (float32, contiguous, apart from every input): zeroed
    by the same launch. options: xq_blocks, xq_norm_block, xq_norm_warps, xq_norm_parts_min_k, timeline."""
    m, k = x2.shape
    args = xq_buffers(m, k, limbs, x2.device)
    xq, xd, xs, kb = args["xq_ptr"], args["xd_ptr"], args["xs_ptr"], args["KB"]
    first, second = (x_gate, x2) if x_gate is not None else (x2, x2)
    if x_gate is not None:
        assert x_gate.stride() == x2.stride() and x_gate.shape == x2.shape and norm is None
    extra, gemv, warps = {}, {}, 1
    grid = (triton.cdiv(kb, options.xq_blocks), m)
    if norm is not None:
        extra = norm.kernel_args(x2)
        extra["NORM_BLOCK"] = min(triton.next_power_of_2(k), options.xq_norm_block)
        second = norm.add if norm.add is not None else x2
        if k >= options.xq_norm_parts_min_k:   # each program its own blocks; the GEMV adds the parts
            floats = _xq_workspace(x2.device, 1, kb * m)[1]
            parts = floats[floats.numel() - m * grid[0]:]
            assert floats.numel() - parts.numel() >= 2 * m * kb, "the parts overlap the scales"
            extra.update(PARTS=True, ssq_ptr=parts)
            gemv = dict(XQ_RMS=True, ssq_ptr=parts, nparts=grid[0], NPARTS=triton.next_power_of_2(grid[0]),
                        eps=float(norm.eps))
        else:   # the whole row is read for its sum of squares in every program: more threads for it
            warps = options.xq_norm_warps
    kind = "glu" if x_gate is not None else ("norm" if norm is not None else "x")
    _quantize_x_kernel[grid](
        first, second, xq, xd, xs, k, kb, x2.stride(0), xq.stride(0), xd.stride(0), LIMBS=limbs, BLOCKS=options.xq_blocks,
        GLU=GATE_ACTIVATIONS[activation] if x_gate is not None else 0, num_warps=warps, **extra, **pdl_args(x2.device),
        **(dict(z_ptr=zero, Z=zero.numel(), ZERO=True) if zero is not None else {}),
        **timeline.args(f"quantize {kind} {k}", grid[0] * grid[1], x2.device, options.timeline))
    return {**args, **gemv}


def xq_buffers(m: int, k: int, limbs: int, device, copies: int = 1) -> dict:
    """The word GEMV's pre-quantized x [M, K] in the stream's workspace, as its kernel arguments: limb
    words xq_ptr [M, KB * 8 * limbs], block scales xd_ptr and sums xs_ptr [M, KB] (KB = ceil(K / 32)).
    `_quantize_x` fills them, or a kernel before the GEMV that stores the same (`attention(..., xq=)`).
    copies > 1: that many such sets, copy_q words and copy_d floats apart (XQ_SELF: one per column
    block), the first one where a single set would be."""
    kb = triton.cdiv(k, 32)
    words, floats = _xq_workspace(device, copies * m * kb * 8 * limbs, copies * m * kb)
    xq = words[: m * kb * 8 * limbs].view(m, kb * 8 * limbs)
    xd, xs = floats[: m * kb].view(m, kb), floats[m * kb: 2 * m * kb].view(m, kb)
    return dict(xq_ptr=xq, xd_ptr=xd, xs_ptr=xs, KB=kb, stride_xqm=xq.stride(0), stride_xdm=xd.stride(0),
                **(dict(copy_q=m * kb * 8 * limbs, copy_d=2 * m * kb) if copies > 1 else {}))

