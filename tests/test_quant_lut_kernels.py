"""The CPU LUT quantized_matmul kernels (GEMV and tiled GEMM) against the NumPy reference, on
awkward shapes, per-tensor and per-group tables, 4 and 8 bits."""
import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.backends.cpu import lut_kernels
from ingot.ir import Node, Op, TensorType
from ingot.ops.quant import quantized_matmul_reference
from ingot.quant import quantize


@pytest.mark.parametrize("fmt", ["lut4", "lut4:g6", "lut8", "lut8:g3"])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_lut_step_matches_reference(fmt, rows):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((18, 94)).astype(np.float32)       # [out, in]: N = 18, K = 94
    t = quantize(w, fmt).to_k_major()
    x = rng.standard_normal((rows, 94)).astype(np.float32)
    attrs = {"qdtype": t.qdtype, "dtype": dt.float32, "mode": "lut", "transpose": False}
    node = Node(Op.QUANTIZED_MATMUL, TensorType((rows, 18), dt.float32), (), attrs)
    step = lut_kernels.lut_matmul_step(node, None)
    got = step(x, t.q, t.lut)
    want = quantized_matmul_reference((x, t.q, t.lut), attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, x @ t.dequantize_rows(), rtol=1e-4, atol=1e-4)
