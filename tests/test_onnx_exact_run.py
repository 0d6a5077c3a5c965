"""The ONNX executables' fast path (OnnxExecutable.exact_run, and SpecializingOnnxExecutable trying the
executable it ran last): feeds of exactly the compiled dtypes, shapes and fixed values run with one pass of
checks; anything else takes the general path, which converts, refuses or compiles as before. Outputs of
successive runs are arrays of their own."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import ingot  # noqa: E402
from ingot.importers.onnx import OnnxExecutable, SpecializingOnnxExecutable, from_onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

X = np.arange(4, dtype=np.float32)


def rate_model(length=4, with_z=True):
    """y = relu(x * 2) if sr == 16000 else x + 1, and the LSTM-free z = x @ w (a planned buffer behind a relu)."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y_then"])], "then", [],
                             [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [length])],
                             [numpy_helper.from_array(np.array(2, np.float32), "two")])
    other = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [length])],
                              [numpy_helper.from_array(np.array(1, np.float32), "one")])
    nodes = [helper.make_node("Constant", [], ["rate"], value_int=16000), helper.make_node("Equal", ["sr", "rate"], ["cond"]),
             helper.make_node("If", ["cond"], ["b"], then_branch=then, else_branch=other),
             helper.make_node("Relu", ["b"], ["y"]),
             helper.make_node("Unsqueeze", ["x", "axes"], ["row"]), helper.make_node("MatMul", ["row", "w"], ["m"]),
             helper.make_node("Relu", ["m"], ["z"])][:None if with_z else 4]
    dim = length if isinstance(length, int) else "n"
    graph = helper.make_graph(nodes, "rate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim]),
                                              helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3])][:None if with_z else 1],
                              [numpy_helper.from_array(np.array([0], np.int64), "axes"),
                               numpy_helper.from_array(np.linspace(-1, 1, 4 * 3, dtype=np.float32).reshape(4, 3), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)


def want(x, sr):
    return np.maximum(x * 2 if sr == 16000 else x + 1, 0), np.maximum(x[None] @ W, 0) if len(x) == 4 else None


def executables():
    return [from_onnx(rate_model(), constant_inputs={"sr": np.array(16000)}), from_onnx(rate_model())]


@pytest.mark.parametrize("kind", [OnnxExecutable, SpecializingOnnxExecutable])
def test_exact_feeds_run_fast_and_agree_with_the_general_path(kind):
    exe = {e.__class__: e for e in executables()}[kind]
    feeds = {"x": X - 1.5, "sr": np.array(16000, np.int64)}
    slow = exe.run([feeds["x"], feeds["sr"]])   # (a list: the general path)
    inner = exe if kind is OnnxExecutable else exe._last
    fast = inner.exact_run(feeds)
    assert fast is not None and list(fast.keys()) == list(slow.keys()) == ["y", "z"]
    for got in (fast, exe.run(feeds), slow):
        np.testing.assert_allclose(got["y"], want(feeds["x"], 16000)[0])
        np.testing.assert_allclose(got["z"], want(feeds["x"], 16000)[1], rtol=1e-6)
    strided = np.arange(8, dtype=np.float32)[::2]   # exact dtype and shape, not contiguous
    np.testing.assert_allclose(exe.run({"x": strided, "sr": feeds["sr"]})["y"], want(strided, 16000)[0])


@pytest.mark.parametrize("kind", [OnnxExecutable, SpecializingOnnxExecutable])
def test_feeds_that_are_not_exact_still_meet_the_general_checks(kind):
    exe = {e.__class__: e for e in executables()}[kind]
    sr = np.array(16000, np.int64)
    exe.run({"x": X, "sr": sr})
    inner = exe if kind is OnnxExecutable else exe._last
    hostile = [({"x": np.zeros(5, np.float32), "sr": sr}, "shape"),               # wrong shape
               ({"x": np.zeros((4, 1), np.float32), "sr": sr}, "shape"),
               ({"x": X.astype(np.int64), "sr": sr}, "dtype"),                    # a float input fed integers
               ({"x": X.astype(np.complex64), "sr": sr}, "dtype"),
               ({"x": X, "sr": sr, "extra": X}, "not inputs"),                    # unknown name
               ({"sr": sr, "sr2": sr}, "not inputs"),                             # as many feeds, one unknown
               ({"sr": sr}, "missing")]
    for feeds, match in hostile:
        assert inner.exact_run(feeds) is None
        with pytest.raises(ingot.IngotError, match=match):
            exe.run(feeds)
    if kind is OnnxExecutable:   # fixed to 16000: another value is refused, an equal one of another dtype is taken
        assert inner.exact_run({"x": X, "sr": np.array(8000, np.int64)}) is None
        with pytest.raises(ingot.IngotError, match="fixed to 16000"):
            exe.run({"x": X, "sr": np.array(8000, np.int64)})
        np.testing.assert_allclose(exe.run({"x": X, "sr": np.array(16000, np.int32)})["y"], want(X, 16000)[0])
    converted = exe.run({"x": X.astype(np.float64) - 1.5, "sr": sr})   # float64: cast, as before
    np.testing.assert_allclose(converted["y"], want(X - 1.5, 16000)[0])


def test_the_specializing_fast_path_follows_values_and_shapes():
    exe = from_onnx(rate_model(length=None))
    assert isinstance(exe, SpecializingOnnxExecutable)
    for x, sr in [(X, 16000), (X, 16000), (X, 8000), (X, 16000)]:   # (z needs x of 4: other lengths below)
        got = exe.run({"x": x, "sr": np.array(sr, np.int64)})
        np.testing.assert_allclose(got["y"], want(x, sr)[0])
    assert len(exe.compiled) == 2
    exe = from_onnx(rate_model(length=None, with_z=False))   # y alone: any length
    for n, sr in [(4, 16000), (4, 16000), (6, 16000), (6, 8000), (4, 8000), (4, 16000)]:
        x = np.linspace(-2, 2, n, dtype=np.float32)
        np.testing.assert_allclose(exe.run({"x": x, "sr": np.array(sr, np.int64)})["y"], want(x, sr)[0])
        assert exe._last.exact_run({"x": x, "sr": np.array(sr, np.int64)}) is not None
        assert exe._last.exact_run({"x": np.zeros(n + 1, np.float32), "sr": np.array(sr, np.int64)}) is None


def lstm_model(hidden=5, size=3, steps=4):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n) for n, s in
             (("W", (1, 4 * hidden, size)), ("R", (1, 4 * hidden, hidden)), ("B", (1, 8 * hidden)))]
    node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h", "c"], ["y", "h_out", "c_out"], hidden_size=hidden)
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, size]),
                                               helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 1, hidden]),
                                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 1, hidden])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "h_out", "c_out")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_of_successive_runs_are_their_own():
    exe = from_onnx(lstm_model())
    rng = np.random.default_rng(1)
    state = np.zeros((1, 1, 5), np.float32)
    first = exe.run({"x": rng.standard_normal((4, 1, 3)).astype(np.float32), "h": state, "c": state})
    kept = {k: np.array(v, copy=True) for k, v in first.items()}
    second = exe.run({"x": rng.standard_normal((4, 1, 3)).astype(np.float32), "h": first["h_out"], "c": first["c_out"]})
    for name in kept:
        np.testing.assert_array_equal(first[name], kept[name])   # the second run changed nothing the first returned
        assert not np.shares_memory(first[name], second[name])
        assert not np.array_equal(first[name], second[name])
    np.testing.assert_array_equal(state, 0)   # the fed state is read, never written
    np.testing.assert_array_equal(kept["h_out"], first["h_out"])
