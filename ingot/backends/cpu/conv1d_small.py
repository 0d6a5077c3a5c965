"""Small 1-D convolutions on the CPU: one compiled call per step, epilogue included.

A voice-activity model (Silero VAD) runs a handful of 1-D convolutions whose outputs are 1-3 columns
long: their arithmetic takes microseconds, so the general path's per-call Python (tiling, weight
lookups, a separate epilogue call, NumPy's sigmoid) was most of their time. Here every decision is
made once when the step is built: the constant weights are arranged as [M, C / groups * k] on the
first run, the epilogue becomes a list of op codes with scalar constants, and a run is one numba
call that gathers the input windows (padding as zeros) and writes conv + bias + epilogue straight
into the output.

Taken: float32 1-D convolutions with constant weights (and bias), output length <= MAX_LENGTH, and an
epilogue of unary steps on the running value, each with at most one scalar constant operand (ReLU as
a maximum with 0, clips, scaling, sigmoid, tanh, abs, log, exp: a filterbank's log(1 + |x|)). Anything else keeps conv.py's path.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...ir import Node, Op

MAX_LENGTH = 16             # output columns: beyond, conv.py's tiled kernels pay for their own setup
MAX_WINDOWS = 1 << 15       # floats of gathered windows (C / groups * k * length) per image and group

# op codes of the epilogue; the binary ones take the running value and a scalar constant
_ADD, _MUL, _MAX, _MIN, _SUB, _RSUB, _DIV, _SIGMOID, _TANH, _NEG, _ABS, _LOG, _EXP = range(13)
_BINARY = {Op.ADD: (_ADD, _ADD), Op.MUL: (_MUL, _MUL), Op.MAXIMUM: (_MAX, _MAX), Op.MINIMUM: (_MIN, _MIN),
           Op.SUB: (_SUB, _RSUB), Op.DIV: (_DIV, None)}   # (value op s, s op value)
_UNARY = {Op.SIGMOID: _SIGMOID, Op.TANH: _TANH, Op.NEG: _NEG, Op.ABS: _ABS, Op.LOG: _LOG, Op.EXP: _EXP}


@njit(cache=True, nogil=True, fastmath=True)
def _conv(x, w, bias, has_bias, groups, k, stride, dilation, pad, codes, consts, cols, out):
    """out[n, m, l] = epilogue(sum over c in m's group, j < k of w[m, c * k + j] * x[n, c, l * stride +
    j * dilation - pad] + bias[m]); x [N, C, L_in], w [M, C / groups * k], cols [length, C / groups * k]."""
    n_img, c_n, l_in = x.shape
    m_n, length = out.shape[1], out.shape[2]
    cg = c_n // groups
    mg = m_n // groups
    kk = cg * k
    for n in range(n_img):
        for g in range(groups):
            for l in range(length):
                col = cols[l]
                for c in range(cg):
                    xrow = x[n, g * cg + c]
                    for j in range(k):
                        i = l * stride + j * dilation - pad
                        col[c * k + j] = xrow[i] if 0 <= i < l_in else np.float32(0.0)
            for m in range(g * mg, (g + 1) * mg):
                wrow = w[m]
                b = bias[m] if has_bias else np.float32(0.0)
                for l in range(length):   # the weights' row stays in L1 across the columns
                    col = cols[l]
                    s = np.float32(0.0)
                    for t in range(np.uintp(kk)):
                        s += wrow[t] * col[t]
                    v = s + b
                    for e in range(codes.shape[0]):
                        op, a = codes[e], consts[e]
                        if op == 0:
                            v = v + a
                        elif op == 1:
                            v = v * a
                        elif op == 2:
                            v = v if v > a or v != v else a
                        elif op == 3:
                            v = v if v < a or v != v else a
                        elif op == 4:
                            v = v - a
                        elif op == 5:
                            v = a - v
                        elif op == 6:
                            v = v / a
                        elif op == 7:
                            v = np.float32(1.0) / (np.float32(1.0) + math.exp(-v))
                        elif op == 8:
                            v = math.tanh(v)
                        elif op == 9:
                            v = -v
                        elif op == 10:
                            v = abs(v)
                        elif op == 11:   # (log of 0: -inf, of a negative: NaN, as NumPy's)
                            v = math.log(v) if v > 0 else (-np.inf if v == 0 else np.nan)
                        else:
                            v = math.exp(v)
                    out[n, m, l] = v


def _epilogue_codes(epilogue, constants: frozenset) -> list[tuple[int, int | None]] | None:
    """The epilogue's steps as (op code, index of its scalar constant input or None), or None where a
    step is not a unary one on the running value with at most one constant scalar."""
    codes = []
    for k, (node, refs) in enumerate(epilogue.steps):
        if node.dtype.name != "float32":
            return None
        running = ("value", 0) if k == 0 else ("step", k - 1)
        if node.op in _UNARY and refs == [running]:
            codes.append((_UNARY[node.op], None))
            continue
        if node.op not in _BINARY or len(refs) != 2 or running not in refs:
            return None
        side = refs.index(running)
        form, i = refs[1 - side]
        code = _BINARY[node.op][side]
        if form != "scalar" or i not in constants or code is None:
            return None
        codes.append((code, i))
    return codes


def small_step(conv: Node, out: np.ndarray | None, epilogue, x_index: int, w_index: int, b_index: int | None,
               constant: bool, constants: frozenset):
    """A step for conv (+ bias + epilogue) by `_conv`, or None where this path does not take it."""
    if conv.type.rank != 3 or not constant:
        return None
    (stride,), (dilation,), ((pad, _),) = conv.attrs["strides"], conv.attrs["dilations"], conv.attrs["pads"]
    groups = conv.attrs["groups"]
    out_shape = tuple(conv.type.shape)
    m, length = out_shape[1], out_shape[2]
    _, cg, k = conv.src[1].type.shape
    if length > MAX_LENGTH or cg * k * length > MAX_WINDOWS:
        return None
    codes = _epilogue_codes(epilogue, constants)
    if codes is None:
        return None
    op_codes = np.array([c for c, _ in codes], np.int64)
    cols = np.empty((length, cg * k), np.float32)
    fixed: dict = {}

    def step(*inputs):
        got = fixed.get("w")
        if got is None:   # constants: arranged once
            w = np.ascontiguousarray(inputs[w_index], np.float32).reshape(m, cg * k)
            b = np.ascontiguousarray(inputs[b_index], np.float32).reshape(m) if b_index is not None else cols[0, :0]
            consts = np.array([inputs[i].reshape(()) if i is not None else 0.0 for _, i in codes], np.float32)
            got = fixed["w"] = (w, b, consts)
        x = inputs[x_index]
        if not x.flags.c_contiguous or x.dtype != np.float32:
            x = np.ascontiguousarray(x, np.float32)
        y = out if out is not None else np.empty(out_shape, np.float32)
        _conv(x, got[0], got[1], b_index is not None, groups, k, stride, dilation, pad, op_codes, got[2], cols, y)
        return y
    return step
