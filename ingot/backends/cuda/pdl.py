"""Programmatic dependent launch (PDL, sm_90 and later): the next kernel starts while this one ends.

A kernel launched with `launch_pdl` may be scheduled before the kernel ahead of it on the stream has
finished; it runs `pdl_enter` first, which waits until that kernel has completed and its writes are
visible (`griddepcontrol.wait`), then lets the kernel behind it be scheduled in turn
(`griddepcontrol.launch_dependents`). What is saved is the launch and ramp-up between dependent
kernels: on the H200 (2026-12-03, `benchmarks/cuda_pdl_probe.py`, 200 dependent kernels replayed in
a CUDA graph) 1.35 -> 0.91 us a tiny kernel and 2.10 -> 1.68 us one reading 1 MiB. Every kernel of
the decode path (attention.py, fused.py, quantized_matmul.py and the generated regions; the audio
kernels of fft.py are launched plainly) calls `pdl_enter` before it reads or writes global memory, so
ordering is as without PDL (tests/test_cuda_pdl.py checks it from the source); a torch kernel between
two of ours never triggers early, so the stream is ordered there as usual. It is always on where the
device has it (off measured slower everywhere; scripts/sm90_compile_check.py compiles the kernels with
it for sm_90a without a GPU).

Nothing is loaded before the wait, the kernel ahead may still be writing it (a weight prepared by the
launch just before; the GEMV tests caught a first weight tile loaded early), with two exceptions. In a
captured CUDA graph the word GEMV loads its first weight tile before the wait (`EARLY_W`), as the
graph's weights are constants no kernel of the stream writes (H200, 2026-12-03: SmolLM2's step 533.5-534.3
us against 552.4-552.8, Llama-3-8B's 1996.6-2001.7 against 2078.4-2078.7). And the decode attention
with RoPE inside reads its length, position, RoPE table and first K/V tile before the wait when its
caller says no kernel ahead writes them (`attention(early=True)`: the executor's decode step, whose
caches only that launch writes; SmolLM2's step 495.9-496.5 us against 551.0, Llama-3-8B's 1916.1
against 1999.1). Once the kernel ahead has passed its own wait, every kernel before it has finished,
so only the kernel just ahead can still be writing. L2 prefetches before the
wait measured slower (2026-12-03, Llama-3-8B step 2271 us with 8 MiB of GEMV weights and a short
cache's first K/V tile prefetched, 2163 without; the GEMVs' kernel time 1532 against 1449 us, decode
attention's 382 against 329), so there are none. Nor is the next kernel held back: triggering later
(H200, 2026-12-04, Llama-3-8B step) after the decode attention's last loads took the attention from
7.84 to 6.69 us a layer and the o GEMV behind it from 2.67 to 3.58 (step 1805.1 us against 1799.0),
and at the end of the quantize launches 1818.1 (BENCHMARKS.md, twentieth session).

    kernel[grid](..., **pdl_args(x.device))
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_CAPABLE: dict[int, bool] = {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel ahead on the stream (all of it, its writes visible), then let the next start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel taking `PDL: tl.constexpr`: PDL on a CUDA device of compute
    capability 9 or later; none elsewhere (older GPUs, Triton's interpreter)."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _CAPABLE.get(index)
    if capable is None:
        capable = _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if capable else {}


__all__ = ["pdl_enter", "pdl_args"]
