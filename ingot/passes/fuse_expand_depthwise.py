"""A pointwise convolution read only by a depthwise one (MobileNet's expand -> depthwise) as one FUSED
"expand_depthwise" op: the CPU backend (backends/cpu/expand_depthwise.py) computes the pointwise output 16
channels at a time straight into the depthwise kernel's padded channel-blocked buffer, so it is never
written as NCHW nor transposed back in.

Matched after fuse_conv_epilogue, on float32 4-D convs with constant weights and static shapes:

    a = conv(x, 1x1, stride 1, no padding, groups 1) [+ epilogue]
    b = conv(a, depthwise kh x kw <= 7 x 7, column stride 1 or 2, dilation 1) [+ epilogue]

a read only by b; each epilogue's operands scalars or per-channel constants.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, consumers
from .fuse_squeeze_excite import plain_conv
from .fusion import Match, fuse_matches


def _pointwise(conv: Node) -> bool:
    a = conv.attrs
    return conv.attrs["groups"] == 1 and tuple(conv.src[1].type.shape[2:]) == (1, 1) and \
        all(s == 1 for s in a["strides"]) and not any(p or q for p, q in a["pads"])


def _depthwise(conv: Node) -> bool:
    a = conv.attrs
    w = conv.src[1].type.shape
    c = conv.src[0].type.shape[1]
    return a["groups"] == c == w[0] and w[1] == 1 and w[2] <= 7 and w[3] <= 7 and a["strides"][1] in (1, 2) and \
        tuple(a["dilations"]) == (1, 1)


def fuse_expand_depthwise(program: Program) -> tuple[Program, bool]:
    """Replace each pointwise -> depthwise pair by a FUSED node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for b in nodes:
        found_b = plain_conv(b) if b.op in (Op.CONV, Op.FUSED) else None
        if found_b is None or not _depthwise(found_b[0]) or not b.src:
            continue
        a = b.src[0]
        found_a = plain_conv(a) if a.op in (Op.CONV, Op.FUSED) else None
        if found_a is None or not _pointwise(found_a[0]) or len(users[a.id]) != 1 or a.id in roots:
            continue
        matches.append(Match("expand_depthwise", [a, b], [b]))
    return fuse_matches(program, matches)
