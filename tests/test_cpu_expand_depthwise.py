"""fuse_expand_depthwise + backends/cpu/expand_depthwise.py: a pointwise conv read only by a depthwise one
runs as one kernel (the pointwise output computed into the depthwise kernel's padded channel blocks),
against NumPy on awkward shapes: channels not a multiple of 16, rows not a multiple of the tiles, strides,
a one-pixel image, batch 2, epilogues with per-channel and scalar operands on both convs."""
import numpy as np
import pytest

import ingot
from ingot.ops.conv import conv
from fusion_helpers import kinds


def hard_swish(g, y):
    return y * g.minimum(g.maximum(y + 3.0, 0.0), 6.0) * (1 / 6)


def np_hard_swish(y):
    return y * np.clip(y + 3, 0, 6) / 6


def graph(shape, m, k, strides, pads, extra_reader=False, bias=True):
    rng = np.random.default_rng(sum(shape) + m)
    n, c = shape[:2]
    wa = rng.standard_normal((m, c, 1, 1)).astype(np.float32) * 0.5
    ba = rng.standard_normal(m).astype(np.float32) if bias else None
    scale = rng.uniform(0.5, 1.5, (1, m, 1, 1)).astype(np.float32)
    wb = rng.standard_normal((m, 1) + k).astype(np.float32) * 0.5
    bb = rng.standard_normal(m).astype(np.float32)
    g = ingot.Graph()
    x = g.placeholder(shape, name="x")
    a = hard_swish(g, g.conv(x, wa, ba) * g.constant(scale))
    b = g.maximum(g.conv(a, wb, bb, strides=strides, pads=pads, groups=m), 0.0)
    exe = g.compile(targets=[b, g.exp(a)] if extra_reader else [b])

    def reference(xv):
        av = np_hard_swish(conv(xv, wa, ba, (1, 1), (1, 1), ((0, 0), (0, 0)), 1) * scale)
        return np.maximum(conv(av, wb, bb, strides, (1, 1), pads, m), 0.0)
    return exe, reference


@pytest.mark.parametrize("shape,m,k,strides,pads", [
    ((1, 16, 56, 56), 72, (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((2, 5, 9, 37), 20, (3, 3), (1, 1), ((1, 1), (1, 1))),      # rows of 37: tiles of 16, 16, 4, 1
    ((1, 7, 13, 11), 33, (5, 5), (2, 2), ((2, 2), (2, 2))),
    ((1, 3, 12, 23), 17, (3, 3), (2, 1), ((1, 1), (1, 1))),     # PP-OCR's row-only stride
    ((1, 24, 1, 1), 40, (3, 3), (1, 1), ((1, 1), (1, 1))),      # a one-pixel image
    ((1, 9, 7, 7), 16, (5, 5), (1, 1), ((2, 2), (2, 2))),
    # rows wider than a band's 2048 floats / 16: several bands, the rows two share kept, skipped (1 x 3 at
    # row stride 2) or reaching into the bottom padding
    ((1, 6, 30, 150), 20, (3, 3), (1, 1), ((1, 1), (1, 1))),
    ((1, 5, 40, 210), 18, (5, 5), (2, 2), ((2, 2), (2, 2))),
    ((1, 4, 30, 300), 16, (1, 3), (2, 1), ((0, 0), (1, 1))),
    # two blocks of 16 channels a pass (expand_depthwise.GROUP): 3 blocks (a pair, then one alone), 196
    # positions (24 tiles of 8, then 4); 4 blocks, the last 2 lanes real, 30 positions (8, 8, 8, 4, 2)
    ((1, 40, 14, 14), 48, (5, 5), (1, 1), ((2, 2), (2, 2))),
    ((1, 19, 6, 5), 50, (3, 3), (2, 2), ((1, 1), (1, 1))),
])
def test_one_kernel_matches_numpy(shape, m, k, strides, pads):
    exe, reference = graph(shape, m, k, strides, pads, bias=m % 2 == 0)
    assert kinds(exe.program) == {"expand_depthwise": 1}
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    want = reference(x)
    for _ in range(2):   # the second run reuses the arranged weights and the scratch
        np.testing.assert_allclose(exe.run({"x": x})[0], want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_pointwise_read_elsewhere_stays_apart():
    exe, reference = graph((1, 4, 6, 6), 8, (3, 3), (1, 1), ((1, 1), (1, 1)), extra_reader=True)
    assert "expand_depthwise" not in kinds(exe.program)
    x = np.random.default_rng(2).standard_normal((1, 4, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
