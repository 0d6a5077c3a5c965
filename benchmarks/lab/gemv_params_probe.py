"""Where the CPU decode GEMV spends its time by parameter form (issue 39): uint4 weights in blocks of
32 on the default model's (SmolLM2-135M) decode shapes, one thread, the CPU backend's
quantized_matmul step (kernels.quantized_matmul_step, as a compiled graph runs it), for each
activation rounding (float32: kmajor_packed4; int8: the VNNI kernel) and each parameter form:

    f32   scale and bias float32 (what the GGUF importer gives for Q4_1)
    f16   scale and bias float16 (the :f16 formats; what the package of a :k format loaded as products)
    k     the :k form as passes/fuse_two_level.py hands it to the backend: 6-bit codes (uint8)
          times a float16 unit per super-block (9 blocks for K 576, 8 for 1536)

Variants are interleaved rep by rep; medians, per-token sums (30 layers + the head, as uint4 here).

    nice -n 19 python benchmarks/lab/gemv_params_probe.py [--reps 100] [--forms f32,f16,k] [--activations float32,int8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# N x K as the builder multiplies them (k-major weight [K, N])
SHAPES = {"q+k+v": (960, 576), "attn_output": (576, 576), "gate+up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
PER_TOKEN = {"q+k+v": 30, "attn_output": 30, "gate+up": 30, "down": 30, "head": 1}


def weight(rng, n: int, k: int, form: str):
    """A k-major uint4 weight [K, N] in blocks of 32 whose parameters are two-level (6-bit codes of a
    float16 unit per super-block, as `ingot quantize` sizes them), in the given form: (q, params)."""
    q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    from ingot.quant.quantize import super_block_size
    nb, per_super = k // 32, super_block_size(k, 32) // 32     # 9 blocks for K 576, 8 for 1536
    # float16 units of 5 significant bits, so that every product of a 6-bit code is a float16 (as split)
    units = [((rng.random((nb // per_super, n)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint16) & np.uint16(0xFFC0))
             .view(np.float16) for _ in range(2)]
    codes = [rng.integers(0, 64, (nb // per_super, per_super, n), dtype=np.uint8) for _ in range(2)]
    prod = [(u.astype(np.float32)[:, None, :] * c.astype(np.float32)).reshape(nb, n) for u, c in zip(units, codes)]
    scale, bias = prod[0], -prod[1]
    if form == "f32":
        return q, (scale.astype(np.float32), bias.astype(np.float32))
    if form == "f16":
        return q, (scale.astype(np.float16), bias.astype(np.float16))
    if form == "k":   # as passes/fuse_two_level.py hands them to the backend: (codes, units) pairs
        codes = [c.reshape(nb, n) for c in codes]
        return q, (codes[0], units[0], codes[1], -units[1])
    raise ValueError(form)


def step_for(q, params, activations: str, per_super: int):
    from ingot import dtypes as dt
    from ingot.backends.cpu import kernels
    from ingot.ir import Node, Op, TensorType
    n = q.shape[1] * 2
    attrs = {"qdtype": dt.uint4, "dtype": dt.float32, "transpose": False, "mode": "affine", "has_zero_point": False,
             "has_bias": True, "axis": 0, "block_size": 32}
    if len(params) == 4:
        attrs["two_level"] = per_super
    node = Node(Op.QUANTIZED_MATMUL, TensorType((1, n), dt.float32), (), attrs)
    return kernels.quantized_matmul_step(node, None, threads=1, activations=activations)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--forms", default="f32,f16,k")
    ap.add_argument("--activations", default="float32,int8")
    args = ap.parse_args()
    forms, acts = args.forms.split(","), args.activations.split(",")
    rng = np.random.default_rng(0)
    runs = {}
    for name, (n, k) in SHAPES.items():
        x = rng.standard_normal((1, k)).astype(np.float32)
        for form in forms:
            q, params = weight(np.random.default_rng(hash(name) % 1000), n, k, form)
            for a in acts:
                per_super = params[0].shape[0] // params[1].shape[0]
                runs[(name, form, a)] = (step_for(q, params, a, per_super), (x, q) + params)
    ref = {}
    for key, (step, sargs) in runs.items():
        out = step(*sargs)
        ref.setdefault((key[0], key[2]), out)
        err = float(np.max(np.abs(out - ref[(key[0], key[2])])))
        assert err <= 1e-3 * float(np.max(np.abs(ref[(key[0], key[2])]))), (key, err)
    times = {key: [] for key in runs}
    c0 = time.process_time()
    for _ in range(args.reps):
        for key, (step, sargs) in runs.items():
            t0 = time.perf_counter()
            step(*sargs)
            times[key].append(time.perf_counter() - t0)
    med = {key: float(np.median(v)) * 1e6 for key, v in times.items()}
    print(f"# one thread, median of {args.reps}, load {os.getloadavg()[0]:.1f}, CPU {time.process_time() - c0:.1f} s; "
          f"us per x[1,K] @ W (uint4, block 32)")
    cols = [(f, a) for a in acts for f in forms]
    print(f"{'shape':<22}" + "".join(f"{f + '/' + a:>16}" for f, a in cols))
    for name, (n, k) in SHAPES.items():
        print(f"{name + f' {n}x{k}':<22}" + "".join(f"{med[(name, f, a)]:16.1f}" for f, a in cols))
    tot = {c: sum(med[(name,) + c] * PER_TOKEN[name] for name in SHAPES) / 1e3 for c in cols}
    print(f"{'per token, ms':<22}" + "".join(f"{tot[c]:16.2f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
