"""The Executable: run(feeds), state objects holding variables, callables binding, save.

    >>> import numpy as np, ingot
    >>> g = ingot.Graph()
    >>> x = g.placeholder((3,), name="x")
    >>> counter = g.variable(np.zeros(3, np.float32), name="counter")
    >>> _ = g.assign(counter, counter + x)
    >>> exe = g.compile(targets=[counter + x])
    >>> exe.run({"x": np.ones(3, np.float32)})[0].tolist(), exe.run({"x": np.ones(3, np.float32)})[0].tolist()
    ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])

Every executable's run returns Outputs: a tuple in target order that also maps output names.

    >>> exe = g.compile(targets={"total": counter + x, "twice": x * 2})
    >>> out = exe.run({"x": np.ones(3, np.float32)})
    >>> out["twice"].tolist(), list(out.keys())
    ([2.0, 2.0, 2.0], ['total', 'twice'])
    >>> total, twice = out
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from . import dtypes as dt
from . import package
from .backends import get_backend
from .errors import IngotError
from .ir import Node, Op, Program, TensorType
from .options import CompileOptions
from .passes.device import device_steps
from .passes.memory_plan import plan_memory
from .passes.regions import find_regions
from .untrusted import checked_path
from .verify import verify


class State:
    """The variables of one sequence (one KV cache). An executable can serve many states.

    Each variable is one array for the life of the state: runs write into it, never replace it, so
    a reference taken from `state[name]` stays valid and in-place updates never copy the cache.
    """

    def __init__(self, values: dict[str, Any], initial: Mapping[str, np.ndarray] | None = None, owner=None):
        self.values = values
        self._initial = initial if initial is not None else {}
        self._owner = owner

    def __getitem__(self, name: str):
        if name not in self.values:
            raise IngotError(f"state: no variable named {name!r} (have {sorted(self.values)}).")
        return self.values[name]

    def __setitem__(self, name: str, value) -> None:
        """Overwrite a variable's contents (same shape; cast to the variable's dtype)."""
        old = self[name]
        value = np.asarray(value)
        if tuple(value.shape) != tuple(old.shape):
            raise IngotError(f"state: variable {name!r} has shape {tuple(old.shape)}, not {value.shape}.")
        if isinstance(old, np.ndarray):
            old[...] = value
        else:   # a device array (the CUDA backend's torch tensors): copied in, in place
            import torch
            old.copy_(torch.as_tensor(np.ascontiguousarray(value)).to(old.dtype))

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def keys(self):
        return self.values.keys()

    def reset(self) -> None:
        """Every variable back to its initial value, in place (a new sequence on the same memory)."""
        for name, initial in self._initial.items():
            self.values[name][...] = initial

    def __repr__(self) -> str:
        return f"<State {', '.join(f'{k}:{v.dtype}{list(v.shape)}' for k, v in self.values.items())}>"


class Outputs(tuple):
    """What `run` returns on every executable (built, loaded or imported): the outputs as a tuple in
    target order, so `(logits,) = exe.run(...)` and `exe.run(...)[0]` work, that also maps each
    output's name to its value, so `exe.run(...)["logits"]`, `.keys()`, `.items()` and `dict(out)` work.
    Iterating gives the values, as a tuple's does. Names come from `compile(targets={name: tensor})`,
    the ONNX graph's outputs, or else the target's own name or "output_I"."""

    def __new__(cls, names: Sequence[str], values: Sequence[Any]) -> "Outputs":
        self = super().__new__(cls, values)
        self._names = tuple(names)
        if len(self._names) != len(self):
            raise IngotError(f"Outputs: {len(self._names)} names for {len(self)} values.")
        return self

    @classmethod
    def named(cls, names: tuple[str, ...], values: Sequence[Any]) -> "Outputs":
        """Outputs of values under names already checked (a tuple, one distinct name per value): run's
        own path, without __new__'s checks."""
        self = tuple.__new__(cls, values)
        self._names = names
        return self

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self._names.index(key))
            except ValueError:
                raise KeyError(f"{key!r} is not an output (outputs: {list(self._names)})") from None
        return tuple.__getitem__(self, key)

    def __contains__(self, key) -> bool:
        return key in self._names if isinstance(key, str) else any(key is v for v in self)

    def keys(self) -> tuple[str, ...]:
        return self._names

    def values(self) -> tuple[Any, ...]:
        return tuple(self)

    def items(self) -> list[tuple[str, Any]]:
        return list(zip(self._names, self))

    def get(self, key: str, default=None):
        return self[key] if key in self._names else default

    def __repr__(self) -> str:
        return "Outputs(" + ", ".join(f"{n}={v!r}" for n, v in zip(self._names, self)) + ")"

    def __reduce__(self):
        return (Outputs, (self._names, tuple(self)))


def name_outputs(nodes: Sequence[Node], names: Sequence[str] | None = None) -> list[str]:
    """names when given (as many as nodes, distinct), else each node's own name or "output_I"."""
    if names is None:
        names = [n.name if n.name else f"output_{i}" for i, n in enumerate(nodes)]
        seen: dict[str, int] = {}
        for i, name in enumerate(names):  # a placeholder returned twice: the later ones get their index
            if name in seen:
                names[i] = f"{name}_{i}"
            seen[name] = i
    names = [str(n) for n in names]
    if len(names) != len(nodes) or len(set(names)) != len(names):
        raise IngotError(f"executable: output names {names} must be {len(nodes)} distinct names, one per output.")
    return names


class Executable:
    """A compiled graph. `run` takes feeds by placeholder name or tensor and returns the targets as
    Outputs (a tuple in target order that also maps output names)."""

    def __init__(self, program: Program, device: str = "cpu", callables: Mapping[str, "Executable"] | None = None,
                 history: Sequence[tuple[str, bool]] = (), inputs: Sequence[tuple[str, TensorType]] = (),
                 output_names: Sequence[str] | None = None, options: CompileOptions | None = None):
        """inputs: every (name, type) the caller declared, in order; compile may have made some of
        them unnecessary (a folded dim()), they are still accepted and checked, then not used.
        output_names: one per program output (default: the nodes' names, else "output_I").
        options: what it was compiled with (None: the defaults), `exe.options`; the backend reads them."""
        self.program = program
        self.output_names = name_outputs(program.outputs, output_names)
        self.options = options if options is not None else CompileOptions()
        self.device = device
        self.history = list(history)
        self.backend = get_backend(device)
        nodes = program.nodes()
        found = {n.name: n.type for n in nodes if n.op == Op.PLACEHOLDER}
        declared = dict(inputs)
        for name, t in found.items():
            if declared.setdefault(name, t) != t:
                raise IngotError(f"executable: input {name!r} is declared as {declared[name]} but the program reads {t}.")
        self.feed_order: list[str] = list(declared)
        self.feed_types: dict[str, TensorType] = declared
        self._used_inputs = frozenset(found)
        self._host_feeds = getattr(self.backend, "name", None) == "cpu"   # from_host is the identity there
        # a feed of exactly this storage dtype and shape needs no check_feed (small models run in ~0.1 ms)
        self._exact_feeds = {name: (np.dtype(t.dtype.storage), dt.storage_shape(t.shape, t.dtype)) for name, t in declared.items()
                             if t.static}
        self.output_types = [n.type for n in program.outputs]
        self.call_sites: dict[str, Node] = {n.attrs["name"]: n for n in nodes if n.op == Op.CALL}
        self.call_sites.update({n.attrs[b]: n for n in nodes if n.op == Op.IF for b in ("then", "else")})
        self.callables: dict[str, Executable] = {}
        # called as hook(self, name) after each bind: keeps sites derived from another site's executable
        # in step with it (ingot.load: a tied head's embedding lookup, adapters.bind_lookups)
        self.bind_hooks: list = []
        for name, exe in (callables or {}).items():
            self.bind(name, exe)
        self.plan = self.backend.prepare(program, self)
        self._state: State | None = None

    # -- state ----------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """The default state, made on first use (an executable run only with explicit states never
        allocates one: prefill executables share the decoder's KV cache)."""
        if self._state is None:
            self._state = self.new_state()
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        self._state = value

    def new_state(self) -> State:
        """A fresh copy of every variable at its initial value, independent of every other state."""
        return State(self.backend.new_state(self.program), self.program.variables, owner=self)

    def _check_state(self, state: State) -> None:
        if not isinstance(state, State):
            raise IngotError(f"run: state must be an ingot State (from exe.new_state()), not {type(state).__name__}.")
        if state._owner is self:
            return
        for name, initial in self.program.variables.items():
            have = state.values.get(name)
            # a device state holds torch tensors: compare dtypes by name (torch.float32 ~ float32)
            if have is None or tuple(have.shape) != initial.shape or str(have.dtype).removeprefix("torch.") != initial.dtype.name:
                raise IngotError(f"run: the state does not hold variable {name!r} as {initial.dtype}{list(initial.shape)}; "
                                 "use a state made by this executable's new_state().")
        state._owner = self

    # -- callables ------------------------------------------------------------------------------
    def bind(self, name: str, executable: "Executable") -> None:
        """Bind (or re-bind) the executable a `call` site runs; the main graph is not recompiled.

        The executable must take the call's input types (in its input order) and return its
        output types; the swap costs a dictionary update.
        """
        site = self.call_sites.get(name)
        if site is None:
            raise IngotError(f"bind: this executable has no call named {name!r} (have {sorted(self.call_sites)}).")
        if not isinstance(executable, Executable):
            raise IngotError(f"bind: {name!r} needs a compiled ingot Executable, not {type(executable).__name__}.")
        if executable is self:
            raise IngotError(f"bind: an executable cannot call itself ({name!r}).")
        if executable.device != self.device:
            raise IngotError(f"bind: {name!r} is compiled for {executable.device!r} but this executable runs on {self.device!r}.")
        want_in = [s.type for s in site.src[1:]] if site.op == Op.IF else [s.type for s in site.src]
        want_out = list(site.type)
        have_in = [executable.feed_types[n] for n in executable.feed_order]
        have_out = executable.output_types
        if want_in != have_in or len(want_out) != len(have_out) or not all(_fits(h, w) for h, w in zip(have_out, want_out)):
            raise IngotError(f"bind: {name!r} takes {want_in} and returns {want_out}, "
                             f"but the executable takes {have_in} and returns {have_out}.")
        self.callables[name] = executable
        for hook in self.bind_hooks:
            hook(self, name)

    # -- running --------------------------------------------------------------------------------
    def run(self, feeds: Mapping[Any, Any] | Sequence[Any] = (), state: State | None = None, **options) -> Outputs:
        """Run once and return the targets as Outputs: a tuple in target order that also maps names.

        feeds: {name or placeholder tensor: array}, or a list in the order the placeholders were
        declared. state: the variables to read and update (default: `self.state`).
        """
        return Outputs(self.output_names, self.run_values(feeds, state, **options))

    __call__ = run

    def run_values(self, feeds: Mapping[Any, Any] | Sequence[Any] = (), state: State | None = None, **options):
        """run's outputs as the backend returns them (a list in target order), not wrapped as Outputs:
        for wrappers that convert them (OnnxExecutable) and build their own."""
        if state is None:
            state = self.state
        else:
            self._check_state(state)
        return self._run_plan(self._feeds(feeds), state, options)

    def _run_plan(self, values: dict[str, Any], state: State, options: Mapping[str, Any]):
        """The plan run on feeds already checked (`_feeds`' dict: the used inputs by name) and a checked state."""
        try:
            return self.plan.run(values, state.values, **options)
        except IngotError:
            raise
        except (ValueError, IndexError, TypeError, ArithmeticError, AssertionError) as e:
            raise IngotError(f"run: {type(e).__name__}: {e}") from e

    def _feeds(self, feeds) -> dict[str, Any]:
        if type(feeds) is dict and self._host_feeds:   # the common case in one pass (~1 us a run less)
            out = {}
            for name, value in feeds.items():
                exact = self._exact_feeds.get(name) if type(name) is str else None
                if exact is None or type(value) is not np.ndarray or value.dtype != exact[0] or value.shape != exact[1]:
                    break
                if name in self._used_inputs:
                    out[name] = value
            else:
                if len(feeds) == len(self.feed_order):   # (the names are distinct, all inputs: none missing)
                    return out
        if isinstance(feeds, Mapping):
            named = {}
            for key, value in feeds.items():
                name = key if isinstance(key, str) else getattr(getattr(key, "node", None), "name", None)
                if name not in self.feed_types:
                    raise IngotError(f"run: {key!r} is not an input of this executable (inputs: {self.feed_order}).")
                named[name] = value
        else:
            if isinstance(feeds, np.ndarray):
                feeds = [feeds]
            feeds = list(feeds)
            if len(feeds) != len(self.feed_order):
                raise IngotError(f"run: expected {len(self.feed_order)} inputs ({self.feed_order}), got {len(feeds)}.")
            named = dict(zip(self.feed_order, feeds))
        missing = [n for n in self.feed_order if n not in named]
        if missing:
            raise IngotError(f"run: missing feeds {missing}.")
        out = {}
        for name, value in named.items():
            exact = self._exact_feeds.get(name)
            if exact is not None and type(value) is np.ndarray and value.dtype == exact[0] and value.shape == exact[1]:
                if name in self._used_inputs:
                    out[name] = self.backend.from_host(value, self.feed_types[name])
                continue
            t = self.feed_types[name]
            if self.device == "cpu" or not hasattr(value, "__dlpack__") or isinstance(value, np.ndarray):
                value = check_feed(name, value, t)  # device arrays are checked by their backend
            if name in self._used_inputs:
                out[name] = self.backend.from_host(value, t)
        return out

    # -- inspection -----------------------------------------------------------------------------
    @property
    def regions(self) -> list[list[Node]]:
        """The fusion regions of the compiled program, each a list of nodes, sources first."""
        by_id = {n.id: n for n in self.program.nodes()}
        return [[by_id[i] for i in region if i in by_id] for region in self.program.regions]

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write a package directory (see ingot.package); atomic: all of it or nothing."""
        package.save(self, path)

    def __repr__(self) -> str:
        return (f"<Executable {self.device} inputs={[f'{n}:{t}' for n, t in self.feed_types.items()]} "
                f"outputs={self.output_types} nodes={len(self.program.nodes())}>")


def load(path, device: str | None = None, options: CompileOptions | None = None) -> Executable:
    """Load a package written by Executable.save (ingot.package); weights stay memory-mapped. options:
    CompileOptions instead of the ones it stores (for it and its callables)."""
    from pathlib import Path

    path = Path(checked_path(path, "package"))
    if not path.is_dir():
        raise IngotError(f"package: {path} does not exist or is not a package directory.")
    program, manifest, graph = package.read_package(path)
    options = options if options is not None else package.options_of(path, manifest)
    history = [(str(h[0]), bool(h[1])) for h in graph.get("history", []) if isinstance(h, list) and len(h) == 2]
    device = device or manifest.get("device", "cpu")
    # compiled for another device: this device's fusions run now (and the regions after them)
    missing = [(name, step) for name, step in device_steps(device, options) if name not in {h[0] for h in history}]
    try:
        for name, step in missing:
            program, changed = step(program)
            verify(program)
            history.append((name, changed))
    except IngotError as e:
        raise IngotError(f"package: {path} cannot be compiled for {device}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise IngotError(f"package: {path} cannot be compiled for {device}: graph.json holds a graph its passes "
                         f"cannot rewrite ({type(e).__name__}: {' '.join(str(e).split())[:200]}).") from None
    if missing:
        program, _ = find_regions(program)
    # the memory plan is derived data: rebuild it rather than trust sizes read from a file
    regions = program.regions
    program, _ = plan_memory(program)
    program.regions = regions
    callables = {name: load(path / "callables" / f"{name}.ingot", device, options)
                 for name in package.callable_names(path, manifest)}
    try:
        return Executable(program, device=device, callables=callables, history=history, inputs=graph["inputs"],
                          output_names=graph.get("output_names"), options=options)
    except IngotError as e:
        raise IngotError(f"package: {path} cannot be loaded: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # graph.json attributes of a form the backend cannot plan (a slice start of null, say)
        raise IngotError(f"package: {path} cannot be loaded: graph.json holds attributes the {device} backend cannot use "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]}).") from None


def _fits(have: TensorType, want: TensorType) -> bool:
    """have is want, a dynamic dimension of want matching any size."""
    return (have.dtype == want.dtype and have.rank == want.rank
            and all(w is None or h == w for h, w in zip(have.shape, want.shape)))


def check_feed(name: str, value, t: TensorType):
    """The feed as an array of the placeholder's storage dtype and shape, or IngotError.

    Casts only where no value changes kind: floats to the float dtype (float64 -> float32, as
    Python floats are), integers that fit to the integer dtype, complex128 to complex64.
    """
    array = np.asarray(value)
    want = t.dtype.storage
    shape = dt.storage_shape(t.shape, t.dtype)
    if array.dtype != want:
        have_kind = "f" if array.dtype.name == "bfloat16" else array.dtype.kind
        if t.dtype.packed or not (have_kind == t.dtype.kind or (have_kind in "iu" and t.dtype.kind in "iu")):
            raise IngotError(f"run: feed {name!r} has dtype {array.dtype}, expected {t.dtype.name}"
                             + (" (packed two per byte as uint8)." if t.dtype.packed else "."))
        if t.dtype.kind in "iu" and array.size:
            info = np.iinfo(want)
            lo, hi = array.min(), array.max()
            if lo < info.min or hi > info.max:
                raise IngotError(f"run: feed {name!r} holds values {lo}..{hi} that do not fit {t.dtype.name}.")
        array = array.astype(want)
    if array.shape != shape:
        raise IngotError(f"run: feed {name!r} has shape {array.shape}, expected {shape}"
                         + (f" (the packed storage of {t})." if t.dtype.packed else "."))
    return array
