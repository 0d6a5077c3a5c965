"""The Executable: feeds, state objects, callables and hot swap, views, and what it refuses."""
import numpy as np
import pytest

import ingot
from ingot import compiler
from ingot.ir import Op

F32 = ingot.TensorType


def adapter(scale: float, shape=(2, 4)):
    g = ingot.Graph()
    x = g.placeholder(shape, name="h")
    return g.compile(targets=[x * scale])


def main_with_call(callables=None):
    g = ingot.Graph()
    x = g.placeholder((2, 4), name="x")
    h = g.exp(x)
    (a,) = g.call("adapter", [h], [F32((2, 4))])
    return g.compile(targets=[a + h], callables=callables)


# -- callables ------------------------------------------------------------------------------------
def test_hot_swap_changes_the_output_without_recompiling(monkeypatch):
    exe = main_with_call({"adapter": adapter(2.0)})
    plan, program = exe.plan, exe.program
    xv = np.zeros((2, 4), np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.full((2, 4), 3.0))
    other = adapter(10.0)
    compiles = []
    monkeypatch.setattr(compiler, "run_pipeline", lambda *a, **k: compiles.append(a) or pytest.fail("bind compiled"))
    for _ in range(1000):
        exe.bind("adapter", other)
    assert compiles == []  # a dictionary update, not a compile
    assert exe.plan is plan and exe.program is program
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.full((2, 4), 11.0))


def test_binding_the_wrong_types_is_refused():
    exe = main_with_call({"adapter": adapter(2.0)})
    with pytest.raises(ingot.IngotError, match="takes"):
        exe.bind("adapter", adapter(2.0, shape=(2, 5)))
    g = ingot.Graph()
    x = g.placeholder((2, 4), ingot.float16, name="h")
    with pytest.raises(ingot.IngotError, match="takes"):
        exe.bind("adapter", g.compile(targets=[x]))
    with pytest.raises(ingot.IngotError, match="no call named"):
        exe.bind("other", adapter(1.0))
    with pytest.raises(ingot.IngotError, match="Executable"):
        exe.bind("adapter", lambda h: h)
    with pytest.raises(ingot.IngotError, match="takes"):
        main_with_call({"adapter": adapter(1.0, shape=(4, 2))})
    np.testing.assert_allclose(exe.run({"x": np.zeros((2, 4), np.float32)})[0], 3.0)  # still the first one


def test_a_calls_dynamic_output_length_is_its_fed_inputs():
    """A call declared [?] -> [?, 4] takes the length its input got when fed: added to a [1, 4]
    tensor it stays [1, 4] (broadcasting 1 against a dynamic length would leave it dynamic)."""
    g = ingot.Graph()
    tokens = g.placeholder((None,), ingot.int32, name="tokens")
    rows = g.gather(g.constant(np.arange(12, dtype=np.float32).reshape(3, 4)), tokens, axis=0)   # [?, 4]
    (delta,) = g.call("lookup", [tokens], [F32((None, 4))])
    other = g.placeholder((None, 2), name="other")
    (mixed,) = g.call("mixed", [tokens, other], [F32((None, 4))])
    exe = g.compile(feeds={tokens: F32((1,), ingot.int32), other: F32((3, 2))}, targets=[rows + delta, mixed])
    (site,) = [n for n in exe.program.nodes() if n.op == Op.CALL and n.attrs["name"] == "lookup"]
    assert site.type == (F32((1, 4)),) and exe.program.outputs[0].type == F32((1, 4))
    (site,) = [n for n in exe.program.nodes() if n.op == Op.CALL and n.attrs["name"] == "mixed"]
    assert site.type == (F32((None, 4)),)   # inputs of two lengths: it stays dynamic


def test_an_unbound_call_fails_clearly_at_run():
    exe = main_with_call()
    with pytest.raises(ingot.IngotError, match="no executable is bound to 'adapter'"):
        exe.run({"x": np.zeros((2, 4), np.float32)})
    exe.bind("adapter", adapter(0.0))
    np.testing.assert_allclose(exe.run({"x": np.zeros((2, 4), np.float32)})[0], 1.0)


def test_a_call_result_that_views_its_input_is_not_a_reused_buffer():
    g = ingot.Graph()
    h = g.placeholder((8,), name="h")
    identity = g.compile(targets=[g.reshape(h, (8,))])  # returns a view of its input
    g = ingot.Graph()
    x = g.placeholder((8,), name="x")
    (a,) = g.call("id", [g.exp(x)], [F32((8,))])
    y = a + g.sin(x) * 2.0  # sin(x) * 2 is planned after exp(x) dies, in its buffer
    exe = g.compile(targets=[y], callables={"id": identity})
    xv = np.linspace(0, 1, 8, dtype=np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.sin(xv) * 2 + np.exp(xv), rtol=1e-6)


# -- views and aliasing ---------------------------------------------------------------------------
def test_array_view_output_shares_memory_with_its_input():
    g = ingot.Graph()
    signal = g.placeholder((64,), name="signal")
    frames = g.array_view(signal, shape=(7, 16), strides=(8, 1))  # STFT framing, hop 8
    exe = g.compile(targets=[frames])
    sv = np.arange(64, dtype=np.float32)
    (out,) = exe.run({"signal": sv})
    assert np.shares_memory(out, sv)
    np.testing.assert_array_equal(out[3], sv[24:40])


def test_an_output_never_aliases_the_state():
    g = ingot.Graph()
    x = g.placeholder((3,), name="x")
    counter = g.variable(np.zeros(3, np.float32), name="counter")
    g.assign(counter, counter + x)
    exe = g.compile(targets=[counter])  # the value at the start of each run
    first = exe.run({"x": np.ones(3, np.float32)})[0]
    second = exe.run({"x": np.ones(3, np.float32)})[0]
    assert first.tolist() == [0, 0, 0] and second.tolist() == [1, 1, 1]
    assert not np.shares_memory(second, exe.state["counter"])


def test_an_output_that_is_a_constant_is_read_only():
    g = ingot.Graph()
    table = g.constant(np.arange(6, dtype=np.float32).reshape(2, 3), name="table")
    exe = g.compile(targets=[g.transpose(table)])
    (out,) = exe.run()
    with pytest.raises(ValueError):
        out[0, 0] = 100.0
    assert exe.run()[0][0, 0] == 0.0


def test_assigns_read_the_values_from_the_start_of_the_run():
    g = ingot.Graph()
    a = g.variable(np.array([1.0], np.float32), name="a")
    b = g.variable(np.array([2.0], np.float32), name="b")
    g.assign(a, b)
    g.assign(b, a)  # a swap: both read the old values
    exe = g.compile()
    arrays = exe.state["a"], exe.state["b"]
    exe.run()
    assert exe.state["a"].tolist() == [2.0] and exe.state["b"].tolist() == [1.0]
    assert exe.state["a"] is arrays[0] and exe.state["b"] is arrays[1]


# -- states ---------------------------------------------------------------------------------------
def test_several_states_are_independent():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    total = g.variable(np.zeros(2, np.float32), name="total")
    g.assign(total, total + x)
    exe = g.compile(targets=[total + x])
    s1, s2 = exe.new_state(), exe.new_state()
    for _ in range(3):
        exe.run({"x": np.ones(2, np.float32)}, state=s1)
    exe.run({"x": np.full(2, 5, np.float32)}, state=s2)
    assert s1["total"].tolist() == [3, 3] and s2["total"].tolist() == [5, 5]
    assert exe.state["total"].tolist() == [0, 0]
    assert not np.shares_memory(s1["total"], s2["total"])
    s1.reset()
    assert s1["total"].tolist() == [0, 0] and s2["total"].tolist() == [5, 5]
    s2["total"] = [7, 8]
    assert exe.run({"x": np.zeros(2, np.float32)}, state=s2)[0].tolist() == [7, 8]
    with pytest.raises(ingot.IngotError, match="shape"):
        s2["total"] = np.zeros(3)
    with pytest.raises(ingot.IngotError, match="no variable"):
        s2["missing"]


def test_a_state_from_another_executable_must_fit():
    g = ingot.Graph()
    x = g.placeholder((None,), name="x")
    total = g.variable(np.zeros(1, np.float32), name="total")
    g.assign(total, total + g.sum(x, keepdims=True))
    two, three = g.compile(feeds={x: (2,)}), g.compile(feeds={x: (3,)})  # prefill/decode style
    shared = two.new_state()
    two.run({"x": np.ones(2, np.float32)}, state=shared)
    three.run({"x": np.ones(3, np.float32)}, state=shared)
    assert shared["total"].tolist() == [5.0]
    g2 = ingot.Graph()
    other = g2.variable(np.zeros(4, np.float32), name="total")
    g2.assign(other, other * 2.0)
    with pytest.raises(ingot.IngotError, match="does not hold variable 'total'"):
        g2.compile().run(state=shared)
    with pytest.raises(ingot.IngotError, match="State"):
        two.run({"x": np.ones(2, np.float32)}, state={"total": np.zeros(1)})


# -- feeds ----------------------------------------------------------------------------------------
def feed_graph():
    g = ingot.Graph()
    b = g.placeholder((2, 3), name="b")
    a = g.placeholder((), ingot.int32, name="a")
    y = g.cast(a, ingot.float32) * 10.0 + b  # a is used first, but b was declared first
    return g.compile(targets=[y])


def test_feeds_by_name_tensor_or_declaration_order():
    exe = feed_graph()
    assert exe.feed_order == ["b", "a"]
    bv = np.ones((2, 3), np.float32)
    by_list = exe.run([bv, np.int32(2)])[0]
    by_name = exe.run({"a": 2, "b": bv})[0]  # a Python int fits int32
    np.testing.assert_array_equal(by_list, np.full((2, 3), 21.0))
    np.testing.assert_array_equal(by_name, by_list)
    np.testing.assert_array_equal(exe.run({"b": bv.astype(np.float64), "a": np.int64(2)})[0], by_list)  # casts in kind


@pytest.mark.parametrize("feeds, message", [
    ({"b": np.ones((3, 2), np.float32), "a": np.int32(1)}, "shape"),
    ({"b": np.ones((2, 3), np.int32), "a": np.int32(1)}, "dtype"),
    ({"b": np.ones((2, 3), np.float32), "a": np.float32(1)}, "dtype"),
    ({"b": np.ones((2, 3), np.float32), "a": np.int64(2**40)}, "do not fit int32"),
    ({"b": np.ones((2, 3), np.float32)}, "missing feeds"),
    ({"b": np.ones((2, 3), np.float32), "a": 1, "c": 1}, "not an input"),
    ([np.ones((2, 3), np.float32)], "expected 2 inputs"),
])
def test_wrong_feeds_raise_ingot_error(feeds, message):
    exe = feed_graph()
    with pytest.raises(ingot.IngotError, match=message):
        exe.run(feeds)


def test_packed_feeds_are_checked_in_storage_shape():
    g = ingot.Graph()
    q = g.placeholder((2, 8), ingot.uint4, name="q")
    exe = g.compile(targets=[g.dequantize(q, scale=1.0)])
    packed = ingot.dtypes.pack_int4(np.arange(16).reshape(2, 8) % 16)
    np.testing.assert_array_equal(exe.run({"q": packed})[0], np.arange(16).reshape(2, 8) % 16)
    with pytest.raises(ingot.IngotError, match="packed storage"):
        exe.run({"q": np.zeros((2, 8), np.uint8)})


def test_run_time_errors_are_ingot_errors():
    g = ingot.Graph()
    table = g.constant(np.ones((4, 2), np.float32))
    i = g.placeholder((1,), ingot.int32, name="i")
    exe = g.compile(targets=[g.gather(table, i)])
    with pytest.raises(ingot.IngotError, match="gather"):
        exe.run({"i": np.array([9], np.int32)})
    assert [n.op for n in exe.program.nodes()].count(Op.GATHER) == 1
    j = g.placeholder((), ingot.int64, name="j")   # one index: its own check
    exe = g.compile(targets=[g.gather(table, j)])
    np.testing.assert_array_equal(exe.run({"j": np.array(-4)})[0], np.ones(2, np.float32))
    for bad in (4, -5):
        with pytest.raises(ingot.IngotError, match="gather: index"):
            exe.run({"j": np.array(bad)})


# == one return convention: Outputs, from g.compile, ingot.load and from_onnx alike =================

def _two_outputs():
    import ingot
    g = ingot.Graph()
    x = g.placeholder((2, 3), ingot.float32, name="x")
    return g, x, {"doubled": x * 2.0, "total": g.sum(x, axis=1)}


def test_run_returns_outputs_by_name_and_in_order(tmp_path):
    import ingot
    g, x, targets = _two_outputs()
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    exe = g.compile(targets=targets)
    out = exe.run(feed)
    assert isinstance(out, ingot.Outputs) and isinstance(out, tuple)
    doubled, total = out                                     # positional, in target order
    np.testing.assert_array_equal(out["doubled"], doubled)
    np.testing.assert_array_equal(total, [3.0, 12.0])
    assert list(out.keys()) == ["doubled", "total"] and "total" in out and "nope" not in out
    assert set(dict(out)) == {"doubled", "total"} and out.get("nope") is None
    with pytest.raises(KeyError, match="'nope' is not an output"):
        out["nope"]
    exe.save(tmp_path / "two.ingot")
    again = ingot.load(tmp_path / "two.ingot").run(feed)     # the names are kept by the package
    assert type(again) is ingot.Outputs and list(again.keys()) == ["doubled", "total"]
    np.testing.assert_array_equal(again["total"], total)
    unnamed = g.compile(targets=[targets["total"], x]).run(feed)
    assert list(unnamed.keys()) == ["output_0", "x"]         # a placeholder keeps its own name


def test_package_without_output_names_still_loads(tmp_path):
    import json

    import ingot
    g, x, targets = _two_outputs()
    g.compile(targets=targets).save(tmp_path / "old.ingot")
    graph = json.loads((tmp_path / "old.ingot" / "graph.json").read_text())
    del graph["output_names"]                                # as packages written before names
    (tmp_path / "old.ingot" / "graph.json").write_text(json.dumps(graph))
    assert list(ingot.load(tmp_path / "old.ingot").run({"x": np.ones((2, 3), np.float32)}).keys()) == ["output_0", "output_1"]
    graph["output_names"] = ["a", "a"]
    (tmp_path / "old.ingot" / "graph.json").write_text(json.dumps(graph))
    with pytest.raises(ingot.IngotError, match="output_names"):
        ingot.load(tmp_path / "old.ingot")


def test_from_onnx_returns_the_same_outputs_type():
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    import ingot
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = ingot.from_onnx(model).run({"x": np.array([-1.0, 2.0], np.float32)})
    assert type(out) is ingot.Outputs and list(out.keys()) == ["y", "z"]
    y, z = out
    np.testing.assert_array_equal(y, [0.0, 2.0])
    np.testing.assert_array_equal(out["z"], [1.0, -2.0])
    assert onnx is not None
