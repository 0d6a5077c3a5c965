"""Mixture-of-experts models as Ingot LLM packages: `ingot convert` and `ingot quantize` of a Qwen3-MoE
GGUF store the expert stacks in the form the graph multiplies (models.moe.ExpertStack), the package
reader (what `ingot.llm.load` opens; these tiny files carry no tokenizer) and `ingot.load` read them
back memory-mapped, and the model decodes the same greedy ids as the tensors it was saved from. (Against transformers: test_families.py.)"""
import json

import numpy as np
import pytest

import ingot
from family_models import write_family_gguf
from ingot import models
from ingot.cli import main
from ingot.errors import IngotError
from ingot.llm.generate import LLM
from ingot.llm.package import open_model, read_llm
from ingot.models.moe import ExpertStack
from ingot.quant.pipeline import quantize_model

PROMPT = np.random.default_rng(3).integers(0, 128, 20).astype(np.int32).tolist()


def greedy(llm: LLM, steps: int = 32) -> list[int]:
    logits = llm.prefill(PROMPT)
    ids = []
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits = llm.step(ids[-1])
    return ids


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    write_family_gguf("qwen3moe", path)
    return path


def test_quantized_moe_package_round_trips_with_the_same_greedy_ids(moe_gguf, tmp_path, capsys):
    """`ingot quantize` (int8) of the MoE GGUF: the package's experts are ExpertStacks (gate and up side by
    side), and ingot.llm.load of it decodes the ids the quantized tensors give before they were saved."""
    out = tmp_path / "moe8.ingot"
    assert main(["quantize", str(moe_gguf), "-o", str(out), "--format", "int8", "--no-calibration", "--no-eval"]) == 0
    model = open_model(str(moe_gguf))
    result = quantize_model(model, "int8")
    cfg = model.config
    cfg.context_length = 64
    before = greedy(LLM.from_graph(models.build(cfg, result.tensors, str(moe_gguf)), tokenizer=None))
    stored = read_llm(out)
    joint = "blk.0.ffn_gate_exps.weight+blk.0.ffn_up_exps.weight"
    assert isinstance(stored.tensors[joint], ExpertStack) and stored.tensors[joint].shape == (8, 64, 128)
    assert stored.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 64)
    assert isinstance(stored.tensors[joint].q, np.memmap) or not stored.tensors[joint].q.flags.owndata
    info = json.loads((out / "llm.json").read_text())
    assert info["tensors"][joint]["kind"] == "experts" and info["architecture"] == "qwen3moe"
    stored.config.context_length = 64
    assert greedy(LLM.from_graph(models.build(stored.config, stored.tensors, stored.path), tokenizer=None)) == before


def test_converted_moe_package_keeps_the_gguf_experts_numbers(moe_gguf, tmp_path):
    """`ingot convert` without quantizing: the GGUF's Q8_0 and Q4_0 experts stored as they are multiplied;
    the stored decode executable (ingot.load) gives the GGUF model's next-token logits."""
    from ingot.convert import convert

    convert(moe_gguf, tmp_path / "moe.ingot")
    model = open_model(str(moe_gguf))
    cfg = model.config
    cfg.context_length = 64
    source = LLM.from_graph(models.build(cfg, model.tensors, str(moe_gguf)), tokenizer=None)
    stored = read_llm(tmp_path / "moe.ingot")
    stored.config.context_length = 64
    assert greedy(LLM.from_graph(models.build(stored.config, stored.tensors, stored.path), tokenizer=None)) == greedy(source)
    decoder = ingot.load(tmp_path / "moe.ingot")                      # the decode executable on its own
    feeds = {"tokens": np.array(PROMPT[:1], np.int32), "pos": np.int32(0), "last": np.int32(0)}
    (got,) = decoder.run(feeds)
    cfg.context_length = 256
    (want,) = models.build(cfg, model.tensors, str(moe_gguf)).compile(1).run(feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_expert_stack_that_does_not_fit_its_description_is_refused(moe_gguf, tmp_path):
    from ingot.convert import convert

    convert(moe_gguf, tmp_path / "moe.ingot")
    info = json.loads((tmp_path / "moe.ingot" / "llm.json").read_text())
    info["tensors"]["blk.0.ffn_down_exps.weight"]["params"] = []           # a Q4_0 stack without its scales
    (tmp_path / "moe.ingot" / "llm.json").write_text(json.dumps(info))
    with pytest.raises(IngotError, match=r"llm.json: expert stack blk.0.ffn_down_exps.weight is described as int4\[8, 64, 64\]"):
        read_llm(tmp_path / "moe.ingot")


def test_a_package_s_experts_read_back_as_the_gguf_s_rows_for_requantizing(moe_gguf, tmp_path):
    """`ingot quantize` of an MoE package reads each expert stack back as the GGUF file's rows [E * out, in]
    (gate and up split again), the same numbers as from the GGUF itself."""
    from ingot.convert import convert
    from ingot.quant.pipeline import float_weights

    convert(moe_gguf, tmp_path / "moe.ingot")
    source, stored = dict(float_weights(open_model(str(moe_gguf)))), dict(float_weights(read_llm(tmp_path / "moe.ingot")))
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        assert stored[name].shape == (512, 64)
        np.testing.assert_array_equal(stored[name], source[name])
    assert main(["quantize", str(tmp_path / "moe.ingot"), "-o", str(tmp_path / "again.ingot"), "--format", "int8",
                 "--no-calibration", "--no-eval"]) == 0
    assert isinstance(read_llm(tmp_path / "again.ingot").tensors["blk.1.ffn_down_exps.weight"], ExpertStack)


def test_an_moe_package_s_size_and_parameters_count_its_experts(moe_gguf, tmp_path):
    from ingot.convert import convert
    from ingot.llm.generate import _model_info
    from ingot.quant.formats import tensor_nbytes

    convert(moe_gguf, tmp_path / "moe.ingot")
    stored = read_llm(tmp_path / "moe.ingot")
    joint = stored.tensors["blk.0.ffn_gate_exps.weight+blk.0.ffn_up_exps.weight"]
    assert tensor_nbytes(joint) == joint.q.nbytes + joint.scale.nbytes > 8 * 64 * 128
    experts = 2 * 3 * 8 * 64 * 64                                         # 2 layers of gate, up, down [8, 64, 64]
    assert _model_info(stored)["parameters"] == _model_info(open_model(str(moe_gguf)))["parameters"] > experts
    assert _model_info(stored)["weights"] == "mostly int8:32"          # Q8_0's gate and up experts


def test_float_expert_stacks_are_stored_and_read_back_too(tmp_path, monkeypatch):
    """float32 gate and up experts (an F32 GGUF's): one ExpertStack each, float, beside the Q4_0 down stack."""
    import dataclasses

    import family_models
    from ingot.convert import convert

    monkeypatch.setitem(family_models.FAMILIES, "qwen3moe_f32",
                        dataclasses.replace(family_models.FAMILIES["qwen3moe"], expert_quant="F32"))
    write_family_gguf("qwen3moe_f32", tmp_path / "moe.gguf")
    convert(tmp_path / "moe.gguf", tmp_path / "moe.ingot")
    stored = read_llm(tmp_path / "moe.ingot")
    gate = stored.tensors["blk.0.ffn_gate_exps.weight"]
    assert gate.qdtype is None and gate.q.dtype == np.float32 and gate.shape == (8, 64, 64)
    assert stored.tensors["blk.0.ffn_down_exps.weight"].qdtype is not None
    model = open_model(str(tmp_path / "moe.gguf"))
    model.config.context_length = stored.config.context_length = 64
    source = LLM.from_graph(models.build(model.config, model.tensors, model.path), tokenizer=None)
    assert greedy(LLM.from_graph(models.build(stored.config, stored.tensors, stored.path), tokenizer=None)) == greedy(source)
