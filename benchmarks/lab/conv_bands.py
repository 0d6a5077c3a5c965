"""Whole ONNX models at 2 threads with the direct convs split by bands of output rows (the default) against
the same model compiled with parts of output channels instead (conv_kernels.rows_first forced false for
that compile), in one process, runs interleaved: medians of 40 rounds each.

    python benchmarks/lab/conv_bands.py yolo dbnet nudenet-yolov8n orientation
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lab.onnx_profile import imported  # noqa: E402

os.environ["INGOT_CPU_THREADS"] = os.environ.get("THREADS", "2")   # (onnx_profile sets 1 at import)

import ingot  # noqa: E402
from ingot.backends.cpu import conv_kernels  # noqa: E402


def main() -> None:
    for name in sys.argv[1:] or ["yolo"]:
        with tempfile.TemporaryDirectory() as folder:
            path, feeds, _, _ = imported(name, folder)
            bands = ingot.from_onnx(path)
            bands.run(feeds)
            rows_first = conv_kernels.rows_first
            conv_kernels.rows_first = lambda *args: False
            try:
                channels = ingot.from_onnx(path)
                channels.run(feeds)
            finally:
                conv_kernels.rows_first = rows_first
            times: dict = {"bands": [], "channels": []}
            for _ in range(5):
                bands.run(feeds)
                channels.run(feeds)
            for _ in range(40):
                for key, exe in (("bands", bands), ("channels", channels)):
                    start = time.perf_counter()
                    exe.run(feeds)
                    times[key].append(time.perf_counter() - start)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("bands", "channels"))
            print(f"{name}: bands {a:.2f} ms, channel parts {b:.2f} ms ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
