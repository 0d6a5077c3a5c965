"""A tiny Llama-family model (float weights, the synthetic SmolLM-style tokenizer) for the
quantization, adapter and package tests."""
import json
from pathlib import Path

import numpy as np

from ingot.models.llama import LlamaConfig, random_weights

FIXTURES = Path(__file__).parent / "fixtures"


def tiny_config(**overrides) -> LlamaConfig:
    cfg = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=296, context_length=64,
               tied_embeddings=True)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_tensors(cfg: LlamaConfig, seed: int = 0) -> dict:
    """GGUF-named float weights [out, in] with a realistic spread (a few large columns)."""
    def matrix(rng, rows, cols):
        w = rng.standard_normal((rows, cols)) / np.sqrt(cols)
        w[:, rng.integers(0, cols, 2)] *= 4
        return w.astype(np.float32)
    return random_weights(cfg, seed, matrix=matrix)


def tokenizer_metadata() -> dict:
    vocabularies = json.loads((FIXTURES / "tokenizer_synthetic.json").read_text())["vocabularies"]
    meta = next(v["metadata"] for v in vocabularies if v["name"] == "bpe-smollm")
    return dict(meta, **{"general.architecture": "llama"})


def save_tiny(path, seed: int = 0) -> None:
    from ingot.llm.package import save_llm

    cfg = tiny_config()
    save_llm(path, cfg, tiny_tensors(cfg, seed), tokenizer_metadata())


def save_tiny_gguf(path, seed: int = 0) -> LlamaConfig:
    """The tiny model as a float32 GGUF file (what `ingot convert` reads); returns its config as the
    file states it (norm_eps rounded to float32)."""
    import dataclasses

    import gguf

    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, norm_eps=float(np.float32(cfg.norm_eps)))
    writer = gguf.GGUFWriter(str(path), "llama")
    u32 = gguf.GGUFValueType.UINT32
    for key, value in (("block_count", cfg.n_layers), ("embedding_length", cfg.dim), ("attention.head_count", cfg.n_heads),
                       ("attention.head_count_kv", cfg.n_kv_heads), ("feed_forward_length", cfg.ffn_dim),
                       ("context_length", cfg.context_length)):
        writer.add_key_value(f"llama.{key}", value, u32)
    writer.add_key_value("llama.rope.freq_base", cfg.rope_base, gguf.GGUFValueType.FLOAT32)
    writer.add_key_value("llama.attention.layer_norm_rms_epsilon", cfg.norm_eps, gguf.GGUFValueType.FLOAT32)
    for name, w in tiny_tensors(cfg, seed).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return cfg


def logits(cfg, tensors, tokens, adapters=None, all_logits=True):
    """All-position logits of the model over tokens (one prefill from an empty cache)."""
    from ingot.adapters import binder
    from ingot.models import llama

    graph = llama.build(cfg, tensors, adapter_sites=adapters.names if adapters else (), all_logits=all_logits)
    if adapters:
        graph.callables_for = binder(cfg, adapters)
    exe = graph.compile(len(tokens))
    return exe.run({"tokens": np.asarray(tokens, np.int32), "pos": np.int32(0)}, state=exe.new_state())[0]
