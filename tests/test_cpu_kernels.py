"""The CPU backend's compiled kernels against the NumPy references of their ops, on awkward shapes."""
import math

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.backends.cpu import kernels, nn_kernels, team, vnni
from ingot.ops import nn as nn_ops
from ingot.ops.quant import quantized_matmul_reference

RNG = np.random.default_rng(1234)


def kmajor_weight(k, n, qdtype, block):
    levels = 16 if qdtype.bits == 4 else 256
    values = RNG.integers(0, levels, (k, n)) - (levels // 2 if qdtype.kind == "i" else 0)
    q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
    scale = RNG.random((k // block, n), np.float32) + 0.1
    bias = RNG.standard_normal((k // block, n)).astype(np.float32)
    return q, scale, bias


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4, dt.int8, dt.uint8], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])          # 17 and 40 take the tiled GEMM path
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("block", [32, 6])                     # 6: rows left over after the 4-row passes
def test_quantized_matmul_step_matches_reference(qdtype, rows, has_bias, params, block):
    k, n = 96, 46
    q, scale, bias = kmajor_weight(k, n, qdtype, block)
    if params == np.float16:  # GGUF's own parameters; zeros and subnormals included
        scale, bias = scale.astype(np.float16), bias.astype(np.float16)
        scale[0, :3] = [0, 3e-6, -2e-7]
        bias[-1, -3:] = [0, -5e-6, 6e-8]
        assert np.all(np.abs(scale[0, 1:3].astype(np.float32)) < np.finfo(np.float16).tiny)
    g = ingot.Graph()
    x = g.placeholder((rows, k), name="x")
    params = dict(scale=g.constant(scale), bias=g.constant(bias) if has_bias else None)
    w = g.dequantize(g.constant(q, dtype=qdtype if qdtype.packed else None), axis=0, block_size=block, **params)
    exe = g.compile(targets=[x @ w])
    node = next(n for n in exe.program.nodes() if n.op.name == "QUANTIZED_MATMUL")
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    got = exe.run({"x": a})[0]
    consts = [exe.program.constants[s.attrs["key"]] for s in node.src[1:]]
    want = quantized_matmul_reference([a] + consts, node.attrs)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)  # float sums in another order


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int8], ids=lambda d: d.name)
@pytest.mark.parametrize("threads", [2, 3])
def test_gemm_splits_columns_over_threads(qdtype, threads):
    """Past GEMV_MAX_ROWS rows, a big enough quantized matmul splits its output columns over the pool
    (uneven parts with 3), each part dequantizing and multiplying its own columns."""
    from ingot.options import CompileOptions, CpuOptions
    rows, k, n, block = 40, 256, 520, 32
    q, scale, bias = kmajor_weight(k, n, qdtype, block)
    g = ingot.Graph()
    x = g.placeholder((rows, k), name="x")
    w = g.dequantize(g.constant(q, dtype=qdtype if qdtype.packed else None), axis=0, block_size=block,
                     scale=g.constant(scale), bias=g.constant(bias))
    exe = g.compile(targets=[x @ w], options=CompileOptions(cpu=CpuOptions(threads=threads)))
    assert rows * k * n >= kernels.PARALLEL_MIN_GEMM and (q.shape[1] // 64) >= threads
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    node = next(nd for nd in exe.program.nodes() if nd.op.name == "QUANTIZED_MATMUL")
    want = quantized_matmul_reference([a] + [exe.program.constants[s.attrs["key"]] for s in node.src[1:]], node.attrs)
    # float32 sums of k products in another order: the error scales with sum |x| |w|, not with the result (int8
    # weights reach ~140, so a result near 0 cancels terms of ~1000: seed-dependent 1.2e-3 misses at atol 1e-3)
    values = dt.unpack_int4(q, n, signed=False) if qdtype.packed else q
    w_abs = np.abs(values * np.repeat(scale, block, axis=0) + np.repeat(bias, block, axis=0))
    np.testing.assert_array_less(np.abs(exe.run({"x": a})[0] - want), 1e-4 * np.abs(want) + 1e-6 * (np.abs(a) @ w_abs))


def integer_activation_model(x, values, scale, offset, center, block):
    """What the int8-activation GEMV computes, in NumPy: x rounded to int8 per 32 k (d = max|x| / 127,
    round half to even), exact integer dots of the rounded x with the stored weight values minus the
    center, each weight block's scale applied in float, the center and offset times the exact x sums."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(xb * inv).astype(np.int64)
    d = (amax / np.float32(127))[..., 0].astype(np.float64)                     # [rows, k/32]
    xsum = xb.astype(np.float64).sum(axis=2)
    dots = np.einsum("rbj,bjn->rbn", xq, (values.astype(np.int64) - center).reshape(k // 32, 32, -1))
    per = np.repeat(scale.astype(np.float64), block // 32, axis=0)            # the scale row of each 32
    off = np.repeat(offset.astype(np.float64), block // 32, axis=0) if offset is not None else 0.0
    return ((dots * d[..., None] + center * xsum[..., None]) * per + off * xsum[..., None]).sum(axis=1)


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4, dt.int8, dt.uint8], ids=lambda d: d.name)
@pytest.mark.parametrize("rows,n", [(1, 46), (3, 46), (16, 46), (1, 48), (16, 48), (40, 48), (130, 48)])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("block", [32, 64, 6])                 # 6: not a multiple of 32, the float kernel
def test_integer_activation_gemv_matches_its_model(qdtype, rows, n, has_bias, params, block):
    """n = 48: the VNNI kernel where the CPU has it (its prefill in blocks of rows past 16), n = 46:
    the portable one; the same integer arithmetic either way."""
    from ingot.options import CompileOptions, CpuOptions
    if rows > 16 and block % 32:
        pytest.skip("past 16 rows the float kernel is the dequantized GEMM, tested elsewhere")
    k = 192
    levels = 16 if qdtype.bits == 4 else 256
    values = RNG.integers(0, levels, (k, n)) - (levels // 2 if qdtype.kind == "i" else 0)
    values[:, 0] = levels - 1 - (levels // 2 if qdtype.kind == "i" else 0)   # the largest products
    values[:, 1] = -(levels // 2) if qdtype.kind == "i" else 0
    q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
    scale = (RNG.random((k // block, n), np.float32) + 0.1).astype(params)
    bias = RNG.standard_normal((k // block, n)).astype(params) if has_bias else None
    g = ingot.Graph()
    xp = g.placeholder((rows, k), name="x")
    w = g.dequantize(g.constant(q, dtype=qdtype if qdtype.packed else None), axis=0, block_size=block,
                     scale=g.constant(scale), bias=g.constant(bias) if has_bias else None)
    exe = g.compile(targets=[xp @ w], options=CompileOptions(cpu=CpuOptions(gemv_activations="int8")))
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0            # a block of zeros (d = 0)
    x[-1, 32:64] *= 100      # a block far larger than the rest
    got = exe.run({"x": x})[0]
    node = next(nd for nd in exe.program.nodes() if nd.op.name == "QUANTIZED_MATMUL")
    exact = quantized_matmul_reference([x] + [exe.program.constants[s.attrs["key"]] for s in node.src[1:]], node.attrs)
    if block % 32 or (rows > 16 and not vnni.AVAILABLE):   # the exact float kernels
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5 * np.abs(exact).max())
        return
    center = {"u": levels // 2, "i": 0}[qdtype.kind]
    want = integer_activation_model(x, values, scale.astype(np.float32), None if bias is None else bias.astype(np.float32),
                                    center, block)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())  # float sums in another order
    # and the rounding of x stays within its bound beside the exact product: each x off by at most half its
    # block's step d = max|x| / 127, times the centered weight it meets (center and bias take exact x sums).
    # A fixed 0.02 of max|exact| failed ~1 run in 4 under xdist's orders (0.021, the model above matched)
    d = np.abs(x.astype(np.float64).reshape(rows, k // 32, 32)).max(axis=2) / 127
    w = (values - center) * np.repeat(scale.astype(np.float64), block, axis=0)
    bound = (d / 2) @ np.abs(w).reshape(k // 32, 32, n).sum(axis=1)
    assert np.all(np.abs(got - exact) <= bound * 1.001 + 1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("columns", [(0, 30), (0, 12), (12, 30), (4, 6)])
def test_packed_kernel_block_and_column_ranges(chunks, columns):
    """A kernel call covers blocks b0..b1 of k and writes columns c0..c1 of out, nothing else."""
    k, n, block = 64, 30, 16
    c0, c1 = columns
    q, scale, bias = kmajor_weight(k, n, dt.uint4, block)
    x = RNG.standard_normal((2, k)).astype(np.float32)
    out = np.zeros((2, n), np.float32)
    nb = k // block
    bounds = [nb * i // chunks for i in range(chunks + 1)]
    for b0, b1 in zip(bounds, bounds[1:]):
        part = np.full_like(out, np.nan)
        kernels.kmajor_packed4(x, q, scale, bias, True, np.uint32(0), b0, b1, c0, c1, part)
        assert np.isnan(part[:, :c0]).all() and np.isnan(part[:, c1:]).all()
        out[:, c0:c1] += part[:, c0:c1]
    w = dt.unpack_int4(q, n, signed=False).astype(np.float32) * np.repeat(scale, block, 0) + np.repeat(bias, block, 0)
    np.testing.assert_allclose(out[:, c0:c1], (x @ w)[:, c0:c1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tq,length,causal,window,softcap", [
    (1, 1, True, 0, 0.0), (1, 37, True, 0, 0.0), (5, 29, True, 0, 0.0), (3, 11, False, 0, 0.0), (33, 33, True, 0, 0.0),
    (40, 57, True, 0, 0.0), (1, 37, True, 7, 0.0), (5, 29, True, 3, 1.5), (40, 57, True, 11, 0.0), (33, 33, True, 1, 2.0),
    (3, 11, False, 0, 0.7)])
def test_attention_kernels_match_reference(tq, length, causal, window, softcap):
    q = RNG.standard_normal((1, 6, tq, 24)).astype(np.float32)
    k = RNG.standard_normal((1, 2, 64, 24)).astype(np.float32)
    v = RNG.standard_normal((1, 2, 64, 20)).astype(np.float32)
    scale = np.float32(1 / math.sqrt(24))
    want = nn_ops.sdpa(q, k, v, None, length, float(scale), causal, window, softcap)
    out = np.empty((1, 6, tq, 20), np.float32)
    nn_kernels.attention(q, k, v, length, scale, causal, window, np.float32(softcap), out)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    if length >= tq:
        np.testing.assert_allclose(nn_kernels.attention_blas(q, k, v, length, scale, causal, window, softcap), want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [None, 10])
def test_rope_kernel(interleaved, rd):
    from ingot.ir import Node, Op, TensorType
    x = RNG.standard_normal((2, 3, 7, 14)).astype(np.float32)
    node = Node(Op.ROPE, TensorType(x.shape), (), {"base": 500.0, "interleaved": interleaved, "rotary_dims": rd})
    got = nn_kernels.rope_step(node)(x, np.int32(5))
    np.testing.assert_allclose(got, nn_ops.rope(x, 5, None, 500.0, interleaved, rd), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tq,length,causal,window", [(64, 64, True, 0), (100, 130, True, 0), (80, 80, True, 9),
                                                      (70, 90, False, 0)])
@pytest.mark.parametrize("threads", [2, 3])
def test_prefill_attention_split_over_threads(tq, length, causal, window, threads, monkeypatch):
    """Prefill attention cut into query ranges of equal work over the pool equals the reference."""
    monkeypatch.setitem(nn_kernels.SPLIT, "threads", threads)
    q = RNG.standard_normal((1, 6, tq, 16)).astype(np.float32)
    k = RNG.standard_normal((1, 2, 160, 16)).astype(np.float32)
    v = RNG.standard_normal((1, 2, 160, 12)).astype(np.float32)
    want = nn_ops.sdpa(q, k, v, None, length, 0.25, causal, window, 0.0)
    np.testing.assert_allclose(nn_kernels.attention_blas(q, k, v, length, np.float32(0.25), causal, window), want,
                               rtol=1e-5, atol=1e-5)


def test_rms_norm_and_silu():
    x = RNG.standard_normal((5, 33)).astype(np.float32) * 3
    w = RNG.standard_normal(33).astype(np.float32)
    np.testing.assert_allclose(nn_kernels.rms_norm(x, w, np.float32(1e-5)), nn_ops.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nn_kernels.silu(x), x / (1 + np.exp(-x.astype(np.float64))), rtol=1e-5, atol=1e-6)


def _kernel_cases(k, n, rows):
    """(kernel, its leading arguments, blocks) for every GEMV kernel the team drives, on one random
    weight each (float16 parameters for two of them)."""
    from ingot.backends.cpu import lut_kernels
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    q4, scale, bias = kmajor_weight(k, n, dt.int4, 32)
    q8, _, _ = kmajor_weight(k, n, dt.int8, 32)
    h = lambda a: a.astype(np.float16).view(np.uint16)  # noqa: E731  (the kernels' form of float16)
    table = RNG.standard_normal(16).astype(np.float32)
    cases = [(kernels.kmajor_packed4, (x, q4, scale, bias, True, np.uint32(0x88)), k // 32),
             (kernels.kmajor_packed4, (x, q4, h(scale), h(bias), True, np.uint32(0)), k // 32),
             (kernels.kmajor_int8, (x, q8, scale, bias, True), k // 32),
             (kernels.kmajor_packed4_xq, (x, q4, scale, bias, True, np.uint8(0), np.float32(8)), k // 32),
             (kernels.kmajor_int8_xq, (x, q8, h(scale), h(bias), True, np.int8(0), np.float32(0)), k // 32),
             (lut_kernels.scaled_lut_gemv_packed4, (x, q4, table, scale), k // 32)]
    if lut_kernels.SHUFFLE:
        cases.append((lut_kernels.scaled_lut_gemv_int, (x, q4, np.arange(-8, 8, dtype=np.int8), scale), k // 32))
    two = two_level_params(k // 32, n, 1)   # the :k formats as stored: codes x units (block_params.py)
    cases.append((kernels.kmajor_packed4, (x, q4, two, two_level_params(k // 32, n, 1, -1), True, np.uint32(0)), k // 32))
    if vnni.AVAILABLE and n % vnni.GROUP == 0:
        cases.append((vnni.gemv, (x, vnni.repack(q4, 0x88), h(scale), h(bias), True, np.float32(0)), k // 32))
        cases.append((vnni.gemv, (x, vnni.repack(q4, 0), two, two, False, np.float32(8)), k // 32))
        cases.append((vnni.gemv, (x, vnni.repack8(q8, 0x80), scale, bias, True, np.float32(0)), k // 32))
    return cases


def two_level_params(nb, n, per_super, sign=1):
    """Two-level parameters as the kernels take them (codes, units' float16 bits, S), every product a
    float16 (5 significant bits in the units, codes of 6 bits), and those products' float16 bits."""
    codes = RNG.integers(0, 64, (nb, n)).astype(np.uint8)
    units = ((RNG.random((-(-nb // per_super), n)) * 0.1 + 0.01).astype(np.float16).view(np.uint16) & np.uint16(0xFFC0))
    units = (sign * units.view(np.float16)).astype(np.float16)
    return codes, units.view(np.uint16), np.int64(per_super)


def two_level_products(p):
    codes, units, per_super = p
    return (codes * np.repeat(units.view(np.float16).astype(np.float32), per_super, axis=0)[:codes.shape[0]]
            ).astype(np.float16).view(np.uint16)


@pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("k,n,rows", [(96, 48, 3), (288, 400, 16)])
@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int8], ids=lambda d: d.name)
@pytest.mark.parametrize("per_super", [1, 3])
def test_vnni_gemv_reads_two_level_parameters_as_their_products(k, n, rows, qdtype, per_super):
    """Codes times units read 16 at a time (BlockIR.two_level_params) give the float16 products'
    result, super-blocks of 1 and 3 blocks: bit for bit without the offset; with it, to float32
    rounding (the compiler may fold code * unit * xsum in another order under fastmath)."""
    q, _, _ = kmajor_weight(k, n, qdtype, 32)
    w = vnni.repack(q, 0) if qdtype.packed else vnni.repack8(q, 0x80)
    center = np.float32(8 if qdtype.packed else 0)
    scale, bias = two_level_params(k // 32, n, per_super), two_level_params(k // 32, n, per_super, -1)
    x = RNG.standard_normal((rows, k)).astype(np.float32) * 3
    for has_offset in (True, False):
        want, got = np.empty((rows, n), np.float32), np.full((rows, n), np.nan, np.float32)
        vnni.gemv(x, w, two_level_products(scale), two_level_products(bias), has_offset, center, 0, k // 32, 0, n, want)
        vnni.gemv(x, w, scale, bias, has_offset, center, 0, k // 32, 0, n, got)
        np.testing.assert_allclose(got, want, rtol=1e-6 * has_offset, atol=1e-6 * has_offset * np.abs(want).max())


@pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("k,n,rows", [(32, 16, 1), (96, 48, 3), (320, 400, 16)])
@pytest.mark.parametrize("qdtype", [dt.uint8, dt.int8], ids=lambda d: d.name)
def test_vnni_gemv_8bit_equals_the_portable_integer_kernel(k, n, rows, qdtype):
    q, scale, bias = kmajor_weight(k, n, qdtype, 32)
    scale, bias = scale.astype(np.float16).view(np.uint16), bias.astype(np.float16).view(np.uint16)
    x = RNG.standard_normal((rows, k)).astype(np.float32) * 3
    unsigned = qdtype == dt.uint8
    want = np.empty((rows, n), np.float32)
    kernels.kmajor_int8_xq(x, q, scale, bias, True, np.uint8(0x80) if unsigned else np.int8(0),
                           np.float32(128 if unsigned else 0), 0, k // 32, 0, n, want)
    got = np.full((rows, n), np.nan, np.float32)
    vnni.gemv(x, vnni.repack8(q, 0 if unsigned else 0x80), scale, bias, True, np.float32(128 if unsigned else 0),
              0, k // 32, 0, n, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("k,n,rows", [(32, 16, 1), (96, 48, 3), (320, 400, 16)])
@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4], ids=lambda d: d.name)
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
def test_vnni_gemv_equals_the_portable_integer_kernel(k, n, rows, qdtype, params):
    """Same rounding of x, same integer dot products: the VNNI kernel's output equals the portable
    int8-activation kernel's to float rounding, block and column ranges included."""
    q, scale, bias = kmajor_weight(k, n, qdtype, 32)
    if params == np.float16:
        scale, bias = scale.astype(np.float16).view(np.uint16), bias.astype(np.float16).view(np.uint16)
    x = RNG.standard_normal((rows, k)).astype(np.float32) * 3
    flip, center = (0, 8) if qdtype == dt.uint4 else (0x88, 0)
    want = np.empty((rows, n), np.float32)
    kernels.kmajor_packed4_xq(x, q, scale, bias, True, np.uint8(flip), np.float32(center), 0, k // 32, 0, n, want)
    got = np.full((rows, n), np.nan, np.float32)
    vnni.gemv(x, vnni.repack(q, flip), scale, bias, True, np.float32(center), 0, k // 32, 0, n, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if n < 48:
        return
    part = np.full((rows, n), np.nan, np.float32)
    vnni.gemv(x, vnni.repack(q, flip), scale, bias, False, np.float32(center), 0, 1, 16, 32, part)
    assert np.isnan(part[:, :16]).all() and np.isnan(part[:, 32:]).all()
    ref = np.empty((rows, n), np.float32)
    kernels.kmajor_packed4_xq(x, q, scale, bias, False, np.uint8(flip), np.float32(center), 0, 1, 0, n, ref)
    np.testing.assert_allclose(part[:, 16:32], ref[:, 16:32], rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("k,n,rows", [(256, 64, 2), (96, 4160, 3), (64, 4096 + 2050, 1)])
@pytest.mark.parametrize("threads", [2, 3])
def test_team_matches_one_thread(k, n, rows, threads):
    """Every GEMV kernel split over a team (along k for narrow outputs, along columns for wide ones:
    n >= SPLIT_COLUMNS, ragged last chunk) gives the one-thread result."""
    for kernel, head, nb in _kernel_cases(k, n, rows):
        serial, threaded = np.empty((rows, n), np.float32), np.full((rows, n), np.nan, np.float32)
        team.split_blocks(kernel, head, nb, serial, 0)
        team.split_blocks(kernel, head, nb, threaded, 10**9, threads=threads)
        np.testing.assert_allclose(threaded, serial, rtol=1e-5, atol=1e-4, err_msg=kernel.__name__)


def test_team_under_contention():
    """Many small jobs from two Python threads at once: the one that finds the team busy runs alone;
    every result is right, and a worker that slept between jobs is woken."""
    import threading
    import time
    cases = _kernel_cases(128, 96, 2)[:2]
    want = []
    for kernel, head, nb in cases:
        want.append(np.empty((2, 96), np.float32))
        kernel(*head, 0, nb, 0, 96, want[-1])
    errors = []

    def hammer(i):
        kernel, head, nb = cases[i]
        for j in range(300):
            out = np.empty((2, 96), np.float32)
            team.split_blocks(kernel, head, nb, out, 10**9, threads=2)
            if not np.allclose(out, want[i], rtol=1e-5, atol=1e-4):
                errors.append((i, j))
            if j == 150:
                time.sleep(0.05)  # past the workers' spin: they sleep, the next job wakes them
    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("hardware", [True, False], ids=["fpext", "shifts"])
def test_half_parameters_convert_exactly(hardware, monkeypatch):
    """Every finite float16 (zeros and subnormals included) as the kernels read it equals numpy's,
    widened by the hardware (F16C's VCVTPH2PS) or by shifting the bits where it has none."""
    import numba
    from ingot.backends.cpu import block_params
    if hardware and not block_params.F16C:
        pytest.skip("the host has no float16 conversion instructions")
    monkeypatch.setattr(block_params, "F16C", hardware)   # read when a caller compiles: a fresh one below

    @numba.njit(fastmath=True)
    def convert(bits, out):
        for b in range(bits.shape[0]):
            row = bits[b]
            for i in range(row.shape[0]):
                out[b, i] = kernels.param(row, i)

    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)].reshape(-1, 62)  # 63488 finite values: 1024 rows of 62
    got = np.empty(halves.shape, np.float32)
    convert(halves.view(np.uint16), got)
    np.testing.assert_array_equal(got.view(np.uint32), halves.astype(np.float32).view(np.uint32))


def test_erf_kernel():
    """The CPU backend's float32 erf (a rational approximation) against float64 erf."""
    x = np.concatenate([RNG.standard_normal(5000) * 3, np.linspace(-8, 8, 4001), [0.0, -0.0, 1e-30, -1e-12]]).astype(np.float32)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    got = nn_kernels.erf(x.reshape(-1, 1))
    assert got.shape == (x.size, 1) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-6, atol=5e-7)
    assert np.isnan(nn_kernels.erf(np.float32([np.nan])))[0]


@pytest.mark.parametrize("has_w,has_b", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_kernel(has_w, has_b):
    x = (RNG.standard_normal((3, 5, 37)) * 4 + 2).astype(np.float32)
    w = RNG.standard_normal(37).astype(np.float32) if has_w else None
    b = RNG.standard_normal(37).astype(np.float32) if has_b else None
    got = nn_kernels.layer_norm(x, w, b, np.float32(1e-5))
    np.testing.assert_allclose(got, nn_ops.layer_norm(x, w, b, 1e-5), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", [(80, 1, 37), (1, 1), (3, 129), (2, 3, 5, 64)])
def test_softmax_lowering_matches_reference(op, shape):
    """(log_)softmax along the last axis through the CPU lowering: wide ranges, -inf, one-element rows."""
    from ingot.backends.cpu import LOWERINGS
    from ingot.ir import Node, Op, TensorType
    from ingot.ops import reference
    which = Op.SOFTMAX if op == "softmax" else Op.LOG_SOFTMAX
    x = (RNG.standard_normal(shape) * 20).astype(np.float32)
    x.reshape(-1, shape[-1])[0, 0] = -np.inf      # a masked entry: exactly 0 (log: -inf)
    x.reshape(-1, shape[-1])[-1, -1] = 80.0       # far above the rest of its row
    attrs = {"axis": len(shape) - 1}
    node = Node(which, TensorType(shape), (Node(Op.PLACEHOLDER, TensorType(shape), (), {}, name="x"),), attrs)
    got = LOWERINGS[which](node, None)(x)
    want = reference(which, [x], attrs)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert x.size == 1 or got.reshape(-1)[0] == (0.0 if op == "softmax" else -np.inf)
    assert np.isnan(LOWERINGS[which](node, None)(np.full(shape, np.nan, np.float32))).all()
    one = x.copy()   # one NaN (past the four running maxima's first values): its row NaN, the others kept
    one.reshape(-1, shape[-1])[0, -1] = np.nan
    got = LOWERINGS[which](node, None)(one).reshape(-1, shape[-1])
    assert np.isnan(got[0]).all() and not np.isnan(got[1:]).any()


@pytest.mark.parametrize("shape,k,n", [((80, 1), 256, 37), ((3, 5), 7, 1), ((2, 1, 4), 33, 65)])
@pytest.mark.parametrize("transposed", [False, True])
def test_stacked_matmul_by_a_matrix(shape, k, n, transposed):
    """[..., K] @ [K, N] on the CPU: the stack as one GEMM, from a contiguous input or a transposed view."""
    g = ingot.Graph()
    full = shape + (k,)
    x = g.placeholder(full[::-1] if transposed else full, name="x")
    w = RNG.standard_normal((k, n)).astype(np.float32)
    a = g.transpose(x, list(range(len(full)))[::-1]) if transposed else x
    exe = g.compile(targets=[g.matmul(a * 1.0, g.constant(w)) + 0.0])
    feed = RNG.standard_normal(full[::-1] if transposed else full).astype(np.float32)
    got = exe.run({"x": feed})[0]
    want = (feed.transpose(list(range(len(full)))[::-1]) if transposed else feed).astype(np.float64) @ w
    assert got.shape == shape + (n,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)   # sums of up to 256 products near 1: float32 rounding


def test_exp_below_its_range_is_zero_and_softmax_leaves_no_subnormals():
    """exp_negative is 0 below -87, not exp(-87): a masked key's weight (1.6e-38 / sum) was subnormal,
    which Intel cores take ~100 cycles a value to multiply (an encoder's P @ V 28 -> 669 us)."""
    from ingot.backends.cpu import nn_kernels
    assert nn_kernels.exp_negative(np.float32(-87.5)) == 0.0
    assert abs(nn_kernels.exp_negative(np.float32(-86.0)) - np.exp(np.float32(-86.0))) <= 1e-6 * np.exp(-86.0)
    rng = np.random.default_rng(9)
    s = (rng.standard_normal((1, 3, 17, 40)) * 20).astype(np.float32)
    mask = np.zeros((1, 1, 1, 40), np.float32)
    mask[..., 33:] = -10000.0
    want = s * np.float32(0.3) + mask
    want = np.exp(want - want.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    nn_kernels.masked_softmax(s, mask, np.float32(0.3), False)
    assert not np.any((s != 0) & (np.abs(s) < np.finfo(np.float32).tiny))
    assert np.all(s[..., 33:] == 0)
    np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-7)
