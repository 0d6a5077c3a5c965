"""Per-op-kind time of one ONNX model in Ingot (each CPU step timed) and in onnxruntime (its own
profiler), single-threaded, on benchmarks/onnx_vision.py's models and feeds.

    python benchmarks/lab/onnx_profile.py yolo            # a vision model (scripts/vision_models.py)
    python benchmarks/lab/onnx_profile.py t5-encoder-int8 # a REAL one (scripts/real_onnx_models.py)
    python benchmarks/lab/onnx_profile.py encoder         # benchmarks/onnx_encoder.py's BERT-like encoder

Prints ms per run by op kind (Ingot: FUSED ops by kind, convs split depthwise / pointwise / other),
top 12 of each (TOP=N: more). CPU time (process_time), steadier under load. A probe, not a
benchmark: the timers add ~1 us a step.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "INGOT_CPU_THREADS"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

import ingot  # noqa: E402
from benchmarks.onnx_vision import script  # noqa: E402
from ingot.ir import Op  # noqa: E402


def kind(node) -> str:
    conv = node if node.op == Op.CONV else None
    if node.op == Op.FUSED:
        body = node.attrs.get("body")
        convs = body.find(Op.CONV) if body is not None and node.attrs.get("kind") == "conv_epilogue" else ()
        if not convs:
            return f"fused:{node.attrs.get('kind')}"
        conv = convs[0]
    if conv is not None:
        w = conv.src[1].type.shape
        tag = "dw" if w[1] == 1 and conv.attrs["groups"] > 1 else ("1x1" if all(k == 1 for k in w[2:]) else "kxk")
        return f"conv {tag}" + ("+epi" if node.op == Op.FUSED else "")
    return node.op.name.lower()


def imported(name: str, folder: str):
    """(path, feeds, exe, inner) of a model by name (the lab scripts share it): "encoder"
    (benchmarks/onnx_encoder.py's BERT-like encoder, 128 tokens), one of scripts/vision_models.py
    (exported into folder) or of real_onnx_models.py; exe imported and run once, inner the executable
    its feeds' shapes specialize to."""
    vision = script("vision_models")
    if name == "encoder":
        import argparse
        from benchmarks.onnx_encoder import export
        args = argparse.Namespace(batch=1, length=128, hidden=128, heads=4, layers=2)
        rng = np.random.default_rng(0)
        mask = np.ones((1, 128), np.int64)
        mask[:, 112:] = 0
        path = export(args, Path(folder))
        feeds = {"input_ids": rng.integers(0, 512, (1, 128)).astype(np.int64), "attention_mask": mask}
    elif name in vision.MODELS:
        x = np.random.default_rng(0).standard_normal(vision.MODELS[name][1]).astype(np.float32)
        path, feeds = vision.export(name, Path(folder) / f"{name}.onnx"), {"image": x}
    else:
        path, feeds = script("real_onnx_models").real_models()[name]
    exe = ingot.from_onnx(str(path))
    exe.run(feeds)
    inner = exe.executable(feeds) if hasattr(exe, "executable") else exe   # specializing: this shape's
    return path, feeds, exe, inner


def main() -> int:
    name, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    with tempfile.TemporaryDirectory() as folder:
        path, feeds, exe, inner = imported(name, folder)
        plan = inner.plan
        nodes = {n.id: n for n in inner.program.nodes()}
        elapsed = defaultdict(float)
        counts = defaultdict(int)

        def timed(fn, label):
            def step(*xs):
                t = time.process_time()
                try:
                    return fn(*xs)
                finally:
                    elapsed[label] += time.process_time() - t
            return step
        labels = [kind(nodes[ids[0]]) for ids in plan.step_nodes]
        for lb in labels:
            counts[lb] += 1
        plan.steps = [(timed(fn, lb), *rest) for lb, (fn, *rest) in zip(labels, plan.steps)]
        exe.run(feeds)
        elapsed.clear()
        t0 = time.process_time()
        for _ in range(runs):
            exe.run(feeds)
        total = (time.process_time() - t0) * 1e3 / runs
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "ort")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        t0 = time.perf_counter()
        for _ in range(runs):
            session.run(None, feeds)
        ort_total = (time.perf_counter() - t0) * 1e3 / runs
        session.end_profiling()
        theirs, ort_counts = defaultdict(float), defaultdict(int)
        events = json.loads(Path(glob.glob(str(Path(folder) / "ort*.json"))[0]).read_text())
        node_events = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        for e in node_events:
            theirs[e["args"]["op_name"]] += e["dur"] / 1e3
        per_run = len(node_events) // (runs + 1)
        for e in node_events[:per_run]:
            ort_counts[e["args"]["op_name"]] += 1
        scale = runs + 1
    print(f"# {name}: Ingot {total:.2f} ms/run ({len(plan.steps)} steps), onnxruntime {ort_total:.2f} ms/run "
          f"({per_run} nodes); load {os.getloadavg()[0]:.1f}")
    a = sorted(elapsed.items(), key=lambda kv: -kv[1])[:int(os.environ.get("TOP", 12))]
    b = sorted(theirs.items(), key=lambda kv: -kv[1])[:12]
    print(f"{'ingot op':<26} {'n':>4} {'ms':>7} | {'onnxruntime op':<26} {'n':>4} {'ms':>7}")
    for i in range(max(len(a), len(b))):
        left = f"{a[i][0]:<26} {counts[a[i][0]]:>4} {a[i][1] * 1e3 / runs:>7.2f}" if i < len(a) else " " * 39
        right = f"{b[i][0]:<26} {ort_counts[b[i][0]]:>4} {b[i][1] / scale:>7.2f}" if i < len(b) else ""
        print(f"{left} | {right}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
