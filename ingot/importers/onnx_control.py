"""ONNX control flow: Loop and Scan unrolled at import (static trip counts, conditions known at
import), and If folded where its condition is known then (a constant, shape arithmetic, or computed
from inputs fixed with constant_inputs=, which from_onnx does per value at run for small inputs such
as a sample rate): the chosen branch is converted into the graph and the other is never read.

An If whose condition depends on data (a larger input, or values computed from it) runs at run time:
each branch is imported as a graph of its own, taking the outer values it reads as inputs, compiled
into an executable, and bound as a callable of an `if` op, which runs the one its condition picks.
Both branches must then return the same types (Ingot compiles static shapes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..graph import Tensor
from ..ir import Op, Program, TensorType, toposort
from ..ops import normalize_axis
from .onnx_ops import MAX_SPECIALIZED_ELEMENTS, Context, ImportGraph, NeedsConstant, OnnxNode, converter, placeholders_of


@dataclass
class Branch:
    """An If branch imported on its own: its graph, inputs (placeholder name, type) and outputs."""
    graph: ImportGraph
    inputs: list[tuple[str, TensorType]]
    outputs: list[Tensor]
    branches: dict[str, "Branch"] = field(default_factory=dict)   # its own run-time Ifs


@converter("If")
def _if(ctx: Context, node: OnnxNode):
    cond = node.input(0)
    value = ctx.value(cond)
    if value is None:
        sources = [n for n in toposort([cond.node]) if n.op == Op.PLACEHOLDER]
        if sources and not ctx.in_branch and all(n.type.static and n.type.size <= MAX_SPECIALIZED_ELEMENTS for n in sources):
            names = placeholders_of(cond)
            raise NeedsConstant(f"{ctx.what}: {node.label}: Ingot folds an If whose condition comes from small inputs "
                                f"at import, so its condition must be known then, but it is computed at run time from "
                                f"graph inputs {names} (fix them with constant_inputs=).", names)
        return _if_at_run_time(ctx, node, cond)
    if np.size(value) != 1:
        raise ctx.fail(node, f"a condition of {np.size(value)} values (ONNX requires one)")
    branch = node.attr("then_branch") if bool(np.asarray(value).reshape(-1)[0]) else node.attr("else_branch")
    outs = ctx.import_subgraph(branch, ctx.scope)
    if len(outs) != len(node.outputs):
        raise ctx.fail(node, f"a branch with {len(outs)} outputs for {len(node.outputs)} node outputs")
    return outs


def outer_names(graph) -> list[str]:
    """The names a subgraph reads from its enclosing scopes (nested subgraphs included), in first-use order."""
    local = {vi.name for vi in graph.input} | {i.name for i in graph.initializer}
    found: dict[str, None] = {}
    for n in graph.node:
        reads = list(n.input)
        for a in n.attribute:
            reads += [name for sub in ([a.g] if a.type == a.GRAPH else list(a.graphs)) for name in outer_names(sub)]
        found.update((name, None) for name in reads if name and name not in local)
        local.update(o for o in n.output if o)
    found.update((vi.name, None) for vi in graph.output if vi.name not in local)
    return list(found)


def _if_at_run_time(ctx: Context, node: OnnxNode, cond: Tensor) -> list[Tensor]:
    if cond.type.size != 1:
        raise ctx.fail(node, f"a condition of shape {list(cond.shape)} (ONNX requires one value)")
    graphs = [node.attr("then_branch"), node.attr("else_branch")]
    outer = {name: ctx.scope[name] for g in graphs for name in outer_names(g) if name in ctx.scope}
    passed = [name for name, t in outer.items() if ctx.value(t) is None]   # the rest enter as constants
    built = []
    for graph in graphs:
        sub = Context(ImportGraph(ctx.g.max_elements), ctx.what, ctx.opsets, ctx.quantize, in_branch=True,
                      import_cache=ctx.import_cache)
        sub.import_subgraph = lambda s, o, i=(), into=None, sub=sub: ctx.import_subgraph(s, o, i, into=into or sub)
        values = {}
        for i, (name, t) in enumerate(outer.items()):
            v = sub.g.placeholder(t.shape, t.dtype, name=f"input_{i}") if name in passed else sub.g.constant(ctx.value(t))
            values[name] = sub.declare(v, ctx.onnx_dtype(t))
        built.append((sub, sub.import_subgraph(graph, values)))
    types = [[o.type for o in outs] for _, outs in built]
    if len(types[0]) != len(node.outputs) or types[0] != types[1]:
        raise ctx.fail(node, f"a condition computed at run time and branches that return {types[0]} and {types[1]} "
                             "(Ingot runs such an If only between branches of the same types)")
    stem = re.sub(r"[^A-Za-z0-9_]", "_", node.outputs[0])[:80]
    names = [f"if{len(ctx.branches)}_{stem}_{side}" for side in ("then", "else")]
    for name, (sub, outs) in zip(names, built):
        inputs = [(f"input_{i}", t.type) for i, (n, t) in enumerate(outer.items()) if n in passed]
        ctx.branches[name] = Branch(sub.g, inputs, outs, sub.branches)
    return ctx.g.if_call(cond, names[0], names[1], [outer[n] for n in passed], types[0])


def bind_branches(exe, branches: dict[str, Branch], debug=False) -> None:
    """Compile each run-time If branch (and theirs) for exe's device and bind it to exe's `if` ops."""
    from ..compiler import run_pipeline
    from ..runtime import Executable

    for name, b in branches.items():
        if name not in exe.call_sites:   # an If the compiler dropped (its result unused)
            continue
        program, history = run_pipeline(Program([t.node for t in b.outputs], [], dict(b.graph.constants), {}), debug,
                                        device=exe.device, options=exe.options)
        branch = Executable(program, exe.device, history=history, inputs=b.inputs, options=exe.options)
        bind_branches(branch, b.branches, debug)
        exe.bind(name, branch)


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
