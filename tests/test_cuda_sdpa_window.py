"""SDPA with a sliding window or a logit softcap (Gemma 2/3) on the CUDA backend (marker `cuda`): torch
ops on the device (lowerings._sdpa_torch), no host fallback, against ops/nn.py's reference on GQA,
prefill and decode over a cache with a runtime length, a bool mask, and queries that see no key. Skips
cleanly without torch, triton or a GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it anywhere.
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

from ingot import dtypes as dt  # noqa: E402
from ingot.graph import Graph  # noqa: E402
from ingot.ops.nn import sdpa  # noqa: E402


@pytest.mark.parametrize("tq, tk, length, window, softcap, masked", [
    (7, 7, None, 3, 0.0, False),       # prefill, window inside the prompt
    (1, 12, 9, 4, 0.0, False),         # decode over a cache of 12 slots, 9 filled
    (5, 12, 11, 2, 30.0, False),       # a chunk of 5 after 6 cached, window and softcap
    (3, 6, None, 0, 5.0, True),        # softcap alone, a bool mask hiding every key of one query
])
def test_windowed_sdpa_matches_the_reference(tq, tk, length, window, softcap, masked):
    rng = np.random.default_rng(tq * 100 + tk)
    hq, hk, d = 4, 2, 16
    q = rng.standard_normal((hq, tq, d)).astype(np.float32) * 2
    k = rng.standard_normal((hk, tk, d)).astype(np.float32) * 2
    v = rng.standard_normal((hk, tk, d)).astype(np.float32)
    mask = rng.random((tq, tk)) > 0.3 if masked else None
    if masked:
        mask[1] = False
    g = Graph()
    feeds = {"q": q, "k": k, "v": v}
    qp, kp, vp = (g.placeholder(a.shape, dt.float32, name=n) for n, a in feeds.items())
    extra = {}
    if masked:
        extra["mask"] = g.placeholder(mask.shape, dt.bool_, name="mask")
        feeds["mask"] = mask
    if length is not None:
        extra["length"] = g.placeholder((), dt.int32, name="length")
        feeds["length"] = np.int32(length)
    y = g.scaled_dot_product_attention(qp, kp, vp, causal=not masked, window=window, softcap=softcap, **extra)
    exe = g.compile(targets=[y], device="cuda")
    assert not exe.plan.host_syncs, exe.plan.host_syncs      # on the device, not the host reference
    got = exe.backend.to_host(exe.run(feeds)[0])
    want = sdpa(q, k, v, mask, None if length is None else np.int32(length), None, not masked, window, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if masked:
        assert np.all(got[:, 1] == 0)                            # a query that sees no key: zeros
