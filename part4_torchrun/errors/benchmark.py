"""DDP slower than expected: what each knob costs, as ratios in one run.

Two ranks train the same model (8 layers of 512 x 512, 8 MB of gradients)
in several DDP set-ups, taking turns, so that every set-up meets the same
machine load. Each line gives the time per training step (forward,
backward, SGD step; the slower rank's; the fastest of --repeats rounds, as
other jobs on the machine only ever add time) and its ratio to the first
line of its group:

- small_batch, large_batch: a step inside no_sync() (no communication)
  against the same step with DDP's all-reduce, with 8 and 128 samples per
  rank: the communication's share of a step shrinks as the batch grows;
- knobs, 32 samples per rank, against DDP's defaults: default_again (the
  same set-up once more: the noise), bucket_cap_mb 1 and 100 (25 is the
  default: small buckets send more messages, one large bucket starts only
  after the whole backward pass), gradient_as_bucket_view=True (the
  gradients live in the buckets: no copy, less memory),
  find_unused_parameters=True (a search of the autograd graph after every
  forward pass, with nothing to find here), and compiling in place with
  inductor, before and after DDP wraps the model (skipped with
  --no-compile).

    python part4_torchrun/errors/benchmark.py

Evidence lines (rank 0):
    bench group=small_batch setting=no_sync batch=8 ms=32.80 ratio=1.00
    bench group=small_batch setting=all_reduce batch=8 ms=59.74 ratio=1.82
"""

import argparse
import contextlib
import os
import socket
import sys
import time
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
# group, setting, batch per rank, DDP's arguments, how: "" (plain),
# "no_sync", "compile_inner" (model.compile(), then DDP),
# "wrap_then_compile" (DDP, then .compile() on it). The first of each
# group is its baseline; "default" twice, to show the noise.
SETUPS = [
    ("small_batch", "no_sync", 8, {}, "no_sync"),
    ("small_batch", "all_reduce", 8, {}, ""),
    ("large_batch", "no_sync", 128, {}, "no_sync"),
    ("large_batch", "all_reduce", 128, {}, ""),
    ("knobs", "default", 32, {}, ""),
    ("knobs", "default_again", 32, {}, ""),
    ("knobs", "bucket_cap_mb=1", 32, {"bucket_cap_mb": 1}, ""),
    ("knobs", "bucket_cap_mb=100", 32, {"bucket_cap_mb": 100}, ""),
    (
        "knobs",
        "gradient_as_bucket_view=True",
        32,
        {"gradient_as_bucket_view": True},
        "",
    ),
    (
        "knobs",
        "find_unused_parameters=True",
        32,
        {"find_unused_parameters": True},
        "",
    ),
    ("knobs", "compile_inner", 32, {}, "compile_inner"),
    ("knobs", "wrap_then_compile", 32, {}, "wrap_then_compile"),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="per round")
    parser.add_argument("--repeats", type=int, default=9, help="rounds")
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the compiled set-ups"
    )
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


class Net(nn.Module):
    """8 layers of 512 x 512: 1 MB of float32 weights each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build(kwargs: dict, how: str):
    torch.manual_seed(0)
    net = Net()
    if how == "compile_inner":
        net.compile()
    model = DDP(net, **kwargs)
    if how == "wrap_then_compile":
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, optimizer


def run_steps(model, optimizer, batch: int, how: str, steps: int) -> float:
    """Seconds per step on this rank."""
    x = torch.randn(batch, 512)
    # The ranks start together.
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        quiet = (
            model.no_sync() if how == "no_sync" else contextlib.nullcontext()
        )
        with quiet:
            model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    # One thread per rank: 2 ranks on a 2-core machine.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
    )
    setups = [s for s in SETUPS if not (args.no_compile and "compile" in s[4])]
    built = []
    for _, _, batch, kwargs, how in setups:
        model, optimizer = build(kwargs, how)
        # Warm-up: DDP rebuilds its buckets after the first step; compiling
        # happens here too.
        run_steps(model, optimizer, batch, how, 2)
        built.append((model, optimizer))
    times = [[] for _ in setups]
    for _ in range(args.repeats):
        # Rounds: each set-up in turn, so all meet the same load.
        for i, ((_, _, batch, _, how), (model, optimizer)) in enumerate(
            zip(setups, built, strict=True)
        ):
            seconds = torch.tensor(
                run_steps(model, optimizer, batch, how, args.steps)
            )
            # The slower rank's time: the step ends when both are done.
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            times[i].append(seconds.item())
    baseline = {}
    for (group, setting, batch, _, _), measured in zip(
        setups, times, strict=True
    ):
        ms = 1000 * min(measured)
        baseline.setdefault(group, ms)
        if rank == 0:
            log(
                f"bench group={group} setting={setting} batch={batch}"
                f" ms={ms:.2f} ratio={ms / baseline[group]:.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn). DDP imports torch._dynamo on first use
    # (seconds): once here, for both ranks.
    method = "fork" if sys.platform == "linux" else "spawn"
    if method == "fork":
        import torch._dynamo
    mp.start_processes(
        worker, (WORLD_SIZE, args), nprocs=WORLD_SIZE, start_method=method
    )
