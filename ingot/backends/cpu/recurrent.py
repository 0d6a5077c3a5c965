"""The LSTM recurrence as one compiled loop (numba): the op's NumPy reference (ops/recurrent.py) runs
a dozen NumPy calls per time step and direction (0.17 ms of Silero VAD's 0.5 ms for one step); here
every step's recurrent GEMV (R h) and the gates' pointwise math run in one kernel call per direction,
after one BLAS matmul projects every step's input (x W^T + both biases).

Lowered where the op is float32 with the default activations (sigmoid, tanh, tanh); other LSTMs,
and RNN and GRU, run the reference.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ...ir import Node, Op
from .nn_kernels import sigmoid as _sigmoid, tanh as _tanh

DEFAULT = ("Sigmoid", "Tanh", "Tanh")


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")   # no zero-division check: vectorised
def lstm_direction(projected, rt, peephole, h, c, lengths, reverse, clip, input_forget, y, direction):
    """One direction of the recurrence, in place on h and c [B, H] (the initial states in, the last out):
    projected [T, B, 4H] = x W^T + input bias + recurrent bias; rt [H, 4H] (R transposed: the GEMV as H
    row updates, no horizontal sums); peephole [3H] (input, output, forget); lengths [B] (steps of each
    sequence, at most T); pre-activations clipped to [-clip, clip]; y [T, D, B, H] gets h at
    y[t, direction], zero at and past a sequence's length."""
    seq, batch, four = projected.shape
    hidden = four // 4
    gates = np.empty(four, np.float32)
    for s in range(seq):
        t = seq - 1 - s if reverse else s
        for b in range(batch):
            if t >= lengths[b]:
                for j in range(hidden):
                    y[t, direction, b, j] = 0.0
                continue
            for g in range(four):
                gates[g] = projected[t, b, g]
            for j in range(hidden):
                hj = h[b, j]
                for g in range(four):
                    gates[g] += hj * rt[j, g]
            for j in range(hidden):
                cj = c[b, j]
                i = _sigmoid(min(max(gates[j] + peephole[j] * cj, -clip), clip))
                f = _sigmoid(min(max(gates[2 * hidden + j] + peephole[2 * hidden + j] * cj, -clip), clip))
                if input_forget:
                    f = np.float32(1.0) - i
                new_c = f * cj + i * _tanh(min(max(gates[3 * hidden + j], -clip), clip))
                o = _sigmoid(min(max(gates[hidden + j] + peephole[hidden + j] * new_c, -clip), clip))
                new_h = o * _tanh(new_c)
                c[b, j] = new_c
                h[b, j] = new_h
                y[t, direction, b, j] = new_h


def lstm_step(node: Node, out):
    """The lstm op (float32, default activations) through lstm_direction; None where it does not apply."""
    a = node.attrs
    d = 2 if a["direction"] == "bidirectional" else 1
    if node.src[0].dtype.name != "float32" or tuple(a["activations"]) != DEFAULT * d:
        return None
    clip = np.float32(a["clip"]) if a.get("clip") is not None else np.float32(np.finfo(np.float32).max)
    input_forget = bool(a.get("input_forget"))
    reverse_first = a["direction"] == "reverse"
    cache: dict = {}
    constant = node.src[2].op == Op.CONSTANT

    def transposed(r, k):
        """R[k] transposed; made once where R is a constant (a fed array may change between runs)."""
        if not constant:
            return np.ascontiguousarray(r[k].T)
        if k not in cache:
            cache[k] = np.ascontiguousarray(r[k].T)
        return cache[k]

    def step(x, w, r, bias, lengths, h0, c0, peephole):
        seq, batch, _ = x.shape
        hidden = r.shape[-1]
        x2 = x.reshape(seq * batch, x.shape[2])
        lengths = np.minimum(np.asarray(lengths).astype(np.int64), seq)
        y = np.empty((seq, d, batch, hidden), np.float32)
        h_last = np.array(h0, np.float32, copy=True)
        c_last = np.array(c0, np.float32, copy=True)
        for k in range(d):
            projected = np.matmul(x2, w[k].T)
            projected += bias[k, :4 * hidden]
            projected += bias[k, 4 * hidden:]
            lstm_direction(projected.reshape(seq, batch, 4 * hidden), transposed(r, k),
                           np.ascontiguousarray(peephole[k]), h_last[k], c_last[k], lengths, reverse_first or k == 1,
                           clip, input_forget, y, k)
        return y, h_last, c_last
    return step
