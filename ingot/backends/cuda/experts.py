"""The CUDA lowerings of mixture-of-experts routing (ops/moe.py), so a routed feed-forward runs on the
device with no host sync: top_k and take_along_axis as torch ops, gather_matmul over float experts as
a batched matmul of the chosen experts, and quantized_gather_matmul through `_expert_gemv_kernel`
(quantized_matmul/experts.py) over the experts re-packed once at load (affine 4/8-bit, lookup tables,
and GGUF's scaled tables: IQ4_NL/IQ4_XS, MXFP4). Registered by importing this
module (backends/cuda/__init__.py)."""
from __future__ import annotations

import numpy as np
import torch

from ...ir import Op
from .device import _cached
from .lowerings import Lowering, StepFn, host_reference, lowering
from .quantized_matmul.experts import expert_matmul, prepare_experts


@lowering(Op.TOP_K)
def _top_k(ctx: Lowering) -> StepFn:
    k = ctx.node.attrs["k"]
    # a stable sort of -x: the k largest, ties to the lower index first, as the reference
    return lambda x: torch.argsort(-x.float(), dim=-1, stable=True)[..., :k].to(torch.int32)


@lowering(Op.TAKE_ALONG_AXIS)
def _take_along_axis(ctx: Lowering) -> StepFn:
    axis = ctx.node.attrs["axis"]
    n = ctx.node.src[0].type.shape[axis]

    def take(x, idx):   # negative indices wrap as NumPy's; out-of-range ones are clamped (no host check)
        i = idx.long()
        i = torch.where(i < 0, i + x.shape[axis], i).clamp(0, max((n or x.shape[axis]) - 1, 0))
        return torch.gather(x, axis, i)
    return take


@lowering(Op.GATHER_MATMUL)
def _gather_matmul(ctx: Lowering) -> StepFn:
    def gather_matmul(x, w, idx):   # x [T, S, K] @ w[idx] [T, J, K, N] -> [T, J, N]
        chosen = w[idx.long().clamp(0, w.shape[0] - 1)]
        rows = x.unsqueeze(2) if x.shape[1] == idx.shape[1] else x.unsqueeze(1).expand(-1, idx.shape[1], -1, -1)
        return torch.matmul(rows.float(), chosen.float()).squeeze(2).to(x.dtype)
    return gather_matmul


@lowering(Op.QUANTIZED_GATHER_MATMUL)
def _quantized_gather_matmul(ctx: Lowering) -> StepFn:
    node = ctx.node
    arrays = [ctx.constant(i) for i in range(2, len(node.src))]
    if any(a is None for a in arrays):
        return host_reference(ctx)   # experts computed at run time
    attrs = node.attrs
    key = ("qexperts", str(ctx.device), attrs["mode"], attrs["qdtype"].name, bool(attrs.get("has_zero_point")),
           bool(attrs.get("has_bias"))) + tuple(id(a) for a in arrays[1:])
    weights = _cached(arrays[0], key, lambda: prepare_experts(np.asarray(arrays[0]), [np.asarray(a) for a in arrays[1:]],
                                                               attrs, ctx.device))
    ctx.reads = (0, 1)   # x and the choices: the experts live re-packed on the device
    return lambda x, idx: expert_matmul(x, idx, weights)
