"""The compiler: a graph's targets and assigns through the pass pipeline, then lowered to a backend.

    >>> import numpy as np, ingot
    >>> g = ingot.Graph()
    >>> x = g.placeholder((None, 4), name="x")
    >>> exe = g.compile(feeds={x: ingot.TensorType((2, 4))}, targets=[g.exp(x) * 2.0])
    >>> [name for name, _ in exe.history][:3]
    ['specialize', 'fold', 'dce']
"""
from __future__ import annotations

import gc
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Collection

from .errors import IngotError
from .ir import Node, Op, Program, TensorType
from .verify import TYPED, verify
from .passes.attention_length import attention_over_buffer
from .passes.cse import eliminate_common_subexpressions
from .passes.dce import eliminate_dead_code
from .passes.device import DEVICE_PIPELINES, FUSIONS, device_steps  # noqa: F401  (public here)
from .passes.fold import fold_constants
from .passes.fold_conv_affine import fold_conv_affine
from .passes.fuse_dequant import fuse_dequantize
from .passes.fuse_norms import fuse_norms
from .passes.fuse_one_hot import fuse_one_hot
from .passes.fuse_sdpa import fuse_attention
from .passes.inplace import update_variables_in_place
from .passes.memory_plan import plan_memory
from .passes.regions import find_regions
from .passes.simplify_views import simplify_views
from .passes.specialize import specialize

Pass = Callable[[Program], tuple[Program, bool]]

PIPELINE: list[tuple[str, Pass]] = [
    ("fold", fold_constants),                       # constant subgraphs computed once, now
    ("dce", eliminate_dead_code),                   # drop what no target or assign needs
    ("cse", eliminate_common_subexpressions),       # one node per distinct computation
    ("fold_conv_affine", fold_conv_affine),         # conv * a + s (a batch norm) -> conv's weights and bias
    ("fuse_attention", fuse_attention),             # hand-written attention -> one SDPA
    ("fuse_norms", fuse_norms),                     # written-out RMSNorm, tanh-GELU -> one op each
    ("fuse_one_hot", fuse_one_hot),                 # one-hot @ table -> a row gather
    ("fuse_dequantize", fuse_dequantize),           # dequantize -> matmul/gather: no float weights
    ("simplify_views", simplify_views),             # chains of reshapes/transposes -> one view (after the
                                                    # fusions, whose patterns name transposes)
    ("inplace", update_variables_in_place),         # assign(v, slice_update(v, ...)) writes the slice only
    ("attention_length", attention_over_buffer),    # attention over a cache prefix keeps shapes static
]

LATE_PIPELINE: list[tuple[str, Pass]] = [
    ("regions", find_regions),                      # elementwise chains a backend runs as one kernel
    ("memory_plan", plan_memory),                   # buffers reused by liveness
]
PASS_NAMES = ("specialize",) + tuple(name for name, _ in PIPELINE) + \
    tuple(sorted({name for passes in DEVICE_PIPELINES.values() for name, _ in passes})) + tuple(n for n, _ in LATE_PIPELINE)


def pass_names(device: str = "cpu") -> tuple[str, ...]:
    """The passes a compile for `device` runs, in order (what debug= can name and history lists)."""
    return ("specialize",) + tuple(n for n, _ in PIPELINE) + tuple(n for n, _ in DEVICE_PIPELINES.get(device, [])) + \
        tuple(n for n, _ in LATE_PIPELINE)


@contextmanager
def paused_collector():
    """Python's cyclic garbage collector paused while a compile runs (and resumed after, if it ran
    before). A compile makes tens of thousands of short-lived objects (IR nodes, programs between
    passes); collections during it promoted the live ones of the moment and set off full collections of
    the whole process (~75 ms each): 5 in 23 new input shapes of PP-OCRv4's detector, whose first runs
    took 129 ms on average (max 238), 107 (max 161) paused. Objects die by reference counting as ever;
    collections resume with the next allocation after."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _dump_filter(debug: bool | str) -> Callable[[str], bool]:
    """debug=True dumps after every pass; a string names the passes to dump ("fold,memory_plan")."""
    if not debug:
        return lambda name: False
    if debug is True:
        return lambda name: True
    wanted = {p.strip() for p in str(debug).split(",") if p.strip()}
    unknown = wanted - set(PASS_NAMES)
    if unknown:
        raise IngotError(f"compile: debug names unknown passes {sorted(unknown)} (passes: {', '.join(PASS_NAMES)}).")
    return lambda name: name in wanted


def run_pipeline(program: Program, debug: bool | str = False, log: Callable[[str], None] | None = None,
                 feed_types: dict[str, TensorType] | None = None, device: str = "cpu",
                 options=None, typed: Collection[int] = ()) -> tuple[Program, list[tuple[str, bool]]]:
    """Specialise, run the generic passes, the device's fusions, then regions and the memory plan,
    verifying after each that changed the program; returns (program, [(pass, changed)]).

    debug=True writes the graph after each pass to stderr (or to `log`). typed: ids of nodes whose
    types their ops' rules gave (Graph.typed: the builder's), which the first verify does not ask again.
    """
    log = log or (lambda text: print(text, file=sys.stderr))
    dump_after = _dump_filter(debug)
    checked: dict[int, object] = dict.fromkeys(typed, TYPED)   # nodes verify checked (immutable: checked once; verify's)
    verify(program, checked)
    steps: list[tuple[str, Pass]] = [("specialize", lambda p: specialize(p, feed_types or {}))] + PIPELINE + \
        device_steps(device, options) + LATE_PIPELINE
    history = []
    for name, fn in steps:
        start = time.perf_counter()
        program, changed = fn(program)
        elapsed = (time.perf_counter() - start) * 1e3
        try:
            if changed:   # a pass that changed nothing leaves the program verified
                verify(program, checked)
        except IngotError as e:
            raise IngotError(f"compile: the graph is invalid after pass {name!r}: {e}") from None
        history.append((name, changed))
        if dump_after(name):
            log(f"--- after {name} (changed={changed}, {elapsed:.2f} ms) ---\n{dump(program)}")
    return program, history


def dump(program: Program) -> str:
    """The program as text, one node a line, sources first (what debug=True prints)."""
    lines = []
    region_of = {i: r for r, ids in enumerate(program.regions) for i in ids}
    for n in program.nodes():
        src = ", ".join(f"%{s.id}" for s in n.src)
        attrs = {k: v for k, v in n.attrs.items() if k not in ("output_types", "input_types")}
        notes = []
        if n.name:
            notes.append(n.name)
        if n.id in region_of:
            notes.append(f"region {region_of[n.id]}")
        if n.id in program.memory_plan:
            notes.append(f"buffer {program.memory_plan[n.id]}")
        lines.append(f"%{n.id} = {n.op.name.lower()}({src}) {attrs} : {n.type}" + (f"  # {', '.join(notes)}" if notes else ""))
    lines.append("outputs: " + ", ".join(f"%{n.id}" for n in program.outputs))
    if program.assigns:
        lines.append("assigns: " + ", ".join(f"%{n.id}" for n in program.assigns))
    return "\n".join(lines)


def compile_graph(graph, targets: list[Node], assigns: list[Node], feed_types: dict[str, TensorType], device: str,
                  callables: dict[str, Any], debug: bool | str = False, options=None):
    """Compile targets and assigns of a Graph into an Executable (Graph.compile is the public entry)."""
    from .runtime import Executable

    if not targets and not assigns:
        raise IngotError("compile: no targets and no assigns: nothing to compute.")
    assigned: dict[str, Node] = {}
    for a in assigns:
        name = a.src[0].attrs["name"]
        if name in assigned and assigned[name] is not a:
            raise IngotError(f"compile: variable {name!r} is assigned twice in one run; build one value and assign it once.")
        assigned[name] = a
    assigns = list(dict.fromkeys(assigns))  # the same assign given twice runs once
    program = Program(list(targets), assigns, dict(graph.constants), dict(graph.variables))
    placeholders = {n.name for n in program.nodes() if n.op == Op.PLACEHOLDER}
    unknown = set(feed_types) - placeholders
    if unknown:
        raise IngotError(f"compile: feeds {sorted(unknown)} are not placeholders the targets depend on "
                         f"(those are {sorted(placeholders)}).")
    declared_types = {n.name: n.type for n in program.nodes() if n.op == Op.PLACEHOLDER}
    with paused_collector():
        program, history = run_pipeline(program, debug, feed_types=feed_types, device=device, options=options,
                                        typed=graph.typed)
        # inputs in the order they were declared, which is the order run() takes a list in
        order = [name for name in getattr(graph, "placeholders", {}) if name in placeholders]
        order += sorted(placeholders - set(order))
        inputs = [(name, feed_types.get(name, declared_types[name])) for name in order]
        return Executable(program, device=device, callables=callables, history=history, inputs=inputs, options=options)
