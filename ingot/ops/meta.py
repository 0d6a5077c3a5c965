"""Ops about tensors rather than their values: dim (the length of one axis, as an int32 scalar)."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import fail, register


def _dim_rule(types, attrs):
    (x,) = types
    if not 0 <= attrs["axis"] < x.rank:
        raise fail(Op.DIM, types, f"an axis within rank {x.rank}")
    return TensorType((), dt.int32)


register(Op.DIM, _dim_rule, lambda xs, a: np.int32(xs[0].shape[a["axis"]]))
