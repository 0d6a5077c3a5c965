"""The tokenizer a GGUF file describes, built on HF `tokenizers`.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges (or the SentencePiece
scores), the token types and the special token ids as metadata under llama.cpp's key names. This
module rebuilds the tokenizer those keys describe, the way transformers' GGUF converter and
llama.cpp do, from a plain dict of metadata (key -> value), so it does not depend on any reader:

    tok = Tokenizer.from_gguf_metadata(metadata)
    ids = tok.encode("Hello")                 # BOS added when tokenizer.ggml.add_bos_token says so
    text = tok.decode(ids)
    stream = tok.stream_decoder()
    for i in ids:
        print(stream.push(i), end="")         # never splits a multi-byte UTF-8 character
    print(stream.flush())

Two vocabulary kinds are built:

* `gpt2` (byte-level BPE): the GGUF merges; the split regex chosen by `tokenizer.ggml.pre`
  (`_PRE_TOKENIZERS`), as llama.cpp and transformers choose it.
* `llama` (SentencePiece): BPE with byte fallback and a `Metaspace` pre-tokenizer, merges taken from
  the file or derived from the token scores, as transformers' `LlamaTokenizer` converter does it.

Control tokens (token type 3) are special: matched whole in text, dropped by `skip_special`.
User-defined tokens (type 4) are matched whole in text too, and are kept by `skip_special`.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import IngotError

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_KEY = "tokenizer.ggml."

# ---------------------------------------------------------------------------------------------------
# Byte-level pre-tokenizers, by tokenizer.ggml.pre
# ---------------------------------------------------------------------------------------------------

# Llama 3 (tokenizer.json of Meta-Llama-3; llama.cpp LLAMA3). Also used by several derived vocabularies.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 / Qwen2.5 / Qwen3 (transformers' Qwen2Tokenizer; llama.cpp QWEN2): digits one at a time.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: marks join letters.
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral tekken.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o / Llama 4.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# name -> (kind, regex, ignore_merges).
#   kind "gpt2": ByteLevel's own GPT-2 regex ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
#   kind "digits": every digit on its own first, then the GPT-2 regex (llama.cpp's STARCODER/SMOLLM
#       group: regexes "\p{N}" then the GPT-2 one; the Digits(individual_digits) + ByteLevel of the
#       original SmolLM tokenizer.json)
#   kind "split": Split(regex, isolated) then ByteLevel without its regex
# ignore_merges: a pre-token that is itself in the vocabulary is emitted whole (Llama 3's
# tokenizer.json sets it; llama.cpp does it for the LLAMA3 pre-tokenizer).
_PRE_TOKENIZERS: dict[str, tuple[str, str | None, bool]] = {
    "default": ("gpt2", None, False),
    "gpt2": ("gpt2", None, False),
    "gpt-2": ("gpt2", None, False),
    "jina-v1-en": ("gpt2", None, False),
    "olmo": ("gpt2", None, False),
    "smollm": ("digits", None, False),
    "starcoder": ("digits", None, False),
    "refact": ("digits", None, False),
    "command-r": ("digits", None, False),
    "codeshell": ("digits", None, False),
    "exaone": ("digits", None, False),
    "minerva-7b": ("digits", None, False),
    "llama3": ("split", _LLAMA3_SPLIT, True),
    "llama-v3": ("split", _LLAMA3_SPLIT, True),
    "llama-bpe": ("split", _LLAMA3_SPLIT, True),
    "falcon3": ("split", _LLAMA3_SPLIT, True),
    "falcon-h1": ("split", _LLAMA3_SPLIT, True),
    "pixtral": ("split", _LLAMA3_SPLIT, True),
    "midm-2.0": ("split", _LLAMA3_SPLIT, True),
    "lfm2": ("split", _LLAMA3_SPLIT, True),
    "dbrx": ("split", _LLAMA3_SPLIT, True),
    "smaug-bpe": ("split", _LLAMA3_SPLIT, True),
    "qwen2": ("split", _QWEN2_SPLIT, False),
    "qwen2.5": ("split", _QWEN2_SPLIT, False),
    "qwen-2.5": ("split", _QWEN2_SPLIT, False),
    "deepseek-r1-qwen": ("split", _QWEN2_SPLIT, False),
    "megrez": ("split", _QWEN2_SPLIT, False),
    "qwen35": ("split", _QWEN35_SPLIT, False),
    "tekken": ("split", _TEKKEN_SPLIT, False),
    "gpt-4o": ("split", _GPT4O_SPLIT, False),
    "llama4": ("split", _GPT4O_SPLIT, False),
}

# Token texts that end a turn in the chat templates that use them (llama.cpp's end-of-generation list).
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<end_of_utterance>",
                      "<\uff5cend\u2581of\u2581sentence\uff5c>")


# The longest text encode() takes: a prompt this long fills any context many times over (and the
# Rust tokenizer panics on texts of ~100 MB).
MAX_TEXT_CHARS = 1 << 24


def _is_rust_panic(e: BaseException) -> bool:
    """pyo3's PanicException (a Rust panic inside tokenizers): a BaseException that no `except Exception` catches."""
    return type(e).__name__ == "PanicException"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()).rstrip(".")
    return text if len(text) <= 300 else text[:297] + "..."


def _check_merges(merges: list[tuple], vocab: Mapping[str, int]) -> None:
    for i, merge in enumerate(merges):
        if len(merge) != 2:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.merges holds {' '.join(merge)!r} (entry {i}), which is not "
                             f"two tokens separated by a space.")
        for part in merge:
            if part not in vocab:
                raise IngotError(f"GGUF metadata field tokenizer.ggml.merges entry {i} names the token {part[:40]!r}, which "
                                 f"is not in tokenizer.ggml.tokens.")
        if merge[0] + merge[1] not in vocab:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.merges entry {i} makes {(merge[0] + merge[1])[:40]!r}, "
                             f"which is not in tokenizer.ggml.tokens.")


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first.

    The same rule (and order, ties included) as transformers' `generate_merges` with scores.
    """
    merges = []
    for piece, score in scores.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _as_list(value) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value)


def _as_str(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    Build it with `Tokenizer.from_gguf_metadata(metadata)` (or `Tokenizer(metadata)`); `metadata` maps
    GGUF keys (`tokenizer.ggml.model`, `tokenizer.ggml.tokens`, ...) to values (str, int, bool, lists or
    NumPy arrays).

    Attributes: `bos_id`, `eos_id`, `unk_id`, `pad_id` (None when the file names none); `eos_ids`, the
    ids that end generation (eos, eot/eom when named, and the end-of-turn tokens such as <|im_end|> or
    <|eot_id|> that the chat template writes, plus <|endoftext|>); `special_ids` (control tokens);
    `add_bos`, `add_eos`; `chat_template` (the file's; when it has none, `default_template`, the model
    family's own turn format, e.g. Gemma's; None when neither: ChatML is rendered); `model` and `pre` as
    the file names them.
    """

    def __init__(self, metadata: Mapping, default_template: str | None = None):
        self._default_template = default_template
        try:
            self._build(metadata)
        except IngotError:
            raise
        except (ValueError, TypeError, OverflowError) as e:
            raise IngotError(f"GGUF tokenizer metadata is malformed ({type(e).__name__}: {_one_line(e)}).") from None
        except BaseException as e:  # the Rust library raises plain Exception (and PanicException, a BaseException)
            if type(e) is Exception or _is_rust_panic(e):
                raise IngotError(f"GGUF tokenizer metadata does not describe a valid vocabulary: {_one_line(e)}.") from None
            raise

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping) -> Tokenizer:
        return cls(metadata)

    # ------------------------------------------------------------------------------------------ build
    def _build(self, md: Mapping) -> None:
        def get(name, default=None):
            return md.get(_KEY + name, default)

        model = get("model")
        if model is None:
            raise IngotError("GGUF metadata has no tokenizer.ggml.model, so it describes no tokenizer.")
        model = _as_str(model)
        raw_tokens = _as_list(get("tokens"))
        if not raw_tokens:
            raise IngotError("GGUF metadata field tokenizer.ggml.tokens is missing or empty.")
        bad = next((t for t in raw_tokens if not isinstance(t, (str, bytes, bytearray))), None)
        if bad is not None:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.tokens holds {type(bad).__name__} values such as "
                             f"{bad!r}, not strings.")
        tokens = [_as_str(t) for t in raw_tokens]
        n = len(tokens)
        raw_types = _as_list(get("token_type"))
        bad = next((t for t in raw_types if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.token_type holds {bad!r}, not an integer.")
        types = [int(t) for t in raw_types] or [TOKEN_NORMAL] * n
        if len(types) != n:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.token_type has {len(types)} entries "
                             f"but tokenizer.ggml.tokens has {n}.")
        self.model = model
        self.pre = _as_str(get("pre")) if get("pre") is not None else None
        self._tokens = tokens
        self._types = types
        self.chat_template = md.get("tokenizer.chat_template")
        if self.chat_template is not None:
            self.chat_template = _as_str(self.chat_template)
        if not self.chat_template:
            self.chat_template = self._default_template

        def token_id(name):
            v = get(name)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                raise IngotError(f"GGUF metadata field tokenizer.ggml.{name} is {v!r}, not a token id.")
            if not 0 <= v < n:
                raise IngotError(f"GGUF metadata field tokenizer.ggml.{name} is {v}, outside the vocabulary "
                                 f"of {n} tokens.")
            return v

        self.bos_id = token_id("bos_token_id")
        self.eos_id = token_id("eos_token_id")
        self.unk_id = token_id("unknown_token_id")
        self.pad_id = token_id("padding_token_id")
        eot_id, eom_id = token_id("eot_token_id"), token_id("eom_token_id")

        if model == "gpt2":
            tk = self._build_byte_level(md)
            default_add_bos = False
        elif model == "llama":
            tk = self._build_sentencepiece(md)
            default_add_bos = True  # llama.cpp and transformers add BOS to a SentencePiece vocabulary by default
        else:
            raise IngotError(f"GGUF metadata field tokenizer.ggml.model is {model!r}; Ingot reads 'gpt2' "
                             f"(byte-level BPE) and 'llama' (SentencePiece) vocabularies.")
        self.add_bos = bool(get("add_bos_token", default_add_bos))
        self.add_eos = bool(get("add_eos_token", False))

        # special (control) and user-defined tokens: matched whole in text, never split
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and t]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t]
        if special:
            tk.add_special_tokens(special)
        if user:
            tk.add_tokens(user)
        if tk.get_vocab_size(with_added_tokens=True) > n:
            raise IngotError(f"GGUF tokenizer metadata is inconsistent: its special tokens do not all appear in "
                             f"tokenizer.ggml.tokens ({n} tokens).")
        self._tk = tk
        self._tk_plain = None  # a copy that reads special-token text as plain text, built on first use
        self.special_ids = frozenset(i for i, ty in enumerate(types) if ty == TOKEN_CONTROL)

        # end of generation: eos, eot/eom when the file names them, and the end-of-turn tokens the chat
        # template writes (<|im_end|>, <|eot_id|>, <end_of_turn>, ...; ChatML's when there is no template),
        # control or user-defined tokens (llama.cpp treats these texts as end of generation either way)
        from .chat import CHATML_TEMPLATE

        eos = {i for i in (self.eos_id, eot_id, eom_id) if i is not None}
        template = self.chat_template or CHATML_TEMPLATE
        for text in _END_OF_TURN_TEXTS:
            i = self._tk.token_to_id(text)
            if i is not None and i < n and types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED) \
                    and (text in template or text == "<|endoftext|>"):
                eos.add(i)
        self.eos_ids = frozenset(eos)

    def _build_byte_level(self, md: Mapping) -> _HFTokenizer:
        merges_raw = [_as_str(m) for m in _as_list(md.get(_KEY + "merges"))]
        if not merges_raw:
            raise IngotError("GGUF metadata field tokenizer.ggml.merges is missing or empty; a 'gpt2' "
                             "(byte-level BPE) vocabulary needs it.")
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(self._tokens, self._types)):
            if ty not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(t) <= alphabet:
                # a plain token written in raw text rather than the byte alphabet: respell it (as transformers does)
                t = "".join(spell[b] for b in t.encode("utf-8"))
            vocab[t] = i
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise IngotError(f"GGUF metadata field tokenizer.ggml.merges holds {m!r}, which is not two "
                                 f"tokens separated by a space.")
            merges.append((a, b))
        _check_merges(merges, vocab)
        pre = self.pre if self.pre is not None else "default"
        if pre not in _PRE_TOKENIZERS:
            warnings.warn(f"tokenizer.ggml.pre {pre!r} is not one Ingot knows; splitting text with GPT-2's regex.",
                          stacklevel=3)
        kind, regex, ignore_merges = _PRE_TOKENIZERS.get(pre, ("gpt2", None, False))
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False, ignore_merges=ignore_merges))
        if kind == "gpt2":
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif kind == "digits":
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        return tk

    def _build_sentencepiece(self, md: Mapping) -> _HFTokenizer:
        tokens = self._tokens
        vocab = {t: i for i, t in enumerate(tokens)}
        merges_raw = _as_list(md.get(_KEY + "merges"))
        if merges_raw:
            merges = [tuple(_as_str(m).split(" ", 1)) for m in merges_raw]
        else:
            scores = _as_list(md.get(_KEY + "scores"))
            if len(scores) != len(tokens):
                raise IngotError(f"GGUF metadata field tokenizer.ggml.scores has {len(scores)} entries but "
                                 f"tokenizer.ggml.tokens has {len(tokens)}; a 'llama' (SentencePiece) vocabulary "
                                 f"without merges needs one score per token.")
            merges = _generate_merges(vocab, dict(zip(tokens, (float(s) for s in scores))))
        if merges_raw:
            _check_merges(merges, vocab)
        unk = tokens[self.unk_id] if self.unk_id is not None else None
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
        add_prefix = bool(md.get(_KEY + "add_space_prefix", True))
        tk.normalizer = None
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                    prepend_scheme="first" if add_prefix else "never", split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tk.decoder = decoders.Sequence(steps)
        return tk

    # ------------------------------------------------------------------------------------------ queries
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token as the GGUF spells it (byte-level vocabularies: in GPT-2's byte alphabet)."""
        self._check_ids((token_id,))
        return self._tokens[int(token_id)]

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as the vocabulary spells it, or None."""
        i = self._tk.token_to_id(token)
        return i if i is not None and i < len(self._tokens) else None

    def token_type(self, token_id: int) -> int:
        self._check_ids((token_id,))
        return self._types[int(token_id)]

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_id] if self.eos_id is not None else ""

    # ------------------------------------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`.

        add_special: add BOS (and EOS) when the vocabulary's add_bos_token (add_eos_token) says so.
        parse_special: read special-token text such as `<|im_start|>` in `text` as that token; False
            tokenizes it as plain text (for untrusted user input).
        """
        if not isinstance(text, str):
            raise IngotError(f"Tokenizer.encode takes a str, not {type(text).__name__}.")
        tk = self._tk
        if not parse_special:
            if self._tk_plain is None:
                self._tk_plain = _HFTokenizer.from_str(self._tk.to_str())
                self._tk_plain.encode_special_tokens = True
            tk = self._tk_plain
        if len(text) > MAX_TEXT_CHARS:
            raise IngotError(f"Tokenizer.encode: the text has {len(text)} characters; at most {MAX_TEXT_CHARS} are tokenized.")
        try:
            ids = tk.encode(text, add_special_tokens=False).ids if text else []
        except BaseException as e:  # a Rust panic arrives as PanicException, a BaseException
            if _is_rust_panic(e) or type(e) is Exception:
                raise IngotError(f"Tokenizer.encode failed on a text of {len(text)} characters: {_one_line(e)}.") from None
            raise
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids = [self.bos_id] + ids
            if self.add_eos and self.eos_id is not None:
                ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for token ids; skip_special drops control tokens (BOS, EOS, <|im_start|>, ...)."""
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        return self._tk.decode(ids, skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True, **kwargs) -> str:
        """The GGUF's chat template (ChatML when it has none) rendered for `messages`.

        Encode the result with `encode(text, add_special=False)`: the template writes BOS itself.
        """
        from .chat import render_chat
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)

    def _check_ids(self, ids) -> None:
        n = len(self._tokens)
        for i in ids:
            if not 0 <= int(i) < n:
                raise IngotError(f"token id {int(i)} is outside the vocabulary of {n} tokens.")

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)})")


def tokenize(model, text: str) -> list[int]:
    """text as the token ids a model (anything with GGUF `.metadata`: a StoredModel) reads, BOS first."""
    return Tokenizer(model.metadata).encode(text, add_special=True)


class StreamDecoder:
    """Text pieces as token ids arrive, never splitting a multi-byte UTF-8 character.

    `push(id)` returns the text that became complete with that id ("" while a character is still
    partial); `flush()` returns what is left at the end. The pieces joined equal `decode(all ids)`.

    It decodes a short window of recent ids twice (with and without the newest ones) and emits the
    difference once it does not end in a partial character, so decoders that depend on neighbouring
    tokens (SentencePiece's leading-space strip, byte fallback) give the same text as a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._window: list[int] = []  # ids still needed: the last emitted ones (context) and the pending ones
        self._read = 0                # window[:_read] is already emitted
        self.text = ""                # all text emitted so far

    def _diff(self) -> tuple[str, str]:
        decode = self._tok._tk.decode
        done = decode(self._window[:self._read], skip_special_tokens=self._skip)
        full = decode(self._window, skip_special_tokens=self._skip)
        return done, full

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._tok._check_ids((token_id,))
        self._window.append(token_id)
        done, full = self._diff()
        if len(full) > len(done) and not full.endswith("\ufffd"):
            piece = full[len(done):]
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        done, full = self._diff()
        piece = full[len(done):] if len(full) > len(done) else ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self.text += piece
        return piece
