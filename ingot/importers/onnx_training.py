"""ONNX's optimizer ops (ai.onnx.preview.training: Adagrad, Momentum, Adam) as elementwise Ingot ops:
one update step of each (X, G, state) group; the step count T must be known at import (from_onnx
compiles per value of a T input)."""
from __future__ import annotations

import numpy as np

from .onnx_ops import Context, OnnxNode, converter, need_float, scalar

TRAINING = "ai.onnx.preview.training"


def _groups(node: OnnxNode, per: int):
    data = node.inputs[2:]
    n = len(data) // per
    return [[data[k * n + i] for k in range(per)] for i in range(n)], n


def _step(ctx: Context, node: OnnxNode) -> int:
    return int(np.asarray(ctx.constant(node, 1, "step count T")).reshape(-1)[0])


@converter("Adagrad", domain=TRAINING)
def _adagrad(ctx: Context, node: OnnxNode):
    g = ctx.g
    r, t = node.inputs[0], _step(ctx, node)
    decay, eps, norm = node.attr("decay_factor", 0.0), node.attr("epsilon", 0.0), node.attr("norm_coefficient", 0.0)
    groups, n = _groups(node, 3)
    xs, hs = [], []
    for x, grad, h in groups:
        need_float(ctx, node, x)
        rate = g.reshape(r, ()) / scalar(ctx, 1 + t * decay, x)
        reg = scalar(ctx, norm, x) * x + grad
        h_new = h + reg * reg
        xs.append(x - rate * reg / (g.sqrt(h_new) + scalar(ctx, eps, x)))
        hs.append(h_new)
    return xs + hs


@converter("Momentum", domain=TRAINING)
def _momentum(ctx: Context, node: OnnxNode):
    g = ctx.g
    r, t = node.inputs[0], _step(ctx, node)
    alpha, beta, norm = node.attr("alpha"), node.attr("beta"), node.attr("norm_coefficient")
    mode = node.attr("mode", "standard")
    if mode not in ("standard", "nesterov"):
        raise ctx.fail(node, f"mode {mode!r}")
    groups, n = _groups(node, 3)
    xs, vs = [], []
    for x, grad, v in groups:
        need_float(ctx, node, x)
        rate = g.reshape(r, ())
        reg = scalar(ctx, norm, x) * x + grad
        v_new = scalar(ctx, alpha, x) * v + scalar(ctx, beta if t > 0 else 1.0, x) * reg
        xs.append(x - rate * (v_new if mode == "standard" else reg + scalar(ctx, alpha, x) * v_new))
        vs.append(v_new)
    return xs + vs


@converter("Adam", domain=TRAINING)
def _adam(ctx: Context, node: OnnxNode):
    g = ctx.g
    r, t = node.inputs[0], _step(ctx, node)
    alpha, beta = node.attr("alpha", 0.9), node.attr("beta", 0.999)
    eps, norm, post = node.attr("epsilon", 0.0), node.attr("norm_coefficient", 0.0), node.attr("norm_coefficient_post", 0.0)
    groups, n = _groups(node, 4)
    xs, vs, hs = [], [], []
    for x, grad, v, h in groups:
        need_float(ctx, node, x)
        reg = scalar(ctx, norm, x) * x + grad
        v_new = scalar(ctx, alpha, x) * v + scalar(ctx, 1 - alpha, x) * reg
        h_new = scalar(ctx, beta, x) * h + scalar(ctx, 1 - beta, x) * (reg * reg)
        adjust = np.sqrt(1 - beta ** t) / (1 - alpha ** t) if t > 0 else 1.0
        rate = g.reshape(r, ()) * scalar(ctx, adjust, x)
        x_new = x - rate * (v_new / (g.sqrt(h_new) + scalar(ctx, eps, x)))
        xs.append(scalar(ctx, 1 - post, x) * x_new)
        vs.append(v_new)
        hs.append(h_new)
    return xs + vs + hs
