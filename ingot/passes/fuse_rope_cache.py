"""RoPE and the KV-cache writes of a decoder layer as one step (and, at decode, inside the attention).

Three kinds, tried in this order on the ROPEs of a runtime scalar position:
  rope_qkv_attention  rope(q), rope(k) and v written into their caches at `pos`, and the SDPA that
                      alone reads rope(q) over those caches: the attention kernel rotates q, writes the
                      new k/v rows and attends (decode). A length `pos + c` enters as (pos, c): the
                      kernel adds c, so the sum is not computed.
  rope_qkv_write      the same without the attention: one kernel rotates q and k and writes k and v.
  rope_kv_write       rope(k) whose only reader writes it into a cache at its position.
Cache writes qualify where the inplace pass made them in place (nothing else reads the old cache).
An int8 cache's write (models/blocks.py `write_rows`: scale = maximum(max(abs(x)) / 127, 2**-126),
quantize(x, scale), the codes and the scale each written at `pos`) counts as one row write, its
chain taken into the fused op (`codes=True`: the backend's kernels quantize the rows as they write
them); the fused op then also outputs the two scale caches, after the codes caches.
"""
from __future__ import annotations

import numpy as np

from ..ir import Node, Op, Program, Ref, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import plain_attention


def writes_rows_at(update: Node, pos: Node, like: Node) -> bool:
    """update writes `like`-shaped rows in place into a cache at [0.., pos, 0] (of like's dtype, or of
    another float dtype, a bfloat16 KV cache, the rows rounded as they are written)."""
    if update.op != Op.SLICE_UPDATE or not update.attrs.get("inplace"):
        return False
    rank, cache = like.type.rank, update.src[0]
    if (cache.dtype != like.dtype and not (cache.dtype.is_float and like.dtype.is_float) and
            not (cache.dtype.name == "int8" and update.src[1].op == Op.QUANTIZE)) or cache.type.shape[:-2] != like.type.shape[:-2] or \
            cache.type.shape[-1] != like.type.shape[-1] or update.src[1].type.shape != like.type.shape:
        return False
    for axis, st in enumerate(update.attrs["start"]):
        if axis == rank - 2:
            if not (isinstance(st, Ref) and update.src[st.index] is pos):
                return False
        elif st != 0:
            return False
    return True


ROW_SCALE_MIN = np.float32(2.0 ** -126)   # ops.nn.ROW_SCALE_MIN


def _constant(program: Program, node: Node, want) -> bool:
    value = program.constants.get(node.attrs.get("key")) if node.op == Op.CONSTANT else None
    return value is not None and value.size == 1 and np.float32(value.reshape(-1)[0]) == np.float32(want)


def codes_write(program: Program, x: Node, pos: Node, users) -> tuple[list[Node], Node, Node] | None:
    """(the quantization chain, the codes' write, the scale's write) when x's only readers are an int8
    cache's row write at [0.., pos, 0] (`write_rows`), both writes in place; else None."""
    readers = users[x.id]
    absolute = next((u for u in readers if u.op == Op.ABS), None)
    quantize = next((u for u in readers if u.op == Op.QUANTIZE), None)
    if len(readers) != 2 or absolute is None or quantize is None or len(users[absolute.id]) != 1:
        return None
    top = users[absolute.id][0]
    if top.op != Op.MAX or tuple(top.attrs.get("axes") or top.attrs.get("axis") or ()) not in ((x.type.rank - 1,), (-1,)) \
            or not top.attrs.get("keepdims") or len(users[top.id]) != 1:
        return None
    divide = users[top.id][0]
    if divide.op != Op.DIV or divide.src[0] is not top or not _constant(program, divide.src[1], 127) or \
            len(users[divide.id]) != 1:
        return None
    scale = users[divide.id][0]
    if scale.op != Op.MAXIMUM or scale.src[0] is not divide or not _constant(program, scale.src[1], ROW_SCALE_MIN):
        return None
    a = quantize.attrs
    if quantize.src != (x, scale) or a["mode"] != "affine" or a.get("has_zero_point") or quantize.dtype.name != "int8" \
            or len(users[quantize.id]) != 1 or len(users[scale.id]) != 2:
        return None
    codes_update = users[quantize.id][0]
    scale_update = next((u for u in users[scale.id] if u is not quantize), None)
    if not writes_rows_at(codes_update, pos, x) or scale_update is None or scale_update.op != Op.SLICE_UPDATE or \
            scale_update.src[1] is not scale or not scale_update.attrs.get("inplace") or \
            tuple(scale_update.attrs["start"]) != tuple(codes_update.attrs["start"]) or \
            scale_update.src[2:] != codes_update.src[2:] or scale_update.src[0].type.shape[:-1] != codes_update.src[0].type.shape[:-1]:
        return None
    return [absolute, top, divide, scale, quantize], codes_update, scale_update


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


def _attention(qr: Node, ku: Node, vu: Node, members: set[int], users, roots, nodes, order,
               scales: tuple[Node, Node] | None = None) -> Node | None:
    """The SDPA that alone reads rope(q), over the caches ku/vu just written (no mask; and an int8
    cache's scales, `scales`), when nothing else reads them before it and nothing between reads the
    caches' variables."""
    if qr.id in roots or len(users[qr.id]) != 1:
        return None
    att = users[qr.id][0]
    if not plain_attention(att) or att.attrs.get("has_mask") or att.src[0] is not qr or att.src[1] is not ku or \
            att.src[2] is not vu or ku is vu or bool(att.attrs.get("kv_scales")) != (scales is not None) or \
            (scales is not None and att.src[-2:] != scales):
        return None
    written = (ku, vu) + (scales or ())
    if any(order[u.id] < order[att.id] for m in written for u in users[m.id] if u.id not in members and u is not att):
        return None
    caches = {m.src[0].id for m in written}
    last = max(order[qr.id], order[ku.id], order[vu.id], *(order[m.id] for m in scales or ()))
    if any(last < order[n.id] < order[att.id] and any(x.id in caches for x in n.src) for n in nodes):
        return None
    return att


def fuse_rope_cache(program: Program, attention: bool = True, codes: bool = False) -> tuple[Program, bool]:
    """Replace rope + cache writes (+ decode attention) by FUSED nodes (codes: an int8 cache's writes
    too); returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    order = {n.id: i for i, n in enumerate(nodes)}
    ropes = [n for n in nodes if n.op == Op.ROPE and n.src[1].type.rank == 0 and n.id not in roots and n.type.rank >= 2]
    updates = [n for n in nodes if n.op == Op.SLICE_UPDATE and n.attrs.get("inplace")]
    matches: list[Match] = []
    used: set[int] = set()
    for kr in ropes:
        pos = kr.src[1]
        k_codes = codes_write(program, kr, pos, users) if codes and kr.id not in used else None
        if k_codes is None and (kr.id in used or len(users[kr.id]) != 1 or not writes_rows_at(users[kr.id][0], pos, kr)):
            continue
        ku = users[kr.id][0] if k_codes is None else k_codes[1]
        qr = next((n for n in ropes if n is not kr and n.id not in used and n.src[1] is pos and _rope_key(n) == _rope_key(kr)
                   and n.type.rank == kr.type.rank and n.type.shape[-2:] == kr.type.shape[-2:] and n.dtype == kr.dtype
                   and not (len(users[n.id]) == 1 and users[n.id][0].op == Op.SLICE_UPDATE)
                   and not (codes and codes_write(program, n, pos, users) is not None)), None)
        if k_codes is None:
            vu = next((u for u in updates if u is not ku and u.id not in used and u.src[0] is not ku.src[0]
                       and u.src[1].op != Op.ROPE and writes_rows_at(u, pos, kr)), None)
            v_codes = None
        else:   # the v rows' own int8 write: the quantize of a row that is not a RoPE's, at the same place
            v_codes = next((w for u in updates if u is not ku and u.id not in used and u.src[1].op == Op.QUANTIZE
                            and u.src[1].src[0].op != Op.ROPE and u.src[1].src[0].type == kr.type
                            for w in [codes_write(program, u.src[1].src[0], pos, users)] if w is not None and w[1] is u), None)
            vu = None if v_codes is None else v_codes[1]
        if qr is None or vu is None:
            continue
        group = [qr, kr, ku, vu]
        scales = None
        if k_codes is not None:   # the chains and the scales' writes: outputs after the codes
            group += k_codes[0] + v_codes[0] + [k_codes[2], v_codes[2]]
            scales = (k_codes[2], v_codes[2])
        ids = {n.id for n in group}
        # the inverse frequencies must be known at compile time for the attention's cos/sin table
        inv_known = len(kr.src) < 3 or kr.src[2].op == Op.CONSTANT
        att = _attention(qr, ku, vu, ids, users, roots, nodes, order, scales) if attention and inv_known else None
        if att is None:
            matches.append(Match("rope_qkv_write", sorted(group, key=lambda n: order[n.id]), [qr, ku, vu, *(scales or ())]))
            used |= ids
            continue
        stand_in, extra = att, []
        at = 3 + bool(att.attrs.get("has_mask"))   # the length's source (an int8 cache's scales come after it)
        plus = plus_constant(att.src[at]) if att.attrs.get("has_length") else None
        if plus is not None:   # the kernel adds c to the position: the body computes its own pos + c
            length = att.src[at].replace()
            stand_in = att.replace(src=att.src[:at] + (length,) + att.src[at + 1:])
            extra = [length]
        members = sorted(group, key=lambda n: order[n.id]) + extra + [stand_in]
        computed = [stand_in, ku, vu, *(scales or ())]
        matches.append(Match("rope_qkv_attention", members, [att, ku, vu, *(scales or ())], computed=computed))
        used |= ids | {att.id}
    for kr in ropes:
        if kr.id in used or len(users[kr.id]) != 1:
            continue
        update = users[kr.id][0]
        if update.src[1] is kr and update.id not in used and writes_rows_at(update, kr.src[1], kr):
            matches.append(Match("rope_kv_write", [kr, update], [update]))
            used |= {kr.id, update.id}
    return fuse_matches(program, matches)
