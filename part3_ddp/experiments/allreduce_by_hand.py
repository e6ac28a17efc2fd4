"""What DDP does under the hood, by hand: all-reduce the gradients.

Part A: after `loss.backward()`, divide every `.grad` by the world size, then
all-reduce it (SUM). That is what DDP does to gradients by default (it overlaps
it with the backward pass, in buckets, and divides while it copies each
gradient into its bucket), so a model trained this way stays equal to a DDP
model trained on the same data. The order matters in float16: a sum of N
gradients can overflow (float16's largest value is 65504) where the sum of N
gradients already divided by N does not. The reducer does the division first
"to avoid overflow, especially for FP16", in the words of DDP's default hook
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py, torch 2.15; the
experiments' README links it). Part A shows it with one float16 gradient of
40000 on every rank: DDP and divide-then-sum give 40000; sum-then-divide and
gloo's `ReduceOp.AVG` (a SUM, then a division) give inf.

Part B: all-reduce itself, written twice with point-to-point messages:
- naive: every rank sends its tensor to rank 0, rank 0 sums and broadcasts the
  result. Rank 0 receives (N - 1) full tensors: its link is the bottleneck as N
  grows.
- ring: the ranks form a ring and pass 1/N-sized chunks to their right-hand
  neighbour. N - 1 steps of reduce-scatter leave each rank with one fully
  summed chunk; N - 1 steps of all-gather pass the summed chunks round. Every
  rank sends 2 (N - 1) / N of the tensor, whatever N is: the reason rings scale
  (gloo's default all-reduce is a ring; NCCL picks among rings, trees and,
  where the hardware has them, NVLS and CollNet; its PAT algorithm serves
  all-gather and reduce-scatter, not all-reduce). Both are checked against
  `dist.all_reduce` and timed over message sizes.

    python part3_ddp/experiments/allreduce_by_hand.py
    python part3_ddp/experiments/allreduce_by_hand.py --nprocs 4 \
        --sizes 1024,1048576,16777216

Evidence lines:
    grad_averaging ranks=3 steps=5 max_abs_diff_vs_ddp=5.551e-17
    fp16_grad ranks=3 grad=40000 ddp=40000 divide_then_sum=40000
        sum_then_divide=inf avg_op=inf
    check algorithm=ring numel=1000 max_abs_diff_vs_all_reduce=8.882e-16
    time numel=65536 bytes=262144 builtin_ms=2.370 naive_ms=1.337
        ring_ms=7.521 ...

On one machine, with three processes and Python-level send/recv, the naive
version often beats the ring: every message costs a fixed latency and the ring
sends 2 (N - 1) of them. The ring's advantage is bandwidth per link as N grows,
which one small machine cannot show.
"""

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group on purpose: imported later (DDP does, on
# first use), it keeps the group alive past destroy_process_group, and gloo can
# abort at exit (README).
import torch.distributed.nn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, default=3, help="processes (ranks)"
    )
    parser.add_argument(
        "--start-method",
        choices=["spawn", "fork"],
        default="spawn",
        help="fork: children inherit the imported torch and start at once"
        " (CPU only)",
    )
    parser.add_argument(
        "--sizes",
        default="256,4096,65536,1048576",
        help="float32 elements per message",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per size (median)"
    )
    parser.add_argument("--seed", type=int, default=0)
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


def setup_process_group(rank: int, world_size: int) -> None:
    # All ranks share this machine's cores: more threads than cores is slower.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    # A collective that waits this long for a lost rank fails instead of
    # hanging.
    timeout = timedelta(seconds=int(os.environ.get("DDP_TIMEOUT_S", 300)))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timeout
    )


# ---- Part A: gradient averaging by hand equals DDP --------------------------


def average_gradients(model: nn.Module) -> None:
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            # Divide first, then sum, in DDP's order. One message per tensor:
            # DDP packs them into buckets.
            param.grad /= world_size
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)


def hand_vs_ddp(rank: int, seed: int, steps: int = 5) -> float:
    def fresh() -> nn.Module:
        # Identical initial weights on every rank and for both copies.
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)
        ).double()

    by_hand, ddp = fresh(), DDP(fresh())
    opt_hand = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    # Each rank its own samples.
    data = torch.Generator().manual_seed(seed + 1 + rank)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=data, dtype=torch.float64)
        y = torch.randint(0, 2, (8,), generator=data)
        for model, optimizer in ((by_hand, opt_hand), (ddp, opt_ddp)):
            optimizer.zero_grad()
            # DDP all-reduces during backward(); by hand, we do it after it.
            F.cross_entropy(model(x), y).backward()
            if model is by_hand:
                average_gradients(model)
            optimizer.step()
    pairs = zip(by_hand.parameters(), ddp.module.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def fp16_order(grad: float = 40000.0) -> dict[str, float]:
    """The same float16 gradient on every rank, averaged four ways. Its sum
    overflows float16 (max 65504) from 2 ranks on; the sum of the gradients
    already divided by N does not."""
    world_size = dist.get_world_size()
    # One weight, input `grad`: d(w * x)/dw = x, so every rank's gradient is
    # `grad`.
    model = DDP(nn.Linear(1, 1, bias=False).half())
    model(torch.full((1, 1), grad, dtype=torch.float16)).sum().backward()
    results = {"ddp": model.module.weight.grad.item()}
    divided = torch.full((1,), grad, dtype=torch.float16) / world_size
    dist.all_reduce(divided, op=dist.ReduceOp.SUM)
    results["divide_then_sum"] = divided.item()
    summed = torch.full((1,), grad, dtype=torch.float16)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    results["sum_then_divide"] = (summed / world_size).item()
    # gloo's AVG: a SUM, then a division (it overflows too).
    averaged = torch.full((1,), grad, dtype=torch.float16)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    results["avg_op"] = averaged.item()
    return results


# ---- Part B: all-reduce from send/recv --------------------------------------


def naive_all_reduce(tensor: torch.Tensor) -> None:
    """Gather everything on rank 0, sum there, broadcast the sum back.
    In place."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for source in range(1, world_size):
            dist.recv(incoming, src=source)
            tensor += incoming
    else:
        dist.send(tensor, dst=0)
    dist.broadcast(tensor, src=0)


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Reduce-scatter then all-gather around a ring, one chunk per step.
    In place."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # Views: writing a chunk writes the tensor.
    chunks = list(tensor.view(-1).tensor_split(world_size))
    incoming = torch.empty_like(chunks[0])
    # Reduce-scatter: at step s, send chunk (rank - s) and add the left
    # neighbour's chunk (rank - s - 1) to ours. After N - 1 steps, chunk
    # (rank + 1) holds the sum of all ranks.
    for step in range(world_size - 1):
        send_index, recv_index = (
            (rank - step) % world_size,
            (rank - step - 1) % world_size,
        )
        # Non-blocking: all ranks send at once, then receive.
        request = dist.isend(chunks[send_index].contiguous(), dst=right)
        # tensor_split chunks may differ by one element.
        buffer = incoming[: chunks[recv_index].numel()]
        dist.recv(buffer, src=left)
        chunks[recv_index] += buffer
        request.wait()
    # All-gather: pass the summed chunks round; at step s, send chunk
    # (rank + 1 - s), receive chunk (rank - s).
    for step in range(world_size - 1):
        send_index, recv_index = (
            (rank + 1 - step) % world_size,
            (rank - step) % world_size,
        )
        request = dist.isend(chunks[send_index].contiguous(), dst=right)
        buffer = incoming[: chunks[recv_index].numel()]
        dist.recv(buffer, src=left)
        chunks[recv_index].copy_(buffer)
        request.wait()


ALGORITHMS = {
    "builtin": dist.all_reduce,
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
}


def check(rank: int, seed: int) -> None:
    # Sizes that do and do not split evenly into chunks.
    for numel in (1, 7, 1000):
        g = torch.Generator().manual_seed(seed + rank)
        mine = torch.randn(numel, generator=g, dtype=torch.float64)
        expected = mine.clone()
        dist.all_reduce(expected)
        for name in ("naive", "ring"):
            result = mine.clone()
            ALGORITHMS[name](result)
            # The worst rank, not just rank 0.
            worst = torch.tensor([(result - expected).abs().max().item()])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if rank == 0:
                log(
                    f"check algorithm={name} numel={numel}"
                    f" max_abs_diff_vs_all_reduce={worst.item():.3e}"
                )


def median_ms(function, tensor: torch.Tensor, repeats: int) -> float:
    # Warm-up: connections and buffers are set up on first use.
    function(tensor.clone())
    times = []
    for _ in range(repeats):
        work = tensor.clone()
        # Start together, so that a late rank is not billed to this message.
        dist.barrier()
        start = time.perf_counter()
        function(work)
        times.append(time.perf_counter() - start)
    # The slowest rank decides when the collective is really done.
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return 1000 * slowest.item()


def benchmark(rank: int, sizes: list[int], repeats: int) -> None:
    for numel in sizes:
        tensor = torch.ones(numel, dtype=torch.float32)
        ms = {
            name: median_ms(function, tensor, repeats)
            for name, function in ALGORITHMS.items()
        }
        if rank == 0:
            nbytes = numel * tensor.element_size()
            times = " ".join(
                f"{name}_ms={ms[name]:.3f}" for name in ALGORITHMS
            )
            # "Algorithm bandwidth": message size / time, in MB/s (1 MB = 1e6
            # bytes).
            rates = " ".join(
                f"{name}_MBps={nbytes / 1e3 / ms[name]:.1f}"
                for name in ALGORITHMS
            )
            log(f"time numel={numel} bytes={nbytes} {times} {rates}")


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    diff = hand_vs_ddp(rank, args.seed)
    if rank == 0:
        log(
            f"grad_averaging ranks={world_size} steps=5"
            f" max_abs_diff_vs_ddp={diff:.3e}"
        )
    fp16 = fp16_order()
    if rank == 0:
        values = " ".join(f"{name}={value:g}" for name, value in fp16.items())
        log(f"fp16_grad ranks={world_size} grad=40000 {values}")
    check(rank, args.seed)
    benchmark(rank, [int(s) for s in args.sizes.split(",")], args.repeats)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # mp.spawn(worker, ...) is start_processes with "spawn": each child starts
    # a fresh Python and imports torch again (seconds). "fork" copies this
    # process, imports included: at once, and safe here because nothing touched
    # CUDA or started threads yet. With GPUs, keep spawn.
    if args.start_method == "fork":
        # DDP imports torch._dynamo on first use (seconds): once here, shared
        # by the children.
        import torch._dynamo
    mp.start_processes(
        worker,
        args=(args.nprocs, args),
        nprocs=args.nprocs,
        start_method=args.start_method,
    )
