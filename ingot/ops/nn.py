"""Linear algebra and the transformer ops: matmul, rms_norm, layer_norm, rope, SDPA."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import broadcast_shapes, compute_dtype, fail, register
from .reduce import softmax


def _matmul_rule(types, attrs):
    a, b = types
    if a.dtype != b.dtype or a.dtype.packed or a.dtype == dt.bool_ or a.rank == 0 or b.rank == 0:
        raise fail(Op.MATMUL, types, "two non-scalar tensors of one numeric dtype")
    ash = (1,) + a.shape if a.rank == 1 else a.shape
    bsh = b.shape + (1,) if b.rank == 1 else b.shape
    k1, k2 = ash[-1], bsh[-2]
    if k1 is not None and k2 is not None and k1 != k2:
        raise fail(Op.MATMUL, types, f"inner dimensions that agree ({k1} vs {k2})")
    batch = broadcast_shapes(Op.MATMUL, [TensorType(ash[:-2]), TensorType(bsh[:-2])], types, "batch dimensions")
    shape = batch + ((ash[-2],) if a.rank > 1 else ()) + ((bsh[-1],) if b.rank > 1 else ())
    return TensorType(shape, a.dtype)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    cd = compute_dtype(a)
    return np.matmul(a.astype(cd, copy=False), b.astype(cd, copy=False)).astype(a.dtype, copy=False)


register(Op.MATMUL, _matmul_rule, lambda xs, a: matmul(xs[0], xs[1]))


def _det_rule(types, attrs):
    (t,) = types
    if t.rank < 2 or t.shape[-1] != t.shape[-2] or not t.dtype.is_float:
        raise fail(Op.DET, types, "float square matrices [..., M, M]")
    return TensorType(t.shape[:-2], t.dtype)


register(Op.DET, _det_rule, lambda xs, a: np.asarray(np.linalg.det(xs[0].astype(np.float64))).astype(xs[0].dtype))


def _norm_rule(op):
    def rule(types, attrs):
        x = types[0]
        if not x.dtype.is_float or x.rank == 0:
            raise fail(op, types, "a floating-point input of rank >= 1")
        for p in types[1:]:
            if p.dtype != x.dtype or p.shape != x.shape[-1:]:
                raise fail(op, types, f"weight and bias of shape ({x.shape[-1]},) and dtype {x.dtype.name}")
        eps = attrs.get("eps")
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
            raise fail(op, types, f"a finite eps >= 0, not {str(eps)[:40]}")   # (a package's graph.json says what it is)
        return x
    return rule


def rms_norm(x, weight, eps):
    xf = x.astype(np.float32)
    y = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    if weight is not None:
        y = y * weight.astype(np.float32)
    return y.astype(x.dtype)


def layer_norm(x, weight, bias, eps):
    xf = x.astype(np.float32)
    mu = xf.mean(axis=-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (xf - mu) / np.sqrt(var + np.float32(eps))
    if weight is not None:
        y = y * weight.astype(np.float32)
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(x.dtype)


register(Op.RMS_NORM, _norm_rule(Op.RMS_NORM),
         lambda xs, a: rms_norm(xs[0], xs[1] if len(xs) > 1 else None, a["eps"]))
register(Op.LAYER_NORM, _norm_rule(Op.LAYER_NORM),
         lambda xs, a: layer_norm(xs[0], xs[1] if a.get("has_weight") else None,
                                  xs[-1] if a.get("has_bias") else None, a["eps"]))


def _rope_rule(types, attrs):
    x, pos = types[0], types[1]
    rd = attrs.get("rotary_dims") or x.shape[-1]
    if not x.dtype.is_float or x.rank < 2:
        raise fail(Op.ROPE, types, "a floating-point input of shape [..., T, D]")
    if x.shape[-1] is not None and (rd % 2 or rd > x.shape[-1]):
        raise fail(Op.ROPE, types, f"an even number of rotary dims <= {x.shape[-1]}, not {rd}")
    if not pos.dtype.is_int or pos.rank > 1 or (pos.rank == 1 and None not in (pos.shape[0], x.shape[-2]) and pos.shape[0] != x.shape[-2]):
        raise fail(Op.ROPE, types, "integer positions: a scalar offset or one position per token")
    if len(types) > 2 and (types[2].dtype != dt.float32 or types[2].rank != 1 or None not in (rd, types[2].shape[0])
                           and types[2].shape[0] != rd // 2):
        raise fail(Op.ROPE, types, f"inverse frequencies float32[{rd // 2}]")
    return x


def rope_inv_freq(rotary_dims: int, base: float) -> np.ndarray:
    return (1.0 / (base ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims))).astype(np.float32)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray):
    angles = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]  # [T, rd/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x, pos, inv_freq, base, interleaved, rotary_dims):
    t, d = x.shape[-2], x.shape[-1]
    rd = rotary_dims or d
    positions = pos + np.arange(t) if np.ndim(pos) == 0 else np.asarray(pos)
    cos, sin = rope_cos_sin(positions, inv_freq if inv_freq is not None else rope_inv_freq(rd, base))
    xf = x.astype(np.float32)
    out = xf.copy()
    if interleaved:
        x1, x2 = xf[..., 0:rd:2], xf[..., 1:rd:2]
        out[..., 0:rd:2] = x1 * cos - x2 * sin
        out[..., 1:rd:2] = x2 * cos + x1 * sin
    else:
        h = rd // 2
        x1, x2 = xf[..., :h], xf[..., h:rd]
        out[..., :h] = x1 * cos - x2 * sin
        out[..., h:rd] = x2 * cos + x1 * sin
    return out.astype(x.dtype)


register(Op.ROPE, _rope_rule,
         lambda xs, a: rope(xs[0], xs[1], xs[2] if len(xs) > 2 else None, a.get("base", 10000.0),
                            a.get("interleaved", False), a.get("rotary_dims")))


def _sdpa_rule(types, attrs):
    q, k, v = types[:3]
    expect = ("q [..., Hq, Tq, D], k [..., Hkv, Tk, D], v [..., Hkv, Tk, Dv] float (k and v of one dtype: q's, or "
              "a KV cache's narrower one; int8 codes with kv_scales), Hq a multiple of Hkv")
    codes = bool(attrs.get("kv_scales"))
    if not (q.dtype.is_float and (k.dtype == dt.int8 if codes else k.dtype.is_float) and k.dtype == v.dtype
            and q.rank == k.rank == v.rank and q.rank >= 3):
        raise fail(Op.SDPA, types, expect)
    if codes:   # one float32 scale per K row and per V row, the last two sources: [..., Hkv, Tk, 1]
        if len(types) != 5 + bool(attrs.get("has_mask")) + bool(attrs.get("has_length")) or \
                any(s.dtype != dt.float32 or s.shape != c.shape[:-1] + (1,) for s, c in zip(types[-2:], (k, v))):
            raise fail(Op.SDPA, types, "int8 K/V codes with float32 scales [..., Hkv, Tk, 1] per row (kv_scales)")
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    known = lambda *ds: all(d is not None for d in ds)  # noqa: E731
    if (known(hk, hv) and hk != hv) or (known(hq, hk) and hq % hk) or (known(q.shape[-1], k.shape[-1]) and q.shape[-1] != k.shape[-1]) \
            or (known(k.shape[-2], v.shape[-2]) and k.shape[-2] != v.shape[-2]):
        raise fail(Op.SDPA, types, expect)
    batch = broadcast_shapes(Op.SDPA, [TensorType(q.shape[:-3]), TensorType(k.shape[:-3]), TensorType(v.shape[:-3])], types,
                             "batch dimensions")
    i = 3
    if attrs.get("has_mask"):
        m = types[i]; i += 1
        if m.dtype not in (dt.bool_, q.dtype):
            raise fail(Op.SDPA, types, f"a bool or {q.dtype.name} mask")
        scores = batch + (hq, q.shape[-2], k.shape[-2])
        if m.rank > len(scores):
            raise fail(Op.SDPA, types, f"a mask of rank <= {len(scores)} (it broadcasts to the scores [..., Hq, Tq, Tk])")
        broadcast_shapes(Op.SDPA, [m, TensorType(scores)], types, "a mask and scores")
    if attrs.get("has_length"):
        length = types[i]
        if length.rank != 0 or not length.dtype.is_int:
            raise fail(Op.SDPA, types, "a scalar integer length")
    window, softcap = attrs.get("window", 0), attrs.get("softcap", 0.0)
    if not isinstance(window, int) or window < 0 or (window and not attrs.get("causal")):
        raise fail(Op.SDPA, types, f"a sliding window of >= 1 keys with causal=True, not window={window!r}")
    if not isinstance(softcap, (int, float)) or softcap < 0 or not math.isfinite(softcap):
        raise fail(Op.SDPA, types, f"a logit softcap >= 0 (0: none), not softcap={softcap!r}")
    scale, causal = attrs.get("scale"), attrs.get("causal", False)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        raise fail(Op.SDPA, types, f"a finite scale (or none: 1/sqrt(D)), not {str(scale)[:40]}")   # (a package's graph.json)
    if not isinstance(causal, bool):
        raise fail(Op.SDPA, types, f"causal true or false, not {str(causal)[:40]}")
    return TensorType(batch + (hq, q.shape[-2], v.shape[-1]), q.dtype)


def sdpa(q, k, v, mask=None, length=None, scale=None, causal=False, window=0, softcap=0.0):
    """Reference attention in float32: softmax(cap(q k^T * scale) + mask) v, GQA by repeating K/V heads.

    softcap c > 0: scores become c * tanh(s / c) (Gemma 2) before the mask. window w > 0 (with causal):
    the query at position p sees keys p - w < j <= p only (a sliding window; positions are aligned
    so that the last query is the last key, as causal is)."""
    tq, d = q.shape[-2], q.shape[-1]
    if length is not None:
        length = int(length)
        k, v = k[..., :length, :], v[..., :length, :]
        if mask is not None and mask.shape[-1] != 1:
            mask = mask[..., :length]
    tk = k.shape[-2]
    group = q.shape[-3] // k.shape[-3]
    kf = np.repeat(k.astype(np.float32), group, axis=-3)
    vf = np.repeat(v.astype(np.float32), group, axis=-3)
    s = np.matmul(q.astype(np.float32), np.swapaxes(kf, -1, -2)) * np.float32(scale if scale is not None else 1 / math.sqrt(d))
    if softcap:
        s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float32)
    if causal:
        query_pos = np.arange(tq)[:, None] + (tk - tq)
        allowed = np.arange(tk)[None, :] <= query_pos
        if window:
            allowed &= np.arange(tk)[None, :] > query_pos - window
        s = np.where(allowed, s, -np.inf)
    row_max = np.max(s, axis=-1, keepdims=True)
    dead = ~np.isfinite(row_max)  # rows that see no key give zeros, not NaN
    p = softmax(np.where(dead, 0, s), axis=-1)
    p = np.where(dead, 0, p)
    return np.matmul(p, vf).astype(q.dtype)


def dequantized_rows(codes, scales, length=None):
    """int8 K/V codes [..., T, D] times their row scales [..., T, 1], in float32: the first `length`
    rows only (an int8 KV cache as attention reads it)."""
    if length is not None:
        codes, scales = codes[..., :int(length), :], scales[..., :int(length), :]
    return codes.astype(np.float32) * scales.astype(np.float32)


def quantized_rows(x):
    """(int8 codes, float32 scales [..., 1]) of float rows x [..., D], symmetric per row: scale =
    max(max|x| / 127, ROW_SCALE_MIN), codes x / scale rounded to nearest even: how an int8 KV cache
    stores each key and value row (llama.cpp's q8_0 with one block per row). The floor keeps a row of
    zeros at codes 0 with no division by zero."""
    xf = np.asarray(x, np.float32)
    amax = np.max(np.abs(xf), axis=-1, keepdims=True)
    scale = np.maximum(amax / np.float32(127), ROW_SCALE_MIN).astype(np.float32)
    return np.clip(np.round(xf / scale), -127, 127).astype(np.int8), scale


ROW_SCALE_MIN = np.float32(2.0 ** -126)   # the smallest normal float32: an int8 KV row's least scale


def _sdpa(xs, a):
    i = 3
    mask = length = None
    if a.get("has_mask"):
        mask = xs[i]; i += 1
    if a.get("has_length"):
        length = xs[i]
    k, v = xs[1], xs[2]
    if a.get("kv_scales"):   # widened here for the reference only (its length's rows); kernels read the codes
        k, v = dequantized_rows(k, xs[-2], length), dequantized_rows(v, xs[-1], length)
    return sdpa(xs[0], k, v, mask, length, a.get("scale"), a.get("causal", False), a.get("window", 0),
                a.get("softcap", 0.0))


register(Op.SDPA, _sdpa_rule, _sdpa)
