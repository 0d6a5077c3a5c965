"""The pool rows decoder on the CUDA backend (marker `cuda`): the pool_attention kernels against the
per-row reference of tests/test_pool_attention.py on awkward shapes (odd head_dim, lengths 1 and not
multiples of the key tile, GQA/MQA, a slot used twice, rows outside the pool, window, softcap, forced
splits), unread pool positions NaN so a stray load fails; then the tiny decoder's rows against the
batch-1 decoder on the same device, and each row independent of what else is in the batch.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_pool_attention.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402

from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import device_name, to_host  # noqa: E402
from ingot.backends.cuda.device import to_device  # noqa: E402
from ingot.backends.cuda.pool_attention import pool_attention  # noqa: E402
from ingot.ir import TensorType  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.runtime import State  # noqa: E402

from quant_helpers import tiny_config  # noqa: E402
from test_pool_attention import CASES, _case_arrays, check_mixed_steps, check_pool_engine, per_row  # noqa: E402

DEVICE = torch.device(device_name())


def _nan_past_use(case, arrays):
    """Pool positions no row reads: NaN (a load that strays there poisons the output)."""
    _, _, _, k_pool, v_pool, slots, positions = arrays
    k_pool, v_pool = k_pool.copy(), v_pool.copy()
    for s in range(k_pool.shape[0]):
        used = [p for sl, p in zip(slots, positions) if sl == s and 0 <= p < k_pool.shape[2]]
        first = max(used) + 1 if used else 0
        k_pool[s, :, first:] = np.nan
        v_pool[s, :, first:] = np.nan
    return arrays[:3] + (k_pool, v_pool) + arrays[5:]


@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_pool_attention_kernels_equal_the_reference(case, split):
    if _INTERPRET and case[7] == "bfloat16":
        pytest.skip("Triton's interpreter mishandles bfloat16 (the GPU run checks it)")
    arrays = _nan_past_use(case, _case_arrays(case, seed=5))
    q, k, v, k_pool, v_pool, slots, positions = (to_device(a, DEVICE) for a in arrays)   # (bfloat16 pools too)
    got = pool_attention(q, k, v, k_pool, v_pool, slots, positions, window=case[8], softcap=case[9], split=split,
                         block_n=16)
    want, kp, vp = per_row(*arrays, window=case[8], softcap=case[9])
    tolerance = 1e-5 if case[7] == "float32" else 2e-3
    np.testing.assert_allclose(to_host(got), want, rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(to_host(k_pool).astype(np.float32), kp)   # the writes, in place
    np.testing.assert_array_equal(to_host(v_pool).astype(np.float32), vp)


def _prefill(model, prompt, state):
    n = len(prompt)
    exe = model.compile(n, "cuda")
    return to_host(exe.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(n - 1)},
                           state=state)[0])[0]


def test_pool_rows_decoder_on_cuda_rows_equal_batch_one_whatever_the_batch():
    cfg = tiny_config(head_dim=0, n_layers=2)
    weights = llama.random_weights(cfg, seed=3)
    single = llama.build(cfg, weights)
    rows, entries = 4, 5
    model = llama.build(cfg, weights, rows=rows, pool=entries)
    exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits], device="cuda")
    assert not exe.plan.host_syncs, exe.plan.host_syncs          # capturable: nothing reads back to the host
    pool = exe.new_state()
    entry = lambda s: State({f"blk.{i}.{kind}_cache": pool.values[f"blk.{i}.{kind}_pool"][s:s + 1]  # noqa: E731
                             for i in range(cfg.n_layers) for kind in ("k", "v")})
    decoder = single.compile(1, "cuda")
    rng = np.random.default_rng(2)
    slots, refs, last, positions = [3, 0], [], [], []
    for s, n in zip(slots, (6, 3)):
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        logits = _prefill(single, prompt, entry(s))
        ref = decoder.new_state()
        # the same graph on a pool entry and on a fresh cache: a GEMV's split-K partial sums may be added
        # atomically, in any order, so equal to float rounding on the GPU (bit for bit under the interpreter)
        np.testing.assert_allclose(_prefill(single, prompt, ref), logits, rtol=0 if _INTERPRET else 1e-5,
                                   atol=0 if _INTERPRET else 1e-5)
        refs.append(ref)
        last.append(int(np.argmax(logits)))
        positions.append(n)
    for step in range(2):
        feeds = {"tokens": np.array(last + [1, 2], np.int32), "positions": np.array(positions + [0, 0], np.int32),
                 "slots": np.array(slots + [4, 4], np.int32)}
        got = to_host(exe.run(feeds, state=pool)[0])
        saved = {name: a.clone() for name, a in pool.values.items()}
        other = {"tokens": np.array([5, 6, last[1], 7], np.int32), "positions": np.array([1, 2, positions[1], 3], np.int32),
                 "slots": np.array([1, 2, slots[1], 4], np.int32)}
        alone = to_host(exe.run(other, state=pool)[0])[2]       # row 1 in other company, at another index
        if _INTERPRET:
            np.testing.assert_array_equal(alone, got[1])
        else:   # a GEMV's split-K partial sums may be added atomically, in any order: to float rounding
            np.testing.assert_allclose(alone, got[1], rtol=1e-5, atol=1e-5)
        assert int(np.argmax(alone)) == int(np.argmax(got[1]))
        for name, a in pool.values.items():
            a.copy_(saved[name])
        for r in range(2):
            want = to_host(decoder.run({"tokens": np.array([last[r]], np.int32), "pos": np.int32(positions[r]),
                                        "last": np.int32(0)}, state=refs[r])[0])[0]
            np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}, row {r}")
            assert int(np.argmax(got[r])) == int(np.argmax(want))
        last = [int(np.argmax(row)) for row in got[:2]]
        positions = [p + 1 for p in positions]


@pytest.mark.skipif(_INTERPRET, reason="Triton's interpreter mishandles bfloat16 (the GPU run checks it)")
def test_pool_engine_on_cuda_prompts_ride_in_decode_steps(tmp_path, monkeypatch):
    """Mixed steps on the device: prompt rows in captured decode steps (a 6-row bucket), the choosing rows
    gathered there for the arg-max; every answer equals its prompt served alone."""
    from quant_helpers import save_tiny

    save_tiny(tmp_path / "tiny.llm")
    check_mixed_steps(str(tmp_path / "tiny.llm"), "cuda", monkeypatch)


@pytest.mark.parametrize("kv_dtype", [None, "float32", "int8"])   # None: the CUDA default, bfloat16
def test_pool_engine_on_cuda_equals_alone_and_generate(tmp_path, kv_dtype):
    """`ingot serve --device cuda`'s engine: concurrent greedy answers equal each alone and generate's."""
    if _INTERPRET and kv_dtype is None:
        pytest.skip("Triton's interpreter mishandles bfloat16 (the GPU run checks it)")
    from quant_helpers import save_tiny

    from ingot.llm.generate import PREFILL_BUCKETS

    save_tiny(tmp_path / "tiny.llm")
    engine = check_pool_engine(str(tmp_path / "tiny.llm"), "cuda", kv_dtype)
    # the greedy runs without logprobs launched steps from the device's arg-max before reading it
    assert engine.metrics.steps_ahead > 0
    rows, _ = engine._rows[2]
    assert rows.plan.capturable == (not _INTERPRET)
    # the warmed bucket: one CUDA graph over the pool, whatever slots it served, its tokens fed from the
    # host or from the step before's arg-max; prefill into slots: none
    assert len(rows.plan._graphs) == (0 if _INTERPRET else 1)
    # warm() ran every prefill length on the scratch entry (its kernels compiled before a request): the
    # first 16 positions of its K rows are written, where the rows decoder wrote position 0 only
    k = engine.pool.values["blk.0.k_pool"]
    assert np.asarray(to_host(k[engine.scratch.index, :, 1:16])).astype(np.float32).any()
    slot_states = {id(slot.state.values) for slot in engine.slots}
    assert all(key[0] not in slot_states for size in PREFILL_BUCKETS if size <= engine.context
               for key in engine.model.compile(size, "cuda").plan._graphs)
