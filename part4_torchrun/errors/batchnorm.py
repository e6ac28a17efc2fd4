"""Batch norm under DDP: each rank normalises with its own few samples.

In training mode BatchNorm normalises a batch with that batch's mean and
variance. Under DDP each rank sees only its own part of the global batch,
so with 2 samples per rank the statistics come from 2 samples, not from
the global batch: noisy, and unlike a one-process run with the same global
batch. The script measures how far each rank's normalised output is from
the output with the global batch's statistics, per batch size per rank.
It also shows where the running statistics (used at evaluation) come from:
DDP copies rank 0's buffers to every rank at the start of a forward pass
through the wrapper that follows one run with gradients on (and the first
one after wrapping), in training or evaluation mode alike
(forward_sync_buffers=True, the default; torch 2.13 deprecated its older
name, broadcast_buffers), so they are estimated from rank 0's samples alone.

SyncBatchNorm computes the statistics over all ranks (the fix), but not on
a CPU (CUDA, XPU, HPU or a PrivateUse1 device): DDP refuses a CPU model with

    ValueError: SyncBatchNorm layers only work with GPU modules

https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html

    python part4_torchrun/errors/batchnorm.py
    python part4_torchrun/errors/batchnorm.py --fix

--fix: nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP. On a CPU
it fails as above. The script runs on CPUs only (gloo); SyncBatchNorm needs
the model and data on GPUs and the nccl backend: not run here.

Evidence lines (rank 0):
    bn sync=False per_rank_batch=2 global_batch=4 mean_abs_diff=0.6088
    buffers after_forward_equal=False eval_forward_starts_from_rank0=True
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
FEATURES = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="SyncBatchNorm (not on a CPU)"
    )
    parser.add_argument(
        "--batch-sizes",
        default="2,8,32",
        help="per rank, comma-separated",
    )
    parser.add_argument(
        "--trials", type=int, default=50, help="batches per batch size"
    )
    parser.add_argument(
        "--timeout", type=float, default=5, help="collective timeout, s"
    )
    return parser.parse_args()


def log(message: str) -> None:
    # One write per line: lines of processes that share a terminal never
    # interleave.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


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
    model = nn.BatchNorm1d(FEATURES)
    if args.fix:
        # fix: statistics over all ranks' samples (GPU modules only)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # On a CPU, with the fix, DDP raises here.
    ddp = DDP(model)
    generator = torch.Generator().manual_seed(rank)
    for batch in map(int, args.batch_sizes.split(",")):
        diffs = []
        for _ in range(args.trials):
            # Features of mean 3 and standard deviation 2.
            x = 3 + 2 * torch.randn(batch, FEATURES, generator=generator)
            # A training step's forward and backward (no update: the
            # weights stay 1 and the biases 0).
            mine = ddp(x)
            mine.sum().backward()
            with torch.no_grad():
                # What the global batch's statistics give (as SyncBatchNorm
                # computes them): normalise all ranks' samples together.
                everyone = [torch.zeros_like(x) for _ in range(world_size)]
                dist.all_gather(everyone, x)
                reference = nn.functional.batch_norm(
                    torch.cat(everyone), None, None, training=True
                ).chunk(world_size)[rank]
            diffs.append((mine.detach() - reference).abs().mean())
        diff = torch.stack(diffs).mean()
        dist.all_reduce(diff)
        if rank == 0:
            log(
                f"bn sync={args.fix} per_rank_batch={batch}"
                f" global_batch={batch * world_size}"
                f" mean_abs_diff={diff.item() / world_size:.4f}"
            )
    # The running mean each rank's BatchNorm starts an evaluation with,
    # after DDP's buffer broadcast, against the one its last training
    # forward ended with: eval mode and no_grad do not stop the copy.
    seen = {}
    model.register_forward_pre_hook(
        lambda module, _: seen.update(start=module.running_mean.clone())
    )
    ended = model.running_mean.clone()
    ddp.eval()
    with torch.no_grad():
        ddp(x)
    buffers = torch.stack([ended, seen["start"]])
    copies = [torch.zeros_like(buffers) for _ in range(world_size)]
    dist.all_gather(copies, buffers)
    if rank == 0:
        ended_equal = all(torch.equal(copies[0][0], c[0]) for c in copies)
        start_is_rank0 = all(torch.equal(copies[0][0], c[1]) for c in copies)
        log(
            f"buffers after_forward_equal={ended_equal}"
            f" eval_forward_starts_from_rank0={start_is_rank0}"
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
