"""Exercise 2 / Bonus 2, solved: the MNIST classifier with DDP, processes started by torchrun.

torchrun starts --nproc_per_node processes on each node and tells each one its RANK,
LOCAL_RANK, WORLD_SIZE and where to meet; under Slurm, srun starts one torchrun per node.
Compared with the srun version only step 6 differs: where ranks come from.

    diff exercises/mnist_classify_ddp.py solutions/mnist_classify_ddp_torchrun.py
    diff solutions/mnist_classify_ddp.py solutions/mnist_classify_ddp_torchrun.py
    torchrun --standalone --nproc_per_node=2 solutions/mnist_classify_ddp_torchrun.py --epochs 5 --data-dir data
    sbatch solutions/job_ddp_torchrun.sbatch --epochs 5 --data-dir data
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist  # step 1
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP  # step 2
from torch.utils.data import DataLoader, Dataset, Subset  # step 3: Subset
from torch.utils.data.distributed import DistributedSampler  # step 3
from torchvision import transforms
from tqdm import tqdm

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


def cpu_threads(tasks_on_this_node: int) -> int:  # step 1: tasks on one node share its cores
    if "OMP_NUM_THREADS" in os.environ:  # step 1: an explicit choice wins (torchrun sets 1 unless you do)
        return int(os.environ["OMP_NUM_THREADS"])  # step 1
    return max(1, len(os.sched_getaffinity(0)) // tasks_on_this_node)  # step 1


def ddp_setup() -> tuple[int, int, int]:  # step 1: who am I? Then join the others
    rank = int(os.environ["RANK"])  # step 6: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    local_rank = int(os.environ["LOCAL_RANK"])  # step 6: MASTER_ADDR and MASTER_PORT for every process it starts
    world_size = int(os.environ["WORLD_SIZE"])  # step 6
    if torch.cuda.is_available():  # step 1
        torch.cuda.set_device(local_rank)  # step 1: before init_process_group, else ranks pile onto GPU 0
    else:  # step 1: else N ranks oversubscribe the CPU
        torch.set_num_threads(cpu_threads(int(os.environ["LOCAL_WORLD_SIZE"])))  # step 6: processes on this node
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # step 1: NCCL for NVIDIA GPUs, gloo for CPUs
    dist.init_process_group(backend)  # step 6: rank, world size and master address: all from torchrun's variables
    return rank, local_rank, world_size  # step 1


def build_datasets(data_dir: str, download: bool) -> tuple[Dataset, Dataset]:
    to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])
    train = torchvision.datasets.MNIST(data_dir, train=True, transform=to_tensor, download=download)
    test = torchvision.datasets.MNIST(data_dir, train=False, transform=to_tensor, download=download)
    return train, test


def build_loaders(args: argparse.Namespace, pin: bool, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:  # step 1 and 3
    if rank == 0:  # step 1: one process downloads; the others wait at the barrier, then read the files
        build_datasets(args.data_dir, download=True)  # step 1
    dist.barrier()  # step 1
    train_set, test_set = build_datasets(args.data_dir, download=False)  # step 1
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)  # step 3: my share
    test_set = Subset(test_set, range(rank, len(test_set), world_size))  # step 3: every world_size-th image, no padding
    # pin: page-locked host memory makes copies to the GPU faster
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers, pin_memory=pin)  # step 3
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
    rank, local_rank, world_size = ddp_setup()  # step 1
    torch.manual_seed(args.seed)  # same seed, same initial weights and data order
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")  # step 4: my GPU, by number
    log(f"rank {rank}/{world_size} device={device} batch_size={args.batch_size} threads={torch.get_num_threads()}")  # step 1

    train_loader, test_loader = build_loaders(args, device.type == "cuda", rank, world_size)  # step 1 and 3: who I am

    model = Net().to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)  # step 2: all-reduces the gradients
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # smaller steps each epoch

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # step 3: else every epoch repeats epoch 0's order
        dist.barrier()  # step 1: timing hint: all ranks start the clock together...
        start = time.perf_counter()
        train_totals = train_one_epoch(model, train_loader, optimizer, device, show_progress=rank == 0)  # step 1
        dist.barrier()  # step 1: ...and stop it when the slowest has finished
        seconds = time.perf_counter() - start
        test_totals = evaluate(model, test_loader, device)
        dist.all_reduce(train_totals)  # step 3: sum over ranks: every rank saw a different share
        dist.all_reduce(test_totals)  # step 3
        scheduler.step()
        if rank == 0:  # step 1: one line per epoch, not one per rank
            log(epoch_line(epoch, args.epochs, train_totals, test_totals, seconds))

    if args.checkpoint:
        if rank == 0:  # step 5: one writer
            save_checkpoint(model.module, args.checkpoint)  # step 5: unwrap: keys without "module."
        dist.barrier()  # step 5: nobody reads the file before rank 0 has finished writing it
    dist.destroy_process_group()  # step 1: leave cleanly


if __name__ == "__main__":
    main()
