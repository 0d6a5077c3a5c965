"""Ingot's dtypes.

Packed 4-bit integers (`int4`, `uint4`) are stored two per byte, low nibble first along the last
axis: a logical array of shape (..., n) is held as uint8 of shape (..., ceil(n / 2)).
bfloat16 comes from ml_dtypes on the CPU, imported the first time a bfloat16 array is needed (the
import costs most of a second, more than all of `import ingot`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from .errors import IngotError


@cache
def _ml_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


@dataclass(frozen=True)
class DType:
    name: str
    bits: int
    kind: str  # "f" float, "i" signed int, "u" unsigned int, "b" bool, "c" complex
    _storage: np.dtype | None  # None: the ml_dtypes type of the same name, imported on first use

    @property
    def storage(self) -> np.dtype:
        """The NumPy dtype that holds the values (uint8 for packed 4-bit)."""
        return self._storage if self._storage is not None else _ml_dtype(self.name)

    @property
    def packed(self) -> bool:
        return self.bits == 4

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype for unpacked values (int8/uint8 for the 4-bit types)."""
        if self.name == "int4":
            return np.dtype(np.int8)
        return self.storage

    def __repr__(self) -> str:
        return f"ingot.{self.name}"


float32 = DType("float32", 32, "f", np.dtype(np.float32))
float16 = DType("float16", 16, "f", np.dtype(np.float16))
bfloat16 = DType("bfloat16", 16, "f", None)
int8 = DType("int8", 8, "i", np.dtype(np.int8))
uint8 = DType("uint8", 8, "u", np.dtype(np.uint8))
int4 = DType("int4", 4, "i", np.dtype(np.uint8))
uint4 = DType("uint4", 4, "u", np.dtype(np.uint8))
int32 = DType("int32", 32, "i", np.dtype(np.int32))
int64 = DType("int64", 64, "i", np.dtype(np.int64))
bool_ = DType("bool", 8, "b", np.dtype(np.bool_))
complex64 = DType("complex64", 64, "c", np.dtype(np.complex64))

ALL = (float32, float16, bfloat16, int8, uint8, int4, uint4, int32, int64, bool_, complex64)
BY_NAME = {d.name: d for d in ALL}
_BY_NUMPY = {d.storage: d for d in ALL if not d.packed and d._storage is not None}


def from_numpy(dtype) -> DType:
    """The Ingot dtype of a NumPy dtype (float64 becomes float32, complex128 complex64)."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return float32
    if dtype == np.complex128:
        return complex64
    if dtype in _BY_NUMPY:
        return _BY_NUMPY[dtype]
    if dtype.name == "bfloat16" and dtype == bfloat16.storage:
        return bfloat16
    raise IngotError(f"NumPy dtype {dtype} has no Ingot equivalent (supported: {', '.join(d.name for d in ALL)}).")


def by_name(name: str) -> DType:
    if name not in BY_NAME:
        raise IngotError(f"unknown dtype {name!r} (supported: {', '.join(BY_NAME)}).")
    return BY_NAME[name]


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Pack integers in 0..15 (uint4) or -8..7 (int4) two per byte along the last axis, low nibble first."""
    v = np.asarray(values)
    n = v.shape[-1]
    nib = (v.astype(np.int16) & 0xF).astype(np.uint8)
    if n % 2:
        nib = np.concatenate([nib, np.zeros(nib.shape[:-1] + (1,), np.uint8)], axis=-1)
    return np.ascontiguousarray((nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8))


def unpack_int4(packed: np.ndarray, n: int, signed: bool) -> np.ndarray:
    """Inverse of pack_int4: the last axis becomes n values (int8 if signed else uint8)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    out = out[..., :n]
    if signed:
        return ((out.astype(np.int8) << 4) >> 4).astype(np.int8)
    return out


def storage_shape(shape: tuple[int, ...], dtype: DType) -> tuple[int, ...]:
    if dtype.packed:
        if not shape:
            raise IngotError(f"a {dtype.name} tensor needs at least one axis to pack along.")
        return tuple(shape[:-1]) + ((shape[-1] + 1) // 2,)
    return tuple(shape)


TILE = 32   # k and columns per tile of a TiledWeight


class TiledWeight:
    """A k-major quantized weight's storage (DESIGN.md "Quantized storage": 4-bit packed [K, N / 2]
    uint8, two columns a byte, low nibble the even one; 8-bit [K, N] int8 or uint8) held tile by
    tile: `tiles` [K / 32, N / 32, 32 * W], tile (a, b) the W bytes (16 for 4 bits, 32 for 8) of
    columns 32 b..32 b + 31 of rows 32 a, 32 a + 1, ..., 32 a + 31 in turn. The CPU's GEMVs read a
    tile as one run of 512 or 1024 bytes where the k-major array spreads it over 32 runs of W
    (backends/cpu/kernels.py converts a weight into this form at load: only one of the two forms is
    ever kept). It stands for the k-major array everywhere else: `shape`, `dtype` and `nbytes` are
    that array's, indexing rows (t[rows]) or columns (t[:, columns]) reads only those, and
    np.asarray(t) makes the whole array (a copy).

        >>> q = np.arange(64 * 32, dtype=np.uint16).astype(np.uint8).reshape(64, 32)
        >>> t = TiledWeight.from_k_major(q, bits=4)
        >>> t.shape, t.tiles.shape, bool((np.asarray(t) == q).all()), bool((t[:, [3, 17]] == q[:, [3, 17]]).all())
        ((64, 32), (2, 2, 512), True, True)
    """

    def __init__(self, tiles: np.ndarray):
        if tiles.dtype not in (np.uint8, np.int8) or tiles.ndim != 3 or tiles.shape[2] not in (16 * TILE, 32 * TILE) \
                or (tiles.shape[2] == 16 * TILE and tiles.dtype != np.uint8):
            raise IngotError(f"TiledWeight: tiles must be [K / 32, N / 32, 512] uint8 or [.., .., 1024] int8 or uint8, "
                             f"not {tiles.dtype}{list(tiles.shape)}.")
        self.tiles = tiles
        self.width = tiles.shape[2] // TILE        # bytes of a tile's row
        self.bits = 4 if self.width == 16 else 8
        self.shape = (tiles.shape[0] * TILE, tiles.shape[1] * self.width)
        self.dtype = tiles.dtype
        self.ndim, self.size, self.nbytes = 2, self.shape[0] * self.shape[1], int(tiles.nbytes)

    @staticmethod
    def fits(q: np.ndarray, bits: int) -> bool:
        """Whether a k-major array of `bits`-wide values tiles: K and N multiples of 32."""
        width = 16 if bits == 4 else 32
        return q.ndim == 2 and q.dtype in ((np.uint8,) if bits == 4 else (np.uint8, np.int8)) \
            and q.shape[0] % TILE == 0 and q.shape[1] % width == 0

    @classmethod
    def from_k_major(cls, q: np.ndarray, bits: int) -> "TiledWeight":
        k, stored = q.shape
        width = 16 if bits == 4 else 32
        tiles = np.ascontiguousarray(q.reshape(k // TILE, TILE, stored // width, width).transpose(0, 2, 1, 3))
        return cls(tiles.reshape(k // TILE, stored // width, TILE * width))

    def _blocks(self) -> np.ndarray:
        a, b, _ = self.tiles.shape
        return self.tiles.reshape(a, b, TILE, self.width)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        q = self._blocks().transpose(0, 2, 1, 3).reshape(self.shape)
        return q if dtype is None else q.astype(dtype)

    def __getitem__(self, key) -> np.ndarray:
        """Rows t[rows] or columns t[:, columns] (integer arrays) of the k-major array, read from their tiles."""
        blocks = self._blocks()
        if isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and np.ndim(key[1]) == 1 \
                and np.asarray(key[1]).dtype.kind in "iu":
            cols = np.asarray(key[1], np.intp)
            return blocks[:, cols // self.width, :, cols % self.width].transpose(1, 2, 0).reshape(self.shape[0], -1)
        if not isinstance(key, tuple) and np.ndim(key) == 1 and np.asarray(key).dtype.kind in "iu":
            rows = np.asarray(key, np.intp)
            return blocks[rows // TILE, :, rows % TILE, :].reshape(len(rows), self.shape[1])
        return np.asarray(self)[key]

    def tobytes(self) -> bytes:
        return np.asarray(self).tobytes()

    def __repr__(self) -> str:
        return f"TiledWeight(k-major {self.dtype}{list(self.shape)}, {self.bits}-bit tiles {list(self.tiles.shape)})"
