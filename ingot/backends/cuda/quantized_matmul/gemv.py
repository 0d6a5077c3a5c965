"""The word GEMV's wrapper: tiles and K splits (`words_gemv_config`), x's rounding (its own launch,
another kernel's, or every program its own split), and `rms_norm_matmul`."""
from __future__ import annotations

import os

import torch
import triton

from ....options import DEFAULT_CUDA, CudaOptions
from ....passes.gemv_rules import GATE_ACTIVATIONS
from .. import timeline
from ..pdl import pdl_args
from . import xq as x_quant
from .buffers import _overlaps, _sm_count, _workspace
from .weights import QuantizedWeight
from .xq import NormPrologue, xq_buffers
from .words_kernel import _qgemv_words_kernel

DP4A = os.environ.get("TRITON_INTERPRET") != "1"                          # the interpreter runs no inline PTX

# The word GEMV's tuning (`CudaOptions`), H200. words_max_rows 16: up to 16 rows (4 a program, the weight
# read once per 4 rows) it beats the tensor-core kernel: Llama-3-8B gate+up at 8 and 16 rows 283 us through
# tensor cores, down 452 us, against 37.2 / 21.5 us for one group of 4 rows; the Llama-3-8B step at batch 16
# 8469 us (1889 tok/s) against 31715 (504). gemv_waves 0: split-K to exactly one wave of programs from the
# kernel's registers (about 16 warps at 100 registers): Llama-3-8B gate+up 23.73 us against 24.65 at 32
# warps, down 14.53 against 15.24, the step 2426 us against 2468. gemv_tile_blocks 0 (auto): 1 block of 32
# k a tile for latency-bound GEMVs, whose programs' serial work on x halves (SmolLM2's qkv 702 instructions
# a program instead of 1439), else 2: the SmolLM2 step 840 us against 925 with 2 everywhere. gemv_limbs 2:
# x to 16 bits per block of 32 (2 * limbs dp4a per weight word; 3, 22 bits, is float32-level).
# self_xq_bytes 4 MiB: a word GEMV of a smaller weight rounds its own x (XQ_SELF) where the kernel ahead can
# zero its split-K output, no quantize launch: SmolLM2 qkv with its norm 2.12 us against 3.37, gate+up 2.63 /
# 3.16, down 1.85 / 2.80; Llama-3-8B qkv with its norm 10.31 against 8.50 (every program reads the
# 4096-float row for its rms), down 12.70 / 12.23.
# Measured and removed (git keeps them): an N-loop GEMV (a program per tile of K walking along N), split-K
# by tickets instead of atomics for every shape (REDUCE 2 stays for a residual: Llama-3-8B gate+up 48.0 vs
# 43.4 us, qkv 17.2 vs 12.2), the memset between quantize launch and GEMV instead of the quantize launch
# zeroing y (the Llama-3-8B step 2448 us against 2271), the int-to-float unit instead of exponent bits, and
# float32 scales where float16 is exact.
# Measured and removed (H200, 2026-12-04): a stream-K word GEMV for one row with x pre-quantized (the
# whole GEMV's tiles, in column-block order, cut into equal runs, one per program of one wave, a run
# adding its sums into y where it leaves a column block), so every multiprocessor had the same work
# (gate+up now runs 616 programs, 3 to 5 on a multiprocessor). Llama-3-8B's step 1938.6 us against
# 1793.5 (1941.7 held to 96 registers, 2001.8 to 104; ptxas chose 128 against the split-K's 96); in the
# timeline every GEMV was slower (gate+up 20.99 us against 19.78, down 11.18 / 10.67, qkv 6.35 / 5.66,
# o 4.62 / 2.69) and the tails no shorter (gate+up 2.83 against 1.98).


def resident_programs(regs: int, warps: int) -> int:
    """Programs of `warps` warps at `regs` registers a thread that one Hopper multiprocessor holds at
    once: 64K registers allocated 256 to a warp, at most 64 warps and 32 programs."""
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * warps), 64 // warps, 32))


_WORDS_REGS: dict = {}   # the word GEMV's registers a thread, per compiled variant (from its first launch)


def words_gemv_config(w: QuantizedWeight, m: int, sms: int, waves: int = 32, num_warps: int | None = None,
                      rows: int | None = None, regs: int | None = None, tb: int | str | None = None) -> dict:
    """The word-layout GEMV: a warp's threads side by side along N (4 columns each, one 16-byte load
    per row of a tile), ROWS rows of x per program (default 1: more spilled registers), and
    split-K until about `waves` warps per multiprocessor are resident. waves=0: split-K until the
    programs fill the multiprocessors exactly once at `regs` registers a thread (`resident_programs`;
    32 warps while regs is not known yet). tb: blocks of 32 k a tile (1 or 2); 0, None or "auto": 1 where
    even one tile per program leaves multiprocessors idle (a latency-bound GEMV: each program's serial
    work, x rounded by every thread, halves), else 2."""
    rows = rows or 1   # one row per program (the weight read once per row): 4 rows in registers spilled (406 us vs 155)
    warps = num_warps or (4 if w.n >= 4 * 128 * 16 else (2 if w.n >= 2 * 128 * 8 else 1))
    block_n = 128 * warps
    programs = triton.cdiv(w.n, block_n) * triton.cdiv(m, rows)
    if not tb or tb == "auto":
        tb = 1 if ((waves or 32) * sms) // (programs * warps) > triton.cdiv(w.q.shape[0], 8) else 2
    tb = int(tb)
    tiles = triton.cdiv(w.q.shape[0], 4 * tb)
    if waves == 0 and regs:
        split = max(1, min(resident_programs(regs, warps) * sms // programs, tiles))
    else:
        split = max(1, min(((waves or 32) * sms) // (programs * warps), tiles))
    return dict(BLOCK_N=block_n, TB=tb, ROWS=rows, SPLIT=split, num_warps=warps, PREFETCH=True)


def rounds_own_x(m: int, w: QuantizedWeight, options: CudaOptions = DEFAULT_CUDA) -> bool:
    """Whether the word GEMV of m rows of w rounds its own x by default where its output can come zeroed
    (`_words_gemv`'s XQ_SELF and ZEROED): weights under options.self_xq_bytes that take x pre-quantized."""
    return w.nbytes < options.self_xq_bytes and gemv_takes_xq(m, w, options=options) > 0


def gemv_takes_xq(m: int, w: QuantizedWeight, config: dict | None = None, options: CudaOptions = DEFAULT_CUDA) -> int:
    """The limbs of x's pre-quantization the word GEMV uses for m rows of w by default (0: none, the
    GEMV rounds x itself or another kernel runs): what a kernel ahead of it may store (`xq_buffers`)."""
    config = config or {}
    if not w.words or m > options.gemv_rows:
        return 0
    return config.get("LIMBS", options.gemv_limbs) if config.get("XQ", w.nbytes >= options.xq_min_bytes) else 0


def _words_gemv(x2: torch.Tensor, w: QuantizedWeight, y: torch.Tensor, config: dict, x_gate: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, norm: NormPrologue | None = None, quantize=None,
                zero: torch.Tensor | None = None, options: CudaOptions = DEFAULT_CUDA, activation: str = "silu") -> None:
    """y = x2 @ W (x2 = act(x_gate) * x2 when x_gate is given, act the `activation` silu or gelu_tanh; rms_norm(x2 [+ norm.add]) * norm.weight
    with `norm`; + residual when given).

    config keys override `words_gemv_config`'s choice, and LIMBS (1-3, default options.gemv_limbs) and XQ
    (x quantized by its own launch first; default: weights of options.xq_min_bytes and more), WAVES
    (default options.gemv_waves) and TB (options.gemv_tile_blocks), REDUCE (1: splits added atomically,
    2: by tickets; a residual takes 2). `quantize` replaces
    that launch (`_quantize_x`'s signature and result): a kernel computing x that also stores it rounded.
    XQ_SELF (with XQ, no `quantize`): no quantize launch; every program rounds its own split of x
    (`_qgemv_words_kernel`). ZEROED: y (float32, contiguous) is zero already, the kernel ahead zeroed it
    (`zero`), so split-K adds into it without a memset. `zero` (float32, contiguous, apart from every
    operand): zeroed by this launch, the output of the GEMV after it (`ZEROED`). EARLY_W (default: on
    while a CUDA graph is captured, where the weights are constants prepared before the capture; off
    otherwise): the first weight tile loaded before the wait on the kernel ahead (H200, steps replayed:
    SmolLM2 533.5-534.3 us against 552.4-552.8 without; Llama-3-8B 2001.7 against 2078.7; slower and
    removed: the first tile's scales early too, the loop's scales a tile ahead, weights 2 or 3 tiles ahead)."""
    m = x2.shape[0]
    assert norm is None or (x_gate is None and x2.dtype == torch.float32), "the norm prologue: float32 x, no GLU"
    xq = config.pop("XQ", w.nbytes >= options.xq_min_bytes)
    if "EARLY_W" not in config and x2.is_cuda and torch.cuda.is_current_stream_capturing():
        config["EARLY_W"] = True
    self_round = config.pop("XQ_SELF", False) and xq and quantize is None
    zeroed = config.pop("ZEROED", False)
    # with x pre-quantized, all (<= 4) rows in one program read the weight once: H200, Llama-3-8B
    # gate+up at 4 rows 87.0 us vs 105.4 one row per program (2026-12-03); without, 4 rows spill
    rows = config.get("ROWS") or (min(triton.next_power_of_2(m), 4) if xq else None)
    waves, tb = config.pop("WAVES", options.gemv_waves), config.pop("TB", options.gemv_tile_blocks)
    # EARLY_W is left out of the key: it is set only while a graph is captured, where the variant's first
    # launch is too late to learn its registers (until 2026-12-04 the captured GEMVs split as for 32 warps a
    # multiprocessor: gate+up and down ran in two waves, cuda_timeline.py)
    glu = GATE_ACTIVATIONS[activation] if x_gate is not None else 0     # the kernels' GLU: 0 none, 1 silu, 2 gelu_tanh
    variant = (w.n, m, w.group, w.bias is not None, xq, rows, tb, glu, norm is not None,
               residual is not None, tuple(sorted((k, v) for k, v in config.items() if k != "EARLY_W")))
    cfg = {**words_gemv_config(w, m, _sm_count(x2.device), waves, config.get("num_warps"), rows,
                               _WORDS_REGS.get(variant), tb), **config}
    block_n, tb, rows, split = cfg.pop("BLOCK_N"), cfg.pop("TB"), cfg.pop("ROWS"), cfg.pop("SPLIT")
    limbs = cfg.pop("LIMBS", options.gemv_limbs)
    assert limbs in (1, 2, 3), f"LIMBS={limbs}: x in 1, 2 or 3 bytes"
    kw = w.q.shape[0]
    kw_per_split = triton.cdiv(triton.cdiv(kw, split), 4 * tb) * 4 * tb
    split = triton.cdiv(kw, kw_per_split)
    reduce = (cfg.pop("REDUCE", 1) or 1) if split > 1 else 0
    if residual is not None and reduce == 1:
        reduce = 2
    grid = (triton.cdiv(w.n, block_n), split, triton.cdiv(m, rows))
    target = y
    part, tickets = y, y
    zero_in_xq = False
    if reduce == 1:
        target = y if y.dtype == torch.float32 and y.stride(1) == 1 else torch.empty((m, w.n), dtype=torch.float32,
                                                                                      device=x2.device)
        inputs = (x2, x_gate) + ((norm.add, norm.total, norm.weight) if norm is not None else ())
        zero_in_xq = xq and not self_round and target.is_contiguous() and not _overlaps(target, *inputs)
        if not zero_in_xq and not (zeroed and target is y and y.is_contiguous()):
            target.zero_()
    elif reduce == 2:
        part, tickets = _workspace(x2.device, split * m * w.n, grid[0] * grid[2])
    b = w.bias if w.bias is not None else w.scale
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
        assert not _overlaps(zero, x2, x_gate, y, target, *((norm.add, norm.total, norm.weight) if norm else ()))
        cfg.update(z_ptr=zero, Z=zero.numel(), ZERO=True)
    if self_round:
        cfg.update(xq_buffers(m, w.k, limbs, x2.device, copies=grid[0]), XQ_SELF=True)
        cfg.setdefault("SELF_BLOCKS", 2 * cfg.get("num_warps", 4))
    elif xq:
        if quantize is None:
            cfg.update(x_quant._quantize_x(x2, x_gate, limbs, norm, zero=target if zero_in_xq else None, options=options,
                                           activation=activation))
        else:
            cfg.update(quantize(x2, x_gate, limbs, norm, zero=target if zero_in_xq else None))
        x_gate = norm = None      # applied by the quantize kernel
    gate = x_gate if x_gate is not None else x2
    if norm is not None:
        cfg.update(norm.kernel_args(x2))
        if norm.add is not None:
            gate = norm.add       # the kernel reads x_ptr + x2_ptr
    if x_gate is not None:
        assert x_gate.stride() == x2.stride() and x_gate.shape == x2.shape
        x2, gate = gate, x2       # the kernel reads silu(x_ptr) * x2_ptr
    res = residual if residual is not None else y
    stamps = timeline.args(f"gemv {w.k}x{w.n}", grid[0] * grid[1] * grid[2], x2.device, options.timeline)
    if stamps.get("STAMP") == 1 and _WORDS_REGS.get(variant):
        # end stamps only: held to the registers of the same kernel without them, which its split assumed
        # (ptxas gave the 4-warp kernel with XQ_RMS 142 against 96 for one more store, without spills at 96)
        cfg["maxnreg"] = _WORDS_REGS[variant]
    compiled = _qgemv_words_kernel[grid](
        x2, gate, w.q, w.scale, b, target, res, part, tickets, m, w.n, w.k, kw, kw_per_split, x2.stride(0),
        w.q.stride(0), w.scale.stride(0), target.stride(0), res.stride(0), GROUP=w.group, HAS_BIAS=w.bias is not None,
        ROWS=rows, BLOCK_N=block_n, TB=tb, REDUCE=reduce, ASM=cfg.pop("ASM", DP4A), GLU=glu if x_gate is not None else 0,
        RESIDUAL=residual is not None, LIMBS=limbs, XQ=xq, EVEN_K=w.k == kw * 8 and w.k % (32 * tb) == 0, **cfg,
        **pdl_args(x2.device), **stamps)
    if waves == 0 and not stamps and isinstance(getattr(compiled, "n_regs", None), int):   # none under the interpreter
        _WORDS_REGS[variant] = max(compiled.n_regs, _WORDS_REGS.get(variant, 0))
    if target is not y:
        y.copy_(target)


def rms_norm_matmul(x: torch.Tensor, w: QuantizedWeight, norm_weight: torch.Tensor | None, eps: float,
                    add: torch.Tensor | None = None, config: dict | None = None, zero: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, options: CudaOptions = DEFAULT_CUDA):
    """rms_norm(x [+ add]) * norm_weight @ W in one word-layout GEMV launch (two with XQ), for float32 x
    [..., K] of at most options.gemv_rows rows: the norm is the GEMV's prologue. Returns y [..., N], or
    (x + add, y) with `add` (the sum is stored by the same launch, for the residual stream). `zero`:
    see `_words_gemv`. `out`: y [M, N] (float32, contiguous) to write.

        >>> h, y = rms_norm_matmul(x, w, g, 1e-5, add=attn_out)           # doctest: +SKIP
    """
    assert w.words and x.shape[-1] == w.k and x.dtype == torch.float32, "a word-layout weight and float32 x [..., K]"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k).contiguous()
    m = x2.shape[0]
    assert m <= options.gemv_rows, f"rms_norm_matmul: {m} rows, the word GEMV takes up to {options.gemv_rows}"
    add2 = total = None
    if add is not None:
        assert add.shape == x.shape and add.dtype == torch.float32
        add2 = add.reshape(-1, w.k).contiguous()
        total = torch.empty_like(x2)
    if norm_weight is not None:
        norm_weight = norm_weight.reshape(-1).to(torch.float32).contiguous()
    y = out if out is not None else torch.empty((m, w.n), dtype=torch.float32, device=x.device)
    assert y.shape == (m, w.n) and y.dtype == torch.float32 and y.is_contiguous()
    _words_gemv(x2, w, y, dict(config or {}), norm=NormPrologue(norm_weight, eps, add2, total), zero=zero,
                options=options)
    y = y.reshape(*lead, w.n)
    return (total.reshape(x.shape), y) if add is not None else y

