"""CUDA decode speed: the Llama graph on Ingot's CUDA backend, random weights of real shapes.

SmolLM2-135M shape (30 layers, dim 576, 9/3 heads, FFN 1536, vocab 49152, tied embeddings),
Llama-3-8B shape (32 layers, dim 4096, 32/8 heads, FFN 14336, vocab 128256) and, through the Gemma
family's graph, Gemma-3-270M shape (`gemma3-270m`: 18 layers, dim 640, 4/1 heads of 256, FFN 2048,
vocab 262144, tied, QK-norm, 5 of 6 layers in a 512 sliding window; issue 33's CUDA decode figure, its
CPU one against llama.cpp on the real file being `cpu-llm --gguf` that file). --dtype int4: int4
weights in blocks of 32 with f16-exact scale and bias (what a GGUF Q4_1 file holds); bf16: dense
bfloat16 weights (random_weights(dense_dtype="bfloat16")); float32 activations either way, the KV cache
float32 unless --kv-dtype says otherwise (comma-separated, each timed; bfloat16 halves its bytes, int8
quarters them: codes and a float32 scale per row).
--batch B: B sequences decoded in lockstep (llama.build(batch=B), one shared position).
Prefill a 32-token prompt per sequence, then time greedy decode steps through the same loop as
ingot.llm (exe.run, logits to the host, argmax per sequence). Prints tok/s (total tokens: B * steps/s)
and per-sequence tok/s, the GPU time of one replayed step, bytes read per step (weights + the KV cache
of all B sequences), and achieved bandwidth per step as a fraction of the device-to-device copy
bandwidth measured in the same run. --anchors also times benchmarks/cuda_anchors.py's
anchor_decode (HF eager bf16, torch.compile bf16 and int4) for each model and batch, and prints
Ingot/anchor ratios.

    python -m benchmarks cuda-llm [--models smollm2,llama8b,gemma3-270m] [--llama-layers 32] [--steps 128]
                                  [--batch 1,4,16] [--dtype int4,bf16] [--kv-dtype float32,bfloat16,int8]
                                  [--prompt 32] [--context 2048] [--anchors] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ingot.backends.cuda.traffic import free_device, weight_bytes  # noqa: E402
from ingot.models import gemma, llama  # noqa: E402

SHAPES = {
    "smollm2": dict(n_layers=30, dim=576, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152, tied_embeddings=True,
                    rope_base=100000.0),
    "llama8b": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                    tied_embeddings=False, rope_base=500000.0),
    "gemma3-270m": dict(n_layers=18, dim=640, n_heads=4, n_kv_heads=1, ffn_dim=2048, vocab_size=262144, head_dim=256,
                        tied_embeddings=True, rope_base=1e6, rope_base_local=1e4, qk_norm=True, sliding_window=512,
                        sliding_pattern=6),
}
FAMILIES = {"gemma3-270m": gemma}   # the models/ module that builds each shape (default: llama)


def family(name: str):
    return FAMILIES.get(name, llama)


def fast_random_weights(cfg: llama.LlamaConfig, seed: int = 0, block: int = 32) -> dict:
    """Random uint4 weights made directly in the k-major form the graph builder uses, with f16-exact
    parameters; 8B parameters in seconds instead of minutes of host repacking."""
    return llama.random_weights(cfg, seed=seed, block_size=block, k_major=True, f16_params=True)


def gguf_like_random_weights(cfg: llama.LlamaConfig) -> dict:
    """Random weights in GGUF's row-major form (converted by the builder as a GGUF file is), scale
    rounded to f16 as a Q4_1 file stores it."""
    return llama.random_weights(cfg, f16_params=True)


ANCHOR_KINDS = ("hf_eager_bf16", "compile_bf16", "compile_int4")


def bf16_random_weights(cfg: llama.LlamaConfig) -> dict | None:
    """Dense bfloat16 random weights, or None where random_weights cannot make them yet."""
    if "dense_dtype" not in inspect.signature(llama.random_weights).parameters:
        return None
    return llama.random_weights(cfg, dense_dtype="bfloat16")


def model_weights(name: str, cfg: llama.LlamaConfig, dtype: str) -> dict | None:
    if name in FAMILIES:   # random_weights of its family (norms and all), uint4 made k-major as fast_random_weights
        kw = dict(dense_dtype="bfloat16") if dtype == "bf16" else dict(block_size=32, k_major=True, f16_params=True)
        return FAMILIES[name].random_weights(cfg, **kw)
    if dtype == "bf16":
        return bf16_random_weights(cfg)
    return gguf_like_random_weights(cfg) if name == "smollm2" else fast_random_weights(cfg)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    import triton.testing
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    del a, b
    return 2 * nbytes / (ms * 1e-3)


def graph_replay_us(graph, replays: int = 50, warmup: int = 1) -> float:
    """Microseconds one replay of a captured CUDA graph takes, replayed back to back (after `warmup`)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def model_shape(name: str, layers: int | None) -> dict:
    shape = dict(SHAPES[name])
    if layers:
        shape["n_layers"] = layers
    return shape


def run_model(name: str, cfg: llama.LlamaConfig, weights: dict, dtype: str, batch: int, steps: int, prompt_len: int,
              bw: float) -> dict:
    free_device()
    t0 = time.perf_counter()
    model = family(name).build(cfg, weights, batch=batch)
    dec = model.compile(1, "cuda")
    pre = model.compile(prompt_len, "cuda")
    build_s = time.perf_counter() - t0
    state = dec.new_state()
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, batch * prompt_len).astype(np.int32)  # [B * P]
    host = dec.backend.to_host

    def generate(n):
        logits = host(pre.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(prompt_len - 1)}, state=state)[0])
        tokens = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            tokens.append(np.argmax(logits, axis=-1).astype(np.int32))   # [B]: one token per sequence
            logits = host(dec.run({"tokens": tokens[-1], "pos": np.int32(prompt_len + i), "last": np.int32(0)},
                                  state=state)[0])
        seconds = time.perf_counter() - t0
        return [step.tolist() for step in tokens], n / seconds

    generate(4)                                     # compile every kernel, capture the graph
    generate(2)
    tokens, steps_s = generate(steps)
    tokens2, steps_s2 = generate(steps)
    # GPU time of one step: replay the captured graph back to back
    entry = next(iter(dec.plan._graphs.values()), None)
    replay_us = None if entry is None else graph_replay_us(entry["graph"])
    # bytes one step reads: every weight once, and the K and V caches of all B sequences (mean length)
    kv_item = {"float32": 4, "int8": 1 + 4 / cfg.head_dim}.get(cfg.kv_dtype, 2)   # (int8: a float32 scale a row)
    kv_read = int(2 * cfg.n_layers * cfg.n_kv_heads * (prompt_len + steps // 2) * cfg.head_dim * kv_item * batch)
    weights_read = weight_bytes(dec)
    nbytes = weights_read + kv_read
    # per-kernel breakdown of one eager step (the profiler cannot see inside a graph replay)
    breakdown = {}
    try:
        feeds = {"tokens": torch.ones(batch, dtype=torch.int32, device="cuda"),
                 "pos": torch.tensor(prompt_len, dtype=torch.int32, device="cuda"),
                 "last": torch.tensor(0, dtype=torch.int32, device="cuda")}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.plan._execute(feeds, state.values)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0):
                breakdown[ev.key[:60]] = dict(count=ev.count, us=round(getattr(ev, "device_time_total", 0.0), 1))
    except Exception as e:  # the breakdown is a diagnostic, not a result
        breakdown = {"error": str(e)[:200]}
    kernels = sum(v["count"] for v in breakdown.values() if isinstance(v, dict))
    best = max(steps_s, steps_s2)                   # decode steps per second (each step: B tokens)
    replay_steps = None if replay_us is None else 1e6 / replay_us
    result = dict(model=name, dtype=dtype, kv_dtype=cfg.kv_dtype, batch=batch, layers=cfg.n_layers,
                  context=cfg.context_length,
                  build_s=round(build_s, 1), prompt=prompt_len, steps=steps,
                  tok_s=round(best * batch, 1), tok_s_per_seq=round(best, 1),
                  tok_s_runs=[round(steps_s * batch, 1), round(steps_s2 * batch, 1)],
                  replay_us=None if replay_us is None else round(replay_us, 1),
                  replay_tok_s=None if replay_us is None else round(replay_steps * batch, 1),
                  bytes_per_step=nbytes, bytes_per_token=nbytes // batch, weight_bytes=weights_read, kv_bytes=kv_read,
                  bandwidth_tb_s=round(nbytes * best / 1e12, 3), of_copy=round(nbytes * best / bw, 3),
                  replay_of_copy=None if replay_us is None else round(nbytes * replay_steps / bw, 3),
                  kernels_per_step=kernels, same_tokens_twice=tokens == tokens2, capturable=dec.plan.capturable,
                  host_syncs=sorted(set(map(str, dec.plan.host_syncs)))[:10],
                  fusions=sorted(set(dec.plan.fusions)),
                  breakdown=dict(sorted(breakdown.items(), key=lambda kv: -kv[1]["us"] if isinstance(kv[1], dict) else 0)[:25]))
    print(f"{name} {dtype} KV {cfg.kv_dtype} prompt {prompt_len} batch {batch} ({cfg.n_layers} layers): "
          f"{best * batch:.1f} tok/s ({best:.1f} per sequence) through "
          f"exe.run + argmax; graph replay {result['replay_us']} us/step ({result['replay_tok_s']} tok/s); "
          f"{nbytes / 1e6:.1f} MB/step -> {result['of_copy']:.2f} of copy bandwidth (replay {result['replay_of_copy']}); "
          f"{kernels} kernels/step; build {build_s:.0f} s"
          + (f"; host syncs: {result['host_syncs']}" if result["host_syncs"] else ""), flush=True)
    del dec, pre, model, state
    return result


def load_anchor():
    """benchmarks/cuda_anchors.py's anchor_decode, or None (with a line saying why) when it is missing."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from cuda_anchors import anchor_decode
    except Exception as e:  # a missing file, or one that does not import: report and go on
        print(f"anchors: not available (benchmarks/cuda_anchors.py: {type(e).__name__}: {e})", flush=True)
        return None
    return anchor_decode


def run_anchors(anchor_decode, name: str, shape: dict, batch: int, args, ingot: list[dict]) -> list[dict]:
    """Each anchor kind at this model and batch, and the ratio of each Ingot run (per dtype) to it."""
    free_device()
    out = []
    for kind in args.anchor_kinds.split(","):
        try:
            a = anchor_decode(dict(shape), batch, kind, args.steps, args.prompt, args.context)
            tok_s = float(a["tok_s"])
        except Exception as e:
            print(f"anchor {kind} {name} batch {batch}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
            out.append(dict(kind="anchor", anchor=kind, model=name, batch=batch, error=f"{type(e).__name__}: {e}"[:500]))
            torch.cuda.empty_cache()
            continue
        ratios = {r["dtype"] + ("" if r.get("kv_dtype", "float32") == "float32" else f"/kv {r['kv_dtype']}"):
                  round(r["tok_s"] / tok_s, 3) for r in ingot if "tok_s" in r and tok_s > 0}
        print(f"anchor {kind} {name} batch {batch}: {tok_s:.1f} tok/s; Ingot/anchor "
              + (", ".join(f"{d} {v:.2f}x" for d, v in ratios.items()) or "(no Ingot run)"), flush=True)
        out.append(dict(a, kind="anchor", anchor=kind, model=name, batch=batch, tok_s=tok_s, ingot_over_anchor=ratios))
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama8b")
    ap.add_argument("--llama-layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,4,16")
    ap.add_argument("--dtype", default="int4", help="comma-separated weight kinds: int4, bf16")
    ap.add_argument("--kv-dtype", default="float32", help="comma-separated KV cache dtypes: float32, bfloat16, float16, int8")
    ap.add_argument("--anchors", action="store_true", help="also time benchmarks/cuda_anchors.py's anchor_decode")
    ap.add_argument("--anchor-kinds", default=",".join(ANCHOR_KINDS))
    ap.add_argument("--anchor-batches", default=None, help="batch sizes the anchors run at (default: every --batch)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    dtypes = args.dtype.split(",")
    kv_dtypes = args.kv_dtype.split(",")
    if any(b < 1 for b in batches) or any(d not in ("int4", "bf16") for d in dtypes) or \
            any(k not in ("float32", "bfloat16", "float16", "int8") for k in kv_dtypes):
        ap.error("--batch takes whole numbers >= 1; --dtype takes int4 and/or bf16; --kv-dtype float32, bfloat16, "
                 "float16, int8")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    results = [dict(kind="anchors", copy_tb_s=round(bw / 1e12, 3), device=torch.cuda.get_device_name(),
                    torch=torch.__version__)]
    anchor_decode = load_anchor() if args.anchors else None
    if args.anchors and anchor_decode is None:
        results.append(dict(kind="anchor", error="benchmarks/cuda_anchors.py (anchor_decode) is missing"))

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    for name in args.models.split(","):
        shape = model_shape(name, args.llama_layers if name == "llama8b" else None)
        cfg = family(name).Config(context_length=args.context, **shape)
        ingot_runs: dict[int, list[dict]] = {b: [] for b in batches}
        for dtype in dtypes:
            try:
                weights = model_weights(name, cfg, dtype)
            except Exception as e:
                import traceback
                traceback.print_exc()
                results.append(dict(model=name, dtype=dtype, error=f"{type(e).__name__}: {e}"))
                save()
                continue
            if weights is None:
                print(f"{dtype}: not available (random_weights has no dense_dtype)", flush=True)
                results.append(dict(model=name, dtype=dtype, error="not available (random_weights has no dense_dtype)"))
                continue
            for batch in batches:
                for kv_dtype in kv_dtypes:
                    try:
                        r = run_model(name, dataclasses.replace(cfg, kv_dtype=kv_dtype), weights, dtype, batch, args.steps,
                                      args.prompt, bw)
                        ingot_runs[batch].append(r)
                        results.append(r)
                    except Exception as e:
                        import traceback
                        traceback.print_exc()
                        results.append(dict(model=name, dtype=dtype, kv_dtype=kv_dtype, batch=batch,
                                            error=f"{type(e).__name__}: {e}"))
                    save()
            del weights
            free_device()
        if anchor_decode is not None and name in FAMILIES:
            print(f"anchors: none for {name} (cuda_anchors.py builds Llama shapes)", flush=True)
        elif anchor_decode is not None:
            for batch in batches:
                if args.anchor_batches and str(batch) not in args.anchor_batches.split(","):
                    continue
                results.extend(run_anchors(anchor_decode, name, shape, batch, args, ingot_runs[batch]))
                save()
    save()


if __name__ == "__main__":
    main()
