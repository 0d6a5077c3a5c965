"""Importers: turn model files made elsewhere into Ingot's formats (GGUF now; ONNX, safetensors later)."""
from .gguf import GGUFModel, read_gguf  # noqa: F401
