"""The CPU lowering of fuse_rows_attention's "rows_qkv_attention" (passes/fuse_rows_attention.py):
one decode step of R independent sequences (`ingot serve`), each row rotating its q and k at its own
position, writing its k/v row into its own caches and attending over its own prefix, as one kernel
call over all rows and heads instead of R plan steps.

The kernel is decode_attention.py's, which the batch-1 decode step runs too (backends/cpu/rope_cache.py),
and a row's result in it never depends on the other rows: so a row computes bit for bit what the
batch-1 decoder computes. Anything the kernel does not take (q, k, v not float32, caches of another
dtype or layout, a position outside the cache, a body of another form) runs the fused op's body
through the references.
"""
from __future__ import annotations

import math

import numpy as np

from ...ir import Node, Op
from ...ops import nn as nn_ops
from ...ops.fused import _fused_reference
from . import decode_attention, nn_kernels

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
    default_inv = nn_ops.rope_inv_freq(form["rd"], form["base"])
    form_inv, form_scale = form["inv"], form["scale"]
    interleaved, rd, causal, window, softcap = form["interleaved"], form["rd"], form["causal"], form["window"], form["softcap"]
    iq, ik, iv = where["q"], where["k"], where["v"]

    checked: list = [None, None]   # the caches last found fit (kept: their ids stay theirs), their ids

    def caches_fit(k, v, k_caches, v_caches) -> list | None:
        """The caches in the kernel's form (nn_kernels.kernel_cache), or None unless all are [1, hkv,
        context, hd] of one dtype, writeable and contiguous, and match k and v. A server passes the
        same slots' arrays step after step: those found fit last are not checked again (their
        identities, not their contents, are what is checked)."""
        ids = tuple(map(id, k_caches)) + tuple(map(id, v_caches))
        if ids == checked[1]:
            return checked[0]
        first, first_v = k_caches[0], v_caches[0]
        if not all(isinstance(c, np.ndarray) and c.dtype == first.dtype and c.ndim == 4 and c.flags.writeable
                   and c.flags.c_contiguous for c in k_caches + v_caches) \
                or nn_kernels.kernel_cache(first) is None \
                or not all(c.shape == first.shape for c in k_caches) \
                or not all(c.shape[:3] == first.shape[:3] and c.shape == first_v.shape for c in v_caches) \
                or first.shape[0] != 1 or k.shape[1:] != (first.shape[1], 1, first.shape[3]) \
                or v.shape[1:] != (first_v.shape[1], 1, first_v.shape[3]):
            return None
        taken = [nn_kernels.kernel_cache(c) for c in k_caches + v_caches]
        checked[:] = [taken, ids]
        return taken

    def step(*xs):
        q, k, v = xs[iq], xs[ik], xs[iv]
        k_caches = [xs[i] for i, _ in caches]
        v_caches = [xs[j] for _, j in caches]
        at = [int(xs[i]) for i in positions]
        lengths_now = [sum(int(xs[i]) for i in parts) for parts in lengths]
        context = k_caches[0].shape[2] if isinstance(k_caches[0], np.ndarray) and k_caches[0].ndim == 4 else 0
        kernel_caches = None
        if all(isinstance(y, np.ndarray) and y.dtype == np.float32 and y.ndim == 4 for y in (q, k, v)) \
                and q.shape[0] == rows and k.shape[0] == rows and v.shape[0] == rows and q.shape[2] == 1 \
                and k.shape[2] == 1 and min(at) >= 0 and max(at) < context and min(lengths_now) >= 0 \
                and max(lengths_now) <= context:
            kernel_caches = caches_fit(k, v, k_caches, v_caches)
        if kernel_caches is None:
            return _fused_reference(xs, node.attrs)
        q, k, v = (np.ascontiguousarray(y) for y in (q, k, v))
        if form_inv is not None:
            inv = np.ascontiguousarray(xs[inv_index], np.float32).reshape(-1)
        else:
            inv = default_inv
        scale = np.float32(form_scale if form_scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        result = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
        decode_attention.run(q, k, v, kernel_caches[:rows], kernel_caches[rows:], np.array(at, np.int64),
                             np.array(lengths_now, np.int64), inv, interleaved, rd, scale, causal, window, softcap, result,
                             nn_kernels.SPLIT["threads"])
        return (result,) + tuple(c for pair in zip(k_caches, v_caches) for c in pair)
    return step


FUSED_LOWERINGS = {"rows_qkv_attention": rows_attention_lowering}
