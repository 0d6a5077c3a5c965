"""conv_spatial's kernels (pointwise, depthwise, kxk stride 1; the epilogue as vector IR) against the NumPy
conv reference on awkward shapes: channels not a multiple of 4 or 16, positions not a multiple of 16,
one-pixel outputs, strides, padding, dilation; and through the compiler with each epilogue op kind."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv_spatial
from ingot.ops.conv import conv

POINTWISE = [(1, 1, (1, 1)), (5, 7, (3, 5)), (16, 32, (9, 13)), (33, 6, (8, 8)), (3, 130, (1, 67))]   # C, M, (H, W)


def check_pointwise(c, m, hw, arrange, run):
    """A 1x1 conv kernel (arrange(w, b) -> its weights and bias; run(x, wk, bk, out) on [C, P] / [M, P])
    against the NumPy reference; out starts as NaN, so a position it misses fails."""
    rng = np.random.default_rng(c * 7 + m)
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((m, c, 1, 1)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    want = conv(x[None], w, b, (1, 1), (1, 1), ((0, 0), (0, 0)), 1)[0]
    wk, bk = arrange(w, b)
    out = np.full(want.shape, np.nan, np.float32)
    run(x.reshape(c, -1), wk, bk, out.reshape(m, -1))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("c,m,hw", POINTWISE)
def test_pointwise_matches_reference(c, m, hw):
    check_pointwise(c, m, hw, conv_spatial.arrange_weights,
                    lambda x, wk, bk, out: conv_spatial.driver(1, 1, [], [])(x, wk, bk, out, ()))


DEPTHWISE = [  # C, (H, W), (kh, kw), stride, dilation, pads ((top, bottom), (left, right)); few windows:
    (1, (1, 1), (3, 3), 2, 1, ((1, 1), (1, 1))),             # each window and stride compiles a kernel
    (13, (9, 7), (3, 3), 2, 1, ((1, 1), (1, 1))),
    (5, (20, 37), (3, 3), 1, 1, ((1, 1), (1, 1))),
    (7, (11, 12), (5, 5), 2, 1, ((2, 1), (0, 2))),
    (4, (10, 9), (3, 3), 1, 2, ((2, 2), (1, 3))),
    (6, (40, 90), (3, 3), 2, 1, ((0, 1), (0, 1))),
    (24, (12, 37), (3, 3), (2, 1), 1, ((1, 1), (1, 1))),      # PP-OCR's row-only stride
    (9, (7, 33), (5, 5), (2, 1), 1, ((2, 2), (2, 2))),
    (3, (13, 21), (3, 5), (3, 2), 2, ((1, 2), (4, 0))),
]


@pytest.mark.parametrize("c,hw,k,stride,dilation,pads", DEPTHWISE)
def test_depthwise_matches_reference(c, hw, k, stride, dilation, pads):
    rng = np.random.default_rng(c + hw[0] * 7 + k[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((c, 1) + k).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    strides = stride if isinstance(stride, tuple) else (stride, stride)
    want = conv(x[None], w, b, strides, (dilation, dilation), pads, c)[0]
    assert conv_spatial.depthwise_fits(k[0], k[1], strides)
    out = np.full(want.shape, np.nan, np.float32)
    kernel = conv_spatial.driver(k[0], k[1], [], [], depthwise_stride=strides[1])
    kernel(x, w.reshape(c, -1), b, strides[0], dilation, dilation, pads[0][0], pads[1][0], out, ())
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def _epilogues(g, y, r):
    """Each epilogue form the fusion pass makes, on conv output y (r: a tensor of y's shape)."""
    six = g.constant(np.float32(6.0))
    return {
        "silu+residual": g.add(g.mul(y, g.sigmoid(y)), r),
        "hardswish": g.div(g.mul(y, g.minimum(g.maximum(g.add(y, 3.0), 0.0), six)), six),
        "leaky": g.where(g.less(y, 0.0), g.mul(y, 0.1), y),
        "tanh,exp": g.add(g.tanh(y), g.exp(g.minimum(y, 1.0))),
        "silu op": g.silu(y),
    }


@pytest.mark.parametrize("kind,form", [("pointwise", f) for f in ("silu+residual", "hardswish", "leaky", "tanh,exp", "silu op")]
                         + [("depthwise", "hardswish")])
def test_fused_epilogue_through_the_compiler(kind, form):
    rng = np.random.default_rng(3)
    c, m = (6, 11) if kind == "pointwise" else (9, 9)
    x = rng.standard_normal((2, c, 7, 9)).astype(np.float32)
    w = rng.standard_normal((m, 1 if kind == "depthwise" else c, *((1, 1) if kind == "pointwise" else (3, 3)))).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    strides, pads, groups = ((1, 1), ((0, 0), (0, 0)), 1) if kind == "pointwise" else ((2, 2), ((1, 1), (1, 0)), m)
    ref = conv(x, w, b, strides, (1, 1), pads, groups)
    r = rng.standard_normal(ref.shape).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = _epilogues(g, g.conv(xi, w, b, strides=strides, pads=pads, groups=groups), ri)[form]
    exe = g.compile(targets=[y])
    fused = [n for n in exe.program.nodes() if n.op.name == "FUSED"]
    assert len(fused) == 1 and fused[0].attrs["kind"] == "conv_epilogue"
    want = {"silu+residual": ref / (1 + np.exp(-ref)) + r, "hardswish": ref * np.clip(ref + 3, 0, 6) / 6,
            "leaky": np.where(ref < 0, ref * 0.1, ref), "tanh,exp": np.tanh(ref) + np.exp(np.minimum(ref, 1)),
            "silu op": ref / (1 + np.exp(-ref))}[form]
    feeds = {"x": x, "r": r} if form == "silu+residual" else {"x": x}
    np.testing.assert_allclose(exe.run(feeds)[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_silu_in_registers_has_no_subnormals():
    """The vector SiLU (conv_spatial._silu) makes no subnormal value, as output or on the way (each costs a
    microcode assist on Intel cores): x < -80 gives -80 / (1 + e^80) = -1.44e-33 (silu(-80) itself; the
    true value is closer to -0), large x gives x."""
    x = np.array([-1e30, -300.0, -100.0, -88.5, -87.5, -86.0, -85.0, -80.5, -79.5, -70.0, -30.0, 79.5, 85.0, 87.5,
                  88.5, 100.0, 1e30], np.float32).reshape(1, 17, 1, 1)
    g = ingot.Graph()
    xi = g.placeholder((1, 17, 1, 1), name="x")
    y = g.conv(xi, np.ones((17, 1, 1, 1), np.float32), None, groups=17)   # depthwise, weights 1: x itself
    exe = g.compile(targets=[g.mul(y, g.sigmoid(y))])
    got = exe.run({"x": x})[0].ravel()
    v = x.astype(np.float64).ravel()
    with np.errstate(over="ignore"):
        want = v / (1 + np.exp(-v))
    assert not np.any((got != 0) & (np.abs(got) < np.finfo(np.float32).tiny))
    assert np.all(got[v < -80] < 0) and np.all(got[v < -80] >= -1.5e-33)
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1.5e-33)


def test_epilogue_keeps_nan_and_extremes():
    """sigmoid / exp / maximum / minimum in the vector epilogue: NaN propagates, +-100 saturate."""
    x = np.array([np.nan, 100.0, -100.0, 0.0, 88.5, -30.0, 2.0, -2.0, 5e-3, -5e-3, 1.0, 3.0, 7.0, -7.0, 0.5, 9.0, -1.0],
                 np.float32).reshape(1, 17, 1, 1)
    g = ingot.Graph()
    xi = g.placeholder((1, 17, 1, 1), name="x")
    y = g.conv(xi, np.ones((17, 1, 1, 1), np.float32), None, groups=17)   # depthwise, weights 1: x itself
    out = g.maximum(g.add(g.mul(y, g.sigmoid(y)), g.exp(g.minimum(y, 0.0))), -1.0)
    exe = g.compile(targets=[out])
    v = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.maximum(v / (1 + np.exp(-v)) + np.exp(np.minimum(v, 0)), -1)
    got = exe.run({"x": x})[0]
    assert any(n.op.name == "FUSED" for n in exe.program.nodes()) and np.isnan(got.ravel()[0])
    np.testing.assert_allclose(got.ravel()[1:], want.ravel()[1:], rtol=3e-6, atol=1e-30)



@pytest.mark.parametrize("scalar", [0.0, -0.0, np.nan, np.inf])
@pytest.mark.parametrize("first", ["maximum", "minimum"])
def test_epilogue_maximum_minimum_as_numpy(first, scalar):
    """maximum / minimum in the vector epilogue (the stores of conv_spatial's tiles: a 1 -> 5 channel 3 x 3
    conv whose weights copy the input) equal NumPy's on the conv's own output bit for bit: a NaN on either
    side propagates, and of two equal values (+0 and -0) the second is kept; a tensor operand, then a scalar."""
    rng = np.random.default_rng(7)
    specials = np.array([np.nan, 0.0, -0.0, np.inf, -np.inf, 1.5, -1.5, 3e-39], np.float32)
    x = rng.choice(specials[1:3].tolist() + [1.5, -1.5, 2.0], (1, 1, 3, 70)).astype(np.float32)  # finite: 0 * x = 0
    r = rng.choice(specials, (1, 5, 3, 70)).astype(np.float32)
    w = np.zeros((5, 1, 3, 3), np.float32)
    w[:, 0, 1, 1] = 1.0
    fns = (np.maximum, np.minimum) if first == "maximum" else (np.minimum, np.maximum)
    outs = []
    for epilogue in (False, True):
        g = ingot.Graph()
        xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
        y = g.conv(xi, w, None, pads=((1, 1), (1, 1)))
        if epilogue:
            y = getattr(g, fns[1].__name__)(getattr(g, fns[0].__name__)(y, ri), np.float32(scalar))
        exe = g.compile(targets=[y])
        assert any(n.op.name == "FUSED" for n in exe.program.nodes()) == epilogue
        outs.append(exe.run({"x": x, "r": r} if epilogue else {"x": x})[0])
    plain, got = outs
    with np.errstate(invalid="ignore"):
        want = fns[1](fns[0](plain, r), np.float32(scalar))
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

ROWS_WINDOW = [  # C, M, (H, W), (kh, kw), stride, dilation, pads
    (3, 16, (17, 70), (3, 3), 2, 1, ((1, 1), (1, 1))),
    (1, 5, (1, 1), (3, 3), 2, 1, ((1, 1), (1, 1))),   # narrower than 16: conv_direct in the compiler
    (5, 7, (9, 11), (3, 3), 1, 2, ((2, 1), (2, 0))),
    (4, 9, (12, 13), (5, 5), 2, 1, ((2, 2), (1, 2))),
    (16, 6, (6, 67), (3, 3), 1, 1, ((1, 1), (1, 1))),
    # stride 1 runs each tile of ROWS channels over every row: channels not a multiple of ROWS over many rows,
    # many input channels on wide rows (to at most 8 outputs), and a first layer's 1 -> 32
    (8, 7, (40, 70), (3, 3), 1, 1, ((1, 1), (1, 1))),
    (32, 5, (7, 520), (3, 3), 1, 1, ((1, 1), (1, 1))),
    (1, 32, (32, 100), (3, 3), 1, 1, ((1, 1), (1, 1))),
    # stride 2 runs on even / odd column phases, a band of rows at a time: odd and even widths, no left
    # pad, even windows, rows longer than a tile, many bands, and a dilated window (the strided kernel)
    (3, 16, (150, 41), (3, 3), 2, 1, ((1, 1), (1, 1))),
    (2, 6, (9, 161), (4, 4), 2, 1, ((0, 2), (0, 1))),
    (2, 5, (23, 30), (7, 7), 2, 1, ((3, 3), (3, 2))),
    (6, 3, (13, 16), (2, 2), 2, 1, ((0, 0), (0, 0))),
    (3, 4, (15, 34), (3, 3), 2, 2, ((2, 2), (2, 2))),
]


@pytest.mark.parametrize("c,m,hw,k,stride,dilation,pads", ROWS_WINDOW)
def test_rows_window_matches_reference(c, m, hw, k, stride, dilation, pads):
    rng = np.random.default_rng(c * 5 + m + hw[1])
    x = rng.standard_normal((c,) + hw).astype(np.float32)
    w = rng.standard_normal((m, c) + k).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    want = conv(x[None], w, b, (stride, stride), (dilation, dilation), pads, 1)[0]
    assert conv_spatial.rows_window_fits(k[0], k[1], 1, (stride, stride), c, outputs=m)   # the kernel takes any width
    wk, bk = conv_spatial.arrange_weights(w, b)
    out = np.full(want.shape, np.nan, np.float32)
    kernel = conv_spatial.driver(k[0], k[1], [], [], window_stride=stride)
    kernel(x, wk, bk, dilation, dilation, pads[0][0], pads[1][0], out, ())
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_rows_window_only_for_few_channels():
    assert not conv_spatial.rows_window_fits(3, 3, 1, (2, 2), 32) and not conv_spatial.rows_window_fits(3, 3, 1, (2, 1), 3)
    assert not conv_spatial.rows_window_fits(5, 1, 1, (1, 1), 8, width=1)
    assert conv_spatial.rows_window_fits(3, 3, 1, (1, 1), 32, outputs=8) and not conv_spatial.rows_window_fits(3, 3, 1, (1, 1), 32)


@pytest.mark.parametrize("shape,axes,keepdims", [((2, 5, 7, 9), (2, 3), True), ((1, 576, 1, 1), (2, 3), False),
                                                  ((3, 4, 1000), (2,), True), ((2, 3, 4), (0, 1, 2), False),
                                                  ((2, 3, 4), (1,), True)])
def test_mean_of_trailing_axes(shape, axes, keepdims):
    """MEAN on the CPU (a squeeze-excite's global average pool) against float64 NumPy; a non-trailing axis
    takes the reference."""
    x = (np.random.default_rng(len(shape)).standard_normal(shape) * 3 + 1).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(shape, name="x")
    exe = g.compile(targets=[g.mean(xi, axis=list(axes), keepdims=keepdims)])
    want = x.astype(np.float64).mean(axis=axes, keepdims=keepdims)
    got = exe.run({"x": x})[0]
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("c,hw,k,stride,pad", [(6, (20, 17), 5, 1, 2), (3, (9, 11), 3, 1, 1), (2, (12, 12), 4, 2, 1),
                                              (1, (1, 1), 3, 1, 1)])
def test_max_pool_separable_matches_reference(c, hw, k, stride, pad):
    """ONNX MaxPool (pad, a window view, max over its axes) on the CPU, where overlapping windows take the
    columns' pass then the rows', against a NumPy loop over the windows: exactly equal."""
    from onnx import TensorProto, helper
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k, k], strides=[stride] * 2, pads=[pad] * 4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, *hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.random.default_rng(c + k).standard_normal((1, c, *hw)).astype(np.float32)
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    oh, ow = [(d + 2 * pad - k) // stride + 1 for d in hw]
    want = np.empty((1, c, oh, ow), np.float32)
    for i in range(oh):
        for j in range(ow):
            want[:, :, i, j] = padded[:, :, i * stride:i * stride + k, j * stride:j * stride + k].max(axis=(2, 3))
    np.testing.assert_array_equal(np.asarray(ingot.from_onnx(model).run({"x": x})[0]), want)


def test_silu_epilogue_relative_error_over_its_range():
    """A conv's SiLU epilogue (conv_spatial._silu: one-FMA reduction, degree-5 exp) within 1e-6 of float64
    relatively on 2 M values from -100 to 100 (the tail, where outputs are ~1e-40 to 1e-7, included; the
    absolute tolerances of the other tests do not see it), and inf, -inf, NaN, +-1e30 as the reference's
    limits."""
    from ingot.options import CompileOptions, CpuOptions
    x = np.concatenate([np.linspace(-100, 100, 2_000_001, dtype=np.float32),
                        np.float32([np.inf, -np.inf, np.nan, 1e30, -1e30])])
    g = ingot.Graph()
    xi = g.placeholder((1, 1, 1, x.size), name="x")
    y = g.conv(xi, np.ones((1, 1, 1, 1), np.float32), np.zeros(1, np.float32))
    exe = g.compile(targets=[g.mul(y, g.sigmoid(y))], options=CompileOptions(cpu=CpuOptions(threads=1, float32_precision="float32")))
    got = np.asarray(exe.run({"x": x.reshape(1, 1, 1, -1)})[0]).reshape(-1).astype(np.float64)
    v = x[:-5].astype(np.float64)
    want = v / (1 + np.exp(-v))
    ok = np.abs(want) > 1e-30   # (float32's results past -80: -80 / (1 + e^80), ~1e-33)
    assert np.max(np.abs(got[:-5][ok] - want[ok]) / np.abs(want[ok])) < 1e-6
    assert got[-5] == np.inf and np.isnan(got[-3]) and got[-2] == np.float32(1e30)
    assert abs(got[-4]) < 1e-30 and abs(got[-1]) < 1e-30


def test_sigmoid_vector_pass_matches_reference():
    """SIGMOID on the CPU (one vector pass) against the reference's stable form in float64: subnormal
    results (x near -100) and 0 past -104 as NumPy's, NaN kept, a length not a multiple of 16."""
    x = np.concatenate([np.array([np.nan, -120.0, -100.0, -90.0, -88.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0], np.float32),
                        np.random.default_rng(4).standard_normal(30).astype(np.float32) * 6])
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    got = g.compile(targets=[g.sigmoid(xi)]).run({"x": x})[0]
    v = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.where(v >= 0, 1 / (1 + np.exp(-np.abs(v))), np.exp(-np.abs(v)) / (1 + np.exp(-np.abs(v))))
    assert np.isnan(got[0]) and got[1] == 0
    np.testing.assert_allclose(got[2:], want[2:], rtol=2e-6, atol=1e-44)   # atol: float32 subnormals' spacing
