"""`ingot generate --tensor-parallel N`: N ranks, one process each, rank 0 reading the prompt and
printing; also the rank body when torchrun started this process (`torchrun --nproc-per-node N -m
ingot generate ...`).

Everything that can be refused is checked in the parent before a process starts: the flags, the
prompt, the model's header and config (no weight is converted), and whether N splits it
(passes/shard.check_tensor_parallel). Each rank then loads its shard and runs the same greedy (or
identically seeded) generation in lock step: the logits after all_gather are the same on every
rank, so every rank picks the same tokens and issues the same collectives.

The CLI (ingot/cli.py, which imports this module) passes in what is its own: reading the prompt and
one rank's generation with its flags (cli._generate_rank).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

from ..errors import IngotError
from . import _dist, broadcast_int, broadcast_text, init, launch, shutdown, under_torchrun


def _ranks(args) -> int:
    """--tensor-parallel, checked; under torchrun its WORLD_SIZE (which --tensor-parallel must equal)."""
    n = args.tensor_parallel
    if n is not None and n < 1:
        raise IngotError(f"--tensor-parallel must be >= 1, not {n}.")
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if n is not None and n != size:
            raise IngotError(f"--tensor-parallel {n} differs from torchrun's {size} processes.")
        return size
    return 1 if n is None else n


def _check_model(args, ranks: int) -> None:
    """The model's header and config read (no weight converted) and the split checked."""
    from ..llm.generate import default_model_path
    from ..llm.package import open_model
    from ..passes.shard import check_tensor_parallel

    if args.lora and ranks > 1:
        raise IngotError("--tensor-parallel: LoRA adapters (--lora) are not supported yet.")
    check_tensor_parallel(open_model(args.model or default_model_path()).config, ranks)


def generate_parallel(args, read_prompt: Callable, generate: Callable) -> int:
    """`ingot generate` over N ranks; returns the exit code (2: refused, with one sentence on stderr).
    read_prompt(args) -> the prompt; generate(args, llm, prompt) -> exit code: one rank's generation
    (a module-level function: spawned ranks receive it pickled by name)."""
    ranks = _ranks(args)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        prompt = read_prompt(args) if rank == 0 else None
        _check_model(args, ranks)
        init(rank, ranks, args.device)
        try:
            return _rank_generate(rank, ranks, args, prompt, generate)
        finally:
            shutdown()
    prompt = read_prompt(args)
    _check_model(args, ranks)
    _dist()                                        # torch is there (else one sentence, exit 2)
    import torch.multiprocessing as mp

    try:
        launch(_rank_main, ranks, args, prompt, generate, device=args.device)
    except mp.ProcessExitedException as e:   # a rank refused something: it printed why
        return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    return 0


def _rank_main(rank: int, ranks: int, args, prompt: str, generate: Callable) -> None:
    """A spawned rank: IngotError -> its sentence on stderr and exit code 2, as the CLI does."""
    try:
        code = _rank_generate(rank, ranks, args, prompt, generate)
    except IngotError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    if code:
        sys.stdout.flush()
        os._exit(code)   # spawn's join reports the code (SystemExit would be taken for a crash)


def _rank_generate(rank: int, ranks: int, args, prompt: str | None, generate: Callable) -> int:
    from ..llm import load
    from ..options import CompileOptions

    prompt = broadcast_text(prompt)
    options = CompileOptions.from_environment()
    if args.device == "cpu" and options.cpu.threads is None:   # the cores shared among the ranks, not each all of them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        options = dataclasses.replace(options, cpu=dataclasses.replace(options.cpu, threads=max(1, cores // ranks)))
    if rank:
        sys.stdout = open(os.devnull, "w")                    # rank 0 alone prints
    llm = load(args.model, device=args.device, context=args.context, options=options, tensor_parallel=ranks,
               kv_dtype=getattr(args, "kv_dtype", None))
    if rank == 0:
        print(llm.describe() + f", tensor parallel over {ranks} ranks", file=sys.stderr, flush=True)
    return generate(args, llm, prompt)


def same_seed(settings: dict) -> dict:
    """Sampling settings with rank 0's seed on every rank (each may have drawn its own)."""
    return dict(settings, seed=broadcast_int(settings["seed"]))
