"""The CPU backend: NumPy (the executable definition of every op) plus numba kernels where NumPy is slow.

The program is lowered once into a flat list of steps (function, input slots, output slot, slots
to free); `run` walks that list, so a decode step costs one Python call per op and no graph walk.
Lowerings are a table keyed by op; an op without an entry uses its NumPy reference.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable

import numpy as np

from ... import dtypes as dt
from ...errors import IngotError
from ...ir import GroupOp, Node, Op, Program, TensorType
from ...ops import REGISTRY
from ...ops.elementwise import BINARY, UNARY
from ...ops.shape import slice_index, slice_update_into
from ...ops import resolve
from ...ops.fft import FORWARD_NORM, INVERSE_NORM
from ...options import DEFAULT_CPU, CompileOptions, CpuOptions
from ...passes.fold import widens_weight
from . import (blocked, conv, conv_amx, expand_depthwise, int8_matmul, kernels, matmul_amx, nn_kernels, recurrent, rope_cache,
               rows_attention, spatial, squeeze_excite)
from .pool_attention import pool_attention_lowering
from .concat import concat_lowering

StepFn = Callable[..., Any]
LOWERINGS: dict[Op, Callable[[Node, np.ndarray | None], StepFn]] = {}


def lowering(*ops: Op):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


def _reference(node: Node, out: np.ndarray | None) -> StepFn:
    ref, attrs = REGISTRY[node.op].reference, node.attrs
    return lambda *xs: ref(xs, attrs)


def _is_f32(node: Node) -> bool:
    return all(isinstance(s.type, TensorType) and s.dtype.name == "float32" for s in node.src) and node.dtype.name == "float32"


LOWERINGS[Op.POOL_ATTENTION] = pool_attention_lowering
LOWERINGS[Op.CONCAT] = concat_lowering


@lowering(Op.CONV)
def _conv(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    return conv.conv_lowering(node, out, options) or _reference(node, out)


@lowering(Op.FUSED)
def _fused(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    """A fused op by kind where a kernel here runs it, else its body through the references."""
    kind = node.attrs["kind"]
    rule = FUSED_LOWERINGS.get(kind)
    if rule is None:
        return _reference(node, out)
    return (rule(node, out, options) if kind in FUSED_WITH_OPTIONS else rule(node, out)) or _reference(node, out)


FUSED_LOWERINGS = dict(conv.FUSED_LOWERINGS) | rope_cache.FUSED_LOWERINGS | int8_matmul.FUSED_LOWERINGS | \
    rows_attention.FUSED_LOWERINGS | spatial.FUSED_LOWERINGS | squeeze_excite.FUSED_LOWERINGS | \
    expand_depthwise.FUSED_LOWERINGS | blocked.FUSED_LOWERINGS
from . import collectives  # noqa: E402,F401  (registers all_reduce/all_gather: torch.distributed, gloo)


@lowering(Op.LSTM)
def _lstm(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    """The whole recurrence in one compiled loop per direction (backends/cpu/recurrent.py)."""
    return recurrent.lstm_step(node, out, options.float32_precision) or _reference(node, out)


@lowering(Op.SOFTMAX, Op.LOG_SOFTMAX)
def _softmax(node: Node, out):
    """float32 (log_)softmax along the last axis: one compiled pass a row (the reference's five NumPy
    passes over small rows took 0.1 ms for a CRNN's 80 x 37 logits)."""
    t = node.src[0].type
    if not _is_f32(node) or not t.static or t.size == 0 or node.attrs["axis"] != t.rank - 1:
        return _reference(node, out)
    shape, log = tuple(node.type.shape), node.op == Op.LOG_SOFTMAX
    return lambda x: nn_kernels.softmax_last_axis(x, out if out is not None else np.empty(shape, np.float32), log)


@lowering(Op.MEAN)
def _mean(node: Node, out):
    """float32 mean over the trailing axes (a squeeze-excite's global average pool): one compiled pass."""
    src = node.src[0].type
    axes = tuple(sorted(node.attrs["axes"]))
    if not _is_f32(node) or not src.static or not axes or axes != tuple(range(src.rank - len(axes), src.rank)):
        return _reference(node, out)
    inner = int(np.prod([src.shape[a] for a in axes]))
    shape = tuple(node.type.shape)
    if inner == 0:
        return _reference(node, out)
    return lambda x: nn_kernels.mean_of_trailing_axes(x, inner, out if out is not None else np.empty(shape, np.float32))


def _pooled_separable(x: np.ndarray, ufunc) -> np.ndarray | None:
    """max/min over the last two axes of a pooling view x [N, C, OH, OW, kh, kw] (an array_view of the
    padded input whose row and column steps are multiples of the window's) as a pass over kw columns,
    then one over kh rows: kw * H' + kh * OH row operations instead of kh * kw * OH (5 x 5, stride 1:
    10 against 25). None where the strides do not have that form, or it would not save a third."""
    n, c, oh, ow, kh, kw = x.shape
    st = x.strides
    if min(st[4], st[5]) <= 0 or st[2] % st[4] or st[3] % st[5] or st[2] < st[4] or st[3] < st[5]:
        return None
    step = st[2] // st[4]
    hp = (oh - 1) * step + kh
    if kw * hp + kh * oh > 0.67 * kh * kw * oh:
        return None
    strided = np.lib.stride_tricks.as_strided
    lines = strided(x[:, :, 0, :, 0, 0], (n, c, hp, ow), (st[0], st[1], st[4], st[3]), writeable=False)
    cols = np.array(lines, copy=True)                                   # [N, C, H', OW]: over the columns
    for j in range(1, kw):
        ufunc(cols, strided(x[:, :, 0, :, 0, j], (n, c, hp, ow), (st[0], st[1], st[4], st[3]), writeable=False), out=cols)
    cs = cols.strides
    y = np.array(strided(cols, (n, c, oh, ow), (cs[0], cs[1], cs[2] * step, cs[3]), writeable=False), copy=True)
    for i in range(1, kh):                                              # then over the rows
        ufunc(y, strided(cols[:, :, i:], (n, c, oh, ow), (cs[0], cs[1], cs[2] * step, cs[3]), writeable=False), out=y)
    return y


@lowering(Op.MAX, Op.MIN)
def _extreme(node: Node, out):
    """max/min of float32 without the reference's copy of the input; a small window of axes (pooling
    over a strided view of the input) as that many elementwise maxima over the long axes."""
    if not _is_f32(node):
        return _reference(node, out)
    src = node.src[0].type
    axes = tuple(sorted(node.attrs["axes"]))
    shape = tuple(node.type.shape)
    ufunc, reduce = (np.maximum, np.max) if node.op == Op.MAX else (np.minimum, np.min)
    window = [src.shape[a] for a in axes]
    if axes and src.static and 1 < np.prod(window) <= 64 and node.type.size >= 1024:
        taps = []
        for index in np.ndindex(*window):
            tap = [slice(None)] * src.rank
            for a, i in zip(axes, index):
                tap[a] = i
            taps.append(tuple(tap))

        def pooled(x):
            if separable:
                y = _pooled_separable(x.transpose(0, 1, 4, 5, 2, 3) if axes == (2, 3) else x, ufunc)
                if y is not None:
                    return y.reshape(shape)
            y = np.array(x[taps[0]], copy=True)
            for t in taps[1:]:
                ufunc(y, x[t], out=y)
            return y.reshape(shape)
        separable = src.rank == 6 and axes in ((2, 3), (4, 5))   # the importer's MaxPool: [N, C, kh, kw, OH, OW]
        return pooled
    return lambda x: reduce(x, axis=axes).reshape(shape)


@lowering(*BINARY)
def _binary(node: Node, out):
    """float32: the ufunc into the planned buffer, or (a graph output, which gets none) into a new array,
    not through the reference (whose dtype checks took ~40 us a run with cold caches: MobileNet's last add)."""
    fn = BINARY[node.op]
    if _is_f32(node) and (out is not None or node.type.rank > 0):   # (a ufunc of 0-d arrays gives a scalar)
        return (lambda a, b: fn(a, b, out=out)) if out is not None else fn
    return _reference(node, out)


@lowering(Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.TANH, Op.SIN, Op.COS)
def _unary(node: Node, out):
    fn = UNARY[node.op]
    if _is_f32(node) and (out is not None or node.type.rank > 0):
        return (lambda a: fn(a, out=out)) if out is not None else fn
    return _reference(node, out)


@lowering(Op.SIGMOID)
def _sigmoid(node: Node, out):
    """float32 sigmoid in one vector pass (conv_spatial's epilogue IR): a detector's last layer, alone."""
    if not _is_f32(node) or not node.type.static:
        return _reference(node, out)
    kernel = conv.conv_spatial.elementwise(node)
    shape = tuple(node.type.shape)

    def step(x):
        y = out if out is not None else np.empty(shape, np.float32)
        kernel(np.ascontiguousarray(x).reshape(-1), y.reshape(-1))
        return y
    return step


@lowering(Op.SILU)
def _silu(node: Node, out):
    if _is_f32(node):
        return nn_kernels.silu
    return _reference(node, out)


@lowering(Op.ERF)
def _erf(node: Node, out):
    return nn_kernels.erf if _is_f32(node) else _reference(node, out)


@lowering(Op.GELU)
def _gelu(node: Node, out):
    if _is_f32(node):
        return nn_kernels.gelu_tanh if node.attrs.get("approximate", "none") == "tanh" else nn_kernels.gelu
    return _reference(node, out)


@lowering(Op.MATMUL)
def _matmul(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    a, b = node.src[0].type, node.src[1].type
    rows = int(np.prod(a.shape[:-1])) if a.static else 0
    if _is_f32(node) and options.float32_precision != "float32" and b.rank == 2 and b.static and a.rank >= 2 \
            and node.src[1].op == Op.CONSTANT and a.static and matmul_amx.fits(rows, *b.shape) and conv_amx.available():
        # by constant weights: AMX's tiles, each product as three bfloat16 ones (matmul_amx.py)
        shape = tuple(node.type.shape)
        amx = matmul_amx.step(rows, b.shape[0], b.shape[1], options.float32_precision)

        def tiles(x, w):
            y = out if out is not None else np.empty(shape, np.float32)
            amx(x, w, y.reshape(rows, b.shape[1]))
            return y
        return tiles
    if _is_f32(node) and b.rank == 2 and a.rank >= 2 and a.static and b.static and node.src[1].op == Op.CONSTANT \
            and options.resolved_threads == 1:
        from . import matmul_avx512   # by constant weights in AVX-512 registers, where it beats BLAS (matmul_avx512.py)
        if matmul_avx512.fits(rows, *b.shape) and not conv_amx.available():
            shape, avx512 = tuple(node.type.shape), matmul_avx512.step(rows, *b.shape)

            def panels(x, w):
                y = out if out is not None else np.empty(shape, np.float32)
                avx512(x, w, y.reshape(rows, b.shape[1]))
                return y
            return panels
    if out is not None and _is_f32(node):
        if a.rank > 2 and b.rank == 2 and a.static and b.static:
            # [..., K] @ [K, N] as one GEMM: NumPy runs a stack as a product per item (a CRNN's
            # [80, 1, 256] @ [256, 37]: 170 us against 15)
            rows, (k, n) = int(np.prod(a.shape[:-1])), b.shape
            flat = out.reshape(rows, n)

            def gemm(x, w):
                np.matmul(x.reshape(rows, k), w, out=flat)
                return out
            return gemm
        if a.rank == 2 and b.rank == 2:   # np.dot into a buffer: ~0.35 us a call against np.matmul's ~0.7
            return lambda a, b: np.dot(a, b, out)
        return lambda a, b: np.matmul(a, b, out=out)
    return _reference(node, out)


def _static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


@lowering(Op.RESHAPE)
def _reshape(node: Node, out):
    shape = node.type.shape
    if _static(shape) and not node.dtype.packed:  # (the reference resolves -1 and checks on every call)
        return lambda x: x.reshape(shape)
    return _reference(node, out)


@lowering(Op.ARRAY_VIEW)
def _array_view(node: Node, out):
    """The reference's strided view through the ndarray constructor: np.lib.stride_tricks.as_strided builds
    an __array_interface__ object on every call (~15 us; a MaxPool's window view is one per run)."""
    a = node.attrs
    if node.dtype.packed:
        return _reference(node, out)
    shape, strides, offset = tuple(a["shape"]), tuple(a["strides"]), int(a.get("offset", 0))

    def view(x):
        flat = np.ascontiguousarray(x).reshape(-1)
        item = flat.itemsize
        v = np.ndarray(shape, flat.dtype, buffer=flat, offset=offset * item, strides=tuple(s * item for s in strides))
        v.flags.writeable = False
        return v
    return view


@lowering(Op.PAD)
def _pad(node: Node, out):
    """A pad of a static shape without np.pad's per-call planning (~25 us on a [1, 512] input): constant
    pads fill a new array and copy x in; reflect, symmetric and edge take precomputed indices per axis."""
    src, pads = node.src[0].type, [tuple(p) for p in node.attrs["pads"]]
    mode = node.attrs.get("mode", "constant")
    if not src.static or node.dtype.packed or not node.type.static:
        return _reference(node, out)
    if mode == "constant":
        value, shape = node.attrs.get("value", 0), node.type.shape
        inner = tuple(slice(lo, lo + d) for (lo, _), d in zip(pads, src.shape))

        def constant(x):
            y = np.full(shape, value, x.dtype)
            y[inner] = x
            return y
        return constant
    taken = [(axis, np.pad(np.arange(d), p, mode=mode)) for axis, (d, p) in enumerate(zip(src.shape, pads)) if p != (0, 0)]

    def indexed(x):
        for axis, index in taken:
            x = np.take(x, index, axis=axis)
        return x if taken else x.copy()
    return indexed


@lowering(Op.SLICE)
def _slice(node: Node, out):
    """A slice whose starts and ends are constants is one precomputed NumPy index (a view)."""
    a, shape = node.attrs, node.src[0].type.shape
    if _static(shape) and not node.dtype.packed and all(isinstance(v, int) for v in (*a["start"], *a["end"]) if v is not None):
        index = slice_index(shape, a["start"], a["end"], a["step"], a.get("size"))
        return lambda x, *_: x[index]
    return _reference(node, out)


@lowering(Op.GATHER)
def _gather(node: Node, out):
    """One index (a scalar: an LSTM's last step, a state's direction) as a basic index and a copy (into the
    planned buffer where there is one): np.take took 0.9 us, this 0.3."""
    src = node.src[0].type
    if node.src[1].type.rank != 0 or not src.static or node.dtype.packed:
        return _reference(node, out)
    axis = node.attrs["axis"]
    n, lead = src.shape[axis], (slice(None),) * axis

    def one(x, index):
        i = int(index)
        if not -n <= i < n:
            raise IngotError(f"gather: index {i} but axis {axis} has {n} entries.")
        picked = x[lead + (i,)]
        if type(picked) is not np.ndarray:   # a 1-D x gives a NumPy scalar, as np.take does
            return picked
        if out is not None:
            np.copyto(out, picked)
            return out
        return picked.copy()
    return one


@lowering(Op.SLICE_UPDATE)
def _slice_update(node: Node, out):
    if not node.attrs.get("inplace"):
        return _reference(node, out)
    start = node.attrs["start"]
    return lambda *xs: slice_update_into(xs[0], xs[1], resolve(start, xs))


@lowering(Op.QUANTIZED_MATMUL)
def _quantized_matmul(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    if node.attrs.get("mode") == "lut":  # lookup-table weights: ingot/backends/cpu/lut_kernels.py
        from . import lut_kernels
        step = lut_kernels.lut_matmul_step(node, out, threads=options.resolved_threads)
        if step is not None:
            return step
    if node.attrs.get("mode") == "scaled_lut":  # GGUF's IQ types and MXFP4: the same file
        from . import lut_kernels
        step = lut_kernels.scaled_lut_matmul_step(node, out, threads=options.resolved_threads)
        if step is not None:
            return step
    # float x of 8 rows or more by an 8-bit weight with one block along k (ONNX's int8 files)
    step = int8_matmul.float_weight_step(node, out, options.gemv_activations, options.resolved_threads)
    if step is not None:
        return step
    return kernels.quantized_matmul_step(node, out, options.resolved_threads, options.gemv_activations)


@lowering(Op.QUANTIZED_GATHER_MATMUL)
def _quantized_gather_matmul(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    """Mixture-of-experts matmul: the chosen experts' packed weights through quantized_matmul's kernels."""
    from . import experts
    return experts.quantized_gather_matmul_step(node, lambda expert: _quantized_matmul(expert, None, options))


# the lowerings that take the CPU options as a third argument (until every lowering takes one context)
# programs that keep BLAS on one thread (CpuPlan.blas): ops whose steps split their work over Ingot's own
# threads (quantized matmuls, convs, and the fused kinds holding convs), or call BLAS per time step (recurrent)
OWN_THREADS = {Op.QUANTIZED_MATMUL, Op.CONV, Op.LSTM, Op.GRU, Op.RNN}
CONV_KINDS = {"conv_epilogue", "blocked", "expand_depthwise", "squeeze_excite"}
WITH_OPTIONS = {Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER_MATMUL, Op.CONV, Op.FUSED, Op.MATMUL, Op.LSTM}
FUSED_WITH_OPTIONS = set(conv.FUSED_LOWERINGS) | {"blocked", "expand_depthwise"}   # the fused kinds whose rules take them (AMX's
                                                             # precision, the threads)


@lowering(Op.SDPA)
def _sdpa(node: Node, out):
    if node.attrs.get("has_mask") and not node.attrs.get("has_length"):
        return _masked_attention_step(node)
    return nn_kernels.sdpa_step(node)


def _masked_attention_step(node: Node) -> StepFn:
    """Attention with a mask (an encoder's padding mask, imported models) through BLAS: scores for a
    K/V head's whole group of query heads at once, the mask added (or applied, if bool) in place."""
    attrs = node.attrs
    reference = REGISTRY[Op.SDPA].reference

    def step(q, k, v, mask):
        if q.dtype != np.float32 or q.ndim != 4 or q.shape[0] != k.shape[0] or mask.dtype not in (np.float32, np.bool_) \
                or attrs.get("window") or attrs.get("softcap"):
            return reference((q, k, v, mask), attrs)
        b, hq, tq, d = q.shape
        hk, tk = k.shape[1], k.shape[2]
        group = hq // hk
        scale = np.float32(attrs["scale"] if attrs.get("scale") is not None else 1.0 / np.sqrt(d))
        s = np.matmul(q.reshape(b, hk, group * tq, d), k.transpose(0, 1, 3, 2))  # [B, Hk, G*Tq, Tk]
        m4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        if mask.dtype == np.float32 and m4.shape[-1] == tk:   # scale, mask, softmax: one compiled pass per row
            nn_kernels.masked_softmax(s.reshape(b, hq, tq, tk), np.ascontiguousarray(m4), scale, bool(attrs.get("causal")))
            return np.matmul(s, v).reshape(b, hq, tq, v.shape[3])
        s *= scale
        s5 = s.reshape(b, hk, group, tq, tk)
        m = np.broadcast_to(m4, (b, hq, tq, tk)).reshape(b, hk, group, tq, tk)
        if mask.dtype == np.bool_:
            s5[~m] = -np.inf
        else:
            s5 += m
        if attrs.get("causal"):
            s5[..., np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq)] = -np.inf
        top = s.max(axis=-1, keepdims=True)
        top[~np.isfinite(top)] = 0  # rows that see no key give zeros, as the reference does
        s -= top
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        total[total == 0] = 1
        s /= total
        return np.matmul(s, v).reshape(b, hq, tq, v.shape[3])
    return step


@lowering(Op.RMS_NORM)
def _rms_norm(node: Node, out):
    if _is_f32(node) and len(node.src) == 2:
        eps = np.float32(node.attrs["eps"])
        return lambda x, w: nn_kernels.rms_norm(x, w, eps)
    return _reference(node, out)


@lowering(Op.LAYER_NORM)
def _layer_norm(node: Node, out):
    if not (_is_f32(node) and node.type.rank >= 1):
        return _reference(node, out)
    eps, has_w, has_b = np.float32(node.attrs["eps"]), node.attrs.get("has_weight"), node.attrs.get("has_bias")
    return lambda x, *p: nn_kernels.layer_norm(x, p[0] if has_w else None, p[-1] if has_b else None, eps)


@lowering(Op.ROPE)
def _rope(node: Node, out):
    return nn_kernels.rope_step(node)


@lowering(*GroupOp.Fft)
def _fft(node: Node, out):
    """The reference's transform through scipy.fft where it is installed: both are pocketfft, but
    scipy's vectorises across a batch of transforms (STFT frames), ~3x numpy.fft on [frames, n_fft],
    and splits a batch over the cores this process may use (workers)."""
    try:
        import scipy.fft as fftlib
        options = {"workers": _fft_workers(node)}
    except ImportError:
        fftlib, options = np.fft, {}
    op, axes, norm = node.op, node.attrs["axes"], node.attrs["norm"]
    if op == Op.IRFFT:
        n = node.attrs.get("n")

        def inverse_real(x):
            s = [x.shape[a] for a in axes[:-1]] + [n if n is not None else 2 * (x.shape[axes[-1]] - 1)]
            return fftlib.irfftn(x, s=s, axes=axes, norm=INVERSE_NORM[norm], **options).astype(np.float32, copy=False)
        return inverse_real
    transform = {Op.FFT: fftlib.fftn, Op.IFFT: fftlib.ifftn, Op.RFFT: fftlib.rfftn}[op]
    scaling = (INVERSE_NORM if op == Op.IFFT else FORWARD_NORM)[norm]
    return lambda x: transform(x, axes=axes, norm=scaling, **options).astype(np.complex64, copy=False)


def _fft_workers(node: Node) -> int:
    """Threads for one FFT step: the usable cores for a batch of at least 64 transforms (STFT frames),
    one otherwise (a thread costs more than a small transform)."""
    shape, axes = node.src[0].type.shape, node.attrs["axes"]
    batch = int(np.prod([d or 1 for a, d in enumerate(shape) if a not in axes], dtype=np.int64))
    if batch < 64:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


class CpuPlan:
    """A program lowered to a flat list of steps over value slots."""

    def __init__(self, program: Program, executable):
        self.program = program
        options = getattr(executable, "options", None) or CompileOptions()
        options = options.cpu
        self.threads = options.resolved_threads   # the GEMV pool's and BLAS's (kernels.blas_threads)
        nodes = program.nodes()
        # Where Ingot's own threads split the work (quantized matmuls: the GEMV team, the GEMM's
        # columns; convolutions: their output channels), BLAS runs on one: OpenBLAS's threads spin
        # ~0.1 s after each call and took the core from Ingot's worker (pp512 at 2 threads 169 tok/s
        # against 190 at one; a YOLO 6.9 ms against 5.7, a CRNN's recurrences 5.4 against 2.2).
        self.blas = 1 if any(n.op in OWN_THREADS or n.op == Op.FUSED and n.attrs.get("kind") in CONV_KINDS
                             for n in nodes) else self.threads
        self.slot = {n.id: i for i, n in enumerate(nodes)}
        self.initial: list[Any] = [None] * len(nodes)
        self.feed_slots: list[tuple[str, int, TensorType]] = []
        self.variable_slots: list[tuple[str, int]] = []
        self.steps: list[tuple[StepFn, tuple[int, ...], int]] = []
        self.step_nodes: list[tuple[int, ...]] = []  # node ids each step computes (ingot view --profile)
        self._items: dict[int, tuple[int, StepFn]] = {}   # step -> (the index a get_item step takes, its step)
        self._runner_steps: list | None = None
        self._compiled: Callable | None = None
        buffers = [np.empty(n, np.uint8) for n in program.buffer_sizes]
        last_use: dict[int, int] = {}
        # constants some other node reads than those that take a dt.TiledWeight as it is (an affine
        # quantized_matmul's weight; a quantized_gather's, which reads only the rows or columns it takes)
        others: set[int] = set()
        for i, n in enumerate(nodes):
            for j, s in enumerate(n.src):
                last_use[self.slot[s.id]] = i
                if not ((n.op == Op.QUANTIZED_MATMUL and j == 1 and n.attrs.get("mode") == "affine")
                        or (n.op == Op.QUANTIZED_GATHER and j == 0)):
                    others.add(s.id)
        keep = {self.slot[n.id] for n in program.roots} | {self.slot[a.src[1].id] for a in program.assigns}
        for i, node in enumerate(nodes):
            s = self.slot[node.id]
            if node.op == Op.CONSTANT:
                value = program.constants[node.attrs["key"]]
                if isinstance(value, dt.TiledWeight) and node.id in others:   # read as the array it stands for
                    value = _untiled(value)
                self.initial[s] = value
                keep.add(s)
                continue
            if node.op == Op.PLACEHOLDER:
                self.feed_slots.append((node.name, s, node.type))
                continue
            if node.op == Op.VARIABLE:
                self.variable_slots.append((node.attrs["name"], s))
                continue
            if node.op == Op.ASSIGN:
                continue
            if widens_weight(node):  # a bf16 weight widened once, at load, and shared by every plan
                self.initial[s] = _widened(program.constants[node.src[0].attrs["key"]])
                keep.add(s)
                continue
            out = None
            if node.id in program.memory_plan:
                t = node.type
                at = program.memory_offsets.get(node.id, 0)   # (a concat's input: its slot)
                out = buffers[program.memory_plan[node.id]][at: at + t.nbytes].view(t.dtype.storage).reshape(
                    dt.storage_shape(t.shape, t.dtype))
            if node.op in (Op.CALL, Op.IF):
                fn = _call_step(node, executable)
            elif node.op in WITH_OPTIONS:
                fn = LOWERINGS[node.op](node, out, options)
            else:
                fn = LOWERINGS.get(node.op, _reference)(node, out)
            if node.op == Op.GET_ITEM:   # (the generated runner subscripts; a step replaced since is called)
                self._items[len(self.steps)] = (int(node.attrs["index"]), fn)
            self.steps.append((fn, tuple(self.slot[x.id] for x in node.src), s))
            self.step_nodes.append((node.id,))
        # free each slot after its last reader, unless the caller or the state needs it
        frees: dict[int, list[int]] = {}
        for s, i in last_use.items():
            if s not in keep:
                frees.setdefault(i, []).append(s)
        step_of_node = {}
        j = 0
        for i, node in enumerate(nodes):
            if node.op not in (Op.CONSTANT, Op.PLACEHOLDER, Op.VARIABLE, Op.ASSIGN) and not widens_weight(node):
                step_of_node[i] = j
                j += 1
        self.frees: list[tuple[int, ...]] = [() for _ in self.steps]
        for i, slots in frees.items():
            if i in step_of_node:
                self.frees[step_of_node[i]] = tuple(slots)
        self.output_slots = [self.slot[n.id] for n in program.outputs]
        self.assign_slots = [(a.src[0].attrs["name"], self.slot[a.src[1].id]) for a in program.assigns]
        # an output must not alias memory a later run changes (a variable: copy it) or the
        # constants every run reads (a read-only view)
        base: dict[int, Node] = {}
        for n in nodes:
            base[n.id] = base[n.src[0].id] if (n.op in GroupOp.View or n.attrs.get("inplace")) and n.src else n
        self.output_fixups = [(i, base[n.id].op == Op.VARIABLE) for i, n in enumerate(program.outputs)
                              if base[n.id].op in (Op.VARIABLE, Op.CONSTANT)]

    def run(self, feeds: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> list[np.ndarray]:
        kernels.blas_threads(self.blas)
        nn_kernels.SPLIT["threads"] = self.threads if self.blas == 1 else 1
        outputs, assigned = self._runner()(feeds, state)
        for i, copy in self.output_fixups:
            outputs[i] = np.array(outputs[i], copy=True) if copy else _read_only(outputs[i])
        if self.assign_slots:
            _assign(state, [(name, value) for (name, _), value in zip(self.assign_slots, assigned)])
        return outputs

    def _runner(self) -> Callable:
        """The steps as one generated Python function of (feeds, state): values in local variables, the
        constants (and the steps) bound once as the closure's, each step one call (a get_item one
        subscript), each slot dropped after its last reader: a step costs ~0.1 us of interpreter time,
        where indexing a list of values per step cost ~0.7 (small models run hundreds of steps), and a
        run copies no list of every slot (a 14-step VAD: 0.8 us a run around its steps -> ~0.3). Made
        again when `steps` is replaced (ingot view --profile times them)."""
        if self._runner_steps is self.steps:
            return self._compiled
        produced = {out for _, _, out in self.steps}
        read = {i for _, ins, _ in self.steps for i in ins} | set(self.output_slots) | {s for _, s in self.assign_slots}
        feeds = [(k, s) for k, (_, s, _) in enumerate(self.feed_slots) if s in read]
        variables = [(k, s) for k, (_, s) in enumerate(self.variable_slots) if s in read]
        bound = read - produced - {s for _, s in feeds} - {s for _, s in variables}
        lines = ["def make(fns, initial, feed_names, variable_names):"]
        lines += [f"    f{k} = fns[{k}]" for k in range(len(self.steps))]
        lines += [f"    v{s} = initial[{s}]" for s in sorted(bound)]          # constants: never freed, never rebound
        lines += [f"    n{k} = feed_names[{k}]" for k, _ in feeds]
        lines += [f"    w{k} = variable_names[{k}]" for k, _ in variables]
        lines += ["    def run(feeds, state):"]
        lines += [f"        v{s} = feeds[n{k}]" for k, s in feeds]
        lines += [f"        v{s} = state[w{k}]" for k, s in variables]
        for k, ((_, ins, out), frees) in enumerate(zip(self.steps, self.frees)):
            item = self._items.get(k)
            call = f"v{ins[0]}[{item[0]}]" if item is not None and item[1] is self.steps[k][0] else \
                f"f{k}({', '.join(f'v{i}' for i in ins)})"
            lines.append(f"        v{out} = {call}")
            lines += [f"        v{f} = None" for f in frees if f not in bound]   # (a closure's: never local)
        outs = ", ".join(f"v{s}" for s in self.output_slots)
        assigned = "".join(f"v{s}, " for _, s in self.assign_slots)
        lines += [f"        return [{outs}], ({assigned})", "    return run"]
        namespace: dict[str, Any] = {}
        exec(_plan_code("\n".join(lines)), namespace)   # our own source: slot numbers only
        self._compiled = namespace["make"]([fn for fn, _, _ in self.steps], self.initial,
                                           [name for name, _, _ in self.feed_slots], [name for name, _ in self.variable_slots])
        self._runner_steps = self.steps
        return self._compiled


@functools.lru_cache(maxsize=32)
def _plan_code(source: str):
    """A plan's generated source compiled, remembered by its text: an imported ONNX model's executables for
    new input shapes of one structure make the same source (PP-OCRv4's detector: 2.5-2.9 ms a compile)."""
    return compile(source, "<ingot cpu plan>", "exec")


_WIDENED: dict[int, np.ndarray] = {}


def _widened(array: np.ndarray) -> np.ndarray:
    """The float32 copy of a bf16 constant, made once per array (prefill and decode
    executables share it) and dropped with the array."""
    hit = _WIDENED.get(id(array))
    if hit is None:
        hit = _WIDENED[id(array)] = _read_only(np.asarray(array, np.float32))
        weakref.finalize(array, _WIDENED.pop, id(array), None)
    return hit


_UNTILED: dict[int, np.ndarray] = {}


def _untiled(tiled: dt.TiledWeight) -> np.ndarray:
    """The k-major array of a dt.TiledWeight for readers other than quantized_matmul's kernels (a
    gather from a tied 4-bit embedding, say), made once per weight and dropped with it."""
    hit = _UNTILED.get(id(tiled))
    if hit is None:
        hit = _UNTILED[id(tiled)] = _read_only(np.asarray(tiled))
        weakref.finalize(tiled, _UNTILED.pop, id(tiled), None)
    return hit


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _assign(state: dict[str, np.ndarray], updates: list[tuple[str, np.ndarray]]) -> None:
    """Write each new value into its variable's own array (identity kept; in-place updates are done)."""
    pending = [(state[name], value) for name, value in updates if value is not state[name]]
    if len(pending) > 1:  # a value that reads another assigned variable must be taken before that one is written
        pending = [(target, np.array(value, copy=True) if any(other is not target and np.may_share_memory(value, other)
                                                              for other, _ in pending) else value)
                   for target, value in pending]
    for target, value in pending:
        target[...] = value


def _call_step(node: Node, executable) -> StepFn:
    """A call, or an if: its condition (src 0) picks which bound executable runs."""

    def call(*xs, name=node.attrs.get("name")):
        target = executable.callables.get(name)
        if target is None:
            raise IngotError(f"call: no executable is bound to {name!r}; pass callables={{{name!r}: exe}} or exe.bind().")
        outs = target.run(list(xs))
        # a result that is a view of an input would alias this plan's buffers: give it its own memory
        return tuple(np.array(o, copy=True) if any(np.may_share_memory(o, x) for x in xs) else o for o in outs)

    if node.op == Op.IF:
        def branch(cond, *xs):
            return call(*xs, name=node.attrs["then"] if bool(np.asarray(cond).reshape(-1)[0]) else node.attrs["else"])
        return branch
    return call


class CpuBackend:
    name = "cpu"

    def prepare(self, program: Program, executable) -> CpuPlan:
        return CpuPlan(program, executable)

    def new_state(self, program: Program) -> dict[str, np.ndarray]:
        # all-zero initial values (KV caches) start as fresh zero pages: memory becomes resident
        # only as positions are written
        return {k: np.zeros(v.shape, v.dtype) if not v.any() else np.array(v, copy=True)
                for k, v in program.variables.items()}

    def to_host(self, value) -> np.ndarray:
        return value

    def from_host(self, value: np.ndarray, t: TensorType) -> np.ndarray:
        return value


__all__ = ["CpuBackend", "CpuPlan", "LOWERINGS", "GroupOp"]
