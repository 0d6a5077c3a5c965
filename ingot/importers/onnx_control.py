"""ONNX control flow: If, folded at import. Its condition must be known then (a constant, shape
arithmetic, or computed from inputs fixed with constant_inputs=, which from_onnx does per value at
run for a small input such as a sample rate); the chosen branch is converted into the graph and
the other is never read. An If whose condition depends on a tensor's data is refused."""
from __future__ import annotations

import numpy as np

from .onnx_ops import Context, NeedsConstant, OnnxNode, converter, placeholders_of


@converter("If")
def _if(ctx: Context, node: OnnxNode):
    cond = node.input(0)
    value = ctx.value(cond)
    if value is None:
        sources = placeholders_of(cond)
        raise NeedsConstant(f"{ctx.what}: {node.label}: Ingot folds If at import, so its condition must be known then, but "
                            f"it is computed at run time{f' from graph inputs {sources} (fix them with constant_inputs=)' if sources else ''}.",
                            sources)
    if np.size(value) != 1:
        raise ctx.fail(node, f"a condition of {np.size(value)} values (ONNX requires one)")
    branch = node.attr("then_branch") if bool(np.asarray(value).reshape(-1)[0]) else node.attr("else_branch")
    outs = ctx.import_subgraph(branch, ctx.scope)
    if len(outs) != len(node.outputs):
        raise ctx.fail(node, f"a branch with {len(outs)} outputs for {len(node.outputs)} node outputs")
    return outs
