"""Low-rank adapters called from a Llama-family graph: LoRA (PEFT files) and error compensation.

An adapter adds delta(x) = x @ A.T @ (scale * B).T to the output of a weight W [out, in]
(A: [rank, in], B: [out, rank]), i.e. the layer computes x @ (W + scale * B @ A).T. The main
graph holds a `call` per adapted weight (or per group of weights multiplied side by side, e.g.
q/k/v); each call is bound to a small executable compiled separately, so adapters are attached,
swapped or removed with `Executable.bind`, never by recompiling the model.

Error compensation can also keep residual rows: R [k, in] for k chosen rows of W (indices idx), so
the layer computes x @ (W + S R).T with S the [out, k] selection: at run time x @ R.T, a small
matmul, gathered into the output's columns (an index map of length out, 0 = no row) and added.

An adapter on token_embd.weight (a tied output head's compensation) corrects the embedding lookup
too, so that both uses of the one matrix read W + delta: the graph calls LOOKUP, tokens [T] ->
the rows delta[tokens] [T, dim] (gather(pad(R), map[tokens]) and B[tokens] @ A), bound from the
same AdapterSet; a package stores the adapter once, at the head's site, and `ingot.load` binds
LOOKUP from it (bind_lookups).

    >>> import numpy as np
    >>> a, b = np.ones((2, 8), np.float32), np.ones((4, 2), np.float32)
    >>> adapters = AdapterSet({"blk.0.attn_q.weight": [(a, 0.5 * b)]})
    >>> exe = adapters.executable(["blk.0.attn_q.weight"], [4], length=1)
    >>> exe.run([np.ones((1, 8), np.float32)])[0].tolist()
    [[8.0, 8.0, 8.0, 8.0]]

PEFT format (Hugging Face): a folder with adapter_config.json (r, lora_alpha, target_modules,
optionally rank_pattern/alpha_pattern, use_rslora) and adapter_model.safetensors holding
`base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight` and
`...mlp.{gate,up,down}_proj.lora_{A,B}.weight`; scale = lora_alpha / r (/ sqrt(r) with rsLoRA).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import dtypes as dt
from .errors import IngotError
from .ir import Op
from .untrusted import read_json, short

# PEFT module name -> the GGUF tensor it adapts (per layer)
PEFT_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
LOOKUP = "token_embd.weight@lookup"   # the call site of the embedding lookup's share of token_embd's adapter
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class AdapterSet:
    """Low-rank factors per weight name: {"blk.3.attn_q.weight": [(A [r, in], B_scaled [out, r]), ...]}.
    Several pairs on one weight add up (two LoRAs, or a LoRA over an error compensation)."""
    factors: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    int8: bool = False   # store the factors as int8 with a scale per rank / output column (error compensation)
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # name -> (idx [k], R [k, in])
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.factors) | frozenset(self.rows)

    def __bool__(self) -> bool:
        return bool(self.factors) or bool(self.rows)

    def merged(self, other: "AdapterSet") -> "AdapterSet":
        out = {k: list(v) for k, v in self.factors.items()}
        for k, v in other.factors.items():
            out.setdefault(k, []).extend(v)
        both = set(self.rows) & set(other.rows)
        if both:
            raise IngotError(f"adapters: two sets of residual rows on {sorted(both)[0]}; one weight keeps one.")
        int8 = (self.int8 or not self) and (other.int8 or not other)
        return AdapterSet(out, int8=int8, rows={**self.rows, **other.rows})

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the factors as stored: float32, or int8 plus a float32 scale per row of A and of B;
        residual rows: int8 with a float32 scale per row, and an int32 index map over the outputs."""
        rows = sum(r.size + 4 * len(r) + 4 * out for out, (_, r) in ((self._outs(n), v) for n, v in self.rows.items()))
        if not self.int8:
            return rows + sum(a.nbytes + b.nbytes for pairs in self.factors.values() for a, b in pairs)
        return rows + sum(a.size + b.size + 4 * (a.shape[0] + b.shape[0]) for pairs in self.factors.values() for a, b in pairs)

    def _outs(self, name: str) -> int:
        """The output width of a weight with residual rows (its low-rank B's rows, else 1 + the largest index)."""
        pairs = self.factors.get(name)
        return pairs[0][1].shape[0] if pairs else int(np.max(self.rows[name][0], initial=-1)) + 1

    def delta(self, name: str, out: int | None = None) -> np.ndarray:
        """scale * B @ A summed over the pairs of one weight plus its residual rows, [out, in] (for
        tests and small weights; out: the weight's rows, needed when it has residual rows only)."""
        total = sum(b.astype(np.float64) @ a.astype(np.float64) for a, b in self.factors.get(name, []))
        if name in self.rows:
            idx, r = self.rows[name]
            full = np.zeros((out or self._outs(name), r.shape[1]))
            full[idx] = r
            total = total + full
        return np.asarray(total, np.float32)

    def site_rows(self, names: list[str], outs: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(map [sum(outs)] int32, R [k, in]) for the residual rows of weights multiplied side by side:
        map[j] = 1 + the row of R that output j adds, 0 where none; None when these weights have none."""
        parts = [(i, idx, r) for i, n in enumerate(names) if n in self.rows for idx, r in [self.rows[n]]]
        if not parts:
            return None
        starts = np.concatenate([[0], np.cumsum(outs)])
        index = np.zeros(int(starts[-1]), np.int32)
        at = 0
        for i, idx, r in parts:
            idx = np.asarray(idx, np.int64)
            if len(idx) != len(r) or (len(idx) and (idx.min() < 0 or idx.max() >= outs[i])) or len(np.unique(idx)) != len(idx):
                raise IngotError(f"adapters: the residual rows of {names[i]} do not fit its {outs[i]} outputs "
                                 f"({len(idx)} distinct indices in range needed for {len(r)} rows).")
            index[starts[i] + idx] = at + 1 + np.arange(len(idx), dtype=np.int32)
            at += len(idx)
        return index, np.concatenate([np.asarray(r, np.float32) for _, _, r in parts], axis=0)

    def site_factors(self, names: list[str], outs: list[int], in_width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(A [R, in], B [sum(outs), R]) for weights multiplied side by side: each weight's pairs
        stacked along the rank, B zero where a weight has no adapter."""
        pairs = [(i, a, b) for i, n in enumerate(names) for a, b in self.factors.get(n, [])]
        if not pairs:  # a site built for an adapter this set lacks: a zero delta keeps the graph's shape
            return np.zeros((1, in_width or 1), np.float32), np.zeros((int(sum(outs)), 1), np.float32)
        ins = {a.shape[1] for _, a, _ in pairs}
        if len(ins) != 1:
            raise IngotError(f"adapters: the factors of {names} take inputs of different widths {sorted(ins)}.")
        starts = np.concatenate([[0], np.cumsum(outs)])
        a_all = np.concatenate([a for _, a, _ in pairs], axis=0).astype(np.float32)
        b_all = np.zeros((int(starts[-1]), a_all.shape[0]), np.float32)
        r0 = 0
        for i, a, b in pairs:
            if b.shape[0] != outs[i]:
                raise IngotError(f"adapters: {names[i]} has {outs[i]} outputs but its adapter's B has {b.shape[0]} rows.")
            b_all[starts[i]:starts[i + 1], r0:r0 + a.shape[0]] = b
            r0 += a.shape[0]
        return a_all, b_all

    def executable(self, names: list[str], outs: list[int], length: int, device: str = "cpu", in_width: int | None = None):
        """The executable of one call site for `length` rows of input: x [length, in] -> delta
        [length, sum(outs)]; cached per (site, length, device)."""
        key = (tuple(names), tuple(outs), length, device)
        exe = self._cache.get(key)
        if exe is None:
            rows = self.site_rows(names, outs)
            low = self.site_factors(names, outs, in_width) if rows is None or any(n in self.factors for n in names) \
                else (None, None)
            exe = self._cache[key] = low_rank_executable(*low, length, device, self.int8, rows=rows, in_width=in_width)
        return exe

    def lookup_executable(self, name: str, outs: int, width: int, length: int, device: str = "cpu"):
        """The executable of the embedding lookup's share of weight `name`'s adapter: tokens [length]
        int32 -> delta[tokens] [length, width] (zeros when this set has none); cached."""
        key = (LOOKUP, name, outs, length, device)
        exe = self._cache.get(key)
        if exe is None:
            from .graph import Graph
            from .ir import TensorType

            g = Graph()
            tokens = g.placeholder((length,), dt.int32, name="tokens")
            out = lookup_delta(g, tokens, self.lookup_parts(name, outs), width, self.int8)
            exe = self._cache[key] = g.compile(feeds={tokens: TensorType((length,), dt.int32)}, targets=[out], device=device)
        return exe

    def lookup_parts(self, name: str, outs: int):
        """(A [R, in], B [outs, R]) or None, and (map, R) or None: what lookup_delta reads for `name`."""
        pairs = self.factors.get(name)
        low = (np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs], axis=1)) if pairs else None
        return low, self.site_rows([name], [outs])


def lookup_delta(g, tokens, parts, width: int, int8: bool, prefix: str = ""):
    """tokens [T] -> [T, width]: rows `tokens` of B @ A + S R (parts from AdapterSet.lookup_parts),
    stored as the head's executable stores them (int8 with the same scales), so both uses add one delta."""
    low, rows = parts

    def table(m: np.ndarray, name: str):   # m [rows, cols] whose rows are gathered: int8 with a scale per row
        m = np.ascontiguousarray(m, np.float32)
        if not int8:
            return g.constant(m, name=prefix + name)
        q, scale = _int8_columns(m.T)
        return g.dequantize(g.constant(np.ascontiguousarray(q.T), name=prefix + name),
                            scale=g.constant(np.ascontiguousarray(scale.T), name=f"{prefix}{name}.scale"))
    out = None
    if low is not None:
        a, b = low
        if int8:   # A as the head's executable holds it: int8 with a scale per rank
            q, scale = _int8_columns(np.ascontiguousarray(a.T, np.float32))
            a = (q.astype(np.float32) * scale).T
        out = g.matmul(g.gather(table(b, "B_rows"), tokens, axis=0), g.constant(np.ascontiguousarray(a, np.float32),
                                                                                name=prefix + "A_rows"))
    if rows is not None:
        index, r = rows
        q, scale = _int8_columns(np.ascontiguousarray(np.asarray(r, np.float32).T))   # R always int8, a scale per row
        # a zero row in front (map entry 0) kept in the constant: gather(dequantize) runs as one quantized
        # gather of the looked-up rows (with a pad between, every call dequantized all of R: 3.8 ms for 6,002 rows)
        q = np.concatenate([np.zeros((q.shape[0], 1), np.int8), q], axis=1)
        scale = np.concatenate([np.ones((1, 1), np.float32), scale], axis=1)
        stored = g.dequantize(g.constant(np.ascontiguousarray(q.T), name=prefix + "R"),
                              scale=g.constant(np.ascontiguousarray(scale.T), name=prefix + "R.scale"))
        at = g.gather(g.constant(np.asarray(index, np.int32), name=prefix + "R_map"), tokens, axis=0)
        picked = g.gather(stored, at, axis=0)
        out = picked if out is None else out + picked
    if out is None:   # a site built for an adapter this set lacks: a zero delta keeps the graph's shape
        out = g.gather(g.constant(np.zeros((1, width), np.float32), name=prefix + "zero"), tokens * np.int32(0), axis=0)
    return out


def _int8_columns(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per column: (q [K, N] int8, scale [1, N] float32)."""
    scale = np.abs(m).max(axis=0, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(m / scale), -127, 127).astype(np.int8), scale


def low_rank_executable(a: np.ndarray | None, b: np.ndarray | None, length: int, device: str = "cpu", int8: bool = False,
                        rows: tuple[np.ndarray, np.ndarray] | None = None, in_width: int | None = None):
    """x [length, in] -> (x @ a.T) @ b.T as a compiled executable (rank-R bottleneck, two matmuls);
    int8: the factors stored as int8 with a scale per column (quantized matmuls). rows (map, R):
    plus the residual rows, gather(pad(x @ R.T, one zero column in front), map) (R always int8,
    a scale per row); a and b None: the rows alone."""
    from .graph import Graph
    from .ir import TensorType

    g = Graph()
    width = a.shape[1] if a is not None else rows[1].shape[1] if rows is not None else in_width
    x = g.placeholder((length, width), dt.float32, name="x")

    def weight(m: np.ndarray, name: str):
        m = np.ascontiguousarray(m, np.float32)
        if not int8:
            return g.constant(m, name=name)
        q, scale = _int8_columns(m)
        return g.dequantize(g.constant(q, name=name), scale=g.constant(scale, name=f"{name}.scale"))
    out = None
    if a is not None:
        down = g.matmul(x, weight(a.T, "A_t"))        # [length, R]
        out = g.matmul(down, weight(b.T, "B_t"))      # [length, out]
    if rows is not None:
        added = rows_delta(g, x, *rows)
        out = added if out is None else out + added
    return g.compile(feeds={x: TensorType((length, width), dt.float32)}, targets=[out], device=device)


def rows_delta(g, x, index: np.ndarray, r: np.ndarray, prefix: str = ""):
    """x [T, in] -> [T, out]: x @ R.T (R int8, a scale per row) gathered to the outputs by the map
    (1 + the row of R, 0: a zero column padded in front)."""
    q, scale = _int8_columns(np.ascontiguousarray(np.asarray(r, np.float32).T))
    picked = g.matmul(x, g.dequantize(g.constant(q, name=f"{prefix}R_t"), scale=g.constant(scale, name=f"{prefix}R_t.scale")))
    return g.gather(g.pad(picked, [(0, 0), (1, 0)]), g.constant(np.asarray(index, np.int32), name=f"{prefix}R_map"), axis=1)


def factors_of(exe) -> tuple[np.ndarray, np.ndarray, bool]:
    """(A, B, int8) back from an executable made by low_rank_executable (e.g. loaded from a package);
    A [0, in] and B [out, 0] when it holds residual rows only."""
    consts = exe.program.constants
    if "A_t" not in consts or "B_t" not in consts:
        if "R_t" in consts and "R_map" in consts:
            r = np.asarray(consts["R_t"])
            return np.zeros((0, r.shape[0]), np.float32), np.zeros((len(consts["R_map"]), 0), np.float32), True
        raise IngotError("adapters: this callable is not a low-rank adapter (no A_t and B_t constants).")
    int8 = "A_t.scale" in consts
    value = lambda k: (np.asarray(consts[k], np.float32) * consts[f"{k}.scale"]) if int8 else np.asarray(consts[k])  # noqa: E731
    return value("A_t").T, value("B_t").T, int8


def site_adapters(exe, names: list[str], outs: list[int], width: int) -> tuple[dict, dict, bool]:
    """(factors, rows, int8), an AdapterSet's fields, held by one call site's executable (made by
    low_rank_executable, e.g. a package's callable) for weights `names` of `outs` outputs side by
    side and `width` inputs: each weight its own rank columns of the stacked B and its own residual
    rows (the outputs whose map entry is non-zero); IngotError where the rows do not fit."""
    a, b, int8 = factors_of(exe)
    starts = np.concatenate([[0], np.cumsum(outs)])
    rows = rows_of(exe, int(starts[-1]), width)
    factors: dict = {}
    residual: dict = {}
    for i, n in enumerate(names):
        part = b[starts[i]:starts[i + 1]]
        ranks = np.any(part != 0, axis=0)  # this weight's own rank columns of the stacked factors
        if np.any(ranks):
            factors[n] = [(np.ascontiguousarray(a[ranks]), np.ascontiguousarray(part[:, ranks]))]
        own = rows[0][starts[i]:starts[i + 1]] if rows is not None else np.zeros(0, np.int32)
        if np.any(own):
            idx = np.flatnonzero(own)
            residual[n] = (idx.astype(np.int32), np.ascontiguousarray(rows[1][own[idx] - 1]))
    return factors, residual, int8


def bind_lookups(exe) -> None:
    """Bind every unbound LOOKUP-style call site `W@lookup` of exe whose head site W is bound: the
    embedding lookup's share of W's adapter, made from what W's executable holds (a package stores
    the adapter once, at the head's site; `ingot.load` calls this). IngotError naming the head's
    callable where its factors or rows do not fit."""
    for site, node in exe.call_sites.items():
        name, _, kind = site.partition("@")
        if kind != LOOKUP.partition("@")[2] or site in exe.callables or name not in exe.callables or node.op != Op.CALL:
            continue
        head = exe.callables[name]
        ins, outs_types = [s.type for s in node.src], list(node.type)   # as compiled (the attrs may hold dynamic dims)
        if len(ins) != 1 or len(outs_types) != 1:
            raise IngotError(f"the call {site!r} takes {ins} and returns {outs_types}, not an embedding lookup's rows.")
        (tokens,), (out,) = ins, outs_types
        if tokens.rank != 1 or out.rank != 2 or not head.output_types or head.output_types[0].rank != 2:
            raise IngotError(f"callables/{name}.ingot: the call {site!r} takes {tokens} and returns {out}, not the rows "
                             f"of an embedding lookup, or {name!r} is not a head's adapter.")
        width, outs = out.shape[1], head.output_types[0].shape[1]
        try:
            factors, rows, int8 = site_adapters(head, [name], [outs], width)
            lookup = AdapterSet(factors, int8=int8, rows=rows).lookup_executable(name, outs, width, tokens.shape[0],
                                                                                  exe.device)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise IngotError(f"callables/{name}.ingot holds an adapter the embedding lookup cannot read "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:160]}).") from None
        except IngotError as e:
            raise IngotError(f"callables/{name}.ingot: {e}") from None
        exe.bind(site, lookup)


def rebind_lookup(exe, name: str) -> None:
    """A bind hook (`Executable.bind_hooks`, set by `ingot.load`): when a head site `name` is re-bound,
    its embedding lookup `name@lookup` is rebuilt from the new executable, so both uses of the tied
    matrix read the same adapter (this compiles the lookup: a re-bind of such a head is not just a
    dictionary update). Where the new executable holds no adapter the lookup can read, the lookup is
    left unbound, so a run says so rather than using the old one; the caller may bind it."""
    site = f"{name}@lookup"
    if site not in exe.call_sites:
        return
    exe.callables.pop(site, None)
    try:
        bind_lookups(exe)
    except IngotError:
        exe.callables.pop(site, None)


def rows_of(exe, outs: int, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(map [outs] int32, R [k, width] float32) of an executable's residual rows, None without them;
    read from a file, so checked: an int8 R_t [width, k] with a float32 scale [1, k], an integer
    map of length outs whose non-zero entries are 1..k, each once; IngotError otherwise."""
    consts = exe.program.constants
    if "R_t" not in consts and "R_map" not in consts:
        return None
    q, scale, index = (np.asarray(consts.get(k)) for k in ("R_t", "R_t.scale", "R_map"))
    k = q.shape[1] if q.ndim == 2 else -1
    used = index[index != 0] if index.ndim == 1 and index.dtype.kind in "iu" else None
    if (q.dtype != np.int8 or q.ndim != 2 or q.shape[0] != width or scale.dtype != np.float32 or scale.shape != (1, k)
            or not np.all(np.isfinite(scale)) or used is None or index.shape != (outs,) or len(used) != k
            or (k and (used.min() < 1 or used.max() > k or len(np.unique(used)) != k))):
        raise IngotError(f"adapters: the residual rows (R_t {list(q.shape)} {q.dtype}, R_map {list(index.shape)} "
                         f"{index.dtype}) do not fit a weight of {outs} outputs and {width} inputs.")
    return index.astype(np.int32), (q.astype(np.float32) * scale).T


# -- sites in a Llama graph -----------------------------------------------------------------------
def site_layout(cfg, names: list[str]) -> list[int]:
    """The output widths of the weights of one call site."""
    hd = cfg.head_dim
    width = {"attn_q": cfg.n_heads * hd, "attn_k": cfg.n_kv_heads * hd, "attn_v": cfg.n_kv_heads * hd,
             "attn_output": cfg.dim, "ffn_gate": cfg.ffn_dim, "ffn_up": cfg.ffn_dim, "ffn_down": cfg.dim,
             "token_embd": cfg.vocab_size, "output": cfg.vocab_size}   # the output head (tied or not)
    return [width[n.split(".")[-2]] for n in names]


def site_input(cfg, name: str) -> int:
    """The input width of a layer weight."""
    kind = name.split(".")[-2]
    return cfg.n_heads * cfg.head_dim if kind == "attn_output" else cfg.ffn_dim if kind == "ffn_down" else cfg.dim


def binder(cfg, adapters: AdapterSet):
    """callables_for({site: input rows}, device) for LlamaGraph: each call site bound to its executable."""
    def callables_for(sites: dict[str, int], device: str) -> dict:
        out = {}
        for site, rows in sites.items():
            if site == LOOKUP:
                name = LOOKUP.partition("@")[0]
                out[site] = adapters.lookup_executable(name, site_layout(cfg, [name])[0], cfg.dim, rows, device)
                continue
            weights = site.split("+")
            out[site] = adapters.executable(weights, site_layout(cfg, weights), rows, device, site_input(cfg, weights[0]))
        return out
    return callables_for


# -- PEFT ---------------------------------------------------------------------------------------
def parse_lora_arg(text: str) -> tuple[str, float]:
    """"PATH[:SCALE]" -> (path, scale multiplier)."""
    path, sep, tail = text.rpartition(":")
    if sep and path and not Path(text).exists():
        try:
            return path, float(tail)
        except ValueError:
            pass
    return text, 1.0


def load_peft(path, cfg, multiplier: float = 1.0) -> AdapterSet:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) as an AdapterSet for a
    Llama-family config; IngotError if a file is missing or a factor does not fit the model.

    HF checkpoints hold q/k projections in the Hugging Face head order; GGUF files permute their
    rows for interleaved RoPE, so B's rows are permuted the same way for q and k.
    """
    from .package import read_safetensors

    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise IngotError(f"LoRA {path}: a PEFT adapter folder needs adapter_config.json and adapter_model.safetensors.")
    config = read_json(config_path, f"LoRA {config_path}")
    if not isinstance(config, dict) or "r" not in config:
        raise IngotError(f"LoRA {config_path} has no rank r.")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise IngotError(f"LoRA {config_path}: {key} is {short(config.get(key))}, not an object.")
    tensors = {k: np.asarray(v, np.float32) for k, v in read_safetensors(weights_path).items()}
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _PEFT_KEY.match(key)
        if not m:
            raise IngotError(f"LoRA {weights_path}: tensor {key!r} is not a LoRA factor of q/k/v/o/gate/up/down_proj.")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in PEFT_MODULES:
            raise IngotError(f"LoRA {weights_path}: module {module!r} is not one of {', '.join(PEFT_MODULES)}.")
        pairs.setdefault((layer, module), {})[which] = value
    if not pairs:
        raise IngotError(f"LoRA {weights_path} holds no LoRA factors.")
    hd = cfg.head_dim
    shapes = {"q_proj": (cfg.n_heads * hd, cfg.dim), "k_proj": (cfg.n_kv_heads * hd, cfg.dim),
              "v_proj": (cfg.n_kv_heads * hd, cfg.dim), "o_proj": (cfg.dim, cfg.n_heads * hd),
              "gate_proj": (cfg.ffn_dim, cfg.dim), "up_proj": (cfg.ffn_dim, cfg.dim), "down_proj": (cfg.dim, cfg.ffn_dim)}
    factors: dict[str, list] = {}
    for (layer, module), ab in sorted(pairs.items()):
        name = f"blk.{layer}.{PEFT_MODULES[module]}.weight"
        if set(ab) != {"A", "B"}:
            raise IngotError(f"LoRA {weights_path}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}.")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[module]
        if layer >= cfg.n_layers:
            raise IngotError(f"LoRA {path}: layer {layer} {module} but the model has {cfg.n_layers} layers.")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
            raise IngotError(f"LoRA {path}: layer {layer} {module} has A {list(a.shape)} and B {list(b.shape)}, "
                             f"which do not fit the model's weight [{out}, {inp}] (A must be [r, {inp}], B [{out}, r]).")
        rank = a.shape[0]
        if rank < 1:
            raise IngotError(f"LoRA {path}: layer {layer} {module} has rank 0 factors.")
        r_cfg = _pattern(config.get("rank_pattern"), module, layer, config["r"])
        alpha = _pattern(config.get("alpha_pattern"), module, layer, config.get("lora_alpha", r_cfg))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise IngotError(f"LoRA {config_path}: lora_alpha for layer {layer} {module} is {short(alpha)}, not a finite number.")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if cfg.rope_interleaved and module in ("q_proj", "k_proj"):
            b = _to_interleaved_rows(b, cfg.n_heads if module == "q_proj" else cfg.n_kv_heads, hd)
        factors.setdefault(name, []).append((a.astype(np.float32), (b * (scale * multiplier)).astype(np.float32)))
    return AdapterSet(factors)


def _pattern(patterns, module: str, layer: int, default):
    for key, value in (patterns or {}).items():
        if re.search(rf"(^|\.){re.escape(str(key))}$", f"layers.{layer}.{module}") or key == module:
            return value
    return default


def _to_interleaved_rows(b: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows of a q/k projection from HF order (each head's first half, then second half) to the GGUF
    order llama.cpp writes for interleaved RoPE (pairs (i, i + head_dim / 2) side by side)."""
    r = b.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2)
    return np.ascontiguousarray(r.reshape(b.shape))
