"""conv_pointwise's kernel (16 output channels a vector, pairs of them x 8/4 positions, one x 16/8/4/2/1,
transposed in registers, the epilogue per channel row) against the NumPy conv reference on awkward shapes, and through
the compiler with a residual (a full operand) and per-channel operands."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv_pointwise
from ingot.ops.conv import conv
from ingot.ops.layout import block_channels

from test_cpu_conv_spatial import check_pointwise

CASES = [(1, 1, (1, 1)), (5, 7, (3, 5)), (16, 32, (7, 7)), (33, 17, (1, 31)), (96, 48, (7, 7)), (3, 130, (2, 3)),
         (8, 16, (14, 14)),
         (37, 70, (1, 1)), (3, 100, (1, 1)), (130, 1280, (1, 1)),   # one position: blocks side by side
         (24, 80, (7, 7)), (20, 40, (1, 7)), (9, 64, (1, 2)), (576, 96, (7, 7)),   # C, M, (H, W); tails of 1-3
                                                                                    # positions, groups of blocks
         (40, 50, (5, 9)), (19, 33, (3, 4))]   # pairs of blocks x 8, 4 positions: the last block 2 lanes, a tail of
                                               # 1 for 4 blocks; no tail, a block left over alone (1 lane)


@pytest.mark.parametrize("c,m,hw", CASES)
def test_pointwise_matches_reference(c, m, hw):
    check_pointwise(c, m, hw, conv_pointwise.arrange_weights,
                    lambda x, wk, bk, out: conv_pointwise.driver([], [])(x, wk, bk, out, ()))


@pytest.mark.parametrize("blocked_in,blocked_out", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("c,m,hw", [CASES[i] for i in (0, 1, 3, 5, 7, 9, 10, 11, 12, 13)])
def test_pointwise_blocked_layouts(c, m, hw, blocked_in, blocked_out):
    """Input and output in the channel-blocked layout (ops/layout.py), the padding lanes stored as zeros."""
    rng = np.random.default_rng(c * 7 + m)
    x = rng.standard_normal((1, c) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    want = conv(x, w, b, (1, 1), (1, 1), ((0, 0), (0, 0)), 1)
    p = hw[0] * hw[1]
    xin = block_channels(x)[0].reshape(-1, p * 16) if blocked_in else x[0].reshape(c, p)
    out = np.full((-(-m // 16), p * 16) if blocked_out else (m, p), np.nan, np.float32)
    wk, bk = conv_pointwise.arrange_weights(w, b)
    kernel = conv_pointwise.driver([], [], blocked_in, blocked_out)
    kernel(xin, wk, bk, out, (), m) if blocked_out else kernel(xin, wk, bk, out, ())
    expect = block_channels(want)[0].reshape(out.shape) if blocked_out else want[0].reshape(m, p)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_chosen_where_positions_waste_more():
    assert conv_pointwise.better_than_positions(576, 49) and conv_pointwise.better_than_positions(96, 49)
    assert not conv_pointwise.better_than_positions(72, 56 * 56) and not conv_pointwise.better_than_positions(24, 784)


@pytest.mark.parametrize("n,c,m,hw", [(2, 24, 48, (7, 7)), (1, 40, 32, (3, 3)), (1, 20, 64, (1, 1)),
                                         (2, 9, 83, (1, 1))])
def test_residual_and_channel_operands_through_the_compiler(n, c, m, hw):
    """A folded batch norm, hard-swish and a residual add after the conv, as ONNX exports them."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c) + hw).astype(np.float32)
    r = rng.standard_normal((n, m) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (1, m, 1, 1)).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.conv(xi, w) * g.constant(scale) + 0.5
    z = y * g.minimum(g.maximum(y + 3.0, 0.0), 6.0) * (1 / 6) + ri
    exe = g.compile(targets=[z])
    assert [n.attrs["kind"] for n in exe.program.nodes() if n.op.name == "FUSED"] == ["conv_epilogue"]
    ref = conv(x, w, None, (1, 1), (1, 1), ((0, 0), (0, 0)), 1) * scale + 0.5
    want = ref * np.clip(ref + 3, 0, 6) / 6 + r
    np.testing.assert_allclose(exe.run({"x": x, "r": r})[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
