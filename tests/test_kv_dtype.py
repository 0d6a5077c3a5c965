"""A KV cache stored in bfloat16 or float16 (`kv_dtype`): rows rounded as written, widened to float32 as
attention reads them; against the float32 cache and the NumPy references (the CPU backend)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.backends.cpu import nn_kernels
from ingot.errors import IngotError
from ingot.ir import Op
from ingot.models import llama
from ingot.ops import nn as nn_ops

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config, tiny_tensors, tokenizer_metadata  # noqa: E402

BF16 = ml_dtypes.bfloat16


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16)


# -- the IR -------------------------------------------------------------------------------------

def test_slice_update_rounds_a_float32_update_into_a_bfloat16_buffer():
    g = ingot.Graph()
    cache = g.variable(np.zeros((2, 5, 3), BF16), name="cache")
    u = g.placeholder((2, 1, 3), dt.float32, name="u")
    pos = g.placeholder((), dt.int32, name="pos")
    g.assign(cache, g.slice_update(cache, u, [0, pos, 0]))
    exe = g.compile(targets=[])
    state = exe.new_state()
    rows = np.random.default_rng(0).standard_normal((2, 1, 3)).astype(np.float32) * 1e3
    rows[0, 0, 0] = 1 + 2 ** -9   # a tie: rounds to even (1.0)
    exe.run({"u": rows, "pos": np.int32(3)}, state=state)
    got = state.values["cache"]
    assert got.dtype == BF16
    assert np.array_equal(got[:, 3:4].view(np.uint16), bf16(rows).view(np.uint16))
    assert float(got[0, 3, 0]) == 1.0 and not np.any(got[:, [0, 1, 2, 4]].astype(np.float32))


def test_slice_update_still_refuses_an_integer_update_into_a_float_buffer():
    g = ingot.Graph()
    cache = g.variable(np.zeros((4, 3), BF16), name="cache")
    with pytest.raises(IngotError, match="slice_update"):
        g.slice_update(cache, g.placeholder((1, 3), dt.int32, name="u"), [0, 0])


def test_sdpa_takes_a_narrower_kv_and_refuses_k_and_v_of_two_dtypes():
    g = ingot.Graph()
    q = g.placeholder((1, 4, 1, 8), dt.float32, name="q")
    k = g.placeholder((1, 2, 6, 8), dt.bfloat16, name="k")
    v = g.placeholder((1, 2, 6, 8), dt.bfloat16, name="v")
    out = g.scaled_dot_product_attention(q, k, v, causal=True)
    assert out.node.type.dtype == dt.float32
    with pytest.raises(IngotError, match="sdpa|SDPA"):
        g.scaled_dot_product_attention(q, k, g.placeholder((1, 2, 6, 8), dt.float16, name="v16"))


# -- the CPU kernels -----------------------------------------------------------------------------

@pytest.mark.parametrize("hq,hk,tq,d,length,causal,window,softcap", [
    (6, 2, 1, 40, 37, True, 0, 0.0), (3, 3, 4, 24, 9, True, 3, 0.0), (4, 1, 2, 16, 50, False, 0, 30.0)])
def test_attention_kernel_reads_a_bfloat16_cache_as_the_reference(hq, hk, tq, d, length, causal, window, softcap):
    rng = np.random.default_rng(hq * 7 + d)
    q = rng.standard_normal((2, hq, tq, d)).astype(np.float32)
    k = bf16(rng.standard_normal((2, hk, 50, d)))
    v = bf16(rng.standard_normal((2, hk, 50, d)))
    scale = np.float32(1 / np.sqrt(d))
    out = np.empty((2, hq, tq, d), np.float32)
    nn_kernels.attention(q, k.view(np.uint16), v.view(np.uint16), length, scale, causal, window, np.float32(softcap), out)
    want = nn_ops.sdpa(q, k, v, length=length, scale=float(scale), causal=causal, window=window, softcap=softcap)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    if tq <= length:   # the prefill path (BLAS) widens the cache prefix
        blas = nn_kernels.attention_blas(q, k.view(np.uint16), v.view(np.uint16), length, scale, causal, window,
                                         np.float32(softcap))
        np.testing.assert_allclose(blas, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("interleaved,rd", [(True, 16), (False, 12)])
def test_rope_write_attend_rounds_the_new_rows_into_a_bfloat16_cache(interleaved, rd):
    rng = np.random.default_rng(rd)
    b, hq, hk, t, d, ctx, pos = 1, 6, 2, 3, 16, 11, 5
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, t, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, t, d)).astype(np.float32) * 100
    old_k, old_v = bf16(rng.standard_normal((b, hk, ctx, d))), bf16(rng.standard_normal((b, hk, ctx, d)))
    inv = nn_ops.rope_inv_freq(rd, 10000.0)
    scale = np.float32(0.25)
    runs = {}
    for kind in (np.float32, BF16):   # the same kernel on a float32 cache and on a bfloat16 one
        kc, vc = old_k.astype(kind), old_v.astype(kind)
        q_out, out = np.empty_like(q), np.empty((b, hq, t, d), np.float32)
        args = (kc, vc) if kind is np.float32 else (kc.view(np.uint16), vc.view(np.uint16))
        nn_kernels.rope_write_attend(q, k, v, *args, pos, pos + t, inv, interleaved, rd, scale, True, 0, np.float32(0),
                                     True, q_out, out)
        runs[kind] = kc, vc, q_out, out
    kc32, vc32, q_out, _ = runs[np.float32]
    kc, vc, _, out = runs[BF16]
    # the new rows are the float32 kernel's, rounded to nearest even; the rest is untouched
    assert np.array_equal(kc.view(np.uint16), bf16(kc32).view(np.uint16))
    assert np.array_equal(vc.view(np.uint16), bf16(vc32).view(np.uint16))
    want = nn_ops.sdpa(q_out, kc, vc, length=pos + t, scale=float(scale), causal=True)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("interleaved,rd,t", [(True, 16, 3), (False, 12, 1), (False, 16, 20)])
def test_kernels_take_a_float16_cache_as_its_bits(interleaved, rd, t):
    """The same kernels over a float16 cache (int16 bits, where the CPU converts float16 in hardware):
    the new rows are the float32 kernel's rounded as NumPy rounds them (overflow to infinity included),
    the attention the reference over the rounded cache; a prefill past DECODE_MAX_ROWS attends by BLAS."""
    from ingot.backends.cpu.block_params import F16C
    if not F16C:
        pytest.skip("this CPU converts float16 in software: float16 caches run the reference")
    rng = np.random.default_rng(rd + t)
    b, hq, hk, d, ctx, pos = 1, 6, 2, 16, 40, 5
    q = rng.standard_normal((b, hq, t, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, t, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, t, d)).astype(np.float32) * 100
    v[0, 0, 0, 0] = 1e6     # past float16's range: infinity, as NumPy rounds it
    old_k, old_v = (rng.standard_normal((b, hk, ctx, d)).astype(np.float16) for _ in range(2))
    inv = nn_ops.rope_inv_freq(rd, 10000.0)
    scale = np.float32(0.25)
    kc32, vc32 = old_k.astype(np.float32), old_v.astype(np.float32)
    q_out = np.empty_like(q)
    nn_kernels.rope_write_attend(q, k, v, kc32, vc32, pos, pos + t, inv, interleaved, rd, scale, True, 0, np.float32(0),
                                 False, q_out, q_out)
    kc, vc = old_k.copy(), old_v.copy()
    assert nn_kernels.kernel_cache(kc).dtype == np.int16
    q16, out = np.empty_like(q), np.empty((b, hq, t, d), np.float32)
    nn_kernels.rope_write_attend(q, k, v, nn_kernels.kernel_cache(kc), nn_kernels.kernel_cache(vc), pos, pos + t, inv,
                                 interleaved, rd, scale, True, 0, np.float32(0), False, q16, q16)
    assert np.array_equal(kc.view(np.int16), kc32.astype(np.float16).view(np.int16))
    assert np.array_equal(vc.view(np.int16), vc32.astype(np.float16).view(np.int16))
    assert np.isinf(vc[0, 0, pos, 0])
    vc[0, 0, pos, 0] = 1.0   # (an infinite value would make the attention NaN: the comparison below needs finite)
    want = nn_ops.sdpa(q16, kc, vc, length=pos + t, scale=float(scale), causal=True)
    out = np.empty((b, hq, t, d), np.float32)
    nn_kernels.attention(q16, nn_kernels.kernel_cache(kc), nn_kernels.kernel_cache(vc), pos + t, scale, True, 0,
                         np.float32(0), out)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    blas = nn_kernels.attention_blas(q16, nn_kernels.kernel_cache(kc), nn_kernels.kernel_cache(vc), pos + t, scale, True,
                                     0, np.float32(0))
    np.testing.assert_allclose(blas, want, rtol=2e-5, atol=2e-5)


# -- the models --------------------------------------------------------------------------------

def _run(model, prompt, forced):
    """Logits after the prompt (a prefill over BLAS when long) and after each forced token."""
    pre, dec = model.compile(len(prompt)), model.compile(1)
    state = dec.new_state()
    logits = [pre.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)},
                      state=state)[0]]
    for i, tok in enumerate(forced):
        logits.append(dec.run({"tokens": np.array([tok], np.int32), "pos": np.int32(len(prompt) + i),
                               "last": np.int32(0)}, state=state)[0])
    return np.concatenate(logits), state, dec


def _relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_narrow_kv_cache_halves_its_bytes_and_keeps_the_logits(kv_dtype):
    cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300, context_length=48)
    weights = llama.random_weights(cfg)
    prompt, forced = list(range(3, 23)), [7, 99, 4, 250, 31]   # 20 tokens: the BLAS prefill, then decode
    wide, wide_state, _ = _run(llama.build(cfg, weights), prompt, forced)
    narrow, state, dec = _run(llama.build(dataclasses.replace(cfg, kv_dtype=kv_dtype), weights), prompt, forced)
    caches = {n: a for n, a in state.values.items() if "_cache" in n}
    assert len(caches) == 4 and all(a.dtype == dt.by_name(kv_dtype).storage for a in caches.values())
    assert sum(a.nbytes for a in caches.values()) * 2 == sum(a.nbytes for n, a in wide_state.values.items() if "_cache" in n)
    assert any(n.op == Op.FUSED and n.attrs["kind"] == "rope_qkv_attention" for n in dec.program.nodes())
    assert _relative(wide, narrow) < 1e-2
    assert not np.array_equal(wide, narrow)   # the cache is rounded: not the float32 run by another name


def test_rows_decoder_reads_bfloat16_slots():
    """`ingot serve`'s rows decoder over bfloat16 caches: each row what a batch-1 decoder of the same
    cache dtype computes."""
    cfg = llama.LlamaConfig(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200, context_length=16,
                            kv_dtype="bfloat16")
    weights = llama.random_weights(cfg)
    single, _, _ = _run(llama.build(cfg, weights), [5, 6, 7], [8])
    rows = llama.build(cfg, weights, rows=2)
    exe = rows.graph.compile(feeds={rows.tokens: ingot.TensorType((2,), dt.int32)}, targets=[rows.logits])
    state = exe.new_state()
    assert state.values["blk.0.k_cache.1"].dtype == BF16
    for p, tok in enumerate([5, 6, 7, 8]):
        out = exe.run({"tokens": np.array([tok, tok], np.int32), "positions": np.array([p, p], np.int32)}, state=state)[0]
        if p >= 2:
            np.testing.assert_allclose(out[0], single[p - 2], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(out[0], out[1])


def test_config_and_load_refuse_an_unknown_kv_dtype():
    with pytest.raises(IngotError, match="kv_dtype"):
        llama.LlamaConfig(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200, kv_dtype="int4")
    from ingot.llm.generate import set_kv_dtype
    with pytest.raises(IngotError, match="kv_dtype must be one of float32, bfloat16, float16, int8"):
        set_kv_dtype(tiny_config(), "bf16")


def test_a_package_keeps_its_kv_dtype(tmp_path):
    from ingot.llm.package import read_llm, save_llm

    cfg = tiny_config(kv_dtype="bfloat16")
    save_llm(tmp_path / "m.ingot", cfg, tiny_tensors(cfg), tokenizer_metadata())
    stored = ingot.load(tmp_path / "m.ingot")   # the stored decode executable's caches
    assert stored.new_state().values["blk.0.k_cache"].dtype == BF16
    assert read_llm(tmp_path / "m.ingot").config.kv_dtype == "bfloat16"
    llm = ingot.llm.load(str(tmp_path / "m.ingot"))
    assert llm.state.values["blk.1.v_cache"].dtype == BF16
    assert ingot.llm.load(str(tmp_path / "m.ingot"), kv_dtype="float32").state.values["blk.1.v_cache"].dtype == np.float32


def test_cli_refuses_an_unknown_kv_dtype():
    code = "import sys; from ingot.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--kv-dtype", "int4"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--kv-dtype" in out.stderr


@pytest.mark.slow
def test_default_model_with_a_bfloat16_cache_keeps_its_logits_and_greedy_tokens():
    """SmolLM2 (the default model) with bf16 KV against its float32 KV: the float32 run's 32 greedy tokens on
    3 prompts fed to both (teacher forcing), logits within 1e-2 of the largest and the same top-1 at
    every step (so greedy decoding gives the same ids); the cache's bytes halved."""
    from test_llm import model_path

    wide = ingot.llm.load(model_path(), context=160)
    narrow = ingot.llm.load(model_path(), context=160, kv_dtype="bfloat16")
    steps = agree = 0
    worst = 0.0
    for prompt in ("Name three colours.", "What is the capital of France?", "Write a haiku about the sea."):
        ids = wide.encode_prompt(prompt)
        a, b = wide.prefill(ids), narrow.prefill(ids)
        for _ in range(32):
            worst = max(worst, _relative(a, b))
            token = int(np.argmax(a))
            steps, agree = steps + 1, agree + (token == int(np.argmax(b)))
            a, b = wide.step(token), narrow.step(token)
    print(f"bf16 KV against f32 KV: max |dlogits| / max |logits| {worst:.4f}, top-1 agreement {agree}/{steps}")
    assert worst < 1e-2 and agree == steps
    bytes_of = lambda llm: sum(a.nbytes for n, a in llm.state.values.items() if "_cache" in n)  # noqa: E731
    assert bytes_of(narrow) * 2 == bytes_of(wide)
