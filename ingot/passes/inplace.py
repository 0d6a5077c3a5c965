"""In-place variable updates: assign(v, slice_update(v, u, start)) writes only the slice into v.

Valid when nothing else reads v in the same run: reads see the value at the start of the run, and
the write would change it under them. A read is any other consumer of v, or v being an output
itself. Otherwise the slice_update keeps copy semantics. The same holds for a pool_attention whose
two pools are variables assigned its updated pools (ops/pool.py): it is marked to write them in place.
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
    for node in _pools_in_place(program, users, outputs):
        replace[node.id] = node.replace(attrs=dict(node.attrs, inplace=True))
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


def _pools_in_place(program: Program, users, outputs: set[int]) -> list[Node]:
    """The pool_attention ops whose pools (src 3 and 4, and an int8 pool's scales 7 and 8) are variables
    that nothing else reads, each assigned the op's own updated pool (its outputs 1 and 2; 3 and 4)."""
    assigned = {a.src[0].id: a.src[1] for a in program.assigns}
    found = {}
    for assign in program.assigns:
        item = assign.src[1]
        if item.op != Op.GET_ITEM or item.src[0].op != Op.POOL_ATTENTION or item.src[0].attrs.get("inplace"):
            continue
        node = item.src[0]
        ok = True
        for index in (1, 2, 3, 4)[:len(node.src) - 5]:
            var = node.src[index + 2 if index < 3 else index + 4]
            value = assigned.get(var.id)
            if var.op != Op.VARIABLE or var.id in outputs or value is None or value.op != Op.GET_ITEM or \
                    value.src[0] is not node or value.attrs["index"] != index or \
                    any(u is not node and not (u.op == Op.ASSIGN and u.src[1] is value) for u in users[var.id]):
                ok = False
        if ok:
            found[node.id] = node
    return list(found.values())
