"""Random state per rank: the same seed gives every rank the same crops.

Every rank calls torch.manual_seed(seed) with the same seed, as the course's
scripts do up to part 3's step 2: the model starts the same everywhere. But
the random augmentation draws from the same generator afterwards, so the
k-th sample of every rank's batch gets the same flip and the same crop
offset: the ranks hold different images, augmented in lockstep. No error,
no warning; only less variety than the run seems to have.

    python part4_torchrun/errors/random_state.py
    python part4_torchrun/errors/random_state.py --fix

--fix: after the model is built, each rank reseeds with seed + rank: the
model stays identical, the augmentation differs per rank.

Evidence lines (rank 0):
    augment rank=0 flips=0,0,0,1 shifts=1,-1,-1,-1
    augment rank=1 flips=0,0,0,1 shifts=1,-1,-1,-1
    compare fix=False model_identical=True augment_identical=True
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

WORLD_SIZE = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="reseed with seed + rank"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


class Augmented(Dataset):
    """64 small images, each flipped at random and shifted by up to 2
    pixels (a random crop of the padded image); returns the image and the
    flip and shift drawn, to compare them across ranks."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.images = torch.randn(64, 3, 8, 8, generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        flip = int(torch.rand(()) < 0.5)
        shift = int(torch.randint(-2, 3, ()))
        if flip:
            image = image.flip(-1)
        padded = nn.functional.pad(image, (2, 2, 2, 2))
        image = padded[:, 2:10, 2 + shift : 10 + shift]
        return image, torch.tensor([flip, shift])


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    # Every rank's copy of the tensor.
    copies = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor)
    return copies


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
    # The same seed on every rank: the same initial weights.
    torch.manual_seed(args.seed)
    model = nn.Linear(3 * 8 * 8, 10)
    if args.fix:
        # fix: the data's randomness differs per rank from here on
        torch.manual_seed(args.seed + rank)
    data = Augmented()
    # The sampler shuffles with its own generator: different samples per
    # rank either way.
    sampler = DistributedSampler(data, world_size, rank, seed=args.seed)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    _, drawn = next(iter(loader))

    weights = gathered(model.weight.detach())
    draws = gathered(drawn)
    if rank == 0:
        for r, d in enumerate(draws):
            flips = ",".join(str(int(f)) for f in d[:, 0])
            shifts = ",".join(str(int(s)) for s in d[:, 1])
            log(f"augment rank={r} flips={flips} shifts={shifts}")
        same_model = all(torch.equal(weights[0], w) for w in weights)
        same_draws = all(torch.equal(draws[0], d) for d in draws)
        log(
            f"compare fix={args.fix} model_identical={same_model}"
            f" augment_identical={same_draws}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn).
    method = "fork" if sys.platform == "linux" else "spawn"
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
