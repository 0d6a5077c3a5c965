"""GPTQ and scaled lookup tables (lut4:bBLOCK) against NumPy references: codes and parameters
reproduce the dequantized weight, the graph's quantized matmul equals a matmul with it, and on fixed
seeded examples the calibrated methods lower the error they are built to lower, by a wide margin."""
import json
import os
import sys

import numpy as np
import pytest

import ingot
from ingot.errors import IngotError
from ingot.quant import parse_format, quantize
from ingot.quant.gptq import gptq


def _correlated_inputs(seed=0, n=2048, cols=128, rank=16):
    """Calibration activations with the low-rank correlations real ones have, and uneven columns."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, cols)) + 0.1 * rng.standard_normal((n, cols))
    return x * np.exp(0.5 * rng.standard_normal(cols))


def _output_error(w, approx, h):
    e = (w - approx).astype(np.float64)
    return float(np.trace(e @ h @ e.T) / np.trace(w.astype(np.float64) @ h @ w.T))


def _reference_dequantize(t):
    """The weight from codes and parameters, written out independently of QuantizedTensor."""
    codes = t.values().astype(np.intp)
    rows, cols = t.shape
    if t.lut is not None:
        tables = np.repeat(t.lut[:, 0, :], rows // t.lut.shape[0], axis=0)
        looked_up = np.take_along_axis(tables, codes, axis=1)
        return looked_up if t.scale is None else looked_up * np.repeat(t.scale, t.block_size, axis=1)
    out = codes * np.repeat(t.scale, t.block_size, axis=1)
    return out if t.bias is None else out + np.repeat(t.bias, t.block_size, axis=1)


@pytest.mark.parametrize("fmt", ["int4:32", "uint4:64", "int8:32", "int4", "lut4:g8", "lut4:b32", "lut4:g8:b16"])
def test_gptq_codes_and_parameters_give_the_weight_and_lower_the_output_error(fmt):
    x = _correlated_inputs()
    h = x.T @ x / len(x)
    w = np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)
    t = gptq(w, fmt, h)
    assert t.shape == (48, 128) and str(parse_format(fmt)) == t.source
    np.testing.assert_allclose(t.dequantize_rows(), _reference_dequantize(t), rtol=1e-6, atol=1e-6)
    plain = quantize(w, fmt, importance=np.diag(h).astype(np.float32)).dequantize_rows()
    # the greedy error feedback beats round-to-nearest on correlated inputs by far (~10x here)
    assert _output_error(w, t.dequantize_rows(), h) < 0.3 * _output_error(w, plain, h), fmt


def test_gptq_refuses_a_wrong_hessian_and_a_tensor_scale():
    w = np.ones((4, 8), np.float32)
    with pytest.raises(IngotError, match="second moments"):
        gptq(w, "int4:16", np.eye(4))
    with pytest.raises(IngotError, match="whole tensor"):
        gptq(w, "int4:tensor", np.eye(8))


@pytest.mark.parametrize("fmt", ["lut4:b32", "lut4:g4:b16", "lut8:b64", "lut4:b16:uniform"])
def test_scaled_lut_codes_are_the_nearest_entries_of_the_scaled_weight(fmt):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 192)) * np.exp(rng.standard_normal((16, 1)))).astype(np.float32)
    t = quantize(w, fmt)
    tables_expected = 4 if ":g4" in fmt else 1
    assert t.scale.shape == (16, 192 // t.block_size) and t.lut.shape == (tables_expected, 1, 2 ** t.qdtype.bits)
    rows_per = 16 // t.lut.shape[0]
    tables = np.repeat(t.lut[:, 0, :], rows_per, axis=0).astype(np.float64)           # [rows, K]
    normalized = w / np.repeat(t.scale, t.block_size, axis=1)
    nearest = np.abs(normalized[:, :, None] - tables[:, None, :]).min(axis=2)
    chosen = np.abs(normalized - np.take_along_axis(tables, t.values().astype(np.intp), axis=1))
    np.testing.assert_array_less(chosen, nearest + 1e-5)
    np.testing.assert_allclose(t.dequantize_rows(), _reference_dequantize(t), rtol=1e-6, atol=1e-6)
    assert str(parse_format(fmt)) == fmt


def test_scaled_lut_beats_affine_int4_at_equal_bytes_on_heavy_tailed_weights():
    rng = np.random.default_rng(3)
    w = (rng.standard_t(5, (64, 512)) * np.exp(0.5 * rng.standard_normal(512))).astype(np.float32)
    err = {f: float(np.mean((w - quantize(w, f).dequantize_rows()) ** 2)) for f in ("int4:64", "lut4:b64")}
    assert err["lut4:b64"] < 0.7 * err["int4:64"]


@pytest.mark.parametrize("fmt", ["lut4:b32", "lut4:g4:b16"])
def test_scaled_lut_matmul_in_a_graph_equals_the_dequantized_weight(fmt):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 96)).astype(np.float32)        # [out, in]
    t = quantize(w, fmt).to_k_major()                           # [in, out]
    g = ingot.Graph()
    x = g.placeholder((3, 96), name="x")
    wd = g.dequantize(g.constant(t.q, dtype=t.qdtype), lut=g.constant(t.lut), scale=g.constant(t.scale), axis=0,
                      block_size=t.block_size)
    exe = g.compile(targets=[g.matmul(x, wd)])
    xv = rng.standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], xv @ t.dequantize_rows(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["lut4:b33", "lut4:bx", "lut4:b0"])
def test_bad_scaled_lut_format_is_one_sentence(fmt):
    with pytest.raises(IngotError, match="format"):
        parse_format(fmt)


def test_float_gguf_reads_back_with_the_same_weights_and_metadata(tmp_path):
    import gguf

    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import save_tiny_gguf

    from ingot.quant.export import write_float_gguf
    from ingot.llm.package import open_model
    from ingot.quant.pipeline import float_weights

    source = tmp_path / "source.gguf"
    save_tiny_gguf(source)
    floats = {name: w * 2 for name, w in float_weights(open_model(str(source)))}   # new values, same names
    out = tmp_path / "float32.gguf"
    write_float_gguf(str(source), floats, out)
    back = dict(float_weights(open_model(str(out))))
    assert back.keys() == floats.keys()
    for name, w in floats.items():
        np.testing.assert_array_equal(back[name], w)
    fields = lambda p: {k: f.contents() for k, f in gguf.GGUFReader(str(p)).fields.items()  # noqa: E731
                        if not k.startswith("GGUF.") and k != "general.file_type"}
    assert fields(out) == fields(source)


def test_scaled_lut_and_gptq_model_saves_and_reads_back_the_same_logits(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import logits, save_tiny, tiny_config

    from ingot.llm.package import open_model, read_llm, save_llm
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.pipeline import calibrate, default_calibration_text, quantize_default

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    stats = calibrate(model, tokenize(model, default_calibration_text()), context=64)
    result = quantize_default(model, "lut4:b32", stats=stats)
    assert any(n.startswith("GPTQ") for n in result.notes)
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata)
    back = read_llm(tmp_path / "q.ingot")
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_allclose(logits(tiny_config(), back.tensors, tokens), logits(tiny_config(), result.tensors, tokens),
                               rtol=1e-5, atol=1e-5)


def test_compensation_weighted_by_second_moments_beats_the_diagonal_model():
    from ingot.quant.compensate import low_rank

    x = _correlated_inputs(seed=5, cols=96)
    h = x.T @ x / len(x)
    error = np.random.default_rng(6).standard_normal((40, 96))
    left = {}
    for name, importance in (("diagonal", np.diag(h)), ("matrix", h)):
        a, b = low_rank(error, 8, importance)
        assert a.shape == (8, 96) and b.shape == (40, 8)
        left[name] = _output_error(error, b @ a, h)
    # the inputs span ~16 directions: rank 8 in the right norm removes most of what they see
    assert left["matrix"] < 0.6 * left["diagonal"], left


def test_auto_picks_the_form_with_the_lower_weighted_error_at_equal_bytes():
    rng = np.random.default_rng(7)
    centred = rng.standard_normal((16, 256)).astype(np.float32)
    shifted = (np.abs(rng.standard_normal((16, 256))) + 0.5).astype(np.float32)   # all positive: asymmetric wins
    for w in (centred, shifted):
        t = quantize(w, "int4:64:auto")
        assert t.source in ("int4:64", "uint4:128") and t.nbytes == quantize(w, "int4:64").nbytes
        errors = {f: float(np.sum((w - quantize(w, f).dequantize_rows()) ** 2)) for f in ("int4:64", "uint4:128")}
        assert t.source == min(errors, key=errors.get)
    assert quantize(shifted, "int4:64:auto").source == "uint4:128"
    assert str(parse_format("int4:64:auto")) == "int4:64:auto"
    with pytest.raises(IngotError, match="needs a block size"):
        parse_format("int4:auto")


def test_pipeline_auto_with_gptq_picks_by_the_output_error(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import save_tiny

    from ingot.llm.package import open_model
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.pipeline import calibrate, default_calibration_text, quantize_default

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    result = quantize_default(model, "int4:32:auto", stats=calibrate(model, tokenize(model, default_calibration_text()), context=64))
    picked = {t.source for n, t in result.tensors.items() if n.startswith("blk.") and hasattr(t, "source")}
    assert picked <= {"int4:32", "uint4:64"} and any(n.startswith("auto:") for n in result.notes)


def test_gptq_f16_parameters_are_float16_and_still_lower_the_output_error():
    x = _correlated_inputs()
    h = x.T @ x / len(x)
    w = np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)
    t = gptq(w, "uint4:32:f16", h)
    assert t.scale.dtype == np.float16 and t.bias.dtype == np.float16
    np.testing.assert_allclose(t.dequantize_rows(), _reference_dequantize(t.__class__(**{
        **t.__dict__, "scale": t.scale.astype(np.float32), "bias": t.bias.astype(np.float32)})), rtol=1e-6, atol=1e-6)
    plain = quantize(w, "uint4:32:f16", importance=np.diag(h).astype(np.float32)).dequantize_rows()
    assert _output_error(w, t.dequantize_rows(), h) < 0.3 * _output_error(w, plain, h)


def test_f16_parameter_model_saves_reads_back_float16_and_the_same_logits(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import logits, save_tiny, tiny_config

    from ingot.llm.package import open_model, read_llm, save_llm
    from ingot.quant.formats import QuantizedTensor
    from ingot.quant.pipeline import quantize_default

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    result = quantize_default(model, "uint4:32:f16", tensor_formats=[])
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata)
    back = read_llm(tmp_path / "q.ingot")
    stored = [t for t in back.tensors.values() if isinstance(t, QuantizedTensor)]
    assert stored and all(t.scale.dtype == np.float16 and t.bias.dtype == np.float16 for t in stored)
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_allclose(logits(tiny_config(), back.tensors, tokens), logits(tiny_config(), result.tensors, tokens),
                               rtol=1e-5, atol=1e-5)


def test_allocation_stays_within_the_budget_and_gives_bits_where_they_lower_the_error_most():
    from ingot.quant.pipeline import allocate_formats

    rng = np.random.default_rng(0)
    smooth = rng.standard_normal((64, 128)).astype(np.float32)
    rough = (rng.standard_normal((64, 128)) * np.exp(2 * rng.standard_normal((64, 128)))).astype(np.float32)
    floats = {"blk.0.attn_q.weight": smooth, "blk.0.attn_k.weight": rough, "output_norm.weight": np.ones(128, np.float32)}
    chosen = lambda budget: {n: str(f) for n, f in allocate_formats(floats, None, budget)}  # noqa: E731
    assert chosen(4.3) == {"blk.0.attn_q.weight": "int4:64:f16", "blk.0.attn_k.weight": "int4:64:f16"}
    # 0.5 bits per weight over both: the heavy-tailed weight gains far more from Q4_1's form
    assert chosen(4.75) == {"blk.0.attn_q.weight": "int4:32:auto:f16", "blk.0.attn_k.weight": "uint4:32:f16"}
    assert set(chosen(5.0).values()) == {"uint4:32:f16"}
    for budget in (4.3, 4.6, 4.75, 4.9):
        bits = sum(8 * quantize(floats[n], f).nbytes for n, f in allocate_formats(floats, None, budget))
        assert bits <= budget * 2 * 64 * 128
    with pytest.raises(IngotError, match="4.0 bits per weight"):
        allocate_formats(floats, None, 4.0)
    # a fixed format counts against the budget and is not allocated
    fixed = lambda budget: {n: str(f) for n, f in allocate_formats(floats, None, budget, fixed=[("*attn_k*", "int8")])}  # noqa: E731
    assert fixed(6.3) == {"blk.0.attn_q.weight": "int4:64:f16"} and fixed(6.4) == {"blk.0.attn_q.weight": "int4:32:auto:f16"}


def _two_level_weight(rng, rows=16, cols=512):
    """Weights whose blocks differ in spread and centre (uneven rows and columns, heavy tails)."""
    w = rng.standard_normal((rows, cols)) * np.exp(0.5 * rng.standard_normal((rows, 1)))
    return (w * np.exp(0.5 * rng.standard_normal((1, cols))) + 0.3 * rng.standard_normal((rows, cols // 32)).repeat(32, 1)
            ).astype(np.float32)


@pytest.mark.parametrize("fmt, bpw", [("uint4:32:k", 4.5), ("uint4:32:k8", 4.625), ("int4:16:k", 4.4375)])
def test_two_level_parameters_are_codes_times_a_unit_per_super_block(fmt, bpw):
    w = _two_level_weight(np.random.default_rng(6))
    t = quantize(w, fmt)
    bits = parse_format(fmt).code_bits
    assert t.two_level == (256, bits) and 8 * t.two_level_nbytes / w.size == bpw
    params = [t.scale] + ([] if t.bias is None else [t.bias])
    assert all(p.dtype == np.float16 for p in params)           # exact products: the kernels read float16
    for p, sign, (unit, codes) in zip(params, (1, -1), t.two_level_codes()):
        assert unit.shape == (2, 16) and codes.shape == (2, 256 // t.block_size, 16) and codes.max() < 2 ** bits
        rebuilt = sign * unit.astype(np.float32)[:, None, :] * codes            # [super, block, row]
        np.testing.assert_array_equal(rebuilt.transpose(2, 0, 1).reshape(16, -1), p.astype(np.float32))
    np.testing.assert_allclose(t.dequantize_rows(), _reference_dequantize(t.__class__(**{
        **t.__dict__, "scale": t.scale.astype(np.float32),
        "bias": None if t.bias is None else t.bias.astype(np.float32)})), rtol=1e-6, atol=1e-6)
    k = t.to_k_major()
    assert k.two_level == t.two_level and all(np.array_equal(a[1], b[1]) for a, b in zip(k.two_level_codes(), t.two_level_codes()))


def test_two_level_blocks_of_32_beat_blocks_of_64_at_equal_bits():
    # uint4:32:k and uint4:64:f16 both take 4.5 bits per weight; the fitted two-level parameters
    # keep nearly all of blocks of 32's gain (Q4_1's uint4:32:f16, 5 bits)
    w = _two_level_weight(np.random.default_rng(7), rows=64)
    err = {f: float(((w - quantize(w, f).dequantize_rows()) ** 2).sum()) for f in ("uint4:32:k", "uint4:64:f16", "uint4:32:f16")}
    assert err["uint4:32:k"] < 0.85 * err["uint4:64:f16"] and err["uint4:32:k"] < 1.05 * err["uint4:32:f16"], err


def test_gptq_two_level_keeps_the_codes_and_lowers_the_output_error():
    x = _correlated_inputs(cols=512)
    h = x.T @ x / len(x)
    w = _two_level_weight(np.random.default_rng(8), rows=24)
    t = gptq(w, "uint4:32:k", h)
    assert t.two_level == (256, 6) and len(t.two_level_codes()) == 2
    plain = quantize(w, "uint4:32:k", importance=np.diag(h).astype(np.float32)).dequantize_rows()
    assert _output_error(w, t.dequantize_rows(), h) < 0.3 * _output_error(w, plain, h)


@pytest.mark.parametrize("fmt", ["uint4:k", "uint4:32:k:f16", "int4:32:auto:k"])
def test_two_level_formats_need_blocks_and_no_other_parameter_form(fmt):
    with pytest.raises(IngotError, match=":k needs a block size"):
        parse_format(fmt)


def test_two_level_model_saves_and_reads_back_its_form_and_the_same_logits(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import logits, save_tiny, tiny_config

    from ingot.llm.package import open_model, read_llm, save_llm
    from ingot.package import read_safetensors
    from ingot.quant.formats import QuantizedTensor
    from ingot.quant.pipeline import quantize_default

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    result = quantize_default(model, "uint4:16:k", tensor_formats=[])
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata)
    back = read_llm(tmp_path / "q.ingot")
    stored = [t for t in back.tensors.values() if isinstance(t, QuantizedTensor)]
    assert stored and all(t.two_level is not None and len(t.two_level_codes()) == 2 for t in stored)
    # on disk: codes and units (package version 4), not the float16 products; the generic loader decodes them too
    entries = read_safetensors(tmp_path / "q.ingot" / "weights.safetensors")
    layout = json.loads((tmp_path / "q.ingot" / "llm.json").read_text())["tensors"]
    names = [n for n, spec in layout.items() if spec["kind"] == "quantized"]
    assert names and not any(f"constant:{n}.scale" in entries for n in names)
    assert all(f"two_level:{n}.bias:codes" in entries for n in names)
    assert json.loads((tmp_path / "q.ingot" / "manifest.json").read_text())["version"] == 4
    program = ingot.load(tmp_path / "q.ingot").program
    assert any(k.endswith(".scale") and v.dtype == np.float16 for k, v in program.constants.items())
    graph = json.loads((tmp_path / "q.ingot" / "graph.json").read_text())
    key = next(iter(graph["two_level"]))
    graph["two_level"][key][1] = 7          # a code width the codes were not written with: one sentence
    (tmp_path / "q.ingot" / "graph.json").write_text(json.dumps(graph))
    with pytest.raises(IngotError, match="two-level constant .* does not match weights.safetensors"):
        read_llm(tmp_path / "q.ingot")
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_allclose(logits(tiny_config(), back.tensors, tokens), logits(tiny_config(), result.tensors, tokens),
                               rtol=1e-5, atol=1e-5)


def test_two_level_model_read_for_the_cpu_keeps_codes_and_units_and_the_same_logits(tmp_path):
    """read_llm(two_level_codes=True) (what ingot.llm.load does on the CPU): scale and bias stay codes and
    float16 units in memory (the package's bytes, codes a byte each), and the CPU kernels multiply them
    as they read them (no float16 products in the program) to the logits of the products."""
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import logits, save_tiny, tiny_config

    from ingot.ir import Op
    from ingot.llm.package import open_model, read_llm, save_llm
    from ingot.models import llama
    from ingot.quant.formats import QuantizedTensor, TwoLevelParams
    from ingot.quant.pipeline import quantize_default

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    result = quantize_default(model, "uint4:16:k", tensor_formats=[])
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata)
    products, codes = read_llm(tmp_path / "q.ingot"), open_model(tmp_path / "q.ingot", two_level_codes=True)
    stored = {n: t for n, t in codes.tensors.items() if isinstance(t, QuantizedTensor)}
    assert stored and all(isinstance(t.scale, TwoLevelParams) and isinstance(t.bias, TwoLevelParams) for t in stored.values())
    for name, t in stored.items():
        other = products.tensors[name]
        assert t.nbytes == t.q.nbytes + 2 * (t.scale.codes.size + 2 * t.scale.units.size) < other.nbytes
        np.testing.assert_array_equal(np.asarray(t.scale), other.scale)
        np.testing.assert_array_equal(np.asarray(t.bias), other.bias)
    exe = llama.build(tiny_config(), codes.tensors).compile(1)
    assert not any(n.op == Op.DEQUANTIZE for n in exe.program.nodes())
    assert not any(v.dtype == np.float16 and k.endswith((".scale", ".bias")) for k, v in exe.program.constants.items())
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_allclose(logits(tiny_config(), codes.tensors, tokens), logits(tiny_config(), products.tensors, tokens),
                               rtol=1e-5, atol=1e-5)


def test_head_compensation_weights_rows_by_the_calibrated_next_token_probability(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from quant_helpers import save_tiny

    from ingot.llm.package import open_model
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.compensate import low_rank
    from ingot.quant.pipeline import OUTPUT_PROBABILITY, calibrate, default_calibration_text, float_weights, quantize_model

    save_tiny(tmp_path / "tiny.ingot")
    model = open_model(tmp_path / "tiny.ingot")
    stats = calibrate(model, tokenize(model, default_calibration_text()), context=64)
    p = stats[OUTPUT_PROBABILITY]
    assert p.shape == (296,) and abs(float(p.sum()) - 1) < 1e-4 and p.min() >= 0
    result = quantize_model(model, "uint4:16:k", stats=stats, compensate=4, compensate_sites=["token_embd.weight"],
                            compensate_form="low_rank")
    assert set(result.adapters.names) == {"token_embd.weight"}       # only the head: --compensate-only
    w = dict(float_weights(model))["token_embd.weight"]
    e = (w - result.tensors["token_embd.weight"].dequantize_rows()).astype(np.float64)
    h = stats["token_embd.weight"].astype(np.float64)
    a, b = result.adapters.factors["token_embd.weight"][0]
    plain_a, plain_b = low_rank(e, 4, h)
    # what the KL divergence weighs, to second order: each row's output error times its probability
    weighted = lambda c: float(np.einsum("r,ri,ij,rj->", p, e - c, h, e - c))  # noqa: E731
    # (the tiny model's distribution is nearly flat, so the margin is small here; 2.7x the KLD closed on SmolLM2's head)
    assert weighted(b @ a) < weighted(plain_b @ plain_a) < 0.95 * weighted(0 * e)
