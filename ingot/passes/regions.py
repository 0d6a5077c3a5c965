"""Fusion regions: connected groups of elementwise and normalisation ops a backend runs as one step.

A producer joins its consumer's region when the consumer is its only user. Regions are recorded
on the program (node ids, sources first) for the backends and the viewer; the graph is unchanged.
"""
from __future__ import annotations

from ..ir import GroupOp, Op, Program, TensorType, consumers

FUSIBLE = GroupOp.Elementwise | GroupOp.Normalize | {Op.ROPE}


def find_regions(program: Program) -> tuple[Program, bool]:
    """Record fusion regions (node ids, sources first) in program.regions; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.get(i, i) != i:
            i = parent[i]
        return i

    def fusible(n) -> bool:
        return n.op in FUSIBLE and isinstance(n.type, TensorType) and n.type.static and not n.dtype.packed

    for node in nodes:
        if not fusible(node):
            continue
        parent.setdefault(node.id, node.id)
        for s in node.src:
            if fusible(s) and len({u.id for u in users[s.id]}) == 1 and s.id not in roots:
                parent[find(s.id)] = find(node.id)
    groups: dict[int, list[int]] = {}
    for node in nodes:
        if node.id in parent:
            groups.setdefault(find(node.id), []).append(node.id)
    regions = [tuple(ids) for ids in groups.values() if len(ids) > 1]
    out = program.with_roots(program.outputs, program.assigns)
    out.regions = regions
    return out, bool(regions)
