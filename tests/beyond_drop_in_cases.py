"""The beyond-DDP chapter's drop-ins against torch's own classes, case by case, in one launch.

    torchrun --standalone --nproc_per_node=2 tests/beyond_drop_in_cases.py [--classes steps]

Each case trains a small model twice from the same start, through the chapter's class and
through torch's (DistributedDataParallel, ZeroRedundancyOptimizer), in the way a training loop
uses them, and rank 0 prints one line per case:

    case name=NAME against=CLASS weight_diff=D grad_diff=G [more=...]
    case name=NAME against=CLASS error=TYPE detail=...

weight_diff is the largest difference between the two models' weights after the case (on any
rank), grad_diff between their gradients after the last backward(). `--classes by_hand` (the
default) takes `by_hand.py`'s drop-ins; `--classes steps` the classes of steps 3 and 4, which
are not drop-ins: the cases show what they miss. Run under tests/run_in_turn.py by
tests/test_beyond_ddp.py; not part of the course.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import itertools
import os
import sys
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

BEYOND = Path(__file__).resolve().parent.parent / "part4_torchrun" / "beyond_ddp"
STEPS = 6  # optimizer steps per case
# The bucket case: 8 layers of 16 x 16, 1,088 bytes each (weight and bias); a cap of 2,200
# bytes holds two layers, four tensors: four buckets of four tensors, DDP's and the wrapper's.
BUCKET_LAYERS, BUCKET_CAP_MB = 8, 2200 / 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", choices=["by_hand", "steps"], default="by_hand")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def classes(which: str) -> tuple:
    """The wrapper, as a function of (module, bucket MB or None), and the optimizer class."""
    sys.path.insert(0, str(BEYOND))
    try:
        if which == "by_hand":
            module = importlib.import_module("by_hand")
            wrapper, zero1 = module.ByHandDDP, module.ZeRO1
        else:
            wrapper = importlib.import_module("step3_hooks").ByHandDDP
            zero1 = importlib.import_module("step4_zero1").ZeRO1
    finally:
        sys.path.pop(0)

    def wrap(module: nn.Module, bucket_mb: float | None) -> nn.Module:
        # the drop-in in DDP(module)'s place; step 3's class needs its bucket size (DDP's 25 MB)
        if bucket_mb is None:
            return wrapper(module) if which == "by_hand" else wrapper(module, 25)
        return wrapper(module, bucket_mb)

    return wrap, zero1


def stable(*words) -> int:
    """A seed from words, the same in every process (hash() of a string is not)."""
    return zlib.crc32(repr(words).encode())


class Net(nn.Module):
    """A small MLP whose forward takes a keyword argument."""

    def __init__(self, layers: int = 3, width: int = 32) -> None:
        super().__init__()
        sizes = [16] + [width] * (layers - 1) + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x) * scale


def data(case: str, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a case's step (and micro-batch)."""
    seed = stable(case, step, micro, dist.get_rank())
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def loss_of(model: nn.Module, case: str, step: int, micro: int = 0, **kwargs) -> torch.Tensor:
    x, y = data(case, step, micro)
    return F.cross_entropy(model(x, **kwargs), y)


def finish(model: nn.Module) -> None:
    # Steps 3's wrapper needs its call after backward(); the drop-in does it alone (a no-op).
    if hasattr(model, "average_gradients"):
        model.average_gradients()


def largest(values: list[torch.Tensor]) -> float:
    """The largest of per-rank numbers, over the ranks."""
    top = (
        torch.stack([v.double() for v in values]).max()
        if values
        else torch.zeros((), dtype=torch.double)
    )
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return top.item()


def differences(a: nn.Module, b: nn.Module) -> dict[str, float]:
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    weights = [(p - q).abs().max() for p, q in pairs]
    grads = [
        (p.grad - q.grad).abs().max() for p, q in pairs if p.grad is not None and q.grad is not None
    ]
    missing = sum((p.grad is None) != (q.grad is None) for p, q in pairs)
    result = {"weight_diff": largest(weights), "grad_diff": largest(grads)}
    if missing:
        result["grads_missing"] = missing
    return result


def start(case: str, seed: int, **net) -> tuple[nn.Module, nn.Module]:
    """Two equal models; each rank starts from weights of its own (the wrappers broadcast)."""
    torch.manual_seed(stable(case, seed, dist.get_rank()))
    model = Net(**net)
    return model, copy.deepcopy(model)


# ---- ByHandDDP against DistributedDataParallel --------------------------------------------------


def train_wrapped(model: nn.Module, case: str) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if case == "no_sync":
            # two micro-batches: the first one's gradients kept on each rank, sent with the second
            with model.no_sync():
                loss_of(model, case, step, 0).backward()
            loss_of(model, case, step, 1).backward()
        elif case == "accumulate":
            # two micro-batches, each backward() synced
            loss_of(model, case, step, 0).backward()
            loss_of(model, case, step, 1).backward()
        elif case == "stray":
            # a backward() whose gradients are thrown away, then the step's own
            loss_of(model, case, step, 9).backward()
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, case, step, 0).backward()
        elif case == "keywords":
            loss_of(model, case, step, scale=0.5).backward()
        else:
            loss_of(model, case, step).backward()
        finish(model)
        if step < STEPS - 1:
            optimizer.step()


def ddp_case(case: str, wrap, seed: int) -> dict:
    if case == "buckets":
        mine, theirs = start(case, seed, layers=BUCKET_LAYERS, width=16)
        wrapped = wrap(mine, BUCKET_CAP_MB)
        reference = DDP(theirs, bucket_cap_mb=BUCKET_CAP_MB)
    else:
        mine, theirs = start(case, seed)
        wrapped, reference = wrap(mine, None), DDP(theirs)
    for model in (wrapped, reference):
        train_wrapped(model, case)
    result = differences(mine, theirs)
    if case == "buckets":
        result["tensors_per_bucket"] = ",".join(str(len(b)) for b in wrapped.buckets)
        sizes = [b.buffer().numel() for b in reference.reducer._get_zeros_like_grad_buckets()]
        result["ddp_bucket_elements"] = ",".join(map(str, sizes))
        result["by_hand_bucket_elements"] = ",".join(
            str(sum(p.numel() for p in b)) for b in wrapped.buckets
        )
    return result


# ---- ZeRO1 against ZeroRedundancyOptimizer -----------------------------------------------------


def build(zero1: type | None, model: nn.Module, case: str, params) -> torch.optim.Optimizer:
    """The case's optimizer: the chapter's ZeRO1 or, with zero1=None, torch's."""
    kind, settings = torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
    if case == "groups":
        kind, settings = torch.optim.AdamW, dict(lr=1e-3)
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        params = [
            {"params": weights, "lr": 1e-2, "weight_decay": 0.1},
            {"params": biases, "lr": 3e-3, "weight_decay": 0.0},
        ]
    elif case == "save_resume":
        kind, settings = torch.optim.Adam, dict(lr=1e-2)
    if zero1 is None:
        return ZeroRedundancyOptimizer(params, optimizer_class=kind, **settings)
    return zero1(params, kind, **settings)


def zero_case(case: str, zero1: type | None, model: nn.Module, path: str) -> list[float]:
    """Trains DDP(model) with the case's optimizer; returns the closure's losses, if any."""
    wrapped = DDP(model)
    params = list(wrapped.parameters())
    if case == "add_param_group":
        # the last layer joins after two steps, with its own lr
        *early, last = wrapped.module.layers
        params = [p for layer in early for p in layer.parameters()]
    optimizer = build(zero1, wrapped.module, case, params)
    scheduler = None
    if case == "steplr":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    elif case == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    losses = []
    for step in range(STEPS):
        if case == "add_param_group" and step == 2:
            optimizer.add_param_group({"params": list(last.parameters()), "lr": 0.05})
        if case == "save_resume" and step == STEPS // 2:
            optimizer = save_and_load(optimizer, zero1, wrapped.module, case, path)
        if case == "closure":

            def closure(optimizer=optimizer, step=step) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_of(wrapped, case, step)
                loss.backward()
                return loss

            losses.append(optimizer.step(closure).detach())
            continue
        optimizer.zero_grad(set_to_none=True)
        loss_of(wrapped, case, step).backward()
        optimizer.step()
        if scheduler:
            scheduler.step()
    return losses


def save_and_load(optimizer, zero1, model: nn.Module, case: str, path: str):
    """Rank 0 saves the consolidated state; a new optimizer on every rank loads it."""
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save(optimizer.state_dict(), path)
    dist.barrier()
    fresh = build(zero1, model, case, list(model.parameters()))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    return fresh


def consolidated_difference(zero1: type, seed: int, path: str) -> float:
    """After 3 Adam steps, the whole state on rank 0, by hand and torch's: the largest
    difference of any tensor in it (inf if they are not the same parameters and keys)."""
    states = []
    mine, theirs = start("consolidated", seed)
    for kind, model in ((zero1, mine), (None, theirs)):
        wrapped = DDP(model)
        optimizer = build(kind, model, "save_resume", list(wrapped.parameters()))
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss_of(wrapped, "consolidated", step).backward()
            optimizer.step()
        optimizer.consolidate_state_dict(to=0)
        states.append(optimizer.state_dict() if dist.get_rank() == 0 else None)
    gap = torch.zeros((), dtype=torch.double)
    if dist.get_rank() == 0:
        a, b = (s["state"] for s in states)
        if a.keys() != b.keys() or any(a[k].keys() != b[k].keys() for k in a):
            gap.fill_(float("inf"))
        else:
            for k in a:
                for name, tensor in a[k].items():
                    other = b[k][name].to(tensor.device)
                    gap = torch.maximum(gap, (tensor - other).abs().max().double())
        groups = [[g["lr"] for g in s["param_groups"]] for s in states]
        if groups[0] != groups[1]:
            gap.fill_(float("inf"))
    dist.broadcast(gap, src=0)
    return gap.item()


def refusal(zero1: type) -> dict:
    """state_dict() before consolidate_state_dict(): refused in one line, as torch's is, rather
    than this rank's shard alone, saved as if it were the whole."""
    optimizer = zero1(Net().parameters(), torch.optim.SGD, lr=0.1)
    try:
        optimizer.state_dict()
    except RuntimeError as error:
        return {"refused": len(str(error).splitlines()) == 1}
    return {"refused": False}


def run_case(name: str, against: str, case) -> None:
    try:
        fields = case()
        error = None
    except Exception as exc:  # today's classes fail in several ways: each is the case's result
        fields, error = {}, exc
    # every rank must have done the same: a rank that failed alone would leave the others in a
    # collective
    failed = torch.tensor(error is not None, dtype=torch.int)
    dist.all_reduce(failed)
    if dist.get_rank() == 0:
        words = [f"case name={name} against={against}"]
        words += [f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()]
        if error is not None:
            detail = str(error).splitlines()[0] if str(error) else ""
            words.append(f"error={type(error).__name__} detail={detail}")
        elif failed.item():
            words.append("error=on_another_rank")
        sys.stdout.write(" ".join(words) + "\n")
        sys.stdout.flush()


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:
        sys.exit("error: run it under torchrun (2 ranks)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    wrap, zero1 = classes(args.classes)
    folder = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    shared = [folder]
    dist.broadcast_object_list(shared, src=0)
    path = os.path.join(shared[0], "zero1.pt")
    for case in ("no_sync", "accumulate", "stray", "keywords", "buckets"):
        run_case(case, "DistributedDataParallel", lambda c=case: ddp_case(c, wrap, args.seed))
    for case in ("steplr", "cosine", "groups", "add_param_group", "closure", "save_resume"):

        def compare(c: str = case) -> dict:
            mine, theirs = start(c, args.seed)
            # both from the same start: DDP copies rank 0's weights into each
            losses = [zero_case(c, zero1, mine, path), zero_case(c, None, theirs, path)]
            result = differences(mine, theirs)
            if c == "closure":
                gaps = [(a - b).abs() for a, b in zip(*losses, strict=True)]
                result["loss_diff"] = largest(gaps)
            return result

        run_case(case, "ZeroRedundancyOptimizer", compare)
    run_case("unconsolidated", "ZeroRedundancyOptimizer", lambda: refusal(zero1))
    run_case(
        "consolidated",
        "ZeroRedundancyOptimizer",
        lambda: {"state_diff": consolidated_difference(zero1, args.seed, path)},
    )
    dist.barrier()
    if dist.get_rank() == 0:
        for leftover in Path(shared[0]).iterdir():
            leftover.unlink()
        Path(shared[0]).rmdir()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
