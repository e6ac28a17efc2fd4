"""A step of a PyTorch DDP course: train an image classifier. Its folder's README walks the diff."""

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from itertools import islice

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="images per step, per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--model", default="resnet18", help="any timm model name")
    parser.add_argument("--dataset", choices=["cifar10", "fake"], default="cifar10")
    parser.add_argument("--fake-size", type=int, default=50_000, help="images in --dataset fake")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=0, help="end each epoch early (0: never)")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="'' to skip")
    # speed: the defaults are the fast settings on a GPU, and plain fp32 eager on a CPU
    gpu = torch.cuda.is_available()
    precisions = ["fp32", "bf16", "fp16"]
    parser.add_argument("--precision", choices=precisions, default="bf16" if gpu else "fp32")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=gpu)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=gpu)
    parser.add_argument("--workers", type=int, default=4 if gpu else 0, help="loader processes")
    args = parser.parse_args()
    # Bad input, or a folder the run cannot write to, ends here: one line, not a traceback.
    if min(args.epochs, args.batch_size, args.fake_size) < 1:
        parser.error("--epochs, --batch-size and --fake-size must be at least 1")
    if not timm.is_model(args.model):
        parser.error(f"unknown --model {args.model!r}; timm.list_models() names them all")
    for folder in {os.path.dirname(p) or "." for p in [args.checkpoint] if p}:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            parser.error(f"cannot write to {os.path.abspath(folder)}: {error.strerror}")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def read_launcher_env() -> tuple[int, ...]:
    # step 6: torchrun and srun tell each process who it is; under plain python it is alone
    env = os.environ
    if "RANK" not in env and "SLURM_STEP_ID" not in env:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
        return 0, 0, 1, 1
    if "RANK" not in env and not {"MASTER_PORT", "SLURM_NTASKS_PER_NODE"} <= env.keys():
        sys.exit("error: under srun, export MASTER_ADDR and MASTER_PORT and give --ntasks-per-node")
    torchrun = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
    srun = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"]
    return tuple(int(env[name]) for name in (torchrun if "RANK" in env else srun))


def setup_process_group(rank: int, local_rank: int, world_size: int, local_world_size: int):
    # step 1: NCCL for NVIDIA GPUs, one per process; gloo for CPUs, whose cores they share
    if torch.cuda.is_available():
        if local_world_size > torch.cuda.device_count():  # step 4: one GPU per process
            sys.exit(f"error: {local_world_size} processes, {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // local_world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 300)))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def build_datasets(args: argparse.Namespace, download: bool) -> tuple:
    to_tensor = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    train_tf, test_tf = transforms.Compose(augment + to_tensor), transforms.Compose(to_tensor)
    if args.dataset == "fake":
        # Random images of CIFAR-10's shape: runs offline, learns nothing.
        size, shape = args.fake_size, (3, 32, 32)
        train = torchvision.datasets.FakeData(size, shape, 10, train_tf)
        test = torchvision.datasets.FakeData(size // 5, shape, 10, test_tf, random_offset=size)
        return train, test
    try:
        train = torchvision.datasets.CIFAR10(args.data_dir, True, train_tf, download=download)
        test = torchvision.datasets.CIFAR10(args.data_dir, False, test_tf, download=download)
    except (OSError, RuntimeError) as error:
        # Offline (a URLError is an OSError), or the files are missing or damaged.
        where = os.path.abspath(args.data_dir)
        sys.exit(f"error: no CIFAR-10 in {where} ({error}); download it, or use --dataset fake")
    return train, test


def build_model(name: str) -> torch.nn.Module:
    # An ImageNet model from timm, with 10 outputs. Its stem shrinks 32x32 images 4x at once:
    # fast, and less accurate than a CIFAR-specific stem would be.
    return timm.create_model(name, num_classes=10)


def train_one_epoch(model, loader, optimizer, device, max_steps: int, show_bar: bool, speed):
    """Returns (summed loss, correct predictions, images) as one tensor on `device`."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    steps = min(len(loader), max_steps or len(loader))
    # disable=None: a progress bar on a terminal only, never in a batch job's log file
    bar = tqdm(islice(loader, steps), total=steps, leave=False, disable=None if show_bar else True)
    for images, labels in bar:
        # speed: from pinned memory the copy to the GPU overlaps with the work queued before it
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with speed.autocast():
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        # speed: fp16 scales the loss up so that small gradients do not round to zero
        speed.scaler.scale(loss).backward()
        speed.scaler.step(optimizer)
        speed.scaler.update()
        # Sums stay on the device: a .item() here would wait for the GPU at every step.
        totals[0] += loss.detach() * len(labels)
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    return totals


@torch.no_grad()
def evaluate(model, loader, device, max_steps: int):
    """Returns (correct predictions, images) as one tensor on `device`; max_steps=0: all."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in islice(loader, max_steps or None):
        images, labels = images.to(device), labels.to(device)
        totals[0] += (model(images).argmax(1) == labels).sum()
        totals[1] += len(labels)
    return totals


def epoch_line(epoch: int, epochs: int, train: list, test: list, seconds: float) -> str:
    (loss_sum, correct, seen), (test_correct, test_seen) = train, test
    return (
        f"epoch {epoch + 1}/{epochs} train_loss={loss_sum / seen:.4f}"
        f" train_acc={100 * correct / seen:.2f}% train_samples={int(seen)}"
        f" test_acc={100 * test_correct / test_seen:.2f}% test_samples={int(test_seen)}"
        f" samples/s={seen / seconds:.1f} epoch_s={seconds:.2f}"
    )


def save_checkpoint(model: torch.nn.Module, path: str) -> None:
    torch.save(model.state_dict(), path)
    log(f"saved checkpoint {path}")


def main() -> None:  # step 6
    args = parse_args()
    rank, local_rank, world_size, local_world_size = read_launcher_env()
    setup_process_group(rank, local_rank, world_size, local_world_size)
    # Same seed, same initial weights and the same data order on every run.
    torch.manual_seed(args.seed)
    # step 4: name this process's GPU; "cuda" alone relies on set_device having been called
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    log(f"rank {rank}/{world_size} device={device} threads={torch.get_num_threads()}")  # step 1

    # step 1: rank 0 downloads; the others wait at the barrier, then read its files
    if rank == 0:
        build_datasets(args, download=True)
    dist.barrier()
    train_set, test_set = build_datasets(args, download=False)
    # step 3: each rank trains on its own shard, and scores every world_size-th test image
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    test_set = Subset(test_set, range(rank, len(test_set), world_size))
    # speed: worker processes decode and augment the next batches while the GPU trains; they
    # live as long as the loader (persistent) and fill page-locked (pinned) host memory
    loading = dict(
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        # Not fork: a fork while other threads hold a lock can hang the worker.
        multiprocessing_context="forkserver" if args.workers else None,
    )
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, **loading)
    test_loader = DataLoader(test_set, args.batch_size, **loading)

    model = build_model(args.model).to(device)
    # speed: channels-last (NHWC) is the layout tensor cores want for convolutions
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # step 2: DDP copies rank 0's weights to every rank, then averages gradients in backward()
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    # speed: autocast runs matmuls and convolutions in 16 bits, keeps sums in fp32; bf16 has
    # fp32's range and needs no GradScaler, fp16 does; fp32 turns both off
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    speed = argparse.Namespace(
        autocast=partial(torch.autocast, device.type, dtype=dtype, enabled=dtype is not None),
        scaler=torch.amp.GradScaler(device.type, enabled=args.precision == "fp16"),
    )
    if args.compile:
        # speed: compiles in place (same state_dict keys); the first steps of epoch 1 compile
        model.compile()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # step 3: a new shuffle every epoch, else epoch 0's order
        start = time.perf_counter()
        totals = train_one_epoch(
            model, train_loader, optimizer, device, args.max_steps, rank == 0, speed
        )
        dist.all_reduce(totals)  # step 3: add up the counts of all ranks
        # .tolist() waits until the device has finished the epoch: only then read the clock.
        train = totals.tolist()
        seconds = time.perf_counter() - start
        test_totals = evaluate(model.module, test_loader, device, args.max_steps)
        dist.all_reduce(test_totals)  # step 3
        test = test_totals.tolist()
        scheduler.step()
        if rank == 0:  # step 1: one line per epoch, not one per process
            log(epoch_line(epoch, args.epochs, train, test, seconds))

    if args.checkpoint and rank == 0:  # step 1: one writer
        # step 5: save the model inside DDP's wrapper: keys without the "module." prefix
        save_checkpoint(model.module, args.checkpoint)
        build_model(args.model).load_state_dict(torch.load(args.checkpoint, map_location="cpu"))
        log(f"checkpoint {args.checkpoint} loads into a bare {args.model}")  # step 5
    dist.destroy_process_group()  # step 1


if __name__ == "__main__":
    main()  # step 6: torchrun, srun or python starts this script once per process
