"""The CPU lowerings of a gather by one index (a basic index and a copy) and of a 2-D matmul into a planned
buffer (np.dot), against the NumPy references: every axis, negative indices, out of range refused, a 1-D
source's scalar, and results that are arrays of their own."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.ops import REGISTRY


@pytest.mark.parametrize("shape,axis", [((15, 1, 32), 0), ((3, 5, 2), 1), ((4, 7), 1), ((6,), 0)])
@pytest.mark.parametrize("index", [0, -1, 2, -3])
def test_gather_one_index_equals_the_reference(shape, axis, index):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    g = ingot.Graph()
    xi, ii = g.placeholder(shape, name="x"), g.placeholder((), ingot.int64, name="i")
    exe = g.compile(targets=[g.gather(xi, ii, axis=axis)])
    node = next(n for n in exe.program.nodes() if n.op == Op.GATHER)
    want = REGISTRY[Op.GATHER].reference((x, np.array(index)), node.attrs)
    (got,) = exe.run({"x": x, "i": np.array(index, np.int64)})
    np.testing.assert_array_equal(got, want)
    assert np.shape(got) == np.shape(want) and not np.shares_memory(got, x)


@pytest.mark.parametrize("index", [15, -16, 2 ** 40])
def test_gather_one_index_out_of_range_is_refused(index):
    g = ingot.Graph()
    xi, ii = g.placeholder((15, 4), name="x"), g.placeholder((), ingot.int64, name="i")
    exe = g.compile(targets=[g.gather(xi, ii)])
    with pytest.raises(ingot.IngotError, match="gather"):
        exe.run({"x": np.zeros((15, 4), np.float32), "i": np.array(index, np.int64)})



def test_gather_one_index_into_its_planned_buffer():
    """An intermediate gather (read by a sigmoid) writes its planned buffer: right on every run, and an
    earlier run's result left as it was."""
    x = np.random.default_rng(2).standard_normal((5, 3, 4)).astype(np.float32)
    g = ingot.Graph()
    xi, ii = g.placeholder(x.shape, name="x"), g.placeholder((), ingot.int64, name="i")
    y = g.sigmoid(g.gather(xi, ii, axis=1))
    exe = g.compile(targets=[y])
    node = next(n for n in exe.program.nodes() if n.op == Op.GATHER)
    assert node.id in exe.program.memory_plan
    results = [exe.run({"x": x, "i": np.array(i, np.int64)})[0] for i in (0, 2, -2)]
    for got, i in zip(results, (0, 2, -2)):
        np.testing.assert_allclose(got, 1 / (1 + np.exp(-x[:, i])), rtol=1e-6)

def test_matmul_of_two_matrices_into_a_buffer():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((1, 32)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)
    g = ingot.Graph()
    ai = g.placeholder(a.shape, name="a")
    y = g.sigmoid(g.matmul(ai, g.constant(b)))   # (the matmul's result is an intermediate: a planned buffer)
    exe = g.compile(targets=[y])
    first = exe.run({"a": a})[0]
    np.testing.assert_allclose(first, 1 / (1 + np.exp(-(a @ b))), rtol=1e-5)
    kept = first.copy()
    second = exe.run({"a": -a})[0]
    np.testing.assert_allclose(second, 1 / (1 + np.exp(a @ b)), rtol=1e-5)
    np.testing.assert_array_equal(first, kept)
