"""sdpa(q, slice(K, end=L), slice(V, end=L)) -> sdpa(q, K, V, length=L) (an int8 cache's scales too).

Attention over the valid part of a cache buffer, with a runtime length instead of a runtime
shape: every shape stays static (CUDA graphs need that) and the cache is read where it lies.
"""
from __future__ import annotations

import numpy as np

from ..ir import Node, Op, Program, Ref, freeze
from ..ops import infer_type
from . import Context, graph_rewrite


def _prefix(node: Node):
    """(buffer, length node) if node is buffer[..., :L, :] with L a runtime scalar, else None."""
    if node.op != Op.SLICE or node.attrs.get("size"):
        return None
    rank = node.type.rank
    start, end, step = node.attrs["start"], node.attrs["end"], node.attrs["step"]
    buffer = node.src[0]
    for axis in range(rank):
        if step[axis] != 1 or start[axis] != 0:
            return None
        if axis == rank - 2:
            if not isinstance(end[axis], Ref):
                return None
        elif end[axis] is not None and end[axis] != buffer.type.shape[axis]:
            return None
    return buffer, node.src[end[rank - 2].index]


def _same_value(a: Node, b: Node, constants: dict, depth: int = 4) -> bool:
    """a and b compute the same scalar (the same node, or the same op over the same sources: pos + 1 twice)."""
    if a is b:
        return True
    if depth == 0 or a.op != b.op or a.type != b.type or len(a.src) != len(b.src) or a.op in (Op.CALL, Op.IF):
        return False
    if a.op in (Op.PLACEHOLDER, Op.VARIABLE):
        return a.name == b.name
    if a.op == Op.CONSTANT:
        x, y = constants[a.attrs["key"]], constants[b.attrs["key"]]
        return x.size <= 16 and x.dtype == y.dtype and np.array_equal(x, y)
    return freeze(a.attrs) == freeze(b.attrs) and all(_same_value(x, y, constants, depth - 1) for x, y in zip(a.src, b.src))


def _rewrite(node: Node, ctx: Context) -> Node | None:
    if node.attrs.get("has_length") or node.attrs.get("has_mask"):
        return None
    k, v = _prefix(node.src[1]), _prefix(node.src[2])
    if k is None or v is None or not _same_value(k[1], v[1], ctx.program.constants):
        return None
    attrs = dict(node.attrs, has_length=True)
    src = (node.src[0], k[0], v[0], k[1])
    if node.attrs.get("kv_scales"):   # an int8 cache: its row scales are prefixes of the same length
        scales = [_prefix(s) for s in node.src[-2:]]
        if any(s is None or not _same_value(s[1], k[1], ctx.program.constants) for s in scales):
            return None
        src += tuple(s[0] for s in scales)
    out = infer_type(Op.SDPA, [s.type for s in src], attrs)
    if out.shape != tuple(d if d is not None else o for d, o in zip(node.type.shape, out.shape)) or out.dtype != node.dtype:
        return None
    return Node(Op.SDPA, out, src, attrs, node.name)


def attention_over_buffer(program: Program) -> tuple[Program, bool]:
    """Rewrite attention over a runtime-length prefix of K/V into attention with a length; returns (program, changed)."""
    return graph_rewrite(program, [((Op.SDPA,), _rewrite)], "attention_length")
