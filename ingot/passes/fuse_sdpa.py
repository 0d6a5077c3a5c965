"""Recognise hand-written attention and replace it with one scaled_dot_product_attention node.

    matmul(softmax(matmul(q, swap(k)) [* c | / c] [+ mask | where(mask, ., -inf)], axis=-1), v)
        -> sdpa(q, k, v, mask, scale)

`swap` is a transpose of the last two axes. A missing scale means scale 1.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import Node, Op, Program
from ..ops import infer_type
from . import Context, graph_rewrite


def _scalar(node: Node, ctx: Context) -> float | None:
    if node.op != Op.CONSTANT:
        return None
    value = ctx.program.constants[node.attrs["key"]]
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _is_swap(node: Node) -> bool:
    perm = node.attrs.get("perm", ())
    r = len(perm)
    return node.op == Op.TRANSPOSE and r >= 2 and tuple(perm) == tuple(range(r - 2)) + (r - 1, r - 2)


def _fuse(node: Node, ctx: Context) -> Node | None:
    probs, v = node.src
    if probs.op != Op.SOFTMAX or probs.attrs["axis"] != probs.type.rank - 1 or probs.type.rank < 3:
        return None
    scores = probs.src[0]
    mask = None
    if scores.op == Op.ADD:
        a, b = scores.src
        if a.op in (Op.MATMUL, Op.MUL, Op.DIV):
            scores, mask = a, b
        else:
            scores, mask = b, a
    elif scores.op == Op.WHERE and _scalar(scores.src[2], ctx) == -math.inf:
        mask, scores = scores.src[0], scores.src[1]
    scale = 1.0
    if scores.op in (Op.MUL, Op.DIV):
        a, b = scores.src
        c = _scalar(b, ctx)
        if c is None and scores.op == Op.MUL:
            c, b, a = _scalar(a, ctx), a, b
        if c is None or c == 0:
            return None
        scale = c if scores.op == Op.MUL else 1.0 / c
        scores = a
    if scores.op != Op.MATMUL or not _is_swap(scores.src[1]):
        return None
    q, k = scores.src[0], scores.src[1].src[0]
    if not (q.type.rank == k.type.rank == v.type.rank == probs.type.rank):
        return None
    src = (q, k, v) + ((mask,) if mask is not None else ())
    attrs = {"scale": scale, "causal": False, "has_mask": mask is not None, "has_length": False}
    try:
        out_type = infer_type(Op.SDPA, [s.type for s in src], attrs)
    except Exception:
        return None
    if out_type != node.type:
        return None
    return Node(Op.SDPA, out_type, src, attrs, node.name)


def fuse_attention(program: Program) -> tuple[Program, bool]:
    return graph_rewrite(program, [((Op.MATMUL,), _fuse)], "fuse_attention")


__all__ = ["fuse_attention", "np"]
