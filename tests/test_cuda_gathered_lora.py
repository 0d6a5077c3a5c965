"""Per-request LoRA adapters on the CUDA backend (marker `cuda`): the gathered LoRA kernels
(backends/cuda/gathered_lora.py) against the NumPy reference on awkward shapes (ranks 1, 8 and 16
mixed and zero-padded, 1..64 rows, widths not multiples of 16, rows on the base entry, indices
outside the table), each row independent of the others; then `ingot serve --device cuda --lora`'s
engine: the base model and two adapters in one captured rows step, each request's greedy tokens
equal to it alone and to `ingot generate --lora` on the device.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_gathered_lora.py
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

from ingot.backends.cuda import device_name  # noqa: E402

DEVICE = torch.device(device_name())


def _tables(k: int, n: int, ranks: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A [E, k, R] and B [E, R, n] of adapters of these ranks, zero-padded to the largest; entry 0 the
    base model's (zeros), as serve/adapters.RowAdapters stacks them."""
    rng = np.random.default_rng(seed)
    rank = max(ranks)
    a = np.zeros((len(ranks) + 1, k, rank), np.float32)
    b = np.zeros((len(ranks) + 1, rank, n), np.float32)
    for i, r in enumerate(ranks, start=1):
        a[i, :, :r] = rng.standard_normal((k, r)) / np.sqrt(k)
        b[i, :r] = rng.standard_normal((r, n))
    return a, b


def _reference(x, a, b, which) -> np.ndarray:
    """Each row through its adapter, in float64 (an index outside the table: zeros)."""
    out = np.zeros((x.shape[0], b.shape[2]))
    for r, w in enumerate(which):
        w = w + a.shape[0] if w < 0 else w
        if 0 <= w < a.shape[0]:
            out[r] = (x[r].astype(np.float64) @ a[w]) @ b[w]
    return out


def _run(x, a, b, which) -> np.ndarray:
    from ingot.backends.cuda.gathered_lora import gathered_lora

    t = lambda v: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE)   # noqa: E731
    return gathered_lora(t(x), t(a), t(b), t(which)).cpu().numpy()


# (rows, K, N, ranks): 1..64 rows; widths not multiples of 16, K over several splits of 512
CASES = [(1, 37, 29, [1]), (5, 100, 61, [1, 8, 16]), (17, 1100, 45, [8, 1, 16]), (64, 77, 200, [16, 1, 8]),
         (3, 300, 70, [64, 1])]   # a larger rank: smaller tiles


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"rows{c[0]}_k{c[1]}_n{c[2]}_ranks{'-'.join(map(str, c[3]))}")
def test_gathered_lora_kernels_equal_the_reference(case):
    rows, k, n, ranks = case
    a, b = _tables(k, n, ranks)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    which = rng.integers(0, len(ranks) + 1, rows).astype(np.int32)
    which[0] = 0                                  # the base entry
    if rows > 2:
        which[1], which[2] = -1, len(ranks) + 1   # wraps to the last adapter; outside the table
    got = _run(x, a, b, which)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, _reference(x, a, b, which), rtol=1e-4, atol=1e-4)
    assert not got[0].any() and (rows <= 2 or not got[2].any())          # exactly zero: base entry, outside
    # each row alone, or among other rows and adapters: the same bits
    for r in sorted({0, rows // 2, rows - 1}):
        np.testing.assert_array_equal(_run(x[r:r + 1], a, b, which[r:r + 1])[0], got[r])
    shuffled = np.roll(which, 1)
    shuffled[rows - 1 if rows > 1 else 0] = which[rows - 1]
    np.testing.assert_array_equal(_run(x, a, b, shuffled)[rows - 1], got[rows - 1])


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory):
    from quant_helpers import save_tiny
    from test_serve_adapters import write_adapters

    root = tmp_path_factory.mktemp("cuda_lora")
    save_tiny(root / "tiny.llm")
    return str(root / "tiny.llm"), write_adapters(root)


def test_engine_serves_adapters_per_request_in_one_captured_step(tiny_with_adapters):
    """`ingot serve --device cuda --lora`: base and adapters in one batch, each answer equal to it
    alone and to generate --lora; the rows step has no host sync (one CUDA graph per bucket)."""
    from test_serve_adapters import check_adapter_engine

    engine = check_adapter_engine(*tiny_with_adapters, "cuda", pool=True, kv_dtype="float32")
    for exe, adapter_rows in engine._rows.values():
        assert adapter_rows is not None
        assert not exe.plan.host_syncs, exe.plan.host_syncs
        # q, v (float32 weights: separate matmuls) and down, each layer
        assert exe.plan.fusions.count("gathered lora (shrink + expand)") == 3 * engine.config.n_layers
        assert exe.plan.capturable == (not _INTERPRET)
