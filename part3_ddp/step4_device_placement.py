"""Part 3, step 4: device placement. Each process names its own GPU, cuda:LOCAL_RANK.

After step 1's set_device, "cuda" already meant this process's GPU; naming it explicitly
keeps the model, each batch and the metrics on the right device whatever code runs later
(a library that creates tensors on "cuda" would otherwise rely on that global setting).

    diff -u part3_ddp/step3_distributed_sampler.py part3_ddp/step4_device_placement.py
    python part3_ddp/step4_device_placement.py --dataset fake --epochs 1 --max-steps 20
"""

import argparse
import difflib
import os
import socket  # step 1: find a free port for the processes to meet on
import sys
import time
from datetime import timedelta  # step 1: process-group timeout
from typing import NoReturn

import timm
import torch
import torch.distributed as dist  # step 1
import torch.multiprocessing as mp  # step 1
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP  # step 2
from torch.utils.data import DataLoader, Dataset, Subset  # step 3: Subset
from torch.utils.data.distributed import DistributedSampler  # step 3
from torchvision import transforms
from tqdm import tqdm

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
NUM_CLASSES = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 (sgd), 1e-3 (adamw)")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--model", default="resnet18", help="any timm model name")
    parser.add_argument("--pretrained", action="store_true", help="ImageNet weights (needs network)")
    parser.add_argument("--dataset", choices=["cifar10", "fake"], default="cifar10")
    parser.add_argument("--fake-size", type=int, default=50_000, help="train images with --dataset fake")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--image-size", type=int, default=32, help="resize inputs, e.g. 224 for pretrained")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--prefetch-factor", type=int, default=None, help="batches each worker loads ahead (default 2; only with --workers > 0)")
    parser.add_argument("--amp", choices=["off", "bf16", "fp16"], default="bf16" if torch.cuda.is_available() else "off", help="mixed precision (default: bf16 on a GPU; off on the CPU, where it is slower)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(), help="NHWC memory layout (default: on with a GPU)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps compile; off by default)")
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (GPUs only)")  # step 2
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=0, help="cap batches per epoch (0: no cap)")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="where to save the weights ('' to skip)")
    parser.add_argument("--nprocs", type=int, default=torch.cuda.device_count() or 2, help="processes (ranks)")  # step 1
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1:  # caught now, not as a crash (or a silent no-op) later
        fail(f"--epochs and --batch-size must be at least 1, got {args.epochs} and {args.batch_size}")
    if not timm.is_model(args.model):  # a typo: name the closest models timm knows
        fail(f"unknown --model {args.model!r}; close matches in timm: {difflib.get_close_matches(args.model, timm.list_models(), 5)}")
    if os.path.isdir(args.checkpoint):  # found out before training, not when saving after it
        fail(f"--checkpoint {args.checkpoint} is a directory; give a file name, e.g. {os.path.join(args.checkpoint, 'model.pt')}")
    if args.sync_bn and not torch.cuda.is_available():  # step 2: SyncBatchNorm's collectives run on GPUs only
        fail("--sync-bn needs GPUs; on the CPU leave it off (each rank then normalises with its own batch's statistics)")
    return args


def log(message: str) -> None:
    # One write per line: lines from several processes sharing a terminal never interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def fail(message: str) -> NoReturn:  # a user error, not a bug: one line that says what to do, no traceback
    sys.stderr.write(f"error: {message}\n")  # one write, as in log()
    sys.exit(1)


def find_free_port() -> int:  # step 1: the OS picks a port nobody uses (no clash with a stale run)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_threads_per_process(local_world_size: int) -> int:  # step 1: processes on one machine share its cores
    if "OMP_NUM_THREADS" in os.environ:  # an explicit choice (yours, or torchrun's) wins
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_world_size)


def setup_process_group(rank: int, world_size: int, local_rank: int, local_world_size: int, device: torch.device) -> None:  # step 1
    if device.type == "cuda" and local_world_size > torch.cuda.device_count():  # NCCL needs a GPU per process
        fail(f"{local_world_size} processes on this machine but {torch.cuda.device_count()} GPU(s): start at most that many, or use gloo on the CPU with CUDA_VISIBLE_DEVICES=''")
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)  # before init_process_group: else ranks can pile onto GPU 0
    else:
        torch.set_num_threads(cpu_threads_per_process(local_world_size))  # else N ranks oversubscribe the CPU
    backend = "nccl" if device.type == "cuda" else "gloo"  # NCCL for NVIDIA GPUs, gloo for CPUs
    timeout = timedelta(seconds=float(os.environ.get("DDP_TIMEOUT_S", 1800)))  # how long a collective waits for a lost rank
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)  # MASTER_ADDR/PORT
    except dist.DistNetworkError as error:  # usually MASTER_PORT is taken, e.g. by a run that never exited
        fail(f"rank {rank} cannot use {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ({error}); if the port is taken, unset MASTER_PORT to get a free one")


def build_transforms(image_size: int, train: bool) -> transforms.Compose:
    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if train else []
    if image_size != 32:
        steps.append(transforms.Resize(image_size, antialias=True))
    steps += [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    return transforms.Compose(steps)


def build_datasets(args: argparse.Namespace, download: bool) -> tuple[Dataset, Dataset]:
    train_tf, test_tf = build_transforms(args.image_size, True), build_transforms(args.image_size, False)
    if args.dataset == "fake":  # random images with CIFAR-10's shape: runs offline
        shape = (3, 32, 32)
        train = torchvision.datasets.FakeData(args.fake_size, shape, NUM_CLASSES, train_tf, random_offset=0)
        test = torchvision.datasets.FakeData(args.fake_size // 5, shape, NUM_CLASSES, test_tf, random_offset=1)
        return train, test
    try:
        train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf, download=download)
        test = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf, download=download)
    except (OSError, RuntimeError) as error:  # offline (a URLError is an OSError), or files missing or damaged
        fail(f"no CIFAR-10 in {os.path.abspath(args.data_dir)} and no download ({error}): copy {torchvision.datasets.CIFAR10.url} into it, or use --dataset fake")
    return train, test


def build_model(name: str, pretrained: bool, image_size: int) -> nn.Module:
    model = timm.create_model(name, pretrained=pretrained, num_classes=NUM_CLASSES)
    stem = getattr(model, "conv1", None)
    if image_size <= 64 and isinstance(stem, nn.Conv2d) and hasattr(model, "maxpool"):
        # ImageNet ResNets shrink the input 4x before the first block; on 32x32 images that
        # leaves 1x1 feature maps. A 3x3 stride-1 stem and no max-pool is the CIFAR variant.
        model.conv1 = nn.Conv2d(3, stem.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def build_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        lr = args.lr or 0.1
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    return torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3, weight_decay=0.05)


def steps_in(loader: DataLoader, max_steps: int) -> int:
    return min(len(loader), max_steps) if max_steps else len(loader)


def autocast_context(amp: str, device: torch.device) -> torch.autocast:  # convs and matmuls in 16 bits, sums stay fp32
    return torch.autocast(device.type, dtype=torch.float16 if amp == "fp16" else torch.bfloat16, enabled=amp != "off")


def train_one_epoch(model, loader, optimizer, scaler, device, max_steps: int, amp: str, show_progress: bool) -> torch.Tensor:
    """Returns (summed loss, correct predictions, samples seen) as one tensor."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    progress = tqdm(loader, total=steps_in(loader, max_steps), disable=not show_progress, leave=False)
    for step, (images, labels) in enumerate(progress):
        if max_steps and step >= max_steps:
            break
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)  # step 4
        with autocast_context(amp, device):  # the forward pass only; backward reuses its precisions
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # fp16: scale up so small gradients do not round to zero
        scaler.step(optimizer)  # unscales first; skips the step if a gradient overflowed
        scaler.update()  # (with bf16 or fp32 the scaler is off and these three are plain backward/step)
        totals[0] += loss.detach() * len(labels)  # tensors, not .item(): no GPU sync per step
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
        progress.set_postfix(loss=f"{loss.item():.3f}")
    return totals


@torch.no_grad()
def evaluate(model, loader, device, max_steps: int, amp: str) -> torch.Tensor:
    """Returns (correct predictions, samples seen) as one tensor."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for step, (images, labels) in enumerate(loader):
        if max_steps and step >= max_steps:
            break
        images, labels = images.to(device), labels.to(device)
        with autocast_context(amp, device):
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


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:  # step 1: runs in every process
    local_rank, local_world_size = rank, world_size  # step 1: one machine, so local rank == global rank
    torch.manual_seed(args.seed)  # same seed, same initial weights and data order
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")  # step 4: my GPU, by name
    setup_process_group(rank, world_size, local_rank, local_world_size, device)  # step 1
    log(f"rank {rank}/{world_size} local_rank={local_rank} device={device} threads={torch.get_num_threads()}")  # step 1
    if rank == 0:  # step 1: per process vs global batch
        log(f"batch_size={args.batch_size} per process, global batch={args.batch_size * world_size}")

    if rank == 0:  # step 1: one process downloads; the others wait at the barrier, then read the files
        build_datasets(args, download=True)
    dist.barrier()  # step 1
    train_set, test_set = build_datasets(args, download=False)  # step 1
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)  # step 3
    test_set = Subset(test_set, range(rank, len(test_set), world_size))  # step 3: every world_size-th image, no padding
    pin = device.type == "cuda"  # page-locked host memory makes copies to the GPU faster
    loading = dict(num_workers=args.workers, pin_memory=pin, persistent_workers=args.workers > 0, prefetch_factor=args.prefetch_factor if args.workers else None)  # workers outlive an epoch
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, **loading)  # step 3
    test_loader = DataLoader(test_set, args.batch_size, **loading)

    model = build_model(args.model, args.pretrained, args.image_size).to(device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # step 2: before wrapping
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)  # step 2: all-reduce grads
    optimizer = build_optimizer(args, model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # only fp16 needs loss scaling
    if args.compile:  # in place: same object, same state_dict keys; compiles what is trained (DDP included)
        model.compile()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # step 3: else every epoch repeats epoch 0's order
        start = time.perf_counter()
        train_totals = train_one_epoch(model, train_loader, optimizer, scaler, device, args.max_steps, args.amp, show_progress=rank == 0)  # step 1
        dist.all_reduce(train_totals)  # step 3: sum over ranks (and wait for the slowest before reading the clock)
        seconds = time.perf_counter() - start
        test_totals = evaluate(model.module, test_loader, device, args.max_steps, args.amp)  # step 2: bare module, no collectives
        dist.all_reduce(test_totals)  # step 3: every rank scored a different shard
        scheduler.step()
        if rank == 0:  # step 1: one line per epoch, not one per rank
            log(epoch_line(epoch, args.epochs, train_totals, test_totals, seconds))

    if args.checkpoint and rank == 0:  # step 1: one writer
        save_checkpoint(model, args.checkpoint)
    dist.destroy_process_group()  # step 1: leave cleanly


if __name__ == "__main__":
    args = parse_args()  # step 1: parse once, in the launching process
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # step 1: rank 0 listens here...
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))  # step 1: ...on this port
    try:  # step 1: if a rank fails, mp.spawn ends the others and raises here
        mp.spawn(main, args=(args.nprocs, args), nprocs=args.nprocs)  # step 1: main(rank, ...) in each process
    except mp.ProcessExitedException as error:  # step 1: the rank exited and said why; a rank's exception (a bug) keeps its traceback
        fail(str(error))
