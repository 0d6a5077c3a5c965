"""Prefill attention on the CPU (nn_kernels.attention_blas) past CAUSAL_CHUNK queries: each chunk of
queries multiplies only the keys it sees (its causal end, its sliding window's start), one compiled
softmax pass per row; against the SDPA reference on awkward lengths, windows and caps."""
from __future__ import annotations

import numpy as np
import pytest

from ingot.backends.cpu import nn_kernels
from ingot.ops import nn as nn_ops

RNG = np.random.default_rng(41)


@pytest.mark.parametrize("tq,length,window,softcap", [(300, 300, 0, 0.0), (261, 333, 0, 0.0), (300, 300, 50, 0.0),
                                                      (129, 400, 130, 0.0), (257, 290, 7, 2.5), (200, 200, 256, 0.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_causal_prefill_matches_reference(tq, length, window, softcap, threads, monkeypatch):
    monkeypatch.setitem(nn_kernels.SPLIT, "threads", threads)
    q = RNG.standard_normal((1, 4, tq, 24)).astype(np.float32)
    k = RNG.standard_normal((1, 2, 416, 24)).astype(np.float32)
    v = RNG.standard_normal((1, 2, 416, 20)).astype(np.float32)
    want = nn_ops.sdpa(q, k, v, None, length, 0.3, True, window, softcap)
    got = nn_kernels.attention_blas(q, k, v, length, np.float32(0.3), True, window, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scores_softmax_zeroes_the_unseen_keys():
    s = RNG.standard_normal((1, 1, 6, 9)).astype(np.float32)
    nn_kernels.scores_softmax(s, 3, 9, np.float32(1.0), True, 4, np.float32(0.0))   # 2 query heads x 3 queries
    seen = (s != 0).reshape(2, 3, 9)
    for t, position in enumerate((6, 7, 8)):
        assert seen[:, t].tolist() == [[position - 4 < j <= position for j in range(9)]] * 2
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-6)
