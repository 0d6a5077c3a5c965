"""The CPU lowering of pad (backends/cpu: a filled array or precomputed indices per axis) against the
op's NumPy reference (np.pad), every mode, on awkward shapes and pads."""
import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.backends.cpu import LOWERINGS
from ingot.ir import Node, Op, TensorType
from ingot.ops import infer_type, reference


@pytest.mark.parametrize("mode", ["constant", "reflect", "symmetric", "edge"])
@pytest.mark.parametrize("shape,pads", [((1, 512), ((0, 0), (32, 32))), ((3, 5, 7), ((1, 2), (0, 0), (3, 1))),
                                        ((2, 1, 4), ((0, 0), (0, 0), (0, 0))), ((6,), ((5, 0),))])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_pad_lowering_equals_reference(mode, shape, pads, dtype):
    if mode == "reflect" and any((lo or hi) and (lo >= d or hi >= d) for d, (lo, hi) in zip(shape, pads)):
        pytest.skip("reflect pads must be shorter than the axis")
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 10).astype(dtype)
    attrs = {"pads": pads, "mode": mode} | ({"value": 2.5 if dtype == np.float32 else 7} if mode == "constant" else {})
    src = Node(Op.PLACEHOLDER, TensorType(shape, dt.from_numpy(x.dtype)), name="x")
    node = Node(Op.PAD, infer_type(Op.PAD, [src.type], attrs), (src,), attrs)
    got = LOWERINGS[Op.PAD](node, None)(x)
    want = reference(Op.PAD, [x], attrs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    assert not np.shares_memory(got, x)
