"""The VNNI GEMV (ingot/backends/cpu/vnni.py) on 5- and 6-bit weights and parameters per 16 k
(GGUF's Q5_0/Q5_1/Q5_K and Q6_K, which import as 8-bit integers), with parameters as [blocks, N] or
grouped per 16 columns: against a NumPy reference of the same integer activations, against the
8-bit layout of the same integers (signed: bit for bit), and through a compiled graph on real GGUF
blocks against gguf.quants.dequantize."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ingot import dtypes as dt
from ingot.backends.cpu import kernels, vnni
from ingot.backends.cpu.nn_kernels import round_rows
from ingot.importers import read_gguf
from ingot.options import CompileOptions, CpuOptions

pytestmark = pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI")
RNG = np.random.default_rng(29)


def rounded(x: np.ndarray):
    """x's int8 rounding as the kernel makes it: (xq * d per element, float64)."""
    m, k = x.shape
    xq, xd = np.empty((m, k), np.int8), np.empty((m, k // 32), np.float32)
    xs, xi = np.empty_like(xd), np.empty_like(xd)
    round_rows(x, 0, k // 32, xq, xd, xs, xi)
    return xq.astype(np.float64) * np.repeat(xd, 32, axis=1).astype(np.float64)


def reference(x, values, scale, offset, block, center):
    """out = sum over k of x~ (values - center) scale + sum(x) (center scale + offset) per block:
    the rounded x multiplies the centred integers, the exact x the rest (as the kernel does)."""
    rep = lambda p: np.repeat(p.astype(np.float64), block, axis=0)  # noqa: E731
    sums = x.astype(np.float64).reshape(x.shape[0], -1, block).sum(-1)
    out = rounded(x) @ ((values - center) * rep(scale)) + sums @ (center * scale.astype(np.float64))
    return out if offset is None else out + sums @ offset.astype(np.float64)


def layout(values: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    half = 1 << (bits - 1)
    codes = (values + (half if signed else 0)).astype(np.uint8)
    return vnni.repack_bits(codes, bits) if bits < 8 else vnni.repack8(codes, 0)


def test_repack_bits_4_is_repack():
    codes = RNG.integers(0, 16, (96, 48), dtype=np.uint8)
    np.testing.assert_array_equal(vnni.repack_bits(codes, 4), vnni.repack(dt.pack_int4(codes), 0))


@pytest.mark.parametrize("bits", [5, 6])
def test_repack_bits_planes_hold_each_codes_high_bits(bits):
    """Bit 4 + p of the code of (k, column) is bit i of plane p's vector j, j = 2 v + h for k = 4 v +
    16 h + q (q < 4) and i = 4 (column % 16) + q: the layout the kernel's masks read."""
    k, n = 64, 32
    codes = RNG.integers(0, 1 << bits, (k, n), dtype=np.uint8)
    w = vnni.repack_bits(codes, bits)
    assert w.shape == (n // 16, k // 32, vnni.BLOCK_BYTES[bits])
    for plane in range(bits - 4):
        for kk, col in [(0, 0), (5, 3), (17, 15), (31, 16), (46, 31), (63, 9)]:
            sb, r = divmod(kk, 32)
            h, rest = divmod(r, 16)
            v, q = divmod(rest, 4)
            j, i = 2 * v + h, 4 * (col % 16) + q
            byte = w[col // 16, sb, 256 + 64 * plane + 8 * j + i // 8]
            assert (byte >> (i % 8)) & 1 == (codes[kk, col] >> (4 + plane)) & 1


def params(form: str, nb: int, n: int, sign: int = 1):
    """Block parameters [nb, N] in the kernels' forms: float32, float16 bits or two-level (codes, units, S)."""
    if form == "two":
        codes = RNG.integers(0, 64, (nb, n)).astype(np.uint8)
        units = ((RNG.random((nb, n)) * 0.1 + 0.01).astype(np.float16).view(np.uint16) & np.uint16(0xFFC0))
        return codes, (sign * units.view(np.float16)).astype(np.float16).view(np.uint16), np.int64(1)
    p = (RNG.random((nb, n)) + 0.1).astype(np.float32) * sign
    return p.astype(np.float16).view(np.uint16) if form == "f16" else p


def as_float(p) -> np.ndarray:
    if isinstance(p, tuple):
        return p[0].astype(np.float32) * p[1].view(np.float16).astype(np.float32)
    return p.view(np.float16).astype(np.float32) if p.dtype == np.uint16 else p


@pytest.mark.parametrize("bits,signed", [(5, True), (5, False), (6, True), (6, False), (4, False), (8, True)])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("form", ["f32", "f16", "two"])
def test_gemv_matches_reference(bits, signed, block, form):
    k, n, rows = 192, 48, 3
    half = 1 << (bits - 1)
    values = RNG.integers(-half, half, (k, n)) if signed else RNG.integers(0, 2 * half, (k, n))
    center = np.float32(0 if signed else half)
    scale, offset = params(form, k // block, n), params(form, k // block, n, -1)
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    x[1, :32] = 0                           # a block of zeros: d = 0
    w = layout(values, bits, signed)
    want = reference(x, values, as_float(scale), as_float(offset), block, center)
    flat = None
    for grouped in (False, True):
        s, o = (vnni.group_params(scale), vnni.group_params(offset)) if grouped else (scale, offset)
        got = np.full((rows, n), np.nan, np.float32)
        vnni.gemv(x, w, s, o, True, center, 0, k // 32, 0, n, got)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        if flat is None:
            flat = got
        else:                                # the grouped parameters: the same numbers
            np.testing.assert_array_equal(got, flat)
    part = np.full((rows, n), np.nan, np.float32)   # blocks 1.. and columns 16..32 only
    vnni.gemv(x, w, vnni.group_params(scale), vnni.group_params(scale), False, center, 1, k // 32, 16, 32, part)
    assert np.isnan(part[:, :16]).all() and np.isnan(part[:, 32:]).all()
    x_late = x.copy()
    x_late[:, :32] = 0
    late = reference(x_late, values, as_float(scale), 0 * as_float(scale), block, center)
    np.testing.assert_allclose(part[:, 16:32], late[:, 16:32], rtol=2e-5, atol=2e-5 * np.abs(late).max())


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("rows", [1, 17])
def test_narrow_layout_equals_the_8bit_layout_bit_for_bit(bits, block, rows):
    """A signed weight read in 5 or 6 bits gives the very numbers its 8-bit layout gives: the same
    integer dot products less the same multiple of sum(xq), the same float epilogue."""
    k, n = 96, 32
    half = 1 << (bits - 1)
    values = RNG.integers(-half, half, (k, n))
    scale = vnni.group_params(params("f16", k // block, n))
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    narrow, wide = np.empty((rows, n), np.float32), np.empty((rows, n), np.float32)
    vnni.gemv(x, layout(values, bits, True), scale, scale, False, np.float32(0), 0, k // 32, 0, n, narrow)
    vnni.gemv(x, layout(values, 8, True), scale, scale, False, np.float32(0), 0, k // 32, 0, n, wide)
    np.testing.assert_array_equal(narrow, wide)


@pytest.mark.parametrize("qdtype,lo,hi,bits", [(dt.int8, -16, 16, 5), (dt.int8, -32, 32, 6), (dt.int8, -33, 32, 8),
                                               (dt.uint8, 0, 32, 5), (dt.uint8, 0, 64, 6), (dt.uint8, 0, 65, 8)])
def test_weights_take_the_fewest_bits_that_hold_them(qdtype, lo, hi, bits):
    q = RNG.integers(lo, hi, (64, 32)).astype(qdtype.storage)
    q[0, :2] = lo, hi - 1
    weight, center, got = kernels._vnni_weight(q, qdtype)
    assert got == bits and weight.shape == (2, 2, vnni.BLOCK_BYTES[bits])
    assert center == (0 if qdtype == dt.int8 else 1 << (bits - 1))


def write_gguf(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, raw, qtype in tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def gguf_blocks(rng, qtype, rows, cols):
    """Valid blocks: gguf's quantizer where it has one, else random bytes with finite f16 scales."""
    if qtype in (T.Q5_0, T.Q5_1):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    for off in {T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]:
        raw[:, :, off:off + 2] = (rng.standard_normal((rows, cols // bs)) * 0.02).astype(np.float16).view(
            np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype,bits", [(T.Q5_0, 5), (T.Q5_1, 5), (T.Q5_K, 5), (T.Q6_K, 6)], ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 3, 20])   # the decode GEMV, a server's rows, prefill
def test_gguf_q5_q6_multiply_in_their_bits(tmp_path, qtype, bits, m):
    """Real GGUF blocks of an awkward shape (N 48, K 2 or 3 super-blocks' worth) through a compiled
    quantized matmul with int8 activations: the 5- or 6-bit layout is the one made, and the result is
    x's int8 rounding times gguf.quants.dequantize's weight."""
    from ingot.graph import Graph
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 512 if qtype in (T.Q5_K, T.Q6_K) else 96
    raw = gguf_blocks(rng, qtype, rows, cols)
    t = read_gguf(write_gguf(tmp_path / "w.gguf", [("w", raw, qtype)])).tensors["w"]
    w_ref = gguf.quants.dequantize(raw, qtype).astype(np.float64)     # [N, K]
    km = t.to_k_major()
    g = Graph()
    extra = {"bias": g.constant(km.bias)} if km.bias is not None else {}
    deq = g.dequantize(g.constant(km.q, name="w"), scale=g.constant(km.scale), axis=0, block_size=km.block_size,
                       **extra)
    xin = g.placeholder((m, cols), dt.float32, name="x")
    before = set(kernels._REPACKED)
    exe = g.compile(targets=[g.matmul(xin, deq)], options=CompileOptions(cpu=CpuOptions(gemv_activations="int8")))
    x = rng.standard_normal((m, cols)).astype(np.float32)
    got = exe.run({"x": x})[0]
    made = [v for key, v in kernels._REPACKED.items() if key not in before]
    assert [v.shape[-1] for v in made] == [vnni.BLOCK_BYTES[bits]]
    # the integer activations' error: each x off by at most half its block's step, plus float rounding
    step = np.repeat(np.abs(x).reshape(m, -1, 32).max(-1) / 127, 32, axis=1).astype(np.float64)
    bound = (step / 2) @ np.abs(w_ref).T + 1e-5 * np.abs(x) @ np.abs(w_ref).T
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ w_ref.T), bound + 1e-30)
