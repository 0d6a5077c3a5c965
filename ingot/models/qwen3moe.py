"""Qwen3-MoE (GGUF architecture qwen3moe): Qwen3's attention (QK-norm, NEOX RoPE, head_dim from
attention.key_length) with a mixture-of-experts feed-forward in every layer (models/moe.py): a
softmax router picks expert_used_count of expert_count SwiGLU experts of expert_feed_forward_length,
their outputs weighted by the renormalised router probabilities (llama.cpp always renormalises for
qwen3moe; transformers' GGUF reader sets norm_topk_prob). No shared experts, no dense layers.

    x = x + attention(rms_norm(x))          (as qwen3.py)
    x = x + moe.feed_forward(rms_norm(x))
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import IngotError
from . import llama, moe
from .blocks import DecoderGraph, Key, config_from_gguf
from .qwen3 import Qwen3Config

ARCHITECTURES = ("qwen3moe",)
MAX_EXPERTS = 1 << 12
GGUF_KEYS = llama.GGUF_KEYS + (
    Key("expert_count", "n_experts", int, required=True),
    Key("expert_used_count", "n_experts_used", int, required=True),
    Key("expert_feed_forward_length", "expert_ffn_dim", int, required=True),
)
GATING_SOFTMAX = 1      # {arch}.expert_gating_func: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    n_experts: int = 1
    n_experts_used: int = 1
    expert_ffn_dim: int = 1
    norm_top_k: bool = True             # the chosen experts' probabilities renormalised to sum to 1

    family = "qwen3moe"

    def validate(self) -> None:
        super().validate()
        for name in ("n_experts", "n_experts_used", "expert_ffn_dim"):
            value = getattr(self, name)
            top = MAX_EXPERTS if name != "expert_ffn_dim" else 1 << 24
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise IngotError(f"qwen3moe: {name} must be an integer in 1..{top}, not {value!r}.")
        if self.n_experts_used > self.n_experts:
            raise IngotError(f"qwen3moe: {self.n_experts_used} experts used per token, but only {self.n_experts} exist.")

    @classmethod
    def from_gguf(cls, model) -> "Qwen3MoeConfig":
        arch = model.architecture
        if arch not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {arch!r} is not Qwen3-MoE.")
        for key, plain in (("expert_shared_count", 0), ("expert_gating_func", GATING_SOFTMAX),
                           ("leading_dense_block_count", 0)):
            value = model.get(f"{arch}.{key}")
            if value is not None and value != plain:
                raise IngotError(f"{model.path}: {arch}.{key} = {value!r} is not supported; Ingot runs Qwen3-MoE's "
                                 f"softmax-routed experts with no shared expert and no dense layer.")
        return config_from_gguf(cls, model, GGUF_KEYS, rope_interleaved=False, qk_norm=True)


Config = Qwen3MoeConfig


def build(cfg: Qwen3MoeConfig, tensors, path: str = "", adapter_sites=(), all_logits: bool = False, batch: int = 1,
          rows: int = 0, pool: int = 0) -> DecoderGraph:
    """The Qwen3-MoE decoder graph: llama.build with the experts as the feed-forward; arguments as there."""
    return llama.build(cfg, tensors, path, adapter_sites, all_logits, batch, rows, ffn=moe.feed_forward, pool=pool)
