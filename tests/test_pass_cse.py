"""eliminate_common_subexpressions: structurally equal nodes become one node."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.cse import eliminate_common_subexpressions
from ingot.runtime import Executable

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=25)

UNARY = ["neg", "tanh", "sin", "abs"]
BINARY = ["add", "mul", "sub", "maximum"]
step = st.one_of(
    st.tuples(st.sampled_from(UNARY), st.integers(0, 50)),
    st.tuples(st.sampled_from(BINARY), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("scalar"), st.sampled_from(BINARY), st.integers(0, 50), st.sampled_from([0.5, 2.0, -1.0])),
)


def build(g: ingot.Graph, x, recipe):
    """The expression the recipe describes, built from fresh nodes each time it is called."""
    values = [x]
    for s in recipe:
        if s[0] == "scalar":
            _, op, i, c = s
            values.append(getattr(g, op)(values[i % len(values)], c))  # the scalar is a new constant node
        elif s[0] in UNARY:
            values.append(getattr(g, s[0])(values[s[1] % len(values)]))
        else:
            values.append(getattr(g, s[0])(values[s[1] % len(values)], values[s[2] % len(values)]))
    return values[-1]


def count(program: Program) -> int:
    return len(program.nodes())


@HYPOTHESIS
@given(recipe=st.lists(step, min_size=1, max_size=12))
def test_a_duplicated_expression_collapses_to_one(recipe):
    g = ingot.Graph()
    x = g.placeholder((3, 4), name="x")
    single = build(g, x, recipe)
    once, _ = eliminate_common_subexpressions(Program([single.node], [], dict(g.constants)))
    twice_graph = g.add(build(g, x, recipe), build(g, x, recipe))
    before = Program([twice_graph.node], [], dict(g.constants))
    after, changed = eliminate_common_subexpressions(before)
    assert changed
    assert count(after) == count(once) + 1  # the two copies are one, plus the final add
    assert after.outputs[0].src[0] is after.outputs[0].src[1]
    keys = [n.key() for n in after.nodes() if n.op not in (Op.CONSTANT, Op.PLACEHOLDER)]
    assert len(keys) == len(set(keys))  # nothing left to merge
    feeds = {"x": np.random.default_rng(len(recipe)).standard_normal((3, 4)).astype(np.float32)}
    (expected,) = evaluate(before, feeds)
    (merged,) = Executable(after).run(feeds)
    np.testing.assert_array_equal(merged, expected)


def test_equal_small_constants_merge_but_different_ones_do_not():
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    y = (x * 2.0) + (x * 2.0) + (x * 3.0)
    after, changed = eliminate_common_subexpressions(Program([y.node], [], dict(g.constants)))
    assert changed
    constants = [n for n in after.nodes() if n.op == Op.CONSTANT]
    values = sorted(float(after.constants[c.attrs["key"]]) for c in constants)
    assert values == [2.0, 3.0]
    assert sum(n.op == Op.MUL for n in after.nodes()) == 2


def test_same_bytes_different_type_stay_apart():
    g = ingot.Graph()
    a = g.constant(np.zeros(4, np.int32))
    b = g.constant(np.zeros(4, np.float32))
    c = g.constant(np.zeros((2, 2), np.int32))
    after, _ = eliminate_common_subexpressions(Program([a.node, b.node, c.node], [], dict(g.constants)))
    assert len({n.id for n in after.outputs}) == 3


def test_assigns_and_calls_are_never_merged():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    t = ingot.TensorType((2,))
    (a,) = g.call("adapter", [x], [t])
    (b,) = g.call("adapter", [x], [t])  # a call may have effects (its own state): both run
    after, _ = eliminate_common_subexpressions(Program([a.node, b.node], [], dict(g.constants)))
    calls = [n for n in after.nodes() if n.op == Op.CALL]
    assert len(calls) == 2


def test_unchanged_graph_reports_no_change():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    y = g.exp(x) + x
    program = Program([y.node], [], dict(g.constants))
    after, changed = eliminate_common_subexpressions(program)
    assert not changed and after.outputs[0] is y.node
