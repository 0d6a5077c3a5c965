"""The CUDA recurrence (backends/cuda/recurrent.py) both ways, each replayed as a CUDA graph: every
step in one launch (`sequence`, at several warp counts) against a launch a step, on a CRNN's
bidirectional LSTM (T 80, batch 1, hidden 128) and larger hidden sizes, to set SEQUENCE_MAX_R_BYTES.
Checks the two paths agree first.

    python benchmarks/lab/cuda_recurrent_probe.py [--hidden 128,256,512] [--seq 80] [--batch 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot.backends.cuda.recurrent import recurrent  # noqa: E402
from ingot.ir import Op  # noqa: E402


def graph_us(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="128,256,512")
    ap.add_argument("--seq", type=int, default=80)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--ops", default="LSTM,GRU")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for opname in args.ops.split(","):
        op, gates = Op[opname], {"LSTM": 4, "GRU": 3, "RNN": 1}[opname]
        for hidden in map(int, args.hidden.split(",")):
            d, t, b = 2, args.seq, args.batch
            x = torch.randn(t, b, args.size, device=dev, generator=g)
            w = torch.randn(d, gates * hidden, args.size, device=dev, generator=g) * 0.1
            r = torch.randn(d, gates * hidden, hidden, device=dev, generator=g) * (0.5 / hidden ** 0.5)
            bias = torch.randn(d, 2 * gates * hidden, device=dev, generator=g) * 0.1
            lens = torch.full((b,), t, dtype=torch.int32, device=dev)
            h0 = torch.zeros(d, b, hidden, device=dev)
            extra = (h0, torch.zeros_like(h0), torch.zeros(d, 3 * hidden, device=dev)) if op == Op.LSTM else (h0,)
            kw = dict(first_reverse=False, clip=None)
            ref = recurrent(op, x, w, r, bias, lens, *extra, sequence=False, **kw)
            got = recurrent(op, x, w, r, bias, lens, *extra, sequence=True, **kw)
            err = max(float((a - c).abs().max()) for a, c in zip(got, ref))
            row = {"step": graph_us(lambda: recurrent(op, x, w, r, bias, lens, *extra, sequence=False, **kw))}
            for warps in (4, 8, 16):
                row[f"seq-w{warps}"] = graph_us(lambda: recurrent(op, x, w, r, bias, lens, *extra, sequence=True,
                                                                  num_warps=warps, **kw))
            kb = gates * hidden * hidden * 4 >> 10
            print(f"{opname} T{t} B{b} H{hidden} (R {kb} KB/dir) max|diff| {err:.1e}: "
                  + "  ".join(f"{k} {v:.1f} us" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
