"""Unused parameters: DDP waits for a gradient that never comes.

The model keeps an auxiliary head that the loss no longer uses. DDP
all-reduces the gradients in buckets and expects every parameter it was
given to receive one in each backward pass; the head's never do, its bucket
never completes, and the next forward pass stops with:

    RuntimeError: Expected to have finished reduction in the prior iteration
    before starting a new one. This error indicates that your module has
    parameters that were not used in producing loss.

    python part4_torchrun/errors/unused_parameters.py
    python part4_torchrun/errors/unused_parameters.py --fix find-unused
    python part4_torchrun/errors/unused_parameters.py --fix freeze

--fix find-unused: DDP searches the autograd graph after every forward pass
for parameters that will get no gradient (a cost at every step; benchmark.py
measures it). --fix freeze: the head takes no part in training, so it is
frozen before DDP wraps the model, and DDP never waits for it (no cost).

Evidence lines (rank 0):
    step 1/3 loss=1.4064
    done fix=freeze reduced_tensors=4 ranks_equal=True
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

WORLD_SIZE = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix",
        choices=["find-unused", "freeze"],
        help="find-unused: DDP's search; freeze: no gradient wanted",
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
    """A body, the classifier head, and an auxiliary head kept from an
    earlier experiment: its parameters take no part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


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
    model = Net()
    if args.fix == "freeze":
        # fix: no gradient wanted, so none awaited: DDP reduces only the
        # parameters that require one
        model.aux_head.requires_grad_(False)
    # fix find-unused: after each forward pass DDP walks the autograd graph
    # and marks the parameters it cannot reach as ready
    find_unused = args.fix == "find-unused"
    ddp = DDP(model, find_unused_parameters=find_unused)
    trained = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=generator)
        y = torch.randint(0, 4, (8,), generator=generator)
        # Without a fix, the second step's forward pass raises here.
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            log(f"step {step + 1}/{args.steps} loss={loss.item():.4f}")
    equal = ranks_equal(model)
    if rank == 0:
        log(
            f"done fix={args.fix} reduced_tensors={len(trained)}"
            f" ranks_equal={equal}"
        )
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
