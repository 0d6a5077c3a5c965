"""Collectives over the ranks of a process group (tensor parallelism, ingot/passes/shard.py).

    all_reduce(x)             attrs world, reduce="sum"   -> x's type: the sum of every rank's x
    all_gather(x)             attrs world, axis           -> x's type with shape[axis] * world: the
                                                             ranks' x side by side, rank 0 first

`world` is part of the op, so a rank's graph says how many ranks it was sharded for and its types
are static. The reference of one rank (the IR's executable definition, `reference`) exists for a
world of 1 only; `reference_ranks` is the definition for any world: it takes every rank's input
and returns every rank's output. Backends lower these to torch.distributed collectives on the
current process group (gloo on the CPU, NCCL on CUDA).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Op, TensorType
from . import fail, normalize_axis, register

REDUCTIONS = ("sum",)
MAX_WORLD = 1 << 16
# dtypes a collective carries: what torch.distributed's gloo and NCCL reduce (bf16 is widened on the CPU)
DTYPES = frozenset({dt.float32, dt.float16, dt.bfloat16, dt.int32, dt.int64})


def _world(op: Op, types, attrs) -> int:
    world = attrs.get("world")
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or not 1 <= world <= MAX_WORLD:
        raise fail(op, types, f"attribute world, a whole number of ranks in 1..{MAX_WORLD}, not {world!r}")
    return int(world)


def _checked_input(op: Op, types, attrs) -> TensorType:
    _world(op, types, attrs)
    if len(types) != 1 or not isinstance(types[0], TensorType) or types[0].dtype not in DTYPES:
        raise fail(op, types, f"one tensor of {', '.join(sorted(d.name for d in DTYPES))}")
    return types[0]


def _all_reduce_rule(types, attrs) -> TensorType:
    x = _checked_input(Op.ALL_REDUCE, types, attrs)
    if attrs.get("reduce", "sum") not in REDUCTIONS:
        raise fail(Op.ALL_REDUCE, types, f"reduce one of {REDUCTIONS}, not {attrs.get('reduce')!r}")
    return x


def _all_gather_rule(types, attrs) -> TensorType:
    x = _checked_input(Op.ALL_GATHER, types, attrs)
    if x.rank == 0:
        raise fail(Op.ALL_GATHER, types, "a tensor of rank >= 1 to gather along an axis")
    axis = normalize_axis(Op.ALL_GATHER, attrs.get("axis", 0), x.rank)
    shape = list(x.shape)
    shape[axis] = None if shape[axis] is None else shape[axis] * attrs["world"]
    return TensorType(shape, x.dtype)


def _one_rank(op: Op):
    def reference(xs, attrs):
        if attrs["world"] != 1:
            raise IngotError(f"{op.name.lower()}: over {attrs['world']} ranks it needs the other ranks' inputs; run it "
                             f"under torch.distributed (ingot.distributed) or through reference_ranks.")
        return np.array(xs[0], copy=True)
    return reference


register(Op.ALL_REDUCE, _all_reduce_rule, _one_rank(Op.ALL_REDUCE))
register(Op.ALL_GATHER, _all_gather_rule, _one_rank(Op.ALL_GATHER))


def reference_ranks(op: Op, inputs: Sequence[np.ndarray], attrs: dict) -> list[np.ndarray]:
    """Every rank's output from every rank's input (inputs[r]: rank r's x), in NumPy.

        >>> [y.tolist() for y in reference_ranks(Op.ALL_GATHER, [np.ones(2), np.zeros(2)], {"world": 2, "axis": 0})]
        [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    """
    if len(inputs) != attrs["world"]:
        raise IngotError(f"{op.name.lower()}: {len(inputs)} inputs for a world of {attrs['world']} ranks.")
    xs = [np.asarray(x) for x in inputs]
    if any(x.shape != xs[0].shape or x.dtype != xs[0].dtype for x in xs):
        raise IngotError(f"{op.name.lower()}: the ranks' inputs differ in shape or dtype: "
                         f"{', '.join(f'{x.dtype}{list(x.shape)}' for x in xs)}.")
    if op == Op.ALL_REDUCE:
        wide = np.float32 if xs[0].dtype.kind in "fV" else xs[0].dtype   # bf16/f16 summed in float32
        total = np.sum(np.stack([x.astype(wide) for x in xs]), axis=0).astype(xs[0].dtype)
        return [total.copy() for _ in xs]
    if op == Op.ALL_GATHER:
        out = np.concatenate(xs, axis=normalize_axis(op, attrs.get("axis", 0), xs[0].ndim))
        return [out.copy() for _ in xs]
    raise IngotError(f"reference_ranks: {op.name.lower()} is not a collective.")
