"""Each decoder family against HF transformers (fp32) on a tiny random-weight GGUF in its real layout.

tests/family_models.py writes the files; scripts/make_family_fixture.py ran transformers over them
and stored its logits and greedy ids (tests/fixtures/families_reference.*). Ingot must give prefill
logits within 1e-4 relative L2 at every position and the same 32 greedy ids; the prompts are longer
than the Gemma models' sliding window. Where transformers is installed, one test also runs it live.
"""
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from family_models import FAMILIES, write_family_gguf
from ingot import models
from ingot.errors import IngotError
from ingot.importers.gguf import read_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "families_reference.npz"


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def ingot_run(path: Path, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    """(logits at every prompt position [T, vocab], `steps` greedy ids after the prompt)."""
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.context_length = 64
    everything = models.build(cfg, model.tensors, str(path), all_logits=True).compile(len(prompt))
    (logits,) = everything.run({"tokens": prompt, "pos": np.int32(0)})
    graph = models.build(cfg, model.tensors, str(path))
    prefill, decode = graph.compile(len(prompt)), graph.compile(1)
    state = decode.new_state()
    (row,) = prefill.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(len(prompt) - 1)}, state=state)
    ids = []
    for i in range(steps):
        ids.append(int(np.argmax(row[0])))
        (row,) = decode.run({"tokens": np.array(ids[-1:], np.int32), "pos": np.int32(len(prompt) + i),
                             "last": np.int32(0)}, state=state)
    return logits, ids


def rel_l2_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(name, reference, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    prompt = reference[f"{name}.prompt"]
    expected = reference[f"{name}.greedy"].tolist()
    logits, ids = ingot_run(path, prompt, len(expected))
    assert logits.shape == reference[f"{name}.logits"].shape
    errors = rel_l2_rows(logits, reference[f"{name}.logits"])
    assert errors.max() < 1e-4, f"{name}: prefill logits differ from transformers' by {errors.max():.2e} (rel L2)"
    assert ids == expected


def test_config_reads_each_family_table(tmp_path):
    """What each family's table makes of its metadata (the numbers the graph is built from)."""
    configs = {}
    for name in ("qwen3", "gemma2", "gemma3"):
        write_family_gguf(name, tmp_path / f"{name}.gguf")
        configs[name] = models.config_from_gguf(read_gguf(tmp_path / f"{name}.gguf", lazy=True))
    q3, g2, g3 = configs["qwen3"], configs["gemma2"], configs["gemma3"]
    assert (q3.family, q3.head_dim, q3.qk_norm, q3.rope_interleaved) == ("qwen3", 128, True, False)
    assert [g3.window(i) for i in range(6)] == [8, 8, 8, 8, 8, 0]           # 5 local : 1 global
    assert (g3.rope_base, g3.rope_base_local, g3.qk_norm, g3.attention_scale) == (1e6, 1e4, True, 1 / 16)
    assert [g2.window(i) for i in range(2)] == [8, 0]
    assert (g2.attn_softcap, g2.final_softcap, g2.qk_norm) == (50.0, 30.0, False)


def test_sliding_window_is_what_makes_gemma3_match(reference, tmp_path):
    """The comparison can fail: without its window, Gemma 3's logits past position 8 are wrong."""
    path = tmp_path / "gemma3.gguf"
    write_family_gguf("gemma3", path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.sliding_window = 1000   # still the local layers (their RoPE base), but a window longer than the prompt
    exe = models.build(cfg, model.tensors, str(path), all_logits=True).compile(24)
    (logits,) = exe.run({"tokens": reference["gemma3.prompt"], "pos": np.int32(0)})
    errors = rel_l2_rows(logits, reference["gemma3.logits"])
    assert errors[:8].max() < 1e-4 and errors[8:].min() > 1e-3


def test_phi3_reads_longrope_and_each_part_of_it_matters(reference, tmp_path):
    """Phi-3's table (LongRoPE over an original context of 16, attn_factor sqrt(1 + ln 16 / ln 16), a
    window of 8); and the comparison can fail: the short factors, no attention factor or no window
    each give logits that are not transformers'."""
    import dataclasses
    path = tmp_path / "phi3.gguf"
    write_family_gguf("phi3", path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    assert (cfg.family, cfg.rope_scaling, cfg.rope_original_context, cfg.sliding_window, cfg.rope_interleaved) == \
        ("phi3", "longrope", 16, 8, False)
    assert cfg.rope_attn_factor == pytest.approx(2 ** 0.5)
    cfg.context_length = 64
    for change in ({"rope_original_context": 64}, {"rope_attn_factor": 1.0}, {"sliding_window": 0}):
        exe = models.build(dataclasses.replace(cfg, **change), model.tensors, str(path), all_logits=True).compile(24)
        (logits,) = exe.run({"tokens": reference["phi3.prompt"], "pos": np.int32(0)})
        assert rel_l2_rows(logits, reference["phi3.logits"]).max() > 1e-3, change


def test_longrope_needs_both_factor_tensors(tmp_path):
    import gguf
    path = tmp_path / "half.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    for key, value in (("block_count", 1), ("embedding_length", 4), ("attention.head_count", 1),
                       ("feed_forward_length", 8), ("rope.scaling.original_context_length", 16)):
        w.add_uint32(f"phi3.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.add_tensor("rope_factors_long.weight", np.ones(2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(IngotError, match="LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight"):
        models.config_from_gguf(read_gguf(path, lazy=True))


def test_smollm3_leaves_rope_out_of_every_fourth_layer(reference, tmp_path):
    """SmolLM3's NoPE layers (layer 3 of 4); and the comparison can fail: with RoPE in every layer the
    logits are not transformers'."""
    path = tmp_path / "smollm3.gguf"
    write_family_gguf("smollm3", path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    assert (cfg.family, cfg.no_rope_interval, [cfg.rope_in(i) for i in range(8)]) == \
        ("llama", 4, [True, True, True, False, True, True, True, False])
    cfg.no_rope_interval = 0
    exe = models.build(cfg, model.tensors, str(path), all_logits=True).compile(24)
    (logits,) = exe.run({"tokens": reference["smollm3.prompt"], "pos": np.int32(0)})
    assert rel_l2_rows(logits, reference["smollm3.logits"]).max() > 1e-3


def test_qwen3moe_reads_its_experts_and_renormalised_routing_matters(reference, tmp_path):
    """The MoE table (8 experts, 3 used, expert width 64); and the comparison can fail: without the
    renormalised top-k probabilities (norm_topk_prob) the logits are not transformers'."""
    path = tmp_path / "qwen3moe.gguf"
    write_family_gguf("qwen3moe", path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    assert (cfg.family, cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim, cfg.norm_top_k, cfg.head_dim) == \
        ("qwen3moe", 8, 3, 64, True, 32)
    cfg.norm_top_k = False
    exe = models.build(cfg, model.tensors, str(path), all_logits=True).compile(24)
    (logits,) = exe.run({"tokens": reference["qwen3moe.prompt"], "pos": np.int32(0)})
    assert rel_l2_rows(logits, reference["qwen3moe.logits"]).max() > 1e-3


@pytest.mark.parametrize("key, value", [("expert_shared_count", 1), ("expert_gating_func", 2)])
def test_qwen3moe_variants_ingot_lacks_are_refused_by_name(tmp_path, key, value):
    path = tmp_path / "moe.gguf"
    _write_gguf(path, "qwen3moe", **{"qwen3moe.block_count": 1, "qwen3moe.embedding_length": 4,
                                     "qwen3moe.attention.head_count": 1, "qwen3moe.feed_forward_length": 8,
                                     "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                                     "qwen3moe.expert_feed_forward_length": 8, f"qwen3moe.{key}": value})
    with pytest.raises(IngotError, match=f"qwen3moe.{key} = {value} is not supported"):
        models.config_from_gguf(read_gguf(path, lazy=True))


def _write_gguf(path: Path, arch: str, **metadata) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_is_refused_before_any_kernel_compiles(tmp_path, monkeypatch):
    import ingot.backends.cpu.kernels as kernels
    import ingot.llm

    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", **{"mamba.block_count": 1})
    monkeypatch.setattr(kernels, "warm_up", lambda: pytest.fail("kernels compiled before the refusal"))
    with pytest.raises(IngotError, match=r"mamba.gguf: architecture 'mamba' is not supported \(supported: llama"):
        ingot.llm.load(str(path))


@pytest.mark.parametrize("kind", ["longrope", "su", "dynamic"])
def test_rope_scaling_that_ingot_lacks_is_refused_by_name(tmp_path, kind):
    path = tmp_path / "scaled.gguf"
    _write_gguf(path, "qwen2", **{"qwen2.block_count": 1, "qwen2.embedding_length": 4, "qwen2.attention.head_count": 1,
                                  "qwen2.feed_forward_length": 8, "qwen2.rope.scaling.type": kind,
                                  "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(IngotError, match=f"RoPE scaling '{kind}' \\(qwen2.rope.scaling.type\\) is not supported"):
        models.config_from_gguf(read_gguf(path, lazy=True))


@pytest.mark.parametrize("extra, words", [
    ({}, "metadata lacks qwen2.rope.scaling.original_context_length"),
    ({"qwen2.rope.scaling.original_context_length": 32, "qwen2.rope.scaling.yarn_log_multiplier": 0.1},
     "YaRN with qwen2.rope.scaling.yarn_log_multiplier = 0.1"),
])
def test_yarn_variants_ingot_lacks_are_refused(tmp_path, extra, words):
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, "qwen2", **{"qwen2.block_count": 1, "qwen2.embedding_length": 4, "qwen2.attention.head_count": 1,
                                  "qwen2.feed_forward_length": 8, "qwen2.rope.scaling.type": "yarn",
                                  "qwen2.rope.scaling.factor": 4.0, **extra})
    with pytest.raises(IngotError, match=words.replace(".", r"\.")):
        models.config_from_gguf(read_gguf(path, lazy=True))


def test_linear_rope_scaling_is_read(tmp_path):
    path = tmp_path / "linear.gguf"
    _write_gguf(path, "llama", **{"llama.block_count": 1, "llama.embedding_length": 4, "llama.attention.head_count": 1,
                                  "llama.feed_forward_length": 8, "llama.rope.scaling.type": "linear",
                                  "llama.rope.scaling.factor": 4.0})
    assert models.config_from_gguf(read_gguf(path, lazy=True)).rope_scale == 4.0


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate")),
                    reason="needs torch, transformers and accelerate (to load a GGUF)")
def test_fixture_is_what_transformers_computes_now(reference, tmp_path):
    """The stored fixture still is transformers' answer (regenerate it with scripts/make_family_fixture.py)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from make_family_fixture import reference as live

    for name in ("qwen3", "gemma3", "qwen3moe"):
        now = live(name, tmp_path)
        np.testing.assert_array_equal(now[f"{name}.greedy"], reference[f"{name}.greedy"])
        assert rel_l2_rows(now[f"{name}.logits"], reference[f"{name}.logits"]).max() < 1e-5
    meta = json.loads(FIXTURE.with_suffix(".json").read_text())
    assert set(meta["families"]) == set(FAMILIES)


# -- chat and stopping per family -------------------------------------------------------------------

TURN_TOKENS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|end|>"]


def tokenizer_for(architecture: str, template: str | None = None):
    """A byte-level vocabulary with every family's turn tokens as control tokens, and the family's
    default template as generate.LLM gives it."""
    from hostile import MERGES, byte_symbols
    from ingot.llm.tokenizer import Tokenizer

    tokens = byte_symbols() + ["he", "ll", "hell", "hello"] + TURN_TOKENS
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1] * 260 + [3] * len(TURN_TOKENS), "tokenizer.ggml.merges": list(MERGES),
          "tokenizer.ggml.bos_token_id": tokens.index("<bos>"), "tokenizer.ggml.eos_token_id": tokens.index("<eos>")}
    if template is not None:
        md["tokenizer.chat_template"] = template
    return Tokenizer(md, default_template=models.chat_template(architecture)), tokens


def test_gemma_without_a_template_gets_its_own_turn_format_and_stops_at_end_of_turn():
    tok, tokens = tokenizer_for("gemma3")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert tok.eos_ids == {tokens.index("<eos>"), tokens.index("<end_of_turn>")}


def test_phi3_without_a_template_gets_its_own_turn_format_and_stops_at_end():
    tok, tokens = tokenizer_for("phi3")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert tok.eos_ids == {tokens.index("<eos>"), tokens.index("<|end|>")}


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_chatml_families_without_a_template_stop_at_im_end(architecture):
    tok, tokens = tokenizer_for(architecture)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_ids == {tokens.index("<eos>"), tokens.index("<|im_end|>")}


@pytest.mark.parametrize("architecture, template, stop", [
    ("gemma3", "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}", "<|im_end|>"),  # the file's wins
    ("llama", "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}", "<|eot_id|>"),
    ("llama", "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}", "<|end|>"),
])
def test_the_files_template_and_its_end_of_turn_token(architecture, template, stop):
    tok, tokens = tokenizer_for(architecture, template)
    assert tok.chat_template == template
    assert tok.eos_ids == {tokens.index("<eos>"), tokens.index(stop)}


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_random_weights_of_a_family_build_and_run(family):
    """Random weights of a config's shapes (what GPU runs use) build a graph the CPU runs."""
    import importlib
    module = importlib.import_module(f"ingot.models.{family}")
    cfg = module.Config(2, 64, 2, 1, 96, 100, head_dim=32, context_length=32)
    if family == "gemma":
        cfg.sliding_window, cfg.sliding_pattern = 4, 2
    graph = models.build(cfg, module.random_weights(cfg, dense_dtype="float32"))
    (logits,) = graph.compile(6).run({"tokens": np.arange(6, dtype=np.int32), "pos": np.int32(0), "last": np.int32(5)})
    assert logits.shape == (1, 100) and np.isfinite(logits).all()


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3", "smollm3", "mistral3", "qwen3moe"])
def test_an_llm_package_of_a_family_keeps_its_numbers(name, reference, tmp_path):
    """`ingot convert` of a family's GGUF: the package reads back as that family (its config class)
    and gives transformers' logits too."""
    from ingot.convert import convert
    from ingot.llm.package import read_llm

    write_family_gguf(name, tmp_path / f"{name}.gguf")
    convert(tmp_path / f"{name}.gguf", tmp_path / f"{name}.ingot")
    stored = read_llm(tmp_path / f"{name}.ingot")
    assert stored.architecture == name and type(stored.config) is models.config_class(name)
    stored.config.context_length = 64
    exe = models.build(stored.config, stored.tensors, stored.path, all_logits=True).compile(24)
    (logits,) = exe.run({"tokens": reference[f"{name}.prompt"], "pos": np.int32(0)})
    assert rel_l2_rows(logits, reference[f"{name}.logits"]).max() < 1e-4


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi3", "qwen3moe", "mistral3_mscale"])
def test_generation_loop_with_padded_chunks_matches_transformers(name, reference, tmp_path, monkeypatch):
    """ingot.llm's loop: the prompt prefilled in padded chunks (here 16 + 8 tokens, padded to 16 each,
    across the window of 8), then decoded step by step, gives transformers' logits and greedy ids."""
    import ingot.llm.generate as generate
    from ingot.llm.generate import LLM

    monkeypatch.setattr(generate, "PREFILL_BUCKETS", (4, 16))
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.context_length = 64
    llm = LLM.from_graph(models.build(cfg, model.tensors, str(path)), tokenizer=None)
    prompt = reference[f"{name}.prompt"].tolist()
    logits = llm.prefill(prompt)
    assert rel_l2_rows(logits, reference[f"{name}.logits"][-1]) < 1e-4
    ids = []
    for _ in range(len(reference[f"{name}.greedy"])):
        ids.append(int(np.argmax(logits)))
        logits = llm.step(ids[-1])
    assert ids == reference[f"{name}.greedy"].tolist()


def test_yarn_is_what_makes_the_scaled_qwen3_match(reference, tmp_path):
    """The comparison can fail: read as unscaled (or linearly scaled) RoPE, the YaRN model's logits differ."""
    path = tmp_path / "qwen3_yarn.gguf"
    write_family_gguf("qwen3_yarn", path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    assert (cfg.rope_scaling, cfg.rope_scale, cfg.rope_original_context) == ("yarn", 4.0, 16)
    for rope_scaling in ("", "linear"):
        cfg.rope_scaling = rope_scaling
        exe = models.build(cfg, model.tensors, str(path), all_logits=True).compile(24)
        (logits,) = exe.run({"tokens": reference["qwen3_yarn.prompt"], "pos": np.int32(0)})
        assert rel_l2_rows(logits, reference["qwen3_yarn.logits"]).max() > 1e-3


def test_mistral3_reads_yarn_mscale_and_temperature_and_each_part_matters(reference, tmp_path):
    """What the mistral3 table makes of its metadata; and the comparison can fail: without the attention
    temperature, or with YaRN's default factor 0.1 ln(f) + 1 instead of the mscale form, the logits differ."""
    from ingot.models.blocks import yarn_magnitude

    for name in ("mistral3", "mistral3_mscale"):
        path = tmp_path / f"{name}.gguf"
        write_family_gguf(name, path)
        model = read_gguf(path)
        cfg = models.config_from_gguf(model)
        mscale_all_dim, beta = (1.0, 0.1) if name == "mistral3" else (0.5, 0.5)
        assert (cfg.family, cfg.rope_interleaved, cfg.rope_scaling, cfg.rope_original_context) == ("llama", True, "yarn", 16)
        assert (cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (1.0, mscale_all_dim)
        assert (cfg.attn_temperature_scale, cfg.attn_temperature_length) == (pytest.approx(beta), 16)
        f = cfg.rope_scale
        assert yarn_magnitude(cfg) == pytest.approx((0.1 * np.log(f) + 1) / (0.1 * mscale_all_dim * np.log(f) + 1))
        cfg.context_length = 64
        wrong = [{"attn_temperature_scale": 0.0}, {"yarn_mscale": 0.0, "yarn_mscale_all_dim": 0.0}]
        for change in wrong[:1] if name == "mistral3" else wrong:   # mistral3's mscale form is a factor 1 ...
            bad = dataclasses.replace(cfg, **change)
            exe = models.build(bad, model.tensors, str(path), all_logits=True).compile(24)
            (logits,) = exe.run({"tokens": reference[f"{name}.prompt"], "pos": np.int32(0)})
            assert rel_l2_rows(logits, reference[f"{name}.logits"]).max() > 1e-3, change
            assert rel_l2_rows(logits, reference[f"{name}.logits"])[:16].max() < 1e-4 or "yarn_mscale" in change
    cfg = models.config_from_gguf(read_gguf(tmp_path / "mistral3.gguf"))   # ... where the default would be 1.14
    assert yarn_magnitude(dataclasses.replace(cfg, yarn_mscale=0.0)) == pytest.approx(0.1 * np.log(4) + 1)


@pytest.mark.parametrize("extra, words", [
    ({"mistral3.attention.temperature_scale": 0.1}, "metadata lacks mistral3.attention.temperature_length (or "
                                                    "mistral3.rope.scaling.original_context_length)"),
    ({"mistral3.attention.temperature_scale": -0.1, "mistral3.attention.temperature_length": 4},
     "metadata key mistral3.attention.temperature_scale is -0.1"),
    ({"mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 4.0,
      "mistral3.rope.scaling.original_context_length": 8, "mistral3.rope.scaling.yarn_log_multiplier": -1.0},
     "metadata key mistral3.rope.scaling.yarn_log_multiplier is -1.0"),
])
def test_mistral3_metadata_it_cannot_use_is_refused(tmp_path, extra, words):
    path = tmp_path / "m3.gguf"
    _write_gguf(path, "mistral3", **{"mistral3.block_count": 1, "mistral3.embedding_length": 4,
                                     "mistral3.attention.head_count": 1, "mistral3.feed_forward_length": 8, **extra})
    with pytest.raises(IngotError, match=re.escape(words)):
        models.config_from_gguf(read_gguf(path, lazy=True))


@pytest.mark.parametrize("name", ["qwen3moe", "phi3", "smollm3", "mistral3_mscale"])
def test_rows_decoder_of_a_family_equals_its_batch_one_decoder(name, tmp_path):
    """`ingot serve`'s rows decoder (one token per row, each at its own position and cache) of the new
    families: each row's logits are the batch-1 decoder's (experts routed per token; Phi-3's window;
    SmolLM3's NoPE layers; Mistral 3's temperature, a row past its length of 16)."""
    from ingot.ir import TensorType
    from ingot.runtime import State
    from ingot import dtypes as dt

    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.context_length = 32
    single = models.build(cfg, model.tensors, str(path))
    decoder = single.compile(1)
    rows = models.build(cfg, model.tensors, str(path), rows=2)
    exe = rows.graph.compile(feeds={rows.tokens: TensorType((2,), dt.int32)}, targets=[rows.logits])
    rng = np.random.default_rng(2)
    states, reference, positions = [], [], [19, 4]
    for n in positions:
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        pair = [decoder.new_state(), decoder.new_state()]
        for state in pair:
            single.compile(n).run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(n - 1)}, state=state)
        states.append(pair[0])
        reference.append(pair[1])
    row_state = State({f"blk.{i}.{kind}_cache.{r}": s.values[f"blk.{i}.{kind}_cache"]
                       for r, s in enumerate(states) for i in range(cfg.n_layers) for kind in ("k", "v")})
    tokens = rng.integers(0, cfg.vocab_size, 2).astype(np.int32)
    (got,) = exe.run({"tokens": tokens, "positions": np.array(positions, np.int32)}, state=row_state)
    for r in range(2):
        (want,) = decoder.run({"tokens": tokens[r:r + 1], "pos": np.int32(positions[r]), "last": np.int32(0)},
                              state=reference[r])
        np.testing.assert_allclose(got[r], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["phi3_short", "qwen3moe"])
def test_the_servers_storage_form_builds_the_same_model(name, reference, tmp_path):
    """`ingot serve` converts the tensors once into the storage form (k-major, q/k/v side by side):
    Phi-3's fused tensors split first, expert stacks kept as they are; the graph built from it gives
    transformers' logits too."""
    from ingot.llm.package import storage_form

    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.context_length = 64
    stored = storage_form(cfg, model.tensors)
    exe = models.build(cfg, stored, str(path), all_logits=True).compile(24)
    (logits,) = exe.run({"tokens": reference[f"{name}.prompt"], "pos": np.int32(0)})
    assert rel_l2_rows(logits, reference[f"{name}.logits"]).max() < 1e-4
