"""Phi-3 and Phi-3.5 (GGUF architecture phi3): the Llama layout with fused tensors and LongRoPE.

What differs from Llama (GGUF names):

    blk.L.attn_qkv.weight  [(H + 2 Hkv) * hd, dim]   q, k and v rows one after another
    blk.L.ffn_up.weight    [2 * ffn, dim]            gate rows, then up rows (SwiGLU)
    rope_factors_long.weight, rope_factors_short.weight  [hd / 2]   LongRoPE (the 128k models; see
        blocks.decoder_rope), with rope.scaling.original_context_length and rope.scaling.attn_factor
    attention.sliding_window (when the file gives one): every layer sees its last w positions

NEOX (half-split) RoPE, Q/K not permuted. The fused tensors are split into the usual attn_q/k/v and
ffn_gate/up rows (views, no copy), which llama.build multiplies side by side again as one matmul.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import IngotError
from ..quant.formats import QuantizedTensor
from . import llama
from .blocks import MAX_DIMENSION, DecoderConfig, DecoderGraph, Key, config_from_gguf

ARCHITECTURES = ("phi3",)
GGUF_KEYS = llama.GGUF_KEYS + (Key("attention.sliding_window", "sliding_window", int, minimum=0),)

# Phi-3's turn format, for a file without tokenizer.chat_template; each turn ends with <|end|>
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass
class Phi3Config(DecoderConfig):
    rope_interleaved: bool = False
    sliding_window: int = 0             # keys every layer sees (0: all)

    family = "phi3"

    def validate(self) -> None:
        super().validate()
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or not 0 <= w <= MAX_DIMENSION:
            raise IngotError(f"phi3: sliding_window must be an integer in 0..{MAX_DIMENSION}, not {w!r}.")

    def window(self, layer: int) -> int:
        return self.sliding_window

    @classmethod
    def from_gguf(cls, model) -> "Phi3Config":
        if model.architecture not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {model.architecture!r} is not Phi-3.")
        return config_from_gguf(cls, model, GGUF_KEYS, rope_interleaved=False)


Config = Phi3Config


def _rows(w, start: int, stop: int):
    """Rows start..stop of an [out, in] weight as GGUF stores it (a view)."""
    if isinstance(w, QuantizedTensor):
        if w.block_axis != 1 or (w.lut is not None and w.lut.shape[0] != 1):
            raise IngotError("phi3: fused tensors are read in GGUF's row form only.")
        part = lambda p: None if p is None else p[start:stop]  # noqa: E731
        return QuantizedTensor(w.q[start:stop], w.qdtype, (stop - start, w.shape[1]), w.block_size, part(w.scale),
                               part(w.bias), part(w.zero_point), w.source, lut=w.lut)
    return np.asarray(w)[start:stop]


class Unfused(Mapping):
    """The tensors with each layer's attn_qkv split into attn_q/k/v and ffn_up [2F] into ffn_gate/up;
    the fused names are hidden. Tensors without fused ones (an Ingot LLM package) pass through."""

    def __init__(self, cfg: Phi3Config, tensors: Mapping, path: str = ""):
        self.tensors, self.path = tensors, path
        q, kv, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
        self.parts: dict[str, tuple[str, int, int]] = {}   # name -> (fused name, first row, end row)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            if p + "attn_qkv.weight" in tensors:
                self._split(p + "attn_qkv.weight", {p + "attn_q.weight": q, p + "attn_k.weight": kv, p + "attn_v.weight": kv})
            if p + "ffn_gate.weight" not in tensors and p + "ffn_up.weight" in tensors:
                self._split(p + "ffn_up.weight", {p + "ffn_gate.weight": f, p + "ffn_up.weight": f})
        self.hidden = {fused for fused, _, _ in self.parts.values()} - set(self.parts)   # attn_qkv
        self._last: tuple[str, object] | None = None       # the fused tensor read last (lazy files convert per lookup)

    def _split(self, fused: str, sizes: dict[str, int]) -> None:
        shape = self.tensors.shape(fused) if hasattr(self.tensors, "shape") else self.tensors[fused].shape
        if int(shape[0]) != sum(sizes.values()):
            raise IngotError(f"{self.path}: tensor {fused} has {shape[0]} rows, expected {sum(sizes.values())} "
                             f"({' + '.join(str(n) for n in sizes.values())}).")
        at = 0
        for name, n in sizes.items():
            self.parts[name] = (fused, at, at + n)
            at += n

    def __getitem__(self, name: str):
        if name in self.parts:
            fused, start, stop = self.parts[name]
            if self._last is None or self._last[0] != fused:
                self._last = (fused, self.tensors[fused])
            return _rows(self._last[1], start, stop)
        if name in self.hidden:
            raise KeyError(name)
        return self.tensors[name]

    def __iter__(self):
        yield from (n for n in self.tensors if n not in self.hidden)
        yield from (n for n in self.parts if n not in self.tensors)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        return name in self.parts or (name in self.tensors and name not in self.hidden)


def unfused(cfg: Phi3Config, tensors: Mapping, path: str = "") -> Unfused:
    """The tensors as the builder reads them (what an Ingot LLM package stores)."""
    return Unfused(cfg, tensors, path)


def build(cfg: Phi3Config, tensors: Mapping, path: str = "", adapter_sites=(), all_logits: bool = False, batch: int = 1,
          rows: int = 0, pool: int = 0) -> DecoderGraph:
    """The Phi-3 decoder graph over GGUF-named tensors (fused or split); arguments as `llama.build`."""
    return llama.build(cfg, Unfused(cfg, tensors, path), path, adapter_sites, all_logits, batch, rows, pool=pool)
