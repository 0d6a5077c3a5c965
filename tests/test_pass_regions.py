"""find_regions: chains of elementwise ops, each the only reader of the one before, form one region."""
import numpy as np

import ingot
from ingot.compiler import dump
from ingot.ir import Op, Program
from ingot.passes.regions import find_regions


def test_a_chain_is_one_region():
    g = ingot.Graph()
    x = g.placeholder((4, 8), name="x")
    h = g.matmul(x, g.constant(np.ones((8, 8), np.float32)))
    y = g.silu(g.exp(h) * 2.0 + 1.0)
    program = Program([y.node], [], dict(g.constants))
    after, changed = find_regions(program)
    assert changed
    assert len(after.regions) == 1
    by_id = {n.id: n for n in after.nodes()}
    ops = [by_id[i].op for i in after.regions[0]]
    assert ops == [Op.EXP, Op.MUL, Op.ADD, Op.SILU]  # sources first, the matmul is not in it
    assert after.outputs == program.outputs  # the graph itself is unchanged


def test_a_value_read_twice_ends_a_region():
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    a = g.exp(x)
    b = g.tanh(a)
    c = g.sin(a)  # a has two readers: it is materialised, not fused into either
    y = g.add(g.neg(b), g.neg(c))
    after, _ = find_regions(Program([y.node], [], dict(g.constants)))
    region_of = {i: r for r, ids in enumerate(after.regions) for i in ids}
    assert a.node.id not in region_of
    assert region_of[b.node.id] == region_of[y.node.id] == region_of[c.node.id]


def test_outputs_and_dynamic_or_non_elementwise_ops_stay_out():
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    a = g.exp(x)
    y = g.neg(a)
    after, changed = find_regions(Program([a.node, y.node], [], dict(g.constants)))
    assert not changed and after.regions == []  # a is an output: it cannot live inside a kernel
    s = g.sum(g.exp(x))
    after, changed = find_regions(Program([s.node], [], dict(g.constants)))
    assert not changed


def test_compiled_program_records_regions_for_the_viewer():
    g = ingot.Graph()
    x = g.placeholder((16,), name="x")
    y = g.sigmoid(g.exp(x) + 1.0) * 3.0
    exe = g.compile(targets=[y])
    assert len(exe.regions) == 1 and [n.op for n in exe.regions[0]] == [Op.EXP, Op.ADD, Op.SIGMOID, Op.MUL]
    assert "region 0" in dump(exe.program)
    xv = np.linspace(-2, 2, 16, dtype=np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], 3 / (1 + np.exp(-(np.exp(xv) + 1))), rtol=1e-6)
