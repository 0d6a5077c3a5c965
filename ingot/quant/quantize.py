"""Quantizers: float weights [rows = out, cols = in] to QuantizedTensors of every Ingot format.

    >>> import numpy as np
    >>> from ingot.quant import parse_format, quantize
    >>> w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    >>> t = quantize(w, "int4:32")
    >>> t.qdtype.name, t.block_size, bool(np.all(np.abs(w - t.dequantize_rows()) <= t.scale.repeat(32, 1) / 2 + 1e-6))
    ('int4', 32, True)
    >>> str(parse_format("lut4:g128"))
    'lut4:g128'
    >>> t = quantize(w, "lut4:b64:offset")
    >>> t.scale.dtype.name, t.bias.dtype.name, 8 * (t.q.nbytes + t.scale.nbytes + t.bias.nbytes) / w.size
    ('float16', 'float16', 4.5)
    >>> t = quantize(w, "lut4:b32:offset:k")
    >>> t.two_level, 8 * (t.two_level_nbytes - t.lut.nbytes) / w.size   # (super-blocks of 128 columns: 4.5 at 256)
    ((128, 6), 4.625)

Formats (FMT strings, `parse_format`):

    int8 | uint8 | int4 | uint4 [:BLOCK] [:sym | :asym | :auto] [:f16]
        affine, w = q * scale (+ bias). BLOCK: 16, 32, 64, 128, 256 (parameters per block of
        columns), `channel` (one per row, the default) or `tensor` (one for the whole matrix).
        :f16 stores scale and bias as float16 (as GGUF's block types do; uint4:32:f16 is Q4_1's
        5 bits per weight, int4:64:f16 4.25), the codes rounded against the float16 values.
        Signed types default to symmetric (scale = max|w| / (qmax + 1/2)), unsigned ones to asymmetric
        (scale = (max - min) / (2**bits - 1), bias = min). |w - w_hat| <= scale / 2 everywhere.
        :k (:k8) stores each block's scale and bias as a 6-bit (8-bit) code times a float16 unit per
        super-block of about 256 columns (GGUF Q4_K's idea: uint4:32:k is its 4.5 bits per weight):
        per block a least-squares fit of scale and bias (bias <= 0), then the codes, each
        block's codes moved by one where that lowers its error; see QuantizedTensor.two_level_nbytes.
        :auto (with a BLOCK) picks per tensor, by the importance-weighted error, between the
        symmetric form in blocks of BLOCK and the asymmetric one in blocks of 2 * BLOCK: the same bytes.
    lut4 | lut8 [:gROWS] [:bBLOCK [:offset [:k | :k8]]] [:uniform]
        a lookup table of 2**bits float16 values, one per tensor or per group of ROWS output rows, fitted by
        1-D k-means (weighted by importance when given) or spaced uniformly over [min, max]; each
        weight becomes the index of its nearest table entry. With :bBLOCK (16-256) every block of
        BLOCK columns also has a float32 scale (a scaled table, as GGUF's IQ4_NL with a fitted
        table): w = table[q] * scale, the table fitted on the weights divided by their block's scale,
        each scale then refitted by least squares (the importance-weighted error, alternately).
        :offset (with :bBLOCK) gives every block a float16 offset beside a float16 scale:
        w = table[q] * scale + offset, 4 + 32 / BLOCK bits per weight (lut4:b64:offset 4.5, as uint4:32:k);
        the table is fitted on each block's weights less its offset, over its scale, and each block's
        scale and offset refitted as the weighted least-squares line through its codes' entries.
        :k (:k8, after :offset) codes each block's scale and offset two-level as uint4:BLOCK:k does
        (scale = d * code, offset = -dmin * code <= 0, float16 d and dmin per super-block), so
        lut4:b32:offset:k is uint4:32:k's 4.5 bits per weight (plus the table) and holds its every weight
        (the table 0..15): fitted from uint4:32:k's own solution and from lut4:b32:offset's, each refined
        (table, codes, lines, codes of the lines) while that lowers the weighted error; never worse than
        the uint4:32:k start on it.

A BLOCK (or ROWS) that does not divide a tensor's columns (rows) becomes the largest divisor of
them that is not above it (SmolLM2's 576 columns take int4:128 as blocks of 96); the tensor
records the block actually used.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from .formats import QuantizedTensor

BLOCK_SIZES = (16, 32, 64, 128, 256)
AFFINE_TYPES = {"int8": dt.int8, "uint8": dt.uint8, "int4": dt.int4, "uint4": dt.uint4}
FORMAT_HELP = ("int8, uint8, int4, uint4 with an optional :BLOCK (16-256, channel, tensor), :sym/:asym/:auto and :f16 or :k/:k8 "
               "(two-level parameters, uint4:32:k = Q4_K's 4.5 bits per weight), "
               "or lut4/lut8 with an optional :gROWS, :bBLOCK (then :offset, then :k for two-level scales and offsets) "
               "and :uniform (e.g. int8, int4:32, uint4:64, lut4, lut4:g128, lut4:b64, lut4:b64:offset, "
               "lut4:b32:offset:k, lut8)")


@dataclass(frozen=True)
class Format:
    kind: str                       # "affine" or "lut"
    qdtype: dt.DType
    block_size: int | None = None   # affine: columns per parameter; None per channel, 0 per tensor; lut: per scale, None unscaled
    symmetric: bool = True          # affine
    auto: bool = False              # affine: symmetric:BLOCK or asymmetric:2*BLOCK, per tensor
    group_rows: int | None = None   # lut: rows per table; None: one table for the tensor
    uniform: bool = False           # lut: uniform table instead of k-means
    half: bool = False              # affine: parameters stored as float16
    code_bits: int = 0              # 6 or 8 for two-level :k / :k8 parameters (codes times units): affine, lut :offset
    offset: bool = False            # lut with blocks: a float16 offset and float16 scale per block (:offset)

    @property
    def bits(self) -> int:
        return self.qdtype.bits

    def __str__(self) -> str:
        if self.kind == "lut":
            return (f"lut{self.bits}" + (f":g{self.group_rows}" if self.group_rows else "")
                    + (f":b{self.block_size}" if self.block_size else "") + (":offset" if self.offset else "")
                    + ({0: "", 6: ":k"}.get(self.code_bits, f":k{self.code_bits}")) + (":uniform" if self.uniform else ""))
        block = "" if self.block_size is None else (":tensor" if self.block_size == 0 else f":{self.block_size}")
        default_sym = self.qdtype.kind == "i"
        half = ":f16" if self.half else ""
        if self.code_bits:
            half = ":k" if self.code_bits == 6 else f":k{self.code_bits}"
        if self.auto:
            return self.qdtype.name + block + ":auto" + half
        return self.qdtype.name + block + ("" if self.symmetric == default_sym else (":sym" if self.symmetric else ":asym")) + half

    def candidates(self) -> list["Format"]:
        """The formats this one stands for: itself, or for :auto its symmetric and asymmetric forms."""
        if not self.auto:
            return [self]
        signed = AFFINE_TYPES[self.qdtype.name.lstrip("u")]
        unsigned = AFFINE_TYPES["u" + self.qdtype.name.lstrip("u")]
        wider = min(2 * self.block_size, BLOCK_SIZES[-1])
        return [Format("affine", signed, self.block_size, True, half=self.half),
                Format("affine", unsigned, wider, False, half=self.half)]


def parse_format(fmt: str | Format) -> Format:
    """A FMT string (see the module docstring) as a Format; IngotError naming the string otherwise."""
    if isinstance(fmt, Format):
        return fmt
    bad = lambda why: IngotError(f"format {fmt!r} is not valid: {why} (formats: {FORMAT_HELP}).")  # noqa: E731
    if not isinstance(fmt, str) or not fmt.strip():
        raise bad("it is empty")
    head, *options = fmt.strip().lower().split(":")
    if head in AFFINE_TYPES:
        qdtype = AFFINE_TYPES[head]
        block, symmetric, auto, half, code_bits = None, qdtype.kind == "i", False, False, 0
        for opt in options:
            if opt == "f16":
                half = True
            elif opt in ("k", "k6", "k8"):
                code_bits = 8 if opt == "k8" else 6
            elif opt in ("sym", "asym"):
                symmetric = opt == "sym"
            elif opt == "auto":
                auto = True
            elif opt == "channel":
                block = None
            elif opt == "tensor":
                block = 0
            elif opt.isdigit():
                if int(opt) not in BLOCK_SIZES:
                    raise bad(f"block size {opt} is not one of {', '.join(map(str, BLOCK_SIZES))}")
                block = int(opt)
            else:
                raise bad(f"option {opt!r} is not a block size, channel, tensor, sym, asym, auto, f16, k or k8")
        if auto and not block:
            raise bad(":auto needs a block size (it compares blocks of BLOCK and 2 * BLOCK)")
        if code_bits and (not block or auto or half):
            raise bad(":k needs a block size and goes without :auto and :f16 (its parameters are codes times float16 units)")
        return Format("affine", qdtype, block, symmetric, auto=auto, half=half, code_bits=code_bits)
    m = re.fullmatch(r"lut([48])", head)
    if m:
        group, uniform, block, offset, code_bits = None, False, None, False, 0
        for opt in options:
            if opt == "uniform":
                uniform = True
            elif opt == "offset":
                offset = True
            elif opt in ("k", "k6", "k8"):
                code_bits = 8 if opt == "k8" else 6
            elif opt == "kmeans":
                uniform = False
            elif re.fullmatch(r"g[1-9][0-9]*", opt):
                group = int(opt[1:])
            elif re.fullmatch(r"b[0-9]+", opt):
                if int(opt[1:]) not in BLOCK_SIZES:
                    raise bad(f"block size {opt[1:]} is not one of {', '.join(map(str, BLOCK_SIZES))}")
                block = int(opt[1:])
            else:
                raise bad(f"option {opt!r} is not gROWS, bBLOCK, offset, k, k8, uniform or kmeans")
        if offset and not block:
            raise bad(":offset needs a block size :bBLOCK (an offset and a scale per block of BLOCK columns)")
        if code_bits and (not offset or uniform):
            raise bad(":k needs :offset and goes without :uniform (two-level block scales and offsets; the table is refitted)")
        return Format("lut", dt.uint4 if m.group(1) == "4" else dt.uint8, block, group_rows=group, uniform=uniform,
                      offset=offset, code_bits=code_bits)
    raise bad(f"{head!r} is not a type")


def fitting_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is <= at_most (n itself when at_most >= n)."""
    if at_most >= n:
        return n
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def _pack(values: np.ndarray, qdtype: dt.DType) -> np.ndarray:
    return dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)


def quantize(weight: np.ndarray, fmt: str | Format, importance: np.ndarray | None = None) -> QuantizedTensor:
    """A float matrix [rows, cols] (rows = outputs, cols = the reduction axis) in format fmt.

    importance: optional non-negative weights per column (e.g. the mean square of the calibration
    activations that multiply each column); affine blocks then search a clipping range that lowers
    the importance-weighted error, and LUT tables are fitted by importance-weighted k-means.
    """
    fmt = parse_format(fmt)
    w = np.asarray(weight, np.float32)
    if w.ndim != 2 or 0 in w.shape:
        raise IngotError(f"quantize: a non-empty 2-D weight is needed, not shape {w.shape}.")
    if not np.all(np.isfinite(w)):
        raise IngotError("quantize: the weight holds NaN or infinite values.")
    if fmt.qdtype.packed and w.shape[1] % 2:
        raise IngotError(f"quantize: {fmt} packs two values per byte along columns; {w.shape[1]} columns is odd.")
    if importance is not None:
        importance = np.asarray(importance, np.float32)
        if importance.shape != (w.shape[1],):
            raise IngotError(f"quantize: importance has shape {importance.shape}, expected ({w.shape[1]},).")
    if fmt.kind == "lut" and fmt.code_bits:
        return _quantize_two_level_lut(w, fmt, importance)
    if fmt.kind == "lut" and fmt.offset:
        return _quantize_offset_lut(w, fmt, importance)
    if fmt.kind == "lut":
        return _quantize_scaled_lut(w, fmt, importance) if fmt.block_size else _quantize_lut(w, fmt, importance)
    if fmt.code_bits:
        return _quantize_two_level(w, fmt, importance)
    if fmt.auto:
        weights = np.ones(w.shape[1], np.float32) if importance is None else importance
        tried = [_quantize_affine(w, f, importance) for f in fmt.candidates()]
        return min(tried, key=lambda t: float((((w - t.dequantize_rows()) ** 2) * weights).sum()))
    return _quantize_affine(w, fmt, importance)


# -- affine -----------------------------------------------------------------------------------
def _affine_params(lo: np.ndarray, hi: np.ndarray, fmt: Format):
    """(scale, bias or None, offset of q) so that q = round((w - bias) / scale) + offset."""
    if fmt.half:  # the codes are rounded against the parameters as stored
        scale, bias, offset = _affine_params(lo, hi, Format("affine", fmt.qdtype, fmt.block_size, fmt.symmetric))
        return half_params(scale, positive=True), half_params(bias), offset
    levels = 2 ** fmt.bits
    signed = fmt.qdtype.kind == "i"
    if fmt.symmetric:
        # max|w| at qmax + 1/2 steps: the extreme rounds to qmax or, on the negative side, to
        # -qmax - 1, both within half a step; finer steps than max|w| / qmax for the same bound
        qmax = levels // 2 - 1
        scale = np.maximum(np.abs(lo), np.abs(hi)) / (qmax + 0.5)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        if signed:
            return scale, None, 0
        return scale, (-(levels // 2) * scale).astype(np.float32), 0
    scale = (hi - lo) / (levels - 1)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    bias = lo.astype(np.float32)
    if signed:  # q = -2**(b-1) stands for lo
        bias = (lo + (levels // 2) * scale).astype(np.float32)
    return scale, bias, 0


def half_params(p: np.ndarray | None, positive: bool = False) -> np.ndarray | None:
    """float32 parameters rounded to float16 values (still float32: the arithmetic stays float32), within
    float16's range; positive: a scale that would round to zero becomes float16's smallest normal."""
    if p is None:
        return None
    top = np.float32(np.finfo(np.float16).max)
    p = np.clip(p, -top, top).astype(np.float16).astype(np.float32)
    return np.maximum(p, np.float32(np.finfo(np.float16).tiny)) if positive else p


def stored_params(p: np.ndarray | None, fmt: Format) -> np.ndarray | None:
    """Block parameters as a tensor keeps them: float16 for :f16 formats (exact: already rounded), else float32."""
    return None if p is None else p.astype(np.float16 if fmt.half else np.float32)


def _round_affine(blocks: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, fmt: Format) -> np.ndarray:
    lo, hi = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15)}[fmt.qdtype.name]
    shifted = blocks if bias is None else blocks - bias[..., None]
    return np.clip(np.rint(shifted / scale[..., None]), lo, hi)


def _quantize_affine(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    rows, cols = w.shape
    if fmt.block_size in (None, 0):
        block = cols
    else:
        block = fitting_divisor(cols, fmt.block_size)
    blocks = w.reshape(rows, cols // block, block)
    if fmt.block_size == 0:
        lo = np.full((rows, 1), w.min(), np.float32)
        hi = np.full((rows, 1), w.max(), np.float32)
    else:
        lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    scale, bias, _ = _affine_params(lo, hi, fmt)
    if importance is not None and fmt.block_size != 0:
        scale, bias = _search_clip(blocks, lo, hi, fmt, importance.reshape(cols // block, block), scale, bias)
    q = _round_affine(blocks, scale, bias, fmt).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, stored_params(scale, fmt),
                           stored_params(bias, fmt), source=str(fmt))


def _search_clip(blocks, lo, hi, fmt, importance, scale, bias, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)):
    """Per block, the range shrink (of [lo, hi] toward its centre, or of max|w| when symmetric) with the
    least importance-weighted squared error; the plain range first, so ties keep it."""
    best_err = None
    best_scale, best_bias = scale, bias
    for r in ratios:
        if fmt.symmetric:
            s, b, _ = _affine_params(lo * r, hi * r, fmt)
        else:
            mid = (lo + hi) / 2
            s, b, _ = _affine_params(mid + (lo - mid) * r, mid + (hi - mid) * r, fmt)
        q = _round_affine(blocks, s, b, fmt)
        approx = q * s[..., None] + (0 if b is None else b[..., None])
        err = np.einsum("rbk,bk->rb", (blocks - approx) ** 2, importance)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, s, best_scale).astype(np.float32)
        if b is not None:
            best_bias = np.where(better, b, best_bias).astype(np.float32)
    return best_scale, best_bias


# -- two-level parameters (:k) -----------------------------------------------------------------
SUPER_BLOCK = 256    # columns per super-block (GGUF's K types), or the nearest multiple of the block dividing cols
LSQ_ROUNDS = 4


def super_block_size(cols: int, block: int) -> int:
    """Columns per super-block: the multiple of block dividing cols nearest SUPER_BLOCK (the larger on a tie)."""
    options = [m * block for m in range(1, cols // block + 1) if cols % (m * block) == 0]
    return min(options, key=lambda s: (abs(s - SUPER_BLOCK), -s))


def _fit_blocks(blocks: np.ndarray, weights: np.ndarray, fmt: Format):
    """Float (scale, bias) per block [rows, nb] for blocks [rows, nb, block] under per-weight
    weights (broadcastable): the best clipped range (_search_clip), then alternately rounding and
    the weighted least-squares scale and bias for the codes, kept where they lower the error;
    asymmetric forms keep bias <= 0 (the bias is -dmin * code)."""
    lo, hi = np.minimum(blocks.min(axis=2), 0), blocks.max(axis=2)
    plain = Format("affine", fmt.qdtype, fmt.block_size, fmt.symmetric)
    s, b, _ = _affine_params(lo, hi, plain)
    imp = np.broadcast_to(weights, blocks.shape)
    s, b = _search_clip(blocks, lo, hi, plain, imp[0], s, b)
    if b is not None:
        b = np.minimum(b, 0)
    err = lambda s, b: (imp * (blocks - _round_affine(blocks, s, b, plain) * s[..., None]  # noqa: E731
                               - (0 if b is None else b[..., None])) ** 2).sum(axis=2)
    best = err(s, b)
    for _ in range(LSQ_ROUNDS):
        q = _round_affine(blocks, s, b, plain)
        a, qq = (imp * q * q).sum(axis=2), (imp * q * blocks).sum(axis=2)
        if b is None:
            s2, b2 = np.where(a > 0, qq / np.maximum(a, 1e-30), s), None
        else:
            c, bq, e = (imp * q).sum(axis=2), imp.sum(axis=2), (imp * blocks).sum(axis=2)
            det = a * bq - c * c
            ok = det > 1e-30 * np.maximum(a * bq, 1e-30)
            s2 = np.where(ok, (bq * qq - c * e) / np.where(ok, det, 1), s)
            b2 = np.where(ok, (a * e - c * qq) / np.where(ok, det, 1), b)
            pinned = b2 > 0           # the bias bound: scale alone, bias 0
            s2 = np.where(pinned, qq / np.maximum(a, 1e-30), s2)
            b2 = np.where(pinned, 0, b2)
        s2 = np.where(s2 > 0, s2, s).astype(np.float32)
        b2 = None if b2 is None else b2.astype(np.float32)
        e2 = err(s2, b2)
        better = e2 < best
        best = np.where(better, e2, best)
        s = np.where(better, s2, s)
        b = None if b is None else np.where(better, b2, b)
    return s.astype(np.float32), None if b is None else b.astype(np.float32)


def _unit(top: np.ndarray, bits: int) -> np.ndarray:
    """The float16 unit per super-block for codes of `bits` bits whose largest is top: top / (2**bits - 1),
    rounded up to 11 - bits significant bits, so that unit * code is exact in float16 (codes have
    `bits` bits); zero where top is."""
    u = np.asarray(top, np.float64) / (2 ** bits - 1)
    m, e = np.frexp(u)
    keep = 2.0 ** (11 - bits)
    u = np.ldexp(np.ceil(m * keep) / keep, e)
    tiny = float(np.finfo(np.float16).tiny) / (2 ** bits - 1)   # products stay float16 normals
    return np.where(top > 0, np.maximum(u, tiny), 0.0).astype(np.float16).astype(np.float32)


def _codes(p: np.ndarray, unit: np.ndarray, bits: int, low: int) -> np.ndarray:
    return np.clip(np.rint(p / np.where(unit > 0, unit, 1)), low, 2 ** bits - 1)


def _two_level_units(s: np.ndarray, b: np.ndarray | None, per_super: int, bits: int):
    """(d, dmin or None) [rows, n_super] for float block parameters [rows, nb]."""
    rows, nb = s.shape
    d = _unit(s.reshape(rows, nb // per_super, per_super).max(axis=2), bits)
    dmin = None if b is None else _unit((-b).reshape(rows, nb // per_super, per_super).max(axis=2), bits)
    return d, dmin


def _coded_params(blocks, weights, s, b, d, dmin, bits, fmt):
    """Block parameters on the two-level grid: the nearest codes to (s, b), then per block the
    neighbouring codes (+-1 each) with the lowest weighted error; returns float32 (scale, bias) exact
    products d * code, -dmin * code."""
    plain = Format("affine", fmt.qdtype, fmt.block_size, fmt.symmetric)
    imp = np.broadcast_to(weights, blocks.shape)
    cs = _codes(s, d, bits, 1)
    cm = None if b is None else _codes(-b, dmin, bits, 0)
    best, best_cs, best_cm = None, cs, cm
    for ds in (0, -1, 1):
        for dm in ((0,) if b is None else (0, -1, 1)):
            ts = np.clip(cs + ds, 1, 2 ** bits - 1)
            scale = (ts * d).astype(np.float32)
            tm = None if b is None else np.clip(cm + dm, 0, 2 ** bits - 1)
            bias = None if b is None else (-(tm * dmin)).astype(np.float32)
            q = _round_affine(blocks, scale, bias, plain)
            e = (imp * (blocks - q * scale[..., None] - (0 if bias is None else bias[..., None])) ** 2).sum(axis=2)
            if best is None:
                best, best_cs, best_cm = e, ts, tm
                continue
            better = e < best
            best = np.where(better, e, best)
            best_cs = np.where(better, ts, best_cs)
            best_cm = None if b is None else np.where(better, tm, best_cm)
    scale = (best_cs * d).astype(np.float32)
    return scale, None if b is None else (-(best_cm * dmin)).astype(np.float32)


def two_level_block_params(blocks, weights, fmt: Format, per_super: int, units=None):
    """(scale, bias, (d, dmin)) for blocks [rows, nb, block] in a :k format; units: the super-blocks'
    (d, dmin) when already fixed (GPTQ fits them on a super-block's weights before its first block)."""
    s, b = _fit_blocks(blocks, weights, fmt)
    if units is None:
        units = _two_level_units(s, b, per_super, fmt.code_bits)
    d, dmin = units
    rep = lambda u: None if u is None else np.repeat(u, per_super, axis=1)[:, :s.shape[1]]  # noqa: E731
    scale, bias = _coded_params(blocks, weights, s, b, rep(d), rep(dmin), fmt.code_bits, fmt)
    return scale, bias, units


def two_level_stored(p: np.ndarray | None) -> np.ndarray | None:
    """Two-level products as a tensor keeps them: float16 (exact, as the units make them), else float32."""
    if p is None:
        return None
    half = p.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), p) else p.astype(np.float32)


def _quantize_two_level(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    rows, cols = w.shape
    block = fitting_divisor(cols, fmt.block_size)
    per_super = super_block_size(cols, block) // block
    blocks = w.reshape(rows, cols // block, block)
    weights = (np.ones((1, 1, 1), np.float32) if importance is None
               else (np.maximum(importance, 0) + np.float32(1e-8)).reshape(1, cols // block, block))
    scale, bias, _ = two_level_block_params(blocks, weights, fmt, per_super)
    q = _round_affine(blocks, scale, bias, fmt).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, two_level_stored(scale),
                           two_level_stored(bias), source=str(fmt), two_level=(per_super * block, fmt.code_bits))


# -- lookup tables ------------------------------------------------------------------------------
HISTOGRAM_BINS = 8192      # groups of more values than this are fitted on a weighted histogram
CHUNK_ELEMENTS = 1 << 22   # bounds the [groups, points, entries] temporaries


def _row_keys(values: np.ndarray, lo: np.ndarray, span: np.ndarray) -> np.ndarray:
    """Values [G, n] mapped into disjoint ranges per row (row r -> [3r, 3r + 1]), float64: one
    sorted-order search then serves every row at once."""
    return ((values - lo[:, None]) / span[:, None] + 3.0 * np.arange(values.shape[0])[:, None]).astype(np.float64)


def _nearest_entry(values: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of each group's sorted table: values [G, n], tables [G, K] -> [G, n]."""
    g, k = tables.shape
    lo = np.minimum(values.min(axis=1), tables[:, 0]).astype(np.float64)
    span = np.maximum(np.maximum(values.max(axis=1), tables[:, -1]) - lo, 1e-30)
    mids = (tables[:, 1:].astype(np.float64) + tables[:, :-1]) / 2           # [G, K - 1]
    keys = _row_keys(mids, lo, span).ravel()
    out = np.empty(values.shape, np.int16)
    step = max(1, CHUNK_ELEMENTS // max(values.shape[1], 1))
    for g0 in range(0, g, step):
        g1 = min(g, g0 + step)
        v = _row_keys(values[g0:g1], lo[g0:g1], span[g0:g1]) + 3.0 * g0
        out[g0:g1] = np.searchsorted(keys, v, side="left") - (k - 1) * np.arange(g0, g1)[:, None]  # mids below v
    return out


def _initial_tables(points: np.ndarray, weights: np.ndarray, k: int, bins: int = 256) -> np.ndarray:
    """Starting tables [G, k]: quantiles of the cube root of each group's weighted density (the
    high-resolution optimum of a scalar quantizer), from a coarse histogram."""
    g = points.shape[0]
    lo, hi = points.min(axis=1), points.max(axis=1)
    span = np.where(hi > lo, hi - lo, 1.0)
    b = np.minimum(((points - lo[:, None]) / span[:, None] * bins).astype(np.intp), bins - 1)
    mass = np.bincount((np.arange(g)[:, None] * bins + b).ravel(), np.broadcast_to(weights, points.shape).ravel(),
                       g * bins).reshape(g, bins)
    density = np.cbrt(mass)
    cdf = np.cumsum(density, axis=1)
    cdf /= np.maximum(cdf[:, -1:], 1e-30)
    targets = (np.arange(k) + 0.5) / k
    at = (cdf[:, :, None] < targets[None, None, :]).sum(axis=1)          # [G, k] bin of each quantile
    before = np.take_along_axis(np.concatenate([np.zeros((g, 1)), cdf], axis=1), at, axis=1)
    inside = np.take_along_axis(np.concatenate([cdf, np.ones((g, 1))], axis=1), at, axis=1) - before
    frac = np.clip((targets[None, :] - before) / np.maximum(inside, 1e-30), 0, 1)
    return lo[:, None] + (at + frac) / bins * span[:, None]


def _kmeans_1d(points: np.ndarray, weights: np.ndarray, k: int, iterations: int = 100, pin_zero: bool = False,
               start: np.ndarray | None = None) -> np.ndarray:
    """Weighted 1-D k-means (Lloyd) for G independent groups: points, weights [G, n] -> sorted tables [G, k],
    from start [G, k] when given (else quantiles of the density). Points are sorted once; each step finds
    the cells' boundaries by one search and their mass and centroid by prefix sums, O(G k log n) per step."""
    g, n = points.shape
    weights = np.broadcast_to(np.asarray(weights, np.float64), points.shape) + 1e-12
    tables = (_initial_tables(points, weights, k) if start is None else np.array(start)).astype(np.float64)
    if pin_zero:
        tables[np.arange(g), np.abs(tables).argmin(axis=1)] = 0.0
    order = np.argsort(points, axis=1)
    sp = np.take_along_axis(points, order, axis=1).astype(np.float64)
    sw = np.take_along_axis(weights, order, axis=1)
    lo, span = sp[:, 0], np.maximum(sp[:, -1] - sp[:, 0], 1e-30)
    keys = _row_keys(sp, lo, span).ravel()
    cw = np.concatenate([[0.0], np.cumsum(sw.ravel())])
    cwp = np.concatenate([[0.0], np.cumsum((sw * sp).ravel())])
    starts = (np.arange(g) * n)[:, None]
    for _ in range(iterations):
        tables.sort(axis=1)
        mids = _row_keys((tables[:, 1:] + tables[:, :-1]) / 2, lo, span)
        cuts = np.searchsorted(keys, mids.ravel(), side="right").reshape(g, k - 1)
        bounds = np.concatenate([starts, np.clip(cuts, starts, starts + n), starts + n], axis=1)  # [G, k + 1]
        mass = cw[bounds[:, 1:]] - cw[bounds[:, :-1]]
        total = cwp[bounds[:, 1:]] - cwp[bounds[:, :-1]]
        new = np.where(mass > 1e-9, total / np.maximum(mass, 1e-30), tables)
        if pin_zero:  # the entry nearest zero is zero
            new[np.arange(g), np.abs(new).argmin(axis=1)] = 0.0
        done = np.allclose(new, tables, rtol=0, atol=1e-7 * (np.abs(tables).max() + 1e-30))
        tables = new
        if done:
            break
    tables.sort(axis=1)
    return tables.astype(np.float32)


def _fit_tables(groups: np.ndarray, weights: np.ndarray, k: int, uniform: bool, start: np.ndarray | None = None) -> np.ndarray:
    """Tables [G, k] for value groups [G, n] with weights [G, n] (broadcastable); k-means from start [G, k]
    when given."""
    lo, hi = groups.min(axis=1), groups.max(axis=1)
    if uniform:
        return np.linspace(lo, hi, k, axis=1).astype(np.float32)
    g, n = groups.shape
    weights = np.broadcast_to(weights, groups.shape)
    if n > HISTOGRAM_BINS:  # compress each group to a fine weighted histogram: mass and centre of each bin
        span = np.where(hi > lo, hi - lo, 1.0)
        bins = np.minimum(((groups - lo[:, None]) / span[:, None] * HISTOGRAM_BINS).astype(np.intp), HISTOGRAM_BINS - 1)
        flat = (np.arange(g)[:, None] * HISTOGRAM_BINS + bins).ravel()
        w = np.asarray(weights, np.float64).ravel()
        mass = np.bincount(flat, w, g * HISTOGRAM_BINS).reshape(g, HISTOGRAM_BINS)
        centre = np.bincount(flat, w * groups.ravel(), g * HISTOGRAM_BINS).reshape(g, HISTOGRAM_BINS)
        edges = lo[:, None] + (np.arange(HISTOGRAM_BINS) + 0.5) / HISTOGRAM_BINS * span[:, None]
        points = np.where(mass > 0, centre / np.maximum(mass, 1e-30), edges)
        return _kmeans_1d(points.astype(np.float32), mass, k, start=start)
    return _kmeans_1d(groups, np.asarray(weights, np.float64), k, start=start)


def _quantize_lut(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    rows, cols = w.shape
    k = 2 ** fmt.bits
    group = rows if fmt.group_rows is None else fitting_divisor(rows, fmt.group_rows)
    n_groups = rows // group
    groups = w.reshape(n_groups, group * cols)
    weights = np.ones((1, 1)) if importance is None else np.tile(np.maximum(importance, 0) + 1e-8, group)[None, :]
    tables = np.sort(_fit_tables(groups, weights, k, fmt.uniform).astype(np.float16), axis=1)  # stored as float16
    q = _nearest_entry(groups, tables.astype(np.float32)).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), cols, None,
                           source=str(fmt), lut=tables.reshape(n_groups, 1, k))


SCALE_STARTS = (0.9, 1.0, 1.1)   # block scales tried, times max|w| / max|table|
TABLE_REFITS = 2


def _scaled_codes(blocks, scale, tables, group):
    """Nearest table entries of blocks / scale: blocks [rows, nb, block], scale [rows, nb], tables [G, K]
    sorted; the count of the table's midpoints below each value (a few compares per value: tables
    are short, so this beats a binary search), in one compiled pass (15 NumPy passes over the weight
    were a third of lut4:b32:offset:k's fitting time)."""
    dtype = np.result_type(blocks.dtype, scale.dtype)
    mids = ((tables[:, 1:] + tables[:, :-1]) / 2).astype(dtype)
    codes = np.empty(blocks.shape, np.uint8)
    from .fit_kernels import count_mids_below   # (numba: imported where a table is fitted)
    count_mids_below(np.ascontiguousarray(blocks, dtype), np.ascontiguousarray(scale, dtype), mids, group, codes)
    return codes


def _refit_scale(blocks, codes, tables, group, weights):
    """Per block the least-squares scale for fixed codes (importance-weighted); [rows, nb]."""
    rows = blocks.shape[0]
    t = tables[np.repeat(np.arange(tables.shape[0]), group)[:, None, None], codes]     # [rows, nb, block]
    num = (weights * blocks * t).sum(axis=2)
    den = (weights * t * t).sum(axis=2)
    return np.where(den > 0, num / np.maximum(den, 1e-30), 1.0).reshape(rows, -1)


def _quantize_scaled_lut(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    rows, cols = w.shape
    k = 2 ** fmt.bits
    block = fitting_divisor(cols, fmt.block_size)
    group = rows if fmt.group_rows is None else fitting_divisor(rows, fmt.group_rows)
    blocks = w.reshape(rows, cols // block, block)
    imp = np.ones(cols, np.float32) if importance is None else np.maximum(importance, 0) + np.float32(1e-8)
    weights = np.broadcast_to(imp.reshape(1, cols // block, block), blocks.shape)
    absmax = np.abs(blocks).max(axis=2)
    scale = np.where(absmax > 0, absmax, 1.0)
    for _ in range(TABLE_REFITS):
        # the table, fitted on the normalised weights; an error e in them costs e * scale in w
        normalized = (blocks / scale[..., None]).reshape(rows // group, -1)
        fit_weights = (weights * scale[..., None] ** 2).reshape(rows // group, -1)
        tables = _fit_tables(normalized, fit_weights, k, fmt.uniform).astype(np.float16).astype(np.float32)
        tables.sort(axis=1)
        top = np.abs(tables).max(axis=1)
        best_err, best_scale = None, scale
        for start in SCALE_STARTS:  # from a few starting scales: codes, then the least-squares scale for them
            s = np.where(absmax > 0, absmax / (start * np.repeat(top, group)[:, None]), 1.0)
            s = _refit_scale(blocks, _scaled_codes(blocks, s, tables, group), tables, group, weights)
            s = np.where(np.abs(s) > 1e-30, s, 1.0)
            codes = _scaled_codes(blocks, s, tables, group)
            approx = tables[np.repeat(np.arange(tables.shape[0]), group)[:, None, None], codes] * s[..., None]
            err = (weights * (blocks - approx) ** 2).sum(axis=2)
            if best_err is None:
                best_err, best_scale = err, s
            else:
                better = err < best_err
                best_err, best_scale = np.where(better, err, best_err), np.where(better, s, best_scale)
        scale = best_scale
    scale = scale.astype(np.float32)
    q = _scaled_codes(blocks, scale, tables, group).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, scale, source=str(fmt),
                           lut=tables.astype(np.float32).reshape(rows // group, 1, k))


OFFSET_ROUNDS = 8   # at most; rounds stop once one lowers the error by less than OFFSET_CONVERGED
OFFSET_CONVERGED = 1e-3


def _offset_codes(blocks, scale, offset, tables, group):
    """Nearest table entries of (blocks - offset) / scale, as _scaled_codes."""
    return _scaled_codes(blocks - offset[..., None], scale, tables, group)


def _quantize_offset_lut(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    """w = table[q] * scale + offset, scale and offset float16 per block of columns. Two starts: each
    block's midrange and half range (benchmarks/lab/lut_offset.py), and lut4:bB's table and clipped
    scales with no offset; from each, rounds of the table (importance- and scale**2-weighted k-means on
    the normalised weights; the second start keeps its table the first time) and then, for the codes it
    gives, each block's weighted least-squares line (scale, offset), both rounded to float16.

    From each start the round with the least weighted error; of the two, the one with the least error
    weighted by the importance, or without one by each column's mean square weight: a plain squared
    error picks the wrong start on the default model's tied
    embedding, where the clipped start's error is lower (0.00867 against 0.00917, relative) but its KLD
    far higher (0.0987 against 0.0635; uint4:32:k 0.0602): it gives up the large weights of the loud
    columns, which the column weighting counts (0.00351 against 0.00238). On zero-mean Student-t
    weights, whose columns are alike, it keeps the clipped start."""
    rows, cols = w.shape
    block = fitting_divisor(cols, fmt.block_size)
    group = rows if fmt.group_rows is None else fitting_divisor(rows, fmt.group_rows)
    blocks = w.reshape(rows, cols // block, block)
    imp = np.ones(cols, np.float32) if importance is None else np.maximum(importance, 0) + np.float32(1e-8)
    weights = imp.reshape(1, cols // block, block)
    select = weights if importance is not None else (np.square(w, dtype=np.float64).mean(axis=0) + 1e-30).reshape(weights.shape)
    hi, lo = blocks.max(axis=2), blocks.min(axis=2)
    plain = _quantize_scaled_lut(w, Format("lut", fmt.qdtype, fmt.block_size, group_rows=fmt.group_rows,
                                           uniform=fmt.uniform), importance)
    starts = [(None, _nonzero_half(half_params((hi - lo) / 2)), half_params((hi + lo) / 2)),
              (plain.lut[:, 0, :], _nonzero_half(half_params(plain.scale)), np.zeros_like(hi))]
    ends = [min(_offset_rounds(blocks, weights, select, group, fmt, *start), key=lambda r: r[0]) for start in starts]
    _, _, tables, scale, offset = min(ends, key=lambda r: r[1])
    q = _offset_codes(blocks, scale, offset, tables, group).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, scale.astype(np.float16),
                           offset.astype(np.float16), source=str(fmt), lut=tables.reshape(rows // group, 1, 2 ** fmt.bits))


def _offset_rounds(blocks, weights, select, group, fmt, tables, scale, offset, rounds=OFFSET_ROUNDS):
    """[(weighted error, error weighted by select, tables, scale, offset)] after each round from a start
    (tables None: fitted first); the rounds stop once one lowers the error by less than OFFSET_CONVERGED."""
    rows = blocks.shape[0]
    row_table = np.repeat(np.arange(rows // group), group)[:, None, None]
    out = []
    for _ in range(rounds):
        if tables is None:   # the table for the normalised weights; an error e in them costs e * scale in w
            normalized = ((blocks - offset[..., None]) / scale[..., None]).reshape(rows // group, -1)
            fit_weights = np.broadcast_to(weights * (scale ** 2)[..., None], blocks.shape).reshape(rows // group, -1)
            tables = np.sort(_fit_tables(normalized, fit_weights, 2 ** fmt.bits, fmt.uniform)
                             .astype(np.float16).astype(np.float32), axis=1)
        scale, offset = _offset_line(blocks, weights, tables[row_table, _offset_codes(blocks, scale, offset, tables, group)],
                                     scale)
        approx = tables[row_table, _offset_codes(blocks, scale, offset, tables, group)] * scale[..., None] + offset[..., None]
        squared = (blocks - approx) ** 2
        out.append((float((weights * squared).sum()), float((select * squared).sum()), tables, scale, offset))
        tables = None
        if len(out) > 1 and out[-1][0] > (1 - OFFSET_CONVERGED) * out[-2][0]:
            break
    return out


def _offset_line(blocks, weights, t, scale):
    """Per block the weighted least-squares (scale, offset) of blocks ~ t * scale + offset, float16-valued
    (the offset fitted for the rounded scale); a block whose entries do not vary keeps its scale."""
    mass = weights.sum(axis=2)
    t_mean = (weights * t).sum(axis=2) / mass
    w_mean = (weights * blocks).sum(axis=2) / mass
    centred = t - t_mean[..., None]
    var = (weights * centred * centred).sum(axis=2)
    cov = (weights * centred * (blocks - w_mean[..., None])).sum(axis=2)
    fitted = np.where(var > 1e-12 * np.maximum(t_mean ** 2, 1e-30), cov / np.maximum(var, 1e-30), scale)
    scale = _nonzero_half(half_params(np.where(fitted > 0, fitted, scale)))
    return scale, half_params(w_mean - scale * t_mean)


def _nonzero_half(scale: np.ndarray) -> np.ndarray:
    """float16-valued scales with zeros (a block of one value) raised to float16's smallest normal."""
    tiny = np.float32(np.finfo(np.float16).tiny)
    return np.where(np.abs(scale) >= tiny, scale, tiny).astype(np.float32)


# -- tables with two-level block scales and offsets (lut4:bB:offset:k) --------------------------------
TWO_LEVEL_LUT_ROUNDS = 6   # at most; rounds stop at the first that does not lower the error by OFFSET_CONVERGED


def _quantize_two_level_lut(w: np.ndarray, fmt: Format, importance: np.ndarray | None) -> QuantizedTensor:
    """w = table[q] * scale + offset, each block's scale and offset coded two-level as uint4:B:k's are
    (scale = d * code, offset = -dmin * code: 6-bit codes, float16 units d and dmin per super-block), so
    the format holds uint4:B:k's every weight exactly (the table the levels 0..15) at its bytes plus a table.

    Two starts: uint4:B:k's own fit (table 0..15, its scales and biases), and lut4:bB:offset's
    (_quantize_offset_lut) with its table shifted to start at 0 (the offsets then the blocks' lows,
    kept <= 0) and its scales and offsets coded. From each, rounds (_two_level_lut_rounds), a round kept
    only where it lowers the error; of the two ends the one with the least error. The error is weighted
    by the importance, or without one by each column's mean square weight (as _quantize_offset_lut picks,
    for the tied embedding's sake). The affine start's table form is never worse than uint4:B:k (a nearest
    entry is at least as near as a clipped rounding), so neither is the result, on that error."""
    rows, cols = w.shape
    k = 2 ** fmt.bits
    block = fitting_divisor(cols, fmt.block_size)
    per_super = super_block_size(cols, block) // block
    group = rows if fmt.group_rows is None else fitting_divisor(rows, fmt.group_rows)
    blocks = w.reshape(rows, cols // block, block)
    imp = np.ones(cols, np.float32) if importance is None else np.maximum(importance, 0) + np.float32(1e-8)
    weights = imp.reshape(1, cols // block, block)
    select = weights if importance is not None else (np.square(w, dtype=np.float64).mean(axis=0) + 1e-30).reshape(weights.shape)
    affine = Format("affine", dt.uint4 if fmt.bits == 4 else dt.uint8, block, symmetric=False, code_bits=fmt.code_bits)
    scale, bias, _ = two_level_block_params(blocks, weights, affine, per_super)
    starts = [(np.tile(np.arange(k, dtype=np.float32), (rows // group, 1)), scale, bias)]
    fitted = _quantize_offset_lut(w, Format("lut", fmt.qdtype, fmt.block_size, group_rows=fmt.group_rows, offset=True),
                                  importance)
    tables = fitted.lut[:, 0, :].astype(np.float32)
    low = np.repeat(tables[:, :1], group, axis=0)                       # [rows, 1]
    scale, offset = fitted.scale.astype(np.float32), fitted.bias.astype(np.float32) + low * fitted.scale.astype(np.float32)
    tables = np.sort(half_params(tables - tables[:, :1]), axis=1)
    starts.append((tables, *_coded_lut_params(blocks, weights, tables, group, scale, offset, per_super, fmt.code_bits)))
    ends = [_two_level_lut_rounds(blocks, weights, select, group, per_super, fmt.code_bits, *start) for start in starts]
    _, tables, scale, offset = min(ends, key=lambda end: end[0])
    q = _offset_codes(blocks, scale, offset, tables, group).reshape(rows, cols)
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, two_level_stored(scale),
                           two_level_stored(offset), source=str(fmt), lut=tables.reshape(rows // group, 1, k),
                           two_level=(per_super * block, fmt.code_bits))


def _two_level_lut_rounds(blocks, weights, select, group, per_super, bits, tables, scale, offset,
                          rounds=TWO_LEVEL_LUT_ROUNDS):
    """(error weighted by select, tables, scale, offset) after rounds from a start whose scale and offset
    are two-level products. A round: the table by weighted k-means on the normalised weights from the
    current table, the codes, each block's weighted least-squares line (offset <= 0) re-coded two-level
    (_coded_lut_params); then per super-block (one pair of units) the new or the old parameters, whichever
    the new table fits better. A round that does not lower the error is dropped and ends the rounds."""
    rows = blocks.shape[0]
    row_table = np.repeat(np.arange(rows // group), group)[:, None, None]

    def block_errors(tables, scale, offset):
        approx = tables[row_table, _offset_codes(blocks, scale, offset, tables, group)] * scale[..., None] + offset[..., None]
        return (select * (blocks - approx) ** 2).sum(axis=2, dtype=np.float64)

    best = float(block_errors(tables, scale, offset).sum())
    for _ in range(rounds):
        normalized = ((blocks - offset[..., None]) / scale[..., None]).reshape(rows // group, -1)
        fit_weights = np.broadcast_to(weights * (scale ** 2)[..., None], blocks.shape).reshape(rows // group, -1)
        new_tables = np.sort(half_params(_fit_tables(normalized, fit_weights, tables.shape[1], False, start=tables)), axis=1)
        t = new_tables[row_table, _offset_codes(blocks, scale, offset, new_tables, group)]
        s, o = _nonpositive_line(blocks, weights, t, scale, offset)
        new_scale, new_offset = _coded_lut_params(blocks, weights, new_tables, group, s, o, per_super, bits)
        e_new, e_old = block_errors(new_tables, new_scale, new_offset), block_errors(new_tables, scale, offset)
        by_super = lambda e: e.reshape(rows, -1, per_super).sum(axis=2)   # noqa: E731
        take = np.repeat(by_super(e_new) < by_super(e_old), per_super, axis=1)
        error = float(np.where(take, e_new, e_old).sum())
        if not error < best:
            break
        converged = error > (1 - OFFSET_CONVERGED) * best
        tables, scale, offset, best = new_tables, np.where(take, new_scale, scale), np.where(take, new_offset, offset), error
        if converged:
            break
    return best, tables, scale, offset


def _nonpositive_line(blocks, weights, t, scale, offset):
    """Per block the weighted least-squares (scale, offset) of blocks ~ t * scale + offset with offset <= 0
    (a positive one pinned at 0, the scale then refitted alone), float32; a block whose fit is degenerate
    or whose scale comes out <= 0 keeps its scale and offset."""
    imp = np.broadcast_to(weights, blocks.shape)
    a, c, m = (imp * t * t).sum(axis=2), (imp * t).sum(axis=2), imp.sum(axis=2)
    e, tx = (imp * blocks).sum(axis=2), (imp * t * blocks).sum(axis=2)
    det = a * m - c * c
    ok = det > 1e-12 * np.maximum(a * m, 1e-30)
    s = np.where(ok, (m * tx - c * e) / np.where(ok, det, 1), scale)
    o = np.where(ok, (a * e - c * tx) / np.where(ok, det, 1), offset)
    pinned = o > 0
    s = np.where(pinned, tx / np.maximum(a, 1e-30), s)
    o = np.where(pinned, 0, o)
    keep = ~(s > 0) | ~np.isfinite(s) | ~np.isfinite(o)
    return np.where(keep, scale, s).astype(np.float32), np.where(keep, offset, o).astype(np.float32)


def _coded_lut_params(blocks, weights, tables, group, s, o, per_super, bits):
    """Float block scales s > 0 and offsets o (<= 0; larger ones clipped to 0) [rows, nb] on the two-level
    grid: float16 units per super-block for their largest (_two_level_units), the nearest codes, then per
    block the neighbouring codes (+-1 each) with the least weighted error for the table; float32 (scale,
    offset), exact products d * code and -dmin * code."""
    o = np.minimum(o, 0)
    d, dmin = (np.repeat(u, per_super, axis=1).astype(np.float32) for u in _two_level_units(s, o, per_super, bits))
    cs, cm = _codes(s, d, bits, 1).astype(np.int64), _codes(-o, dmin, bits, 0).astype(np.int64)
    tables = np.ascontiguousarray(tables, np.float32)
    mids = ((tables[:, 1:] + tables[:, :-1]) / 2).astype(np.float32)
    scale, offset = np.empty(s.shape, np.float32), np.empty(s.shape, np.float32)
    from .fit_kernels import best_coded_lines
    best_coded_lines(np.ascontiguousarray(blocks, np.float32), np.ascontiguousarray(weights, np.float32), tables, mids,
                     group, cs, cm, d, dmin, 2 ** bits - 1, scale, offset)
    return scale, offset
