"""Exercise 2: turn this serial MNIST classifier into a DDP script, in six steps.

This file is exercises/mnist_classify.py plus `TODO(step N)` comments where each change
goes; it still runs serially as it is. Work through the steps, then run it on 2 processes
and let the autograder check it (exercises/README.md):

    srun -n 2 python exercises/mnist_classify_ddp.py --batch-size 128 --epochs 5 --data-dir data
    DDP_EXERCISE_SCRIPT=exercises/mnist_classify_ddp.py python -m pytest tests/test_exercises.py -k autograde
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from tqdm import tqdm

# TODO(step 1): import torch.distributed as dist
# TODO(step 2): from torch.nn.parallel import DistributedDataParallel as DDP
# TODO(step 3): from torch.utils.data.distributed import DistributedSampler (and Subset for the test set)

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)  # pixel statistics of the MNIST training set


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate")
    parser.add_argument("--data-dir", default="data", help="MNIST is downloaded here if missing")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="mnist_cnn.pt", help="where to save the weights ('' to skip)")
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines from several processes sharing a terminal never interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


# TODO(step 1): a function ddp_setup() -> (rank, local_rank, world_size) that
#   - reads them from srun's variables SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS,
#   - on a GPU calls torch.cuda.set_device(local_rank) BEFORE joining the group,
#   - on a CPU gives each process its share of the cores: torch.set_num_threads(cores // processes on the node)
#     unless OMP_NUM_THREADS is set,
#   - joins the group: dist.init_process_group("nccl" on GPUs, "gloo" on CPUs, rank=..., world_size=...).
# TODO(step 6): srun starts the processes but does not tell them where to meet: the job script exports
#   MASTER_ADDR (the job's first node) and MASTER_PORT (a free port) before srun.


def build_datasets(data_dir: str, download: bool) -> tuple[Dataset, Dataset]:
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])
    train = torchvision.datasets.MNIST(data_dir, train=True, transform=to_tensor, download=download)
    test = torchvision.datasets.MNIST(data_dir, train=False, transform=to_tensor, download=download)
    return train, test


def build_loaders(args: argparse.Namespace, pin: bool) -> tuple[DataLoader, DataLoader]:  # TODO(step 1 and 3): + rank, world_size
    # TODO(step 1): only rank 0 downloads; the others wait at dist.barrier(), then everyone reads (download=False)
    train_set, test_set = build_datasets(args.data_dir, download=True)
    # TODO(step 3): give each rank its own share: a DistributedSampler(train_set, ...) instead of shuffle=True,
    #   and Subset(test_set, range(rank, len(test_set), world_size)) for the test set
    # pin: page-locked host memory makes copies to the GPU faster
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=pin)
    test_loader = DataLoader(test_set, 1000, num_workers=args.workers, pin_memory=pin)
    return train_loader, test_loader


class Net(nn.Module):
    """Two convolutions find strokes, two linear layers vote on the digit; dropout fights overfitting."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)  # 28x28 -> 26x26, max-pooled to 13x13
        self.conv2 = nn.Conv2d(16, 32, 3)  # -> 11x11, max-pooled to 5x5
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(self.dropout1(torch.flatten(x, 1))))
        return self.fc2(self.dropout2(x))  # logits


def train_one_epoch(model, loader, optimizer, device, show_progress: bool) -> torch.Tensor:
    """Returns (summed loss, correct predictions, samples seen) as one tensor."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in tqdm(loader, disable=not show_progress, leave=False):
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach() * len(labels)  # tensors, not .item(): no GPU sync per step
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    return totals


@torch.no_grad()
def evaluate(model, loader, device) -> torch.Tensor:
    """Returns (correct predictions, samples seen) as one tensor."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        totals[0] += (model(images).argmax(1) == labels).sum()
        totals[1] += len(labels)
    return totals


def epoch_line(epoch: int, epochs: int, train: torch.Tensor, test: torch.Tensor, seconds: float) -> str:
    loss_sum, correct, seen = train.tolist()
    test_correct, test_seen = test.tolist()
    return (
        f"epoch {epoch + 1}/{epochs} train_loss={loss_sum / seen:.4f} train_acc={100 * correct / seen:.2f}%"
        f" train_samples={int(seen)} test_acc={100 * test_correct / test_seen:.2f}% test_samples={int(test_seen)}"
        f" samples/s={seen / seconds:.1f} epoch_s={seconds:.2f}"
    )


def save_checkpoint(model: nn.Module, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(model.state_dict(), path)
    log(f"saved checkpoint {path}")


def main() -> None:
    args = parse_args()
    # TODO(step 1): rank, local_rank, world_size = ddp_setup()
    torch.manual_seed(args.seed)  # same seed, same initial weights and data order
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # TODO(step 4): this rank's GPU, cuda:<local_rank>
    log(f"device={device} batch_size={args.batch_size} threads={torch.get_num_threads()}")  # TODO(step 1): and my rank

    train_loader, test_loader = build_loaders(args, pin=device.type == "cuda")  # TODO(step 1 and 3): + rank, world_size

    model = Net().to(device)
    # TODO(step 2): wrap it: DDP(model, device_ids=[local_rank]) on a GPU, device_ids=None on a CPU
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # smaller steps each epoch

    for epoch in range(args.epochs):
        # TODO(step 3): train_loader.sampler.set_epoch(epoch), else every epoch repeats the same order
        # TODO(step 1): timing hint: dist.barrier() before each time.perf_counter(), so the clock waits for every rank
        start = time.perf_counter()
        train_totals = train_one_epoch(model, train_loader, optimizer, device, show_progress=True)  # TODO(step 1): bar on rank 0
        seconds = time.perf_counter() - start
        test_totals = evaluate(model, test_loader, device)
        # TODO(step 3): each rank counted only its share: dist.all_reduce() both totals (sums over ranks)
        scheduler.step()
        log(epoch_line(epoch, args.epochs, train_totals, test_totals, seconds))  # TODO(step 1): rank 0 only

    if args.checkpoint:
        save_checkpoint(model, args.checkpoint)  # TODO(step 5): rank 0 saves model.module, then all wait at a barrier
    # TODO(step 1): leave the group: dist.destroy_process_group()


if __name__ == "__main__":
    main()
