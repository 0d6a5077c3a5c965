"""CPU LLM speed: Ingot vs llama.cpp (and HF transformers) on the default model, in one run.

Same figures and method for every engine (see benchmarks/anchors.py): prefill tok/s of one
512-token prompt from an empty cache, and decode tok/s of 128 greedy steps after a 32-token prompt.
Every engine (Ingot per activation rounding and thread count, llama.cpp per thread count, each
library's default settings too) is loaded first, then the runs are interleaved, one prefill and one
decode per engine per round, so that a busy neighbour slows all alike; medians of --repeats rounds
after one warm-up round. Ratios are Ingot / llama.cpp: best thread count each, and default vs default.
--accuracy also scores integer activations against the exact path, token by token (the decode GEMV),
over tests/fixtures/eval_text.txt: top-1 agreement and mean KLD of the next-token distributions.

    python -m benchmarks cpu-llm [--gguf PATH] [--repeats 3] [--threads 1,2] [--activations float32,int8]
                                 [--skip llamacpp,transformers] [--accuracy]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import anchors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class IngotEngine:
    def __init__(self, path: str, context: int, activations: str, threads: int | None, device: str = "cpu"):
        import ingot.llm
        from ingot.options import CompileOptions, CpuOptions

        self.cpu = CpuOptions(threads=threads, gemv_activations=activations)
        self.key = (activations, self.cpu.resolved_threads)
        self.name = f"ingot {activations} t={self.cpu.resolved_threads}" + (" (default)" if threads is None else "")
        t = time.perf_counter()
        self.llm = ingot.llm.load(path, device=device, context=context, options=CompileOptions(cpu=self.cpu))
        self.load_s = time.perf_counter() - t
        self.vocab = self.llm.config.vocab_size

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.prefill(ids)

    def decode(self, prompt: list[int], n: int) -> float:
        import numpy as np
        self.llm.reset()
        nxt = int(np.argmax(self.llm.prefill(prompt)))
        t = time.perf_counter()
        for _ in range(n):
            nxt = int(np.argmax(self.llm.step(nxt)))
        return time.perf_counter() - t


class LlamaCppEngine:
    def __init__(self, path: str, context: int, threads: int | None, n_batch: int):
        try:
            import llama_cpp
        except ImportError as e:
            raise RuntimeError("llama-cpp-python is not installed (docs/benchmark-setup.md)") from e
        kw = {} if threads is None else dict(n_threads=threads, n_threads_batch=threads)
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_batch=n_batch, n_ubatch=n_batch,
                                   n_gpu_layers=0, logits_all=False, verbose=False, **kw)
        threads = self.llm.n_threads
        self.threads = threads
        self.name = f"llama.cpp t={threads}" + (" (default)" if not kw else "")
        self.version = llama_cpp.__version__
        self.vocab = self.llm.n_vocab()

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)  # clears the cache past n_tokens=0, then one batch

    def decode(self, prompt: list[int], n: int) -> float:
        import numpy as np
        self.llm.reset()
        self.llm.eval(prompt)
        nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([nxt])
            nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return time.perf_counter() - t


def interleaved(engines: list, n_prompt: int, n_decode: int, decode_prompt: int, repeats: int) -> dict:
    """Rounds of one prefill and one decode per engine (round 0 is the warm-up); medians."""
    vocab = engines[0].vocab
    prompt, dprompt = anchors._token_ids(n_prompt, vocab), anchors._token_ids(decode_prompt, vocab, seed=1)
    pre: dict[str, list[float]] = {e.name: [] for e in engines}
    dec: dict[str, list[float]] = {e.name: [] for e in engines}
    loads = [os.getloadavg()[0]]
    for r in range(repeats + 1):
        for e in engines:
            t = time.perf_counter()
            e.prefill(prompt)
            p = n_prompt / (time.perf_counter() - t)
            d = n_decode / e.decode(dprompt, n_decode)
            if r:
                pre[e.name].append(p)
                dec[e.name].append(d)
            print(f"round {r}{' (warm-up)' if not r else ''}: {e.name}: pp {p:.1f} tok/s, tg {d:.1f} tok/s",
                  file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
        print(f"round {r}: load average {loads[-1]:.2f}", file=sys.stderr, flush=True)
    return {e.name: {"prefill_tok_s": statistics.median(pre[e.name]), "decode_tok_s": statistics.median(dec[e.name]),
                     "prefill_runs_tok_s": [round(x, 1) for x in pre[e.name]],
                     "decode_runs_tok_s": [round(x, 1) for x in dec[e.name]]} for e in engines} | \
        {"loadavg": [round(x, 2) for x in loads]}


def accuracy(path: str, tokens: int = 512, chunk: int = 128) -> dict:
    """Integer activations against the exact path over the eval text, token by token from an empty
    cache per chunk of `chunk` tokens (every position through the decode GEMV): top-1 agreement and
    mean KLD(exact || int8) of the next-token distributions (ingot.eval.compare)."""
    import numpy as np
    import ingot.llm
    from ingot.eval import Scored, compare, log_softmax
    from ingot.options import CompileOptions, CpuOptions

    scored = []
    ids = None
    for activations in ("float32", "int8"):
        llm = ingot.llm.load(path, context=chunk + 16, options=CompileOptions(cpu=CpuOptions(gemv_activations=activations)))
        if ids is None:
            with open(os.path.join(ROOT, "tests/fixtures/eval_text.txt"), encoding="utf-8") as f:
                ids = llm.tokenizer.encode(f.read(), add_special=False)[:tokens]
        logprobs, targets = [], []
        for c0 in range(0, len(ids) - chunk + 1, chunk):
            part = ids[c0:c0 + chunk]
            llm.reset()
            rows = [llm.step(t) for t in part[:-1]]
            logprobs.append(log_softmax(np.stack(rows)))
            targets.append(np.asarray(part[1:], np.int64))
        scored.append(Scored(np.concatenate(logprobs), np.concatenate(targets)))
        del llm
    r = compare(*scored)
    return {"tokens": r.tokens, "top1": r.top1, "mean_kld": r.mean_kld, "kld_p99": r.kld_p99,
            "ppl_exact": r.ppl_reference, "ppl_int8": r.ppl_model}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="thread counts for every engine, comma-separated")
    ap.add_argument("--activations", default="float32,int8", help="Ingot's GEMV activations, comma-separated")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-decode", type=int, default=128)
    ap.add_argument("--skip", default="transformers", help="comma-separated anchors to skip: llamacpp,transformers")
    ap.add_argument("--accuracy", action="store_true", help="also score int8 activations against the exact path")
    args = ap.parse_args()
    path = args.gguf or anchors.default_gguf_path()
    threads = [int(t) for t in args.threads.split(",") if t]
    skip = set(args.skip.split(","))
    context = max(args.n_prompt, 32 + args.n_decode) + 16
    engines = [IngotEngine(path, context, "float32", None)]   # the default settings first (not run twice)
    engines += [IngotEngine(path, context, a, t) for a in args.activations.split(",") for t in threads
                if (a, t) != engines[0].key]
    if "llamacpp" not in skip:
        try:
            engines.append(LlamaCppEngine(path, context, None, args.n_prompt))
            engines += [LlamaCppEngine(path, context, t, args.n_prompt) for t in threads if t != engines[-1].threads]
        except RuntimeError as e:
            print(f"llamacpp: skipped ({e})", file=sys.stderr)
    results = interleaved(engines, args.n_prompt, args.n_decode, 32, args.repeats)
    if "transformers" not in skip:
        try:
            results["transformers"] = anchors.transformers_speed(path, args.n_prompt, args.n_decode, threads=max(threads),
                                                                 repeats=args.repeats)
        except RuntimeError as e:
            print(f"transformers: skipped ({e})", file=sys.stderr)
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d"), "results": results}
    if args.accuracy:
        report["int8_activations_vs_exact"] = accuracy(path)
    print(json.dumps(report, indent=1))
    rows = {k: v for k, v in results.items() if isinstance(v, dict)}
    print(f"\n{'engine':32s} {'pp' + str(args.n_prompt) + ' tok/s':>14s} {'tg' + str(args.n_decode) + ' tok/s':>14s}")
    for name, r in rows.items():
        print(f"{name:32s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:14.1f}")
    print(f"load average (1 min) before, after each round: {results['loadavg']}")
    ours = {k: v for k, v in rows.items() if k.startswith("ingot")}
    theirs = {k: v for k, v in rows.items() if k.startswith("llama.cpp")}
    if theirs:
        for figure in ("prefill_tok_s", "decode_tok_s"):
            a, b = max(ours, key=lambda k: ours[k][figure]), max(theirs, key=lambda k: theirs[k][figure])
            da = next(k for k in ours if "default" in k)
            db = next(k for k in theirs if "default" in k)
            print(f"{figure}: best {ours[a][figure] / theirs[b][figure]:.2f}x ({a} vs {b}); "
                  f"default {ours[da][figure] / theirs[db][figure]:.2f}x ({da} vs {db})")


if __name__ == "__main__":
    main()
