"""simplify_views: chains of reshapes and transposes collapse into one view with the same values."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ingot
from ingot.ir import Op, Program
from ingot.passes.simplify_views import simplify_views
from ingot.passes.specialize import specialize

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=25)


def program_of(g, out):
    p = Program([out.node], [], dict(g.constants), dict(g.variables))
    return specialize(p, {})[0]


def run(program, x):
    from ingot.runtime import Executable
    return Executable(program).run({"x": x})[0]


def ops(program):
    return [n.op for n in program.nodes() if n.op not in (Op.PLACEHOLDER, Op.CONSTANT)]


def test_head_split_with_one_token_becomes_one_reshape():
    g = ingot.Graph()
    x = g.placeholder((1, 576), name="x")                        # [T=1, H*D]
    heads = g.reshape(g.transpose(g.reshape(x, (-1, 9, 64)), (1, 0, 2)), (1, 9, -1, 64))
    before = program_of(g, heads)
    after, changed = simplify_views(before)
    assert changed and ops(before).count(Op.TRANSPOSE) == 1
    assert ops(after) == [Op.RESHAPE]
    a = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
    np.testing.assert_array_equal(run(after, a), a.reshape(1, 9, 1, 64))


def test_real_transpose_is_kept():
    g = ingot.Graph()
    x = g.placeholder((3, 9, 64), name="x")
    out = g.transpose(x, (1, 0, 2))
    after, changed = simplify_views(program_of(g, out))
    assert not changed and ops(after) == [Op.TRANSPOSE]


def test_identity_views_vanish():
    g = ingot.Graph()
    x = g.placeholder((4, 5), name="x")
    out = g.transpose(g.transpose(g.reshape(x, (4, 5)), (1, 0)), (1, 0)) + 1.0
    after, changed = simplify_views(program_of(g, out))
    assert changed and ops(after) == [Op.ADD]


shapes = st.lists(st.integers(1, 4), min_size=2, max_size=4)


@HYPOTHESIS
@given(shapes, st.data())
def test_random_view_chains_keep_values(shape, data):
    rank = len(shape)
    g = ingot.Graph()
    x = g.placeholder(tuple(shape), name="x")
    y, cur = x, list(shape)
    for _ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()):
            perm = data.draw(st.permutations(range(rank)))
            y = g.transpose(y, perm)
            cur = [cur[p] for p in perm]
        else:
            cur = data.draw(st.permutations(cur)) if data.draw(st.booleans()) else cur
            y = g.reshape(y, tuple(cur))
    before = program_of(g, y)
    after, _ = simplify_views(before)
    assert len(after.nodes()) <= len(before.nodes())
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(run(after, a), run(before, a))
