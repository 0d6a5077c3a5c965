"""The CPU lowering of fuse_rows_attention's "rows_qkv_attention" (passes/fuse_rows_attention.py):
one decode step of R independent sequences (`ingot serve`), each row rotating its q and k at its own
position, writing its k/v row into its own caches and attending over its own prefix, as one kernel
call over all rows instead of R plan steps.

Each row runs nn_kernels.rope_write_attend on arrays of the batch-1 decode step's layout ([1, h, 1,
hd] row views, the row's own [1, hkv, context, hd] caches), so a row's result is bit for bit what the
batch-1 decoder computes. Rows are split over the GEMV team (team.py) in chunks when the plan runs
on several threads. Anything the kernel does not take (not float32, a position outside the cache,
a body of another form) runs the fused op's body through the references.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...ir import Node, Op
from ...ops import nn as nn_ops
from ...ops.fused import _fused_reference
from . import nn_kernels, team
from .nn_kernels import rope_write_attend

_serial = dict(fastmath=True, cache=True, nogil=True)
CHUNKS_PER_THREAD = 2   # chunks of rows per thread: a late worker still finds some
ROWS_PER_CALL = 8       # the caches go to the kernel as tuples of this many arrays (padded): one compiled
                        # specialisation for every row count (a tuple's length is part of its type)


@njit(**_serial)
def rows_rope_write_attend(q, k, v, k_caches, v_caches, positions, lengths, inv_freq, interleaved, rd, scale, causal,
                           window, softcap, q_out, out, r0, r1):
    """Rows r0..r1 of q [R, Hq, 1, D], k, v [R, Hk, 1, D] (R <= ROWS_PER_CALL): row r rotated at
    positions[r], its k/v written into k_caches[r] / v_caches[r] ([1, Hk, context, D] each; tuples of
    ROWS_PER_CALL, the rest unused) and its attention over their first lengths[r] rows into out[r]
    (rope_write_attend on row r's views)."""
    for r in range(r0, r1):
        rope_write_attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_caches[r], v_caches[r], positions[r], lengths[r],
                          inv_freq, interleaved, rd, scale, causal, window, softcap, True, q_out[r:r + 1],
                          out[r:r + 1])


@njit(**_serial)
def rows_chunks(head, plan, outs, out, ctrl, gen, lead):
    """team.py's driver: chunks of rows (plan [chunks, 2]: r0, r1) taken by whoever runs."""
    n = plan.shape[0]
    c = team.begin(ctrl, gen, lead, n)
    while c >= 0:
        rows_rope_write_attend(*head, plan[c, 0], plan[c, 1])
        c = team.after(ctrl, gen, n)
    return team.end(ctrl, lead, n, outs, out)


def _param(node: Node) -> int | None:
    return node.attrs["param"] if node.op == Op.PLACEHOLDER else None


def _rope_attention_form(body) -> dict | None:
    """Where a rope_qkv_attention body (passes/fuse_rope_cache.py) reads q, k, v, the caches, the
    position, the inverse frequencies and the length parts (its parameter indices), and its RoPE and
    attention settings; None for any other form (as backends/cpu/rope_cache.py reads it)."""
    updates, ropes, atts = body.find(Op.SLICE_UPDATE), body.find(Op.ROPE), body.find(Op.SDPA)
    ku = next((u for u in updates if u.src[1].op == Op.ROPE), None)
    vu = next((u for u in updates if u is not ku), None)
    if ku is None or vu is None or len(ropes) != 2 or len(atts) != 1:
        return None
    kr, att = ku.src[1], atts[0]
    qr = next(r for r in ropes if r is not kr)
    reads = [_param(x) for x in (qr.src[0], kr.src[0], vu.src[1], ku.src[0], vu.src[0], kr.src[1])]
    inv = _param(kr.src[2]) if len(kr.src) > 2 else None
    if None in reads or (len(kr.src) > 2 and inv is None) or (len(qr.src) > 2 and qr.src[2] is not kr.src[2]):
        return None
    a, sa = kr.attrs, att.attrs
    rd = a.get("rotary_dims") or kr.type.shape[-1]
    interleaved = bool(a.get("interleaved", False))
    if (qr.attrs.get("rotary_dims") or qr.type.shape[-1]) != rd or bool(qr.attrs.get("interleaved", False)) != interleaved \
            or sa.get("has_mask") or att.src[0] is not qr or not sa.get("has_length"):
        return None
    ln = att.src[-1]
    length = [_param(s) for s in ln.src] if ln.op == Op.ADD else [_param(ln)]
    if None in length:
        return None
    return dict(zip(("q", "k", "v", "k_cache", "v_cache", "pos"), reads), inv=inv, length=length, rd=rd,
                interleaved=interleaved, base=a.get("base", 10000.0), causal=bool(sa.get("causal")),
                window=int(sa.get("window", 0)), softcap=np.float32(sa.get("softcap", 0.0)), scale=sa.get("scale"))


def rows_attention_lowering(node: Node, out):
    """The step of a rows_qkv_attention fused op; None where its body is not the pass's form (the
    caller then runs the body through the references)."""
    body = node.attrs["body"]
    concat = body.outputs[0]
    if concat.op != Op.CONCAT or len(body.outputs) != 1 + 2 * len(concat.src):
        return None
    inner = [item.src[0] for item in concat.src]
    if any(item.op != Op.GET_ITEM or f.op != Op.FUSED or f.attrs["body"] != inner[0].attrs["body"]
           for item, f in zip(concat.src, inner)):
        return None
    form = _rope_attention_form(inner[0].attrs["body"])
    if form is None:
        return None
    rows = len(inner)

    def outer(f: Node, key: str, row: int | None = None) -> int | None:
        """The fused op's input that row f's `key` is: a parameter, or (row given) row `row` of one."""
        s = f.src[form[key]]
        if row is not None and s.op == Op.SLICE and s.type.shape[0] == 1 and s.attrs["start"][0] == row:
            s = s.src[0]
        return _param(s)

    where = {}
    for key in ("q", "k", "v"):
        found = {outer(f, key, r) for r, f in enumerate(inner)}
        if len(found) != 1 or None in found:
            return None
        where[key] = found.pop()
    caches = [(outer(f, "k_cache"), outer(f, "v_cache")) for f in inner]
    positions = [outer(f, "pos") for f in inner]
    lengths = [[_param(f.src[i]) for i in form["length"]] for f in inner]
    invs = {outer(f, "inv") if form["inv"] is not None else -1 for f in inner}
    if None in positions or any(None in c for c in caches) or any(None in parts for parts in lengths) or \
            len(invs) != 1 or None in invs:
        return None
    for r, f in enumerate(inner):   # the outputs: the concat, then each row's k and v cache
        k_item, v_item = body.outputs[1 + 2 * r], body.outputs[2 + 2 * r]
        if (k_item.op, v_item.op) != (Op.GET_ITEM, Op.GET_ITEM) or k_item.src[0] is not f or v_item.src[0] is not f \
                or (k_item.attrs["index"], v_item.attrs["index"]) != (1, 2):
            return None
    inv_index = invs.pop()
    default_inv = nn_ops.rope_inv_freq(form["rd"], form["base"]).view()
    default_inv.flags.writeable = False
    interleaved, rd, causal, window, softcap = form["interleaved"], form["rd"], form["causal"], form["window"], form["softcap"]
    iq, ik, iv = where["q"], where["k"], where["v"]
    dummy = np.zeros((1, 1), np.float32)

    checked: list = [None, None]   # the caches last found fit (kept: their ids stay theirs), their ids

    def caches_fit(q, k, v, k_caches, v_caches) -> bool:
        """The caches are float32 [1, hkv, context, hd], writeable and contiguous, and match q, k, v.
        A server passes the same slots' arrays step after step: those found fit last are not checked
        again (their identities, not their contents, are what is checked)."""
        ids = tuple(map(id, k_caches)) + tuple(map(id, v_caches))
        if ids == checked[1]:
            return True
        first, first_v = k_caches[0], v_caches[0]
        if not all(isinstance(c, np.ndarray) and c.dtype == np.float32 and c.ndim == 4 and c.flags.writeable
                   and c.flags.c_contiguous for c in k_caches + v_caches) \
                or not all(c.shape == first.shape for c in k_caches) \
                or not all(c.shape[:3] == first.shape[:3] and c.shape == first_v.shape for c in v_caches) \
                or first.shape[0] != 1 or k.shape[1:] != (first.shape[1], 1, first.shape[3]) \
                or v.shape[1:] != (first_v.shape[1], 1, first_v.shape[3]):
            return False
        checked[:] = [k_caches + v_caches, ids]
        return True

    def step(*xs):
        q, k, v = xs[iq], xs[ik], xs[iv]
        k_caches = [xs[i] for i, _ in caches]
        v_caches = [xs[j] for _, j in caches]
        at = [int(xs[i]) for i in positions]
        lengths_now = [sum(int(xs[i]) for i in parts) for parts in lengths]
        context = k_caches[0].shape[2] if isinstance(k_caches[0], np.ndarray) and k_caches[0].ndim == 4 else 0
        if not all(isinstance(y, np.ndarray) and y.dtype == np.float32 and y.ndim == 4 for y in (q, k, v)) \
                or q.shape[0] != rows or k.shape[0] != rows or v.shape[0] != rows or q.shape[2] != 1 or k.shape[2] != 1 \
                or not (min(at) >= 0 and max(at) < context and min(lengths_now) >= 0 and max(lengths_now) <= context) \
                or not caches_fit(q, k, v, k_caches, v_caches):
            return _fused_reference(xs, node.attrs)
        pos, length = np.array(at, np.int64), np.array(lengths_now, np.int64)
        q, k, v = (np.ascontiguousarray(y) for y in (q, k, v))
        if form["inv"] is not None:
            inv = np.ascontiguousarray(xs[inv_index], np.float32).reshape(-1).view()
            inv.flags.writeable = False
        else:
            inv = default_inv
        scale = np.float32(form["scale"] if form["scale"] is not None else 1.0 / math.sqrt(q.shape[-1]))
        q_out = np.empty(q.shape, np.float32)
        result = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
        threads = nn_kernels.SPLIT["threads"]
        for g in range(0, rows, ROWS_PER_CALL):
            n = min(ROWS_PER_CALL, rows - g)
            pad = [padding] * (ROWS_PER_CALL - n)
            head = (q[g:g + n], k[g:g + n], v[g:g + n], tuple(k_caches[g:g + n] + pad), tuple(v_caches[g:g + n] + pad),
                    pos[g:g + n], length[g:g + n], inv, interleaved, rd, scale, causal, window, softcap,
                    q_out[g:g + n], result[g:g + n])
            if threads <= 1 or n < 2 or not team.team(threads).run(rows_chunks, (head, plan(n, threads), dummy[None], dummy)):
                rows_rope_write_attend(*head, 0, n)
        return (result,) + tuple(c for pair in zip(k_caches, v_caches) for c in pair)
    return step


def plan(rows: int, threads: int) -> np.ndarray:
    """The team's chunks of `rows` rows: [chunks, 2] (r0, r1)."""
    hit = _plans.get((rows, threads))
    if hit is None:
        parts = min(rows, threads * CHUNKS_PER_THREAD)
        hit = _plans[(rows, threads)] = np.array([(rows * i // parts, rows * (i + 1) // parts) for i in range(parts)],
                                                 np.int64)
    return hit


_plans: dict[tuple[int, int], np.ndarray] = {}
padding = np.zeros((1, 1, 1, 1), np.float32)   # the unused entries of a cache tuple


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel and its team driver (kernels.warm_up calls this)."""
    f32 = lambda *shape: np.ones(shape, np.float32)   # noqa: E731
    inv = f32(4)
    inv.flags.writeable = False
    caches = (f32(1, 1, 4, 8),) * ROWS_PER_CALL
    head = (f32(1, 2, 1, 8), f32(1, 1, 1, 8), f32(1, 1, 1, 8), caches, caches, np.zeros(1, np.int64),
            np.ones(1, np.int64), inv, True, 8, np.float32(1), True, 0, np.float32(0), f32(1, 2, 1, 8), f32(1, 2, 1, 8))
    rows_rope_write_attend(*head, 0, 1)
    ctrl, out = np.zeros(team.SLEEP + 8, np.int64), f32(1, 1)
    rows_chunks(head, plan(1, 1), out[None], out, ctrl, 1, -1)   # the lead alone: takes the one chunk


FUSED_LOWERINGS = {"rows_qkv_attention": rows_attention_lowering}
