"""GFLOP/s of cpu/matmul_avx512.py's kernel by tile (rows x vectors) against NumPy's BLAS, one thread,
on the BERT encoder's shapes (and any given as M,K,N), best of interleaved rounds.

    python benchmarks/lab/matmul_avx512_tiles.py                    # tiles 8x3 6x4 ...
    python benchmarks/lab/matmul_avx512_tiles.py 8x2,12x2 128,768,768
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from ingot.backends.cpu import matmul_avx512  # noqa: E402

TILES = "14x2,12x2,8x2,6x4,7x4,4x4,8x3,9x3"
SHAPES = [(128, 128, 128), (128, 128, 512), (128, 512, 128), (1, 128, 128)]


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> int:
    tiles = [tuple(int(v) for v in t.split("x")) for t in (sys.argv[1] if len(sys.argv) > 1 else TILES).split(",")]
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]] or SHAPES
    rng = np.random.default_rng(0)
    print(f"# OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}; load {os.getloadavg()[0]:.1f}")
    for m, k, n in shapes:
        x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        out = np.empty((m, n), np.float32)
        fns = {"blas": lambda: np.dot(x, w, out)}
        for r, v in tiles:
            run = matmul_avx512.step(m, k, n, r, v)
            run(x, w, out)
            assert np.allclose(out, x @ w, atol=1e-3), (r, v)
            fns[f"{r}x{v}"] = (lambda run: lambda: run(x, w, out))(run)
        calls = max(10, int(2e7 / (m * k * n)))
        best = {name: 1.0 for name in fns}
        for _ in range(7):
            for name, fn in fns.items():
                best[name] = min(best[name], timed(fn, calls))
        flops = 2 * m * k * n
        print(f"{m}x{k}x{n}: " + "  ".join(f"{name} {t * 1e6:.1f} us {flops / t / 1e9:.0f}" for name, t in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
