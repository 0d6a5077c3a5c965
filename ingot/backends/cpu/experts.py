"""quantized_gather_matmul on the CPU: each chosen expert's rows through the quantized_matmul kernel
of its packed weight (GEMV for a decode step, tiled GEMM for a prompt), never a float copy of the
experts. The tokens are grouped by expert (ops.moe.routed_matmul), so an expert no token chose
costs nothing."""
from __future__ import annotations

from typing import Callable

from ...ir import Node, Op, TensorType
from ...ops.moe import expert_params, routed_matmul


def quantized_gather_matmul_step(node: Node, matmul_step_for: Callable[[Node], Callable]) -> Callable:
    """The step for `node`; matmul_step_for(a quantized_matmul node) gives the CPU's step for one
    expert's [K, N] weight (the same kernels, chosen by the same attributes)."""
    n = node.type.shape[-1]
    expert_node = Node(Op.QUANTIZED_MATMUL, TensorType((None, n), node.dtype), (), dict(node.attrs, transpose=False))
    matmul = matmul_step_for(expert_node)
    # per weight: (the weight, [(q[e], params of e)]): views made once and kept, so the kernel's
    # preparation (cached by the identity of what it is given) is done once per expert
    views: dict[int, tuple] = {}

    def step(x, idx, q, *params):
        hit = views.get(id(q))
        if hit is None or hit[0] is not q:
            hit = views[id(q)] = (q, [(q[e], expert_params(params, e)) for e in range(q.shape[0])])
        experts = hit[1]

        def expert(e: int, rows):
            qe, pe = experts[e]
            return matmul(rows, qe, *pe)
        return routed_matmul(x, idx, q.shape[0], expert)
    return step
