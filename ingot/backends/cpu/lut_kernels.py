"""numba kernels for quantized_matmul with lookup-table (LUT) weights on the CPU.

The weight is k-major (transpose=False): q [K, N] indices (4-bit packed two per byte along N, or
8-bit), one table per group of output columns: lut [1, G, 2**bits] (G divides N; one table per
tensor is G = 1). A GEMV turns, for every k, the tables into the 2**bits products x[k] * table
(G * 2**bits multiplies) and then adds one product per weight: a table lookup and an add, no
per-weight multiply. Many rows (prefill) dequantize K-tiles through the tables and use BLAS.
Tested against the NumPy reference of quantized_matmul (tests/test_quant_lut_kernels.py).

Scaled tables (mode "scaled_lut", GGUF's IQ types and MXFP4: one 16-entry table, a scale per block
of K rows and column) have their own kernels below (tests/test_gguf_quants.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...ir import Node
from ...ops import quant as quant_ops
from . import team
from .vnni import host_has

GEMV_MAX_ROWS = 16
TILE_ELEMENTS = 1 << 21
_opts = dict(fastmath=True, cache=True, nogil=True)


@njit(**_opts)
def lut_gemv_packed4(x, q, tables, out):
    """out[m, n] = sum_k x[m, k] * tables[n // (N / G), q[k, n]]; q [K, N/2] packed, tables [G, 16].
    Groups of >= 16 columns: per k, the G x 16 products x[k] * table, then one lookup and add per
    weight; narrower groups (one table per column or two): a lookup and a multiply-add per weight."""
    m_rows, k = x.shape
    half = q.shape[1]
    groups = tables.shape[0]
    width = 2 * half // groups                       # output columns per table
    pairs = max(width // 2, 1)                       # bytes per table when width is even
    prod = np.empty((groups, 16), np.float32)
    acc_e = np.empty(half, np.float32)
    acc_o = np.empty(half, np.float32)
    for m in range(m_rows):
        acc_e[:] = 0
        acc_o[:] = 0
        for kk in range(k):
            xv = x[m, kk]
            row = q[kk]
            if width >= 16 and width % 2 == 0:
                for g in range(groups):
                    for v in range(16):
                        prod[g, v] = tables[g, v] * xv
                for g in range(groups):
                    p = prod[g]
                    for i in range(g * pairs, (g + 1) * pairs):
                        byte = row[i]
                        acc_e[i] += p[byte & np.uint8(15)]
                        acc_o[i] += p[byte >> np.uint8(4)]
            else:
                for i in range(half):
                    byte = row[i]
                    acc_e[i] += tables[(2 * i) // width, byte & np.uint8(15)] * xv
                    acc_o[i] += tables[(2 * i + 1) // width, byte >> np.uint8(4)] * xv
        for i in range(half):
            out[m, 2 * i] = acc_e[i]
            out[m, 2 * i + 1] = acc_o[i]


@njit(**_opts)
def lut_gemv_int8(x, q, tables, out):
    """out[m, n] = sum_k x[m, k] * tables[n // (N / G), q[k, n]]; q [K, N] uint8, tables [G, 256]."""
    m_rows, k = x.shape
    n = q.shape[1]
    groups, entries = tables.shape
    width = n // groups
    acc = np.empty(n, np.float32)
    for m in range(m_rows):
        acc[:] = 0
        for kk in range(k):
            xv = x[m, kk]
            row = q[kk]
            for g in range(groups):
                t = tables[g]
                for i in range(g * width, (g + 1) * width):
                    acc[i] += t[row[i]] * xv
        for i in range(n):
            out[m, i] = acc[i]


@njit(**_opts)
def lut_tile(q, tables, packed, k0, k1, out):
    """out[k - k0, n] = tables[n // width, q[k, n]] for k in k0..k1."""
    groups = tables.shape[0]
    n = out.shape[1]
    width = n // groups
    for kk in range(k0, k1):
        row = q[kk]
        for i in range(n):
            if packed:
                byte = row[i // 2]
                v = (byte >> np.uint8(4)) if i % 2 else (byte & np.uint8(15))
            else:
                v = row[i]
            out[kk - k0, i] = tables[i // width, v]


def lut_matmul_step(node: Node, out, threads: int = 1, permute: bool | None = None):
    """A step for a k-major LUT quantized_matmul with one table per column group, or None (the
    caller then uses the reference). threads: `CpuOptions.threads` (the permute GEMV's team);
    permute: the AVX-512 permute GEMV for 4-bit codes where the groups allow (default: when the CPU
    has it)."""
    attrs = node.attrs
    if attrs.get("mode") != "lut" or attrs.get("transpose") or node.dtype.name != "float32":
        return None
    if attrs["qdtype"].name not in ("uint4", "uint8"):
        return None
    packed = attrs["qdtype"].packed
    permute = PERMUTE if permute is None else permute and PERMUTE
    reference = quant_ops.quantized_matmul_reference
    prepared: dict = {}
    ones = np.ones((1, 1), np.float32)

    def step(x, q, lut):
        if lut.ndim != 3 or lut.shape[0] != 1:
            return reference((x, q, lut), attrs)
        tables = prepared.get(id(lut))
        if tables is None:
            tables = prepared[id(lut)] = (np.ascontiguousarray(lut[0], dtype=np.float32), lut)
        tables = tables[0]
        k = x.shape[-1]
        n = q.shape[1] * (2 if packed else 1)
        x2 = x.reshape(-1, k)
        if not x2.flags.c_contiguous or x2.dtype != np.float32:
            x2 = np.ascontiguousarray(x2, dtype=np.float32)
        rows = x2.shape[0]
        groups = tables.shape[0]
        if rows <= GEMV_MAX_ROWS and packed and permute and (groups == 1 or (n // groups) % 32 == 0) \
                and q.flags.c_contiguous:
            result = np.empty((rows, n), np.float32)
            team.split_blocks(lut_gemv_perm, (x2, q, tables, ones, ones, False, PERM_BLOCK), -(-k // PERM_BLOCK),
                              result, k * n, threads)
        elif rows <= GEMV_MAX_ROWS:
            result = np.empty((rows, n), np.float32)
            (lut_gemv_packed4 if packed else lut_gemv_int8)(x2, q, tables, result)
        else:
            tile_k = max(1, min(k, TILE_ELEMENTS // n))
            tile = np.empty((tile_k, n), np.float32)
            result = None
            for k0 in range(0, k, tile_k):
                k1 = min(k, k0 + tile_k)
                t = tile[: k1 - k0]
                lut_tile(q, tables, packed, k0, k1, t)
                part = x2[:, k0:k1] @ t
                result = part if result is None else result + part
        return result.reshape(x.shape[:-1] + (n,))
    return step


# -- 4-bit tables by vector permutes (AVX-512) -----------------------------------------------------
#
# VPERMPS looks 16 lanes up in a 16-float register in one instruction: with the table in a register,
# 16 bytes of codes give 32 weights (low and high nibbles) in two permutes, each then a fused
# multiply-add with x[k], instead of 32 scalar loads. `lut_rows` does a block of k rows for 32
# columns with its sums in registers; `lut_gemv_perm` serves both modes: one table per group of
# columns (mode "lut", blocks of PERM_BLOCK rows, no scale) and a scaled table (mode "scaled_lut",
# the weight's own blocks, a float32 scale per block and column).


PERMUTE = host_has("avx512f")   # VPERMPS on 512-bit vectors
PERM_BLOCK = 64   # rows of k per block of the unscaled ("lut") kernel (32, 64 and 128 timed the same)


def _make_lut_rows():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from .vnni import splat

    @intrinsic
    def lut_rows(typingctx, res_e, res_o, r_at, q, q_at, stride, rows, x, x_at, tables, t_at, scale_e, scale_o, s_at,
                 scaled):
        """For the 16 bytes of codes at flat offset q_at + r stride of q (uint8, C order), r < rows:
        sum_e += table[low nibble] * x[x_at + r], sum_o the same of the high nibble (16 lanes each, in
        registers; table: the 16 floats at flat offset t_at of tables); then res_e[r_at:r_at + 16] +=
        sum_e (times scale_e[s_at:s_at + 16] when scaled), res_o likewise."""
        sig = types.void(res_e, res_o, r_at, q, q_at, stride, rows, x, x_at, tables, t_at, scale_e, scale_o, s_at,
                         scaled)

        def codegen(context, builder, signature, args):
            re_v, ro_v, r_at_v, q_v, q_at_v, stride_v, rows_v, x_v, x_at_v, t_v, t_at_v, se_v, so_v, s_at_v, scaled_v = args
            arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
            qa, xa = arr(3, q_v), arr(7, x_v)
            v16f, v16b = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(8), 16)
            v16i = ir.VectorType(ir.IntType(32), 16)
            perm = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512",
                                                    fnty=ir.FunctionType(v16f, [v16f, v16i]))
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(v16f, [v16f] * 3))
            vector_at = lambda a, at, ty: builder.bitcast(builder.gep(a.data, [at]), ty.as_pointer())  # noqa: E731
            table = builder.load(vector_at(arr(9, t_v), t_at_v, v16f), align=4)
            zero = ir.Constant(v16f, [0.0] * 16)
            sums = [cgutils.alloca_once_value(builder, zero) for _ in range(2)]
            fifteen, four = ir.Constant(v16b, [15] * 16), ir.Constant(v16b, [4] * 16)
            with cgutils.for_range(builder, rows_v) as loop:
                r = loop.index
                codes = builder.load(vector_at(qa, builder.add(q_at_v, builder.mul(r, stride_v)), v16b), align=1)
                xr = splat(builder, builder.load(builder.gep(xa.data, [builder.add(x_at_v, r)])), v16f)
                for total, nibbles in zip(sums, (builder.and_(codes, fifteen), builder.lshr(codes, four))):
                    looked_up = builder.call(perm, [table, builder.zext(nibbles, v16i)])
                    builder.store(builder.call(fma, [looked_up, xr, builder.load(total)]), total)
            sum_e, sum_o = builder.load(sums[0]), builder.load(sums[1])
            for i, add, scale_v in ((0, sum_e, se_v), (1, sum_o, so_v)):
                ptr = vector_at(arr(i, (re_v, ro_v)[i]), r_at_v, v16f)
                with builder.if_then(builder.icmp_unsigned("!=", scaled_v, ir.Constant(scaled_v.type, 0))):
                    s = builder.load(vector_at(arr(11 + i, scale_v), s_at_v, v16f), align=4)
                    builder.store(builder.fadd(builder.load(ptr, align=4), builder.fmul(add, s)), ptr, align=4)
                with builder.if_then(builder.icmp_unsigned("==", scaled_v, ir.Constant(scaled_v.type, 0))):
                    builder.store(builder.fadd(builder.load(ptr, align=4), add), ptr, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return lut_rows


if PERMUTE:
    lut_rows = _make_lut_rows()

    @njit(**_opts)
    def lut_gemv_perm(x, q, tables, scale_e, scale_o, scaled, block, b0, b1, c0, c1, out):
        """out[m, c0:c1] (c0, c1 even) = x[m, rows of blocks b0..b1) @ W[those rows, c0:c1] for a k-major
        4-bit LUT weight q [K, N/2] (low nibble = even column): W[k, n] = tables[n // (N / G), code]
        [G, 16], times scale_e/scale_o[k // block, n // 2] (even/odd columns) when scaled. Blocks of
        `block` rows (the last may be shorter); each group of 32 columns within one table (N / G a
        multiple of 32, or G = 1: the step checks)."""
        m_rows, k = x.shape
        half = q.shape[1]
        groups = tables.shape[0]
        width = 2 * half // groups
        h0, h1 = c0 // 2, c1 // 2
        whole = h0 + (h1 - h0) // 16 * 16
        res_e = np.empty(h1 - h0, np.float32)
        res_o = np.empty(h1 - h0, np.float32)
        for m in range(m_rows):
            res_e[:] = 0
            res_o[:] = 0
            for b in range(b0, b1):
                k0 = b * block
                rows = min(block, k - k0)
                srow = b if scaled else 0
                for c in range(h0, whole, 16):
                    lut_rows(res_e, res_o, c - h0, q, k0 * half + c, half, rows, x, m * k + k0, tables,
                             2 * c // width * 16, scale_e, scale_o, srow * half + c, scaled)
                for i in range(whole, h1):         # the last columns, under 32 (one table: G = 1)
                    te = np.float32(0.0)
                    to = np.float32(0.0)
                    for r in range(rows):
                        byte = q[k0 + r, i]
                        te += tables[0, byte & np.uint8(15)] * x[m, k0 + r]
                        to += tables[0, byte >> np.uint8(4)] * x[m, k0 + r]
                    res_e[i - h0] += te * (scale_e[srow, i] if scaled else np.float32(1.0))
                    res_o[i - h0] += to * (scale_o[srow, i] if scaled else np.float32(1.0))
            for i in range(h1 - h0):
                out[m, 2 * (h0 + i)] = res_e[i]
                out[m, 2 * (h0 + i) + 1] = res_o[i]

    @njit(**_opts)
    def lut_perm_chunks(head, plan, outs, out, ctrl, gen, lead):
        """lut_gemv_perm over a team's chunks (team.py)."""
        n = plan.shape[0]
        c = team.begin(ctrl, gen, lead, n)
        while c >= 0:
            lut_gemv_perm(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
            c = team.after(ctrl, gen, n)
        return team.end(ctrl, lead, n, outs, out)


def split_scale(scale: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A scale [blocks, 1 or N] as its even and odd columns [blocks, N / 2], float32, C order."""
    full = np.broadcast_to(scale.astype(np.float32, copy=False), (scale.shape[0], n))
    return np.ascontiguousarray(full[:, 0::2]), np.ascontiguousarray(full[:, 1::2])


# -- scaled lookup tables (GGUF's IQ types, MXFP4): w = table[q] * scale[block] ----------------------
#
# A lookup per weight does not vectorise (numba/LLVM emit one scalar load each: 6x slower than the
# affine 4-bit kernel). When the table is small integers up to a power-of-two factor (IQ4_NL/XS's
# kvalues, MXFP4's doubled e2m1 values, the IQ2/IQ3 grid levels, IQ1's values times 8) and the CPU
# has SSSE3, each row of codes is decoded 32 weights at a time by two byte shuffles (PSHUFB: a
# 16-entry byte table lookup in one instruction) into int8, and the products run on int8 as the
# affine kernels do. Otherwise a kernel that looks each code up in a per-row table of 16 products.


SHUFFLE = host_has("ssse3")   # PSHUFB
COLUMN_CHUNK = 4096  # output columns per pass of the int8 scaled-table GEMV (an even number)


def _make_decode16():
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def decode16(typingctx, q, q_at, table, out, out_at):
        """out[out_at:out_at + 32] (int8) = table[codes], the 32 4-bit codes of the 16 bytes at
        flat offset q_at of the C-contiguous array q (low nibble first); table: 16 int8. Two
        PSHUFB and two byte interleaves."""
        sig = types.void(q, q_at, table, out, out_at)

        def codegen(context, builder, signature, args):
            q_v, q_at_v, t_v, o_v, o_at_v = args
            qa = context.make_array(signature.args[0])(context, builder, q_v)
            ta = context.make_array(signature.args[2])(context, builder, t_v)
            oa = context.make_array(signature.args[3])(context, builder, o_v)
            v16 = ir.VectorType(ir.IntType(8), 16)
            ptr = lambda base, at: builder.bitcast(builder.gep(base, [at]), v16.as_pointer())  # noqa: E731
            codes = builder.load(ptr(qa.data, q_at_v), align=1)
            tab = builder.load(builder.bitcast(ta.data, v16.as_pointer()), align=1)
            fifteen = ir.Constant(v16, [15] * 16)
            lo = builder.and_(codes, fifteen)
            hi = builder.and_(builder.lshr(codes, ir.Constant(v16, [4] * 16)), fifteen)
            pshufb = builder.module.declare_intrinsic("llvm.x86.ssse3.pshuf.b.128", fnty=ir.FunctionType(v16, [v16, v16]))
            lv, hv = builder.call(pshufb, [tab, lo]), builder.call(pshufb, [tab, hi])
            mask = lambda first: ir.Constant(ir.VectorType(ir.IntType(32), 16), [j for i in range(first, first + 8) for j in (i, i + 16)])  # noqa: E731
            builder.store(builder.shuffle_vector(lv, hv, mask(0)), ptr(oa.data, o_at_v), align=1)
            builder.store(builder.shuffle_vector(lv, hv, mask(8)), ptr(oa.data, builder.add(o_at_v, ir.Constant(o_at_v.type, 16))), align=1)
            return context.get_dummy_value()
        return sig, codegen
    return decode16


if SHUFFLE:
    decode16 = _make_decode16()

    @njit(**_opts)
    def decode_row(q, k, h0, h1, table, out):
        """out[2i], out[2i + 1] = table[low nibble], table[high nibble] of q[k, h0 + i] for
        i < h1 - h0 (int8); q C-contiguous (no row views made: they cost ~30 us a K = 1536 GEMV)."""
        base = k * q.shape[1]
        whole = h0 + (h1 - h0) // 16 * 16
        for c in range(h0, whole, 16):
            decode16(q, base + c, table, out, 2 * (c - h0))
        for i in range(whole, h1):
            byte = q[k, i]
            out[2 * (i - h0)] = table[byte & np.uint8(15)]
            out[2 * (i - h0) + 1] = table[byte >> np.uint8(4)]

    @njit(**_opts)
    def scaled_lut_gemv_int(x, q, table, scale, b0, b1, c0, c1, out):
        """out[m, c0:c1] = x[m, rows of blocks b0..b1) @ W[those rows, c0:c1] (c0, c1 even) for a k-major scaled-table weight:
        q [K, N/2] 4-bit codes (low nibble = even column), table [16] int8, scale [K / block, N]
        float32 (the table's power-of-two factor folded in). Four rows of W per pass: decoded to
        int8, then multiplied as _kmajor_int8 does; columns in chunks of COLUMN_CHUNK so that the
        decoded rows and the sums stay in cache (576 x 3072: 125 us against 160 unchunked)."""
        m_rows, k = x.shape
        n = 2 * q.shape[1]
        nb = scale.shape[0]
        bs = k // nb
        width = min(c1 - c0, COLUMN_CHUNK)
        dec = np.empty((4, width), np.int8)
        acc = np.empty(width, np.float32)
        res = np.empty(width, np.float32)
        for m in range(m_rows):
            for t0 in range(c0, c1, width):
                t1 = min(c1, t0 + width)
                w = t1 - t0
                h0, h1 = t0 // 2, t1 // 2
                res[:w] = 0
                for b in range(b0, b1):
                    acc[:w] = 0
                    k0 = b * bs
                    k4 = k0 + bs // 4 * 4
                    for kk in range(k0, k4, 4):
                        for j in range(4):
                            decode_row(q, kk + j, h0, h1, table, dec[j])
                        x0, x1, x2, x3 = x[m, kk], x[m, kk + 1], x[m, kk + 2], x[m, kk + 3]
                        d0, d1, d2, d3 = dec[0], dec[1], dec[2], dec[3]
                        for i in range(w):
                            acc[i] += (np.float32(np.int32(d0[i])) * x0 + np.float32(np.int32(d1[i])) * x1
                                       + np.float32(np.int32(d2[i])) * x2 + np.float32(np.int32(d3[i])) * x3)
                    for kk in range(k4, k0 + bs):
                        decode_row(q, kk, h0, h1, table, dec[0])
                        xv = x[m, kk]
                        d0 = dec[0]
                        for i in range(w):
                            acc[i] += np.float32(np.int32(d0[i])) * xv
                    srow = scale[b]
                    for i in range(w):
                        res[i] += acc[i] * srow[t0 + i]
                for i in range(w):
                    out[m, t0 + i] = res[i]

    @njit(**_opts)
    def scaled_lut_tile_int(q, table, scale, k0, k1, block, out):
        """out[k - k0, n] = table[q[k, n]] * scale[k // block, n] for k in k0..k1 (int8 table)."""
        n = out.shape[1]
        dec = np.empty(n, np.int8)
        for kk in range(k0, k1):
            decode_row(q, kk, 0, q.shape[1], table, dec)
            srow = scale[kk // block]
            for i in range(n):
                out[kk - k0, i] = np.float32(np.int32(dec[i])) * srow[i]


@njit(**_opts)
def scaled_lut_gemv_packed4(x, q, table, scale, b0, b1, c0, c1, out):
    """As scaled_lut_gemv_int for any float32 table [16]: per row of W the 16 products x[k] * table,
    then a lookup and an add per weight, four rows of W per pass over the accumulators; columns
    c0..c1 (even) of out."""
    m_rows, k = x.shape
    h0 = c0 // 2
    half = c1 // 2 - h0
    nb = scale.shape[0]
    bs = k // nb
    prod = np.empty((4, 16), np.float32)
    acc_e = np.empty(half, np.float32)
    acc_o = np.empty(half, np.float32)
    res_e = np.empty(half, np.float32)
    res_o = np.empty(half, np.float32)
    low, shift = np.uint32(15), np.uint32(4)
    for m in range(m_rows):
        res_e[:] = 0
        res_o[:] = 0
        for b in range(b0, b1):
            acc_e[:] = 0
            acc_o[:] = 0
            k0 = b * bs
            k4 = k0 + bs // 4 * 4
            for kk in range(k0, k4, 4):
                for j in range(4):
                    xv = x[m, kk + j]
                    for v in range(16):
                        prod[j, v] = table[v] * xv
                p0, p1, p2, p3 = prod[0], prod[1], prod[2], prod[3]
                r0, r1, r2, r3 = q[kk], q[kk + 1], q[kk + 2], q[kk + 3]
                for i in range(half):
                    j = h0 + i
                    u0, u1, u2, u3 = np.uint32(r0[j]), np.uint32(r1[j]), np.uint32(r2[j]), np.uint32(r3[j])
                    acc_e[i] += (p0[u0 & low] + p1[u1 & low]) + (p2[u2 & low] + p3[u3 & low])
                    acc_o[i] += (p0[u0 >> shift] + p1[u1 >> shift]) + (p2[u2 >> shift] + p3[u3 >> shift])
            for kk in range(k4, k0 + bs):
                xv = x[m, kk]
                for v in range(16):
                    prod[0, v] = table[v] * xv
                p0 = prod[0]
                row = q[kk]
                for i in range(half):
                    u = np.uint32(row[h0 + i])
                    acc_e[i] += p0[u & low]
                    acc_o[i] += p0[u >> shift]
            srow = scale[b]
            for i in range(half):
                res_e[i] += acc_e[i] * srow[2 * (h0 + i)]
                res_o[i] += acc_o[i] * srow[2 * (h0 + i) + 1]
        for i in range(half):
            out[m, 2 * (h0 + i)] = res_e[i]
            out[m, 2 * (h0 + i) + 1] = res_o[i]


@njit(**_opts)
def scaled_lut_tile_packed4(q, table, scale, k0, k1, block, out):
    """out[k - k0, n] = table[q[k, n]] * scale[k // block, n] for k in k0..k1 (4-bit codes)."""
    half = q.shape[1]
    for kk in range(k0, k1):
        row = q[kk]
        srow = scale[kk // block]
        for i in range(half):
            byte = np.uint32(row[i])
            out[kk - k0, 2 * i] = table[byte & np.uint32(15)] * srow[2 * i]
            out[kk - k0, 2 * i + 1] = table[byte >> np.uint32(4)] * srow[2 * i + 1]


@njit(**_opts)
def lut_packed4_chunks(head, plan, outs, out, ctrl, gen, lead):
    """scaled_lut_gemv_packed4 over a team's chunks of blocks (team.py)."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        scaled_lut_gemv_packed4(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


if SHUFFLE:
    @njit(**_opts)
    def lut_int_chunks(head, plan, outs, out, ctrl, gen, lead):
        """scaled_lut_gemv_int over a team's chunks of blocks (team.py)."""
        n = plan.shape[0]
        c = team.begin(ctrl, gen, lead, n)
        while c >= 0:
            scaled_lut_gemv_int(*head, plan[c, 0], plan[c, 1], plan[c, 2], plan[c, 3], outs[plan[c, 4]])
            c = team.after(ctrl, gen, n)
        return team.end(ctrl, lead, n, outs, out)


def int8_table(table: np.ndarray) -> tuple[np.ndarray, float] | None:
    """(int8 table, factor) with table = int8 table * factor, factor a power of two (1 .. 1/16),
    or None when the values are no such integers."""
    for shift in range(5):
        scaled = table.astype(np.float64) * (1 << shift)
        if np.all(scaled == np.round(scaled)) and scaled.min() >= -128 and scaled.max() <= 127:
            return scaled.astype(np.int8), 1.0 / (1 << shift)
    return None


def scaled_lut_matmul_step(node: Node, out, shuffle: bool | None = None, threads: int = 1,
                           permute: bool | None = None):
    """A step for a k-major scaled-table quantized_matmul (4-bit codes, one table, a scale per block
    of K rows and output column, and with attrs["has_bias"] a bias per block: lut4:bB:offset, whose share
    x's block sums times the bias [K / B, N] adds, one small BLAS product), or None (the caller then uses the
    reference). shuffle: use the
    PSHUFB kernels when the table allows (default: when the CPU has them); permute: the AVX-512 permute
    GEMV, any table (default: when the CPU has it; faster than both); threads: `CpuOptions.threads`."""
    attrs = node.attrs
    if attrs.get("mode") != "scaled_lut" or attrs.get("transpose") or node.dtype.name != "float32" \
            or attrs["qdtype"].name not in ("uint4", "int4"):
        return None
    shuffle = SHUFFLE if shuffle is None else shuffle and SHUFFLE
    permute = PERMUTE if permute is None else permute and PERMUTE
    reference = quant_ops.quantized_matmul_reference
    prepared: dict = {}

    def prepare(q, lut, scale, bias):
        key = (id(q), id(lut), id(scale), id(bias))
        hit = prepared.get(key)
        if hit is None:
            n = q.shape[1] * 2
            ready = None
            if lut.ndim == 3 and lut.shape[:2] == (1, 1) and scale.ndim == 2 and scale.shape[1] in (1, n) and \
                    (bias is None or (bias.ndim == 2 and bias.shape[1] in (1, n) and q.shape[0] % bias.shape[0] == 0)):
                # (int4 codes are read as raw nibbles: nibble 15 is code -1, which indexes
                # table[-1] = table[15] in the reference too)
                table = np.ascontiguousarray(lut.reshape(16), dtype=np.float32)
                full = np.broadcast_to(scale.astype(np.float32, copy=False), (scale.shape[0], n))
                qv = np.ascontiguousarray(q.view(np.uint8))
                perm_args = None
                if permute:
                    perm_args = (table.reshape(1, 16),) + split_scale(scale, n) + (True, q.shape[0] // scale.shape[0])
                small = int8_table(table) if shuffle else None
                if small is not None:
                    table, factor = small
                    full = full * np.float32(factor) if factor != 1 else full
                    gemv, tile = scaled_lut_gemv_int, scaled_lut_tile_int
                else:
                    gemv, tile = scaled_lut_gemv_packed4, scaled_lut_tile_packed4
                full = np.ascontiguousarray(full)
                for a in (table, full, qv):
                    a.flags.writeable = False
                gemv_args = (table, full) if perm_args is None else perm_args
                bias32 = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)   # widened once
                ready = (lut_gemv_perm if perm_args else gemv, gemv_args, tile, table, full, qv, bias32)
            hit = prepared[key] = (ready, (q, lut, scale, bias))  # the arrays kept: ids stay valid
        return hit[0]

    def step(x, q, lut, scale, *bias):
        ready = prepare(q, lut, scale, bias[0] if bias else None)
        k = x.shape[-1]
        if ready is None or k % ready[4].shape[0] or k != q.shape[0]:
            return reference((x, q, lut, scale) + bias, attrs)
        gemv, gemv_args, tile_fn, table, full, qv, bias32 = ready
        nb, n = full.shape
        x2 = x.reshape(-1, k)
        if not x2.flags.c_contiguous or x2.dtype != np.float32:
            x2 = np.ascontiguousarray(x2, dtype=np.float32)
        rows = x2.shape[0]
        if rows <= GEMV_MAX_ROWS:
            result = np.empty((rows, n), np.float32)
            team.split_blocks(gemv, (x2, qv) + gemv_args, nb, result, k * n, threads)
        else:
            block = k // nb
            tile_k = max(block, min(k, TILE_ELEMENTS // n) // block * block)
            tile = np.empty((min(tile_k, k), n), np.float32)
            result = None
            for k0 in range(0, k, tile_k):
                k1 = min(k, k0 + tile_k)
                t = tile[: k1 - k0]
                tile_fn(qv, table, full, k0, k1, block, t)
                part = x2[:, k0:k1] @ t
                result = part if result is None else result + part
        if bias32 is not None:   # x's sums per bias block [rows, nbb] @ bias [nbb, N or 1]
            result += x2.reshape(rows, bias32.shape[0], -1).sum(axis=2) @ bias32
        return result.reshape(x.shape[:-1] + (n,))
    return step


team.DRIVERS[scaled_lut_gemv_packed4] = (lut_packed4_chunks, False)
if SHUFFLE:
    team.DRIVERS[scaled_lut_gemv_int] = (lut_int_chunks, False)
if PERMUTE:
    team.DRIVERS[lut_gemv_perm] = (lut_perm_chunks, False)
