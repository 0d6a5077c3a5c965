"""Would a per-block offset close lut4's gap (issue 39)? A lookup-table format w = s * T[q] + m (one fitted
16-entry table, per block of B columns a float16 scale s and a float16 offset m: 4 + 32 / B bits a weight)
emulated on the default model's tied embedding, the one weight of its Q4_1 source not on a 4-bit grid
(Q8_0), against Ingot's formats of the same bytes there: uint4:32:k (4.5 bits) and lut4:bB (a table
times a float32 block scale, no offset). The emulated weight is dequantized into the model (no kernel
holds the format yet); every row is scored as benchmarks/quant_table.py scores its rows (mean KLD over
3 chunks of 256 tokens of tests/fixtures/eval_text.txt against the float32 reference, uncalibrated).

    python benchmarks/lab/lut_offset.py [--blocks 64,32] [--workdir W]   # W: quant_table's, float32.gguf reused
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ingot.eval import chunks, compare, score  # noqa: E402
from ingot.llm.generate import default_model_path  # noqa: E402
from ingot.llm.package import StoredModel, open_model  # noqa: E402
from ingot.llm.tokenizer import tokenize  # noqa: E402
from ingot.quant import quantize  # noqa: E402
from ingot.quant.export import write_float_gguf  # noqa: E402
from ingot.quant.pipeline import float_weights  # noqa: E402
from ingot.quant.quantize import _fit_tables  # noqa: E402


def lut_with_offset(w: np.ndarray, block: int, iterations: int = 4, k: int = 16) -> np.ndarray:
    """w [rows, cols] as s * T[q] + m, dequantized: T fitted (weighted 1-D k-means) on the blocks' values
    normalised by their (s, m), then per block the least-squares (s, m) for its codes, both rounded to
    float16, `iterations` times."""
    rows, cols = w.shape
    b = w.reshape(rows, cols // block, block).astype(np.float64)
    m = (b.max(axis=2) + b.min(axis=2)) / 2
    s = np.maximum((b.max(axis=2) - b.min(axis=2)) / 2, 1e-6)
    for _ in range(iterations):
        norm = ((b - m[..., None]) / s[..., None]).reshape(1, -1).astype(np.float32)
        weights = np.broadcast_to((s ** 2)[..., None], b.shape).reshape(1, -1)
        table = np.sort(_fit_tables(norm, weights, k, False)[0].astype(np.float16).astype(np.float64))
        mids = (table[1:] + table[:-1]) / 2
        t = table[np.searchsorted(mids, (b - m[..., None]) / s[..., None])]
        tm, wm = t.mean(axis=2), b.mean(axis=2)
        cov = ((t - tm[..., None]) * (b - wm[..., None])).sum(axis=2)
        var = ((t - tm[..., None]) ** 2).sum(axis=2)
        s = np.where(var > 1e-12, cov / np.maximum(var, 1e-30), s)
        m = (wm - s * tm).astype(np.float16).astype(np.float64)
        s = s.astype(np.float16).astype(np.float64)
        s = np.where(np.abs(s) > 1e-12, s, 1e-6)
    codes = np.searchsorted(mids, (b - m[..., None]) / s[..., None])
    return (s[..., None] * table[codes] + m[..., None]).reshape(rows, cols).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="64,32")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    path = default_model_path()
    source = open_model(path)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ingot-lut-"))
    float_path = workdir / "float32.gguf"
    if not float_path.is_file():
        write_float_gguf(path, dict(float_weights(source)), float_path)
    reference = open_model(str(float_path))
    token_chunks = chunks(tokenize(reference, (ROOT / "tests/fixtures/eval_text.txt").read_text()), 256)[:3]
    scored_ref = score(reference, token_chunks)
    w = dict(float_weights(source))["token_embd.weight"]

    def row(name: str, dequantized: np.ndarray, bits: float) -> None:
        tensors = dict(source.tensors)
        tensors["token_embd.weight"] = dequantized
        model = StoredModel(path, source.architecture, source.metadata, tensors, source.config, source.adapters)
        r = compare(scored_ref, score(model, token_chunks))
        mse = float(((w - dequantized) ** 2).sum() / (w ** 2).sum())
        print(f"| {name} | {bits:.2f} | {mse:.5f} | {r.mean_kld:.4f} | {r.top1:.1%} |", flush=True)

    print("| token_embd.weight as | bits/weight | relative squared error | mean KLD | top-1 |\n| --- | ---: | ---: | ---: | ---: |")
    t0 = time.perf_counter()
    row("uint4:32:k", quantize(w, "uint4:32:k").dequantize_rows(), 4.5)
    row("uint4:32:f16", quantize(w, "uint4:32:f16").dequantize_rows(), 5.0)
    for block in (int(b) for b in args.blocks.split(",")):
        row(f"lut4:b{block} (float32 scale, no offset)", quantize(w, f"lut4:b{block}").dequantize_rows(), 4 + 32 / block)
        row(f"table x float16 scale + float16 offset, blocks of {block} (emulated)", lut_with_offset(w, block), 4 + 32 / block)
    print(f"({time.perf_counter() - t0:.0f} s; reference in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
