"""ONNX ops whose output shape depends on the values they read (NonZero, Unique, NonMaxSuppression),
run as a host step between two compiled stages.

Ingot compiles static shapes. Where such an op's inputs are known at import it is computed then (a
constant). Otherwise the import stops at it (NeedsHostStep) and from_onnx builds a
StagedOnnxExecutable from two models cut out of the file:
- stage A: the nodes that compute the op's inputs, compiled as usual;
- the host step: the op itself, run by onnx's reference implementation (onnx.reference) on A's
  outputs, which gives its outputs with their value-dependent shapes;
- stage B: the rest of the model, with the op's outputs as inputs of symbolic shape, which
  from_onnx compiles per shape (SpecializingOnnxExecutable: a new count of non-zeros or of kept
  boxes compiles once, later runs with a count seen before reuse it).
Either stage may hold another such op (it is staged again). Only ops of the main graph are staged;
one inside an If branch or a Loop body is refused.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import IngotError
from ..runtime import Outputs
from .onnx_control import outer_names
from .onnx_ops import Context, OnnxNode, UnsupportedOnnx, converter, named_feeds

HOST_OPS = ("NonZero", "Unique", "NonMaxSuppression")


class NeedsHostStep(UnsupportedOnnx):
    """The import met an op whose output shape depends on values computed at run time."""

    def __init__(self, message: str, outputs: Sequence[str]):
        super().__init__(message)
        self.outputs = list(outputs)


def _reference_node(op_type: str, present: Sequence[bool], attrs: Mapping[str, Any], n_outputs: int, opset: int):
    """The op as a one-node onnx.reference evaluator: inputs "in0", "in1", ... (those present)."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    proto = helper.make_node(op_type, [f"in{i}" if p else "" for i, p in enumerate(present)],
                             [f"out{i}" for i in range(n_outputs)], **attrs)
    return ReferenceEvaluator(proto, opsets={"": opset}) if opset else ReferenceEvaluator(proto)


def host_converter(ctx: Context, node: OnnxNode):
    values = [None if t is None else ctx.value(t) for t in node.inputs]
    if all(v is not None for v, t in zip(values, node.inputs) if t is not None):   # known at import: computed now
        feeds = {f"in{i}": v for i, v in enumerate(values) if v is not None}
        outs = _reference_node(node.op_type, [t is not None for t in node.inputs], node.attrs, len(node.outputs),
                               node.opset).run(None, feeds)
        return [ctx.g.constant(np.asarray(o)) for o in outs]
    where = " inside an If branch" if ctx.in_branch else ""
    raise NeedsHostStep(f"{ctx.what}: {node.label}: its output shape depends on values computed at run time{where}; "
                        "Ingot runs it as a host step between two compiled stages, for an op of the main graph only.",
                        node.outputs)


for _op in HOST_OPS:
    converter(_op)(host_converter)


def _pruned(model, outputs: Sequence[str], drop: Sequence[str] = (), new_inputs: Sequence = ()):
    """A copy of model computing only `outputs` (ONNX names), without the nodes producing `drop`, and
    with `new_inputs` (ValueInfoProtos) added to its inputs."""
    m = copy.deepcopy(model)
    graph = m.graph
    nodes = [n for n in graph.node if not any(o in drop for o in n.output)]
    need, keep = set(outputs), set()
    changed = True
    while changed:   # (consumers first: one pass for nodes in graph order)
        changed = False
        for i, n in reversed(list(enumerate(nodes))):
            if i not in keep and any(o in need for o in n.output):
                keep.add(i)
                reads = list(n.input) + [name for a in n.attribute
                                         for sub in ([a.g] if a.type == a.GRAPH else list(a.graphs)) for name in outer_names(sub)]
                need.update(r for r in reads if r)
                changed = True
    del graph.node[:]
    graph.node.extend(n for i, n in enumerate(nodes) if i in keep)
    by_name = {vi.name: vi for vi in list(graph.output) + list(graph.value_info)}
    del graph.output[:]
    graph.output.extend(copy.deepcopy(by_name[name]) if name in by_name else _untyped(name) for name in outputs)
    graph.input.extend(new_inputs)
    return m


def _untyped(name: str):
    from onnx import ValueInfoProto
    return ValueInfoProto(name=name)


class StagedOnnxExecutable:
    """Stage A, a host step, stage B (see the module docstring); `run` takes and returns what
    OnnxExecutable's does."""

    def __init__(self, model, outputs: Sequence[str], compile_stage):
        """outputs: the host op's output names; compile_stage(model) -> an executable (from_onnx with the
        caller's device and options)."""
        host = [n for n in model.graph.node if any(o and o in outputs for o in n.output)]
        if len(host) != 1:
            raise IngotError(f"the node computing {list(outputs)} is not in the main graph: Ingot stages value-dependent ops "
                             "of the main graph only (not inside If branches or Loop bodies).")
        (self.node,) = host
        self.model, self.compile_stage = model, compile_stage
        initializers = {i.name for i in model.graph.initializer}
        self.onnx_inputs = [vi.name for vi in model.graph.input if vi.name not in initializers]
        self.output_names = [vi.name for vi in model.graph.output]
        self.host_inputs = [name for name in self.node.input]
        self.first = compile_stage(_pruned(model, [n for n in self.host_inputs if n]))
        opset = {o.domain: o.version for o in model.opset_import}.get("", 0)
        from onnx import helper
        attrs = {a.name: helper.get_attribute_value(a) for a in self.node.attribute}
        self.host_step = _reference_node(self.node.op_type, [bool(n) for n in self.host_inputs], attrs,
                                         len(self.node.output), opset)
        self.second = None

    def _second(self, produced: Mapping[str, np.ndarray]):
        from onnx import helper
        new_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                    [f"{name}_dim{i}" for i in range(value.ndim)])
                      for name, value in produced.items()]
        model = _pruned(self.model, self.output_names, drop=list(produced), new_inputs=new_inputs)
        return self.compile_stage(model)

    def run(self, feeds: Mapping[str, Any] | Sequence[Any] = (), state=None, **options) -> Outputs:
        """Run once: feeds by ONNX input name (or a list in the model's input order); returns Outputs."""
        feeds = named_feeds(feeds, self.onnx_inputs)
        first = self.first.run({k: v for k, v in feeds.items() if k in self.first.onnx_inputs}, **options)
        host_feeds = {f"in{i}": first[name] for i, name in enumerate(self.host_inputs) if name}
        outs = self.host_step.run(None, host_feeds)
        produced = {name: np.asarray(v) for name, v in zip(self.node.output, outs) if name}
        if self.second is None:
            self.second = self._second(produced)
        second_feeds = {**{k: v for k, v in feeds.items() if k in self.second.onnx_inputs}, **produced}
        return self.second.run({k: v for k, v in second_feeds.items() if k in self.second.onnx_inputs}, **options)

    __call__ = run_named = run   # run_named: feeds already by name (SpecializingOnnxExecutable's), which run takes too

    def __repr__(self) -> str:
        return f"<StagedOnnxExecutable inputs={self.onnx_inputs} host step {self.node.op_type} {list(self.node.output)}>"
