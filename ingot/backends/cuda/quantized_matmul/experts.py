"""quantized_gather_matmul on the GPU: each token's chosen experts multiplied straight from their packed
weights (`_expert_gemv_kernel`), never a float copy of any expert.

    out[t, j] = x[t, j or 0] @ W[idx[t, j]]        x [T, S, K], idx [T, J], W [E, K, N] -> [T, J, N]

The experts are re-packed once at load, each as `prepare_weight` packs a quantized_matmul weight
(k-major, unsigned, parameters per GROUP rows; lookup tables as they are), then stacked along a leading
expert axis (`ExpertWeights`). One program multiplies one (token, choice) row by a BLOCK_N column block
of its expert: [BLOCK_K, BLOCK_N] tiles through the same tile loader and dequantizer as the one-row
GEMVs (`gemm._load_tile`, `gemm._dequantize_tile`; a scaled table's scales applied after the lookup), products accumulated in a 2-D register tile and
summed over K once at the end. The expert index is read on the device (no host sync: the plan can be
captured as a CUDA graph) and clamped into 0..E-1, where the NumPy reference raises on a bad one.

Many rows (a prompt: from GROUPED_MIN_ROWS (token, choice) rows on) run the grouped GEMM instead
(`_expert_gemm_kernel`): the rows sorted by expert on the device (`group_rows`: a stable argsort, each
expert's rows padded to a multiple of BLOCK_M, no host sync), one program per BLOCK_M rows of one expert
by BLOCK_N columns, the expert's tile dequantized in registers and fed to tl.dot (tensor cores; tf32x3
for float32 x), so each expert's weight is read once per tile of its rows instead of once per row. The
grid is the bound cdiv(rows, BLOCK_M) + min(E, rows) on the tiles; the tiles past the last expert's
return at once. Tiles and the threshold are not tuned on a GPU yet (written 2026-12-05 under Triton's
interpreter).

    >>> w = prepare_experts(q, params, attrs, "cuda")             # doctest: +SKIP
    >>> y = expert_matmul(x, idx, w)                                # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .... import dtypes as dt
from ....errors import IngotError
from ....ops.moe import expert_params
from .gemm import _dequantize_tile, _load_tile
from .weights import prepare_weight

BLOCK_N, BLOCK_K = 64, 32
GROUPED_MIN_ROWS = 64     # (token, choice) rows from which expert_matmul runs the grouped GEMM (not measured)


@dataclass
class ExpertWeights:
    """E quantized [K, N] experts in the kernels' form, stacked: q uint8 [E, Kp, NQ], scale and bias
    [E, Kp / group, Np] (affine, and scaled tables' scales; bias None when zero), lut float32
    [E, pK, pN, 2**bits] (lookup tables)."""
    q: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    lut: torch.Tensor | None
    lut_block_k: int
    lut_block_n: int
    bits: int
    group: int
    k: int
    n: int
    scaled: bool = False            # a scaled table: w = lut[v] * scale (scale per group rows, as affine)

    @property
    def experts(self) -> int:
        return self.q.shape[0]


def prepare_experts(q: np.ndarray, params: list[np.ndarray], attrs: dict, device) -> ExpertWeights:
    """Re-pack a quantized_gather_matmul's experts (q [E, K, N] in Ingot's layout, 4-bit packed along N;
    parameters block-broadcast over it, a leading axis of 1 shared by all) for `_expert_gemv_kernel`.
    A scaled table (GGUF's IQ4_NL/IQ4_XS, MXFP4: w = lut[v] * scale) is packed as its table, and its scales
    as an affine weight's (per `group` rows; `scaled`)."""
    attrs = dict(attrs, transpose=False)
    experts = range(q.shape[0])
    if attrs["mode"] == "scaled_lut":
        if attrs.get("has_bias"):
            raise IngotError("quantized_gather_matmul: routed experts in a scaled table with a bias (lut4:bB:offset) "
                             "have no GPU kernel; quantize the experts in another format.")
        tables = [prepare_weight(q[e], expert_params(params, e)[:1], dict(attrs, mode="lut"), device) for e in experts]
        scales = [prepare_weight(q[e], expert_params(params, e)[1:], dict(attrs, mode="affine", qdtype=dt.uint4
                                 if attrs["qdtype"].packed else dt.uint8, has_zero_point=False, has_bias=False), device)
                  for e in experts]
        first, s = tables[0], _stacked([w.scale for w in scales])
        return ExpertWeights(_stacked([w.q for w in tables]), s, None, _stacked([w.lut for w in tables]),
                             first.lut_block_k, first.lut_block_n, first.bits, scales[0].group, first.k, first.n,
                             scaled=True)
    per = [prepare_weight(q[e], expert_params(params, e), attrs, device, words=False) for e in experts]
    first = per[0]

    return ExpertWeights(*(_stacked([getattr(w, f) for w in per]) for f in ("q", "scale", "bias", "lut")),
                         first.lut_block_k, first.lut_block_n, first.bits, first.group, first.k, first.n)


def _stacked(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The experts' tensors along a new leading axis (float32 where some are float16 and some not)."""
    if parts[0] is None:
        return None
    if len({p.dtype for p in parts}) > 1:     # float16 where exact for some experts, not all
        parts = [p.float() for p in parts]
    return torch.stack(parts).contiguous()


@triton.jit
def _expert_gemv_kernel(x_ptr, idx_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                        N, K, NQ, E, ROW_DIV, stride_xr, stride_qe, stride_qk, stride_se, stride_sk,
                        lut_block_k, lut_block_n, stride_le, stride_lk, stride_ln,
                        BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr = False):
    """y[r, n0:n0+BLOCK_N] = x[r // ROW_DIV] @ W[idx[r]][:, n0:n0+BLOCK_N] for choice r = t * J + j
    (ROW_DIV = J when every choice of a token reads its one row, 1 when choice j reads row j)."""
    r = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.minimum(tl.maximum(tl.load(idx_ptr + r).to(tl.int64), 0), E - 1)
    q_e = q_ptr + e * stride_qe
    s_e = s_ptr + e * stride_se
    b_e = b_ptr + e * stride_se
    lut_e = lut_ptr + e * stride_le
    x_row = x_ptr + (r // ROW_DIV).to(tl.int64) * stride_xr
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        v = _load_tile(q_e, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
        w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_e, b_e, lut_e, stride_sk, lut_block_k, lut_block_n,
                             stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K)
        if SCALED:   # a scaled table: the looked-up values times the scale of their group of rows
            ok = (offs_k < K)[:, None] & n_mask[None, :]
            w *= tl.load(s_e + (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        acc += w * x[:, None]
    tl.store(y_ptr + r.to(tl.int64) * N + offs_n, tl.sum(acc, axis=0), mask=n_mask)


@triton.jit
def _expert_gemm_kernel(x_ptr, ids_ptr, tile_e_ptr, q_ptr, s_ptr, b_ptr, lut_ptr, y_ptr,
                        R, N, K, NQ, E, ROW_DIV, stride_xr, stride_qe, stride_qk, stride_se, stride_sk,
                        lut_block_k, lut_block_n, stride_le, stride_lk, stride_ln,
                        BITS: tl.constexpr, LUT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """y[rows, n0:n0+BLOCK_N] = x[rows // ROW_DIV] @ W[e][:, n0:n0+BLOCK_N] for one tile of BLOCK_M rows
    that chose expert e (ids_ptr: the rows sorted by expert, R where a tile is padded; tile_e_ptr: each
    tile's expert, E past the last)."""
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(tile_e_ptr + tile).to(tl.int64)
    if e < E:
        rows = tl.load(ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        r_ok = rows < R
        x_rows = x_ptr + (rows // ROW_DIV).to(tl.int64) * stride_xr
        q_e = q_ptr + e * stride_qe
        s_e = s_ptr + e * stride_se
        b_e = b_ptr + e * stride_se
        lut_e = lut_ptr + e * stride_le
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=r_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            v = _load_tile(q_e, offs_k, n0, K, NQ, stride_qk, BITS, BLOCK_K, BLOCK_N)
            w = _dequantize_tile(v, k0, offs_k, K, offs_n, n_mask, s_e, b_e, lut_e, stride_sk, lut_block_k, lut_block_n,
                                 stride_lk, stride_ln, LUT, GROUP, HAS_BIAS, BLOCK_K)
            if SCALED:
                ok = (offs_k < K)[:, None] & n_mask[None, :]
                w *= tl.load(s_e + (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :], mask=ok,
                             other=0.0).to(tl.float32)
            if x.dtype == tl.float32:
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=r_ok[:, None] & n_mask[None, :])


def group_rows(idx: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) rows of idx [T, J] sorted by expert, on the device (no host sync): (ids int32
    [tiles * block_m], R = T * J where a tile is padded; the expert of each tile int32 [tiles], `experts`
    past the last), tiles = cdiv(R, block_m) + min(experts, R), a bound on what the experts need. An
    index outside 0..experts-1 is clamped, as `_expert_gemv_kernel` does."""
    flat = idx.reshape(-1).long().clamp(0, experts - 1)
    r = flat.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    chosen = flat[order]
    rank = torch.arange(r, device=idx.device) - (torch.cumsum(counts, 0) - counts)[chosen]
    tiles = triton.cdiv(r, block_m) + min(experts, r)
    ids = torch.full((tiles * block_m,), r, dtype=torch.int32, device=idx.device)
    ids[(ends - padded)[chosen] + rank] = order.to(torch.int32)
    starts = torch.arange(tiles, device=idx.device, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return ids, tile_expert


def grouped_config(rows: int, experts: int, dtype: torch.dtype) -> dict:
    """Tiles for the grouped GEMM: BLOCK_M near the rows an expert gets on average."""
    per = rows / max(experts, 1)
    block_m = 16 if per <= 24 else (32 if per <= 48 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32 if dtype == torch.float32 else 64, num_warps=4,
                num_stages=2 if dtype == torch.float32 else 3)


def expert_matmul(x: torch.Tensor, idx: torch.Tensor, w: ExpertWeights, grouped: bool | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """out [T, J, N] (x's dtype) = each token's chosen experts applied to x [T, S, K] (S = 1 or J).
    grouped: the grouped GEMM (True), the row-by-row GEMV (False), or by the rows (None: from
    GROUPED_MIN_ROWS on); config overrides `grouped_config`'s tiles."""
    t, s, k = x.shape
    j = idx.shape[1]
    if k != w.k or idx.shape[0] != t or s not in (1, j):
        raise ValueError(f"expert_matmul: x {list(x.shape)}, choices {list(idx.shape)}, experts [{w.experts}, {w.k}, {w.n}]")
    x = x.contiguous()
    idx = idx.contiguous()
    y = torch.empty((t * j, w.n), dtype=torch.float32, device=x.device)
    if grouped is None:
        grouped = t > 1 and t * j >= GROUPED_MIN_ROWS
    lut = w.lut is not None
    s_t = w.scale if w.scale is not None else w.q
    b_t = w.bias if w.bias is not None else s_t
    lut_t = w.lut if lut else w.q
    if t * j and grouped:
        cfg = {**grouped_config(t * j, w.experts, x.dtype), **(config or {})}
        block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
        ids, tile_expert = group_rows(idx, w.experts, block_m)
        _expert_gemm_kernel[(tile_expert.numel(), triton.cdiv(w.n, block_n))](
            x, ids, tile_expert, w.q, s_t, b_t, lut_t, y,
            t * j, w.n, k, w.q.shape[2], w.experts, j if s == 1 else 1, k, w.q.stride(0), w.q.stride(1),
            s_t.stride(0) if w.scale is not None else 0, s_t.stride(1) if w.scale is not None else 0,
            w.lut_block_k, w.lut_block_n,
            w.lut.stride(0) if lut else 0, w.lut.stride(1) if lut else 0, w.lut.stride(2) if lut else 0,
            BITS=w.bits, LUT=lut, GROUP=w.group, HAS_BIAS=w.bias is not None, SCALED=w.scaled, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32x3", **cfg)
    elif t * j:
        _expert_gemv_kernel[(t * j, triton.cdiv(w.n, BLOCK_N))](
            x, idx, w.q, s_t, b_t, lut_t, y,
            w.n, k, w.q.shape[2], w.experts, j if s == 1 else 1, k, w.q.stride(0), w.q.stride(1),
            s_t.stride(0) if w.scale is not None else 0, s_t.stride(1) if w.scale is not None else 0,
            w.lut_block_k, w.lut_block_n,
            w.lut.stride(0) if lut else 0, w.lut.stride(1) if lut else 0, w.lut.stride(2) if lut else 0,
            BITS=w.bits, LUT=lut, GROUP=w.group, HAS_BIAS=w.bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            SCALED=w.scaled)
    return y.reshape(t, j, w.n).to(x.dtype)
