"""The FUSED op and the driver every device fusion pass shares (ops/fused.py, passes/fusion.py)."""
import numpy as np
import pytest

import ingot
from ingot.errors import IngotError
from ingot.ir import Node, Op, Program, TensorType
from ingot.ops import infer_type, reference
from ingot.ops.fused import Body, fuse
from ingot.package import _decode, _encode
from ingot.passes import evaluate
from ingot.passes.cse import eliminate_common_subexpressions
from ingot.passes.fusion import Match, fuse_matches
from ingot.verify import verify


def chain():
    g = ingot.Graph()
    x = g.placeholder((3, 5), name="x")
    a = g.exp(x)
    b = a * 2.0
    c = g.tanh(b) + a     # a is read inside and outside the match below
    return g, x, a, b, c


def test_fuse_builds_a_body_over_parameters():
    g, x, a, b, c = chain()
    f = fuse("k", [a.node, b.node], [a.node, b.node])
    assert f.op == Op.FUSED and f.attrs["kind"] == "k"
    body = f.attrs["body"]
    assert [p.attrs["param"] for p in body.params] == list(range(len(f.src)))
    assert f.src[0] is x.node and isinstance(f.type, tuple) and len(f.type) == 2
    assert infer_type(Op.FUSED, [s.type for s in f.src], f.attrs) == f.type
    xv = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    got = reference(Op.FUSED, [xv] + [g.constants[s.attrs["key"]] for s in f.src[1:]], f.attrs)
    np.testing.assert_allclose(got[1], np.exp(xv) * 2, rtol=1e-6)


def test_the_type_rule_refuses_other_inputs():
    g, x, a, b, c = chain()
    f = fuse("k", [a.node], [a.node])
    with pytest.raises(IngotError, match="its body takes"):
        infer_type(Op.FUSED, [TensorType((3, 6))], f.attrs)


def test_a_body_holds_no_sources():
    v = Node(Op.VARIABLE, TensorType((2,)), (), {"name": "v"})
    with pytest.raises(IngotError, match="may not hold variable"):
        Body([], [Node(Op.EXP, TensorType((2,)), (v,))])


def test_fuse_matches_rewires_readers_and_keeps_numbers():
    g, x, a, b, c = chain()
    before = Program([c.node], [], dict(g.constants))
    after, changed = fuse_matches(before, [Match("k", [a.node, b.node], [a.node, b.node])])
    assert changed
    verify(after)
    fused = [n for n in after.nodes() if n.op == Op.FUSED]
    assert len(fused) == 1 and sum(n.op == Op.GET_ITEM for n in after.nodes()) == 2
    assert not any(n.op == Op.EXP for n in after.nodes())
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)}
    np.testing.assert_allclose(evaluate(after, feeds)[0], evaluate(before, feeds)[0], rtol=1e-6)


def test_a_match_read_inside_out_is_refused():
    g, x, a, b, c = chain()
    before = Program([c.node], [], dict(g.constants))
    with pytest.raises(IngotError, match="read outside the match"):
        fuse_matches(before, [Match("k", [a.node, b.node], [b.node])])   # a is read by c too


def test_a_match_that_would_make_a_cycle_is_skipped():
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    a = g.exp(x)
    mid = g.tanh(a)               # outside the match, between its members
    b = a * mid
    before = Program([b.node], [], dict(g.constants))
    after, changed = fuse_matches(before, [Match("k", [a.node, b.node], [b.node])])
    assert not changed and after is before


def test_equal_bodies_are_one_node_after_cse():
    g, x, a, b, c = chain()
    f1 = fuse("k", [a.node], [a.node])
    f2 = fuse("k", [a.node], [a.node])
    assert f1.attrs["body"] == f2.attrs["body"] and f1.attrs["body"] is not f2.attrs["body"]
    program = Program([Node(Op.ADD, f1.type, (f1, f2))], [], dict(g.constants))
    after, changed = eliminate_common_subexpressions(program)
    assert changed and sum(n.op == Op.FUSED for n in after.nodes()) == 1


def test_a_body_round_trips_through_the_package_encoding():
    g, x, a, b, c = chain()
    f = fuse("k", [a.node, b.node], [b.node])
    import json
    again = _decode(json.loads(json.dumps(_encode(f.attrs["body"]))))
    assert again == f.attrs["body"]
    with pytest.raises(IngotError, match="not earlier nodes"):
        _decode({"body": {"nodes": [{"op": "EXP", "type": {"shape": [2], "dtype": "float32"}, "src": [0],
                                     "attrs": {}}], "outputs": [0]}})
