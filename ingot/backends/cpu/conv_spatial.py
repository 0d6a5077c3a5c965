"""Convolutions vectorised along the output's positions, with the epilogue applied before the store.

conv.py's kernels vectorise along channels (16 output channels a vector), which leaves NCHW outputs to
be scattered lane by lane, lanes idle where the channels are not a multiple of 16, and the epilogue
(bias, folded batch norm, activation, residual add) to a second pass over the whole output. Here:

- a pointwise (1x1, stride 1) convolution is out [M, P] = w [M, C] @ x [C, P]: per call, 8 output
  channels x 48 positions (24 vector accumulators) over every input channel, each step 3 vector loads
  of x and 8 broadcast weights (`_tile`); the output stays NCHW, written once. (4 x 64, 16 accumulators,
  ran at 100-128 GFLOP/s on YOLO's 1x1 layers against 130-156: twice the loads of x an FMA.)
- a depthwise one runs the same tile (one channel, every tap) over each channel copied into a
  zero-padded plane: stride 1 on the padded grid (positions oy * W' + ox, each tap an offset; the
  columns past the output's width computed and dropped), stride 2 a row at a time (even lanes).
- the epilogue's ops are emitted as vector IR (`_epilogue_intrinsic`, generated per epilogue), applied to
  each 16 positions while they are in L1 (pointwise: in place; depthwise: on the way from the grid to
  the output; conv_kernels.conv_direct calls it too). exp, sigmoid, SiLU and tanh use a degree-6
  polynomial exp (relative error ~2e-7).
- a kxk window over few channels (a stem: 3 -> 16, 3 x 3) runs the tile a row of outputs at a time; with
  stride 2 over a copy of a band of input rows split into even and odd columns (`_ROWS_PHASES`), so that
  each tap is one contiguous load per 16 outputs (the stride-2 loads' shuffle cost 3 -> 16 at 224 x 224
  143 us against 124). A model's first layer reads its input from memory, not cache: while a band computes,
  the input rows of the band after it are prefetched (YOLO's 3 -> 16 at 320 x 320 in the model: 0.28-0.39 ->
  0.22-0.28 ms; all evicted 0.40-0.46 -> 0.30-0.35; hot ~0.20 either way).
(The same tile over a kxk window with groups 1 ran at 60-78 GFLOP/s against conv_direct's 80-100.)

Both are llvmlite intrinsics called by numba drivers that codegen generates and caches on disk.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ... import codegen
from ...ir import Op
from .vnni import host_has

def _revision() -> str:
    """A hash of the files whose llvmlite intrinsics the generated kernels call. Each generated source
    carries it, so that numba's on-disk cache of a kernel (found by the kernel's own source) is not
    reused after an intrinsic changed."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in ("conv_spatial.py", "conv_kernels.py", "spatial.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


REVISION = _revision()


def load(source: str, name: str, where: str):
    """codegen.load of a generated kernel that calls the intrinsics here (REVISION in its source)."""
    return codegen.load(f"# intrinsics {REVISION}\n{source}", name, where)


ROWS = 4        # output channels per tile
VECTORS = 4     # 16-position vectors per tile (the last tile of a row fewer)
TILE = 16 * VECTORS
POINTWISE_ROWS = 8      # the pointwise kernel's tile: output channels
POINTWISE_VECTORS = 3   # and 16-position vectors (8 x 3 against 4 x 4, 6 x 4, 12 x 2, 9 x 3: the fastest)

_F32, _I1, _I32, _I64 = ir.FloatType(), ir.IntType(1), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, 16)
AVX512 = host_has("avx512f")   # VSCALEFPS and VRCP14PS in the vector exp and sigmoid


# divisions (SiLU's x / (1 + e), sigmoid's 1 / (1 + e)) as VDIVPS where the divider is quick (Zen: ~2 cycles a
# vector, off the FMA ports), else VRCP14PS and a Newton step (Intel's VDIVPS: 10-16 cycles a vector)
def _zen() -> bool:
    import llvmlite.binding as llvm
    return llvm.get_host_cpu_name().startswith("znver")


DIVIDE = AVX512 and _zen()
_M = ir.VectorType(_I1, 16)


def _masked(builder):
    """(load, store) of <16 x float> under a <16 x i1> mask."""
    mod = builder.module
    ptr = _V.as_pointer()
    load = mod.globals.get("llvm.masked.load.v16f32.p0") or \
        ir.Function(mod, ir.FunctionType(_V, [ptr, _I32, _M, _V]), name="llvm.masked.load.v16f32.p0")
    store = mod.globals.get("llvm.masked.store.v16f32.p0") or \
        ir.Function(mod, ir.FunctionType(ir.VoidType(), [_V, ptr, _I32, _M]), name="llvm.masked.store.v16f32.p0")
    return (lambda p, mask: builder.call(load, [p, ir.Constant(_I32, 4), mask, ir.Constant(_V, [0.0] * 16)]),
            lambda v, p, mask: builder.call(store, [v, p, ir.Constant(_I32, 4), mask]))


def _lane_mask(builder, valid, first: int):
    """Lanes first + l < valid, as a <16 x i1> (valid: i64)."""
    lanes = ir.Constant(ir.VectorType(_I64, 16), list(range(first, first + 16)))
    return builder.icmp_signed("<", lanes, _splat(builder, valid, ir.VectorType(_I64, 16)))


def _splat(builder, value, vtype=_V):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _vptr(builder, data, at):
    return builder.bitcast(builder.gep(data, [at]), _V.as_pointer())


# -- the tile: ROWS output channels x VECTORS * 16 positions ----------------------------------------------

def _tile_intrinsic(kh: int, kw: int, masked_x: bool, n_rows: int, vectors: int, stride: int, steps=(), operands=(),
                    phases: bool = False):
    """tile(out, out_at, out_step, x, x_at, c_step, row_step, col_step, w, w_at, w_step, n_c, bias, b_at,
    valid, rows): for r < min(rows, n_rows), q < min(valid, 16 * vectors):
    out[out_at + r * out_step + q] = bias[b_at + r] + sum over c < n_c, taps (i, j) of
    w[w_at + r * w_step + (c * kh + i) * kw + j] * x[x_at + c * c_step + i * row_step + j * col_step + stride * q]
    (stride 2: two loads and the even lanes), then the epilogue's steps on the registers (_emit_epilogue:
    channel b_at + r, full operands laid out as out). phases (stride 1 reads): x's rows hold their even
    columns, then their odd ones from col_step on; tap j reads x[... + (j % 2) * col_step + j // 2 + q]."""
    @intrinsic
    def tile(typingctx, out, out_at, out_step, x, x_at, c_step, row_step, col_step, w, w_at, w_step, n_c, bias,
             b_at, valid, rows, ops):
        sig = types.void(out, out_at, out_step, x, x_at, c_step, row_step, col_step, w, w_at, w_step, n_c, bias,
                         b_at, valid, rows, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, xa, wa, ba = arr(0), arr(3), arr(8), arr(12)
            out_at_v, out_step_v, x_at_v, c_step_v, row_v, col_v, w_at_v, w_step_v, n_v, b_at_v, valid_v, rows_v = (
                _i64(builder, args[i]) for i in (1, 2, 4, 5, 6, 7, 9, 10, 11, 13, 14, 15))
            load, store = _masked(builder)
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
            masks = [_tail_mask(builder, valid_v, 16 * v) for v in range(vectors)]
            init = [_splat(builder, builder.load(builder.gep(ba.data, [builder.add(b_at_v, ir.Constant(_I64, r))])))
                    for r in range(n_rows)]
            w_rows = [builder.add(w_at_v, builder.mul(w_step_v, ir.Constant(_I64, r))) for r in range(n_rows)]
            taps = kh * kw
            start = builder.block
            loop, done = builder.append_basic_block("c_loop"), builder.append_basic_block("c_done")
            builder.cbranch(builder.icmp_signed(">", n_v, ir.Constant(_I64, 0)), loop, done)
            builder.position_at_end(loop)
            c = builder.phi(_I64)
            c.add_incoming(ir.Constant(_I64, 0), start)
            accs = []
            for r in range(n_rows):
                for v in range(vectors):
                    p = builder.phi(_V)
                    p.add_incoming(init[r], start)
                    accs.append(p)
            new = list(accs)
            x_c = builder.add(x_at_v, builder.mul(c, c_step_v))
            w_c = builder.mul(c, ir.Constant(_I64, taps))
            for i in range(kh):
                x_i = builder.add(x_c, builder.mul(row_v, ir.Constant(_I64, i)))
                for j in range(kw):
                    x_ij = builder.add(x_i, builder.add(builder.mul(col_v, ir.Constant(_I64, j % 2)), ir.Constant(_I64, j // 2))) \
                        if phases else builder.add(x_i, builder.mul(col_v, ir.Constant(_I64, j)))
                    ptrs = [_vptr(builder, xa.data, builder.add(x_ij, ir.Constant(_I64, 16 * stride * v + 16 * h)))
                            for v in range(vectors) for h in range(stride)]
                    if masked_x:
                        xs = [load(p, masks[v]) for v, p in enumerate(ptrs)]
                    elif stride == 1:
                        xs = [builder.load(p, align=4) for p in ptrs]
                    else:
                        xs = [builder.shuffle_vector(builder.load(ptrs[2 * v], align=4), builder.load(ptrs[2 * v + 1], align=4),
                                                     ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2))))
                              for v in range(vectors)]
                    for r in range(n_rows):
                        at = builder.add(w_rows[r], builder.add(w_c, ir.Constant(_I64, i * kw + j)))
                        wv = _splat(builder, builder.load(builder.gep(wa.data, [at])))
                        for v in range(vectors):
                            new[r * vectors + v] = builder.call(fma, [wv, xs[v], new[r * vectors + v]])
            nxt = builder.add(c, ir.Constant(_I64, 1))
            latch = builder.block
            c.add_incoming(nxt, latch)
            for p, val in zip(accs, new):
                p.add_incoming(val, latch)
            builder.cbranch(builder.icmp_signed("<", nxt, n_v), loop, done)
            builder.position_at_end(done)
            finals = []
            for k in range(n_rows * vectors):
                f = builder.phi(_V)
                f.add_incoming(init[k // vectors], start)
                f.add_incoming(new[k], latch)
                finals.append(f)
            for r in range(n_rows):
                with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, r), rows_v)):
                    row_at = builder.add(out_at_v, builder.mul(out_step_v, ir.Constant(_I64, r)))
                    m_v = builder.add(b_at_v, ir.Constant(_I64, r))
                    for v in range(vectors):
                        at = builder.add(row_at, ir.Constant(_I64, 16 * v))
                        value = _emit_epilogue(context, builder, steps, operands, signature.args[16], args[16],
                                               finals[r * vectors + v], m_v, at, masks[v])
                        store(value, _vptr(builder, oa.data, at), masks[v])
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _tail_mask(builder, valid, first: int):
    """_lane_mask by scalar arithmetic, (1 << clamp(valid - first, 0, 16)) - 1 as 16 bits: a shift and a
    move to a mask register where the vector compare loads two constants and joins two halves (the tile's
    stores with the compare's masks: 73 against 62 us on CRNN's first conv, all in cache)."""
    n = builder.sub(valid, ir.Constant(_I64, first))
    n = builder.select(builder.icmp_signed("<", n, ir.Constant(_I64, 0)), ir.Constant(_I64, 0), n)
    n = builder.select(builder.icmp_signed(">", n, ir.Constant(_I64, 16)), ir.Constant(_I64, 16), n)
    return _bits_mask(builder, ir.Constant(_I64, 0), n)


def _bits_mask(builder, lo, hi):
    """Lanes lo <= l < hi of 16 as a <16 x i1> (lo, hi: i64 in 0..16)."""
    one = ir.Constant(_I64, 1)
    bits = builder.sub(builder.shl(one, hi), builder.shl(one, lo))
    return builder.bitcast(builder.trunc(bits, ir.IntType(16)), _M)


@intrinsic
def split_columns(typingctx, dst, even_at, odd_at, src, src_at, first, last, count):
    """For k < count (at most 16): dst[even_at + k] = src[src_at + 2 * k], dst[odd_at + k] = src[src_at + 2 * k + 1],
    reading only the values src_at + l with first <= l < last (both clamped to 0..32; zeros elsewhere: the
    padding): two masked loads, two shuffles, two masked stores (the phases kernel's copy)."""
    sig = types.void(dst, even_at, odd_at, src, src_at, first, last, count)

    def codegen(context, builder, signature, args):
        da = context.make_array(signature.args[0])(context, builder, args[0])
        sa = context.make_array(signature.args[3])(context, builder, args[3])
        even_v, odd_v, src_v, first_v, last_v, count_v = (_i64(builder, args[i]) for i in (1, 2, 4, 5, 6, 7))
        load, store = _masked(builder)
        clamp = lambda v, lo: builder.select(builder.icmp_signed("<", v, ir.Constant(_I64, lo)), ir.Constant(_I64, lo),  # noqa: E731
                                             builder.select(builder.icmp_signed(">", v, ir.Constant(_I64, lo + 16)),
                                                            ir.Constant(_I64, lo + 16), v))
        halves = []
        for h in (0, 16):
            lo_h = builder.sub(clamp(first_v, h), ir.Constant(_I64, h))
            hi_h = builder.sub(clamp(last_v, h), ir.Constant(_I64, h))
            halves.append(load(_vptr(builder, sa.data, builder.add(src_v, ir.Constant(_I64, h))), _bits_mask(builder, lo_h, hi_h)))
        mask = _bits_mask(builder, ir.Constant(_I64, 0), count_v)
        for start, at in ((0, even_v), (1, odd_v)):
            picked = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 16), list(range(start, 32, 2))))
            store(picked, _vptr(builder, da.data, at), mask)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, at):
    """A software prefetch, for reading and into all cache levels, of the line holding arr's element at flat
    index `at` (arr C-contiguous)."""
    sig = types.void(arr, at)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        fn = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), name="llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return sig, codegen


TILES = {}


def tile_for(kh: int, kw: int, rows: int = ROWS, vectors: int = VECTORS, stride: int = 1, key: str = "",
             phases: bool = False):
    """The tile intrinsic of a kh x kw window (made once per process) with the epilogue of key (epilogue_for's;
    "" none); 1x1 (pointwise) masks its loads of x at the end of the positions, a window reads a padded
    copy with slack past the last tile (phases: a copy split into even and odd columns)."""
    spec = (kh, kw, rows, vectors, stride, key, phases)
    if spec not in TILES:
        steps, operands = SPECS[key] if key else ((), ())
        TILES[spec] = _tile_intrinsic(kh, kw, (kh, kw) == (1, 1), rows, vectors, stride, steps, operands, phases)
    return TILES[spec]


# -- the epilogue as vector IR ----------------------------------------------------------------------------

_EXP_POLY = (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)


def _const(c: float):
    return ir.Constant(_V, [float(np.float32(c))] * 16)


def _exp(builder, x, upper: bool = True):
    """exp(x) for <16 x float>: 2^n * p(r), |r| <= ln 2 / 2, x clamped to [-104, 88] (results below 2^-126
    come out subnormal, as NumPy's, and 0 past -104). upper=False: the caller knows x <= 0. With AVX-512
    the power of two is one VSCALEFPS (exact, subnormals included), else two factors built from n's bits."""
    mod = builder.module
    fma = mod.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
    lo = mod.declare_intrinsic("llvm.minnum.v16f32", fnty=ir.FunctionType(_V, [_V, _V]))
    hi = mod.declare_intrinsic("llvm.maxnum.v16f32", fnty=ir.FunctionType(_V, [_V, _V]))
    if upper:
        x = builder.call(lo, [x, _const(88.0)])
    x = builder.call(hi, [x, _const(-104.0)])   # NaN: the callers keep it
    rint = mod.declare_intrinsic("llvm.rint.v16f32", fnty=ir.FunctionType(_V, [_V]))
    n = builder.call(rint, [builder.fmul(x, _const(1.4426950408889634))])
    r = builder.call(fma, [n, _const(-0.693145751953125), x])
    r = builder.call(fma, [n, _const(-1.428606765330187e-06), r])
    p = _const(_EXP_POLY[0])
    for c in _EXP_POLY[1:]:   # fused multiply-adds: half the vector ops of the polynomial
        p = builder.call(fma, [p, r, _const(c)])
    if AVX512:
        scalef = mod.declare_intrinsic("llvm.x86.avx512.mask.scalef.ps.512", fnty=ir.FunctionType(
            _V, [_V, _V, _V, ir.IntType(16), _I32]))
        return builder.call(scalef, [p, n, ir.Constant(_V, ir.Undefined), ir.Constant(ir.IntType(16), -1),
                                     ir.Constant(_I32, 4)])   # 4: the current rounding mode
    i16 = ir.VectorType(_I32, 16)
    ni = builder.fptosi(n, i16)
    half = builder.ashr(ni, ir.Constant(i16, [1] * 16))

    def power(k):   # 2^k for -127 < k < 128
        return builder.bitcast(builder.shl(builder.add(k, ir.Constant(i16, [127] * 16)), ir.Constant(i16, [23] * 16)), _V)
    return builder.fmul(builder.fmul(p, power(half)), power(builder.sub(ni, half)))


def _reciprocal(builder, d):
    """1 / d for d in [1, 2]: with AVX-512 VRCP14PS's estimate (relative error < 2^-14) and one Newton step
    (r + r * (1 - d * r): ~2^-23), a few cycles against Intel's VDIVPS (10-16 a vector); on Zen (DIVIDE)
    VDIVPS, ~2 cycles a vector there."""
    if not AVX512 or DIVIDE:
        return builder.fdiv(_const(1.0), d)
    rcp = builder.module.declare_intrinsic("llvm.x86.avx512.rcp14.ps.512",
                                           fnty=ir.FunctionType(_V, [_V, _V, ir.IntType(16)]))
    fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
    r = builder.call(rcp, [d, ir.Constant(_V, ir.Undefined), ir.Constant(ir.IntType(16), -1)])
    err = builder.call(fma, [builder.fneg(d), r, _const(1.0)])
    return builder.call(fma, [r, err, r])


def _nan_kept(builder, x, y):
    """y, except x where x is NaN."""
    return builder.select(builder.fcmp_unordered("uno", x, x), x, y)


def _sigmoid(builder, x):
    """The reference's stable form: e = exp(-|x|), then 1 / (1 + e) or e / (1 + e)."""
    fabs = builder.module.declare_intrinsic("llvm.fabs.v16f32", fnty=ir.FunctionType(_V, [_V]))
    e = _exp(builder, builder.fneg(builder.call(fabs, [x])), upper=False)
    inv = _reciprocal(builder, builder.fadd(_const(1.0), e))
    return _nan_kept(builder, x, builder.select(builder.fcmp_ordered(">=", x, _const(0.0)), inv, builder.fmul(e, inv)))


# exp(-r) for |r| <= ln 2 / 2 as a degree-5 polynomial in -r fitted for relative error (1.5e-7 with these
# float32 coefficients, against the degree-6 Taylor polynomial's 1.6e-7: one FMA fewer), highest first
_EXP5 = (0.008291716687381268, 0.04191502928733826, 0.1666766256093979, 0.49998900294303894, 0.9999996423721313,
         1.0000001192092896)


def _silu(builder, x):
    """x * sigmoid(x) as x / (1 + exp(-x)), with AVX-512 (else x times the stable sigmoid): x clamped below
    to -80 by VMAXPS (a NaN in x kept), exp(-x) of that clamped above to 80 as well, its reduction r = x + n ln 2
    into the polynomial of -r, 2^n by VSCALEFPS, then x / (1 + e) (DIVIDE; else VRCP14PS and a Newton step).
    The reduction is one FMA by float32's ln 2, not two (Cody-Waite's high and low parts): |n| <= 116 puts
    its error under 116 * 1.9e-9 = 2.2e-7 in r; SiLU's largest relative error against float64 over -100..100
    2.7e-7 -> 3.2e-7 (at x = -72; 2.5e-7 for |x| < 20), 1.63 -> 1.45 ns a vector alone on Zen 5.
    x < -80 gives -80 / (1 + e^80) = -1.45e-33. No value on the way is subnormal: with x clamped to 88, e
    (x > 87) or 1 / (1 + e) (x < -87) were, and outputs of ~-5e-37 made the next conv's first FMAs'
    results subnormal; each costs a microcode assist on Intel cores (NudeNet's 16 x 160 x 160 -> 32
    stride 2 on a random image: 0.81 ms hot, 0.50 with flush-to-zero set). 14 vector ops against the
    stable form's 24 (YOLO's 2.5 M SiLU outputs a run): 2.9 -> 2.1 ns a vector on Zen 5, alone."""
    if not AVX512:
        return builder.fmul(x, _sigmoid(builder, x))
    mod = builder.module
    fma = mod.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
    lo = mod.declare_intrinsic("llvm.minnum.v16f32", fnty=ir.FunctionType(_V, [_V, _V]))
    vmax = mod.declare_intrinsic("llvm.x86.avx512.max.ps.512", fnty=ir.FunctionType(_V, [_V, _V, _I32]))
    rint = mod.declare_intrinsic("llvm.rint.v16f32", fnty=ir.FunctionType(_V, [_V]))
    xl = builder.call(vmax, [_const(-80.0), x, ir.Constant(_I32, 4)])   # (VMAXPS: the second operand where NaN)
    xc = builder.call(lo, [xl, _const(80.0)])
    n = builder.call(rint, [builder.fmul(xc, _const(-1.4426950408889634))])
    r = builder.call(fma, [n, _const(0.6931471805599453), xc])
    p = _const(-_EXP5[0])   # the coefficient of r^k times (-1)^k
    for k, c in zip(range(4, -1, -1), _EXP5[1:]):
        p = builder.call(fma, [p, r, _const(-c if k % 2 else c)])
    scalef = mod.declare_intrinsic("llvm.x86.avx512.mask.scalef.ps.512", fnty=ir.FunctionType(
        _V, [_V, _V, _V, ir.IntType(16), _I32]))
    e = builder.call(scalef, [p, n, ir.Constant(_V, ir.Undefined), ir.Constant(ir.IntType(16), -1), ir.Constant(_I32, 4)])
    d = builder.fadd(_const(1.0), e)
    return builder.fdiv(xl, d) if DIVIDE else builder.fmul(xl, _reciprocal(builder, d))


def _silu_steps(steps) -> set[int]:
    """The indices k of SIGMOID steps whose one reader is step k + 1, a MUL of the sigmoid's own input by
    it: apply_steps emits the pair as one _silu."""
    users: dict[int, int] = {}
    for j, (_, refs) in enumerate(steps):
        for form, i in refs:
            if form == "step":
                users[i] = users.get(i, 0) + 1
    pairs = set()
    for k in range(len(steps) - 1):
        (sig, sig_refs), (mul, mul_refs) = steps[k], steps[k + 1]
        if sig.op == Op.SIGMOID and mul.op == Op.MUL and users.get(k) == 1 and len(sig_refs) == 1 and \
                sorted(mul_refs) == sorted([sig_refs[0], ("step", k)]):
            pairs.add(k)
    return pairs


def _pick(builder, a, b, cmp: str):
    """np.maximum / np.minimum: a NaN in either propagates, of equal values (+0, -0) b. With AVX-512:
    VMAXPS / VMINPS (b where either is NaN or they are equal), then a where a is NaN: 3 vector ops where
    two compares, their OR and a blend are 4 (a ReLU in a tile's stores: 14 -> 5 us of CRNN's 63 us conv)."""
    if AVX512:
        name = "max" if cmp == ">" else "min"
        f = builder.module.declare_intrinsic(f"llvm.x86.avx512.{name}.ps.512", fnty=ir.FunctionType(_V, [_V, _V, _I32]))
        return _nan_kept(builder, a, builder.call(f, [a, b, ir.Constant(_I32, 4)]))
    keep_a = builder.or_(builder.fcmp_ordered(cmp, a, b), builder.fcmp_unordered("uno", a, a))
    return builder.select(keep_a, a, b)


def _unary(name):
    return lambda b, x: b.call(b.module.declare_intrinsic(name, fnty=ir.FunctionType(_V, [_V])), [x])


EMIT = {
    Op.ADD: lambda b, x, y: b.fadd(x, y), Op.SUB: lambda b, x, y: b.fsub(x, y), Op.MUL: lambda b, x, y: b.fmul(x, y),
    Op.DIV: lambda b, x, y: b.fdiv(x, y), Op.MAXIMUM: lambda b, x, y: _pick(b, x, y, ">"),
    Op.MINIMUM: lambda b, x, y: _pick(b, x, y, "<"), Op.NEG: lambda b, x: b.fneg(x),
    Op.ABS: _unary("llvm.fabs.v16f32"), Op.SQRT: _unary("llvm.sqrt.v16f32"),
    Op.EXP: lambda b, x: _nan_kept(b, x, _exp(b, x)), Op.SIGMOID: _sigmoid,
    Op.SILU: lambda b, x: _silu(b, x),
    Op.TANH: lambda b, x: _nan_kept(b, x, b.fsub(b.fmul(_const(2.0), _sigmoid(b, b.fmul(_const(2.0), x))), _const(1.0))),
    Op.LESS: lambda b, x, y: b.fcmp_ordered("<", x, y), Op.LESS_EQUAL: lambda b, x, y: b.fcmp_ordered("<=", x, y),
    Op.GREATER: lambda b, x, y: b.fcmp_ordered(">", x, y), Op.GREATER_EQUAL: lambda b, x, y: b.fcmp_ordered(">=", x, y),
    Op.EQUAL: lambda b, x, y: b.fcmp_ordered("==", x, y), Op.NOT_EQUAL: lambda b, x, y: b.fcmp_unordered("!=", x, y),
    Op.WHERE: lambda b, c, x, y: b.select(c, x, y),
}
_BOOL_OUT = {Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL, Op.EQUAL, Op.NOT_EQUAL}


def supported(steps, operands) -> bool:
    """Whether _epilogue_intrinsic can emit these steps (conv.Epilogue's), reading float32 operands."""
    for node, refs in steps:
        if node.op not in EMIT:
            return False
        want = "bool" if node.op in _BOOL_OUT else "float32"
        if node.dtype.name != want or (node.op in _BOOL_OUT and len(refs) != 2):
            return False
    return all(form in ("scalar", "channel", "full") for form, _ in operands)


def _emit_epilogue(context, builder, steps, operands, op_types, ops, value, m_v, full_v, mask):
    """The steps applied to value (<16 x float>), reading operand k of `operands` (ops[k], a 1-D float32
    array) as ops[k][0] (scalar), ops[k][m] (channel) or ops[k][full_at : +16] (full, under mask)."""
    if not steps:
        return value
    return apply_steps(builder, steps, operands, epilogue_reads(context, builder, operands, op_types, ops, m_v, full_v, mask),
                       value)


def epilogue_reads(context, builder, operands, op_types, ops, m_v, full_v=None, mask=None, channels=None):
    """The operands' vectors for apply_steps: a scalar splat; a channel's value m_v splat, or with channels
    (a <16 x i1> mask) the 16 channels from m_v, one a lane (lanes are channels: conv_kernels' tiles);
    full: 16 values from full_v under mask."""
    load, _ = _masked(builder)
    read = {}
    for k, (form, _) in enumerate(operands):
        oa = context.make_array(op_types[k])(context, builder, builder.extract_value(ops, k))
        if form == "scalar":
            read[k] = _splat(builder, builder.load(oa.data))
        elif form == "channel" and channels is not None:
            read[k] = load(_vptr(builder, oa.data, m_v), channels)
        elif form == "channel":
            read[k] = _splat(builder, builder.load(builder.gep(oa.data, [m_v])))
        else:
            read[k] = load(_vptr(builder, oa.data, full_v), mask)
    return read


def apply_steps(builder, steps, operands, read, value):
    """The steps on value (<16 x float>) with the operands' vectors of epilogue_reads."""
    slot = {i: k for k, (_, i) in enumerate(operands)}
    silu = _silu_steps(steps)
    vals = []
    for k, (node, refs) in enumerate(steps):
        if k in silu:   # x * sigmoid(x): the next step emits it whole
            vals.append(None)
            continue
        xs = [value if form == "value" else vals[i] if form == "step" else read[slot[i]] for form, i in refs]
        if k - 1 in silu:
            vals.append(_silu(builder, next(x for (form, i), x in zip(refs, xs) if (form, i) != ("step", k - 1))))
            continue
        vals.append(EMIT[node.op](builder, *xs))
    return vals[-1] if vals else value


def _epilogue_intrinsic(steps, operands):
    """epilogue(dst, dst_at, src, src_at, valid, m, full_at, ops): for q < min(valid, 16),
    dst[dst_at + q] = the steps applied to src[src_at + q] (_emit_epilogue; full operands at full_at)."""
    @intrinsic
    def epilogue(typingctx, dst, dst_at, src, src_at, valid, m, full_at, ops):
        sig = types.void(dst, dst_at, src, src_at, valid, m, full_at, ops)

        def codegen(context, builder, signature, args):
            da = context.make_array(signature.args[0])(context, builder, args[0])
            sa = context.make_array(signature.args[2])(context, builder, args[2])
            dst_at_v, src_at_v, valid_v, m_v, full_v = (_i64(builder, args[i]) for i in (1, 3, 4, 5, 6))
            load, store = _masked(builder)
            mask = _lane_mask(builder, valid_v, 0)
            value = load(_vptr(builder, sa.data, src_at_v), mask)
            value = _emit_epilogue(context, builder, steps, operands, signature.args[7], args[7], value, m_v, full_v, mask)
            store(value, _vptr(builder, da.data, dst_at_v), mask)
            return context.get_dummy_value()
        return sig, codegen
    return epilogue


EPILOGUES: dict = {}
SPECS: dict = {}


def epilogue_for(key: str, steps, operands):
    """The epilogue intrinsic of these steps, made once per process per key (the steps' text)."""
    if key not in EPILOGUES:
        EPILOGUES[key] = _epilogue_intrinsic(steps, operands)
        SPECS[key] = (list(steps), list(operands))
    return EPILOGUES[key]


def steps_key(steps, operands) -> str:
    """A text naming the steps and operand forms: equal texts, equal epilogues."""
    return ";".join(f"{node.op.name}:{','.join(f'{f}{i}' for f, i in refs)}" for node, refs in steps) + \
        "|" + ",".join(f"{f}{i}" for f, i in operands)


# -- the drivers (numba, generated per window and epilogue) ------------------------------------------------

_POINTWISE = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_spatial import POINTWISE_ROWS, POINTWISE_VECTORS, tile_for

tile3, tile2, tile1 = (tile_for(1, 1, POINTWISE_ROWS, v, 1, {key!r}) for v in (3, 2, 1))   # POINTWISE_VECTORS 3


@njit(cache=True, nogil=True)
def kernel(x, w, bias, out, ops):
    # x [C, P], w [M rounded up to POINTWISE_ROWS, C], bias [M rounded up], out [M, P], all C-contiguous
    c_n, p_n = x.shape
    m_n = out.shape[0]
    xf = x.reshape(c_n * p_n)
    of = out.reshape(m_n * p_n)
    w_step = w.shape[1]
    wf = w.reshape(w.shape[0] * w_step)
    for q in range(0, p_n, 16 * POINTWISE_VECTORS):
        left = p_n - q
        for m0 in range(0, m_n, POINTWISE_ROWS):
            rows = min(POINTWISE_ROWS, m_n - m0)
            if left > 32:
                tile3(of, m0 * p_n + q, p_n, xf, q, p_n, 0, 0, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
            elif left > 16:
                tile2(of, m0 * p_n + q, p_n, xf, q, p_n, 0, 0, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
            else:
                tile1(of, m0 * p_n + q, p_n, xf, q, p_n, 0, 0, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
"""

_DEPTHWISE = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_spatial import EPILOGUES, TILE, tile_for

tile4, tile3, tile2, tile1 = (tile_for({kh}, {kw}, 1, v, {stride}) for v in (4, 3, 2, 1))
epilogue = EPILOGUES[{key!r}]


@njit(cache=True, nogil=True)
def kernel(x, w, bias, sh, dh, dw, ph, pw, out, ops):
    # x [C, H, W], w [C, kh * kw], bias [C], out [C, OH, OW]; column stride s, row stride sh. Each channel
    # is copied into a zero-padded plane of row width wp. Strides 1: output (oy, ox) is grid position
    # q = oy * wp + ox, which reads the plane at q + i * dh * wp + j * dw (the columns past ow are computed
    # and dropped). Else a row at a time, grid q = oy * ow + ox reading sh * oy * wp + s * ox + i * dh * wp
    # + j * dw (s 2: two loads, the even lanes).
    c_n, h, wd = x.shape
    _, oh, ow = out.shape
    kh, kw, s = {kh}, {kw}, {stride}
    wp = max(wd + pw, s * (ow - 1) + (kw - 1) * dw + 1)
    hp = max(h + ph, sh * (oh - 1) + (kh - 1) * dh + 1)
    xp = np.zeros(hp * wp + 2 * s * TILE + wp, np.float32)   # borders stay zero; slack for dropped lanes
    grid_path = s == 1 and sh == 1
    wq = wp if grid_path else ow
    n = (oh - 1) * wq + ow
    grid = np.empty(n + TILE, np.float32)
    of = out.reshape(c_n * oh * ow)
    taps = kh * kw
    wf = w.reshape(c_n * taps)
    for c in range(c_n):
        xc = x[c]
        for y in range(h):
            at = np.uintp((y + ph) * wp + pw)
            row = xc[y]
            for t in range(np.uintp(wd)):
                xp[at + t] = row[t]
        if grid_path:
            for q in range(0, n, TILE):
                left = n - q
                if left > 48:
                    tile4(grid, q, 0, xp, q, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                elif left > 32:
                    tile3(grid, q, 0, xp, q, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                elif left > 16:
                    tile2(grid, q, 0, xp, q, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                else:
                    tile1(grid, q, 0, xp, q, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
        else:
            for oy in range(oh):
                for ox in range(0, ow, TILE):
                    left = ow - ox
                    q, src = oy * ow + ox, sh * oy * wp + s * ox
                    if left > 48:
                        tile4(grid, q, 0, xp, src, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                    elif left > 32:
                        tile3(grid, q, 0, xp, src, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                    elif left > 16:
                        tile2(grid, q, 0, xp, src, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
                    else:
                        tile1(grid, q, 0, xp, src, 0, dh * wp, dw, wf, c * taps, 0, 1, bias, c, left, 1, ops)
        for oy in range(oh):
            at = (c * oh + oy) * ow
            for t in range(0, ow, 16):
                epilogue(of, at + t, grid, oy * wq + t, ow - t, c, at + t, ops)
"""

_ROWS_WINDOW = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_spatial import ROWS, TILE, tile_for

tile4, tile3, tile2, tile1 = (tile_for({kh}, {kw}, ROWS, v, {stride}, {key!r}) for v in (4, 3, 2, 1))


@njit(cache=True, nogil=True)
def kernel(x, w, bias, dh, dw, ph, pw, out, ops):
    # x [C, H, W], w [M rounded up to ROWS, C * kh * kw], bias [M rounded up], out [M, OH, OW]; stride s.
    # ROWS output channels at a time over every output row, a row's tiles in turn: x copied once into
    # zero-padded planes of row width wp, output (oy, ox) reads them at s * (oy * wp + ox) + i * dh * wp +
    # j * dw (stride 2: two loads, the even lanes). The channels outermost, so that the stores run down
    # ROWS planes at a time, not M: a first layer's output is written where the cache holds none of it,
    # and the prefetcher follows 4 streams (CRNN's 1 -> 32, 3 x 3 at 32 x 320: 1.3 MB, 150 -> 95 us cold).
    c_n, h, wd = x.shape
    m_n, oh, ow = out.shape
    kh, kw, s = {kh}, {kw}, {stride}
    wp = max(wd + pw, s * (ow - 1) + (kw - 1) * dw + 1)
    hp = max(h + ph, s * (oh - 1) + (kh - 1) * dh + 1)
    plane = hp * wp
    xp = np.zeros(c_n * plane + 2 * s * TILE + wp, np.float32)   # slack: the dropped lanes read past it
    for c in range(c_n):
        xc = x[c]
        for y in range(h):
            at = np.uintp(c * plane + (y + ph) * wp + pw)
            row = xc[y]
            for t in range(np.uintp(wd)):
                xp[at + t] = row[t]
    of = out.reshape(m_n * oh * ow)
    w_step = w.shape[1]
    wf = w.reshape(w.shape[0] * w_step)
    for m0 in range(0, m_n, ROWS):
        rows = min(ROWS, m_n - m0)
        for oy in range(oh):
            for ox in range(0, ow, TILE):
                left = ow - ox
                src = s * (oy * wp + ox)
                at = (m0 * oh + oy) * ow + ox
                if left > 48:
                    tile4(of, at, oh * ow, xp, src, plane, dh * wp, dw, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                elif left > 32:
                    tile3(of, at, oh * ow, xp, src, plane, dh * wp, dw, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                elif left > 16:
                    tile2(of, at, oh * ow, xp, src, plane, dh * wp, dw, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                else:
                    tile1(of, at, oh * ow, xp, src, plane, dh * wp, dw, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
"""

_ROWS_PHASES = """
from ingot.backends.cpu.conv_spatial import BAND_FLOATS, prefetch, split_columns

phase4, phase3, phase2, phase1 = (tile_for({kh}, {kw}, ROWS, v, 1, {key!r}, True) for v in (4, 3, 2, 1))


@njit(cache=True, nogil=True)
def phases(x, w, bias, dh, dw, ph, pw, out, ops):
    # Stride 2, column dilation 1 (else `strided`): x [C, H, W], w [M rounded up to ROWS, C * kh * kw], bias [M rounded up],
    # out [M, OH, OW]. A band of output rows at a time: the input rows it reads are copied, zero-padded,
    # into xp [C, rows, 2 * we], each padded row split into its even columns [0, we) and its odd ones
    # [we, 2 * we) (padded column 2 * k + e at e * we + k). Output (oy, ox), tap (i, j) reads band row
    # 2 * (oy - oy0) + i * dh, column (j % 2) * we + j // 2 + ox: contiguous loads, no shuffles.
    if dw != 1:
        return strided(x, w, bias, dh, dw, ph, pw, out, ops)
    c_n, h, wd = x.shape
    m_n, oh, ow = out.shape
    kh, kw = {kh}, {kw}
    we = ow + kw // 2
    wr = 2 * we
    band = max(1, min(oh, (BAND_FLOATS // (c_n * wr) - (kh - 1) * dh + 1) // 2))   # output rows a band
    plane = (2 * (band - 1) + (kh - 1) * dh + 1) * wr
    xp = np.zeros(c_n * plane + TILE + wr, np.float32)   # slack: the dropped lanes read past it
    of = out.reshape(m_n * oh * ow)
    xf = x.reshape(c_n * h * wd)
    w_step = w.shape[1]
    wf = w.reshape(w.shape[0] * w_step)
    for oy0 in range(0, oh, band):
        oy1 = min(oh, oy0 + band)
        for c in range(c_n):
            for r in range(2 * (oy1 - 1 - oy0) + (kh - 1) * dh + 1):
                at = c * plane + r * wr
                iy = 2 * oy0 + r - ph
                if iy < 0 or iy >= h:
                    xp[at:at + wr] = 0.0
                    continue
                base = (c * h + iy) * wd
                for k in range(0, we, 16):   # padded columns 2k, 2k + 1 are x's 2k - pw, 2k + 1 - pw
                    split_columns(xp, at + k, at + we + k, xf, base + 2 * k - pw, pw - 2 * k, wd + pw - 2 * k, min(16, we - k))
        for oy in range(oy0, oy1):
            for r in range(2):   # the input rows of the output row a band ahead, on their way from memory meanwhile
                iy = 2 * (oy + band) + r - ph
                if 0 <= iy < h:
                    for c in range(c_n):
                        for t in range(0, wd, 16):
                            prefetch(xf, (c * h + iy) * wd + t)
            src = 2 * (oy - oy0) * wr
            for ox in range(0, ow, TILE):
                left = ow - ox
                for m0 in range(0, m_n, ROWS):
                    rows = min(ROWS, m_n - m0)
                    at = (m0 * oh + oy) * ow + ox
                    if left > 48:
                        phase4(of, at, oh * ow, xp, src + ox, plane, dh * wr, we, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                    elif left > 32:
                        phase3(of, at, oh * ow, xp, src + ox, plane, dh * wr, we, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                    elif left > 16:
                        phase2(of, at, oh * ow, xp, src + ox, plane, dh * wr, we, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
                    else:
                        phase1(of, at, oh * ow, xp, src + ox, plane, dh * wr, we, wf, m0 * w_step, w_step, c_n, bias, m0, left, rows, ops)
"""
BAND_FLOATS = 1 << 14   # the band's copy of the input: 64 KB, in L2 next to the output rows it makes


SMALL_REDUCTION = 144   # C * kh * kw up to which a kxk conv runs here, not in conv_kernels.conv_direct
FEW_OUTPUTS = (8, 576)  # and up to 576 where it has at most 8 output channels (half of conv_direct's lanes)


def rows_window_fits(kh: int, kw: int, groups: int, strides, channels: int, width: int = 16, outputs: int = 16) -> bool:
    """A kxk window (not 1x1, at most 7 x 7) with groups 1, stride 1 or 2 in both axes, over few input
    channels or to few output channels, with output rows at least 16 wide (a tile is one row's): there
    conv_direct's lane-by-lane stores cost as much as its FMAs (3 -> 16 channels, 3 x 3, stride 2 at
    320 x 320: 0.54 ms there, 0.30 here; 32 -> 8 at 80 x 80: 0.38 there, 0.28 here; 64 -> 128: 0.60
    there, 1.08 here)."""
    reduction = channels * kh * kw
    small = reduction <= SMALL_REDUCTION or (outputs <= FEW_OUTPUTS[0] and reduction <= FEW_OUTPUTS[1])
    return groups == 1 and (kh, kw) != (1, 1) and kh <= 7 and kw <= 7 and strides[0] == strides[1] and \
        strides[0] in (1, 2) and small and width >= 16


def pointwise_fits(kh: int, kw: int, groups: int, strides, pads) -> bool:
    return groups == 1 and kh == kw == 1 and all(s == 1 for s in strides) and not any(a or b for a, b in pads)


def arrange_weights(w: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """w [M, C, kh, kw] as [M rounded up to ROWS and POINTWISE_ROWS, C * kh * kw] and the bias as [M
    rounded up] (zeros)."""
    m = w.shape[0]
    step = max(ROWS, POINTWISE_ROWS)
    rows = -(-m // step) * step
    wk = np.zeros((rows, int(np.prod(w.shape[1:]))), np.float32)
    wk[:m] = w.reshape(m, -1)
    b = np.zeros(rows, np.float32)
    if bias is not None:
        b[:m] = bias.reshape(-1)
    return wk, b


_FLAT = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_spatial import EPILOGUES

epilogue = EPILOGUES[{key!r}]


@njit(cache=True, nogil=True)
def kernel(x, out):
    # out = the steps on x, both flat float32, 16 at a time
    n = x.shape[0]
    for t in range(0, n, 16):
        epilogue(out, t, x, t, n - t, 0, t, ())
"""


def elementwise(node) -> object:
    """A unary float32 op of EMIT (sigmoid) as one vector pass: fn(x, out) over flat arrays."""
    steps = [(node, [("value", 0)])]
    key = steps_key(steps, [])
    epilogue_for(key, steps, [])
    return load(_FLAT.format(key=key), "kernel", "cpu_conv_spatial")


def depthwise_fits(kh: int, kw: int, strides) -> bool:
    """A depthwise window up to 7 x 7 with column stride 1 or 2 (any row stride: PP-OCR's (2, 1))."""
    return kh <= 7 and kw <= 7 and strides[1] in (1, 2) and strides[0] >= 1


def driver(kh: int, kw: int, steps, operands, depthwise_stride: int = 0, window_stride: int = 0):
    """The numba kernel of a kh x kw window (1x1: pointwise) with this epilogue (steps may be empty);
    depthwise_stride: the depthwise kernel of that stride; window_stride: the row-at-a-time kxk one."""
    key = steps_key(steps, operands)
    epilogue_for(key, steps, operands)
    if window_stride == 2:   # the strided kernel, and the phases one that calls it where dilated
        source = _ROWS_WINDOW.replace("def kernel(", "def strided(").format(key=key, kh=kh, kw=kw, stride=2) + \
            _ROWS_PHASES.format(key=key, kh=kh, kw=kw)
        return load(source, "phases", "cpu_conv_spatial")
    if window_stride:
        source = _ROWS_WINDOW.format(key=key, kh=kh, kw=kw, stride=window_stride)
    elif depthwise_stride:
        source = _DEPTHWISE.format(key=key, kh=kh, kw=kw, stride=depthwise_stride)
    else:
        assert (kh, kw) == (1, 1), "conv_spatial: a kxk window with groups 1 runs conv_kernels.conv_direct"
        source = _POINTWISE.format(key=key)
    return load(source, "kernel", "cpu_conv_spatial")
