"""Tensor parallelism, Megatron style: each rank holds a slice of every big weight and the graph
gains the collectives that make the slices add up to the whole model.

Sharding is done in two steps, as gpt-fast's tp.py does it, because the head counts are baked into
many shapes (the q/k/v reshapes, the KV-cache variables, the attention) that a rewrite of the finished
graph would have to find and change one by one:

1. `shard_weights` (before the graph is built) slices the weights and narrows the config: q/k/v by
   whole KV-head groups (column-parallel), o by the same heads' columns (row-parallel), gate/up by
   FFN rows, down by FFN columns, the embedding and the head by vocabulary rows. The builder, given
   the narrowed config, makes the rank's graph with its own heads, its own KV cache and its own FFN
   slice. Quantized weights are sliced as stored (packed bytes, scales per block): a split that
   does not fall on a block (or packed byte) boundary is refused, so nothing is ever repacked.
2. `insert_collectives` (the pass, over the built graph) finds the matmuls by the weights they
   multiply and adds what the slices need: all_reduce after o and down (row-parallel partial sums),
   all_reduce of the masked embedding lookup (each rank looks up its own vocabulary rows), and
   all_gather of the head's logits along the vocabulary.

`collective_chain` checks that the collectives form one chain of data dependences (so every rank
issues them in the same order, whatever order its plan runs the rest); models/tensor_parallel.py
runs the pass on a built decoder (shard_decoder, build_sharded) with these checks and the verifier. The KV heads are spread as evenly as they go (3 KV heads over 2 ranks: 2 and 1,
each with its query heads), so SmolLM2's 9/3 heads run on 2 ranks; the FFN and the vocabulary must
divide by the world size (all_gather takes equal parts).

    >>> cfg = llama.LlamaConfig(2, 64, 4, 2, 128, 256)                          # doctest: +SKIP
    >>> local_cfg, local = shard_weights(cfg, llama.random_weights(cfg), world=2, rank=1)   # doctest: +SKIP
    >>> model = models.tensor_parallel.shard_decoder(llama.build(local_cfg, local), world=2, rank=1)  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import GroupOp, Node, Op, Program, TensorType
from ..ops import infer_type
from ..quant.formats import QuantizedTensor, concat_columns
from . import Context, graph_rewrite

FAMILIES = ("llama", "qwen3")   # whose graphs name their weights as blocks.py does (GGUF names)

# weight suffix -> (which split, "out" rows of the [out, in] weight, "in" columns, or "vector")
SPLITS: dict[str, tuple[str, str]] = {
    "attn_q.weight": ("q_heads", "out"), "attn_k.weight": ("kv_heads", "out"), "attn_v.weight": ("kv_heads", "out"),
    "attn_q.bias": ("q_heads", "vector"), "attn_k.bias": ("kv_heads", "vector"), "attn_v.bias": ("kv_heads", "vector"),
    "attn_output.weight": ("q_heads", "in"),
    "ffn_gate.weight": ("ffn", "out"), "ffn_up.weight": ("ffn", "out"), "ffn_down.weight": ("ffn", "in"),
    "token_embd.weight": ("vocab", "out"), "output.weight": ("vocab", "out"),
}
ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight")   # their matmuls give partial sums: all_reduce
HEADS = ("output.weight", "token_embd.weight")              # a matmul by these gives a vocabulary slice


# -- the plan: which slice of each dimension a rank holds -------------------------------------------

def even_parts(total: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's share of `total` units, the first total % world ranks one more."""
    base, extra = divmod(total, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The ranges of rank `rank` out of `world`: KV heads (query heads follow their group), FFN rows,
    vocabulary rows; each in units of the full model."""
    world: int
    rank: int
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    def rows(self, split: str) -> tuple[int, int]:
        """[start, stop) along the split dimension, in rows/columns of the weights."""
        if split in ("q_heads", "kv_heads"):
            a, b = getattr(self, split)
            return a * self.head_dim, b * self.head_dim
        return getattr(self, split)


def check_tensor_parallel(cfg, world) -> None:
    """One IngotError sentence unless `cfg`'s decoder splits over `world` ranks (checked before any
    process starts): a whole number >= 1, at most the KV heads, dividing the FFN and the vocabulary."""
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise IngotError(f"tensor parallel: the number of ranks must be a whole number >= 1, not {world!r}.")
    family = getattr(cfg, "family", "")
    if world > 1 and family not in FAMILIES:
        raise IngotError(f"tensor parallel: the {family or 'unknown'} family is not supported "
                         f"(supported: {', '.join(FAMILIES)}).")
    if world > 1 and cfg.extra.get("experts"):
        raise IngotError("tensor parallel: mixture-of-experts models are not supported.")
    bad = [f"{what} {n}" for what, n, ok in (
        ("KV heads", cfg.n_kv_heads, cfg.n_kv_heads >= world), ("FFN width", cfg.ffn_dim, cfg.ffn_dim % world == 0),
        ("vocabulary", cfg.vocab_size, cfg.vocab_size % world == 0)) if not ok]
    if bad:
        raise IngotError(f"tensor parallel over {world} ranks needs at least {world} KV heads and an FFN width and "
                         f"vocabulary that {world} divides; this model has {', '.join(bad)}.")


def plan(cfg, world: int, rank: int) -> ShardPlan:
    check_tensor_parallel(cfg, world)
    if not 0 <= rank < world:
        raise IngotError(f"tensor parallel: rank {rank} is not in 0..{world - 1}.")
    kv = even_parts(cfg.n_kv_heads, world)[rank]
    group = cfg.n_heads // cfg.n_kv_heads
    return ShardPlan(world, rank, kv, (kv[0] * group, kv[1] * group), even_parts(cfg.ffn_dim, world)[rank],
                     even_parts(cfg.vocab_size, world)[rank], cfg.head_dim)


def local_config(cfg, p: ShardPlan):
    """cfg narrowed to rank p's heads, FFN rows and vocabulary (head_dim, dim and the rest unchanged)."""
    return dataclasses.replace(cfg, n_heads=p.q_heads[1] - p.q_heads[0], n_kv_heads=p.kv_heads[1] - p.kv_heads[0],
                               ffn_dim=p.ffn[1] - p.ffn[0], vocab_size=p.vocab[1] - p.vocab[0], head_dim=cfg.head_dim,
                               rope_dims=cfg.rope_dims)


# -- slicing the weights as stored -------------------------------------------------------------------

def _on_boundary(name: str, axis: int, start: int, stop: int, unit: int, units: str) -> None:
    if start % unit or stop % unit:
        raise IngotError(f"tensor parallel: tensor {name} splits its {'rows' if axis == 0 else 'columns'} at "
                         f"{start}..{stop}, which is not on a boundary of its {units} ({unit} wide); nothing is repacked.")


def slice_quantized(w: QuantizedTensor, axis: int, start: int, stop: int, name: str) -> QuantizedTensor:
    """Rows (axis 0) or columns (axis 1) start..stop of a quantized tensor, cut from its stored
    bytes and block parameters: exact, or an IngotError naming the tensor when the cut is not on a
    block (or packed byte, or lookup-table group) boundary."""
    shape = list(w.shape)
    if axis == w.block_axis:
        _on_boundary(name, axis, start, stop, w.block_size, "quantization blocks")
    packed = w.qdtype.packed and axis == 1
    if packed:
        _on_boundary(name, axis, start, stop, 2, "bytes of two 4-bit values")

    def cut(array, unit):
        if array is None:
            return None
        index = [slice(None)] * array.ndim
        index[axis] = slice(start // unit, stop // unit)
        return np.ascontiguousarray(array[tuple(index)])

    param_unit = w.block_size if axis == w.block_axis else 1
    lut = w.lut
    if lut is not None and lut.shape[axis] > 1:
        per = shape[axis] // lut.shape[axis]
        _on_boundary(name, axis, start, stop, per, "lookup-table groups")
        lut = cut(lut, per)
    shape[axis] = stop - start
    return dataclasses.replace(w, q=cut(w.q, 2 if packed else 1), shape=tuple(shape), scale=cut(w.scale, param_unit),
                               bias=cut(w.bias, param_unit), zero_point=cut(w.zero_point, param_unit), lut=lut)


def slice_weight(w, side: str, start: int, stop: int, name: str):
    """The [out, in] weight's rows ("out") or columns ("in") start..stop, or a vector's elements,
    whatever its storage: a float/bf16 array [out, in], a QuantizedTensor in GGUF form [out, in] or
    k-major [in, out]."""
    if side == "vector":
        return np.ascontiguousarray(np.asarray(w)[start:stop])
    if isinstance(w, QuantizedTensor):
        out_axis = 0 if w.block_axis == 1 else 1
        return slice_quantized(w, out_axis if side == "out" else 1 - out_axis, start, stop, name)
    array = np.asarray(w)
    return np.ascontiguousarray(array[start:stop] if side == "out" else array[:, start:stop])


class ShardedTensors(Mapping):
    """A rank's view of a model's tensors: each big weight sliced when it is read (lazily, so a
    rank holds only its slices once the full tensor is dropped), the rest as they are."""

    def __init__(self, cfg, tensors: Mapping, p: ShardPlan):
        self.cfg, self.tensors, self.plan = cfg, tensors, p

    def __getitem__(self, name: str):
        full = self.tensors[name]
        if "+" in name:   # an Ingot package's side-by-side weights (k-major q|k|v, gate|up): each part cut
            return self._fused(name, full)
        rule = SPLITS.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if rule is None:
            return full
        split, side = rule
        return slice_weight(full, side, *self.plan.rows(split), name)

    def _fused(self, name: str, full):
        parts = name.split("+")
        rules = [SPLITS.get(part.split(".", 2)[-1]) for part in parts]
        if not isinstance(full, QuantizedTensor) or full.block_axis != 0 or any(r is None or r[1] != "out" for r in rules):
            raise IngotError(f"tensor parallel: tensor {name} is not a k-major quantized side-by-side weight of "
                             f"column-parallel parts; it cannot be split.")
        width = {"q_heads": self.cfg.n_heads * self.cfg.head_dim, "kv_heads": self.cfg.n_kv_heads * self.cfg.head_dim,
                 "ffn": self.cfg.ffn_dim}
        pieces, at = [], 0
        for part, (split, _) in zip(parts, rules):
            start, stop = self.plan.rows(split)
            pieces.append(slice_quantized(full, 1, at + start, at + stop, name))
            at += width[split]
        if at != full.shape[1]:
            raise IngotError(f"tensor parallel: tensor {name} has {full.shape[1]} columns, expected {at}.")
        return concat_columns(pieces)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name) -> bool:
        return name in self.tensors


def shard_weights(cfg, tensors: Mapping, world: int, rank: int):
    """(rank's config, rank's tensors) for a decoder split over `world` ranks (see the module doc)."""
    p = plan(cfg, world, rank)
    return local_config(cfg, p), ShardedTensors(cfg, tensors, p)


# -- the pass: collectives where the slices meet --------------------------------------------------------

def weight_name(node: Node) -> str:
    """The name of the constant a matmul's or gather's weight operand is made from ("" if none)."""
    while node.op in (Op.DEQUANTIZE, Op.CAST) and node.src:
        node = node.src[0]
    return (node.name or "") if node.op == Op.CONSTANT else ""


def _node(op: Op, src: tuple[Node, ...], attrs: dict[str, Any] | None = None, name: str | None = None) -> Node:
    attrs = attrs or {}
    return Node(op, infer_type(op, [s.type for s in src], attrs), src, attrs, name)


def _scalar(program: Program, key: str, value: int) -> Node:
    program.constants[key] = np.array(value, np.int32)
    return Node(Op.CONSTANT, TensorType((), dt.int32), (), {"key": key}, key)


def insert_collectives(program: Program, world: int, rank: int) -> tuple[Program, bool]:
    """Add the collectives a rank's graph (built from `shard_weights`' config and tensors) needs:
    all_reduce after each row-parallel matmul (o, down), all_gather of the head's logits, and the
    vocabulary-parallel embedding (look up own rows, zero the others, all_reduce). Returns
    (program, changed)."""
    program = program.with_roots(program.outputs, program.assigns)
    program.constants = dict(program.constants)

    def matmul(node: Node, ctx: Context) -> Node | None:
        name = weight_name(node.src[1])
        if name.endswith(ROW_PARALLEL):
            return _node(Op.ALL_REDUCE, (node,), {"world": world, "reduce": "sum"})
        if name in HEADS:
            return _node(Op.ALL_GATHER, (node,), {"world": world, "axis": node.type.rank - 1})
        return None

    def gather(node: Node, ctx: Context) -> Node | None:
        table, index = node.src
        if weight_name(table) != "token_embd.weight" or node.attrs.get("axis") != 1 or table.type.rank != 2:
            return None
        rows = table.type.shape[1]                                   # this rank's vocabulary rows
        start = _scalar(ctx.program, f"shard.{node.id}.vocab_start", rank * rows)
        size = _scalar(ctx.program, f"shard.{node.id}.vocab_rows", rows)
        zero = _scalar(ctx.program, f"shard.{node.id}.zero", 0)
        local = _node(Op.SUB, (index, start))
        inside = _node(Op.LOGICAL_AND, (_node(Op.GREATER_EQUAL, (local, zero)), _node(Op.LESS, (local, size))))
        looked_up = node.replace(src=(table, _node(Op.WHERE, (inside, local, zero))))      # [dim, T]
        masked = _node(Op.MUL, (looked_up, _node(Op.CAST, (inside,), {"dtype": node.dtype})))
        return _node(Op.ALL_REDUCE, (masked,), {"world": world, "reduce": "sum"})

    return graph_rewrite(program, [((Op.MATMUL,), matmul), ((Op.GATHER,), gather)], "shard")


def collective_chain(program: Program) -> list[Node]:
    """The collectives in the order every rank runs them; IngotError unless each depends on the one
    before (then no plan order of the rest can make two ranks disagree on which comes next)."""
    seen: dict[int, int] = {}
    chain: list[Node] = []
    for node in program.nodes():
        depth = max((seen[s.id] for s in node.src), default=0)
        if node.op in GroupOp.Collective:
            if depth != len(chain):
                raise IngotError(f"tensor parallel: {node.op.name.lower()} #{node.id} does not follow the collective "
                                 f"before it; ranks could run them in different orders.")
            chain.append(node)
            depth += 1
        seen[node.id] = depth
    return chain


# -- the oracle: every rank's program evaluated in lock step with the NumPy references ---------------------

def evaluate_ranks(programs: list[Program], feeds: dict[str, Any], variables: list[dict] | None = None) -> list[list]:
    """Each rank's outputs, computing every rank's program with the references and each collective
    with `reference_ranks` over all ranks' inputs: the oracle the sharding pass is tested against,
    no process group needed."""
    from ..ops import reference
    from ..ops.collective import reference_ranks

    def run(program: Program, state: dict):
        values: dict[int, Any] = {}
        for node in program.nodes():
            if node.op == Op.PLACEHOLDER:
                values[node.id] = np.asarray(feeds[node.name])
            elif node.op == Op.CONSTANT:
                values[node.id] = program.constants[node.attrs["key"]]
            elif node.op == Op.VARIABLE:
                values[node.id] = state[node.attrs["name"]]
            elif node.op == Op.ASSIGN:
                values[node.id] = values[node.src[1].id]
            elif node.op in GroupOp.Collective:
                values[node.id] = yield node, values[node.src[0].id]
            else:
                values[node.id] = reference(node.op, [values[s.id] for s in node.src], node.attrs)
        return [values[n.id] for n in program.outputs]

    runs = [run(p, (variables or [p.variables for p in programs])[r]) for r, p in enumerate(programs)]
    results: list[list | None] = [None] * len(runs)

    def advance(r: int, value) -> tuple[Node, Any] | None:
        try:
            return runs[r].send(value)
        except StopIteration as done:
            results[r] = done.value
            return None

    pending = [advance(r, None) for r in range(len(runs))]
    while any(p is not None for p in pending):
        if any(p is None for p in pending) or len({(n.op, freeze_attrs(n)) for n, _ in pending}) != 1:
            raise IngotError("evaluate_ranks: the ranks reached different collectives.")
        outs = reference_ranks(pending[0][0].op, [x for _, x in pending], pending[0][0].attrs)
        pending = [advance(r, outs[r]) for r in range(len(runs))]
    return results


def freeze_attrs(node: Node) -> tuple:
    return tuple(sorted(node.attrs.items()))


__all__ = ["ShardPlan", "ShardedTensors", "check_tensor_parallel", "collective_chain", "evaluate_ranks",
           "insert_collectives", "plan", "shard_weights", "slice_quantized", "slice_weight"]
