"""`ingot convert IN.(onnx|gguf) -o OUT.ingot [--quantize FMT] [--device cpu|cuda] [--input-shape NAME=D0,D1,...]
[--constant NAME=V0,V1,...]`
and `ingot quantize IN.(gguf|ingot) -o OUT.ingot --format FMT [--calibration TEXT] [--exclude GLOB]
[--compensate RANK] [--awq]`: the one way from a model file to an Ingot package.

An ONNX model becomes a compiled package (`ingot.load` runs it without the source file; its outputs
come back in the ONNX graph's output order). A GGUF language model becomes an Ingot LLM package
(ingot.llm.package: `ingot generate --model OUT.ingot`). `--quantize FMT` stores the weights of
matmuls (ONNX: every 2-D constant a MatMul or Gemm multiplies by; GGUF: every 2-D weight) in an
Ingot format (ingot.quant: int8, int4:32, lut4, ...), multiplied without a float copy.

    >>> import ingot.convert  # doctest: +SKIP
    >>> ingot.convert.convert("model.onnx", "model.ingot", quantize="int8")  # doctest: +SKIP

`ingot quantize` checks every input before any work (format, files, rank), so a bad one costs one
sentence and exit code 2 with nothing written; the package is written atomically at the end.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from .errors import IngotError
from .progress import progress_bar


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


def parse_constants(items: Sequence[str]) -> dict[str, list[float]]:
    """["sr=16000", "shape=2,3"] -> {"sr": [16000], "shape": [2, 3]}; IngotError naming a malformed item."""
    values = {}
    for item in items or ():
        name, sep, text = item.partition("=")
        try:
            numbers = [_number(v) for v in text.split(",") if v.strip()] if sep else None
        except ValueError:
            numbers = None
        if not name or not numbers:
            raise IngotError(f"--constant {item!r} is not NAME=V0,V1,... (numbers).")
        values[name] = numbers
    return values


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def constant_arrays(model, values: Mapping[str, Sequence[float]], what: str) -> dict:
    """Each named input's values as an array of its declared dtype, in its declared shape when that
    is static and holds as many values (else a scalar for one value, a vector for more)."""
    import numpy as np

    from .importers.onnx_ops import ONNX_DTYPES
    declared = {vi.name: vi for vi in model.graph.input}
    arrays = {}
    for name, numbers in values.items():
        if name not in declared:
            raise IngotError(f"{what}: --constant names {name!r}, which is not an input of the model "
                             f"(inputs: {list(declared)}).")
        t = declared[name].type.tensor_type
        dtype = ONNX_DTYPES[t.elem_type][1] if t.elem_type in ONNX_DTYPES else np.float32
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in t.shape.dim]
        array = np.array(numbers).astype(dtype)
        if t.HasField("shape") and None not in dims and int(np.prod(dims)) == array.size:
            array = array.reshape(dims)
        elif array.size == 1:
            array = array.reshape(())
        arrays[name] = array
    return arrays


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
            input_shapes: Mapping[str, Sequence[int]] | None = None,
            constants: Mapping[str, Sequence[float]] | None = None) -> str:
    """Convert an ONNX or GGUF file into an Ingot package at `output`; returns a one-line summary.
    constants: {input name: values} fixed at import (a sample rate, a shape); the package takes
    the other inputs only."""
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
        if input_shapes or constants:
            raise IngotError(f"convert: {'--input-shape' if input_shapes else '--constant'} applies to ONNX models, not GGUF.")
        return _convert_gguf(source, output, fmt, device, start)
    from .importers.onnx import compile_import, import_onnx, load_model, op_counts

    with progress_bar(f"convert {source.name}", total=3) as advance:
        advance("importing", steps=0)
        model = load_model(source, str(source))
        fixed = constant_arrays(model, constants or {}, str(source))
        imported = import_onnx(model, input_shapes, what=str(source), constant_inputs=fixed, quantize=fmt)
        advance("compiling")
        exe = compile_import(imported, device)
        advance("saving")
        exe.save(output)
        advance("saved")
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
        with progress_bar(f"quantize {fmt}", total=len(model.tensors)) as advance:
            result = quantize_model(model, fmt, progress=advance)
        tensors, adapters = result.tensors, (result.adapters or None)
        extra["quantized"] = {"format": str(fmt), "source": source.name}
    save_llm(output, model.config, tensors, model.metadata, adapters, architecture=model.architecture, extra=extra)
    note = "" if device == "cpu" else "; an LLM package picks its device when loaded (ingot generate --device cuda)"
    return (f"[{source} -> {output}: LLM package ({model.architecture}, {model.config.n_layers} layers"
            f"{', ' + str(fmt) if fmt else ''}), {time.perf_counter() - start:.1f} s{note}]")


def convert_command(args) -> int:
    summary = convert(args.input, args.output, device=args.device, quantize=args.quantize,
                      input_shapes=parse_input_shapes(args.input_shape), constants=parse_constants(args.constant))
    print(summary, file=sys.stderr)
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def disk_bytes(path) -> int:
    """The bytes a file, or every file under a folder (a package), takes on disk as written."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def default_eval_text() -> tuple[str, str]:
    """(name, text) of the short English text `ingot quantize` scores KLD on when given none."""
    from importlib.resources import files

    return "ingot/data/eval.txt", (files("ingot") / "data" / "eval.txt").read_text(encoding="utf-8")


def quantize_command(args) -> int:
    import numpy as np

    from .eval import chunks, compare, read_text, score
    from .llm.package import StoredModel, is_llm_package, open_model, save_llm
    from .llm.tokenizer import tokenize
    from .quant import parse_format
    from .quant.formats import tensor_nbytes
    from .quant.pipeline import (DEFAULT_FORMAT, HEAD_SHARE, calibrate, default_calibration_text, default_head,
                                 quantize_default)

    fmt = parse_format(args.format or DEFAULT_FORMAT)
    tensor_formats = []
    for item in args.tensor_format:
        glob, sep, tensor_fmt = item.partition("=")
        if not sep or not glob:
            raise IngotError(f"quantize: --tensor-format {item!r} is not GLOB=FMT (e.g. 'token_embd.weight=int8').")
        tensor_formats.append((glob, str(parse_format(tensor_fmt))))
    bits = getattr(args, "bits", None)
    if bits is not None and not 0 < bits <= 32:
        raise IngotError(f"quantize: --bits {bits} is not a budget in bits per weight (e.g. 4.5).")
    out = Path(args.output)
    if not str(out).endswith(".ingot"):
        raise IngotError(f"quantize: the output {out} should be a package directory named NAME.ingot.")
    if out.exists() and not is_llm_package(out) and not (out.is_dir() and not any(out.iterdir())):
        raise IngotError(f"quantize: {out} exists and is not an Ingot LLM package; refusing to replace it.")
    if not out.resolve().parent.is_dir():
        raise IngotError(f"quantize: the folder {out.resolve().parent} does not exist.")
    if args.compensate < 0:
        raise IngotError(f"quantize: --compensate takes a rank >= 1, not {args.compensate}.")
    if args.no_calibration and args.calibration:
        raise IngotError("quantize: give --calibration TEXT_FILE or --no-calibration, not both.")
    for method in ("awq", "gptq"):
        if args.no_calibration and getattr(args, method):
            raise IngotError(f"quantize: --{method} needs a calibration text (drop --no-calibration).")
    if args.awq and fmt.kind != "affine":
        raise IngotError(f"quantize: --awq applies to affine formats (int8, int4, ...), not {fmt}.")
    calibration_name, calibration = None, None
    if args.calibration:
        calibration_name, calibration = args.calibration, read_text(args.calibration)
    elif not args.no_calibration:
        calibration_name = "ingot/data/calibration.txt"
    eval_name, eval_text = (args.eval_text, read_text(args.eval_text)) if args.eval_text else (None, None)
    if eval_text is None and not args.no_eval:
        eval_name, eval_text = default_eval_text()
    if Path(args.input).resolve() == out.resolve():
        raise IngotError("quantize: the output would replace the input; choose another path.")
    model = open_model(args.input)
    err = sys.stderr
    if fmt.kind == "lut" and args.no_calibration:
        print("note: LUT tables fitted without calibration ignore which columns meet large activations; on "
              "SmolLM2 that costs far more than it saves (BENCHMARKS.md, Quantization).", file=err)
    stats = None
    if calibration_name is not None:
        print(f"calibrating on {calibration_name} ...", file=err)
        text = default_calibration_text() if calibration is None else calibration
        stats = calibrate(model, tokenize(model, text), context=args.context)
    compensate, sites = args.compensate, list(getattr(args, "compensate_only", []))
    head_formats, rank, head_sites = default_head(model, stats, tensor_formats, args.exclude, compensate, bits)
    if rank:
        compensate, sites = rank, head_sites
        print(f"note: the output head is over {HEAD_SHARE:.0%} of the weights: {fmt} with rank {rank}'s bytes of "
              f"compensation on it, not int8 (--tensor-format {sites[0]}=int8 keeps int8).", file=err)
    names = list(model.tensors)
    with progress_bar(f"quantize {fmt}", total=len(names)) as advance:
        done = set()

        def step(name: str) -> None:
            done.add(name)
            advance(name, steps=1 if len(done) <= len(names) else 0)
        result = quantize_default(model, fmt, stats=stats, compensate=compensate, exclude=args.exclude,
                                  compensate_sites=sites, compensate_form=getattr(args, "compensate_form", "auto"),
                                  awq=args.awq, gptq=args.gptq, tensor_formats=tensor_formats + head_formats,
                                  bits=bits, progress=step)
    methods = {"awq": any(n.startswith("AWQ") for n in result.notes), "gptq": any(n.startswith("GPTQ") for n in result.notes)}
    extra = {"quantized": {"format": str(fmt), "tensor_formats": tensor_formats + head_formats,
                           "exclude": list(args.exclude), "compensate": compensate, "bits": bits,
                           "compensate_only": sites,
                           "compensate_form": getattr(args, "compensate_form", "auto"),
                           **methods, "calibration": Path(calibration_name).name if calibration_name else None,
                           "source": Path(args.input).name}}
    architecture = model.architecture  # a package says what its family is
    save_llm(out, model.config, result.tensors, model.metadata, result.adapters if result.adapters else None,
             architecture=architecture, extra=extra)
    # sizes as the disk holds them (`du --apparent-size`), not the tensors' bytes: the package's graph,
    # KV cache initial values and metadata count too
    before, after = disk_bytes(args.input), disk_bytes(out)
    matrices = [t for t in result.tensors.values() if len(getattr(t, "shape", ())) == 2]
    stored = lambda t: getattr(t, "two_level_nbytes", tensor_nbytes(t))  # noqa: E731  (:k parameters as the package stores them)
    bits = 8 * (sum(stored(t) for t in matrices) + result.adapter_bytes) / max(1, sum(int(np.prod(t.shape)) for t in matrices))
    print(f"[{args.input}: {_mb(before)} -> {out}: {_mb(after)} on disk ({after / max(before, 1):.2f}x), "
          f"{bits:.2f} bits per weight" + (f", of which adapters {_mb(result.adapter_bytes)}" if result.adapter_bytes else "")
          + f"; weight error ||W - W_hat|| / ||W|| mean {result.mean_relative_error:.4f}]")
    for note in result.notes:
        print(f"  note: {note}", file=err)
    if eval_text is not None:
        token_chunks = chunks(tokenize(model, eval_text), min(args.context, model.config.context_length))
        quantized = StoredModel(str(out), model.architecture, model.metadata, result.tensors, model.config, result.adapters)
        with progress_bar("KLD", total=2 * len(token_chunks)) as advance:
            reference = score(open_model(args.input), token_chunks, progress=lambda: advance("reference"))
            r = compare(reference, score(quantized, token_chunks, progress=lambda: advance("quantized")))
        print(f"[vs {Path(args.input).name} over {eval_name}: {r.row()}]")
    return 0

