"""Move a scaled table's per-block bias (lut4:bB:offset) out of quantized_matmul and quantized_gather.

    quantized_matmul(x, q, lut, scale, bias)  -> quantized_matmul(x, q, lut, scale) + block_sums(x) @ bias
    quantized_gather(q, lut, scale, bias, idx) -> quantized_gather(q, lut, scale, idx) + bias's entries, repeated

With W[k, n] = lut[q[k, n]] * scale[k // B, n] + bias[k // B, n] (blocks of B along K),
x @ W = x @ (lut[q] * scale) + sum over blocks b of (sum of x[k] for k in b) * bias[b, n]: the
bias's share is a float matmul of the sums of x over each block [..., K / B] by bias [K / B, N],
a B-th of the GEMV's work. The GPU's scaled-table kernels (gguf_kernels) then run as they do for
GGUF's IQ types, never seeing a bias: this is the first pass of the CUDA pipeline (passes/device.py).
A gather takes the bias's entries of the rows (columns) it reads and repeats each over its block.
The CPU needs no split: its table GEMV adds x's block sums times the bias in the same step
(backends/cpu/lut_kernels.py; as separate ops the default model decoded at 43.6 tok/s against 54.7
for lut4:b64, one thread).

The bias stays the graph constant it was (a package stores and reads it by name), float16 as the
format keeps it, widened to float32 by a cast where it is read.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Node, Op, Program
from ..ops import infer_type
from . import Context, graph_rewrite


def _make(op: Op, src: tuple[Node, ...], attrs: dict | None = None) -> Node:
    attrs = attrs or {}
    return Node(op, infer_type(op, [s.type for s in src], attrs), src, attrs)


def _float32(p: Node) -> Node:
    return p if p.dtype == dt.float32 else _make(Op.CAST, (p,), {"dtype": dt.float32})


def _without_bias(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if k != "has_bias"}


def _has_lut_bias(node: Node) -> bool:
    return node.attrs.get("mode") == "scaled_lut" and bool(node.attrs.get("has_bias"))


def _static(shape) -> bool:
    return all(d is not None for d in shape)


def _matmul(node: Node, ctx: Context) -> Node | None:
    if not _has_lut_bias(node):
        return None
    x, q, lut, scale, bias = node.src
    if not (_static(x.type.shape) and _static(bias.type.shape)) or x.dtype != dt.float32:
        raise IngotError(f"quantized_matmul {node.name or node.id}: a table with a bias needs static shapes and a "
                         f"float32 input, not {x.type} and {bias.type}.")
    base = Node(Op.QUANTIZED_MATMUL, node.type, (x, q, lut, scale), _without_bias(node.attrs), node.name)
    p = _float32(bias)                                    # [pK, pN], or [pN, pK] for a transposed weight
    if node.attrs.get("transpose"):
        p = _make(Op.TRANSPOSE, (p,), {"perm": (1, 0)})
    blocks = p.type.shape[0]
    k = x.type.shape[-1]
    lead = tuple(x.type.shape[:-1])
    grouped = _make(Op.RESHAPE, (x,), {"shape": lead + (blocks, k // blocks)})
    sums = _make(Op.SUM, (grouped,), {"axes": (len(lead) + 1,), "keepdims": False})   # [..., pK]
    share = _make(Op.MATMUL, (sums, p))                   # [..., pN]: pN is N or 1 (broadcast by the add)
    out = Node(Op.ADD, infer_type(Op.ADD, [base.type, share.type], {}), (base, share), {}, node.name)
    return out if out.type == node.type else None


def _gather(node: Node, ctx: Context) -> Node | None:
    if not _has_lut_bias(node):
        return None
    q, lut, scale, bias, idx = node.src
    axis = node.attrs.get("axis", 0)
    rows, cols = q.type.shape                            # (the logical shape: 4-bit types count values)
    taken, other = (rows, cols) if axis == 0 else (cols, rows)
    p_taken, p_other = bias.type.shape[axis], bias.type.shape[1 - axis]
    if p_taken not in (1, taken) or not _static(idx.type.shape):
        raise IngotError(f"quantized_gather {node.name or node.id}: a table's bias is gathered along axis {axis} "
                         f"only with one entry per row or column there (bias {bias.type}, table [{rows}, {cols}]).")
    base = Node(Op.QUANTIZED_GATHER, node.type, (q, lut, scale, idx), _without_bias(node.attrs), node.name)
    p = bias                                               # (cast once gathered: only the entries taken)
    count = int(np.prod(idx.type.shape, dtype=np.int64))
    if p_taken == taken:
        flat = _make(Op.RESHAPE, (idx,), {"shape": (count,)})
        p = _make(Op.GATHER, (p, flat), {"axis": axis})   # [pR, count] (axis 1) or [count, pC] (axis 0)
    if axis == 1:                                          # repeat each of the pR entries over its block of rows
        p = _make(Op.RESHAPE, (p,), {"shape": (p_other, 1, p.type.shape[1])})
        p = _make(Op.BROADCAST_TO, (p,), {"shape": (p_other, other // p_other, p.type.shape[2])})
        p = _make(Op.RESHAPE, (p,), {"shape": (other, p.type.shape[2])})
        p = _make(Op.RESHAPE, (p,), {"shape": (other,) + (tuple(idx.type.shape) if p_taken == taken else (1,) * idx.type.rank)})
    else:
        p = _make(Op.RESHAPE, (p,), {"shape": (p.type.shape[0], p_other, 1)})
        p = _make(Op.BROADCAST_TO, (p,), {"shape": (p.type.shape[0], p_other, other // p_other)})
        p = _make(Op.RESHAPE, (p,), {"shape": (tuple(idx.type.shape) if p_taken == taken else (1,) * idx.type.rank) + (other,)})
    if p.dtype != node.dtype:
        p = _make(Op.CAST, (p,), {"dtype": node.dtype})
    out = Node(Op.ADD, infer_type(Op.ADD, [base.type, p.type], {}), (base, p), {}, node.name)
    return out if out.type == node.type else None


def split_lut_bias(program: Program) -> tuple[Program, bool]:
    """Every scaled table's bias as its own float matmul (gather) beside the table's; returns (program, changed)."""
    return graph_rewrite(program, [((Op.QUANTIZED_MATMUL,), _matmul), ((Op.QUANTIZED_GATHER,), _gather)], "split_lut_bias")
