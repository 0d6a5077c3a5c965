"""Per-request adapters in one decode batch, gathered per row (S-LoRA / Punica style).

A rows decoder built with `RowAdapters` as its adapter sites computes every adapter delta inline:
each call site's factors of every served adapter are stacked ([adapters, in, R] and [adapters, R,
out], zero-padded to the largest rank R; entry 0 is the base model's, usually zeros), and an int32
feed `adapter_rows` [rows] says which adapter each row uses; the graph gathers that row's factors
and multiplies:

    delta[r] = (x[r] @ A[adapter_rows[r]]) @ B[adapter_rows[r]]

Every site of the decoder reads the same feed, which the scheduler sets each step: one small feed
however many sites and adapters there are. Being a feed (like the KV pool's `slots`), it lives in
the executable's fixed device buffer on CUDA, so the step stays one captured CUDA graph; the CUDA
device pipeline runs each site's two gathered matmuls and the add of the delta as one step of two
Triton launches (passes/fuse_gathered_lora.py, backends/cuda/gathered_lora.py). A row whose entry has zero factors
gets a delta of exactly zero (0 * x summed), so exactly the base model's result, and each row's
delta is its own: no row depends on which adapters the others use.

    sites = RowAdapters(cfg, [base, lora_a, lora_b]).for_rows(8)
    model = models.build(cfg, tensors, adapter_sites=sites, rows=8)      # feeds: ..., adapter_rows [8]
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..adapters import AdapterSet, lookup_delta, rows_delta, site_input, site_layout
from ..errors import IngotError
from ..graph import Graph, Tensor


class RowAdapters:
    """The served adapter sets (entry i of `adapter_rows` picks sets[i]) as a rows decoder's adapter
    sites: iterating gives the adapted weight names; `delta` builds one site's gathered delta. The
    stacked factors are made once per site and shared by every rows decoder built from this object
    (and its `for_rows` copies), so each holds one copy of them on a device."""

    def __init__(self, cfg, sets: list[AdapterSet], rows: int = 0, factors: dict | None = None):
        self.cfg, self.sets, self.rows = cfg, list(sets), rows
        self.names = frozenset().union(*(s.names for s in self.sets))
        self._factors: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {} if factors is None else factors
        self._feed: tuple[Graph, Tensor] | None = None

    def for_rows(self, rows: int) -> "RowAdapters":
        """These adapters for a decoder of `rows` rows (sharing the stacked factors)."""
        return RowAdapters(self.cfg, self.sets, rows, self._factors)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def factors(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(A [adapters, in, R], B [adapters, R, out]) of one call site, rank zero-padded to R."""
        key = tuple(names)
        hit = self._factors.get(key)
        if hit is None:
            outs, in_width = site_layout(self.cfg, names), site_input(self.cfg, names[0])
            pairs = [s.site_factors(names, outs, in_width) for s in self.sets]   # (A [r, in], B [out, r]) each
            rank = max(a.shape[0] for a, _ in pairs)
            a_all = np.zeros((len(pairs), in_width, rank), np.float32)
            b_all = np.zeros((len(pairs), rank, int(sum(outs))), np.float32)
            for i, (a, b) in enumerate(pairs):
                a_all[i, :, :a.shape[0]] = a.T
                b_all[i, :b.shape[1], :] = b.T
            hit = self._factors[key] = (a_all, b_all)
        return hit

    def delta(self, g: Graph, names: list[str], x: Tensor) -> Tensor:
        """x [rows, in] -> each row's delta [rows, out] through the adapter `adapter_rows` names."""
        if self.rows < 1:
            raise ValueError("RowAdapters: build a rows decoder with adapters.for_rows(rows).")
        if self._feed is None or self._feed[0] is not g:
            self._feed = (g, g.placeholder((self.rows,), dt.int32, name="adapter_rows"))
        which = self._feed[1]
        a_all, b_all = self.factors(names)
        site = "+".join(names)
        a_rows = g.gather(g.constant(a_all, name=f"{site}.lora_A"), which, axis=0)     # [rows, in, R]
        b_rows = g.gather(g.constant(b_all, name=f"{site}.lora_B"), which, axis=0)     # [rows, R, out]
        down = g.matmul(g.reshape(x, (self.rows, 1, a_all.shape[1])), a_rows)          # [rows, 1, R]
        delta = g.reshape(g.matmul(down, b_rows), (self.rows, b_all.shape[2]))
        residual = self._residual_rows(names)
        return delta if residual is None else delta + rows_delta(g, x, *residual, prefix=f"{site}.")

    def _residual_rows(self, names: list[str]):
        """The site's residual rows (a quantized model's compensation, ingot.adapters), the same in
        every served set (each is the base's merged with a LoRA); None without them."""
        found = [s.site_rows(names, site_layout(self.cfg, names)) for s in self.sets]
        first = found[0]
        if all(f is None for f in found):
            return None
        if any(f is None or not (np.array_equal(f[0], first[0]) and np.array_equal(f[1], first[1])) for f in found):
            raise IngotError(f"serve: the adapter sets differ in residual rows at {'+'.join(names)}; only the base "
                             "model's own (from ingot quantize --compensate) are supported.")
        return first

    def lookup(self, g: Graph, name: str, tokens: Tensor, width: int) -> Tensor:
        """tokens [rows] -> the embedding lookup's share of `name`'s adapter (ingot.adapters.LOOKUP),
        the same in every served set (the base model's compensation of a tied head)."""
        outs = site_layout(self.cfg, [name])[0]
        found = [s.lookup_parts(name, outs) for s in self.sets]

        def same(x, y):
            return (x is None) == (y is None) and (x is None or all(np.array_equal(u, v) for u, v in zip(x, y)))
        if any(not (same(f[0], found[0][0]) and same(f[1], found[0][1])) for f in found) or \
                any(s.int8 != self.sets[0].int8 for s in self.sets if s.factors.get(name)):
            raise IngotError(f"serve: the adapter sets differ at {name}, whose adapter the embedding lookup reads too; "
                             "only the base model's own (from ingot quantize --compensate) is supported.")
        return lookup_delta(g, tokens, found[0], width, self.sets[0].int8, prefix=f"{name}.lookup.")
