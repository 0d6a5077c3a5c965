"""Compile every Triton kernel launch a set of cuda tests makes, for the H200 (sm_90a), without a GPU.

Triton's interpreter (TRITON_INTERPRET=1) checks what a kernel computes but never compiles it: a
loop-carried value that changes type, a layout the backend cannot lower, a tile that spills or does
not fit in shared memory all wait for the lent GPU, where device time is scarce. This script runs
the given pytest selection on the CPU with INGOT_CUDA_DEVICE=cpu and the interpreter OFF, records
each launch instead of running it (kernel, argument types, constexprs, warps, stages), compiles each
distinct launch through Triton's NVIDIA backend and ptxas for sm_90a, and prints registers, spills
and shared memory (more than the 227 KB a block may use counts as a failure: the launch would fail). The tests' own results are meaningless in this mode (no kernel runs) and are
ignored; the exit status is 1 when a launch does not compile.

    python scripts/sm90_compile_check.py tests/test_cuda_norm_gemv.py -k "rows1"
    python scripts/sm90_compile_check.py tests/test_cuda_prefill.py tests/test_audio_cuda.py -x
    python scripts/sm90_compile_check.py --sass /tmp/sass tests/test_cuda_gemv_xq.py

--sass DIR also disassembles each launch (cuobjdump) into DIR (with Triton's TTGIR beside it) and prints, for each loop (a backward
branch), its instructions, barriers and shared-memory loads and stores: a layout conversion that
Triton put inside a loop shows as barriers there (the word GEMV had 36 a tile, 2026-12-03).

Needs torch (the CPU build is enough) and triton; ptxas comes with triton's wheel.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)
os.environ["INGOT_CUDA_DEVICE"] = "cpu"
os.environ.setdefault("INGOT_CUDA_GRAPHS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
          torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.bool: "i1", torch.uint32: "u32"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")
SMEM_LIMIT = 227 * 1024   # shared memory one block may use on sm_90 (H100/H200)


class Launches:
    """Distinct launches seen while the tests ran: key -> (jit function, signature, constexprs, hints, options)."""

    def __init__(self):
        self.seen: dict[tuple, tuple] = {}

    def record(self, fn: JITFunction, args: tuple, kwargs: dict) -> None:
        if "PDL" in fn.arg_names:   # the kernels as the H200 runs them: with programmatic dependent launch
            kwargs = {**kwargs, "PDL": True, "launch_pdl": True}
        bound = dict(zip(fn.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        signature, constants, hints = {}, {}, {}
        for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
            value = bound.get(name, param.default)
            if param.is_constexpr or value is None:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TYPES[value.dtype]
                if value.data_ptr() % 16 == 0:
                    hints[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i64" if not -2 ** 31 <= value < 2 ** 31 else "i32"
                if value and value % 16 == 0:
                    hints[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
        key = (fn.fn.__qualname__, fn.fn.__module__, tuple(signature.items()),
               tuple((k, repr(v)) for k, v in constants.items()), tuple(sorted(hints)), tuple(sorted(options.items())))
        self.seen.setdefault(key, (fn, signature, constants, hints, options))

    def compile_all(self, sass_dir: str | None = None) -> int:
        tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        ptxas = os.path.join(tools, "ptxas")
        failures = 0
        for index, (fn, signature, constants, hints, options) in enumerate(self.seen.values()):
            flags = {k: v for k, v in constants.items() if k.isupper() and v is not None}
            label = f"{fn.fn.__name__} {options} {flags}"
            try:
                kernel = triton.compile(ASTSource(fn, signature, constants, hints), target=GPUTarget("cuda", 90, 32),
                                        options=options)
                with tempfile.TemporaryDirectory() as tmp:
                    ptx = os.path.join(tmp, "k.ptx")
                    with open(ptx, "w") as f:
                        f.write(kernel.asm["ptx"])
                    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                                            capture_output=True, text=True).stderr
                    sass = (subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", os.path.join(tmp, "k.o")],
                                           capture_output=True, text=True).stdout if sass_dir else "")
                regs = re.search(r"Used (\d+) registers", report)
                spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", report))
                if kernel.metadata.shared > SMEM_LIMIT:
                    raise RuntimeError(f"{kernel.metadata.shared} bytes of shared memory, over the H200's "
                                       f"{SMEM_LIMIT} per block: the launch would fail")
                print(f"ok    regs {regs.group(1) if regs else '?':>3}  spill {spills:>5} B  smem {kernel.metadata.shared:>6} B  "
                      f"{label}")
                if sass_dir:
                    path = os.path.join(sass_dir, f"{index:03d}_{fn.fn.__name__}.sass")
                    with open(path, "w") as f:
                        f.write(sass)
                    with open(path[: -len(".sass")] + ".ttgir", "w") as f:   # Triton's last IR, in source order
                        f.write(kernel.asm["ttgir"])
                    for loop in loop_counts(sass):
                        print(f"      loop: {loop['instructions']} instructions, {loop['BAR']} barriers, "
                              f"{loop['STS'] + loop['STSM']} shared stores, {loop['LDS'] + loop['LDSM']} shared loads  {path}")
            except Exception as e:  # noqa: BLE001 (every failing launch is reported, then the exit status says so)
                failures += 1
                message = str(e).strip().splitlines()
                print(f"FAIL  {label}\n      {type(e).__name__}: {' | '.join(message[-6:])[:1500]}")
        return failures


def loop_counts(sass: str) -> list[Counter]:
    """Per loop of a SASS listing (the instructions from a backward branch's target to the branch):
    its opcode counts, with 'instructions' the total."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    address = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    opcode = [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln) for ln in lines]
    loops = []
    for at, ln in zip(address, lines):
        branch = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if branch and int(branch.group(1), 16) < at:
            target = int(branch.group(1), 16)
            counts = Counter(op.group(1) for a, op in zip(address, opcode) if op and target <= a <= at)
            counts["instructions"] = sum(counts.values())
            loops.append(counts)
    return loops


class _Plugin:
    """Launches recorded instead of run; the tests' verdicts (meaningless without the kernels) hidden."""

    def __init__(self, launches: Launches):
        self.launches = launches

    def pytest_configure(self, config):
        launches = self.launches

        def run(fn, *args, grid, warmup, **kwargs):
            launches.record(fn, args, kwargs)
        JITFunction.run = run

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" and report.failed:
            report.outcome = "passed"   # an assertion on results no kernel computed


def main(argv: list[str]) -> int:
    sass_dir = None
    if argv[:1] == ["--sass"]:
        sass_dir, argv = argv[1], argv[2:]
        os.makedirs(sass_dir, exist_ok=True)
    launches = Launches()
    pytest.main(["-q", "-p", "no:cacheprovider", *argv], plugins=[_Plugin(launches)])
    print(f"\n{len(launches.seen)} distinct launches; compiling for sm_90a", flush=True)
    failures = launches.compile_all(sass_dir)
    print(f"{failures} did not compile" if failures else "every launch compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
