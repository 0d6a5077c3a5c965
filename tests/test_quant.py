"""Quantizers: every format round-trips within its theoretical bound (hypothesis), FMT parsing,
and the quantized tensors run through the graph's dequantize and quantized_matmul."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import ingot
from ingot.errors import IngotError
from ingot.quant import parse_format, quantize
from ingot.quant.formats import concat_columns

AFFINE = [f"{t}:{b}{s}" for t in ("int8", "uint8", "int4", "uint4") for b in (16, 32, 64, 128, 256, "channel", "tensor")
          for s in ("", ":sym", ":asym")]
LUT = ["lut4", "lut8", "lut4:g2", "lut8:g3", "lut4:uniform", "lut4:g4:uniform"]


def matrices(max_rows=12, max_cols=6):
    """Float matrices with an even number of columns (4-bit packs two per byte), awkward values included."""
    shapes = st.tuples(st.integers(1, max_rows), st.integers(1, max_cols).map(lambda c: 2 * c))
    elements = st.floats(-1e3, 1e3, allow_nan=False, width=32) | st.sampled_from([0.0, 1e-6, -1e-6])
    return shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=elements))


def _parameter_per_value(t, p):
    """A [rows, blocks] parameter repeated to one per weight."""
    return np.repeat(p, t.block_size, axis=1)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(w=matrices(), fmt=st.sampled_from(AFFINE))
def test_affine_error_within_half_a_step(w, fmt):
    t = quantize(w, fmt)
    approx = t.dequantize_rows()
    scale = _parameter_per_value(t, t.scale)
    # |w - w_hat| <= scale / 2, plus float32 rounding of q * scale + bias
    slack = 1e-5 * (np.abs(w) + np.abs(approx)) + 1e-6 * scale + 1e-30
    assert np.all(np.abs(w - approx) <= scale / 2 + slack), fmt
    assert t.values().min() >= {"int8": -128, "uint8": 0, "int4": -8, "uint4": 0}[t.qdtype.name]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(w=matrices(), fmt=st.sampled_from(LUT), importance=st.booleans())
def test_lut_picks_the_nearest_table_entry(w, fmt, importance):
    weights = np.linspace(0.1, 2.0, w.shape[1]).astype(np.float32) if importance else None
    t = quantize(w, fmt, importance=weights)
    approx = t.dequantize_rows()
    rows_per = w.shape[0] // t.lut.shape[0]
    tables = np.repeat(t.lut[:, 0, :], rows_per, axis=0)                 # [rows, K]
    nearest = np.abs(w[:, :, None] - tables[:, None, :]).min(axis=2)
    assert np.all(np.abs(w - approx) <= nearest + 1e-6 * (1 + np.abs(w))), fmt
    assert t.lut.shape[-1] == 2 ** t.qdtype.bits


def test_kmeans_table_beats_uniform_on_gaussian_weights():
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    err = {f: float(np.mean((w - quantize(w, f).dequantize_rows()) ** 2)) for f in ("lut4", "lut4:uniform", "lut8", "int8")}
    assert err["lut4"] < 0.6 * err["lut4:uniform"]
    assert err["lut4"] < 1.05 * 0.009497  # Lloyd-Max optimum for a unit Gaussian, 16 levels
    assert err["lut8"] < err["int8"]


def test_importance_lowers_weighted_error():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    w[:, :8] *= 6
    importance = np.ones(256, np.float32)
    importance[8:] = 20.0
    for fmt in ("int4:32", "lut4"):
        plain = quantize(w, fmt).dequantize_rows()
        aware = quantize(w, fmt, importance=importance).dequantize_rows()
        weighted = lambda a: float(((w - a) ** 2 * importance).sum())  # noqa: E731
        assert weighted(aware) < weighted(plain), fmt


def test_block_that_does_not_divide_takes_the_largest_divisor():
    t = quantize(np.ones((4, 576), np.float32), "int4:128")
    assert t.block_size == 96 and t.scale.shape == (4, 6)


@pytest.mark.parametrize("fmt", ["int4:33", "int3", "lut5", "lut4:gx", "int8:sym:foo", "", "int4:0", "lut4:g0", "lut4:f16"])
def test_bad_format_is_one_sentence(fmt):
    with pytest.raises(IngotError, match="format"):
        parse_format(fmt)


@pytest.mark.parametrize("fmt", ["int8", "int4:32", "uint4:64", "lut4", "lut4:g128", "lut8", "int4:32:asym", "uint8:tensor",
                                 "uint4:32:f16", "int4:64:auto:f16", "uint4:32:k", "int4:16:k8"])
def test_format_string_round_trips(fmt):
    assert str(parse_format(fmt)) == fmt


@pytest.mark.parametrize("fmt", ["int8", "uint4:32", "int4:16:asym", "lut4", "lut4:g4", "lut8:g2", "uint4:32:f16", "int4:16:f16",
                                 "uint4:16:k"])
def test_quantized_matmul_in_a_graph_equals_the_dequantized_weight(fmt):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 64)).astype(np.float32)       # [out, in]
    t = quantize(w, fmt).to_k_major()                           # [in, out]
    g = ingot.Graph()
    x = g.placeholder((3, 64), name="x")
    q = g.constant(t.q, dtype=t.qdtype if t.qdtype.packed else None)
    if t.lut is not None:
        wd = g.dequantize(q, lut=g.constant(t.lut))
    else:
        params = {"scale": g.constant(t.scale)}
        if t.bias is not None:
            params["bias"] = g.constant(t.bias)
        wd = g.dequantize(q, axis=0, block_size=t.block_size, **params)
    exe = g.compile(targets=[g.matmul(x, wd)])
    assert any(n.op.name == "QUANTIZED_MATMUL" for n in exe.program.nodes())
    xv = rng.standard_normal((3, 64)).astype(np.float32)
    expect = xv @ t.dequantize_rows()
    np.testing.assert_allclose(exe.run({"x": xv})[0], expect, rtol=1e-4, atol=1e-4)


def test_lut_tensors_concatenate_with_a_common_group():
    rng = np.random.default_rng(3)
    parts = [quantize(rng.standard_normal((n, 32)).astype(np.float32), f).to_k_major()
             for n, f in ((8, "lut4"), (4, "lut4:g2"), (4, "lut4"))]
    cat = concat_columns(parts)
    np.testing.assert_array_equal(cat.dequantize_rows(), np.concatenate([p.dequantize_rows() for p in parts], axis=1))


@pytest.mark.parametrize("fmt", ["uint4:32:f16", "int4:64:f16", "int8:32:f16", "uint4:f16"])
def test_f16_parameters_are_stored_as_float16_and_the_codes_fit_them(fmt):
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((16, 128)) * np.exp(rng.standard_normal((16, 1)))).astype(np.float32)
    t, full = quantize(w, fmt), quantize(w, fmt.removesuffix(":f16"))
    assert str(parse_format(fmt)) == fmt and t.scale.dtype == np.float16
    assert t.bias is None or t.bias.dtype == np.float16
    assert t.nbytes == full.nbytes - (full.scale.nbytes + (0 if full.bias is None else full.bias.nbytes)) // 2
    # half a step, plus what rounding scale and bias to float16 (a relative 2**-11 each) moves the
    # range's ends by: up to 2**bits steps' worth of the scale's rounding, and the bias's
    scale = _parameter_per_value(t, t.scale.astype(np.float32))
    bias = 0 if t.bias is None else np.abs(_parameter_per_value(t, t.bias.astype(np.float32)))
    bound = scale * (0.5 + 2 ** t.qdtype.bits * 2.0 ** -11) + bias * 2.0 ** -11
    assert np.all(np.abs(w - t.dequantize_rows()) <= bound * (1 + 1e-5)), fmt
    assert np.mean(np.abs(w - t.dequantize_rows()) <= scale / 2 * (1 + 1e-5)) > 0.95


def test_f16_asymmetric_blocks_of_32_reproduce_q4_1_weights_exactly():
    # GGUF's Q4_1: w = q * d + m per block of 32, d and m float16: uint4:32:f16 finds the same grid
    rng = np.random.default_rng(5)
    d = (np.abs(rng.standard_normal((8, 4))) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((8, 4)) * 0.05).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (8, 4, 32))
    q[..., 0], q[..., 1] = 0, 15                       # each block spans its whole grid
    w = (q * d[..., None] + m[..., None]).reshape(8, 128).astype(np.float32)
    t = quantize(w, "uint4:32:f16")
    np.testing.assert_array_equal(t.dequantize_rows(), w)
    assert 8 * t.nbytes / w.size == 5.0                # Q4_1's bits per weight
