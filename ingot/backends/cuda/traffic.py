"""The device bytes one step of a compiled CUDA executable reads: the weights behind the "of copy"
figures of `python -m benchmarks cuda-llm` (bytes over time, against the device-to-device copy
bandwidth), and what tests/test_cuda_bench_bytes.py checks them against."""
from __future__ import annotations

import torch

from ...ir import Op
from . import quantized_matmul as qmm
from .device import _DEVICE_CONSTANTS   # the backend's device copies of constants, keyed by the host array's id first


def weight_bytes(exe=None) -> int:
    """Bytes of the device weights one step of `exe` reads: the re-packed quantized weights and float
    constants made from its program's constants. A gather's table is read one row a token, so its own
    device copy is left out (an untied model's embedding, 328 MB at Llama-3-8B int4; a tied model's
    k-major copy beside the lm_head's word layout); the rows it reads are a few KB. exe None: every
    device constant made so far."""
    used, gathered, other = None, set(), set()
    if exe is not None:
        program = exe.plan.program
        for node in program.nodes():
            table = node.src[:-1] if node.op in (Op.GATHER, Op.QUANTIZED_GATHER) else ()
            for src in node.src:
                if src.op == Op.CONSTANT:
                    (gathered if any(src is t for t in table) else other).add(id(program.constants[src.attrs["key"]]))
        used = gathered | other
    total = 0
    for key, v in _DEVICE_CONSTANTS.items():
        if used is not None:
            if key[0] not in used:
                continue
            if key[0] in gathered and (key[0] not in other or (isinstance(v, qmm.QuantizedWeight) and not v.words)):
                continue   # the gather's own copy: a table only gathered, or the k-major copy of a tied one
        if isinstance(v, qmm.QuantizedWeight):
            total += v.nbytes
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def device_weights() -> list:
    """Every device copy of a constant made so far (torch tensors and qmm.QuantizedWeights)."""
    return list(_DEVICE_CONSTANTS.values())


def free_device() -> None:
    """Drop every cached device copy of a constant and return the memory to the driver."""
    _DEVICE_CONSTANTS.clear()
    torch.cuda.empty_cache()
