"""The CUDA backend: torch tensors for device memory, our Triton kernels where fusion or quantization
matters (attention, quantized matmul/gather, norms, RoPE, KV writes, generated elementwise regions),
torch ops for the rest, and the whole run captured as one CUDA graph once it repeats.

The folder follows the pipeline: device.py (dtypes, copies, each constant's one device copy),
lowerings.py (the table by op), fused_lowerings.py (FUSED ops by kind: what the compiler's device
passes fused, ingot/passes/fuse_*.py), plan.py (the step list, graph capture and replay), and one
file per kernel family (attention, quantized_matmul, fused, fft, flash_sm90, pdl, experts). An op with no
device lowering runs its NumPy reference on host copies, with a warning: such a plan is not captured
as a graph.

    >>> exe = g.compile(feeds=..., targets=[y], device="cuda")       # doctest: +SKIP
    >>> exe.run({"x": np.ones(4, np.float32)})[0]                    # a torch tensor on the GPU  # doctest: +SKIP

Environment: INGOT_CUDA_DEVICE=cpu runs the same code on the CPU under TRITON_INTERPRET=1 (kernel
tests without a GPU).
"""
from __future__ import annotations

import numpy as np
import torch
import triton  # noqa: F401  (an ImportError here tells get_backend that the extra is missing)

from ... import dtypes as dt
from ...errors import IngotError
from ...ir import Program, TensorType
from ...passes.gemv_rules import identity_slice  # noqa: F401  (tests name it here)
from .device import (_DEVICE_CONSTANTS, TORCH_DTYPE, constant_tensor, device_name, prepared_weight,  # noqa: F401
                     to_device, to_host, torch_dtype)
from .lowerings import LOWERINGS, Lowering, StepFn, host_reference, lowering  # noqa: F401
from . import fft  # noqa: E402,F401  (registers the FFT lowerings and the fused STFT power -> mel chain)
from . import collectives  # noqa: E402,F401  (registers all_reduce/all_gather: NCCL through torch.distributed)
from . import experts  # noqa: E402,F401  (registers the mixture-of-experts lowerings: top_k, quantized_gather_matmul, ...)
from . import recurrent  # noqa: E402,F401  (registers the lstm lowering)
from . import pool_attention  # noqa: E402,F401  (registers pool_attention: a rows decoder's KV pool, ops/pool.py)
from . import gathered_lora  # noqa: E402,F401  (registers the fused gathered_lora: ingot serve's per-row adapters)
from .plan import CudaPlan


class CudaBackend:
    name = "cuda"

    def __init__(self):
        self.device = torch.device(device_name())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise IngotError("device 'cuda': torch sees no CUDA GPU on this machine.")

    def prepare(self, program: Program, executable) -> CudaPlan:
        return CudaPlan(program, executable, self.device, getattr(executable, "options", None))

    def new_state(self, program: Program) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in program.variables.items():
            if not v.any():  # KV caches: zeros made on the device, nothing copied
                out[k] = torch.zeros(v.shape, dtype=torch_dtype(dt.from_numpy(v.dtype)), device=self.device)
            else:
                out[k] = to_device(v, self.device)
        return out

    def to_host(self, value) -> np.ndarray:
        return to_host(value)

    def from_host(self, value, t: TensorType):
        """Numpy feeds pass through (the plan stages them); device arrays of any DLPack library are
        taken zero-copy, as torch tensors."""
        if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
            return value
        tensor = value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
        want = tuple(dt.storage_shape(t.shape, t.dtype)) if t.shape else ()
        if tensor.dtype != torch_dtype(t.dtype) or tuple(tensor.shape) != want:
            raise IngotError(f"run: a device feed has {tensor.dtype}{list(tensor.shape)}, expected {t}.")
        return tensor


__all__ = ["CudaBackend", "CudaPlan", "LOWERINGS", "to_host", "to_device", "torch_dtype"]
