"""The mixture-of-experts feed-forward block (Qwen3-MoE's, as llama.cpp and transformers run it).

Per token x [dim] of a layer (GGUF names):

    probs   = softmax(x @ ffn_gate_inp.T)                   [E]      the router
    chosen  = top_k(probs, k)                               [k]      experts, most probable first
    weights = probs[chosen] / sum(probs[chosen])            [k]      (norm_top_k; else probs[chosen])
    y       = sum_j weights[j] * down_j(silu(gate_j(x)) * up_j(x)),  j = chosen experts

The experts are 3-D GGUF tensors ffn_gate_exps/ffn_up_exps [E, ffn, dim], ffn_down_exps [E, dim, ffn]
(the importer reads a quantized one as its rows [E * rows, cols]). They become constants with every
expert in the k-major form a CPU GEMV reads best, [E, in, out] (gate and up side by side, [E, dim,
2 ffn], when their formats allow: one routed matmul for both), quantized ones staying quantized
(dequantize -> gather_matmul, which the compiler turns into quantized_gather_matmul: the chosen
experts' packed weights multiplied, no float copy). `stored_experts` makes that form without a graph:
an LLM package stores it (ExpertStack) and the builder reads it back as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..quant.formats import QuantizedTensor, concat_columns
from .blocks import DecoderConfig, Weights, linear


@dataclass
class ExpertStack:
    """E experts' weights in the form the graph multiplies (what an LLM package stores and memory-maps):
    q [E, in, out] (each expert k-major; 4-bit packed along out), parameters [E, in / block, out], lut as
    the dequantize reads it ([1, 1, 1, 2**bits]); qdtype None: q holds float32 weights [E, in, out]."""
    q: np.ndarray
    qdtype: dt.DType | None = None
    block_size: int = 0
    scale: np.ndarray | None = None
    bias: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    lut: np.ndarray | None = None
    source: str = ""

    PARAMS = ("scale", "bias", "zero_point", "lut")

    @property
    def shape(self) -> tuple[int, int, int]:
        e, k, n = self.q.shape
        return e, k, n * 2 if self.qdtype is not None and self.qdtype.packed else n

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + sum(getattr(self, p).nbytes for p in self.PARAMS if getattr(self, p) is not None))

    def float_rows(self, names: list[str]):
        """(name, float32 [E * out, in]) for each GGUF stack side by side in this one (equal widths: gate,
        up), as a GGUF file's rows: what a quantizer reads back out of a package."""
        e, k, n = self.shape
        if self.qdtype is None:
            w = np.asarray(self.q, np.float32)
        else:
            part = lambda p, i: None if p is None else np.asarray(p[i])  # noqa: E731
            w = np.stack([QuantizedTensor(np.asarray(self.q[i]), self.qdtype, (k, n), self.block_size, part(self.scale, i),
                                          part(self.bias, i), part(self.zero_point, i), self.source, block_axis=0,
                                          lut=None if self.lut is None else np.asarray(self.lut[0])).dequantize_rows()
                          for i in range(e)])                                  # [E, in, out]
        width = n // len(names)
        for j, name in enumerate(names):
            yield name, np.ascontiguousarray(w[:, :, j * width:(j + 1) * width].transpose(0, 2, 1).reshape(e * width, k))

    def check(self, name: str) -> None:
        """The arrays fit each other (as read from a package): IngotError naming `name` otherwise."""
        ok = self.q.ndim == 3
        if ok and self.qdtype is None:
            ok = self.q.dtype == np.float32 and all(getattr(self, p) is None for p in self.PARAMS)
        elif ok:
            e, k, n = self.shape
            block = self.block_size
            ok = (self.q.dtype == self.qdtype.storage and block >= 1 and k % block == 0
                  and all(getattr(self, p) is None or getattr(self, p).shape == (e, k // block, n)
                          for p in ("scale", "bias", "zero_point"))
                  and (self.scale is not None or self.lut is not None)
                  and (self.lut is None or (self.lut.ndim == 4 and self.lut.shape[:3] == (1, 1, 1))))
        if not ok:
            shape = list(self.shape if self.q.ndim == 3 else self.q.shape)
            raise IngotError(f"expert stack {name} is described as {self.qdtype.name if self.qdtype else 'float32'}"
                             f"{shape}, which its stored arrays do not fit.")


def stored_experts(path: str, tensors, names: list[str], shapes: list[tuple[int, int, int]]) -> dict[str, ExpertStack]:
    """The expert stacks `names` ([E, out, in] GGUF tensors, shapes) in the graph's form, keyed by name;
    stacks that multiply one input side by side under one "a+b" name when their quantized formats allow
    (gate and up: one routed matmul). Stacks already in that form (a package's) are returned as they are."""
    joint = "+".join(names)
    if joint in tensors and isinstance(tensors[joint], ExpertStack):
        return {joint: tensors[joint]}
    if all(isinstance(tensors.get(n), ExpertStack) for n in names):
        return {n: tensors[n] for n in names}
    for n in names:
        if n not in tensors:
            raise IngotError(f"{path}: tensor {n} is missing.")
    ws = [tensors[n] for n in names]
    if all(isinstance(w, QuantizedTensor) for w in ws):
        per_name = [_quantized_experts(path, n, w, s) for n, w, s in zip(names, ws, shapes)]
        try:
            per_expert = [concat_columns(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*per_name)]
        except ValueError:
            per_expert = None
        if per_expert is not None:
            return {joint: _stacked(per_expert)}
    out = {}
    for name, w, (experts, rows, cols) in zip(names, ws, shapes):
        if isinstance(w, QuantizedTensor):
            out[name] = _stacked(_quantized_experts(path, name, w, (experts, rows, cols)))
            continue
        a = np.asarray(w, np.float32)
        if a.size != experts * rows * cols:
            raise IngotError(f"{path}: tensor {name} has shape {a.shape}, expected {[experts, rows, cols]}.")
        out[name] = ExpertStack(np.ascontiguousarray(a.reshape(experts, rows, cols).transpose(0, 2, 1)))
    return out


def expert_matrices(weights: Weights, names: str | list[str], shapes: tuple[int, int, int] | list) -> Tensor | list[Tensor]:
    """The [E, out, in] expert stack `names` as an [E, in, out] float tensor (a dequantize when quantized).
    Several stacks (a list of names and shapes) that multiply the same input come side by side, one
    [E, in, sum(out)] tensor, when they share a quantized format (gate and up: one routed matmul);
    else a list, one tensor each."""
    single = isinstance(names, str)
    if single:
        names, shapes = [names], [shapes]
    stacks = stored_experts(weights.path, weights.tensors, names, shapes)
    made = [_constant(weights.g, name, stack) for name, stack in stacks.items()]
    return made[0] if len(made) == 1 else made


def _quantized_experts(path: str, name: str, w: QuantizedTensor, shape: tuple[int, int, int]) -> list[QuantizedTensor]:
    """Each expert of the GGUF row stack w [E * rows, cols] as its own k-major [cols, rows] tensor."""
    experts, rows, cols = shape
    if w.shape != (experts * rows, cols) or w.block_axis != 1 or (w.lut is not None and w.lut.shape[:2] != (1, 1)):
        raise IngotError(f"{path}: tensor {name} has shape {w.shape}, expected the rows of {list(shape)}.")
    part = lambda p, e: None if p is None else p[e * rows:(e + 1) * rows]  # noqa: E731
    return [QuantizedTensor(w.q[e * rows:(e + 1) * rows], w.qdtype, (rows, cols), w.block_size, part(w.scale, e),
                            part(w.bias, e), part(w.zero_point, e), w.source, lut=w.lut).to_k_major()
            for e in range(experts)]


def _stacked(per_expert: list[QuantizedTensor]) -> ExpertStack:
    """The experts' k-major tensors stacked: q [E, in, out], parameters [E, in / block, out]."""
    first = per_expert[0]
    stack = lambda field: None if getattr(first, field) is None else np.stack([getattr(t, field) for t in per_expert])  # noqa: E731
    return ExpertStack(stack("q"), first.qdtype, first.block_size, stack("scale"), stack("bias"), stack("zero_point"),
                       None if first.lut is None else first.lut[None], first.source)   # lut [1, 1, 1, 2**bits]


def _constant(g: Graph, name: str, s: ExpertStack) -> Tensor:
    """The stack as graph constants (named name, name.scale, ...) and, when quantized, their dequantize."""
    if s.qdtype is None:
        return g.constant(s.q, name=name)
    q = g.constant(s.q, dtype=s.qdtype if s.qdtype.packed else None, name=name)
    params = {k: g.constant(v, name=f"{name}.{k}") for k in ("scale", "zero_point", "bias") if (v := getattr(s, k)) is not None}
    if s.lut is not None:
        return g.dequantize(q, lut=g.constant(s.lut, name=f"{name}.lut"), **params)
    return g.dequantize(q, **params)


def feed_forward(g: Graph, cfg: DecoderConfig, weights: Weights, layer: int, x: Tensor) -> Tensor:
    """The routed SwiGLU experts of `layer`; x: [B*T, dim] -> [B*T, dim]. cfg: n_experts,
    n_experts_used, expert_ffn_dim, norm_top_k (see qwen3moe.Qwen3MoeConfig)."""
    p = f"blk.{layer}."
    e, k, f, dim = cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim, cfg.dim
    probs = g.softmax(linear(g, x, weights.matrix(p + "ffn_gate_inp.weight", (e, dim))), axis=-1)   # [T, E]
    chosen = g.top_k(probs, k)                                                                  # [T, k]
    chance = g.take_along_axis(probs, chosen, axis=-1)                                          # [T, k]
    if cfg.norm_top_k:
        chance = chance / g.sum(chance, axis=-1, keepdims=True)
    rows = g.reshape(x, (-1, 1, dim))                                                           # [T, 1, dim]
    gate_up = expert_matrices(weights, [p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"], [(e, f, dim)] * 2)
    if isinstance(gate_up, list):
        gate, up = (g.gather_matmul(rows, w, chosen) for w in gate_up)                          # [T, k, f]
    else:
        both = g.gather_matmul(rows, gate_up, chosen)                                           # [T, k, 2f]
        gate, up = g.slice(both, [0, 0, 0], [None, None, f]), g.slice(both, [0, 0, f], [None, None, 2 * f])
    down = g.gather_matmul(g.silu(gate) * up, expert_matrices(weights, p + "ffn_down_exps.weight", (e, dim, f)),
                           chosen)                                                              # [T, k, dim]
    return g.sum(down * g.reshape(chance, (-1, k, 1)), axis=1)                                  # [T, dim]
