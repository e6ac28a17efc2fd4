"""Rank 0 works alone while the others wait, and their wait times out.

After each epoch rank 0 evaluates the whole validation set by itself; rank 1
goes on to the next epoch and waits in its first backward pass, where DDP
all-reduces the gradients. When rank 0's work takes longer than the
collective timeout (--timeout), rank 1's wait ends with

    RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:...] Timed out
    waiting 5000ms for recv operation to complete

The same happens when rank 0 alone downloads a data set, or writes a large
checkpoint to a slow disk. Here the evaluation's cost is a sleep per batch,
standing for a large model's forward pass: 1.5 x the timeout in all.

    python part4_torchrun/errors/rank0_slow.py
    python part4_torchrun/errors/rank0_slow.py --fix

--fix: every rank evaluates its half of the validation set, and an
all_reduce sums the counts: half the time, and no rank waits for another.
(For a download, do it before training starts or on every node; a wait
that must be long needs a longer timeout in init_process_group.)

Evidence lines (rank 0):
    epoch 1/2 eval_s=3.75 val_samples=64
    done epochs=2
"""

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does),
# it keeps the group alive past destroy_process_group (../../part3_ddp/
# experiments/README.md).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
VAL_BATCHES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="every rank evaluates its half"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def evaluate(model: nn.Module, batches: range, batch_s: float) -> int:
    """How many validation samples these batches hold (8 per batch); each
    batch costs batch_s seconds, as a large model's forward pass would."""
    samples = 0
    with torch.no_grad():
        for batch in batches:
            generator = torch.Generator().manual_seed(batch)
            x = torch.randn(8, 16, generator=generator)
            model(x)
            time.sleep(batch_s)
            samples += len(x)
    return samples


def worker(
    rank: int, world_size: int, rendezvous: str, args: argparse.Namespace
) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The whole validation set takes 1.5 x the timeout on one rank.
    batch_s = 1.5 * args.timeout / VAL_BATCHES
    for epoch in range(args.epochs):
        for _ in range(4):
            x = torch.randn(8, 16)
            # Without the fix, rank 1 waits in here while rank 0 evaluates.
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        start = time.perf_counter()
        if args.fix:
            # fix: every rank takes its share of the batches, and the
            # counts are summed
            mine = range(rank, VAL_BATCHES, world_size)
            count = torch.tensor(evaluate(model.module, mine, batch_s))
            dist.all_reduce(count)
            samples = int(count)
        elif rank == 0:
            # The bug: rank 0 evaluates everything, the others go on.
            samples = evaluate(model.module, range(VAL_BATCHES), batch_s)
        if rank == 0:
            log(
                f"epoch {epoch + 1}/{args.epochs}"
                f" eval_s={time.perf_counter() - start:.2f}"
                f" val_samples={samples}"
            )
    if rank == 0:
        log(f"done epochs={args.epochs}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn). DDP imports torch._dynamo on first use
    # (seconds): once here, for both ranks.
    method = "fork" if sys.platform == "linux" else "spawn"
    if method == "fork":
        import torch._dynamo
    # The ranks meet through a file (init_method="file://..."): no port to
    # pick, so no clash with another job on the machine.
    with tempfile.TemporaryDirectory() as directory:
        rendezvous = "file://" + os.path.join(directory, "rendezvous")
        mp.start_processes(
            worker,
            (WORLD_SIZE, rendezvous, args),
            nprocs=WORLD_SIZE,
            start_method=method,
        )
