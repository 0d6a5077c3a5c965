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
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import team
from .block_params import param_blocks, param_columns, unit_row
from .nn_kernels import XQ_BLOCK, round_rows

GROUP = 16  # output columns per VNNI vector (16 int32 lanes)


def _available() -> bool:
    """x86-64 with AVX-512 VNNI, numba compiling for the host CPU."""
    import numba
    if platform.machine().lower() not in ("x86_64", "amd64") or numba.config.CPU_NAME not in (None, "host"):
        return False
    try:
        import llvmlite.binding as llvm
        features = llvm.get_host_cpu_features()
        return all(features.get(f) for f in ("avx512f", "avx512bw", "avx512vnni"))
    except Exception:
        return False


AVAILABLE = _available()


def _block_fma(bits: int):
    """The intrinsic block_fma for bits-wide weights (4: 256 bytes a block, 8: 512)."""
    @intrinsic
    def block_fma(typingctx, res, res_at, w, w_at, xq, x_at, scale, offset, p_at, u_at, d, shift, cx, xsum, has_offset):
        """res[res_at:res_at + 16] += scale * ((dot - shift) * d + cx) + offset * xsum (offset only when
        has_offset), dot the 16 int32 dot products of one block of 32 k: the 256 (4-bit) or 512 (8-bit)
        bytes of w (uint8, C order) at flat offset w_at against the 32 int8 of x at int32 offset x_at
        of xq (an int32 view); scale and offset at flat offset p_at, float32 or float16 bits (uint16),
        or two-level (block_params.py: codes at p_at, units at u_at).
        All in vector registers: the same in numba loops of 16 cost more than the VPDPBUSDs."""
        sig = types.void(res, res_at, w, w_at, xq, x_at, scale, offset, p_at, u_at, d, shift, cx, xsum, has_offset)
        return sig, _codegen(bits)
    return block_fma


def splat(builder, value, vector_type):
    """value in every lane of a 16-lane vector_type (insert into lane 0, then broadcast)."""
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


class BlockIR:
    """The instructions of one block of W that the VNNI intrinsics share (`block_fma` here, rows_gemv's
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

        if bits == 4:   # vector v: k 4v.. in the low nibbles, 16 + 4v.. in the high ones
            self.parts = []
            for v in range(4):
                weights = load(v)
                self.parts += [(b.and_(weights, nibbles), v), (b.and_(b.lshr(weights, four), nibbles), v + 4)]
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


def _codegen(bits: int):

    def codegen(context, builder, signature, args):
        res_v, res_at_v, w_v, w_at_v, xq_v, x_at_v, s_v, o_v, p_at_v, u_at_v, d_v, shift_v, cx_v, xsum_v, has_v = args
        arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
        ra, wa, xa = arr(0, res_v), arr(2, w_v), arr(4, xq_v)
        block = BlockIR(builder, bits, wa, w_at_v)
        f16x = block.f16x
        scale = param_vector(context, block, signature.args[6], s_v, p_at_v, u_at_v)
        add = block.row(xa, x_at_v, shift_v, d_v, cx_v, scale)
        res_ptr = builder.bitcast(builder.gep(ra.data, [res_at_v]), f16x.as_pointer())
        acc = builder.fadd(builder.load(res_ptr, align=4), add)
        with builder.if_then(builder.icmp_unsigned("!=", has_v, ir.Constant(has_v.type, 0))):
            offset = param_vector(context, block, signature.args[7], o_v, p_at_v, u_at_v)
            builder.store(builder.fadd(acc, builder.fmul(offset, block.splat(xsum_v, f16x))), res_ptr, align=4)
        with builder.if_then(builder.icmp_unsigned("==", has_v, ir.Constant(has_v.type, 0))):
            builder.store(acc, res_ptr, align=4)
        return context.get_dummy_value()
    return codegen


block_fma4, block_fma8 = _block_fma(4), _block_fma(8)


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


@njit(fastmath=True, cache=True, nogil=True)
def gemv(x, w, scale, offset, has_offset, center, s0, s1, c0, c1, out):
    """out[:, c0:c1] (c0, c1 multiples of 16) = x[:, blocks s0..s1 of 32 k] @ W for W in a VNNI
    layout w (repack: 4-bit, 256 bytes a block; repack8: 8-bit, 512) with scale and offset
    [K / block, N] (float32, float16 bits or two-level: block_params.py); x rounded to int8 per block
    of 32 by nn_kernels.round_rows. The codes c read as unsigned are the value + 8 (4-bit) or
    + 128 (8-bit): dot - that * sum(xq) is the signed product."""
    m_rows, k = x.shape
    bs = k // param_blocks(scale)
    nb32 = k // XQ_BLOCK
    xq = np.empty((m_rows, k), np.int8)
    xd = np.empty((m_rows, nb32), np.float32)
    xs = np.empty((m_rows, nb32), np.float32)
    xi = np.empty((m_rows, nb32), np.float32)
    round_rows(x, s0, s1, xq, xd, xs, xi)
    x4 = xq.reshape(m_rows * k).view(np.int32)
    size = w.shape[2]
    bias = np.float32(8.0) if size == 256 else np.float32(128.0)
    res = np.zeros(m_rows * GROUP, np.float32)
    n = param_columns(scale)
    for g in range(c0 // GROUP, c1 // GROUP):
        lo = g * GROUP
        res[:] = 0
        for sb in range(s0, s1):
            b = sb * XQ_BLOCK // bs
            at, u_at = b * n + lo, unit_row(scale, b) * n + lo
            for m in range(m_rows):
                w_at, x_at = (g * nb32 + sb) * size, (m * k + sb * XQ_BLOCK) // 4
                if size == 256:
                    block_fma4(res, m * GROUP, w, w_at, x4, x_at, scale, offset, at, u_at, xd[m, sb], bias * xi[m, sb],
                               center * xs[m, sb], xs[m, sb], has_offset)
                else:
                    block_fma8(res, m * GROUP, w, w_at, x4, x_at, scale, offset, at, u_at, xd[m, sb], bias * xi[m, sb],
                               center * xs[m, sb], xs[m, sb], has_offset)
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
