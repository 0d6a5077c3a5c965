"""Where one decode step of `ingot serve`'s rows decoder spends its time, by op kind.

    python benchmarks/lab/serve_step_profile.py [--rows 8] [--positions 40,55,...] [--int8] [--runs 20]

Each plan step is wrapped with a timer (process CPU time and wall time); the report groups steps by
op (fused ops by kind; quantized matmuls split float/int8) and puts the rest of the run's wall time
(the plan loop, slot lists, frees) under "python".
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", default="", help="each row's position (default: 40 + 13 r)")
    ap.add_argument("--int8", action="store_true", help="cpu.gemv_activations = int8")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="cpu.threads (1: steps timed in thread CPU time, "
                    "steady on a busy machine)")
    ap.add_argument("--kv-dtype", default=None, help="the slots' dtype (float32, bfloat16, float16)")
    ap.add_argument("--per-row", action="store_true", help="without fuse_rows_attention (each row's attention a step)")
    args = ap.parse_args()
    from ingot import CompileOptions
    from ingot.options import CpuOptions
    from ingot.llm.generate import default_model_path
    from ingot.passes.device import FUSIONS
    from ingot.serve.engine import Engine

    options = CompileOptions(cpu=CpuOptions(gemv_activations="int8" if args.int8 else "float32", threads=args.threads),
                             fusions=frozenset(FUSIONS["cpu"]) - {"rows_attention"} if args.per_row else None)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    engine = Engine(default_model_path(), max_batch=args.rows, context=1024, options=options, kv_dtype=args.kv_dtype)
    exe, _ = engine._rows_executable(args.rows)
    slots = tuple(engine.slots[:args.rows])
    positions = np.array([int(p) for p in args.positions.split(",")] if args.positions else
                         [40 + 13 * r for r in range(args.rows)], np.int32)
    rng = np.random.default_rng(0)
    for slot in slots:       # K/V of some earlier tokens (their values do not change the cost)
        for _, a in slot.arrays(engine.config.n_layers):
            a[...] = (rng.standard_normal(a.shape, np.float32) * 0.1).astype(a.dtype)
    state = engine._row_state(slots)
    tokens = np.arange(args.rows, dtype=np.int32) + 100
    plan = exe.plan
    nodes = {n.id: n for n in exe.program.nodes()}
    names = []
    for ids in plan.step_nodes:
        n = nodes[ids[0]]
        name = n.op.name.lower()
        if n.op.name == "FUSED":
            name = "fused:" + n.attrs["kind"]
        elif n.op.name == "QUANTIZED_MATMUL":   # by weight: dtype and [K, N]
            w = n.src[1].type
            name = f"quantized_matmul {w.dtype.name} {w.shape[0]}x{n.type.shape[-1]}"
        names.append(name)
    wall = collections.Counter()
    calls = collections.Counter()

    def timed(fn, name):
        def step(*xs):
            t = clock()
            try:
                return fn(*xs)
            finally:
                wall[name] += clock() - t
                calls[name] += 1
        return step

    exe.run({"tokens": tokens, "positions": positions}, state=state)
    exe.run({"tokens": tokens, "positions": positions}, state=state)
    plain = list(plan.steps)
    t = clock()
    for _ in range(args.runs):
        exe.run({"tokens": tokens, "positions": positions}, state=state)
    untimed = (clock() - t) / args.runs
    plan.steps = [(timed(fn, name), *rest) for (fn, *rest), name in zip(plain, names)]
    t, c = clock(), time.process_time()
    for _ in range(args.runs):
        exe.run({"tokens": tokens, "positions": positions}, state=state)
    total, cpu = (clock() - t) / args.runs, (time.process_time() - c) / args.runs
    plan.steps = plain
    print(f"[{args.rows} rows at positions {positions.tolist()}, {'int8' if args.int8 else 'float32'} activations; "
          f"{len(plain)} plan steps; {'thread CPU' if args.threads == 1 else 'wall'}: untimed step {1e3 * untimed:.1f} ms, "
          f"timed {1e3 * total:.1f} ms; "
          f"{1e3 * cpu:.1f} ms CPU]")
    steps = sum(wall.values()) / args.runs
    for name, s in wall.most_common():
        print(f"  {name:<34}{calls[name] // args.runs:>5} steps {1e3 * s / args.runs:8.2f} ms")
    print(f"  {'python (plan loop, feeds, assigns)':<34}{'':>11}{1e3 * (total - steps):8.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
