"""`CudaOptions.prefill_precision="bf16"`: the prefill's GEMM and flash attention round their float32
operands to bfloat16 in registers and sum in float32 (marker `cuda`); flash attention and a Llama prefill
under "f16" too (float16 operands: within 2e-3 and 3x closer than bf16; its GEMMs:
test_cuda_prefill_f16.py).

Against float64 references on awkward shapes (rows, K and N off the tiles; query and key counts off
the blocks; GQA; a cache longer than the chunk), and a Llama graph's prefill logits and greedy ids
against the default tf32x3 prefill. Tolerance: bf16 operands carry a relative error of 2^-9 each;
over K random-sign products that leaves about 1e-3 relative (L2), bounded at 1e-2 (STYLE.md's bf16
tolerance). Triton's interpreter multiplies bf16 tiles wrongly (a tl.dot of two bf16 tiles returns
garbage there, checked 2026-12-05), so this file needs a GPU.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import greedy, require_cuda  # noqa: E402

if require_cuda():
    pytest.skip("Triton's interpreter computes bf16 dots wrongly; needs a GPU", allow_module_level=True)
import torch  # noqa: E402

import ingot  # noqa: E402
from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.quantized_matmul.weights import dequantize  # noqa: E402
from ingot.models import llama  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402

RNG = np.random.default_rng()
SEED = int(RNG.integers(1 << 31))
print(f"test_cuda_prefill_bf16 seed {SEED}")
REL = 1e-2
F16_REL = 2e-3   # float16 operands: 2^-11 each


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("m,k,n,block", [(17, 96, 80, 32), (130, 200, 66, 8), (513, 320, 1030, 32), (40, 4096, 384, 64)])
def test_gemm_bf16_against_float64(words, m, k, n, block):
    rng = np.random.default_rng([SEED, m, k, n])
    q = rng.integers(0, 256, (k, (n + 1) // 2), dtype=np.uint8)
    scale = rng.random((k // block, n), dtype=np.float32) * 0.02
    bias = -rng.random((k // block, n), dtype=np.float32) * 0.02
    w = qmm.prepare_weight(q, [scale, bias], dict(mode="affine", qdtype=dt.uint4, has_bias=True), "cuda", words=words)
    x = torch.randn(m, k, device="cuda")
    want = x.double() @ dequantize(w).double()
    got = qmm.quantized_matmul(x, w, precision="bf16")
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel(got, want) < REL
    exact = qmm.quantized_matmul(x, w)                       # the default stays float32-level
    assert rel(exact, want) < 1e-5


@pytest.mark.parametrize("m,k,n,block,qdtype,bias", [
    (17, 96, 80, 32, "uint4", True),        # one row past the word GEMV, N off the 256-column tile
    (33, 4160, 300, 64, "int4", False),     # signed (the +8 folded into a bias), K past a split's tiles
    (64, 1024, 520, 128, "uint4", False),   # no bias: scale only; the last row tile full
    (48, 224, 1000, 32, "int4", True),      # K of 7 tiles of 32
    (100, 4096, 700, 32, "uint4", True),    # past 64 rows: two row tiles, the second ragged
    (128, 1024, 520, 64, "int4", False),    # the last rows the word GEMM takes
])
def test_words_gemm_against_float64(m, k, n, block, qdtype, bias):
    """`_qgemm_words_kernel` (bf16 dots over a word-layout weight, 9-128 rows): float32 and bfloat16 x,
    the K splits its config picks and forced ones (1: a plain store; 7: float32 atomics, a split ending
    inside K's last tile), against the dequantized weight in float64."""
    from ingot.backends.cuda.quantized_matmul import dispatch

    rng = np.random.default_rng([SEED, m, k, n])
    q = rng.integers(0, 256, (k, (n + 1) // 2), dtype=np.uint8)
    params = [rng.random((k // block, n), dtype=np.float32) * 0.02]
    if bias:
        params.append(-rng.random((k // block, n), dtype=np.float32) * 0.02)
    w = qmm.prepare_weight(q, params, dict(mode="affine", qdtype=getattr(dt, qdtype), has_bias=bias), "cuda", words=True)
    assert w.words and w.group >= 32
    x = torch.randn(m, k, device="cuda")
    want = x.double() @ dequantize(w).double()
    for x_in in (x, x.bfloat16()):
        got = qmm.quantized_matmul(x_in, w, precision="bf16")
        assert got.dtype == x_in.dtype and got.shape == (m, n)
        assert rel(got, want) < REL, x_in.dtype
    for split in (1, 7):
        y = torch.full((m, n), float("nan"), device="cuda")
        dispatch._words_gemm(x, w, y, {"SPLIT_K": split, "BLOCK_N": 64 if split == 1 else 256})
        assert rel(y, want) < REL, split


@pytest.mark.parametrize("precision,bound", [("bf16", REL), ("f16", F16_REL)])
def test_gemm_follows_the_option(precision, bound):
    rng = np.random.default_rng([SEED, 1])
    q = rng.integers(0, 256, (256, 64), dtype=np.uint8)
    w = qmm.prepare_weight(q, [rng.random((8, 128), dtype=np.float32)], dict(mode="affine", qdtype=dt.uint4), "cuda")
    x = torch.randn(64, 256, device="cuda")
    want = x.double() @ dequantize(w).double()
    by_option = qmm.quantized_matmul(x, w, options=CudaOptions(prefill_precision=precision))
    f32 = qmm.quantized_matmul(x, w, options=CudaOptions(prefill_precision="tf32x3"))
    assert 1e-6 < rel(by_option, want) < bound     # rounded operands: not float32-exact, within the bound
    assert torch.equal(by_option, qmm.quantized_matmul(x, w, precision=precision))
    assert rel(f32, want) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "f16"])
@pytest.mark.parametrize("hq,hk,tq,tk,d,causal", [(2, 2, 77, 77, 64, True), (4, 1, 130, 600, 128, True),
                                                   (8, 2, 200, 260, 80, False), (32, 8, 512, 1536, 128, True),
                                                   (32, 8, 2048, 2600, 128, True)])
def test_flash_16_bit_against_ieee(precision, hq, hk, tq, tk, d, causal):
    q = torch.randn(1, hq, tq, d, device="cuda")
    k = torch.randn(1, hk, tk, d, device="cuda")
    v = torch.randn(1, hk, tk, d, device="cuda")
    want = attn.attention(q, k, v, causal=causal, precision="ieee")
    got = attn.attention(q, k, v, causal=causal, precision=precision)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel(got, want) < REL
    if precision == "f16":   # float16 dots, not a fallback to bf16's
        assert rel(got, want) < F16_REL and rel(got, want) * 3 < rel(attn.attention(q, k, v, causal=causal, precision="bf16"), want)
    by_option = attn.attention(q, k, v, causal=causal, options=CudaOptions(prefill_precision=precision))
    assert torch.equal(by_option, got)


@pytest.mark.parametrize("gluon", [None, True, False])
def test_float32_queries_over_a_bf16_cache(gluon):
    """q float32 (2,048 rows: the Hopper kernel's size by default), k/v a bf16 cache longer than the chunk."""
    q = torch.randn(1, 32, 2048, 128, device="cuda")
    k = torch.randn(1, 8, 3000, 128, device="cuda").bfloat16()
    v = torch.randn(1, 8, 3000, 128, device="cuda").bfloat16()
    want = attn.attention(q, k.float(), v.float(), length=2900, causal=True, precision="ieee")
    got = attn.attention(q, k, v, length=2900, causal=True, precision="bf16", gluon=gluon)
    assert got.dtype == torch.float32 and rel(got, want) < REL
    exact = attn.attention(q, k, v, length=2900, causal=True)      # tf32x3 over the widened cache
    assert rel(exact, want) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_llama_prefill_16_bit_logits_and_ids(precision):
    """A random Llama graph (dims off the tiles): bf16 prefill logits within 1e-2 of tf32x3's (f16: within
    2e-3 and 3x closer than bf16's), and greedy ids after it; prints the top-1 agreement of the decode steps."""
    cfg = llama.LlamaConfig(n_layers=3, dim=192, n_heads=6, n_kv_heads=2, ffn_dim=544, vocab_size=1000,
                            context_length=512, rope_base=10000.0)
    model = llama.build(cfg, llama.random_weights(cfg, seed=SEED % 1000))
    prompt = [int(t) for t in np.random.default_rng(SEED).integers(0, cfg.vocab_size, 300)]
    options = {p: CompileOptions(cuda=CudaOptions(prefill_precision=p)) for p in ("bf16", "f16")}
    ids32, logits32, _ = greedy(model, "cuda", prompt, 8)
    ids16, logits16, _ = greedy(model, "cuda", prompt, 8, forced=ids32, options=options[precision])
    err = rel(torch.as_tensor(logits16[0]), torch.as_tensor(logits32[0]))
    assert err < REL
    if precision == "f16":
        bf16 = greedy(model, "cuda", prompt, 0, options=options["bf16"])[1]
        assert err < F16_REL and err * 3 < rel(torch.as_tensor(bf16[0]), torch.as_tensor(logits32[0]))
    agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(logits16, logits32)])
    print(f"{precision} prefill: logits relative L2 {err:.2e}, top-1 agreement {agree:.2f} over {len(logits32)} positions")
    assert agree >= 0.75
    assert ingot.CompileOptions.from_json(options[precision].to_json()).cuda.prefill_precision == precision   # kept in packages


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_llama_decode_bf16_logits(kv_dtype):
    """CudaOptions.decode_precision="bf16" with the bf16 prefill (the bf16-activation choice): the decode
    attention's q, p and cache tiles rounded to bfloat16, one product each. Every step's logits within
    1e-2 of the float32 path's on the same cache dtype (teacher-forced), over several key tiles; prints
    the top-1 agreement."""
    cfg = llama.LlamaConfig(n_layers=3, dim=256, n_heads=8, n_kv_heads=2, ffn_dim=512, vocab_size=1000,
                            context_length=512, rope_base=10000.0, kv_dtype=kv_dtype)
    model = llama.build(cfg, llama.random_weights(cfg, seed=SEED % 1000 + 1))
    prompt = [int(t) for t in np.random.default_rng(SEED + 1).integers(0, cfg.vocab_size, 200)]
    ids32, logits32, _ = greedy(model, "cuda", prompt, 12)
    bf16 = CompileOptions(cuda=CudaOptions(prefill_precision="bf16", decode_precision="bf16"))
    _, logits16, _ = greedy(model, "cuda", prompt, 12, forced=ids32, options=bf16)
    errors = [rel(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(logits16[1:], logits32[1:])]
    agree = np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(logits16[1:], logits32[1:])])
    print(f"bf16 decode, {kv_dtype} cache: logits relative error <= {max(errors):.1e}, top-1 agreement {agree:.2f}")
    assert max(errors) < REL, errors
    assert ingot.CompileOptions.from_json(bf16.to_json()).cuda.decode_precision == "bf16"   # kept in packages
