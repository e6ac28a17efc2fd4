"""Your own script: a forward outside the training step. See README.md.

A small generator with BatchNorm, trained with DDP on 2 ranks; every
--sample-every steps rank 0 alone renders samples from fixed noise, as a GAN
or a VAE shows its progress. Without --fix it calls the wrapper,
model(noise): DDP's forward can start a collective (the buffer broadcast)
that no other rank joins. With --fix it calls model.module(noise): outside
the training step, call .module.

    torchrun --standalone --nproc_per_node=2 outside_step.py --timeout 3
    torchrun --standalone --nproc_per_node=2 outside_step.py --fix
"""

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

NOISE = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fix", action="store_true", help="samples through model.module"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument(
        "--train-mode", action="store_true", help="sample without eval()"
    )
    parser.add_argument(
        "--with-grad", action="store_true", help="sample without no_grad()"
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if min(args.steps, args.sample_every, args.timeout) <= 0:
        parser.error("--steps, --sample-every and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def toy_loss(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    # Match the batch's mean and spread: a GAN would train a discriminator,
    # which changes nothing below.
    means = (fake.mean(0) - real.mean(0)).pow(2).sum()
    return means + (fake.std(0) - real.std(0)).pow(2).sum()


def main(args: argparse.Namespace) -> None:
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    generator = nn.Sequential(
        nn.Linear(NOISE, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2)
    )
    model = DDP(generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # Each rank its own noise and its own real samples (a 2-D Gaussian).
    draws = torch.Generator().manual_seed(args.seed + 1 + rank)
    fixed_noise = torch.randn(
        16, NOISE, generator=torch.Generator().manual_seed(args.seed)
    )
    center = torch.tensor([2.0, -1.0])

    # DDP's forward broadcasts rank 0's buffers first (_pre_forward ->
    # _sync_buffers) when will_sync_module_buffers() says so: the previous
    # forward through the wrapper ran with gradients on (or there was none),
    # forward_sync_buffers is on (the default), the model has buffers. It
    # reads neither train() nor eval(). Counted here on each rank.
    broadcasts, rendered = 0, 0
    for step in range(1, args.steps + 1):
        noise = torch.randn(32, NOISE, generator=draws)
        real = center + 0.5 * torch.randn(32, 2, generator=draws)
        broadcasts += model.will_sync_module_buffers()
        loss = toy_loss(model(noise), real)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        # The course's "one writer": only rank 0 renders and saves samples.
        if rank == 0 and step % args.sample_every == 0:
            # --fix: outside the training step, call .module: no collective
            sampler = model.module if args.fix else model
            # Through the wrapper this forward broadcasts rank 0's buffers,
            # and no other rank joins it. In mid-run it meets rank 1's next
            # training forward's broadcast (rank 0's own next forward skips
            # it: this one ran without gradients); after the last step rank 1
            # waits in the all_gather below, and this broadcast waits for a
            # partner that never comes.
            if sampler is model:
                broadcasts += model.will_sync_module_buffers()
            through = "wrapper" if sampler is model else "module"
            log(
                f"rank=0 sample step={step} through={through}"
                f" buffer_broadcasts={broadcasts}"
            )
            # eval mode and no gradients, as for any sample (--train-mode and
            # --with-grad leave them out)
            if not args.train_mode:
                sampler.eval()
            with torch.set_grad_enabled(args.with_grad):
                # the samples: rendered and saved here
                sampler(fixed_noise)
            sampler.train()
            rendered += 1

    log(
        f"rank={rank} steps={step} samples={rendered}"
        f" buffer_broadcasts={broadcasts}"
    )
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    if rank == 0:
        drift = max((r - flat).abs().max().item() for r in replicas)
        log(f"replicas max_abs_diff={drift:.4g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
