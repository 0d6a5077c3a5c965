"""Memory plan: one buffer per intermediate, reused once its value (and every view of it) is dead.

Sources, views, in-place updates, call results, outputs and assigned values get no planned buffer:
they alias memory the runtime already owns or hand memory to the caller.
"""
from __future__ import annotations

from ..ir import GroupOp, Op, Program, TensorType


def _planned(node, keep: set[int]) -> bool:
    return (node.op not in GroupOp.Source and node.op not in GroupOp.View and node.op not in (Op.CALL, Op.GET_ITEM, Op.ASSIGN)
            and not node.attrs.get("inplace") and node.id not in keep and isinstance(node.type, TensorType) and node.type.static)


def plan_memory(program: Program) -> tuple[Program, bool]:
    nodes = program.nodes()
    base: dict[int, int] = {}  # node id -> id of the node that owns its memory
    for n in nodes:
        base[n.id] = base[n.src[0].id] if (n.op in GroupOp.View or n.attrs.get("inplace")) and n.src else n.id
    keep = {base[n.id] for n in program.outputs} | {base[a.src[1].id] for a in program.assigns}
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            last_use[base[s.id]] = i
    free: dict[int, list[int]] = {}
    sizes: list[int] = []
    plan: dict[int, int] = {}
    dying: dict[int, list[int]] = {}
    for owner, i in last_use.items():
        dying.setdefault(i, []).append(owner)
    for i, n in enumerate(nodes):
        if _planned(n, keep) and n.id in last_use:
            nbytes = n.type.nbytes
            pool = free.get(nbytes)
            if pool:
                plan[n.id] = pool.pop()
            else:
                plan[n.id] = len(sizes)
                sizes.append(nbytes)
        for owner in dying.get(i, ()):
            if owner in plan and owner != n.id:
                free.setdefault(sizes[plan[owner]], []).append(plan[owner])
    out = program.with_roots(program.outputs, program.assigns)
    out.regions, out.memory_plan, out.buffer_sizes = program.regions, plan, sizes
    return out, bool(plan)
