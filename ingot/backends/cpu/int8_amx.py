"""int8_matmul's D = xu @ ws on AMX tiles (TDPBUSD: unsigned bytes of x by signed bytes of the weight,
each four summed into int32, exact and wrapping as VPDPBUSD's), for 32 rows of x or more.

A block is 32 rows of x x 32 columns: four int32 accumulator tiles; per 64 k, two tiles of x (16 rows x
64 bytes, read straight from the zero-padded xu, rows Kp apart) and two of the weight (AMX's layout, 16
rows of [16 columns][4 k], 1 KB, arranged once: `arrange`), 4 TDPBUSD. Each accumulator then joins
int8_matmul's terms (b[n] Rx[m] - a Cw[n] - K a b[n], in int64 wrapped to int32) and is written as int32
or float32(sum) * scale, exactly what vnni_gemm writes.
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from . import conv_amx
from .conv_amx import _I8, _I64, _P8, _declare, release
from .vnni import host_has

K_BLOCK = 64     # k a tile row holds
ROW_BLOCK = 32   # x's rows a block (two tiles); xu's rows are padded to a multiple of this
MIN_ROWS = 32    # fewer rows: VNNI's tiles. Both stream the weight at L2's or memory's pace there (Xeon VM,
                 # us, [M, K] @ [K, N], VNNI / tiles: 16 x 512 x 2048 69 / 65, 32 rows 128 / 84, 128 x 512 x
                 # 512 126 / 68; cold caches 16 rows 106 / 117, 32 rows 169 / 141)


@functools.cache
def available() -> bool:
    """AMX-INT8 where conv_amx may use the tiles."""
    return conv_amx.available() and host_has("amx-int8")


def arrange(ws: np.ndarray) -> np.ndarray:
    """The int8 weight ws [Kp, N] (Kp a multiple of 64) as [N' / 32][Kp / 64][2][16][16][4] (N' = N rounded
    up to 32, zero columns): per 32 columns, their k blocks in turn, each two tiles of 16 columns whose row
    r holds k = 4 r .. 4 r + 3 of every column."""
    kp, n = ws.shape
    npad = -(-n // 32) * 32
    padded = np.zeros((kp, npad), np.int8)
    padded[:, :n] = ws
    t = padded.reshape(kp // 64, 16, 4, npad // 32, 2, 16)   # [kb][r][e][g][nt][c]
    return np.ascontiguousarray(t.transpose(3, 0, 4, 1, 5, 2)).reshape(-1)


_config = conv_amx.tile_config([(16, 64)] * 8)   # every tile 16 rows x 64 bytes


@intrinsic
def _block(typingctx, xu, x_at, kp, w, w_at, nb, scratch):
    """Accumulator 2 mr + nt = sum over k blocks kb < nb of x rows (x_at + 16 mr kp bytes, rows kp apart)
    times weight tile w[w_at + 2048 kb + 1024 nt]; stored to scratch[256 (2 mr + nt):] as int32."""
    sig = types.void(xu, x_at, kp, w, w_at, nb, scratch)

    def codegen(context, builder, signature, args):
        arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
        xa, wa, sa = arr(0), arr(3), arr(6)
        x_at_v, kp_v, w_at_v, nb_v = args[1], args[2], args[4], args[5]
        load, dp, store = conv_amx.tile_ops(builder, "tdpbusd")
        zero = _declare(builder.module, "llvm.x86.tilezero", ir.VoidType(), [_I8])
        i64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        p8 = lambda a, at: builder.bitcast(builder.gep(a.data, [at]), _P8)  # noqa: E731
        for k in range(4):
            builder.call(zero, [ir.Constant(_I8, k)])

        def k_block(kb):
            x_k = builder.add(x_at_v, builder.mul(kb, i64(K_BLOCK)))
            w_k = builder.add(w_at_v, builder.mul(kb, i64(2048)))
            for mr in range(2):
                load(4 + mr, p8(xa, builder.add(x_k, builder.mul(kp_v, i64(16 * mr)))), kp_v)
            for nt in range(2):
                load(6 + nt, p8(wa, builder.add(w_k, i64(1024 * nt))), 64)
            for mr in range(2):
                for nt in range(2):
                    dp(2 * mr + nt, 4 + mr, 6 + nt)
        conv_amx.counted_loop(builder, nb_v, k_block)
        for k in range(4):
            store(k, p8(sa, i64(256 * k)), 64)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def amx_gemm(xu, w, m_rows, n, b, a, cw, k, scale, scaled, out_f, out_i, scratch):
    """vnni_gemm's contract (int8_matmul.py) on the tiles: out[m, t] = D[m, t] + b[t] Rx[m] - a Cw[t] -
    k a b[t] wrapped to int32 into out_i, or float32(that) * scale into out_f where scaled. xu [Mp, Kp]
    uint8 (Mp a multiple of 32, Kp of 64, padding zero); w: `arrange`d; b [>= n] int32; scratch 1024
    int32."""
    mp, kp = xu.shape
    nb = kp // K_BLOCK
    groups = -(-n // 32)
    rx, col = terms(xu, m_rows, n, groups * 32, b, a, cw, k)
    xf = xu.reshape(mp * kp)
    _config()
    for g in range(groups):
        for r0 in range(0, m_rows, ROW_BLOCK):
            _block(xf, r0 * kp, kp, w, g * nb * 2048, nb, scratch)
            for mr in range(2):
                for nt in range(2):
                    acc = (2 * mr + nt) * 256
                    t0 = g * 32 + nt * 16
                    width = min(16, n - t0)
                    for rr in range(min(16, m_rows - r0 - 16 * mr)):
                        m = r0 + 16 * mr + rr
                        _finish_row(scratch, acc + 16 * rr, b, col, t0, rx[m], width, scale, scaled,
                                    out_f[m] if scaled else out_f[0], out_i[0] if scaled else out_i[m])
    release()


@njit(cache=True, nogil=True, inline="always")
def _finish_row(scratch, at, b, col, t0, r, width, scale, scaled, row_f, row_i):
    """One accumulator row's 16 sums joined with their terms (int64, wrapped to int32 as the int32 lanes of
    the VNNI kernel wrap) into row_f (as float32(sum) * scale) or row_i: separate branch-free loops, which
    LLVM vectorises."""
    rl = np.int64(r)
    if scaled:
        for j in range(width):
            v = np.int64(scratch[at + j]) + np.int64(b[t0 + j]) * rl + np.int64(col[t0 + j])
            row_f[t0 + j] = np.float32(np.int32(v)) * scale
    else:
        for j in range(width):
            row_i[t0 + j] = np.int32(np.int64(scratch[at + j]) + np.int64(b[t0 + j]) * rl + np.int64(col[t0 + j]))


@njit(cache=True, nogil=True)
def terms(xu, m_rows, n, length, b, a, cw, k):
    """(Rx, col): the rows' sums of xu [Mp, Kp] (int32, wrapping) and col[t] = -a Cw[t] - k a b[t] for t < n
    (int32 wrapped, zero up to length): the terms int8_matmul's module docstring adds to D."""
    rx = np.zeros(xu.shape[0], np.int32)
    for m in range(m_rows):
        total = np.int32(0)
        for t in range(xu.shape[1]):
            total += np.int32(xu[m, t])
        rx[m] = total
    col = np.zeros(length, np.int32)
    for t in range(n):
        col[t] = np.int32(-a * cw[t] - k * a * np.int64(b[t]))
    return rx, col


@njit(cache=True, nogil=True)
def unsigned_rows(x, flip, x_zero, s0, s1, xu):
    """x [M, K] uint8 bytes (int8 x as its bytes, flip set: x + 128) into xu; (a, scale): a = x_zero
    (+ 128 with flip), scale = float32(s0 * s1), the body's product of two float32 scalars."""
    m_rows, k = x.shape
    bits = np.uint8(0x80) if flip else np.uint8(0)
    for r in range(m_rows):
        for t in range(k):
            xu[r, t] = x[r, t] ^ bits
    return np.int64(x_zero.flat[0]) + (128 if flip else 0), np.float32(s0.flat[0]) * np.float32(s1.flat[0])


@njit(cache=True, nogil=True)
def amx_matmul(x, flip, x_zero, s0, s1, scaled, xu, w, n, b, cw, out_f, out_i, scratch):
    """int8_matmul.vnni_matmul's contract on the tiles: unsigned_rows, then amx_gemm."""
    a, scale = unsigned_rows(x, flip, x_zero, s0, s1, xu)
    amx_gemm(xu, w, x.shape[0], n, b, a, cw, np.int64(x.shape[1]), scale, scaled, out_f, out_i, scratch)
