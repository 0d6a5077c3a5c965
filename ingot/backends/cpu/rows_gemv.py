"""The VNNI GEMV (vnni.py, integer activations) for a few rows of x (2..GEMV_MAX_ROWS: `ingot serve`'s
decode batch): each block of W is loaded, unpacked and its parameters widened once for all rows.

vnni.gemv calls its block intrinsic once per row and block, so every row loads and unpacks the
block's 256 bytes and widens its float16 scale and offset again: 8 rows cost ~3x one. Here one
intrinsic per block keeps the unpacked weights and parameters in registers and loops over the rows,
each row's 8 VPDPBUSD and float epilogue being vnni.gemv's own instructions in the same order, so a
row's result is bit for bit what vnni.gemv gives it alone (a server's answer never depends on its
batch). kernels.quantized_matmul_step takes it for 2 rows or more.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import team
from .nn_kernels import XQ_BLOCK, round_rows
from .vnni import GROUP, BlockIR

_serial = dict(fastmath=True, cache=True, nogil=True)


def _rows_block_fma(bits: int):
    """The intrinsic rows_block_fma for bits-wide weights (4: 256 bytes a block, 8: 512)."""
    @intrinsic
    def rows_block_fma(typingctx, res, w, w_at, xq, x_at, x_stride, scale, offset, p_at, d, shift, cx, xsum, s_at,
                       s_stride, rows, has_offset):
        """For each row r < rows: res[16 r:16 r + 16] += scale * ((dot_r - shift_r) * d_r + cx_r)
        + offset * xsum_r (offset only when has_offset), dot_r the 16 int32 dot products of one block
        of 32 k: the block's bytes of w at flat offset w_at against the 32 int8 of row r of x at int32
        offset x_at + r x_stride of xq (an int32 view); scale and offset at flat offset p_at (float32
        or float16 bits); d, shift, cx, xsum [rows, blocks] read at s_at + r s_stride."""
        sig = types.void(res, w, w_at, xq, x_at, x_stride, scale, offset, p_at, d, shift, cx, xsum, s_at, s_stride,
                         rows, has_offset)
        return sig, _codegen(bits)
    return rows_block_fma


def _codegen(bits: int):

    def codegen(context, builder, signature, args):
        (res_v, w_v, w_at_v, xq_v, x_at_v, x_stride_v, s_v, o_v, p_at_v, d_v, shift_v, cx_v, xsum_v, s_at_v,
         s_stride_v, rows_v, has_v) = args
        arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
        ra, wa, xa, sa, oa = arr(0, res_v), arr(1, w_v), arr(3, xq_v), arr(6, s_v), arr(7, o_v)
        da, sha, cxa, xsa = arr(9, d_v), arr(10, shift_v), arr(11, cx_v), arr(12, xsum_v)
        block = BlockIR(builder, bits, wa, w_at_v)      # unpacked and widened once for all rows
        f16x = block.f16x
        scale = block.params(sa, p_at_v, signature.args[6].dtype)
        offset = block.params(oa, p_at_v, signature.args[7].dtype)
        with cgutils.for_range(builder, rows_v) as loop:
            r = loop.index
            x_row = builder.add(x_at_v, builder.mul(r, x_stride_v))
            at = builder.add(s_at_v, builder.mul(r, s_stride_v))
            scalar = lambda a: builder.load(builder.gep(a.data, [at]))  # noqa: E731
            add = block.row(xa, x_row, scalar(sha), scalar(da), scalar(cxa), scale)
            res_at = builder.mul(r, ir.Constant(r.type, GROUP))
            res_ptr = builder.bitcast(builder.gep(ra.data, [res_at]), f16x.as_pointer())
            acc = builder.fadd(builder.load(res_ptr, align=4), add)
            with builder.if_else(builder.icmp_unsigned("!=", has_v, ir.Constant(has_v.type, 0))) as (then, otherwise):
                with then:
                    builder.store(builder.fadd(acc, builder.fmul(offset, block.splat(scalar(xsa), f16x))), res_ptr,
                                  align=4)
                with otherwise:
                    builder.store(acc, res_ptr, align=4)
        return context.get_dummy_value()
    return codegen


rows_block_fma4, rows_block_fma8 = _rows_block_fma(4), _rows_block_fma(8)


@njit(**_serial)
def gemv_rows(x, w, scale, offset, has_offset, center, s0, s1, c0, c1, out):
    """vnni.gemv (same arguments, same results row by row), one intrinsic per block for all rows."""
    m_rows, k = x.shape
    bs = k // scale.shape[0]
    nb32 = k // XQ_BLOCK
    xq = np.empty((m_rows, k), np.int8)
    xd = np.empty((m_rows, nb32), np.float32)
    xs = np.empty((m_rows, nb32), np.float32)
    xi = np.empty((m_rows, nb32), np.float32)
    round_rows(x, s0, s1, xq, xd, xs, xi)
    x4 = xq.reshape(m_rows * k).view(np.int32)
    size = w.shape[2]
    bias = np.float32(8.0) if size == 256 else np.float32(128.0)
    shift = np.empty((m_rows, nb32), np.float32)   # vnni.gemv's per-row scalars, computed as it does
    cx = np.empty((m_rows, nb32), np.float32)
    for m in range(m_rows):
        for sb in range(s0, s1):
            shift[m, sb] = bias * xi[m, sb]
            cx[m, sb] = center * xs[m, sb]
    res = np.zeros(m_rows * GROUP, np.float32)
    n = scale.shape[1]
    for g in range(c0 // GROUP, c1 // GROUP):
        lo = g * GROUP
        res[:] = 0
        for sb in range(s0, s1):
            at = (sb * XQ_BLOCK // bs) * n + lo
            w_at, x_at = (g * nb32 + sb) * size, sb * XQ_BLOCK // 4
            if size == 256:
                rows_block_fma4(res, w, w_at, x4, x_at, k // 4, scale, offset, at, xd, shift, cx, xs, sb, nb32, m_rows,
                                has_offset)
            else:
                rows_block_fma8(res, w, w_at, x4, x_at, k // 4, scale, offset, at, xd, shift, cx, xs, sb, nb32, m_rows,
                                has_offset)
        for m in range(m_rows):
            out[m, lo:lo + GROUP] = res[m * GROUP:(m + 1) * GROUP]


@njit(**_serial)
def gemv_rows_chunks(head, plan, outs, out, ctrl, gen, lead):
    """gemv_rows over a team's chunks (team.py)."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        gemv_rows(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


team.DRIVERS[gemv_rows] = (gemv_rows_chunks, True)   # as vnni.gemv: split along columns


# -- float32 activations: 4-bit W unpacked once for up to ROW_TILE rows ----------------------------
#
# kernels._kmajor_packed4 (the float32-activation GEMV of 4-bit weights) unpacks W again for every row
# of x: 8 rows cost ~6x one. Here a tile of 32 output columns and 32 k (one block) is unpacked and
# converted to float into two vectors of 16 columns (even, odd) per k once, and each of up to ROW_TILE
# rows adds code * x with one FMA per vector, its sums in registers; at the block's end a row's sums
# are scaled and its offset term added (sum * scale + offset * sum(x), the kmajor kernel's epilogue).
# A row's result is the same chain of FMAs whatever the rows beside it, so it is bit for bit the same
# in a batch of 1 or 16: kernels.quantized_matmul_step takes it for every row count on AVX-512 CPUs,
# the batch-1 decoder included (generate and a server's lone request agree). One row costs what
# _kmajor_packed4 costs; 8 rows half of it. (The same for 8-bit weights lost to _kmajor_int8 at one
# row on the 49152-column LM head: 3.5 ms against 2.0.)

ROW_TILE = 8          # rows of x per pass over a tile of W: 2 x 8 sums + the converted codes in 32 registers
TILE_COLUMNS = 32     # output columns per tile: 16 bytes of a row of W
SPAN_BYTES = 2048     # at most this much of a row of W per span: a block's part (64 KB) is what each k's
                      # line fetches ahead (its 32 runs of W are too many streams for the hardware)
SPAN_SUMS = 1 << 14   # float32 results of a span of columns (64 KB: rows x columns): wide spans read long runs of W


def _float_fma(tile: int, bits: int = 4, group: int = 1):
    """The intrinsic for `tile` rows of x, `group` tiles of 32 columns side by side (their sums are
    independent chains: one row's 2 chains alone wait on the FMA's latency), and bits-wide weights
    (8: 32 bytes a row of a tile, each column's value the byte, signed for an int8 w; acc and the
    parameters in column order)."""
    @intrinsic
    def rows_block_fma_float(typingctx, acc, acc_at, w, w_at, w_stride, w_next, x, x_at, x_stride, xsum, xs_at,
                             xs_stride, scale, offset, p_at, has_offset, flip):
        """One block of 32 k: codes c_k (the 32 columns of W's row k, 16 bytes at flat offset w_at +
        k w_stride, each byte ^ flip, low nibble the even column) and for each row t < tile:
        acc[acc_at + 32 t:... + 32] += (sum over k of c_k * x[x_at + t x_stride + k]) * scale + offset *
        xsum[xs_at + t xs_stride] (offset when has_offset), the sum FMAs in k's order from zero; scale
        and offset the 32 parameters at flat offset p_at (float32 or float16 bits). acc holds a row's
        32 columns as two vectors of 16: the even columns, then the odd. Tile j < group of the call:
        w_at + j w_next, acc_at + 32 tile j, p_at + 32 j."""
        sig = types.void(acc, acc_at, w, w_at, w_stride, w_next, x, x_at, x_stride, xsum, xs_at, xs_stride, scale,
                         offset, p_at, has_offset, flip)
        return sig, _float_codegen(tile, bits, group)
    return rows_block_fma_float


def _float_codegen(tile: int, bits: int, group: int):

    def codegen(context, builder, signature, args):
        b = builder
        (acc_v, acc_at0, w_v, w_at0, w_stride, w_next, x_v, x_at, x_stride, xs_v, xs_at, xs_stride, s_v, o_v, p_at0,
         has_v, flip_v) = args
        args = list(signature.args)
        del args[5]    # (w_next: the argument positions below are the one-tile intrinsic's)
        signature = types.void(*args)
        arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
        aa, wa, xa, xsa, sa, oa = (arr(0, acc_v), arr(2, w_v), arr(5, x_v), arr(8, xs_v), arr(11, s_v),
                                   arr(12, o_v))
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        v16i8, v16i32, f16x = ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16)
        index = lambda v: ir.Constant(w_at0.type, v)  # noqa: E731
        fma = b.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(f16x, [f16x] * 3))
        prefetch = b.module.declare_intrinsic("llvm.prefetch.p0i8", fnty=ir.FunctionType(
            ir.VoidType(), [i8.as_pointer(), i32, i32, i32]))
        zeros = ir.Constant(f16x, [0.0] * 16)
        lanes = ir.Constant(v16i32, [0] * 16)
        parts = (ir.Constant(v16i32, list(range(0, 32, 2))), ir.Constant(v16i32, list(range(1, 32, 2)))) if bits == 4 \
            else (ir.Constant(v16i32, list(range(16))), ir.Constant(v16i32, list(range(16, 32))))
        v32i32 = ir.VectorType(i32, 32)
        signed = signature.args[2].dtype == types.int8

        def splat(value):
            one = b.insert_element(ir.Constant(f16x, ir.Undefined), value, ir.Constant(i32, 0))
            return b.shuffle_vector(one, ir.Constant(f16x, ir.Undefined), lanes)

        def params(a, element, p_at):
            """The 32 parameters at p_at as float32: the even columns' and the odd ones'."""
            ptr = b.gep(a.data, [p_at])
            if element == types.uint16:
                halves = b.load(b.bitcast(ptr, ir.VectorType(ir.HalfType(), 32).as_pointer()), align=2)
                wide = b.fpext(halves, ir.VectorType(f32, 32))
            else:
                wide = b.load(b.bitcast(ptr, ir.VectorType(f32, 32).as_pointer()), align=4)
            return [b.shuffle_vector(wide, ir.Constant(ir.VectorType(f32, 32), ir.Undefined), p) for p in parts]

        width = flip_v.type.width
        flip32 = flip_v if width == 32 else b.zext(flip_v, i32) if width < 32 else b.trunc(flip_v, i32)
        flip = b.shuffle_vector(b.insert_element(ir.Constant(v16i32, ir.Undefined), flip32, ir.Constant(i32, 0)),
                                ir.Constant(v16i32, ir.Undefined), lanes)
        nibble, four = ir.Constant(v16i32, [15] * 16), ir.Constant(v16i32, [4] * 16)
        ahead = b.mul(index(32), w_stride)   # 32 rows on: the next block's (k-major), the next tile (tiles)
        sums = [[zeros] * (2 * tile) for _ in range(group)]
        w_ats = [b.add(w_at0, b.mul(index(j), w_next)) for j in range(group)]
        for k in range(32):
            xks = [splat(b.load(b.gep(xa.data, [b.add(x_at, b.add(b.mul(index(t), x_stride), index(k)))])))
                   for t in range(tile)]
            for j in range(group):
                ptr = b.gep(wa.data, [b.add(w_ats[j], b.mul(index(k), w_stride))])
                if bits == 4:
                    b.call(prefetch, [b.bitcast(b.gep(ptr, [ahead]), i8.as_pointer()), ir.Constant(i32, 0),
                                      ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    codes = b.xor(b.zext(b.load(b.bitcast(ptr, v16i8.as_pointer()), align=1), v16i32), flip)
                    floats = [b.sitofp(c, f16x) for c in (b.and_(codes, nibble), b.lshr(codes, four))]
                else:
                    row = b.load(b.bitcast(ptr, ir.VectorType(i8, 32).as_pointer()), align=1)
                    wide = b.sitofp((b.sext if signed else b.zext)(row, v32i32), ir.VectorType(f32, 32))
                    floats = [b.shuffle_vector(wide, ir.Constant(ir.VectorType(f32, 32), ir.Undefined), p)
                              for p in parts]
                for t in range(tile):
                    for h in range(2):
                        sums[j][2 * t + h] = b.call(fma, [floats[h], xks[t], sums[j][2 * t + h]])
        for j in range(group):
            acc_at, p_at = b.add(acc_at0, index(32 * tile * j)), b.add(p_at0, index(32 * j))
            scale = params(sa, signature.args[11].dtype, p_at)
            acc_ptrs = [b.bitcast(b.gep(aa.data, [b.add(acc_at, index(32 * t + 16 * h))]), f16x.as_pointer())
                        for t in range(tile) for h in range(2)]
            results = [b.call(fma, [sums[j][i], scale[i % 2], b.load(p, align=4)]) for i, p in enumerate(acc_ptrs)]
            with b.if_else(b.icmp_unsigned("!=", has_v, ir.Constant(has_v.type, 0))) as (then, otherwise):
                with then:
                    offset = params(oa, signature.args[12].dtype, p_at)
                    for t in range(tile):
                        xs = splat(b.load(b.gep(xsa.data, [b.add(xs_at, b.mul(index(t), xs_stride))])))
                        for h in range(2):
                            b.store(b.call(fma, [offset[h], xs, results[2 * t + h]]), acc_ptrs[2 * t + h], align=4)
                with otherwise:
                    for p, r in zip(acc_ptrs, results):
                        b.store(r, p, align=4)
        return context.get_dummy_value()
    return codegen


fma8, fma4, fma2, fma1 = (_float_fma(t) for t in (8, 4, 2, 1))
# 8 bits: 1 row x 4 tiles and 2 x 2 keep 8 chains of sums (576 x 49152, one row: 1.8 ms against 2.9 with one
# tile a call; 4 bits lost with them: 576 x 3072 0.097 ms against 0.079)
wide8, wide4, wide2, wide1 = (_float_fma(t, 8, g) for t, g in ((8, 1), (4, 1), (2, 2), (1, 4)))
wide2_one, wide1_one = _float_fma(2, 8), _float_fma(1, 8)
_exact = dict(cache=True, nogil=True)   # no fastmath: a row's arithmetic is the intrinsics' FMAs, in order


def tile_strides(q, width):
    """(bytes from one 32 k to the next, from one 32 columns to the next, from one k to the next
    within them) of a weight whose 32 columns take `width` bytes (16: 4 bits, 32: 8): the k-major
    array [K, N * width / 32], or the tiles of a dt.TiledWeight [K / 32, N / 32, 32 width] (each
    tile one run)."""
    return (32 * q.shape[1], width, q.shape[1]) if q.ndim == 2 else (q.shape[1] * q.shape[2], q.shape[2], width)


@overload(tile_strides, inline="always", jit_options=dict(nogil=True))
def _tile_strides(q, width):
    if q.ndim == 3:
        return lambda q, width: (q.shape[1] * q.shape[2], q.shape[2], width)
    return lambda q, width: (32 * q.shape[1], width, q.shape[1])


@njit(**_exact)
def _block_sums(x, has_offset):
    """[rows, K / 32]: each 32 k's sum of x, in order (the same for any rows beside it); zeros when
    there is no offset to multiply."""
    m_rows, k = x.shape
    xsum = np.zeros((m_rows, k // 32), np.float32)
    if has_offset:
        for m in range(m_rows):
            for j in range(k // 32):
                total = np.float32(0.0)
                for i in range(32 * j, 32 * j + 32):
                    total += x[m, i]
                xsum[m, j] = total
    return xsum


@njit(**_exact)
def gemv_rows_float4(x, q, scale, offset, has_offset, flip, b0, b1, c0, c1, out):
    """kernels._kmajor_packed4's arguments and result (within float rounding), c0 and c1 multiples
    of TILE_COLUMNS, the block size a multiple of 32; each row the same whatever the rows beside it.
    q: the k-major array or a dt.TiledWeight's tiles (the same sums, bit for bit; tiles read faster:
    576 x 49152, one row, W from memory 1.6 ms against 3.5). Rows of x go in tiles of 8, 4, 2, 1; for
    each, the columns in spans whose results fill SPAN_SUMS, each span block by block, tile by tile
    within a block (32 runs of 16 bytes of W each, or one of 512)."""
    m_rows, k = x.shape
    bs = k // scale.shape[0]
    n = scale.shape[1]
    k_step, c_step, stride = tile_strides(q, 16)
    nb32 = k // 32
    xsum = _block_sums(x, has_offset)
    acc = np.empty(min(SPAN_SUMS, min(m_rows, ROW_TILE) * (c1 - c0)), np.float32)
    r = 0
    while r < m_rows:
        left = m_rows - r
        t = 8 if left >= 8 else 4 if left >= 4 else 2 if left >= 2 else 1
        span = min(SPAN_SUMS // (t * TILE_COLUMNS) * TILE_COLUMNS, 2 * SPAN_BYTES)
        for s0 in range(c0, c1, span):
            s1 = min(c1, s0 + span)
            tiles = (s1 - s0) // TILE_COLUMNS
            acc[:tiles * t * TILE_COLUMNS] = 0
            for blk in range(b0, b1):
                for k0 in range(blk * bs, (blk + 1) * bs, 32):
                    x_at, xs_at = r * k + k0, r * nb32 + k0 // 32
                    for i in range(tiles):
                        c = s0 + i * TILE_COLUMNS
                        a_at, w_at, p_at = i * t * TILE_COLUMNS, k0 // 32 * k_step + c // 32 * c_step, blk * n + c
                        if t == 8:
                            fma8(acc, a_at, q, w_at, stride, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, flip)
                        elif t == 4:
                            fma4(acc, a_at, q, w_at, stride, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, flip)
                        elif t == 2:
                            fma2(acc, a_at, q, w_at, stride, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, flip)
                        else:
                            fma1(acc, a_at, q, w_at, stride, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, flip)
            for i in range(tiles):
                c = s0 + i * TILE_COLUMNS
                for j in range(t):
                    row, at = out[r + j], (i * t + j) * TILE_COLUMNS
                    for lane in range(16):
                        row[c + 2 * lane] = acc[at + lane]
                        row[c + 2 * lane + 1] = acc[at + 16 + lane]
        r += t


@njit(**_exact)
def float4_chunks(head, plan, outs, out, ctrl, gen, lead):
    """gemv_rows_float4 over a team's chunks (team.py)."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        gemv_rows_float4(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


# split along columns only: a row's sum then never depends on the split (its blocks added in order)
team.DRIVERS[gemv_rows_float4] = (float4_chunks, True)


@njit(**_exact)
def gemv_rows_float8(x, q, scale, offset, has_offset, b0, b1, c0, c1, out):
    """kernels._kmajor_int8's arguments and result (within float rounding) for an 8-bit weight held as
    a dt.TiledWeight's tiles q [K / 32, N / 32, 1024] (int8 or uint8): gemv_rows_float4's walk, a
    tile's 1024 bytes one run (its 32 rows of 32 columns), read once for up to ROW_TILE rows of x;
    each row the same whatever the rows beside it. SmolLM2's head (576 x 49152) in a decode step,
    one thread: 8 rows 4.9 ms against _kmajor_int8's 13.8, but one row 3.0-3.3 against 2.5 (hot in
    L2 it wins there too, 1.5 against 1.8; from memory one stream of tiles loses to its four rows)."""
    m_rows, k = x.shape
    bs = k // scale.shape[0]
    n = scale.shape[1]
    k_step, c_step = q.shape[1] * q.shape[2], q.shape[2]
    nb32 = k // 32
    xsum = _block_sums(x, has_offset)
    acc = np.empty(min(SPAN_SUMS, min(m_rows, ROW_TILE) * (c1 - c0)), np.float32)
    r = 0
    while r < m_rows:
        left = m_rows - r
        t = 8 if left >= 8 else 4 if left >= 4 else 2 if left >= 2 else 1
        # tiles: no cap on a span's bytes (one row, 576 x 49152 hot: 1.5 ms against 1.8 with float4's cap)
        span = SPAN_SUMS // (t * TILE_COLUMNS) * TILE_COLUMNS
        for s0 in range(c0, c1, span):
            s1 = min(c1, s0 + span)
            tiles = (s1 - s0) // TILE_COLUMNS
            acc[:tiles * t * TILE_COLUMNS] = 0
            for blk in range(b0, b1):
                for k0 in range(blk * bs, (blk + 1) * bs, 32):
                    x_at, xs_at = r * k + k0, r * nb32 + k0 // 32
                    i = 0
                    while i < tiles:   # (1 and 2 rows: 4 and 2 tiles a call where there are)
                        c = s0 + i * TILE_COLUMNS
                        a_at, w_at, p_at = i * t * TILE_COLUMNS, k0 // 32 * k_step + c // 32 * c_step, blk * n + c
                        if t == 8:
                            wide8(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 1
                        elif t == 4:
                            wide4(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 1
                        elif t == 2 and i + 2 <= tiles:
                            wide2(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 2
                        elif t == 2:
                            wide2_one(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 1
                        elif i + 4 <= tiles:
                            wide1(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 4
                        else:
                            wide1_one(acc, a_at, q, w_at, 32, c_step, x, x_at, k, xsum, xs_at, nb32, scale, offset,
                                 p_at, has_offset, 0)
                            i += 1
            for i in range(tiles):
                c = s0 + i * TILE_COLUMNS
                for j in range(t):
                    out[r + j, c:c + TILE_COLUMNS] = acc[(i * t + j) * TILE_COLUMNS:(i * t + j + 1) * TILE_COLUMNS]
        r += t


@njit(**_exact)
def float8_chunks(head, plan, outs, out, ctrl, gen, lead):
    """gemv_rows_float8 over a team's chunks (team.py)."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        gemv_rows_float8(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


team.DRIVERS[gemv_rows_float8] = (float8_chunks, True)


def warm_up() -> None:
    """Compile (or load from numba's cache) the float32-activation kernel and its team driver for the
    types quantized_matmul_step gives them (kernels.warm_up calls this)."""
    def read_only(a: np.ndarray) -> np.ndarray:   # as kernels._kernel_form gives them (float16 as its bits)
        view = a.view(np.uint16) if a.dtype == np.float16 else a.view()
        view.flags.writeable = False
        return view

    x, out = np.ones((2, 32), np.float32), np.zeros((2, 32), np.float32)
    ctrl = np.zeros(team.SLEEP + 8, np.int64)
    q = read_only(np.zeros((1, 1, 512), np.uint8))   # a TiledWeight's tiles: the loaders' form (k-major
    for params in (np.ones((1, 32), np.float32), np.ones((1, 32), np.float16)):   # arrays compile when met)
        p = read_only(params)
        head = (x, q, p, p, True, np.uint32(0))
        gemv_rows_float4(*head, 0, 1, 0, 32, out)
        float4_chunks(head, np.array([[0, 1, 0, 32, 0]], np.int64), out[None], out, ctrl, 1, -1)
    # 8-bit tiles as a GGUF's Q8_0 comes (int8, float32 scales): ~5 MB of code a specialisation
    p = read_only(np.ones((1, 32), np.float32))
    head8 = (x, read_only(np.zeros((1, 1, 1024), np.int8)), p, p, True)
    gemv_rows_float8(*head8, 0, 1, 0, 32, out)
    float8_chunks(head8, np.array([[0, 1, 0, 32, 0]], np.int64), out[None], out, ctrl, 1, -1)
