"""A convolution and the elementwise ops after it (an activation, a residual add) as one FUSED
"conv_epilogue" op, which the CPU backend runs per output tile while the tile is in cache
(backends/cpu/conv.py).

From each float32 CONV the pass grows a group of elementwise ops of the output's shape whose other
operands are scalars, per-channel values or tensors of the output's shape (ReLU as maximum(x, 0), SiLU
as x * sigmoid(x), hard-swish, clip, leaky ReLU as a where, x + residual), and keeps the largest group
in which only the last op is read outside (at most MAX_OPS ops).
"""
from __future__ import annotations

from ..ir import GroupOp, Op, Program, consumers
from .fusion import Match, fuse_matches

MAX_OPS = 12
EPILOGUE_OPS = GroupOp.Binary | GroupOp.Compare | {Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID,
                                                   Op.SILU, Op.GELU, Op.ERF, Op.WHERE}


def operand_form(shape: tuple, out_shape: tuple) -> str | None:
    """How an epilogue reads an operand of this shape against the output [N, M, *spatial]: "scalar",
    "channel" ([M] broadcast as [1, M, 1, ...]), "full" (the output's shape); None: none of these."""
    if all(d == 1 for d in shape):
        return "scalar"
    rank = len(out_shape)
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    if len(shape) <= rank and padded[1] == out_shape[1] and all(d == 1 for i, d in enumerate(padded) if i != 1):
        return "channel"
    return "full" if tuple(shape) == tuple(out_shape) else None


def fuse_conv_epilogue(program: Program) -> tuple[Program, bool]:
    """Replace each convolution and its epilogue by a FUSED node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    order = {n.id: i for i, n in enumerate(nodes)}
    matches = []
    for conv in nodes:
        if conv.op != Op.CONV or conv.dtype.name != "float32" or not conv.type.static:
            continue
        shape = tuple(conv.type.shape)
        members, inside, best = [conv], {conv.id}, None
        # kept as members are added: the members' readers outside (candidates), each member's count of
        # reads from outside, and how many members are read outside (or are roots)
        frontier = {u.id: u for u in users[conv.id]}
        outside = {conv.id: len(users[conv.id])}
        read_outside = int(conv.id in roots or outside[conv.id] > 0)
        while len(members) <= MAX_OPS:
            candidates = sorted(frontier.values(), key=lambda u: order[u.id])
            pick = next((u for u in candidates if u.op in EPILOGUE_OPS and tuple(u.type.shape) == shape and
                         all(s.id in inside or operand_form(tuple(s.type.shape), shape) for s in u.src)), None)
            if pick is None:
                break
            members.append(pick)
            inside.add(pick.id)
            del frontier[pick.id]
            for s in pick.src:   # pick's reads of members are inside now
                if s.id in outside:
                    outside[s.id] -= 1
                    if outside[s.id] == 0 and s.id not in roots:
                        read_outside -= 1
            outside[pick.id] = sum(u.id not in inside for u in users[pick.id])
            frontier.update((u.id, u) for u in users[pick.id] if u.id not in inside)
            pick_open = pick.id in roots or outside[pick.id] > 0
            read_outside += pick_open
            if pick_open and read_outside == 1 and pick.dtype.name == "float32":   # only its last op read outside
                best = list(members)
        if best is not None:
            matches.append(Match("conv_epilogue", best, [best[-1]]))
    return fuse_matches(program, matches)
