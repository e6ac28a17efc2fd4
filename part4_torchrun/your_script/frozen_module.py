"""Your own script: a module that DDP does not wrap.

A student network trained under DDP against a frozen one (a loss network, a
teacher, a target network: nothing in it is trained): the loss is how far
the student's output lies from the frozen network's. DDP copies rank 0's
weights into what it wraps and averages its gradients; a module it does not
wrap it never copies or checks, and a module with nothing to train it
refuses to wrap. Without --fix the script seeds each rank with seed + rank
(its own dropout masks and noise) before it builds the frozen network: each
rank builds another one, and trains the one student against it. With --fix
the frozen network is built before the per-rank seed (--fix broadcast: built
anywhere, then rank 0's weights broadcast, as for a network that rank 0
alone loads). Rank 0 also trains the original, one process on all the rows,
against rank 0's frozen network; a replica check of every module ends the
run.

    torchrun --standalone --nproc_per_node=2 frozen_module.py
    torchrun --standalone --nproc_per_node=2 frozen_module.py --fix
    torchrun --standalone --nproc_per_node=2 frozen_module.py --fix broadcast
"""

import argparse
import copy
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
        nargs="?",
        const="before",
        choices=["before", "broadcast"],
        help="the same frozen network on every rank (default: built before"
        " the per-rank seed)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="B: the global batch"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.batch_size, args.steps, args.timeout) <= 0:
        parser.error("--batch-size, --steps and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def check_replicas(model: nn.Module, step: int) -> None:
    """Stop every rank, with one line, if the replicas differ. Copy it into
    your script and call it every N steps with the bare model (model.module).

    DDP keeps the replicas equal only while every rank applies the same
    update; nothing in DDP checks it. Each rank sums every parameter twice
    (plainly, and weighted by position, in float64); the MAX and the MIN over
    the ranks differ where a replica differs. Costs two small all-reduces."""
    names, sums = [], []
    for name, p in model.named_parameters():
        flat = p.detach().flatten().double()
        weights = torch.arange(1, len(flat) + 1, device=flat.device)
        names.append(name)
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    high, low = torch.stack(sums), torch.stack(sums)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    differs = (high != low).any(dim=1).tolist()
    if not any(differs):
        return
    first = names[differs.index(True)]
    if dist.get_rank() == 0:
        sys.stderr.write(
            f"error: replicas differ at step {step}: first differing"
            f" tensor {first!r} ({sum(differs)} of {len(names)} differ)\n"
        )
    dist.destroy_process_group()
    sys.exit(1)


def make_student() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def make_frozen() -> nn.Module:
    """The frozen network: random weights here (a target network); a loss
    network or a teacher loads its own. Nothing in it is trained."""
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return net.requires_grad_(False)


def train(student, frozen, x, steps: int, rows: int) -> None:
    """SGD on the distance between the two networks' outputs."""
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    for step in range(steps):
        batch = x[step * rows : (step + 1) * rows]
        loss = F.mse_loss(student(batch), frozen(batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def gathered_diff(tensors) -> float:
    """The largest difference between this tensor list and other ranks'."""
    flat = torch.cat([t.detach().flatten() for t in tensors])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    return max((c - flat).abs().max().item() for c in copies)


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        sys.exit(f"error: --batch-size must split into {world_size} ranks")
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps * args.batch_size + 64, 8, generator=g)
    held_out, x = x[-64:], x[:-64]

    # The single-device order: the model, then the loss and what it needs.
    torch.manual_seed(args.seed)
    model = DDP(make_student())
    if args.fix == "before":
        # --fix: built before the per-rank seed, from the seed all share
        frozen = make_frozen()
    # The random draws of training differ per rank (wrapper.py, dropout).
    torch.manual_seed(args.seed + rank)
    if args.fix != "before":
        frozen = make_frozen()
    if args.fix == "broadcast":
        # --fix broadcast: every rank takes rank 0's frozen weights
        for tensor in frozen.state_dict().values():
            dist.broadcast(tensor, src=0)
    try:
        DDP(frozen)
    except RuntimeError as error:
        if rank == 0:
            log(f"DDP(frozen) error=RuntimeError: {error}")
    original = copy.deepcopy(model.module) if rank == 0 else None
    reference = copy.deepcopy(frozen) if rank == 0 else None

    # Each rank's rows of each global batch, as in equivalence.py.
    share = args.batch_size // world_size
    mine = x.view(args.steps, args.batch_size, 8)[:, rank * share :]
    mine = mine[:, :share].reshape(-1, 8)
    train(model, frozen, mine, args.steps, share)
    frozen_diff = gathered_diff(frozen.parameters())
    student_diff = gathered_diff(model.parameters())
    with torch.no_grad():
        loss = F.mse_loss(model.module(held_out), frozen(held_out)).item()
    log(f"rank={rank} held_out_loss={loss:.6f}")
    if rank == 0:
        log(
            f"frozen max_abs_diff={frozen_diff:.4g}"
            f" student max_abs_diff={student_diff:.4g}"
        )
        # The original: one process, all B rows a step, rank 0's network.
        train(original, reference, x, args.steps, args.batch_size)
        pairs = zip(original.parameters(), model.parameters(), strict=True)
        diff = max((p - q).abs().max().item() for p, q in pairs)
        log(f"vs_one_process max_abs_diff={diff:.3g}")
    # Every module that holds weights, wrapped or not, in one check.
    every = nn.ModuleDict({"student": model.module, "frozen": frozen})
    check_replicas(every, args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
