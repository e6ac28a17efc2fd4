"""Bonus 3: time all-reduce over message sizes; report time, algorithm and bus bandwidth.

DDP's cost is mostly one all-reduce of the gradients per step. This measures it alone, with
the definitions of NVIDIA's nccl-tests, so numbers compare with theirs:
  algbw = bytes / time                      (how fast this one message went)
  busbw = algbw * 2 (n - 1) / n             (per-link traffic of a ring all-reduce over n ranks;
                                             comparable with the hardware's link bandwidth)
NCCL on GPUs (pick its algorithm with NCCL_ALGO), gloo on CPUs. Launch with torchrun or srun:

    torchrun --standalone --nproc_per_node=4 solutions/allreduce_benchmark.py
    NCCL_ALGO=Ring torchrun --standalone --nproc_per_node=4 solutions/allreduce_benchmark.py
    NCCL_ALGO=Tree torchrun --standalone --nproc_per_node=4 solutions/allreduce_benchmark.py
    torchrun --standalone --nproc_per_node=2 solutions/allreduce_benchmark.py --max-bytes 4M   # CPU, gloo
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64K' -> 65536: sizes as nccl-tests writes them."""
    unit = UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit else int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"))
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size (NCCL sets up on the first)")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines from several processes sharing a terminal never interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def read_launcher_env() -> tuple[int, int, int, int]:
    """rank, local rank, world size, processes on this node: from torchrun, else from srun."""
    env = os.environ
    if "RANK" in env:  # torchrun (it also sets MASTER_ADDR/PORT)
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    world_size = int(env["SLURM_NTASKS"])  # srun: the job script exports MASTER_ADDR/PORT
    return int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]), world_size, int(env.get("SLURM_NTASKS_PER_NODE", world_size))


def setup(local_rank: int, local_world_size: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # before init_process_group: one GPU per process
        dist.init_process_group("nccl")
        return torch.device(f"cuda:{local_rank}")
    if "OMP_NUM_THREADS" not in os.environ:  # processes on one node share its cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def check_sum(device: torch.device) -> None:
    """Before timing anything: does all-reduce add up every rank's contribution?"""
    world_size = dist.get_world_size()
    value = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    if not torch.all(value == expected):
        raise RuntimeError(f"all_reduce gave {value.tolist()}, expected {expected}")


def seconds_per_all_reduce(tensor: torch.Tensor, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        dist.all_reduce(tensor)
    synchronize(tensor.device)
    dist.barrier()  # start together: otherwise we would time the wait for a late rank
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    synchronize(tensor.device)  # GPU collectives are asynchronous: wait until they are done
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the operation ends when the slowest rank ends
    return elapsed.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size, local_world_size = read_launcher_env()
    device = setup(local_rank, local_world_size)
    check_sum(device)
    bus_factor = 2 * (world_size - 1) / world_size
    if rank == 0:
        log(f"# all_reduce world_size={world_size} backend={dist.get_backend()} device={device.type}"
            f" NCCL_ALGO={os.environ.get('NCCL_ALGO', 'auto')} dtype=float32 iters={args.iters}")
        log(f"# {'size(B)':>12} {'count':>12} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    for size in message_sizes(args.min_bytes, args.max_bytes, args.factor):
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)  # 4 bytes per float32
        seconds = seconds_per_all_reduce(tensor, args.warmup, args.iters)
        algbw = size / seconds / 1e9  # GB/s with G = 10^9, as nccl-tests
        if rank == 0:
            log(f"  {size:>12} {size // 4:>12} {seconds * 1e6:>12.1f} {algbw:>12.3f} {algbw * bus_factor:>12.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
