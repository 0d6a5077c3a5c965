"""The blocked depthwise and the direct conv kernels (backends/cpu/conv_kernels.py) against the NumPy conv
reference on awkward shapes: channels not a multiple of 16, odd sizes, strides, asymmetric padding,
dilation, 1-D windows; and a depthwise conv through the CPU conv step with an epilogue (bias + ReLU)."""
import numpy as np
import pytest

from ingot.backends.cpu import conv_kernels
from ingot.ops.conv import conv
from ingot.options import CompileOptions, CpuOptions

FLOAT32 = CompileOptions(cpu=CpuOptions(float32_precision="float32"))   # the AVX-512 kernels, not AMX's tiles

CASES = [  # channels, (H, W), (kh, kw), strides, dilations, pads ((top, bottom), (left, right))
    (1, (1, 1), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),
    (13, (9, 7), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),
    (16, (14, 14), (5, 5), (1, 1), (1, 1), ((2, 2), (2, 2))),
    (33, (11, 12), (5, 5), (2, 1), (1, 1), ((2, 1), (0, 2))),
    (20, (10, 9), (3, 3), (1, 2), (2, 2), ((2, 2), (1, 3))),
    (17, (5, 8), (7, 7), (1, 1), (1, 1), ((3, 3), (3, 3))),
    (40, (1, 23), (1, 5), (1, 2), (1, 1), ((0, 0), (2, 2))),
    (18, (6, 6), (3, 3), (1, 1), (1, 1), ((0, 0), (0, 0))),
]


@pytest.mark.parametrize("c,hw,k,strides,dilations,pads", CASES)
def test_depthwise_blocked_matches_reference(c, hw, k, strides, dilations, pads):
    rng = np.random.default_rng(c + hw[0] * 7 + k[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((c,) + k).astype(np.float32)
    want = conv(x[None], w[:, None], None, strides, dilations, pads, c)[0]
    out = np.full(want.shape, np.nan, np.float32)
    (sh, sw), (dh, dw), ((ph, _), (pw, _)) = strides, dilations, pads
    assert conv_kernels.blocked_fits(k[0], k[1], *want.shape[1:])
    conv_kernels.depthwise_blocked(x, w, sh, sw, dh, dw, ph, pw, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_blocked_only_for_small_outputs_and_known_windows():
    assert not conv_kernels.blocked_fits(3, 3, 56, 56) and not conv_kernels.blocked_fits(2, 2, 7, 7)


@pytest.mark.parametrize("strides", [(2, 2), (2, 1)])
def test_depthwise_conv_step_with_epilogue(strides):
    """A depthwise conv + bias + ReLU compiled for the CPU (fusion, the vector kernel) equals the reference;
    strides (2, 1) as PP-OCR's backbone has them."""
    import ingot
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 21, 15, 13)).astype(np.float32)
    w = rng.standard_normal((21, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(21).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y = g.maximum(g.conv(xi, w, b, strides=strides, pads=((1, 1), (0, 1)), groups=21), 0.0)
    exe = g.compile(targets=[y], options=FLOAT32)
    assert any(n.op.name == "FUSED" for n in exe.program.nodes())
    want = np.maximum(conv(x, w, b, strides, (1, 1), ((1, 1), (0, 1)), 21), 0)
    np.testing.assert_allclose(exe.run({"x": x})[0], want, rtol=1e-5, atol=1e-5)


DIRECT = [  # C, M, (H, W), (kh, kw), strides, dilations, pads
    (1, 1, (1, 1), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),
    (3, 16, (9, 7), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),
    (5, 21, (11, 12), (5, 5), (2, 1), (1, 1), ((2, 1), (0, 2))),
    (7, 33, (10, 9), (3, 3), (1, 2), (2, 2), ((2, 2), (1, 3))),
    (4, 17, (8, 13), (7, 7), (1, 1), (1, 1), ((3, 3), (3, 3))),
    (6, 9, (1, 23), (1, 3), (1, 2), (1, 1), ((0, 0), (1, 1))),
    (8, 40, (9, 9), (1, 1), (2, 2), (1, 1), ((0, 0), (0, 0))),
    (2, 5, (6, 6), (3, 1), (1, 1), (1, 1), ((1, 0), (0, 0))),
    (5, 24, (6, 19), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),    # 8 + 8 + 3 columns; blocks of 16 and 8
    (3, 36, (5, 33), (3, 3), (1, 2), (1, 1), ((1, 1), (1, 0))),    # stride 2: 8 + 8 columns; 16 + 16 + 4
    (2, 40, (30, 37), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),   # input > weights: rows first; 8 + 6 + 5 columns
    (3, 20, (4, 10), (3, 3), (1, 1), (2, 1), ((2, 2), (1, 1))),    # 5 + 5 columns, dilated rows
    # edge rows whose window has its first or last row in the padding only (trimmed tiles)
    (20, 17, (7, 16), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),   # stride 2: top and bottom trimmed
    (3, 16, (6, 8), (5, 5), (1, 1), (1, 1), ((2, 2), (2, 2))),     # 5 x 5: two rows out (whole), one (trimmed)
    (4, 16, (5, 8), (3, 3), (1, 1), (2, 1), ((2, 2), (1, 1))),     # dilated rows
    (4, 32, (2, 8), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),     # two rows: one trimmed each side
    (3, 16, (1, 8), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),     # one row: both sides out, not trimmed
    (5, 16, (4, 8), (3, 3), (1, 1), (1, 1), ((0, 2), (1, 1))),     # bottom padding only, two rows of it
    # rows first (input larger than the weights): padded rows in a ring of RING_SLOTS windows' heights, the
    # last rows moved to its top as it fills
    (2, 16, (23, 29), (5, 5), (2, 2), (1, 1), ((2, 1), (2, 2))),   # stride 2 through a ring of 5
    (2, 16, (61, 13), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),   # the ring filled five times
    (3, 16, (50, 11), (3, 3), (4, 1), (1, 1), ((1, 2), (1, 1))),   # a row stride past the window, uneven pads
    (3, 8, (20, 24), (3, 3), (1, 1), (2, 2), ((2, 2), (2, 2))),    # dilated rows: a ring of 5
    (3, 8, (44, 24), (3, 3), (1, 1), (2, 2), ((2, 2), (2, 2))),    # the same taller: past the ring's period (20)
    (4, 16, (17, 9), (3, 1), (3, 1), (1, 1), ((1, 1), (0, 0))),    # a row stride past the window
    # rows first at stride 2 through a ring of the window's rows: edges, odd sizes, no padding
    (3, 40, (24, 26), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),   # the left edge padded; 7 + 6 / 13 columns
    (4, 24, (25, 31), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),   # odd H and W: bottom trimmed, right edge padded
    (5, 17, (21, 20), (3, 3), (2, 2), (1, 1), ((0, 0), (0, 0))),   # no padding: every tile in place
    (2, 16, (22, 9), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),    # one tile of 5 reaching both edges
    (3, 33, (25, 15), (3, 3), (2, 2), (1, 1), ((1, 3), (1, 1))),   # a last window all padding
    (3, 20, (25, 47), (3, 3), (2, 2), (1, 1), ((1, 3), (1, 1))),   # the same with inner tiles: all rows copied
    (2, 16, (23, 61), (5, 5), (2, 2), (1, 1), ((2, 1), (2, 2))),   # two padding rows at the top: all rows copied
    # weights larger than the input, rows not a multiple of 8: tiles of 8 positions running across rows
    (40, 20, (5, 6), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),    # 3 x 3 outputs: a tile over 3 rows, the last overlapping
    (24, 40, (10, 10), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),  # 10 x 10: 16 + 16 + 8 channels
    (16, 18, (7, 6), (5, 5), (1, 1), (1, 1), ((2, 2), (2, 2))),    # 5 x 5 over rows of 6
    # rows as tiles of up to 14 columns, stored 8 at a time (the last 8 under a mask)
    (6, 20, (7, 27), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),    # 14 + 13 columns
    (5, 33, (9, 29), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),    # stride 2: 8 + 7 columns
    (4, 18, (6, 16), (5, 5), (1, 1), (1, 2), ((2, 2), (4, 4))),    # dilated columns: 2 x 8
    (12, 40, (3, 11), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),   # weights the larger: rows of 11, one tile
]


@pytest.mark.parametrize("c,m,hw,k,strides,dilations,pads", DIRECT)
def test_direct_conv_matches_reference(c, m, hw, k, strides, dilations, pads):
    rng = np.random.default_rng(c * 31 + m + hw[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    guarded = np.full(x.size + 2 * 4096, np.nan, np.float32)   # NaN before and after x: a read outside it shows
    guarded[4096:-4096] = x.reshape(-1)
    x = guarded[4096:-4096].reshape(x.shape)
    w = rng.standard_normal((m, c) + k).astype(np.float32)
    want = conv(x[None], w, None, strides, dilations, pads, 1)[0]
    out = np.full(want.shape, np.nan, np.float32)
    (sh, sw), (dh, dw), ((ph, _), (pw, _)) = strides, dilations, pads
    assert conv_kernels.direct_fits(k[0], k[1], 1) and not conv_kernels.direct_fits(k[0], k[1], 2)
    conv_kernels.conv_direct(x, conv_kernels.direct_weights(w), k[0], k[1], sh, sw, dh, dw, ph, pw, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_silu_epilogue_matches_float64():
    """The vector SiLU (a polynomial exp) on rows not a multiple of 16, large magnitudes and NaN."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 37)) * 8).astype(np.float32)
    x[0, :6] = [np.nan, 100.0, -100.0, 0.0, 88.5, -30.0]
    bias = rng.standard_normal(5).astype(np.float32)
    bias[0] = 0
    got = x.copy()
    conv_kernels.silu_epilogue(got, bias, True)
    v = x.astype(np.float64) + bias[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        want = v / (1 + np.exp(-v))
    assert np.isnan(got[0, 0])
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=3e-6, atol=1e-30)
    plain = x.copy()
    conv_kernels.silu_epilogue(plain, bias, False)
    np.testing.assert_allclose(plain[1:], (x / (1 + np.exp(-x.astype(np.float64))))[1:], rtol=3e-6, atol=1e-30)


def test_direct_conv_of_a_column():
    """A kh x 1 window over an input one wide runs as the row it is in memory (Magika's 5 x 1 layer)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 45, 1)).astype(np.float32)
    w = rng.standard_normal((19, 6, 5, 1)).astype(np.float32)
    want = conv(x[None], w, None, (2, 1), (1, 1), ((2, 1), (0, 0)), 1)[0]
    assert conv_kernels.direct_fits(5, 1, 1, want.shape[2], 1) and not conv_kernels.direct_fits(5, 1, 1, 3, 3)
    out = np.full(want.shape, np.nan, np.float32)
    conv_kernels.conv_direct(x, conv_kernels.direct_weights(w), 5, 1, 2, 1, 1, 1, 2, 0, out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("m,ow", [(24, 20), (8, 7), (40, 13), (17, 14), (9, 31)])
def test_direct_conv_narrow_tiles_and_half_blocks(m, ow):
    """A row's last columns fewer than 8 (narrow tiles) and a last block of at most 8 output channels
    (8-lane vectors), with a bias and an epilogue (leaky ReLU + residual) applied in the kernel."""
    import ingot
    from ingot.backends.cpu import conv_spatial
    rng = np.random.default_rng(m + ow)
    x = rng.standard_normal((1, 5, 9, ow)).astype(np.float32)
    w = rng.standard_normal((m, 5, 3, 3)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    ref = conv(x, w, b, (1, 1), (1, 1), ((1, 1), (1, 1)), 1)
    r = rng.standard_normal(ref.shape).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.conv(xi, w, b, pads=((1, 1), (1, 1)))
    exe = g.compile(targets=[g.add(g.where(g.less(y, 0.0), g.mul(y, 0.1), y), ri)], options=FLOAT32)
    want = np.where(ref < 0, ref * 0.1, ref) + r
    assert conv_kernels.direct_fits(3, 3, 1) and conv_spatial.supported(*_steps_of(exe))
    np.testing.assert_allclose(exe.run({"x": x, "r": r})[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _steps_of(exe):
    """(steps, operands) of the executable's one fused conv epilogue, as conv.Epilogue reads them."""
    from ingot.backends.cpu.conv import Epilogue
    from ingot.ir import Op
    (fused,) = [n for n in exe.program.nodes() if n.op == Op.FUSED]
    body = fused.attrs["body"]
    epilogue = Epilogue(body, body.find(Op.CONV)[0])
    return epilogue.steps, epilogue.operands


@pytest.mark.parametrize("m,hw,stride,residual,batch", [(21, (7, 19), 1, False, 1), (9, (6, 35), 2, False, 1),
                                                         (40, (5, 17), 1, True, 1), (18, (4, 13), 1, True, 3)])
def test_direct_conv_step_with_channel_epilogue(m, hw, stride, residual, batch, monkeypatch):
    """A conv + batch norm (scale, shift per channel) + hard-swish (+ a residual) compiled for the CPU runs
    the direct kernel from its own step (conv._direct_step), the epilogue in its tiles' registers (a
    residual: after each row), and equals the reference; channels not a multiple of 16, rows of 8 + 8 + a
    few columns, images of a batch one at a time."""
    import ingot
    from ingot.backends.cpu import conv as cpu_conv
    steps = []
    real = cpu_conv._direct_step
    monkeypatch.setattr(cpu_conv, "_direct_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    rng = np.random.default_rng(m + hw[1])
    c = 20   # C * 9 > conv_spatial.SMALL_REDUCTION: the direct kernel, not the position-vectorised one
    x = rng.standard_normal((batch, c) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 3, 3)).astype(np.float32) * 0.2
    b, scale, shift = (rng.standard_normal(m).astype(np.float32) for _ in range(3))
    y_ref = conv(x, w, b, (stride, stride), (1, 1), ((1, 1), (1, 1)), 1)
    r = rng.standard_normal(y_ref.shape).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.conv(xi, w, b, strides=(stride, stride), pads=((1, 1), (1, 1)))
    y = g.add(g.mul(y, scale.reshape(m, 1, 1)), shift.reshape(m, 1, 1))
    y = g.mul(y, g.div(g.minimum(g.maximum(g.add(y, 3.0), 0.0), 6.0), 6.0))
    if residual:
        y = g.add(y, ri)
    exe = g.compile(targets=[y], options=FLOAT32)
    assert [n.attrs.get("kind") for n in exe.program.nodes() if n.op.name == "FUSED"] == ["conv_epilogue"]
    t = y_ref * scale.reshape(m, 1, 1) + shift.reshape(m, 1, 1)
    want = t * np.clip(t + 3, 0, 6) / 6 + (r if residual else 0)
    got = exe.run({"x": x, "r": r} if residual else {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert steps == [1]


@pytest.mark.parametrize("m,hw,pads,batch,residual", [
    (24, (15, 21), ((1, 0), (0, 1)), 2, False),   # blocks 16 + 8 as one 2-block tile; odd sizes, asymmetric padding
    (50, (17, 33), ((1, 1), (1, 1)), 1, True),    # 16 + 16, then 16 + 2 as 2-block tiles; rows of 8 + 8 + 1
    (36, (9, 40), ((0, 1), (1, 0)), 3, False),    # 16 + 16 as one tile, 4 channels in a half tile; batch 3
])
def test_direct_conv_two_block_tiles_stride_two(m, hw, pads, batch, residual):
    """Stride-2 3 x 3 convs over more than 16 output channels run tiles of two 16-channel blocks (conv_kernels
    WIDEST_PAIR); with a per-channel scale and SiLU in the tiles (a residual: after each row) they equal the
    reference on odd sizes, asymmetric padding, channels not a multiple of 16 and batches."""
    import ingot
    rng = np.random.default_rng(m + hw[1] + batch)
    c = 19   # C * 9 > conv_spatial.SMALL_REDUCTION: the direct kernel
    x = rng.standard_normal((batch, c) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 3, 3)).astype(np.float32) * 0.2
    b, scale = (rng.standard_normal(m).astype(np.float32) for _ in range(2))
    y_ref = conv(x, w, b, (2, 2), (1, 1), pads, 1)
    r = rng.standard_normal(y_ref.shape).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.mul(g.conv(xi, w, b, strides=(2, 2), pads=pads), scale.reshape(m, 1, 1))
    y = g.mul(y, g.sigmoid(y))
    if residual:
        y = g.add(y, ri)
    exe = g.compile(targets=[y], options=FLOAT32)
    t = (y_ref * scale.reshape(m, 1, 1)).astype(np.float64)
    want = t / (1 + np.exp(-t)) + (r if residual else 0)
    got = exe.run({"x": x, "r": r} if residual else {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_direct_conv_step_one_d(monkeypatch):
    """A 1-D conv (batch 2, dilation 2, stride 2, uneven padding) + ReLU through conv._direct_step."""
    import ingot
    from ingot.backends.cpu import conv as cpu_conv
    steps = []
    real = cpu_conv._direct_step
    monkeypatch.setattr(cpu_conv, "_direct_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 24, 301)).astype(np.float32)
    w = rng.standard_normal((19, 24, 3)).astype(np.float32)
    b = rng.standard_normal(19).astype(np.float32)
    g = ingot.Graph()
    y = g.conv(g.placeholder(x.shape, name="x"), w, b, strides=(2,), dilations=(2,), pads=((2, 1),))
    exe = g.compile(targets=[g.maximum(y, 0.0)], options=FLOAT32)
    want = np.maximum(conv(x[:, :, None], w[:, :, None], b, (1, 2), (1, 2), ((0, 0), (2, 1)), 1)[:, :, 0], 0)
    np.testing.assert_allclose(exe.run({"x": x})[0], want, rtol=1e-5, atol=1e-4)
    assert steps == [1]


@pytest.mark.parametrize("k,m", [(3, 21), (1, 19)])
def test_silu_epilogue_in_registers_extremes(k, m):
    """Conv + x * sigmoid(x) compiled for the CPU (direct kxk kernel, or the pointwise one): the SiLU emitted
    whole (conv_spatial._silu) equals float64's on outputs from -300 to 300, a NaN propagating, and lanes
    past the channels and columns."""
    import ingot
    rng = np.random.default_rng(k + m)
    x = (rng.standard_normal((1, 20, 9, 21)) * 12).astype(np.float32)
    x[0, 3, 4, 10] = np.nan
    w = rng.standard_normal((m, 20, k, k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y = g.conv(xi, w, b, pads=((k // 2,) * 2, (k // 2,) * 2))
    got = g.compile(targets=[g.mul(y, g.sigmoid(y))], options=FLOAT32).run({"x": x})[0]
    v = conv(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), (1, 1), (1, 1),
             ((k // 2,) * 2, (k // 2,) * 2), 1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v / (1 + np.exp(-v))
    assert np.abs(v[np.isfinite(v)]).max() > 100 and np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=3e-5, atol=1e-4)


@pytest.mark.parametrize("c,m,hw,strides", [
    (16, 32, (21, 17), (2, 2)),     # odd sizes: the last row and column taken
    (5, 40, (9, 13), (2, 3)),       # channels not a multiple of 16, unequal strides
    (7, 3, (6, 8), (3, 1)),         # few outputs: the positions kernel
    (12, 20, (1, 37), (1, 2)),      # one row
])
def test_strided_pointwise_conv_with_epilogue(c, m, hw, strides):
    """A 1 x 1 convolution with stride > 1 (a ResNet shortcut) runs as a pointwise one on the strided
    positions, with its bias, ReLU and a residual of the output's shape applied in the kernel."""
    import ingot
    from ingot.backends.cpu import conv as cpu_conv
    rng = np.random.default_rng(c * 7 + m)
    x = rng.standard_normal((1, c) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    ref = conv(x, w, b, strides, (1, 1), ((0, 0), (0, 0)), 1)
    r = rng.standard_normal(ref.shape).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.conv(xi, w, b, strides=strides)
    exe = g.compile(targets=[g.maximum(g.add(y, ri), 0.0)], options=FLOAT32)
    assert cpu_conv._strided_pointwise(1, 1, strides, ((0, 0), (0, 0)), 1)
    want = np.maximum(ref + r, 0)
    np.testing.assert_allclose(exe.run({"x": x, "r": r})[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    one_d = g.conv(g.placeholder((1, c, hw[1]), name="x1"), w[:, :, 0], b, strides=strides[1:])
    got = g.compile(targets=[one_d], options=FLOAT32).run({"x1": x[:, :, 0]})[0]
    np.testing.assert_allclose(got, conv(x[:, :, :1], w, b, (1, strides[1]), (1, 1), ((0, 0), (0, 0)), 1)[:, :, 0],
                               rtol=1e-5, atol=1e-4)


def test_arranged_once_is_made_once_per_array_and_dropped_with_it():
    import gc
    import weakref

    from ingot.backends.cpu import conv as cpu_conv, conv_pointwise
    w = np.arange(2 * 20, dtype=np.float32).reshape(20, 2, 1, 1)
    first = cpu_conv.arranged_once(conv_pointwise.arrange_weights, w, None)
    assert cpu_conv.arranged_once(conv_pointwise.arrange_weights, w, None) is first
    other = w.copy()   # equal values, another array: arranged on its own
    assert cpu_conv.arranged_once(conv_pointwise.arrange_weights, other, None) is not first
    np.testing.assert_array_equal(first[0], conv_pointwise.arrange_weights(w, None)[0])
    arranged = weakref.ref(first[0])
    del first
    gc.collect()
    assert arranged() is not None   # held while w lives
    del w, other
    gc.collect()
    assert arranged() is None       # dropped with it
