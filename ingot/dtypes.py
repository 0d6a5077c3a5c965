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
