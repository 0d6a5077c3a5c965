"""conv_depthwise's kernel (16 channels a vector, 16 x 16 transposes in and out, the epilogue in
registers) against the NumPy conv reference on awkward shapes: channels not a multiple of 16, rows
narrower or wider than 16 and not a multiple of the tile, one-pixel inputs, strides (row-only too),
asymmetric padding; and through the compiler with per-channel and scalar epilogue operands."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv_depthwise
from ingot.ops.conv import conv
from ingot.ops.layout import block_channels

CASES = [  # C, (H, W), (kh, kw), (row stride, column stride), pads ((top, bottom), (left, right))
    (20, (150, 140), (3, 3), (1, 1), ((1, 1), (1, 1))),   # rows wider than a band (2048 floats)
    (3, (130, 131), (5, 5), (2, 2), ((2, 2), (2, 2))),
    (1, (1, 1), (3, 3), (2, 2), ((1, 1), (1, 1))),
    (13, (9, 7), (3, 3), (2, 2), ((1, 1), (1, 1))),
    (17, (7, 7), (5, 5), (1, 1), ((2, 2), (2, 2))),
    (33, (14, 14), (5, 5), (2, 2), ((2, 2), (2, 2))),
    (5, (20, 37), (3, 3), (1, 1), ((1, 1), (1, 1))),
    (16, (11, 12), (5, 5), (2, 2), ((2, 1), (0, 2))),
    (24, (12, 37), (3, 3), (2, 1), ((1, 1), (1, 1))),   # PP-OCR's row-only stride
    (3, (13, 21), (3, 5), (3, 2), ((1, 2), (4, 0))),
    (40, (3, 50), (7, 7), (1, 1), ((3, 3), (3, 3))),
    (2, (6, 5), (1, 3), (1, 2), ((0, 0), (0, 0))),
    (4, (45, 150), (5, 5), (2, 2), ((2, 2), (2, 2))),   # two bands, the last one reading the bottom padding
    (7, (50, 200), (3, 3), (3, 1), ((0, 2), (1, 1))),
]


@pytest.mark.parametrize("c,hw,k,strides,pads", CASES)
def test_depthwise_matches_reference(c, hw, k, strides, pads):
    rng = np.random.default_rng(c + hw[0] * 7 + k[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((c, 1) + k).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    want = conv(x[None], w, b, strides, (1, 1), pads, c)[0]
    assert conv_depthwise.fits(k[0], k[1], strides, (1, 1), [])
    out = np.full(want.shape, np.nan, np.float32)
    kernel = conv_depthwise.driver(k[0], k[1], strides[1], [], [])
    xp_n, ot_n = conv_depthwise.band_scratch_sizes(k[0], k[1], strides[1], hw, want.shape[1:], strides[0], pads[0][0],
                                                   pads[1][0])
    xp, ot = np.full(xp_n, np.nan, np.float32), np.full(ot_n, np.nan, np.float32)   # the kernel writes the padding
    for _ in range(2):   # the second call reuses the scratch
        kernel(x, *conv_depthwise.arrange_weights(w.reshape(c, -1), b), strides[0], pads[0][0], pads[1][0], out, (), xp, ot, c,
               conv_depthwise.positions(want.shape[2]))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
        out[:] = np.nan


@pytest.mark.parametrize("blocked_in,blocked_out", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("c,hw,k,strides,pads", [CASES[i] for i in (0, 2, 3, 7, 9, 12)] + [
    (40, (1, 1), (3, 3), (1, 1), ((1, 1), (1, 1)))])   # a one-pixel image: the row's tile past three blocks
def test_depthwise_blocked_layouts(c, hw, k, strides, pads, blocked_in, blocked_out):
    """Input and output in the channel-blocked layout (ops/layout.py), the padding lanes stored as zeros."""
    rng = np.random.default_rng(c + hw[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((c, 1) + k).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    want = conv(x[None], w, b, strides, (1, 1), pads, c)
    (oh, ow), blocks = want.shape[2:], -(-c // 16)
    xin = block_channels(x[None])[0].reshape(blocks, hw[0], hw[1] * 16) if blocked_in else x
    out = np.full((blocks, oh, ow * 16) if blocked_out else want.shape[1:], np.nan, np.float32)
    kernel = conv_depthwise.driver(k[0], k[1], strides[1], [], [], blocked_in, blocked_out)
    xp_n, ot_n = conv_depthwise.band_scratch_sizes(k[0], k[1], strides[1], hw, (oh, ow), strides[0], pads[0][0], pads[1][0])
    xp, ot = np.full(xp_n, np.nan, np.float32), np.full(ot_n, np.nan, np.float32)
    kernel(xin, *conv_depthwise.arrange_weights(w.reshape(c, -1), b), strides[0], pads[0][0], pads[1][0], out, (), xp, ot, c,
           conv_depthwise.positions(ow))
    expect = block_channels(want)[0].reshape(out.shape) if blocked_out else want[0]
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_one_kernel_serves_every_tile_width():
    """Widths that pick tiles of 4 to 8 positions run one kernel (a new image width loads none)."""
    kernel = conv_depthwise.driver(3, 3, 1, [], [])
    assert sorted({conv_depthwise.positions(ow) for ow in (4, 5, 6, 7, 9, 15, 16, 19, 26, 33)}) == [4, 5, 6, 7, 8]
    rng = np.random.default_rng(3)
    c = 20
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    for ow in (4, 5, 6, 7, 9, 15, 16, 19, 26, 33):
        x = rng.standard_normal((c, 5, ow)).astype(np.float32)
        want = conv(x[None], w, None, (1, 1), (1, 1), ((1, 1), (1, 1)), c)[0]
        xp_n, ot_n = conv_depthwise.band_scratch_sizes(3, 3, 1, (5, ow), (5, ow), 1, 1, 1)
        out = np.full(want.shape, np.nan, np.float32)
        kernel(x, *conv_depthwise.arrange_weights(w.reshape(c, -1), None), 1, 1, 1, out, (), np.zeros(xp_n, np.float32),
               np.empty(ot_n, np.float32), c, conv_depthwise.positions(ow))
        assert conv_depthwise.driver(3, 3, 1, [], []) is kernel
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_fits_only_what_it_runs():
    assert not conv_depthwise.fits(3, 3, (1, 3), (1, 1), [])       # column stride 3
    assert not conv_depthwise.fits(3, 3, (1, 1), (2, 2), [])       # dilation
    assert not conv_depthwise.fits(9, 9, (1, 1), (1, 1), [])       # wider than 7
    assert not conv_depthwise.fits(3, 3, (1, 1), (1, 1), [("full", 3)])   # a residual operand


@pytest.mark.parametrize("shape,strides", [((2, 19, 9, 8), (2, 2)), ((1, 35, 5, 23), (1, 1))])
def test_epilogue_with_channel_operands_through_the_compiler(shape, strides):
    """A folded batch norm (per-channel scale and shift) and hard-swish, as ONNX exports them."""
    rng = np.random.default_rng(4)
    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (1, c, 1, 1)).astype(np.float32)
    shift = rng.standard_normal((1, c, 1, 1)).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(shape, name="x")
    y = g.conv(xi, w, None, strides=strides, pads=((1, 1), (1, 1)), groups=c) * g.constant(scale) + g.constant(shift)
    z = y * g.minimum(g.maximum(y + 3.0, 0.0), 6.0) * (1 / 6)
    exe = g.compile(targets=[z])
    assert [n.attrs["kind"] for n in exe.program.nodes() if n.op.name == "FUSED"] == ["conv_epilogue"]
    ref = conv(x, w, None, strides, (1, 1), ((1, 1), (1, 1)), c) * scale + shift
    want = ref * np.clip(ref + 3, 0, 6) / 6
    np.testing.assert_allclose(exe.run({"x": x})[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
