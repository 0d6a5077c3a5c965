"""fold_constants: constant subgraphs are computed at compile time, never a dequantize."""
import numpy as np

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fold import MAX_ELEMENTS, fold_constants
from ingot.runtime import Executable


def program_of(g, *outs) -> Program:
    return Program([o.node for o in outs], [], dict(g.constants), dict(g.variables))


def test_computes_a_constant_subgraph():
    g = ingot.Graph()
    x = g.placeholder((3,), name="x")
    a = g.constant(np.array([1, 2, 3], np.float32))
    b = g.constant(np.array([4, 5, 6], np.float32))
    y = x + g.exp(a * b - 30.0)
    before = program_of(g, y)
    after, changed = fold_constants(before)
    assert changed
    out = after.outputs[0]
    assert out.op == Op.ADD and out.src[1].op == Op.CONSTANT
    folded = after.constants[out.src[1].attrs["key"]]
    np.testing.assert_allclose(folded, np.exp(np.array([4, 10, 18], np.float32) - 30), rtol=1e-6)
    assert [n.op for n in after.nodes()].count(Op.CONSTANT) == 1
    assert len(before.constants) == 3  # the input program's store is untouched
    feeds = {"x": np.ones(3, np.float32)}
    np.testing.assert_allclose(Executable(after).run(feeds)[0], evaluate(before, feeds)[0], rtol=1e-6)


def test_scalar_stays_scalar():
    g = ingot.Graph()
    x = g.placeholder((), name="x")
    y = x * (g.constant(2.0) * g.constant(3.0))
    after, changed = fold_constants(program_of(g, y))
    assert changed
    scale = after.outputs[0].src[1]
    assert after.constants[scale.attrs["key"]].shape == () and scale.type.shape == ()
    assert g.compile(targets=[y]).run({"x": np.float32(1.5)})[0].shape == ()


def test_folded_dtype_is_the_node_dtype():
    g = ingot.Graph()
    y = g.cast(g.constant(np.array([1.7, -2.2], np.float32)), ingot.int32) + g.constant(np.int32(1))
    after, _ = fold_constants(program_of(g, y))
    value = after.constants[after.outputs[0].attrs["key"]]
    assert value.dtype == np.int32 and value.tolist() == [2, -1]


def test_never_folds_a_dequantize():
    g = ingot.Graph()
    x = g.placeholder((2, 4), name="x")
    w = g.dequantize(g.constant(np.ones((4, 3), np.int8)), scale=g.constant(np.float32(0.5)) * 2.0)
    y = g.matmul(x, w)
    after, changed = fold_constants(program_of(g, y))
    assert changed  # the scale product is folded ...
    ops = [n.op for n in after.nodes()]
    assert Op.DEQUANTIZE in ops and Op.MUL not in ops  # ... the dequantize is not
    assert not [v for v in after.constants.values() if v.dtype.kind == "f" and v.shape == (4, 3)]


def test_skips_broadcasts_and_big_results():
    g = ingot.Graph()
    b = g.broadcast_to(g.constant(np.float32(1)), (8, 8))
    big = g.constant(np.ones(MAX_ELEMENTS + 1, np.float32)) * 2.0
    after, changed = fold_constants(program_of(g, b, big))
    assert not changed
    assert [n.op for n in after.outputs] == [Op.BROADCAST_TO, Op.MUL]


def test_static_dim_becomes_a_constant():
    g = ingot.Graph()
    x = g.placeholder((None, 4), name="x")
    n = g.dim(x, 0)
    exe = g.compile(feeds={x: ingot.TensorType((5, 4))}, targets=[n + 1])
    assert exe.program.outputs[0].op == Op.CONSTANT
    assert int(exe.run({"x": np.zeros((5, 4), np.float32)})[0]) == 6


def test_nothing_constant_nothing_changed():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    after, changed = fold_constants(program_of(g, g.exp(x) * 2.0))
    assert not changed


def test_keeps_a_bfloat16_weight_bfloat16():
    """cast(bf16 matrix, float32) is the float copy the backends avoid: not folded; a float16
    matrix and a bf16 vector still fold."""
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((2, 6), name="x")
    w16 = rng.standard_normal((6, 5)).astype(ingot.bfloat16.storage)
    wide = g.cast(g.constant(w16), ingot.float32)
    half = g.cast(g.constant(rng.standard_normal((6, 5)).astype(np.float16)), ingot.float32)
    vector = g.cast(g.constant(rng.standard_normal(5).astype(ingot.bfloat16.storage)), ingot.float32)
    y = g.matmul(x, wide) + g.matmul(x, half) + vector
    before = program_of(g, y)
    after, changed = fold_constants(before)
    assert changed
    casts = [n for n in after.nodes() if n.op == Op.CAST]
    assert len(casts) == 1 and casts[0].src[0].op == Op.CONSTANT and casts[0].src[0].dtype == ingot.bfloat16
    feeds = {"x": rng.standard_normal((2, 6)).astype(np.float32)}
    np.testing.assert_allclose(evaluate(after, feeds)[0], evaluate(before, feeds)[0], rtol=1e-6)


def test_a_slice_of_a_constant_up_to_a_fixed_dim_folds_to_its_static_length():
    """iota[:dim(x, 0)]: once compile fixes x's length, the slice's open length becomes that of a constant,
    and what is computed from it is static again (Mistral 3's positions of a chunk)."""
    from ingot import dtypes as dt
    from ingot.ir import TensorType

    g = ingot.Graph()
    x = g.placeholder((None, 4), name="x")
    iota = g.constant(np.arange(16, dtype=np.int32))
    y = g.reshape(g.slice(iota, [0], [g.dim(x, 0)]) * 2, (-1, 1))
    assert y.node.type.shape == (None, 1)
    exe = g.compile(feeds={"x": TensorType((5, 4), dt.float32)}, targets=[y])
    (out,) = exe.program.outputs
    assert out.op == Op.CONSTANT and out.type.shape == (5, 1)
    np.testing.assert_array_equal(exe.run({"x": np.zeros((5, 4), np.float32)})[0], np.arange(0, 10, 2)[:, None])
