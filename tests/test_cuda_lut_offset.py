"""lut4:bB:offset (and lut4:bB:offset:k) on the CUDA backend (marker `cuda`): the scaled-table kernels add each block's bias
themselves (GEMV: x's block sums times the biases; GEMM and gather: in the looked-up tile). The
matmul (one row: the GEMV; three: the GEMM), stored k-major and transposed ([N, K], as a tied
embedding's head), and the gather, against the CPU backend on shapes off the tiles (K = 96 in blocks of
32, N = 10 or 9). Under Triton's interpreter only the matmul runs: its scaled-table gather kernel hits
the interpreter's "mask has unsupported dtype" (without a bias too)."""
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


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_offset_table_matmul_and_gather_equal_the_cpu(with_bias, transpose, rows):
    rng = np.random.default_rng()
    k, n, block = 96, 9 if transpose else 10, 32
    codes = rng.integers(0, 16, (n, k) if transpose else (k, n)).astype(np.uint8)
    pshape = (n, k // block) if transpose else (k // block, n)
    g = ingot.Graph()
    x = g.placeholder((rows, k), name="x")
    idx = g.placeholder((2,), ingot.int32, name="idx")
    w = g.dequantize(g.constant(dt.pack_int4(codes), dtype=dt.uint4),
                     lut=np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16),
                     scale=rng.uniform(0.5, 2, pshape).astype(np.float16),
                     bias=rng.standard_normal(pshape).astype(np.float16) if with_bias else None,
                     axis=1 if transpose else 0, block_size=block)
    y = g.matmul(x, g.transpose(w, (1, 0)) if transpose else w)
    targets = {"y": y}
    feeds = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
    if not INTERPRET:   # rows of the [N, K] weight (an embedding's lookup), columns of the [K, N] one
        targets["rows"] = g.gather(w, idx, axis=0) if transpose else g.gather(w, idx, axis=1)
        feeds["idx"] = np.array([1, 7], np.int32)
    want = g.compile(targets=targets, device="cpu").run(feeds)
    got = g.compile(targets=targets, device="cuda").run(feeds)
    for name in targets:
        np.testing.assert_allclose(to_host(got[name]), np.asarray(want[name]), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sibling_tables_run_as_one_matmul_and_equal_the_cpu(with_bias, rows):
    """q/k/v-like siblings of lut4 weights stored [N, K] (one table for 12 and for 6 output rows, a table per 4 in the
    third): one matmul over the weights side by side, their tables repeated to every 2 columns."""
    rng = np.random.default_rng()
    k, block = 64, 32
    g = ingot.Graph()
    x = g.placeholder((rows, k), name="x")
    outs = []
    for n, tables in ((12, 1), (6, 1), (8, 2)):
        w = g.dequantize(g.constant(dt.pack_int4(rng.integers(0, 16, (n, k)).astype(np.uint8)), dtype=dt.uint4),
                         lut=np.sort(rng.standard_normal((tables, 1, 16)), axis=-1).astype(np.float32),
                         scale=rng.uniform(0.5, 2, (n, k // block)).astype(np.float16),
                         bias=rng.standard_normal((n, k // block)).astype(np.float16) if with_bias else None,
                         axis=1, block_size=block)
        outs.append(g.matmul(x, g.transpose(w, (1, 0))))
    feeds = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
    want = g.compile(targets=outs, device="cpu").run(feeds)
    exe = g.compile(targets=outs, device="cuda")
    assert "3 sibling quantized matmuls" in exe.plan.fusions, exe.plan.fusions
    for got, ref in zip(exe.run(feeds), want):
        np.testing.assert_allclose(to_host(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_two_level_table_weight_equals_the_cpu():
    """lut4:b32:offset:k as the quantizer gives it (scales and offsets float16 products of 6-bit codes and
    units, the table refitted): the CUDA pipeline takes it as lut4:bB:offset, the same numbers as the CPU."""
    from ingot.quant import quantize

    rng = np.random.default_rng(5)
    t = quantize(rng.standard_t(4, (10, 96)).astype(np.float32), "lut4:b32:offset:k").to_k_major()
    assert t.two_level == (96, 6)
    g = ingot.Graph()
    x = g.placeholder((3, 96), name="x")
    w = g.dequantize(g.constant(t.q, dtype=t.qdtype), lut=t.lut, scale=t.scale, bias=t.bias, axis=0, block_size=32)
    targets = {"y": g.matmul(x, w)}
    feeds = {"x": rng.standard_normal((3, 96)).astype(np.float32)}
    want = g.compile(targets=targets, device="cpu").run(feeds)
    got = g.compile(targets=targets, device="cuda").run(feeds)
    np.testing.assert_allclose(to_host(got["y"]), np.asarray(want["y"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(want["y"]), feeds["x"] @ t.dequantize_rows(), rtol=1e-4, atol=1e-4)
