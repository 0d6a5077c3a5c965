"""`python -m benchmarks` lists the benchmarks and hands NAME --help to each, on a machine without
torch too; and no test imports a benchmark (shared code lives in ingot/ or tests/)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["cpu-llm", "cuda-llm", "cuda-generate", "kernels", "audio", "onnx", "onnx-vision", "quant", "gguf-quants", "viewer", "startup",
         "serve"]


def run(*args: str, block=("torch", "triton")) -> subprocess.CompletedProcess:
    """python -m benchmarks ARGS in the repository, with the `block`ed libraries made unimportable."""
    code = (f"import runpy, sys\nfor m in {list(block)!r}:\n    sys.modules[m] = None\n"
            f"sys.argv = ['benchmarks', *{list(args)!r}]\nrunpy.run_module('benchmarks', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_list_runs_without_torch():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for name in NAMES:
        assert f"\n  {name} " in r.stdout, name
    assert run().stdout == r.stdout


def test_each_name_is_a_benchmark_module_with_help():
    table = ast.literal_eval(next(
        node.value for node in ast.parse((ROOT / "benchmarks" / "__main__.py").read_text()).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BENCHMARKS"))
    assert set(NAMES) <= set(table), sorted(set(NAMES) - set(table))
    for module, _, _ in table.values():
        source = (ROOT / "benchmarks" / f"{module}.py").read_text()
        assert "def main(" in source and "ArgumentParser(" in source, module


def test_a_benchmark_help_is_argparse():
    r = run("startup", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m benchmarks startup") and "--repeats" in r.stdout


def test_a_benchmark_that_needs_torch_still_explains_itself():
    r = run("kernels", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: python -m benchmarks kernels" in r.stdout and "cuBLAS" in r.stdout
    assert "torch" in r.stderr
    r = run("kernels")
    assert r.returncode == 2 and "needs an NVIDIA GPU, torch, triton" in r.stderr


def test_an_unknown_benchmark_is_one_sentence_exit_2():
    r = run("gpu")
    assert r.returncode == 2 and "no benchmark 'gpu'" in r.stderr and "cpu-llm" in r.stderr
    assert r.stderr.count("\n") == 1


def test_no_test_imports_a_benchmark():
    modules = {p.stem for p in (ROOT / "benchmarks").rglob("*.py")} | {"benchmarks"}
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{path.name}: imports {n}" for n in names if n.split(".")[0] in modules]
        if '"benchmarks"' in source or "'benchmarks'" in source:
            wrong += [f"{path.name}: names the benchmarks folder"] if path.name != Path(__file__).name else []
    assert not wrong, wrong
