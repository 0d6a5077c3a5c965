"""FUSED: a subgraph that a device pass chose to run as one step.

A fused op carries its own definition: `attrs["body"]` is the subgraph it replaced, rebuilt over
parameters that stand for the op's sources (param i is src[i]), and `attrs["kind"]` names the fusion
(the pass that made it, the backend lowering that runs it). So a fusion needs no type rule or NumPy
reference of its own: the type rule re-infers the body from the sources' types (the verifier checks
every fused op after every pass) and the reference evaluates the body op by op (the CPU backend runs
any fused program). A backend lowers a kind it knows as one kernel and any other kind as its parts.
This is XLA's fusion computation, and the way a fused program equals the unfused one by construction.

    >>> import numpy as np
    >>> from ingot.ir import Node, Op, TensorType
    >>> x = Node(Op.PLACEHOLDER, TensorType((2,)), name="x")
    >>> y = Node(Op.EXP, TensorType((2,)), (Node(Op.NEG, TensorType((2,)), (x,)),))
    >>> f = fuse("example", [y.src[0], y], [y])
    >>> f.op.name, f.attrs["kind"], [n.op.name for n in f.attrs["body"].nodes]
    ('FUSED', 'example', ['PLACEHOLDER', 'NEG', 'EXP'])
    >>> float(reference(Op.FUSED, [np.zeros(2, np.float32)], f.attrs)[0])
    1.0
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import IngotError
from ..ir import GroupOp, Node, Op, TensorType, freeze, toposort
from . import infer_type, reference, register


class Body:
    """A fused op's subgraph: `params` (PLACEHOLDER nodes, attrs {"param": i}) and the `outputs`
    computed from them. Immutable like Node; equal bodies have equal `structural_key()`s (CSE)."""

    __slots__ = ("params", "outputs", "nodes", "_key", "_checked")

    def __init__(self, params: Sequence[Node], outputs: Sequence[Node], nodes: list[Node] | None = None):
        """nodes: toposort(params + outputs), where the caller made them in that order (fuse does)."""
        object.__setattr__(self, "params", tuple(params))
        object.__setattr__(self, "outputs", tuple(outputs))
        if nodes is None:
            nodes = toposort(list(self.params) + list(self.outputs))
        inside = {p.id for p in self.params}
        for n in nodes:
            if n.id in inside:
                continue
            if n.op in GroupOp.Source or n.op in (Op.ASSIGN, Op.CALL, Op.IF):
                raise IngotError(f"fused: a body may not hold {n.op.name.lower()} nodes (sources enter as parameters).")
            inside.add(n.id)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "_key", None)
        object.__setattr__(self, "_checked", False)

    def __setattr__(self, *_):
        raise AttributeError("Body is immutable")

    @property
    def output_type(self) -> TensorType | tuple[TensorType, ...]:
        types = tuple(o.type for o in self.outputs)
        return types[0] if len(types) == 1 else types

    def find(self, *ops: Op) -> list[Node]:
        """The body's nodes of these ops, sources first."""
        return [n for n in self.nodes if n.op in ops]

    def structural_key(self) -> tuple:
        if self._key is None:
            pos = {n.id: i for i, n in enumerate(self.nodes)}
            key = tuple((n.op, n.type, tuple(pos[s.id] for s in n.src), freeze(n.attrs)) for n in self.nodes)
            object.__setattr__(self, "_key", ("body", key, tuple(pos[o.id] for o in self.outputs)))
        return self._key

    def __eq__(self, other) -> bool:
        return isinstance(other, Body) and self.structural_key() == other.structural_key()

    def __hash__(self) -> int:
        return hash(self.structural_key())

    def check(self, checked: dict | None = None) -> None:
        """Every body node's type is its op's rule applied to its sources' types (the verifier's check).
        checked: the verifier's record of rules it applied (verify's): a member the pass copied into the
        body over parameters of its sources' types is not asked of its rule again."""
        if self._checked:
            return
        for n in self.nodes:
            if n.op == Op.PLACEHOLDER:
                continue
            types = tuple(s.type for s in n.src)
            rule = (n.op, n.type, types, id(n.attrs))
            if checked is not None and rule in checked:
                continue
            expected = infer_type(n.op, types, n.attrs)
            if expected != n.type:
                raise IngotError(f"fused: body node {n.op.name} has type {n.type} but its rule gives {expected}.")
            if checked is not None:
                checked[rule] = n.attrs
        object.__setattr__(self, "_checked", True)

    def evaluate(self, inputs: Sequence[Any]) -> list[Any]:
        """The outputs from the inputs, op by op with the NumPy references."""
        values: dict[int, Any] = {p.id: np.asarray(x) for p, x in zip(self.params, inputs)}
        for n in self.nodes:
            if n.id not in values:
                values[n.id] = reference(n.op, [values[s.id] for s in n.src], n.attrs)
        return [values[o.id] for o in self.outputs]

    def __repr__(self) -> str:
        return f"<Body {'+'.join(n.op.name.lower() for n in self.nodes if n.op != Op.PLACEHOLDER)}>"


def fuse(kind: str, members: Sequence[Node], outputs: Sequence[Node], **attrs: Any) -> Node:
    """One FUSED node computing `outputs` from what `members` read outside themselves.

    Its sources are those outside values in order of first use; its type is the one output's type, or
    a tuple of them (read with GET_ITEM). Extra attrs describe choices the pass made (e.g. offsets)."""
    inside = {m.id for m in members}
    if not {o.id for o in outputs} <= inside:
        raise IngotError("fused: every output must be a member.")
    sources: list[Node] = []
    index: dict[int, int] = {}
    for m in members:
        for s in m.src:
            if s.id not in inside and s.id not in index:
                index[s.id] = len(sources)
                sources.append(s)
    params = [Node(Op.PLACEHOLDER, s.type, (), {"param": i}, name=f"in{i}") for i, s in enumerate(sources)]
    memo: dict[int, Node] = {s.id: params[i] for s, i in ((s, index[s.id]) for s in sources)}
    # members rebuilt over the parameters (never below an input), in the order toposort(params + outputs)
    # gives the body: its walk (outputs in order, each node's sources in order, post-order) over the members
    nodes = list(params)
    for root in outputs:
        if root.id in memo:
            continue
        stack = [(root, 0)]
        while stack:
            m, i = stack.pop()
            if i < len(m.src):
                stack.append((m, i + 1))
                s = m.src[i]
                if s.id not in memo:
                    if s.id not in inside:
                        raise IngotError(f"fused: {s.op.name.lower()} #{s.id} is read by a member but is neither a member "
                                         "nor an input.")
                    stack.append((s, 0))
            elif m.id not in memo:
                memo[m.id] = m.replace(src=tuple(memo[s.id] for s in m.src))
                nodes.append(memo[m.id])
    body = Body(params, [memo[o.id] for o in outputs], nodes)
    return Node(Op.FUSED, body.output_type, tuple(sources), dict(attrs, kind=kind, body=body))


def _fused_rule(types, attrs):
    body: Body = attrs["body"]
    got = tuple(types)
    want = tuple(p.type for p in body.params)
    if got != want:
        shown = ", ".join(repr(t) for t in got)
        raise IngotError(f"fused {attrs.get('kind')!r}: got inputs ({shown}); its body takes ({', '.join(map(repr, want))}).")
    body.check()
    return body.output_type


def _fused_reference(xs, attrs):
    outs = attrs["body"].evaluate(xs)
    return outs[0] if len(outs) == 1 else tuple(outs)


register(Op.FUSED, _fused_rule, _fused_reference)
