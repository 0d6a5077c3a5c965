"""CPU GEMV speed of GGUF types after import, side by side: Q4_1 (the default model's type) against
Q4_K, Q3_K and IQ4_XS, on the default model's (SmolLM2-135M) decode shapes, one thread (the GEMV kernels' default).

Each weight is random valid GGUF blocks of its type written to a GGUF file and read back with
read_gguf (so the timed form is what the importer makes: Q4_1 and Q4_K -> uint4 block 32 with scale
and bias, Q3_K -> int4 block 16, IQ4_XS -> 4-bit codes into a 16-entry table times a scale per 32),
then multiplied by x [1, K] by the CPU backend's quantized_matmul step (the GEMV kernels; a
compiled graph adds ~0.1 ms of runtime overhead per run, the same for every type, not counted). K = 576 is not a multiple of the K-quants'
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
    """The CPU backend's step for quantized_matmul(x [1, K], t) (what a compiled graph runs for the
    fused dequantize + matmul; timed without the runtime's per-run overhead) and its arguments."""
    from ingot import dtypes as dt
    from ingot.backends.cpu import kernels, lut_kernels
    from ingot.ir import Node, Op, TensorType

    k, n = t.shape
    attrs = {"qdtype": t.qdtype, "dtype": dt.float32, "transpose": False}
    if t.lut is not None:
        attrs["mode"], params = "scaled_lut", (t.lut, t.scale)
    else:
        attrs.update(mode="affine", has_zero_point=False, has_bias=t.bias is not None)
        params = (t.scale,) if t.bias is None else (t.scale, t.bias)
    node = Node(Op.QUANTIZED_MATMUL, TensorType((1, n), dt.float32), (), attrs)
    step = lut_kernels.scaled_lut_matmul_step(node, None) if t.lut is not None else kernels.quantized_matmul_step(node, None)
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    return step, (x, t.q) + params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--types", default="Q4_1,Q4_K,Q3_K,IQ4_XS", help="GGUF types, the first the baseline "
                    "(random blocks for Q4_1, Q4_K, Q3_K, IQ4_XS, Q8_0)")
    args = ap.parse_args()
    types = args.types.split(",")
    ws = weights(types)
    runs = {key: gemv(t) for key, t in ws.items()}
    for step, step_args in runs.values():  # compile the kernels, warm the caches
        step(*step_args)
    times: dict = {key: [] for key in runs}
    for _ in range(args.reps):
        for key, (step, step_args) in runs.items():
            t0 = time.perf_counter()
            step(*step_args)
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
