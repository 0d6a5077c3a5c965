"""plan_memory: buffers reused by liveness; outputs never live in a reused buffer."""
import numpy as np

import ingot
from ingot.ir import GroupOp, Op
from ingot.passes.memory_plan import plan_memory

BIG = (256, 1024)  # 1 MiB of float32


def chain(n: int = 10):
    g = ingot.Graph()
    x = g.placeholder(BIG, name="x")
    h = x
    for i in range(n):
        h = [g.exp, g.tanh, g.sin, g.neg, g.abs][i % 5](h) if i % 2 else h * float(i + 1)
    return g, h


def reference_chain(x: np.ndarray, n: int = 10) -> np.ndarray:
    h = x
    for i in range(n):
        h = [np.exp, np.tanh, np.sin, np.negative, np.abs][i % 5](h) if i % 2 else h * np.float32(i + 1)
    return h


def test_a_chain_of_ten_runs_in_one_buffer():
    g, y = chain(10)
    exe = g.compile(targets=[y])
    program = exe.program
    planned = [n for n in program.nodes() if n.id in program.memory_plan]
    assert len(planned) == 9  # every intermediate, not the output
    assert len(program.buffer_sizes) == 1 and program.buffer_sizes[0] == 256 * 1024 * 4
    assert program.outputs[0].id not in program.memory_plan
    xv = np.random.default_rng(0).standard_normal(BIG).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], reference_chain(xv), rtol=1e-5, atol=1e-6)


def test_outputs_are_not_overwritten_by_the_next_run():
    g = ingot.Graph()
    x = g.placeholder((64, 64), name="x")
    a = g.exp(x) * 2.0
    b = g.matmul(a, a) + 1.0
    out = g.tanh(b)
    c = g.matmul(g.sin(x), g.sin(x))  # same sizes: would take a freed buffer
    exe = g.compile(targets=[out, c])
    assert exe.program.buffer_sizes  # something was planned
    x1, x2 = np.full((64, 64), 0.01, np.float32), np.full((64, 64), -0.02, np.float32)
    first = exe.run({"x": x1})
    kept = [np.array(o, copy=True) for o in first]
    second = exe.run({"x": x2})
    for o, k in zip(first, kept):
        np.testing.assert_array_equal(o, k)
    for o1, o2 in zip(first, second):
        assert not np.shares_memory(o1, o2)


def test_views_keep_their_buffer_alive():
    g = ingot.Graph()
    x = g.placeholder((32, 32), name="x")
    a = g.exp(x)
    view = g.transpose(a)  # no buffer of its own: reads a's
    b = g.sin(x) * 3.0  # must not land in a's buffer while the view is still to be read
    y = g.matmul(view, b) + g.reshape(view, (32, 32))
    exe = g.compile(targets=[y])
    plan = exe.program.memory_plan
    assert view.node.id not in plan
    assert plan[b.node.id] != plan[a.node.id]
    xv = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32) * 0.1
    expected = np.exp(xv).T @ (np.sin(xv) * 3) + np.exp(xv).T
    np.testing.assert_allclose(exe.run({"x": xv})[0], expected, rtol=1e-5)


def test_in_place_never_through_a_view_of_the_same_buffer():
    g = ingot.Graph()
    x = g.placeholder((16, 16), name="x")
    a = g.exp(x)
    y = g.sin(a + g.transpose(a))  # a dies at the add, but its transpose is read there too
    exe = g.compile(targets=[y])
    (add,) = [n for n in exe.program.nodes() if n.op == Op.ADD]
    plan = exe.program.memory_plan
    assert plan[add.id] != plan[a.node.id]
    xv = np.random.default_rng(2).standard_normal((16, 16)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.sin(np.exp(xv) + np.exp(xv).T), rtol=1e-5)


def test_plan_is_consistent_by_liveness():
    g, y = chain(6)
    h = g.matmul(y, g.constant(np.ones((1024, 8), np.float32))) * 2.0
    exe = g.compile(targets=[h])
    program = exe.program
    nodes = program.nodes()
    position = {n.id: i for i, n in enumerate(nodes)}
    last_use = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            last_use[s.id] = i
    plan = program.memory_plan
    for a in plan:
        for b in plan:
            if a != b and plan[a] == plan[b]:
                # two values in one buffer: one must be dead when the other is written
                first, second = sorted((a, b), key=position.get)
                assert last_use[first] <= position[second]
    for n in nodes:
        assert not (n.id in plan and (n.op in GroupOp.View or n.op in GroupOp.Source))
    after, changed = plan_memory(program)
    assert changed and after.memory_plan == plan  # deterministic


def test_a_small_long_lived_value_does_not_pin_a_big_free_buffer():
    # chunks: a big temporary, then a small result that lives until the concat (an STFT -> mel chunk)
    g = ingot.Graph()
    x = g.placeholder((8, 256, 1024), name="x")
    small = []
    for i in range(8):
        big = g.softmax(g.exp(x[i]), axis=-1)                     # 1 MiB temporaries; the first is free
        small.append(g.sum(big, axis=1, keepdims=True))           # by the sum: 1 KiB, lives until the concat
    y = g.concat(small, axis=1)
    exe = g.compile(targets=[y])
    sizes = exe.program.buffer_sizes
    assert sum(sizes) < 3 * 256 * 1024 * 4, sizes  # the big buffers are reused chunk after chunk
    xv = np.random.default_rng(0).standard_normal((8, 256, 1024)).astype(np.float32) * 0.1
    e = np.exp(xv)
    expected = (e / e.sum(axis=-1, keepdims=True)).sum(axis=2).T[None].reshape(256, 8)
    np.testing.assert_allclose(exe.run({"x": xv})[0], expected, rtol=1e-5)
