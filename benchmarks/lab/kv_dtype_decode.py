"""CPU decode speed at a long context by KV cache dtype: the default model (SmolLM2) prefilled with
--context-fill tokens, then --steps greedy decode steps, per kv_dtype; the dtypes interleaved round by
round (a busy neighbour slows all alike), medians of --rounds, wall and process CPU time per token.

    nice -n 19 python benchmarks/lab/kv_dtype_decode.py [--kv-dtypes float32,bfloat16,int8] [--context-fill 2048]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import ingot.llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--context-fill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from ingot.options import CompileOptions, CpuOptions
    options = CompileOptions(cpu=CpuOptions(threads=args.threads))
    context = args.context_fill + args.steps * (args.rounds + 1) + 8
    ids = list(np.random.default_rng(0).integers(100, 40000, args.context_fill))
    llms = {kv: ingot.llm.load(context=context, kv_dtype=kv, options=options) for kv in args.kv_dtypes.split(",")}
    for llm in llms.values():
        llm.prefill(ids)
        llm.step(5)                                       # the decode executable compiled
    times: dict[str, list[tuple[float, float]]] = {kv: [] for kv in llms}
    for _ in range(args.rounds):
        for kv, llm in llms.items():
            w0, c0 = time.perf_counter(), time.process_time()
            token = 5
            for _ in range(args.steps):
                token = int(np.argmax(llm.step(token)))
            times[kv].append(((time.perf_counter() - w0) / args.steps, (time.process_time() - c0) / args.steps))
    base = statistics.median(w for w, _ in times["float32"]) if "float32" in times else None
    print(f"decode after {args.context_fill} tokens, {args.steps} steps x {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for kv, rows in times.items():
        wall, cpu = statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows)
        ratio = f", {base / wall:.2f}x float32's tok/s" if base else ""
        print(f"  {kv:9s} {1 / wall:7.1f} tok/s ({wall * 1e3:6.1f} ms wall, {cpu * 1e3:6.1f} ms CPU a token){ratio}")


if __name__ == "__main__":
    main()
