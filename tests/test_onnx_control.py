"""ONNX If, folded at import: a condition known then (a constant input, shape arithmetic) picks the
branch; one computed from a small input compiles per value; one computed from data runs at run time,
its branches compiled as callables of an `if` op."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import ingot  # noqa: E402
from ingot.importers.onnx import NeedsConstant, OnnxExecutable, SpecializingOnnxExecutable, from_onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def if_model(condition_nodes, condition_inputs):
    """y = x * 2 if cond else x + offset (a branch initializer); both branches read the outer x."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y_then"])], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [4])],
                             [numpy_helper.from_array(np.array(2, np.float32), "two")])
    other = helper.make_graph([helper.make_node("Add", ["x", "offset"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.array(1, np.float32), "offset")])
    nodes = condition_nodes + [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])] + condition_inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


SAMPLE_RATE = if_model([helper.make_node("Constant", [], ["rate"], value_int=16000),
                        helper.make_node("Equal", ["sr", "rate"], ["cond"])],
                       [helper.make_tensor_value_info("sr", TensorProto.INT64, [])])
X = np.arange(4, dtype=np.float32)


def test_if_on_a_constant_input_is_folded():
    exe = from_onnx(SAMPLE_RATE, constant_inputs={"sr": np.array(16000)})
    assert isinstance(exe, OnnxExecutable)
    np.testing.assert_array_equal(exe.run({"x": X, "sr": np.array(16000)})["y"], X * 2)
    assert not any(n.op.name == "ADD" for n in exe.program.nodes())   # the other branch is never built
    exe = from_onnx(SAMPLE_RATE, constant_inputs={"sr": np.array(8000)})
    np.testing.assert_array_equal(exe.run({"x": X, "sr": np.array(8000)})["y"], X + 1)
    np.testing.assert_array_equal(exe.run({"x": X, "sr": np.array(8000, np.int32)})["y"], X + 1)   # same value
    np.testing.assert_array_equal(exe.run({"x": X})["y"], X + 1)          # a fixed input may be left out
    with pytest.raises(ingot.IngotError, match=r"missing feeds \['x'\]"):
        exe.run({"sr": np.array(8000)})
    for other in (np.array(16000), 16000, np.array([8000])):
        with pytest.raises(ingot.IngotError, match="fixed to 8000"):
            exe.run({"x": X, "sr": other})


def test_if_on_a_small_input_compiles_per_value():
    exe = ingot.from_onnx(SAMPLE_RATE)
    assert isinstance(exe, SpecializingOnnxExecutable)
    for sr in (16000, 8000, 16000):
        want = X * 2 if sr == 16000 else X + 1
        np.testing.assert_array_equal(exe.run({"x": X, "sr": np.array(sr)})["y"], want)
    assert len(exe.compiled) == 2


def test_if_on_shape_arithmetic_is_folded():
    model = if_model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ReduceProd", ["s"], ["n"], keepdims=0),
                      helper.make_node("Constant", [], ["four"], value=numpy_helper.from_array(np.array(4, np.int64))),
                      helper.make_node("Equal", ["n", "four"], ["cond"])], [])
    np.testing.assert_array_equal(from_onnx(model).run({"x": X})["y"], X * 2)


ZERO = helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.float32)))


def data_if_model():
    """cond = sum(data) > 0, from a 1000-value input: too large to compile per value, so it runs at run time."""
    big = helper.make_tensor_value_info("data", TensorProto.FLOAT, [1000])
    return if_model([helper.make_node("ReduceSum", ["data"], ["total"], keepdims=0), ZERO,
                     helper.make_node("Greater", ["total", "zero"], ["cond"])], [big])


def test_if_on_data_runs_the_branch_its_condition_picks(tmp_path):
    model = data_if_model()
    exe = from_onnx(model)
    assert isinstance(exe, OnnxExecutable)
    (site,) = [n for n in exe.program.nodes() if n.op.name == "IF"]
    assert sorted(exe.callables) == sorted([site.attrs["then"], site.attrs["else"]])
    assert not any(n.op.name in ("MUL", "ADD") for n in exe.program.nodes())   # the branches live in the callables
    rng = np.random.default_rng(0)
    for sign in (1, -1, 1):
        data = np.abs(rng.standard_normal(1000)).astype(np.float32) * sign
        x = rng.standard_normal(4).astype(np.float32)
        want = onnxruntime_run(model, {"x": x, "data": data})
        np.testing.assert_array_equal(want, x * 2 if sign > 0 else x + 1)
        np.testing.assert_array_equal(exe.run({"x": x, "data": data})["y"], want)
    exe.save(tmp_path / "if.ingot")      # the branches are saved as the package's callables
    loaded = ingot.load(tmp_path / "if.ingot")
    data = -np.ones(1000, np.float32)
    np.testing.assert_array_equal(loaded.run({"x": X, "data": data})[0], X + 1)


def test_nested_if_on_data_and_outer_values_of_several_kinds():
    """An If inside a branch of an If, both on data; branches read an outer input, an outer constant and a
    value computed before the If, and the inner one a value of its enclosing branch."""
    inner_then = helper.make_graph([helper.make_node("Sub", ["t", "scale"], ["r1"])], "inner_then", [],
                                   [helper.make_tensor_value_info("r1", TensorProto.FLOAT, [4])])
    inner_else = helper.make_graph([helper.make_node("Neg", ["t"], ["r2"])], "inner_else", [],
                                   [helper.make_tensor_value_info("r2", TensorProto.FLOAT, [4])])
    then = helper.make_graph([helper.make_node("Mul", ["x", "scale"], ["t"]),
                              helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
                              helper.make_node("Greater", ["m", "zero"], ["c2"]),
                              helper.make_node("If", ["c2"], ["inner"], then_branch=inner_then, else_branch=inner_else)],
                             "then", [], [helper.make_tensor_value_info("inner", TensorProto.FLOAT, [4])])
    other = helper.make_graph([helper.make_node("Add", ["x", "shifted"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [4])])
    nodes = [ZERO, helper.make_node("ReduceSum", ["data"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["cond"]),
             helper.make_node("Add", ["x", "x"], ["shifted"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "nested", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                                helper.make_tensor_value_info("data", TensorProto.FLOAT, [100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.array(3, np.float32), "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    exe = from_onnx(model)
    rng = np.random.default_rng(1)
    for data_sign, x_sign in ((1, 1), (1, -1), (-1, 1)):
        feeds = {"x": np.abs(rng.standard_normal(4)).astype(np.float32) * x_sign,
                 "data": np.abs(rng.standard_normal(100)).astype(np.float32) * data_sign}
        np.testing.assert_allclose(exe.run(feeds)["y"], onnxruntime_run(model, feeds), rtol=1e-6)


def test_if_on_data_with_branches_of_different_shapes_is_refused():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["a"])], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["b"], axis=0)], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    nodes = [ZERO, helper.make_node("ReduceSum", ["data"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                           helper.make_tensor_value_info("data", TensorProto.FLOAT, [100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(ingot.IngotError, match=r"If node .*branches that return \[float32\[4\]\] and \[float32\[8\]\]"):
        from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def onnxruntime_run(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def loop_model(condition_from_data: bool):
    """A Loop of 3 steps: total += x * i; each step's total is also a scan output."""
    body_nodes = [helper.make_node("Cast", ["i"], ["i_float"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["x", "i_float"], ["step"]),
                  helper.make_node("Add", ["total_in", "step"], ["total_out"]),
                  helper.make_node("Identity", ["total_out"], ["scan_out"])]
    if condition_from_data:
        body_nodes += [helper.make_node("ReduceSum", ["total_out"], ["s"], keepdims=0),
                       helper.make_node("Constant", [], ["cap"], value=numpy_helper.from_array(np.array(100, np.float32))),
                       helper.make_node("Less", ["s", "cap"], ["cond_out"])]
    else:
        body_nodes += [helper.make_node("Identity", ["cond_in"], ["cond_out"])]
    body = helper.make_graph(body_nodes, "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("total_in", TensorProto.FLOAT, [4])],
                             [helper.make_tensor_value_info(n, t, s) for n, t, s in
                              (("cond_out", TensorProto.BOOL, []), ("total_out", TensorProto.FLOAT, [4]),
                               ("scan_out", TensorProto.FLOAT, [4]))])
    nodes = [helper.make_node("Constant", [], ["trip"], value=numpy_helper.from_array(np.array(3, np.int64))),
             helper.make_node("Constant", [], ["go"], value=numpy_helper.from_array(np.array(True))),
             helper.make_node("Loop", ["trip", "go", "zeros"], ["total", "steps"], body=body)]
    graph = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("total", TensorProto.FLOAT, [4]),
                               helper.make_tensor_value_info("steps", TensorProto.FLOAT, [3, 4])],
                              [numpy_helper.from_array(np.zeros(4, np.float32), "zeros")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_loop_with_a_static_trip_count_is_unrolled():
    total, steps = from_onnx(loop_model(False)).run({"x": X})
    np.testing.assert_array_equal(total, X * 3)
    np.testing.assert_array_equal(steps, [X * 0, X * 1, X * 3])


def test_loop_whose_condition_depends_on_data_is_refused():
    with pytest.raises(ingot.IngotError, match="Loop node .*condition computed from data"):
        from_onnx(loop_model(True))


def test_an_op_without_a_converter_runs_as_its_onnx_function():
    # MeanVarianceNormalization has no converter: ONNX defines it as a function of other ops
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[1])
    graph = helper.make_graph([node], "mvn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])])
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    y = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])).run({"x": x})["y"]
    np.testing.assert_allclose(y, (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True), rtol=1e-5, atol=1e-5)
