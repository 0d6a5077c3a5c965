"""The driver every device fusion pass shares: replace matched subgraphs by FUSED nodes.

A fusion pass finds `Match`es (which nodes, which of them are read outside, what kind) and calls
`fuse_matches`; the driver builds each FUSED node (ops/fused.py), rewires the readers of the outputs
to it (through GET_ITEM where it has several), and leaves everything else as it was. A match whose
replacement would make a cycle (an input computed from one of its own outputs) is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import IngotError
from ..ir import Node, Op, Program
from ..ops.fused import fuse
from . import rebuild


@dataclass
class Match:
    """members: the body's nodes, sources first; outputs: the program's nodes whose readers read the
    fused op instead (its outputs in order); computed: the member computing each output where a pass
    made a new node for it (a variant of the program's node), else the output itself."""

    kind: str
    members: list[Node]
    outputs: list[Node]
    attrs: dict[str, Any] = field(default_factory=dict)
    computed: list[Node] | None = None

    def replaced(self, order: dict[int, int]) -> list[Node]:
        """The program's nodes this match replaces."""
        return [n for n in self.members if n.id in order] + [o for o in self.outputs if o.id in order]


def _convex(match: Match, order: dict[int, int]) -> bool:
    """No input of the match depends on one of its members (fusing it would make a cycle)."""
    inside = {m.id for m in match.replaced(order)}
    body = {m.id for m in match.members}
    lowest = min(order[i] for i in inside)
    stack = [s for m in match.members for s in m.src if s.id not in inside and s.id not in body]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if n.id in seen or order.get(n.id, -1) < lowest:
            continue
        seen.add(n.id)
        if n.id in inside:
            return False
        stack.extend(n.src)
    return True


def fuse_matches(program: Program, matches: list[Match]) -> tuple[Program, bool]:
    """The program with each (disjoint, convex) match replaced by one FUSED node."""
    if not matches:
        return program, False
    order = {n.id: i for i, n in enumerate(program.nodes())}
    kept, owner = [], {}
    for m in matches:
        replaced = m.replaced(order)
        if any(n.id in owner for n in replaced) or not _convex(m, order):
            continue
        for n in replaced:
            owner[n.id] = len(kept)
        kept.append(m)
    if not kept:
        return program, False
    proto = [fuse(m.kind, m.members, m.computed or m.outputs, **m.attrs) for m in kept]
    out_index = {o.id: k for m in kept for k, o in enumerate(m.outputs)}
    made: dict[int, Node] = {}
    items: dict[tuple[int, int], Node] = {}
    memo: dict[int, Node] = {}
    expanded: set[int] = set()

    def deps(n: Node) -> tuple[Node, ...]:
        return proto[owner[n.id]].src if n.id in owner else n.src

    stack = list(reversed(program.roots))
    while stack:
        n = stack[-1]
        if n.id in memo:
            stack.pop()
            continue
        missing = [d for d in deps(n) if d.id not in memo]
        if missing:
            if n.id in expanded:
                raise IngotError(f"fusion: a cycle through {n.op.name.lower()} #{n.id}.")
            expanded.add(n.id)
            stack.extend(missing)
            continue
        stack.pop()
        if n.id not in owner:
            memo[n.id] = rebuild(n, tuple(memo[s.id] for s in n.src))
            continue
        i = owner[n.id]
        if n.id not in out_index:
            raise IngotError(f"fusion {kept[i].kind!r}: member {n.op.name.lower()} #{n.id} is read outside the match.")
        if i not in made:
            made[i] = rebuild(proto[i], tuple(memo[s.id] for s in proto[i].src))
        f, k = made[i], out_index[n.id]
        if len(kept[i].outputs) == 1:
            memo[n.id] = f
        else:
            if (i, k) not in items:
                items[(i, k)] = Node(Op.GET_ITEM, f.type[k], (f,), {"index": k})
            memo[n.id] = items[(i, k)]
    out = program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns])
    return out, True
