"""Fused scaled-dot-product attention on the GPU (Triton): decode and prefill, reading the KV cache in place.

Semantics are those of the SDPA op's NumPy reference (ingot/ops/nn.py): q [B, Hq, Tq, D],
k [B, Hk, Tk, D], v [B, Hk, Tk, Dv], Hq a multiple of Hk (GQA); keys at or past `length` are
ignored; `causal` lets query t see key j when j <= t + length - Tq; a row that sees no key is zeros.
The length may be a device scalar, read by the kernels, so a captured CUDA graph serves every
position.

- `_decode_kernel` + `_combine_kernel`: few query rows over a long cache. One program per
  (batch, KV head, split of the keys): the Hq/Hk query heads of a group share every K/V load; the
  keys are split over programs (split-KV, the chunk sized from the runtime length, at least ~32 KB
  of K+V per split), only the splits that see keys run, and the partial softmaxes are merged by the
  last of them (a ticket) or a second kernel. A short cache has one such split, which writes the
  output itself.
- `_flash_kernel`: many query rows (prefill): FlashAttention-2 tiles in two stages (the key tiles
  every row of the block sees without any masking, then the diagonal and tail tiles masked), the
  causal blocks with the most keys first, an optional additive mask read through broadcast strides.

The package: decode.py (the split-KV kernels and their wrapper), prefill.py (the flash kernel and its
wrapper), and here `attention`, which shapes the operands and picks one. Tuning: `CudaOptions`.

    >>> out = attention(q, k_cache, v_cache, length=pos_plus_one, causal=True)   # doctest: +SKIP
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import triton

from ....ops.nn import rope_cos_sin
from ....options import DEFAULT_CUDA, CudaOptions
from . import decode, prefill
from .decode import DECODE_MAX_ROWS, _combine_kernel, _decode_kernel, _decode_min_chunk  # noqa: F401
from .prefill import _ensure_allocator, _flash_config, _flash_kernel, _tma_ok  # noqa: F401

LOG2E = 1.4426950408889634


@dataclass
class RopeWrite:
    """What `attention(..., rope=)` rotates and writes: the 0-d integer position (on the device), RoPE's
    inverse frequencies [HALF] (float32; rotary dims 2 * HALF <= D), the new token's k and v rows
    [..., Hk, T, D] (written into the caches at position + t), the pairing (interleaved or halves) and
    the cos/sin table of every cache position (`rope_table`, float32 [rows, HALF] each)."""
    pos: torch.Tensor
    inv_freq: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    interleaved: bool
    cos_sin: tuple[torch.Tensor, torch.Tensor]


@dataclass
class XQTarget:
    """Where `attention(..., xq=)` stores its output rounded as `quantized_matmul._quantize_x` would for
    the word GEMV reading it as x [B, Hq * Dv]: limb words xq [B, KB * 8 * limbs] (int32), block scales
    xd and sums xs [B, KB] (float32), KB = Hq * Dv / 32; `zero`: float32 zeroed by the same launch
    (the GEMV's split-K output). `written` is set when the kernel did it (else the caller quantizes)."""
    xq: torch.Tensor
    xd: torch.Tensor
    xs: torch.Tensor
    limbs: int
    zero: torch.Tensor | None = None
    written: bool = False


def rope_table(inv_freq: np.ndarray, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, HALF] (float32) of positions 0..rows-1, float64 angles as the CPU backend and
    `fused._rope_row` compute them: `RopeWrite.cos_sin`, read by the decode kernel instead of computing them."""
    cos, sin = rope_cos_sin(np.arange(rows), np.asarray(inv_freq))
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def _qmm_workspace(device, floats, tickets):
    from ..quantized_matmul import _workspace
    return _workspace(device, floats, tickets)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass
class Problem:
    """What `attention` hands the decode and prefill wrappers: q/k/v/out as [B, H, T, D] (B the batch
    dimensions flattened), their sizes, the length (a device pointer or a constant) and the scale."""
    q4: torch.Tensor
    k4: torch.Tensor
    v4: torch.Tensor
    o4: torch.Tensor
    result: torch.Tensor
    batch: tuple
    nb: int
    hq: int
    hk: int
    group: int
    tq: int
    tbuf: int
    d: int
    dv: int
    block_d: int
    block_dv: int
    f32: bool
    qk_scale: float
    len_ptr: torch.Tensor
    len_const: int
    from_ptr: bool
    length_offset: int
    four: Callable[[torch.Tensor], torch.Tensor]
    scales: tuple[torch.Tensor, torch.Tensor] | None = None   # an int8 cache's row scales [nb, Hk, TBUF, 1]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int | torch.Tensor | None = None,
              scale: float | None = None, causal: bool = False, mask: torch.Tensor | None = None,
              out: torch.Tensor | None = None, split: int | None = None, precision: str | None = None,
              block_n: int | None = None, num_warps: int | None = None, block_m: int | None = None,
              num_stages: int | None = None, merge: bool | None = None, split_stages: bool = True,
              heavy_first: bool = True, heads_on_axis0: bool = True, tma: bool = False,
              min_chunk: int | None = None,
              rope: RopeWrite | None = None, xq: XQTarget | None = None,
              zero: torch.Tensor | None = None, length_offset: int = 0, fresh: bool | None = None,
              early: bool = False, chunk_align: int | None = None, gluon: bool | dict | None = None,
              scales: tuple[torch.Tensor, torch.Tensor] | None = None,
              options: CudaOptions = DEFAULT_CUDA) -> torch.Tensor:
    """softmax(q k^T * scale (+ mask), causal) v over the first `length` (+ `length_offset`) keys; GQA by
    head groups.

    q [..., Hq, Tq, D], k [..., Hk, Tk, D], v [..., Hk, Tk, Dv]; length an int or a 0-d integer
    device tensor (read by the kernel: no host sync; the decode kernels add `length_offset` to it
    themselves, so a decode step passes its position and 1, with no launch to add them); mask bool
    or additive, broadcast to the scores.
    Prefill variants (the flash kernel): `split_stages` runs the key tiles below the causal diagonal
    unmasked, `heavy_first` starts the causal query blocks with the most keys first,
    `heads_on_axis0` puts the heads on grid axis 0 (the first wave: the heaviest block of every head;
    H200, causal bf16 T 4096: 421 TFLOP/s against 405 with the blocks on axis 0), `tma` loads Q/K/V
    through tensor descriptors (16-bit inputs with 16-byte aligned rows; otherwise the pointer loads).
    `gluon` (None: options.prefill_hopper, by default head dim 128 from prefill_hopper_min_rows query rows) runs the
    Hopper kernel of `flash_sm90` where it applies (16-bit, head dim 64 or 128, no mask, sm_90): the
    softmax of a key tile overlaps the tensor cores' P V product of the tile before; a dict passes
    `flash_sm90`'s options (block_n, stages, maxnreg).
    Decode (the split-KV kernel): only the splits that see keys run, and one such split writes the
    output itself (no partials, ticket or merge); `min_chunk` is the fewest keys per split (None:
    about 32 KB of K+V, e.g. 64 keys at f32 d 64; 0 or 1: no minimum); `chunk_align`: a split's keys
    are a multiple of it (None: options.decode_chunk_align, else the key tile); `split` and `merge`
    force the split count and where the splits are merged.

    `rope`: q is RoPE's input, rotated here, and the new token's k and v (`RopeWrite`) are written into
    the caches k and v at its position first: in the decode kernel itself when there is one query row
    (no launch for them), else by `fused.rope_qkv_into` ahead of the attention. There `fresh` (None:
    with `early`, where the first K+V tile is at most options.decode_fresh_tile_bytes) takes the new key and value from
    registers instead of reading them back, so the cache loads do not wait for the write. `early` (with
    `rope`, on a device with programmatic dependent launch): the length, the position, the caches'
    first key tile and the RoPE table are read while the kernel ahead on the stream still runs; only
    for a caller that knows that kernel writes none of them (the executor's decode step: the caches
    are written by this launch alone).

    `scales`: k and v are an int8 cache's codes and these their row scales (k_scales [..., Hk, Tk, 1],
    v_scales likewise, float32): the kernels multiply each key's score and each value's weight by its
    row's scale as they read the tiles (no float copy of the cache; not with a mask); with `rope` the
    new rows are quantized as they are written.

    `xq`: the output is also stored rounded for the word GEMV that reads it next (`XQTarget`), where the
    decode kernel writes each head's output itself (one query row, no combine launch); `xq.written`
    says whether it did; `xq.zero` is zeroed only where it did. `zero` (float32, contiguous, apart from
    every operand): zero when this returns, whatever `xq` got, the split-K output of the GEMV after the
    attention; the decode kernel zeroes it in its own launch (no memset between the two), other paths
    by a memset.
    """
    assert zero is None or xq is None or xq.zero is None, "attention: zero= or xq.zero, not both"
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if rope is not None and not (mask is None and q.shape[-2] == 1 and q.shape[-3] // k.shape[-3] <= DECODE_MAX_ROWS
                                 and k.shape[:-3] == v.shape[:-3] == batch and q.shape[-1] == k.shape[-1]):
        from ..fused import rope_qkv_into
        q = rope_qkv_into(q, rope.k, rope.v, rope.pos, rope.inv_freq, k, v, rope.interleaved, scales)
        rope = None
    hq, tq, d = q.shape[-3:]
    hk, tbuf, _ = k.shape[-3:]
    dv = v.shape[-1]
    assert hq % hk == 0 and k.shape[-1] == d and v.shape[-2] == tbuf, "attention: q/k/v shapes do not fit"
    group = hq // hk
    nb = math.prod(batch)

    def four(x):
        x = x.expand(*batch, *x.shape[-3:]).reshape(nb, *x.shape[-3:])
        return _last_contiguous(x)

    q4, k4, v4 = four(q), four(k), four(v)
    result = out if out is not None else torch.empty((*batch, hq, tq, dv), dtype=q.dtype, device=q.device)
    o4 = result.view(nb, hq, tq, dv)
    qk_scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    decodes = mask is None and group * tq <= DECODE_MAX_ROWS
    if isinstance(length, torch.Tensor):
        len_ptr, len_const, from_ptr = length, 0, True
        if length_offset and not decodes:   # the flash kernel: added here
            len_ptr, length_offset = length + length_offset, 0
    else:
        length = tbuf if length is None else int(length) + length_offset
        len_ptr, len_const, from_ptr, length_offset = q4, min(max(length, 0), tbuf), False, 0
    if (nb == 0 or tq == 0 or not decodes) and zero is not None:
        zero.zero_()
        zero = None
    if nb == 0 or tq == 0:
        return result
    if scales is not None:
        assert mask is None and k.dtype == v.dtype == torch.int8 and \
            all(s.dtype == torch.float32 and s.shape[-3:] == x.shape[-3:-1] + (1,) for s, x in zip(scales, (k, v))), \
            "attention: int8 K/V codes with float32 row scales [..., Hk, Tk, 1]"
        scales = tuple(four(s) for s in scales)
    p = Problem(q4, k4, v4, o4, result, tuple(batch), nb, hq, hk, group, tq, tbuf, d, dv,
                max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv)), q.dtype == torch.float32,
                qk_scale, len_ptr, len_const, from_ptr, length_offset, four, scales)
    if decodes:      # few query rows: the decode kernel, at options.decode_precision (bf16 is the prefill's)
        # a narrower cache (bfloat16 KV under float32 q) is widened tile by tile in the kernel
        precision = None if precision in ("bf16", "f16") else precision
        return decode.decode_attention(p, causal, split, precision, block_n, num_warps, num_stages, merge, min_chunk,
                                       rope, xq, zero, fresh, early, chunk_align, options)
    return prefill.prefill_attention(p, causal, mask, precision, block_n, num_warps, block_m, num_stages, split_stages,
                                     heavy_first, heads_on_axis0, tma, gluon, options)
