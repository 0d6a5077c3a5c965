"""CUDA prefill: time to first token on the Llama-3-8B shape against a bf16 PyTorch forward pass.

Random int4 weights (blocks of 32, f16-exact scale and bias) on Ingot's CUDA backend, prefill in
chunks of --chunk tokens (each chunk one replay of the prefill executable, attending to the chunks
before it in the cache), then a few greedy decode steps after the prompt. The anchor is
benchmarks/cuda_anchors.py's gpt-fast-style decoder in bf16: one eager forward pass over the whole
prompt (cuBLAS GEMMs, SDPA with a mask over the static bf16 cache). Both in one process, each
prompt length timed after a warm-up pass; Ingot once per `--precisions` (CudaOptions.prefill_precision:
tf32x3, float32-level dots; bf16 / f16, GEMM and attention operands rounded to bfloat16 / float16).

--gemm prints the prefill GEMM alone per Llama-3-8B shape and row count: Ingot's int4 kernel (float32
x with each precision; bf16 x) against cuBLAS bf16 (torch.mm) of the same shape, in TFLOP/s.
--attention prints the flash prefill attention (a chunk of queries against a cache) likewise
against torch SDPA in bf16.

    python -m benchmarks cuda-prefill [--prompts 512,2048,8192,32768] [--chunk 512]
                                      [--precisions tf32x3,bf16,f16] [--kv-dtypes float32,bfloat16,int8]
                                      [--gemm] [--attention] [--dequant] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.cuda_llm import SHAPES, fast_random_weights  # noqa: E402
from ingot.backends.cuda.traffic import free_device  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402

GEMM_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)}


def _bench(fn) -> float:
    """Median seconds of fn (triton.testing.do_bench: warm-up, L2 cleared between calls)."""
    import triton.testing
    return triton.testing.do_bench(fn, return_mode="median") * 1e-3


def gemm_table(rows: list[int], configs: dict[str, dict]) -> list[dict]:
    from ingot import dtypes as dt
    from ingot.backends.cuda import quantized_matmul as qmm
    from ingot.backends.cuda.quantized_matmul.weights import dequantize
    out = []
    rng = np.random.default_rng(0)
    for name, (k, n) in GEMM_SHAPES.items():
        q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
        scale = (rng.random((k // 32, n), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
        bias = (rng.random((k // 32, n), dtype=np.float32) * -0.01).astype(np.float16).astype(np.float32)
        attrs = {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False}
        weights = {layout: qmm.prepare_weight(q, [scale, bias], attrs, "cuda", words=layout == "words")
                   for layout in ("words", "bytes")}
        dense = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x32 = torch.randn(m, k, device="cuda")
            x16 = x32.to(torch.bfloat16)
            flop = 2.0 * m * n * k
            row = dict(shape=name, m=m, k=k, n=n)
            row["cublas_bf16"] = flop / _bench(lambda: torch.mm(x16, dense)) / 1e12
            ref = torch.mm(x32.double(), dequantize(weights["bytes"]).double()).float()
            for label, c in configs.items():
                w = weights[c.get("layout", "words")]
                x = x16 if c.get("x") == "bf16" else x32
                cfg = dict(c.get("config", {}))
                options = CudaOptions(prefill_dequant_rows=c.get("dequant_rows", 0))
                try:
                    y = qmm.quantized_matmul(x, w, precision=c.get("precision"), config=cfg or None, options=options)
                    row[label + "_err"] = float((y.float() - ref).norm() / ref.norm())
                    row[label] = flop / _bench(lambda: qmm.quantized_matmul(
                        x, w, precision=c.get("precision"), config=cfg or None, options=options)) / 1e12
                except Exception as e:  # a config that does not compile here is reported, not fatal
                    row[label] = f"{type(e).__name__}"
            out.append(row)
            cells = "  ".join(f"{k2} {v:.1f}" if isinstance(v, float) and not k2.endswith("_err") else
                              f"{k2} {v:.1e}" if isinstance(v, float) else f"{k2} {v}"
                              for k2, v in row.items() if k2 not in ("shape", "m", "k", "n"))
            print(f"gemm {name} m={m}: TFLOP/s {cells}", flush=True)
    return out


def dequant_table() -> list[dict]:
    """The cuBLAS path's two parts on the gate+up shape: W dequantized to bf16 (tile variants, against a
    device copy of as many bytes) and torch.mm with float32 out against bf16 out."""
    from ingot import dtypes as dt
    from ingot.backends.cuda import quantized_matmul as qmm
    k, n = GEMM_SHAPES["gate+up"]
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = rng.random((k // 32, n), dtype=np.float32).astype(np.float16).astype(np.float32)
    attrs = {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False}
    out = []
    src = torch.empty(k * n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_us = _bench(lambda: dst.copy_(src)) * 1e6
    print(f"dequant gate+up: a bf16 copy of W's size {copy_us:.1f} us", flush=True)
    for layout in ("words", "bytes"):
        w = qmm.prepare_weight(q, [scale, -scale], attrs, "cuda", words=layout == "words")
        for bk, bn, warps in ((32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 256, 4)):
            try:
                us = _bench(lambda: qmm.dispatch.dequantize_into(w, torch.bfloat16, bk, bn, warps)) * 1e6
            except Exception as e:
                print(f"dequant {layout} {bk}x{bn} w{warps}: {type(e).__name__}")
                continue
            out.append(dict(layout=layout, block_k=bk, block_n=bn, warps=warps, us=us))
            print(f"dequant {layout} {bk}x{bn} w{warps}: {us:.1f} us ({copy_us / us:.2f} of the copy's speed)", flush=True)
    wd = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for m in (512, 2048, 8192):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t16 = _bench(lambda: torch.mm(a, wd)) * 1e6
        t32 = _bench(lambda: torch.mm(a, wd, out_dtype=torch.float32)) * 1e6
        print(f"mm gate+up m={m}: bf16 out {t16:.1f} us, float32 out {t32:.1f} us", flush=True)
        out.append(dict(m=m, mm_bf16_out_us=t16, mm_f32_out_us=t32))
    return out


def attention_table(chunk: int, caches: list[int]) -> list[dict]:
    from ingot.backends.cuda import attention as att
    out = []
    hq, hk, d = 32, 8, 128
    for length in caches:
        q32 = torch.randn(1, hq, chunk, d, device="cuda")
        k32 = torch.randn(1, hk, length, d, device="cuda")
        v32 = torch.randn(1, hk, length, d, device="cuda")
        q16, k16, v16 = q32.bfloat16(), k32.bfloat16(), v32.bfloat16()
        flop = 4.0 * hq * chunk * d * (length - chunk / 2)     # causal: the chunk's rows see length - chunk + i keys
        ref = att.attention(q32, k32, v32, causal=True, precision="ieee") if length <= 8192 else None
        row = dict(chunk=chunk, cache=length)
        variants = {"f32_tf32x3": (q32, k32, v32, "tf32x3", {}), "f32_bf16": (q32, k32, v32, "bf16", {}),
                    "f32_bf16_m128w8": (q32, k32, v32, "bf16", dict(block_m=128, block_n=64, num_warps=8)),
                    "f32_bf16_m128n32": (q32, k32, v32, "bf16", dict(block_m=128, block_n=32, num_warps=8)),
                    "f32_bf16_s3": (q32, k32, v32, "bf16", dict(num_stages=3)),
                    "f32q_bf16kv": (q32, k16, v16, "bf16", {}),
                    "bf16": (q16, k16, v16, None, {})}
        for label, (q, k, v, prec, kw) in variants.items():
            try:
                y = att.attention(q, k, v, causal=True, precision=prec, **kw)
                if ref is not None:
                    row[label + "_err"] = float((y.float() - ref).norm() / ref.norm())
                row[label] = flop / _bench(lambda: att.attention(q, k, v, causal=True, precision=prec, **kw)) / 1e12
            except Exception as e:  # a tile that does not fit here is reported, not fatal
                print(f"attention {label}: {type(e).__name__}: {str(e)[:100]}")
        g = hq // hk
        mask = torch.arange(length, device="cuda")[None, :] <= (length - chunk + torch.arange(chunk, device="cuda"))[:, None]
        qg = q16.reshape(1, hk, g * chunk, d)
        row["torch_sdpa_bf16_mask"] = flop / _bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            qg, k16, v16, attn_mask=mask.repeat(g, 1))) / 1e12
        out.append(row)
        print("attention chunk {} cache {}: TFLOP/s ".format(chunk, length) + "  ".join(
            f"{k2} {v:.2e}" if k2.endswith("_err") else f"{k2} {v:.1f}" for k2, v in row.items()
            if k2 not in ("chunk", "cache")), flush=True)
    return out


def ingot_prefill(prompts: list[int], chunk: int, precision: str, decode_steps: int,
                  kv_dtype: str = "float32", decode_precision: str = "tf32x3p") -> list[dict]:
    context = max(prompts) + decode_steps + chunk
    shape = dict(SHAPES["llama8b"])
    cfg = llama.LlamaConfig(**shape, context_length=context, kv_dtype=kv_dtype)
    free_device()
    model = llama.build(cfg, fast_random_weights(cfg))
    options = CompileOptions(cuda=CudaOptions.for_device(torch.cuda.get_device_name(), prefill_precision=precision,
                                                           decode_precision=decode_precision))
    pre = model.compile(chunk, "cuda", options=options)
    dec = model.compile(1, "cuda", options=options)
    state = dec.new_state()
    host = dec.backend.to_host
    rng = np.random.default_rng(1)
    for i in range(3):        # the decode executable compiled and its graph captured before any timing
        dec.run({"tokens": np.zeros(1, np.int32), "pos": np.int32(i), "last": np.int32(0)}, state=state)
    rows = []
    for n in prompts:
        ids = rng.integers(0, cfg.vocab_size, n).astype(np.int32)

        def prefill() -> np.ndarray:
            logits = None
            for start in range(0, n, chunk):
                part = ids[start:start + chunk]
                padded = np.zeros(chunk, np.int32)
                padded[:len(part)] = part
                logits = pre.run({"tokens": padded, "pos": np.int32(start), "last": np.int32(len(part) - 1)},
                                 state=state)[0]
            return host(logits)

        prefill()                       # compiles, then captures the chunk's graph
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = prefill()
        ttft = time.perf_counter() - t0
        token = np.argmax(logits, axis=-1).astype(np.int32).reshape(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(decode_steps):
            logits = host(dec.run({"tokens": token, "pos": np.int32(n + i), "last": np.int32(0)}, state=state)[0])
            token = np.argmax(logits, axis=-1).astype(np.int32).reshape(1)
        decode = decode_steps / (time.perf_counter() - t0)
        rows.append(dict(engine=f"ingot_int4_{precision}_kv{kv_dtype}_chunk{chunk}_dec{decode_precision}", prompt=n, chunk=chunk, ttft_s=ttft, prefill_tok_s=n / ttft,
                         decode_tok_s=decode))
        print(f"ingot int4 {precision:6s} KV {kv_dtype:8s} decode {decode_precision:7s} chunk {chunk:5d} prompt {n:6d}: ttft {ttft:.3f} s, prefill {n / ttft:9.0f} tok/s, "
              f"decode after it {decode:.0f} tok/s", flush=True)
    return rows


def anchor_prefill(prompts: list[int], decode_steps: int) -> list[dict]:
    from benchmarks.cuda_anchors import Decoder, Shape, decode_one
    s = Shape.of(SHAPES["llama8b"])
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n in prompts:
            # a static cache of this prompt's own length: its masked SDPA reads the whole cache, so one
            # cache of the longest prompt would slow the short prompts' anchor (gpt-fast sizes it per run)
            model = None
            free_device()
            model = Decoder(s, 1, n + decode_steps, int4=False, device=torch.device("cuda")).eval()
            ids = torch.randint(0, s.vocab_size, (1, n), device="cuda", generator=gen)
            pos = torch.arange(n, device="cuda")
            try:
                model(ids, pos).argmax(-1)      # warm-up
            except torch.cuda.OutOfMemoryError:
                print(f"torch bf16 (eager)  prompt {n:6d}: out of memory (its masked SDPA)", flush=True)
                torch.cuda.empty_cache()
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            token = model(ids, pos).argmax(-1, keepdim=True).cpu()
            ttft = time.perf_counter() - t0
            token = token.cuda()
            input_pos = torch.tensor([n], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                token = decode_one(model, token, input_pos)
                input_pos += 1
                token.cpu()
            decode = decode_steps / (time.perf_counter() - t0)
            rows.append(dict(engine="torch_bf16", prompt=n, ttft_s=ttft, prefill_tok_s=n / ttft, decode_tok_s=decode))
            print(f"torch bf16 (eager)  prompt {n:6d}: ttft {ttft:.3f} s, prefill {n / ttft:9.0f} tok/s, "
                  f"decode after it {decode:.0f} tok/s (eager)", flush=True)
            del model
    free_device()
    return rows


def decode_ratios(rows: list[dict]) -> None:
    """Issue 38's decode goal per engine (KV dtype, precision): decode tok/s after the longest prompt over
    decode tok/s after the shortest (goal >= 0.9 at 8k against 512)."""
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["prompt"])
        if len(mine) > 1 and mine[0]["decode_tok_s"] > 0:
            print(f"decode ratio {engine}: {mine[-1]['decode_tok_s'] / mine[0]['decode_tok_s']:.2f} "
                  f"(after {mine[-1]['prompt']} tokens against {mine[0]['prompt']})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks cuda-prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="512,2048,8192,32768")
    ap.add_argument("--chunk", default="512", help="prefill chunk sizes, comma-separated (each timed)")
    ap.add_argument("--precisions", default="tf32x3,bf16,f16")
    ap.add_argument("--kv-dtypes", default="float32", help="KV cache dtypes, comma-separated (float32, bfloat16, int8)")
    ap.add_argument("--decode-precisions", default="tf32x3p",
                    help="CudaOptions.decode_precision values, comma-separated (tf32x3p; bf16: one bfloat16 product)")
    ap.add_argument("--max-tf32x3-prompt", type=int, default=8192, help="longer prompts only with bf16 (time)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--gemm-rows", default="16,128,512,2048,8192")
    ap.add_argument("--gemm-tiles", default="",
                    help="more tensor-core kernel tiles: 'BM,BN,BK,warps,stages[,split[,precision]];...' (split 0: the default)")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--dequant", action="store_true", help="the cuBLAS path's dequantization and GEMM parts")
    ap.add_argument("--no-e2e", action="store_true", help="only the kernel tables")
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--max-anchor-prompt", type=int, default=32768,
                    help="longer prompts without the anchor (its masked SDPA materialises T x context scores)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda-prefill: no CUDA device here.")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    result = {}
    if args.gemm:
        configs = {"kernel_tf32x3": dict(precision="tf32x3"), "kernel_bf16": dict(precision="bf16"),
                   "kernel_f16": dict(precision="f16"),
                   "dequant_cublas_f32": dict(precision="tf32x3", dequant_rows=1),
                   "dequant_cublas_bf16": dict(precision="bf16", dequant_rows=1),
                   "dequant_cublas_f16": dict(precision="f16", dequant_rows=1),
                   "dequant_cublas_bf16_bytes": dict(precision="bf16", dequant_rows=1, layout="bytes")}
        for tiles in filter(None, args.gemm_tiles.split(";")):   # the tensor-core kernel at other tiles
            # BM,BN,BK,warps,stages[,split[,precision]]: split 0 (or none) = gemm_config's K split
            bm, bn, bk, warps, stages, *rest = tiles.split(",")
            split = int(rest[0]) if rest and int(rest[0]) else None
            prec = rest[1] if len(rest) > 1 else "bf16"
            config = dict(BLOCK_M=int(bm), BLOCK_N=int(bn), BLOCK_K=int(bk), num_warps=int(warps), num_stages=int(stages))
            if split:
                config["SPLIT_K"] = split
            configs[f"kernel_{prec}_{bm}x{bn}x{bk}w{warps}s{stages}" + (f"k{split}" if split else "")] = dict(
                precision=prec, config=config)
        result["gemm"] = gemm_table([int(r) for r in args.gemm_rows.split(",")], configs)
    if args.dequant:
        result["dequant"] = dequant_table()
    if args.attention:
        chunk = int(args.chunk.split(",")[0])
        result["attention"] = attention_table(chunk, [chunk, 2048, 8192])
    if not args.no_e2e:
        prompts = [int(p) for p in args.prompts.split(",")]
        rows = []
        for precision in args.precisions.split(","):
            todo = [p for p in prompts if precision != "tf32x3" or p <= args.max_tf32x3_prompt]
            for chunk in args.chunk.split(","):
                for kv in args.kv_dtypes.split(","):
                    for dec in args.decode_precisions.split(","):
                        rows += ingot_prefill(todo, int(chunk), precision, args.decode_steps, kv, dec)
        if not args.no_anchor:
            anchor = anchor_prefill([p for p in prompts if p <= args.max_anchor_prompt], args.decode_steps)
            rows += anchor
            for r in rows:
                a = next((x for x in anchor if x["prompt"] == r["prompt"]), None)
                if a is not None and r is not a:
                    print(f"ratio {r['engine']} / torch_bf16 prompt {r['prompt']}: prefill "
                          f"{r['prefill_tok_s'] / a['prefill_tok_s']:.2f}x", flush=True)
        decode_ratios(rows)
        result["e2e"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
