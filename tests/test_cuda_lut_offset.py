"""lut4:bB:offset on the CUDA backend (marker `cuda`): split_lut_bias leaves the table kernels as they
are and adds x's block sums times the offsets (a gather of them for embedding rows); the matmul and the
gather against the CPU backend on shapes off the tiles (K = 96 in blocks of 32, N = 10, 3 rows).
Under Triton's interpreter only the matmul runs: its scaled-table gather kernel hits the interpreter's
"mask has unsupported dtype" (without a bias too)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

INTERPRET = require_cuda()
from ingot.backends.cuda import to_host  # noqa: E402


@pytest.mark.parametrize("with_bias", [True, False])
def test_offset_table_matmul_and_gather_equal_the_cpu(with_bias):
    rng = np.random.default_rng()
    k, n = 96, 10
    g = ingot.Graph()
    x = g.placeholder((3, k), name="x")
    idx = g.placeholder((2,), ingot.int32, name="idx")
    w = g.dequantize(g.constant(dt.pack_int4(rng.integers(0, 16, (k, n)).astype(np.uint8)), dtype=dt.uint4),
                     lut=np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16),
                     scale=rng.uniform(0.5, 2, (3, n)).astype(np.float16),
                     bias=rng.standard_normal((3, n)).astype(np.float16) if with_bias else None, axis=0, block_size=32)
    targets = {"y": g.matmul(x, w)} if INTERPRET else {"y": g.matmul(x, w), "rows": g.gather(w, idx, axis=1)}
    feeds = {"x": rng.standard_normal((3, k)).astype(np.float32)}
    if not INTERPRET:
        feeds["idx"] = np.array([1, 7], np.int32)
    want = g.compile(targets=targets, device="cpu").run(feeds)
    exe = g.compile(targets=targets, device="cuda")
    got = exe.run(feeds)
    for name in targets:
        np.testing.assert_allclose(to_host(got[name]), np.asarray(want[name]), rtol=1e-5, atol=1e-5, err_msg=name)
