"""The CUDA backend's lowering table: one function per op, Lowering -> step function.

A step function takes the values of the node's sources (those `ctx.reads` names, all by default) as
torch tensors and returns its value. An op without an entry runs its NumPy reference on the host
(`host_reference`), which keeps the plan from being captured as a CUDA graph. Fused ops are lowered by
kind in fused_lowerings.py.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ... import dtypes as dt
from ...errors import IngotError
from ...ir import Node, Op, Ref
from ...options import CudaOptions
from ...ops import REGISTRY
from ...ops.nn import rope_inv_freq
from ...passes.fold import widens_weight
from ...passes.gemv_rules import identity_slice
from . import attention as attention_kernels
from . import fused
from . import quantized_matmul as qmm
from .device import constant_tensor, prepared_weight, to_device, to_host, torch_dtype

@dataclass
class _ZeroAhead:
    """The split-K output of a step's first GEMV when that GEMV rounds its own x (`qmm.rounds_own_x`):
    allocated by the step before it and zeroed by that step's last launch (`zero=`), so neither a
    quantize launch nor a memset runs between the two GEMVs. The consumer sets `shape` when the plan
    is built; `tensor` is None where the producer's launch did not zero it (the consumer then falls
    back to its quantize launch)."""
    shape: tuple | None = None
    tensor: torch.Tensor | None = None

    def make(self, device) -> torch.Tensor | None:
        self.tensor = None if self.shape is None else torch.empty(self.shape, dtype=torch.float32, device=device)
        return self.tensor

    def take(self) -> torch.Tensor | None:
        tensor, self.tensor = self.tensor, None
        return tensor


# -- lowerings ----------------------------------------------------------------------------------------

StepFn = Callable[..., Any]


class Lowering:
    """What a lowering sees: the node, the device, the program's constants, and a way to say that
    the step syncs with the host (such a plan is not captured as a CUDA graph). A node inside a fused
    op's body has the fused op's lowering as `parent`: its parameters stand for the fused op's sources."""

    def __init__(self, plan, node: Node, parent: "Lowering | None" = None):
        self.plan, self.node, self.device, self.parent = plan, node, plan.device, parent
        self.reads: tuple[int, ...] | None = None   # which sources the step takes (default: all)

    @property
    def cuda(self) -> CudaOptions:
        """The tuning the plan was compiled with (CompileOptions.cuda)."""
        return self.plan.options.cuda

    def source(self, src_index: int) -> Node:
        """The program's node that src[src_index] is (through fused bodies' parameters)."""
        s = self.node.src[src_index]
        if self.parent is not None and s.op == Op.PLACEHOLDER and "param" in s.attrs:
            return self.parent.source(s.attrs["param"])
        return s

    def constant(self, src_index: int) -> np.ndarray | None:
        s = self.source(src_index)
        return self.plan.program.constants[s.attrs["key"]] if s.op == Op.CONSTANT else None

    def syncs(self, why: str) -> None:
        self.plan.host_syncs.append(f"{self.node.op.name.lower()}: {why}")


LOWERINGS: dict[Op, Callable[[Lowering], StepFn]] = {}


def lowering(*ops: Op):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


_WARNED: set[str] = set()


def host_reference(ctx: Lowering) -> StepFn:
    """The op's NumPy reference on host copies: correct, slow, and a host sync (warned once per op)."""
    node = ctx.node
    name = node.op.name.lower()
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"ingot cuda: op {name} has no device lowering for {node.type}; it runs on the host "
                      "(slow, and the plan is not captured as a CUDA graph).", RuntimeWarning, stacklevel=2)
    ctx.syncs("runs on the host")
    ref, attrs, device = REGISTRY[node.op].reference, node.attrs, ctx.device

    def step(*xs):
        out = ref([to_host(x) for x in xs], attrs)
        if isinstance(out, tuple):
            return tuple(to_device(o, device) for o in out)
        return to_device(out, device)
    return step


_BINARY = {Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.POW: torch.pow,
           Op.MAXIMUM: torch.maximum, Op.MINIMUM: torch.minimum,
           Op.EQUAL: torch.eq, Op.NOT_EQUAL: torch.ne, Op.LESS: torch.lt, Op.LESS_EQUAL: torch.le,
           Op.GREATER: torch.gt, Op.GREATER_EQUAL: torch.ge, Op.LOGICAL_AND: torch.logical_and,
           Op.LOGICAL_OR: torch.logical_or, Op.LOGICAL_XOR: torch.logical_xor}
_UNARY = {Op.NEG: torch.neg, Op.ABS: torch.abs, Op.EXP: torch.exp, Op.LOG: torch.log, Op.SQRT: torch.sqrt,
          Op.RSQRT: torch.rsqrt, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid, Op.SILU: torch.nn.functional.silu,
          Op.ERF: torch.erf, Op.SIN: torch.sin, Op.COS: torch.cos, Op.LOGICAL_NOT: torch.logical_not}


@lowering(*_BINARY)
def _binary(ctx: Lowering) -> StepFn:
    op = ctx.node.op
    fn = _BINARY[op]
    if ctx.node.src[0].dtype == dt.bool_ and op in (Op.MAXIMUM, Op.MINIMUM):
        fn = torch.logical_or if op == Op.MAXIMUM else torch.logical_and
    if op == Op.POW and ctx.node.dtype.is_int:
        return host_reference(ctx)  # integer powers: NumPy's overflow and negative-exponent rules
    return fn


@lowering(Op.DIV)
def _div(ctx: Lowering) -> StepFn:
    if ctx.node.dtype.is_int:
        return lambda a, b: torch.div(a, b, rounding_mode="trunc")
    return torch.div


@lowering(*_UNARY)
def _unary(ctx: Lowering) -> StepFn:
    return _UNARY[ctx.node.op]


@lowering(Op.GELU)
def _gelu(ctx: Lowering) -> StepFn:
    approximate = ctx.node.attrs.get("approximate", "none")
    return lambda x: torch.nn.functional.gelu(x, approximate="tanh" if approximate == "tanh" else "none")


@lowering(Op.CAST)
def _cast(ctx: Lowering) -> StepFn:
    target = ctx.node.attrs["dtype"]
    td = torch_dtype(target)

    def cast(x):
        if target == dt.bool_:
            return x != 0
        if x.is_complex() and target != dt.complex64:
            x = x.real
        return x.to(td)
    return cast


@lowering(Op.WHERE)
def _where(ctx: Lowering) -> StepFn:
    return torch.where


@lowering(Op.REAL, Op.IMAG)
def _complex_part(ctx: Lowering) -> StepFn:
    part = torch.real if ctx.node.op == Op.REAL else torch.imag
    return lambda x: part(x).contiguous()


@lowering(Op.COMPLEX)
def _complex(ctx: Lowering) -> StepFn:
    return lambda a, b: torch.complex(*torch.broadcast_tensors(a, b))


# reductions

@lowering(Op.SUM, Op.MEAN, Op.MAX, Op.MIN)
def _reduce(ctx: Lowering) -> StepFn:
    node = ctx.node
    axes, keep = tuple(node.attrs["axes"]), bool(node.attrs.get("keepdims", False))
    out_dtype = torch_dtype(node.dtype)
    fn = {Op.SUM: torch.sum, Op.MEAN: torch.mean, Op.MAX: torch.amax, Op.MIN: torch.amin}[node.op]

    def reduce(x):
        if not axes:  # NumPy reduces over no axis: the input itself
            return x.to(out_dtype).clone()
        if node.op == Op.SUM and x.dtype == torch.bool:
            x = x.to(torch.int32)
        return fn(x, dim=axes, keepdim=keep).to(out_dtype)
    return reduce


@lowering(Op.ARGMAX, Op.ARGMIN)
def _arg(ctx: Lowering) -> StepFn:
    (axis,) = ctx.node.attrs["axes"]
    keep = bool(ctx.node.attrs.get("keepdims", False))
    fn = torch.argmax if ctx.node.op == Op.ARGMAX else torch.argmin
    return lambda x: fn(x, dim=axis, keepdim=keep).to(torch.int32)


@lowering(Op.SOFTMAX, Op.LOG_SOFTMAX)
def _softmax(ctx: Lowering) -> StepFn:
    axis = ctx.node.attrs["axis"]
    fn = torch.softmax if ctx.node.op == Op.SOFTMAX else torch.log_softmax
    return lambda x: fn(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, dim=axis).to(x.dtype)


# shapes

@lowering(Op.RESHAPE)
def _reshape(ctx: Lowering) -> StepFn:
    shape = tuple(ctx.node.type.shape)
    return lambda x: x.reshape(shape)


@lowering(Op.TRANSPOSE)
def _transpose(ctx: Lowering) -> StepFn:
    perm = tuple(ctx.node.attrs["perm"])
    return lambda x: x.permute(perm)


@lowering(Op.BROADCAST_TO)
def _broadcast(ctx: Lowering) -> StepFn:
    shape = tuple(ctx.node.attrs["shape"])
    return lambda x: x.expand(shape)


@lowering(Op.CONCAT)
def _concat(ctx: Lowering) -> StepFn:
    axis = ctx.node.attrs["axis"]
    return lambda *xs: torch.cat(xs, dim=axis)


def _pad_index(d: int, lo: int, hi: int, mode: str) -> np.ndarray:
    i = np.arange(-lo, d + hi)
    if mode == "edge":
        return np.clip(i, 0, d - 1)
    if mode == "reflect":
        period = 2 * (d - 1) if d > 1 else 1
        i = np.abs(i) % period
        return np.where(i >= d, period - i, i)
    period = 2 * d  # symmetric
    i = np.where(i < 0, -i - 1, i) % period
    return np.where(i >= d, period - 1 - i, i)


@lowering(Op.PAD)
def _pad(ctx: Lowering) -> StepFn:
    node = ctx.node
    pads, mode = node.attrs["pads"], node.attrs.get("mode", "constant")
    if mode == "constant":
        flat = [p for lo_hi in reversed(pads) for p in lo_hi]
        value = node.attrs.get("value", 0)
        return lambda x: torch.nn.functional.pad(x, flat, mode="constant", value=value)
    shape = node.src[0].type.shape
    index = [(axis, torch.as_tensor(_pad_index(shape[axis], lo, hi, mode), device=ctx.device))
             for axis, (lo, hi) in enumerate(pads) if lo or hi]

    def pad(x):
        for axis, idx in index:
            x = torch.index_select(x, axis, idx)
        return x
    return pad


@lowering(Op.GATHER)
def _gather(ctx: Lowering) -> StepFn:
    axis = ctx.node.attrs["axis"]
    n = ctx.node.src[0].type.shape[axis]

    def gather(x, idx):  # indices wrap like NumPy's take; out-of-range ones are clamped (no host check)
        flat = idx.reshape(-1).long()
        flat = torch.where(flat < 0, flat + n, flat).clamp(0, max(n - 1, 0))
        out = torch.index_select(x, axis, flat)
        return out.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])
    return gather


def _runtime(value, xs):
    return xs[value.index] if isinstance(value, Ref) else value


@lowering(Op.SLICE)
def _slice(ctx: Lowering) -> StepFn:
    node = ctx.node
    if identity_slice(node):   # no kernel: the clamped start can only be 0
        ctx.reads = (0,)
        return lambda x: x
    start, end, step = node.attrs["start"], node.attrs["end"], node.attrs["step"]
    size = node.attrs.get("size") or (None,) * len(start)
    shape = node.src[0].type.shape
    dynamic = [a for a in range(len(start)) if isinstance(start[a], Ref) or isinstance(end[a], Ref)]
    needs_host = [a for a in dynamic if size[a] is None]
    if needs_host:
        ctx.syncs("a runtime slice bound without a size")
    arange = {a: torch.arange(size[a], device=ctx.device) for a in dynamic if size[a] is not None}

    def static_index(a, s, e, st, sz):
        if sz is not None:
            s = s + shape[a] if s < 0 else s
            if not 0 <= s <= shape[a] - sz:
                raise IngotError(f"slice: start {s} with size {sz} does not fit axis {a} of length {shape[a]}.")
            return slice(s, s + sz, 1)
        return slice(s, e, st)

    def run(*xs):
        x = xs[0]
        out = x
        for a in range(len(start)):
            s, e, st, sz = start[a], end[a], step[a], size[a]
            if a in arange:  # device start, static size: gather the rows, no sync
                first = xs[s.index].reshape(()).long()
                first = torch.where(first < 0, first + shape[a], first).clamp(0, shape[a] - sz)
                out = torch.index_select(out, a, first + arange[a])
                continue
            if isinstance(s, Ref) or isinstance(e, Ref):
                s = int(xs[s.index]) if isinstance(s, Ref) else s
                e = int(xs[e.index]) if isinstance(e, Ref) else e
            sl = static_index(a, s, e, st, sz)
            if sl.step is not None and sl.step < 0:
                idx = torch.arange(*sl.indices(shape[a]), device=x.device)
                out = torch.index_select(out, a, idx)
            elif sl != slice(None, None, 1) and sl != slice(0, None, 1):
                out = out[(slice(None),) * a + (sl,)]
        return out
    return run


@lowering(Op.SLICE_UPDATE)
def _slice_update(ctx: Lowering) -> StepFn:
    node = ctx.node
    start = node.attrs["start"]
    inplace = bool(node.attrs.get("inplace"))
    shape = node.type.shape
    runtime = any(isinstance(s, Ref) for s in start)

    def update(*xs):
        x, u = xs[0], xs[1]
        target = x if inplace else x.clone()
        if runtime:
            return fused.slice_write(target, u, [_runtime(s, xs) for s in start])
        for a, (s, n) in enumerate(zip(start, u.shape)):
            if not 0 <= s <= shape[a] - n:
                raise IngotError(f"slice_update: start {s} + update length {n} does not fit axis {a} of length {shape[a]}.")
        target[tuple(slice(s, s + n) for s, n in zip(start, u.shape))] = u
        return target
    return update


@lowering(Op.ARRAY_VIEW)
def _array_view(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    shape, strides, offset = tuple(a["shape"]), tuple(a["strides"]), a.get("offset", 0)
    if any(s < 0 for s in strides):  # torch views cannot run backwards: gather the elements (a copy)
        index = np.full(shape, offset, np.int64)
        for axis, (n, st) in enumerate(zip(shape, strides)):
            index += (np.arange(n) * st).reshape((-1,) + (1,) * (len(shape) - axis - 1))
        flat_index = torch.as_tensor(index, device=ctx.device)
        return lambda x: x.contiguous().reshape(-1)[flat_index]
    return lambda x: torch.as_strided(x.contiguous().reshape(-1), shape, strides, offset)


@lowering(Op.DIM)
def _dim(ctx: Lowering) -> StepFn:
    value = torch.tensor(ctx.node.src[0].type.shape[ctx.node.attrs["axis"]], dtype=torch.int32, device=ctx.device)
    return lambda x: value


# linear algebra and the transformer ops

def with_float32_precision(ctx: Lowering, fn: StepFn) -> StepFn:
    """fn with torch's TF32 switches (cuDNN's and cuBLAS's, process-wide) set to the plan's
    cuda.float32_precision for the call and put back after, so that a float32 product does not
    depend on what else in the process set them."""
    tf32 = ctx.cuda.float32_precision == "tf32"

    def step(*xs):
        matmul = torch.backends.cuda.matmul
        before = matmul.allow_tf32
        matmul.allow_tf32 = tf32
        try:
            with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
                return fn(*xs)
        finally:
            matmul.allow_tf32 = before
    return step


@lowering(Op.CONV)
def _conv(ctx: Lowering) -> StepFn:
    """cuDNN through torch (cuda.float32_precision); uneven padding as a pad first."""
    a = ctx.node.attrs
    fn = (None, torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[ctx.node.type.rank - 2]
    even = all(lo == hi for lo, hi in a["pads"])
    flat = tuple(v for lo, hi in reversed(a["pads"]) for v in (lo, hi))   # torch's pad: last axis first

    def conv(x, w, b=None):
        x = x if even else torch.nn.functional.pad(x, flat)
        return fn(x, w, b, a["strides"], tuple(lo for lo, _ in a["pads"]) if even else 0, a["dilations"], a["groups"])
    return with_float32_precision(ctx, conv)


@lowering(Op.MATMUL)
def _matmul(ctx: Lowering) -> StepFn:
    if not ctx.node.dtype.is_float:
        return host_reference(ctx)  # cuBLAS has no integer GEMM through torch
    if narrow_weight(ctx.node) is not None:
        return _narrow_weight_matmul(ctx)
    return with_float32_precision(ctx, torch.matmul)


def narrow_weight(node: Node) -> Node | None:
    """The bf16 constant W of matmul(x, cast(W, float32)) with a float32 x, else None."""
    w = node.src[1]
    if node.op != Op.MATMUL or not widens_weight(w) or w.type.rank != 2 or node.src[0].dtype != dt.float32:
        return None
    return w.src[0]


def _narrow_weight_matmul(ctx: Lowering) -> StepFn:
    """y = x @ W for a bf16 weight W [K, N] kept in its own dtype on the device: no float32
    copy of W is ever made (the cast node feeding it is not lowered; see CudaPlan).

    x is rounded to W's dtype and cuBLAS multiplies in that dtype with float32 accumulation (what a
    torch.compile bf16 model does). That rounding of x (relative 2^-9 for bf16) is the accuracy cost:
    expect about 1e-2 relative error in y against a float32 product, not 1e-5. The float32 result
    comes straight from the GEMM where torch.mm has out_dtype (CUDA), else from a bf16 result
    widened (one more rounding, same order)."""
    weight = constant_tensor(ctx.plan.program.constants[narrow_weight(ctx.node).attrs["key"]], ctx.device)
    ctx.reads = (0,)  # the step takes x only: the weight lives on the device in its own dtype
    k, n = weight.shape
    direct = qmm.mm_out_dtype(ctx.device)

    def matmul(x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k).to(weight.dtype)
        y = torch.mm(x2, weight, out_dtype=torch.float32) if direct else torch.mm(x2, weight).float()
        return y.reshape(*lead, n)
    return matmul


@lowering(Op.RMS_NORM)
def _rms_norm(ctx: Lowering) -> StepFn:
    eps = ctx.node.attrs["eps"]
    return lambda x, w=None: fused.rms_norm(x, w, eps)


@lowering(Op.LAYER_NORM)
def _layer_norm(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    eps, has_w, has_b = a["eps"], a.get("has_weight"), a.get("has_bias")

    def norm(x, *params):
        w = params[0].float() if has_w else None
        b = params[-1].float() if has_b else None
        return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
    return norm


@lowering(Op.ROPE)
def _rope(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    d = ctx.node.type.shape[-1]
    rd = a.get("rotary_dims") or d
    interleaved = bool(a.get("interleaved", False))
    table = torch.as_tensor(rope_inv_freq(rd, a.get("base", 10000.0)), device=ctx.device)

    def rope(x, pos, inv_freq=None):
        return fused.rope(x, pos, table if inv_freq is None else inv_freq, interleaved)
    return rope


@lowering(Op.SDPA)
def _sdpa(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    scale, causal, has_mask, has_length = a.get("scale"), bool(a.get("causal")), a.get("has_mask"), a.get("has_length")
    if a.get("kv_scales"):   # an int8 cache: codes and row scales, the last two sources
        return _sdpa_codes(ctx)
    if a.get("window") or a.get("softcap"):   # no kernel takes a sliding window or a softcap yet: torch ops
        window, softcap = a.get("window", 0), a.get("softcap", 0.0)

        def windowed(q, k, v, *rest, out=None, xq=None, zero=None):
            return _into(_sdpa_torch(q, k, v, rest[0] if has_mask else None, rest[-1] if has_length else None, scale,
                                     causal, window, softcap), out, zero)
        return windowed
    options = ctx.cuda

    def sdpa(q, k, v, *rest, out=None, xq=None, zero=None):
        mask = rest[0] if has_mask else None
        length = rest[-1] if has_length else None
        return attention_kernels.attention(q, k, v, length=length, scale=scale, causal=causal, mask=mask, out=out,
                                           xq=xq, zero=zero, options=options)
    return sdpa


def _sdpa_codes(ctx: Lowering) -> StepFn:
    """Attention over an int8 cache (codes, row scales): the decode and flash kernels read the codes and
    scales tile by tile; a sliding window, a softcap or a mask (no kernel takes them yet) as torch ops."""
    a = ctx.node.attrs
    has_mask, has_length = a.get("has_mask"), a.get("has_length")
    if not (has_mask or a.get("window") or a.get("softcap")):
        options = ctx.cuda

        def kernel(q, k, v, *rest, out=None, xq=None, zero=None):
            return attention_kernels.attention(q, k, v, length=rest[0] if has_length else None, scale=a.get("scale"),
                                               causal=bool(a.get("causal")), out=out, xq=xq, zero=zero,
                                               scales=tuple(rest[-2:]), options=options)
        return kernel

    def step(q, k, v, *rest, out=None, xq=None, zero=None):
        k_scales, v_scales = rest[-2:]
        return _into(_sdpa_torch(q, k.float() * k_scales, v.float() * v_scales, rest[0] if has_mask else None,
                                 rest[-3] if has_length else None, a.get("scale"), bool(a.get("causal")),
                                 a.get("window", 0), a.get("softcap", 0.0)), out, zero)
    return step


def _into(y, out, zero):
    """A torch-op attention step's result y, handed on as the kernels hand theirs: zero (the split-K
    output of the GEMV after the attention, which the decode kernel clears in its own launch) cleared,
    y copied into out when given."""
    if zero is not None:
        zero.zero_()
    if out is not None:
        out.copy_(y)
        return out
    return y


def _sdpa_torch(q, k, v, mask, length, scale, causal: bool, window: int, softcap: float):
    """ops/nn.py's `sdpa` (softcap, sliding window, GQA, rows that see no key give zeros) as torch ops in
    float32, with no host sync: a length masks the keys from it on instead of slicing them off."""
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    group = q.shape[-3] // k.shape[-3]
    kf = k.float().repeat_interleave(group, dim=-3)
    vf = v.float().repeat_interleave(group, dim=-3)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * float(np.float32(scale if scale is not None else 1 / math.sqrt(d)))
    if softcap:
        c = float(np.float32(softcap))
        s = c * torch.tanh(s / c)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    keys = torch.arange(tk, device=q.device)
    allowed = None
    if length is not None:
        n = length.reshape(()).to(torch.int64)
        allowed = (keys < n)[None, :]
        end = n
    else:
        end = tk
    if causal:
        query_pos = torch.arange(tq, device=q.device)[:, None] + (end - tq)
        seen = keys[None, :] <= query_pos
        if window:
            seen = seen & (keys[None, :] > query_pos - window)
        allowed = seen if allowed is None else allowed & seen
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    dead = ~torch.isfinite(s.amax(dim=-1, keepdim=True))
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return torch.matmul(p, vf).to(q.dtype)


# quantization

def _weight_arrays(ctx: Lowering, first: int, count: int) -> list[np.ndarray] | None:
    arrays = [ctx.constant(i) for i in range(first, first + count)]
    return None if any(a is None for a in arrays) else arrays


@lowering(Op.QUANTIZED_MATMUL)
def _quantized_matmul(ctx: Lowering) -> StepFn:
    node, options = ctx.node, ctx.cuda
    arrays = _weight_arrays(ctx, 1, len(node.src) - 1)
    if arrays is None:  # a weight computed at run time: re-pack it on the device every run
        attrs = node.attrs
        return lambda x, q, *params: qmm.quantized_matmul(
            x, qmm.prepare_weight(to_host(q), [to_host(p) for p in params], attrs, x.device, options.words_layout),
            options=options)
    weight = prepared_weight(arrays, node.attrs, ctx.device, options.words_layout)
    ctx.reads = (0,)  # the step takes x only: the weight lives re-packed on the device
    return lambda x: qmm.quantized_matmul(x, weight, options=options)


@lowering(Op.QUANTIZED_GATHER)
def _quantized_gather(ctx: Lowering) -> StepFn:
    node = ctx.node
    arrays = _weight_arrays(ctx, 0, len(node.src) - 1)
    if arrays is None:
        return host_reference(ctx)
    # the table as a k-major [K, N] weight: a quantized_matmul's layout (transpose=False)
    weight = prepared_weight(arrays, dict(node.attrs, transpose=False), ctx.device)
    axis, out_dtype = node.attrs.get("axis", 0), torch_dtype(node.dtype)
    ctx.reads = (len(node.src) - 1,)
    if getattr(weight, "scaled", False):   # a scaled table (GGUF's IQ types, MXFP4): no GEMV output zeroed ahead
        ctx.plan._zero_ahead = None
        return lambda idx: qmm.gguf_kernels.scaled_gather(weight, idx, axis, out_dtype)
    # the embedding's launch zeroes the first layer's GEMV output where that GEMV rounds its own x
    ahead = ctx.plan._zero_ahead = _ZeroAhead()
    return lambda idx: fused.quantized_gather(weight, idx, axis, out_dtype, zero=ahead.make(idx.device))


def _unpack(q: torch.Tensor, qdtype: dt.DType) -> torch.Tensor:
    if not qdtype.packed:
        return q
    v = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    if qdtype.kind == "i":
        v = (v.to(torch.int8) << 4) >> 4
    return v


def _expand(p: torch.Tensor, shape) -> torch.Tensor:
    for axis, (pd, d) in enumerate(zip(p.shape, shape)):
        if pd != d and pd != 1:
            p = p.repeat_interleave(d // pd, dim=axis)
    return p


@lowering(Op.DEQUANTIZE)
def _dequantize(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    qdtype, out_dtype = a["qdtype"], torch_dtype(a["dtype"])

    def dequantize(q, *params):
        v = _unpack(q, qdtype)
        if a["mode"] in ("lut", "scaled_lut"):   # scaled_lut: GGUF's IQ types, MXFP4 (lut[v] * scale in float32)
            lut = params[0].float()
            table = _expand(lut, tuple(v.shape) + (lut.shape[-1],)).expand(*v.shape, lut.shape[-1])
            idx = (v.long() % lut.shape[-1]).unsqueeze(-1)  # NumPy's negative indices wrap
            w = torch.gather(table, -1, idx).squeeze(-1)
            if a["mode"] == "scaled_lut":
                w = w * _expand(params[1].float(), v.shape)
                if a.get("has_bias"):
                    w = w + _expand(params[2].float(), v.shape)
            return w.to(out_dtype)
        it = iter(params)
        w = v.float()
        scale = next(it).float()
        if a.get("has_zero_point"):
            w = w - _expand(next(it).float(), v.shape)
        w = w * _expand(scale, v.shape)
        if a.get("has_bias"):
            w = w + _expand(next(it).float(), v.shape)
        return w.to(out_dtype)
    return dequantize


@lowering(Op.QUANTIZE)
def _quantize(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    if a["mode"] == "lut":
        return host_reference(ctx)
    from ...ops.quant import RANGES
    target = a["dtype"]
    lo, hi = RANGES[target.name]

    def quantize(x, scale, *zp):
        q = torch.round(x.float() / _expand(scale.float(), x.shape))
        if zp:
            q = q + _expand(zp[0].float(), x.shape)
        q = q.clamp(lo, hi).to(torch.int16)
        if target.packed:
            nib = (q & 0xF).to(torch.uint8)
            return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()
        return q.to(torch_dtype(target))
    return quantize


@lowering(Op.GET_ITEM)
def _get_item(ctx: Lowering) -> StepFn:
    index = ctx.node.attrs["index"]
    return lambda outs: outs[index]


def _call(ctx: Lowering, executable) -> StepFn:
    """A call, or an if: its condition (src 0) read on the host picks which bound executable runs.

    A call's executable runs eagerly inside the caller's step while the caller is captured, so the
    caller's CUDA graph records its launches too (an adapter on a decode step no longer makes the step
    eager: a compensated SmolLM2 head decoded at 28.9 tok/s on an H100 against 1,597 without it). The
    caller's plan keys its graphs by the executables bound when they were captured
    (`CudaPlan.bound_callees`), so a re-bind captures anew; an if reads its condition on the host, and
    stays eager."""
    node = ctx.node
    on_gpu = ctx.plan.device.type == "cuda"
    if node.op == Op.IF:
        ctx.syncs("an if (its condition is read on the host)")
    else:
        ctx.plan.call_names.append(node.attrs["name"])

    def call(*xs, name=node.attrs.get("name")):
        target = executable.callables.get(name)
        if target is None:
            raise IngotError(f"call: no executable is bound to {name!r}; pass callables={{{name!r}: exe}} or exe.bind().")
        # inside the caller's capture: eagerly, recorded into its graph; else as it runs alone (its own graph)
        outs = target.run_values(list(xs), graph=not (on_gpu and torch.cuda.is_current_stream_capturing()))
        return tuple(o.clone() if any(_shares(o, x) for x in xs) else o for o in outs)

    if node.op == Op.IF:
        def branch(cond, *xs):
            return call(*xs, name=node.attrs["then"] if bool(cond.reshape(-1)[0].item()) else node.attrs["else"])
        return branch
    return call


def _shares(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
