"""Per-request adapters in one decode batch, gathered per row (S-LoRA / Punica style).

Each call site of the rows decoder is bound to one executable holding every served adapter's
factors for that site stacked ([adapters, in, R] and [adapters, R, out], zero-padded to the largest
rank R; entry 0 is the base model's, usually zeros). A variable `adapter_rows` [rows] says which
adapter each row uses; the executable gathers that row's factors and multiplies:

    delta[r] = (x[r] @ A[adapter_rows[r]]) @ B[adapter_rows[r]]

All sites of one rows decoder share the same `adapter_rows` array, which the scheduler fills before
each step: one write, however many sites and adapters there are.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..adapters import AdapterSet, site_input, site_layout
from ..graph import Graph
from ..ir import TensorType
from ..runtime import State


def gathered_executable(sets: list[AdapterSet], names: list[str], outs: list[int], rows: int, in_width: int,
                        device: str, row_adapters: np.ndarray):
    """x [rows, in] -> delta [rows, sum(outs)], row r through adapter set sets[row_adapters[r]]."""
    pairs = [s.site_factors(names, outs, in_width) for s in sets]        # (A [r, in], B [out, r]) each
    rank = max(a.shape[0] for a, _ in pairs)
    out = int(sum(outs))
    a_all = np.zeros((len(sets), in_width, rank), np.float32)
    b_all = np.zeros((len(sets), rank, out), np.float32)
    for i, (a, b) in enumerate(pairs):
        a_all[i, :, :a.shape[0]] = a.T
        b_all[i, :b.shape[1], :] = b.T
    g = Graph()
    x = g.placeholder((rows, in_width), dt.float32, name="x")
    which = g.variable(np.zeros(rows, np.int32), name="adapter_rows")
    a_rows = g.gather(g.constant(a_all, name="A_t"), which, axis=0)      # [rows, in, R]
    b_rows = g.gather(g.constant(b_all, name="B_t"), which, axis=0)      # [rows, R, out]
    down = g.matmul(g.reshape(x, (rows, 1, in_width)), a_rows)           # [rows, 1, R]
    delta = g.reshape(g.matmul(down, b_rows), (rows, out))
    exe = g.compile(feeds={x: TensorType((rows, in_width), dt.float32)}, targets=[delta], device=device)
    exe.state = State({"adapter_rows": row_adapters})
    return exe


def gathered_callables(cfg, sets: list[AdapterSet], call_sites, rows: int, device: str,
                       row_adapters: np.ndarray) -> dict:
    """{site: gathered executable} for the call sites of a rows decoder."""
    out = {}
    for site in call_sites:
        names = site.split("+")
        out[site] = gathered_executable(sets, names, site_layout(cfg, names), rows, site_input(cfg, names[0]),
                                        device, row_adapters)
    return out
