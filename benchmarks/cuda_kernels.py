"""CUDA kernels: Ingot's Triton kernels vs torch anchors of the same shapes, in one run.

Anchors measured here, in the same process: device-to-device copy bandwidth (bytes read + written),
a bf16 cuBLAS matmul/GEMV of the same shape, torch.nn.functional.scaled_dot_product_attention.
Every Ingot figure is printed as a ratio to its anchor. Times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph: no host launch cost, for Ingot and the anchors alike); GEMV
weights and small KV caches rotate over copies that together exceed the 60 MB L2, so they come from HBM.

    python -m benchmarks kernels [--quick] [--json out.json] [--only gemv,gemm,decode,prefill]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402

DEVICE = torch.device("cuda")


def bench(fn, warmup=25, rep=100) -> float:
    """Milliseconds per call, the calls captured in a CUDA graph and replayed (no host launch cost in
    the figure, for Ingot and the anchors alike), median of the replays."""
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=max(rep // 4, 20), return_mode="median"))


def rotating(fns):
    """One call of fns[i], the next one each time (captured into a graph, the replays cycle through them)."""
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()
    return call


def copies_for(nbytes: int, total: int = 256 << 20) -> int:
    return max(1, min(16, -(-total // max(nbytes, 1))))


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=DEVICE).uniform_()
    b = torch.empty_like(a)
    for _ in range(300):  # clocks up first
        b.copy_(a)
    # timed as cuda_llm.py times it (do_bench, median): replayed from a CUDA graph the copy read 2.77 TB/s
    # (H200, 2026-12-03) in runs where do_bench gave 4.28 TB/s
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def random_weight(k: int, n: int, block: int = 32, qdtype=dt.uint4, f16_params: bool = True, seed: int = 0,
                  words: bool = True):
    """A k-major quantized weight (Ingot's layout) with GGUF-like f16-exact scale and bias."""
    rng = np.random.default_rng(seed)
    if qdtype.packed:
        q = rng.integers(0, 256, size=(k, n // 2), dtype=np.uint8)
    else:
        q = rng.integers(0, 256, size=(k, n), dtype=np.uint8).view(qdtype.storage)
    scale = (rng.random((k // block, n), dtype=np.float32) * 0.02 + 1e-3)
    bias = -scale * 8
    if f16_params:
        scale, bias = (p.astype(np.float16).astype(np.float32) for p in (scale, bias))
    attrs = dict(qdtype=qdtype, dtype=dt.float32, mode="affine", has_zero_point=False, has_bias=True, transpose=False)
    return qmm.prepare_weight(q, [scale, bias], attrs, DEVICE, words=words)


def gemv_rows(results, bw, quick, rows_list=(1,), only_shapes=None, row_shapes=None, json_path=None, only_variants=None):
    shapes = [  # (name, K, N)
        ("smollm qkv", 576, 960), ("smollm gate+up", 576, 3072), ("smollm down", 1536, 576),
        ("smollm lm_head", 576, 49152), ("llama8b qkv", 4096, 6144), ("llama8b o", 4096, 4096),
        ("llama8b gate+up", 4096, 28672), ("llama8b down", 14336, 4096), ("llama8b lm_head", 4096, 128256),
    ]
    if quick:
        shapes = [s for s in shapes if s[0] in ("smollm qkv", "llama8b gate+up", "llama8b down")]
    if only_shapes:
        shapes = [s for s in shapes if s[0].replace(" ", "_") in only_shapes]
    variants = {  # word-layout dp4a kernel (the default), then the k-major kernels it replaced
        "default": None,
        "atomic": dict(REDUCE=1), "waves8": dict(WAVES=8), "waves16": dict(WAVES=16), "waves20": dict(WAVES=20),
        "waves24": dict(WAVES=24), "waves64": dict(WAVES=64),
        "one-wave": dict(WAVES=0),
        "w1": dict(num_warps=1), "w2": dict(num_warps=2), "w4": dict(num_warps=4), "w8": dict(num_warps=8),
        "no-prefetch": dict(PREFETCH=False), "tb1": dict(TB=1), "tb-auto": dict(TB="auto"), "stages1": dict(num_stages=1),
        "kmajor-stream": dict(KMAJOR=True), "kmajor-small": dict(KMAJOR=True, KERNEL="small"),
        # x in LIMBS bytes (2 * LIMBS dp4a per weight word), rounded in the GEMV or pre-quantized by its own launch (XQ)
        "limbs1": dict(LIMBS=1, XQ=False), "limbs2": dict(LIMBS=2, XQ=False), "limbs3": dict(LIMBS=3, XQ=False),
        "xq-l1": dict(XQ=True, LIMBS=1), "xq-l2": dict(XQ=True, LIMBS=2), "xq-l3": dict(XQ=True, LIMBS=3),
        "xq-l2-tb1": dict(XQ=True, LIMBS=2, TB=1), "xq-l1-waves16": dict(XQ=True, LIMBS=1, WAVES=16),
        # x rounded by each program for its split (no quantize launch; y taken as zeroed by the kernel ahead)
        "self": dict(XQ=True, XQ_SELF=True, ZEROED=True), "self-tb1": dict(XQ=True, XQ_SELF=True, ZEROED=True, TB=1),
        "self-sb2": dict(XQ=True, XQ_SELF=True, ZEROED=True, SELF_BLOCKS=2),
        "self-sb8": dict(XQ=True, XQ_SELF=True, ZEROED=True, SELF_BLOCKS=8),
        "self-sb16": dict(XQ=True, XQ_SELF=True, ZEROED=True, SELF_BLOCKS=16),
        # x = rms_norm(x + add) * g (`rms_norm_matmul`): its quantize launch, or each program's own rounding
        "norm": dict(NORM=True), "norm-self": dict(NORM=True, XQ=True, XQ_SELF=True, ZEROED=True),
    }
    row_variants = {"default": None, "rows1": dict(ROWS=1), "rows2": dict(ROWS=2),
                    "waves64": dict(WAVES=64), "tensor-core": dict(BLOCK_M=16),
                    # x pre-quantized: no x registers to spill, so 4 rows per program (the weight read once) may pay now
                    "xq-l2": dict(XQ=True, LIMBS=2), "xq-l2-rows4": dict(XQ=True, LIMBS=2, ROWS=4)}
    for name, k, n in shapes:
        w = random_weight(k, n)
        nbytes = w.nbytes
        ws = [w] + [random_weight(k, n, seed=i + 1) for i in range(copies_for(nbytes) - 1)]
        wk = [random_weight(k, n, seed=i + 1, words=False) for i in range(len(ws))]
        for rows in rows_list:
            if rows > 1 and row_shapes and name.replace(" ", "_") not in row_shapes:
                continue
            x = torch.randn(rows, k, device=DEVICE)
            g_ones = torch.ones(k, device=DEVICE)
            wbs = [torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies_for(k * n * 2))]
            xb = x.to(torch.bfloat16)
            t_cublas = bench(rotating([lambda wb=wb: xb @ wb for wb in wbs]))
            del wbs
            row = dict(kernel="qgemv", shape=name, K=k, N=n, rows=rows, weight_bytes=nbytes,
                       cublas_bf16_us=round(t_cublas * 1e3, 2))
            for vname, cfg in (variants if rows == 1 else row_variants).items():
                if only_variants and vname not in only_variants:
                    continue
                cfg = dict(cfg or {})
                pool = wk if cfg.pop("KMAJOR", False) else ws
                if cfg.pop("NORM", False):   # x + x (the add), times ones, over its rms: err against the same
                    def gemv(wi, cfg=cfg):
                        return qmm.rms_norm_matmul(x, wi, g_ones, 1e-6, add=x, config=dict(cfg))[1]
                    want = (2 * x) * torch.rsqrt((2 * x).pow(2).mean(-1, keepdim=True) + 1e-6)
                else:
                    def gemv(wi, cfg=cfg):
                        return qmm.quantized_matmul(x, wi, config=dict(cfg))
                    want = x
                try:
                    y = gemv(pool[0])
                    err = float((y - want @ qmm.dequantize(pool[0])).norm() / (want @ qmm.dequantize(pool[0])).norm())
                    t = bench(rotating([lambda wi=wi: gemv(wi) for wi in pool]))
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    row[vname] = f"error: {type(e).__name__}: {str(e)[:120]}"
                    continue
                row[vname] = dict(us=round(t * 1e3, 2), tb_s=round(nbytes / (t * 1e-3) / 1e12, 3),
                                  of_copy=round(nbytes / (t * 1e-3) / bw, 3), rel_err=err)
            best = min((v for v in row.values() if isinstance(v, dict)), key=lambda v: v["us"])
            row["best"] = best
            row["vs_cublas_bf16"] = round(t_cublas / best["us"] * 1e3, 2)
            results.append(row)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(results, f, indent=1)
            print("   " + "  ".join(f"{v}={r['us'] if isinstance(r, dict) else 'ERR'}" for v, r in row.items()
                                    if v != "best" and (isinstance(r, dict) or str(r).startswith("error"))), flush=True)
            print(f"qgemv {name:18s} rows={rows:2d} {nbytes / 1e6:8.2f} MB  default {row['default']['us'] if isinstance(row['default'], dict) else row['default']} us  "
                  f"best {best['us']} us = {best['of_copy']:.2f} of copy bw; cuBLAS bf16 {row['cublas_bf16_us']} us", flush=True)
        del w, ws, wk


def gemm_rows(results, quick):
    shapes = [("llama8b qkv", 4096, 6144), ("llama8b gate+up", 4096, 28672), ("llama8b down", 14336, 4096)]
    if quick:
        shapes = shapes[:1]
    for name, k, n in shapes:
        w = random_weight(k, n)
        for m in (512, 2048):
            for xdtype in (torch.float16, torch.float32):
                x = torch.randn(m, k, device=DEVICE).to(xdtype)
                wb = torch.randn(n, k, device=DEVICE, dtype=torch.float16)
                t_cublas = bench(lambda: x.to(torch.float16) @ wb.t() if xdtype != torch.float16 else x @ wb.t())
                flops = 2 * m * n * k
                row = dict(kernel="qgemm", shape=name, M=m, K=k, N=n, x=str(xdtype).replace("torch.", ""),
                           cublas_f16_tflops=round(flops / (t_cublas * 1e-3) / 1e12, 1))
                for cname, cfg in {"default": None, "128x128x32-w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
                                   "128x256x32-w8": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=3),
                                   "64x128x32-w4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4),
                                   "128x128x32-w8-s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=4)}.items():
                    try:
                        t = bench(lambda: qmm.quantized_matmul(x, w, config=dict(cfg) if cfg else None), rep=50)
                        y = qmm.quantized_matmul(x, w, config=dict(cfg) if cfg else None).float()
                        ref = x.float() @ qmm.dequantize(w)
                        err = float((y - ref).norm() / ref.norm())
                        row[cname] = dict(ms=round(t, 3), tflops=round(flops / (t * 1e-3) / 1e12, 1), rel_err=err)
                    except Exception as e:
                        row[cname] = f"error: {type(e).__name__}: {str(e)[:120]}"
                best = max((v for v in row.values() if isinstance(v, dict)), key=lambda v: v["tflops"], default=None)
                row["best"] = best
                if best:
                    row["vs_cublas_f16"] = round(best["tflops"] / row["cublas_f16_tflops"], 2)
                results.append(row)
                print(f"qgemm {name:16s} M={m:5d} x={row['x']:8s} best {best and best['tflops']} TFLOP/s vs cuBLAS f16 "
                      f"{row['cublas_f16_tflops']} ({row.get('vs_cublas_f16')})", flush=True)


def decode_attention_rows(results, bw, quick):
    hq, hk, d = 32, 8, 128
    lengths = (4096, 32768, 131072) if not quick else (32768,)
    for length in lengths:
        q = torch.randn(1, hq, 1, d, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(1, hk, length, d, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(1, hk, length, d, device=DEVICE, dtype=torch.bfloat16)
        ln = torch.tensor(length, dtype=torch.int32, device=DEVICE)
        nbytes = 2 * k.numel() * k.element_size()
        kvs = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(copies_for(nbytes) - 1)]
        t_torch = bench(rotating([lambda kk=kk, vv=vv: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
                                  for kk, vv in kvs]))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        row = dict(kernel="decode_attention", kv_len=length, heads=f"{hq}/{hk}", d=d, dtype="bfloat16", kv_bytes=nbytes,
                   torch_sdpa_us=round(t_torch * 1e3, 1), torch_tb_s=round(nbytes / (t_torch * 1e-3) / 1e12, 3))
        # (measured slower on the H200, 2026-12-03, and dropped: 32 splits merged in the kernel 56.9 us, 64 /
        # 128 / 256 splits 48.2 / 55.2 / 74.8, 128 splits of 128-key tiles with 8 warps 63.1, against 40.3;
        # 32 splits with the combine kernel, 39.2-39.4 against 41.1 for 33, is the default since)
        for vname, kw in {"default": {}, "combine-kernel": dict(merge=False),
                          "split41": dict(split=41), "split49": dict(split=49), "align16": dict(chunk_align=16),
                          "align8": dict(chunk_align=8), "split49-align16": dict(split=49, chunk_align=16),
                          "bn128": dict(block_n=128), "bn32": dict(block_n=32),
                          "w8": dict(num_warps=8), "stages2": dict(num_stages=2), "stages4": dict(num_stages=4)}.items():
            try:
                out = attn.attention(q, k, v, length=ln, **kw)
                err = float((out.float() - ref).norm() / ref.norm())
                t = bench(rotating([lambda kk=kk, vv=vv: attn.attention(q, kk, vv, length=ln, **kw) for kk, vv in kvs]))
                row[vname] = dict(us=round(t * 1e3, 1), tb_s=round(nbytes / (t * 1e-3) / 1e12, 3),
                                  of_copy=round(nbytes / (t * 1e-3) / bw, 3), rel_err=err)
            except Exception as e:
                row[vname] = f"error: {type(e).__name__}: {str(e)[:120]}"
        # RoPE and the new token's K/V write inside the kernel, as the executor's decode step runs it
        # (a cos/sin table of every position): what they cost at a long cache; not a candidate for "best"
        inv = (1.0 / (500000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
        kn, vn = (torch.randn(1, hk, 1, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        rope = attn.RopeWrite(torch.tensor(length - 1, dtype=torch.int32, device=DEVICE), torch.from_numpy(inv).to(DEVICE),
                              kn, vn, False, attn.rope_table(inv, length, DEVICE))
        t = bench(rotating([lambda kk=kk, vv=vv: attn.attention(q, kk, vv, length=ln, rope=rope) for kk, vv in kvs]))
        rope_row = dict(us=round(t * 1e3, 1), tb_s=round(nbytes / (t * 1e-3) / 1e12, 3), of_copy=round(nbytes / (t * 1e-3) / bw, 3))
        best = min((v for v in row.values() if isinstance(v, dict)), key=lambda v: v["us"])
        row["with_rope"] = rope_row
        row["best"] = best
        row["vs_torch"] = round(t_torch * 1e3 / best["us"], 2)
        results.append(row)
        print(f"decode attention kv={length:6d}: with RoPE + KV write {rope_row['us']} us = {rope_row['of_copy']:.2f} of copy; "
              f"default {row['default']['us'] if isinstance(row['default'], dict) else row['default']} us", flush=True)
        print(f"decode attention kv={length:6d}: best {best['us']} us = {best['tb_s']} TB/s = {best['of_copy']:.2f} of copy; "
              f"torch SDPA {row['torch_sdpa_us']} us ({row['torch_tb_s']} TB/s)", flush=True)
        del k, v, kvs


def small_decode_attention_rows(results):
    """Short-cache decode attention, float32 caches of 2048 rows: SmolLM2 (9/3 heads, d 64) at short and
    long prefixes, and Llama-3-8B's shape (32/8 heads, d 128) at 64 and 512. Variants: "default" (only
    the splits that see keys run; one split writes the output itself; at least ~64 KB of K+V per split),
    the combine kernel, min_chunk overrides, one split."""
    variants = {
        "default": {}, "combine-kernel": dict(merge=False),
        "min-chunk-0": dict(min_chunk=0), "min-chunk-64": dict(min_chunk=64), "min-chunk-128": dict(min_chunk=128),
        "min-chunk-256": dict(min_chunk=256), "split1": dict(split=1),
    }   # 7 variants: a compile per shape, a graph-replay timing per length (49 in all): under a minute
    shapes = [("smollm2", 9, 3, 64, (32, 64, 100, 160, 1000)), ("llama3-8b", 32, 8, 128, (64, 512))]
    buf = 2048
    for name, hq, hk, d, lengths in shapes:
        q = torch.randn(1, hq, 1, d, device=DEVICE)
        k = torch.randn(1, hk, buf, d, device=DEVICE)
        v = torch.randn(1, hk, buf, d, device=DEVICE)
        for length in lengths:
            ln = torch.tensor(length, dtype=torch.int32, device=DEVICE)
            ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
            t_torch = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length],
                                                                                    enable_gqa=True))
            row = dict(kernel="decode_attention_small", model=name, kv_len=length, buffer=buf, heads=f"{hq}/{hk}", d=d,
                       dtype="float32", torch_sdpa_us=round(t_torch * 1e3, 2))
            for vname, kw in variants.items():
                try:
                    out = attn.attention(q, k, v, length=ln, **kw)
                    err = float((out - ref).norm() / ref.norm())
                    row[vname] = dict(us=round(bench(lambda: attn.attention(q, k, v, length=ln, **kw)) * 1e3, 2), rel_err=err)
                except Exception as e:
                    row[vname] = f"error: {type(e).__name__}: {str(e)[:120]}"
            timed = {vn: r for vn, r in row.items() if vn in variants and isinstance(r, dict)}
            best = min(timed, key=lambda vn: timed[vn]["us"]) if timed else None
            row["best"] = dict(timed[best], variant=best) if best else None
            if "default" in timed and "old" in timed:
                row["old_over_default"] = round(timed["old"]["us"] / timed["default"]["us"], 2)
            results.append(row)
            print(f"small decode attention {name} L={length}: default {timed.get('default', {}).get('us')} us, "
                  f"old {timed.get('old', {}).get('us')} us ({row.get('old_over_default')}x), best {best} "
                  f"{best and timed[best]['us']} us, torch {row['torch_sdpa_us']} us", flush=True)
            print("  " + ", ".join(f"{vn} {r['us'] if isinstance(r, dict) else r}" for vn, r in row.items()
                                   if vn in variants), flush=True)


def prefill_attention_rows(results, quick):
    # attention() keyword arguments of the flash kernel; "default" is what Ingot runs
    variants = {
        "old-m64-n64-w4": dict(block_m=64, block_n=64, num_warps=4, num_stages=3, split_stages=False, heavy_first=False,
                               heads_on_axis0=False, gluon=False),
        "default": {},                                              # from 2048 rows (d 128): flash_sm90
        "triton": dict(gluon=False),                                # m128-n64-w8-s3, two stages, heavy blocks first
        "blocks-axis0": dict(heads_on_axis0=False, gluon=False),    # grid (blocks, B*H): the third session's default
        "one-stage": dict(split_stages=False, gluon=False),         # every key tile masked
        "s4": dict(num_stages=4, gluon=False),
        "s2": dict(num_stages=2, gluon=False),
        "m128-n128-s2": dict(block_n=128, num_stages=2, gluon=False),
        "tma": dict(tma=True, gluon=False),                         # Q/K/V through on-device tensor descriptors
        # the Hopper kernel in Gluon (flash_sm90): softmax overlapped with the P V product, two compute warpgroups
        # of 64 rows, K/V and q loaders; one program a multiprocessor walks the query blocks (at any length)
        "gluon": dict(gluon=True),
        "gluon-n64-s4": dict(gluon=dict(block_n=64, stages=4)),
    }
    h, d = 32, 128
    for t in ((4096,) if quick else (1024, 2048, 4096, 8192)):
        q, k, v = (torch.randn(1, h, t, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * t * t * d * h / 2  # causal
        t_torch = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        row = dict(kernel="prefill_attention", T=t, heads=h, d=d, dtype="bfloat16",
                   torch_sdpa_tflops=round(flops / (t_torch * 1e-3) / 1e12, 1))
        for vname, kw in variants.items():
            try:
                out = attn.attention(q, k, v, causal=True, **kw)
                err = float((out.float() - ref).norm() / ref.norm())
                ms = bench(lambda: attn.attention(q, k, v, causal=True, **kw))
                row[vname] = dict(ms=round(ms, 3), tflops=round(flops / (ms * 1e-3) / 1e12, 1), rel_err=err)
            except Exception as e:
                row[vname] = f"error: {type(e).__name__}: {str(e)[:120]}"
        timed = {name: v for name, v in row.items() if isinstance(v, dict)}
        best_name = max(timed, key=lambda name: timed[name]["tflops"])
        row["best"] = dict(timed[best_name], variant=best_name)
        row["vs_torch"] = round(timed[best_name]["tflops"] / row["torch_sdpa_tflops"], 2)
        if "default" in timed:
            row["default_vs_torch"] = round(timed["default"]["tflops"] / row["torch_sdpa_tflops"], 2)
            if "triton" in timed:
                row["default_vs_triton"] = round(timed["default"]["tflops"] / timed["triton"]["tflops"], 2)
        results.append(row)
        print(f"prefill attention T={t}: best {best_name} {timed[best_name]['tflops']} TFLOP/s vs torch SDPA "
              f"{row['torch_sdpa_tflops']} ({row['vs_torch']}); default {row.get('default_vs_torch')}x torch, "
              f"{row.get('default_vs_triton')}x the Triton kernel", flush=True)
        for name, v in row.items():
            if name in variants:
                print(f"  {name:18s} {v}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default="gemv,gemm,decode,prefill")
    ap.add_argument("--shapes", default=None, help="GEMV shapes, comma-separated, spaces as _ (llama8b_gate+up)")
    ap.add_argument("--row-shapes", default=None, help="GEMV shapes that also run 4 and 16 rows")
    ap.add_argument("--variants", default=None, help="GEMV variants to time, comma-separated (default: all)")
    ap.add_argument("--rows", default=None, help="GEMV rows, comma-separated (default 1 with --quick, else 1,4,16)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    t0 = time.time()
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (bench(lambda: a @ a, rep=50) * 1e-3) / 1e12
    bw = max(copy_bandwidth(), copy_bandwidth())  # after the matmul: clocks up (a cold first copy read 2.77 TB/s)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; bf16 cuBLAS 8192^3 {mm:.0f} TFLOP/s", flush=True)
    del a
    results = [dict(kernel="anchors", copy_tb_s=round(bw / 1e12, 3), cublas_bf16_tflops=round(mm, 1),
                    device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)]
    rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else ((1,) if args.quick else (1, 4, 16))
    split = lambda v: set(v.split(",")) if v else None  # noqa: E731
    sections = [("gemv", lambda: gemv_rows(results, bw, args.quick, rows, split(args.shapes), split(args.row_shapes), args.json,
                                         split(args.variants))),
                ("decode", lambda: decode_attention_rows(results, bw, args.quick)),
                ("decode", lambda: small_decode_attention_rows(results)),
                ("prefill", lambda: prefill_attention_rows(results, args.quick)),
                ("gemm", lambda: gemm_rows(results, args.quick))]
    for name, fn in sections:
        if name in only:
            try:
                fn()
            except Exception as e:  # keep the other sections' numbers
                print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
                results.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
