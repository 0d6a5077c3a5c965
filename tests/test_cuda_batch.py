"""Batched lockstep decode on the CUDA backend against the CPU backend (marker `cuda`).

B = 1, 4 and 16 sequences through `llama.build(batch=B)`: prefill, then greedy decode steps, with
float32 weights and with uint4 weights in blocks of 32 (so decode runs the <=4-row word-layout GEMV at
B <= 4 and the tensor-core kernel at B = 16 and in prefill). Skips cleanly without torch, triton or a
GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under Triton's interpreter (slow: tiny shapes).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()

from ingot.backends.cuda import attention as attention_kernels  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402

PROMPT, STEPS = 3, 3


def _config() -> llama.LlamaConfig:
    # test_cuda.py's small decoder, one layer: GQA 6/2 heads of 16, FFN and vocab not powers of two
    return llama.LlamaConfig(n_layers=1, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                             context_length=32, tied_embeddings=True)


def _weights(kind: str, cfg: llama.LlamaConfig) -> dict:
    if kind == "f32":
        return llama.random_weights(cfg, seed=3, matrix=lambda rng, rows, cols: (
            rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32))
    return llama.random_weights(cfg, seed=3)   # uint4, blocks of 32, scale and bias: quantized_matmul


def _greedy(model: llama.LlamaGraph, device: str, prompts: np.ndarray, forced: list[np.ndarray] | None, options=None):
    """Logits after prefill and after each decode step; the next tokens are `forced` when given (the
    CPU's choices, so a near tie cannot make the two runs diverge), else the argmax."""
    pre, dec = model.compile(PROMPT, device, options), model.compile(1, device, options)
    state = dec.new_state()
    host = dec.backend.to_host
    logits = host(pre.run({"tokens": prompts.reshape(-1), "pos": np.int32(0), "last": np.int32(PROMPT - 1)}, state=state)[0])
    seen, chosen = [logits], []
    for i in range(STEPS):
        chosen.append(np.argmax(seen[-1], axis=-1).astype(np.int32))
        tokens = forced[i] if forced is not None else chosen[-1]
        seen.append(host(dec.run({"tokens": tokens, "pos": np.int32(PROMPT + i), "last": np.int32(0)}, state=state)[0]))
    return seen, chosen


class _Rows:
    """Records the row counts the quantized matmul kernels are launched with (eager runs; a replayed
    CUDA graph calls no Python)."""

    def __init__(self, monkeypatch):
        self.words, self.tensor_core = set(), set()
        words, gemm = qmm._words_gemv, qmm.dispatch._qgemm_kernel

        def counted_words(x2, *args, **kwargs):
            self.words.add(x2.shape[0])
            return words(x2, *args, **kwargs)

        class CountedGemm:
            def __getitem__(_, grid):
                def launch(x2, *args, **kwargs):
                    self.tensor_core.add(args[5])   # m: after x2 come q, scale, bias, lut, y
                    return gemm[grid](x2, *args, **kwargs)
                return launch
        monkeypatch.setattr(qmm, "_words_gemv", counted_words)        # the plan's own calls
        monkeypatch.setattr(qmm.gemv, "_words_gemv", counted_words)   # quantized_matmul's
        monkeypatch.setattr(qmm.dispatch, "_qgemm_kernel", CountedGemm())


@pytest.mark.parametrize("kind", ["f32", "uint4"])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batched_greedy_decode_equals_the_cpu_backend(batch, kind, monkeypatch):
    cfg = _config()
    model = llama.build(cfg, _weights(kind, cfg), batch=batch)
    prompts = np.random.default_rng(batch).integers(0, cfg.vocab_size, (batch, PROMPT)).astype(np.int32)
    cpu_logits, cpu_tokens = _greedy(model, "cpu", prompts, None)
    rows = _Rows(monkeypatch)
    early, attention = [], attention_kernels.attention
    monkeypatch.setattr(attention_kernels, "attention", lambda *a, **k: early.append(k.get("early")) or attention(*a, **k))
    gpu_logits, gpu_tokens = _greedy(model, "cuda", prompts, cpu_tokens)
    # the fused attention reads the caches, the position and the RoPE table before its wait: the caches are
    # variables only it writes, the position a feed
    assert early and all(early), early
    # decode: the rope and the KV write run inside the decode attention kernel (one query row)
    fusions = model.compile(1, "cuda").plan.fusions
    assert "rope q + rope k + v write into the caches + attention" in fusions
    # quantized: the attention stores its output rounded for the o projection's GEMV
    assert ("attention output rounded for the quantized matmul after it" in fusions) == (kind == "uint4"), fusions
    # the decode kernel adds the 1 to the position for its length: no launch adds them
    plan = model.compile(1, "cuda").plan
    assert "the decode kernel adds 1 to the position for its length" in fusions
    if kind == "uint4" and batch <= qmm.WORDS_MAX_ROWS:   # the last sum reaches the lm_head's norm GEMV through
        # row `last` (a whole-axis slice)
        launches = [name for name in plan.step_names if name not in ("slice", "reshape", "transpose")]   # views after it
        assert launches[-1] == "add_rms_norm_gemv" and "add" not in launches, plan.step_names
    if kind == "uint4":   # B rows (decode), B * PROMPT (prefill): the word-layout GEMV up to words_max_rows, the
        # tensor-core kernel above, and from prefill_dequant_rows a dequantized copy through cuBLAS (neither)
        opts = CudaOptions()
        for m in (batch, batch * PROMPT):
            if m <= opts.words_max_rows:
                assert m in rows.words, (m, rows.words)
            elif m >= opts.prefill_dequant_rows:
                assert m not in rows.words | rows.tensor_core, (m, rows.words, rows.tensor_core)
            else:
                assert m in rows.tensor_core, (m, rows.tensor_core)
    assert gpu_logits[0].shape == (batch, cfg.vocab_size)
    for step, (got, want) in enumerate(zip(gpu_logits, cpu_logits)):
        # 1e-4, not 1e-5: the GPU sums the K=96/160 reductions in another order (as test_cuda.py's decode test)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    assert [t.tolist() for t in gpu_tokens] == [t.tolist() for t in cpu_tokens]


ROUNDED_BY_ATTENTION = "attention output rounded for the quantized matmul after it"
ZEROED_BY_ATTENTION = "attention zeroes the output of the quantized matmul after it, which rounds its own x"


@pytest.mark.parametrize("self_xq", [True, False], ids=["self-xq", "self-xq-off"])
@pytest.mark.parametrize("limit", [0, 1, None], ids=["off", "below-every-weight", "default"])
def test_attention_rounds_for_the_o_gemv_below_the_weight_threshold(limit, self_xq):
    """The attention rounds its output for the o projection's GEMV where the o weight is under
    options.cuda.attention_xq_bytes (0: never); above it, where the GEMV rounds its own x (weights under
    self_xq_bytes), it zeroes the GEMV's output; the decode step computes the same logits every way."""
    cfg = _config()
    model = llama.build(cfg, _weights("uint4", cfg), batch=1)
    prompts = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, PROMPT)).astype(np.int32)
    want_logits, tokens = _greedy(model, "cpu", prompts, None)
    cuda = CudaOptions(self_xq_bytes=4 << 20 if self_xq else 0)
    if limit is not None:
        cuda = dataclasses.replace(cuda, attention_xq_bytes=limit)
    options = CompileOptions(cuda=cuda)
    fusions = model.compile(1, "cuda", options).plan.fusions
    assert (ROUNDED_BY_ATTENTION in fusions) == (limit is None), (limit, fusions)
    assert (ZEROED_BY_ATTENTION in fusions) == (limit is not None and self_xq), (limit, fusions)
    got_logits, _ = _greedy(model, "cuda", prompts, tokens, options)
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


@pytest.mark.parametrize("self_xq", [True, False], ids=["self-xq", "self-xq-off"])
def test_decode_gemvs_round_their_own_x(self_xq, monkeypatch):
    """Weights under options.cuda.self_xq_bytes: the gate+up GEMV zeroes the down GEMV's output and the down GEMV
    rounds silu(gate) * up itself; every norm GEMV (layer 0's qkv after the embedding lookup, which
    zeroes it) gets its output zeroed by the step before and rounds its own x; so does o where the
    attention cannot round its x (head dim 16 here: the attention rounds only multiples of 32), the
    attention zeroing its output. A decode step then runs no quantize launch. Switched off, all of them
    run. The logits equal the CPU backend's either way."""
    cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=256, vocab_size=300,
                            context_length=32, tied_embeddings=True)
    model = llama.build(cfg, _weights("uint4", cfg), batch=1)
    prompts = np.random.default_rng(11).integers(0, cfg.vocab_size, (1, PROMPT)).astype(np.int32)
    want_logits, tokens = _greedy(model, "cpu", prompts, None)
    options = CompileOptions(cuda=CudaOptions(self_xq_bytes=4 << 20 if self_xq else 0))
    fusions = model.compile(1, "cuda", options).plan.fusions
    down = fusions.count("the gate+up GEMV zeroes the down GEMV's output, which rounds silu*mul itself")
    zeroed = fusions.count("the GEMV rounds its own x, its output zeroed by the step before")
    assert (down, zeroed) == ((cfg.n_layers, 2 * cfg.n_layers + 1) if self_xq else (0, 0)), fusions
    launches = []   # per quantize launch: rows, and whether it computes silu(gate) * up (eager runs only:
    quantize = qmm._quantize_x   # a replayed graph calls no Python)
    counted = (lambda x2, x_gate, *a, **k: launches.append((x2.shape[0], x_gate is not None)) or quantize(x2, x_gate, *a, **k))
    monkeypatch.setattr(qmm, "_quantize_x", counted)      # the plan's own calls
    monkeypatch.setattr(qmm.xq, "_quantize_x", counted)   # the GEMV's
    got_logits, _ = _greedy(model, "cuda", prompts, tokens, options)
    decode = [glu for rows, glu in launches if rows == 1]   # prefill: PROMPT rows
    if self_xq:   # a decode step: none (prefill's rows take the tensor-core kernel, no quantize launch)
        assert not any(glu for _, glu in launches) and not decode, launches
    else:
        assert any(glu for _, glu in launches) and len(decode) >= 4 * cfg.n_layers, launches
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


@pytest.mark.skipif(_INTERPRET, reason="Triton's interpreter computes bf16 dots wrongly")
def test_bf16_batch_steps_past_gemv_rows_take_the_word_gemm(monkeypatch):
    """With prefill_precision "bf16", a decode step of more than CudaOptions.gemv_rows rows (12 > 8) runs
    its projections in the word GEMM (bf16 dots), not the word GEMV, and folds no norm or GLU into a
    GEMV; its logits stay within 1e-2 (relative, L2) of the float32-level path's."""
    cfg, batch = _config(), 12
    model = llama.build(cfg, _weights("uint4", cfg), batch=batch)
    bf16 = CompileOptions(cuda=CudaOptions(prefill_precision="bf16"))
    assert bf16.cuda.gemv_rows == 8 < batch <= CompileOptions().cuda.gemv_rows
    prompts = np.random.default_rng(5).integers(0, cfg.vocab_size, (batch, PROMPT)).astype(np.int32)
    want, chosen = _greedy(model, "cuda", prompts, None)
    gemm_rows, words_gemm = [], qmm.dispatch._words_gemm
    monkeypatch.setattr(qmm.dispatch, "_words_gemm", lambda x2, *a, **k: gemm_rows.append(x2.shape[0]) or
                        words_gemm(x2, *a, **k))
    rows = _Rows(monkeypatch)
    got, _ = _greedy(model, "cuda", prompts, chosen, bf16)
    assert batch in gemm_rows and batch not in rows.words, (gemm_rows, rows.words)
    fusions = model.compile(1, "cuda", bf16).plan.fusions   # nothing folded into or rounded for a GEMV
    assert not any("GEMV" in f or "for the quantized matmul" in f for f in fusions), fusions
    for step, (a, b) in enumerate(zip(got[1:], want[1:])):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, step
