"""Gathered LoRA (`ingot serve`'s per-request adapters, serve/adapters.py): each row's factors gathered
by its adapter index and multiplied, and the delta added to the weight's output y,

    y + reshape(matmul(matmul(reshape(x) [R, 1, K], gather(A [E, K, RANK], which [R])), gather(B [E, RANK, N], which)))

becomes one FUSED "gathered_lora" op, which the CUDA backend runs as a shrink and an expand kernel that
read only the chosen adapters' factors (backends/cuda/gathered_lora.py) instead of gathering a copy
of them per row and multiplying, the expand adding y.

x is what the weight's GEMV reads: an rms_norm's output, or act(gate) * up. Read by the LoRA too, it
would keep the later passes from fusing it into the GEMV (fuse_norm_gemv, fuse_glu need it read by
the GEMV alone), so the fused op computes its own copy from their inputs (the shrink kernel's
prologue): the GEMV's fusions stay as without adapters. Runs before them.
"""
from __future__ import annotations

from .. import dtypes as dt
from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import gate_activation, last_axis_slice


def _gathered(n: Node, rows: int | None) -> bool:
    """n = gather(table [E, K, N], which [rows], axis=0) of float32 or narrower float tables."""
    return (n.op == Op.GATHER and n.attrs.get("axis") == 0 and n.src[0].type.rank == 3 and n.src[1].type.rank == 1
            and n.src[1].type.shape[0] == rows and n.src[0].dtype.is_float and n.src[0].dtype.bits <= 32)


def _prologue(x: Node) -> list[Node] | None:
    """Copies of the nodes computing x from their inputs, when x is rms_norm(x0[, g]) or act(gate) * up
    (gate and up last-axis slices of one tensor), float32 [R, K]; else None (x read as it is)."""
    if x.dtype != dt.float32 or x.type.rank != 2 or not x.type.static:
        return None
    if x.op == Op.RMS_NORM and x.src[0].dtype == dt.float32 and x.src[0].type.shape == x.type.shape and \
            (len(x.src) == 1 or (x.src[1].dtype == dt.float32 and tuple(x.src[1].type.shape) == (x.type.shape[1],))):
        return [x.replace()]
    if x.op == Op.MUL:
        act = next((s for s in x.src if gate_activation(s) is not None), None)
        if act is None:
            return None
        up = x.src[1] if x.src[0] is act else x.src[0]
        gate = act.src[0]
        if gate.op != Op.SLICE or up.op != Op.SLICE or gate.src[0] is not up.src[0] or gate.type != up.type or \
                gate.type.shape != x.type.shape or last_axis_slice(gate, gate.src[0]) is None or \
                last_axis_slice(up, up.src[0]) is None or gate.src[0].type.rank != 2:
            return None
        gate_c, up_c = gate.replace(), up.replace()
        act_c = act.replace(src=(gate_c,))
        return [gate_c, up_c, act_c, x.replace(src=(act_c, up_c) if x.src[0] is act else (up_c, act_c))]
    return None


def fuse_gathered_lora(program: Program) -> tuple[Program, bool]:
    """Replace the gathered shrink and expand of a row-indexed LoRA (and the add of its delta) by FUSED
    nodes; returns (program, changed)."""
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
        x3, a_rows = down.src
        rows = x3.type.shape[0]
        if not (_gathered(a_rows, rows) and _gathered(b_rows, rows) and only(a_rows)) or a_rows.src[1] is not b_rows.src[1]:
            continue
        head = _prologue(x3.src[0]) if x3.op == Op.RESHAPE and only(x3) else None
        x3_c = x3.replace(src=(head[-1],)) if head else x3
        down_c = down.replace(src=(x3_c, a_rows))
        up_c = up.replace(src=(down_c, b_rows))
        members, out, computed = (head or []) + ([x3_c] if head else []) + [a_rows, down_c, b_rows, up_c], up, up_c
        flat = users[up.id][0] if only(up) else None
        add = users[flat.id][0] if flat is not None and flat.op == Op.RESHAPE and only(flat) else None
        if add is not None and add.op == Op.ADD and add.type == flat.type and all(s.type == flat.type for s in add.src) \
                and flat.type.rank == 2 and sum(s is flat for s in add.src) == 1:
            flat_c = flat.replace(src=(up_c,))
            add_c = add.replace(src=tuple(flat_c if s is flat else s for s in add.src))
            members, out, computed = members + [flat_c, add_c], add, add_c
        matches.append(Match("gathered_lora", members, [out], computed=[computed]))
    return fuse_matches(program, matches)
