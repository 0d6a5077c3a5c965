"""The package format: a directory NAME.ingot/ holding

    manifest.json       {"format": "ingot-package", "version": 1, "device": ..., "callables": [...]}
    graph.json          the compiled program: nodes (sources first), outputs, assigns, annotations
    weights.safetensors constants and variable initial values, memory-mapped on load
    callables/NAME.ingot/  one package per bound callable

Nothing is pickled or evaluated: JSON and raw tensor bytes only. A package is written under a
temporary name and renamed into place, so a failed save leaves nothing half written.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import dtypes as dt
from .errors import IngotError
from .ir import Node, Op, Program, Ref, TensorType

FORMAT = "ingot-package"
VERSION = 1

# safetensors dtype names <-> the NumPy dtype that holds the bytes
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I32": np.int32,
              "I64": np.int64, "BOOL": np.bool_, "U16": np.uint16, "F64": np.float64}


# -- attribute encoding -------------------------------------------------------------------------
def _encode(value: Any) -> Any:
    if isinstance(value, dt.DType):
        return {"dtype": value.name}
    if isinstance(value, Ref):
        return {"ref": value.index}
    if isinstance(value, TensorType):
        return {"tensor_type": {"shape": list(value.shape), "dtype": value.dtype.name}}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise IngotError(f"package: cannot store attribute value of type {type(value).__name__}.")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        if "dtype" in value:
            return dt.by_name(value["dtype"])
        if "ref" in value:
            return Ref(int(value["ref"]))
        if "tensor_type" in value:
            t = value["tensor_type"]
            return TensorType(t["shape"], dt.by_name(t["dtype"]))
        raise IngotError(f"package: graph.json has an attribute object with unknown keys {sorted(value)}.")
    return value


def _encode_type(t) -> Any:
    if isinstance(t, tuple):
        return {"tuple": [_encode_type(x) for x in t]}
    return {"shape": list(t.shape), "dtype": t.dtype.name}


def _decode_type(v) -> Any:
    if "tuple" in v:
        return tuple(_decode_type(x) for x in v["tuple"])
    return TensorType(v["shape"], dt.by_name(v["dtype"]))


# -- save ---------------------------------------------------------------------------------------
def _storable(array: np.ndarray) -> tuple[np.ndarray, str]:
    """The array as bytes safetensors accepts, and the dtype to restore."""
    a = np.ascontiguousarray(array)
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16), "bfloat16"
    if a.dtype == np.complex64:
        return a.view(np.float32), "complex64"
    return a, a.dtype.name


def _write(program: Program, device: str, callables: dict, path: Path) -> None:
    from safetensors.numpy import save_file

    nodes = program.nodes()
    graph = {
        "nodes": [{"id": n.id, "op": n.op.name, "type": _encode_type(n.type), "src": [s.id for s in n.src],
                   "attrs": {k: _encode(v) for k, v in n.attrs.items()}, "name": n.name} for n in nodes],
        "outputs": [n.id for n in program.outputs],
        "assigns": [n.id for n in program.assigns],
        "regions": [list(r) for r in program.regions],
        "memory_plan": {str(k): v for k, v in program.memory_plan.items()},
        "buffer_sizes": program.buffer_sizes,
    }
    tensors, dtypes = {}, {}
    for prefix, store in (("constant", program.constants), ("variable", program.variables)):
        for key, value in store.items():
            name = f"{prefix}:{key}"
            tensors[name], dtypes[name] = _storable(value)
    graph["tensor_dtypes"] = dtypes
    path.mkdir(parents=True)
    (path / "graph.json").write_text(json.dumps(graph))
    save_file(tensors, str(path / "weights.safetensors"))
    for name, exe in callables.items():
        _write(exe.program, exe.device, exe.callables, path / "callables" / f"{name}.ingot")
    manifest = {"format": FORMAT, "version": VERSION, "device": device, "callables": sorted(callables)}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def save(executable, path) -> None:
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent if path.parent.exists() else None))
    try:
        staged = tmp / path.name
        _write(executable.program, executable.device, executable.callables, staged)
        if path.exists():
            old = tmp / "old"
            os.replace(path, old)
        os.replace(staged, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- load ---------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise IngotError(f"package: {path} is missing.")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IngotError(f"package: {path} is not valid JSON ({e}).") from None


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a safetensors file (its header is 8 bytes of length, then JSON)."""
    if not path.is_file():
        raise IngotError(f"package: {path} is missing.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise IngotError(f"package: {path} is truncated ({size} bytes).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise IngotError(f"package: {path} header claims {n} bytes but the file has {size}.")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise IngotError(f"package: {path} has a corrupt header.") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise IngotError(f"package: {path} entry {name!r} is malformed ({info}).") from None
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or 8 + n + end > size or begin < 0:
            raise IngotError(f"package: {path} is truncated or corrupt at tensor {name!r} "
                             f"(bytes {begin}..{end} of {size - 8 - n}).")
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=shape)
    return out


def _restore(array: np.ndarray, dtype_name: str) -> np.ndarray:
    if dtype_name == "bfloat16":
        return array.view(dt.bfloat16.storage)
    if dtype_name == "complex64":
        return array.view(np.complex64)
    return array


def _read_program(path: Path) -> tuple[Program, dict]:
    manifest = _read_json(path / "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IngotError(f"package: {path} is not an Ingot package (manifest format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}).")
    if manifest.get("version") != VERSION:
        raise IngotError(f"package: {path} has format version {manifest.get('version')}; this Ingot reads version {VERSION}.")
    graph = _read_json(path / "graph.json")
    weights = read_safetensors(path / "weights.safetensors")
    dtypes = graph.get("tensor_dtypes", {})
    constants, variables = {}, {}
    for name, array in weights.items():
        prefix, _, key = name.partition(":")
        array = _restore(array, dtypes.get(name, ""))
        (constants if prefix == "constant" else variables)[key] = array
    nodes: dict[int, Node] = {}
    try:
        for entry in graph["nodes"]:
            try:
                op = Op[entry["op"]]
            except KeyError:
                raise IngotError(f"package: {path}/graph.json uses unknown op {entry['op']!r}.") from None
            missing = [s for s in entry["src"] if s not in nodes]
            if missing:
                raise IngotError(f"package: {path}/graph.json node {entry['id']} refers to undefined nodes {missing}.")
            attrs = {k: _decode(v) for k, v in entry["attrs"].items()}
            if op == Op.CONSTANT and attrs["key"] not in constants:
                raise IngotError(f"package: {path}/graph.json refers to tensor {attrs['key']!r}, absent from weights.safetensors.")
            if op == Op.VARIABLE and attrs["name"] not in variables:
                raise IngotError(f"package: {path}/graph.json refers to variable {attrs['name']!r}, absent from weights.safetensors.")
            nodes[entry["id"]] = Node(op, _decode_type(entry["type"]), tuple(nodes[s] for s in entry["src"]), attrs, entry["name"])
        outputs = [nodes[i] for i in graph["outputs"]]
        assigns = [nodes[i] for i in graph["assigns"]]
    except (KeyError, TypeError, ValueError) as e:
        raise IngotError(f"package: {path}/graph.json is malformed ({type(e).__name__}: {e}).") from None
    program = Program(outputs, assigns, constants, variables)
    new_id = {old: n.id for old, n in nodes.items()}
    program.regions = [tuple(new_id[i] for i in r) for r in graph.get("regions", [])]
    program.memory_plan = {new_id[int(k)]: v for k, v in graph.get("memory_plan", {}).items()}
    program.buffer_sizes = list(graph.get("buffer_sizes", []))
    from .ir import verify
    verify(program)
    return program, manifest


def load(path, device: str | None = None):
    from .runtime import Executable

    path = Path(path)
    if not path.is_dir():
        raise IngotError(f"package: {path} does not exist or is not a package directory.")
    program, manifest = _read_program(path)
    callables = {name: load(path / "callables" / f"{name}.ingot", device) for name in manifest.get("callables", [])}
    return Executable(program, device=device or manifest.get("device", "cpu"), callables=callables)
