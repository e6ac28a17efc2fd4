"""DDP slower than expected: what each knob costs, as ratios in one run.

Two ranks train the same model (8 layers of 512 x 512, 8 MB of gradients)
in several DDP set-ups, taking turns, so that every set-up meets the same
machine load. Each line gives the wall time per training step (forward,
backward, SGD step; the slower rank's; the fastest of --repeats rounds, as
other jobs on the machine only ever add time), the CPU time per step (the
ranks' mean; waiting not counted, so little changed by other jobs), and
their ratios to the first line of its group:

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

Evidence lines (rank 0; the wall times of a loaded machine):
    bench group=small_batch setting=no_sync batch=8 ms=32.63 ratio=1.00
        cpu_ms=5.36 cpu_ratio=1.00
    bench group=small_batch setting=all_reduce batch=8 ms=28.99 ratio=0.89
        cpu_ms=11.36 cpu_ratio=2.12
"""

import argparse
import contextlib
import os
import sys
import tempfile
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


def run_steps(model, optimizer, batch: int, how: str, steps: int):
    """(wall, CPU) seconds per step on this rank. The CPU time counts every
    thread of the process (gloo's too) and not the time spent waiting, so
    other jobs on the machine barely change it."""
    x = torch.randn(batch, 512)
    # The ranks start together.
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        quiet = (
            model.no_sync() if how == "no_sync" else contextlib.nullcontext()
        )
        with quiet:
            model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    wall = time.perf_counter() - start
    return wall / steps, (time.process_time() - cpu_start) / steps


def worker(
    rank: int, world_size: int, rendezvous: str, args: argparse.Namespace
) -> None:
    # One thread per rank: 2 ranks on a 2-core machine.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    setups = [s for s in SETUPS if not (args.no_compile and "compile" in s[4])]
    built = []
    for _, _, batch, kwargs, how in setups:
        model, optimizer = build(kwargs, how)
        # Warm-up: DDP rebuilds its buckets after the first step; compiling
        # happens here too.
        run_steps(model, optimizer, batch, how, 2)
        built.append((model, optimizer))
    walls, cpus = [[] for _ in setups], [[] for _ in setups]
    for _ in range(args.repeats):
        # Rounds: each set-up in turn, so all meet the same load.
        for i, ((_, _, batch, _, how), (model, optimizer)) in enumerate(
            zip(setups, built, strict=True)
        ):
            wall, cpu = run_steps(model, optimizer, batch, how, args.steps)
            # The slower rank's wall time: a step ends when both are done.
            wall = torch.tensor(wall)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            walls[i].append(wall.item())
            # The ranks' mean CPU time.
            cpu = torch.tensor(cpu)
            dist.all_reduce(cpu)
            cpus[i].append(cpu.item() / world_size)
    baseline = {}
    for (group, setting, batch, _, _), wall, cpu in zip(
        setups, walls, cpus, strict=True
    ):
        ms, cpu_ms = 1000 * min(wall), 1000 * min(cpu)
        base_ms, base_cpu = baseline.setdefault(group, (ms, cpu_ms))
        if rank == 0:
            log(
                f"bench group={group} setting={setting} batch={batch}"
                f" ms={ms:.2f} ratio={ms / base_ms:.2f}"
                f" cpu_ms={cpu_ms:.2f} cpu_ratio={cpu_ms / base_cpu:.2f}"
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
