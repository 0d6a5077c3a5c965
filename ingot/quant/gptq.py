"""GPTQ (Frantar et al., 2022): quantize a weight one input column at a time, and spread each
column's rounding error over the columns not yet quantized, in the directions the calibration
activations make cheapest. With H = E[x x^T] (the inputs' second moments, [in, in]) it minimises
E ||(W - W_hat) x||^2 greedily, where round-to-nearest minimises ||W - W_hat||^2 only.

Block parameters (an affine format's scale and bias) are fitted on a block's columns as they stand
when the sweep reaches the block, after the earlier blocks' corrections (GPTQ's "groups"); a lookup
table format keeps the tables (and block scales and offsets) fitted on the original weight and GPTQ
picks each entry.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((512, 64)) * np.linspace(0.1, 3, 64)       # calibration inputs
    >>> w = rng.standard_normal((32, 64)).astype(np.float32)
    >>> h = x.T @ x / len(x)
    >>> plain = w - quantize(w, "int4:32").dequantize_rows()
    >>> better = w - gptq(w, "int4:32", h).dequantize_rows()
    >>> bool(np.trace(better @ h @ better.T) < np.trace(plain @ h @ plain.T))
    True
"""
from __future__ import annotations

import numpy as np

from ..errors import IngotError
from .formats import QuantizedTensor
from .quantize import (Format, _affine_params, _fit_blocks, _pack, _round_affine, _search_clip, _two_level_units,
                       fitting_divisor, parse_format, quantize, stored_params, super_block_size, two_level_block_params,
                       two_level_stored)

DAMPING = 0.01       # of the mean diagonal, added to H (GPTQ's default)
SWEEP_BLOCK = 128    # columns whose corrections are applied lazily together


def inverse_cholesky(hessian: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U), H damped to be positive definite: with
    P the reversal, P H P = L L^T gives H^-1 = (P L^-T P)(P L^-1 P), one factorisation and one
    triangular inverse (LAPACK trtri: a third of the work of solving against the identity; 1536 x 1536
    on one thread 40 ms against 136-266). Weights that read one input share it (compute once, pass as
    factor=)."""
    from scipy.linalg import cholesky
    from scipy.linalg.lapack import dtrtri

    h = np.array(hessian, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h += DAMPING * np.mean(np.diag(h)) * np.eye(len(h))
    lower = cholesky(h[::-1, ::-1], lower=True)
    inverse, info = dtrtri(lower, lower=1)
    if info != 0:   # a zero pivot: cholesky succeeded, so only a non-finite statistic gets here
        raise IngotError(f"gptq: the damped second moments are singular (LAPACK trtri info {info}).")
    return np.ascontiguousarray(np.tril(inverse)[::-1, ::-1])


def gptq(weight: np.ndarray, fmt: str | Format, hessian: np.ndarray, factor: np.ndarray | None = None) -> QuantizedTensor:
    """weight [rows, cols] in format fmt (affine with blocks, or lut), GPTQ-rounded under the input
    second moments hessian [cols, cols]; factor: inverse_cholesky(hessian) when already known."""
    fmt = parse_format(fmt)
    w = np.array(weight, np.float64)
    rows, cols = w.shape
    if np.shape(hessian) != (cols, cols):
        raise IngotError(f"gptq: the second moments have shape {np.shape(hessian)}, expected ({cols}, {cols}).")
    if fmt.kind == "affine" and fmt.block_size == 0:
        raise IngotError(f"gptq: {fmt} has one scale for the whole tensor; use blocks or channels.")
    importance = np.maximum(np.diag(hessian), 0).astype(np.float32)
    w[:, np.diag(hessian) <= 0] = 0.0
    u = inverse_cholesky(hessian) if factor is None else factor
    if fmt.kind == "lut":
        template = quantize(weight, fmt, importance=importance)   # the tables, fitted once
        group = rows // template.lut.shape[0]
        tables = template.lut[:, 0, :].astype(np.float64)          # [groups, entries]
        row_table = np.repeat(np.arange(tables.shape[0]), group)
        block = template.block_size                                # a scaled table keeps its fitted scales
        lut_scale = None if template.scale is None else template.scale.astype(np.float64)
        lut_offset = None if template.bias is None else template.bias.astype(np.float64)   # lut4:bB:offset
    else:
        block = cols if fmt.block_size is None else fitting_divisor(cols, fmt.block_size)
        scale = np.empty((rows, cols // block), np.float32)
        bias = None if fmt.symmetric and fmt.qdtype.kind == "i" else np.empty((rows, cols // block), np.float32)
        per_super = super_block_size(cols, block) if fmt.code_bits else 0
    q = np.empty((rows, cols), np.int16)

    def quantize_column(j: int, column: np.ndarray) -> np.ndarray:
        """Codes of column j into q; returns the column's dequantized values."""
        if fmt.kind == "lut":
            entries = tables[row_table]                                     # [rows, entries]
            s = 1.0 if lut_scale is None else lut_scale[:, j // block]
            m = 0.0 if lut_offset is None else lut_offset[:, j // block]
            codes = np.abs(entries - ((column - m) / s)[:, None]).argmin(axis=1)
            q[:, j] = codes
            return tables[row_table, codes] * s + m
        b = j // block
        s = scale[:, b].astype(np.float64)
        offset = 0.0 if bias is None else bias[:, b].astype(np.float64)
        codes = _round_affine(column[:, None], s, None if bias is None else offset, fmt)[:, 0]
        q[:, j] = codes
        return codes * s + offset

    for start in range(0, cols, SWEEP_BLOCK):
        stop = min(cols, start + SWEEP_BLOCK)
        errors = np.empty((rows, stop - start))
        for j in range(start, stop):
            if fmt.kind == "affine" and fmt.code_bits and j % block == 0:
                if j % per_super == 0:   # the super-block's units, from its columns as they stand now
                    cells = w[:, j:j + per_super].astype(np.float32).reshape(rows, per_super // block, block)
                    imp = importance[j:j + per_super].reshape(1, per_super // block, block) + np.float32(1e-8)
                    units = _two_level_units(*_fit_blocks(cells, imp, fmt), per_super // block, fmt.code_bits)
                cells = w[:, j:j + block].astype(np.float32)[:, None, :]
                s, bb, _ = two_level_block_params(cells, importance[None, None, j:j + block] + np.float32(1e-8), fmt, 1,
                                                  units=units)
                scale[:, j // block] = s[:, 0]
                if bias is not None:
                    bias[:, j // block] = bb[:, 0]
            elif fmt.kind == "affine" and j % block == 0:  # this block's parameters, from its columns as they stand now
                cells = w[:, j:j + block].astype(np.float32)[:, None, :]
                lo, hi = cells.min(axis=2), cells.max(axis=2)
                s, bb, _ = _affine_params(lo, hi, fmt)
                s, bb = _search_clip(cells, lo, hi, fmt, importance[None, j:j + block], s, bb)
                scale[:, j // block] = s[:, 0]
                if bias is not None:
                    bias[:, j // block] = bb[:, 0]
            column = w[:, j]
            err = (column - quantize_column(j, column)) / u[j, j]
            w[:, j + 1:stop] -= np.outer(err, u[j, j + 1:stop])
            errors[:, j - start] = err
        w[:, stop:] -= errors @ u[start:stop, stop:]
    if fmt.kind == "lut":
        return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, template.scale, template.bias,
                               source=str(fmt), lut=template.lut, two_level=template.two_level)
    if fmt.code_bits:
        return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, two_level_stored(scale),
                               two_level_stored(bias), source=str(fmt), two_level=(per_super, fmt.code_bits))
    return QuantizedTensor(_pack(q, fmt.qdtype), fmt.qdtype, (rows, cols), block, stored_params(scale, fmt),
                           stored_params(bias, fmt), source=str(fmt))
