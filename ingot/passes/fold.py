"""Constant folding: an op whose inputs are all constants becomes a constant.

Skipped where folding would lose what the compiler is for: dequantize (that would be the float copy
of a quantized weight), a bfloat16 weight's cast to float32 (its float32 copy: backends multiply the
bf16 weight directly; float16 weights still fold, an x rounded to float16 could overflow),
broadcasts (bigger, not faster), and results over a size limit.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import GroupOp, Node, Op, Program, TensorType
from ..ops import reference
from . import Context, graph_rewrite

NO_FOLD = frozenset({Op.DEQUANTIZE, Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER, Op.QUANTIZED_GATHER_MATMUL, Op.BROADCAST_TO, Op.CALL, Op.IF, Op.GET_ITEM,
                     Op.ASSIGN, Op.ARRAY_VIEW}) | GroupOp.Source | GroupOp.Collective
MAX_ELEMENTS = 1 << 20


def widens_weight(node: Node) -> bool:
    """cast(c, float32) of a bfloat16 matrix constant: a weight that stays bf16 in memory."""
    return node.op == Op.CAST and node.src[0].op == Op.CONSTANT and node.dtype == dt.float32 and \
        node.src[0].dtype == dt.bfloat16 and node.type.rank >= 2


def _static_dim(node: Node, ctx: Context) -> Node | None:
    """dim(x, axis) of an axis compile has fixed is that number."""
    d = node.src[0].type.shape[node.attrs["axis"]]
    if d is None:
        return None
    key = f"folded_{node.id}"
    ctx.program.constants[key] = np.array(d, np.int32)
    return Node(Op.CONSTANT, node.type, (), {"key": key}, node.name or key)


def _fold(node: Node, ctx: Context) -> Node | None:
    if node.op == Op.DIM:
        return _static_dim(node, ctx)
    if node.op in NO_FOLD or not node.src or any(s.op != Op.CONSTANT for s in node.src) or widens_weight(node):
        return None
    if not isinstance(node.type, TensorType) or node.type.static and node.type.size > MAX_ELEMENTS:
        return None
    # a slice of a constant whose bounds are constants now (a dim() folded) has its length: computed,
    # the constant gets the static type its consumers are re-inferred from (no runtime length left)
    opened = not node.type.static and node.op == Op.SLICE and not node.type.dtype.packed
    if not node.type.static and not opened:
        return None
    store = ctx.program.constants
    value = np.asarray(reference(node.op, [store[s.attrs["key"]] for s in node.src], node.attrs))
    # np.ascontiguousarray would turn a 0-d result into shape (1,): keep the rank the type says
    value = np.array(value, dtype=node.dtype.storage, order="C", copy=True)
    typ = TensorType(value.shape, node.dtype) if opened else node.type
    if value.shape != dt.storage_shape(typ.shape, node.dtype) or value.size > MAX_ELEMENTS or any(
            d is not None and d != v for d, v in zip(node.type.shape, value.shape)):
        return None  # the reference disagrees with the type rule; leave the op to the backend
    key = f"folded_{node.id}"
    store[key] = value
    return Node(Op.CONSTANT, typ, (), {"key": key}, node.name or key)


def fold_constants(program: Program) -> tuple[Program, bool]:
    """Compute every constant subgraph now; returns (program, changed).

        >>> import numpy as np, ingot
        >>> from ingot.ir import Program
        >>> g = ingot.Graph()
        >>> y = g.constant(np.float32(2)) * 3.0
        >>> p, changed = fold_constants(Program([y.node], [], dict(g.constants)))
        >>> changed, p.outputs[0].op.name, float(p.constants[p.outputs[0].attrs["key"]])
        (True, 'CONSTANT', 6.0)
    """
    # fold adds to the store: work on a copy so the input program is left as it was
    program = program.with_roots(program.outputs, program.assigns)
    program.constants = dict(program.constants)
    return graph_rewrite(program, [(tuple(Op), _fold)], "fold")
