"""Chat templates: the GGUF's `tokenizer.chat_template` rendered with jinja2 the way HF transformers does.

    text = render_chat(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                       bos_token="<s>", eos_token="</s>")

The environment matches transformers' `apply_chat_template`: a sandboxed, immutable jinja2
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
block (rendered as its body), a `tojson` filter that does not escape HTML, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. Templates see `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents` and any extra keyword.
A file without a template gets ChatML (`CHATML_TEMPLATE`).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import IngotError

# transformers' ChatML default (the template it used when a tokenizer had none)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without attribute access to the real type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no reaching CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 (same signature trick as jinja2.utils.Namespace)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).rstrip(".")


def render_chat(template: str | None, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools=None, documents=None, **kwargs) -> str:
    """Render a chat template for `messages` (a list of {"role": ..., "content": ...} dicts).

    template: the GGUF's `tokenizer.chat_template`; None or "" selects ChatML.
    add_generation_prompt: end with the header of an assistant turn, ready for generation.
    Raises IngotError with one sentence when the template does not parse, rejects the messages, or fails.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise IngotError(f"chat messages must be a list of dicts with 'role' and 'content', "
                         f"not {type(messages).__name__}.")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise IngotError(f"chat message {i} must be a dict with 'role' and 'content', not {m!r}.")
    if not template:
        template = CHATML_TEMPLATE
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise IngotError(f"the chat template does not parse: {_one_line(e.message or e)} (template line {e.lineno}).") \
            from None
    try:
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, tools=tools, documents=documents, **kwargs)
    except _TemplateRaised as e:
        raise IngotError(f"the chat template rejected the messages: {_one_line(e)}.") from None
    except jinja2.exceptions.SecurityError as e:
        raise IngotError(f"the chat template tried something the sandbox forbids: {_one_line(e)}.") from None
    except Exception as e:  # a template error at render time: undefined attribute, bad operand, ...
        raise IngotError(f"the chat template failed to render: {type(e).__name__}: {_one_line(e)}.") from None
