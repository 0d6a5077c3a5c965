"""`ingot generate --tensor-parallel N`: N ranks, one process each, rank 0 reading the prompt and
printing; also the rank body when torchrun started this process (`torchrun --nproc-per-node N -m
ingot generate ...`).

Everything that can be refused is checked in the parent before a process starts: the flags, the
prompt, the model's header and config (no weight is converted), and whether N splits it
(passes/shard.check_tensor_parallel). Each rank then loads its shard and runs the same greedy (or
identically seeded) generation in lock step: the logits after all_gather are the same on every
rank, so every rank picks the same tokens and issues the same collectives.
"""
from __future__ import annotations

import dataclasses
import os
import sys

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


def generate_parallel(args) -> int:
    """`ingot generate` over N ranks; returns the exit code (2: refused, with one sentence on stderr)."""
    from ..cli import _read_prompt

    ranks = _ranks(args)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        prompt = _read_prompt(args) if rank == 0 else None
        _check_model(args, ranks)
        init(rank, ranks, args.device)
        try:
            return _rank_generate(rank, ranks, args, prompt)
        finally:
            shutdown()
    prompt = _read_prompt(args)
    _check_model(args, ranks)
    _dist()                                        # torch is there (else one sentence, exit 2)
    if ranks == 1:
        from ..cli import _generate_with, _load_llm
        return _generate_with(args, _load_llm(args), prompt)
    import torch.multiprocessing as mp

    try:
        launch(_rank_main, ranks, args, prompt, device=args.device)
    except mp.ProcessExitedException as e:   # a rank refused something: it printed why
        return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    return 0


def _rank_main(rank: int, ranks: int, args, prompt: str) -> None:
    """A spawned rank: IngotError -> its sentence on stderr and exit code 2, as the CLI does."""
    try:
        code = _rank_generate(rank, ranks, args, prompt)
    except IngotError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    if code:
        sys.stdout.flush()
        os._exit(code)   # spawn's join reports the code (SystemExit would be taken for a crash)


def _rank_generate(rank: int, ranks: int, args, prompt: str | None) -> int:
    from ..cli import _generate_with, _loras, _sampling
    from ..llm import load
    from ..options import CompileOptions

    prompt = broadcast_text(prompt)
    options = CompileOptions.from_environment()
    if args.device == "cpu" and options.cpu.threads is None:   # the cores shared among the ranks, not each all of them
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        options = dataclasses.replace(options, cpu=dataclasses.replace(options.cpu, threads=max(1, cores // ranks)))
    quiet = open(os.devnull, "w") if rank else None
    if quiet is not None:
        sys.stdout = quiet                                    # rank 0 alone prints
    llm = load(args.model, device=args.device, context=args.context, lora=_loras(args), options=options,
               tensor_parallel=ranks)
    if rank == 0:
        print(llm.describe() + f", tensor parallel over {ranks} ranks", file=sys.stderr, flush=True)
    stderr = sys.stderr
    sys.stderr = quiet or stderr                              # (a seed chosen is printed once)
    sampling = _sampling(args, llm)
    sys.stderr = stderr
    sampling["seed"] = broadcast_int(sampling["seed"])        # every rank draws the same numbers
    return _generate_with(args, llm, prompt, sampling)
