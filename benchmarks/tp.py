"""Tensor-parallel decode speed: the Llama graph sharded over N ranks (ingot/passes/shard.py), each
rank a process in one torch.distributed group (gloo on the CPU, NCCL on CUDA), against the same
model in one process (TP 1, also launched as a group of one).

CPU (the default without a GPU): SmolLM2-135M's shape (30 layers, dim 576, 9/3 heads, FFN 1536,
vocabulary 49152, tied), random Q4_1-like uint4 weights, TP 1 and 2. CUDA: Llama-3-8B's shape (32
layers, dim 4096, 32/8 heads, FFN 14336, vocab 128256) and Llama-3-70B's (80 layers, dim 8192, 64/8
heads, FFN 28672), random int4 weights, TP 1 and 2/4/8 (as many GPUs as there are). 8B's ranks cut
one full set of weights (so their tokens must equal TP 1's); 70B's ranks make random weights of
their own shard only (a full 70B per process would not fit in host memory 8 times): speed only.

Each rank prefills a 16-token prompt and times greedy decode steps through exe.run + argmax (as
ingot.llm does), after a warm-up (kernels compiled, CUDA graphs captured). Printed per model and N:
decode tok/s, its ratio to TP 1, rank 0's CPU time per token (the machine may be shared: wall time
alone says little there), whether the tokens equal TP 1's, and on CUDA the bytes the ranks read per
step (weights + KV) over the step time as a fraction of the aggregate copy bandwidth (N times one
GPU's device-to-device copy, measured in the same run). Goal (issue 37): 70B int4 at TP 4 >= 60 %.

    python -m benchmarks tp [--device cpu|cuda] [--models smollm2,llama8b,llama70b] [--tp 1,2,4,8]
                            [--steps 32] [--layers N] [--json out.json]

`--models tiny` (1 layer, dim 64) checks the code path quickly, e.g. the CUDA ranks' on CPU tensors
over gloo: INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m benchmarks tp --device cuda --models tiny
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ingot.distributed import launch  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.models.tensor_parallel import build_sharded, shard_decoder  # noqa: E402
from ingot.passes.shard import local_config, plan  # noqa: E402

SHAPES = {
    "smollm2": dict(n_layers=30, dim=576, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152, tied_embeddings=True,
                    rope_base=100000.0),
    "llama8b": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                    tied_embeddings=False, rope_base=500000.0),
    "tiny": dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256),   # a check of the code path
    "llama70b": dict(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                     tied_embeddings=False, rope_base=500000.0),
}
SHARD_ONLY = {"llama70b"}    # ranks make their own shard's random weights (no token check)
PROMPT = 16


def rank_model(name: str, cfg: llama.LlamaConfig, ranks: int, rank: int):
    """Rank `rank`'s decoder: one full set of random weights cut (same seed on every rank), or for
    SHARD_ONLY shapes random weights of the shard's own shape."""
    big = name not in ("smollm2", "tiny")   # k-major random bytes: 8B parameters in seconds
    if name in SHARD_ONLY and ranks > 1:
        local = local_config(cfg, plan(cfg, ranks, rank))
        weights = llama.random_weights(local, seed=rank, k_major=True, f16_params=True)
        return shard_decoder(llama.build(local, weights), ranks, rank)
    return build_sharded(cfg, llama.random_weights(cfg, k_major=big, f16_params=True), ranks, rank, builder=llama.build)


def _rank(rank: int, ranks: int, name: str, shape: dict, device: str, steps: int, out: str) -> None:
    import torch.distributed as dist
    from dataclasses import replace

    from ingot.options import CompileOptions

    cfg = llama.LlamaConfig(**shape, context_length=PROMPT + 2 * steps + 16)
    options = CompileOptions.from_environment()
    if device == "cpu" and options.cpu.threads is None:
        options = replace(options, cpu=replace(options.cpu, threads=max(1, len(os.sched_getaffinity(0)) // ranks)))
    model = rank_model(name, cfg, ranks, rank)
    decode, prefill = model.compile(1, device, options), model.compile(PROMPT, device, options)
    state = decode.new_state()
    host = decode.backend.to_host
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, PROMPT).astype(np.int32)

    def generate(n: int):
        logits = host(prefill.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(PROMPT - 1)}, state=state)[0])
        tokens = []
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(n):
            tokens.append(int(np.argmax(logits[0])))
            logits = host(decode.run({"tokens": np.array(tokens[-1:], np.int32), "pos": np.int32(PROMPT + i),
                                      "last": np.int32(0)}, state=state)[0])
        return tokens, n / (time.perf_counter() - wall), (time.process_time() - cpu) / n

    generate(3)                                            # kernels compiled, graphs captured
    tokens, tok_s, cpu_per_token = generate(steps)
    result = dict(rank=rank, tokens=tokens, tok_s=tok_s, cpu_ms_per_token=cpu_per_token * 1e3)
    if device == "cuda":
        from ingot.backends.cuda.traffic import weight_bytes
        kv = 2 * cfg.n_layers * model.config.n_kv_heads * (PROMPT + steps // 2) * cfg.head_dim * 4
        result["bytes_per_step"] = weight_bytes(decode) + kv
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """One GPU's device-to-device copy bandwidth (bytes/s, read + write)."""
    import torch
    import triton.testing

    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    a = b = None   # (the memory back before the ranks start)
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def run(name: str, shape: dict, ranks: int, device: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        started = time.perf_counter()
        launch(_rank, ranks, name, shape, device, steps, out, device=device)
        results = [json.load(open(f"{out}.{r}")) for r in range(ranks)]
    head = results[0]
    return dict(model=name, tp=ranks, layers=shape["n_layers"], steps=steps, tok_s=round(head["tok_s"], 2),
                cpu_ms_per_token=round(head["cpu_ms_per_token"], 2), tokens=head["tokens"],
                ranks_agree=all(r["tokens"] == head["tokens"] for r in results),
                bytes_per_step=sum(r.get("bytes_per_step", 0) for r in results) or None,
                seconds=round(time.perf_counter() - started, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when a GPU is there")
    p.add_argument("--models", default=None, help="comma-separated (default: smollm2 on cpu, llama8b,llama70b on cuda)")
    p.add_argument("--tp", default=None, help="rank counts (default: 1,2 on cpu; 1,2,4,8 up to the GPUs on cuda)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (quick runs)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    gpus = 0
    try:
        import torch
        gpus = torch.cuda.device_count()
    except ImportError:
        pass
    device = args.device or ("cuda" if gpus else "cpu")
    models = (args.models or ("llama8b,llama70b" if device == "cuda" else "smollm2")).split(",")
    counts = [int(n) for n in (args.tp or ("1,2,4,8" if device == "cuda" else "1,2")).split(",")]
    emulated = os.environ.get("INGOT_CUDA_DEVICE") == "cpu"   # the CUDA code on CPU tensors, gloo (a check, not a timing)
    if device == "cuda" and not gpus and not emulated:
        print("python -m benchmarks tp: --device cuda needs NVIDIA GPUs; torch sees none.", file=sys.stderr)
        return 2
    if device == "cuda" and not emulated:
        counts = [n for n in counts if n <= gpus]
    bandwidth = copy_bandwidth() if device == "cuda" and not emulated else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    copy = f", copy {bandwidth / 1e12:.2f} TB/s per GPU" if bandwidth else ""
    print(f"tp: {device}, load average {load:.1f} at start{copy}", flush=True)
    rows = []
    for name in models:
        shape = dict(SHAPES[name], **({"n_layers": args.layers} if args.layers else {}))
        base = None
        for n in counts:
            row = run(name, shape, n, device, args.steps)
            base = base or (row if n == 1 else None)
            row["vs_tp1"] = round(row["tok_s"] / base["tok_s"], 2) if base else None
            row["same_tokens_as_tp1"] = None if base is None or name in SHARD_ONLY else row["tokens"] == base["tokens"]
            if bandwidth and row["bytes_per_step"]:
                row["of_aggregate_copy"] = round(row["bytes_per_step"] * row["tok_s"] / (n * bandwidth), 3)
            rows.append(row)
            copy = f", {row['of_aggregate_copy']:.0%} of aggregate copy" if "of_aggregate_copy" in row else ""
            print(f"{name} ({shape['n_layers']} layers) TP {n}: {row['tok_s']:.1f} tok/s (x{row['vs_tp1']} vs TP 1), "
                  f"rank 0 CPU {row['cpu_ms_per_token']:.1f} ms/token, ranks agree {row['ranks_agree']}, tokens = TP 1: "
                  f"{row['same_tokens_as_tp1']}{copy}; {row['seconds']:.0f} s", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else "", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
