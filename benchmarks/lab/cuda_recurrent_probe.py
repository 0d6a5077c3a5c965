"""The CUDA recurrence (backends/cuda/recurrent.py, a launch a time step), replayed as a CUDA graph, at
several tiles (BB batch rows, BH units, BK columns of R a load; BK >= H: the whole row in one load,
no loop), on a CRNN's bidirectional LSTM (T 80, batch 1, hidden 128) and other sizes. Each tile's
result is checked against step_tiles' first.

    python benchmarks/lab/cuda_recurrent_probe.py [--hidden 128,256] [--seq 80] [--batch 1,16]

Measured and removed (H100, 2026-12-05): every step in one launch, a program per direction owning all
units with a barrier between steps: 2,064 us against 659 at hidden 128 (R read by one SM a step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ingot.backends.cuda.recurrent import recurrent, step_tiles  # noqa: E402
from benchmarks.cuda_llm import graph_replay_us  # noqa: E402
from ingot.ir import Op  # noqa: E402


def graph_us(fn) -> float:
    """fn captured as a CUDA graph (after a warm-up on a side stream): microseconds a replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return sorted(graph_replay_us(g, warmup=5) for _ in range(5))[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", default="128,256")
    ap.add_argument("--seq", type=int, default=80)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--ops", default="LSTM,GRU")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for opname in args.ops.split(","):
        op, gates = Op[opname], {"LSTM": 4, "GRU": 3, "RNN": 1}[opname]
        for hidden in map(int, args.hidden.split(",")):
            for b in map(int, args.batch.split(",")):
                d, t = 2, args.seq
                x = torch.randn(t, b, args.size, device=dev, generator=g)
                w = torch.randn(d, gates * hidden, args.size, device=dev, generator=g) * 0.1
                r = torch.randn(d, gates * hidden, hidden, device=dev, generator=g) * (0.5 / hidden ** 0.5)
                bias = torch.randn(d, 2 * gates * hidden, device=dev, generator=g) * 0.1
                lens = torch.full((b,), t, dtype=torch.int32, device=dev)
                h0 = torch.zeros(d, b, hidden, device=dev)
                extra = (h0, torch.zeros_like(h0), torch.zeros(d, 3 * hidden, device=dev)) if op == Op.LSTM else (h0,)
                kw = dict(first_reverse=False, clip=None)
                bb = step_tiles(b, hidden)[0]
                tiles = {"default": None}
                for bh in (8, 16, 32):
                    for warps in (2, 4):
                        if bb * bh * hidden <= 64 * 32 * warps:   # the product at most 64 registers a thread
                            tiles[f"{bb}x{bh}x{hidden}-w{warps}"] = (bb, bh, hidden, warps)
                ref = recurrent(op, x, w, r, bias, lens, *extra, **kw)
                row = {}
                for name, tile in tiles.items():
                    got = recurrent(op, x, w, r, bias, lens, *extra, tiles=tile, **kw)
                    err = max(float((a - c).abs().max()) for a, c in zip(got, ref))
                    us = graph_us(lambda tile=tile: recurrent(op, x, w, r, bias, lens, *extra, tiles=tile, **kw))
                    row[name] = f"{us:.1f} us" + (f" (diff {err:.1e})" if err > 1e-5 else "")
                print(f"{opname} T{t} B{b} H{hidden}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
