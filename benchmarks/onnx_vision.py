"""Convolutional ONNX models (scripts/vision_models.py: MobileNetV3-style, YOLOv8-style, DBNet-style and
a CRNN with a bidirectional LSTM (--models crnn), random weights, exported from PyTorch; --models vad: the LSTM
voice-activity class of scripts/voice_activity.py, If on its sample rate, 512 samples a call) run by Ingot (ingot.from_onnx, CPU) and onnxruntime
(CPUExecutionProvider, all graph optimisations) in one process on the same input, single-threaded
by default (both, and NumPy's BLAS); with --threads above 1 each engine is timed in a process of its own. --real adds the ONNX files that PyPI packages ship, where they
are installed (`pip install --no-deps rapidocr-onnxruntime silero-vad magika`): PP-OCRv4's text
detector and recogniser and its direction classifier, Silero VAD (LSTM, If on the sample rate) and
Magika's file-type classifier.

    python -m benchmarks onnx-vision                      # the three conv nets, 20 interleaved runs each
    python -m benchmarks onnx-vision --models yolo --runs 50 --threads 2
    python -m benchmarks onnx-vision --real --models none
    python -m benchmarks onnx-vision --models mobilenet,ppocr-cls,orientation   # REAL ones by name

Prints per model the median wall time and the median CPU time of one run of each (CPU time is the
steadier figure on a shared machine), the ratio onnxruntime / Ingot (> 1: Ingot is faster) and the
largest difference between the first outputs (relative to the largest value where that exceeds 1). Needs torch (to export),
onnx and onnxruntime.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .onnx_encoder import blas_threads

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    """A module of scripts/ (shared with the tests, which import no benchmark)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mobilenet,yolo,dbnet")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads and NumPy's BLAS threads")
    p.add_argument("--real", action="store_true", help="also the ONNX files of installed PyPI packages (REAL)")
    p.add_argument("--time-engine", choices=("ingot", "ort"), help=argparse.SUPPRESS)   # a child's one job:
    p.add_argument("--model-path", help=argparse.SUPPRESS)                             # time ENGINE on MODEL
    p.add_argument("--feeds", help=argparse.SUPPRESS)                                  # with FEEDS (.npz)
    args = p.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when NumPy loads its BLAS
        os.environ[var] = str(args.threads)
    os.environ.setdefault("INGOT_CPU_THREADS", str(args.threads))
    import numpy as np
    import onnxruntime as ort

    import ingot
    if args.time_engine:
        return _time_one(args, np, ort, ingot)
    models = script("vision_models")
    # on several threads, each engine is timed in a process of its own: onnxruntime's pool spins after its runs
    # (its default allow_spinning), and in one process its spinning threads took the other core through
    # Ingot's runs (a YOLO at 2 threads: Ingot's process CPU time 2x its wall time) and set Ingot's team
    # backing off (team.py: a worker that is not scheduled), 6.1-6.2 ms against 4.9 alone
    apart = args.threads > 1
    print(f"# {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}, {args.runs} "
          f"{'runs, each engine in its own process' if apart else 'interleaved runs'}, ms; BLAS: "
          f"{blas_threads()}")
    print(f"{'model':<10} {'ingot wall':>10} {'ort wall':>9} {'ratio':>6} {'ingot cpu':>10} {'ort cpu':>8} {'ratio':>6} "
          f"{'max diff':>9}")
    with tempfile.TemporaryDirectory() as folder:
        cases = []
        real = script("real_onnx_models").real_models()
        for name in [m for m in args.models.split(",") if m and m != "none"]:
            if name in real and not args.real:   # one REAL model by its name
                cases.append((name, *real[name]))
                continue
            if name == "vad":   # the LSTM voice-activity class (scripts/voice_activity.py): If on the sample rate
                path = Path(folder) / "vad.onnx"
                script("voice_activity").export_voice_activity(path, batch=1, samples=512)
                state = np.zeros((1, 1, 32), np.float32)
                audio = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
                cases.append((name, path, {"audio": audio, "sr": np.array(16000, np.int64), "h": state, "c": state}))
                continue
            if name not in models.MODELS:
                print(f"no model {name!r} (have {', '.join([*models.MODELS, 'vad', *real])})", file=sys.stderr)
                return 2
            x = np.random.default_rng(0).standard_normal(models.MODELS[name][1]).astype(np.float32)
            cases.append((name, models.export(name, Path(folder) / f"{name}.onnx"), {"image": x}))
        if args.real:
            cases += [(name, path, feeds) for name, (path, feeds) in real.items()]
        for name, path, feeds in cases:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            exe = ingot.from_onnx(str(path))
            expected = session.run(None, feeds)[0]
            got = np.asarray(exe.run(feeds)[0])
            diff = float(np.abs(got - expected).max() / max(float(np.abs(expected).max()), 1.0))
            if apart:
                np.savez(Path(folder) / "feeds.npz", **feeds)
                ours, theirs = (_child(engine, path, Path(folder) / "feeds.npz", args) for engine in ("ingot", "ort"))
            else:
                ours, theirs = [], []
                for _ in range(args.runs):
                    ours.append(timed(lambda: exe.run(feeds)))
                    theirs.append(timed(lambda: session.run(None, feeds)))
            (iw, ic), (ow, oc) = [tuple(statistics.median(t[i] for t in runs) * 1e3 for i in (0, 1)) for runs in (ours, theirs)]
            print(f"{name:<10} {iw:>10.3f} {ow:>9.3f} {ow / iw:>6.2f} {ic:>10.3f} {oc:>8.3f} {oc / ic:>6.2f} {diff:>9.1e}")
    return 0


def _child(engine: str, path, feeds, args) -> list:
    """(wall, cpu) of each of args.runs runs of engine on the model, timed in a fresh process."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, "-m", "benchmarks", "onnx-vision", "--time-engine", engine, "--model-path",
                          str(path), "--feeds", str(feeds), "--runs", str(args.runs), "--threads", str(args.threads)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return [tuple(t) for t in json.loads(out.strip().splitlines()[-1])]


def _time_one(args, np, ort, ingot) -> int:
    """The child's job: two untimed runs, then args.runs timed ones, printed as JSON [(wall, cpu), ...]."""
    import json
    with np.load(args.feeds) as f:
        feeds = {k: f[k] for k in f.files}
    if args.time_engine == "ingot":
        exe = ingot.from_onnx(args.model_path)
        engine = lambda: exe.run(feeds)  # noqa: E731
    else:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(args.model_path, options, providers=["CPUExecutionProvider"])
        engine = lambda: session.run(None, feeds)  # noqa: E731
    engine()
    engine()
    print(json.dumps([timed(engine) for _ in range(args.runs)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
