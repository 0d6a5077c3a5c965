"""Quantization ops: quantize, dequantize (affine or lookup table), quantized_matmul, quantized_gather.

Parameters (scale, zero point, bias, table) are *block-broadcast*: they have the rank of q and each
of their dimensions divides q's (1: shared along that axis; equal: one per element; otherwise one
per block of q.shape[i] / p.shape[i] elements). Scalar, per-axis and per-block parameters are all
this one form; the builder reshapes what the user gives into it. A lookup table has one extra
trailing axis of 2**bits entries.

Affine:      w = (q - zero_point) * scale + bias        (zero_point and bias optional)
LUT:         w = lut[group(q), q]
Scaled LUT:  w = lut[group(q), q] * scale (+ bias)    (mode "scaled_lut"; params lut, scale[, bias])

The scaled LUT is the form of GGUF's non-linear and codebook types (IQ4_NL/XS, the IQ2/IQ3/IQ1
grids, MXFP4): each weight's code picks a value of a small table, and a per-block scale multiplies
it, in float32 (the product gguf.quants.dequantize forms, bit for bit). With attrs["has_bias"] a
per-block bias is added after the product (Ingot's lut4:bB:offset format); without it the op is as
it always was. The CPU's table GEMV and the GPU's (backends/cuda/quantized_matmul/gguf_kernels.py)
add the bias's share (x's block sums times the bias) themselves.

4-bit tensors are packed two per byte along the last axis, which must be even.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import fail, register

QUANT_DTYPES = (dt.int8, dt.uint8, dt.int4, dt.uint4)
RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15)}


MODES = ("affine", "lut", "scaled_lut")


def param_count(attrs) -> int:
    mode = attrs["mode"]
    if mode == "lut":
        return 1
    if mode == "scaled_lut":
        return 2 + bool(attrs.get("has_bias"))
    return (1 + bool(attrs.get("has_zero_point")) + bool(attrs.get("has_bias"))) * (2 if attrs.get("two_level") else 1)


def two_level_products(params, attrs) -> list:
    """A quantized op's block parameters as arrays: as they are, or with attrs["two_level"] = S (the
    :k formats as stored, fused by passes/fuse_two_level.py) from their (codes, units) pairs: codes
    uint8 [nb, N] times units [nb / S, N], one unit per S blocks along axis 0, in float32 (exact:
    the products of 8-bit codes and float16 units)."""
    if not attrs.get("two_level"):
        return list(params)
    per_super = attrs["two_level"]
    return [codes.astype(np.float32) * np.repeat(units.astype(np.float32), per_super, axis=0)
            for codes, units in zip(params[0::2], params[1::2])]


def _check_two_level(op, types, params, attrs):
    """The (codes, units) pairs of a two-level op; returns the codes, whose shapes are the parameters'."""
    per_super = attrs["two_level"]
    if attrs["mode"] != "affine" or attrs.get("has_zero_point") or not isinstance(per_super, int) or per_super < 1:
        raise fail(op, types, "two-level parameters only for affine weights without zero points")
    codes, units = params[0::2], params[1::2]
    for c, u in zip(codes, units):
        if (c.dtype != dt.uint8 or not u.dtype.is_float or c.rank != 2 or u.rank != 2 or not c.static or not u.static
                or c.shape[0] % per_super or u.shape != (c.shape[0] // per_super, c.shape[1])):
            raise fail(op, types, f"two-level parameters: uint8 codes [nb, N] and float units [nb / {per_super}, N]")
    return codes


def _check_params(op, types, q_shape, params, mode, qdtype):
    for i, p in enumerate(params):
        table = mode == "lut" or (mode == "scaled_lut" and i == 0)
        p_shape = p.shape[:-1] if table else p.shape
        # (a dynamic dimension: one parameter per element, the same dynamic dimension as q's)
        if len(p_shape) != len(q_shape) or any((pd is None) != (qd is None) if pd is None else (qd is not None and (pd == 0 or qd % pd))
                                               for pd, qd in zip(p_shape, q_shape)):
            raise fail(op, types, f"parameters whose dims divide {q_shape} (block-broadcast), not {p.shape}")
        if table and p.shape[-1] != 2 ** qdtype.bits:
            raise fail(op, types, f"a table of {2 ** qdtype.bits} entries for {qdtype.name}")


def _dequantize_rule(types, attrs):
    q, params = types[0], types[1:]
    qdtype = attrs["qdtype"]
    if q.dtype != qdtype or q.dtype not in QUANT_DTYPES:
        raise fail(Op.DEQUANTIZE, types, "an int8, uint8, int4 or uint4 input")
    if q.dtype.packed and q.shape and q.shape[-1] is not None and q.shape[-1] % 2:
        raise fail(Op.DEQUANTIZE, types, "an even last axis for a packed 4-bit tensor")
    if attrs["mode"] not in MODES:
        raise fail(Op.DEQUANTIZE, types, f"a mode among {', '.join(MODES)}, not {attrs['mode']!r}")
    if len(params) != param_count(attrs):
        raise fail(Op.DEQUANTIZE, types, "float scale (and zero point, bias) or a float lookup table")
    if attrs.get("two_level"):
        params = _check_two_level(Op.DEQUANTIZE, types, params, attrs)
    elif any(not p.dtype.is_float for p in params):
        raise fail(Op.DEQUANTIZE, types, "float scale (and zero point, bias) or a float lookup table")
    _check_params(Op.DEQUANTIZE, types, q.shape, params, attrs["mode"], qdtype)
    return TensorType(q.shape, attrs["dtype"])


def unpack(q: np.ndarray, qdtype: dt.DType) -> np.ndarray:
    if qdtype.packed:
        return dt.unpack_int4(q, q.shape[-1] * 2, signed=qdtype.kind == "i")
    return q


def expand(p: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Repeat a block-broadcast parameter up to `shape` (a broadcastable view where blocks are 1)."""
    for axis, (pd, d) in enumerate(zip(p.shape, shape)):
        if pd != d and pd != 1:
            p = np.repeat(p, d // pd, axis=axis)
    return p


def dequantize_values(q_values: np.ndarray, params, attrs) -> np.ndarray:
    """Dequantize already unpacked integers; params are block-broadcast arrays."""
    out_dtype = attrs["dtype"].numpy
    if attrs["mode"] == "lut":
        return _lookup(q_values, params[0]).astype(out_dtype)
    if attrs["mode"] == "scaled_lut":
        w = _lookup(q_values, params[0])
        w *= expand(params[1].astype(np.float32), q_values.shape)
        if attrs.get("has_bias"):
            w += expand(params[2].astype(np.float32), q_values.shape)
        return w.astype(out_dtype)
    it = iter(params)
    scale = next(it).astype(np.float32)
    w = q_values.astype(np.float32)
    if attrs.get("has_zero_point"):
        w = w - expand(next(it).astype(np.float32), q_values.shape)
    w = w * expand(scale, q_values.shape)
    if attrs.get("has_bias"):
        w = w + expand(next(it).astype(np.float32), q_values.shape)
    return w.astype(out_dtype)


def _lookup(q_values: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """float32 lut[group, q] for every integer of q_values (a fresh array)."""
    lut = lut.astype(np.float32)
    groups = lut.shape[:-1]
    idx = q_values.astype(np.intp)
    if not any(g != 1 for g in groups):
        return lut.reshape(-1)[idx]
    table = expand(lut, q_values.shape + (lut.shape[-1],))
    return np.take_along_axis(np.broadcast_to(table, q_values.shape + (lut.shape[-1],)), idx[..., None], axis=-1)[..., 0]


register(Op.DEQUANTIZE, _dequantize_rule,
         lambda xs, a: dequantize_values(unpack(xs[0], a["qdtype"]), xs[1:], a))


def _quantize_rule(types, attrs):
    x, params = types[0], types[1:]
    target = attrs["dtype"]
    if not x.dtype.is_float or target not in QUANT_DTYPES:
        raise fail(Op.QUANTIZE, types, "a float input and an int8, uint8, int4 or uint4 target")
    if target.packed and x.shape and x.shape[-1] is not None and x.shape[-1] % 2:
        raise fail(Op.QUANTIZE, types, "an even last axis for a packed 4-bit result")
    if attrs["mode"] not in ("affine", "lut"):
        raise fail(Op.QUANTIZE, types, f"mode 'affine' or 'lut', not {attrs['mode']!r}")
    if len(params) != (1 if attrs["mode"] == "lut" else 1 + bool(attrs.get("has_zero_point"))):
        raise fail(Op.QUANTIZE, types, "a scale (and zero point) or a lookup table")
    _check_params(Op.QUANTIZE, types, x.shape, params, attrs["mode"], target)
    return TensorType(x.shape, target)


def quantize_values(x: np.ndarray, params, attrs) -> np.ndarray:
    target: dt.DType = attrs["dtype"]
    lo, hi = RANGES[target.name]
    xf = x.astype(np.float32)
    if attrs["mode"] == "lut":
        lut = params[0].astype(np.float32)
        table = expand(lut, x.shape + (lut.shape[-1],))
        q = np.argmin(np.abs(xf[..., None] - table), axis=-1)
    else:
        q = np.round(xf / expand(params[0].astype(np.float32), x.shape))
        if attrs.get("has_zero_point"):
            q = q + expand(params[1].astype(np.float32), x.shape)
        q = np.clip(q, lo, hi)
    q = q.astype(np.int16)
    return dt.pack_int4(q) if target.packed else q.astype(target.numpy)


register(Op.QUANTIZE, _quantize_rule, lambda xs, a: quantize_values(xs[0], xs[1:], a))


def _quantized_matmul_rule(types, attrs):
    x, q = types[0], types[1]
    weight = _dequantize_rule(types[1:], attrs)
    if not x.dtype.is_float or q.rank != 2 or x.rank < 1:
        raise fail(Op.QUANTIZED_MATMUL, types, "a float input and a 2-D quantized weight")
    k, n = (q.shape[1], q.shape[0]) if attrs.get("transpose") else q.shape
    if x.shape[-1] is not None and k is not None and x.shape[-1] != k:
        raise fail(Op.QUANTIZED_MATMUL, types, f"inner dimensions that agree ({x.shape[-1]} vs {k})")
    del weight
    return TensorType(x.shape[:-1] + (n,), x.dtype)


def quantized_matmul_reference(xs, attrs, rows_per_tile: int = 1024):
    """x @ W (or x @ W.T) dequantizing W one tile of rows at a time: never a float copy of all of W."""
    x, q, params = xs[0], xs[1], two_level_products(xs[2:], attrs)
    qdtype = attrs["qdtype"]
    transpose = attrs.get("transpose", False)
    row_blocks = [q.shape[0] // p.shape[0] for p in params if p.shape[0] not in (1, q.shape[0])]
    if row_blocks:  # tiles must hold whole parameter blocks
        block = int(np.lcm.reduce(row_blocks))
        rows_per_tile = max(block, rows_per_tile // block * block)
    n = q.shape[0] if transpose else (q.shape[1] * (2 if qdtype.packed else 1))
    xf = x.astype(np.float32)
    out = np.empty(x.shape[:-1] + (n,), np.float32)
    if not transpose:  # W is [K, N]: tile over K rows and accumulate
        out[...] = 0
        k = q.shape[0]
        for r0 in range(0, k, rows_per_tile):
            r1 = min(k, r0 + rows_per_tile)
            w = _dequantize_rows(q, params, attrs, r0, r1)
            out += xf[..., r0:r1] @ w
        return out.astype(x.dtype)
    for r0 in range(0, n, rows_per_tile):  # W is [N, K]: tile over output rows
        r1 = min(n, r0 + rows_per_tile)
        w = _dequantize_rows(q, params, attrs, r0, r1)
        out[..., r0:r1] = xf @ w.T
    return out.astype(x.dtype)


def _dequantize_rows(q, params, attrs, r0, r1):
    rows = q.shape[0]
    sub = []
    for p in params:
        if p.shape[0] == 1:
            sub.append(p)
        else:
            block = rows // p.shape[0]
            if r0 % block or (r1 % block and r1 != rows):
                raise AssertionError("row tiles must align with parameter blocks")
            sub.append(p[r0 // block:(r1 + block - 1) // block])
    return dequantize_values(unpack(q[r0:r1], attrs["qdtype"]), sub, dict(attrs, dtype=dt.float32))


register(Op.QUANTIZED_MATMUL, _quantized_matmul_rule, quantized_matmul_reference)


def _quantized_gather_rule(types, attrs):
    weight = _dequantize_rule(types[:-1], attrs)
    idx = types[-1]
    axis = attrs.get("axis", 0)
    if idx.dtype not in (dt.int32, dt.int64) or weight.rank != 2 or axis not in (0, 1):
        raise fail(Op.QUANTIZED_GATHER, types, "a 2-D quantized table, int32/int64 indices and axis 0 or 1")
    if axis == 1:
        return TensorType(weight.shape[:1] + idx.shape, weight.dtype)
    return TensorType(idx.shape + weight.shape[1:], weight.dtype)


def quantized_gather_reference(xs, attrs):
    """Rows (axis 0) or columns (axis 1) of a quantized table, dequantizing only those taken."""
    q, params, idx = xs[0], xs[1:-1], xs[-1]
    qdtype = attrs["qdtype"]
    axis = attrs.get("axis", 0)
    n = q.shape[0] if axis == 0 else q.shape[1] * (2 if qdtype.packed else 1)
    flat = idx.reshape(-1).astype(np.intp)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        from ..errors import IngotError
        raise IngotError(f"quantized_gather: indices span {flat.min()}..{flat.max()} but axis {axis} of the table has {n} entries.")
    if attrs.get("two_level"):   # the columns' codes and units first (a tied embedding's rows of a k-major table)
        params = two_level_products([p[:, flat // (n // p.shape[1])] for p in params] if axis == 1 else params, attrs)
        if axis == 1:
            values = unpack(q, qdtype)[:, flat] if not qdtype.packed else _unpacked_columns(q, flat, qdtype)
            out = dequantize_values(values, params, attrs)
            return out.reshape(out.shape[:1] + idx.shape)
    if axis == 0:
        sub = [p if p.shape[0] == 1 else p[flat // (n // p.shape[0])] for p in params]
        out = dequantize_values(unpack(q[flat], qdtype), sub, attrs)
        return out.reshape(idx.shape + out.shape[1:])
    values = unpack(q, qdtype)[:, flat] if not qdtype.packed else _unpacked_columns(q, flat, qdtype)
    sub = [p if p.shape[1] == 1 else p[:, flat // (n // p.shape[1])] for p in params]
    out = dequantize_values(values, sub, attrs)
    return out.reshape(out.shape[:1] + idx.shape)


def _unpacked_columns(q, cols, qdtype):
    byte = q[:, cols // 2]
    nib = np.where(cols % 2 == 0, byte & 0xF, byte >> 4).astype(np.uint8)
    return ((nib.astype(np.int8) << 4) >> 4).astype(np.int8) if qdtype.kind == "i" else nib


register(Op.QUANTIZED_GATHER, _quantized_gather_rule, quantized_gather_reference)
