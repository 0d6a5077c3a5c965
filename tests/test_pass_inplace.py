"""update_variables_in_place: assign(v, slice_update(v, u, start)) writes the slice into v, no copy."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.inplace import update_variables_in_place

CACHE = (1, 3, 2048, 64)


def cache_graph():
    g = ingot.Graph()
    cache = g.variable(np.zeros(CACHE, np.float32), name="k_cache")
    new = g.placeholder((1, 3, 1, 64), name="new")
    pos = g.placeholder((), ingot.int32, name="pos")
    updated = g.slice_update(cache, new, start=[0, 0, pos, 0])
    assign = g.assign(cache, updated)
    return g, cache, new, pos, updated, assign


def test_marks_the_update_in_place():
    g, cache, new, pos, updated, assign = cache_graph()
    before = Program([], [assign.node], dict(g.constants), dict(g.variables))
    after, changed = update_variables_in_place(before)
    assert changed
    (a,) = after.assigns
    assert a.src[1].op == Op.SLICE_UPDATE and a.src[1].attrs.get("inplace") is True
    assert a.src[1].src[0] is a.src[0]  # still the variable itself
    assert not before.assigns[0].src[1].attrs.get("inplace")  # nodes are immutable
    _, again = update_variables_in_place(after)
    assert not again
    feeds = {"new": np.ones((1, 3, 1, 64), np.float32), "pos": np.int32(3)}
    after.outputs = [a.src[1]]
    before.outputs = [before.assigns[0].src[1]]
    np.testing.assert_array_equal(evaluate(after, feeds)[0], evaluate(before, feeds)[0])


@pytest.mark.parametrize("reader", ["output", "consumer"])
def test_copy_semantics_kept_when_the_old_value_is_read(reader):
    g, cache, new, pos, updated, assign = cache_graph()
    old_view = cache if reader == "output" else g.sum(cache)
    program = Program([old_view.node], [assign.node], dict(g.constants), dict(g.variables))
    after, changed = update_variables_in_place(program)
    assert not changed and not after.assigns[0].src[1].attrs.get("inplace")
    exe = g.compile(targets=[old_view])
    (first,) = exe.run({"new": np.ones((1, 3, 1, 64), np.float32), "pos": np.int32(0)})
    assert float(np.sum(first)) == 0.0  # the value at the start of the run
    (second,) = exe.run({"new": np.ones((1, 3, 1, 64), np.float32), "pos": np.int32(1)})
    assert float(np.sum(second)) == 192.0
    assert float(np.sum(first)) == 0.0  # and the first result was not written under the caller


def test_kv_cache_updated_100_times_without_a_copy():
    g, cache, new, pos, updated, assign = cache_graph()
    exe = g.compile()
    assert ("inplace", True) in exe.history
    state = exe.state["k_cache"]
    pointer = state.__array_interface__["data"][0]
    expected = np.zeros(CACHE, np.float32)
    rng = np.random.default_rng(0)
    for p in range(100):
        row = rng.standard_normal((1, 3, 1, 64)).astype(np.float32)
        exe.run({"new": row, "pos": np.int32(p)})
        expected[:, :, p:p + 1] = row
        assert exe.state["k_cache"] is state
        assert state.__array_interface__["data"][0] == pointer
    np.testing.assert_array_equal(state, expected)


def test_out_of_range_position_is_an_ingot_error():
    g, *_ = cache_graph()
    exe = g.compile()
    with pytest.raises(ingot.IngotError, match="slice_update"):
        exe.run({"new": np.ones((1, 3, 1, 64), np.float32), "pos": np.int32(2048)})
