"""Fuse dequantize into its consumer so no float copy of a quantized weight ever exists.

    matmul(x, dequantize(q, ...))             -> quantized_matmul(x, q, ..., transpose=False)
    matmul(x, transpose(dequantize(q, ...)))  -> quantized_matmul(x, q, ..., transpose=True)
    gather(dequantize(q, ...), idx, axis=0|1) -> quantized_gather(q, ..., idx, axis=0|1)
    gather(cast(w_bf16, float32), idx)        -> cast(gather(w_bf16, idx), float32)
    gather_matmul(x, dequantize(q, ...), idx) -> quantized_gather_matmul(x, idx, q, ...)   (experts)
    conv(x, dequantize(q_const, ...))         -> conv(x, w_float_const)     (dequantized at load)
    sdpa(q, dequantize(kc, ks), dequantize(vc, vs), ...) -> sdpa(q, kc, vc, ..., ks, vs, kv_scales=True)
                                                (an int8 KV cache: codes and a float32 scale per row)
    dequantize(q, scale=1, ...) * c_const     -> dequantize(q, scale=c, ...) (a weight-only quantization
                                                 written as cast and multiply; the same float32 products)

A convolution's weight is the exception: it is dequantized once, at compile. A conv reads each weight
once per output position (hundreds of times per run), so a kernel over int8 weights would convert
them on every use or keep a float tile of them anyway, and conv weights are small (MobileNetV2's are
2.2 M values: 8.8 MB as float32 against 2.2 MB). The float conv keeps its BLAS path and epilogue
fusion; the dequantize no longer runs on every call (tests/test_onnx_qdq.py measures both).

A bf16 weight's widening cast (kept by fold) is left to the matmul that reads it: backends
multiply the narrow weight directly (CUDA) or widen it once at load (CPU). A gather of it takes
the rows it needs first, so the cast is of those rows only.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Node, Op, Program, TensorType
from ..ops import infer_type, reference
from . import Context, graph_rewrite
from .fold import widens_weight


def _typed(op: Op, src: tuple[Node, ...], attrs: dict):
    try:
        return infer_type(op, [s.type for s in src], attrs)
    except IngotError:
        return None


def _matmul(node: Node, ctx: Context) -> Node | None:
    x, w = node.src
    transpose = False
    if w.op == Op.TRANSPOSE and tuple(w.attrs["perm"]) == (1, 0):
        w, transpose = w.src[0], True
    if w.op != Op.DEQUANTIZE or w.type.rank != 2 or x.type.rank < 1 or w.dtype != x.dtype:
        return None
    attrs = {k: v for k, v in w.attrs.items()}
    attrs["transpose"] = transpose
    src = (x,) + w.src
    out = _typed(Op.QUANTIZED_MATMUL, src, attrs)
    if out != node.type:
        return None
    return Node(Op.QUANTIZED_MATMUL, out, src, attrs, node.name)


def _gather(node: Node, ctx: Context) -> Node | None:
    table, idx = node.src
    if table.op != Op.DEQUANTIZE or table.type.rank != 2 or node.attrs["axis"] not in (0, 1):
        return None
    src = table.src + (idx,)
    attrs = dict(table.attrs, axis=node.attrs["axis"])
    out = _typed(Op.QUANTIZED_GATHER, src, attrs)
    if out != node.type:
        return None
    return Node(Op.QUANTIZED_GATHER, out, src, attrs, node.name)


def _gather_matmul(node: Node, ctx: Context) -> Node | None:
    x, w, idx = node.src
    if w.op != Op.DEQUANTIZE:
        return None
    src = (x, idx) + w.src
    out = _typed(Op.QUANTIZED_GATHER_MATMUL, src, dict(w.attrs))
    if out != node.type:
        return None
    return Node(Op.QUANTIZED_GATHER_MATMUL, out, src, dict(w.attrs), node.name)


def _gather_then_cast(node: Node, ctx: Context) -> Node | None:
    table, idx = node.src
    if not widens_weight(table):
        return None
    narrow = table.src[0]
    rows = _typed(Op.GATHER, (narrow, idx), node.attrs)
    if rows is None:
        return None
    gathered = Node(Op.GATHER, rows, (narrow, idx), dict(node.attrs), node.name)
    out = _typed(Op.CAST, (gathered,), table.attrs)
    if out != node.type:
        return None
    return Node(Op.CAST, out, (gathered,), dict(table.attrs), node.name)


def _scaled(node: Node, ctx: Context) -> Node | None:
    deq, c = node.src if node.src[0].op == Op.DEQUANTIZE else node.src[::-1]
    if deq.op != Op.DEQUANTIZE or c.op != Op.CONSTANT or deq.attrs["mode"] != "affine" or deq.attrs.get("has_bias") \
            or node.type != deq.type or c.dtype != deq.dtype or deq.src[1].op != Op.CONSTANT:
        return None
    store = ctx.program.constants
    if np.any(store[deq.src[1].attrs["key"]] != 1):   # (q * s) * c is not q * (s * c) in float32 unless s is 1
        return None
    value = store[c.attrs["key"]]
    rank = deq.type.rank
    if value.ndim > rank:
        return None
    value = value.reshape((1,) * (rank - value.ndim) + value.shape)
    if any(d not in (1, q) for d, q in zip(value.shape, deq.type.shape)):   # a block-broadcast parameter
        return None
    key = f"scale_{node.id}"
    store[key] = np.ascontiguousarray(value)
    scale = Node(Op.CONSTANT, TensorType(value.shape, c.dtype), (), {"key": key}, key)
    return Node(Op.DEQUANTIZE, deq.type, (deq.src[0], scale) + deq.src[2:], dict(deq.attrs), node.name)


def _conv_weight(node: Node, ctx: Context) -> Node | None:
    w = node.src[1]
    if w.op != Op.DEQUANTIZE or any(s.op != Op.CONSTANT for s in w.src) or not w.type.static:
        return None
    store = ctx.program.constants
    key = f"dequantized_{w.id}"
    if key not in store:
        value = reference(Op.DEQUANTIZE, [store[s.attrs["key"]] for s in w.src], w.attrs)
        store[key] = np.ascontiguousarray(value, dtype=w.dtype.storage)
    weight = Node(Op.CONSTANT, w.type, (), {"key": key}, w.name or key)
    return node.replace(src=(node.src[0], weight) + node.src[2:])


def _row_codes(node: Node) -> tuple[Node, Node] | None:
    """(codes, scales) when node dequantizes int8 rows [..., T, D] by one float32 scale a row [..., T, 1]
    into float32, else None."""
    a = node.attrs
    if node.op != Op.DEQUANTIZE or a["mode"] != "affine" or a.get("has_zero_point") or a.get("has_bias") or \
            a.get("two_level") or node.src[0].dtype != dt.int8 or node.dtype != dt.float32 or node.type.rank < 3:
        return None
    codes, scales = node.src
    if scales.dtype != dt.float32 or scales.type.shape != codes.type.shape[:-1] + (1,):
        return None
    return codes, scales


def _attention(node: Node, ctx: Context) -> Node | None:
    if node.attrs.get("kv_scales"):
        return None
    k, v = _row_codes(node.src[1]), _row_codes(node.src[2])
    if k is None or v is None:
        return None
    src = (node.src[0], k[0], v[0]) + node.src[3:] + (k[1], v[1])
    attrs = dict(node.attrs, kv_scales=True)
    if _typed(Op.SDPA, src, attrs) != node.type:
        return None
    return Node(Op.SDPA, node.type, src, attrs, node.name)


def fuse_dequantize(program: Program) -> tuple[Program, bool]:
    """Fuse every dequantize into the matmul or gather that reads it; returns (program, changed)."""
    program = program.with_roots(program.outputs, program.assigns)
    program.constants = dict(program.constants)   # conv weights dequantized at load are added to a copy
    return graph_rewrite(program, [((Op.MATMUL,), _matmul), ((Op.GATHER,), _gather), ((Op.GATHER,), _gather_then_cast),
                                   ((Op.GATHER_MATMUL,), _gather_matmul), ((Op.CONV,), _conv_weight),
                                   ((Op.MUL,), _scaled), ((Op.SDPA,), _attention)],
                         "fuse_dequantize")
