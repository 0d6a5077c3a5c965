"""Does the decode GEMV of a GGUF's output head reach the memory's speed? The head (Gemma 3 270M: Q8_0,
262144 x 640, 178 MB read per token) through kernels.quantized_matmul_step (int8 activations, the VNNI
kernel) against plain reads of as many bytes (a numba nogil sum of 64-bit words, the array split over
the threads), 1 and 2 threads, interleaved rep by rep; medians of wall and process CPU time, GB/s of the
bytes each reads.

    nice -n 19 python benchmarks/lab/head_bandwidth.py --gguf PATH [--reps 10] [--tensor token_embd.weight]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@njit(nogil=True, cache=True, fastmath=True)
def _read(words):
    total = np.uint64(0)
    for i in range(words.shape[0]):
        total += words[i]
    return total


def read_all(words: np.ndarray, threads: int) -> None:
    parts = np.array_split(words, threads)
    if threads == 1:
        _read(parts[0])
        return
    others = [threading.Thread(target=_read, args=(p,)) for p in parts[1:]]
    for t in others:
        t.start()
    _read(parts[0])
    for t in others:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tensor", default="token_embd.weight")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from gguf_gemv_probe import step_for
    from ingot.backends.cpu import kernels
    from ingot.importers.gguf import read_gguf
    t = read_gguf(args.gguf, lazy=True).tensors[args.tensor]
    steps = {n: step_for(t, "int8", n) for n in (1, 2)}
    x = np.random.default_rng(0).standard_normal((1, t.shape[1])).astype(np.float32)
    for step, wargs in steps.values():
        step(x, *wargs)
    layout = max(kernels._REPACKED.values(), key=lambda a: a.nbytes)
    head_bytes = layout.nbytes + t.scale.size * 2        # the VNNI layout and its float16 scales
    words = np.ones(head_bytes // 8, np.uint64)
    for n in (1, 2):
        read_all(words, n)
    times: dict = {}
    for _ in range(args.reps):
        for n in (1, 2):
            c, p = time.perf_counter(), time.process_time()
            read_all(words, n)
            times.setdefault(("read", n), []).append((time.perf_counter() - c, time.process_time() - p))
            step, wargs = steps[n]
            c, p = time.perf_counter(), time.process_time()
            step(x, *wargs)
            times.setdefault(("head GEMV", n), []).append((time.perf_counter() - c, time.process_time() - p))
    print(f"# {args.tensor} {t.source} {t.shape}: {head_bytes / 1e6:.0f} MB a token; load {os.getloadavg()[0]:.1f}; "
          f"median wall of {args.reps}")
    for (what, n), v in sorted(times.items()):
        s, cpu = (float(np.median([r[i] for r in v])) for i in (0, 1))
        print(f"{what:<10} {n} thread(s): {1e3 * s:7.2f} ms  {head_bytes / s / 1e9:5.1f} GB/s wall; "
              f"{1e3 * cpu:7.2f} ms CPU ({head_bytes / cpu / 1e9:5.1f} GB/s per CPU second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
