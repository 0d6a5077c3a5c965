"""The 4-bit GEMV with integer activations on AVX-512 VNNI: 64 multiply-adds per instruction.

The portable kernel (kernels._kmajor_packed4_xq) spends its time in the unpack and the int16 adds
of every weight, and one more row of x costs as much again: 8 rows took 7x one row, so a server's
batch gained nothing. VPDPBUSD multiplies 64 unsigned bytes by 64 signed bytes and adds each four
into 16 int32 lanes, as llama.cpp's Q4 x Q8 dot products do; here one such instruction per 4 k per
16 output columns, and the weights, once in L1, serve every row of x.

Layout (`repack`, once per weight, when the CPU has VNNI): for each group of 16 output columns and
each block of 32 k, 256 bytes: four vectors of 64, vector v holding, for column l of the group, at
bytes 4 l .. 4 l + 3, the 4-bit codes of k = 4 v .. 4 v + 3 in the low nibbles and of k = 16 + 4 v ..
in the high nibbles (codes as the portable kernel reads them: byte ^ flip, so n - 8 is the value).
A block's 16 dot products are then 8 VPDPBUSD: low and high nibbles against the four x values of
their k, broadcast. The float epilogue is the portable kernel's: out += scale * (d * (dot - 8 sum
xq) + center * xsum) + offset * xsum, per block of 32 k and row of x.

5- and 6-bit weights (GGUF's Q5_0/Q5_1/Q5_K and Q6_K, which import as 8-bit integers) keep their
bits (`repack_bits`): the 4-bit layout of their low four bits, then one 64-byte bit plane per further
bit, 8 bytes per 64-byte vector of codes (bit i for byte i), which a mask register ORs into the codes
(320 or 384 bytes a block of 512 weights, where repack8's 512 read 55 or 33 % more than the file).
Weights with parameters per 16 k (Q6_K, Q3_K, Q2_K) keep the two halves' dot products apart and scale
each by its own parameter. The parameters read fastest grouped as the weights are (`group_params`:
[N / 16, blocks, 16], one sequential stream per parameter, where [blocks, N] walked each group's
column with a stride: ~64 streams for a K of 1024, more than the prefetcher follows, which left a
Q4_K matrix at a third of the memory's speed). The kernel unpacks a block once for all rows of x.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import team
from .nn_kernels import XQ_BLOCK, round_rows

GROUP = 16  # output columns per VNNI vector (16 int32 lanes)
BLOCK_BYTES = {4: 256, 5: 320, 6: 384, 8: 512}   # bytes of one block (16 columns x 32 k) per weight width


def host_has(*features: str) -> bool:
    """Whether x86 intrinsics needing these LLVM CPU features (e.g. "avx512f") may be emitted: an x86-64
    host that has them all, numba compiling for the host CPU."""
    import numba
    if platform.machine().lower() not in ("x86_64", "amd64") or numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        import llvmlite.binding as llvm
        found = llvm.get_host_cpu_features()
        return all(found.get(f) for f in features)
    except Exception:
        return False


AVAILABLE = host_has("avx512f", "avx512bw", "avx512vnni")


def _block_rows(bits: int, halves: bool):
    """The intrinsic block_rows for bits-wide weights (BLOCK_BYTES) whose parameters cover 32 k, or
    16 k (halves: two parameters a block, at p_at and p_at2 / u_at and u_at2)."""
    @intrinsic
    def block_rows(typingctx, res, w, w_at, xq, x_at, x_stride, scale, offset, p_at, u_at, p_at2, u_at2, d, shift, cx,
                   xsum, s_at, s_stride, h_at, h_stride, rows, has_offset):
        """For each row r < rows: res[16 r:16 r + 16] += scale * ((dot_r - shift_r) * d_r + cx_r)
        + offset * xsum_r (offset only when has_offset), dot_r the 16 int32 dot products of one block
        of 32 k: the block's bytes of w at flat offset w_at against the 32 int8 of row r of x at int32
        offset x_at + r x_stride of xq (an int32 view); d read at s_at + r s_stride, shift, cx and
        xsum at h_at + r h_stride (halves: each half's at h_at + h + r h_stride, with its own
        parameters); scale and offset at flat offset p_at: float32, float16 bits (uint16) or
        two-level (block_params.py: codes at p_at, units at u_at). The block is unpacked once for all
        rows; each row's instructions are vnni.gemv's of a block alone, so a row's result is the same
        bits whatever rows come with it. All in vector registers: in numba loops of 16 these cost more
        than the VPDPBUSDs."""
        sig = types.void(res, w, w_at, xq, x_at, x_stride, scale, offset, p_at, u_at, p_at2, u_at2, d, shift, cx, xsum,
                         s_at, s_stride, h_at, h_stride, rows, has_offset)
        return sig, _codegen(bits, halves)
    return block_rows


def splat(builder, value, vector_type):
    """value in every lane of a 16-lane vector_type (insert into lane 0, then broadcast)."""
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


class BlockIR:
    """The instructions of one block of W that the VNNI intrinsics share (`block_rows` here, rows_gemv's
    `rows_block_fma`): the block's bytes at flat offset w_at of wa unpacked into VPDPBUSD operands once,
    its float32 or float16 parameters widened, and a row's dot products with their float epilogue."""

    def __init__(self, builder, bits: int, wa, w_at):
        self.builder = b = builder
        i32 = ir.IntType(32)
        self.v16, self.f16x = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
        self.vdp = b.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512",
                                              fnty=ir.FunctionType(self.v16, [self.v16] * 3))
        self.zeros = ir.Constant(self.v16, [0] * 16)
        nibbles, four = ir.Constant(self.v16, [0x0F0F0F0F] * 16), ir.Constant(self.v16, [4] * 16)

        def load(v):
            at = b.add(w_at, ir.Constant(w_at.type, 64 * v))
            return b.load(b.bitcast(b.gep(wa.data, [at]), self.v16.as_pointer()), align=1)

        if bits < 8:    # vector v: k 4v.. in the low nibbles, 16 + 4v.. in the high ones
            self.parts = []
            for v in range(4):
                weights = load(v)
                self.parts += [(b.and_(weights, nibbles), v), (b.and_(b.lshr(weights, four), nibbles), v + 4)]
            bytes64, mask64 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(1), 64)
            for plane in range(bits - 4):   # bit 4 + plane of part j's 64 codes: 8 bytes at 256 + 64 plane + 8 j
                bit = ir.Constant(bytes64, [1 << (4 + plane)] * 64)
                for j, (part, quad) in enumerate(self.parts):
                    at = b.add(w_at, ir.Constant(w_at.type, 256 + 64 * plane + 8 * j))
                    mask = b.bitcast(b.load(b.bitcast(b.gep(wa.data, [at]), ir.IntType(64).as_pointer()), align=1),
                                     mask64)
                    high = b.select(mask, bit, ir.Constant(bytes64, [0] * 64))
                    self.parts[j] = (b.bitcast(b.or_(b.bitcast(part, bytes64), high), self.v16), quad)
        else:           # vector v: k 4v..4v + 3
            self.parts = [(load(v), v) for v in range(8)]

    def splat(self, value, vector_type):
        return splat(self.builder, value, vector_type)

    def params(self, a, at, element):
        """16 parameters of array a at flat offset at, widened to float32 (float16 bits when uint16)."""
        b = self.builder
        ptr = b.gep(a.data, [at])
        if element == types.uint16:
            halves = b.load(b.bitcast(ptr, ir.VectorType(ir.HalfType(), 16).as_pointer()), align=2)
            return b.fpext(halves, self.f16x)
        return b.load(b.bitcast(ptr, self.f16x.as_pointer()), align=4)

    def two_level_params(self, codes, at, units, unit_at):
        """16 two-level parameters (block_params.py): the uint8 codes of array codes at flat offset at
        times the float16 units (uint16 bits) of array units at flat offset unit_at, in float32."""
        b = self.builder
        ptr = b.bitcast(b.gep(codes.data, [at]), ir.VectorType(ir.IntType(8), 16).as_pointer())
        return b.fmul(b.uitofp(b.load(ptr, align=1), self.f16x), self.params(units, unit_at, types.uint16))

    def dots(self, xa, x_at):
        """The 16 int32 dot products of the block's k 0..15 and of its k 16..31 with the 32 int8 of x
        at int32 offset x_at of xa: two chains of 4 VPDPBUSD."""
        b = self.builder
        totals = [self.zeros, self.zeros]
        for part, quad in self.parts:
            x4 = b.load(b.gep(xa.data, [b.add(x_at, ir.Constant(x_at.type, quad))]), align=4)
            totals[quad // 4] = b.call(self.vdp, [totals[quad // 4], part, self.splat(x4, self.v16)])
        return totals

    def row(self, xa, x_at, shift, d, cx, scale):
        """scale * ((dot - shift) * d + cx) for the 32 int8 of x at int32 offset x_at of xa."""
        b, f16x = self.builder, self.f16x
        total = self.zeros
        for part, quad in self.parts:
            x4 = b.load(b.gep(xa.data, [b.add(x_at, ir.Constant(x_at.type, quad))]), align=4)
            total = b.call(self.vdp, [total, part, self.splat(x4, self.v16)])
        dots = b.sitofp(total, f16x)
        inner = b.fadd(b.fmul(b.fsub(dots, self.splat(shift, f16x)), self.splat(d, f16x)), self.splat(cx, f16x))
        return b.fmul(scale, inner)


def param_vector(context, block: BlockIR, ty, value, at, unit_at):
    """16 parameters of a block, float32 lanes, from an array (BlockIR.params) or a two-level tuple."""
    if isinstance(ty, types.BaseTuple):
        codes, units, _ = cgutils.unpack_tuple(block.builder, value, len(ty))
        make = lambda t, v: context.make_array(t)(context, block.builder, v)  # noqa: E731
        return block.two_level_params(make(ty.types[0], codes), at, make(ty.types[1], units), unit_at)
    return block.params(context.make_array(ty)(context, block.builder, value), at, ty.dtype)


def _codegen(bits: int, halves: bool):

    def codegen(context, builder, signature, args):
        (res_v, w_v, w_at_v, xq_v, x_at_v, x_stride_v, s_v, o_v, p_at_v, u_at_v, p_at2_v, u_at2_v, d_v, shift_v, cx_v,
         xsum_v, s_at_v, s_stride_v, h_at_v, h_stride_v, rows_v, has_v) = args
        arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
        ra, wa, xa = arr(0, res_v), arr(1, w_v), arr(3, xq_v)
        da, sha, cxa, xsa = arr(12, d_v), arr(13, shift_v), arr(14, cx_v), arr(15, xsum_v)
        block = BlockIR(builder, bits, wa, w_at_v)      # unpacked and widened once for all rows
        f16x, splat_f = block.f16x, lambda v: block.splat(v, block.f16x)  # noqa: E731
        vector = lambda i, v, at, u_at: param_vector(context, block, signature.args[i], v, at, u_at)  # noqa: E731
        scales = [vector(6, s_v, p_at_v, u_at_v)] + ([vector(6, s_v, p_at2_v, u_at2_v)] if halves else [])
        offsets = [vector(7, o_v, p_at_v, u_at_v)] + ([vector(7, o_v, p_at2_v, u_at2_v)] if halves else [])
        one = ir.Constant(h_at_v.type, 1)
        with cgutils.for_range(builder, rows_v) as loop:
            r = loop.index
            dots = block.dots(xa, builder.add(x_at_v, builder.mul(r, x_stride_v)))
            d = splat_f(builder.load(builder.gep(da.data, [builder.add(s_at_v, builder.mul(r, s_stride_v))])))
            at = builder.add(h_at_v, builder.mul(r, h_stride_v))
            ats = [at, builder.add(at, one)] if halves else [at]
            scalar = lambda a, i: splat_f(builder.load(builder.gep(a.data, [ats[i]])))  # noqa: E731
            parts = [builder.add(dots[0], dots[1])] if not halves else dots
            add = None
            for i, (part, scale) in enumerate(zip(parts, scales)):
                inner = builder.fadd(builder.fmul(builder.fsub(builder.sitofp(part, f16x), scalar(sha, i)), d),
                                     scalar(cxa, i))
                term = builder.fmul(scale, inner)
                add = term if add is None else builder.fadd(add, term)
            res_at = builder.mul(r, ir.Constant(r.type, GROUP))
            res_ptr = builder.bitcast(builder.gep(ra.data, [res_at]), f16x.as_pointer())
            acc = builder.fadd(builder.load(res_ptr, align=4), add)
            with builder.if_else(builder.icmp_unsigned("!=", has_v, ir.Constant(has_v.type, 0))) as (then, otherwise):
                with then:
                    total = acc
                    for i, offset in enumerate(offsets):
                        total = builder.fadd(total, builder.fmul(offset, scalar(xsa, i)))
                    builder.store(total, res_ptr, align=4)
                with otherwise:
                    builder.store(acc, res_ptr, align=4)
        return context.get_dummy_value()
    return codegen


BLOCK_ROWS = {(bits, halves): _block_rows(bits, halves) for bits in BLOCK_BYTES for halves in (False, True)}
block_rows4, block_rows5, block_rows6, block_rows8 = (BLOCK_ROWS[b, False] for b in (4, 5, 6, 8))
halves_rows4, halves_rows5, halves_rows6, halves_rows8 = (BLOCK_ROWS[b, True] for b in (4, 5, 6, 8))


def repack(q: np.ndarray, flip: int) -> np.ndarray:
    """The VNNI layout [N / 16, K / 32, 256] (uint8) of a k-major 4-bit weight q [K, N / 2]."""
    k, half = q.shape
    n = 2 * half
    codes = np.empty((k, n), np.uint8)
    flipped = q ^ np.uint8(flip)
    codes[:, 0::2] = flipped & 15
    codes[:, 1::2] = flipped >> 4
    # [K/32, 2 (low/high half of the block), 4 (v), 4 (p), N/16, 16 (l)] -> [N/16, K/32, v, l, p]
    c = codes.reshape(k // 32, 2, 4, 4, n // GROUP, GROUP)
    packed = c[:, 0] | (c[:, 1] << 4)                         # [K/32, v, p, G, l]
    return np.ascontiguousarray(packed.transpose(3, 0, 1, 4, 2)).reshape(n // GROUP, k // 32, 256)


def repack8(q: np.ndarray, flip: int) -> np.ndarray:
    """The VNNI layout [N / 16, K / 32, 512] (uint8) of a k-major 8-bit weight q [K, N], read as
    q ^ flip (int8 with flip 0x80: the value + 128)."""
    k, n = q.shape
    c = (q.view(np.uint8) ^ np.uint8(flip)).reshape(k // 32, 8, 4, n // GROUP, GROUP)   # [K/32, v, p, G, l]
    return np.ascontiguousarray(c.transpose(3, 0, 1, 4, 2)).reshape(n // GROUP, k // 32, 512)


def repack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """The VNNI layout [N / 16, K / 32, BLOCK_BYTES[bits]] (uint8) of a k-major weight of unsigned
    codes [K, N] below 2**bits (bits 4, 5 or 6): repack's nibbles of the low four bits, then for each
    further bit a plane of 8 bytes per vector of codes (vector j = 2 v + h: k 4 v + 16 h + p of column
    l at byte 4 l + p; bit 4 l + p of its 8 bytes, little-endian)."""
    k, n = codes.shape
    c = (codes & np.uint8(15)).reshape(k // 32, 2, 4, 4, n // GROUP, GROUP)   # [K/32, h, v, p, G, l]
    parts = [(c[:, 0] | (c[:, 1] << 4)).transpose(3, 0, 1, 4, 2).reshape(n // GROUP, k // 32, 256)]
    for plane in range(bits - 4):
        bit = ((codes >> np.uint8(4 + plane)) & np.uint8(1)).reshape(k // 32, 2, 4, 4, n // GROUP, GROUP)
        vectors = bit.transpose(4, 0, 2, 1, 5, 3).reshape(n // GROUP, k // 32, 8, 64)   # [G, K/32, v h, l p]
        parts.append(np.packbits(vectors, axis=-1, bitorder="little").reshape(n // GROUP, k // 32, 64))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def group_params(p):
    """Block parameters [nb, N] (an array, or a two-level tuple: codes, units, S) grouped as the
    VNNI layouts group the weights: [N / 16, nb, 16], each group's blocks one after another."""
    if isinstance(p, tuple):
        return tuple(group_params(a) for a in p[:2]) + (p[2],)
    nb, n = p.shape
    return np.ascontiguousarray(p.reshape(nb, n // GROUP, GROUP).transpose(1, 0, 2))


def param_at(p, g, b):
    """Flat offset of the 16 parameters of block b for columns 16 g.. in p: [nb, N], or grouped
    [N / 16, nb, 16] (group_params); of the codes for a two-level p."""
    return 0


def unit_at(p, g, b):
    """Flat offset of block b's units for columns 16 g.. in a two-level p; param_at for an array."""
    return 0


def param_count(p):
    """nb, the blocks of k that parameters p ([nb, N] or grouped) cover."""
    return 0


_inline = dict(inline="always", jit_options=dict(fastmath=True, nogil=True))


def _array_of(p):
    return p.types[0] if isinstance(p, types.BaseTuple) else p


@overload(param_at, **_inline)
def _param_at(p, g, b):
    grouped, two = _array_of(p).ndim == 3, isinstance(p, types.BaseTuple)
    if grouped:
        return (lambda p, g, b: (g * p[0].shape[1] + b) * GROUP) if two else (lambda p, g, b: (g * p.shape[1] + b) * GROUP)
    return (lambda p, g, b: b * p[0].shape[1] + g * GROUP) if two else (lambda p, g, b: b * p.shape[1] + g * GROUP)


@overload(unit_at, **_inline)
def _unit_at(p, g, b):
    if not isinstance(p, types.BaseTuple):
        return lambda p, g, b: param_at(p, g, b)
    if p.types[0].ndim == 3:
        return lambda p, g, b: (g * p[1].shape[1] + b // p[2]) * GROUP
    return lambda p, g, b: (b // p[2]) * p[1].shape[1] + g * GROUP


@overload(param_count, **_inline)
def _param_count(p):
    axis = 1 if _array_of(p).ndim == 3 else 0
    if isinstance(p, types.BaseTuple):
        return lambda p: p[0].shape[axis]
    return lambda p: p.shape[axis]


@njit(fastmath=True, cache=True, nogil=True)
def gemv(x, w, scale, offset, has_offset, center, s0, s1, c0, c1, out):
    """out[:, c0:c1] (c0, c1 multiples of 16) = x[:, blocks s0..s1 of 32 k] @ W for W in a VNNI
    layout w (repack: 4-bit, 256 bytes a block; repack_bits: 5 or 6, 320 or 384; repack8: 8-bit,
    512) with scale and offset [K / block, N] or grouped (group_params), float32, float16 bits or
    two-level (block_params.py), for blocks of 16 k or multiples of 32; x rounded to int8 per block
    of 32 by nn_kernels.round_rows. The codes c read as unsigned are the value + 2**(bits - 1) for a
    signed weight (center 0), the value for an unsigned one (center 2**(bits - 1)): dot - 2**(bits - 1)
    * sum(xq) is the product with c - 2**(bits - 1), center * sum(x) adds the rest."""
    m_rows, k = x.shape
    bs = k // param_count(scale)
    halves = bs < XQ_BLOCK
    nh = 2 if halves else 1
    nb32 = k // XQ_BLOCK
    xq = np.empty((m_rows, k), np.int8)
    xd = np.empty((m_rows, nb32), np.float32)
    xs = np.empty((m_rows, nb32), np.float32)
    xi = np.empty((m_rows, nb32), np.float32)
    round_rows(x, s0, s1, xq, xd, xs, xi)
    x4 = xq.reshape(m_rows * k).view(np.int32)
    size = w.shape[2]
    bias = np.float32(8.0 if size == 256 else 16.0 if size == 320 else 32.0 if size == 384 else 128.0)
    shift = np.empty((m_rows, nb32 * nh), np.float32)   # per row and block (half-block) of k
    cx = np.empty((m_rows, nb32 * nh), np.float32)
    xsum = np.empty((m_rows, nb32 * nh), np.float32)
    for m in range(m_rows):
        for sb in range(s0, s1):
            if halves:
                for h in range(2):
                    k0, isum, total = sb * XQ_BLOCK + 16 * h, 0, np.float32(0.0)
                    for j in range(16):
                        isum += xq[m, k0 + j]
                        total += x[m, k0 + j]
                    shift[m, 2 * sb + h] = bias * np.float32(isum)
                    cx[m, 2 * sb + h] = center * total
                    xsum[m, 2 * sb + h] = total
            else:
                shift[m, sb] = bias * xi[m, sb]
                cx[m, sb] = center * xs[m, sb]
                xsum[m, sb] = xs[m, sb]
    res = np.zeros(m_rows * GROUP, np.float32)
    x_stride = k // 4
    for g in range(c0 // GROUP, c1 // GROUP):
        lo = g * GROUP
        res[:] = 0
        for sb in range(s0, s1):
            b = sb * XQ_BLOCK // bs
            at, u_at = param_at(scale, g, b), unit_at(scale, g, b)
            w_at, x_at = (g * nb32 + sb) * size, sb * (XQ_BLOCK // 4)
            if halves:
                at2, u_at2 = param_at(scale, g, b + 1), unit_at(scale, g, b + 1)
                if size == 256:
                    halves_rows4(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at2, u_at2, xd, shift, cx,
                                 xsum, sb, nb32, 2 * sb, 2 * nb32, m_rows, has_offset)
                elif size == 320:
                    halves_rows5(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at2, u_at2, xd, shift, cx,
                                 xsum, sb, nb32, 2 * sb, 2 * nb32, m_rows, has_offset)
                elif size == 384:
                    halves_rows6(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at2, u_at2, xd, shift, cx,
                                 xsum, sb, nb32, 2 * sb, 2 * nb32, m_rows, has_offset)
                else:
                    halves_rows8(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at2, u_at2, xd, shift, cx,
                                 xsum, sb, nb32, 2 * sb, 2 * nb32, m_rows, has_offset)
            elif size == 256:
                block_rows4(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at, u_at, xd, shift, cx, xsum,
                            sb, nb32, sb, nb32, m_rows, has_offset)
            elif size == 320:
                block_rows5(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at, u_at, xd, shift, cx, xsum,
                            sb, nb32, sb, nb32, m_rows, has_offset)
            elif size == 384:
                block_rows6(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at, u_at, xd, shift, cx, xsum,
                            sb, nb32, sb, nb32, m_rows, has_offset)
            else:
                block_rows8(res, w, w_at, x4, x_at, x_stride, scale, offset, at, u_at, at, u_at, xd, shift, cx, xsum,
                            sb, nb32, sb, nb32, m_rows, has_offset)
        for m in range(m_rows):
            out[m, lo:lo + GROUP] = res[m * GROUP:(m + 1) * GROUP]


@njit(fastmath=True, cache=True, nogil=True)
def gemv_chunks(head, plan, outs, out, ctrl, gen, lead):
    """gemv over a team's chunks (team.py)."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        gemv(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


team.DRIVERS[gemv] = (gemv_chunks, True)   # the layout is contiguous per 16 columns: split along them
