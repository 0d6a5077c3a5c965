"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral 7B, Qwen2/2.5) as an Ingot graph.

One graph holds the weights (quantized weights stay quantized: each linear is
dequantize -> transpose -> matmul, which the compiler fuses into quantized_matmul), the KV cache
as two variables per layer, and a token placeholder whose length is dynamic (see models/blocks.py).

    tokens: int32 [T]   pos: int32 []   last: int32 []   ->   logits: float32 [1, vocab]

build(batch=B) decodes B sequences in lockstep (one shared position): tokens [B*T], KV caches
[B, nkv, ctx, hd], logits [B, vocab]. Mistral 7B and SmolLM2 files say "llama"; Qwen2 differs in
its q/k/v biases (found in the tensors) and NEOX RoPE; Qwen3 (qwen3.py) adds QK-norm. SmolLM3
(smollm3) leaves RoPE out of every 4th layer (NoPE). Mistral 3 / Ministral 3 text models (mistral3)
are Llama's layout with YaRN in its mscale form (see blocks.yarn_magnitude) and Llama 4's attention
temperature: q at position p times 1 + beta ln(1 + floor(p / L)), beta = attention.temperature_scale,
L = attention.temperature_length or else rope.scaling.original_context_length (llama.cpp's reading).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph
from ..quant.formats import QuantizedTensor
from .blocks import (MAX_DIMENSION, DecoderConfig, DecoderGraph, Key, Weights, adapted, attention, checked_batch, config_from_gguf,  # noqa: F401
                     decoder_rope, embedding, feed_forward, inputs, linear, linear_split, output, rms_norm, rope_frequencies,
                     checked_rows, row_inputs, temperature_table)

ARCHITECTURES = ("llama", "mistral", "qwen2", "smollm", "smollm3", "mistral3")
NO_ROPE_INTERVAL = {"smollm3": 4}      # every 4th layer has no RoPE (llama.cpp's n_no_rope_layer_step; no GGUF key)
LlamaGraph = DecoderGraph

# GGUF metadata `{architecture}.{key}` -> LlamaConfig field
GGUF_KEYS = (
    Key("block_count", "n_layers", int, required=True),
    Key("embedding_length", "dim", int, required=True),
    Key("attention.head_count", "n_heads", int, required=True),
    Key("attention.head_count_kv", "n_kv_heads", int),
    Key("feed_forward_length", "ffn_dim", int, required=True),
    Key("attention.key_length", "head_dim", int, minimum=0),
    Key("rope.freq_base", "rope_base", float, exclusive_minimum=True),
    Key("rope.dimension_count", "rope_dims", int, minimum=0),
    Key("attention.layer_norm_rms_epsilon", "norm_eps", float, maximum=1.0),
    Key("context_length", "context_length", int),
)
TEMPERATURE_KEYS = (
    Key("attention.temperature_scale", "attn_temperature_scale", float, maximum=1e6),
    Key("attention.temperature_length", "attn_temperature_length", int),
)


@dataclass
class LlamaConfig(DecoderConfig):
    qk_norm: bool = False               # rms_norm of each q and k head before RoPE (Qwen3)
    no_rope_interval: int = 0           # n > 0: layers n-1, 2n-1, ... attend without RoPE (SmolLM3's NoPE); 0: none
    attn_temperature_scale: float = 0.0   # Mistral 3: beta of q's factor 1 + beta ln(1 + floor(p / length)); 0: none
    attn_temperature_length: int = 0      # its length (positions per step of the floor)

    def validate(self) -> None:
        super().validate()
        beta, length = self.attn_temperature_scale, self.attn_temperature_length
        if isinstance(beta, bool) or not isinstance(beta, (int, float, np.integer, np.floating)) or not math.isfinite(beta) \
                or beta < 0 or (beta and (isinstance(length, bool) or not isinstance(length, (int, np.integer))
                                          or not 1 <= length <= MAX_DIMENSION)):
            raise IngotError(f"{self.family}: attention temperature needs a finite scale >= 0 and, when it is not 0, a "
                             f"length in 1..{MAX_DIMENSION}, not {beta!r}, {length!r}.")
        n = self.no_rope_interval
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_DIMENSION:
            raise IngotError(f"{self.family}: no_rope_interval must be an integer in 0..{MAX_DIMENSION}, not {n!r}.")

    def rope_in(self, layer: int) -> bool:
        """Whether `layer` rotates q and k (False for a NoPE layer)."""
        n = self.no_rope_interval
        return not n or (layer + 1) % n != 0

    family = "llama"

    @classmethod
    def from_gguf(cls, model) -> "LlamaConfig":
        if model.architecture not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {model.architecture!r} is not a Llama-family one "
                             f"({', '.join(ARCHITECTURES)}).")
        # llama.cpp runs qwen2 with NEOX (half-split) RoPE; llama files store Q/K permuted for interleaved
        arch = model.architecture
        computed = {}
        if arch == "mistral3":
            from ..untrusted import metadata_int
            original = f"{arch}.rope.scaling.original_context_length"
            if model.get(f"{arch}.attention.temperature_scale") and model.get(f"{arch}.attention.temperature_length") is None:
                if model.get(original) is None:
                    raise IngotError(f"{model.path}: metadata lacks {arch}.attention.temperature_length (or {original}), "
                                     f"which the attention temperature {arch}.attention.temperature_scale needs.")
                computed["attn_temperature_length"] = metadata_int(model, original, None, 1, MAX_DIMENSION)
        return config_from_gguf(cls, model, GGUF_KEYS + (TEMPERATURE_KEYS if arch == "mistral3" else ()),
                                rope_interleaved=arch != "qwen2", no_rope_interval=NO_ROPE_INTERVAL.get(arch, 0), **computed)


Config = LlamaConfig


def build(cfg: LlamaConfig, tensors: dict, path: str = "", adapter_sites=(), all_logits: bool = False,
          batch: int = 1, rows: int = 0, ffn=feed_forward, pool: int = 0) -> DecoderGraph:
    """The decoder graph over GGUF-named tensors (numpy arrays or QuantizedTensors).

    adapter_sites: weight names (e.g. "blk.0.attn_q.weight") whose outputs add a called adapter
    (see `blocks.adapted`); all_logits: logits for every position [T, vocab] instead of row `last`.
    batch: B sequences decoded in lockstep (one shared position): tokens [B*T] sequence-major, KV
    caches [B, nkv, ctx, hd], logits [B, vocab] (row `last` of each sequence) or [B*T, vocab].
    rows=R (continuous batching, `ingot serve`): R independent sequences, one token each, tokens [R],
    positions [R] (each row's own), a cache per row (blk.L.k_cache.r [1, nkv, ctx, hd]), logits [R, vocab].
    pool=S (with rows): the caches are one pool of S entries per layer and a `slots` feed [R] says
    which entry each row uses (blocks.pool_row_attention: fixed buffers, a CUDA graph per R).
    ffn: the feed-forward block, (g, cfg, weights, layer, x) -> x's update (SwiGLU; moe.feed_forward).

        >>> m = build(cfg, random_weights(cfg), batch=4)                     # doctest: +SKIP
        >>> m.compile(1).run({"tokens": ids4, "pos": np.int32(p), "last": np.int32(0)})  # doctest: +SKIP
    """
    batch, rows = checked_batch(batch), checked_rows(rows)
    if pool and not rows:
        raise IngotError(f"build: pool={pool} needs rows > 0 (a pool serves a rows decoder).")
    if rows and batch != 1:
        raise IngotError(f"build: rows={rows} decodes independent sequences; it takes batch=1, not {batch}.")
    g = Graph()
    weights = Weights(g, tensors, path, adapter_sites)
    tokens, pos, last = row_inputs(g, rows, pool) if rows else inputs(g)
    inv_freq, scale = decoder_rope(cfg, tensors)                          # scale: None but for YaRN
    q_scale = temperature_table(g, cfg, getattr(cfg, "attn_temperature_scale", 0.0),
                                getattr(cfg, "attn_temperature_length", 0))   # Mistral 3; None elsewhere
    x, embed = embedding(g, cfg, weights, tokens)                         # [B*T, dim]
    qk_norm = getattr(cfg, "qk_norm", False)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        h = rms_norm(g, cfg, weights, p + "attn_norm.weight", x)
        window = cfg.window(layer) if hasattr(cfg, "window") else 0         # Phi-3's sliding window
        layer_freq = inv_freq if not hasattr(cfg, "rope_in") or cfg.rope_in(layer) else None   # None: NoPE
        x = x + attention(g, cfg, weights, layer, h, pos, layer_freq, batch, qk_norm=qk_norm, scale=scale, rows=rows,
                          window=window, q_scale=q_scale)
        h = rms_norm(g, cfg, weights, p + "ffn_norm.weight", x)
        x = x + ffn(g, cfg, weights, layer, h)                            # SwiGLU (or experts)
    logits = output(g, cfg, weights, x, embed, last, batch, all_logits or bool(rows))  # [B, vocab]
    return DecoderGraph(g, tokens, pos, last, logits, cfg, inputs=weights.inputs, batch=batch)


def random_weights(cfg: LlamaConfig, seed: int = 0, block_size: int = 32, qdtype: dt.DType = dt.uint4,
                   k_major: bool = False, f16_params: bool = False, matrix=None, dense_dtype: str | None = None) -> dict:
    """GGUF-named random weights of the config's shapes (quantized matrices), for tests and GPU runs.

    k_major=True makes the quantized matrices straight in the builder's k-major form (random bytes,
    no repacking: Llama-3-8B shapes in seconds); f16_params rounds scales as a Q4_1 file stores them.
    matrix(rng, rows, cols), when given, makes each [out, in] matrix instead (float weights, say).
    dense_dtype="float32" or "bfloat16" makes unquantized [out, in] matrices of that dtype, normal
    with standard deviation 1/sqrt(in) (the same draws for both, rounded; norm vectors stay float32):

        >>> t = random_weights(LlamaConfig(1, 64, 4, 2, 128, 100), dense_dtype="bfloat16")
        >>> t["blk.0.attn_q.weight"].dtype.name, t["blk.0.attn_norm.weight"].dtype.name
        ('bfloat16', 'float32')
    """
    if dense_dtype is not None:
        if matrix is not None:
            raise IngotError("random_weights: give matrix= or dense_dtype=, not both.")
        if dense_dtype not in ("float32", "bfloat16"):
            raise IngotError(f"random_weights: dense_dtype must be 'float32' or 'bfloat16', not {dense_dtype!r}.")
        storage = dt.float32.numpy if dense_dtype == "float32" else dt.bfloat16.storage
        matrix = lambda rng, rows, cols: (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(storage)  # noqa: E731
    rng = np.random.default_rng(seed)
    levels = 16 if qdtype.bits == 4 else 256

    def quantized(rows, cols):  # the [rows = out, cols = in] weight
        nb = cols // block_size
        if k_major:
            width = rows // 2 if qdtype.packed else rows
            q = rng.integers(0, 256, size=(cols, width), dtype=np.uint8).view(qdtype.storage)
            scale = rng.random((nb, rows), np.float32)
        else:
            values = rng.integers(0, levels, size=(rows, cols)) - (levels // 2 if qdtype.kind == "i" else 0)
            q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
            scale = rng.random((rows, nb), np.float32)
        scale = (scale * 0.02 / math.sqrt(cols / 64) + 1e-3).astype(np.float32)
        if f16_params:
            scale = scale.astype(np.float16).astype(np.float32)
        bias = (-scale * (levels / 2)).astype(np.float32) if qdtype.kind == "u" else None
        shape = (cols, rows) if k_major else (rows, cols)
        return QuantizedTensor(q, qdtype, shape, block_size, scale, bias, block_axis=0 if k_major else 1)

    if matrix is not None:
        quantized = lambda rows, cols: matrix(rng, rows, cols)  # noqa: E731
    hd = cfg.head_dim
    t = {"token_embd.weight": quantized(cfg.vocab_size, cfg.dim),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)}
    if not cfg.tied_embeddings:
        t["output.weight"] = quantized(cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
        t[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
        t[p + "attn_q.weight"] = quantized(cfg.n_heads * hd, cfg.dim)
        t[p + "attn_k.weight"] = quantized(cfg.n_kv_heads * hd, cfg.dim)
        t[p + "attn_v.weight"] = quantized(cfg.n_kv_heads * hd, cfg.dim)
        t[p + "attn_output.weight"] = quantized(cfg.dim, cfg.n_heads * hd)
        t[p + "ffn_gate.weight"] = quantized(cfg.ffn_dim, cfg.dim)
        t[p + "ffn_up.weight"] = quantized(cfg.ffn_dim, cfg.dim)
        t[p + "ffn_down.weight"] = quantized(cfg.dim, cfg.ffn_dim)
        if getattr(cfg, "qk_norm", False):
            t[p + "attn_q_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
            t[p + "attn_k_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        if cfg.qkv_bias:
            for n, rows in (("attn_q.bias", cfg.n_heads * hd), ("attn_k.bias", cfg.n_kv_heads * hd), ("attn_v.bias", cfg.n_kv_heads * hd)):
                t[p + n] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
    return t
