"""CudaPlan: a program lowered to a flat list of device steps, captured as a CUDA graph once it repeats.

The plan only lowers by table (lowerings.py by op, fused_lowerings.py by fused kind), allocates value
slots, and captures and replays graphs; what runs as one kernel the compiler's device passes decided
(FUSED ops in the program). Elementwise regions (the regions pass) run as one generated kernel each.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import dtypes as dt
from ...errors import IngotError
from ...ir import GroupOp, Node, Op, Program, TensorType
from ...options import CompileOptions
from ...passes.fold import widens_weight
from . import fused
from .device import constant_tensor, to_device, torch_dtype
from .fused_lowerings import lower
from .lowerings import Lowering, StepFn, _call, _shares, _ZeroAhead, narrow_weight


class CudaPlan:
    """A program lowered to a flat list of device steps; captured as a CUDA graph once it repeats."""

    def __init__(self, program: Program, executable, device: torch.device, options=None):
        self.program = program
        self.device = device
        self.options = options if isinstance(options, CompileOptions) else CompileOptions()
        self.host_syncs: list[str] = []
        self.call_names: list[str] = []   # the call sites whose bound executables run inside a step
        self._executable = executable
        nodes = program.nodes()
        self.nodes = nodes
        self.slot = {n.id: i for i, n in enumerate(nodes)}
        by_id = {n.id: n for n in nodes}
        users: dict[int, list[Node]] = {n.id: [] for n in nodes}
        for n in nodes:
            for s in n.src:
                users[s.id].append(n)
        roots = {n.id for n in program.roots}
        self.initial: list[Any] = [None] * len(nodes)
        self.feed_slots: list[tuple[str, int, TensorType]] = []
        self.variable_slots: list[tuple[str, int]] = []
        steps: list[tuple[StepFn, tuple[int, ...], tuple[int, ...], str]] = []
        done: set[int] = set()          # nodes whose value no step needs to compute
        self.fusions: list[str] = []
        self._zero_ahead: _ZeroAhead | None = None   # the last step that can zero the next GEMV's output
        self._rope_tables: dict[tuple, tuple] = {}   # RoPE's inverse frequencies and cos/sin tables by (freqs, rows)

        # fused elementwise regions (the regions pass): the root's step computes the region from its inputs
        region_root: dict[int, fused.RegionKernel] = {}
        chosen = self.options.fusions
        for region in (program.regions if chosen is None or "regions" in chosen else ()):
            members = [by_id[i] for i in region if i in by_id]
            if len(members) < 2 or not fused.region_supported(members):
                continue
            if any(m.id in roots for m in members[:-1]):
                continue
            kernel = fused.RegionKernel(members, torch_dtype)
            region_root[members[-1].id] = kernel
            done.update(m.id for m in members[:-1])
            self.fusions.append("region " + "+".join(m.op.name.lower() for m in members))

        # a bf16 weight's cast to float32 that only matmuls read: they multiply the narrow weight
        for n in nodes:
            if widens_weight(n) and n.id not in roots and users[n.id] and \
                    all(u.op == Op.MATMUL and u.src[1] is n and u.src[0] is not n and narrow_weight(u) is not None
                        for u in users[n.id]):
                done.add(n.id)

        for node in nodes:
            s = self.slot[node.id]
            if node.op == Op.CONSTANT:
                self.initial[s] = program.constants[node.attrs["key"]]  # uploaded below if a step reads it
                continue
            if node.op == Op.PLACEHOLDER:
                self.feed_slots.append((node.name, s, node.type))
                continue
            if node.op == Op.VARIABLE:
                self.variable_slots.append((node.attrs["name"], s))
                continue
            if node.op == Op.ASSIGN or node.id in done:
                continue
            if node.id in region_root:
                kernel = region_root[node.id]
                steps.append((kernel, tuple(self.slot[x.id] for x in kernel.inputs), (s,), "region"))
                continue
            ctx = Lowering(self, node)
            fn, name = (_call(ctx, executable), "call") if node.op in (Op.CALL, Op.IF) else lower(ctx)
            reads = node.src if ctx.reads is None else [node.src[i] for i in ctx.reads]
            steps.append((fn, tuple(self.slot[x.id] for x in reads), self._outputs(node, users, done), name))

        # upload only the constants a step reads (packed weights live re-packed in the kernels' cache)
        read = {i for _, ins, _, _ in steps for i in ins}
        read |= {self.slot[n.id] for n in program.outputs} | {self.slot[a.src[1].id] for a in program.assigns}
        for n in nodes:
            if n.op == Op.CONSTANT:
                s = self.slot[n.id]
                self.initial[s] = constant_tensor(self.initial[s], device) if s in read else None

        # free each slot after its last reader, unless an output or an assign needs it
        keep = {self.slot[n.id] for n in program.roots} | {self.slot[a.src[1].id] for a in program.assigns}
        keep |= {self.slot[n.id] for n in nodes if n.op in GroupOp.Source}
        last: dict[int, int] = {}
        for i, (_, ins, _, _) in enumerate(steps):
            for x in ins:
                last[x] = i
        frees: list[list[int]] = [[] for _ in steps]
        for x, i in last.items():
            if x not in keep:
                frees[i].append(x)
        for i, (_, _, outs, _) in enumerate(steps):   # what no step reads (a fused op's unread output)
            frees[i] += [x for x in outs if x not in last and x not in keep]
        self.steps = [(fn, ins, outs, tuple(fr)) for (fn, ins, outs, _), fr in zip(steps, frees)]
        self.step_names = [name for *_, name in steps]
        self.output_slots = [self.slot[n.id] for n in program.outputs]
        self.assign_slots = [(a.src[0].attrs["name"], self.slot[a.src[1].id]) for a in program.assigns]
        base: dict[int, Node] = {}
        for n in nodes:
            base[n.id] = base[n.src[0].id] if (n.op in GroupOp.View or n.attrs.get("inplace")) and n.src else n
        # an output must not be memory a later run changes (a variable, a staged feed) or a constant
        self.output_copies = [i for i, n in enumerate(program.outputs)
                              if base[n.id].op in (Op.VARIABLE, Op.CONSTANT, Op.PLACEHOLDER)]
        self.capturable = device.type == "cuda" and not self.host_syncs and self.options.cuda.graphs and \
            all(isinstance(n.type, (TensorType, tuple)) and (n.op in (Op.CALL, Op.IF) or _static(n.type)) for n in nodes)
        self._graphs: dict[int, dict] = {}
        self._runs: dict[int, int] = {}
        self._stage = None

    def _outputs(self, node: Node, users: dict[int, list[Node]], done: set[int]) -> tuple[int, ...]:
        """The slots a step writes: its node's, or for a fused op of several outputs the slots of the
        GET_ITEMs that read them (which then need no step), a fresh slot for an output nobody reads."""
        if node.op != Op.FUSED or not isinstance(node.type, tuple):
            return (self.slot[node.id],)
        items: dict[int, Node] = {}
        for u in users[node.id]:
            if u.op != Op.GET_ITEM or u.attrs["index"] in items:
                return (self.slot[node.id],)   # read whole, or one output twice: GET_ITEM steps take it apart
            items[u.attrs["index"]] = u
        outs = []
        for i in range(len(node.type)):
            if i in items:
                outs.append(self.slot[items[i].id])
                done.add(items[i].id)
            else:
                outs.append(len(self.initial))
                self.initial.append(None)
        return tuple(outs)

    # -- running --------------------------------------------------------------------------------
    def _execute(self, feeds: dict[str, torch.Tensor], state: dict[str, torch.Tensor], copy_outputs: bool = True):
        vals = list(self.initial)
        for name, s, _ in self.feed_slots:
            vals[s] = feeds[name]
        for name, s in self.variable_slots:
            vals[s] = state[name]
        for fn, ins, outs, frees in self.steps:
            result = fn(*[vals[i] for i in ins])
            if len(outs) == 1:
                vals[outs[0]] = result
            else:
                for o, r in zip(outs, result):
                    vals[o] = r
            for f in frees:
                vals[f] = None
        outputs = [vals[s] for s in self.output_slots]
        if copy_outputs:
            for i in self.output_copies:
                outputs[i] = outputs[i].clone()
        if self.assign_slots:
            _assign(state, [(name, vals[s]) for name, s in self.assign_slots])
        return outputs

    def _device_feeds(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in feeds.items():
            out[name] = value.to(self.device) if isinstance(value, torch.Tensor) else to_device(value, self.device)
        return out

    def _staging(self):
        """Static device buffers for the feeds (a captured graph reads them) and a pinned host mirror."""
        if self._stage is None:
            layout, total = {}, 0
            for name, _, t in self.feed_slots:
                nbytes = max(t.nbytes, 1)
                layout[name] = (total, nbytes, t)
                total += -(-nbytes // 64) * 64
            device_buf = torch.empty(max(total, 64), dtype=torch.uint8, device=self.device)
            host_buf = torch.empty(max(total, 64), dtype=torch.uint8, pin_memory=True)
            views, host_views = {}, {}
            for name, (off, nbytes, t) in layout.items():
                shape = dt.storage_shape(t.shape, t.dtype) if t.shape else ()
                views[name] = device_buf[off:off + t.nbytes].view(torch_dtype(t.dtype)).view(shape)
                host_views[name] = host_buf[off:off + t.nbytes].numpy()
            self._stage = dict(device=device_buf, host=host_buf, views=views, host_views=host_views,
                               event=torch.cuda.Event(), copied=False)
        return self._stage

    def _stage_feeds(self, feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The staging buffer's views, the given feeds copied in (host arrays through the pinned mirror)."""
        stage = self._staging()
        if stage["copied"]:
            stage["event"].synchronize()  # the last copy out of the pinned buffer has finished
        host_feeds = False
        for name, value in feeds.items():
            if isinstance(value, torch.Tensor):
                stage["views"][name].copy_(value, non_blocking=True)
            else:
                a = np.ascontiguousarray(value)
                stage["host_views"][name][...] = a.reshape(-1).view(np.uint8) if a.size else 0
                host_feeds = True
        if host_feeds:
            stage["device"].copy_(stage["host"], non_blocking=True)
            stage["event"].record()
            stage["copied"] = True
        return stage["views"]

    def _in_place(self, value) -> bool:
        """A feed the steps read where it lies: contiguous device memory of the plan's device."""
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type and value.is_contiguous() and \
            (self.device.index is None or value.device.index == self.device.index)

    def run(self, feeds: dict[str, Any], state: dict[str, torch.Tensor], stream=None, outputs=None, graph: bool = True,
            **options) -> list[torch.Tensor]:
        """stream: the caller's CUDA stream (torch, or any object with a `ptr`/`cuda_stream`, or a raw
        handle): every copy, kernel and graph replay of this run is queued on it, after the caller's
        work. outputs: device arrays (any DLPack producer) that receive the targets, so the run
        allocates nothing on the device; they are returned (as torch views of the same memory).

        Device feeds are read in place, never copied: the CUDA graph of a state is captured over the
        feeds' addresses, so a caller that refills the same buffers replays it with no copy; new
        addresses run eagerly once, then get a graph of their own (four kept). graph=False: always eager,
        nothing captured (a caller whose states change from run to run: `ingot serve`'s prefill into any of
        its slots would capture, and evict, a graph per slot)."""
        if stream is not None:
            with torch.cuda.stream(_torch_stream(stream, self.device)):
                return self.run(feeds, state, outputs=outputs, graph=graph, **options)
        direct = {name: v for name, v in feeds.items() if self._in_place(v)}
        staged = {name: v for name, v in feeds.items() if name not in direct}
        self.last_feed_pointers = {name: v.data_ptr() for name, v in direct.items()}
        # callees None: a call site unbound (the eager run says so) or bound to one that cannot be captured
        callees = self.bound_callees() if self.capturable and graph else None
        if callees is None:
            values = self._device_feeds(staged)
            values.update(direct)
            return _deliver(self._execute(values, state), outputs, fresh=True)
        key = (id(state), tuple(id(c) for c in callees)) + tuple(sorted((name, v.data_ptr()) for name, v in direct.items()))
        entry = self._graphs.get(key)
        if entry is not None and entry["state"] is state and all(a is b for a, b in zip(entry["callees"], callees)):
            self._stage_feeds(staged)
            entry["graph"].replay()
            return _deliver(entry["outputs"], outputs, fresh=False)
        if len(self._runs) > 64:
            self._runs.clear()
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        values = dict(self._stage_feeds(staged))
        values.update(direct)
        if runs < 2:  # the first run is eager: it compiles every kernel
            return _deliver(self._execute(values, state), outputs, fresh=True)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = self._execute(values, state, copy_outputs=False)
        graph.replay()
        if len(self._graphs) >= 4:
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = dict(graph=graph, outputs=captured, state=state, callees=callees)   # (held: ids stay theirs)
        return _deliver(captured, outputs, fresh=False)

    def bound_callees(self) -> tuple | None:
        """The executables bound to this plan's call sites now, in site order, where each of them (and
        theirs, in turn) can be captured into this plan's graph; None where one is unbound or cannot."""
        bound = tuple(self._executable.callables.get(name) for name in self.call_names)
        for exe in bound:
            plan = getattr(exe, "plan", None)
            if not isinstance(plan, CudaPlan) or plan.device != self.device or not plan.capturable or \
                    plan.bound_callees() is None:
                return None
        return bound


def _static(t) -> bool:
    return all(_static(x) for x in t) if isinstance(t, tuple) else t.static


def _torch_stream(stream, device) -> torch.cuda.Stream:
    """A torch stream for the caller's stream object (torch, CuPy, Numba, or a raw cudaStream_t)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    handle = stream if isinstance(stream, int) else getattr(stream, "ptr", None) or getattr(stream, "cuda_stream", None) \
        or getattr(stream, "handle", None)
    if not isinstance(handle, int):
        raise IngotError(f"run: stream= takes a torch.cuda.Stream, an object with a .ptr or .cuda_stream, or a "
                         f"cudaStream_t as an int; got {type(stream).__name__}.")
    return torch.cuda.ExternalStream(handle, device=device)


def _deliver(results: list[torch.Tensor], outputs, fresh: bool) -> list[torch.Tensor]:
    """The run's results: copied into the caller's arrays when given, else fresh tensors (a captured
    graph's own output buffers are never handed out: the next replay overwrites them)."""
    if outputs is None:
        return results if fresh else [o.clone() for o in results]
    if len(outputs) != len(results):
        raise IngotError(f"run: outputs= has {len(outputs)} arrays for {len(results)} targets.")
    delivered = []
    for i, (dst, src) in enumerate(zip(outputs, results)):
        t = dst if isinstance(dst, torch.Tensor) else torch.from_dlpack(dst)
        if tuple(t.shape) != tuple(src.shape) or t.dtype != src.dtype or t.device != src.device:
            raise IngotError(f"run: outputs[{i}] is {t.dtype}{list(t.shape)} on {t.device}; the target is "
                             f"{src.dtype}{list(src.shape)} on {src.device}.")
        t.copy_(src)
        delivered.append(t)
    return delivered


def _assign(state: dict[str, torch.Tensor], updates: list[tuple[str, torch.Tensor]]) -> None:
    pending = [(state[name], value) for name, value in updates if value is not state[name]]
    if len(pending) > 1:  # a value reading another assigned variable is taken before that one is written
        pending = [(target, value.clone() if any(other is not target and _shares(value, other) for other, _ in pending)
                    else value) for target, value in pending]
    for target, value in pending:
        target.copy_(value)
