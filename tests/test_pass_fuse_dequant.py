"""fuse_dequantize: dequantize -> matmul / gather becomes one quantized op; no float weight exists."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ingot
from ingot import dtypes as dt
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fold import fold_constants
from ingot.passes.fuse_dequant import fuse_dequantize
from ingot.runtime import Executable

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=20)
RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15)}


def quantized_weight(rng, shape, qdtype, granularity, axis, block, zero_point):
    """(stored integers, params as the user gives them, float weight computed in NumPy)."""
    lo, hi = RANGES[qdtype.name]
    values = rng.integers(lo, hi + 1, size=shape)
    stored = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
    if granularity == "tensor":
        pshape, full = (), lambda p: p
    elif granularity == "axis":
        pshape, full = (shape[axis],), lambda p: np.expand_dims(p, 1 - axis)
    else:
        pshape, full = (shape[axis] // block,), lambda p: np.expand_dims(np.repeat(p, block), 1 - axis)
    scale = rng.uniform(0.01, 0.1, size=pshape).astype(np.float32)
    zp = rng.integers(lo, hi + 1, size=pshape).astype(np.float32) if zero_point else None
    weight = (values - (full(zp) if zero_point else 0)) * full(scale)
    return stored, scale, zp, weight.astype(np.float64)


def build(m, k, n, qdtype, granularity, zero_point, transpose, seed=0):
    rng = np.random.default_rng(seed)
    g = ingot.Graph()
    x = g.placeholder((m, k), name="x")
    wshape = (n, k) if transpose else (k, n)
    axis = 1 if transpose else 0  # scales along the reduction axis for blocks, along it for per-axis too
    block = 2 if granularity == "block" else None
    stored, scale, zp, weight = quantized_weight(rng, wshape, qdtype, granularity, axis, block, zero_point)
    q = g.constant(stored, dtype=qdtype, name="w_q")
    w = g.dequantize(q, scale=g.constant(scale, name="w_scale"),
                     zero_point=None if zp is None else g.constant(zp, name="w_zero"),
                     axis=None if granularity == "tensor" else axis, block_size=block)
    y = g.matmul(x, g.transpose(w) if transpose else w)
    xv = rng.standard_normal((m, k)).astype(np.float32)
    expected = xv.astype(np.float64) @ (weight.T if transpose else weight)
    return g, y, {"x": xv}, expected


@HYPOTHESIS
@given(m=st.integers(1, 20), k_half=st.integers(1, 8), n=st.integers(1, 9),
       qdtype=st.sampled_from([ingot.int8, ingot.uint8, ingot.int4, ingot.uint4]),
       granularity=st.sampled_from(["tensor", "axis", "block"]), zero_point=st.booleans(), transpose=st.booleans())
def test_fuses_and_keeps_the_numbers(m, k_half, n, qdtype, granularity, zero_point, transpose):
    k = 2 * k_half
    if qdtype.packed and not transpose:
        n += n % 2  # 4-bit values pack in pairs along the last axis, here N
    g, y, feeds, expected = build(m, k, n, qdtype, granularity, zero_point, transpose)
    before = Program([y.node], [], dict(g.constants))
    after, changed = fuse_dequantize(before)
    assert changed
    ops = [node.op for node in after.nodes()]
    assert ops.count(Op.QUANTIZED_MATMUL) == 1
    assert Op.DEQUANTIZE not in ops and Op.MATMUL not in ops
    assert after.outputs[0].attrs["transpose"] == transpose
    (unfused,) = evaluate(before, feeds)
    (fused,) = Executable(after).run(feeds)
    np.testing.assert_allclose(unfused, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fused, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("qdtype", [ingot.int8, ingot.uint4])
def test_compiled_program_never_holds_a_float_weight(qdtype, transpose):
    m, k, n = 3, 64, 48
    g, y, feeds, expected = build(m, k, n, qdtype, "block", True, transpose, seed=1)
    exe = g.compile(targets=[y])
    nodes = exe.program.nodes()
    assert [node.op for node in nodes].count(Op.QUANTIZED_MATMUL) == 1
    float_shapes = {(k, n), (n, k)}
    assert not [node for node in nodes if node.shape in float_shapes and node.dtype.is_float]
    for key, value in exe.program.constants.items():
        assert not (value.dtype.kind == "f" and value.size >= k * n), key
    np.testing.assert_allclose(exe.run(feeds)[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_of_a_dequantized_table(axis):
    rng = np.random.default_rng(2)
    g = ingot.Graph()
    stored, scale, _, weight = quantized_weight(rng, (6, 8), ingot.int4, "axis", 0, None, False)
    table = g.dequantize(g.constant(stored, dtype=ingot.int4), scale=scale, axis=0)
    idx = g.placeholder((3,), ingot.int32, name="idx")
    y = g.gather(table, idx, axis=axis)
    before = Program([y.node], [], dict(g.constants))
    after, changed = fuse_dequantize(before)
    assert changed
    ops = [node.op for node in after.nodes()]
    assert Op.QUANTIZED_GATHER in ops and Op.DEQUANTIZE not in ops and Op.GATHER not in ops
    feeds = {"idx": np.array([5, 0, 2], np.int32)}
    expected = np.take(weight, feeds["idx"], axis=axis)
    np.testing.assert_allclose(Executable(after).run(feeds)[0], expected, rtol=1e-6)
    np.testing.assert_allclose(evaluate(before, feeds)[0], expected, rtol=1e-6)


def test_leaves_float_matmul_and_mismatched_dtypes():
    g = ingot.Graph()
    x = g.placeholder((2, 4), name="x")
    w = g.dequantize(g.constant(np.ones((4, 3), np.int8)), scale=0.5, dtype=ingot.float16)
    y16 = g.matmul(g.cast(x, ingot.float16), w)  # fused: both float16
    y32 = g.matmul(x, g.constant(np.ones((4, 3), np.float32)))  # no dequantize at all
    after, changed = fuse_dequantize(Program([y32.node], [], dict(g.constants)))
    assert not changed and after.outputs[0].op == Op.MATMUL
    after, changed = fuse_dequantize(Program([y16.node], [], dict(g.constants)))
    assert changed and after.outputs[0].op == Op.QUANTIZED_MATMUL


def test_gathers_bfloat16_rows_before_the_cast():
    """gather(cast(W_bf16, float32), idx) -> cast(gather(W_bf16, idx)): only the rows read are widened."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((7, 50)).astype(dt.bfloat16.storage)
    g = ingot.Graph()
    idx = g.placeholder((3,), dt.int32, name="idx")
    y = g.gather(g.cast(g.constant(table), dt.float32), idx, axis=1)
    before = Program([y.node], [], dict(g.constants))
    after, changed = fuse_dequantize(before)
    assert changed
    out = after.outputs[0]
    assert out.op == Op.CAST and out.src[0].op == Op.GATHER and out.src[0].src[0].dtype == dt.bfloat16
    assert out.type == y.node.type
    feeds = {"idx": np.array([49, 0, 7], np.int32)}
    np.testing.assert_array_equal(evaluate(after, feeds)[0], evaluate(before, feeds)[0])
    float_table = Program([g.gather(g.constant(table.astype(np.float32)), idx, axis=1).node], [], dict(g.constants))
    assert not fuse_dequantize(float_table)[1]  # a float32 table is left alone


def test_conv_weight_is_dequantized_once_at_compile():
    """conv(x, dequantize(q_const)) -> conv(x, float constant): the numbers of the unfused program."""
    rng = np.random.default_rng(3)
    stored, scale, zp, weight = quantized_weight(rng, (6, 12), ingot.uint8, "axis", 0, None, True)
    g = ingot.Graph()
    x = g.placeholder((2, 4, 7, 5), name="x")
    w = g.dequantize(g.constant(stored.reshape(6, 2, 3, 2)), scale=g.constant(scale.reshape(6, 1, 1, 1)),
                     zero_point=g.constant(zp.reshape(6, 1, 1, 1)))
    y = g.conv(x, w, strides=(2, 1), pads=((1, 1), (0, 0)), groups=2)
    before = Program([y.node], [], dict(g.constants))
    after, changed = fuse_dequantize(before)
    assert changed
    conv = after.outputs[0]
    assert conv.op == Op.CONV and conv.src[1].op == Op.CONSTANT and Op.DEQUANTIZE not in [n.op for n in after.nodes()]
    np.testing.assert_allclose(after.constants[conv.src[1].attrs["key"]].reshape(6, 12), weight, rtol=1e-6)
    assert set(before.constants) < set(after.constants)   # the dequantized weight is added to a copy
    feeds = {"x": rng.standard_normal((2, 4, 7, 5)).astype(np.float32)}
    np.testing.assert_allclose(Executable(after).run(feeds)[0], evaluate(before, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_unit_scale_dequantize_times_a_constant_takes_it_as_its_scale():
    """dequantize(q, 1) * c (a weight written as cast and multiply) -> dequantize(q, c) -> quantized_matmul,
    the same float32 products; a scale other than 1 is left alone ((q * s) * c is not q * (s * c))."""
    rng = np.random.default_rng(4)
    q = rng.integers(-128, 128, (9, 6)).astype(np.int8)
    c = rng.uniform(0.01, 0.1, (1, 6)).astype(np.float32)
    g = ingot.Graph()
    x = g.placeholder((3, 9), name="x")
    w = g.dequantize(g.constant(q), scale=g.constant(np.float32(1))) * g.constant(c)
    y = g.matmul(x, w)
    before = Program([y.node], [], dict(g.constants))
    after, changed = fuse_dequantize(fold_constants(before)[0])   # (fold makes the reshaped scales constants)
    assert changed and after.outputs[0].op == Op.QUANTIZED_MATMUL
    assert Op.MUL not in [n.op for n in after.nodes()]
    feeds = {"x": rng.standard_normal((3, 9)).astype(np.float32)}
    np.testing.assert_array_equal(evaluate(Program([w.node], [], dict(g.constants)), {})[0], q.astype(np.float32) * c)
    np.testing.assert_allclose(Executable(after).run(feeds)[0], evaluate(before, feeds)[0], rtol=1e-5, atol=1e-5)
    h = ingot.Graph()
    scaled = h.dequantize(h.constant(q), scale=h.constant(np.float32(0.5))) * h.constant(c)
    kept, _ = fuse_dequantize(fold_constants(Program([scaled.node], [], dict(h.constants)))[0])
    assert kept.outputs[0].op == Op.MUL
