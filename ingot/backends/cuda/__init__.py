"""The CUDA backend: torch tensors for device memory, our Triton kernels where fusion or quantization
matters (attention, quantized matmul/gather, norms, RoPE, KV writes, generated elementwise
regions), torch ops for the rest, and the whole run captured as one CUDA graph once it repeats.

The program is lowered once into a flat list of steps over value slots, like the CPU backend.
Lowerings are a table keyed by op. Plan-level fusions (all checked against the NumPy reference):
  - sibling quantized matmuls reading one x (q/k/v, gate/up) run as one GEMV over a weight
    concatenated at load;
  - a residual add followed by rms_norm is one kernel writing both;
  - rms_norm (with the residual add before it) feeding only word-layout GEMVs of float32 rows (a
    single one or a sibling group) is the GEMV's prologue, no norm launch (INGOT_CUDA_NORM_GEMV=0 turns
    it off; H200: SmolLM2 replay 886 us/step with it, 951 without, 187 kernels instead of 248);
  - a fusion region of float elementwise ops is one generated kernel.
An op with no device lowering runs its NumPy reference on host copies, with a warning: such a
plan is not captured as a graph.

    >>> exe = g.compile(feeds=..., targets=[y], device="cuda")       # doctest: +SKIP
    >>> exe.run({"x": np.ones(4, np.float32)})[0]                    # a torch tensor on the GPU  # doctest: +SKIP

Environment: INGOT_CUDA_GRAPHS=0 turns graph capture off; INGOT_CUDA_DEVICE=cpu runs the same
code on the CPU under TRITON_INTERPRET=1 (kernel tests without a GPU).
"""
from __future__ import annotations

import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np
import torch
import triton  # noqa: F401  (an ImportError here tells get_backend that the extra is missing)

from ... import dtypes as dt
from ...errors import IngotError
from ...ir import GroupOp, Node, Op, Program, Ref, TensorType
from ...ops import REGISTRY
from ...ops.nn import rope_inv_freq
from ...passes.fold import widens_weight
from . import attention as attention_kernels
from . import fused
from . import quantized_matmul as qmm

if os.environ.get("TRITON_INTERPRET") == "1":  # development without a GPU (see the module docstring)
    from triton.runtime import interpreter as _interpreter
    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        """Program ids have the shape (1,) in the interpreter; numpy 2 refuses int() of those in range()."""
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    _interpreter._patch_lang_tensor = _patch_lang_tensor

TORCH_DTYPE = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
    "uint8": torch.uint8, "int4": torch.uint8, "uint4": torch.uint8, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool, "complex64": torch.complex64,
}


def torch_dtype(d: dt.DType) -> torch.dtype:
    return TORCH_DTYPE[d.name]


def device_name() -> str:
    return os.environ.get("INGOT_CUDA_DEVICE", "cuda")


# -- host <-> device ----------------------------------------------------------------------------------

def to_device(array, device) -> torch.Tensor:
    """A numpy array (bfloat16 from ml_dtypes included) as a device tensor."""
    a = np.asarray(array)
    if a.dtype == ml_dtypes.bfloat16:
        return to_device(a.view(np.int16), device).view(torch.bfloat16)
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only arrays (memory-mapped weights) are only read
        t = torch.from_numpy(a)
    return t.to(device)


def to_host(value) -> np.ndarray:
    """A device tensor as a numpy array (bfloat16 via ml_dtypes); other values pass through."""
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return value.detach().cpu().numpy()


_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _cached(array: np.ndarray, key: tuple, make: Callable[[], Any]):
    """One device copy per host constant (prefill and decode executables share their weights)."""
    full = (id(array),) + key
    hit = _DEVICE_CONSTANTS.get(full)
    if hit is None:
        hit = _DEVICE_CONSTANTS[full] = make()
        weakref.finalize(array, _DEVICE_CONSTANTS.pop, full, None)
    return hit


def constant_tensor(array: np.ndarray, device) -> torch.Tensor:
    return _cached(array, ("tensor", str(device)), lambda: to_device(array, device))


WORDS_LAYOUT = os.environ.get("INGOT_CUDA_WORDS", "1") == "1"   # matmul weights in the dp4a GEMV's word layout
# a decode attention rounds its output for the quantized matmul after it (no quantize launch between
# them) where that matmul's weight is smaller than this; 0: never. H200, steps replayed: SmolLM2's o
# (0.2 MB) 653 us with it against 679 (eighth session). Llama-3-8B's o (10.5 MB) lost then (2054 against
# 1987, with the 8 MiB limit this had until the fourteenth session) but wins since the attention's early
# loads: 1896.6 / 1896.3 us against 1919.9 / 1918.7 (fourteenth session, two calls)
ATTENTION_XQ_BYTES = int(os.environ.get("INGOT_CUDA_ATTENTION_XQ_BYTES", str(256 << 20)))


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


def _sum_through_views(x: Node) -> Node:
    """The ADD that x is through reshapes and `identity_slice`s to x's own shape (a decode step's row `last`
    of the last layer's sum), else x."""
    y = x
    while y.op == Op.RESHAPE or identity_slice(y):
        y = y.src[0]
    return y if y.op == Op.ADD and y.type.static and y.type.shape == x.type.shape else x


def _plus_constant(node: Node, constants: dict) -> tuple[Node, int] | None:
    """(x, c) when node is x + c for a 0-d integer x computed at run time and a 0-d integer constant c
    (a decode step's attention length: its position + 1), else None."""
    if node.op != Op.ADD or node.type.rank != 0 or not node.dtype.is_int:
        return None
    x, c = node.src if node.src[1].op == Op.CONSTANT else node.src[::-1]
    if c.op != Op.CONSTANT or x.op == Op.CONSTANT or x.type != node.type or c.type != node.type:
        return None
    value = np.asarray(constants[c.attrs["key"]])
    return (x, int(value)) if value.shape == () and abs(int(value)) < 1 << 30 else None


def _last_axis_slice(node: Node, src: Node) -> tuple[int, int] | None:
    """(start, stop) when node is src[..., start:stop] (static, step 1, every other axis whole), else None."""
    if node.op != Op.SLICE or node.src[0] is not src or not src.type.static or \
            any(sz is not None for sz in node.attrs.get("size") or ()):
        return None
    start, end, step = node.attrs["start"], node.attrs["end"], node.attrs["step"]
    shape = src.type.shape
    if any(isinstance(v, Ref) for v in (*start, *end)) or any(st != 1 for st in step):
        return None
    spans = [range(*slice(a, b).indices(d)) for a, b, d in zip(start, end, shape)]
    if any(len(r) != d for r, d in zip(spans[:-1], shape[:-1])):
        return None
    return spans[-1].start, spans[-1].stop


def prepared_weight(arrays: list[np.ndarray], attrs: dict, device, words: bool = False) -> qmm.QuantizedWeight:
    key = ("qweight", str(device), attrs["mode"], attrs["qdtype"].name, bool(attrs.get("transpose")),
           bool(attrs.get("has_zero_point")), bool(attrs.get("has_bias")), words) + tuple(id(a) for a in arrays[1:])
    return _cached(arrays[0], key, lambda: qmm.prepare_weight(arrays[0], list(arrays[1:]), attrs, device, words))


def concatenated_weight(members: list[tuple[list[np.ndarray], dict]], device) -> qmm.QuantizedWeight | None:
    """The weights of sibling matmuls side by side along N (one GEMV for q/k/v), or None if they differ in kind."""
    key = ("qconcat", str(device), WORDS_LAYOUT) + tuple((id(a), attrs["qdtype"].name, bool(attrs.get("transpose")))
                                           for arrays, attrs in members for a in arrays)
    first = members[0][0][0]
    hit = _DEVICE_CONSTANTS.get((id(first),) + key)
    if hit is not None:
        return hit
    joined = qmm.concatenate([qmm.prepare_weight(arrays[0], list(arrays[1:]), attrs, device, WORDS_LAYOUT)
                              for arrays, attrs in members])
    if joined is None:
        return None
    return _cached(first, key, lambda: joined)


# -- lowerings ----------------------------------------------------------------------------------------

StepFn = Callable[..., Any]


class Lowering:
    """What a lowering sees: the node, the device, the program's constants, and a way to say that
    the step syncs with the host (such a plan is not captured as a CUDA graph)."""

    def __init__(self, plan: "CudaPlan", node: Node):
        self.plan, self.node, self.device = plan, node, plan.device
        self.reads: tuple[int, ...] | None = None   # which sources the step takes (default: all)

    def constant(self, src_index: int) -> np.ndarray | None:
        s = self.node.src[src_index]
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


def identity_slice(node: Node) -> bool:
    """Whether a slice is its input on this backend: static shapes, the output the input's type, steps 1
    and no runtime end. A runtime start with a static size is clamped into the axis here (no host
    check, see `_slice`), so a size spanning the axis starts at 0 (a decode step's row `last` of 1)."""
    if node.op != Op.SLICE or not (node.type.static and node.src[0].type == node.type):
        return False
    return all(st == 1 for st in node.attrs["step"]) and not any(isinstance(e, Ref) for e in node.attrs["end"])


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

@lowering(Op.MATMUL)
def _matmul(ctx: Lowering) -> StepFn:
    if not ctx.node.dtype.is_float:
        return host_reference(ctx)  # cuBLAS has no integer GEMM through torch
    if narrow_weight(ctx.node) is not None:
        return _narrow_weight_matmul(ctx)
    return torch.matmul


def narrow_weight(node: Node) -> Node | None:
    """The bf16 constant W of matmul(x, cast(W, float32)) with a float32 x, else None."""
    w = node.src[1]
    if node.op != Op.MATMUL or not widens_weight(w) or w.type.rank != 2 or node.src[0].dtype != dt.float32:
        return None
    return w.src[0]


_MM_OUT_DTYPE: dict[str, bool] = {}


def _mm_out_dtype(device) -> bool:
    """Whether torch.mm(a16, b16, out_dtype=torch.float32) runs here (CUDA in recent torch; not the CPU)."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.zeros((2, 2), dtype=torch.bfloat16, device=device)
            _MM_OUT_DTYPE[key] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


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
    direct = _mm_out_dtype(ctx.device)

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

    def sdpa(q, k, v, *rest, out=None, xq=None, zero=None):
        mask = rest[0] if has_mask else None
        length = rest[-1] if has_length else None
        return attention_kernels.attention(q, k, v, length=length, scale=scale, causal=causal, mask=mask, out=out,
                                           xq=xq, zero=zero)
    return sdpa


# quantization

def _weight_arrays(ctx: Lowering, first: int, count: int) -> list[np.ndarray] | None:
    arrays = [ctx.constant(i) for i in range(first, first + count)]
    return None if any(a is None for a in arrays) else arrays


@lowering(Op.QUANTIZED_MATMUL)
def _quantized_matmul(ctx: Lowering) -> StepFn:
    node = ctx.node
    arrays = _weight_arrays(ctx, 1, len(node.src) - 1)
    if arrays is None:  # a weight computed at run time: re-pack it on the device every run
        attrs = node.attrs
        return lambda x, q, *params: qmm.quantized_matmul(
            x, qmm.prepare_weight(to_host(q), [to_host(p) for p in params], attrs, x.device, WORDS_LAYOUT))
    weight = prepared_weight(arrays, node.attrs, ctx.device, WORDS_LAYOUT)
    ctx.reads = (0,)  # the step takes x only: the weight lives re-packed on the device
    return lambda x: qmm.quantized_matmul(x, weight)


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
        if a["mode"] == "lut":
            lut = params[0].float()
            table = _expand(lut, tuple(v.shape) + (lut.shape[-1],)).expand(*v.shape, lut.shape[-1])
            idx = (v.long() % lut.shape[-1]).unsqueeze(-1)  # NumPy's negative indices wrap
            return torch.gather(table, -1, idx).squeeze(-1).to(out_dtype)
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


# fft

_FORWARD = {"none": "backward", "size": "forward", "unitary": "ortho"}
_INVERSE = {"none": "forward", "size": "backward", "unitary": "ortho"}


@lowering(Op.FFT, Op.IFFT, Op.RFFT, Op.IRFFT)
def _fft(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    axes, norm, op = tuple(a["axes"]), a["norm"], ctx.node.op
    if op == Op.FFT:
        return lambda x: torch.fft.fftn(x, dim=axes, norm=_FORWARD[norm]).to(torch.complex64)
    if op == Op.IFFT:
        return lambda x: torch.fft.ifftn(x, dim=axes, norm=_INVERSE[norm]).to(torch.complex64)
    if op == Op.RFFT:
        return lambda x: torch.fft.rfftn(x, dim=axes, norm=_FORWARD[norm])
    out_shape = ctx.node.type.shape
    s = [out_shape[ax] for ax in axes]
    return lambda x: torch.fft.irfftn(x, s=s, dim=axes, norm=_INVERSE[norm]).to(torch.float32)


@lowering(Op.GET_ITEM)
def _get_item(ctx: Lowering) -> StepFn:
    index = ctx.node.attrs["index"]
    return lambda outs: outs[index]


def _call(ctx: Lowering, executable) -> StepFn:
    name = ctx.node.attrs["name"]
    ctx.syncs("a call (its executable can be re-bound)")

    def call(*xs):
        target = executable.callables.get(name)
        if target is None:
            raise IngotError(f"call: no executable is bound to {name!r}; pass callables={{{name!r}: exe}} or exe.bind().")
        outs = target.run(list(xs))
        return tuple(o.clone() if any(_shares(o, x) for x in xs) else o for o in outs)
    return call


def _shares(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- the plan -----------------------------------------------------------------------------------------

class CudaPlan:
    """A program lowered to a flat list of device steps; captured as a CUDA graph once it repeats."""

    def __init__(self, program: Program, executable, device: torch.device):
        self.program = program
        self.device = device
        self.host_syncs: list[str] = []
        nodes = program.nodes()
        self.nodes = nodes
        self.slot = {n.id: i for i, n in enumerate(nodes)}
        by_id = {n.id: n for n in nodes}
        users: dict[int, list[Node]] = {n.id: [] for n in nodes}
        for n in nodes:
            for s in n.src:
                users[s.id].append(n)
        roots = {n.id for n in program.roots}
        self.initial: list[Any] = [None] * len(nodes)
        self.feed_slots: list[tuple[str, int, TensorType]] = []
        self.variable_slots: list[tuple[str, int]] = []
        steps: list[tuple[StepFn, tuple[int, ...], tuple[int, ...], str]] = []
        done: set[int] = set()          # nodes whose value another (fused) step produces
        self.fusions: list[str] = []
        self._zero_ahead: _ZeroAhead | None = None   # the last step that can zero the next GEMV's output
        self._rope_tables: dict[tuple, tuple] = {}   # RoPE's inverse frequencies and cos/sin table, `_qkv_groups`

        # fused elementwise regions: the root's step computes the region from its external inputs
        region_root: dict[int, fused.RegionKernel] = {}
        if os.environ.get("INGOT_CUDA_REGIONS", "1") == "1":
            from . import fft as audio_chains
            chain_roles = audio_chains.plan_roles(self)
            for region in program.regions:
                members = [by_id[i] for i in region if i in by_id]
                if len(members) < 2 or not fused.region_supported(members):
                    continue
                if all(m.id in chain_roles for m in members):
                    continue  # the mel kernel's epilogue (ingot.backends.cuda.fft)
                if any(m.id in roots for m in members[:-1]):
                    continue
                kernel = fused.RegionKernel(members, torch_dtype)
                region_root[members[-1].id] = kernel
                done.update(m.id for m in members[:-1])
                self.fusions.append("region " + "+".join(m.op.name.lower() for m in members))

        # silu(a) * b feeding only a quantized GEMV: computed in the GEMV's prologue (no region kernel)
        glu: dict[int, tuple[Node, Node, fused.RegionKernel]] = {}
        if os.environ.get("INGOT_CUDA_GLU", "1") == "1":
            for n in nodes:
                kernel = region_root.get(n.src[0].id) if n.op == Op.QUANTIZED_MATMUL and n.src else None
                if kernel is None or len(users[n.src[0].id]) != 1 or n.src[0].id in roots:
                    continue
                ops = [m.op for m in kernel.nodes]
                if ops != [Op.SILU, Op.MUL] or n.src[0].dtype != dt.float32 or n.attrs["mode"] != "affine":
                    continue
                silu, mul = kernel.nodes
                if len(users[silu.id]) != 1 or silu not in mul.src:
                    continue
                up = mul.src[1] if mul.src[0] is silu else mul.src[0]
                if up.type.shape != silu.src[0].type.shape or any(x.op != Op.CONSTANT for x in n.src[1:]):
                    continue
                glu[n.id] = (silu.src[0], up, kernel)

        # sibling quantized matmuls over one x, with constant weights of one kind
        sibling_groups: dict[int, list[Node]] = {}
        for n in nodes:
            if n.op == Op.QUANTIZED_MATMUL and n.attrs["mode"] == "affine" and all(s.op == Op.CONSTANT for s in n.src[1:]):
                sibling_groups.setdefault(n.src[0].id, []).append(n)
        group_of: dict[int, list[Node]] = {}
        if os.environ.get("INGOT_CUDA_CONCAT", "1") == "1":
            for members in sibling_groups.values():
                if len(members) > 1 and len({m.dtype for m in members}) == 1:
                    for m in members:
                        group_of[m.id] = members

        # a bf16 weight's cast to float32 that only matmuls read: they multiply the narrow weight
        for n in nodes:
            if widens_weight(n) and n.id not in roots and users[n.id] and \
                    all(u.op == Op.MATMUL and u.src[1] is n and u.src[0] is not n and narrow_weight(u) is not None
                        for u in users[n.id]):
                done.add(n.id)

        qkv_last = self._qkv_groups(nodes, users, roots, done) if os.environ.get("INGOT_CUDA_QKV", "1") == "1" else {}

        # rms_norm (and the residual add before it) feeding only word-layout GEMVs: the GEMV's prologue
        norm_gemv: dict[int, tuple] = {}      # the add's or the norm's id -> (add, norm, matmuls, weight)
        if os.environ.get("INGOT_CUDA_NORM_GEMV", "1") == "1":
            for n in nodes:
                found = self._norm_gemv(n, users, roots, done, region_root, group_of) if n.op == Op.RMS_NORM else None
                if found is None:
                    continue
                add, members, weight = found
                if add is not None and add.id in norm_gemv:
                    add = None                    # another norm of the same sum took the add
                norm_gemv[(add or n).id] = (add, n, members, weight)
                done.update(m.id for m in members)
                if add is not None:
                    done.add(n.id)                # the step runs where the add stood

        # a decode attention whose output only a quantized matmul reads (through views): the attention
        # kernel rounds its output for that GEMV (no quantize launch between them); both run as one step
        attn_o = self._attention_gemvs(nodes, users, roots, done, group_of) \
            if ATTENTION_XQ_BYTES > 0 or qmm.SELF_XQ_BYTES > 0 else {}

        for node in nodes:
            s = self.slot[node.id]
            if node.id in qkv_last:
                steps.append(self._with_gemv(qkv_last[node.id], attn_o.get(node.id)))
                continue
            if node.op == Op.CONSTANT:
                self.initial[s] = program.constants[node.attrs["key"]]  # uploaded below if a step reads it
                continue
            if node.op == Op.PLACEHOLDER:
                self.feed_slots.append((node.name, s, node.type))
                continue
            if node.op == Op.VARIABLE:
                self.variable_slots.append((node.attrs["name"], s))
                continue
            if node.op == Op.ASSIGN or node.id in done:
                continue
            if node.id in norm_gemv:
                add, norm, members, weight = norm_gemv[node.id]
                rows = math.prod(norm.type.shape[:-1])
                down = self._glu_after(members, glu, users, roots)
                if down is not None and not qmm.rounds_own_x(rows, down[1]):
                    down = None
                steps.append(self._norm_gemv_step(add, norm, members, weight, down))
                if down is not None:
                    done.update(n.id for n in [down[0], *down[2]])
                continue
            if node.id in glu:
                gate, up, kernel = glu[node.id]
                fn = self._glu_step(node, kernel)
                steps.append((fn, (self.slot[gate.id], self.slot[up.id]), (s,), "glu_quantized_matmul"))
                continue
            if node.id in region_root:
                if any(u.id in glu for u in users[node.id]):
                    continue  # computed inside the GEMV that reads it
                kernel = region_root[node.id]
                steps.append((kernel, tuple(self.slot[x.id] for x in kernel.inputs), (s,), "region"))
                continue
            if node.id in group_of:
                fn, outs = self._sibling_step(group_of[node.id])
                if fn is not None:
                    steps.append((fn, (self.slot[node.src[0].id],), tuple(self.slot[m.id] for m in outs), "qkv"))
                    done.update(m.id for m in outs)
                    continue
            if node.op == Op.ROPE and self._rope_into_cache(node, users, roots, steps, done):
                continue
            if node.op == Op.ADD and node.id not in roots:
                norm = next((u for u in users[node.id] if u.op == Op.RMS_NORM and u.src[0] is node and u.id not in norm_gemv),
                            None)
                if norm is not None and node.dtype.name in ("float32", "float16", "bfloat16") and \
                        node.src[0].type.shape == node.src[1].type.shape == node.type.shape and node.type.rank >= 1:
                    eps = norm.attrs["eps"]
                    weight_slot = (self.slot[norm.src[1].id],) if len(norm.src) > 1 else ()
                    step = (lambda a, b, w=None, eps=eps: fused.add_rms_norm(a, b, w, eps))
                    steps.append((step, (self.slot[node.src[0].id], self.slot[node.src[1].id]) + weight_slot,
                                  (s, self.slot[norm.id]), "add_rms_norm"))
                    done.add(norm.id)
                    self.fusions.append("add+rms_norm")
                    continue
            ctx = Lowering(self, node)
            if node.op == Op.CALL:
                fn = _call(ctx, executable)
            else:
                fn = LOWERINGS.get(node.op, host_reference)(ctx)
            reads = node.src if ctx.reads is None else [node.src[i] for i in ctx.reads]
            steps.append(self._with_gemv((fn, tuple(self.slot[x.id] for x in reads), (s,), node.op.name.lower()),
                                         attn_o.get(node.id)))

        # upload only the constants a step reads (packed weights live re-packed in the kernels' cache)
        read = {i for _, ins, _, _ in steps for i in ins}
        read |= {self.slot[n.id] for n in program.outputs} | {self.slot[a.src[1].id] for a in program.assigns}
        for n in nodes:
            if n.op == Op.CONSTANT:
                s = self.slot[n.id]
                self.initial[s] = constant_tensor(self.initial[s], device) if s in read else None

        # free each slot after its last reader, unless an output or an assign needs it
        keep = {self.slot[n.id] for n in program.roots} | {self.slot[a.src[1].id] for a in program.assigns}
        keep |= {self.slot[n.id] for n in nodes if n.op in GroupOp.Source}
        last: dict[int, int] = {}
        for i, (_, ins, _, _) in enumerate(steps):
            for x in ins:
                last[x] = i
        frees: list[list[int]] = [[] for _ in steps]
        for x, i in last.items():
            if x not in keep:
                frees[i].append(x)
        self.steps = [(fn, ins, outs, tuple(fr)) for (fn, ins, outs, _), fr in zip(steps, frees)]
        self.step_names = [name for *_, name in steps]
        self.output_slots = [self.slot[n.id] for n in program.outputs]
        self.assign_slots = [(a.src[0].attrs["name"], self.slot[a.src[1].id]) for a in program.assigns]
        base: dict[int, Node] = {}
        for n in nodes:
            base[n.id] = base[n.src[0].id] if (n.op in GroupOp.View or n.attrs.get("inplace")) and n.src else n
        # an output must not be memory a later run changes (a variable, a staged feed) or a constant
        self.output_copies = [i for i, n in enumerate(program.outputs)
                              if base[n.id].op in (Op.VARIABLE, Op.CONSTANT, Op.PLACEHOLDER)]
        self.capturable = device.type == "cuda" and not self.host_syncs and \
            os.environ.get("INGOT_CUDA_GRAPHS", "1") == "1" and all(isinstance(n.type, TensorType) and n.type.static
                                                                for n in nodes if n.op != Op.CALL)
        self._graphs: dict[int, dict] = {}
        self._runs: dict[int, int] = {}
        self._stage = None

    def _cache_write_at(self, update: Node, pos: Node, like: Node) -> bool:
        """update writes `like`-shaped rows in place into a cache at [0.., pos, 0]."""
        if update.op != Op.SLICE_UPDATE or not update.attrs.get("inplace"):
            return False
        rank, cache = like.type.rank, update.src[0]
        if cache.dtype != like.dtype or cache.type.shape[:-2] != like.type.shape[:-2] or \
                cache.type.shape[-1] != like.type.shape[-1] or update.src[1].type.shape != like.type.shape:
            return False
        for axis, st in enumerate(update.attrs["start"]):
            if axis == rank - 2:
                if not (isinstance(st, Ref) and update.src[st.index] is pos):
                    return False
            elif st != 0:
                return False
        return True

    def _qkv_groups(self, nodes, users, roots, done) -> dict[int, tuple]:
        """rope(q), rope(k) written into the k cache, and v written into the v cache, at one runtime
        position: one kernel (fused.rope_qkv_into), run where the last of the three stood."""
        order = {n.id: i for i, n in enumerate(nodes)}
        ropes = [n for n in nodes if n.op == Op.ROPE and n.src[1].type.rank == 0 and n.id not in roots and n.type.rank >= 2]
        updates = [n for n in nodes if n.op == Op.SLICE_UPDATE and n.attrs.get("inplace")]
        groups, used = {}, set()
        offsets: dict[int, set[int]] = {}    # a length `position + c` -> the attentions that add c themselves
        attrs_of = lambda n: (n.attrs.get("base", 10000.0), bool(n.attrs.get("interleaved", False)),  # noqa: E731
                              n.attrs.get("rotary_dims") or n.type.shape[-1], len(n.src) > 2 and n.src[2].id)
        for kr in ropes:
            if len(users[kr.id]) != 1 or kr.id in used or not self._cache_write_at(users[kr.id][0], kr.src[1], kr):
                continue
            ku, pos = users[kr.id][0], kr.src[1]
            qr = next((n for n in ropes if n is not kr and n.id not in used and n.src[1] is pos and attrs_of(n) == attrs_of(kr)
                       and n.type.rank == kr.type.rank and n.type.shape[-2:] == kr.type.shape[-2:] and n.dtype == kr.dtype
                       and not (len(users[n.id]) == 1 and users[n.id][0].op == Op.SLICE_UPDATE)), None)
            vu = next((u for u in updates if u is not ku and u.id not in used and u.src[0] is not ku.src[0]
                       and u.src[1].op != Op.ROPE and self._cache_write_at(u, pos, kr)), None)
            if qr is None or vu is None:
                continue
            last = max((qr, ku, vu), key=lambda n: order[n.id])
            members = {qr.id, kr.id, ku.id, vu.id}
            if any(order[u.id] < order[last.id] for m in (qr, ku, vu) for u in users[m.id] if u.id not in members):
                continue
            if any(order[x.id] > order[last.id] for m in (qr, kr, vu) for x in m.src):
                continue
            a = kr.attrs
            rd = a.get("rotary_dims") or kr.type.shape[-1]
            interleaved = bool(a.get("interleaved", False))
            inv_host = rope_inv_freq(rd, a.get("base", 10000.0))
            table = torch.as_tensor(inv_host, device=self.device)
            has_inv = len(kr.src) > 2

            ins = (self.slot[qr.src[0].id], self.slot[pos.id], self.slot[kr.src[0].id], self.slot[ku.src[0].id],
                   self.slot[vu.src[1].id], self.slot[vu.src[0].id]) + ((self.slot[kr.src[2].id],) if has_inv else ())
            # the inverse frequencies, to tabulate cos/sin: a constant (computed at run time: no table, and
            # float64 angles in the decode kernel made it slower than the RoPE launch, which stays)
            if has_inv:
                inv_host = self.program.constants[kr.src[2].attrs["key"]] if kr.src[2].op == Op.CONSTANT else None
                inv_host = None if inv_host is None else np.ascontiguousarray(inv_host).reshape(-1)
            att = None if inv_host is None else self._rope_attention(qr, ku, vu, last, members, users, roots, nodes, order)
            if att is not None:   # the attention reading them rotates q and writes k/v itself (decode)
                sdpa = att.attrs
                length_slot, offset = (), 0
                if sdpa.get("has_length"):   # position + 1: the kernel adds the 1 (no launch for the sum)
                    plus = _plus_constant(att.src[-1], self.program.constants)
                    if plus is not None:
                        offsets.setdefault(att.src[-1].id, set()).add(att.id)
                    length, offset = plus or (att.src[-1], 0)
                    length_slot = (self.slot[length.id],)
                rows = ku.src[0].type.shape[-2]
                key = (inv_host.tobytes(), rows)   # cos/sin of every cache position, one table for all layers
                if key not in self._rope_tables:
                    self._rope_tables[key] = (torch.as_tensor(inv_host, device=self.device),
                                              attention_kernels.rope_table(inv_host, rows, self.device))
                inv_dev, cos_sin = self._rope_tables[key]

                has_length, scale, causal = bool(sdpa.get("has_length")), sdpa.get("scale"), bool(sdpa.get("causal"))
                # the caches as the step found them (variables no earlier node of the step wrote): only this
                # launch writes them, so the decode kernel may read them before the kernel ahead ends; as
                # the position and length when fed (no kernel of the step computes them)
                early = ku.src[0].op == Op.VARIABLE and vu.src[0].op == Op.VARIABLE and pos.op in GroupOp.Source and \
                    (not has_length or length.op in GroupOp.Source)

                def step(q, position, k, k_cache, v, v_cache, *rest, interleaved=interleaved, inv_dev=inv_dev,
                         has_length=has_length, scale=scale, causal=causal, cos_sin=cos_sin, offset=offset, out=None,
                         xq=None, zero=None, early=early):
                    rope = attention_kernels.RopeWrite(position, inv_dev, k, v, interleaved, cos_sin)
                    out = attention_kernels.attention(q, k_cache, v_cache, length=rest[-1] if has_length else None,
                                                      scale=scale, causal=causal, rope=rope, out=out, xq=xq, zero=zero,
                                                      length_offset=offset, early=early)
                    return out, k_cache, v_cache
                groups[att.id] = (step, ins + length_slot, (self.slot[att.id], self.slot[ku.id], self.slot[vu.id]),
                                  "rope_qkv_attention")
                members.add(att.id)
                used |= members
                done |= members - {att.id}
                self.fusions.append("rope q + rope k + v write into the caches + attention")
                continue

            def step(q, position, k, k_cache, v, v_cache, *inv, table=table, interleaved=interleaved):
                q_out = fused.rope_qkv_into(q, k, v, position, inv[0] if inv else table, k_cache, v_cache, interleaved)
                return q_out, k_cache, v_cache
            groups[last.id] = (step, ins, (self.slot[qr.id], self.slot[ku.id], self.slot[vu.id]), "rope_qkv_into_cache")
            used |= members
            done |= members - {last.id}
            self.fusions.append("rope q + rope k + v write into the caches")
        for add, atts in offsets.items():   # the sum no step reads any more: not computed
            if add not in roots and all(u.id in atts for u in users[add]):
                done.add(add)
                self.fusions.append("the decode kernel adds 1 to the position for its length")
        return groups

    def _attention_gemvs(self, nodes, users, roots, done, group_of) -> dict[int, tuple]:
        """{SDPA id: (quantized matmul, its prepared weight)} where the matmul (constant affine weights of
        fewer than ATTENTION_XQ_BYTES, or a float32 one that rounds its own x (`qmm.rounds_own_x`), alone
        on its x) reads the attention's output of one query row through reshapes and transposes that keep
        its memory order (x [B, Hq * Dv] is the output [B, Hq, 1, Dv] as laid out), and nothing else reads it."""
        found = {}
        for m in nodes:
            if m.op != Op.QUANTIZED_MATMUL or m.id in done or m.id in group_of or m.attrs.get("mode") != "affine" or \
                    any(x.op != Op.CONSTANT for x in m.src[1:]) or m.type.rank != 2:
                continue
            chain, x = [], m.src[0]
            while x.op in (Op.RESHAPE, Op.TRANSPOSE) and len(users[x.id]) == 1 and x.id not in roots:
                if x.op == Op.TRANSPOSE:   # the axes longer than 1 stay in order
                    shape = x.src[0].type.shape
                    kept = [a for a in x.attrs["perm"] if shape[a] != 1]
                    if kept != sorted(kept):
                        break
                chain.append(x)
                x = x.src[0]
            else:
                if x.op == Op.SDPA and len(users[x.id]) == 1 and x.id not in roots and not x.attrs.get("has_mask") and \
                        x.type.shape[-2] == 1 and x.type.static and m.src[0].type.shape[-1] == x.type.shape[-3] * x.type.shape[-1] \
                        and m.src[0].type.shape[0] == math.prod(x.type.shape[:-3]):
                    arrays = [self.program.constants[c.attrs["key"]] for c in m.src[1:]]
                    weight = prepared_weight(arrays, m.attrs, self.device, WORDS_LAYOUT)
                    rows = math.prod(m.src[0].type.shape[:-1])
                    if weight.nbytes < ATTENTION_XQ_BYTES or (m.dtype == dt.float32 and qmm.rounds_own_x(rows, weight)):
                        found[x.id] = (m, weight)
                        done.update(n.id for n in chain + [m])
        return found

    def _with_gemv(self, step: tuple, gemv: tuple | None) -> tuple:
        """The attention step (fn, ins, outs, name), with gemv = (m, weight): it also computes m = x @ W
        from the attention's output, which the decode kernel stores rounded for the GEMV (`XQTarget`;
        weights under ATTENTION_XQ_BYTES), or the GEMV rounds its own x, the decode kernel zeroing its
        output (`qmm.rounds_own_x`). The GEMV zeroes the output of the next step's first GEMV (`_ZeroAhead`)."""
        if gemv is None:
            return step
        fn, ins, outs, name = step
        m, weight = gemv
        rows, k = m.src[0].type.shape
        y_shape = tuple(m.type.shape)
        in_attention = weight.nbytes < ATTENTION_XQ_BYTES
        ahead = self._zero_ahead = _ZeroAhead()
        self.fusions.append("attention output rounded for the quantized matmul after it" if in_attention else
                            "attention zeroes the output of the quantized matmul after it, which rounds its own x")

        def attention_gemv(*args, fn=fn, weight=weight, rows=rows, k=k, y_shape=y_shape, ahead=ahead):
            q = args[0]
            out = torch.empty((*q.shape[:-1], k // q.shape[-3]), dtype=q.dtype, device=q.device)
            x2 = out.view(rows, k)
            holder = {}
            if not qmm.gemv_takes_xq(rows, weight):
                holder["res"] = fn(*args, out=out)
                y = qmm.quantized_matmul(x2, weight)
            elif x2.dtype == torch.float32 and qmm.rounds_own_x(rows, weight):
                # the attention zeroes y and, where its kernel can (in_attention), rounds x for the GEMV;
                # where it did not, the GEMV rounds its own x: no quantize launch either way
                y = torch.empty((rows, weight.n), dtype=torch.float32, device=x2.device)
                limbs = qmm.gemv_takes_xq(rows, weight)
                buf = qmm.xq_buffers(rows, k, limbs, x2.device)
                target = attention_kernels.XQTarget(buf["xq_ptr"], buf["xd_ptr"], buf["xs_ptr"], limbs) \
                    if in_attention else None
                holder["res"] = fn(*args, out=out, xq=target, zero=y)
                config = {"ZEROED": True, "LIMBS": limbs}
                if target is not None and target.written:
                    quantize = (lambda *_, **__: buf)
                else:
                    quantize, config["XQ_SELF"] = None, True
                qmm._words_gemv(x2, weight, y, config, quantize=quantize, zero=ahead.make(x2.device))
            else:
                def quantize(x2_, x_gate, limbs, norm, zero=None):
                    buf = qmm.xq_buffers(rows, k, limbs, x2_.device)
                    target = attention_kernels.XQTarget(buf["xq_ptr"], buf["xd_ptr"], buf["xs_ptr"], limbs, zero)
                    holder["res"] = fn(*args, out=out, xq=target)
                    return buf if target.written else qmm._quantize_x(x2_, None, limbs, None, zero=zero)
                y = torch.empty((rows, weight.n), dtype=x2.dtype, device=x2.device)
                qmm._words_gemv(x2, weight, y, {}, quantize=quantize, zero=ahead.make(x2.device))
            res = holder["res"]
            return (*res, y.view(y_shape)) if isinstance(res, tuple) else (res, y.view(y_shape))
        return attention_gemv, ins, outs + (self.slot[m.id],), name + "+gemv"

    def _rope_attention(self, qr, ku, vu, last, members, users, roots, nodes, order) -> Node | None:
        """The SDPA node that alone reads rope(q), over the caches ku/vu just written (no mask), when
        nothing else reads rope(q) or the caches before it: the rope + KV write can run inside it."""
        if os.environ.get("INGOT_CUDA_ROPE_ATTENTION", "1") != "1" or qr.id in roots or len(users[qr.id]) != 1:
            return None
        att = users[qr.id][0]
        if att.op != Op.SDPA or att.attrs.get("has_mask") or att.src[0] is not qr or att.src[1] is not ku or \
                att.src[2] is not vu or att.src[1] is att.src[2]:
            return None
        if any(order[u.id] < order[att.id] for m in (ku, vu) for u in users[m.id] if u.id not in members and u is not att):
            return None
        caches = {ku.src[0].id, vu.src[0].id}
        if any(order[last.id] < order[n.id] < order[att.id] and any(x.id in caches for x in n.src) for n in nodes):
            return None
        return att

    def _rope_into_cache(self, node: Node, users, roots, steps, done) -> bool:
        """rope(k) whose only reader writes it into a cache at the same runtime position: one kernel
        rotates and writes in place (the KV-cache update of a decoder layer)."""
        if os.environ.get("INGOT_CUDA_ROPE_CACHE", "1") != "1" or node.id in roots or len(users[node.id]) != 1:
            return False
        update = users[node.id][0]
        pos = node.src[1]
        if update.op != Op.SLICE_UPDATE or not update.attrs.get("inplace") or update.src[1] is not node:
            return False
        start, rank = update.attrs["start"], node.type.rank
        cache = update.src[0]
        if pos.type.rank != 0 or rank < 2 or cache.dtype != node.dtype or cache.type.shape[:-2] != node.type.shape[:-2] \
                or cache.type.shape[-1] != node.type.shape[-1]:
            return False
        for axis, st in enumerate(start):
            if axis == rank - 2:
                if not (isinstance(st, Ref) and update.src[st.index] is pos):
                    return False
            elif st != 0:
                return False
        a = node.attrs
        rd = a.get("rotary_dims") or node.type.shape[-1]
        interleaved = bool(a.get("interleaved", False))
        table = torch.as_tensor(rope_inv_freq(rd, a.get("base", 10000.0)), device=self.device)
        has_inv = len(node.src) > 2

        def step(x, position, *rest):
            return fused.rope_into(rest[-1], x, position, rest[0] if has_inv else table, interleaved)
        ins = tuple(self.slot[x.id] for x in node.src) + (self.slot[cache.id],)
        steps.append((step, ins, (self.slot[update.id],), "rope_into_cache"))
        done.add(update.id)
        self.fusions.append("rope+kv write")
        return True

    def _glu_step(self, node: Node, region: fused.RegionKernel):
        """y = (silu(a) * b) @ W: the word-layout GEMV computes silu(a) * b as it loads x; other sizes
        run the region kernel, then the matmul."""
        arrays = [self.program.constants[x.attrs["key"]] for x in node.src[1:]]
        weight = prepared_weight(arrays, node.attrs, self.device, WORDS_LAYOUT)
        rows = math.prod(node.src[0].type.shape[:-1])
        self.fusions.append("silu*mul into the GEMV")
        if weight.words and rows <= qmm.WORDS_MAX_ROWS:
            n_out = node.type.shape[-1]

            def step(a, b):
                a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
                if a2.stride() != b2.stride() or a2.stride(-1) != 1:
                    a2, b2 = a2.contiguous(), b2.contiguous()
                y = torch.empty((a2.shape[0], n_out), dtype=a.dtype, device=a.device)
                qmm._words_gemv(b2, weight, y, {}, x_gate=a2)
                return y.reshape(*a.shape[:-1], n_out)
            return step
        def fallback(a, b):  # region.inputs is [a, b] (silu's input first), or [a] for silu(a) * a
            return qmm.quantized_matmul(region(a, b) if len(region.inputs) == 2 else region(a), weight)
        return fallback

    def _norm_gemv(self, norm: Node, users, roots, done, region_root, group_of):
        """(the add before norm or None, the matmuls norm feeds, their word-layout weight) when
        rms_norm(x [+ y]) * g feeds only quantized matmuls that run as one word-layout GEMV (a single
        one, or a sibling group concatenated at load) at this row count, in float32; else None."""
        x = norm.src[0]
        k = x.type.shape[-1] if x.type.rank >= 1 and x.type.static else None
        if norm.id in roots or norm.dtype != dt.float32 or x.dtype != dt.float32 or k is None or not users[norm.id]:
            return None
        if len(norm.src) > 1 and (norm.src[1].dtype != dt.float32 or tuple(norm.src[1].type.shape) != (k,)):
            return None
        if not 1 <= math.prod(x.type.shape[:-1]) <= qmm.WORDS_MAX_ROWS:
            return None
        members = users[norm.id]
        if any(m.op != Op.QUANTIZED_MATMUL or m.src[0] is not norm or any(s is norm for s in m.src[1:]) or
               any(s.op != Op.CONSTANT for s in m.src[1:]) or m.attrs["mode"] != "affine" or m.dtype != dt.float32
               for m in members):
            return None
        if len({m.id for m in members}) > 1:     # a sibling group, all of it
            group = group_of.get(members[0].id)
            if group is None or {m.id for m in group} != {m.id for m in members}:
                return None
            members = group
            arrays = [[self.program.constants[s.attrs["key"]] for s in m.src[1:]] for m in members]
            weight = concatenated_weight(list(zip(arrays, [m.attrs for m in members])), self.device)
        else:
            arrays = [self.program.constants[s.attrs["key"]] for s in members[0].src[1:]]
            weight = prepared_weight(arrays, members[0].attrs, self.device, WORDS_LAYOUT)
        if weight is None or not weight.words or weight.k != k:
            return None
        x = _sum_through_views(x)
        add = x if x.op == Op.ADD else None       # the step then runs at the add: g must be there already
        if add is not None and (add.id in roots or add.id in done or add.id in region_root or add.dtype != dt.float32 or
                                not add.src[0].type.shape == add.src[1].type.shape == add.type.shape or
                                any(s.dtype != dt.float32 for s in add.src) or
                                (len(norm.src) > 1 and norm.src[1].op != Op.CONSTANT)):
            add = None
        return add, members, weight

    def _glu_after(self, members: list[Node], glu: dict, users, roots) -> tuple | None:
        """(down, its word-layout weight, the slices of a fused gate_up output) when the GEMV's outputs are
        gate and up of a GLU (members [gate, up], or [gate_up] that only two last-axis halves read) whose
        down projection runs as a word GEMV (`_glu_step`) and nothing else reads gate or up: one step can
        run both GEMVs, the gate+up launch zeroing the down GEMV's output (`_glu_down`)."""
        if len(members) == 2:
            pair, slices = members, []
        elif len(members) == 1 and members[0].type.static and members[0].id not in roots:
            both = members[0]
            n = both.type.shape[-1]
            halves = sorted(users[both.id], key=lambda u: _last_axis_slice(u, both) or (n, n))
            if len(halves) != 2 or [_last_axis_slice(u, both) for u in halves] != [(0, n // 2), (n // 2, n)] or n % 2:
                return None
            pair, slices = halves, halves
        else:
            return None
        gate, up = pair
        for down_id, (g, u, kernel) in glu.items():
            if g is not gate or u is not up or gate.id in roots or up.id in roots:
                continue
            inside = {m.id for m in kernel.nodes}
            if any(x.id not in inside for x in users[gate.id] + users[up.id]):
                return None
            down = next(n for n in users[kernel.nodes[-1].id] if n.id == down_id)
            arrays = [self.program.constants[x.attrs["key"]] for x in down.src[1:]]
            weight = prepared_weight(arrays, down.attrs, self.device, WORDS_LAYOUT)
            if not weight.words or math.prod(down.src[0].type.shape[:-1]) > qmm.WORDS_MAX_ROWS:
                return None
            return down, weight, slices
        return None

    def _norm_gemv_step(self, add: Node | None, norm: Node, members: list[Node], weight: qmm.QuantizedWeight,
                        down: tuple | None = None):
        """One step for [add ->] rms_norm -> quantized matmul(s): `qmm.rms_norm_matmul` (the norm in the
        word GEMV's prologue; with the add, its sum stored by the same launch for the residual stream).
        down = (the down projection, its weight, _) (`_glu_after`): the step goes on through silu(gate) *
        up and the down GEMV, which rounds its own x (`_glu_down`). Where the GEMV rounds its own x
        (`qmm.rounds_own_x`) and the step before can zero its output, it does (`_ZeroAhead`)."""
        eps = norm.attrs["eps"]
        has_g = len(norm.src) > 1
        rows = math.prod(norm.type.shape[:-1])
        behind, self._zero_ahead = self._zero_ahead, None
        if behind is not None and norm.type.static and qmm.rounds_own_x(rows, weight):
            behind.shape = (rows, weight.n)
            self.fusions.append("the GEMV rounds its own x, its output zeroed by the step before")
        if down is None:
            offsets = [int(o) for o in np.cumsum([0] + [m.type.shape[-1] for m in members])]

            def compute(x, b, g):
                got = _rms_norm_matmul(x, weight, g, eps, b, behind)
                total, y = got if b is not None else (None, got)
                return total, tuple(y[..., offsets[i]:offsets[i + 1]] for i in range(len(members))) \
                    if len(members) > 1 else (y,)
            written, suffix = members, ""
        else:
            compute = self._glu_down(weight, eps, down[:2], behind)
            written, suffix = [down[0]], "+glu_gemv"
        if add is not None:
            def step(a, b, g=None):
                total, ys = compute(a, b, g)
                return (total, *ys)
            ins = (self.slot[add.src[0].id], self.slot[add.src[1].id])
            outs = (self.slot[add.id],)
            self.fusions.append("add+rms_norm into the GEMV")
        else:
            def step(x, g=None):
                ys = compute(x, None, g)[1]
                return ys[0] if len(ys) == 1 else ys
            ins = (self.slot[norm.src[0].id],)
            outs = ()
            self.fusions.append("rms_norm into the GEMV")
        if len(members) > 1:
            self.fusions.append(f"{len(members)} sibling quantized matmuls")
        ins += (self.slot[norm.src[1].id],) if has_g else ()
        outs += tuple(self.slot[m.id] for m in written)
        return step, ins, outs, ("add_rms_norm_gemv" if add is not None else "rms_norm_gemv") + suffix

    def _glu_down(self, weight: qmm.QuantizedWeight, eps: float, down: tuple, behind: _ZeroAhead | None = None):
        """compute(x, add or None, g) -> (x + add or None, (y,)): rms_norm -> gate+up GEMV -> silu(gate) *
        up -> down GEMV with no quantize launch between the two GEMVs: the gate+up launch zeroes the down
        GEMV's output and the down GEMV rounds silu(gate) * up itself, each program its split
        (`qmm.rounds_own_x`). `behind`: the gate+up GEMV's output, zeroed by the step before
        (`_ZeroAhead`); the down GEMV zeroes the next step's."""
        d_node, d_weight = down
        half, n_out = weight.n // 2, d_node.type.shape[-1]
        ahead = self._zero_ahead = _ZeroAhead()
        self.fusions += ["silu*mul into the GEMV",
                         "the gate+up GEMV zeroes the down GEMV's output, which rounds silu*mul itself"]

        def compute(x, b, g):
            lead = x.shape[:-1]
            rows = math.prod(lead)
            y_down = torch.empty((rows, n_out), dtype=torch.float32, device=x.device)
            got = _rms_norm_matmul(x, weight, g, eps, b, behind, zero=y_down)
            total, y = got if b is not None else (None, got)
            y2 = y.reshape(rows, 2 * half)
            qmm._words_gemv(y2[:, half:], d_weight, y_down, {"XQ_SELF": True, "ZEROED": True}, x_gate=y2[:, :half],
                            zero=ahead.make(x.device))
            return total, (y_down.reshape(*lead, n_out),)
        return compute

    def _sibling_step(self, members: list[Node]):
        arrays = [[self.program.constants[s.attrs["key"]] for s in m.src[1:]] for m in members]
        weight = concatenated_weight(list(zip(arrays, [m.attrs for m in members])), self.device)
        if weight is None:
            return None, members
        widths = [m.type.shape[-1] for m in members]
        offsets = np.cumsum([0] + widths)

        def step(x):
            y = qmm.quantized_matmul(x, weight)
            return tuple(y[..., int(offsets[i]):int(offsets[i + 1])] for i in range(len(members)))
        self.fusions.append(f"{len(members)} sibling quantized matmuls")
        return step, members

    # -- running --------------------------------------------------------------------------------
    def _execute(self, feeds: dict[str, torch.Tensor], state: dict[str, torch.Tensor], copy_outputs: bool = True):
        vals = list(self.initial)
        for name, s, _ in self.feed_slots:
            vals[s] = feeds[name]
        for name, s in self.variable_slots:
            vals[s] = state[name]
        for fn, ins, outs, frees in self.steps:
            result = fn(*[vals[i] for i in ins])
            if len(outs) == 1:
                vals[outs[0]] = result
            else:
                for o, r in zip(outs, result):
                    vals[o] = r
            for f in frees:
                vals[f] = None
        outputs = [vals[s] for s in self.output_slots]
        if copy_outputs:
            for i in self.output_copies:
                outputs[i] = outputs[i].clone()
        if self.assign_slots:
            _assign(state, [(name, vals[s]) for name, s in self.assign_slots])
        return outputs

    def _device_feeds(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in feeds.items():
            out[name] = value.to(self.device) if isinstance(value, torch.Tensor) else to_device(value, self.device)
        return out

    def _staging(self):
        """Static device buffers for the feeds (a captured graph reads them) and a pinned host mirror."""
        if self._stage is None:
            layout, total = {}, 0
            for name, _, t in self.feed_slots:
                nbytes = max(t.nbytes, 1)
                layout[name] = (total, nbytes, t)
                total += -(-nbytes // 64) * 64
            device_buf = torch.empty(max(total, 64), dtype=torch.uint8, device=self.device)
            host_buf = torch.empty(max(total, 64), dtype=torch.uint8, pin_memory=True)
            views, host_views = {}, {}
            for name, (off, nbytes, t) in layout.items():
                shape = dt.storage_shape(t.shape, t.dtype) if t.shape else ()
                views[name] = device_buf[off:off + t.nbytes].view(torch_dtype(t.dtype)).view(shape)
                host_views[name] = host_buf[off:off + t.nbytes].numpy()
            self._stage = dict(device=device_buf, host=host_buf, views=views, host_views=host_views,
                               event=torch.cuda.Event(), copied=False)
        return self._stage

    def _stage_feeds(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The staging buffer's views, the given feeds copied in (host arrays through the pinned mirror)."""
        stage = self._staging()
        if stage["copied"]:
            stage["event"].synchronize()  # the last copy out of the pinned buffer has finished
        host_feeds = False
        for name, value in feeds.items():
            if isinstance(value, torch.Tensor):
                stage["views"][name].copy_(value, non_blocking=True)
            else:
                a = np.ascontiguousarray(value)
                stage["host_views"][name][...] = a.reshape(-1).view(np.uint8) if a.size else 0
                host_feeds = True
        if host_feeds:
            stage["device"].copy_(stage["host"], non_blocking=True)
            stage["event"].record()
            stage["copied"] = True
        return stage["views"]

    def _in_place(self, value) -> bool:
        """A feed the steps read where it lies: contiguous device memory of the plan's device."""
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type and value.is_contiguous() and \
            (self.device.index is None or value.device.index == self.device.index)

    def run(self, feeds: dict[str, Any], state: dict[str, torch.Tensor], stream=None, outputs=None,
            **options) -> list[torch.Tensor]:
        """stream: the caller's CUDA stream (torch, or any object with a `ptr`/`cuda_stream`, or a raw
        handle): every copy, kernel and graph replay of this run is queued on it, after the caller's
        work. outputs: device arrays (any DLPack producer) that receive the targets, so the run
        allocates nothing on the device; they are returned (as torch views of the same memory).

        Device feeds are read in place, never copied: the CUDA graph of a state is captured over the
        feeds' addresses, so a caller that refills the same buffers replays it with no copy; new
        addresses run eagerly once, then get a graph of their own (four kept)."""
        if stream is not None:
            with torch.cuda.stream(_torch_stream(stream, self.device)):
                return self.run(feeds, state, outputs=outputs, **options)
        direct = {name: v for name, v in feeds.items() if self._in_place(v)}
        staged = {name: v for name, v in feeds.items() if name not in direct}
        self.last_feed_pointers = {name: v.data_ptr() for name, v in direct.items()}
        if not self.capturable:
            values = self._device_feeds(staged)
            values.update(direct)
            return _deliver(self._execute(values, state), outputs, fresh=True)
        key = (id(state),) + tuple(sorted((name, v.data_ptr()) for name, v in direct.items()))
        entry = self._graphs.get(key)
        if entry is not None and entry["state"] is state:
            self._stage_feeds(staged)
            entry["graph"].replay()
            return _deliver(entry["outputs"], outputs, fresh=False)
        if len(self._runs) > 64:
            self._runs.clear()
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        values = dict(self._stage_feeds(staged))
        values.update(direct)
        if runs < 2:  # the first run is eager: it compiles every kernel
            return _deliver(self._execute(values, state), outputs, fresh=True)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = self._execute(values, state, copy_outputs=False)
        graph.replay()
        if len(self._graphs) >= 4:
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = dict(graph=graph, outputs=captured, state=state)
        return _deliver(captured, outputs, fresh=False)


def _rms_norm_matmul(x, weight: qmm.QuantizedWeight, g, eps: float, add, behind: _ZeroAhead | None, **kw):
    """`qmm.rms_norm_matmul`, into the output the step before zeroed where there is one (`_ZeroAhead`):
    then the GEMV rounds its own x, with no quantize launch ahead of it."""
    y = behind.take() if behind is not None else None
    if y is None:
        return qmm.rms_norm_matmul(x, weight, g, eps, add=add, **kw)
    return qmm.rms_norm_matmul(x, weight, g, eps, add=add, out=y, config={"XQ_SELF": True, "ZEROED": True}, **kw)


def _torch_stream(stream, device) -> torch.cuda.Stream:
    """A torch stream for the caller's stream object (torch, CuPy, Numba, or a raw cudaStream_t)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    handle = stream if isinstance(stream, int) else getattr(stream, "ptr", None) or getattr(stream, "cuda_stream", None) \
        or getattr(stream, "handle", None)
    if not isinstance(handle, int):
        raise IngotError(f"run: stream= takes a torch.cuda.Stream, an object with a .ptr or .cuda_stream, or a "
                         f"cudaStream_t as an int; got {type(stream).__name__}.")
    return torch.cuda.ExternalStream(handle, device=device)


def _deliver(results: list[torch.Tensor], outputs, fresh: bool) -> list[torch.Tensor]:
    """The run's results: copied into the caller's arrays when given, else fresh tensors (a captured
    graph's own output buffers are never handed out: the next replay overwrites them)."""
    if outputs is None:
        return results if fresh else [o.clone() for o in results]
    if len(outputs) != len(results):
        raise IngotError(f"run: outputs= has {len(outputs)} arrays for {len(results)} targets.")
    delivered = []
    for i, (dst, src) in enumerate(zip(outputs, results)):
        t = dst if isinstance(dst, torch.Tensor) else torch.from_dlpack(dst)
        if tuple(t.shape) != tuple(src.shape) or t.dtype != src.dtype or t.device != src.device:
            raise IngotError(f"run: outputs[{i}] is {t.dtype}{list(t.shape)} on {t.device}; the target is "
                             f"{src.dtype}{list(src.shape)} on {src.device}.")
        t.copy_(src)
        delivered.append(t)
    return delivered


def _assign(state: dict[str, torch.Tensor], updates: list[tuple[str, torch.Tensor]]) -> None:
    pending = [(state[name], value) for name, value in updates if value is not state[name]]
    if len(pending) > 1:  # a value reading another assigned variable is taken before that one is written
        pending = [(target, value.clone() if any(other is not target and _shares(value, other) for other, _ in pending)
                    else value) for target, value in pending]
    for target, value in pending:
        target.copy_(value)


class CudaBackend:
    name = "cuda"

    def __init__(self):
        self.device = torch.device(device_name())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise IngotError("device 'cuda': torch sees no CUDA GPU on this machine.")

    def prepare(self, program: Program, executable) -> CudaPlan:
        return CudaPlan(program, executable, self.device)

    def new_state(self, program: Program) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in program.variables.items():
            if not v.any():  # KV caches: zeros made on the device, nothing copied
                out[k] = torch.zeros(v.shape, dtype=torch_dtype(dt.from_numpy(v.dtype)), device=self.device)
            else:
                out[k] = to_device(v, self.device)
        return out

    def to_host(self, value) -> np.ndarray:
        return to_host(value)

    def from_host(self, value, t: TensorType):
        """Numpy feeds pass through (the plan stages them); device arrays of any DLPack library are
        taken zero-copy, as torch tensors."""
        if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
            return value
        tensor = value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
        want = tuple(dt.storage_shape(t.shape, t.dtype)) if t.shape else ()
        if tensor.dtype != torch_dtype(t.dtype) or tuple(tensor.shape) != want:
            raise IngotError(f"run: a device feed has {tensor.dtype}{list(tensor.shape)}, expected {t}.")
        return tensor


from . import fft  # noqa: E402  (registers the FFT lowerings and the fused STFT power -> mel chain)

__all__ = ["CudaBackend", "CudaPlan", "LOWERINGS", "to_host", "to_device", "torch_dtype", "math"]
