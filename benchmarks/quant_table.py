"""Quantization formats on the default model: bytes, mean KLD and top-1 agreement against the float
model, decode tok/s on the CPU, in one run (the BENCHMARKS.md "Quantization" table).

The float reference is the default model's weights dequantized to float32 (all of them, the Q8_0
embedding included). Every row quantizes those float weights with `ingot.quant` (all 2-D weights,
the tied embedding included) and is scored over tests/fixtures/eval_text.txt in llama.cpp's manner
(chunks of --context tokens from an empty cache, second half of each scored; ingot.eval).
Compensation rows add low-rank factors (int8, weighted by activation statistics from
tests/fixtures/calibration_text.txt) of every layer weight's error as called adapters.
Decode tok/s: median of --steps single-token steps after a 16-token prompt, one thread for GEMV.

    python -m benchmarks quant [--rows int8,int4:32,...] [--context 256] [--steps 24] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = ["int8", "int4:32", "int4:128", "lut4", "lut4:g128", "int4:128+c8", "int4:128+c16", "int4:128+c32"]


def decode_tok_s(model, tensors, adapters, steps: int) -> float:
    from ingot.adapters import binder
    from ingot.models import llama

    cfg = model.config
    graph = llama.build(cfg, tensors, adapter_sites=adapters.names if adapters else ())
    if adapters:
        graph.callables_for = binder(cfg, adapters)
    exe = graph.compile(1)
    state = exe.new_state()
    rng = np.random.default_rng(0)
    times = []
    for pos in range(16 + steps):
        token = np.array([rng.integers(0, cfg.vocab_size)], np.int32)
        t = time.perf_counter()
        exe.run({"tokens": token, "pos": np.int32(pos), "last": np.int32(0)}, state=state)
        if pos >= 16:
            times.append(time.perf_counter() - t)
    return 1.0 / float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="FMT[+cRANK][+awq][+cal][+x], comma-separated: compensation rank, AWQ scaling, calibration-weighted "
                             "quantizer, token_embd kept (Q8_0)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--speed-only", action="store_true", help="skip the KLD scoring: bytes and decode tok/s only")
    args = parser.parse_args()

    from threadpoolctl import threadpool_limits

    from ingot.eval import chunks, compare, score
    from ingot.llm.generate import default_model_path
    from ingot.llm.package import StoredModel, open_model
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.formats import tensor_nbytes
    from ingot.quant.pipeline import activation_stats, float_weights, quantize_model

    path = default_model_path()
    source = open_model(path)
    text = (ROOT / "tests/fixtures/eval_text.txt").read_text()
    calibration = (ROOT / "tests/fixtures/calibration_text.txt").read_text()
    token_chunks = chunks(tokenize(source, text), args.context)
    t0 = time.perf_counter()
    floats = dict(float_weights(source))
    reference = StoredModel(path, source.architecture, source.metadata, floats, source.config, source.adapters)
    scored_ref = score(reference, token_chunks if not args.speed_only else [token_chunks[0][:8]])
    gguf_bytes = sum(tensor_nbytes(source.tensors[n]) for n in source.tensors)
    float_bytes = sum(w.nbytes for w in floats.values())
    del reference, floats
    print(f"reference: float32 weights {float_bytes / 1e6:.1f} MB (the GGUF's tensors in Ingot's form: {gguf_bytes / 1e6:.1f} MB); "
          f"{len(token_chunks)} chunks of {args.context} tokens, {len(scored_ref.targets)} scored; "
          f"PPL {np.exp(-scored_ref.logprobs[np.arange(len(scored_ref.targets)), scored_ref.targets].mean()):.3f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    with threadpool_limits(1):
        stats = activation_stats(source, tokenize(source, calibration), context=args.context)
    results = []
    print(f"| format | bytes (MB) | vs Q4_1 tensors | adapters (MB) | mean KLD | top-1 | PPL | decode tok/s |", flush=True)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for row in args.rows.split(","):
        fmt, *options = row.split("+")
        rank = next((int(o[1:]) for o in options if o[:1] == "c" and o[1:].isdigit()), 0)
        awq = "awq" in options
        exclude = ["token_embd.weight"] if "x" in options else []   # x: the embedding stays as the GGUF has it (Q8_0)
        t = time.perf_counter()
        with threadpool_limits(1):  # many small SVDs and k-means: BLAS threads only contend on 2 cores
            result = quantize_model(source, fmt, stats=stats if (rank or awq or "cal" in options) else None, compensate=rank, awq=awq,
                                    exclude=exclude)
        quant_s = time.perf_counter() - t
        model = StoredModel(path, source.architecture, source.metadata, result.tensors, source.config, result.adapters)
        r = compare(scored_ref, score(model, token_chunks if not args.speed_only else [token_chunks[0][:8]]))
        speed = decode_tok_s(source, result.tensors, result.adapters, args.steps)
        entry = {"row": row, "bytes": result.bytes_after, "adapter_bytes": result.adapter_bytes, "mean_kld": r.mean_kld,
                 "kld_p99": r.kld_p99, "top1": r.top1, "ppl": r.ppl_model, "ppl_reference": r.ppl_reference,
                 "decode_tok_s": speed, "quantize_s": quant_s, "notes": result.notes}
        results.append(entry)
        print(f"| {row} | {result.bytes_after / 1e6:.1f} | {result.bytes_after / gguf_bytes:.2f}x | "
              f"{result.adapter_bytes / 1e6:.1f} | {r.mean_kld:.4f} | {100 * r.top1:.1f}% | {r.ppl_model:.2f} | {speed:.1f} |",
              flush=True)
    print(f"[{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; total {time.perf_counter() - t0:.0f} s]")
    if args.json:
        Path(args.json).write_text(json.dumps({"reference_ppl": results[0]["ppl_reference"] if results else None,
                                               "gguf_bytes": gguf_bytes, "float_bytes": float_bytes, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
