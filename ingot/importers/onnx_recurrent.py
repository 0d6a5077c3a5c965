"""ONNX converters for recurrent layers (RNN, LSTM, GRU) onto Ingot's rnn, lstm and gru ops
(ingot/ops/recurrent.py): omitted inputs become zeros (full lengths), layout 1 (batch first) is
transposed to time first and back, and the activation attributes are matched to their functions."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op
from ..ops.recurrent import ACTIVATION_FUNCTIONS, ACTIVATIONS_PER_DIRECTION, DEFAULT_ACTIVATIONS, GATES
from .onnx_ops import Context, OnnxNode, converter, need_float

_OPS = {"RNN": Op.RNN, "LSTM": Op.LSTM, "GRU": Op.GRU}


def _activation_names(ctx: Context, node: OnnxNode, op: Op, directions: int) -> tuple[str, ...]:
    given = node.attr("activations")
    names = list(given) if given else list(DEFAULT_ACTIVATIONS[op]) * directions
    if len(names) == ACTIVATIONS_PER_DIRECTION[op] and directions == 2 and not given:
        names = names * 2
    known = {k.lower(): k for k in ACTIVATION_FUNCTIONS}
    out = []
    for name in names:
        if name.lower() not in known:
            raise ctx.fail(node, f"activation {name!r} (Ingot has {', '.join(sorted(ACTIVATION_FUNCTIONS))})")
        out.append(known[name.lower()])
    if len(out) != directions * ACTIVATIONS_PER_DIRECTION[op]:
        raise ctx.fail(node, f"{len(out)} activations for {directions} direction(s) (expected "
                             f"{directions * ACTIVATIONS_PER_DIRECTION[op]})")
    return tuple(out)


def _alphas_betas(node: OnnxNode, names: tuple[str, ...]) -> tuple[tuple, tuple]:
    """activation_alpha / activation_beta, consumed in order by the activations that take them."""
    alphas, betas = list(node.attr("activation_alpha", []) or []), list(node.attr("activation_beta", []) or [])
    a_out, b_out = [], []
    for name in names:
        _, alpha, beta = ACTIVATION_FUNCTIONS[name]
        a_out.append(float(alphas.pop(0)) if alpha is not None and alphas else None)
        b_out.append(float(betas.pop(0)) if beta is not None and betas else None)
    return tuple(a_out), tuple(b_out)


@converter(*_OPS)
def _recurrent(ctx: Context, node: OnnxNode):
    op = _OPS[node.op_type]
    g = ctx.g
    x, w, r = node.input(0), node.input(1), node.input(2)
    need_float(ctx, node, x)
    direction = node.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.fail(node, f"direction {direction!r}")
    d = 2 if direction == "bidirectional" else 1
    gates = GATES[op]
    if w.ndim != 3 or r.ndim != 3 or w.shape[0] != d:
        raise ctx.fail(node, f"weights of shapes {list(w.shape)} and {list(r.shape)} for {d} direction(s)")
    hidden = r.shape[-1]
    if node.attr("hidden_size") not in (None, hidden):
        raise ctx.fail(node, f"hidden_size {node.attr('hidden_size')} but recurrent weights for {hidden}")
    batch_first = node.attr("layout", 0) == 1
    if batch_first:
        x = g.transpose(x, (1, 0, 2))
    seq, batch = x.shape[0], x.shape[1]
    dtype = x.dtype

    def given_or_zeros(i: int, shape, transpose_state: bool = False):
        t = node.input(i)
        if t is None:
            zeros = g.constant(np.zeros(shape, np.float32))
            return zeros if dtype == dt.float32 else g.cast(zeros, dtype)
        if transpose_state and batch_first:
            t = g.transpose(t, (1, 0, 2))
        return t if t.dtype == dtype else g.cast(t, dtype)

    w, r = (t if t.dtype == dtype else g.cast(t, dtype) for t in (w, r))
    bias = given_or_zeros(3, (d, 2 * gates * hidden))
    lengths = node.input(4)
    if lengths is None:
        lengths = g.constant(np.full((batch,), seq, np.int32))
    elif lengths.dtype not in (dt.int32, dt.int64):
        lengths = g.cast(lengths, dt.int64)
    h0 = given_or_zeros(5, (d, batch, hidden), transpose_state=True)
    inputs = [x, w, r, bias, lengths, h0]
    if op == Op.LSTM:
        inputs += [given_or_zeros(6, (d, batch, hidden), transpose_state=True), given_or_zeros(7, (d, 3 * hidden))]
    names = _activation_names(ctx, node, op, d)
    alphas, betas = _alphas_betas(node, names)
    attrs = {"direction": direction, "activations": names, "alphas": alphas, "betas": betas,
             "clip": None if node.attr("clip") is None else float(node.attr("clip"))}
    if op == Op.LSTM:
        attrs["input_forget"] = bool(node.attr("input_forget", 0))
    if op == Op.GRU:
        attrs["linear_before_reset"] = bool(node.attr("linear_before_reset", 0))
    result = g.op(op, inputs, attrs)
    outs = [g.op(Op.GET_ITEM, [result], {"index": i}) for i in range(3 if op == Op.LSTM else 2)]
    if batch_first:   # y [T, D, B, H] -> [B, T, D, H]; states [D, B, H] -> [B, D, H]
        outs = [g.transpose(outs[0], (2, 0, 1, 3))] + [g.transpose(s, (1, 0, 2)) for s in outs[1:]]
    return outs[:len(node.outputs)]
