"""Quantization head to head with llama.cpp's quantizer on the default model (the BENCHMARKS.md
"Quantization" table): bits per weight, bytes on disk, mean KLD, top-1 agreement and perplexity
against the float model, every row scored by the same evaluator.

The float weights: the default model's tensors dequantized to float32 and written as an F32 GGUF
(the gguf library; metadata and tokenizer copied from the original file). llama.cpp's rows run
`llama_cpp.llama_model_quantize` (llama-cpp-python) on that file and are read back by Ingot's GGUF
importer, which converts Q4_0, Q5_0, Q8_0, Q3_K..Q6_K, IQ4_NL and IQ4_XS bit-exactly; Ingot's rows
run `ingot.quant` on the same floats. Every row is scored with `ingot.eval` over
tests/fixtures/eval_text.txt (llama.cpp's method: chunks of --context tokens from an empty cache,
the second half of each scored), against the F32 GGUF's own scoring.

bits per weight: the bits of every 2-D weight as stored (packed values and block parameters, and
for Ingot the compensation adapters) over their element count (the :k formats' parameters as codes
and units, as the package stores them; a second line gives the bits of codes a byte each, what the CPU
backend holds in memory without AVX-512: there it holds the float16 products, as :f16); disk MB: the GGUF file, or the
Ingot LLM package (written for the speed column or --save-packages; otherwise its tensors and adapters).

Ingot rows are FMT[+OPTION...]: +cal (quantizers weighted by calibration statistics), +awq (AWQ
scaling), +gptq (GPTQ), +cRANK (compensation adapters; +cRANK@GLOB|GLOB only on those weights, @head
the output head: `--compensate-only`; the head's bytes go to low-rank factors or residual rows, whichever
leaves the lower weighted error, and a tied head's correct the embedding lookup too; +lowrank or +rows forces one:
`--compensate-form`), +x (the tied embedding kept as the source
stores it), +only=GLOB (only the weights GLOB matches quantized, the rest kept float: a format on one
tensor, e.g. the default model's tied embedding, the one weight not on a 4-bit grid in its source),
+head=FMT (the output head, and a tied embedding, in FMT instead of int8), +bits=BPW (the
layer weights' formats allocated under that budget: `ingot quantize --bits`); `default` is
what `ingot quantize IN -o OUT` does with no flags, and FMT+default what it does with --format FMT
(calibrated AWQ for affine formats, GPTQ, the output head in int8). Calibration always comes
from Ingot's shipped corpus (ingot/data/calibration.txt), never from the scored text.

Decode tok/s (CPU): every row's file (llama.cpp's GGUF, Ingot's package) loaded by its own engine
(benchmarks/cpu_llm.py's IngotEngine and LlamaCppEngine, --threads threads each), then decoded with
cpu_llm's interleaved method: rounds of one prefill (--speed-prompt tokens) and 128 greedy decode
steps per row, the first round a warm-up, medians of --speed-repeats rounds; --speed-repeats 0 skips it.
CUDA decode: Ingot's package on the GPU (ingot.llm.load(device="cuda")), the same loop; "not run"
without a GPU.

    python -m benchmarks quant [--llama Q4_0,Q4_K_M,...] [--rows default,int4:64,...] [--chunks 3]
                               [--speed-repeats 3] [--threads 1] [--json OUT]
"""
from __future__ import annotations

import argparse
import ctypes
import fnmatch
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# llama.cpp's file types (llama.h, enum llama_ftype)
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q8_0": 7, "Q3_K_M": 12, "Q4_K_S": 14, "Q4_K_M": 15,
                "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}
LLAMA_ROWS = ["Q4_0", "Q4_K_M", "IQ4_XS", "Q3_K_M"]
ROWS = ["int4:64", "uint4:128", "default", "default+c8", "lut4:g8+cal"]


def gguf_weight_bits(path) -> tuple[int, int]:
    """(bits, elements) of a GGUF file's 2-D tensors as stored."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    return sum(8 * int(t.n_bytes) for t in matrices), sum(int(t.n_elements) for t in matrices)


@contextmanager
def stderr_to(path):
    """The process's file descriptor 2 (llama.cpp's C logging) sent to a file for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def llama_quantize(source: Path, out: Path, name: str, log: Path) -> str | None:
    """Run llama.cpp's quantizer; None when it wrote out, else why not (one line)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[name]
    params.nthread = 2
    with stderr_to(log):
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return f"llama_model_quantize returned {rc}: {tail[0] if tail else 'no message'}"
    return None


def decode_speeds(files: list[tuple[str, str, str]], threads: int, repeats: int, n_prompt: int,
                  devices: tuple[str, ...] = ("cpu", "cuda")) -> dict:
    """{label: (cpu tok/s or None, cuda tok/s or a reason)} for (label, kind, path) rows, kind
    "llama.cpp" or "Ingot": cpu_llm's interleaved rounds over every row's engine at once, on `devices`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_llm

    n_decode = 128
    context = max(n_prompt, 32 + n_decode) + 16
    engines = []
    for label, kind, path in files if "cpu" in devices else ():
        try:
            e = (cpu_llm.LlamaCppEngine(path, context, threads, context) if kind == "llama.cpp"
                 else cpu_llm.IngotEngine(path, context, "float32", threads))
        except RuntimeError as err:
            print(f"{label}: not measured ({err})", file=sys.stderr)
            continue
        e.name = label
        engines.append(e)
    cpu = cpu_llm.interleaved(engines, n_prompt, n_decode, 32, repeats) if engines else {}
    try:
        import torch
        gpu = torch.cuda.is_available() and "cuda" in devices
    except ImportError:
        gpu = False
    cuda = {}
    if gpu:
        gpu_engines = []
        for label, kind, path in files:   # llama.cpp's files too: Ingot's CUDA backend reads the GGUF types
            try:
                e = cpu_llm.IngotEngine(path, context, "float32", None, device="cuda")
            except Exception as err:   # a type Ingot's CUDA backend refuses is reported in the cell
                cuda[label] = f"not run ({type(err).__name__}: {str(err)[:80]})"
                continue
            e.name = label
            gpu_engines.append(e)
        cuda |= {k: v["decode_tok_s"] for k, v in cpu_llm.interleaved(gpu_engines, n_prompt, n_decode, 32, repeats).items()
                 if isinstance(v, dict)}
    return {label: (cpu[label]["decode_tok_s"] if label in cpu else None,
                    cuda.get(label, "not run" + ("" if gpu else " (no GPU)")))
            for label, _, _ in files} | {"loadavg": cpu.get("loadavg", [])}


def ingot_row(source, row: str, stats: dict):
    """quantize_model's result for an Ingot row spec (see the module docstring)."""
    from ingot.quant.pipeline import DEFAULT_FORMAT, quantize_default, quantize_model

    from ingot.quant.pipeline import DEFAULT_TENSOR_FORMATS, default_head

    fmt, *options = row.split("+")
    rank = next((int(o[1:].partition("@")[0]) for o in options if o[:1] == "c" and o[1:].partition("@")[0].isdigit()), 0)
    sites = [g for o in options if o[:1] == "c" and "@" in o for g in o.partition("@")[2].split("|")]
    sites = [s for g in sites for s in (("token_embd.weight", "output.weight") if g == "head" else (g,))]
    head = next((o[5:] for o in options if o.startswith("head=")), None)
    bits = next((float(o[5:]) for o in options if o.startswith("bits=")), None)
    form = "low_rank" if "lowrank" in options else "rows" if "rows" in options else "auto"
    if fmt == "default" or "default" in options:
        tensor_formats = DEFAULT_TENSOR_FORMATS if head is None else [("token_embd.weight", head), ("output.weight", head)]
        if head is None:   # the CLI's rule for a large head
            tensor_formats, head_rank, head_sites = default_head(source, stats, compensate=rank, bits=bits)
            rank, sites = (head_rank, head_sites) if head_rank else (rank, sites)
        return quantize_default(source, DEFAULT_FORMAT if fmt == "default" else fmt, stats=stats, compensate=rank,
                                tensor_formats=tensor_formats, bits=bits, compensate_sites=sites, compensate_form=form)
    exclude = ["token_embd.weight"] if "x" in options else []
    only = next((o[5:] for o in options if o.startswith("only=")), None)
    if only:   # only these weights quantized, the others kept float: a format measured on one tensor
        exclude += [n for name in source.tensors for n in name.split("+") if not fnmatch.fnmatch(n, only)]
    use_stats = rank or {"awq", "cal", "gptq"} & set(options)
    heads = [("token_embd.weight", head), ("output.weight", head)] if head else []
    return quantize_model(source, fmt, stats=stats if use_stats else None, compensate=rank, awq="awq" in options,
                          gptq="gptq" in options, exclude=exclude, compensate_sites=sites, compensate_form=form,
                          tensor_formats=heads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama", default=",".join(LLAMA_ROWS), help="llama.cpp file types, comma-separated ('' for none)")
    parser.add_argument("--rows", default=",".join(ROWS), help="Ingot rows, comma-separated: FMT[+cal][+awq][+gptq][+cRANK][+x], default, FMT+default[+cRANK]")
    parser.add_argument("--model", help="the GGUF file whose weights, dequantized, are the reference (default: the default model)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=3, help="chunks of the eval text scored (at most 5)")
    parser.add_argument("--workdir", help="where the F32 GGUF and llama.cpp's files go (default: a temporary folder)")
    parser.add_argument("--save-packages", action="store_true", help="write each Ingot row's package to measure it on disk")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--speed-repeats", type=int, default=3, help="interleaved decode rounds after the warm-up (0: no speed column)")
    parser.add_argument("--speed-prompt", type=int, default=64, help="prefill tokens per round of the speed rounds")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every engine in the speed rounds")
    parser.add_argument("--devices", default="cpu,cuda", help="where the speed rounds run (cuda: where a GPU is)")
    args = parser.parse_args()

    from ingot.convert import disk_bytes
    from ingot.eval import chunks, compare, score
    from ingot.llm.generate import default_model_path
    from ingot.llm.package import StoredModel, open_model, save_llm
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.export import write_float_gguf
    from ingot.quant.formats import tensor_nbytes
    from ingot.quant.pipeline import calibrate, default_calibration_text, float_weights

    t0 = time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ingot-quant-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = args.model or default_model_path()
    source = open_model(path)
    float_path = workdir / "float32.gguf"
    if not float_path.is_file():
        write_float_gguf(path, dict(float_weights(source)), float_path)
    reference = open_model(str(float_path))
    text = (ROOT / "tests/fixtures/eval_text.txt").read_text()
    token_chunks = chunks(tokenize(reference, text), args.context)[:args.chunks]
    scored_ref = score(reference, token_chunks)
    print(f"reference: {float_path.name} ({disk_bytes(float_path) / 1e6:.0f} MB, float32 from {Path(path).name}); "
          f"{len(token_chunks)} chunks of {args.context} tokens of tests/fixtures/eval_text.txt, {len(scored_ref.targets)} "
          f"scored; PPL {np.exp(-scored_ref.logprobs[np.arange(len(scored_ref.targets)), scored_ref.targets].mean()):.3f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    results = []
    speed_files = []   # (label, "llama.cpp" or "Ingot", path) for the decode-speed rounds
    header = "| quantizer | format | bits/weight | disk MB | mean KLD | KLD p99 | top-1 | PPL | quantize s |"
    print(header + "\n|" + " --- |" * 2 + " ---: |" * 7, flush=True)

    def report(quantizer, row, bits, elements, disk, model, seconds, notes=(), memory_bits=None):
        """memory_bits: the bits in memory where they differ from those stored."""
        r = compare(scored_ref, score(model, token_chunks))
        entry = {"quantizer": quantizer, "row": row, "bpw": bits / elements, "disk_bytes": disk, "mean_kld": r.mean_kld,
                 "kld_p99": r.kld_p99, "top1": r.top1, "ppl": r.ppl_model, "ppl_reference": r.ppl_reference,
                 "quantize_s": seconds, "notes": list(notes)}
        if memory_bits is not None and memory_bits != bits:   # bits: as stored; memory_bits: as the kernels hold them
            entry["bpw_in_memory"] = memory_bits / elements
        results.append(entry)
        print(f"| {quantizer} | {row} | {bits / elements:.3f} | {disk / 1e6:.1f} | {r.mean_kld:.4f} | {r.kld_p99:.3f} | "
              f"{100 * r.top1:.1f}% | {r.ppl_model:.2f} | {seconds:.0f} |", flush=True)
        if "bpw_in_memory" in entry:
            print(f"|  | (in CPU memory: {entry['bpw_in_memory']:.3f} bits/weight: affine :k parameters as codes a byte each "
                  "(on AVX-512 as float16 products), tables' as float16 products) |",
                  flush=True)

    for name in [n for n in args.llama.split(",") if n]:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(f"| llama.cpp | {name} | (llama-cpp-python is not installed) |", flush=True)
            continue
        out = workdir / f"llama-{name}.gguf"
        t = time.perf_counter()
        refused = llama_quantize(float_path, out, name, workdir / f"llama-{name}.log")
        seconds = time.perf_counter() - t
        if refused:
            print(f"| llama.cpp | {name} | refused: {refused} |", flush=True)
            continue
        bits, elements = gguf_weight_bits(out)
        report("llama.cpp", name, bits, elements, disk_bytes(out), open_model(str(out)), seconds)
        if args.speed_repeats:
            speed_files.append((name, "llama.cpp", str(out)))
        else:
            out.unlink()

    stats = calibrate(source, tokenize(source, default_calibration_text()), context=args.context)  # ingot/data/calibration.txt
    for row in [r for r in args.rows.split(",") if r]:
        t = time.perf_counter()
        result = ingot_row(source, row, stats)
        seconds = time.perf_counter() - t
        matrices = [(n, v) for n, v in result.tensors.items() if len(getattr(v, "shape", ())) == 2]
        stored = lambda v: getattr(v, "two_level_nbytes", tensor_nbytes(v))  # noqa: E731  (:k formats: two-level)
        bits = 8 * (sum(stored(v) for _, v in matrices) + result.adapter_bytes)
        in_memory = lambda v: getattr(v, "two_level_memory_nbytes", tensor_nbytes(v))  # noqa: E731  (on the CPU)
        memory_bits = 8 * (sum(in_memory(v) for _, v in matrices) + result.adapter_bytes)
        elements = sum(int(np.prod(v.shape)) for _, v in matrices)
        disk = sum(stored(v) for v in result.tensors.values()) + result.adapter_bytes
        if args.save_packages or args.speed_repeats:
            out = workdir / ("ingot-" + "".join(c if c.isalnum() else "_" for c in row) + ".ingot")
            save_llm(out, source.config, result.tensors, source.metadata, result.adapters or None,
                     architecture=source.architecture)
            disk = disk_bytes(out)
            if args.speed_repeats:
                speed_files.append((row, "Ingot", str(out)))
        model = StoredModel(path, source.architecture, source.metadata, result.tensors, source.config, result.adapters)
        report("Ingot", row, bits, elements, disk, model, seconds, result.notes, memory_bits)
    if speed_files:
        print(f"decode speed: {len(speed_files)} rows interleaved, {args.speed_repeats} rounds after a warm-up, "
              f"{args.threads} thread(s) each, {args.speed_prompt}-token prefill + 128 decode steps a round", flush=True)
        speeds = decode_speeds(speed_files, args.threads, args.speed_repeats, args.speed_prompt,
                               tuple(args.devices.split(",")))
        print("| quantizer | format | mean KLD | bits/weight | CPU decode tok/s | CUDA decode tok/s |\n|" + " --- |" * 2
              + " ---: |" * 4)
        for entry in results:
            label = entry["row"]
            cpu, cuda = speeds.get(label, (None, "not run"))
            entry["cpu_decode_tok_s"], entry["cuda_decode_tok_s"] = cpu, cuda
            print(f"| {entry['quantizer']} | {label} | {entry['mean_kld']:.4f} | {entry['bpw']:.3f} | "
                  f"{'not run' if cpu is None else f'{cpu:.1f}'} | {cuda if isinstance(cuda, str) else f'{cuda:.1f}'} |",
                  flush=True)
        print(f"load average (1 min) before, after each speed round: {speeds['loadavg']}")
        for label, kind, path in speed_files:
            if kind == "llama.cpp" or not args.save_packages:
                shutil.rmtree(path) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)
    print(f"[{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; total {time.perf_counter() - t0:.0f} s; files in {workdir}]")
    if args.json:
        Path(args.json).write_text(json.dumps({"reference_ppl": float(np.exp(-scored_ref.logprobs[
            np.arange(len(scored_ref.targets)), scored_ref.targets].mean())), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
