"""A BERT-like encoder exported from PyTorch to ONNX, run by Ingot (ingot.from_onnx, CPU) and by
onnxruntime (CPUExecutionProvider, all graph optimisations) in one process, same inputs.

    python -m benchmarks onnx                        # hidden 128, 4 heads, 2 layers, 128 tokens
    python -m benchmarks onnx --length 32 --threads 1
    python -m benchmarks onnx --model tests/fixtures/onnx/encoder.onnx --length 16

Prints the median wall and CPU time per forward pass of each (over --repeats runs, the two interleaved
after a warm-up; CPU time is the steadier figure on a shared machine), the ratios onnxruntime / Ingot
(> 1: Ingot is faster), and the largest difference between
their outputs. onnxruntime runs with --threads intra-op threads (default 2, this machine's cores);
Ingot's matmuls run in NumPy's BLAS with --blas-threads threads (default the same; Ingot's thread
setting INGOT_CPU_THREADS follows it unless set). Needs torch and onnxscript
to export the model unless --model names an .onnx file.
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

ROOT = Path(__file__).resolve().parent.parent


def export(args, folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_onnx_fixtures", ROOT / "scripts" / "make_onnx_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    import torch
    torch.manual_seed(0)
    return fixtures.export_encoder(folder / "encoder.onnx", batch=args.batch, length=args.length, hidden=args.hidden,
                                   heads=args.heads, ffn=4 * args.hidden, layers=args.layers, max_len=max(128, args.length))


def blas_threads() -> str:
    """Each BLAS library's threads and kernels, e.g. "openblas 1 Haswell (OPENBLAS_CORETYPE)": an
    environment can pin OpenBLAS's kernels (this project's machines pin AVX2's Haswell ones on AVX-512
    CPUs, where OpenBLAS picks SkylakeX: the encoder's matmuls ~1.6x slower), which moves Ingot's BLAS
    time and not onnxruntime's (MLAS chooses its own)."""
    pinned = " (OPENBLAS_CORETYPE)" if os.environ.get("OPENBLAS_CORETYPE") else ""
    try:
        from threadpoolctl import threadpool_info
        return ", ".join(f"{i['internal_api']} {i['num_threads']} {i.get('architecture', '')}"
                         f"{pinned if i['internal_api'] == 'openblas' else ''}"
                         for i in threadpool_info() if i["user_api"] == "blas")
    except ImportError:
        return os.environ.get("OPENBLAS_NUM_THREADS", "NumPy's default")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an encoder .onnx with inputs input_ids, attention_mask (default: export one)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="threads of NumPy's BLAS, which runs Ingot's matmuls (default: --threads)")
    args = p.parse_args()
    blas = str(args.blas_threads or args.threads)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # read when NumPy loads its BLAS
        os.environ[var] = blas
    os.environ.setdefault("INGOT_CPU_THREADS", blas)   # Ingot's own thread setting, which sets BLAS's at run
    global np
    import numpy as np

    import onnxruntime as ort

    import ingot
    from ingot.importers.onnx import op_counts

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else export(args, Path(tmp))
        rng = np.random.default_rng(0)
        mask = np.ones((args.batch, args.length), np.int64)
        mask[:, args.length - args.length // 8:] = 0
        feeds = {"input_ids": rng.integers(0, 512, (args.batch, args.length)).astype(np.int64), "attention_mask": mask}
        start = time.perf_counter()
        exe = ingot.from_onnx(path, input_shapes={k: v.shape for k, v in feeds.items()})
        compile_s = time.perf_counter() - start
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        ours = exe.run(feeds)
        theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        diff = max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in theirs)
        for _ in range(10):
            exe.run(feeds)
            session.run(None, feeds)
        t_ingot, t_ort, c_ingot, c_ort = [], [], [], []
        for _ in range(args.repeats):
            for fn, wall, cpu in ((lambda: exe.run(feeds), t_ingot, c_ingot), (lambda: session.run(None, feeds), t_ort, c_ort)):
                t, c = time.perf_counter(), time.process_time()
                fn()
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
        counts = op_counts(exe)
        ms_ingot, ms_ort = statistics.median(t_ingot) * 1e3, statistics.median(t_ort) * 1e3
        cpu_ingot, cpu_ort = statistics.median(c_ingot) * 1e3, statistics.median(c_ort) * 1e3
        print(f"model: {path.name if args.model else f'BERT-like, hidden {args.hidden}, {args.heads} heads, {args.layers} layers'}, "
              f"batch {args.batch} x {args.length} tokens; Ingot compiled {len(exe.program.nodes())} ops "
              f"({counts['sdpa']} sdpa, {counts['matmul']} matmul) in {compile_s:.2f} s")
        print(f"ingot        {ms_ingot:8.3f} ms wall {cpu_ingot:8.3f} ms CPU  (BLAS: {blas_threads()})")
        print(f"onnxruntime  {ms_ort:8.3f} ms wall {cpu_ort:8.3f} ms CPU  ({ort.__version__}, {args.threads} intra-op threads)")
        print(f"ratio onnxruntime/ingot: {ms_ort / ms_ingot:.2f}x wall, {cpu_ort / cpu_ingot:.2f}x CPU time  (medians of "
              f"{args.repeats}; max |diff| {diff:.2e}; load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
