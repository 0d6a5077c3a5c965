"""LoRA adapters (PEFT files) as called executables: exact against W + scale * B @ A merged in
NumPy, hot swap on one compiled executable (rebinding >= 100x faster than compiling), bad shapes."""
import json
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import logits, tiny_config, tiny_tensors  # noqa: E402

from ingot.adapters import AdapterSet, binder, load_peft, parse_lora_arg  # noqa: E402
from ingot.errors import IngotError  # noqa: E402
from ingot.models import llama  # noqa: E402

MODULES = {"q_proj": ("self_attn", "attn_q"), "k_proj": ("self_attn", "attn_k"), "v_proj": ("self_attn", "attn_v"),
           "o_proj": ("self_attn", "attn_output"), "gate_proj": ("mlp", "ffn_gate"), "up_proj": ("mlp", "ffn_up"),
           "down_proj": ("mlp", "ffn_down")}
TOKENS = [5, 17, 42, 7, 99, 3]


def write_peft(folder, cfg, modules, rank=4, alpha=8, seed=1, layers=None, bad_shape=False):
    """A PEFT adapter folder with random factors; returns {(layer, module): (A, B)} (HF row order)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, factors = {}, {}
    shapes = {"q_proj": (cfg.n_heads * cfg.head_dim, cfg.dim), "k_proj": (cfg.n_kv_heads * cfg.head_dim, cfg.dim),
              "v_proj": (cfg.n_kv_heads * cfg.head_dim, cfg.dim), "o_proj": (cfg.dim, cfg.n_heads * cfg.head_dim),
              "gate_proj": (cfg.ffn_dim, cfg.dim), "up_proj": (cfg.ffn_dim, cfg.dim), "down_proj": (cfg.dim, cfg.ffn_dim)}
    for layer in (range(cfg.n_layers) if layers is None else layers):
        for m in modules:
            out, inp = shapes[m]
            a = (0.2 * rng.standard_normal((rank, inp + (3 if bad_shape else 0)))).astype(np.float32)
            b = (0.2 * rng.standard_normal((out, rank))).astype(np.float32)
            key = f"base_model.model.model.layers.{layer}.{MODULES[m][0]}.{m}"
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
            factors[(layer, m)] = (a, b)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                                                            "peft_type": "LORA"}))
    return factors


def merged(cfg, tensors, factors, scale):
    """W + scale * B @ A in NumPy, B's rows put in GGUF's q/k order (interleaved RoPE)."""
    out = dict(tensors)
    for (layer, m), (a, b) in factors.items():
        delta = scale * (b.astype(np.float64) @ a.astype(np.float64))
        if m in ("q_proj", "k_proj"):
            heads = cfg.n_heads if m == "q_proj" else cfg.n_kv_heads
            delta = delta.reshape(heads, 2, cfg.head_dim // 2, -1).swapaxes(1, 2).reshape(delta.shape)
        name = f"blk.{layer}.{MODULES[m][1]}.weight"
        out[name] = (out[name].astype(np.float64) + delta).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, tiny_tensors(cfg)


def test_peft_adapter_equals_merged_weights(tiny, tmp_path):
    cfg, tensors = tiny
    modules = list(MODULES)
    factors = write_peft(tmp_path / "lora", cfg, modules, rank=4, alpha=8)
    adapters = load_peft(tmp_path / "lora", cfg, multiplier=0.5)
    assert adapters.names == {f"blk.{i}.{MODULES[m][1]}.weight" for i in range(cfg.n_layers) for m in modules}
    with_adapter = logits(cfg, tensors, TOKENS, adapters)
    expect = logits(cfg, merged(cfg, tensors, factors, 0.5 * 8 / 4), TOKENS)
    base = logits(cfg, tensors, TOKENS)
    assert np.abs(expect - base).max() > 0.1                      # the adapter does change the outputs
    np.testing.assert_allclose(with_adapter, expect, rtol=1e-4, atol=1e-4)


def test_two_adapters_swap_on_one_compiled_executable(tiny, tmp_path, monkeypatch):
    cfg, tensors = tiny
    f1 = write_peft(tmp_path / "one", cfg, ["q_proj", "v_proj", "down_proj"], seed=1)
    f2 = write_peft(tmp_path / "two", cfg, ["q_proj", "v_proj", "down_proj"], rank=2, seed=2)
    a1, a2 = load_peft(tmp_path / "one", cfg), load_peft(tmp_path / "two", cfg)
    graph = llama.build(cfg, tensors, adapter_sites=a1.names, all_logits=True)
    exe = graph.compile(len(TOKENS))
    feeds = {"tokens": np.asarray(TOKENS, np.int32), "pos": np.int32(0)}
    sites = sorted(exe.call_sites)
    assert set(sites) == set(a1.names)  # float weights are multiplied one by one: one call site each
    ones = binder(cfg, a1)({s: len(TOKENS) for s in sites}, "cpu")
    twos = binder(cfg, a2)({s: len(TOKENS) for s in sites}, "cpu")
    for name, callee in ones.items():
        exe.bind(name, callee)
    out1 = exe.run(feeds, state=exe.new_state())[0]
    from ingot import compiler
    compiles = []
    real = compiler.run_pipeline
    monkeypatch.setattr(compiler, "run_pipeline", lambda *a, **k: compiles.append(1) or real(*a, **k))
    for name, callee in twos.items():
        exe.bind(name, callee)
    out2 = exe.run(feeds, state=exe.new_state())[0]
    assert compiles == []                                         # swapping adapters compiled nothing
    np.testing.assert_allclose(out1, logits(cfg, merged(cfg, tensors, f1, 2.0), TOKENS), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out2, logits(cfg, merged(cfg, tensors, f2, 4.0), TOKENS), rtol=1e-4, atol=1e-4)
    assert graph.compile(len(TOKENS)) is exe                      # still the one compiled executable


def test_adapter_whose_shapes_do_not_fit_is_one_sentence(tiny, tmp_path):
    cfg, _ = tiny
    write_peft(tmp_path / "bad", cfg, ["o_proj"], bad_shape=True)
    with pytest.raises(IngotError, match=r"do not fit the model's weight \[64, 64\]"):
        load_peft(tmp_path / "bad", cfg)
    write_peft(tmp_path / "deep", cfg, ["v_proj"], layers=[5])
    with pytest.raises(IngotError, match="layer 5"):
        load_peft(tmp_path / "deep", cfg)
    with pytest.raises(IngotError, match="adapter_config.json"):
        load_peft(tmp_path / "missing", cfg)


def test_lora_argument_scale():
    assert parse_lora_arg("some/dir:0.5") == ("some/dir", 0.5)
    assert parse_lora_arg("some/dir") == ("some/dir", 1.0)


def test_adapter_sets_add_up(tiny):
    cfg, tensors = tiny
    rng = np.random.default_rng(4)
    name = "blk.1.attn_output.weight"
    pairs = [(rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)) for _ in range(2)]
    both = AdapterSet({name: [pairs[0]]}).merged(AdapterSet({name: [pairs[1]]}))
    merged_tensors = dict(tensors)
    merged_tensors[name] = tensors[name] + both.delta(name)
    np.testing.assert_allclose(logits(cfg, tensors, TOKENS, both), logits(cfg, merged_tensors, TOKENS), rtol=1e-4, atol=1e-4)


def test_lora_on_quantized_weights_side_by_side(tiny, tmp_path):
    """q/k/v quantized alike are multiplied as one matrix: one call site whose adapter has zero rows for k."""
    from ingot.quant import quantize

    cfg, tensors = tiny
    quantized = {n: quantize(w, "uint4:32") if w.ndim == 2 else w for n, w in tensors.items()}
    dequantized = {n: t.dequantize_rows() if hasattr(t, "dequantize_rows") else t for n, t in quantized.items()}
    factors = write_peft(tmp_path / "qv", cfg, ["q_proj", "v_proj"], seed=5)
    adapters = load_peft(tmp_path / "qv", cfg)
    graph = llama.build(cfg, quantized, adapter_sites=adapters.names, all_logits=True)
    exe = graph.compile(len(TOKENS))
    assert sorted(exe.call_sites) == [f"blk.{i}.attn_q.weight+blk.{i}.attn_k.weight+blk.{i}.attn_v.weight" for i in range(2)]
    np.testing.assert_allclose(logits(cfg, quantized, TOKENS, adapters), logits(cfg, merged(cfg, dequantized, factors, 2.0), TOKENS),
                               rtol=1e-4, atol=1e-4)
