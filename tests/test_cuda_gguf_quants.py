"""GGUF's scaled-table types (IQ4_NL/XS, the IQ2/IQ3/IQ1 grids, MXFP4) on the CUDA backend (marker
`cuda`): there is no kernel for mode "scaled_lut" yet, and compiling one is refused in one sentence,
never multiplied as if the table were a scale. The affine imports (Q2_K, Q3_K, TQ*) run the int4
kernels. Skips cleanly without torch, triton or a GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1`
runs it under Triton's interpreter.
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

gguf = pytest.importorskip("gguf")  # the device machine has no gguf: skip there
T = gguf.GGMLQuantizationType
from test_gguf_quants import random_blocks, write_gguf  # noqa: E402

from ingot import IngotError  # noqa: E402
from ingot import dtypes as dt  # noqa: E402
from ingot.graph import Graph  # noqa: E402
from ingot.importers import read_gguf  # noqa: E402


def matmul_graph(t):
    g = Graph()
    q = g.constant(t.q, dtype=t.qdtype)
    if t.lut is not None:
        w = g.dequantize(q, lut=g.constant(t.lut), scale=g.constant(t.scale), axis=0, block_size=t.block_size)
    else:
        extra = {"bias": g.constant(t.bias)} if t.bias is not None else {}
        w = g.dequantize(q, scale=g.constant(t.scale), axis=0, block_size=t.block_size, **extra)
    x = g.placeholder((1, t.shape[0]), dt.float32, name="x")
    return g, g.matmul(x, w)


@pytest.mark.parametrize("qtype", [T.IQ4_XS, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_scaled_tables_refused_affine_imports_run(tmp_path, qtype):
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, qtype, 4, 256)
    t = read_gguf(write_gguf(tmp_path / "w.gguf", [("w", raw, qtype)])).tensors["w"].to_k_major()
    g, y = matmul_graph(t)
    if t.lut is not None:
        with pytest.raises(IngotError, match="no kernel for mode 'scaled_lut'"):
            g.compile(targets=[y], device="cuda")
        return
    exe = g.compile(targets=[y], device="cuda")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    got = exe.backend.to_host(exe.run({"x": x})[0])
    want = x @ gguf.quants.dequantize(raw, qtype).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
