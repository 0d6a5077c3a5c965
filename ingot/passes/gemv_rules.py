"""What the GEMV fusions need to know about a quantized matmul, decided on the IR alone (no torch).

The CUDA backend's word GEMV (backends/cuda/quantized_matmul) streams 4-bit affine weights re-packed
at load into a word layout; it takes up to `words_max_rows` rows and can run a prologue (rms_norm,
the residual add, act(gate) * up with act silu or gelu_tanh) as it loads x. The fusion passes offer it only matmuls it can take;
the backend still checks the weight it prepared and runs a fused op as its parts where it cannot.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import Node, Op, Ref

WORDS_MAX_ROWS = 16         # rows the word GEMV takes (CudaOptions.words_max_rows)
SELF_XQ_BYTES = 4 << 20     # weights under this round their own x in the GEMV (CudaOptions.self_xq_bytes)


# the gate activations of a GLU the GEMV computes as it loads x: its kernels' GLU constexpr
GATE_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}


def gate_activation(node: Node) -> str | None:
    """"silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma) when `node` is a gate activation the GEMV computes; else None."""
    if node.op == Op.SILU:
        return "silu"
    if node.op == Op.GELU and node.attrs.get("approximate") == "tanh":
        return "gelu_tanh"
    return None


def glu_parts(body) -> tuple[Node, Node, Node]:
    """(the gate activation, the product, the other factor) of a glu_gemv body (act(gate) * up)."""
    mul = body.find(Op.MUL)[0]
    act = next(s for s in mul.src if gate_activation(s) is not None)
    return act, mul, mul.src[1] if mul.src[0] is act else mul.src[0]


def constant_affine(m: Node, src: tuple[Node, ...] | None = None) -> bool:
    """A quantized matmul of constant affine weights (what the GEMV kernels re-pack at load). `src`: the
    nodes m's sources stand for, where m is inside a fused op's body (its parameters)."""
    src = m.src if src is None else src
    return m.op == Op.QUANTIZED_MATMUL and m.attrs.get("mode") == "affine" and all(s.op == Op.CONSTANT for s in src[1:])


def constant_scaled_table(m: Node) -> bool:
    """A quantized matmul of a constant scaled table (lut4:bB[:offset], GGUF's IQ types, MXFP4)."""
    return m.op == Op.QUANTIZED_MATMUL and m.attrs.get("mode") == "scaled_lut" and all(s.op == Op.CONSTANT for s in m.src[1:])


def outer_sources(fused: Node, m: Node) -> tuple[Node, ...]:
    """The program's nodes that body node m of `fused` reads (its parameters resolved)."""
    return tuple(fused.src[s.attrs["param"]] if s.op == Op.PLACEHOLDER else s for s in m.src)


def word_layout(m: Node, src: tuple[Node, ...] | None = None) -> bool:
    """The weight goes into the word layout: 4-bit affine, parameter blocks spanning a multiple of 32 k."""
    if not constant_affine(m, src) or not m.attrs["qdtype"].packed:
        return False
    k = m.src[0].type.shape[-1]
    axis = 1 if m.attrs.get("transpose") else 0
    blocks = max(p.type.shape[axis] if p.type.rank == 2 else 1 for p in m.src[2:]) if len(m.src) > 2 else 1
    return k is not None and blocks > 0 and k % blocks == 0 and (k // blocks) % 32 == 0


def rows(node: Node) -> int | None:
    """Rows of x for a matmul-like node (every axis but the last)."""
    shape = node.src[0].type.shape
    return None if any(d is None for d in shape[:-1]) else math.prod(shape[:-1])


def weight_bytes(m: Node) -> int:
    """About the bytes the GEMV streams for m's weight: the packed values and 16-bit parameters."""
    q = m.src[1].type
    return q.nbytes + sum(int(np.prod(p.type.shape)) * 2 for p in m.src[2:])


def identity_slice(node: Node) -> bool:
    """Whether a slice is its input on the CUDA backend: static shapes, the output the input's type,
    steps 1 and no runtime end. A runtime start with a static size is clamped into the axis there,
    so a size spanning the axis starts at 0 (a decode step's row `last` of 1)."""
    if node.op != Op.SLICE or not (node.type.static and node.src[0].type == node.type):
        return False
    return all(st == 1 for st in node.attrs["step"]) and not any(isinstance(e, Ref) for e in node.attrs["end"])


def sum_through_views(x: Node) -> tuple[Node, list[Node]]:
    """(the ADD that x is through reshapes and identity slices to x's own shape, those views), else (x, [])."""
    y, views = x, []
    while y.op == Op.RESHAPE or identity_slice(y):
        views.append(y)
        y = y.src[0]
    if y.op == Op.ADD and y.type.static and y.type.shape == x.type.shape:
        return y, views
    return x, []


def last_axis_slice(node: Node, src: Node) -> tuple[int, int] | None:
    """(start, stop) when node is src[..., start:stop] (static, step 1, every other axis whole), else None."""
    if node.op != Op.SLICE or node.src[0] is not src or not src.type.static or \
            any(sz is not None for sz in node.attrs.get("size") or ()):
        return None
    start, end, step = node.attrs["start"], node.attrs["end"], node.attrs["step"]
    shape = src.type.shape
    if any(isinstance(v, Ref) for v in (*start, *end)) or any(st != 1 for st in step):
        return None
    spans = [range(*slice(a, b).indices(d)) for a, b, d in zip(start, end, shape)]
    if any(len(r) != d for r, d in zip(spans[:-1], shape[:-1])):
        return None
    return spans[-1].start, spans[-1].stop


def plain_attention(att: Node) -> bool:
    """An SDPA the CUDA attention kernels take: no sliding window and no logit softcap (yet)."""
    return att.op == Op.SDPA and not att.attrs.get("window") and not att.attrs.get("softcap")
