"""A rows decoder's per-row decode attentions (`ingot serve`'s continuous batching) as one FUSED
"rows_qkv_attention" op per layer, which the CPU backend runs as one kernel over all rows
(backends/cpu/rows_attention.py).

A rows decoder (models/blocks.py `row_attention`) gives each of its R rows its own position and
its own K/V cache variables, so after fuse_rope_cache a layer holds R "rope_qkv_attention" ops, each
reading row r of the layer's q, k and v ([R, h, 1, hd] sliced to [r:r+1]) and writing row r's
caches, and a CONCAT of their attention outputs along axis 0. This pass takes the R ops, their
slices and the concat whole: the fused op's outputs are the concat and each row's two caches (read
by the assigns), its body the per-row ops unchanged, so its reference is the per-row program's.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches


def _row_slice(node: Node, row: int) -> Node | None:
    """The tensor t when node is t[row:row + 1] along axis 0 (the rest whole), else None."""
    if node.op != Op.SLICE or node.type.rank < 1 or node.type.shape[0] != 1:
        return None
    a, src = node.attrs, node.src[0]
    if len(node.src) != 1 or a.get("size") is not None or any(s != 1 for s in a["step"]):
        return None
    rest_whole = all(s == 0 for s in a["start"][1:]) and all(e is None or e == d for e, d in
                                                            zip(a["end"][1:], src.type.shape[1:]))
    return src if a["start"][0] == row and a["end"][0] == row + 1 and rest_whole else None


def _row_inputs(fused: Node, row: int, users) -> list[tuple[Node, Node]] | None:
    """(slice, whole tensor) for each input of one row's rope_qkv_attention that is row `row` of a
    [R, ...] tensor read by nothing else (q, k, v); None unless there are three."""
    found = []
    for s in fused.src:
        whole = _row_slice(s, row)
        if whole is not None and len(users[s.id]) == 1:
            found.append((s, whole))
    return found if len(found) == 3 else None


def fuse_rows_attention(program: Program) -> tuple[Program, bool]:
    """Replace each layer's per-row rope_qkv_attention ops (two rows or more) by one FUSED node;
    returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches: list[Match] = []
    for concat in nodes:
        if concat.op != Op.CONCAT or concat.attrs.get("axis") != 0 or len(concat.src) < 2:
            continue
        members: list[Node] = []
        caches: list[Node] = []
        wholes: list[tuple[int, ...]] = []
        body = None
        for row, item in enumerate(concat.src):
            fused = item.src[0] if item.op == Op.GET_ITEM and item.attrs.get("index") == 0 else None
            if fused is None or fused.op != Op.FUSED or fused.attrs.get("kind") != "rope_qkv_attention" or \
                    fused.id in roots or len(users[item.id]) != 1 or item.id in roots:
                break
            if body is None:
                body = fused.attrs["body"]
            elif fused.attrs["body"] != body:   # every row the same computation (attrs, shapes)
                break
            items = {u.attrs.get("index"): u for u in users[fused.id] if u.op == Op.GET_ITEM}
            inputs = _row_inputs(fused, row, users)
            if len(users[fused.id]) != 3 or set(items) != {0, 1, 2} or inputs is None:
                break
            members += [s for s, _ in inputs] + [fused, item]
            caches += [items[1], items[2]]
            wholes.append(tuple(w.id for _, w in inputs))
        else:
            if len(set(wholes)) != 1:   # every row reads its own row of the same q, k and v
                continue
            members += caches + [concat]
            matches.append(Match("rows_qkv_attention", members, [concat] + caches))
    return fuse_matches(program, matches)
