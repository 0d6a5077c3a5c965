"""A one-hot matrix times a table becomes a row gather: Magika (a file-type classifier shipped on PyPI)
embeds its 2048 bytes as cast(equal(x[..., None], arange(257)), float32) @ W [257, 64], a [2048, 257]
one-hot built and multiplied each run (1.1 ms of its 8.5), where the answer is W's rows at x.

    cast(equal(x [..., 1], c [1.., V]), float32) @ W [V, N]     -> gather(W', where(x < 0, V, min(x, V)))

c a constant holding 0..V-1 along its last axis (either operand of the equal), x integer, W' = W with
a zero row appended: an index outside 0..V-1 matches no column of the one-hot and gives a zero row,
as the product does (a W holding inf or NaN would give NaN rows in the product; the gather keeps
them to their own row).
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Node, Op, Program, TensorType
from ..ops import infer_type
from . import Context, graph_rewrite


def _node(op: Op, src: tuple[Node, ...], attrs: dict | None = None) -> Node:
    attrs = attrs or {}
    return Node(op, infer_type(op, [s.type for s in src], attrs), src, attrs)


def _constant(ctx: Context, array: np.ndarray, key: str) -> Node:
    ctx.program.constants[key] = array
    return Node(Op.CONSTANT, TensorType(array.shape, dt.from_numpy(array.dtype)), (), {"key": key}, key)


def _index_and_size(equal: Node, ctx: Context) -> tuple[Node, int] | None:
    """(x, V) if equal compares an integer x [..., 1] with a constant arange(V) along the last axis."""
    for x, c in (equal.src, equal.src[::-1]):
        if c.op != Op.CONSTANT or x.dtype.kind not in "iu" or x.dtype.packed or c.dtype.kind not in "iu" or not x.type.static or \
                x.type.rank < 1 or x.type.shape[-1] != 1:
            continue
        values = np.asarray(ctx.program.constants[c.attrs["key"]])
        if values.ndim < 1 or any(d != 1 for d in values.shape[:-1]) or values.ndim > x.type.rank:
            continue
        size = values.shape[-1]
        if size < 1 or not np.array_equal(values.reshape(-1), np.arange(size)):
            continue
        if tuple(equal.type.shape) == tuple(x.type.shape[:-1]) + (size,):
            return x, size
    return None


def _one_hot_matmul(node: Node, ctx: Context) -> Node | None:
    a, w = node.src
    if node.dtype.name != "float32" or a.op != Op.CAST or a.src[0].op != Op.EQUAL or w.type.rank != 2 or \
            not w.type.static or w.dtype.name != "float32":
        return None
    found = _index_and_size(a.src[0], ctx)
    if found is None or w.type.shape[0] != found[1]:
        return None
    x, size = found
    idx = _node(Op.RESHAPE, (x,), {"shape": tuple(x.type.shape[:-1])})
    kind = x.dtype.numpy
    last = _constant(ctx, np.array(size, kind), f"one_hot_size_{node.id}")
    zero = _constant(ctx, np.array(0, kind), f"one_hot_zero_{node.id}")
    safe = _node(Op.WHERE, (_node(Op.LESS, (idx, zero)), last, _node(Op.MINIMUM, (idx, last))))
    if x.dtype.name not in ("int32", "int64"):
        safe = _node(Op.CAST, (safe,), {"dtype": dt.int64})
    padding = np.zeros((1, w.type.shape[1]), np.float32)
    if w.op == Op.CONSTANT:
        table = _constant(ctx, np.concatenate([np.asarray(ctx.program.constants[w.attrs["key"]], np.float32), padding]),
                          f"one_hot_table_{node.id}")
    else:
        table = _node(Op.CONCAT, (w, _constant(ctx, padding, f"one_hot_padding_{node.id}")), {"axis": 0})
    out = _node(Op.GATHER, (table, safe), {"axis": 0})
    return out.replace(name=node.name) if out.type == node.type else None


def fuse_one_hot(program: Program) -> tuple[Program, bool]:
    """Replace each one-hot @ table by a row gather; returns (program, changed)."""
    program = program.with_roots(program.outputs, program.assigns)
    program.constants = dict(program.constants)
    return graph_rewrite(program, [((Op.MATMUL,), _one_hot_matmul)], "fuse_one_hot")
