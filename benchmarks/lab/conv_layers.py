"""Per-convolution time of one ONNX model in Ingot (each CPU step timed, CPU time) next to onnxruntime's
own per-node profile (median over runs of each node's kernel time), single-threaded, matched by output
shape in order. Shows where Ingot's convolutions lose, layer by layer.

    python benchmarks/lab/conv_layers.py yolo [RUNS]
"""
from __future__ import annotations

import glob
import json
import os
import statistics
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

from benchmarks.lab.onnx_profile import imported  # noqa: E402
from ingot.ir import Op  # noqa: E402


def describe(node) -> tuple[str, float]:
    conv = node
    epi = ""
    if node.op == Op.FUSED:
        body = node.attrs.get("body")
        convs = body.find(Op.CONV) if body is not None else ()
        if not convs:
            return node.attrs.get("kind"), 0.0
        conv = convs[0]
        epi = "+" + ",".join(n.op.name.lower() for n in body.nodes if n.op not in (Op.PLACEHOLDER, Op.CONV))
    if conv.op != Op.CONV:
        return node.op.name.lower(), 0.0
    w = conv.src[1].type.shape
    x = conv.src[0].type.shape
    o = conv.type.shape
    g = conv.attrs["groups"]
    flops = 2.0 * np.prod(o) * np.prod(w[1:])
    s = conv.attrs["strides"]
    return f"{x[1]}x{tuple(x[2:])}->{o[1]}x{tuple(o[2:])} k{tuple(w[2:])} s{s[0]} g{g}{epi}"[:90], flops


def main() -> int:
    name, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    with tempfile.TemporaryDirectory() as folder:
        path, feeds, exe, inner = imported(name, folder)
        plan = inner.plan
        nodes = {n.id: n for n in inner.program.nodes()}
        times = defaultdict(list)

        def timed(fn, i):
            def step(*xs):
                t = time.process_time()
                try:
                    return fn(*xs)
                finally:
                    times[i].append(time.process_time() - t)
            return step
        plan.steps = [(timed(fn, i), *rest) for i, (fn, *rest) in enumerate(plan.steps)]
        for _ in range(runs):
            exe.run(feeds)
        rows = []
        for i, ids in enumerate(plan.step_nodes):
            d, f = describe(nodes[ids[0]])
            rows.append((statistics.median(times[i]) * 1e3, d, f))
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "ort")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for _ in range(runs + 1):
            session.run(None, feeds)
        session.end_profiling()
        events = json.loads(Path(glob.glob(str(Path(folder) / "ort*.json"))[0]).read_text())
        node_events = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        per = defaultdict(list)
        order = []
        for e in node_events:
            if e["name"] not in per:
                order.append(e["name"])
            per[e["name"]].append(e["dur"] / 1e3)
        ort_rows = [(statistics.median(per[k][1:] or per[k]), k, next(e["args"]["op_name"] for e in node_events if e["name"] == k)) for k in order]
    total = sum(r[0] for r in rows)
    print(f"# {name}: Ingot steps {total:.2f} ms, onnxruntime nodes {sum(r[0] for r in ort_rows):.2f} ms; load {os.getloadavg()[0]:.1f}")
    for ms, d, f in sorted(rows, key=lambda r: -r[0])[:int(os.environ.get("TOP", 25))]:
        print(f"{ms:7.3f} {f / ms / 1e6 if f else 0:6.1f} GF/s  {d}")
    print("# onnxruntime")
    for ms, k, op in sorted(ort_rows, key=lambda r: -r[0])[:int(os.environ.get("TOP", 25))]:
        print(f"{ms:7.3f} {op:<16} {k[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
