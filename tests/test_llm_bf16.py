"""Dense bfloat16 Llama weights on the CPU backend: the graph keeps every matrix bf16 (cast to float32
where it is read) and computes exactly what the same model does with those weights widened to
float32 beforehand; a BF16 GGUF file reaches the builder as bf16 arrays.

The CUDA half (the matmul that reads the bf16 weight directly) is tests/test_cuda_bf16.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.ir import Op
from ingot.models import llama

BF16 = dt.bfloat16.storage


def tiny_config(**overrides) -> llama.LlamaConfig:
    # odd sizes: head_dim 12, ffn 72, vocab 97
    cfg = dict(n_layers=2, dim=48, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=97, context_length=32)
    cfg.update(overrides)
    return llama.LlamaConfig(**cfg)


def widened(tensors: dict) -> dict:
    return {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == BF16 else v for k, v in tensors.items()}


def run_steps(model: llama.LlamaGraph, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Logits of a prefill of `prompt`, then of `steps` greedy decode steps."""
    prefill, decode = model.compile(len(prompt)), model.compile(1)
    feeds = {"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)}
    out = [np.array(prefill.run(feeds)[0])]
    state = prefill.state
    decode.state = state
    for i in range(steps):
        token = int(np.argmax(out[-1][0]))
        out.append(np.array(decode.run({"tokens": np.array([token], np.int32), "pos": np.int32(len(prompt) + i),
                                        "last": np.int32(0)})[0]))
    return out


def test_random_weights_dense_dtype():
    cfg = tiny_config()
    bf, f32 = llama.random_weights(cfg, seed=3, dense_dtype="bfloat16"), llama.random_weights(cfg, seed=3, dense_dtype="float32")
    assert bf.keys() == f32.keys()
    for name, w in bf.items():
        if name.endswith("norm.weight"):
            assert w.dtype == np.float32 and np.array_equal(w, f32[name])
        else:
            assert w.dtype == BF16 and w.shape == f32[name].shape
            np.testing.assert_array_equal(w, f32[name].astype(BF16))  # the same draws, rounded
    q = bf["blk.0.attn_q.weight"].astype(np.float32)
    assert abs(float(q.std()) * np.sqrt(cfg.dim) - 1) < 0.1
    with pytest.raises(Exception, match="dense_dtype"):
        llama.random_weights(cfg, dense_dtype="float16")


def test_weights_stay_bfloat16_in_the_graph():
    cfg = tiny_config()
    model = llama.build(cfg, llama.random_weights(cfg, seed=1, dense_dtype="bfloat16"))
    exe = model.compile(1)
    program = exe.program
    matmuls = [n for n in program.nodes() if n.op == Op.MATMUL]
    assert len(matmuls) == 4 * cfg.n_layers + 1   # q/k/v side by side, output, gate/up side by side, down; head
    for m in matmuls:
        w = m.src[1]
        assert w.op == Op.CAST and w.src[0].op == Op.CONSTANT and w.src[0].dtype == dt.bfloat16, m
        assert w.id not in program.memory_plan        # widened once at load, no per-run buffer
    widths = [m.type.shape[-1] for m in matmuls]
    assert widths.count((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim) == cfg.n_layers  # q/k/v side by side
    assert widths.count(2 * cfg.ffn_dim) == cfg.n_layers                                      # gate/up side by side
    # no float32 copy of a weight among the constants; the embedding rows are gathered bf16, then cast
    big = [k for k, v in program.constants.items() if np.asarray(v).dtype == np.float32 and np.asarray(v).ndim == 2]
    assert not big, big
    gathers = [n for n in program.nodes() if n.op == Op.GATHER]
    assert gathers and all(g.src[0].dtype == dt.bfloat16 for g in gathers)


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_model_equals_its_float32_upcast(tied):
    cfg = tiny_config(tied_embeddings=tied)
    tensors = llama.random_weights(cfg, seed=2, dense_dtype="bfloat16")
    if tied:
        assert "output.weight" not in tensors
    got = run_steps(llama.build(cfg, tensors), [5, 17, 3, 90, 41], 4)
    want = run_steps(llama.build(cfg, widened(tensors)), [5, 17, 3, 90, 41], 4)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_mixed_bfloat16_and_float32_matrices():
    """q bf16 with k/v float32: no side-by-side fusion, each weight its own matmul, same numbers."""
    cfg = tiny_config(n_layers=1)
    tensors = llama.random_weights(cfg, seed=4, dense_dtype="bfloat16")
    tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_k.weight"].astype(np.float32)
    got = run_steps(llama.build(cfg, tensors), [1, 2, 3], 2)
    want = run_steps(llama.build(cfg, widened(tensors)), [1, 2, 3], 2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_bfloat16_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    from ingot.importers.gguf import read_gguf

    cfg = tiny_config(tied_embeddings=True)
    tensors = llama.random_weights(cfg, seed=5, dense_dtype="bfloat16")
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    u32 = gguf.GGUFValueType.UINT32
    for key, value in (("block_count", cfg.n_layers), ("embedding_length", cfg.dim), ("attention.head_count", cfg.n_heads),
                       ("attention.head_count_kv", cfg.n_kv_heads), ("feed_forward_length", cfg.ffn_dim),
                       ("context_length", cfg.context_length)):
        writer.add_key_value(f"llama.{key}", value, u32)
    for name, w in tensors.items():
        if w.dtype == BF16:
            writer.add_tensor(name, w.view(np.uint16), raw_shape=w.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model = read_gguf(tmp_path / "m.gguf", bfloat16=True)
    assert model.tensor_types["blk.0.attn_q.weight"] == "BF16"
    for name, w in tensors.items():
        got = model.tensors[name]
        assert got.dtype == w.dtype and got.shape == w.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8))
    assert read_gguf(tmp_path / "m.gguf").tensors["token_embd.weight"].dtype == np.float32  # the default widens
    file_cfg = llama.LlamaConfig.from_gguf(model)
    assert file_cfg.tied_embeddings and file_cfg.vocab_size == cfg.vocab_size
    got = run_steps(llama.build(file_cfg, model.tensors), [7, 8, 9], 2)
    want = run_steps(llama.build(file_cfg, widened(tensors)), [7, 8, 9], 2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
    from ingot.llm.package import open_model
    lazy = open_model(str(tmp_path / "m.gguf"), bfloat16=True)   # the LLM loader's way in (lazy tensors)
    assert lazy.tensors["blk.1.ffn_down.weight"].dtype == BF16
    assert open_model(str(tmp_path / "m.gguf")).tensors["blk.1.ffn_down.weight"].dtype == np.float32
