"""Files, templates and arguments from strangers (issue 31's reproducers): each is refused with one
IngotError sentence (the CLI: one `error:` line, exit 2), fast, without allocating what the input
claims; and a valid file with an odd shape loads."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

import ingot
from hostile import patch_gguf_tensor, tiny_llama_gguf, write_gguf
from ingot import IngotError
from ingot.cli import main

T = gguf.GGMLQuantizationType


def refused(capsys, argv, *words):
    """main(argv) prints exactly one `error:` line holding `words` and returns 2."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def run_cli(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "ingot.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


# -- GGUF: metadata -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("llama.rope.dimension_count", 2**30, ["rope.dimension_count", "1073741824"]),
    ("llama.rope.dimension_count", 18, ["rope.dimension_count", "18", "head dimension 16"]),
    ("llama.attention.head_count", 0, ["attention.head_count", "0"]),
    ("llama.attention.head_count_kv", 0, ["head_count_kv", "0"]),
    ("llama.attention.head_count_kv", 3, ["head_count_kv", "3"]),
    ("llama.attention.head_count", 5, ["embedding_length 64", "head_count 5"]),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), ["layer_norm_rms_epsilon", "nan"]),
    ("llama.rope.freq_base", float("inf"), ["freq_base", "inf"]),
    ("llama.block_count", "two", ["block_count", "'two'", "not an integer"]),
    ("llama.embedding_length", 64.0, ["embedding_length", "not an integer"]),
    ("llama.context_length", -5, ["context_length", "-5"]),
])
def test_gguf_metadata_is_checked_before_use(tmp_path, capsys, key, value, words):
    path = tiny_llama_gguf(tmp_path / "m.gguf", metadata={key: value})
    refused(capsys, ["generate", "hi", "--model", path], "m.gguf", *words)


@pytest.mark.parametrize("metadata, words", [
    ({"tokenizer.ggml.merges": ["zz qq"]}, ["merges", "zz"]),
    ({"tokenizer.ggml.tokens": list(range(270))}, ["tokenizer.ggml.tokens", "int"]),
    ({"tokenizer.ggml.token_type": ["x"] * 270}, ["token_type", "'x'"]),
    ({"tokenizer.ggml.bos_token_id": "one"}, ["bos_token_id", "'one'"]),
    ({"tokenizer.ggml.eos_token_id": 100000}, ["eos_token_id", "100000"]),
])
def test_gguf_tokenizer_metadata_is_checked(tmp_path, capsys, metadata, words):
    path = tiny_llama_gguf(tmp_path / "m.gguf", metadata=metadata)
    refused(capsys, ["generate", "hi", "--model", path], "m.gguf", *words)


# -- GGUF: tensor list ----------------------------------------------------------------------------------

def quantized_file(path, qtype=T.Q4_0, rows=4, cols=64):
    data = gguf.quants.quantize(np.ones((rows, cols), np.float32), qtype)
    return write_gguf(path, {}, {"a": np.ones(3, np.float32)}, raw={"w": (data, qtype)})


@pytest.mark.parametrize("name, patch, words", [
    ("w", dict(dims=[0, 2**40]), ["tensor w", "dimension of 0"]),        # 0 elements that "read": hung for hours
    ("a", dict(dims=[0]), ["tensor a", "dimension of 0"]),
    ("w", dict(dims=[64, 2**40]), ["truncated", "tensor w"]),
    ("w", dict(dims=[2**32, 2**32]), ["truncated", "tensor w"]),         # the product wraps in uint64
    ("a", dict(dims=[2**62]), ["truncated", "tensor a"]),
    ("w", dict(type_id=9999), ["tensor w", "9999"]),
    ("w", dict(offset=2**63), ["truncated", "tensor w"]),
    ("w", dict(dims=[48, 4]), ["tensor w", "48 columns"]),
])
def test_gguf_tensor_list_is_bounded_by_the_file(tmp_path, name, patch, words):
    from ingot.importers.gguf import read_gguf
    path = patch_gguf_tensor(quantized_file(tmp_path / "q.gguf"), name, **patch)
    start = time.monotonic()
    with pytest.raises(IngotError) as e:
        read_gguf(path)
    assert time.monotonic() - start < 30, "a refusal, not a loop over the claimed rows"  # hangs took hours
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_odd_vocabulary_with_a_4bit_embedding_loads(tmp_path, qtype):
    """32001-token vocabularies exist; a 4-bit token embedding of an odd number of rows cannot pack two
    rows per byte once transposed, so it is kept one value per byte: the same logits as its floats."""
    from ingot.importers.gguf import read_gguf
    from ingot.llm.package import open_model
    from ingot.models import llama

    path = tiny_llama_gguf(tmp_path / "odd.gguf", vocab=271, quantize={"token_embd.weight": qtype})
    model = open_model(path)
    assert model.config.vocab_size == 271
    quantized = llama.build(model.config, model.tensors, path).compile(3)
    floats = {k: v for k, v in read_gguf(path).tensors.items()}
    floats["token_embd.weight"] = floats["token_embd.weight"].dequantize_rows()
    reference = llama.build(model.config, floats, path).compile(3)
    feeds = {"tokens": np.array([5, 270, 104], np.int32), "pos": np.int32(0), "last": np.int32(2)}
    got = quantized.run(feeds, state=quantized.new_state())[0]
    want = reference.run(feeds, state=reference.new_state())[0]
    assert got.shape == (1, 271)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
