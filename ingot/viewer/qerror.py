"""Quantization error per weight against a reference with float weights (`ingot view --reference REF`).

REF is a GGUF file (tensors matched by GGUF name: a constant that holds several side-by-side GGUF
tensors is compared part by part), an Ingot package (constants matched by key), or, from Python, a
mapping name -> array. Each quantized weight is dequantized on its own, compared, and dropped: the
float model is never held whole. Error: relative RMS, ||w - ref|| / ||ref||, and the largest |w - ref|.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import IngotError
from ..ir import Op
from . import stats


def _reference_tensors(reference) -> tuple[str, Mapping, str]:
    """(label, name -> array-or-QuantizedTensor, orientation) where orientation is "gguf" ([out, in]) or "ingot"."""
    if isinstance(reference, Mapping):
        return "a mapping", reference, "ingot"
    path = os.fspath(reference)
    if os.path.isdir(path):
        from ..package import read_package
        program, _, _ = read_package(__import__("pathlib").Path(path))
        return path, program.constants, "ingot"
    if not os.path.isfile(path):
        raise IngotError(f"--reference: {path} does not exist.")
    from ..importers.gguf import read_gguf
    return path, read_gguf(path, lazy=True).tensors, "gguf"


def _as_float(value) -> np.ndarray:
    from ..quant.formats import QuantizedTensor
    if isinstance(value, QuantizedTensor):
        return value.dequantize_rows()
    return np.asarray(value, np.float32)


def quantization_error(model, reference) -> dict[str, Any]:
    """{"reference", "constants": {node id: {"relative", "max_abs", "compared"}}} for each quantized weight found in REF."""
    label, tensors, orientation = _reference_tensors(reference)
    program = model.program
    nodes = program.nodes()
    uses = stats.quant_uses(nodes)
    out: dict[int, dict[str, Any]] = {}
    for n in nodes:
        use = uses.get(n.id)
        if n.op != Op.CONSTANT or use is None or use[1] != -1:
            continue
        key = n.attrs["key"]
        names = key.split("+") if orientation == "gguf" else [key]
        if not all(name in tensors for name in names):
            continue
        shape = tuple(n.shape)
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        ours = stats.dequantized_corner(program, n, use[0], rows, shape[-1])
        if orientation == "gguf":   # ours: [in, sum(out)] k-major; GGUF: [out, in] each
            refs = [_as_float(tensors[name]) for name in names]
            want = np.concatenate([r.T for r in refs], axis=1) if len(refs) > 1 else refs[0].T
        else:
            want = _as_float(tensors[names[0]]).reshape(rows, -1)
        if want.shape != ours.shape:
            continue
        diff = ours - want
        norm = float(np.linalg.norm(want))
        out[n.id] = {"relative": float(np.linalg.norm(diff) / norm) if norm else float(np.linalg.norm(diff)),
                     "max_abs": float(np.abs(diff).max()) if diff.size else 0.0, "compared": names}
    if not out:
        raise IngotError(f"--reference: no quantized weight of {model.path} has a tensor of the same name and shape in {label}.")
    return {"reference": label, "constants": out}
