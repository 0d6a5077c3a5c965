"""fuse_one_hot: cast(equal(x[..., None], arange(V)), float32) @ W (Magika's byte embedding) becomes a
row gather, zero rows for indices outside 0..V-1 as the product gives."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fuse_one_hot import fuse_one_hot

V, N = 7, 5


def one_hot_graph(dtype, arange_first: bool, constant_table: bool):
    g = ingot.Graph()
    x = g.placeholder((2, 9, 1), dtype, name="x")
    c = g.constant(np.arange(V).astype(dtype.numpy).reshape(1, 1, V))
    hot = g.equal(c, x) if arange_first else g.equal(x, c)
    table = np.random.default_rng(1).standard_normal((V, N)).astype(np.float32)
    w = g.constant(table) if constant_table else g.placeholder((V, N), name="w")
    return g, g.matmul(g.cast(hot, ingot.float32), w), table


@pytest.mark.parametrize("dtype", [ingot.int32, ingot.int64])
@pytest.mark.parametrize("arange_first", [False, True])
@pytest.mark.parametrize("constant_table", [True, False])
def test_one_hot_matmul_becomes_a_gather(dtype, arange_first, constant_table):
    g, y, table = one_hot_graph(dtype, arange_first, constant_table)
    program = Program([y.node], [], dict(g.constants))
    out, changed = fuse_one_hot(program)
    ops = [n.op for n in out.nodes()]
    assert changed and Op.GATHER in ops and Op.MATMUL not in ops and Op.EQUAL not in ops
    x = np.array([[0, 6, 3, -1, 7, 100, -50, 2, 6]] * 2, np.int64).reshape(2, 9, 1).astype(dtype.numpy)   # out of range: zeros
    feeds = {"x": x} if constant_table else {"x": x, "w": table}
    want = evaluate(program, feeds)[0]
    got = evaluate(out, feeds)[0]
    assert got.shape == want.shape == (2, 9, N)
    np.testing.assert_array_equal(got, want)
    assert not got[0, 3].any() and not got[0, 4].any() and np.array_equal(got[0, 1], table[6])
    exe = g.compile(targets=[y])   # the default pipeline, on the CPU
    np.testing.assert_array_equal(exe.run(feeds)[0], want)


def test_other_one_hots_are_left_alone():
    g = ingot.Graph()
    x = g.placeholder((4, 1), ingot.int32, name="x")
    w = g.constant(np.ones((V, N), np.float32))
    shuffled = g.matmul(g.cast(g.equal(x, g.constant(np.array([[1, 0, 2, 3, 4, 5, 6]], np.int32))), ingot.float32), w)
    wide = g.placeholder((4, 2), ingot.int32, name="wide")   # x's last axis must be 1
    two = g.matmul(g.cast(g.equal(wide, g.constant(np.arange(2, dtype=np.int32).reshape(1, 2))), ingot.float32),
                   g.constant(np.ones((2, N), np.float32)))
    out, changed = fuse_one_hot(Program([shuffled.node, two.node], [], dict(g.constants)))
    assert not changed and [n.op for n in out.nodes()].count(Op.MATMUL) == 2
