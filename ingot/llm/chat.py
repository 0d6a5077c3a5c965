"""Chat templates: the GGUF's `tokenizer.chat_template` rendered with jinja2 the way HF transformers does.

    text = render_chat(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                       bos_token="<s>", eos_token="</s>")

The environment matches transformers' `apply_chat_template`: a sandboxed, immutable jinja2
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
block (rendered as its body), a `tojson` filter that does not escape HTML, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. Templates see `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents` and any extra keyword.
A file without a template gets ChatML (`CHATML_TEMPLATE`).

A chat template is code from whoever made the file, so it runs bounded: at most
MAX_RENDER_SECONDS of time (checked on every call and template line while it renders) and
MAX_OUTPUT_CHARS of output (checked before `*`, `+`, `%` and `**` build a string or list, on every
filter's and function's size arguments and result, and on the text rendered so far). Past either
bound, or on any failure, render_chat raises one IngotError.
"""
from __future__ import annotations

import json
import re
import sys
import time
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


MAX_RENDER_SECONDS = 1.0
MAX_OUTPUT_CHARS = 1 << 22     # 4 Mi characters: far more than any context holds
MAX_TEMPLATE_CHARS = 1 << 20   # the template's own source (published ones are a few kB)


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


class _TemplateTooBig(Exception):
    """The template would take longer or write more than the bounds allow."""


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_args(name: str, args, kwargs) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
            raise _TemplateTooBig(f"{name} was given the size {v}, beyond the output bound of {MAX_OUTPUT_CHARS} characters")


def _check_result(name: str, value):
    if _size(value) > MAX_OUTPUT_CHARS:
        raise _TemplateTooBig(f"{name} made a value of {_size(value)} items, beyond the output bound of {MAX_OUTPUT_CHARS}")
    return value


_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d+))?")
_FORMAT_WIDTH = re.compile(r"(\d+)(?=[^{}]*\})")   # digits inside a {...} replacement field


def _bounded_join(join):
    """jinja2's str_join / markup_join (the `~` operator) with the output bound."""
    def bounded(seq):
        return _check_result("'~'", join(seq))
    return bounded


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every operator that can build a big value and every call size-checked."""

    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * max(n, 0) > MAX_OUTPUT_CHARS:
                    raise _TemplateTooBig(f"'*' would make {_size(seq) * n} items, beyond the output bound of {MAX_OUTPUT_CHARS}")
        elif operator == "+" and _size(left) + _size(right) > MAX_OUTPUT_CHARS:
            raise _TemplateTooBig(f"'+' would make {_size(left) + _size(right)} items, beyond the output bound")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                right > 0 and max(abs(left), 2).bit_length() * right > 4096:
            raise _TemplateTooBig(f"{left} ** {right} is too large a number")
        elif operator == "%" and isinstance(left, str):
            widths = [int(w or 0) for pair in _PERCENT_WIDTH.findall(left) for w in pair]
            if widths and max(widths) > MAX_OUTPUT_CHARS:
                raise _TemplateTooBig(f"'%' asks for a field of {max(widths)} characters")
        return _check_result(f"'{operator}'", super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        _check_args(name, args, kwargs)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if isinstance(owner, str) and name in ("format", "format_map"):
            widths = [int(w) for w in _FORMAT_WIDTH.findall(owner)]
            if widths and max(widths) > MAX_OUTPUT_CHARS:
                raise _TemplateTooBig(f"str.format asks for a field of {max(widths)} characters")
        return _check_result(name, super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(name: str, fn):
    def bounded(*args, **kwargs):
        _check_args(f"filter {name}", args, kwargs)
        return _check_result(f"filter {name}", fn(*args, **kwargs))
    for attr in ("jinja_pass_arg",):  # keep how jinja2 passes the environment/context
        if hasattr(fn, attr):
            setattr(bounded, attr, getattr(fn, attr))
    return bounded


def _deadline_tracer(deadline: float):
    """A sys.settrace function that raises once `deadline` passes: on every Python call, and on every
    line of the compiled template itself (its loops)."""
    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TemplateTooBig(f"rendering took longer than {MAX_RENDER_SECONDS} s")
        return trace if frame.f_code.co_filename == "<template>" else None
    return trace


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
        _check_result(f"namespace attribute {name!r}", value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    compiled = env.from_string(template)
    names = compiled.root_render_func.__globals__  # the compiled module's: `~` calls these
    for join in ("str_join", "markup_join"):
        if join in names:
            names[join] = _bounded_join(names[join])
    return compiled


class TemplateRefused(IngotError):
    """The template cannot be used at all: it does not parse or compile, or it passed a bound."""


def check_template(template: str | None) -> None:
    """Refuse (TemplateRefused) a template that does not parse or compile, or that passes the time or
    output bound on a one-message conversation: what loading a model checks before anything else is
    built. A template that only rejects this conversation (raise_exception, an undefined name) passes."""
    try:
        render_chat(template, [{"role": "user", "content": "Hello."}], add_generation_prompt=True)
    except TemplateRefused:
        raise
    except IngotError:
        pass


def _one_line(text: str) -> str:
    text = " ".join(str(text).split()).rstrip(".")
    return text if len(text) <= 300 else text[:297] + "..."


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
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRefused(f"the chat template is {type(template).__name__ if not isinstance(template, str) else f'{len(template)} characters long'}"
                         f"; a template is a string of at most {MAX_TEMPLATE_CHARS} characters.")
    try:
        compiled = _compile(template)
    except RecursionError:
        raise TemplateRefused("the chat template does not parse: it nests expressions too deeply.") from None
    except SyntaxError as e:  # jinja2 parsed it but Python rejects the code it made (e.g. a break outside a loop)
        raise TemplateRefused(f"the chat template does not compile: {_one_line(e.msg)}.") from None
    except jinja2.TemplateSyntaxError as e:
        raise TemplateRefused(f"the chat template does not parse: {_one_line(e.message or e)} (template line {e.lineno}).") \
            from None
    previous = sys.gettrace()
    sys.settrace(_deadline_tracer(time.monotonic() + MAX_RENDER_SECONDS))
    try:
        pieces, total = [], 0
        for piece in compiled.generate(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token, tools=tools, documents=documents, **kwargs):
            total += len(piece)
            if total > MAX_OUTPUT_CHARS:
                raise _TemplateTooBig(f"the rendered text passed the output bound of {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateTooBig as e:
        raise TemplateRefused(f"the chat template was stopped: {_one_line(e)}.") from None
    except (MemoryError, RecursionError) as e:
        raise TemplateRefused(f"the chat template was stopped: it ran out of {'memory' if isinstance(e, MemoryError) else 'stack'}.") \
            from None
    except _TemplateRaised as e:
        raise IngotError(f"the chat template rejected the messages: {_one_line(e)}.") from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateRefused(f"the chat template tried something the sandbox forbids: {_one_line(e)}.") from None
    except Exception as e:  # a template error at render time: undefined attribute, bad operand, ...
        raise IngotError(f"the chat template failed to render: {type(e).__name__}: {_one_line(e)}.") from None
    finally:
        sys.settrace(previous)
