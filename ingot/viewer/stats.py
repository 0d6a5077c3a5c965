"""Constants as the viewer lists them: format, size, role, and on demand a weight preview.

A quantized weight is a CONSTANT of integers read by a dequantize / quantized_matmul /
quantized_gather, whose other inputs are its parameters (scale, zero point, bias, or a lookup
table), all block-broadcast (see ingot.ops.quant). Previews never dequantize a whole big weight:
the value histogram is over at most SAMPLE elements (whole rows from the top), the code histogram
counts every integer (a bincount, no floats), the heatmap is a corner of at most HEATMAP x HEATMAP.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..ir import Node, Op, Program
from ..ops.quant import param_count, unpack

SAMPLE = 1 << 20
HEATMAP = 48
BINS = 48
QUANT_OPS = {Op.DEQUANTIZE: 0, Op.QUANTIZED_MATMUL: 1, Op.QUANTIZED_GATHER: 0, Op.QUANTIZED_GATHER_MATMUL: 2}  # op -> index of q in src
PARAM_NAMES = ("scale", "zero_point", "bias")


def quant_uses(nodes: list[Node]) -> dict[int, tuple[Node, int]]:
    """Constant node id -> (the quantization op reading it, its role index: -1 = the integers, else param i)."""
    uses: dict[int, tuple[Node, int]] = {}
    for n in nodes:
        if n.op not in QUANT_OPS:
            continue
        at = QUANT_OPS[n.op]
        uses.setdefault(n.src[at].id, (n, -1))
        for i in range(param_count(n.attrs)):
            uses.setdefault(n.src[at + 1 + i].id, (n, i))
    return uses


def quant_params(op: Node) -> list[tuple[str, Node]]:
    at = QUANT_OPS[op.op]
    if op.attrs["mode"] == "lut":
        return [("lut", op.src[at + 1])]
    if op.attrs["mode"] == "scaled_lut":   # (a bias: lut4:bB:offset)
        return [("lut", op.src[at + 1]), ("scale", op.src[at + 2])] + ([("bias", op.src[at + 3])] if op.attrs.get("has_bias") else [])
    names = ["scale"] + (["zero_point"] if op.attrs.get("has_zero_point") else []) + (["bias"] if op.attrs.get("has_bias") else [])
    return list(zip(names, op.src[at + 1: at + 1 + len(names)]))


def describe_format(q: Node, op: Node) -> str:
    """'uint4 block 32 · scale, bias', 'int8 per-channel · scale', 'LUT-16 (uint4)' ..."""
    qdtype = op.attrs["qdtype"]
    params = quant_params(op)
    if op.attrs["mode"] == "lut":
        lut = params[0][1]
        groups = int(np.prod([d or 1 for d in lut.shape[:-1]]))
        return f"LUT-{2 ** qdtype.bits} ({qdtype.name})" + (f", {groups} tables" if groups > 1 else "")
    scaled = op.attrs["mode"] == "scaled_lut"   # a table times a scale per block (GGUF's IQ types, MXFP4)
    if scaled:
        params = params[1:]
    p = params[0][1]
    granularity = "per-tensor"
    blocks = [q.shape[i] // p.shape[i] for i in range(len(q.shape)) if p.shape[i] not in (1, q.shape[i])]
    if blocks:
        granularity = "block " + "x".join(str(b) for b in blocks)
    elif any(d != 1 for d in p.shape):
        granularity = "per-channel"
    if scaled:
        return f"LUT-{2 ** qdtype.bits} ({qdtype.name}) {granularity} · {', '.join(name for name, _ in params)}"
    return f"{qdtype.name} {granularity} · {', '.join(name for name, _ in params)}"


def plain_format(node: Node) -> str:
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "complex64": "c64"}
    return short.get(node.dtype.name, node.dtype.name)


def constant_table(program: Program, nodes: list[Node], tensor_types: dict[str, str]) -> dict[int, dict[str, Any]]:
    """Node id -> {key, bytes, elements, format, role, of, parts} for every constant."""
    uses = quant_uses(nodes)
    table = {}
    for n in nodes:
        if n.op != Op.CONSTANT:
            continue
        key = n.attrs["key"]
        value = program.constants[key]
        info: dict[str, Any] = {"key": key, "bytes": int(value.nbytes), "elements": int(np.prod(n.shape, dtype=np.int64)),
                                "dtype": n.dtype.name, "format": plain_format(n), "role": "tensor"}
        use = uses.get(n.id)
        if use is not None:
            op, role = use
            q = op.src[QUANT_OPS[op.op]]
            if role == -1:
                info["role"] = "quantized weight"
                info["format"] = describe_format(n, op)
                params = quant_params(op)
                info["params"] = [p.id for _, p in params]
                info["bytes_with_params"] = info["bytes"] + sum(int(program.constants[p.attrs["key"]].nbytes)
                                                                for _, p in params if p.op == Op.CONSTANT)
            else:
                info["role"] = quant_params(op)[role][0] if role < len(quant_params(op)) else "parameter"
                info["weight"] = q.id
        parts = key.split("+")
        if len(parts) > 1:   # weights stored side by side (q/k/v, gate/up): the tensors it holds
            info["parts"] = parts
        known = [part for part in parts if part in tensor_types]
        if known:
            info["gguf"] = [{"name": part, "type": tensor_types[part]} for part in known]
        table[n.id] = info
    return table


def _summary(values: np.ndarray) -> dict[str, float]:
    v = np.asarray(values, np.float64).ravel()
    if v.size == 0:
        return {"count": 0}
    return {"count": int(v.size), "min": float(v.min()), "max": float(v.max()), "mean": float(v.mean()),
            "std": float(v.std()), "zeros": int(np.count_nonzero(v == 0))}


def _histogram(values: np.ndarray, bins: int = BINS) -> dict[str, Any]:
    v = np.asarray(values, np.float64).ravel()
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"lo": 0.0, "hi": 1.0, "counts": [0]}
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts, _ = np.histogram(v, bins=bins, range=(lo, hi))
    return {"lo": lo, "hi": hi, "counts": [int(c) for c in counts]}


def _heatmap(corner: np.ndarray) -> dict[str, Any]:
    c = np.asarray(corner, np.float64)
    if c.ndim == 1:
        c = c[None, :]
    c = c.reshape(-1, c.shape[-1])[:HEATMAP, :HEATMAP]
    lo, hi = (float(c.min()), float(c.max())) if c.size else (0.0, 0.0)
    scaled = np.zeros(c.shape, np.uint8) if hi == lo else np.round((c - lo) / (hi - lo) * 255).astype(np.uint8)
    return {"rows": int(c.shape[0]), "cols": int(c.shape[1]) if c.ndim == 2 else 0, "min": lo, "max": hi,
            "data": base64.b64encode(scaled.tobytes()).decode("ascii")}


def _as_2d(array: np.ndarray) -> np.ndarray:
    if array.ndim == 0:
        return array.reshape(1, 1)
    return array.reshape(-1, array.shape[-1])


def _expand_rows(p: np.ndarray, q_shape: tuple[int, ...], rows: int, cols: int) -> np.ndarray:
    """A block-broadcast parameter at the top-left [rows, cols] corner of a 2-D weight."""
    p2 = p.reshape(p.shape[-2:]) if p.ndim >= 2 else p.reshape(1, -1) if p.ndim == 1 else p.reshape(1, 1)
    q_rows, q_cols = (q_shape[-2] if len(q_shape) >= 2 else 1), q_shape[-1]
    r = np.arange(rows) * p2.shape[0] // q_rows
    c = np.arange(cols) * p2.shape[1] // q_cols
    return p2[np.ix_(r, c)].astype(np.float32)


def dequantized_corner(program: Program, q: Node, op: Node, rows: int, cols: int) -> np.ndarray:
    """Float values of the top-left [rows, cols] of a quantized weight (2-D; others: leading axes flattened)."""
    raw = program.constants[q.attrs["key"]]
    shape = tuple(q.shape)
    q_rows = shape[-2] if len(shape) >= 2 else 1
    rows, cols = min(rows, q_rows), min(cols, shape[-1])
    stored = raw.reshape(-1, raw.shape[-1]) if raw.ndim >= 2 else raw.reshape(1, -1)
    qdtype = op.attrs["qdtype"]
    byte_cols = (cols + 1) // 2 if qdtype.packed else cols
    codes = unpack(np.ascontiguousarray(stored[:rows, :byte_cols]), qdtype)[:, :cols].astype(np.float32)
    params = dict(quant_params(op))
    value = lambda name: program.constants[params[name].attrs["key"]]  # noqa: E731
    if op.attrs["mode"] in ("lut", "scaled_lut"):   # one table per group: groups are block-broadcast like affine parameters
        lut = program.constants[params["lut"].attrs["key"]]
        tables = lut.reshape(-1, *lut.shape[-3:])[0] if lut.ndim >= 3 else lut.reshape(1, 1, lut.shape[-1])
        r = np.arange(rows)[:, None] * tables.shape[0] // q_rows
        c = np.arange(cols)[None, :] * tables.shape[1] // shape[-1]
        looked_up = tables[r, c, codes.astype(np.int64)]
        if op.attrs["mode"] == "scaled_lut":
            looked_up = looked_up * _expand_rows(value("scale"), shape, rows, cols)
        if "bias" in params:
            looked_up = looked_up + _expand_rows(value("bias"), shape, rows, cols)
        return looked_up
    w = codes
    if "zero_point" in params:
        w = w - _expand_rows(value("zero_point"), shape, rows, cols)
    w = w * _expand_rows(value("scale"), shape, rows, cols)
    if "bias" in params:
        w = w + _expand_rows(value("bias"), shape, rows, cols)
    return w


def _code_counts(raw: np.ndarray, packed: bool, chunk: int = 1 << 22) -> np.ndarray:
    """How often each integer code occurs, counted a chunk at a time (bincount widens to int64)."""
    flat = raw.reshape(-1).view(np.uint8)
    counts = np.zeros(16 if packed else 256, np.int64)
    for at in range(0, flat.size, chunk):
        b = flat[at: at + chunk]
        if packed:
            counts += np.bincount(b & 0xF, minlength=16) + np.bincount(b >> 4, minlength=16)
        else:
            counts += np.bincount(b, minlength=256)
    return counts


def preview(program: Program, node: Node, nodes: list[Node]) -> dict[str, Any]:
    """Histogram, heatmap and parameter statistics of one constant (the Constants navigator's detail)."""
    raw = program.constants[node.attrs["key"]]
    use = quant_uses(nodes).get(node.id)
    out: dict[str, Any] = {"id": node.id, "key": node.attrs["key"]}
    if use is not None and use[1] == -1:
        op = use[0]
        shape = tuple(node.shape)
        cols = shape[-1] if shape else 1
        rows = max(1, min(int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1, SAMPLE // max(cols, 1)))
        sample = dequantized_corner(program, node, op, rows, cols)
        total = int(np.prod(shape, dtype=np.int64))
        out["sample"] = {"elements": int(sample.size), "of": total, "rows": rows}
        out["histogram"] = _histogram(sample)
        out["values"] = _summary(sample)
        out["heatmap"] = _heatmap(sample[:HEATMAP, :HEATMAP])
        qdtype = op.attrs["qdtype"]
        codes = _code_counts(raw, qdtype.packed)
        half = 8 if qdtype.packed else 128
        labels = list(range(-half, half)) if qdtype.kind == "i" else list(range(2 * half))
        if qdtype.kind == "i":   # two's complement: the negative codes are the upper half
            codes = np.concatenate([codes[half:], codes[:half]])
        out["codes"] = {"labels": labels, "counts": [int(c) for c in codes]}
        params = {}
        for name, p in quant_params(op):
            if p.op != Op.CONSTANT:
                continue
            pv = program.constants[p.attrs["key"]]
            entry: dict[str, Any] = {"shape": list(p.shape), **_summary(pv)}
            if name == "lut":
                tables = pv.reshape(-1, pv.shape[-1])
                entry["tables"] = int(tables.shape[0])
                entry["values"] = [float(x) for x in tables[0]]
            else:
                entry["histogram"] = _histogram(pv)
            params[name] = entry
        out["params"] = params
        return out
    array = np.asarray(raw)
    if node.dtype.packed:
        array = unpack(array, node.dtype)
    if array.dtype.kind == "c":
        array = np.abs(array)
    if array.dtype.kind not in "fiub":
        return out
    array = array.astype(np.float32) if array.dtype != np.float32 else array
    flat = array.reshape(-1)[:SAMPLE]
    out["sample"] = {"elements": int(flat.size), "of": int(array.size), "rows": 0}
    out["histogram"] = _histogram(flat)
    out["values"] = _summary(flat)
    out["heatmap"] = _heatmap(_as_2d(array)[:HEATMAP, :HEATMAP])
    return out


__all__ = ["constant_table", "preview", "quant_uses", "quant_params", "describe_format", "dequantized_corner"]
