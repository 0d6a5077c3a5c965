"""Why the word-layout GEMV runs where it runs: registers, spills and load widths of each config
(from the compiled kernel), and with --ncu one launch to profile under Nsight Compute.

    python benchmarks/cuda_gemv_probe.py                  # resource table of the configs
    ncu --clock-control none --kernel-name regex:words --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats python benchmarks/cuda_gemv_probe.py --ncu
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from cuda_kernels import random_weight  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402


def launch(x, w, y, config):
    m = x.shape[0]
    cfg = {**qmm.words_gemv_config(w, m, torch.cuda.get_device_properties(0).multi_processor_count,
                                   config.pop("WAVES", 32), config.get("num_warps"), config.get("ROWS")), **config}
    block_n, tb, rows, split = cfg.pop("BLOCK_N"), cfg.pop("TB"), cfg.pop("ROWS"), cfg.pop("SPLIT")
    kw = w.q.shape[0]
    per = triton.cdiv(triton.cdiv(kw, split), 4 * tb) * 4 * tb
    split = triton.cdiv(kw, per)
    y.zero_()
    return qmm._qgemv_words_kernel[(triton.cdiv(w.n, block_n), split, triton.cdiv(m, rows))](
        x, x, w.q, w.scale, w.bias, y, y, y, y, m, w.n, w.k, kw, per, x.stride(0), w.q.stride(0), w.scale.stride(0),
        y.stride(0), y.stride(0), GROUP=w.group, HAS_BIAS=True, ROWS=rows, BLOCK_N=block_n, TB=tb,
        REDUCE=1 if split > 1 else 0, ASM=True, **cfg), split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    w = random_weight(4096, 28672)
    x = torch.randn(1, 4096, device="cuda")
    y = torch.empty(1, 28672, device="cuda")
    if args.ncu:
        for _ in range(4):
            launch(x, w, y, {})
        torch.cuda.synchronize()
        return
    configs = {"default": {}, "tb1": dict(TB=1), "w2": dict(num_warps=2), "w8": dict(num_warps=8),
               "no-prefetch": dict(PREFETCH=False), "rows4": dict(ROWS=4)}
    for name, cfg in configs.items():
        xx = torch.randn(4, 4096, device="cuda") if name == "rows4" else x
        yy = torch.empty(xx.shape[0], 28672, device="cuda")
        k, split = launch(xx, w, yy, dict(cfg))
        ptx = k.asm.get("ptx", "")
        counts = {pat: len(re.findall(pat, ptx)) for pat in (r"ld\.global\.v4", r"ld\.global\.(?!v)", r"dp4a", r"bar\.sync",
                                                               r"shfl", r"st\.shared", r"ld\.shared", r"red\.|atom\.")}
        print(f"{name:12s} split={split:3d} regs={k.n_regs} spills={k.n_spills} smem={k.metadata.shared} "
              + " ".join(f"{p.split(chr(92))[0]}{'v4' if 'v4' in p else ''}:{c}" for p, c in counts.items()), flush=True)


if __name__ == "__main__":
    main()
