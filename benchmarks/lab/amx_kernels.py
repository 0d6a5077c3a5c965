"""AMX tiles against the AVX-512 kernels and BLAS, through exe.run, one thread: float32 convolutions
(cpu/conv_amx.py, `CpuOptions.float32_precision` "bf16x3" against "float32"), matmuls by constant weights
(cpu/matmul_amx.py against OpenBLAS), ONNX's integer matmuls (cpu/int8_amx.py against VNNI, warm
and with the caches flushed) and a CRNN's bidirectional LSTM layers (input projections on the tiles
against recurrent.py's panels). A probe for the shapes the models have, not a benchmark: best of 5.

    python benchmarks/lab/amx_kernels.py            # all four
    python benchmarks/lab/amx_kernels.py conv       # conv | matmul | int8 | lstm
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "INGOT_CPU_THREADS"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import ingot  # noqa: E402
from ingot.backends.cpu import conv_amx  # noqa: E402
from ingot.options import CompileOptions, CpuOptions  # noqa: E402

CONVS = [  # C, M, (H, W), k, stride: YOLO's, DBNet's and MobileNet's layers
    (16, 32, (160, 160), 3, 2), (16, 16, (80, 80), 3, 1), (32, 64, (80, 80), 3, 2), (64, 64, (40, 40), 3, 1),
    (128, 128, (20, 20), 3, 1), (192, 64, (40, 40), 1, 1), (128, 64, (40, 40), 1, 1), (512, 512, (7, 7), 1, 1)]
MATMULS = [(128, 128, 128), (128, 128, 512), (128, 512, 128), (37, 200, 70), (1000, 256, 1024)]   # rows, K, N
INT8 = [(16, 512, 2048), (32, 512, 2048), (128, 512, 512)]   # rows, K, N
FLUSH = np.ones(8 << 20, np.float32)


def best(fn, n: int = 20, cold: bool = False) -> float:
    """Best of 5 means of n calls, us; cold: the caches flushed (32 MB written) before each call."""
    fn()
    times = []
    for _ in range(5):
        total = 0.0
        for _ in range(n):
            if cold:
                np.add(FLUSH, 1.0, out=FLUSH)
            t = time.perf_counter()
            fn()
            total += time.perf_counter() - t
        times.append(total / n)
    return min(times) * 1e6


def compiled(build, precision: str):
    g = ingot.Graph()
    return g.compile(targets=[build(g)], options=CompileOptions(cpu=CpuOptions(float32_precision=precision)))


def convs() -> None:
    print("conv + SiLU, us: tiles (bf16x3) / float32 kernels")
    for c, m, hw, k, s in CONVS:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, c) + hw).astype(np.float32)
        w = (rng.standard_normal((m, c, k, k)) * 0.1).astype(np.float32)

        def build(g):
            y = g.conv(g.placeholder(x.shape, name="x"), w, strides=(s, s), pads=((k // 2, k // 2), (k // 2, k // 2)))
            return y * g.sigmoid(y)
        t = [best(lambda: exe.run({"x": x})) for exe in (compiled(build, p) for p in ("bf16x3", "float32"))]
        print(f"  {c:>3} x {hw[0]:>3} x {hw[1]:>3} -> {m:>3}, {k}x{k} s{s}: {t[0]:8.1f} / {t[1]:8.1f}  ({t[1] / t[0]:.2f}x)")


def matmuls() -> None:
    print("x @ w (w a constant), us: tiles (bf16x3) / OpenBLAS")
    for rows, k, n in MATMULS:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = rng.standard_normal((k, n)).astype(np.float32)
        t = [best(lambda: exe.run({"x": x})) for exe in
             (compiled(lambda g: g.matmul(g.placeholder(x.shape, name="x"), g.constant(w)), p) for p in ("bf16x3", "float32"))]
        print(f"  [{rows}, {k}] @ [{k}, {n}]: {t[0]:8.1f} / {t[1]:8.1f}  ({t[1] / t[0]:.2f}x)")


def int8() -> None:
    from ingot.backends.cpu.int8_matmul import IntegerMatmul
    print("integer matmul (scaled), us: VNNI / tiles, warm | caches flushed")
    for rows, k, n in INT8:
        rng = np.random.default_rng(0)
        w = rng.integers(-128, 128, (k, n)).astype(np.int8)
        x = rng.integers(0, 256, (rows, k)).astype(np.uint8)
        s0, s1, zero = np.array(0.37, np.float32), np.array([1.9e-3], np.float32), np.zeros(1, np.uint8)
        out = np.empty((rows, n), np.float32)
        kernels = [IntegerMatmul(w, np.zeros(n, np.int64), tiles=tiles) for tiles in (False, True)]
        warm = [best(lambda: kern.scaled(x, zero, s0, s1, out)) for kern in kernels]
        cold = [best(lambda: kern.scaled(x, zero, s0, s1, out), cold=True) for kern in kernels]
        print(f"  [{rows}, {k}] @ [{k}, {n}]: {warm[0]:7.1f} / {warm[1]:7.1f} | {cold[0]:7.1f} / {cold[1]:7.1f}")


def lstm() -> None:
    from ingot.backends.cpu import LOWERINGS
    from ingot.ir import Node, Op
    from ingot.ops import infer_type
    print("bidirectional LSTM layer (constant W and biases), us: tiles (bf16x3) / panels (float32)")
    for seq, batch, size, hidden in ((80, 1, 128, 128), (80, 1, 256, 128)):   # a CRNN's two layers
        rng = np.random.default_rng(0)
        shapes = [(seq, batch, size), (2, 4 * hidden, size), (2, 4 * hidden, hidden), (2, 8 * hidden), (batch,),
                  (2, batch, hidden), (2, batch, hidden), (2, 3 * hidden)]
        xs = [(rng.standard_normal(s) * 0.5).astype(np.float32) for s in shapes]
        xs[4] = np.full(batch, seq, np.int64)
        types = [ingot.ir.TensorType(s, ingot.dtypes.int64 if i == 4 else ingot.dtypes.float32)
                 for i, s in enumerate(shapes)]
        src = tuple(Node(Op.CONSTANT if i in (1, 3) else Op.PLACEHOLDER, t, (), {"key": f"c{i}"})
                    for i, t in enumerate(types))
        attrs = {"direction": "bidirectional", "activations": ("Sigmoid", "Tanh", "Tanh") * 2,
                 "alphas": (None,) * 6, "betas": (None,) * 6, "clip": None, "input_forget": False}
        node = Node(Op.LSTM, infer_type(Op.LSTM, types, attrs), src, attrs)
        t = [best(lambda: step(*xs), n=10) for step in
             (LOWERINGS[Op.LSTM](node, None, CpuOptions(float32_precision=p)) for p in ("bf16x3", "float32"))]
        print(f"  T {seq}, I {size}, H {hidden}: {t[0]:8.1f} / {t[1]:8.1f}  ({t[1] / t[0]:.2f}x)")


def main() -> int:
    if not conv_amx.available():
        print("this host has no AMX tiles (or its kernel does not grant them)")
        return 1
    which = sys.argv[1:] or ["conv", "matmul", "int8", "lstm"]
    for name in which:
        {"conv": convs, "matmul": matmuls, "int8": int8, "lstm": lstm}[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
