"""Files, templates and arguments from strangers (issue 31's reproducers): each is refused with one
IngotError sentence (the CLI: one `error:` line, exit 2), fast, without allocating what the input
claims; and a valid file with an odd shape loads."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

import ingot
from hostile import (nested_json, onnx_add_model, onnx_model, onnx_with_external, patch_gguf_tensor, safetensors_bytes,
                     tiny_llama_gguf, tiny_package, write_gguf)
from ingot import IngotError
from ingot.cli import main

T = gguf.GGMLQuantizationType


def refused(capsys, argv, *words):
    """main(argv) prints exactly one `error:` line holding `words` and returns 2."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def run_cli(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "ingot.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)


# -- GGUF: metadata -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("llama.rope.dimension_count", 2**30, ["rope.dimension_count", "1073741824"]),
    ("llama.rope.dimension_count", 18, ["rope.dimension_count", "18", "head dimension 16"]),
    ("llama.attention.head_count", 0, ["attention.head_count", "0"]),
    ("llama.attention.head_count_kv", 0, ["head_count_kv", "0"]),
    ("llama.attention.head_count_kv", 3, ["head_count_kv", "3"]),
    ("llama.attention.head_count", 5, ["embedding_length 64", "head_count 5"]),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), ["layer_norm_rms_epsilon", "nan"]),
    ("llama.rope.freq_base", float("inf"), ["freq_base", "inf"]),
    ("llama.block_count", "two", ["block_count", "'two'", "not an integer"]),
    ("llama.embedding_length", 64.0, ["embedding_length", "not an integer"]),
    ("llama.context_length", -5, ["context_length", "-5"]),
    ("llama.rope.scaling.type", [1048576, 31], ["rope.scaling.type", "not a string"]),  # found by the fuzzer
])
def test_gguf_metadata_is_checked_before_use(tmp_path, capsys, key, value, words):
    path = tiny_llama_gguf(tmp_path / "m.gguf", metadata={key: value})
    refused(capsys, ["generate", "hi", "--model", path], "m.gguf", *words)


@pytest.mark.parametrize("metadata, words", [
    ({"tokenizer.ggml.merges": ["zz qq"]}, ["merges", "zz"]),
    ({"tokenizer.ggml.tokens": list(range(270))}, ["tokenizer.ggml.tokens", "int"]),
    ({"tokenizer.ggml.token_type": ["x"] * 270}, ["token_type", "'x'"]),
    ({"tokenizer.ggml.bos_token_id": "one"}, ["bos_token_id", "'one'"]),
    ({"tokenizer.ggml.eos_token_id": 100000}, ["eos_token_id", "100000"]),
])
def test_gguf_tokenizer_metadata_is_checked(tmp_path, capsys, metadata, words):
    path = tiny_llama_gguf(tmp_path / "m.gguf", metadata=metadata)
    refused(capsys, ["generate", "hi", "--model", path], "m.gguf", *words)


# -- GGUF: tensor list ----------------------------------------------------------------------------------

def quantized_file(path, qtype=T.Q4_0, rows=4, cols=64):
    data = gguf.quants.quantize(np.ones((rows, cols), np.float32), qtype)
    return write_gguf(path, {}, {"a": np.ones(3, np.float32)}, raw={"w": (data, qtype)})


@pytest.mark.parametrize("name, patch, words", [
    ("w", dict(dims=[0, 2**40]), ["tensor w", "dimension of 0"]),        # 0 elements that "read": hung for hours
    ("a", dict(dims=[0]), ["tensor a", "dimension of 0"]),
    ("w", dict(dims=[64, 2**40]), ["truncated", "tensor w"]),
    ("w", dict(dims=[2**32, 2**32]), ["truncated", "tensor w"]),         # the product wraps in uint64
    ("a", dict(dims=[2**62]), ["truncated", "tensor a"]),
    ("w", dict(type_id=9999), ["tensor w", "9999"]),
    ("w", dict(offset=2**63), ["truncated", "tensor w"]),
    ("w", dict(dims=[48, 4]), ["tensor w", "48 columns"]),
])
def test_gguf_tensor_list_is_bounded_by_the_file(tmp_path, name, patch, words):
    from ingot.importers.gguf import read_gguf
    path = patch_gguf_tensor(quantized_file(tmp_path / "q.gguf"), name, **patch)
    start = time.monotonic()
    with pytest.raises(IngotError) as e:
        read_gguf(path)
    assert time.monotonic() - start < 30, "a refusal, not a loop over the claimed rows"  # hangs took hours
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_gguf_quantized_norm_vector_is_refused(tmp_path, capsys):
    """Found by the fuzzer: a norm weight stored as Q4_1 reached np.asarray(QuantizedTensor) (TypeError)."""
    from ingot.llm.package import open_model
    from ingot.models import llama
    path = tiny_llama_gguf(tmp_path / "m.gguf", quantize={"blk.0.attn_norm.weight": T.Q4_1})
    model = open_model(path)
    with pytest.raises(IngotError, match=r"blk\.0\.attn_norm\.weight should be a float vector, not Q4_1"):
        llama.build(model.config, model.tensors, path)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_odd_vocabulary_with_a_4bit_embedding_loads(tmp_path, qtype):
    """32001-token vocabularies exist; a 4-bit token embedding of an odd number of rows cannot pack two
    rows per byte once transposed, so it is kept one value per byte: the same logits as its floats."""
    from ingot.importers.gguf import read_gguf
    from ingot.llm.package import open_model
    from ingot.models import llama

    path = tiny_llama_gguf(tmp_path / "odd.gguf", vocab=271, quantize={"token_embd.weight": qtype})
    model = open_model(path)
    assert model.config.vocab_size == 271
    quantized = llama.build(model.config, model.tensors, path).compile(3)
    floats = {k: v for k, v in read_gguf(path).tensors.items()}
    floats["token_embd.weight"] = floats["token_embd.weight"].dequantize_rows()
    reference = llama.build(model.config, floats, path).compile(3)
    feeds = {"tokens": np.array([5, 270, 104], np.int32), "pos": np.int32(0), "last": np.int32(2)}
    got = quantized.run(feeds, state=quantized.new_state())[0]
    want = reference.run(feeds, state=reference.new_state())[0]
    assert got.shape == (1, 271)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# -- ONNX -----------------------------------------------------------------------------------------------

def secret(tmp_path):
    path = tmp_path / "secret.bin"
    path.write_bytes(np.full(6, 7.0, np.float32).tobytes())
    return path


def onnx_refused(path, *words):
    with pytest.raises(IngotError) as e:
        ingot.from_onnx(str(path))
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    for w in words:
        assert w in message, message
    return message


def test_onnx_external_data_symlink_out_of_the_folder(tmp_path):
    """onnx 1.16 followed this link and returned the secret's bytes as weights."""
    secret(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink("../secret.bin", folder / "link.bin")
    onnx_refused(onnx_with_external(folder, "link.bin"), "link.bin", "outside the model's folder")


@pytest.mark.parametrize("location", ["../secret.bin", "sub/../../secret.bin"])
def test_onnx_external_data_dotdot(tmp_path, location):
    secret(tmp_path)
    (tmp_path / "model" / "sub").mkdir(parents=True)
    onnx_refused(onnx_with_external(tmp_path / "model", location), "outside the model's folder")


@pytest.mark.parametrize("location", ["ABSOLUTE", "w.bin\0x", "a" * 5000, ""])
def test_onnx_external_data_location_is_a_plain_relative_path(tmp_path, location):
    location = str(secret(tmp_path)) if location == "ABSOLUTE" else location
    onnx_refused(onnx_with_external(tmp_path / "model", location), "not a relative path")


def test_onnx_external_data_inside_the_folder_loads(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "real.bin").write_bytes(b"\0" * 8 + np.arange(6, dtype=np.float32).tobytes())
    os.symlink("real.bin", folder / "link.bin")  # a link that stays inside is fine
    exe = ingot.from_onnx(str(onnx_with_external(folder, "link.bin", offset="8")))
    assert exe.run({"x": np.ones((2, 3), np.float32)})["y"].tolist() == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("offset, length, data, words", [
    ("abc", None, b"\0" * 24, ["offset 'abc'"]),
    ("-8", None, b"\0" * 24, ["offset '-8'"]),
    ("1e3", None, b"\0" * 24, ["offset '1e3'"]),
    ("0", "x", b"\0" * 24, ["length 'x'"]),
    ("0", "4", b"\0" * 24, ["length is 4"]),
    ("16", None, b"\0" * 24, ["needs bytes 16..40", "holds 24"]),
])
def test_onnx_external_offsets_and_lengths(tmp_path, offset, length, data, words):
    onnx_refused(onnx_with_external(tmp_path / "m", "w.bin", offset=offset, length=length, data=data), *words)


def save_onnx(model, path):
    import onnx
    onnx.save(model, str(path))
    return path


def test_onnx_initializer_dims_disagree_with_data(tmp_path):
    model = onnx_add_model()
    model.graph.initializer[0].dims[:] = [2, 4]
    onnx_refused(save_onnx(model, tmp_path / "a.onnx"), "'w'", "[2, 4]", "24 bytes")
    model = onnx_add_model()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.float_data[:] = [1.0] * 5
    onnx_refused(save_onnx(model, tmp_path / "b.onnx"), "'w'", "[2, 3]")


def test_onnx_unknown_data_type(tmp_path):
    model = onnx_add_model()
    model.graph.initializer[0].data_type = 99
    onnx_refused(save_onnx(model, tmp_path / "a.onnx"), "'w'", "type 99")


def constant_model(tmp_path, name, node, inits, out_type=1):
    from onnx import helper
    model = onnx_model([node], [], [helper.make_tensor_value_info("y", out_type, None)], inits)
    return save_onnx(model, tmp_path / f"{name}.onnx")


def i64(name, values):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array(values, np.int64), name)


def f32(name, values):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array(values, np.float32), name)


def hostile_generators():
    from onnx import helper
    node = helper.make_node
    return {
        "Range": (node("Range", ["a", "b", "c"], ["y"]), [i64("a", 0), i64("b", 2**40), i64("c", 1)], 7),
        "ConstantOfShape": (node("ConstantOfShape", ["s"], ["y"]), [i64("s", [2**20, 2**20])], 1),
        "OneHot": (node("OneHot", ["i", "d", "v"], ["y"]), [i64("i", [1, 2]), i64("d", [2**40]), f32("v", [0, 1])], 1),
        "Pad": (node("Pad", ["x", "p"], ["y"]), [f32("x", [1, 2]), i64("p", [0, 2**40])], 1),
        "Resize": (node("Resize", ["x", "", "s"], ["y"], mode="nearest"), [f32("x", [[1, 2], [3, 4]]), f32("s", [2**20, 2**20])], 1),
        "Expand": (node("Expand", ["x", "s"], ["y"]), [f32("x", [1]), i64("s", [2**20, 2**20])], 1),
        "CumSum": (node("CumSum", ["x", "a"], ["y"]), [f32("x", np.zeros((1, 2**17))), i64("a", 1)], 1),
    }


@pytest.mark.parametrize("op", ["Range", "ConstantOfShape", "OneHot", "Pad", "Resize", "Expand", "CumSum"])
def test_onnx_generated_tensors_are_capped(tmp_path, op):
    node, inits, out_type = hostile_generators()[op]
    onnx_refused(constant_model(tmp_path, op, node, inits, out_type), f"{op} node", "more than this import allows")


def test_onnx_declared_input_dim_2_31(tmp_path):
    from onnx import helper
    model = onnx_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", 1, [2**31, 4])],
                       [helper.make_tensor_value_info("y", 1, None)])
    onnx_refused(save_onnx(model, tmp_path / "a.onnx"), "input 'x'", "2147483648")


def test_onnx_converter_errors_on_odd_attributes_are_one_sentence(tmp_path):
    from onnx import helper
    # a float where ints belong, and a mode string that is not one
    node = helper.make_node("Transpose", ["x"], ["y"], perm=[1.5, 0.5])
    onnx_refused(constant_model(tmp_path, "t", node, [f32("x", [[1, 2]])]), "Transpose")
    node = helper.make_node("Range", ["a", "b", "c"], ["y"])
    onnx_refused(constant_model(tmp_path, "r", node, [i64("a", 0), i64("b", 5), i64("c", 0)], 7), "Range")
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])   # found by the fuzzer: StopIteration
    onnx_refused(constant_model(tmp_path, "u", node, [f32("x", [1, 2]), i64("axes", [0, 0, 0, 0])]), "Unsqueeze")


# -- packages -------------------------------------------------------------------------------------------

def package_refused(path, *words):
    with pytest.raises(IngotError) as e:
        ingot.load(str(path))
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    for w in words:
        assert w in message, message


def edit_json(path, fn):
    data = json.loads(path.read_text())
    out = fn(data)
    path.write_text(out if isinstance(out, str) else json.dumps(data))


def edit_safetensors_header(path, fn):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    new = fn(header)
    path.write_bytes(safetensors_bytes(new if new is not None else header, raw[8 + n:]))


@pytest.mark.parametrize("file", ["manifest.json", "graph.json"])
def test_package_deeply_nested_json(tmp_path, file):
    pkg = tiny_package(tmp_path / "p.ingot")
    (pkg / file).write_text(nested_json(100_000))
    package_refused(pkg, file, "deeper than")
    (pkg / file).write_text('{"nodes": [{"attrs": {"a": ' + nested_json(900) + '}}]}')  # within Python's limit, not ours
    package_refused(pkg, file, "deeper than")


def constant_entry(header):
    return next(v for k, v in header.items() if k != "__metadata__")


@pytest.mark.parametrize("change, words", [
    (lambda h: nested_json(100_000), ["header", "deeper than"]),
    (lambda h: constant_entry(h).update(shape=[2**32, 2**32, 1]), ["24 bytes", "4294967296"]),  # np.prod wraps to 0
    (lambda h: constant_entry(h).update(shape=[2**62, 4]), ["24 bytes"]),
    (lambda h: json.dumps(h).replace('"shape": [2, 3]', '"shape": [Infinity, 3]'), ["Infinity"]),
    (lambda h: constant_entry(h).update(shape=[2.0, 3]), ["malformed"]),
    (lambda h: constant_entry(h).update(shape=None), ["malformed"]),
    (lambda h: constant_entry(h).update(data_offsets=[0, None]), ["malformed"]),
    (lambda h: {k: None for k in h}, ["malformed"]),
])
def test_package_safetensors_header(tmp_path, change, words):
    pkg = tiny_package(tmp_path / "p.ingot")
    edit_safetensors_header(pkg / "weights.safetensors", change)
    package_refused(pkg, "weights.safetensors", *words)


@pytest.mark.parametrize("change, words", [
    (lambda g: g.update(nodes=None), ["graph.json"]),
    (lambda g: g["nodes"].__setitem__(0, None), ["graph.json"]),
    (lambda g: g["nodes"][0].update(type=None), ["graph.json"]),
    (lambda g: g["nodes"][0]["type"].update(shape=None), ["graph.json", "shape None"]),
    (lambda g: json.dumps(g).replace('"shape": [2, 3]', '"shape": [Infinity, 3]', 1), ["Infinity"]),
    (lambda g: json.dumps(g).replace('"shape": [2, 3]', '"shape": [1e300, 3]', 1), ["1e+300"]),
    (lambda g: json.dumps(g).replace('"shape": [2, 3]', '"shape": [-2, 3]', 1), ["[-2, 3]"]),
    (lambda g: g.update(inputs=[None]), ["graph.json"]),
    (lambda g: g.update(outputs=[[1]]), ["graph.json"]),
    (lambda g: g.update(regions=[[99999]]), ["graph.json"]),
])
def test_package_graph_json_fields(tmp_path, change, words):
    pkg = tiny_package(tmp_path / "p.ingot")
    edit_json(pkg / "graph.json", change)
    package_refused(pkg, *words)


@pytest.mark.parametrize("callables", [["a" * 5000], [None], ["../x"], ["x\0y"]])
def test_package_callable_names(tmp_path, callables):
    pkg = tiny_package(tmp_path / "p.ingot")
    edit_json(pkg / "manifest.json", lambda m: m.update(callables=callables))
    package_refused(pkg, "manifest.json", "callable")


def test_package_callable_symlinked_out_of_the_folder(tmp_path):
    pkg = tiny_package(tmp_path / "p.ingot")
    tiny_package(tmp_path / "elsewhere.ingot")
    (pkg / "callables").mkdir()
    os.symlink(tmp_path / "elsewhere.ingot", pkg / "callables" / "x.ingot")
    edit_json(pkg / "manifest.json", lambda m: m.update(callables=["x"]))
    package_refused(pkg, "outside")


def test_package_null_device_and_odd_history(tmp_path):
    pkg = tiny_package(tmp_path / "p.ingot")
    edit_json(pkg / "graph.json", lambda g: g.update(history=5))
    assert ingot.load(str(pkg)).run({"x": np.zeros((2, 3), np.float32)})[0].tolist() == [[1.0] * 3] * 2
    edit_json(pkg / "manifest.json", lambda m: m.update(device=None))
    package_refused(pkg, "device")
    edit_json(pkg / "manifest.json", lambda m: m.update(device=["cpu"]))   # found by the fuzzer: unhashable
    package_refused(pkg, "device", "['cpu']")


# -- LLM packages ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm_package(tmp_path_factory):
    from ingot.convert import convert
    folder = tmp_path_factory.mktemp("llm")
    convert(tiny_llama_gguf(folder / "t.gguf"), folder / "src.ingot", quantize="int4:32")
    return folder / "src.ingot"


def quantized_entry(info):
    return next(v for v in info["tensors"].values() if v["kind"] == "quantized")


@pytest.mark.parametrize("change, words", [
    (lambda i: i.update(adapter_sites=["../../outside"]), ["adapter site", "'../../outside'"]),
    (lambda i: i.update(adapter_sites=[None]), ["adapter site", "None"]),
    (lambda i: i.update(adapter_sites="x"), ["adapter_sites"]),
    (lambda i: nested_json(100_000), ["deeper than"]),
    (lambda i: i["config"].update(dim=None), ["dim", "None"]),
    (lambda i: i["config"].update(n_heads="4"), ["n_heads", "'4'"]),
    (lambda i: i["config"].update(n_heads=0), ["n_heads", "0"]),
    (lambda i: i["config"].update(context_length=-1), ["context_length", "-1"]),
    (lambda i: json.dumps(i).replace('"rope_base": 10000.0', '"rope_base": NaN'), ["NaN"]),
    (lambda i: i.update(tensors=None), ["llm.json"]),
    (lambda i: quantized_entry(i).update(shape=[2**40, 64]), ["1099511627776", "do not fit"]),
    (lambda i: quantized_entry(i).update(block_size=0), ["blocks of 0"]),
    (lambda i: i.update(metadata=[1]), ["metadata"]),
])
def test_llm_package_llm_json(tmp_path, llm_package, change, words):
    from ingot.llm.package import read_llm
    pkg = tmp_path / "m.ingot"
    shutil.copytree(llm_package, pkg)
    (tmp_path / "outside.ingot").mkdir()
    edit_json(pkg / "llm.json", change)
    with pytest.raises(IngotError) as e:
        read_llm(pkg)
    assert "\n" not in str(e.value) and str(pkg) in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_llm_package_adapter_site_symlinked_out(tmp_path, llm_package):
    from ingot.llm.package import read_llm
    pkg = tmp_path / "m.ingot"
    shutil.copytree(llm_package, pkg)
    tiny_package(tmp_path / "elsewhere.ingot")
    (pkg / "callables").mkdir(exist_ok=True)
    os.symlink(tmp_path / "elsewhere.ingot", pkg / "callables" / "blk.0.attn_q.weight.ingot")
    edit_json(pkg / "llm.json", lambda i: i.update(adapter_sites=["blk.0.attn_q.weight"]))
    with pytest.raises(IngotError, match="outside"):
        read_llm(pkg)


# -- chat templates -------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",
    "{{ ('a'*10**6)|wordwrap(1) }}",
    "{% for c in 'a'*1000000 %}{% for d in 'a'*1000000 %}{% endfor %}{% endfor %}",
])
def test_chat_template_time_bound(template):
    from ingot.llm.chat import MAX_RENDER_SECONDS, render_chat
    start = time.monotonic()
    with pytest.raises(IngotError, match="longer than"):
        render_chat(template, MESSAGES)
    assert time.monotonic() - start < MAX_RENDER_SECONDS + 5  # the bound, not the loops' hours


@pytest.mark.parametrize("template, words", [
    ("{{ 'a' * 2**31 }}", "2147483648"),
    ("{{ [1] * 2**31 }}", "2147483648"),
    ("{{ 'a'|center(2**31) }}", "filter center"),
    ("{{ 'a'.center(2**31) }}", "center"),
    ("{{ '%2000000000d' % 1 }}", "2000000000"),
    ("{{ '{:2000000000}'.format(1) }}", "2000000000"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
    ("{{ ('a'*1000000)|replace('a', 'aaaaaaaaaa') }}", "filter replace"),
    ("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", "rendered text"),
])
def test_chat_template_output_bound(template, words):
    from ingot.llm.chat import render_chat
    with pytest.raises(IngotError) as e:
        render_chat(template, MESSAGES)
    assert "stopped" in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("template, words", [
    ("{{" + "(" * 100_000 + "1" + ")" * 100_000 + "}}", "too deeply"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "stack"),
    ("x" * (2**20 + 1), "at most"),
    ("{% break %}{{ messages }}", "break"),            # found by the fuzzer: Python's SyntaxError, not jinja2's
    ("{% for m in messages %}{% endfor %}{% continue %}", "continue"),
])
def test_chat_template_parse_and_recursion(template, words):
    from ingot.llm.chat import render_chat
    with pytest.raises(IngotError, match=words):
        render_chat(template, MESSAGES)


def test_chat_template_bounds_leave_real_templates_alone():
    from ingot.llm.chat import render_chat
    from ingot.llm.generate import default_model_path
    try:
        from ingot.importers.gguf import read_gguf
        template = read_gguf(default_model_path(), lazy=True).get("tokenizer.chat_template")
    except IngotError:
        pytest.skip("default model not installed")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello there " * 50} for i in range(200)]
    text = render_chat(template, messages)
    assert text.count("hello there") == 200 * 50 and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_panic_and_huge_text_are_one_sentence(monkeypatch):
    import ingot.llm.tokenizer as tk_module
    from hostile import tokenizer_metadata
    tok = tk_module.Tokenizer(tokenizer_metadata())
    assert tok.decode(tok.encode("hello")) == "hello"

    class PanicException(BaseException):  # pyo3's: a BaseException that `except Exception` misses
        pass

    class Panicking:
        def encode(self, *a, **k):
            raise PanicException("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(tok, "_tk", Panicking())
    with pytest.raises(IngotError, match="unwrap"):
        tok.encode("hello")
    monkeypatch.setattr(tk_module, "MAX_TEXT_CHARS", 10)
    with pytest.raises(IngotError, match="11 characters"):
        tok.encode("hello world")


# -- audio and the files Ingot writes -------------------------------------------------------------------

@pytest.fixture
def tone(tmp_path):
    from hostile import wav_bytes
    path = tmp_path / "tone.wav"
    path.write_bytes(wav_bytes(np.sin(np.arange(8000) / 10.0)))
    return path


@pytest.mark.parametrize("flag", ["--mels", "--n-fft", "--hop-length", "--sample-rate"])
def test_spectrogram_sizes_are_bounded(tmp_path, capsys, tone, flag):
    refused(capsys, ["spectrogram", str(tone), "--npy", str(tmp_path / "o.npy"), flag, str(2**40)], flag, str(2**40))
    assert not (tmp_path / "o.npy").exists()


def test_two_gigabyte_wav_is_refused_by_its_header(tmp_path, capsys):
    from hostile import sparse_wav
    path = sparse_wav(tmp_path / "big.wav", 2 * 10**9)   # sparse: no sample is written to disk
    assert os.stat(path).st_blocks * 512 < 1 << 20
    refused(capsys, ["spectrogram", path, "--npy", str(tmp_path / "o.npy")], "big.wav", "1000000000 frames")


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield 0o664
    os.umask(old)


def test_outputs_get_the_umask(tmp_path, tone, umask_002):
    pytest.importorskip("matplotlib")
    assert main(["spectrogram", str(tone), "-o", str(tmp_path / "s.png"), "--npy", str(tmp_path / "s.npy")]) == 0
    for name in ("s.png", "s.npy"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == umask_002, name
    assert sorted(os.listdir(tmp_path)) == ["s.npy", "s.png", "tone.wav"]   # no temporary left behind
    pkg = tiny_package(tmp_path / "p.ingot")
    for name in ("weights.safetensors", "graph.json", "manifest.json"):
        assert os.stat(pkg / name).st_mode & 0o777 == umask_002, name


# -- the CLI boundary -----------------------------------------------------------------------------------

def warn_then(result):
    def command(*args, **kwargs):
        import warnings
        warnings.warn("overflow encountered in cast", RuntimeWarning)
        warnings.warn("overflow encountered in cast", RuntimeWarning)
        if isinstance(result, Exception):
            raise result
    return command


def test_runtime_warnings_do_not_precede_the_error_line(tmp_path, capsys, tone, monkeypatch):
    import ingot.audio_io
    monkeypatch.setattr(ingot.audio_io, "check_spectrogram_parameters", warn_then(IngotError("bad value in x.")))
    refused(capsys, ["spectrogram", str(tone), "--npy", str(tmp_path / "o.npy")], "bad value in x")


def run_python(code: str, *argv, timeout=120):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout, env=env)


def test_runtime_warnings_of_a_success_are_shown_after_it(tmp_path, tone):
    code = ("import sys, warnings, ingot.audio_io as a; from ingot.cli import main\n"
            "a.check_spectrogram_parameters = lambda *x: warnings.warn('overflow encountered', RuntimeWarning)\n"
            "sys.exit(main(sys.argv[1:]))")
    r = run_python(code, "spectrogram", str(tone), "--npy", str(tmp_path / "o.npy"))
    assert r.returncode == 0 and "RuntimeWarning" in r.stderr and r.stderr.index("mels x") < r.stderr.index("RuntimeWarning")
    code = code.replace("RuntimeWarning)", "RuntimeWarning) or (_ for _ in ()).throw(a.IngotError('bad value.'))")
    r = run_python(code, "spectrogram", str(tone), "--npy", str(tmp_path / "o.npy"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: bad value."], r.stderr


def test_refusals_are_cheap_and_one_line(tmp_path):
    """A 24-byte file, and a model whose metadata is wrong, are refused before any kernel compiles or
    weight loads: the process never imports numba (issue 31: a refusal took 10 s under load)."""
    bad = tmp_path / "tiny.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    heads0 = tiny_llama_gguf(tmp_path / "heads0.gguf", metadata={"llama.attention.head_count": 0})
    loops = tiny_llama_gguf(tmp_path / "loops.gguf", metadata={"tokenizer.chat_template": "{% for i in range(99999) %}"
                                                                 "{% for j in range(99999) %}{% endfor %}{% endfor %}"})
    big = tiny_llama_gguf(tmp_path / "big.gguf", metadata={"tokenizer.chat_template": "{{ 'a' * 2**31 }}"})
    code = "import sys; from ingot.cli import main; rc = main(sys.argv[1:]); print('numba' in sys.modules, file=sys.stderr); sys.exit(rc)"
    for argv, name in ((["generate", "hi", "--model", str(bad)], "tiny.gguf"), (["convert", str(bad), "-o", str(tmp_path / "o.ingot")], "tiny.gguf"),
                       (["generate", "hi", "--model", heads0], "heads0.gguf"), (["generate", "hi", "--model", loops], "longer than"),
                       (["generate", "hi", "--model", big], "2147483648")):
        r = run_python(code, *argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 2 and lines[0].startswith("error: ") and name in lines[0], r.stderr
        assert lines[1] == "False", (argv, "numba was imported before the refusal")


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--model", "LONG"], ["view", "LONG", "--html", "OUT/x.html"], ["convert", "LONG", "-o", "OUT/o.ingot"],
    ["spectrogram", "LONG", "--npy", "OUT/o.npy"], ["spectrogram", "TONE", "--npy", "OUT/LONG.npy"],
    ["eval", "kld", "--reference", "LONG", "--model", "LONG", "--text", "LONG"],
])
def test_five_thousand_character_paths(tmp_path, capsys, tone, argv):
    long = "a" * 5000
    argv = [a.replace("LONG", long).replace("OUT", str(tmp_path)).replace("TONE", str(tone)) for a in argv]
    line = refused(capsys, argv)
    assert len(line) < 400, line


@pytest.mark.parametrize("load", ["ingot.load", "ingot.from_onnx", "read_gguf", "open_model", "read_audio"])
def test_library_entry_points_refuse_unopenable_paths(load):
    from ingot.audio_io import read_audio
    from ingot.importers.gguf import read_gguf
    from ingot.llm.package import open_model
    fn = {"ingot.load": ingot.load, "ingot.from_onnx": ingot.from_onnx, "read_gguf": read_gguf, "open_model": open_model,
          "read_audio": read_audio}[load]
    for path in ("a" * 5000, "x\0y"):
        with pytest.raises(IngotError, match="not a path this system can open"):
            fn(path)


# -- LoRA (PEFT) folders --------------------------------------------------------------------------------

@pytest.mark.parametrize("config, rank, words", [
    (nested_json(100_000), 4, ["deeper than"]),
    ('{"r": 4, "lora_alpha": "eight"}', 4, ["lora_alpha", "'eight'"]),
    ('{"r": 4, "lora_alpha": NaN}', 4, ["NaN"]),
    ('{"r": 4, "rank_pattern": [1]}', 4, ["rank_pattern"]),
    ('{"r": 0}', 0, ["rank 0"]),
])
def test_peft_folder(tmp_path, config, rank, words):
    from safetensors.numpy import save_file

    from ingot.adapters import load_peft
    from ingot.models import llama
    cfg = llama.LlamaConfig(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=270)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": np.zeros((rank, 64), np.float32), f"{key}.lora_B.weight": np.zeros((64, rank), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(config)
    with pytest.raises(IngotError) as e:
        load_peft(tmp_path, cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


# -- found by the long fuzz run -------------------------------------------------------------------------

def test_onnx_softmax_of_an_empty_tensor(tmp_path):
    """A Tile by 0 makes an empty axis; Softmax over it took np.max of nothing (ValueError; the fuzzer met it
    while the compiler folded a constant one)."""
    from onnx import helper
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tile", ["h", "reps"], ["t"]),
                        helper.make_node("Softmax", ["t"], ["y"], axis=-1)],
                       [helper.make_tensor_value_info("x", 1, [2, 8])], [helper.make_tensor_value_info("y", 1, None)],
                       [f32("w", np.ones((8, 4))), i64("reps", [1, 0])])
    exe = ingot.from_onnx(str(save_onnx(model, tmp_path / "m.onnx")))   # the softmax axis is empty
    assert exe.run({"x": np.ones((2, 8), np.float32)})["y"].shape == (2, 0)


def test_package_slice_with_a_null_start(tmp_path):
    """A SLICE node whose start holds null reached the CPU backend's planner (TypeError)."""
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    g.compile(targets=[g.slice(x, [1], [3]) * 2.0]).save(str(tmp_path / "p.ingot"))

    def null_start(graph):  # with a size, as the fuzzer's case had: the type rule accepts it, the planner did not
        next(n for n in graph["nodes"] if n["op"] == "SLICE")["attrs"].update(start=[None], end=[None], size=[2])
    edit_json(tmp_path / "p.ingot" / "graph.json", null_start)
    package_refused(tmp_path / "p.ingot", "cannot be loaded", "TypeError")


def test_package_inputs_must_be_named_tensors_of_known_shape(tmp_path):
    """Found by the long fuzz run: graph.json's inputs [{"name": 255, "type": {"shape": [2, null]}}] loaded, and
    feed_types then held a shape no caller could make (np.zeros: TypeError)."""
    g = ingot.Graph()
    x = g.placeholder((2, 3), name="x")
    g.compile(targets=[x * 2.0]).save(str(tmp_path / "p.ingot"))
    edit_json(tmp_path / "p.ingot" / "graph.json", lambda graph: graph["inputs"][0].update(name=255))
    package_refused(tmp_path / "p.ingot", "input 255", "not a named tensor of known shape")
    g.compile(targets=[x * 2.0]).save(str(tmp_path / "q.ingot"))
    edit_json(tmp_path / "q.ingot" / "graph.json", lambda graph: graph["inputs"][0]["type"].update(shape=[2, None]))
    package_refused(tmp_path / "q.ingot", "'x'", "[2, None]", "not a named tensor of known shape")


@pytest.mark.parametrize("eps", [[15], "1e-5", -1.0, True])
def test_package_norm_eps_must_be_a_number(tmp_path, eps):
    """Found by the long fuzz run: an RMS_NORM whose eps graph.json gives as [15] reached the numba kernel
    (TypingError at run). A norm's eps must be a finite number >= 0."""
    g = ingot.Graph()
    x = g.placeholder((2, 8), name="x")
    g.compile(targets=[g.rms_norm(x, np.ones(8, np.float32), eps=1e-5)]).save(str(tmp_path / "p.ingot"))

    def set_eps(graph):
        next(n for n in graph["nodes"] if n["op"] == "RMS_NORM")["attrs"]["eps"] = eps
    edit_json(tmp_path / "p.ingot" / "graph.json", set_eps)
    package_refused(tmp_path / "p.ingot", "rms_norm", "a finite eps >= 0")


@pytest.mark.parametrize("attr,value,says", [("scale", [-8179203571892546432, 9007199254740992], "a finite scale"),
                                             ("scale", "0.25", "a finite scale"), ("causal", 1, "causal true or false")])
def test_package_sdpa_scalars_must_be_what_they_say(tmp_path, attr, value, says):
    """Found by the long fuzz run on the final code (seed 33, package case 95230): an SDPA whose scale
    graph.json gives as a list of ints reached the fused RoPE/attention numba kernel (TypingError)."""
    g = ingot.Graph()
    q = g.placeholder((1, 2, 3, 8), name="q")
    g.compile(targets=[g.scaled_dot_product_attention(q, q, q, scale=0.5)]).save(str(tmp_path / "p.ingot"))

    def set_attr(graph):
        next(n for n in graph["nodes"] if n["op"] == "SDPA")["attrs"][attr] = value
    edit_json(tmp_path / "p.ingot" / "graph.json", set_attr)
    package_refused(tmp_path / "p.ingot", "sdpa", says)

def test_sdpa_length_beyond_the_cache_is_refused():
    """Found by the long fuzz run: a package whose folded constant made the attention length 2**24 read
    past the KV cache in the numba kernel (SIGSEGV). The length is now checked against the cache."""
    from ingot.backends.cpu.nn_kernels import sdpa_step
    from ingot.ir import Node, Op, TensorType
    q = np.zeros((1, 4, 1, 16), np.float32)
    kv = np.zeros((1, 2, 64, 16), np.float32)
    node = Node(Op.SDPA, TensorType(q.shape), (), {"scale": None, "causal": True, "has_mask": False, "has_length": True})
    step = sdpa_step(node)
    assert step(q, kv, kv, np.int32(3)).shape == q.shape
    for length in (2**24, 65, -1):
        with pytest.raises(IngotError, match="outside 0..64"):
            step(q, kv, kv, np.int32(length))


def _peak_rss_during(fn):
    """fn()'s result and how far its peak RSS rose above the RSS before it (Linux: VmHWM, reset first)."""
    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) << 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS:")
    result = fn()
    return result, kib("VmHWM:") - before



def test_onnx_huge_dimension_beside_a_zero_is_refused(tmp_path):
    """Found by the long fuzz run: an input declared [6204901781994648158, 0] holds 0 elements, so it passed the
    element budget, and no caller could make the array it asks for (NumPy: "array is too big")."""
    from onnx import helper
    model = onnx_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", 1, [6204901781994648158, 0])],
                       [helper.make_tensor_value_info("y", 1, None)])
    onnx_refused(save_onnx(model, tmp_path / "a.onnx"), "input 'x'", "6204901781994648158", "more than this import allows")

@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is read from Linux's /proc")
def test_onnx_resize_weights_do_not_cost_many_times_their_size():
    """Found by the long fuzz run: an image model's Resize on a 5,792-tall input peaked at 2.9 GB while its
    weights (ONNX's reference run on an identity matrix) were computed; they now come a block at a time."""
    from onnx.reference.ops import op_resize as ref

    from ingot.importers.onnx_nn import _resize_matrix
    for fct in (ref._linear_coeffs, lambda r, s: ref._cubic_coeffs(r, s, A=-0.75), lambda r, s: ref._nearest_coeffs(r)):
        for transform in ("half_pixel", "align_corners", "asymmetric"):
            kwargs = dict(coordinate_transformation_mode=transform, exclude_outside=False)
            weights, outside = _resize_matrix(7, 13, 13 / 7, None, fct, **kwargs)
            expected = ref._interpolate_1d_along_axis(np.eye(7), 0, 13 / 7, 13, fct, extrapolation_value=0.0, **kwargs)
            np.testing.assert_allclose(weights, expected, atol=1e-12)
            assert outside.shape == (13,)
    # the peak in a fresh process: glibc's thresholds are process-wide (an LLM load in this one sets them:
    # llm/generate.py) and the heap keeps what earlier tests freed, so here the figure depends on them
    code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); from test_hostile_inputs import _peak_rss_during; "
            "from onnx.reference.ops import op_resize as ref; from ingot.importers.onnx_nn import _resize_matrix; "
            "(w, _), rise = _peak_rss_during(lambda: _resize_matrix(2048, 4096, 2.0, None, ref._linear_coeffs, "
            "coordinate_transformation_mode='half_pixel')); "
            "print(w.shape[0], w.shape[1], int(np.allclose(w.sum(axis=1), 1.0)), w.nbytes, rise)")
    run = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=300)
    rows, cols, sums_to_one, nbytes, rise = map(int, run.stdout.split())
    assert (rows, cols, sums_to_one) == (4096, 2048, 1)
    assert rise < 2.5 * nbytes, f"peak RSS rose {rise >> 20} MiB for {nbytes >> 20} MiB of weights"


def test_resampling_between_coprime_rates_is_refused_by_its_header(tmp_path):
    """Found by the long fuzz run: a 2,000-sample FLAC claiming 1,048,384 Hz, read at 22,050 Hz, designed
    a filter of 10 million taps (resample_poly's 20x the larger term of 11025/524192): 480 MB and 2 s; two
    coprime rates near 2**20 took 1 GB and 5 s. The reduced ratio's terms are now bounded, from the header."""
    from hostile import wav_bytes

    from ingot.audio_io import read_audio, resample
    path = tmp_path / "odd.wav"
    path.write_bytes(wav_bytes(np.zeros(2000, np.float32), 1048573))
    with pytest.raises(IngotError, match="odd.wav: resampling 1048573 Hz to 22050 Hz reduces to the ratio 22050/1048573"):
        read_audio(path, 22050)
    assert read_audio(path)[1] == 1048573                              # read as it is: fine
    for rate in (44100, 48000, 22050, 11025, 8000, 96000, 44056):     # every usual rate (and an odd one) resamples
        assert resample(np.zeros(rate // 10, np.float32), rate, 16000).shape == (1600,)


def test_onnx_external_offset_past_the_end_without_a_size(tmp_path):
    """Found by the long fuzz run: an external offset of 2**64 on a tensor whose type has no fixed size
    (its length then came from the file's size) reached f.seek (ValueError: cannot fit 'int')."""
    import onnx
    path = onnx_with_external(tmp_path, "w.bin", offset=str(2**64), data=b"\0" * 24)
    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer[0].data_type = 8   # (STRING: no bytes per element)
    onnx.save(model, str(path))
    onnx_refused(path, "offset 18446744073709551616", "past the end of 'w.bin' (24 bytes)")


def test_onnx_op_type_that_is_not_utf8(tmp_path):
    """Found by the long fuzz run: an op type whose bytes are not UTF-8 reaches Python as bytes, and sorting
    it among the str ones for the "not supported" sentence raised TypeError."""
    from onnx import helper
    model = onnx_model([helper.make_node("Zzz", ["x"], ["h"]), helper.make_node("Nope", ["h"], ["y"])],
                       [helper.make_tensor_value_info("x", 1, [2])], [helper.make_tensor_value_info("y", 1, None)])
    path = save_onnx(model, tmp_path / "m.onnx")
    raw = path.read_bytes().replace(b"Nope", b"N\xf5pe")
    path.write_bytes(raw)
    onnx_refused(path, "2 op types are not supported", "N\\xf5pe", "Zzz")
    path.write_bytes(raw.replace(b"N\xf5pe", b"N\npe"))   # (found by the long fuzz run, seed 32: a newline in an op type)
    onnx_refused(path, "2 op types are not supported", "'N\\npe'")


def test_onnx_resize_of_a_wide_axis_gathers_its_taps():
    """Found by the long fuzz run: Resize applied its weights [n_out, n_in] as a matmul, n_in multiply-adds per
    output; an upscale of a batch of 4,096-wide images by 2 ran past 10 s of CPU. Linear weights have 2
    taps a row: the axis is now a sum of 2 gathers, equal to the matmul."""
    from onnx.reference.ops import op_resize as ref

    from ingot.importers.onnx_nn import _interpolate_axis, _resize_matrix
    for n_in, n_out, fct in ((4096, 8192, ref._linear_coeffs), (7, 13, lambda r, s: ref._cubic_coeffs(r, s, A=-0.75)),
                             (6, 3, ref._linear_coeffs)):
        weights, _ = _resize_matrix(n_in, n_out, n_out / n_in, None, fct, coordinate_transformation_mode="half_pixel")
        g = ingot.Graph()
        x = g.placeholder((3, n_in, 2), name="x")
        y = _interpolate_axis(g, x, 1, weights)
        exe = g.compile(targets=[y])
        data = np.random.default_rng(0).standard_normal((3, n_in, 2)).astype(np.float32)
        np.testing.assert_allclose(exe.run({"x": data})[0], np.einsum("oi,bic->boc", weights, data), rtol=1e-5, atol=1e-5)
        if n_in == 4096:   # (a 6-wide axis keeps the matmul: 2 taps of 6 is no saving)
            assert "MATMUL" not in {n.op.name for n in exe.program.nodes()}
