"""The verifier: the invariants every pass must keep, checked after each pass by the compiler and on
every package read from disk. It sits above ingot.ops (it asks each op's type rule), which sits
above ingot.ir."""
from __future__ import annotations

from . import dtypes as dt
from .errors import IngotError
from .ir import Node, Op, Program
from .ops import infer_type


TYPED = object()   # checked's entry for a node whose type its rule gave as it was made (Graph.typed)


def verify(program: Program, checked: dict[int, object] | None = None) -> None:
    """Check the invariants every pass must keep: sources defined, types equal to the op's rules.
    checked: nodes an earlier call checked (filled here), by id: a node is immutable, so its type against
    its rule need not be checked again (the compiler verifies after each pass, and most nodes pass
    through a pass as they were: PP-OCRv4's detector 14 -> 11 ms a compile; a change rebuilds every node
    downstream of it); a constant's entry is the stored array it was checked against (a pass may
    store another under its key), so a constant is checked again only when its array changed. A node
    that a pass rebuilt over new sources of the same types (Node.replace shares its attrs) is found by
    (op, type, source types, attrs) and not asked of its rule again either."""
    names: dict[str, Node] = {}
    constants = program.constants
    for node in program.nodes():
        op = node.op
        if checked is not None and node.id in checked and op != Op.PLACEHOLDER and (
                op != Op.CONSTANT or checked[node.id] is constants.get(node.attrs["key"])):
            if checked[node.id] is TYPED:   # its rule recorded as applied (a fused body's copy is found by it)
                checked[node.id] = None
                checked[(op, node.type, tuple(s.type for s in node.src), id(node.attrs))] = node.attrs
            continue
        if op == Op.CONSTANT:
            if node.attrs["key"] not in constants:
                raise IngotError(f"verify: constant {node.attrs['key']!r} is used by the graph but absent from the store.")
            value = constants[node.attrs["key"]]
            want = dt.storage_shape(node.type.shape, node.dtype) if node.type.shape else ()
            if tuple(value.shape) != tuple(want) or value.dtype != node.dtype.storage:
                raise IngotError(f"verify: constant {node.attrs['key']!r} holds {value.dtype}{list(value.shape)} "
                                 f"but its node says {node.type}.")
            if checked is not None:
                checked[node.id] = value
            continue
        if op == Op.VARIABLE:
            vname = node.attrs["name"]
            if vname not in program.variables:
                raise IngotError(f"verify: variable {vname!r} has no initial value.")
        if op == Op.PLACEHOLDER:
            other = names.setdefault(node.name, node)
            if other is not node and other.type != node.type:
                raise IngotError(f"verify: two placeholders named {node.name!r} with different types.")
        if op in (Op.PLACEHOLDER, Op.VARIABLE):
            continue
        types = tuple(s.type for s in node.src)
        rule = (op, node.type, types, id(node.attrs))   # the same rule applied to the same types
        if checked is not None and rule in checked:
            checked[node.id] = None
            continue
        if op == Op.FUSED:   # its rule re-infers its body: the body's members by the same record
            node.attrs["body"].check(checked)
        expected = infer_type(op, types, node.attrs)
        if expected != node.type:
            raise IngotError(f"verify: {op.name} #{node.id} has type {node.type} but its rule gives {expected}.")
        if checked is not None:
            checked[node.id] = None
            checked[rule] = node.attrs   # (held: the attrs' id names no other dict while the entry lives)
