"""The blocks every decoder family is built from (gpt-fast style: a config dataclass, one function
per block, shapes in comments).

A family module (llama.py, qwen3.py, gemma.py) maps its GGUF metadata to a config with one table
(`Key` entries read by `config_from_gguf`) and builds its graph from these blocks with plain ops:
rms_norm, dequantize -> matmul, rope, slice_update of the KV-cache variables, and
scaled_dot_product_attention. The compiler's passes fuse them on every device; nothing here fuses
by hand.

    tokens: int32 [B*T]   pos: int32 []   last: int32 []   ->   logits: float32 [B, vocab]

Compiling a graph for T = 1 gives the decode executable (static shapes, the position a runtime
scalar); compiling for a prompt chunk length gives a prefill executable (cached per length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor
from ..ir import TensorType
from ..ops.nn import rope_inv_freq
from ..quant.formats import QuantizedTensor, TwoLevelParams, concat_columns


MAX_DIMENSION = 1 << 24  # any count or size a config may hold (layers, dims, vocabulary, context)
# what the KV cache may be stored in: attention widens each key and value to float32 as it reads it
# (bfloat16 or float16 halve the cache's bytes; int8 quarters them: each row of hd values as int8 codes
# and one float32 scale, `kv_cache`)
KV_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclass
class DecoderConfig:
    """What every decoder family shares; a family's config adds its own fields."""
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    head_dim: int = 0                   # 0: dim // n_heads (GGUF attention.key_length when it differs)
    rope_base: float = 10000.0
    rope_dims: int = 0
    rope_interleaved: bool = True       # GGUF stores Llama's Q/K permuted for llama.cpp's interleaved RoPE
    rope_scale: float = 1.0             # linear position scaling (YaRN: its factor)
    rope_scaling: str = ""              # "" (none or linear by rope_scale), "yarn" or "longrope"
    rope_original_context: int = 0      # YaRN, LongRoPE: the context the model was trained with
    rope_attn_factor: float = 1.0       # LongRoPE: what cos and sin are multiplied by (the scores by its square)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0            # YaRN's cos/sin factor is mscale(f, yarn_mscale) / mscale(f, yarn_mscale_all_dim)
    yarn_mscale_all_dim: float = 0.0    # when both are non-zero (Mistral 3); mscale(f) = 0.1 ln(f) + 1 otherwise
    norm_eps: float = 1e-5
    context_length: int = 2048
    tied_embeddings: bool = False
    qkv_bias: bool = False
    kv_dtype: str = "float32"           # the KV cache variables' dtype (KV_DTYPES): new rows rounded as written
    extra: dict = field(default_factory=dict)

    family: ClassVar[str] = ""          # the models/ module that builds it

    def __post_init__(self):
        self.validate()
        self.head_dim = self.head_dim or self.dim // self.n_heads
        self.rope_dims = self.rope_dims or self.head_dim
        if self.rope_dims > self.head_dim or self.rope_dims % 2:
            raise IngotError(f"{self.family}: rope_dims {self.rope_dims} must be even and at most head_dim {self.head_dim}.")

    def validate(self) -> None:
        """Every field of the type and range a decoder can be built from (a file or llm.json may say
        anything): positive counts, heads that divide, finite numbers. One IngotError otherwise."""
        counts = {"n_layers": self.n_layers, "dim": self.dim, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                  "ffn_dim": self.ffn_dim, "vocab_size": self.vocab_size, "context_length": self.context_length}
        for name, value in {**counts, "head_dim": self.head_dim, "rope_dims": self.rope_dims}.items():
            low = 1 if name in counts else 0
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= MAX_DIMENSION:
                raise IngotError(f"{self.family}: {name} must be an integer in {low}..{MAX_DIMENSION}, not {value!r}.")
        for name in ("rope_base", "rope_scale", "norm_eps"):
            value = getattr(self, name)
            if not _finite(value) or value < 0 or (value == 0 and name != "norm_eps"):
                raise IngotError(f"{self.family}: {name} must be a finite positive number, not {value!r}.")
        for name in ("yarn_mscale", "yarn_mscale_all_dim"):
            if not _finite(getattr(self, name)) or getattr(self, name) < 0:
                raise IngotError(f"{self.family}: {name} must be a finite number >= 0, not {getattr(self, name)!r}.")
        if self.rope_scaling not in ("", "linear", "yarn", "longrope"):
            raise IngotError(f"{self.family}: rope_scaling must be '', 'linear', 'yarn' or 'longrope', not {self.rope_scaling!r}.")
        if self.rope_scaling == "longrope" and (
                isinstance(self.rope_original_context, bool) or not isinstance(self.rope_original_context, (int, np.integer))
                or not 1 <= self.rope_original_context <= MAX_DIMENSION or not _finite(self.rope_attn_factor)
                or self.rope_attn_factor <= 0 or self.rope_dims not in (0, self.head_dim or self.dim // self.n_heads)):
            raise IngotError(f"{self.family}: LongRoPE needs an original context in 1..{MAX_DIMENSION}, a positive "
                             f"attention factor and RoPE over whole heads, not {self.rope_original_context!r}, "
                             f"{self.rope_attn_factor!r}, rope_dims {self.rope_dims}.")
        if self.rope_scaling == "yarn" and (isinstance(self.rope_original_context, bool) or not isinstance(
                self.rope_original_context, (int, np.integer)) or not 1 <= self.rope_original_context <= MAX_DIMENSION
                or not all(_finite(b) and b > 0 for b in (self.yarn_beta_fast, self.yarn_beta_slow))
                or self.rope_dims not in (0, self.head_dim or self.dim // self.n_heads)):
            raise IngotError(f"{self.family}: YaRN needs an original context in 1..{MAX_DIMENSION}, positive betas "
                             f"and RoPE over whole heads, not {self.rope_original_context!r}, {self.yarn_beta_fast!r}, "
                             f"{self.yarn_beta_slow!r}, rope_dims {self.rope_dims}.")
        if self.kv_dtype not in KV_DTYPES:
            raise IngotError(f"{self.family}: kv_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}.")
        if self.n_heads % self.n_kv_heads:
            raise IngotError(f"{self.family}: {self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads.")
        if not self.head_dim and self.dim % self.n_heads:
            raise IngotError(f"{self.family}: dim {self.dim} is not a multiple of {self.n_heads} heads (and no head_dim is given).")


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value)


# --------------------------------------------------------------------------------------------
# GGUF metadata -> config, by table.


@dataclass(frozen=True)
class Key:
    """One row of a family's metadata table: GGUF key `{architecture}.{key}` -> config field, with
    the range a value must lie in (integers: [minimum, MAX_DIMENSION]; numbers: as metadata_float)."""
    key: str
    field: str
    kind: type = int
    required: bool = False
    minimum: float | None = None        # None: 1 for integers, 0 for numbers
    maximum: float = 1e30
    exclusive_minimum: bool = False


def config_from_gguf(cls, model, table: tuple[Key, ...], **computed) -> DecoderConfig:
    """cls(**fields) from the GGUF metadata keys in `table` (architecture prefix added), each checked
    (type, range, consistency) before anything is allocated from it, the shapes the tensor table
    implies, the rope scaling, and `computed` (family-specific values)."""
    from ..untrusted import metadata_float, metadata_int

    arch = model.architecture
    missing = [f"{arch}.{k.key}" for k in table if k.required and model.get(f"{arch}.{k.key}") is None]
    if missing:
        raise IngotError(f"{model.path}: metadata lacks {', '.join(missing)}.")
    values: dict[str, Any] = {}
    for k in table:
        full = f"{arch}.{k.key}"
        if model.get(full) is None:
            continue
        if k.kind is int:
            values[k.field] = metadata_int(model, full, None, 1 if k.minimum is None else int(k.minimum), MAX_DIMENSION)
        else:
            values[k.field] = metadata_float(model, full, 0.0, k.minimum or 0.0, k.maximum, k.exclusive_minimum)
    dim, n_heads = values["dim"], values["n_heads"]
    if not values.get("head_dim") and dim % n_heads:
        raise IngotError(f"{model.path}: {arch}.embedding_length {dim} is not a multiple of "
                         f"{arch}.attention.head_count {n_heads}.")
    head_dim = values.get("head_dim") or dim // n_heads
    rope_dims = values.get("rope_dims", 0)
    if rope_dims > head_dim or rope_dims % 2:
        raise IngotError(f"{model.path}: {arch}.rope.dimension_count is {rope_dims}; it must be even and at most "
                         f"the head dimension {head_dim}.")
    n_kv_heads = values.setdefault("n_kv_heads", n_heads)
    if n_heads % n_kv_heads:
        raise IngotError(f"{model.path}: {arch}.attention.head_count {n_heads} is not a multiple of "
                         f"{arch}.attention.head_count_kv {n_kv_heads}.")
    tensors = model.tensors
    if "token_embd.weight" not in tensors:
        raise IngotError(f"{model.path}: tensor token_embd.weight is missing.")
    shape = tensors.shape("token_embd.weight") if hasattr(tensors, "shape") else tensors["token_embd.weight"].shape
    values.update(vocab_size=int(shape[0]), tied_embeddings="output.weight" not in tensors,
                  qkv_bias="blk.0.attn_q.bias" in tensors, **rope_scaling(model))
    values.update(computed)
    try:
        return cls(**values)
    except IngotError as e:
        raise IngotError(f"{model.path}: {e}") from None


# architectures whose `rope.scaling.yarn_log_multiplier` is YaRN's mscale_all_dim (llama.cpp's reading of
# Mistral 3: mscale 1, the cos/sin factor mscale(f, 1) / mscale(f, mscale_all_dim)); elsewhere it is refused
YARN_MSCALE_ALL_DIM = ("mistral3",)


def rope_scaling(model) -> dict[str, Any]:
    """Config fields for `{arch}.rope.scaling.*`: none ({}), linear (rope_scale), or YaRN (rope_scaling
    "yarn", rope_scale = its factor, rope_original_context, yarn_beta_fast/slow, and for Mistral 3
    yarn_mscale/yarn_mscale_all_dim from its yarn_log_multiplier). Llama 3's scaling
    comes as the tensor rope_freqs.weight (see `rope_frequencies`). A kind or a YaRN variant Ingot does
    not implement (LongRoPE, YaRN with an attention factor or log multiplier of its own) is refused by
    name, never ignored: its logits would be wrong at long context."""
    from ..untrusted import metadata_float, metadata_int, metadata_str, short

    arch = model.architecture
    kind = metadata_str(model, f"{arch}.rope.scaling.type")
    factors = [name for name in ("rope_factors_long.weight", "rope_factors_short.weight") if name in model.tensors]
    if factors:
        return longrope_scaling(model, factors, kind)
    if kind is None or kind == "none":
        return {}
    factor = f"{arch}.rope.scaling.factor"
    if kind == "linear":
        return {"rope_scale": metadata_float(model, factor, 1.0, exclusive_minimum=True)}
    if kind == "yarn":
        mscale: dict[str, float] = {}
        if arch in YARN_MSCALE_ALL_DIM:      # its yarn_log_multiplier is transformers' mscale_all_dim, mscale 1
            all_dim = metadata_float(model, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)
            mscale = {"yarn_mscale": 1.0, "yarn_mscale_all_dim": all_dim} if all_dim else {}
        for key, plain in (("attn_factor", (1.0,)), ("yarn_attn_factor", (1.0,)), ("yarn_log_multiplier", (0.0,)),
                           ("yarn_ext_factor", (-1.0, 1.0))):
            if key == "yarn_log_multiplier" and arch in YARN_MSCALE_ALL_DIM:
                continue
            value = model.get(f"{arch}.rope.scaling.{key}")
            if value is not None and value not in plain:
                raise IngotError(f"{model.path}: YaRN with {arch}.rope.scaling.{key} = {short(value)} is not supported; "
                                 f"Ingot implements YaRN as transformers does by default.")
        if model.get(factor) is None:
            raise IngotError(f"{model.path}: metadata lacks {factor}, which YaRN scaling needs.")
        return {"rope_scaling": "yarn", "rope_scale": metadata_float(model, factor, 1.0, minimum=1.0), **mscale,
                "rope_original_context": metadata_int(model, f"{arch}.rope.scaling.original_context_length", None, 1,
                                                      MAX_DIMENSION),
                "yarn_beta_fast": metadata_float(model, f"{arch}.rope.scaling.yarn_beta_fast", 32.0, exclusive_minimum=True),
                "yarn_beta_slow": metadata_float(model, f"{arch}.rope.scaling.yarn_beta_slow", 1.0, exclusive_minimum=True)}
    raise IngotError(f"{model.path}: RoPE scaling {short(kind)} ({arch}.rope.scaling.type) is not supported; Ingot "
                     f"implements 'linear', 'yarn', Llama 3's rope_freqs and LongRoPE (rope_factors_long/short tensors).")


def longrope_scaling(model, factors: list[str], kind) -> dict[str, Any]:
    """Config fields for LongRoPE (Phi-3/3.5): the tensors rope_factors_long/short.weight divide the
    frequencies (see `decoder_rope`), `{arch}.rope.scaling.original_context_length` says which set a
    context needs, and cos/sin are multiplied by `{arch}.rope.scaling.attn_factor` (default, as
    transformers: sqrt(1 + ln(s) / ln(original)), s = context_length / original, when s > 1)."""
    from ..untrusted import metadata_float, metadata_int, short

    arch = model.architecture
    if kind not in (None, "none", "longrope", "su"):
        raise IngotError(f"{model.path}: RoPE scaling {short(kind)} ({arch}.rope.scaling.type) with LongRoPE factor "
                         f"tensors is not supported.")
    if len(factors) != 2:
        raise IngotError(f"{model.path}: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight; "
                         f"the file has only {factors[0]}.")
    original = metadata_int(model, f"{arch}.rope.scaling.original_context_length", None, 1, MAX_DIMENSION)
    trained = metadata_int(model, f"{arch}.context_length", original, 1, MAX_DIMENSION)
    stretch = trained / original
    default = math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1 and original > 1 else 1.0
    return {"rope_scaling": "longrope", "rope_original_context": original,
            "rope_attn_factor": metadata_float(model, f"{arch}.rope.scaling.attn_factor", default, exclusive_minimum=True)}


def rope_frequencies(rope_dims: int, base: float, scale: float = 1.0, tensors=None,
                     yarn: tuple[int, float, float] | None = None) -> np.ndarray:
    """RoPE inverse frequencies float32 [rope_dims / 2]: base ** (-2i / rope_dims), divided by Llama 3's
    rope_freqs.weight factors when the file has them, and by the linear position scale.

    yarn = (original context, beta_fast, beta_slow): YaRN's blend instead (scale is its factor): the
    pairs that turn fewer than beta_slow times over the original context are interpolated (/ scale),
    those that turn more than beta_fast times kept, a linear ramp between (transformers' default form)."""
    inv_freq = rope_inv_freq(rope_dims, base)
    if yarn is not None:
        original, beta_fast, beta_slow = yarn

        def pair(rotations: float) -> float:   # the pair index that turns `rotations` times over the original context
            return rope_dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), rope_dims - 1)
        interpolated = np.clip((np.arange(rope_dims // 2) - low) / ((high - low) or 0.001), 0, 1)
        f = inv_freq.astype(np.float64)
        return (f / scale * interpolated + f * (1 - interpolated)).astype(np.float32)
    if tensors is not None and "rope_freqs.weight" in tensors:      # Llama 3 frequency scaling
        inv_freq = inv_freq / np.asarray(tensors["rope_freqs.weight"], np.float32)
    return (inv_freq / np.float32(scale)).astype(np.float32)


def decoder_rope(cfg: DecoderConfig, tensors=None) -> tuple[np.ndarray, float | None]:
    """(inverse frequencies, the attention scale or None for 1 / sqrt(hd)) of cfg's RoPE and scaling.
    YaRN multiplies cos and sin by `yarn_magnitude`, i.e. the scores by its square. LongRoPE divides
    the frequencies by rope_factors_long.weight when the context (cfg.context_length, what the KV cache
    holds) exceeds the original one, by rope_factors_short.weight otherwise (llama.cpp's rule;
    transformers switches per call, by the longest position, so the two agree while every position
    is on one side), and multiplies cos and sin by rope_attn_factor."""
    if cfg.rope_scaling == "longrope":
        name = "rope_factors_long.weight" if cfg.context_length > cfg.rope_original_context else "rope_factors_short.weight"
        factors = np.asarray(tensors[name] if tensors is not None and name in tensors else (), np.float32)
        if factors.shape != (cfg.rope_dims // 2,) or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
            raise IngotError(f"{cfg.family}: tensor {name} must hold {cfg.rope_dims // 2} positive factors, "
                             f"not {factors.size} values.")
        inv_freq = (rope_inv_freq(cfg.rope_dims, cfg.rope_base) / factors).astype(np.float32)
        return inv_freq, cfg.rope_attn_factor ** 2 / math.sqrt(cfg.head_dim)
    if cfg.rope_scaling != "yarn":
        return rope_frequencies(cfg.rope_dims, cfg.rope_base, cfg.rope_scale, tensors), None
    inv_freq = rope_frequencies(cfg.rope_dims, cfg.rope_base, cfg.rope_scale,
                                yarn=(cfg.rope_original_context, cfg.yarn_beta_fast, cfg.yarn_beta_slow))
    return inv_freq, yarn_magnitude(cfg) ** 2 / math.sqrt(cfg.head_dim)


def yarn_magnitude(cfg: DecoderConfig) -> float:
    """What YaRN multiplies cos and sin by (transformers' attention_factor): mscale(f, m) = 0.1 m ln(f) + 1
    (1 for f <= 1); mscale(f, yarn_mscale) / mscale(f, yarn_mscale_all_dim) when both are given, else
    mscale(f, 1). Mistral 3 has both 1: a factor of 1, its scores unscaled."""
    def mscale(m: float) -> float:
        return 0.1 * m * math.log(cfg.rope_scale) + 1.0 if cfg.rope_scale > 1 else 1.0
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return mscale(cfg.yarn_mscale) / mscale(cfg.yarn_mscale_all_dim)
    return mscale(1.0)


def temperature_table(g: Graph, cfg: DecoderConfig, beta: float, length: int) -> tuple[Tensor, Tensor] | None:
    """Llama 4's attention temperature (Mistral 3): q at position p times 1 + beta ln(1 + floor(p / length)).
    (that factor for every position [context_length], the positions 0, 1, ... [context_length] int32), which
    the attention blocks gather at their positions; None when beta is 0."""
    if not beta:
        return None
    p = np.arange(cfg.context_length, dtype=np.float64)
    return (g.constant((1.0 + beta * np.log1p(np.floor(p / length))).astype(np.float32), name="attn_temperature"),
            g.constant(np.arange(cfg.context_length, dtype=np.int32), name="positions"))


# --------------------------------------------------------------------------------------------
# Weights.


def _is_bfloat16(w) -> bool:
    return isinstance(w, np.ndarray) and w.dtype == dt.bfloat16.storage


class Weights:
    """Looks up GGUF-named tensors and turns them into graph constants (quantized ones stay so)."""

    def __init__(self, g: Graph, tensors: dict, path: str = "", adapter_sites=()):
        self.g, self.tensors, self.path = g, tensors, path
        self.adapter_sites = frozenset(adapter_sites)  # weight names whose output gets a called adapter
        # or, for `ingot serve`'s rows decoders, every served adapter inline, chosen per row by a feed
        # (serve/adapters.RowAdapters: its `delta` builds a site's gathered matmuls instead of a call)
        self.row_adapters = adapter_sites if hasattr(adapter_sites, "delta") else None
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

    def _param(self, p, name: str) -> Tensor:
        """A k-major weight's block parameters: a constant, or for two-level ones (the :k formats as
        stored) codes times a unit per super-block, dequantized in the graph (the CPU backend's GEMV
        reads codes and units as they are: passes/fuse_two_level.py)."""
        g = self.g
        if isinstance(p, TwoLevelParams):
            return g.dequantize(g.constant(p.codes, name=f"{name}.codes"), axis=0, block_size=p.per_super,
                                scale=g.constant(p.units, name=f"{name}.units"))
        return g.constant(p, name=name)

    def _constant(self, w, name: str) -> Tensor:
        g = self.g
        if isinstance(w, QuantizedTensor):
            q = g.constant(w.q, dtype=w.qdtype if w.qdtype.packed else None, name=name)
            if w.lut is not None and w.scale is not None:  # a scaled lookup table (GGUF's IQ types, MXFP4; with
                bias = None if w.bias is None else g.constant(w.bias, name=f"{name}.bias")   # a bias lut4:bB:offset)
                return g.dequantize(q, lut=g.constant(w.lut, name=f"{name}.lut"), axis=0, block_size=w.block_size,
                                    scale=g.constant(w.scale, name=f"{name}.scale"), bias=bias)
            if w.lut is not None:
                return g.dequantize(q, lut=g.constant(w.lut, name=f"{name}.lut"))
            params = {"scale": self._param(w.scale, f"{name}.scale")}
            if w.zero_point is not None:
                params["zero_point"] = g.constant(w.zero_point, name=f"{name}.zero_point")
            if w.bias is not None:
                params["bias"] = self._param(w.bias, f"{name}.bias")
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
    if weights.row_adapters is not None:
        return y + weights.row_adapters.delta(g, names, x)
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


# --------------------------------------------------------------------------------------------
# The blocks.


def inputs(g: Graph) -> tuple[Tensor, Tensor, Tensor]:
    """The decoder's feeds: this step's token ids [B*T], the position of tokens[0], the logits row."""
    tokens = g.placeholder((None,), dt.int32, name="tokens")
    pos = g.placeholder((), dt.int32, name="pos")
    last = g.placeholder((), dt.int32, name="last")
    return tokens, pos, last


@dataclass(frozen=True)
class PoolFeeds:
    """What a pool rows decoder's attention reads per row (`row_inputs` with pool > 0): each row's
    position [rows] and the pool entry (slot) holding its sequence's K/V [rows]; `size` entries."""
    positions: Tensor
    slots: Tensor
    size: int


def row_inputs(g: Graph, rows: int, pool: int = 0) -> tuple[Tensor, Tensor | PoolFeeds, Tensor]:
    """The feeds of a decode step over `rows` independent sequences (`ingot serve`'s continuous
    batching): one token per row [rows], each row's own position [rows] (and an unused `last`).
    pool > 0: the K/V live in one pool of `pool` entries per layer (blk.L.k_pool [pool, nkv, ctx, hd]),
    and a `slots` feed [rows] says which entry each row reads and writes (`PoolFeeds`)."""
    if isinstance(pool, bool) or not isinstance(pool, (int, np.integer)) or pool < 0 or (pool and not rows):
        raise IngotError(f"build: pool must be a number of KV entries >= 0 (with rows > 0), got {pool!r}.")
    tokens = g.placeholder((None,), dt.int32, name="tokens")
    positions = g.placeholder((rows,), dt.int32, name="positions")
    last = g.placeholder((), dt.int32, name="last")
    if pool:
        return tokens, PoolFeeds(positions, g.placeholder((rows,), dt.int32, name="slots"), int(pool)), last
    return tokens, positions, last


def checked_rows(rows) -> int:
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
        raise IngotError(f"build: rows must be a whole number of sequences >= 0, got {rows!r}.")
    return int(rows)


def checked_batch(batch) -> int:
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise IngotError(f"build: batch must be a whole number of sequences >= 1, got {batch!r}.")
    return int(batch)


def embedding(g: Graph, cfg: DecoderConfig, weights: Weights, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(x [B*T, dim], the embedding matrix [dim, vocab]); only the looked-up columns are dequantized."""
    embed = weights.matrix("token_embd.weight", (cfg.vocab_size, cfg.dim))   # [dim, vocab]
    x = g.transpose(g.gather(embed, tokens, axis=1), (1, 0))
    if "token_embd.weight" in weights.adapter_sites:   # a tied head's compensation: the lookup reads W + delta too
        from ..adapters import LOOKUP

        if weights.row_adapters is not None:
            return x + weights.row_adapters.lookup(g, "token_embd.weight", tokens, cfg.dim), embed
        (delta,) = g.call(LOOKUP, [tokens], [TensorType(x.shape, x.dtype)])
        x = x + delta
    return x, embed


def rms_norm(g: Graph, cfg: DecoderConfig, weights: Weights, name: str, x: Tensor) -> Tensor:
    """x / rms(x) * w over the last axis (GGUF stores Gemma's (1 + w) already added)."""
    return g.rms_norm(x, weights.vector(name), cfg.norm_eps)


def split_heads(g: Graph, t: Tensor, n: int, hd: int, batch: int) -> Tensor:
    """[B*T, n*hd] -> [B, n, T, hd]."""
    if batch == 1:
        return g.reshape(g.transpose(g.reshape(t, (-1, n, hd)), (1, 0, 2)), (1, n, -1, hd))
    return g.transpose(g.reshape(t, (batch, -1, n, hd)), (0, 2, 1, 3))


def merge_heads(g: Graph, t: Tensor, n: int, hd: int, batch: int) -> Tensor:
    """[B, n, T, hd] -> [B*T, n*hd]."""
    if batch == 1:
        return g.reshape(g.transpose(g.reshape(t, (n, -1, hd)), (1, 0, 2)), (-1, n * hd))
    return g.reshape(g.transpose(t, (0, 2, 1, 3)), (-1, n * hd))


@dataclass(frozen=True)
class Cache:
    """One K or V cache: `values` [..., context, hd] of cfg.kv_dtype, and for an int8 cache `scales`
    [..., context, 1] float32, one per row (the variable named like values with "_scale" after k/v)."""
    values: Tensor
    scales: Tensor | None = None


def cache_kinds(cfg) -> tuple[str, ...]:
    """The kinds of cache variable a layer holds (blk.L.{kind}_cache, _pool): k and v, and an int8
    cache's row scales."""
    return ("k", "v", "k_scale", "v_scale") if getattr(cfg, "kv_dtype", "float32") == "int8" else ("k", "v")


def kv_cache(g: Graph, cfg: DecoderConfig, layer: int, batch: int, kind: str = "cache",
             suffix: str = "") -> tuple[Cache, Cache]:
    """This layer's K and V caches [B, nkv, context, hd] of cfg.kv_dtype, zeros at first
    (blk.L.k_{kind}{suffix}, v_...; an int8 cache's scales blk.L.k_scale_{kind}{suffix}, ...)."""
    shape = (batch, cfg.n_kv_heads, cfg.context_length, cfg.head_dim)
    return tuple(_cache_variable(g, cfg, shape, f"blk.{layer}.{kv}_{kind}{suffix}", f"blk.{layer}.{kv}_scale_{kind}{suffix}")
                 for kv in ("k", "v"))


def _cache_variable(g: Graph, cfg: DecoderConfig, shape: tuple, name: str, scale_name: str = "") -> Cache:
    """A zero cache of cfg.kv_dtype; slice_update rounds each float32 row written into it, and
    attention reads it widened to float32. int8: codes and their row scales (`write_rows`)."""
    kind = dt.by_name(getattr(cfg, "kv_dtype", "float32"))
    values = g.variable(np.zeros(shape, kind.storage), name=name)
    if kind != dt.int8:
        return Cache(values)
    return Cache(values, g.variable(np.zeros(shape[:-1] + (1,), np.float32), name=scale_name))


ROW_SCALE_MIN = np.float32(2.0 ** -126)   # ops.nn.ROW_SCALE_MIN (a row of zeros: codes 0, no division by 0)


def write_rows(g: Graph, cache: Cache, rows: Tensor, start: list) -> Cache:
    """The cache with float32 rows [..., T, hd] written at `start` (slice_update, in place after the
    compiler's inplace pass) and assigned back; an int8 cache stores each row as codes round(x / s)
    and its scale s = max(max|x| / 127, ROW_SCALE_MIN) (ops.nn.quantized_rows)."""
    if cache.scales is None:
        values = g.slice_update(cache.values, rows, start)
        g.assign(cache.values, values)
        return Cache(values)
    scale = g.maximum(g.max(g.abs(rows), axis=-1, keepdims=True) / np.float32(127), ROW_SCALE_MIN)
    codes = g.quantize(rows, dt.int8, scale)
    values, scales = g.slice_update(cache.values, codes, start), g.slice_update(cache.scales, scale, start)
    g.assign(cache.values, values)
    g.assign(cache.scales, scales)
    return Cache(values, scales)


def read_prefix(g: Graph, cache: Cache, end: Tensor) -> Tensor:
    """The cache's first `end` rows [..., end, hd] as attention reads them (an int8 cache dequantized:
    the fuse_dequantize pass hands the codes and scales to the attention, no float copy is made)."""
    def prefix(t):
        return g.slice(t, [0] * t.ndim, [None] * (t.ndim - 2) + [end, None])
    if cache.scales is None:
        return prefix(cache.values)
    return g.dequantize(prefix(cache.values), scale=prefix(cache.scales))


def attention(g: Graph, cfg: DecoderConfig, weights: Weights, layer: int, x: Tensor, pos: Tensor, inv_freq: np.ndarray,
              batch: int = 1, *, qk_norm: bool = False, window: int = 0, softcap: float = 0.0,
              scale: float | None = None, rope_base: float | None = None, rows: int = 0,
              q_scale: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal self-attention for one layer, writing this chunk's K/V into the cache variables.

    x: [B*T, dim], B sequences of T tokens (sequence-major), all at position `pos`. qk_norm: rms_norm
    of each head of q and k (weights attn_q_norm/attn_k_norm [hd]) before RoPE; window: sliding-window
    attention over the last `window` positions; softcap: scores c * tanh(s / c); scale: of the
    scores (None: 1 / sqrt(hd)); rope_base: what inv_freq was made from (None: cfg.rope_base);
    inv_freq None: no RoPE at all (SmolLM3's NoPE layers); q_scale: what q at each position is
    multiplied by (Mistral 3's attention temperature: `temperature_table`). rows > 0: x is [rows, dim], one token of each of `rows` independent sequences, and pos their
    positions [rows] (see `row_attention`); batch is 1."""
    p = f"blk.{layer}."
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q, k, v = linear_split(g, x, weights, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                           [(nh * hd, cfg.dim), (nkv * hd, cfg.dim), (nkv * hd, cfg.dim)])   # [B*T, h*hd]
    if cfg.qkv_bias:
        q, k, v = (q + weights.vector(p + "attn_q.bias"), k + weights.vector(p + "attn_k.bias"),
                   v + weights.vector(p + "attn_v.bias"))
    if rows:   # one token per row, each at its own position, over its own cache (ingot serve)
        out = row_attention(g, cfg, weights, layer, q, k, v, pos, inv_freq, rows, qk_norm=qk_norm, window=window,
                            softcap=softcap, scale=scale, rope_base=rope_base, q_scale=q_scale)
        return adapted(g, weights, [p + "attn_output.weight"], out,
                       linear(g, out, weights.matrix(p + "attn_output.weight", (cfg.dim, nh * hd))))
    q, k, v = split_heads(g, q, nh, hd, batch), split_heads(g, k, nkv, hd, batch), split_heads(g, v, nkv, hd, batch)
    if qk_norm:                                                       # per head, over hd
        q = rms_norm(g, cfg, weights, p + "attn_q_norm.weight", q)
        k = rms_norm(g, cfg, weights, p + "attn_k_norm.weight", k)
    count = g.dim(x, 0) if batch == 1 else g.dim(q, 2)                # T tokens per sequence
    end = pos + count
    if q_scale is not None:                                           # before RoPE, which is linear per position
        table, iota = q_scale   # f(pos + t), t < T: iota[:T] is a constant once compile fixes T
        q = q * g.reshape(g.gather(table, g.slice(iota, [0], [count]) + pos), (1, 1, -1, 1))
    if inv_freq is not None:
        rope = dict(base=cfg.rope_base if rope_base is None else rope_base, interleaved=cfg.rope_interleaved, rotary_dims=cfg.rope_dims, inv_freq=inv_freq)
        q = g.rope(q, pos, **rope)                                    # [B, nh, T, hd]
        k = g.rope(k, pos, **rope)                                    # [B, nkv, T, hd]
    k_cache, v_cache = kv_cache(g, cfg, layer, batch)
    k_all = write_rows(g, k_cache, k, [0, 0, pos, 0])                # written in place by the compiler
    v_all = write_rows(g, v_cache, v, [0, 0, pos, 0])
    k_seen = read_prefix(g, k_all, end)                               # attention over the valid prefix
    v_seen = read_prefix(g, v_all, end)
    out = g.scaled_dot_product_attention(q, k_seen, v_seen, scale=scale, causal=True, window=window,
                                         softcap=softcap)             # [B, nh, T, hd]
    out = merge_heads(g, out, nh, hd, batch)                          # [B*T, nh*hd]
    return adapted(g, weights, [p + "attn_output.weight"], out,
                   linear(g, out, weights.matrix(p + "attn_output.weight", (cfg.dim, nh * hd))))


def row_cache(g: Graph, cfg: DecoderConfig, layer: int, row: int) -> tuple[Cache, Cache]:
    """Row `row`'s own K and V caches [1, nkv, context, hd] (blk.L.k_cache.ROW): the
    arrays of a batch-1 decoder's state, so a server maps each row to any sequence's cache."""
    return kv_cache(g, cfg, layer, 1, suffix=f".{row}")


def row_attention(g: Graph, cfg: DecoderConfig, weights: Weights, layer: int, q: Tensor, k: Tensor, v: Tensor,
                  positions: Tensor, inv_freq: np.ndarray, rows: int, *, qk_norm: bool = False, window: int = 0,
                  softcap: float = 0.0, scale: float | None = None, rope_base: float | None = None,
                  q_scale: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Decode attention of `rows` independent sequences, one token each, every row at its own
    position and over its own cache: q [rows, nh*hd], k and v [rows, nkv*hd] -> [rows, nh*hd].

    Row r runs the batch-1 decode step's kernels on arrays laid out as that step's (RoPE at
    positions[r], its K/V written in place at positions[r] of blk.L.k_cache.r / v_cache.r,
    attention over positions 0..positions[r]), so its result is bit for bit what a batch-1 decoder
    computes and never depends on another row. (A strided q, sliced out of [1, nh, rows, hd], gave
    1e-6 differences: numba's fastmath kernels vectorise differently for non-contiguous arrays.)"""
    if isinstance(positions, PoolFeeds):
        return pool_row_attention(g, cfg, weights, layer, q, k, v, positions, inv_freq, rows, qk_norm=qk_norm,
                                  window=window, softcap=softcap, scale=scale, rope_base=rope_base, q_scale=q_scale)
    p = f"blk.{layer}."
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    rope = dict(base=cfg.rope_base if rope_base is None else rope_base, interleaved=cfg.rope_interleaved,
                rotary_dims=cfg.rope_dims, inv_freq=inv_freq)
    # one token per row: [rows, h*hd] -> [rows, h, 1, hd] is a reshape, and row r's slice of it is
    # contiguous, laid out as a batch-1 step's [1, h, 1, hd] (the kernels see the same arrays)
    q, k, v = g.reshape(q, (rows, nh, 1, hd)), g.reshape(k, (rows, nkv, 1, hd)), g.reshape(v, (rows, nkv, 1, hd))
    if qk_norm:                                                       # per head, over hd
        q = rms_norm(g, cfg, weights, p + "attn_q_norm.weight", q)
        k = rms_norm(g, cfg, weights, p + "attn_k_norm.weight", k)
    outs = []
    for r in range(rows):
        pos = g.reshape(g.slice(positions, [r], [r + 1]), ())
        q_r, k_r, v_r = (g.slice(t, [r], [r + 1]) for t in (q, k, v))  # [1, h, 1, hd]
        if q_scale is not None:
            q_r = q_r * g.reshape(g.gather(q_scale[0], g.reshape(pos, (1,))), (1, 1, 1, 1))
        if inv_freq is not None:
            q_r, k_r = g.rope(q_r, pos, **rope), g.rope(k_r, pos, **rope)
        k_cache, v_cache = row_cache(g, cfg, layer, r)
        k_all = write_rows(g, k_cache, k_r, [0, 0, pos, 0])           # written in place by the compiler
        v_all = write_rows(g, v_cache, v_r, [0, 0, pos, 0])
        end = pos + 1
        k_seen = read_prefix(g, k_all, end)                           # attention over the valid prefix
        v_seen = read_prefix(g, v_all, end)
        outs.append(g.scaled_dot_product_attention(q_r, k_seen, v_seen, scale=scale, causal=True, window=window,
                                                   softcap=softcap))      # [1, nh, 1, hd]
    return g.reshape(outs[0] if rows == 1 else g.concat(outs, axis=0), (rows, nh * hd))


def pool_row_attention(g: Graph, cfg: DecoderConfig, weights: Weights, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       feeds: PoolFeeds, inv_freq: np.ndarray, rows: int, *, qk_norm: bool = False, window: int = 0,
                       softcap: float = 0.0, scale: float | None = None, rope_base: float | None = None,
                       q_scale: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`row_attention` over a KV pool: one K and one V variable per layer, blk.L.k_pool / v_pool
    [entries, nkv, context, hd] of cfg.kv_dtype, and ONE pool_attention op for all rows (row r writes
    and reads entry slots[r] at positions[r]). The executable's buffers are the same whatever slots
    the rows hold, so a device can capture it once per row count. q [rows, nh*hd], k and v
    [rows, nkv*hd] -> [rows, nh*hd]. A batch-1 decoder's state of entry s is pool[s:s + 1] (views)."""
    p = f"blk.{layer}."
    hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    positions = feeds.positions
    q, k, v = g.reshape(q, (rows, nh, hd)), g.reshape(k, (rows, nkv, hd)), g.reshape(v, (rows, nkv, hd))
    if qk_norm:                                                       # per head, over hd
        q = rms_norm(g, cfg, weights, p + "attn_q_norm.weight", q)
        k = rms_norm(g, cfg, weights, p + "attn_k_norm.weight", k)
    if q_scale is not None:                                           # each row's own factor
        q = q * g.reshape(g.gather(q_scale[0], positions), (rows, 1, 1))
    if inv_freq is not None:   # RoPE over [h, rows, hd]: the rows are the tokens, each at its own position
        rope = dict(base=cfg.rope_base if rope_base is None else rope_base, interleaved=cfg.rope_interleaved,
                    rotary_dims=cfg.rope_dims, inv_freq=inv_freq)
        q = g.transpose(g.rope(g.transpose(q, (1, 0, 2)), positions, **rope), (1, 0, 2))
        k = g.transpose(g.rope(g.transpose(k, (1, 0, 2)), positions, **rope), (1, 0, 2))
    k_pool, v_pool = kv_cache(g, cfg, layer, feeds.size, kind="pool")
    scales = (k_pool.scales, v_pool.scales) if k_pool.scales is not None else None
    out, *pools = g.pool_attention(q, k, v, k_pool.values, v_pool.values, feeds.slots, positions, scale=scale,
                                   window=window, softcap=softcap, scales=scales)   # [rows, nh, hd]
    for variable, new in zip((k_pool.values, v_pool.values) + (scales or ()), pools):
        g.assign(variable, new)                                       # written in place by the compiler
    return g.reshape(out, (rows, nh * hd))


ACTIVATIONS: dict[str, Callable[[Graph, Tensor], Tensor]] = {
    "silu": lambda g, x: g.silu(x),                       # SwiGLU (Llama, Qwen)
    "gelu_tanh": lambda g, x: g.gelu(x, approximate="tanh"),   # GeGLU (Gemma)
}


def feed_forward(g: Graph, cfg: DecoderConfig, weights: Weights, layer: int, x: Tensor, activation: str = "silu") -> Tensor:
    """Gated feed-forward: down(act(gate(x)) * up(x)); x: [B*T, dim] -> [B*T, dim]."""
    p = f"blk.{layer}."
    gate, up = linear_split(g, x, weights, [p + "ffn_gate.weight", p + "ffn_up.weight"],
                            [(cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim)])   # [B*T, ffn]
    h = ACTIVATIONS[activation](g, gate) * up
    return adapted(g, weights, [p + "ffn_down.weight"], h,
                   linear(g, h, weights.matrix(p + "ffn_down.weight", (cfg.dim, cfg.ffn_dim))))


def output(g: Graph, cfg: DecoderConfig, weights: Weights, x: Tensor, embed: Tensor, last: Tensor, batch: int,
           all_logits: bool, softcap: float = 0.0) -> Tensor:
    """The final norm and the head: logits [B, vocab] of row `last` of each sequence ([B*T, vocab]
    with all_logits); tied embeddings reuse `embed`; softcap: c * tanh(logits / c)."""
    if not all_logits and batch == 1:
        x = g.slice(x, [last, 0], size=[1, None])              # only the row whose logits we need
    elif not all_logits:                                       # row `last` of each sequence: [B, dim]
        x = g.reshape(g.slice(g.reshape(x, (batch, -1, cfg.dim)), [0, last, 0], size=[None, 1, None]), (batch, cfg.dim))
    x = rms_norm(g, cfg, weights, "output_norm.weight", x)
    head = embed if cfg.tied_embeddings else weights.matrix("output.weight", (cfg.vocab_size, cfg.dim))
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = adapted(g, weights, [head_name], x, linear(g, x, head))   # [B, vocab]
    if softcap:
        logits = g.tanh(logits * np.float32(1.0 / softcap)) * np.float32(softcap)
    return logits


@dataclass
class DecoderGraph:
    graph: Graph
    tokens: Tensor
    pos: Tensor
    last: Tensor
    logits: Tensor
    config: "DecoderConfig"
    callables_for: Callable[[dict[str, int], str], dict] | None = None  # {call name: input rows}, device -> {name: executable}
    inputs: dict[str, Tensor] = field(default_factory=dict)             # what each (fused) weight multiplies
    batch: int = 1                                                      # sequences decoded in lockstep

    def compile(self, length: int, device: str = "cpu", options=None):
        """The executable for `length` tokens per step and sequence (1 = decode); cached by the graph
        (and options, an `ingot.CompileOptions`).
        Its tokens feed is [batch * length] (sequence-major). Adapter call sites are (re)bound to
        `callables_for({site: rows}, device)`, which costs no recompile."""
        exe = self.graph.compile(feeds={self.tokens: TensorType((self.batch * length,), dt.int32)}, targets=[self.logits],
                                 device=device, options=options)
        if self.callables_for is not None:
            rows = {name: site.src[0].type.shape[0] for name, site in exe.call_sites.items()}
            for name, callee in self.callables_for(rows, device).items():
                if exe.callables.get(name) is not callee:
                    exe.bind(name, callee)
        return exe
