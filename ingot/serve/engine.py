"""The serving engine: KV slots, a scheduler thread with continuous batching, prefix reuse and
per-request adapters.

Every sequence owns a KV slot: the state of a batch-1 decoder (one [1, nkv, context, hd] K and V
variable per layer). Prefill runs through the batch-1 executables `ingot generate` uses (the same
chunks, the same buckets), straight into the slot. Decode runs all sequences in decode together
through a rows decoder (`llama.build(rows=R)`, R the smallest power of two that holds them), in one
of two layouts:

- per-row caches (the CPU's): row r reads and writes slot arrays mapped by name (a State whose
  variables are the slots' own arrays, no copy), at its own position, with the batch-1 step's
  kernels, so each row computes exactly what a batch-1 decode step computes.
- a KV pool (CUDA's; `pool=True`): one K and one V variable per layer of max_batch + 1 entries
  (`llama.build(rows=R, pool=S)`), slot i's batch-1 state the views pool[i:i + 1] and the last entry
  the scratch that padding rows write; the rows executable takes each row's slot as a feed, so its
  buffers never change and the device captures it once per bucket (a CUDA graph) and replays it.

Either way a row's result never depends on what else is in the batch.

Between decode steps the scheduler admits waiting requests (up to max_batch running), runs one
prefill chunk, and retires finished or cancelled sequences at once, their slots free for the next
request. A prompt is prefilled in generate's chunks (512 tokens) while nothing else decodes, so a
lone request's greedy answer is generate's exactly, and in 64-token chunks while others decode, so
their next token waits for one short chunk at most (a long prompt prefilled so may differ from
generate's in the last bits of its K/V: other chunk lengths round differently). With a KV pool,
prompts join the decode step instead while others decode (mixed steps): a prompt's next tokens are
rows of the rows decoder, each at its own position of its slot (the pool's writes all land before any
row reads, so a row sees the rows before it in the same step), up to MIXED_ROWS rows a step and
positions below MIXED_MAX_POSITION; so a burst of requests is prefilled in a few steps that also
decode, not one request's chunk per step.

Steps ahead (a KV pool on a GPU): when every running sequence's token is chosen on the device (greedy,
or drawn there at its temperature and top-p: serve/sampling.py) with nothing else to
do (no prompt, no request waiting for a free slot), the next step is launched from this step's arg-max
on the device before the host reads this step's tokens; the host then detokenises and streams them
while the GPU runs the next step. A sequence that stops at a token (end of text, a stop string) has a
row in the step already launched: its output is dropped, and the K/V row it wrote lies past the
tokens its slot records, so nothing reads it.

Prefix reuse: a free slot keeps the tokens whose K/V it holds. A new request takes the free slot
sharing the longest prefix with its prompt (same adapter), or copies the rows of a running
sequence's slot when that shares a longer one, and prefills only the rest.

    engine = Engine.load(path, max_batch=8)
    request = engine.submit(Request(ids, SamplingParams(max_tokens=32)), on_event)   # from any thread
"""
from __future__ import annotations

import inspect
import itertools
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import IngotError

PREFILL_CHUNK = 512            # tokens per prefill run when nothing decodes: generate's chunk (its answers exactly)
BUSY_PREFILL_CHUNK = 64        # ... while other sequences decode: each of their steps waits one such chunk at most
MIXED_ROWS = 256               # a KV pool's decode step carries prompt rows up to this many rows in all
MIXED_MAX_POSITION = 1024      # ... of prompt positions below this (each such row reads its whole prefix)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0                # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0               # ... and this times the number of times it was generated
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)


@dataclass
class Event:
    """What the scheduler tells a request: kind "text" (text, logprobs entries), "done" (finish_reason,
    usage) or "error" (status, message)."""
    kind: str
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    status: int = 0
    message: str = ""


@dataclass
class Request:
    ids: list[int]
    params: SamplingParams
    adapter: str | None = None                   # a --lora name, None for the base model
    on_event: Callable[[Event], None] = lambda e: None   # called from the scheduler thread
    id: int = 0
    cancelled: bool = False
    arrived: float = 0.0

    def cancel(self) -> None:
        """Ask the scheduler to stop this request and free its slot (client gone)."""
        self.cancelled = True


class QueueFull(IngotError):
    pass


class Slot:
    """One sequence's KV cache (a batch-1 decoder state) and the tokens whose K/V it holds."""

    def __init__(self, index: int, state):
        self.index, self.state = index, state
        self.tokens: list[int] = []
        self.adapter: str | None = None
        self.busy = False
        self.used = 0.0

    def arrays(self, n_layers: int) -> list[tuple[str, np.ndarray]]:
        """Every cache array of the slot: K and V of each layer (and an int8 cache's row scales)."""
        values = self.state.values
        return [(f"blk.{i}.{kind}_cache", values[f"blk.{i}.{kind}_cache"]) for i in range(n_layers)
                for kind in ("k", "v", "k_scale", "v_scale") if f"blk.{i}.{kind}_cache" in values]


class Sequence:
    """A request being served: prefill progress, sampling, detokenising, stop strings (generate's
    rules, so the text and the finish equal `LLM.generate`'s)."""

    def __init__(self, request: Request, slot: Slot, engine: "Engine", reused: int):
        from ..llm.sampling import Sampler, StopChecker

        self.request, self.slot, self.engine = request, slot, engine
        p = request.params
        self.sampler = Sampler(temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        self.seed = p.seed if p.seed is not None else secrets.randbits(63)   # a GPU step's draws (serve/sampling.py)
        self.stopper = StopChecker(list(p.stop))
        self.stream = engine.tokenizer.stream_decoder()
        self.done = reused                       # prompt tokens whose K/V are in the slot
        self.reused = reused
        self.generated: list[int] = []
        self.starts: list[int] = []
        self.decoded = self.shown = 0
        self.next_token: int | None = None       # the token to feed at the next decode step
        self.pending_logprobs: list = []
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.finished = False
        self.counts: dict[int, int] = {}         # generated token -> times (presence and frequency penalties)
        self.bias = (np.array([t for t, _ in p.logit_bias], np.int64), np.array([b for _, b in p.logit_bias], np.float32))
        self.adjusts = bool(p.logit_bias) or bool(p.presence_penalty) or bool(p.frequency_penalty)

    def adjust(self, logits: np.ndarray) -> None:
        """logit_bias, then the presence and frequency penalties over the generated tokens, in place."""
        p = self.request.params
        if p.logit_bias:
            logits[self.bias[0]] += self.bias[1]
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self.counts, np.int64, len(self.counts))
            times = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            logits[ids] -= np.float32(p.frequency_penalty) * times + np.float32(p.presence_penalty)

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.request.ids)

    def accept(self, token: int, logits: np.ndarray) -> None:
        """Take the token chosen from these logits (the model's, for logprobs) and move the text along."""
        engine, p = self.engine, self.request.params
        now = time.perf_counter()
        if not self.first_token_at:
            self.first_token_at = now
            engine.metrics.first_token(now - self.request.arrived)
        else:
            engine.metrics.inter_token(now - self.last_token_at)
        self.last_token_at = now
        if p.logprobs:
            self.pending_logprobs.append(engine.logprob_entry(logits, token, p.top_logprobs))
        if token in engine.tokenizer.eos_ids:
            return self.finish("stop")
        self.generated.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        engine.metrics.tokens(1)
        piece = self.stream.push(token)
        self.starts.append(self.decoded)
        self.decoded += len(piece)
        text = self.stopper.feed(piece)
        self.shown += len(text)
        if text:
            self.emit(text)
        if self.stopper.stopped:
            del self.generated[next((j for j, s in enumerate(self.starts) if s >= self.shown), len(self.starts)):]
            return self.finish("stop")
        if len(self.generated) >= p.max_tokens:
            return self.finish("length")
        if len(self.slot.tokens) + 1 >= engine.context:
            return self.finish("length")
        self.next_token = token

    def emit(self, text: str) -> None:
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.request.on_event(Event("text", text=text, logprobs=logprobs))

    def finish(self, reason: str) -> None:
        rest = "" if self.stopper.stopped else self.stopper.feed(self.stream.flush()) + self.stopper.flush()
        if rest or self.pending_logprobs:
            self.emit(rest)
        prompt = len(self.request.ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                 "total_tokens": prompt + len(self.generated),
                 "prompt_tokens_details": {"cached_tokens": self.reused}}
        self.finished = True
        self.request.on_event(Event("done", finish_reason=reason, usage=usage))


class Engine:
    """A model loaded for serving: `submit` requests from any thread; the scheduler thread runs them.
    path: a GGUF file or an LLM package, or a `StoredModel` already in memory; loras: {name: (PEFT
    folder, scale) or an `AdapterSet` already in memory}."""

    def __init__(self, path, device: str = "cpu", max_batch: int = 8, context: int | None = None,
                 loras: dict | None = None, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, options=None, kv_dtype: str | None = None,
                 pool: bool | None = None):
        from .. import models
        from ..adapters import AdapterSet, binder, load_peft
        from ..llm.chat import check_template
        from ..llm.generate import DEFAULT_CONTEXT, LLM, _model_info, set_kv_dtype
        from ..llm.package import StoredModel, open_model, storage_form
        from ..llm.tokenizer import Tokenizer
        from .adapters import RowAdapters
        from .metrics import Metrics

        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
                raise IngotError(f"serve: {name} must be an integer in 1..4096, not {value!r}.")
        started = time.perf_counter()
        # a path, or a model already in memory (benchmarks/serve.py's random weights of real shapes)
        model = path if isinstance(path, StoredModel) else open_model(path, bfloat16=device != "cpu")
        path = model.path if isinstance(path, StoredModel) else path
        family = models.family(model.architecture, str(path))
        parameters = inspect.signature(family.build).parameters
        if "rows" not in parameters and not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            raise IngotError(f"{path}: architecture {model.architecture!r} has no rows decoder (continuous batching) "
                             f"yet, so ingot serve cannot batch it.")
        self.path, self.device, self.options = str(path), device, options
        self.pooled = device != "cpu" if pool is None else bool(pool)   # the KV pool layout (CUDA graphs)
        if self.pooled and "pool" not in parameters and not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            raise IngotError(f"{path}: architecture {model.architecture!r} has no KV pool rows decoder yet, so ingot "
                             f"serve cannot batch it on {device}.")
        self.info = _model_info(model)
        self.config = cfg = model.config
        cfg.context_length = min(cfg.context_length, context or DEFAULT_CONTEXT)
        if kv_dtype is None and device != "cpu" and cfg.kv_dtype == "float32":
            kv_dtype = "bfloat16"     # a GPU server holds many sequences: half the bytes, attention in float32
        set_kv_dtype(cfg, kv_dtype)   # every slot's and rows decoder's cache (they build from cfg)
        self.context = cfg.context_length
        try:
            self.tokenizer = Tokenizer(model.metadata, default_template=models.chat_template(model.architecture))
            check_template(self.tokenizer.chat_template)
        except IngotError as e:
            raise IngotError(f"{path}: {e}") from None
        base = model.adapters if model.adapters else AdapterSet()
        self.adapters: dict[str | None, AdapterSet] = {None: base}
        for name, lora in (loras or {}).items():   # (PEFT folder, scale), or an AdapterSet already in memory
            self.adapters[name] = base.merged(lora if isinstance(lora, AdapterSet) else load_peft(lora[0], cfg, lora[1]))
        self.sites = frozenset().union(*(a.names for a in self.adapters.values()))
        # the rows decoders compute every adapter's delta inline, each row's chosen by the adapter_rows feed
        self.gathered = RowAdapters(cfg, list(self.adapters.values())) if self.sites else None
        if device == "cpu":
            from ..backends.cpu.kernels import warm_up
            from ..llm.generate import kernels_used
            warm_up(**kernels_used(options, self.path))
        # converted once, k-major and q/k/v, gate/up side by side (as a package stores them): every graph
        # built from them (batch-1, rows decoders) shares these arrays, none converts or copies its own
        finish = None
        if device == "cpu":   # 4-bit ones tiled for the GEMV (kernels.tile_weight) as each comes, held once
            from ..backends.cpu.kernels import tile_weight as finish
        self.tensors = storage_form(cfg, model.tensors, finish=finish)
        self.metadata = {k: v for k, v in model.metadata.items() if not k.startswith("tokenizer.ggml.")}
        del model
        self.model = models.build(cfg, self.tensors, self.path, adapter_sites=self.sites)
        if self.sites:   # the base model's (entry 0) until a prefill binds its request's (_bind_prefill)
            self.model.callables_for = binder(cfg, base)
        self.llm = LLM.from_graph(self.model, self.tokenizer, device, options)   # the batch-1 decoder and prefill
        self.llm.path, self.llm.metadata = self.path, self.metadata
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self._rows: dict[int, tuple] = {}                      # R -> (executable, its adapter_rows feed)
        self._token_feeds: dict[int, object] = {}              # R -> its tokens feed on a GPU (one CUDA graph a bucket)
        self._flight: _Flight | None = None                    # a decode step whose tokens the host has not read
        self._row_states: dict[tuple, object] = {}
        if self.pooled:
            check_kv_fits(cfg, max_batch + 1, device, sum(int(getattr(t, "nbytes", 0)) for t in self.tensors.values()))
            self.pool = self._new_pool()
            self.slots = [Slot(i, self._entry_state(i)) for i in range(max_batch)]
            self.scratch = Slot(max_batch, self._entry_state(max_batch))   # rows that pad a bucket write here
        else:
            self.pool = None
            self.slots = [Slot(i, self.llm.decoder.new_state()) for i in range(max_batch)]
            self.scratch = Slot(-1, self.llm.decoder.new_state())  # rows that pad a bucket write here
        self.metrics = Metrics()
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count(1)
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.info.update(context=self.context, load_seconds=time.perf_counter() - started)

    # -- the public side (any thread) -------------------------------------------------------------
    def start(self) -> None:
        if self.device != "cpu":
            # the scheduler waits on the GPU with the GIL released; the HTTP thread streaming to many
            # clients then holds it until CPython's switch interval (5 ms) before the next step can launch
            import sys
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._thread = threading.Thread(target=self._loop, name="ingot-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: Request) -> Request:
        """Queue a request; QueueFull when max_queue requests already wait; IngotError for a prompt the
        context cannot hold or an adapter this server lacks."""
        if request.adapter not in self.adapters:
            raise IngotError(f"model {request.adapter!r} is not served here.")
        if not request.ids:
            raise IngotError("the prompt is empty.")
        if len(request.ids) >= self.context:
            raise IngotError(f"the prompt has {len(request.ids)} tokens but the context holds {self.context}; "
                             f"shorten it or start the server with a larger --context.")
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the server is busy: {len(self.waiting)} requests are waiting already.")
            request.id = next(self._ids)
            request.arrived = time.perf_counter()
            self.waiting.append(request)
            self.metrics.queue(len(self.waiting))
            self._wake.notify()
        return request

    def wake(self) -> None:
        """Make the scheduler look at its requests now (after a cancel)."""
        with self._wake:
            self._wake.notify()

    def warm(self, rows=()) -> None:
        """Compile the rows decoders for these row counts (default: every bucket) and the prefill
        executables of every bucket length the context allows (with every adapter's callables), before
        the first request needs them. On a GPU each prefill length also runs once on the scratch entry:
        its kernels are compiled at their first launch (an H100 server's first requests waited 2.3 s for
        their first token when they came first)."""
        from ..llm.generate import PREFILL_BUCKETS

        for r in rows or self.buckets():
            exe, adapter_rows = self._rows_executable(r)
            if self.pooled:   # run twice on the scratch entry: kernels compiled, then the CUDA graph captured
                feeds = {"tokens": self._token_feed(r, np.zeros(r, np.int32)), "positions": np.zeros(r, np.int32),
                         "slots": np.full(r, self.scratch.index, np.int32)}
                if adapter_rows is not None:
                    feeds["adapter_rows"] = np.zeros(r, np.int32)
                for _ in range(2):
                    exe.run(feeds, state=self.pool)
        for size in PREFILL_BUCKETS:
            if size <= self.context:
                exe = self.model.compile(size, self.device, self.options)
                for name in [*self.adapters][::-1] if self.sites else ():   # each adapter's callables, compiled;
                    self._bind_prefill(exe, name, size)                      # the base model's bound last
                if self.pooled and self.device != "cpu":
                    exe.run({"tokens": np.zeros(size, np.int32), "pos": np.int32(0), "last": np.int32(size - 1)},
                            state=self.scratch.state, graph=False)

    def buckets(self) -> list[int]:
        """Row counts the rows decoders are compiled for: powers of two up to max_batch, and with a KV pool
        the mixed steps' (prompt rows riding along) in steps of four up to MIXED_ROWS."""
        out, r = [], 1
        while r < self.max_batch:
            out.append(r)
            r *= 2
        out.append(self.max_batch)
        if self.pooled and self.max_batch < MIXED_ROWS:
            r = self.max_batch * 4
            while r < MIXED_ROWS:
                out.append(r)
                r *= 4
            out.append(MIXED_ROWS)
        return out

    # -- the scheduler thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.waiting and not self.running:
                    self._wake.wait()
                if self._stop:
                    break
            try:
                self._iteration()
            except Exception as e:   # noqa: BLE001 -- no request may take the server down
                message = str(e) if isinstance(e, IngotError) else f"internal error ({type(e).__name__}: {e})"
                for seq in self.running:
                    self._fail(seq, 500, message)
                self.running = []
                self._flight = None
        self._flight = None
        for seq in self.running:
            self._fail(seq, 503, "the server is shutting down.")
        while self.waiting:
            self.waiting.popleft().on_event(Event("error", status=503, message="the server is shutting down."))

    def _iteration(self) -> None:
        if self._flight is not None:   # a step in flight: launch the one after it if nothing else waits, then read it
            self._land()
            self._retire()
            if self._flight is not None:
                self.metrics.running(len(self.running))
                return
        self._retire()
        self._admit()
        # with a KV pool, while others decode, prompts ride in the decode step (mixed steps); a prompt
        # past MIXED_MAX_POSITION, or any when nothing decodes, takes a prefill chunk of its own
        mixed = self.pooled and any(not s.prefilling and s.next_token is not None for s in self.running)
        late = [s for s in self.running if s.prefilling and (not mixed or s.done >= MIXED_MAX_POSITION)]
        if late:
            seq = late[0]
            try:
                self._prefill_chunk(seq)
            except IngotError as e:
                self._fail(seq, 400, str(e))
        self._retire()
        decoding = [s for s in self.running if not s.prefilling and s.next_token is not None]
        riders = self._riders([s for s in self.running if s.prefilling], len(decoding)) if mixed and decoding else []
        if decoding:
            self._decode(decoding, riders)
        self._retire()
        self.metrics.running(len(self.running))

    def _riders(self, prefilling: list[Sequence], decoding: int) -> list[tuple[Sequence, int]]:
        """(sequence, prompt tokens) that join a decode step of `decoding` rows: in arrival order, each
        its next tokens below MIXED_MAX_POSITION, MIXED_ROWS rows in all."""
        room = MIXED_ROWS - decoding   # (buckets() reaches MIXED_ROWS with a pool)
        riders = []
        for seq in prefilling:
            self._reuse_more(seq)
            n = min(len(seq.request.ids), MIXED_MAX_POSITION) - seq.done
            n = min(n, room)
            if n > 0:
                riders.append((seq, n))
                room -= n
        return riders

    def _retire(self) -> None:
        keep = []
        for seq in self.running:
            if seq.request.cancelled and not seq.finished:
                seq.finished = True
                self.metrics.cancelled()
            if seq.finished:
                seq.slot.busy = False
                seq.slot.used = time.perf_counter()
            else:
                keep.append(seq)
        self.running = keep

    def _fail(self, seq: Sequence, status: int, message: str) -> None:
        if not seq.finished:
            seq.finished = True
            seq.request.on_event(Event("error", status=status, message=message))
        seq.slot.busy = False
        seq.slot.tokens = []          # its K/V may be half written

    def _admit(self) -> None:
        with self._wake:
            while self.waiting and len(self.running) < self.max_batch:
                request = self.waiting.popleft()
                if request.cancelled:
                    continue
                try:
                    self.running.append(self._place(request))
                except IngotError as e:
                    request.on_event(Event("error", status=400, message=str(e)))
            self.metrics.queue(len(self.waiting))

    def _place(self, request: Request) -> Sequence:
        """A slot for the request, reusing the longest cached prefix (same adapter) there is."""
        ids, limit = request.ids, len(request.ids) - 1    # the last prompt token is always computed (its logits)

        def common(tokens: list[int]) -> int:
            n = 0
            for a, b in zip(tokens, ids[:limit]):
                if a != b:
                    break
                n += 1
            return n

        free = [s for s in self.slots if not s.busy]
        same = lambda s: s.adapter == request.adapter  # noqa: E731
        slot = max(free, key=lambda s: (common(s.tokens) if same(s) else 0, -s.used))
        reused = common(slot.tokens) if same(slot) else 0
        slot.tokens = list(ids[:reused])
        slot.adapter, slot.busy = request.adapter, True
        reused = self._copy_prefix(slot, ids, reused)
        self.metrics.admitted(len(ids), reused)
        return Sequence(request, slot, self, reused)

    def _copy_prefix(self, slot: Slot, ids: list[int], reused: int) -> int:
        """Copy into slot the K/V rows of the running sequence (same adapter) whose tokens share more
        than `reused` of ids (the last token excepted); returns how many the slot now holds."""
        def common(tokens: list[int]) -> int:
            n = 0
            for a, b in zip(tokens, ids[:len(ids) - 1]):
                if a != b:
                    break
                n += 1
            return n

        donor = max((s for s in self.slots if s.busy and s is not slot and s.adapter == slot.adapter),
                    key=lambda s: common(s.tokens), default=None)
        if donor is not None and common(donor.tokens) > reused:   # copy the rows of a running sequence
            reused = common(donor.tokens)
            for (name, dst), (_, src) in zip(slot.arrays(self.config.n_layers), donor.arrays(self.config.n_layers)):
                dst[:, :, :reused] = src[:, :, :reused]
            slot.tokens = list(ids[:reused])
        return reused

    def _prefill_chunk(self, seq: Sequence) -> None:
        from ..llm.generate import PREFILL_BUCKETS

        ids = seq.request.ids
        self._reuse_more(seq)
        pos = seq.done
        busy = any(not s.prefilling and s.next_token is not None for s in self.running)
        chunk = ids[pos:pos + (min(self.prefill_chunk, BUSY_PREFILL_CHUNK) if busy else self.prefill_chunk)]
        size = min(next((b for b in PREFILL_BUCKETS if b >= len(chunk)), len(chunk)), self.context - pos)
        exe = self.model.compile(size, self.device, self.options)
        self._bind_prefill(exe, seq.request.adapter, size)
        padded = np.zeros(size, np.int32)
        padded[:len(chunk)] = chunk
        eager = {"graph": False} if self.pooled and self.device != "cpu" else {}   # a captured graph per slot: too many
        logits = exe.run({"tokens": padded, "pos": np.int32(pos), "last": np.int32(len(chunk) - 1)},
                         state=seq.slot.state, **eager)[0]
        seq.done += len(chunk)
        seq.slot.tokens = list(ids[:seq.done])
        if not seq.prefilling:   # its first token, chosen as its decode steps choose (the device's draws on a GPU)
            flight = self._device_tokens([seq], logits, [seq.done - 1])
            if flight is None:
                self._accept([seq], exe.backend.to_host(logits))
            else:
                self._take(flight)

    def _reuse_more(self, seq: Sequence) -> None:
        """Before a sequence's first prompt row is computed: a sequence admitted with it (n > 1), or since,
        may hold a longer prefix of its prompt now; copy those rows."""
        if seq.done == seq.reused:
            before = seq.reused
            seq.done = seq.reused = self._copy_prefix(seq.slot, seq.request.ids, before)
            self.metrics.reused(seq.reused - before)

    def _bind_prefill(self, exe, adapter: str | None, rows: int) -> None:
        from ..adapters import site_input, site_layout

        adapters = self.adapters[adapter]
        for site in exe.call_sites:
            names = site.split("+")
            callee = adapters.executable(names, site_layout(self.config, names), rows, self.device,
                                         site_input(self.config, names[0]))
            if exe.callables.get(site) is not callee:
                exe.bind(site, callee)

    def _rows_executable(self, rows: int):
        hit = self._rows.get(rows)
        if hit is None:
            from .. import models
            from .. import dtypes as dt
            from ..ir import TensorType

            pool = {"pool": self.max_batch + 1} if self.pooled else {}
            sites = self.gathered.for_rows(rows) if self.gathered is not None else ()
            model = models.build(self.config, self.tensors, self.path, adapter_sites=sites, rows=rows, **pool)
            exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits],
                                      device=self.device, options=self.options)
            hit = self._rows[rows] = (exe, np.zeros(rows, np.int32) if sites else None)
        return hit

    def _new_pool(self):
        """The KV pool: every pool variable of the rows decoders, zeros on the device (allocated here,
        never scanned: the graph's initial values are lazily mapped zeros)."""
        from ..runtime import State

        exe, _ = self._rows_executable(1)
        values = {}
        for name, initial in exe.program.variables.items():
            if self.device == "cpu":
                values[name] = np.zeros(initial.shape, initial.dtype)
            else:
                import torch

                from .. import dtypes as dt
                from ..backends.cuda import torch_dtype
                values[name] = torch.zeros(initial.shape, dtype=torch_dtype(dt.from_numpy(initial.dtype)),
                                           device=exe.backend.device)
        return State(values)

    def _entry_state(self, index: int):
        """Pool entry `index` as a batch-1 decoder's state: its caches are views of the pool (no copy)."""
        from ..runtime import State

        from ..models.blocks import cache_kinds
        return State({f"blk.{i}.{kind}_cache": self.pool.values[f"blk.{i}.{kind}_pool"][index:index + 1]
                      for i in range(self.config.n_layers) for kind in cache_kinds(self.config)})

    def _row_state(self, slots: tuple[Slot, ...]):
        from ..runtime import State

        key = tuple(s.index for s in slots)
        state = self._row_states.get(key)
        if state is None:
            if len(self._row_states) > 256:
                self._row_states.clear()
            n = self.config.n_layers
            state = self._row_states[key] = State({f"{name}.{r}": array for r, slot in enumerate(slots)
                                                   for name, array in slot.arrays(n)})
        return state

    def _decode(self, decoding: list[Sequence], riders: list[tuple[Sequence, int]] = ()) -> None:
        """One step of the rows decoder: each decoding sequence's next token, then (a KV pool's mixed
        step) each rider's next prompt tokens, a row each at its position; the sequences whose last
        prompt token is among them choose their first token from its row."""
        seqs = list(decoding)
        slots = [s.slot for s in decoding]
        tokens = [s.next_token for s in decoding]
        positions = [len(s.slot.tokens) for s in decoding]
        emit = list(range(len(decoding)))       # the row each of `choosers` chooses its token from
        choosers = list(decoding)
        for seq, n in riders:
            seqs += [seq] * n
            slots += [seq.slot] * n
            tokens += seq.request.ids[seq.done:seq.done + n]
            positions += range(seq.done, seq.done + n)
            if seq.done + n == len(seq.request.ids):
                emit.append(len(tokens) - 1)
                choosers.append(seq)
        rows = next(b for b in self.buckets() if b >= len(tokens))
        exe, row_adapters = self._rows_executable(rows)
        pad = rows - len(tokens)
        slots = tuple(slots) + (self.scratch,) * pad
        feeds = {"tokens": self._token_feed(rows, np.array(tokens + [0] * pad, np.int32)),
                 "positions": np.array(positions + [0] * pad, np.int32)}
        if row_adapters is not None:    # each row's adapter: its index among the served ones (0: the base model)
            order = list(self.adapters)
            row_adapters[:] = [order.index(s.request.adapter) for s in seqs] + [0] * pad
            feeds["adapter_rows"] = row_adapters
        started = time.perf_counter()
        if self.pooled:
            feeds["slots"] = np.array([s.index for s in slots], np.int32)
            out = exe.run(feeds, state=self.pool)[0]
        else:
            out = exe.run(feeds, state=self._row_state(slots))[0]
        if emit != list(range(len(emit))):   # prompt rows in between: the choosing rows, gathered
            out = out[np.array(emit)] if isinstance(out, np.ndarray) else out[_device_index(out, emit)]
        flight = self._device_tokens(choosers, out, [positions[r] for r in emit])
        logits = exe.backend.to_host(out) if flight is None else None
        for seq in decoding:
            seq.slot.tokens.append(seq.next_token)
            seq.next_token = None
        for seq, n in riders:
            seq.done += n
            seq.slot.tokens = list(seq.request.ids[:seq.done])
        if flight is None:
            self.metrics.step(len(decoding), time.perf_counter() - started, sum(n for _, n in riders))
            self._accept(choosers, logits)
        else:   # read at the next iteration, after the step that follows it is launched (_land)
            flight.started, flight.decoding, flight.prompt_rows = started, len(decoding), sum(n for _, n in riders)
            self._flight = flight

    def _device_tokens(self, seqs: list[Sequence], logits, positions: list[int]) -> _Flight | None:
        """On a GPU, when no row asks for logprobs, biases or penalties, each row's token chosen there
        (greedy, or drawn at its temperature and top-p: serve/sampling.py, keyed by the request's seed and
        the row's position) and its copy to the host queued: a few bytes come back instead of [rows, vocab]
        floats (64 rows of a 128k vocabulary: 32 MB a step, and 61 ms of host sampling at top-p 0.95 for
        32 rows). None otherwise (the host samples the logits)."""
        if self.device == "cpu" or isinstance(logits, np.ndarray) or not all(_on_device(s) for s in seqs):
            return None
        return self._flight_of(seqs, logits, positions)

    def _flight_of(self, seqs: list[Sequence], logits, positions: list[int]) -> _Flight:
        import torch

        from .sampling import choose, row_key

        rows = logits[:len(seqs)]
        if all(s.sampler.greedy for s in seqs):
            tokens = rows.argmax(dim=-1)
        else:
            params = torch.tensor([[s.sampler.temperature, s.sampler.top_p] for s in seqs], dtype=torch.float32)
            keys = torch.tensor([row_key(s.seed, p) for s, p in zip(seqs, positions)], dtype=torch.int64)
            if rows.is_cuda:
                params = params.pin_memory().to(rows.device, non_blocking=True)
                keys = keys.pin_memory().to(rows.device, non_blocking=True)
            tokens = choose(rows, params[:, 0], params[:, 1], keys)
        both = torch.stack([tokens, torch.isnan(rows).any(dim=-1).to(torch.int64)])
        event = None
        if both.device.type == "cuda":   # (the interpreter's stand-in device is the CPU: already there)
            host = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            both = host
        return _Flight(list(seqs), tokens.to(torch.int32), both, event)

    def _land(self) -> None:
        """Read the step in flight: first launch the step after it from its tokens on the device where
        nothing else waits (_ahead), then take its tokens on the host (each sequence moves along; a row
        holding NaN fails its request, as sampling it on the host does)."""
        flight = self._flight
        ahead = self._ahead(flight)
        self.metrics.step(flight.decoding, time.perf_counter() - flight.started, flight.prompt_rows, flight.ahead)
        self._take(flight)
        if ahead is not None:   # the tokens just accepted are the inputs that step already took
            for seq in ahead.seqs:
                if not seq.finished and seq.next_token is not None:
                    seq.slot.tokens.append(seq.next_token)
                    seq.next_token = None
        self._flight = ahead

    def _take(self, flight: _Flight) -> None:
        """Each sequence of a step read on the host takes its token (a row holding NaN fails its request)."""
        tokens, nan = flight.read()
        for seq, token, bad in zip(flight.seqs, tokens, nan):
            if seq.finished:
                continue
            if bad:
                self._fail(seq, 500, "the model's logits hold NaN; no token can be chosen.")
                continue
            try:
                seq.accept(token, None)
            except IngotError as e:
                self._fail(seq, 500, str(e))

    def _ahead(self, flight: _Flight) -> _Flight | None:
        """The step after `flight`, launched before the host reads its tokens: each of its sequences one
        row, its token the arg-max on the device, at the position after its slot's tokens. Only when
        those sequences are all that runs, none was cancelled, and no request waits for a free slot
        (those need the host's scheduling first)."""
        seqs = flight.seqs
        if len(self.running) != len(seqs) or {id(s) for s in self.running} != {id(s) for s in seqs} or \
                any(s.request.cancelled or s.finished or len(s.slot.tokens) >= self.context for s in seqs) or \
                (self.waiting and len(self.running) < self.max_batch) or self._stop:
            return None
        rows = next(b for b in self.buckets() if b >= len(seqs))
        exe, row_adapters = self._rows_executable(rows)
        pad = rows - len(seqs)
        feeds = {"tokens": self._token_feed(rows, flight.tokens),
                 "positions": np.array([len(s.slot.tokens) for s in seqs] + [0] * pad, np.int32),
                 "slots": np.array([s.slot.index for s in seqs] + [self.scratch.index] * pad, np.int32)}
        if row_adapters is not None:
            order = list(self.adapters)
            row_adapters[:] = [order.index(s.request.adapter) for s in seqs] + [0] * pad
            feeds["adapter_rows"] = row_adapters
        started = time.perf_counter()
        out = exe.run(feeds, state=self.pool)[0]
        ahead = self._device_tokens(seqs, out, [int(p) for p in feeds["positions"][:len(seqs)]])
        ahead.started, ahead.decoding, ahead.ahead = started, len(seqs), True
        return ahead

    def _token_feed(self, rows: int, tokens):
        """The rows decoder's tokens feed: on a GPU one device buffer per bucket (read in place: one
        CUDA graph a bucket, whether the tokens come from the host or from a step's arg-max), filled
        from the host (numpy [rows]) or on the device (a tensor of the first rows, the rest zeros)."""
        if not self.pooled or self.device == "cpu":
            return np.concatenate([tokens, np.zeros(rows - len(tokens), np.int32)]) if len(tokens) < rows else tokens
        import torch

        feed = self._token_feeds.get(rows)
        if feed is None:
            device = next(iter(self.pool.values.values())).device
            feed = self._token_feeds[rows] = torch.zeros(rows, dtype=torch.int32, device=device)
        if isinstance(tokens, np.ndarray):
            source = torch.from_numpy(tokens)
            feed.copy_(source.pin_memory() if feed.is_cuda else source, non_blocking=True)
        else:
            feed[:len(tokens)].copy_(tokens)
            feed[len(tokens):].zero_()
        return feed

    def _accept(self, seqs: list[Sequence], logits: np.ndarray) -> None:
        """Choose each sequence's next token from its row of logits [>= len(seqs), vocab], all rows at
        once (sample_rows), and move each along; a row that cannot be sampled fails its request."""
        from ..llm.sampling import sample_rows

        rows = logits[:len(seqs)]
        chosen = rows
        if any(s.adjusts for s in seqs):       # biases and penalties on a copy: logprobs are the model's
            chosen = np.array(rows, np.float32, copy=True)
            for r, seq in enumerate(seqs):
                if seq.adjusts:
                    seq.adjust(chosen[r])
        try:
            tokens = sample_rows([s.sampler for s in seqs], chosen).tolist()
        except IngotError:                      # find the row: sample one by one
            tokens = []
            for r, seq in enumerate(seqs):
                try:
                    tokens.append(int(seq.sampler(chosen[r])))
                except IngotError as e:
                    tokens.append(None)
                    self._fail(seq, 500, str(e))
        for r, (seq, token) in enumerate(zip(seqs, tokens)):
            if token is None or seq.finished:
                continue
            try:
                seq.accept(token, rows[r])
            except IngotError as e:
                self._fail(seq, 500, str(e))

    # -- helpers ------------------------------------------------------------------------------------
    def logprob_entry(self, logits: np.ndarray, token: int, top: int) -> dict:
        """OpenAI's logprobs entry of the chosen token (log-softmax of the model's logits)."""
        x = logits.astype(np.float64)
        m = x.max()
        logz = m + math.log(np.exp(x - m).sum())
        entry = {"token": self.token_text(token), "logprob": float(x[token] - logz), "id": token}
        if top:
            best = np.argpartition(-x, top)[:top] if top < x.size else np.arange(x.size)
            best = best[np.argsort(-x[best], kind="stable")]
            entry["top_logprobs"] = [{"token": self.token_text(int(i)), "logprob": float(x[i] - logz), "id": int(i)}
                                     for i in best]
        else:
            entry["top_logprobs"] = []
        return entry

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _on_device(seq: Sequence) -> bool:
    """Whether a GPU step may choose this sequence's token (no logprobs, logit biases or penalties)."""
    s = seq.sampler
    return not seq.adjusts and not seq.request.params.logprobs and s.repetition_penalty == 1.0 and s.top_k == 0 \
        and s.min_p == 0.0


def _device_index(tensor, rows: list[int]):
    """rows as an index tensor on tensor's device (through pinned memory: no wait for the stream)."""
    import torch

    index = torch.tensor(rows, dtype=torch.long)
    return index.pin_memory().to(tensor.device, non_blocking=True) if tensor.is_cuda else index.to(tensor.device)


@dataclass
class _Flight:
    """A decode step launched on a GPU whose tokens the host has not read: its choosing sequences (a
    row each, in order), their arg-max on the device (int32, the next step's tokens feed) and the
    arg-max and NaN flags [2, rows] copied (or being copied: `event`) to the host."""
    seqs: list
    tokens: object
    host: object
    event: object
    started: float = 0.0
    decoding: int = 0
    prompt_rows: int = 0
    ahead: bool = False

    def read(self) -> tuple[list[int], list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


def kv_bytes(cfg, entries: int) -> int:
    """Bytes of a KV pool of `entries` sequences of cfg.context_length (K and V, every layer, cfg.kv_dtype)."""
    from .. import dtypes as dt

    size = dt.by_name(cfg.kv_dtype).storage.itemsize
    scales = 4 if cfg.kv_dtype == "int8" else 0   # an int8 cache's float32 scale per row
    return 2 * cfg.n_layers * entries * cfg.n_kv_heads * cfg.context_length * (cfg.head_dim * size + scales)


def check_kv_fits(cfg, entries: int, device: str, weight_bytes: int, free: int | None = None) -> None:
    """One IngotError, before anything is allocated, when the KV pool of `entries` sequences and the
    weights cannot fit the device's free memory (free None: asked of the device; a CPU is not checked)."""
    if free is None:
        if device == "cpu":
            return
        import torch

        from ..backends.cuda import device_name
        where = torch.device(device_name())
        if where.type != "cuda":       # the interpreter's stand-in device (INGOT_CUDA_DEVICE=cpu)
            return
        free = torch.cuda.mem_get_info(where)[0]
    need = kv_bytes(cfg, entries)
    margin = 1 << 30                   # activations, workspaces, CUDA graphs, the allocator's slack
    if need + weight_bytes + margin > free:
        gib = lambda n: f"{n / (1 << 30):.1f} GiB"   # noqa: E731
        raise IngotError(f"serve: the KV cache of {entries - 1} slots x context {cfg.context_length} x "
                         f"{cfg.n_layers} layers in {cfg.kv_dtype} needs {gib(need)} (weights {gib(weight_bytes)}), "
                         f"but {device} has {gib(free)} free; lower --max-batch or --context, or use "
                         f"--kv-dtype bfloat16.")
