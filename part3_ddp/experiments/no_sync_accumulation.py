"""Experiment 6: gradient accumulation with `no_sync`: the same update, fewer all-reduces.

To train with a batch K times larger than fits in memory, run K micro-batches and step the
optimizer once. Under DDP each backward pass all-reduces the gradients, but only the sum
after the K-th micro-batch matters: inside `model.no_sync()` DDP skips the all-reduce and
just accumulates into `.grad`; the first backward outside it all-reduces the accumulated
gradients. Averaging is linear, so the update is the same, with 1 all-reduce instead of K.

The flag is read in the *forward* pass (that is when DDP prepares its backward hooks), so
the forward must be inside `no_sync()` too: wrapping only `loss.backward()` syncs anyway.

All-reduces are counted with a DDP communication hook: DDP calls it once per gradient
bucket it would all-reduce (this small model fits in one bucket).

    python part3_ddp/experiments/no_sync_accumulation.py
    python part3_ddp/experiments/no_sync_accumulation.py --nprocs 3 --accumulate 8

Evidence lines:
    run mode=sync_every_step updates=3 micro_batches=12 allreduce_calls=12
    run mode=no_sync updates=3 micro_batches=12 allreduce_calls=3
    run mode=no_sync_backward_only updates=3 micro_batches=12 allreduce_calls=12
    compare mode=no_sync vs=sync_every_step max_abs_diff=1.110e-16
"""

import argparse
import contextlib
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("sync_every_step", "no_sync", "no_sync_backward_only")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn",
                        help="fork: children inherit the imported torch and start at once (CPU only)")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step (K)")
    parser.add_argument("--updates", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch, per process")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def log(message: str) -> None:
    sys.stdout.write(message + "\n")  # one write per line: ranks never glue lines together
    sys.stdout.flush()


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup(rank: int, world_size: int) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def counting_allreduce_hook(calls: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """What DDP does by default (all-reduce, then divide by world size), plus a tally."""
    calls[0] += 1
    world_size = dist.get_world_size()
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0] / world_size)


def train(rank: int, args: argparse.Namespace, mode: str) -> tuple[nn.Module, int]:
    torch.manual_seed(args.seed)  # the same initial weights for every mode and rank
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)).double())
    calls = [0]
    model.register_comm_hook(calls, counting_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(args.seed + 1 + rank)  # same micro-batches for every mode
    for _ in range(args.updates):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            x = torch.randn(args.batch_size, 10, generator=data, dtype=torch.float64)
            y = torch.randint(0, 3, (args.batch_size,), generator=data)
            last = micro == args.accumulate - 1
            skip = mode != "sync_every_step" and not last
            # no_sync: forward AND backward inside the context; backward_only: the common mistake
            around_forward = model.no_sync() if skip and mode == "no_sync" else contextlib.nullcontext()
            around_backward = model.no_sync() if skip else contextlib.nullcontext()
            with around_forward:
                loss = F.cross_entropy(model(x), y) / args.accumulate  # mean over all K micro-batches
            with around_backward:
                loss.backward()  # gradients add up in .grad across micro-batches
        optimizer.step()
    return model.module, calls[0]


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup(rank, world_size)
    models = {}
    for mode in MODES:
        models[mode], calls = train(rank, args, mode)
        if rank == 0:
            log(f"run mode={mode} ranks={world_size} updates={args.updates}"
                f" micro_batches={args.updates * args.accumulate} allreduce_calls={calls}")
    if rank == 0:
        for mode in MODES[1:]:
            diff = max((p - q).abs().max().item() for p, q in
                       zip(models[mode].parameters(), models["sync_every_step"].parameters(), strict=True))
            log(f"compare mode={mode} vs=sync_every_step max_abs_diff={diff:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # mp.spawn(worker, ...) is start_processes with "spawn": each child starts a fresh Python and
    # imports torch again (seconds). "fork" copies this process, imports included: instant, and
    # safe here because nothing touched CUDA or started threads yet. With GPUs, keep "spawn".
    if args.start_method == "fork":  # DDP imports torch._dynamo on first use (seconds): once here, shared
        import torch._dynamo
    mp.start_processes(worker, args=(args.nprocs, args), nprocs=args.nprocs, start_method=args.start_method)
