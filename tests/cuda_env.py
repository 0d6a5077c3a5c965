"""The header of every cuda-marked test file: skip the module unless torch, triton and a CUDA GPU
are there, or `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` asks for Triton's interpreter on the CPU
(slow; for developing without a GPU). CI has neither and skips these files cleanly."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
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


def greedy(model, device, prompt, steps, forced=None, options=None):
    """A Llama graph's greedy decode on `device`: (tokens, logits after the prompt and each step, the
    decode executable). `forced` feeds those tokens instead (the same inputs on both backends)."""
    pre, dec = model.compile(len(prompt), device, options), model.compile(1, device, options)
    state = dec.new_state()
    host = dec.backend.to_host
    logits = host(pre.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)},
                          state=state)[0])
    tokens, all_logits = [], [logits]
    for i in range(steps):
        tokens.append(int(np.argmax(logits)) if forced is None else forced[i])
        logits = host(dec.run({"tokens": np.array([tokens[-1]], np.int32), "pos": np.int32(len(prompt) + i),
                               "last": np.int32(0)}, state=state)[0])
        all_logits.append(logits)
    return tokens, all_logits, dec
