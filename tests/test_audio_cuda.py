"""Audio front ends on the CUDA backend against the CPU backend (marker `cuda`).

STFT, mel, log-mel and Whisper graphs from ingot.models.audio compiled for device="cuda" and for the
CPU, on awkward lengths (odd signal and FFT sizes, chunks that end mid-signal), every window type
and centre mode. The mel chain runs fused on the device (cuFFT over the strided frames, then one
Triton kernel: window in frequency, |.|^2, mel projection); the tests check that the fusion was
taken where expected and that the framing stays a view of the signal.

Runs where torch sees a GPU; skipped cleanly elsewhere. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1`
runs the same kernels under Triton's interpreter (slow; small signals only).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402

import ingot  # noqa: E402
from ingot.backends.cuda import fft as cuda_fft  # noqa: E402
from ingot.backends.cuda import to_host  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402
from ingot.models import audio  # noqa: E402

WINDOWS = ["hann", "hamming", ("gaussian", 9.5), "boxcar", "custom"]
CENTRES = [(True, "constant"), (True, "reflect"), (False, "constant")]
F32 = 1e-5     # float32, relative to the largest magnitude of the result
LOG_MEL = 1e-4  # dB and Whisper's log10 scale: the tolerance for log-mel


def signal(n: int, seed: int = 0, lead=()) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    tone = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 3111 * t)
    return (tone + 0.1 * rng.standard_normal(lead + (n,))).astype(np.float32)


def window_of(name, n_fft: int):
    if name == "custom":
        return np.random.default_rng(1).random(n_fft) + 0.5
    return name


def run_both(build, x: np.ndarray, options=None):
    """(cuda result as numpy, cpu result, the cuda executable)."""
    g = ingot.Graph()
    s = g.placeholder(x.shape, ingot.float32, name="signal")
    y = build(g, s)
    expected = g.compile(targets=[y]).run({"signal": x})[0]
    exe = g.compile(targets=[y], device="cuda", options=options)
    actual = to_host(exe.run({"signal": x})[0])
    again = to_host(exe.run({"signal": x})[0])    # the second run replays a captured CUDA graph
    np.testing.assert_array_equal(actual, again)
    return actual, expected, exe


def assert_close(actual, expected, tol):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    scale = max(float(np.abs(expected).max()), 1e-30)
    err = float(np.abs(actual.astype(np.complex128) - expected).max()) / scale
    assert err <= tol, f"max error {err:.3g} of the largest magnitude > {tol}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("center,pad_mode", CENTRES)
@pytest.mark.parametrize("length,n_fft,hop", [(2999, 256, 64), (1823, 401, 100)])
def test_stft_equals_cpu(window, center, pad_mode, length, n_fft, hop):
    x = signal(length)
    actual, expected, _ = run_both(lambda g, s: audio.stft(g, s, n_fft=n_fft, hop_length=hop,
                                                          window=window_of(window, n_fft), center=center,
                                                          pad_mode=pad_mode), x)
    assert_close(actual, expected, F32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("center,pad_mode", CENTRES)
def test_mel_equals_cpu_and_is_fused(window, center, pad_mode):
    n_fft, hop = 401, 97
    x = signal(4001, seed=2)
    build = lambda g, s: audio.mel_spectrogram(g, s, sample_rate=16000, n_fft=n_fft, hop_length=hop,  # noqa: E731
                                               window=window_of(window, n_fft), center=center, pad_mode=pad_mode,
                                               n_mels=40, frames_per_chunk=13)
    actual, expected, exe = run_both(build, x)
    assert_close(actual, expected, F32)
    fused = [f for f in exe.plan.fusions if f.startswith("stft power+mel")]
    assert fused, exe.plan.fusions
    in_frequency = window in ("hann", "hamming", "boxcar")
    assert all(("window applied first" in f) != in_frequency for f in fused), fused


@pytest.mark.parametrize("length", [16000, 16001, 4321])
@pytest.mark.parametrize("n_fft,n_mels,htk", [(400, 80, False), (512, 64, True), (1023, 40, False)])
def test_log_mel_equals_cpu(length, n_fft, n_mels, htk):
    x = signal(length, seed=3)
    actual, expected, exe = run_both(lambda g, s: audio.log_mel_spectrogram(
        g, s, sample_rate=16000, n_fft=n_fft, hop_length=160, n_mels=n_mels, htk=htk, pad_mode="reflect"), x)
    assert_close(actual, expected, LOG_MEL)
    # the dB scale stored by the mel kernel
    assert any(f.startswith("mel epilogue") and "tl.log(tl.maximum(mel, " in f for f in exe.plan.fusions), exe.plan.fusions


def test_epilogue_with_the_constant_first_keeps_operand_order():
    """maximum(amin, mel), then a subtraction from a constant and a division: the value's place among
    each node's sources is kept (c - v is not v - c)."""
    x = signal(4001, seed=6)

    def build(g, s):
        mel = audio.mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160, n_mels=40)
        floor = g.constant(np.float32(1e-10))
        return g.div(g.sub(g.constant(np.float32(3.0)), g.log(g.maximum(floor, mel))), g.constant(np.float32(4.0)))
    actual, expected, exe = run_both(build, x)
    assert_close(actual, expected, LOG_MEL)
    assert any(f.startswith("mel epilogue") and "(3.0 - tl.log(" in f for f in exe.plan.fusions), exe.plan.fusions


def test_mel_read_elsewhere_keeps_its_values_and_no_epilogue():
    """The mel is an output too: the kernel must store the mel itself, and the dB scale runs after it."""
    x = signal(5001, seed=5)
    g = ingot.Graph()
    s = g.placeholder(x.shape, ingot.float32, name="signal")
    mel = audio.mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160, n_mels=40)
    db = audio.power_to_db(g, mel)
    expected = g.compile(targets=[mel, db]).run({"signal": x})
    exe = g.compile(targets=[mel, db], device="cuda")
    actual = [to_host(a) for a in exe.run({"signal": x})]
    assert not any(f.startswith("mel epilogue") for f in exe.plan.fusions), exe.plan.fusions
    assert_close(actual[0], expected[0], F32)
    assert_close(actual[1], expected[1], LOG_MEL)


def test_batched_and_win_length_mel_fall_back_and_equal_cpu():
    x = signal(3001, seed=4, lead=(2,))
    actual, expected, _ = run_both(lambda g, s: audio.mel_spectrogram(g, s, sample_rate=8000, n_fft=256, hop_length=80,
                                                                     n_mels=24), x)
    assert_close(actual, expected, F32)
    x = signal(3001, seed=5)
    actual, expected, exe = run_both(lambda g, s: audio.mel_spectrogram(g, s, sample_rate=8000, n_fft=256, hop_length=80,
                                                                       win_length=200, n_mels=24), x)
    assert_close(actual, expected, F32)
    assert any("window applied first" in f for f in exe.plan.fusions), exe.plan.fusions  # a padded window is no cosine sum


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("length,padding", [(16000 * 3 + 7, 0), (12345, 16000)])
def test_whisper_front_end_equals_cpu(n_mels, length, padding):
    x = signal(length, seed=6)
    actual, expected, exe = run_both(lambda g, s: audio.whisper_log_mel_spectrogram(g, s, n_mels=n_mels, padding=padding), x)
    assert_close(actual, expected, LOG_MEL)
    assert any(f.startswith("stft power+mel (hann, 400-point") for f in exe.plan.fusions), exe.plan.fusions


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="30 s of audio is slow in the interpreter")
def test_whisper_thirty_seconds_equals_cpu():
    x = audio.pad_or_trim(signal(16000 * 21, seed=7))
    actual, expected, _ = run_both(lambda g, s: audio.whisper_log_mel_spectrogram(g, s), x)
    assert actual.shape == (80, 3000)
    assert_close(actual, expected, LOG_MEL)


@pytest.mark.parametrize("frames,bins_n_fft,n_mels,cosine", [(1, 400, 80, (0.5, 0.5)), (333, 401, 40, (0.54, 0.46)),
                                                              (70, 256, 24, None), (129, 1023, 128, (0.5, 0.5))])
def test_mel_kernel_equals_numpy(frames, bins_n_fft, n_mels, cosine):
    n_fft = bins_n_fft
    rng = np.random.default_rng(8)
    x = rng.standard_normal((frames, n_fft)).astype(np.float32)
    filters = audio.mel_filterbank(16000, n_fft, n_mels)
    window = np.ones(n_fft) if cosine is None else cosine[0] - cosine[1] * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    expected = (filters.astype(np.float64) @ (np.abs(np.fft.rfft(x * window, axis=-1)) ** 2).T).astype(np.float32)
    device = torch.device(os.environ.get("INGOT_CUDA_DEVICE", "cuda"))
    projection = cuda_fft.MelProjection(torch.as_tensor(filters, device=device), n_fft, cosine,
                                        cuda_fft.unrolled_kernel(filters, n_fft, cosine))
    actual = to_host(cuda_fft.mel_of_frames(torch.as_tensor(x, device=device), projection))
    assert_close(actual, expected, F32)


def test_adjacent_chunk_views_merge_into_one():
    device = torch.device(os.environ.get("INGOT_CUDA_DEVICE", "cuda"))
    x = torch.arange(1000, dtype=torch.float32, device=device)
    a = x.as_strided((3, 40), (16, 1), 5)
    b = x.as_strided((4, 40), (16, 1), 5 + 3 * 16)        # starts where a's frames leave off
    c = x.as_strided((2, 40), (16, 1), 5 + 7 * 16 + 1)    # one sample late: a separate view
    d = torch.zeros((2, 40), device=device)                # another storage
    merged = cuda_fft.merged_views([a, b, c, d])
    assert [v.shape[0] for v in merged] == [7, 2, 2]
    assert merged[0].data_ptr() == a.data_ptr() and torch.equal(merged[0], torch.cat([a, b]))


@pytest.mark.parametrize("pass_frames", [5, 1 << 17])
def test_chunked_log_mel_merges_chunks_and_equals_cpu(pass_frames):
    options = CompileOptions(cuda=CudaOptions(mel_pass_frames=pass_frames))
    x = signal(16000 + 333, seed=4)
    build = lambda g, s: audio.log_mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160,  # noqa: E731
                                                   n_mels=80, pad_mode="reflect", frames_per_chunk=11)
    actual, expected, exe = run_both(build, x, options)
    assert_close(actual, expected, LOG_MEL)
    (op,) = [n for n in exe.plan.program.nodes() if n.op.name == "FUSED" and n.attrs["kind"] == "stft_mel"]
    assert op.attrs["body"].find(ingot.ir.Op.CONCAT) and exe.plan.step_names.count("stft_mel") == 1


def test_mel_fusions_by_name():
    """CompileOptions.fusions without "mel" (none at all here): the chain's nodes lowered one by one, the
    same values as fused."""
    x = signal(4001, seed=9)
    build = lambda g, s: audio.log_mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160,  # noqa: E731
                                                   n_mels=40, pad_mode="reflect")
    for fusions, chain, epilogue in ((frozenset(), False, False), (None, True, True)):
        actual, expected, exe = run_both(build, x, CompileOptions(fusions=fusions))
        assert_close(actual, expected, LOG_MEL)
        assert any(f.startswith("stft power+mel") for f in exe.plan.fusions) == chain, exe.plan.fusions
        assert any(f.startswith("mel epilogue") for f in exe.plan.fusions) == epilogue, exe.plan.fusions


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs device memory")
def test_one_hour_log_mel_peak_device_memory_under_three_times_signal_plus_output():
    n = 16000 * 3600
    g = ingot.Graph()
    s = g.placeholder((n,), ingot.float32, name="signal")
    exe = g.compile(targets=[audio.log_mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160, n_mels=80,
                                                       pad_mode="reflect")], device="cuda")
    x = torch.as_tensor(signal(n), device="cuda")
    exe.run({"signal": x})                                 # kernels compiled, plans made
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = exe.run({"signal": x})[0]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    signal_bytes, output_bytes = x.numel() * 4, out.numel() * 4
    assert out.shape == (80, n // 160 + 1)
    # windowed frames alone would be 2.5x the signal: the chain never writes them
    assert peak < 3 * (signal_bytes + output_bytes), (peak / 1e6, signal_bytes / 1e6, output_bytes / 1e6)


def test_evaluate_on_cuda_returns_numpy_equal_to_cpu():
    x = signal(8001, seed=9)
    on_gpu = audio.evaluate(audio.whisper_log_mel_spectrogram, x, device="cuda", n_mels=80)
    on_cpu = audio.evaluate(audio.whisper_log_mel_spectrogram, x, n_mels=80)
    assert isinstance(on_gpu, np.ndarray)
    assert_close(on_gpu, on_cpu, LOG_MEL)


def test_spectrogram_cli_on_cuda_writes_the_cpu_array(tmp_path, capsys):
    soundfile = pytest.importorskip("soundfile")  # the lent GPU has none: checked here under the interpreter
    from ingot.cli import main
    x = signal(16000 * 2 + 17, seed=10)
    source = tmp_path / "speech.wav"
    soundfile.write(source, x, 16000, subtype="FLOAT")
    arrays = {}
    for device in ("cpu", "cuda"):
        npy = tmp_path / f"{device}.npy"
        assert main(["spectrogram", str(source), "--npy", str(npy), "--whisper", "--device", device]) == 0, \
            capsys.readouterr().err
        arrays[device] = np.load(npy)
    assert_close(arrays["cuda"], arrays["cpu"], LOG_MEL)
