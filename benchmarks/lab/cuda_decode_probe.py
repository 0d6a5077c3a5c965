"""Where does a short-cache decode attention launch spend its time? SmolLM2's shape (9/3 heads, d 64,
float32 caches of 2048 rows) as the executor's decode step runs it: RoPE and the new token's K/V
write inside (`rope=`), the output rounded for the o GEMV (`xq=`) and that GEMV's output zeroed
(`zero=`); then with each of those parts left out, and with other launch settings. Each figure is the
median of do_bench_cudagraph (the launch repeated in a CUDA graph, programmatic dependent launch as
the model runs it); "empty" is a kernel that only waits and exits, the floor of a launch.

    python benchmarks/lab/cuda_decode_probe.py [--lengths 33,100,160,1000] [--json out.json]

Long contexts as a model compiled for a long context runs them (issue 38's decode at 8k against 512):
`--shape 32,8,128 --buffer 34848 --lengths 512,8192 --kv-dtypes bfloat16,int8` (an int8 cache: codes
and float32 row scales, as `kv_dtype="int8"` stores them; its new row quantized by the kernel).
`--caches N`: N caches of their own, one launch on each in turn (a layer after another, as a model's step
reads them), so the keys come from memory, not from the L2 a repeated launch leaves them in; the figure is
a launch's share, and GB/s the cache bytes it reads over that.
`--variants exec:decode_precision=bf16` runs the executor's launch with that CudaOptions choice.
`--dry` runs each variant once, untimed (Triton's interpreter: INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.pdl import pdl_args, pdl_enter  # noqa: E402
from ingot.options import CudaOptions  # noqa: E402


@triton.jit
def _empty(x_ptr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    if tl.program_id(0) == 1 << 30:
        tl.store(x_ptr, 0.0)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="33,100,160,1000")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    ap.add_argument("--shape", default="9,3,64")
    ap.add_argument("--buffer", type=int, default=2048, help="cache rows (the compiled context)")
    ap.add_argument("--kv-dtypes", default="float32", help="comma-separated: float32, bfloat16, float16, int8")
    ap.add_argument("--caches", type=int, default=1, help="caches of their own, a launch on each in turn")
    ap.add_argument("--dry", action="store_true", help="each variant once, untimed (the interpreter)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import os
    dev = torch.device(os.environ.get("INGOT_CUDA_DEVICE", "cuda"))
    timed = (lambda fn: (fn(), 0.0)[1]) if a.dry else bench
    hq, hk, d = (int(v) for v in a.shape.split(","))
    buf = a.buffer
    x = torch.zeros(1, device=dev)
    rows = [dict(variant="empty", us=round(timed(lambda: _empty[(hk,)](x, **pdl_args(dev))), 2))]
    print(f"empty kernel ({hk} programs): {rows[0]['us']} us", flush=True)
    inv = (1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)
    table = attn.rope_table(inv, buf, dev)
    inv_dev = torch.from_numpy(inv).to(dev)
    limbs = 2
    xq = qmm.xq_buffers(1, hq * d, limbs, dev)
    zero = torch.empty(576, device=dev)
    variants = {
        "exec": dict(rope=True, xq=True, zero=True),
        "exec-early": dict(rope=True, xq=True, zero=True, early=True),
        "exec-reread": dict(rope=True, xq=True, zero=True, fresh=False),
        "exec-reread-early": dict(rope=True, xq=True, zero=True, fresh=False, early=True),
        "plain": dict(),
        "rope": dict(rope=True),
        "xq+zero": dict(xq=True, zero=True),
        "rope+zero": dict(rope=True, zero=True),
        "exec-ieee": dict(rope=True, xq=True, zero=True, precision="ieee"),
        "exec-tf32": dict(rope=True, xq=True, zero=True, precision="tf32"),
        "exec-tf32x3p": dict(rope=True, xq=True, zero=True, precision="tf32x3p"),
        "plain-tf32x3p": dict(precision="tf32x3p"),
        "exec-w1": dict(rope=True, xq=True, zero=True, num_warps=1),
        "exec-w2": dict(rope=True, xq=True, zero=True, num_warps=2),
        "exec-w4": dict(rope=True, xq=True, zero=True, num_warps=4),
        "exec-w8": dict(rope=True, xq=True, zero=True, num_warps=8),
        "exec-s1": dict(rope=True, xq=True, zero=True, num_stages=1),
        "exec-bn32": dict(rope=True, xq=True, zero=True, block_n=32),
        "exec-bn128": dict(rope=True, xq=True, zero=True, block_n=128),
        "exec-chunk256": dict(rope=True, xq=True, zero=True, min_chunk=256),
        "exec-chunk256-bn128": dict(rope=True, xq=True, zero=True, min_chunk=256, block_n=128),
        "exec-split16": dict(rope=True, xq=True, zero=True, split=16),
        # one CTA an SM fits (8 warps x 212 registers at int8, 122 KB of shared memory at bf16, sm_90a):
        # 33 splits x 8 heads run in two waves; these fit two an SM or run in one wave
        "exec-s2": dict(rope=True, xq=True, zero=True, num_stages=2),
        "exec-split16-s2": dict(rope=True, xq=True, zero=True, split=16, num_stages=2),
        "exec-bn32-w4": dict(rope=True, xq=True, zero=True, block_n=32, num_warps=4),
        "exec-bn32-w4-s2": dict(rope=True, xq=True, zero=True, block_n=32, num_warps=4, num_stages=2),
        "exec-split24": dict(rope=True, xq=True, zero=True, split=24),
        "exec-split8": dict(rope=True, xq=True, zero=True, split=8),
        "exec-split4": dict(rope=True, xq=True, zero=True, split=4),
        "exec-early-w4": dict(rope=True, xq=True, zero=True, early=True, num_warps=4),
        "exec-early-tf32": dict(rope=True, xq=True, zero=True, early=True, precision="tf32"),
        "rope-early": dict(rope=True, early=True),
        "rope+zero-early": dict(rope=True, zero=True, early=True),
    }
    if a.variants:   # a name above, or the executor's launch with settings: "exec:split=16+block_n=32+num_warps=4"
        def parse(name):
            if name in variants:
                return variants[name]
            base, _, settings = name.partition(":")
            cfg = dict(variants[base])
            for item in filter(None, settings.split("+")):
                key, _, value = item.partition("=")
                if key == "decode_precision":   # CudaOptions.decode_precision ("bf16": one bfloat16 product)
                    cfg["options"] = CudaOptions(decode_precision=value)
                else:
                    cfg[key] = value if key == "precision" else int(value)
            return cfg
        variants = {name: parse(name) for name in a.variants.split(",")}
    for kv_dtype, length in ((t, int(n)) for t in a.kv_dtypes.split(",") for n in a.lengths.split(",")):
        q = torch.randn(1, hq, 1, d, device=dev)
        caches = []
        for _ in range(a.caches):
            if kv_dtype == "int8":   # codes and float32 row scales, as kv_dtype="int8" stores them
                kv = tuple(torch.randint(-127, 128, (1, hk, buf, d), dtype=torch.int8, device=dev) for _ in range(2))
                caches.append((*kv, tuple(torch.rand(1, hk, buf, 1, device=dev) * 0.02 for _ in range(2))))
            else:
                caches.append((*(torch.randn(1, hk, buf, d, device=dev).to(getattr(torch, kv_dtype)) for _ in range(2)), None))
        row_bytes = hk * d * caches[0][0].element_size() * 2 + (hk * 8 if kv_dtype == "int8" else 0)
        kn, vn = torch.randn(1, hk, 1, d, device=dev), torch.randn(1, hk, 1, d, device=dev)
        pos = torch.tensor(length - 1, dtype=torch.int32, device=dev)
        ln = torch.tensor(length, dtype=torch.int32, device=dev)
        line = []
        for name, cfg in variants.items():
            kw = {key: val for key, val in cfg.items() if key not in ("rope", "xq", "zero")}
            if cfg.get("rope"):
                kw["rope"] = attn.RopeWrite(pos, inv_dev, kn, vn, False, table)
            if cfg.get("zero"):
                kw["zero"] = zero

            def call(kw=kw, cfg=cfg):
                extra = dict(kw)
                if cfg.get("xq"):
                    extra["xq"] = attn.XQTarget(xq["xq_ptr"], xq["xd_ptr"], xq["xs_ptr"], limbs)
                for k, v, scales in caches:
                    out = attn.attention(q, k, v, length=ln, causal=True, scales=scales, **extra)
                return out
            try:
                us = round(timed(call) / len(caches), 2)
            except Exception as e:   # a variant that does not compile is reported, not fatal
                us = f"error: {type(e).__name__}: {str(e)[:100]}"
            rows.append(dict(variant=name, kv_dtype=kv_dtype, buffer=buf, length=length, caches=a.caches, us=us))
            line.append(f"{name} {us}" + (f" ({length * row_bytes / us / 1e3:.0f} GB/s)" if isinstance(us, float) and us > 0 else ""))
        print(f"{kv_dtype} L={length} (buffer {buf}, {a.caches} caches): " + ", ".join(line), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
