"""`ingot serve`'s N-clients-vs-one throughput without HTTP: N client threads each send --requests chat
requests (benchmarks/serve.py's short prompts) one after another straight to a started Engine.

    PYTHONPATH=. python benchmarks/lab/serve_engine_ratio.py [--clients 1,8] [--requests 3] [--max-tokens 64]
                                                             [--int8] [--kv-dtype float32]

For each N: output tok/s and the scheduler thread's wall and CPU time (its own thread: not the team's
worker) in decode steps by row bucket (the model run apart), prefill chunks and whole iterations;
then the N-vs-1 ratio, to set beside `python -m benchmarks serve`'s (which adds HTTP and streaming).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--int8", action="store_true", help="cpu.gemv_activations = int8")
    ap.add_argument("--kv-dtype", default=None)
    args = ap.parse_args()
    from benchmarks.serve import _prompts
    from ingot import CompileOptions
    from ingot.llm.generate import default_model_path
    from ingot.options import CpuOptions
    from ingot.serve.engine import Engine, Request, SamplingParams

    clients = [int(c) for c in args.clients.split(",")]
    options = CompileOptions(cpu=CpuOptions(gemv_activations="int8" if args.int8 else "float32"))
    engine = Engine(default_model_path(), max_batch=max(clients), context=1024, options=options, kv_dtype=args.kv_dtype)
    engine.start()
    engine.warm()
    wall, cpu, calls = collections.Counter(), collections.Counter(), collections.Counter()
    decode_rows = [0]

    def timed(name, fn):
        def call(*a, **k):
            if name == "decode":
                decode_rows[0] = len(a[0])
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                key = f"decode {next(b for b in engine.buckets() if b >= decode_rows[0])} rows" if name == "decode" else name
                wall[key] += time.perf_counter() - w
                cpu[key] += time.thread_time() - c
                calls[key] += 1
        return call

    for rows in engine.buckets():
        exe = engine._rows_executable(rows)[0]
        exe.run = timed("  model run", exe.run)
    engine._decode = timed("decode", engine._decode)
    engine._prefill_chunk = timed("prefill chunk", engine._prefill_chunk)
    engine._iteration = timed("iteration", engine._iteration)
    prompts = [engine.llm.encode_prompt([{"role": "user", "content": p}]) for p in _prompts(max(clients) * args.requests, 0)]

    def ask(ids, max_tokens: int) -> int:
        done, tokens = threading.Event(), []

        def on_event(e):
            if e.kind == "done":
                tokens.append(e.usage["completion_tokens"])
            if e.kind in ("done", "error"):
                done.set()
        engine.submit(Request(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0), on_event=on_event))
        done.wait()
        return sum(tokens)

    results = {}
    for n in clients:
        ask(prompts[0], 8)   # warm-up, as the HTTP benchmark's
        wall.clear(), cpu.clear(), calls.clear()
        out: list = []
        threads = [threading.Thread(target=lambda c: out.extend(ask(i, args.max_tokens) for i in prompts[:n * args.requests][c::n]),
                                    args=(c,)) for c in range(n)]
        start, load = time.perf_counter(), os.getloadavg()[0]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        results[n] = sum(out) / elapsed
        print(f"[{n} clients: {sum(out)} tokens in {elapsed:.2f} s = {results[n]:.1f} tok/s, load {load:.1f}]")
        for key in sorted(wall, key=lambda k: -wall[k]):
            print(f"  {key:<22}{calls[key]:>6} calls {wall[key]:8.2f} s wall {cpu[key]:8.2f} s CPU "
                  f"{1e3 * wall[key] / calls[key]:8.1f} ms/call")
    if 1 in results:
        print("  ".join(f"{n} vs 1: {results[n] / results[1]:.2f}x" for n in clients if n != 1))
    engine.stop()


if __name__ == "__main__":
    main()
