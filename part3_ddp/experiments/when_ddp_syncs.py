"""When DDP copies rank 0's state to the other ranks, and when it does not.

DDP copies rank 0's weights and buffers once, when it is built. After that it
keeps the weights equal by averaging gradients, and it copies rank 0's buffers
(BatchNorm's running statistics) at the start of a forward pass when a flag is
set: the constructor sets it, and every forward clears it unless it runs with
gradients enabled outside `no_sync`, which sets it again. The module's train or
eval mode plays no part. torch 2.15, `require_forward_param_sync` in
`__init__`, `_pre_forward` and `_post_forward` of
https://github.com/pytorch/pytorch/blob/main/torch/nn/parallel/distributed.py.
So:

- the first forward after the wrap copies rank 0's buffers, even in eval mode
  without gradients; a forward that rank 0 alone makes there waits in that copy
  for the others (until the group's timeout);
- after training, each rank's buffers include its own last batch: the bare
  models (`model.module`) of the ranks differ, and score differently;
- the first forward through the wrapper under `torch.no_grad()` copies rank
  0's buffers: every rank then scores rank 0's model, the one rank 0 saves;
- later no_grad forwards copy nothing, so ranks may run different numbers of
  evaluation batches through the wrapper without waiting for each other;
- nor does the first training forward after them (it follows a no_grad
  forward): the copy comes back at the second;
- a state loaded on rank 0 alone after `DDP(...)` is never copied: the
  replicas stay apart (load on every rank, or before wrapping).

    python part3_ddp/experiments/when_ddp_syncs.py

Evidence lines (all from rank 0):
    first_forward_after_wrap mode=eval grad=off buffers_copied=True
    trained buffers_equal=False bare_scores_equal=False
    first_eval_forward buffers_equal=True equal_to_rank0=True scores_equal=True
    later_eval_forwards per_rank=3,2 buffers_copied=False
    train_forwards buffers_copied_first=False buffers_copied_second=True
    load_on_rank0_after_wrap weights_equal_after_steps=False
    load_on_every_rank weights_equal_after_steps=True
"""

import argparse
import os
import socket
import sys
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
    parser.add_argument("--nprocs", type=int, default=2, help="processes")
    parser.add_argument("--steps", type=int, default=3)
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


def all_equal(tensor: torch.Tensor) -> tuple[bool, bool]:
    """Is the tensor the same on every rank; is this rank's rank 0's?"""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    same = all(torch.equal(parts[0], p) for p in parts)
    return same, torch.equal(parts[0], tensor)


def state(model: nn.Module) -> torch.Tensor:
    """Every buffer, flat (BatchNorm's mean, variance and batch count)."""
    return torch.cat([b.flatten().float() for b in model.buffers()])


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def mark(model: nn.Module, rank: int) -> None:
    """Make this rank's buffers its own: add the rank to each."""
    for buffer in model.buffers():
        if buffer.is_floating_point():
            buffer += rank


def train(model, optimizer, data, steps: int) -> None:
    model.train()
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data)
        y = torch.randint(0, 4, (16,), generator=data)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    setup_process_group(rank, world_size)
    torch.manual_seed(args.seed)
    net = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)
    )
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Different data on each rank; one evaluation input shared by all.
    data = torch.Generator().manual_seed(args.seed + 1 + rank)
    probe = torch.randn(32, 8, generator=torch.Generator().manual_seed(99))

    # The first forward after the wrap copies rank 0's buffers too: the
    # constructor sets the flag that a forward with gradients sets. Mark this
    # rank's buffers, then one forward in eval mode, without gradients: the
    # copy comes all the same. (A forward on rank 0 alone here would wait in
    # that copy for the others.)
    mark(model.module, rank)
    model.eval()
    with torch.no_grad():
        model(probe)
    same, _ = all_equal(state(model.module))
    report = (
        f"first_forward_after_wrap mode=eval grad=off buffers_copied={same}"
    )
    train(model, optimizer, data, args.steps)

    # The bare model: each rank's buffers, each rank's scores.
    model.eval()
    with torch.no_grad():
        bare_scores = model.module(probe)
    same, _ = all_equal(state(model.module))
    scores_same, _ = all_equal(bare_scores)
    report += f"\ntrained buffers_equal={same} bare_scores_equal={scores_same}"

    # The first forward through the wrapper after training copies rank 0's.
    with torch.no_grad():
        scores = model(probe)
    same, like_rank0 = all_equal(state(model.module))
    scores_same, _ = all_equal(scores)
    report += (
        f"\nfirst_eval_forward buffers_equal={same}"
        f" equal_to_rank0={like_rank0} scores_equal={scores_same}"
    )

    # Later no_grad forwards copy nothing: mark this rank's buffers, run a
    # different number of forwards on each rank, and look whether the marks
    # survived. (A copy here would wait for the ranks that ran fewer.)
    mark(model.module, rank)
    forwards = world_size + 1 - rank
    with torch.no_grad():
        for _ in range(forwards):
            model(probe)
    counts = torch.tensor([forwards])
    gathered = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(gathered, counts)
    same, _ = all_equal(state(model.module))
    per_rank = ",".join(str(int(c)) for c in gathered)
    report += (
        f"\nlater_eval_forwards per_rank={per_rank} buffers_copied={same}"
    )

    # Training forwards after them: the first follows a no_grad forward and
    # copies nothing; the second follows a training forward and copies rank
    # 0's. A pre-hook of the inner module sees the buffers after DDP's copy.
    seen = []
    hook = model.module.register_forward_pre_hook(
        lambda module, _: seen.append(state(module))
    )
    train(model, optimizer, data, 2)
    hook.remove()
    first, _ = all_equal(seen[0])
    second, _ = all_equal(seen[1])
    report += (
        f"\ntrain_forwards buffers_copied_first={first}"
        f" buffers_copied_second={second}"
    )

    # A snapshot loaded after DDP(...) on rank 0 alone, then on every rank.
    saved = {k: v + 0.01 for k, v in model.module.state_dict().items()}
    for where in ("on_rank0_after_wrap", "on_every_rank"):
        if rank == 0 or where == "on_every_rank":
            model.module.load_state_dict(saved)
        train(model, optimizer, data, args.steps)
        same, _ = all_equal(weights(model.module))
        report += f"\nload_{where} weights_equal_after_steps={same}"
        if where == "on_rank0_after_wrap":
            # Start the second case from equal weights again.
            model.module.load_state_dict(saved)
    if rank == 0:
        log(report)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    mp.spawn(worker, args=(args.nprocs, args), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
