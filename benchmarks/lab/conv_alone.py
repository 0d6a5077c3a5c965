"""Each convolution step of an ONNX model timed in the model, then alone on the same inputs: hot (run
again and again: input, weights and output in cache), with the output evicted (a buffer larger than L2
written, then the inputs read back: the output's lines are where the model finds them) and with
everything evicted. CPU time, single-threaded, medians; shows where a layer loses to its cache state.

    python benchmarks/lab/conv_alone.py yolo [RUNS] [EVICT_MB]    (MATCH=3x: only layers whose line has it)
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "INGOT_CPU_THREADS"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from benchmarks.lab.conv_layers import describe  # noqa: E402
from benchmarks.lab.onnx_profile import imported  # noqa: E402


def main() -> int:
    name = sys.argv[1]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    evict = np.ones((int(sys.argv[3]) if len(sys.argv) > 3 else 8) << 18, np.float32)
    with tempfile.TemporaryDirectory() as folder:
        path, feeds, exe, inner = imported(name, folder)
    plan = inner.plan
    nodes = {n.id: n for n in inner.program.nodes()}
    times, args = defaultdict(list), {}

    def timed(fn, i):
        def step(*xs):
            args.setdefault(i, xs)
            t = time.thread_time()
            try:
                return fn(*xs)
            finally:
                times[i].append(time.thread_time() - t)
        return step
    original = list(plan.steps)
    plan.steps = [(timed(fn, i), *rest) for i, (fn, *rest) in enumerate(plan.steps)]
    for _ in range(runs):
        exe.run(feeds)
    plan.steps = original
    rows = []
    for i, ids in enumerate(plan.step_nodes):
        d, flops = describe(nodes[ids[0]])
        if not flops or os.environ.get("MATCH", "") not in d:
            continue
        fn, xs = original[i][0], args[i]
        arrays = [a for a in xs if isinstance(a, np.ndarray) and a.size > 4096]

        def once(mode):
            if mode != "hot":
                np.add(evict, 1.0, out=evict)
                if mode == "out":
                    for a in arrays:
                        np.add.reduce(a, axis=None)
            t = time.thread_time()
            fn(*xs)
            return time.thread_time() - t
        got = {}
        for mode in ("hot", "out", "all"):
            once(mode)
            got[mode] = statistics.median(once(mode) for _ in range(runs))
        rows.append((statistics.median(times[i]) * 1e3, got["hot"] * 1e3, got["out"] * 1e3, got["all"] * 1e3, d))
    print(f"# {name}: ms, model / hot / output evicted / all evicted ({evict.nbytes >> 20} MB written); "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"# sums: {' '.join(f'{sum(r[k] for r in rows):.2f}' for k in range(4))}")
    for r in sorted(rows, key=lambda r: -r[0])[:int(os.environ.get("TOP", 30))]:
        print(f"{r[0]:7.3f} {r[1]:7.3f} {r[2]:7.3f} {r[3]:7.3f}  {r[1] and r[0] / r[1]:4.2f}x  {r[4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
