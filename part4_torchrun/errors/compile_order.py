"""torch.compile with DDP: wrap first, then compile.

torch.compile(model) returns a wrapper whose state_dict keys start with
"_orig_mod.". Compiled first and then wrapped in DDP, that wrapper is what
DDP holds, so the checkpoint saved from model.module carries the prefix, and
a plain script that loads it into the bare model fails with

    RuntimeError: Error(s) in loading state_dict for Net:
    ... Unexpected key(s) in state_dict: "_orig_mod.layers.0.weight", ...

Either way, while DDP's forward pass runs, TorchDynamo splits the captured
graph at DDP's bucket boundaries (its DDPOptimizer), so that each bucket's
all-reduce can start while the backward pass of the graphs before it still
runs. The script counts the graphs: one per 1 MB bucket here.

The backend here only counts the graphs and runs them as captured;
torch.compile's default backend, inductor, generates code for each
(benchmark.py measures it).

    python part4_torchrun/errors/compile_order.py
    python part4_torchrun/errors/compile_order.py --fix

--fix: DDP(model) first, then .compile() on the DDP module, in place: the
order the DDP notes give, and the keys stay the bare model's.

Evidence lines (rank 0):
    graphs fix=True graphs=8
    loaded fix=True keys=16 first_key=layers.0.weight
"""

import argparse
import os
import socket
import sys
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
# Graphs handed to the backend, in this process.
GRAPHS = []


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="wrap in DDP, then compile"
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="collective timeout, s"
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


def count_graphs(graph_module, example_inputs):
    # A torch.compile backend: notes each graph, runs it as captured.
    GRAPHS.append(graph_module)
    return graph_module.forward


class Net(nn.Module):
    """8 layers of 512 x 512: 1 MB of float32 weights each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timeout
    )
    torch.manual_seed(0)
    net = Net()
    if args.fix:
        # fix: wrap, then compile the DDP module in place
        model = DDP(net, bucket_cap_mb=1)
        model.compile(backend=count_graphs)
    else:
        # The bug: DDP wraps the compiled wrapper (keys "_orig_mod.")
        model = DDP(torch.compile(net, backend=count_graphs), bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(8, 512)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        log(f"graphs fix={args.fix} graphs={len(GRAPHS)}")

    # What a plain script does with the checkpoint: load it into the bare
    # model (strict: every key must match). Without the fix it raises here.
    state = model.module.state_dict()
    Net().load_state_dict(state)
    if rank == 0:
        first = next(iter(state))
        log(f"loaded fix={args.fix} keys={len(state)} first_key={first}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn). DDP and torch.compile import
    # torch._dynamo (seconds): once here, for both ranks.
    method = "fork" if sys.platform == "linux" else "spawn"
    if method == "fork":
        import torch._dynamo
    mp.start_processes(
        worker, (WORLD_SIZE, args), nprocs=WORLD_SIZE, start_method=method
    )
