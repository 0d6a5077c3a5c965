"""The word-layout int4 GEMV for Hopper (sm_90) in Gluon: weights streamed by TMA, loaded before the wait.

`quantized_matmul._qgemv_words_kernel` (Triton) streams the weight through registers: a program loads a
tile a step ahead of its arithmetic, so what a multiprocessor has in flight is bounded by its registers,
and under programmatic dependent launch only the first tile may be loaded before the wait on the kernel
ahead (`EARLY_W`). Split-K fills the multiprocessors once, so the GEMV ends when its slowest program
does. Here one program a multiprocessor (persistent) takes an equal, contiguous share of the weight's
tiles (column chunk major, then K), and two warp-specialized partitions share a ring of STAGES tiles in
shared memory:
- a one-warp loader: each tile's weight words [TBK blocks of 32 k, 4 word rows, BN columns] and their
  scales (and biases) by TMA bulk copies, one ready mbarrier a stage. In a captured CUDA graph
  (EARLY) the weights are constants no kernel of the stream writes, so the loader never waits on the
  kernel ahead: the whole ring (160 KB a multiprocessor by default, 21 MB on an H200) fills while the
  quantize launch or the attention ahead still runs;
- the compute warps (the default partition): wait on the kernel ahead (x, y and the output they zero
  are its), then per tile the same integer arithmetic as the Triton kernel (`dp4a` of the weight nibbles
  with the limbs of the pre-quantized x, exact per block of 32, then one float multiply by the block's
  weight scale and x scale, + bias * the block's x sum), and free the stage. A program's partial sums
  of one column chunk go to y by atomic adds (y comes zeroed by the kernel ahead) when it leaves the
  chunk.

Scope: one row of x pre-quantized (`_quantize_x` or a kernel ahead storing the same: xq/xd/xs), GROUP 32,
16-byte aligned weight rows; `quantized_matmul._words_gemv` takes it on sm_90 where these hold
(INGOT_CUDA_GEMV_GLUON) and the Triton kernel everywhere else. Triton's interpreter does not run Gluon,
so `tests/test_cuda_gemv_sm90.py` checks it on the GPU.
"""
from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _gdc_wait():
    """griddepcontrol.wait: the kernel ahead on the stream has completed and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dp4a(a, b, c, SIGNED: gl.constexpr):
    """c + the dot product of the four bytes of a (unsigned) with those of b (signed if SIGNED), per element."""
    if SIGNED:
        return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                         is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                         is_pure=True, pack=1)


@gluon.jit
def _share(T, P, pid):
    """Tiles [u0, u1) of program pid when P programs split T tiles into contiguous shares."""
    return pid * T // P, (pid + 1) * T // P


@gluon.jit
def _loader(w_desc, s_desc, b_desc, w_smem, s_smem, b_smem, ready, free, KT, T,
            HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, EARLY: gl.constexpr):
    """One warp: this program's tiles through the ring (a fresh free barrier counts as released)."""
    TBK: gl.constexpr = s_desc.block_type.shape[0]
    BN: gl.constexpr = s_desc.block_type.shape[1]
    if PDL and not EARLY:   # the weight may be the kernel ahead's output (an eager run)
        _gdc_wait()
    u0, u1 = _share(T, gl.num_programs(0), gl.program_id(0))
    NBYTES: gl.constexpr = 4 * w_desc.block_type.nbytes + s_desc.block_type.nbytes + (b_desc.block_type.nbytes if HAS_BIAS else 0)
    for i in range(u1 - u0):
        u = u0 + i
        c = u // KT
        kt = u - c * KT
        st = i % STAGES
        mbarrier.wait(free.index(st), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), NBYTES)
        for j in gl.static_range(4):
            tma.async_copy_global_to_shared(w_desc, [j, kt * TBK, c * BN], ready.index(st),
                                            w_smem.index(4 * st + j).reshape([1, TBK, BN]))
        tma.async_copy_global_to_shared(s_desc, [kt * TBK, c * BN], ready.index(st), s_smem.index(st))
        if HAS_BIAS:
            tma.async_copy_global_to_shared(b_desc, [kt * TBK, c * BN], ready.index(st), b_smem.index(st))


@gluon.jit
def _limb(w_lo, w_hi, x_words, j: gl.constexpr, limb: gl.constexpr, x_ok, acc, LIMBS: gl.constexpr):
    """acc + the dot products of one word row's nibbles (w_lo, w_hi [TBK, BN]) with limb `limb` of x's
    words for that row (the same for a block's threads: a broadcast load)."""
    x_lo = gl.expand_dims(gl.load(x_words + (limb * 8 + j), mask=x_ok, other=0), 1)
    x_hi = gl.expand_dims(gl.load(x_words + (limb * 8 + 4 + j), mask=x_ok, other=0), 1)
    x_lo, w_lo = gl.broadcast(x_lo, w_lo)
    x_hi, w_hi = gl.broadcast(x_hi, w_hi)
    return _dp4a(w_hi, x_hi, _dp4a(w_lo, x_lo, acc, limb == LIMBS - 1), limb == LIMBS - 1)


@gluon.jit
def _compute(w_smem, s_smem, b_smem, ready, free, xq_ptr, xd_ptr, xs_ptr, y_ptr, z_ptr, Z, N, KB, KT, T,
             LIMBS: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
             ZERO: gl.constexpr, layout: gl.constexpr, STREAM: gl.constexpr):
    """The compute warps: every tile of this program's share, its column chunk's sums to y by atomic adds
    when the share leaves the chunk. Per block of 32 k and column, each limb's dot products chain through
    the 4 word rows in one int32 (8 dp4a), exact; then one float multiply-add per block."""
    TBK: gl.constexpr = s_smem.type.shape[1]
    BN: gl.constexpr = s_smem.type.shape[2]
    if PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    P = gl.num_programs(0)
    pid = gl.program_id(0)
    if ZERO:   # the output of the GEMV after this one, a share a program
        ZL: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        zs = gl.cdiv(gl.cdiv(Z, P), 4) * 4
        for z0 in range(pid * zs, gl.minimum(pid * zs + zs, Z), 1024 * gl.num_warps()):
            offs = z0 + gl.arange(0, 1024 * gl.num_warps(), layout=ZL)
            gl.store(z_ptr + offs, gl.zeros([1024 * gl.num_warps()], gl.float32, ZL),
                     mask=(offs < Z) & (offs < pid * zs + zs))
    u0, u1 = _share(T, P, pid)
    blk = gl.arange(0, TBK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    acc = gl.zeros([TBK, BN], gl.float32, layout)
    tiles = u1 - u0
    if STREAM:   # a bound for measuring only: the tiles arrive and are freed, no arithmetic (wrong results)
        for i in range(tiles):
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            mbarrier.arrive(free.index(i % STAGES), count=1)
        tiles = 0
    for i in range(tiles):
        u = u0 + i
        c = u // KT
        kt = u - c * KT
        st = i % STAGES
        b = kt * TBK + blk
        x_ok = b < KB
        x_words = xq_ptr + b * (8 * LIMBS)
        d = gl.load(xd_ptr + b, mask=x_ok, other=0.0)
        if HAS_BIAS:
            x_sum = gl.load(xs_ptr + b, mask=x_ok, other=0.0)
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        s0 = gl.zeros([TBK, BN], gl.int32, layout)
        s1 = gl.zeros([TBK, BN], gl.int32, layout)
        s2 = gl.zeros([TBK, BN], gl.int32, layout)
        for j in gl.static_range(4):
            w = w_smem.index(4 * st + j).load(layout)
            w_lo = w & 0x0F0F0F0F
            w_hi = (w >> 4) & 0x0F0F0F0F
            s0 = _limb(w_lo, w_hi, x_words, j, 0, x_ok, s0, LIMBS)
            if LIMBS > 1:
                s1 = _limb(w_lo, w_hi, x_words, j, 1, x_ok, s1, LIMBS)
            if LIMBS > 2:
                s2 = _limb(w_lo, w_hi, x_words, j, 2, x_ok, s2, LIMBS)
        scale = s_smem.index(st).load(layout).to(gl.float32)
        if HAS_BIAS:
            bias = b_smem.index(st).load(layout).to(gl.float32)
        mbarrier.arrive(free.index(st), count=1)
        total = s0
        if LIMBS > 1:
            total += s1 << 8
        if LIMBS > 2:
            total += s2 << 16
        part = total.to(gl.float32) * gl.expand_dims(d, 1) * scale      # exact integer sums, then floats
        if HAS_BIAS:
            part += bias * gl.expand_dims(x_sum, 1)
        acc += part
        if (kt == KT - 1) | (i == tiles - 1):      # the share leaves column chunk c
            n = c * BN + cols
            gl.atomic_add(y_ptr + n, gl.sum(acc, axis=0), mask=n < N, sem="relaxed")
            acc = gl.zeros([TBK, BN], gl.float32, layout)


@gluon.jit
def _gemv_sm90_kernel(w_desc, s_desc, b_desc, xq_ptr, xd_ptr, xs_ptr, y_ptr, z_ptr, Z, N, KB, KT, T,
                      LIMBS: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                      EARLY: gl.constexpr, ZERO: gl.constexpr, layout: gl.constexpr, s_layout: gl.constexpr,
                      STREAM: gl.constexpr = False):
    """y[n] += sum_k x[k] W[k, n] for this program's share of the T tiles (KT a column chunk): the ring,
    its barriers, then the two partitions (the module's docstring)."""
    TBK: gl.constexpr = s_desc.block_type.shape[0]
    BN: gl.constexpr = s_desc.block_type.shape[1]
    w_smem = gl.allocate_shared_memory(gl.int32, [4 * STAGES, TBK, BN], s_layout)   # word row j of stage st: 4 st + j
    s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES if HAS_BIAS else 1] + b_desc.block_type.shape,
                                       b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_compute, (w_smem, s_smem, b_smem, ready, free, xq_ptr, xd_ptr, xs_ptr, y_ptr, z_ptr, Z, N, KB, KT, T,
                    LIMBS, HAS_BIAS, STAGES, PDL, ZERO, layout, STREAM)),
        (_loader, (w_desc, s_desc, b_desc, w_smem, s_smem, b_smem, ready, free, KT, T, HAS_BIAS, STAGES, PDL, EARLY)),
    ], [1], [40])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(free.index(i))


TBK = 4          # blocks of 32 k a tile
BN = 256         # columns a tile (TMA's largest box side)
# tiles in a program's ring (20 KB each with float16 scales and biases), the compute partition's warps, and
# programs a multiprocessor: INGOT_CUDA_GEMV_SM90="stages,warps,programs"
STAGES, NUM_WARPS, PER_SM = (int(v) for v in os.environ.get("INGOT_CUDA_GEMV_SM90", "8,8,1").split(","))
_DESCRIPTORS: dict = {}
_WORD_ROWS = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)   # the ring's [TBK, BN] rows


def _layout(num_warps: int) -> gl.BlockedLayout:
    """[TBK, BN] (one word row of a tile, the block sums, scales): a thread holds 4 columns of one block
    (16-byte shared loads, a warp 512 contiguous bytes), warps over the blocks first, then the columns."""
    wb = min(TBK, num_warps)
    return gl.BlockedLayout([1, 4], [1, 32], [wb, num_warps // wb], [1, 0])


def supported(w, m: int, device: torch.device) -> bool:
    """Whether `gemv_sm90` takes m rows of the word-layout weight w on this device."""
    if m != 1 or device.type != "cuda" or not w.words or w.group != 32:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    params = [w.scale] + ([w.bias] if w.bias is not None else [])
    if any(p.dtype not in (torch.float16, torch.float32) or p.stride(1) != 1 for p in params):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in [w.q] + params)


def _descriptors(w) -> tuple:
    """TMA descriptors of w's words [KW/4, 4, Np] (int32) and its scales and biases [KB, Np], made once per
    weight (the weights of a model are constants)."""
    key = (w.q.data_ptr(), w.scale.data_ptr(), w.bias.data_ptr() if w.bias is not None else 0, tuple(w.q.shape))
    have = _DESCRIPTORS.get(key)
    if have is None:
        kw, np_ = w.q.shape
        wl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        w_desc = TensorDescriptor(w.q, [4, kw // 4, np_], [w.q.stride(0), 4 * w.q.stride(0), 1], [1, TBK, BN], wl)

        def params(p):
            pl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * p.element_size(), rank=2)
            return TensorDescriptor(p, list(p.shape), list(p.stride()), [TBK, BN], pl)
        s_desc = params(w.scale)
        have = _DESCRIPTORS[key] = (w_desc, s_desc, params(w.bias) if w.bias is not None else s_desc, w)
    return have[:3]


def gemv_sm90(w, xq: dict, y: torch.Tensor, limbs: int, zero: torch.Tensor | None = None, early: bool = False,
              stages: int = STAGES, per_sm: int = PER_SM, num_warps: int = NUM_WARPS, programs: int | None = None,
              pdl: dict | None = None, stream: bool = False) -> None:
    """y [1, N] (float32, contiguous, zeroed: the kernel ahead zeroed it) += x @ W for x pre-quantized into
    `xq` (`quantized_matmul.xq_buffers`' arguments, LIMBS `limbs`). zero (float32, contiguous): zeroed by
    this launch after its wait (the output of the GEMV after it). early: the loader does not wait on the
    kernel ahead (weights no kernel of the stream writes: a captured graph's constants). `pdl`: the
    launch keywords of `pdl.pdl_args`. per_sm programs a multiprocessor (or `programs` in all), each a
    ring of `stages` tiles and `num_warps` compute warps."""
    w_desc, s_desc, b_desc = _descriptors(w)
    kb = triton.cdiv(w.q.shape[0], 4)
    kt = triton.cdiv(kb, TBK)
    total = triton.cdiv(w.n, BN) * kt
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    grid = (max(1, min(total, programs or per_sm * sms)),)
    pdl = dict(pdl or {})
    if per_sm > 1:   # registers for per_sm programs of num_warps + the loader's warp
        pdl["maxnreg"] = min(255, 65536 // (per_sm * (num_warps + 1) * 32) // 8 * 8)
    _gemv_sm90_kernel[grid](
        w_desc, s_desc, b_desc, xq["xq_ptr"], xq["xd_ptr"], xq["xs_ptr"], y, zero if zero is not None else y,
        zero.numel() if zero is not None else 0, w.n, xq["KB"], kt, total, LIMBS=limbs, HAS_BIAS=w.bias is not None,
        STAGES=stages, PDL=pdl.pop("PDL", False), EARLY=early, ZERO=zero is not None, layout=_layout(num_warps),
        s_layout=_WORD_ROWS, STREAM=stream, num_warps=num_warps, **pdl)


__all__ = ["gemv_sm90", "supported", "TBK", "BN"]
