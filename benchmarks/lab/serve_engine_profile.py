"""Where `ingot serve`'s scheduler spends a request load's time, without HTTP: N greedy requests run
through Engine._iteration on this thread, the decode and prefill executables' runs timed apart
from the rest (scheduling, sampling, detokenising, events), which cProfile then breaks down.

    PYTHONPATH=. python benchmarks/lab/serve_engine_profile.py [--clients 8] [--max-tokens 64] [--int8] [--threads 2]
                                                               [--profile]

The short chat prompts of `python -m benchmarks serve --long-every 0`, all submitted at once; every
bucket's rows decoder and every prefill length compiled first.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from benchmarks.serve import QUESTIONS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--int8", action="store_true", help="cpu.gemv_activations = int8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile the loop (slower; top functions by own time)")
    args = ap.parse_args()
    from ingot import CompileOptions
    from ingot.llm.generate import default_model_path
    from ingot.options import CpuOptions
    from ingot.serve.engine import Engine, Request, SamplingParams

    options = CompileOptions(cpu=CpuOptions(gemv_activations="int8" if args.int8 else "float32", threads=args.threads))
    engine = Engine(default_model_path(), max_batch=args.clients, context=1024, options=options)
    engine.warm()
    timers = {"decode": [0.0, 0], "prefill": [0.0, 0]}

    def timed(exe, kind):
        run = exe.run

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return run(*a, **k)
            finally:
                timers[kind][0] += time.perf_counter() - t
                timers[kind][1] += 1
        exe.run = wrapped

    for rows in engine.buckets():
        timed(engine._rows_executable(rows)[0], "decode")
    compile_model = engine.model.compile

    def compiled(*a, **k):
        exe = compile_model(*a, **k)
        if not getattr(exe, "_timed", False):
            timed(exe, "prefill")
            exe._timed = True
        return exe
    engine.model.compile = compiled
    def chat(question: str) -> list[int]:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        return engine.tokenizer.encode(text, add_special=False)

    for question in QUESTIONS:   # warm every prefill size these prompts take
        ids = chat(question)
        engine.submit(Request(ids, SamplingParams(max_tokens=2, temperature=0.0)))
        while engine.running or engine.waiting:
            engine._iteration()
    for t in timers.values():
        t[:] = [0.0, 0]
    events = [0]
    for i in range(args.clients):
        engine.submit(Request(chat(QUESTIONS[i % len(QUESTIONS)]),
                              SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                              on_event=lambda e: events.__setitem__(0, events[0] + 1)))
    profiler = cProfile.Profile() if args.profile else None
    t, c = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    while engine.running or engine.waiting:
        engine._iteration()
    if profiler:
        profiler.disable()
    total, cpu = time.perf_counter() - t, time.process_time() - c
    decode, steps = timers["decode"]
    prefill, prefills = timers["prefill"]
    print(f"[{args.clients} requests x {args.max_tokens} tokens, {'int8' if args.int8 else 'float32'} activations] "
          f"{total:.2f} s wall, {cpu:.2f} s CPU, {events[0]} events: decode {steps} steps {decode:.2f} s "
          f"({1e3 * decode / max(steps, 1):.1f} ms/step), prefill {prefills} runs {prefill:.2f} s, "
          f"the rest {total - decode - prefill:.2f} s ({1e3 * (total - decode - prefill) / max(steps, 1):.2f} ms/step)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
