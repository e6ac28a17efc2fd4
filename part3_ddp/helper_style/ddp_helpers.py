"""The helper module of the helper-module style: everything distributed, in one
place.

The training file (train.py next to this) calls these functions and never
touches torch.distributed itself. Each helper does the right thing in a world
of one process too, so the same training file runs with 1 or N processes.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does, on
# first use), it keeps the group alive past destroy_process_group, and gloo can
# abort at exit (see ../experiments/README.md).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler


def find_free_port() -> int:
    # Port 0: the OS picks a free one, so no clash with a stale run.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(worker: Callable[..., None], nprocs: int, *args) -> None:
    """Run worker(rank, world_size, *args) in nprocs processes; with one, just
    call it."""
    if nprocs == 1:
        # No extra process, no process group: plain single-device PyTorch.
        worker(0, 1, *args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    mp.spawn(worker, args=(nprocs, *args), nprocs=nprocs)


def setup_process_group(rank: int, world_size: int) -> None:
    """NCCL and one GPU per process with GPUs, gloo on CPUs. All processes run
    on this machine."""
    if torch.cuda.is_available():
        if world_size > torch.cuda.device_count():
            sys.exit(
                f"error: {world_size} processes,"
                f" {torch.cuda.device_count()} GPU(s): start at most one per"
                " GPU, or run on CPUs with CUDA_VISIBLE_DEVICES=''"
            )
        # Before any CUDA work or collective: else "cuda" means GPU 0 in every
        # rank, and NCCL (which creates its communicator at the first
        # collective) uses GPU 0 for all of them.
        torch.cuda.set_device(rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # The processes share the machine's cores: more threads than cores is
        # slower.
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # A collective that waits this long for a lost rank fails instead of
    # hanging.
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 300)))
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timeout
    )


def destroy_process_group() -> None:
    """dist.destroy_process_group(), if there is a process group."""
    if is_distributed():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_primary() -> bool:
    return get_rank() == 0


def print_primary(message: str) -> None:
    if is_primary():
        # One write per line: lines of processes that share a terminal never
        # interleave.
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def get_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def data_sampler(dataset: Dataset, shuffle: bool) -> DistributedSampler | None:
    """A DistributedSampler when distributed; None otherwise (then let the
    DataLoader shuffle)."""
    return (
        DistributedSampler(dataset, shuffle=shuffle)
        if is_distributed()
        else None
    )


def prepare_ddp_model(model: nn.Module) -> nn.Module:
    """Wrap in DDP only when there is someone to synchronise with."""
    if get_world_size() == 1:
        return model
    return DDP(
        model,
        device_ids=[get_device().index] if torch.cuda.is_available() else None,
    )


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def reduce(value: torch.Tensor, average: bool = True) -> torch.Tensor:
    """Sum (or average) over ranks; a copy, on every rank."""
    value = value.detach().clone()
    if is_distributed():
        dist.all_reduce(value)
        if average:
            value /= get_world_size()
    return value


def gather(value: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (the same shape on all ranks), in rank order."""
    if not is_distributed():
        return [value]
    parts = [torch.empty_like(value) for _ in range(get_world_size())]
    dist.all_gather(parts, value.contiguous())
    return parts
