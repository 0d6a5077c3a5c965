"""Tiny random-weight GGUF files in each decoder family's real layout and metadata (test helper).

`write_family_gguf(name, path)` writes one with gguf.GGUFWriter: the tensor names, shapes and
metadata keys llama.cpp's converter writes for that architecture, float32 weights (or Q8_0
matrices), seeded, so HF transformers and Ingot read the same file. scripts/make_family_fixture.py
runs transformers over these files; tests/test_families.py compares Ingot with what it stored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np


@dataclass(frozen=True)
class Family:
    arch: str
    n_layers: int
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 96
    vocab: int = 128
    context: int = 256
    rope_base: float = 10000.0
    eps: float = 1e-5
    sliding_window: int = 0
    quant: str = "F32"                         # or "Q8_0" for the matrices
    experts: int = 0                           # mixture of experts: experts per layer (0: dense)
    experts_used: int = 0                      # experts each token is routed to
    expert_ffn_dim: int = 0                    # each expert's hidden size
    expert_quant: str = "Q8_0"                 # the 3-D expert tensors' type
    extra: dict = field(default_factory=dict)  # more metadata, {key without the arch prefix: value}

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3moe", "gemma3")

    @property
    def gemma(self) -> bool:
        return self.arch.startswith("gemma")


FAMILIES = {
    "llama": Family("llama", 2, quant="Q8_0"),
    "qwen2": Family("qwen2", 2, rope_base=1e6, eps=1e-6),
    # head_dim != dim / heads; 128 because HF's GGUF loader assumes it (it reads no qwen3.attention.key_length)
    "qwen3": Family("qwen3", 2, head_dim=128, rope_base=1e6, eps=1e-6),
    # Gemma: head_dim 256 is what HF's GGUF loader assumes (query_pre_attn_scalar), as the real models have
    "gemma2": Family("gemma2", 2, n_heads=2, n_kv_heads=1, head_dim=256, eps=1e-6, sliding_window=8,
                     extra={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": Family("gemma3", 6, n_heads=2, n_kv_heads=1, head_dim=256, rope_base=1e6, eps=1e-6, sliding_window=8),
    # Qwen3-MoE: 8 experts, 3 used per token (norm_topk_prob), Q8_0 and Q4_0 expert tensors [E, out, in]
    "qwen3moe": Family("qwen3moe", 2, head_dim=32, rope_base=1e6, eps=1e-6, experts=8, experts_used=3,
                       expert_ffn_dim=64),
    # Phi-3: fused attn_qkv and gate_up (ffn_up) tensors, LongRoPE over an original context of 16 (the
    # prompt is longer: the long factors), attn_factor by default from context_length / original, a
    # sliding window of 8 on every layer
    "phi3": Family("phi3", 2, sliding_window=8, extra={"rope.scaling.original_context_length": 16}),
    # Phi-3 within its original context (4096 > 256): the short factors, attn_factor 1, no window, Q8_0
    "phi3_short": Family("phi3", 2, quant="Q8_0", extra={"rope.scaling.original_context_length": 4096}),
    # SmolLM3: Llama's layout, layer 3 without RoPE (transformers cannot read this GGUF: the reference
    # is its SmolLM3 model holding the weights it reads from the same file written as "llama")
    "smollm3": Family("smollm3", 4, rope_base=5e6, eps=1e-6, quant="Q8_0"),
    # Mistral 3 / Ministral 3 (mistral3): Llama's layout, YaRN (factor 4 over an original context of 16,
    # shorter than the prompt) with mscale = mscale_all_dim = 1 (yarn_log_multiplier, as Ministral's files)
    # and Llama 4's attention temperature (beta 0.1 per step of 16 positions); transformers reads no
    # mistral3 GGUF: the reference is its Ministral3 model holding the weights of the file written as "llama"
    "mistral3": Family("mistral3", 2, rope_base=1e6, quant="Q8_0",
                       extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                              "rope.scaling.original_context_length": 16, "rope.scaling.yarn_beta_fast": 32.0,
                              "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 1.0,
                              "attention.temperature_scale": 0.1}),
    # the mscale form with mscale_all_dim 0.5 (cos/sin times (1 + 0.1 ln 8) / (1 + 0.05 ln 8)), a stronger
    # temperature, its length given by its own key (transformers takes it from the original context: the same 16)
    "mistral3_mscale": Family("mistral3", 2, extra={
        "rope.scaling.type": "yarn", "rope.scaling.factor": 8.0, "rope.scaling.original_context_length": 16,
        "rope.scaling.yarn_log_multiplier": 0.5, "attention.temperature_scale": 0.5, "attention.temperature_length": 16}),
    # YaRN, factor 4 over an original context of 16 (shorter than the prompt)
    "qwen3_yarn": Family("qwen3", 2, head_dim=128, rope_base=1e6, eps=1e-6,
                         extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                "rope.scaling.original_context_length": 16}),
}


def longrope_factors(head_dim: int) -> dict[str, list[float]]:
    """The LongRoPE factor tensors the phi3 models carry (deterministic, so HF's config can repeat them)."""
    half = np.arange(head_dim // 2, dtype=np.float64) / (head_dim // 2)
    return {"long": (1.0 + 7.0 * half ** 2).astype(np.float32).tolist(),
            "short": (1.0 + 0.3 * half).astype(np.float32).tolist()}


def _phi3_config(original: int, **more) -> dict:
    return {"original_max_position_embeddings": original, "pad_token_id": None, **more,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
                                "long_factor": longrope_factors(16)["long"], "short_factor": longrope_factors(16)["short"]}}


# what transformers' GGUF reader does not take from the file, given to from_pretrained (the same values)
HF_CONFIG = {"phi3": _phi3_config(16, sliding_window=8), "phi3_short": _phi3_config(4096),
             "qwen3moe": {"moe_intermediate_size": 64},   # it reads no qwen3moe.expert_feed_forward_length
             "qwen3_yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                                "rope_theta": 1e6}}}


def _add_matrix(w: gguf.GGUFWriter, name: str, m: np.ndarray, quant: str) -> None:
    if quant != "F32":   # Q8_0, Q4_0, ...: 2-D matrices or 3-D stacks of expert matrices
        kind = gguf.GGMLQuantizationType[quant]
        data = gguf.quants.quantize(m, kind)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    else:
        w.add_tensor(name, m.astype(np.float32))


# families transformers' GGUF reader does not take: (the architecture to write the twin file as,
# the transformers model class and config class that run the weights it reads from that twin)
HF_TWIN = {"smollm3": ("llama", "SmolLM3ForCausalLM", "SmolLM3Config"),
           "mistral3": ("llama", "Ministral3ForCausalLM", "Ministral3Config"),
           "mistral3_mscale": ("llama", "Ministral3ForCausalLM", "Ministral3Config")}

# the twin model's rope_parameters (transformers' names for what the mistral3 file says)
HF_TWIN_ROPE = {
    "mistral3": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
    "mistral3_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
                        "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.5},
}


def write_family_gguf(name: str, path, seed: int = 0, arch: str | None = None) -> Family:
    """Write the tiny model of family `name` (a key of FAMILIES) to path; returns its Family.
    arch: write it as another architecture (the same tensors; the common metadata under that prefix)."""
    f = FAMILIES[name]
    if arch is not None:
        import dataclasses
        f = dataclasses.replace(f, arch=arch, extra={})   # the same tensors, none of the family's own metadata
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), f.arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(f.n_layers)
    w.add_context_length(f.context)
    w.add_embedding_length(f.dim)
    w.add_feed_forward_length(f.ffn_dim)
    w.add_head_count(f.n_heads)
    w.add_head_count_kv(f.n_kv_heads)
    w.add_rope_freq_base(f.rope_base)
    w.add_layer_norm_rms_eps(f.eps)
    w.add_vocab_size(f.vocab)
    if f.head_dim != f.dim // f.n_heads or f.gemma:
        w.add_key_length(f.head_dim)
        w.add_value_length(f.head_dim)
    if f.sliding_window:
        w.add_sliding_window(f.sliding_window)
    if f.arch == "phi3":
        w.add_rope_dimension_count(f.head_dim)
        for kind, factors in longrope_factors(f.head_dim).items():
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(factors, np.float32))
    if f.experts:
        w.add_expert_count(f.experts)
        w.add_expert_used_count(f.experts_used)
        w.add_expert_feed_forward_length(f.expert_ffn_dim)
    for key, value in f.extra.items():
        add = w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"{f.arch}.{key}", value)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if f.quant == "Q8_0" else gguf.LlamaFileType.ALL_F32)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):  # Gemma's files store 1 + w; the others w: both near 1
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    hd, q_rows, kv_rows = f.head_dim, f.n_heads * f.head_dim, f.n_kv_heads * f.head_dim
    _add_matrix(w, "token_embd.weight", (rng.standard_normal((f.vocab, f.dim)) * (0.05 if f.gemma else 1)).astype(np.float32), f.quant)
    w.add_tensor("output_norm.weight", norm(f.dim))
    if not f.gemma:
        _add_matrix(w, "output.weight", matrix(f.vocab, f.dim), f.quant)
    for i in range(f.n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(f.dim))
        if f.arch == "phi3":   # q, k, v rows in one tensor
            _add_matrix(w, p + "attn_qkv.weight", matrix(q_rows + 2 * kv_rows, f.dim), f.quant)
        else:
            _add_matrix(w, p + "attn_q.weight", matrix(q_rows, f.dim), f.quant)
            _add_matrix(w, p + "attn_k.weight", matrix(kv_rows, f.dim), f.quant)
            _add_matrix(w, p + "attn_v.weight", matrix(kv_rows, f.dim), f.quant)
        if f.arch == "qwen2":
            for n, rows in (("attn_q.bias", q_rows), ("attn_k.bias", kv_rows), ("attn_v.bias", kv_rows)):
                w.add_tensor(p + n, (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if f.qk_norm:
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        _add_matrix(w, p + "attn_output.weight", matrix(f.dim, q_rows), f.quant)
        if f.gemma:
            w.add_tensor(p + "post_attention_norm.weight", norm(f.dim))
        w.add_tensor(p + "ffn_norm.weight", norm(f.dim))
        if f.experts:   # router [E, dim] float32; expert stacks [E, out, in], gate and up in one type, down in Q4_0
            e, h = f.experts, f.expert_ffn_dim
            w.add_tensor(p + "ffn_gate_inp.weight", matrix(e, f.dim))
            _add_matrix(w, p + "ffn_gate_exps.weight", np.stack([matrix(h, f.dim) for _ in range(e)]), f.expert_quant)
            _add_matrix(w, p + "ffn_up_exps.weight", np.stack([matrix(h, f.dim) for _ in range(e)]), f.expert_quant)
            _add_matrix(w, p + "ffn_down_exps.weight", np.stack([matrix(f.dim, h) for _ in range(e)]), "Q4_0")
        elif f.arch == "phi3":   # gate rows, then up rows, in one tensor
            _add_matrix(w, p + "ffn_up.weight", matrix(2 * f.ffn_dim, f.dim), f.quant)
            _add_matrix(w, p + "ffn_down.weight", matrix(f.dim, f.ffn_dim), f.quant)
        else:
            _add_matrix(w, p + "ffn_gate.weight", matrix(f.ffn_dim, f.dim), f.quant)
            _add_matrix(w, p + "ffn_up.weight", matrix(f.ffn_dim, f.dim), f.quant)
            _add_matrix(w, p + "ffn_down.weight", matrix(f.dim, f.ffn_dim), f.quant)
        if f.gemma:
            w.add_tensor(p + "post_ffw_norm.weight", norm(f.dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return f
