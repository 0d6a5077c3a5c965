"""One convolution (+ ReLU) at 1 and 2 CPU threads (backends/cpu/conv.py threaded_step: the direct kernel's
bands of output rows where its input is the larger, else parts of output channels, or of output rows under
32 channels), wall-time medians, float32 kernels:

    python benchmarks/lab/conv_threads.py [RUNS]

Shapes: large kxk ones, YOLO's (32 -> 32 at 40 x 40, 16 -> 16 at 80 x 80, 16 -> 32 stride 2 at 160), a 1x1
one under the split threshold and a depthwise one. A probe, not a benchmark.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [  # C, M, (H, W), k, stride (groups C where depthwise)
    (64, 64, (80, 80), 3, 1, False), (128, 128, (40, 40), 3, 1, False), (32, 32, (40, 40), 3, 1, False),
    (16, 16, (80, 80), 3, 1, False), (16, 32, (160, 160), 3, 2, False), (64, 64, (20, 20), 3, 1, False),
    (32, 32, (80, 80), 1, 1, False), (96, 96, (56, 56), 3, 1, True),
]


def main() -> int:
    import ingot
    from ingot.options import CompileOptions, CpuOptions

    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    rng = np.random.default_rng(0)
    for c, m, hw, k, s, depthwise in SHAPES:
        groups = c if depthwise else 1
        x = rng.standard_normal((1, c) + hw).astype(np.float32)
        w = (rng.standard_normal((m, c // groups, k, k)) * 0.1).astype(np.float32)
        g = ingot.Graph()
        y = g.maximum(g.conv(g.placeholder(x.shape, name="x"), w, None, strides=(s, s), pads=((k // 2, k // 2),) * 2,
                             groups=groups), 0.0)
        ms = []
        for threads in (1, 2):
            exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=threads, float32_precision="float32")))
            exe.run({"x": x})
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                exe.run({"x": x})
                times.append(time.perf_counter() - t)
            ms.append(statistics.median(times) * 1e3)
        kind = "depthwise " if depthwise else ""
        print(f"{kind}{c} -> {m} {k}x{k} s{s} at {hw[0]}x{hw[1]}: 1 thread {ms[0]:.3f} ms, 2 threads {ms[1]:.3f} ms, "
              f"{ms[0] / ms[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
