"""Rewrite passes. Each is a pure function Program -> (Program, changed).

`graph_rewrite` is the one driver for local rules: it walks the graph sources-first, rebuilds a
node whose sources changed (re-inferring its type, which is how compile specialises dynamic
shapes), then applies the rules for its op until none fires. A rule returns None when it does not
apply.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ..ir import Node, Op, Program, consumers
from ..ops import infer_type


@dataclass
class Context:
    program: Program
    nodes: list[Node]

    @functools.cached_property
    def users(self) -> dict[int, list[Node]]:
        """Each node's readers (made when a rule first asks: most passes' rules fire on no node)."""
        return consumers(self.nodes)


Rule = Callable[[Node, Context], Node | None]


def rebuild(node: Node, src: tuple[Node, ...]) -> Node:
    if src == node.src:   # (nodes compare by identity)
        return node
    if node.op in (Op.PLACEHOLDER, Op.CONSTANT, Op.VARIABLE):
        return node
    if all(a.type == b.type for a, b in zip(src, node.src)):   # a type rule is a function of the sources'
        return node.replace(src=src)                            # types and the attrs: the same type
    return node.replace(src=src, type=infer_type(node.op, [s.type for s in src], node.attrs))


def graph_rewrite(program: Program, rules: Iterable[tuple[Iterable[Op], Rule]], name: str = "") -> tuple[Program, bool]:
    table: dict[Op, list[Rule]] = {}
    for ops, rule in rules:
        for op in ops:
            table.setdefault(op, []).append(rule)
    nodes = program.nodes()
    ctx = Context(program, nodes)
    memo: dict[int, Node] = {}
    changed = False
    for node in nodes:
        # until a node changes, every node's sources are themselves: nothing to rebuild
        new = rebuild(node, tuple(memo[s.id] for s in node.src)) if changed else node
        for _ in range(64 if new.op in table else 0):
            for rule in table.get(new.op, ()):
                out = rule(new, ctx)
                if out is not None:
                    new = out
                    break
            else:
                break
        if new is not node:
            changed = True
        memo[node.id] = new
    out = program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns])
    return out, changed


def evaluate(program: Program, feeds: dict[str, Any], variables: dict[str, Any] | None = None) -> list[Any]:
    """Run a program node by node with the NumPy references: the oracle passes are tested against.

    No lowering, no memory plan, no in-place writes (an in-place slice_update is computed as a copy).
    Variables default to their initial values; calls are not supported.

        >>> import numpy as np, ingot
        >>> g = ingot.Graph()
        >>> x = g.placeholder((2,), name="x")
        >>> evaluate(Program([(x * 3.0).node], [], dict(g.constants)), {"x": np.ones(2, np.float32)})[0].tolist()
        [3.0, 3.0]
    """
    from ..ops import reference

    variables = program.variables if variables is None else variables
    values: dict[int, Any] = {}
    for node in program.nodes():
        if node.op == Op.PLACEHOLDER:
            values[node.id] = np.asarray(feeds[node.name])
        elif node.op == Op.CONSTANT:
            values[node.id] = program.constants[node.attrs["key"]]
        elif node.op == Op.VARIABLE:
            values[node.id] = variables[node.attrs["name"]]
        elif node.op == Op.ASSIGN:
            values[node.id] = values[node.src[1].id]
        else:
            values[node.id] = reference(node.op, [values[s.id] for s in node.src], node.attrs)
    return [values[n.id] for n in program.outputs]
