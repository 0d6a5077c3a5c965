"""Ingot: a graph compiler and runtime for fast ML inference on CPUs and NVIDIA GPUs."""
from .dtypes import (DType, bfloat16, bool_, complex64, float16, float32, int4, int8, int32, int64,  # noqa: F401
                     uint4, uint8)
from .errors import IngotError  # noqa: F401
from .graph import Graph, Tensor  # noqa: F401
from .ir import TensorType  # noqa: F401
from .options import CompileOptions  # noqa: F401
from .runtime import Executable, Outputs, State  # noqa: F401

__version__ = "0.1.0"


def load(path, device: str | None = None, options=None) -> Executable:
    """Load a package written by Executable.save (ingot.runtime.load: weights memory-mapped; options: a
    CompileOptions instead of the stored ones). A tied LLM head's embedding lookup, which an LLM package
    stores once at the head's adapter, is bound from it (ingot.adapters.bind_lookups), and rebuilt when
    the head is re-bound (rebind_lookup)."""
    from .adapters import bind_lookups, rebind_lookup
    from .runtime import load as _load

    exe = _load(path, device, options)
    try:
        bind_lookups(exe)
    except IngotError as e:
        raise IngotError(f"package: {path} cannot be loaded: {e}") from None
    exe.bind_hooks.append(rebind_lookup)   # a head re-bound later takes its lookup along
    return exe


def from_onnx(model_or_path, device: str = "cpu", input_shapes=None, constant_inputs=None, quantize=None, options=None):
    """Import an ONNX model (a path or an onnx.ModelProto) and compile it with `options` (a CompileOptions;
    None: the defaults); see ingot.importers.onnx.from_onnx."""
    from .importers.onnx import from_onnx as _from_onnx
    return _from_onnx(model_or_path, device=device, input_shapes=input_shapes, constant_inputs=constant_inputs,
                      quantize=quantize, options=options)
