"""The op table: one entry per op with its type rule and its NumPy reference.

`infer_type(op, input_types, attrs)` is the shape and dtype rule; `reference(op, inputs, attrs)`
computes the op in NumPy and is the executable definition of the IR (the CPU backend's default
lowering). Each group of ops lives in its own module and registers itself with `register`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import IngotError
from ..ir import Dim, Op, Ref, TensorType

TypeRule = Callable[[Sequence[TensorType], dict[str, Any]], Any]
Reference = Callable[[Sequence[np.ndarray], dict[str, Any]], Any]


@dataclass(frozen=True)
class OpDef:
    op: Op
    type_rule: TypeRule
    reference: Reference


REGISTRY: dict[Op, OpDef] = {}


def register(op: Op, type_rule: TypeRule, reference: Reference) -> None:
    REGISTRY[op] = OpDef(op, type_rule, reference)


def infer_type(op: Op, types: Sequence[TensorType], attrs: dict[str, Any]):
    return REGISTRY[op].type_rule(types, attrs)


def reference(op: Op, inputs: Sequence[np.ndarray], attrs: dict[str, Any]):
    return REGISTRY[op].reference(inputs, attrs)


# -- helpers shared by the rule modules ---------------------------------------------------------

def fail(op: Op | str, types: Sequence[TensorType], expected: str) -> IngotError:
    name = op.name.lower() if isinstance(op, Op) else op
    got = ", ".join(repr(t) for t in types)
    return IngotError(f"{name}: got inputs ({got}); expected {expected}.")


def broadcast_dims(a: Dim, b: Dim) -> Dim:
    if a == 1:
        return b
    if b == 1:
        return a
    if a is None or b is None:
        return a if b is None else b
    if a != b:
        raise ValueError
    return a


def broadcast_shapes(op: Op, types: Sequence[TensorType], inputs: Sequence[TensorType] | None = None,
                     what: str = "shapes") -> tuple[Dim, ...]:
    """NumPy broadcasting of types' shapes. `inputs`: the op's own input types, for the error message
    when `types` are parts of them (batch dims of a matmul, a mask against the scores)."""
    rank = max(t.rank for t in types)
    out: list[Dim] = [1] * rank
    try:
        for t in types:
            padded = (1,) * (rank - t.rank) + t.shape
            out = [broadcast_dims(a, b) for a, b in zip(out, padded)]
    except ValueError:
        shown = "" if inputs is None else f" ({', '.join(str(tuple(t.shape)) for t in types)})"
        raise fail(op, inputs or types, f"{what} that broadcast together (NumPy rules){shown}") from None
    return tuple(out)


def normalize_axis(op: Op | str, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise IngotError(f"{op.name.lower() if isinstance(op, Op) else op}: axis {axis} is out of range for rank {rank}.")
    return axis % max(rank, 1)


def resolve(value: Any, inputs: Sequence[np.ndarray]) -> Any:
    """An attribute value with any Ref replaced by the runtime scalar it points at."""
    if isinstance(value, Ref):
        return int(np.asarray(inputs[value.index]).reshape(()))
    if isinstance(value, (tuple, list)):
        return type(value)(resolve(v, inputs) for v in value)
    return value


def compute_dtype(x: np.ndarray) -> np.dtype:
    """float16 and bfloat16 are computed in float32 by the references."""
    return np.dtype(np.float32) if x.dtype.kind == "V" or x.dtype in (np.float16,) or x.dtype.name == "bfloat16" else x.dtype


from . import elementwise, reduce, shape, nn, quant, fft, control, meta, fused, conv, moe, recurrent, image, collective, pool, layout  # noqa: E402,F401  (registration)
