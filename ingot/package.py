"""The package format: a directory NAME.ingot/ holding

    manifest.json          {"format": "ingot-package", "version": 3, "device": ..., "callables": [...],
                            "options": {...}}   (the CompileOptions, `CompileOptions.to_dict`)
    graph.json             the compiled program: nodes (sources first), outputs, assigns, inputs in
                           order, fusion regions, memory plan, pass history
    weights.safetensors    constants and variable initial values ("constant:KEY", "variable:NAME"),
                           in their own dtypes (BF16, C64 included; 4-bit tensors as their packed
                           uint8 bytes), memory-mapped on load
    callables/NAME.ingot/  one package per bound callable

Nothing is pickled or evaluated: JSON and raw tensor bytes only. A package is written under a
temporary name and renamed into place, so a failed save leaves nothing half written. Every way a
package can be broken raises one IngotError naming the file and what is wrong.

Version history: 1 stored bfloat16 as U16 and complex64 as F32 pairs with a dtype table in
graph.json; 2 stores them as safetensors BF16 and C64 and records the input order; 3 records the
compile options in the manifest (a version 2 package loads with the default options); 4 may store
float16 constants two-level (graph.json "two_level": {KEY: [blocks per super-block, code bits, sign]};
weights.safetensors "two_level:KEY:units" float16 [n_super, N] and "two_level:KEY:codes" packed
codes, ingot.quant.formats.two_level_split), decoded to float16 on load (read_weights can keep them
as they are, as the CPU's LLM loading does): `save(..., two_level=)`,
what the :k quantization formats' scales and biases take; packages without them are written as 3.
5 may hold scaled-table ops with a bias (lut4:bB:offset: dequantize's mode "scaled_lut" with
"has_bias"), which an Ingot reading 4 would not know; packages without them are written as 3 or 4.

    >>> import numpy as np, ingot, tempfile, os
    >>> g = ingot.Graph()
    >>> x = g.placeholder((2,), name="x")
    >>> exe = g.compile(targets=[x * 2.0])
    >>> path = os.path.join(tempfile.mkdtemp(), "double.ingot")
    >>> exe.save(path)
    >>> ingot.load(path).run({"x": np.ones(2, np.float32)})[0].tolist()
    [2.0, 2.0]
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from . import dtypes as dt
from .errors import IngotError
from .files import default_file_mode
from .ops.fused import Body
from .ir import Node, Op, Program, Ref, TensorType
from .untrusted import clip, inside, loads, read_json, short
from .verify import verify

FORMAT = "ingot-package"
VERSION = 3
TWO_LEVEL_VERSION = 4   # written when constants are stored two-level
LUT_BIAS_VERSION = 5    # written when a scaled table has a bias (and two-level constants may be there too)
READS = (2, 3, 4, 5)   # versions this Ingot loads

# safetensors dtype names -> the NumPy dtype that holds the bytes (BF16: ml_dtypes' bfloat16, made on
# first use by ingot.dtypes, so that importing ingot does not load ml_dtypes)
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": None,
             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
             "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
             "BOOL": np.bool_, "C64": np.complex64}


# -- attribute encoding -------------------------------------------------------------------------
def _encode(value: Any) -> Any:
    if isinstance(value, dt.DType):
        return {"dtype": value.name}
    if isinstance(value, Ref):
        return {"ref": value.index}
    if isinstance(value, TensorType):
        return {"tensor_type": _encode_type(value)}
    if isinstance(value, Body):
        return {"body": _encode_body(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise IngotError(f"package: cannot store an attribute value of type {type(value).__name__} ({value!r}).")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        if set(value) == {"dtype"}:
            return dt.by_name(value["dtype"])
        if set(value) == {"ref"}:
            return Ref(int(value["ref"]))
        if set(value) == {"tensor_type"}:
            return _decode_type(value["tensor_type"])
        if set(value) == {"body"}:
            return _decode_body(value["body"])
        raise IngotError(f"graph.json has an attribute object with unknown keys {sorted(value)}")
    return value


def _encode_body(body: Body) -> dict:
    """A fused op's body: its nodes, parameters first, each naming its sources by position."""
    pos = {n.id: i for i, n in enumerate(body.nodes)}
    return {"nodes": [{"op": n.op.name, "type": _encode_type(n.type), "src": [pos[x.id] for x in n.src],
                       "attrs": {k: _encode(v) for k, v in n.attrs.items()}} for n in body.nodes],
            "outputs": [pos[o.id] for o in body.outputs]}


def _decode_body(value: dict) -> Body:
    nodes: list[Node] = []
    for entry in value["nodes"]:
        op = entry["op"]
        if not isinstance(op, str) or op not in Op.__members__:
            raise IngotError(f"graph.json has a fused body with unknown op {op!r}")
        src = entry["src"]
        if not isinstance(src, list) or any(not isinstance(i, int) or not 0 <= i < len(nodes) for i in src):
            raise IngotError(f"graph.json has a fused body node whose sources {src!r} are not earlier nodes")
        nodes.append(Node(Op[op], _decode_type(entry["type"]), tuple(nodes[i] for i in src),
                          {k: _decode(v) for k, v in entry["attrs"].items()}))
    params = [n for n in nodes if n.op == Op.PLACEHOLDER]
    if [n.attrs.get("param") for n in params] != list(range(len(params))):
        raise IngotError("graph.json has a fused body whose parameters are not numbered 0, 1, ...")
    outputs = value["outputs"]
    if not isinstance(outputs, list) or not outputs or any(not isinstance(i, int) or not 0 <= i < len(nodes) for i in outputs):
        raise IngotError(f"graph.json has a fused body with outputs {outputs!r}")
    return Body(params, [nodes[i] for i in outputs])


def _encode_type(t) -> Any:
    if isinstance(t, tuple):
        return {"tuple": [_encode_type(x) for x in t]}
    return {"shape": list(t.shape), "dtype": t.dtype.name}


def _decode_type(v) -> Any:
    if "tuple" in v:
        return tuple(_decode_type(x) for x in v["tuple"])
    shape = v["shape"]
    if not isinstance(shape, list) or not all(d is None or _is_count(d) for d in shape):
        raise IngotError(f"graph.json has a tensor type with shape {short(shape)}, not a list of non-negative integers")
    return TensorType(shape, dt.by_name(v["dtype"]))


# -- save ---------------------------------------------------------------------------------------
def _contiguous(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # (ascontiguousarray makes 0-d 1-d)


def _write(executable, path: Path, two_level: dict | None = None) -> None:
    from safetensors.numpy import save_file
    from .quant.formats import pack_codes, two_level_split

    program: Program = executable.program
    nodes = program.nodes()
    graph = {
        "nodes": [{"id": n.id, "op": n.op.name, "type": _encode_type(n.type), "src": [s.id for s in n.src],
                   "attrs": {k: _encode(v) for k, v in n.attrs.items()}, "name": n.name} for n in nodes],
        "outputs": [n.id for n in program.outputs],
        "output_names": list(executable.output_names),
        "assigns": [n.id for n in program.assigns],
        "inputs": [{"name": name, "type": _encode_type(executable.feed_types[name])} for name in executable.feed_order],
        "regions": [list(r) for r in program.regions],
        "memory_plan": {str(k): v for k, v in program.memory_plan.items()},
        "buffer_sizes": list(program.buffer_sizes),
        "history": [[name, bool(changed)] for name, changed in executable.history],
    }
    tensors = {}
    for prefix, store in (("constant", program.constants), ("variable", program.variables)):
        for key, value in store.items():
            tensors[f"{prefix}:{key}"] = _contiguous(value)
    encoded = {}
    for key, (per_super, bits, sign) in (two_level or {}).items():
        value = program.constants.get(key)
        if value is None or value.dtype != np.float16 or value.ndim != 2:
            continue
        try:   # [nb, N] k-major parameters: super-blocks along axis 0
            units, codes = two_level_split(np.asarray(value).T, per_super, bits, sign)
        except ValueError:
            continue   # not (or no longer) two-level: stored as it is
        del tensors[f"constant:{key}"]
        tensors[f"two_level:{key}:units"], tensors[f"two_level:{key}:codes"] = units, pack_codes(codes, bits)
        encoded[key] = [int(per_super), int(bits), int(sign), list(value.shape)]
    if encoded:
        graph["two_level"] = encoded
    path.mkdir(parents=True)
    (path / "graph.json").write_text(json.dumps(graph))
    save_file(tensors, str(path / "weights.safetensors"))
    os.chmod(path / "weights.safetensors", default_file_mode())  # safetensors writes 0600
    for name, exe in executable.callables.items():
        _write(exe, path / "callables" / f"{name}.ingot")
    lut_bias = any(n.attrs.get("mode") == "scaled_lut" and n.attrs.get("has_bias") for n in nodes)
    version = LUT_BIAS_VERSION if lut_bias else TWO_LEVEL_VERSION if encoded else VERSION
    manifest = {"format": FORMAT, "version": version, "device": executable.device,
                "callables": sorted(executable.callables), "options": executable.options.to_dict()}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _is_package_or_empty(path: Path) -> bool:
    if not any(path.iterdir()):
        return True
    try:
        return json.loads((path / "manifest.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save(executable, path, two_level: dict | None = None) -> None:
    """Write `executable` as a package directory at path, replacing a package already there.

    Atomic: the package is built under a temporary name next to path and renamed into place; if
    anything fails, path is as it was before. A path that is a file, or a directory that is not
    an Ingot package, is refused rather than replaced. two_level: {constant key: (blocks per
    super-block, code bits, sign)} for float16 block parameters [nb, N] to store two-level
    (version 4); one that is not two-level is stored as it is.
    """
    path = Path(path)
    if path.exists() and not (path.is_dir() and _is_package_or_empty(path)):
        raise IngotError(f"save: {path} exists and is not an Ingot package; refusing to replace it.")
    with atomic_directory(path) as staged:
        _write(executable, staged, two_level)


@contextmanager
def atomic_directory(path: Path):
    """Yield a path (not yet created) to build a directory at; when the block ends without an
    error it replaces `path` by rename, and on any error `path` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        staged = tmp / path.name
        yield staged
        old = tmp / "previous"
        if path.exists():
            os.replace(path, old)
        try:
            os.replace(staged, path)
        except BaseException:
            if old.exists():
                os.replace(old, path)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- load ---------------------------------------------------------------------------------------
def _read_json(path: Path, what: type = dict) -> Any:
    if not path.is_file():
        raise IngotError(f"package: {path} is missing.")
    value = read_json(path, f"package: {path}")
    if not isinstance(value, what):
        raise IngotError(f"package: {path} holds a JSON {type(value).__name__}, not an object.")
    return value


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a safetensors file (8 bytes of header length, the JSON header, data)."""
    if not path.is_file():
        raise IngotError(f"package: {path} is missing.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise IngotError(f"package: {path} is truncated ({size} bytes, shorter than a safetensors header).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise IngotError(f"package: {path} is truncated: its header claims {n} bytes but the file has {size}.")
        header = loads(f.read(n), f"package: {path}'s header")
    if not isinstance(header, dict):
        raise IngotError(f"package: {path} has a corrupt header (not a JSON object).")
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            kind = ST_DTYPES[info["dtype"]]
            dtype = dt.bfloat16.storage if info["dtype"] == "BF16" else np.dtype(kind)
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if not all(_is_count(v) for v in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise IngotError(f"package: {path} entry {short(name)} is malformed ({short(info, 200)}).") from None
        count = math.prod(shape)  # Python integers: a product that would wrap in int64 stays too big
        if begin < 0 or end - begin != count * dtype.itemsize:
            raise IngotError(f"package: {path} entry {short(name)} has {end - begin} bytes for {dtype}{list(shape)}.")
        if end > data_size:
            raise IngotError(f"package: {path} is truncated: tensor {short(name)} needs bytes {begin}..{end} "
                             f"but the data section has {data_size}.")
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=shape)
    return out


def read_weights(path: Path, graph: dict | None = None, two_level_codes: bool = False) -> dict[str, np.ndarray]:
    """A package's weights.safetensors entries (memory-mapped), two-level ones decoded back to their
    "constant:KEY" float16 arrays (graph: its graph.json, read here when not given), or with
    two_level_codes=True kept as codes and units (ingot.quant.formats.TwoLevelParams, k-major [nb, N])."""
    from .quant.formats import TwoLevelParams, two_level_join, unpack_codes

    weights = read_safetensors(path / "weights.safetensors")
    graph = _read_json(path / "graph.json") if graph is None else graph
    encoded = graph.get("two_level", {}) if isinstance(graph, dict) else {}
    if not isinstance(encoded, dict):
        raise IngotError(f"package: {path}/graph.json has two_level {short(encoded)}, not an object.")
    for key, spec in encoded.items():
        try:
            per_super, bits, sign, shape = spec
            units = weights.pop(f"two_level:{key}:units")
            data = weights.pop(f"two_level:{key}:codes")
            nb, n = (int(d) for d in shape)
            if (bits not in (6, 8) or sign not in (1, -1) or not _is_count(per_super) or per_super == 0 or nb % per_super
                    or units.dtype != np.float16 or units.shape != (nb // per_super, n) or data.dtype != np.uint8
                    or data.shape != ((nb * n if bits == 8 else -(-nb * n // 4) * 3),)):
                raise ValueError
            codes = unpack_codes(data, bits, nb * n).reshape(nb // per_super, per_super, n)
        except (KeyError, TypeError, ValueError):
            raise IngotError(f"package: {path}: two-level constant {short(key)} ({short(spec)}) does not match "
                             f"weights.safetensors.") from None
        if two_level_codes:
            weights[f"constant:{key}"] = TwoLevelParams(codes.reshape(nb, n), units if sign > 0 else -units)
        else:
            weights[f"constant:{key}"] = np.ascontiguousarray(two_level_join(units, codes, sign).T)
    return weights


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tensor(path: Path, what: str, name: str, array: np.ndarray, t: TensorType) -> None:
    want = dt.storage_shape(t.shape, t.dtype)
    if array.dtype != t.dtype.storage or array.shape != want:
        raise IngotError(f"package: {path}/graph.json declares {what} {name!r} as {t} but weights.safetensors holds "
                         f"{array.dtype}{list(array.shape)}.")


def _build_program(path: Path, graph: dict, weights: dict[str, np.ndarray]) -> tuple[Program, list[tuple[str, TensorType]]]:
    constants, variables = {}, {}
    for name, array in weights.items():
        prefix, _, key = name.partition(":")
        if prefix not in ("constant", "variable"):
            raise IngotError(f"package: {path}/weights.safetensors has tensor {name!r}, neither a constant nor a variable.")
        (constants if prefix == "constant" else variables)[key] = array
    nodes: dict[int, Node] = {}
    for entry in graph["nodes"]:
        op_name = entry["op"]
        if not isinstance(op_name, str) or op_name not in Op.__members__:
            raise IngotError(f"package: {path}/graph.json uses unknown op {op_name!r}; "
                             "it was written by a newer Ingot or is corrupt.")
        op = Op[op_name]
        missing = [s for s in entry["src"] if s not in nodes]
        if missing:
            raise IngotError(f"package: {path}/graph.json node {entry['id']} refers to undefined nodes {missing}.")
        attrs = {k: _decode(v) for k, v in entry["attrs"].items()}
        node_type = _decode_type(entry["type"])
        if op == Op.CONSTANT:
            if attrs["key"] not in constants:
                raise IngotError(f"package: {path}/graph.json refers to tensor {attrs['key']!r}, absent from weights.safetensors.")
            _check_tensor(path, "constant", attrs["key"], constants[attrs["key"]], node_type)
        if op == Op.VARIABLE:
            if attrs["name"] not in variables:
                raise IngotError(f"package: {path}/graph.json refers to variable {attrs['name']!r}, absent from weights.safetensors.")
            _check_tensor(path, "variable", attrs["name"], variables[attrs["name"]], node_type)
        if entry["id"] in nodes:
            raise IngotError(f"package: {path}/graph.json defines node {entry['id']} twice.")
        nodes[entry["id"]] = Node(op, node_type, tuple(nodes[s] for s in entry["src"]), attrs, entry["name"])
    outputs = [nodes[i] for i in graph["outputs"]]
    assigns = [nodes[i] for i in graph["assigns"]]
    program = Program(outputs, assigns, constants, variables)
    live = {n.id for n in program.nodes()}
    regions = []
    for region in graph.get("regions", []):
        ids = tuple(nodes[i].id for i in region)
        if not set(ids) <= live:
            raise IngotError(f"package: {path}/graph.json has a fusion region over nodes the program does not use.")
        regions.append(ids)
    program.regions = regions
    inputs = []
    for entry in graph.get("inputs", []):
        name, t = entry["name"], _decode_type(entry["type"])
        if not isinstance(name, str) or not isinstance(t, TensorType) or not all(_is_count(d) for d in t.shape):
            raise IngotError(f"package: {path}/graph.json has input {short(name)} of type {short(entry['type'])}, "
                             f"not a named tensor of known shape.")
        inputs.append((name, t))
    return program, inputs


def read_package(path: Path) -> tuple[Program, dict, dict]:
    """(program, manifest, graph.json) of the package at path, verified; runtime.load builds the
    Executable from them."""
    manifest = _read_json(path / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise IngotError(f"package: {path} is not an Ingot package (manifest.json format is {manifest.get('format')!r}, "
                         f"expected {FORMAT!r}).")
    if manifest.get("version") not in READS:
        raise IngotError(f"package: {path} has format version {manifest.get('version')!r}; this Ingot reads versions "
                         f"{', '.join(map(str, READS))}.")
    graph = _read_json(path / "graph.json")
    weights = read_weights(path, graph)
    try:
        program, inputs = _build_program(path, graph, weights)
    except IngotError as e:
        if str(e).startswith("package:"):
            raise
        raise IngotError(f"package: {path}/graph.json is malformed: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise IngotError(f"package: {path}/graph.json is malformed ({type(e).__name__}: {clip(e)}).") from None
    try:
        verify(program)
    except IngotError as e:
        raise IngotError(f"package: {path}/graph.json does not describe a valid program: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise IngotError(f"package: {path}/graph.json does not describe a valid program ({type(e).__name__}: "
                         f"{clip(e)}).") from None
    graph["inputs"] = inputs
    if not isinstance(manifest.get("device", "cpu"), str):
        raise IngotError(f"package: {path}/manifest.json has device {short(manifest.get('device'))}, not a device name.")
    history = graph.get("history", [])   # the pass history, shown by the viewer: kept only where well formed
    graph["history"] = [h for h in (history if isinstance(history, list) else []) if isinstance(h, list) and len(h) == 2]
    names = graph.get("output_names")  # absent in packages written before outputs had names
    if names is not None and (not isinstance(names, list) or len(names) != len(program.outputs)
                              or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names)):
        raise IngotError(f"package: {path}/graph.json has output_names {str(names)[:80]}, not "
                         f"{len(program.outputs)} distinct names.")
    return program, manifest, graph


def callable_names(path: Path, manifest: dict) -> list[str]:
    names = manifest.get("callables", [])
    if not isinstance(names, list):
        raise IngotError(f"package: {path}/manifest.json has callables {names!r}, not a list of names.")
    for name in names:
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name \
                or len(name.encode()) > 200:
            raise IngotError(f"package: {path}/manifest.json names a callable {short(name)} that is not a plain name.")
        inside(path, f"callables/{name}.ingot", f"package: {path}/manifest.json callable {short(name)}")
    return names


def options_of(path: Path, manifest: dict):
    """The CompileOptions the package was compiled with (a version 2 package: the defaults)."""
    from .options import CompileOptions

    try:
        return CompileOptions.from_dict(manifest.get("options", {}))
    except IngotError as e:
        raise IngotError(f"package: {path}/manifest.json: {e}") from None
