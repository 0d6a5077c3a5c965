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
from numba.extending import intrinsic

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
