"""A bfloat16 / float16 KV cache under float32 q on the CUDA backend (marker `cuda`): the decode kernel
widens each K/V tile after its load, writes the new rows rounded (RoPE fused in or not), the prefill
path widens the cache for the flash kernel; a decoder built with kv_dtype against the CPU backend's.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_kv_dtype.py
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import greedy, require_cuda  # noqa: E402

INTERPRET = require_cuda()
import torch  # noqa: E402

from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.ops import nn as nn_ops  # noqa: E402

from test_cuda_decode_attention import rotate  # noqa: E402

DEVICE = torch.device(cuda_backend.device_name())
KV = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _cache(rng, shape, kind, length):
    """A cache of `kind` (device) and its values widened (host); rows at or past `length` NaN."""
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(KV[kind])
    x[:, :, length:] = float("nan")
    return x.to(DEVICE), x.float().numpy()


@pytest.mark.parametrize("kind", list(KV))
@pytest.mark.parametrize("b,hq,hk,tq,d,buffer,length", [
    (1, 9, 3, 1, 64, 200, 71),        # SmolLM2's heads, decode
    (2, 8, 2, 3, 128, 300, 260),      # GQA 4, three query rows, several splits
    (1, 4, 2, 70, 80, 160, 150),      # prefill (the flash kernel over the widened cache), d 80
])
def test_attention_reads_a_narrow_cache_under_float32_q(kind, b, hq, hk, tq, d, buffer, length):
    rng = np.random.default_rng(hq * 100 + tq)
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    k_dev, k = _cache(rng, (b, hk, buffer, d), kind, length)
    v_dev, v = _cache(rng, (b, hk, buffer, d), kind, length)
    for ln in (length, torch.tensor(length, dtype=torch.int32, device=DEVICE)):
        got = attn.attention(torch.from_numpy(q).to(DEVICE), k_dev, v_dev, length=ln, causal=True)
        assert got.dtype == torch.float32
        want = nn_ops.sdpa(q, k, v, length=length, causal=True)
        np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", list(KV))
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "reread"])
def test_decode_with_rope_rounds_the_new_rows_into_a_narrow_cache(kind, fresh):
    """attention(..., rope=) with float32 q, k, v rows and a 16-bit cache: the rotated k and v stored
    rounded to the cache's dtype, the attention over the cache as written (from registers when fresh:
    the new key as stored, so later steps read what this one used)."""
    b, hq, hk, d, half, buffer, pos = 1, 8, 2, 64, 32, 120, 50
    rng = np.random.default_rng(7)
    k_dev, k = _cache(rng, (b, hk, buffer, d), kind, pos + 1)
    v_dev, v = _cache(rng, (b, hk, buffer, d), kind, pos + 1)
    k_dev[:, :, pos] = float("nan")   # written by the launch before anything may read it
    v_dev[:, :, pos] = float("nan")
    q_raw, kn, vn = (rng.standard_normal((b, n, 1, d)).astype(np.float32) for n in (hq, hk, hk))
    q_rot, inv = rotate(q_raw, pos, half, False)
    k[:, :, pos] = torch.from_numpy(rotate(kn[:, :, 0], pos, half, False)[0]).to(KV[kind]).float().numpy()
    v[:, :, pos] = torch.from_numpy(vn[:, :, 0]).to(KV[kind]).float().numpy()
    rope = attn.RopeWrite(torch.tensor(pos, dtype=torch.int32, device=DEVICE), torch.from_numpy(inv).to(DEVICE),
                          torch.from_numpy(kn).to(DEVICE), torch.from_numpy(vn).to(DEVICE), False,
                          attn.rope_table(inv, buffer, DEVICE))
    got = attn.attention(torch.from_numpy(q_raw).to(DEVICE), k_dev, v_dev, length=torch.tensor(pos, device=DEVICE),
                         length_offset=1, causal=True, rope=rope, fresh=fresh, early=fresh)
    assert k_dev.dtype == KV[kind]
    # rounded to nearest even as torch rounds (Triton's interpreter truncates to bfloat16: one unit in the last place)
    ulp = 2.0 ** -7 if INTERPRET and kind == "bfloat16" else 0.0
    np.testing.assert_allclose(k_dev.float().cpu().numpy()[:, :, :pos + 1], k[:, :, :pos + 1], rtol=ulp, atol=0)
    np.testing.assert_allclose(v_dev.float().cpu().numpy()[:, :, :pos + 1], v[:, :, :pos + 1], rtol=ulp, atol=0)
    if ulp:   # attend over what the kernel stored
        k[:, :, pos], v[:, :, pos] = (x.float().cpu().numpy()[:, :, pos] for x in (k_dev, v_dev))
    want = nn_ops.sdpa(q_rot, k, v, length=pos + 1, causal=True)
    np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", list(KV))
def test_decoder_with_a_narrow_kv_cache_equals_the_cpu_backend(kind):
    """A small Llama built with kv_dtype: prefill (rope_qkv_write + the flash kernel), then the fused
    decode attention, on both backends; the GPU's caches of that dtype, half the float32 bytes."""
    cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=96, tied_embeddings=True, kv_dtype=kind)
    model = llama.build(cfg, llama.random_weights(cfg))
    prompt = [5, 17, 250, 3, 99, 42, 7] * 4   # G * Tq = 84 > 64: the flash kernel
    cpu_tokens, cpu_logits, _ = greedy(model, "cpu", prompt, 8)
    gpu_tokens, gpu_logits, dec = greedy(model, "cuda", prompt, 8, forced=cpu_tokens)
    tol = 1e-2 if INTERPRET and kind == "bfloat16" else 1e-3   # the interpreter truncates to bfloat16
    for a, b in zip(gpu_logits, cpu_logits):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    state = dec.new_state()
    cache = state.values["blk.0.k_cache"]
    assert cache.dtype == KV[kind] and cache.element_size() == 2
    wide = llama.build(dataclasses.replace(cfg, kv_dtype="float32"), llama.random_weights(cfg))
    _, wide_logits, _ = greedy(wide, "cuda", prompt, 8, forced=cpu_tokens)
    worst = max(float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(wide_logits, gpu_logits))
    assert worst < 1e-2, worst


@pytest.mark.skipif(INTERPRET, reason="Triton's interpreter returns garbage for a tl.dot of two bf16 tiles")
def test_prefill_with_bf16_dots_reads_a_bfloat16_cache_as_it_is():
    """prefill_precision "bf16" rounds q and p to bfloat16 in registers: a bfloat16 cache goes in unwidened."""
    from ingot.options import CudaOptions

    rng = np.random.default_rng(3)
    b, hq, hk, tq, d, buffer, length = 1, 8, 2, 200, 128, 512, 450
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    k_dev, k = _cache(rng, (b, hk, buffer, d), "bfloat16", length)
    v_dev, v = _cache(rng, (b, hk, buffer, d), "bfloat16", length)
    got = attn.attention(torch.from_numpy(q).to(DEVICE), k_dev, v_dev, length=torch.tensor(length, device=DEVICE),
                         causal=True, options=CudaOptions(prefill_precision="bf16"))
    want = nn_ops.sdpa(q, k, v, length=length, causal=True)
    got = cuda_backend.to_host(got)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
