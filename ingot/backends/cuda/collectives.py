"""all_reduce and all_gather on CUDA: NCCL collectives on the current torch.distributed group, on
the plan's stream, so a rank's decode step (collectives included) is captured as one CUDA graph.
(Under INGOT_CUDA_DEVICE=cpu the same steps run gloo collectives on CPU tensors.)"""
from __future__ import annotations

import torch

from ...ir import Op
from .lowerings import Lowering, StepFn, lowering


@lowering(Op.ALL_REDUCE)
def _all_reduce(ctx: Lowering) -> StepFn:
    from ... import distributed

    ranks = ctx.node.attrs["world"]
    if ranks == 1:
        return lambda x: x.clone()
    dist = distributed.group_of(ranks, "all_reduce")

    def step(x):
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y)
        return y
    return step


@lowering(Op.ALL_GATHER)
def _all_gather(ctx: Lowering) -> StepFn:
    from ... import distributed

    node = ctx.node
    ranks, axis = node.attrs["world"], node.attrs["axis"] % node.type.rank
    shape = tuple(node.type.shape)
    if ranks == 1:
        return lambda x: x.clone()
    dist = distributed.group_of(ranks, "all_gather")
    into_tensor = dist.get_backend() == "nccl"   # one NCCL call into one buffer; gloo takes a list

    def step(x):
        x = x.contiguous()
        if into_tensor:
            stacked = torch.empty((ranks, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(stacked, x)
            return stacked.movedim(0, axis).reshape(shape)   # [.., rank, part, ..] -> [.., rank * part, ..]
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=axis)
    return step
