"""The VNNI GEMV for a few rows (backends/cpu/rows_gemv.py): each row bit for bit what vnni.gemv
gives it alone (a server's rows never depend on their batch), on awkward row counts, 4- and 8-bit
weights, float32 and float16 parameters, with and without offsets; and a rows decoder with integer
activations equal to its batch-1 decoder. (Against the NumPy model of integer activations through
quantized_matmul: tests/test_cpu_kernels.py, rows 3 and 16.)"""
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
