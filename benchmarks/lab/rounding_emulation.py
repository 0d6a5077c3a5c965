"""What 16-bit operands cost a real model, independently of Ingot's kernels: HF transformers runs the
default model's GGUF in float32 on the CPU with the operands of chosen products rounded to bfloat16 or
float16 (sums stay float32), and the last position's logits of each fixture prompt (tests/data) are
compared with the float32 reference (relative L2), as tests/test_cuda_llm.py compares Ingot's.

    python benchmarks/lab/rounding_emulation.py              # every variant, ~2 min on 2 cores

Variants: the linears' x and W, attention's q/k (scores) and p/v (output), alone and together. Where
Ingot's GPU prefill lands near "everything" of its dtype, its kernels round as the dtype must and no
more (2026-12-06: bf16 everything 3.5e-3 / 2.6e-3 / 2.7e-3 / 1.23e-2 / 4.0e-3 against Ingot's H100
bf16 prefill's 1.9e-3..1.16e-2; float16 everything 3.1e-4..8.3e-4). Needs transformers and accelerate.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from test_llm import load_reference, model_path, rel_l2  # noqa: E402

ROUND = {}          # what the hooks round now: "x", "w", "qk", "pv" -> dtype


def rounded(t: torch.Tensor, what: str) -> torch.Tensor:
    dtype = ROUND.get(what)
    return t if dtype is None else t.to(dtype).to(torch.float32)


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **_):
    """torch SDPA in float32 with q/k and p/v rounded as ROUND says (causal or a mask, GQA)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = rounded(q, "qk") @ rounded(k, "qk").transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    tq, tk = s.shape[-2:]
    if attn_mask is None:
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq), float("-inf"))
    elif attn_mask.dtype == torch.bool:
        s = s.masked_fill(~attn_mask, float("-inf"))
    else:
        s = s + attn_mask
    return rounded(s.softmax(-1), "pv") @ rounded(v, "pv")


def main() -> int:
    from transformers import AutoModelForCausalLM
    import torch.nn.functional as F
    import transformers.integrations.sdpa_attention as hf_sdpa

    path = model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    F.scaled_dot_product_attention = hf_sdpa.torch.nn.functional.scaled_dot_product_attention = sdpa
    weights = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name:     # Ingot's head runs one row, float32-level
            weights[m] = m.weight.data.clone()
            m.register_forward_pre_hook(lambda mod, args: (rounded(args[0], "x"),))
    meta, arrays = load_reference()
    print("prompt tokens:", [len(p["prompt_ids"]) for p in meta["prompts"]])
    variants = {"float32": ()}
    for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        variants.update({f"{name} linears' x": {"x": dtype}, f"{name} linears' W": {"w": dtype},
                         f"{name} attention q/k": {"qk": dtype}, f"{name} attention p/v": {"pv": dtype},
                         f"{name} linears": {"x": dtype, "w": dtype},
                         f"{name} everything": {"x": dtype, "w": dtype, "qk": dtype, "pv": dtype}})
    for label, rounding in variants.items():
        ROUND.clear()
        ROUND.update(rounding)
        for m, w in weights.items():
            m.weight.data = rounded(w, "w")
        errors = []
        with torch.no_grad():
            for case, p in enumerate(meta["prompts"]):
                logits = model(torch.tensor([p["prompt_ids"]])).logits[0, -1].numpy()
                errors.append(rel_l2(logits.astype(np.float64), arrays["logits_prefill"][case]))
        print(f"{label:28s} " + " ".join(f"{e:.2e}" for e in errors), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
