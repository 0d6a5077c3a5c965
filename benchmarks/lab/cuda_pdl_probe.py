"""Does programmatic dependent launch (PDL) shorten a chain of small dependent kernels in a CUDA graph?

Each kernel reads `w` (a weight block of its own, independent of the chain) and the previous kernel's
output vector, and writes the next: y = x + sum(w_tile) * 0 + 1, so the chain's result is exact.
Variants: plain launches, PDL with the wait at the top, PDL with the weight load before the wait.
Prints the replayed graph's time per kernel, median of 20 replays of N kernels.

    python benchmarks/lab/cuda_pdl_probe.py --kernels 200 --weight-kib 256
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _link(x_ptr, y_ptr, w_ptr, n, W_PER_PROG: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
          EARLY_W: tl.constexpr):
    pid = tl.program_id(0)
    offs_w = pid * W_PER_PROG + tl.arange(0, W_PER_PROG)
    if EARLY_W:
        w = tl.load(w_ptr + offs_w)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if not EARLY_W:
        w = tl.load(w_ptr + offs_w)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    ws = tl.sum(w.to(tl.float32), axis=0)
    y = x + 1.0 + tl.where(ws == 12345.678, 1.0, 0.0)
    if pid == 0:
        tl.store(y_ptr + offs, y, mask=offs < n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--weight-kib", type=int, nargs="+", default=[16, 1024])
    ap.add_argument("--programs", type=int, default=132)
    a = ap.parse_args()
    n = 1024
    for wkib in a.weight_kib:
        per = max(16, triton.next_power_of_2(wkib * 1024 // 2 // a.programs))
        ws = [torch.randn(a.programs * per, device="cuda", dtype=torch.float16) for _ in range(a.kernels)]
        bufs = [torch.zeros(n, device="cuda") for _ in range(2)]
        for name, gdc, early in (("plain", False, False), ("pdl", True, False), ("pdl-early-w", True, True)):
            def chain():
                bufs[0].zero_()
                for i in range(a.kernels):
                    _link[(a.programs,)](bufs[i % 2], bufs[(i + 1) % 2], ws[i], n, W_PER_PROG=per, BLOCK=n,
                                         USE_GDC=gdc, EARLY_W=early, launch_pdl=gdc, num_warps=4)
            chain()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain()
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=s):
                    chain()
            torch.cuda.current_stream().wait_stream(s)
            times = []
            for _ in range(20):
                bufs[a.kernels % 2].fill_(-1)
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                st.record(); g.replay(); en.record(); torch.cuda.synchronize()
                times.append(st.elapsed_time(en) * 1000 / a.kernels)
            ok = bool((bufs[a.kernels % 2] == a.kernels).all())
            print(f"pdl-probe weight {wkib} KiB x {a.kernels} kernels {name:12s} {statistics.median(times):6.2f} us/kernel "
                  f"correct={ok}", flush=True)


if __name__ == "__main__":
    main()
