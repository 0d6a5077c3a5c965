"""The convolutional nets of scripts/vision_models.py (MobileNetV3-, YOLOv8-, DBNet-style and a CRNN,
random weights), exported from PyTorch, through ingot.from_onnx against onnxruntime at 1e-4 relative. Needs
torch to export (skipped without it); benchmarks/onnx_vision.py times the same models."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def vision_models():
    spec = importlib.util.spec_from_file_location("vision_models", ROOT / "scripts" / "vision_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenet", "yolo", "dbnet", "crnn"])
def test_vision_model_equals_onnxruntime(name, tmp_path):
    models = vision_models()
    path = models.export(name, tmp_path / f"{name}.onnx")
    x = np.random.default_rng(3).standard_normal(models.MODELS[name][1]).astype(np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
    got = ingot.from_onnx(str(path)).run({"image": x})["out"]
    assert got.shape == expected.shape
    err = float(np.abs(got - expected).max() / np.abs(expected).max())
    assert err < 1e-4, f"{name}: relative error {err:.3g}"
