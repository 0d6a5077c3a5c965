"""ONNX converters for attention: the Attention op (opset 23+), com.microsoft Attention, RotaryEmbedding.
Hand-written attention needs no converter: the compiler's fuse_attention pass finds it."""
from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from .onnx_ops import Context, OnnxNode, converter, need_float, scalar


@converter("Attention")
def _attention(ctx: Context, node: OnnxNode):
    """ONNX Attention (opset 23+) as Ingot's SDPA where it can be (no softcap, no QK output), else
    written out (matmul, softcap, bias, softmax, matmul). Causal, sliding-window and padding masks
    are constants built here; a KV cache (past -> present) is a concat."""
    q, k, v = node.inputs[:3]
    mask, past_k, past_v = node.input(3), node.input(4), node.input(5)
    nonpad = node.input(6)
    g = ctx.g
    need_float(ctx, node, q)
    three_d = q.ndim == 3
    if three_d:  # [B, T, H*D] -> [B, H, T, D]
        hq, hk = node.attr("q_num_heads"), node.attr("kv_num_heads")
        if not hq or not hk:
            raise IngotError("3-D inputs without q_num_heads and kv_num_heads")
        split = lambda t, h: g.transpose(g.reshape(t, (t.shape[0], t.shape[1], h, t.shape[2] // h)), (0, 2, 1, 3))  # noqa: E731
        q, k, v = split(q, hq), split(k, hk), split(v, hk)
    if past_k is not None:
        k, v = g.concat([past_k, k], axis=2), g.concat([past_v, v], axis=2)
    tq, tk = q.shape[2], k.shape[2]
    # the constant part of the bias: causal and sliding-window frontiers, padded keys
    allowed = np.ones((1, 1, tq, tk), bool)
    if nonpad is not None and past_k is None:
        lengths = np.asarray(ctx.constant(node, 6, "nonpad_kv_seqlen")).reshape(-1).astype(np.int64)
        offset = (lengths - tq).reshape(-1, 1, 1, 1)
        allowed = allowed & (np.arange(tk).reshape(1, 1, 1, tk) < lengths.reshape(-1, 1, 1, 1))
    else:
        offset = np.array(past_k.shape[2] if past_k is not None else 0).reshape(1, 1, 1, 1)
    diff = np.arange(tq).reshape(1, 1, tq, 1) + offset - np.arange(tk).reshape(1, 1, 1, tk)  # query position - key
    if node.attr("is_causal", 0):
        allowed = allowed & (diff >= 0)
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left is not None and left >= 0:
        allowed = allowed & (diff <= left)
    if right is not None and right >= 0:
        allowed = allowed & (-diff <= right)
    bias = None
    if mask is not None:
        if mask.shape[-1] < tk:  # a mask shorter than the keys: the rest is masked
            pads = [(0, 0)] * (mask.ndim - 1) + [(0, tk - mask.shape[-1])]
            mask = g.pad(g.cast(mask, dt.int32), pads) if mask.dtype == dt.bool_ else g.pad(mask, pads, value=-np.inf)
            mask = g.cast(mask, dt.bool_) if mask.dtype == dt.int32 else mask
        if mask.dtype == dt.bool_:
            mask = g.where(mask, scalar(ctx, 0, q), scalar(ctx, -np.inf, q))
        elif mask.dtype != q.dtype:
            mask = g.cast(mask, q.dtype)
        bias = mask
    if not allowed.all():
        constant = g.constant(np.where(allowed, 0, -np.inf).astype(q.dtype.numpy))
        bias = constant if bias is None else bias + constant
    scale = node.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    softcap = node.attr("softcap", 0.0) or 0.0
    mode = node.attr("qk_matmul_output_mode", 0)
    wants_qk = len(node.outputs) > 3 and bool(node.outputs[3])
    if softcap <= 0 and not wants_qk:
        y = g.scaled_dot_product_attention(q, k, v, mask=bias, scale=scale)
        qk = None
    else:
        y, qk = _attention_written_out(ctx, q, k, v, bias, scale, softcap, mode)
    if three_d:
        y = g.reshape(g.transpose(y, (0, 2, 1, 3)), (y.shape[0], y.shape[2], y.shape[1] * y.shape[3]))
    return [y, k, v] + ([qk] if wants_qk else [])


def _attention_written_out(ctx: Context, q, k, v, bias, scale, softcap, mode):
    g = ctx.g
    b, hq = q.shape[:2]
    hk = k.shape[1]
    if hq != hk:  # each K/V head serves a group of query heads
        grow = lambda t: g.reshape(g.broadcast_to(g.reshape(t, (b, hk, 1) + tuple(t.shape[2:])),  # noqa: E731
                                                  (b, hk, hq // hk) + tuple(t.shape[2:])), (b, hq) + tuple(t.shape[2:]))
        k, v = grow(k), grow(v)
    root = scalar(ctx, math.sqrt(scale), q)
    scores = g.matmul(q * root, g.swapaxes(k, -1, -2) * root)
    if softcap > 0:
        c = scalar(ctx, softcap, scores)
        scores = g.tanh(scores / c) * c
    with_bias = scores if bias is None else scores + bias
    qk = with_bias if mode == 2 else scores
    dead = None
    if bias is not None:  # rows whose bias masks every key give zeros, not NaN
        dead = g.equal(g.max(g.broadcast_to(bias, tuple(with_bias.shape)) if bias.ndim < 4 or bias.shape != with_bias.shape
                             else bias, (3,), keepdims=True), scalar(ctx, -np.inf, q))
        with_bias = g.where(dead, scalar(ctx, 0, q), with_bias)
    probs = g.softmax(with_bias, axis=-1)
    if dead is not None:
        probs = g.where(dead, scalar(ctx, 0, q), probs)
    if mode == 3:
        qk = probs
    return g.matmul(probs, v), qk


@converter("Attention", domain="com.microsoft")
def _ms_attention(ctx: Context, node: OnnxNode):
    """com.microsoft Attention (onnxruntime's fused BERT attention): the QKV projection, then SDPA
    with the padding mask (raw [B, T] / [B, S, T] or lengths [B]) as mask_filter_value where masked."""
    x, weights, bias, mask_index = node.input(0), node.input(1), node.input(2), node.input(3)
    g = ctx.g
    if node.input(4) is not None or (len(node.outputs) > 1 and node.outputs[1]) or node.input(6) is not None:
        raise ctx.fail(node, "a KV cache (past/present)")
    if node.attr("do_rotary", 0):
        raise ctx.fail(node, "do_rotary")
    need_float(ctx, node, x)
    heads = node.attr("num_heads")
    sizes = list(node.attr("qkv_hidden_sizes", []) or [weights.shape[1] // 3] * 3)
    b, s, _ = x.shape
    qkv = g.matmul(x, weights)
    if bias is not None:
        qkv = qkv + bias
    q, k, v = g.split(qkv, sizes, axis=2)
    heads_of = lambda t: g.transpose(g.reshape(t, (b, s, heads, t.shape[2] // heads)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = heads_of(q), heads_of(k), heads_of(v)
    filter_value = node.attr("mask_filter_value", -10000.0)
    masked, keep = scalar(ctx, filter_value, q), scalar(ctx, 0, q)
    mask = None
    if mask_index is not None:
        if mask_index.ndim == 2 and mask_index.shape == (b, s):       # raw: 1 attend, 0 masked
            mask = g.reshape(g.where(g.equal(mask_index, scalar(ctx, 0, mask_index)), masked, keep), (b, 1, 1, s))
        elif mask_index.ndim == 3:                                      # [B, S, T]
            mask = g.reshape(g.where(g.equal(mask_index, scalar(ctx, 0, mask_index)), masked, keep), (b, 1, s, s))
        elif mask_index.ndim == 1 and mask_index.shape[0] == b:         # right padding: valid lengths
            lengths = g.reshape(mask_index, (b, 1))
            inside = g.less(g.constant(np.arange(s, dtype=mask_index.dtype.numpy)), lengths)
            mask = g.reshape(g.where(inside, keep, masked), (b, 1, 1, s))
        else:
            raise ctx.fail(node, f"a mask_index of shape {list(mask_index.shape)}")
    if node.attr("unidirectional", 0):
        causal = g.constant(np.where(np.tril(np.ones((s, s), bool)), 0.0, filter_value).astype(q.dtype.numpy))
        mask = causal if mask is None else mask + causal
    if node.input(5) is not None:
        mask = node.input(5) if mask is None else mask + node.input(5)
    y = g.scaled_dot_product_attention(q, k, v, mask=mask, scale=node.attr("scale"))
    return [g.reshape(g.transpose(y, (0, 2, 1, 3)), (b, s, y.shape[1] * y.shape[3]))]


@converter("RotaryEmbedding")
def _rotary_embedding(ctx: Context, node: OnnxNode):
    """ONNX RotaryEmbedding (opset 23) with its cos/sin caches: the rotation written out (the caches
    are the model's own, so Ingot's rope op, which makes its own, is not used)."""
    x, cos, sin, positions = node.input(0), node.input(1), node.input(2), node.input(3)
    g = ctx.g
    need_float(ctx, node, x)
    four_d = x.ndim == 4
    if four_d:  # [B, H, S, D] -> [B, S, H, D]
        y = g.transpose(x, (0, 2, 1, 3))
    else:
        heads = node.attr("num_heads", 0)
        if not heads:
            raise IngotError("3-D input without num_heads")
        y = g.reshape(x, (x.shape[0], x.shape[1], heads, x.shape[2] // heads))
    head = y.shape[3]
    rd = node.attr("rotary_embedding_dim", 0) or head
    if positions is not None:
        cos, sin = g.gather(cos, positions, axis=0), g.gather(sin, positions, axis=0)   # [B, S, rd/2]
    shape = tuple(cos.shape[:-1]) + (1, rd // 2)
    cos, sin = g.reshape(cos, shape), g.reshape(sin, shape)
    rotate = y if rd == head else g.slice(y, [0, 0, 0, 0], [None, None, None, rd])
    if node.attr("interleaved", 0):
        x1 = g.slice(rotate, [0, 0, 0, 0], [None] * 4, [1, 1, 1, 2])
        x2 = g.slice(rotate, [0, 0, 0, 1], [None] * 4, [1, 1, 1, 2])
    else:
        x1, x2 = g.split(rotate, 2, axis=3)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if node.attr("interleaved", 0):
        pair = tuple(real.shape) + (1,)
        rotated = g.reshape(g.concat([g.reshape(real, pair), g.reshape(imag, pair)], axis=4), tuple(rotate.shape))
    else:
        rotated = g.concat([real, imag], axis=3)
    if rd != head:
        rotated = g.concat([rotated, g.slice(y, [0, 0, 0, rd], [None] * 4)], axis=3)
    return [g.transpose(rotated, (0, 2, 1, 3)) if four_d else g.reshape(rotated, tuple(x.shape))]


def _rotate(ctx: Context, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x [B, H, S, D] rotated by cos/sin [S, rd/2] (the first rd dims; the rest pass through)."""
    g = ctx.g
    b, h, s, d = x.shape
    rd = cos.shape[-1] * 2
    cos, sin = g.reshape(cos, (1, 1, s, rd // 2)), g.reshape(sin, (1, 1, s, rd // 2))
    part = x if rd == d else g.slice(x, [0, 0, 0, 0], [None, None, None, rd])
    if interleaved:
        x1 = g.slice(part, [0, 0, 0, 0], [None] * 4, [1, 1, 1, 2])
        x2 = g.slice(part, [0, 0, 0, 1], [None] * 4, [1, 1, 1, 2])
    else:
        x1, x2 = g.split(part, 2, axis=3)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        pair = tuple(real.shape) + (1,)
        out = g.reshape(g.concat([g.reshape(real, pair), g.reshape(imag, pair)], axis=4), tuple(part.shape))
    else:
        out = g.concat([real, imag], axis=3)
    return out if rd == d else g.concat([out, g.slice(x, [0, 0, 0, rd], [None] * 4)], axis=3)


@converter("GroupQueryAttention", domain="com.microsoft")
def _group_query_attention(ctx: Context, node: OnnxNode):
    """com.microsoft GroupQueryAttention: SDPA with fewer K/V heads, causal, keys past seqlens_k
    masked; a past K/V is taken as dense (the new tokens follow all of its positions) and
    present = concat(past, new). Rotary (do_rotary) with the model's cos/sin caches."""
    q, k, v, past_k, past_v, seqlens = (node.input(i) for i in range(6))
    g = ctx.g
    need_float(ctx, node, q)
    if any(node.input(i) is not None for i in (9, 10, 11)) or node.attr("smooth_softmax", 0) or node.attr("softcap", 0.0):
        raise ctx.fail(node, "position_ids, attention_bias, head_sink, smooth_softmax or softcap")
    hq, hk = node.attr("num_heads"), node.attr("kv_num_heads")
    b, s = q.shape[:2]
    if k is None:  # packed QKV
        d = q.shape[2] // (hq + 2 * hk)
        q, k, v = g.split(q, [hq * d, hk * d, hk * d], axis=2)
    heads = lambda t, h: g.transpose(g.reshape(t, (b, s, h, t.shape[2] // h)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = heads(q, hq), heads(k, hk), heads(v, hk)
    past = 0 if past_k is None else past_k.shape[2]
    if node.attr("do_rotary", 0):
        cos, sin = node.input(7), node.input(8)
        positions = g.constant(np.arange(past, past + s, dtype=np.int64))
        cos, sin = g.gather(cos, positions, axis=0), g.gather(sin, positions, axis=0)
        interleaved = bool(node.attr("rotary_interleaved", 0))
        q, k = _rotate(ctx, q, cos, sin, interleaved), _rotate(ctx, k, cos, sin, interleaved)
    if past_k is not None:
        k, v = g.concat([past_k, k], axis=2), g.concat([past_v, v], axis=2)
    total = past + s
    allowed = np.arange(total)[None, :] <= past + np.arange(s)[:, None]              # causal, [S, T]
    window = node.attr("local_window_size", -1)
    if window is not None and window > 0:
        allowed &= np.arange(total)[None, :] > past + np.arange(s)[:, None] - window
    mask = g.constant(allowed.reshape(1, 1, s, total))
    if seqlens is not None:  # keys after the last valid one (seqlens_k[b]) of each sequence do not count
        last = g.reshape(seqlens if seqlens.dtype == dt.int64 else g.cast(seqlens, dt.int64), (b, 1, 1, 1))
        mask = g.logical_and(mask, g.less_equal(g.constant(np.arange(total, dtype=np.int64).reshape(1, 1, 1, total)), last))
    y = g.scaled_dot_product_attention(q, k, v, mask=mask, scale=node.attr("scale") or None)
    return [g.reshape(g.transpose(y, (0, 2, 1, 3)), (b, s, hq * y.shape[3])), k, v]
