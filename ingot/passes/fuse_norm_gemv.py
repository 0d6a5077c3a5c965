"""rms_norm (and the residual add before it) in the prologue of the GEMV it feeds.

    norm_gemv      [add ->] rms_norm(x) * g -> quantized matmul (or a FUSED "siblings" group): the word
                   GEMV normalises x as it loads it, and with the add stores the sum for the residual
                   stream. Outputs: (the sum, if read elsewhere) then each matmul's output.
    norm_gemv_glu  the same where the GEMV's outputs are gate and up (a siblings pair, or one gate_up
                   matmul read only by its two halves) read only by a FUSED "glu_gemv": the whole
                   feed-forward as one step. Outputs: (the sum, if read elsewhere), the down projection.

Only float32 rows (at most `words_max_rows`) and word-layout weights that share x's length; the add
joins where its operands have its shape and g is a constant. Runs after fuse_siblings and fuse_glu.
"""
from __future__ import annotations

from .. import dtypes as dt
from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches
from .gemv_rules import (SELF_XQ_BYTES, WORDS_MAX_ROWS, glu_parts, last_axis_slice, outer_sources, rows,
                         sum_through_views, weight_bytes, word_layout)


def _gemv_members(norm: Node, readers: list[Node]) -> list[Node] | None:
    """The matmuls norm feeds when they all run as one word GEMV over norm's output: one quantized
    matmul, or one FUSED siblings group of them."""
    if len(readers) != 1:
        return None
    m = readers[0]
    if m.op == Op.QUANTIZED_MATMUL:
        matmuls = [(m, m.src)]
    elif m.op == Op.FUSED and m.attrs["kind"] == "siblings":
        matmuls = [(q, outer_sources(m, q)) for q in m.attrs["body"].find(Op.QUANTIZED_MATMUL)]
    else:
        return None
    if m.src[0] is not norm or any(s is norm for s in m.src[1:]):
        return None
    k = norm.type.shape[-1]
    if any(not word_layout(q, src) or q.dtype != dt.float32 or q.src[0].type.shape[-1] != k for q, src in matmuls):
        return None
    return [m]


def _glu_after(gemv: Node, users, roots, self_xq_bytes: int) -> tuple[list[Node], Node] | None:
    """([the nodes between the GEMV and the glu], the FUSED glu_gemv) when the GEMV's outputs are
    gate and up, read only by one glu_gemv as its gate and up, whose weight is small enough for the
    down GEMV to round its own x (under `self_xq_bytes`: no quantize launch between the two GEMVs)."""
    readers = [u for u in users[gemv.id]]
    if gemv.op == Op.FUSED:             # a siblings pair: gate and up are its two GET_ITEMs
        if len(gemv.type) != 2 or len(readers) != 2 or any(r.op != Op.GET_ITEM for r in readers):
            return None
        pair = sorted(readers, key=lambda r: r.attrs["index"])
    else:                                # one gate_up matmul read by its two halves
        n = gemv.type.shape[-1]
        pair = sorted(readers, key=lambda u: last_axis_slice(u, gemv) or (n, n))
        if n % 2 or len(pair) != 2 or [last_axis_slice(u, gemv) for u in pair] != [(0, n // 2), (n // 2, n)]:
            return None
    gate, up = pair
    if gate.id in roots or up.id in roots or len(users[gate.id]) != 1 or users[gate.id] != users[up.id]:
        return None
    glu = users[gate.id][0]
    if glu.op != Op.FUSED or glu.attrs["kind"] != "glu_gemv":
        return None
    body = glu.attrs["body"]
    act, _, up_param = glu_parts(body)
    if glu.src[act.src[0].attrs["param"]] is not gate or up_param.op != Op.PLACEHOLDER or \
            glu.src[up_param.attrs["param"]] is not up:
        return None
    if weight_bytes(body.find(Op.QUANTIZED_MATMUL)[0]) >= self_xq_bytes:
        return None
    return pair, glu


def fuse_norm_gemv(program: Program, words_max_rows: int = WORDS_MAX_ROWS,
                   self_xq_bytes: int = SELF_XQ_BYTES) -> tuple[Program, bool]:
    """Replace [add ->] rms_norm -> GEMV [-> glu GEMV] by FUSED nodes; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches, taken = [], set()
    for norm in nodes:
        if norm.op != Op.RMS_NORM or norm.id in roots or norm.dtype != dt.float32:
            continue
        x = norm.src[0]
        if x.dtype != dt.float32 or x.type.rank < 1 or not x.type.static or not 1 <= (rows(norm) or 0) <= words_max_rows:
            continue
        k = x.type.shape[-1]
        if len(norm.src) > 1 and (norm.src[1].dtype != dt.float32 or tuple(norm.src[1].type.shape) != (k,)):
            continue
        gemv = _gemv_members(norm, users[norm.id])
        if gemv is None:
            continue
        add, views = sum_through_views(x)
        if add.op != Op.ADD or add.id in roots or add.id in taken or add.dtype != dt.float32 or \
                not add.src[0].type.shape == add.src[1].type.shape == add.type.shape or \
                any(s.dtype != dt.float32 for s in add.src) or (len(norm.src) > 1 and norm.src[1].op != Op.CONSTANT) or \
                any(len(users[v.id]) != 1 or v.id in roots for v in views):
            add, views = None, []
        head = ([add] + views[::-1]) if add is not None else []
        inside = {n.id for n in head} | {norm.id}
        sum_out = [add] if add is not None and any(u.id not in inside for u in users[add.id]) else []
        glu = _glu_after(gemv[0], users, roots, self_xq_bytes)
        if glu is not None:
            between, fused_glu = glu
            members = head + [norm] + gemv + between + [fused_glu]
            matches.append(Match("norm_gemv_glu", members, sum_out + [fused_glu]))
        else:
            outs = gemv if gemv[0].op == Op.QUANTIZED_MATMUL else [u for u in users[gemv[0].id]]
            if gemv[0].op == Op.FUSED and any(u.op != Op.GET_ITEM for u in outs):
                continue
            outs = sorted(outs, key=lambda u: u.attrs.get("index", 0))
            members = head + [norm] + gemv + (outs if gemv[0].op == Op.FUSED else [])
            matches.append(Match("norm_gemv", members, sum_out + outs))
        if add is not None:
            taken.add(add.id)
    return fuse_matches(program, matches)
