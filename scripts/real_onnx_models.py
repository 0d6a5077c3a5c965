"""ONNX files that PyPI packages ship, with the inputs Ingot's tests and benchmarks feed them: PP-OCRv4's
text detector and recogniser and its direction classifier (rapidocr-onnxruntime), Silero VAD (LSTM,
If on the sample rate; silero-vad) and Magika's file-type classifier. Installed with
`pip install --no-deps rapidocr-onnxruntime silero-vad magika`; nothing is downloaded at run time.
Used by tests/test_onnx_real.py and benchmarks/onnx_vision.py --real.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package, file inside it, {input: (shape, dtype, value or None: random)})
REAL = {
    "ppocr-det": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", {"x": ((1, 3, 320, 320), "float32", None)}),
    "ppocr-rec": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", {"x": ((1, 3, 48, 320), "float32", None)}),
    "ppocr-cls": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                  {"x": ((1, 3, 48, 192), "float32", None)}),
    "silero-vad": ("silero_vad", "data/silero_vad.onnx", {"input": ((1, 512), "float32", None),
                                                          "state": ((2, 1, 128), "float32", 0.0), "sr": ((), "int64", 16000)}),
    "magika": ("magika", "models/standard_v3_3/model.onnx", {"bytes": ((1, 2048), "int32", None)}),
}


def real_models() -> dict:
    """{name: (path, feeds)} for the REAL models whose package is installed (found, not imported)."""
    import numpy as np
    found = {}
    for name, (package, inner, inputs) in REAL.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / inner
        if not path.exists():
            continue
        rng = np.random.default_rng(0)
        feeds = {}
        for k, (shape, dtype, value) in inputs.items():
            if value is not None:
                feeds[k] = np.full(shape, value, dtype)
            elif dtype == "int32":
                feeds[k] = rng.integers(0, 256, shape).astype(dtype)
            else:
                feeds[k] = (rng.standard_normal(shape) * 0.5 + 0.5).astype(dtype)
        found[name] = (path, feeds)
    return found
