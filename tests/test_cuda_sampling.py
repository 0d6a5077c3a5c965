"""DeviceSampler on the GPU and generate's device loop (marker `cuda`).

Skips cleanly without torch, triton or a CUDA GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it
on the CPU through Triton's interpreter (slow; the sync-debug check needs a real GPU).
"""
from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402

from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.llm.generate import LLM  # noqa: E402
from ingot.llm.sampling import DeviceSampler, Sampler  # noqa: E402
from ingot.models import llama  # noqa: E402

DEVICE = torch.device(cuda_backend.device_name())


def _dense(sampler, x):
    ids, probs = sampler.distribution(x)
    out = np.zeros(x.size)
    out[ids] = probs
    return out


@pytest.mark.parametrize("n", [7, 1823, 32000, 128256])
def test_device_sampler_on_the_gpu_matches_numpy(n):
    rng = np.random.default_rng(n)
    for trial in range(6):
        x = (rng.normal(size=n) * (1.5 if trial % 2 else 6)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)  # ties, at the maximum and at the k-th logit
        on_device = torch.from_numpy(x).to(DEVICE)
        assert DeviceSampler()(on_device) == Sampler()(x)
        for case in (dict(temperature=0.8, top_k=40), dict(temperature=1.0, top_p=0.9),
                     dict(temperature=0.6, top_k=200, top_p=0.95), dict(temperature=1.3, top_k=n + 5, top_p=0.5)):
            got = DeviceSampler(**case).distribution_tensor(on_device)
            assert got.device.type == DEVICE.type
            got = got.cpu().numpy()
            want = _dense(Sampler(**case), x)
            assert np.flatnonzero(got).tolist() == np.flatnonzero(want).tolist(), case
            np.testing.assert_allclose(got, want, atol=1e-6)
            s = DeviceSampler(seed=3, **case)
            assert all(want[s(on_device)] > 0 for _ in range(20))  # draws stay in the support


class _Pieces:
    """A stand-in tokenizer: every id is its own non-empty piece, and there is no EOS."""
    eos_ids = frozenset()

    def stream_decoder(self):
        class Stream:
            def push(self, token_id):
                return f"<{token_id}>"

            def flush(self):
                return ""
        return Stream()


@pytest.fixture(scope="module")
def small_llm():
    cfg = llama.LlamaConfig(n_layers=1, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=64, tied_embeddings=True)
    return LLM.from_graph(llama.build(cfg, llama.random_weights(cfg, seed=0)), _Pieces(), device="cuda")


def test_greedy_generate_syncs_once_per_token(small_llm, monkeypatch):
    prompt, steps = [5, 17, 250, 3, 99, 42, 7], 8
    llm = small_llm
    # the reference: numpy logits through prefill/step and the numpy Sampler
    llm.reset()
    logits, want = llm.prefill(prompt), []
    for _ in range(steps):
        want.append(Sampler()(logits))
        logits = llm.step(want[-1])
    list(llm.generate(prompt, max_tokens=steps))  # warm: kernels compiled, the decode graph captured

    items, copies = [], []
    real_item, real_to_host = torch.Tensor.item, cuda_backend.CudaBackend.to_host
    monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(t.device) or real_item(t))
    monkeypatch.setattr(cuda_backend.CudaBackend, "to_host", lambda self, v: copies.append(v) or real_to_host(self, v))
    tokens = llm.generate(prompt, max_tokens=steps)
    first = next(tokens)  # prefill and the first choice
    items.clear()
    sync_debug = not _INTERPRET
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            rest = list(tokens)
        finally:
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
    got = [first.id] + [t.id for t in rest]
    assert got == want == llm.stats.tokens
    assert copies == []  # the logits never came to the host
    assert len(items) == steps - 1 and all(d.type == DEVICE.type for d in items)  # one .item() per decode step
    if sync_debug:
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]  # not the prototype notice
        assert len(syncs) <= steps - 1, [str(w.message) for w in syncs]


def test_sampled_generate_on_the_device_is_seeded(small_llm):
    prompt = [5, 17, 250, 3]
    options = dict(max_tokens=6, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3)
    a = [t.id for t in small_llm.generate(prompt, seed=11, **options)]
    b = [t.id for t in small_llm.generate(prompt, seed=11, **options)]
    assert a == b and len(a) == 6 and all(0 <= i < 300 for i in a)
    # a penalty that forbids repeats in effect: no id comes twice (the history is on the device)
    seen = [t.id for t in small_llm.generate(prompt, max_tokens=10, repetition_penalty=1e30)]
    assert len(set(seen)) == len(seen) and not set(seen) & set(prompt)


def test_load_and_generate_warm_the_executables_before_timing():
    """On a device, loading runs the decoder twice (kernels compiled, its CUDA graph captured) and generate
    runs a prefill length once before its clock starts, so the speeds it reports are the steady ones;
    the warm-up's cache rows are rewritten, so the tokens equal a cold step-by-step reference."""
    cfg = llama.LlamaConfig(n_layers=1, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=64, tied_embeddings=True)
    llm = LLM.from_graph(llama.build(cfg, llama.random_weights(cfg, seed=1)), _Pieces(), device="cuda")
    assert llm._warm == {1} and llm.cached == []
    if llm.decoder.plan.capturable:
        assert len(llm.decoder.plan._graphs) == 1   # captured at load, not in the first timed steps
    prompt = [9, 8, 7, 6, 5]
    got = [t.id for t in llm.generate(prompt, max_tokens=5)]
    assert llm._warm == {1} | llm._chunk_sizes(len(prompt)) and len(llm._warm) == 2
    reference = LLM.from_graph(llm.model, _Pieces(), device="cpu")
    reference.reset()
    logits, want = reference.prefill(prompt), []
    for _ in range(5):
        want.append(int(np.argmax(logits)))
        logits = reference.step(want[-1])
    assert got == want
