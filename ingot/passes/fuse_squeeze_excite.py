"""A squeeze-excite block as one FUSED "squeeze_excite" op, which the CPU backend runs as one kernel
(backends/cpu/squeeze_excite.py): the global average pool of x, two 1x1 convolutions on the pooled
vector (each with its epilogue: bias, ReLU, hard-sigmoid), and x scaled by the result per channel.

MobileNetV3 and PP-OCR's classifiers have one after most depthwise convolutions; unfused it is five
steps of which the two convolutions on a 1 x 1 image cost the most (the conv step's per-call work,
not the arithmetic). Matched, after fuse_conv_epilogue:

    m = MEAN(x, axes (2, 3), keepdims)      x [N, C, H, W] float32
    h = conv(m) [+ epilogue]                 1x1 kernel, groups 1: [N, C', 1, 1]
    s = conv(h) [+ epilogue]                 [N, C, 1, 1]
    y = MUL(x, s) or MUL(s, x)               [N, C, H, W]

where m, h and s are read only by the next one, and each epilogue's ops are SCALAR_OPS over scalars
or per-channel values.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, consumers
from .fuse_conv_epilogue import operand_form
from .fusion import Match, fuse_matches

SCALAR_OPS = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM, Op.NEG, Op.ABS, Op.SIGMOID}


def conv_of(node: Node) -> tuple[Node, list[Node]] | None:
    """(the conv, its epilogue's ops) of a CONV or a FUSED conv_epilogue node."""
    if node.op == Op.CONV:
        return node, []
    if node.op == Op.FUSED and node.attrs.get("kind") == "conv_epilogue":
        body = node.attrs["body"]
        convs = body.find(Op.CONV)
        if len(convs) == 1:
            return convs[0], [n for n in body.nodes if n.op != Op.PLACEHOLDER and n is not convs[0]]
    return None


def plain_conv(node: Node) -> tuple[Node, list[Node]] | None:
    """(conv, epilogue) of a float32 4-D CONV / conv_epilogue with constant weights and epilogue operands
    scalars or per-channel constants, the conv's input the node's first source."""
    found = conv_of(node)
    if found is None or node.dtype.name != "float32" or not node.type.static or node.type.rank != 4:
        return None
    conv, epilogue = found
    if node.op == Op.FUSED and conv.src[0].attrs.get("param") != 0:
        return None
    if not all(s.op == Op.CONSTANT for s in node.src[1:]) or tuple(node.type.shape) != tuple(conv.type.shape):
        return None
    out = tuple(conv.type.shape)
    for n in epilogue:
        for s in n.src:
            if s.op == Op.PLACEHOLDER and operand_form(tuple(s.type.shape), out) not in ("scalar", "channel"):
                return None
    return conv, epilogue


def _vector_conv(node: Node, channels_in: int) -> bool:
    """A plain_conv that is a 1x1 conv (groups 1, no padding) on a [N, channels_in, 1, 1] value, its
    epilogue of float32 SCALAR_OPS."""
    found = plain_conv(node)
    if found is None:
        return False
    conv, epilogue = found
    w = conv.src[1].type.shape
    if conv.attrs["groups"] != 1 or len(w) != 4 or tuple(w[1:]) != (channels_in, 1, 1) or \
            any(a or b for a, b in conv.attrs["pads"]) or tuple(node.type.shape[2:]) != (1, 1):
        return False
    out = tuple(conv.type.shape)
    return all(n.op in SCALAR_OPS and n.dtype.name == "float32" and tuple(n.type.shape) == out for n in epilogue)


def fuse_squeeze_excite(program: Program) -> tuple[Program, bool]:
    """Replace each squeeze-excite block by a FUSED node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for y in nodes:
        if y.op != Op.MUL or y.dtype.name != "float32" or not y.type.static or y.type.rank != 4:
            continue
        for x, s in (y.src, reversed(y.src)):
            if tuple(x.type.shape) != tuple(y.type.shape) or tuple(s.type.shape) != (*y.type.shape[:2], 1, 1):
                continue
            h = s.src[0] if s.src else None
            m = h.src[0] if h is not None and h.src else None
            if m is None or m.op != Op.MEAN or m.src[0] is not x or tuple(m.attrs["axes"]) != (2, 3) or \
                    not m.attrs.get("keepdims", False):
                continue
            if not (_vector_conv(h, y.type.shape[1]) and _vector_conv(s, h.type.shape[1])):
                continue
            if any(len(users[n.id]) != 1 or n.id in roots for n in (m, h, s)):
                continue
            matches.append(Match("squeeze_excite", [m, h, s, y], [y]))
            break
    return fuse_matches(program, matches)
