"""Packages: save -> load -> run is bit-identical; weights are memory-mapped; broken packages fail clearly."""
import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.ir import Op
from ingot.package import FORMAT, READS


def adapter():
    g = ingot.Graph()
    h = g.placeholder((4, 8), name="h")
    bias = g.variable(np.full((4, 8), 0.5, np.float32), name="adapter_bias")
    return g.compile(targets=[g.tanh(h) + bias])


def every_dtype_executable():
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((4, 8), name="x")
    pos = g.placeholder((), ingot.int32, name="pos")
    w32 = g.constant(rng.standard_normal((8, 8)).astype(np.float32), name="w_f32")
    w16 = g.constant(rng.standard_normal((8, 8)).astype(np.float16), name="w_f16")
    wbf = g.constant(rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16), name="w_bf16")
    q4 = g.constant(dt.pack_int4(rng.integers(-8, 8, (8, 8))), dtype=ingot.int4, name="w_int4")
    qu4 = g.constant(dt.pack_int4(rng.integers(0, 16, (8, 8))), dtype=ingot.uint4, name="w_uint4")
    q8 = g.constant(rng.integers(-128, 128, (8, 8)).astype(np.int8), name="w_int8")
    qu8 = g.constant(rng.integers(0, 256, (8, 8)).astype(np.uint8), name="w_uint8")
    scales = g.constant(rng.uniform(0.01, 0.1, 8).astype(np.float32), name="scales")
    ids = g.constant(np.array([3, 1], np.int32), name="ids")
    big = g.constant(np.array([2**40], np.int64), name="big")
    keep = g.constant(rng.random((4, 8)) > 0.5, name="keep")
    rotation = g.constant(np.exp(1j * rng.uniform(0, 6, (8,))).astype(np.complex64), name="rotation")
    phase = g.constant(np.complex64(0.5 - 0.25j), name="phase")  # 0-d complex
    cache = g.variable(np.zeros((1, 6, 8), np.float32), name="cache")
    steps = g.variable(np.zeros((), np.int64), name="steps")
    g.assign(cache, g.slice_update(cache, g.reshape(x[0:1], (1, 1, 8)), start=[0, pos, 0]))
    g.assign(steps, steps + 1)

    h = g.matmul(x, w32) + g.cast(g.matmul(g.cast(x, ingot.float16), w16), ingot.float32)
    h = h + g.cast(g.matmul(g.cast(x, ingot.bfloat16), wbf), ingot.float32)
    for q in (q4, qu4, q8, qu8):
        h = h + g.matmul(x, g.transpose(g.dequantize(q, scale=scales, axis=0)))
    h = g.where(keep, h, 0.0) + g.sum(g.gather(x, ids, axis=1))
    spectrum = g.fft(g.cast(h, ingot.complex64), axes=-1) * rotation * phase
    h = h + g.real(spectrum) * 1e-3 + g.cast(g.minimum(steps, big), ingot.float32)
    (adapted,) = g.call("adapter", [h], [ingot.TensorType((4, 8))])
    out = g.rms_norm(adapted + h, eps=1e-5) + g.sum(cache, axis=1)
    return g.compile(targets=[out, spectrum, steps], callables={"adapter": adapter()})


def run_twice(exe):
    rng = np.random.default_rng(1)
    results = []
    for p in range(2):
        results.append(exe.run({"x": rng.standard_normal((4, 8)).astype(np.float32), "pos": np.int32(p)}))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    exe = every_dtype_executable()
    path = tmp_path_factory.mktemp("pkg") / "model.ingot"
    exe.save(path)
    return exe, path


def test_round_trip_is_bit_identical(saved):
    exe, path = saved
    loaded = ingot.load(path)
    for before, after in zip(run_twice(exe), run_twice(loaded)):
        for a, b in zip(before, after):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.isfinite(a).all() and a.tobytes() == b.tobytes()
    assert loaded.state["steps"] == 2 and loaded.state["cache"][0, 1].any()
    assert loaded.feed_order == exe.feed_order == ["x", "pos"]
    assert loaded.history == exe.history


def test_constants_of_every_dtype_are_stored_natively(saved):
    exe, path = saved
    with open(path / "weights.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    dtypes = {name: info["dtype"] for name, info in header.items() if name != "__metadata__"}
    assert dtypes["constant:w_bf16"] == "BF16" and dtypes["constant:rotation"] == "C64"
    assert dtypes["constant:w_int4"] == "U8" and header["constant:w_int4"]["shape"] == [8, 4]  # packed bytes
    assert header["constant:phase"]["shape"] == [] and dtypes["variable:steps"] == "I64"
    kinds = {value.dtype.name for value in exe.program.constants.values()}
    assert {"float32", "float16", "bfloat16", "uint8", "int8", "int32", "int64", "bool", "complex64"} <= kinds


def test_weights_are_memory_mapped(saved):
    _, path = saved
    loaded = ingot.load(path)
    for key, value in loaded.program.constants.items():
        assert isinstance(value, np.memmap) or not value.flags.owndata, key
        assert not value.flags.writeable, key
    state = loaded.new_state()  # variables get their own writable copies
    assert state["cache"].flags.writeable and state["cache"].flags.owndata


def test_only_json_and_safetensors_files(saved):
    _, path = saved
    files = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
    assert files and all(f.endswith((".json", ".safetensors")) for f in files)
    assert os.path.isfile(path / "callables" / "adapter.ingot" / "manifest.json")
    for f in files:
        with open(f, "rb") as handle:
            assert b"\x80\x04\x95" not in handle.read()  # no pickle protocol 4 frames anywhere


def test_regions_round_trip(saved):
    exe, path = saved
    loaded = ingot.load(path)
    assert exe.regions
    signature = lambda e: [[(n.op, n.type) for n in region] for region in e.regions]  # noqa: E731
    assert signature(loaded) == signature(exe)
    assert loaded.program.buffer_sizes == exe.program.buffer_sizes


def test_save_replaces_an_older_package(tmp_path, saved):
    _, _ = saved
    path = tmp_path / "m.ingot"
    adapter().save(path)
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    g.compile(targets=[x + 1.0]).save(path)
    assert ingot.load(path).run({"x": np.zeros(2, np.float32)})[0].tolist() == [1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["m.ingot"]


# -- atomic save ----------------------------------------------------------------------------------
def test_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.numpy

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        adapter().save(tmp_path / "m.ingot")
    assert os.listdir(tmp_path) == []


def test_a_failed_save_keeps_the_old_package(tmp_path, monkeypatch):
    import safetensors.numpy

    path = tmp_path / "m.ingot"
    adapter().save(path)
    before = sorted(os.listdir(path))
    monkeypatch.setattr(safetensors.numpy, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        adapter().save(path)
    assert sorted(os.listdir(tmp_path)) == ["m.ingot"] and sorted(os.listdir(path)) == before
    monkeypatch.undo()
    assert ingot.load(path).run({"h": np.zeros((4, 8), np.float32)})[0].tolist()[0][0] == 0.5


def test_save_refuses_to_replace_what_is_not_a_package(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ingot.IngotError, match="not an Ingot package"):
        adapter().save(tmp_path)
    with pytest.raises(ingot.IngotError, match="not an Ingot package"):
        adapter().save(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


# -- malformed packages ---------------------------------------------------------------------------
def small_package(tmp_path):
    g = ingot.Graph()
    x = g.placeholder((3,), name="x")
    w = g.constant(np.arange(3, dtype=np.float32), name="w")
    path = tmp_path / "small.ingot"
    g.compile(targets=[x * w + 1.0]).save(path)
    return path


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def truncate_weights(p):
    f = p / "weights.safetensors"
    f.write_bytes(f.read_bytes()[:-5])


def unknown_op(p):
    def change(graph):
        graph["nodes"][-1]["op"] = "FLASH_DECODE"
    edit_json(p / "graph.json", change)


def absent_tensor(p):
    def change(graph):
        for node in graph["nodes"]:
            if node["op"] == "CONSTANT" and node["attrs"]["key"] == "w":
                node["attrs"]["key"] = "w_missing"
    edit_json(p / "graph.json", change)


def wrong_type(p):
    def change(graph):
        for node in graph["nodes"]:
            if node["op"] == "CONSTANT" and node["attrs"]["key"] == "w":
                node["type"]["shape"] = [4]
    edit_json(p / "graph.json", change)


def missing_key(p):
    def change(graph):
        del graph["outputs"]
    edit_json(p / "graph.json", change)


BREAKAGES = {
    "truncated weights": (truncate_weights, "weights.safetensors is truncated"),
    "empty weights": (lambda p: (p / "weights.safetensors").write_bytes(b"\x01\x00"), "truncated"),
    "wrong version": (lambda p: edit_json(p / "manifest.json", lambda m: m.update(version=max(READS) + 1)),
                      f"format version {max(READS) + 1}; this Ingot reads versions"),
    "wrong format": (lambda p: edit_json(p / "manifest.json", lambda m: m.update(format="mpsgraph")),
                     "not an Ingot package .*'mpsgraph'"),
    "missing manifest": (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    "missing graph": (lambda p: (p / "graph.json").unlink(), "graph.json is missing"),
    "missing weights": (lambda p: (p / "weights.safetensors").unlink(), "weights.safetensors is missing"),
    "absent tensor": (absent_tensor, "'w_missing', absent from weights.safetensors"),
    "unknown op": (unknown_op, "unknown op 'FLASH_DECODE'"),
    "corrupt graph json": (lambda p: (p / "graph.json").write_text('{"nodes": [1, 2'), "graph.json is not valid JSON"),
    "corrupt manifest json": (lambda p: (p / "manifest.json").write_text("\x00\xff"), "manifest.json is not valid JSON"),
    "graph not an object": (lambda p: (p / "graph.json").write_text("[]"), "graph.json holds a JSON list"),
    "tensor type mismatch": (wrong_type, "declares constant 'w' as float32\\[4\\]"),
    "malformed graph": (missing_key, "graph.json is malformed"),
    "callable name escapes": (lambda p: edit_json(p / "manifest.json", lambda m: m.update(callables=["../../etc"])),
                              "not a plain name"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_broken_package_raises_one_clear_ingot_error(tmp_path, breakage):
    path = small_package(tmp_path)
    ingot.load(path)  # intact, it loads
    damage, message = BREAKAGES[breakage]
    damage(path)
    with pytest.raises(ingot.IngotError, match=message) as info:
        ingot.load(path)
    text = str(info.value)
    assert text.startswith("package: ") and "\n" not in text
    error = info.value  # one error, no chained traceback behind it
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert type(info.value) is ingot.IngotError


def test_loading_what_is_not_there(tmp_path):
    with pytest.raises(ingot.IngotError, match="does not exist"):
        ingot.load(tmp_path / "nothing.ingot")


def test_loaded_program_is_verified_and_runs(tmp_path):
    path = small_package(tmp_path)
    loaded = ingot.load(path)
    assert [n.op for n in loaded.program.nodes()].count(Op.CONSTANT) == 2
    np.testing.assert_array_equal(loaded.run({"x": np.ones(3, np.float32)})[0], [1, 2, 3])
