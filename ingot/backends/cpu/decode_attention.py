"""Grouped decode attention: one compiled kernel for a decode step of R sequences (R >= 1), each row
at its own position over its own K/V cache: RoPE of its q and k, its k/v row written into its caches,
then its attention over the caches' first lengths[r] keys.

The work is cut into jobs of (row, kv head): a job rotates and writes that head's k/v row and
attends for the head's whole group of query heads (GQA), so each key and value row is read once per
group; softmax is online over blocks of BLOCK keys, all in float32. The jobs run on the GEMV team
(team.py) when the plan runs on several threads. A job's arithmetic never depends on R, on the other
rows or on who runs it, so a row's result is bit for bit the same alone (the batch-1 decode step,
backends/cpu/rope_cache.py) or among any others (the rows step of `ingot serve`,
backends/cpu/rows_attention.py): both call `decode_attention`.

    q [R, Hq, 1, D], k [R, Hk, 1, D], v [R, Hk, 1, Dv]; k_caches[r] [1, Hk, C, D], v_caches[r] [1, Hk, C, Dv]
    (float32, or bfloat16/float16 bits: nn_kernels.kernel_cache); positions, lengths [R] int64
    -> out [R, Hq, 1, Dv]; row r's k/v written at positions[r] of its caches

The caches go in as tuples of ROWS_PER_CALL arrays (padded with `padding(dtype)`): a tuple's length is
part of its numba type, so one compiled specialisation serves every row count.

RoPE's cos/sin come from a table per inverse frequencies (`rope_table`), computed as
nn_kernels.rope_write_attend computes them (float64 angle, rounded to float32).
"""
from __future__ import annotations

import math
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import team
from .block_params import F16C
from .nn_kernels import exp_negative, exp_shifted, put, widen

_serial = dict(fastmath=True, cache=True, nogil=True)
BLOCK = 128             # keys per online-softmax block (a block's scores stay in L1)
ROWS_PER_CALL = 8       # rows per kernel call (the caches' tuples)
CHUNKS_PER_THREAD = 4   # chunks of jobs per thread: rows differ in length, a late worker still finds some
PARALLEL_MIN_WORK = 1 << 11   # query heads x keys under which the team costs more than it saves
AHEAD = 16              # key rows fetched ahead: a server's caches come from memory, each (row, head) a
                        # stream of a few pages the hardware prefetcher barely ramps up on


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line of array[index] (1-D) ahead of its use (llvm.prefetch: never faults)."""
    def codegen(context, builder, sig, args):
        pointer = team._pointer(context, builder, sig.args[0], args[0], args[1])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(pointer, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(array, index), codegen


@njit(**_serial)
def decode_attention(q, k, v, k_caches, v_caches, positions, lengths, cos_table, sin_table, interleaved, rd, scale,
                     causal, window, softcap, out, j0, j1):
    """Jobs j0..j1 of the R x Hk (row r = j // Hk, kv head h = j % Hk): row r's k/v of head h rotated
    and written at positions[r] of k_caches[r] / v_caches[r], then the attention of its query heads
    h * G .. (h + 1) * G (rotated) over the first lengths[r] keys into out; causal with one query:
    every key below the length is seen, window > 0 the last `window` of them; softcap > 0:
    s -> softcap * tanh(s / softcap)."""
    hq, hk, d, dv = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    group = hq // hk
    half = rd // 2
    line = 64 // k_caches[0].itemsize   # elements per cache line
    qg = np.empty((group, d), np.float32)
    scores = np.empty((group, BLOCK), np.float32)
    acc = np.empty((group, dv), np.float32)
    best = np.empty(group, np.float32)
    total = np.empty(group, np.float32)
    for job in range(j0, j1):
        r = job // hk
        h = job % hk
        pos, length = positions[r], lengths[r]
        k_cache, v_cache = k_caches[r], v_caches[r]
        cos, sin = cos_table[pos], sin_table[pos]
        krow = k_cache[0, h, pos]
        vrow = v_cache[0, h, pos]
        for e in range(dv):
            put(vrow, e, v[r, h, 0, e])
        for j in range(half):
            c, s = cos[j], sin[j]
            if interleaved:
                x0, x1 = k[r, h, 0, 2 * j], k[r, h, 0, 2 * j + 1]
                put(krow, 2 * j, x0 * c - x1 * s)
                put(krow, 2 * j + 1, x1 * c + x0 * s)
            else:
                x0, x1 = k[r, h, 0, j], k[r, h, 0, j + half]
                put(krow, j, x0 * c - x1 * s)
                put(krow, j + half, x1 * c + x0 * s)
        for e in range(rd, d):
            put(krow, e, k[r, h, 0, e])
        for g in range(group):
            qh = h * group + g
            for j in range(half):
                c, s = cos[j], sin[j]
                if interleaved:
                    x0, x1 = q[r, qh, 0, 2 * j], q[r, qh, 0, 2 * j + 1]
                    qg[g, 2 * j] = x0 * c - x1 * s
                    qg[g, 2 * j + 1] = x1 * c + x0 * s
                else:
                    x0, x1 = q[r, qh, 0, j], q[r, qh, 0, j + half]
                    qg[g, j] = x0 * c - x1 * s
                    qg[g, j + half] = x1 * c + x0 * s
            for e in range(rd, d):
                qg[g, e] = q[r, qh, 0, e]
        first = max(0, length - window) if causal and window > 0 else 0
        acc[:] = 0.0
        best[:] = -np.inf
        total[:] = 0.0
        for b0 in range(first, length, BLOCK):
            n = min(BLOCK, length - b0)
            for i in range(n):
                ahead, later = k_cache[0, h, min(b0 + i + AHEAD, length - 1)], v_cache[0, h, b0 + i]
                for e in range(0, d, line):
                    prefetch(ahead, e)
                for e in range(0, dv, line):
                    prefetch(later, e)   # read after the block's scores
                key = k_cache[0, h, b0 + i]
                for g in range(group):
                    s = np.float32(0.0)
                    for e in range(d):
                        s += qg[g, e] * widen(key[e])
                    s *= scale
                    if softcap > 0:
                        s = np.float32(softcap * math.tanh(s / softcap))
                    scores[g, i] = s
            for g in range(group):
                row = scores[g]
                top = best[g]
                for i in range(n):
                    top = max(top, row[i])
                if top > best[g]:   # the running sums were taken against a smaller maximum: rescale
                    if best[g] > -np.inf:
                        alpha = exp_negative(best[g] - top)
                        total[g] *= alpha
                        for e in range(dv):
                            acc[g, e] *= alpha
                    best[g] = top
                total[g] += exp_shifted(row, 0, n, best[g])
            for i in range(n):
                value = v_cache[0, h, b0 + i]
                for g in range(group):
                    p = scores[g, i]
                    for e in range(dv):
                        acc[g, e] += p * widen(value[e])
        for g in range(group):
            qh = h * group + g
            inv = np.float32(1.0) / total[g] if length > first else np.float32(0.0)
            for e in range(dv):
                out[r, qh, 0, e] = acc[g, e] * inv


@njit(**_serial)
def decode_chunks(head, plan, outs, out, ctrl, gen, lead):
    """team.py's driver: chunks of jobs (plan [chunks, 2]: j0, j1) taken by whoever runs."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        decode_attention(*head, plan[c, 0], plan[c, 1])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


@njit(**_serial)
def _fill_rope_table(inv_freq, half, start, cos_table, sin_table):
    for p in range(start, cos_table.shape[0]):
        for j in range(half):
            angle = np.float64(p) * np.float64(inv_freq[j])
            cos_table[p, j] = math.cos(angle)
            sin_table[p, j] = math.sin(angle)


_tables: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray]] = {}
_tables_lock = threading.Lock()


def rope_table(inv_freq: np.ndarray, rd: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [>= positions, rd // 2] float32 of position p times inv_freq (float32 [>= rd // 2]),
    grown in powers of two as positions come (one table per inverse frequencies, shared by the layers)."""
    key = (inv_freq[:rd // 2].tobytes(), rd)
    table = _tables.get(key)
    if table is None or table[0].shape[0] < positions:
        with _tables_lock:
            table = _tables.get(key)
            size = 256 if table is None else table[0].shape[0]
            while size < positions:
                size *= 2
            if table is None or table[0].shape[0] < size:
                cos, sin = np.empty((size, max(1, rd // 2)), np.float32), np.empty((size, max(1, rd // 2)), np.float32)
                start = 0
                if table is not None:
                    start = table[0].shape[0]
                    cos[:start], sin[:start] = table
                _fill_rope_table(np.ascontiguousarray(inv_freq, np.float32), rd // 2, start, cos, sin)
                table = _tables[key] = (cos, sin)
    return table


_paddings: dict = {}


def padding(dtype) -> np.ndarray:
    """The unused entries of a caches tuple: a [1, 1, 1, 1] array of the caches' dtype."""
    p = _paddings.get(dtype)
    if p is None:
        p = _paddings[dtype] = np.zeros((1, 1, 1, 1), dtype)
    return p


_plans: dict[tuple[int, int], np.ndarray] = {}


def plan(jobs: int, threads: int) -> np.ndarray:
    """The team's chunks of `jobs` jobs: [chunks, 2] (j0, j1)."""
    hit = _plans.get((jobs, threads))
    if hit is None:
        parts = min(jobs, threads * CHUNKS_PER_THREAD)
        hit = _plans[(jobs, threads)] = np.array([(jobs * i // parts, jobs * (i + 1) // parts) for i in range(parts)],
                                                 np.int64)
    return hit


_dummy = np.zeros((1, 1), np.float32)


def run(q, k, v, k_caches: list, v_caches: list, positions: np.ndarray, lengths: np.ndarray, inv_freq: np.ndarray,
        interleaved: bool, rd: int, scale: np.float32, causal: bool, window: int, softcap: np.float32, out: np.ndarray,
        threads: int = 1) -> None:
    """decode_attention over all rows and heads, ROWS_PER_CALL rows a call, on `threads` threads (the
    team) when there is work enough. q, k, v contiguous float32 [R, H, 1, D]; the caches (kernel_cache
    form, one dtype, each [1, Hk, C, D], writeable and contiguous) and positions, lengths (int64 [R])
    checked by the caller: 0 <= positions[r] < C, 0 <= lengths[r] <= C."""
    rows, hk = q.shape[0], k.shape[1]
    cos, sin = rope_table(inv_freq, rd, int(positions.max()) + 1)
    pad = padding(k_caches[0].dtype)
    for g in range(0, rows, ROWS_PER_CALL):
        n = min(ROWS_PER_CALL, rows - g)
        more = (pad,) * (ROWS_PER_CALL - n)
        head = (q[g:g + n], k[g:g + n], v[g:g + n], tuple(k_caches[g:g + n]) + more, tuple(v_caches[g:g + n]) + more,
                positions[g:g + n], lengths[g:g + n], cos, sin, interleaved, rd, scale, causal, window, softcap,
                out[g:g + n])
        jobs = n * hk
        if threads <= 1 or jobs < 2 or q.shape[1] * int(lengths[g:g + n].sum()) < PARALLEL_MIN_WORK or \
                not team.team(threads).run(decode_chunks, (head, plan(jobs, threads), _dummy[None], _dummy)):
            decode_attention(*head, 0, jobs)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel and its team driver for float32, bfloat16 and
    float16 caches (kernels.warm_up calls this)."""
    f32 = lambda *shape: np.ones(shape, np.float32)   # noqa: E731
    cos, sin = rope_table(f32(4), 8, 4)
    for dtype in (np.float32, np.uint16) + ((np.int16,) if F16C else ()):
        caches = (np.ones((1, 1, 4, 8), dtype),) * ROWS_PER_CALL
        head = (f32(1, 2, 1, 8), f32(1, 1, 1, 8), f32(1, 1, 1, 8), caches, caches, np.zeros(1, np.int64),
                np.ones(1, np.int64), cos, sin, True, 8, np.float32(1), True, 0, np.float32(0), f32(1, 2, 1, 8))
        decode_attention(*head, 0, 1)
        ctrl = np.zeros(team.SLEEP + 8, np.int64)
        decode_chunks(head, plan(1, 1), _dummy[None], _dummy, ctrl, 1, -1)   # the lead alone: takes the one chunk
