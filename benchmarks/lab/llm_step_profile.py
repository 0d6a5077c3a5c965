"""Where one decode step (or one prefill chunk) of `ingot.llm.load(GGUF)` spends its time, by plan step.

    python benchmarks/lab/llm_step_profile.py --gguf PATH [--size 1|512] [--int8] [--threads 1] [--runs 10]

Each plan step is wrapped with a timer (thread CPU time with --threads 1, steady on a busy machine;
wall time otherwise); steps are grouped by op (fused ops by kind, quantized matmuls by weight dtype
and [K, N]); the rest of the run (the plan loop, frees) is reported as "python". The model runs at
position --pos (decode) or from position 0 (prefill) over a cache of random K/V.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--size", type=int, default=1, help="tokens per run: 1 (decode) or a prefill bucket")
    ap.add_argument("--pos", type=int, default=100, help="position of a decode step")
    ap.add_argument("--int8", action="store_true", help="cpu.gemv_activations = int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    import ingot.llm
    from ingot.options import CompileOptions, CpuOptions

    options = CompileOptions(cpu=CpuOptions(gemv_activations="int8" if args.int8 else "float32", threads=args.threads))
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    llm = ingot.llm.load(args.gguf, context=1024, options=options)
    exe = llm.decoder if args.size == 1 else llm.model.compile(args.size, "cpu", options)
    pos = args.pos if args.size == 1 else 0
    feeds = {"tokens": (np.arange(args.size, dtype=np.int32) * 7919 + 100) % llm.config.vocab_size,
             "pos": np.int32(pos), "last": np.int32(args.size - 1)}
    plan = exe.plan
    nodes = {n.id: n for n in exe.program.nodes()}
    names = []
    for ids in plan.step_nodes:
        n = nodes[ids[0]]
        name = n.op.name.lower()
        if n.op.name == "FUSED":
            name = "fused:" + n.attrs["kind"]
        elif n.op.name == "QUANTIZED_MATMUL":
            w = n.src[1].type
            name = f"quantized_matmul {n.attrs['qdtype'].name} {w.shape[0]}x{n.type.shape[-1]}"
        names.append(name)
    spent = collections.Counter()
    calls = collections.Counter()

    def timed(fn, name):
        def step(*xs):
            t = clock()
            try:
                return fn(*xs)
            finally:
                spent[name] += clock() - t
                calls[name] += 1
        return step

    for _ in range(2):
        exe.run(feeds, state=llm.state)
    plain = list(plan.steps)
    t = clock()
    for _ in range(args.runs):
        exe.run(feeds, state=llm.state)
    untimed = (clock() - t) / args.runs
    plan.steps = [(timed(fn, name), *rest) for (fn, *rest), name in zip(plain, names)]
    t = clock()
    for _ in range(args.runs):
        exe.run(feeds, state=llm.state)
    total = (clock() - t) / args.runs
    plan.steps = plain
    print(f"[{args.size} token(s) at {pos}, {'int8' if args.int8 else 'float32'} activations, {args.threads} thread(s); "
          f"{len(plain)} plan steps; {'thread CPU' if args.threads == 1 else 'wall'}: untimed {1e3 * untimed:.2f} ms, "
          f"timed {1e3 * total:.2f} ms]")
    for name, s in spent.most_common():
        print(f"  {name:<44}{calls[name] // args.runs:>5} steps {1e3 * s / args.runs:8.2f} ms")
    print(f"  {'python (plan loop, frees)':<44}{'':>11}{1e3 * (total - sum(spent.values()) / args.runs):8.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
