"""Exercise 2, solved: the MNIST classifier with DDP, its processes from srun.

srun starts this script once per task and tells each task who it is
(SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS); the job script tells them where
to meet (MASTER_ADDR, MASTER_PORT). Every line the six steps add carries a
`# step N` tag, or sits under a comment or statement that does:

    diff exercises/mnist_classify_ddp.py solutions/mnist_classify_ddp.py
    sbatch solutions/job_ddp_srun.sbatch --epochs 5
"""

import argparse
import os
import sys
import time
from datetime import timedelta  # step 1

import torch
import torch.distributed as dist  # step 1
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP  # step 2
from torch.utils.data import DataLoader, Subset  # step 3
from torch.utils.data.distributed import DistributedSampler  # step 3
from torchvision import transforms
from tqdm import tqdm

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


def setup_process_group() -> tuple[int, int, int]:  # step 1
    # step 1: who am I? srun numbers the tasks over all nodes (the rank) and
    # on this node (the local rank, which picks the GPU)
    rank = int(os.environ["SLURM_PROCID"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    # step 6: srun does not say where to meet: the job script exports it
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        sys.exit(
            "error: export MASTER_ADDR and MASTER_PORT before srun"
            " (see job_ddp_srun.sbatch)"
        )
    if torch.cuda.is_available():
        # step 1: before any CUDA work or collective, else all use GPU 0
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # step 1: the tasks on one node share its cores: more threads than
        # cores is slower
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", world_size)
        threads = torch.get_num_threads() // int(per_node)
        torch.set_num_threads(max(1, threads))
    # step 1: NCCL for NVIDIA GPUs, gloo for CPUs
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # step 1: a collective that waits this long for a lost rank fails
    # instead of hanging; a minute covers rank 0's MNIST download (11 MB)
    # at the barrier
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 60)))
    # step 1: this process's GPU, named: NCCL would otherwise guess it
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
    # step 1: rank 0 listens at MASTER_ADDR:MASTER_PORT, the others connect
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=gpu,
    )
    return rank, local_rank, world_size


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


# step 1 and 3: each rank builds its own loaders
def build_loaders(args: argparse.Namespace, rank: int, world_size: int):
    # step 1: rank 0 alone downloads; the others wait at the barrier, then
    # every rank reads the files
    if rank == 0:
        build_datasets(args.data_dir, download=True)
    dist.barrier()
    train_set, test_set = build_datasets(args.data_dir, download=False)
    # step 3: each rank its own share, in a new order each epoch (set_epoch),
    # padded to equal shares with the first samples again (4,000 on 3 ranks:
    # 3 x 1,334, 2 drawn twice), so that every rank takes as many steps
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)
    # step 3: every world_size-th test image, without the sampler's padding
    test_set = Subset(test_set, range(rank, len(test_set), world_size))
    # Persistent workers start once, not every epoch (slow, and can hang).
    kwargs = dict(
        num_workers=args.workers, persistent_workers=args.workers > 0
    )
    # Not fork: a fork while other threads hold a lock can hang the worker.
    kwargs["multiprocessing_context"] = "spawn" if args.workers else None
    # pin_memory: page-locked host memory makes copies to the GPU faster
    kwargs["pin_memory"] = torch.cuda.is_available()
    # step 3: the sampler, not shuffle=True, orders the training batches
    batch_size = args.batch_size
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, **kwargs)
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
    rank, local_rank, world_size = setup_process_group()  # step 1
    # Same seed, same initial weights and the same data order on every run.
    torch.manual_seed(args.seed)
    # step 4: on a GPU, this process's own: the one set_device picked
    cuda = f"cuda:{local_rank}"
    device = torch.device(cuda if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    # step 1: each process says who it is
    log(f"rank {rank}/{world_size} device={device} threads={threads}")

    train_loader, test_loader = build_loaders(args, rank, world_size)  # step 1

    model = Net().to(device)
    # step 2: DDP all-reduces the gradients in backward(): every copy of the
    # model takes the same step
    ids = [local_rank] if device.type == "cuda" else None
    model = DDP(model, device_ids=ids)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    # Smaller steps each epoch.
    step_lr = torch.optim.lr_scheduler.StepLR
    scheduler = step_lr(optimizer, step_size=1, gamma=0.7)

    for epoch in range(args.epochs):
        # step 3: a new shuffle each epoch, else each repeats epoch 0's order
        train_loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        # step 1: the progress bar on rank 0 alone
        show_bar = rank == 0
        totals = train_one_epoch(
            model, train_loader, optimizer, device, show_bar
        )
        # step 3: sum over the ranks, which also waits for the slowest rank
        dist.all_reduce(totals)
        # .tolist() waits until the device ends the epoch: then read the clock.
        train = totals.tolist()
        seconds = time.perf_counter() - start
        test_totals = evaluate(model, test_loader, device)
        dist.all_reduce(test_totals)  # step 3
        test = test_totals.tolist()
        scheduler.step()
        # step 1: one line per epoch, not one per rank
        if rank == 0:
            log(epoch_line(epoch, args.epochs, train, test, seconds))

    if args.checkpoint:
        # step 5: one writer; model.module unwraps DDP: keys without "module."
        if rank == 0:  # step 5
            save_checkpoint(model.module, args.checkpoint)
        # step 5: nobody reads the file before rank 0 has written it
        dist.barrier()  # step 5
    dist.destroy_process_group()  # step 1


if __name__ == "__main__":
    main()
