"""all_reduce and all_gather on the CPU: torch.distributed collectives (gloo) on the current process
group, through ingot.distributed. A world of 1 needs no group: a copy. torch is imported only by a
plan that holds a collective over more than one rank."""
from __future__ import annotations

import numpy as np

from ...ir import Node, Op
from . import lowering


@lowering(Op.ALL_REDUCE)
def _all_reduce(node: Node, out):
    from ... import distributed

    ranks = node.attrs["world"]
    if ranks == 1:
        return lambda x: np.array(x, copy=True)
    distributed.group_of(ranks, "all_reduce")   # refused when the plan is made, not at the first token
    return lambda x: distributed.all_reduce(x, ranks)


@lowering(Op.ALL_GATHER)
def _all_gather(node: Node, out):
    from ... import distributed

    ranks, axis = node.attrs["world"], node.attrs["axis"] % node.type.rank
    if ranks == 1:
        return lambda x: np.array(x, copy=True)
    distributed.group_of(ranks, "all_gather")
    return lambda x: distributed.all_gather(x, ranks, axis)
