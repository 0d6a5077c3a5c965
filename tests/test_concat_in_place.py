"""plan_memory's concat elision: a concat's inputs computed straight into their slots of its buffer
(memory_offsets), and the cases where an input must be copied instead."""
import numpy as np

import ingot
from ingot.ir import Op

SHAPE = (1, 4, 6, 5)
WIDE = (1, 8, 6, 5)


def compiled(build, *shapes):
    g = ingot.Graph()
    xs = [g.placeholder(s, name=f"x{i}") for i, s in enumerate(shapes or (SHAPE,))]
    targets = build(g, *xs)
    exe = g.compile(targets=targets if isinstance(targets, list) else [targets])
    feeds = {f"x{i}": np.random.default_rng(i).standard_normal(s).astype(np.float32)
             for i, s in enumerate(shapes or (SHAPE,))}
    return exe, feeds


def concat_of(exe):
    (c,) = [n for n in exe.program.nodes() if n.op == Op.CONCAT]
    return c


def placed(exe) -> dict[int, int]:
    """Id -> byte offset of each value planned inside the concat's buffer, the concat's own input order."""
    program, c = exe.program, concat_of(exe)
    owners = [s.src[0] if s.op in (Op.SLICE, Op.RESHAPE) else s for s in c.src]
    return {o.id: program.memory_offsets.get(o.id, 0) for o in owners
            if o.id in program.memory_plan and program.memory_plan[o.id] == program.memory_plan[c.id]}


def check(exe, feeds, expected, runs: int = 2):
    for _ in range(runs):   # a second run: buffers reused, slots found in place again
        outs = exe.run(feeds)
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_inputs_are_computed_in_their_slots():
    exe, feeds = compiled(lambda g, x: g.concat([g.exp(x), g.sin(x), g.tanh(x)], axis=1) * 2.0)
    c = concat_of(exe)
    plane = 6 * 5 * 4
    assert sorted(placed(exe).values()) == [0, 4 * plane, 8 * plane]
    assert [exe.program.memory_offsets.get(s.id, 0) for s in c.src] == [0, 4 * plane, 8 * plane]
    x = feeds["x0"]
    check(exe, feeds, [np.concatenate([np.exp(x), np.sin(x), np.tanh(x)], axis=1) * 2])


def test_both_halves_of_one_value_in_order_share_its_memory():
    # YOLO's C2f: a conv's output split in two, the second half read on, all three concatenated
    def build(g, x):
        t = g.exp(x)   # [1, 8, 6, 5]
        a, b = t[:, :4], t[:, 4:]
        return g.concat([a, b, g.tanh(b) + b], axis=1) * 3.0
    exe, feeds = compiled(build, WIDE)
    assert len(placed(exe)) == 2 and 0 in placed(exe).values()
    t = np.exp(feeds["x0"])
    check(exe, feeds, [np.concatenate([t, np.tanh(t[:, 4:]) + t[:, 4:]], axis=1) * 3])


def test_an_input_read_after_the_concat_is_not_overwritten():
    # neg(c) could run in c's buffer (c dies there), but a is still to be read from it
    def build(g, x):
        a = g.exp(x)
        c = g.concat([a, g.sin(x)], axis=1)
        return g.neg(c)[:, :4] * a
    exe, feeds = compiled(build)
    assert placed(exe)
    x = feeds["x0"]
    check(exe, feeds, [-np.exp(x) * np.exp(x)])


def test_inputs_constants_and_outputs_are_copied():
    w = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)

    def build(g, x):
        out = g.exp(x)
        return [g.concat([x, g.constant(w), out, g.sin(x)], axis=1) * 2.0, out]
    exe, feeds = compiled(build)
    (only,) = placed(exe).values()
    assert only == 12 * 6 * 5 * 4   # sin(x), the fourth slot; the output exp(x) is the caller's
    x = feeds["x0"]
    first = [np.array(o, copy=True) for o in exe.run(feeds)]
    check(exe, feeds, [np.concatenate([x, w, np.exp(x), np.sin(x)], axis=1) * 2, np.exp(x)])
    np.testing.assert_array_equal(first[1], np.exp(x))


def test_the_same_tensor_twice_is_placed_once():
    exe, feeds = compiled(lambda g, x: g.concat([g.exp(x), g.exp(x), g.sin(x)], axis=1) * 2.0)
    assert len(placed(exe)) == 2
    x = feeds["x0"]
    check(exe, feeds, [np.concatenate([np.exp(x), np.exp(x), np.sin(x)], axis=1) * 2])


def test_half_of_a_value_is_copied():
    # t's second half is read later: t in the concat's buffer would have it overwritten by sin(x)
    def build(g, y, x):
        t = g.exp(y)
        return g.sum(g.concat([t[:, :4], g.sin(x)], axis=1) * 2.0, axis=1, keepdims=True) * g.tanh(t[:, 4:] + 1.0)
    exe, feeds = compiled(build, WIDE, SHAPE)
    assert len(placed(exe)) == 1
    x, t = feeds["x1"], np.exp(feeds["x0"])
    c = np.concatenate([t[:, :4], np.sin(x)], axis=1) * 2
    check(exe, feeds, [c.sum(axis=1, keepdims=True) * np.tanh(t[:, 4:] + 1)])


def test_a_concat_off_the_outer_axis_copies():
    exe, feeds = compiled(lambda g, x: g.concat([g.exp(x), g.sin(x)], axis=2) * 2.0)
    assert not placed(exe) and not exe.program.memory_offsets
    x = feeds["x0"]
    check(exe, feeds, [np.concatenate([np.exp(x), np.sin(x)], axis=2) * 2])


def test_a_producer_that_ignores_its_slot_is_copied():
    # a constant pad makes a new array (the CPU lowering takes no output buffer): the concat copies it
    def build(g, x):
        return g.concat([g.pad(g.exp(x), [(0, 0), (0, 0), (1, 0), (0, 0)])[:, :, :6], g.sin(x)], axis=1) * 2.0
    exe, feeds = compiled(build)
    x = feeds["x0"]
    padded = np.pad(np.exp(x), [(0, 0), (0, 0), (1, 0), (0, 0)])[:, :, :6]
    check(exe, feeds, [np.concatenate([padded, np.sin(x)], axis=1) * 2])


def test_a_planned_buffer_is_never_shared_by_two_live_values():
    def build(g, x):
        t = g.exp(x)
        a, b = t[:, :4], t[:, 4:]
        c = g.concat([a, b, g.tanh(b)], axis=1)
        return g.sum(c * 2.0, axis=1) + g.sin(a).sum(axis=1)
    exe, feeds = compiled(build, WIDE)
    program = exe.program
    nodes = program.nodes()
    position = {n.id: i for i, n in enumerate(nodes)}
    end = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            end[s.id] = i
    extent = {k: (program.memory_offsets.get(k, 0), program.memory_offsets.get(k, 0) + n.type.nbytes)
              for n in nodes for k in [n.id] if k in program.memory_plan}
    c = concat_of(exe)
    group = {k for k in extent if program.memory_plan[k] == program.memory_plan[c.id]}
    for a in program.memory_plan:
        for b in program.memory_plan:
            if a < b and program.memory_plan[a] == program.memory_plan[b] and not ({a, b} <= group and c.id in (a, b)):
                overlap = extent[a][0] < extent[b][1] and extent[b][0] < extent[a][1]
                first, second = sorted((a, b), key=position.get)
                assert not overlap or end[first] <= position[second], (a, b)
    t = np.exp(feeds["x0"])
    cc = np.concatenate([t, np.tanh(t[:, 4:])], axis=1)
    check(exe, feeds, [(cc * 2).sum(axis=1) + np.sin(t[:, :4]).sum(axis=1)])


def test_the_concat_buffer_lives_while_an_input_in_it_does():
    # c dies at its product with 2; a, in c's buffer, is read after cos(x) took a free buffer
    def build(g, x):
        a = g.exp(x)
        m = g.concat([a, g.sin(x)], axis=1) * 2.0
        u = g.cos(x) * 3.0
        return g.sum(m, axis=1, keepdims=True) + u + a
    exe, feeds = compiled(build)
    assert placed(exe)
    x = feeds["x0"]
    m = np.concatenate([np.exp(x), np.sin(x)], axis=1) * 2
    check(exe, feeds, [m.sum(axis=1, keepdims=True) + np.cos(x) * 3 + np.exp(x)])
