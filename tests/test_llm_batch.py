"""Batched lockstep decode in the Llama graph builder (CPU backend): B sequences in one graph equal
B separate batch-1 runs, prefill then greedy decode steps, for float and quantized weights."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot import IngotError
from ingot.models import llama

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config, tiny_tensors  # noqa: E402

BATCH, PROMPT, STEPS = 3, 5, 4


def _weights(kind: str, cfg: llama.LlamaConfig) -> dict:
    if kind == "f32":
        return tiny_tensors(cfg, seed=1)
    return llama.random_weights(cfg, seed=1)   # uint4 in blocks of 32 (quantized_matmul after fusion)


def _prompts(cfg: llama.LlamaConfig) -> np.ndarray:
    return np.random.default_rng(7).integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)


def _separate(cfg, weights, prompts) -> list[list[np.ndarray]]:
    """Each sequence on its own through the batch-1 graph: logits after prefill, then greedy steps."""
    model = llama.build(cfg, weights)
    pre, dec = model.compile(PROMPT), model.compile(1)
    runs = []
    for prompt in prompts:
        state = dec.new_state()
        logits = pre.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(PROMPT - 1)}, state=state)[0]
        seen = [logits[0]]
        for i in range(STEPS):
            token = np.array([np.argmax(seen[-1])], np.int32)
            seen.append(dec.run({"tokens": token, "pos": np.int32(PROMPT + i), "last": np.int32(0)}, state=state)[0][0])
        runs.append(seen)
    return runs


@pytest.mark.parametrize("kind", ["f32", "uint4"])
def test_batched_decode_equals_separate_runs(kind):
    cfg = tiny_config()
    weights = _weights(kind, cfg)
    prompts = _prompts(cfg)
    want = _separate(cfg, weights, prompts)

    model = llama.build(cfg, weights, batch=BATCH)
    assert model.batch == BATCH
    pre, dec = model.compile(PROMPT), model.compile(1)
    state = dec.new_state()
    assert state.values["blk.0.k_cache"].shape == (BATCH, cfg.n_kv_heads, cfg.context_length, cfg.head_dim)
    logits = pre.run({"tokens": prompts.reshape(-1), "pos": np.int32(0), "last": np.int32(PROMPT - 1)}, state=state)[0]
    assert logits.shape == (BATCH, cfg.vocab_size) and logits.dtype == np.float32
    for step in range(STEPS + 1):
        for b in range(BATCH):
            np.testing.assert_allclose(logits[b], want[b][step], rtol=1e-5, atol=1e-5, err_msg=f"step {step}, sequence {b}")
        if step < STEPS:
            tokens = np.array([np.argmax(want[b][step]) for b in range(BATCH)], np.int32)
            logits = dec.run({"tokens": tokens, "pos": np.int32(PROMPT + step), "last": np.int32(0)}, state=state)[0]


def test_batched_all_logits_are_every_row_of_every_sequence():
    cfg = tiny_config(tied_embeddings=False, qkv_bias=True, rope_interleaved=False)
    weights = tiny_tensors(cfg, seed=2)
    prompts = _prompts(cfg)
    single = llama.build(cfg, weights, all_logits=True).compile(PROMPT)
    want = [single.run({"tokens": p, "pos": np.int32(0)}, state=single.new_state())[0] for p in prompts]
    batched = llama.build(cfg, weights, all_logits=True, batch=BATCH).compile(PROMPT)
    got = batched.run({"tokens": prompts.reshape(-1), "pos": np.int32(0)}, state=batched.new_state())[0]
    assert got.shape == (BATCH * PROMPT, cfg.vocab_size)
    np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [0, -2, 2.5, True, "4"])
def test_bad_batch_is_a_clear_error(batch):
    with pytest.raises(IngotError, match="batch must be a whole number of sequences >= 1"):
        llama.build(tiny_config(), {}, batch=batch)
