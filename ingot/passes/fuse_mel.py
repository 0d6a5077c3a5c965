"""The STFT power -> mel chain as one FUSED "stft_mel" op, which a backend runs as one transform and one
projection kernel (backends/cuda/fft.py).

The chain `ingot.models.audio` builds per chunk of frames,

    mel = matmul(filters, transpose(abs(rfft(frames [* window])) ** 2))      # [n_mels, frames]

(CSE has made the square's two operands one node), where each inner node has no other reader and
`filters` is a float32 constant [n_mels, n_fft // 2 + 1]. The window joins the op when it is a cosine
sum (Hann, Hamming, boxcar; `cosine_window`), which the kernel applies in frequency; another window is
multiplied in before, as its own step. Chunks of one signal concatenated along frames (every part a
chain of the same bank, read only by the concat) become one op, which computes them together. With
`epilogue`, the float32 elementwise ops after the mel that have a scalar constant as their other
operand (a dB or log10 scale: maximum, log, mul, add, ...) join it too, each the only reader of the one
before, so the kernel stores the scaled value.
"""
from __future__ import annotations

import numpy as np

from ..ir import Node, Op, Program, consumers
from .fusion import Match, fuse_matches

EPILOGUE_OPS = (Op.MAXIMUM, Op.MINIMUM, Op.LOG, Op.MUL, Op.ADD, Op.SUB, Op.DIV)


def cosine_window(window: np.ndarray) -> tuple[float, float] | None:
    """(a0, a1) when window[n] == a0 - a1 cos(2 pi n / N) for its length N >= 3 (a periodic Hann,
    Hamming or boxcar), to float32 precision; None otherwise."""
    w = np.asarray(window, np.float64)
    n = w.shape[-1]
    if w.ndim != 1 or n < 3:
        return None
    cos = np.cos(2 * np.pi * np.arange(n) / n)
    a0, a1 = float(w.mean()), float(-2.0 * (w * cos).mean())
    if np.abs(w - (a0 - a1 * cos)).max() > 1e-6 * max(np.abs(w).max(), 1e-30):
        return None
    return a0, a1


def swaps_axes(node: Node) -> bool:
    """A transpose of a matrix, or the reshape that stands for one ([1, n] -> [n, 1]: one frame)."""
    if node.op == Op.TRANSPOSE:
        return tuple(node.attrs["perm"]) == (1, 0)
    inner = node.src[0].type if node.src else None
    return node.op == Op.RESHAPE and node.type.rank == 2 and inner is not None and inner.rank == 2 and \
        inner.shape[0] == 1 and tuple(node.type.shape) == tuple(inner.shape)[::-1]


def chain_spectrum(mm: Node) -> Node:
    """The RFFT a matched chain's matmul projects (matmul <- transpose <- square <- abs <- rfft)."""
    return mm.src[1].src[0].src[0].src[0]


def fuse_mel(program: Program, epilogue: bool = True) -> tuple[Program, bool]:
    """Replace each mel chain (and its chunks' concat, and with `epilogue` its scalar tail) by a FUSED
    "stft_mel" node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}

    def only_for(inner: Node, user: Node) -> bool:
        return inner.id not in roots and {u.id for u in users[inner.id]} == {user.id}

    def constant(node: Node) -> np.ndarray | None:
        return program.constants[node.attrs["key"]] if node.op == Op.CONSTANT else None

    chains: dict[int, tuple[list[Node], tuple]] = {}   # matmul id -> (members, (filters id, n_fft, cosine))
    for mm in nodes:
        if mm.op != Op.MATMUL or len(mm.src) != 2 or mm.type.rank != 2 or mm.dtype.name != "float32":
            continue
        filters_node, transpose = mm.src
        filters = constant(filters_node)
        if filters is None or filters.ndim != 2 or filters.dtype != np.float32:
            continue
        if not swaps_axes(transpose) or not only_for(transpose, mm):
            continue
        square = transpose.src[0]
        if square.op != Op.MUL or square.src[0] is not square.src[1] or not only_for(square, transpose):
            continue
        magnitude = square.src[0]
        if magnitude.op != Op.ABS or not only_for(magnitude, square):
            continue
        spectrum = magnitude.src[0]
        if spectrum.op != Op.RFFT or spectrum.type.rank != 2 or tuple(spectrum.attrs["axes"]) != (1,) \
                or spectrum.attrs["norm"] != "none" or not only_for(spectrum, magnitude):
            continue
        frames = spectrum.src[0]
        n_fft = frames.type.shape[1]
        if filters.shape[1] != n_fft // 2 + 1 or n_fft // 2 + 1 < 2:
            continue
        members, cosine = [spectrum, magnitude, square, transpose, mm], None
        if frames.op == Op.MUL and only_for(frames, spectrum):
            for i in (0, 1):
                w, view = constant(frames.src[i]), frames.src[1 - i]
                if w is not None and w.shape == (n_fft,) and view.type.shape == frames.type.shape:
                    cosine = cosine_window(w)
                    if cosine is not None:
                        members.insert(0, frames)
                    break
        chains[mm.id] = (members, (filters_node.id, n_fft, cosine))

    heads: list[tuple[Node, list[Node]]] = []
    taken: set[int] = set()
    for cat in nodes:   # the chunks of one signal, concatenated along frames
        if cat.op != Op.CONCAT or cat.type.rank != 2 or cat.attrs["axis"] not in (1, -1) or len(cat.src) < 2:
            continue
        parts = [chains.get(s.id) for s in cat.src]
        if any(p is None for p in parts) or len({p[1] for p in parts}) != 1 or len({s.id for s in cat.src}) != len(cat.src) \
                or not all(only_for(s, cat) for s in cat.src):
            continue
        heads.append((cat, [m for p in parts for m in p[0]] + [cat]))
        taken |= {s.id for s in cat.src}
    heads += [(by_mm[0][-1], by_mm[0]) for mm_id, by_mm in chains.items() if mm_id not in taken]

    matches = []
    for head, members in heads:
        out = head
        while epilogue and out.id not in roots and len(users[out.id]) == 1:
            u = users[out.id][0]
            if u.op not in EPILOGUE_OPS or u.dtype.name != "float32" or u.type.shape != out.type.shape:
                break
            if u.op == Op.LOG:
                if len(u.src) != 1:
                    break
            else:
                other = u.src[1] if u.src[0] is out else u.src[0]
                c = constant(other)
                if len(u.src) != 2 or u.src[0] is u.src[1] or c is None or c.size != 1:
                    break
            members = members + [u]
            out = u
        matches.append(Match("stft_mel", members, [out]))
    return fuse_matches(program, matches)
