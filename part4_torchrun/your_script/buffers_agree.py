"""Your own script: buffers that differ between ranks. See README.md.

A small regression with two BatchNorm layers, trained with DDP on 2 ranks,
each on its own shard. DDP copies rank 0's buffers to every rank at the start
of each training forward (of the first forward after the wrap, and of any
forward after one with gradients on; train or eval mode plays no part), then
each rank's forward updates its own: after training, the running statistics
differ. Without --fix each rank evaluates its own, and rank 0 saves its own;
with --fix the ranks first average them (--fix broadcast: take rank 0's).

    torchrun --standalone --nproc_per_node=2 buffers_agree.py
    torchrun --standalone --nproc_per_node=2 buffers_agree.py --fix
    torchrun --standalone --nproc_per_node=2 buffers_agree.py --fix broadcast
"""

import argparse
import os
import shutil
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix",
        nargs="?",
        const="average",
        choices=["average", "broadcast"],
        help="make the buffers agree first (default: average)",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.epochs, args.timeout) <= 0:
        parser.error("--epochs and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 1),
    )


def make_buffers_agree(model: nn.Module, how: str) -> None:
    """Every rank's buffers made equal: rank 0's, or the mean over ranks."""
    for buffer in model.buffers():
        if how == "broadcast":
            # rank 0's statistics, as DDP's next forward would copy them
            dist.broadcast(buffer, src=0)
        elif buffer.is_floating_point():
            # the mean of the ranks' running statistics; num_batches_tracked,
            # an integer count equal on every rank, stays as it is
            dist.all_reduce(buffer)
            buffer.div_(dist.get_world_size())


def compare_buffers(model: nn.Module) -> str:
    """How many buffer tensors differ between the ranks, and by how much."""
    differ, largest, buffers = 0, 0.0, list(model.buffers())
    for buffer in buffers:
        copies = [
            torch.empty_like(buffer) for _ in range(dist.get_world_size())
        ]
        dist.all_gather(copies, buffer)
        if any(not torch.equal(copy, copies[0]) for copy in copies):
            differ += 1
            gaps = [(copy - copies[0]).abs().max().item() for copy in copies]
            largest = max([largest, *gaps])
    return (
        f"buffers_differ={differ} of {len(buffers)} max_abs_diff={largest:.4g}"
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    model.train()
    return loss


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The same data on every rank: 320 samples to train on, 64 held out.
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(384, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    y = y + 0.1 * torch.randn(384, 1, generator=g)
    held_x, held_y = x[320:], y[320:]
    # A shard each: every world_size-th sample, as a DistributedSampler's.
    train_x, train_y = x[:320][rank::world_size], y[:320][rank::world_size]

    torch.manual_seed(args.seed)
    model = DDP(make_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.epochs):
        for i in range(0, len(train_y), 16):
            loss = F.mse_loss(model(train_x[i : i + 16]), train_y[i : i + 16])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    # Before saving or evaluating with the bare model:
    if args.fix:
        # --fix: make the buffers agree (the mean, or rank 0's)
        make_buffers_agree(model.module, args.fix)
    found = compare_buffers(model.module)
    if rank == 0:
        log(f"after={args.fix or 'training'} {found}")

    # Each rank scores the same held-out batch with its own bare model.
    loss = evaluate(model.module, held_x, held_y)
    log(f"rank={rank} eval=module loss={loss:.6f}")

    # Rank 0 saves the bare model's state; a fresh model loads and scores it.
    if rank == 0:
        folder = tempfile.mkdtemp()
        path = os.path.join(folder, "model.pt")
        torch.save(model.module.state_dict(), path)
        saved = make_net()
        saved.load_state_dict(torch.load(path))
        shutil.rmtree(folder)
        log(f"checkpoint loss={evaluate(saved, held_x, held_y):.6f}")

    # Through the wrapper, on every rank: the first forward after a training
    # forward copies rank 0's buffers to every rank before it computes (in
    # eval mode too: the mode plays no part).
    loss = evaluate(model, held_x, held_y)
    log(f"rank={rank} eval=wrapper loss={loss:.6f}")
    found = compare_buffers(model.module)
    if rank == 0:
        log(f"after=wrapper_eval {found}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
