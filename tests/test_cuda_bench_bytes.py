"""The bytes a decode step reads, as ingot.backends.cuda.traffic counts them for the "of copy" figures of
`python -m benchmarks cuda-llm` (marker
`cuda`): every weight the step's program multiplies by, once; a gather's table (the token embedding)
not, as a step reads one row of it. Compiles only (no kernel runs), so it is quick under
`INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` too.
"""
from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

require_cuda()
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda import traffic  # noqa: E402
from ingot.models import llama  # noqa: E402


def _matmul_bytes(cfg: llama.LlamaConfig, head: bool) -> int:
    """uint4 in blocks of 32 with f16 scale and bias: 0.5 + 2 * 2 / 32 bytes a weight."""
    hd = cfg.dim // cfg.n_heads
    layer = cfg.dim * (cfg.dim + 2 * cfg.n_kv_heads * hd) + cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    weights = cfg.n_layers * layer + (cfg.dim * cfg.vocab_size if head else 0)
    return weights // 2 + weights // 32 * 4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_step_bytes_leave_out_the_embedding_table(tied):
    cfg = llama.LlamaConfig(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512,
                            context_length=32, tied_embeddings=tied)
    traffic.free_device()
    model = llama.build(cfg, llama.random_weights(cfg, seed=5, k_major=True, f16_params=True), batch=1)
    dec = model.compile(1, "cuda")
    model.compile(3, "cuda")                     # a prefill executable shares the device weights
    norms = (2 * cfg.n_layers + 1) * cfg.dim * 4 + cfg.dim // cfg.n_heads // 2 * 4   # + RoPE's inverse frequencies
    step = traffic.weight_bytes(dec)
    # the lm_head is read whole every step, tied or not; the gather's own copy of the table is not
    assert step == _matmul_bytes(cfg, head=True) + norms, (step, _matmul_bytes(cfg, head=True) + norms)
    table = cfg.vocab_size * cfg.dim // 2 + cfg.vocab_size * cfg.dim // 32 * 4
    everything = traffic.weight_bytes()         # the count before: every device constant
    assert everything - step == table, (everything, step, table)
    words = [v for v in traffic.device_weights() if isinstance(v, qmm.QuantizedWeight)]
    assert sum(not w.words for w in words) == 1   # the gather's k-major table, the only one not in words
