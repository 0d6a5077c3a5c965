"""Device memory for the CUDA backend: dtypes, host <-> device copies, and one device copy of each
host constant (raw, or re-packed for the quantized-matmul kernels), shared by every plan that reads it
(a model's prefill and decode executables share their weights)."""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable

import ml_dtypes
import numpy as np
import torch

from ... import dtypes as dt
from . import quantized_matmul as qmm

if os.environ.get("TRITON_INTERPRET") == "1":  # development without a GPU (see the module docstring)
    from triton.runtime import interpreter as _interpreter
    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        """Program ids have the shape (1,) in the interpreter; numpy 2 refuses int() of those in range()."""
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    _interpreter._patch_lang_tensor = _patch_lang_tensor

TORCH_DTYPE = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
    "uint8": torch.uint8, "int4": torch.uint8, "uint4": torch.uint8, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool, "complex64": torch.complex64,
}


def torch_dtype(d: dt.DType) -> torch.dtype:
    return TORCH_DTYPE[d.name]


def device_name() -> str:
    return os.environ.get("INGOT_CUDA_DEVICE", "cuda")


# -- host <-> device ----------------------------------------------------------------------------------

def to_device(array, device) -> torch.Tensor:
    """A numpy array (bfloat16 from ml_dtypes included) as a device tensor."""
    a = np.asarray(array)
    if a.dtype == ml_dtypes.bfloat16:
        return to_device(a.view(np.int16), device).view(torch.bfloat16)
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only arrays (memory-mapped weights) are only read
        t = torch.from_numpy(a)
    return t.to(device)


def to_host(value) -> np.ndarray:
    """A device tensor as a numpy array (bfloat16 via ml_dtypes); other values pass through."""
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return value.detach().cpu().numpy()


_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _cached(array: np.ndarray, key: tuple, make: Callable[[], Any]):
    """One device copy per host constant (prefill and decode executables share their weights)."""
    full = (id(array),) + key
    hit = _DEVICE_CONSTANTS.get(full)
    if hit is None:
        hit = _DEVICE_CONSTANTS[full] = make()
        weakref.finalize(array, _DEVICE_CONSTANTS.pop, full, None)
    return hit


def constant_tensor(array: np.ndarray, device) -> torch.Tensor:
    return _cached(array, ("tensor", str(device)), lambda: to_device(array, device))


def prepared_weight(arrays: list[np.ndarray], attrs: dict, device, words: bool = False) -> qmm.QuantizedWeight:
    key = ("qweight", str(device), attrs["mode"], attrs["qdtype"].name, bool(attrs.get("transpose")),
           bool(attrs.get("has_zero_point")), bool(attrs.get("has_bias")), words) + tuple(id(a) for a in arrays[1:])
    return _cached(arrays[0], key, lambda: qmm.prepare_weight(arrays[0], list(arrays[1:]), attrs, device, words))


def concatenated_weight(members: list[tuple[list[np.ndarray], dict]], device, words: bool = True) -> qmm.QuantizedWeight | None:
    """The weights of sibling matmuls side by side along N (one GEMV for q/k/v), or None if they differ in kind."""
    key = ("qconcat", str(device), words) + tuple((id(a), attrs["qdtype"].name, bool(attrs.get("transpose")))
                                           for arrays, attrs in members for a in arrays)
    first = members[0][0][0]
    hit = _DEVICE_CONSTANTS.get((id(first),) + key)
    if hit is not None:
        return hit
    joined = qmm.concatenate([qmm.prepare_weight(arrays[0], list(arrays[1:]), attrs, device, words)
                              for arrays, attrs in members])
    if joined is None:
        return None
    return _cached(first, key, lambda: joined)
