"""Qwen3 (dense): the Llama layout with QK-norm (rms_norm of each q and k head before RoPE), NEOX
RoPE, no q/k/v biases, and a head_dim from the metadata (attention.key_length) that may differ from
dim / heads (Qwen3-0.6B: dim 1024, 16 heads of 128).

    x = x + attention(rms_norm(x))      q, k: [B, H, T, hd] -> rms_norm over hd -> rope
    x = x + swiglu(rms_norm(x))
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import IngotError
from . import llama
from .blocks import config_from_gguf

ARCHITECTURES = ("qwen3",)
GGUF_KEYS = llama.GGUF_KEYS   # the same table: block_count, embedding_length, attention.key_length, ...


@dataclass
class Qwen3Config(llama.LlamaConfig):
    qk_norm: bool = True
    rope_interleaved: bool = False      # llama.cpp runs Qwen3 with NEOX (half-split) RoPE

    family = "qwen3"

    @classmethod
    def from_gguf(cls, model) -> "Qwen3Config":
        if model.architecture not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {model.architecture!r} is not Qwen3.")
        return config_from_gguf(cls, model, GGUF_KEYS, rope_interleaved=False, qk_norm=True)


Config = Qwen3Config
build = llama.build                     # the Llama graph; cfg.qk_norm adds the per-head norms
random_weights = llama.random_weights
