"""The Executable: run(feeds), state objects holding variables, callables binding, save.

    >>> import numpy as np, ingot
    >>> g = ingot.Graph()
    >>> x = g.placeholder((3,), name="x")
    >>> counter = g.variable(np.zeros(3, np.float32), name="counter")
    >>> _ = g.assign(counter, counter + x)
    >>> exe = g.compile(targets=[counter + x])
    >>> exe.run({"x": np.ones(3, np.float32)})[0].tolist(), exe.run({"x": np.ones(3, np.float32)})[0].tolist()
    ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .backends import get_backend
from .errors import IngotError
from .ir import Op, Program, TensorType


class State:
    """The variables of one sequence (one KV cache). An executable can serve many states."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def __getitem__(self, name: str):
        return self.values[name]

    def __setitem__(self, name: str, value) -> None:
        if name not in self.values:
            raise IngotError(f"state: no variable named {name!r} (have {sorted(self.values)}).")
        old = self.values[name]
        value = np.asarray(value)
        if value.shape != old.shape:
            raise IngotError(f"state: variable {name!r} has shape {old.shape}, not {value.shape}.")
        old[...] = value

    def keys(self):
        return self.values.keys()


class Executable:
    """A compiled graph. `run` takes feeds by placeholder name or tensor and returns the targets."""

    def __init__(self, program: Program, device: str = "cpu", callables: Mapping[str, "Executable"] | None = None,
                 history: Sequence[tuple[str, bool]] = ()):
        self.program = program
        self.device = device
        self.history = list(history)
        self.backend = get_backend(device)
        self.feed_types: dict[str, TensorType] = {n.name: n.type for n in program.nodes() if n.op == Op.PLACEHOLDER}
        self.feed_order = list(self.feed_types)
        self.output_types = [n.type for n in program.outputs]
        self.call_sites = {n.attrs["name"]: n for n in program.nodes() if n.op == Op.CALL}
        self.callables: dict[str, Executable] = {}
        for name, exe in (callables or {}).items():
            self.bind(name, exe)
        self.plan = self.backend.prepare(program, self)
        self.state = self.new_state()

    # -- state ----------------------------------------------------------------------------------
    def new_state(self) -> State:
        """A fresh copy of every variable at its initial value."""
        return State(self.backend.new_state(self.program))

    # -- callables ------------------------------------------------------------------------------
    def bind(self, name: str, executable: "Executable") -> None:
        """Bind (or re-bind) the executable a `call` site runs; the main graph is not recompiled."""
        site = self.call_sites.get(name)
        if site is None:
            raise IngotError(f"bind: this executable has no call named {name!r} (have {sorted(self.call_sites)}).")
        want_in = list(site.attrs["input_types"])
        have_in = [executable.feed_types[n] for n in executable.feed_order]
        if want_in != have_in or list(site.attrs["output_types"]) != executable.output_types:
            raise IngotError(f"bind: {name!r} takes {want_in} and returns {list(site.attrs['output_types'])}, "
                             f"but the executable takes {have_in} and returns {executable.output_types}.")
        self.callables[name] = executable

    # -- running --------------------------------------------------------------------------------
    def run(self, feeds: Mapping[Any, Any] | Sequence[Any] = (), state: State | None = None, **kwargs) -> list[Any]:
        """Run once. feeds: {name or placeholder tensor: array} or a list in placeholder order."""
        state = state or self.state
        values = self._feeds(feeds)
        try:
            return self.plan.run(values, state.values, **kwargs)
        except IngotError:
            raise
        except (ValueError, IndexError, TypeError) as e:
            raise IngotError(f"run: {type(e).__name__}: {e}.") from e

    __call__ = run

    def _feeds(self, feeds) -> dict[str, Any]:
        if isinstance(feeds, Mapping):
            named = {}
            for key, value in feeds.items():
                name = key if isinstance(key, str) else getattr(getattr(key, "node", None), "name", None)
                if name not in self.feed_types:
                    raise IngotError(f"run: {key!r} is not an input of this executable (inputs: {self.feed_order}).")
                named[name] = value
        else:
            feeds = list(feeds)
            if len(feeds) != len(self.feed_order):
                raise IngotError(f"run: expected {len(self.feed_order)} inputs ({self.feed_order}), got {len(feeds)}.")
            named = dict(zip(self.feed_order, feeds))
        missing = [n for n in self.feed_order if n not in named]
        if missing:
            raise IngotError(f"run: missing feeds {missing}.")
        out = {}
        for name, value in named.items():
            t = self.feed_types[name]
            out[name] = self.backend.from_host(_check_feed(name, value, t), t)
        return out

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write a package directory (see ingot.package)."""
        from .package import save
        save(self, path)

    def __repr__(self) -> str:
        return (f"<Executable {self.device} inputs={[f'{n}:{t}' for n, t in self.feed_types.items()]} "
                f"outputs={self.output_types} nodes={len(self.program.nodes())}>")


def _check_feed(name: str, value, t: TensorType):
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
        return value  # device arrays are checked by their backend
    array = np.asarray(value)
    want = t.dtype.storage
    if array.dtype != want:
        if array.dtype.kind == want.kind or (array.dtype.kind in "iu" and want.kind in "iu"):
            array = array.astype(want)
        else:
            raise IngotError(f"run: feed {name!r} has dtype {array.dtype}, expected {t.dtype.name}.")
    if array.shape != tuple(t.shape) and not (t.dtype.packed):
        raise IngotError(f"run: feed {name!r} has shape {array.shape}, expected {tuple(t.shape)}.")
    return array
