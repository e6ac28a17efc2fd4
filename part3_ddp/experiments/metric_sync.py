"""Synchronising metrics across ranks, and printing them once.

Every rank computes its loss and accuracy on its own shard of the batch; those
numbers describe one rank, not the model. To report the model's numbers:

- average a scalar with `all_reduce(op=ReduceOp.AVG)`, or with
  `all_reduce(SUM)` and a division by the world size. NCCL has AVG since NCCL
  2.10; gloo since March 2025 (https://github.com/pytorch/pytorch/pull/149781;
  both are shown here, with torch 2.15). `dist.reduce` to rank 0 with SUM
  leaves the *sum* on rank 0 (world size times too large), and leaves the other
  ranks' tensors undefined: reduce a copy, never the tensor you need.
- gather per-sample results (here: was the prediction right?) with
  `all_gather`, then count over the concatenation. gloo's all_gather needs the
  same shape on every rank (ProcessGroupGloo::allgather: invalid tensor size);
  all_gather's docstring says uneven sizes are supported, as NCCL's are (torch
  2.15).
- print on the primary rank only: one line per step, not one per rank.

    python part3_ddp/experiments/metric_sync.py
    python part3_ddp/experiments/metric_sync.py --nprocs 3 --steps 5

Evidence lines (all from rank 0):
    losses step=0 per_rank=1.394221,1.388377
        each rank's own loss (gathered to print it)
    reduce step=0 op=SUM dst=0 value=2.782598
        what rank 0 holds after dist.reduce
    average step=0 all_reduce_then_divide=1.391299 all_reduce_avg=1.391299
        every rank
    accuracy step=0 gathered=64 correct=16 acc=25.00%
        predictions of all ranks
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
        "--batch-size", type=int, default=32, help="per process"
    )
    parser.add_argument("--steps", type=int, default=3)
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


def print_primary(message: str) -> None:
    # After the collectives every rank knows the same numbers: one line is
    # enough.
    if dist.get_rank() == 0:
        log(message)


def average(value: torch.Tensor) -> torch.Tensor:
    """The mean over ranks, on every rank. A copy: the caller's tensor keeps
    this rank's value."""
    total = value.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def average_op(value: torch.Tensor) -> torch.Tensor:
    """The same mean with ReduceOp.AVG (gloo accepts it since March 2025; see
    the top)."""
    mean = value.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean


def reduce_to_primary(value: torch.Tensor) -> torch.Tensor:
    """What dist.reduce leaves on rank 0: the SUM. Only rank 0's result is
    meaningful."""
    total = value.detach().clone()
    dist.reduce(total, dst=0, op=dist.ReduceOp.SUM)
    return total


def gather(values: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor, concatenated in rank order (gloo: the same shape on
    all ranks)."""
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    # The same model everywhere (DDP would also copy rank 0's weights to the
    # others).
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Different data on each rank.
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 8, generator=data)
        y = torch.randint(0, 4, (args.batch_size,), generator=data)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # Every rank's own loss, only to show the raw material; not needed in
        # practice.
        per_rank = gather(loss.detach().reshape(1))
        summed = reduce_to_primary(loss)
        mean = average(loss)
        mean_avg = average_op(loss)
        # One bool per sample of every rank.
        correct = gather(logits.argmax(1) == y)
        losses = ",".join(f"{v:.6f}" for v in per_rank.tolist())
        print_primary(f"losses step={step} per_rank={losses}")
        print_primary(
            f"reduce step={step} op=SUM dst=0 value={summed.item():.6f}"
        )
        print_primary(
            f"average step={step} all_reduce_then_divide={mean.item():.6f}"
            f" all_reduce_avg={mean_avg.item():.6f}"
        )
        print_primary(
            f"accuracy step={step} gathered={correct.numel()}"
            f" correct={int(correct.sum())}"
            f" acc={100 * correct.float().mean().item():.2f}%"
        )
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
