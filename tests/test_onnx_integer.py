"""ONNX's integer ops (MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv) against onnxruntime, exactly:
zero points per tensor and per channel, int8 and uint8, constant and run-time weights, and weights
large enough that float32 could not hold the sums (Ingot then sums in float64)."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ingot.importers.onnx import from_onnx, op_counts  # noqa: E402
from ingot.ir import Op  # noqa: E402
from ingot.ops.conv import conv  # noqa: E402

ELEM = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8, np.dtype(np.float32): TensorProto.FLOAT,
        np.dtype(np.int32): TensorProto.INT32}
RANGE = {np.int8: (-128, 128), np.uint8: (0, 256)}


def ints(rng, shape, dtype, lo=None, hi=None):
    a, b = RANGE[dtype]
    return rng.integers(a if lo is None else lo, b if hi is None else hi, shape).astype(dtype)


def run_both(op, inputs, attrs=None, constant=(), onnxruntime=True):
    """One-node model: inputs {name: array}, those named in `constant` as initializers. (ours, onnxruntime's)."""
    names = [n for n in inputs]
    inits = [numpy_helper.from_array(v, n) for n, v in inputs.items() if n in constant and v is not None]
    graph_inputs = [helper.make_tensor_value_info(n, ELEM[v.dtype], v.shape) for n, v in inputs.items()
                    if n not in constant and v is not None]
    out = TensorProto.INT32 if op.endswith("Integer") else ELEM[inputs[names[0]].dtype]
    node = helper.make_node(op, [n if inputs[n] is not None else "" for n in names], ["y"], **(attrs or {}))
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", out, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    feeds = {n: v for n, v in inputs.items() if n not in constant and v is not None}
    exe = from_onnx(model)
    theirs = None
    if onnxruntime:
        (theirs,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return exe, exe.run(feeds)[0], theirs


def eight_bit_matmuls(exe) -> int:
    """quantized_matmul nodes, those inside FUSED integer_matmul ops (8-bit x on VNNI) included."""
    fused = sum(len(n.attrs["body"].find(Op.QUANTIZED_MATMUL)) for n in exe.program.nodes()
                if n.op == Op.FUSED and n.attrs["kind"] == "integer_matmul")
    return op_counts(exe)["quantized_matmul"] + fused


def assert_same(ours, theirs):
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)])
@pytest.mark.parametrize("zeros", ["none", "tensor", "channel"])
def test_matmul_integer(a_type, b_type, zeros):
    rng = np.random.default_rng(0)
    a, b = ints(rng, (3, 5, 37), a_type), ints(rng, (37, 19), b_type)
    a_zero = None if zeros == "none" else ints(rng, (), a_type)
    b_zero = {"none": None, "tensor": ints(rng, (), b_type), "channel": ints(rng, (19,), b_type)}[zeros]
    exe, ours, theirs = run_both("MatMulInteger", {"a": a, "b": b, "a_zero": a_zero, "b_zero": b_zero},
                                 constant=("b", "a_zero", "b_zero"))
    assert_same(ours, theirs)
    assert eight_bit_matmuls(exe) == 1     # the constant weight stays 8-bit
    _, ours, theirs = run_both("MatMulInteger", {"a": a, "b": b, "a_zero": a_zero, "b_zero": b_zero})   # all at run time
    assert_same(ours, theirs)


def test_matmul_integer_sums_beyond_float32():
    """uint8 weights of 255 over K = 600 with zero points 0: sums up to 39e6 > 2**24, summed in float64."""
    rng = np.random.default_rng(1)
    a, b = ints(rng, (4, 600), np.uint8, 250), ints(rng, (600, 7), np.uint8, 250)
    exe, ours, theirs = run_both("MatMulInteger", {"a": a, "b": b}, constant=("b",))
    assert theirs.max() > 2 ** 24 and eight_bit_matmuls(exe) == 2   # x in two digits, W still 8-bit
    assert_same(ours, theirs)


def test_matmul_integer_run_time_weights_in_four_parts():
    """K = 4500 with weights unknown at import: both sides split into digits (four products)."""
    rng = np.random.default_rng(6)
    a, b = ints(rng, (2, 4500), np.uint8, 200), ints(rng, (4500, 3), np.uint8, 200)
    exe, ours, theirs = run_both("MatMulInteger", {"a": a, "b": b, "a_zero": np.uint8(3), "b_zero": np.uint8(1)},
                                 constant=("a_zero", "b_zero"))
    assert op_counts(exe)["matmul"] == 4
    assert_same(ours, theirs)


@pytest.mark.parametrize("x_type,w_type", [(np.uint8, np.int8), (np.uint8, np.uint8)])
@pytest.mark.parametrize("zeros", ["none", "tensor", "channel"])
def test_conv_integer(x_type, w_type, zeros):
    rng = np.random.default_rng(2)
    x, w = ints(rng, (2, 4, 9, 7), x_type), ints(rng, (6, 2, 3, 2), w_type)
    x_zero = None if zeros == "none" else ints(rng, (), x_type)
    w_zero = {"none": None, "tensor": ints(rng, (), w_type), "channel": ints(rng, (6,), w_type)}[zeros]
    attrs = {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}
    inputs = {"x": x, "w": w, "x_zero": x_zero, "w_zero": w_zero}
    expected = conv_integer_reference(x, w, x_zero, w_zero, attrs)
    for constant in (("w", "x_zero", "w_zero"), ()):
        _, ours, theirs = run_both("ConvInteger", inputs, attrs, constant=constant, onnxruntime=zeros != "channel")
        assert_same(ours, expected)
        if theirs is not None:   # onnxruntime takes no per-channel weight zero point in ConvInteger
            assert_same(ours, theirs)


def conv_integer_reference(x, w, x_zero, w_zero, attrs):
    xs = x.astype(np.float64) - (0 if x_zero is None else x_zero)
    ws = w.astype(np.float64) - (0 if w_zero is None else np.reshape(w_zero, (-1, 1, 1, 1)))
    pads = attrs["pads"]
    y = conv(xs, ws, None, attrs["strides"], attrs["dilations"], [(pads[0], pads[2]), (pads[1], pads[3])], attrs["group"])
    return y.astype(np.int32)


def test_conv_integer_sums_beyond_float32():
    rng = np.random.default_rng(3)
    x, w = ints(rng, (1, 64, 6, 6), np.uint8, 250), ints(rng, (3, 64, 3, 3), np.uint8, 250)
    _, ours, theirs = run_both("ConvInteger", {"x": x, "w": w}, constant=("w",))
    assert theirs.max() > 2 ** 24
    assert_same(ours, theirs)


def mid_zero(rng, shape, dtype):
    return ints(rng, shape, dtype, 100, 150) if dtype == np.uint8 else ints(rng, shape, dtype, -10, 10)


def scales(rng, shape):
    return rng.uniform(0.001, 0.02, shape).astype(np.float32)


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.int8, np.int8), (np.uint8, np.uint8)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_matmul(a_type, b_type, per_channel):
    rng = np.random.default_rng(4)
    n = 19
    inputs = {"a": ints(rng, (2, 5, 37), a_type), "a_scale": scales(rng, ()), "a_zero": mid_zero(rng, (), a_type),
              "b": ints(rng, (37, n), b_type), "b_scale": scales(rng, (n,) if per_channel else ()),
              "b_zero": mid_zero(rng, (n,) if per_channel else (), b_type),
              "y_scale": np.float32(0.2), "y_zero": np.array(128 if a_type == np.uint8 else 0, a_type)}
    constant = [k for k in inputs if k != "a"]
    exe, ours, theirs = run_both("QLinearMatMul", inputs, constant=constant)
    assert_same(ours, theirs)
    assert eight_bit_matmuls(exe) == 1
    lo, hi = RANGE[a_type]
    assert np.mean((ours > lo) & (ours < hi - 1)) > 0.6


@pytest.mark.parametrize("x_type,w_type", [(np.uint8, np.int8), (np.int8, np.int8), (np.uint8, np.uint8)])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_qlinear_conv(x_type, w_type, per_channel, bias):
    rng = np.random.default_rng(5)
    m = 6
    w_zero = np.zeros((m,) if per_channel else (), w_type) if w_type == np.int8 else ints(rng, (m,) if per_channel else (), w_type, 100, 150)
    inputs = {"x": ints(rng, (2, 4, 11, 8), x_type), "x_scale": scales(rng, ()), "x_zero": ints(rng, (), x_type, 0, 100),
              "w": ints(rng, (m, 2, 3, 3), w_type), "w_scale": scales(rng, (m,) if per_channel else ()), "w_zero": w_zero,
              "y_scale": np.float32(0.05), "y_zero": np.array(128 if x_type == np.uint8 else 0, x_type),
              "bias": rng.integers(-3000, 3000, m).astype(np.int32) if bias else None}
    attrs = {"group": 2, "strides": [1, 2], "pads": [1, 1, 0, 1]}
    constant = [k for k in inputs if k != "x"]
    exe, ours, theirs = run_both("QLinearConv", inputs, attrs, constant=constant)
    assert_same(ours, theirs)
    lo, hi = RANGE[x_type]
    assert np.mean((ours > lo) & (ours < hi - 1)) > 0.6     # mostly not saturated: the rounding is what is compared


@pytest.mark.parametrize("fill", [0.0, None])
def test_dynamic_quantize_linear_then_matmul_integer(fill):
    """quantize_dynamic's chain: x's own uint8 scale and zero point, MatMulInteger with an int8 weight, then
    the float rescale; an all-zero x too (onnxruntime's scale 1, not the spec's 0 / 0)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 21)).astype(np.float32) if fill is None else np.full((3, 4, 21), fill, np.float32)
    w = ints(rng, (21, 13), np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]), helper.make_node("Mul", ["accf", "s"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.int8(0), "wz"),
             numpy_helper.from_array(np.float32(0.02), "ws")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               (("y", TensorProto.FLOAT), ("xq", TensorProto.UINT8), ("xs", TensorProto.FLOAT))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    exe = from_onnx(model)
    assert eight_bit_matmuls(exe) == 1
    for ours, want in zip(exe.run({"x": x}), theirs):
        assert_same(ours, want)
