"""`ingot view --profile`: time each step of a few runs and give every node its mean time.

The backend's plan says which node(s) each step computes (`plan.step_nodes`); the viewer wraps
the steps of its own executable with a timer, so runs without --profile pay nothing.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..errors import IngotError
from ..ir import Op

RUNS = 5


def _zeros(model) -> dict[str, Any]:
    feeds = {}
    for name, t in model.inputs:
        if not t.static:
            raise IngotError(f"profile: input {name!r} has a dynamic shape {t}; the viewer cannot make an example feed.")
        feeds[name] = np.zeros(t.shape, t.dtype.storage) if t.shape else t.dtype.storage.type(0)
    return feeds


def profile_run(model, device: str = "cpu", runs: int = RUNS) -> dict[str, Any]:
    """{"device", "runs", "total_ms", "nodes": {node id: ms per run}} from `runs` timed runs after one warm-up."""
    if device != "cpu":
        raise IngotError(f"profile: per-node timing is measured on the CPU backend only, not {device!r}.")
    exe = model.executable(device)
    plan = exe.plan
    step_nodes = getattr(plan, "step_nodes", None)
    if step_nodes is None:  # a plan without the record: one step per node that is not a source or an assign
        skip = (Op.CONSTANT, Op.PLACEHOLDER, Op.VARIABLE, Op.ASSIGN)
        step_nodes = [(n.id,) for n in model.program.nodes() if n.op not in skip]
    if len(step_nodes) != len(plan.steps):
        raise IngotError(f"profile: the {device} backend does not say which node each step computes.")
    elapsed = [0.0] * len(plan.steps)

    def timed(fn, k):
        def step(*xs):
            start = time.perf_counter()
            try:
                return fn(*xs)
            finally:
                elapsed[k] += time.perf_counter() - start
        return step

    plan.steps = [(timed(fn, k), *rest) for k, (fn, *rest) in enumerate(plan.steps)]
    feeds = dict(model.feeds) if model.feeds is not None else _zeros(model)
    has_pos = "pos" in feeds
    exe.run(feeds)  # warm-up: numba kernels, first-touch pages
    elapsed[:] = [0.0] * len(elapsed)
    start = time.perf_counter()
    for r in range(runs):
        if has_pos:
            feeds["pos"] = np.int32(r + 1)
        exe.run(feeds)
    total = (time.perf_counter() - start) * 1e3 / runs
    per_node: dict[int, float] = {}
    for k, ids in enumerate(step_nodes):
        for node_id in ids:
            per_node[node_id] = per_node.get(node_id, 0.0) + elapsed[k] * 1e3 / runs / len(ids)
    by_op: dict[str, float] = {}
    ops = {n.id: n.op for n in model.program.nodes()}
    for node_id, ms in per_node.items():
        name = ops[node_id].name.lower() if node_id in ops else "?"
        by_op[name] = by_op.get(name, 0.0) + ms
    return {"device": device, "runs": runs, "total_ms": total, "nodes": per_node,
            "steps_ms": sum(per_node.values()), "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            "skipped": [Op.CONSTANT.name]}
