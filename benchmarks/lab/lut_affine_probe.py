"""Would a lookup table with an offset per block close lut4's gap to the affine formats? Relative weight error
||W - W_hat|| / ||W|| (no calibration) of some of an LLM's layer weights, per format:

    python benchmarks/lab/lut_affine_probe.py [--gguf PATH] [--weights 12]

- uint4:32, uint4:32:k: the affine formats (a scale and a minimum per block of 32);
- lut4:b32: Ingot's scaled table (a fitted 16-entry table per tensor times a scale per block, no offset);
- affine lut4 (not a format yet): each block mapped to [0, 1] by its minimum and range, a 16-entry table
  fitted by 1-D k-means on all of a tensor's mapped values, then per block the least-squares scale and offset
  for its codes, codes and parameters refitted in turn. A uniform table is uint4:32's grid, so it can only
  lose to uint4:32 by the fit's local optimum.

A probe for issue 39's lut4 goal (within 1.2x of the best affine int4 at equal bytes), not a benchmark.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def affine_lut(w: np.ndarray, block: int = 32, levels: int = 16, rounds: int = 3) -> np.ndarray:
    """W_hat of the affine table: w = table[q] * scale + offset per block of `block` columns."""
    from ingot.quant.quantize import _kmeans_1d

    rows, cols = w.shape
    b = w.reshape(rows, cols // block, block).astype(np.float64)
    lo, hi = b.min(axis=2), b.max(axis=2)
    scale, offset = np.where(hi > lo, hi - lo, 1.0), lo
    table = np.linspace(0, 1, levels)
    for _ in range(rounds):
        mapped = ((b - offset[..., None]) / scale[..., None]).reshape(-1)
        table = _kmeans_1d(mapped[None].astype(np.float32), np.ones((1, mapped.size), np.float32), levels)[0].astype(np.float64)
        mids = (table[1:] + table[:-1]) / 2
        codes = np.searchsorted(mids, (b - offset[..., None]) / scale[..., None])
        t = table[codes]
        # least squares per block: w ~ s t + o
        n = block
        st, stt = t.sum(axis=2), (t * t).sum(axis=2)
        sw, stw = b.sum(axis=2), (t * b).sum(axis=2)
        det = n * stt - st * st
        ok = det > 1e-12
        scale = np.where(ok, (n * stw - st * sw) / np.where(ok, det, 1), scale)
        offset = np.where(ok, (sw - scale * st) / n, offset)
        scale = np.where(np.abs(scale) > 1e-12, scale, 1.0)
    mids = (table[1:] + table[:-1]) / 2
    codes = np.searchsorted(mids, (b - offset[..., None]) / scale[..., None])
    return (table[codes] * scale[..., None] + offset[..., None]).reshape(rows, cols)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="an LLM's GGUF file (default: the default model)")
    ap.add_argument("--weights", type=int, default=12, help="layer weights to try, spread over the layers")
    ap.add_argument("--synthetic", action="store_true", help="Student-t weights (3 degrees of freedom, a few large "
                    "columns) instead of a file's: a GGUF's are already on a grid (the default model's Q4_1 is "
                    "uint4:32's, exactly)")
    args = ap.parse_args()
    from ingot.llm.package import open_model
    from ingot.llm.generate import default_model_path
    from ingot.quant import quantize
    from ingot.quant.pipeline import LAYER_WEIGHT, float_weights

    if args.synthetic:
        rng = np.random.default_rng(0)

        def weights():
            for i in range(args.weights):
                w = rng.standard_t(3, (512, 576)) / 24
                w[:, rng.integers(0, 576, 4)] *= 4
                yield f"student-t {i}", w.astype(np.float32)
    else:
        model = open_model(args.gguf or default_model_path())
        names = [n for n in model.tensors if LAYER_WEIGHT.match(n)]
        chosen = set(names[:: max(1, len(names) // args.weights)][: args.weights])

        def weights():
            return ((n, w) for n, w in float_weights(model) if n in chosen)
    errors: dict[str, list[float]] = {}
    for name, w in weights():
        norm = float(np.linalg.norm(w))
        for label, fn in (("uint4:32", lambda w: quantize(w, "uint4:32").dequantize_rows()),
                          ("uint4:32:k", lambda w: quantize(w, "uint4:32:k").dequantize_rows()),
                          ("lut4:b32", lambda w: quantize(w, "lut4:b32").dequantize_rows()),
                          ("affine lut4 (b32)", affine_lut)):
            errors.setdefault(label, []).append(float(np.linalg.norm(w - fn(w))) / norm)
        print(f"{name:<28} " + "  ".join(f"{k} {v[-1]:.4f}" for k, v in errors.items()), flush=True)
    base = max(float(np.mean(errors["uint4:32"])), 1e-12)
    for label, v in errors.items():
        print(f"{label:<20} mean relative error {np.mean(v):.4f} ({np.mean(v) / base:.2f}x uint4:32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
