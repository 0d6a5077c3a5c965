"""Fused ops on the CUDA backend, lowered by kind: the compiler's device passes decided what is fused
(ingot/passes/fuse_*.py); each function here runs one kind as one step of our kernels, or returns None
where the weights it prepared do not suit them, and the op runs as its parts (`lower_parts`).

A body node is read through its parameter: `param(n)` is the index of the fused op's source it stands
for, which is where the step's inputs come from (`ctx.reads`).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ... import dtypes as dt
from ...ir import GroupOp, Node, Op
from ...ops.fused import Body
from ...ops.nn import rope_inv_freq
from ...passes.gemv_rules import gate_activation, glu_parts
from . import attention as attention_kernels
from . import fused
from . import quantized_matmul as qmm
from .device import concatenated_weight, prepared_weight
from .lowerings import LOWERINGS, Lowering, StepFn, _ZeroAhead, host_reference

FusedLowering = Callable[[Lowering], "tuple[StepFn, str] | None"]
FUSED_LOWERINGS: dict[str, FusedLowering] = {}


def fused_lowering(kind: str):
    def deco(fn):
        FUSED_LOWERINGS[kind] = fn
        return fn
    return deco


def lower(ctx: Lowering) -> tuple[StepFn, str]:
    """(step function, step name) for any node: by op, and a FUSED op by kind or as its parts."""
    node = ctx.node
    if node.op != Op.FUSED:
        return LOWERINGS.get(node.op, host_reference)(ctx), node.op.name.lower()
    rule = FUSED_LOWERINGS.get(node.attrs["kind"])
    got = rule(ctx) if rule is not None else None
    if got is not None:
        return got
    ctx.reads = None
    return lower_parts(ctx), node.attrs["kind"] + " as parts"


def lower_parts(ctx: Lowering) -> StepFn:
    """A fused op as its body's ops, each lowered alone, run in one step."""
    body: Body = ctx.node.attrs["body"]
    steps, read = [], set()
    for n in body.nodes:
        if n.op == Op.PLACEHOLDER:
            continue
        sub = Lowering(ctx.plan, n, parent=ctx)
        fn, _ = lower(sub)
        reads = n.src if sub.reads is None else [n.src[i] for i in sub.reads]
        read |= {param(r) for r in reads if r.op == Op.PLACEHOLDER}
        steps.append((fn, [r.id for r in reads], n.id))
    ctx.reads = tuple(sorted(read))
    params = [body.params[i].id for i in ctx.reads]
    outs = [o.id for o in body.outputs]

    def run(*xs):
        vals = dict(zip(params, xs))
        for fn, ins, out in steps:
            vals[out] = fn(*[vals[i] for i in ins])
        results = [vals[i] for i in outs]
        return results[0] if len(results) == 1 else tuple(results)
    return run


def param(n: Node) -> int:
    """The fused op's source index that body node n (a parameter) stands for."""
    assert n.op == Op.PLACEHOLDER and "param" in n.attrs, f"{n} is not a parameter of the body"
    return n.attrs["param"]


def _weight(ctx: Lowering, m: Node) -> qmm.QuantizedWeight:
    """The prepared (re-packed, device) weight of a quantized matmul inside ctx's body."""
    arrays = [ctx.constant(param(s)) for s in m.src[1:]]
    return prepared_weight(arrays, m.attrs, ctx.device, ctx.cuda.words_layout)


def _group_weight(ctx: Lowering, matmuls: list[Node]) -> qmm.QuantizedWeight | None:
    """One weight for matmuls over one x: its own, or theirs side by side along N (None if they differ)."""
    if len(matmuls) == 1:
        return _weight(ctx, matmuls[0])
    members = [([ctx.constant(param(s)) for s in m.src[1:]], m.attrs) for m in matmuls]
    return concatenated_weight(members, ctx.device, ctx.cuda.words_layout)


# -- sibling matmuls, silu(gate) * up ------------------------------------------------------------------

@fused_lowering("siblings")
def _siblings(ctx: Lowering):
    body = ctx.node.attrs["body"]
    matmuls = body.find(Op.QUANTIZED_MATMUL)
    weight = _group_weight(ctx, matmuls)
    if weight is None:
        return None
    offsets = [int(o) for o in np.cumsum([0] + [m.type.shape[-1] for m in matmuls])]
    ctx.reads = (param(matmuls[0].src[0]),)
    ctx.plan.fusions.append(f"{len(matmuls)} sibling quantized matmuls")

    options = ctx.cuda

    def step(x):
        y = qmm.quantized_matmul(x, weight, options=options)
        return tuple(y[..., offsets[i]:offsets[i + 1]] for i in range(len(matmuls)))
    return step, "qkv"


def _gate_up(body: Body) -> tuple[Node, Node, Node, str]:
    """(the gate activation's input, the other factor, the matmul, the activation: silu or gelu_tanh)
    of a glu_gemv body."""
    act, _, up = glu_parts(body)
    return act.src[0], up, body.find(Op.QUANTIZED_MATMUL)[0], gate_activation(act)


@fused_lowering("glu_gemv")
def _glu_gemv(ctx: Lowering):
    """y = (act(a) * b) @ W: the word-layout GEMV computes act(a) * b as it loads x (act silu or gelu_tanh)."""
    gate, up, m, activation = _gate_up(ctx.node.attrs["body"])
    weight = _weight(ctx, m)
    rows = math.prod(m.src[0].type.shape[:-1])
    options = ctx.cuda
    if not weight.words or rows > options.gemv_rows:
        return None
    n_out = m.type.shape[-1]
    ctx.reads = (param(gate), param(up))
    ctx.plan.fusions.append(f"{activation}*mul into the GEMV")

    def step(a, b):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        if a2.stride() != b2.stride() or a2.stride(-1) != 1:
            a2, b2 = a2.contiguous(), b2.contiguous()
        y = torch.empty((a2.shape[0], n_out), dtype=a.dtype, device=a.device)
        qmm._words_gemv(b2, weight, y, {}, x_gate=a2, options=options, activation=activation)
        return y.reshape(*a.shape[:-1], n_out)
    return step, "glu_quantized_matmul"


# -- rms_norm in the GEMV's prologue --------------------------------------------------------------------

def _rms_norm_matmul(x, weight: qmm.QuantizedWeight, g, eps: float, add, behind: _ZeroAhead | None, options, **kw):
    """`qmm.rms_norm_matmul`, into the output the step before zeroed where there is one (`_ZeroAhead`):
    then the GEMV rounds its own x, with no quantize launch ahead of it."""
    y = behind.take() if behind is not None else None
    if y is None:
        return qmm.rms_norm_matmul(x, weight, g, eps, add=add, options=options, **kw)
    return qmm.rms_norm_matmul(x, weight, g, eps, add=add, out=y, config={"XQ_SELF": True, "ZEROED": True},
                               options=options, **kw)


def _glu_down(plan, weight: qmm.QuantizedWeight, eps: float, d_weight: qmm.QuantizedWeight, n_out: int,
              behind: _ZeroAhead | None, options, activation: str = "silu"):
    """compute(x, add or None, g) -> (x + add or None, (y,)): rms_norm -> gate+up GEMV -> act(gate) *
    up (act: `activation`, silu or gelu_tanh) -> down GEMV with no quantize launch between the two GEMVs:
    the gate+up launch zeroes the down GEMV's output and the down GEMV rounds act(gate) * up itself, each program its split
    (`qmm.rounds_own_x`). `behind`: the gate+up GEMV's output, zeroed by the step before
    (`_ZeroAhead`); the down GEMV zeroes the next step's."""
    half = weight.n // 2
    ahead = plan._zero_ahead = _ZeroAhead()
    plan.fusions += [f"{activation}*mul into the GEMV",
                     f"the gate+up GEMV zeroes the down GEMV's output, which rounds {activation}*mul itself"]

    def compute(x, b, g):
        lead = x.shape[:-1]
        rows = math.prod(lead)
        y_down = torch.empty((rows, n_out), dtype=torch.float32, device=x.device)
        got = _rms_norm_matmul(x, weight, g, eps, b, behind, options, zero=y_down)
        total, y = got if b is not None else (None, got)
        y2 = y.reshape(rows, 2 * half)
        qmm._words_gemv(y2[:, half:], d_weight, y_down, {"XQ_SELF": True, "ZEROED": True}, x_gate=y2[:, :half],
                        zero=ahead.make(x.device), options=options, activation=activation)
        return total, (y_down.reshape(*lead, n_out),)
    return compute


def _norm_gemv_parts(body: Body):
    """(add or None, norm, the GEMV node (a quantized matmul or a siblings op), its matmuls)."""
    norm = body.find(Op.RMS_NORM)[0]
    add = next((a for a in body.find(Op.ADD) if _feeds(a, norm)), None)
    gemv = next(n for n in body.nodes if (n.op == Op.QUANTIZED_MATMUL or (n.op == Op.FUSED and n.attrs["kind"] == "siblings"))
                and n.src and n.src[0] is norm)
    matmuls = [gemv] if gemv.op == Op.QUANTIZED_MATMUL else gemv.attrs["body"].find(Op.QUANTIZED_MATMUL)
    return add, norm, gemv, matmuls


def _feeds(add: Node, norm: Node) -> bool:
    """norm reads add through views (the residual sum of a norm_gemv body)."""
    x = norm.src[0]
    while x is not add and x.op in GroupOp.View:
        x = x.src[0]
    return x is add


@fused_lowering("norm_gemv")
@fused_lowering("norm_gemv_glu")
def _norm_gemv(ctx: Lowering):
    """[add ->] rms_norm -> quantized matmul(s) [-> silu(gate) * up -> down] as one step:
    `qmm.rms_norm_matmul` (the norm in the word GEMV's prologue; with the add, its sum stored by the same
    launch for the residual stream). Where the GEMV rounds its own x (`qmm.rounds_own_x`) and the step
    before can zero its output, it does (`_ZeroAhead`)."""
    node, plan = ctx.node, ctx.plan
    body: Body = node.attrs["body"]
    add, norm, gemv, matmuls = _norm_gemv_parts(body)
    k = norm.type.shape[-1]
    rows = math.prod(norm.type.shape[:-1])
    # the matmuls' weights are read through their own op's parameters (a siblings op nested in this body)
    owner = ctx if gemv.op == Op.QUANTIZED_MATMUL else Lowering(plan, gemv, parent=ctx)
    weight = _group_weight(owner, matmuls)
    options = ctx.cuda
    if weight is None or not weight.words or weight.k != k or rows > options.gemv_rows:
        return None
    glu = next((n for n in body.nodes if n.op == Op.FUSED and n.attrs["kind"] == "glu_gemv"), None)
    down = None
    if glu is not None:   # the down GEMV in the same step, rounding its own x
        _, _, d_node, activation = _gate_up(glu.attrs["body"])
        d_weight = _weight(Lowering(plan, glu, parent=ctx), d_node)
        if not (d_weight.words and qmm.rounds_own_x(rows, d_weight, options=options)):
            return None
        down = (d_node, d_weight)
    eps = norm.attrs["eps"]
    has_g = len(norm.src) > 1
    behind, plan._zero_ahead = plan._zero_ahead, None
    if behind is not None and qmm.rounds_own_x(rows, weight, options=options):
        behind.shape = (rows, weight.n)
        plan.fusions.append("the GEMV rounds its own x, its output zeroed by the step before")
    offsets = [int(o) for o in np.cumsum([0] + [m.type.shape[-1] for m in matmuls])]
    if down is not None:
        compute = _glu_down(plan, weight, eps, down[1], down[0].type.shape[-1], behind, options, activation)
        suffix = "+glu_gemv"
    else:
        def compute(x, b, g):
            got = _rms_norm_matmul(x, weight, g, eps, b, behind, options)
            total, y = got if b is not None else (None, got)
            return total, tuple(y[..., offsets[i]:offsets[i + 1]] for i in range(len(matmuls)))
        suffix = ""
    # what the body hands out: the sum (if read outside), then the GEMV's outputs or the down projection
    sum_out = add is not None and body.outputs[0] is add

    def results(total, ys):
        got = ((total,) if sum_out else ()) + tuple(ys)
        return got[0] if len(got) == 1 else got

    if add is not None:
        ctx.reads = (param(add.src[0]), param(add.src[1])) + ((param(norm.src[1]),) if has_g else ())

        def step(a, b, g=None):
            total, ys = compute(a, b, g)
            return results(total, ys)
        plan.fusions.append("add+rms_norm into the GEMV")
    else:
        ctx.reads = (param(norm.src[0]),) + ((param(norm.src[1]),) if has_g else ())

        def step(x, g=None):
            return results(None, compute(x, None, g)[1])
        plan.fusions.append("rms_norm into the GEMV")
    if len(matmuls) > 1:
        plan.fusions.append(f"{len(matmuls)} sibling quantized matmuls")
    return step, ("add_rms_norm_gemv" if add is not None else "rms_norm_gemv") + suffix


@fused_lowering("add_rms_norm")
def _add_rms_norm(ctx: Lowering):
    body = ctx.node.attrs["body"]
    add, norm = body.find(Op.ADD)[0], body.find(Op.RMS_NORM)[0]
    eps = norm.attrs["eps"]
    ctx.reads = (param(add.src[0]), param(add.src[1])) + ((param(norm.src[1]),) if len(norm.src) > 1 else ())
    ctx.plan.fusions.append("add+rms_norm")
    return (lambda a, b, w=None: fused.add_rms_norm(a, b, w, eps)), "add_rms_norm"


# -- RoPE, the KV-cache writes, the decode attention ---------------------------------------------------------

def _row_written(update: Node) -> Node:
    """The float row a cache write stores (an int8 cache's: what its codes quantize)."""
    return update.src[1].src[0] if update.src[1].op == Op.QUANTIZE else update.src[1]


def _rope_parts(body: Body) -> tuple[Node | None, Node, Node, Node | None, tuple[Node, Node] | None]:
    """(rope(q) or None, rope(k), k's cache write, v's cache write or None, an int8 cache's scale writes
    (k's, v's) or None) of a rope_* body (passes/fuse_rope_cache.py)."""
    updates = body.find(Op.SLICE_UPDATE)
    scales = [u for u in updates if u.src[1].op == Op.MAXIMUM]
    ku = next(u for u in updates if _row_written(u).op == Op.ROPE)
    vu = next((u for u in updates if u is not ku and u not in scales), None)
    kr = _row_written(ku)
    qr = next((r for r in body.find(Op.ROPE) if r is not kr), None)
    if not scales:
        return qr, kr, ku, vu, None
    ksu = next(u for u in scales if u.src[1] is ku.src[1].src[1])
    return qr, kr, ku, vu, (ksu, next(u for u in scales if u is not ksu))


def _inverse_frequencies(ctx: Lowering, rope: Node) -> tuple[np.ndarray | None, torch.Tensor]:
    """(host inverse frequencies or None where they are computed at run time, the device table)."""
    a = rope.attrs
    rd = a.get("rotary_dims") or rope.type.shape[-1]
    host = rope_inv_freq(rd, a.get("base", 10000.0))
    if len(rope.src) > 2:
        given = ctx.constant(param(rope.src[2]))
        host = None if given is None else np.ascontiguousarray(given).reshape(-1)
    return host, torch.as_tensor(rope_inv_freq(rd, a.get("base", 10000.0)), device=ctx.device)


def _rope_reads(ctx: Lowering, kr: Node, *inputs: Node):
    """(interleaved, the device inverse frequencies): ctx reads `inputs`, then rope(k)'s own frequencies
    where it has them (a step's last argument)."""
    _, table = _inverse_frequencies(ctx, kr)
    ctx.reads = tuple(param(x) for x in inputs) + ((param(kr.src[2]),) if len(kr.src) > 2 else ())
    return bool(kr.attrs.get("interleaved", False)), table


@fused_lowering("rope_kv_write")
def _rope_kv_write(ctx: Lowering):
    """rope(k) written into the cache at its position, in place (the KV-cache update of a layer)."""
    _, kr, ku, _, _ = _rope_parts(ctx.node.attrs["body"])
    interleaved, table = _rope_reads(ctx, kr, kr.src[0], kr.src[1], ku.src[0])
    ctx.plan.fusions.append("rope+kv write")

    def step(x, position, cache, inv=None):
        return fused.rope_into(cache, x, position, inv if inv is not None else table, interleaved)
    return step, "rope_into_cache"


@fused_lowering("rope_qkv_write")
def _rope_qkv_write(ctx: Lowering):
    """rope(q), rope(k) written into the k cache and v into the v cache at one runtime position: one kernel."""
    qr, kr, ku, vu, scales = _rope_parts(ctx.node.attrs["body"])
    interleaved, table = _rope_reads(ctx, kr, qr.src[0], kr.src[1], kr.src[0], ku.src[0], _row_written(vu), vu.src[0],
                                     *(u.src[0] for u in scales or ()))
    ctx.plan.fusions.append("rope q + rope k + v write into the caches" + (" (int8 rows)" if scales else ""))
    codes = 2 if scales else 0

    def step(q, position, k, k_cache, v, v_cache, *rest):
        inv = rest[codes:]
        q_out = fused.rope_qkv_into(q, k, v, position, inv[0] if inv else table, k_cache, v_cache, interleaved,
                                    rest[:2] if codes else None)
        return (q_out, k_cache, v_cache, *rest[:codes])
    return step, "rope_qkv_into_cache"


@fused_lowering("rope_qkv_attention")
def _rope_qkv_attention(ctx: Lowering):
    """The decode attention rotating q, writing the new k/v rows into the caches and attending, one kernel.
    Returns (output, k cache, v cache); takes out=, xq=, zero= as the SDPA step does (attention_gemv)."""
    plan, body = ctx.plan, ctx.node.attrs["body"]
    qr, kr, ku, vu, scales = _rope_parts(body)
    att = body.find(Op.SDPA)[0]
    inv_host, _ = _inverse_frequencies(ctx, kr)
    if inv_host is None:
        return None
    interleaved = bool(kr.attrs.get("interleaved", False))
    sdpa = att.attrs
    has_length, scale, causal = bool(sdpa.get("has_length")), sdpa.get("scale"), bool(sdpa.get("causal"))
    pos_i = param(kr.src[1])
    reads = [param(x) for x in (qr.src[0], kr.src[1], kr.src[0], ku.src[0], _row_written(vu), vu.src[0])]
    codes = 2 if scales else 0   # an int8 cache's scale caches, read after the caches
    reads += [param(u.src[0]) for u in scales or ()]
    if len(kr.src) > 2:
        reads.append(param(kr.src[2]))
    offset, length_i = 0, None
    if has_length:
        length = att.src[3]
        if length.op == Op.ADD:      # position + c: the kernel adds c (the pass made this sum the body's own)
            x, c = (length.src[0], length.src[1]) if ctx.constant(param(length.src[1])) is not None else length.src[::-1]
            offset = int(np.asarray(ctx.constant(param(c))))
            length_i = param(x)
            if "the decode kernel adds 1 to the position for its length" not in plan.fusions:
                plan.fusions.append("the decode kernel adds 1 to the position for its length")
        else:
            length_i = param(length)
        reads.append(length_i)
    ctx.reads = tuple(reads)
    rows = ku.src[0].type.shape[-2]
    key = (inv_host.tobytes(), rows)   # cos/sin of every cache position, one table for all layers
    if key not in plan._rope_tables:
        plan._rope_tables[key] = (torch.as_tensor(inv_host, device=ctx.device),
                                  attention_kernels.rope_table(inv_host, rows, ctx.device))
    inv_dev, cos_sin = plan._rope_tables[key]
    # the caches as the step found them (variables no earlier node of the step wrote): only this launch
    # writes them, so the decode kernel may read them before the kernel ahead ends; as the position and
    # length when fed (no kernel of the step computes them)
    source = ctx.source
    early = source(param(ku.src[0])).op == Op.VARIABLE and source(param(vu.src[0])).op == Op.VARIABLE and \
        source(pos_i).op in GroupOp.Source and (length_i is None or source(length_i).op in GroupOp.Source)
    plan.fusions.append("rope q + rope k + v write into the caches + attention")
    options = ctx.cuda

    def step(q, position, k, k_cache, v, v_cache, *rest, out=None, xq=None, zero=None):
        rope = attention_kernels.RopeWrite(position, inv_dev, k, v, interleaved, cos_sin)
        out = attention_kernels.attention(q, k_cache, v_cache, length=rest[-1] if has_length else None,
                                          scale=scale, causal=causal, rope=rope, out=out, xq=xq, zero=zero,
                                          length_offset=offset, early=early, scales=rest[:2] if codes else None,
                                          options=options)
        return (out, k_cache, v_cache, *rest[:codes])
    return step, "rope_qkv_attention"


@fused_lowering("attention_gemv")
def _attention_gemv(ctx: Lowering):
    """The attention step, then m = x @ W from its output, which the decode kernel stores rounded for the
    GEMV (`XQTarget`; weights under CudaOptions.attention_xq_bytes), or the GEMV rounds its own x, the decode kernel
    zeroing its output (`qmm.rounds_own_x`). The GEMV zeroes the output of the next step's first GEMV
    (`_ZeroAhead`)."""
    plan, body = ctx.plan, ctx.node.attrs["body"]
    m = body.find(Op.QUANTIZED_MATMUL)[-1]
    att = next(n for n in body.nodes if n.op == Op.SDPA or (n.op == Op.FUSED and n.attrs["kind"] == "rope_qkv_attention"))
    weight = _weight(ctx, m)
    rows, k = m.src[0].type.shape
    options = ctx.cuda
    if rows > options.gemv_rows:   # the word GEMM takes these rows: nothing to round or zero for a GEMV
        return None
    if not (weight.nbytes < options.attention_xq_bytes or
            (m.dtype == dt.float32 and qmm.rounds_own_x(rows, weight, options=options))):
        return None
    inner = Lowering(plan, att, parent=ctx)
    fn, name = lower(inner)
    if name.endswith(" as parts"):
        return None
    inner_reads = inner.reads if inner.reads is not None else range(len(att.src))
    ctx.reads = tuple(param(att.src[i]) for i in inner_reads)
    y_shape = tuple(m.type.shape)
    in_attention = weight.nbytes < options.attention_xq_bytes
    ahead = plan._zero_ahead = _ZeroAhead()
    plan.fusions.append("attention output rounded for the quantized matmul after it" if in_attention else
                        "attention zeroes the output of the quantized matmul after it, which rounds its own x")
    # which of the attention's outputs the body hands out after y (the caches a rope_qkv_attention wrote)
    items = {n.id: n.attrs["index"] for n in body.nodes if n.op == Op.GET_ITEM and n.src[0] is att}
    extra = [items[o.id] for o in body.outputs if o.id in items]

    def attention_gemv(*args):
        q = args[0]
        out = torch.empty((*q.shape[:-1], k // q.shape[-3]), dtype=q.dtype, device=q.device)
        x2 = out.view(rows, k)
        holder = {}
        if not qmm.gemv_takes_xq(rows, weight, options=options):
            holder["res"] = fn(*args, out=out)
            y = qmm.quantized_matmul(x2, weight, options=options)
        elif x2.dtype == torch.float32 and qmm.rounds_own_x(rows, weight, options=options):
            # the attention zeroes y and, where its kernel can (in_attention), rounds x for the GEMV;
            # where it did not, the GEMV rounds its own x: no quantize launch either way
            y = torch.empty((rows, weight.n), dtype=torch.float32, device=x2.device)
            limbs = qmm.gemv_takes_xq(rows, weight, options=options)
            buf = qmm.xq_buffers(rows, k, limbs, x2.device)
            target = attention_kernels.XQTarget(buf["xq_ptr"], buf["xd_ptr"], buf["xs_ptr"], limbs) \
                if in_attention else None
            holder["res"] = fn(*args, out=out, xq=target, zero=y)
            config = {"ZEROED": True, "LIMBS": limbs}
            if target is not None and target.written:
                quantize = (lambda *_, **__: buf)
            else:
                quantize, config["XQ_SELF"] = None, True
            qmm._words_gemv(x2, weight, y, config, quantize=quantize, zero=ahead.make(x2.device), options=options)
        else:
            def quantize(x2_, x_gate, limbs, norm, zero=None):
                buf = qmm.xq_buffers(rows, k, limbs, x2_.device)
                target = attention_kernels.XQTarget(buf["xq_ptr"], buf["xd_ptr"], buf["xs_ptr"], limbs, zero)
                holder["res"] = fn(*args, out=out, xq=target)
                return buf if target.written else qmm._quantize_x(x2_, None, limbs, None, zero=zero, options=options)
            y = torch.empty((rows, weight.n), dtype=x2.dtype, device=x2.device)
            qmm._words_gemv(x2, weight, y, {}, quantize=quantize, zero=ahead.make(x2.device), options=options)
        res = holder["res"]
        got = (y.view(y_shape),) + tuple(res[i] for i in extra)
        return got[0] if len(got) == 1 else got
    return attention_gemv, name + "+gemv"
