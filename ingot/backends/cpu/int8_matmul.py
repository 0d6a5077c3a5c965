"""Integer matmuls on AVX-512 VNNI: the FUSED "integer_matmul" op (passes/fuse_integer_matmul.py), ONNX's
MatMulInteger after DynamicQuantizeLinear (and QLinearMatMul's sums), in int32 as the spec defines them.

The importer writes sum_k (x - x_zero)(w - w_zero) as a float32 matmul of whole numbers against the
8-bit weight (exact, onnx_integer.py); that ran the float GEMV kernel per row, 0.22 ms for 16 x 512 x
384, where onnxruntime's int8 GEMM takes 0.05. Here x stays 8-bit and one VPDPBUSD multiplies 64
unsigned bytes of x by 64 signed bytes of the weight, summing each four into 16 int32 lanes
(vnni.py's instruction and weight layout `repack8`: per 16 output columns and 32 k, 512 bytes).

With xu = x as uint8 (x + 128 for int8 x) and ws = w as int8 (w - 128 for uint8 w), a = 128 [int8 x] +
x_zero and b[n] = 128 [uint8 w] - w_zero[n], every term is an integer:
    sum_k (x - x_zero)(w - w_zero) = D + b[n] * Rx[m] - a * Cw[n] - K * a * b[n],
D = xu @ ws (VPDPBUSD: exact, no int16 step), Rx the rows' sums of xu, Cw the columns' sums of ws.
"""
from __future__ import annotations

import copy
import weakref

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ... import dtypes as dt
from ...ir import Node, Op
from ...ops import quant as quant_ops
from . import int8_amx, kernels, team, vnni

ROWS = 4                 # x's rows are padded to a multiple of this (the last pass of _tile)
BLOCK = 32               # k per weight block (vnni.repack8)
AVAILABLE = vnni.AVAILABLE
EXACT_K = 512           # k per float32 matmul without VNNI: 255 * 128 * 512 < 2**24, every sum exact


WIDE = 8                 # rows of x per pass of _tile (8 int32 accumulators in registers; then ROWS)
PREFETCH = 8192          # bytes of weight ahead that _tile asks for (T5's GEMMs stream theirs from L3)


def _tile_of(rows: int):
    """_tile for `rows` rows of x and one group of 16 output columns."""
    @intrinsic
    def _tile(typingctx, out, out_at, out_stride, w, w_at, nb, x4, x_at, x_stride, rx, rx_at, b, col, col_at, scale,
              valid):
        """For r < min(rows, valid), t < 16: out[out_at + r * out_stride + t] = D + b[col_at + t] * rx[rx_at + r] +
        col[col_at + t] in int32 (wrapping, as the int64 sum cast to int32 does), times scale where out is
        float32 (float32(total) * scale); D the dot product over nb weight blocks (int8, vnni.repack8 layout,
        512 bytes each, the first at w_at) with row r of x (uint8 as an int32 view: x4[x_at + r * x_stride ..],
        8 int32 a block). The k loop runs inside: the accumulators stay in registers, each weight block is
        read once for all rows, PREFETCH bytes ahead asked for; the module docstring's terms join them
        there and the row leaves as its final values (an int32 D in memory and a scalar epilogue took 37 %
        of a 16 x 512 x 1024 product); nb >= 1."""
        sig = types.void(out, out_at, out_stride, w, w_at, nb, x4, x_at, x_stride, rx, rx_at, b, col, col_at, scale, valid)
        scaled = isinstance(out.dtype, types.Float)

        def codegen(context, builder, signature, args):
            (out_v, out_at_v, out_stride_v, w_v, w_at_v, nb_v, x_v, x_at_v, stride_v, rx_v, rx_at_v, b_v, col_v,
             col_at_v, scale_v, valid_v) = args
            arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
            oa, wa, xa, rxa, ba, ca = arr(0, out_v), arr(3, w_v), arr(6, x_v), arr(9, rx_v), arr(11, b_v), arr(12, col_v)
            i32, index = ir.IntType(32), w_at_v.type
            v16, f16x = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16)
            vdp = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(v16, [v16, v16, v16]))
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]))
            zeros = ir.Constant(v16, [0] * 16)
            const = lambda v: ir.Constant(index, v)  # noqa: E731
            entry = builder.block
            loop = builder.append_basic_block("k_blocks")
            done = builder.append_basic_block("k_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            blk = builder.phi(index)
            sums = [builder.phi(v16) for _ in range(rows)]
            blk.add_incoming(const(0), entry)
            for phi in sums:
                phi.add_incoming(zeros, entry)
            w_base = builder.add(w_at_v, builder.mul(blk, const(512)))
            x_base = builder.add(x_at_v, builder.mul(blk, const(8)))
            row_at = [builder.add(x_base, builder.mul(stride_v, const(r))) for r in range(rows)]
            for line in range(8):   # (read, into L2 (prefetcht1: 5-10 % faster from memory than t0), data)
                ahead = builder.gep(wa.data, [builder.add(w_base, const(PREFETCH + 64 * line))])
                builder.call(prefetch, [builder.bitcast(ahead, byte_ptr), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
            new = list(sums)
            for v in range(8):
                weight = builder.load(builder.bitcast(builder.gep(wa.data, [builder.add(w_base, const(64 * v))]),
                                                      v16.as_pointer()), align=1)
                for r in range(rows):
                    x4 = builder.load(builder.gep(xa.data, [builder.add(row_at[r], const(v))]), align=4)
                    new[r] = builder.call(vdp, [new[r], vnni.splat(builder, x4, v16), weight])   # unsigned x, signed w
            following = builder.add(blk, const(1))
            blk.add_incoming(following, builder.block)
            for phi, value in zip(sums, new):
                phi.add_incoming(value, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, nb_v), loop, done)
            builder.position_at_end(done)
            vector = lambda a, at, ty: builder.load(builder.bitcast(builder.gep(a.data, [at]), ty.as_pointer()), align=4)  # noqa: E731
            b_vec, col_vec = vector(ba, col_at_v, v16), vector(ca, col_at_v, v16)
            scale_vec = vnni.splat(builder, scale_v, f16x) if scaled else None
            for r in range(rows):
                if r:   # rows past valid are padding: not stored
                    store = builder.append_basic_block(f"row_{r}")
                    after = builder.append_basic_block(f"after_{r}")
                    builder.cbranch(builder.icmp_signed("<", const(r), valid_v), store, after)
                    builder.position_at_end(store)
                rx_vec = vnni.splat(builder, builder.load(builder.gep(rxa.data, [builder.add(rx_at_v, const(r))]), align=4), v16)
                total = builder.add(builder.add(new[r], builder.mul(b_vec, rx_vec)), col_vec)
                value = builder.fmul(builder.sitofp(total, f16x), scale_vec) if scaled else total
                at = builder.add(out_at_v, builder.mul(out_stride_v, const(r)))
                builder.store(value, builder.bitcast(builder.gep(oa.data, [at]), value.type.as_pointer()), align=4)
                if r:
                    builder.branch(after)
                    builder.position_at_end(after)
            return context.get_dummy_value()
        return sig, codegen
    return _tile


_tile_wide, _tile_rows = _tile_of(WIDE), _tile_of(ROWS)


@njit(cache=True, nogil=True)
def _tiles(out, w, g, nb, x4, stride, mp, m_rows, rx, b, col, scale):
    """Group g's 16 columns of every row into out (flat, 16 columns a row), WIDE rows a pass, then ROWS."""
    wide = mp - mp % WIDE
    for r0 in range(0, wide, WIDE):
        _tile_wide(out, r0 * 16, 16, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16, scale, m_rows - r0)
    for r0 in range(wide, mp, ROWS):
        _tile_rows(out, r0 * 16, 16, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16, scale, m_rows - r0)


@njit(cache=True, nogil=True)
def vnni_gemm(xu, w, m_rows, n, b, a, cw, k, scale, scaled, out_f, out_i):
    """out[m, t] = D[m, t] + b[t] * Rx[m] - a * Cw[t] - k * a * b[t] for m < m_rows, t < n (the module
    docstring's terms; D = xu @ w by VPDPBUSD, Rx the rows' sums of xu), wrapped to int32 into out_i,
    or float32(that) * scale into out_f where scaled (the other out unused; both C-contiguous [m_rows,
    n]). xu [Mp, Kp] uint8, Mp a multiple of ROWS and Kp of BLOCK, padding zero; w [Np / 16, Kp / 32,
    512] int8 bytes (vnni.repack8 with flip 0); b [Np] int32 (zero past n), cw [n] int64. The terms
    join each tile's sums in registers (_tile): no int32 D in memory."""
    mp, kp = xu.shape
    nb = kp // BLOCK
    groups = w.shape[0]
    # (int32 arithmetic wraps as the int64 sums cast to int32 do)
    rx, col = int8_amx.terms(xu, m_rows, n, groups * 16, b, a, cw, k)
    x4 = xu.reshape(mp * kp).view(np.int32)
    stride = kp // 4
    whole = n // 16
    wide = mp - mp % WIDE
    if scaled:
        of = out_f.reshape(out_f.size)
        for g in range(whole):
            for r0 in range(0, wide, WIDE):
                _tile_wide(of, r0 * n + g * 16, n, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16,
                           scale, m_rows - r0)
            for r0 in range(wide, mp, ROWS):
                _tile_rows(of, r0 * n + g * 16, n, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16,
                           scale, m_rows - r0)
        if whole < groups:   # the last columns through a [Mp, 16] scratch
            part = np.empty(mp * 16, np.float32)
            _tiles(part, w, whole, nb, x4, stride, mp, m_rows, rx, b, col, scale)
            for m in range(m_rows):
                for t in range(whole * 16, n):
                    out_f[m, t] = part[m * 16 + t - whole * 16]
    else:
        oi = out_i.reshape(out_i.size)
        for g in range(whole):
            for r0 in range(0, wide, WIDE):
                _tile_wide(oi, r0 * n + g * 16, n, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16,
                           scale, m_rows - r0)
            for r0 in range(wide, mp, ROWS):
                _tile_rows(oi, r0 * n + g * 16, n, w, g * nb * 512, nb, x4, r0 * stride, stride, rx, r0, b, col, g * 16,
                           scale, m_rows - r0)
        if whole < groups:
            part_i = np.empty(mp * 16, np.int32)
            _tiles(part_i, w, whole, nb, x4, stride, mp, m_rows, rx, b, col, scale)
            for m in range(m_rows):
                for t in range(whole * 16, n):
                    out_i[m, t] = part_i[m * 16 + t - whole * 16]


@njit(cache=True, nogil=True)
def vnni_matmul(x, flip, x_zero, s0, s1, scaled, xu, w, n, b, cw, out_f, out_i):
    """IntegerMatmul's VNNI path in one call (a T5 runs 56 of them: the Python around vnni_gemm cost
    ~8 us each): x [M, K] uint8 bytes (int8 x as its bytes, flip set: x + 128) into the zero-padded
    buffer xu, a = x_zero (+ 128 with flip), scale = float32(s0 * s1) (the body's product of two
    float32 scalars) (int8_amx.unsigned_rows), then vnni_gemm into out_f (scaled) or out_i."""
    a, scale = int8_amx.unsigned_rows(x, flip, x_zero, s0, s1, xu)
    vnni_gemm(xu, w, x.shape[0], n, b, a, cw, np.int64(x.shape[1]), scale, scaled, out_f, out_i)


@njit(cache=True, nogil=True)
def _finish(d, xu, m_rows, b, a, cw, k, n, out):
    """out[m, :n] = d + b * rx[m] - a * cw - k * a * b, rx[m] the sum of row m of xu; in int64, wrapped
    to int32 as the sums are (the exact float32 path's finish)."""
    for m in range(m_rows):
        r = np.int64(0)
        for t in range(xu.shape[1]):
            r += np.int64(xu[m, t])
        for t in range(n):
            out[m, t] = np.int32(np.int64(d[m, t]) + np.int64(b[t]) * r - a * np.int64(cw[t]) - k * a * np.int64(b[t]))


class IntegerMatmul:
    """sum_k (x - x_zero)(w - w_zero[n]) for a constant 8-bit weight w [K, N], x [..., K] int8 or uint8
    fed at run time with a scalar zero point. Without VNNI (vnni=False) D runs as float32 matmuls of
    at most EXACT_K k each, exact (255 * 128 * 512 < 2**24), summed in int64; with VNNI and AMX-INT8
    (tiles=True) int8_amx.MIN_ROWS rows or more run on the tiles (int8_amx.py), equal bit for bit."""

    def __init__(self, w: np.ndarray, w_zero: np.ndarray, vnni_kernel: bool = AVAILABLE, tiles: bool = True):
        k, n = w.shape
        self.k, self.n, self.vnni = k, n, vnni_kernel
        self.amx = vnni_kernel and tiles and int8_amx.available()   # MIN_ROWS rows and more on AMX's tiles
        k_block = int8_amx.K_BLOCK if self.amx else BLOCK
        self.kp, self.np_ = -(-k // k_block) * k_block, -(-n // 16) * 16
        ws = w.astype(np.int16) - (128 if w.dtype == np.uint8 else 0)           # as int8
        if vnni_kernel:
            padded = np.zeros((self.kp, self.np_), np.int8)
            padded[:k, :n] = ws
            self.w = vnni.repack8(padded, 0)
            if self.amx:
                self.w_amx = int8_amx.arrange(padded[:, :n])
                self.scratch = np.zeros(1024, np.int32)
        else:
            self.w = ws.astype(np.float32)
        self.cw = ws.astype(np.int64).sum(axis=0)                               # Cw
        self.b = (128 if w.dtype == np.uint8 else 0) - np.broadcast_to(w_zero.astype(np.int64).reshape(-1), (n,))
        self.b = np.ascontiguousarray(self.b)
        self.b32 = np.zeros(self.np_, np.int32)                                 # vnni_gemm's b: int32, padded
        self.b32[:n] = self.b
        self.buffers: dict = {}
        self.unused = (np.empty((1, 1), np.float32), np.empty((1, 1), np.int32))   # vnni_gemm's other output

    def _buffer(self, m: int) -> np.ndarray:
        """x's rows as uint8, zero-padded to [a multiple of ROWS (AMX: of int8_amx.ROW_BLOCK), Kp] (the padding
        stays zero)."""
        step = int8_amx.ROW_BLOCK if self.amx and m >= int8_amx.MIN_ROWS else ROWS   # (vnni_gemm: fewer than ROWS past m)
        mp = -(-m // step) * step
        xu = self.buffers.get(mp)
        if xu is None:
            xu = self.buffers[mp] = np.zeros((mp, self.kp), np.uint8)
        return xu

    def scaled(self, x: np.ndarray, x_zero: np.ndarray, s0: np.ndarray, s1: np.ndarray, out: np.ndarray | None = None):
        """float32(sums) * float32(s0 * s1), x_zero, s0 and s1 one-value arrays: the fused op's epilogue
        (VNNI: one kernel call)."""
        if not self.vnni:
            scale = np.float32(np.float32(np.asarray(s0).reshape(-1)[0]) * np.float32(np.asarray(s1).reshape(-1)[0]))
            return self(x, x_zero, out, scale)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        result = np.empty((m, self.n), np.float32) if out is None else out.reshape(m, self.n)
        if self.amx and m >= int8_amx.MIN_ROWS:
            int8_amx.amx_matmul(x2.view(np.uint8), x2.dtype == np.int8, x_zero, s0, s1, True, self._buffer(m), self.w_amx,
                                self.n, self.b32, self.cw, result, self.unused[1], self.scratch)
        else:
            vnni_matmul(x2.view(np.uint8), x2.dtype == np.int8, x_zero, s0, s1, True, self._buffer(m), self.w, self.n,
                        self.b32, self.cw, result, self.unused[1])
        return result.reshape(lead + (self.n,)) if out is None else out

    def __call__(self, x: np.ndarray, x_zero, out: np.ndarray | None = None, scale=None) -> np.ndarray:
        """The int32 sums, or with scale (a float32) float32(sums) * scale."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xu = self._buffer(m)
        mp = xu.shape[0]
        if x2.dtype == np.int8:
            np.bitwise_xor(x2.view(np.uint8), np.uint8(0x80), out=xu[:m, :k])  # x + 128
            a = 128 + int(np.asarray(x_zero).reshape(-1)[0])
        else:
            xu[:m, :k] = x2
            a = int(np.asarray(x_zero).reshape(-1)[0])
        dtype = np.int32 if scale is None else np.float32
        result = np.empty((m, self.n), dtype) if out is None else out.reshape(m, self.n)
        if self.vnni:
            other = self.unused[dtype == np.float32]
            outs = (result if scale is not None else other, result if scale is None else other)
            if self.amx and m >= int8_amx.MIN_ROWS:
                int8_amx.amx_gemm(xu, self.w_amx, m, self.n, self.b32, np.int64(a), self.cw, np.int64(k),
                                  np.float32(scale or 0.0), scale is not None, *outs, self.scratch)
            else:
                vnni_gemm(xu, self.w, m, self.n, self.b32, np.int64(a), self.cw, np.int64(k), np.float32(scale or 0.0),
                          scale is not None, *outs)
            return result.reshape(lead + (self.n,)) if out is None else out
        xf = xu[:, :k].astype(np.float32)
        total = np.zeros((mp, self.n), np.int64)
        for k0 in range(0, k, EXACT_K):
            total += (xf[:, k0:k0 + EXACT_K] @ self.w[k0:k0 + EXACT_K]).astype(np.int64)
        d = total.astype(np.int32)   # |D| < 2**31 for K < 65536
        sums = np.empty((m, self.n), np.int32) if scale is not None else result
        _finish(d, xu, m, self.b, np.int64(a), self.cw, np.int64(k), self.n, sums)
        if scale is not None:   # the rounding cast(sum, float32) * scale has
            np.multiply(sums.astype(np.float32), np.float32(scale), out=result)
        return result.reshape(lead + (self.n,)) if out is None else out


def reference(x: np.ndarray, x_zero, w: np.ndarray, w_zero) -> np.ndarray:
    """The NumPy reference: sum_k (x - x_zero)(w - w_zero) in int64, wrapped to int32."""
    xs = x.astype(np.int64) - np.asarray(x_zero, np.int64).reshape(())
    ws = w.astype(np.int64) - np.asarray(w_zero, np.int64).reshape(-1)
    return (xs @ ws).astype(np.int32)


# -- the FUSED op's lowering ---------------------------------------------------------------------------

def operands(body) -> dict | None:
    """The fused op's input index of x, x_zero, w, scale and w_zero (None where absent) read off its body:
    cast(x) [- cast(x_zero)] -> quantized_matmul(., w, scale [, w_zero]) -> cast int32; None if it is not that."""
    (mm,) = body.find(Op.QUANTIZED_MATMUL) or (None,)
    if mm is None or any(s.op != Op.PLACEHOLDER for s in mm.src[1:]):
        return None
    xs = mm.src[0]
    zero = None
    if xs.op == Op.SUB:
        xs, z = xs.src
        z = z.src[0] if z.op == Op.CAST else z      # an 8-bit zero point, or a whole float32 constant
        if z.op != Op.PLACEHOLDER:
            return None
        zero = z.attrs["param"]
    if xs.op != Op.CAST or xs.src[0].op != Op.PLACEHOLDER:
        return None
    params = [s.attrs["param"] for s in mm.src[1:]]
    return {"x": xs.src[0].attrs["param"], "x_zero": zero, "w": params[0], "scale": params[1],
            "w_zero": params[2] if mm.attrs.get("has_zero_point") else None}


def scale_operands(body) -> tuple[int, ...] | None:
    """The params whose product scales the float32 result: () for the int32 sums, (s,) or (a, b) for the
    epilogue cast(sum, float32) * s [s = a * b] (passes/fuse_integer_matmul.py); None if neither."""
    (result,) = body.outputs
    if result.op == Op.CAST and result.dtype.name == "int32":
        return ()
    if result.op != Op.MUL or result.dtype.name != "float32":
        return None
    cast, s = result.src if result.src[0].op == Op.CAST else result.src[::-1]
    if cast.op != Op.CAST or cast.src[0].op != Op.CAST or cast.src[0].dtype.name != "int32":
        return None
    if s.op == Op.PLACEHOLDER:
        return (s.attrs["param"],)
    if s.op == Op.MUL and all(t.op == Op.PLACEHOLDER for t in s.src):
        return tuple(t.attrs["param"] for t in s.src)
    return None


def integer_matmul_lowering(node: Node, out):
    """The FUSED "integer_matmul" op (VNNI, else exact float32 chunks); None where the weight is not a constant.
    The pass checked that the scale is 1 and the zero points whole; the first run checks the values."""
    index = operands(node.attrs["body"])
    scales = scale_operands(node.attrs["body"])
    if index is None or scales is None or node.src[index["w"]].op != Op.CONSTANT:
        return None
    body = node.attrs["body"]
    state: dict = {}

    def step(*inputs):
        kernel = state.get("kernel")
        if kernel is None:
            w, scale = inputs[index["w"]], np.asarray(inputs[index["scale"]])
            zero = np.zeros(1) if index["w_zero"] is None else np.asarray(inputs[index["w_zero"]], np.float64)
            exact = np.all(scale == 1) and np.all(zero == np.round(zero)) and zero.size in (1, w.shape[1]) and \
                scale.size in (1, w.shape[1])
            kernel = state["kernel"] = IntegerMatmul(w, zero.astype(np.int64)) if exact else False
        if kernel is False:
            result = body.evaluate(inputs)[0]
        else:
            x_zero = inputs[index["x_zero"]] if index["x_zero"] is not None else NO_ZERO
            if not scales:
                return kernel(inputs[index["x"]], x_zero, out)
            # a float32 product, as the body's mul of two float32 scalars rounds it
            return kernel.scaled(inputs[index["x"]], np.asarray(x_zero), np.asarray(inputs[scales[0]], np.float32),
                                 np.asarray(inputs[scales[1]], np.float32) if len(scales) == 2 else ONE, out)
        if out is not None:
            out[...] = result
            return out
        return result
    return step


NO_ZERO, ONE = np.zeros(1, np.uint8), np.ones(1, np.float32)
FUSED_LOWERINGS = {"integer_matmul": integer_matmul_lowering}


# -- float x times an 8-bit weight (per column scale and zero point) ---------------------------------------
#
# ONNX files that store int8 weights for float activations (a Cast and a Mul, or DequantizeLinear per
# tensor or channel) reach quantized_matmul with one block along k. Past 16 rows the generic path
# dequantizes tiles of W on every run and multiplies them with BLAS (22 x 384 x 1536: 0.38 ms); here the
# weight's 16 bytes of each k widen to 16 floats in registers (less the column's zero point, exact) and
# serve 12 (or 8, 4) rows of x by fused multiply-adds, the sums in registers over the whole k loop; the
# scale and bias apply once per output.

FROWS = 8     # x's rows are padded to a multiple of this (passes of 12, 8 or 4 rows: _fma_block)
FK = 16       # x's k is padded to a multiple of this


def _fma_block_of(rows: int):
    """_fma_block for `rows` rows: the whole k loop inside one intrinsic, the rows' sums in registers."""
    @intrinsic
    def _fma_block(typingctx, acc, w, kp, zero, zero_at, x, x_at, x_stride):
        """acc[16 r : 16 r + 16] = sum over k < kp of x[x_at + r * x_stride + k] * (w[16 k : + 16] - zero[zero_at :
        + 16]) for r < rows: w int8 (one group of 16 columns, k-major), zero int32, x and acc float32. Each k's
        16 weights are widened once for all rows; the same sums, in the same order, as one multiply-add a k would make."""
        sig = types.void(acc, w, kp, zero, zero_at, x, x_at, x_stride)

        def codegen(context, builder, signature, args):
            acc_v, w_v, kp_v, z_v, z_at_v, x_v, x_at_v, stride_v = args
            arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
            aa, wa, za, xa = arr(0, acc_v), arr(1, w_v), arr(3, z_v), arr(5, x_v)
            i8, i32, f32, index = ir.IntType(8), ir.IntType(32), ir.FloatType(), kp_v.type
            b16, v16, f16x = ir.VectorType(i8, 16), ir.VectorType(i32, 16), ir.VectorType(f32, 16)
            const = lambda v: ir.Constant(index, v)  # noqa: E731
            zero_point = builder.load(builder.bitcast(builder.gep(za.data, [z_at_v]), v16.as_pointer()), align=4)
            row_at = [builder.add(x_at_v, builder.mul(stride_v, const(r))) for r in range(rows)]
            entry = builder.block
            loop = builder.append_basic_block("k_loop")
            done = builder.append_basic_block("k_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(index)
            sums = [builder.phi(f16x) for _ in range(rows)]
            k.add_incoming(const(0), entry)
            for phi in sums:
                phi.add_incoming(ir.Constant(f16x, [0.0] * 16), entry)
            raw = builder.load(builder.bitcast(builder.gep(wa.data, [builder.mul(k, const(16))]), b16.as_pointer()), align=1)
            weight = builder.sitofp(builder.sub(builder.sext(raw, v16), zero_point), f16x)
            new = []
            for r in range(rows):
                xv = builder.load(builder.gep(xa.data, [builder.add(row_at[r], k)]), align=4)
                new.append(builder.fadd(sums[r], builder.fmul(vnni.splat(builder, xv, f16x), weight, flags=("contract",)),
                                        flags=("contract",)))
            following = builder.add(k, const(1))
            k.add_incoming(following, builder.block)
            for phi, value in zip(sums, new):
                phi.add_incoming(value, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, kp_v), loop, done)
            builder.position_at_end(done)
            for r in range(rows):
                ptr = builder.bitcast(builder.gep(aa.data, [ir.Constant(ir.IntType(64), 16 * r)]), f16x.as_pointer())
                builder.store(new[r], ptr, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return _fma_block


_fma_block12, _fma_block8, _fma_block4 = _fma_block_of(12), _fma_block_of(8), _fma_block_of(4)


@njit(cache=True, nogil=True)
def float_gemm(x, w, zero, scale, bias, has_bias, m_rows, n, g0, g1, out):
    """out[:m_rows, :n] = x @ ((w - zero) * scale (+ bias)), the bias added to every weight of its column
    (dequantize's form): x [Mp, Kp] float32 (Mp a multiple of FROWS, Kp of FK, padding zero), w [Np / 16,
    Kp, 16] int8, zero [Np] int32, scale and bias [Np] float32; the groups of 16 columns g0..g1."""
    mp, kp = x.shape
    xf = x.reshape(mp * kp)
    sums = np.zeros(mp, np.float32)
    if has_bias:
        for m in range(m_rows):
            sums[m] = x[m].sum()
    acc = np.zeros(12 * 16, np.float32)
    for g in range(g0, g1):
        lo = g * 16
        wg = w[g].reshape(kp * 16)
        r0 = 0
        while r0 < mp:   # 12 rows a pass while 12 remain, then 8 or 4 (Mp is a multiple of 8)
            rows = 12 if mp - r0 >= 12 else (8 if mp - r0 >= 8 else 4)
            if rows == 12:
                _fma_block12(acc, wg, kp, zero, lo, xf, r0 * kp, kp)
            elif rows == 8:
                _fma_block8(acc, wg, kp, zero, lo, xf, r0 * kp, kp)
            else:
                _fma_block4(acc, wg, kp, zero, lo, xf, r0 * kp, kp)
            for r in range(rows):
                m = r0 + r
                if m < m_rows:
                    for t in range(min(16, n - lo)):
                        v = acc[r * 16 + t] * scale[lo + t]
                        out[m, lo + t] = v + bias[lo + t] * sums[m] if has_bias else v
            r0 += rows


class FloatInt8Matmul:
    """x [..., K] float32 @ ((w - zero) * scale + bias) for an 8-bit weight w [K, N], zero, scale and bias
    (added to each weight, as dequantize adds it) one per column (or one)."""

    def __init__(self, w: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bias: np.ndarray | None,
                 threads: int = 1):
        k, n = w.shape
        self.k, self.n, self.threads = k, n, threads
        self.kp, self.np_ = -(-k // FK) * FK, -(-n // 16) * 16
        flip = 128 if w.dtype == np.uint8 else 0          # uint8 read as int8: q - 128, zero - 128
        padded = np.zeros((self.kp, self.np_), np.int8)
        padded[:k, :n] = (w.astype(np.int16) - flip).astype(np.int8)
        self.w = np.ascontiguousarray(padded.reshape(self.kp, self.np_ // 16, 16).transpose(1, 0, 2))

        def column(p, fill, dtype):
            out = np.full(self.np_, fill, dtype)
            if p is not None:
                out[:n] = np.broadcast_to(np.asarray(p).reshape(-1), (n,))
            return out
        self.zero = column(None if zero is None else np.asarray(zero, np.float64) - flip, -flip, np.int32) \
            if zero is not None or flip else np.zeros(self.np_, np.int32)
        self.scale = column(np.asarray(scale, np.float32), 0, np.float32)
        self.bias = column(bias, 0, np.float32)
        self.has_bias = bias is not None
        self.buffers: dict = {}

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        mp = -(-m // FROWS) * FROWS
        xp = self.buffers.get(mp)
        if xp is None:
            xp = self.buffers[mp] = np.zeros((mp, self.kp), np.float32)
        xp[:m, :k] = x2
        result = np.empty((m, self.n), np.float32) if out is None else out.reshape(m, self.n)
        groups = self.w.shape[0]
        parts = min(self.threads, groups) if m * k * self.n >= PARALLEL_MIN else 1
        args = (xp, self.w, self.zero, self.scale, self.bias, self.has_bias, m, self.n)
        if parts <= 1:
            float_gemm(*args, 0, groups, result)
        else:   # column groups over the pool's threads (the kernel releases the GIL)
            bounds = [groups * i // parts for i in range(parts + 1)]
            team.run_parallel(float_gemm, [args + (g0, g1, result) for g0, g1 in zip(bounds, bounds[1:])])
        return result.reshape(lead + (self.n,)) if out is None else out


PARALLEL_MIN = 1 << 22   # multiply-adds from which the columns split over the threads (as kernels' GEMM)
FLOAT_MIN_ROWS = 8   # from here the kernel beats the GEMV path (16 x 512 x 384: 0.07 against 0.11 ms)


_PACKED: dict = {}   # id(w) -> (weakref to w, scale, zero, bias, threads, FloatInt8Matmul), dropped with w


def _packed(w, scale, zero, bias, threads: int) -> "FloatInt8Matmul":
    """A FloatInt8Matmul of these constants, its packed weight made once for every executable holding
    the same arrays (an ONNX model's per-shape executables share their constants: a MiniLM's 10 MB of
    packed weights were made again for each sequence length); each caller gets its own row buffers."""
    hit = _PACKED.get(id(w))
    if hit is None or hit[0]() is not w or hit[1] is not scale or hit[2] is not zero or hit[3] is not bias \
            or hit[4] != threads:
        # (a dt.TiledWeight: the k-major array it stands for; the kernel packs its own)
        kernel = FloatInt8Matmul(np.asarray(w), scale, zero, bias, threads)
        try:
            if hit is None or hit[0]() is not w:
                weakref.finalize(w, _PACKED.pop, id(w), None)
            _PACKED[id(w)] = hit = (weakref.ref(w), scale, zero, bias, threads, kernel)
        except TypeError:   # not weakly referable: this caller's alone
            return kernel
    kernel = copy.copy(hit[5])
    kernel.buffers = {}
    return kernel


def float_weight_step(node: Node, out, activations: str = "float32", threads: int = 1):
    """quantized_matmul of float32 x (static, at least FLOAT_MIN_ROWS rows) by a constant 8-bit weight
    [K, N] with one block along k, through FloatInt8Matmul; None otherwise (and where activations are
    rounded to int8: the VNNI GEMV path is the lead's there)."""
    a = node.attrs
    if len(node.src) < 2:   # an expert's stand-in (experts.py, no sources): the GEMV path
        return None
    x = node.src[0]
    if a.get("mode") != "affine" or a.get("transpose") or a["qdtype"].name not in ("int8", "uint8") or \
            activations != "float32" or node.dtype.name != "float32" or x.dtype.name != "float32" or \
            not x.type.static or any(s.op != Op.CONSTANT for s in node.src[1:]):
        return None
    rows = int(np.prod(x.type.shape[:-1], dtype=np.int64))
    if rows < FLOAT_MIN_ROWS or any(p.type.rank != 2 or p.type.shape[0] != 1 for p in node.src[2:]):
        return None
    state: dict = {}

    def step(x, q, *params):
        if isinstance(q, dt.TiledWeight) and x.shape[0] <= kernels.GEMV_MAX_ROWS:
            # the LLM loaders' tiles (an int8 head with one block): rows_gemv's kernel, as for fewer rows,
            # so a served sequence's logits do not depend on how many sequences decode beside it
            if "gemv" not in state:
                state["gemv"] = kernels.quantized_matmul_step(node, out, threads, activations)
            return state["gemv"](x, q, *params)
        kernel = state.get("kernel")
        if kernel is None:
            it = iter(params)
            scale = next(it)
            zero = next(it) if a.get("has_zero_point") else None
            bias = next(it) if a.get("has_bias") else None
            exact_zero = zero is None or np.all(np.asarray(zero, np.float64) == np.round(np.asarray(zero, np.float64)))
            kernel = state["kernel"] = _packed(q, scale, zero, bias, threads) if exact_zero else False
        if kernel is False:
            return quant_ops.quantized_matmul_reference((x, np.asarray(q)) + params, a)
        return kernel(x, out)
    return step


# -- DynamicQuantizeLinear: the FUSED "dynamic_quantize" op (passes/fuse_dynamic_quantize.py) -------------

@intrinsic
def _range_lanes(typingctx, x, n, out):
    """out[:16] = the lane-wise minimum of 0 and x[16 i + lane] over i < n // 16, out[16:32] the maximum
    (x flat float32; minnum / maxnum skip NaN, which the caller checks apart): numba's scalar min and max
    do not vectorise (8192 values: 12 us against ~1)."""
    sig = types.void(x, n, out)

    def codegen(context, builder, signature, args):
        x_v, n_v, out_v = args
        xa = context.make_array(signature.args[0])(context, builder, x_v)
        oa = context.make_array(signature.args[2])(context, builder, out_v)
        f16x, index = ir.VectorType(ir.FloatType(), 16), n_v.type
        fmin, fmax = (builder.module.declare_intrinsic(f"llvm.{f}.v16f32", fnty=ir.FunctionType(f16x, [f16x, f16x]))
                      for f in ("minnum", "maxnum"))
        zero = ir.Constant(f16x, [0.0] * 16)
        count = builder.udiv(n_v, ir.Constant(index, 16))
        entry = builder.block
        loop = builder.append_basic_block("lanes")
        done = builder.append_basic_block("lanes_done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(index, 0)), loop, done)
        builder.position_at_end(loop)
        i, lo, hi = builder.phi(index), builder.phi(f16x), builder.phi(f16x)
        i.add_incoming(ir.Constant(index, 0), entry)
        lo.add_incoming(zero, entry)
        hi.add_incoming(zero, entry)
        v = builder.load(builder.bitcast(builder.gep(xa.data, [builder.mul(i, ir.Constant(index, 16))]), f16x.as_pointer()),
                         align=4)
        new_lo, new_hi = builder.call(fmin, [lo, v]), builder.call(fmax, [hi, v])
        following = builder.add(i, ir.Constant(index, 1))
        i.add_incoming(following, loop)
        lo.add_incoming(new_lo, loop)
        hi.add_incoming(new_hi, loop)
        builder.cbranch(builder.icmp_signed("<", following, count), loop, done)
        builder.position_at_end(done)
        last_lo, last_hi = builder.phi(f16x), builder.phi(f16x)
        for phi, value in ((last_lo, new_lo), (last_hi, new_hi)):
            phi.add_incoming(zero, entry)
            phi.add_incoming(value, loop)
        builder.store(last_lo, builder.bitcast(oa.data, f16x.as_pointer()), align=4)
        builder.store(last_hi, builder.bitcast(builder.gep(oa.data, [ir.Constant(index, 16)]), f16x.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, fastmath={"reassoc"})   # (reassociated: the sum vectorises)
def _not_finite(x):
    """Whether x holds NaN or an infinity (x * 0 summed is NaN then)."""
    bad = np.float32(0.0)
    for i in range(x.size):
        bad += x[i] * np.float32(0.0)
    return bad != np.float32(0.0)


@njit(cache=True, nogil=True, error_model="numpy")   # no zero-division check: the loop vectorises
def dynamic_quantize(x, y):
    """y = saturate(round_half_even(x / scale) + zero_point) over x's range widened to hold 0, as the
    body computes it (float32 throughout); returns (scale, zero_point as float32), NaN where x holds
    NaN or an infinity. One pass for the range (vector min and max), one for NaN and infinities, one to
    quantize (x / scale: a reciprocal would round otherwise)."""
    lanes = np.empty(32, np.float32)
    whole = x.size - x.size % 16
    _range_lanes(x, whole, lanes)
    lo, hi = np.float32(0.0), np.float32(0.0)
    for j in range(16):
        lo, hi = min(lo, lanes[j]), max(hi, lanes[16 + j])
    for i in range(whole, x.size):
        lo, hi = min(lo, x[i]), max(hi, x[i])
    if _not_finite(x) or not (np.isfinite(lo) and np.isfinite(hi)):
        return np.float32(np.nan), np.float32(np.nan)
    scale = np.float32(1.0) if hi == lo else np.float32((hi - lo) / np.float32(255.0))
    zero = np.float32(min(max(np.rint(np.float32(-lo / scale)), np.float32(0.0)), np.float32(255.0)))
    for i in range(x.size):
        q = np.rint(np.float32(x[i] / scale)) + zero
        y[i] = np.uint8(min(max(q, np.float32(0.0)), np.float32(255.0)))
    return scale, zero


def dynamic_quantize_lowering(node: Node, out):
    """The FUSED "dynamic_quantize" op: its outputs (y, and scale and zero point where read outside) from
    one numba kernel; where x holds NaN or infinities, the body's references (their NaN and saturation)."""
    body = node.attrs["body"]
    (mx,) = body.find(Op.MAX)
    x_index = mx.src[0].attrs["param"]
    kinds = []
    for o in body.outputs:
        kinds.append("y" if o.op == Op.QUANTIZE and o.type.rank else "scale" if o.op == Op.WHERE else "zero")
    shapes = {k: tuple(o.type.shape) for k, o in zip(kinds, body.outputs)}

    scale_shape, zero_shape = shapes.get("scale", ()), shapes.get("zero", ())

    def step(*inputs):
        x = inputs[x_index]
        if type(x) is not np.ndarray or x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, np.float32)
        y = np.empty(x.shape, np.uint8)
        scale, zero = dynamic_quantize(x.reshape(-1), y.reshape(-1))
        if scale != scale:   # NaN: x holds NaN or an infinity
            outs = body.evaluate(inputs)
            return outs[0] if len(outs) == 1 else tuple(outs)
        # (np.array(v).reshape: np.full took ~1 us a value, 32 to 50 calls a T5 run)
        outs = tuple(y if k == "y" else np.array(scale, np.float32).reshape(scale_shape) if k == "scale"
                     else np.array(zero, np.uint8).reshape(zero_shape) for k in kinds)
        return outs[0] if len(outs) == 1 else outs
    return step


FUSED_LOWERINGS["dynamic_quantize"] = dynamic_quantize_lowering
