"""A compiled program as the page's JSON: nodes, folded repeated blocks, constants, variables,
kernel groups per device, and the optional overlays (profile, quantization error).

Repeated blocks are found from the names of parameters and state: the family of names with a
numbered segment (`blk.7.attn_q.weight`, `model.layers.7.mlp...`) that has the most distinct
numbers is the block family; an op joins the block of its numbered inputs (the highest number
among them, through unnamed ops too), except an op that reads an un-numbered named constant
directly (the embedding, the final norm), which stays outside every block.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from .. import dtypes as dt
from ..ir import Node, Op, Ref, TensorType
from . import fusion, stats
from .source import Model

NUMBERED = re.compile(r"(?:^|[./_:])(\d+)(?=[./_:]|$)")
SERIAL = re.compile(r"^[A-Za-z]*(?:::[A-Za-z]+)?_\d+$")   # val_14, onnx::MatMul_1234: an exporter's serial names
DEVICES = ("cpu", "cuda")


def attr_text(value: Any) -> str:
    if isinstance(value, dt.DType):
        return value.name
    if isinstance(value, Ref):
        return f"input {value.index}"
    if isinstance(value, TensorType):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(attr_text(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)}"
    return str(value)


def type_text(t) -> str:
    if isinstance(t, tuple):
        return "(" + ", ".join(repr(x) for x in t) + ")"
    return repr(t)


def _label_name(n: Node) -> str | None:
    if n.op == Op.CONSTANT:
        return n.attrs["key"]
    if n.op == Op.VARIABLE:
        return n.attrs["name"]
    return n.name


def find_blocks(nodes: list[Node]) -> tuple[str, dict[int, int]]:
    """(family prefix, node id -> block number) for the repeated blocks of a program ('' if none)."""
    families: dict[str, Counter] = {}
    numbered: dict[int, tuple[str, int]] = {}
    for n in nodes:
        name = _label_name(n)
        if n.op not in (Op.CONSTANT, Op.VARIABLE) or not name or name.startswith("folded_"):
            continue
        m = NUMBERED.search(name.split("+")[0])
        if m:
            prefix = name[: m.start(1)]
            families.setdefault(prefix, Counter())[int(m.group(1))] += 1
            numbered[n.id] = (prefix, int(m.group(1)))

    def is_blocks(counts: Counter) -> bool:
        """Layers: several numbers, each naming several tensors, numbered nearly one after another
        (not a serial number per tensor, like ONNX's onnx::MatMul_1234)."""
        numbers = sorted(counts)
        return len(numbers) >= 2 and sorted(counts.values())[len(numbers) // 2] >= 2 \
            and numbers[-1] - numbers[0] + 1 <= 2 * len(numbers)

    families = {p: c for p, c in families.items() if is_blocks(c)}
    if not families:
        return "", {}
    prefix = max(families, key=lambda p: (len(families[p]), -len(p)))
    block: dict[int, int] = {i: k for i, (p, k) in numbered.items() if p == prefix}
    users: dict[int, list[Node]] = {}
    for n in nodes:
        for s in n.src:
            users.setdefault(s.id, []).append(n)
    # a named tensor outside the blocks read by one op (an embedding, the output head) keeps that op
    # outside; serial names an exporter made up (val_14, onnx::MatMul_7) and tensors several ops share
    # (one norm weight for every layer) say nothing about where their reader belongs
    outside: set[int] = {n.id for n in nodes if n.op in (Op.CONSTANT, Op.VARIABLE) and n.id not in block
                         and _label_name(n) and not _label_name(n).startswith(("folded_", "const_"))
                         and not SERIAL.match(_label_name(n)) and len(users.get(n.id, ())) == 1}
    ops = [n for n in nodes if n.op not in (Op.CONSTANT, Op.VARIABLE, Op.PLACEHOLDER)]
    for n in ops:  # forward: an op joins the latest block it reads from
        if any(s.id in outside for s in n.src):
            continue
        found = [block[s.id] for s in n.src if s.id in block]
        if found:
            block[n.id] = max(found)
    for n in reversed(ops):  # backward: an op with a weight of its own joins the block of all its readers
        own = [s for s in n.src if s.op in (Op.CONSTANT, Op.VARIABLE) and s.id not in outside and s.id not in block
               and len(users.get(s.id, ())) == 1]
        readers = {block.get(u.id) for u in users.get(n.id, ())}
        if own and len(readers) == 1 and None not in readers and not any(s.id in outside for s in n.src):
            block[n.id] = readers.pop()
    # the last block keeps no more ops than the others have: ops after it that read it (a pooler, a
    # head with a serial-named weight) come off it, last first, while nothing in it reads them
    sizes = Counter(k for i, k in block.items() if i in {n.id for n in ops})
    if len(sizes) >= 2:
        last = max(sizes)
        typical = Counter(v for k, v in sizes.items() if k != last).most_common(1)[0][0]
        for n in reversed(ops):
            if sizes[last] <= typical:
                break
            if block.get(n.id) == last and all(block.get(u.id) != last for u in users.get(n.id, ())):
                del block[n.id]
                sizes[last] -= 1
    # an op that takes a graph input and feeds only ops outside every block is not part of the last block
    for n in reversed(nodes):
        if n.id in block and n.op not in (Op.CONSTANT, Op.VARIABLE) and any(s.op == Op.PLACEHOLDER for s in n.src) \
                and not any(s.id in block and s.op in (Op.CONSTANT, Op.VARIABLE) for s in n.src) \
                and users.get(n.id) and all(u.id not in block for u in users[n.id]):
            del block[n.id]
    return prefix, block


def export(model: Model, profile: dict | None = None, qerror: dict | None = None, previews: bool = False) -> dict[str, Any]:
    """The page's data for a Model (JSON-serialisable). previews=True embeds every constant's preview."""
    program = model.program
    nodes = program.nodes()
    index = {n.id: i for i, n in enumerate(nodes)}
    consts = stats.constant_table(program, nodes, model.tensor_types)
    kind_of = {Op.CONSTANT: "constant", Op.VARIABLE: "variable", Op.PLACEHOLDER: "input", Op.ASSIGN: "assign"}
    out_nodes = []
    for i, n in enumerate(nodes):
        entry: dict[str, Any] = {"i": i, "id": n.id, "op": n.op.name.lower(), "kind": kind_of.get(n.op, "op"),
                                 "type": type_text(n.type), "src": [index[s.id] for s in n.src]}
        name = _label_name(n)
        if name:
            entry["name"] = name
        attrs = {k: attr_text(v) for k, v in n.attrs.items() if k not in ("key",)}
        if attrs:
            entry["attrs"] = attrs
        out_nodes.append(entry)

    prefix, block = find_blocks(nodes)
    groups = []
    if prefix:
        numbers = sorted(set(block.values()))
        members: dict[int, list[int]] = {k: [] for k in numbers}
        for node_id, k in block.items():
            if nodes[index[node_id]].op != Op.CONSTANT:
                members[k].append(index[node_id])
        signature = {k: tuple(sorted(Counter(out_nodes[i]["op"] for i in members[k]).items())) for k in numbers}
        common = Counter(signature.values()).most_common(1)[0][0]
        same = sum(signature[k] == common for k in numbers)
        label = prefix.rstrip("./_:") or "block"
        groups.append({"id": "repeat", "label": f"{label} {numbers[0]}–{numbers[-1]}", "parent": None,
                       "repeat": len(numbers), "identical": same,
                       "note": f"{len(numbers)} blocks, {same} with the same ops"})
        for k in numbers:
            groups.append({"id": f"b{k}", "label": f"{prefix}{k}", "parent": "repeat", "nodes": sorted(members[k]),
                           "same": signature[k] == common})

    ops = [e for e in out_nodes if e["kind"] != "constant"]
    counts = Counter(e["op"] for e in ops)
    constants = {index[node_id]: {**info, "params": [index[p] for p in info.get("params", [])],
                                  **({"weight": index[info["weight"]]} if "weight" in info else {})}
                 for node_id, info in consts.items()}
    for info in constants.values():
        if not info["params"]:
            del info["params"]
    quantized = [c for c in constants.values() if c["role"] == "quantized weight"]
    by_format = Counter(c["format"] for c in quantized)
    gguf_parts = Counter(part["type"] for c in quantized for part in c.get("gguf", []))

    if profile is not None:
        profile = {**profile, "nodes": {index[k]: v for k, v in profile["nodes"].items() if k in index}}
    if qerror is not None:
        qerror = {**qerror, "constants": {index[k]: v for k, v in qerror["constants"].items() if k in index}}
    data: dict[str, Any] = {
        "model": {"path": model.path, "kind": model.kind, "notes": list(model.notes),
                  "history": [[name, changed] for name, changed in model.history],
                  "inputs": [[name, repr(t)] for name, t in model.inputs]},
        "nodes": out_nodes,
        "outputs": [index[n.id] for n in program.outputs],
        "assigns": [index[n.id] for n in program.assigns],
        "groups": groups,
        "counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "constants": constants,
        "quantized": {"tensors": len(quantized), "formats": dict(by_format), "gguf": dict(gguf_parts),
                      "held": sum(len(c.get("parts", [c["key"]])) for c in quantized),
                      "bytes": sum(c.get("bytes_with_params", c["bytes"]) for c in quantized)},
        "variables": variable_sites(nodes, index, program.variables),
        "regions": {},
        "profile": profile,
        "qerror": qerror,
    }
    for device in DEVICES:
        kg = fusion.kernel_groups(program, device)
        kg["groups"] = [{**g, "nodes": [index[i] for i in g["nodes"]]} for g in kg["groups"]]
        data["regions"][device] = kg
    if previews:
        data["previews"] = {index[n.id]: stats.preview(program, n, nodes) for n in nodes if n.op == Op.CONSTANT}
    return data


def variable_sites(nodes: list[Node], index: dict[int, int], initial: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """For each variable: the node that creates it, the assigns that set it, the ops that write it in
    place, and the ops that read it (directly or through a view or in-place write of it)."""
    base: dict[int, Node] = {}
    for n in nodes:
        base[n.id] = base[n.src[0].id] if n.src and (n.op in (Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_TO, Op.ARRAY_VIEW,
                                                               Op.SLICE) or n.attrs.get("inplace")) else n
    out: dict[str, Any] = {}
    for n in nodes:
        if n.op == Op.VARIABLE:
            out[n.attrs["name"]] = {"node": index[n.id], "type": repr(n.type), "assigned": [], "written": [], "read": []}
            value = (initial or {}).get(n.attrs["name"])
            if value is not None:
                v = np.asarray(value)
                out[n.attrs["name"]]["initial"] = "zeros" if not v.any() else \
                    f"values {float(v.min()):.4g} .. {float(v.max()):.4g}" if v.dtype.kind in "fiub" else "values"
    for n in nodes:
        for pos, s in enumerate(n.src):
            root = base[s.id]
            if root.op != Op.VARIABLE:
                continue
            site = out[root.attrs["name"]]
            i = index[n.id]
            if n.op == Op.ASSIGN:
                if pos == 0:
                    site["assigned"].append(i)
                continue
            if base[n.id] is root and n.op == Op.SLICE_UPDATE:
                if i not in site["written"]:
                    site["written"].append(i)
                continue
            if base[n.id] is root:
                continue  # a view of the variable: its readers are listed instead
            if i not in site["read"]:
                site["read"].append(i)
    return out


__all__ = ["export", "find_blocks", "variable_sites"]
