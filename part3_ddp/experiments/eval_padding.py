"""Evaluation on several ranks counts some samples twice, unless you stop it.

`DistributedSampler` gives every rank the same number of samples. 10,000 test
samples on 3 ranks do not split evenly, so it pads each shard to
ceil(10,000 / 3) = 3,334 by repeating the first samples: 10,002 predictions,
two of them duplicates, and an accuracy that is slightly off. A strided split
without padding (rank r takes r, r + 3, r + 6, ...) gives
3,334 + 3,333 + 3,333 = 10,000 and, after summing the counts over ranks,
exactly the one-process accuracy.

Two ways to sum the counts side by side: by hand (`dist.all_reduce` of a
(correct, total) tensor) and with torchmetrics, whose `compute()` gathers the
metric's state from all ranks. They agree on the same shards: torchmetrics
cannot undo the padding either. Where they differ: torchmetrics'
`MulticlassAccuracy` averages per class by default (average="macro"), which is
not correct / total; ask for average="micro" to get the count-based number. And
`compute()` is a collective: every rank must call it.

    python part3_ddp/experiments/eval_padding.py
    python part3_ddp/experiments/eval_padding.py --nprocs 4 --size 10001

Evidence lines (first, last: the first and last samples of a rank's shard;
twice: the samples counted more than once):
    reference correct=7385 total=10000 acc=73.8500%
        one process, the whole test set
    shard sampler=padded rank=1 correct=2472 total=3334 acc=74.1452%
        first=1,4,7 last=9994,9997,0
        one rank alone
    global sampler=padded method=all_reduce correct=7385 total=10002
        acc=73.8352% twice=0,1
    global sampler=padded method=torchmetrics_micro acc=73.8352%
    global sampler=padded method=torchmetrics_default_macro acc=71.1003%
"""

import argparse
import os
import socket
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (torchmetrics
# does, in the ranks), it keeps the group alive past destroy_process_group, and
# gloo can abort at exit (README).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, default=3, help="processes (ranks)"
    )
    parser.add_argument(
        "--start-method",
        choices=["spawn", "fork"],
        default="spawn",
        help="fork: children inherit the imported torch and start at once"
        " (CPU only)",
    )
    parser.add_argument(
        "--size", type=int, default=10_000, help="test samples"
    )
    parser.add_argument(
        "--batch-size", type=int, default=500, help="per process"
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


class StridedSampler(Sampler[int]):
    """Rank r of n takes samples r, r + n, r + 2n, ...: every sample exactly
    once, no padding.

    Shards may differ in length by one. That is fine for evaluation (no
    gradients to all-reduce, so no rank waits for another), but not for
    training with DDP.
    """

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_test_set(size: int, seed: int) -> tuple[TensorDataset, nn.Module]:
    """A fixed 'trained' linear classifier, and labels it gets right about 70%
    of the time."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(16, NUM_CLASSES)
    with torch.no_grad():
        model.weight.copy_(torch.randn(NUM_CLASSES, 16, generator=g))
        model.bias.zero_()
        x = torch.randn(size, 16, generator=g)
        labels = model(x).argmax(1)
    # Relabel 30% at random: an imperfect model.
    wrong = torch.rand(size, generator=g) < 0.3
    labels[wrong] = torch.randint(
        0, NUM_CLASSES, (int(wrong.sum()),), generator=g
    )
    # The third tensor: each sample's index, to see which samples a rank
    # scored.
    return TensorDataset(x, labels, torch.arange(size)), model


def evaluate(
    model: nn.Module, loader: DataLoader, metrics: list
) -> tuple[torch.Tensor, list[int]]:
    """(correct, total) on this rank's shard, and the samples it scored; also
    feeds every torchmetrics metric."""
    counts = torch.zeros(2, dtype=torch.int64)
    scored = []
    with torch.no_grad():
        for x, y, index in loader:
            scored += index.tolist()
            logits = model(x)
            counts += torch.tensor(
                [(logits.argmax(1) == y).sum().item(), len(y)]
            )
            for metric in metrics:
                metric.update(logits, y)
    return counts, scored


def compare(
    rank: int, world_size: int, args, name: str, sampler: Sampler
) -> None:
    # Imported in the ranks only: slow to import (torchvision, scipy...), and
    # the process that starts them has no use for it.
    from torchmetrics.classification import MulticlassAccuracy

    dataset, model = make_test_set(args.size, args.seed)
    # micro: correct / total; the default, macro: the mean of the per-class
    # accuracies
    micro = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
    default = MulticlassAccuracy(num_classes=NUM_CLASSES)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler)
    local, scored = evaluate(model, loader, [micro, default])

    # all_gather: only to print every rank's own view below.
    shards = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local)
    samples = [None] * world_size
    dist.all_gather_object(samples, scored)
    # The hand-written way: sum (correct, total) over the ranks.
    summed = local.clone()
    dist.all_reduce(summed)
    # Collectives: every rank calls them.
    tm_micro, tm_macro = micro.compute().item(), default.compute().item()
    if rank == 0:
        for r, (correct, total) in enumerate(
            shard.tolist() for shard in shards
        ):
            # The first and the last samples of the rank's shard.
            ends = samples[r][:3], samples[r][-3:]
            first, last = (",".join(map(str, e)) for e in ends)
            log(
                f"shard sampler={name} rank={r} correct={correct}"
                f" total={total} acc={100 * correct / total:.4f}%"
                f" first={first} last={last}"
            )
        # The samples counted more than once, over all ranks.
        counts = Counter(i for shard in samples for i in shard)
        twice = sorted(i for i, n in counts.items() if n > 1)
        correct, total = summed.tolist()
        log(
            f"global sampler={name} method=all_reduce correct={correct}"
            f" total={total} acc={100 * correct / total:.4f}%"
            f" twice={','.join(map(str, twice)) or 'none'}"
        )
        log(
            f"global sampler={name} method=torchmetrics_micro"
            f" acc={100 * tm_micro:.4f}%"
        )
        log(
            f"global sampler={name} method=torchmetrics_default_macro"
            f" acc={100 * tm_macro:.4f}%"
        )


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    if rank == 0:
        # What one process says over the whole test set: the number to
        # reproduce.
        dataset, model = make_test_set(args.size, args.seed)
        x, y, _ = dataset.tensors
        with torch.no_grad():
            correct = int((model(x).argmax(1) == y).sum())
        log(
            f"reference correct={correct} total={args.size}"
            f" acc={100 * correct / args.size:.4f}%"
        )
    # shuffle=False keeps the order, but the shards are still padded to equal
    # length.
    padded = DistributedSampler(
        range(args.size), world_size, rank, shuffle=False
    )
    compare(rank, world_size, args, "padded", padded)
    compare(
        rank,
        world_size,
        args,
        "strided",
        StridedSampler(args.size, rank, world_size),
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
