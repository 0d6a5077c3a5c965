"""Audio files in, spectrogram images and arrays out: what `ingot spectrogram` needs around the graphs.

soundfile reads (WAV, FLAC, OGG, ...), scipy's polyphase filter resamples, matplotlib draws. All
three are core dependencies (imported when used); a missing one is an IngotError naming it. Every
problem with an input file is one IngotError sentence naming the file; outputs are written under a
temporary name and renamed, so a failure leaves no file behind.

    >>> import numpy as np, os, tempfile
    >>> import soundfile
    >>> path = os.path.join(tempfile.mkdtemp(), "tone.wav")
    >>> soundfile.write(path, np.zeros((800, 2), np.float32), 8000)
    >>> signal, rate = read_audio(path, sample_rate=16000)
    >>> signal.shape, signal.dtype, rate
    ((1600,), dtype('float32'), 16000)
"""
from __future__ import annotations

import math
import os
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import IngotError
from .files import default_file_mode
from .untrusted import checked_path

INSTALL = "a dependency of Ingot: pip install -e . or pip install ingot installs it"

# Bounds on what a file or an argument may ask for (the signal is held whole, as float32):
MAX_SAMPLES = 1 << 27         # frames x channels read (512 MiB of float32; 2.3 hours of 16 kHz audio)
MAX_SAMPLE_RATE = 1 << 20     # Hz, of a file or a resampling target
MAX_RESAMPLE_TERM = 1 << 16   # the terms of the reduced ratio target/rate (resample_poly's filter has 20x as many taps:
                              # 44,100 -> 16,000 Hz is 160/441; two coprime rates near 2**20 took 1 GB and 5 s)
MAX_N_FFT = 1 << 16
MAX_MELS = 1024
MAX_HOP_LENGTH = 1 << 20


def check_spectrogram_parameters(n_mels: int, n_fft: int, hop_length: int | None = None,
                                 sample_rate: int | None = None) -> None:
    """One IngotError unless every parameter is a positive integer within its documented bound
    (MAX_MELS, MAX_N_FFT, MAX_HOP_LENGTH, MAX_SAMPLE_RATE): checked before any audio is read."""
    for name, value, bound in (("--mels", n_mels, MAX_MELS), ("--n-fft", n_fft, MAX_N_FFT),
                               ("--hop-length", hop_length, MAX_HOP_LENGTH), ("--sample-rate", sample_rate, MAX_SAMPLE_RATE)):
        if value is not None and not 0 < value <= bound:
            raise IngotError(f"{name} must be in 1..{bound}, not {value}.")


def _require(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise IngotError(f"ingot spectrogram needs {module.split('.')[0]} ({INSTALL}).") from None


def _wav_sample_rate(path: Path) -> int | None:
    """The sample rate field of a RIFF/WAVE header, or None when the file is not one (libsndfile
    rejects a rate of 0 with a message that does not say so)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) < 12 or head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
        return None
    at, order = 12, "<" if head[:4] == b"RIFF" else ">"
    while at + 8 <= len(head):
        chunk, size = head[at:at + 4], struct.unpack(order + "I", head[at + 4:at + 8])[0]
        if chunk == b"fmt " and at + 16 <= len(head):
            return struct.unpack(order + "I", head[at + 12:at + 16])[0]
        at += 8 + size + (size & 1)
    return None


def resample(signal: np.ndarray, rate: int, target: int) -> np.ndarray:
    """signal at `rate` Hz to `target` Hz with scipy.signal.resample_poly (polyphase, Kaiser window)."""
    if rate == target:
        return signal
    up, down = _resample_ratio(rate, target)
    return _require("scipy.signal").resample_poly(signal, up, down).astype(np.float32)


def _resample_ratio(rate: int, target: int) -> tuple[int, int]:
    """target/rate in lowest terms; IngotError when a term exceeds MAX_RESAMPLE_TERM."""
    common = math.gcd(int(rate), int(target))
    up, down = int(target) // common, int(rate) // common
    if max(up, down) > MAX_RESAMPLE_TERM:
        raise IngotError(f"resampling {rate} Hz to {target} Hz reduces to the ratio {up}/{down}, whose filter would have "
                         f"{20 * max(up, down)} taps; Ingot resamples when both terms are at most {MAX_RESAMPLE_TERM}.")
    return up, down


def read_audio(path: str | os.PathLike, sample_rate: int | None = None) -> tuple[np.ndarray, int]:
    """A file's samples mixed to mono float32 [T] (the mean of the channels) and resampled to
    sample_rate when given; returns (signal, rate). Empty, unreadable, rate-0 or non-finite audio
    is an IngotError."""
    soundfile = _require("soundfile")
    path = Path(checked_path(path, "audio file"))
    if not path.is_file():
        raise IngotError(f"{path}: no such audio file.")
    if path.stat().st_size == 0:
        raise IngotError(f"{path}: the file is empty.")
    if _wav_sample_rate(path) == 0:
        raise IngotError(f"{path}: the sample rate is 0 Hz, so the samples have no timing.")
    try:  # the header first: how much would be read, at what rate
        info = soundfile.info(str(path))
        if info.frames * info.channels > MAX_SAMPLES:
            raise IngotError(f"{path}: {info.frames} frames x {info.channels} channels is more than the {MAX_SAMPLES} samples "
                             f"Ingot reads from one file.")
        if not 0 < info.samplerate <= MAX_SAMPLE_RATE:
            raise IngotError(f"{path}: the sample rate {info.samplerate} Hz is outside 1..{MAX_SAMPLE_RATE}.")
        if sample_rate is not None and 0 < sample_rate <= MAX_SAMPLE_RATE \
                and info.frames * sample_rate // info.samplerate > MAX_SAMPLES:
            raise IngotError(f"{path}: resampled to {sample_rate} Hz it would hold more than {MAX_SAMPLES} samples.")
        if sample_rate is not None and 0 < sample_rate <= MAX_SAMPLE_RATE:
            try:
                _resample_ratio(info.samplerate, sample_rate)
            except IngotError as e:
                raise IngotError(f"{path}: {e}") from None
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError) as e:
        reason = str(e).split(": ", 1)[-1].rstrip(".") if ": " in str(e) else str(e).rstrip(".")
        raise IngotError(f"{path}: not a readable audio file (WAV, FLAC or OGG): {reason}.") from None
    if rate <= 0:
        raise IngotError(f"{path}: the sample rate is {rate} Hz, so the samples have no timing.")
    if samples.size == 0:
        raise IngotError(f"{path}: the file holds no samples.")
    finite = np.isfinite(samples)
    if not finite.all():
        first = int(np.argmin(finite.all(axis=1)))
        raise IngotError(f"{path}: the signal holds NaN or infinite values (the first at sample {first}, {first / rate:.3f} s).")
    signal = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    signal = np.ascontiguousarray(signal)
    if sample_rate is not None:
        if not 0 < sample_rate <= MAX_SAMPLE_RATE:
            raise IngotError(f"the target sample rate must be in 1..{MAX_SAMPLE_RATE} Hz, not {sample_rate}.")
        signal, rate = resample(signal, rate, sample_rate), sample_rate
    return signal, int(rate)


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path`; renamed onto it when the block ends without an error and
    removed when it raises, so `path` is either complete or untouched."""
    path = Path(path)
    if not path.parent.is_dir():
        raise IngotError(f"{path}: the folder {path.parent} does not exist.")
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode())  # mkstemp makes it 0600; a new file gets the user's umask
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)



def save_array(path: str | os.PathLike, array: np.ndarray) -> None:
    """np.save to exactly this path (no `.npy` suffix is added); wrap in atomic_output for safety."""
    with open(path, "wb") as f:
        np.save(f, array)


def save_image(path: str | os.PathLike, spectrogram: np.ndarray, sample_rate: int, hop_length: int,
               mel_frequencies: np.ndarray, title: str, colour_label: str) -> None:
    """A PNG of spectrogram [n_mels, frames]: time in seconds across, mel bands up (labelled in Hz
    at the band centres), a colour bar. Wrap in atomic_output for safety."""
    matplotlib = _require("matplotlib")
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    n_mels, frames = spectrogram.shape
    seconds = frames * hop_length / sample_rate
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(spectrogram, origin="lower", aspect="auto", interpolation="nearest", cmap="magma",
                        extent=(0.0, seconds, -0.5, n_mels - 0.5))
    ticks = np.unique(np.linspace(0, n_mels - 1, min(n_mels, 8)).round().astype(int))
    axes.set_yticks(ticks, [f"{mel_frequencies[t]:.0f}" for t in ticks])
    axes.set_xlabel("time (s)")
    axes.set_ylabel("frequency (Hz, mel scale)")
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label=colour_label)
    figure.savefig(path, format="png")
