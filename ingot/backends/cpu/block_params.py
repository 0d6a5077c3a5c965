"""Block parameters [nb, N] (scale, offset) as the CPU GEMV kernels take them, and how they read them.

An array: float32, or float16 as its uint16 bits (numba has no float16). Or two-level (the :k
formats as stored: passes/fuse_two_level.py): a tuple (codes uint8 [nb, N], units [nb / S, N] as
float16 bits, S) whose parameter is code * unit. A kernel takes a block's row with param_rows and
reads entry i with param where it uses it, so float16 is widened (VCVTPH2PS) and codes multiplied
by their unit inside the loop that consumes them, never in a pass of their own. The VNNI kernels
(vnni.BlockIR) read 16 at a time the same way.
"""
from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import types
from numba.extending import intrinsic, overload


def _host_has_f16c() -> bool:
    """True where LLVM widens float16 in hardware for the host numba compiles for (x86 with F16C:
    VCVTPH2PS, 16 a instruction; ARM64 natively); elsewhere half_to_float shifts the bits."""
    try:
        import llvmlite.binding as llvm
        machine = platform.machine().lower()
        if machine in ("aarch64", "arm64"):
            return True
        return machine in ("x86_64", "amd64") and numba.config.CPU_NAME in (None, "host") \
            and bool(llvm.get_host_cpu_features().get("f16c"))
    except Exception:
        return False


F16C = _host_has_f16c()
_TWO_POW_112 = 5.192296858534828e33   # 2**112, the difference of the float32 and float16 exponent biases


@intrinsic
def half_to_float(typingctx, h):
    """The float32 value of float16 bits h (uint16; numba has no float16): `fpext half` where the
    host widens in hardware (in a loop LLVM vectorises it to VCVTPH2PS), else the float16 exponent
    and mantissa shifted into a float32 and scaled by 2**112. Exact for every finite value, zeros and
    subnormals included."""
    if h != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        (bits,) = args
        if F16C:
            return builder.fpext(builder.bitcast(bits, llvm_ir.HalfType()), llvm_ir.FloatType())
        i32 = llvm_ir.IntType(32)
        wide = builder.zext(bits, i32)
        magnitude = builder.shl(builder.and_(wide, llvm_ir.Constant(i32, 0x7FFF)), llvm_ir.Constant(i32, 13))
        sign = builder.shl(builder.and_(wide, llvm_ir.Constant(i32, 0x8000)), llvm_ir.Constant(i32, 16))
        shifted = builder.bitcast(builder.or_(magnitude, sign), llvm_ir.FloatType())
        return builder.fmul(shifted, llvm_ir.Constant(llvm_ir.FloatType(), _TWO_POW_112))
    return types.float32(types.uint16), codegen


def param_blocks(p):
    """nb, the blocks of k that parameters p cover."""
    return p.shape[0]


def param_rows(p, b, lo, hi):
    """Block b's parameters for columns lo..hi (views; the units' row for a two-level p)."""
    return p[b, lo:hi]


def param(row, i):
    """Entry i of a param_rows row as float32: float32 parameters as they are, float16 ones widened
    where the kernel reads them (a loop over a block's parameters vectorises with the widening
    inside it), two-level ones as the code times the widened unit."""
    return row[i]


_inline = dict(inline="always", jit_options=dict(fastmath=True, nogil=True))


@overload(param_blocks, **_inline)
def _param_blocks(p):
    if isinstance(p, types.BaseTuple):
        return lambda p: p[0].shape[0]
    return lambda p: p.shape[0]


@overload(param_rows, **_inline)
def _param_rows(p, b, lo, hi):
    if isinstance(p, types.BaseTuple):
        return lambda p, b, lo, hi: (p[0][b, lo:hi], p[1][b // p[2], lo:hi])
    return lambda p, b, lo, hi: p[b, lo:hi]


@overload(param, **_inline)
def _param(row, i):
    if isinstance(row, types.BaseTuple):
        return lambda row, i: np.float32(row[0][i]) * half_to_float(row[1][i])
    if row.dtype == types.uint16:
        return lambda row, i: half_to_float(row[i])
    return lambda row, i: row[i]


def param_columns(p):
    """N, the columns of parameters p."""
    return p.shape[1]


def unit_row(p, b):
    """The row of block b's units in a two-level p (b // S); b for an array."""
    return b


@overload(param_columns, **_inline)
def _param_columns(p):
    if isinstance(p, types.BaseTuple):
        return lambda p: p[0].shape[1]
    return lambda p: p.shape[1]


@overload(unit_row, **_inline)
def _unit_row(p, b):
    if isinstance(p, types.BaseTuple):
        return lambda p, b: b // p[2]
    return lambda p, b: b
