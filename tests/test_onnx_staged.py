"""Ops whose output shape depends on values (NonZero, Unique, NonMaxSuppression): computed at import when
their inputs are known, else run as a host step between two compiled stages (the second compiled per
shape), against onnxruntime."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402
from ingot.importers.onnx import OnnxExecutable, StagedOnnxExecutable, from_onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def model_of(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def assert_matches(exe, model, feeds):
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = exe.run(feeds)
    assert list(ours.keys()) == [o.name for o in model.graph.output]
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def nonzero_model(threshold=0.0):
    """The sum of squares of x's values above a threshold, and where they are."""
    nodes = [helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.array(threshold, np.float32))),
             helper.make_node("Greater", ["x", "t"], ["mask"]),
             helper.make_node("NonZero", ["mask"], ["where"]),
             helper.make_node("Transpose", ["where"], ["idx"]),
             helper.make_node("GatherND", ["x", "idx"], ["vals"]),
             helper.make_node("Mul", ["vals", "vals"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["total"], keepdims=0)]
    return model_of(nodes, [("x", TensorProto.FLOAT, [3, 5])],
                    [("total", TensorProto.FLOAT, []), ("where", TensorProto.INT64, [2, None])])


def test_nonzero_on_data_runs_between_two_stages():
    model = nonzero_model()
    exe = from_onnx(model)
    assert isinstance(exe, StagedOnnxExecutable) and isinstance(exe.first, OnnxExecutable)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(3)]
    xs.append(xs[0] * 2)      # the same count of positives as the first: no new compile
    xs.append(-np.abs(xs[1]))  # none: [2, 0] indices, a sum over nothing
    for x in xs:
        assert_matches(exe, model, {"x": x})
    counts = {int((x > 0).sum()) for x in xs}
    assert len(exe.second.compiled) == len(counts)


def test_nonzero_of_a_constant_is_computed_at_import():
    nodes = [helper.make_node("NonZero", ["c"], ["where"]), helper.make_node("Cast", ["where"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "x"], ["y"])]
    c = numpy_helper.from_array(np.array([[0, 3, 0], [1, 0, 2]], np.int32), "c")
    model = model_of(nodes, [("x", TensorProto.FLOAT, [2, 3])], [("y", TensorProto.FLOAT, [2, 3])], [c])
    exe = from_onnx(model)
    assert isinstance(exe, OnnxExecutable)
    assert_matches(exe, model, {"x": np.ones((2, 3), np.float32)})


def test_unique_on_data():
    nodes = [helper.make_node("Unique", ["x"], ["values", "indices", "inverse", "counts"], sorted=1),
             helper.make_node("Cast", ["counts"], ["fc"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["values", "fc"], ["weighted"])]
    model = model_of(nodes, [("x", TensorProto.FLOAT, [12])],
                     [("weighted", TensorProto.FLOAT, [None]), ("inverse", TensorProto.INT64, [12])])
    exe = from_onnx(model)
    rng = np.random.default_rng(1)
    for _ in range(3):
        assert_matches(exe, model, {"x": rng.integers(0, 5, 12).astype(np.float32)})


def test_non_max_suppression_then_gather_the_kept_boxes():
    """A detector's tail: boxes scaled from the input, NMS, the kept boxes gathered and scored."""
    nodes = [helper.make_node("Mul", ["raw", "scale"], ["boxes"]),
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "min_score"], ["selected"]),
             helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
             helper.make_node("Squeeze", ["boxes", "zero"], ["flat"]),
             helper.make_node("Gather", ["flat", "box_index"], ["kept"], axis=0)]
    inits = [numpy_helper.from_array(np.array(100, np.float32), "scale"),
             numpy_helper.from_array(np.array([3], np.int64), "max_out"),
             numpy_helper.from_array(np.array([0.4], np.float32), "iou"),
             numpy_helper.from_array(np.array([0.2], np.float32), "min_score"),
             numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array([0], np.int64), "zero")]
    model = model_of(nodes, [("raw", TensorProto.FLOAT, [1, 9, 4]), ("scores", TensorProto.FLOAT, [1, 2, 9])],
                     [("kept", TensorProto.FLOAT, [None, 4]), ("selected", TensorProto.INT64, [None, 3])], inits)
    exe = from_onnx(model)
    rng = np.random.default_rng(2)
    for _ in range(3):
        corner = rng.random((1, 9, 2)).astype(np.float32)
        raw = np.concatenate([corner, corner + rng.random((1, 9, 2)).astype(np.float32) * 0.5], axis=2)
        assert_matches(exe, model, {"raw": raw, "scores": rng.random((1, 2, 9)).astype(np.float32)})


def test_nonzero_inside_an_if_on_data_is_refused():
    branch = helper.make_graph([helper.make_node("NonZero", ["x"], ["w"])], "b", [],
                               [helper.make_tensor_value_info("w", TensorProto.INT64, None)])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Constant", [], ["z"], value=numpy_helper.from_array(np.array(0, np.float32))),
             helper.make_node("Greater", ["s", "z"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)]
    model = model_of(nodes, [("x", TensorProto.FLOAT, [100])], [("y", TensorProto.INT64, None)])
    with pytest.raises(ingot.IngotError, match="main graph only"):
        from_onnx(model)
