"""An int8 KV cache (`kv_dtype="int8"`): each key and value row stored as int8 codes and one float32
scale (symmetric, max|x| / 127, round half to even), written by quantize + slice_update and read by
attention straight from the codes and scales (fuse_dequantize hands them to the SDPA); against the
NumPy references and the float32 cache (the CPU backend)."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.backends.cpu import nn_kernels
from ingot.errors import IngotError
from ingot.ir import Op
from ingot.models import llama
from ingot.models.blocks import Cache, read_prefix, write_rows
from ingot.ops import nn as nn_ops
from ingot.ops.pool import pool_attention

sys.path.insert(0, os.path.dirname(__file__))
from test_kv_dtype import _relative, _run  # noqa: E402


def codes_and_scales(rng, shape, spread=True):
    """An int8 cache [..., T, D] as quantized_rows stores rows of varied magnitudes (some all zeros)."""
    x = rng.standard_normal(shape).astype(np.float32) * (rng.uniform(0.05, 2.0, shape[:-1] + (1,)) if spread else 1)
    x[..., ::5, :] *= 0 if spread else 1
    return nn_ops.quantized_rows(x)


# -- the IR -------------------------------------------------------------------------------------

def test_quantized_rows_are_symmetric_per_row_rounded_half_to_even():
    x = np.array([[0.0, 0.0, 0.0, 0.0], [127.0, -63.5, 0.5, 1.5], [-2.54, 1.27, 0.0, 0.635]], np.float32)
    codes, scales = nn_ops.quantized_rows(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (3, 1)
    np.testing.assert_array_equal(codes[0], 0)                       # a row of zeros: codes 0, no NaN
    assert scales[0, 0] == nn_ops.ROW_SCALE_MIN
    np.testing.assert_array_equal(codes[1], [127, -64, 0, 2])        # -63.5, 0.5 and 1.5: to even
    assert scales[1, 0] == np.float32(1.0)
    assert codes[2, 0] == -127 and np.abs(codes).max() <= 127
    np.testing.assert_allclose(codes[2] * scales[2], x[2], atol=float(scales[2, 0]) / 2 + 1e-7)


def test_write_rows_stores_what_quantized_rows_gives_and_attention_reads_it():
    """The graph's int8 write (abs, max, /127, floor, quantize, slice_update) equals ops.nn.quantized_rows
    bit for bit, and attention over the cache takes the codes and scales with no dequantize left."""
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    cache = Cache(g.variable(np.zeros((1, 2, 8, 16), np.int8), name="k"),
                  g.variable(np.zeros((1, 2, 8, 1), np.float32), name="k_scale"))
    values = Cache(g.variable(np.zeros((1, 2, 8, 16), np.int8), name="v"),
                   g.variable(np.zeros((1, 2, 8, 1), np.float32), name="v_scale"))
    rows = g.placeholder((1, 2, None, 16), dt.float32, name="rows")
    q = g.placeholder((1, 4, None, 16), dt.float32, name="q")
    pos = g.placeholder((), dt.int32, name="pos")
    end = pos + g.dim(rows, 2)
    k_all, v_all = write_rows(g, cache, rows, [0, 0, pos, 0]), write_rows(g, values, rows * 0.5, [0, 0, pos, 0])
    out = g.sdpa(q, read_prefix(g, k_all, end), read_prefix(g, v_all, end), causal=True)
    exe = g.compile(feeds={rows: ingot.TensorType((1, 2, 3, 16)), q: ingot.TensorType((1, 4, 3, 16))}, targets=[out])
    sdpas = [n for n in exe.program.nodes() if n.op == Op.SDPA]
    assert len(sdpas) == 1 and sdpas[0].attrs["kv_scales"] and sdpas[0].attrs["has_length"]
    assert not any(n.op == Op.DEQUANTIZE for n in exe.program.nodes())
    state = exe.new_state()
    x = rng.standard_normal((1, 2, 3, 16)).astype(np.float32) * 7
    x[0, 1, 2] = 0
    qx = rng.standard_normal((1, 4, 3, 16)).astype(np.float32)
    got = exe.run({"rows": x, "q": qx, "pos": np.int32(4)}, state=state)[0]
    codes, scales = nn_ops.quantized_rows(x)
    np.testing.assert_array_equal(state.values["k"][:, :, 4:7], codes)
    np.testing.assert_array_equal(state.values["k_scale"][:, :, 4:7], scales)
    assert not state.values["k"][:, :, :4].any() and not state.values["k"][:, :, 7:].any()
    k = nn_ops.dequantized_rows(state.values["k"], state.values["k_scale"], 7)
    v = nn_ops.dequantized_rows(state.values["v"], state.values["v_scale"], 7)
    np.testing.assert_allclose(got, nn_ops.sdpa(qx, k, v, causal=True), rtol=1e-5, atol=1e-6)


def test_sdpa_refuses_int8_kv_without_row_scales():
    g = ingot.Graph()
    q = g.placeholder((1, 4, 1, 8), dt.float32)
    k = g.placeholder((1, 2, 5, 8), dt.int8)
    with pytest.raises(IngotError, match="sdpa"):
        g.sdpa(q, k, k)
    bad = g.placeholder((1, 2, 5, 8), dt.float32)
    with pytest.raises(IngotError, match="row scales|float32 scales"):
        g._op(Op.SDPA, [q, k, k, bad, bad], {"scale": None, "causal": False, "has_mask": False, "has_length": False,
                                             "kv_scales": True})


# -- the CPU kernels ------------------------------------------------------------------------------

SHAPES = [  # hq, hk, tq, d, buffer, length, causal, window, softcap
    (4, 1, 1, 64, 40, 1, True, 0, 0.0),
    (8, 2, 1, 80, 40, 17, True, 0, 0.0),
    (6, 3, 1, 128, 40, 39, True, 0, 0.0),
    (6, 3, 1, 64, 40, 40, True, 5, 0.0),
    (4, 4, 3, 64, 40, 17, True, 0, 30.0),
    (9, 3, 5, 80, 40, 23, False, 0, 0.0),
]


@pytest.mark.parametrize("hq, hk, tq, d, buffer, length, causal, window, softcap", SHAPES)
def test_decode_kernel_reads_int8_codes_and_scales_as_the_reference(hq, hk, tq, d, buffer, length, causal, window, softcap):
    rng = np.random.default_rng(hq * 1000 + d + length)
    q = rng.standard_normal((2, hq, tq, d)).astype(np.float32)
    (k, ks), (v, vs) = codes_and_scales(rng, (2, hk, buffer, d)), codes_and_scales(rng, (2, hk, buffer, d))
    attrs = dict(scale=0.3, causal=causal, window=window, softcap=softcap, has_length=True, has_mask=False, kv_scales=True)
    want = nn_ops._sdpa((q, k, v, np.int32(length), ks, vs), attrs)
    out = np.empty_like(want)
    nn_kernels.attention(q, k, v, length, np.float32(0.3), causal, window, np.float32(softcap), out, ks, vs)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tile", [7, 1024])
@pytest.mark.parametrize("hq, hk, d, window, softcap", [(6, 2, 64, 0, 0.0), (4, 4, 80, 6, 0.0), (8, 2, 128, 0, 20.0)])
def test_prefill_reads_int8_codes_by_tiles_as_the_reference(monkeypatch, tile, hq, hk, d, window, softcap):
    monkeypatch.setattr(nn_kernels, "CODES_TILE", tile)
    rng = np.random.default_rng(d + tile)
    tq, pos, buffer = 150, 9, 170   # more than CAUSAL_CHUNK queries: chunks of them
    q = rng.standard_normal((1, hq, tq, d)).astype(np.float32)
    (k, ks), (v, vs) = codes_and_scales(rng, (1, hk, buffer, d)), codes_and_scales(rng, (1, hk, buffer, d))
    attrs = dict(scale=None, causal=True, window=window, softcap=softcap, has_length=True, has_mask=False, kv_scales=True)
    want = nn_ops._sdpa((q, k, v, np.int32(pos + tq), ks, vs), attrs)
    step = nn_kernels.sdpa_step(ingot.ir.Node(Op.SDPA, ingot.TensorType(want.shape), (), attrs))
    np.testing.assert_allclose(step(q, k, v, np.int32(pos + tq), ks, vs), want, rtol=2e-5, atol=2e-5)


def test_pool_attention_quantizes_the_new_rows_into_an_int8_pool():
    rng = np.random.default_rng(3)
    rows, hq, hk, d, slots_n, ctx = 3, 4, 2, 16, 4, 12
    (kp, ksp), (vp, vsp) = codes_and_scales(rng, (slots_n, hk, ctx, d)), codes_and_scales(rng, (slots_n, hk, ctx, d))
    q, k, v = (rng.standard_normal((rows, h, d)).astype(np.float32) for h in (hq, hk, hk))
    slots, positions = np.array([2, 0, 9], np.int32), np.array([5, 11, 3], np.int32)   # slot 9: out of the pool
    out, kp2, vp2, ksp2, vsp2 = pool_attention(q, k, v, kp, vp, slots, positions, ksp, vsp)
    codes, scales = nn_ops.quantized_rows(k[0])
    np.testing.assert_array_equal(kp2[2, :, 5], codes)
    np.testing.assert_array_equal(ksp2[2, :, 5], scales)
    assert np.array_equal(kp2[1], kp[1]) and not out[2].any()
    keys = nn_ops.dequantized_rows(kp2[0:1], ksp2[0:1], 12)
    values = nn_ops.dequantized_rows(vp2[0:1], vsp2[0:1], 12)
    np.testing.assert_allclose(out[1], nn_ops.sdpa(q[1][None, :, None], keys, values, causal=True)[0, :, 0], rtol=1e-6)


# -- the models ---------------------------------------------------------------------------------

CFG = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300, context_length=48)


def test_an_int8_kv_cache_quarters_its_bytes_and_keeps_the_logits():
    weights = llama.random_weights(CFG)
    prompt, forced = list(range(3, 23)), [7, 99, 4, 250, 31]   # 20 tokens: the BLAS prefill, then decode
    wide, wide_state, _ = _run(llama.build(CFG, weights), prompt, forced)
    narrow, state, dec = _run(llama.build(dataclasses.replace(CFG, kv_dtype="int8"), weights), prompt, forced)
    assert sorted(n for n in state.values if n.startswith("blk.0.")) == \
        ["blk.0.k_cache", "blk.0.k_scale_cache", "blk.0.v_cache", "blk.0.v_scale_cache"]
    assert state.values["blk.0.k_cache"].dtype == np.int8 and state.values["blk.0.v_scale_cache"].shape == (1, 2, 48, 1)
    cache_bytes = lambda s: sum(a.nbytes for n, a in s.values.items() if "_cache" in n)  # noqa: E731
    assert cache_bytes(state) * 4 == cache_bytes(wide_state) * (16 + 4) // 16   # hd 16: codes + a float32 scale a row
    sdpas = [n for f in dec.program.nodes() if f.op == Op.FUSED for n in f.attrs["body"].find(Op.SDPA)]
    assert len(sdpas) == 2 and all(n.attrs.get("kv_scales") for n in sdpas)
    assert 1e-4 < _relative(wide, narrow) < 2e-2


def test_rows_and_pool_decoders_read_int8_caches_as_a_batch_1_decoder():
    cfg = dataclasses.replace(CFG, n_layers=1, context_length=16, kv_dtype="int8")
    weights = llama.random_weights(cfg)
    single, _, _ = _run(llama.build(cfg, weights), [5, 6, 7], [8])
    for pool in (0, 3):
        rows = llama.build(cfg, weights, rows=2, pool=pool) if pool else llama.build(cfg, weights, rows=2)
        exe = rows.graph.compile(feeds={rows.tokens: ingot.TensorType((2,), dt.int32)}, targets=[rows.logits])
        state = exe.new_state()
        for p, tok in enumerate([5, 6, 7, 8]):
            feeds = {"tokens": np.array([tok, tok], np.int32), "positions": np.array([p, p], np.int32)}
            if pool:
                feeds["slots"] = np.array([0, 2], np.int32)
            out = exe.run(feeds, state=state)[0]
            if p >= 2:
                np.testing.assert_allclose(out[0], single[p - 2], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(out[1], out[0], rtol=1e-6, atol=1e-6)


def test_cli_takes_kv_dtype_int8_on_generate_chat_and_serve():
    from ingot.cli import build_parser
    parser = build_parser()
    for command in (["generate", "hi"], ["chat"], ["serve"]):
        assert parser.parse_args(command + ["--kv-dtype", "int8"]).kv_dtype == "int8"


@pytest.mark.slow
def test_default_model_with_an_int8_cache_keeps_its_greedy_tokens():
    """SmolLM2 (the default model) with int8 KV against its float32 KV: the float32 run's greedy tokens on
    3 prompts fed to both (teacher forcing). Measured over 300 steps (3 x 100, 2026-12-05): top-1
    agreement 298/300, max |dlogits| 1.13 (4.8 % of the largest logit; bfloat16 KV: 299/300, 0.8 %)."""
    from test_llm import model_path

    wide = ingot.llm.load(model_path(), context=128)
    narrow = ingot.llm.load(model_path(), context=128, kv_dtype="int8")
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
    print(f"int8 KV against f32 KV: max |dlogits| / max |logits| {worst:.4f}, top-1 agreement {agree}/{steps}")
    assert 1e-3 < worst < 0.1 and agree >= steps - 3
    assert narrow.state.values["blk.0.k_cache"].dtype == np.int8


def test_rope_cache_fusion_takes_the_int8_writes_into_one_step():
    """fuse_rope_cache (codes=True on the CPU) takes rope(q), rope(k), both rows' quantization and the four
    cache writes with the decode attention into one rope_qkv_attention op (outputs: the attention, the
    codes caches, the scale caches); its kernel quantizes as ops.nn.quantized_rows: the first layer's V cache equals an
    unfused run's bit for bit (K's rows come out of the fused RoPE, whose float32 rounding may differ
    in the last place, and later layers' inputs with them), and the logits agree."""
    cfg = dataclasses.replace(CFG, kv_dtype="int8")
    weights = llama.random_weights(cfg)
    prompt, forced = list(range(3, 23)), [7, 99, 4, 250, 31]
    fused, state, dec = _run(llama.build(cfg, weights), prompt, forced)
    kinds = [n.attrs["kind"] for n in dec.program.nodes() if n.op == Op.FUSED]
    assert kinds.count("rope_qkv_attention") == 2
    assert not any(n.op in (Op.QUANTIZE, Op.SDPA, Op.SLICE_UPDATE) for n in dec.program.nodes())
    plain = llama.build(cfg, weights)
    unfused = ingot.CompileOptions(fusions=())
    pre, dec2 = plain.compile(len(prompt), options=unfused), plain.compile(1, options=unfused)
    state2 = dec2.new_state()
    logits = [pre.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)},
                      state=state2)[0]]
    for i, tok in enumerate(forced):
        logits.append(dec2.run({"tokens": np.array([tok], np.int32), "pos": np.int32(len(prompt) + i),
                                "last": np.int32(0)}, state=state2)[0])
    assert not any(n.op == Op.FUSED for n in dec2.program.nodes())
    for name, array in state.values.items():   # the first layer's v bit for bit; the rest as close as its inputs
        if name.startswith("blk.0.v_"):
            np.testing.assert_array_equal(array, state2.values[name], err_msg=name)
        else:
            np.testing.assert_allclose(array.astype(np.float32), state2.values[name], rtol=1e-5, atol=1, err_msg=name)
    np.testing.assert_allclose(fused, np.concatenate(logits), rtol=1e-4, atol=1e-4)


def test_rope_write_attend_quantizes_rows_as_quantized_rows_ties_to_even():
    """The fused CPU decode kernel's int8 write: the v row (not rotated) with ties x / scale = n + 1/2 and
    a row of zeros; codes and scales exactly ops.nn.quantized_rows'."""
    d, hk, ctx, pos = 8, 2, 6, 3
    v = np.zeros((1, hk, 1, d), np.float32)
    v[0, 0, 0] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.25]
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((1, 4, 1, d)).astype(np.float32), rng.standard_normal((1, hk, 1, d)).astype(np.float32)
    caches = [np.zeros((1, hk, ctx, d), np.int8) for _ in range(2)] + [np.zeros((1, hk, ctx, 1), np.float32) for _ in range(2)]
    out, q_out = np.empty((1, 4, 1, d), np.float32), np.empty((1, 4, 1, d), np.float32)
    inv = nn_ops.rope_inv_freq(d, 10000.0)
    nn_kernels.rope_write_attend(q, k, v, caches[0], caches[1], pos, pos + 1, inv, False, d, np.float32(0.3), True, 0,
                                 np.float32(0), True, q_out, out, caches[2], caches[3])
    codes, scales = nn_ops.quantized_rows(v[0, :, 0])
    np.testing.assert_array_equal(caches[1][0, :, pos], codes)
    np.testing.assert_array_equal(caches[3][0, :, pos], scales)
    assert list(codes[0]) == [127, 0, 2, 2, 0, -2, -126, 3] and not codes[1].any()
    k_rot = nn_ops.rope(k, np.int32(pos), inv, 10000.0, False, d)
    k_codes, k_scales = nn_ops.quantized_rows(k_rot[0, :, 0])
    np.testing.assert_allclose(caches[0][0, :, pos], k_codes, atol=1)
    keys = nn_ops.dequantized_rows(caches[0], caches[2], pos + 1)
    values = nn_ops.dequantized_rows(caches[1], caches[3], pos + 1)
    np.testing.assert_allclose(out, nn_ops.sdpa(q_out, keys, values, scale=0.3, causal=True), rtol=1e-5, atol=1e-6)


def test_a_package_keeps_its_int8_kv_cache(tmp_path):
    from ingot.llm.package import read_llm, save_llm
    from quant_helpers import tiny_config, tiny_tensors, tokenizer_metadata

    cfg = tiny_config(kv_dtype="int8")
    save_llm(tmp_path / "m.ingot", cfg, tiny_tensors(cfg), tokenizer_metadata())
    values = ingot.load(tmp_path / "m.ingot").new_state().values   # the stored decode executable's caches
    assert values["blk.0.k_cache"].dtype == np.int8 and values["blk.0.k_scale_cache"].dtype == np.float32
    assert read_llm(tmp_path / "m.ingot").config.kv_dtype == "int8"
    llm = ingot.llm.load(str(tmp_path / "m.ingot"))
    llm.prefill([1, 2, 3])
    assert llm.state.values["blk.1.v_cache"].dtype == np.int8 and llm.state.values["blk.1.v_scale_cache"][0, :, :3].all()
