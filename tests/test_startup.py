"""Start-up stays cheap: `import ingot`, `ingot --help` and the refusal of a file that is not a model
import none of the heavy libraries (numba and its LLVM, ml_dtypes, tokenizers, jinja2, rich), which
load on first use. benchmarks/startup.py times the same three; here only what is imported is checked."""
import json
import subprocess
import sys

HEAVY = ("numba", "ml_dtypes", "tokenizers", "jinja2", "rich", "scipy", "onnx", "torch")


def imported_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if '.' not in m)))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_import_ingot_is_light():
    loaded = imported_after("import ingot\ng = ingot.Graph()\nx = g.placeholder((2,), ingot.float32, name='x')")
    assert "numpy" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_help_is_light():
    loaded = imported_after("import contextlib, io\nfrom ingot.cli import main\n"
                            "with contextlib.redirect_stdout(io.StringIO()):\n"
                            "    try:\n        main(['generate', '--help'])\n    except SystemExit:\n        pass")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_refusing_a_text_file_is_light(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text("not a model\n")
    loaded = imported_after(f"import contextlib, io\nfrom ingot.cli import main\n"
                            f"with contextlib.redirect_stderr(io.StringIO()):\n"
                            f"    assert main(['generate', '--model', {str(bogus)!r}, 'hi']) == 2")
    assert not loaded & {"numba", "tokenizers", "jinja2", "rich"}, sorted(loaded & set(HEAVY))


def test_bfloat16_is_still_ml_dtypes():
    import ml_dtypes
    import numpy as np

    import ingot
    from ingot import dtypes

    assert ingot.bfloat16.storage == np.dtype(ml_dtypes.bfloat16)
    assert dtypes.from_numpy(ml_dtypes.bfloat16) is ingot.bfloat16
    assert dtypes.from_numpy(np.float32) is ingot.float32
