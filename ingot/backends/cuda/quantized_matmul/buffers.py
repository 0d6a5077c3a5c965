"""Per-device and per-stream scratch of the GEMV kernels, and the multiprocessor count."""
from __future__ import annotations

import torch

_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return _SMS[device]


def _overlaps(a: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a's bytes meet any of others' (each spanning its first to its last element)."""
    def span(t):
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    lo, hi = span(a)
    return any(o is not None and o.numel() and span(o)[0] < hi and lo < span(o)[1] for o in others)


_MM_OUT_DTYPE: dict[str, bool] = {}


def mm_out_dtype(device) -> bool:
    """Whether torch.mm(a16, b16, out_dtype=torch.float32) runs here (CUDA in recent torch; not the CPU)."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.zeros((2, 2), dtype=torch.bfloat16, device=device)
            _MM_OUT_DTYPE[key] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


_WORKSPACE: dict = {}


def _stream_key(device) -> tuple:
    return (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)


def _workspace(device, floats: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums and per-column tickets of the split-K GEMV, one pair per device and stream (kernels
    of one stream run in order; every launch leaves the tickets at zero). Sized generously at first
    use, which is an eager run, so a CUDA-graph capture never allocates."""
    key = _stream_key(device)
    have = _WORKSPACE.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < tickets:
        floats = max(floats, 1 << 22, have[0].numel() if have else 0)
        tickets = max(tickets, 1 << 16, have[1].numel() if have else 0)
        have = _WORKSPACE[key] = (torch.empty(floats, dtype=torch.float32, device=device),
                                  torch.zeros(tickets, dtype=torch.int32, device=device))
    return have


_XQ_WORKSPACE: dict = {}


def _xq_workspace(device, words: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-quantized x of the word GEMV (`_quantize_x_kernel`): limb words (int32) and per-block scale
    and sum (float32, 2 * blocks), one pair per device and stream (the quantize kernel and the GEMV that
    reads it run in order on that stream). Allocated at the first call, an eager run, and grown only
    when too small. A capture on a stream that has none yet (torch captures on a side stream) allocates
    it from the graph's pool, as `_workspace` does; the minimum size (4 MB of words: 4 rows of K up to
    80k in three limbs, or 16 column blocks' copies of 4 rows of K 16k in two, XQ_SELF) means it is not
    grown again for decode shapes, so no buffer a captured kernel reads is dropped."""
    key = _stream_key(device)
    have = _XQ_WORKSPACE.get(key)
    if have is None or have[0].numel() < words or have[1].numel() < 2 * blocks:
        words = max(words, 1 << 20, have[0].numel() if have else 0)
        floats = max(2 * blocks, 1 << 17, have[1].numel() if have else 0)
        have = _XQ_WORKSPACE[key] = (torch.empty(words, dtype=torch.int32, device=device),
                                     torch.empty(floats, dtype=torch.float32, device=device))
    return have


_DEQUANTIZED: dict = {}
_RETIRED: list = []     # outgrown copies, kept: a captured CUDA graph may still write them


def dequantized_workspace(device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Room for one weight dequantized for cuBLAS (`dispatch._dequantized_gemm`), per device, stream and
    dtype; allocated at the first (eager) run of a plan and grown when too small. An outgrown buffer is
    never freed, so a graph captured over it stays valid (at most twice the largest weight in all)."""
    key = (*_stream_key(device), dtype)
    have = _DEQUANTIZED.get(key)
    if have is None or have.numel() < numel:
        if have is not None:
            _RETIRED.append(have)
        have = _DEQUANTIZED[key] = torch.empty(numel, dtype=dtype, device=device)
    return have
