"""Recognise RMSNorm and GELU written out op by op (as ONNX exporters write T5's and BERT's layers) and
replace each by its one op, so that every backend runs one kernel where the export had five to ten steps.

    x * (1 / sqrt(mean(x * x | x ^ 2, axis=-1) + eps)) [* w]     -> rms_norm(x, w, eps)
    x / sqrt(mean(x * x | x ^ 2, axis=-1) + eps) [* w]           -> rms_norm(x, w, eps)
    x * rsqrt(mean(...) + eps) [* w]                              -> rms_norm(x, w, eps)
    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))     -> gelu(x, approximate="tanh")
    0.5 * x * (1 + erf(x / sqrt(2) | x * (1 / sqrt(2))))          -> gelu(x)

Products in either order, eps and w constants (w of shape [D] or broadcast to it), the mean over the
last axis with kept dims, x float32. The fused node must have the type of the node it replaces, or
nothing is rewritten.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import Node, Op, Program, TensorType
from ..ops import infer_type
from . import Context, graph_rewrite

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
SQRT_2 = math.sqrt(2.0)


def _scalar(node: Node, ctx: Context) -> float | None:
    if node.op != Op.CONSTANT:
        return None
    value = ctx.program.constants[node.attrs["key"]]
    return float(np.asarray(value).reshape(-1)[0]) if value.size == 1 and value.dtype.kind == "f" else None


def _close(value: float | None, want: float, rel: float = 1e-6) -> bool:
    return value is not None and abs(value - want) <= rel * abs(want)


def _operands(node: Node, op: Op) -> list[tuple[Node, Node]]:
    """(a, b) and (b, a) for a commutative node of op, else []."""
    if node.op != op:
        return []
    a, b = node.src
    return [(a, b), (b, a)]


def _is_square_of(node: Node, x: Node, ctx: Context) -> bool:
    if node.op == Op.MUL:
        return node.src[0] is x and node.src[1] is x
    return node.op == Op.POW and node.src[0] is x and _scalar(node.src[1], ctx) == 2.0


def _inverse_rms(node: Node, x: Node, ctx: Context) -> float | None:
    """eps if node is 1 / sqrt(mean(x^2, -1) + eps) or rsqrt(mean(x^2, -1) + eps), else None."""
    if node.op == Op.DIV and _scalar(node.src[0], ctx) == 1.0 and node.src[1].op == Op.SQRT:
        inner = node.src[1].src[0]
    elif node.op == Op.RSQRT:
        inner = node.src[0]
    else:
        return None
    return _mean_square_plus_eps(inner, x, ctx)


def _mean_square_plus_eps(node: Node, x: Node, ctx: Context) -> float | None:
    for mean, eps in _operands(node, Op.ADD):
        e = _scalar(eps, ctx)
        rank = x.type.rank
        if rank == 0 or e is None or e < 0 or mean.op != Op.MEAN or not mean.attrs.get("keepdims") or \
                tuple(a % rank for a in mean.attrs["axes"]) != (rank - 1,):
            continue
        if _is_square_of(mean.src[0], x, ctx):
            return e
    return None


def _normalized(node: Node, ctx: Context) -> tuple[Node, float] | None:
    """(x, eps) if node is x * inverse_rms(x) or x / sqrt(mean(x^2) + eps), else None."""
    if node.op == Op.DIV and node.src[1].op == Op.SQRT:
        x = node.src[0]
        eps = _mean_square_plus_eps(node.src[1].src[0], x, ctx)
        return (x, eps) if eps is not None else None
    for x, inv in _operands(node, Op.MUL):
        eps = _inverse_rms(inv, x, ctx)
        if eps is not None:
            return x, eps
    return None


def _rms_norm(node: Node, ctx: Context) -> Node | None:
    if node.dtype.name != "float32" or not node.type.static or node.type.rank < 1:
        return None
    found, weight = _normalized(node, ctx), None
    if found is None:   # (the rewrite runs sources first: the normalisation may be an rms_norm already)
        for inner, w in _operands(node, Op.MUL):
            found = (inner.src[0], inner.attrs["eps"]) if inner.op == Op.RMS_NORM and len(inner.src) == 1 \
                else _normalized(inner, ctx)
            if found is not None and w.op == Op.CONSTANT and w.dtype.name == "float32" and \
                    all(d == 1 for d in w.type.shape[:-1]) and w.type.shape[-1:] == node.type.shape[-1:]:
                weight = w
                break
            found = None
    if found is None:
        return None
    x, eps = found
    if x.dtype.name != "float32" or x.type != node.type:
        return None
    if weight is not None and weight.type.rank != 1:
        key = f"rms_weight_{weight.id}"
        ctx.program.constants[key] = np.ascontiguousarray(ctx.program.constants[weight.attrs["key"]].reshape(-1))
        weight = Node(Op.CONSTANT, TensorType((weight.type.shape[-1],), weight.dtype), (), {"key": key}, key)
    src = (x,) if weight is None else (x, weight)
    attrs = {"eps": eps}
    if infer_type(Op.RMS_NORM, [s.type for s in src], attrs) != node.type:
        return None
    return Node(Op.RMS_NORM, node.type, src, attrs, node.name)


def _cube_of(node: Node, x: Node, ctx: Context) -> bool:
    if node.op == Op.POW:
        return node.src[0] is x and _scalar(node.src[1], ctx) == 3.0
    return any(a is x and _is_square_of(b, x, ctx) for a, b in _operands(node, Op.MUL))


def _gelu_tail(node: Node, x: Node, ctx: Context) -> str | None:
    """"tanh" if node is 1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)), "none" if it is 1 + erf(x / sqrt(2))
    (or x * (1 / sqrt(2))): gelu's approximate attribute; else None."""
    for one, t in _operands(node, Op.ADD):
        if _scalar(one, ctx) != 1.0:
            continue
        if t.op == Op.ERF:
            inner = t.src[0]
            if inner.op == Op.DIV and inner.src[0] is x and _close(_scalar(inner.src[1], ctx), SQRT_2):
                return "none"
            if any(a is x and _close(_scalar(c, ctx), 1 / SQRT_2) for a, c in _operands(inner, Op.MUL)):
                return "none"
        if t.op != Op.TANH:
            continue
        for c, inner in _operands(t.src[0], Op.MUL):
            if not _close(_scalar(c, ctx), SQRT_2_OVER_PI):
                continue
            for a, cubic in _operands(inner, Op.ADD):
                if a is x and any(_close(_scalar(k, ctx), 0.044715) and _cube_of(cube, x, ctx)
                                  for k, cube in _operands(cubic, Op.MUL)):
                    return "tanh"
    return None


def _gelu(node: Node, ctx: Context) -> Node | None:
    """0.5 * x * tail in any association: (x * 0.5) * tail, (x * tail) * 0.5, x * (0.5 * tail)."""
    if node.dtype.name != "float32" or node.op != Op.MUL:
        return None
    for a, b in _operands(node, Op.MUL):
        for x, half in _operands(a, Op.MUL):        # (x * 0.5) * tail
            if _scalar(half, ctx) == 0.5 and (form := _gelu_tail(b, x, ctx)):
                return _gelu_node(node, x, form)
        if _scalar(b, ctx) == 0.5:                   # (x * tail) * 0.5
            for x, tail in _operands(a, Op.MUL):
                if form := _gelu_tail(tail, x, ctx):
                    return _gelu_node(node, x, form)
        for half, tail in _operands(b, Op.MUL):      # x * (0.5 * tail)
            if _scalar(half, ctx) == 0.5 and (form := _gelu_tail(tail, a, ctx)):
                return _gelu_node(node, a, form)
    return None


def _gelu_node(node: Node, x: Node, approximate: str) -> Node | None:
    if x.type != node.type:
        return None
    return Node(Op.GELU, node.type, (x,), {"approximate": approximate}, node.name)


def fuse_norms(program: Program) -> tuple[Program, bool]:
    """Replace written-out RMSNorms and GELUs by their ops; returns (program, changed)."""
    program = program.with_roots(program.outputs, program.assigns)
    program.constants = dict(program.constants)
    return graph_rewrite(program, [((Op.MUL, Op.DIV), _rms_norm), ((Op.MUL,), _gelu)], "fuse_norms")
