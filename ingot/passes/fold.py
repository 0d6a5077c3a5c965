"""Constant folding: an op whose inputs are all constants becomes a constant.

Skipped where folding would lose what the compiler is for: dequantize (that would be the float copy
of a quantized weight), broadcasts (bigger, not faster), and results over a size limit.
"""
from __future__ import annotations

import numpy as np

from ..ir import GroupOp, Node, Op, Program, TensorType
from ..ops import reference
from . import Context, graph_rewrite

NO_FOLD = frozenset({Op.DEQUANTIZE, Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER, Op.BROADCAST_TO, Op.CALL, Op.GET_ITEM,
                     Op.ASSIGN, Op.ARRAY_VIEW}) | GroupOp.Source
MAX_ELEMENTS = 1 << 20


def _fold(node: Node, ctx: Context) -> Node | None:
    if node.op in NO_FOLD or not node.src or any(s.op != Op.CONSTANT for s in node.src):
        return None
    if not isinstance(node.type, TensorType) or not node.type.static or node.type.size > MAX_ELEMENTS:
        return None
    store = ctx.program.constants
    value = np.ascontiguousarray(reference(node.op, [store[s.attrs["key"]] for s in node.src], node.attrs))
    key = f"folded_{node.id}"
    store[key] = value
    return Node(Op.CONSTANT, node.type, (), {"key": key}, node.name or key)


def fold_constants(program: Program) -> tuple[Program, bool]:
    return graph_rewrite(program, [(tuple(Op), _fold)], "fold")
