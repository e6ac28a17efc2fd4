"""Uneven inputs: one rank has a batch more, and the epoch never ends.

Each rank reads its own shard of the training data, and the shards differ in
size: 20 samples on rank 0, 16 on rank 1, so 5 and 4 batches of 4. In its
fifth backward pass rank 0 waits for rank 1 to all-reduce the gradients;
rank 1 has finished the epoch and waits in the barrier before the
checkpoint. Nothing moves until the collective timeout (--timeout):

    RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:...] Timed out
    waiting 5000ms for recv operation to complete

    python part4_torchrun/errors/uneven_inputs.py
    python part4_torchrun/errors/uneven_inputs.py --fix sampler
    python part4_torchrun/errors/uneven_inputs.py --fix join

--fix sampler: one data set of 36 samples, split by DistributedSampler into
equal shards (it pads with repeated samples when the split is uneven;
drop_last=True drops the tail instead). --fix join: keep the uneven shards
and train inside torch.distributed.algorithms.Join: a rank that runs out of
batches answers the others' all-reduces with zeros until all are done.

Evidence line (rank 0):
    done fix=join batches=5,4 samples=36 ranks_equal=True
"""

import argparse
import contextlib
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does),
# it keeps the group alive past destroy_process_group (../../part3_ddp/
# experiments/README.md).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

WORLD_SIZE = 2
SHARD_SIZES = (20, 16)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix",
        choices=["sampler", "join"],
        help="sampler: equal shards; join: uneven shards inside Join",
    )
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def ranks_equal(model: nn.Module) -> bool:
    # Every rank's weights, side by side: DDP keeps the copies equal.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0], c) for c in copies)


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
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(sum(SHARD_SIZES), 16, generator=generator),
        torch.randint(0, 4, (sum(SHARD_SIZES),), generator=generator),
    )
    if args.fix == "sampler":
        # fix: equal shards of one data set
        sampler = DistributedSampler(data, world_size, rank, shuffle=False)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    else:
        # The bug: rank r reads its own shard, and the shards differ.
        start = sum(SHARD_SIZES[:rank])
        shard = range(start, start + SHARD_SIZES[rank])
        loader = DataLoader(Subset(data, shard), batch_size=4)

    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # fix join: a rank that runs out of batches shadows the others'
    # collectives until every rank has left the block
    joined = Join([model]) if args.fix == "join" else contextlib.nullcontext()
    counts = torch.zeros(2, dtype=torch.int64)
    with joined:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            # Without a fix, rank 0's fifth backward pass waits here.
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            counts += torch.tensor([1, len(x)])
    # Every rank waits here before rank 0 would save a checkpoint.
    dist.barrier()
    batches = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(batches, counts)
    equal = ranks_equal(model)
    if rank == 0:
        log(
            f"done fix={args.fix}"
            f" batches={','.join(str(int(b[0])) for b in batches)}"
            f" samples={sum(int(b[1]) for b in batches)} ranks_equal={equal}"
        )
    dist.destroy_process_group()


def run(rank: int, *rest) -> None:
    # mp.spawn shows the error of one rank only, whichever it notices first:
    # each rank says its own, so the one that timed out is always seen.
    try:
        worker(rank, *rest)
    except RuntimeError as error:
        sys.stderr.write(f"rank {rank}: {type(error).__name__}: {error}\n")
        raise


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
            run,
            (WORLD_SIZE, rendezvous, args),
            nprocs=WORLD_SIZE,
            start_method=method,
        )
