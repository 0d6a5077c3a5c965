"""eliminate_dead_code: constants and variables no output or assign reaches are dropped."""
import numpy as np

import ingot
from ingot.ir import Program
from ingot.passes import evaluate
from ingot.passes.dce import eliminate_dead_code
from ingot.runtime import Executable


def graph_with_dead_parts():
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    used = g.constant(np.arange(4, dtype=np.float32), name="used")
    g.constant(np.ones((256, 256), np.float32), name="unused_weight")
    dead = g.variable(np.zeros(4, np.float32), name="dead_cache")
    _ = g.exp(x) * g.read(dead)  # built, never a target
    y = x * used
    return g, y


def test_drops_unused_constants_and_variables():
    g, y = graph_with_dead_parts()
    before = Program([y.node], [], dict(g.constants), dict(g.variables))
    after, changed = eliminate_dead_code(before)
    assert changed
    assert set(after.constants) == {"used"} and after.variables == {}
    assert set(before.constants) == {"used", "unused_weight"}  # the input program is untouched
    feeds = {"x": np.arange(4, dtype=np.float32)}
    np.testing.assert_array_equal(Executable(after).run(feeds)[0], evaluate(before, feeds)[0])
    np.testing.assert_array_equal(evaluate(before, feeds)[0], feeds["x"] * np.arange(4))


def test_keeps_what_assigns_need():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    counter = g.variable(np.zeros(2, np.float32), name="counter")
    step = g.constant(np.full(2, 3, np.float32), name="step")
    a = g.assign(counter, counter + x * step)
    after, changed = eliminate_dead_code(Program([], [a.node], dict(g.constants), dict(g.variables)))
    assert not changed
    assert set(after.constants) == {"step"} and set(after.variables) == {"counter"}


def test_second_run_changes_nothing():
    g, y = graph_with_dead_parts()
    once, _ = eliminate_dead_code(Program([y.node], [], dict(g.constants), dict(g.variables)))
    _, changed = eliminate_dead_code(once)
    assert not changed


def test_compile_drops_dead_weights():
    g, y = graph_with_dead_parts()
    exe = g.compile(targets=[y])
    assert "unused_weight" not in exe.program.constants and not exe.program.variables
    assert ("dce", True) in exe.history
