"""Open what `ingot view` is given (a package, a GGUF file, an ONNX file) as a compiled Program.

A GGUF model's graph is built by ingot.models.llama over lazily read tensors (each weight converted
once, kept quantized, never dequantized) and run through the compile pipeline for one decode step,
which is what `ingot generate` runs. Anything that is not one of these raises IngotError.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Program, TensorType

DECODE_CONTEXT = 2048  # the KV-cache length `ingot generate` uses by default


@dataclass
class Model:
    """A compiled program and what the viewer knows about where it came from."""

    path: str
    kind: str                                             # "package", "gguf", "onnx" or "graph"
    program: Program
    inputs: list[tuple[str, TensorType]]
    history: list[tuple[str, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)       # one line each, shown under the title
    tensor_types: dict[str, str] = field(default_factory=dict)   # GGUF tensor name -> "Q4_1", ...
    feeds: dict[str, Any] | None = None                  # example feeds for a profiled run

    def executable(self, device: str = "cpu"):
        """An Executable over this very program (same node ids), for a profiled run."""
        from ..runtime import Executable
        return Executable(self.program, device=device, history=self.history, inputs=self.inputs)


def open_model(path, device: str = "cpu") -> Model:
    """A package directory, a .gguf file or an .onnx file as a Model; IngotError for anything else."""
    path = os.fspath(path)
    p = Path(path)
    if not p.exists():
        raise IngotError(f"view: {path} does not exist.")
    if p.is_dir():
        if not (p / "manifest.json").is_file():
            raise IngotError(f"view: {path} is a folder but not an Ingot package (no manifest.json).")
        return _open_package(p)
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        return _open_gguf(path)
    if p.suffix.lower() == ".onnx":
        return _open_onnx(path)
    raise IngotError(f"view: {path} is not an Ingot package, a GGUF file or an ONNX file (it starts with {magic!r}).")


def _open_package(p: Path) -> Model:
    from ..package import read_package

    program, manifest, graph = read_package(p)
    history = [(str(h[0]), bool(h[1])) for h in graph.get("history", []) if isinstance(h, list) and len(h) == 2]
    notes = [f"Ingot package, format version {manifest.get('version')}, compiled for {manifest.get('device', 'cpu')}"]
    notes += _llm_notes(p)
    return Model(str(p), "package", program, list(graph["inputs"]), history, notes)


def _llm_notes(p: Path) -> list[str]:
    """A line about an LLM package's llm.json (architecture, layers, how it was quantized), if it has one."""
    import json

    try:
        info = json.loads((p / "llm.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(info, dict):
        return []
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    quantized = (info.get("extra") or {}).get("quantized") if isinstance(info.get("extra"), dict) else None
    line = f"LLM package: {info.get('architecture', '?')}, {config.get('n_layers', '?')} layers, dim {config.get('dim', '?')}"
    if isinstance(quantized, dict):
        line += f"; quantized {quantized.get('format')} from {quantized.get('source')}"
    return [line]


def _open_gguf(path: str) -> Model:
    from ..compiler import run_pipeline
    from ..importers.gguf import read_gguf
    from ..options import CompileOptions
    from .. import models

    model = read_gguf(path, lazy=True)
    config = models.config_from_gguf(model)
    config.context_length = min(config.context_length, DECODE_CONTEXT)
    built = models.build(config, model.tensors, path)
    g = built.graph
    program = Program([built.logits.node], list(g.assigns), dict(g.constants), dict(g.variables))
    step = TensorType((1,), dt.int32)
    # the graph before any device's fusions (each device's kernel groups are outlined over it: fusion.py)
    program, history = run_pipeline(program, feed_types={"tokens": step}, options=CompileOptions(fusions=frozenset()))
    inputs = [("tokens", step), ("pos", TensorType((), dt.int32)), ("last", TensorType((), dt.int32))]
    types = sorted({t for t in model.tensor_types.values()})
    notes = [f"GGUF {model.architecture}: {config.n_layers} layers, dim {config.dim}, {config.n_heads}/{config.n_kv_heads} heads, "
             f"vocabulary {config.vocab_size}; tensors {', '.join(f'{sum(v == t for v in model.tensor_types.values())} {t}' for t in types)}",
             f"the decode step (1 token, KV cache {config.context_length}) after the compile pipeline"]
    import numpy as np
    feeds = {"tokens": np.array([1], np.int32), "pos": np.int32(0), "last": np.int32(0)}
    return Model(path, "gguf", program, inputs, history, notes, dict(model.tensor_types), feeds)


def _open_onnx(path: str) -> Model:
    if importlib.util.find_spec("ingot.importers.onnx") is None:
        raise IngotError(f"view: {path} is an ONNX file, and this Ingot has no ONNX importer yet.")
    if importlib.util.find_spec("onnx") is None:
        raise IngotError(f"view: {path} is an ONNX file; reading it needs the onnx package (pip install 'ingot[onnx]').")
    from ..importers.onnx import compile_import, import_onnx

    # imported and compiled for the CPU: the program `ingot convert` would package (static shapes: a model
    # with symbolic dimensions is refused with the input_shapes hint, not compiled per shape as from_onnx does)
    exe = compile_import(import_onnx(path))
    inputs = [(name, exe.feed_types[name]) for name in exe.feed_order]
    return Model(path, "onnx", exe.program, inputs, list(exe.history), ["ONNX model after the compile pipeline"])


def from_graph(graph, targets, feeds: dict | None = None, name: str = "graph") -> Model:
    """A Model from a Graph under construction, compiled through the pipeline (tests, notebooks)."""
    from ..compiler import run_pipeline

    feed_types = {}
    for key, value in (feeds or {}).items():
        node = graph._placeholder_node(key)
        feed_types[node.name] = value if isinstance(value, TensorType) else TensorType(value, node.type.dtype)
    program = Program([t.node for t in targets], list(graph.assigns), dict(graph.constants), dict(graph.variables))
    program, history = run_pipeline(program, feed_types=feed_types)
    inputs = [(n, feed_types.get(n, node.type)) for n, node in graph.placeholders.items()]
    return Model(name, "graph", program, inputs, history, [])
