"""The CPU backend's vectorised float32 math (backends/cpu/nn_kernels.py: a polynomial exp, sigmoid,
tanh, GELU in its erf and tanh forms) against float64 NumPy, over every range: tiny, cancelling,
saturating, infinite and NaN inputs, on an awkward length (not a multiple of the vector width)."""
import math

import numpy as np
from numba import njit

from ingot.backends.cpu import LOWERINGS, nn_kernels
from ingot.ir import Node, Op, TensorType

X = np.concatenate([np.random.default_rng(0).standard_normal(1001) * 4, np.linspace(-0.05, 0.05, 77),
                    [0.0, -0.0, 1e-30, -1e-8, 0.019999, 0.02, 30.0, -30.0, 100.0, -100.0, 1e30, -1e30]]).astype(np.float32)


@njit
def _apply(which, x, out):
    for i in range(x.shape[0]):
        out[i] = nn_kernels.sigmoid(x[i]) if which == 0 else nn_kernels.tanh(x[i])


def test_sigmoid_and_tanh():
    xd = X.astype(np.float64)
    for which, want in ((0, 1 / (1 + np.exp(-np.clip(xd, -700, 700)))), (1, np.tanh(xd))):
        got = np.empty_like(X)
        _apply(which, X, got)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-37)


def test_gelu_kernels_against_float64():
    xd = X.astype(np.float64)
    exact = 0.5 * xd * (1 + np.array([math.erf(v / math.sqrt(2)) for v in xd]))
    tanh_form = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(nn_kernels.gelu(X.reshape(-1, 10)).reshape(-1), exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nn_kernels.gelu_tanh(X), tanh_form, rtol=1e-5, atol=1e-6)
    assert np.isnan(nn_kernels.gelu(np.float32([np.nan]))[0]) and np.isnan(nn_kernels.gelu_tanh(np.float32([np.nan]))[0])


def test_gelu_lowering_matches_the_reference_for_both_forms():
    from ingot.ops import reference
    x = np.random.default_rng(1).standard_normal((3, 5, 37)).astype(np.float32) * 3
    src = Node(Op.PLACEHOLDER, TensorType(x.shape), (), {}, name="x")
    for approximate in ("none", "tanh"):
        node = Node(Op.GELU, TensorType(x.shape), (src,), {"approximate": approximate})
        got = LOWERINGS[Op.GELU](node, None)(x)
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, reference(Op.GELU, [x], node.attrs), rtol=1e-5, atol=1e-6)
