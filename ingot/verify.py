"""The verifier: the invariants every pass must keep, checked after each pass by the compiler and on
every package read from disk. It sits above ingot.ops (it asks each op's type rule), which sits
above ingot.ir."""
from __future__ import annotations

from . import dtypes as dt
from .errors import IngotError
from .ir import Node, Op, Program
from .ops import infer_type


def verify(program: Program, checked: set[int] | None = None) -> None:
    """Check the invariants every pass must keep: sources defined, types equal to the op's rules.
    checked: ids of nodes whose rule an earlier call checked (filled here); a node is immutable, so its
    type against its rule need not be checked again (the compiler verifies after each pass, and most
    nodes pass through a pass as they were: PP-OCRv4's detector 14 -> 11 ms a compile;
    a change rebuilds every node downstream of it)."""
    names: dict[str, Node] = {}
    for node in program.nodes():
        if node.op == Op.CONSTANT and node.attrs["key"] not in program.constants:
            raise IngotError(f"verify: constant {node.attrs['key']!r} is used by the graph but absent from the store.")
        if node.op == Op.CONSTANT:
            value = program.constants[node.attrs["key"]]
            want = dt.storage_shape(node.type.shape, node.dtype) if node.type.shape else ()
            if tuple(value.shape) != tuple(want) or value.dtype != node.dtype.storage:
                raise IngotError(f"verify: constant {node.attrs['key']!r} holds {value.dtype}{list(value.shape)} "
                                 f"but its node says {node.type}.")
        if node.op == Op.VARIABLE:
            vname = node.attrs["name"]
            if vname not in program.variables:
                raise IngotError(f"verify: variable {vname!r} has no initial value.")
        if node.op == Op.PLACEHOLDER:
            other = names.setdefault(node.name, node)
            if other is not node and other.type != node.type:
                raise IngotError(f"verify: two placeholders named {node.name!r} with different types.")
        if node.op in (Op.PLACEHOLDER, Op.CONSTANT, Op.VARIABLE) or (checked is not None and node.id in checked):
            continue
        expected = infer_type(node.op, [s.type for s in node.src], node.attrs)
        if expected != node.type:
            raise IngotError(f"verify: {node.op.name} #{node.id} has type {node.type} but its rule gives {expected}.")
        if checked is not None:
            checked.add(node.id)
