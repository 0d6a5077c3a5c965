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
from typing import Any, Callable

import gguf as _gguf
import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..untrusted import checked_path
from ..quant.formats import QuantizedTensor

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


# --------------------------------------------------------------------------------------------
# Tensor conversion. Each converter takes a chunk of rows of structured blocks [r, nb] and fills
# preallocated outputs q (storage), scale and bias (float32) for those rows.

_F16 = "<f2"


def _block_dtype(ttype, fields) -> np.dtype:
    d = np.dtype(fields)
    assert d.itemsize == _gguf.GGML_QUANT_SIZES[ttype][1], ttype
    return d


# The bit work runs on 64-bit little-endian words (eight bytes per lane) over contiguous copies of
# one chunk of rows: numpy's loops over the blocks' short strided fields are several times slower.
_U64 = np.dtype("<u8")


def _rep(byte: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))


def _rep16(half: int) -> np.uint64:
    return np.uint64(int.from_bytes(half.to_bytes(2, "little") * 4, "little"))


_LOW4, _ONE = _rep(0x0F), _rep(0x01)
_EVEN_LO, _EVEN_HI = _rep16(0x000F), _rep16(0x00F0)      # the low byte of each 16-bit lane
_SH = {k: np.uint64(k) for k in (4, 8)}


def _words(field: np.ndarray, words_per_row: int) -> np.ndarray:
    """A structured field [r, nb, n] bytes -> a fresh contiguous copy (callers modify it in place) as
    little-endian u64 [-1, words_per_row]."""
    return np.array(field, order="C", copy=True).view(_U64).reshape(-1, words_per_row)


def _even_bytes(x: np.ndarray) -> np.ndarray:
    """u64 [..., 2] whose values sit in the even bytes -> u64 [...] of those 8 bytes in order."""
    return x.view("<u2").astype(np.uint8).view(_U64).reshape(x.shape[:-1])


def _repack_nibbles(field: np.ndarray, q: np.ndarray, group: int) -> None:
    """GGUF's nibble order -> Ingot's. In each `group` bytes of `field`, the low nibbles hold elements
    0..group-1 and the high nibbles elements group..2*group-1; Ingot wants element 2k in the low and
    2k+1 in the high nibble of byte k. q: the uint8 output rows (same number of bytes)."""
    x = _words(field, 2)                   # a pair of words = 16 bytes = 8 (even, odd) byte pairs
    x4 = x >> _SH[4]
    lo = x & _EVEN_LO                      # even byte's low nibble ...
    lo |= x4 & _EVEN_HI                    # ... with the odd byte's low nibble above it
    hi = x4 & _EVEN_LO                     # even byte's high nibble ...
    x >>= _SH[8]
    x &= _EVEN_HI
    hi |= x                                # ... with the odd byte's high nibble above it
    per = group // 16                      # word pairs per group
    out = q.view(_U64).reshape(-1, 2, per)
    out[:, 0, :] = _even_bytes(lo).reshape(-1, per)
    out[:, 1, :] = _even_bytes(hi).reshape(-1, per)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte K-quant scale field [..., 12] -> (8 six-bit scales, 8 six-bit mins), uint8."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _cv_q8_0(b, q, s, _):
    q.reshape(b.shape + (32,))[...] = b["qs"]
    s[...] = b["d"]


def _cv_q4_0(b, q, s, _):
    _repack_nibbles(b["qs"], q, 16)
    q.view(_U64)[...] ^= _rep(0x88)        # q - 8 as a two's-complement nibble
    s[...] = b["d"]


def _cv_q4_1(b, q, s, m):
    _repack_nibbles(b["qs"], q, 16)
    s[...] = b["d"]
    m[...] = b["m"]


def _five_bit_32(b, q):
    out = q.view(_U64).reshape(-1, 2, 2)   # per block: elements 0..15 (low nibbles), 16..31 (high)
    x = _words(b["qs"], 2)
    np.bitwise_and(x, _LOW4, out=out[:, 0, :])
    x >>= _SH[4]
    x &= _LOW4
    out[:, 1, :] = x
    high = np.unpackbits(b["qh"], axis=-1, bitorder="little")     # [r, nb, 32] bits of qh, in element order
    high <<= 4
    q.view(np.uint8).reshape(high.shape)[...] |= high


def _cv_q5_0(b, q, s, _):
    _five_bit_32(b, q)
    qv = q.view(np.uint8)
    np.subtract(qv, 16, out=qv)            # wraps in uint8; the int8 view holds q - 16
    s[...] = b["d"]


def _cv_q5_1(b, q, s, m):
    _five_bit_32(b, q)
    s[...] = b["d"]
    m[...] = b["m"]


def _k_params(b, s, m):
    r, nb = b.shape
    sc, mn = _k_scales(b["scales"])
    np.multiply(b["d"].astype(np.float32)[..., None], sc, out=s.reshape(r, nb, 8))
    mv = m.reshape(r, nb, 8)
    np.multiply(b["dmin"].astype(np.float32)[..., None], mn, out=mv)
    np.negative(mv, out=mv)


def _cv_q4_k(b, q, s, m):
    _repack_nibbles(b["qs"], q, 32)
    _k_params(b, s, m)


_SHIFT8 = np.arange(8, dtype=np.uint64)[:, None]
_SHIFT4x2 = np.arange(0, 8, 2, dtype=np.uint64)[:, None]


def _cv_q5_k(b, q, s, m):
    out = q.view(_U64).reshape(-1, 4, 2, 4)   # [block, 32-byte chunk c, sub-block 2c / 2c+1, 4 words]
    x = _words(b["qs"], 4).reshape(-1, 4, 4)  # [block, chunk, 4 words]
    np.bitwise_and(x, _LOW4, out=out[:, :, 0, :])
    x >>= _SH[4]
    x &= _LOW4
    out[:, :, 1, :] = x
    h = _words(b["qh"], 4)[:, None, :] >> _SHIFT8   # [block, sub-block s, 4 words]: bit s of each byte
    h &= _ONE
    h <<= _SH[4]
    out |= h.reshape(out.shape)
    _k_params(b, s, m)


def _cv_q6_k(b, q, s, _):
    r, nb = b.shape
    out = q.view(_U64).reshape(-1, 2, 2, 8)   # [block, half, low/high nibbles, 8 words = 64 values]
    x = _words(b["ql"], 16).reshape(-1, 2, 8)
    np.bitwise_and(x, _LOW4, out=out[:, :, 0, :])
    x >>= _SH[4]
    x &= _LOW4
    out[:, :, 1, :] = x
    h = _words(b["qh"], 8).reshape(-1, 2, 1, 4) >> _SHIFT4x2   # [block, half, 32-group s, 4 words]
    h &= _rep(0x03)
    h <<= _SH[4]
    out |= h.reshape(out.shape)
    qv = q.view(np.uint8)
    np.subtract(qv, 32, out=qv)            # wraps in uint8; the int8 view holds q - 32
    np.multiply(b["d"].astype(np.float32)[..., None], b["scales"], out=s.reshape(r, nb, 16))


# The 2-bit, 3-bit and ternary types become 4-bit integers (Q2_K, Q3_K, TQ*); the non-linear and
# codebook types become 4-bit codes into one 16-entry table per type, times a scale per block
# (Ingot's scaled lookup table). Codebook grids, sign tables and value tables are the gguf
# package's own (gguf.quants), never copied here.

_GQ = _gguf.quants
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _pack_codes(codes: np.ndarray, q: np.ndarray) -> None:
    """Values 0..15 (or int4 values -8..7) in element order [r, ..., cols] -> q, two per byte, low
    nibble = even column (Ingot's 4-bit packing)."""
    c = codes.reshape(q.shape[0], -1, 2).astype(np.uint8)
    np.bitwise_or(c[..., 0] & np.uint8(0x0F), (c[..., 1] & np.uint8(0x0F)) << np.uint8(4), out=q.reshape(q.shape[0], -1))


def _two_bit(qs: np.ndarray) -> np.ndarray:
    """A K-quant's 2-bit field [r, nb, 64] -> [r, nb, 256]: each 32-byte half h holds elements
    128h + 32j + i in bits 2j..2j+1 of byte i."""
    r, nb, _ = qs.shape
    v = qs.reshape(r, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    return (v & np.uint8(3)).reshape(r, nb, 256)


def _cv_q2_k(b, q, s, m):
    r, nb = b.shape
    _pack_codes(_two_bit(b["qs"]), q)
    sc = b["scales"]
    np.multiply(b["d"].astype(np.float32)[..., None], (sc & np.uint8(0x0F)).astype(np.float32), out=s.reshape(r, nb, 16))
    mv = m.reshape(r, nb, 16)
    np.multiply(b["dmin"].astype(np.float32)[..., None], (sc >> np.uint8(4)).astype(np.float32), out=mv)
    np.negative(mv, out=mv)


def _cv_q3_k(b, q, s, _):
    r, nb = b.shape
    low = _two_bit(b["qs"]).astype(np.int8)
    high = (b["hmask"].reshape(r, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    low -= ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8).reshape(r, nb, 256)   # -4 where the mask bit is 0
    _pack_codes(low, q)
    sc = b["scales"]
    lo = (sc[..., :8].reshape(r, nb, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(r, nb, 16)
    hi = (sc[..., 8:].reshape(r, nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(r, nb, 16)
    six = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    np.multiply(b["d"].astype(np.float32)[..., None], six.astype(np.float32), out=s.reshape(r, nb, 16))


def _cv_tq1_0(b, q, s, _):
    r, nb = b.shape
    qs = b["qs"]
    parts = [(qs[..., :32].reshape(r, nb, 1, 32) * _POW3.reshape(1, 1, 5, 1)).reshape(r, nb, 160),
             (qs[..., 32:].reshape(r, nb, 1, 16) * _POW3.reshape(1, 1, 5, 1)).reshape(r, nb, 80),
             (b["qh"].reshape(r, nb, 1, 4) * _POW3[:4].reshape(1, 1, 4, 1)).reshape(r, nb, 16)]
    trits = (np.concatenate(parts, axis=-1).astype(np.uint16) * np.uint16(3)) >> np.uint16(8)   # 0..2
    _pack_codes(trits.astype(np.int8) - np.int8(1), q)
    s[...] = b["d"]


def _cv_tq2_0(b, q, s, _):
    _pack_codes(_two_bit(b["qs"]).astype(np.int8) - np.int8(1), q)
    s[...] = b["d"]


def _table(values) -> np.ndarray:
    """A type's values as Ingot's [1, 1, 16] float32 table (unused entries 0)."""
    t = np.zeros(16, np.float32)
    v = np.asarray(values, np.float32).reshape(-1)
    t[:v.size] = v
    return t.reshape(1, 1, 16)


def _cv_iq4_nl(b, q, s, _):
    _repack_nibbles(b["qs"], q, 16)
    s[...] = b["d"]


def _cv_iq4_xs(b, q, s, _):
    r, nb = b.shape
    _repack_nibbles(b["qs"], q, 16)
    lo = (b["scales_l"].reshape(r, nb, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2)).reshape(r, nb, 8)
    hi = (b["scales_h"].reshape(r, nb, 1) >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 1, 8)).astype(np.uint8)
    six = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    np.multiply(b["d"].astype(np.float32)[..., None], six.astype(np.float32), out=s.reshape(r, nb, 8))


def _cv_mxfp4(b, q, s, _):
    _repack_nibbles(b["qs"], q, 16)
    s[...] = _GQ.MXFP4.e8m0_to_fp32_half(b["e"].astype(np.uint32))


@functools.lru_cache(maxsize=None)
def _grid_codes(cls) -> np.ndarray:
    """A codebook type's grid [entries, width] as indices into its value list (gguf's grid_map)."""
    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)
    levels = np.asarray(cls.grid_map, np.float32)
    codes = np.searchsorted(levels, grid).astype(np.uint8)
    assert np.array_equal(levels[codes], grid), cls
    return codes


@functools.lru_cache(maxsize=None)
def _ksigns() -> np.ndarray:
    """The 128 sign patterns of IQ2_XXS/IQ2_XS/IQ3_XXS as [128, 8] bits (1 = negative)."""
    k = np.frombuffer(_GQ.IQ2_XXS.ksigns, dtype=np.uint8)
    return np.unpackbits(k[:, None], axis=1, bitorder="little")


def _signed_table(cls) -> np.ndarray:
    """Codes 0..L-1 the grid values, L..2L-1 their negatives."""
    levels = np.asarray(cls.grid_map, np.float32)
    return _table(np.concatenate([levels, -levels]))


def _signed_codes(cls, index: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Codes [r, nb, cols] from grid indices [r, nb, groups] and sign bits [r, nb, cols]."""
    grid = _grid_codes(cls)
    codes = np.take(grid, index.astype(np.intp), axis=0).reshape(negative.shape)
    flips = negative.view(np.uint8) if negative.dtype == np.uint8 else negative.astype(np.uint8)
    codes += flips * np.uint8(len(cls.grid_map))
    return codes


def _iq_scale(d, ls, half: float, out) -> None:
    """d * (0.5 + ls) * half in float32, the order gguf.quants forms it in."""
    np.multiply(d.astype(np.float32)[..., None] * (np.float32(0.5) + ls.astype(np.float32)), np.float32(half), out=out)


def _cv_iq2_xxs(b, q, s, _):
    r, nb = b.shape
    words = b["qs"].reshape(r, nb, 8, 2)
    index = words[..., 0].copy().view(np.uint8).reshape(r, nb, 32)                        # 4 grid rows per 32
    sign_idx = (words[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32).reshape(1, 1, 1, 4)) & np.uint32(0x7F)
    negative = _ksigns()[sign_idx.reshape(r, nb, 32)].reshape(r, nb, 256)
    _pack_codes(_signed_codes(_GQ.IQ2_XXS, index, negative), q)
    _iq_scale(b["d"], words[..., 1] >> np.uint32(28), 0.25, s.reshape(r, nb, 8))


def _nibble_scales(scales: np.ndarray) -> np.ndarray:
    """Bytes [r, nb, n] -> 2n four-bit scales, low nibble first."""
    r, nb, n = scales.shape
    return ((scales.reshape(r, nb, n, 1) >> np.array([0, 4], np.uint8)) & np.uint8(0x0F)).reshape(r, nb, 2 * n)


def _sign_bits(signs: np.ndarray) -> np.ndarray:
    """Bytes [r, nb, n] -> [r, nb, 8n] bits, bit k of byte i for element 8i + k."""
    return np.unpackbits(signs, axis=-1, bitorder="little")


def _cv_iq2_xs(b, q, s, _):
    r, nb = b.shape
    qs = b["qs"]
    negative = _ksigns()[(qs >> np.uint16(9)).astype(np.intp)].reshape(r, nb, 256)
    _pack_codes(_signed_codes(_GQ.IQ2_XS, qs & np.uint16(511), negative), q)
    _iq_scale(b["d"], _nibble_scales(b["scales"]), 0.25, s.reshape(r, nb, 16))


def _cv_iq2_s(b, q, s, _):
    r, nb = b.shape
    high = (b["qh"].reshape(r, nb, 8, 1) >> np.array([0, 2, 4, 6], np.uint8)) & np.uint8(3)
    index = b["qs"].astype(np.uint16) | (high.reshape(r, nb, 32).astype(np.uint16) << np.uint16(8))
    _pack_codes(_signed_codes(_GQ.IQ2_S, index, _sign_bits(b["signs"])), q)
    _iq_scale(b["d"], _nibble_scales(b["scales"]), 0.25, s.reshape(r, nb, 16))


def _cv_iq3_xxs(b, q, s, _):
    r, nb = b.shape
    aux = b["scales"]                                                                       # [r, nb, 8] u32
    sign_idx = (aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(0x7F)
    negative = _ksigns()[sign_idx.reshape(r, nb, 32)].reshape(r, nb, 256)
    _pack_codes(_signed_codes(_GQ.IQ3_XXS, b["qs"], negative), q)
    _iq_scale(b["d"], aux >> np.uint32(28), 0.5, s.reshape(r, nb, 8))


def _cv_iq3_s(b, q, s, _):
    r, nb = b.shape
    high = _sign_bits(b["qh"]).astype(np.uint16)                                            # bit 8 of each index
    index = b["qs"].astype(np.uint16) | (high << np.uint16(8))
    _pack_codes(_signed_codes(_GQ.IQ3_S, index, _sign_bits(b["signs"])), q)
    odd = (np.uint8(1) + np.uint8(2) * _nibble_scales(b["scales"])).astype(np.float32)
    np.multiply(b["d"].astype(np.float32)[..., None], odd, out=s.reshape(r, nb, 8))


def _iq1_table() -> np.ndarray:
    """IQ1 codes: 0..2 the grid values -1, 0, 1 plus delta, 3..5 the same minus delta (float32 sums)."""
    levels = np.asarray(_GQ.IQ1_S.grid_map, np.float32)
    delta = _GQ.IQ1_S.delta
    return _table(np.concatenate([levels + delta, levels - delta]))


def _iq1_codes(cls, index: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """Codes [r, nb, 256] from grid indices [r, nb, 32] and a minus-delta flag per group of 8."""
    grid = _grid_codes(cls)
    r, nb, _ = index.shape
    codes = grid[index.astype(np.intp)]                                                     # [r, nb, 32, 8]
    return (codes + (minus.astype(np.uint8) * np.uint8(3)).reshape(r, nb, 32, 1)).reshape(r, nb, 256)


def _cv_iq1_s(b, q, s, _):
    r, nb = b.shape
    qh = b["qh"]                                                                            # [r, nb, 8] u16
    high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)
    index = b["qs"].astype(np.uint16) | (high.reshape(r, nb, 32) << np.uint16(8))
    minus = np.repeat((qh & np.uint16(0x8000)) != 0, 4, axis=-1)
    _pack_codes(_iq1_codes(_GQ.IQ1_S, index, minus), q)
    odd = (np.uint16(2) * ((qh >> np.uint16(12)) & np.uint16(7)) + np.uint16(1)).astype(np.float32)
    np.multiply(b["d"].astype(np.float32)[..., None], odd, out=s.reshape(r, nb, 8))


def _cv_iq1_m(b, q, s, _):
    r, nb = b.shape
    sc = b["scales"]                                                                        # [r, nb, 4] u16
    top = (sc & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
    d = (top[..., 0] | top[..., 1] | top[..., 2] | top[..., 3]).view(np.float16).astype(np.float32)
    nib = (b["qh"].reshape(r, nb, 16, 1) >> np.array([0, 4], np.uint8)).reshape(r, nb, 32)
    index = b["qs"].astype(np.uint16) | ((nib & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    _pack_codes(_iq1_codes(_GQ.IQ1_M, index, (nib & np.uint8(8)) != 0), q)
    three = ((sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)).reshape(r, nb, 16)
    odd = (np.uint16(2) * three + np.uint16(1)).astype(np.float32)
    np.multiply(d[..., None], odd, out=s.reshape(r, nb, 16))


@dataclass(frozen=True)
class _QSpec:
    block: np.dtype        # one GGUF block
    qdtype: dt.DType
    block_size: int        # Ingot's block (parameters per block_size columns)
    bias: bool
    convert: Callable
    table: Callable | None = None   # () -> [1, 1, 16] float32: a scaled lookup table's values


_QUANT: dict[Any, _QSpec] = {
    _T.Q8_0: _QSpec(_block_dtype(_T.Q8_0, [("d", _F16), ("qs", "i1", (32,))]), dt.int8, 32, False, _cv_q8_0),
    _T.Q4_0: _QSpec(_block_dtype(_T.Q4_0, [("d", _F16), ("qs", "u1", (16,))]), dt.int4, 32, False, _cv_q4_0),
    _T.Q4_1: _QSpec(_block_dtype(_T.Q4_1, [("d", _F16), ("m", _F16), ("qs", "u1", (16,))]),
                    dt.uint4, 32, True, _cv_q4_1),
    _T.Q5_0: _QSpec(_block_dtype(_T.Q5_0, [("d", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
                    dt.int8, 32, False, _cv_q5_0),
    _T.Q5_1: _QSpec(_block_dtype(_T.Q5_1, [("d", _F16), ("m", _F16), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
                    dt.uint8, 32, True, _cv_q5_1),
    _T.Q4_K: _QSpec(_block_dtype(_T.Q4_K, [("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)),
                                           ("qs", "u1", (128,))]), dt.uint4, 32, True, _cv_q4_k),
    _T.Q5_K: _QSpec(_block_dtype(_T.Q5_K, [("d", _F16), ("dmin", _F16), ("scales", "u1", (12,)),
                                           ("qh", "u1", (32,)), ("qs", "u1", (128,))]), dt.uint8, 32, True, _cv_q5_k),
    _T.Q6_K: _QSpec(_block_dtype(_T.Q6_K, [("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)),
                                           ("d", _F16)]), dt.int8, 16, False, _cv_q6_k),
    _T.Q2_K: _QSpec(_block_dtype(_T.Q2_K, [("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", _F16), ("dmin", _F16)]),
                    dt.uint4, 16, True, _cv_q2_k),
    _T.Q3_K: _QSpec(_block_dtype(_T.Q3_K, [("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)),
                                           ("d", _F16)]), dt.int4, 16, False, _cv_q3_k),
    _T.TQ1_0: _QSpec(_block_dtype(_T.TQ1_0, [("qs", "u1", (48,)), ("qh", "u1", (4,)), ("d", _F16)]),
                     dt.int4, 256, False, _cv_tq1_0),
    _T.TQ2_0: _QSpec(_block_dtype(_T.TQ2_0, [("qs", "u1", (64,)), ("d", _F16)]), dt.int4, 256, False, _cv_tq2_0),
    _T.IQ4_NL: _QSpec(_block_dtype(_T.IQ4_NL, [("d", _F16), ("qs", "u1", (16,))]), dt.uint4, 32, False, _cv_iq4_nl,
                      lambda: _table(_GQ.IQ4_NL.kvalues)),
    _T.IQ4_XS: _QSpec(_block_dtype(_T.IQ4_XS, [("d", _F16), ("scales_h", "<u2"), ("scales_l", "u1", (4,)),
                                               ("qs", "u1", (128,))]), dt.uint4, 32, False, _cv_iq4_xs,
                      lambda: _table(_GQ.IQ4_NL.kvalues)),
    _T.MXFP4: _QSpec(_block_dtype(_T.MXFP4, [("e", "u1"), ("qs", "u1", (16,))]), dt.uint4, 32, False, _cv_mxfp4,
                     lambda: _table(_GQ.MXFP4.kvalues)),
    _T.IQ2_XXS: _QSpec(_block_dtype(_T.IQ2_XXS, [("d", _F16), ("qs", "<u4", (16,))]), dt.uint4, 32, False, _cv_iq2_xxs,
                       lambda: _signed_table(_GQ.IQ2_XXS)),
    _T.IQ2_XS: _QSpec(_block_dtype(_T.IQ2_XS, [("d", _F16), ("qs", "<u2", (32,)), ("scales", "u1", (8,))]),
                      dt.uint4, 16, False, _cv_iq2_xs, lambda: _signed_table(_GQ.IQ2_XS)),
    _T.IQ2_S: _QSpec(_block_dtype(_T.IQ2_S, [("d", _F16), ("qs", "u1", (32,)), ("signs", "u1", (32,)),
                                             ("qh", "u1", (8,)), ("scales", "u1", (8,))]),
                     dt.uint4, 16, False, _cv_iq2_s, lambda: _signed_table(_GQ.IQ2_S)),
    _T.IQ3_XXS: _QSpec(_block_dtype(_T.IQ3_XXS, [("d", _F16), ("qs", "u1", (64,)), ("scales", "<u4", (8,))]),
                       dt.uint4, 32, False, _cv_iq3_xxs, lambda: _signed_table(_GQ.IQ3_XXS)),
    _T.IQ3_S: _QSpec(_block_dtype(_T.IQ3_S, [("d", _F16), ("qs", "u1", (64,)), ("qh", "u1", (8,)),
                                             ("signs", "u1", (32,)), ("scales", "u1", (4,))]),
                     dt.uint4, 32, False, _cv_iq3_s, lambda: _signed_table(_GQ.IQ3_S)),
    _T.IQ1_S: _QSpec(_block_dtype(_T.IQ1_S, [("d", _F16), ("qs", "u1", (32,)), ("qh", "<u2", (8,))]),
                     dt.uint4, 32, False, _cv_iq1_s, _iq1_table),
    _T.IQ1_M: _QSpec(_block_dtype(_T.IQ1_M, [("qs", "u1", (32,)), ("qh", "u1", (16,)), ("scales", "<u2", (4,))]),
                     dt.uint4, 16, False, _cv_iq1_m, _iq1_table),
}
_PLAIN = {_T.F32: np.float32, _T.F16: np.float32, _T.BF16: np.float32,
          _T.I8: np.int8, _T.I16: np.int32, _T.I32: np.int32, _T.I64: np.int64}
SUPPORTED_TYPES = tuple(t.name for t in (*_PLAIN, *_QUANT))

_CHUNK_ELEMS = 1 << 19  # rows are converted in chunks of about this many values (bounds temporaries)


def _convert_quant(path: str, t, spec: _QSpec) -> QuantizedTensor:
    ne = [int(x) for x in t.shape]
    if len(ne) > 2 and any(x != 1 for x in ne[2:]):
        raise IngotError(f"{path}: tensor {t.name} is a quantized {len(ne)}-D tensor (ne={ne}); Ingot imports "
                         f"quantized tensors only as 2-D matrices.")
    cols = ne[0]
    rows = ne[1] if len(ne) > 1 else 1
    gbs = _gguf.GGML_QUANT_SIZES[t.tensor_type][0]
    nb = cols // gbs
    raw = np.asarray(t.data).reshape(rows, nb * spec.block.itemsize)
    blocks = raw.view(spec.block)                                  # [rows, nb] structured, zero-copy
    qcols = cols // 2 if spec.qdtype.packed else cols
    q = np.empty((rows, qcols), spec.qdtype.storage)
    nbo = cols // spec.block_size
    scale = np.empty((rows, nbo), np.float32)
    bias = np.empty((rows, nbo), np.float32) if spec.bias else None
    step = max(1, _CHUNK_ELEMS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        spec.convert(blocks[r0:r1], q[r0:r1], scale[r0:r1], None if bias is None else bias[r0:r1])
    return QuantizedTensor(q=q, qdtype=spec.qdtype, shape=(rows, cols), block_size=spec.block_size,
                           scale=scale, bias=bias, source=t.tensor_type.name,
                           lut=None if spec.table is None else spec.table())


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
