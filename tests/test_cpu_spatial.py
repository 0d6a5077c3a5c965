"""passes/fuse_spatial.py and backends/cpu/spatial.py: max pooling, nearest upsampling and the depth-to-space
shuffle (with the elementwise ops after it moved in front) as one step each, against a NumPy reference on
awkward shapes (odd sizes, channels not a multiple of 16, stride 2, dilation, asymmetric pads, NaN) and,
as ONNX graphs, against onnxruntime."""
import numpy as np
import pytest

from ingot.backends.cpu import spatial
from ingot.ir import Op

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ingot  # noqa: E402


def pool_reference(x, kh, kw, sh, sw, dh, dw, top, left, bottom, right, value, oh, ow):
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right)), constant_values=value)
    taps = [xp[:, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
            for i in range(kh) for j in range(kw)]
    return np.max(np.stack(taps), axis=0)


POOLS = [  # planes, (H, W), (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right)
    (3, (9, 7), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    (5, (20, 20), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    (2, (1, 37), (1, 3), (1, 2), (1, 1), (0, 1, 0, 0)),
    (4, (13, 35), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0)),
    (1, (11, 40), (3, 3), (1, 1), (2, 3), (2, 0, 1, 3)),
    (7, (6, 5), (7, 7), (1, 2), (1, 1), (3, 3, 3, 3)),
    # strided and padded, wide: windows inside the input read it in place, the edge tiles' columns and the
    # edge rows' whole rows copied (the last tile reaching the right padding; two padding rows at the top)
    (3, (11, 75), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    (2, (12, 70), (5, 5), (2, 2), (1, 1), (2, 2, 2, 2)),
    (4, (9, 66), (3, 3), (1, 2), (2, 1), (2, 0, 2, 1)),
    # no padding: read in place (masked at the rows' ends; the last one ends the array): CRNN's 2 x 1 and 4 x 1
    (5, (8, 21), (2, 1), (2, 1), (1, 1), (0, 0, 0, 0)),
    (3, (9, 40), (4, 1), (4, 1), (1, 1), (0, 0, 0, 0)),
    (1, (2, 2), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0)),
    (6, (7, 67), (3, 2), (2, 2), (1, 2), (0, 0, 0, 0)),
    # stride 1, the output as wide as the input: flat vectors over whole planes (positions not a multiple of
    # 16, a row crossing vectors, uneven pads, fewer or more output rows than input rows, a plane of one)
    (3, (7, 9), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2)),
    (2, (13, 5), (3, 5), (1, 1), (1, 1), (0, 1, 2, 3)),
    (4, (1, 1), (5, 3), (1, 1), (1, 1), (2, 1, 2, 1)),
    (3, (9, 17), (3, 3), (1, 1), (1, 1), (1, 1, 0, 1)),
    (5, (5, 33), (5, 5), (1, 1), (1, 1), (3, 2, 2, 2)),
]


@pytest.mark.parametrize("planes,hw,k,s,d,pads", POOLS)
def test_max_pool_kernel_matches_reference(planes, hw, k, s, d, pads):
    rng = np.random.default_rng(planes * 13 + hw[1])
    x = rng.standard_normal((planes,) + hw).astype(np.float32)
    x.reshape(-1)[::17] = np.nan if planes % 2 else -np.inf
    x.reshape(-1)[5::23] = np.inf   # next to -inf (and the -inf padding): the kernel's exact path
    top, left, bottom, right = pads
    oh = (hw[0] + top + bottom - (k[0] - 1) * d[0] - 1) // s[0] + 1
    ow = (hw[1] + left + right - (k[1] - 1) * d[1] - 1) // s[1] + 1
    value = np.float32(-np.inf if planes != 5 else 0.25)
    want = pool_reference(x, *k, *s, *d, top, left, bottom, right, value, oh, ow)
    out = np.full((planes, oh, ow), 7.0, np.float32)
    assert spatial.pool_fits(k[0], k[1], s[1])
    spatial.max_pool(x, *k, *s, *d, top, left, value, out)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("rows", [[0, 0, 1, 1, 4, 4, 4, 2], [i // 2 for i in range(10)], [i // 2 for i in range(9)] + [3]])
@pytest.mark.parametrize("cols", [[6, 0, 0, 3, 3], list(range(7)), [j // 2 for j in range(14)], [j // 2 for j in range(12)],
                                  [j // 2 for j in range(13)] + [5]])
def test_upsample_kernel_matches_take(rows, cols):
    """Any gather; nearest 2x along the row (stored twice, no gather), along rows too (a pair of rows in
    one pass); and near misses of them."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 7)).astype(np.float32)
    rows, cols = np.array(rows), np.array(cols)
    out = np.empty((6, len(rows), len(cols)), np.float32)
    spatial.upsample(x, rows, cols, out)
    np.testing.assert_array_equal(out, x[:, rows][:, :, cols])


@pytest.mark.parametrize("w", [1, 16, 21, 33])
def test_upsample_2x_over_several_vectors(w):
    """Nearest 2x both ways on rows of several 16-value vectors and a part of one (masked tail)."""
    x = np.random.default_rng(w).standard_normal((3, 4, w)).astype(np.float32)
    out = np.full((3, 8, 2 * w), 7.0, np.float32)
    spatial.upsample(x, np.arange(8) // 2, np.arange(2 * w) // 2, out)
    np.testing.assert_array_equal(out, x.repeat(2, axis=1).repeat(2, axis=2))


def test_depth_to_space_kernel_matches_transpose():
    x = np.random.default_rng(4).standard_normal((2, 3 * 2 * 3, 5, 7)).astype(np.float32)
    out = np.empty((2, 3, 10, 21), np.float32)
    spatial.depth_to_space(x, 2, 3, out)
    want = x.reshape(2, 3, 2, 3, 5, 7).transpose(0, 1, 4, 2, 5, 3).reshape(2, 3, 10, 21)
    np.testing.assert_array_equal(out, want)


def _model(nodes, inits, shape, outputs):
    graph = helper.make_graph(nodes, "spatial", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(model, shape, kinds, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"x": x})
    exe = ingot.from_onnx(model)
    got = exe.run({"x": x})
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(e).max())))
    inner = exe.executable({"x": x}) if hasattr(exe, "executable") else exe
    found = {n.attrs.get("kind") for n in inner.program.nodes() if n.op == Op.FUSED}
    assert kinds <= found, found


def test_onnx_pools_and_resizes_equal_onnxruntime_as_one_step_each():
    nodes = [helper.make_node("MaxPool", ["x"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 2]),
             helper.make_node("MaxPool", ["x"], ["p2"], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2]),
             helper.make_node("MaxPool", ["x"], ["p3"], kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 1], ceil_mode=1),
             helper.make_node("Resize", ["x", "", "s2"], ["r2"], mode="nearest"),
             helper.make_node("Resize", ["x", "", "s3"], ["r3"], mode="nearest", nearest_mode="floor",
                              coordinate_transformation_mode="asymmetric"),
             helper.make_node("Resize", ["x", "", "s4"], ["r4"], mode="nearest")]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s2"),
             numpy_helper.from_array(np.array([1, 1, 1.5, 3], np.float32), "s3"),
             numpy_helper.from_array(np.array([1, 1, 1, 2], np.float32), "s4")]
    shape = (2, 19, 11, 13)
    _check(_model(nodes, inits, shape, ["p1", "p2", "p3", "r2", "r3", "r4"]), shape, {"max_pool", "upsample"})


def test_onnx_transposed_conv_with_batch_norm_relu_sigmoid_equals_onnxruntime():
    """ConvTranspose (kernel = stride) + BatchNorm + ReLU, then ConvTranspose + Sigmoid (DBNet's head): the
    per-channel ops move in front of the shuffle, into the convolution's epilogue."""
    rng = np.random.default_rng(7)

    def init(name, shape, scale=0.5, shift=0.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale + shift).astype(np.float32), name)
    inits = [init("w1", (5, 3, 2, 2)), init("b1", (3,)), init("g", (3,)), init("beta", (3,)), init("mean", (3,)),
             init("var", (3,), 0.1, 1.0), init("w2", (3, 1, 3, 2))]
    nodes = [helper.make_node("ConvTranspose", ["x", "w1", "b1"], ["u1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("BatchNormalization", ["u1", "g", "beta", "mean", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]),
             helper.make_node("ConvTranspose", ["r", "w2"], ["u2"], kernel_shape=[3, 2], strides=[3, 2]),
             helper.make_node("Sigmoid", ["u2"], ["y"])]
    shape = (1, 5, 9, 7)
    model = _model(nodes, inits, shape, ["y", "r"])
    _check(model, shape, {"depth_to_space", "conv_epilogue"})
    exe = ingot.from_onnx(model)
    exe.run({"x": np.zeros(shape, np.float32)})
    inner = exe.executable({"x": np.zeros(shape, np.float32)}) if hasattr(exe, "executable") else exe
    ops = [n.op for n in inner.program.nodes()]
    assert Op.SIGMOID not in ops and Op.MAXIMUM not in ops   # all in the convolutions' epilogues
