"""ONNX models on device="cuda" (marker `cuda`) against onnxruntime on the CPU, to 1e-4 relative, with
nothing run on the host (each plan can be captured as a CUDA graph): the rnn, lstm and gru
lowering (backends/cuda/recurrent.py) on directions, sequence lengths, initial states, peepholes,
clip, input_forget and linear_before_reset at awkward sizes, and the issue's model classes exported from PyTorch with random
weights (MobileNet, YOLO, DBNet, a CRNN with a bidirectional LSTM, an LSTM voice-activity model with
If on its sample rate, a BERT-like encoder). Float32 products exact (cuda.float32_precision "ieee",
the default); "tf32" is checked to reach cuDNN. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it
under Triton's interpreter."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

require_cuda()
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _plans(exe):
    """The compiled executables behind exe (one, or one per specialisation), and their If branches."""
    found = list(exe.compiled.values()) if hasattr(exe, "compiled") else [exe]
    return found + [callee for e in found for callee in getattr(e, "callables", {}).values()]


def check(exe, model, feeds, rtol=1e-4):
    """exe's outputs against onnxruntime's to rtol relative (of each output's largest value), and no
    step of any of its plans on the host."""
    session = ort.InferenceSession(str(model) if isinstance(model, (str, Path)) else model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    want = session.run(None, {k: v for k, v in feeds.items() if k in names})
    got = exe.run(feeds)
    assert len(got) == len(want)
    for name, a, b in zip(got.keys(), got, want):
        a = np.asarray(a)
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(float(np.abs(b).max()), 1e-6), err_msg=name)
    for plan_exe in _plans(exe):
        assert not plan_exe.plan.host_syncs, plan_exe.plan.host_syncs


GATES = {"RNN": 1, "LSTM": 4, "GRU": 3}


def recurrent_model(op, seq, batch, size, hidden, direction, lengths, initial, peephole=False, attrs=None, seed=0):
    """A one-node ONNX model of op (RNN, LSTM or GRU) and its feeds; weights as initializers."""
    rng = np.random.default_rng(seed)
    d, g = 2 if direction == "bidirectional" else 1, GATES[op]
    params = {"W": rng.standard_normal((d, g * hidden, size)) * 0.5,
              "R": rng.standard_normal((d, g * hidden, hidden)) * (0.5 / np.sqrt(hidden / 6)),
              "B": rng.standard_normal((d, 2 * g * hidden)) * 0.3}
    feeds = {"X": rng.standard_normal((seq, batch, size)).astype(np.float32)}
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [seq, batch, size])]
    names = ["X", "W", "R", "B", ""]
    if lengths:
        feeds["L"] = rng.integers(1, seq + 1, batch).astype(np.int32)
        feeds["L"][0] = seq
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, [batch]))
        names[-1] = "L"
    for state in ("H0", "C0") if op == "LSTM" else ("H0",):
        if initial:
            feeds[state] = rng.standard_normal((d, batch, hidden)).astype(np.float32)
            inputs.append(helper.make_tensor_value_info(state, TensorProto.FLOAT, [d, batch, hidden]))
        names.append(state if initial else "")
    if peephole:
        params["P"] = rng.standard_normal((d, 3 * hidden)) * 0.3
        names.append("P")
    while names[-1] == "":
        names.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, hidden_size=hidden, direction=direction, **(attrs or {}))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    graph = helper.make_graph([node], "recurrent", inputs, outs,
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()])
    # IR version 8: what onnxruntime releases older than onnx 1.20 (IR 14) read too
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), feeds


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("seq, batch, size, hidden", [(7, 3, 5, 6), (5, 17, 9, 40)])
def test_lstm_on_the_device(direction, seq, batch, size, hidden):
    model, feeds = recurrent_model("LSTM", seq, batch, size, hidden, direction, lengths=True, initial=True, peephole=True)
    exe = ingot.from_onnx(model, device="cuda")
    assert any(n.op.name == "LSTM" for n in exe.program.nodes())
    check(exe, model, feeds)


@pytest.mark.parametrize("attrs", [{"clip": 0.7}, {"input_forget": 1}])
def test_lstm_clip_and_input_forget(attrs):
    model, feeds = recurrent_model("LSTM", 6, 2, 4, 5, "bidirectional", lengths=False, initial=False, peephole=True,
                                   attrs=attrs, seed=3)
    check(ingot.from_onnx(model, device="cuda"), model, feeds)


@pytest.mark.parametrize("op, attrs", [("RNN", {}), ("RNN", {"clip": 0.5}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}),
                                       ("GRU", {"clip": 0.6})])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("seq, batch, size, hidden", [(7, 3, 5, 6), (4, 17, 9, 40)])
def test_rnn_and_gru_on_the_device(op, attrs, direction, seq, batch, size, hidden):
    model, feeds = recurrent_model(op, seq, batch, size, hidden, direction, lengths=True, initial=True, attrs=attrs, seed=5)
    check(ingot.from_onnx(model, device="cuda"), model, feeds)


def test_other_activations_run_the_reference_on_the_host():
    model, feeds = recurrent_model("LSTM", 4, 2, 3, 5, "forward", lengths=False, initial=False,
                                   attrs={"activations": ["HardSigmoid", "Tanh", "Tanh"]})
    exe = ingot.from_onnx(model, device="cuda")
    assert exe.plan.host_syncs            # said, not hidden
    got = exe.run(feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=1e-5, atol=1e-5)


def _script(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["mobilenet", "yolo", "dbnet", "crnn"])
def test_vision_models(name, tmp_path):
    pytest.importorskip("torch")
    models = _script("vision_models")
    path = models.export(name, tmp_path / f"{name}.onnx")
    x = np.random.default_rng(0).standard_normal(models.MODELS[name][1]).astype(np.float32)
    check(ingot.from_onnx(path, device="cuda"), path, {"image": x})


def test_voice_activity_lstm_with_if(tmp_path):
    pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    h, c = (rng.standard_normal((1, 2, 32)).astype(np.float32) * 0.5 for _ in range(2))
    path = tmp_path / "vad.onnx"
    _script("voice_activity").export_voice_activity(path)
    exe = ingot.from_onnx(path, device="cuda")
    for sr, samples in ((16000, 512), (8000, 256)):
        feeds = {"audio": rng.standard_normal((2, samples)).astype(np.float32), "sr": np.array(sr, np.int64), "h": h, "c": c}
        check(exe, path, feeds)


def test_bert_like_encoder():
    path = ROOT / "tests" / "fixtures" / "onnx" / "encoder.onnx"
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    ids = rng.integers(0, 100, shapes["input_ids"]).astype(np.int64)
    mask = np.ones(shapes["attention_mask"], np.int64)
    mask[..., -3:] = 0
    check(ingot.from_onnx(path, device="cuda"), path, {"input_ids": ids, "attention_mask": mask})


def test_float32_precision_option_reaches_the_convolutions():
    """tf32 convolutions differ from exact ones by about 1e-3 relative on a GPU (the interpreter runs
    exact float32 either way); both stay within 1e-2 of onnxruntime, and the option is the plan's."""
    model = ROOT / "tests" / "fixtures" / "onnx" / "cnn.onnx"
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    tf32 = CompileOptions(cuda=CudaOptions(float32_precision="tf32"))
    exe = ingot.from_onnx(model, device="cuda", options=tf32)
    assert exe.options.cuda.float32_precision == "tf32"
    check(exe, model, {"image": x}, rtol=1e-2)
    with pytest.raises(ingot.IngotError, match="float32_precision"):
        CudaOptions(float32_precision="fast")
