"""Collapse chains of views into one: fewer steps at run time, same bytes.

    transpose(x, perm)      -> reshape(x)  when perm only moves axes of size 1
    reshape(reshape(x))     -> reshape(x)
    transpose(transpose(x)) -> transpose(x, composed perm)
    reshape(x) / transpose(x) that change nothing -> x

A decode step of a Llama graph has three such chains per attention head group (the [T, H*D] ->
[1, H, T, D] dance with T = 1); each becomes one reshape.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, TensorType
from . import Context, graph_rewrite


def _static(node: Node) -> bool:
    return isinstance(node.type, TensorType) and node.type.static


def _transpose(node: Node, ctx: Context) -> Node | None:
    (x,) = node.src
    perm = tuple(node.attrs["perm"])
    if perm == tuple(range(len(perm))):
        return x
    if x.op == Op.TRANSPOSE:
        inner = tuple(x.attrs["perm"])
        return node.replace(src=x.src, attrs={"perm": tuple(inner[p] for p in perm)})
    if _static(x):
        moved = [p for p in perm if x.type.shape[p] != 1]
        if moved == sorted(moved):  # the data keep their order: a reshape
            return Node(Op.RESHAPE, node.type, (x,), {"shape": tuple(node.type.shape)}, node.name)
    return None


def _reshape(node: Node, ctx: Context) -> Node | None:
    (x,) = node.src
    if not _static(node):
        return None
    if x.op == Op.RESHAPE:
        return Node(Op.RESHAPE, node.type, x.src, {"shape": tuple(node.type.shape)}, node.name)
    if x.type == node.type:
        return x
    if tuple(node.attrs["shape"]) != tuple(node.type.shape):  # resolve -1 once shapes are known
        return node.replace(attrs={"shape": tuple(node.type.shape)})
    return None


def simplify_views(program: Program) -> tuple[Program, bool]:
    return graph_rewrite(program, [((Op.TRANSPOSE,), _transpose), ((Op.RESHAPE,), _reshape)], "simplify_views")
