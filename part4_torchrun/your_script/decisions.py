"""Your own script: decisions that every rank must take alike. See README.md.

A small regression trained with DDP on 2 ranks, with the decisions a single-
device script takes from its validation loss: lower the learning rate on a
plateau, stop early below a target, stop on Ctrl-C. Without --fix each rank
decides from its own shard's loss; with --fix from the all-reduced loss.

    torchrun --standalone --nproc_per_node=2 decisions.py
    torchrun --standalone --nproc_per_node=2 decisions.py --fix
"""

import argparse
import os
import signal
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
        "--fix", action="store_true", help="decide from all-reduced values"
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument(
        "--stop-below", type=float, default=0.0, help="val loss; 0: off"
    )
    parser.add_argument(
        "--interrupt-at",
        type=int,
        default=0,
        help="SIGINT to rank 1 at step N",
    )
    parser.add_argument(
        "--check-every", type=int, default=0, help="steps; 0: no check"
    )
    parser.add_argument(
        "--drift-every",
        type=int,
        default=0,
        help="steps between lines of the replicas' difference; 0: none",
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.epochs, args.timeout) <= 0:
        parser.error("--epochs and --timeout must be > 0")
    if min(args.check_every, args.drift_every) < 0:
        parser.error("--check-every and --drift-every must be >= 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def make_data(seed: int) -> tuple:
    """(x, y) for training and for validation, the same on every rank.

    The validation samples get noisier along the set, so rank 0's half scores
    a lower loss than rank 1's: two shards that disagree, as real ones do."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(640, 8, generator=g)
    noise = torch.cat([torch.full((512,), 0.3), torch.linspace(0.1, 1.5, 128)])
    y = x @ w + noise.unsqueeze(1) * torch.randn(640, 1, generator=g)
    return (x[:512], y[:512]), (x[512:], y[512:])


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


def replica_drift(model: nn.Module) -> float:
    """The largest difference between this rank's weights and another's."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    return max((r - flat).abs().max().item() for r in replicas)


def validate(model: nn.Module, x, y, fix: bool) -> float:
    """The mean validation loss: this rank's shard's, or with --fix, all."""
    with torch.no_grad():
        sums = torch.stack(
            [F.mse_loss(model(x), y, reduction="sum"), torch.tensor(len(y))]
        ).double()
    if fix:
        # --fix: every rank reads the same number, so decides the same way
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    (train_x, train_y), (val_x, val_y) = make_data(args.seed)
    # A shard each: every world_size-th training sample, a block of the
    # validation set (as a Subset would hand it out).
    train_x, train_y = train_x[rank::world_size], train_y[rank::world_size]
    block = len(val_y) // world_size
    mine = slice(rank * block, (rank + 1) * block)
    val_x, val_y = val_x[mine], val_y[mine]

    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, factor=0.25, patience=1, threshold=0.02
    )

    # Ctrl-C under torchrun reaches every rank, each at its own point of a
    # step. With --fix a signal only raises a flag; the ranks look at it
    # together, at the start of each step.
    stop = torch.zeros(1)
    if args.fix:

        def request_stop(signum, frame):
            stop.fill_(1)

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        if rank == 0:
            # torchrun sets this from its --signals-to-handle, whatever the
            # variable held before
            passed = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "")
            log(f"rank 0 stops on SIGINT,SIGTERM; torchrun passes on {passed}")

    step, stopped = 0, False
    try:
        for epoch in range(1, args.epochs + 1):
            model.train()
            for i in range(0, len(train_y), 16):
                if step + 1 == args.interrupt_at and rank == 1:
                    # as if Ctrl-C reached rank 1 first, as this step begins
                    os.kill(os.getpid(), signal.SIGINT)
                if args.fix:
                    # --fix: stop when any rank was asked to, all at once
                    agreed = stop.clone()
                    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                    if agreed.item():
                        log(f"rank {rank} stops after step {step}: a signal")
                        stopped = True
                        break
                x, y = train_x[i : i + 16], train_y[i : i + 16]
                loss = F.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if args.check_every and step % args.check_every == 0:
                    check_replicas(model.module, step)
                if args.drift_every and step % args.drift_every == 0:
                    drift = replica_drift(model)
                    if rank == 0:
                        log(f"step={step} replicas_max_abs_diff={drift:.4g}")
            if stopped:
                break
            val = validate(model.module, val_x, val_y, args.fix)
            plateau.step(val)
            lr = optimizer.param_groups[0]["lr"]
            log(f"epoch {epoch} rank {rank} val_loss={val:.4f} lr={lr:.4g}")
            if val < args.stop_below:
                log(f"rank {rank} stops early after epoch {epoch}")
                break
    except KeyboardInterrupt:
        # the single-device habit: Ctrl-C ends training, the script goes on
        log(f"rank {rank} interrupted after step {step}: leaves training")

    # Every rank waits here for the others, as before a final checkpoint.
    dist.barrier()
    drift = replica_drift(model)
    if rank == 0:
        log(f"replicas max_abs_diff={drift:.4g} steps={step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
