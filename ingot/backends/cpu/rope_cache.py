"""The CPU lowerings of fuse_rope_cache's fused ops (passes/fuse_rope_cache.py): RoPE of q and k, the
new k/v rows written into their caches in place, and (rope_qkv_attention) the attention over the
caches, as one step. The decode step of one sequence runs decode_attention.py's kernel (the one `ingot
serve`'s rows step runs); up to DECODE_MAX_ROWS queries one compiled kernel does it all; a longer
prefill rotates and writes with the RoPE kernel and attends with BLAS. The caches are float32, bfloat16
or float16 (rows rounded as written, widened as read; float16 where the CPU converts it in hardware),
or int8 codes with their row scales (each row quantized as written, `nn_kernels.store_row`).
Anything else (q, k, v not float32, rank other than 4, a position outside the cache) runs the fused
op's body through the references.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import IngotError
from ...ir import Node, Op
from ...ops import nn as nn_ops
from ...ops.fused import _fused_reference
from . import decode_attention, nn_kernels

DECODE_MAX_ROWS = 16   # queries up to which the compiled decode kernel attends (above: BLAS)


def _param(body_node: Node) -> int | None:
    return body_node.attrs["param"] if body_node.op == Op.PLACEHOLDER else None


def rope_cache_lowering(node: Node, out):
    """The step of a rope_qkv_attention or rope_qkv_write fused op; None where its body is not the
    pass's usual form (the caller then runs the body through the references)."""
    kind, body = node.attrs["kind"], node.attrs["body"]
    updates = body.find(Op.SLICE_UPDATE)
    ropes = body.find(Op.ROPE)
    # an int8 cache's writes: the codes (of quantize(rope(k)) and quantize(v)) and the row scales
    row_of = lambda u: u.src[1].src[0] if u.src[1].op == Op.QUANTIZE else u.src[1]   # noqa: E731
    ku = next((u for u in updates if row_of(u).op == Op.ROPE), None)
    vu = next((u for u in updates if u is not ku and u.src[1].op != Op.MAXIMUM), None)
    scale_updates = [u for u in updates if u.src[1].op == Op.MAXIMUM]
    if ku is None or vu is None or len(ropes) != 2 or len(scale_updates) not in (0, 2):
        return None
    kr = row_of(ku)
    qr = next(r for r in ropes if r is not kr)
    scale_reads = None
    if scale_updates:   # (the pass checked the chain: quantized_rows' scale and codes)
        ksu = next((u for u in scale_updates if u.src[1] is ku.src[1].src[1]), None)
        vsu = next((u for u in scale_updates if u is not ksu), None)
        if ksu is None or vu.src[1].op != Op.QUANTIZE or vsu.src[1] is not vu.src[1].src[1]:
            return None
        scale_reads = (_param(ksu.src[0]), _param(vsu.src[0]))
        if None in scale_reads:
            return None
    reads = [_param(x) for x in (qr.src[0], kr.src[0], row_of(vu), ku.src[0], vu.src[0], kr.src[1])]
    inv_i = _param(kr.src[2]) if len(kr.src) > 2 else None
    if None in reads or (len(kr.src) > 2 and inv_i is None) or (len(qr.src) > 2 and qr.src[2] is not kr.src[2]):
        return None
    iq, ik, iv, ikc, ivc, ipos = reads
    a = kr.attrs
    interleaved, base = bool(a.get("interleaved", False)), a.get("base", 10000.0)
    rd = a.get("rotary_dims") or kr.type.shape[-1]
    if (qr.attrs.get("rotary_dims") or qr.type.shape[-1]) != rd or bool(qr.attrs.get("interleaved", False)) != interleaved:
        return None
    attend = kind == "rope_qkv_attention"
    length_of = None
    if attend:
        att = body.find(Op.SDPA)[0]
        sa = att.attrs
        if sa.get("has_mask") or att.src[0] is not qr:
            return None
        causal, window, softcap = bool(sa.get("causal")), int(sa.get("window", 0)), np.float32(sa.get("softcap", 0.0))
        scale_attr = sa.get("scale")
        if sa.get("has_length"):
            ln = att.src[3]
            parts = [_param(s) for s in ln.src] if ln.op == Op.ADD else [_param(ln)]
            if None in parts:
                return None
            length_of = parts
    default_inv = nn_ops.rope_inv_freq(rd, base).view()
    body_only = lambda *xs: _fused_reference(xs, node.attrs)   # noqa: E731

    def step(*xs):
        q, k, v, kc, vc = xs[iq], xs[ik], xs[iv], xs[ikc], xs[ivc]
        pos = int(xs[ipos])
        t = k.shape[-2]
        scales = () if scale_reads is None else tuple(xs[i] for i in scale_reads)
        caches = (kc, vc) + scales   # returned as they are; the kernels take a bfloat16 cache as its bits
        if not all(isinstance(y, np.ndarray) and y.ndim == 4 for y in (q, k, v, kc, vc) + scales) \
                or not all(y.dtype == np.float32 for y in (q, k, v) + scales) or kc.dtype != vc.dtype \
                or (nn_kernels.kernel_cache(kc) is None if not scales else kc.dtype != np.int8) \
                or not all(y.flags.writeable and y.flags.c_contiguous for y in scales) \
                or not kc.flags.writeable or not vc.flags.writeable or not 0 <= pos <= kc.shape[2] - t \
                or q.shape[0] != k.shape[0] or k.shape[:2] != kc.shape[:2] or v.shape[:2] != vc.shape[:2]:
            return body_only(*xs)
        q, k, v = (np.ascontiguousarray(y) for y in (q, k, v))   # the layouts warm_up compiles for
        if not scales:
            kc, vc = nn_kernels.kernel_cache(kc), nn_kernels.kernel_cache(vc)
        inv = np.ascontiguousarray(xs[inv_i], np.float32).reshape(-1).view() if inv_i is not None else default_inv
        inv.flags.writeable = False
        length = kc.shape[2]
        if length_of is not None:
            length = sum(int(xs[i]) for i in length_of)
            if not 0 <= length <= kc.shape[2]:
                raise IngotError(f"sdpa: attention length {length} is outside 0..{kc.shape[2]} (the cache's positions).")
        scale = np.float32(scale_attr if attend and scale_attr is not None else 1.0 / math.sqrt(q.shape[-1]))
        if attend and not scales and q.shape[0] == 1 and t == 1 and q.shape[2] == 1 and 0 <= pos < length \
                and kc.flags.c_contiguous and vc.flags.c_contiguous:
            # the decode step: decode_attention.py's kernel, which `ingot serve`'s rows step runs too
            result = np.empty(q.shape[:3] + (vc.shape[3],), np.float32)
            decode_attention.run(q, k, v, [kc], [vc], np.array([pos], np.int64), np.array([length], np.int64), inv,
                                 interleaved, rd, scale, causal, window, softcap, result, nn_kernels.SPLIT["threads"])
            return (result, *caches)
        q_out = np.empty(q.shape, np.float32)
        if not attend or q.shape[2] <= DECODE_MAX_ROWS or length < q.shape[2]:
            result = np.empty(q.shape[:3] + (vc.shape[3],), np.float32) if attend else q_out
            nn_kernels.rope_write_attend(q, k, v, kc, vc, pos, length, inv, interleaved, rd, scale,
                                      causal if attend else False, window if attend else 0,
                                      softcap if attend else np.float32(0), attend, q_out, result, *scales)
            return (result, *caches)
        nn_kernels.rope_write_attend(q, k, v, kc, vc, pos, length, inv, interleaved, rd, scale, causal, window,
                                  softcap, False, q_out, q_out, *scales)
        return (nn_kernels.attention_blas(q_out, kc, vc, length, scale, causal, window, softcap, scales or None), *caches)
    return step


FUSED_LOWERINGS = {"rope_qkv_attention": rope_cache_lowering, "rope_qkv_write": rope_cache_lowering}
