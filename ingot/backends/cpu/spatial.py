"""The FUSED ops of passes/fuse_spatial.py: max pooling, nearest upsampling and the depth-to-space
shuffle, each one compiled pass over [N, C, H, W] float32 planes.

- max_pool: each plane copied into a buffer holding the padding (the pad's value), then 16 outputs of
  a row at a time, their maximum kept in a register over the window's taps (at most 7 x 7, column stride
  1 or 2: generated per window); at stride 1 over the window's columns, then its rows (5 x 5: 10 maxima
  an output, not 25). Where the output is as wide as the input (SPPF's 5 x 5, pads 2) both passes run on
  whole planes as flat vectors, x read in place under per-tap lane masks, no copy (YOLO's 64 x 20 x 20:
  16.4 -> 9.4 us a pool, hot; rows of 20 were a vector and a quarter each). Other windows that need no
  padding read x in place, and only the rows and columns the others read are copied (DBNet's 3 x 3 stride 2
  over 16 x 160 x 160: 0.074 -> 0.070 ms hot; in the model it reads its input from L3, ~0.1 ms either way).
  NaN propagates, as np.max: VMAXPS and a sum of the taps per vector, the few
  vectors whose sum is NaN taken again with a NaN-keeping compare.
- upsample: out[n, c, i, j] = x[n, c, rows[i], cols[j]]; an output row equal to the one before (nearest
  upsampling repeats each row) is copied whole; at cols[j] = j // 2 each value is stored twice (no gather),
  at rows[i] = i // 2 as well into both rows of a pair, 16 values a vector load, two shuffles, four vector
  stores (YOLO's 128 x 20 x 20 -> 40 x 40: 0.076 -> 0.026 ms hot as scalar stores, 0.012 so).
- depth_to_space: out[n, m, y * kh + i, x * kw + j] = x[n, (m * kh + i) * kw + j, y, x].
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...ir import Node, Op
from ...ops import REGISTRY
from ...ops.fused import Body
from ...passes.fuse_spatial import pool_window, shuffle_of
from . import conv_spatial as cs


def _window_max_intrinsic(kh: int, kw: int, sw: int):
    """window_max(out, o_at, buf, b_at, row_step, dh, dw, n): for lanes t < min(n, 16), out[o_at + t] = max
    over i < kh, j < kw of buf[b_at + i * dh * row_step + j * dw + sw * t] (NaN kept, as np.maximum), the
    maximum kept in a register over the taps; buf is read only where a lane is used (masked loads: the
    kernel reads an unpadded input in place)."""
    @intrinsic
    def window_max(typingctx, out, o_at, buf, b_at, row_step, dh, dw, n):
        sig = types.void(out, o_at, buf, b_at, row_step, dh, dw, n)

        def codegen(context, builder, signature, args):
            oa = context.make_array(signature.args[0])(context, builder, args[0])
            ba = context.make_array(signature.args[2])(context, builder, args[2])
            o_at_v, b_at_v, row_v, dh_v, dw_v, n_v = (cs._i64(builder, args[i]) for i in (1, 3, 4, 5, 6, 7))
            load, store = cs._masked(builder)
            i64, i32 = ir.IntType(64), ir.IntType(32)
            even = ir.Constant(ir.VectorType(i32, 16), list(range(0, 32, 2)))
            row_v = builder.mul(row_v, dh_v)
            used = builder.add(builder.mul(builder.sub(n_v, ir.Constant(i64, 1)), ir.Constant(i64, sw)), ir.Constant(i64, 1))
            masks = [cs._bits_mask(builder, ir.Constant(i64, 0), _clamp(builder, builder.sub(used, ir.Constant(i64, 16 * h))))
                     for h in range(sw)]   # the lanes read: (n - 1) * sw + 1 values

            def taps():
                for i in range(kh):
                    for j in range(kw):
                        at = builder.add(builder.add(b_at_v, builder.mul(row_v, ir.Constant(i64, i))),
                                         builder.mul(dw_v, ir.Constant(i64, j)))
                        v = load(cs._vptr(builder, ba.data, at), masks[0])
                        if sw == 2:
                            hi = load(cs._vptr(builder, ba.data, builder.add(at, ir.Constant(i64, 16))), masks[1])
                            v = builder.shuffle_vector(v, hi, even)
                        yield v
            store(_max_of_taps(builder, taps), cs._vptr(builder, oa.data, o_at_v), cs._lane_mask(builder, n_v, 0))
            return context.get_dummy_value()
        return sig, codegen
    return window_max


def _max_of_taps(builder, taps):
    """The lanes' maximum of the vectors taps() yields (called again where needed). VMAXPS (a > b ? a : b)
    drops a NaN in a; the taps' sum is NaN where any tap is (or +inf meets -inf): those vectors are taken
    again with the NaN-keeping compare-and-select."""
    acc = total = None
    for v in taps():
        acc, total = (v, v) if acc is None else \
            (builder.select(builder.fcmp_ordered(">", acc, v), acc, v), builder.fadd(total, v))
    nan = builder.bitcast(builder.fcmp_unordered("uno", total, total), ir.IntType(16))
    fast = builder.block
    with builder.if_then(builder.icmp_unsigned("!=", nan, ir.Constant(ir.IntType(16), 0)), likely=False):
        exact = None
        for v in taps():
            exact = v if exact is None else cs._pick(builder, exact, v, ">")
        slow = builder.block
    result = builder.phi(acc.type)
    result.add_incoming(acc, fast)
    result.add_incoming(exact, slow)
    return result


def _stencil_max_intrinsic(taps: int, masked: bool):
    """stencil_max(out, o_at, src, s_at, step, masks, m_at, value, n): for lanes t < min(n, 16), out[o_at + t] =
    max over k < taps of src[s_at + t + k * step] (masked: only where bit t of masks[m_at + k] is set, value
    elsewhere; src read only there); NaN kept, as window_max: VMAXPS and the taps' sum, the vectors whose
    sum is NaN taken again with the NaN-keeping compare. Unmasked, all 16 lanes of every tap are read."""
    @intrinsic
    def stencil_max(typingctx, out, o_at, src, s_at, step, masks, m_at, value, n):
        sig = types.void(out, o_at, src, s_at, step, masks, m_at, value, n)

        def codegen(context, builder, signature, args):
            oa = context.make_array(signature.args[0])(context, builder, args[0])
            sa = context.make_array(signature.args[2])(context, builder, args[2])
            ma = context.make_array(signature.args[5])(context, builder, args[5])
            o_at_v, s_at_v, step_v, m_at_v, n_v = (cs._i64(builder, args[i]) for i in (1, 3, 4, 6, 8))
            i64 = ir.IntType(64)
            vtype = ir.VectorType(ir.FloatType(), 16)
            mtype = ir.VectorType(ir.IntType(1), 16)
            fill = cs._splat(builder, args[7])
            load_masked = builder.module.globals.get("llvm.masked.load.v16f32.p0") or ir.Function(
                builder.module, ir.FunctionType(vtype, [vtype.as_pointer(), ir.IntType(32), mtype, vtype]),
                name="llvm.masked.load.v16f32.p0")
            _, store = cs._masked(builder)
            bits = [builder.bitcast(builder.load(builder.gep(ma.data, [builder.add(m_at_v, ir.Constant(i64, k))])), mtype)
                    for k in range(taps)] if masked else None

            def taps_():
                for k in range(taps):
                    at = builder.add(s_at_v, builder.mul(step_v, ir.Constant(i64, k)))
                    ptr = cs._vptr(builder, sa.data, at)
                    yield builder.call(load_masked, [ptr, ir.Constant(ir.IntType(32), 4), bits[k], fill]) if masked \
                        else builder.load(ptr, align=4)
            store(_max_of_taps(builder, taps_), cs._vptr(builder, oa.data, o_at_v), cs._lane_mask(builder, n_v, 0))
            return context.get_dummy_value()
        return sig, codegen
    return stencil_max


STENCIL_MAX: dict = {}


def stencil_max_for(taps: int, masked: bool):
    """The stencil_max intrinsic of taps taps, masked or not, made once per process."""
    if (taps, masked) not in STENCIL_MAX:
        STENCIL_MAX[taps, masked] = _stencil_max_intrinsic(taps, masked)
    return STENCIL_MAX[taps, masked]


def _clamp(builder, v):
    """v (i64) clamped to 0..16."""
    zero, full = ir.Constant(ir.IntType(64), 0), ir.Constant(ir.IntType(64), 16)
    v = builder.select(builder.icmp_signed("<", v, zero), zero, v)
    return builder.select(builder.icmp_signed(">", v, full), full, v)


WINDOW_MAX: dict = {}


def window_max_for(kh: int, kw: int, sw: int):
    """The window_max intrinsic of a kh x kw window at column stride sw (1 or 2), made once per process."""
    if (kh, kw, sw) not in WINDOW_MAX:
        WINDOW_MAX[kh, kw, sw] = _window_max_intrinsic(kh, kw, sw)
    return WINDOW_MAX[kh, kw, sw]


def pool_fits(kh: int, kw: int, sw: int) -> bool:
    return kh * kw <= 49 and sw in (1, 2)


_POOL = """import numpy as np
from numba import njit

from ingot.backends.cpu.spatial import stencil_max_for, window_max_for

window_max = window_max_for({kh}, {kw}, {sw})
along_rows = window_max_for(1, {kw}, 1)
along_columns = window_max_for({kh}, 1, 1)
flat_rows = stencil_max_for({kw}, True)
flat_columns = stencil_max_for({kh}, False)


@njit(cache=True, nogil=True)
def kernel(x, sh, dh, dw, top, left, value, out, masks, cols):
    # each plane of x [P, H, W] copied into a buffer padded with value, then 16 outputs of a row at a time;
    # at stride 1 separable: the maxima over the window's columns for every row, then over its rows.
    # Windows that need no padding read x in place (CRNN's 2 x 2 and 2 x 1 pools: no copy).
    p_n, h, w = x.shape
    _, oh, ow = out.shape
    kh, kw, sw = {kh}, {kw}, {sw}
    hp = max(h + top, (oh - 1) * sh + (kh - 1) * dh + 1)
    wp = max(w + left, (ow - 1) * sw + (kw - 1) * dw + 1)
    separable = sh == 1 and sw == 1 and kh > 1 and kw > 1
    of = out.reshape(p_n * oh * ow)
    if top == 0 and left == 0 and hp == h and wp == w and not separable:
        xf = x.reshape(p_n * h * w)
        for p in range(p_n):
            for oy in range(oh):
                for ox in range(0, ow, 16):
                    window_max(of, (p * oh + oy) * ow + ox, xf, (p * h + oy * sh) * w + ox * sw, w, dh, dw, ow - ox)
        return
    n = h * w
    nv = (n + 15) // 16
    if separable and dh == 1 and dw == 1 and ow == w and masks.size == nv * kw and cols.size >= hp * w + 32:
        # the output as wide as the input (SPPF's 5 x 5, pads 2; masks and cols from flat_scratch): per plane,
        # the maxima over the window's columns of the whole plane as flat vectors, x read in place (tap j of
        # a lane whose column + j - left lies outside its row reads value), into rows top.. of cols [hp, w]
        # whose other rows hold value; then over the window's rows, a stencil of step w over the flat cols
        xf = x.reshape(p_n * n)
        m = oh * ow
        for p in range(p_n):
            for q in range(nv):   # (a last vector's lanes past the plane: all taps masked, value stored)
                flat_rows(cols, top * w + 16 * q, xf, p * n + 16 * q - left, 1, masks, q * kw, value, 16)
            for q in range(0, m, 16):
                flat_columns(of, p * m + q, cols, q, w, masks, 0, value, m - q)
        return
    buf = np.full(hp * wp + 32 * sw, value, np.float32)   # slack: the lanes past the row's end read it
    cols = np.empty(hp * ow + 16 if separable else 0, np.float32)
    # not separable: a window inside x reads it in place; the buffer holds the input rows the windows
    # reaching into the padding rows read whole, of the others only the columns [0, cl) and [cr, w) that
    # the tiles of 16 reaching into the padding columns read
    whole = np.zeros(h, np.bool_)
    cl, cr = w, w
    if separable:
        whole[:] = True
    else:
        for oy in range(oh):
            iy0 = oy * sh - top
            if iy0 < 0 or iy0 + (kh - 1) * dh >= h:
                for i in range(kh):
                    if 0 <= iy0 + i * dh < h:
                        whole[iy0 + i * dh] = True
        cl = 0
        for ox in range(0, ow, 16):
            a0 = ox * sw - left
            a1 = a0 + (min(16, ow - ox) - 1) * sw + (kw - 1) * dw   # the last column the tile reads
            if a0 < 0:
                cl = max(cl, min(a1 + 1, w))
            elif a1 >= w:
                cr = min(cr, a0)
        cr = max(cl, cr)
    xf = x.reshape(p_n * h * w)
    for p in range(p_n):
        plane = x[p]
        for y in range(h):
            src, at = plane[y], np.uintp((y + top) * wp + left)
            if whole[y]:
                for t in range(np.uintp(w)):
                    buf[at + t] = src[t]
                continue
            for t in range(np.uintp(cl)):
                buf[at + t] = src[t]
            for t in range(np.uintp(cr), np.uintp(w)):
                buf[at + t] = src[t]
        if separable:
            for y in range(hp):
                for ox in range(0, ow, 16):
                    along_rows(cols, y * ow + ox, buf, y * wp + ox, wp, dh, dw, ow - ox)
            for oy in range(oh):
                for ox in range(0, ow, 16):
                    along_columns(of, (p * oh + oy) * ow + ox, cols, oy * ow + ox, ow, dh, 1, ow - ox)
            continue
        for oy in range(oh):
            iy0 = oy * sh - top
            inside = iy0 >= 0 and iy0 + (kh - 1) * dh < h
            for ox in range(0, ow, 16):
                a0 = ox * sw - left
                if inside and a0 >= 0 and a0 + (min(16, ow - ox) - 1) * sw + (kw - 1) * dw < w:
                    window_max(of, (p * oh + oy) * ow + ox, xf, (p * h + iy0) * w + a0, w, dh, dw, ow - ox)
                else:
                    window_max(of, (p * oh + oy) * ow + ox, buf, oy * sh * wp + ox * sw, wp, dh, dw, ow - ox)
"""


def pool_kernel(kh: int, kw: int, sw: int):
    """kernel(x, sh, dh, dw, top, left, value, out, masks, cols): out [P, OH, OW] = max over the kh x kw window
    (stride, dilation) of each plane of x [P, H, W] padded by top rows and left columns (and as many after as
    the windows reach) of value (a float32); sw 1 or 2; masks and cols: flat_scratch's."""
    return cs.load(_POOL.format(kh=kh, kw=kw, sw=sw), "kernel", "cpu_pool")


def flat_scratch(h: int, w: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, top: int, left: int,
                 oh: int, ow: int, value) -> tuple[np.ndarray, np.ndarray]:
    """(masks, cols) for the kernel's flat path (stride 1, no dilation, ow == w), made once per pool, else
    empty: masks[q * kw + j] has bit t where position 16 q + t of a plane is in it and its column + j - left
    in [0, w); cols [(oh + kh - 1) * w + 32] of value (the kernel writes only its rows top.. top + h - 1 and
    value past them)."""
    if (sh, sw, dh, dw) != (1, 1, 1, 1) or kh < 2 or kw < 2 or ow != w:
        return np.zeros(0, np.uint16), np.zeros(0, np.float32)
    n = h * w
    pos = np.arange(-(-n // 16) * 16)
    col = pos % w
    weights = (1 << np.arange(16)).astype(np.int64)
    masks = np.stack([((pos < n) & (col + j - left >= 0) & (col + j - left < w)).reshape(-1, 16) @ weights
                      for j in range(kw)], axis=1).astype(np.uint16).reshape(-1)
    hp = max(h + top, oh + kh - 1)
    return masks, np.full(hp * w + 32, value, np.float32)


def max_pool(x, kh, kw, sh, sw, dh, dw, top, left, value, out) -> None:
    """pool_kernel's kernel, found per call."""
    masks, cols = flat_scratch(*x.shape[1:], kh, kw, sh, sw, dh, dw, top, left, *out.shape[1:], value)
    pool_kernel(kh, kw, sw)(x, sh, dh, dw, top, left, np.float32(value), out, masks, cols)


@intrinsic
def _doubled(typingctx, out, first_at, second_at, x, x_at, n):
    """For k < min(n, 16): out[first_at + 2k] = out[first_at + 2k + 1] = out[second_at + 2k] =
    out[second_at + 2k + 1] = x[x_at + k]: one masked load, two shuffles, four masked stores (a nearest 2x
    upsampling's two output rows; NumPy-style element loops ran as scalar stores, 2 a cycle)."""
    sig = types.void(out, first_at, second_at, x, x_at, n)

    def codegen(context, builder, signature, args):
        oa = context.make_array(signature.args[0])(context, builder, args[0])
        xa = context.make_array(signature.args[3])(context, builder, args[3])
        first, second, x_at, n = (cs._i64(builder, args[i]) for i in (1, 2, 4, 5))
        load, store = cs._masked(builder)
        v = load(cs._vptr(builder, xa.data, x_at), cs._lane_mask(builder, n, 0))
        twice = builder.add(n, n)
        i32 = ir.IntType(32)
        for half in (0, 1):
            pairs = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 16), [8 * half + k // 2 for k in range(16)]))
            mask = cs._lane_mask(builder, twice, 16 * half)
            for at in (first, second):
                store(pairs, cs._vptr(builder, oa.data, builder.add(at, ir.Constant(ir.IntType(64), 16 * half))), mask)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def upsample(x, rows, cols, out):
    """out [P, OH, OW] = x [P, H, W] at rows[i], cols[j] (indices already in range)."""
    p_n, h, w = x.shape
    _, oh, ow = out.shape
    doubled = ow == 2 * w   # cols[t] = t // 2 (nearest 2x): each value stored twice, no gather
    for t in range(ow):
        doubled = doubled and cols[t] == t // 2
    twice = doubled and oh == 2 * h   # rows[i] = i // 2 as well: both rows of a pair in one pass
    for i in range(oh):
        twice = twice and rows[i] == i // 2
    if twice and x.flags.c_contiguous and out.flags.c_contiguous:
        xf, of = x.reshape(x.size), out.reshape(out.size)
        for p in range(p_n):
            for i in range(h):
                src, dst = (p * h + i) * w, (p * oh + 2 * i) * ow
                for t in range(0, w, 16):
                    _doubled(of, dst + 2 * t, dst + ow + 2 * t, xf, src + t, w - t)
        return
    for p in range(p_n):
        for i in range(oh):
            dst = out[p, i]
            if i > 0 and rows[i] == rows[i - 1]:
                prev = out[p, i - 1]
                for t in range(np.uintp(ow)):
                    dst[t] = prev[t]
                continue
            src = x[p, rows[i]]
            if doubled:
                for t in range(np.uintp(w)):
                    v = src[t]
                    dst[2 * t] = v
                    dst[2 * t + 1] = v
                continue
            for t in range(np.uintp(ow)):
                dst[t] = src[cols[t]]


@njit(cache=True, nogil=True)
def depth_to_space(x, kh, kw, out):
    """out [N, M, H * kh, W * kw] from x [N, M * kh * kw, H, W]: channel (m * kh + i) * kw + j lands at rows
    y * kh + i, columns x * kw + j of channel m."""
    n_n, _, h, w = x.shape
    m_n = out.shape[1]
    for n in range(n_n):
        for m in range(m_n):
            for i in range(kh):
                for j in range(kw):
                    plane = x[n, (m * kh + i) * kw + j]
                    for y in range(h):
                        src, dst = plane[y], out[n, m, y * kh + i]
                        for t in range(np.uintp(w)):
                            dst[t * np.uintp(kw) + np.uintp(j)] = src[t]


def _planes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1, a.shape[-2], a.shape[-1])


def max_pool_lowering(node: Node, out):
    body: Body = node.attrs["body"]
    (view,) = body.find(Op.ARRAY_VIEW)
    pads = body.find(Op.PAD)
    kh, kw, sh, sw, dh, dw = pool_window(view)
    if not pool_fits(kh, kw, sw):
        return None
    (top, _), (left, _) = pads[0].attrs["pads"][2:] if pads else ((0, 0), (0, 0))
    value = np.float32(pads[0].attrs.get("value", 0.0)) if pads else np.float32(0.0)
    shape = tuple(node.type.shape)
    kernel = pool_kernel(kh, kw, sw)   # (found once: its source's hash took a few us a run)
    x_shape = (pads[0].src[0] if pads else view.src[0]).type.shape
    masks, cols = flat_scratch(*x_shape[2:], kh, kw, sh, sw, dh, dw, top, left, *shape[2:], value)

    def step(x):
        y = out if out is not None else np.empty(shape, np.float32)
        kernel(np.ascontiguousarray(x).reshape(-1, *x.shape[-2:]), sh, dh, dw, top, left, value, y.reshape(-1, *shape[2:]),
               masks, cols)
        return y
    return step


def upsample_lowering(node: Node, out):
    body: Body = node.attrs["body"]
    gathers = body.find(Op.GATHER)
    x_shape = tuple(next(g for g in gathers if g.src[0].op == Op.PLACEHOLDER).src[0].type.shape)
    shape = tuple(node.type.shape)
    index = {}   # axis -> the fused op's input holding its indices
    for gth in gathers:
        index[gth.attrs["axis"]] = gth.src[1].attrs["param"]
    if any(node.src[i].op != Op.CONSTANT for i in index.values()):
        return None
    arranged: dict = {}

    def step(*inputs):
        if not arranged:   # constant indices: checked and converted once
            for axis, size in ((2, x_shape[2]), (3, x_shape[3])):
                idx = np.asarray(inputs[index[axis]]).astype(np.int64) if axis in index else np.arange(size)
                arranged[axis] = np.where(idx < 0, idx + size, idx)
                arranged["valid"] = arranged.get("valid", True) and bool(np.all((idx >= -size) & (idx < size)))
        if not arranged["valid"]:   # the reference says what is wrong
            return REGISTRY[Op.FUSED].reference(inputs, node.attrs)
        y = out if out is not None else np.empty(shape, np.float32)
        upsample(_planes(inputs[0]), arranged[2], arranged[3], y.reshape(-1, *shape[2:]))
        return y
    return step


def depth_to_space_lowering(node: Node, out):
    body: Body = node.attrs["body"]
    _, kh, kw = shuffle_of(body.outputs[0])
    shape = tuple(node.type.shape)

    def step(x):
        y = out if out is not None else np.empty(shape, np.float32)
        depth_to_space(np.ascontiguousarray(x), kh, kw, y)
        return y
    return step


FUSED_LOWERINGS = {"max_pool": max_pool_lowering, "upsample": upsample_lowering, "depth_to_space": depth_to_space_lowering}
