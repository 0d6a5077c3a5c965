"""Convolution kernels with 16 channels to a vector (NCHWc-style, as onnxruntime's), which conv.py picks:

- depthwise, where the output is small (MAX_OUTPUTS positions): conv._depthwise vectorises along an
  output row, which suits wide rows; MobileNet's late layers have rows of 7 or 14 and hundreds of
  channels, where it ran at ~2 GMAC/s (576 channels, 7 x 7, 5 x 5 taps: 0.42 ms). Here a block of 16
  channels is copied once into a zero-padded [H', W', 16] buffer and each output position is kh * kw
  vector FMAs in registers: 0.09-0.10 ms there. Past 28 x 28 outputs the copies cost more than they save.
- direct kxk (groups 1, not the BLAS pointwise case): instead of gathering windows (im2col, kh * kw
  copies of the input) for BLAS, per block of 16 output channels and TILE output columns the
  accumulators stay in registers over every input channel and tap (YOLO's 3 x 3 layers: 87-100
  GFLOP/s at stride 1, against BLAS's 65-88 without counting the gather; ~110 with caches warm). A row's
  last 9 to 11 columns run as two tiles of 4 to 6 (a tile of 1 to 3 has too few FMA chains for the
  latency); an input larger than the weights is walked row by row for all blocks (read once, not once a
  block), each input row copied into the padded buffer just before the first output row reading it; there
  the buffer is a ring of RING_SLOTS windows' heights of rows, which stays in L1/L2 where a whole padded
  copy of a large input did not (YOLO's 16 x 160 x 160 -> 32, stride 2: 0.87 -> 0.74 ms in the model); each
  row written once, and when the ring is full the window's rows already there moved to its top (a window
  is always contiguous; each row written twice, into two rings of one window, cost 1-4 % of YOLO's
  3 x 3 layers: 16 x 160 x 160 -> 32 stride 2 0.277 -> 0.268 ms hot). An output row whose window has its first or last row in the padding skips that row.
  At a column stride above 1 the tiles whose window columns lie inside the input read it in place, and only
  the edge tiles' columns are copied (where every window has at most its trimmed row in the padding): the
  copy was 14 % of YOLO's 16 x 160 x 160 -> 32 stride 2 (0.29 -> 0.275 ms hot and in the model, 32 x 80 x 80
  -> 64 0.258 -> 0.250); at stride 1 reading x in place ran 1-3 % slower than copying it.
  Where the weights are the larger and rows are not a multiple of TILE wide (DBNet's 128 x 10 x 10), a
  block's positions run as one sequence, a tile crossing from one row into the next (each position's
  input offset read from a small array): 10 columns were tiles of 5 and 5, too few FMA chains (3 x 3,
  128 -> 128 at 10 x 10: 0.28-0.31 -> 0.265-0.27 ms hot). Two blocks (32 output channels) run as one tile of
  up to 8 columns, each input value broadcast once for both (YOLO's 3 x 3 layers of 32-128 output channels,
  hot, with SiLU: 1-3 % faster, e.g. 64 -> 128 stride 2 at 40 x 40 0.253-0.266 -> 0.248-0.255 ms; the
  stride-2 layers were not bound by the broadcasts: the input read, SiLU and the transposes stay).

Both are llvmlite intrinsics per window size (as vnni.py emits VPDPBUSD), called by numba kernels that
codegen generates and caches on disk.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


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
    from .conv_spatial import load
    kernel = load(_KERNEL.format(kh=kh, kw=kw), "kernel", "cpu_depthwise")
    kernel(x, w, sh, sw, dh, dw, ph, pw, out)


# -- direct convolution, output channels in blocks of 16 ------------------------------------------------
#
# A kxk convolution gathered its windows (im2col: a copy of kh * kw times the input) and multiplied them
# by BLAS. Here, per block of 16 output channels and run of TILE output columns of one row, TILE vector
# accumulators stay in registers over every input channel and tap: each step one weight vector (16
# output channels) and TILE broadcast input values (llvmlite, the loop over input channels in IR).

TILE = 8   # output columns a transpose stores (and a gather tile's positions)
WIDEST = 14   # output columns a tile computes at most (14 accumulators: 12 and 16 ran 0-5 % slower)
RING_SLOTS = 4   # the direct kernel's ring of input rows: slots, in windows' heights
WIDEST_PAIR = 8   # output columns a tile of two blocks computes at most (16 accumulators; 7, 10, 12 no better)
_V8 = ir.VectorType(ir.FloatType(), 8)


def _transposed(builder, accs):
    """8 <16 x float> vectors (position r: 16 channels) as 8 vectors of 2 channels x 8 positions each
    (vector k: channel 2k's positions 0..7, then channel 2k + 1's): three rounds of two-source shuffles."""
    i32 = ir.IntType(32)

    def shuffle(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), mask))
    # round 1: positions (2p, 2p + 1), channels 0-7 | 8-15, as (channel, position) pairs
    r1 = {}
    for p in range(4):
        a, b = accs[2 * p], accs[2 * p + 1]
        for h in range(2):
            r1[p, h] = shuffle(a, b, [x for c in range(8 * h, 8 * h + 8) for x in (c, 16 + c)])
    # round 2: positions 4q..4q+3 of 4 channels; lane 2c + e of r1 holds channel c (of 8), position e
    r2 = {}
    for q in range(2):
        for h in range(2):
            a, b = r1[2 * q, h], r1[2 * q + 1, h]
            for g in range(2):
                r2[q, h, g] = shuffle(a, b, [x for c in range(4 * g, 4 * g + 4) for x in (2 * c, 2 * c + 1, 16 + 2 * c, 17 + 2 * c)])
    # round 3: positions 0..7 of 2 channels; lane 4c + e of r2 holds channel c (of 4), position e
    out = []
    for h in range(2):
        for g in range(2):
            a, b = r2[0, h, g], r2[1, h, g]
            for e in range(2):
                out.append(shuffle(a, b, [x for c in range(2 * e, 2 * e + 2) for x in
                                          (4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3, 16 + 4 * c, 17 + 4 * c, 18 + 4 * c, 19 + 4 * c)]))
    return out


def _tile_intrinsic(kh: int, kw: int, width: int = 8, lanes: int = 16, key: str = "", gather: bool = False,
                    stride: int = 1, dilation: int = 1, blocks: int = 1):
    """tile(out, o_at, o_step, xp, x_at, ic_step, row_step, wb, w_at, n_ic, bias, b_at, n_ch, sw, dw, ops, trim, pos,
    w_block): for positions
    r < width and channels l < min(n_ch, lanes), out[o_at + l * o_step + r] = bias[b_at + l] + sum over
    ic < n_ic, taps (i, j) of xp[x_at + ic * ic_step + i * row_step + j * dw + r * sw] *
    wb[w_at + ((ic * kh + i) * kw + j) * 16 + l]. The accumulators (one vector of 16 channels per position)
    are transposed in registers 8 positions at a time and stored as rows of 8 (the last group under a mask;
    lanes 8: the first 8 of each 16). key: conv_spatial's epilogue of that key (without full operands)
    applied to the accumulators before the transpose, its channel operands read 16 at a time from b_at (ops
    as conv_spatial's). trim 1 (2): the window's first (last) row left out,
    as it lies in the padding (an output row at the top or bottom edge); tested inside the loop over input
    channels (a predicted branch per kh * kw * width FMAs: one tile for all rows, not three to compile).
    gather: position r reads x_at + pos[r] (an int64 array) instead of x_at + r * sw, so that a tile's
    positions may run on from one output row into the next (pos is read once a call). stride, dilation: the
    column stride and dilation, constants of the tile (its sw and dw arguments are not read), so that each tap's
    loads are one pointer and constant displacements (as arguments, the 8 x kw offsets took registers that
    spilled: a reload from the stack beside each FMA, ~110 GFLOP/s against ~190 without). blocks 2: two
    blocks of 16 output channels at once (channels l < min(n_ch, 32), the driver gives it more than 16; block
    k's weights at w_at + k * w_block, its outputs from o_at + 16 * k * o_step), each input value broadcast
    once for both blocks (half the loads an FMA)."""
    @intrinsic
    def tile(typingctx, out, o_at, o_step, xp, x_at, ic_step, row_step, wb, w_at, n_ic, bias, b_at, n_ch, sw, dw, ops,
             trim, pos, w_block):
        sig = types.void(out, o_at, o_step, xp, x_at, ic_step, row_step, wb, w_at, n_ic, bias, b_at, n_ch, sw, dw, ops,
                         trim, pos, w_block)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(3), arr(7), arr(10)
            i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
            f16x = ir.VectorType(f32, lanes)
            undef = ir.Constant(f16x, ir.Undefined)
            zeros_i = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
            fma = builder.module.declare_intrinsic(f"llvm.fma.v{lanes}f32", fnty=ir.FunctionType(f16x, [f16x, f16x, f16x]))
            cast = lambda v: builder.sext(v, i64) if v.type.width < 64 else v  # noqa: E731
            o_at_v, o_step_v, x_at_v, ic_v, row_v, w_at_v, n_v, b_at_v, n_ch_v, w_block_v = (
                cast(args[i]) for i in (1, 2, 4, 5, 6, 8, 9, 11, 12, 18))
            if gather:
                pa = arr(17)
                at_r = [builder.load(builder.gep(pa.data, [ir.Constant(i64, r)])) for r in range(width)]
                offs = {(j, r): builder.add(ir.Constant(i64, j * dilation), at_r[r]) for j in range(kw) for r in range(width)}
            else:
                offs = {(j, r): ir.Constant(i64, j * dilation + r * stride) for j in range(kw) for r in range(width)}
            x0 = builder.gep(xa.data, [x_at_v])
            w0 = builder.gep(wa.data, [w_at_v])
            start = builder.block
            loop = builder.append_basic_block("ic_loop")
            done = builder.append_basic_block("ic_done")
            zero_acc = ir.Constant(f16x, [0.0] * lanes)
            builder.cbranch(builder.icmp_signed(">", n_v, ir.Constant(i64, 0)), loop, done)
            builder.position_at_end(loop)
            ic = builder.phi(i64)
            ic.add_incoming(ir.Constant(i64, 0), start)
            accs = []
            for _ in range(blocks * width):   # block k, position r: accs[k * width + r]
                p = builder.phi(f16x)
                p.add_incoming(zero_acc, start)
                accs.append(p)
            new = list(accs)
            xptr = builder.gep(x0, [builder.mul(ic, ic_v)])
            wptr = builder.gep(w0, [builder.mul(ic, ir.Constant(i64, kh * kw * 16))])
            wptrs = [wptr] + [builder.gep(wptr, [builder.mul(w_block_v, ir.Constant(i64, k))]) for k in range(1, blocks)]
            trim_v = cast(args[16])

            def window_row(i, sums):
                row = builder.gep(xptr, [builder.mul(row_v, ir.Constant(i64, i))])
                for j in range(kw):
                    wvs = [builder.load(builder.bitcast(builder.gep(w, [ir.Constant(i64, (i * kw + j) * 16)]), f16x.as_pointer()),
                                        align=4) for w in wptrs]
                    for r in range(width):
                        xv = builder.load(builder.gep(row, [offs[j, r]]))
                        splat = builder.shuffle_vector(builder.insert_element(undef, xv, ir.Constant(i32, 0)), undef, zeros_i)
                        for k, wv in enumerate(wvs):
                            sums[k * width + r] = builder.call(fma, [splat, wv, sums[k * width + r]])
                return sums
            for i in range(kh):
                edge = 1 if i == 0 and kh > 1 else 2 if i == kh - 1 and kh > 1 else 0
                if not edge:
                    new = window_row(i, new)
                    continue
                before = builder.block
                then = builder.append_basic_block(f"row{i}")
                merge = builder.append_basic_block(f"row{i}_done")
                builder.cbranch(builder.icmp_signed("!=", trim_v, ir.Constant(i64, edge)), then, merge)
                builder.position_at_end(then)
                summed = window_row(i, list(new))
                then_end = builder.block
                builder.branch(merge)
                builder.position_at_end(merge)
                merged = []
                for a, b in zip(new, summed):
                    phi = builder.phi(f16x)
                    phi.add_incoming(a, before)
                    phi.add_incoming(b, then_end)
                    merged.append(phi)
                new = merged
            nxt = builder.add(ic, ir.Constant(i64, 1))
            latch = builder.block
            ic.add_incoming(nxt, latch)
            for p, v in zip(accs, new):
                p.add_incoming(v, latch)
            builder.cbranch(builder.icmp_signed("<", nxt, n_v), loop, done)
            builder.position_at_end(done)
            phis = []
            for k in range(blocks * width):
                f = builder.phi(f16x)
                f.add_incoming(zero_acc, start)
                f.add_incoming(new[k], latch)
                phis.append(f)
            for k in range(blocks):   # (the driver gives a 2-block tile more than 16 channels)
                _store_block(context, builder, signature, args, phis[k * width:(k + 1) * width], lanes, key, oa, ba,
                             builder.add(o_at_v, builder.mul(o_step_v, ir.Constant(i64, 16 * k))), o_step_v,
                             builder.add(b_at_v, ir.Constant(i64, 16 * k)), builder.sub(n_ch_v, ir.Constant(i64, 16 * k)))
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _store_block(context, builder, signature, args, finals, lanes: int, key: str, oa, ba, o_at_v, o_step_v, b_at_v, n_ch_v):
    """A block's accumulators (finals: a <lanes x float> per position) + bias [b_at:+16], the epilogue of key,
    stored transposed as rows of positions: channel l < min(n_ch, lanes) at o_at + l * o_step."""
    width = len(finals)
    i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
    f16x = ir.VectorType(f32, lanes)
    undef = ir.Constant(f16x, ir.Undefined)
    b = builder.load(builder.bitcast(builder.gep(ba.data, [b_at_v]), f16x.as_pointer()), align=4)
    finals = [builder.fadd(f, b) for f in finals]
    if lanes == 8:   # as 16 lanes, the upper 8 never stored
        widen = ir.Constant(ir.VectorType(i32, 16), list(range(16)))
        finals = [builder.shuffle_vector(f, undef, widen) for f in finals]
    if key:   # the epilogue on registers whose lanes are channels
        from . import conv_spatial as cs
        steps, operands = cs.SPECS[key]
        read = cs.epilogue_reads(context, builder, operands, signature.args[15], args[15], b_at_v,
                                 channels=cs._lane_mask(builder, n_ch_v, 0))
        finals = [cs.apply_steps(builder, steps, operands, read, f) for f in finals]
    v16 = ir.VectorType(f32, 16)
    ptr8 = _V8.as_pointer()
    masked_store = builder.module.globals.get("llvm.masked.store.v8f32.p0") or ir.Function(
        builder.module, ir.FunctionType(ir.VoidType(), [_V8, ptr8, i32, ir.VectorType(ir.IntType(1), 8)]),
        name="llvm.masked.store.v8f32.p0")
    for g0 in range(0, width, TILE):   # 8 positions at a time, transposed; the last group's under a mask
        n_g = min(TILE, width - g0)
        group = finals[g0:g0 + n_g] + [ir.Constant(v16, [0.0] * 16)] * (TILE - n_g)
        rows = _transposed(builder, group)
        for c in range(lanes):
            half = builder.shuffle_vector(rows[c // 2], ir.Constant(v16, ir.Undefined),
                                          ir.Constant(ir.VectorType(i32, 8), list(range(8 * (c % 2), 8 * (c % 2) + 8))))
            with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, c), n_ch_v)):
                at = builder.add(o_at_v, builder.add(builder.mul(o_step_v, ir.Constant(i64, c)), ir.Constant(i64, g0)))
                ptr = builder.bitcast(builder.gep(oa.data, [at]), ptr8)
                if n_g == TILE:
                    builder.store(half, ptr, align=4)
                else:
                    builder.call(masked_store, [half, ptr, ir.Constant(i32, 4), ir.Constant(
                        ir.VectorType(ir.IntType(1), 8), [1] * n_g + [0] * (TILE - n_g))])


_TILES: dict = {}


def narrow_tile(kh: int, kw: int, width: int, lanes: int = 16, key: str = "", gather: bool = False, sw: int = 1,
                dw: int = 1, blocks: int = 1):
    """The tile of width <= WIDEST columns (a row of 20: two of 10, not 8 + 8 + 4); lanes 8: of
    a last block of at most 8 output channels (24 channels: 16 + 8, not 32 computed); key: the epilogue in
    registers; gather: positions at offsets read from pos; sw, dw: the column stride and
    dilation; blocks 2: 32 output channels at once; made once per process."""
    spec = (kh, kw, width, lanes, key, gather, sw, dw, blocks)
    if spec not in _TILES:
        _TILES[spec] = _tile_intrinsic(*spec)
    return _TILES[spec]


WINDOW_SIZES = ((3, 3), (1, 1), (5, 5), (7, 7), (1, 3), (3, 1), (1, 5), (1, 7))


def _dispatch(prefix: str, indent: str, widest: int = WIDEST) -> str:
    """Generated source: the call of the tile of width n (1..widest) named prefix + n."""
    lines = []
    for k, n in enumerate(range(widest, 0, -1)):
        head = "if" if k == 0 else "elif" if n != 1 else "else"
        lines.append(f"{indent}{head} n == {n}:" if head != "else" else f"{indent}else:")
        lines.append(f"{indent}    {prefix}{n}(of, (b * 16 * oh + oy) * ow + ox0, oh * ow, src, at, src_plane, src_row, wf, b * w_block, "
                     "c_n, bp, b * 16, lanes, sw, dw, ops, trim, pos, w_block)")
    return "\n".join(lines)


_DIRECT = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_kernels import RING_SLOTS, TILE, edge_columns, narrow_tile, trimmed
from ingot.backends.cpu.conv_spatial import EPILOGUES

{tiles} = (narrow_tile({kh}, {kw}, w, 16, {tile_key!r}, False, {sw}, {dw}) for w in range(1, {widest} + 1))
{halves} = (narrow_tile({kh}, {kw}, w, 8, {tile_key!r}, False, {sw}, {dw}) for w in range(1, {widest} + 1))
{pairs} = (narrow_tile({kh}, {kw}, w, 16, {tile_key!r}, False, {sw}, {dw}, 2) for w in range(1, {widest_pair} + 1))
gather16, gather8 = (narrow_tile({kh}, {kw}, TILE, lanes, {tile_key!r}, True, {sw}, {dw}) for lanes in (16, 8))
epilogue = EPILOGUES[{key!r}]


@njit(cache=True, nogil=True)
def kernel(x, wb, bias, sh, sw, dh, dw, ph, pw, out, ops, padded, oy0, oy1):
    # output rows oy0..oy1 (all of them: 0, oh); a band is computed only where the input is the larger
    # (rows first), each band with its own padded buffer (conv.threaded_step's row parts)
    if sw != {sw} or dw != {dw}:
        raise ValueError("conv_direct: the kernel was made for another column stride or dilation")
    c_n, h, wd = x.shape
    m, oh, ow = out.shape
    kh, kw = {kh}, {kw}
    tiles = (ow + TILE - 1) // TILE
    hp = max(h + ph, (oh - 1) * sh + (kh - 1) * dh + 1)
    wp = max(wd + pw, (tiles * TILE - 1) * sw + (kw - 1) * dw + 1)
    blocks = wb.shape[0]
    w_block = wb.shape[1] * wb.shape[2]   # floats of a block's weights
    wf = wb.reshape(blocks * w_block)
    rows_first = c_n * hp * wp > wb.size   # the input the larger: every block's row oy, then row oy + 1 (input read once)
    ring = (kh - 1) * dh + 1   # rows first: padded row p in slot p - base, base moved on as the slots fill
    rows_first_ring = rows_first and RING_SLOTS * ring < hp
    slots = RING_SLOTS * ring if rows_first_ring else hp
    plane = slots * wp
    xp = padded[:c_n * plane].reshape(c_n, slots, wp)   # zeros left and right of the input, kept between calls
    xf = xp.reshape(c_n * plane)
    of = out.reshape(m * oh * ow)
    bp = bias   # the bias in whole blocks of 16 (conv._direct_step's are)
    if bias.size < blocks * 16:
        bp = np.zeros(blocks * 16, np.float32)
        for l in range(m):
            bp[l] = bias[l]
    # a row as few tiles of at most WIDEST columns as even as they go (20: 10 + 10; 40: 4 x 10)
    row_tiles = (ow + {widest} - 1) // {widest}
    narrowest, wider = ow // row_tiles, ow % row_tiles   # the first `wider` tiles a column wider
    pair_tiles = (ow + {widest_pair} - 1) // {widest_pair}   # the same for tiles of two blocks
    pair_narrowest, pair_wider = ow // pair_tiles, ow % pair_tiles
    if (oy0 != 0 or oy1 != oh) and not rows_first:
        raise ValueError("conv_direct: a band of output rows where the weights are the larger")
    # strided: tiles whose columns lie inside the input read it in place (x's rows, no copy); the padded copy
    # then holds only the columns the edge tiles read, [0, cl) and [cr, wd). Only where every output row's
    # window lies in the input or has its one padding row trimmed (else all of each row is copied, every tile
    # reads it). At stride 1 the copy (a ninth of the FMAs' loads) costs less than the reads from x save
    xs = x.reshape(c_n * h * wd)
    in_place = sw > 1
    for oy in range(oy0, oy1):
        iy0 = oy * sh - ph
        if (iy0 < 0 or iy0 + (kh - 1) * dh >= h) and trimmed(iy0, kh, dh, h) == 0:
            in_place = False
    cl, cr = wd, wd
    if in_place:
        cl, cr = edge_columns(ow, sw, dw, kw, pw, wd, {widest}, {widest_pair})
    copied = max(0, oy0 * sh - ph)   # input rows copied into xp, each just before the first output row that reads it
    filled = oy0 * sh   # with the ring: padded rows written into it
    base = filled   # the padded row in slot 0
    pos = np.zeros(TILE, np.int64)
    positions = oh * ow
    if not rows_first and ow < TILE <= positions:
        # rows narrower than a tile: each block's positions as one run, TILE at a time, a tile running on
        # from one row into the next (x at pos[r]); the last tile ends at the last position (overlapping
        # the one before it: its outputs computed twice, the same)
        while copied < h:
            for c in range(c_n):
                row, dst = x[c, copied], xp[c, copied + ph]
                for t in range(np.uintp(wd)):
                    dst[np.uintp(pw) + t] = row[t]
            copied += 1
        for b in range(blocks):
            lanes = min(16, m - b * 16)
            for k in range(0, positions, TILE):
                p0 = min(k, positions - TILE)
                for r in range(TILE):
                    oy = (p0 + r) // ow
                    pos[r] = oy * sh * wp + (p0 + r - oy * ow) * sw
                oy = p0 // ow
                trim = 0
                if oy == (p0 + TILE - 1) // ow:   # one row: its window's padding rows left out
                    trim = trimmed(oy * sh - ph, kh, dh, h)
                if lanes > 8:
                    gather16(of, b * 16 * positions + p0, positions, xf, 0, plane, dh * wp, wf, b * w_block, c_n, bp, b * 16,
                             lanes, sw, dw, ops, trim, pos, w_block)
                else:
                    gather8(of, b * 16 * positions + p0, positions, xf, 0, plane, dh * wp, wf, b * w_block, c_n, bp, b * 16,
                            lanes, sw, dw, ops, trim, pos, w_block)
            if {has_epilogue} and not {in_tile}:   # full operands: the block's planes after them
                for l in range(lanes):
                    at = (b * 16 + l) * positions
                    for t0 in range(0, positions, 16):
                        epilogue(of, at + t0, of, at + t0, positions - t0, b * 16 + l, at + t0, ops)
        return
    groups = (blocks + 1) // 2   # blocks 2g and 2g + 1 at once (a tile of two blocks), the last alone where odd
    for outer in range(oy0, oy1) if rows_first else range(groups):
        for inner in range(groups) if rows_first else range(oh):
            oy, b = (outer, 2 * inner) if rows_first else (inner, 2 * outer)
            if rows_first_ring:
                while filled < oy * sh + ring:
                    if filled - base == slots:   # full: the last ring - 1 rows (a window's that has begun) to the top
                        for c in range(c_n):
                            for r in range(ring - 1):
                                top, dst = xp[c, slots - ring + 1 + r], xp[c, r]
                                for t in range(np.uintp(cl)):
                                    dst[np.uintp(pw) + t] = top[np.uintp(pw) + t]
                                for t in range(np.uintp(cr), np.uintp(wd)):
                                    dst[np.uintp(pw) + t] = top[np.uintp(pw) + t]
                        base = filled - ring + 1
                    y = filled - ph
                    for c in range(c_n):
                        dst = xp[c, filled - base]
                        if 0 <= y < h:
                            row = x[c, y]
                            for t in range(np.uintp(cl)):
                                dst[np.uintp(pw) + t] = row[t]
                            for t in range(np.uintp(cr), np.uintp(wd)):
                                dst[np.uintp(pw) + t] = row[t]
                        else:
                            for t in range(np.uintp(wd)):
                                dst[np.uintp(pw) + t] = 0.0
                    filled += 1
            need = min(h, oy * sh + (kh - 1) * dh + 1 - ph)
            while copied < need and not rows_first_ring:
                for c in range(c_n):
                    row, dst = x[c, copied], xp[c, copied + ph]
                    for t in range(np.uintp(cl)):
                        dst[np.uintp(pw) + t] = row[t]
                    for t in range(np.uintp(cr), np.uintp(wd)):
                        dst[np.uintp(pw) + t] = row[t]
                copied += 1
            slot0 = oy * sh - base if rows_first_ring else oy * sh   # the slot of the window's first row
            lanes = min(32, m - b * 16)
            iy0 = oy * sh - ph   # the input row of the window's first
            trim = trimmed(iy0, kh, dh, h)
            ox0 = 0
            for t in range(pair_tiles if lanes > 16 else row_tiles):
                n = (pair_narrowest + (1 if t < pair_wider else 0)) if lanes > 16 else narrowest + (1 if t < wider else 0)
                a0 = ox0 * sw - pw   # the tile's first input column
                if in_place and a0 >= 0 and a0 + (n - 1) * sw + (kw - 1) * dw < wd:   # its columns all inside x
                    src, at, src_plane, src_row = xs, iy0 * wd + a0, h * wd, dh * wd
                else:
                    src, at, src_plane, src_row = xf, slot0 * wp + ox0 * sw, plane, dh * wp
                if lanes > 16:
{pair}
                elif lanes > 8:
{full}
                else:
{half}
                ox0 += n
            if {has_epilogue} and not {in_tile}:   # the block's 16 rows just written, in L1
                for l in range(lanes):
                    at = ((b * 16 + l) * oh + oy) * ow
                    for t0 in range(0, ow, 16):
                        epilogue(of, at + t0, of, at + t0, ow - t0, b * 16 + l, at + t0, ops)
"""


@njit(cache=True, nogil=True, inline="always")
def trimmed(iy0, kh, dh, h):
    """The direct tile's trim of a window whose first row is input row iy0: 1 where only its first row is
    padding, 2 where only its last, else 0."""
    if iy0 < 0 <= iy0 + dh and iy0 + (kh - 1) * dh < h:
        return 1
    if iy0 >= 0 and iy0 + (kh - 2) * dh < h <= iy0 + (kh - 1) * dh:
        return 2
    return 0


@njit(cache=True, nogil=True)
def edge_columns(ow, sw, dw, kw, pw, wd, widest, widest_pair):
    """(cl, cr): the input columns [0, cl) and [cr, wd) that the direct kernel's edge tiles read (a tile whose
    window columns reach into the padding), over both tilings of a row (tiles of up to widest columns, pairs
    of blocks' of up to widest_pair); the other tiles read the input in place."""
    cl, cr = 0, wd
    for most in (widest, widest_pair):
        tiles = (ow + most - 1) // most
        narrowest, wider = ow // tiles, ow % tiles
        ox0 = 0
        for t in range(tiles):
            n = narrowest + (1 if t < wider else 0)
            a0, a1 = ox0 * sw - pw, ox0 * sw - pw + (n - 1) * sw + (kw - 1) * dw   # first and last column read
            if a0 < 0:
                cl = max(cl, min(a1 + 1, wd))
            elif a1 >= wd:
                cr = min(cr, a0)
            ox0 += n
    return cl, max(cl, cr)


def _columns(kh: int, kw: int, ow: int, width: int) -> bool:
    """A column convolution (input and output one wide, window kh x 1), run as the row it is in memory."""
    return kw == 1 and ow == 1 and width == 1


def direct_fits(kh: int, kw: int, groups: int, ow: int = 0, width: int = 0) -> bool:
    """The direct kernel takes groups 1 and a window in TILES (a column one as its row: Magika's 5 x 1
    over 512 x 1, whose tiles along the output row would be 1 of 8 wide)."""
    if _columns(kh, kw, ow, width):
        kh, kw = kw, kh
    return groups == 1 and (kh, kw) in WINDOW_SIZES


def direct_weights(w: np.ndarray) -> np.ndarray:
    """w [M, C, kh, kw] as [ceil(M / 16), C * kh * kw * 16]: block b, then (c, i, j), then 16 output channels."""
    m, c, kh, kw = w.shape
    blocks = -(-m // 16)
    padded = np.zeros((blocks * 16, c, kh, kw), np.float32)
    padded[:m] = w
    return np.ascontiguousarray(padded.reshape(blocks, 16, c, kh, kw).transpose(0, 2, 3, 4, 1)).reshape(blocks, -1, 16)


_NO_BIAS: dict = {}


def direct_kernel(kh: int, kw: int, sw: int, dw: int, steps=(), operands=()):
    """The numba kernel of a kh x kw window, column stride sw and dilation dw with this epilogue
    (conv.Epilogue's steps and operands):
    kernel(x, wb, bias, sh, sw, dh, dw, ph, pw, out, ops, padded, oy0, oy1), generated and cached once per process
    (oy0, oy1: the output rows computed; a band only where rows_first does).
    Without full operands (a residual) the full tiles apply the epilogue in registers, before their
    transpose; the rest of each row after it is written."""
    from . import conv_spatial
    key = conv_spatial.steps_key(steps, operands)
    conv_spatial.epilogue_for(key, steps, operands)
    in_tile = bool(steps) and all(form != "full" for form, _ in operands)   # full operands: lanes are channels
    source = _DIRECT.format(kh=kh, kw=kw, sw=sw, dw=dw, key=key, widest=WIDEST,
                            tile_key=key if in_tile else "", has_epilogue=bool(steps), in_tile=in_tile,
                            full=_dispatch("tile", " " * 24), half=_dispatch("half", " " * 24),
                            pair=_dispatch("pair", " " * 24, WIDEST_PAIR), widest_pair=WIDEST_PAIR,
                            pairs=", ".join(f"pair{n}" for n in range(1, WIDEST_PAIR + 1)),
                            tiles=", ".join(f"tile{n}" for n in range(1, WIDEST + 1)),
                            halves=", ".join(f"half{n}" for n in range(1, WIDEST + 1)))
    return conv_spatial.load(source, "kernel", "cpu_direct_conv")


def rows_first(c: int, h: int, w: int, oh: int, ow: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
               ph: int, pw: int, m: int) -> bool:
    """Whether the direct kernel walks the output row by row for all blocks (the input larger than the
    weights, as the kernel decides it): where it may compute a band of output rows."""
    tiles = -(-ow // TILE)
    hp = max(h + ph, (oh - 1) * sh + (kh - 1) * dh + 1)
    wp = max(w + pw, (tiles * TILE - 1) * sw + (kw - 1) * dw + 1)
    return c * hp * wp > -(-m // 16) * 16 * c * kh * kw


def padded_size(c: int, h: int, w: int, oh: int, ow: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
                ph: int, pw: int) -> int:
    """Floats of the direct kernel's zero-padded copy of the input (its rows reach past the last tile)."""
    tiles = -(-ow // TILE)
    hp = max(h + ph, (oh - 1) * sh + (kh - 1) * dh + 1)
    wp = max(w + pw, (tiles * TILE - 1) * sw + (kw - 1) * dw + 1)
    return c * max(hp, RING_SLOTS * ((kh - 1) * dh + 1)) * wp


def conv_direct(x, wb, kh, kw, sh, sw, dh, dw, ph, pw, out, bias=None, kernel=None, ops=(), scratch=None) -> None:
    """out [M, OH, OW] = the convolution of x [C, H, W] by the weights arranged by direct_weights (the
    same bytes for a kh x 1 window as for 1 x kh: a column convolution runs as a row one), + bias [M],
    then the epilogue of kernel (direct_kernel's; default none) on each block of rows while in cache.
    scratch: a dict kept between calls of the same convolution, where the zero-padded copy of the input
    stays (only its interior is written again: no zeroing per call)."""
    if _columns(kh, kw, out.shape[2], x.shape[2]):
        c, h, _ = x.shape
        m, oh, _ = out.shape
        x, out = x.reshape(c, 1, h), out.reshape(m, 1, oh)
        kh, kw, sh, sw, dh, dw, ph, pw = kw, kh, sw, sh, dw, dh, pw, ph
    if kernel is None:
        kernel = direct_kernel(kh, kw, sw, dw)
    if bias is None:
        bias = _NO_BIAS.get(wb.shape[0])
        if bias is None:
            bias = _NO_BIAS[wb.shape[0]] = np.zeros(wb.shape[0] * 16, np.float32)
    size = padded_size(*x.shape, *out.shape[1:], kh, kw, sh, sw, dh, dw, ph, pw)
    padded = scratch.get("padded") if scratch is not None else None
    if padded is None or padded.size < size:
        padded = np.zeros(size, np.float32)
        if scratch is not None:
            scratch["padded"] = padded
    kernel(x, wb, bias, sh, sw, dh, dw, ph, pw, out, ops, padded, 0, out.shape[1])


# -- the SiLU epilogue: x * sigmoid(x) with a vector exp -------------------------------------------------
#
# numba has no vector exp here (no SVML), so conv.Epilogue ran SiLU as five NumPy passes per tile
# (YOLO: ~4.5 ms a run). Here 16 floats at a time: exp(-v) as 2^n * p(r), |r| <= ln 2 / 2, p of degree 6
# (relative error ~2e-7), then v / (1 + exp(-v)); NaN stays NaN.

_EXP_POLY = (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)


@intrinsic
def _silu16(typingctx, row, at, bias):
    """row[at:at + 16] = silu(row[at:at + 16] + bias), row float32."""
    sig = types.void(row, at, bias)

    def codegen(context, builder, signature, args):
        row_v, at_v, bias_v = args
        ra = context.make_array(signature.args[0])(context, builder, row_v)
        f32, i32 = ir.FloatType(), ir.IntType(32)
        f16x, i16x = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
        undef = ir.Constant(f16x, ir.Undefined)
        zeros_i = ir.Constant(i16x, [0] * 16)

        def const(c):
            return ir.Constant(f16x, [float(np.float32(c))] * 16)

        ptr = builder.bitcast(builder.gep(ra.data, [at_v]), f16x.as_pointer())
        b = builder.shuffle_vector(builder.insert_element(undef, bias_v, ir.Constant(i32, 0)), undef, zeros_i)
        v = builder.fadd(builder.load(ptr, align=4), b)
        x = builder.fneg(v)                                        # exp(-v)
        x = builder.select(builder.fcmp_ordered(">", x, const(88.0)), const(88.0), x)
        x = builder.select(builder.fcmp_ordered("<", x, const(-88.0)), const(-88.0), x)
        rint = builder.module.declare_intrinsic("llvm.rint.v16f32", fnty=ir.FunctionType(f16x, [f16x]))
        n = builder.call(rint, [builder.fmul(x, const(1.4426950408889634))])
        r = builder.fsub(builder.fsub(x, builder.fmul(n, const(0.693145751953125))), builder.fmul(n, const(1.428606765330187e-06)))
        p = const(_EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = builder.fadd(builder.fmul(p, r), const(c))
        scale = builder.bitcast(builder.shl(builder.add(builder.fptosi(n, i16x), ir.Constant(i16x, [127] * 16)),
                                            ir.Constant(i16x, [23] * 16)), f16x)
        e = builder.fmul(p, scale)
        y = builder.fdiv(v, builder.fadd(const(1.0), e))
        y = builder.select(builder.fcmp_unordered("uno", v, v), v, y)
        builder.store(y, ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def silu_epilogue(slab, bias, has_bias):
    """conv.Epilogue's compiled form for SiLU: slab [M, P] = silu(slab + bias[m]) in place."""
    m_n, p = slab.shape
    flat = slab.reshape(m_n * p)
    full = p // 16 * 16
    for m in range(m_n):
        b = bias[m] if has_bias else np.float32(0.0)
        base = m * p
        for t in range(0, full, 16):
            _silu16(flat, base + t, b)
        for t in range(full, p):
            v = flat[base + t] + b
            flat[base + t] = v / (np.float32(1.0) + np.exp(-v))


def special_epilogue(steps):
    """A vector kernel with run_compiled's signature for an epilogue of steps that is x * sigmoid(x) (in
    either order), else None."""
    from ...ir import Op
    if len(steps) != 2 or any(node.dtype.name != "float32" for node, _ in steps):
        return None
    (sig, sig_refs), (mul, mul_refs) = steps
    if sig.op != Op.SIGMOID or sig_refs != [("value", 0)] or mul.op != Op.MUL or \
            sorted(mul_refs) != sorted([("value", 0), ("step", 0)]):
        return None
    return silu_epilogue
