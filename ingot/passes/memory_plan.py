"""Memory plan: one buffer per intermediate, reused once its value (and every view of it) is dead.

Sources, views, in-place updates, call results, outputs, assigned values and the float32 cast of a
bf16 weight (see fold.widens_weight) get no planned buffer:
they alias memory the runtime already owns or hand memory to the caller, so an output is never a
buffer the next run overwrites.

An elementwise op whose input has the op's own shape and dtype and dies at that op writes over the
input's buffer: a fused region (a chain of elementwise ops, each the only reader of the one before)
runs in a single buffer. A backend that lowers an elementwise op with an output buffer must accept
that buffer being one of the inputs (NumPy ufuncs do).

A concat whose slots are contiguous (every axis before the concat's of size 1: NCHW, batch 1, on
channels) has its inputs computed straight into their slots (memory_offsets: a byte offset in the
concat's buffer), so nothing is copied (YOLO's C2f blocks). An input qualifies where its memory owner
is a planned value whose views fill exactly its slots (a conv's output split in two and both halves
concatenated in order counts); a graph input, a constant, an output, the same tensor in a second
slot, a value in place of another, or one already placed in another concat is copied as before. The
concat's buffer is taken when its first such input is computed and freed when the last of the concat
and those inputs dies; no op runs in place of any of them. A backend lowers a concat with a buffer by
copying each input that is not already in its slot.
"""
from __future__ import annotations

import math

from ..ir import GroupOp, Node, Op, Program, TensorType
from .fold import widens_weight


def _planned(node: Node, keep: set[int]) -> bool:
    # a bf16 weight's cast to float32 is a load-time value (CPU) or never made (CUDA): no buffer
    return (node.op not in GroupOp.Source and not widens_weight(node) and node.op not in GroupOp.View and node.op not in (Op.CALL, Op.IF, Op.GET_ITEM, Op.ASSIGN)
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


def _view_offset(view: Node, owner: Node) -> int | None:
    """The byte offset of `view` in `owner`'s memory where view is owner itself or a chain of reshapes
    and constant slices of it that leaves it contiguous; else None."""
    elements = 0
    while view is not owner:
        if view.op == Op.RESHAPE:
            view = view.src[0]
            continue
        a = view.attrs
        if view.op != Op.SLICE or len(view.src) != 1 or a.get("size") or not view.src[0].type.static:
            return None
        shape = view.src[0].type.shape
        strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
        taken = []
        for d, start, end, step, stride in zip(shape, a["start"], a["end"], a["step"], strides):
            if not all(v is None or isinstance(v, int) for v in (start, end, step)):
                return None
            first, _, step = slice(start, end, step).indices(d)
            elements += first * stride
            taken.append((stride * step, len(range(*slice(start, end, step).indices(d)))))
        expected = 1   # the slice's own strides must be those of a C-contiguous array of its shape
        for stride, n in reversed(taken):
            if n != 1 and stride != expected:
                return None
            expected *= n
        view = view.src[0]
    size = math.prod(owner.type.shape)
    return elements * (owner.type.nbytes // size) if size else None


def _concat_places(nodes: list[Node], base: dict[int, int], keep: set[int],
                   last_use: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Owner id -> (concat id, byte offset) for each value computed straight into a concat's slots."""
    by_id = {n.id: n for n in nodes}
    written = {base[n.id] for n in nodes if n.attrs.get("inplace")}
    places: dict[int, tuple[int, int]] = {}
    concats: set[int] = set()
    for c in nodes:
        if c.op != Op.CONCAT or not _planned(c, keep) or c.id not in last_use or c.id in places or c.id in written:
            continue
        axis = c.attrs["axis"] % c.type.rank
        if math.prod(c.type.shape[:axis]) != 1:
            continue
        at, position, filled = 0, {}, {}
        for s in c.src:
            owner = by_id[base[s.id]]
            offset = _view_offset(s, owner)
            if (offset is not None and owner.id not in places and owner.id not in concats and owner.id not in written
                    and _planned(owner, keep) and owner.id in last_use and 0 <= at - offset
                    and at - offset + owner.type.nbytes <= c.type.nbytes
                    and position.setdefault(owner.id, at - offset) == at - offset):
                filled[owner.id] = filled.get(owner.id, 0) + s.type.nbytes
            at += s.type.nbytes
        # an owner whose memory holds anything but its slots (half of it concatenated) would be
        # overwritten by the copies into the other slots
        chosen = {o: position[o] for o, n in filled.items() if n == by_id[o].type.nbytes}
        if chosen:
            places.update((o, (c.id, p)) for o, p in chosen.items())
            concats.add(c.id)
    return places


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
    places = _concat_places(nodes, base, keep, last_use)
    shared = set(places) | {c for c, _ in places.values()}   # memory no op may take in place
    ends = dict(last_use)
    for owner, (c, _) in places.items():   # a concat's buffer lives as long as it or any input in it
        ends[c] = max(ends[c], ends.pop(owner))
    dying: dict[int, list[int]] = {}
    for owner, i in ends.items():
        dying.setdefault(i, []).append(owner)
    by_id = {n.id: n for n in nodes}
    sizes: list[int] = []
    plan: dict[int, int] = {}
    holder: dict[int, int] = {}  # buffer -> the node whose value it holds now
    free: list[int] = []
    offsets: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.id in places:   # into its slots of a concat's buffer, taken by the first such input
            c, offsets[n.id] = places[n.id]
            if c not in plan:
                plan[c] = _take(free, sizes, by_id[c].type.nbytes)
                holder[plan[c]] = c
            plan[n.id] = plan[c]
        elif _planned(n, keep) and n.id in last_use and n.id not in plan:
            buf = None
            if n.op in GroupOp.Elementwise:
                for s in n.src:
                    if (s.id in plan and s.id not in shared and holder.get(plan[s.id]) == s.id and last_use[s.id] == i
                            and s.type == n.type and all(t is s or base[t.id] != s.id for t in n.src)):
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
    out.memory_offsets = {k: v for k, v in offsets.items() if v}
    return out, bool(plan)
