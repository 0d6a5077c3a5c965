"""RoPE and the KV-cache writes of a decoder layer as one step (and, at decode, inside the attention).

Three kinds, tried in this order on the ROPEs of a runtime scalar position:
  rope_qkv_attention  rope(q), rope(k) and v written into their caches at `pos`, and the SDPA that
                      alone reads rope(q) over those caches: the attention kernel rotates q, writes the
                      new k/v rows and attends (decode). A length `pos + c` enters as (pos, c): the
                      kernel adds c, so the sum is not computed.
  rope_qkv_write      the same without the attention: one kernel rotates q and k and writes k and v.
  rope_kv_write       rope(k) whose only reader writes it into a cache at its position.
Cache writes qualify where the inplace pass made them in place (nothing else reads the old cache).
"""
from __future__ import annotations

from ..ir import Node, Op, Program, Ref, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import plain_attention


def writes_rows_at(update: Node, pos: Node, like: Node) -> bool:
    """update writes `like`-shaped rows in place into a cache at [0.., pos, 0] (of like's dtype, or of
    another float dtype, a bfloat16 KV cache, the rows rounded as they are written)."""
    if update.op != Op.SLICE_UPDATE or not update.attrs.get("inplace"):
        return False
    rank, cache = like.type.rank, update.src[0]
    if (cache.dtype != like.dtype and not (cache.dtype.is_float and like.dtype.is_float)) or cache.type.shape[:-2] != like.type.shape[:-2] or \
            cache.type.shape[-1] != like.type.shape[-1] or update.src[1].type.shape != like.type.shape:
        return False
    for axis, st in enumerate(update.attrs["start"]):
        if axis == rank - 2:
            if not (isinstance(st, Ref) and update.src[st.index] is pos):
                return False
        elif st != 0:
            return False
    return True


def plus_constant(node: Node) -> tuple[Node, Node] | None:
    """(x, c) when node is x + c for a 0-d integer x computed at run time and a 0-d integer constant c
    (a decode step's attention length: its position + 1)."""
    if node.op != Op.ADD or node.type.rank != 0 or not node.dtype.is_int:
        return None
    x, c = node.src if node.src[1].op == Op.CONSTANT else node.src[::-1]
    if c.op != Op.CONSTANT or x.op == Op.CONSTANT or x.type != node.type or c.type != node.type:
        return None
    return x, c


def _rope_key(n: Node) -> tuple:
    a = n.attrs
    return (a.get("base", 10000.0), bool(a.get("interleaved", False)), a.get("rotary_dims") or n.type.shape[-1],
            len(n.src) > 2 and n.src[2].id)


def _attention(qr: Node, ku: Node, vu: Node, members: set[int], users, roots, nodes, order) -> Node | None:
    """The SDPA that alone reads rope(q), over the caches ku/vu just written (no mask), when nothing
    else reads them before it and nothing between reads the caches' variables."""
    if qr.id in roots or len(users[qr.id]) != 1:
        return None
    att = users[qr.id][0]
    if not plain_attention(att) or att.attrs.get("has_mask") or att.src[0] is not qr or att.src[1] is not ku or \
            att.src[2] is not vu or ku is vu:
        return None
    if any(order[u.id] < order[att.id] for m in (ku, vu) for u in users[m.id] if u.id not in members and u is not att):
        return None
    caches = {ku.src[0].id, vu.src[0].id}
    last = max(order[qr.id], order[ku.id], order[vu.id])
    if any(last < order[n.id] < order[att.id] and any(x.id in caches for x in n.src) for n in nodes):
        return None
    return att


def fuse_rope_cache(program: Program, attention: bool = True) -> tuple[Program, bool]:
    """Replace rope + cache writes (+ decode attention) by FUSED nodes; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    order = {n.id: i for i, n in enumerate(nodes)}
    ropes = [n for n in nodes if n.op == Op.ROPE and n.src[1].type.rank == 0 and n.id not in roots and n.type.rank >= 2]
    updates = [n for n in nodes if n.op == Op.SLICE_UPDATE and n.attrs.get("inplace")]
    matches: list[Match] = []
    used: set[int] = set()
    for kr in ropes:
        if kr.id in used or len(users[kr.id]) != 1 or not writes_rows_at(users[kr.id][0], kr.src[1], kr):
            continue
        ku, pos = users[kr.id][0], kr.src[1]
        qr = next((n for n in ropes if n is not kr and n.id not in used and n.src[1] is pos and _rope_key(n) == _rope_key(kr)
                   and n.type.rank == kr.type.rank and n.type.shape[-2:] == kr.type.shape[-2:] and n.dtype == kr.dtype
                   and not (len(users[n.id]) == 1 and users[n.id][0].op == Op.SLICE_UPDATE)), None)
        vu = next((u for u in updates if u is not ku and u.id not in used and u.src[0] is not ku.src[0]
                   and u.src[1].op != Op.ROPE and writes_rows_at(u, pos, kr)), None)
        if qr is None or vu is None:
            continue
        group = [qr, kr, ku, vu]
        ids = {n.id for n in group}
        # the inverse frequencies must be known at compile time for the attention's cos/sin table
        inv_known = len(kr.src) < 3 or kr.src[2].op == Op.CONSTANT
        att = _attention(qr, ku, vu, ids, users, roots, nodes, order) if attention and inv_known else None
        if att is None:
            matches.append(Match("rope_qkv_write", sorted(group, key=lambda n: order[n.id]), [qr, ku, vu]))
            used |= ids
            continue
        stand_in, extra = att, []
        plus = plus_constant(att.src[-1]) if att.attrs.get("has_length") else None
        if plus is not None:   # the kernel adds c to the position: the body computes its own pos + c
            length = att.src[-1].replace()
            stand_in = att.replace(src=att.src[:-1] + (length,))
            extra = [length]
        members = sorted(group, key=lambda n: order[n.id]) + extra + [stand_in]
        computed = [stand_in, ku, vu]
        matches.append(Match("rope_qkv_attention", members, [att, ku, vu], computed=computed))
        used |= ids | {att.id}
    for kr in ropes:
        if kr.id in used or len(users[kr.id]) != 1:
            continue
        update = users[kr.id][0]
        if update.src[1] is kr and update.id not in used and writes_rows_at(update, kr.src[1], kr):
            matches.append(Match("rope_kv_write", [kr, update], [update]))
            used |= {kr.id, update.id}
    return fuse_matches(program, matches)
