"""Residual-row compensation (AdapterSet.rows: gather(pad(x @ R.T), map) beside low-rank factors) on
the CUDA backend (marker `cuda`), through the same IR ops as the CPU: against NumPy and the CPU
backend, and a tiny model with residual rows on its head equal on both backends.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_residual_rows.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

require_cuda()

from ingot.adapters import AdapterSet, _int8_columns  # noqa: E402


@pytest.mark.parametrize("length", [1, 3])
def test_rows_executable_on_cuda_equals_numpy_and_the_cpu(length):
    rng = np.random.default_rng(2)
    width, out = 40, 77
    r = rng.standard_normal((9, width)).astype(np.float32)
    idx = np.array([76, 0, 5, 33, 34, 60, 2, 11, 50], np.int32)
    a, b = rng.standard_normal((2, width)).astype(np.float32), rng.standard_normal((out, 2)).astype(np.float32)
    x = rng.standard_normal((length, width)).astype(np.float32)
    q, s = _int8_columns(r.T)
    want = x @ (b @ a).T
    want[:, idx] += x @ (q.astype(np.float32) * s)
    for adapters in (AdapterSet({"w": [(a, b)]}, rows={"w": (idx, r)}),):
        exe = adapters.executable(["w"], [out], length, device="cuda")
        got = exe.backend.to_host(exe.run([x])[0])
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        cpu = adapters.executable(["w"], [out], length, device="cpu").run([x])[0]
        np.testing.assert_allclose(got, cpu, rtol=1e-3, atol=1e-3)
    only = AdapterSet(rows={"w": (idx[:4], r[:4])}).executable(["w"], [out], length, device="cuda")
    got = only.backend.to_host(only.run([x])[0])
    want = np.zeros((length, out), np.float32)
    want[:, idx[:4]] = x @ (q[:, :4].astype(np.float32) * s[:, :4])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_tiny_model_with_head_rows_equals_the_cpu():
    """The tied head's rows on both uses: the head's columns and the embedding lookup (ingot.adapters.LOOKUP)."""
    from quant_helpers import tiny_config, tiny_tensors

    from ingot.adapters import binder
    from ingot.models import llama

    cfg = tiny_config()
    rng = np.random.default_rng(3)
    rows = AdapterSet(rows={"token_embd.weight": (np.array([3, 40, 41, 295], np.int32),
                                                  rng.standard_normal((4, cfg.dim)).astype(np.float32))})
    out = {}
    for tokens in ([1, 40, 41, 60], [1, 7, 8, 60]):   # looked-up tokens with rows, and without
        for device, adapters in (("cpu", rows), ("cuda", rows), ("plain", AdapterSet())):
            graph = llama.build(cfg, tiny_tensors(cfg), adapter_sites=adapters.names, all_logits=True)
            graph.callables_for = binder(cfg, adapters)
            exe = graph.compile(len(tokens), "cpu" if device == "plain" else device)
            out[device, tokens[1]] = exe.backend.to_host(exe.run({"tokens": np.array(tokens, np.int32), "pos": np.int32(0)},
                                                                 state=exe.new_state())[0])
    for t in (40, 7):
        np.testing.assert_allclose(out["cuda", t], out["cpu", t], rtol=2e-3, atol=2e-3)
    assert np.abs(out["cpu", 7][:, [3, 40, 41, 295]] - out["plain", 7][:, [3, 40, 41, 295]]).min() > 1e-3   # the rows act
    np.testing.assert_allclose(np.delete(out["cpu", 7], [3, 40, 41, 295], axis=1),
                               np.delete(out["plain", 7], [3, 40, 41, 295], axis=1), rtol=1e-5, atol=1e-5)
    # tokens 40 and 41 look up corrected embeddings: every logit from position 1 on moves
    assert np.abs(np.delete(out["cpu", 40] - out["plain", 40], [3, 40, 41, 295], axis=1)[1:]).max() > 1e-3
