"""CPU LLM speed: Ingot vs llama.cpp vs HF transformers on the default model, in one run.

Same figures and method for every engine (see benchmarks/anchors.py): prefill tok/s of one
512-token prompt from an empty cache, and decode tok/s of 128 greedy steps after a 32-token prompt;
medians of --repeats runs after one warm-up. Ratios are Ingot / anchor.

    python -m benchmarks cpu-llm [--gguf PATH] [--repeats 3] [--threads 2] [--skip llamacpp,transformers]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import anchors  # noqa: E402


def ingot_speed(gguf_path: str, n_prompt: int = 512, n_decode: int = 128, decode_prompt: int = 32,
                threads: int = 2, repeats: int = 3) -> dict:
    # BLAS (prefill) uses the machine's threads; the packed GEMV kernels run on INGOT_CPU_THREADS
    # (default 1: splitting them was slower on the 2-core VMs measured)
    import numpy as np
    import ingot.llm

    t = time.perf_counter()
    llm = ingot.llm.load(gguf_path, context=max(n_prompt, decode_prompt + n_decode) + 16)
    load_s = time.perf_counter() - t
    vocab = llm.config.vocab_size
    prompt = anchors._token_ids(n_prompt, vocab)
    dprompt = anchors._token_ids(decode_prompt, vocab, seed=1)

    def prefill_once() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.prefill(prompt)
        return n_prompt / (time.perf_counter() - t)

    def decode_once() -> float:
        llm.reset()
        nxt = int(np.argmax(llm.prefill(dprompt)))
        t = time.perf_counter()
        for _ in range(n_decode):
            nxt = int(np.argmax(llm.step(nxt)))
        return n_decode / (time.perf_counter() - t)

    prefill_once(), decode_once()  # warm-up (compiles the prefill buckets, loads numba kernels)
    load = os.getloadavg()[0]
    pre = [prefill_once() for _ in range(repeats)]
    dec = [decode_once() for _ in range(repeats)]
    from ingot.options import CpuOptions
    return anchors._summary(pre, dec, load, engine="ingot", gemv_threads=CpuOptions().resolved_threads,
                            load_s=round(load_s, 2), n_prompt=n_prompt, n_decode=n_decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-decode", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma-separated anchors to skip: llamacpp,transformers")
    args = ap.parse_args()
    path = args.gguf or anchors.default_gguf_path()
    kw = dict(n_prompt=args.n_prompt, n_decode=args.n_decode, threads=args.threads, repeats=args.repeats)
    results = {"ingot": ingot_speed(path, **kw)}
    for name, fn in (("llamacpp", anchors.llamacpp_speed), ("transformers", anchors.transformers_speed)):
        if name in args.skip.split(","):
            continue
        try:
            results[name] = fn(path, **kw)
        except RuntimeError as e:
            print(f"{name}: skipped ({e})", file=sys.stderr)
    print(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                      "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    me = results["ingot"]
    print(f"\n{'engine':14s} {'pp' + str(args.n_prompt) + ' tok/s':>14s} {'tg' + str(args.n_decode) + ' tok/s':>14s}")
    for name, r in results.items():
        print(f"{name:14s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:14.1f}")
    for name, r in results.items():
        if name != "ingot":
            print(f"ingot / {name}: prefill {me['prefill_tok_s'] / r['prefill_tok_s']:.2f}x, "
                  f"decode {me['decode_tok_s'] / r['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
