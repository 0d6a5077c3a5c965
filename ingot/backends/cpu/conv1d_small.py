"""Small 1-D convolutions on the CPU: one compiled call per step, epilogue included.

A voice-activity model (Silero VAD) runs a handful of 1-D convolutions whose outputs are 1-16 columns
long: their arithmetic takes microseconds, so the general path's per-call Python (tiling, weight
lookups, a separate epilogue call, NumPy's sigmoid) was most of their time. Here every decision is
made once when the step is built: the constant weights are packed as recurrent.py's panels (WIDTH
output channels, k-major) on the first run, the epilogue becomes a list of op codes with scalar
constants, and a run is one numba call that copies the input as rows of channels per position (the
padding rows stay zero), so that each window is one contiguous run of k * C / groups floats, multiplies
the windows by the panels with their sums in vector registers (recurrent.accumulate; a tap at a time
where dilation spreads a window), then applies bias and epilogue a vector of output channels at a time.
(A dot product per output value, with a gathered window as the vector, took 4.5 us for a filterbank's
[24, 64] x [64, 15]; this, ~1.6 with the call.)

Taken: float32 1-D convolutions with constant weights (and bias), output length <= MAX_LENGTH, and an
epilogue of unary steps on the running value, each with at most one scalar constant operand (ReLU as
a maximum with 0, clips, scaling, sigmoid, tanh, abs, log, exp: a filterbank's log(1 + |x|)). Anything else keeps conv.py's path.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ...ir import Node, Op
from .nn_kernels import _bits_of_float, _float_of_bits, sigmoid as _sigmoid, tanh as _tanh
from .recurrent import WIDTH, accumulate, pack

MAX_LENGTH = 16             # output columns: beyond, conv.py's tiled kernels pay for their own setup
MAX_WINDOWS = 1 << 15       # multiply-adds of an output column (C / groups * k) times its columns, per group

# op codes of the epilogue; the binary ones take the running value and a scalar constant
_ADD, _MUL, _MAX, _MIN, _SUB, _RSUB, _DIV, _SIGMOID, _TANH, _NEG, _ABS, _LOG, _EXP = range(13)
_BINARY = {Op.ADD: (_ADD, _ADD), Op.MUL: (_MUL, _MUL), Op.MAXIMUM: (_MAX, _MAX), Op.MINIMUM: (_MIN, _MIN),
           Op.SUB: (_SUB, _RSUB), Op.DIV: (_DIV, None)}   # (value op s, s op value)
_UNARY = {Op.SIGMOID: _SIGMOID, Op.TANH: _TANH, Op.NEG: _NEG, Op.ABS: _ABS, Op.LOG: _LOG, Op.EXP: _EXP}
_FAST = {"contract", "nsz", "arcp"}   # no nnan / ninf: NaN and infinities keep NumPy's meaning in the epilogue
_INF = np.float32(np.inf)


@njit(inline="always", fastmath=_FAST, cache=True, error_model="numpy")
def _log(x):
    """log of a float32 from its bits and Cephes logf's polynomial (~1 ulp), so that a loop of it
    vectorises (math.log is a call per element); 0 -> -inf, negative or NaN -> NaN, inf -> inf."""
    tiny = x < np.float32(1.17549435e-38)                     # subnormal: scaled by 2^23 first
    bits = _bits_of_float(x * np.float32(8388608.0) if tiny else x)
    e = np.float32(np.int32((bits >> np.uint32(23)) & np.uint32(0xFF)) - np.int32(126)) - (np.float32(23.0) if tiny else np.float32(0.0))
    m = _float_of_bits((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000))   # x = m 2^e, m in [0.5, 1)
    low = m < np.float32(0.70710678)
    e = e - np.float32(1.0) if low else e
    m = (m + m if low else m) - np.float32(1.0)
    z = m * m
    y = np.float32(7.0376836292e-2) * m - np.float32(1.1514610310e-1)
    y = y * m + np.float32(1.1676998740e-1)
    y = y * m - np.float32(1.2420140846e-1)
    y = y * m + np.float32(1.4249322787e-1)
    y = y * m - np.float32(1.6668057665e-1)
    y = y * m + np.float32(2.0000714765e-1)
    y = y * m - np.float32(2.4999993993e-1)
    y = y * m + np.float32(3.3333331174e-1)
    y = y * m * z + np.float32(-2.12194440e-4) * e - np.float32(0.5) * z
    r = m + y + np.float32(0.693359375) * e
    return r if x > 0 and x < _INF else (-_INF if x == 0 else (x if x > 0 else np.float32(np.nan)))


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def _conv(x, panels, bias, shape, codes, consts, rows, acc, out):
    """out[n, m, l] = epilogue(sum over c in m's group, j < k of W[m, c, j] * x[n, c, l * stride + j * dilation -
    pad] + bias[m]); x [N, C, L_in]; panels [groups, taps, pack(W of the group and tap as [M / groups, K])] (taps
    1 and K = k * C / groups in (j, c) order where dilation is 1, else taps k and K = C / groups); bias [groups,
    width] (zero past M / groups); shape: groups, k, stride, dilation, pad; rows [(length - 1) * stride + (k - 1) *
    dilation + 1, C / groups]: the padded input positions of a group, zero where they are padding (written here
    only where they are not); acc [length, width]: scratch, width = the group's panels * WIDTH."""
    groups, k, stride, dilation, pad = shape[0], shape[1], shape[2], shape[3], shape[4]
    n_img, c_n, l_in = x.shape
    m_n, length = out.shape[1], out.shape[2]
    cg = c_n // groups
    mg = m_n // groups
    width = acc.shape[1]
    taps = panels.shape[1]
    depth = k * cg if taps == 1 else cg
    lo, hi = min(pad, rows.shape[0]), min(pad + l_in, rows.shape[0])
    inputs = rows.reshape(rows.size)
    flat = acc.reshape(acc.size)
    vector = min(-(-mg // 16) * 16, width)   # the epilogue's columns: whole vectors
    for n in range(n_img):
        for g in range(groups):
            for c in range(cg):   # the group's channels as rows of positions: each window is contiguous
                src = x[n, g * cg + c, lo - pad:]
                if cg == 1:   # (a copy; unsigned indices: no negative-index wrap, a vector loop)
                    for r in range(np.uintp(hi - lo)):
                        inputs[lo + r] = src[r]
                else:
                    for r in range(np.uintp(hi - lo)):
                        inputs[(lo + r) * cg + c] = src[r]
            brow = bias[g]
            for l in range(length):
                row = flat[l * width:]
                for m in range(np.uintp(width)):
                    row[m] = brow[m]
            for j in range(taps):
                accumulate(flat, 0, width, panels[g, j], depth, inputs, j * dilation * cg, stride * cg, length, width // WIDTH)
            for e in range(codes.shape[0]):   # each step of the epilogue over every sum: a vector loop
                op, a = codes[e], consts[e]
                for l in range(length):
                    v = acc[l, :vector]
                    if op == 0:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] + a
                    elif op == 1:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] * a
                    elif op == 2:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] if v[i] > a or v[i] != v[i] else a
                    elif op == 3:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] if v[i] < a or v[i] != v[i] else a
                    elif op == 4:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] - a
                    elif op == 5:
                        for i in range(np.uintp(vector)):
                            v[i] = a - v[i]
                    elif op == 6:
                        for i in range(np.uintp(vector)):
                            v[i] = v[i] / a
                    elif op == 7:
                        for i in range(np.uintp(vector)):
                            v[i] = _sigmoid(v[i])
                    elif op == 8:
                        for i in range(np.uintp(vector)):
                            v[i] = _tanh(v[i])
                    elif op == 9:
                        for i in range(np.uintp(vector)):
                            v[i] = -v[i]
                    elif op == 10:
                        for i in range(np.uintp(vector)):
                            v[i] = abs(v[i])
                    elif op == 11:
                        for i in range(np.uintp(vector)):
                            v[i] = _log(v[i])
                    else:
                        for i in range(np.uintp(vector)):
                            v[i] = math.exp(v[i])
            for m in range(mg):
                for l in range(length):
                    out[n, g * mg + m, l] = acc[l, m]


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
    mg = m // groups
    width = -(-mg // WIDTH) * WIDTH
    taps = 1 if dilation == 1 else k
    op_codes = np.array([c for c, _ in codes], np.int64)
    shape = np.array([groups, k, stride, dilation, pad], np.int64)
    rows = np.zeros(((length - 1) * stride + (k - 1) * dilation + 1, cg), np.float32)
    acc = np.empty((length, width), np.float32)
    fixed: list = []

    def arranged(inputs):
        """The constants, once: the weights as panels per group and tap, the biases padded to the panels' width."""
        w = np.asarray(inputs[w_index], np.float32).reshape(groups, mg, cg, k).transpose(0, 3, 1, 2)   # [G, k, mg, cg]
        if taps == 1:   # one window of k positions x cg channels, position-major
            w = w.transpose(0, 2, 1, 3).reshape(groups, 1, mg, k * cg)
        panels = np.stack([np.stack([pack(np.ascontiguousarray(w[g, j])) for j in range(taps)]) for g in range(groups)])
        bias = np.zeros((groups, width), np.float32)
        if b_index is not None:
            bias[:, :mg] = np.asarray(inputs[b_index], np.float32).reshape(groups, mg)
        consts = np.array([inputs[i].reshape(()) if i is not None else 0.0 for _, i in codes], np.float32)
        fixed[:] = [panels, bias, consts]

    def step(*inputs):
        if not fixed:
            arranged(inputs)
        x = inputs[x_index]
        if not x.flags.c_contiguous or x.dtype != np.float32:
            x = np.ascontiguousarray(x, np.float32)
        y = out if out is not None else np.empty(out_shape, np.float32)
        _conv(x, fixed[0], fixed[1], shape, op_codes, fixed[2], rows, acc, y)
        return y
    return step
