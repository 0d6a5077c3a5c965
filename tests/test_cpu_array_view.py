"""The CPU lowering of array_view (the ndarray constructor over x's storage) against the reference
(as_strided): windows, overlapping frames, negative strides, an offset, a read-only constant input,
a non-contiguous input (copied first); the view never writable, never a copy of a contiguous input."""
import numpy as np
import pytest

from ingot.backends.cpu import LOWERINGS
from ingot.ir import Node, Op, TensorType
from ingot.ops import infer_type, reference


@pytest.mark.parametrize("shape,strides,offset", [((1, 3, 4, 2, 2, 2), (120, 40, 10, 2, 5, 1), 0),   # 2x2 windows
                                                   ((7, 8), (3, 1), 2),                                # STFT frames
                                                   ((5,), (-2,), 9), ((2, 3), (0, 4), 1)])
@pytest.mark.parametrize("source", ["contiguous", "read_only", "transposed"])
def test_array_view_lowering_equals_reference(shape, strides, offset, source):
    base = np.arange(120, dtype=np.float32).reshape(1, 3, 8, 5)
    x = {"contiguous": base, "read_only": base.copy(), "transposed": base.transpose(0, 1, 3, 2)}[source]
    if source == "read_only":
        x.flags.writeable = False
    attrs = {"shape": shape, "strides": strides, "offset": offset}
    src = Node(Op.PLACEHOLDER, TensorType(x.shape), name="x")
    node = Node(Op.ARRAY_VIEW, infer_type(Op.ARRAY_VIEW, [src.type], attrs), (src,), attrs)
    got, want = LOWERINGS[Op.ARRAY_VIEW](node, None)(x), reference(Op.ARRAY_VIEW, [x], attrs)
    assert got.shape == want.shape and got.dtype == want.dtype and not got.flags.writeable
    np.testing.assert_array_equal(got, want)
    assert np.shares_memory(got, x) == (source != "transposed")
