"""A residual add and the rms_norm that reads it: one FUSED "add_rms_norm" op writing both the sum
(the residual stream) and the normalised rows, one kernel instead of two."""
from __future__ import annotations

from ..ir import Op, Program, consumers
from .fusion import Match, fuse_matches

FLOATS = ("float32", "float16", "bfloat16")


def fuse_add_rms_norm(program: Program) -> tuple[Program, bool]:
    """Replace add -> rms_norm by FUSED nodes with outputs (sum, norm); returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for add in nodes:
        if add.op != Op.ADD or add.id in roots or add.dtype.name not in FLOATS or add.type.rank < 1 or \
                not add.src[0].type.shape == add.src[1].type.shape == add.type.shape:
            continue
        norm = next((u for u in users[add.id] if u.op == Op.RMS_NORM and u.src[0] is add), None)
        if norm is not None:
            matches.append(Match("add_rms_norm", [add, norm], [add, norm]))
    return fuse_matches(program, matches)
