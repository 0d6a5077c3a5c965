"""Audio front ends (ingot.models.audio) against scipy, NumPy float64 references, librosa's mel
filters and Whisper's published formula; framing is a view; `ingot spectrogram` end to end.

tests/fixtures/librosa_mel_filters.npz holds librosa 0.11.0's `librosa.filters.mel(**MEL_BANKS[key])`
for each key, so the filterbank is checked against librosa itself where librosa is not installed.
Where librosa (or torch) is importable the tests also compare with it directly.
"""
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import scipy.signal

import ingot
from ingot.audio_io import read_audio
from ingot.cli import main
from ingot.models import audio

FIXTURES = Path(__file__).parent / "fixtures"
MEL_BANKS = {
    "whisper_80": dict(sr=16000, n_fft=400, n_mels=80),
    "whisper_128": dict(sr=16000, n_fft=400, n_mels=128),
    "slaney_22050_2048_128": dict(sr=22050, n_fft=2048, n_mels=128),
    "htk_22050_1023_40_fmin30_fmax8000_nonorm": dict(sr=22050, n_fft=1023, n_mels=40, fmin=30.0, fmax=8000.0, htk=True, norm=None),
    "htk_8000_256_24_slaney": dict(sr=8000, n_fft=256, n_mels=24, htk=True),
}
WINDOWS = ["hann", "hamming", ("gaussian", 9.5), "boxcar"]
CENTRES = [(True, "constant"), (True, "reflect"), (False, "constant")]
F32 = 1e-5  # float32 tolerance, relative to the largest magnitude of the result


def librosa_filters(key: str) -> np.ndarray:
    with np.load(FIXTURES / "librosa_mel_filters.npz") as f:
        return f[key]


def signal(n: int, seed: int = 0, lead=()) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 3111 * t)
    return (tone + 0.1 * rng.standard_normal(lead + (n,))).astype(np.float32)


def assert_close(actual, expected, tol=F32):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max()), 1e-30)
    err = float(np.abs(actual.astype(np.complex128) - expected).max()) / scale
    assert err <= tol, f"max error {err:.3g} of the largest magnitude > {tol}"


def stft_reference(x, n_fft, hop, win_length=None, window="hann", center=True, pad_mode="constant"):
    """float64 NumPy STFT with librosa's conventions: [..., bins, frames]."""
    x = x.astype(np.float64)
    win_length = win_length or n_fft
    w = scipy.signal.get_window(window, win_length, fftbins=True) if not isinstance(window, np.ndarray) else window.astype(np.float64)
    left = (n_fft - win_length) // 2
    w = np.pad(w, (left, n_fft - win_length - left))
    if center:
        x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(n_fft // 2, n_fft // 2)], mode=pad_mode)
    n_frames = 1 + (x.shape[-1] - n_fft) // hop
    frames = np.stack([x[..., i * hop:i * hop + n_fft] for i in range(n_frames)], axis=-2)
    return np.swapaxes(np.fft.rfft(frames * w, axis=-1), -1, -2)


# -- windows and STFT ----------------------------------------------------------------------------

@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("length", [1, 7, 400, 401])
def test_windows_equal_scipy_periodic_windows(window, length):
    np.testing.assert_allclose(audio.get_window(window, length), scipy.signal.get_window(window, length, fftbins=True),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("center,pad_mode", CENTRES)
@pytest.mark.parametrize("length", [1001, 4099])
def test_stft_equals_scipy_stft(window, center, pad_mode, length):
    # scipy scales by 1 / sum(window) and pads nperseg // 2 each side ("even" is NumPy's reflect)
    x = signal(length)
    n_fft, hop = 256, 75  # a hop that divides neither n_fft nor the length
    ours = audio.evaluate(audio.stft, x, n_fft=n_fft, hop_length=hop, window=window, center=center, pad_mode=pad_mode)
    w = scipy.signal.get_window(window, n_fft, fftbins=True)
    boundary = {(True, "constant"): "zeros", (True, "reflect"): "even", (False, "constant"): None}[(center, pad_mode)]
    _, _, expected = scipy.signal.stft(x.astype(np.float64), window=w, nperseg=n_fft, noverlap=n_fft - hop,
                                       boundary=boundary, padded=False, detrend=False)
    assert ours.dtype == np.complex64
    assert_close(ours, expected * w.sum())


@pytest.mark.parametrize("center,pad_mode", CENTRES)
def test_stft_short_window_custom_window_and_batch_equal_numpy(center, pad_mode):
    x = signal(3001, lead=(2, 3))
    custom = np.random.default_rng(1).uniform(0.1, 1.0, 301).astype(np.float32)
    for window, win_length in [("hann", 300), ("hamming", 301), (("gaussian", 40.0), 255), (custom, 301)]:
        ours = audio.evaluate(audio.stft, x, n_fft=512, hop_length=128, win_length=win_length, window=window,
                              center=center, pad_mode=pad_mode)
        assert ours.shape == (2, 3, 257, 1 + ((3001 + (512 if center else 0)) - 512) // 128)
        assert_close(ours, stft_reference(x, 512, 128, win_length, window, center, pad_mode))


def test_stft_errors_are_one_sentence():
    g = ingot.Graph()
    with pytest.raises(ingot.IngotError, match="reflect padding by 128 needs more than 128 samples"):
        audio.stft(g, g.placeholder((100,)), n_fft=256, pad_mode="reflect")
    with pytest.raises(ingot.IngotError, match="fewer than one frame"):
        audio.stft(g, g.placeholder((100,)), n_fft=256, center=False)
    with pytest.raises(ingot.IngotError, match="static shape"):
        audio.stft(g, g.placeholder((None,)), n_fft=256)
    with pytest.raises(ingot.IngotError, match="window"):
        audio.stft(g, g.placeholder((1000,)), n_fft=256, window="kaiser")
    with pytest.raises(ingot.IngotError, match=r"shape \(256,\)"):
        audio.stft(g, g.placeholder((1000,)), n_fft=256, window=np.ones(100))


# -- framing is a view -----------------------------------------------------------------------------

def test_framing_is_a_view_of_the_signal():
    x = signal(16001)
    g = ingot.Graph()
    placeholder = g.placeholder(x.shape, name="signal")
    (frames,) = g.compile(targets=[audio.frame(g, placeholder, 400, 160)]).run({"signal": x})
    assert frames.shape == (98, 400)
    assert np.shares_memory(frames, x)
    assert frames.strides == (160 * 4, 4)  # hop and sample strides: consecutive frames overlap in memory
    np.testing.assert_array_equal(frames[3], x[480:880])


def test_centred_framing_views_the_padded_signal_once():
    x = signal(16001)
    g = ingot.Graph()
    placeholder = g.placeholder(x.shape, name="signal")
    padded = g.pad(placeholder, [(200, 200)], mode="reflect")
    (frames,) = g.compile(targets=[audio.frame(g, padded, 400, 160)]).run({"signal": x})
    assert np.shares_memory(frames[0], frames[1])  # overlapping frames are one memory, not copies
    low, high = np.lib.array_utils.byte_bounds(frames)
    assert frames.shape == (101, 400)
    assert high - low == (100 * 160 + 400) * 4  # the frames span the padded signal once: 16400 samples, not 101 x 400
    np.testing.assert_array_equal(frames[1, 40:], x[:360])


def test_stft_peak_memory_stays_under_three_times_signal_plus_output():
    x = signal(16000 * 300)  # 5 minutes at 16 kHz
    tracemalloc.start()
    try:
        out = audio.evaluate(audio.stft, x, n_fft=400, hop_length=160, pad_mode="reflect")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # per-frame copies would be n_fft / hop = 2.5x the signal in float32 for the frames alone,
    # plus the padded copy; the view keeps the whole run within 3x (signal + spectrum)
    assert peak < 3 * (x.nbytes + out.nbytes), (peak, x.nbytes, out.nbytes)


def test_log_mel_peak_memory_stays_under_three_times_signal_plus_output():
    x = signal(16000 * 600)  # 10 minutes at 16 kHz (one chunk's temporaries, ~50 MB, are a fixed cost)
    tracemalloc.start()
    try:
        out = audio.evaluate(audio.whisper_log_mel_spectrogram, x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # windowed frames (2.5x the signal) and their spectrum (2.5x) exist one chunk at a time, and the
    # signal is never padded whole: the signal itself counts here too
    assert x.nbytes + peak < 3 * (x.nbytes + out.nbytes), (peak, x.nbytes, out.nbytes)


@pytest.mark.slow
def test_one_hour_log_mel_peak_memory_stays_under_three_times_signal_plus_output():
    x = np.zeros(16000 * 3600, np.float32)  # 1 h at 16 kHz (230 MB); the values do not change the memory
    x[::7] = 0.5
    tracemalloc.start()
    try:
        out = audio.evaluate(audio.log_mel_spectrogram, x, sample_rate=16000, n_fft=400, hop_length=160, n_mels=80,
                             pad_mode="reflect")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (80, 1 + len(x) // 160)
    # per-frame copies would be 2.5x the signal (576 MB) for the windowed frames and as much again
    # for their spectrum; chunk by chunk, the whole run stays within 3x (signal + output)
    assert x.nbytes + peak < 3 * (x.nbytes + out.nbytes), (peak, x.nbytes, out.nbytes)


@pytest.mark.parametrize("pad_mode", ["constant", "reflect"])
@pytest.mark.parametrize("frames_per_chunk", [1, 7, None])
def test_chunked_mel_equals_the_reference(pad_mode, frames_per_chunk):
    # chunks of 1 and 7 frames put every chunk boundary, and the padded head and tail pieces, to work
    x = signal(2999, lead=(2,))
    for n_fft, hop in [(255, 64), (256, 100)]:
        ours = audio.evaluate(audio.mel_spectrogram, x, sample_rate=16000, n_fft=n_fft, hop_length=hop, n_mels=24,
                              pad_mode=pad_mode, frames_per_chunk=frames_per_chunk)
        expected = audio.mel_filterbank(16000, n_fft, 24).astype(np.float64) @ (
            np.abs(stft_reference(x, n_fft, hop, pad_mode=pad_mode)) ** 2)
        assert_close(ours, expected)
    whisper = audio.evaluate(audio.whisper_log_mel_spectrogram, x, frames_per_chunk=frames_per_chunk)
    np.testing.assert_allclose(whisper, audio.evaluate(audio.whisper_log_mel_spectrogram, x), rtol=0, atol=1e-5)


# -- inverse ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_fft,hop,win_length,window,length", [
    (512, 128, None, "hann", 4001),
    (400, 160, None, "hann", 16000),       # 2.5 frames per hop: the overlap-add pads frames to 3 hops
    (256, 100, 200, "hamming", 3333),
    (255, 64, None, ("gaussian", 30.0), 2000),
])
def test_istft_of_stft_returns_the_signal(n_fft, hop, win_length, window, length):
    x = signal(length)

    def round_trip(g, s):
        spec = audio.stft(g, s, n_fft=n_fft, hop_length=hop, win_length=win_length, window=window)
        return audio.istft(g, spec, hop_length=hop, win_length=win_length, n_fft=n_fft, window=window, length=length)

    y = audio.evaluate(round_trip, x)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)


def test_istft_batched_and_without_length():
    x = signal(4096, lead=(3,))
    y = audio.evaluate(lambda g, s: audio.istft(g, audio.stft(g, s, n_fft=256, hop_length=64), hop_length=64), x)
    assert y.shape == (3, 4096)  # 4096 is a multiple of the hop, so no length is needed
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)


# -- mel filterbank, spectra, log-mel ----------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(MEL_BANKS))
def test_mel_filterbank_equals_librosa(key):
    p = dict(MEL_BANKS[key])
    ours = audio.mel_filterbank(p.pop("sr"), p.pop("n_fft"), **p)
    expected = librosa_filters(key)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-9)


def test_mel_filterbank_other_norms_and_errors():
    w = audio.mel_filterbank(16000, 512, 40, norm=2.0)
    np.testing.assert_allclose(np.linalg.norm(w.astype(np.float64), axis=1), 1.0, rtol=1e-6)
    assert audio.mel_filterbank(16000, 512, 40, norm=None).max() <= 1.0
    with pytest.raises(ingot.IngotError, match="fmin < fmax"):
        audio.mel_filterbank(16000, 512, 40, fmin=9000)
    np.testing.assert_allclose(audio.mel_to_hz(audio.hz_to_mel([0, 500, 1000, 7999.5])), [0, 500, 1000, 7999.5])
    np.testing.assert_allclose(audio.mel_to_hz(audio.hz_to_mel([30, 8000], htk=True), htk=True), [30, 8000])


def test_power_and_magnitude_spectra():
    x = signal(2001)
    spec = stft_reference(x, 256, 64)
    power = audio.evaluate(lambda g, s: audio.power_spectrum(g, audio.stft(g, s, n_fft=256, hop_length=64)), x)
    magnitude = audio.evaluate(lambda g, s: audio.magnitude_spectrum(g, audio.stft(g, s, n_fft=256, hop_length=64)), x)
    cube = audio.evaluate(lambda g, s: audio.power_spectrum(g, audio.stft(g, s, n_fft=256, hop_length=64), 3.0), x)
    assert power.dtype == magnitude.dtype == np.float32
    assert_close(power, np.abs(spec) ** 2)
    assert_close(magnitude, np.abs(spec))
    assert_close(cube, np.abs(spec) ** 3, tol=2e-5)  # float32 pow of a float32 magnitude


def log_mel_reference(x, sr, n_fft, hop, filters, pad_mode="constant", ref=1.0, amin=1e-10, top_db=80.0):
    """librosa.feature.melspectrogram + librosa.power_to_db, written out in float64."""
    mel = filters.astype(np.float64) @ np.abs(stft_reference(x, n_fft, hop, pad_mode=pad_mode)) ** 2
    ref_value = mel.max() if ref == "max" else ref
    db = 10 * np.log10(np.maximum(amin, mel)) - 10 * np.log10(max(amin, ref_value))
    return np.maximum(db, db.max() - top_db) if top_db is not None else db


@pytest.mark.parametrize("ref,top_db", [(1.0, 80.0), ("max", 80.0), (1.0, None)])
def test_log_mel_equals_librosa_reference(ref, top_db):
    x = signal(22050 * 2 + 17)
    ours = audio.evaluate(audio.log_mel_spectrogram, x, sample_rate=22050, n_fft=2048, hop_length=512, n_mels=128,
                          ref=ref, top_db=top_db)
    expected = log_mel_reference(x, 22050, 2048, 512, librosa_filters("slaney_22050_2048_128"), ref=ref, top_db=top_db)
    assert ours.shape == expected.shape == (128, 1 + (len(x) // 512))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


def test_log_mel_equals_librosa_itself():
    librosa = pytest.importorskip("librosa")
    x = signal(16000 * 3 + 5)
    for options in [dict(n_fft=512, hop_length=160, n_mels=64), dict(n_fft=1023, hop_length=200, n_mels=40, htk=True,
                                                                      fmin=30.0, fmax=7000.0, norm=None)]:
        ours = audio.evaluate(audio.log_mel_spectrogram, x, sample_rate=16000, **options)
        expected = librosa.power_to_db(librosa.feature.melspectrogram(y=x, sr=16000, **options))
        np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


# -- Whisper -----------------------------------------------------------------------------------------

def whisper_reference(x, n_mels, padding=0):
    """whisper.audio.log_mel_spectrogram (openai/whisper), written out in float64 NumPy."""
    if padding:
        x = np.pad(x, (0, padding))
    spec = stft_reference(x, 400, 160, pad_mode="reflect")  # torch.stft(center=True, pad_mode="reflect")
    magnitudes = np.abs(spec[..., :-1]) ** 2
    mel = librosa_filters(f"whisper_{n_mels}").astype(np.float64) @ magnitudes
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("length,padding", [(16000 * 2 + 77, 0), (16000 + 1, audio.WHISPER_N_SAMPLES)])
def test_whisper_front_end_equals_the_published_formula(n_mels, length, padding):
    x = signal(length)
    ours = audio.evaluate(audio.whisper_log_mel_spectrogram, x, n_mels=n_mels, padding=padding)
    expected = whisper_reference(x, n_mels, padding)
    assert ours.shape == expected.shape == (n_mels, (length + padding) // 160)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


def test_whisper_thirty_second_window_and_torch():
    x = audio.pad_or_trim(signal(16000 * 7))
    ours = audio.evaluate(audio.whisper_log_mel_spectrogram, x)
    assert ours.shape == (80, 3000)
    torch = pytest.importorskip("torch")
    window = torch.hann_window(400)
    stft = torch.stft(torch.from_numpy(x), 400, 160, window=window, return_complex=True)
    mel = torch.from_numpy(librosa_filters("whisper_80")) @ (stft[..., :-1].abs() ** 2)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    np.testing.assert_allclose(ours, ((log_spec + 4.0) / 4.0).numpy(), rtol=0, atol=1e-4)
    with pytest.raises(ingot.IngotError, match="80 or 128"):
        audio.evaluate(audio.whisper_log_mel_spectrogram, x, n_mels=64)
    assert audio.pad_or_trim(np.ones(10), 4).shape == (4,)


# -- ingot spectrogram -------------------------------------------------------------------------------

def run_cli(*args):
    """`ingot spectrogram ARGS` in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ingot.cli", "spectrogram", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def run_main(capsys, *args):
    """The same through ingot.cli.main in this process (no interpreter start-up per case)."""
    code = main(["spectrogram", *map(str, args)])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def assert_one_sentence_error(result, *words):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def wav_bytes(sample_rate: int, samples: np.ndarray) -> bytes:
    import struct
    data = samples.astype("<i2").tobytes()
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", len(data)) + data)


def test_spectrogram_cli_writes_a_labelled_png_and_the_array(tmp_path):
    soundfile = pytest.importorskip("soundfile")
    pytest.importorskip("matplotlib")
    rate = 44100
    t = np.arange(int(rate * 1.5)) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 880 * t), 0.5 * np.sin(2 * np.pi * 880 * t)], axis=1)
    source = tmp_path / "tone.flac"
    soundfile.write(source, stereo, rate)
    png, npy = tmp_path / "tone.png", tmp_path / "tone.npy"
    result = run_cli(source, "-o", png, "--npy", npy, "--whisper")
    assert result.returncode == 0, result.stderr
    array = np.load(npy)
    # resampled to 16 kHz, then Whisper's 80 x T // 160
    assert array.shape == (80, 150) and np.isfinite(array).all()
    mono16k, _ = read_audio(source, 16000)
    np.testing.assert_allclose(array, audio.evaluate(audio.whisper_log_mel_spectrogram, mono16k), atol=1e-5)
    peak_band = int(np.argmax(array.mean(axis=1)))
    centres = audio.mel_frequencies(82, 0, 8000)[1:-1]
    assert abs(centres[peak_band] - 880) < 60  # the tone's band is the loudest
    from matplotlib.image import imread
    image = imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] >= 200 and image.shape[1] >= 400
    rgb = image[..., :3]
    assert rgb.std() > 0.1 and len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50  # not blank: a picture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tone.flac", "tone.npy", "tone.png"]  # no temporaries


def test_spectrogram_cli_log_mel_array_only(tmp_path, capsys):
    soundfile = pytest.importorskip("soundfile")
    source = tmp_path / "noise.ogg"
    soundfile.write(source, signal(8000), 8000)
    npy = tmp_path / "noise.npy"
    result = run_main(capsys, source, "--npy", npy, "--mels", "40", "--n-fft", "256")
    assert result.returncode == 0, result.stderr
    assert np.load(npy).shape == (40, 1 + 8000 // 64)


BAD_FILES = {
    "empty": (b"", ["empty"]),
    "text": (b"this is not audio at all\n" * 40, ["not a readable audio file"]),
    "rate0": (wav_bytes(0, np.zeros(400)), ["sample rate is 0"]),
    "no_samples": (wav_bytes(16000, np.zeros(0)), ["no samples"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_spectrogram_cli_bad_files(tmp_path, capsys, case):
    content, words = BAD_FILES[case]
    source = tmp_path / f"{case}.wav"
    source.write_bytes(content)
    out = tmp_path / "out.png"
    assert_one_sentence_error(run_main(capsys, source, "-o", out, "--npy", tmp_path / "out.npy"), f"{case}.wav", *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{case}.wav"]  # nothing written, no temporaries


def test_spectrogram_cli_nan_and_usage_errors(tmp_path, capsys):
    soundfile = pytest.importorskip("soundfile")
    x = signal(4000)
    x[1234] = np.nan
    source = tmp_path / "nan.wav"
    soundfile.write(source, x, 16000, subtype="FLOAT")
    assert_one_sentence_error(run_main(capsys, source, "-o", tmp_path / "x.png"), "nan.wav", "NaN", "sample 1234")
    assert_one_sentence_error(run_main(capsys, tmp_path / "missing.wav", "-o", tmp_path / "x.png"), "missing.wav")
    assert_one_sentence_error(run_main(capsys, source), "-o OUT.png")
    assert_one_sentence_error(run_main(capsys, source, "-o", tmp_path / "no" / "x.png"), "does not exist")
    assert_one_sentence_error(run_main(capsys, source, "-o", tmp_path / "x.png", "--whisper", "--mels", "64"), "80 or 128")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.wav"]
