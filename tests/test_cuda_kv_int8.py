"""An int8 KV cache on the CUDA backend (marker `cuda`): the decode (split-KV) and flash kernels read the
codes and their row scales tile by tile, the pool kernels quantize the new rows as ops.nn.quantized_rows
does and read them back; a decoder built with kv_dtype="int8" against the CPU backend's.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_kv_int8.py
"""
from __future__ import annotations

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
from ingot.backends.cuda.pool_attention import pool_attention as pool_kernels  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.ops import nn as nn_ops  # noqa: E402
from ingot.ops.pool import pool_attention as pool_reference  # noqa: E402

DEVICE = torch.device(cuda_backend.device_name())


def _codes(rng, shape, length=None):
    """An int8 cache as quantized_rows stores rows of varied magnitudes (every fifth a row of zeros);
    (codes, scales) on the device and on the host. Rows at or past `length` hold codes 127 and NaN scales."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.05, 2.0, shape[:-1] + (1,)).astype(np.float32)
    x[..., ::5, :] = 0
    codes, scales = nn_ops.quantized_rows(x)
    dev_codes, dev_scales = torch.from_numpy(codes.copy()), torch.from_numpy(scales.copy())
    if length is not None:
        dev_codes[..., length:, :] = 127
        dev_scales[..., length:, :] = float("nan")
    return dev_codes.to(DEVICE), dev_scales.to(DEVICE), codes, scales


@pytest.mark.parametrize("b,hq,hk,tq,d,buffer,length", [
    (1, 9, 3, 1, 64, 200, 1),         # SmolLM2's heads, decode, one key
    (1, 9, 3, 1, 64, 200, 71),        # several key tiles
    (2, 8, 2, 3, 128, 300, 299),      # GQA 4, three query rows, several splits, context - 1
    (1, 4, 4, 1, 80, 40, 17),         # d 80 (padded tiles), no GQA
    (1, 4, 2, 70, 80, 160, 150),      # prefill (the flash kernel), d 80
    (1, 8, 2, 40, 64, 96, 96),        # prefill over the whole buffer
])
def test_attention_reads_int8_codes_and_row_scales(b, hq, hk, tq, d, buffer, length):
    rng = np.random.default_rng(hq * 100 + tq + d)
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    kc, ks, k, k_scales = _codes(rng, (b, hk, buffer, d), length)
    vc, vs, v, v_scales = _codes(rng, (b, hk, buffer, d), length)
    want = nn_ops.sdpa(q, nn_ops.dequantized_rows(k, k_scales, length), nn_ops.dequantized_rows(v, v_scales, length),
                       causal=True)
    for ln in (length, torch.tensor(length, dtype=torch.int32, device=DEVICE)):
        got = attn.attention(torch.from_numpy(q).to(DEVICE), kc, vc, length=ln, causal=True, scales=(ks, vs))
        np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", [
    # rows, hq, hk, d, slots, context, window, softcap
    (3, 9, 3, 64, 4, 40, 0, 0.0),
    (2, 8, 2, 128, 3, 70, 0, 0.0),
    (2, 4, 4, 80, 2, 33, 5, 0.0),
    (1, 4, 2, 64, 2, 20, 0, 30.0),
])
@pytest.mark.parametrize("split", [1, 3])
def test_pool_kernels_quantize_and_read_an_int8_pool(case, split):
    rows, hq, hk, d, n_slots, context, window, softcap = case
    rng = np.random.default_rng(rows * 10 + d + split)
    kp_dev, ksp_dev, kp, ksp = _codes(rng, (n_slots, hk, context, d))
    vp_dev, vsp_dev, vp, vsp = _codes(rng, (n_slots, hk, context, d))
    q, k, v = (rng.standard_normal((rows, h, d)).astype(np.float32) * 3 for h in (hq, hk, hk))
    slots = np.array([1, 0, n_slots + 3][:rows], np.int32)                 # the last: outside the pool
    positions = np.array([context - 1, 0, 4][:rows], np.int32)
    want = pool_reference(q, k, v, kp, vp, slots, positions, ksp, vsp, window=window, softcap=softcap)
    dev = lambda x: torch.from_numpy(x).to(DEVICE)  # noqa: E731
    got = pool_kernels(dev(q), dev(k), dev(v), kp_dev, vp_dev, dev(slots), dev(positions), window=window,
                       softcap=softcap, split=split, scales=(ksp_dev, vsp_dev))
    for written, expected in zip((kp_dev, vp_dev, ksp_dev, vsp_dev), want[1:]):
        np.testing.assert_array_equal(cuda_backend.to_host(written), expected)   # the codes and scales, bit for bit
    np.testing.assert_allclose(cuda_backend.to_host(got), want[0], rtol=2e-5, atol=2e-5)


def test_decoder_with_an_int8_kv_cache_equals_the_cpu_backend():
    """A small Llama built with kv_dtype="int8": prefill (the flash kernel over the codes), then decode
    (the split-KV kernel), on both backends; the GPU's caches int8 codes and float32 row scales."""
    cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=96, tied_embeddings=True, kv_dtype="int8")
    model = llama.build(cfg, llama.random_weights(cfg))
    prompt = [5, 17, 250, 3, 99, 42, 7] * 4   # G * Tq = 84 > 64: the flash kernel
    cpu_tokens, cpu_logits, _ = greedy(model, "cpu", prompt, 6)
    gpu_tokens, gpu_logits, dec = greedy(model, "cuda", prompt, 6, forced=cpu_tokens)
    for a, b in zip(gpu_logits, cpu_logits):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    state = dec.new_state()
    assert state.values["blk.0.k_cache"].dtype == torch.int8 and state.values["blk.0.k_scale_cache"].dtype == torch.float32
    assert "rope q + rope k + v write into the caches + attention" in dec.plan.fusions   # the int8 write inside


@pytest.mark.parametrize("interleaved", [False, True])
def test_decode_with_rope_quantizes_the_new_rows_into_an_int8_cache(interleaved):
    """attention(..., rope=, scales=): the decode kernel rotates q, writes the rotated k row and the v row
    as their codes and scales (ops.nn.quantized_rows of what the CPU's RoPE gives, codes within one
    step where RoPE's float32 rounding differs) and attends over the cache as written; a prefill chunk
    (rope_qkv_into) likewise."""
    from test_cuda_decode_attention import rotate

    b, hq, hk, d, half, buffer = 1, 8, 2, 64, 32, 120
    rng = np.random.default_rng(11)
    for pos, t in ((50, 1), (30, 5)):
        kc, ks, k, k_scales = _codes(rng, (b, hk, buffer, d))
        vc, vs, v, v_scales = _codes(rng, (b, hk, buffer, d))
        q_raw = rng.standard_normal((b, hq, t, d)).astype(np.float32)
        kn, vn = (rng.standard_normal((b, hk, t, d)).astype(np.float32) * 2 for _ in range(2))
        inv = rotate(q_raw, pos, half, interleaved)[1]
        q_rot, k_rot = (nn_ops.rope(x, np.int32(pos), inv, 10000.0, interleaved, d) for x in (q_raw, kn))
        rope = attn.RopeWrite(torch.tensor(pos, dtype=torch.int32, device=DEVICE), torch.from_numpy(inv).to(DEVICE),
                              torch.from_numpy(kn).to(DEVICE), torch.from_numpy(vn).to(DEVICE), interleaved,
                              attn.rope_table(inv, buffer, DEVICE))
        got = attn.attention(torch.from_numpy(q_raw).to(DEVICE), kc, vc, length=torch.tensor(pos + t - 1, device=DEVICE),
                             length_offset=1, causal=True, rope=rope, scales=(ks, vs))
        codes, scales = nn_ops.quantized_rows(vn)
        host = cuda_backend.to_host
        np.testing.assert_array_equal(host(vc)[:, :, pos:pos + t], codes)
        np.testing.assert_array_equal(host(vs)[:, :, pos:pos + t], scales)
        codes, scales = nn_ops.quantized_rows(k_rot)
        np.testing.assert_allclose(host(kc)[:, :, pos:pos + t], codes, atol=1)
        np.testing.assert_allclose(host(ks)[:, :, pos:pos + t], scales, rtol=1e-6)
        keys = nn_ops.dequantized_rows(host(kc), host(ks), pos + t)
        values = nn_ops.dequantized_rows(host(vc), host(vs), pos + t)
        np.testing.assert_allclose(host(got), nn_ops.sdpa(q_rot, keys, values, causal=True), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(INTERPRET, reason="Triton's interpreter returns garbage for a tl.dot of two bf16 tiles")
def test_prefill_with_bf16_dots_reads_int8_codes():
    """prefill_precision "bf16": the codes (exact in bfloat16) and q, p rounded to bfloat16 in registers."""
    from ingot.options import CudaOptions

    rng = np.random.default_rng(4)
    b, hq, hk, tq, d, buffer, length = 1, 8, 2, 200, 128, 512, 450
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    kc, ks, k, k_scales = _codes(rng, (b, hk, buffer, d), length)
    vc, vs, v, v_scales = _codes(rng, (b, hk, buffer, d), length)
    got = attn.attention(torch.from_numpy(q).to(DEVICE), kc, vc, length=torch.tensor(length, device=DEVICE),
                         causal=True, scales=(ks, vs), options=CudaOptions(prefill_precision="bf16"))
    want = nn_ops.sdpa(q, nn_ops.dequantized_rows(k, k_scales, length), nn_ops.dequantized_rows(v, v_scales, length),
                       causal=True)
    got = cuda_backend.to_host(got)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@pytest.mark.skipif(INTERPRET, reason="Triton's interpreter returns garbage for a tl.dot of two bf16 tiles")
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("length", [2, 70, 2000])   # (an int8 cache's row 0 is zeros: 2 keys at least)
def test_decode_with_bf16_dots(cache, length):
    """decode_precision "bf16" (the bf16-activation choice): q, p and the cache tiles rounded to
    bfloat16, one product each, on every cache dtype; within bfloat16's bar of the float64 reference,
    and the split-KV merge over many splits unchanged."""
    from ingot.options import CudaOptions

    rng = np.random.default_rng(length)
    b, hq, hk, d, buffer = 1, 32, 8, 128, 2048
    q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    if cache == "int8":
        kc, ks, k, k_scales = _codes(rng, (b, hk, buffer, d), length)
        vc, vs, v, v_scales = _codes(rng, (b, hk, buffer, d), length)
        k, v = nn_ops.dequantized_rows(k, k_scales, length), nn_ops.dequantized_rows(v, v_scales, length)
        dev, scales = (kc, vc), (ks, vs)
    else:
        k, v = (rng.standard_normal((b, hk, buffer, d)).astype(np.float32) for _ in range(2))
        dev = tuple(torch.from_numpy(x).to(DEVICE, getattr(torch, cache)) for x in (k, v))
        k, v = (x.float().cpu().numpy()[:, :, :length] for x in dev)
        scales = None
    want = nn_ops.sdpa(q, k[:, :, :length], v[:, :, :length], causal=True)
    for split in (None, 33):
        got = attn.attention(torch.from_numpy(q).to(DEVICE), *dev, length=torch.tensor(length, device=DEVICE),
                             causal=True, scales=scales, split=split, options=CudaOptions(decode_precision="bf16"))
        got = cuda_backend.to_host(got)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, (split, cache)
