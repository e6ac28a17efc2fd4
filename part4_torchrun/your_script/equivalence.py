"""Your own script: show that the DDP version trains as the original does.

The recipe, on a small MLP with SGD and momentum, in float32 and float64:
the DDP model trains on this rank's B/N rows of each global batch of B, and
rank 0 also trains the original, without DDP, on all B rows. Run alone
(python: a world of one) the two must match bit for bit; on N ranks they
match to rounding after one step, then drift apart slowly.

Randomness. --shuffle: batches from a shuffled data set, through a
DistributedSampler per rank, and the original shuffles with shuffle=True: a
world of one no longer matches. --noise: forward adds noise from torch.randn:
N ranks no longer match. With --fix the original takes the rows the ranks'
samplers hand out, and the noise is drawn per sample, from a generator keyed
by the sample's index.

A chaotic training (--lr 1 --steps 40) amplifies rounding; the float64 run
tells that from a bug (--bug batch-per-rank: every rank loads B rows).

Normalisation and adaptive optimizers. --norm batch: BatchNorm normalises
over each rank's rows, so N ranks differ from one process by design, in
float64 as in float32; with --fix, a switch for the check only, BatchNorm
runs on its running statistics in both. --norm instance --optimizer adam: a
bias before InstanceNorm has no gradient but rounding's, and Adam turns
that into a full step: a float32 difference that float64 shows is rounding.

    python equivalence.py
    torchrun --standalone --nproc_per_node=2 equivalence.py
    python equivalence.py --shuffle
    torchrun --standalone --nproc_per_node=2 equivalence.py --noise
    python equivalence.py --shuffle --noise --fix
    torchrun --standalone --nproc_per_node=2 equivalence.py \\
        --shuffle --noise --fix
    torchrun --standalone --nproc_per_node=2 equivalence.py --lr 1 --steps 40
    torchrun --standalone --nproc_per_node=2 equivalence.py \\
        --lr 1 --steps 40 --bug batch-per-rank
    torchrun --standalone --nproc_per_node=2 equivalence.py --norm batch
    torchrun --standalone --nproc_per_node=2 equivalence.py --norm batch --fix
    torchrun --standalone --nproc_per_node=2 equivalence.py \\
        --norm instance --optimizer adam
"""

import argparse
import itertools
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before init_process_group: imported later (DDP does), it keeps the
# group alive at exit (part3_ddp/experiments/README.md).
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# The standard deviation of --noise, added to the first layer's output.
NOISE = 0.5
LR = 0.1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=32, help="B: the global batch"
    )
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument(
        "--steps",
        type=int,
        default=100,
        help="compared after steps 1, 10 and STEPS",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shuffle", action="store_true", help="a shuffled data set"
    )
    parser.add_argument(
        "--noise", action="store_true", help="random noise in forward"
    )
    parser.add_argument(
        "--norm", choices=["batch", "instance"], help="a normalisation layer"
    )
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument(
        "--fix",
        action="store_true",
        help="the same rows, draws and normalisation in both",
    )
    parser.add_argument(
        "--bug", choices=["batch-per-rank"], help="a bug planted in the port"
    )
    parser.add_argument(
        "--timeout", type=float, default=60, help="seconds a collective waits"
    )
    args = parser.parse_args()
    if min(args.steps, args.batch_size, args.timeout) <= 0:
        parser.error("--steps, --batch-size and --timeout must be > 0")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def per_sample_noise(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A draw per sample, from a generator seeded with the sample's id: the
    same draw whichever rank, batch or position the sample is in."""
    rows = [
        torch.randn(like.shape[1:], generator=torch.Generator().manual_seed(i))
        for i in ids.tolist()
    ]
    return torch.stack(rows).to(like.dtype)


class Net(nn.Module):
    """The MLP; noise: none, or drawn inside forward, as a GAN's generator or
    a VAE's reparameterisation draws it; norm: none, BatchNorm after the
    first layer, or a convolution then InstanceNorm as the first layer."""

    def __init__(self, noise: str, norm: str | None):
        super().__init__()
        first = nn.Linear(16, 64)
        if norm == "instance":
            # A bias per channel, then each sample's channel normalised: the
            # bias drops out of the output; its gradient is rounding alone.
            first = nn.Sequential(
                nn.Unflatten(1, (1, 16)), nn.Conv1d(1, 4, 3, padding=1),
                nn.InstanceNorm1d(4), nn.Flatten(),
            )  # fmt: skip
        after = nn.BatchNorm1d(64) if norm == "batch" else nn.Identity()
        self.layers = nn.Sequential(
            first, after, nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
            nn.Linear(64, 4),
        )  # fmt: skip
        self.noise = noise

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        if self.noise == "global":
            # The single-device way: torch's generator, seeded alike on every
            # rank: the ranks draw the same noise for different samples.
            h = h + NOISE * torch.randn_like(h)
        elif self.noise == "per_sample":
            # --fix: the noise belongs to the sample, not to the rank
            h = h + NOISE * per_sample_noise(ids, h)
        return self.layers[1:](h)


def noise_kind(args) -> str:
    if not args.noise:
        return ""
    # --fix: the noise drawn per sample (Net.forward)
    return "per_sample" if args.fix else "global"


def build(dtype: torch.dtype, args) -> nn.Module:
    # Step 1 of the recipe: the same seed gives both the same initial weights.
    torch.manual_seed(args.seed)
    net = Net(noise_kind(args), args.norm).to(dtype)
    if args.fix and args.norm == "batch":
        # --fix: for the check only, BatchNorm on its running statistics in
        # both: each row normalised alone, whichever rank holds it
        for module in net.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()
    return net


def global_batch(step: int, size: int, seed: int, dtype: torch.dtype):
    """The step's B samples, the same on every rank: the same data order."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    # Drawn in float32 for both dtypes: float64 trains on the same samples.
    x = torch.randn(size, 16, generator=g).to(dtype)
    return x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()


def sample_ids(args, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """Each draw's own number: the seed, the pass over the data, the sample."""
    return (args.seed * 1_000_003 + epoch) * 1_000_003 + index


def data_set(args, dtype: torch.dtype) -> TensorDataset:
    # 8 global batches of samples, with their indices (for the noise's ids)
    x, y = global_batch(0, 8 * args.batch_size, args.seed, dtype)
    return TensorDataset(x, y, torch.arange(len(x)))


def stream_batches(args, dtype, rank: int, world_size: int, per_rank: int):
    """(x, y, ids) of each step: `rank`'s rows of each global batch."""
    for step in itertools.count(1):
        x, y = global_batch(step, per_rank * world_size, args.seed, dtype)
        # A stream: each step's samples are new, so the step is their pass.
        ids = sample_ids(args, step, torch.arange(len(x)))
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        yield x[rows], y[rows], ids[rows]


def rank_batches(args, dtype, rank: int, world_size: int, per_rank: int):
    """(x, y, ids) of each step: the rows the DDP run gives to `rank`."""
    if not args.shuffle:
        yield from stream_batches(args, dtype, rank, world_size, per_rank)
        return
    data = data_set(args, dtype)
    sampler = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(data, batch_size=per_rank, sampler=sampler)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            yield x, y, sample_ids(args, epoch, index)


def original_batches(args, dtype, world_size: int):
    """(x, y, ids) of each step: the B rows the original trains on."""
    if not args.shuffle:
        yield from stream_batches(args, dtype, 0, 1, args.batch_size)
    elif args.fix:
        # --fix: at each step, the rows every rank's DistributedSampler hands
        # out at that step, together: the DDP run's global batch
        share = args.batch_size // world_size
        ranks = range(world_size)
        parts = [
            rank_batches(args, dtype, r, world_size, share) for r in ranks
        ]
        for batches in zip(*parts, strict=True):
            x, y, ids = zip(*batches, strict=True)
            yield torch.cat(x), torch.cat(y), torch.cat(ids)
    else:
        # the original's own loader, shuffle=True from its seed
        data = data_set(args, dtype)
        g = torch.Generator().manual_seed(args.seed)
        loader = DataLoader(
            data, batch_size=args.batch_size, shuffle=True, generator=g
        )
        for epoch in itertools.count():
            for x, y, index in loader:
                yield x, y, sample_ids(args, epoch, index)


def train(model: nn.Module, args, batches, checkpoints) -> dict[int, list]:
    """Trains on `batches`, one a step; the weights at each checkpoint."""
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=0.9
        )
    weights = {}
    steps = itertools.islice(batches, args.steps)
    for step, (x, y, ids) in enumerate(steps, start=1):
        # The mean loss over these rows; DDP then averages the gradients over
        # the ranks: the mean over all B rows, as in the original.
        loss = F.cross_entropy(model(x, ids), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step in checkpoints:
            weights[step] = [p.detach().clone() for p in model.parameters()]
    return weights


def described(args) -> str:
    """The options that differ from the recipe's plain run, as key=value."""
    found = []
    if args.shuffle:
        found.append(f"original_order={'samplers' if args.fix else 'shuffle'}")
    if args.noise:
        found.append(f"noise={noise_kind(args)}")
    if args.norm:
        running = "_running" if args.fix and args.norm == "batch" else ""
        found.append(f"norm={args.norm}{running}")
    if args.optimizer != "sgd":
        found.append(f"optimizer={args.optimizer}")
    if args.lr != LR:
        found.append(f"lr={args.lr:g}")
    if args.bug:
        found.append(f"bug={args.bug}")
    return "".join(" " + item for item in found)


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:
        # python alone: a world of one on this machine, any free port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        os.environ.update(RANK="0", WORLD_SIZE="1")
    if "OMP_NUM_THREADS" not in os.environ:
        # Layers this small run fastest on one thread (torchrun sets it too
        # when it starts more than one process on the node).
        torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world_size:
        sys.exit(f"error: --batch-size must split into {world_size} ranks")
    share = args.batch_size // world_size
    if args.bug == "batch-per-rank":
        # The bug: each rank's loader kept the original's batch size, so the
        # global batch is N x B, and the original's B rows are rank 0's.
        share = args.batch_size
    checkpoints = sorted({1, min(10, args.steps), args.steps})
    for dtype in (torch.float32, torch.float64):
        mine = rank_batches(args, dtype, rank, world_size, share)
        ddp = train(DDP(build(dtype, args)), args, mine, checkpoints)
        if rank != 0:
            continue
        # Rank 0 also runs the original: one process, all B rows, no DDP.
        batches = original_batches(args, dtype, world_size)
        original = train(build(dtype, args), args, batches, checkpoints)
        for step in checkpoints:
            pairs = zip(ddp[step], original[step], strict=True)
            diff = max((p - q).abs().max().item() for p, q in pairs)
            log(
                f"equivalence ranks={world_size} batch={args.batch_size}"
                f" per_rank={share}{described(args)} dtype={str(dtype)[6:]}"
                f" step={step} max_abs_diff={diff:.3g}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
