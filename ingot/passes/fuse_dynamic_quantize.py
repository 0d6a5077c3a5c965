"""ONNX's DynamicQuantizeLinear (importers/onnx_quant.py) as one FUSED "dynamic_quantize" op, which the
CPU backend runs as two passes over x (backends/cpu/int8_matmul.py) instead of a dozen steps.

The importer writes it as
    lo = minimum(min(x), 0); hi = maximum(max(x), 0)
    scale = where(hi == lo, 1, (hi - lo) / 255)
    zero_point = quantize(-lo / scale, uint8)            (scale 1: saturate(round(.)))
    y = quantize(x, uint8, scale, zero_point)            (scale and zero point reshaped, the latter cast)
and the pass matches that chain (constants 0, 1 and 255 checked). The fused op's outputs are those of
y, scale and zero_point read outside it, in that order.
"""
from __future__ import annotations

import numpy as np

from ..ir import Op, Program, consumers
from .fusion import Match, fuse_matches


def _value(program: Program, node, want: float) -> bool:
    v = program.constants.get(node.attrs.get("key")) if node.op == Op.CONSTANT else None
    return v is not None and v.size == 1 and float(np.asarray(v).reshape(-1)[0]) == want


def _unwrap(node, *ops):
    """node below any chain of these ops (one source each)."""
    chain = []
    while node.op in ops:
        chain.append(node)
        node = node.src[0]
    return node, chain


def match(program: Program, y, users) -> Match | None:
    """The DynamicQuantizeLinear chain ending in quantize y, or None."""
    if y.op != Op.QUANTIZE or y.attrs.get("mode") != "affine" or not y.attrs.get("has_zero_point") or \
            y.dtype.name != "uint8" or len(y.src) != 3 or y.src[0].dtype.name != "float32" or not y.type.static:
        return None
    x = y.src[0]
    scale, s_chain = _unwrap(y.src[1], Op.RESHAPE)
    zq, z_chain = _unwrap(y.src[2], Op.RESHAPE, Op.CAST)
    if scale.op != Op.WHERE or zq.op != Op.QUANTIZE or zq.attrs.get("has_zero_point") or zq.dtype.name != "uint8":
        return None
    eq, one, div = scale.src
    if eq.op != Op.EQUAL or div.op != Op.DIV or not _value(program, one, 1) or not _value(program, div.src[1], 255):
        return None
    hi, lo = eq.src
    sub = div.src[0]
    if sub.op != Op.SUB or sub.src[0] is not hi or sub.src[1] is not lo:
        return None
    full = tuple(range(x.type.rank))
    for bound, op, reduce in ((hi, Op.MAXIMUM, Op.MAX), (lo, Op.MINIMUM, Op.MIN)):
        if bound.op != op or bound.src[0].op != reduce or bound.src[0].src[0] is not x or \
                tuple(sorted(bound.src[0].attrs["axes"])) != full or not _value(program, bound.src[1], 0):
            return None
    zdiv, zone = zq.src
    if zdiv.op != Op.DIV or zdiv.src[1] is not scale or zdiv.src[0].op != Op.NEG or zdiv.src[0].src[0] is not lo \
            or not _value(program, zone, 1):
        return None
    members = [hi.src[0], hi, lo.src[0], lo, eq, sub, div, scale, *reversed(s_chain), zdiv.src[0], zdiv, zq,
               *reversed(z_chain), y]
    inside = {m.id for m in members}
    read_outside = {m.id for m in members if any(u.id not in inside for u in users[m.id])} | \
        {m.id for m in members if m.id in {r.id for r in program.roots}}
    outputs = [n for n in (y, scale, zq) if n.id in read_outside]
    if read_outside - {n.id for n in outputs} or y not in outputs:
        return None
    return Match("dynamic_quantize", members, outputs)


def fuse_dynamic_quantize(program: Program) -> tuple[Program, bool]:
    """Replace each DynamicQuantizeLinear chain by a FUSED node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    matches = [m for m in (match(program, n, users) for n in nodes if n.op == Op.QUANTIZE) if m is not None]
    return fuse_matches(program, matches)
