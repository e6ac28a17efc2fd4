"""Beyond DDP: train a small model by hand and with DDP, then compare them."""

import argparse
import copy
import hashlib
import os
import sys

import torch
import torch.distributed as dist

# Imported before the group starts, so that destroy_process_group() releases
# it (part3_ddp/experiments/README.md says why); DDP would import it later.
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

FEATURES, CLASSES = 64, 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--width", type=int, default=256, help="hidden units")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parser.parse_args()
    if min(args.steps, args.batch_size, args.width, args.depth) < 1:
        parser.error("--steps, --batch-size, --width and --depth must be >= 1")
    return args


def log(message: str) -> None:
    # One write per line: lines of processes sharing a terminal stay whole.
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def start_group() -> tuple[int, int, torch.device]:
    # torchrun says who each process is; under plain python, a world of one
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # the group's GPU, named: NCCL would otherwise guess it
    gpu = local_rank if torch.cuda.is_available() else None
    dist.init_process_group(backend, device_id=gpu)
    cuda = f"cuda:{local_rank}"
    device = torch.device(cuda if torch.cuda.is_available() else "cpu")
    return dist.get_rank(), dist.get_world_size(), device


def build_model(args: argparse.Namespace) -> nn.Module:
    # A plain MLP: no BatchNorm, so DDP has no buffers to broadcast.
    layers, width = [], FEATURES
    for _ in range(args.depth):
        layers += [nn.Linear(width, args.width), nn.ReLU()]
        width = args.width
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def batch(args, step: int, rank: int, world_size: int, device) -> tuple:
    # The same global batch on every rank, drawn from the step's number; each
    # rank takes its own slice of it, as a DistributedSampler would.
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    size = world_size * args.batch_size
    images = torch.randn(size, FEATURES, generator=generator)
    # A rule to learn: the label is the largest of the first ten features.
    labels = images[:, :CLASSES].argmax(1)
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    return images[mine].to(device), labels[mine].to(device)


class Buckets:
    def __init__(self, model: nn.Module, bucket_mb: float):
        # by hand 2: fill from the last parameter: backward()'s order
        self.buckets = [[]]
        for param in reversed(list(model.parameters())):
            size = sum(p.nbytes for p in self.buckets[-1]) + param.nbytes
            if self.buckets[-1] and size > bucket_mb * 2**20:
                self.buckets.append([])
            self.buckets[-1].append(param)
        # by hand 3: autograd calls grad_ready(param) once param.grad is in,
        # while backward() goes on to the layers before
        self.bucket_of = {p: ps for ps in self.buckets for p in ps}
        self.ready, self.sent = set(), []
        hook = torch.Tensor.register_post_accumulate_grad_hook
        self.hooks = [hook(p, self.grad_ready) for p in self.bucket_of]

    def grad_ready(self, param: torch.Tensor) -> None:
        self.ready.add(param)
        params = self.bucket_of[param]
        if self.ready.issuperset(params):
            # by hand 3: the bucket is full: send it without waiting for the
            # sum (async_op=True), and let backward() go on meanwhile
            flat = torch.cat([p.grad.flatten() for p in params])
            work = dist.all_reduce(flat, async_op=True)
            self.sent.append((params, flat, work))

    def average(self) -> None:
        # by hand 3: before the step, wait for each bucket's sum
        if len(self.ready) < len(self.bucket_of):
            raise RuntimeError("a parameter got no gradient: see the README")
        for params, flat, work in self.sent:
            work.wait()
            flat /= dist.get_world_size()
            means = flat.split([p.numel() for p in params])
            for param, mean in zip(params, means, strict=True):
                param.grad.copy_(mean.view_as(param))
        self.ready, self.sent = set(), []


def train_ddp(args, model, rank, world_size, device) -> torch.optim.Optimizer:
    # The reference: DDP copies rank 0's weights to every rank, then averages
    # the gradients during backward().
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    for step in range(args.steps):
        images, labels = batch(args, step, rank, world_size, device)
        loss = F.cross_entropy(ddp(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return optimizer


def train_by_hand(args, model, rank, world_size, device):
    # by hand 1: every rank starts from rank 0's weights
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    # by hand 4: all weights as one flat vector, cut into world_size equal
    # shards (zeros pad the last one); this rank owns shard number `rank`
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    shard_size = -(-total // world_size)
    flat = torch.zeros(shard_size * world_size, device=device)
    torch.cat([p.detach().flatten() for p in params], out=flat[:total])
    mine = slice(rank * shard_size, (rank + 1) * shard_size)
    shard = flat[mine].clone().requires_grad_()
    # by hand 4: Adam steps this shard only: its moments are 1/world_size
    optimizer = torch.optim.Adam([shard], lr=args.lr)
    buckets = Buckets(model, args.bucket_mb)
    for step in range(args.steps):
        images, labels = batch(args, step, rank, world_size, device)
        loss = F.cross_entropy(model(images), labels)
        # by hand 4: the optimizer holds the shard, not the model's weights
        model.zero_grad(set_to_none=True)
        loss.backward()
        # by hand 3: the hooks sent the buckets in backward(): wait for them
        buckets.average()
        # by hand 4: this rank's slice of the mean gradient steps its shard
        grads = torch.zeros_like(flat)
        torch.cat([p.grad.flatten() for p in params], out=grads[:total])
        shard.grad = grads[mine]
        optimizer.step()
        # by hand 4: each rank sends its updated shard to all (all-gather):
        # every rank then holds all the new weights
        dist.all_gather_into_tensor(flat, shard.detach())
        new_weights = flat[:total].split(sizes)
        with torch.no_grad():
            for param, new in zip(params, new_weights, strict=True):
                param.copy_(new.view_as(param))
    return optimizer, loss.detach()


def fingerprint(model: nn.Module) -> str:
    # A hash of every weight's bytes: two models share it only if bit-equal.
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # What the optimizer keeps between steps: Adam's two moments per weight
    # (its step counters, 0-dimensional, left out).
    state = optimizer.state.values()
    return sum(t.nbytes for s in state for t in s.values() if t.dim())


def main(args: argparse.Namespace) -> None:
    rank, world_size, device = start_group()
    # Each rank starts from weights of its own: the broadcast must fix that.
    torch.manual_seed(args.seed + rank)
    by_hand = build_model(args).to(device)
    reference = copy.deepcopy(by_hand)
    by_hand_opt, loss = train_by_hand(args, by_hand, rank, world_size, device)
    ddp_opt = train_ddp(args, reference, rank, world_size, device)

    pairs = zip(by_hand.parameters(), reference.parameters(), strict=True)
    diff = torch.stack([(a - b).abs().max() for a, b in pairs]).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss)
    # Each rank's fingerprints and optimizer state, gathered on every rank.
    mine = fingerprint(by_hand), fingerprint(reference)
    mine += state_bytes(by_hand_opt), state_bytes(ddp_opt)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        params = sum(p.numel() for p in by_hand.parameters())
        log(f"model params={params} world_size={world_size} steps={args.steps}")
        log(f"by_hand sha={mine[0]} loss={loss.item() / world_size:.4f}")
        log(f"ddp sha={mine[1]}")
        in_sync = len({r[0] for r in ranks}) == len({r[1] for r in ranks}) == 1
        bit_equal = mine[0] == mine[1]
        log(f"compare max_abs_diff={diff.item():.3e} bit_equal={bit_equal}")
        log(f"compare ranks_in_sync={in_sync}")
        for r, (_, _, by_hand_bytes, ddp_bytes) in enumerate(ranks):
            ratio = by_hand_bytes / ddp_bytes
            log(
                f"optimizer_state rank={r} by_hand_bytes={by_hand_bytes}"
                f" ddp_bytes={ddp_bytes} ratio={ratio:.4f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
