"""Your own script: an IterableDataset sharded by rank and loader worker.

A stream of records (lines of files, rows of a database: here numbers) has
no length and no index, so no DistributedSampler can split it. Each copy of
the dataset must skip what the others read. There are world_size x
num_workers copies: one per loader worker of every rank. Without --fix each
copy reads the whole stream; with --fix copy k reads records k, k + copies,
k + 2 x copies, ..., and all copies stop at the same count.

    torchrun --standalone --nproc_per_node=2 iterable_shards.py
    torchrun --standalone --nproc_per_node=2 iterable_shards.py --fix
"""

import argparse
import multiprocessing
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="shard by rank and worker"
    )
    parser.add_argument("--records", type=int, default=103)
    parser.add_argument("--workers", type=int, default=2, help="per rank")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.records, args.batch_size) < 1 or args.workers < 0:
        parser.error(
            "--records, --batch-size: 1 or more; --workers: 0 or more"
        )
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


class Records(IterableDataset):
    """Records 0 .. n - 1, read in order."""

    def __init__(self, n: int, rank: int, world_size: int, fix: bool):
        self.n, self.rank, self.world_size = n, rank, world_size
        self.fix = fix

    def __iter__(self):
        # Each loader worker runs this in a copy of the dataset of its own.
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        reader = self.rank * workers + worker
        first, stride, end = 0, 1, self.n
        if self.fix:
            # --fix: every reader of every rank takes its own records ...
            first, stride = reader, self.world_size * workers
            # ... and all stop at the same count: the same number of
            # batches on every rank (the tail, fewer than `stride` records,
            # is left out, as drop_last would)
            end = self.n // stride * stride
        for record in range(first, end, stride):
            yield torch.tensor(record)


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    records = Records(args.records, rank, world_size, args.fix)
    loader = DataLoader(
        records,
        batch_size=args.batch_size,
        num_workers=args.workers,
        # Not fork: a fork while other threads (gloo's) hold a lock can hang
        # the worker. A spawned worker gets the dataset pickled: Records
        # holds numbers only.
        multiprocessing_context="spawn" if args.workers else None,
    )
    if rank == 0:
        # The copies of the dataset that read the stream: one in every
        # loader worker of every rank (without workers, the rank's own)
        copies = world_size * max(args.workers, 1)
        where = f"{world_size} ranks, no loader workers"
        if args.workers:
            # (no context given: multiprocessing's default start method)
            context = loader.multiprocessing_context or multiprocessing
            where = (
                f"{world_size} ranks x {args.workers} loader workers,"
                f" started by {context.get_start_method()}"
            )
        log(f"dataset copies={copies}: {where}")
    # Something for the stream to feed: a line fitted to y = 2x.
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, batches = [], 0
    for numbers in loader:
        x = numbers.float().unsqueeze(1) / args.records
        loss = (model(x) - 2 * x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += numbers.tolist()
        batches += 1
    log(f"rank {rank} batches={batches} records={len(seen)}")

    # Rank 0 gathers what every rank read and counts the repeats.
    everything = [None] * world_size
    dist.all_gather_object(everything, seen)
    if rank == 0:
        read = [n for part in everything for n in part]
        distinct = len(set(read))
        log(
            f"records stream={args.records} read={len(read)}"
            f" distinct={distinct} repeated={len(read) - distinct}"
            f" unread={args.records - distinct}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
