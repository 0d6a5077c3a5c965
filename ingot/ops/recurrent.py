"""Recurrent layers: rnn, lstm, gru, as ONNX defines them (layout: time first).

Inputs (every one given; a builder fills zeros where a model has none):

    x [T, B, I]   w [D, G*H, I]   r [D, G*H, H]   bias [D, 2*G*H] (input then recurrent)
    lengths [B] (int32 or int64: steps of each sequence)   h0 [D, B, H]
    lstm only: c0 [D, B, H], peephole [D, 3*H] (input, output, forget)

D is 2 for "bidirectional" (forward first), else 1; G is 1 (rnn), 4 (lstm: gates i, o, f, c) or
3 (gru: gates z, r, h). Outputs, a tuple: y [T, D, B, H] (zero past each sequence's length), the
last hidden state [D, B, H] (for "reverse", the state after step 0), and for lstm the last cell
state. attrs: direction, activations (names, G' per direction: rnn 1, lstm 3, gru 2), alphas and
betas (one per activation, None for its default), clip (pre-activations clipped to [-clip, clip],
or None), input_forget (lstm: the forget gate is 1 - input gate), linear_before_reset (gru).

The reference projects every step's input with one matmul, then runs the recurrence step by
step; it is the CPU backend's kernel.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import fail, register

GATES = {Op.RNN: 1, Op.LSTM: 4, Op.GRU: 3}
ACTIVATIONS_PER_DIRECTION = {Op.RNN: 1, Op.LSTM: 3, Op.GRU: 2}
DEFAULT_ACTIVATIONS = {Op.RNN: ("Tanh",), Op.LSTM: ("Sigmoid", "Tanh", "Tanh"), Op.GRU: ("Sigmoid", "Tanh")}
DIRECTIONS = ("forward", "reverse", "bidirectional")


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


# name -> (function of x, alpha, beta; default alpha; default beta), as ONNX's RNN ops define them
ACTIVATION_FUNCTIONS = {
    "Relu": (lambda x, a, b: np.maximum(x, 0), None, None),
    "Tanh": (lambda x, a, b: np.tanh(x), None, None),
    "Sigmoid": (lambda x, a, b: _sigmoid(x), None, None),
    "Affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "LeakyRelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "ThresholdedRelu": (lambda x, a, b: np.where(x > a, x, 0), 1.0, None),
    "ScaledTanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "HardSigmoid": (lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "Elu": (lambda x, a, b: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1)), 1.0, None),
    "Softsign": (lambda x, a, b: x / (1 + np.abs(x)), None, None),
    "Softplus": (lambda x, a, b: np.logaddexp(x, 0), None, None),
}


def _directions(attrs) -> int:
    return 2 if attrs["direction"] == "bidirectional" else 1


def _recurrent_rule(op):
    def rule(types, attrs):
        n_in = 8 if op == Op.LSTM else 6
        if len(types) != n_in:
            raise fail(op, types, f"{n_in} inputs")
        x, w, r, bias, lengths, h0 = types[:6]
        if attrs.get("direction") not in DIRECTIONS:
            raise fail(op, types, f"a direction among {DIRECTIONS}, not {attrs.get('direction')!r}")
        acts = attrs.get("activations", ())
        d, g = _directions(attrs), GATES[op]
        if len(acts) != d * ACTIVATIONS_PER_DIRECTION[op] or any(a not in ACTIVATION_FUNCTIONS for a in acts):
            raise fail(op, types, f"{d * ACTIVATIONS_PER_DIRECTION[op]} activations among {sorted(ACTIVATION_FUNCTIONS)}, "
                                  f"not {list(acts)}")
        if x.rank != 3 or not x.dtype.is_float or any(t.dtype != x.dtype for t in types if t is not lengths):
            raise fail(op, types, "a float input x [T, B, I] and parameters of its dtype")
        seq, batch, size = x.shape
        hidden = r.shape[-1] if r.rank == 3 else None
        want = {"w": (w, (d, g * hidden, size)), "r": (r, (d, g * hidden, hidden)), "bias": (bias, (d, 2 * g * hidden)),
                "h0": (h0, (d, batch, hidden)), "lengths": (lengths, (batch,))}
        if op == Op.LSTM:
            want.update({"c0": (types[6], (d, batch, hidden)), "peephole": (types[7], (d, 3 * hidden))})
        for name, (t, shape) in want.items():
            if hidden is None or t.shape != shape:
                raise fail(op, types, f"{name} of shape {list(shape) if hidden is not None else '[D, G*H, H]'}")
        if lengths.dtype not in (dt.int32, dt.int64):
            raise fail(op, types, "int32 or int64 lengths")
        state = TensorType((d, batch, hidden), x.dtype)
        return (TensorType((seq, d, batch, hidden), x.dtype), state) + ((state,) if op == Op.LSTM else ())
    return rule


def _activations(attrs):
    """The activation functions, each with its alpha and beta bound."""
    out = []
    alphas, betas = attrs.get("alphas") or (), attrs.get("betas") or ()
    for k, name in enumerate(attrs["activations"]):
        fn, alpha, beta = ACTIVATION_FUNCTIONS[name]
        a = alphas[k] if k < len(alphas) and alphas[k] is not None else alpha
        b = betas[k] if k < len(betas) and betas[k] is not None else beta
        out.append(lambda x, fn=fn, a=a, b=b: fn(x, np.float32(a if a is not None else 0), np.float32(b if b is not None else 0)))
    return out


def recurrent(op: Op, xs, attrs):
    """The NumPy reference of rnn, lstm and gru (see the module docstring)."""
    x, w, r, bias, lengths, h0 = xs[:6]
    dtype = x.dtype
    f32 = [np.asarray(v, np.float32) for v in (x, w, r, bias, h0)]
    x, w, r, bias, h0 = f32
    c0 = np.asarray(xs[6], np.float32) if op == Op.LSTM else None
    peep = np.asarray(xs[7], np.float32) if op == Op.LSTM else None
    seq, batch, _ = x.shape
    d, g, hidden = _directions(attrs), GATES[op], r.shape[-1]
    lengths = np.minimum(np.asarray(lengths).astype(np.int64), seq)
    acts = _activations(attrs)
    per = ACTIVATIONS_PER_DIRECTION[op]
    clip = attrs.get("clip")
    limit = (lambda v: np.clip(v, -clip, clip)) if clip is not None else (lambda v: v)
    y = np.zeros((seq, d, batch, hidden), np.float32)
    h_last = np.zeros((d, batch, hidden), np.float32)
    c_last = np.zeros((d, batch, hidden), np.float32)
    for k in range(d):
        reverse = attrs["direction"] == "reverse" or k == 1
        f, gg, hh = (acts[k * per:(k + 1) * per] + [None, None])[:3]
        wb, rb = bias[k, :g * hidden], bias[k, g * hidden:]
        projected = x @ w[k].T + (wb if op != Op.GRU else np.concatenate([wb[:2 * hidden] + rb[:2 * hidden], wb[2 * hidden:]]))
        h = h0[k].copy()
        c = c0[k].copy() if op == Op.LSTM else None
        for t in (range(seq - 1, -1, -1) if reverse else range(seq)):
            live = (t < lengths)[:, None]
            if op == Op.RNN:
                new_h = f(limit(projected[t] + h @ r[k].T + rb))
            elif op == Op.LSTM:
                gates = projected[t] + h @ r[k].T + rb
                i, o, fo, cc = np.split(gates, 4, axis=-1)
                pi, po, pf = np.split(peep[k], 3)
                i = f(limit(i + pi * c))
                fo = 1 - i if attrs.get("input_forget") else f(limit(fo + pf * c))
                new_c = fo * c + i * gg(limit(cc))
                o = f(limit(o + po * new_c))
                new_h = o * hh(new_c)
                c = np.where(live, new_c, c)
            else:
                rz, rr, rh = np.split(r[k], 3, axis=0)
                recurrent_zr = h @ np.concatenate([rz, rr]).T
                z = f(limit(projected[t, :, :hidden] + recurrent_zr[:, :hidden]))
                rg = f(limit(projected[t, :, hidden:2 * hidden] + recurrent_zr[:, hidden:]))
                if attrs.get("linear_before_reset"):
                    candidate = gg(limit(projected[t, :, 2 * hidden:] + rg * (h @ rh.T + rb[2 * hidden:])))
                else:
                    candidate = gg(limit(projected[t, :, 2 * hidden:] + (rg * h) @ rh.T + rb[2 * hidden:]))
                new_h = (1 - z) * candidate + z * h
            h = np.where(live, new_h, h)
            y[t, k] = np.where(live, new_h, 0)
        h_last[k] = h
        if op == Op.LSTM:
            c_last[k] = c
    outs = (y, h_last) + ((c_last,) if op == Op.LSTM else ())
    return tuple(o.astype(dtype) for o in outs)


for _op in GATES:
    register(_op, _recurrent_rule(_op), lambda xs, a, _op=_op: recurrent(_op, xs, a))
