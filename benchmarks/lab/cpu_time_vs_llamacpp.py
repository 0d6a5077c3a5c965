"""Ingot (int8 activations, 1 thread) against llama.cpp (1 thread) on one GGUF, interleaved round by round:
a prefill of 512 tokens and 64 greedy decode steps after 32, in wall and process CPU time. CPU time per
token is steadier than wall time on a shared machine; the decode timing leaves the prompt's prefill out.
Round 0 is a warm-up; medians of the rest.

    nice -n 19 python benchmarks/lab/cpu_time_vs_llamacpp.py --gguf PATH [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import anchors  # noqa: E402
from cpu_llm import IngotEngine, LlamaCppEngine  # noqa: E402


def decode(e, prompt: list[int], n: int) -> tuple[float, float]:
    """(wall, CPU) seconds of n greedy steps after prompt, the prompt's prefill not counted."""
    e.llm.reset()
    if isinstance(e, IngotEngine):
        nxt = int(np.argmax(e.llm.prefill(prompt)))

        def step(t):
            return int(np.argmax(e.llm.step(t)))
    else:
        e.llm.eval(prompt)
        nxt = int(np.argmax(e.llm.scores[e.llm.n_tokens - 1]))

        def step(t):
            e.llm.eval([t])
            return int(np.argmax(e.llm.scores[e.llm.n_tokens - 1]))
    c, w = time.process_time(), time.perf_counter()
    for _ in range(n):
        nxt = step(nxt)
    return time.perf_counter() - w, time.process_time() - c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engines = [IngotEngine(args.gguf, 2048, "int8", 1), LlamaCppEngine(args.gguf, 2048, 1, 512)]
    prompt = anchors._token_ids(512, engines[0].vocab)
    dprompt = anchors._token_ids(32, engines[0].vocab, seed=1)
    runs: dict[str, list] = {}
    for r in range(args.rounds + 1):
        for e in engines:
            c, w = time.process_time(), time.perf_counter()
            e.prefill(prompt)
            pw, pc = time.perf_counter() - w, time.process_time() - c
            dw, dc = decode(e, dprompt, 64)
            if r:
                runs.setdefault(e.name, []).append((pw, pc, dw, dc))
            print(f"round {r}: {e.name}: prefill {1e3 * pw:.0f} ms wall, {1e3 * pc:.0f} ms CPU; decode "
                  f"{1e3 * dw / 64:.2f} ms/tok wall, {1e3 * dc / 64:.2f} ms/tok CPU; load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
    for name, v in runs.items():
        pw, pc, dw, dc = (statistics.median(x[i] for x in v) for i in range(4))
        print(f"{name}: prefill {512 / pw:.0f} tok/s wall, {512 / pc:.0f} tok/CPU-s; "
              f"decode {64 / dw:.1f} tok/s wall, {64 / dc:.1f} tok/CPU-s ({1e3 * dc / 64:.1f} ms CPU a token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
