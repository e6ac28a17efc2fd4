"""Your own script: random draws inside a data set.

A siamese network's data set as public scripts often write it: __getitem__
draws its pair with Python's random (a first image, whether the pair is of
one class, a second image to match), so the index chooses nothing. The
script seeds as seed-everything helpers do: Python's random and torch, the
same seed on every rank. Each rank's DistributedSampler hands out its own
indices, and each rank draws the same pairs. Seeding torch again does not
seed Python's random: a second pass draws other pairs, so a run does not
repeat. (Loader workers, --workers N, seed Python's random from torch's
generator, alike on every rank: the same pairs again.) With --fix the index
chooses the first image, and the rest is drawn from a generator of the
pair's own, keyed by the seed, the epoch and the index: the same pair on any
rank, in any worker, in every run.

    torchrun --standalone --nproc_per_node=2 pair_draws.py
    torchrun --standalone --nproc_per_node=2 pair_draws.py --fix
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CLASSES, PER_CLASS = 4, 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="draw each pair from its own key"
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="loader workers per rank"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if args.workers < 0 or args.timeout <= 0:
        parser.error("--workers must be >= 0, --timeout > 0")
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
    """(first image, second image, 1.0 if one class, the two image ids)."""

    def __init__(self, images: torch.Tensor, fix: bool, seed: int):
        self.images, self.fix, self.seed, self.epoch = images, fix, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        if self.fix:
            # --fix: the index chooses the first image; the rest comes from
            # a generator of this pair's own: (seed, epoch, index) decide it
            key = (self.seed * 1_000_003 + self.epoch) * 1_000_003 + index
            draw, first = random.Random(key), index
        else:
            # Python's random, as the single-device script draws: the index
            # chooses nothing
            draw = random
            first = draw.randrange(len(self.images))
        same = draw.random() < 0.5
        cls = first // PER_CLASS
        if not same:
            cls = (cls + draw.randrange(1, CLASSES)) % CLASSES
        second = cls * PER_CLASS + draw.randrange(PER_CLASS)
        pair = torch.tensor([first, second])
        return self.images[first], self.images[second], float(same), pair


def one_pass(loader: DataLoader, epoch: int) -> list[tuple[int, int]]:
    """The (first, second) image ids of every pair this rank loads."""
    loader.sampler.set_epoch(epoch)
    loader.dataset.set_epoch(epoch)
    return [tuple(p.tolist()) for *_, pairs in loader for p in pairs]


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The single-device script's seeding, as seed-everything helpers do it
    # (numpy's too, where it is used): the same seed on every rank.
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    data = Pairs(make_images(args.seed), args.fix, args.seed)
    # A spawned worker starts clean: no lock of gloo's threads inherited.
    context = "spawn" if args.workers else None
    loader = DataLoader(
        data,
        batch_size=16,
        sampler=DistributedSampler(data, seed=args.seed),
        num_workers=args.workers,
        multiprocessing_context=context,
    )
    pairs = one_pass(loader, epoch=0)
    # A rerun seeds torch again: does the pass repeat?
    torch.manual_seed(args.seed)
    again = one_pass(loader, epoch=0)
    repeated = sum(a == b for a, b in zip(pairs, again, strict=True))
    log(f"rank={rank} pairs={len(pairs)} repeated_after_reseed={repeated}")

    indices = list(loader.sampler)
    shares = [None] * world_size
    dist.all_gather_object(shares, (indices, pairs))
    if rank == 0:
        # rank 1's indices, and its pairs of images, that rank 0 had too
        (i0, p0), (i1, p1) = shares[:2]
        log(
            f"indices_on_both_ranks={len(set(i0) & set(i1))}"
            f" pairs_on_both_ranks={sum(p in set(p0) for p in p1)}"
            f" of {len(p1)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
