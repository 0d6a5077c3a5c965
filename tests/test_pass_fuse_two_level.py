"""fuse_two_level: a quantized weight whose scale and bias are codes times a unit per super-block (the
:k formats as stored) is multiplied by the CPU kernels from the codes and units themselves."""
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.ir import Op
from ingot.options import CompileOptions, CpuOptions
from ingot.passes import evaluate
from ingot.passes.fuse_two_level import fuse_two_level
from ingot.quant.formats import TwoLevelParams

RNG = np.random.default_rng(39)


def two_level(nb, n, per_super, sign=1):
    """Codes of 6 bits and float16 units of 5 significant bits: every product a float16, as split makes them."""
    codes = RNG.integers(0, 64, (nb, n)).astype(np.uint8)
    codes[0, :2] = [0, 63]
    units = (RNG.random((nb // per_super, n)) * 1e-2 + 1e-4).astype(np.float16)
    units = (units.view(np.uint16) & np.uint16(0xFFC0)).view(np.float16)
    return TwoLevelParams(codes, (sign * units).astype(np.float16))


def build(k, n, rows, qdtype, per_super, has_bias, gather=False):
    """y = x @ W (and, with gather, W's columns 3 and n - 1, as a tied embedding reads them) for a
    k-major W in blocks of 32 whose parameters are two-level; the float W in NumPy."""
    levels = 16 if qdtype.bits == 4 else 256
    values = RNG.integers(0, levels, (k, n)) - (levels // 2 if qdtype.kind == "i" else 0)
    q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
    scale = two_level(k // 32, n, per_super)
    bias = two_level(k // 32, n, per_super, sign=-1) if has_bias else None
    weight = values * np.repeat(np.asarray(scale, np.float32), 32, axis=0)
    if bias is not None:
        weight = weight + np.repeat(np.asarray(bias, np.float32), 32, axis=0)
    g = ingot.Graph()
    x = g.placeholder((rows, k), name="x")
    param = lambda p: g.dequantize(g.constant(p.codes), axis=0, block_size=p.per_super,  # noqa: E731
                                   scale=g.constant(p.units))
    w = g.dequantize(g.constant(q, dtype=qdtype if qdtype.packed else None), axis=0, block_size=32,
                     scale=param(scale), bias=param(bias) if bias is not None else None)
    targets = [x @ w] + ([g.gather(w, np.array([3, n - 1], np.int32), axis=1)] if gather else [])
    return g, targets, weight


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4, dt.uint8, dt.int8], ids=lambda d: d.name)
@pytest.mark.parametrize("rows,n", [(1, 46), (3, 46), (17, 46), (1, 48), (5, 48)])   # 17: the tiled GEMM
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_kernels_read_codes_and_units_and_match_the_float_weight(qdtype, rows, n, has_bias, activations):
    """K 288: 9 blocks of 32 in super-blocks of 3; n 46 is no multiple of the VNNI kernel's 16 columns."""
    k, per_super = 288, 3
    g, targets, weight = build(k, n, rows, qdtype, per_super, has_bias, gather=True)
    exe = g.compile(targets=targets, options=CompileOptions(cpu=CpuOptions(gemv_activations=activations)))
    nodes = exe.program.nodes()
    assert not any(nd.op == Op.DEQUANTIZE for nd in nodes)
    fused = [nd for nd in nodes if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER)]
    assert len(fused) == 2 and all(nd.attrs["two_level"] == per_super for nd in fused)
    kept = [exe.program.constants[s.attrs["key"]] for s in fused[0].src[2:]]
    assert [p.dtype for p in kept] == [np.uint8, np.float16] * (1 + has_bias)   # codes and units, no products
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    got, columns = exe.run({"x": x})
    want = x.astype(np.float64) @ weight
    assert got.shape == (rows, n) and got.dtype == np.float32
    # float32 activations: float sums in another order; int8: x rounded to 8 bits per block of 32
    tol = 1e-5 if activations == "float32" or rows > 16 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_array_equal(columns, weight[:, [3, n - 1]].astype(np.float32))


def test_fuses_once_and_keeps_the_reference_numbers():
    g, targets, weight = build(96, 20, 2, dt.uint4, 3, True, gather=True)
    unfused = g.compile(targets=targets, options=CompileOptions(fusions=()))
    assert sum(nd.op == Op.DEQUANTIZE for nd in unfused.program.nodes()) == 2   # the parameters' (CSE: shared)
    fused, changed = fuse_two_level(unfused.program)
    assert changed and not any(nd.op == Op.DEQUANTIZE for nd in fused.nodes())
    assert not fuse_two_level(fused)[1]
    x = RNG.standard_normal((2, 96)).astype(np.float32)
    before, after = evaluate(unfused.program, {"x": x}), evaluate(fused, {"x": x})
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(unfused.run({"x": x})[0], x.astype(np.float64) @ weight, rtol=1e-5, atol=1e-4)


def test_parameters_that_are_not_constants_stay_as_they_are():
    """Units computed at run time (a placeholder), or float32 units: no two-level op."""
    g = ingot.Graph()
    x = g.placeholder((1, 64), name="x")
    units = g.placeholder((1, 8), ingot.float16, name="u")
    scale = g.dequantize(g.constant(np.ones((2, 8), np.uint8)), axis=0, block_size=2, scale=units)
    wide = g.dequantize(g.constant(np.ones((2, 8), np.uint8)), axis=0, block_size=2,
                        scale=g.constant(np.ones((1, 8), np.float32)))
    q = g.constant(np.zeros((64, 4), np.uint8), dtype=ingot.uint4)
    y = x @ g.dequantize(q, axis=0, block_size=32, scale=scale)
    z = x @ g.dequantize(q, axis=0, block_size=32, scale=wide)
    exe = g.compile(targets=[y, z])
    assert not any(nd.attrs.get("two_level") for nd in exe.program.nodes())
    got = exe.run({"x": np.ones((1, 64), np.float32), "u": np.ones((1, 8), np.float16)})
    assert all(np.array_equal(v, np.zeros((1, 8), np.float32)) for v in got)
