"""Reading what strangers wrote: the checks every loader shares (DESIGN.md, "Untrusted input").

    metadata_int(model, key, ...)      an integer metadata value of the type and range a builder needs
    metadata_float(model, key, ...)    a finite number in range
    metadata_str(model, key)           a string
    read_json(path, what)              JSON with a depth limit, no NaN/Infinity, one IngotError
    inside(folder, relative, what)     a path that resolves (symlinks followed) inside folder
    checked_path(path, what)           a path the OS can look up (no NUL, not over-long)

Each raises one IngotError naming the file, the field and the value.

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.json")
    >>> _ = open(path, "w").write("[" * 100 + "]" * 100)
    >>> try:
    ...     read_json(path, "x.json")
    ... except Exception as e:
    ...     print(type(e).__name__)
    IngotError
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from .errors import IngotError

MAX_JSON_DEPTH = 64           # nesting of arrays and objects in manifest.json, graph.json, llm.json, headers
MAX_JSON_BYTES = 1 << 30      # a JSON file Ingot reads whole


def clip(text: Any, limit: int = 200) -> str:
    """str(text) on one line, cut to `limit` characters (for an exception's message inside a sentence)."""
    text = " ".join(str(text).split()).rstrip(".")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a hostile value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- metadata values ----------------------------------------------------------------------------------

def metadata_int(model, key: str, default: int | None = None, minimum: int = 1, maximum: int = 1 << 31) -> int:
    """The integer metadata value `key` of a model file (anything with .path and .get), checked:
    stored as an integer (not a string, float or bool) and within [minimum, maximum]; `default`
    when absent (None: the key is required)."""
    value = model.get(key)
    if value is None:
        if default is None:
            raise IngotError(f"{model.path}: metadata lacks {key}.")
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise IngotError(f"{model.path}: metadata key {key} is {short(value)} ({type(value).__name__}), not an integer.")
    value = int(value)
    if not minimum <= value <= maximum:
        raise IngotError(f"{model.path}: metadata key {key} is {value}, outside {minimum}..{maximum}.")
    return value


def metadata_str(model, key: str, default: str | None = None) -> str | None:
    """A string metadata value (not a number or an array); `default` when absent."""
    value = model.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise IngotError(f"{model.path}: metadata key {key} is {short(value)} ({type(value).__name__}), not a string.")
    return value


def metadata_float(model, key: str, default: float, minimum: float = 0.0, maximum: float = 1e30,
                   exclusive_minimum: bool = False) -> float:
    """A finite number-valued metadata value (integers accepted) within [minimum, maximum] (or
    (minimum, maximum] with exclusive_minimum); `default` when absent."""
    value = model.get(key)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise IngotError(f"{model.path}: metadata key {key} is {short(value)} ({type(value).__name__}), not a number.")
    value = float(value)
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        raise IngotError(f"{model.path}: metadata key {key} is {value}, outside {'(' if exclusive_minimum else '['}"
                         f"{minimum}, {maximum}].")
    return value


# -- JSON ---------------------------------------------------------------------------------------------

def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest (iterative: a deep value cannot exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads(text: str | bytes, what: str) -> Any:
    """json.loads with a depth limit (MAX_JSON_DEPTH) and no NaN/Infinity; IngotError naming `what`."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise IngotError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels.") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise IngotError(f"{what} is not valid JSON ({' '.join(str(e).split())[:200]}).") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise IngotError(f"{what} nests arrays or objects deeper than {MAX_JSON_DEPTH} levels.")
    return value


def read_json(path, what: str | None = None) -> Any:
    """A JSON file, whole (at most MAX_JSON_BYTES), parsed by `loads`."""
    what = what or str(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_JSON_BYTES:
            raise IngotError(f"{what} is {size} bytes, more than the {MAX_JSON_BYTES} a JSON file may hold.")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise IngotError(f"{what} cannot be read ({e.strerror or e}).") from None
    return loads(data, what)


# -- paths --------------------------------------------------------------------------------------------

MAX_PATH_BYTES = 4096   # Linux's PATH_MAX; a name within it at most NAME_MAX (255) bytes


def checked_path(path, what: str = "path") -> str:
    """os.fspath(path), refused with one IngotError when the OS could not look it up (a NUL byte,
    more than MAX_PATH_BYTES, a component over 255 bytes): Path.is_file() raises OSError on those."""
    try:
        text = os.fspath(path)
        raw = os.fsencode(text)
    except (TypeError, ValueError, UnicodeError):
        raise IngotError(f"{what} {short(path)} is not a file path.") from None
    if b"\0" in raw or len(raw) > MAX_PATH_BYTES or any(len(part) > 255 for part in raw.split(b"/")):
        raise IngotError(f"{what} {short(text)} ({len(raw)} bytes) is not a path this system can open: it is too long "
                         f"or holds a NUL byte.")
    return text


def inside(folder, relative: str, what: str) -> str:
    """folder/relative as a real path (symlinks followed), which must lie inside folder's real path;
    `relative` must be a plain relative path (no NUL, not absolute, no over-long part)."""
    if not isinstance(relative, str) or not relative or "\0" in relative or os.path.isabs(relative) \
            or any(len(part.encode()) > 255 for part in relative.replace("\\", "/").split("/")) or len(relative) > 4096:
        raise IngotError(f"{what} names {short(relative)}, which is not a relative path inside {folder}.")
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise IngotError(f"{what} names {short(relative)}, which resolves to {path}, outside {root}; refused.")
    return path
