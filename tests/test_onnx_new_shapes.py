"""One ONNX model run at many input shapes (SpecializingOnnxExecutable): each new shape's outputs equal a
fresh compile at that shape (bitwise: the same kernels run) and onnxruntime's; a shape that changes what
the import decides (an If folded on a shape) never gets another shape's executable; what imports share
across shapes (ImportCache) and the depthwise kernels' tile widths (one kernel for every width) keep
outputs as they were."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ingot.importers.onnx import SpecializingOnnxExecutable, from_onnx  # noqa: E402
from ingot.ir import Program, toposort  # noqa: E402

C = 16


def _conv_model():
    """x [1, 16, H, W] -> 1x1 conv + relu -> 3x3 depthwise conv + relu -> 1x1 conv, then flattened by a shape
    the graph computes (Shape -> Slice -> Concat -> Reshape): weights fixed, H and W symbolic."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((32, C, 1, 1)).astype(np.float32) * 0.3
    wd = rng.standard_normal((32, 1, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((8, 32, 1, 1)).astype(np.float32) * 0.3
    b = rng.standard_normal(32).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Conv", ["ar", "wd", "b"], ["d"], group=32, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["d"], ["dr"]),
        helper.make_node("Conv", ["dr", "w2"], ["y4"]),
        helper.make_node("Shape", ["y4"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["s2"]),
        helper.make_node("Concat", ["s2", "minus1"], ["s3"], axis=0),
        helper.make_node("Reshape", ["y4", "s3"], ["y"]),
    ]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(wd, "wd"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2], np.int64), "two"), numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, None])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _onnxruntime(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


# widths whose depthwise tiles hold 4, 5, 6, 7 and 8 positions (conv_depthwise.positions), and back
SHAPES = [(9, 16), (6, 4), (7, 5), (5, 6), (8, 7), (3, 19), (9, 16), (12, 26)]


def test_each_new_shape_matches_a_fresh_compile_and_onnxruntime():
    model = _conv_model()
    exe = from_onnx(model)
    assert isinstance(exe, SpecializingOnnxExecutable)
    rng = np.random.default_rng(1)
    for h, w in SHAPES:
        x = rng.standard_normal((1, C, h, w)).astype(np.float32)
        got = exe.run({"x": x})["y"]
        assert got.shape == (1, 8, h * w)
        fresh = from_onnx(model, input_shapes={"x": (1, C, h, w)}).run({"x": x})["y"]
        np.testing.assert_array_equal(got, fresh)
        np.testing.assert_allclose(got, _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-5)
    assert len(exe.compiled) == len(set(SHAPES))


def _if_on_width_model():
    """y = x * 2 where x's last dimension is over 8, else x + 1: an If the import folds on the shape."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)], [two])
    other = helper.make_graph([helper.make_node("Add", ["x", "one"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)], [one])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=-1),
        helper.make_node("Greater", ["s", "eight"], ["wide"]),
        helper.make_node("Squeeze", ["wide"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(nodes, "if_on_width", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([8], np.int64), "eight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_shape_that_changes_a_branch_gets_its_own_executable():
    model = _if_on_width_model()
    exe = from_onnx(model)
    rng = np.random.default_rng(2)
    for w in (4, 12, 8, 9, 4, 12):
        x = rng.standard_normal((2, w)).astype(np.float32)
        want = x * 2 if w > 8 else x + 1
        np.testing.assert_array_equal(exe.run({"x": x})["y"], want)
        np.testing.assert_array_equal(_onnxruntime(model, {"x": x}), want)
    assert len(exe.compiled) == 4


def test_imports_share_what_does_not_depend_on_the_shape():
    """The second shape's import reads the cached nodes (the graph is sorted once), and a converter that
    changed its attributes could not change the next import's: each gets its own dict, arrays read only."""
    model = _conv_model()
    exe = from_onnx(model)
    exe.run({"x": np.ones((1, C, 4, 4), np.float32)})
    (graph, nodes), = exe.import_cache.graphs.values()
    assert graph is model.graph and exe.import_cache.checked
    exe.run({"x": np.ones((1, C, 5, 7), np.float32)})
    assert exe.import_cache.graphs[id(model.graph)][1] is nodes
    for _, _, attrs, _, _ in nodes:
        assert all(not v.flags.writeable for v in attrs.values() if isinstance(v, np.ndarray))


def test_program_order_follows_its_roots():
    """Program.nodes() remembers orders by roots: a program whose outputs change gets the new order, and
    the list it returns is the caller's to change."""
    from ingot.graph import Graph
    g = Graph()
    x = g.placeholder((2,), name="x")
    a, b = x * 2.0, x + 1.0
    program = Program([a.node], [], dict(g.constants))
    first = program.nodes()
    assert first == toposort([a.node])
    first.clear()
    assert program.nodes() == toposort([a.node])
    program.outputs.append(b.node)
    assert program.nodes() == toposort([a.node, b.node]) and b.node in program.nodes()
