"""The mixture-of-experts feed-forward block (Qwen3-MoE's, as llama.cpp and transformers run it).

Per token x [dim] of a layer (GGUF names):

    probs   = softmax(x @ ffn_gate_inp.T)                   [E]      the router
    chosen  = top_k(probs, k)                               [k]      experts, most probable first
    weights = probs[chosen] / sum(probs[chosen])            [k]      (norm_top_k; else probs[chosen])
    y       = sum_j weights[j] * down_j(silu(gate_j(x)) * up_j(x)),  j = chosen experts

The experts are 3-D GGUF tensors ffn_gate_exps/ffn_up_exps [E, ffn, dim], ffn_down_exps [E, dim, ffn]
(the importer reads a quantized one as its rows [E * rows, cols]). They become one constant each,
every expert in the k-major form a CPU GEMV reads best: [E, in, out], quantized ones staying
quantized (dequantize -> gather_matmul, which the compiler turns into quantized_gather_matmul: the
chosen experts' packed weights multiplied, no float copy).
"""
from __future__ import annotations

import numpy as np

from ..errors import IngotError
from ..graph import Graph, Tensor
from ..quant.formats import QuantizedTensor
from .blocks import DecoderConfig, Weights, linear


def expert_matrices(weights: Weights, name: str, shape: tuple[int, int, int]) -> Tensor:
    """The [E, out, in] expert stack `name` as an [E, in, out] float tensor (a dequantize when quantized)."""
    g = weights.g
    experts, rows, cols = shape
    w = weights.get(name)
    if isinstance(w, QuantizedTensor):
        if w.shape != (experts * rows, cols) or w.block_axis != 1 or (w.lut is not None and w.lut.shape[:2] != (1, 1)):
            raise IngotError(f"{weights.path}: tensor {name} has shape {w.shape}, expected the rows of {list(shape)}.")
        part = lambda p, e: None if p is None else p[e * rows:(e + 1) * rows]  # noqa: E731
        per_expert = [QuantizedTensor(w.q[e * rows:(e + 1) * rows], w.qdtype, (rows, cols), w.block_size, part(w.scale, e),
                                      part(w.bias, e), part(w.zero_point, e), w.source, lut=w.lut).to_k_major()
                      for e in range(experts)]
        first = per_expert[0]
        stack = lambda field: None if getattr(first, field) is None else np.stack([getattr(t, field) for t in per_expert])  # noqa: E731
        q = g.constant(stack("q"), dtype=first.qdtype if first.qdtype.packed else None, name=name)
        params = {k: g.constant(v, name=f"{name}.{k}") for k in ("scale", "zero_point", "bias") if (v := stack(k)) is not None}
        if first.lut is not None:
            lut = g.constant(first.lut[None], name=f"{name}.lut")                # [1, 1, 1, 2**bits]
            return g.dequantize(q, lut=lut, **params)
        return g.dequantize(q, **params)                                         # params [E, in / block, out]
    a = np.asarray(w, np.float32)
    if a.size != experts * rows * cols:
        raise IngotError(f"{weights.path}: tensor {name} has shape {a.shape}, expected {list(shape)}.")
    return g.constant(np.ascontiguousarray(a.reshape(experts, rows, cols).transpose(0, 2, 1)), name=name)


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
    gate = g.gather_matmul(rows, expert_matrices(weights, p + "ffn_gate_exps.weight", (e, f, dim)), chosen)   # [T, k, f]
    up = g.gather_matmul(rows, expert_matrices(weights, p + "ffn_up_exps.weight", (e, f, dim)), chosen)
    down = g.gather_matmul(g.silu(gate) * up, expert_matrices(weights, p + "ffn_down_exps.weight", (e, dim, f)),
                           chosen)                                                              # [T, k, dim]
    return g.sum(down * g.reshape(chance, (-1, k, 1)), axis=1)                                  # [T, dim]
