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

Untrusted files: external data must resolve (symlinks followed) to a file inside the model's folder
and is read by Ingot itself, whatever the onnx version; every tensor the import creates (inputs,
constants it generates, op outputs) holds at most `element_budget(model)` elements: the larger of
MIN_ELEMENT_BUDGET (2**26) and 16x the model's own weights, so a few bytes of a Range, ConstantOfShape,
Resize, OneHot, Pad or input dimension cannot claim terabytes.

An op without a converter whose ONNX definition is a function of other ops (AffineGrid, Shrink,
LinearAttention, ...) is converted as that function body. Control flow is resolved at import: If
folded, Loop and Scan unrolled (onnx_control).

ONNX types Ingot lacks are computed in the nearest Ingot type (double in float32, int16/uint16 in
int32, uint32/uint64 in int64); `OnnxExecutable.run` casts the outputs back to the declared types.
"""
from __future__ import annotations

import math
import os
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..untrusted import checked_path
from ..graph import Graph, Tensor
from ..ir import GroupOp, Op, Program, TensorType
from ..runtime import Executable, Outputs
from . import (onnx_attention, onnx_control, onnx_integer, onnx_math, onnx_nn, onnx_quant, onnx_recurrent, onnx_shape,  # noqa: F401
               onnx_signal, onnx_training)  # (registration)
from .onnx_staged import NeedsHostStep, StagedOnnxExecutable
from .onnx_ops import (CONVERTERS, MAX_SPECIALIZED_ELEMENTS, ONNX_DTYPES, ONNX_TYPE_NAMES, Context, ImportGraph,
                       NeedsConstant, OnnxNode, MIN_ELEMENT_BUDGET, WEIGHT_BUDGET_FACTOR, UnsupportedOnnx, as_ingot_array,
                       ingot_dtype, named_feeds)

MAX_LOCATION_CHARS = 4096  # an external data location (PATH_MAX)
SUB_BYTE_SIZES = {21: 0.5, 22: 0.5, 23: 0.5, 25: 0.25, 26: 0.25}  # bytes per element of the packed ONNX types

__all__ = ["from_onnx", "import_onnx", "load_model", "OnnxExecutable", "OnnxImport", "SpecializingOnnxExecutable",
           "UnsupportedOnnx", "NeedsConstant", "supported_ops"]


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
    path = Path(checked_path(model_or_path, "ONNX model"))
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
            _read_external(tensor, base, what)
    return model


def _external_int(tensor, info: dict, key: str, what: str) -> int | None:
    text = info.get(key)
    if text is None or text == "":
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        raise IngotError(f"{what}: tensor {_name(tensor)} has external data {key} {text[:40]!r}, not a non-negative integer.")
    return int(text)


def _name(tensor) -> str:
    return repr(tensor.name if len(tensor.name) <= 80 else tensor.name[:77] + "...")


def _read_external(tensor, base: Path, what: str) -> None:
    """Read a tensor's external data into it, from a file that resolves (symlinks followed) inside
    the model's folder; refuse anything else with one IngotError. Ingot checks this itself: onnx
    1.16 followed a symlink out of the folder."""
    import onnx

    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    if not location or "\0" in location or len(location) > MAX_LOCATION_CHARS or os.path.isabs(location) \
            or any(len(part.encode()) > 255 for part in location.replace("\\", "/").split("/")):
        raise IngotError(f"{what}: tensor {_name(tensor)} names its external data file {location[:80]!r}, which is not a "
                         "relative path of a file beside the model.")
    folder = os.path.realpath(base)
    file = os.path.realpath(os.path.join(folder, location))
    if os.path.commonpath([folder, file]) != folder:
        raise IngotError(f"{what}: tensor {_name(tensor)} keeps its data in {location[:80]!r}, which resolves to a file outside "
                         f"the model's folder {folder}; refused.")
    if not os.path.isfile(file):
        raise IngotError(f"{what}: tensor {_name(tensor)} keeps its data in the external file {location[:80]!r}, which does not "
                         f"exist next to the model ({base}).")
    offset = _external_int(tensor, info, "offset", what) or 0
    length = _external_int(tensor, info, "length", what)
    size = os.path.getsize(file)
    itemsize = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2}
    count = _element_count(tensor, what)
    if tensor.data_type in itemsize:
        need = count * itemsize[tensor.data_type]
        if length is not None and length != need:
            raise IngotError(f"{what}: tensor {_name(tensor)} has dims {list(tensor.dims)} ({need} bytes) but its external data "
                             f"length is {length}.")
        length = need
    elif length is None:
        length = size - offset
    if offset > size:
        raise IngotError(f"{what}: tensor {_name(tensor)} has the external data offset {offset}, past the end of "
                         f"{location[:80]!r} ({size} bytes).")
    if offset + length > size:
        raise IngotError(f"{what}: tensor {_name(tensor)} needs bytes {offset}..{offset + length} of {location[:80]!r}, which "
                         f"holds {size}.")
    try:
        with open(file, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError as e:
        raise IngotError(f"{what}: the external data of tensor {_name(tensor)} cannot be read ({e.strerror}).") from None
    tensor.raw_data = data
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT


def _element_count(tensor, what: str) -> int:
    """A TensorProto's element count from its dims, each checked (>= 0; the product in Python integers)."""
    count = 1
    for d in tensor.dims:
        if d < 0:
            raise IngotError(f"{what}: tensor {_name(tensor)} has a negative dimension in {list(tensor.dims)}.")
        count *= int(d)
    return count


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
    branches: dict[str, Any] = field(default_factory=dict)  # If branches compiled as callables (onnx_control.py)


def _attribute_value(attr, what: str = "onnx model") -> Any:
    from onnx import helper
    if attr.type == attr.TENSOR:
        return _tensor_array(attr.t, what)
    if attr.type == attr.GRAPH or attr.type == attr.GRAPHS:
        return attr.g if attr.type == attr.GRAPH else list(attr.graphs)
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8", "replace") for v in value]
    if attr.type == attr.TENSORS:
        return [_tensor_array(t, what) for t in value]
    return value


def _tensor_array(tensor, what: str = "onnx model") -> np.ndarray:
    """A TensorProto's values; 4-bit types unpacked to int8/uint8 (the caller packs them). Its type
    must be one Ingot computes and its data must hold exactly what its dims say."""
    from onnx import numpy_helper
    if tensor.data_type == 8:
        raise UnsupportedOnnx(f"{what}: tensor {_name(tensor)} holds strings, which Ingot does not compute.")
    if tensor.data_type not in ONNX_DTYPES:
        raise UnsupportedOnnx(f"{what}: tensor {_name(tensor)} has ONNX type "
                              f"{ONNX_TYPE_NAMES.get(tensor.data_type, tensor.data_type)}, which Ingot does not compute.")
    count = _element_count(tensor, what)
    if tensor.HasField("raw_data"):
        itemsize = SUB_BYTE_SIZES.get(tensor.data_type) or ONNX_DTYPES[tensor.data_type][1].itemsize
        if len(tensor.raw_data) != math.ceil(count * itemsize):
            raise IngotError(f"{what}: tensor {_name(tensor)} has dims {list(tensor.dims)} ({count} elements) but "
                             f"{len(tensor.raw_data)} bytes of data.")
    try:
        array = numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise IngotError(f"{what}: tensor {_name(tensor)} (dims {list(tensor.dims)}) does not hold the data its dims and type "
                         f"say ({type(e).__name__}: {' '.join(str(e).split())[:200]}).") from None
    if array.size != count:
        raise IngotError(f"{what}: tensor {_name(tensor)} has dims {list(tensor.dims)} ({count} elements) but holds {array.size}.")
    if array.dtype.name in ("int4", "uint4"):
        return array.astype(np.int8 if array.dtype.name == "int4" else np.uint8)
    return array


def element_budget(model) -> int:
    """The most elements any one tensor of this model's import may hold: MIN_ELEMENT_BUDGET, or
    WEIGHT_BUDGET_FACTOR times the model's own weights when those are larger."""
    weights = 0
    for init in model.graph.initializer:
        count = 1
        for d in init.dims:
            count *= max(int(d), 0)
        weights += count
    return max(MIN_ELEMENT_BUDGET, WEIGHT_BUDGET_FACTOR * weights)


def _value_type(vi, what: str, shapes: Mapping[str, Sequence[int]]) -> tuple[TensorType, np.dtype]:
    t = vi.type
    if t.WhichOneof("value") != "tensor_type":
        raise UnsupportedOnnx(f"{what}: input {vi.name!r} is a {t.WhichOneof('value')}, not a tensor.")
    elem = t.tensor_type.elem_type
    dtype = ingot_dtype(elem, f"{what}: input {vi.name!r}")
    if vi.name in shapes:
        shape = tuple(int(d) for d in shapes[vi.name])
        if t.tensor_type.HasField("shape"):
            declared = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in t.tensor_type.shape.dim]
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
    """One UnsupportedOnnx naming every op type the importer lacks (type, a node name, count): those
    with no converter and no function body in ONNX's definition."""
    opsets = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}

    missing: dict[str, list[str]] = {}
    for node in _all_nodes(model.graph):
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if (domain, node.op_type) not in CONVERTERS and _function_body(node, opsets.get(domain, 1)) is None:
            key = f"{domain}:{node.op_type}" if domain else str(node.op_type)   # (bytes where not UTF-8)
            key = key if key.isprintable() else repr(key)                          # (one line, whatever the file says)
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


@dataclass
class ImportCache:
    """What imports of one model at several input shapes share, none of it shape-dependent: the initializers
    as arrays (read only), and per graph (the main one, If and Loop bodies; by id, with the GraphProto
    itself, which the entry keeps alive) its nodes in topological order with their attributes as Python
    values (arrays read only). PP-OCRv4's detector: an import 24.6 -> 13.5 ms."""

    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    graphs: dict[int, tuple[Any, list]] = field(default_factory=dict)
    checked: bool = False   # check_supported passed


def import_onnx(model_or_path, input_shapes: Mapping[str, Sequence[int]] | None = None, what: str | None = None,
                constant_inputs: Mapping[str, np.ndarray] | None = None, quantize=None,
                cache: ImportCache | None = None) -> OnnxImport:
    """Build an Ingot graph from an ONNX model (a path or an onnx.ModelProto).

    input_shapes: shapes for inputs with symbolic dimensions. constant_inputs: inputs whose values
    are fixed (a model that computes a Reshape's shape from an input can only be imported so);
    the executable still takes them, and checks that they hold those values. quantize: an
    ingot.quant format ("int8", "int4:32", ...) for the 2-D constant weights of MatMul and Gemm.
    cache: what an earlier import of the same model read (ImportCache; filled here): a model compiled per
    input shape reads its weights and attributes out of the protobuf once.
    """

    if what is None:
        what = str(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else "onnx model"
    model = load_model(model_or_path, what)
    opsets = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}
    if opsets.get("", 1) < 1:
        raise IngotError(f"{what}: imports ONNX opset {opsets['']}.")
    if cache is None or not cache.checked:
        check_supported(model, what)
        if cache is not None:
            cache.checked = True
    input_shapes = dict(input_shapes or {})
    graph = model.graph
    g = ImportGraph(element_budget(model))
    if quantize is not None:
        from ..quant import parse_format
        quantize = parse_format(quantize)
    ctx = Context(g, what, opsets, quantize, import_cache=cache)
    values: dict[str, Tensor] = {}
    for init in graph.initializer:
        array = cache.initializers.get(init.name) if cache is not None else None
        if array is None:
            array = _tensor_array(init, what)
            if cache is not None:
                array.flags.writeable = False   # every shape's executable reads it
                cache.initializers[init.name] = array
        values[init.name] = _constant(g, array, init.data_type, init.name)
        if init.data_type in ONNX_DTYPES and init.data_type not in (21, 22):   # (4-bit constants stay packed)
            ctx.declare(values[init.name], init.data_type)
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
            array = as_ingot_array(np.asarray(constant_inputs[vi.name]))
            values[vi.name] = g.constant(as_ingot_array(array).astype(t.dtype.storage), name=vi.name)
            inputs[vi.name] = values[vi.name]
            input_dtypes[vi.name] = declared
            continue
        g.check_elements(t.shape, f"{what}: input {vi.name!r}")
        placeholder = g.placeholder(t.shape, t.dtype, name=vi.name)
        ctx.declare(placeholder, declared)
        inputs[vi.name] = values[vi.name] = placeholder
        input_dtypes[vi.name] = declared
    unknown = (set(input_shapes) | set(constant_inputs)) - set(inputs)
    if unknown:
        raise IngotError(f"{what}: input_shapes or constant_inputs name {sorted(unknown)}, which are not inputs of the model "
                         f"(inputs: {list(inputs)}).")
    ctx.import_subgraph = lambda sub, outer, inputs=(), into=None: _convert_subgraph(into or ctx, sub, outer, what, inputs)
    _convert_graph(ctx, graph, values, what)
    outputs: dict[str, Tensor] = {}
    output_dtypes: dict[str, np.dtype] = {}
    for vi in graph.output:
        if vi.name not in values:
            raise IngotError(f"{what}: output {vi.name!r} is produced by no node.")
        outputs[vi.name] = values[vi.name]
        output_dtypes[vi.name] = _output_dtype(vi) or values[vi.name].dtype.storage
    return OnnxImport(g, inputs, outputs, output_dtypes, input_dtypes, constant_inputs, ctx.branches)


def _convert_graph(ctx: Context, graph, values: dict[str, Tensor], what: str) -> None:
    """Convert a graph's nodes in order, adding each output to `values` (which holds what they may read:
    the graph's inputs and initializers, and for a subgraph the enclosing graph's values)."""
    g, opsets = ctx.g, ctx.opsets
    outer_scope, ctx.scope = ctx.scope, values
    for node, domain, attrs, input_names, output_names in _prepared_nodes(ctx, graph, values, what):
        converter = CONVERTERS.get((domain, node.op_type))
        onode = OnnxNode(node.op_type, domain, node.name, [values[i] if i else None for i in input_names], dict(attrs),
                         list(output_names), opsets.get(domain, 1))
        try:
            outs = list(converter(ctx, onode)) if converter else _expand_function(ctx, node, onode.inputs, what)
        except UnsupportedOnnx:
            raise
        except IngotError as e:
            message = str(e)
            raise IngotError(message if message.startswith(f"{what}: ") else f"{what}: {onode.label}: {message}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError,
                StopIteration) as e:
            # a converter meeting an attribute or operand of a form it does not expect: the file's doing
            raise IngotError(f"{what}: {onode.label} has attributes or inputs the importer cannot use "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}).") from None
        for name, out in zip(output_names, outs):
            if name and out is not None:
                values[name] = _settle(g, out, name)
                if out.node.id in ctx.declared:
                    ctx.declared[values[name].node.id] = ctx.declared[out.node.id]
        for name in output_names[len(outs):]:
            if name:
                raise ctx.fail(onode, f"output {name!r} is not computed by the importer")
    ctx.scope = outer_scope


def _prepared_nodes(ctx: Context, graph, values: Mapping[str, Tensor], what: str) -> list:
    """(node, domain, attributes, input names, output names) of each node of graph in topological order;
    from ctx's ImportCache where an earlier import of the model prepared them."""
    cache = ctx.import_cache
    held = cache.graphs.get(id(graph)) if cache is not None else None
    if held is not None and held[0] is graph:
        return held[1]
    prepared = []
    for node in _topological(graph, set(values), what):
        attrs = {a.name: _attribute_value(a, what) for a in node.attribute}
        if cache is not None:   # shared by every later import: read only
            for value in attrs.values():
                if isinstance(value, np.ndarray):
                    value.flags.writeable = False
        prepared.append((node, "" if node.domain in ("", "ai.onnx") else node.domain, attrs, tuple(node.input),
                         tuple(node.output)))
    if cache is not None:   # the graph held too: its id names no other graph while the entry lives
        cache.graphs[id(graph)] = (graph, prepared)
    return prepared


def _function_body(node, opset: int, input_types=None):
    """ONNX's own definition of an op as a function of other ops, for this opset: (FunctionProto,
    OpSchema), or None where it has none. A context-dependent function (one that depends on the input
    types) is only made when `input_types` (TypeProtos) are given."""
    from onnx import FunctionProto, defs

    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    try:
        schema = defs.get_schema(node.op_type, opset, domain)
    except Exception:  # onnx's SchemaError: no such op at this opset
        return None
    proto = FunctionProto()

    def pick(versions):   # the function for the newest opset up to ours; else the oldest (the op is the same
        older = [v for v in versions if v <= opset]   # schema, its function written with newer ops)
        return max(older) if older else min(versions, default=None)

    version = pick(list(schema.function_opset_versions))
    if version is not None:
        proto.ParseFromString(schema.get_function_with_opset_version(version))
        return proto, schema
    version = pick(list(schema.context_dependent_function_opset_versions))
    if version is None:
        return None
    if input_types is None:
        return proto, schema
    try:
        made = schema.get_context_dependent_function_with_opset_version(
            version, node.SerializeToString(), [t.SerializeToString() for t in input_types])
    except Exception:  # onnx could not build the function for these types
        return None
    proto.ParseFromString(made)
    return proto, schema


def _expand_function(ctx: Context, node, inputs: Sequence[Tensor | None], what: str) -> list[Tensor]:
    """An op without a converter, converted as ONNX defines it: its function body, with the node's
    inputs and attributes bound (onnxruntime does the same for ops it has no kernel for)."""
    from onnx import GraphProto, helper

    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    types = [helper.make_tensor_type_proto(0, None) if t is None else
             helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(ctx.onnx_dtype(t)), list(t.shape)) for t in inputs]
    found = _function_body(node, ctx.opsets.get(domain, 1), types)
    if found is None:
        raise UnsupportedOnnx(f"{what}: op {node.op_type} (node {node.name or node.output[0]!r}) is not supported.")
    proto, schema = found
    attrs = {a.name: a for a in node.attribute}
    for name, declared in schema.attributes.items():
        if name not in attrs and declared.default_value and declared.default_value.name:
            attrs[name] = declared.default_value
    omitted = {name for i, name in enumerate(proto.input) if i >= len(inputs) or inputs[i] is None}
    body = GraphProto(name=f"{node.op_type} function")
    for inner in proto.node:
        copy = body.node.add()
        copy.CopyFrom(inner)
        copy.input[:] = ["" if i in omitted else i for i in inner.input]
        del copy.attribute[:]
        for a in inner.attribute:
            if a.ref_attr_name:   # an attribute of the function: the node's value, or left out
                if a.ref_attr_name in attrs:
                    bound = copy.attribute.add()
                    bound.CopyFrom(attrs[a.ref_attr_name])
                    bound.name = a.name
            else:
                copy.attribute.add().CopyFrom(a)
    values = {name: t for name, t in zip(proto.input, inputs) if t is not None}
    outer_opsets = ctx.opsets
    ctx.opsets = {**outer_opsets, **{("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in proto.opset_import}}
    try:
        _convert_graph(ctx, body, values, what)
    finally:
        ctx.opsets = outer_opsets
    return [values[name] if name in values else None for name in proto.output][:len(node.output)]


def _convert_subgraph(ctx: Context, graph, outer: Mapping[str, Tensor], what: str, inputs: Sequence[Tensor] = ()) -> list[Tensor]:
    """A subgraph (an If branch, one step of a Loop or Scan body) converted into the enclosing graph, its
    inputs bound to `inputs`: its outputs, in order."""
    if len(inputs) != len(graph.input):
        raise IngotError(f"{what}: subgraph {graph.name!r} takes {len(graph.input)} inputs, given {len(inputs)}.")
    values = dict(outer)
    values.update({vi.name: t for vi, t in zip(graph.input, inputs)})
    for init in graph.initializer:
        constant = _constant(ctx.g, _tensor_array(init, what), init.data_type, init.name)
        values[init.name] = constant if init.data_type in (21, 22) else ctx.declare(constant, init.data_type)
    _convert_graph(ctx, graph, values, what)
    missing = [vi.name for vi in graph.output if vi.name not in values]
    if missing:
        raise IngotError(f"{what}: subgraph {graph.name!r} has outputs {missing} that no node produces.")
    return [values[vi.name] for vi in graph.output]


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
                 output_dtypes: list[np.dtype], onnx_inputs: list[str], constant_inputs: Mapping[str, np.ndarray] | None = None,
                 options=None):
        super().__init__(program, device=device, history=history, inputs=inputs, output_names=output_names, options=options)
        self.output_dtypes = list(output_dtypes)
        self._output_names = tuple(self.output_names)
        self.onnx_inputs = list(onnx_inputs)
        self.constant_inputs = dict(constant_inputs or {})
        # each fixed input's dtype, shape and bytes: a feed of the same dtype and shape compares as bytes
        self._fixed = [(name, np.asarray(v).dtype, np.asarray(v).shape, np.asarray(v).tobytes())
                       for name, v in self.constant_inputs.items()]
        self._exact = self._exact_inputs()

    def _exact_inputs(self) -> dict[str, tuple[np.dtype, tuple, bytes | None]] | None:
        """What exact_run takes: each ONNX input's dtype, shape and, for a fixed input, bytes; None where an
        input is neither a static one the program reads in a dtype that as_ingot_array keeps, nor fixed
        (the general path converts, checks or ignores it), or the backend's feeds are not host arrays."""
        if not self._host_feeds:
            return None
        exact = {}
        for name in self.onnx_inputs:
            if name in self.constant_inputs and name not in self.feed_types:
                value = np.asarray(self.constant_inputs[name])
                exact[name] = (value.dtype, value.shape, value.tobytes())
            elif name in self._used_inputs and name in self._exact_feeds and name not in self.constant_inputs:
                dtype, shape = self._exact_feeds[name]
                if as_ingot_array(np.empty(0, dtype)).dtype != dtype:
                    return None
                exact[name] = (dtype, shape, None)
            else:
                return None
        return exact

    def exact_run(self, feeds: dict) -> Outputs | None:
        """run on the default state for a dict that holds every ONNX input as an ndarray of exactly the dtype
        and shape compiled (a fixed input with its bytes): run_named's and Executable._feeds' checks in one
        pass (a small model's run: ~3 us less); None, having run nothing, where any feed is otherwise (the
        general path then converts, checks or refuses it)."""
        exact = self._exact
        if exact is None or len(feeds) != len(exact):
            return None
        values = {}
        for name, value in feeds.items():
            want = exact.get(name) if type(name) is str else None
            if want is None or type(value) is not np.ndarray or value.dtype != want[0] or value.shape != want[1]:
                return None
            if want[2] is None:
                values[name] = value
            elif value.tobytes() != want[2]:
                return None
        return self._outputs(self._run_plan(values, self._state if self._state is not None else self.state, {}))

    def run(self, feeds: Mapping[str, Any] | Sequence[Any] = (), state=None, **options) -> Outputs:
        """Run once: feeds by ONNX input name (or a list in the model's input order); returns Outputs
        (`out["logits"]` by ONNX output name, or `(logits,) = out` in the graph's output order)."""
        if state is None and not options and type(feeds) is dict:
            out = self.exact_run(feeds)
            if out is not None:
                return out
        return self.run_named(named_feeds(feeds, self.onnx_inputs), state, **options)

    def run_named(self, feeds: dict, state=None, **options) -> Outputs:
        """run, for feeds already by ONNX input name (named_feeds' dict; SpecializingOnnxExecutable's)."""
        if len(feeds) != len(self.onnx_inputs):   # (named_feeds refused unknown names; a fixed input may be left out)
            missing = [k for k in self.onnx_inputs if k not in feeds and k not in self.constant_inputs]
            if missing:
                raise IngotError(f"run: missing feeds {missing}.")
        for name, dtype, shape, data in self._fixed:
            if name not in feeds:   # a fixed input left out
                continue
            value = feeds[name]
            if isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape and value.tobytes() == data:
                continue
            if not np.array_equal(np.asarray(value), self.constant_inputs[name]):
                raise IngotError(f"run: input {name!r} was fixed to {np.asarray(self.constant_inputs[name]).tolist()} at "
                                 f"import; it cannot take other values ({np.asarray(value).tolist()}).")
        return self._outputs(self.run_values({k: as_ingot_array(v) if isinstance(v, np.ndarray) else v
                                              for k, v in feeds.items() if k in self.feed_types}, state, **options))

    def _outputs(self, outs) -> Outputs:
        """The backend's outputs as host arrays of the ONNX dtypes, named."""
        dtypes = self.output_dtypes
        for value, dtype in zip(outs, dtypes):
            if type(value) is not np.ndarray or value.dtype != dtype:
                break
        else:   # (the common case: as they are)
            return Outputs.named(self._output_names, outs)
        result = []
        for dtype, value in zip(dtypes, outs):
            if type(value) is not np.ndarray:
                value = np.asarray(self.backend.to_host(value))
            result.append(value.astype(dtype) if value.dtype != dtype else value)
        return Outputs(self.output_names, result)

    __call__ = run


def compile_import(imported: OnnxImport, device: str = "cpu", debug: bool | str = False, options=None,
                   shared: dict | None = None) -> OnnxExecutable:
    """Compile an imported graph (every shape already static) into an OnnxExecutable. shared: the
    constants earlier compiles of the same model hold (SpecializingOnnxExecutable's), by dtype and shape;
    a constant with the same bytes as one of them is that array (each shape's executable held its own copy
    of the weights: a 21 MB MiniLM grew 35-40 MB a sequence length)."""
    from ..compiler import paused_collector, run_pipeline

    targets = [t.node for t in imported.outputs.values()]
    program = Program(targets, [], dict(imported.graph.constants), {})
    placeholders = {n.name for n in program.nodes() if n.op == Op.PLACEHOLDER}
    with paused_collector():
        program, history = run_pipeline(program, debug, device=device, options=options, typed=imported.graph.typed)
        if shared is not None:
            _share_constants(program.constants, shared)
        inputs = [(name, t.type) for name, t in imported.inputs.items() if name in placeholders]
        exe = OnnxExecutable(program, device, history, inputs, list(imported.outputs),
                             list(imported.output_dtypes.values()), list(imported.inputs), imported.constant_inputs, options)
        onnx_control.bind_branches(exe, imported.branches, debug)
    return exe


SMALL_CONSTANT = 4096   # bytes up to which a constant is found by its bytes (a dict key), past it by comparing


def _share_constants(constants: dict, shared: dict) -> None:
    """Each array constant with the same dtype, shape and bytes as one in shared (weak references, so an
    evicted executable's arrays go with it) becomes that array; the others join shared (found again by
    their id, while the reference is to them). Byte-exact: a NaN matches its own bits, -0.0 never
    matches 0.0."""
    for name, value in constants.items():
        if not (isinstance(value, np.ndarray) and value.flags.c_contiguous):
            continue
        held_as = shared.get(("id", id(value)))   # this very array is held (the import cache's initializers)
        if held_as is not None and held_as[0]() is value:
            continue
        small = value.nbytes <= SMALL_CONSTANT
        key = (value.dtype.str, value.shape, value.tobytes() if small else None)
        refs = shared.setdefault(key, [])
        refs[:] = [r for r in refs if r() is not None]
        held = [r() for r in refs]
        if small:   # the key holds the bytes: any one held is equal
            same = next((a for a in held if a is not None), None)
        else:
            bits = value.reshape(-1).view(np.uint8)
            same = next((a for a in held if a is not None and
                         (a is value or np.array_equal(a.reshape(-1).view(np.uint8), bits))), None)
        if same is None:
            refs.append(weakref.ref(value))
            shared[("id", id(value))] = [refs[-1]]
        else:
            constants[name] = same


def from_onnx(model_or_path, device: str = "cpu", input_shapes: Mapping[str, Sequence[int]] | None = None,
              constant_inputs: Mapping[str, np.ndarray] | None = None, quantize=None,
              debug: bool | str = False, options=None) -> "OnnxExecutable | SpecializingOnnxExecutable":
    """Import an ONNX model (path or onnx.ModelProto) and compile it for `device`.

    input_shapes fixes the symbolic dimensions of inputs: {"input_ids": (1, 128)}; constant_inputs
    fixes the values of inputs that must be known at import (shapes, axes). The result's `run`
    takes {ONNX input name: array} and returns Outputs by ONNX output name. quantize: an ingot.quant
    format for the matmul weights ("int8", "int4:32", "lut4"), multiplied as quantized_matmul.
    options: the CompileOptions every executable of the model is compiled with (None: the defaults).

    A model whose shapes depend on what it is fed (symbolic input dimensions not fixed by
    input_shapes; small inputs that a Reshape, Resize or reduction reads as its shape, sizes or
    axes) gives a SpecializingOnnxExecutable, which compiles once per such shape or value, at run.
    """
    what = str(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else "onnx model"
    model = load_model(model_or_path, what)
    input_shapes, constant_inputs = dict(input_shapes or {}), dict(constant_inputs or {})
    initializers = {i.name for i in model.graph.initializer}
    if any(vi.name not in input_shapes and vi.name not in constant_inputs and vi.name not in initializers
           and _has_symbolic_dims(vi) for vi in model.graph.input):
        return SpecializingOnnxExecutable(model, what, device, input_shapes, constant_inputs, quantize, debug,
                                          options=options)
    try:
        imported = import_onnx(model, input_shapes, what=what, constant_inputs=constant_inputs, quantize=quantize)
    except NeedsConstant as e:
        names = [n for n in e.input_names if n not in constant_inputs]
        if not names or not all(_may_specialize(model, n) for n in names):
            raise
        return SpecializingOnnxExecutable(model, what, device, input_shapes, constant_inputs, quantize, debug, names,
                                          options=options)
    except NeedsHostStep as e:   # NonZero and the like on data: two compiled stages around a host step
        return StagedOnnxExecutable(model, e.outputs, lambda m: from_onnx(m, device, input_shapes, constant_inputs, quantize, debug,
                                                                          options=options))
    return compile_import(imported, device, debug, options)


MAX_SPECIALIZATIONS = 16        # compiled executables a SpecializingOnnxExecutable keeps (oldest dropped)


def _has_symbolic_dims(vi) -> bool:
    t = vi.type
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return False
    return any(not d.HasField("dim_value") or d.dim_value < 0 for d in t.tensor_type.shape.dim)


def _may_specialize(model, name: str) -> bool:
    """Whether graph input `name` is declared small enough to be compiled per value (unknown: yes)."""
    for vi in model.graph.input:
        if vi.name == name:
            t = vi.type
            if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
                return True
            dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in t.tensor_type.shape.dim]
            return None in dims or math.prod(dims) <= MAX_SPECIALIZED_ELEMENTS
    return False


class SpecializingOnnxExecutable:
    """An ONNX model compiled per input shape and per value of its shape-giving inputs, at run.

    Ingot compiles static shapes. A model with symbolic input dimensions, or one that reads a
    small input as a shape, axes or scales (ONNX's node tests do; so do exported models that pass
    a sample rate), is imported and compiled when it is first run with a given set of such
    shapes and values; later runs with the same ones reuse that executable (the latest
    MAX_SPECIALIZATIONS are kept). `run` takes and returns what OnnxExecutable's does.

        >>> import numpy as np, onnx, ingot
        >>> from onnx import helper, TensorProto
        >>> node = helper.make_node("Reshape", ["x", "shape"], ["y"])
        >>> graph = helper.make_graph([node], "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
        ...                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        ...                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        >>> exe = ingot.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        >>> exe.run({"x": np.arange(6, dtype=np.float32), "shape": np.array([2, 3])})["y"].shape
        (2, 3)
    """

    def __init__(self, model, what: str, device: str, input_shapes: Mapping[str, Sequence[int]],
                 constant_inputs: Mapping[str, np.ndarray], quantize, debug, value_inputs: Sequence[str] = (), options=None):
        self.model, self.what, self.device, self.quantize, self.debug = model, what, device, quantize, debug
        self.options = options
        self.input_shapes, self.constant_inputs = dict(input_shapes), dict(constant_inputs)
        initializers = {i.name for i in model.graph.initializer}
        self.onnx_inputs = [vi.name for vi in model.graph.input if vi.name not in initializers]
        self.shape_inputs = [vi.name for vi in model.graph.input if vi.name in self.onnx_inputs and
                             vi.name not in self.input_shapes and vi.name not in self.constant_inputs and _has_symbolic_dims(vi)]
        self.value_inputs = list(value_inputs)     # grows as imports name more inputs they need the values of
        self.output_names = [vi.name for vi in model.graph.output]
        self.compiled: dict[tuple, OnnxExecutable] = {}
        self.shared: dict = {}   # the executables' constants (compile_import's shared)
        self.import_cache = ImportCache()   # what each shape's import reads out of the model (import_onnx's)
        self._last: OnnxExecutable | None = None   # the one the latest run ran: its exact_run is tried first

    def _key(self, feeds: Mapping[str, Any]) -> tuple:
        shapes = tuple((n, np.shape(feeds[n])) for n in self.shape_inputs)
        values = []
        for n in self.value_inputs:
            a = np.asarray(feeds[n])
            values.append((n, a.dtype.str, a.shape, a.tobytes()))
        return shapes, tuple(values)

    def executable(self, feeds: Mapping[str, Any]) -> OnnxExecutable:
        """The executable compiled for these feeds' shapes and shape-giving values (compiled now if new)."""
        missing = [k for k in self.onnx_inputs if k not in feeds and k not in self.constant_inputs]
        if missing:
            raise IngotError(f"run: missing feeds {missing}.")
        key = self._key(feeds)
        if key in self.compiled:
            return self.compiled[key]
        from ..compiler import paused_collector
        with paused_collector():
            return self._compile(feeds, key)

    def _compile(self, feeds: Mapping[str, Any], key: tuple) -> OnnxExecutable:
        while True:
            for n in self.value_inputs:
                size = np.size(feeds[n])
                if size > MAX_SPECIALIZED_ELEMENTS:
                    raise IngotError(f"{self.what}: input {n!r} gives a shape, axes or bounds that Ingot needs at compile "
                                     f"time, but holds {size} values (at most {MAX_SPECIALIZED_ELEMENTS} are compiled "
                                     f"per value); fix it with constant_inputs=.")
            shapes = {**self.input_shapes, **{n: np.shape(feeds[n]) for n in self.shape_inputs}}
            fixed = {**self.constant_inputs, **{n: np.asarray(feeds[n]) for n in self.value_inputs}}
            try:
                imported = import_onnx(self.model, shapes, what=self.what, constant_inputs=fixed, quantize=self.quantize,
                                       cache=self.import_cache)
                break
            except NeedsHostStep as e:
                exe = StagedOnnxExecutable(self.model, e.outputs, lambda m: from_onnx(m, self.device, shapes, fixed, self.quantize,
                                                                                      self.debug, options=self.options))
                return self._keep(key, exe)
            except NeedsConstant as e:
                new = [n for n in e.input_names if n not in fixed and n in self.onnx_inputs]
                if not new:
                    raise
                self.value_inputs += new
                key = self._key(feeds)
                if key in self.compiled:
                    return self.compiled[key]
        return self._keep(key, compile_import(imported, self.device, self.debug, self.options, self.shared))

    def _keep(self, key: tuple, exe):
        if len(self.compiled) >= MAX_SPECIALIZATIONS:
            del self.compiled[next(iter(self.compiled))]
        self.compiled[key] = exe
        return exe

    def run(self, feeds: Mapping[str, Any] | Sequence[Any] = (), state=None, **options) -> Outputs:
        """Run once: feeds by ONNX input name (or a list in the model's input order); returns Outputs."""
        last = self._last
        if last is not None and state is None and not options and type(feeds) is dict:
            out = last.exact_run(feeds)   # (takes only feeds of the shapes and values that compiled it)
            if out is not None:
                return out
        feeds = named_feeds(feeds, self.onnx_inputs)
        exe = self.executable(feeds)
        self._last = exe if isinstance(exe, OnnxExecutable) else None
        return exe.run_named(feeds, state, **options)

    __call__ = run

    def __repr__(self) -> str:
        return (f"<SpecializingOnnxExecutable {self.device} inputs={self.onnx_inputs} compiled per "
                f"{'shape of ' + str(self.shape_inputs) if self.shape_inputs else ''}"
                f"{' and ' if self.shape_inputs and self.value_inputs else ''}"
                f"{'value of ' + str(self.value_inputs) if self.value_inputs else ''} ({len(self.compiled)} so far)>")


def op_counts(exe: Executable) -> Counter:
    """How many nodes of each op the compiled program holds (by lower-case op name)."""
    return Counter(n.op.name.lower() for n in exe.program.nodes())
