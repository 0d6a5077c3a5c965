"""Sibling quantized matmuls: several matmuls of constant affine weights (or of constant scaled tables:
lut4:bB[:offset], GGUF's IQ types) reading one x (q/k/v, gate/up built separately) become one FUSED
"siblings" op with an output each, which a backend runs as one GEMV over the weights side by side (the
CUDA backend concatenates them at load)."""
from __future__ import annotations

from ..ir import Node, Program
from .fusion import Match, fuse_matches
from .gemv_rules import constant_affine, constant_scaled_table


def fuse_siblings(program: Program) -> tuple[Program, bool]:
    """Group quantized matmuls over the same x (same output dtype) into FUSED nodes; returns (program, changed)."""
    groups: dict[tuple[int, str], list[Node]] = {}
    for n in program.nodes():
        if constant_affine(n) or constant_scaled_table(n):
            groups.setdefault((n.src[0].id, n.attrs["mode"]), []).append(n)
    matches = [Match("siblings", members, members) for members in groups.values()
               if len(members) > 1 and len({m.dtype for m in members}) == 1]
    return fuse_matches(program, matches)
