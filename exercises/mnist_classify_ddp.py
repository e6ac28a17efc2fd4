"""Exercise 2: make this serial MNIST classifier a DDP script, in six steps.

This file is exercises/mnist_classify.py plus `TODO(step N)` comments where
each change goes; as it is, it still runs serially. Work through the steps, run
it on 2 processes, then let the autograder check it (exercises/README.md has
the commands):

    DDP_EXERCISE_SCRIPT=exercises/mnist_classify_ddp.py \
        python -m pytest tests/test_exercises.py -k autograde
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader
from torchvision import transforms
from tqdm import tqdm

# TODO(step 1): from datetime import timedelta, import torch.distributed
# TODO(step 2): from torch.nn.parallel import DistributedDataParallel as DDP
# TODO(step 3): DistributedSampler (torch.utils.data.distributed) and Subset

# Pixel mean and standard deviation of the MNIST training set.
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=128, help="per process"
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--lr", type=float, default=1.0, help="Adadelta learning rate"
    )
    parser.add_argument(
        "--data-dir",
        default="data",
        help="MNIST is downloaded here if missing",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="DataLoader worker processes"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint", default="mnist_cnn.pt", help="'' to skip"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


# TODO(step 1): a function setup_process_group() that returns
#   (rank, local_rank, world_size) and
#   - reads them from srun's SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS;
#   - on a GPU, calls torch.cuda.set_device(local_rank) before any CUDA work;
#   - on CPUs, unless OMP_NUM_THREADS is set, gives each process its share of
#     the cores: torch.set_num_threads(max(1, threads // tasks)), where
#     threads = torch.get_num_threads() and tasks, those on this node, is
#     SLURM_NTASKS_PER_NODE (else world_size);
#   - joins the group: dist.init_process_group("nccl" on GPUs, "gloo" on
#     CPUs, rank=..., world_size=..., timeout=timeout, device_id=...): the
#     GPU's index on a GPU (else NCCL guesses it, and warns), None on CPUs;
#     timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 60))):
#     then a
#     collective that waits for a lost rank fails after a minute instead of
#     hanging (a minute covers rank 0's MNIST download at the barrier).
# TODO(step 6): srun starts the processes but does not tell them where to
#   meet: the job script exports MASTER_ADDR (the job's first node) and
#   MASTER_PORT (a free port) before srun. Without them, end with
#   sys.exit("error: ...") saying so.


def build_datasets(data_dir: str, download: bool) -> tuple:
    normalize = transforms.Normalize(MNIST_MEAN, MNIST_STD)
    norm = transforms.Compose([transforms.ToTensor(), normalize])
    mnist = torchvision.datasets.MNIST
    try:
        train = mnist(data_dir, True, transform=norm, download=download)
        test = mnist(data_dir, False, transform=norm, download=download)
    except (OSError, RuntimeError):
        # Offline (a URLError is an OSError), or files missing or damaged.
        sys.exit(
            f"error: no MNIST in {os.path.abspath(data_dir)} and no download;"
            " offline, write 5,000 real digits with:"
            " python exercises/get_mnist_subset.py data/mnist-5k"
        )
    return train, test


def build_loaders(args: argparse.Namespace):
    # TODO(step 1 and 3): build_loaders needs rank and world_size.
    # TODO(step 1): only rank 0 downloads; the others wait at dist.barrier(),
    #   then every rank reads the files (download=False).
    train_set, test_set = build_datasets(args.data_dir, download=True)
    # TODO(step 3): each rank its own share of the training set: a
    #   DistributedSampler(train_set, ...) instead of shuffle=True; and
    #   Subset(test_set, range(rank, len(test_set), world_size))
    # Persistent workers start once, not every epoch (slow, and can hang).
    kwargs = dict(
        num_workers=args.workers, persistent_workers=args.workers > 0
    )
    # Not fork: a fork while other threads hold a lock can hang the worker.
    kwargs["multiprocessing_context"] = "spawn" if args.workers else None
    # pin_memory: page-locked host memory makes copies to the GPU faster
    kwargs["pin_memory"] = torch.cuda.is_available()
    train_loader = DataLoader(
        train_set, args.batch_size, shuffle=True, **kwargs
    )
    test_loader = DataLoader(test_set, 1000, **kwargs)
    return train_loader, test_loader


class Net(nn.Module):
    """Two convolutions find strokes, two linear layers vote on the digit;
    dropout against overfitting. Returns logits."""

    def __init__(self) -> None:
        super().__init__()
        # 28x28 -> 26x26, max-pooled to 13x13; then 11x11, max-pooled to 5x5
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(self.dropout1(torch.flatten(x, 1))))
        return self.fc2(self.dropout2(x))


def train_one_epoch(model, loader, optimizer, device, show_bar: bool):
    """(summed loss, correct predictions, images): one tensor on `device`."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    # disable=None: a progress bar on a terminal only, never in a job's log
    bar = tqdm(loader, leave=False, disable=None if show_bar else True)
    for images, labels in bar:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # Sums stay on the device: .item() would wait for the GPU every step.
        totals[0] += loss.detach() * len(labels)
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    return totals


@torch.no_grad()
def evaluate(model, loader, device) -> torch.Tensor:
    """(correct predictions, images): one tensor on `device`."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        totals[0] += (model(images).argmax(1) == labels).sum()
        totals[1] += len(labels)
    return totals


def epoch_line(epoch, epochs, train: list, test: list, seconds: float) -> str:
    loss_sum, correct, seen = train
    test_correct, test_seen = test
    return (
        f"epoch {epoch + 1}/{epochs} train_loss={loss_sum / seen:.4f}"
        f" train_acc={100 * correct / seen:.2f}% train_samples={int(seen)}"
        f" test_acc={100 * test_correct / test_seen:.2f}%"
        f" test_samples={int(test_seen)}"
        f" samples/s={seen / seconds:.1f} epoch_s={seconds:.2f}"
    )


def save_checkpoint(model: nn.Module, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(model.state_dict(), path)
    log(f"saved checkpoint {path}")


def main() -> None:
    args = parse_args()
    # TODO(step 1): rank, local_rank, world_size = setup_process_group()
    # Same seed, same initial weights and the same data order on every run.
    torch.manual_seed(args.seed)
    # TODO(step 4): on a GPU, this rank's own one: cuda:<local_rank>
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    # TODO(step 1): say which rank is speaking: rank {rank}/{world_size}
    log(f"device={device} threads={threads}")

    # TODO(step 1 and 3): pass rank and world_size
    train_loader, test_loader = build_loaders(args)

    model = Net().to(device)
    # TODO(step 2): wrap it: DDP(model, device_ids=[local_rank]) on a GPU,
    #   device_ids=None on CPUs
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    # Smaller steps each epoch.
    step_lr = torch.optim.lr_scheduler.StepLR
    scheduler = step_lr(optimizer, step_size=1, gamma=0.7)

    for epoch in range(args.epochs):
        # TODO(step 3): train_loader.sampler.set_epoch(epoch): without it,
        #   every epoch has the same order
        start = time.perf_counter()
        # TODO(step 1): the progress bar on rank 0 only (show_bar = rank == 0)
        show_bar = True
        totals = train_one_epoch(
            model, train_loader, optimizer, device, show_bar
        )
        # TODO(step 3): each rank counted its share: dist.all_reduce(totals)
        #   sums them over the ranks. It also waits for the slowest rank, so
        #   the clock below stops once the epoch has ended everywhere: no
        #   dist.barrier() needed.
        # .tolist() waits until the device ends the epoch: then read the clock.
        train = totals.tolist()
        seconds = time.perf_counter() - start
        test_totals = evaluate(model, test_loader, device)
        # TODO(step 3): dist.all_reduce(test_totals) too
        test = test_totals.tolist()
        scheduler.step()
        # TODO(step 1): rank 0 alone prints the epoch line
        log(epoch_line(epoch, args.epochs, train, test, seconds))

    if args.checkpoint:
        # TODO(step 5): rank 0 alone saves model.module: keys without "module."
        #   Then every rank waits at dist.barrier() until the file is written.
        save_checkpoint(model, args.checkpoint)
    # TODO(step 1): leave the group: dist.destroy_process_group()


if __name__ == "__main__":
    main()
