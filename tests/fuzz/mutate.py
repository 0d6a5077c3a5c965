"""Mutators shared by every loader's harness, written against a small `Draw` interface so that the same
code is driven by hypothesis (CI: derandomized, shrinks a failure) or by random.Random (the long
mode: millions of cases, no per-example overhead)."""
from __future__ import annotations

import random
import struct
from typing import Any, Sequence

# Values that break size arithmetic: zero, one, signs, powers of two around 8/16/32/64-bit limits.
INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 255, 256, 1023, 1024, 4095, 4096, 65535, 65536,
                    2**20, 2**24, 2**30, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**63,
                    2**64 - 1, -1, -2, -128, -2**31, -2**63]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-300, 1e300, 3.4e38, float("inf"), float("-inf"), float("nan")]


class Draw:
    """The randomness a mutator uses."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, items: Sequence[Any]) -> Any:
        return items[self.integer(0, len(items) - 1)]

    def chance(self, one_in: int) -> bool:
        return self.integer(0, one_in - 1) == 0

    def some_bytes(self, max_len: int) -> bytes:
        return bytes(self.integer(0, 255) for _ in range(self.integer(0, max_len)))

    def interesting_int(self) -> int:
        return self.choice(INTERESTING_INTS) if not self.chance(4) else self.integer(-2**63, 2**64 - 1)


class RandomDraw(Draw):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def some_bytes(self, max_len: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_len))


class HypothesisDraw(Draw):
    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def some_bytes(self, max_len: int) -> bytes:
        return self.data.draw(self.st.binary(max_size=max_len))


def mutate_bytes(draw: Draw, data: bytes, focus: int | None = None, rounds: int = 4) -> bytes:
    """1..rounds byte-level edits, positions biased to the first `focus` bytes (a header) when given."""
    buf = bytearray(data)
    for _ in range(draw.integer(1, rounds)):
        if not buf:
            buf.extend(draw.some_bytes(16))
            continue
        end = len(buf) if focus is None or draw.chance(4) else min(len(buf), focus)
        at = draw.integer(0, end - 1)
        op = draw.integer(0, 7)
        if op == 0:                                              # flip bits
            buf[at] ^= 1 << draw.integer(0, 7)
        elif op == 1:                                            # an interesting byte
            buf[at] = draw.choice([0, 1, 0x7F, 0x80, 0xFF])
        elif op in (2, 3):                                       # an interesting 32- or 64-bit integer
            width = 4 if op == 2 else 8
            value = draw.interesting_int() % (1 << (8 * width))
            buf[at:at + width] = value.to_bytes(width, "little")
        elif op == 4:                                            # insert bytes
            buf[at:at] = draw.some_bytes(16)
        elif op == 5:                                            # delete a range
            del buf[at:at + draw.integer(1, 64)]
        elif op == 6:                                            # truncate
            del buf[at:]
        else:                                                    # duplicate a chunk elsewhere
            size = draw.integer(1, 64)
            chunk = bytes(buf[at:at + size])
            where = draw.integer(0, len(buf))
            buf[where:where] = chunk
    return bytes(buf)


def hostile_value(draw: Draw, like: Any = None) -> Any:
    """A JSON-able or metadata value meant to break whoever reads it: a wrong type, a boundary
    number, a non-finite float, an empty, long or nested container."""
    options = [
        lambda: None,
        lambda: draw.interesting_int(),
        lambda: draw.choice(INTERESTING_FLOATS),
        lambda: draw.choice(["", "a" * 5000, "../../etc/passwd", "x\0y", "\u202e", "NaN"]),
        lambda: draw.choice([True, False]),
        lambda: [],
        lambda: [draw.interesting_int() for _ in range(draw.integer(1, 4))],
        lambda: {"a": None},
        lambda: nested(draw.integer(1, 200)),
    ]
    if isinstance(like, (int, float)) and not isinstance(like, bool):
        options.append(lambda: like * draw.choice([-1, 2, 1000, 2**31]))
    if isinstance(like, list) and like:
        options.append(lambda: like[: draw.integer(0, len(like) - 1)])
        options.append(lambda: like + like)
    return draw.choice(options)()


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def json_paths(value: Any, prefix: tuple = (), limit: int = 2000) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices), breadth first, at most `limit`."""
    out, queue = [], [(prefix, value)]
    while queue and len(out) < limit:
        path, v = queue.pop(0)
        out.append(path)
        if isinstance(v, dict):
            queue.extend((path + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            queue.extend((path + (i,), x) for i, x in enumerate(v[:50]))
    return out


def mutate_json(draw: Draw, value: Any, rounds: int = 3) -> Any:
    """The value with 1..rounds leaves or subtrees replaced by hostile values (a deep copy)."""
    import copy
    value = copy.deepcopy(value)
    for _ in range(draw.integer(1, rounds)):
        paths = json_paths(value)
        path = draw.choice(paths)
        if not path:
            value = hostile_value(draw, value)
            continue
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if draw.chance(6) and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = hostile_value(draw, parent[key])
    return value


def pack_le(fmt: str, *values) -> bytes:
    return struct.pack("<" + fmt, *values)
