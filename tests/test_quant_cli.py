"""ingot quantize / ingot eval kld / LLM packages on a tiny model: round trips, compensation and
calibration do what they claim, and bad input is one sentence, exit 2, nothing left behind."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import FIXTURES, logits, save_tiny, save_tiny_gguf, tiny_config, tiny_tensors  # noqa: E402

from ingot.cli import main  # noqa: E402
from ingot.errors import IngotError  # noqa: E402
from ingot.llm.package import open_model, read_llm, save_llm  # noqa: E402
from ingot.llm.tokenizer import tokenize  # noqa: E402
from ingot.quant.pipeline import activation_stats, quantize_model  # noqa: E402

TOKENS = [1, 40, 41, 60, 61, 80, 81, 100]
CALIBRATION = FIXTURES / "calibration_text.txt"
SHORT = CALIBRATION.read_text()[:600]   # the tiny synthetic vocabulary spends many tokens per word


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("texts") / "short.txt"
    path.write_text(SHORT)
    return path


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.ingot"
    save_tiny(path)
    return path


def _logits(model):
    return logits(model.config, model.tensors, TOKENS, model.adapters)


def test_package_round_trip_is_exact(tiny_package):
    import ingot

    cfg = tiny_config()
    model = read_llm(tiny_package)
    np.testing.assert_array_equal(_logits(model), logits(cfg, tiny_tensors(cfg), TOKENS))
    exe = ingot.load(tiny_package)                         # the stored decode executable opens on its own
    assert exe.output_types[0].shape == (1, cfg.vocab_size)


def test_quantize_cli_writes_a_package_generate_runs(tiny_package, tmp_path, capsys, short_text):
    out = tmp_path / "q.ingot"
    assert main(["quantize", str(tiny_package), "-o", str(out), "--format", "lut4:g16", "--compensate", "4",
                 "--calibration", str(short_text), "--context", "64"]) == 0
    text = capsys.readouterr().out
    assert "MB" in text and "mean KLD" in text and "top-1" in text
    info = json.loads((out / "llm.json").read_text())
    assert info["extra"]["quantized"]["format"] == "lut4:g16"
    model = read_llm(out)
    assert model.adapters and all(len(v) == 1 and v[0][0].shape[0] == 4 for v in model.adapters.factors.values())
    assert main(["generate", "--model", str(out), "--no-chat", "--max-tokens", "4", "--json", "hello world"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) >= 1
    assert main(["eval", "kld", "--reference", str(tiny_package), "--model", str(out), "--text", str(short_text),
                 "--context", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 0 < r["mean_kld"] < 1 and 0 <= r["top1"] <= 1 and r["tokens"] > 20


def test_compensation_closes_the_gap_with_rank(tiny_package):
    model = open_model(tiny_package)
    reference = _logits(model)
    stats = activation_stats(model, tokenize(model, SHORT), context=64)
    err = {}
    for rank in (0, 8, 32):
        r = quantize_model(model, "int4:tensor", stats=stats, compensate=rank, exclude=["token_embd.weight"])
        quantized = logits(model.config, r.tensors, TOKENS, r.adapters if rank else None)
        err[rank] = float(np.abs(quantized - reference).mean())
    # per-tensor int4 error of random weights is nearly full-rank noise: each rank takes its share
    assert err[32] < 0.5 * err[0] and err[32] < err[8] < err[0], err


def test_awq_and_calibrated_lut_are_not_worse(tiny_package):
    model = open_model(tiny_package)
    reference = _logits(model)
    stats = activation_stats(model, tokenize(model, SHORT), context=64)
    gap = lambda r: float(np.abs(logits(model.config, r.tensors, TOKENS) - reference).mean())  # noqa: E731
    plain = gap(quantize_model(model, "int4:32"))
    aware = gap(quantize_model(model, "int4:32", stats=stats, awq=True))
    assert aware < 1.2 * plain                                # AWQ keeps alpha = 0 where scaling does not help


@pytest.mark.parametrize("args, message", [
    (["--format", "int4:33"], "format 'int4:33' is not valid"),
    (["--format", "fp4"], "is not a type"),
    (["--format", "int4:32", "--calibration", "EMPTY"], "is empty"),
    (["--format", "int4:32", "--compensate", "-1"], "rank"),
    (["--format", "int4:32", "--no-calibration", "--awq"], "needs a calibration text"),
    (["--format", "int4:32", "--no-calibration", "--calibration", "EMPTY"], "not both"),
    (["--format", "lut4", "--awq"], "affine formats"),
    (["--tensor-format", "token_embd.weight"], "is not GLOB=FMT"),
    (["--tensor-format", "token_embd.weight=int3"], "format 'int3' is not valid"),
    (["--bits", "0"], "is not a budget in bits per weight"),
    (["--bits", "3.5", "--no-calibration"], "raise the budget"),
])
def test_quantize_bad_input_is_one_sentence_and_writes_nothing(tiny_package, tmp_path, capsys, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "never.ingot"
    args = [str(empty) if a == "EMPTY" else a for a in args]
    assert main(["quantize", str(tiny_package), "-o", str(out)] + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_lora_that_does_not_fit_exits_2(tiny_package, tmp_path, capsys):
    from safetensors.numpy import save_file

    folder = tmp_path / "lora"
    folder.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 65), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    assert main(["generate", "--model", str(tiny_package), "--lora", f"{folder}:0.5", "--no-chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and err.count("\n") == 1


def test_eval_kld_of_a_model_against_itself_is_zero(tiny_package, capsys, short_text):
    assert main(["eval", "kld", "--reference", str(tiny_package), "--model", str(tiny_package), "--text", str(short_text),
                 "--context", "64", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert abs(r["mean_kld"]) < 1e-6 and r["top1"] == 1.0 and r["ppl_reference"] == pytest.approx(r["ppl_model"])


def test_save_refuses_to_replace_a_folder_that_is_not_a_package(tmp_path):
    (tmp_path / "x.ingot").mkdir()
    (tmp_path / "x.ingot" / "notes.txt").write_text("mine")
    cfg = tiny_config()
    with pytest.raises(IngotError, match="refusing"):
        save_llm(tmp_path / "x.ingot", cfg, tiny_tensors(cfg), {})


def test_generate_with_lora_and_swap(tiny_package, tmp_path, capsys):
    import ingot.llm
    from test_lora import write_peft

    cfg = tiny_config()
    write_peft(tmp_path / "a", cfg, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=64, seed=1)
    write_peft(tmp_path / "b", cfg, ["q_proj", "v_proj", "down_proj"], rank=2, alpha=64, seed=2)
    runs = {}
    for name, extra in (("base", []), ("a", ["--lora", f"{tmp_path / 'a'}:1.0"])):
        assert main(["generate", "--model", str(tiny_package), "--no-chat", "--max-tokens", "6", "--temperature", "0",
                     "--json", "hello"] + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out)["tokens"]
    assert runs["a"] != runs["base"]
    # swap adapter b in on the loaded model: the same decode executable, the logits of a fresh load with b
    llm = ingot.llm.load(str(tiny_package), lora=[str(tmp_path / "a")])
    decoder = llm.decoder
    from ingot.adapters import load_peft
    llm.set_adapters(load_peft(tmp_path / "b", cfg))
    assert llm.decoder is decoder
    fresh = ingot.llm.load(str(tiny_package), lora=[str(tmp_path / "b")])
    ids = [1, 40, 41, 60]
    np.testing.assert_allclose(llm.prefill(ids), fresh.prefill(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(llm.step(7), fresh.step(7), rtol=1e-5, atol=1e-5)


def test_convert_keeps_or_quantizes_the_weights(tmp_path):
    from ingot.convert import convert

    cfg = save_tiny_gguf(tmp_path / "tiny.gguf")
    want = logits(cfg, tiny_tensors(cfg), TOKENS)
    convert(tmp_path / "tiny.gguf", tmp_path / "same.ingot")
    same = read_llm(tmp_path / "same.ingot")
    assert same.config == cfg
    np.testing.assert_allclose(_logits(same), want, rtol=1e-5, atol=1e-5)
    convert(tmp_path / "tiny.gguf", tmp_path / "int8.ingot", quantize="int8")
    model = read_llm(tmp_path / "int8.ingot")
    assert {t.qdtype.name for t in model.tensors.values() if hasattr(t, "qdtype")} == {"int8"}
    a = _logits(model)
    assert 0 < np.abs(a - want).mean() < 0.1 * np.abs(want).mean()       # int8 per channel: a few per cent


def test_quantize_reports_sizes_on_disk_and_kld_by_default(tiny_package, tmp_path, capsys):
    from ingot.convert import disk_bytes

    out = tmp_path / "plain.ingot"
    assert main(["quantize", str(tiny_package), "-o", str(out), "--format", "int8"]) == 0
    text = capsys.readouterr().out
    sizes = text.split("[", 1)[1].split(";")[0]  # "IN: 0.3 MB -> OUT: 0.2 MB on disk (0.71x)"
    before, after = (float(part.rsplit(":", 1)[1].split("MB")[0]) for part in sizes.split(" -> "))
    assert before == round(disk_bytes(tiny_package) / 1e6, 1) and after == round(disk_bytes(out) / 1e6, 1), text
    assert "on disk" in text and "mean KLD" in text and "ingot/data/eval.txt" in text  # the shipped text
    assert main(["quantize", str(tiny_package), "-o", str(tmp_path / "quiet.ingot"), "--format", "int8", "--no-eval"]) == 0
    assert "mean KLD" not in capsys.readouterr().out


def test_quantize_with_no_flags_calibrates_on_the_shipped_text(tiny_package, tmp_path, capsys):
    from ingot.quant.pipeline import DEFAULT_FORMAT

    out = tmp_path / "default.ingot"
    assert main(["quantize", str(tiny_package), "-o", str(out), "--no-eval"]) == 0
    captured = capsys.readouterr()
    assert "bits per weight" in captured.out and "ingot/data/calibration.txt" in captured.err
    quantized = json.loads((out / "llm.json").read_text())["extra"]["quantized"]
    assert quantized["format"] == DEFAULT_FORMAT and quantized["calibration"] == "calibration.txt"
    assert quantized["awq"] and quantized["gptq"]
    head = read_llm(out).tensors["token_embd.weight"]
    assert head.qdtype.name == "int8"                               # the output head keeps 8 bits by default
    assert main(["quantize", str(tiny_package), "-o", str(tmp_path / "plain.ingot"), "--no-calibration", "--no-eval"]) == 0
    quantized = json.loads((tmp_path / "plain.ingot" / "llm.json").read_text())["extra"]["quantized"]
    assert quantized["calibration"] is None and not quantized["awq"] and not quantized["gptq"]


def test_second_moments_hold_the_mean_squares_on_their_diagonal(tiny_package):
    model = open_model(tiny_package)
    ids = tokenize(model, SHORT)
    squares = activation_stats(model, ids, context=64)
    moments = activation_stats(model, ids, context=64, second_moments=True)
    assert set(squares) == set(moments)
    for name, m in moments.items():
        assert m.shape == (len(squares[name]), len(squares[name]))
        np.testing.assert_allclose(np.diag(m), squares[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(m, m.T, rtol=1e-5, atol=1e-7)


def test_quantize_under_a_bits_budget_stays_within_it(tiny_package, tmp_path, capsys):
    out = tmp_path / "budget.ingot"
    args = ["--bits", "4.9", "--tensor-format", "token_embd.weight=uint4:32:f16", "--no-eval"]
    assert main(["quantize", str(tiny_package), "-o", str(out)] + args) == 0
    bits = float(capsys.readouterr().out.split(" bits per weight")[0].rsplit(", ", 1)[1])
    assert 4.5 < bits <= 4.9
    tensors = read_llm(out).tensors
    assert {t.source for t in tensors.values() if hasattr(t, "source")} >= {"uint4:32:f16"}
    assert json.loads((out / "llm.json").read_text())["extra"]["quantized"]["bits"] == 4.9


def test_a_head_over_a_third_of_the_weights_takes_the_format_and_residual_rows(tmp_path, capsys):
    """quant.pipeline.default_head: with no flag naming it, a head of more than HEAD_SHARE of the weights (a
    big vocabulary over few, narrow layers: here 55 %, Gemma 3 270M's 63 %) takes the layers' format and
    HEAD_RANK's bytes of compensation on the head alone, not int8; naming the head's format, or no
    calibration to rank its rows by, keeps int8."""
    from quant_helpers import tokenizer_metadata

    from ingot.quant.pipeline import DEFAULT_FORMAT, HEAD_RANK

    cfg = tiny_config(n_layers=1, ffn_dim=16)
    source = tmp_path / "wide_head.ingot"
    save_llm(source, cfg, tiny_tensors(cfg), tokenizer_metadata())
    out = tmp_path / "q.ingot"
    assert main(["quantize", str(source), "-o", str(out), "--no-eval"]) == 0
    assert "the output head is over 33% of the weights" in capsys.readouterr().err
    quantized = json.loads((out / "llm.json").read_text())["extra"]["quantized"]
    assert (quantized["compensate"], quantized["compensate_only"]) == (HEAD_RANK, ["token_embd.weight"])
    package = read_llm(out)
    assert str(package.tensors["token_embd.weight"].source) == DEFAULT_FORMAT and package.adapters
    for flags in (["--tensor-format", "token_embd.weight=int8"], ["--no-calibration"]):
        other = tmp_path / f"other{len(flags)}.ingot"
        assert main(["quantize", str(source), "-o", str(other), "--no-eval", *flags]) == 0
        assert "the output head is over" not in capsys.readouterr().err
        assert read_llm(other).tensors["token_embd.weight"].qdtype.name == "int8"
        assert json.loads((other / "llm.json").read_text())["extra"]["quantized"]["compensate"] == 0
