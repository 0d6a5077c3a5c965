"""Tensor parallelism over torch.distributed: process groups (gloo on the CPU, NCCL on CUDA), the
collectives the backends lower all_reduce/all_gather to, and a launcher.

Ingot does not run its own distributed runtime: a rank is a process in a torch.distributed group,
started by `launch` (torch.multiprocessing, a free localhost port), by `ingot generate
--tensor-parallel N`, or by `torchrun --nproc-per-node N -m ingot ...` (its RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT environment). Every rank runs the same program on its slice of the
weights (ingot/passes/shard.py) in lock step; rank 0 does the I/O.

    >>> def work(rank, world):                                               # doctest: +SKIP
    ...     llm = ingot.llm.load(tensor_parallel=world)                      # this rank's shard
    ...     text = "".join(t.text for t in llm.generate("Hi", max_tokens=8))
    ...     if rank == 0: print(text)
    >>> ingot.distributed.launch(work, 2)                                    # doctest: +SKIP

torch is imported only here and only when a group is made or used (it is the `cuda` extra).
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import numpy as np

from ..errors import IngotError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        raise IngotError("tensor parallelism needs torch (pip install 'ingot[cuda]', or torch for the CPU).") from None
    return dist


def world() -> tuple[int, int]:
    """(ranks, this rank) of the current process group; (1, 0) when there is none."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 1, 0
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its rendezvous variables are set)."""
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    """NCCL for GPUs; gloo on the CPU, and for the CUDA backend run on CPU tensors (INGOT_CUDA_DEVICE=cpu)."""
    return "nccl" if device == "cuda" and os.environ.get("INGOT_CUDA_DEVICE", "cuda") != "cpu" else "gloo"


def init(rank: int, ranks: int, device: str = "cpu", port: int | None = None) -> None:
    """Join (or make) the process group of `ranks` processes as `rank`: over 127.0.0.1:port, or
    torchrun's environment when port is None. On CUDA each rank takes GPU LOCAL_RANK (else rank),
    with NCCL's NVLink multicast (NVLS) left off."""
    dist = _dist()
    if dist.is_initialized():
        if dist.get_world_size() != ranks:
            raise IngotError(f"tensor parallel: a process group of {dist.get_world_size()} ranks exists; "
                             f"{ranks} were asked for.")
        return
    if backend_for(device) == "nccl":
        import torch
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend_for(device), init_method=method, rank=rank, world_size=ranks)


def shutdown() -> None:
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()


def group_of(ranks: int, op: str):
    """torch.distributed, checked to hold a group of `ranks` (what a compiled collective needs)."""
    dist = _dist()
    if not dist.is_initialized():
        raise IngotError(f"{op} over {ranks} ranks needs a torch.distributed process group; start the ranks with "
                         f"ingot.distributed.launch, `ingot generate --tensor-parallel {ranks}` or torchrun.")
    if dist.get_world_size() != ranks:
        raise IngotError(f"{op}: the graph was sharded for {ranks} ranks but the process group has {dist.get_world_size()}.")
    return dist


# -- collectives on NumPy arrays (the CPU backend's lowering) ---------------------------------------------

def _as_torch(x: np.ndarray):
    """A contiguous copy of x as a torch tensor sharing its memory (bfloat16 widened to float32)."""
    import torch

    wide = np.float32 if x.dtype.kind == "V" or x.dtype.name == "bfloat16" else x.dtype
    y = np.array(x, dtype=wide, order="C", copy=True)
    return y, torch.from_numpy(y.reshape(-1) if y.ndim == 0 else y)


def all_reduce(x: np.ndarray, ranks: int) -> np.ndarray:
    """The sum over the ranks of x (every rank gets it)."""
    dist = group_of(ranks, "all_reduce")
    y, t = _as_torch(x)
    dist.all_reduce(t)
    return y.astype(x.dtype, copy=False)


def all_gather(x: np.ndarray, ranks: int, axis: int) -> np.ndarray:
    """The ranks' x side by side along axis, rank 0 first (every rank gets it)."""
    import torch

    dist = group_of(ranks, "all_gather")
    y, t = _as_torch(x)
    parts = [torch.empty_like(t) for _ in range(ranks)]
    dist.all_gather(parts, t)
    return np.concatenate([p.numpy() for p in parts], axis=axis).astype(x.dtype, copy=False)


def broadcast_text(text: str | None) -> str:
    """Rank 0's text on every rank (as UTF-8 bytes in tensors: nothing is pickled)."""
    import torch

    dist = _dist()
    data = (text or "").encode("utf-8") if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(buffer, 0)
    return bytes(buffer.numpy()).decode("utf-8")


def broadcast_int(value: int | None) -> int | None:
    """Rank 0's integer (or None) on every rank."""
    import torch

    dist = _dist()
    t = torch.tensor([0 if value is None else 1, 0 if value is None else int(value)], dtype=torch.int64)
    dist.broadcast(t, 0)
    return None if int(t[0]) == 0 else int(t[1])


# -- launching ---------------------------------------------------------------------------------------

def _worker(rank: int, fn: Callable, ranks: int, device: str, port: int, args: tuple) -> None:
    init(rank, ranks, device, port)
    try:
        fn(rank, ranks, *args)
    finally:
        shutdown()


def launch(fn: Callable[..., Any], ranks: int, *args, device: str = "cpu") -> None:
    """Run fn(rank, ranks, *args) in `ranks` new processes, each in one process group (gloo, or NCCL
    for device "cuda") over a free port on 127.0.0.1; returns when all are done. fn and args must
    pickle (a module-level function). A rank that fails ends the others and raises here."""
    import torch.multiprocessing as mp

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise IngotError(f"launch: ranks must be a whole number >= 1, not {ranks!r}.")
    mp.spawn(_worker, args=(fn, ranks, device, free_port(), args), nprocs=ranks, join=True)


def rank_for(cfg, tensor_parallel, adapters=()) -> int:
    """This process's rank for a model split over `tensor_parallel` ranks (0 when it is 1): the split
    checked against cfg first, then the process group (it must hold exactly that many ranks)."""
    from ..passes.shard import check_tensor_parallel

    check_tensor_parallel(cfg, tensor_parallel)
    if tensor_parallel == 1:
        return 0
    if adapters:
        raise IngotError("tensor parallel: LoRA adapters are not supported yet.")
    ranks, rank = world()
    if ranks != tensor_parallel:
        raise IngotError(f"load: tensor_parallel={tensor_parallel} runs in a torch.distributed group of that many ranks "
                         f"(ingot.distributed.launch, `ingot generate --tensor-parallel {tensor_parallel}` or torchrun); "
                         f"this process is in {'none' if ranks == 1 else f'one of {ranks}'}.")
    return rank
