"""Prefill attention for Hopper (sm_90) in Gluon: each tile's softmax runs while the tensor cores multiply.

Triton's `tl.dot` waits for every warpgroup MMA before the instructions after it, so in the flash
kernel (`attention._flash_kernel`) the softmax of a key tile and the tensor-core work never overlap
(ptxas: `wgmma.wait_group 0` right after each q k^T). Gluon states the waits. Per key tile j:

    issue  S_j = q k_j^T                   (async warpgroup MMA, q in registers, k_j in shared memory)
    issue  acc += P_{j-1} v_{j-1}          (async; P_{j-1} in registers, from the last step)
    wait   until only the second is in flight, then softmax(S_j) -> P_j, m, l, alpha
    wait   for the second, acc *= alpha, and free the stage tile j-1 used

so the exponentials of one tile overlap the P V product of the one before (FlashAttention-3's overlap
within a warpgroup). Tiles below the causal diagonal run unmasked; the rest apply the key bound and the
causal limit (and a row that has seen no key yet keeps a zero maximum).

The kernel is persistent: one program a multiprocessor walks the blocks of 128 query rows (`_work_item`:
heaviest first, the rounds dealt in snake order). Four warp-specialized partitions a program:
- two compute warpgroups of 64 query rows (`_compute`), each its own partition, so Gluon's barriers
  sync one warpgroup, not both;
- a one-warp K/V loader (`_kv_loader`): TMA from device-side descriptors of the first `length` rows
  (rows past it read as zero, so a stale or NaN cache tail never enters the product) into a ring of
  STAGES tiles shared by both warpgroups, one ready and one free mbarrier a stage; it runs ahead into
  the next block while the warpgroups finish one;
- a one-warp q loader (`_q_loader`): each block's q by TMA into a buffer that the warpgroups copy into
  the MMA's registers, which frees it for the next block's q.
The descriptors are rank 4 over [B, H, T, D], so any strides TMA takes run (q, k, v seen through a
transpose of [B, T, H, D] too).

Measured on the H200 (causal 4k d 128 bf16; BENCHMARKS.md, fifteenth and sixteenth sessions), and what
each change gave:
- q loaded by every compute warpgroup from global memory: its loads were about 14 % of the compute
  warps' stall samples in ncu. By TMA from the K/V loader: 478.6 against 461.7 TFLOP/s; from a loader
  of its own, with snake-order rounds: 500-537.
- rounds in plain order: the busiest program did 1.125x the mean work at 4k and 1.21x at 2k.
- removed: a program per query block, which lost to the persistent kernel at every length
  (450.1 against 507.2 at 4k, 518.9 against 538.5 at 8k).
- removed: one partition of 4 or 8 warps that also issues the loads, no faster than the Triton kernel
  (ncu: the two warpgroups held together by CTA barriers).
- removed: the two warpgroups taking turns at the tensor cores through mbarriers (FA3's ping-pong),
  459.5 against 462.9.
- not kept: an item's last P V and its stores overlapped with the next item's first q k^T. ptxas then
  serialized every warpgroup MMA (C7511: not enough registers at 240 a thread).

Scope: 16-bit q/k/v with head dims D == DV of 64 or 128, row-contiguous, 16-byte aligned rows, no
mask, a non-negative scale; `attention()` takes the Triton kernel for everything else. Compiles for
sm_90 only (warpgroup MMA, TMA); Triton's interpreter does not run Gluon, so `tests/test_cuda_prefill.py`
checks it on the GPU.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def _key_tiles(m0, TQ, length, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles the query block from row m0 reads, and how many of them every row sees whole (no
    mask): causal row t sees keys up to t + length - TQ."""
    if CAUSAL:
        hi = gl.minimum(length, gl.maximum(gl.minimum(m0 + BLOCK_M, TQ) + length - TQ, 0))
        seen_by_all = gl.minimum(hi, gl.maximum(m0 + 1 + length - TQ, 0))   # keys the block's first row sees
    else:
        hi = length
        seen_by_all = length
    return gl.cdiv(hi, BLOCK_N), seen_by_all // BLOCK_N


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, n_full, limit, length, qk_scale, CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """P (unnormalized, float32), the new row maxima and sums and the rescale factor of key tile j from its
    raw scores s; tiles from n_full on are masked (key bound, causal limit)."""
    if j < n_full:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
    else:
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(offs_n < length, 0)
        if CAUSAL:
            ok = ok & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(limit, 1))
        s = gl.where(ok, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _attend(q, k_smem, v_smem, ready, free, n, n_full, limit, length, qk_scale, CAUSAL: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, t0):
    """One compute warpgroup's online softmax over n key tiles of the ring, S_j's exponentials overlapping
    P_{j-1} V_{j-1} on the tensor cores (the module's schedule); returns the unnormalized output
    [BLOCK_M, BLOCK_D] and the row sums. q: in the MMA's registers. ready: a stage's K and V have landed;
    free: this warpgroup is done with a stage (it arrives once P V of its tile is). t0: the ring's count
    of tiles before this one's first (the program's earlier work items)."""
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    p = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
    if n > 0:
        st = t0 % STAGES
        mbarrier.wait(ready.index(st), (t0 // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        p32, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, n_full, limit, length, qk_scale, CAUSAL, BLOCK_N,
                                             s_layout)
        p = gl.convert_layout(p32.to(dtype), p_layout)
    for j in range(1, n):
        st = (t0 + j) % STAGES
        mbarrier.wait(ready.index(st), ((t0 + j) // STAGES) & 1)
        sp = (t0 + j - 1) % STAGES
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p, v_smem.index(sp), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        p32, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, n_full, limit, length, qk_scale, CAUSAL, BLOCK_N,
                                             s_layout)
        acc, p_done = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
        mbarrier.arrive(free.index(sp), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p32.to(dtype), p_layout)
    if n > 0:
        sp = (t0 + n - 1) % STAGES
        acc_tok = warpgroup_mma(p, v_smem.index(sp), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok])
        mbarrier.arrive(free.index(sp), count=1)
    return acc, l_i


@gluon.jit
def _store_rows(acc, l_i, out_ptr, so_t, m0, TQ, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr):
    """Rows m0 .. m0 + BLOCK_M (< TQ) of the output: acc / l, zero where a row saw no key; stored from the
    MMA layout (no shared-memory scratch, which the warp-specialized partitions could not share)."""
    o_layout: gl.constexpr = acc.type.layout
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = gl.where(gl.expand_dims(l_o > 0, 1), acc / gl.expand_dims(gl.where(l_o > 0, l_o, 1.0), 1), 0.0)
    out = out.to(out_ptr.dtype.element_ty)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + gl.expand_dims(offs_m, 1) * so_t + gl.expand_dims(offs_d, 0), out,
             mask=gl.expand_dims(offs_m < TQ, 1))


@gluon.jit
def _work_item(k, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """This program's work item of round k: its batch, query head, KV head, first query row, key tiles and
    unmasked tiles. Items go heaviest query blocks (of every head) first, round k to the programs in order
    when k is even and in reverse when odd, so each program's heavy and light blocks even out (a causal
    4k prefill: the busiest program does 1.00x the mean work, against 1.125x when every round went in
    order). Past the last item (the last round), no tile and no row (m0 = TQ): every partition still
    runs the round's handshakes."""
    P = gl.num_programs(0)
    pid = gl.program_id(0)
    item = k * P + pid + (k % 2) * (P - 1 - 2 * pid)
    valid = (item < total).to(gl.int32)
    bh = item % BH
    pid_m = item // BH
    if CAUSAL:
        pid_m = NUM_M - 1 - pid_m
    m0 = valid * pid_m * BLOCK_M + (1 - valid) * TQ
    n, n_full = _key_tiles(m0, TQ, length, CAUSAL, BLOCK_M, BLOCK_N)
    return bh // HQ, bh % HQ, (bh % HQ) // G, m0, n * valid, n_full


@gluon.jit
def _kv_loader(k_desc, v_desc, k_smem, v_smem, ready, free, total, BH, NUM_M, HQ, G, TQ, length,
               CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The K/V loader (one warp): every work item's K and V tiles through the ring, one running tile count
    across items, so it runs ahead into the next item while the last one finishes (a fresh free barrier
    counts as released: a wait on phase 1 returns at once)."""
    D: gl.constexpr = k_desc.block_type.shape[3]
    t = 0
    for k in range(0, gl.cdiv(total, gl.num_programs(0))):
        b, h, hk, m0, n, n_full = _work_item(k, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL, BLOCK_M, BLOCK_N)
        for j in range(n):
            st = t % STAGES
            mbarrier.wait(free.index(st), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], ready.index(st),
                                            k_smem.index(st).reshape([1, 1, BLOCK_N, D]))
            tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], ready.index(st),
                                            v_smem.index(st).reshape([1, 1, BLOCK_N, D]))
            t += 1


@gluon.jit
def _q_loader(q_desc, q_smem, q_ready, q_free, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The q loader (one warp): each work item's q, its two halves, as soon as both compute warpgroups have
    taken the last item's q into registers (early in that item). In the K/V loader's loop instead, a
    light item's q came too late (ncu, H200: compute warps waiting for q)."""
    HALF: gl.constexpr = BLOCK_M // 2
    D: gl.constexpr = q_desc.block_type.shape[3]
    c = 0
    for k in range(0, gl.cdiv(total, gl.num_programs(0))):
        b, h, hk, m0, n, n_full = _work_item(k, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL, BLOCK_M, BLOCK_N)
        mbarrier.wait(q_free, (c & 1) ^ 1)
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready, q_smem.index(0).reshape([1, 1, HALF, D]))
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + HALF, 0], q_ready,
                                        q_smem.index(1).reshape([1, 1, HALF, D]))
        c += 1


@gluon.jit
def _compute(q_smem, k_smem, v_smem, q_ready, q_free, ready, free, out_ptr, so_b, so_h, so_t,
             total, BH, NUM_M, HQ, G, TQ, length, qk_scale,
             CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
             STAGES: gl.constexpr, ME: gl.constexpr):
    """A compute warpgroup: rows ME * BLOCK_M / 2 .. (ME + 1) * BLOCK_M / 2 of each work item's
    query block, its q taken from the loader's buffer into the MMA's registers (which frees the buffer for
    the next item's q)."""
    HALF: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    t = 0
    c = 0
    for k in range(0, gl.cdiv(total, gl.num_programs(0))):
        b, h, hk, m0, n, n_full = _work_item(k, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL, BLOCK_M, BLOCK_N)
        r0 = m0 + ME * HALF
        mbarrier.wait(q_ready, c & 1)
        q = q_smem.index(ME).load(q_layout)
        mbarrier.arrive(q_free, count=1)
        limit = gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)) + r0 + length - TQ
        out, l_i = _attend(q, k_smem, v_smem, ready, free, n, n_full, limit, length, qk_scale, CAUSAL, HALF, BLOCK_N,
                           BLOCK_D, STAGES, t)
        _store_rows(out, l_i, out_ptr + b * so_b + h * so_h, so_t, r0, TQ, HALF, BLOCK_D)
        t += n
        c += 1


@gluon.jit
def _flash_sm90_kernel(q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, length_const, HQ, G, TQ, TBUF, NB, qk_scale,
                       sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                       LEN_FROM_PTR: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                       q_desc_layout: gl.constexpr, kv_layout: gl.constexpr, q_layout: gl.constexpr,
                       ring_layout: gl.constexpr, num_warps: gl.constexpr):
    """One program a multiprocessor (grid: min(blocks, multiprocessors)) walks the blocks of BLOCK_M query
    rows of every (batch, head): the shared memory, barriers and descriptors, then the four partitions
    (the module's docstring)."""
    if LEN_FROM_PTR:
        length = gl.minimum(gl.maximum(gl.load(len_ptr).to(gl.int32), 0), TBUF)
    else:
        length = length_const
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = BLOCK_M // 2
    hk = HQ // G
    rows = gl.maximum(length, 1)
    q_desc = tma.make_tensor_descriptor(q_ptr, shape=[NB, HQ, TQ, BLOCK_D], strides=[sq_b, sq_h, sq_t, 1],
                                        block_shape=[1, 1, HALF, BLOCK_D], layout=q_desc_layout)
    k_desc = tma.make_tensor_descriptor(k_ptr, shape=[NB, hk, rows, BLOCK_D], strides=[sk_b, sk_h, sk_t, 1],
                                        block_shape=[1, 1, BLOCK_N, BLOCK_D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, shape=[NB, hk, rows, BLOCK_D], strides=[sv_b, sv_h, sv_t, 1],
                                        block_shape=[1, 1, BLOCK_N, BLOCK_D], layout=kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], ring_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], ring_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    mbarrier.init(q_ready, count=1)                      # both halves of an item's q landed
    mbarrier.init(q_free, count=2)                       # both warpgroups hold their q in registers
    fence_async_shared()
    BH = NB * HQ
    NUM_M = gl.cdiv(TQ, BLOCK_M)
    total = BH * NUM_M
    gl.warp_specialize([
        (_compute, (q_smem, k_smem, v_smem, q_ready, q_free, ready, free, out_ptr, so_b, so_h, so_t, total, BH,
                    NUM_M, HQ, G, TQ, length, qk_scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, 0)),
        (_compute, (q_smem, k_smem, v_smem, q_ready, q_free, ready, free, out_ptr, so_b, so_h, so_t, total, BH,
                    NUM_M, HQ, G, TQ, length, qk_scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, 1)),
        (_kv_loader, (k_desc, v_desc, k_smem, v_smem, ready, free, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL,
                      BLOCK_M, BLOCK_N, STAGES)),
        (_q_loader, (q_desc, q_smem, q_ready, q_free, total, BH, NUM_M, HQ, G, TQ, length, CAUSAL, BLOCK_M,
                     BLOCK_N)),
    ], [4, 1, 1], [240, 24, 24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free.index(i))
    mbarrier.invalidate(q_ready)
    mbarrier.invalidate(q_free)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, qk_scale: float) -> bool:
    """Whether `flash_sm90` takes these [B, H, T, D] (last-contiguous) inputs: see the module's scope."""
    d = q.shape[-1]
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if mask is not None or qk_scale < 0 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (k.dtype == v.dtype == q.dtype and d in (64, 128) and k.shape[-1] == v.shape[-1] == d):
        return False
    return all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
               and x.stride(-1) == 1 for x in (q, k, v))


def flash_sm90(q4, k4, v4, o4, len_ptr, len_const: int, from_ptr: bool, group: int, qk_scale: float, causal: bool,
               block_n: int = 128, stages: int = 3, maxnreg: int = 168) -> None:
    """softmax(q k^T * scale) v into o4 for q4 [B, Hq, Tq, D], k4/v4 [B, Hk, Tbuf, D] (`attention`'s flash
    path, the same arguments); the caller has set Triton's allocator (device-side tensor descriptors).
    One program a multiprocessor walks the blocks of 128 query rows: two compute warpgroups of 64 rows
    and two one-warp loaders (12 warps a block), at most `maxnreg` registers a thread (168: one block a
    multiprocessor), the loaders 24, the compute warpgroups 240; a ring of `stages` tiles of `block_n`
    keys. The defaults are the fastest measured (H200, causal 4k d 128 bf16)."""
    nb, hq, tq, d = q4.shape
    tbuf = k4.shape[2]
    dtype = gl.float16 if q4.dtype == torch.float16 else gl.bfloat16
    total = nb * hq * triton.cdiv(tq, 128)
    grid = (max(1, min(total, torch.cuda.get_device_properties(q4.device).multi_processor_count)),)
    _flash_sm90_kernel[grid](
        q4, k4, v4, len_ptr, o4, len_const, hq, group, tq, tbuf, nb, qk_scale,
        *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3],
        LEN_FROM_PTR=from_ptr, CAUSAL=causal, BLOCK_M=128, BLOCK_N=block_n, BLOCK_D=d, STAGES=stages,
        q_desc_layout=gl.NVMMASharedLayout.get_default_for([1, 1, 64, d], dtype),
        kv_layout=gl.NVMMASharedLayout.get_default_for([1, 1, block_n, d], dtype),
        q_layout=gl.NVMMASharedLayout.get_default_for([64, d], dtype),
        ring_layout=gl.NVMMASharedLayout.get_default_for([block_n, d], dtype), num_warps=4, maxnreg=maxnreg)
