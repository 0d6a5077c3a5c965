"""The IR: the Op enum, TensorType, Node and Program (the verifier is ingot.verify).

A Node is small and immutable: (op, type, src, attrs, name). Passes make new nodes with
`node.replace(...)`; they never mutate one. A Program is what the compiler works on: the outputs
it must produce, the ASSIGN nodes it must run, and the constant and variable stores.
"""
from __future__ import annotations

import enum
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from . import dtypes as dt


class Op(enum.IntEnum):
    """Every op of the IR. Serialised by name; append only."""

    # sources and state
    PLACEHOLDER = enum.auto(); CONSTANT = enum.auto(); VARIABLE = enum.auto(); ASSIGN = enum.auto()
    # elementwise, binary
    ADD = enum.auto(); SUB = enum.auto(); MUL = enum.auto(); DIV = enum.auto(); POW = enum.auto()
    MAXIMUM = enum.auto(); MINIMUM = enum.auto()
    EQUAL = enum.auto(); NOT_EQUAL = enum.auto(); LESS = enum.auto(); LESS_EQUAL = enum.auto()
    GREATER = enum.auto(); GREATER_EQUAL = enum.auto()
    LOGICAL_AND = enum.auto(); LOGICAL_OR = enum.auto(); LOGICAL_XOR = enum.auto()
    # elementwise, unary
    NEG = enum.auto(); ABS = enum.auto(); EXP = enum.auto(); LOG = enum.auto(); SQRT = enum.auto()
    RSQRT = enum.auto(); TANH = enum.auto(); SIGMOID = enum.auto(); SILU = enum.auto(); GELU = enum.auto()
    ERF = enum.auto(); SIN = enum.auto(); COS = enum.auto(); LOGICAL_NOT = enum.auto(); CAST = enum.auto()
    # elementwise, ternary
    WHERE = enum.auto()
    # reductions
    SUM = enum.auto(); MEAN = enum.auto(); MAX = enum.auto(); MIN = enum.auto(); ARGMAX = enum.auto()
    SOFTMAX = enum.auto(); LOG_SOFTMAX = enum.auto()
    # shape
    RESHAPE = enum.auto(); TRANSPOSE = enum.auto(); BROADCAST_TO = enum.auto(); CONCAT = enum.auto()
    PAD = enum.auto(); GATHER = enum.auto(); SLICE = enum.auto(); SLICE_UPDATE = enum.auto()
    ARRAY_VIEW = enum.auto()
    # linear algebra and nn
    MATMUL = enum.auto(); RMS_NORM = enum.auto(); LAYER_NORM = enum.auto(); ROPE = enum.auto()
    SDPA = enum.auto()
    # quantization
    QUANTIZE = enum.auto(); DEQUANTIZE = enum.auto(); QUANTIZED_MATMUL = enum.auto()
    QUANTIZED_GATHER = enum.auto()
    # fft
    FFT = enum.auto(); IFFT = enum.auto(); RFFT = enum.auto(); IRFFT = enum.auto()
    # calls
    CALL = enum.auto(); GET_ITEM = enum.auto()
    # later additions go here, at the end
    ARGMIN = enum.auto(); REAL = enum.auto(); IMAG = enum.auto(); COMPLEX = enum.auto()
    DIM = enum.auto()
    FUSED = enum.auto()   # a named subgraph a device pass chose to run as one step (ops/fused.py)
    CONV = enum.auto()    # N-d convolution with optional bias (ops/conv.py)
    # mixture-of-experts routing (ops/moe.py)
    TOP_K = enum.auto(); TAKE_ALONG_AXIS = enum.auto(); GATHER_MATMUL = enum.auto()
    QUANTIZED_GATHER_MATMUL = enum.auto()
    # ONNX breadth: a cast to a format Ingot stores wider (float8, float4, int4, int2), more unary math,
    # bitwise ops, float mod, a product reduction (ops/elementwise.py, reduce.py)
    NARROW_CAST = enum.auto()
    FLOOR = enum.auto(); CEIL = enum.auto(); ROUND = enum.auto(); TAN = enum.auto(); ASIN = enum.auto()
    ACOS = enum.auto(); ATAN = enum.auto(); SINH = enum.auto(); COSH = enum.auto(); ASINH = enum.auto()
    ACOSH = enum.auto(); ATANH = enum.auto()
    BITWISE_AND = enum.auto(); BITWISE_OR = enum.auto(); BITWISE_XOR = enum.auto(); BITWISE_NOT = enum.auto()
    SHIFT_LEFT = enum.auto(); SHIFT_RIGHT = enum.auto()
    PROD = enum.auto(); MOD = enum.auto()
    RNN = enum.auto(); LSTM = enum.auto(); GRU = enum.auto()   # recurrent layers (ops/recurrent.py)
    CUMPROD = enum.auto(); BITCAST = enum.auto(); DET = enum.auto(); GRID_SAMPLE = enum.auto()
    IF = enum.auto()      # one of two bound callables, chosen by a run-time condition (ops/control.py)
    # tensor parallelism: collectives over the ranks of a process group (ops/collective.py)
    ALL_REDUCE = enum.auto(); ALL_GATHER = enum.auto()
    POOL_ATTENTION = enum.auto()   # decode attention of independent rows over a KV pool (ops/pool.py)
    BLOCK_CHANNELS = enum.auto(); UNBLOCK_CHANNELS = enum.auto()   # [N, C, ...] <-> [N, C/16, ..., 16] (ops/layout.py)


class GroupOp:
    """Sets of ops that share a rule."""

    Binary = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAXIMUM, Op.MINIMUM})
    Compare = frozenset({Op.EQUAL, Op.NOT_EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL})
    Logical = frozenset({Op.LOGICAL_AND, Op.LOGICAL_OR, Op.LOGICAL_XOR})
    Unary = frozenset({Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.TANH, Op.SIGMOID, Op.SILU,
                       Op.GELU, Op.ERF, Op.SIN, Op.COS, Op.LOGICAL_NOT, Op.CAST, Op.REAL, Op.IMAG})
    Elementwise = Binary | Compare | Logical | Unary | {Op.WHERE, Op.COMPLEX}
    Reduce = frozenset({Op.SUM, Op.MEAN, Op.MAX, Op.MIN, Op.ARGMAX, Op.ARGMIN})
    Normalize = frozenset({Op.SOFTMAX, Op.LOG_SOFTMAX, Op.RMS_NORM, Op.LAYER_NORM})
    # ops whose output may share memory with input 0 (no data is moved)
    View = frozenset({Op.RESHAPE, Op.TRANSPOSE, Op.BROADCAST_TO, Op.ARRAY_VIEW, Op.SLICE})
    Source = frozenset({Op.PLACEHOLDER, Op.CONSTANT, Op.VARIABLE})
    Fft = frozenset({Op.FFT, Op.IFFT, Op.RFFT, Op.IRFFT})
    # ops every rank must run, in the same order: never folded, merged or reordered across ranks
    Collective = frozenset({Op.ALL_REDUCE, Op.ALL_GATHER})


Dim = int | None  # None: dynamic, fixed when the graph is compiled


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of a tensor. A dimension of None is dynamic."""

    shape: tuple[Dim, ...]
    dtype: dt.DType = dt.float32

    def __init__(self, shape: Iterable[Dim], dtype: dt.DType = dt.float32):
        object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in shape))
        object.__setattr__(self, "dtype", dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def static(self) -> bool:
        return all(d is not None for d in self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)   # (Python integers: ~0.2 us, np.prod ~3 us; the import asks per op)

    @property
    def nbytes(self) -> int:
        return int(np.prod(dt.storage_shape(self.shape, self.dtype), dtype=np.int64)) * self.dtype.storage.itemsize

    def __repr__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name}[{dims}]"


@dataclass(frozen=True)
class Ref:
    """An attribute value that is read at run time from src[index] (a scalar integer tensor)."""

    index: int


_ids = itertools.count()
_set = object.__setattr__   # (Node's own attributes, set once: Node forbids setattr)
_FIELDS = frozenset({"op", "type", "src", "attrs", "name", "origin"})   # what Node.replace may change


class Node:
    """One op application. Immutable; compare by identity, CSE by `key()`."""

    __slots__ = ("op", "type", "src", "attrs", "name", "id", "origin")

    def __init__(self, op: Op, type: TensorType | tuple[TensorType, ...], src: tuple["Node", ...] = (),
                 attrs: dict[str, Any] | None = None, name: str | None = None, origin: int | None = None):
        _set(self, "op", op)
        _set(self, "type", type)
        _set(self, "src", tuple(src))
        _set(self, "attrs", dict(attrs or {}))
        _set(self, "name", name)
        node_id = next(_ids)
        _set(self, "id", node_id)
        # the id of the node this one was first made as, through every replace(): which node of an
        # earlier program it is (the viewer outlines a fused op's members in the unfused graph by it)
        _set(self, "origin", node_id if origin is None else origin)

    def __setattr__(self, *_):
        raise AttributeError("Node is immutable; use replace()")

    def replace(self, **changes) -> "Node":
        if not changes.keys() <= _FIELDS:
            raise TypeError(f"Node.replace: no fields {sorted(changes.keys() - _FIELDS)}")
        node = Node.__new__(Node)
        _set(node, "op", changes.get("op", self.op))
        _set(node, "type", changes.get("type", self.type))
        _set(node, "src", tuple(changes["src"]) if "src" in changes else self.src)
        # attrs are never mutated: an unchanged dict is shared (verify's record knows a rebuilt node by it)
        _set(node, "attrs", dict(changes["attrs"] or {}) if "attrs" in changes else self.attrs)
        _set(node, "name", changes.get("name", self.name))
        _set(node, "id", next(_ids))
        _set(node, "origin", changes.get("origin", self.origin))
        if node.origin is None:
            _set(node, "origin", node.id)
        return node

    def key(self) -> tuple:
        """Structural identity given the identity of the sources (CSE uses it)."""
        return (self.op, self.type, tuple(s.id for s in self.src), freeze(self.attrs))

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.type.shape

    @property
    def dtype(self) -> dt.DType:
        return self.type.dtype

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<{self.op.name}{name} #{self.id} {self.type}>"


def freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if hasattr(value, "structural_key"):   # a fused op's body (ops/fused.py)
        return value.structural_key()
    return value


@dataclass
class Program:
    """What the compiler transforms: outputs to compute, assigns to run, and the stores they use."""

    outputs: list[Node]
    assigns: list[Node] = field(default_factory=list)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    variables: dict[str, np.ndarray] = field(default_factory=dict)  # initial values
    # annotations added by late passes, read by backends and the viewer
    regions: list[tuple[int, ...]] = field(default_factory=list)   # node ids per fused region
    memory_plan: dict[int, int] = field(default_factory=dict)      # node id -> buffer index
    memory_offsets: dict[int, int] = field(default_factory=dict)   # node id -> byte offset there (else 0)
    buffer_sizes: list[int] = field(default_factory=list)

    @property
    def roots(self) -> list[Node]:
        return list(self.outputs) + list(self.assigns)

    def nodes(self) -> list[Node]:
        return list(_order(tuple(self.roots)))

    def with_roots(self, outputs: list[Node], assigns: list[Node]) -> "Program":
        return Program(list(outputs), list(assigns), self.constants, self.variables)


@functools.lru_cache(maxsize=8)
def _order(roots: tuple[Node, ...]) -> tuple[Node, ...]:
    """toposort of roots, remembered for the latest programs: nodes are immutable, so the same roots give
    the same order, and a compile asks it of one program many times (every pass, the verifier after
    each, fusions; a pass that changes nothing keeps the roots): PP-OCRv4's detector sorted its ~1,000
    nodes 140 times a compile."""
    return tuple(toposort(roots))


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Nodes reachable from roots, every node after its sources (iterative DFS, stable order)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if root.id in seen:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if i < len(node.src):
                stack.append((node, i + 1))
                child = node.src[i]
                if child.id not in seen:
                    stack.append((child, 0))
            elif node.id not in seen:
                seen.add(node.id)
                order.append(node)
    return order


def consumers(nodes: list[Node]) -> dict[int, list[Node]]:
    users: dict[int, list[Node]] = {n.id: [] for n in nodes}
    for n in nodes:
        for s in n.src:
            users.setdefault(s.id, []).append(n)
    return users
