"""ONNX models on a GPU: Ingot (ingot.from_onnx, device="cuda") against PyTorch eager running the
module the ONNX file was exported from (same random weights), in one process on the same input.

The models are the issue's classes (scripts/): MobileNetV3-, YOLOv8- and DBNet-style convolutional
nets, a CRNN with a two-layer bidirectional LSTM, an LSTM voice-activity model with If on its sample
rate, and a BERT-like encoder. Each run goes host to host for both (the input copied to the device,
the outputs copied back), as a caller with NumPy arrays sees it. --precision sets Ingot's
cuda.float32_precision and torch's TF32 switches (cuDNN and cuBLAS) alike: "ieee" exact float32
(both), "tf32" tensor-core float32 (torch eager's default for convolutions).

    python -m benchmarks onnx-cuda                          # all, 50 interleaved runs, ieee and tf32
    python -m benchmarks onnx-cuda --models crnn,vad --runs 200 --precision ieee

Prints per model and precision the median wall time of one run of each, the ratio torch / Ingot
(> 1: Ingot is faster) and the largest difference between their first outputs (relative to the
largest value where that exceeds 1). Needs an NVIDIA GPU, torch, triton and onnx.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.onnx_vision import script   # a module of scripts/

MODELS = ("mobilenet", "yolo", "dbnet", "crnn", "vad", "encoder")


def case(name: str, folder: Path):
    """(torch module, ONNX path, feeds as NumPy arrays, a function of the feeds calling the module)."""
    import numpy as np
    import torch
    rng = np.random.default_rng(0)
    if name == "vad":
        module, _ = script("voice_activity").export_voice_activity(folder / "vad.onnx", batch=1, samples=512)
        h = np.zeros((1, 1, 32), np.float32)
        feeds = {"audio": rng.standard_normal((1, 512)).astype(np.float32), "sr": np.array(16000, np.int64), "h": h, "c": h}
        return module, folder / "vad.onnx", feeds, lambda t: module(t["audio"], t["sr"], t["h"], t["c"])
    if name == "encoder":
        fixtures = script("make_onnx_fixtures")
        torch.manual_seed(0)
        config = dict(hidden=128, heads=4, ffn=512, layers=2, max_len=128)
        path = fixtures.export_encoder(folder / "encoder.onnx", batch=1, length=128, **config)
        torch.manual_seed(0)     # export_encoder seeds 0 and builds Encoder(**config): the same weights
        module = fixtures.Encoder(**config).eval()
        ids, mask = (t.numpy() for t in fixtures.encoder_inputs(1, 128))
        return module, path, {"input_ids": ids, "attention_mask": mask}, \
            lambda t: module(t["input_ids"], t["attention_mask"])
    models = script("vision_models")
    path = models.export(name, folder / f"{name}.onnx")
    x = rng.standard_normal(models.MODELS[name][1]).astype(np.float32)
    module = models.random_model(name)
    return module, path, {"image": x}, lambda t: module(t["image"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--precision", default="ieee,tf32", help="comma-separated: ieee, tf32")
    args = p.parse_args()
    import numpy as np
    import torch

    import ingot
    from ingot.backends.cuda.device import device_name
    from ingot.options import CompileOptions, CudaOptions
    device = device_name()     # "cpu" under INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1: a dry run of this script
    if device == "cuda" and not torch.cuda.is_available():
        print("onnx-cuda: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if device == "cuda" else "no GPU (the interpreter)"
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"no model {unknown[0]!r} (have {', '.join(MODELS)})", file=sys.stderr)
        return 2
    print(f"# {gpu}, torch {torch.__version__}, {args.runs} interleaved runs, ms, host to host")
    print(f"{'model':<10} {'precision':<9} {'ingot':>8} {'torch':>8} {'ratio':>6} {'max diff':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            module, path, feeds, call = case(name, Path(folder))
            module = module.to(device).eval()
            for precision in args.precision.split(","):
                tf32 = precision == "tf32"
                exe = ingot.from_onnx(str(path), device="cuda",
                                      options=CompileOptions(cuda=CudaOptions(float32_precision=precision)))

                def eager():
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    with torch.inference_mode(), torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
                        out = call({k: torch.from_numpy(np.asarray(v)).to(device) for k, v in feeds.items()})
                        first = out[0] if isinstance(out, (tuple, list)) else out
                        return first.float().cpu().numpy()

                def ours():
                    return np.asarray(exe.run(feeds)[0])

                got, want = ours(), eager()
                diff = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1.0))
                times = {"ingot": [], "torch": []}
                for _ in range(args.runs):
                    for key, fn in (("ingot", ours), ("torch", eager)):
                        t = time.perf_counter()
                        fn()
                        times[key].append(time.perf_counter() - t)
                mine, theirs = (statistics.median(times[k]) * 1e3 for k in ("ingot", "torch"))
                print(f"{name:<10} {precision:<9} {mine:>8.3f} {theirs:>8.3f} {theirs / mine:>6.2f} {diff:>9.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
