"""Shuffling: what `DistributedSampler.set_epoch` changes, and when forgetting
it hurts.

Part 1, the data order. A data set of plain integers makes the sampler visible:
each sample *is* its index. Two ranks draw their shards for a few epochs,
without `set_epoch` and with it. Without it the sampler shuffles with the same
seed every epoch: every epoch repeats epoch 0, and each rank sees the same half
of the data forever. With it the permutation changes each epoch, and since the
sampler shuffles the whole data set before splitting it, samples move *across*
ranks, not only within one.

Part 2, the training. DDP averages the gradients of all ranks, so which rank
holds a sample does not matter; what `set_epoch` changes is the sequence of
global batches, which without it is the same every epoch. A linear classifier
on a noisy 10-class problem is trained both ways, twice: with full epochs, and
with every epoch cut short after `--max-steps` steps (a step budget, like the
course's `--max-steps`). Cut short, an epoch without `set_epoch` draws the same
first batches again: the model never sees more than those samples, and it shows
in the test accuracy. With full epochs every sample is seen either way and the
two runs end close to each other: the repeated order costs little here.

  python part3_ddp/experiments/shuffling.py
  python part3_ddp/experiments/shuffling.py --nprocs 3 --size 24 --max-steps 8

Evidence lines (parsed by tests/test_inside_ddp.py):
    indices set_epoch=off epoch=0 rank=0 3,1,...
        every index a rank drew in that epoch
    moved set_epoch=on from_epoch=0 to_epoch=1 rank=0 count=4
        samples new to that rank
    train epochs=capped set_epoch=off epoch=8 seen=128 loss=0.0835
        test_acc=73.85%
    (seen: distinct training samples drawn so far, by all ranks; loss over all
    ranks)
"""

import argparse
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CLASSES, FEATURES = 10, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        "--size", type=int, default=16, help="part 1: samples in the data set"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="part 1: epochs drawn"
    )
    parser.add_argument(
        "--train-size", type=int, default=2048, help="part 2: training samples"
    )
    parser.add_argument("--train-epochs", type=int, default=8, help="part 2")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="part 2: per process"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=4,
        help="part 2: steps per short epoch",
    )
    parser.add_argument("--lr", type=float, default=0.5)
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


# ---- Part 1: the data order -------------------------------------------------


def draw_indices(
    rank: int, world_size: int, args: argparse.Namespace, call_set_epoch: bool
):
    """The indices this rank's loader yields in each epoch."""
    # Sample i is the integer i.
    dataset = list(range(args.size))
    sampler = DistributedSampler(
        dataset, world_size, rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    epochs = []
    for epoch in range(args.epochs):
        if call_set_epoch:
            # The permutation is seeded with seed + epoch.
            sampler.set_epoch(epoch)
        epochs.append([int(i) for batch in loader for i in batch])
    return epochs


def report_indices(per_rank: list[list[list[int]]], flag: str) -> None:
    """What every rank drew, then how many samples each rank got that it had
    not had before."""
    epochs = range(len(per_rank[0]))
    for epoch in epochs:
        for rank, drawn in enumerate(per_rank):
            indices = ",".join(map(str, drawn[epoch]))
            log(
                f"indices set_epoch={flag} epoch={epoch} rank={rank} {indices}"
            )
    for epoch in epochs[1:]:
        for rank, drawn in enumerate(per_rank):
            new = len(set(drawn[epoch]) - set(drawn[epoch - 1]))
            log(
                f"moved set_epoch={flag} from_epoch={epoch - 1}"
                f" to_epoch={epoch} rank={rank} count={new}"
            )


# ---- Part 2: the training ---------------------------------------------------


def gaussian_classes(size: int, seed: int) -> TensorDataset:
    """10 classes, each a cloud around its own centre; the clouds overlap. The
    third tensor is the sample's index, to count the distinct samples a run has
    seen."""
    centres = torch.randn(
        CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)
    )
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (size,), generator=g)
    x = 0.4 * centres[labels] + torch.randn(size, FEATURES, generator=g)
    return TensorDataset(x, labels, torch.arange(size))


def train(
    rank: int,
    world_size: int,
    args: argparse.Namespace,
    capped: bool,
    flag: str,
) -> None:
    train_set = gaussian_classes(args.train_size, args.seed + 1)
    x_test, y_test, _ = gaussian_classes(4096, args.seed + 2).tensors
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # The same initial weights for every run (DDP would also copy rank 0's to
    # the others).
    torch.manual_seed(args.seed)
    model = DDP(nn.Linear(FEATURES, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    seen = torch.zeros(args.train_size)
    for epoch in range(args.train_epochs):
        if flag == "on":
            sampler.set_epoch(epoch)
        # (summed loss, samples) on this rank
        totals = torch.zeros(2)
        for step, (x, y, index) in enumerate(loader):
            if capped and step == args.max_steps:
                break
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals[0] += loss.detach() * len(y)
            totals[1] += len(y)
            seen[index] = 1
        # Over all ranks: the loss of every sample, every sample any rank has
        # drawn.
        dist.all_reduce(totals)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        loss_sum, samples = totals.tolist()
        if rank == 0:
            with torch.no_grad():
                test_acc = (
                    (model.module(x_test).argmax(1) == y_test)
                    .float()
                    .mean()
                    .item()
                )
            log(
                f"train epochs={'capped' if capped else 'full'}"
                f" set_epoch={flag} epoch={epoch + 1} seen={int(seen.sum())}"
                f" loss={loss_sum / samples:.4f}"
                f" test_acc={100 * test_acc:.2f}%"
            )


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    for flag in ("off", "on"):
        mine = draw_indices(
            rank, world_size, args, call_set_epoch=flag == "on"
        )
        everyone = [None] * world_size
        # Rank 0 prints for all: one ordered output.
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            report_indices(everyone, flag)
    for capped in (False, True):
        for flag in ("off", "on"):
            train(rank, world_size, args, capped, flag)
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
