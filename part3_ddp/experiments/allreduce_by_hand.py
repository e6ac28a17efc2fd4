"""Experiment 5: what DDP does under the hood, by hand: all-reduce the gradients.

Part A: after `loss.backward()`, all-reduce every `.grad` (SUM) and divide by the world size.
That is all DDP does to gradients (it overlaps it with the backward pass, in buckets), so a
model trained this way stays equal to a DDP model trained on the same data.

Part B: all-reduce itself, written twice with point-to-point messages:
- naive: every rank sends its tensor to rank 0, rank 0 sums and broadcasts the result.
  Rank 0 receives (N - 1) full tensors: its link is the bottleneck as N grows.
- ring: ranks form a ring and pass 1/N-sized chunks to their right-hand neighbour. N - 1
  steps of reduce-scatter leave each rank with one fully summed chunk; N - 1 steps of
  all-gather pass the summed chunks round. Every rank sends 2 (N - 1) / N of the tensor,
  whatever N is: the reason rings scale (gloo uses one; NCCL picks rings or trees).
Both are checked against `dist.all_reduce` and timed over message sizes.

    python part3_ddp/experiments/allreduce_by_hand.py
    python part3_ddp/experiments/allreduce_by_hand.py --nprocs 4 --sizes 1024,1048576,16777216

Evidence lines:
    grad_averaging ranks=3 steps=5 max_abs_diff_vs_ddp=5.551e-17
    check algorithm=ring numel=1000 max_abs_diff_vs_all_reduce=8.882e-16
    time numel=65536 bytes=262144 builtin_ms=2.370 naive_ms=1.337 ring_ms=7.521 builtin_MBps=110.6 ...

On one machine, with three processes and Python-level send/recv, the naive version often
beats the ring: every message costs a fixed latency and the ring sends 2 (N - 1) of them.
The ring's advantage is bandwidth per link as N grows, which this laptop-sized test cannot show.
"""

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=3, help="processes (ranks)")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn",
                        help="fork: children inherit the imported torch and start at once (CPU only)")
    parser.add_argument("--sizes", default="256,4096,65536,1048576", help="float32 elements per message")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (the median is printed)")
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


# ---- Part A: gradient averaging by hand equals DDP -------------------------------------------

def average_gradients(model: nn.Module) -> None:
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)  # one message per tensor: DDP buckets them
            param.grad /= world_size


def hand_vs_ddp(rank: int, seed: int, steps: int = 5) -> float:
    def fresh() -> nn.Module:
        torch.manual_seed(seed)  # identical initial weights on every rank and for both copies
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()

    by_hand, ddp = fresh(), DDP(fresh())
    opt_hand = torch.optim.SGD(by_hand.parameters(), lr=0.1, momentum=0.9)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own samples
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=data, dtype=torch.float64), torch.randint(0, 2, (8,), generator=data)
        for model, optimizer in ((by_hand, opt_hand), (ddp, opt_ddp)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()  # DDP all-reduces during this call
            if model is by_hand:
                average_gradients(model)  # ... we do it after it
            optimizer.step()
    return max((p - q).abs().max().item() for p, q in zip(by_hand.parameters(), ddp.module.parameters(), strict=True))


# ---- Part B: all-reduce from send/recv --------------------------------------------------------

def naive_all_reduce(tensor: torch.Tensor) -> None:
    """Gather everything on rank 0, sum there, broadcast the sum back. In place, like dist.all_reduce."""
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
    """Reduce-scatter then all-gather around a ring, one chunk per step. In place."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = list(tensor.view(-1).tensor_split(world_size))  # views: writing a chunk writes the tensor
    incoming = torch.empty_like(chunks[0])
    # Reduce-scatter: at step s, send chunk (rank - s) and add the left neighbour's chunk (rank - s - 1).
    # After N - 1 steps, chunk (rank + 1) holds the sum over all ranks.
    for step in range(world_size - 1):
        send_index, recv_index = (rank - step) % world_size, (rank - step - 1) % world_size
        request = dist.isend(chunks[send_index].contiguous(), dst=right)  # non-blocking: all ranks send at once
        buffer = incoming[: chunks[recv_index].numel()]  # tensor_split chunks may differ by one element
        dist.recv(buffer, src=left)
        chunks[recv_index] += buffer
        request.wait()
    # All-gather: pass the summed chunks round; at step s, send chunk (rank + 1 - s), receive (rank - s).
    for step in range(world_size - 1):
        send_index, recv_index = (rank + 1 - step) % world_size, (rank - step) % world_size
        request = dist.isend(chunks[send_index].contiguous(), dst=right)
        buffer = incoming[: chunks[recv_index].numel()]
        dist.recv(buffer, src=left)
        chunks[recv_index].copy_(buffer)
        request.wait()


ALGORITHMS = {"builtin": dist.all_reduce, "naive": naive_all_reduce, "ring": ring_all_reduce}


def check(rank: int, seed: int) -> None:
    for numel in (1, 7, 1000):  # sizes that do and do not split evenly into chunks
        mine = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)
        expected = mine.clone()
        dist.all_reduce(expected)
        for name in ("naive", "ring"):
            result = mine.clone()
            ALGORITHMS[name](result)
            worst = torch.tensor([(result - expected).abs().max().item()])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank, not just rank 0
            if rank == 0:
                log(f"check algorithm={name} numel={numel} max_abs_diff_vs_all_reduce={worst.item():.3e}")


def median_ms(function, tensor: torch.Tensor, repeats: int) -> float:
    function(tensor.clone())  # warm-up: connections and buffers are set up on first use
    times = []
    for _ in range(repeats):
        work = tensor.clone()
        dist.barrier()  # start together, so a slow rank is not billed to the next message
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
        ms = {name: median_ms(function, tensor, repeats) for name, function in ALGORITHMS.items()}
        if rank == 0:
            nbytes = numel * tensor.element_size()
            # "algorithm bandwidth": message size / time, in MB/s (1 MB = 1e6 bytes)
            rates = " ".join(f"{name}_MBps={nbytes / 1e3 / ms[name]:.1f}" for name in ALGORITHMS)
            log(f"time numel={numel} bytes={nbytes} " + " ".join(f"{name}_ms={ms[name]:.3f}" for name in ALGORITHMS)
                + " " + rates)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup(rank, world_size)
    diff = hand_vs_ddp(rank, args.seed)
    if rank == 0:
        log(f"grad_averaging ranks={world_size} steps=5 max_abs_diff_vs_ddp={diff:.3e}")
    check(rank, args.seed)
    benchmark(rank, [int(s) for s in args.sizes.split(",")], args.repeats)
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
