"""Bonus 3: all-reduce's time, algorithm and bus bandwidth, by message size.

DDP's cost is mostly one all-reduce of the gradients per step. This measures
it alone, with the definitions of NVIDIA's nccl-tests, so numbers compare with
theirs:
  algbw = bytes / time           (how fast this one message went)
  busbw = algbw * 2 (n - 1) / n  (per-link traffic of a ring all-reduce over
                                  n ranks: compare it with the hardware's
                                  link bandwidth)
NCCL on GPUs (pick its algorithm with NCCL_ALGO), gloo on CPUs. Launch with
torchrun or srun; on 4 GPUs, then on 2 CPU processes:

    torchrun --standalone --nproc_per_node=4 solutions/allreduce_benchmark.py
    NCCL_ALGO=Ring torchrun --standalone --nproc_per_node=4 \
        solutions/allreduce_benchmark.py
    NCCL_ALGO=Tree torchrun --standalone --nproc_per_node=4 \
        solutions/allreduce_benchmark.py
    torchrun --standalone --nproc_per_node=2 \
        solutions/allreduce_benchmark.py --max-bytes 4M
"""

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
COLUMNS = ("size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)")


def parse_size(text: str) -> int:
    """'64K' -> 65536: sizes as nccl-tests writes them."""
    unit = UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit else int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A default given as text goes through parse_size too.
    parser.add_argument("--min-bytes", type=parse_size, default="1K")
    parser.add_argument("--max-bytes", type=parse_size, default="256M")
    parser.add_argument(
        "--factor", type=int, default=4, help="size multiplier between rows"
    )
    # NCCL connects during the first all-reduces: leave them out of the timing
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed all-reduces per size"
    )
    parser.add_argument(
        "--iters", type=int, default=20, help="timed all-reduces per size"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def setup_process_group() -> tuple[int, int, torch.device]:
    """Returns rank, world size and this process's device."""
    env = os.environ
    # torchrun sets RANK (and MASTER_ADDR, MASTER_PORT); srun sets
    # SLURM_PROCID, and the job script exports MASTER_ADDR and MASTER_PORT
    if "RANK" in env:
        names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
    elif (
        "SLURM_PROCID" in env and {"MASTER_ADDR", "MASTER_PORT"} <= env.keys()
    ):
        names = ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"]
        names.append("SLURM_NTASKS_PER_NODE")
    else:
        sys.exit(
            "error: start it with torchrun, or with srun after exporting"
            " MASTER_ADDR/PORT"
        )
    rank, local_rank, world_size = (int(env[name]) for name in names[:3])
    local_world_size = int(env.get(names[3], world_size))
    if torch.cuda.is_available():
        # before init_process_group: one GPU per process
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in env:
        # the processes on one node share its cores
        threads = torch.get_num_threads() // local_world_size
        torch.set_num_threads(max(1, threads))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # a collective that waits this long for a lost rank fails instead of
    # hanging
    timeout = timedelta(seconds=int(env.get("DDP_TIMEOUT_S", 60)))
    # this process's GPU, named: NCCL would otherwise guess it
    gpu = local_rank if torch.cuda.is_available() else None
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=gpu,
    )
    cuda = f"cuda:{local_rank}"
    device = torch.device(cuda if torch.cuda.is_available() else "cpu")
    return rank, world_size, device


def check_sum(device: torch.device) -> None:
    """Before any timing: does all-reduce add up every rank's contribution?"""
    world_size = dist.get_world_size()
    value = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    if not torch.all(value == expected):
        got = value.tolist()
        raise RuntimeError(f"all_reduce gave {got}, expected {expected}")


def seconds_per_all_reduce(tensor, warmup: int, iters: int) -> float:
    # At least one warm-up: it also lines the ranks up.
    for _ in range(max(1, warmup)):
        dist.all_reduce(tensor)
    # Start together, else we would time the wait for a late rank: the last
    # warm-up all-reduce ends only once every rank has joined it, and
    # .tolist() waits for it on the device.
    tensor[:1].tolist()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    # GPU collectives are asynchronous: .tolist() waits until they are done.
    tensor[:1].tolist()
    seconds = (time.perf_counter() - start) / iters
    elapsed = torch.tensor([seconds], device=tensor.device)
    # The operation ends when the slowest rank ends.
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()[0]


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_process_group()
    check_sum(device)
    bus_factor = 2 * (world_size - 1) / world_size
    if rank == 0:
        algo = os.environ.get("NCCL_ALGO", "auto")
        log(
            f"# all_reduce world_size={world_size}"
            f" backend={dist.get_backend()} device={device.type}"
            f" NCCL_ALGO={algo}"
            f" dtype=float32 iters={args.iters}"
        )
        log("# " + " ".join(f"{column:>12}" for column in COLUMNS))
    for size in message_sizes(args.min_bytes, args.max_bytes, args.factor):
        # 4 bytes per float32
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds = seconds_per_all_reduce(tensor, args.warmup, args.iters)
        # GB/s with G = 10^9, as nccl-tests
        algbw = size / seconds / 1e9
        busbw = algbw * bus_factor
        measured = (f"{seconds * 1e6:.1f}", f"{algbw:.3f}", f"{busbw:.3f}")
        row = (size, size // 4, *measured)
        if rank == 0:
            log("  " + " ".join(f"{value:>12}" for value in row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
