"""Gemma 2 and Gemma 3 decoders (text) as an Ingot graph, from the shared blocks.

What differs from Llama, per layer i (GGUF names; the file stores the RMSNorm weights as 1 + w,
which is what Gemma's norm multiplies by, so they are used as they are):

    x = token_embd[tokens] * sqrt(dim)                                   [B*T, dim]
    a = attention(rms_norm(x, attn_norm))        q, k: [B, H, T, hd], hd = attention.key_length (!= dim / H)
          Gemma 3: rms_norm of each q and k head (attn_q_norm, attn_k_norm) before RoPE
          sliding layers (window w): each query sees its last w positions, RoPE base rope_base_local
            Gemma 2: even layers (pattern 2, w 4096);  Gemma 3: 5 of every 6 (pattern 6, w 512, base 10000)
          global layers: RoPE base rope.freq_base, divided by the linear rope scaling (Gemma 3 4B+)
          Gemma 2: scores capped by 50 * tanh(s / 50) (attn_logit_softcapping)
          scale 1 / sqrt(hd) (27B: 1 / sqrt(dim / H), as llama.cpp and HF's query_pre_attn_scalar do)
    x = x + rms_norm(a, post_attention_norm)
    x = x + rms_norm(down(gelu_tanh(gate(h)) * up(h)), post_ffw_norm),  h = rms_norm(x, ffn_norm)
    logits = rms_norm(x, output_norm) @ token_embd.T      Gemma 2: 30 * tanh(logits / 30)

NEOX (half-split) RoPE; Q/K are not permuted in the file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import IngotError
from ..graph import Graph
from .blocks import (MAX_DIMENSION, DecoderConfig, DecoderGraph, Key, Weights, attention, checked_batch, checked_rows,
                     config_from_gguf, embedding, feed_forward, inputs, output, rms_norm, row_inputs, rope_frequencies)

ARCHITECTURES = ("gemma2", "gemma3")
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}        # llama.cpp's set_swa_pattern; HF's layer_types
LOCAL_ROPE_BASE = {"gemma2": 0.0, "gemma3": 10000.0}  # 0: the global base (HF's rope_local_base_freq)
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}        # the 27B models scale scores by 1 / sqrt(dim / heads)

# Gemma's turn format, for a file without tokenizer.chat_template: no system role (a system message is
# put before the first user message's text), the assistant is "model", each turn ends with <end_of_turn>
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set system.text = system.text + message['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + system.text"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% set system.text = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# GGUF metadata `{architecture}.{key}` -> GemmaConfig field
GGUF_KEYS = (
    Key("block_count", "n_layers", int, required=True),
    Key("embedding_length", "dim", int, required=True),
    Key("attention.head_count", "n_heads", int, required=True),
    Key("attention.head_count_kv", "n_kv_heads", int),
    Key("feed_forward_length", "ffn_dim", int, required=True),
    Key("attention.key_length", "head_dim", int, minimum=0),
    Key("rope.freq_base", "rope_base", float, exclusive_minimum=True),
    Key("rope.freq_base_swa", "rope_base_local", float, exclusive_minimum=True),
    Key("rope.dimension_count", "rope_dims", int, minimum=0),
    Key("attention.layer_norm_rms_epsilon", "norm_eps", float, maximum=1.0),
    Key("context_length", "context_length", int),
    Key("attention.sliding_window", "sliding_window", int, minimum=0),
    Key("attn_logit_softcapping", "attn_softcap", float),
    Key("final_logit_softcapping", "final_softcap", float),
    Key("attention.scale", "attention_scale", float, exclusive_minimum=True, maximum=1e3),
)


@dataclass
class GemmaConfig(DecoderConfig):
    rope_interleaved: bool = False
    norm_eps: float = 1e-6
    tied_embeddings: bool = True
    qk_norm: bool = False               # Gemma 3
    sliding_window: int = 0             # keys a sliding layer sees (0: none)
    sliding_pattern: int = 0            # layer i slides when i % pattern < pattern - 1
    rope_base_local: float = 0.0        # sliding layers' RoPE base (0: rope_base)
    attn_softcap: float = 0.0           # Gemma 2: 50
    final_softcap: float = 0.0          # Gemma 2: 30
    attention_scale: float = 0.0        # 0: 1 / sqrt(head_dim)

    family = "gemma"

    def validate(self) -> None:
        super().validate()
        for name in ("sliding_window", "sliding_pattern"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= MAX_DIMENSION:
                raise IngotError(f"gemma: {name} must be an integer in 0..{MAX_DIMENSION}, not {value!r}.")
        for name in ("rope_base_local", "attn_softcap", "final_softcap", "attention_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value) or value < 0:
                raise IngotError(f"gemma: {name} must be a finite number >= 0, not {value!r}.")

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: global attention)."""
        p = self.sliding_pattern
        return self.sliding_window if self.sliding_window and p and layer % p < p - 1 else 0

    @classmethod
    def from_gguf(cls, model) -> "GemmaConfig":
        arch = model.architecture
        if arch not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {arch!r} is not a Gemma one ({', '.join(ARCHITECTURES)}).")
        cfg = config_from_gguf(cls, model, GGUF_KEYS, sliding_pattern=SLIDING_PATTERN[arch], qk_norm=arch == "gemma3")
        if cfg.rope_scaling == "yarn":
            raise IngotError(f"{model.path}: YaRN RoPE scaling ({arch}.rope.scaling.type) is not supported for {arch}.")
        if model.get(f"{arch}.rope.freq_base_swa") is None:
            cfg.rope_base_local = LOCAL_ROPE_BASE[arch]
        if not cfg.attention_scale:
            big = cfg.n_layers == LAYERS_OF_27B[arch]
            cfg.attention_scale = 1.0 / math.sqrt(cfg.dim / cfg.n_heads if big else cfg.head_dim)
        return cfg


Config = GemmaConfig


def build(cfg: GemmaConfig, tensors: dict, path: str = "", adapter_sites=(), all_logits: bool = False,
          batch: int = 1, rows: int = 0, pool: int = 0) -> DecoderGraph:
    """The Gemma 2/3 decoder graph over GGUF-named tensors; arguments as `llama.build` (rows=R: R
    independent sequences, one token each, for `ingot serve`; pool=S: over a KV pool)."""
    batch, rows = checked_batch(batch), checked_rows(rows)
    if pool and not rows:
        raise IngotError(f"build: pool={pool} needs rows > 0 (a pool serves a rows decoder).")
    if rows and batch != 1:
        raise IngotError(f"build: rows={rows} decodes independent sequences; it takes batch=1, not {batch}.")
    g = Graph()
    weights = Weights(g, tensors, path, adapter_sites)
    tokens, pos, last = row_inputs(g, rows, pool) if rows else inputs(g)
    global_freq = rope_frequencies(cfg.rope_dims, cfg.rope_base, cfg.rope_scale)   # scaling: global layers only
    local_freq = rope_frequencies(cfg.rope_dims, cfg.rope_base_local or cfg.rope_base)
    scale = cfg.attention_scale or 1.0 / math.sqrt(cfg.head_dim)
    x, embed = embedding(g, cfg, weights, tokens)                                # [B*T, dim]
    x = x * np.float32(math.sqrt(cfg.dim))
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        window = cfg.window(layer)
        h = rms_norm(g, cfg, weights, p + "attn_norm.weight", x)
        a = attention(g, cfg, weights, layer, h, pos, local_freq if window else global_freq, batch, qk_norm=cfg.qk_norm,
                      window=window, softcap=cfg.attn_softcap, scale=scale,
                      rope_base=(cfg.rope_base_local or cfg.rope_base) if window else cfg.rope_base, rows=rows)   # [B*T, dim]
        x = x + rms_norm(g, cfg, weights, p + "post_attention_norm.weight", a)
        h = rms_norm(g, cfg, weights, p + "ffn_norm.weight", x)
        f = feed_forward(g, cfg, weights, layer, h, activation="gelu_tanh")      # GeGLU
        x = x + rms_norm(g, cfg, weights, p + "post_ffw_norm.weight", f)
    logits = output(g, cfg, weights, x, embed, last, batch, all_logits or bool(rows), softcap=cfg.final_softcap)
    return DecoderGraph(g, tokens, pos, last, logits, cfg, inputs=weights.inputs, batch=batch)


def random_weights(cfg: GemmaConfig, seed: int = 0, **kwargs) -> dict:
    """GGUF-named random weights of a Gemma config's shapes, for tests and GPU runs: llama.random_weights
    (its keyword arguments; QK-norms when cfg.qk_norm, no output.weight when tied) plus the post-norms.

        >>> t = random_weights(GemmaConfig(2, 64, 2, 1, 96, 100, head_dim=32, qk_norm=True), dense_dtype="float32")
        >>> t["blk.1.post_ffw_norm.weight"].shape, t["blk.0.attn_q_norm.weight"].shape
        ((64,), (32,))
    """
    from .llama import random_weights as llama_weights

    t = llama_weights(cfg, seed=seed, **kwargs)
    rng = np.random.default_rng(seed + 1)
    for i in range(cfg.n_layers):
        for name in ("post_attention_norm", "post_ffw_norm"):
            t[f"blk.{i}.{name}.weight"] = (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
    return t
