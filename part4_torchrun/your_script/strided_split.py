"""Your own script: a strided split that lines up with the data.

A siamese network's pair data set where the index's parity is the pair's
label (an even index pairs two images of one class, an odd one two of
different classes), the layout of pytorch/examples' siamese network. Without
--fix each rank takes its share with DistributedSampler(shuffle=False):
every world_size-th index from its rank on, so rank 0 trains on the pairs of
one class, rank 1 on the others. DDP averages the gradients of the ranks'
mean losses; a model without BatchNorm (--no-batchnorm) then trains as on
mixed batches, but BatchNorm computes each row's output, and its gradient,
from its rank's batch: pairs of one kind. With --fix the sampler shuffles,
every epoch anew.

    torchrun --standalone --nproc_per_node=2 strided_split.py
    torchrun --standalone --nproc_per_node=2 strided_split.py --fix
    torchrun --standalone --nproc_per_node=2 strided_split.py --no-batchnorm
"""

import argparse
import random
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CLASSES, PER_CLASS = 4, 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="the sampler shuffles"
    )
    parser.add_argument(
        "--no-batchnorm", action="store_true", help="a model without it"
    )
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.epochs, args.timeout) <= 0:
        parser.error("--epochs and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def make_images(seed: int) -> torch.Tensor:
    """PER_CLASS images of each class (vectors around the class's centre);
    image i is of class i // PER_CLASS."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, 8, generator=g)
    noise = torch.randn(CLASSES * PER_CLASS, 8, generator=g)
    return centres.repeat_interleave(PER_CLASS, 0) + noise


class Pairs(Dataset):
    """Two pairs per image: index 2i pairs image i with one of its class
    (label 1.0), index 2i + 1 with one of another class (label 0.0). The
    second image comes from a generator keyed by (seed, epoch, index), as
    pair_draws.py's --fix draws it."""

    def __init__(self, images: torch.Tensor, seed: int):
        self.images, self.seed, self.epoch = images, seed, 0

    def __len__(self) -> int:
        return 2 * len(self.images)

    def __getitem__(self, index: int):
        key = (self.seed * 1_000_003 + self.epoch) * 1_000_003 + index
        draw, first = random.Random(key), index // 2
        cls = first // PER_CLASS
        same = index % 2 == 0
        if not same:
            cls = (cls + draw.randrange(1, CLASSES)) % CLASSES
        second = cls * PER_CLASS + draw.randrange(PER_CLASS)
        return self.images[first], self.images[second], float(same)


class Siamese(nn.Module):
    """One embedding for both images (with BatchNorm, as a ResNet has), and
    a head that scores the distance between the two embeddings."""

    def __init__(self, batchnorm: bool):
        super().__init__()
        norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.embed = nn.Sequential(
            nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 8)
        )
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        distance = (self.embed(x1) - self.embed(x2)).abs()
        return self.head(distance).squeeze(1)


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    images = make_images(args.seed)
    data = Pairs(images, args.seed)
    # --fix: a shuffled order, each rank a random share of both kinds
    sampler = DistributedSampler(data, shuffle=args.fix, seed=args.seed)
    loader = DataLoader(data, batch_size=16, sampler=sampler)

    torch.manual_seed(args.seed)
    model = DDP(Siamese(batchnorm=not args.no_batchnorm))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        data.epoch = epoch
        labels = []
        for x1, x2, y in loader:
            loss = F.binary_cross_entropy_with_logits(model(x1, x2), y.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            labels.append(y)
        if epoch == 0:
            same = int(torch.cat(labels).sum().item())
            log(
                f"rank={rank} epoch=0 same_class_pairs={same}"
                f" other_class_pairs={len(torch.cat(labels)) - same}"
            )

    # The same 256 pairs on every rank, drawn for an epoch not trained on,
    # scored through the wrapper (rank 0's statistics, copied at forward).
    test = Pairs(images, args.seed)
    test.epoch = args.epochs
    x1, x2, y = next(iter(DataLoader(test, batch_size=len(test))))
    model.eval()
    with torch.no_grad():
        correct = ((model(x1, x2) > 0) == (y > 0.5)).sum().item()
    if rank == 0:
        log(
            f"batchnorm={not args.no_batchnorm}"
            f" accuracy={correct / len(y):.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
