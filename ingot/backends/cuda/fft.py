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

Other windows are multiplied in first (torch) and the kernel does |.|^2 alone. The earlier methods,
measured and removed (git keeps them): a windowed-power pass then a float32 cuBLAS projection, and
power and projection in one kernel on the tensor cores (tf32x3); on the H200 the unrolled kernel took
0.39 ms for the hour of 16 kHz audio against 0.38 + 0.46 for the two passes and 0.82 for the one
tensor-core kernel (BENCHMARKS.md). The chunks a graph is built in
(for the CPU's memory) are merged again at run time when their frames are adjacent views of one
signal: one cuFFT batch per pass of 2^17 frames, passes alternating over two streams, each written
into its columns of the concatenation. The compiler's fuse_mel pass (ingot/passes/fuse_mel.py) makes
the chain one FUSED "stft_mel" op, lowered here as one step, so nothing in between is written to device
memory; any other use of these ops lowers as before. The fusion is named "mel" in
`CompileOptions.fusions` (the dB scale stored by its kernel, "mel_epilogue"); the kernel's tiles and
the passes are `CudaOptions.mel_*`.

    >>> exe = g.compile(targets=[audio.log_mel_spectrogram(g, x)], device="cuda")   # doctest: +SKIP
    >>> exe.plan.fusions                                       # doctest: +SKIP
    ['stft power+mel (hann, 400-point)', ...]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import triton

from ...ir import Node, Op
from ...ops.fused import Body
from ...options import DEFAULT_CUDA, CudaOptions
from ...passes.fuse_mel import EPILOGUE_OPS, chain_spectrum, cosine_window  # noqa: F401  (tests name it here)
from .device import constant_tensor
from .fused_lowerings import fused_lowering, param
from .lowerings import LOWERINGS, Lowering, StepFn

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


# The kernel's tuning (`CudaOptions.mel_*`): frames per program, warps, bins loaded ahead (H200, the hour's
# log-mel through the graph: 1.375 ms with loads 16 bins ahead, 1.389 with 8, 1.428 with 1; 128 frames /
# 4 warps as fast as any other tile measured, 2 frames per thread 40 % slower; a frame's bins spread over
# 8 or 16 threads, so that a warp load touches fewer frames' cache lines, 1.725 / 1.792 ms against 1.363,
# 2026-12-03: benchmarks/audio.py)


def unrolled_kernel(filters: np.ndarray, n_fft: int, cosine: tuple[float, float] | None, lookahead: int | None = None,
                    epilogue: str = "@v"):
    """The compiled-in kernel for this bank, window and epilogue (generated once per process and cached
    on disk by its source, like the fused regions); lookahead None: CudaOptions().mel_lookahead."""
    from .fused import _load_kernel
    ahead = DEFAULT_CUDA.mel_lookahead if lookahead is None else lookahead
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
    spectrum, out = _spectrum_and_out(spectrum, projection, out)
    frames = spectrum.shape[0]
    if frames == 0:
        return out
    kernel = projection.unrolled
    block_f = block_f or projection.options.mel_block_frames
    kernel[(triton.cdiv(frames, block_f),)](torch.view_as_real(spectrum), projection.filters, out, frames, out.stride(0),
                                            BLOCK_F=block_f, num_warps=num_warps or projection.options.mel_warps)
    return out


@dataclass(frozen=True)
class MelProjection:
    """What the kernel needs besides the spectrum: the filters [n_mels, bins] on the device, the window
    as cosine-sum coefficients (None: already applied), the generated kernel (`unrolled_kernel`) and
    what it stores of each band value @v, and the kernel's tuning."""
    filters: torch.Tensor
    n_fft: int
    cosine: tuple[float, float] | None
    unrolled: object = field(compare=False)
    epilogue: str = "@v"
    options: CudaOptions = field(default=DEFAULT_CUDA, compare=False)


def mel_of_frames(frames: torch.Tensor, projection: MelProjection, out: torch.Tensor | None = None) -> torch.Tensor:
    """[frames, n_fft] (a strided view of the signal, windowed already unless projection.cosine)
    -> mel [n_mels, frames]: cuFFT, then the window in frequency, power and the mel projection."""
    return unrolled_mel(torch.fft.rfft(frames, dim=-1), projection, out)


# Frames per cuFFT batch and kernel launch once chunks are merged (`CudaOptions.mel_pass_frames`): the
# complex spectrum of 2**17 400-point frames is 211 MB, so the hour of 16 kHz audio takes three passes;
# mel_streams >= 2: passes spread over that many streams (H200, the hour: 2.04 ms on one stream, 1.95 on
# two, with the two-pass method; benchmarks/audio.py)
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


def concatenated_mel(chunks: list[torch.Tensor], projection: MelProjection) -> torch.Tensor:
    """The concatenation of the chunks' mels [n_mels, sum of frames], each run of adjacent chunks
    computed as one and written straight into its columns (no per-chunk result, no concatenation)."""
    views = merged_views(chunks)
    total = sum(v.shape[0] for v in views)
    out = torch.empty((projection.filters.shape[0], total), dtype=torch.float32, device=views[0].device)
    pieces, col, step = [], 0, max(1, projection.options.mel_pass_frames)
    for v in views:
        for start in range(0, v.shape[0], step):  # bounded temporaries: the spectrum of `step` frames at most
            piece = v[start:start + step]
            pieces.append((piece, out[:, col:col + piece.shape[0]]))
            col += piece.shape[0]
    streams = projection.options.mel_streams
    if streams < 2 or len(pieces) < 2 or out.device.type != "cuda":
        for piece, columns in pieces:
            mel_of_frames(piece, projection, columns)
        return out
    # pieces alternate over side streams, so one piece's cuFFT overlaps another's kernels (neither
    # alone fills the memory system); forked from and joined to the caller's stream (graph capture too)
    main = torch.cuda.current_stream(out.device)
    side = _side_streams(out.device, streams)
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


def _window_name(cosine: tuple[float, float] | None) -> str:
    if cosine is None:
        return "window applied first"
    a0, a1 = cosine
    names = {(0.5, 0.5): "hann", (0.54, 0.46): "hamming", (1.0, 0.0): "boxcar"}
    return next((name for (b0, b1), name in names.items() if math.isclose(a0, b0, abs_tol=1e-6)
                 and math.isclose(a1, b1, abs_tol=1e-6)), f"cosine {a0:.3g}, {a1:.3g}")


@fused_lowering("stft_mel")
def stft_mel(ctx: Lowering) -> tuple[StepFn, str]:
    """The FUSED "stft_mel" op (passes/fuse_mel.py): cuFFT over each chunk's frames, then the unrolled
    kernel (window in frequency where the op holds a cosine window, |.|^2, the bank, the epilogue),
    chunks of one signal merged into one pass where their frames are adjacent views."""
    body: Body = ctx.node.attrs["body"]
    cat = body.find(Op.CONCAT)
    matmuls = list(cat[0].src) if cat else body.find(Op.MATMUL)
    head = cat[0] if cat else matmuls[0]
    frames, window = [], None
    for mm in matmuls:
        x = chain_spectrum(mm).src[0]
        if x.op == Op.MUL:   # the cosine window, applied in frequency by the kernel
            i = 0 if ctx.constant(param(x.src[0])) is not None and x.src[0].type.rank == 1 else 1
            window, x = ctx.constant(param(x.src[i])), x.src[1 - i]
        frames.append(param(x))
    filters = ctx.constant(param(matmuls[0].src[0]))
    n_fft = chain_spectrum(matmuls[0]).src[0].type.shape[1]
    cosine = cosine_window(window) if window is not None else None
    expr = _epilogue(ctx, body, head)
    projection = MelProjection(constant_tensor(filters, ctx.device), n_fft, cosine,
                               unrolled_kernel(filters, n_fft, cosine, ctx.cuda.mel_lookahead, epilogue=expr),
                               epilogue=expr, options=ctx.cuda)
    plan = ctx.plan
    if hasattr(plan, "fusions"):
        plan.fusions.append(f"stft power+mel ({_window_name(cosine)}, {n_fft}-point)")
        if expr != "@v":
            plan.fusions.append(f"mel epilogue {expr.replace('@v', 'mel')}")
    ctx.reads = tuple(frames)
    if len(frames) == 1:
        return (lambda x: mel_of_frames(x, projection)), "stft_mel"
    return (lambda *xs: concatenated_mel(list(xs), projection)), "stft_mel"


def _epilogue(ctx: Lowering, body: Body, head: Node) -> str:
    """What the kernel stores of each mel value @v: the body's scalar ops after `head`, in order."""
    from .fused import _FLOAT_EXPR
    expr, x = "@v", head
    readers = {s.id: n for n in body.nodes for s in n.src if n.op in EPILOGUE_OPS}
    while x is not body.outputs[0]:
        u = readers[x.id]
        if u.op == Op.LOG:
            expr = _FLOAT_EXPR[Op.LOG].format(expr)
        else:
            other = u.src[1] if u.src[0] is x else u.src[0]
            literal = repr(float(np.float32(ctx.constant(param(other)).reshape(()))))
            expr = _FLOAT_EXPR[u.op].format(*((expr, literal) if u.src[0] is x else (literal, expr)))
        x = u
    return expr


def register(table: dict) -> None:
    """Put the FFT lowerings into a backend's lowering table."""
    for op in (Op.FFT, Op.IFFT, Op.RFFT, Op.IRFFT):
        table[op] = fft_lowering


register(LOWERINGS)
