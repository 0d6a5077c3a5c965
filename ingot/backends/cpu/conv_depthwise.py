"""Depthwise convolutions with 16 channels to a vector, the epilogue applied in registers.

conv_spatial's depthwise kernel vectorises along an output row: each channel is copied into its own
padded plane, every tap is a load per 16 positions, rows of 7 or 14 leave lanes idle, and the epilogue
is a second pass. MobileNet's depthwise layers (3 x 3 and 5 x 5, stride 1 and 2, 7 x 7 to 56 x 56
outputs, 16 to 576 channels) ran there at 7-28 GFLOP/s. Here, per block of 16 channels:

- the block is transposed into a zero-padded [H', W', 16] buffer, 16 x 16 at a time in registers
  (`_transpose_in`: 64 two-source shuffles per 256 values);
- a tile of R output positions of one row (`_tile`) keeps R accumulators; per kernel row it loads each
  input column the tile reads once (s * (R - 1) + kw vectors) and each tap's 16 weights once, then
  kw * R FMAs; bias and epilogue (conv_spatial.apply_steps, channel operands read 16 at a time) are
  applied before the store into an [OH * OW, 16] buffer;
- that buffer is transposed back into the NCHW output (`_transpose_out`, masked at the ends).

Column stride 1 or 2 (any row stride), dilation 1, windows up to 7 x 7.
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
from .conv_spatial import _I32, _I64, _V, _i64, _lane_mask, _masked, _vptr, apply_steps, epilogue_reads

with open(os.path.abspath(__file__), "rb") as _f:
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16]


def _transpose16(builder, vs):
    """16 <16 x float> rows as 16 columns: 4 stages, stage s swapping bit s of row and column."""
    vs = list(vs)
    for s in (8, 4, 2, 1):
        lo = ir.Constant(ir.VectorType(_I32, 16), [k if not k & s else 16 + (k ^ s) for k in range(16)])
        hi = ir.Constant(ir.VectorType(_I32, 16), [k ^ s if not k & s else 16 + k for k in range(16)])
        out = list(vs)
        for i in range(16):
            if not i & s:
                out[i] = builder.shuffle_vector(vs[i], vs[i + s], lo)
                out[i + s] = builder.shuffle_vector(vs[i], vs[i + s], hi)
        vs = out
    return vs


def _row_masks(builder, cols_v, rows_v):
    """Per row l < 16: the lanes < cols, or none where l >= rows."""
    cols = _lane_mask(builder, _i64(builder, cols_v), 0)
    none = ir.Constant(cols.type, [0] * 16)
    rows = _i64(builder, rows_v)
    return [builder.select(builder.icmp_signed("<", ir.Constant(_I64, l), rows), cols, none) for l in range(16)]


@intrinsic
def _transpose_in(typingctx, dst, dst_at, src, src_at, src_step, rows, cols):
    """dst[dst_at + p * 16 + l] = src[src_at + l * src_step + p] for p < 16, l < 16, zero where l >= rows
    or p >= cols (all 16 positions are written)."""
    sig = types.void(dst, dst_at, src, src_at, src_step, rows, cols)

    def codegen(context, builder, signature, args):
        da = context.make_array(signature.args[0])(context, builder, args[0])
        sa = context.make_array(signature.args[2])(context, builder, args[2])
        dst_at_v, src_at_v, step_v = (_i64(builder, args[i]) for i in (1, 3, 4))
        load, _ = _masked(builder)
        masks = _row_masks(builder, args[6], args[5])
        vs = [load(_vptr(builder, sa.data, builder.add(src_at_v, builder.mul(step_v, ir.Constant(_I64, l)))), masks[l])
              for l in range(16)]
        for p, v in enumerate(_transpose16(builder, vs)):
            builder.store(v, _vptr(builder, da.data, builder.add(dst_at_v, ir.Constant(_I64, 16 * p))), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _transpose_out(typingctx, dst, dst_at, dst_step, src, src_at, rows, cols):
    """dst[dst_at + l * dst_step + p] = src[src_at + p * 16 + l] for l < rows, p < cols (reads 256 values)."""
    sig = types.void(dst, dst_at, dst_step, src, src_at, rows, cols)

    def codegen(context, builder, signature, args):
        da = context.make_array(signature.args[0])(context, builder, args[0])
        sa = context.make_array(signature.args[3])(context, builder, args[3])
        dst_at_v, step_v, src_at_v = (_i64(builder, args[i]) for i in (1, 2, 4))
        _, store = _masked(builder)
        masks = _row_masks(builder, args[6], args[5])
        vs = [builder.load(_vptr(builder, sa.data, builder.add(src_at_v, ir.Constant(_I64, 16 * p))), align=4)
              for p in range(16)]
        for l, v in enumerate(_transpose16(builder, vs)):
            store(v, _vptr(builder, da.data, builder.add(dst_at_v, builder.mul(step_v, ir.Constant(_I64, l)))), masks[l])
        return context.get_dummy_value()
    return sig, codegen


def _tile_intrinsic(kh: int, kw: int, stride: int, r_n: int, zero_lanes: bool, steps, operands):
    """tile(out, out_at, x, x_at, row_step, w, bias, c0, lanes, ops): for r < r_n, out[out_at + 16 r : +16] =
    the epilogue of bias[0:16] + sum over taps (i, j) of w[(i * kw + j) * 16 : +16] *
    x[x_at + i * row_step + (stride * r + j) * 16 : +16] (channels c0 + lane, lanes < `lanes` real; zero_lanes:
    the others stored as zeros, as the blocked layout has them)."""
    @intrinsic
    def tile(typingctx, out, out_at, x, x_at, row_step, w, bias, c0, lanes, ops):
        sig = types.void(out, out_at, x, x_at, row_step, w, bias, c0, lanes, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(2), arr(5), arr(6)
            out_at_v, x_at_v, row_v, c0_v, lanes_v = (_i64(builder, args[i]) for i in (1, 3, 4, 7, 8))
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
            vload = lambda data, at: builder.load(_vptr(builder, data, at), align=4)  # noqa: E731
            bias_v = vload(ba.data, ir.Constant(_I64, 0))
            acc = [bias_v] * r_n
            for i in range(kh):
                base = builder.add(x_at_v, builder.mul(row_v, ir.Constant(_I64, i)))
                cols = {}
                for j in range(kw):
                    wv = vload(wa.data, ir.Constant(_I64, (i * kw + j) * 16))
                    for r in range(r_n):
                        c = stride * r + j
                        if c not in cols:
                            cols[c] = vload(xa.data, builder.add(base, ir.Constant(_I64, 16 * c)))
                        acc[r] = builder.call(fma, [wv, cols[c], acc[r]])
            channels = _lane_mask(builder, lanes_v, 0)
            read = epilogue_reads(context, builder, operands, signature.args[9], args[9], c0_v, channels=channels) \
                if steps else {}
            for r in range(r_n):
                value = apply_steps(builder, steps, operands, read, acc[r]) if steps else acc[r]
                if zero_lanes:
                    value = builder.select(channels, value, ir.Constant(_V, [0.0] * 16))
                builder.store(value, _vptr(builder, oa.data, builder.add(out_at_v, ir.Constant(_I64, 16 * r))), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return tile


@functools.cache
def tile_for(kh: int, kw: int, stride: int, r_n: int, key: str, zero_lanes: bool = False):
    return _tile_intrinsic(kh, kw, stride, r_n, zero_lanes, *conv_spatial.SPECS[key])


# One output row's tiles of r_n positions, the width dispatched among the five tile kernels (tile4..tile8,
# BLOCKED_OUT: globals of the generated module that includes this; conv_depthwise's and expand_depthwise's).
# x_row: the row's first input position in xp, t_row: its first position in ot (both in positions).
TILES_OF_ROW = """
@njit(inline="always")
def tiles_of_row(ot, of, xp, x_row, t_row, wp, s, wt, bt, c0, lanes, ops, oy, ow, r_n, p_n):
    for ox in range(0, ow, r_n):
        x_at = (x_row + ox * s) * 16
        dst, at, through = ot, (t_row + ox) * 16, False
        if BLOCKED_OUT:
            # past the row: into the next, computed later; past the block's last row: through ot (expand_depthwise
            # computes two blocks band by band: the next block's first rows may be done)
            if oy * ow + ox + r_n <= p_n:
                dst, at = of, c0 * p_n + (oy * ow + ox) * 16
            else:
                at, through = 0, True
        if r_n == 8:
            tile8(dst, at, xp, x_at, wp * 16, wt, bt, c0, lanes, ops)
        elif r_n == 7:
            tile7(dst, at, xp, x_at, wp * 16, wt, bt, c0, lanes, ops)
        elif r_n == 6:
            tile6(dst, at, xp, x_at, wp * 16, wt, bt, c0, lanes, ops)
        elif r_n == 5:
            tile5(dst, at, xp, x_at, wp * 16, wt, bt, c0, lanes, ops)
        else:
            tile4(dst, at, xp, x_at, wp * 16, wt, bt, c0, lanes, ops)
        if through:
            at = c0 * p_n + (oy * ow + ox) * 16
            of[at:at + (ow - ox) * 16] = ot[:(ow - ox) * 16]
"""


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_depthwise import _transpose_in, _transpose_out, tile_for

# every tile width positions() may pick: a new image width needs no other kernel
tile4, tile5, tile6, tile7, tile8 = (tile_for({kh}, {kw}, {stride}, r, {key!r}, {blocked_out}) for r in (4, 5, 6, 7, 8))
BLOCKED_IN, BLOCKED_OUT = {blocked_in}, {blocked_out}
{tiles_of_row}

@njit(cache=True, nogil=True)
def kernel(x, w, bias, sh, ph, pw, out, ops, xp, ot, c_n, r_n):
    # x [C, H, W] (blocked: [C / 16, H, W * 16]), w [C / 16, kh * kw * 16], bias [C / 16, 16] (arrange_weights),
    # c_n: C, r_n: output positions per tile (positions(OW)), out [C, OH, OW] (blocked:
    # [C / 16, OH, OW * 16]); column stride s, row stride sh; xp, ot: scratch of band_scratch_sizes. Per block
    # of 16 channels, a band of output rows at a time: the padded input rows it reads transposed (blocked:
    # copied) into xp (band-relative: rows r0.. of the padded plane; the rows two bands share are
    # transposed again), its tiles into ot, ot transposed back (blocked: the tiles stored in place, the
    # last one past the output's end through ot): the scratch stays in L2 (full planes of it, 0.8 MB each
    # at 16 x 112 x 112, went to memory and back between two runs).
    h = x.shape[1]
    wd = x.shape[2] // 16 if BLOCKED_IN else x.shape[2]
    oh = out.shape[1]
    ow = out.shape[2] // 16 if BLOCKED_OUT else out.shape[2]
    kh, kw, s = {kh}, {kw}, {stride}
    taps = kh * kw
    wp = max(wd + pw, s * (ow - 1) + kw)
    p_n = oh * ow
    band = max(1, 2048 // wp)
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    filled = pw + wd if BLOCKED_IN else pw + (wd + 15) // 16 * 16   # columns the copies write (zeros past wd)
    for c0 in range(0, c_n, 16):
        lanes = min(16, c_n - c0)
        wt, bt = w[c0 // 16], bias[c0 // 16]
        for oy0 in range(0, oh, band):
            oy1 = min(oh, oy0 + band)
            r0 = oy0 * sh
            for r in range(r0, (oy1 - 1) * sh + kh):
                at = (r - r0) * wp * 16
                y = r - ph
                if y < 0 or y >= h:
                    xp[at:at + wp * 16] = 0.0
                    continue
                xp[at:at + pw * 16] = 0.0
                if filled < wp:
                    xp[at + filled * 16:at + wp * 16] = 0.0
                if BLOCKED_IN:   # a loop: a slice assignment copies through a temporary (may they overlap?)
                    src, dst = np.uintp((c0 * h + y * 16) * wd), np.uintp(at + pw * 16)
                    for t in range(np.uintp(wd * 16)):
                        xp[dst + t] = xf[src + t]
                else:
                    for x0 in range(0, wd, 16):
                        _transpose_in(xp, at + (pw + x0) * 16, xf, (c0 * h + y) * wd + x0, h * wd, lanes, wd - x0)
            for oy in range(oy0, oy1):
                tiles_of_row(ot, of, xp, (oy - oy0) * sh * wp, (oy - oy0) * ow, wp, s, wt, bt, c0, lanes, ops, oy, ow,
                             r_n, p_n)
            if not BLOCKED_OUT:
                n = (oy1 - oy0) * ow
                for p0 in range(0, n, 16):
                    _transpose_out(of, c0 * p_n + oy0 * ow + p0, p_n, ot, p0 * 16, lanes, min(16, n - p0))
"""


def arrange_weights(w: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """w [C, taps] as [C / 16, taps * 16] (tap t of channel 16 b + l at [b, 16 t + l]) and the bias as
    [C / 16, 16], zeros past C: a block's taps as the tiles load them."""
    c, taps = w.shape
    blocks = -(-c // 16)
    wk = np.zeros((blocks * 16, taps), np.float32)
    wk[:c] = w
    b = np.zeros(blocks * 16, np.float32)
    if bias is not None:
        b[:c] = bias.reshape(-1)
    return np.ascontiguousarray(wk.reshape(blocks, 16, taps).transpose(0, 2, 1).reshape(blocks, taps * 16)), \
        b.reshape(blocks, 16)


def fits(kh: int, kw: int, strides, dilations, operands) -> bool:
    """Windows up to 7 x 7, column stride 1 or 2, dilation 1, epilogue operands scalars or per channel."""
    return kh <= 7 and kw <= 7 and strides[1] in (1, 2) and strides[0] >= 1 and tuple(dilations) == (1, 1) and \
        all(form in ("scalar", "channel") for form, _ in operands)


def positions(ow: int) -> int:
    """Output positions per tile: 4 to 8, the fewest computed and dropped at the row's end (ties: more)."""
    return min(range(8, 3, -1), key=lambda r: -(-ow // r) * r - ow)


def scratch_sizes(kh: int, kw: int, stride: int, in_hw, out_hw, sh: int, ph: int, pw: int) -> tuple[int, int]:
    """Floats of the kernel's xp (the padded [H', W', 16] block, slack past it for the tails) and ot."""
    (h, wd), (oh, ow) = in_hw, out_hw
    wp = max(wd + pw, stride * (ow - 1) + kw)
    hp = max(h + ph, sh * (oh - 1) + kh)
    return (hp * wp + stride * positions(ow) + kw + 32) * 16, (oh * ow + positions(ow) + 32) * 16


def band_scratch_sizes(kh: int, kw: int, stride: int, in_hw, out_hw, sh: int, ph: int, pw: int) -> tuple[int, int]:
    """Floats of the kernel's xp (a band's padded [rows, W', 16], slack past it for the tails) and ot (the
    band's outputs)."""
    (_, wd), (oh, ow) = in_hw, out_hw
    wp = max(wd + pw, stride * (ow - 1) + kw)
    band = max(1, 2048 // wp)
    rows = (min(band, oh) - 1) * sh + kh
    return (rows * wp + stride * positions(ow) + kw + 32) * 16, (min(band, oh) * ow + positions(ow) + 32) * 16


def driver(kh: int, kw: int, stride: int, steps, operands, blocked_in: bool = False, blocked_out: bool = False):
    """The kernel for this window and epilogue, its input and output NCHW or channel-blocked (ops/layout.py). It
    holds a tile of each width positions() picks and takes the width as an argument: a new image width reuses
    the kernel (one kernel per width cost ~5 ms to load from numba's cache at each new width of a model)."""
    key = conv_spatial.steps_key(steps, operands)
    conv_spatial.epilogue_for(key, steps, operands)
    source = _DRIVER.format(kh=kh, kw=kw, stride=stride, key=key, blocked_in=blocked_in,
                            blocked_out=blocked_out, tiles_of_row=TILES_OF_ROW)
    return conv_spatial.load(f"# depthwise {REVISION}\n{source}", "kernel", "cpu_conv_depthwise")


def depthwise_step(conv, out, epilogue, x_index: int, w_index: int, b_index: int | None, constant: bool,
                   window: tuple, constants: frozenset, operand, blocked_in: bool = False, blocked_out: bool = False):
    """conv.py's step for a depthwise conv here: window (row stride, column stride, ph, pw); operand:
    conv._operand (an epilogue operand as the kernels read it); blocked_in, blocked_out: the input, the
    output in the channel-blocked layout (ops/layout.py)."""
    out_shape = tuple(conv.type.shape)
    n_img, c = out_shape[:2]
    blocks = -(-c // 16)
    spatial = out_shape[2:] if len(out_shape) == 4 else (1,) + out_shape[2:]
    in_spatial = conv.src[0].type.shape[2:] if len(out_shape) == 4 else (1,) + conv.src[0].type.shape[2:]
    w_shape = conv.src[1].type.shape
    kh, kw = (w_shape[2], w_shape[3]) if len(w_shape) == 4 else (1, w_shape[2])
    sh, sw, ph, pw = window
    operands = epilogue.operands
    kernel = driver(kh, kw, sw, epilogue.steps, operands, blocked_in, blocked_out)
    r_n = positions(spatial[1])
    xp_n, ot_n = band_scratch_sizes(kh, kw, sw, in_spatial, spatial, sh, ph, pw)
    if blocked_out:   # the output's last tile only
        ot_n = (positions(spatial[1]) + 32) * 16
    x_shape = (n_img, blocks, in_spatial[0], in_spatial[1] * 16) if blocked_in else (n_img, c, *in_spatial)
    y_shape = (n_img, blocks, spatial[0], spatial[1] * 16) if blocked_out else (n_img, c, *spatial)
    result_shape = (n_img, blocks, *spatial, 16) if blocked_out else out_shape
    xp, ot = np.zeros(xp_n, np.float32), np.empty(ot_n, np.float32)   # reused: their pages stay mapped
    fixed_ops = all(i in constants for _, i in operands)
    arranged: dict = {}

    def step(*inputs, into=None):
        wk = arranged.get("w") if constant else None
        if wk is None:
            bias = inputs[b_index] if b_index is not None else None
            wk = arrange_weights(np.asarray(inputs[w_index], dtype=np.float32).reshape(c, kh * kw),
                                 None if bias is None else np.asarray(bias, dtype=np.float32))
            if constant:
                arranged["w"] = wk
        ops = arranged.get("ops") if fixed_ops else None
        if ops is None:
            ops = tuple(operand(inputs[i], form, 0) for form, i in operands)
            if fixed_ops:
                arranged["ops"] = ops
        xs = np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(x_shape)
        y = into if into is not None else out if out is not None else np.empty(result_shape, np.float32)
        ys = y.reshape(y_shape)
        for n in range(n_img):
            kernel(xs[n], wk[0], wk[1], sh, ph, pw, ys[n], ops, xp, ot, c, r_n)
        return y
    step.splits = True   # writes `into` where given (conv.threaded_step)
    return step
