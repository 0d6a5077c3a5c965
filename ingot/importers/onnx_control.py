"""ONNX control flow, all resolved at import: Loop and Scan unrolled (static trip counts, conditions
known at import), and If folded. Its condition must be known then (a constant, shape
arithmetic, or computed from inputs fixed with constant_inputs=, which from_onnx does per value at
run for a small input such as a sample rate); the chosen branch is converted into the graph and
the other is never read. An If whose condition depends on a tensor's data is refused."""
from __future__ import annotations

import numpy as np

from ..ops import normalize_axis
from .onnx_ops import Context, NeedsConstant, OnnxNode, converter, placeholders_of


@converter("If")
def _if(ctx: Context, node: OnnxNode):
    cond = node.input(0)
    value = ctx.value(cond)
    if value is None:
        sources = placeholders_of(cond)
        raise NeedsConstant(f"{ctx.what}: {node.label}: Ingot folds If at import, so its condition must be known then, but "
                            f"it is computed at run time{f' from graph inputs {sources} (fix them with constant_inputs=)' if sources else ''}.",
                            sources)
    if np.size(value) != 1:
        raise ctx.fail(node, f"a condition of {np.size(value)} values (ONNX requires one)")
    branch = node.attr("then_branch") if bool(np.asarray(value).reshape(-1)[0]) else node.attr("else_branch")
    outs = ctx.import_subgraph(branch, ctx.scope)
    if len(outs) != len(node.outputs):
        raise ctx.fail(node, f"a branch with {len(outs)} outputs for {len(node.outputs)} node outputs")
    return outs


MAX_UNROLLED_NODES = 20_000   # a Loop or Scan is unrolled at import only up to this many body nodes in all


def _body_size(graph) -> int:
    return max(len(graph.node), 1)


@converter("Scan")
def _scan(ctx: Context, node: OnnxNode):
    """Scan (opset 9+) unrolled at import: its trip count is the scan axis's static length."""
    if node.opset < 9:
        raise ctx.fail(node, "the opset 8 form (batch axis and sequence_lens)")
    g = ctx.g
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    states, scans = list(node.inputs[:len(node.inputs) - m]), list(node.inputs[len(node.inputs) - m:])
    in_axes = [normalize_axis("Scan", a, t.ndim) for a, t in zip(node.attr("scan_input_axes") or [0] * m, scans)]
    in_reverse = node.attr("scan_input_directions") or [0] * m
    lengths = {t.shape[a] for t, a in zip(scans, in_axes)}
    if len(lengths) != 1:
        raise ctx.fail(node, f"scan inputs of different lengths {sorted(lengths)}")
    (steps,) = lengths
    if steps * _body_size(body) > MAX_UNROLLED_NODES:
        raise ctx.fail(node, f"{steps} steps of a {len(body.node)}-node body (Ingot unrolls Scan up to "
                             f"{MAX_UNROLLED_NODES} nodes)")
    n_out = len(body.output) - len(states)
    per_step: list[list] = [[] for _ in range(n_out)]
    for t in range(steps):
        slices = []
        for x, axis, rev in zip(scans, in_axes, in_reverse):
            i = steps - 1 - t if rev else t
            slices.append(_index(g, x, i, axis))
        outs = ctx.import_subgraph(body, ctx.scope, states + slices)
        states = outs[:len(states)]
        for k, y in enumerate(outs[len(states):]):
            per_step[k].append(y)
    out_axes = node.attr("scan_output_axes") or [0] * n_out
    out_reverse = node.attr("scan_output_directions") or [0] * n_out
    stacked = []
    for ys, axis, rev in zip(per_step, out_axes, out_reverse):
        axis = normalize_axis("Scan", axis, ys[0].ndim + 1)
        ys = ys[::-1] if rev else ys
        stacked.append(g.concat([g.reshape(y, y.shape[:axis] + (1,) + y.shape[axis:]) for y in ys], axis))
    return states + stacked


def _index(g, x, i: int, axis: int):
    """x[..., i, ...] along axis (the axis removed)."""
    start = [0] * x.ndim
    end = list(x.shape)
    start[axis], end[axis] = i, i + 1
    part = g.slice(x, start, end)
    return g.reshape(part, x.shape[:axis] + x.shape[axis + 1:])


@converter("Loop")
def _loop(ctx: Context, node: OnnxNode):
    """Loop unrolled at import: its trip count and every step's condition must be known then."""
    g = ctx.g
    body = node.attr("body")
    trip, cond = node.input(0), node.input(1)
    carried = [t for t in node.inputs[2:]]
    if any(t is None for t in carried):
        raise ctx.fail(node, "omitted loop-carried values")
    limit = None if trip is None else int(np.asarray(ctx.constant(node, 0, "trip count")).reshape(-1)[0])
    going = True if cond is None else bool(np.asarray(ctx.constant(node, 1, "condition")).reshape(-1)[0])
    if limit is None:
        raise ctx.fail(node, "no trip count (Ingot unrolls Loop at import)")
    if limit * _body_size(body) > MAX_UNROLLED_NODES:
        raise ctx.fail(node, f"{limit} steps of a {len(body.node)}-node body (Ingot unrolls Loop up to "
                             f"{MAX_UNROLLED_NODES} nodes)")
    n_scan = len(body.output) - 1 - len(carried)
    per_step: list[list] = [[] for _ in range(n_scan)]
    i = 0
    while i < limit and going:
        outs = ctx.import_subgraph(body, ctx.scope, [g.constant(np.array(i, np.int64)), g.constant(np.array(going)), *carried])
        value = ctx.value(outs[0])
        if value is None:
            raise ctx.fail(node, "a condition computed from data (Ingot unrolls Loop at import)")
        going = bool(np.asarray(value).reshape(-1)[0])
        carried = outs[1:1 + len(carried)]
        for k, y in enumerate(outs[1 + len(carried):]):
            per_step[k].append(y)
        i += 1
    if any(not ys for ys in per_step):
        raise ctx.fail(node, "scan outputs of a loop that runs no step")
    return carried + [g.concat([g.reshape(y, (1,) + y.shape) for y in ys], 0) for ys in per_step]
