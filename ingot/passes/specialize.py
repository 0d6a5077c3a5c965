"""Give placeholders the concrete types of the feeds; the driver re-infers every type downstream."""
from __future__ import annotations

from ..errors import IngotError
from ..ir import Op, Program, TensorType
from . import graph_rewrite


def specialize(program: Program, feed_types: dict[str, TensorType]) -> tuple[Program, bool]:
    """Give each placeholder named in feed_types that type and re-infer every type downstream."""
    def rule(node, ctx):
        want = feed_types.get(node.name)
        if want is None or want == node.type:
            if not node.type.static and want is None:
                raise IngotError(f"compile: placeholder {node.name!r} has dynamic shape {node.type}; give its type in feeds.")
            return None
        declared = node.type
        if declared.dtype != want.dtype or declared.rank != want.rank or any(
                d is not None and d != w for d, w in zip(declared.shape, want.shape)) or not want.static:
            raise IngotError(f"compile: feed {node.name!r} of type {want} does not fit the placeholder's {declared}.")
        return node.replace(type=want)

    return graph_rewrite(program, [((Op.PLACEHOLDER,), rule)], "specialize")
