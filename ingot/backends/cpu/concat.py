"""Concat into its planned buffer: each input copied into its slot unless it already lies there (the
memory plan had its producer write straight into the slot: passes/memory_plan.py), so a YOLO C2f block's
concat copies nothing."""
from __future__ import annotations

import numpy as np

from ...ir import Node


def concat_lowering(node: Node, out: np.ndarray | None):
    axis = node.attrs["axis"]
    if out is None or not node.type.static:
        return lambda *xs: np.concatenate(xs, axis=axis)
    axis %= node.type.rank
    slots, at = [], 0
    for s in node.src:
        slots.append(out[(slice(None),) * axis + (slice(at, at + s.type.shape[axis]),)])
        at += s.type.shape[axis]
    addresses = [slot.ctypes.data if slot.flags.c_contiguous else None for slot in slots]
    placed: list = [None] * len(slots)   # per slot, the array last found in it (a planned producer's own)

    def step(*xs):
        for k, x in enumerate(xs):
            if x is placed[k]:
                continue
            if addresses[k] is not None and x.flags.c_contiguous and x.ctypes.data == addresses[k] and \
                    x.shape == slots[k].shape and x.dtype == slots[k].dtype:
                placed[k] = x
            else:
                np.copyto(slots[k], x)
        return out
    return step
