"""Depthwise convolutions with channels in blocks of 16 (NCHWc, as onnxruntime's kernels): conv.py picks
this kernel where the output is small (MAX_OUTPUTS positions).

conv._depthwise vectorises along an output row, which suits wide rows; MobileNet's late layers have
rows of 7 or 14 and hundreds of channels, where it ran at ~2 GMAC/s (576 channels, 7 x 7, 5 x 5 taps:
0.42 ms). Here 16 channels are one AVX-512 vector: a block's input is copied once into a zero-padded
[H', W', 16] buffer and each output position is kh * kw vector FMAs in registers (an llvmlite
intrinsic per window size, as vnni.py emits VPDPBUSD): 0.09-0.10 ms there. Past 28 x 28 outputs the
copies in and out cost more than they save.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ... import codegen

LANES = 16   # channels per block: one AVX-512 vector of float32


def _window_intrinsic(kh: int, kw: int):
    """window(acc, acc_at, xb, x_at, row_step, col_step, wb): acc[acc_at:+16] = sum over the kh x kw taps
    of xb[x_at + i * row_step + j * col_step : +16] * wb[(i * kw + j) * 16 : +16], as <16 x float>
    vectors (numba's loops over 16 lanes of three arrays did not vectorise: aliasing)."""
    @intrinsic
    def window(typingctx, acc, acc_at, xb, x_at, row_step, col_step, wb):
        sig = types.void(acc, acc_at, xb, x_at, row_step, col_step, wb)

        def codegen(context, builder, signature, args):
            acc_v, acc_at_v, x_v, x_at_v, row_v, col_v, w_v = args
            arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
            aa, xa, wa = arr(0, acc_v), arr(2, x_v), arr(6, w_v)
            f16x = ir.VectorType(ir.FloatType(), 16)
            i64 = ir.IntType(64)
            total = None
            for i in range(kh):
                row_at = builder.add(x_at_v, builder.mul(row_v, ir.Constant(row_v.type, i)))
                for j in range(kw):
                    at = builder.add(row_at, builder.mul(col_v, ir.Constant(col_v.type, j)))
                    xv = builder.load(builder.bitcast(builder.gep(xa.data, [at]), f16x.as_pointer()), align=4)
                    wv = builder.load(builder.bitcast(builder.gep(wa.data, [ir.Constant(i64, (i * kw + j) * 16)]),
                                                      f16x.as_pointer()), align=4)
                    prod = builder.fmul(xv, wv, flags=("contract",))
                    total = prod if total is None else builder.fadd(total, prod, flags=("contract",))
            builder.store(total, builder.bitcast(builder.gep(aa.data, [acc_at_v]), f16x.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return window


WINDOWS = {(kh, kw): _window_intrinsic(kh, kw) for kh, kw in ((3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (1, 5), (5, 1))}


_KERNEL = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_kernels import LANES, WINDOWS

window = WINDOWS[({kh}, {kw})]


@njit(cache=True, nogil=True, fastmath=True)
def kernel(x, w, sh, sw, dh, dw, ph, pw, out):
    c_n, h, wd = x.shape
    kh, kw = w.shape[1], w.shape[2]
    oh, ow = out.shape[1], out.shape[2]
    hp = max(h + ph, (oh - 1) * sh + (kh - 1) * dh + 1)
    wp = max(wd + pw, (ow - 1) * sw + (kw - 1) * dw + 1)
    xb = np.zeros((hp, wp, LANES), np.float32)
    xf = xb.reshape(hp * wp * LANES)
    wb = np.zeros(kh * kw * LANES, np.float32)
    acc = np.empty((ow, LANES), np.float32)
    af = acc.reshape(ow * LANES)
    for c0 in range(0, c_n, LANES):
        lanes = min(LANES, c_n - c0)
        for l in range(lanes):
            for i in range(kh):
                for j in range(kw):
                    wb[(i * kw + j) * LANES + l] = w[c0 + l, i, j]
            for y in range(h):
                for xx in range(wd):
                    xb[y + ph, xx + pw, l] = x[c0 + l, y, xx]
        for oy in range(oh):
            base = oy * sh * wp * LANES
            for ox in range(ow):
                window(af, ox * LANES, xf, base + ox * sw * LANES, dh * wp * LANES, dw * LANES, wb)
            for l in range(lanes):
                orow = out[c0 + l, oy]
                for ox in range(ow):
                    orow[ox] = acc[ox, l]
"""
MAX_OUTPUTS = 28 * 28   # output positions up to which the blocked kernel wins (the copies cost more past it)


def blocked_fits(kh: int, kw: int, oh: int, ow: int) -> bool:
    return (kh, kw) in WINDOWS and oh * ow <= MAX_OUTPUTS


def depthwise_blocked(x, w, sh, sw, dh, dw, ph, pw, out) -> None:
    """The whole depthwise convolution out [C, OH, OW] of x [C, H, W] by w [C, kh, kw] (a size in WINDOWS)
    with channels in blocks of LANES: each block's input copied into a zero-padded [H', W', LANES]
    buffer, each output position one window of vector FMAs, each row written back channel by channel.
    The kernel for w's size is generated once and cached on disk (codegen)."""
    kh, kw = w.shape[1:]
    kernel = codegen.load(_KERNEL.format(kh=kh, kw=kw), "kernel", "cpu_depthwise")
    kernel(x, w, sh, sw, dh, dw, ph, pw, out)
