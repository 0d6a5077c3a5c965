"""Backends are plug-ins behind a narrow interface: prepare(program, exe) -> plan; plan.run(...)."""
from __future__ import annotations

from ..errors import IngotError


def get_backend(device: str):
    if device == "cpu":
        from .cpu import CpuBackend
        return CpuBackend()
    if device == "cuda":
        try:
            from .cuda import CudaBackend
        except ImportError as e:
            raise IngotError(f"device 'cuda' needs torch and triton (pip install 'ingot[cuda]'): {e}.") from None
        return CudaBackend()
    raise IngotError(f"unknown device {device!r} (have 'cpu', 'cuda').")
