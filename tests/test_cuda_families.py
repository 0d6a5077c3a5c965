"""Every decoder family on the CUDA backend (marker `cuda`): the tiny GGUFs of tests/family_models.py
compiled for the GPU give transformers' prefill logits (within 1e-4 relative L2 at every position, as
the CPU does: test_families.py) and its 32 greedy ids, and the decode step of the families without a
sliding window or softcap runs with no host sync (Qwen3-MoE's routing included). Skips cleanly
without torch, triton or a GPU; under `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` it runs (slowly).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

INTERPRET = require_cuda()
pytest.importorskip("gguf")   # family_models writes the files with it

from family_models import FAMILIES, write_family_gguf  # noqa: E402
from ingot import models  # noqa: E402
from ingot.importers.gguf import read_gguf  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "families_reference.npz"
# no sliding window or softcap: every op of their decode step has a device lowering
NO_HOST_SYNC = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3_short", "smollm3", "mistral3", "mistral3_mscale", "qwen3_yarn")


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run(path: Path, prompt: np.ndarray, steps: int, device: str):
    """(prefill logits [T, vocab], `steps` greedy ids, the decode executable) on `device`."""
    model = read_gguf(path)
    cfg = models.config_from_gguf(model)
    cfg.context_length = 64
    everything = models.build(cfg, model.tensors, str(path), all_logits=True).compile(len(prompt), device)
    host = everything.backend.to_host
    logits = host(everything.run({"tokens": prompt, "pos": np.int32(0)})[0])
    graph = models.build(cfg, model.tensors, str(path))
    prefill, decode = graph.compile(len(prompt), device), graph.compile(1, device)
    state = decode.new_state()
    row = host(prefill.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(len(prompt) - 1)}, state=state)[0])
    ids = []
    for i in range(steps):
        ids.append(int(np.argmax(row[0])))
        row = host(decode.run({"tokens": np.array(ids[-1:], np.int32), "pos": np.int32(len(prompt) + i),
                               "last": np.int32(0)}, state=state)[0])
    return logits, ids, decode


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_on_cuda_matches_transformers(name, reference, tmp_path):
    path = tmp_path / f"{name}.gguf"
    write_family_gguf(name, path)
    expected = reference[f"{name}.greedy"].tolist()
    steps = 4 if INTERPRET else len(expected)          # the interpreter is slow: the first ids only
    logits, ids, decode = run(path, reference[f"{name}.prompt"], steps, "cuda")
    want = reference[f"{name}.logits"]
    errors = np.linalg.norm(logits - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert errors.max() < 1e-4, f"{name}: CUDA prefill logits differ from transformers' by {errors.max():.2e} (rel L2)"
    assert ids == expected[:steps]
    if name in NO_HOST_SYNC:
        assert not decode.plan.host_syncs, decode.plan.host_syncs
