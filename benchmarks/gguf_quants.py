"""CPU GEMV speed of GGUF types after import, side by side: Q4_1 (the default model's type) against
Q4_K, Q3_K and IQ4_XS, on the default model's (SmolLM2-135M) decode shapes, one thread (the GEMV kernels' default).

Each weight is random valid GGUF blocks of its type written to a GGUF file and read back with
read_gguf (so the timed form is what the importer makes: Q4_1 and Q4_K -> uint4 block 32 with scale
and bias, Q3_K -> int4 block 16, IQ4_XS -> 4-bit codes into a 16-entry table times a scale per 32),
then multiplied by x [1, K] through a compiled graph (quantized_matmul; the time includes the
runtime's per-run overhead, the same for every type). K = 576 is not a multiple of the K-quants'
256: those weights are [N, 768] in the file, cut to their first 576 columns (whole Ingot blocks).
Times are medians over --reps runs, the types interleaved.

    python -m benchmarks gguf-quants [--reps 200] [--types Q4_1,Q4_K,Q3_K,IQ4_XS,Q8_0]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# SmolLM2-135M: dim 576, 9 heads of 64, 3 KV heads, ffn 1536, vocab 49152; N x K as the builder multiplies
SHAPES = {"q+k+v": (960, 576), "attn_output": (576, 576), "gate+up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
PER_TOKEN = {"q+k+v": 30, "attn_output": 30, "gate+up": 30, "down": 30, "head": 1}  # 30 layers


def random_blocks(rng, qtype, rows, cols):
    import gguf
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    offsets = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q3_K": (108,), "IQ4_XS": (0,), "Q8_0": (0,)}[qtype.name]
    for off in offsets:
        d = (rng.standard_normal((rows, cols // bs)) * 1e-3).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def weights(types: list[str]) -> dict:
    """{(type, shape name): QuantizedTensor [N, K]} converted by the importer."""
    import gguf

    from ingot.importers import read_gguf
    from ingot.quant.formats import QuantizedTensor

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.gguf")
        w = gguf.GGUFWriter(path, "llama")
        for t in types:
            qtype = gguf.GGMLQuantizationType[t]
            unit = gguf.GGML_QUANT_SIZES[qtype][0]
            for name, (n, k) in SHAPES.items():
                w.add_tensor(f"{t}.{name}", random_blocks(rng, qtype, n, -(-k // unit) * unit), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        model = read_gguf(path)
        out = {}
        for t in types:
            for name, (n, k) in SHAPES.items():
                qt = model.tensors[f"{t}.{name}"]
                if qt.shape[1] != k:  # whole Ingot blocks of the first k columns
                    nb = k // qt.block_size
                    cut = lambda p: None if p is None else np.ascontiguousarray(p[:, :nb])  # noqa: E731
                    qt = QuantizedTensor(np.ascontiguousarray(qt.q[:, :k // 2]), qt.qdtype, (n, k), qt.block_size,
                                         cut(qt.scale), cut(qt.bias), source=qt.source, lut=qt.lut)
                out[(t, name)] = qt.to_k_major()
    return out


def gemv(t):
    """A compiled x [1, K] @ W for the k-major weight t, and its feed."""
    from ingot import dtypes as dt
    from ingot.graph import Graph

    g = Graph()
    q = g.constant(t.q, dtype=t.qdtype)
    if t.lut is not None:
        w = g.dequantize(q, lut=g.constant(t.lut), scale=g.constant(t.scale), axis=0, block_size=t.block_size)
    else:
        extra = {"bias": g.constant(t.bias)} if t.bias is not None else {}
        w = g.dequantize(q, scale=g.constant(t.scale), axis=0, block_size=t.block_size, **extra)
    x = g.placeholder((1, t.shape[0]), dt.float32, name="x")
    exe = g.compile(targets=[g.matmul(x, w)])
    feed = {"x": np.random.default_rng(1).standard_normal((1, t.shape[0])).astype(np.float32)}
    return exe, feed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--types", default="Q4_1,Q4_K,Q3_K,IQ4_XS", help="GGUF types, the first the baseline "
                    "(random blocks for Q4_1, Q4_K, Q3_K, IQ4_XS, Q8_0)")
    args = ap.parse_args()
    types = args.types.split(",")
    ws = weights(types)
    runs = {key: gemv(t) for key, t in ws.items()}
    for exe, feed in runs.values():  # compile the kernels, warm the caches
        exe.run(feed)
    times: dict = {key: [] for key in runs}
    for _ in range(args.reps):
        for key, (exe, feed) in runs.items():
            t0 = time.perf_counter()
            exe.run(feed)
            times[key].append(time.perf_counter() - t0)
    med = {key: float(np.median(v)) * 1e6 for key, v in times.items()}
    print(f"# CPU GEMV, one thread, median of {args.reps} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores); us per x[1,K] @ W; bytes = Ingot's in-memory weight (q + params)")
    head = f"{'shape (N x K)':<26}" + "".join(f"{t:>18}" for t in types)
    print(head)
    for name, (n, k) in SHAPES.items():
        cells = []
        for t in types:
            us = med[(t, name)]
            cells.append(f"{us:9.1f} ({us / med[(types[0], name)]:4.2f}x)")
        print(f"{name + f' {n}x{k}':<26}" + "".join(f"{c:>18}" for c in cells))
    totals = {t: sum(med[(t, name)] * PER_TOKEN[name] for name in SHAPES) for t in types}
    print(f"{'per token (30 layers+head)':<26}" + "".join(f"{totals[t] / 1e3:8.2f} ms ({totals[t] / totals[types[0]]:4.2f}x)".rjust(18) for t in types))
    mb = {t: sum(ws[(t, name)].nbytes * PER_TOKEN[name] for name in SHAPES) / 1e6 for t in types}
    print(f"{'weights read per token':<26}" + "".join(f"{mb[t]:10.1f} MB".rjust(18) for t in types))
    return 0


if __name__ == "__main__":
    sys.exit(main())
