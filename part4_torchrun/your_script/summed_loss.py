"""Your own script: a loss summed over the batch, under DDP. See README.md.

A small autoencoder (an MLP, no dropout) with a reconstruction loss summed
over the batch (reduction="sum", as VAEs often have). As in equivalence.py,
the DDP model trains on this rank's B/N rows of a global batch of B, and rank
0 also trains the original, without DDP, on all B rows. DDP averages the
ranks' gradients: a summed loss then gives 1/N of the original's gradient.
--fix multiplies the loss by the world size. Printed in both modes: gradient
clipping, and two losses before one optimizer step (a GAN's discriminator:
real, then fake) in three orders of forwards and backwards.

    torchrun --standalone --nproc_per_node=2 summed_loss.py
    torchrun --standalone --nproc_per_node=2 summed_loss.py --fix
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
        help="multiply the loss by the world size",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="B: the global batch"
    )
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.batch_size, args.lr, args.timeout) <= 0:
        parser.error("--batch-size, --lr and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def build(seed: int) -> nn.Module:
    # The same seed, the same initial weights, in both set-ups.
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(),
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16),
    )  # fmt: skip


def global_batch(step: int, size: int, seed: int) -> torch.Tensor:
    """The step's B samples, the same on every rank: the same data order."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(size, 16, generator=g)


def summed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The original script's loss: a sum over the rows it is given.
    return F.mse_loss(model(x), x, reduction="sum")


def gradient(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def between_ranks(flat: torch.Tensor) -> float:
    """The largest difference of `flat` between rank 0 and any other rank."""
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return max(largest_difference(other, every[0]) for other in every)


def clipping(args, rows: slice) -> None:
    """clip_grad_norm_ after backward on the DDP model, from the first
    weights again, on another batch; rank 0 clips the original's too."""
    model = DDP(build(args.seed))
    world_size = dist.get_world_size()
    x = global_batch(2, args.batch_size, args.seed)
    loss = summed(model, x[rows])
    if args.fix:
        # --fix: the same factor as in main()
        loss = loss * world_size
    loss.backward()
    # the norm before clipping, of the averaged gradient: equal on all ranks
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    log(f"clip_norm rank={dist.get_rank()} norm={norm.item():.6g}")
    if dist.get_rank() == 0:
        original = build(args.seed)
        summed(original, x).backward()
        norm = nn.utils.clip_grad_norm_(original.parameters(), max_norm=1.0)
        diff = largest_difference(gradient(model), gradient(original))
        log(
            f"clip_norm one_process norm={norm.item():.6g}"
            f" clipped_vs_one_process={diff:.3g}"
        )


def two_backward(args, rows: slice, order: str) -> None:
    """The gradient that one optimizer step would take, from two losses: the
    first half of this rank's rows and the second, each a mean loss halved."""
    model = DDP(build(args.seed))
    x = global_batch(3, args.batch_size, args.seed)
    first, second = x[rows].chunk(2)
    if order == "fwd,bwd,fwd,bwd":
        # each loss's backward right after its own forward (DCGAN's order)
        (F.mse_loss(model(first), first) / 2).backward()
        (F.mse_loss(model(second), second) / 2).backward()
    else:
        # both forwards first, then the two backward passes, or one of the sum
        loss_first = F.mse_loss(model(first), first) / 2
        loss_second = F.mse_loss(model(second), second) / 2
        if order == "fwd,fwd,bwd,bwd":
            # A forward readies DDP's all-reduce for one backward. The first
            # backward to end uses it up; the second one's gradient is added
            # to .grad unreduced: this rank's own, unlike the other ranks'.
            loss_first.backward()
            loss_second.backward()
        else:
            # one backward through both forwards: all-reduced once, whole
            (loss_first + loss_second).backward()
    ddp = gradient(model)
    spread = between_ranks(ddp)
    if dist.get_rank() == 0:
        original = build(args.seed)
        F.mse_loss(original(x), x).backward()
        diff = largest_difference(ddp, gradient(original))
        log(
            f"two_backward_vs_one_process={diff:.3g} order={order}"
            f" between_ranks={spread:.3g}"
        )


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % (2 * world_size):
        sys.exit(f"error: --batch-size must split into {2 * world_size}")
    share = args.batch_size // world_size
    mine = slice(rank * share, (rank + 1) * share)
    model = DDP(build(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    original = build(args.seed) if rank == 0 else None

    # One step on this rank's rows; on rank 0 the original on all of them.
    x = global_batch(1, args.batch_size, args.seed)
    loss = summed(model, x[mine])
    if args.fix:
        # --fix: DDP divides the ranks' summed gradients by the world size,
        # which suits a mean loss; the original's loss is the sum over all
        # ranks' rows, so multiply by what DDP divides by
        loss = loss * world_size
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm_ddp = gradient(model).norm().item()
    optimizer.step()
    if rank == 0:
        one = torch.optim.SGD(original.parameters(), lr=args.lr)
        summed(original, x).backward()
        norm_one = gradient(original).norm().item()
        one.step()
        pairs = zip(model.parameters(), original.parameters(), strict=True)
        weights = max(largest_difference(p, q) for p, q in pairs)
        log(
            f"grad_norm_ddp={norm_ddp:.6g}"
            f" grad_norm_one_process={norm_one:.6g}"
        )
        log(f"max_abs_weight_diff={weights:.3g}")

    clipping(args, mine)
    for order in ("fwd,bwd,fwd,bwd", "fwd,fwd,bwd,bwd", "fwd,fwd,bwd_of_sum"):
        two_backward(args, mine, order)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
