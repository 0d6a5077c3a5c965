#!/usr/bin/env python
"""Make the per-family reference fixture with HF transformers (fp32) over tiny random-weight GGUFs.

Not part of Ingot and not run by the tests: it needs torch, transformers and accelerate (to load a
GGUF), which are not project dependencies. For each family in tests/family_models.py it writes the
tiny GGUF (seeded), lets transformers load it (its own GGUF reader and modelling code: an
independent implementation) and records

  * the prompt ids (24 random ids: longer than the Gemma models' sliding window of 8),
  * float32 logits at every prompt position (prefill), and
  * 32 greedily generated ids (HF generate, do_sample=False, with its KV cache).

Outputs: tests/fixtures/families_reference.npz ({family}.prompt, {family}.logits, {family}.greedy)
and tests/fixtures/families_reference.json (versions, command). Run from the repository root:

    pip install torch transformers accelerate      # a scratch environment, never Ingot's deps
    python scripts/make_family_fixture.py              # every family
    python scripts/make_family_fixture.py mistral3     # only these (the others' arrays kept)
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from family_models import FAMILIES, HF_CONFIG, HF_TWIN, HF_TWIN_ROPE, write_family_gguf  # noqa: E402

PROMPT_LENGTH, GENERATED = 24, 32


def prompt_ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, PROMPT_LENGTH).astype(np.int32)


def reference(name: str, folder: Path) -> dict[str, np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    f = write_family_gguf(name, folder / f"{name}.gguf")
    if name in HF_TWIN:   # transformers reads the same tensors written as a family it knows, runs them in its own model
        import transformers
        arch, model_class, config_class = HF_TWIN[name]
        write_family_gguf(name, folder / f"{name}.{arch}.gguf", arch=arch)
        twin = AutoModelForCausalLM.from_pretrained(folder, gguf_file=f"{name}.{arch}.gguf", dtype=torch.float32)
        c = twin.config
        config = getattr(transformers, config_class)(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
            rms_norm_eps=c.rms_norm_eps,
            rope_parameters=HF_TWIN_ROPE.get(name, {"rope_type": "default", "rope_theta": f.rope_base}),
            tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            **({"head_dim": f.head_dim} if config_class == "Ministral3Config" else {}))
        model = getattr(transformers, model_class)(config).to(torch.float32).eval()
        model.load_state_dict(twin.state_dict(), strict=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=f"{name}.gguf", dtype=torch.float32,
                                                     **HF_CONFIG.get(name, {})).eval()
    if "rope_parameters" in HF_CONFIG.get(name, {}):   # the override took: transformers' rotary embedding is YaRN's, ...
        assert model.model.rotary_emb.rope_type == HF_CONFIG[name]["rope_parameters"]["rope_type"], name
    if name in HF_TWIN_ROPE:
        assert model.model.rotary_emb.rope_type == HF_TWIN_ROPE[name]["rope_type"], name
    ids = prompt_ids(f.vocab)
    x = torch.tensor(ids[None].astype(np.int64))
    with torch.no_grad():
        logits = model(x).logits[0].numpy().astype(np.float32)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GENERATED, min_new_tokens=GENERATED,
                             do_sample=False)
    return {f"{name}.prompt": ids, f"{name}.logits": logits,
            f"{name}.greedy": out[0, len(ids):].numpy().astype(np.int32)}


def main(names: list[str]) -> None:
    """Every family's reference, or (names given) only those, the others kept from the stored fixture."""
    import torch
    import transformers

    fixtures = ROOT / "tests" / "fixtures"
    arrays: dict[str, np.ndarray] = {}
    if names:
        with np.load(fixtures / "families_reference.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k.split(".")[0] in FAMILIES and k.split(".")[0] not in names}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or FAMILIES:
            arrays.update(reference(name, Path(tmp)))
            print(name, arrays[f"{name}.greedy"][:8].tolist())
    np.savez_compressed(fixtures / "families_reference.npz", **arrays)
    meta = {"families": list(FAMILIES), "prompt_length": PROMPT_LENGTH, "generated": GENERATED,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "command": "python scripts/make_family_fixture.py"}
    (fixtures / "families_reference.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
