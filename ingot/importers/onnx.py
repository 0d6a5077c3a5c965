"""Import ONNX models (opset 13 and newer; older opsets where an op's meaning is the same) as Ingot graphs.

    >>> import numpy as np, onnx, ingot
    >>> from onnx import helper, TensorProto
    >>> node = helper.make_node("Relu", ["x"], ["y"])
    >>> graph = helper.make_graph([node], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    ...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    >>> exe = ingot.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    >>> exe.run({"x": np.array([-1.0, 2.0], np.float32)})["y"].tolist()
    [0.0, 2.0]

How it works: every ONNX value becomes an Ingot tensor of a static type (input shapes are fixed at
import: the model's own, or `input_shapes=` for its symbolic dimensions). While the graph is built,
every op whose inputs are all known is also computed at once (`onnx_ops.ImportGraph`), so shape arithmetic
(Shape -> Gather -> Concat -> Reshape) becomes constants, and converters read the constant operands
they need (a Reshape's shape, a Slice's bounds) with `ctx.constant(...)`. Each ONNX op has one
converter in `onnx_ops.CONVERTERS`; the graph they build is plain Ingot, which the compiler's own
passes then rewrite (hand-written attention -> SDPA, DequantizeLinear -> MatMul -> quantized_matmul).

ONNX types Ingot lacks are computed in the nearest Ingot type (double in float32, int16/uint16 in
int32, uint32/uint64 in int64); `OnnxExecutable.run` casts the outputs back to the declared types.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..ir import GroupOp, Op, Program, TensorType
from ..runtime import Executable, Outputs
from . import onnx_attention, onnx_math, onnx_nn, onnx_quant, onnx_shape, onnx_signal  # noqa: F401  (registration)
from .onnx_ops import (CONVERTERS, ONNX_DTYPES, ONNX_TYPE_NAMES, Context, ImportGraph, NeedsConstant, OnnxNode,
                       UnsupportedOnnx, as_ingot_array, ingot_dtype)

__all__ = ["from_onnx", "import_onnx", "load_model", "OnnxExecutable", "OnnxImport", "UnsupportedOnnx", "NeedsConstant",
           "supported_ops"]


# -- loading --------------------------------------------------------------------------------------

def load_model(model_or_path, what: str | None = None):
    """An onnx.ModelProto from a path or a ModelProto (external data loaded), or one IngotError."""
    try:
        import onnx
    except ImportError:
        raise IngotError(f"{what or model_or_path}: reading ONNX models needs the onnx package "
                         "(pip install 'ingot[onnx]').") from None

    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    path = Path(model_or_path)
    what = what or str(path)
    if not path.is_file():
        raise IngotError(f"{what}: the file does not exist." if not path.exists() else f"{what}: is not a file.")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise IngotError(f"{what}: is not an ONNX model (the protobuf does not parse: {type(e).__name__}).") from None
    if not model.graph.node and not model.graph.output:
        raise IngotError(f"{what}: is not an ONNX model (it holds no graph).")
    base = path.parent
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            location = info.get("location", "")
            file = (base / location).resolve()
            if not location or not file.is_file():
                raise IngotError(f"{what}: tensor {tensor.name!r} keeps its data in the external file {location!r}, "
                                 f"which does not exist next to the model ({base}).")
            offset, length = int(info.get("offset", 0) or 0), info.get("length")
            size = file.stat().st_size
            if length is not None and offset + int(length) > size:
                raise IngotError(f"{what}: tensor {tensor.name!r} needs bytes {offset}..{offset + int(length)} of "
                                 f"{location!r}, which holds {size}.")
    try:
        from onnx.external_data_helper import load_external_data_for_model
        load_external_data_for_model(model, str(base))
    except Exception as e:
        raise IngotError(f"{what}: its external data could not be read ({type(e).__name__}: {e}).") from None
    return model


def _all_tensors(model):
    yield from model.graph.initializer
    for node in _all_nodes(model.graph):
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.HasField("g"):
                yield from _all_nodes(a.g)
            for sub in a.graphs:
                yield from _all_nodes(sub)


def supported_ops() -> list[str]:
    """Every ONNX op type the importer converts ("domain:Op" outside the default domain)."""
    return sorted(f"{d}:{o}" if d else o for d, o in CONVERTERS)


# -- the import ------------------------------------------------------------------------------------

@dataclass
class OnnxImport:
    """The result of `import_onnx`: the Ingot graph and its named inputs and outputs."""

    graph: Graph
    inputs: dict[str, Tensor]                      # placeholders, by ONNX input name (model order)
    outputs: dict[str, Tensor]                     # by ONNX output name (model order)
    output_dtypes: dict[str, np.dtype]             # the dtypes ONNX declares for the outputs
    input_dtypes: dict[str, np.dtype]
    constant_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # inputs fixed at import


def _attribute_value(attr) -> Any:
    from onnx import helper, numpy_helper
    if attr.type == attr.TENSOR:
        return _tensor_array(attr.t)
    if attr.type == attr.GRAPH or attr.type == attr.GRAPHS:
        return attr.g if attr.type == attr.GRAPH else list(attr.graphs)
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", "replace") for v in value]
    if attr.type == attr.TENSORS:
        return [numpy_helper.to_array(t) for t in value]
    return value


def _tensor_array(tensor) -> np.ndarray:
    """A TensorProto's values; 4-bit types unpacked to int8/uint8 (the caller packs them)."""
    from onnx import numpy_helper
    if tensor.data_type == 8:
        raise UnsupportedOnnx(f"tensor {tensor.name!r} holds strings, which Ingot does not compute.")
    array = numpy_helper.to_array(tensor)
    if array.dtype.name in ("int4", "uint4"):
        return array.astype(np.int8 if array.dtype.name == "int4" else np.uint8)
    if tensor.data_type not in ONNX_DTYPES and tensor.data_type not in (21, 22):
        raise UnsupportedOnnx(f"tensor {tensor.name!r} has ONNX type {ONNX_TYPE_NAMES.get(tensor.data_type, tensor.data_type)}, "
                              "which Ingot does not compute.")
    return array


def _value_type(vi, what: str, shapes: Mapping[str, Sequence[int]]) -> tuple[TensorType, np.dtype]:
    t = vi.type
    if t.WhichOneof("value") != "tensor_type":
        raise UnsupportedOnnx(f"{what}: input {vi.name!r} is a {t.WhichOneof('value')}, not a tensor.")
    elem = t.tensor_type.elem_type
    dtype = ingot_dtype(elem, f"{what}: input {vi.name!r}")
    if vi.name in shapes:
        shape = tuple(int(d) for d in shapes[vi.name])
        if t.tensor_type.HasField("shape"):
            declared = [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]
            if len(declared) != len(shape) or any(d is not None and d != s for d, s in zip(declared, shape)):
                raise IngotError(f"{what}: input_shapes gives {vi.name!r} the shape {list(shape)}, which does not fit the "
                                 f"model's {['?' if d is None else d for d in declared]}.")
        return TensorType(shape, dtype), ONNX_DTYPES[elem][1]
    if not t.tensor_type.HasField("shape"):
        raise IngotError(f"{what}: input {vi.name!r} has no shape in the model; give it with input_shapes={{{vi.name!r}: (...)}}.")
    dims = []
    for d in t.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:
            dims.append(d.dim_value)
        else:
            label = d.dim_param or "?"
            raise IngotError(f"{what}: input {vi.name!r} has the symbolic dimension {label!r}; give its shape with "
                             f"input_shapes={{{vi.name!r}: (...)}} (or --input-shape {vi.name}=D0,D1,... on the command line).")
    return TensorType(dims, dtype), ONNX_DTYPES[elem][1]


def _output_dtype(vi) -> np.dtype | None:
    t = vi.type
    if t.WhichOneof("value") == "tensor_type" and t.tensor_type.elem_type in ONNX_DTYPES:
        return ONNX_DTYPES[t.tensor_type.elem_type][1]
    return None


def check_supported(model, what: str) -> None:
    """One UnsupportedOnnx naming every op type the importer lacks (type, a node name, count)."""

    missing: dict[str, list[str]] = {}
    for node in _all_nodes(model.graph):
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if (domain, node.op_type) not in CONVERTERS:
            key = f"{domain}:{node.op_type}" if domain else node.op_type
            missing.setdefault(key, []).append(node.name or (node.output[0] if node.output else "?"))
    if missing:
        parts = [f"{op} ({len(names)} node{'s' if len(names) > 1 else ''}, e.g. {names[0]!r})" for op, names in
                 sorted(missing.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        raise UnsupportedOnnx(f"{what}: {len(missing)} op type{'s are' if len(missing) > 1 else ' is'} not supported: "
                              + ", ".join(parts) + ".")


def _topological(graph, known: set[str], what: str) -> list:
    """The graph's nodes in an order where every input is produced first; IngotError on a cycle."""
    producers: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                if out in producers or out in known:
                    raise IngotError(f"{what}: the value {out!r} is produced twice (node {node.name!r}).")
                producers[out] = i
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in known and name not in producers:
                raise IngotError(f"{what}: node {node.name or node.op_type!r} reads {name!r}, which no node, initializer "
                                 "or graph input produces.")
    waiting = [sum(1 for n in set(node.input) if n and n in producers) for node in graph.node]
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in set(node.input):
            if name and name in producers:
                readers.setdefault(producers[name], []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        i = ready.pop(0) if len(ready) < 2 else ready.pop(ready.index(min(ready)))
        order.append(i)
        for j in readers.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) != len(graph.node):
        stuck = [graph.node[i] for i in range(len(graph.node)) if waiting[i] > 0]
        names = ", ".join(repr(n.name or n.op_type) for n in stuck[:3])
        raise IngotError(f"{what}: the graph has a cycle: {len(stuck)} nodes ({names}{', ...' if len(stuck) > 3 else ''}) "
                         "wait on each other's outputs.")
    return [graph.node[i] for i in order]


def import_onnx(model_or_path, input_shapes: Mapping[str, Sequence[int]] | None = None, what: str | None = None,
                constant_inputs: Mapping[str, np.ndarray] | None = None, quantize=None) -> OnnxImport:
    """Build an Ingot graph from an ONNX model (a path or an onnx.ModelProto).

    input_shapes: shapes for inputs with symbolic dimensions. constant_inputs: inputs whose values
    are fixed (a model that computes a Reshape's shape from an input can only be imported so);
    the executable still takes them, and checks that they hold those values. quantize: an
    ingot.quant format ("int8", "int4:32", ...) for the 2-D constant weights of MatMul and Gemm.
    """

    if what is None:
        what = str(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else "onnx model"
    model = load_model(model_or_path, what)
    opsets = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}
    if opsets.get("", 1) < 1:
        raise IngotError(f"{what}: imports ONNX opset {opsets['']}.")
    check_supported(model, what)
    input_shapes = dict(input_shapes or {})
    graph = model.graph
    g = ImportGraph()
    if quantize is not None:
        from ..quant import parse_format
        quantize = parse_format(quantize)
    ctx = Context(g, what, opsets, quantize)
    values: dict[str, Tensor] = {}
    for init in graph.initializer:
        array = _tensor_array(init)
        values[init.name] = _constant(g, array, init.data_type, init.name)
    for init in graph.sparse_initializer:
        raise UnsupportedOnnx(f"{what}: sparse initializer {init.values.name!r} is not supported.")
    inputs: dict[str, Tensor] = {}
    input_dtypes: dict[str, np.dtype] = {}
    constant_inputs = dict(constant_inputs or {})
    for vi in graph.input:
        if vi.name in values:  # an initializer listed as an input (IR < 4): a constant with a default
            continue
        t, declared = _value_type(vi, what, input_shapes if vi.name not in constant_inputs else
                                  {**input_shapes, vi.name: np.shape(constant_inputs[vi.name])})
        if vi.name in constant_inputs:
            array = np.asarray(constant_inputs[vi.name])
            values[vi.name] = g.constant(as_ingot_array(array).astype(t.dtype.storage), name=vi.name)
            inputs[vi.name] = values[vi.name]
            input_dtypes[vi.name] = declared
            continue
        placeholder = g.placeholder(t.shape, t.dtype, name=vi.name)
        inputs[vi.name] = values[vi.name] = placeholder
        input_dtypes[vi.name] = declared
    unknown = (set(input_shapes) | set(constant_inputs)) - set(inputs)
    if unknown:
        raise IngotError(f"{what}: input_shapes or constant_inputs name {sorted(unknown)}, which are not inputs of the model "
                         f"(inputs: {list(inputs)}).")
    for node in _topological(graph, set(values), what):
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        converter = CONVERTERS[(domain, node.op_type)]
        attrs = {a.name: _attribute_value(a) for a in node.attribute}
        onode = OnnxNode(node.op_type, domain, node.name, [values[i] if i else None for i in node.input], attrs,
                         list(node.output), opsets.get(domain, 1))
        try:
            outs = list(converter(ctx, onode))
        except UnsupportedOnnx:
            raise
        except IngotError as e:
            raise IngotError(f"{what}: {onode.label}: {e}") from None
        for name, out in zip(node.output, outs):
            if name and out is not None:
                values[name] = _settle(g, out, name)
        for name in node.output[len(outs):]:
            if name:
                raise ctx.fail(onode, f"output {name!r} is not computed by the importer")
    outputs: dict[str, Tensor] = {}
    output_dtypes: dict[str, np.dtype] = {}
    for vi in graph.output:
        if vi.name not in values:
            raise IngotError(f"{what}: output {vi.name!r} is produced by no node.")
        outputs[vi.name] = values[vi.name]
        output_dtypes[vi.name] = _output_dtype(vi) or values[vi.name].dtype.storage
    return OnnxImport(g, inputs, outputs, output_dtypes, input_dtypes, constant_inputs)


def _constant(g: ImportGraph, array: np.ndarray, elem_type: int, name: str) -> Tensor:
    if elem_type in (21, 22):  # uint4, int4: Ingot keeps them packed two per byte
        if array.ndim == 0:
            array = array.reshape(1)
        return g.constant(dt.pack_int4(array), dtype=dt.uint4 if elem_type == 21 else dt.int4, name=name)
    return g.constant(as_ingot_array(array), name=name)


def _settle(g: ImportGraph, t: Tensor, name: str) -> Tensor:
    """A value known at import becomes a constant node (so the graph shows no dead shape arithmetic)."""
    if t.node.op in GroupOp.Source:
        return t
    value = g.value(t)
    if value is None:
        return t
    return g.constant(value, name=name)


# -- the executable --------------------------------------------------------------------------------

class OnnxExecutable(Executable):
    """An Executable compiled from ONNX: `run` takes feeds by ONNX input name and returns Outputs
    named by the ONNX graph's outputs (in its order), host arrays in the dtypes the model declares."""

    def __init__(self, program: Program, device: str, history, inputs, output_names: list[str],
                 output_dtypes: list[np.dtype], onnx_inputs: list[str], constant_inputs: Mapping[str, np.ndarray] | None = None):
        super().__init__(program, device=device, history=history, inputs=inputs, output_names=output_names)
        self.output_dtypes = list(output_dtypes)
        self.onnx_inputs = list(onnx_inputs)
        self.constant_inputs = dict(constant_inputs or {})

    def run(self, feeds: Mapping[str, Any] | Sequence[Any] = (), state=None, **options) -> Outputs:
        """Run once: feeds by ONNX input name (or a list in the model's input order); returns Outputs
        (`out["logits"]` by ONNX output name, or `(logits,) = out` in the graph's output order)."""
        if not isinstance(feeds, Mapping):
            feeds = [feeds] if isinstance(feeds, np.ndarray) else list(feeds)
            if len(feeds) != len(self.onnx_inputs):
                raise IngotError(f"run: expected {len(self.onnx_inputs)} inputs ({self.onnx_inputs}), got {len(feeds)}.")
            feeds = dict(zip(self.onnx_inputs, feeds))
        unknown = [k for k in feeds if k not in self.onnx_inputs]
        if unknown:
            raise IngotError(f"run: {unknown} are not inputs of this model (inputs: {self.onnx_inputs}).")
        missing = [k for k in self.onnx_inputs if k not in feeds]
        if missing:
            raise IngotError(f"run: missing feeds {missing}.")
        for name, fixed in self.constant_inputs.items():
            if not np.array_equal(np.asarray(feeds[name]), fixed):
                raise IngotError(f"run: input {name!r} was fixed to {np.asarray(fixed).tolist()} at import; "
                                 f"it cannot take other values ({np.asarray(feeds[name]).tolist()}).")
        outs = super().run({k: v for k, v in feeds.items() if k in self.feed_types}, state, **options)
        result = []
        for dtype, value in zip(self.output_dtypes, outs):
            value = np.asarray(self.backend.to_host(value))
            result.append(value.astype(dtype) if value.dtype != dtype else value)
        return Outputs(self.output_names, result)

    __call__ = run


def compile_import(imported: OnnxImport, device: str = "cpu", debug: bool | str = False) -> OnnxExecutable:
    """Compile an imported graph (every shape already static) into an OnnxExecutable."""
    from ..compiler import run_pipeline

    targets = [t.node for t in imported.outputs.values()]
    program = Program(targets, [], dict(imported.graph.constants), {})
    placeholders = {n.name for n in program.nodes() if n.op == Op.PLACEHOLDER}
    program, history = run_pipeline(program, debug)
    inputs = [(name, t.type) for name, t in imported.inputs.items() if name in placeholders]
    return OnnxExecutable(program, device, history, inputs, list(imported.outputs),
                          list(imported.output_dtypes.values()), list(imported.inputs), imported.constant_inputs)


def from_onnx(model_or_path, device: str = "cpu", input_shapes: Mapping[str, Sequence[int]] | None = None,
              constant_inputs: Mapping[str, np.ndarray] | None = None, quantize=None,
              debug: bool | str = False) -> OnnxExecutable:
    """Import an ONNX model (path or onnx.ModelProto) and compile it for `device`.

    input_shapes fixes the symbolic dimensions of inputs: {"input_ids": (1, 128)}; constant_inputs
    fixes the values of inputs that must be known at import (shapes, axes). The result's `run`
    takes {ONNX input name: array} and returns {ONNX output name: array}. quantize: an ingot.quant
    format for the matmul weights ("int8", "int4:32", "lut4"), multiplied as quantized_matmul.
    """
    return compile_import(import_onnx(model_or_path, input_shapes, constant_inputs=constant_inputs, quantize=quantize),
                          device, debug)


def op_counts(exe: Executable) -> Counter:
    """How many nodes of each op the compiled program holds (by lower-case op name)."""
    return Counter(n.op.name.lower() for n in exe.program.nodes())
