"""Decode attention for Hopper (sm_90) in Gluon: the caches streamed by TMA through a ring of shared memory.

One query row a head (a decode step over a long cache). The G query heads of a KV head are the rows
of one warpgroup MMA tile (padded to 64), and each program takes one split of that KV head's keys, by
the rule of the Triton decode kernel (`attention._decode_chunk`, no minimum). Its partial softmax goes
to `attention._combine_kernel` in the same layout.

Two partitions a program:
- a one-warp loader: K and V tiles by TMA bulk copies from device-side descriptors of the first
  `length` rows (rows past it read as zero), STAGES tiles in flight;
- the compute warpgroup: `flash_sm90._attend`, S = q K^T and P V on the tensor cores, one tile's
  softmax while the P V product of the tile before multiplies.
No thread issues a load of the cache, so the bytes in flight do not depend on registers.

Scope: one query row, 16-bit q/k/v with D == DV of 64 or 128, 16-byte aligned rows, G <= 64, no mask,
no RoPE, KV write or rounded output folded in (`attention()` keeps the Triton kernel for those), sm_90.
Triton's interpreter does not run Gluon: `tests/test_cuda_decode_attention.py` checks it on the GPU.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .flash_sm90 import _attend

ROWS = gl.constexpr(64)   # the warpgroup MMA's rows: the G query heads of a KV head, padded


@gluon.jit
def _loader(k_desc, v_desc, k_smem, v_smem, ready, free, b, hk, start, n, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """The split's n key tiles from key `start` through the ring (a fresh free barrier counts as released)."""
    D: gl.constexpr = k_desc.block_type.shape[3]
    for j in range(n):
        st = j % STAGES
        mbarrier.wait(free.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, start + j * BLOCK_N, 0], ready.index(st),
                                        k_smem.index(st).reshape([1, 1, BLOCK_N, D]))
        tma.async_copy_global_to_shared(v_desc, [b, hk, start + j * BLOCK_N, 0], ready.index(st),
                                        v_smem.index(st).reshape([1, 1, BLOCK_N, D]))


@gluon.jit
def _compute(q_ptr, k_smem, v_smem, ready, free, o_part_ptr, ml_part_ptr, part0, b, hk, G, sq_b, sq_h, keys, n,
             qk_scale, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_R: gl.constexpr, STAGES: gl.constexpr):
    """The compute warpgroup: q of the G heads into the MMA's registers, the split's `keys` keys (n tiles),
    and the partials of rows < BLOCK_R: the unnormalized output, the row maximum and sum."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + b * sq_b + gl.expand_dims(hk * G + rows, 1) * sq_h + gl.expand_dims(offs_d, 0),
                mask=gl.expand_dims(rows < G, 1), other=0.0)
    limit = gl.zeros([ROWS], gl.int32, layout=gl.SliceLayout(1, s_layout))   # no causal limit: one query row
    acc, l_i, m_i = _attend(q, k_smem, v_smem, ready, free, n, keys // BLOCK_N, limit, keys, qk_scale, False,
                            ROWS, BLOCK_N, BLOCK_D, STAGES, 0)
    o_layout: gl.constexpr = acc.type.layout
    r_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    d_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_part_ptr + gl.expand_dims(part0 + r_o, 1) * BLOCK_D + gl.expand_dims(d_o, 0), acc,
             mask=gl.expand_dims(r_o < BLOCK_R, 1))
    r_s = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    gl.store(ml_part_ptr + (part0 + r_s) * 2, m_i, mask=r_s < BLOCK_R)
    gl.store(ml_part_ptr + (part0 + r_s) * 2 + 1, l_i, mask=r_s < BLOCK_R)


@gluon.jit
def _decode_sm90_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, ml_part_ptr, length_const, len_add, NB, HK, G, TBUF,
                        qk_scale, sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                        LEN_FROM_PTR: gl.constexpr, SPLIT: gl.constexpr, ALIGN: gl.constexpr, BLOCK_R: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                        kv_layout: gl.constexpr, ring_layout: gl.constexpr, num_warps: gl.constexpr):
    """Split pid_s of KV head pid_bh: grid (B * Hk, SPLIT). Every program stores its partials, an empty
    split too (maximum -inf, sum 0), so the combine kernel reads all SPLIT of them."""
    pid_bh = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    if LEN_FROM_PTR:   # the device scalar + len_add (a decode step's position + 1)
        length = gl.minimum(gl.maximum(gl.load(len_ptr).to(gl.int32) + len_add, 0), TBUF)
    else:
        length = length_const
    chunk = (length + SPLIT - 1) // SPLIT
    chunk = (chunk + ALIGN - 1) // ALIGN * ALIGN
    start = pid_s * chunk
    keys = gl.maximum(gl.minimum(chunk, length - start), 0)
    n = gl.cdiv(keys, BLOCK_N)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    k_desc = tma.make_tensor_descriptor(k_ptr, shape=[NB, HK, gl.maximum(length, 1), BLOCK_D],
                                        strides=[sk_b, sk_h, sk_t, 1], block_shape=[1, 1, BLOCK_N, BLOCK_D],
                                        layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(v_ptr, shape=[NB, HK, gl.maximum(length, 1), BLOCK_D],
                                        strides=[sv_b, sv_h, sv_t, 1], block_shape=[1, 1, BLOCK_N, BLOCK_D],
                                        layout=kv_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], ring_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], ring_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()
    part0 = (pid_bh * SPLIT + pid_s) * BLOCK_R
    gl.warp_specialize([
        (_compute, (q_ptr, k_smem, v_smem, ready, free, o_part_ptr, ml_part_ptr, part0, b, hk, G, sq_b, sq_h, keys, n,
                    qk_scale, BLOCK_N, BLOCK_D, BLOCK_R, STAGES)),
        (_loader, (k_desc, v_desc, k_smem, v_smem, ready, free, b, hk, start, n, BLOCK_N, STAGES)),
    ], [1], [24])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free.index(i))


def supported(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, group: int) -> bool:
    """Whether `decode_sm90` takes these [B, H, T, D] (last-contiguous) inputs: see the module's scope."""
    d = q4.shape[-1]
    if q4.device.type != "cuda" or torch.cuda.get_device_capability(q4.device)[0] != 9:
        return False
    if q4.shape[2] != 1 or group > ROWS or q4.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (k4.dtype == v4.dtype == q4.dtype and d in (64, 128) and k4.shape[-1] == v4.shape[-1] == d):
        return False
    return all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
               and x.stride(-1) == 1 for x in (q4, k4, v4))


def decode_sm90(q4, k4, v4, o_part, ml_part, len_ptr, len_const: int, from_ptr: bool, len_add: int, group: int,
                qk_scale: float, split: int, align: int, block_r: int, block_n: int = 128, stages: int = 3) -> None:
    """The split-KV partials of q4 [B, Hq, 1, D] over k4/v4 [B, Hk, Tbuf, D] into o_part [B * Hk * split *
    block_r, D] and ml_part [..., 2] (`attention`'s decode path, its buffers and chunk rule); the caller
    runs `_combine_kernel` over them and has set Triton's allocator (device-side tensor descriptors).
    A ring of `stages` tiles of `block_n` keys (3 x 128 at d 128: 192 KB, one program a multiprocessor)."""
    nb, hq, _, d = q4.shape
    hk, tbuf = k4.shape[1], k4.shape[2]
    dtype = gl.float16 if q4.dtype == torch.float16 else gl.bfloat16
    _decode_sm90_kernel[(nb * hk, split)](
        q4, k4, v4, len_ptr, o_part, ml_part, len_const, len_add, nb, hk, group, tbuf, qk_scale,
        q4.stride(0), q4.stride(1), *k4.stride()[:3], *v4.stride()[:3],
        LEN_FROM_PTR=from_ptr, SPLIT=split, ALIGN=align, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=d, STAGES=stages,
        kv_layout=gl.NVMMASharedLayout.get_default_for([1, 1, block_n, d], dtype),
        ring_layout=gl.NVMMASharedLayout.get_default_for([block_n, d], dtype), num_warps=4)
