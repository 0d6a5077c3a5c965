"""The CPU's fused RoPE + KV-cache write + attention step (backends/cpu/rope_cache.py) against the same
model compiled without the fusion: prefill (the compiled kernel for short prompts, BLAS past 16 rows),
then greedy decode steps, logits and caches equal to float32 rounding."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot.models import llama
from ingot.options import CompileOptions

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config, tiny_tensors  # noqa: E402

UNFUSED = CompileOptions(fusions=frozenset({"conv_epilogue"}))


def _kinds(exe) -> list[str]:
    return [n.attrs["kind"] for n in exe.program.nodes() if n.op.name == "FUSED"]


@pytest.mark.parametrize("prompt", [5, 40])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_rope_cache_attention_equals_unfused(prompt, interleaved):
    cfg = tiny_config(rope_interleaved=interleaved)
    weights = tiny_tensors(cfg, seed=2)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, prompt).astype(np.int32)
    runs = []
    for options in (None, UNFUSED):
        model = llama.build(cfg, weights)
        pre, dec = model.compile(prompt, options=options), model.compile(1, options=options)
        runs.append((_kinds(pre) + _kinds(dec)).count("rope_qkv_attention"))
        state = dec.new_state()
        seen = [pre.run({"tokens": tokens, "pos": np.int32(0), "last": np.int32(prompt - 1)}, state=state)[0][0]]
        for i in range(4):
            token = np.array([np.argmax(seen[-1])], np.int32)
            seen.append(dec.run({"tokens": token, "pos": np.int32(prompt + i), "last": np.int32(0)}, state=state)[0][0])
        runs.append((seen, {k: np.array(v) for k, v in state.values.items()}))
    fused_count, (fused, fused_state), unfused_count, (plain, plain_state) = runs
    assert fused_count == 2 * cfg.n_layers and unfused_count == 0   # the fusion ran (and can be turned off)
    for a, b in zip(fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for name in plain_state:
        np.testing.assert_allclose(fused_state[name], plain_state[name], rtol=1e-5, atol=1e-5)
