"""Models exported from PyTorch with random weights, through ingot.from_onnx, against onnxruntime to
1e-4 relative: a CRNN text recogniser (convolutions, then a two-layer bidirectional LSTM, then a
classifier), and an LSTM voice-activity model in the manner of Silero VAD (a scripted module whose
front end branches on the sample rate: an ONNX If; the LSTM state goes in and out). Each .onnx file
is exported into the test's temporary folder; nothing binary is committed."""
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402
from ingot.importers.onnx import SpecializingOnnxExecutable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from voice_activity import VoiceActivity, export  # noqa: E402


class CRNN(torch.nn.Module):
    def __init__(self, classes: int = 37, hidden: int = 24):
        super().__init__()
        self.features = torch.nn.Sequential(   # [B, 1, 16, W] -> [B, 32, 1, W/4]
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 32, (4, 1)), torch.nn.ReLU())
        self.rnn = torch.nn.LSTM(32, hidden, num_layers=2, bidirectional=True)
        self.classifier = torch.nn.Linear(2 * hidden, classes)

    def forward(self, image):
        f = self.features(image).squeeze(2).permute(2, 0, 1)   # [T, B, C]
        y, _ = self.rnn(f)
        return self.classifier(y).log_softmax(-1)              # [T, B, classes]


def assert_matches_onnxruntime(exe, path, feeds, rtol=1e-4):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    want = session.run(None, {k: v for k, v in feeds.items() if k in names})
    got = exe.run(feeds)
    for name, a, b in zip(got.keys(), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=name)


def test_crnn_with_a_bidirectional_lstm(tmp_path):
    image = np.random.default_rng(1).standard_normal((2, 1, 16, 40)).astype(np.float32)
    model = export(CRNN(), (torch.from_numpy(image),), ["image"], ["log_probs"], tmp_path / "crnn.onnx")
    assert sum(n.op_type == "LSTM" for n in model.graph.node) == 2
    exe = ingot.from_onnx(tmp_path / "crnn.onnx")
    assert sum(n.op.name == "LSTM" for n in exe.program.nodes()) == 2
    assert_matches_onnxruntime(exe, tmp_path / "crnn.onnx", {"image": image})


def test_voice_activity_lstm_with_if_on_the_sample_rate(tmp_path):
    rng = np.random.default_rng(2)
    h, c = (rng.standard_normal((1, 2, 32)).astype(np.float32) * 0.5 for _ in range(2))
    args = (torch.zeros(2, 512), torch.tensor(16000), torch.from_numpy(h), torch.from_numpy(c))
    path = tmp_path / "vad.onnx"
    model = export(VoiceActivity(), args, ["audio", "sr", "h", "c"], ["prob", "h_out", "c_out"], path, script=True,
                   dynamic_axes={"audio": {1: "samples"}})
    assert {"If", "LSTM"} <= {n.op_type for n in model.graph.node}
    exe = ingot.from_onnx(path)        # the sample rate and the audio length are inputs: compiled per value and shape
    assert isinstance(exe, SpecializingOnnxExecutable)
    for sr, samples in ((16000, 512), (8000, 256), (16000, 1024)):
        feeds = {"audio": rng.standard_normal((2, samples)).astype(np.float32), "sr": np.array(sr, np.int64), "h": h, "c": c}
        assert_matches_onnxruntime(exe, path, feeds)
    assert len(exe.compiled) == 3
    fixed = ingot.from_onnx(path, constant_inputs={"sr": np.array(8000)}, input_shapes={"audio": (2, 256)})
    assert not isinstance(fixed, SpecializingOnnxExecutable)
    assert_matches_onnxruntime(fixed, path, {**feeds, "sr": np.array(8000), "audio": feeds["audio"][:, :256]})
