"""RNN, LSTM and GRU through the ONNX importer against onnxruntime (an independent implementation):
each direction, sequence lengths, initial states, peepholes, clip, activation attributes, batch-first
layout, on awkward sizes (T 7, B 3, I 5, H 6), to 1e-5."""
import zlib

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

T, B, I, H = 7, 3, 5, 6
GATES = {"RNN": 1, "LSTM": 4, "GRU": 3}


def build(op: str, direction="forward", lengths=False, initial=False, peephole=False, layout=0, bias=True,
          attrs=None, initializers=True):
    rng = np.random.default_rng(zlib.crc32(repr((op, direction, lengths, initial, peephole)).encode()))
    d = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    x_shape = [B, T, I] if layout else [T, B, I]
    state_shape = [B, d, H] if layout else [d, B, H]
    params = {"W": rng.standard_normal((d, g * H, I)).astype(np.float32) * 0.5,
              "R": rng.standard_normal((d, g * H, H)).astype(np.float32) * 0.5}
    if bias:
        params["B"] = rng.standard_normal((d, 2 * g * H)).astype(np.float32) * 0.3
    feeds = {"X": rng.standard_normal([T, B, I]).astype(np.float32)}
    if layout:
        feeds["X"] = feeds["X"].transpose(1, 0, 2).copy()
    names = ["X", "W", "R", "B" if bias else ""]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    if lengths:
        feeds["L"] = np.array([T, 3, 5], np.int32)
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, [B]))
    names.append("L" if lengths else "")
    if initial:
        feeds["H0"] = rng.standard_normal([d, B, H]).astype(np.float32).transpose(*((1, 0, 2) if layout else (0, 1, 2))).copy()
        inputs.append(helper.make_tensor_value_info("H0", TensorProto.FLOAT, state_shape))
    names.append("H0" if initial else "")
    if op == "LSTM":
        if initial:
            feeds["C0"] = rng.standard_normal([d, B, H]).astype(np.float32).transpose(*((1, 0, 2) if layout else (0, 1, 2))).copy()
            inputs.append(helper.make_tensor_value_info("C0", TensorProto.FLOAT, state_shape))
        names.append("C0" if initial else "")
        if peephole:
            params["P"] = rng.standard_normal((d, 3 * H)).astype(np.float32) * 0.3
        names.append("P" if peephole else "")
    while names and names[-1] == "":
        names.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, hidden_size=H, direction=direction, layout=layout, **(attrs or {}))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    inits = [numpy_helper.from_array(v, k) for k, v in params.items()]
    if not initializers:   # weights as graph inputs, fed at run
        inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in params.items()]
        feeds.update(params)
        inits = []
    graph = helper.make_graph([node], "rnn", inputs, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), feeds


def check(model, feeds, atol=1e-5):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    got = ingot.from_onnx(model).run(feeds)
    assert len(got) == len(want)
    for name, a, b in zip(got.keys(), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.parametrize("op", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lengths, initial", [(False, False), (True, True)])
def test_directions_lengths_and_initial_states(op, direction, lengths, initial):
    check(*build(op, direction, lengths, initial, peephole=op == "LSTM"))


@pytest.mark.parametrize("op", ["RNN", "LSTM", "GRU"])
def test_batch_first_layout_without_bias(op):
    # onnxruntime has no layout 1: compare with the same layer, time first, run by onnxruntime
    model, feeds = build(op, "bidirectional", lengths=True, initial=True, layout=1, bias=False)
    reference, reference_feeds = build(op, "bidirectional", lengths=True, initial=True, layout=0, bias=False)
    session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, reference_feeds)
    got = ingot.from_onnx(model).run(feeds)
    np.testing.assert_allclose(got[0], want[0].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, attrs", [
    ("RNN", {"activations": ["Relu"]}),
    ("RNN", {"activations": ["LeakyRelu", "HardSigmoid"], "activation_alpha": [0.2, 0.3], "activation_beta": [0.4]}),
    ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Softsign"], "activation_alpha": [0.3], "activation_beta": [0.6]}),
    ("LSTM", {"clip": 0.7}),
    ("LSTM", {"input_forget": 1}),
    ("GRU", {"linear_before_reset": 1}),
    ("GRU", {"activations": ["Sigmoid", "ScaledTanh"], "activation_alpha": [1.5], "activation_beta": [0.5], "clip": 1.2}),
])
def test_activation_attributes(op, attrs):
    direction = "bidirectional" if len(attrs.get("activations", [])) in (2, 6) and op == "RNN" else "forward"
    check(*build(op, direction, lengths=True, initial=True, attrs=attrs))


def test_a_saved_package_runs_the_same(tmp_path):
    model, feeds = build("LSTM", "bidirectional", lengths=True, initial=True, peephole=True, attrs={"clip": 0.5})
    exe = ingot.from_onnx(model)
    exe.save(tmp_path / "lstm.ingot")
    loaded = ingot.load(tmp_path / "lstm.ingot").run(feeds)
    assert list(loaded.keys()) == ["Y", "Y_h", "Y_c"]
    for a, b in zip(exe.run(feeds), loaded):
        np.testing.assert_array_equal(a, b)


def test_weights_fed_at_run_time():
    check(*build("LSTM", "bidirectional", lengths=True, initializers=False))


def test_type_rule_refuses_mismatched_weights():
    g = ingot.Graph()
    x = g.placeholder((T, B, I), name="x")
    w, r = g.placeholder((1, 4 * H, I + 1), name="w"), g.placeholder((1, 4 * H, H), name="r")
    others = [g.placeholder(s, name=n) for n, s in (("b", (1, 8 * H)),)] + [g.placeholder((B,), ingot.int32, name="l")]
    states = [g.placeholder((1, B, H), name=n) for n in ("h", "c")] + [g.placeholder((1, 3 * H), name="p")]
    from ingot.ir import Op
    with pytest.raises(ingot.IngotError, match="lstm.*w of shape"):
        g.op(Op.LSTM, [x, w, r, *others, *states], {"direction": "forward", "activations": ("Sigmoid", "Tanh", "Tanh")})
