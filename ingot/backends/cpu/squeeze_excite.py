"""The FUSED "squeeze_excite" op (passes/fuse_squeeze_excite.py) as one numba kernel per image: the
channels' means, the two 1x1 convolutions on them as dot products with their epilogues applied per
output channel, then x scaled by the result. Generated per block's epilogues (their ops inlined as
scalar expressions) and cached on disk by codegen.

MobileNetV3-style, 224 x 224: the five steps of each block took 40-100 us (the two convolutions on a
1 x 1 image 13-46 us each, mostly the conv step's per-call work); one kernel does the same arithmetic.
"""
from __future__ import annotations

import numpy as np

from ... import codegen
from ...ir import Node, Op
from ...passes.fuse_conv_epilogue import operand_form
from ...passes.fuse_squeeze_excite import conv_of

_EXPR = {Op.ADD: "({0} + {1})", Op.SUB: "({0} - {1})", Op.MUL: "({0} * {1})", Op.DIV: "({0} / {1})",
         Op.MAXIMUM: "_max({0}, {1})", Op.MINIMUM: "_min({0}, {1})", Op.NEG: "(-{0})", Op.ABS: "abs({0})",
         Op.SIGMOID: "_sigmoid({0})"}

_SOURCE = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv import _max, _min


@njit(inline="always")
def _sigmoid(v):
    if v >= 0:
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))
    e = np.exp(v)
    return e / (np.float32(1.0) + e)


@njit(cache=True, nogil=True, fastmath={{"reassoc", "contract"}})
def kernel(x, w1, b1, w2, b2, out{params}):
    # x, out [C, P]; w1 [C1, C], b1 [C1]; w2 [C, C1], b2 [C]
    c_n, p_n = x.shape
    c1_n = w1.shape[0]
    pooled = np.empty(c_n, np.float32)
    for c in range(c_n):
        acc = np.float32(0.0)
        for p in range(p_n):
            acc += x[c, p]
        pooled[c] = acc / np.float32(p_n)
    hidden = np.empty(c1_n, np.float32)
    for m in range(c1_n):
        acc = np.float32(0.0)
        for c in range(c_n):
            acc += w1[m, c] * pooled[c]
        v = acc + b1[m]
{first}
        hidden[m] = {first_out}
    for m in range(c_n):
        acc = np.float32(0.0)
        for c in range(c1_n):
            acc += w2[m, c] * hidden[c]
        v = acc + b2[m]
{second}
        g = {second_out}
        for p in range(p_n):
            out[m, p] = x[m, p] * g
"""


def _epilogue_lines(steps, names) -> tuple[list[str], str]:
    """The steps as lines of `s{k} = expr` reading v (the conv's value) and the operands (names: outer input
    index -> expression at channel m), and the last value's name."""
    lines = []
    for k, (op, refs) in enumerate(steps):
        args = ["v" if form == "value" else f"s{i}" if form == "step" else names[i] for form, i in refs]
        lines.append(f"        s{k} = np.float32({_EXPR[op].format(*args)})")
    return lines, f"s{len(steps) - 1}" if steps else "v"


def _fc(fc: Node):
    """(weight input, bias input or None, steps [(op, [(form, i)])], operands {input: form}) of one of the
    block's 1x1 convs, inputs numbered as the fused op's."""
    conv, epilogue = conv_of(fc)

    def outer(s: Node) -> int:   # a node of fc's body (or fc's own source) -> the fused op's input
        if fc.op == Op.FUSED:
            s = fc.src[s.attrs["param"]]
        return s.attrs["param"]
    w = outer(conv.src[1])
    b = outer(conv.src[2]) if len(conv.src) > 2 else None
    slot = {conv.id: ("value", 0)}
    steps, operands = [], {}
    out_shape = tuple(conv.type.shape)
    for k, n in enumerate(epilogue):
        refs = []
        for s in n.src:
            if s.id in slot:
                refs.append(slot[s.id])
            else:
                i = outer(s)
                operands[i] = operand_form(tuple(s.type.shape), out_shape)
                refs.append((operands[i], i))
        slot[n.id] = ("step", k)
        steps.append((n.op, refs))
    return w, b, steps, operands


def squeeze_excite_lowering(node: Node, out):
    body = node.attrs["body"]
    (mean,) = body.find(Op.MEAN)
    (mul,) = body.find(Op.MUL)
    fcs = [n for n in body.nodes if n.op in (Op.CONV, Op.FUSED)]
    if len(fcs) != 2 or any(conv_of(f) is None for f in fcs):
        return None
    x_index = mean.src[0].attrs["param"]
    (w1, b1, steps1, ops1), (w2, b2, steps2, ops2) = _fc(fcs[0]), _fc(fcs[1])
    operands = list(dict.fromkeys([*ops1, *ops2]))
    forms = {**ops1, **ops2}
    names = {i: f"o{k}[0]" if forms[i] == "scalar" else f"o{k}[m]" for k, i in enumerate(operands)}
    first, first_out = _epilogue_lines(steps1, names)
    second, second_out = _epilogue_lines(steps2, names)
    source = _SOURCE.format(params="".join(f", o{k}" for k in range(len(operands))),
                            first="\n".join(first), first_out=first_out, second="\n".join(second),
                            second_out=second_out)
    kernel = codegen.load(source, "kernel", "cpu_squeeze_excite")
    shape = tuple(node.type.shape)
    n_img, c = shape[:2]
    arranged: dict = {}

    def vector(a) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(a, dtype=np.float32).reshape(-1))

    def step(*inputs):
        fixed = arranged.get("fixed")
        if fixed is None:   # every input but x is a constant (the pass's condition): arranged once
            wa = np.ascontiguousarray(inputs[w1], dtype=np.float32).reshape(-1, c)
            fixed = arranged["fixed"] = (
                wa, vector(inputs[b1]) if b1 is not None else np.zeros(wa.shape[0], np.float32),
                np.ascontiguousarray(inputs[w2], dtype=np.float32).reshape(c, -1),
                vector(inputs[b2]) if b2 is not None else np.zeros(c, np.float32),
                tuple(vector(inputs[i]) for i in operands))
        wa, ba, wb, bb, ops = fixed
        x = np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(n_img, c, -1)
        y = out if out is not None else np.empty(shape, np.float32)
        ys = y.reshape(n_img, c, -1)
        for n in range(n_img):
            kernel(x[n], wa, ba, wb, bb, ys[n], *ops)
        return y
    return step


FUSED_LOWERINGS = {"squeeze_excite": squeeze_excite_lowering}
