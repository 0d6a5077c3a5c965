"""Memory plan: one buffer per intermediate, reused once its value (and every view of it) is dead.

Sources, views, in-place updates, call results, outputs, assigned values and the float32 cast of a
bf16 weight (see fold.widens_weight) get no planned buffer:
they alias memory the runtime already owns or hand memory to the caller, so an output is never a
buffer the next run overwrites.

An elementwise op whose input has the op's own shape and dtype and dies at that op writes over the
input's buffer: a fused region (a chain of elementwise ops, each the only reader of the one before)
runs in a single buffer. A backend that lowers an elementwise op with an output buffer must accept
that buffer being one of the inputs (NumPy ufuncs do).
"""
from __future__ import annotations

from ..ir import GroupOp, Node, Op, Program, TensorType
from .fold import widens_weight


def _planned(node: Node, keep: set[int]) -> bool:
    # a bf16 weight's cast to float32 is a load-time value (CPU) or never made (CUDA): no buffer
    return (node.op not in GroupOp.Source and not widens_weight(node) and node.op not in GroupOp.View and node.op not in (Op.CALL, Op.IF, Op.GET_ITEM, Op.ASSIGN, Op.FUSED)
            and not node.attrs.get("inplace") and node.id not in keep and isinstance(node.type, TensorType) and node.type.static)


OVERSIZE = 4  # a value never takes a free buffer more than this many times its size


def _take(free: list[int], sizes: list[int], nbytes: int) -> int:
    """The free buffer that fits best (the smallest big enough, else the biggest smaller one, grown),
    or a new one. A buffer over OVERSIZE times too big is left free: a small value that lives long
    (one chunk's result of many, waiting for a concat) would pin it, and the next big temporary
    would need a new one."""
    candidates = [b for b in free if sizes[b] <= OVERSIZE * nbytes]
    if not candidates:
        sizes.append(nbytes)
        return len(sizes) - 1
    big_enough = [b for b in candidates if sizes[b] >= nbytes]
    buf = min(big_enough, key=lambda b: sizes[b]) if big_enough else max(candidates, key=lambda b: sizes[b])
    free.remove(buf)
    sizes[buf] = max(sizes[buf], nbytes)
    return buf


def plan_memory(program: Program) -> tuple[Program, bool]:
    """Assign intermediates to reusable buffers (program.memory_plan, program.buffer_sizes)."""
    nodes = program.nodes()
    base: dict[int, int] = {}  # node id -> id of the node that owns its memory
    for n in nodes:
        base[n.id] = base[n.src[0].id] if (n.op in GroupOp.View or n.attrs.get("inplace")) and n.src else n.id
    keep = {base[n.id] for n in program.outputs} | {base[a.src[1].id] for a in program.assigns}
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            last_use[base[s.id]] = i
    dying: dict[int, list[int]] = {}
    for owner, i in last_use.items():
        dying.setdefault(i, []).append(owner)
    sizes: list[int] = []
    plan: dict[int, int] = {}
    holder: dict[int, int] = {}  # buffer -> the node whose value it holds now
    free: list[int] = []
    for i, n in enumerate(nodes):
        if _planned(n, keep) and n.id in last_use:
            buf = None
            if n.op in GroupOp.Elementwise:
                for s in n.src:
                    if (s.id in plan and holder.get(plan[s.id]) == s.id and last_use[s.id] == i and s.type == n.type
                            and all(t is s or base[t.id] != s.id for t in n.src)):
                        buf = plan[s.id]  # in place: s dies here and nothing else reads its memory
                        break
            if buf is None:
                buf = _take(free, sizes, n.type.nbytes)
            plan[n.id] = buf
            holder[buf] = n.id
        for owner in dying.get(i, ()):
            if owner in plan and owner != n.id and holder.get(plan[owner]) == owner:
                free.append(plan[owner])
                del holder[plan[owner]]
    out = program.with_roots(program.outputs, program.assigns)
    out.regions, out.memory_plan, out.buffer_sizes = program.regions, plan, sizes
    return out, bool(plan)
