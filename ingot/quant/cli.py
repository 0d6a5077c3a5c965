"""`ingot quantize IN -o OUT.ingot --format FMT [--calibration TEXT] [--exclude GLOB] [--compensate RANK] [--awq]`.

Every input is checked before any work (format, files, rank), so a bad one costs one sentence
and exit code 2 with nothing written; the package is written atomically at the end.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import IngotError


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def quantize_command(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..eval import chunks, compare, read_text, score, tokenize
    from ..llm.package import StoredModel, is_llm_package, open_model, save_llm
    from .pipeline import activation_stats, quantize_model
    from .quantize import parse_format

    fmt = parse_format(args.format)
    out = Path(args.output)
    if not str(out).endswith(".ingot"):
        raise IngotError(f"quantize: the output {out} should be a package directory named NAME.ingot.")
    if out.exists() and not is_llm_package(out) and not (out.is_dir() and not any(out.iterdir())):
        raise IngotError(f"quantize: {out} exists and is not an Ingot LLM package; refusing to replace it.")
    if not out.resolve().parent.is_dir():
        raise IngotError(f"quantize: the folder {out.resolve().parent} does not exist.")
    if args.compensate < 0:
        raise IngotError(f"quantize: --compensate takes a rank >= 1, not {args.compensate}.")
    if args.awq and not args.calibration:
        raise IngotError("quantize: --awq needs --calibration TEXT_FILE.")
    calibration = read_text(args.calibration) if args.calibration else None
    eval_text = read_text(args.eval_text) if args.eval_text else calibration
    if Path(args.input).resolve() == out.resolve():
        raise IngotError("quantize: the output would replace the input; choose another path.")
    model = open_model(args.input)
    err = sys.stderr
    if fmt.kind == "lut" and calibration is None:
        print("note: LUT tables fitted without --calibration ignore which columns meet large activations; on "
              "SmolLM2 that costs far more than it saves (BENCHMARKS.md, Quantization).", file=err)
    stats = None
    if calibration is not None:
        print(f"calibrating on {args.calibration} ...", file=err)
        stats = activation_stats(model, calibration, context=args.context)
    names = list(model.tensors)
    with Progress(TextColumn("[bold]quantize[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as progress:
        task = progress.add_task(str(fmt), total=len(names))
        done = set()

        def step(name: str) -> None:
            done.add(name)
            progress.update(task, completed=min(len(done), len(names)), description=f"{fmt} {name}")
        result = quantize_model(model, fmt, exclude=args.exclude, stats=stats, compensate=args.compensate,
                                awq=args.awq, progress=step)
        progress.update(task, completed=len(names), description=str(fmt))
    extra = {"quantized": {"format": str(fmt), "exclude": list(args.exclude), "compensate": args.compensate,
                           "awq": bool(args.awq), "calibration": Path(args.calibration).name if args.calibration else None,
                           "source": Path(args.input).name}}
    architecture = "llama" if is_llm_package(args.input) else model.architecture
    save_llm(out, model.config, result.tensors, model.metadata, result.adapters if result.adapters else None,
             architecture=architecture, extra=extra)
    ratio = result.bytes_after / max(result.bytes_before, 1)
    print(f"[{args.input}: {_mb(result.bytes_before)} -> {out}: {_mb(result.bytes_after)} ({ratio:.2f}x)"
          + (f", of which adapters {_mb(result.adapter_bytes)}" if result.adapter_bytes else "")
          + f"; weight error ||W - W_hat|| / ||W|| mean {result.mean_relative_error:.4f}]")
    for note in result.notes:
        print(f"  note: {note}", file=err)
    if eval_text is not None:
        token_chunks = chunks(tokenize(model, eval_text), args.context)
        reference = score(open_model(args.input), token_chunks)
        quantized = StoredModel(str(out), model.architecture, model.metadata, result.tensors, model.config, result.adapters)
        r = compare(reference, score(quantized, token_chunks))
        print(f"[vs {Path(args.input).name} over {args.eval_text or args.calibration}: {r.row()}]")
    return 0
