"""Experiment 1: what `DistributedSampler.set_epoch` does to the data order.

A data set of plain integers makes the sampler visible: each sample *is* its index. Two
ranks draw their shards for a few epochs, once without `set_epoch` and once with it. Without
it the sampler reshuffles with the same seed every epoch, so every epoch repeats epoch 0 and
each rank sees the same half of the data forever. With it the permutation changes each
epoch, and because the sampler shuffles the whole data set before splitting it, samples move
*across* ranks, not only within a rank. A short training run shows the effect on the loss.

    python part3_ddp/experiments/shuffling.py
    python part3_ddp/experiments/shuffling.py --nprocs 3 --size 24 --epochs 4

Evidence lines (parsed by tests/test_inside_ddp.py):
    indices set_epoch=off epoch=0 rank=0 3,1,...   every index a rank drew in that epoch
    moved set_epoch=on from_epoch=0 to_epoch=1 rank=0 count=4   samples new to that rank
    train set_epoch=off epoch=3 loss=0.52 acc=75.00%   (a tiny MLP, loss and accuracy over all ranks)
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn",
                        help="fork: children inherit the imported torch and start at once (CPU only)")
    parser.add_argument("--size", type=int, default=16, help="samples in the integer data set")
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-epochs", type=int, default=4, help="epochs of the small training run")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def log(message: str) -> None:
    sys.stdout.write(message + "\n")  # one write per line: ranks never glue lines together
    sys.stdout.flush()


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup(rank: int, world_size: int) -> None:
    # Several processes share this machine's cores: one thread each unless you say otherwise.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def draw_indices(rank: int, world_size: int, args: argparse.Namespace, call_set_epoch: bool) -> list[list[int]]:
    """The indices this rank's loader yields in each epoch."""
    dataset = list(range(args.size))  # sample i is the integer i
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    epochs = []
    for epoch in range(args.epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)  # the permutation is seeded with seed + epoch
        epochs.append([int(i) for batch in loader for i in batch])
    return epochs


def report_indices(per_rank: list[list[list[int]]], flag: str) -> None:
    """Rank 0 prints what every rank drew, then how many samples each rank got that it had not seen before."""
    for epoch in range(len(per_rank[0])):
        for rank, epochs in enumerate(per_rank):
            log(f"indices set_epoch={flag} epoch={epoch} rank={rank} {','.join(map(str, epochs[epoch]))}")
    for epoch in range(1, len(per_rank[0])):
        for rank, epochs in enumerate(per_rank):
            new = set(epochs[epoch]) - set(epochs[epoch - 1])
            log(f"moved set_epoch={flag} from_epoch={epoch - 1} to_epoch={epoch} rank={rank} count={len(new)}")


def synthetic_task(size: int, seed: int) -> TensorDataset:
    """Two interleaved half-moons in 2-D: small, but not linearly separable."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (size,), generator=g)
    angle = torch.rand(size, generator=g) * torch.pi
    x = torch.stack([torch.cos(angle) + labels, torch.sin(angle) * (1 - 2 * labels) + 0.3 * labels], 1)
    return TensorDataset(x + 0.15 * torch.randn(size, 2, generator=g), labels)


def short_training(rank: int, world_size: int, args: argparse.Namespace, call_set_epoch: bool) -> None:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    dataset = synthetic_task(256, args.seed)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size * 2, sampler=sampler)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    flag = "on" if call_set_epoch else "off"
    for epoch in range(args.train_epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        totals = torch.zeros(3, dtype=torch.float64)  # summed loss, correct, samples
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(totals)  # loss and accuracy over all ranks, not just rank 0's shard
        if rank == 0:
            log(f"train set_epoch={flag} epoch={epoch} loss={totals[0] / totals[2]:.4f} acc={100 * totals[1] / totals[2]:.2f}%")


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup(rank, world_size)
    for call_set_epoch in (False, True):
        mine = draw_indices(rank, world_size, args, call_set_epoch)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)  # rank 0 prints for all: ordered output
        if rank == 0:
            report_indices(everyone, "on" if call_set_epoch else "off")
    for call_set_epoch in (False, True):
        short_training(rank, world_size, args, call_set_epoch)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # mp.spawn(worker, ...) is start_processes with "spawn": each child starts a fresh Python and
    # imports torch again (seconds). "fork" copies this process, imports included: instant, and
    # safe here because nothing touched CUDA or started threads yet. With GPUs, keep "spawn".
    if args.start_method == "fork":  # DDP imports torch._dynamo on first use (seconds): once here, shared
        import torch._dynamo
    mp.start_processes(worker, args=(args.nprocs, args), nprocs=args.nprocs, start_method=args.start_method)
