"""Recognise hand-written attention and replace it with one scaled_dot_product_attention node.

    matmul(softmax(cap(matmul(q, swap(k)) [* c | / c]) [+ mask | where(mask, ., -inf)], axis=-1), v)
        -> sdpa(q, k, v, mask, scale, softcap)

`swap` is a transpose of the last two axes (or a reshape to [N, T, D], a transpose and a reshape back),
c a constant scalar (either side of the multiply; or one on q and one on swap(k), whose product is the
scale), the additive mask either side of the add, and the probabilities may be NaN-guarded
(where(p != p, 0, p), HF's export); `cap` is optional: tanh(s / m) * m (or tanh(s * (1 / m)), the
product either way round) with one constant m, the logit softcap of Gemma 2. A sliding window written
by hand is a mask like any other. A missing scale means scale 1. The fused node must have the
type the matmul had, or nothing is rewritten.
"""
from __future__ import annotations

import math

from ..errors import IngotError
from ..ir import Node, Op, Program
from ..ops import infer_type
from . import Context, graph_rewrite


def _scalar(node: Node, ctx: Context) -> float | None:
    if node.op != Op.CONSTANT:
        return None
    value = ctx.program.constants[node.attrs["key"]]
    return float(value.reshape(-1)[0]) if value.size == 1 and value.dtype.kind in "fiu" else None


def _is_swap(node: Node) -> bool:
    perm = node.attrs.get("perm", ())
    r = len(perm)
    return node.op == Op.TRANSPOSE and r >= 2 and tuple(perm) == tuple(range(r - 2)) + (r - 1, r - 2)


def _scaled_scores(node: Node, ctx: Context) -> tuple[Node, Node, float] | None:
    """(q, k, scale) if node is matmul(q, swap(k)) [* c | / c], else None."""
    scale = 1.0
    if node.op in (Op.MUL, Op.DIV):
        a, b = node.src
        c = _scalar(b, ctx)
        if c is None and node.op == Op.MUL:
            c, a = _scalar(a, ctx), b
        if c is None or c == 0 or not math.isfinite(c):
            return None
        scale = c if node.op == Op.MUL else 1.0 / c
        node = a
    if node.op != Op.MATMUL:
        return None
    q, kt = node.src
    for side in ("q", "k"):   # the scale split over q and k^T (c each, c^2 = 1/sqrt(D): HF's export)
        operand = q if side == "q" else kt
        if operand.op != Op.MUL:
            continue
        for a, b in (operand.src, operand.src[::-1]):
            c = _scalar(b, ctx)
            if c is not None and c != 0 and math.isfinite(c):
                scale *= c
                q, kt = (a, kt) if side == "q" else (q, a)
                break
    k = _swapped(kt)
    if k is None:
        return None
    return q, k, scale


def _swapped(node: Node) -> Node | None:
    """k if node is k with its last two axes swapped: a transpose, or k [..., T, D] reshaped to [N, T, D],
    transposed to [N, D, T] and reshaped to [..., D, T]."""
    if _is_swap(node):
        return node.src[0]
    inner = node.src[0] if node.op == Op.RESHAPE else None
    if inner is None or inner.op != Op.TRANSPOSE or tuple(inner.attrs["perm"]) != (0, 2, 1) or inner.src[0].op != Op.RESHAPE:
        return None
    k = inner.src[0].src[0]
    ks, merged, out = k.type.shape, inner.src[0].type.shape, node.type.shape
    if k.type.rank < 2 or not k.type.static or not node.type.static or len(out) != len(ks) or \
            tuple(out) != tuple(ks[:-2]) + (ks[-1], ks[-2]) or tuple(merged[1:]) != tuple(ks[-2:]):
        return None
    return k


def _capped_scores(node: Node, ctx: Context) -> tuple[Node, Node, float, float] | None:
    """(q, k, scale, softcap) if node is [tanh(s / m) * m of] scaled scores s, else None."""
    found = _scaled_scores(node, ctx)
    if found is not None:
        return found + (0.0,)
    if node.op != Op.MUL:
        return None
    for t, outer in (node.src, node.src[::-1]):
        m = _scalar(outer, ctx)
        if t.op != Op.TANH or m is None or not math.isfinite(m) or m <= 0:
            continue
        inner = t.src[0]
        if inner.op == Op.DIV and _scalar(inner.src[1], ctx) == m:
            s = inner.src[0]
        elif inner.op == Op.MUL and _scalar(inner.src[1], ctx) is not None \
                and math.isclose(_scalar(inner.src[1], ctx) * m, 1.0, rel_tol=1e-6):
            s = inner.src[0]
        else:
            continue
        found = _scaled_scores(s, ctx)
        if found is not None:
            return found + (m,)
    return None


def _candidates(scores: Node, ctx: Context):
    """Every (q, k, scale, softcap, mask) reading of the softmax input."""
    found = _capped_scores(scores, ctx)
    if found is not None:
        yield found + (None,)
    if scores.op == Op.ADD:
        for s, mask in (scores.src, scores.src[::-1]):
            found = _capped_scores(s, ctx)
            if found is not None:
                yield found + (mask,)
    elif scores.op == Op.WHERE and _scalar(scores.src[2], ctx) == -math.inf:
        found = _capped_scores(scores.src[1], ctx)
        if found is not None:
            yield found + (scores.src[0],)


def _nan_guarded(node: Node, ctx: Context) -> Node:
    """p for where(p != p, 0, p) (a NaN row, from a row masked whole, zeroed: SDPA gives such rows zeros)."""
    if node.op == Op.WHERE and _scalar(node.src[1], ctx) == 0.0 and node.src[0].op == Op.NOT_EQUAL:
        p = node.src[2]
        if node.src[0].src[0] is p and node.src[0].src[1] is p:
            return p
    return node


def _fuse(node: Node, ctx: Context) -> Node | None:
    probs, v = node.src
    probs = _nan_guarded(probs, ctx)
    if probs.op != Op.SOFTMAX or probs.type.rank < 3 or probs.attrs["axis"] != probs.type.rank - 1:
        return None
    for q, k, scale, softcap, mask in _candidates(probs.src[0], ctx):
        if not q.type.rank == k.type.rank == v.type.rank == probs.type.rank:
            continue
        src = (q, k, v) + ((mask,) if mask is not None else ())
        attrs = {"scale": scale, "causal": False, "has_mask": mask is not None, "has_length": False}
        if softcap:
            attrs["softcap"] = softcap
        try:
            out_type = infer_type(Op.SDPA, [s.type for s in src], attrs)
        except IngotError:
            continue
        if out_type == node.type:
            return Node(Op.SDPA, out_type, src, attrs, node.name)
    return None


def fuse_attention(program: Program) -> tuple[Program, bool]:
    """Replace each hand-written attention with one SDPA node; returns (program, changed)."""
    return graph_rewrite(program, [((Op.MATMUL,), _fuse)], "fuse_attention")
