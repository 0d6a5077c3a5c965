"""A decode attention and the quantized matmul that reads its output (the o projection): one FUSED
"attention_gemv" op, so the attention kernel stores its output rounded for the GEMV (or zeroes the
GEMV's output, which then rounds its own x) and no quantize launch runs between them.

The attention is an SDPA of one query row without a mask, or a FUSED rope_qkv_attention (its first
output); the matmul reads it through reshapes and transposes that keep its memory order
(x [B, Hq * Dv] is the output [B, Hq, 1, Dv] as laid out) and nothing else reads it. Outputs: the
matmul's, then the attention's other outputs (the caches a rope_qkv_attention wrote), if read.
"""
from __future__ import annotations

import math

from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import constant_affine, plain_attention


def _order_kept(t: Node) -> bool:
    """A transpose whose axes longer than 1 stay in order (no data moves)."""
    shape = t.src[0].type.shape
    kept = [a for a in t.attrs["perm"] if shape[a] != 1]
    return kept == sorted(kept)


def fuse_attention_gemv(program: Program) -> tuple[Program, bool]:
    """Replace attention -> views -> quantized matmul by FUSED nodes; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for m in nodes:
        if not constant_affine(m) or m.type.rank != 2:
            continue
        chain, x = [], m.src[0]
        while x.op in (Op.RESHAPE, Op.TRANSPOSE) and len(users[x.id]) == 1 and x.id not in roots and \
                (x.op == Op.RESHAPE or _order_kept(x)):
            chain.append(x)
            x = x.src[0]
        head: list[Node] = []
        if x.op == Op.GET_ITEM and x.attrs["index"] == 0 and x.src[0].op == Op.FUSED and \
                x.src[0].attrs["kind"] == "rope_qkv_attention":
            att_out, att = x, x.src[0]
            head = sorted(users[att.id], key=lambda g: g.attrs["index"])   # its GET_ITEMs
            if any(g.op != Op.GET_ITEM for g in head):
                continue
        elif plain_attention(x) and not x.attrs.get("has_mask"):
            att_out, att = x, x
        else:
            continue
        t = att_out.type
        if len(users[att_out.id]) != 1 or att_out.id in roots or not t.static or t.rank < 3 or t.shape[-2] != 1 or \
                m.src[0].type.shape[-1] != t.shape[-3] * t.shape[-1] or m.src[0].type.shape[0] != math.prod(t.shape[:-3]):
            continue
        members = [att] + head + chain[::-1] + [m]
        others = [g for g in head if g.attrs["index"] != 0 and (g.id in roots or users[g.id])]
        matches.append(Match("attention_gemv", members, [m] + others))
    return fuse_matches(program, matches)
