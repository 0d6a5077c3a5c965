"""QuantizedTensor: a weight kept as integers with block-wise parameters, Ingot's in-memory format.

Layout (DESIGN.md, "Quantized storage"): a logical [rows, cols] matrix of `qdtype` integers;
4-bit values packed two per byte along cols, low nibble first (storage [rows, cols // 2] uint8);
parameters per block of `block_size` consecutive columns, as float32 [rows, cols // block_size]:

    w[r, c] = (q[r, c] - zero_point[r, b]) * scale[r, b] + bias[r, b],   b = c // block_size

zero_point and bias are optional. Every GGUF quant type converts into this losslessly.

A lookup-table tensor (`lut` set, `scale` None) maps each integer through a table instead:
w[r, c] = lut[r // (rows // lut.shape[0]), c // (cols // lut.shape[1]), q[r, c]], the table
block-broadcast over the logical matrix (one per tensor: [1, 1, 2**bits]; one per group of output
rows: [rows // g, 1, 2**bits]), the form `Graph.dequantize(q, lut=)` takes. With both `lut` and
`scale` set (a scaled lookup table, GGUF's IQ and MXFP4 types) each looked-up value is multiplied
by its block's scale: w[r, c] = lut[..., q[r, c]] * scale[r, b], in float32; with `bias` set too (Ingot's
lut4:bB:offset, scale and bias float16) its block's offset is added: lut[..., q[r, c]] * scale[r, b] + bias[r, b].

`to_k_major()` gives the transposed form a matmul reads best on the CPU: the logical [cols, rows]
matrix (reduction axis first), packed along rows, blocks along axis 0, parameters
[cols // block_size, rows]. A GEMV over it accumulates whole rows of outputs at once (vectorised
across outputs, no per-block horizontal sums). `block_axis` says which form a tensor is in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import dtypes as dt


@dataclass
class QuantizedTensor:
    q: np.ndarray                    # storage: uint8 (packed 4-bit), int8 or uint8
    qdtype: dt.DType                 # int4, uint4, int8 or uint8
    shape: tuple[int, int]           # logical [rows, cols]
    block_size: int
    scale: np.ndarray | None         # float32 [rows, cols // block_size]; None for a plain lookup table
    bias: np.ndarray | None = None   # float32 [rows, cols // block_size]
    zero_point: np.ndarray | None = None
    source: str = ""                 # e.g. "Q4_1" for a GGUF tensor
    block_axis: int = 1              # 1: blocks run along cols (GGUF's form); 0: along rows (k-major)
    lut: np.ndarray | None = None    # float32 [pR, pC, 2**bits] block-broadcast table (LUT formats)
    two_level: tuple[int, int] | None = None   # (weights per super-block, bits per code): see two_level_nbytes

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + sum(p.nbytes for p in (self.scale, self.bias, self.zero_point, self.lut) if p is not None))

    @property
    def two_level_nbytes(self) -> int:
        """Bytes of the two-level encoding of a tensor quantized with `two_level` = (S, BITS) (the
        `:k` formats, GGUF Q4_K's idea): each block's scale (and bias) is an unsigned BITS-bit code
        times a float16 unit per super-block of S weights along the blocks' axis (scale = d * code,
        bias = -dmin * code), so every parameter held here is that product, exactly; the codes and
        units take BITS bits per block and 16 bits per super-block per parameter. Without
        two_level: nbytes. A table (lut4:bB:offset:k) counts as it is. (The CPU kernels read codes and units:
        two_level_memory_nbytes; on AVX-512 an LLM's weights are tiles with the float16 products,
        kernels.tile_weight; others the products: nbytes.)"""
        if self.two_level is None:
            return self.nbytes
        per_super, bits = self.two_level
        params = [p for p in (self.scale, self.bias) if p is not None]
        blocks = self.scale.size
        supers = blocks // (per_super // self.block_size)
        table = 0 if self.lut is None else self.lut.nbytes
        return int(self.q.nbytes + table + len(params) * ((blocks * bits + 7) // 8 + 2 * supers))

    @property
    def two_level_memory_nbytes(self) -> int:
        """Bytes a two-level tensor takes in the CPU backend's memory: its codes a byte each and its
        units (TwoLevelParams, what the GEMV reads); other tensors, and tables (whose scales and offsets
        the CPU holds as their float16 products), nbytes."""
        if self.two_level is None or self.lut is not None:
            return self.nbytes
        params = [p for p in (self.scale, self.bias) if p is not None]
        blocks = self.scale.size
        supers = blocks // (self.two_level[0] // self.block_size)
        return int(self.q.nbytes + len(params) * (blocks + 2 * supers))

    def two_level_codes(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(units [n_super, R], codes [n_super, per_super, R]) per parameter (scale, then bias as -unit * code)
        of a two-level tensor, super-blocks along the blocks' axis and R the other: the encoding
        two_level_nbytes counts (see two_level_split)."""
        per_super, bits = self.two_level
        return [two_level_split(p.T if self.block_axis == 0 else p, per_super // self.block_size, bits, sign)
                for p, sign in ((self.scale, 1), (self.bias, -1)) if p is not None]

    def values(self) -> np.ndarray:
        """The unpacked integers [rows, cols] (int8 or uint8)."""
        if self.qdtype.packed:
            return dt.unpack_int4(self.q, self.shape[1], signed=self.qdtype.kind == "i")
        return self.q

    def dequantize_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 rows [start:stop]; for tests and small slices, never the whole of a big weight."""
        stop = self.shape[0] if stop is None else stop
        v = self.values()[start:stop].astype(np.float32)
        if self.lut is not None:
            lut = self.lut
            rows_per, cols_per = self.shape[0] // lut.shape[0], self.shape[1] // lut.shape[1]
            r = (np.arange(start, stop) // rows_per)[:, None]
            c = (np.arange(self.shape[1]) // cols_per)[None, :]
            looked_up = lut[r, c, v.astype(np.intp)].astype(np.float32)
            if self.scale is None:
                return looked_up
            looked_up *= self._repeat(self.scale, start, stop)
            return looked_up if self.bias is None else looked_up + self._repeat(self.bias, start, stop)
        rep = lambda p: self._repeat(p, start, stop)  # noqa: E731
        if self.zero_point is not None:
            v = v - rep(self.zero_point)
        v = v * rep(self.scale)
        if self.bias is not None:
            v = v + rep(self.bias)
        return v

    def _repeat(self, p: np.ndarray, start: int, stop: int) -> np.ndarray:
        """A block parameter repeated to one value per weight, rows start..stop."""
        if self.block_axis == 0:
            return np.repeat(p, self.block_size, axis=0)[start:stop]
        return np.repeat(p[start:stop], self.block_size, axis=1)

    def to_k_major(self) -> "QuantizedTensor":
        """The same weight transposed: logical [cols, rows], packed along rows, blocks along axis 0.

        4-bit values pack two per byte along rows, so an odd number of rows (a vocabulary of 32001)
        cannot pack: those stay one value per byte (int4 -> int8, uint4 -> uint8), the same numbers."""
        if self.block_axis != 1:
            raise ValueError("already k-major")
        values = self.values().T                                  # [cols, rows]
        qdtype = self.qdtype
        if qdtype.packed and self.shape[0] % 2 == 0:
            q = dt.pack_int4(values)
        else:
            q = np.ascontiguousarray(values)
            qdtype = {"int4": dt.int8, "uint4": dt.uint8}.get(qdtype.name, qdtype)
        t = lambda p: None if p is None else np.ascontiguousarray(p.T)  # noqa: E731
        lut = None if self.lut is None else np.ascontiguousarray(self.lut.transpose(1, 0, 2))
        return QuantizedTensor(q, qdtype, (self.shape[1], self.shape[0]), self.block_size, t(self.scale),
                               t(self.bias), t(self.zero_point), self.source, block_axis=0, lut=lut,
                               two_level=self.two_level)


def concat_columns(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
    """k-major tensors of one format side by side: [K, N1] + [K, N2] + ... -> [K, N1 + N2 + ...]."""
    first = parts[0]
    same = all(p.block_axis == 0 and p.qdtype == first.qdtype and p.block_size == first.block_size
               and p.shape[0] == first.shape[0] and (p.bias is None) == (first.bias is None)
               and (p.zero_point is None) == (first.zero_point is None)
               and (not p.qdtype.packed or p.shape[1] % 2 == 0) and (p.lut is None) == (first.lut is None)
               and (p.lut is None or p.lut.shape[0] == 1) and (p.scale is None) == (first.scale is None)
               and p.two_level == first.two_level for p in parts)
    if not same:
        raise ValueError("only k-major tensors of one format and K concatenate")
    lut = None
    if first.lut is not None and first.scale is not None:  # scaled tables: one table for all
        if any(p.lut.shape[:2] != (1, 1) or not np.array_equal(p.lut, first.lut) for p in parts):
            raise ValueError("only scaled-table tensors with one and the same table concatenate")
        lut = first.lut
    elif first.lut is not None:  # tables per group of columns: repeat each up to the common group size
        widths = [p.shape[1] // p.lut.shape[1] for p in parts]
        group = int(np.gcd.reduce(widths))
        lut = np.ascontiguousarray(np.concatenate([np.repeat(p.lut, w // group, axis=1) for p, w in zip(parts, widths)], axis=1))
    cat = lambda arrays: None if arrays[0] is None else np.ascontiguousarray(np.concatenate(arrays, axis=1))  # noqa: E731
    return QuantizedTensor(cat([p.q for p in parts]), first.qdtype, (first.shape[0], sum(p.shape[1] for p in parts)),
                           first.block_size, cat([p.scale for p in parts]), cat([p.bias for p in parts]),
                           cat([p.zero_point for p in parts]), first.source, block_axis=0, lut=lut,
                           two_level=first.two_level)


def tensor_nbytes(t) -> int:
    """Bytes a weight takes as stored: a QuantizedTensor's (or models.moe.ExpertStack's) packed values and
    parameters, or an array's."""
    return int(t.nbytes) if hasattr(t, "nbytes") else int(np.asarray(t).nbytes)   # (an ExpertStack has nbytes too)


class TwoLevelParams:
    """Block parameters [nb, N] (k-major) held as the :k formats store them: unsigned codes [nb, N]
    (uint8) times a float16 unit per super-block of `per_super` blocks along axis 0 (units
    [nb / per_super, N], negative for a bias: the product is the parameter). What a QuantizedTensor's
    scale or bias is when read from a package for the CPU backend (read_llm(two_level_codes=True)),
    whose GEMV multiplies codes by units as it reads them; np.asarray gives the float16 products.

        >>> p = TwoLevelParams(np.array([[1, 2], [3, 4]], np.uint8), np.array([[0.5, -1]], np.float16))
        >>> np.asarray(p).tolist(), p.shape, p.nbytes
        ([[0.5, -2.0], [1.5, -4.0]], (2, 2), 8)
    """
    dtype = np.dtype(np.float16)
    ndim = 2

    def __init__(self, codes: np.ndarray, units: np.ndarray):
        if (codes.ndim != 2 or units.ndim != 2 or codes.dtype != np.uint8 or units.dtype != np.float16
                or units.shape[1] != codes.shape[1] or units.shape[0] == 0 or codes.shape[0] % units.shape[0]):
            raise ValueError(f"two-level parameters: codes {codes.dtype}{list(codes.shape)} and units "
                             f"{units.dtype}{list(units.shape)} do not fit")
        self.codes, self.units = codes, units
        self.per_super = codes.shape[0] // units.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def size(self) -> int:
        return int(self.codes.size)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.units.nbytes)

    def __getitem__(self, index):   # a slice (a split of side-by-side weights): of the products
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        products = (self.codes.astype(np.float32) * np.repeat(self.units.astype(np.float32), self.per_super, axis=0))
        return products.astype(dtype or np.float16)


def two_level_split(p: np.ndarray, per_super: int, bits: int, sign: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Block parameters [R, nb] (nb blocks along axis 1, per_super of them per super-block) that are
    sign * unit * code, as (units float16 [n_super, R], codes uint8 [n_super, per_super, R]): for
    each super-block the largest float16 unit whose multiples, codes of at most `bits` bits, give
    every product exactly. ValueError if there is none (the parameters are not two-level)."""
    v = sign * np.asarray(p, np.float64)
    if v.ndim != 2 or v.shape[1] % per_super:
        raise ValueError(f"parameters of shape {v.shape} do not split into super-blocks of {per_super} blocks")
    v = v.reshape(v.shape[0], -1, per_super).transpose(1, 2, 0)             # [n_super, per_super, R]
    top = v.max(axis=1)
    unit, found = np.zeros_like(top), top <= 0
    for c in range(1, 2 ** bits):     # the unit that makes the largest product code c: the largest unit first
        u = top / c
        codes = v / np.where(u > 0, u, 1)[:, None, :]
        fits = ~found & np.all((codes == np.rint(codes)) & (codes >= 0), axis=1) & (u.astype(np.float16) == u)
        unit, found = np.where(fits, u, unit), found | fits
    if not found.all():
        raise ValueError("parameters that are not multiples of a float16 unit per super-block")
    return unit.astype(np.float16), np.rint(v / np.where(unit > 0, unit, 1)[:, None, :]).astype(np.uint8)


def two_level_join(units: np.ndarray, codes: np.ndarray, sign: int = 1) -> np.ndarray:
    """two_level_split's inverse: float16 parameters [R, nb] (exact: the units keep 11 - bits significant bits)."""
    products = sign * units.astype(np.float32)[:, None, :] * codes.astype(np.float32)
    return np.ascontiguousarray(products.transpose(2, 0, 1).reshape(units.shape[1], -1)).astype(np.float16)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes of `bits` (6 or 8) bits as bytes: 8 as they are, 6 four to three bytes (zero-padded)."""
    flat = codes.reshape(-1).astype(np.uint32)
    if bits == 8:
        return flat.astype(np.uint8)
    flat = np.concatenate([flat, np.zeros(-len(flat) % 4, np.uint32)]).reshape(-1, 4)
    word = flat[:, 0] | flat[:, 1] << 6 | flat[:, 2] << 12 | flat[:, 3] << 18
    return np.stack([word & 255, word >> 8 & 255, word >> 16 & 255], axis=1).astype(np.uint8).reshape(-1)


def unpack_codes(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """pack_codes's inverse: the first `count` codes (uint8)."""
    data = np.asarray(data, np.uint8).reshape(-1)
    if bits == 8:
        return data[:count].copy()
    b = data.reshape(-1, 3).astype(np.uint32)
    word = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16
    return np.stack([word >> s & 63 for s in (0, 6, 12, 18)], axis=1).reshape(-1)[:count].astype(np.uint8)
