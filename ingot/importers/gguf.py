"""Read GGUF files (llama.cpp's format) into Ingot's formats, weights kept quantized.

`read_gguf(path)` returns a `GGUFModel`: the metadata as Python values and every tensor converted
losslessly, block by block, straight from the reader's memory map:

    F32, F16, BF16        float32 ndarray (numpy shape order: rows = ne[1], cols = ne[0]); BF16 as
                          an ml_dtypes.bfloat16 ndarray with read_gguf(..., bfloat16=True)
    I8, I16, I32, I64     int8 / int32 / int32 / int64 ndarray
    Q8_0                  QuantizedTensor int8,  block 32, scale = d
    Q4_0                  QuantizedTensor int4,  block 32, scale = d             (q - 8)
    Q4_1                  QuantizedTensor uint4, block 32, scale = d, bias = m
    Q5_0                  QuantizedTensor int8,  block 32, scale = d             (q - 16)
    Q5_1                  QuantizedTensor uint8, block 32, scale = d, bias = m   (0..31)
    Q4_K                  QuantizedTensor uint4, block 32, scale = d*sc, bias = -dmin*m
    Q5_K                  QuantizedTensor uint8, block 32, scale = d*sc, bias = -dmin*m
    Q6_K                  QuantizedTensor int8,  block 16, scale = d*sc          (q - 32)
    Q2_K                  QuantizedTensor uint4, block 16, scale = d*sc, bias = -dmin*m   (0..3)
    Q3_K                  QuantizedTensor int4,  block 16, scale = d*(sc - 32)   (-4..3)
    TQ1_0, TQ2_0          QuantizedTensor int4,  block 256, scale = d            (-1..1, -1..2)
    IQ4_NL, IQ4_XS        scaled table: uint4 codes, lut = gguf's kvalues, block 32, scale = d (IQ4_XS: d*(sc - 32))
    MXFP4                 scaled table: uint4 codes, lut = the doubled e2m1 values, block 32, scale = 2**(e - 128)
    IQ2_XXS/XS/S,         scaled table: uint4 codes for the grid values and their negatives (the grid
    IQ3_XXS/S             rows and sign patterns decoded per weight), block 32 (IQ2_XS/S: 16),
                          scale = d * (0.5 + s) / 4 (IQ3_XXS: / 2; IQ3_S: d * (1 + 2s))
    IQ1_S, IQ1_M          scaled table: uint4 codes for grid value (-1, 0, 1) +- delta, block 32
                          (IQ1_M: 16), scale = d * (2s + 1)

A scaled table (QuantizedTensor with both lut [1, 1, 16] and scale) means w = lut[code] * scale, in
float32: the product gguf forms. The codebook grids, sign tables and value lists are read from the
gguf package (gguf.quants), not copied. These types take 4 bits a weight plus a float32 scale per
block in memory (IQ4_XS 5 bits, IQ2_XXS 5, IQ2_XS 6; the file holds 4.25, 2.06 and 2.31).

so that `w = q * scale + bias` reproduces `gguf.quants.dequantize` bit for bit in float32 (the
products d*sc are formed in float32 from the f16 values, exactly as llama.cpp does).

Block layouts (per GGUF block; d, m, dmin are little-endian f16):
    Q8_0  d, qs[32] int8
    Q4_0  d, qs[16]: byte j holds element j (low nibble) and j+16 (high nibble)
    Q4_1  d, m, qs[16] as Q4_0
    Q5_0  d, qh[4] (bit j = 5th bit of element j), qs[16] as Q4_0
    Q5_1  d, m, qh[4], qs[16]
    Q4_K  d, dmin, scales[12] (8 six-bit scales and mins), qs[128]: each 32-byte chunk c holds
          sub-block 2c in its low nibbles and 2c+1 in its high nibbles
    Q5_K  d, dmin, scales[12], qh[32] (bit s of byte j = 5th bit of element j of sub-block s), qs[128]
    Q6_K  ql[128] (each 64-byte half h: low nibbles = elements 128h..128h+63, high nibbles the next
          64), qh[64] (each 32-byte half h: bits 2s..2s+1 of byte j = top bits of element
          128h + 32s + j), scales[16] int8, d
GGUF's nibble order is re-packed into Ingot's (two per byte, low nibble = even column). A 1-D
quantized tensor becomes [1, cols]; quantized tensors of more dimensions are refused.

gguf.GGUFReader builds separate memmap views for every element of a metadata array, which takes
~11 s for a 49k-token vocabulary. `_Reader` overrides that step with a bulk one (same ReaderField
data indices; string arrays keep only the string bytes as parts), bounds-checks every read (the
reference returns short strings from a cut-off file) and records how far parsing got, so that a
failure can be explained in one sentence.
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf as _gguf
import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..untrusted import checked_path
from ..quant.formats import QuantizedTensor
from .gguf_blocks import QUANT as _QUANT, convert_quant as _convert_quant

__all__ = ["GGUFModel", "read_gguf", "SUPPORTED_TYPES"]

_T = _gguf.GGMLQuantizationType
_V = _gguf.GGUFValueType


@dataclass
class GGUFModel:
    path: str
    architecture: str                                        # general.architecture ("" if absent)
    metadata: dict[str, Any] = field(default_factory=dict)   # key -> str/int/float/bool, list[str], 1-D ndarray
    tensors: dict[str, np.ndarray | QuantizedTensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)  # name -> GGUF type name, e.g. "Q4_1"

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` if the file has no such key."""
        return self.metadata.get(key, default)


# --------------------------------------------------------------------------------------------
# The reader: gguf.GGUFReader with a fast path for metadata arrays and hooks for error messages.


@functools.lru_cache(maxsize=None)
def _reader_class():
    class _Reader(_gguf.GGUFReader):
        # Set before GGUFReader.__init__ runs so that a failure can be explained.
        _last_key: str | None = None
        _stage: str = "fixed header"
        _tensor_infos: tuple[int, list] | None = None

        def _get(self, offset, dtype, count=1, *args, **kwargs):
            # The reference slices the memmap: at the end of a cut-off file it fails obscurely or
            # returns fewer values.
            n, item = int(count), np.dtype(dtype)
            if int(offset) + n * item.itemsize > self.data.shape[0]:
                raise ValueError(f"{n} x {item.name} at byte {int(offset)} run past the end of the file")
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _push_field(self, fld, skip_sum=False):
            out = super()._push_field(fld, skip_sum)
            self._last_key = fld.name
            if fld.name == "GGUF.kv_count" or not fld.name.startswith("GGUF."):
                self._stage = "metadata"
            return out

        def _build_tensor_info(self, offs, count):
            self._stage = "tensor list"
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            self._tensor_infos = (start_offs, fields)
            self._stage = "tensor data"
            _check_tensor_infos(self.path_name, int(start_offs), fields, int(self.data.shape[0]))
            return super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs, raw_type):
            if int(raw_type) != _V.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            if raw_itype.size < 1 or alen.size < 1:
                raise ValueError("array header runs past the end of the file")
            itype = _V(int(raw_itype[0]))
            n = int(alen[0])
            offs = orig_offs + 12
            u8 = np.asarray(self.data)  # a plain view: memmap's __getitem__ is slow per element
            size = u8.shape[0]
            parts: list[np.ndarray] = [raw_itype, alen]
            if itype == _V.STRING:
                # Only the string bytes become parts (the reference also keeps each length).
                unpack = struct.Struct("<Q" if (sys.byteorder == "little") == (self.byte_order == "I") else ">Q")
                unpack_from = unpack.unpack_from
                bounds = []
                for _ in range(n):
                    if offs + 8 > size:
                        raise ValueError(f"string array of {n} entries runs past the end of the file")
                    (ln,) = unpack_from(u8, offs)
                    bounds.append((offs + 8, offs + 8 + ln))
                    offs += 8 + ln
                if offs > size:
                    raise ValueError(f"string array of {n} entries runs past the end of the file")
                parts.extend(u8[a:e] for a, e in bounds)
                idxs = list(range(2, 2 + n))
            elif itype in self.gguf_scalar_to_np:
                edt = np.dtype(self.gguf_scalar_to_np[itype]).newbyteorder(self.byte_order)
                end = offs + n * edt.itemsize
                if end > size:
                    raise ValueError(f"{itype.name} array of {n} entries runs past the end of the file")
                parts.extend(u8[offs:end].view(edt).reshape(n, 1))
                offs = end
                idxs = list(range(2, 2 + n))
            else:  # nested arrays: rare, leave them to the reference implementation
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, parts, idxs, [_V.ARRAY, itype] if n else [_V.ARRAY]

    return _Reader


class _Refused(Exception):
    """A tensor-list entry that breaks a rule, found before any tensor is touched: its message is the
    IngotError's sentence."""


MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


def _check_tensor_infos(path: str, start: int, fields, size: int) -> None:
    """Every tensor's dims (1..4 of them, each >= 1), type, and bytes (inside the file), computed in
    Python integers so that no product wraps: what the reader would otherwise map, reshape and loop
    over is bounded by the file itself."""
    for f in fields:
        _nl, name_data, _nd, dims, raw_dtype, offset = f.parts
        name = bytes(name_data).decode("utf-8", "replace")
        shown = name if len(name) <= 80 else name[:77] + "..."
        ne = [int(x) for x in dims]
        if not 1 <= len(ne) <= MAX_DIMS:
            raise _Refused(f"{path}: tensor {shown} has {len(ne)} dimensions; GGUF tensors have 1 to {MAX_DIMS}.")
        try:
            ttype = _T(int(raw_dtype[0]))
        except ValueError:
            raise _Refused(f"{path}: tensor {shown} has unknown GGML type id {int(raw_dtype[0])}.") from None
        if min(ne) < 1:
            raise _Refused(f"{path}: tensor {shown} has a dimension of 0 (ne={ne}); every dimension must be at least 1.")
        bs, ts = _gguf.GGML_QUANT_SIZES[ttype]
        if ne[0] % bs:
            raise _Refused(f"{path}: tensor {shown} ({ttype.name}) has {ne[0]} columns, not a multiple of the "
                           f"{ttype.name} block size {bs}.")
        count = 1
        for d in ne:
            count *= d
        first = start + int(offset[0])
        end = first + count // bs * ts
        if end > size:
            raise _Refused(f"{path} is truncated: tensor {shown} ({ttype.name}, ne={ne}) needs bytes {first}..{end} "
                           f"but the file has only {size} bytes.")


def _open(path: str):
    cls = _reader_class()
    reader = cls.__new__(cls)
    reader.path_name = path
    try:
        _gguf.GGUFReader.__init__(reader, path, "r")
    except _Refused as exc:
        raise IngotError(str(exc)) from None
    except Exception as exc:  # the reader raises ValueError, IndexError, KeyError, OSError ...
        raise _explain_failure(path, reader, exc) from exc
    return reader


def _explain_failure(path: str, reader, exc: Exception) -> IngotError:
    size = os.path.getsize(path)
    infos = getattr(reader, "_tensor_infos", None)
    if infos is not None:  # the header parsed; look for the tensor that does not fit
        start, fields = infos
        for f in fields:
            try:
                _nl, name_data, _nd, dims, raw_dtype, offset = f.parts
                name = bytes(name_data).decode("utf-8", "replace")
            except Exception:
                break
            try:
                ttype = _T(int(raw_dtype[0]))
            except ValueError:
                return IngotError(f"{path}: tensor {name} has unknown GGML type id {int(raw_dtype[0])}.")
            ne = [int(x) for x in dims]
            bs, ts = _gguf.GGML_QUANT_SIZES[ttype]
            if ne and ne[0] % bs:
                return IngotError(f"{path}: tensor {name} ({ttype.name}) has {ne[0]} columns, not a "
                                  f"multiple of the {ttype.name} block size {bs}.")
            first = start + int(offset[0])
            end = first + int(np.prod(ne, dtype=np.int64)) * ts // bs
            if end > size:
                return IngotError(f"{path} is truncated: tensor {name} ({ttype.name}, ne={ne}) needs bytes "
                                  f"{first}..{end} but the file has only {size} bytes.")
    stage = getattr(reader, "_stage", "header")
    last = getattr(reader, "_last_key", None)
    where = f"in its {stage}"
    if stage == "metadata" and last and not last.startswith("GGUF."):
        where += f" after key {last!r}"
    return IngotError(f"{path} is truncated or corrupt: reading the GGUF file failed {where} "
                      f"(file size {size} bytes; {type(exc).__name__}: {exc}).")


# --------------------------------------------------------------------------------------------
# Metadata.


def _decode(path: str, key: str, b: np.ndarray) -> str:
    try:
        return b.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IngotError(f"{path}: metadata key {key!r} holds a string that is not valid UTF-8 ({exc}).") from exc


def _field_value(path: str, key: str, f) -> Any:
    main = f.types[0] if f.types else None
    if main == _V.STRING:
        return _decode(path, key, f.parts[-1])
    if main == _V.ARRAY:
        sub = f.types[-1]
        if len(f.types) == 1:
            return []
        if sub == _V.STRING:
            parts = f.parts
            try:
                return [parts[i].tobytes().decode("utf-8") for i in f.data]
            except UnicodeDecodeError as exc:
                raise IngotError(f"{path}: metadata key {key!r} holds a string that is not valid UTF-8 "
                                 f"({exc}).") from exc
        if len(f.types) == 2 and sub in _reader_class().gguf_scalar_to_np:
            parts = f.parts
            vals = np.concatenate([parts[i].reshape(-1) for i in f.data])
            return vals.astype(vals.dtype.newbyteorder("="), copy=True)
        return f.contents()  # nested arrays, flattened as GGUFReader does
    if main is None:
        return None
    return f.parts[-1].tolist()[0]


_PLAIN = {_T.F32: np.float32, _T.F16: np.float32, _T.BF16: np.float32,
          _T.I8: np.int8, _T.I16: np.int32, _T.I32: np.int32, _T.I64: np.int64}
SUPPORTED_TYPES = tuple(t.name for t in (*_PLAIN, *_QUANT))

def _convert_plain(t, bfloat16: bool = False) -> np.ndarray:
    data = np.asarray(t.data)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    if t.tensor_type == _T.BF16 and bfloat16:  # the bits as they are (a copy: the file's pages are released)
        return np.array(data.view("<u2").reshape(shape), copy=True).view(dt.bfloat16.storage)
    if t.tensor_type == _T.BF16:
        out = np.empty(shape, np.float32)
        bits = out.view(np.uint32)
        bits[...] = data.view("<u2").reshape(shape)
        bits <<= 16
        return out
    return np.array(data, dtype=_PLAIN[t.tensor_type], copy=True).reshape(shape)


# --------------------------------------------------------------------------------------------


class LazyTensors(Mapping):
    """Tensors converted when looked up, never cached: a model builder that turns each weight into
    its own layout holds one converted copy at a time, not the whole file twice."""

    def __init__(self, path: str, reader, bfloat16: bool = False):
        self.path, self.reader, self.bfloat16 = path, reader, bfloat16
        self.by_name = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str):
        t = self.by_name[name]
        spec = _QUANT.get(t.tensor_type)
        out = _convert_plain(t, self.bfloat16) if spec is None else _convert_quant(self.path, t, spec)
        self._release(t)
        return out

    def _release(self, t) -> None:
        """Drop the file pages just read from this process's resident set (they stay in the page
        cache): converting the model then costs its converted size, not that plus the file."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start = int(t.data_offset) // page * page
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def __iter__(self):
        return iter(self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)

    def __contains__(self, name) -> bool:
        return name in self.by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.by_name[name].shape))


def read_gguf(path, *, architectures: tuple[str, ...] | None = None, lazy: bool = False,
              bfloat16: bool = False) -> GGUFModel:
    """Read a GGUF file: metadata as Python values, tensors converted losslessly and kept quantized.

    lazy=True converts each tensor when it is looked up (and again at each lookup); the file stays
    memory-mapped while the model object lives. bfloat16=True keeps BF16 tensors bfloat16
    (ml_dtypes arrays; llama.build then multiplies them without a float32 copy on CUDA) instead of
    widening them to float32.

    Raises IngotError for a missing file, a file that is not GGUF, a truncated or corrupt file, a
    tensor type Ingot cannot import, or (when `architectures` is given) another architecture.
    """
    path = checked_path(path, "GGUF file")
    if not os.path.exists(path):
        raise IngotError(f"GGUF file {path} does not exist.")
    if not os.path.isfile(path):
        raise IngotError(f"GGUF path {path} is not a regular file.")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise IngotError(f"GGUF file {path} cannot be opened ({exc}).") from exc
    if magic != b"GGUF":
        raise IngotError(f"{path} is not a GGUF file: it starts with {magic!r} instead of b'GGUF'.")

    reader = _open(path)
    if reader.byte_order != "I":
        bad = next((t for t in reader.tensors if t.tensor_type in _QUANT or t.tensor_type == _T.BF16), None)
        if bad is not None:
            raise IngotError(f"{path}: tensor {bad.name} has type {bad.tensor_type.name} in a byte-swapped "
                             f"(big-endian) GGUF file, which Ingot cannot import.")

    metadata = {k: _field_value(path, k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = metadata.get("general.architecture", "")
    if not isinstance(arch, str):
        raise IngotError(f"{path}: metadata key 'general.architecture' is {arch!r}, not a string.")
    if architectures is not None and arch not in architectures:
        raise IngotError(f"{path} holds a model of architecture {arch or '(none)'!r}, but only "
                         f"{', '.join(repr(a) for a in architectures)} can be read here.")

    for t in reader.tensors:
        if t.tensor_type not in _QUANT and t.tensor_type not in _PLAIN:
            raise IngotError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which Ingot cannot import "
                             f"(supported: {', '.join(SUPPORTED_TYPES)}).")

    types = {t.name: t.tensor_type.name for t in reader.tensors}
    if lazy:
        reader.fields.clear()  # converted into `metadata` above; the raw parts need not stay alive
        return GGUFModel(path=path, architecture=arch, metadata=metadata, tensors=LazyTensors(path, reader, bfloat16), tensor_types=types)
    tensors: dict[str, np.ndarray | QuantizedTensor] = {}
    for t in reader.tensors:
        spec = _QUANT.get(t.tensor_type)
        tensors[t.name] = _convert_plain(t, bfloat16) if spec is None else _convert_quant(path, t, spec)
    return GGUFModel(path=path, architecture=arch, metadata=metadata, tensors=tensors, tensor_types=types)
