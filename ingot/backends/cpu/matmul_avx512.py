"""float32 matmuls by constant weights, x [M, K] @ w [K, N], in AVX-512 registers (hosts without AMX).

NumPy's BLAS runs these where OpenBLAS's kernels are the ones the user's environment chose: pinned to
AVX2's (OPENBLAS_CORETYPE=Haswell, as this project's EPYC machines are) a BERT encoder's GEMMs ran at
85-116 GFLOP/s on one Zen 5 core, against 171-201 with OpenBLAS's own AVX-512 choice. Here w is
packed once into panels of NR = 16 V columns ([N / NR][K][NR], zero past N, 64-byte aligned), and a
tile of R rows x V vectors of columns keeps R V accumulators in zmm registers: per k, V loads of
the panel, R broadcasts of x (folded into the FMAs) and R V FMAs; K unrolled by UNROLL. Rows are
walked a tile at a time over a band of panels whose share of w fits in L2 (x's R rows stay in L1,
the band's panels stream from L2); the last rows take a tile of fewer rows, the last panel's columns
a masked store.
"""
from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import conv_spatial
from .conv_spatial import _I64, _V, _i64, _lane_mask, _masked, _splat, _vptr
from .vnni import host_has

with open(os.path.abspath(__file__), "rb") as _f:   # the generated driver's cache key: the intrinsic here
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16]

AVAILABLE = host_has("avx512f")
# the tile: 6 rows x 4 vectors (24 accumulators). One Zen 5 core, GFLOP/s on [128, 128] @ [128, 128] /
# [128, 128] @ [128, 512] / [128, 512] @ [128, 128]: 6x4 250-253 / 258-263 / 251-265, 4x4 the same, 8x2
# 252-255 / 250-265 / 261-265, 8x3 224-229 / 252-257 / 231-236, 7x4 206 / 215 / 222, 12x2 147 / 147 / 149,
# 14x2 177 / 170 / 174 (benchmarks/lab/matmul_avx512_tiles.py)
ROWS, VECTORS = 6, 4
UNROLL = 4               # k steps a loop iteration
BAND_BYTES = 1 << 19     # w's share a band of panels: half of Zen 5's 1 MB L2


def fits(rows: int, k: int, n: int) -> bool:
    """Products taken from BLAS (where AVX-512 is and AMX is not): 16 rows or more and K N >= 2^14, where a
    call's ~0.7 us is paid back. One Zen 5 core, us, here / OpenBLAS SkylakeX / Haswell kernels: [16, 128]
    @ [128, 128] 2.7 / 3.0 / 6.2, [128, 128] @ [128, 128] 16.7 / 20.7 / 35.8, [128, 768] @ [768, 3072]
    2440 / 3162 / 7136, [512, 1024] @ [1024, 1024] 5755 / 6715 / 11588; left to BLAS: [4, 128] @ [128, 128]
    1.2 / 1.0 / 3.0, [64, 64] @ [64, 64] 2.8 / 2.5 / 4.9, [1, 128] @ [128, 128] 1.0 / 1.0 / 0.9."""
    return AVAILABLE and rows >= 16 and k * n >= 1 << 14


def _tile_intrinsic(rows: int, vectors: int, strided: bool = False):
    """tile(out, out_at, ldo, x, x_at, ldx, w, w_at, k_n, cols): for r < rows, lanes c < min(cols, 16
    vectors): out[out_at + r ldo + c] = sum over k < k_n of x[x_at + r ldx + k] * w[w_at + 16 vectors k + c].
    strided: tile(out, out_at, ldo, x, x_at, ldx, w, w_at, ldw, k_n, cols), w's rows ldw apart (any
    row of w [K, ldw] at all, not a packed panel; conv_winograd's transformed input)."""
    nr = 16 * vectors

    def codegen(context, builder, signature, args):
        arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
        oa, xa, wa = arr(0), arr(3), arr(6)
        last = (1, 2, 4, 5, 7, 9, 10, 8) if strided else (1, 2, 4, 5, 7, 8, 9)
        out_at_v, ldo_v, x_at_v, ldx_v, w_at_v, k_v, cols_v, *ldw = (_i64(builder, args[i]) for i in last)
        fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V, [_V, _V, _V]))
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        ldw_v, align = (ldw[0], 4) if strided else (const(nr), 64)
        row_at = [builder.add(x_at_v, builder.mul(ldx_v, const(r))) for r in range(rows)]

        def step(k, accs, unroll):
            # accs after k .. k + unroll - 1
            accs = list(accs)
            for u in range(unroll):
                ku = builder.add(k, const(u))
                w_k = builder.add(w_at_v, builder.mul(ku, ldw_v))
                wv = [builder.load(_vptr(builder, wa.data, builder.add(w_k, const(16 * v))), align=align)
                      for v in range(vectors)]
                for r in range(rows):
                    a = _splat(builder, builder.load(builder.gep(xa.data, [builder.add(row_at[r], ku)])))
                    for v in range(vectors):
                        accs[r * vectors + v] = builder.call(fma, [a, wv[v], accs[r * vectors + v]])
            return accs

        def loop(start, stop, accs, unroll, name):
            # counted loop k = start, start + unroll, .. < stop over the accumulators; those after it
            before = builder.block
            body, done = builder.append_basic_block(f"{name}_body"), builder.append_basic_block(f"{name}_done")
            builder.cbranch(builder.icmp_signed("<", start, stop), body, done)
            builder.position_at_end(body)
            k = builder.phi(_I64)
            k.add_incoming(start, before)
            phis = []
            for acc in accs:
                p = builder.phi(_V)
                p.add_incoming(acc, before)
                phis.append(p)
            new = step(k, phis, unroll)
            nxt = builder.add(k, const(unroll))
            latch = builder.block
            k.add_incoming(nxt, latch)
            for p, val in zip(phis, new):
                p.add_incoming(val, latch)
            builder.cbranch(builder.icmp_signed("<", nxt, stop), body, done)
            builder.position_at_end(done)
            finals = []
            for acc, val in zip(accs, new):
                f = builder.phi(_V)
                f.add_incoming(acc, before)
                f.add_incoming(val, latch)
                finals.append(f)
            return finals

        zero = ir.Constant(_V, [0.0] * 16)
        main = builder.mul(builder.sdiv(k_v, const(UNROLL)), const(UNROLL))
        accs = loop(const(0), main, [zero] * (rows * vectors), UNROLL, "k_main")
        accs = loop(main, k_v, accs, 1, "k_rest")
        _, store = _masked(builder)
        masks = [_lane_mask(builder, cols_v, 16 * v) for v in range(vectors)]
        for r in range(rows):
            at = builder.add(out_at_v, builder.mul(ldo_v, const(r)))
            for v in range(vectors):
                store(accs[r * vectors + v], _vptr(builder, oa.data, builder.add(at, const(16 * v))), masks[v])
        return context.get_dummy_value()

    if strided:
        @intrinsic
        def tile_strided(typingctx, out, out_at, ldo, x, x_at, ldx, w, w_at, ldw, k_n, cols):
            return types.void(out, out_at, ldo, x, x_at, ldx, w, w_at, ldw, k_n, cols), codegen
        return tile_strided

    @intrinsic
    def tile(typingctx, out, out_at, ldo, x, x_at, ldx, w, w_at, k_n, cols):
        return types.void(out, out_at, ldo, x, x_at, ldx, w, w_at, k_n, cols), codegen
    return tile


@functools.cache
def tile_for(rows: int, vectors: int, strided: bool = False):
    """The tile intrinsic of rows x vectors (strided: w's rows a given stride apart), made once per process."""
    return _tile_intrinsic(rows, vectors, strided)


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.matmul_avx512 import tile_for

R, V = {rows}, {vectors}
NR = 16 * V
{tiles}


@njit(cache=True, nogil=True)
def rest(out, out_at, ldo, x, x_at, ldx, w, w_at, k, cols, rows):
{dispatch}


@njit(cache=True, nogil=True)
def kernel(x, panels, out, band):
    # x [M, K] @ w [K, N] into out [M, N], w as panels [N / NR][K][NR]; `band` panels at a time
    m, k = x.shape
    n = out.shape[1]
    xf, of = x.reshape(m * k), out.reshape(m * n)
    n_panels = (n + NR - 1) // NR
    full = m - m % R
    for p0 in range(0, n_panels, band):
        p1 = min(n_panels, p0 + band)
        for i in range(0, full, R):
            for p in range(p0, p1):
                tile{rows}(of, i * n + p * NR, n, xf, i * k, k, panels, p * k * NR, k, n - p * NR)
        if full < m:
            for p in range(p0, p1):
                rest(of, full * n + p * NR, n, xf, full * k, k, panels, p * k * NR, k, n - p * NR, m - full)
"""


def driver(rows: int = ROWS, vectors: int = VECTORS):
    """The numba kernel(x, panels, out, band) of a tile (generated, cached on disk)."""
    tiles = "\n".join(f"tile{r} = tile_for({r}, V)" for r in range(1, rows + 1))
    dispatch = "\n".join(f"    {'if' if r == 1 else 'elif'} rows == {r}:\n"
                         f"        tile{r}(out, out_at, ldo, x, x_at, ldx, w, w_at, k, cols)" for r in range(1, rows))
    source = _DRIVER.format(rows=rows, vectors=vectors, tiles=tiles, dispatch=dispatch or "    pass")
    return conv_spatial.load(f"# avx512 matmul {REVISION}\n{source}", "kernel", "matmul_avx512")


def pack(w: np.ndarray, vectors: int = VECTORS) -> np.ndarray:
    """w [K, N] as panels [ceil(N / NR)][K][NR] (NR = 16 vectors columns, zero past N), flat, 64-byte aligned."""
    k, n = w.shape
    nr = 16 * vectors
    n_panels = -(-n // nr)
    padded = np.zeros((k, n_panels * nr), np.float32)
    padded[:, :n] = w
    size = n_panels * k * nr
    raw = np.empty(size + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    flat = raw[start:start + size]
    flat.reshape(n_panels, k, nr)[:] = padded.reshape(k, n_panels, nr).transpose(1, 0, 2)
    return flat


def step(rows: int, k: int, n: int, rows_tile: int = ROWS, vectors: int = VECTORS):
    """run(x, w, out_rows): x [..., K] @ w [K, N] into out_rows [rows, N]; w a constant, packed at the
    first call (the lowering's step sees the constant's value only then).

        >>> run = step(128, 64, 96); run(x, w, out)          # doctest: +SKIP
    """
    kernel = driver(rows_tile, vectors)
    band = max(1, BAND_BYTES // (4 * k * 16 * vectors))
    cache: dict = {}

    def run(x, w, out_rows):
        panels = cache.get("w")
        if panels is None:
            panels = cache["w"] = pack(np.asarray(w, np.float32), vectors)
        kernel(np.ascontiguousarray(x, dtype=np.float32).reshape(rows, k), panels, out_rows, band)
    return run
