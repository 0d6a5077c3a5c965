"""Chains of convolutions kept in the channel-blocked layout (ops/layout.py: [N, C/16, H, W, 16]) between
the CPU's conv kernels, as onnxruntime's NCHWc: each conv of a chain becomes a FUSED "blocked" op whose
body is the conv with its blocked inputs unblocked and its output blocked,

    y = conv_or_fused(x, w, ...)   ->   yb = FUSED blocked(xb, w, ...)
                                        body: block_channels(conv_or_fused(unblock_channels(xb), w, ...))

so the fused op equals the NCHW one by construction, and the backend (backends/cpu/blocked.py) runs the
conv's kernel reading and writing blocks of 16 channels: a depthwise conv's input needs no transpose into
its padded [H', W', 16] buffer nor its output one back, a 1x1 conv's tile of 16 output channels is stored
as it is (conv_pointwise's and conv_depthwise's transposes otherwise).

Members (after fuse_expand_depthwise, float32 4-D static convs with constant weights): the FUSED
expand_depthwise op, and a CONV or conv_epilogue that is a 1x1 conv (stride 1, no padding, groups 1;
a residual the same shape as its output allowed in the epilogue) or a depthwise one (kh, kw <= 7,
column stride 1 or 2, dilation 1; scalar or per-channel epilogue operands). A member's output is
blocked where every reader is a member reading it as its image or its residual (the reader's output
then blocked too) and it is no program output; its image is blocked where its producer's output is.
No conversion node is left between two members; a chain's first and last kernels read and write NCHW.
"""
from __future__ import annotations

from ..ir import Node, Op, Program, TensorType, consumers
from ..ops.fused import Body
from ..ops.layout import BLOCK
from . import rebuild
from .fuse_conv_epilogue import operand_form
from .fuse_squeeze_excite import conv_of


def _pointwise(conv: Node) -> bool:
    a = conv.attrs
    return a["groups"] == 1 and tuple(conv.src[1].type.shape[2:]) == (1, 1) and all(s == 1 for s in a["strides"]) and \
        not any(p or q for p, q in a["pads"])


def _depthwise(conv: Node) -> bool:
    a = conv.attrs
    w = conv.src[1].type.shape
    return a["groups"] == conv.src[0].type.shape[1] == w[0] and w[1] == 1 and w[2] <= 7 and w[3] <= 7 and \
        a["strides"][1] in (1, 2) and tuple(a["dilations"]) == (1, 1)


def _few_lanes_wasted(m: int, positions: int) -> bool:
    """Whether a 1x1 conv's 16-channel blocks compute no more dropped lanes than 16-position vectors would
    (the NCHW kernel's): MobileNet's 72 -> 24 channels on 28 x 28 (24 of 32 lanes, 784 = 49 x 16) lost 8 us
    of 30 blocked."""
    return (-(-m // 16) * 16) * positions <= m * (-(-positions // 16) * 16)


def _member(node: Node) -> tuple[int, set[int]] | None:
    """(the source index of the image, those of residuals) of a member, or None."""
    if node.op not in (Op.CONV, Op.FUSED) or not isinstance(node.type, TensorType) or node.dtype.name != "float32" or \
            not node.type.static or node.type.rank != 4:
        return None
    if node.op == Op.FUSED and node.attrs.get("kind") == "expand_depthwise":
        first = [n for n in node.attrs["body"].nodes if n.op in (Op.CONV, Op.FUSED)][0]
        image = first.src[0]
        return (image.attrs["param"], set()) if image.op == Op.PLACEHOLDER else None
    found = conv_of(node)
    if found is None:
        return None
    conv, epilogue = found
    if conv.dtype.name != "float32" or conv.type.rank != 4 or tuple(conv.type.shape) != tuple(node.type.shape):
        return None
    pointwise, depthwise = _pointwise(conv), _depthwise(conv)
    m = conv.type.shape[1]
    if not (pointwise or depthwise) or pointwise and not _few_lanes_wasted(m, conv.type.size // m):
        return None
    param = (lambda s: s.attrs["param"]) if node.op == Op.FUSED else (lambda s: node.src.index(s))
    if any(node.src[param(s)].op != Op.CONSTANT for s in conv.src[1:]):
        return None
    if node.op == Op.FUSED and conv.src[0].op != Op.PLACEHOLDER:
        return None
    residuals = set()
    out = tuple(conv.type.shape)
    for n in epilogue:
        for s in n.src:
            if s.op != Op.PLACEHOLDER:
                continue
            form = operand_form(tuple(s.type.shape), out)
            if form == "full" and pointwise and s.dtype.name == "float32":
                residuals.add(param(s))
            elif form not in ("scalar", "channel"):
                return None
    return param(conv.src[0]), residuals


def block_channels(program: Program) -> tuple[Program, bool]:
    """Rewrite each chain of member convs into FUSED "blocked" ops; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    members = {n.id: m for n in nodes if (m := _member(n)) is not None}
    roots = {n.id for n in program.roots}
    by_id = {n.id: n for n in nodes}
    blocked = {i for i in members if i not in roots}   # outputs kept blocked: shrunk to a fixed point

    def reads_ok(producer: Node, reader: Node) -> bool:
        if reader.id not in members:
            return False
        image, residuals = members[reader.id]
        uses = {k for k, s in enumerate(reader.src) if s is producer}
        return uses <= {image} | residuals and (not uses & residuals or reader.id in blocked)

    changed = True
    while changed:
        changed = False
        for i in list(blocked):
            n = by_id[i]
            if not all(reads_ok(n, r) for r in users[i]) or \
                    any(n.src[k].id not in blocked for k in members[i][1]):
                blocked.discard(i)
                changed = True
    if not blocked:
        return program, False
    memo: dict[int, Node] = {}
    for n in nodes:
        src = tuple(memo[s.id] for s in n.src)
        if n.id in members and (n.id in blocked or any(s.id in blocked for s in n.src)):
            memo[n.id] = _blocked_node(n, src, [s.id in blocked for s in n.src], n.id in blocked)
        else:
            memo[n.id] = rebuild(n, src)
    return program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns]), True


def _blocked_node(node: Node, src: tuple[Node, ...], blocked_in: list[bool], blocked_out: bool) -> Node:
    params = [Node(Op.PLACEHOLDER, s.type, (), {"param": k}, name=f"in{k}") for k, s in enumerate(src)]
    inner_src = tuple(Node(Op.UNBLOCK_CHANNELS, old.type, (p,), {"channels": old.type.shape[1]}) if b else p
                      for p, old, b in zip(params, node.src, blocked_in))
    inner = node.replace(src=inner_src)
    out = inner
    if blocked_out:
        c = node.type.shape[1]
        shape = (node.type.shape[0], -(-c // BLOCK)) + tuple(node.type.shape[2:]) + (BLOCK,)
        out = Node(Op.BLOCK_CHANNELS, TensorType(shape, node.dtype), (inner,))
    body = Body(params, [out])
    return Node(Op.FUSED, body.output_type, src, {"kind": "blocked", "body": body})
