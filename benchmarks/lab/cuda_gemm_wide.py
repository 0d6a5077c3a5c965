"""Many-row int4 GEMMs (prefill: 512 / 2,048 rows, bf16 dots) on Llama-3-8B shapes, issue 38's goal of
0.9x cuBLAS bf16 from M = 512: a wide word GEMM (y^T = W^T x^T; W's dequantized tile is the dot's first
operand, K tiles spanning several parameter groups, x bf16 read through TMA or plain loads) swept over
tiles, warps and stages, against the route today (W dequantized to bf16 + cuBLAS), the tile kernel
(`_qgemm_kernel`) and cuBLAS bf16 on a dense W. Each variant checked against the dequantized weight
in float64 before it is timed. TFLOP/s.

    python benchmarks/lab/cuda_gemm_wide.py [--rows 512,2048,128] [--shapes qkv,o,gate+up,down] [--quick]

Measured (H100, Triton 3.6, 2026-12-06; the full sweep, then `--quick`): the best tile is 64 columns of
W (one warpgroup's MMA rows, W's tile from registers) x 256 rows of x through TMA, K tile 128, 4 warps,
3 stages: 248-352 TFLOP/s, 0.40-0.57x cuBLAS bf16 at 512 rows and 0.44-0.49x at 2,048, against
dequantize + cuBLAS 306-396 (512) and 507-584 (2,048): a loss, so the route stays dequantize + cuBLAS
and this kernel lives only here. 128-column W tiles peak at 250; bfloat16 dequantize arithmetic
(DQ16) +2-3 %; plain loads of x -25 %. Triton's warp specialization (tl.range(warp_specialize=True))
fails to compile this loop (WSDataPartition.cpp: "Unexpected op"), so the dequantize and the MMA do not
overlap: what a producer/consumer kernel (Marlin / Machete) would add.
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
from ingot.backends.cuda.quantized_matmul.gemm import _to_float, gemm_config  # noqa: E402
from ingot.backends.cuda.quantized_matmul.weights import dequantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)}


@triton.jit
def _qgemm_wide_kernel(x_ptr, x_desc, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qk, stride_sk, stride_ym,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, X_TMA: tl.constexpr, DQ16: tl.constexpr, M_FAST: tl.constexpr,
                 DOT: tl.constexpr = tl.bfloat16):
    """y[M, N] = x @ W, one [BLOCK_N, BLOCK_M] tile of y^T a program: W^T's [BLOCK_N, BLOCK_K] tile from
    BLOCK_K / 8 words a column, dequantized in registers (scale and bias per group of GROUP k), the
    dot's first operand; x^T's [BLOCK_K, BLOCK_M] tile its second."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if M_FAST:         # the row tiles of one W tile run side by side: W read once from memory
        pid_m = pid % num_m
        pid_n = pid // num_m
    else:
        pid_n = pid % num_n
        pid_m = pid // num_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    G: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP                 # parameter rows a tile spans
    GS: tl.constexpr = BLOCK_K // G                                   # k a parameter row covers in it
    j = tl.arange(0, 8)
    shift = (j % 4) * 8 + (j // 4) * 4          # k = 8r + j: low nibble of byte j (j < 4), else high of j - 4
    KW = tl.cdiv(K, 8)
    KG = tl.cdiv(K, GROUP)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(q_ptr + r[None, :] * stride_qk + offs_n[:, None], mask=n_ok[:, None] & (r < KW)[None, :],
                        other=0)
        v = (words[:, :, None] >> shift[None, None, :]) & 0xF                      # [BLOCK_N, BLOCK_K/8, 8]
        g = k0 // GROUP + tl.arange(0, G)
        g_ok = n_ok[:, None] & (g < KG)[None, :]
        s = tl.load(s_ptr + g[None, :] * stride_sk + offs_n[:, None], mask=g_ok, other=0.0)
        if DQ16:       # v - 128 exact in bfloat16 (128 + v by the exponent trick), then one bf16 FMA
            vb = (v | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
            w = tl.reshape(vb, [BLOCK_N, G, GS]) * s.to(tl.bfloat16)[:, :, None]
            if HAS_BIAS:
                b = tl.load(b_ptr + g[None, :] * stride_sk + offs_n[:, None], mask=g_ok, other=0.0)
                w += b.to(tl.bfloat16)[:, :, None]
            wt = tl.reshape(w, [BLOCK_N, BLOCK_K])
        else:
            w = tl.reshape(_to_float(v), [BLOCK_N, G, GS]) * s.to(tl.float32)[:, :, None]
            if HAS_BIAS:
                b = tl.load(b_ptr + g[None, :] * stride_sk + offs_n[:, None], mask=g_ok, other=0.0)
                w += b.to(tl.float32)[:, :, None]
            wt = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(DOT)
        if X_TMA:
            xt = tl.trans(x_desc.load([pid_m * BLOCK_M, k0]))
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :] & (offs_k < K)[:, None], other=0.0)
        acc = tl.dot(wt, xt.to(DOT), acc)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


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
                 for bn, bm, bk, wp, st, tma, dq in [
                     (64, 256, 128, 4, 3, True, True), (64, 256, 128, 4, 3, True, False), (64, 256, 128, 4, 3, False, True),
                     (64, 256, 64, 4, 3, True, True), (64, 256, 64, 4, 4, True, True), (64, 256, 256, 4, 2, True, True),
                     (64, 256, 128, 4, 2, True, True), (64, 256, 128, 8, 3, True, True), (64, 128, 128, 4, 4, True, True),
                     (64, 256, 64, 4, 5, True, True), (128, 256, 64, 8, 3, True, True), (128, 256, 64, 8, 2, True, True)]]
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
