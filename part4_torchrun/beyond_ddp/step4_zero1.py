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
    parser.add_argument("--model", choices=["mlp", "mixed"], default="mlp")
    parser.add_argument("--optimizer", default="Adam", help="torch.optim's")
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
    if args.model == "mixed":
        # What models people train hold: a frozen layer, a layer used twice
        # (one weight, two uses, as tied weights), BatchNorm and its buffers.
        frozen = nn.Linear(FEATURES, args.width).requires_grad_(False)
        twice = nn.Linear(args.width, args.width)
        norm = nn.BatchNorm1d(args.width)
        out = nn.Linear(args.width, CLASSES)
        return nn.Sequential(
            frozen, norm, nn.ReLU(), twice, nn.ReLU(), twice, out
        )
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


class ByHandDDP(nn.Module):
    """DDP's shape: wrap, train, call average_gradients() after backward()."""

    def __init__(self, module: nn.Module, bucket_mb: float):
        super().__init__()
        self.module = module
        # by hand 1: every rank starts from rank 0's parameters (frozen ones
        # too) and buffers, copied in place, as DDP does when it is built
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=0)
        # by hand 1: frozen parameters get no gradient: left out, as in DDP
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sync_buffers = True
        # by hand 2: fill from the last parameter: backward()'s order
        self.buckets = [[]]
        for param in reversed(self.params):
            size = sum(p.nbytes for p in self.buckets[-1]) + param.nbytes
            if self.buckets[-1] and size > bucket_mb * 2**20:
                self.buckets.append([])
            self.buckets[-1].append(param)
        # by hand 3: autograd calls grad_ready(param) once param.grad is in,
        # while backward() goes on to the layers before
        self.ready, self.sent = set(), []
        hook = torch.Tensor.register_post_accumulate_grad_hook
        self.hooks = [hook(p, self.grad_ready) for p in self.params]

    def forward(self, *inputs, **kwargs):
        # by hand 1: DDP's rule for buffers (BatchNorm's statistics): rank
        # 0's are copied to all at the start of the first forward and of
        # each forward that follows one with gradients enabled (training)
        if self.sync_buffers:
            for buffer in self.module.buffers():
                dist.broadcast(buffer, src=0)
        self.sync_buffers = torch.is_grad_enabled()
        return self.module(*inputs, **kwargs)

    def grad_ready(self, param: torch.Tensor) -> None:
        self.ready.add(param)
        # by hand 3: the buckets leave in their order, each once its last
        # gradient is in, so that every rank sends them in the same order
        while len(self.sent) < len(self.buckets):
            params = self.buckets[len(self.sent)]
            if not self.ready.issuperset(params):
                break
            # by hand 3: sent without waiting for the sum (async_op=True)
            flat = torch.cat([p.grad.flatten() for p in params])
            work = dist.all_reduce(flat, async_op=True)
            self.sent.append((params, flat, work))

    def average_gradients(self) -> None:
        # by hand 1: a parameter this rank did not use has no gradient:
        # zeros stand in, so that every rank sends the same tensors
        for param in self.params:
            if param not in self.ready:
                param.grad = torch.zeros_like(param)
                self.grad_ready(param)
        # by hand 3: before the step, wait for each bucket's sum
        for params, flat, work in self.sent:
            work.wait()
            flat /= dist.get_world_size()
            means = flat.split([p.numel() for p in params])
            for param, mean in zip(params, means, strict=True):
                param.grad.copy_(mean.view_as(param))
        self.ready, self.sent = set(), []


class ZeRO1(torch.optim.Optimizer):
    def __init__(self, params, optimizer_class: type, **settings):
        # by hand 4: the base class holds every parameter: its zero_grad()
        params = [p for p in params if p.requires_grad]
        super().__init__(params, settings)
        # by hand 4: whole tensors, the largest first, to the rank owning least
        self.owner, owned = {}, [0] * dist.get_world_size()
        for param in sorted(params, key=torch.numel, reverse=True):
            self.owner[param] = owned.index(min(owned))
            owned[self.owner[param]] += param.numel()
        # by hand 4: it steps, and keeps the state of, this rank's alone
        mine = [p for p in params if self.owner[p] == dist.get_rank()]
        self.optimizer = optimizer_class(mine, **settings)

    def step(self) -> None:
        self.optimizer.step()
        # by hand 4: each parameter's owner sends its new weights to all
        for param, owner in self.owner.items():
            dist.broadcast(param.detach(), src=owner)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()


def optimizer_class(args: argparse.Namespace) -> tuple[type, dict]:
    # Any torch.optim class and its settings; SGD with momentum, for a state.
    momentum = dict(momentum=0.9) if args.optimizer == "SGD" else {}
    return getattr(torch.optim, args.optimizer), dict(lr=args.lr, **momentum)


def train_ddp(args, model, rank, world_size, device) -> tuple:
    # The reference: DDP copies rank 0's weights to every rank, then averages
    # the gradients during backward().
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
    kind, settings = optimizer_class(args)
    optimizer = kind(ddp.parameters(), **settings)
    for step in range(args.steps):
        images, labels = batch(args, step, rank, world_size, device)
        loss = F.cross_entropy(ddp(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return ddp, optimizer


def train_by_hand(args, model, rank, world_size, device):
    # by hand 1: wrapped as DDP wraps it, trained as DDP is trained
    model = ByHandDDP(model, args.bucket_mb)
    kind, settings = optimizer_class(args)
    optimizer = ZeRO1(model.parameters(), kind, **settings)
    for step in range(args.steps):
        images, labels = batch(args, step, rank, world_size, device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # by hand 1: after backward(), every gradient's mean over the ranks
        model.average_gradients()
        optimizer.step()
    return model, optimizer, loss.detach()


def tensors(model: nn.Module) -> list[torch.Tensor]:
    # What training changes: the weights, then the buffers (BatchNorm's).
    return [t.detach() for t in [*model.parameters(), *model.buffers()]]


def fingerprint(model: nn.Module) -> str:
    # A hash of every tensor's bytes: two models share it only if bit-equal.
    digest = hashlib.sha256()
    for tensor in tensors(model):
        digest.update(tensor.cpu().numpy().tobytes())
    return digest.hexdigest()[:12]


def message_bytes(model: nn.Module) -> str:
    # The bytes of each message of a step, in the order sent: DDP's buckets
    # (a private call: DDP has no public one), or the wrapper's messages.
    if isinstance(model, DDP):
        buckets = model.reducer._get_zeros_like_grad_buckets()
        return ",".join(str(b.buffer().nbytes) for b in buckets)
    sizes = [sum(p.nbytes for p in params) for params in model.buckets]
    return ",".join(map(str, sizes))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # What the optimizer keeps between steps, as its state_dict() holds it:
    # Adam's two moments per weight (0-dimensional step counters left out).
    state = optimizer.state_dict()["state"].values()
    kept = [t for s in state for t in s.values() if torch.is_tensor(t)]
    return sum(t.nbytes for t in kept if t.dim())


def main(args: argparse.Namespace) -> None:
    rank, world_size, device = start_group()
    # Each rank starts from weights of its own: the broadcast must fix that.
    torch.manual_seed(args.seed + rank)
    model = build_model(args).to(device)
    reference = copy.deepcopy(model)
    by_hand, by_hand_opt, loss = train_by_hand(
        args, model, rank, world_size, device
    )
    ddp, ddp_opt = train_ddp(args, reference, rank, world_size, device)
    # A forward in eval mode, as a test would run: it starts by copying rank
    # 0's buffers, in DDP as by hand, so that every rank holds the same.
    images, _ = batch(args, args.steps, rank, world_size, device)
    with torch.no_grad():
        for wrapped in (by_hand, ddp):
            wrapped.eval()(images)
    pairs = zip(tensors(model), tensors(reference), strict=True)
    diff = torch.stack([(a - b).abs().max().double() for a, b in pairs]).max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss)
    # Each rank's fingerprints and optimizer state, gathered on every rank.
    mine = fingerprint(model), fingerprint(reference)
    mine += state_bytes(by_hand_opt), state_bytes(ddp_opt)
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        log(
            f"model params={params} world_size={world_size} steps={args.steps}"
        )
        sizes = message_bytes(by_hand), message_bytes(ddp)
        log(f"buckets by_hand={sizes[0]} ddp={sizes[1]}")
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
