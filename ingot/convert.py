"""`ingot convert IN.(onnx|gguf) -o OUT.ingot [--quantize FMT] [--device cpu|cuda] [--input-shape NAME=D0,D1,...]`.

An ONNX model becomes a compiled package (`ingot.load` runs it without the source file; its outputs
come back in the ONNX graph's output order). A GGUF language model becomes an Ingot LLM package
(ingot.llm.package: `ingot generate --model OUT.ingot`). `--quantize FMT` stores the weights of
matmuls (ONNX: every 2-D constant a MatMul or Gemm multiplies by; GGUF: every 2-D weight) in an
Ingot format (ingot.quant: int8, int4:32, lut4, ...), multiplied without a float copy.

    >>> import ingot.convert  # doctest: +SKIP
    >>> ingot.convert.convert("model.onnx", "model.ingot", quantize="int8")  # doctest: +SKIP
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from .errors import IngotError


def parse_input_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """["input_ids=1,128", ...] -> {"input_ids": (1, 128)}; IngotError naming a malformed item."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip()) if sep else None
        except ValueError:
            shape = None
        if not name or shape is None or any(d < 0 for d in shape):
            raise IngotError(f"--input-shape {item!r} is not NAME=D0,D1,... (non-negative integers).")
        shapes[name] = shape
    return shapes


def _kind(path: Path) -> str:
    """'onnx' or 'gguf', by the file's first bytes (GGUF's magic), else by its suffix."""
    if not path.exists():
        raise IngotError(f"convert: {path}: the file does not exist.")
    if not path.is_file():
        raise IngotError(f"convert: {path}: is not a file.")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        return "gguf"
    if path.suffix.lower() == ".gguf":
        raise IngotError(f"convert: {path}: is not a GGUF file (it does not start with the GGUF magic).")
    return "onnx"


def convert(source, output, device: str = "cpu", quantize: str | None = None,
            input_shapes: Mapping[str, Sequence[int]] | None = None) -> str:
    """Convert an ONNX or GGUF file into an Ingot package at `output`; returns a one-line summary."""
    source, output = Path(source), Path(output)
    if not str(output).endswith(".ingot"):
        raise IngotError(f"convert: the output {output} should be a package directory named NAME.ingot.")
    if not output.resolve().parent.is_dir():
        raise IngotError(f"convert: the folder {output.resolve().parent} does not exist.")
    if output.exists() and not output.is_dir():
        raise IngotError(f"convert: {output} exists and is not a package directory; refusing to replace it.")
    if device not in ("cpu", "cuda"):
        raise IngotError(f"convert: unknown device {device!r} (have 'cpu', 'cuda').")
    fmt = None
    if quantize:
        from .quant import parse_format
        fmt = parse_format(quantize)
    kind = _kind(source)
    start = time.perf_counter()
    if kind == "gguf":
        if input_shapes:
            raise IngotError("convert: --input-shape applies to ONNX models, not GGUF.")
        return _convert_gguf(source, output, fmt, device, start)
    from .importers.onnx import compile_import, import_onnx, op_counts

    imported = import_onnx(source, input_shapes, what=str(source), quantize=fmt)
    exe = compile_import(imported, device)
    exe.save(output)
    counts = op_counts(exe)
    fused = ", ".join(f"{counts[k]} {k}" for k in ("sdpa", "quantized_matmul") if counts[k])
    return (f"[{source} -> {output}: {len(imported.inputs)} inputs, {len(imported.outputs)} outputs, "
            f"{len(exe.program.nodes())} ops{' (' + fused + ')' if fused else ''}, {device}, "
            f"{time.perf_counter() - start:.1f} s]")


def _convert_gguf(source: Path, output: Path, fmt, device: str, start: float) -> str:
    from .llm.package import is_llm_package, open_model, save_llm

    if output.exists() and not is_llm_package(output) and any(output.iterdir()):
        raise IngotError(f"convert: {output} exists and is not an Ingot LLM package; refusing to replace it.")
    model = open_model(str(source))
    tensors, adapters, extra = model.tensors, None, {"converted": {"source": source.name}}
    if fmt is not None:
        from .quant.pipeline import quantize_model
        result = quantize_model(model, fmt)
        tensors, adapters = result.tensors, (result.adapters or None)
        extra["quantized"] = {"format": str(fmt), "source": source.name}
    save_llm(output, model.config, tensors, model.metadata, adapters, architecture=model.architecture, extra=extra)
    note = "" if device == "cpu" else "; an LLM package picks its device when loaded (ingot generate --device cuda)"
    return (f"[{source} -> {output}: LLM package ({model.architecture}, {model.config.n_layers} layers"
            f"{', ' + str(fmt) if fmt else ''}), {time.perf_counter() - start:.1f} s{note}]")


def convert_command(args) -> int:
    summary = convert(args.input, args.output, device=args.device, quantize=args.quantize,
                      input_shapes=parse_input_shapes(args.input_shape))
    print(summary, file=sys.stderr)
    return 0
