"""Common subexpression elimination: structurally equal nodes become one node.

Small constants with equal bytes are merged too; placeholders and variables are equal by name.
"""
from __future__ import annotations

from ..ir import GroupOp, Node, Op, Program, freeze
from . import rebuild

SMALL_CONSTANT = 4096  # bytes; bigger constants are compared by key only (hashing them costs)


def eliminate_common_subexpressions(program: Program) -> tuple[Program, bool]:
    """Merge structurally equal nodes into one; returns (program, changed)."""
    canonical: dict[tuple, Node] = {}
    memo: dict[int, Node] = {}
    changed = False
    for node in program.nodes():
        new = rebuild(node, tuple(memo[s.id] for s in node.src))
        if node.op == Op.CONSTANT:
            value = program.constants[node.attrs["key"]]
            key = ("const", node.type, value.dtype.str, value.tobytes()) if value.nbytes <= SMALL_CONSTANT else new.key()
        elif node.op in (Op.PLACEHOLDER, Op.VARIABLE):
            key = (node.op, node.name)
        elif node.op in (Op.ASSIGN, Op.CALL, Op.IF) or node.op in GroupOp.Collective:   # collectives run as built
            key = ("unique", node.id)
        else:
            key = new.key()
        found = canonical.setdefault(key, new)
        if found is not node:
            changed = True
        memo[node.id] = found
    out = program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns])
    return out, changed


__all__ = ["eliminate_common_subexpressions", "freeze"]
