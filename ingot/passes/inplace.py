"""In-place variable updates: assign(v, slice_update(v, u, start)) writes only the slice into v.

Valid when nothing else reads v in the same run: reads see the value at the start of the run, and
the write would change it under them. A read is any other consumer of v, or v being an output
itself. Otherwise the slice_update keeps copy semantics.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, consumers


def update_variables_in_place(program: Program) -> tuple[Program, bool]:
    """Mark each assign(v, slice_update(v, ...)) that may write into v's memory; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    outputs = {n.id for n in program.outputs}
    replace: dict[int, Node] = {}
    for assign in program.assigns:
        var, value = assign.src
        if value.op != Op.SLICE_UPDATE or value.src[0] is not var or value.attrs.get("inplace"):
            continue
        if var.id in outputs or any(u is not value and u is not assign for u in users[var.id]):
            continue
        replace[value.id] = value.replace(attrs=dict(value.attrs, inplace=True))
    if not replace:
        return program, False
    memo: dict[int, Node] = {}
    for node in nodes:
        new = replace.get(node.id, node)
        src = tuple(memo[s.id] for s in node.src)
        if any(a is not b for a, b in zip(src, node.src)) or new is not node:
            new = new.replace(src=src)
        memo[node.id] = new
    return program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns]), True
