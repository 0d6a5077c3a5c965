"""The grouped decode attention kernel (backends/cpu/decode_attention.py): every row at its own position
over its own caches, against NumPy (the RoPE, SDPA and cache-write references) on awkward shapes, and
a row's results bit for bit the same alone, among other rows, on one thread or on the team."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ingot.backends.cpu import decode_attention
from ingot.backends.cpu.block_params import F16C
from ingot.backends.cpu.nn_kernels import kernel_cache
from ingot.ir import Op
from ingot.ops import REGISTRY
from ingot.ops import nn as nn_ops


def _reference_row(q, k, v, kc, vc, pos, length, inv, interleaved, rd, scale, window, softcap):
    """NumPy: rope at pos, the k/v row written (rounded to the cache's dtype), attention over the
    first `length` keys (widened to float32)."""
    rope = lambda x: nn_ops.rope(x, pos, inv, 10000.0, interleaved, rd)   # noqa: E731
    kc, vc = kc.copy(), vc.copy()
    kc[:, :, pos] = rope(k)[:, :, 0].astype(kc.dtype)
    vc[:, :, pos] = v[:, :, 0].astype(vc.dtype)
    attrs = {"scale": scale, "causal": True, "window": window, "softcap": softcap}
    out = REGISTRY[Op.SDPA].reference((rope(q), kc[:, :, :length].astype(np.float32),
                                       vc[:, :, :length].astype(np.float32)), attrs)
    return out, kc, vc


def _case(rows, hq, hk, d, dv, context, seed=7, dtype=np.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)   # noqa: E731
    q, k, v = f(rows, hq, 1, d), f(rows, hk, 1, d), f(rows, hk, 1, dv)
    k_caches = [f(1, hk, context, d).astype(dtype) for _ in range(rows)]
    v_caches = [f(1, hk, context, dv).astype(dtype) for _ in range(rows)]
    return q, k, v, k_caches, v_caches


def _run(q, k, v, k_caches, v_caches, positions, lengths, inv, interleaved, rd, scale, window, softcap, threads=1):
    out = np.full((q.shape[0], q.shape[1], 1, v.shape[3]), np.nan, np.float32)
    decode_attention.run(q, k, v, [kernel_cache(c) for c in k_caches], [kernel_cache(c) for c in v_caches],
                         np.array(positions, np.int64), np.array(lengths, np.int64), inv, interleaved, rd,
                         np.float32(scale), True, window, np.float32(softcap), out, threads)
    return out


CASES = [  # rows, Hq, Hk, D, Dv, rotary dims, context, positions, interleaved, window, softcap
    (5, 6, 3, 10, 10, 6, 23, [0, 1, 22, 9, 4], True, 0, 0.0),             # first and last positions, GQA 2
    (3, 9, 3, 64, 64, 64, 300, [299, 130, 127], False, 0, 0.0),           # lengths across BLOCK (128), GQA 3
    (4, 8, 1, 16, 12, 16, 200, [199, 0, 128, 64], False, 0, 0.0),         # one kv head (MQA), Dv != D
    (3, 4, 4, 12, 12, 8, 50, [49, 17, 2], True, 0, 0.0),                  # no grouping (MHA), partial RoPE
    (4, 6, 2, 8, 8, 8, 300, [290, 5, 140, 0], False, 7, 0.0),             # a sliding window
    (3, 6, 2, 8, 8, 8, 260, [259, 3, 130], False, 0, 5.0),                # a softcap
    (11, 6, 3, 8, 8, 8, 40, [3 * r + 1 for r in range(11)], False, 0, 0.0),   # more rows than ROWS_PER_CALL
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_against_numpy(case):
    rows, hq, hk, d, dv, rd, context, positions, interleaved, window, softcap = case
    q, k, v, k_caches, v_caches = _case(rows, hq, hk, d, dv, context)
    inv = nn_ops.rope_inv_freq(rd, 10000.0)
    scale = 1 / math.sqrt(d)
    want = [_reference_row(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_caches[r], v_caches[r], positions[r], positions[r] + 1,
                           inv, interleaved, rd, scale, window, softcap) for r in range(rows)]
    out = _run(q, k, v, k_caches, v_caches, positions, [p + 1 for p in positions], inv, interleaved, rd, scale, window,
               softcap)
    assert out.shape == (rows, hq, 1, dv) and out.dtype == np.float32
    for r in range(rows):
        np.testing.assert_allclose(out[r:r + 1], want[r][0], rtol=1e-5, atol=1e-5, err_msg=f"row {r}")
        np.testing.assert_allclose(k_caches[r], want[r][1], rtol=1e-6, atol=1e-6, err_msg=f"row {r}")
        np.testing.assert_array_equal(v_caches[r], want[r][2], err_msg=f"row {r}")


def test_lengths_other_than_position_plus_one():
    """A length of 0 gives zeros; a length past the position reads the cache's later rows too."""
    rows, hq, hk, d, context = 3, 4, 2, 8, 30
    q, k, v, k_caches, v_caches = _case(rows, hq, hk, d, d, context, seed=3)
    inv = nn_ops.rope_inv_freq(d, 10000.0)
    positions, lengths = [5, 0, 10], [0, 1, 30]
    want = {r: _reference_row(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_caches[r], v_caches[r], positions[r], lengths[r],
                              inv, False, d, 0.3, 0, 0.0) for r in (1, 2)}
    out = _run(q, k, v, k_caches, v_caches, positions, lengths, inv, False, d, 0.3, 0, 0.0)
    assert not out[0].any()
    for r in (1, 2):
        np.testing.assert_allclose(out[r:r + 1], want[r][0], rtol=1e-5, atol=1e-5, err_msg=f"row {r}")


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16] + ([np.float16] if F16C else []))
def test_narrow_caches_rounded_as_written_and_widened_as_read(dtype):
    rows, hq, hk, d, context = 3, 6, 2, 16, 140
    q, k, v, k_caches, v_caches = _case(rows, hq, hk, d, d, context, seed=5, dtype=dtype)
    inv = nn_ops.rope_inv_freq(d, 10000.0)
    positions = [139, 0, 70]
    want = [_reference_row(q[r:r + 1], k[r:r + 1], v[r:r + 1], k_caches[r], v_caches[r], positions[r], positions[r] + 1,
                           inv, True, d, 0.25, 0, 0.0) for r in range(rows)]
    out = _run(q, k, v, k_caches, v_caches, positions, [p + 1 for p in positions], inv, True, d, 0.25, 0, 0.0)
    for r in range(rows):
        np.testing.assert_allclose(out[r:r + 1], want[r][0], rtol=1e-5, atol=1e-5, err_msg=f"row {r}")
        # the rotated key rounds once to the narrow type: at most one step of it apart
        got, expected = k_caches[r].astype(np.float32), want[r][1].astype(np.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-2 if dtype == ml_dtypes.bfloat16 else 1e-3, atol=1e-6)
        np.testing.assert_array_equal(v_caches[r], want[r][2])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_bit_for_bit_the_same_alone_or_among_others(threads):
    """What `ingot serve` needs: row r's output and caches, computed alone (the batch-1 decode step)
    or with any other rows around it, in any order, on one thread or split over the team."""
    rows, hq, hk, d, context = 6, 9, 3, 64, 400
    q, k, v, k_caches, v_caches = _case(rows, hq, hk, d, d, context, seed=11)
    inv = nn_ops.rope_inv_freq(d, 10000.0)
    positions = [399, 260, 1, 128, 33, 200]
    lengths = [p + 1 for p in positions]
    caches = [(kc.copy(), vc.copy()) for kc, vc in zip(k_caches, v_caches)]
    together = _run(q, k, v, k_caches, v_caches, positions, lengths, inv, False, d, 0.125, 0, 0.0, threads)
    order = [3, 0, 5]   # row 3 among two others, first
    kc, vc = [caches[r][0].copy() for r in order], [caches[r][1].copy() for r in order]
    picked = _run(q[order], k[order], v[order], kc, vc, [positions[r] for r in order], [lengths[r] for r in order], inv,
                  False, d, 0.125, 0, 0.0, threads)
    for r in range(rows):
        alone_k, alone_v = caches[r][0].copy(), caches[r][1].copy()
        alone = _run(q[r:r + 1], k[r:r + 1], v[r:r + 1], [alone_k], [alone_v], positions[r:r + 1], lengths[r:r + 1], inv,
                     False, d, 0.125, 0, 0.0, 1)
        np.testing.assert_array_equal(together[r], alone[0], err_msg=f"row {r}")
        np.testing.assert_array_equal(k_caches[r], alone_k)
        np.testing.assert_array_equal(v_caches[r], alone_v)
        if r in order:
            np.testing.assert_array_equal(picked[order.index(r)], alone[0], err_msg=f"row {r} among others")


def test_rope_table_matches_the_reference_and_grows():
    inv = nn_ops.rope_inv_freq(8, 10000.0)
    cos, sin = decode_attention.rope_table(inv, 8, 10)
    assert cos.shape[0] >= 10 and cos.shape[1] == 4
    bigger = decode_attention.rope_table(inv, 8, 5000)[0]
    assert bigger.shape[0] >= 5000
    angles = np.arange(5000)[:, None] * inv[None, :4].astype(np.float64)
    np.testing.assert_allclose(bigger[:5000], np.cos(angles), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(bigger[:cos.shape[0]], cos)   # grown, the old positions kept
