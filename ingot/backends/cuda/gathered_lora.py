"""Gathered LoRA on the CUDA backend: each row through its own adapter, in two Triton launches (the
shrink and expand of S-LoRA/Punica), the FUSED "gathered_lora" op of passes/fuse_gathered_lora.py.

    delta[r] = (x[r] @ A[which[r]]) @ B[which[r]]      x [R, K]  A [E, K, RANK]  B [E, RANK, N]  which [R]

- `_shrink_kernel`, one program per (row, split of K): the row's slice of x times the same rows of
  its adapter's A, a partial [RANK] per split (no atomics: the sum order is fixed).
- `_expand_kernel`, one program per (row, tile of N): the partials summed in split order, times its
  adapter's B tile.

Only the chosen adapter's factors are read (no [R, K, RANK] gather copy as gather + matmul makes:
64 rows of a 4096-wide site at rank 16 copy 16 MB per site, 4 sites a layer), rows sharing an
adapter read it from L2. Every row is computed by its own programs with tile sizes that depend on the
shapes of the factors only, so a row's delta is the same whatever the other rows or their number; a
row whose factors are zero gets exactly 0; indices wrap as NumPy's (-1 is the last adapter) and one
outside [-E, E) gives 0 (nothing read; the gather op's lowering clamps it, the reference raises).
The indices are a device tensor: a captured CUDA graph replays any mix of adapters.
Registered by importing this module (backends/cuda/__init__.py).

    >>> delta = gathered_lora(x, a, b, which)   # doctest: +SKIP
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_lowerings import fused_lowering, param
from .lowerings import Lowering

K_PER_SPLIT = 512      # x columns one shrink program reduces: 8 splits at K 4096, 28 at 14336
MAX_RANK_PAD = 512     # larger stacked ranks run as gather + matmul (the op's parts)
SHRINK_TILE = 4096     # elements of a shrink program's A tile and accumulator (rank 64: 90 registers, not 167)
EXPAND_TILE = 8192     # elements of an expand program's B tile


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, which_ptr, part_ptr, K, RANK, E, SPLITS,
                   sx_r, sa_e, sa_k, sp_r,
                   BLOCK_K: tl.constexpr, RANK_PAD: tl.constexpr, PER_SPLIT: tl.constexpr):
    """part[r, s, :] = x[r, k range s] @ A[which[r], k range s, :] (zeros for an index outside A)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    w = tl.load(which_ptr + r)
    w = tl.where(w < 0, w + E, w)     # negative indices wrap as NumPy's take
    valid = (w >= 0) & (w < E)
    w64 = tl.where(valid, w, 0).to(tl.int64)
    ranks = tl.arange(0, RANK_PAD)
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K, RANK_PAD], tl.float32)
    start = s * PER_SPLIT
    for k0 in range(0, PER_SPLIT, BLOCK_K):
        k = start + k0 + offs
        in_k = (k < K) & valid
        xv = tl.load(x_ptr + r * sx_r + k, mask=in_k, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + w64 * sa_e + k[:, None] * sa_k + ranks[None, :],
                     mask=in_k[:, None] & (ranks[None, :] < RANK), other=0.0).to(tl.float32)
        acc += xv[:, None] * av
    tl.store(part_ptr + r * sp_r + s * RANK_PAD + ranks, tl.sum(acc, axis=0))


@triton.jit
def _expand_kernel(part_ptr, b_ptr, which_ptr, out_ptr, N, RANK, E, SPLITS,
                   sp_r, sb_e, sb_k, so_r,
                   BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out[r, n tile] = (sum over splits of part[r]) @ B[which[r], :, n tile] (zeros outside B)."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.load(which_ptr + r)
    w = tl.where(w < 0, w + E, w)     # negative indices wrap as NumPy's take
    valid = (w >= 0) & (w < E)
    w64 = tl.where(valid, w, 0).to(tl.int64)
    ranks = tl.arange(0, RANK_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    parts = tl.load(part_ptr + r * sp_r + splits[:, None] * RANK_PAD + ranks[None, :],
                    mask=splits[:, None] < SPLITS, other=0.0)
    t = tl.sum(parts, axis=0)                                                   # [RANK_PAD]
    bv = tl.load(b_ptr + w64 * sb_e + ranks[:, None] * sb_k + n[None, :],
                 mask=(ranks[:, None] < RANK) & (n[None, :] < N) & valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * so_r + n, tl.sum(t[:, None] * bv, axis=0).to(out_ptr.dtype.element_ty), mask=n < N)


def supported(rank: int) -> bool:
    return rank <= MAX_RANK_PAD


def gathered_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """delta [R, N] = each row's (x[r] @ a[which[r]]) @ b[which[r]]; x [R, K], a [E, K, RANK],
    b [E, RANK, N] (float32 or narrower, the last axis contiguous), which [R] int32/int64."""
    rows, k = x.shape
    experts, rank, n = b.shape
    assert a.shape == (experts, k, rank) and which.shape == (rows,), (x.shape, a.shape, b.shape, which.shape)
    assert supported(rank), f"rank {rank} > {MAX_RANK_PAD}"
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(2) != 1:
        a = a.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    rank_pad = max(triton.next_power_of_2(rank), 2)
    splits = triton.cdiv(k, K_PER_SPLIT)
    block_k = max(16, min(128, SHRINK_TILE // rank_pad, triton.next_power_of_2(k)))
    per_split = triton.cdiv(min(k, K_PER_SPLIT), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    part = torch.empty((rows, splits, rank_pad), dtype=torch.float32, device=x.device)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    _shrink_kernel[(rows, splits)](x, a, which, part, k, rank, experts, splits,
                                   x.stride(0), a.stride(0), a.stride(1), part.stride(0),
                                   BLOCK_K=block_k, RANK_PAD=rank_pad, PER_SPLIT=per_split, num_warps=4)
    block_n = max(16, min(128, EXPAND_TILE // rank_pad, triton.next_power_of_2(n)))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](part, b, which, out, n, rank, experts, splits,
                                                    part.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                                    BLOCK_N=block_n, RANK_PAD=rank_pad,
                                                    SPLITS_PAD=max(triton.next_power_of_2(splits), 2), num_warps=4)
    return out


@fused_lowering("gathered_lora")
def _gathered_lora(ctx: Lowering):
    """matmul(matmul(x [R, 1, K], gather(A, which)), gather(B, which)) -> [R, 1, N] as the two kernels."""
    up = ctx.node.attrs["body"].outputs[0]
    down, b_rows = up.src
    x, a_rows = down.src
    if not supported(b_rows.type.shape[1]) or up.dtype.name != "float32":
        return None
    ctx.reads = (param(x), param(a_rows.src[0]), param(b_rows.src[0]), param(a_rows.src[1]))
    ctx.plan.fusions.append("gathered lora (shrink + expand)")

    def step(x, a, b, which):
        rows = x.shape[0]
        return gathered_lora(x.reshape(rows, x.shape[-1]), a, b, which).reshape(rows, 1, b.shape[-1])
    return step, "gathered_lora"
