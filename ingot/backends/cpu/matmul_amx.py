"""float32 matmuls by constant weights, x [..., K] @ w [K, N], on AMX tiles (conv_amx.py's blocks).

The product is a 1x1 convolution whose positions are x's rows: w is split and arranged once as the
conv's weights (w.T as [N, K, 1, 1]); each call splits x's rows into the [chunks][rows][KC] planes
(`split_rows`: KC contiguous floats a row and chunk, no transpose), runs the blocks of 32 (or 16)
columns x 2 (or 4) tiles of 16 rows without the transpose the NCHW epilogue needs, and copies each
accumulator row (16 columns of an output row) out under the columns' mask. Where BLAS takes it:
`fits`.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import conv_amx, conv_spatial
from .conv_amx import BANDS, _I64, _declare, bf16_part, each_part

with open(os.path.abspath(__file__), "rb") as _f:
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16] + conv_amx.REVISION


def fits(rows: int, k: int, n: int) -> bool:
    """Products the tiles take over BLAS: a tile of rows (16) or more, and K and N of at least 64 (smaller
    ones are a few microseconds either way). Through exe.run, one thread, Xeon VM, us, tiles / OpenBLAS:
    [128, 128] @ [128, 128] 19.4 / 37.7, [128, 512] @ [512, 128] 54.9 / 126.2, [1000, 256] @ [256, 1024]
    1770 / 3576, [17, 64] @ [64, 64] 5.8 / 7.2."""
    return rows >= 16 and k >= 64 and n >= 64


def _split_intrinsic(kc: int):
    """split_flat(planes, at, part_size, parts, xf, src, n): the n (<= KC) floats xf[src:] (zero past n)
    split into `parts` bfloat16 parts, part k's KC values at planes[k part_size + at]."""
    f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
    v32, h32 = ir.VectorType(f32, 32), ir.VectorType(i16, 32)
    m32 = ir.VectorType(ir.IntType(1), 32)

    @intrinsic
    def split_flat(typingctx, planes, at, part_size, parts, xf, src, n):
        sig = types.void(planes, at, part_size, parts, xf, src, n)

        def codegen(context, builder, signature, args):
            pa = context.make_array(signature.args[0])(context, builder, args[0])
            xa = context.make_array(signature.args[4])(context, builder, args[4])
            at_v, ps_v, parts_v, src_v, n_v = (args[i] for i in (1, 2, 3, 5, 6))
            mod = builder.module
            i64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            vt = ir.VectorType(_I64, 32)
            one = builder.insert_element(ir.Constant(vt, ir.Undefined), n_v, ir.Constant(i32, 0))
            n_all = builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(i32, 32), [0] * 32))
            live = builder.icmp_signed("<", ir.Constant(vt, list(range(32))), n_all)
            ld = _declare(mod, "llvm.masked.load.v32f32.p0", v32, [v32.as_pointer(), i32, m32, v32])
            v = builder.call(ld, [builder.bitcast(builder.gep(xa.data, [src_v]), v32.as_pointer()), ir.Constant(i32, 4),
                                  live, ir.Constant(v32, [0.0] * 32)])
            st = _declare(mod, "llvm.masked.store.v32i16.p0", ir.VoidType(), [h32, h32.as_pointer(), i32, m32])
            row = ir.Constant(m32, [c < kc for c in range(32)])
            rest = [v]

            def store_part(k):
                bits, rest[0] = bf16_part(builder, rest[0])
                ptr = builder.gep(pa.data, [builder.add(at_v, builder.mul(ps_v, i64(k)))])
                builder.call(st, [bits, builder.bitcast(ptr, h32.as_pointer()), ir.Constant(i32, 2), row])
            each_part(builder, parts_v, store_part)
            return context.get_dummy_value()
        return sig, codegen
    return split_flat


SPLITS: dict = {}


def split_for(kc: int):
    """The split_flat intrinsic of KC, made once per process."""
    if kc not in SPLITS:
        SPLITS[kc] = _split_intrinsic(kc)
    return SPLITS[kc]


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_amx import blocks_for, release
from ingot.backends.cpu.conv_spatial import EPILOGUES
from ingot.backends.cpu.matmul_amx import split_for

config, block22, block14 = blocks_for({kc}, {precision!r}, False)
split_flat = split_for({kc})
copy = EPILOGUES[{key!r}]
KC = {kc}


@njit(cache=True, nogil=True)
def emit(ctx, scratch, acc, r0, n0):
    # accumulator acc ([16 rows][16 columns]) into out [M, N] at rows r0.., columns n0..
    of, m_rows, n = ctx
    for r in range(min(16, m_rows - r0)):
        at = (r0 + r) * n + n0
        copy(of, at, scratch, acc * 256 + 16 * r, n - n0, 0, at, ())


@njit(cache=True, nogil=True)
def prepare_band(x, planes, pctx, ready, b1):
    # x's rows ..16 b1 past the `ready` ones split into planes [chunks][pl rows][KC]; the rows now ready
    parts, part_size, pl, chunks = pctx
    m_rows, k = x.shape
    xf = x.reshape(m_rows * k)
    need = min(16 * b1, m_rows)
    for c in range(chunks):
        for r in range(ready, need):
            split_flat(planes, (c * pl + r) * KC, part_size, parts, xf, r * k + c * KC, min(KC, k - c * KC))
    return max(need, ready)
""" + BANDS + """

@njit(cache=True, nogil=True)
def kernel(x, planes, parts, part_size, pl, chunks, w, bias_t, offs, n_tiles, band, out, scratch):
    # x [M, K] float32 -> planes a band of row tiles at a time, just before it (`bands`); w, bias_t:
    # conv_amx.Geometry.weights of w.T as a 1x1 conv; out [M, N].
    m_rows, n = out.shape
    bands(x, planes, (parts, part_size, pl, chunks), parts, part_size, w, bias_t, offs, n_tiles, band, scratch,
          (out.reshape(m_rows * n), m_rows, n))
"""


def driver(kc: int, precision: str):
    """The numba kernel of KC and a precision (generated, cached on disk)."""
    key = conv_spatial.steps_key([], [])
    conv_spatial.epilogue_for(key, [], [])   # no steps: a masked copy
    return conv_spatial.load(f"# amx matmul {REVISION}\n" + _DRIVER.format(kc=kc, precision=precision, key=key),
                             "kernel", "matmul_amx")


def step(rows: int, k: int, n: int, precision: str):
    """run(x, w, out_rows, bias=None): x [..., K] @ w [K, N] (+ bias [N]) into out_rows [rows, N]; w and
    bias constants, split once."""
    g = conv_amx.Geometry(k, 1, rows, n, 1, 1, 1, 1, 1, 1, 0, 0, 1, rows, precision)
    kernel = driver(g.kc, precision)
    planes = g.planes()
    scratch = np.zeros(1024 + 16, np.float32)
    cache: dict = {}

    def run(x, w, out_rows, bias=None):
        arranged = cache.get("w")
        if arranged is None:
            arranged = cache["w"] = g.weights(np.ascontiguousarray(np.asarray(w, np.float32).T), bias)
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, k)
        kernel(x2, planes, g.parts, g.part_size, g.pl, g.chunks, arranged[0], arranged[1], g.offs, g.n_tiles, g.band,
               out_rows, scratch)
    return run
