"""Gradient accumulation with `no_sync`: the same update, fewer all-reduces.

To train with a batch K times larger than fits in memory, run K micro-batches
and step the optimizer once. Under DDP each backward pass all-reduces the
gradients, but only the sum after the K-th micro-batch matters: inside
`model.no_sync()` DDP skips the all-reduce and just accumulates into `.grad`;
the first backward outside it all-reduces the accumulated gradients. Averaging
is linear, so the update is the same, with 1 all-reduce instead of K.

DDP reads the flag in the *forward* pass (that is when it prepares its backward
hooks), so the forward must be inside `no_sync()` too: wrapping only
`loss.backward()` syncs anyway.

All-reduces are counted with a DDP communication hook: DDP calls it once per
gradient bucket it would all-reduce (this small model fits in one bucket).

    python part3_ddp/experiments/no_sync_accumulation.py
    python part3_ddp/experiments/no_sync_accumulation.py --nprocs 3 \
        --accumulate 8

Evidence lines:
    run mode=sync_every_step ranks=2 updates=3 micro_batches=12
        allreduce_calls=12
    run mode=no_sync ranks=2 updates=3 micro_batches=12 allreduce_calls=3
    run mode=no_sync_backward_only ranks=2 updates=3 micro_batches=12
        allreduce_calls=12
    compare mode=no_sync vs=sync_every_step max_abs_diff=1.110e-16
"""

import argparse
import contextlib
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does, on
# first use), it keeps the group alive past destroy_process_group, and gloo can
# abort at exit (README).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("sync_every_step", "no_sync", "no_sync_backward_only")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, default=2, help="processes (ranks)"
    )
    parser.add_argument(
        "--start-method",
        choices=["spawn", "fork"],
        default="spawn",
        help="fork: children inherit the imported torch and start at once"
        " (CPU only)",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=4,
        help="micro-batches per update (K)",
    )
    parser.add_argument(
        "--updates", type=int, default=3, help="optimizer steps"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="micro-batch, per process"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def find_free_port() -> int:
    # Port 0: the OS picks a free one.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_process_group(rank: int, world_size: int) -> None:
    # All ranks share this machine's cores: more threads than cores is slower.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    # A collective that waits this long for a lost rank fails instead of
    # hanging.
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 300)))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timeout
    )


def counting_allreduce_hook(
    calls: list[int], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """What DDP does by default (divide by the world size, then all-reduce: the
    sum of gradients already divided does not overflow where their sum can),
    plus a tally. With a hook registered, DDP leaves the division to the
    hook."""
    calls[0] += 1
    bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def train(
    rank: int, args: argparse.Namespace, mode: str
) -> tuple[nn.Module, int]:
    # The same initial weights for every mode and rank.
    torch.manual_seed(args.seed)
    model = DDP(
        nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    )
    calls = [0]
    model.register_comm_hook(calls, counting_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The same micro-batches for every mode; each rank its own.
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    for _ in range(args.updates):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            x = torch.randn(
                args.batch_size, 10, generator=data, dtype=torch.float64
            )
            y = torch.randint(0, 3, (args.batch_size,), generator=data)
            skip = mode != "sync_every_step" and micro < args.accumulate - 1
            # no_sync: forward AND backward inside the context; backward_only:
            # the mistake
            nothing = contextlib.nullcontext()
            around_forward = (
                model.no_sync() if skip and mode == "no_sync" else nothing
            )
            around_backward = model.no_sync() if skip else nothing
            with around_forward:
                # The mean over all K micro-batches.
                loss = F.cross_entropy(model(x), y) / args.accumulate
            with around_backward:
                # Gradients add up in .grad across micro-batches.
                loss.backward()
        optimizer.step()
    return model.module, calls[0]


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    models = {}
    for mode in MODES:
        models[mode], calls = train(rank, args, mode)
        if rank == 0:
            log(
                f"run mode={mode} ranks={world_size} updates={args.updates}"
                f" micro_batches={args.updates * args.accumulate}"
                f" allreduce_calls={calls}"
            )
    if rank == 0:
        reference = list(models["sync_every_step"].parameters())
        for mode in MODES[1:]:
            pairs = zip(models[mode].parameters(), reference, strict=True)
            diff = max((p - q).abs().max().item() for p, q in pairs)
            log(
                f"compare mode={mode} vs=sync_every_step"
                f" max_abs_diff={diff:.3e}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # mp.spawn(worker, ...) is start_processes with "spawn": each child starts
    # a fresh Python and imports torch again (seconds). "fork" copies this
    # process, imports included: at once, and safe here because nothing touched
    # CUDA or started threads yet. With GPUs, keep spawn.
    if args.start_method == "fork":
        # DDP imports torch._dynamo on first use (seconds): once here, shared
        # by the children.
        import torch._dynamo
    mp.start_processes(
        worker,
        args=(args.nprocs, args),
        nprocs=args.nprocs,
        start_method=args.start_method,
    )
