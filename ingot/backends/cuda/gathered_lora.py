"""Gathered LoRA on the CUDA backend: each row through its own adapter, in two Triton launches (the
shrink and expand of S-LoRA/Punica), the FUSED "gathered_lora" op of passes/fuse_gathered_lora.py.

    out[r] = y[r] + (x[r] @ A[which[r]]) @ B[which[r]]      x [R, K]  A [E, K, RANK]  B [E, RANK, N]  which [R]

- `_shrink_kernel`, one program per (row, split of K): the row's slice of x times the same rows of
  its adapter's A, a partial [RANK] per split (no atomics: the sum order is fixed). x is read as
  stored, or computed as it is loaded the way the weight's GEMV computes it (so the GEMV keeps its
  fusions): act(gate) * up, or an rms_norm's input times its weight, the row's 1 / rms applied later.
- `_expand_kernel`, one program per (row, tile of N): the partials summed in split order (times 1 / rms),
  times its adapter's B tile, plus y (the weight's output) where given.

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

from ... import dtypes as dt
from ...ir import Op
from ...passes.gemv_rules import GATE_ACTIVATIONS, gate_activation, glu_parts, last_axis_slice
from .fused_lowerings import fused_lowering, param
from .lowerings import Lowering
from .quantized_matmul.xq import _load_x

K_PER_SPLIT = 512      # x columns one shrink program reduces: 8 splits at K 4096, 28 at 14336
MAX_RANK_PAD = 512     # larger stacked ranks run as gather + matmul (the op's parts)
SHRINK_TILE = 4096     # elements of a shrink program's A tile and accumulator (rank 64: 90 registers, not 167)
EXPAND_TILE = 8192     # elements of an expand program's B tile


@triton.jit
def _shrink_kernel(x_ptr, x2_ptr, g_ptr, a_ptr, which_ptr, part_ptr, ss_ptr, K, RANK, E,
                   sx_r, sx2_r, sa_e, sa_k, sp_r, ss_r,
                   BLOCK_K: tl.constexpr, RANK_PAD: tl.constexpr, PER_SPLIT: tl.constexpr,
                   GLU: tl.constexpr, NORM: tl.constexpr, HAS_G: tl.constexpr):
    """part[r, s, :] = x[r, k range s] @ A[which[r], k range s, :] (zeros for an index outside A), x
    the row as stored, or act(x) * x2 (GLU 1 silu, 2 gelu_tanh), or with NORM an rms_norm's input times
    its weight g, its sum of squares over the range stored in ss[r, s] (the expand applies 1 / rms)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    w = tl.load(which_ptr + r)
    w = tl.where(w < 0, w + E, w)     # negative indices wrap as NumPy's take
    valid = (w >= 0) & (w < E)
    w64 = tl.where(valid, w, 0).to(tl.int64)
    ranks = tl.arange(0, RANK_PAD)
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K, RANK_PAD], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    start = s * PER_SPLIT
    for k0 in range(0, PER_SPLIT, BLOCK_K):
        k = start + k0 + offs
        in_k = (k < K) & valid
        xv = _load_x(x_ptr + r * sx_r, x2_ptr + r * sx2_r, k, in_k, GLU)
        if NORM:
            squares += xv * xv
            if HAS_G:
                xv *= tl.load(g_ptr + k, mask=in_k, other=0.0)
        av = tl.load(a_ptr + w64 * sa_e + k[:, None] * sa_k + ranks[None, :],
                     mask=in_k[:, None] & (ranks[None, :] < RANK), other=0.0).to(tl.float32)
        acc += xv[:, None] * av
    tl.store(part_ptr + r * sp_r + s * RANK_PAD + ranks, tl.sum(acc, axis=0))
    if NORM:
        tl.store(ss_ptr + r * ss_r + s, tl.sum(squares, axis=0))


@triton.jit
def _expand_kernel(part_ptr, ss_ptr, b_ptr, which_ptr, y_ptr, out_ptr, N, RANK, E, SPLITS, K, eps,
                   sp_r, ss_r, sb_e, sb_k, sy_r, so_r,
                   BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                   NORM: tl.constexpr, HAS_Y: tl.constexpr):
    """out[r, n tile] = [y[r, n tile] +] (sum over splits of part[r]) [/ rms] @ B[which[r], :, n tile]
    (no delta for an index outside B)."""
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.load(which_ptr + r)
    w = tl.where(w < 0, w + E, w)
    valid = (w >= 0) & (w < E)
    w64 = tl.where(valid, w, 0).to(tl.int64)
    ranks = tl.arange(0, RANK_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    parts = tl.load(part_ptr + r * sp_r + splits[:, None] * RANK_PAD + ranks[None, :],
                    mask=splits[:, None] < SPLITS, other=0.0)
    t = tl.sum(parts, axis=0)                                                   # [RANK_PAD]
    if NORM:   # the rms_norm's 1 / rms, a common factor of the row's sums (as the GEMV applies it)
        total = tl.sum(tl.load(ss_ptr + r * ss_r + splits, mask=splits < SPLITS, other=0.0), axis=0)
        t = t / tl.sqrt(total / K + eps)
    bv = tl.load(b_ptr + w64 * sb_e + ranks[:, None] * sb_k + n[None, :],
                 mask=(ranks[:, None] < RANK) & (n[None, :] < N) & valid, other=0.0).to(tl.float32)
    delta = tl.sum(t[:, None] * bv, axis=0)
    if HAS_Y:
        delta = tl.load(y_ptr + r * sy_r + n, mask=n < N, other=0.0).to(tl.float32) + delta
    tl.store(out_ptr + r * so_r + n, delta.to(out_ptr.dtype.element_ty), mask=n < N)


def supported(rank: int) -> bool:
    return rank <= MAX_RANK_PAD


def gathered_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, which: torch.Tensor, y: torch.Tensor | None = None,
                  up: torch.Tensor | None = None, activation: str | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
    """[y +] each row's (x[r] @ a[which[r]]) @ b[which[r]] [R, N]; x [R, K], a [E, K, RANK], b [E, RANK,
    N] (float32 or narrower, the last axis contiguous), which [R] int32/int64, y [R, N]. x is read as
    act(x) * up with `activation` ("silu", "gelu_tanh"), or as rms_norm(x) * norm_weight with `eps`."""
    rows, k = x.shape
    experts, rank, n = b.shape
    assert a.shape == (experts, k, rank) and which.shape == (rows,), (x.shape, a.shape, b.shape, which.shape)
    assert (up is None) == (activation is None) and (up is None or up.shape == x.shape)
    assert y is None or y.shape == (rows, n), (y.shape, rows, n)
    assert supported(rank), f"rank {rank} > {MAX_RANK_PAD}"
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    up = x if up is None else (up if up.stride(-1) == 1 else up.contiguous())
    norm = eps is not None
    g = x if norm_weight is None else norm_weight.contiguous()
    rank_pad = max(triton.next_power_of_2(rank), 2)
    block_k = max(16, min(128, SHRINK_TILE // rank_pad, triton.next_power_of_2(k)))
    per_split = triton.cdiv(min(k, K_PER_SPLIT), block_k) * block_k
    splits = triton.cdiv(k, per_split)
    part = torch.empty((rows, splits, rank_pad), dtype=torch.float32, device=x.device)
    squares = torch.empty((rows, splits) if norm else (1, 1), dtype=torch.float32, device=x.device)
    out = torch.empty((rows, n), dtype=x.dtype if y is None else y.dtype, device=x.device)
    if rows == 0:
        return out
    _shrink_kernel[(rows, splits)](x, up, g, a, which, part, squares, k, rank, experts,
                                   x.stride(0), up.stride(0), a.stride(0), a.stride(1), part.stride(0), squares.stride(0),
                                   BLOCK_K=block_k, RANK_PAD=rank_pad, PER_SPLIT=per_split,
                                   GLU=GATE_ACTIVATIONS[activation] if activation else 0, NORM=norm,
                                   HAS_G=norm_weight is not None, num_warps=4)
    block_n = max(16, min(128, EXPAND_TILE // rank_pad, triton.next_power_of_2(n)))
    y_arg = out if y is None else (y if y.stride(-1) == 1 else y.contiguous())
    _expand_kernel[(rows, triton.cdiv(n, block_n))](part, squares, b, which, y_arg, out, n, rank, experts, splits, k,
                                                    float(eps or 0.0), part.stride(0), squares.stride(0), b.stride(0),
                                                    b.stride(1), y_arg.stride(0), out.stride(0),
                                                    BLOCK_N=block_n, RANK_PAD=rank_pad,
                                                    SPLITS_PAD=max(triton.next_power_of_2(splits), 2), NORM=norm,
                                                    HAS_Y=y is not None, num_warps=4)
    return out


@fused_lowering("gathered_lora")
def _gathered_lora(ctx: Lowering):
    """[y +] reshape(matmul(matmul(reshape(x), gather(A, which)), gather(B, which))) as the two kernels,
    x a source, rms_norm(x0[, g]) or act(gate) * up (slices of one source): fuse_gathered_lora's bodies."""
    body = ctx.node.attrs["body"]
    out = body.outputs[0]
    y = None
    if out.op == Op.ADD:
        flat = next(s for s in out.src if s.op == Op.RESHAPE)
        y = out.src[1] if out.src[0] is flat else out.src[0]
        out = flat.src[0]
    down, b_rows = out.src
    x3, a_rows = down.src
    x = x3.src[0] if x3.op == Op.RESHAPE and x3.src[0].op != Op.PLACEHOLDER else x3
    if not supported(b_rows.type.shape[1]) or out.dtype != dt.float32:
        return None
    n_out = b_rows.type.shape[2]
    sources = [a_rows.src[0], b_rows.src[0], a_rows.src[1]] + ([y] if y is not None else [])
    kw: dict = {}
    if x.op == Op.RMS_NORM:
        kw["eps"] = float(x.attrs["eps"])
        sources.append(x.src[0])
        if len(x.src) > 1:
            sources.append(x.src[1])
        kind = "norm"
    elif x.op == Op.MUL:
        act, _, up = glu_parts(body)
        gate = act.src[0]
        z = gate.src[0]
        spans = last_axis_slice(gate, z), last_axis_slice(up, z)
        kw["activation"] = gate_activation(act)
        sources.append(z)
        kind = "glu"
    else:
        sources.append(x3.src[0] if x3.op == Op.RESHAPE else x3)
        kind = "plain"
    ctx.reads = tuple(param(s) for s in sources)
    ctx.plan.fusions.append(f"gathered lora (shrink + expand{', ' + kind + ' prologue' if kind != 'plain' else ''}"
                            f"{', + y' if y is not None else ''})")

    def step(a, b, which, *rest):
        rest = list(rest)
        y_t = rest.pop(0) if y is not None else None
        src = rest.pop(0)
        rows = src.shape[0]
        if kind == "norm":
            delta = gathered_lora(src, a, b, which, y_t, norm_weight=rest[0] if rest else None, eps=kw["eps"])
        elif kind == "glu":
            (g0, g1), (u0, u1) = spans
            delta = gathered_lora(src[:, g0:g1], a, b, which, y_t, up=src[:, u0:u1], activation=kw["activation"])
        else:
            delta = gathered_lora(src.reshape(rows, -1), a, b, which, y_t)
        return delta if y is not None else delta.reshape(rows, 1, n_out)
    return step, "gathered_lora"
