"""Can a latency-bound kernel pull the next GEMV's weights into L2 for it?

In a decode step the short-cache attention (and each quantize launch) keeps the HBM mostly idle for a
few microseconds, and the GEMV after it then streams its weights from HBM. Here a stand-in for such a
kernel (a few programs spinning for about `--spin-us`, launched with programmatic dependent launch as
the step's kernels are) runs ahead of a real word GEMV of a Llama-3-8B shape, and may spend extra
programs on bulk L2 prefetches (`cp.async.bulk.prefetch.L2.global`) of the GEMV's weight words,
scales and biases, issued at once (weights are constants: no kernel of the stream writes them).
Weights rotate over copies larger than L2, as in cuda_kernels.py. Medians of CUDA-graph replays, us:

- spin alone; the GEMV alone (cold: rotating; hot: the same copy every time, L2-resident);
- spin + GEMV with no prefetch, and with the first `frac` of the GEMV's bytes prefetched.

    python benchmarks/cuda_l2_probe.py [--shapes o,qkv,gate+up,down] [--spin-us 6]

H200, 2026-12-03 (fourteenth session; us, with x's quantize launch): the GEMVs from L2 take o 4.45 against
5.69 cold, qkv 5.38 / 7.16, down 8.85 / 11.93 (gate+up, 73 MB, does not fit). Prefetched by the spin
kernel they do not get there: spin + o 11.56 with half its bytes prefetched and 12.37 with all, against
11.81 without (down 20.30 / 22.56 against 17.97). The prefetches alone take 2.98 us for o's 10.5 MB
(HBM-bound), and 128 or 512 programs, or line prefetches instead of bulk ones, change little. Wired into
the Llama step (the decode attention prefetching o's weight, each quantize launch its GEMV's first MB),
the step took 1923.7 / 1988.1 / 2093.7 us with 4 / 8 / 16 MB against 1916.9 without; not kept.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from cuda_kernels import bench, copies_for, random_weight, rotating  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.pdl import pdl_args, pdl_enter  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate+up": (4096, 28672), "down": (14336, 4096)}
PREFETCH_PROGRAMS = 128   # one warp each: spread over the multiprocessors (one SM alone pulls ~100 GB/s at most)


@triton.jit
def _l2_prefetch(addr, nbytes, BULK: tl.constexpr):
    """One `cp.async.bulk.prefetch.L2` of nbytes from addr per thread (BULK), or a line prefetch of addr."""
    if BULK:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                                  [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l",
                                  [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, iters, spin_programs, a0, n0, a1, n1, a2, n2, CHUNK, THREADS: tl.constexpr,
                 BULK: tl.constexpr, PDL: tl.constexpr):
    """Programs below spin_programs: a dependent chain of iters multiply-adds after the wait (the
    stand-in for a latency-bound kernel). The others: bulk L2 prefetches of three byte ranges
    (a_i, n_i: 16-byte aligned, n_i a multiple of 16), CHUNK bytes a thread, before any wait."""
    pid = tl.program_id(0)
    if pid >= spin_programs:
        c = (pid - spin_programs) * THREADS + tl.arange(0, THREADS)         # this thread's chunk index
        c0 = tl.cdiv(n0, CHUNK)
        c1 = tl.cdiv(n1, CHUNK)
        in0 = c < c0
        in1 = (c >= c0) & (c < c0 + c1)
        in2 = c >= c0 + c1
        start = tl.where(in0, c, tl.where(in1, c - c0, c - c0 - c1)).to(tl.int64) * CHUNK
        base = tl.where(in0, a0, tl.where(in1, a1, a2))
        total = tl.where(in0, n0, tl.where(in1, n1, n2)).to(tl.int64)
        size = tl.minimum(total - start, CHUNK)
        ok = size > 0
        if BULK:
            _l2_prefetch(tl.where(ok, base + start, a0), tl.where(ok, size, 16).to(tl.int32), True)
        else:
            for j in range(0, CHUNK, 128):   # CHUNK a multiple of 128 here
                _l2_prefetch(tl.where(ok & (j < size), base + start + j, a0), 0, False)
        return
    pdl_enter(PDL)
    x = pid.to(tl.float32) + 1.0
    for _ in range(iters):
        x = x * 1.0000001 + 1e-7
    tl.store(out_ptr + pid, x)


def spin(out, iters, programs, parts=(), bulk=True, extra=PREFETCH_PROGRAMS, threads=32):
    """The stand-in kernel; with parts, `extra` programs of `threads` threads prefetch them."""
    parts = list(parts) + [(out, 0)] * (3 - len(parts))
    total = sum(n for _, n in parts)
    chunk = max(128, triton.cdiv(triton.cdiv(total, extra * threads), 128) * 128) if total else 128
    extra = sum(triton.cdiv(n, chunk) for _, n in parts)
    extra = triton.cdiv(extra, threads) if total else 0
    args = []
    for t, n in parts:
        args += [t.data_ptr(), n]
    _spin_kernel[(programs + extra,)](out, iters, programs, *args, chunk, THREADS=threads, BULK=bulk,
                                      num_warps=max(1, threads // 32), **pdl_args(out.device))


def weight_parts(w: qmm.QuantizedWeight, frac: float):
    """The first frac of each of the weight's tensors (words, scales, biases), as (tensor, bytes)."""
    out = []
    for t in (w.q, w.scale, w.bias):
        if t is None:
            continue
        n = t.numel() * t.element_size()
        out.append((t, max(16, int(n * frac) // 16 * 16)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="o,qkv,gate+up,down")
    ap.add_argument("--spin-us", type=float, default=6.0)
    ap.add_argument("--fracs", default="0.5,1.0")
    a = ap.parse_args()
    dev = torch.device("cuda")
    out = torch.zeros(4096, device=dev)
    programs = 16
    # calibrate the spin to about --spin-us
    iters = 2000
    t = bench(lambda: spin(out, iters, programs)) * 1e3
    iters = max(1, int(iters * a.spin_us / t))
    t_spin = bench(lambda: spin(out, iters, programs)) * 1e3
    print(f"l2-probe spin {iters} iters: {t_spin:.2f} us", flush=True)
    for name in a.shapes.split(","):
        k, n = SHAPES[name]
        ws = [random_weight(k, n, seed=i) for i in range(copies_for(random_weight(k, n).nbytes))]
        x = torch.randn(1, k, device=dev)
        mb = ws[0].nbytes / 1e6
        cold = bench(rotating([lambda w=w: qmm.quantized_matmul(x, w) for w in ws])) * 1e3
        hot = bench(lambda: qmm.quantized_matmul(x, ws[0])) * 1e3
        both = bench(rotating([lambda w=w: (spin(out, iters, programs), qmm.quantized_matmul(x, w)) for w in ws])) * 1e3
        line = (f"l2-probe {name:8s} {mb:6.1f} MB  gemv cold {cold:6.2f} hot {hot:6.2f} | spin+gemv {both:6.2f} "
                f"(sum {t_spin + cold:6.2f})")
        for frac in (float(f) for f in a.fracs.split(",")):
            for bulk, extra in ((True, 128), (True, 512), (False, 128)):
                if not bulk and frac < 1.0:
                    continue
                t_pf = bench(rotating([lambda w=w: (spin(out, iters, programs, weight_parts(w, frac), bulk, extra),
                                                    qmm.quantized_matmul(x, w)) for w in ws])) * 1e3
                line += f" | pf{'' if bulk else '-line'} {frac:.2f} x{extra}: {t_pf:6.2f}"
        # the spin with prefetches alone, to see what issuing them costs the kernel itself
        t_spin_pf = bench(rotating([lambda w=w: spin(out, iters, programs, weight_parts(w, 1.0)) for w in ws])) * 1e3
        t_pf_only = bench(rotating([lambda w=w: spin(out, 1, programs, weight_parts(w, 1.0)) for w in ws])) * 1e3
        print(line + f" | spin+pf alone {t_spin_pf:6.2f}, pf alone {t_pf_only:6.2f}", flush=True)
        # correctness: the GEMV's result does not depend on the prefetch
        y0 = qmm.quantized_matmul(x, ws[0]).clone()
        spin(out, iters, programs, weight_parts(ws[0], 1.0))
        y1 = qmm.quantized_matmul(x, ws[0])
        torch.cuda.synchronize()
        assert torch.equal(y0, y1) or torch.allclose(y0, y1, rtol=1e-5, atol=1e-5)
        del ws


if __name__ == "__main__":
    main()
