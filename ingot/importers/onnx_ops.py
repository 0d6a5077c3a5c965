"""What every ONNX converter works with: the import context (the graph being built, which computes
what it can at import; constant reads; errors), ONNX's types, and the table of converters
(CONVERTERS) with the helpers they share. The converters themselves are grouped by family in
onnx_math, onnx_shape, onnx_nn, onnx_signal, onnx_quant and onnx_attention, which register into
the table when ingot.importers.onnx imports them.

A converter, (Context, OnnxNode) -> the node's outputs as Ingot tensors, builds plain Ingot ops with
the builder API. Operands that ONNX passes as tensors but that Ingot needs as attributes (shapes,
axes, slice bounds, pads) are read with `ctx.constant`, which works because every input shape is
fixed at import and shape arithmetic is computed as the graph is built. What a converter cannot
express raises `ctx.fail(node, why)` (UnsupportedOnnx).
"""
from __future__ import annotations

import math
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..ir import GroupOp, Node, Op, TensorType, toposort
from ..ops import reference
from ..ops.elementwise import NARROW_FORMATS
from ..passes.fold import MAX_ELEMENTS as FOLD_MAX_ELEMENTS, NO_FOLD, widens_weight


class UnsupportedOnnx(IngotError):
    """The model uses ops (or attributes of an op) the importer does not convert."""


class NeedsConstant(UnsupportedOnnx):
    """An operand Ingot needs at import (a shape, axes, bounds) is computed at run time.

    `input_names` are the graph inputs it is computed from: fixing their values with
    `constant_inputs=` makes the model importable (ONNX's node tests pass shapes as inputs)."""

    def __init__(self, message: str, input_names: list[str] | None = None):
        super().__init__(message)
        self.input_names = list(input_names or [])


# ONNX TensorProto element types -> (the Ingot dtype that computes them, the NumPy dtype ONNX declares)
ONNX_DTYPES: dict[int, tuple[dt.DType, np.dtype]] = {
    1: (dt.float32, np.dtype(np.float32)), 2: (dt.uint8, np.dtype(np.uint8)), 3: (dt.int8, np.dtype(np.int8)),
    4: (dt.int32, np.dtype(np.uint16)), 5: (dt.int32, np.dtype(np.int16)), 6: (dt.int32, np.dtype(np.int32)),
    7: (dt.int64, np.dtype(np.int64)), 9: (dt.bool_, np.dtype(np.bool_)), 10: (dt.float16, np.dtype(np.float16)),
    11: (dt.float32, np.dtype(np.float64)), 12: (dt.int64, np.dtype(np.uint32)), 13: (dt.int64, np.dtype(np.uint64)),
    14: (dt.complex64, np.dtype(np.complex64)), 16: (dt.bfloat16, dt.bfloat16.storage),
}
# ONNX types Ingot holds in a wider dtype (ops.elementwise.NARROW_FORMATS), by the ml_dtypes format whose
# values they keep: a Cast to one rounds to that format (Op.NARROW_CAST), run() returns the declared type
NARROW_TYPES = {17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz", 21: "uint4",
                22: "int4", 23: "float4_e2m1fn", 24: "float8_e8m0fnu", 25: "uint2", 26: "int2"}
ONNX_DTYPES.update({elem: (NARROW_FORMATS[fmt], np.dtype(getattr(ml_dtypes, fmt))) for elem, fmt in NARROW_TYPES.items()})
ONNX_TYPE_NAMES = {1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
                   9: "bool", 10: "float16", 11: "double", 12: "uint32", 13: "uint64", 14: "complex64",
                   15: "complex128", 16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2",
                   20: "float8e5m2fnuz", 21: "uint4", 22: "int4", 23: "float4e2m1", 24: "float8e8m0", 25: "uint2",
                   26: "int2"}

KNOWN_MAX_ELEMENTS = 1 << 22  # ops on known values up to this size are computed at import
INTERNED_BYTES = 4096         # an unnamed constant this small is one node per type and value (ImportGraph.constant)
MIN_ELEMENT_BUDGET = 1 << 26  # no tensor of an import holds more elements than this, unless the model's
WEIGHT_BUDGET_FACTOR = 16     # weights are larger: then up to this many times their element count


def ingot_dtype(elem_type: int, what: str) -> dt.DType:
    if elem_type not in ONNX_DTYPES:
        raise UnsupportedOnnx(f"{what} has ONNX type {ONNX_TYPE_NAMES.get(elem_type, elem_type)}, which Ingot does not compute "
                              f"(supported: {', '.join(sorted({ONNX_TYPE_NAMES[k] for k in ONNX_DTYPES}))}).")
    return ONNX_DTYPES[elem_type][0]


_WIDER = {np.dtype(np.float64): np.float32, np.dtype(np.int16): np.int32, np.dtype(np.uint16): np.int32,
          np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64, np.dtype(np.complex128): np.complex64}


def as_ingot_array(array: np.ndarray) -> np.ndarray:
    """A NumPy array in the storage dtype Ingot computes its ONNX type in (run on every feed of every run)."""
    a = np.asarray(array)
    wider = _WIDER.get(a.dtype)
    if wider is not None:
        return a.astype(wider)
    if a.dtype.kind == "V" and a.dtype.name in NARROW_FORMATS:   # ml_dtypes' narrow formats
        return a.astype(NARROW_FORMATS[a.dtype.name].numpy)
    return a


# -- the graph being built ------------------------------------------------------------------------

class ImportGraph(Graph):
    """A Graph that also computes every op whose inputs are all known (constants), as it is built."""

    def __init__(self, max_elements: int = MIN_ELEMENT_BUDGET):
        super().__init__()
        self.known: dict[int, np.ndarray] = {}
        self.interned: dict[tuple, Node] = {}   # small unnamed constants by (type, dtype, bytes) (constant())
        self.interned_ids: set[int] = set()
        self.max_elements = max_elements

    def check_elements(self, shape, what: str) -> None:
        """IngotError when a tensor of `shape` (or of that many elements) would exceed the import's budget; so does
        one dimension past it, even beside a 0 (NumPy cannot make an empty array 2**62 long)."""
        count = shape if isinstance(shape, (int, np.integer)) else math.prod(int(d) for d in shape if d is not None)
        longest = 0 if isinstance(shape, (int, np.integer)) else max((int(d) for d in shape if d is not None), default=0)
        if count > self.max_elements or longest > self.max_elements:
            shown = f"{count} elements" if isinstance(shape, (int, np.integer)) else f"shape {[int(d) for d in shape]}"
            raise IngotError(f"{what} would hold {shown}, more than this import allows ({self.max_elements} elements: "
                             f"the larger of {MIN_ELEMENT_BUDGET} and {WEIGHT_BUDGET_FACTOR}x the model's weights).")

    def _op(self, op, src, attrs=None, name=None):
        out = super()._op(op, src, attrs, name)
        t = out.node.type
        if not isinstance(t, TensorType):
            return out
        shape = t.shape
        if None in shape or math.prod(shape) > self.max_elements or max(shape, default=0) > self.max_elements:
            self.check_elements(shape, f"the {op.name.lower()} result")   # (the refusal, where it is one)
        if op in GroupOp.Source or op in (Op.DEQUANTIZE, Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER, Op.CALL, Op.IF, Op.GET_ITEM):
            return out
        if t.dtype.packed or t.size > KNOWN_MAX_ELEMENTS:
            return out
        values = []
        for s in src:   # (most ops read a computed value: stop at the first unknown)
            v = self.value(s)
            if v is None:
                return out
            values.append(v)
        try:
            with np.errstate(all="ignore"):
                value = np.asarray(reference(op, values, out.node.attrs))
        except Exception:  # a value the op cannot take is left to fail (or not) where it runs
            return out
        if value.shape != t.shape or value.dtype != t.dtype.storage:
            return out
        if op not in NO_FOLD and src and value.size <= FOLD_MAX_ELEMENTS and not widens_weight(out.node):
            # what the compiler's fold pass would compute is a constant now: fold then changes nothing (it
            # rebuilt every node downstream of what it folded, and the verifier checked them again)
            key = f"const_{len(self.constants)}"
            while key in self.constants:
                key = f"{key}_"
            self.constants[key] = np.array(value, order="C", copy=True)
            node = Node(Op.CONSTANT, t, (), {"key": key}, out.node.name or key)
            return Tensor(self, node if out.node.name else self._interned(node))
        self.known[out.node.id] = value
        return out

    def constant(self, value, dtype: dt.DType | None = None, name: str | None = None) -> Tensor:
        """Graph.constant; an unnamed small one (a converter's scalar) is the node made for the same
        type and bytes before, if any: the compiler's CSE merged them (PP-OCRv4's detector: 148; MiniLM
        37), and rebuilt every node downstream."""
        t = super().constant(value, dtype, name)
        return t if name is not None else Tensor(self, self._interned(t.node))

    def _interned(self, node: Node) -> Node:
        """The constant node made before with node's type and bytes (node's own entry dropped), or node."""
        array = self.constants[node.attrs["key"]]
        if node.dtype.packed or not isinstance(array, np.ndarray) or array.nbytes > INTERNED_BYTES:
            return node
        held = self.interned.setdefault((node.type, array.dtype.str, array.tobytes()), node)
        if held is node:
            self.interned_ids.add(node.id)
        else:
            del self.constants[node.attrs["key"]]
        return held

    def value(self, t: Tensor) -> np.ndarray | None:
        """t's value if it is known at import (a constant, or computed only from constants)."""
        node = t.node
        if node.op == Op.CONSTANT:
            return None if node.dtype.packed else self.constants[node.attrs["key"]]
        return self.known.get(node.id)


@dataclass
class OnnxNode:
    """One ONNX node as a converter sees it: inputs as Ingot tensors (None where omitted)."""

    op_type: str
    domain: str
    name: str
    inputs: list[Tensor | None]
    attrs: dict[str, Any]
    outputs: list[str]
    opset: int

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def input(self, i: int) -> Tensor | None:
        return self.inputs[i] if i < len(self.inputs) else None

    @property
    def label(self) -> str:
        return f"{self.op_type} node {self.name!r}" if self.name else f"{self.op_type} node (output {self.outputs[0]!r})"


MAX_SPECIALIZED_ELEMENTS = 64   # an input this small (shapes, axes, scales) may be fixed per value at run


def named_feeds(feeds, onnx_inputs: Sequence[str]) -> dict:
    """Feeds by ONNX input name, from a mapping or a list in the model's input order; unknown names refused."""
    if type(feeds) is not dict and not isinstance(feeds, abc.Mapping):   # (typing's isinstance: ~1.5 us a call)
        feeds = [feeds] if isinstance(feeds, np.ndarray) else list(feeds)
        if len(feeds) != len(onnx_inputs):
            raise IngotError(f"run: expected {len(onnx_inputs)} inputs ({onnx_inputs}), got {len(feeds)}.")
        feeds = dict(zip(onnx_inputs, feeds))
    unknown = [k for k in feeds if k not in onnx_inputs]
    if unknown:
        raise IngotError(f"run: {unknown} are not inputs of this model (inputs: {onnx_inputs}).")
    return dict(feeds)


@dataclass
class Context:
    """What converters use: the graph, the ONNX file's label for errors, and constant reads."""

    g: ImportGraph
    what: str
    opsets: dict[str, int] = field(default_factory=dict)
    quantize: Any = None  # an ingot.quant Format: store matmul weights in it
    declared: dict[int, np.dtype] = field(default_factory=dict)  # node id -> its ONNX type, where Ingot holds it wider
    scope: dict[str, Tensor] | None = None      # the values the graph being converted can read, by ONNX name
    import_subgraph: Any = None                 # (subgraph, outer values[, inputs, into=context]) -> its outputs,
                                                # converted in place (into this context's graph, or `into`'s)
    branches: dict[str, Any] = field(default_factory=dict)  # If branches run at run time, by callable name
    in_branch: bool = False                     # converting such a branch (its inputs are not the model's)
    import_cache: Any = None                    # onnx.ImportCache: what imports of the model at other shapes read

    def onnx_dtype(self, t: Tensor) -> np.dtype:
        """The NumPy dtype of t's ONNX type (uint16 for a uint16 held in int32), where the import knows it."""
        return self.declared.get(t.node.id, t.dtype.storage)

    def narrow_format(self, t: Tensor | None) -> str | None:
        """The narrow format (float8, int4, ...) t's ONNX type is, None for a type Ingot has."""
        name = None if t is None else self.onnx_dtype(t).name
        return name if name in NARROW_FORMATS else None

    def declare(self, t: Tensor, elem_or_dtype) -> Tensor:
        """Record t's ONNX type (an element type number or a NumPy dtype) where Ingot holds it in another."""
        declared = ONNX_DTYPES[elem_or_dtype][1] if isinstance(elem_or_dtype, int) else np.dtype(elem_or_dtype)
        if declared != t.dtype.storage:
            if t.node.id in self.g.interned_ids:   # a node others read as its Ingot type: this value its own
                t = Graph.constant(self.g, np.array(self.g.value(t)))
            self.declared[t.node.id] = declared
        return t

    def value(self, t: Tensor | None) -> np.ndarray | None:
        return None if t is None else self.g.value(t)

    def constant(self, node: OnnxNode, i: int, what: str) -> np.ndarray:
        """Input i's value, which must be known at import (a constant or constant arithmetic)."""
        t = node.input(i)
        v = self.value(t)
        if v is None:
            sources = placeholders_of(t)
            hint = f" from graph inputs {sources} (fix them with constant_inputs=)" if sources else ""
            raise NeedsConstant(f"{self.what}: {node.label} needs its {what} (input {i}) known at import, but it is computed "
                                f"at run time{hint}.", sources)
        return v

    def check_elements(self, node: OnnxNode, shape, what: str = "its output") -> None:
        """Refuse (IngotError) a tensor this node would create that exceeds the import's element budget."""
        self.g.check_elements(shape, f"{self.what}: {node.label}: {what}")

    def fail(self, node: OnnxNode, message: str) -> UnsupportedOnnx:
        return UnsupportedOnnx(f"{self.what}: {node.label}: {message}.")


def placeholders_of(t: Tensor) -> list[str]:
    """The graph inputs a tensor is computed from (placeholder names, in graph order)."""
    return [n.name for n in toposort([t.node]) if n.op == Op.PLACEHOLDER]


Converter = Callable[[Context, OnnxNode], Sequence[Tensor | None]]


CONVERTERS: dict[tuple[str, str], Converter] = {}


def converter(*op_types: str, domain: str = ""):
    def deco(fn: Converter) -> Converter:
        for op in op_types:
            CONVERTERS[(domain, op)] = fn
        return fn
    return deco


def scalar(ctx: Context, value, like: Tensor) -> Tensor:
    return ctx.g.constant(np.asarray(value, like.dtype.numpy))


def need_float(ctx: Context, node: OnnxNode, x: Tensor) -> None:
    if not x.dtype.is_float:
        raise ctx.fail(node, f"input of type {x.dtype.name} (Ingot computes this op on floats)")


def attr_or_input(ctx: Context, node: OnnxNode, name: str, index: int, default=None):
    """An operand that older opsets give as an attribute and newer ones as an (optional) input."""
    if name in node.attrs:
        return node.attrs[name]
    if node.input(index) is not None:
        return ctx.constant(node, index, name).tolist()
    return default


def onnx_to_ingot_dtype(ctx: Context, node: OnnxNode, elem_type: int, narrow: bool = False) -> dt.DType:
    """The Ingot dtype that computes an ONNX type; the narrow ones (float8, int4, ...) only where the
    converter rounds to them (narrow=True)."""
    if elem_type not in ONNX_DTYPES or (elem_type in NARROW_TYPES and not narrow):
        raise ctx.fail(node, f"type {ONNX_TYPE_NAMES.get(elem_type, elem_type)} is not one Ingot computes")
    return ONNX_DTYPES[elem_type][0]


def ints(value) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]
