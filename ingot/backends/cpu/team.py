"""A team of CPU threads for kernels of tens of microseconds: the decode step's GEMVs.

Handing work to a sleeping thread costs a wake-up (15-50 us in a VM), as long as a 576-wide GEMV
takes, so the queue pool (kernels._Workers) made two threads slower than one. OpenMP's spinning
teams hand off in ~2 us but wait at a barrier for every member: when a busy neighbour holds a core,
a 15 us GEMV took 1 ms. Here the workers spin (a bounded while, then sleep) on a shared counter, and
the calling thread takes chunks of the work too: whoever is running takes the next chunk, so a
worker that is not scheduled costs nothing but its own unfinished chunk.

Protocol, over one int64 array `ctrl` (slots a cache line apart):
- ctrl[WORK] = generation << 32 | next chunk. The lead publishes a job by storing (gen << 32)
  after its DONE count is reset; anyone takes chunk c by compare-and-swap of c -> c + 1 within the
  same generation, so a late worker can never take a chunk of a later job.
- ctrl[DONE] counts finished chunks; the lead returns when all are done (then it adds the partial
  outputs).
- ctrl[SLEEP + 8 i] is 1 while worker i sleeps on its Event; the lead reads it after publishing and
  the Python side sets the Event (a worker sets it before re-checking WORK, so no wake-up is lost).
The job's arrays are handed over in Python (Team.job), read by a worker while the lead is inside
its nogil driver, so the GIL is free when a worker needs it.

A driver per kernel (kernels.py, lut_kernels.py) wraps the chunk loop around it:
    c = begin(ctrl, gen, lead, n)
    while c >= 0: kernel(..., *plan[c, :4], outs[plan[c, 4]]); c = after(ctrl, gen, n)
    return end(ctrl, lead, n, outs, out)
"""
from __future__ import annotations

import platform
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

WORK, DONE, SLEEP = 0, 8, 16
SPINS = 1 << 16      # pauses a worker spins before it sleeps (~1-2 ms)
WAIT_SPINS = 1 << 12  # pauses a worker waits for a generation that Team.job already holds
GENERATIONS = 1 << 31  # a team serves this many jobs, then a new one takes over (WORK's high half)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")


def _pointer(context, builder, array_type, array, index):
    a = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, a, [index])


@intrinsic
def load(typingctx, array, index):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_pointer(context, builder, sig.args[0], *args), "seq_cst", 8)
    return types.int64(array, index), codegen


@intrinsic
def store(typingctx, array, index, value):
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _pointer(context, builder, sig.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(array, index, types.int64), codegen


@intrinsic
def add(typingctx, array, index, value):
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _pointer(context, builder, sig.args[0], args[0], args[1]), args[2], "seq_cst")
    return types.int64(array, index, types.int64), codegen


@intrinsic
def swap(typingctx, array, index, old, new):
    """Compare-and-swap: 1 when array[index] was old and is now new, else 0."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_pointer(context, builder, sig.args[0], args[0], args[1]), args[2], args[3],
                               "seq_cst", "seq_cst")
        return builder.zext(builder.extract_value(pair, 1), ir.IntType(64))
    return types.int64(array, index, types.int64, types.int64), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 PAUSE); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


_opts = dict(nogil=True, cache=True)


@njit(inline="always", **_opts)
def take(ctrl, gen, n):
    """The next chunk of generation gen (of n), or -1 when there is none left (or gen is over)."""
    while True:
        v = load(ctrl, WORK)
        c = v & 0xFFFFFFFF
        if (v >> 32) != gen or c >= n:
            return -1
        if swap(ctrl, WORK, v, v + 1):
            return c


@njit(inline="always", **_opts)
def begin(ctrl, gen, lead, n):
    """The lead publishes generation gen; a worker waits (briefly) until it is published. Returns
    the caller's first chunk, or -1."""
    if lead:
        store(ctrl, DONE, 0)
        store(ctrl, WORK, gen << 32)
    else:
        for _ in range(WAIT_SPINS):
            if (load(ctrl, WORK) >> 32) >= gen:
                break
            pause()
    return take(ctrl, gen, n)


@njit(inline="always", **_opts)
def after(ctrl, gen, n):
    """Count the chunk just finished as done; the next one, or -1."""
    add(ctrl, DONE, 1)
    return take(ctrl, gen, n)


@njit(inline="always", **_opts)
def end(ctrl, lead, n, outs, out):
    """The lead waits for every chunk, writes the sum of the partial outputs outs [P, M, N] into
    out [M, N] when P > 1 (P = 1: the chunks wrote out itself) and returns how many workers were
    asleep (the caller wakes them); a worker returns 0."""
    if not lead:
        return 0
    while load(ctrl, DONE) < n:
        pause()
    if outs.shape[0] > 1:
        for m in range(out.shape[0]):
            for i in range(out.shape[1]):
                total = outs[0, m, i]
                for c in range(1, outs.shape[0]):
                    total += outs[c, m, i]
                out[m, i] = total
    asleep = 0
    for i in range((ctrl.shape[0] - SLEEP) // 8):
        asleep += load(ctrl, SLEEP + 8 * i)
    return asleep


@njit(**_opts)
def wait(ctrl, seen, worker):
    """Spin until a generation after seen is published and return it; after SPINS pauses, mark
    this worker asleep and return -1 (unless one came meanwhile)."""
    slot = SLEEP + 8 * worker
    store(ctrl, slot, 0)
    for _ in range(SPINS):
        g = load(ctrl, WORK) >> 32
        if g > seen:
            return g
        pause()
    store(ctrl, slot, 1)
    g = load(ctrl, WORK) >> 32
    if g > seen:
        store(ctrl, slot, 0)
        return g
    return -1


class Team:
    """The calling thread and `workers` spinning threads. run() is for one caller at a time: a
    second thread that finds the team busy runs its job alone."""

    def __init__(self, workers: int):
        self.ctrl = np.zeros(SLEEP + 8 * workers, np.int64)
        self.job = (0, None, None)   # (generation, driver, arguments before the ctrl array)
        self.gen = 0
        self.busy = threading.Lock()
        self.events = [threading.Event() for _ in range(workers)]
        for i in range(workers):
            threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"ingot-team-{i}").start()

    def _loop(self, i: int) -> None:
        seen = 0
        while True:
            g = wait(self.ctrl, seen, i)
            if g < 0:
                self.events[i].wait()
                self.events[i].clear()
                continue
            gen, driver, args = self.job
            if gen >= g and driver is not None:
                try:
                    driver(*args, self.ctrl, gen, False)
                except BaseException:   # a worker's chunk failing leaves it to the lead: see run
                    pass
            seen = max(g, gen)

    def run(self, driver, args: tuple) -> bool:
        """driver(*args, ctrl, gen, lead) with the workers; False (nothing run) when another thread
        holds the team."""
        if not self.busy.acquire(blocking=False):
            return False
        try:
            self.gen += 1
            self.job = (self.gen, driver, args)
            asleep = driver(*args, self.ctrl, self.gen, True)
            if asleep:
                for event in self.events:
                    event.set()
            return True
        finally:
            self.busy.release()


_teams: dict[int, Team] = {}
_made = threading.Lock()


def team(threads: int) -> Team:
    """The shared team of `threads` threads (the caller and threads - 1 workers)."""
    t = _teams.get(threads)
    if t is None or t.gen >= GENERATIONS - 1:
        with _made:
            t = _teams.get(threads)
            if t is None or t.gen >= GENERATIONS - 1:   # the old team's workers fall asleep for good
                t = _teams[threads] = Team(threads - 1)
    return t
