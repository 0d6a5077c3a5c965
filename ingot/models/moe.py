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
experts' packed weights multiplied, no float copy).
"""
from __future__ import annotations

import numpy as np

from ..errors import IngotError
from ..graph import Graph, Tensor
from ..quant.formats import QuantizedTensor, concat_columns
from .blocks import DecoderConfig, Weights, linear


def expert_matrices(weights: Weights, names: str | list[str], shapes: tuple[int, int, int] | list) -> Tensor | list[Tensor]:
    """The [E, out, in] expert stack `names` as an [E, in, out] float tensor (a dequantize when quantized).
    Several stacks (a list of names and shapes) that multiply the same input come side by side, one
    [E, in, sum(out)] tensor, when they share a quantized format (gate and up: one routed matmul);
    else a list, one tensor each."""
    if isinstance(names, str):
        names, shapes = [names], [shapes]
    g = weights.g
    ws = [weights.get(n) for n in names]
    if all(isinstance(w, QuantizedTensor) for w in ws):
        per_name = [_quantized_experts(weights.path, n, w, s) for n, w, s in zip(names, ws, shapes)]
        try:
            per_expert = [concat_columns(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*per_name)]
        except ValueError:
            per_expert = None
        if per_expert is not None:
            return _stack_constant(g, "+".join(names), per_expert)
    if len(names) > 1:   # formats that do not concatenate: one tensor each
        return [expert_matrices(weights, n, s) for n, s in zip(names, shapes)]
    (name,), (w,), ((experts, rows, cols),) = names, ws, shapes
    if isinstance(w, QuantizedTensor):
        return _stack_constant(g, name, _quantized_experts(weights.path, name, w, shapes[0]))
    a = np.asarray(w, np.float32)
    if a.size != experts * rows * cols:
        raise IngotError(f"{weights.path}: tensor {name} has shape {a.shape}, expected {[experts, rows, cols]}.")
    return g.constant(np.ascontiguousarray(a.reshape(experts, rows, cols).transpose(0, 2, 1)), name=name)


def _quantized_experts(path: str, name: str, w: QuantizedTensor, shape: tuple[int, int, int]) -> list[QuantizedTensor]:
    """Each expert of the GGUF row stack w [E * rows, cols] as its own k-major [cols, rows] tensor."""
    experts, rows, cols = shape
    if w.shape != (experts * rows, cols) or w.block_axis != 1 or (w.lut is not None and w.lut.shape[:2] != (1, 1)):
        raise IngotError(f"{path}: tensor {name} has shape {w.shape}, expected the rows of {list(shape)}.")
    part = lambda p, e: None if p is None else p[e * rows:(e + 1) * rows]  # noqa: E731
    return [QuantizedTensor(w.q[e * rows:(e + 1) * rows], w.qdtype, (rows, cols), w.block_size, part(w.scale, e),
                            part(w.bias, e), part(w.zero_point, e), w.source, lut=w.lut).to_k_major()
            for e in range(experts)]


def _stack_constant(g: Graph, name: str, per_expert: list[QuantizedTensor]) -> Tensor:
    """dequantize of the experts' k-major tensors stacked: q [E, in, out], parameters [E, in / block, out]."""
    first = per_expert[0]
    stack = lambda field: None if getattr(first, field) is None else np.stack([getattr(t, field) for t in per_expert])  # noqa: E731
    q = g.constant(stack("q"), dtype=first.qdtype if first.qdtype.packed else None, name=name)
    params = {k: g.constant(v, name=f"{name}.{k}") for k in ("scale", "zero_point", "bias") if (v := stack(k)) is not None}
    if first.lut is not None:
        return g.dequantize(q, lut=g.constant(first.lut[None], name=f"{name}.lut"), **params)   # [1, 1, 1, 2**bits]
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
