"""Llama-family decoders (Llama 2/3, SmolLM, Mistral, Qwen2) as an Ingot graph.

One graph holds the weights (quantized weights stay quantized: each linear is
dequantize -> transpose -> matmul, which the compiler fuses into quantized_matmul), the KV cache
as two variables per layer, and a token placeholder whose length is dynamic. Compiling it for
T = 1 gives the decode executable (static shapes, the position a runtime scalar); compiling for a
prompt chunk length gives a prefill executable (cached per length).

    tokens: int32 [T]   pos: int32 []   last: int32 []   ->   logits: float32 [1, vocab]

build(batch=B) decodes B sequences in lockstep (one shared position): tokens [B*T], KV caches
[B, nkv, ctx, hd], logits [B, vocab].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..ir import TensorType
from ..ops.nn import rope_inv_freq
from ..quant.formats import QuantizedTensor, concat_columns

ARCHITECTURES = ("llama", "mistral", "qwen2", "smollm")
MAX_DIMENSION = 1 << 24  # any count or size a config may hold (layers, dims, vocabulary, context)


@dataclass
class LlamaConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    head_dim: int = 0
    rope_base: float = 10000.0
    rope_dims: int = 0
    rope_interleaved: bool = True       # GGUF stores Q/K permuted for llama.cpp's interleaved RoPE
    rope_scale: float = 1.0             # linear position scaling
    norm_eps: float = 1e-5
    context_length: int = 2048
    tied_embeddings: bool = False
    qkv_bias: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()
        self.head_dim = self.head_dim or self.dim // self.n_heads
        self.rope_dims = self.rope_dims or self.head_dim
        if self.rope_dims > self.head_dim or self.rope_dims % 2:
            raise IngotError(f"llama: rope_dims {self.rope_dims} must be even and at most head_dim {self.head_dim}.")

    def validate(self) -> None:
        """Every field of the type and range a decoder can be built from (a file or llm.json may say
        anything): positive counts, heads that divide, finite numbers. One IngotError otherwise."""
        counts = {"n_layers": self.n_layers, "dim": self.dim, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                  "ffn_dim": self.ffn_dim, "vocab_size": self.vocab_size, "context_length": self.context_length}
        for name, value in {**counts, "head_dim": self.head_dim, "rope_dims": self.rope_dims}.items():
            low = 1 if name in counts else 0
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= MAX_DIMENSION:
                raise IngotError(f"llama: {name} must be an integer in {low}..{MAX_DIMENSION}, not {value!r}.")
        for name in ("rope_base", "rope_scale", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value) or value < 0 or (value == 0 and name != "norm_eps"):
                raise IngotError(f"llama: {name} must be a finite positive number, not {value!r}.")
        if self.n_heads % self.n_kv_heads:
            raise IngotError(f"llama: {self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads.")
        if not self.head_dim and self.dim % self.n_heads:
            raise IngotError(f"llama: dim {self.dim} is not a multiple of {self.n_heads} heads (and no head_dim is given).")

    @classmethod
    def from_gguf(cls, model) -> "LlamaConfig":
        """The config a GGUF file's metadata describes, every value checked (type, range, consistency)
        before anything is allocated from it."""
        from ..untrusted import metadata_float, metadata_int, metadata_str

        arch = model.architecture
        if arch not in ARCHITECTURES:
            raise IngotError(f"{model.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)}).")
        required = ["block_count", "embedding_length", "attention.head_count", "feed_forward_length"]
        missing = [k for k in required if model.get(f"{arch}.{k}") is None]
        if missing:
            raise IngotError(f"{model.path}: metadata lacks {', '.join(arch + '.' + k for k in missing)}.")
        integer = lambda key, default=None, minimum=1: metadata_int(model, f"{arch}.{key}", default, minimum,  # noqa: E731
                                                                     MAX_DIMENSION)
        number = lambda key, default, **kw: metadata_float(model, f"{arch}.{key}", default, **kw)  # noqa: E731
        if "token_embd.weight" not in model.tensors:
            raise IngotError(f"{model.path}: tensor token_embd.weight is missing.")
        tensors = model.tensors
        vocab = tensors.shape("token_embd.weight")[0] if hasattr(tensors, "shape") else tensors["token_embd.weight"].shape[0]
        scaling = metadata_str(model, f"{arch}.rope.scaling.type")
        n_heads = integer("attention.head_count")
        dim = integer("embedding_length")
        head_dim = integer("attention.key_length", 0, minimum=0)
        if not head_dim and dim % n_heads:
            raise IngotError(f"{model.path}: {arch}.embedding_length {dim} is not a multiple of "
                             f"{arch}.attention.head_count {n_heads}.")
        head_dim = head_dim or dim // n_heads
        rope_dims = integer("rope.dimension_count", 0, minimum=0)
        if rope_dims > head_dim or rope_dims % 2:
            raise IngotError(f"{model.path}: {arch}.rope.dimension_count is {rope_dims}; it must be even and at most "
                             f"the head dimension {head_dim}.")
        n_kv_heads = integer("attention.head_count_kv", n_heads)
        if n_heads % n_kv_heads:
            raise IngotError(f"{model.path}: {arch}.attention.head_count {n_heads} is not a multiple of "
                             f"{arch}.attention.head_count_kv {n_kv_heads}.")
        values = dict(
            n_layers=integer("block_count"), dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            ffn_dim=integer("feed_forward_length"), vocab_size=int(vocab), head_dim=head_dim,
            rope_base=number("rope.freq_base", 10000.0, exclusive_minimum=True), rope_dims=rope_dims,
            rope_interleaved=arch not in ("qwen2",),  # llama.cpp runs qwen2 with NEOX (half-split) RoPE
            rope_scale=number("rope.scaling.factor", 1.0, exclusive_minimum=True) if scaling == "linear" else 1.0,
            norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5, maximum=1.0),
            context_length=integer("context_length", 2048),
            tied_embeddings="output.weight" not in model.tensors,
            qkv_bias="blk.0.attn_q.bias" in model.tensors,
        )
        try:
            return cls(**values)
        except IngotError as e:
            raise IngotError(f"{model.path}: {e}") from None


def _is_bfloat16(w) -> bool:
    return isinstance(w, np.ndarray) and w.dtype == dt.bfloat16.storage


class Weights:
    """Looks up GGUF-named tensors and turns them into graph constants (quantized ones stay so)."""

    def __init__(self, g: Graph, tensors: dict, path: str = "", adapter_sites=()):
        self.g, self.tensors, self.path = g, tensors, path
        self.adapter_sites = frozenset(adapter_sites)  # weight names whose output gets a called adapter
        self.inputs: dict[str, Tensor] = {}            # "+".join(weight names) -> the tensor they multiply

    def get(self, name: str):
        if name not in self.tensors:
            raise IngotError(f"{self.path}: tensor {name} is missing.")
        return self.tensors[name]

    def vector(self, name: str) -> Tensor:
        w = self.get(name)
        if isinstance(w, QuantizedTensor) or np.ndim(w) != 1:
            raise IngotError(f"{self.path}: tensor {name} should be a float vector, not "
                             f"{w.source or w.qdtype.name if isinstance(w, QuantizedTensor) else np.asarray(w).dtype}"
                             f"{list(w.shape)}.")
        return self.g.constant(np.asarray(w, np.float32), name=name)

    def _checked(self, name: str, shape: tuple[int, int]):
        w = self.get(name)
        if tuple(w.shape) != (shape if not isinstance(w, QuantizedTensor) or w.block_axis == 1 else shape[::-1]):
            raise IngotError(f"{self.path}: tensor {name} has shape {tuple(w.shape)}, expected {shape}.")
        if isinstance(w, QuantizedTensor) and w.block_axis == 1:
            w = w.to_k_major()
        return w

    def _constant(self, w, name: str) -> Tensor:
        g = self.g
        if isinstance(w, QuantizedTensor):
            q = g.constant(w.q, dtype=w.qdtype if w.qdtype.packed else None, name=name)
            if w.lut is not None and w.scale is not None:  # a scaled lookup table (GGUF's IQ types, MXFP4)
                return g.dequantize(q, lut=g.constant(w.lut, name=f"{name}.lut"), axis=0, block_size=w.block_size,
                                    scale=g.constant(w.scale, name=f"{name}.scale"))
            if w.lut is not None:
                return g.dequantize(q, lut=g.constant(w.lut, name=f"{name}.lut"))
            params = {"scale": g.constant(w.scale, name=f"{name}.scale")}
            if w.zero_point is not None:
                params["zero_point"] = g.constant(w.zero_point, name=f"{name}.zero_point")
            if w.bias is not None:
                params["bias"] = g.constant(w.bias, name=f"{name}.bias")
            return g.dequantize(q, axis=0, block_size=w.block_size, **params)
        if _is_bfloat16(w):  # stays bf16 [in, out]; consumers see float32 (backends multiply the bf16 directly)
            return g.cast(g.constant(np.ascontiguousarray(np.asarray(w).T), name=name), dt.float32)
        return g.constant(np.ascontiguousarray(np.asarray(w, np.float32).T), name=name)

    def matrix(self, name: str, shape: tuple[int, int]) -> Tensor:
        """The [out, in] weight as an [in, out] float tensor: a dequantize of its k-major form when
        quantized (the reduction axis first is what the CPU GEMV reads fastest; see QuantizedTensor),
        cast(bf16 constant, float32) when bfloat16 (a GGUF BF16 tensor, or random_weights(dense_dtype=))."""
        return self._constant(self._checked(name, shape), name)

    def matrices(self, names: list[str], shapes: list[tuple[int, int]]) -> list[Tensor] | Tensor:
        """Weights that multiply the same input, side by side as one [in, sum(out)] tensor when they
        share a quantized format or are all bfloat16 (one matmul instead of several); else a list, one per weight.
        A tensor stored under "+".join(names) (an Ingot LLM package) is that side-by-side weight."""
        fused = "+".join(names)
        if len(names) > 1 and fused in self.tensors:
            return self._constant(self.tensors[fused], fused)
        ws = [self._checked(n, s) for n, s in zip(names, shapes)]
        if all(isinstance(w, QuantizedTensor) for w in ws):
            try:
                return self._constant(concat_columns(ws), "+".join(names))
            except ValueError:
                pass
        if len(ws) > 1 and all(_is_bfloat16(w) for w in ws):  # [out, in] rows stacked: [in, sum(out)] after the transpose
            return self._constant(np.concatenate([np.asarray(w) for w in ws], axis=0), "+".join(names))
        return [self._constant(w, n) for w, n in zip(ws, names)]


def adapted(g: Graph, weights: Weights, names: list[str], x: Tensor, y: Tensor) -> Tensor:
    """y plus a separately compiled adapter's delta(x) when one of these weights has an adapter site:
    a `call` named "+".join(names), bound (and re-bound) to an executable, e.g. LoRA x @ A.T @ B.T."""
    weights.inputs["+".join(names)] = x  # calibration reads these (activation statistics per weight)
    if not weights.adapter_sites.intersection(names):
        return y
    (delta,) = g.call("+".join(names), [x], [TensorType(y.shape, y.dtype)])
    # y + delta, typed as y: a call's declared output keeps the build-time dynamic length, and
    # [1, n] + [?, n] would leave every later shape (and the next call's input) dynamic at decode
    return g.slice_update(y, y + delta, [0, 0])


def linear_split(g: Graph, x: Tensor, weights: Weights, names: list[str], shapes: list[tuple[int, int]]) -> list[Tensor]:
    """[x @ w.T for each weight], computed as one matmul over the weights side by side when possible."""
    fused = weights.matrices(names, shapes)
    if isinstance(fused, list):
        return [adapted(g, weights, [n], x, linear(g, x, w)) for n, w in zip(names, fused)]
    y = adapted(g, weights, names, x, linear(g, x, fused))
    outs, at = [], 0
    for rows, _ in shapes:
        outs.append(g.slice(y, [0, at], [None, at + rows]))
        at += rows
    return outs


def linear(g: Graph, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ w (+ bias); x: [T, in], w: [in, out]."""
    y = g.matmul(x, w)
    return y + bias if bias is not None else y


def attention(g: Graph, cfg: LlamaConfig, weights: Weights, layer: int, x: Tensor, pos: Tensor, inv_freq,
              batch: int = 1) -> Tensor:
    """Causal self-attention for one layer, writing this chunk's K/V into the cache variables.

    x: [B*T, dim], B sequences of T tokens (sequence-major), all at position `pos`."""
    p = f"blk.{layer}."
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    bias = (lambda n: weights.vector(p + n)) if cfg.qkv_bias else (lambda n: None)  # noqa: E731
    q, k, v = linear_split(g, x, weights, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                           [(nh * hd, cfg.dim), (nkv * hd, cfg.dim), (nkv * hd, cfg.dim)])
    if cfg.qkv_bias:
        q, k, v = q + bias("attn_q.bias"), k + bias("attn_k.bias"), v + bias("attn_v.bias")
    if batch == 1:
        heads = lambda t, n: g.reshape(g.transpose(g.reshape(t, (-1, n, hd)), (1, 0, 2)), (1, n, -1, hd))  # noqa: E731
    else:
        heads = lambda t, n: g.transpose(g.reshape(t, (batch, -1, n, hd)), (0, 2, 1, 3))  # noqa: E731
    q, k, v = heads(q, nh), heads(k, nkv), heads(v, nkv)            # [B, H, T, hd]
    rope = dict(base=cfg.rope_base, interleaved=cfg.rope_interleaved, rotary_dims=cfg.rope_dims, inv_freq=inv_freq)
    q = g.rope(q, pos, **rope)
    k = g.rope(k, pos, **rope)
    k_cache = g.variable(np.zeros((batch, nkv, cfg.context_length, hd), np.float32), name=f"{p}k_cache")
    v_cache = g.variable(np.zeros((batch, nkv, cfg.context_length, hd), np.float32), name=f"{p}v_cache")
    k_all = g.slice_update(k_cache, k, [0, 0, pos, 0])                # written in place by the compiler
    v_all = g.slice_update(v_cache, v, [0, 0, pos, 0])
    g.assign(k_cache, k_all)
    g.assign(v_cache, v_all)
    end = pos + (g.dim(x, 0) if batch == 1 else g.dim(q, 2))         # T tokens per sequence
    k_seen = g.slice(k_all, [0, 0, 0, 0], [None, None, end, None])  # attention over the valid prefix
    v_seen = g.slice(v_all, [0, 0, 0, 0], [None, None, end, None])
    out = g.scaled_dot_product_attention(q, k_seen, v_seen, causal=True)  # [B, nh, T, hd]
    if batch == 1:
        out = g.reshape(g.transpose(g.reshape(out, (nh, -1, hd)), (1, 0, 2)), (-1, nh * hd))
    else:
        out = g.reshape(g.transpose(out, (0, 2, 1, 3)), (-1, nh * hd))   # [B*T, nh*hd]
    return adapted(g, weights, [p + "attn_output.weight"], out, linear(g, out, weights.matrix(p + "attn_output.weight", (cfg.dim, nh * hd))))


def feed_forward(g: Graph, cfg: LlamaConfig, weights: Weights, layer: int, x: Tensor) -> Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    p = f"blk.{layer}."
    gate, up = linear_split(g, x, weights, [p + "ffn_gate.weight", p + "ffn_up.weight"],
                            [(cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim)])
    h = g.silu(gate) * up
    return adapted(g, weights, [p + "ffn_down.weight"], h, linear(g, h, weights.matrix(p + "ffn_down.weight", (cfg.dim, cfg.ffn_dim))))


@dataclass
class LlamaGraph:
    graph: Graph
    tokens: Tensor
    pos: Tensor
    last: Tensor
    logits: Tensor
    config: LlamaConfig
    callables_for: Callable[[dict[str, int], str], dict] | None = None  # {call name: input rows}, device -> {name: executable}
    inputs: dict[str, Tensor] = field(default_factory=dict)             # what each (fused) weight multiplies
    batch: int = 1                                                      # sequences decoded in lockstep

    def compile(self, length: int, device: str = "cpu"):
        """The executable for `length` tokens per step and sequence (1 = decode); cached by the graph.
        Its tokens feed is [batch * length] (sequence-major). Adapter call sites are (re)bound to
        `callables_for({site: rows}, device)`, which costs no recompile."""
        exe = self.graph.compile(feeds={self.tokens: TensorType((self.batch * length,), dt.int32)}, targets=[self.logits],
                                 device=device)
        if self.callables_for is not None:
            rows = {name: site.src[0].type.shape[0] for name, site in exe.call_sites.items()}
            for name, callee in self.callables_for(rows, device).items():
                if exe.callables.get(name) is not callee:
                    exe.bind(name, callee)
        return exe


def build(cfg: LlamaConfig, tensors: dict, path: str = "", adapter_sites=(), all_logits: bool = False,
          batch: int = 1) -> LlamaGraph:
    """The decoder graph over GGUF-named tensors (numpy arrays or QuantizedTensors).

    adapter_sites: weight names (e.g. "blk.0.attn_q.weight") whose outputs add a called adapter
    (see `adapted`); all_logits: logits for every position [T, vocab] instead of row `last`.
    batch: B sequences decoded in lockstep (one shared position): tokens [B*T] sequence-major, KV
    caches [B, nkv, ctx, hd], logits [B, vocab] (row `last` of each sequence) or [B*T, vocab].

        >>> m = build(cfg, random_weights(cfg), batch=4)                     # doctest: +SKIP
        >>> m.compile(1).run({"tokens": ids4, "pos": np.int32(p), "last": np.int32(0)})  # doctest: +SKIP
    """
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise IngotError(f"llama.build: batch must be a whole number of sequences >= 1, got {batch!r}.")
    batch = int(batch)
    g = Graph()
    weights = Weights(g, tensors, path, adapter_sites)
    tokens = g.placeholder((None,), dt.int32, name="tokens")   # this step's token ids
    pos = g.placeholder((), dt.int32, name="pos")              # position of tokens[0]
    last = g.placeholder((), dt.int32, name="last")            # which row's logits to return
    inv_freq = rope_inv_freq(cfg.rope_dims, cfg.rope_base)
    if "rope_freqs.weight" in tensors:                         # Llama 3 frequency scaling
        inv_freq = inv_freq / np.asarray(tensors["rope_freqs.weight"], np.float32)
    inv_freq = (inv_freq / np.float32(cfg.rope_scale)).astype(np.float32)
    embed = weights.matrix("token_embd.weight", (cfg.vocab_size, cfg.dim))   # [dim, vocab]
    x = g.transpose(g.gather(embed, tokens, axis=1), (1, 0))  # [T, dim]; only these columns are dequantized
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        x = x + attention(g, cfg, weights, layer, g.rms_norm(x, weights.vector(p + "attn_norm.weight"), cfg.norm_eps), pos, inv_freq,
                          batch)
        x = x + feed_forward(g, cfg, weights, layer, g.rms_norm(x, weights.vector(p + "ffn_norm.weight"), cfg.norm_eps))
    if not all_logits and batch == 1:
        x = g.slice(x, [last, 0], size=[1, None])              # only the row whose logits we need
    elif not all_logits:                                       # row `last` of each sequence: [B, dim]
        x = g.reshape(g.slice(g.reshape(x, (batch, -1, cfg.dim)), [0, last, 0], size=[None, 1, None]), (batch, cfg.dim))
    x = g.rms_norm(x, weights.vector("output_norm.weight"), cfg.norm_eps)
    head = embed if cfg.tied_embeddings else weights.matrix("output.weight", (cfg.vocab_size, cfg.dim))
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = adapted(g, weights, [head_name], x, linear(g, x, head))   # [B, vocab]
    return LlamaGraph(g, tokens, pos, last, logits, cfg, inputs=weights.inputs, batch=batch)


def random_weights(cfg: LlamaConfig, seed: int = 0, block_size: int = 32, qdtype: dt.DType = dt.uint4,
                   k_major: bool = False, f16_params: bool = False, matrix=None, dense_dtype: str | None = None) -> dict:
    """GGUF-named random weights of the config's shapes (quantized matrices), for tests and GPU runs.

    k_major=True makes the quantized matrices straight in the builder's k-major form (random bytes,
    no repacking: Llama-3-8B shapes in seconds); f16_params rounds scales as a Q4_1 file stores them.
    matrix(rng, rows, cols), when given, makes each [out, in] matrix instead (float weights, say).
    dense_dtype="float32" or "bfloat16" makes unquantized [out, in] matrices of that dtype, normal
    with standard deviation 1/sqrt(in) (the same draws for both, rounded; norm vectors stay float32):

        >>> t = random_weights(LlamaConfig(1, 64, 4, 2, 128, 100), dense_dtype="bfloat16")
        >>> t["blk.0.attn_q.weight"].dtype.name, t["blk.0.attn_norm.weight"].dtype.name
        ('bfloat16', 'float32')
    """
    if dense_dtype is not None:
        if matrix is not None:
            raise IngotError("random_weights: give matrix= or dense_dtype=, not both.")
        if dense_dtype not in ("float32", "bfloat16"):
            raise IngotError(f"random_weights: dense_dtype must be 'float32' or 'bfloat16', not {dense_dtype!r}.")
        storage = dt.float32.numpy if dense_dtype == "float32" else dt.bfloat16.storage
        matrix = lambda rng, rows, cols: (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(storage)  # noqa: E731
    rng = np.random.default_rng(seed)
    levels = 16 if qdtype.bits == 4 else 256

    def quantized(rows, cols):  # the [rows = out, cols = in] weight
        nb = cols // block_size
        if k_major:
            width = rows // 2 if qdtype.packed else rows
            q = rng.integers(0, 256, size=(cols, width), dtype=np.uint8).view(qdtype.storage)
            scale = rng.random((nb, rows), np.float32)
        else:
            values = rng.integers(0, levels, size=(rows, cols)) - (levels // 2 if qdtype.kind == "i" else 0)
            q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
            scale = rng.random((rows, nb), np.float32)
        scale = (scale * 0.02 / math.sqrt(cols / 64) + 1e-3).astype(np.float32)
        if f16_params:
            scale = scale.astype(np.float16).astype(np.float32)
        bias = (-scale * (levels / 2)).astype(np.float32) if qdtype.kind == "u" else None
        shape = (cols, rows) if k_major else (rows, cols)
        return QuantizedTensor(q, qdtype, shape, block_size, scale, bias, block_axis=0 if k_major else 1)

    if matrix is not None:
        quantized = lambda rows, cols: matrix(rng, rows, cols)  # noqa: E731
    hd = cfg.head_dim
    t = {"token_embd.weight": quantized(cfg.vocab_size, cfg.dim),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)}
    if not cfg.tied_embeddings:
        t["output.weight"] = quantized(cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
        t[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(cfg.dim)).astype(np.float32)
        t[p + "attn_q.weight"] = quantized(cfg.n_heads * hd, cfg.dim)
        t[p + "attn_k.weight"] = quantized(cfg.n_kv_heads * hd, cfg.dim)
        t[p + "attn_v.weight"] = quantized(cfg.n_kv_heads * hd, cfg.dim)
        t[p + "attn_output.weight"] = quantized(cfg.dim, cfg.n_heads * hd)
        t[p + "ffn_gate.weight"] = quantized(cfg.ffn_dim, cfg.dim)
        t[p + "ffn_up.weight"] = quantized(cfg.ffn_dim, cfg.dim)
        t[p + "ffn_down.weight"] = quantized(cfg.dim, cfg.ffn_dim)
        if cfg.qkv_bias:
            for n, rows in (("attn_q.bias", cfg.n_heads * hd), ("attn_k.bias", cfg.n_kv_heads * hd), ("attn_v.bias", cfg.n_kv_heads * hd)):
                t[p + n] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
    return t
