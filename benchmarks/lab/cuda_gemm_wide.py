"""Many-row int4 GEMMs (prefill: 512 / 2,048 rows, bf16 dots) on Llama-3-8B shapes, issue 38's goal of
0.9x cuBLAS bf16 from M = 512: a wide word GEMM (y^T = W^T x^T; W's dequantized tile is the dot's first
operand, K tiles spanning several parameter groups, x bf16 read through TMA or plain loads) swept over
tiles, warps and stages, against the route today (W dequantized to bf16 + cuBLAS), the tile kernel
(`_qgemm_kernel`) and cuBLAS bf16 on a dense W. Each variant checked against the dequantized weight
in float64 before it is timed. TFLOP/s.

    python benchmarks/lab/cuda_gemm_wide.py [--rows 512,2048,128] [--shapes qkv,o,gate+up,down] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.quantized_matmul.gemm import _qgemm_wide_kernel, gemm_config  # noqa: E402
from ingot.backends.cuda.quantized_matmul.weights import dequantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)}


def wide(x16, w, y, cfg):
    m = x16.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    desc = None
    if cfg["X_TMA"]:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(x16, [bm, bk])
    bias = w.bias if w.bias is not None else w.scale
    grid = (triton.cdiv(m, bm) * triton.cdiv(w.n, bn),)
    _qgemm_wide_kernel[grid](x16, desc, w.q, w.scale, bias, y, m, w.n, w.k, x16.stride(0), w.q.stride(0), w.scale.stride(0),
                       y.stride(0), GROUP=w.group, HAS_BIAS=w.bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       X_TMA=cfg["X_TMA"], DQ16=cfg["DQ16"], M_FAST=cfg["M_FAST"], DOT=cfg.get("DOT", tl.bfloat16), num_warps=cfg["num_warps"],
                       num_stages=cfg["num_stages"])
    return y


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,2048,128")
    ap.add_argument("--shapes", default="qkv,o,gate+up,down")
    ap.add_argument("--quick", action="store_true", help="a short sweep")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds before the sweep stops")
    a = ap.parse_args()
    t_start = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = np.random.default_rng(0)
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    try:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    except Exception:
        pass
    prepared = {}
    for name in a.shapes.split(","):
        k, n = SHAPES[name]
        q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
        scale = (rng.random((k // 32, n), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
        bias = (rng.random((k // 32, n), dtype=np.float32) * -0.01).astype(np.float16).astype(np.float32)
        attrs = {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False}
        w = qmm.prepare_weight(q, [scale, bias], attrs, "cuda", words=True)
        prepared[name] = (w, dequantize(w).double(), torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    print("scale dtype", prepared[next(iter(prepared))][0].scale.dtype, flush=True)
    if a.quick:
        space = [dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, num_warps=wp, num_stages=st, X_TMA=tma, DQ16=dq, M_FAST=True)
                 for bn, bm, bk, wp, st, tma, dq in [(128, 128, 64, 8, 3, False, False), (128, 256, 64, 8, 3, True, False),
                                                     (128, 128, 128, 8, 3, True, False), (128, 128, 64, 8, 3, True, True)]]
    else:
        space = []
        for bn, bm, bk, wp, st, tma, dq in itertools.product((128, 256), (128, 256), (64, 128), (4, 8), (3, 4),
                                                           (True, False), (False, True)):
            if bn * bm > 128 * 256 or (wp == 4 and bn * bm > 128 * 128) or (bk == 128 and st == 4):
                continue
            space.append(dict(BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, num_warps=wp, num_stages=st, X_TMA=tma, DQ16=dq,
                              M_FAST=True))
        space.append({**space[0], "M_FAST": False})
    best = {}
    for m, name in ((int(r), name) for r in a.rows.split(",") for name in a.shapes.split(",")):
        k, n = SHAPES[name]
        w, ref_w, dense = prepared[name]
        x = torch.randn(m, k, device="cuda")
        x16 = x.to(torch.bfloat16)
        ref = (x16.double() @ ref_w).float()
        flop = 2.0 * m * n * k
        y = torch.empty(m, n, device="cuda")
        cublas = flop / bench(lambda: torch.mm(x16, dense)) / 1e12
        cells = [f"cuBLAS bf16 {cublas:.0f}"]

        def timed(fn):
            try:
                out = fn()
                err = float((out.float() - ref).norm() / ref.norm())
                if not err < 2e-2:
                    return None, f"WRONG {err:.1e}"
                return flop / bench(fn) / 1e12, f"err {err:.1e}"
            except Exception as e:  # a config that does not compile or run is reported
                return None, f"{type(e).__name__}: {str(e)[:80]}"

        t, note = timed(lambda: qmm.quantized_matmul(x, w, precision="bf16"))
        cells.append(f"route (dequantize + cuBLAS) {t or 0:.0f} {note}")
        tile = gemm_config(m, w, torch.bfloat16, "bf16", sms)
        t, note = timed(lambda: qmm.quantized_matmul(x16, w, precision="bf16", config=tile))
        cells.append(f"tile kernel {t or 0:.0f}")
        print(f"{name} m={m}: " + " | ".join(cells), flush=True)
        results = []
        for cfg in space:
            if time.time() - t_start > a.budget:
                print("  budget spent", flush=True)
                break
            t, note = timed(lambda cfg=cfg: wide(x16, w, y, cfg))
            tag = "n{BLOCK_N} m{BLOCK_M} k{BLOCK_K} w{num_warps} s{num_stages} tma{X_TMA:d} dq16{DQ16:d} mf{M_FAST:d}".format(**cfg)
            if t is None:
                print(f"  {tag}: {note}", flush=True)
                continue
            results.append((t, tag))
        results.sort(reverse=True)
        for t, tag in results[:5]:
            print(f"  {tag}: {t:.0f} TFLOP/s = {t / cublas:.2f}x cuBLAS", flush=True)
        if results:
            best[(name, m)] = (results[0][0] / cublas, results[0][1])
    print("best:", {f"{k[0]}@{k[1]}": f"{v[0]:.2f}x {v[1]}" for k, v in best.items()}, flush=True)


if __name__ == "__main__":
    main()
