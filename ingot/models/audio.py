"""Audio front ends as Ingot graphs: STFT, inverse STFT, power spectra, mel filterbanks, log-mel, Whisper.

Framing is a zero-copy strided view (`array_view` with the hop as the frame stride), then a window
multiply and an `rfft` per frame. Spectra come out in librosa's layout, frequency before time:

    signal  float32 [..., T]
    stft    complex64 [..., n_fft // 2 + 1, frames]      frames = 1 + (T + 2 * (n_fft // 2) - n_fft) // hop
    mel     float32 [..., n_mels, frames]

    >>> import numpy as np
    >>> from ingot.models import audio
    >>> x = np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32)
    >>> audio.evaluate(audio.whisper_log_mel_spectrogram, x).shape
    (80, 100)

The mel filterbank follows librosa (`librosa.filters.mel`: Slaney or HTK scale, Slaney area
normalisation) and the Whisper front end follows `whisper.audio.log_mel_spectrogram` exactly;
both are written here in NumPy, with no dependency on either project.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Graph, Tensor

# Whisper's fixed hyper-parameters (whisper/audio.py)
WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP_LENGTH = 160
WHISPER_CHUNK_SECONDS = 30
WHISPER_N_SAMPLES = WHISPER_CHUNK_SECONDS * WHISPER_SAMPLE_RATE  # 480000 samples: 3000 frames

Window = str | tuple | Sequence[float] | np.ndarray


# -- windows and filterbanks (NumPy, computed once at build time) --------------------------------

def get_window(window: Window, length: int) -> np.ndarray:
    """A periodic ("fftbins") analysis window of `length` samples, as scipy.signal.get_window gives it.

    window: "hann", "hamming", "boxcar" (also "rectangular", "ones"), ("gaussian", std), or the
    samples themselves (a custom window, `length` long).

        >>> get_window("hann", 4).round(6).tolist()
        [0.0, 0.5, 1.0, 0.5]
    """
    if length <= 0:
        raise IngotError(f"window: the length must be positive, not {length}.")
    if not isinstance(window, (str, tuple)):
        samples = np.asarray(window, np.float64)
        if samples.shape != (length,):
            raise IngotError(f"window: a custom window must have shape ({length},), not {samples.shape}.")
        if not np.isfinite(samples).all():
            raise IngotError("window: the custom window holds NaN or infinite values.")
        return samples
    name, *params = (window,) if isinstance(window, str) else window
    n = np.arange(length, dtype=np.float64)
    if length == 1 and name in ("hann", "hamming", "boxcar", "rectangular", "ones", "gaussian"):
        return np.ones(1)  # scipy's convention for a one-sample window
    if name == "hann" and not params:
        return 0.5 - 0.5 * np.cos(2 * np.pi * n / length)
    if name == "hamming" and not params:
        return 0.54 - 0.46 * np.cos(2 * np.pi * n / length)
    if name in ("boxcar", "rectangular", "ones") and not params:
        return np.ones(length)
    if name == "gaussian" and len(params) == 1 and float(params[0]) > 0:
        # the symmetric window of length + 1 without its last sample (scipy's periodic form)
        return np.exp(-0.5 * ((n - length / 2) / float(params[0])) ** 2)
    raise IngotError(f"window: expected 'hann', 'hamming', 'boxcar', ('gaussian', std) or an array, not {window!r}.")


def _padded_window(window: Window, win_length: int, n_fft: int) -> np.ndarray:
    """The window centred in n_fft samples (zeros either side), as librosa pads it."""
    if not 0 < win_length <= n_fft:
        raise IngotError(f"stft: win_length must be in 1..n_fft ({n_fft}), not {win_length}.")
    samples = get_window(window, win_length)
    left = (n_fft - win_length) // 2
    return np.pad(samples, (left, n_fft - win_length - left))


def hz_to_mel(frequencies, htk: bool = False) -> np.ndarray:
    """Hertz to mels: HTK's 2595 log10(1 + f / 700), or Slaney's (linear below 1 kHz, log above)."""
    f = np.asanyarray(frequencies, np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + f / 700.0)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, min_log_hz) / min_log_hz) / logstep, f / f_sp)


def mel_to_hz(mels, htk: bool = False) -> np.ndarray:
    """Mels to hertz, the inverse of `hz_to_mel`."""
    m = np.asanyarray(mels, np.float64)
    if htk:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


def mel_frequencies(n: int, fmin: float = 0.0, fmax: float = 11025.0, htk: bool = False) -> np.ndarray:
    """n frequencies in Hz evenly spaced on the mel scale from fmin to fmax (librosa.mel_frequencies);
    filter i of an n_mels bank peaks at mel_frequencies(n_mels + 2, ...)[i + 1]."""
    return mel_to_hz(np.linspace(hz_to_mel(fmin, htk), hz_to_mel(fmax, htk), n), htk)


def mel_filterbank(sample_rate: float, n_fft: int, n_mels: int = 128, fmin: float = 0.0, fmax: float | None = None,
                   htk: bool = False, norm: str | float | None = "slaney") -> np.ndarray:
    """Triangular mel filters, float32 [n_mels, n_fft // 2 + 1]; librosa.filters.mel's defaults and values.

    norm="slaney" divides each triangle by its width in Hz (constant energy per band); a number p
    scales each filter to unit p-norm; None leaves peaks at 1.

        >>> mel_filterbank(16000, 400, n_mels=80).shape    # Whisper's 80-mel bank
        (80, 201)
    """
    if sample_rate <= 0 or n_fft <= 0 or n_mels <= 0:
        raise IngotError(f"mel_filterbank: sample_rate, n_fft and n_mels must be positive, not {sample_rate}, {n_fft}, {n_mels}.")
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    if not 0 <= fmin < fmax:
        raise IngotError(f"mel_filterbank: need 0 <= fmin < fmax, not fmin={fmin}, fmax={fmax}.")
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    mel_freqs = mel_frequencies(n_mels + 2, fmin, fmax, htk)
    widths = np.diff(mel_freqs)
    ramps = mel_freqs[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    if norm == "slaney":
        weights *= (2.0 / (mel_freqs[2:n_mels + 2] - mel_freqs[:n_mels]))[:, None]
    elif isinstance(norm, (int, float)) and not isinstance(norm, bool):
        lengths = np.linalg.norm(weights, ord=norm, axis=-1, keepdims=True) if np.isfinite(norm) else np.abs(weights).max(-1, keepdims=True)
        weights = np.divide(weights, lengths, out=np.zeros_like(weights), where=lengths > np.finfo(np.float64).tiny)
    elif norm is not None:
        raise IngotError(f"mel_filterbank: norm must be 'slaney', a number or None, not {norm!r}.")
    return weights.astype(np.float32)


def window_sum_square(window: Window, n_frames: int, hop_length: int, n_fft: int, win_length: int | None = None) -> np.ndarray:
    """The sum over frames of the squared window at each output sample (librosa's window_sumsquare):
    what overlap-add of windowed frames multiplies a signal by."""
    w2 = _padded_window(window, win_length or n_fft, n_fft) ** 2
    total = np.zeros(n_fft + hop_length * (n_frames - 1))
    for i in range(n_frames):  # a short loop at build time; n_fft / hop additions per sample
        total[i * hop_length:i * hop_length + n_fft] += w2
    return total


# -- graph builders ------------------------------------------------------------------------------

def _static_length(x: Tensor, what: str) -> int:
    if x.ndim == 0 or any(d is None for d in x.shape):
        raise IngotError(f"{what}: the signal needs a static shape [..., samples], not {x.type}.")
    if x.dtype != dt.float32:
        raise IngotError(f"{what}: the signal must be float32, not {x.dtype.name}.")
    return x.shape[-1]


def _last_pad(x: Tensor, before: int, after: int) -> list[tuple[int, int]]:
    return [(0, 0)] * (x.ndim - 1) + [(before, after)]


def _swap_last(g: Graph, x: Tensor) -> Tensor:
    perm = list(range(x.ndim))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return g.transpose(x, perm)


def frame(g: Graph, signal: Tensor, frame_length: int, hop_length: int) -> Tensor:
    """Overlapping frames of signal [..., T] as a strided view [..., frames, frame_length]: frame i
    starts at sample i * hop_length. No sample is copied.

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((10,), name="x")
        >>> exe = g.compile(targets=[frame(g, x, 4, 3)])
        >>> exe.run({"x": np.arange(10, dtype=np.float32)})[0][:, 0].tolist()
        [0.0, 3.0, 6.0]
    """
    length = _static_length(signal, "frame")
    if frame_length <= 0 or hop_length <= 0:
        raise IngotError(f"frame: frame_length and hop_length must be positive, not {frame_length}, {hop_length}.")
    if length < frame_length:
        raise IngotError(f"frame: the signal has {length} samples, fewer than one frame of {frame_length}.")
    n_frames = 1 + (length - frame_length) // hop_length
    lead = signal.shape[:-1]
    lead_strides = [int(np.prod(signal.shape[i + 1:])) for i in range(len(lead))]
    return g.array_view(signal, (*lead, n_frames, frame_length), (*lead_strides, hop_length, 1))


def _centre_check(length: int, half: int, pad_mode: str, what: str) -> None:
    if pad_mode not in ("constant", "reflect"):
        raise IngotError(f"{what}: pad_mode must be 'constant' or 'reflect', not {pad_mode!r}.")
    if pad_mode == "reflect" and length <= half:
        raise IngotError(f"{what}: reflect padding by {half} needs more than {half} samples, the signal has {length}.")


def _centre(g: Graph, signal: Tensor, n_fft: int, center: bool, pad_mode: str, what: str) -> Tensor:
    length = _static_length(signal, what)
    if not center:
        return signal
    _centre_check(length, n_fft // 2, pad_mode, what)
    return g.pad(signal, _last_pad(signal, n_fft // 2, n_fft // 2), mode=pad_mode)


def _stft_frames_major(g: Graph, signal: Tensor, n_fft: int, hop_length: int | None, win_length: int | None,
                       window: Window, center: bool, pad_mode: str, what: str = "stft") -> Tensor:
    """The STFT as complex64 [..., frames, bins] (the layout rfft gives; the public stft transposes)."""
    if n_fft <= 0:
        raise IngotError(f"{what}: n_fft must be positive, not {n_fft}.")
    hop_length = hop_length or (win_length or n_fft) // 4
    padded = _centre(g, signal, n_fft, center, pad_mode, what)
    frames = frame(g, padded, n_fft, hop_length)                                     # [..., F, n_fft], a view
    taper = g.constant(_padded_window(window, win_length or n_fft, n_fft).astype(np.float32), name="window")
    return g.rfft(frames * taper, axes=-1)                                           # [..., F, n_fft // 2 + 1]


def _map_frames(g: Graph, signal: Tensor, n_fft: int, hop_length: int, center: bool, pad_mode: str,
                per_chunk: Callable[[Tensor], Tensor], n_frames: int | None = None, frames_per_chunk: int | None = None,
                what: str = "stft", axis: int = -1) -> Tensor:
    """per_chunk(frames [..., count, n_fft]) -> [..., k, count] over the frames of the (centred)
    signal, chunk by chunk, concatenated along the last axis. Each chunk's temporaries (windowed
    frames, spectrum, power) die before the next chunk starts, so a long signal needs memory for one
    chunk plus the result. Frames inside the signal are views of it; the few frames that reach into
    the centre padding come from two small padded pieces of its ends (as librosa >= 0.10 does), so
    the signal is never copied whole. n_frames: keep only the first n frames (Whisper drops the last)."""
    length = _static_length(signal, what)
    if n_fft <= 0 or hop_length <= 0:
        raise IngotError(f"{what}: n_fft and hop_length must be positive, not {n_fft}, {hop_length}.")
    half = n_fft // 2 if center else 0
    if center:
        _centre_check(length, half, pad_mode, what)
    total = 1 + (length + 2 * half - n_fft) // hop_length if length + 2 * half >= n_fft else 0
    n_frames = total if n_frames is None else min(n_frames, total)
    if n_frames <= 0:
        raise IngotError(f"{what}: the signal has {length} samples, fewer than one frame of {n_fft}.")
    chunk = frames_per_chunk or max(1, (1 << 22) // n_fft)  # about 16 MB of windowed float32 frames
    lead = signal.shape[:-1]
    rank = signal.ndim

    def frames_of(x: Tensor, offset: int, count: int) -> Tensor:  # count frames of x from sample offset on
        lead_strides = [int(np.prod(x.shape[i + 1:])) for i in range(len(lead))]
        return g.array_view(x, (*lead, count, n_fft), (*lead_strides, hop_length, 1), offset=offset)

    def piece(begin: int, end: int, before: int, after: int) -> Tensor:  # signal[begin:end], padded as the whole is
        cut = g.slice(signal, [0] * (rank - 1) + [begin], [None] * (rank - 1) + [end])
        return g.pad(cut, _last_pad(cut, before, after), mode=pad_mode)

    first_inside = -(-half // hop_length)                        # frame i starts at sample i * hop - half
    first_past_end = (length + half - n_fft) // hop_length + 1   # frames from here on reach past the end
    head_end = (first_inside - 1) * hop_length + n_fft - half
    tail_begin = first_past_end * hop_length - half
    pieces_fit = (center and first_inside < first_past_end and head_end <= length
                  and (pad_mode != "reflect" or (head_end > half and length - tail_begin > half)))
    parts: list[tuple[Tensor, int, int]] = []                     # (source, sample offset in it, frames)
    if not pieces_fit:  # no centring, or a signal so short that the padding reaches most frames
        padded = _centre(g, signal, n_fft, center, pad_mode, what)
        parts = [(padded, start * hop_length, min(chunk, n_frames - start)) for start in range(0, n_frames, chunk)]
    else:
        if first_inside:
            parts.append((piece(0, head_end, half, 0), 0, min(first_inside, n_frames)))
        middle_end = min(first_past_end, n_frames)
        for start in range(first_inside, middle_end, chunk):
            parts.append((signal, start * hop_length - half, min(chunk, middle_end - start)))
        if n_frames > first_past_end:
            parts.append((piece(tail_begin, length, 0, half), 0, n_frames - first_past_end))
    outputs = [per_chunk(frames_of(x, offset, count)) for x, offset, count in parts]
    return outputs[0] if len(outputs) == 1 else g.concat(outputs, axis=axis)


def stft(g: Graph, signal: Tensor, n_fft: int = 2048, hop_length: int | None = None, win_length: int | None = None,
         window: Window = "hann", center: bool = True, pad_mode: str = "constant") -> Tensor:
    """Short-time Fourier transform of float32 [..., T] -> complex64 [..., n_fft // 2 + 1, frames].

    librosa.stft's conventions: hop_length defaults to win_length // 4, a window shorter than n_fft
    is centred in it, center=True pads n_fft // 2 samples each side (pad_mode "constant" zeros,
    or "reflect" as torch.stft and Whisper), no scaling.

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((1000,), name="x")
        >>> spec = stft(g, x, n_fft=256, hop_length=64)
        >>> spec.type
        complex64[129, 16]
    """
    return _swap_last(g, _stft_frames_major(g, signal, n_fft, hop_length, win_length, window, center, pad_mode))


def istft(g: Graph, spectrum: Tensor, hop_length: int | None = None, win_length: int | None = None,
          n_fft: int | None = None, window: Window = "hann", center: bool = True, length: int | None = None) -> Tensor:
    """Inverse STFT of complex64 [..., bins, frames] -> float32 [..., samples], by overlap-add with
    the window-sum normalisation (librosa.istft), so istft(stft(x)) == x with the same parameters.

    length: trim or zero-pad the result to this many samples (pass len(x) for an exact round trip).

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((1000,), name="x")
        >>> y = istft(g, stft(g, x, n_fft=256, hop_length=64), hop_length=64, length=1000)
        >>> signal = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
        >>> bool(abs(g.compile(targets=[y]).run({"x": signal})[0] - signal).max() < 1e-5)
        True
    """
    if spectrum.dtype != dt.complex64 or spectrum.ndim < 2 or any(d is None for d in spectrum.shape):
        raise IngotError(f"istft: the spectrum must be a static complex64 [..., bins, frames], not {spectrum.type}.")
    bins, n_frames = spectrum.shape[-2:]
    n_fft = n_fft or 2 * (bins - 1)
    if n_fft // 2 + 1 != bins:
        raise IngotError(f"istft: n_fft {n_fft} gives {n_fft // 2 + 1} bins, the spectrum has {bins}.")
    win_length = win_length or n_fft
    hop_length = hop_length or win_length // 4
    taper = _padded_window(window, win_length, n_fft)
    frames = g.irfft(_swap_last(g, spectrum), axes=-1, n=n_fft) * g.constant(taper.astype(np.float32), name="window")
    # overlap-add: frame f's block r (hop samples) lands in output block f + r
    blocks_per_frame = -(-n_fft // hop_length)
    if blocks_per_frame * hop_length > n_fft:
        frames = g.pad(frames, _last_pad(frames, 0, blocks_per_frame * hop_length - n_fft))
    lead = tuple(spectrum.shape[:-2])
    blocks = g.reshape(frames, (*lead, n_frames, blocks_per_frame, hop_length))
    rank = len(lead) + 3
    total = None
    for r in range(blocks_per_frame):
        start, end = [0] * rank, [None] * rank
        start[-2], end[-2] = r, r + 1
        part = g.reshape(g.slice(blocks, start, end), (*lead, n_frames, hop_length))
        shifted = g.pad(part, [(0, 0)] * len(lead) + [(r, blocks_per_frame - 1 - r), (0, 0)])
        total = shifted if total is None else total + shifted
    full = n_fft + hop_length * (n_frames - 1)
    y = g.reshape(total, (*lead, (n_frames + blocks_per_frame - 1) * hop_length))
    wss = window_sum_square(window, n_frames, hop_length, n_fft, win_length)
    inverse = np.where(wss > np.finfo(np.float32).tiny, 1.0 / np.maximum(wss, np.finfo(np.float32).tiny), 1.0)
    start = n_fft // 2 if center else 0
    stop = full - n_fft // 2 if center else full
    if length is not None:
        stop = start + int(length)
    keep = min(stop, full) - start
    if keep <= 0:
        raise IngotError(f"istft: {n_frames} frames of hop {hop_length} leave no samples to return.")
    y = g.slice(y, [0] * len(lead) + [start], [None] * len(lead) + [start + keep])
    y = y * g.constant(inverse[start:start + keep].astype(np.float32), name="inverse_window_sum")
    if stop > full:  # librosa zero-pads to the requested length
        y = g.pad(y, _last_pad(y, 0, stop - full))
    return y


def magnitude_spectrum(g: Graph, spectrum: Tensor) -> Tensor:
    """|STFT|: complex64 -> float32 of the same shape."""
    return g.abs(spectrum)


def power_spectrum(g: Graph, spectrum: Tensor, power: float = 2.0) -> Tensor:
    """|STFT| ** power (2: energy, librosa's and Whisper's default; 1: magnitude).

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); z = g.placeholder((2,), ingot.complex64, name="z")
        >>> g.compile(targets=[power_spectrum(g, z)]).run({"z": np.array([3 + 4j, 1j], np.complex64)})[0].tolist()
        [25.0, 1.0]
    """
    magnitude = g.abs(spectrum)
    if power == 1.0:
        return magnitude
    if power == 2.0:
        return magnitude * magnitude
    if power <= 0:
        raise IngotError(f"power_spectrum: power must be positive, not {power}.")
    return magnitude ** float(power)


def mel_spectrogram(g: Graph, signal: Tensor, sample_rate: float = 22050, n_fft: int = 2048,
                    hop_length: int | None = None, win_length: int | None = None, window: Window = "hann",
                    center: bool = True, pad_mode: str = "constant", power: float = 2.0, n_mels: int = 128,
                    fmin: float = 0.0, fmax: float | None = None, htk: bool = False,
                    norm: str | float | None = "slaney", frames_per_chunk: int | None = None) -> Tensor:
    """Mel spectrogram float32 [..., n_mels, frames] with librosa.feature.melspectrogram's defaults.

    The frames go through window, rfft, power and the mel projection in chunks of frames_per_chunk
    (default: about 16 MB of windowed frames), so memory stays near the signal plus the result.

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((22050,), name="x")
        >>> mel_spectrogram(g, x).type
        float32[128, 44]
    """
    if n_fft <= 0:
        raise IngotError(f"mel_spectrogram: n_fft must be positive, not {n_fft}.")
    hop_length = hop_length or (win_length or n_fft) // 4
    taper = g.constant(_padded_window(window, win_length or n_fft, n_fft).astype(np.float32), name="window")
    filters = g.constant(mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax, htk, norm), name="mel_filters")

    def mel_of(frames: Tensor) -> Tensor:                                           # [..., c, n_fft], a view
        energy = power_spectrum(g, g.rfft(frames * taper, axes=-1), power)           # [..., c, bins]
        return g.matmul(filters, _swap_last(g, energy))                              # [n_mels, bins] @ [..., bins, c]
    return _map_frames(g, signal, n_fft, hop_length, center, pad_mode, mel_of, frames_per_chunk=frames_per_chunk,
                       what="mel_spectrogram")


def power_to_db(g: Graph, spectrum: Tensor, ref: float | str = 1.0, amin: float = 1e-10, top_db: float | None = 80.0) -> Tensor:
    """10 log10(max(S, amin) / max(ref, amin)) floored at its maximum minus top_db (librosa.power_to_db).

    ref: a number, or "max" for the spectrum's own maximum (librosa's ref=np.max).
    """
    if amin <= 0:
        raise IngotError(f"power_to_db: amin must be positive, not {amin}.")
    if top_db is not None and top_db < 0:
        raise IngotError(f"power_to_db: top_db must be non-negative, not {top_db}.")
    to_db = 10.0 / math.log(10.0)
    db = g.log(g.maximum(spectrum, float(amin))) * to_db
    if ref == "max":
        db = db - g.log(g.maximum(g.max(spectrum), float(amin))) * to_db
    elif isinstance(ref, (int, float)) and ref > 0:
        offset = float(10.0 * math.log10(max(float(ref), amin)))
        if offset:  # ref=1.0 (the default) subtracts nothing: no pass over the spectrum for it
            db = db - offset
    else:
        raise IngotError(f"power_to_db: ref must be a positive number or 'max', not {ref!r}.")
    if top_db is not None:
        db = g.maximum(db, g.max(db) - float(top_db))
    return db


def log_mel_spectrogram(g: Graph, signal: Tensor, sample_rate: float = 22050, n_fft: int = 2048,
                        hop_length: int | None = None, n_mels: int = 128, ref: float | str = 1.0, amin: float = 1e-10,
                        top_db: float | None = 80.0, **options: Any) -> Tensor:
    """power_to_db(mel_spectrogram(signal)): librosa's log-mel in dB, float32 [..., n_mels, frames].
    Further keywords (window, center, pad_mode, fmin, fmax, htk, norm, power) go to mel_spectrogram.

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((16000,), name="x")
        >>> log_mel_spectrogram(g, x, sample_rate=16000, n_fft=512, hop_length=160, n_mels=64).type
        float32[64, 101]
    """
    mel = mel_spectrogram(g, signal, sample_rate, n_fft, hop_length, n_mels=n_mels, **options)
    return power_to_db(g, mel, ref, amin, top_db)


def whisper_log_mel_spectrogram(g: Graph, audio: Tensor, n_mels: int = 80, padding: int = 0,
                                frames_per_chunk: int | None = None) -> Tensor:
    """Whisper's front end (whisper.audio.log_mel_spectrogram) for 16 kHz float32 audio [..., T].

    n_fft 400 with a periodic Hann window, hop 160, reflect centre padding, the last frame dropped,
    |STFT|^2 through librosa's Slaney mel bank (80 or 128 mels), log10 clamped at 1e-10, floored at
    the maximum minus 8, then (x + 4) / 4. padding: zero samples appended first (Whisper's
    transcribe passes WHISPER_N_SAMPLES, 30 s); `pad_or_trim` fixes audio to one 30-s window.
    Output float32 [..., n_mels, (T + padding) // 160].

        >>> import numpy as np, ingot
        >>> g = ingot.Graph(); x = g.placeholder((WHISPER_N_SAMPLES,), name="audio")
        >>> whisper_log_mel_spectrogram(g, x, n_mels=128).type
        float32[128, 3000]
    """
    if n_mels not in (80, 128):
        raise IngotError(f"whisper: n_mels must be 80 or 128 (the published models), not {n_mels}.")
    if padding < 0:
        raise IngotError(f"whisper: padding must be non-negative, not {padding}.")
    if padding:
        audio = g.pad(audio, _last_pad(audio, 0, padding))
    length = _static_length(audio, "whisper")
    taper = g.constant(get_window("hann", WHISPER_N_FFT).astype(np.float32), name="window")
    filters = g.constant(mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels), name="mel_filters")

    def mel_of(frames: Tensor) -> Tensor:                                           # [..., c, 400], a view
        energy = power_spectrum(g, g.rfft(frames * taper, axes=-1))                  # [..., c, 201]
        return g.matmul(filters, _swap_last(g, energy))                              # [..., n_mels, c]
    mel = _map_frames(g, audio, WHISPER_N_FFT, WHISPER_HOP_LENGTH, True, "reflect", mel_of,
                      n_frames=length // WHISPER_HOP_LENGTH, frames_per_chunk=frames_per_chunk, what="whisper")  # the last frame dropped
    log_spec = g.log(g.maximum(mel, 1e-10)) * (1.0 / math.log(10.0))
    log_spec = g.maximum(log_spec, g.max(log_spec) - 8.0)
    return (log_spec + 4.0) * 0.25


def pad_or_trim(audio: np.ndarray, length: int = WHISPER_N_SAMPLES) -> np.ndarray:
    """Zero-pad or cut the last axis to `length` samples (whisper.audio.pad_or_trim; 30 s by default)."""
    audio = np.asarray(audio)
    if audio.shape[-1] >= length:
        return audio[..., :length]
    return np.pad(audio, [(0, 0)] * (audio.ndim - 1) + [(0, length - audio.shape[-1])])


# -- running a builder ---------------------------------------------------------------------------

def evaluate(builder: Callable[..., Tensor], signal: np.ndarray, device: str = "cpu", **options: Any) -> np.ndarray:
    """Build `builder(g, signal_placeholder, **options)` for this signal's shape, compile it for
    `device` and run it once: the one-call way to use the builders above on an array. The result is
    a NumPy array on every device.

        >>> import numpy as np
        >>> evaluate(stft, np.zeros(4096, np.float32), n_fft=1024).shape
        (513, 17)
    """
    signal = np.ascontiguousarray(signal, dtype=np.float32)
    g = Graph()
    x = g.placeholder(signal.shape, dt.float32, name="signal")
    exe = g.compile(targets=[builder(g, x, **options)], device=device)
    (out,) = exe.run({"signal": signal})
    return np.asarray(exe.backend.to_host(out))  # a device result comes back as a NumPy array
