"""Pointwise (1x1, stride 1) convolutions with 16 output channels a vector, for small images.

conv_spatial's pointwise kernel vectorises along positions, 64 a tile: a 7 x 7 image (49 positions)
computes 64, a quarter of its FMAs on lanes it drops (MobileNet's 96 <-> 576 layers at 7 x 7 ran at
40-70 GFLOP/s). Here out [M, P] = w [M, C] @ x [C, P] is computed in tiles of 32 output channels x 8 or 4
positions (two vectors of 16 weights and R broadcast inputs per input channel, 2 R FMAs: 10 loads for 16),
a block of 16 left over in tiles of 16 x R (R = 16, 8, 4; one weight vector, R FMAs), the last 1-3
positions of several blocks at once. The R accumulators (lanes: channels) are transposed in registers
(conv_depthwise._transpose16) into 16 rows of R positions, the bias and epilogue applied per row
(conv_spatial's vector IR: per-channel operands splat, full ones, a residual, read under the row's
mask) and stored NCHW under the mask. Chosen where it drops fewer lanes than conv_spatial
(`better_than_positions`).
"""
from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import conv_spatial
from . import conv_depthwise
from .conv_depthwise import _transpose16
from .conv_spatial import _I64, _V, _emit_epilogue, _i64, _lane_mask, _masked, _splat, _vptr, apply_steps, epilogue_reads

with open(os.path.abspath(__file__), "rb") as _f:   # the generated kernels' cache key: the intrinsics here
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16] + conv_depthwise.REVISION


def fma_loop(builder, n, count: int, products) -> list:
    """A counted loop over c < n (LLVM IR) of `count` vector multiply-adds: acc[i] += a_i * b_i for the
    [(a_i, b_i)] that products(c) emits in the loop body; the accumulators after the loop, zero where
    n <= 0."""
    fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
    zero = ir.Constant(_V, [0.0] * 16)
    start = builder.block
    loop, done = builder.append_basic_block("c_loop"), builder.append_basic_block("c_done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    c = builder.phi(_I64)
    c.add_incoming(ir.Constant(_I64, 0), start)
    accs = []
    for _ in range(count):
        acc = builder.phi(_V)
        acc.add_incoming(zero, start)
        accs.append(acc)
    new = [builder.call(fma, [a, b, acc]) for (a, b), acc in zip(products(c), accs)]
    nxt = builder.add(c, ir.Constant(_I64, 1))
    latch = builder.block
    c.add_incoming(nxt, latch)
    for acc, val in zip(accs, new):
        acc.add_incoming(val, latch)
    builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
    builder.position_at_end(done)
    finals = []
    for val in new:
        f = builder.phi(_V)
        f.add_incoming(zero, start)
        f.add_incoming(val, latch)
        finals.append(f)
    return finals


def fma_rows(builder, x_data, w_data, x_at, p_n, w_at, n, rows: int, blocked: bool = False) -> list:
    """The channel loop of a tile of 16 output channels and `rows` positions (LLVM IR): for c < n,
    acc[r] += w[w_at + 16 c : + 16] * x[x_at + c p_n + r] (blocked: x [C / 16, p_n, 16], channel c of
    position q at (c // 16) * 16 p_n + 16 q + c % 16); the accumulators after the loop, zero where n <= 0.
    Shared by the 1x1 conv tile and the 1x1 -> depthwise pair (expand_depthwise.py)."""
    def products(c):
        wv = builder.load(_vptr(builder, w_data, builder.add(w_at, builder.mul(c, ir.Constant(_I64, 16)))), align=4)
        return [(wv, _splat(builder, builder.load(builder.gep(x_data, [_x_at(builder, c, x_at, p_n, r, blocked)]))))
                for r in range(rows)]
    return fma_loop(builder, n, rows, products)


def _x_at(builder, c, x_at, p_n, r: int, blocked: bool):
    """The index of channel c at position x_at + r of an input of p_n positions (LLVM IR): NCHW c * p_n +
    x_at + r; blocked [C / 16, p_n, 16] (c // 16) * 16 p_n + 16 (x_at + r) + c % 16."""
    if not blocked:
        return builder.add(builder.add(x_at, builder.mul(c, p_n)), ir.Constant(_I64, r))
    block = builder.mul(builder.ashr(c, ir.Constant(_I64, 4)), builder.mul(p_n, ir.Constant(_I64, 16)))
    lane = builder.add(block, builder.and_(c, ir.Constant(_I64, 15)))
    return builder.add(lane, builder.mul(builder.add(x_at, ir.Constant(_I64, r)), ir.Constant(_I64, 16)))


def _column_intrinsic(blocks: int, steps, operands):
    """column(out, x, w, w_at, w_step, n_c, bias, m0, m_n, ops): a one-position image (P = 1: a classifier's
    1x1 conv after the global pool, a GEMV) for `blocks` blocks of 16 output channels side by side: for
    b < blocks, lanes l with m = m0 + 16 b + l < m_n: out[m] = epilogue(bias[m] + sum over c < n_c of
    w[w_at + b * w_step + 16 c + l] * x[c]). The blocks' sums are independent chains of multiply-adds (one
    block alone waits on each FMA), and its 16 channels are 16 consecutive outputs: no transpose."""
    @intrinsic
    def column(typingctx, out, x, w, w_at, w_step, n_c, bias, m0, m_n, ops):
        sig = types.void(out, x, w, w_at, w_step, n_c, bias, m0, m_n, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(1), arr(2), arr(6)
            w_at_v, w_step_v, n_v, m0_v, m_n_v = (_i64(builder, args[i]) for i in (3, 4, 5, 7, 8))
            _, store = _masked(builder)

            def products(c):
                xv = _splat(builder, builder.load(builder.gep(xa.data, [c])))
                w_c = builder.add(w_at_v, builder.mul(c, ir.Constant(_I64, 16)))
                return [(builder.load(_vptr(builder, wa.data, builder.add(w_c, builder.mul(w_step_v, ir.Constant(_I64, b)))),
                                      align=4), xv) for b in range(blocks)]
            finals = fma_loop(builder, n_v, blocks, products)
            for b, f in enumerate(finals):
                m_v = builder.add(m0_v, ir.Constant(_I64, 16 * b))
                mask = _lane_mask(builder, builder.sub(m_n_v, m_v), 0)
                value = builder.fadd(f, builder.load(_vptr(builder, ba.data, m_v), align=4))
                if steps:   # lanes are channels: per-channel operands 16 at a time, full ones at the same place
                    value = apply_steps(builder, steps, operands, epilogue_reads(
                        context, builder, operands, signature.args[9], args[9], m_v, m_v, mask, channels=mask), value)
                store(value, _vptr(builder, oa.data, m_v), mask)
            return context.get_dummy_value()
        return sig, codegen
    return column


@functools.cache
def column_for(blocks: int, key: str):
    return _column_intrinsic(blocks, *conv_spatial.SPECS[key])


def _tile_intrinsic(r_n: int, blocked_in: bool, steps, operands):
    """tile(out, out_at, p_n, x, x_at, w, w_at, n_c, bias, m0, rows, ops): for l < rows, r < r_n:
    out[out_at + l * p_n + r] = epilogue(bias[m0 + l] + sum over c < n_c of w[w_at + c * 16 + l] *
    x[x_at + c * p_n + r]) (channel m0 + l; full operands laid out as out; blocked_in: x channel-blocked)."""
    @intrinsic
    def tile(typingctx, out, out_at, p_n, x, x_at, w, w_at, n_c, bias, m0, rows, ops):
        sig = types.void(out, out_at, p_n, x, x_at, w, w_at, n_c, bias, m0, rows, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(3), arr(5), arr(8)
            out_at_v, p_v, x_at_v, w_at_v, n_v, m0_v, rows_v = (_i64(builder, args[i]) for i in (1, 2, 4, 6, 7, 9, 10))
            _, store = _masked(builder)
            zero = ir.Constant(_V, [0.0] * 16)
            finals = fma_rows(builder, xa.data, wa.data, x_at_v, p_v, w_at_v, n_v, r_n, blocked_in)
            rows_of = _transpose16(builder, finals + [zero] * (16 - r_n))
            mask = _lane_mask(builder, ir.Constant(_I64, r_n), 0)
            for l in range(16):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, l), rows_v)):
                    m_v = builder.add(m0_v, ir.Constant(_I64, l))
                    at = builder.add(out_at_v, builder.mul(p_v, ir.Constant(_I64, l)))
                    value = builder.fadd(rows_of[l], _splat(builder, builder.load(builder.gep(ba.data, [m_v]))))
                    value = _emit_epilogue(context, builder, steps, operands, signature.args[11], args[11], value, m_v, at, mask)
                    store(value, _vptr(builder, oa.data, at), mask)
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _blocks_tile_intrinsic(r_n: int, blocks: int, blocked_in: bool, steps, operands):
    """tile(out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops): the last r_n (< 4) positions of
    every row, for `blocks` blocks of 16 channels side by side: for b < blocks, m = m0 + 16 b + l < m_n,
    r < r_n: out[m * p_n + x_at + r] = epilogue(bias[m] + sum over c < n_c of w[w_at + b * w_step + c * 16 + l]
    * x[x_at + c * p_n + r]). One block's 1-3 chains of multiply-adds waited on each FMA (a 7 x 7 image's
    49th position cost as much as 4 others); blocks * r_n chains keep the FMA units busy. blocked_in: x
    channel-blocked (_x_at)."""
    @intrinsic
    def tile(typingctx, out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops):
        sig = types.void(out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(2), arr(4), arr(8)
            p_v, x_at_v, w_at_v, w_step_v, n_v, m0_v, m_n_v = (_i64(builder, args[i]) for i in (1, 3, 5, 6, 7, 9, 10))
            _, store = _masked(builder)
            zero = ir.Constant(_V, [0.0] * 16)

            finals = _tile_sums(builder, xa, wa, x_at_v, p_v, w_at_v, w_step_v, n_v, r_n, blocks, blocked_in)
            mask = _lane_mask(builder, ir.Constant(_I64, r_n), 0)
            for b in range(blocks):
                rows_of = _transpose16(builder, finals[b * r_n:(b + 1) * r_n] + [zero] * (16 - r_n))
                for l in range(16):
                    m_v = builder.add(m0_v, ir.Constant(_I64, 16 * b + l))
                    with builder.if_then(builder.icmp_signed("<", m_v, m_n_v)):
                        at = builder.add(builder.mul(p_v, m_v), x_at_v)
                        value = builder.fadd(rows_of[l], _splat(builder, builder.load(builder.gep(ba.data, [m_v]))))
                        value = _emit_epilogue(context, builder, steps, operands, signature.args[11], args[11], value, m_v, at,
                                               mask)
                        store(value, _vptr(builder, oa.data, at), mask)
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _tile_sums(builder, xa, wa, x_at_v, p_v, w_at_v, w_step_v, n_v, r_n: int, blocks: int, blocked_in: bool) -> list:
    """The accumulators [b * r_n + r] of a tile (both tile intrinsics): for c < n_v, block b's 16 weights
    w[w_at + b * w_step + 16 c:...] times position r's x[c, x_at + r] (NCHW or channel-blocked x)."""
    def products(c):
        xs = [_splat(builder, builder.load(builder.gep(xa.data, [_x_at(builder, c, x_at_v, p_v, r, blocked_in)])))
              for r in range(r_n)]
        w_c = builder.add(w_at_v, builder.mul(c, ir.Constant(_I64, 16)))
        pairs = []
        for b in range(blocks):
            wv = builder.load(_vptr(builder, wa.data, builder.add(w_c, builder.mul(w_step_v, ir.Constant(_I64, b)))),
                              align=4)
            pairs += [(wv, xs[r]) for r in range(r_n)]
        return pairs
    return fma_loop(builder, n_v, blocks * r_n, products)


def _blocked_tile_intrinsic(r_n: int, blocks: int, blocked_in: bool, steps, operands):
    """tile(out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops): the output channel-blocked
    ([M / 16, p_n, 16], ops/layout.py): for b < blocks, r < r_n, lanes l (channel m = m0 + 16 b + l):
    out[(m0 + 16 b) * p_n + 16 (x_at + r) + l] = epilogue(bias[m] + sum over c < n_c of
    w[w_at + b * w_step + 16 c + l] * x[c, x_at + r]), zero where m >= m_n. Lanes are channels, as the
    accumulators have them: stored with no transpose; full operands (a residual) blocked as out."""
    @intrinsic
    def tile(typingctx, out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops):
        sig = types.void(out, p_n, x, x_at, w, w_at, w_step, n_c, bias, m0, m_n, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(2), arr(4), arr(8)
            p_v, x_at_v, w_at_v, w_step_v, n_v, m0_v, m_n_v = (_i64(builder, args[i]) for i in (1, 3, 5, 6, 7, 9, 10))
            zero = ir.Constant(_V, [0.0] * 16)

            finals = _tile_sums(builder, xa, wa, x_at_v, p_v, w_at_v, w_step_v, n_v, r_n, blocks, blocked_in)
            for b in range(blocks):
                m_v = builder.add(m0_v, ir.Constant(_I64, 16 * b))
                channels = _lane_mask(builder, builder.sub(m_n_v, m_v), 0)
                bias_v = builder.load(_vptr(builder, ba.data, m_v), align=4)
                for r in range(r_n):
                    at = builder.add(builder.mul(m_v, p_v), builder.mul(builder.add(x_at_v, ir.Constant(_I64, r)),
                                                                        ir.Constant(_I64, 16)))
                    value = builder.fadd(finals[b * r_n + r], bias_v)
                    if steps:
                        value = apply_steps(builder, steps, operands, epilogue_reads(
                            context, builder, operands, signature.args[11], args[11], m_v, at, channels, channels=channels),
                            value)
                    value = builder.select(channels, value, zero)
                    builder.store(value, _vptr(builder, oa.data, at), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return tile


@functools.cache
def blocked_tile_for(r_n: int, blocks: int, key: str, blocked_in: bool):
    return _blocked_tile_intrinsic(r_n, blocks, blocked_in, *conv_spatial.SPECS[key])


TAIL_BLOCKS = {1: 4, 2: 2, 3: 2}   # blocks side by side for a tail of 1, 2, 3 positions: 4-6 chains (2 and 3 alike)


@functools.cache
def blocks_tile_for(r_n: int, key: str, blocked_in: bool = False):
    return _blocks_tile_intrinsic(r_n, TAIL_BLOCKS[r_n], blocked_in, *conv_spatial.SPECS[key])


@functools.cache
def pair_tile_for(r_n: int, key: str, blocked_in: bool = False):
    return _blocks_tile_intrinsic(r_n, 2, blocked_in, *conv_spatial.SPECS[key])


@functools.cache
def tile_for(r_n: int, key: str, blocked_in: bool = False):
    return _tile_intrinsic(r_n, blocked_in, *conv_spatial.SPECS[key])


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_pointwise import blocks_tile_for, column_for, pair_tile_for, tile_for

tile16, tile8, tile4, tile2, tile1 = (tile_for(r, {key!r}, {blocked_in}) for r in (16, 8, 4, 2, 1))
column4, column1 = column_for(4, {key!r}), column_for(1, {key!r})   # one position: blocked or not alike
tail1, tail2, tail3 = (blocks_tile_for(r, {key!r}, {blocked_in}) for r in (1, 2, 3))
pair8, pair4 = (pair_tile_for(r, {key!r}, {blocked_in}) for r in (8, 4))


@njit(cache=True, nogil=True)
def kernel(x, w, bias, out, ops):
    # x [C, P] (blocked: [C / 16, P * 16]), w [M rounded up to 16 / 16, C, 16], bias [M rounded up],
    # out [M, P], all C-contiguous
    c_n = w.shape[1]
    m_n, p_n = out.shape
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    wf = w.reshape(w.size)
    if p_n == 1:   # a GEMV: four blocks of 16 channels a pass, stored as they are (lanes: consecutive outputs)
        b = 0
        while b + 4 <= w.shape[0]:
            column4(of, xf, wf, b * c_n * 16, c_n * 16, c_n, bias, b * 16, m_n, ops)
            b += 4
        while b < w.shape[0]:
            column1(of, xf, wf, b * c_n * 16, c_n * 16, c_n, bias, b * 16, m_n, ops)
            b += 1
        return
    tail = p_n % 4   # the last 1-3 positions: `group` blocks a pass, after the group's other tiles
    group = {tail_1} if tail == 1 else 2   # TAIL_BLOCKS; pairs of blocks for the tiles of 8 and 4 positions
    main = p_n - tail
    step = c_n * 16
    for g in range(0, w.shape[0], group):
        end = min(w.shape[0], g + group)
        b = g
        while b + 2 <= end:   # 32 channels x 8 positions a tile: 2 weight loads and 8 broadcasts for 16 FMAs
            p = 0
            while p + 8 <= main:
                pair8(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
                p += 8
            if p + 4 <= main:
                pair4(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            b += 2
        for b in range(b, end):   # a block left over: 16 channels x 16, 8, 4 positions
            m0 = b * 16
            rows = min(16, m_n - m0)
            w_at = b * step
            p = 0
            while p + 16 <= main:
                tile16(of, m0 * p_n + p, p_n, xf, p, wf, w_at, c_n, bias, m0, rows, ops)
                p += 16
            if p + 8 <= main:
                tile8(of, m0 * p_n + p, p_n, xf, p, wf, w_at, c_n, bias, m0, rows, ops)
                p += 8
            if p + 4 <= main:
                tile4(of, m0 * p_n + p, p_n, xf, p, wf, w_at, c_n, bias, m0, rows, ops)
        if not tail:
            continue
        if g + group > w.shape[0]:   # a group short of blocks: one block at a time
            for b in range(g, end):
                m0 = b * 16
                rows = min(16, m_n - m0)
                p = main
                if p + 2 <= p_n:
                    tile2(of, m0 * p_n + p, p_n, xf, p, wf, b * step, c_n, bias, m0, rows, ops)
                    p += 2
                if p < p_n:
                    tile1(of, m0 * p_n + p, p_n, xf, p, wf, b * step, c_n, bias, m0, rows, ops)
        elif tail == 1:
            tail1(of, p_n, xf, p_n - 1, wf, g * step, step, c_n, bias, g * 16, m_n, ops)
        elif tail == 2:
            tail2(of, p_n, xf, p_n - 2, wf, g * step, step, c_n, bias, g * 16, m_n, ops)
        else:
            tail3(of, p_n, xf, p_n - 3, wf, g * step, step, c_n, bias, g * 16, m_n, ops)
"""


_BLOCKED_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_pointwise import blocked_tile_for

tile16, tile8, tile4, tile3, tile2, tile1 = (blocked_tile_for(r, 1, {key!r}, {blocked_in}) for r in (16, 8, 4, 3, 2, 1))
pair8, pair4 = (blocked_tile_for(r, 2, {key!r}, {blocked_in}) for r in (8, 4))
tail1, tail2, tail3 = (blocked_tile_for(r, b, {key!r}, {blocked_in}) for r, b in ((1, {tail_1}), (2, {tail_2}), (3, {tail_3})))


@njit(cache=True, nogil=True)
def kernel(x, w, bias, out, ops, m_n):
    # x [C, P] (blocked_in: [C / 16, P * 16]), w [M rounded up to 16 / 16, C, 16], bias [M rounded up],
    # out [M / 16, P * 16] blocked; m_n: M
    p_n = out.shape[1] // 16
    c_n, blocks = w.shape[1], w.shape[0]
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    wf = w.reshape(w.size)
    step = c_n * 16
    tail = p_n % 4
    main = p_n - tail
    b = 0
    while b + 2 <= blocks:   # 32 channels x 8 positions a tile: 2 weight loads and 8 broadcasts for 16 FMAs
        p = 0
        while p + 8 <= main:
            pair8(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            p += 8
        if p + 4 <= main:
            pair4(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
        b += 2
    for b in range(b, blocks):   # 16 channels x 16, 8, 4 positions a tile
        p = 0
        while p + 16 <= main:
            tile16(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            p += 16
        if p + 8 <= main:
            tile8(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            p += 8
        if p + 4 <= main:
            tile4(of, p_n, xf, p, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
    if tail:   # the last 1-3 positions: several blocks a pass (TAIL_BLOCKS), then one at a time
        group = {tail_1} if tail == 1 else {tail_2} if tail == 2 else {tail_3}
        b = 0
        while b + group <= blocks:
            if tail == 1:
                tail1(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            elif tail == 2:
                tail2(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            else:
                tail3(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            b += group
        while b < blocks:
            if tail == 1:
                tile1(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            elif tail == 2:
                tile2(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            else:
                tile3(of, p_n, xf, main, wf, b * step, step, c_n, bias, b * 16, m_n, ops)
            b += 1
"""


def driver(steps, operands, blocked_in: bool = False, blocked_out: bool = False):
    """The numba kernel(x, w, bias, out, ops) with this epilogue (steps may be empty), its input and
    output NCHW or channel-blocked (ops/layout.py; blocked_out: kernel(x, w, bias, out, ops, m), m the
    output channels)."""
    key = conv_spatial.steps_key(steps, operands)
    conv_spatial.epilogue_for(key, steps, operands)
    if blocked_out:
        source = _BLOCKED_DRIVER.format(key=key, blocked_in=blocked_in, tail_1=TAIL_BLOCKS[1], tail_2=TAIL_BLOCKS[2],
                                        tail_3=TAIL_BLOCKS[3])
    else:
        source = _DRIVER.format(key=key, tail_1=TAIL_BLOCKS[1], blocked_in=blocked_in)
    return conv_spatial.load(f"# pointwise {REVISION}\n{source}", "kernel", "cpu_conv_pointwise")


def arrange_weights(w: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """w [M, C, 1, 1] as [M rounded up to 16 / 16, C, 16] (zeros past M) and the bias as [M rounded up]."""
    m = w.shape[0]
    blocks = -(-m // 16)
    wk = np.zeros((blocks * 16, w.shape[1]), np.float32)
    wk[:m] = w.reshape(m, -1)
    b = np.zeros(blocks * 16, np.float32)
    if bias is not None:
        b[:m] = bias.reshape(-1)
    return np.ascontiguousarray(wk.reshape(blocks, 16, -1).transpose(0, 2, 1)), b


def better_than_positions(m: int, p: int) -> bool:
    """Whether this kernel computes fewer dropped lanes than conv_spatial's (64 positions a tile, the
    last tile's vectors rounded up to 16): 7 x 7 images with M a multiple of 16, not 56 x 56."""
    ours = (-(-m // 16) * 16) / m
    theirs = (-(-p // 16) * 16) / p
    return ours < theirs
