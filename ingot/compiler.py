"""The compiler: a graph's targets and assigns through the pass pipeline, then lowered to a backend."""
from __future__ import annotations

import sys
from typing import Any, Callable

from .errors import IngotError
from .ir import Node, Program, TensorType, verify
from .passes.attention_length import attention_over_buffer
from .passes.cse import eliminate_common_subexpressions
from .passes.dce import eliminate_dead_code
from .passes.fold import fold_constants
from .passes.fuse_dequant import fuse_dequantize
from .passes.fuse_sdpa import fuse_attention
from .passes.inplace import update_variables_in_place
from .passes.memory_plan import plan_memory
from .passes.regions import find_regions
from .passes.specialize import specialize

Pass = Callable[[Program], tuple[Program, bool]]

PIPELINE: list[tuple[str, Pass]] = [
    ("fold", fold_constants),                       # constant subgraphs computed once, now
    ("dce", eliminate_dead_code),                   # drop what no target or assign needs
    ("cse", eliminate_common_subexpressions),       # one node per distinct computation
    ("fuse_attention", fuse_attention),             # hand-written attention -> one SDPA
    ("fuse_dequantize", fuse_dequantize),           # dequantize -> matmul/gather: no float weights
    ("inplace", update_variables_in_place),         # assign(v, slice_update(v, ...)) writes the slice only
    ("attention_length", attention_over_buffer),    # attention over a cache prefix keeps shapes static
    ("regions", find_regions),                      # elementwise chains a backend runs as one kernel
    ("memory_plan", plan_memory),                   # buffers reused by liveness
]


def run_pipeline(program: Program, debug: bool | str = False, log: Callable[[str], None] | None = None) -> tuple[Program, list[tuple[str, bool]]]:
    """Run every pass in order, verifying after each. debug=True dumps the graph after each pass."""
    log = log or (lambda text: print(text, file=sys.stderr))
    verify(program)
    history = []
    for name, fn in PIPELINE:
        program, changed = fn(program)
        verify(program)
        history.append((name, changed))
        if debug:
            log(f"--- after {name} (changed={changed}) ---\n{dump(program)}")
    return program, history


def dump(program: Program) -> str:
    lines = []
    for n in program.nodes():
        src = ", ".join(f"%{s.id}" for s in n.src)
        attrs = {k: v for k, v in n.attrs.items() if k not in ("output_types", "input_types")}
        lines.append(f"%{n.id} = {n.op.name.lower()}({src}) {attrs} : {n.type}" + (f"  # {n.name}" if n.name else ""))
    lines.append("outputs: " + ", ".join(f"%{n.id}" for n in program.outputs))
    if program.assigns:
        lines.append("assigns: " + ", ".join(f"%{n.id}" for n in program.assigns))
    return "\n".join(lines)


def compile_graph(graph, targets: list[Node], assigns: list[Node], feed_types: dict[str, TensorType], device: str,
                  callables: dict[str, Any], debug: bool | str = False):
    from .runtime import Executable

    if not targets and not assigns:
        raise IngotError("compile: no targets and no assigns: nothing to compute.")
    program = Program(list(targets), list(assigns), dict(graph.constants), dict(graph.variables))
    unknown = set(feed_types) - {n.name for n in program.nodes() if n.op.name == "PLACEHOLDER"}
    if unknown:
        raise IngotError(f"compile: feeds {sorted(unknown)} are not placeholders the targets depend on.")
    program, _ = specialize(program, feed_types)
    program, history = run_pipeline(program, debug)
    return Executable(program, device=device, callables=callables, history=history)
