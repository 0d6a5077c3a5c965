"""Few-row int4 GEMMs (a batched decode step: 17-64 rows, bf16 dots) on Llama-3-8B shapes: the word GEMM
(`_qgemm_words_kernel`: y^T = W^T x^T, each word loaded once) at its default tiles and a sweep of
others, against the tensor-core kernel that ran these rows before it (`_qgemm_kernel`, forced by its
config) and cuBLAS bf16 on a dense W. Random words and f16-exact parameters; each variant checked
against the dequantized weight in float64 before it is timed. TFLOP/s, and GB/s of the packed weight.

    python benchmarks/lab/cuda_gemm_swap.py [--rows 32,16,64] [--shapes qkv,o,gate+up,down] [--sweep]

Past WORDS_GEMM_MAX_ROWS (e.g. --rows 128) the word GEMM is also timed, forced (64-row tiles).

At the word GEMV's rows (up to CudaOptions.words_max_rows) the word GEMM is also timed, forced (the
GEMV's cell is the standalone call: x rounded by its own launch, which a decode step folds elsewhere).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.quantized_matmul import dispatch  # noqa: E402
from ingot.backends.cuda.quantized_matmul.gemm import WORDS_GEMM_MAX_ROWS, gemm_config, words_gemm_config  # noqa: E402
from ingot.backends.cuda.quantized_matmul.weights import dequantize  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,16,64")
    ap.add_argument("--shapes", default="qkv,o,gate+up,down")
    ap.add_argument("--sweep", action="store_true", help="other tiles, splits, warps and stages of the word GEMM")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = np.random.default_rng(0)
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    prepared = {}
    for name in a.shapes.split(","):
        k, n = SHAPES[name]
        q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
        scale = (rng.random((k // 32, n), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
        bias = (rng.random((k // 32, n), dtype=np.float32) * -0.01).astype(np.float16).astype(np.float32)
        attrs = {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False}
        w = qmm.prepare_weight(q, [scale, bias], attrs, "cuda", words=True)
        prepared[name] = (w, dequantize(w).double(), torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    for m, name in ((int(r), name) for r in a.rows.split(",") for name in a.shapes.split(",")):   # rows first
        k, n = SHAPES[name]
        w, ref_w, dense = prepared[name]
        x = torch.randn(m, k, device="cuda")
        ref = (x.double() @ ref_w).float()
        flop = 2.0 * m * n * k

        def cell(label, fn):
            try:
                err = float((fn().float() - ref).norm() / ref.norm())
                if err > 2e-2:
                    return f"{label} WRONG {err:.1e}"
                t = bench(fn)
            except Exception as e:  # a config that does not compile is reported
                return f"{label} {type(e).__name__}"
            return f"{label} {flop / t / 1e12:.1f} ({w.nbytes / t / 1e9:.0f} GB/s, err {err:.1e})"

        x16 = x.to(torch.bfloat16)
        cells = [f"cuBLAS bf16 {flop / bench(lambda: torch.mm(x16, dense)) / 1e12:.1f}"]
        tile = gemm_config(m, w, torch.float32, "bf16", sms)
        cells.append(cell("tile kernel", lambda: qmm.quantized_matmul(x, w, precision="bf16", config=tile)))
        cells.append(cell(f"{'word GEMV' if m <= qmm.WORDS_MAX_ROWS else 'word GEMM'} (the route)",
                          lambda: qmm.quantized_matmul(x, w, precision="bf16")))
        if m <= qmm.WORDS_MAX_ROWS:   # the GEMV's rows: the word GEMM forced
            y_gemm = torch.empty(m, n, device="cuda")
            cells.append(cell(f"word GEMM {words_gemm_config(m, w, sms)}",
                              lambda: (dispatch._words_gemm(x, w, y_gemm, {}), y_gemm)[1]))
        if m > WORDS_GEMM_MAX_ROWS:   # past the word GEMM's rows (the route: dequantize + cuBLAS), forced
            y_wide = torch.empty(m, n, device="cuda")
            for bn in (256, 128):
                cells.append(cell(f"word GEMM forced, {bn} columns",
                                  lambda bn=bn: (dispatch._words_gemm(x, w, y_wide, {"BLOCK_N": bn}), y_wide)[1]))
        if a.sweep:
            y = torch.empty(m, n, device="cuda")
            block_m = words_gemm_config(m, w, sms)["BLOCK_M"]
            for bn in (128, 256):
                tiles = triton.cdiv(m, block_m) * triton.cdiv(n, bn)
                for waves in (1, 2, 4):
                    split = max(1, min((waves * sms) // tiles, k // 128))
                    for warps, stages in ((4, 3), (8, 3), (4, 4), (4, 2)):
                        cfg = dict(BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)
                        cells.append(cell(f"{bn} k{split} w{warps} s{stages}",
                                          lambda cfg=cfg: (dispatch._words_gemm(x, w, y, cfg), y)[1]))
        print(f"{name} m={m}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
