"""One word-GEMM launch (Llama-3-8B gate+up, int4 g32, bf16 dots) for Nsight Compute:

    ncu --set full -k regex:_qgemm_words -s 2 -c 1 python benchmarks/lab/ncu_words_gemm.py [--rows 32]

H100, 2026-12-06, 32 rows: 224 programs (0.57 waves; 3 fit an SM by registers, 145 a thread, and shared
memory, 36.9 KB), achieved occupancy 10 % (1.65 warps a scheduler, 0.66 eligible), issue slots 43 % busy,
DRAM 24 % of peak: latency-bound at low occupancy. Measured in cuda_gemm_swap.py and dropped: three or
four programs an SM (split-K, maxnreg 128): +0-6 % at 32 rows, slower at 64; nibbles joined in
registers (no shared-memory transpose, 513 instructions a K tile against 608): 8-20 % slower; the
next tile's loads issued by hand: 10-13 % slower on gate+up and down.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=32)
ap.add_argument("--shape", default="4096,28672")
a = ap.parse_args()
k, n = (int(v) for v in a.shape.split(","))
rng = np.random.default_rng(0)
q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
scale = (rng.random((k // 32, n), dtype=np.float32) * 0.01).astype(np.float16).astype(np.float32)
bias = (rng.random((k // 32, n), dtype=np.float32) * -0.01).astype(np.float16).astype(np.float32)
w = qmm.prepare_weight(q, [scale, bias], {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False},
                       "cuda", words=True)
x = torch.randn(a.rows, k, device="cuda")
for _ in range(4):
    qmm.quantized_matmul(x, w, precision="bf16")
torch.cuda.synchronize()
