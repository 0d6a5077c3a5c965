"""`ingot serve`: the per-row decode graph (continuous batching) against batch-1 decoders, then a
live server on 127.0.0.1 driven by the official `openai` client (see the second half)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot import IngotError
from ingot import dtypes as dt
from ingot.ir import TensorType
from ingot.models import llama
from ingot.runtime import State

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config  # noqa: E402


def _row_state(cfg, states: list) -> State:
    """The rows decoder's variables as views of batch-1 states: row r is states[r]'s cache."""
    return State({f"blk.{i}.{kind}_cache.{r}": s.values[f"blk.{i}.{kind}_cache"]
                  for r, s in enumerate(states) for i in range(cfg.n_layers) for kind in ("k", "v")})


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rows_decoder_is_bit_exact_per_row(qk_norm):
    """Three sequences at different positions, one token each per step: every row's logits equal a
    batch-1 decoder's exactly, whatever the other rows hold (the server's greedy results cannot
    depend on what else is in the batch)."""
    cfg = tiny_config(qk_norm=qk_norm)
    weights = llama.random_weights(cfg, seed=1)
    single = llama.build(cfg, weights)
    decoder = single.compile(1)
    rows = 3
    model = llama.build(cfg, weights, rows=rows)
    exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits])
    assert exe.feed_order == ["tokens", "positions"]
    assert all(n.attrs.get("inplace") for n in exe.program.nodes() if n.op.name == "SLICE_UPDATE")
    rng = np.random.default_rng(0)
    lengths = [5, 2, 7]
    served, reference, last = [], [], []
    for n in lengths:
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        states = [decoder.new_state(), decoder.new_state()]
        for state in states:
            logits = single.compile(n).run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(n - 1)}, state=state)[0]
        served.append(states[0])
        reference.append(states[1])
        last.append(int(np.argmax(logits[0])))
    positions = list(lengths)
    for step in range(4):
        noise = step % 2 == 1   # the third row's token: its own, or anything else
        tokens = [last[0], last[1], (last[2] + 17) % cfg.vocab_size if noise else last[2]]
        got = exe.run({"tokens": np.array(tokens, np.int32), "positions": np.array(positions, np.int32)},
                      state=_row_state(cfg, served))[0]
        assert got.shape == (rows, cfg.vocab_size)
        for r in range(2):
            want = decoder.run({"tokens": np.array([tokens[r]], np.int32), "pos": np.int32(positions[r]),
                                "last": np.int32(0)}, state=reference[r])[0][0]
            np.testing.assert_array_equal(got[r], want, err_msg=f"step {step}, row {r}")
        last = [int(np.argmax(row)) for row in got]
        positions = [p + 1 for p in positions]


def test_rows_takes_batch_one_and_a_count():
    cfg = tiny_config()
    weights = llama.random_weights(cfg, seed=1)
    with pytest.raises(IngotError, match="rows=2 .* batch=1"):
        llama.build(cfg, weights, rows=2, batch=2)
    with pytest.raises(IngotError, match="rows must be"):
        llama.build(cfg, weights, rows=-1)
