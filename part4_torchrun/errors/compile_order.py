"""torch.compile with DDP: the order, and what each one keeps.

torch.compile(model) returns a wrapper whose state_dict keys start with
"_orig_mod.". Compiled so and then wrapped in DDP, that wrapper is what DDP
holds, so the checkpoint saved from ddp.module carries the prefix, and a
plain script that loads it into the bare model fails with

    RuntimeError: Error(s) in loading state_dict for Net:
    ... Unexpected key(s) in state_dict: "_orig_mod.layers.0.weight", ...

The fixes compile in place with the module's own .compile(), which adds no
wrapper, in either order:

    python part4_torchrun/errors/compile_order.py
    python part4_torchrun/errors/compile_order.py --fix compile-inner
    python part4_torchrun/errors/compile_order.py --fix wrap-then-compile

--fix compile-inner: model.compile(), then DDP(model): what PyTorch's "Where
to apply torch.compile?" page advises. --fix wrap-then-compile: DDP(model),
then .compile() on the DDP module: what the DDP notes show, and what the
course's speed step 2 does.

While DDP's forward pass runs, TorchDynamo splits the captured graph at
DDP's bucket boundaries (its DDPOptimizer), so that each bucket's all-reduce
can start while the backward pass of the graphs before it still runs. The
script counts the graphs, with a backend that only counts them and runs
them as captured (torch.compile's default backend, inductor, generates code
for each; benchmark.py measures it): one per 1 MB bucket. It does so for
two models with the same 8 layers: Net, a class of this script, and a bare
nn.Sequential, PyTorch's own class, which compiling the DDP module does not
compile at all.

Evidence lines (rank 0):
    graphs fix=compile-inner model=Net graphs=8
    graphs fix=compile-inner model=Sequential graphs=8
    loaded fix=compile-inner keys=16 first_key=layers.0.weight
"""

import argparse
import os
import sys
import tempfile
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix",
        choices=["compile-inner", "wrap-then-compile"],
        help="compile in place, before or after DDP wraps the model",
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


def counting_backend(graphs: list):
    # A torch.compile backend: notes each graph, runs it as captured.
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend


class Net(nn.Module):
    """8 layers of 512 x 512: 1 MB of float32 weights each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def wrap(net: nn.Module, fix: str | None, backend) -> DDP:
    if fix == "compile-inner":
        # fix: compile the model in place, then wrap it
        net.compile(backend=backend)
        return DDP(net, bucket_cap_mb=1)
    if fix == "wrap-then-compile":
        # fix: wrap, then compile the DDP module in place
        model = DDP(net, bucket_cap_mb=1)
        model.compile(backend=backend)
        return model
    # The bug: DDP holds torch.compile's wrapper (keys "_orig_mod.")
    return DDP(torch.compile(net, backend=backend), bucket_cap_mb=1)


def worker(
    rank: int, world_size: int, rendezvous: str, args: argparse.Namespace
) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    torch.manual_seed(0)
    net = Net()
    # The same layers in PyTorch's own container.
    sequential = nn.Sequential(
        *(m for layer in net.layers for m in (layer, nn.ReLU()))
    )
    for name, module in (("Net", net), ("Sequential", sequential)):
        graphs = []
        model = wrap(module, args.fix, counting_backend(graphs))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(torch.randn(8, 512)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            log(f"graphs fix={args.fix} model={name} graphs={len(graphs)}")
        if name == "Net":
            state = model.module.state_dict()

    # What a plain script does with the checkpoint: load it into the bare
    # model (strict: every key must match). Without a fix it raises here.
    Net().load_state_dict(state)
    if rank == 0:
        first = next(iter(state))
        log(f"loaded fix={args.fix} keys={len(state)} first_key={first}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    # fork: the ranks inherit the imported torch and start at once (Linux;
    # CPU only: with GPUs, spawn). DDP and torch.compile import
    # torch._dynamo (seconds): once here, for both ranks.
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
