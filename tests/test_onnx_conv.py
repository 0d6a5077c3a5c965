"""Convolutional ONNX graphs as exporters write them (conv + BatchNorm folded + an activation as
separate nodes, depthwise and pointwise convolutions, residual adds, a transposed convolution)
through ingot.from_onnx against onnxruntime, and the convolution epilogues fused on the CPU."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import ingot  # noqa: E402
from ingot.ir import Op  # noqa: E402


def build_model(seed: int = 0):
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def weight(name, shape, scale=0.3):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def conv(x, out, cin, cout, k, stride=1, group=1, pad=None):
        p = k // 2 if pad is None else pad
        nodes.append(helper.make_node("Conv", [x, weight(out + "_w", (cout, cin // group, k, k)), weight(out + "_b", (cout,))],
                                      [out], kernel_shape=[k, k], strides=[stride, stride], pads=[p, p, p, p], group=group))
        return out

    def silu(x, out):
        nodes.append(helper.make_node("Sigmoid", [x], [out + "_s"]))
        nodes.append(helper.make_node("Mul", [x, out + "_s"], [out]))
        return out

    a = silu(conv("image", "c1", 3, 16, 3, stride=2), "a1")                           # stem: conv + SiLU
    d = conv(a, "dw", 16, 16, 5, group=16)                                               # depthwise 5x5
    nodes.append(helper.make_node("HardSwish", [d], ["d_act"]))
    p = conv("d_act", "pw", 16, 16, 1)                                                   # pointwise
    nodes.append(helper.make_node("Add", [p, a], ["res"]))                               # residual
    nodes.append(helper.make_node("Relu", ["res"], ["r"]))
    c = conv("r", "c2", 16, 24, 3, stride=2)
    nodes.append(helper.make_node("LeakyRelu", [c], ["lr"], alpha=0.1))
    nodes.append(helper.make_node("ConvTranspose", ["lr", weight("up_w", (24, 8, 2, 2)), weight("up_b", (8,))], ["up"],
                                  kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("Sigmoid", ["up"], ["prob"]))
    nodes.append(helper.make_node("MaxPool", [a], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 37, 42])],
                              [helper.make_tensor_value_info("prob", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("lr", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("pool", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convolutional_model_equals_onnxruntime_and_fuses_epilogues():
    model = build_model()
    x = np.random.default_rng(1).standard_normal((1, 3, 37, 42)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip(["prob", "lr", "pool"], sess.run(None, {"image": x})))
    exe = ingot.from_onnx(model)
    got = exe.run({"image": x})
    for name in ("prob", "lr", "pool"):   # pool: a max over a window view, 9 elementwise maxima on the CPU
        assert got[name].shape == expected[name].shape, name
        err = np.abs(got[name] - expected[name]).max() / np.abs(expected[name]).max()
        assert err < 1e-4, f"{name}: relative error {err:.3g}"
    kinds = [n.attrs["kind"] for n in exe.program.nodes() if n.op == Op.FUSED]
    # the stem's SiLU, the depthwise conv's hard-swish and the pointwise conv's residual + ReLU join their
    # convolutions; the conv read twice (by LeakyRelu's where) keeps its activation in the op as well
    assert kinds.count("conv_epilogue") >= 3, kinds
    # padding is the conv's attribute, not a padded copy (the one PAD left spreads the transposed conv's input)
    assert sum(n.op == Op.PAD for n in exe.program.nodes()) <= 1
