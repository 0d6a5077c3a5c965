"""CompileOptions: validated, round-trip through JSON, reach the executable and are stored in packages."""
import json
import os

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.options import CompileOptions, CpuOptions, CudaOptions


def test_defaults_need_no_gpu_and_are_the_h200_table():
    assert CudaOptions() == CudaOptions.for_device("NVIDIA H200") == CudaOptions.for_device("Some Future GPU")
    assert CudaOptions().words_max_rows == 16 and CudaOptions().attention_xq_bytes == 256 << 20
    assert CompileOptions().fusions is None and CompileOptions().cpu.threads is None


def test_gemv_rows_follow_the_precision():
    """The word GEMV takes up to words_max_rows rows; with bf16 many-row dots, up to words_bf16_max_rows."""
    assert CudaOptions().gemv_rows == 16
    assert CudaOptions(prefill_precision="bf16").gemv_rows == 8
    assert CudaOptions(prefill_precision="bf16", words_max_rows=4).gemv_rows == 4
    assert CudaOptions(prefill_precision="bf16", words_bf16_max_rows=16).gemv_rows == 16
    with pytest.raises(ingot.IngotError, match="words_bf16_max_rows is 0"):
        CudaOptions(words_bf16_max_rows=0)


def test_for_device_overrides():
    o = CudaOptions.for_device("NVIDIA H200", gemv_limbs=3, decode_warps=8)
    assert (o.gemv_limbs, o.decode_warps, o.xq_blocks) == (3, 8, 4)
    with pytest.raises(ingot.IngotError, match="no field 'gemv_limb'"):
        CudaOptions.for_device("NVIDIA H200", gemv_limb=3)


def test_json_round_trip():
    o = CompileOptions(fusions={"glu", "qkv"}, cuda=CudaOptions(gemv_tile_blocks=2, timeline="end"),
                       cpu=CpuOptions(threads=2))
    assert isinstance(o.fusions, frozenset)
    assert CompileOptions.from_json(o.to_json()) == o
    assert CompileOptions.from_json("{}") == CompileOptions()
    assert CompileOptions.from_json('{"cuda": {"gemv_limbs": 1}}').cuda == CudaOptions(gemv_limbs=1)
    assert json.loads(o.to_json())["fusions"] == ["glu", "qkv"]


@pytest.mark.parametrize("text,field", [
    ('{"cuda": {"gemv_limbs": "2"}}', "cuda.gemv_limbs"),
    ('{"cuda": {"words_layout": 1}}', "cuda.words_layout"),
    ('{"cuda": {"xq_blocks": true}}', "cuda.xq_blocks"),
    ('{"cuda": {"no_such": 1}}', "cuda.no_such"),
    ('{"cpu": {"threads": "4"}}', "cpu.threads"),
    ('{"gpu": {}}', "'gpu'"),
    ('{"fusions": "glu"}', "fusions"),
    ('{"cuda": {"decode_precision": "fast"}}', "cuda.decode_precision"),
    ('{"cuda": {"gemv_limbs": 4}}', "cuda.gemv_limbs"),
    ('{"cuda": {"self_xq_bytes": -1}}', "cuda.self_xq_bytes"),
    ('{"cuda": 3}', "cuda"),
    ("[1, 2]", "object"),
    ("{nope", "JSON"),
])
def test_bad_options_name_the_field(text, field):
    with pytest.raises(ingot.IngotError, match=field.replace(".", r"\.")):
        CompileOptions.from_json(text)


def graph():
    g = ingot.Graph()
    x = g.placeholder((2, 64), name="x")
    rng = np.random.default_rng(0)
    q = g.constant(dt.pack_int4(rng.integers(-8, 8, (64, 48))), dtype=ingot.int4, name="w")
    scale = g.constant(rng.uniform(0.01, 0.1, (2, 48)).astype(np.float32), name="s")
    return g, g.matmul(x, g.dequantize(q, scale=scale, axis=0, block_size=32))


def test_compile_takes_options_and_caches_by_them():
    g, y = graph()
    threaded = CompileOptions(cpu=CpuOptions(threads=3))
    a = g.compile(targets=[y])
    b = g.compile(targets=[y], options=threaded)
    assert a.options == CompileOptions() and b.options is threaded and a is not b
    assert g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=3))) is b
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(a.run({"x": x})[0], b.run({"x": x})[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ingot.IngotError, match="CompileOptions"):
        g.compile(targets=[y], options={"cpu": {"threads": 2}})


def test_options_file_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "options.json"
    path.write_text(CompileOptions(cuda=CudaOptions(decode_warps=8)).to_json())
    monkeypatch.setenv("INGOT_OPTIONS", str(path))
    g, y = graph()
    assert g.compile(targets=[y]).options.cuda.decode_warps == 8
    path.write_text('{"cuda": {"decode_warps": "8"}}')
    with pytest.raises(ingot.IngotError, match="options.json: options: cuda.decode_warps"):
        CompileOptions.from_environment()
    monkeypatch.setenv("INGOT_OPTIONS", str(tmp_path / "missing.json"))
    with pytest.raises(ingot.IngotError, match="cannot read"):
        CompileOptions.from_environment()


def test_cpu_threads_from_the_environment(monkeypatch):
    monkeypatch.delenv("INGOT_CPU_THREADS", raising=False)
    assert CpuOptions().resolved_threads == len(os.sched_getaffinity(0))   # the usable cores
    monkeypatch.setenv("INGOT_CPU_THREADS", "3")
    assert CpuOptions().resolved_threads == 3 and CpuOptions(threads=2).resolved_threads == 2
    monkeypatch.setenv("INGOT_CPU_THREADS", "many")
    with pytest.raises(ingot.IngotError, match="INGOT_CPU_THREADS"):
        CpuOptions().resolved_threads


def test_packages_store_the_options(tmp_path):
    g, y = graph()
    options = CompileOptions(fusions=frozenset(), cuda=CudaOptions(gemv_limbs=3))   # the CPU has no fusion to name
    g.compile(targets=[y], options=options).save(tmp_path / "a.ingot")
    manifest = json.loads((tmp_path / "a.ingot" / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["options"]["cuda"]["gemv_limbs"] == 3 and manifest["options"]["fusions"] == []
    assert ingot.load(tmp_path / "a.ingot").options == options
    assert ingot.load(tmp_path / "a.ingot", options=CompileOptions()).options == CompileOptions()


def test_a_version_2_package_loads_with_the_defaults(tmp_path):
    g, y = graph()
    g.compile(targets=[y], options=CompileOptions(cuda=CudaOptions(gemv_limbs=3))).save(tmp_path / "a.ingot")
    path = tmp_path / "a.ingot" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["options"]
    manifest["version"] = 2
    path.write_text(json.dumps(manifest))
    assert ingot.load(tmp_path / "a.ingot").options == CompileOptions()
    manifest["version"], manifest["options"] = 3, {"cuda": {"gemv_limbs": "x"}}
    path.write_text(json.dumps(manifest))
    with pytest.raises(ingot.IngotError, match=r"manifest.json: options: cuda\.gemv_limbs"):
        ingot.load(tmp_path / "a.ingot")


def test_llm_compiles_with_its_options():
    from ingot.llm import LLM
    from ingot.models import llama

    cfg = llama.LlamaConfig(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=40, context_length=16)
    options = CompileOptions(cpu=CpuOptions(threads=2))
    llm = LLM.from_graph(llama.build(cfg, llama.random_weights(cfg)), tokenizer=None, options=options)
    assert llm.decoder.options is options
