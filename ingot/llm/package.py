"""An LLM as an Ingot package: the decoder compiled for one token (what `ingot.load` and `ingot
view` open), its weights, and llm.json (config, tokenizer and chat template metadata, and which
constants are which weight) so `ingot generate --model X.ingot` rebuilds the graph at any length.

    X.ingot/
      manifest.json, graph.json, weights.safetensors   the decode executable (ingot.package), KV cache
                                                        of STORED_CONTEXT positions
      callables/SITE.ingot/                             adapters bound to it (LoRA, error compensation)
      llm.json                                          {"format": "ingot-llm", "version": 1, ...}

Weights are stored the way the builder multiplies them (k-major, q/k/v and gate/up side by side
under "a+b+c" names), memory-mapped on load, and never converted again; the :k formats' scales
and biases are stored two-level (codes and float16 units: package version 4), kept so in memory when
loaded for the CPU (its GEMV multiplies code by unit as it reads them) and decoded to their float16
products otherwise; a table's (lut4:bB:offset:k) are stored so too and always decoded to their float16
products, which the table kernels read (a reader of version 2 decodes them the same way: np.asarray).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..untrusted import checked_path, clip, inside, read_json, short
from ..quant.formats import QuantizedTensor, TwoLevelParams, concat_columns
from ..models.moe import ExpertStack

LLM_FORMAT = "ingot-llm"
LLM_VERSION = 1
LUT_BIAS_LLM_VERSION = 2   # written when a table tensor has a bias (lut4:bB:offset), which version 1 readers would drop
LLM_READS = (LLM_VERSION, LUT_BIAS_LLM_VERSION)
LLM_FILE = "llm.json"
_PARAMS = ("scale", "bias", "zero_point", "lut")
STORED_CONTEXT = 256


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def is_llm_package(path) -> bool:
    return Path(path).is_dir() and (Path(path) / LLM_FILE).is_file()


def fused_groups(cfg) -> list[list[str]]:
    """The weights the builder multiplies side by side (per layer: q/k/v, gate/up)."""
    return [[f"blk.{i}.{k}.weight" for k in kinds] for i in range(cfg.n_layers)
            for kinds in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))]


def expert_groups(cfg) -> list[tuple[list[str], list[tuple[int, int, int]]]]:
    """A mixture-of-experts config's expert stacks per layer: (names, [E, out, in] shapes) of each group
    the builder multiplies as one (gate and up; down); [] for a dense model."""
    e, f, dim = getattr(cfg, "n_experts", 0), getattr(cfg, "expert_ffn_dim", 0), cfg.dim
    if not e:
        return []
    return [group for i in range(cfg.n_layers) for group in (
        ([f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"], [(e, f, dim)] * 2),
        ([f"blk.{i}.ffn_down_exps.weight"], [(e, dim, f)]))]


def storage_form(cfg, tensors: Mapping, finish=None) -> dict:
    """Tensors as the package stores them: quantized ones k-major, fusable groups side by side; a
    family's fused tensors split first (models.unfused); expert stacks (*_exps) in the form the graph
    multiplies (models.moe.ExpertStack: each expert k-major, gate and up side by side when they can).

    finish(t), where given, takes each weight as it comes (the CPU loaders' kernels.tile_weight): a
    lazily converted file then holds one weight in two forms at a time, not the whole model (SmolLM2's
    load peaked 27 MB above its end, its tied embedding's k-major array beside its tiles)."""
    from .. import models
    from ..models.moe import stored_experts

    finish = finish or (lambda t: t)
    tensors = models.unfused(cfg, tensors)
    out: dict = {}
    grouped = set()
    for names, shapes in expert_groups(cfg):
        out.update(stored_experts("", tensors, names, shapes))
        grouped.update(names)
    for names in fused_groups(cfg):
        parts = [tensors.get(n) for n in names]
        if all(isinstance(p, QuantizedTensor) for p in parts):
            try:
                out["+".join(names)] = finish(concat_columns([p if p.block_axis == 0 else p.to_k_major() for p in parts]))
                grouped.update(names)
            except ValueError:
                pass
        del parts
    for name in tensors:
        if name in grouped or name in out:
            continue
        t = tensors[name]
        if isinstance(t, ExpertStack):
            out[name] = t
            continue
        if isinstance(t, QuantizedTensor) and t.block_axis != 0:
            t = t.to_k_major()   # the file's form goes before finish makes another
        out[name] = finish(t if isinstance(t, QuantizedTensor) else np.asarray(t))
        del t
    return out


def _json_value(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        return v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    raise TypeError(f"not JSON: {type(v).__name__}")


def save_llm(path, cfg, tensors: Mapping, metadata: Mapping, adapters=None, architecture: str = "llama",
             extra: Mapping | None = None) -> None:
    """Write an LLM package at path (atomic: all of it or nothing; an existing package is replaced).

    tensors: GGUF-named float arrays or QuantizedTensors; metadata: the GGUF metadata (tokenizer
    and chat template included); adapters: an AdapterSet compiled in as callables; extra: more
    JSON for llm.json (e.g. how the weights were quantized).
    """
    from .. import package
    from ..adapters import LOOKUP, binder
    from .. import models

    path = Path(path)
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / "manifest.json").is_file())):
        raise IngotError(f"save: {path} exists and is not an Ingot package; refusing to replace it.")
    stored = storage_form(cfg, tensors)
    # the stored decode executable's KV cache is short (its zeros are stored too); generate rebuilds
    # the graph from llm.json with the model's own context length
    model = models.build(replace(cfg, context_length=min(cfg.context_length, STORED_CONTEXT)), stored, str(path),
                        adapter_sites=adapters.names if adapters else ())
    if adapters:
        model.callables_for = binder(cfg, adapters)
    decoder = model.compile(1, "cpu")
    decoder.callables.pop(LOOKUP, None)   # made from the head's adapter when the graph is built: stored once, there
    layout = {}
    for name, t in stored.items():
        if isinstance(t, ExpertStack):
            layout[name] = {"kind": "experts", "qdtype": t.qdtype.name if t.qdtype else None, "shape": list(t.shape),
                            "block_size": t.block_size, "params": [p for p in t.PARAMS if getattr(t, p) is not None],
                            "source": t.source}
        elif isinstance(t, QuantizedTensor):
            layout[name] = {"kind": "quantized", "qdtype": t.qdtype.name, "shape": list(t.shape), "block_size": t.block_size,
                            "params": [p for p in _PARAMS if getattr(t, p) is not None], "source": t.source}
            if t.two_level:
                layout[name]["two_level"] = list(t.two_level)
        elif np.ndim(t) == 2:
            layout[name] = {"kind": "matrix"}   # stored transposed ([in, out]) by the builder
        else:
            layout[name] = {"kind": "array"}
    constants = decoder.program.constants
    missing = [n for n in layout if n not in constants and not n.startswith("rope_freqs")]
    for name in missing:  # not read by the decode graph (e.g. an unused tensor): keep it out of the package
        layout.pop(name)
    lut_bias = any(isinstance(t, QuantizedTensor) and t.lut is not None and t.bias is not None for t in stored.values())
    info = {"format": LLM_FORMAT, "version": LUT_BIAS_LLM_VERSION if lut_bias else LLM_VERSION, "architecture": architecture,
            "config": asdict(cfg), "metadata": dict(metadata), "tensors": layout,
            "adapter_sites": sorted(set(decoder.call_sites) - {LOOKUP}), "extra": dict(extra or {})}
    if "rope_freqs.weight" in tensors:
        info["rope_freqs"] = np.asarray(tensors["rope_freqs.weight"], np.float32).tolist()
        layout.pop("rope_freqs.weight", None)
    factors = {n: np.asarray(tensors[n], np.float32).tolist() for n in LONGROPE_TENSORS if n in tensors}
    if factors:   # LongRoPE's (Phi-3): read when the graph is built, not graph constants
        info["rope_factors"] = factors
    two_level = {}   # the :k formats' parameters, stored as codes and units (package version 4)
    for name, t in stored.items():
        if isinstance(t, QuantizedTensor) and t.two_level:
            for p, sign in (("scale", 1), ("bias", -1)):
                if getattr(t, p) is not None:
                    two_level[f"{name}.{p}"] = (t.two_level[0] // t.block_size, t.two_level[1], sign)
    with package.atomic_directory(path) as staged:
        package.save(decoder, staged, two_level=two_level)
        (staged / LLM_FILE).write_text(json.dumps(info, default=_json_value))


class StoredModel:
    """What LLM needs from a model file: path, architecture, metadata, tensors (GGUF names, or
    "a+b" for side-by-side weights), the config, and the adapters it was saved with."""

    def __init__(self, path, architecture, metadata, tensors, config, adapters):
        self.path, self.architecture, self.metadata, self.tensors = path, architecture, metadata, tensors
        self.config, self.adapters = config, adapters

    def get(self, key, default=None):
        return self.metadata.get(key, default)


def read_llm(path, two_level_codes: bool = False) -> StoredModel:
    """Open an LLM package: weights memory-mapped, adapters read back from its callables; the :k
    formats' parameters as their float16 products, or with two_level_codes=True as they are stored
    (codes and units: QuantizedTensor scale and bias of type TwoLevelParams, which the CPU backend's
    GEMV reads as they are)."""
    from ..adapters import AdapterSet, site_adapters, site_input, site_layout
    from ..models import config_class
    from ..package import read_weights

    path = Path(path)
    if not is_llm_package(path):
        raise IngotError(f"{path} is not an Ingot LLM package (no {LLM_FILE}).")
    info = read_json(path / LLM_FILE)
    if not isinstance(info, dict) or info.get("format") != LLM_FORMAT:
        raise IngotError(f"{path / LLM_FILE} is not an {LLM_FORMAT} description.")
    if info.get("version") not in LLM_READS:
        raise IngotError(f"{path / LLM_FILE} has version {info.get('version')!r}; this Ingot reads versions "
                         f"{', '.join(map(str, LLM_READS))}.")
    try:
        config_type = config_class(info.get("architecture", "llama"), str(path))
        known = {f.name for f in fields(config_type)}
        config = config_type(**{k: v for k, v in info["config"].items() if k in known and k != "extra"})
        weights = {k.partition(":")[2]: v for k, v in read_weights(path, two_level_codes=two_level_codes).items()
                   if k.startswith("constant:")}
        tensors: dict = {}
        for name, spec in info["tensors"].items():
            if spec["kind"] == "quantized":
                qdtype = dt.by_name(spec["qdtype"])
                params = {p: _array_or_two_level(weights[f"{name}.{p}"]) for p in spec["params"] if p in _PARAMS}
                if "lut" in params:   # a table's two-level scales and offsets (lut4:bB:offset:k): their float16 products
                    params = {p: np.asarray(v) for p, v in params.items()}
                two_level = spec.get("two_level")
                if two_level is not None and not (isinstance(two_level, list) and len(two_level) == 2
                                                  and all(isinstance(v, int) and not isinstance(v, bool) for v in two_level)):
                    raise IngotError(f"tensor {short(name)} has two_level {short(two_level)}, not [weights per super-block, "
                                     f"code bits].")
                tensors[name] = QuantizedTensor(weights[name], qdtype, tuple(spec["shape"]), int(spec["block_size"]),
                                                params.get("scale"), params.get("bias"), params.get("zero_point"),
                                                str(spec.get("source", "")), block_axis=0, lut=params.get("lut"),
                                                two_level=None if two_level is None else (int(two_level[0]), int(two_level[1])))
                _check_quantized(path, name, tensors[name])
            elif spec["kind"] == "experts":
                qdtype = None if spec["qdtype"] is None else dt.by_name(spec["qdtype"])
                params = {p: np.asarray(weights[f"{name}.{p}"]) for p in spec["params"] if p in ExpertStack.PARAMS}
                tensors[name] = ExpertStack(weights[name], qdtype, int(spec["block_size"]), **params,
                                            source=str(spec.get("source", "")))
                tensors[name].check(name)
            elif spec["kind"] == "matrix":
                tensors[name] = weights[name].T
            else:
                tensors[name] = weights[name]
        if "rope_freqs" in info:
            tensors["rope_freqs.weight"] = np.asarray(info["rope_freqs"], np.float32)
        for name, values in dict(info.get("rope_factors", {})).items():
            if name not in LONGROPE_TENSORS:
                raise IngotError(f"rope_factors names {short(name)}, not one of {', '.join(LONGROPE_TENSORS)}.")
            tensors[name] = np.asarray(values, np.float32).reshape(-1)
    except IngotError as e:
        raise IngotError(f"{path}: {LLM_FILE}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise IngotError(f"{path}: {LLM_FILE} does not match weights.safetensors ({type(e).__name__}: {clip(e)}).") from None
    factors: dict = {}
    residual_rows: dict = {}
    int8 = False
    sites = info.get("adapter_sites", [])
    if not isinstance(sites, list):
        raise IngotError(f"{path}: {LLM_FILE} has adapter_sites {short(sites)}, not a list of names.")
    for site in sites:
        from ..runtime import load
        if not isinstance(site, str) or "/" in site or "\\" in site or site in ("", ".", "..") or len(site.encode()) > 200:
            raise IngotError(f"{path}: {LLM_FILE} names an adapter site {short(site)}, which is not a plain name.")
        folder = inside(path, f"callables/{site}.ingot", f"{path}: {LLM_FILE} adapter site")
        try:
            exe = load(folder)
            names = site.split("+")
            own, rows, int8 = site_adapters(exe, names, site_layout(config, names), site_input(config, names[0]))
            for n, pairs in own.items():
                factors.setdefault(n, []).extend(pairs)
            residual_rows.update(rows)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise IngotError(f"{path}: adapter site {short(site)} does not fit the model ({type(e).__name__}: {clip(e)}).") from None
    metadata = info.get("metadata", {})
    architecture = info.get("architecture", "llama")
    if not isinstance(metadata, dict) or not isinstance(architecture, str):
        raise IngotError(f"{path}: {LLM_FILE} has metadata or architecture of the wrong type.")
    return StoredModel(str(path), architecture, metadata, tensors, config, AdapterSet(factors, int8=int8, rows=residual_rows))


def _array_or_two_level(value):
    return value if isinstance(value, TwoLevelParams) else np.asarray(value)


def _check_quantized(path: Path, name: str, t: QuantizedTensor) -> None:
    """A k-major tensor read from a package: logical shape [K, N], q [K, N // 2 or N], params [K // block, N]."""
    k, n = (int(d) for d in t.shape)
    block = t.block_size
    q_shape = (k, n // 2 if t.qdtype.packed else n)
    params = [p for p in (t.scale, t.bias, t.zero_point) if p is not None]
    if (k < 1 or n < 1 or block < 1 or k % block or (t.qdtype.packed and n % 2) or tuple(t.q.shape) != q_shape
            or t.q.dtype != t.qdtype.storage or any(tuple(p.shape) != (k // block, n) for p in params)
            or (t.scale is None and t.lut is None) or (t.lut is not None and t.scale is None and t.bias is not None)
            or (t.lut is not None and (t.lut.ndim != 3 or t.lut.shape[-1] != 2 ** t.qdtype.bits or 0 in t.lut.shape
                                       or k % t.lut.shape[0] or n % t.lut.shape[1]))
            or (t.two_level is not None and (t.two_level[1] not in (6, 8) or t.two_level[0] < block
                                             or t.two_level[0] % block or k % t.two_level[0]
                                             or (t.lut is not None and (t.scale is None or t.bias is None))))):
        raise IngotError(f"tensor {short(name)} is described as {t.qdtype.name}{[k, n]} in blocks of "
                         f"{block}, which its stored arrays (q {list(t.q.shape)}) do not fit.")


def open_model(path, bfloat16: bool = False, two_level_codes: bool = False):
    """A GGUF file (lazily converted) or an Ingot LLM package, as a StoredModel.

    bfloat16=True keeps a GGUF file's BF16 tensors bfloat16 (the CUDA backend multiplies them as they
    are; the CPU backend widens each once at load) instead of widening them to float32 here.
    two_level_codes: a package's :k parameters as stored (read_llm), for the CPU backend."""
    from ..adapters import AdapterSet
    from ..importers.gguf import read_gguf
    from ..models import config_from_gguf

    if Path(checked_path(path, "model")).is_dir():
        return read_llm(path, two_level_codes=two_level_codes)
    model = read_gguf(path, lazy=True, bfloat16=bfloat16)
    return StoredModel(model.path, model.architecture, model.metadata, model.tensors, config_from_gguf(model),
                       AdapterSet())
