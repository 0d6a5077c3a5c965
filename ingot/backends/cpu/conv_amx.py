"""Convolutions on Intel AMX tiles, each float32 product taken as three bfloat16 ones.

A float32 v is split into bfloat16 parts, hi = round(v) and lo = round(v - hi) (v = hi + lo to 2^-17 of
|v|); x * w is taken as hi_x hi_w + hi_x lo_w + lo_x hi_w (CpuOptions.float32_precision "bf16x3"), each
product exact and summed in AMX's float32 accumulators (TDPBF16PS). What is dropped (lo_x lo_w and the
splits' rounding) is ~2^-16 of |x w|: ~1e-5 of a layer's output. "bf16x6" splits into three parts and
adds the products of order 2^-16 too, for float32's own error at twice the cost.

- The input is split and copied into zero-padded planes, [S*S phases][chunks][PL positions][KC channels]
  (KC <= 32 even, the chunks equal): a tile of AMX's A operand is 16 consecutive positions of a chunk,
  1 KB in one piece, each row a cache line. A stride-s conv reads phase (i*dh % s, j*dw % s) at
  (oy + i*dh // s, ox + j*dw // s): consecutive outputs are consecutive positions.
- The weights are AMX's B operand: per tap and chunk, tiles of 16 output channels [KC/2][16][2].
- Outputs are plane positions q = oy * WQ + ox, 16 a tile (the few columns past the output's width are
  computed and dropped: a 20-wide row wastes 2 of 22 positions, not 12 of 32).
- A block is 32 output channels x 2 tiles of positions, or, for a last 16 channels, 16 x 4: four float32
  accumulator tiles started from the bias; over every tap and chunk, 12 TDPBF16PS from 10 tile loads
  (x3: `schedule`); then each accumulator, transposed in registers to [channel][position], gets the
  epilogue's vector IR (conv_spatial) and masked stores into the NCHW output, a run per output row.
  Bands of positions keep the input they read in L2 while every 32 channels pass over it (their rows
  split just before); a chunk's taps run together, reading the same lines from L1.
AMX needs the kernel's permission for its tile state (arch_prctl ARCH_REQ_XCOMP_PERM): `available()`
asks once. What the split changes besides the rounding: an infinite input (or weight) gives NaN where
float32 gives +-inf (its lo part is inf - inf; and inf * a zero lo part of the other side is NaN, as
tf32x3's is on the GPU); subnormals count as zero (AMX reads bfloat16 subnormals as zero); values past
bfloat16's largest (3.39e38) round to infinity. "float32" keeps IEEE float32 for such data.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import conv_spatial
from .conv_depthwise import _transpose16
from .conv_spatial import _V
from .vnni import host_has

with open(os.path.abspath(__file__), "rb") as _f:   # the generated kernels' cache key: the intrinsics here
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16] + conv_spatial.REVISION

PRODUCTS = {"bf16x3": ((0, 0), (0, 1), (1, 0)),   # (weight part, input part) pairs summed
            "bf16x6": ((0, 0), (0, 1), (0, 2), (1, 1), (1, 0), (2, 0))}
BAND_BYTES = 512 << 10   # the split input a band of output rows reads: L2-sized

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_P8 = _I8.as_pointer()


@functools.cache
def available() -> bool:
    """Whether this process may use AMX's bfloat16 tiles: an x86-64 Linux host with AMX-TILE and
    AMX-BF16 whose kernel grants the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA))."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not host_has("amx-tile", "amx-bf16"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0   # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def fits(kh: int, kw: int, groups: int, c: int, m: int) -> bool:
    """Convolutions the tiles take: groups 1, at least 8 input channels and 16 output ones, and a reduction
    (C * kh * kw) of at least 64."""
    return groups == 1 and c >= 8 and m >= 16 and c * kh * kw >= 64


def worth_it(kh: int, kw: int, c: int, m: int, positions: int) -> bool:
    """Where the tiles beat the AVX-512 kernels, measured through exe.run (Xeon VM, ms, tiles / float32):
    any kxk window over a tile of outputs (16) or more (64 x 40 x 40 3x3 0.258 / 0.667); a 1x1 one, whose
    input is split for only M products a value, from C * M = 192 * 64 and 64 outputs (192 x 40 x 40 ->
    64 0.258 / 0.296, 256 x 20 x 20 -> 128 0.153 / 0.177, 512 x 7 x 7 -> 512 0.107 / 0.216; lost or tied:
    128 x 40 x 40 -> 64 0.192 / 0.178, 96 -> 64 0.134 / 0.140, 576 x 7 x 7 -> 96 0.039 / 0.047 cold
    0.079 / 0.081)."""
    if kh * kw > 1:
        return positions >= 16
    return c * m >= 192 * 64 and positions >= 64


def chunking(c: int) -> tuple[int, int]:
    """(chunks, KC): input channels in equal even chunks of at most 32."""
    chunks = -(-c // 32)
    kc = -(-c // chunks)
    return chunks, kc + (kc & 1)


# -- the splits -------------------------------------------------------------------------------------------

def split(a: np.ndarray, parts: int) -> list[np.ndarray]:
    """float32 a as `parts` bfloat16 bit patterns (uint16), rounded to nearest even, each the rest of the
    ones before."""
    rest = np.ascontiguousarray(a, dtype=np.float32)
    out = []
    for _ in range(parts):
        u = rest.view(np.uint32)
        hi = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out.append((hi >> np.uint32(16)).astype(np.uint16))
        rest = rest - hi.view(np.float32)
    return out


def _split_intrinsic(stride: int, kc: int):
    """split_rows(planes, at, part_size, parts, xf, src, ch_step, n_ch, n): for positions q < min(n, 16)
    and channels c < KC, the value xf[src + c ch_step + stride q] (zero for c >= n_ch) split into `parts`
    bfloat16 parts, part k written at planes[k part_size + at + q KC + c]: 16 positions of a chunk's rows.
    The channels' vectors are transposed in registers (conv_depthwise._transpose16), 16 at a time."""
    f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
    v16, v32 = ir.VectorType(f32, 16), ir.VectorType(f32, 32)
    m16, m32 = ir.VectorType(ir.IntType(1), 16), ir.VectorType(ir.IntType(1), 32)
    i32x = lambda k: ir.VectorType(i32, k)  # noqa: E731
    halves = -(-kc // 16)
    width = 16 * halves

    @intrinsic
    def split_rows(typingctx, planes, at, part_size, parts, xf, src, ch_step, n_ch, n):
        sig = types.void(planes, at, part_size, parts, xf, src, ch_step, n_ch, n)

        def codegen(context, builder, signature, args):
            pa = context.make_array(signature.args[0])(context, builder, args[0])
            xa = context.make_array(signature.args[4])(context, builder, args[4])
            at_v, ps_v, parts_v, src_v, step_v, n_ch_v, n_v = (args[i] for i in (1, 2, 3, 5, 6, 7, 8))
            mod = builder.module
            i64 = lambda v: ir.Constant(_I64, v)  # noqa: E731

            def splat(v, k):
                vt = ir.VectorType(_I64, k)
                one = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(i32x(k), [0] * k))
            lanes = lambda k: ir.Constant(ir.VectorType(_I64, k), list(range(k)))  # noqa: E731
            zero16 = ir.Constant(v16, [0.0] * 16)
            if stride == 1:
                ld = _declare(mod, "llvm.masked.load.v16f32.p0", v16, [v16.as_pointer(), i32, m16, v16])
                full = builder.icmp_signed("<", lanes(16), splat(n_v, 16))
            else:   # 32 values, the even ones (the odd past the last even one masked off)
                ld = _declare(mod, "llvm.masked.load.v32f32.p0", v32, [v32.as_pointer(), i32, m32, v32])
                full = builder.icmp_signed("<=", lanes(32), splat(builder.mul(builder.sub(n_v, i64(1)), i64(2)), 32))
            count = 16 if stride == 1 else 32
            none = ir.Constant(ir.VectorType(ir.IntType(1), count), [0] * count)
            columns = []
            for c in range(width):
                if c >= kc:
                    columns.append(zero16)
                    continue
                live = builder.icmp_signed("<", i64(c), n_ch_v)
                mask = builder.select(live, full, none)
                start = builder.add(src_v, builder.mul(step_v, i64(c)))
                start = builder.select(live, start, src_v)
                if stride == 1:
                    ptr = builder.bitcast(builder.gep(xa.data, [start]), v16.as_pointer())
                    columns.append(builder.call(ld, [ptr, ir.Constant(i32, 4), mask, zero16]))
                else:
                    ptr = builder.bitcast(builder.gep(xa.data, [start]), v32.as_pointer())
                    wide = builder.call(ld, [ptr, ir.Constant(i32, 4), mask, ir.Constant(v32, [0.0] * 32)])
                    columns.append(builder.shuffle_vector(wide, ir.Constant(v32, ir.Undefined),
                                                          ir.Constant(i32x(16), list(range(0, 32, 2)))))
            rows = [_transpose16(builder, columns[16 * h:16 * h + 16]) for h in range(halves)]   # [half][q]
            hw = ir.VectorType(i16, width)
            st = _declare(mod, f"llvm.masked.store.v{width}i16.p0", ir.VoidType(),
                          [hw, hw.as_pointer(), i32, ir.VectorType(ir.IntType(1), width)])
            lane_ok = ir.Constant(ir.VectorType(ir.IntType(1), width), [c < kc for c in range(width)])
            values = []
            for q in range(16):
                v = rows[0][q] if halves == 1 else builder.shuffle_vector(
                    rows[0][q], rows[1][q], ir.Constant(i32x(32), list(range(32))))
                values.append(v)
            def store_part(k):
                base = builder.add(at_v, builder.mul(ps_v, i64(k)))
                for q in range(16):
                    bits, values[q] = bf16_part(builder, values[q])
                    mask = builder.select(builder.icmp_signed("<", i64(q), n_v), lane_ok,
                                          ir.Constant(lane_ok.type, [0] * width))
                    ptr = builder.bitcast(builder.gep(pa.data, [builder.add(base, i64(q * kc))]), hw.as_pointer())
                    builder.call(st, [bits, ptr, ir.Constant(i32, 2), mask])
            each_part(builder, parts_v, store_part)
            return context.get_dummy_value()
        return sig, codegen
    return split_rows


def each_part(builder, parts_v, emit) -> None:
    """emit(k) for each part k < parts_v (a run-time i64, 1 to 3), each in a block after the one before (LLVM
    IR): what emit(k) computes is there for emit(k + 1)."""
    end = builder.append_basic_block("parts_done")
    for k in range(3):
        if k:
            go = builder.append_basic_block(f"part{k}")
            builder.cbranch(builder.icmp_signed(">", parts_v, ir.Constant(parts_v.type, k)), go, end)
            builder.position_at_end(go)
        emit(k)
    builder.branch(end)
    builder.position_at_end(end)


def counted_loop(builder, n, body) -> None:
    """body(t) for t < n (an i64; LLVM IR): a loop whose counter is a phi."""
    zero = ir.Constant(n.type, 0)
    start = builder.block
    loop, done = builder.append_basic_block("loop"), builder.append_basic_block("loop_done")
    builder.cbranch(builder.icmp_signed(">", n, zero), loop, done)
    builder.position_at_end(loop)
    t = builder.phi(n.type)
    t.add_incoming(zero, start)
    body(t)
    nxt = builder.add(t, ir.Constant(n.type, 1))
    t.add_incoming(nxt, builder.block)
    builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
    builder.position_at_end(done)


def tile_ops(builder, product: str):
    """(load, dp, store) of AMX's tiles (LLVM IR): load(slot, byte pointer, stride), dp(accumulator, a, b)
    by the instruction `product` ("tdpbf16ps", "tdpbusd"), store(slot, byte pointer, stride)."""
    mod = builder.module
    load = _declare(mod, "llvm.x86.tileloadd64", ir.VoidType(), [_I8, _P8, _I64])
    dp = _declare(mod, f"llvm.x86.{product}", ir.VoidType(), [_I8, _I8, _I8])
    store = _declare(mod, "llvm.x86.tilestored64", ir.VoidType(), [_I8, _P8, _I64])
    i8 = lambda v: ir.Constant(_I8, v)  # noqa: E731
    stride = lambda v: v if isinstance(v, ir.Value) else ir.Constant(_I64, v)  # noqa: E731
    return (lambda slot, ptr, step: builder.call(load, [i8(slot), ptr, stride(step)]),
            lambda c, a, b: builder.call(dp, [i8(c), i8(a), i8(b)]),
            lambda slot, ptr, step: builder.call(store, [i8(slot), ptr, stride(step)]))


def bf16_part(builder, v):
    """(bits, rest) of a <N x float> v (LLVM IR): its values rounded to the nearest bfloat16 (ties to even),
    as <N x i16> bits, and v less them (exact in float32)."""
    n = v.type.count
    iw, hw = ir.VectorType(ir.IntType(32), n), ir.VectorType(ir.IntType(16), n)
    c = lambda x: ir.Constant(iw, [x] * n)  # noqa: E731
    u = builder.bitcast(v, iw)
    odd = builder.and_(builder.lshr(u, c(16)), c(1))
    hi = builder.and_(builder.add(builder.add(u, c(0x7FFF)), odd), c(0xFFFF0000 - (1 << 32)))
    return builder.trunc(builder.lshr(hi, c(16)), hw), builder.fsub(v, builder.bitcast(hi, v.type))


SPLITS: dict = {}


def splits_for(kc: int):
    """The stride-1 and stride-2 split intrinsics of KC, made once per process."""
    if kc not in SPLITS:
        SPLITS[kc] = (_split_intrinsic(1, kc), _split_intrinsic(2, kc))
    return SPLITS[kc]


@njit(cache=True, nogil=True)
def split_scalar(xf, src, ch_step, n_ch, n, stride, planes, at, parts, part_size, kc):
    """split_rows' work for any stride, a value at a time (strides above 2 are rare)."""
    for q in range(n):
        for ch in range(n_ch):
            v = xf[src + ch * ch_step + q * stride]
            for k in range(parts):
                u = np.float32(v).view(np.uint32)
                hi = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
                planes[k * part_size + at + q * kc + ch] = np.uint16(hi >> np.uint32(16))
                v = v - np.uint32(hi).view(np.float32)


class Geometry:
    """The planes, taps and chunks of one convolution (shapes fixed at compile time)."""

    def __init__(self, c: int, h: int, w: int, m: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
                 ph: int, pw: int, oh: int, ow: int, precision: str):
        self.c, self.m, self.kh, self.kw = c, m, kh, kw
        self.sh, self.sw, self.dh, self.dw, self.ph, self.pw = sh, sw, dh, dw, ph, pw
        self.oh, self.ow = oh, ow
        self.products = PRODUCTS[precision]
        self.parts = 1 + max(max(p) for p in self.products)
        self.chunks, self.kc = chunking(c)
        self.m_pad = -(-m // 16) * 16
        self.hq = max(oh - 1 + (kh - 1) * dh // sh, (ph + h - 1) // sh) + 1
        self.wq = max(ow - 1 + (kw - 1) * dw // sw, (pw + w - 1) // sw) + 1
        self.pl = self.hq * self.wq + 32           # positions a plane; slack: the last tile reads up to 15 past
        self.part_size = sh * sw * self.chunks * self.pl * self.kc
        offs = []   # elements, per chunk and tap: a chunk's taps read the same lines, from L1
        for k in range(self.chunks):
            for i in range(kh):
                for j in range(kw):
                    plane = (((i * dh) % sh) * sw + (j * dw) % sw) * self.chunks + k
                    offs.append((plane * self.pl + ((i * dh) // sh) * self.wq + (j * dw) // sw) * self.kc)
        self.offs = np.array(offs, np.int64)
        # outputs are plane positions q = oy * wq + ox (the columns past ow computed and dropped), 16 a tile
        self.positions = (oh - 1) * self.wq + ow
        self.n_tiles = -(-self.positions // 16)
        rows = max(1, BAND_BYTES // max(1, self.chunks * self.kc * 2 * self.parts * self.wq * sh))
        self.band = max(4, -(-rows * self.wq // 64) * 4)   # tiles a band, a multiple of 4

    def planes(self) -> np.ndarray:
        """The split input's planes, zero (their borders stay so), 64-byte aligned: a tile row (32 bfloat16
        channels of a position) is one cache line."""
        raw = np.zeros(self.parts * self.part_size + 32, np.uint16)
        skip = (-raw.ctypes.data % 64) // 2
        return raw[skip:skip + self.parts * self.part_size]

    def weights(self, w: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """w [M, C, kh, kw] as groups of 32 output channels (the last 16 where M' / 16 is odd), each
        [taps * chunks][parts][32 or 16 channels as tiles of [KC / 2][16][2]] bfloat16 (AMX's pair layout;
        a block's weights one stream), and the bias as [M' / 16][16][16] float32 tiles (every row the
        tile's 16 channels' biases)."""
        m, c, kh, kw = self.m, self.c, self.kh, self.kw
        wp = np.zeros((self.m_pad, self.chunks * self.kc, kh, kw), np.float32)
        wp[:m, :c] = np.asarray(w, np.float32).reshape(m, c, kh, kw)
        arranged = wp.reshape(self.m_pad, self.chunks, self.kc, kh, kw).transpose(1, 3, 4, 0, 2)
        tc, mt, kc = kh * kw * self.chunks, self.m_pad // 16, self.kc
        parts = np.stack(split(arranged, self.parts)).reshape(self.parts, tc, mt, 16, kc // 2, 2)
        parts = parts.transpose(0, 1, 2, 4, 3, 5)   # a tile: [KC / 2][16 channels][2]
        groups = [parts[:, :, t0:t0 + 2].transpose(1, 0, 2, 3, 4, 5).reshape(-1) for t0 in range(0, mt, 2)]
        b = np.zeros(self.m_pad, np.float32)
        if bias is not None:
            b[:m] = np.asarray(bias, np.float32).reshape(-1)
        return np.ascontiguousarray(np.concatenate(groups)), np.ascontiguousarray(
            np.broadcast_to(b.reshape(mt, 1, 16), (mt, 16, 16)))


# -- the tile intrinsics ----------------------------------------------------------------------------------

def _declare(mod, name: str, ret, args):
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, args), name=name)


def tile_config(shapes):
    """An intrinsic config() that loads the tile configuration `shapes` ((rows, bytes a row) of tiles 0..7)."""
    raw = [0] * 64
    raw[0] = 1   # palette 1
    for t, (rows, colsb) in enumerate(shapes):
        raw[16 + 2 * t], raw[17 + 2 * t], raw[48 + t] = colsb & 0xFF, colsb >> 8, rows

    @intrinsic
    def config(typingctx):
        def codegen(context, builder, signature, args):
            cfg_t = ir.ArrayType(_I8, 64)
            cfg = builder.alloca(cfg_t)
            builder.store(ir.Constant(cfg_t, raw), cfg)
            builder.call(_declare(builder.module, "llvm.x86.ldtilecfg", ir.VoidType(), [_P8]), [builder.bitcast(cfg, _P8)])
            return context.get_dummy_value()
        return types.void(), codegen
    return config


def _config_intrinsic(kc: int):
    """config() for KC: tiles 0-3 accumulators (16 positions x 16 channels float32), 4-5 weights (KC / 2 pair
    rows of 16 channels x 2 bf16), 6-7 inputs (16 positions x KC bf16)."""
    return tile_config([(16, 64)] * 4 + [(kc // 2, 64)] * 2 + [(16, 2 * kc)] * 2)


@intrinsic
def release(typingctx):
    """tilerelease(): the tile state back to its initial one."""
    def codegen(context, builder, signature, args):
        builder.call(_declare(builder.module, "llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()
    return types.void(), codegen


def schedule(products, m_tiles: int) -> list[tuple]:
    """The tile operations of one tap and chunk of a block of m_tiles (1 or 2) x 4 / m_tiles accumulators:
    ("load", slot, ("A", part, m-tile) or ("B", part, p-tile)) and ("dp", accumulator, a slot, b slot).
    Slots 4-5 hold weights, 6-7 inputs; a load only where the slot holds something else."""
    held: dict = {}
    ops: list = []

    def ensure(slot, what):
        if held.get(slot) != what:
            ops.append(("load", slot, what))
            held[slot] = what
    if m_tiles == 2:
        for a, b in products:
            for mk in range(2):
                ensure(4 + mk, ("A", a, mk))
            for pk in range(2):
                ensure(6 + pk, ("B", b, pk))
            ops += [("dp", 2 * mk + pk, 4 + mk, 6 + pk) for mk in range(2) for pk in range(2)]
        return ops
    weight_parts = sorted({a for a, _ in products})
    for pair in (0, 2):   # p-tiles two at a time, the products grouped by input part
        for a, b in sorted(products, key=lambda ab: (ab[1], ab[0])):
            slot = 4 + weight_parts.index(a) % 2
            ensure(slot, ("A", a, 0))
            for k in range(2):
                ensure(6 + k, ("B", b, pair + k))
            ops += [("dp", pair + k, slot, 6 + k) for k in range(2)]
    return ops


def _block_intrinsic(kc: int, products, m_tiles: int, transpose: bool = True):
    """block(x, x_part, w, w_part, bias_t, b_at, offs, p0, p1, p2, p3, w_at, w_tc, scratch): a block of
    m_tiles (1 or 2) tiles of 16 output channels x 4 / m_tiles tiles of 16 positions (p0.. in elements:
    position * KC). Accumulator (mk, pk) (tile (4 / m_tiles) mk + pk, [16 positions][16 channels]) =
    bias tile b_at + 256 mk, plus over t < len(offs) and the products (a, b): input part b at
    offs[t] + p_pk (16 x KC) times weights part a at w_at + t w_tc + a w_part + 16 KC mk ([KC / 2][16][2]);
    stored to scratch[256 * accumulator:], transposed ([16 channels][16 positions]) or not."""
    ops = schedule(products, m_tiles)
    p_tiles = 4 // m_tiles

    @intrinsic
    def block(typingctx, x, x_part, w, w_part, bias_t, b_at, offs, p0, p1, p2, p3, w_at, w_tc, scratch):
        sig = types.void(x, x_part, w, w_part, bias_t, b_at, offs, p0, p1, p2, p3, w_at, w_tc, scratch)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            xa, wa, ba, oa, sa = arr(0), arr(2), arr(4), arr(6), arr(13)
            x_part_v, w_part_v, b_at_v, w_at_v, w_tc_v = (args[i] for i in (1, 3, 5, 11, 12))
            ps = args[7:11]
            load, dp, store = tile_ops(builder, "tdpbf16ps")
            i64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            p8 = lambda a, at: builder.bitcast(builder.gep(a.data, [at]), _P8)  # noqa: E731
            for mk in range(m_tiles):
                bias_p = p8(ba, builder.add(b_at_v, i64(256 * mk)))
                for pk in range(p_tiles):
                    load(p_tiles * mk + pk, bias_p, 64)

            def tap_chunk(t):
                off = builder.load(builder.gep(oa.data, [t]))
                w_base = builder.add(w_at_v, builder.mul(t, w_tc_v))
                for op in ops:
                    if op[0] == "dp":   # accumulator += input (slot 6-7) x weights (slot 4-5)
                        dp(op[1], op[3], op[2])
                        continue
                    _, slot, (kind, part, tile) = op
                    if kind == "A":   # weights
                        load(slot, p8(wa, builder.add(builder.add(builder.mul(i64(part), w_part_v), w_base),
                                                      i64(16 * kc * tile))), 64)
                    else:             # inputs
                        load(slot, p8(xa, builder.add(builder.mul(i64(part), x_part_v), builder.add(off, ps[tile]))),
                             2 * kc)
            counted_loop(builder, builder.extract_value(oa.shape, 0), tap_chunk)
            vp = lambda at: builder.bitcast(builder.gep(sa.data, [i64(at)]), _V.as_pointer())  # noqa: E731
            for k in range(4):
                store(k, p8(sa, i64(256 * k)), 64)
                if not transpose:
                    continue
                rows = [builder.load(vp(256 * k + 16 * r), align=4) for r in range(16)]
                for r, v in enumerate(_transpose16(builder, rows)):
                    builder.store(v, vp(256 * k + 16 * r), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return block


CONFIGS: dict = {}
BLOCKS: dict = {}


def blocks_for(kc: int, precision: str, transpose: bool = True):
    """The config intrinsic and the 2 x 2 and 1 x 4 block intrinsics of KC and a precision (transpose: the
    accumulators stored [channel][position], as the NCHW epilogue reads them), made once per process."""
    if (kc, precision, transpose) not in BLOCKS:
        CONFIGS[kc] = CONFIGS.get(kc) or _config_intrinsic(kc)
        BLOCKS[kc, precision, transpose] = tuple(_block_intrinsic(kc, PRODUCTS[precision], m, transpose)
                                                 for m in (2, 1))
    return (CONFIGS[kc],) + BLOCKS[kc, precision, transpose]


# The band and block loops both drivers share: over each band of n_tiles tiles of 16 positions, its input
# prepared just before (prepare_band), 32 output channels x 2 tiles a block (block22), a last 16 x 4
# (block14), each accumulator out through emit (the driver's).
BANDS = """

@njit(cache=True, nogil=True)
def bands(x, planes, pctx, parts, part_size, w, bias_t, offs, n_tiles, band, scratch, ctx):
    m_tiles = bias_t.shape[0]
    n_tc = offs.shape[0]
    last = (n_tiles - 1) * 16 * KC
    ready = 0
    config()
    for b0 in range(0, n_tiles, band):
        b1 = min(n_tiles, b0 + band)
        ready = prepare_band(x, planes, pctx, ready, b1)
        for mb in range(0, m_tiles - 1, 2):
            for t in range(b0, b1, 2):
                p = 16 * t * KC
                block22(planes, part_size, w, 32 * KC, bias_t, mb * 256, offs, p, min(p + 16 * KC, last), 0, 0,
                        mb * n_tc * parts * 16 * KC, parts * 32 * KC, scratch)
                for mk in range(2):
                    for pk in range(min(2, b1 - t)):
                        emit(ctx, scratch, 2 * mk + pk, 16 * (t + pk), (mb + mk) * 16)
        if m_tiles % 2:
            mb = m_tiles - 1
            for t in range(b0, b1, 4):
                p = 16 * t * KC
                block14(planes, part_size, w, 16 * KC, bias_t, mb * 256, offs, p, min(p + 16 * KC, last),
                        min(p + 32 * KC, last), min(p + 48 * KC, last), mb * n_tc * parts * 16 * KC, parts * 16 * KC,
                        scratch)
                for pk in range(min(4, b1 - t)):
                    emit(ctx, scratch, pk, 16 * (t + pk), mb * 16)
    release()
"""

_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_amx import blocks_for, release, split_scalar, splits_for
from ingot.backends.cpu.conv_spatial import EPILOGUES

config, block22, block14 = blocks_for({kc}, {precision!r})
split1, split2 = splits_for({kc})
epilogue = EPILOGUES[{key!r}]
KC = {kc}


@njit(cache=True, nogil=True)
def prepare(x, planes, parts, part_size, sh, sw, ph, pw, wq, pl, chunks, y0, y1):
    # rows y0..y1 of x [C, H, W] float32 split into `parts` bfloat16 parts, into planes (uint16, part k at
    # k * part_size) [sh * sw phases][chunks][pl positions][KC channels]: padded (y + ph, x + pw) at phase
    # (y % sh, x % sw), position (y // sh) * wq + x // sw. The zero border is never written.
    c_n, h, w = x.shape
    xf = x.reshape(c_n * h * w)
    for k in range(chunks):
        n_ch = min(KC, c_n - k * KC)
        for y in range(y0, y1):
            yy = y + ph
            src_row = (k * KC * h + y) * w
            for b in range(sw):
                q0 = (pw - b + sw - 1) // sw        # the first column xq * sw + b >= pw
                q1 = (pw + w - 1 - b) // sw + 1     # past the last <= pw + w - 1
                if q1 <= q0:
                    continue
                plane = ((yy % sh) * sw + b) * chunks + k
                at = (plane * pl + (yy // sh) * wq + q0) * KC
                first = src_row + q0 * sw + b - pw
                if sw > 2:
                    split_scalar(xf, first, h * w, n_ch, q1 - q0, sw, planes, at, parts, part_size, KC)
                    continue
                for q in range(0, q1 - q0, 16):
                    if sw == 1:
                        split1(planes, at + q * KC, part_size, parts, xf, first + q, h * w, n_ch, q1 - q0 - q)
                    else:
                        split2(planes, at + q * KC, part_size, parts, xf, first + 2 * q, h * w, n_ch, q1 - q0 - q)


@njit(cache=True, nogil=True)
def emit(ctx, scratch, acc, q0, m0):
    # accumulator acc (16 channels from m0 x positions q0..q0+15) through the epilogue into out: each run
    # of positions within an output row (q = oy * wq + ox, ox < ow) in turn
    of, n_q, wq, ow, p_n, m_n, ops = ctx
    q = q0
    end = min(q0 + 16, n_q)
    while q < end:
        oy = q // wq
        ox = q - oy * wq
        if ox >= ow:
            q = (oy + 1) * wq
            continue
        run = min(end - q, ow - ox)
        for r in range(min(16, m_n - m0)):
            at = (m0 + r) * p_n + oy * ow + ox
            epilogue(of, at, scratch, acc * 256 + 16 * r + q - q0, run, m0 + r, at, ops)
        q += run


@njit(cache=True, nogil=True)
def prepare_band(x, planes, pctx, ready, b1):
    # the rows of x band ..b1 reads, past the `ready` ones; the rows now ready
    parts, part_size, sh, sw, ph, pw, wq, pl, chunks, reach = pctx
    need = min(x.shape[1], ((16 * b1 - 1) // wq) * sh + reach - ph + 1)
    if need > ready:
        prepare(x, planes, parts, part_size, sh, sw, ph, pw, wq, pl, chunks, ready, need)
    return max(need, ready)
""" + BANDS + """

@njit(cache=True, nogil=True)
def kernel(x, planes, parts, part_size, sh, sw, ph, pw, wq, pl, chunks, reach, w, bias_t, offs, n_tiles, band, out,
           scratch, ops):
    # x [C, H, W] float32 -> planes (prepare), the rows a band reads just before it (they are in L2 when
    # the band runs); reach: (kh - 1) * dh; w, bias_t: Geometry.weights; offs: the taps' and chunks'
    # element offsets; out [M, OH, OW] (`bands`).
    m_n, oh, ow = out.shape
    ctx = (out.reshape(m_n * oh * ow), (oh - 1) * wq + ow, wq, ow, oh * ow, m_n, ops)
    bands(x, planes, (parts, part_size, sh, sw, ph, pw, wq, pl, chunks, reach), parts, part_size, w, bias_t, offs,
          n_tiles, band, scratch, ctx)
"""


def driver(kc: int, precision: str, steps, operands):
    """The numba kernel of KC, a precision and an epilogue (generated, cached on disk)."""
    key = conv_spatial.steps_key(steps, operands)
    conv_spatial.epilogue_for(key, steps, operands)
    return conv_spatial.load(f"# amx {REVISION}\n" + _DRIVER.format(kc=kc, precision=precision, key=key), "kernel",
                             "conv_amx")
