"""The header of every cuda-marked test file: skip the module unless torch, triton and a CUDA GPU
are there, or `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` asks for Triton's interpreter on the CPU
(slow; for developing without a GPU). CI has neither and skips these files cleanly."""
from __future__ import annotations

import importlib.util
import os

import pytest

INTERPRET = os.environ.get("INGOT_CUDA_DEVICE") == "cpu"


def require_cuda() -> bool:
    """Skip the calling test module when nothing can run the CUDA backend; True under the interpreter."""
    have = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("triton") is not None
    if have and not INTERPRET:
        import torch
        have = torch.cuda.is_available()
    if not have:
        pytest.skip("needs torch, triton and a CUDA GPU (or INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1)",
                    allow_module_level=True)
    return INTERPRET
