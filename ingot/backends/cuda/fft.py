"""CUDA lowerings of the FFT ops, and the audio front end (STFT power -> mel): cuFFT, then one generated kernel.

The FFT ops run on cuFFT through torch. A strided input (STFT frames taken by `array_view` with the
hop as the frame stride) goes to cuFFT as it is: cuFFT reads frame f at sample f * hop of the
signal, so the framing stays a view on the device too (torch copies only an input whose start is
not 8-byte aligned).

The mel spectrogram that `ingot.models.audio` builds, per chunk of frames,

    mel = matmul(filters, transpose(abs(rfft(frames * window)) ** 2))      # [n_mels, frames]

would be five device passes over the frames and their spectra. When the window is a cosine sum
(w[n] = a0 - a1 cos(2 pi n / n_fft): Hann, Hamming, boxcar) it is applied after the transform, as a
three-tap filter across bins (X_w[k] = a0 X[k] - a1/2 (X[k-1] + X[k+1]), the spectrum of a real
signal continued by X[-k] = conj X[k]), so the chain becomes

    spectrum = rfft(frames)                    # cuFFT over the strided view of the signal
    mel = unrolled_kernel(spectrum)            # one generated Triton kernel per filter bank: a thread
                                               # per frame walks its bins once (window, |.|^2) and adds
                                               # each bin's power into its bands, weights as constants

Other windows are multiplied in first (torch) and the kernel does |.|^2 alone. The earlier methods
stay selectable for measuring (INGOT_CUDA_AUDIO_MEL): "gemm" (a windowed-power pass, then a float32
cuBLAS projection), "fused" and "stream" (power and projection in one kernel on the tensor cores,
tf32x3); on the H200 the unrolled kernel took 0.39 ms for the hour of 16 kHz audio against 0.38 +
0.46 for "gemm"'s two passes and 0.82 for "stream" (BENCHMARKS.md). The chunks a graph is built in
(for the CPU's memory) are merged again at run time when their frames are adjacent views of one
signal: one cuFFT batch per pass of 2^17 frames, passes alternating over two streams, each written
into its columns of the concatenation. The nodes of the chain are recognised in the lowered program
(`mel_chains`); their steps pass a deferred value along and the matmul step computes the result, so
nothing in between is written to device memory. Any other use of these ops lowers as before.
INGOT_CUDA_AUDIO_FUSION=0 turns the fusion off (each node lowered alone: for measuring what it saves).

    >>> exe = g.compile(targets=[audio.log_mel_spectrogram(g, x)], device="cuda")   # doctest: +SKIP
    >>> exe.plan.fusions                                       # doctest: +SKIP
    ['stft power+mel (hann, 400-point, unrolled)', ...]
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from ...ir import Node, Op, Program
from . import LOWERINGS, Lowering, StepFn, constant_tensor

_FORWARD = {"none": "backward", "size": "forward", "unitary": "ortho"}
_INVERSE = {"none": "forward", "size": "backward", "unitary": "ortho"}


# -- the FFT ops ----------------------------------------------------------------------------------

def fft_lowering(ctx: Lowering) -> StepFn:
    """FFT, IFFT, RFFT, IRFFT through torch.fft (cuFFT); MPSGraph's scaling names mapped to torch's."""
    a = ctx.node.attrs
    axes, norm, op = tuple(a["axes"]), a["norm"], ctx.node.op
    if op == Op.FFT:
        return lambda x: torch.fft.fftn(x, dim=axes, norm=_FORWARD[norm]).to(torch.complex64)
    if op == Op.IFFT:
        return lambda x: torch.fft.ifftn(x, dim=axes, norm=_INVERSE[norm]).to(torch.complex64)
    if op == Op.RFFT:
        if len(axes) == 1:  # the STFT's case: one transform per frame, frames possibly a strided view
            axis = axes[0]
            return lambda x: torch.fft.rfft(x, dim=axis, norm=_FORWARD[norm])
        return lambda x: torch.fft.rfftn(x, dim=axes, norm=_FORWARD[norm])
    s = [ctx.node.type.shape[ax] for ax in axes]
    return lambda x: torch.fft.irfftn(x, s=s, dim=axes, norm=_INVERSE[norm]).to(torch.float32)


# -- the fused kernel -----------------------------------------------------------------------------

@triton.jit
def _power_mel_kernel(spec_ptr, filt_ptr, band_ptr, out_ptr, F, B, M, REFLECT, stride_sf, stride_om, a0, a1_half,
                      WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[m, f] = sum_k filt[m, k] |X_w[f, k]|^2 for one tile of mel bands x frames; X is complex64
    [F, B] read as interleaved float32, X_w its windowed form (WINDOWED) or X itself."""
    pid_m = tl.program_id(0)  # mel tiles vary fastest: the tiles of one block of frames share its rows in L2
    pid_f = tl.program_id(1)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = tl.load(band_ptr + 2 * pid_m)
    hi = tl.load(band_ptr + 2 * pid_m + 1)
    rows = spec_ptr + offs_f[:, None].to(tl.int64) * stride_sf
    f_mask = offs_f[:, None] < F
    m_mask = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32)
    for b0 in range(lo, hi, BLOCK_B):
        k = b0 + tl.arange(0, BLOCK_B)
        k_mask = k < hi
        mask = f_mask & k_mask[None, :]
        re = tl.load(rows + 2 * k[None, :], mask=mask, other=0.0)
        im = tl.load(rows + 2 * k[None, :] + 1, mask=mask, other=0.0)
        if WINDOWED:
            below = tl.where(k == 0, 1, k - 1)               # X[-1] = conj X[1]
            above = tl.where(k == B - 1, REFLECT, k + 1)     # X[B] = conj X[n_fft - B]
            re_below = tl.load(rows + 2 * below[None, :], mask=mask, other=0.0)
            im_below = tl.load(rows + 2 * below[None, :] + 1, mask=mask, other=0.0)
            re_above = tl.load(rows + 2 * above[None, :], mask=mask, other=0.0)
            im_above = tl.load(rows + 2 * above[None, :] + 1, mask=mask, other=0.0)
            im_below = tl.where(k[None, :] == 0, -im_below, im_below)
            im_above = tl.where(k[None, :] == B - 1, -im_above, im_above)
            re = a0 * re - a1_half * (re_below + re_above)
            im = a0 * im - a1_half * (im_below + im_above)
        power = re * re + im * im                                                   # [BLOCK_F, BLOCK_B]
        w = tl.load(filt_ptr + offs_m[None, :] * B + k[:, None], mask=m_mask & k_mask[:, None], other=0.0)
        acc += tl.dot(power, w, input_precision=PRECISION)                          # [BLOCK_F, BLOCK_M]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_f[:, None], acc, mask=f_mask & m_mask)


@triton.jit
def _windowed_power_kernel(spec_ptr, out_ptr, F, B, REFLECT, stride_sf, stride_of, a0, a1_half,
                           WINDOWED: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[f, k] = |X_w[f, k]|^2 (float32 [F, B]) from complex64 X [F, B] read as interleaved float32."""
    offs_f = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    k = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rows = spec_ptr + offs_f[:, None].to(tl.int64) * stride_sf
    mask = (offs_f[:, None] < F) & (k[None, :] < B)
    re = tl.load(rows + 2 * k[None, :], mask=mask, other=0.0)
    im = tl.load(rows + 2 * k[None, :] + 1, mask=mask, other=0.0)
    if WINDOWED:
        below = tl.where(k == 0, 1, k - 1)               # X[-1] = conj X[1]
        above = tl.where(k == B - 1, REFLECT, k + 1)     # X[B] = conj X[n_fft - B]
        re_below = tl.load(rows + 2 * below[None, :], mask=mask, other=0.0)
        im_below = tl.load(rows + 2 * below[None, :] + 1, mask=mask, other=0.0)
        re_above = tl.load(rows + 2 * above[None, :], mask=mask, other=0.0)
        im_above = tl.load(rows + 2 * above[None, :] + 1, mask=mask, other=0.0)
        im_below = tl.where(k[None, :] == 0, -im_below, im_below)
        im_above = tl.where(k[None, :] == B - 1, -im_above, im_above)
        re = a0 * re - a1_half * (re_below + re_above)
        im = a0 * im - a1_half * (im_below + im_above)
    tl.store(out_ptr + offs_f[:, None].to(tl.int64) * stride_of + k[None, :], re * re + im * im, mask=mask)


@triton.jit
def _spectrum_mel_kernel(spec_ptr, filt_ptr, out_ptr, F, B, stride_sf, stride_om, a0, a1_half,
                         WINDOWED: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr, M: tl.constexpr,
                         BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, B_PAD: tl.constexpr):
    """out[m, f] = sum_k filt_t[k, m] |X_w[f, k]|^2 for BLOCK_F frames, every bin and every mel band:
    the spectrum rows are read once, as contiguous interleaved (re, im) pairs, in BLOCK_B-bin chunks.

    X_w, the spectrum of the windowed frame, is a0 X[k] - a1/2 (X[k-1] + X[k+1]); its neighbours are
    the same rows read one pair earlier and later (L1 hits), with the ends continued as the spectrum
    of a real signal is: X[-1] = conj X[1], X[B] = conj X[B-2] (even n_fft) or conj X[B-1] (odd).
    filt_t is the filter bank transposed and zero-padded to [B_PAD, BLOCK_M]."""
    offs_f = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = offs_f[:, None] < F
    rows = spec_ptr + offs_f[:, None].to(tl.int64) * stride_sf
    pair = tl.arange(0, 2 * BLOCK_B)                                                  # interleaved re, im
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32)
    for b0 in tl.static_range(0, B_PAD, BLOCK_B):
        at = 2 * b0 + pair
        mask = f_mask & (at < 2 * B)[None, :]
        x = tl.reshape(tl.load(rows + at[None, :], mask=mask, other=0.0), (BLOCK_F, BLOCK_B, 2))
        re, im = tl.split(x)                                                          # [BLOCK_F, BLOCK_B]
        if WINDOWED:
            k = b0 + tl.arange(0, BLOCK_B)[None, :]
            below_ok = f_mask & ((at >= 2) & (at < 2 * B + 2))[None, :]
            above_ok = f_mask & (at + 2 < 2 * B)[None, :]
            xb = tl.reshape(tl.load(rows + at[None, :] - 2, mask=below_ok, other=0.0), (BLOCK_F, BLOCK_B, 2))
            xa = tl.reshape(tl.load(rows + at[None, :] + 2, mask=above_ok, other=0.0), (BLOCK_F, BLOCK_B, 2))
            re_b, im_b = tl.split(xb)
            re_a, im_a = tl.split(xa)
            first = k == 0                                      # X[-1] = conj X[1], X[1] is "above" here
            re_b = tl.where(first, re_a, re_b)
            im_b = tl.where(first, -im_a, im_b)
            last = k == B - 1                                   # X[B] = conj X[n_fft - B]
            if EVEN:
                re_a = tl.where(last, re_b, re_a)
                im_a = tl.where(last, -im_b, im_a)
            else:
                re_a = tl.where(last, re, re_a)
                im_a = tl.where(last, -im, im_a)
            re, im = a0 * re - a1_half * (re_b + re_a), a0 * im - a1_half * (im_b + im_a)
        power = re * re + im * im                                                     # [BLOCK_F, BLOCK_B]
        k_rows = b0 + tl.arange(0, BLOCK_B)
        w = tl.load(filt_ptr + k_rows[:, None] * BLOCK_M + offs_m[None, :])          # zero-padded: no mask
        acc += tl.dot(power, w, input_precision=PRECISION)
    out = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_f[:, None]
    tl.store(out, acc, mask=f_mask & (offs_m[None, :] < M))


# -- the unrolled kernel: the filter bank compiled into the code -----------------------------------

class _Bank:
    """What the generated mel kernels need to know of a filter bank: its shape, the window's taps
    (a0, a1 / 2; none when the window is already applied or a boxcar), and each band's first and last
    non-zero bin (-1: an empty band)."""

    def __init__(self, filters: np.ndarray, n_fft: int, cosine: tuple[float, float] | None):
        self.filters = np.asarray(filters, np.float32)
        self.n_mels, self.bins = self.filters.shape
        assert self.bins == n_fft // 2 + 1 and self.bins >= 2, (self.filters.shape, n_fft)
        self.windowed = cosine is not None and cosine[1] != 0.0
        self.a0, self.a1_half = (float(np.float32(cosine[0])), float(np.float32(cosine[1] / 2))) if self.windowed \
            else (1.0, 0.0)
        self.nonzero = self.filters != 0
        self.first = [int(np.argmax(row)) if row.any() else -1 for row in self.nonzero]
        self.last = [self.bins - 1 - int(np.argmax(row[::-1])) if row.any() else -1 for row in self.nonzero]

    def parts(self) -> tuple:
        return (self.filters, self.n_mels, self.bins, self.windowed, self.a0, self.a1_half, self.nonzero, self.first,
                self.last)

    def empty_band_stores(self, epilogue: str) -> list[str]:
        """Source lines storing the epilogue of 0 for the bands with no non-zero weight."""
        zeros = epilogue.replace("@v", "tl.zeros([BLOCK_F], tl.float32)")
        return [f"    tl.store(out + {m} * stride_om, {zeros}, mask=ok)" for m in range(self.n_mels) if self.first[m] < 0]


def unrolled_source(filters: np.ndarray, n_fft: int, cosine: tuple[float, float] | None, lookahead: int = 1,
                    epilogue: str = "@v") -> str:
    """Source of a Triton kernel for one filter bank, `mel_kernel(spec_ptr, w_ptr, out_ptr, F,
    stride_om, BLOCK_F)`: out[m, f] = sum_k filters[m, k] |X_w[f, k]|^2 (w_ptr, the filters, unused here).

    Each thread takes a frame and walks its bins once, in order: one 8-byte (re, im) load per bin, the
    window as three taps over bins already loaded, and each bin's power added into the few bands it
    feeds (a Slaney or HTK bank: at most two), the weights written in as constants. A band is stored
    as soon as its last bin is in, so a handful of accumulators are live at any time. No tensor
    cores, no zero weights, and the power never goes to memory: the spectrum is read once. Each
    bin's load is written `lookahead` bins before its use (more loads in flight per thread).
    `epilogue`: an expression of the band's value `@v` stored in its place (the dB scale that follows
    the mel in a log-mel graph: tl.log(tl.maximum(@v, 1e-10)) * 4.34...)."""
    bank = _Bank(filters, n_fft, cosine)
    filters, n_mels, bins, windowed, a0, a1_half, nonzero, first, last = bank.parts()
    lines = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
             "def mel_kernel(spec_ptr, w_ptr, out_ptr, F, stride_om, BLOCK_F: tl.constexpr):",
             f'    """{n_mels} mel bands of the {n_fft}-point spectrum, '
             f'{"window a0 %r, a1 %r" % (cosine[0], cosine[1]) if windowed else "no window"}: generated."""',
             "    f = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)",
             "    ok = f < F",
             "    pair_ok = ok[:, None]",
             f"    rows = spec_ptr + f.to(tl.int64)[:, None] * {2 * bins} + tl.arange(0, 2)[None, :]",
             "    out = out_ptr + f.to(tl.int64)"]
    lines += bank.empty_band_stores(epilogue)
    loaded = set()

    def load(k: int) -> None:
        if k not in loaded and 0 <= k < bins:
            loaded.add(k)
            lines.append(f"    r{k}, i{k} = tl.split(tl.load(rows + {2 * k}, mask=pair_ok, other=0.0))")

    def raw(j: int) -> tuple[str, str]:   # X[j] for j in [-1, bins]: a real signal's spectrum continued
        if j == -1:
            return "r1", "(-i1)"
        if j == bins:
            return f"r{n_fft - bins}", f"(-i{n_fft - bins})"
        return f"r{j}", f"i{j}"

    for k in range(bins):
        for j in range(k, k + max(1, lookahead) + 1):
            load(j)
        if windowed:
            (rb, ib), (ra, ia) = raw(k - 1), raw(k + 1)
            lines.append(f"    wr = {a0!r} * r{k} - {a1_half!r} * ({rb} + {ra})")
            lines.append(f"    wi = {a0!r} * i{k} - {a1_half!r} * ({ib} + {ia})")
            lines.append("    p = wr * wr + wi * wi")
        else:
            lines.append(f"    p = r{k} * r{k} + i{k} * i{k}")
        for m in np.nonzero(nonzero[:, k])[0]:
            w = float(filters[m, k])
            lines.append(f"    a{m} = p * {w!r}" if k == first[m] else f"    a{m} += p * {w!r}")
            if k == last[m]:
                lines.append(f"    tl.store(out + {m} * stride_om, {epilogue.replace('@v', f'a{m}')}, mask=ok)")
    return "\n".join(lines) + "\n"


# "unrolled" kernel: frames per program, warps, bins loaded ahead (H200, the hour's log-mel through the
# graph: 1.375 ms with loads 16 bins ahead, 1.389 with 8, 1.428 with 1; 128 frames / 4 warps as fast as
# any other tile measured, 2 frames per thread 40 % slower; a frame's bins spread over 8 or 16 threads,
# so that a warp load touches fewer frames' cache lines, 1.725 / 1.792 ms against 1.363, 2026-12-03:
# benchmarks/audio.py)
UNROLLED_CONFIG = dict(block_f=int(os.environ.get("INGOT_CUDA_MEL_UNROLLED_F", "128")),
                       num_warps=int(os.environ.get("INGOT_CUDA_MEL_UNROLLED_WARPS", "4")),
                       lookahead=int(os.environ.get("INGOT_CUDA_MEL_UNROLLED_AHEAD", "16")))


def unrolled_kernel(filters: np.ndarray, n_fft: int, cosine: tuple[float, float] | None, lookahead: int | None = None,
                    epilogue: str = "@v"):
    """The compiled-in kernel for this bank, window and epilogue (generated once per process and cached
    on disk by its source, like the fused regions)."""
    from .fused import _load_kernel
    ahead = UNROLLED_CONFIG["lookahead"] if lookahead is None else lookahead
    return _load_kernel(unrolled_source(filters, n_fft, cosine, ahead, epilogue), "mel_kernel")


def _spectrum_and_out(spectrum: torch.Tensor, projection: "MelProjection", out: torch.Tensor | None):
    """The spectrum as rows of interleaved (re, im) a kernel reads, and the [n_mels, frames] result
    (`out`, checked: unit frame stride, or a new tensor)."""
    assert spectrum.dtype == torch.complex64 and spectrum.ndim == 2, spectrum.shape
    frames, bins = spectrum.shape
    n_mels = projection.filters.shape[0]
    assert bins == projection.n_fft // 2 + 1
    if spectrum.stride() != (bins, 1):
        spectrum = spectrum.contiguous()
    if out is None:
        out = torch.empty((n_mels, frames), dtype=torch.float32, device=spectrum.device)
    assert out.shape == (n_mels, frames) and (frames <= 1 or out.stride(1) == 1), (out.shape, out.stride())
    return spectrum, out


def unrolled_mel(spectrum: torch.Tensor, projection: "MelProjection", out: torch.Tensor | None = None,
                 block_f: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """filters @ |window(spectrum)|^2.T through the projection's unrolled kernel: complex64 [frames,
    bins] -> float32 [n_mels, frames], into `out` (any [n_mels, frames] view with unit frame stride)."""
    assert projection.unrolled is not None, "unrolled_mel: the projection has no unrolled kernel"
    spectrum, out = _spectrum_and_out(spectrum, projection, out)
    frames = spectrum.shape[0]
    if frames == 0:
        return out
    kernel = projection.unrolled
    block_f = block_f or UNROLLED_CONFIG["block_f"]
    kernel[(triton.cdiv(frames, block_f),)](torch.view_as_real(spectrum), projection.filters, out, frames, out.stride(0),
                                            BLOCK_F=block_f, num_warps=num_warps or UNROLLED_CONFIG["num_warps"])
    return out


@dataclass(frozen=True)
class MelProjection:
    """What the kernel needs besides the spectrum: the filters [n_mels, bins] on the device, each
    mel tile's non-zero bin range, the window as cosine-sum coefficients (None: already applied)."""
    filters: torch.Tensor
    bands: torch.Tensor
    n_fft: int
    cosine: tuple[float, float] | None
    block_m: int = 16
    method: str = "gemm"    # "unrolled" (mel_chains' default): the generated kernel in `unrolled`; "gemm": power
                            # kernel + cuBLAS; "stream": one kernel per block of frames (every bin, every band,
                            # tf32x3); "fused": one kernel per mel tile and block of frames
    host_bands: tuple[tuple[int, int], ...] = ()   # `bands` on the host: "gemm" multiplies each tile's band alone
    filters_t: torch.Tensor | None = None          # [bins padded, mels padded] for "stream" (transposed_filters)
    unrolled: object = field(default=None, compare=False)   # the "unrolled" method's kernel (unrolled_kernel)
    epilogue: str = "@v"                                    # what `unrolled` stores of each band value @v


def transposed_filters(filters: np.ndarray | torch.Tensor, device=None) -> torch.Tensor:
    """The [n_mels, bins] bank as the "stream" kernel reads it: [bins rounded up to 128, n_mels rounded
    up to a power of two >= 16], zeros outside."""
    f = torch.as_tensor(np.asarray(filters.cpu() if isinstance(filters, torch.Tensor) else filters, np.float32))
    n_mels, bins = f.shape
    out = torch.zeros((triton.cdiv(bins, 128) * 128, max(16, triton.next_power_of_2(n_mels))), dtype=torch.float32)
    out[:bins, :n_mels] = f.T
    return out.to(device if device is not None else (filters.device if isinstance(filters, torch.Tensor) else "cpu"))


# "stream" tiles, measured on the H200 for the hour of 16 kHz audio (benchmarks/audio.py)
STREAM_CONFIG = dict(block_f=int(os.environ.get("INGOT_CUDA_MEL_F", "32")), block_b=int(os.environ.get("INGOT_CUDA_MEL_B", "32")),
                     num_warps=int(os.environ.get("INGOT_CUDA_MEL_WARPS", "4")), num_stages=1,
                     precision=os.environ.get("INGOT_CUDA_MEL_PRECISION", "tf32x3"))


def spectrum_mel(spectrum: torch.Tensor, projection: MelProjection, out: torch.Tensor | None = None,
                 precision: str | None = None, block_f: int | None = None, block_b: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """filters @ |window(spectrum)|^2.T in one pass over the spectrum: complex64 [frames, bins] ->
    float32 [n_mels, frames], written into `out` (any [n_mels, frames] view with unit frame stride)
    when given. precision "tf32x3" (default) keeps float32 accuracy on the tensor cores."""
    cfg = STREAM_CONFIG
    precision, block_f, block_b = precision or cfg["precision"], block_f or cfg["block_f"], block_b or cfg["block_b"]
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    spectrum, out = _spectrum_and_out(spectrum, projection, out)
    frames, bins = spectrum.shape
    n_mels = projection.filters.shape[0]
    filters_t = projection.filters_t
    if filters_t is None:
        filters_t = transposed_filters(projection.filters)
    b_pad = triton.cdiv(bins, block_b) * block_b
    assert filters_t.shape[0] >= b_pad and filters_t.shape[1] >= n_mels, (filters_t.shape, b_pad, n_mels)
    if frames == 0:
        return out
    a0, a1 = projection.cosine if projection.cosine is not None else (1.0, 0.0)
    _spectrum_mel_kernel[(triton.cdiv(frames, block_f),)](
        torch.view_as_real(spectrum), filters_t, out, frames, bins, 2 * bins, out.stride(0), a0, a1 / 2,
        WINDOWED=projection.cosine is not None and a1 != 0.0, EVEN=projection.n_fft % 2 == 0, PRECISION=precision,
        M=n_mels, BLOCK_F=block_f, BLOCK_B=block_b, BLOCK_M=filters_t.shape[1], B_PAD=b_pad,
        num_warps=num_warps, num_stages=num_stages)
    return out


def mel_bands(filters: np.ndarray, block_m: int) -> np.ndarray:
    """[tiles, 2] int32: for each tile of block_m mel rows, the bins [lo, hi) holding its non-zeros."""
    bands = []
    for m0 in range(0, filters.shape[0], block_m):
        cols = np.nonzero(np.any(filters[m0:m0 + block_m] != 0, axis=0))[0]
        bands.append((int(cols[0]), int(cols[-1]) + 1) if cols.size else (0, 0))
    return np.asarray(bands, np.int32).reshape(-1, 2)


def cosine_window(window: np.ndarray) -> tuple[float, float] | None:
    """(a0, a1) when window[n] == a0 - a1 cos(2 pi n / N) for its length N >= 3 (a periodic Hann,
    Hamming or boxcar), to float32 precision; None otherwise."""
    w = np.asarray(window, np.float64)
    n = w.shape[-1]
    if w.ndim != 1 or n < 3:
        return None
    cos = np.cos(2 * np.pi * np.arange(n) / n)
    a0, a1 = float(w.mean()), float(-2.0 * (w * cos).mean())
    if np.abs(w - (a0 - a1 * cos)).max() > 1e-6 * max(np.abs(w).max(), 1e-30):
        return None
    return a0, a1


def power_mel(spectrum: torch.Tensor, projection: MelProjection, precision: str = "tf32x3",
              block_f: int = 128, block_b: int = 16, num_warps: int = 8, num_stages: int = 1) -> torch.Tensor:
    """filters @ |window(spectrum)|^2.T: complex64 [frames, bins] -> float32 [n_mels, frames]."""
    filters = projection.filters
    assert spectrum.dtype == torch.complex64 and spectrum.ndim == 2, spectrum.shape
    frames, bins = spectrum.shape
    n_mels = filters.shape[0]
    assert filters.shape == (n_mels, bins) and filters.is_contiguous(), (filters.shape, bins)
    assert bins == projection.n_fft // 2 + 1
    if spectrum.stride() != (bins, 1):
        spectrum = spectrum.contiguous()
    interleaved = torch.view_as_real(spectrum)                                   # [frames, bins, 2] float32
    out = torch.empty((n_mels, frames), dtype=torch.float32, device=spectrum.device)
    if frames == 0:
        return out
    a0, a1 = projection.cosine if projection.cosine is not None else (1.0, 0.0)
    grid = (triton.cdiv(n_mels, projection.block_m), triton.cdiv(frames, block_f))
    _power_mel_kernel[grid](interleaved, filters, projection.bands, out, frames, bins, n_mels,
                            projection.n_fft - bins, 2 * bins, out.stride(0), a0, a1 / 2,
                            WINDOWED=projection.cosine is not None and a1 != 0.0, PRECISION=precision,
                            BLOCK_F=block_f, BLOCK_B=block_b, BLOCK_M=projection.block_m,
                            num_warps=num_warps, num_stages=num_stages)
    return out


def windowed_power(spectrum: torch.Tensor, n_fft: int, cosine: tuple[float, float] | None,
                   block_f: int = 8, block_b: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """|window(spectrum)|^2: complex64 [frames, bins] -> float32 [frames, bins] in one pass."""
    assert spectrum.dtype == torch.complex64 and spectrum.ndim == 2, spectrum.shape
    frames, bins = spectrum.shape
    assert bins == n_fft // 2 + 1
    if spectrum.stride() != (bins, 1):
        spectrum = spectrum.contiguous()
    out = torch.empty((frames, bins), dtype=torch.float32, device=spectrum.device)
    if frames == 0:
        return out
    block_b = block_b or min(256, triton.next_power_of_2(bins))
    a0, a1 = cosine if cosine is not None else (1.0, 0.0)
    grid = (triton.cdiv(frames, block_f), triton.cdiv(bins, block_b))
    _windowed_power_kernel[grid](torch.view_as_real(spectrum), out, frames, bins, n_fft - bins, 2 * bins, bins,
                                 a0, a1 / 2, WINDOWED=cosine is not None and a1 != 0.0,
                                 BLOCK_F=block_f, BLOCK_B=block_b, num_warps=num_warps)
    return out


# The projection tile by tile (5 GEMMs for 80 mels) beat one dense GEMM on the H200 for 360,001
# frames (0.34 vs 0.46 ms); for the default chunks (~10k frames) five launches per chunk may cost
# more than they save (not measured), so those keep the one dense GEMM.
BANDED_MIN_FRAMES = 100_000


def mel_of_spectrum(spectrum: torch.Tensor, projection: MelProjection, out: torch.Tensor | None = None) -> torch.Tensor:
    """filters @ |window(spectrum)|^2.T by the projection's method: complex64 [frames, bins] ->
    float32 [n_mels, frames] (into `out` when given). "gemm" is float32 cuBLAS (TF32 only if the
    caller allowed it globally through torch.backends.cuda.matmul.allow_tf32)."""
    if projection.method == "stream":
        return spectrum_mel(spectrum, projection, out)
    if projection.method == "unrolled":
        return unrolled_mel(spectrum, projection, out)
    if out is not None:
        out.copy_(mel_of_spectrum(spectrum, projection))
        return out
    if projection.method == "fused":
        return power_mel(spectrum, projection)
    power = windowed_power(spectrum, projection.n_fft, projection.cosine)        # [frames, bins]
    filters = projection.filters
    if not projection.host_bands or power.shape[0] < BANDED_MIN_FRAMES:
        return torch.matmul(filters, power.T)
    out = torch.empty((filters.shape[0], power.shape[0]), dtype=torch.float32, device=power.device)
    for tile, (lo, hi) in enumerate(projection.host_bands):  # each tile of mel rows over its non-zero bins only
        rows = slice(tile * projection.block_m, (tile + 1) * projection.block_m)
        if hi > lo:
            torch.mm(filters[rows, lo:hi], power[:, lo:hi].T, out=out[rows])
        else:
            out[rows].zero_()
    return out


def mel_of_frames(frames: torch.Tensor, projection: MelProjection, out: torch.Tensor | None = None) -> torch.Tensor:
    """[frames, n_fft] (a strided view of the signal, windowed already unless projection.cosine)
    -> mel [n_mels, frames]: cuFFT, then the window in frequency, power and the mel projection."""
    return mel_of_spectrum(torch.fft.rfft(frames, dim=-1), projection, out)


# Frames per cuFFT batch and kernel launch once chunks are merged: the complex spectrum of this many
# 400-point frames is 211 MB, so the hour of 16 kHz audio takes three passes (benchmarks/audio.py)
PASS_FRAMES = int(os.environ.get("INGOT_CUDA_MEL_PASS_FRAMES", str(1 << 17)))


# >= 2: passes spread over that many streams (H200, the hour: "gemm" 2.04 ms on one stream, 1.95 on two)
STREAMS = int(os.environ.get("INGOT_CUDA_MEL_STREAMS", "2"))
_SIDE: dict = {}


def _side_streams(device, n: int) -> list:
    key = (str(device), n)
    if key not in _SIDE:
        _SIDE[key] = [torch.cuda.Stream(device) for _ in range(n)]
    return _SIDE[key]


def merged_views(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive [count, n_fft] frame views of one signal joined into one view when each starts
    where the previous one's frames leave off (same storage, same strides): the chunks a graph was
    built with (for the CPU's memory) become one cuFFT batch and one kernel launch on the device."""
    merged: list[torch.Tensor] = []
    for v in views:
        if merged:
            a = merged[-1]
            if (a.dim() == 2 and v.dim() == 2 and a.stride() == v.stride() and a.shape[1] == v.shape[1]
                    and a.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                    and v.storage_offset() == a.storage_offset() + a.shape[0] * a.stride(0)):
                merged[-1] = a.as_strided((a.shape[0] + v.shape[0], a.shape[1]), a.stride(), a.storage_offset())
                continue
        merged.append(v)
    return merged


def concatenated_mel(deferred: "list[Deferred]", projection: MelProjection) -> torch.Tensor:
    """The concatenation of the chains' mels [n_mels, sum of frames], each run of adjacent chunks
    computed as one and written straight into its columns (no per-chunk result, no concatenation)."""
    views = merged_views([d.frames for d in deferred])
    total = sum(v.shape[0] for v in views)
    out = torch.empty((projection.filters.shape[0], total), dtype=torch.float32, device=views[0].device)
    pieces, col, step = [], 0, max(1, PASS_FRAMES)
    for v in views:
        for start in range(0, v.shape[0], step):  # bounded temporaries: the spectrum of `step` frames at most
            piece = v[start:start + step]
            pieces.append((piece, out[:, col:col + piece.shape[0]]))
            col += piece.shape[0]
    if STREAMS < 2 or len(pieces) < 2 or out.device.type != "cuda":
        for piece, columns in pieces:
            mel_of_frames(piece, projection, columns)
        return out
    # pieces alternate over side streams, so one piece's cuFFT overlaps another's kernels (neither
    # alone fills the memory system); forked from and joined to the caller's stream (graph capture too)
    main = torch.cuda.current_stream(out.device)
    side = _side_streams(out.device, STREAMS)
    start = torch.cuda.Event()
    start.record(main)
    for i, (piece, columns) in enumerate(pieces):
        s = side[i % len(side)]
        s.wait_event(start)
        with torch.cuda.stream(s):
            mel_of_frames(piece, projection, columns)
    for s in side:
        done = torch.cuda.Event()
        done.record(s)
        main.wait_event(done)
    return out


# -- recognising the mel chain in a lowered program -----------------------------------------------

@dataclass(frozen=True)
class Role:
    """A node's part in a mel chain: 'window', 'rfft', 'abs', 'square', 'transpose' pass a deferred
    value on; 'mel' (the matmul) computes. `reads` are the source indices the step takes."""
    part: str
    reads: tuple[int, ...]
    projection: MelProjection | None = None
    deferred: bool = False   # 'mel': leave the result to the CONCAT that takes every chunk ('concat')


@dataclass
class Deferred:
    """Frames whose window, transform and power a later mel step computes."""
    frames: torch.Tensor


_CHAINS: "weakref.WeakKeyDictionary[object, dict[int, Role]]" = weakref.WeakKeyDictionary()


def _constant(program: Program, node: Node) -> np.ndarray | None:
    return program.constants[node.attrs["key"]] if node.op == Op.CONSTANT else None


def mel_chains(program: Program, device) -> dict[int, Role]:
    """node id -> Role for every matmul(filters, transpose(|rfft(frames [* window])|^2)) in the program
    whose inner nodes have no other reader. The program as `ingot.models.audio` leaves it after the
    passes (CSE has made the two abs one node)."""
    nodes = program.nodes()
    users: dict[int, set[int]] = {}
    for n in nodes:
        for s in n.src:
            users.setdefault(s.id, set()).add(n.id)
    roots = {n.id for n in program.roots}

    def only_for(inner: Node, user: Node) -> bool:
        return inner.id not in roots and users.get(inner.id) == {user.id}

    roles: dict[int, Role] = {}
    projections: dict[tuple, MelProjection] = {}   # one per filter bank, window and n_fft
    hosts: dict[tuple, np.ndarray] = {}
    for mm in nodes:
        if mm.op != Op.MATMUL or len(mm.src) != 2 or mm.type.rank != 2 or mm.dtype.name != "float32":
            continue
        filters_node, transpose = mm.src
        filters = _constant(program, filters_node)
        if filters is None or filters.ndim != 2 or filters.dtype != np.float32:
            continue
        swaps = (transpose.op == Op.TRANSPOSE and tuple(transpose.attrs["perm"]) == (1, 0)) or \
            (transpose.op == Op.RESHAPE and transpose.type.rank == 2 and transpose.src[0].type.rank == 2 and
             transpose.src[0].type.shape[0] == 1 and tuple(transpose.type.shape) == tuple(transpose.src[0].type.shape)[::-1])
        if not swaps or not only_for(transpose, mm):   # a transpose, or the reshape that stands for one (one frame)
            continue
        square = transpose.src[0]
        if square.op != Op.MUL or square.src[0] is not square.src[1] or not only_for(square, transpose):
            continue
        magnitude = square.src[0]
        if magnitude.op != Op.ABS or not only_for(magnitude, square):
            continue
        spectrum = magnitude.src[0]
        if spectrum.op != Op.RFFT or spectrum.type.rank != 2 or tuple(spectrum.attrs["axes"]) != (1,) \
                or spectrum.attrs["norm"] != "none" or not only_for(spectrum, magnitude):
            continue
        frames = spectrum.src[0]
        n_fft = frames.type.shape[1]
        if filters.shape[1] != n_fft // 2 + 1:
            continue
        cosine = None
        if frames.op == Op.MUL and only_for(frames, spectrum):
            which = [i for i in (0, 1) if (w := _constant(program, frames.src[i])) is not None and w.shape == (n_fft,)]
            view_index = 1 - which[0] if which else None
            if which and frames.src[view_index].type.shape == frames.type.shape:
                cosine = cosine_window(_constant(program, frames.src[which[0]]))
                if cosine is not None:
                    roles[frames.id] = Role("window", (view_index,))
        key = (filters_node.id, n_fft, cosine)
        hosts[key] = filters
        projection = projections.get(key)
        if projection is None:
            bands = mel_bands(filters, 16)
            method = os.environ.get("INGOT_CUDA_AUDIO_MEL", "unrolled")
            projection = projections[key] = MelProjection(
                constant_tensor(filters, device), torch.as_tensor(bands, device=device), n_fft, cosine, method=method,
                host_bands=tuple((int(lo), int(hi)) for lo, hi in bands), filters_t=transposed_filters(filters, device),
                unrolled=unrolled_kernel(filters, n_fft, cosine) if method == "unrolled" else None)
        roles.update({spectrum.id: Role("rfft", (0,)), magnitude.id: Role("abs", (0,)),
                      square.id: Role("square", (0,)), transpose.id: Role("transpose", (0,)),
                      mm.id: Role("mel", (1,), projection)})
    for cat in nodes:  # the chunks of one signal, concatenated along frames: computed together by the concat
        if cat.op != Op.CONCAT or cat.type.rank != 2 or cat.attrs["axis"] not in (1, -1):
            continue
        parts = [roles.get(s.id) for s in cat.src]
        if not all(r is not None and r.part == "mel" and only_for(s, cat) for r, s in zip(parts, cat.src)) \
                or len({id(r.projection) for r in parts}) != 1:
            continue
        for s, r in zip(cat.src, parts):
            roles[s.id] = Role("mel", r.reads, r.projection, deferred=True)
        roles[cat.id] = Role("concat", tuple(range(len(cat.src))), parts[0].projection)
    if os.environ.get("INGOT_CUDA_MEL_EPILOGUE", "1") == "1":
        by_id = {n.id: n for n in nodes}
        region_of = {i: set(region) for region in getattr(program, "regions", ()) for i in region}
        for node_id, role in list(roles.items()):
            computes = role.part == "concat" or (role.part == "mel" and not role.deferred)
            if not computes or role.projection.method != "unrolled":
                continue
            tail, expr = _epilogue(program, by_id[node_id], by_id, users, roots, region_of)
            if not tail:
                continue
            p = role.projection
            key = next(k for k, v in projections.items() if v is p)
            kernel = unrolled_kernel(hosts[key], p.n_fft, p.cosine, epilogue=expr)
            roles[node_id] = Role(role.part, role.reads, replace(p, unrolled=kernel, epilogue=expr), role.deferred)
            roles.update({t.id: Role("epilogue", (index,)) for t, index in tail})
    return roles


_EPILOGUE_OPS = (Op.MAXIMUM, Op.MINIMUM, Op.LOG, Op.MUL, Op.ADD, Op.SUB, Op.DIV)


def _epilogue(program: Program, start: Node, by_id: dict, users: dict, roots: set,
              region_of: dict) -> tuple[list[tuple[Node, int]], str]:
    """The float32 elementwise nodes that follow the mel (`start`), each the only reader of the one
    before and with a scalar constant as its other operand (log: none), with the index of the value
    among its sources, and what they compute as an expression of `@v`; whole fusion regions only (a
    region cut in two would read the dB values as mels)."""
    from .fused import _FLOAT_EXPR
    tail, exprs, x, expr = [], [], start, "@v"
    while x.id not in roots and len(users.get(x.id, ())) == 1:
        u = by_id[next(iter(users[x.id]))]
        if u.op not in _EPILOGUE_OPS or u.dtype.name != "float32" or u.type.shape != x.type.shape:
            break
        if u.op == Op.LOG:
            if len(u.src) != 1:
                break
            expr = _FLOAT_EXPR[Op.LOG].format(expr)
        else:
            if len(u.src) != 2 or u.src[0] is u.src[1]:
                break
            other = u.src[1] if u.src[0] is x else u.src[0]
            c = _constant(program, other)
            if c is None or c.size != 1:
                break
            literal = repr(float(np.float32(c.reshape(()))))
            expr = _FLOAT_EXPR[u.op].format(*((expr, literal) if u.src[0] is x else (literal, expr)))
        tail.append((u, 0 if u.src[0] is x else 1))
        exprs.append(expr)
        x = u
    ids = {t.id for t, _ in tail}
    while tail and not all(region_of.get(t.id, {t.id}) <= ids for t, _ in tail):   # whole regions only
        ids.discard(tail.pop()[0].id)
        exprs.pop()
    return tail, exprs[-1] if exprs else "@v"


def plan_roles(plan) -> dict[int, Role]:
    """mel_chains of a CudaPlan's program, computed once per plan ({} with INGOT_CUDA_AUDIO_FUSION=0)."""
    if os.environ.get("INGOT_CUDA_AUDIO_FUSION", "1") != "1":
        return {}
    roles = _CHAINS.get(plan)
    if roles is None:
        roles = _CHAINS[plan] = mel_chains(plan.program, plan.device)
    return roles


def _roles(ctx: Lowering) -> dict[int, Role]:
    return plan_roles(ctx.plan)


def _window_name(cosine: tuple[float, float] | None) -> str:
    if cosine is None:
        return "window applied first"
    a0, a1 = cosine
    names = {(0.5, 0.5): "hann", (0.54, 0.46): "hamming", (1.0, 0.0): "boxcar"}
    return next((name for (b0, b1), name in names.items() if math.isclose(a0, b0, abs_tol=1e-6)
                 and math.isclose(a1, b1, abs_tol=1e-6)), f"cosine {a0:.3g}, {a1:.3g}")


def _chain_step(role: Role, ctx: Lowering) -> StepFn:
    ctx.reads = role.reads
    if role.part == "window":
        return lambda frames: Deferred(frames)
    if role.part == "rfft":
        return lambda frames: frames if isinstance(frames, Deferred) else Deferred(frames)
    if role.part in ("abs", "square", "transpose", "epilogue"):
        return lambda deferred: deferred
    projection = role.projection
    plan = ctx.plan
    if projection.epilogue != "@v" and hasattr(plan, "fusions"):
        plan.fusions.append(f"mel epilogue {projection.epilogue.replace('@v', 'mel')}")
    if role.part == "concat":
        return lambda *deferred: concatenated_mel(list(deferred), projection)
    if hasattr(plan, "fusions"):
        plan.fusions.append(f"stft power+mel ({_window_name(projection.cosine)}, {projection.n_fft}-point, "
                            f"{projection.method})")
    if role.deferred:
        return lambda deferred: deferred
    return lambda deferred: mel_of_frames(deferred.frames, projection)


def _with_chains(previous: Callable[[Lowering], StepFn]) -> Callable[[Lowering], StepFn]:
    """A lowering that takes the mel chain's nodes and leaves every other node to `previous`."""
    def lower(ctx: Lowering) -> StepFn:
        if os.environ.get("INGOT_CUDA_AUDIO_FUSION", "1") != "1":  # off: every node lowered alone (measuring)
            return previous(ctx)
        role = _roles(ctx).get(ctx.node.id)
        return previous(ctx) if role is None else _chain_step(role, ctx)
    lower.__doc__ = f"The fused audio chain's part, else {getattr(previous, '__name__', previous)}."
    return lower


def register(table: dict) -> None:
    """Put the FFT lowerings and the mel-chain parts into a backend's lowering table."""
    for op in (Op.FFT, Op.IFFT, Op.IRFFT):
        table[op] = fft_lowering
    table[Op.RFFT] = _with_chains(fft_lowering)
    for op in {Op.MUL, Op.ABS, Op.TRANSPOSE, Op.RESHAPE, Op.MATMUL, Op.CONCAT, *_EPILOGUE_OPS}:
        table[op] = _with_chains(table[op])


register(LOWERINGS)
