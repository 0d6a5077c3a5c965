"""One convolution (+ SiLU, as YOLO's layers) compiled alone for the CPU, single-threaded, timed hot
(CPU time, median of RUNS) next to its GFLOP/s; the shapes of YOLO's stride-2 layers and stem by default.

    python benchmarks/lab/conv_one.py [C,H,W,M,K,STRIDE[,silu|none] ...] [--runs N] [--winograd CHANNELS]

--winograd: CpuOptions.winograd_channels (0: the direct kernels only; default: the option's default).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "INGOT_CPU_THREADS"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import ingot  # noqa: E402
from ingot.options import CompileOptions, CpuOptions  # noqa: E402

DEFAULT = ["3,320,320,16,3,2", "16,160,160,32,3,2", "32,80,80,64,3,2", "64,40,40,128,3,2",
           "16,80,80,16,3,1", "64,40,40,64,3,1", "128,20,20,128,3,1"]


def timed(spec: str, runs: int, winograd: int) -> str:
    c, h, w, m, k, s, *rest = spec.split(",")
    c, h, w, m, k, s = map(int, (c, h, w, m, k, s))
    act = rest[0] if rest else "silu"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((m, c, k, k)) * 0.1).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y = g.conv(xi, wt, b, strides=(s, s), pads=((k // 2, k // 2), (k // 2, k // 2)))
    if act == "silu":
        y = y * g.sigmoid(y)
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=1, float32_precision="float32", winograd_channels=winograd)))
    feeds = {"x": x}
    for _ in range(3):
        exe.run(feeds)
    ts = []
    for _ in range(runs):
        t = time.thread_time()
        exe.run(feeds)
        ts.append(time.thread_time() - t)
    ms = statistics.median(ts) * 1e3
    oh, ow = (h + 2 * (k // 2) - k) // s + 1, (w + 2 * (k // 2) - k) // s + 1
    flops = 2.0 * m * oh * ow * c * k * k
    return f"{ms:7.3f} ms {flops / ms / 1e6:6.1f} GF/s  {c}x{h}x{w}->{m} k{k} s{s} {act}"


def main() -> int:
    args = sys.argv[1:]
    runs = 50
    if "--runs" in args:
        i = args.index("--runs")
        runs = int(args[i + 1])
        del args[i:i + 2]
    winograd = CpuOptions().winograd_channels
    if "--winograd" in args:
        i = args.index("--winograd")
        winograd = int(args[i + 1])
        del args[i:i + 2]
    for spec in args or DEFAULT:
        print(timed(spec, runs, winograd), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
