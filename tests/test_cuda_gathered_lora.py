"""Per-request LoRA adapters on the CUDA backend (marker `cuda`): the gathered LoRA kernels
(backends/cuda/gathered_lora.py) against the NumPy reference on awkward shapes (ranks 1, 8 and 16
mixed and zero-padded, 1..64 rows, widths not multiples of 16, rows on the base entry, indices
outside the table), each row independent of the others; then `ingot serve --device cuda --lora`'s
engine: the base model and two adapters in one captured rows step, each request's greedy tokens
equal to it alone and to `ingot generate --lora` on the device.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_gathered_lora.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402

from ingot.backends.cuda import device_name  # noqa: E402

DEVICE = torch.device(device_name())


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory):
    from quant_helpers import save_tiny
    from test_serve_adapters import write_adapters

    root = tmp_path_factory.mktemp("cuda_lora")
    save_tiny(root / "tiny.llm")
    return str(root / "tiny.llm"), write_adapters(root)


def test_engine_serves_adapters_per_request_in_one_captured_step(tiny_with_adapters):
    """`ingot serve --device cuda --lora`: base and adapters in one batch, each answer equal to it
    alone and to generate --lora; the rows step has no host sync (one CUDA graph per bucket)."""
    from test_serve_adapters import check_adapter_engine

    engine = check_adapter_engine(*tiny_with_adapters, "cuda", pool=True, kv_dtype="float32")
    for exe, adapter_rows in engine._rows.values():
        assert adapter_rows is not None
        assert not exe.plan.host_syncs, exe.plan.host_syncs
        assert exe.plan.capturable == (not _INTERPRET)
