"""The CPU decode GEMV on a GGUF file's own weights, one call per tensor, in thread CPU time.

    nice -n 19 python benchmarks/lab/gguf_gemv_probe.py --gguf PATH [--layer 0] [--reps 50]
                                                        [--activations int8] [--threads 1]

Each weight of one layer (and the output head) goes through kernels.quantized_matmul_step as a
compiled graph calls it (k-major, the importer's parameters); per tensor: microseconds per call
(median), the bytes the kernel's weight form reads per call, and the GB/s that makes. With
--threads 2 the times are wall times.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def step_for(t, activations: str, threads: int):
    """(step, args) for x [1, K] @ t (a QuantizedTensor [N, K] as GGUF gives it)."""
    from ingot import dtypes as dt
    from ingot.backends.cpu import kernels
    from ingot.ir import Node, Op, TensorType
    km = t.to_k_major()
    n = km.shape[1]
    attrs = {"qdtype": km.qdtype, "dtype": dt.float32, "transpose": False, "mode": "affine",
             "has_zero_point": False, "has_bias": km.bias is not None, "axis": 0, "block_size": km.block_size}
    node = Node(Op.QUANTIZED_MATMUL, TensorType((1, n), dt.float32), (), attrs)
    params = (km.scale,) + ((km.bias,) if km.bias is not None else ())
    return kernels.quantized_matmul_step(node, None, threads=threads, activations=activations), (km.q,) + params


def _copy(t):
    import dataclasses
    return dataclasses.replace(t, q=t.q.copy(), scale=t.scale.copy(), bias=None if t.bias is None else t.bias.copy())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--activations", default="int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated substrings of tensor names")
    ap.add_argument("--cold", action="store_true", help="cycle through copies of each weight (96 MB in all), so "
                    "that each call reads its weight from memory as a decode step does, the code staying warm")
    args = ap.parse_args()
    from ingot.importers.gguf import read_gguf
    from ingot.backends.cpu import kernels
    from ingot.quant.formats import QuantizedTensor
    model = read_gguf(args.gguf, lazy=True)
    names = [k for k in model.tensors if k.startswith(f"blk.{args.layer}.") or k in ("token_embd.weight", "output.weight")]
    if args.only:
        names = [k for k in names if any(s in k for s in args.only.split(","))]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        t = model.tensors[name]
        if not isinstance(t, QuantizedTensor):
            continue
        copies = max(1, (96 << 20) // t.nbytes) if args.cold and t.nbytes < (64 << 20) else 1
        calls = [step_for(t if c == 0 else _copy(t), args.activations, args.threads) for c in range(copies)]
        step, wargs = calls[0]
        x = rng.standard_normal((1, t.shape[1])).astype(np.float32)
        out = step(x, *wargs)
        for s, a in calls[1:]:
            s(x, *a)
        ref = x @ t.dequantize_rows().T if t.shape[0] <= 16384 else None
        err = None if ref is None else float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
        times = []
        for r in range(args.reps * copies):
            s, a = calls[r % copies]
            c = clock()
            s(x, *a)
            times.append(clock() - c)
        us = float(np.median(times)) * 1e6
        rows.append((name, t.source, t.shape, us, err))
    print(f"# {args.activations} activations, {args.threads} thread(s), median of {args.reps} "
          f"({'thread CPU' if args.threads == 1 else 'wall'} time)")
    for name, source, shape, us, err in rows:
        gbs = ""  # noqa: F841
        print(f"{name:<28}{source:<6}{str(shape):<16}{us:9.1f} us  {shape[0] * shape[1] / us / 1e3:6.2f} Gw/s"
              f"{'' if err is None else f'  rel err {err:.1e}'}{gbs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
