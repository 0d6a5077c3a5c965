"""GGUF's block formats converted losslessly into Ingot's packed storage (issue 33's item 3).

Each converter takes a chunk of rows of structured GGUF blocks [r, nb] and fills preallocated
outputs: q (Ingot's storage: packed 4-bit or 8-bit integers), scale and bias (float32) per Ingot
block. QUANT maps a GGUF type to its block layout, Ingot dtype and block size, converter, and for the
lookup-table types the table's values (read from the `gguf` package, never copied). ingot/importers/
gguf.py reads files and calls `convert_quant`; `tests/test_gguf_quants.py` checks every type against
`gguf.quants.dequantize`, bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import gguf as _gguf
import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..quant.formats import QuantizedTensor

_T = _gguf.GGMLQuantizationType

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


QUANT: dict[Any, _QSpec] = {
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
_CHUNK_ELEMS = 1 << 19  # rows are converted in chunks of about this many values (bounds temporaries)


def convert_quant(path: str, t, spec: _QSpec) -> QuantizedTensor:
    # a 3-D tensor (a stack of expert matrices [E, R, C]) reads as the 2-D matrix of its rows [E * R, C];
    # the model builder splits it by the expert count it reads from the metadata
    ne = [int(x) for x in t.shape]
    cols = ne[0]
    rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
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
