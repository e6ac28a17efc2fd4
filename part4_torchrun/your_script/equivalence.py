"""Your own script: show that the DDP version trains as the original does.

The recipe, on a small MLP with SGD and momentum, in float32 and float64:
the DDP model trains on this rank's B/N rows of each global batch of B, and
rank 0 also trains the original, without DDP, on all B rows. Run alone
(python: a world of one) the two must match bit for bit; on N ranks they
match to rounding after one step, then drift apart slowly.

    python equivalence.py
    torchrun --standalone --nproc_per_node=2 equivalence.py
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

CHECKPOINTS = (1, 10, 100)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=32, help="B: the global batch"
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def build(dtype: torch.dtype, seed: int) -> nn.Module:
    # Step 1 of the recipe: the same seed gives both the same initial weights.
    # No dropout: its masks would be drawn differently in the two set-ups.
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 4),
    )  # fmt: skip
    return model.to(dtype)


def global_batch(step: int, size: int, seed: int, dtype: torch.dtype):
    """The step's B samples, the same on every rank: the same data order."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, 16, generator=g, dtype=dtype)
    return x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()


def train(model: nn.Module, args, dtype, rows: slice) -> dict[int, list]:
    """Trains on `rows` of each global batch; the weights at each checkpoint."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    weights = {}
    for step in range(1, max(CHECKPOINTS) + 1):
        x, y = global_batch(step, args.batch_size, args.seed, dtype)
        # The mean loss over these rows; DDP then averages the gradients over
        # the ranks: the mean over all B rows, as in the original.
        loss = F.cross_entropy(model(x[rows]), y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step in CHECKPOINTS:
            weights[step] = [p.detach().clone() for p in model.parameters()]
    return weights


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:
        # python alone: a world of one on this machine, any free port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        os.environ.update(RANK="0", WORLD_SIZE="1")
    if "OMP_NUM_THREADS" not in os.environ:
        # Layers this small run fastest on one thread (torchrun sets it too).
        torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        sys.exit(f"error: --batch-size must split into {world_size} ranks")
    share = args.batch_size // world_size
    mine = slice(rank * share, (rank + 1) * share)
    for dtype in (torch.float32, torch.float64):
        ddp = train(DDP(build(dtype, args.seed)), args, dtype, mine)
        if rank != 0:
            continue
        # Rank 0 also runs the original: one process, all B rows, no DDP.
        original = train(build(dtype, args.seed), args, dtype, slice(None))
        for step in CHECKPOINTS:
            pairs = zip(ddp[step], original[step], strict=True)
            diff = max((p - q).abs().max().item() for p, q in pairs)
            log(
                f"equivalence ranks={world_size} batch={args.batch_size}"
                f" per_rank={share} dtype={str(dtype)[6:]} step={step}"
                f" max_abs_diff={diff:.3g}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
