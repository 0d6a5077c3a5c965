"""The CPU LUT quantized_matmul kernels (GEMV and tiled GEMM) against the NumPy reference, on
awkward shapes, per-tensor and per-group tables, 4 and 8 bits, the AVX-512 permute GEMV and the
portable one."""
import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.backends.cpu import lut_kernels
from ingot.ir import Node, Op, TensorType
from ingot.ops.quant import quantized_matmul_reference
from ingot.quant import quantize


@pytest.mark.parametrize("fmt,n,k", [("lut4", 18, 94), ("lut4:g6", 18, 94), ("lut8", 18, 94), ("lut8:g3", 18, 94),
                                     ("lut4", 82, 130), ("lut4:g32", 96, 70), ("lut4:g64", 128, 198)])
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("permute", [True, False], ids=["permute", "portable"])
def test_lut_step_matches_reference(fmt, n, k, rows, permute):
    """N = 82: two 32-column groups of the permute GEMV and a 9-byte tail; K = 130 and 198: a last
    block of rows shorter than PERM_BLOCK; g32/g64: a table per group of 32/64 columns."""
    if permute and not lut_kernels.PERMUTE:
        pytest.skip("no AVX-512 on this CPU")
    rng = np.random.default_rng(n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)       # [out, in]
    t = quantize(w, fmt).to_k_major()
    x = rng.standard_normal((rows, k)).astype(np.float32)
    attrs = {"qdtype": t.qdtype, "dtype": dt.float32, "mode": "lut", "transpose": False}
    node = Node(Op.QUANTIZED_MATMUL, TensorType((rows, n), dt.float32), (), attrs)
    step = lut_kernels.lut_matmul_step(node, None, permute=permute)
    got = step(x, t.q, t.lut)
    want = quantized_matmul_reference((x, t.q, t.lut), attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, x @ t.dequantize_rows(), rtol=1e-4, atol=1e-4)


def test_permute_gemv_split_over_threads(monkeypatch):
    """The permute GEMV split over a team of two threads (by blocks of rows into partial sums, or by
    columns) adds up to the one-thread result."""
    from ingot.backends.cpu import team
    if not lut_kernels.PERMUTE:
        pytest.skip("no AVX-512 on this CPU")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((192, 300)).astype(np.float32)
    t = quantize(w, "lut4:g64").to_k_major()
    x = rng.standard_normal((2, 300)).astype(np.float32)
    attrs = {"qdtype": t.qdtype, "dtype": dt.float32, "mode": "lut", "transpose": False}
    node = Node(Op.QUANTIZED_MATMUL, TensorType((2, 192), dt.float32), (), attrs)
    one = lut_kernels.lut_matmul_step(node, None)(x, t.q, t.lut)
    monkeypatch.setattr(team, "PARALLEL_MIN_WEIGHTS", 1)
    for columns in (1 << 30, 1):
        monkeypatch.setattr(team, "SPLIT_COLUMNS", columns)
        two = lut_kernels.lut_matmul_step(node, None, threads=2)(x, t.q, t.lut)
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5 * float(np.abs(one).max()))
