"""A parameter used twice: reentrant activation checkpointing under DDP.

The model applies the same block twice (shared weights), and checkpoints
each application to save memory: its activations are recomputed during the
backward pass. With use_reentrant=True (what the script passes without a
fix), each call runs its recomputation as a backward pass of its own, and
DDP's hook on the block's parameters fires in each: the first backward
fails with

    RuntimeError: Expected to mark a variable ready only once.

Sharing weights alone is fine: in one backward pass autograd sums the two
uses before DDP's hook fires.

    python part4_torchrun/errors/checkpoint_twice.py
    python part4_torchrun/errors/checkpoint_twice.py --fix non-reentrant
    python part4_torchrun/errors/checkpoint_twice.py --fix static-graph

--fix non-reentrant: checkpoint(..., use_reentrant=False), which PyTorch
recommends: the recomputation joins the one backward pass. --fix
static-graph: DDP(static_graph=True) learns in the first step which hooks
fire how often; valid while the graph stays the same at every step.

Evidence lines (rank 0):
    step 1/3 loss=1.4073
    done fix=non-reentrant ranks_equal=True
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does),
# it keeps the group alive past destroy_process_group (../../part3_ddp/
# experiments/README.md).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

WORLD_SIZE = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix",
        choices=["non-reentrant", "static-graph"],
        help="non-reentrant: use_reentrant=False; static-graph: DDP's flag",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


class Net(nn.Module):
    """A stem, one block applied twice (shared weights), a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for _ in range(2):
            # Activations recomputed in the backward pass: less memory.
            x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


def ranks_equal(model: nn.Module) -> bool:
    # Every rank's weights, side by side: DDP keeps the copies equal.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0], c) for c in copies)


def worker(
    rank: int, world_size: int, rendezvous: str, args: argparse.Namespace
) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    torch.manual_seed(0)
    # fix non-reentrant: the recomputation joins the one backward pass
    model = Net(reentrant=args.fix != "non-reentrant")
    # fix static-graph: DDP counts the hooks of the first step and expects
    # the same from then on
    ddp = DDP(model, static_graph=args.fix == "static-graph")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=generator)
        y = torch.randint(0, 4, (8,), generator=generator)
        loss = nn.functional.cross_entropy(ddp(x), y)
        # Without a fix, the first backward pass raises here.
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            log(f"step {step + 1}/{args.steps} loss={loss.item():.4f}")
    equal = ranks_equal(model)
    if rank == 0:
        log(f"done fix={args.fix} ranks_equal={equal}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn). DDP imports torch._dynamo on first use
    # (seconds): once here, for both ranks.
    method = "fork" if sys.platform == "linux" else "spawn"
    if method == "fork":
        import torch._dynamo
    # The ranks meet through a file (init_method="file://..."): no port to
    # pick, so no clash with another job on the machine.
    with tempfile.TemporaryDirectory() as directory:
        rendezvous = "file://" + os.path.join(directory, "rendezvous")
        mp.start_processes(
            worker,
            (WORLD_SIZE, rendezvous, args),
            nprocs=WORLD_SIZE,
            start_method=method,
        )
