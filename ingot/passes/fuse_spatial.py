"""The data movement between convolutions as one step each (CPU), and per-channel elementwise ops moved
in front of a depth-to-space shuffle so that they join the convolution's epilogue.

ONNX importers build pooling, nearest resizing and kernel-equals-stride transposed convolutions from
general ops, which the CPU ran as NumPy passes around the convolutions (a DBNet detector at 320 x 320:
1.6 of its 9.2 ms, the convolutions' own time 6.2). This pass recognises them:

- "max_pool": max over the window axes of an array_view [N, C, kh, kw, OH, OW] of a [N, C, H, W] tensor
  (strides dilation * row, stride * row, ...), padded first or not: one compiled pass per plane.
- "upsample": gather along axis 2, axis 3 or both of a [N, C, H, W] tensor by constant indices (nearest
  Resize/Upsample): one pass, repeated rows copied whole.
- "depth_to_space": reshape [N, M*kh*kw, H, W] -> [N, M, kh, kw, H, W], transpose to [N, M, H, kh, W,
  kw], reshape to [N, M, H*kh, W*kw] (a transposed convolution whose kernel equals its stride, as a
  1x1 convolution then this shuffle): one pass. Before that, elementwise ops after the shuffle whose other
  operands are scalars or per-channel constants (the bias, a batch norm, the activation) move in front
  of it with each channel's value repeated kh*kw times, where fuse_conv_epilogue takes them into the
  convolution.
"""
from __future__ import annotations

import numpy as np

from ..ir import GroupOp, Node, Op, Program, TensorType, consumers
from ..ops import infer_type
from . import rebuild
from .fusion import Match, fuse_matches

_SHUFFLE_PERM = (0, 1, 4, 2, 5, 3)
_MOVABLE = GroupOp.Binary | {Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIGMOID, Op.SILU, Op.GELU, Op.ERF}


def _static4(node: Node) -> bool:
    return isinstance(node.type, TensorType) and node.type.static and node.type.rank == 4 and \
        node.dtype.name == "float32"


def pool_window(view: Node) -> tuple | None:
    """(kh, kw, sh, sw, dh, dw) where view is an array_view [N, C, kh, kw, OH, OW] of its [N, C, H, W] source
    as pooling makes it, else None."""
    x = view.src[0]
    if not _static4(x) or view.type.rank != 6 or view.attrs.get("offset", 0) != 0:
        return None
    n, c, h, w = x.type.shape
    vn, vc, kh, kw, oh, ow = view.type.shape
    st = tuple(view.attrs["strides"])
    if (vn, vc) != (n, c) or st[0] != c * h * w or st[1] != h * w or st[2] % w or st[4] % w:
        return None
    dh, dw, sh, sw = st[2] // w, st[3], st[4] // w, st[5]
    if min(kh, kw, oh, ow, dh, dw, sh, sw) < 1 or (oh - 1) * sh + (kh - 1) * dh >= h or (ow - 1) * sw + (kw - 1) * dw >= w:
        return None
    return kh, kw, sh, sw, dh, dw


def _max_pool(node: Node, users) -> Match | None:
    if node.op != Op.MAX or node.dtype.name != "float32" or node.type.rank != 4 or node.attrs.get("keepdims") or \
            tuple(sorted(node.attrs["axes"])) != (2, 3):
        return None
    view = node.src[0]
    if view.op != Op.ARRAY_VIEW or len(users[view.id]) != 1 or pool_window(view) is None:
        return None
    members = [view, node]
    pad = view.src[0]
    if pad.op == Op.PAD and pad.attrs.get("mode", "constant") == "constant" and len(users[pad.id]) == 1 and \
            tuple(pad.attrs["pads"][:2]) == ((0, 0), (0, 0)) and all(a >= 0 and b >= 0 for a, b in pad.attrs["pads"]) \
            and _static4(pad.src[0]):
        members.insert(0, pad)
    return Match("max_pool", members, [node])


def _gather_axis(node: Node) -> int | None:
    """The axis (2 or 3) of a gather of a float32 [N, C, H, W] by a constant 1-D index, else None."""
    if node.op != Op.GATHER or not _static4(node) or not _static4(node.src[0]):
        return None
    idx = node.src[1]
    axis = node.attrs["axis"]
    if axis not in (2, 3) or idx.op != Op.CONSTANT or idx.type.rank != 1 or idx.dtype.name not in ("int32", "int64"):
        return None
    return axis


def _upsample(node: Node, users, done: set) -> Match | None:
    if node.id in done or _gather_axis(node) is None:
        return None
    inner = node.src[0]
    members = [node]
    if _gather_axis(inner) is not None and _gather_axis(inner) != _gather_axis(node) and len(users[inner.id]) == 1:
        members.insert(0, inner)
    for m in members:
        done.add(m.id)
    return Match("upsample", members, [node])


def shuffle_of(node: Node) -> tuple[Node, int, int] | None:
    """(source, kh, kw) where node is reshape(transpose(reshape(source), _SHUFFLE_PERM)) as a depth-to-space
    shuffle [N, M*kh*kw, H, W] -> [N, M, H*kh, W*kw], else None."""
    if node.op != Op.RESHAPE or not _static4(node):
        return None
    t = node.src[0]
    if t.op != Op.TRANSPOSE or tuple(t.attrs["perm"]) != _SHUFFLE_PERM or t.src[0].op != Op.RESHAPE:
        return None
    source = t.src[0].src[0]
    if not _static4(source) or t.src[0].type.rank != 6:
        return None
    n, m, kh, kw, h, w = t.src[0].type.shape
    if tuple(source.type.shape) != (n, m * kh * kw, h, w) or tuple(node.type.shape) != (n, m, h * kh, w * kw):
        return None
    return source, kh, kw


def _channel_values(node: Node, program: Program, m: int) -> np.ndarray | None:
    """A constant's values as [M] (a scalar: [1]) where it broadcasts against [N, M, H, W] per channel."""
    if node.op != Op.CONSTANT or node.dtype.name != "float32":
        return None
    shape = tuple(node.type.shape)
    if all(d == 1 for d in shape):
        return np.asarray(program.constants[node.attrs["key"]], np.float32).reshape(1)
    padded = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or padded[1] != m or any(d != 1 for i, d in enumerate(padded) if i != 1):
        return None
    return np.asarray(program.constants[node.attrs["key"]], np.float32).reshape(m)


def _sink_into_shuffles(program: Program) -> tuple[Program, bool]:
    """Elementwise ops after a depth-to-space shuffle, per channel or scalar, applied before it instead."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    chains: dict[int, tuple[Node, list[Node], int, int]] = {}   # last op's id -> (shuffle, ops, kh, kw)
    for node in nodes:
        found = shuffle_of(node)
        if found is None or node.id in roots:
            continue
        _, kh, kw = found
        m = node.type.shape[1]
        ops, last = [], node
        while len(users[last.id]) == 1 and last.id not in roots:
            (u,) = users[last.id]
            if u.op not in _MOVABLE or u.type != node.type or u.src[0] is not last or \
                    any(_channel_values(s, program, m) is None for s in u.src[1:]):
                break
            ops.append(u)
            last = u
        if ops:
            chains[last.id] = (node, ops, kh, kw)
    if not chains:
        return program, False
    memo: dict[int, Node] = {}
    for node in nodes:
        if node.id not in chains:
            memo[node.id] = rebuild(node, tuple(memo[s.id] for s in node.src))
            continue
        shuffle, ops, kh, kw = chains[node.id]
        mid, perm = shuffle.src[0], shuffle.src[0].src[0]
        value = memo[perm.src[0].id]
        m = shuffle.type.shape[1]
        for op in ops:
            src = [value]
            for s in op.src[1:]:
                v = _channel_values(s, program, m)
                if v.size > 1:
                    key = f"shuffled_{s.id}_{kh}x{kw}"
                    program.constants[key] = np.repeat(v, kh * kw).reshape(m * kh * kw, 1, 1)
                    s = Node(Op.CONSTANT, TensorType((m * kh * kw, 1, 1), s.dtype), (), {"key": key}, key)
                src.append(s)
            value = Node(op.op, infer_type(op.op, [x.type for x in src], op.attrs), tuple(src), op.attrs, op.name)
        inner = Node(Op.RESHAPE, perm.type, (value,), dict(perm.attrs))
        t = Node(Op.TRANSPOSE, mid.type, (inner,), dict(mid.attrs))
        memo[node.id] = Node(Op.RESHAPE, shuffle.type, (t,), dict(shuffle.attrs), node.name)
    out = program.with_roots([memo[n.id] for n in program.outputs], [memo[n.id] for n in program.assigns])
    return out, True


def fuse_spatial(program: Program) -> tuple[Program, bool]:
    """Sink elementwise ops into shuffles, then replace pools, nearest upsamplings and shuffles by FUSED
    nodes; returns (program, changed)."""
    program, sunk = _sink_into_shuffles(program)
    nodes = program.nodes()
    users = consumers(nodes)
    matches, done = [], set()
    for node in reversed(nodes):   # the outer gather of a pair first
        match = _max_pool(node, users) or _upsample(node, users, done)
        if match is None and shuffle_of(node) is not None and len(users[node.src[0].id]) == 1 and \
                len(users[node.src[0].src[0].id]) == 1:
            match = Match("depth_to_space", [node.src[0].src[0], node.src[0], node], [node])
        if match is not None:
            matches.append(match)
    program, fused = fuse_matches(program, matches[::-1])
    return program, sunk or fused
