"""One check per claim (claims.py lists them): each returns a Verdict, the evidence when the claim
holds, the cause and what to do when it fails; it raises NotChecked when nothing showed it."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from conftest import checker
from torch.nn.parallel import DistributedDataParallel

from .causes import crash_cause, unordered_reads
from .run import FIGURES, LR, Training, threads_per_task

# After 3 epochs: 96.5% here; the README's 5-epoch run reaches 97.5%.
MIN_TEST_ACC = 95.0
# Relative distance (|a - b| / |b|) under which two gradients count as equal: float32 sums
# taken in another order differ by ~1e-7 here; a mistake moves them by 1e-2 or more.
GRADIENT_TOLERANCE = 1e-4


class NotChecked(Exception):
    """Nothing showed the claim either way: what would show it is missing."""


@dataclass
class Verdict:
    # None: the claim holds
    problem: str | None
    evidence: str = ""
    # the step a failure points at when it is not the claim's own (a crash's line)
    blame: str | None = None
    # for a failure: whether it accounts for a crash, given the crash's `Type: message` (a
    # missing DDP wrap for an AttributeError on `model.module`): then it leads the report
    explains: Callable[[str], bool] | None = None


def holds(evidence: str) -> Verdict:
    # A claim holds on evidence; without any, it is not checked.
    assert evidence, "a claim that holds says what shows it"
    return Verdict(None, evidence)


def fails(
    problem: str, blame: str | None = None, explains: Callable[[str], bool] | None = None
) -> Verdict:
    return Verdict(problem, blame=blame, explains=explains)


def no_process_group(what: str) -> bool:
    """A crash that a missing init_process_group() explains."""
    return "process group" in what.lower() or "init_process_group" in what


def no_ddp_wrapper(what: str) -> bool:
    """A crash that a missing DDP wrap explains: an AttributeError on the model for what only
    the wrapper has (model.module, model.no_sync(), ...)."""
    found = re.search(r"AttributeError: '\w+' object has no attribute '(\w+)'", what)
    if not found:
        return False
    name = found.group(1)
    own = hasattr(DistributedDataParallel, name) and not hasattr(torch.nn.Module, name)
    return name == "module" or own


def unless_failed(t: Training, problem: str) -> Verdict:
    """A failure, or, when the job ended early, a claim the job never got to show."""
    if t.failed:
        raise NotChecked("the job ended first")
    return fails(problem)


def count(n: int) -> str:
    return f"{n:,}"


def samples(n: int) -> str:
    return f"{count(n)} sample" + ("" if n == 1 else "s")


def per_rank(values: dict[int, object]) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in sorted(values.items()))


def check_run(t: Training) -> Verdict:
    if not t.failed:
        return holds(f"exit 0, {t.world} ranks, {t.seconds:.0f} s")
    return fails(*crash_cause(t))


def check_group(t: Training) -> Verdict:
    joined = sorted((e["rank"], e["world_size"], e["backend"]) for e in t.probe.events("init"))
    if not joined:
        return fails(
            "no process called dist.init_process_group(): the processes trained alone,"
            " each on everything",
            explains=no_process_group,
        )
    if joined != [(rank, t.world, "gloo") for rank in range(t.world)]:
        return fails(
            f"(rank, world size, backend) of the processes: {joined};"
            f" expected ranks 0..{t.world - 1} of {t.world} on gloo"
        )
    wrong = sorted(task for task, pid in t.tasks.items() if t.probe.ranks().get(task) != pid)
    if wrong:
        return fails(f"tasks {wrong} did not get the rank srun gave them: read SLURM_PROCID")
    left = sorted(e["rank"] for e in t.probe.events("final"))
    if left != list(range(t.world)):
        some = f"only ranks {left}" if left else "no rank"
        return unless_failed(
            t, f"{some} called dist.destroy_process_group() at the end; every rank should"
        )
    given = "the launcher's" if t.tasks or t.target.launcher == "torchrun" else "its"
    return holds(f"ranks 0..{t.world - 1} of {t.world} on gloo, each {given} rank; all left")


def check_threads(t: Training) -> Verdict:
    # The OMP_NUM_THREADS the launch set: torchrun's 1, or the job script's share.
    expected = 1 if t.target.launcher == "torchrun" else threads_per_task(t.world)
    threads = {e["rank"]: e["threads"] for e in t.probe.events("final")}
    if not threads:
        raise NotChecked("recorded at dist.destroy_process_group(), which no rank reached")
    if any(n != expected for n in threads.values()):
        return fails(
            f"threads per rank {threads}: OMP_NUM_THREADS={expected} was set for {t.world}"
            f" processes on {len(os.sched_getaffinity(0))} cores; an explicit OMP_NUM_THREADS"
            " should win"
        )
    return holds(f"OMP_NUM_THREADS={expected}: {per_rank(threads)}")


def check_printing(t: Training) -> Verdict:
    lines = len(t.epoch_lines)
    if lines > t.epochs:
        return fails(f"{lines} epoch lines for {t.epochs} epochs: only rank 0 should print them")
    if lines < t.epochs:
        raise NotChecked(f"{lines} epoch lines for {t.epochs} epochs")
    return holds(f"{lines} epoch lines for {t.epochs} epochs")


def gradient(
    net: torch.nn.Module, params: list[torch.Tensor], parts: list[dict], training: bool = True
) -> torch.Tensor:
    """The gradient of the mean cross-entropy over the samples of `parts` together (each
    {inputs, labels, rng}), from the weights `params`: one process's gradient on that batch.
    Each part's forward runs with its rank's random state, so dropout drops what it dropped on
    that rank, in the mode the step ran in (train, else eval)."""
    with torch.no_grad():
        for parameter, value in zip(net.parameters(), params, strict=True):
            parameter.copy_(value)
    net.train(training)
    net.zero_grad()
    samples = sum(len(part["labels"]) for part in parts)
    with torch.random.fork_rng():
        loss = 0
        for part in parts:
            torch.set_rng_state(part["rng"])
            loss = loss + F.cross_entropy(net(part["inputs"]), part["labels"], reduction="sum")
        (loss / samples).backward()
    return flat([torch.zeros_like(p) if p.grad is None else p.grad for p in net.parameters()])


def parts_of(step: dict) -> list[dict]:
    """The batches whose gradients a first step applied: one per backward() before it (the
    probe's `forwards`), else the last forward's."""
    return step.get("forwards") or [step]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def flat_grads(step: dict) -> torch.Tensor:
    """The step's gradients as one vector; a parameter without one counts as zeros."""
    pairs = zip(step["params"], step["grads"], strict=True)
    return flat([torch.zeros_like(p) if g is None else g for p, g in pairs])


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def first_of_each(t: Training) -> dict[int, dict]:
    """rank -> its first optimizer step (the probe's step record), for the ranks that took one."""
    found = {}
    for rank, pid in sorted(t.pids.items()):
        steps = t.steps(pid)
        if steps:
            found[rank] = steps[0]
    return found


def check_wrap(t: Training) -> Verdict:
    """Each rank wraps its model in DDP once: DDP(model), not DDP(DDP(model))."""
    wraps: dict[int, list[str]] = {}
    for e in t.probe.events("wrap"):
        rank = t.rank_of(e["pid"])
        if rank is not None:
            wraps.setdefault(rank, []).append(e["module"])
    if not wraps:
        raise NotChecked("no rank made a DistributedDataParallel (step 2's gradient claim)")
    for rank, modules in sorted(wraps.items()):
        if "DistributedDataParallel" in modules:
            return fails(
                f"rank {rank} wrapped its model twice, DDP(DDP(model)): {len(modules)} DDP"
                f" wraps, the outer one of a DistributedDataParallel. Wrap the bare model once,"
                " model = DDP(model, device_ids=ids); model.module is then the bare model"
            )
    return holds(f"{per_rank({r: f'DDP({m[0]})' for r, m in wraps.items()})}: one wrap each")


def erased(t: Training) -> str | None:
    """Gradients that backward() left and the optimizer's step no longer found: a zero_grad()
    between backward() and step(); None when no step shows it."""
    for rank, pid in sorted(t.pids.items()):
        found = t.steps(pid)
        # (an optimizer on another model's parameters finds none either: check_optimizer's)
        gone = [s for s in found if s.get("left") and not s.get("nonzero") and not held_apart(s)]
        if gone:
            s = gone[0]
            return (
                f"the gradients were erased between backward() and step(): at {len(gone)} of"
                f" rank {rank}'s {len(found)} optimizer steps, backward() left {s['left']}"
                " non-zero gradients and step() found none, so no step moved the weights."
                " Call optimizer.zero_grad() before backward() (or after step()), never"
                " between them"
            )
    return None


def unequal_steps(t: Training) -> str | None:
    """Ranks that took different numbers of optimizer steps (optimizer.step() on some ranks
    only); None when every rank took as many, or the job ended early."""
    if t.failed:
        return None
    taken = {rank: len(t.steps(pid)) for rank, pid in sorted(t.pids.items())}
    if len(set(taken.values())) <= 1 and len(taken) == t.world:
        return None
    most = max(taken.values(), default=0)
    behind = [rank for rank, n in taken.items() if n < most]
    return (
        f"the ranks took different numbers of optimizer steps ({per_rank(taken)}): ranks"
        f" {behind} skipped optimizer.step(), so their replicas stopped training while DDP"
        " went on averaging their gradients. Call optimizer.step() on every rank, outside"
        " `if rank == 0:`"
    )


def check_optimizer(t: Training) -> Verdict:
    """The optimizer steps the parameters of the model that computes the loss: it holds every
    one that backward() reaches, they have gradients at its step, and its steps change them."""
    firsts = first_of_each(t)
    if not firsts:
        raise NotChecked("no rank took an optimizer step")
    if erased(t):
        # the optimizer is the right one; the steps claim names what emptied its gradients
        raise NotChecked("the gradients were erased before the step (see the steps claim)")
    skipped = unequal_steps(t)
    if skipped:
        return fails(skipped)
    advice = (
        "Build the optimizer from the model you train, after DDP wraps it:"
        " torch.optim.Adadelta(model.parameters(), lr=args.lr)"
    )
    for rank, step in firsts.items():
        held, graded = step["params"], step["graded"]
        if step["model"]:
            name, trained, mine = step["model"]
            if mine < trained:
                some = "none" if not mine else f"only {mine}"
                got = "none of them" if not graded else f"{graded} of them"
                return fails(
                    f"rank {rank}'s optimizer holds {some} of the {trained} parameters of the"
                    f" {name} whose loss backward() reached before its first step, and"
                    f" {got} got a gradient: it was built on another model's parameters (a model"
                    " made before the one DDP wraps?), so what it steps is not what computes"
                    f" the loss. {advice}"
                )
        if not graded:
            return fails(
                f"none of the {held} parameters rank {rank}'s optimizer holds had a gradient at"
                f" its first step: backward() reached other parameters, and its steps change"
                f" nothing. {advice}"
            )
        if step["changed"] == 0:
            return fails(
                f"rank {rank}'s first optimizer step changed none of its {held} parameters"
                f" (lr={step['lr']}): a step must move the weights"
            )
    # Over the whole training: the parameters the optimizer holds moved.
    start, end = t.first_steps(), t.params()
    for rank in sorted(set(start) & set(end)):
        if all(map(torch.equal, start[rank]["params"], end[rank])):
            return fails(
                f"rank {rank}'s optimizer ended training with the parameters it started from:"
                f" nothing trained. {advice}"
            )
    step = firsts[min(firsts)]
    model = f"all {step['model'][1]} parameters of the {step['model'][0]} that computes the loss"
    held = model if step["model"] else f"{step['params']} parameters"
    changed = f", its first step changed {step['changed']}" if step["changed"] else ""
    moved = "; they moved over training" if end else ""
    return holds(
        f"rank {min(firsts)}'s optimizer holds {held}; {step['graded']} had a gradient"
        f"{changed}{moved} (the same on all {t.world} ranks)"
    )


def accumulated(t: Training, n: int) -> str | None:
    """Whether the first step applied the sum ("summed") or the mean ("averaged") of the
    gradients of its n batches (the probe's first step: one part per backward()); None when
    neither, or when the records do not show it."""
    steps = t.first_steps()
    ranks = sorted(steps)
    if len(ranks) < t.world or any(len(parts_of(steps[r])) != n for r in ranks):
        return None
    net = t.module.Net()
    params = steps[ranks[0]]["params"]
    total = sum(gradient(net, params, [parts_of(steps[r])[k] for r in ranks]) for k in range(n))
    grads = flat_grads(steps[ranks[0]])
    if distance(grads, total) < GRADIENT_TOLERANCE:
        return "summed"
    if distance(grads, total / n) < GRADIENT_TOLERANCE:
        return "averaged"
    return None


def held_apart(step: dict) -> bool:
    """Whether the optimizer that took the step lacks parameters of the model that computed
    the loss before it."""
    return bool(step["model"]) and step["model"][2] < step["model"][1]


def check_steps(t: Training) -> Verdict:
    """Every optimizer step, in every epoch, is one process's step on one batch: one forward
    and one backward() since the previous step, the model in train mode."""
    steps = {rank: t.steps(pid) for rank, pid in sorted(t.pids.items())}
    steps = {rank: found for rank, found in steps.items() if found}
    if not steps:
        raise NotChecked("no rank took an optimizer step")
    cause = erased(t) or unequal_steps(t)
    if cause:
        return fails(cause)
    for rank, found in steps.items():
        many = [s for s in found if s["backwards"] > 1]
        if many:
            n = found[0]["backwards"] if found[0]["backwards"] > 1 else many[0]["backwards"]
            example = next(s for s in many if s["backwards"] == n)
            sizes = "+".join(map(str, example["samples"]))
            said = f"rank {rank} called backward() {n} times before {len(many)} of its"
            said += f" {len(found)} optimizer steps ({sizes} samples)"
            how = accumulated(t, n)
            if how == "averaged":
                return fails(
                    f"{n} batches per optimizer step, their gradients averaged: {said}, each loss"
                    f" divided by {n}: every step is on {n} x --batch-size samples per rank."
                    " --batch-size is the batch of a step: zero_grad(), backward() and step()"
                    " once per batch"
                )
            return fails(
                f"{n} batches' gradients summed per step: {said}, and .grad adds up what each"
                f" backward() computes, {n} times one batch's mean gradient. One step per batch:"
                " zero_grad(), backward() and step() for every batch"
            )
        idle = [s for s in found if s["backwards"] == 0]
        if idle:
            return fails(
                f"rank {rank} took {len(idle)} of its {len(found)} optimizer steps with no"
                " backward() since its previous step: it applied old gradients again. One"
                " backward() per step"
            )
        # (gradients of a model that the optimizer does not hold: check_optimizer's cause)
        stale = [s for s in found if s.get("leftover") and not held_apart(s)]
        if stale:
            return fails(
                f"earlier batches' gradients summed into later steps: at {len(stale)} of rank"
                f" {rank}'s {len(found)} optimizer steps, backward() began with gradients still"
                " in .grad, and backward() adds to them. Call optimizer.zero_grad() before each"
                " backward()"
            )
    for rank, found in steps.items():
        off = [s for s in found if s["train"] is False]
        if off:
            pid = t.pids[rank]
            epochs = sorted({e + 1 for e in (t.epoch_of(pid, s) for s in off) if e is not None})
            since = f" (in epoch{'s' * (len(epochs) > 1)} {', '.join(map(str, epochs))})"
            since = since if epochs else ""
            return fails(
                f"the model was in eval mode at {len(off)} of rank {rank}'s {len(found)}"
                f" optimizer steps{since}: dropout was off while it trained. model.eval() lasts"
                " until model.train(): call model.train() at the start of every epoch's"
                " training, after each evaluation"
            )
    rank, found = next(iter(steps.items()))
    pid = t.pids[rank]
    per_epoch: dict[int, int] = {}
    for s in found:
        epoch = t.epoch_of(pid, s)
        if epoch is not None:
            per_epoch[epoch + 1] = per_epoch.get(epoch + 1, 0) + 1
    told = ", ".join(f"{n} in epoch {e}" for e, n in sorted(per_epoch.items()))
    if len(steps) < t.world:
        raise NotChecked(f"only ranks {sorted(steps)} of {t.world} took a step: the job ended")
    return holds(
        f"rank {rank}: {len(found)} optimizer steps ({told or 'outside the training loader'}),"
        f" each after one backward() of one batch, in train mode; the same on all {len(steps)}"
        " ranks"
    )


def check_lr(t: Training) -> Verdict:
    """Every rank steps with the same learning rate at every step: a schedule that moves on
    some ranks only (scheduler.step() inside `if rank == 0:`) makes the replicas part."""
    rates = {rank: [s["lr"] for s in t.steps(pid)] for rank, pid in sorted(t.pids.items())}
    rates = {rank: got for rank, got in rates.items() if got}
    if len(rates) < t.world:
        raise NotChecked(f"only ranks {sorted(rates)} of {t.world} took a step")
    for k in range(min(map(len, rates.values()))):
        at = {rank: got[k] for rank, got in rates.items()}
        if len(set(at.values())) > 1:
            epochs = {r: t.epoch_of(t.pids[r], t.steps(t.pids[r])[k]) for r in rates}
            epoch = next((e + 1 for e in epochs.values() if e is not None), None)
            during = f" (epoch {epoch})" if epoch else ""
            return fails(
                f"the ranks stepped with different learning rates at optimizer step {k + 1}"
                f"{during}: {per_rank({r: f'lr={v:g}' for r, v in at.items()})}: the schedule"
                " moved on some ranks only, and their replicas parted. Call scheduler.step()"
                " (or set the lr) on every rank, outside `if rank == 0:`"
            )
    first = next(iter(rates.values()))
    changes = sorted(set(first), reverse=True)
    told = ", ".join(f"{v:g}" for v in changes[:4]) + (", ..." if len(changes) > 4 else "")
    return holds(f"at each of the {len(first)} steps the same on all {t.world} ranks ({told})")


def check_gradient(t: Training) -> Verdict:
    """One optimizer step on W ranks is one process's step on their batches together: the
    gradient it applies, on every rank, is the gradient of the mean loss over the global
    batch (DDP all-reduces the gradients and divides by the world size). Where a step summed
    several batches (check_steps fails it), the sum of such gradients, one per batch."""
    steps = t.first_steps()
    if len(steps) < t.world:
        raise NotChecked(f"ranks {sorted(set(range(t.world)) - set(steps))} took no step")
    parts = {r: parts_of(steps[r]) for r in sorted(steps)}
    if any(p["labels"] is None or p["inputs"] is None for got in parts.values() for p in got):
        raise NotChecked("the first step's inputs or labels were not seen")
    if all(g is None for s in steps.values() for g in s["grads"]):
        raise NotChecked("the optimizer's parameters had no gradient at its first step")
    ranks = sorted(steps)
    n = len(parts[ranks[0]])
    if any(len(parts[r]) != n for r in ranks):
        raise NotChecked(f"the ranks summed different numbers of batches: {per_rank(parts)}")
    records = first_of_each(t)
    training = all(records[r]["train"] is not False for r in records)
    net = t.module.Net()
    start = {r: flat(steps[r]["params"]) for r in ranks}
    if any(not torch.equal(start[r], start[0]) for r in ranks):
        wraps = t.probe.events("wrap")
        if any(not w["init_sync"] for w in wraps):
            return fails(
                "the ranks started from different weights: DDP(model, init_sync=False) skips the"
                " copy of rank 0's weights to every rank that DDP makes when it wraps the model."
                " Leave init_sync at its default (True)"
            )
        return fails(
            "the ranks started from different weights: DDP(model) copies rank 0's to every"
            " rank when it wraps the model; wrap it before training"
        )
    params = steps[0]["params"]

    def summed(ranks_: list[int]) -> torch.Tensor:
        return sum(gradient(net, params, [parts[r][k] for r in ranks_], training) for k in range(n))

    reference = summed(ranks)
    grads = {r: flat_grads(steps[r]) for r in ranks}
    gap = {r: distance(grads[r], reference) for r in ranks}
    sizes = {r: sum(len(p["labels"]) for p in parts[r]) for r in ranks}
    if max(gap.values()) < GRADIENT_TOLERANCE:
        close = f"within {max(gap.values()):.0e} of" if max(gap.values()) else "equal to"
        many = f", the sum over its {n} batches" if n > 1 else ""
        return holds(
            f"first step, {sum(sizes.values())} samples ({per_rank(sizes)}): every rank's"
            f" gradient {close} one process's on them all{many}"
        )
    own = {r: distance(grads[r], summed([r])) for r in ranks}
    if max(own.values()) < GRADIENT_TOLERANCE:
        return fails(
            "each rank applied the gradient of its own batch alone at the first step: nothing"
            " averaged the ranks' gradients. Wrap the model in DDP and train the wrapped model",
            explains=no_ddp_wrapper,
        )
    if all(distance(grads[r], grads[0]) < GRADIENT_TOLERANCE for r in ranks):
        scale = float(grads[0] @ reference / (reference @ reference))
        if distance(grads[0], scale * reference) < GRADIENT_TOLERANCE:
            if abs(scale * t.world - 1) < 0.01:
                return fails(
                    f"the gradient is 1/{t.world} of the global batch's: the loss is divided"
                    " by the world size. DDP already averages the gradients over the ranks:"
                    " backward() the plain mean loss of the rank's batch"
                )
            if abs(scale / t.world - 1) < 0.01:
                return fails(
                    f"the gradient is {t.world} times the global batch's: the ranks' gradients"
                    " are summed, not averaged. Divide by the world size, or let DDP average"
                )
            return fails(
                f"the gradient is {scale:.3g} times the global batch's: is the loss scaled?"
                " backward() the plain mean loss of the rank's batch"
            )
        return fails(
            "every rank applied the same gradient, but not the gradient of the mean loss over"
            f" the global batch (off by {gap[0]:.1e}): the loss or the forward pass differs from"
            " F.cross_entropy(model(images), labels)"
        )
    return fails(
        f"the ranks applied different gradients at the first step (off by {per_rank(gap)}):"
        " DDP gives every rank the same averaged gradient; train the DDP-wrapped model"
    )


def check_in_sync(t: Training) -> Verdict:
    """The checker's "replicas equal": every parameter of the DDP-wrapped model bit-equal on
    every rank at the end (at dist.destroy_process_group(), else at exit)."""
    replicas = t.checked("replicas equal")
    if not replicas:
        # the checker saw no process group
        return fails("no process group, so nothing keeps the ranks' parameters equal: no DDP")
    for c in replicas:
        if c.status == "FAIL":
            return fails(
                f"the ranks' parameters differ after training: {c.detail}. A rank updated its"
                " replica differently: train the DDP-wrapped model, the same steps on every rank"
            )
    for c in replicas:
        if c.status != "ok":
            raise NotChecked(c.detail)
    return holds("; ".join(c.detail for c in replicas))


def check_gpu(t: Training) -> Verdict:
    raise NotChecked(
        "on CPUs every rank's device is 'cpu' (exercises/README.md, step 4: it fails nowhere)"
    )


def check_shards(t: Training) -> Verdict:
    """Each epoch, the ranks split one permutation of the training set. The checker's "loader
    samples disjoint" shows the shares disjoint: no sample drawn by two ranks in a pass, apart
    from DistributedSampler's padding (up to W - 1 samples again); they also cover it: every
    sample drawn, or fewer than W left out (drop_last)."""
    n, w = t.train_digits, t.world
    epochs = list(range(min(2, t.whole_epochs)))
    if not epochs:
        raise NotChecked("no epoch ended on every rank")
    loader = t.loader(training=True)
    # None: the checker recorded no process group; the probe's draws still tell the cause
    overlaps = loader.overlaps(w) if loader else None
    for epoch in epochs:
        drawn = t.draws(epoch, training=True)
        sizes = {rank: len(drawn[rank]) for rank in drawn}
        missing = n - len({i for rank in drawn for i in drawn[rank]})
        if overlaps is not None and epoch not in overlaps and missing < w:
            continue
        samplers = t.samplers(epoch)
        kinds = {rank: s.get("type") for rank, s in samplers.items()}
        drew = per_rank({rank: count(size) for rank, size in sizes.items()})
        said = f"in epoch {epoch + 1}, {drew} samples"
        idle = [rank for rank, size in sizes.items() if not size]
        if idle:
            return fails(f"ranks {idle} trained on nothing ({said})")
        whole = [rank for rank, size in sizes.items() if size >= n]
        if whole:
            return fails(
                f"ranks {whole} each trained on all {samples(n)} ({said}; sampler"
                f" {kinds[whole[0]]}): no DistributedSampler. Give the training DataLoader"
                " sampler=DistributedSampler(train_set, world_size, rank), not shuffle=True"
            )
        if all(drawn[rank] == drawn[0] for rank in drawn):
            return fails(
                f"every rank drew the same {count(sizes[0])} samples in epoch {epoch + 1}: the"
                " sampler's rank is not the process's rank. Pass rank=rank"
            )
        if loader is None:
            return fails(f"no process group: the ranks' shares cannot be one split ({said})")
        seeds = {rank: s.get("seed") for rank, s in samplers.items()}
        numbers = {rank: s.get("epoch") for rank, s in samplers.items()}
        shared = loader.shared(epoch)
        overlap = f"{samples(shared)} drawn by more than one rank, {count(missing)} never ({said})"
        if len(set(seeds.values())) > 1:
            return fails(
                f"the ranks' shares overlap: {overlap}. Their samplers were seeded"
                f" differently ({per_rank(seeds)}): each rank shuffles its own permutation"
                " and takes its slice of it. Give DistributedSampler the same seed on every"
                " rank (seed=args.seed)"
            )
        if len(set(numbers.values())) > 1:
            return fails(
                f"the ranks' shares overlap: {overlap}. Their samplers were at different"
                f" epochs ({per_rank(numbers)}): call set_epoch(epoch) on every rank"
            )
        return fails(
            f"the ranks' shares overlap or miss samples: {overlap}. The ranks must split one"
            " permutation: a DistributedSampler, the same seed on every rank"
        )
    drawn = t.draws(epochs[-1], training=True)
    sizes = {rank: count(len(drawn[rank])) for rank in drawn}
    shared = loader.shared(epochs[-1])
    missing = n - len({i for rank in drawn for i in drawn[rank]})
    note = f"{shared} on two ranks: the sampler pads to {w} equal shares" if shared else ""
    note = note or (f"{missing} left out: drop_last" if missing else "none on two ranks")
    said = " and ".join(f"{e + 1}" for e in epochs)
    return holds(f"epochs {said}: {per_rank(sizes)} samples; {note}; all of {count(n)} drawn")


def check_batches(t: Training) -> Verdict:
    """Each rank's training batches hold --batch-size samples (the last of an epoch may hold
    fewer): --batch-size is per process, W ranks step on W times it together."""
    b = t.batch_size
    lasts: dict[int, set[int]] = {}
    for rank, pid in sorted(t.pids.items()):
        loader = t.training_loader(pid)
        passes: dict[int, list[int]] = {}
        for r in t.batches.get(pid, []):
            if r["loader"] == loader:
                passes.setdefault(r["pass"], []).append(len(r["samples"]))
        wrong = [n for got in passes.values() for n in got[:-1] if n != b]
        wrong += [got[-1] for got in passes.values() if got[-1] > b]
        if wrong:
            firsts = first_of_each(t)
            lr = firsts[rank]["lr"] if rank in firsts else None
            scaled = (
                f"; and its first step's lr is {lr:g}, not the --lr {LR:g} passed"
                if (lr is not None and abs(lr - LR) > 1e-9 * LR)
                else ""
            )
            divided = " (it was divided by the world size)" if wrong[0] * t.world == b else ""
            return fails(
                f"rank {rank}'s training batches hold {samples(wrong[0])}, but --batch-size"
                f" {b} was passed{divided}: --batch-size is per process. Give each rank's"
                f" DataLoader batch_size=args.batch_size: {t.world} ranks then step on"
                f" {t.world * b} samples together{scaled}"
            )
        if passes:
            lasts[rank] = {got[-1] for got in passes.values()}
    if not lasts:
        raise NotChecked("no rank drew a training batch")
    last = sorted({n for got in lasts.values() for n in got if n != b})
    fewer = f" (the last of an epoch {', '.join(map(str, last))})" if last else ""
    return holds(
        f"--batch-size {b}: every training batch of the {len(lasts)} ranks holds {b}{fewer}"
    )


def check_order(t: Training) -> Verdict:
    """The training order is shuffled, and differs between epochs on every rank."""
    if t.whole_epochs < 2:
        raise NotChecked("the ranks did not train two epochs")
    first, second = t.draws(0, training=True), t.draws(1, training=True)
    samplers = [t.samplers(0), t.samplers(1)]
    if len(first[0]) > 1 and first[0] == sorted(first[0]):
        shuffle = samplers[0][0].get("shuffle")
        setting = f" (its shuffle={shuffle})" if shuffle is not None else ""
        return fails(
            f"rank 0 drew its {count(len(first[0]))} samples in increasing order: the training"
            f" sampler{setting} does not shuffle. DistributedSampler shuffles by default:"
            " leave out shuffle=False"
        )
    same = [rank for rank in first if first[rank] == second[rank]]
    if same:
        numbers = {
            rank: (samplers[0][rank].get("epoch"), samplers[1][rank].get("epoch")) for rank in same
        }
        told = per_rank({rank: f"{a} then {b}" for rank, (a, b) in numbers.items()})
        return fails(
            f"ranks {same} drew the same samples in the same order in epochs 1 and 2 (their"
            f" sampler's epoch: {told}): call train_loader.sampler.set_epoch(epoch) on every"
            " rank, with the epoch's number, at the start of each epoch"
        )
    moved = sum(a != b for a, b in zip(first[0], second[0], strict=False))
    return holds(
        f"shuffled; rank 0's order changed at {count(moved)} of {count(len(first[0]))} positions"
        " between epochs 1 and 2"
    )


def check_test_shares(t: Training) -> Verdict:
    """Each rank evaluates its own part of the test set: together each sample once. (The
    checker's "loader samples disjoint" allows a DistributedSampler's padding; this does not.)"""
    n, w = t.test_digits, t.world
    if not t.whole_epochs:
        raise NotChecked("no epoch ended on every rank")
    drawn = t.draws(0, training=False)
    idle = sorted(rank for rank in range(w) if not drawn.get(rank))
    if idle:
        return fails(
            f"ranks {idle} evaluated nothing: every rank evaluates its own share of the test"
            " set, and the counts are summed"
        )
    sizes = {rank: len(drawn[rank]) for rank in drawn}
    share = "Subset(test_set, range(rank, len(test_set), world_size))"
    whole = [rank for rank, size in sizes.items() if size >= n]
    if whole:
        return fails(
            f"ranks {whole} each evaluated the whole test set ({count(n)} samples): give each"
            f" rank its share, {share}"
        )
    loader = t.loader(training=False)
    shared = loader.shared(0) if loader else 0
    padding = w * math.ceil(n / w) - n
    if shared and shared == padding and loader.sampler == "DistributedSampler":
        return fails(
            f"the test set was padded, {samples(shared)} evaluated twice: a DistributedSampler"
            f" pads the {count(n)} test samples to {w} x {math.ceil(n / w)}; split them"
            f" without padding, {share}"
        )
    evaluated = len({i for rank in drawn for i in drawn[rank]})
    if shared or evaluated != n or sum(sizes.values()) != n:
        return fails(
            f"the ranks evaluated {count(evaluated)} different samples of {count(n)},"
            f" {shared} on more than one rank ({per_rank(sizes)}): split the test set, {share}"
        )
    return holds(f"epoch 1: {per_rank(sizes)} test samples; none twice; all of {count(n)}")


def check_figures(t: Training) -> Verdict:
    """Every figure of the epoch lines is one that training can compute: a number, a loss of 0
    or more (a cross-entropy), accuracies from 0 to 100%, counts from 1 to the data set's size
    (the training set's with a DistributedSampler's padding, up to W - 1 samples)."""
    lines = t.epoch_lines
    if not lines:
        raise NotChecked("no epoch lines")
    sizes = {"train": t.train_digits + t.world - 1, "test": t.test_digits}
    for line in lines[: t.epochs]:
        epoch = int(line["epoch"])
        said = f"epoch {epoch} reports"
        for name in FIGURES:
            if not math.isfinite(line[name]):
                return fails(
                    f"{said} {name}={line[name]}: not a number. A sum divided by a count of 0,"
                    " or a loss that diverged"
                )
        if line["train_loss"] < 0:
            return fails(
                f"{said} train_loss={line['train_loss']}: a cross-entropy is never negative. Sum"
                " each batch's F.cross_entropy times its size, and divide by the samples"
            )
        for kind in ("train", "test"):
            accuracy, seen = line[f"{kind}_acc"], line[f"{kind}_samples"]
            figures = f"{kind}_acc={accuracy:.2f}% of {kind}_samples={seen:g}"
            if not 0 <= accuracy <= 100:
                drawn = t.draws(epoch - 1, training=kind == "train")
                together, alone = sum(map(len, drawn.values())), len(drawn.get(0, []))
                correct = round(accuracy * seen / 100)
                if accuracy > 100 and seen == together and 0 < accuracy / t.world <= 100:
                    why = (
                        f" {correct} correct predictions of {count(together)} samples. The"
                        f" sample count is right (the ranks drew {count(together)}): the count"
                        f" of correct predictions alone was summed more than once; summed once,"
                        f" {t.world} times smaller, it gives {accuracy / t.world:.2f}%. One"
                        " dist.all_reduce of a tensor that holds both counts, once"
                    )
                elif accuracy > 100 and seen == alone < together and correct <= together:
                    why = (
                        f" {correct} correct predictions, summed over the ranks, divided by rank"
                        f" 0's own {kind} samples: the ranks drew {count(together)} together."
                        " Sum both counts over the ranks (one dist.all_reduce of a tensor that"
                        " holds both), then divide"
                    )
                else:
                    why = (
                        " a share of the samples is from 0 to 100%: divide the correct"
                        " predictions by the samples they were counted on, both summed over"
                        " the ranks"
                    )
                return fails(
                    f"{said} {figures}, {'above 100' if accuracy > 0 else 'below 0'}%:{why}"
                )
            if not 1 <= seen <= sizes[kind]:
                drawn = t.draws(epoch - 1, training=kind == "train")
                together = sum(map(len, drawn.values()))
                times = seen / together if together else 0
                again = (
                    f"; {times:g} times the {count(together)} the ranks drew: summed over the"
                    " ranks more than once?"
                    if times > 1 and times == int(times)
                    else ""
                )
                return fails(
                    f"{said} {kind}_samples={seen:g}, {'more' if seen > 1 else 'fewer'} than the"
                    f" {kind} set can give ({count(sizes[kind])} at most{again}): count each"
                    " sample once, on the rank that drew it, and sum the counts over the ranks"
                    " once"
                )
    return holds(
        f"{len(lines)} epoch lines: losses of 0 or more, accuracies from 0 to 100%, counts"
        f" within the data sets' {count(sizes['train'])} and {count(sizes['test'])}"
    )


def check_counts(t: Training) -> Verdict:
    """Every epoch line's counts are sums over the ranks: what the ranks drew together."""
    lines = t.epoch_lines
    if not lines:
        raise NotChecked("no epoch lines")
    for epoch, line in enumerate(lines[: t.epochs]):
        train, test = t.draws(epoch, training=True), t.draws(epoch, training=False)
        together = (sum(map(len, train.values())), sum(map(len, test.values())))
        said = (int(line["train_samples"]), int(line["test_samples"]))
        if said != together:
            alone = (len(train.get(0, [])), len(test.get(0, [])))
            why = (
                "rank 0's own counts: dist.all_reduce the sums before rank 0 prints them"
                if any(s == a != b for s, a, b in zip(said, alone, together, strict=True))
                else "dist.all_reduce the sums (op SUM), and count each sample once"
            )
            return fails(
                f"epoch {epoch + 1} reports train_samples={said[0]} test_samples={said[1]};"
                f" the ranks drew {count(together[0])} and {count(together[1])} together: {why}"
            )
    padded = (
        f" ({count(together[0] - t.train_digits)} padding)" if together[0] > t.train_digits else ""
    )
    return holds(
        f"every epoch line: train_samples={together[0]}{padded} test_samples={together[1]},"
        " the ranks' sums"
    )


def check_loss(t: Training) -> Verdict:
    """Each epoch line's train_loss is the mean of the losses the ranks computed that epoch
    (the probe's F.cross_entropy values, weighted by their batches)."""
    lines = t.epoch_lines
    if not lines:
        raise NotChecked("no epoch lines")
    # [loader, pass, sum of loss x samples, samples] per rank: at its steps, and at its exit
    # for the batches no step followed
    recorded = {
        pid: [
            entry
            for e in t.events(pid)
            if e["event"] in ("step", "losses")
            for entry in e.get("losses") or []
        ]
        for pid in t.pids.values()
    }
    told = []
    for epoch, line in enumerate(lines[: t.epochs]):
        total = samples_ = 0.0
        for pid, entries in recorded.items():
            loader = t.training_loader(pid)
            for where, number, summed, n in entries:
                if (where, number) == (loader, epoch):
                    total += summed
                    samples_ += n
        if not samples_:
            raise NotChecked("no F.cross_entropy loss was recorded at the training steps")
        mean, printed = total / samples_, line["train_loss"]
        if abs(printed - mean) <= 2e-4 + 1e-3 * abs(mean):
            told.append(f"{printed:.4f}")
            continue
        said = (
            f"epoch {epoch + 1} reports train_loss={printed:.4f}; the ranks' losses averaged"
            f" {mean:.4f} over their {count(int(samples_))} training samples"
        )
        ratio = printed / mean if mean else math.inf
        if abs(ratio - t.world) < 0.01 * t.world:
            return fails(
                f"{said}: {t.world} times the mean, as if each batch's loss were summed over"
                f" the {t.world} ranks (a dist.all_reduce of the loss, in place, before it was"
                " added up?). DDP averages the gradients, not the loss: add up each rank's own"
                " loss x batch, all_reduce the sums once after the epoch, divide by the samples"
            )
        if abs(ratio * t.world - 1) < 0.01:
            return fails(
                f"{said}: 1/{t.world} of the mean. Divide the summed losses by the samples"
                " summed over the ranks, not by the world size on top"
            )
        return fails(
            f"{said}. train_loss should be the summed loss x batch over the ranks, divided by"
            " the samples summed over the ranks"
        )
    return holds(
        f"every epoch line's train_loss ({', '.join(told)}) is the mean of the losses the"
        f" ranks computed"
    )


def check_checkpoint(t: Training) -> Verdict:
    path = os.path.abspath(t.checkpoint)
    writers = [t.rank_of(e["pid"]) for e in t.probe.events("save") if e["path"] == path]
    if writers not in ([], [0]):
        return fails(
            f"the checkpoint was written {len(writers)} times, by ranks {sorted(writers)}:"
            " only rank 0 should write it (if rank == 0:)"
        )
    if not writers:
        return unless_failed(t, "no checkpoint was written: rank 0 saves it after the last epoch")
    if not t.checkpoint.exists():
        return unless_failed(t, "rank 0 called torch.save, but no checkpoint file is there")
    state = torch.load(t.checkpoint, weights_only=True)
    if any(key.startswith("module.") for key in state):
        return fails(
            "the checkpoint's keys start with 'module.':"
            " save model.module.state_dict(), not the DDP wrapper's"
        )
    model = t.module.Net()
    # strict: every key matches the bare model
    model.load_state_dict(state)
    trained = trained_weights(t, dict(model.named_parameters()))
    if trained is None:
        raise NotChecked("rank 0's trained weights were not recorded")
    if not all(map(torch.equal, model.parameters(), trained)):
        return fails("the saved weights are not the trained ones: save after the last epoch")
    return holds(
        f"written once, by rank 0; {len(state)} keys without 'module.' load into the script's"
        " Net and equal the trained weights"
    )


def trained_weights(t: Training, saved: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """Rank 0's model at the end, parameter by parameter in the order of `saved` (the
    checkpoint's): the DDP-wrapped model whose parameters have the checkpoint's names (the
    checker's record), else the parameters of the optimizer (the probe's)."""
    ranks, _ = checker().read(t.check_dir)
    for rank in ranks:
        for end in rank.of("end") if rank.rank == 0 else []:
            held = torch.load(end["saved"], weights_only=True)
            if held.keys() == saved.keys():
                return [held[name] for name in saved]
    return t.params().get(0)


def check_read_after_write(t: Training) -> Verdict:
    races = unordered_reads(t)
    if races:
        return fails(races[0])
    reads = [e for e in t.probe.events("load") if t.rank_of(e["pid"]) not in (0, None)]
    if not reads:
        if t.failed:
            raise NotChecked("the job ended first")
        return holds("no other rank read it")
    return holds(f"{len(reads)} reads by other ranks, each after the barrier after the write")


def check_evaluation(t: Training) -> Verdict:
    """Each rank evaluates in eval mode: model.eval() turns dropout off (and makes batch norm
    use its running statistics). The probe's first forward of each pass of every loader but the
    training one (the test set's)."""
    tested: dict[int, list[dict]] = {}
    for rank, pid in sorted(t.pids.items()):
        training = t.training_loader(pid)
        tested[rank] = [
            e
            for e in t.events(pid)
            if e["event"] == "forward" and e["loader"] not in (None, training)
        ]
        on = [e for e in tested[rank] if e["train"]]
        if on:
            epochs = ", ".join(str(e["pass"] + 1) for e in on)
            return fails(
                f"rank {rank} evaluated in train mode (its test forwards of epochs {epochs}):"
                " dropout was on while it tested. Call model.eval() before evaluating, and"
                " model.train() before training again"
            )
    passes = {rank: len(found) for rank, found in tested.items() if found}
    if not passes:
        raise NotChecked("no forward on a test batch was recorded")
    return holds(f"in eval mode at every test pass ({per_rank(passes)})")


def check_accuracy(t: Training) -> Verdict:
    epochs = t.epoch_lines
    if len(epochs) < t.epochs:
        raise NotChecked(f"{len(epochs)} epoch lines for {t.epochs} epochs")
    accuracy = epochs[-1]["test_acc"]
    if not 0 <= accuracy <= 100:
        return fails(f"test_acc={accuracy}% after {t.epochs} epochs is no accuracy")
    if accuracy < MIN_TEST_ACC:
        return fails(f"test accuracy after {t.epochs} epochs: {accuracy}%")
    return holds(f"{accuracy}% after {t.epochs} epochs")
