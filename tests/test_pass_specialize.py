"""specialize: dynamic dimensions take the feed types given at compile; everything downstream follows."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op, Program
from ingot.passes.specialize import specialize


def dynamic_graph():
    g = ingot.Graph()
    x = g.placeholder((1, None, 8), name="x")
    w = g.constant(np.ones((8, 4), np.float32))
    y = g.softmax(g.matmul(x, w), axis=-1)
    return g, x, y


def test_fixes_dynamic_dims_downstream():
    g, x, y = dynamic_graph()
    program = Program([y.node], [], dict(g.constants))
    assert program.outputs[0].shape == (1, None, 4)
    after, changed = specialize(program, {"x": ingot.TensorType((1, 5, 8))})
    assert changed
    assert after.outputs[0].shape == (1, 5, 4)
    assert all(n.type.static for n in after.nodes())


def test_rejects_types_that_do_not_fit():
    g, x, y = dynamic_graph()
    program = Program([y.node], [], dict(g.constants))
    with pytest.raises(ingot.IngotError, match="does not fit"):
        specialize(program, {"x": ingot.TensorType((2, 5, 8))})  # the static 1 is not 2
    with pytest.raises(ingot.IngotError, match="does not fit"):
        specialize(program, {"x": ingot.TensorType((1, 5, 8), ingot.float16)})
    with pytest.raises(ingot.IngotError, match="give its type in feeds"):
        specialize(program, {})


def test_static_graph_is_unchanged():
    g = ingot.Graph()
    x = g.placeholder((2, 3), name="x")
    y = g.exp(x)
    after, changed = specialize(Program([y.node], [], {}), {})
    assert not changed and after.outputs[0] is y.node


def test_compile_specialises_each_length_and_caches_it():
    g, x, y = dynamic_graph()
    five = g.compile(feeds={x: ingot.TensorType((1, 5, 8))}, targets=[y])
    seven = g.compile(feeds={"x": (1, 7, 8)}, targets=[y])
    assert five is g.compile(feeds={x: ingot.TensorType((1, 5, 8))}, targets=[y])
    assert five is not seven
    assert five.feed_types["x"].shape == (1, 5, 8) and seven.output_types[0].shape == (1, 7, 4)
    out = seven.run({"x": np.zeros((1, 7, 8), np.float32)})[0]
    np.testing.assert_allclose(out, np.full((1, 7, 4), 0.25, np.float32))
    assert ("specialize", True) in five.history
    assert all(n.type.static for n in five.program.nodes() if n.op != Op.CALL)
