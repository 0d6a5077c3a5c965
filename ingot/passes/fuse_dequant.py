"""Fuse dequantize into its consumer so no float copy of a quantized weight ever exists.

    matmul(x, dequantize(q, ...))             -> quantized_matmul(x, q, ..., transpose=False)
    matmul(x, transpose(dequantize(q, ...)))  -> quantized_matmul(x, q, ..., transpose=True)
    gather(dequantize(q, ...), idx, axis=0|1) -> quantized_gather(q, ..., idx, axis=0|1)
    gather(cast(w_bf16, float32), idx)        -> cast(gather(w_bf16, idx), float32)
    gather_matmul(x, dequantize(q, ...), idx) -> quantized_gather_matmul(x, idx, q, ...)   (experts)

A bf16 weight's widening cast (kept by fold) is left to the matmul that reads it: backends
multiply the narrow weight directly (CUDA) or widen it once at load (CPU). A gather of it takes
the rows it needs first, so the cast is of those rows only.
"""
from __future__ import annotations

from ..errors import IngotError
from ..ir import Node, Op, Program
from ..ops import infer_type
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


def fuse_dequantize(program: Program) -> tuple[Program, bool]:
    """Fuse every dequantize into the matmul or gather that reads it; returns (program, changed)."""
    return graph_rewrite(program, [((Op.MATMUL,), _matmul), ((Op.GATHER,), _gather), ((Op.GATHER,), _gather_then_cast),
                                   ((Op.GATHER_MATMUL,), _gather_matmul)],
                         "fuse_dequantize")
