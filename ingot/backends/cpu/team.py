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
  outputs); ctrl[CHUNKS] is the job's chunk count, ctrl[WAITED] how long the lead last waited.
- ctrl[SLEEP + 8 i] is 1 while worker i sleeps on its Event; the lead reads it after its chunks and
  the Python side sets the Event (a worker sets it before its last look at WORK: no wake-up is lost).
A worker takes its first chunk in `wait`, without the GIL, and only then reads the job's arrays in
Python (Team.job): the lead is inside its nogil driver waiting for that chunk, so the GIL is free,
and a job whose chunks the lead took alone costs the worker no GIL at all (taking the GIL for jobs
it could not help with made two threads 2x slower than one on a busy machine).

A driver per kernel (kernels.py, lut_kernels.py) wraps the chunk loop around it:
    c = begin(ctrl, gen, lead, n)      # lead: -1 for the calling thread, else the worker's chunk
    while c >= 0: kernel(..., *plan[c, :4], outs[plan[c, 4]]); c = after(ctrl, gen, n)
    return end(ctrl, lead, n, outs, out)
"""
from __future__ import annotations

import platform
import queue
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

WORK, DONE, WAITED, CHUNKS, HELPED, SLEEP = 0, 8, 16, 24, 32, 40
SPINS = 1 << 16      # pauses a worker spins before it sleeps (~1-2 ms)
STALL_SPINS = 1 << 17  # a lead that waited this long for a worker's chunk (~3 ms, a time slice): it was
                       # preempted (1 << 14 also caught page faults and interrupts on a quiet machine)
BACKOFF = 2000          # jobs then run by the caller alone before the team is tried again
MISSES = 256            # jobs in a row that no worker took a chunk of: the workers are not running
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
    """lead < 0: the lead publishes generation gen of n chunks and returns its first chunk (or -1);
    lead >= 0: a worker's chunk, already taken in `wait`."""
    if lead >= 0:
        return lead
    store(ctrl, DONE, 0)
    store(ctrl, CHUNKS, n)
    store(ctrl, WORK, gen << 32)
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
    if lead >= 0:
        return 0
    waited = 0
    while load(ctrl, DONE) < n:
        pause()
        waited += 1
    store(ctrl, WAITED, waited)
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
    """Spin until a generation after seen has a chunk left, take it and return gen << 32 | chunk;
    a generation whose chunks are all taken is passed over here, without the GIL. After SPINS
    pauses with nothing to take, mark this worker asleep and return -1 (unless work came meanwhile)."""
    slot = SLEEP + 8 * worker
    store(ctrl, slot, 0)
    for i in range(SPINS + 1):
        if i == SPINS:
            store(ctrl, slot, 1)
        v = load(ctrl, WORK)
        g = v >> 32
        if g > seen:
            c = v & 0xFFFFFFFF
            if c < load(ctrl, CHUNKS):
                if swap(ctrl, WORK, v, v + 1):
                    store(ctrl, slot, 0)
                    add(ctrl, HELPED, 1)
                    return v
                continue
            seen = g   # all taken: nothing for this worker in it
        pause()
    return -1


class Team:
    """The calling thread and `workers` spinning threads. run() is for one caller at a time: a
    second thread that finds the team busy runs its job alone."""

    def __init__(self, workers: int):
        self.ctrl = np.zeros(SLEEP + 8 * workers, np.int64)
        self.job = (0, None, None)   # (generation, driver, arguments before the ctrl array)
        self.gen = 0
        self.solo = 0     # jobs left to run alone (see run)
        self.misses = 0   # jobs in a row the workers took no part in
        self.busy = threading.Lock()
        self.events = [threading.Event() for _ in range(workers)]
        for i in range(workers):
            threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"ingot-team-{i}").start()

    def _loop(self, i: int) -> None:
        seen = 0
        while True:
            taken = wait(self.ctrl, seen, i)
            if taken < 0:
                self.events[i].wait()
                self.events[i].clear()
                continue
            # The lead set self.job before publishing and waits for this chunk: the job is this one.
            gen, driver, args = self.job
            driver(*args, self.ctrl, gen, taken & 0xFFFFFFFF)
            seen = gen

    def run(self, driver, args: tuple) -> bool:
        """driver(*args, ctrl, gen, lead) with the workers; False (nothing run: the caller runs the
        job alone) when another thread holds the team, or for BACKOFF jobs after the lead waited more
        than STALL_SPINS for a worker's chunk (a worker preempted mid-chunk stalls the lead) or after
        MISSES jobs in a row without a worker: on a busy machine the spinning worker only took CPU
        time from its own process (two threads decoded at 21-23 tok/s, one at 34-38, load 10); its
        spin then runs out and it sleeps."""
        if self.solo > 0:
            self.solo -= 1
            return False
        if not self.busy.acquire(blocking=False):
            return False
        try:
            self.gen += 1
            self.job = (self.gen, driver, args)
            helped = self.ctrl[HELPED]
            asleep = driver(*args, self.ctrl, self.gen, -1)
            if asleep:
                for event in self.events:
                    event.set()
            self.misses = 0 if self.ctrl[HELPED] != helped else self.misses + 1
            if self.ctrl[WAITED] > STALL_SPINS or self.misses >= MISSES:
                self.solo, self.misses = BACKOFF, 0
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


# --- Python parts over a team (a conv's channel parts) -------------------------------------------

_NO_OUTS, _NO_OUT = np.zeros((1, 1, 1), np.float32), np.zeros((1, 1), np.float32)


def _parts_driver(parts, errors, ctrl, gen, lead):
    """The team's driver for parts [(fn, args)]: each taker calls fn(*args) for the chunks it takes. The
    parts call nogil kernels, so the GIL passes between the lead and the workers as they enter them; a
    part's exception is kept for the lead (a worker's thread must not die with its chunk uncounted)."""
    n = len(parts)
    c = begin(ctrl, gen, lead, n)
    while c >= 0:
        fn, args = parts[c]
        try:
            fn(*args)
        except BaseException as e:   # re-raised by run_parts on the calling thread
            errors.append(e)
        c = after(ctrl, gen, n)
    return end(ctrl, lead, n, _NO_OUTS, _NO_OUT)


def run_parts(fn, argsets: list, threads: int) -> None:
    """fn(*args) for each of argsets on the spinning team of `threads` threads: consecutive jobs hand off
    in microseconds, where the blocking pool's queue and a sleeping thread's wake-up cost tens (a conv
    of 0.1-0.5 ms split in two gained little through it). The caller runs them all when the team is busy."""
    errors: list = []
    if not team(threads).run(_parts_driver, ([(fn, a) for a in argsets], errors)):
        _each(fn, argsets, errors)
    if errors:
        raise errors[0]


def _each(fn, argsets, errors: list) -> None:
    """fn(*args) for each of argsets on this thread, every one run even after one raises (kept in errors)."""
    for args in argsets:
        try:
            fn(*args)
        except BaseException as e:
            errors.append(e)


# --- GEMV kernels over a team -------------------------------------------------------------------

DRIVERS: dict = {}   # kernel -> (its team driver, whether it always splits along columns); each
                     # kernel module writes out and registers its own: numba caches module-level
                     # functions, while one driver taking the kernel as an argument compiled anew in
                     # every process (its cache key holds the dispatcher object)
PARALLEL_MIN_WEIGHTS = 3 << 18  # smaller GEMVs ran slower on two threads than on one (576 x 960: 35 -> 45 us)
CHUNKS_PER_THREAD = 2   # chunks a job is cut into per thread: a late worker still finds some
SPLIT_COLUMNS = 4096    # from this many output columns a job is cut along them, else along k


def split_blocks(kernel, head: tuple, n_blocks: int, out: np.ndarray, work: int, threads: int = 1) -> None:
    """kernel(*head, b0, b1, c0, c1, out) for all blocks and columns of out, on `threads` threads
    (`CpuOptions.threads`) by a team (team.py) taking chunks: ranges of columns written straight into
    out for wide outputs, else ranges of blocks (each streaming its own part of the weight) into
    partial outputs added at the end."""
    n = out.shape[1]
    driver, always_columns = DRIVERS[kernel]
    columns = n >= SPLIT_COLUMNS or always_columns
    if threads <= 1 or work < PARALLEL_MIN_WEIGHTS or (n_blocks < 2 and not columns):
        kernel(*head, 0, n_blocks, 0, n, out)
        return
    key = (n_blocks, n, threads, columns)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(n_blocks, n, threads, columns)
    outs = out[None] if columns else np.empty((plan.shape[0],) + out.shape, np.float32)
    if not team(threads).run(driver, (head, plan, outs, out)):
        kernel(*head, 0, n_blocks, 0, n, out)   # the team is busy with another thread's job


def _plan(n_blocks: int, n: int, threads: int, columns: bool) -> np.ndarray:
    """Chunks as rows (b0, b1, c0, c1, which partial output)."""
    if columns:
        parts = threads * CHUNKS_PER_THREAD
        width = -(-(-(-n // parts)) // 64) * 64   # ceil(n / parts) rounded up to 64 columns
        return np.array([(0, n_blocks, c, min(n, c + width), 0) for c in range(0, n, width)], np.int64)
    parts = min(threads * CHUNKS_PER_THREAD, n_blocks)
    return np.array([(n_blocks * i // parts, n_blocks * (i + 1) // parts, 0, n, i) for i in range(parts)], np.int64)


_plans: dict = {}


# --- a blocking pool for long parallel work (the prefill GEMM's columns, attention's rows) -------

class _Workers:
    """Threads that run nogil kernels on column chunks beside the calling thread. A hand-off costs
    a queue put and get (microseconds); numba's own prange scheduling cost more than it saved here."""

    def __init__(self, n: int):
        self.inbox = [queue.SimpleQueue() for _ in range(n)]
        self.outbox = [queue.SimpleQueue() for _ in range(n)]
        self.busy = threading.Lock()
        for i in range(n):
            threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"ingot-cpu-{i}").start()

    def _loop(self, i: int) -> None:
        while True:
            fn, args = self.inbox[i].get()
            try:
                fn(*args)
                self.outbox[i].put(None)
            except BaseException as e:  # handed back to the caller
                self.outbox[i].put(e)

    def run(self, fn, argsets) -> None:
        """fn(*argsets[0]) here, fn(*argsets[i]) on worker i-1; returns when all are done. A caller that
        finds the pool serving another thread runs all of argsets itself (two callers' hand-offs would
        interleave in the queues, and one would take the other's completions)."""
        if not self.busy.acquire(blocking=False):
            errors: list = []
            _each(fn, argsets, errors)
            if errors:
                raise errors[0]
            return
        try:
            for i, args in enumerate(argsets[1:]):
                self.inbox[i].put((fn, args))
            try:
                fn(*argsets[0])
                errors = [None]
            except BaseException as e:   # the workers' completions are still taken: the queues stay in step
                errors = [e]
            errors += [self.outbox[i].get() for i in range(len(argsets) - 1)]
        finally:
            self.busy.release()
        for e in errors:
            if e is not None:
                raise e


_workers: dict[int, _Workers] = {}   # by their number


def run_parallel(fn, argsets: list) -> None:
    """fn(*args) for each of argsets, the first here and the others on the pool's threads (nogil
    work: BLAS, NumPy, numba kernels)."""
    if len(argsets) - 1 not in _workers:
        _workers[len(argsets) - 1] = _Workers(len(argsets) - 1)
    _workers[len(argsets) - 1].run(fn, argsets)


