"""The GEMVs for a few rows (backends/cpu/rows_gemv.py): the VNNI one, each row bit for bit what
vnni.gemv gives it alone (a server's rows never depend on their batch), on awkward row counts, 4- and
8-bit weights, float32 and float16 parameters, with and without offsets; the float32-activation one
for 4-bit weights against a float64 NumPy product and each row bit for bit what it gives the row
alone; and rows decoders with either activations equal to their batch-1 decoders. (Against the NumPy
model of integer activations through quantized_matmul: tests/test_cpu_kernels.py, rows 3 and 16.)"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot.backends.cpu import kernels, vnni

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI")
RNG = np.random.default_rng(11)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [2, 3, 7, 16])
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("has_offset", [True, False])
def test_each_row_equals_the_one_row_kernel(bits, rows, params, has_offset):
    from ingot.backends.cpu.rows_gemv import gemv_rows
    k, n = 160, 80          # 5 blocks of 32 k, 5 groups of 16 columns
    if bits == 4:
        w, center = vnni.repack(RNG.integers(0, 256, (k, n // 2), dtype=np.uint8), 0), np.float32(8)
    else:
        w, center = vnni.repack8(RNG.integers(-128, 128, (k, n), dtype=np.int8), 0x80), np.float32(0)
    w = kernels._kernel_form(w)
    scale = kernels._kernel_form((RNG.random((k // 32, n)) + 0.1).astype(params))
    offset = kernels._kernel_form(RNG.standard_normal((k // 32, n)).astype(params)) if has_offset else scale
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    x[1, :32] = 0            # a block of zeros: d = 0
    x[0, 40] = 50.0          # a large value: the rest of its block rounds to small integers
    got, want = np.full((rows, n), np.nan, np.float32), np.full((rows, n), np.nan, np.float32)
    gemv_rows(x, w, scale, offset, has_offset, center, 1, k // 32, 16, n, got)    # blocks 1.., columns 16..
    for m in range(rows):
        vnni.gemv(x[m:m + 1], w, scale, offset, has_offset, center, 1, k // 32, 16, n, want[m:m + 1])
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[:, :16]).all()   # only its columns written


def test_rows_decoder_with_int8_activations_is_bit_exact_per_row(monkeypatch, tmp_path):
    from ingot.models import llama
    from quant_helpers import tiny_config
    from test_serve import _check_rows_bit_exact

    path = tmp_path / "options.json"
    path.write_text('{"cpu": {"gemv_activations": "int8"}}')
    monkeypatch.setenv("INGOT_OPTIONS", str(path))
    cfg = tiny_config(dim=64, ffn_dim=128, vocab_size=320)   # every matrix's columns a multiple of 16
    weights = llama.random_weights(cfg, seed=3)
    kernels_used = []
    split_blocks = kernels.split_blocks
    monkeypatch.setattr(kernels, "split_blocks", lambda kernel, *a: (kernels_used.append(kernel), split_blocks(kernel, *a)))
    _check_rows_bit_exact(cfg, llama.build(cfg, weights), llama.build(cfg, weights, rows=3), lengths=(5, 2, 7))
    from ingot.backends.cpu.rows_gemv import gemv_rows
    assert gemv_rows in kernels_used and vnni.gemv in kernels_used   # the rows kernel ran, and the one-row one


def test_repacked_weights_are_shared_and_dropped_with_the_weight():
    """Every executable over one weight array (a server's prefill lengths and row counts) shares its
    VNNI layout, made once; it goes when the weight goes."""
    import gc
    q = RNG.integers(0, 256, (64, 16), dtype=np.uint8)
    first = kernels._repacked(q, 0x88, 4)
    assert kernels._repacked(q, 0x88, 4) is first
    np.testing.assert_array_equal(first, vnni.repack(q, 0x88))
    assert kernels._repacked(q, 0, 4) is not first          # another flip: another layout
    key = (id(q), 0x88, 4)
    del q
    gc.collect()
    assert key not in kernels._REPACKED


@pytest.mark.parametrize("rows", [1, 2, 3, 9, 16])
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("has_offset", [True, False])
@pytest.mark.parametrize("flip", [0, 0x88])
def test_float_rows_kernel_against_numpy_and_each_row_alone(rows, params, has_offset, flip):
    from ingot.backends.cpu.rows_gemv import gemv_rows_float4
    k, n, block = 192, 96, 64   # 3 blocks of 64 k (two runs of 32 each), 3 tiles of 32 columns
    q = RNG.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = (RNG.random((k // block, n)) + 0.1).astype(params)
    offset = RNG.standard_normal((k // block, n)).astype(params)
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    x[0, 40] = 50.0
    codes = np.empty((k, n), np.float64)
    flipped = q ^ np.uint8(flip)
    codes[:, 0::2], codes[:, 1::2] = flipped & 15, flipped >> 4
    w = codes * np.repeat(scale.astype(np.float64), block, axis=0)
    if has_offset:
        w += np.repeat(offset.astype(np.float64), block, axis=0)
    want = x.astype(np.float64) @ w
    form = kernels._kernel_form
    args = (form(q), form(scale), form(offset) if has_offset else form(scale), has_offset, np.uint32(flip))
    got = np.full((rows, n), np.nan, np.float32)
    gemv_rows_float4(x, *args, 1, k // block, 32, n, got)          # blocks 1.., columns 32..
    partial = x[:, block:].astype(np.float64) @ w[block:, 32:]
    np.testing.assert_allclose(got[:, 32:], partial, rtol=1e-5, atol=1e-4 * np.abs(partial).max())
    assert np.isnan(got[:, :32]).all()   # only its columns written
    whole = np.empty((rows, n), np.float32)
    gemv_rows_float4(x, *args, 0, k // block, 0, n, whole)
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    for m in range(rows):
        alone = np.empty((1, n), np.float32)
        gemv_rows_float4(x[m:m + 1], *args, 0, k // block, 0, n, alone)
        np.testing.assert_array_equal(alone[0], whole[m])


def test_rows_decoder_with_float_activations_is_bit_exact_per_row(monkeypatch):
    from ingot.models import llama
    from quant_helpers import tiny_config
    from test_serve import _check_rows_bit_exact
    from ingot.backends.cpu.rows_gemv import gemv_rows_float4

    cfg = tiny_config(dim=64, ffn_dim=128, vocab_size=320)   # every 4-bit matrix's columns a multiple of 32
    weights = llama.random_weights(cfg, seed=4)
    kernels_used = []
    split_blocks = kernels.split_blocks
    monkeypatch.setattr(kernels, "split_blocks", lambda kernel, *a: (kernels_used.append(kernel), split_blocks(kernel, *a)))
    _check_rows_bit_exact(cfg, llama.build(cfg, weights), llama.build(cfg, weights, rows=3), lengths=(5, 2, 7))
    assert gemv_rows_float4 in kernels_used and kernels.kmajor_packed4 not in kernels_used
