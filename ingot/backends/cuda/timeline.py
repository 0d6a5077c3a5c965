"""When each program of a captured decode step's kernels started, was released and ended (a diagnostic).

The profiler sees one replayed CUDA graph as one event, and a kernel timed alone hides how it overlaps
its neighbours through programmatic dependent launch (pdl.py). With `CudaOptions(timeline="all")`, every word
GEMV, quantize and decode attention launch captured into a graph takes a slot of a device buffer, and
its programs store the global timer (ns) at four points, and their multiprocessor:

    0 start: the program is resident        1 released: past `pdl_enter`, the kernel ahead is done
    2 loop done: the weights are consumed   3 end: its last store issued        4 %smid

The times are held in registers and stored at the end. That still costs some kernels registers (ptxas
for sm_90a: the split-K word GEMV of 2 warps 130 a thread against 100, of 4 warps with XQ_RMS 129
against 96), so fewer of their programs fit a multiprocessor than without stamps. timeline="end" stamps only the end
(and the multiprocessor). On its own that still cost the 4-warp word GEMV with XQ_RMS (Llama-3-8B's
gate+up and lm_head) 142 registers against 96 (ptxas; any one store more did, wherever it stood), so
their programs, split for 96, ran in 1.5 waves (`cuda_timeline.py --detail`). The word GEMV's end-stamped
launches are therefore held to the registers of the same kernel without stamps (`maxnreg`, from
`_words_gemv`'s memo: 96, no spills), and then run as without stamps.

A replay rewrites the same slots; `benchmarks/cuda_timeline.py` reads them after one and prints, kernel
by kernel, when its programs started, were released and ended, relative to the kernel ahead.
Off (the default), the kernels compile without any of it.

    kernel[grid](..., **timeline.args("gemv 4096x6144", programs, device, options.timeline))
    ...
    t0 = now(STAMP)                          # in the kernel, at each point
    stamp(stamp_ptr, program, t0, t1, t2, STAMP)   # at the end; program its flat index
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = {"off": 0, "end": 1, "all": 2}   # `CudaOptions.timeline` -> STAMP: 2 every point, 1 the end only
POINTS = 5
CAPACITY = 1 << 22          # stamps (int64): 32 MiB, a Llama-3-8B step's ~230 stamped launches x ~600 programs
_buffers: dict = {}         # device -> int64 [CAPACITY]
records: list = []          # (name, offset, programs) per stamped launch, in capture order
_cursor = [0]


def args(name: str, programs: int, device, mode: str = "off") -> dict:
    """The kernel arguments for one launch: a slot of `programs` x POINTS stamps while a CUDA graph is
    captured with the timeline on (mode "end" or "all"), nothing otherwise (the kernel then compiles
    without stamps)."""
    if not MODES[mode] or not torch.cuda.is_available():
        return {}
    device = torch.device(device)
    buf = _buffers.get(device)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            return {}   # allocated outside a capture only: the first launches run eagerly first
        buf = _buffers[device] = torch.zeros(CAPACITY, dtype=torch.int64, device=device)
    if not torch.cuda.is_current_stream_capturing():
        return {}
    offset = _cursor[0]
    if offset + programs * POINTS > CAPACITY:
        return {}
    _cursor[0] += programs * POINTS
    records.append((name, offset, programs))
    return dict(stamp_ptr=buf[offset:], STAMP=MODES[mode])


def reset() -> None:
    """Forget the slots (a new capture takes them from the start)."""
    records.clear()
    _cursor[0] = 0


def read() -> list[dict]:
    """Each stamped launch: name and its programs' stamps, int64 [programs, POINTS] (ns; smid last)."""
    if not _buffers:
        return []
    (buf,) = _buffers.values()   # one device: the launches' slots are numbered across devices
    host = buf.cpu()
    return [dict(name=n, stamps=host[o: o + p * POINTS].view(p, POINTS).numpy()) for n, o, p in records]


@triton.jit
def now(STAMP: tl.constexpr):
    """The global timer (ns) when STAMP is 2 (every point), else 0 (nothing compiled)."""
    if STAMP == 2:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def stamp(ptr, program, t0, t1, t2, STAMP: tl.constexpr):
    """Store a program's stamps (STAMP 1 or 2): t0-t2 (from `now`: 0 at STAMP 1), the time now as the end,
    and its multiprocessor.
    The times are kept in registers until the end: a store between them cost the word GEMV ~30
    registers a thread (ptxas for sm_90a), and with them a program a multiprocessor."""
    if STAMP:
        t3 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        base = ptr + program * 5
        if STAMP == 2:   # the buffer's zeros stay at the others
            tl.store(base + 0, t0)
            tl.store(base + 1, t1)
            tl.store(base + 2, t2)
        tl.store(base + 3, t3)
        tl.store(base + 4, sm.to(tl.int64))
