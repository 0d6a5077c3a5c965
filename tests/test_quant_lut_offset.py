"""lut4:bB:offset, a scaled lookup table with a float16 offset beside each block's float16 scale
(w = table[q] * scale + offset): the format string, the quantizer's error against lut4:bB at the same
block, the IR's scaled_lut mode with a bias against NumPy references (dequantize, quantized_matmul,
quantized_gather, on awkward shapes; the GPU's kernels: test_cuda_lut_offset.py), GPTQ,
a tiny model's greedy generation on the CPU against its dequantized weights, and a package round trip."""
import os
import sys

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.errors import IngotError
from ingot.ir import Op
from ingot.ops import reference
from ingot.quant import parse_format, quantize
from ingot.quant.formats import QuantizedTensor

sys.path.insert(0, os.path.dirname(__file__))


def _written_out(t: QuantizedTensor) -> np.ndarray:
    """The weight from codes, table, scales and offsets, independently of QuantizedTensor."""
    rows, cols = t.shape
    tables = np.repeat(t.lut[:, 0, :].astype(np.float64), rows // t.lut.shape[0], axis=0)
    looked_up = np.take_along_axis(tables, t.values().astype(np.intp), axis=1)
    per_weight = lambda p: np.repeat(p.astype(np.float64), t.block_size, axis=1)  # noqa: E731
    return looked_up * per_weight(t.scale) + per_weight(t.bias)


def _student_t(rows=64, cols=512, seed=3):
    """Student-t weights (4 degrees of freedom) whose blocks of 64 sit off zero, each by its own amount."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(4, (rows, cols)) + 0.5 * rng.standard_normal((rows, cols // 64)).repeat(64, axis=1)).astype(np.float32)


# -- the format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["lut4:b64:offset", "lut4:b32:offset", "lut4:g8:b16:offset", "lut8:b64:offset",
                                 "lut4:b64:offset:uniform"])
def test_format_string_round_trips(fmt):
    assert str(parse_format(fmt)) == fmt and parse_format(fmt).offset


@pytest.mark.parametrize("fmt", ["lut4:offset", "lut4:g8:offset", "int4:32:offset", "lut4:b64:offsets"])
def test_offset_without_blocks_or_on_affine_is_one_sentence(fmt):
    with pytest.raises(IngotError, match="format .* is not valid"):
        parse_format(fmt)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_offsets_count_in_the_bits_per_weight(block):
    w = _student_t()
    t = quantize(w, f"lut4:b{block}:offset")
    assert t.scale.dtype == np.float16 and t.bias.dtype == np.float16
    assert t.scale.shape == t.bias.shape == (64, 512 // block)
    assert 8 * (t.nbytes - t.lut.nbytes) / w.size == 4 + 32 / block


# -- the quantizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [32, 64])
def test_offset_lowers_the_error_of_lut4_at_the_same_block(block):
    w = _student_t()
    err = {f: float(np.mean((w - quantize(w, f).dequantize_rows()) ** 2)) for f in (f"lut4:b{block}", f"lut4:b{block}:offset")}
    assert err[f"lut4:b{block}:offset"] < 0.95 * err[f"lut4:b{block}"], err


def test_offset_lowers_the_error_of_lut4_on_zero_mean_student_t_in_blocks_of_32():
    # (in blocks of 64 the fit keeps every block's extremes in the table's span and costs ~8 % of squared
    # error there: what lowered the default model's KLD; see quantize._quantize_offset_lut)
    w = np.random.default_rng(0).standard_t(4, (128, 512)).astype(np.float32)
    err = {f: float(np.mean((w - quantize(w, f).dequantize_rows()) ** 2)) for f in ("lut4:b32", "lut4:b32:offset")}
    assert err["lut4:b32:offset"] < 0.97 * err["lut4:b32"], err


@pytest.mark.parametrize("fmt", ["lut4:b32:offset", "lut4:g4:b16:offset", "lut8:b64:offset"])
def test_codes_are_the_nearest_entries_and_the_parameters_give_the_weight(fmt):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 192)) * np.exp(rng.standard_normal((16, 1))) + rng.standard_normal((16, 1))).astype(np.float32)
    importance = np.linspace(0.2, 3, 192).astype(np.float32)
    t = quantize(w, fmt, importance=importance)
    rows_per = 16 // t.lut.shape[0]
    tables = np.repeat(t.lut[:, 0, :], rows_per, axis=0).astype(np.float64)
    rep = lambda p: np.repeat(p.astype(np.float64), t.block_size, axis=1)  # noqa: E731
    normalized = (w - rep(t.bias)) / rep(t.scale)
    nearest = np.abs(normalized[:, :, None] - tables[:, None, :]).min(axis=2)
    chosen = np.abs(normalized - np.take_along_axis(tables, t.values().astype(np.intp), axis=1))
    np.testing.assert_array_less(chosen, nearest + 1e-4)
    np.testing.assert_allclose(t.dequantize_rows(), _written_out(t), rtol=1e-6, atol=1e-6)
    k_major = t.to_k_major()
    np.testing.assert_array_equal(k_major.dequantize_rows(), t.dequantize_rows().T)


def test_gptq_keeps_the_offsets_and_lowers_the_output_error():
    from ingot.quant.gptq import gptq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 16)) @ rng.standard_normal((16, 128)) + 0.1 * rng.standard_normal((2048, 128))
    h = x.T @ x / len(x)
    w = (rng.standard_normal((48, 128)) + 0.5).astype(np.float32)
    t = gptq(w, "lut4:b32:offset", h)
    plain = quantize(w, "lut4:b32:offset", importance=np.diag(h).astype(np.float32))
    np.testing.assert_array_equal(t.bias, plain.bias)
    np.testing.assert_allclose(t.dequantize_rows(), _written_out(t), rtol=1e-6, atol=1e-6)
    out_err = lambda a: float(np.trace((w - a) @ h @ (w - a).T))  # noqa: E731
    assert out_err(t.dequantize_rows()) < 0.5 * out_err(plain.dequantize_rows())


# -- the IR: scaled_lut with a bias -------------------------------------------------------------
def _random_table_weight(rng, k, n, block, qdtype=dt.uint4):
    """Codes [k, n], a table [1, 1, 2**bits], scale and bias [k // block, n] float16."""
    entries = 2 ** qdtype.bits
    codes = rng.integers(0, entries, (k, n)).astype(np.uint8)
    table = np.sort(rng.standard_normal(entries)).astype(np.float32).reshape(1, 1, entries)
    scale = rng.uniform(0.5, 2, (k // block, n)).astype(np.float16)
    bias = rng.standard_normal((k // block, n)).astype(np.float16)
    dense = table.reshape(-1)[codes] * np.repeat(scale.astype(np.float32), block, 0) + np.repeat(bias.astype(np.float32), block, 0)
    return codes, table, scale, bias, dense


def _stored(codes, qdtype):
    return dt.pack_int4(codes) if qdtype.packed else codes


def test_dequantize_reference_adds_the_bias_and_the_plain_form_is_unchanged():
    rng = np.random.default_rng(0)
    codes, table, scale, bias, dense = _random_table_weight(rng, 96, 10, 32)
    attrs = {"qdtype": dt.uint4, "dtype": dt.float32, "mode": "scaled_lut"}
    expand = lambda p: np.repeat(p, 32, axis=0)  # noqa: E731
    plain = reference(Op.DEQUANTIZE, [dt.pack_int4(codes), table, expand(scale)], attrs)
    np.testing.assert_array_equal(plain, table.reshape(-1)[codes] * np.repeat(scale.astype(np.float32), 32, 0))
    biased = reference(Op.DEQUANTIZE, [dt.pack_int4(codes), table, scale, bias], dict(attrs, has_bias=True))
    np.testing.assert_allclose(biased, dense, rtol=1e-6, atol=1e-6)
    g = ingot.Graph()
    node = g.dequantize(g.constant(dt.pack_int4(codes), dtype=dt.uint4), lut=table, scale=scale, axis=0, block_size=32).node
    assert "has_bias" not in node.attrs and len(node.src) == 3


# (K, N, block, qdtype, transpose, batch): K not a multiple of 64, N odd where the layout allows
# (unpacked 8-bit codes, or a transposed weight [N, K] packed along K)
SHAPES = [(96, 14, 32, dt.uint4, False, ()), (160, 7, 32, dt.uint8, False, (2,)), (96, 13, 16, dt.uint4, True, ()),
          (192, 33, 64, dt.uint4, True, (2,)), (48, 6, 48, dt.int4, False, ())]


@pytest.mark.parametrize("k, n, block, qdtype, transpose, batch", SHAPES)
def test_quantized_matmul_and_gather_match_numpy_on_awkward_shapes(k, n, block, qdtype, transpose, batch):
    rng = np.random.default_rng(k + n)
    codes, table, scale, bias, dense = _random_table_weight(rng, k, n, block, dt.uint8 if qdtype == dt.uint8 else dt.uint4)
    if qdtype == dt.int4:   # raw nibbles 8..15 are codes -8..-1, which index table[-8..-1] as NumPy does
        dense = table.reshape(-1)[np.where(codes >= 8, codes.astype(np.int16) - 16, codes)] * \
            np.repeat(scale.astype(np.float32), block, 0) + np.repeat(bias.astype(np.float32), block, 0)
    g = ingot.Graph()
    x = g.placeholder(batch + (3, k), name="x")
    idx = g.placeholder((5,), ingot.int32, name="idx")
    if transpose:   # the weight stored [N, K], blocks along axis 1
        q = g.constant(_stored(np.ascontiguousarray(codes.T), qdtype), dtype=qdtype)
        w = g.dequantize(q, lut=table, scale=np.ascontiguousarray(scale.T), bias=np.ascontiguousarray(bias.T), axis=1,
                         block_size=block)
        y, rows = g.matmul(x, g.transpose(w, (1, 0))), g.gather(w, idx, axis=0)
    else:
        q = g.constant(_stored(codes, qdtype), dtype=qdtype)
        w = g.dequantize(q, lut=table, scale=scale, bias=bias, axis=0, block_size=block)
        y, rows = g.matmul(x, w), g.gather(w, idx, axis=1)
    exe = g.compile(targets=[y, rows, w])
    nodes = exe.program.nodes()
    fused = [nd for nd in nodes if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER)]
    assert len(fused) == 2 and all(nd.attrs.get("has_bias") for nd in fused)   # the CPU reads the bias where it is
    xv = rng.standard_normal(batch + (3, k)).astype(np.float32)
    iv = np.array([0, n - 1, 2, n // 2, 2], np.int32)
    out_y, out_rows, out_w = exe.run({"x": xv, "idx": iv})
    np.testing.assert_allclose(out_w, dense if not transpose else dense.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_y, xv @ dense, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out_rows, dense[:, iv] if not transpose else dense.T[iv], rtol=1e-6, atol=1e-6)
    # the op references themselves, bias and all (what a backend without the pass would run)
    wq = _stored(codes, qdtype) if not transpose else _stored(np.ascontiguousarray(codes.T), qdtype)
    params = [table, scale, bias] if not transpose else [table, np.ascontiguousarray(scale.T), np.ascontiguousarray(bias.T)]
    attrs = {"qdtype": qdtype, "dtype": dt.float32, "mode": "scaled_lut", "has_bias": True, "transpose": transpose}
    np.testing.assert_allclose(reference(Op.QUANTIZED_MATMUL, [xv, wq] + params, attrs), xv @ dense, rtol=1e-4, atol=1e-4)
    gathered = reference(Op.QUANTIZED_GATHER, [wq] + params + [iv], dict(attrs, axis=0 if transpose else 1))
    np.testing.assert_allclose(gathered, dense.T[iv] if transpose else dense[:, iv], rtol=1e-6, atol=1e-6)


def test_cpu_lut_kernel_adds_the_bias_share():
    from ingot.backends.cpu import lut_kernels

    rng = np.random.default_rng(6)
    codes, table, scale, bias, dense = _random_table_weight(rng, 128, 32, 64)
    g = ingot.Graph()
    x = g.placeholder((1, 128), name="x")
    w = g.dequantize(g.constant(dt.pack_int4(codes), dtype=dt.uint4), lut=table, scale=scale, bias=bias, axis=0, block_size=64)
    exe = g.compile(targets=[g.matmul(x, w)])
    (node,) = [nd for nd in exe.program.nodes() if nd.op == Op.QUANTIZED_MATMUL]
    assert node.attrs.get("has_bias") and len(node.src) == 5
    xq = [np.asarray(exe.program.constants[s.attrs["key"]]) for s in node.src[1:]]
    for rows in (1, 3, 40):   # the GEMV, and the tiles through BLAS (more than GEMV_MAX_ROWS rows)
        step = lut_kernels.scaled_lut_matmul_step(node, None)
        assert step is not None
        xv = rng.standard_normal((rows, 128)).astype(np.float32)
        np.testing.assert_allclose(step(xv, *xq), xv @ dense, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(step(xv, *xq[:3]), xv @ (dense - np.repeat(bias.astype(np.float32), 64, 0)),
                                   rtol=1e-4, atol=1e-4)   # (the plain form of the same arrays: no bias)
    xv = rng.standard_normal((1, 128)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], xv @ dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias_shape", [(3, 14), (2, 5), (1, 1, 14)])
def test_mismatched_bias_is_one_sentence(bias_shape):
    rng = np.random.default_rng(7)
    codes, table, scale, _, _ = _random_table_weight(rng, 64, 14, 32)
    g = ingot.Graph()
    q = g.constant(dt.pack_int4(codes), dtype=dt.uint4)
    with pytest.raises(IngotError, match="dequantize"):
        g.dequantize(q, lut=table, scale=scale, bias=np.zeros(bias_shape, np.float16), axis=0, block_size=32)


def test_lut_without_scale_takes_no_bias():
    g = ingot.Graph()
    q = g.constant(np.zeros((4, 2), np.uint8), dtype=dt.uint4)
    with pytest.raises(IngotError, match="without scale= takes no zero_point= or bias="):
        g.dequantize(q, lut=np.zeros((1, 1, 16), np.float32), bias=np.ones((4, 1), np.float32))


# -- a tiny model -------------------------------------------------------------------------------
FMT = "lut4:b32:offset"


def _quantized_tiny():
    from quant_helpers import tiny_config, tiny_tensors

    cfg = tiny_config()
    tensors = tiny_tensors(cfg)
    return cfg, {n: quantize(w, FMT) if np.ndim(w) == 2 else w for n, w in tensors.items()}


def _greedy(cfg, tensors, prompt, steps):
    from ingot.models import llama

    model = llama.build(cfg, tensors, all_logits=True)
    prefill, decode = model.compile(len(prompt)), model.compile(1)
    state = decode.new_state()
    logits = prefill.run({"tokens": np.asarray(prompt, np.int32), "pos": np.int32(0)}, state=state)[0]
    out, seen = [], [logits[-1]]
    for i in range(steps):
        token = int(np.argmax(seen[-1]))
        out.append(token)
        seen.append(decode.run({"tokens": np.array([token], np.int32), "pos": np.int32(len(prompt) + i)}, state=state)[0][-1])
    return out, np.stack(seen), decode


def test_tiny_model_generates_as_its_dequantized_weights_do():
    cfg, tensors = _quantized_tiny()
    dequantized = {n: t.dequantize_rows() if isinstance(t, QuantizedTensor) else t for n, t in tensors.items()}
    prompt = [1, 40, 41, 60, 61, 80]
    tokens, logits, decode = _greedy(cfg, tensors, prompt, 12)
    expect_tokens, expect_logits, _ = _greedy(cfg, dequantized, prompt, 12)
    assert tokens == expect_tokens
    np.testing.assert_allclose(logits, expect_logits, rtol=1e-4, atol=2e-4)
    nodes = decode.program.nodes()
    tables = [nd for nd in nodes if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER) and nd.attrs.get("mode") == "scaled_lut"]
    # every layer matmul, the tied head and the embedding lookup read the table and its bias
    assert len(tables) >= 2 * 4 + 2 and all(nd.attrs.get("has_bias") for nd in tables)
    assert any(nd.op == Op.QUANTIZED_GATHER for nd in tables)


def test_tiny_model_package_round_trip(tmp_path):
    import json

    from quant_helpers import logits, tokenizer_metadata

    from ingot.llm.package import _check_quantized, read_llm, save_llm

    cfg, tensors = _quantized_tiny()
    save_llm(tmp_path / "q.ingot", cfg, tensors, tokenizer_metadata())
    back = read_llm(tmp_path / "q.ingot")
    info = json.loads((tmp_path / "q.ingot" / "llm.json").read_text())
    assert info["tensors"]["token_embd.weight"]["params"] == ["scale", "bias", "lut"]
    # versions an Ingot that would drop the bias refuses: the LLM description's and the compiled package's
    assert info["version"] == 2 and json.loads((tmp_path / "q.ingot" / "manifest.json").read_text())["version"] == 5
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            got = back.tensors[name]
            assert got.bias is not None and got.bias.dtype == np.float16 and got.scale.dtype == np.float16, name
            np.testing.assert_array_equal(got.dequantize_rows(), t.to_k_major().dequantize_rows())
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_array_equal(logits(cfg, back.tensors, tokens), logits(cfg, tensors, tokens))
    good = back.tensors["token_embd.weight"]
    for bad in (QuantizedTensor(good.q, good.qdtype, good.shape, good.block_size, good.scale, good.bias[:-1], lut=good.lut,
                                block_axis=0),
                QuantizedTensor(good.q, good.qdtype, good.shape, good.block_size, good.scale, good.bias, lut=good.lut[..., :8],
                                block_axis=0),
                QuantizedTensor(good.q, good.qdtype, good.shape, good.block_size, None, good.bias, lut=good.lut, block_axis=0)):
        with pytest.raises(IngotError, match="token_embd.weight' is described as uint4"):
            _check_quantized(tmp_path, "token_embd.weight", bad)
