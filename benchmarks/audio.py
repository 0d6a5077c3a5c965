"""Audio front ends on the CPU: Ingot vs librosa vs torch.stft (+ a torchaudio-style mel), in one run.

For 1 minute and 1 hour of 16 kHz audio (seeded tones + noise, float32), the median wall time of
each engine over --repeats runs after one warm-up:

  stft      complex STFT, n_fft 400, hop 160, Hann, centred (reflect)
  log-mel   |STFT|^2 -> 80 Slaney mels -> power_to_db (top_db 80): librosa.feature.melspectrogram +
            librosa.power_to_db; torch.stft + abs^2 + matmul with the same filters + 10 log10 as
            torchaudio's MelSpectrogram + AmplitudeToDB compute it
  whisper   Whisper's log-mel (80 mels): Ingot's front end vs whisper.audio's formula in torch

Ingot's time is `exe.run` of an executable compiled once for the signal length (compile time is
printed apart). Ratios are anchor time / Ingot time: above 1 means Ingot is faster.

    python -m benchmarks audio [--repeats 5] [--threads 2] [--durations 60,3600] [--skip librosa,torch]

--device cuda times the same graphs compiled for the GPU (the signal already on the device; Ingot's
time is a replay of its captured CUDA graph plus the copy of the result out of the graph's buffer)
against torch.stft alone, torch.stft + a torchaudio-style mel (abs^2, matmul, 10 log10, top_db),
torchaudio's MelSpectrogram + AmplitudeToDB where installed, and Whisper's formula in torch; each the
median of triton.testing.do_bench (L2 flushed between calls). It also times the fused kernel's
variants (matmul precision, tile sizes) on the 1-h spectrum and checks Ingot's result against the
torch anchors:

    python -m benchmarks audio --device cuda [--durations 3600]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np

SAMPLE_RATE, N_FFT, HOP, N_MELS = 16000, 400, 160, 80


def make_signal(seconds: float) -> np.ndarray:
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
    rng = np.random.default_rng(0)
    x = 0.3 * np.sin(2 * np.pi * (220 + 20 * np.sin(0.5 * t)) * t) + 0.05 * rng.standard_normal(n)
    return x.astype(np.float32)


def median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn. The engines take turns within each repeat, so a machine shared
    with other work loads them alike."""
    for fn in fns.values():
        fn()  # warm-up: plans, caches, numba
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            del result
    return {name: statistics.median(t) for name, t in times.items()}


def ingot_runners(x: np.ndarray, only: str | None = None) -> dict[str, tuple[Callable[[], object], float]]:
    import ingot
    from ingot.models import audio

    builders = {
        "stft": lambda g, s: audio.stft(g, s, n_fft=N_FFT, hop_length=HOP, pad_mode="reflect"),
        "log-mel": lambda g, s: audio.log_mel_spectrogram(g, s, sample_rate=SAMPLE_RATE, n_fft=N_FFT, hop_length=HOP,
                                                          n_mels=N_MELS, pad_mode="reflect"),
        "whisper": lambda g, s: audio.whisper_log_mel_spectrogram(g, s, n_mels=N_MELS),
    }
    runners = {}
    for name, build in builders.items():
        if only is not None and name != only:
            continue
        start = time.perf_counter()
        g = ingot.Graph()
        signal = g.placeholder(x.shape, ingot.float32, name="signal")
        exe = g.compile(targets=[build(g, signal)])
        runners[name] = ((lambda exe=exe: exe.run({"signal": x})), time.perf_counter() - start)
    return runners


def librosa_runners(x: np.ndarray) -> dict[str, Callable[[], object]]:
    import librosa

    return {
        "stft": lambda: librosa.stft(x, n_fft=N_FFT, hop_length=HOP, pad_mode="reflect"),
        "log-mel": lambda: librosa.power_to_db(librosa.feature.melspectrogram(
            y=x, sr=SAMPLE_RATE, n_fft=N_FFT, hop_length=HOP, n_mels=N_MELS, pad_mode="reflect")),
    }


def torch_runners(x: np.ndarray) -> dict[str, Callable[[], object]]:
    import torch
    from ingot.models.audio import mel_filterbank

    signal = torch.from_numpy(x)
    window = torch.hann_window(N_FFT)
    filters = torch.from_numpy(mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS))

    def stft():
        return torch.stft(signal, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True)

    def log_mel():  # torchaudio MelSpectrogram(power=2) + AmplitudeToDB("power", top_db=80)
        power = stft().abs().pow(2.0)
        mel = torch.matmul(power.transpose(-1, -2), filters.T).transpose(-1, -2)
        db = 10.0 * torch.log10(torch.clamp(mel, min=1e-10))
        return torch.maximum(db, db.amax() - 80.0)

    def whisper():  # whisper.audio.log_mel_spectrogram
        magnitudes = stft()[..., :-1].abs() ** 2
        log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    return {"stft": stft, "log-mel": log_mel, "whisper": whisper}


def peak_memory_mb(fn: Callable[[], object]) -> float:
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


# -- CUDA ----------------------------------------------------------------------------------------

def cuda_anchors(x):
    """torch.stft alone, torch.stft + a torchaudio-style mel in dB, torchaudio itself, Whisper's formula."""
    import torch
    from ingot.models.audio import mel_filterbank

    window = torch.hann_window(N_FFT, device=x.device)
    filters = torch.from_numpy(mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS)).to(x.device)

    def stft():
        return torch.stft(x, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True)

    def log_mel():  # torchaudio MelSpectrogram(power=2) + AmplitudeToDB("power", top_db=80), as matmuls
        mel = filters @ stft().abs().pow(2.0)
        db = 10.0 * torch.log10(torch.clamp(mel, min=1e-10))
        return torch.maximum(db, db.amax() - 80.0)

    def whisper():  # whisper.audio.log_mel_spectrogram
        magnitudes = stft()[..., :-1].abs() ** 2
        log_spec = torch.clamp(filters @ magnitudes, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    runners = {"torch.stft": stft, "torch log-mel": log_mel, "torch whisper": whisper}
    try:
        import torchaudio
        mel_spec = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=N_FFT, hop_length=HOP, n_mels=N_MELS,
                                                        pad_mode="reflect", norm="slaney", mel_scale="slaney").to(x.device)
        to_db = torchaudio.transforms.AmplitudeToDB("power", top_db=80.0).to(x.device)
        runners["torchaudio log-mel"] = lambda: to_db(mel_spec(x))
    except Exception as e:  # noqa: BLE001 (an anchor we can do without)
        print(f"# torchaudio not used: {e}")
    return runners


def cuda_main(args) -> None:
    import torch
    import triton
    import triton.testing

    import ingot
    from ingot.backends.cuda import fft as cuda_fft
    from ingot.models import audio
    from ingot.options import CompileOptions, CudaOptions

    from ingot.backends.cuda import device_name

    device = torch.device(device_name())  # INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1: a dry run of this code

    def bench(fn) -> float:
        if device.type != "cuda":
            return median_times({"fn": fn}, 1)["fn"] * 1e3
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # ms

    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    for seconds in (float(s) for s in args.durations.split(",")):
        host = make_signal(seconds)
        x = torch.from_numpy(host).to(device)
        label = f"{seconds:g} s" if seconds < 60 else f"{seconds / 60:g} min" if seconds < 3600 else f"{seconds / 3600:g} h"
        log_mel = lambda g, s, **o: audio.log_mel_spectrogram(g, s, sample_rate=SAMPLE_RATE, n_fft=N_FFT,  # noqa: E731
                                                             hop_length=HOP, n_mels=N_MELS, pad_mode="reflect", **o)
        def tuned(**cuda):   # CompileOptions with these CudaOptions fields (the mel kernel's and passes')
            return CompileOptions(cuda=CudaOptions(**cuda))

        # name: (builder, CompileOptions)
        builders = {
            "ingot log-mel": (log_mel, None),
            "ingot log-mel, one chunk": (lambda g, s: log_mel(g, s, frames_per_chunk=len(host)), None),
            "ingot log-mel, one stream": (log_mel, tuned(mel_streams=1)),
            "ingot log-mel, one pass": (log_mel, tuned(mel_pass_frames=1 << 30, mel_streams=1)),
            "ingot log-mel, unfused": (log_mel, CompileOptions(fusions=frozenset())),   # no device fusion at all
            "ingot log-mel, passes of 2^16": (log_mel, tuned(mel_pass_frames=1 << 16)),
            "ingot log-mel, passes of 2^18": (log_mel, tuned(mel_pass_frames=1 << 18)),
            "ingot log-mel, 3 streams": (log_mel, tuned(mel_streams=3)),
            "ingot log-mel, ahead 1": (log_mel, tuned(mel_lookahead=1)),
            "ingot log-mel, ahead 8": (log_mel, tuned(mel_lookahead=8)),
            "ingot whisper": (lambda g, s: audio.whisper_log_mel_spectrogram(g, s, n_mels=N_MELS), None),
            "ingot stft": (lambda g, s: audio.stft(g, s, n_fft=N_FFT, hop_length=HOP, pad_mode="reflect"), None),
        }
        if args.quick:
            also = {f"ingot log-mel, {name.strip()}" for name in args.also.split(",") if name.strip()}
            builders = {k: v for k, v in builders.items() if k in {"ingot log-mel", "ingot whisper", "ingot stft", *also}}
        times, results = {}, {}
        for name, (build, options) in builders.items():
            start = time.perf_counter()
            g = ingot.Graph()
            signal = g.placeholder(host.shape, ingot.float32, name="signal")
            exe = g.compile(targets=[build(g, signal)], device="cuda", options=options)
            compile_s = time.perf_counter() - start
            run = (lambda exe=exe: exe.run({"signal": x})[0])
            results[name] = run()              # kernels compiled; the next runs capture and replay
            run()
            times[name] = bench(run)
            print(f"{label:>8} {name:<28} {times[name]:8.3f} ms   compile {compile_s:.2f} s   fusions: "
                  f"{sorted(set(f for f in exe.plan.fusions if f.startswith('stft')))}", flush=True)
            del exe
        anchors = cuda_anchors(x)
        for name, run in anchors.items():
            results[name] = run()
            times[name] = bench(run)
            print(f"{label:>8} {name:<28} {times[name]:8.3f} ms", flush=True)
        for ours, theirs in (("ingot log-mel", "torch log-mel"), ("ingot log-mel", "torchaudio log-mel"),
                             ("ingot whisper", "torch whisper"), ("ingot stft", "torch.stft")):
            if theirs in results:
                a, b = results[ours], results[theirs]
                err = float((a - b).abs().max() / b.abs().max())
                print(f"{label:>8} {ours} vs {theirs}: max |difference| / max |{theirs}| = {err:.2e}")
        for ours, theirs in ([(name, "torch.stft") for name in builders] +
                             [("ingot log-mel", "torch log-mel"), ("ingot log-mel", "torchaudio log-mel"),
                              ("ingot whisper", "torch whisper")]):
            if theirs in times and ours in times:
                print(f"{label:>8} ratio {theirs} / {ours} = {times[theirs] / times[ours]:.2f}")
        if args.skip_parts:
            continue
        # the fused chain's parts on the whole signal (one chunk): cuFFT of the strided frames, the kernels
        frames = x.as_strided((1 + (len(host) - N_FFT) // HOP, N_FFT), (HOP, 1))
        filters = audio.mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS)
        spectrum = torch.fft.rfft(frames)
        print(f"{label:>8} part: cuFFT rfft of the strided frames      {bench(lambda: torch.fft.rfft(frames)):8.3f} ms")
        filters_d = torch.from_numpy(filters).to(device)
        hann = 0.5 - 0.5 * torch.cos(2 * torch.pi * torch.arange(N_FFT, device=device, dtype=torch.float64) / N_FFT)
        power = torch.fft.rfft(frames.double() * hann).abs() ** 2                  # the window in time, float64
        reference = (filters_d.double() @ power.T).float()
        out = torch.empty((N_MELS, spectrum.shape[0]), dtype=torch.float32, device=device)
        spectrum_bytes = spectrum.numel() * 8 + out.numel() * 4

        def part(kernel: str, config: str, run) -> None:
            """Time one kernel configuration writing `out`, with its error against the float64 reference."""
            try:
                run()
                err = float((out - reference).abs().max() / reference.abs().max())
                rel = float(((out - reference).abs() / reference.abs().clamp_min(1e-30)).max())
                ms = bench(run)
                print(f"{label:>8} part: {kernel} {config:<32} {ms:8.3f} ms  {spectrum_bytes / ms / 1e9:.2f} TB/s  "
                      f"(vs float64: {err:.1e} of max, {rel:.1e} relative)", flush=True)
            except Exception as e:  # noqa: BLE001 (a tile that does not compile is reported, not fatal)
                print(f"{label:>8} part: {kernel} {config} failed: {type(e).__name__}: {str(e)[:200]}")

        for block_f, num_warps, ahead in ((128, 4, 1), (128, 4, 16), (64, 2, 16), (128, 4, 32)):
            unrolled = cuda_fft.MelProjection(filters_d, N_FFT, (0.5, 0.5),
                                              cuda_fft.unrolled_kernel(filters, N_FFT, (0.5, 0.5), ahead))
            part("unrolled kernel", f"F{block_f} warps {num_warps} ahead {ahead}",
                 lambda: cuda_fft.unrolled_mel(spectrum, unrolled, out, block_f, num_warps))
        power = spectrum = out = reference = None   # free the device memory before the next length
        copy = torch.empty_like(x)
        ms = bench(lambda: copy.copy_(x))
        print(f"{label:>8} device copy of the signal: {ms:.3f} ms = {2 * x.numel() * 4 / ms / 1e9:.2f} TB/s")
        del results, anchors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (BLAS and FFT use their defaults)")
    ap.add_argument("--durations", default="60,3600", help="signal lengths in seconds, comma-separated")
    ap.add_argument("--skip", default="", help="anchors to leave out: librosa,torch")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--quick", action="store_true", help="cuda: only the default log-mel, Whisper and STFT graphs")
    ap.add_argument("--skip-parts", action="store_true", help="cuda: not the per-kernel timings of the chain's parts")
    ap.add_argument("--also", default="", help="cuda --quick: log-mel variants to add, e.g. 'ahead 8,one stream'")
    args = ap.parse_args()
    if args.device == "cuda":
        return cuda_main(args)
    skip = set(filter(None, args.skip.split(",")))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}", end="")
    if "torch" not in skip:
        import torch
        torch.set_num_threads(args.threads)
        print(f", torch {torch.__version__} ({args.threads} threads)", end="")
    if "librosa" not in skip:
        import librosa
        print(f", librosa {librosa.__version__}", end="")
    print()
    print(f"{'signal':>8} {'workload':>8} {'ingot ms':>9} {'librosa ms':>11} {'torch ms':>9} {'librosa/ingot':>14} "
          f"{'torch/ingot':>12} {'compile s':>10}")
    for seconds in (float(s) for s in args.durations.split(",")):
        x = make_signal(seconds)
        repeats = args.repeats if seconds <= 600 else max(1, min(args.repeats, 3))
        ingot = ingot_runners(x)
        anchors = {"librosa": {} if "librosa" in skip else librosa_runners(x),
                   "torch": {} if "torch" in skip else torch_runners(x)}
        for workload, (run, compile_s) in ingot.items():
            medians = median_times({"ingot": run, **{name: r[workload] for name, r in anchors.items() if workload in r}},
                                   repeats)
            ours = medians["ingot"]
            theirs = {name: medians.get(name) for name in anchors}
            cell = lambda t: f"{t * 1e3:.1f}" if t is not None else "-"  # noqa: E731
            ratio = lambda t: f"{t / ours:.2f}" if t is not None else "-"  # noqa: E731
            label = f"{seconds:g} s" if seconds < 60 else f"{seconds / 60:g} min" if seconds < 3600 else f"{seconds / 3600:g} h"
            print(f"{label:>8} {workload:>8} {cell(ours):>9} {cell(theirs['librosa']):>11} {cell(theirs['torch']):>9} "
                  f"{ratio(theirs['librosa']):>14} {ratio(theirs['torch']):>12} {compile_s:>10.2f}", flush=True)
        del ingot, anchors
        peak = peak_memory_mb(lambda: ingot_runners(x, "log-mel")["log-mel"][0]())  # compile (planned buffers) and run
        print(f"{'':>8} ingot log-mel peak traced memory {peak:.0f} MB, compile and run (signal {x.nbytes / 1e6:.0f} MB, "
              f"output {N_MELS * (1 + len(x) // HOP) * 4 / 1e6:.0f} MB)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
