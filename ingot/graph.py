"""The builder API: `ingot.Graph` and its tensor handles, named after MPSGraph in snake_case.

    >>> import numpy as np, ingot
    >>> g = ingot.Graph()
    >>> x = g.placeholder((2, 3), ingot.float32, name="x")
    >>> y = g.softmax(x * 2.0, axis=-1)
    >>> exe = g.compile(targets=[y])
    >>> exe.run({"x": np.zeros((2, 3), np.float32)})[0].round(3).tolist()
    [[0.333, 0.333, 0.333], [0.333, 0.333, 0.333]]

Shapes and dtypes are inferred as each op is built; a mismatch raises IngotError at once.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import dtypes as dt
from .errors import IngotError
from .ir import Node, Op, Ref, TensorType
from .ops import infer_type, normalize_axis


Scalar = int | float | bool


class Tensor:
    """A handle on a node of a Graph; supports Python operators."""

    __slots__ = ("graph", "node")
    __array_priority__ = 1000  # so ndarray + Tensor calls Tensor.__radd__

    def __init__(self, graph: "Graph", node: Node):
        self.graph, self.node = graph, node

    shape = property(lambda self: self.node.type.shape)
    dtype = property(lambda self: self.node.type.dtype)
    type = property(lambda self: self.node.type)
    name = property(lambda self: self.node.name)
    ndim = property(lambda self: len(self.node.type.shape))

    def __repr__(self) -> str:
        return f"Tensor({self.node!r})"

    def __hash__(self) -> int:
        return hash(self.node.id)

    def __eq__(self, other) -> bool:  # identity: tensors are dict keys in feeds
        return isinstance(other, Tensor) and other.node is self.node

    def __add__(self, o): return self.graph.add(self, o)
    def __radd__(self, o): return self.graph.add(o, self)
    def __sub__(self, o): return self.graph.sub(self, o)
    def __rsub__(self, o): return self.graph.sub(o, self)
    def __mul__(self, o): return self.graph.mul(self, o)
    def __rmul__(self, o): return self.graph.mul(o, self)
    def __truediv__(self, o): return self.graph.div(self, o)
    def __rtruediv__(self, o): return self.graph.div(o, self)
    def __pow__(self, o): return self.graph.pow(self, o)
    def __rpow__(self, o): return self.graph.pow(o, self)
    def __matmul__(self, o): return self.graph.matmul(self, o)
    def __rmatmul__(self, o): return self.graph.matmul(o, self)
    def __neg__(self): return self.graph.neg(self)
    def __abs__(self): return self.graph.abs(self)
    def __lt__(self, o): return self.graph.less(self, o)
    def __le__(self, o): return self.graph.less_equal(self, o)
    def __gt__(self, o): return self.graph.greater(self, o)
    def __ge__(self, o): return self.graph.greater_equal(self, o)
    def __and__(self, o): return self.graph.logical_and(self, o)
    def __or__(self, o): return self.graph.logical_or(self, o)
    def __xor__(self, o): return self.graph.logical_xor(self, o)
    def __invert__(self): return self.graph.logical_not(self)

    def __getitem__(self, index):
        return self.graph._getitem(self, index)

    def reshape(self, *shape): return self.graph.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
    def transpose(self, *perm): return self.graph.transpose(self, perm or None)
    def astype(self, dtype): return self.graph.cast(self, dtype)
    def sum(self, axis=None, keepdims=False): return self.graph.sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return self.graph.mean(self, axis, keepdims)

    @property
    def T(self): return self.graph.transpose(self)


TensorLike = Tensor | np.ndarray | Scalar


class Graph:
    """A graph under construction. Build ops with its methods, then `compile`."""

    def __init__(self):
        self.constants: dict[str, np.ndarray] = {}
        self.variables: dict[str, np.ndarray] = {}
        self.variable_nodes: dict[str, Node] = {}
        self.assigns: list[Node] = []
        self.placeholders: dict[str, Node] = {}
        self._compiled: dict[Any, Any] = {}
        self.typed: set[int] = set()   # ids of the nodes _op made: their types are their rules' (the compiler's
                                       # first verify does not ask those rules again)

    # -- building blocks ------------------------------------------------------------------------
    def _op(self, op: Op, src: Sequence[Tensor], attrs: dict[str, Any] | None = None, name: str | None = None) -> Tensor:
        attrs = attrs or {}
        nodes = tuple(self._own(s).node for s in src)
        node_type = infer_type(op, [n.type for n in nodes], attrs)
        node = Node(op, node_type, nodes, attrs, name)
        self.typed.add(node.id)
        return Tensor(self, node)

    def op(self, op: Op, inputs: Sequence[Tensor], attrs: dict[str, Any] | None = None, name: str | None = None) -> Tensor:
        """Any IR op by its enum entry, for the ops without a builder method of their own.

            >>> g = Graph(); x = g.placeholder((3,), name="x")
            >>> g.op(Op.FLOOR, [x]).type
            float32[3]
        """
        return self._op(op, inputs, attrs, name)

    def _own(self, t: Tensor) -> Tensor:
        if not isinstance(t, Tensor):
            raise IngotError(f"expected an ingot Tensor, got {type(t).__name__}.")
        if t.graph is not self:
            raise IngotError(f"tensor {t.node!r} belongs to another graph.")
        return t

    def _lift(self, value: TensorLike, like: Tensor | None = None) -> Tensor:
        """A Python scalar or array as a constant (scalars take the dtype of `like`)."""
        if isinstance(value, Tensor):
            return self._own(value)
        if isinstance(value, (bool, int, float, np.generic)) and like is not None:
            dtype = like.dtype
            if isinstance(value, float) and not (dtype.is_float or dtype == dt.complex64):
                raise IngotError(f"cannot combine the float {value} with a {dtype.name} tensor without a cast.")
            return self.constant(np.asarray(value, dtype.numpy))
        return self.constant(np.asarray(value))

    def _pair(self, a: TensorLike, b: TensorLike) -> tuple[Tensor, Tensor]:
        if isinstance(a, Tensor):
            return a, self._lift(b, a)
        if isinstance(b, Tensor):
            return self._lift(a, b), b
        raise IngotError("an op needs at least one ingot Tensor input.")

    # -- sources and state ------------------------------------------------------------------------
    def placeholder(self, shape: Iterable[int | None], dtype: dt.DType = dt.float32, name: str | None = None) -> Tensor:
        """A graph input. A dimension of None is dynamic and fixed when the graph is compiled."""
        name = name or f"input_{len(self.placeholders)}"
        if name in self.placeholders:
            raise IngotError(f"placeholder: the name {name!r} is already taken.")
        node = Node(Op.PLACEHOLDER, TensorType(shape, dtype), (), {}, name)
        self.placeholders[name] = node
        return Tensor(self, node)

    def constant(self, value, dtype: dt.DType | None = None, name: str | None = None) -> Tensor:
        """A constant. For int4/uint4 pass the packed bytes (two values per byte, low nibble first), or
        a dt.TiledWeight of them (kept as it is: the CPU's storage form of a 4-bit weight)."""
        array = value if isinstance(value, dt.TiledWeight) else np.asarray(value)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        elif array.dtype == np.complex128:
            array = array.astype(np.complex64)
        if dtype is not None and dtype.packed:
            if array.dtype != np.uint8:
                raise IngotError(f"constant: packed {dtype.name} data must be uint8 bytes, not {array.dtype}.")
            shape = array.shape[:-1] + (array.shape[-1] * 2,)
        else:
            if dtype is not None:
                array = array.astype(dtype.numpy)
            dtype = dt.from_numpy(array.dtype)
            shape = array.shape
        key = name or f"const_{len(self.constants)}"
        while key in self.constants:
            key = f"{key}_"
        self.constants[key] = array
        return Tensor(self, Node(Op.CONSTANT, TensorType(shape, dtype), (), {"key": key}, key))

    def variable(self, initial, name: str, dtype: dt.DType | None = None) -> Tensor:
        """State that persists across runs of an executable (one copy per state object)."""
        array = np.asarray(initial) if dtype is None else np.asarray(initial).astype(dtype.numpy)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        if name in self.variables:
            raise IngotError(f"variable: the name {name!r} is already taken.")
        self.variables[name] = array
        node = Node(Op.VARIABLE, TensorType(array.shape, dt.from_numpy(array.dtype)), (), {"name": name}, name)
        self.variable_nodes[name] = node
        return Tensor(self, node)

    def read(self, variable: Tensor) -> Tensor:
        """The variable's value at the start of a run (assigns take effect when the run ends)."""
        if variable.node.op != Op.VARIABLE:
            raise IngotError(f"read: {variable.node!r} is not a variable.")
        return variable

    def assign(self, variable: Tensor, value: TensorLike) -> Tensor:
        """Set the variable to value when the run ends. Runs on every `run` of a compiled graph."""
        if variable.node.op != Op.VARIABLE:
            raise IngotError(f"assign: {variable.node!r} is not a variable.")
        value = self._lift(value, variable)
        out = self._op(Op.ASSIGN, [variable, value])
        self.assigns.append(out.node)
        return out

    # -- elementwise ----------------------------------------------------------------------------
    def _binary(self, op, a, b):
        a, b = self._pair(a, b)
        return self._op(op, [a, b])

    def add(self, a, b): return self._binary(Op.ADD, a, b)
    def sub(self, a, b): return self._binary(Op.SUB, a, b)
    def mul(self, a, b): return self._binary(Op.MUL, a, b)
    def div(self, a, b): return self._binary(Op.DIV, a, b)
    def pow(self, a, b): return self._binary(Op.POW, a, b)
    def maximum(self, a, b): return self._binary(Op.MAXIMUM, a, b)
    def minimum(self, a, b): return self._binary(Op.MINIMUM, a, b)
    def equal(self, a, b): return self._binary(Op.EQUAL, a, b)
    def not_equal(self, a, b): return self._binary(Op.NOT_EQUAL, a, b)
    def less(self, a, b): return self._binary(Op.LESS, a, b)
    def less_equal(self, a, b): return self._binary(Op.LESS_EQUAL, a, b)
    def greater(self, a, b): return self._binary(Op.GREATER, a, b)
    def greater_equal(self, a, b): return self._binary(Op.GREATER_EQUAL, a, b)
    def logical_and(self, a, b): return self._binary(Op.LOGICAL_AND, a, b)
    def logical_or(self, a, b): return self._binary(Op.LOGICAL_OR, a, b)
    def logical_xor(self, a, b): return self._binary(Op.LOGICAL_XOR, a, b)

    def neg(self, x): return self._op(Op.NEG, [x])
    def abs(self, x): return self._op(Op.ABS, [x])
    def exp(self, x): return self._op(Op.EXP, [x])
    def log(self, x): return self._op(Op.LOG, [x])
    def sqrt(self, x): return self._op(Op.SQRT, [x])
    def rsqrt(self, x): return self._op(Op.RSQRT, [x])
    def tanh(self, x): return self._op(Op.TANH, [x])
    def sigmoid(self, x): return self._op(Op.SIGMOID, [x])
    def silu(self, x): return self._op(Op.SILU, [x])
    def erf(self, x): return self._op(Op.ERF, [x])
    def sin(self, x): return self._op(Op.SIN, [x])
    def cos(self, x): return self._op(Op.COS, [x])
    def logical_not(self, x): return self._op(Op.LOGICAL_NOT, [x])
    def real(self, x): return self._op(Op.REAL, [x])
    def imag(self, x): return self._op(Op.IMAG, [x])
    def complex(self, re, im): return self._binary(Op.COMPLEX, re, im)

    def gelu(self, x, approximate: str = "none"):
        """GELU; approximate="tanh" for the tanh form, "none" for the exact erf form."""
        if approximate not in ("none", "tanh"):
            raise IngotError(f"gelu: approximate must be 'none' or 'tanh', not {approximate!r}.")
        return self._op(Op.GELU, [x], {"approximate": approximate})

    def cast(self, x, dtype: dt.DType):
        return self._op(Op.CAST, [x], {"dtype": dtype})

    def where(self, condition, a, b):
        condition = self._own(condition)
        like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
        if like is None:
            raise IngotError("where: at least one branch must be a Tensor.")
        return self._op(Op.WHERE, [condition, self._lift(a, like), self._lift(b, like)])

    # -- reductions -----------------------------------------------------------------------------
    def _axes(self, op, x, axis) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(x.ndim))
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        return tuple(sorted(normalize_axis(op, a, x.ndim) for a in axes))

    def _reduce(self, op, x, axis, keepdims):
        x = self._own(x)
        return self._op(op, [x], {"axes": self._axes(op, x, axis), "keepdims": bool(keepdims)})

    def sum(self, x, axis=None, keepdims=False): return self._reduce(Op.SUM, x, axis, keepdims)
    def mean(self, x, axis=None, keepdims=False): return self._reduce(Op.MEAN, x, axis, keepdims)
    def max(self, x, axis=None, keepdims=False): return self._reduce(Op.MAX, x, axis, keepdims)
    def min(self, x, axis=None, keepdims=False): return self._reduce(Op.MIN, x, axis, keepdims)
    def argmax(self, x, axis: int = -1, keepdims=False): return self._reduce(Op.ARGMAX, x, axis, keepdims)
    def argmin(self, x, axis: int = -1, keepdims=False): return self._reduce(Op.ARGMIN, x, axis, keepdims)

    def softmax(self, x, axis: int = -1):
        x = self._own(x)
        return self._op(Op.SOFTMAX, [x], {"axis": normalize_axis(Op.SOFTMAX, axis, x.ndim)})

    def log_softmax(self, x, axis: int = -1):
        x = self._own(x)
        return self._op(Op.LOG_SOFTMAX, [x], {"axis": normalize_axis(Op.LOG_SOFTMAX, axis, x.ndim)})

    # -- shape ----------------------------------------------------------------------------------
    def reshape(self, x, shape: Sequence[int]):
        return self._op(Op.RESHAPE, [x], {"shape": tuple(int(d) for d in shape)})

    def transpose(self, x, perm: Sequence[int] | None = None):
        x = self._own(x)
        perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(normalize_axis(Op.TRANSPOSE, p, x.ndim) for p in perm)
        return self._op(Op.TRANSPOSE, [x], {"perm": perm})

    permute = transpose

    def swapaxes(self, x, a: int, b: int):
        perm = list(range(x.ndim))
        a, b = normalize_axis(Op.TRANSPOSE, a, x.ndim), normalize_axis(Op.TRANSPOSE, b, x.ndim)
        perm[a], perm[b] = perm[b], perm[a]
        return self.transpose(x, perm)

    def dim(self, x, axis: int) -> Tensor:
        """The length of one axis as an int32 scalar (known once the graph is compiled)."""
        x = self._own(x)
        return self._op(Op.DIM, [x], {"axis": normalize_axis(Op.DIM, axis, x.ndim)})

    def broadcast_to(self, x, shape: Sequence[int]):
        return self._op(Op.BROADCAST_TO, [x], {"shape": tuple(int(d) for d in shape)})

    def expand_dims(self, x, axis: int):
        x = self._own(x)
        axis = normalize_axis("expand_dims", axis, x.ndim + 1)
        return self.reshape(x, self._shape_for_reshape(x)[:axis] + (1,) + self._shape_for_reshape(x)[axis:])

    def squeeze(self, x, axis: int | Sequence[int] | None = None):
        x = self._own(x)
        axes = [i for i, d in enumerate(x.shape) if d == 1] if axis is None else [normalize_axis("squeeze", a, x.ndim) for a in ((axis,) if isinstance(axis, int) else axis)]
        if any(x.shape[a] != 1 for a in axes):
            raise IngotError(f"squeeze: axes {axes} of shape {x.shape} are not all of size 1.")
        return self.reshape(x, tuple(d for i, d in enumerate(self._shape_for_reshape(x)) if i not in axes))

    @staticmethod
    def _shape_for_reshape(x: Tensor) -> tuple[int, ...]:
        if sum(d is None for d in x.shape) > 1:
            raise IngotError(f"reshape: shape {x.shape} has more than one dynamic dimension; compile with concrete feeds first.")
        return tuple(-1 if d is None else d for d in x.shape)

    def concat(self, tensors: Sequence[Tensor], axis: int = 0):
        tensors = [self._own(t) for t in tensors]
        if not tensors:
            raise IngotError("concat: needs at least one tensor.")
        return self._op(Op.CONCAT, tensors, {"axis": normalize_axis(Op.CONCAT, axis, tensors[0].ndim)})

    def split(self, x, sections: int | Sequence[int], axis: int = 0) -> list[Tensor]:
        """Split into equal sections (an int) or at sizes (a list of lengths)."""
        x = self._own(x)
        axis = normalize_axis("split", axis, x.ndim)
        n = x.shape[axis]
        if n is None:
            raise IngotError("split: the split axis must be static.")
        if isinstance(sections, int):
            if sections <= 0 or n % sections:
                raise IngotError(f"split: axis {axis} of length {n} does not split into {sections} equal parts.")
            sizes = [n // sections] * sections
        else:
            sizes = list(sections)
            if sum(sizes) != n or any(s < 0 for s in sizes):
                raise IngotError(f"split: sizes {sizes} do not add up to {n}.")
        out, at = [], 0
        for s in sizes:
            start = [0] * x.ndim
            end = [None] * x.ndim
            start[axis], end[axis] = at, at + s
            out.append(self.slice(x, start, end))
            at += s
        return out

    def pad(self, x, pads: Sequence[tuple[int, int]], mode: str = "constant", value: float = 0.0):
        return self._op(Op.PAD, [x], {"pads": tuple((int(a), int(b)) for a, b in pads), "mode": mode, "value": float(value)})

    def gather(self, x, indices: TensorLike, axis: int = 0):
        x = self._own(x)
        idx = self._lift(indices) if not isinstance(indices, Tensor) else indices
        return self._op(Op.GATHER, [x, idx], {"axis": normalize_axis(Op.GATHER, axis, x.ndim)})

    take = gather

    # -- mixture of experts (ops/moe.py) ----------------------------------------------------------
    def top_k(self, x, k: int):
        """int32 indices of the k largest entries along the last axis, largest first."""
        return self._op(Op.TOP_K, [self._own(x)], {"k": int(k)})

    def take_along_axis(self, x, indices, axis: int = -1):
        """np.take_along_axis: x's entries at `indices` along `axis` (e.g. the top_k values)."""
        x = self._own(x)
        return self._op(Op.TAKE_ALONG_AXIS, [x, self._own(indices)], {"axis": normalize_axis(Op.TAKE_ALONG_AXIS, axis, x.ndim)})

    def gather_matmul(self, x, experts, indices):
        """Routed expert matmul: x [T, S, K] (S = 1 or J), experts [E, K, N], indices [T, J] ->
        [T, J, N] with out[t, j] = x[t, j or 0] @ experts[indices[t, j]]. Over dequantize(q, ...) the
        compiler multiplies the packed weights of the chosen experts only (quantized_gather_matmul)."""
        return self._op(Op.GATHER_MATMUL, [self._own(x), self._own(experts), self._own(indices)])

    def slice(self, x, start: Sequence[Any], end: Sequence[Any] | None = None, step: Sequence[int] | None = None,
              size: Sequence[int | None] | None = None):
        """x[start:end:step] per axis. start/end entries may be ints, None or scalar int Tensors
        (runtime positions); `size` fixes the length of an axis whose start is a runtime tensor."""
        x = self._own(x)
        rank = x.ndim
        pad = lambda seq, fill: list(seq or []) + [fill] * (rank - len(seq or []))  # noqa: E731
        start, end, step, size = pad(start, None), pad(end, None), pad(step, 1), pad(size, None)
        if max(len(start), len(end), len(step), len(size)) > rank:
            raise IngotError(f"slice: more indices than the {rank} axes of {x.shape}.")
        src: list[Tensor] = [x]

        def entry(value, default):
            if value is None:
                return default
            if isinstance(value, Tensor):
                src.append(value)
                return Ref(len(src) - 1)
            return int(value)

        steps = tuple(int(s) for s in step)
        # an omitted start is the first element along the step: 0 forwards, the last (-1) backwards
        starts = tuple(entry(s, 0 if st > 0 else -1) for s, st in zip(start, steps))
        ends = tuple(entry(e, None) for e in end)
        attrs = {"start": starts, "end": ends, "step": steps}
        if any(s is not None for s in size):
            attrs["size"] = tuple(None if s is None else int(s) for s in size)
        return self._op(Op.SLICE, src, attrs)

    def _getitem(self, x, index):
        index = index if isinstance(index, tuple) else (index,)
        start, end, step, size, drop = [], [], [], [], []
        for axis, item in enumerate(index):
            if isinstance(item, slice):
                start.append(item.start); end.append(item.stop); step.append(item.step or 1); size.append(None)
            elif isinstance(item, (int, np.integer)):
                i, n = int(item), x.shape[axis] if axis < x.ndim else None
                if n is not None and not -n <= i < n:
                    raise IngotError(f"indexing: index {i} is out of range for axis {axis} of {x.type}.")
                # size 1, so the axis is known to be 1 (and can be dropped) even where its length is dynamic
                start.append(i); end.append(None); step.append(1); size.append(1); drop.append(axis)
            else:
                raise IngotError(f"tensor indexing takes ints and slices, not {type(item).__name__}.")
        out = self.slice(x, start, end, step, size)
        return self.squeeze(out, drop) if drop else out

    def slice_update(self, x, update, start: Sequence[Any]):
        """x with `update` written at `start` (ints or scalar int Tensors, one per axis)."""
        x = self._own(x)
        src: list[Tensor] = [x, self._lift(update, x)]
        starts = []
        for s in list(start) + [0] * (x.ndim - len(start)):
            if isinstance(s, Tensor):
                src.append(s)
                starts.append(Ref(len(src) - 1))
            else:
                starts.append(int(s))
        return self._op(Op.SLICE_UPDATE, src, {"start": tuple(starts)})

    def array_view(self, x, shape: Sequence[int], strides: Sequence[int], offset: int = 0):
        """A strided view of x's elements (strides and offset in elements); never a copy."""
        return self._op(Op.ARRAY_VIEW, [x], {"shape": tuple(int(d) for d in shape),
                                             "strides": tuple(int(s) for s in strides), "offset": int(offset)})

    # -- linear algebra and nn --------------------------------------------------------------------
    def matmul(self, a, b):
        a, b = self._pair(a, b)
        return self._op(Op.MATMUL, [a, b])

    def conv(self, x, w, bias=None, strides: Sequence[int] | None = None, dilations: Sequence[int] | None = None,
             pads: Sequence[tuple[int, int]] | None = None, groups: int = 1):
        """N-d convolution of x [N, C, *spatial] with w [M, C / groups, *kernel] (+ bias [M]); pads are
        (before, after) zeros per spatial axis. Defaults: stride 1, dilation 1, no padding."""
        x = self._own(x)
        w = self._lift(w, x)
        k = x.ndim - 2
        src = [x, w] + ([self._lift(bias, x)] if bias is not None else [])
        attrs = {"strides": tuple(int(s) for s in (strides or (1,) * k)),
                 "dilations": tuple(int(d) for d in (dilations or (1,) * k)),
                 "pads": tuple((int(a), int(b)) for a, b in (pads or ((0, 0),) * k)), "groups": int(groups)}
        return self._op(Op.CONV, src, attrs)

    def rms_norm(self, x, weight=None, eps: float = 1e-6):
        """x / sqrt(mean(x^2, last axis) + eps) * weight."""
        src = [x] + ([self._lift(weight)] if weight is not None else [])
        return self._op(Op.RMS_NORM, src, {"eps": float(eps)})

    def layer_norm(self, x, weight=None, bias=None, eps: float = 1e-5):
        src = [x] + ([self._lift(weight)] if weight is not None else []) + ([self._lift(bias)] if bias is not None else [])
        return self._op(Op.LAYER_NORM, src, {"eps": float(eps), "has_weight": weight is not None, "has_bias": bias is not None})

    def rope(self, x, positions: TensorLike = 0, base: float = 10000.0, interleaved: bool = False,
             rotary_dims: int | None = None, inv_freq: np.ndarray | Tensor | None = None):
        """Rotary position embedding over [..., T, D]: `positions` is a scalar offset (token t is at
        offset + t) or one position per token. Half-split pairs (i, i + D/2) unless interleaved
        ((2i, 2i+1), GGUF's layout). `inv_freq` overrides base**(-2i/D) (Llama-3 scaling)."""
        x = self._own(x)
        pos = positions if isinstance(positions, Tensor) else self.constant(np.asarray(positions, np.int32))
        src = [x, pos]
        if inv_freq is not None:
            src.append(self._lift(np.asarray(inv_freq, np.float32)) if not isinstance(inv_freq, Tensor) else inv_freq)
        attrs = {"base": float(base), "interleaved": bool(interleaved)}
        if rotary_dims is not None:
            attrs["rotary_dims"] = int(rotary_dims)
        return self._op(Op.ROPE, src, attrs)

    def scaled_dot_product_attention(self, q, k, v, mask=None, scale: float | None = None, causal: bool = False,
                                     length: Tensor | None = None, window: int = 0, softcap: float = 0.0):
        """softmax(q kᵀ · scale + mask) v over [..., H, T, D]; K/V may have fewer heads (GQA/MQA).
        mask: bool (True = attend) or additive, broadcast to [..., Hq, Tq, Tk]. causal aligns the last
        query with the last key. length: only the first `length` keys count (a runtime scalar).
        window (with causal): each query sees only its last `window` keys, itself included (sliding
        window attention). softcap c: scores s become c * tanh(s / c) before the mask (Gemma 2)."""
        src = [q, k, v]
        if mask is not None:
            src.append(self._lift(mask))
        if length is not None:
            src.append(length)
        attrs = {"scale": None if scale is None else float(scale), "causal": bool(causal),
                 "has_mask": mask is not None, "has_length": length is not None}
        if window:   # only when set: graphs without them are unchanged (fusion passes, packages)
            attrs["window"] = int(window)
        if softcap:
            attrs["softcap"] = float(softcap)
        return self._op(Op.SDPA, src, attrs)

    sdpa = scaled_dot_product_attention

    def pool_attention(self, q, k, v, k_pool, v_pool, slots, positions, scale: float | None = None, window: int = 0,
                       softcap: float = 0.0, scales: tuple | None = None) -> tuple[Tensor, ...]:
        """Decode attention of R independent sequences over a KV pool (ops/pool.py): row r's k [R, Hk, D]
        and v written at positions[r] of pool entry slots[r], then q [R, Hq, D] attending over that
        entry's first positions[r] + 1 keys. Returns (out [R, Hq, Dv], k_pool', v_pool'); assign the
        pools back to their variables (written in place by the compiler). scales: an int8 pool's
        (k_scales, v_scales) [S, Hk, C, 1] float32, returned updated after the pools."""
        attrs: dict[str, Any] = {"scale": None if scale is None else float(scale)}
        if window:
            attrs["window"] = int(window)
        if softcap:
            attrs["softcap"] = float(softcap)
        node = self._op(Op.POOL_ATTENTION, [q, k, v, k_pool, v_pool, slots, positions] + list(scales or ()), attrs)
        return tuple(self._op(Op.GET_ITEM, [node], {"index": i}) for i in range(5 if scales else 3))

    # -- quantization ---------------------------------------------------------------------------
    def _block_param(self, p: TensorLike, q: Tensor, axis: int | None, block_size: int | None, what: str, extra: int = 0) -> Tensor:
        """Reshape a scalar, per-axis or per-block parameter into block-broadcast form."""
        p = self._lift(p) if not isinstance(p, Tensor) else self._own(p)
        rank = q.ndim
        core = p.shape[:len(p.shape) - extra] if extra else p.shape
        tail = p.shape[len(p.shape) - extra:] if extra else ()
        as_target = lambda shape: tuple(-1 if d is None else d for d in shape)  # noqa: E731  (reshape's dynamic dim)
        if len(core) == rank:
            return p
        if len(core) == 0 or (axis is None and all(d == 1 for d in core)):
            return self.reshape(p, (1,) * rank + as_target(tail))
        if axis is None or len(core) != 1:
            raise IngotError(f"{what}: a parameter of shape {p.shape} needs axis= (per-axis or per-block) or the rank of the input ({rank}).")
        axis = normalize_axis(what, axis, rank)
        n, length = core[0], q.shape[axis]
        if block_size is not None and (block_size <= 0 or (length is not None and length % block_size)):
            raise IngotError(f"{what}: block_size {block_size} does not divide axis {axis} of the input {q.type} (length {length}).")
        expect = length if block_size is None or length is None else length // block_size
        if None not in (n, expect) and n != expect and not (block_size is None and length and n and length % n == 0):
            raise IngotError(f"{what}: a parameter of shape {p.shape} does not fit axis {axis} of the input {q.type} "
                             f"(block size {block_size}).")
        shape = [1] * rank
        shape[axis] = n
        return self.reshape(p, as_target(tuple(shape) + tail))

    def dequantize(self, q, scale=None, zero_point=None, bias=None, axis: int | None = None,
                   block_size: int | None = None, lut=None, dtype: dt.DType = dt.float32):
        """Integers to floats: (q - zero_point) * scale + bias, lut[q], or lut[q] * scale (+ bias).

        Parameters are scalars, per-axis (axis=), per-block (axis= and block_size=), or of q's rank
        with each dimension dividing q's. A lookup table has 2**bits entries, per tensor or per group;
        given with scale= each looked-up value is scaled ("scaled_lut": GGUF's IQ and MXFP4 types),
        and with bias= too a per-block offset is added (Ingot's lut4:bB:offset format; no zero_point=).

            >>> import numpy as np, ingot
            >>> g = ingot.Graph()
            >>> q = g.constant(np.array([[0, 1], [2, 3]], np.uint8))
            >>> table = g.constant(np.arange(256, dtype=np.float32) / 2)
            >>> w = g.dequantize(q, lut=table, scale=g.constant(np.float32(2)), bias=g.constant(np.float32(1)))
            >>> g.compile(feeds={}, targets=[w], device="cpu").run({})[0].tolist()
            [[1.0, 2.0], [3.0, 4.0]]
        """
        q = self._own(q)
        if lut is None and scale is None:
            raise IngotError("dequantize: give scale= (affine), lut= (lookup table) or both (scaled lookup table).")
        attrs = {"qdtype": q.dtype, "dtype": dtype}
        if lut is not None and scale is not None:
            if zero_point is not None:
                raise IngotError("dequantize: a scaled lookup table (lut= and scale=) takes no zero_point=.")
            attrs["mode"] = "scaled_lut"
            params = [self._block_param(lut, q, None, None, "dequantize", extra=1),
                      self._block_param(scale, q, axis, block_size, "dequantize")]
            if bias is not None:   # the no-bias form keeps its attributes as they always were
                attrs["has_bias"] = True
                params.append(self._block_param(bias, q, axis, block_size, "dequantize"))
        elif lut is not None:
            if zero_point is not None or bias is not None:
                raise IngotError("dequantize: a lookup table without scale= takes no zero_point= or bias=.")
            attrs["mode"] = "lut"
            params = [self._block_param(lut, q, axis, block_size, "dequantize", extra=1)]
        else:
            attrs.update(mode="affine", has_zero_point=zero_point is not None, has_bias=bias is not None)
            params = [self._block_param(p, q, axis, block_size, "dequantize") for p in (scale, zero_point, bias) if p is not None]
            if zero_point is not None and params[1].dtype.is_int:  # zero points are often stored as integers
                params[1] = self.cast(params[1], dt.float32)
        return self._op(Op.DEQUANTIZE, [q] + params, attrs)

    def quantize(self, x, dtype: dt.DType, scale=None, zero_point=None, axis: int | None = None,
                 block_size: int | None = None, lut=None):
        """Floats to integers: clip(round(x / scale) + zero_point), or the index of the nearest lut entry."""
        x = self._own(x)
        if (lut is None) == (scale is None):
            raise IngotError("quantize: give either scale= (affine) or lut= (lookup table).")
        attrs: dict[str, Any] = {"dtype": dtype}
        if lut is not None:
            attrs["mode"] = "lut"
            params = [self._block_param(lut, x, axis, block_size, "quantize", extra=1)]
        else:
            attrs.update(mode="affine", has_zero_point=zero_point is not None)
            params = [self._block_param(p, x, axis, block_size, "quantize") for p in (scale, zero_point) if p is not None]
            if zero_point is not None:
                params[1] = self.cast(params[1], dt.float32) if not params[1].dtype.is_float else params[1]
        return self._op(Op.QUANTIZE, [x] + params, attrs)

    # -- fft ------------------------------------------------------------------------------------
    def _fft(self, op, x, axes, norm, n=None):
        x = self._own(x)
        axes = (-1,) if axes is None else ((axes,) if isinstance(axes, int) else tuple(axes))
        attrs = {"axes": tuple(normalize_axis(op, a, x.ndim) for a in axes), "norm": norm}
        if op == Op.IRFFT:
            attrs["n"] = n
        return self._op(op, [x], attrs)

    def fft(self, x, axes=None, norm: str = "none"): return self._fft(Op.FFT, x, axes, norm)
    def ifft(self, x, axes=None, norm: str = "size"): return self._fft(Op.IFFT, x, axes, norm)
    def rfft(self, x, axes=None, norm: str = "none"): return self._fft(Op.RFFT, x, axes, norm)
    def irfft(self, x, axes=None, norm: str = "size", n: int | None = None): return self._fft(Op.IRFFT, x, axes, norm, n)

    # -- calls ----------------------------------------------------------------------------------
    def call(self, name: str, inputs: Sequence[Tensor], output_types: Sequence[TensorType]) -> list[Tensor]:
        """Call a separately compiled executable, bound by name at compile time (and re-bindable)."""
        call = self._op(Op.CALL, list(inputs), {"name": name, "output_types": tuple(output_types),
                                                "input_types": tuple(self._own(i).type for i in inputs)})
        return [self._op(Op.GET_ITEM, [call], {"index": i}) for i in range(len(output_types))]

    def if_call(self, cond, then: str, otherwise: str, inputs: Sequence[Tensor], output_types: Sequence[TensorType]) -> list[Tensor]:
        """Run the executable bound to `then` when cond (one value) is true, else the one bound to
        `otherwise`; both take `inputs` and return `output_types`. Only the chosen one runs."""
        inputs = [self._own(i) for i in inputs]
        node = self._op(Op.IF, [self._own(cond)] + inputs, {"then": then, "else": otherwise, "output_types": tuple(output_types),
                                                           "input_types": tuple(i.type for i in inputs)})
        return [self._op(Op.GET_ITEM, [node], {"index": i}) for i in range(len(output_types))]

    # -- compile --------------------------------------------------------------------------------
    def compile(self, feeds: dict[Any, TensorType] | None = None, targets: Sequence[Tensor] | Mapping[str, Tensor] = (),
                device: str = "cpu", callables: dict[str, Any] | None = None, debug: bool | str = False,
                assigns: Sequence[Tensor] | None = None, options=None):
        """Compile targets (and every assign, unless `assigns` names a subset) into an Executable.

        feeds maps placeholders (tensors or names) to concrete TensorTypes; placeholders not named
        keep their declared type, which must then be static. targets: a list, or {name: tensor} to
        name the outputs (`exe.run(...)["name"]`; a list's outputs are "output_0", ... unless the
        tensor is a named placeholder). Results are cached per feed types and options. options: an
        `ingot.CompileOptions` (None: `CompileOptions.from_environment()`).
        """
        from .compiler import compile_graph
        from .options import CompileOptions

        if options is None:
            options = CompileOptions.from_environment()
        elif not isinstance(options, CompileOptions):
            raise IngotError(f"compile: options must be an ingot.CompileOptions, not {type(options).__name__}.")

        names = None
        if isinstance(targets, Mapping):
            names, targets = [str(k) for k in targets], list(targets.values())
        feeds = feeds or {}
        feed_types = {}
        for key, value in feeds.items():
            node = self._placeholder_node(key)
            feed_types[node.name] = value if isinstance(value, TensorType) else TensorType(value, node.type.dtype)
        targets = [self._own(t) for t in targets]
        assign_nodes = self.assigns if assigns is None else [self._own(a).node for a in assigns]
        cache_key = (tuple(sorted(feed_types.items(), key=lambda kv: kv[0])), tuple(t.node.id for t in targets),
                     tuple(a.id for a in assign_nodes), device, debug, options)
        cache_key += (tuple(sorted((k, id(v)) for k, v in (callables or {}).items())), tuple(names or ()))
        if cache_key in self._compiled:
            return self._compiled[cache_key]
        exe = compile_graph(self, [t.node for t in targets], assign_nodes, feed_types, device, callables or {}, debug,
                            options)
        if names is not None:
            from .runtime import name_outputs
            exe.output_names = name_outputs(exe.program.outputs, names)
        self._compiled[cache_key] = exe
        return exe

    def _placeholder_node(self, key) -> Node:
        if isinstance(key, Tensor):
            if key.node.op != Op.PLACEHOLDER:
                raise IngotError(f"feeds: {key.node!r} is not a placeholder.")
            return key.node
        if key not in self.placeholders:
            raise IngotError(f"feeds: no placeholder named {key!r} (have {sorted(self.placeholders)}).")
        return self.placeholders[key]
