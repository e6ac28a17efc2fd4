"""DDP on N ranks with batch B is one process with batch N x B (not BatchNorm).

Each rank computes the mean-loss gradient of its B samples; DDP averages those
gradients over the ranks, which is the mean-loss gradient of all N x B samples.
Every rank then takes the same optimizer step from the same weights. So after
any number of steps the weights equal those of one process that trained on the
concatenated batch: bit for bit in exact arithmetic, to ~1e-16 in float64 (sums
in another order), to ~1e-8 in float32 (one rounding of the weights).

Two mistakes break it, each planted in a run of its own. No sampler: every
rank trains on the same B rows, as a DataLoader without DistributedSampler
gives every rank the same batches; the ranks stay equal, but they take the
step of one process with batch B. No wrap: each rank its own rows, no DDP;
each rank steps on its own gradient, and the replicas drift apart. Rank 0
trains on its own B rows either way, so its weights are the same in both.

BatchNorm breaks it too: in training mode it normalises with the mean and
variance of the batch it sees, which under DDP is each rank's B samples, not
the N x B batch. SyncBatchNorm computes those statistics over all ranks and
restores the equality, but PyTorch implements it for GPU modules only: on CPU,
running it under DDP raises the error printed below.

    python part3_ddp/experiments/ddp_equals_big_batch.py
    python part3_ddp/experiments/ddp_equals_big_batch.py --nprocs 3 --steps 10

Evidence lines (rank 0 trains the one-process reference itself, on the full
batch; max_abs_diff: the largest difference between rank 0's weights and the
reference's after each step; replicas_equal: all ranks' weights at the end):
    compare setup=ddp model=mlp dtype=float64 ... replicas_equal=True
        max_abs_diff=2.8e-17,2.8e-17,2.8e-17,2.8e-17,5.6e-17
    compare setup=ddp model=mlp dtype=float32 ... replicas_equal=True
        max_abs_diff=1.5e-08,1.5e-08,1.5e-08,1.5e-08,1.5e-08
    compare setup=no_sampler model=mlp dtype=float32 ... replicas_equal=True
        max_abs_diff=1.3e-02,1.8e-02,2.5e-02,2.1e-02,2.2e-02
    compare setup=no_wrap model=mlp dtype=float32 ... replicas_equal=False
        max_abs_diff=1.3e-02,1.8e-02,2.5e-02,2.1e-02,2.2e-02
    compare setup=ddp model=mlp_batchnorm dtype=float32 ... replicas_equal=True
        max_abs_diff=5.0e-03,1.2e-02,1.2e-02,1.1e-02,1.1e-02
    syncbatchnorm device=cpu error=ValueError: SyncBatchNorm layers only work
        with GPU modules
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does, on
# first use), it keeps the group alive past destroy_process_group, and gloo can
# abort at exit (README).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, default=2, help="processes (ranks)"
    )
    parser.add_argument(
        "--start-method",
        choices=["spawn", "fork"],
        default="spawn",
        help="fork: children inherit the imported torch and start at once"
        " (CPU only)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="B, per process"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def find_free_port() -> int:
    # Port 0: the OS picks a free one.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_process_group(rank: int, world_size: int) -> None:
    # All ranks share this machine's cores: more threads than cores is slower.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    # A collective that waits this long for a lost rank fails instead of
    # hanging.
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 300)))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timeout
    )


def build_model(kind: str, dtype: torch.dtype, seed: int) -> nn.Module:
    # The same initial weights for the DDP copies and the reference. No dropout
    # anywhere: its random masks would differ between the two set-ups.
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    else:
        model = nn.Sequential(
            nn.Linear(10, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 3)
        )
    return model.to(dtype)


def global_batches(
    args: argparse.Namespace, world_size: int, dtype: torch.dtype
) -> list:
    """The same N x B batches on every rank; rank r trains on
    rows r*B .. (r+1)*B - 1."""
    g = torch.Generator().manual_seed(args.seed + 1)
    size = world_size * args.batch_size
    return [
        (
            torch.randn(size, 10, generator=g, dtype=dtype),
            torch.randint(0, 3, (size,), generator=g),
        )
        for _ in range(args.steps)
    ]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def sgd_steps(model: nn.Module, batches: list, lr: float) -> list:
    """Train; the weights after each step, flat."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    after = []
    for x, y in batches:
        # The mean over the samples this model sees.
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        after.append(flat(model))
    return after


def compare(
    rank: int,
    world_size: int,
    args: argparse.Namespace,
    kind: str,
    dtype: torch.dtype,
    setup: str = "ddp",
) -> None:
    batches = global_batches(args, world_size, dtype)
    b = args.batch_size
    # Each rank its own B rows; the planted mistake "no_sampler": every rank
    # the first B rows, as every rank gets the same batches without a sampler.
    first = 0 if setup == "no_sampler" else rank * b
    mine = slice(first, first + b)
    model = build_model(kind, dtype, args.seed)
    # The planted mistake "no_wrap": no DDP, nothing averages the gradients.
    if setup != "no_wrap":
        model = DDP(model)
    steps = sgd_steps(model, [(x[mine], y[mine]) for x, y in batches], args.lr)
    # Do the ranks hold the same weights at the end?
    ends = [torch.empty_like(steps[-1]) for _ in range(world_size)]
    dist.all_gather(ends, steps[-1])
    equal = all(torch.equal(ends[0], end) for end in ends)
    if rank == 0:
        # One process, batch N x B, no DDP.
        reference = build_model(kind, dtype, args.seed)
        ref_steps = sgd_steps(reference, batches, args.lr)
        diffs = [
            f"{(p - q).abs().max().item():.1e}"
            for p, q in zip(steps, ref_steps, strict=True)
        ]
        dtype_name = str(dtype).removeprefix("torch.")
        log(
            f"compare setup={setup} model={kind} dtype={dtype_name}"
            f" lr={args.lr} ranks={world_size} batch={b}"
            f" big_batch={world_size * b} replicas_equal={equal}"
            f" max_abs_diff={','.join(diffs)}"
        )


def try_sync_batchnorm(rank: int) -> None:
    model = build_model("mlp_batchnorm", torch.float64, 0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    try:
        DDP(model)(torch.randn(4, 10, dtype=torch.float64)).sum().backward()
        message = "ok"
    except (ValueError, RuntimeError) as error:
        # The CPU case: SyncBatchNorm wants CUDA tensors.
        message = f"error={type(error).__name__}: {error}"
    if rank == 0:
        log(f"syncbatchnorm device=cpu {message}")


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    compare(rank, world_size, args, "mlp", torch.float64)
    compare(rank, world_size, args, "mlp", torch.float32)
    compare(rank, world_size, args, "mlp", torch.float32, "no_sampler")
    compare(rank, world_size, args, "mlp", torch.float32, "no_wrap")
    compare(rank, world_size, args, "mlp_batchnorm", torch.float32)
    try_sync_batchnorm(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # mp.spawn(worker, ...) is start_processes with "spawn": each child starts
    # a fresh Python and imports torch again (seconds). "fork" copies this
    # process, imports included: at once, and safe here because nothing touched
    # CUDA or started threads yet. With GPUs, keep spawn.
    if args.start_method == "fork":
        # DDP imports torch._dynamo on first use (seconds): once here, shared
        # by the children.
        import torch._dynamo
    mp.start_processes(
        worker,
        args=(args.nprocs, args),
        nprocs=args.nprocs,
        start_method=args.start_method,
    )
