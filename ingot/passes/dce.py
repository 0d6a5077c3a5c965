"""Dead code elimination: what no output or assign reaches is dropped, constants and variables too."""
from __future__ import annotations

from ..ir import Op, Program


def eliminate_dead_code(program: Program) -> tuple[Program, bool]:
    """Drop constants and variables no output or assign reaches; returns (program, changed)."""
    nodes = program.nodes()
    live_constants = {n.attrs["key"] for n in nodes if n.op == Op.CONSTANT}
    live_variables = {n.attrs["name"] for n in nodes if n.op == Op.VARIABLE}
    constants = {k: v for k, v in program.constants.items() if k in live_constants}
    variables = {k: v for k, v in program.variables.items() if k in live_variables}
    changed = len(constants) != len(program.constants) or len(variables) != len(program.variables)
    out = program.with_roots(program.outputs, program.assigns)
    out.constants, out.variables = constants, variables
    return out, changed
