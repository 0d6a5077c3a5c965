"""Check the viewer's CUDA kernel groups (ingot.viewer.fusion, torch-free) against a real CudaPlan.

On a machine with torch, triton and a GPU: a Llama decoder of SmolLM2-135M's shapes (random weights,
so no model file is needed) and, with --split, one whose q/k/v and gate/up weights are separate
(sibling quantized matmuls), compiled for one decode step on cuda; the plan's own list of fusions is
counted by kind and compared with the groups the viewer draws.

    python benchmarks/viewer_cuda_groups.py [--layers 30]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import numpy as np


def plan_counts(fusions: list[str]) -> Counter:
    kinds = Counter()
    for f in fusions:
        kinds["region" if f.startswith("region ") else "add_rms_norm" if f == "add+rms_norm" else
              "rope_cache" if f == "rope+kv write" else "siblings" if "sibling" in f else f] += 1
    return kinds


def check(name: str, built, device: str = "cuda") -> bool:
    from ingot.viewer.fusion import kernel_groups
    exe = built.compile(1, device=device)
    planned = plan_counts(exe.plan.fusions)
    viewer = Counter(g["kind"] for g in kernel_groups(exe.program, "cuda")["groups"])
    ok = planned == viewer
    print(f"{name:<34} plan {dict(sorted(planned.items()))}\n{'':<34} view {dict(sorted(viewer.items()))}  {'OK' if ok else 'DIFFERENT'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    from ingot.models import llama
    cfg = llama.LlamaConfig(n_layers=args.layers, dim=576, n_heads=9, n_kv_heads=3, ffn_dim=1536, vocab_size=49152,
                            tied_embeddings=True, context_length=256)
    weights = llama.random_weights(cfg, k_major=True, f16_params=True)
    ok = check("SmolLM2 shapes (q/k/v side by side)", llama.build(cfg, weights))
    # the same decoder with every weight its own constant: sibling matmuls for the plan to join
    original = llama.Weights.matrices
    llama.Weights.matrices = lambda self, names, shapes: [self._constant(self._checked(n, s), n) for n, s in zip(names, shapes)]
    try:
        ok &= check("SmolLM2 shapes (separate weights)", llama.build(cfg, weights))
    finally:
        llama.Weights.matrices = original
    return 0 if ok else 1


if __name__ == "__main__":
    np.random.seed(0)
    sys.exit(main())
