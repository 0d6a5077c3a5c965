"""3 x 3 convolutions (stride 1, padding 1, groups 1) as Winograd F(2 x 2, 3 x 3): 16 products where the
direct kernel makes 36 per 2 x 2 outputs and input channel (Lavin and Gray, "Fast Algorithms for
Convolutional Neural Networks", 2016).

The direct kernels (conv_kernels.py) already run at ~92-96 % of a Zen 5 core's FMA peak on YOLO's 3 x 3
layers, so fewer multiplies is what is left. Per image, a block of tile rows at a time (its buffers in
L2; a tile is 2 x 2 outputs, read from a 4 x 4 window 2 apart):
- the input transform B^T d B of each window, channel by channel, into V [16][C][tiles] (the 16 elements of
  the transformed windows; the block's tiles contiguous, as the GEMM's rows of "w");
- 16 GEMMs M[e] [Cout][tiles] = U[e] [Cout][C] @ V[e] [C][tiles], in matmul_avx512's register tile (ROWS
  output channels x up to 4 vectors of 16 tiles, strided: V's rows are the block's, not a packed panel; the
  last Cout % ROWS channels a tile of their own); U = G g G^T, arranged once per weight;
- the output transform A^T M A plus the bias, 16 tiles a call, the two outputs of each tile row interleaved
  into 32 columns, then the epilogue (conv_spatial's: activation, residual) on the way to the NCHW output.
The transforms' rounding adds ~1e-7 relative to the largest output (tests/test_cpu_conv_winograd.py keeps
a conv within 1e-5 of the direct kernel). F(4 x 4, 3 x 3) would take 36 products for 144, but in float32 it
was 3e-6 to 1.3e-5 off at 16 to 256 channels (NumPy, one 6 x 6 tile): not kept within 1e-5.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import conv_spatial, matmul_avx512
from .conv_spatial import _I32, _I64, _i64, _masked, _splat, _vptr
from .matmul_avx512 import AVAILABLE

with open(os.path.abspath(__file__), "rb") as _f:   # the generated driver's cache key: the intrinsics here
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16]

ROWS = 6            # output channels a GEMM tile (6 x 4 vectors: matmul_avx512's tile)
BLOCK_BYTES = 5 << 17   # V and M of a block of tile rows: 640 KB, in Zen 5's 1 MB L2
# below this many multiply-adds the transforms' and calls' cost is not paid back (one Zen 5 core, CPU ms
# direct -> here, with SiLU: 32 x 10 x 10 -> 32 0.013 -> 0.015, 16 x 40 x 40 -> 16 0.041 -> 0.043, 64 x 3 x 3
# -> 64 0.012 -> 0.020; past it: 128 x 7 x 7 -> 128 0.104 -> 0.064, 16 x 80 x 80 -> 16 0.150 -> 0.122)
MIN_MACS = 1 << 22
MIN_TILES = 64          # tiles a block at the least (past L2 for many channels): a GEMM tile of 4 vectors

# F(2, 3): Y = A^T [(G g G^T) * (B^T d B)] A, a correlation as a convolution layer computes it
G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def fits(kh: int, kw: int, strides, dilations, pads, groups: int, c: int, m: int, oh: int, ow: int,
         min_channels: int) -> bool:
    """A 3 x 3 window, stride and dilation 1, padding 1 on every side, groups 1, at least min_channels input
    and output channels (CpuOptions.winograd_channels; 0: never) and MIN_MACS multiply-adds."""
    return AVAILABLE and min_channels > 0 and kh == kw == 3 and tuple(strides) == (1, 1) and \
        tuple(dilations) == (1, 1) and all(tuple(p) == (1, 1) for p in pads) and groups == 1 and \
        c >= min_channels and m >= min_channels and 9 * c * m * oh * ow >= MIN_MACS


def arrange_weights(w: np.ndarray) -> np.ndarray:
    """w [M, C, 3, 3] as U [16][M rounded up to ROWS][C]: U[4 i + j][m][c] = (G w[m, c] G^T)[i, j] (zero rows
    past M)."""
    m, c = w.shape[:2]
    u = np.einsum("ik,mckl,jl->ijmc", G, np.asarray(w, np.float64), G).reshape(16, m, c)
    out = np.zeros((16, -(-m // ROWS) * ROWS, c), np.float32)
    out[:, :m] = u
    return out


def block_rows(c: int, m: int, ow: int) -> int:
    """Tile rows a block: V [16][C][tiles] and M [16][M][tiles] within BLOCK_BYTES, at least one."""
    tw = (ow + 1) // 2
    return max(1, -(-MIN_TILES // tw), BLOCK_BYTES // (16 * 4 * (c + -(-m // ROWS) * ROWS) * tw))


class Buffers:
    """The scratch of a conv's kernel calls, V and M of a block, as views of one array per thread that every
    Winograd conv shares: each conv's own (~0.6 MB) came to it cold from L3 (YOLO's 32 x 40 x 40 layers with
    SiLU: 0.098 ms alone, 0.129-0.143 in the model; 0.113-0.132 shared)."""

    def __init__(self, c: int, m: int, h: int, w: int):
        tw = (w + 1) // 2
        self.rblock = min(block_rows(c, m, w), (h + 1) // 2)
        self.ntp = -(-self.rblock * tw // 16) * 16
        mp = -(-m // ROWS) * ROWS
        # planes a cache line more than their size apart: 16 KB apart (64 channels of 64 tiles), the input
        # transform's 16 stores a vector went to one L1 set (64 x 40 x 40: 0.136 -> 0.03 ms)
        self.v_size = 16 * (c * self.ntp + 16)
        self.m_size = 16 * (mp * self.ntp + 16) + 16   # (the last tiles' loads read 16 on)
        _Arena.floats = max(_Arena.floats, self.v_size + self.m_size)
        self.views: dict = {}

    def args(self) -> tuple:
        """(V, M, rows a block, tiles' stride) on the calling thread's arena."""
        arena = _ARENA.mine()
        views = self.views.get(threading.get_ident())
        if views is None or views[0] is not arena:
            views = self.views[threading.get_ident()] = (
                arena, (arena[:self.v_size], arena[self.v_size:self.v_size + self.m_size], self.rblock, self.ntp))
        return views[1]


class _Arena(threading.local):
    floats = 0   # the largest a conv built so far needs (a class attribute: every thread's)

    def mine(self) -> np.ndarray:
        array = getattr(self, "array", None)
        if array is None or array.size < _Arena.floats:
            array = self.array = np.zeros(_Arena.floats, np.float32)
        return array


_ARENA = _Arena()

# -- the transforms, 16 tiles (a row's consecutive ones) at a time ----------------------------------------

def _lanes(builder, first, lo, hi, extra=None):
    """<16 x i1>: lo <= first + lane < hi (i64s), and extra (i1) where given."""
    i64x = ir.VectorType(_I64, 16)
    lane = builder.add(_splat(builder, first, i64x), ir.Constant(i64x, list(range(16))))
    mask = builder.and_(builder.icmp_signed(">=", lane, _splat(builder, lo, i64x)),
                        builder.icmp_signed("<", lane, _splat(builder, hi, i64x)))
    if extra is not None:
        mask = builder.and_(mask, _splat(builder, extra, ir.VectorType(ir.IntType(1), 16)))
    return mask


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


_EVEN, _ODD = list(range(0, 32, 2)), list(range(1, 32, 2))


@intrinsic
def input_tiles(typingctx, v, v_at, plane, valid, x, x_at, w, col0, row0, h):
    """For the 16 tiles l < valid from column col0 = 2 tx0 - 1, row row0 = 2 ty - 1 of a channel of x [H, W]
    (x_at: the flat index of (row0, col0), outside x or not): v[v_at + (4 i + j) plane + l] = (B^T d B)[i, j]
    of the window d = x[row0 + k, col0 + 2 l + c] (k, c < 4; zero outside x)."""
    sig = types.void(v, v_at, plane, valid, x, x_at, w, col0, row0, h)

    def codegen(context, builder, signature, args):
        va = context.make_array(signature.args[0])(context, builder, args[0])
        xa = context.make_array(signature.args[4])(context, builder, args[4])
        v_at, plane, valid, x_at, w, col0, row0, h = (_i64(builder, args[i]) for i in (1, 2, 3, 5, 6, 7, 8, 9))
        load, store = _masked(builder)
        c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
        cols = []   # per window row k: its columns 2 l + c, c < 4, as four vectors over l
        for k in range(4):
            row = builder.add(row0, c64(k))
            inside = builder.and_(builder.icmp_signed(">=", row, c64(0)), builder.icmp_signed("<", row, h))
            at = builder.add(x_at, builder.mul(w, c64(k)))
            halves = []
            for off in (0, 2):
                pair = []
                for half in (0, 16):
                    first = builder.add(col0, c64(off + half))
                    mask = _lanes(builder, first, c64(0), w, inside)
                    pair.append(load(_vptr(builder, xa.data, builder.add(at, c64(off + half))), mask))
                halves.append(pair)
            (p0, p1), (q0, q1) = halves
            cols.append([_shuffle(builder, p0, p1, _EVEN), _shuffle(builder, p0, p1, _ODD),
                         _shuffle(builder, q0, q1, _EVEN), _shuffle(builder, q0, q1, _ODD)])

        def bt(d):   # B^T's rows applied to d0..d3
            return [builder.fsub(d[0], d[2]), builder.fadd(d[1], d[2]), builder.fsub(d[2], d[1]),
                    builder.fsub(d[1], d[3])]
        vertical = [bt([cols[k][c] for k in range(4)]) for c in range(4)]   # [c][i]
        mask = _lanes(builder, c64(0), c64(0), valid)
        for i in range(4):
            row = bt([vertical[c][i] for c in range(4)])
            for j in range(4):
                at = builder.add(v_at, builder.mul(plane, c64(4 * i + j)))
                store(row[j], _vptr(builder, va.data, at), mask)
        return context.get_dummy_value()
    return sig, codegen


@functools.cache
def output_tiles_for(key: str):
    """out_tiles(out, out_at, valid, ow, two, m, p, p_at, plane, bias, ops): for the 16 tiles from p_at of
    M (p, planes `plane` apart), the 2 x 2 outputs A^T M A + bias, then the epilogue (steps of `key`, channel
    m, full operands at the outputs' own indices), stored to out[out_at + 2 l + b] and (two: the second row
    is in the output) out[out_at + ow + 2 l + b], columns 2 l + b < valid."""
    steps, operands = conv_spatial.SPECS[key]

    @intrinsic
    def out_tiles(typingctx, out, out_at, valid, ow, two, m, p, p_at, plane, bias, ops):
        sig = types.void(out, out_at, valid, ow, two, m, p, p_at, plane, bias, ops)

        def codegen(context, builder, signature, args):
            oa = context.make_array(signature.args[0])(context, builder, args[0])
            pa = context.make_array(signature.args[6])(context, builder, args[6])
            c64 = lambda n: ir.Constant(_I64, n)  # noqa: E731
            out_at, valid, ow, m_v, p_at, plane = (_i64(builder, args[i]) for i in (1, 2, 3, 5, 7, 8))
            two = builder.icmp_signed("!=", _i64(builder, args[4]), c64(0))
            mv = [[builder.load(_vptr(builder, pa.data, builder.add(p_at, builder.mul(plane, c64(4 * i + j)))), align=4)
                   for j in range(4)] for i in range(4)]
            s0 = [builder.fadd(builder.fadd(mv[0][j], mv[1][j]), mv[2][j]) for j in range(4)]
            s1 = [builder.fsub(builder.fsub(mv[1][j], mv[2][j]), mv[3][j]) for j in range(4)]
            b = _splat(builder, args[9])
            _, store = _masked(builder)
            for dy, s in enumerate((s0, s1)):
                y0 = builder.fadd(builder.fadd(builder.fadd(s[0], s[1]), s[2]), b)
                y1 = builder.fadd(builder.fsub(builder.fsub(s[1], s[2]), s[3]), b)
                row_at = builder.add(out_at, ow) if dy else out_at
                for half, lanes in ((0, list(range(8))), (16, list(range(8, 16)))):
                    value = _shuffle(builder, y0, y1, [q for lane in lanes for q in (lane, 16 + lane)])
                    mask = _lanes(builder, c64(half), c64(0), valid, two if dy else None)
                    at = builder.add(row_at, c64(half))
                    value = conv_spatial._emit_epilogue(context, builder, steps, operands, signature.args[10], args[10],
                                                        value, m_v, at, mask)
                    store(value, _vptr(builder, oa.data, at), mask)
            return context.get_dummy_value()
        return sig, codegen
    return out_tiles


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_winograd import ROWS, input_tiles, output_tiles_for
from ingot.backends.cpu.matmul_avx512 import tile_for

tile4, tile3, tile2, tile1 = (tile_for(ROWS, v, True) for v in (4, 3, 2, 1))
tile1_twice = tile_for(2 * ROWS, 1, True)
REST = {rest}   # the output channels past a multiple of ROWS: tiles of that many rows
{rest_tiles}
out_tiles = output_tiles_for({key!r})


@njit(cache=True, nogil=True)
def transform_in(x, ty0, ty1, tw, v, ntp):
    # v [16][C][ntp] (flat): B^T d B of each window d (rows 2 ty - 1 .. 2 ty + 2, columns 2 tx - 1 .. 2 tx + 2,
    # zero outside x), tile t = (ty - ty0) tw + tx
    c, h, w = x.shape
    xf = x.reshape(c * h * w)
    plane = c * ntp + 16
    for ci in range(c):
        for ty in range(ty0, ty1):
            for tx0 in range(0, tw, 16):
                input_tiles(v, ci * ntp + (ty - ty0) * tw + tx0, plane, tw - tx0, xf,
                            (ci * h + 2 * ty - 1) * w + 2 * tx0 - 1, w, 2 * tx0 - 1, 2 * ty - 1, h)


@njit(cache=True, nogil=True)
def gemm(u, u_at, c, m, v, v_at, ntp, mo, mo_at, nt):
    # mo[mo_at + co ntp + t] = sum over ci of u[u_at + co c + ci] * v[v_at + ci ntp + t], co < m, t < nt
    full = m - REST
    for q in range(0, nt, 64):
        left = nt - q
        if left <= 16:   # one vector of tiles: twice the rows, else 6 FMA chains for a 4-cycle latency
            for r0 in range(0, full, 2 * ROWS):
                o, ua, va = mo_at + r0 * ntp + q, u_at + r0 * c, v_at + q
                if r0 + 2 * ROWS <= full:
                    tile1_twice(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
                else:
                    tile1(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
{rest_one}
            continue
        for r0 in range(0, full, ROWS):
            o, ua, va = mo_at + r0 * ntp + q, u_at + r0 * c, v_at + q
            if left > 48:
                tile4(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
            elif left > 32:
                tile3(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
            elif left > 16:
                tile2(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
            else:
                tile1(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
{rest_many}


@njit(cache=True, nogil=True)
def transform_out(mo, mp, ntp, ty0, ty1, tw, bias, out, ops):
    # out [M, OH, OW]: A^T M A + bias of each tile, then the epilogue
    m, oh, ow = out.shape
    of = out.reshape(m * oh * ow)
    plane = mp * ntp + 16
    for co in range(m):
        b = bias[co]
        for ty in range(ty0, ty1):
            for tx0 in range(0, tw, 16):
                out_tiles(of, (co * oh + 2 * ty) * ow + 2 * tx0, ow - 2 * tx0, ow, 2 * ty + 1 < oh, co, mo,
                          co * ntp + (ty - ty0) * tw + tx0, plane, b, ops)


@njit(cache=True, nogil=True)
def kernel(x, u, bias, out, ops, v, mo, rblock, ntp):
    # x [C, H, W], u [16][Mp][C], bias [M], out [M, H, W]
    c = x.shape[0]
    mp = u.shape[1]
    oh, ow = out.shape[1], out.shape[2]
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    uf = u.reshape(16 * mp * c)
    for ty0 in range(0, th, rblock):
        ty1 = min(th, ty0 + rblock)
        nt = (ty1 - ty0) * tw
        transform_in(x, ty0, ty1, tw, v, ntp)
        for e in range(16):
            gemm(uf, e * mp * c, c, out.shape[0], v, e * (c * ntp + 16), ntp, mo, e * (mp * ntp + 16), nt)
        transform_out(mo, mp, ntp, ty0, ty1, tw, bias, out, ops)
"""


_REST_ONE = """            if REST:
                o, ua, va = mo_at + full * ntp + q, u_at + full * c, v_at + q
                rest1(mo, o, ntp, u, ua, c, v, va, ntp, c, left)"""
_REST_MANY = """        if REST:
            o, ua, va = mo_at + full * ntp + q, u_at + full * c, v_at + q
            if left > 48:
                rest4(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
            elif left > 32:
                rest3(mo, o, ntp, u, ua, c, v, va, ntp, c, left)
            else:
                rest2(mo, o, ntp, u, ua, c, v, va, ntp, c, left)"""


def driver(steps, operands, m: int):
    """The numba kernel(x, u, bias, out, ops, *Buffers.args()) with this epilogue (steps may be empty), for
    m output channels (the last m % ROWS in a tile of their own: as zero rows of a whole tile they cost
    16 x 80 x 80 -> 16 and 32 x 40 x 40 -> 32 an eighth more multiplies)."""
    key = conv_spatial.steps_key(steps, operands)
    conv_spatial.epilogue_for(key, steps, operands)
    rest = m % ROWS
    tiles = "rest4, rest3, rest2, rest1 = (tile_for(REST, v, True) for v in (4, 3, 2, 1))"
    source = _DRIVER.format(key=key, rest=rest, rest_tiles=tiles if rest else "", rest_one=_REST_ONE if rest else "",
                            rest_many=_REST_MANY if rest else "")
    return conv_spatial.load(f"# winograd {REVISION}, avx512 matmul {matmul_avx512.REVISION}\n" + source,
                             "kernel", "cpu_conv_winograd")
