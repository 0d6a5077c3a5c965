"""Gathered LoRA (`ingot serve`'s per-request adapters, serve/adapters.py): each row's factors gathered
by its adapter index and multiplied,

    matmul(matmul(x [R, 1, K], gather(A [E, K, RANK], which [R])), gather(B [E, RANK, N], which))

becomes one FUSED "gathered_lora" op, which the CUDA backend runs as a shrink and an expand kernel that
read only the chosen adapters' factors (backends/cuda/gathered_lora.py) instead of gathering a copy
of them per row and multiplying."""
from __future__ import annotations

from .. import dtypes as dt
from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches


def _gathered(n: Node, rows: int | None) -> bool:
    """n = gather(table [E, K, N], which [rows], axis=0) of float32 or narrower float tables."""
    return (n.op == Op.GATHER and n.attrs.get("axis") == 0 and n.src[0].type.rank == 3 and n.src[1].type.rank == 1
            and n.src[1].type.shape[0] == rows and n.src[0].dtype.is_float and n.src[0].dtype.bits <= 32)


def fuse_gathered_lora(program: Program) -> tuple[Program, bool]:
    """Replace the gathered shrink and expand of a row-indexed LoRA by FUSED nodes; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    only = lambda n: len(users[n.id]) == 1 and n.id not in roots   # noqa: E731
    matches = []
    for up in nodes:
        if up.op != Op.MATMUL or up.dtype != dt.float32 or up.type.rank != 3 or not up.type.static:
            continue
        down, b_rows = up.src
        if down.op != Op.MATMUL or not only(down) or not only(b_rows) or down.type.shape[1] != 1:
            continue
        x, a_rows = down.src
        rows = x.type.shape[0]
        if not (_gathered(a_rows, rows) and _gathered(b_rows, rows) and only(a_rows)) or a_rows.src[1] is not b_rows.src[1]:
            continue
        matches.append(Match("gathered_lora", [a_rows, down, b_rows, up], [up]))
    return fuse_matches(program, matches)
