"""Your own script: a library that decides from the value you hand it.

torch.optim.LBFGS trains full-batch: each step calls a closure (forward,
backward, return the loss) as often as its line search asks, and decides
from the loss the closure returns how far to go and when to stop. Under DDP
every call is one forward and one gradient all-reduce. Without --fix the
closure returns this rank's own loss: each rank's line search decides
alone, the ranks' weights part, then their calls, and each all-reduce pairs
one rank's call with another call of the other rank, until a rank waits for
a call that never comes. With --fix the closure returns the loss averaged
over the ranks, the original's loss over all the rows: every rank decides
the same.

    torchrun --standalone --nproc_per_node=2 closure.py --timeout 5
    torchrun --standalone --nproc_per_node=2 closure.py --fix
"""

import argparse
import sys
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
        action="store_true",
        help="the closure returns the loss averaged over the ranks",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.steps, args.timeout) <= 0:
        parser.error("--steps and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """256 rows of a small regression, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g))
    return x, y + 0.1 * torch.randn(256, 1, generator=g)


def build(seed: int) -> nn.Module:
    # The same seed, the same initial weights, in both set-ups.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = make_data(args.seed)
    model = DDP(build(args.seed))
    if rank == 0:
        # What the original's closure returns first: the loss of all rows.
        first = F.mse_loss(model.module(x), y).item()
        log(f"one_process step=1 loss={first:.6g}")
    # A shard each: every world_size-th row, as a DistributedSampler's.
    x, y = x[rank::world_size], y[rank::world_size]

    # Full-batch LBFGS with a line search, as public scripts use it.
    optimizer = torch.optim.LBFGS(
        model.parameters(), line_search_fn="strong_wolfe"
    )
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if args.fix:
            # --fix: LBFGS decides from the loss of every rank, averaged:
            # the original's loss over all the rows, the same on every rank
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world_size
        return loss

    for step in range(1, args.steps + 1):
        before = calls
        loss = optimizer.step(closure)
        log(
            f"rank={rank} step={step} closure_calls={calls - before}"
            f" loss={loss.item():.6g}"
            f" weights_sum={weights(model).sum().item():.6f}"
        )
    log(f"rank={rank} closure_calls={calls}")
    flat = weights(model)
    replicas = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    if rank == 0:
        drift = max((r - flat).abs().max().item() for r in replicas)
        log(f"replicas max_abs_diff={drift:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
