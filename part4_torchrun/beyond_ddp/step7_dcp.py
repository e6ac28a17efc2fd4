"""A step of a PyTorch DDP course: train an image classifier (see README)."""

import argparse
import os
import sys
import tempfile
import time
from itertools import islice

import timm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.nn.functional as F
import torchvision
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm import tqdm

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--batch-size", type=int, default=128, help="per process"
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--model", default="resnet18", help="timm's, 32x32 in")
    parser.add_argument(
        "--dataset", default="cifar10", choices=["cifar10", "fake"]
    )
    parser.add_argument("--fake-size", type=int, default=50_000, help="images")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps", type=int, default=0, help="per epoch; 0: all"
    )
    parser.add_argument(
        "--checkpoint", default="checkpoint.pt", help="'': none"
    )
    parser.add_argument("--sharded", default="", help="a folder per epoch")
    parser.add_argument("--resume", default="", help="an epoch's folder")
    args = parser.parse_args()
    # Bad input, or a folder it cannot write to, ends here in one line.
    if min(args.epochs, args.batch_size, args.fake_size) < 1:
        parser.error("--epochs, --batch-size and --fake-size must be positive")
    if not timm.is_model(args.model):
        parser.error(f"unknown --model {args.model!r}: see timm.list_models()")
    for folder in {os.path.dirname(p) or "." for p in [args.checkpoint] if p}:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            where = os.path.abspath(folder)
            parser.error(f"cannot write to {where}: {error.strerror}")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def read_launcher_env(env=os.environ) -> tuple[int, ...]:
    # step 6: torchrun and srun say who each process is; python: a world of one
    if "RANK" not in env and "SLURM_STEP_ID" not in env:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # any free port
        return 0, 0, 1, 1
    needs = {"MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS_PER_NODE"}
    if "RANK" not in env and not needs <= env.keys():
        sys.exit(f"error: under srun, set {sorted(needs - env.keys())}")
    torchrun = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
    srun = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"]
    names = torchrun if "RANK" in env else [*srun, "SLURM_NTASKS_PER_NODE"]
    log("launcher: " + " ".join(f"{n}={env[n]}" for n in names))
    return tuple(int(env[n]) for n in names)


def build_datasets(args: argparse.Namespace, download: bool) -> tuple:
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    to_tensor = [transforms.ToTensor(), normalize]
    flip = transforms.RandomHorizontalFlip()
    augment = [transforms.RandomCrop(32, padding=4), flip]
    train_tf = transforms.Compose(augment + to_tensor)
    test_tf = transforms.Compose(to_tensor)
    if args.dataset == "fake":
        # Random images of CIFAR-10's shape: runs offline, learns nothing.
        size, shape = args.fake_size, (3, 32, 32)
        train = torchvision.datasets.FakeData(size, shape, 10, train_tf)
        test = torchvision.datasets.FakeData(
            size // 5, shape, 10, test_tf, random_offset=size
        )
        return train, test
    try:
        cifar10 = torchvision.datasets.CIFAR10
        train = cifar10(args.data_dir, True, train_tf, download=download)
        test = cifar10(args.data_dir, False, test_tf, download=download)
    except (OSError, RuntimeError) as error:
        # Offline (a URLError is an OSError), or files missing or damaged.
        path = os.path.abspath(args.data_dir)
        sys.exit(f"error: no CIFAR-10 in {path} ({error}); try --dataset fake")
    return train, test


def build_model(name: str) -> torch.nn.Module:
    # An ImageNet model from timm, 10 outputs. Its stem shrinks 32x32 images
    # 4x at once: fast, less accurate than a CIFAR-specific stem would be.
    return timm.create_model(name, num_classes=10)


def train_one_epoch(model, loader, optimizer, device, max_steps, verbose):
    """(summed loss, correct predictions, images): one tensor on `device`."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    steps = min(len(loader), max_steps or len(loader))
    # disable=None: a progress bar on a terminal only, never in a job's log
    batches = islice(loader, steps)
    bar = tqdm(batches, steps, leave=False, disable=None if verbose else True)
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
def evaluate(model, loader, device, max_steps: int):
    """(correct predictions, images), one tensor on `device`; 0 steps: all."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in islice(loader, max_steps or None):
        images, labels = images.to(device), labels.to(device)
        totals[0] += (model(images).argmax(1) == labels).sum()
        totals[1] += len(labels)
    return totals


def epoch_line(epoch, epochs, train: list, test: list, seconds: float) -> str:
    (loss_sum, correct, seen), (test_correct, test_seen) = train, test
    return (
        f"epoch {epoch + 1}/{epochs} train_loss={loss_sum / seen:.4f}"
        f" train_acc={100 * correct / seen:.2f}% train_samples={int(seen)}"
        f" test_acc={100 * test_correct / test_seen:.2f}%"
        f" test_samples={int(test_seen)}"
        f" samples/s={seen / seconds:.1f} epoch_s={seconds:.2f}"
    )


def save_checkpoint(model: torch.nn.Module, path: str) -> None:
    torch.save(model.state_dict(), path)
    log(f"saved checkpoint {path}")


def sharded_state(model, optimizer, scheduler) -> dict:
    # FSDP2: this rank's shards as DTensors; DCP calls the schedule's methods
    model_state, optim_state = dcp_state.get_state_dict(model, optimizer)
    return dict(model=model_state, optim=optim_state, sched=scheduler)


def load_sharded(path: str, model, optimizer, scheduler) -> None:
    state = sharded_state(model, optimizer, scheduler)
    try:
        dcp.load(state, checkpoint_id=path)  # FSDP2: into this rank's shards
    except dcp.api.CheckpointException as error:
        reason = next(iter(error.failures.values()))[0]
        sys.exit(f"error: cannot resume from {path}: {reason}")
    dcp_state.set_optimizer_state_dict(model, optimizer, state["optim"])


def main(args: argparse.Namespace) -> None:  # step 6
    rank, local_rank, world_size, local_world_size = read_launcher_env()
    # step 1: NCCL and a GPU per process; else gloo, the cores shared
    if torch.cuda.is_available():
        # step 4: one GPU per process
        if local_world_size > torch.cuda.device_count():
            gpus = torch.cuda.device_count()
            sys.exit(f"error: {local_world_size} processes, {gpus} GPU(s)")
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        threads = torch.get_num_threads() // local_world_size
        torch.set_num_threads(max(1, threads))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # step 1: name the group's GPU, which NCCL would otherwise guess
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, device_id=gpu
    )
    # Same seed, same initial weights and the same data order on every run.
    torch.manual_seed(args.seed)
    # step 4: name this process's GPU; "cuda" alone relies on set_device
    cuda = f"cuda:{local_rank}"
    device = torch.device(cuda if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()
    log(f"rank {rank}/{world_size} device={device} threads={threads}")
    if rank == 0:  # step 1: rank 0 downloads; the others wait at the barrier
        build_datasets(args, download=True)
    dist.barrier()
    train_set, test_set = build_datasets(args, download=False)
    # step 3: each rank trains on its shard, scores every world_size-th image
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)
    # FSDP2: each forward is a collective: all ranks score as many batches
    scored = len(test_set) // world_size * world_size
    test_set = Subset(test_set, range(rank, scored, world_size))
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, args.batch_size)
    # step 3: the shards, gathered: how many of this rank's another rank has
    shards = [None] * world_size
    dist.all_gather_object(shards, set(sampler))
    mine = shards.pop(rank)
    shared = len(mine & set().union(*shards))
    log(f"rank {rank}/{world_size} shard={len(sampler)} shared={shared}")

    model = build_model(args.model).to(device)
    # FSDP2: each rank keeps 1/world_size of every weight, gathered per block
    mesh = dist.init_device_mesh(device.type, (world_size,))
    for block in [b for b in model.children() if list(b.parameters())]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4
    )
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR
    scheduler = cosine(optimizer, T_max=args.epochs)

    if args.resume:  # FSDP2: all as saved; scheduler.last_epoch: epochs done
        load_sharded(args.resume, model, optimizer, scheduler)
    for epoch in range(scheduler.last_epoch, args.epochs):
        # step 3: a new shuffle every epoch, else epoch 0's order; and each
        # rank its own crops and flips; fully_shard() sends no weight: one seed
        sampler.set_epoch(epoch)
        torch.manual_seed(hash((args.seed, rank, epoch)))
        start = time.perf_counter()
        verbose = rank == 0  # step 1: rank 0 alone draws a progress bar
        totals = train_one_epoch(
            model, train_loader, optimizer, device, args.max_steps, verbose
        )
        dist.all_reduce(totals)  # step 3: add up the counts of all ranks
        # .tolist() waits until the device ends the epoch: then read the clock.
        train = totals.tolist()
        seconds = time.perf_counter() - start
        test_sums = evaluate(model, test_loader, device, args.max_steps)
        dist.all_reduce(test_sums)  # step 3
        test = test_sums.tolist()
        scheduler.step()
        if rank == 0:  # step 1: one line per epoch, not one per process
            log(epoch_line(epoch, args.epochs, train, test, seconds))
        if args.sharded:  # FSDP2: each rank writes its shards, none gathered
            for buffer in model.buffers():  # FSDP2: one copy saved: rank 0's
                dist.broadcast(buffer, src=0)
            state = sharded_state(model, optimizer, scheduler)
            dcp.save(state, checkpoint_id=f"{args.sharded}/epoch_{epoch + 1}")
    # step 2: each rank prints the norm of its model's weights: all the same
    weights = [p.double() for p in model.parameters()]  # 12 digits: float64
    norm = torch.nn.utils.get_total_norm(weights)
    log(f"rank {rank}/{world_size} weights' norm {norm.item():.12g}")
    # FSDP2: bytes this rank holds: its shards of weights, grads, momentum
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    bufs = [s["momentum_buffer"] for s in optimizer.state.values()]
    held = [sum(t.to_local().nbytes for t in x) for x in (params, grads, bufs)]
    kinds = "params_bytes={} grads_bytes={} optimizer_bytes={}"
    log(f"memory rank={rank} " + kinds.format(*held))
    # FSDP2: all ranks gather the whole weights; rank 0 gets them, on the CPU
    full = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = dcp_state.get_model_state_dict(model, options=full)
    if args.checkpoint and rank == 0:  # step 1: one writer
        # FSDP2: part 1's model takes the whole weights, and is saved as ever
        model = build_model(args.model)
        model.load_state_dict(whole)
        save_checkpoint(model, args.checkpoint)
        saved = torch.load(args.checkpoint, map_location="cpu")
        log(f"checkpoint keys: {list(saved)[:3]} and {len(saved) - 3} more")
        build_model(args.model).load_state_dict(saved)
        log(f"checkpoint {args.checkpoint} loads into a bare {args.model}")
    dist.destroy_process_group()  # step 1


if __name__ == "__main__":
    args = parse_args()
    main(args)  # step 6: torchrun, srun or python start it once per process
    # FSDP2: skip Python's teardown of the gloo group, kept by DTensor (README)
    os._exit(0)
