"""Quantizing a whole LLM: float weights (dequantized from the input file) to one format, with
calibration (activation statistics from a text: by default one shipped with Ingot), AWQ-style
scaling, GPTQ rounding, excluded tensors and error-compensation adapters. `ingot quantize` is a
thin shell around `quantize_default`, which picks the methods; `quantize_model` takes them one by one.

    model = open_model("in.gguf")                               # ingot.llm.package
    stats = calibrate(model, tokenize(model, default_calibration_text()))   # ingot.llm.tokenizer
    result = quantize_default(model, "int4:64", stats=stats, compensate=8)
    save_llm("out.ingot", model.config, result.tensors, model.metadata, result.adapters)
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import IngotError
from .formats import QuantizedTensor, tensor_nbytes
from .quantize import Format, parse_format, quantize

# `ingot quantize` with no --format: asymmetric uint4 in blocks of 32 whose scales and offsets are 6-bit
# codes times a float16 unit per super-block (GGUF Q4_K's form, 4.5 bits per weight). With the head in
# int8, on the default model: KLD 0.0065 at 5.24 bits per weight, where int4:64:auto (the default until
# 2026-12-05) gave 0.156 at 5.35 and llama.cpp's Q4_K_M 0.047 at 6.16, at the same CPU decode speed
# (BENCHMARKS.md, Quantization)
DEFAULT_FORMAT = "uint4:32:k"
# the output head keeps 8 bits, as llama.cpp's mixes keep it at Q6_K or Q8_0: its error reaches every
# logit directly (on SmolLM2 it is also the tied embedding, a fifth of the weights)
DEFAULT_TENSOR_FORMATS = (("output.weight", "int8"), ("token_embd.weight", "int8"))
# ... unless the head is a large share of the weights (Gemma 3 270M's tied 262,144 x 640 embedding: 63 %):
# there int8 doubles what a decode step reads (40 tok/s on one Zen 5 core against llama.cpp's 87), and the
# layers' format with rank HEAD_RANK's bytes of residual rows on the head (default_head) is both smaller
# and closer: KLD 0.0766 at 5.06 bits per weight against int8's 0.0793 at 6.72 (SmolLM2's head, 21 % of
# its weights, keeps int8: 0.0065 against 0.0083 with the rows; BENCHMARKS.md, Quantization)
HEAD_SHARE = 1 / 3
HEAD_RANK = 70
LAYER_WEIGHT = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
AWQ_ALPHAS = (0.0, 0.25, 0.5, 0.75)
OUTPUT_PROBABILITY = "output:probability"   # calibrate's mean next-token distribution (not a weight name)
ROW_FLOOR = 1e-3     # the head's compensation weights rows by probability + ROW_FLOOR / vocab
# how --compensate spends its bytes on the output head: low-rank factors, residual rows (the error of the
# rows of largest calibration-probability-weighted error, int8, as many as rank N's bytes buy), or
# "auto": whichever leaves the lower probability-weighted output error. On the default model rank 70's
# bytes buy 6,000 int8 rows, which leave 0.09 of the head's weighted error where rank 70 leaves 0.47:
# its GPTQ error is spread over directions but concentrated, for the KLD, in the likely tokens' rows.
# A tied head's adapter (rows or factors) corrects the embedding lookup as well (ingot.adapters.LOOKUP):
# on the calibration text's second half, 6,002 rows ranked on its first leave KLD 0.0156 on the head
# alone and 0.0125 on both uses (0.0225 uncompensated), at no extra bytes.
COMPENSATE_FORMS = ("auto", "low_rank", "rows")


@dataclass
class QuantizeResult:
    tensors: dict                       # GGUF names -> QuantizedTensor or float arrays
    adapters: object                    # ingot.adapters.AdapterSet (compensation), possibly empty
    bytes_before: int
    bytes_after: int                    # tensors + adapters
    adapter_bytes: int
    errors: dict = field(default_factory=dict)   # name -> relative RMS error ||W - W_hat|| / ||W||
    notes: list = field(default_factory=list)

    @property
    def mean_relative_error(self) -> float:
        return float(np.mean(list(self.errors.values()))) if self.errors else 0.0


def activation_stats(model, ids: Sequence[int], context: int = 256, max_tokens: int = 1024,
                     device: str = "cpu", second_moments: bool = False,
                     output_probability: bool = False) -> dict[str, np.ndarray]:
    """Mean square of the activations each layer weight multiplies, per input column, over the
    calibration text's token ids run through `model` (a StoredModel): {weight name: float32 [in]}.
    second_moments=True keeps the whole matrix E[x x^T] instead ({name: float32 [in, in]}, what
    GPTQ needs; its diagonal is the mean square). output_probability=True adds the model's mean
    next-token distribution over the text (float32 [vocab]) under OUTPUT_PROBABILITY: how much
    each row of the output head matters to the logits' KL divergence."""
    from .. import dtypes as dt
    from ..ir import TensorType
    from .. import models

    ids = list(ids)[:max_tokens]
    if len(ids) < 2:
        raise IngotError(f"calibration: the text has {len(ids)} tokens; give a longer text.")
    graph = models.build(model.config, model.tensors, model.path, all_logits=True)  # the head sees every row
    sites = sorted(graph.inputs)
    sums = {s: 0.0 for s in sites}
    count, probability = 0, 0.0
    for start in range(0, len(ids), context):
        chunk = ids[start:start + context]
        exe = graph.graph.compile(feeds={graph.tokens: TensorType((len(chunk),), dt.int32)},
                                  targets=[graph.inputs[s] for s in sites] + ([graph.logits] if output_probability else []),
                                  device=device)
        outs = exe.run({"tokens": np.asarray(chunk, np.int32), "pos": np.int32(0)}, state=exe.new_state())
        if output_probability:
            logits = np.asarray(exe.backend.to_host(outs[-1]), np.float64).reshape(len(chunk), -1)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            probability = probability + (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
        for s, x in zip(sites, outs):
            x = np.asarray(exe.backend.to_host(x), np.float64)
            sums[s] = sums[s] + (x.T @ x if second_moments else (x * x).sum(axis=0))
        count += len(chunk)
    stats = {}
    for s in sites:
        stat = (sums[s] / count).astype(np.float32)
        for name in s.split("+"):   # one array per input: GPTQ factorises it once for all its weights
            stats[name] = stat
    if output_probability:
        stats[OUTPUT_PROBABILITY] = (probability / count).astype(np.float32)
    return stats


def default_calibration_text() -> str:
    """The calibration text shipped with Ingot (ingot/data/calibration.txt): a few kB of varied
    English (prose, dialogue in a chat layout, code, lists, figures), used when none is given."""
    from importlib.resources import files

    return (files("ingot") / "data" / "calibration.txt").read_text(encoding="utf-8")


def calibrate(model, tokens: Sequence[int], context: int = 256, device: str = "cpu") -> dict[str, np.ndarray]:
    """The activations' second moments E[x x^T] per weight over the token ids of a text (by default
    default_calibration_text(), tokenized by the caller: quant sits below llm): what AWQ, GPTQ, the
    weighted quantizers and compensation all read."""
    context = min(context, model.config.context_length)
    return activation_stats(model, list(tokens), context=context, device=device, second_moments=True,
                            output_probability=True)


def quantize_default(model, fmt: str | Format = DEFAULT_FORMAT, stats: dict | None = None, compensate: int = 0,
                     exclude: Sequence[str] = (), awq: bool | None = None, gptq: bool | None = None,
                     tensor_formats: Sequence[tuple[str, str]] | None = None, bits: float | None = None,
                     compensate_sites: Sequence[str] = (), progress: Callable[[str], None] | None = None,
                     compensate_form: str = "auto") -> QuantizeResult:
    """What `ingot quantize` does: quantize_model with the methods that pay on by default. Given
    calibration stats (from calibrate), affine formats get AWQ scaling, and GPTQ rounds every format
    whose stats hold second moments; awq= / gptq= force either way. tensor_formats (GLOB, FMT)
    pairs come before DEFAULT_TENSOR_FORMATS (the output head in int8); [] for none at all.
    bits: a budget in bits per weight for all 2-D weights; the layer weights' formats then come
    from allocate_formats (among ALLOCATION_FORMATS; fmt for the other weights tensor_formats leave)."""
    fmt = parse_format(fmt)
    tensor_formats = DEFAULT_TENSOR_FORMATS if tensor_formats is None else tuple(tensor_formats)
    if bits is not None:
        allocated = allocate_formats(dict(float_weights(model)), stats, bits, fixed=tensor_formats, rest=fmt)
        tensor_formats = tuple(allocated) + tuple(tensor_formats)
    has_moments = stats is not None and any(v.ndim == 2 for v in stats.values())
    awq = (stats is not None and fmt.kind == "affine") if awq is None else awq
    gptq = has_moments if gptq is None else gptq
    return quantize_model(model, fmt, exclude=exclude, stats=stats, compensate=compensate, awq=awq, gptq=gptq,
                          tensor_formats=tensor_formats, compensate_sites=compensate_sites, progress=progress,
                          compensate_form=compensate_form)


def default_head(model, stats: dict | None, tensor_formats: Sequence[tuple[str, str]] = (), exclude: Sequence[str] = (),
                 compensate: int = 0, bits: float | None = None) -> tuple[list[tuple[str, str]], int, list[str]]:
    """What `ingot quantize` adds for the output head, as (tensor formats, compensation rank, compensation
    sites): int8 (DEFAULT_TENSOR_FORMATS, rank 0: the caller's own compensation stands), or, where no flag
    names the head (tensor_formats, exclude), none asks for compensation or a bits budget, a calibration can
    rank its rows and the head holds more than HEAD_SHARE of the 2-D weights' elements: the layers' format
    and HEAD_RANK's bytes of compensation on the head alone."""
    heads = ("token_embd.weight", "output.weight")
    named = any(excluded(h, [glob]) for glob, _ in tensor_formats for h in heads) or \
        any(excluded(h, list(exclude)) for h in heads)
    sizes = {name: int(np.prod(t.shape)) for name, t in model.tensors.items() if len(getattr(t, "shape", ())) == 2}
    head = "token_embd.weight" if model.config.tied_embeddings else "output.weight"
    if named or compensate or bits is not None or stats is None or sizes.get(head, 0) <= HEAD_SHARE * sum(sizes.values()):
        return list(DEFAULT_TENSOR_FORMATS), 0, []
    return [], HEAD_RANK, [head]


# what allocate_formats chooses from by default: Q4_1's form (5 bits per weight), 4.5 and 4.25 bits
ALLOCATION_FORMATS = ("uint4:32:f16", "int4:32:auto:f16", "int4:64:f16")


def allocate_formats(floats: dict, stats: dict | None, budget: float, candidates: Sequence[str | Format] = ALLOCATION_FORMATS,
                     fixed: Sequence[tuple[str, str | Format]] = (), rest: str | Format = "int8") -> list[tuple[str, Format]]:
    """A format per layer weight (LAYER_WEIGHT names of floats: {name: float [out, in]}) so that all
    2-D weights together take at most `budget` bits per weight: the tensors matching a `fixed` glob
    keep that format (other 2-D weights that are not layer weights: `rest`); the layer weights start
    in the candidate with the fewest bits and move to one with more, the move with the largest drop
    of relative output error E||(W - W_hat) x||^2 / E||W x||^2 (calibrated; plain squared error
    without stats; rounded to nearest) per bit added first, while the budget allows. Returns
    (name, format) pairs for quantize_model's tensor_formats; IngotError when even the fewest bits
    exceed the budget."""
    candidates, rest = [parse_format(f) for f in candidates], parse_format(rest)
    fixed = [(glob, parse_format(f)) for glob, f in fixed]
    total_bits, elements = 0.0, 0
    options = {}   # name -> [(bits, relative error, format)] per candidate, in increasing bits
    for name, w in floats.items():
        if w.ndim != 2:
            continue
        elements += w.size
        own = next((f for glob, f in fixed if excluded(name, [glob])), None)
        if own is not None or not LAYER_WEIGHT.match(name):   # not allocated: in its own format or `rest`
            total_bits += 8 * quantize(w, own or rest).nbytes
            continue
        stat = None if stats is None else stats.get(name)
        importance = None if stat is None else diagonal(stat)
        tried = [quantize(w, f, importance=importance) for f in candidates]
        reference = _output_error(w, None, stat)
        options[name] = sorted(((8 * t.nbytes, _output_error(w, t, stat) / max(reference, 1e-30), f)
                                for t, f in zip(tried, candidates)), key=lambda o: o[0])
    level = {name: 0 for name in options}
    used = total_bits + sum(o[0][0] for o in options.values())
    if used > budget * elements:
        raise IngotError(f"quantize: {budget} bits per weight is below what the fewest-bit formats take "
                         f"({used / elements:.3f}); raise the budget.")
    while True:
        best, gain = None, 0.0
        for name, o in options.items():
            i = level[name]
            for j in range(i + 1, len(o)):
                if used + o[j][0] - o[i][0] <= budget * elements:
                    g = (o[i][1] - o[j][1]) / max(o[j][0] - o[i][0], 1)
                    if g > gain:
                        best, gain = (name, j), g
        if best is None:
            break
        name, j = best
        used += options[name][j][0] - options[name][level[name]][0]
        level[name] = j
    return [(name, options[name][level[name]][2]) for name in options]


def float_weights(model):
    """(name, float32 array) for every tensor of a StoredModel, matrices as [out, in]; side-by-side
    groups ("a+b" names, as an LLM package stores them) split into their weights."""
    from ..adapters import site_layout

    for name in list(model.tensors):
        t = model.tensors[name]
        names = name.split("+")
        if hasattr(t, "float_rows"):   # a package's expert stacks (models.moe.ExpertStack), as GGUF's rows
            yield from t.float_rows(names)
            continue
        if isinstance(t, QuantizedTensor):
            w = t.dequantize_rows()
            w = w.T if t.block_axis == 0 else w
        else:
            w = np.asarray(t, np.float32)
        if len(names) == 1:
            yield name, w
            continue
        starts = np.concatenate([[0], np.cumsum(site_layout(model.config, names))])
        for i, n in enumerate(names):
            yield n, np.ascontiguousarray(w[starts[i]:starts[i + 1]])


def diagonal(stat: np.ndarray) -> np.ndarray:
    """The mean square per input column of an activation statistic (a vector, or the diagonal of E[x x^T])."""
    return stat if stat.ndim == 1 else np.ascontiguousarray(np.diag(stat))


def excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or p == name for p in patterns)


def _awq(floats: dict, stats: dict, fmt: Format, layers: int, notes: list, format_of=None) -> dict:
    """Activation-aware scaling (AWQ): per group of weights that read one input, scale input column j
    by s_j = rms_j ** alpha (alpha searched to minimise the activation-weighted quantization error)
    and fold 1 / s_j into what produces that input (the RMSNorm weight; for ffn_down, ffn_up's rows).
    Returns the statistics of the rescaled inputs."""
    stats = dict(stats)
    chosen = []
    for i in range(layers):
        p = f"blk.{i}."
        groups = [([p + "ffn_down.weight"], p + "ffn_up.weight", "rows"),
                  ([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], p + "attn_norm.weight", "vector"),
                  ([p + "ffn_gate.weight", p + "ffn_up.weight"], p + "ffn_norm.weight", "vector")]
        for names, producer, how in groups:
            if not all(n in floats and n in stats for n in names) or producer not in floats:
                continue
            m = diagonal(stats[names[0]]).astype(np.float64)
            rms = np.sqrt(np.maximum(m, 1e-12))
            best, best_err, best_s = None, None, None
            for alpha in AWQ_ALPHAS:
                s = rms ** alpha
                s = s / np.exp(np.log(s).mean())        # geometric mean 1 keeps magnitudes in range
                err = 0.0
                for n in names:
                    w = floats[n].astype(np.float64)
                    approx = quantize((w * s).astype(np.float32), format_of(n) if format_of else fmt).dequantize_rows() / s
                    err += float((((w - approx) ** 2) * m).sum())
                if best_err is None or err < best_err:
                    best, best_err, best_s = alpha, err, s
            chosen.append(best)
            if best == 0.0:
                continue
            stat = stats[names[0]]   # the weights of a group read one input: one statistic, rescaled once
            scaled = (stat / (best_s ** 2 if stat.ndim == 1 else np.outer(best_s, best_s))).astype(np.float32)
            for n in names:
                floats[n] = (floats[n] * best_s).astype(np.float32)
                stats[n] = scaled
            if how == "vector":
                floats[producer] = (floats[producer] / best_s).astype(np.float32)
            else:
                floats[producer] = (floats[producer] / best_s[:, None]).astype(np.float32)
    if chosen:
        notes.append(f"AWQ: alpha per group {dict(zip(*np.unique(chosen, return_counts=True)))}")
    return stats


def _output_error(w: np.ndarray, t: QuantizedTensor | None, stat: np.ndarray | None) -> float:
    """The error of t as the calibration inputs see it: E ||(W - W_hat) x||^2 (second moments), its
    diagonal model (mean squares), or plain squared error without calibration; t None: of W itself."""
    e = (w if t is None else w - t.dequantize_rows()).astype(np.float64)
    if stat is None:
        return float((e * e).sum())
    if stat.ndim == 1:
        return float((e * e * stat).sum())
    return float(((e @ stat) * e).sum())


def _choose_rows(error: np.ndarray, row_weight: np.ndarray, stat: np.ndarray | None, budget: int,
                 a: np.ndarray | None, b: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """Residual rows for a weight's error [out, in] within budget bytes (int8 with a float32 scale per
    row, and an int32 map over the outputs): the rows of largest weighted error row_weight_v e_v^T H e_v
    (on SmolLM2's head 0.091 of it left by 6,000 rows, 0.095 ranked by probability alone). Returns (idx, R, note),
    or (None, None, note) when the low-rank factors (a, b), given, leave the lower weighted error
    sum_v row_weight_v e_v^T H e_v (H the inputs' second moments, or their diagonal, or 1)."""
    from ..adapters import _int8_columns

    out, inp = error.shape
    k = int(min(out, (budget - 4 * out) // (inp + 4)))
    if k < 1:
        return None, None, f"{budget} bytes buy no residual row"
    e = error.astype(np.float64)

    def per_row(m):
        if stat is None:
            return (m * m).sum(axis=1)
        return (m * m * stat).sum(axis=1) if stat.ndim == 1 else ((m @ stat) * m).sum(axis=1)
    before = per_row(e) * row_weight
    idx = np.sort(np.argsort(-before, kind="stable")[:k]).astype(np.int32)   # the rows that hold the most of it
    q, scale = _int8_columns(e[idx].T)
    r = (q.astype(np.float32) * scale).T                        # the rows as the int8 store gives them back
    left = before.copy()
    left[idx] = per_row(e[idx] - r) * row_weight[idx]
    note = (f"residual rows: {k} int8 rows leave {left.sum() / before.sum():.3f} of the weighted error")
    if a is None:
        return idx, r, note
    aq, sa = _int8_columns(a.T.astype(np.float64))
    bq, sb = _int8_columns(b.T.astype(np.float64))
    lr = e - (bq * sb).T @ (aq * sa).T
    low = float((per_row(lr) * row_weight).sum())
    note += f", rank {a.shape[0]} {low / before.sum():.3f}"
    return (idx, r, note + ": rows") if left.sum() < low else (None, None, note + ": low rank")


def quantize_model(model, fmt: str | Format, exclude: Sequence[str] = (), stats: dict | None = None,
                   compensate: int = 0, awq: bool = False, gptq: bool = False,
                   tensor_formats: Sequence[tuple[str, str | Format]] = (), compensate_sites: Sequence[str] = (),
                   progress: Callable[[str], None] | None = None, compensate_form: str = "auto") -> QuantizeResult:
    """Quantize every 2-D weight of a StoredModel to fmt (tensors matching an exclude glob stay as
    they are in the input). stats (from activation_stats) weight the quantizers and the
    compensation; awq applies activation-aware scaling first (needs stats, affine formats);
    compensate=RANK adds low-rank factors of each layer weight's and the output head's error as
    adapters (only those matching a compensate_sites glob, when given; the head's rows weighted by
    the calibration's next-token probabilities when stats hold them: the rows that carry the
    probability, and so the KL divergence, are corrected first; compensate_form, one of
    COMPENSATE_FORMS, lets the head spend rank RANK's bytes on residual rows instead); gptq rounds
    the 4-bit weights with GPTQ (needs stats with second moments: activation_stats(..., second_moments=True));
    tensor_formats: (GLOB, FMT) pairs, the first whose glob matches a tensor's name gives its format."""
    from ..adapters import AdapterSet
    from .compensate import low_rank
    from .gptq import gptq as gptq_quantize, inverse_cholesky

    fmt = parse_format(fmt)
    tensor_formats = [(glob, parse_format(f)) for glob, f in tensor_formats]
    format_of = lambda name: next((f for glob, f in tensor_formats if excluded(name, [glob])), fmt)  # noqa: E731
    if awq and stats is None:
        raise IngotError("quantize: AWQ scaling needs a calibration text.")
    if awq and fmt.kind != "affine":
        raise IngotError(f"quantize: AWQ scaling applies to affine formats, not {fmt}.")
    if gptq and (stats is None or not any(v.ndim == 2 for v in stats.values())):
        raise IngotError("quantize: GPTQ needs a calibration text (its activations' second moments).")
    if compensate < 0:
        raise IngotError(f"quantize: the compensation rank must be positive, not {compensate}.")
    if compensate_form not in COMPENSATE_FORMS:
        raise IngotError(f"quantize: the compensation form {compensate_form!r} is not one of {', '.join(COMPENSATE_FORMS)}.")
    bytes_before = sum(tensor_nbytes(model.tensors[n]) for n in model.tensors)
    floats, originals = {}, {}
    for name, w in float_weights(model):
        if excluded(name, exclude):  # kept as the input stores it (a weight split out of a group: as floats)
            originals[name] = model.tensors[name] if name in model.tensors else w
        else:
            floats[name] = w
    notes = []
    if awq:
        stats = _awq(floats, stats, fmt, model.config.n_layers, notes, format_of)
    tensors = dict(originals)
    errors, factors, residual_rows = {}, {}, {}
    rounded_by_gptq, factors_by_input, chosen = 0, {}, {}
    head = "token_embd.weight" if model.config.tied_embeddings else "output.weight"  # the output head's adapter site
    for name, w in floats.items():
        if progress:
            progress(name)
        if w.ndim != 2:
            tensors[name] = w
            continue
        tensor_fmt = format_of(name)
        stat = None if stats is None else stats.get(name)
        importance = None if stat is None else diagonal(stat)
        # GPTQ for the 4-bit weights: 8-bit rounding error is already ~256x smaller, not worth the sweep
        use_gptq = (gptq and stat is not None and stat.ndim == 2 and tensor_fmt.bits <= 4
                    and not (tensor_fmt.kind == "affine" and tensor_fmt.block_size == 0))
        if use_gptq and id(stat) not in factors_by_input:  # weights that read one input share its factorisation
            factors_by_input[id(stat)] = inverse_cholesky(stat)
        tried = [gptq_quantize(w, f, stat, factor=factors_by_input[id(stat)]) if use_gptq else quantize(w, f, importance=importance)
                 for f in tensor_fmt.candidates()]
        t = min(tried, key=lambda t: _output_error(w, t, stat)) if len(tried) > 1 else tried[0]
        rounded_by_gptq += use_gptq
        if tensor_fmt.auto:
            chosen[t.source] = chosen.get(t.source, 0) + 1
        if (tensor_fmt.kind == "affine" and not tensor_fmt.auto and tensor_fmt.block_size and t.block_size != tensor_fmt.block_size
                and f"{t.block_size}/{w.shape[1]}" not in " ".join(notes)):
            notes.append(f"blocks of {t.block_size} for {w.shape[1]} columns (not divisible by {tensor_fmt.block_size}): {t.block_size}/{w.shape[1]}")
        tensors[name] = t
        approx = t.dequantize_rows()
        errors[name] = float(np.linalg.norm(w - approx) / max(np.linalg.norm(w), 1e-30))
        if (compensate and (LAYER_WEIGHT.match(name) or name == head)
                and (not compensate_sites or excluded(name, compensate_sites))):
            rows = None if stats is None or name != head else stats.get(OUTPUT_PROBABILITY)
            if rows is not None and len(rows) == w.shape[0]:
                weight = np.sqrt(rows.astype(np.float64) + ROW_FLOOR / len(rows))[:, None]
                a = b = None
                if compensate_form != "rows":
                    a, b = low_rank(weight * (w - approx), compensate, stat)
                    b = (b / weight).astype(np.float32)
                if compensate_form != "low_rank":
                    budget = compensate * (w.shape[0] + w.shape[1]) + 4 * (compensate + w.shape[0])  # rank N's int8 bytes
                    idx, r, note = _choose_rows(w - approx, weight[:, 0] ** 2, stat, budget, a, b)
                    tied = " (the tied embedding's lookup adds them too)" if name == "token_embd.weight" else ""
                    notes.append(f"{name}: {note}{tied}")
                    if idx is not None:
                        residual_rows[name] = (idx, r)
                        continue
            else:
                a, b = low_rank(w - approx, compensate, stat)   # the whole second moments when calibrated
            if a is not None:
                factors[name] = [(a, b)]
    if chosen:
        notes.append("auto: " + ", ".join(f"{n} {f}" for f, n in sorted(chosen.items())))
    if rounded_by_gptq:
        notes.append(f"GPTQ: {rounded_by_gptq} weights rounded against their inputs' second moments")
    adapters = AdapterSet(factors, int8=True, rows=residual_rows)
    adapter_bytes = adapters.stored_nbytes
    bytes_after = sum(tensor_nbytes(t) for t in tensors.values()) + adapter_bytes
    return QuantizeResult(tensors, adapters, bytes_before, bytes_after, adapter_bytes, errors, notes)
