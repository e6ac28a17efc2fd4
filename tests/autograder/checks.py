"""One check per claim (claims.py lists them): each returns a Verdict, the evidence when the claim
holds, the cause and what to do when it fails; it raises NotChecked when nothing showed it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .causes import crash_cause, unordered_reads
from .run import Training, threads_per_task

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


def holds(evidence: str) -> Verdict:
    # A claim holds on evidence; without any, it is not checked.
    assert evidence, "a claim that holds says what shows it"
    return Verdict(None, evidence)


def fails(problem: str, blame: str | None = None) -> Verdict:
    return Verdict(problem, blame=blame)


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
            " each on everything"
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
    lines = len(t.run.epochs())
    if lines > t.epochs:
        return fails(f"{lines} epoch lines for {t.epochs} epochs: only rank 0 should print them")
    if lines < t.epochs:
        raise NotChecked(f"{lines} epoch lines for {t.epochs} epochs")
    return holds(f"{lines} epoch lines for {t.epochs} epochs")


def gradient(net: torch.nn.Module, steps: list[dict]) -> torch.Tensor:
    """The gradient of the mean cross-entropy over the samples of `steps` together, from
    their initial weights: one process's gradient on that batch. Each part's forward runs
    with its rank's random state, so dropout drops what it dropped on that rank."""
    with torch.no_grad():
        for parameter, value in zip(net.parameters(), steps[0]["params"], strict=True):
            parameter.copy_(value)
    net.train()
    net.zero_grad()
    samples = sum(len(step["labels"]) for step in steps)
    with torch.random.fork_rng():
        loss = 0
        for step in steps:
            torch.set_rng_state(step["rng"])
            loss = loss + F.cross_entropy(net(step["inputs"]), step["labels"], reduction="sum")
        (loss / samples).backward()
    return flat([torch.zeros_like(p) if p.grad is None else p.grad for p in net.parameters()])


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def flat_grads(step: dict) -> torch.Tensor:
    """The step's gradients as one vector; a parameter without one counts as zeros."""
    pairs = zip(step["params"], step["grads"], strict=True)
    return flat([torch.zeros_like(p) if g is None else g for p, g in pairs])


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_gradient(t: Training) -> Verdict:
    """One optimizer step on W ranks is one process's step on their batches together: the
    gradient it applies, on every rank, is the gradient of the mean loss over the global
    batch (DDP all-reduces the gradients and divides by the world size)."""
    steps = t.first_steps()
    if len(steps) < t.world:
        raise NotChecked(f"ranks {sorted(set(range(t.world)) - set(steps))} took no step")
    if any(s["labels"] is None or s["inputs"] is None for s in steps.values()):
        raise NotChecked("the first step's inputs or labels were not seen")
    ranks = sorted(steps)
    net = t.module.Net()
    start = {r: flat(steps[r]["params"]) for r in ranks}
    if any(not torch.equal(start[r], start[0]) for r in ranks):
        return fails(
            "the ranks started from different weights: DDP(model) copies rank 0's to every"
            " rank when it wraps the model; wrap it before training"
        )
    reference = gradient(net, [steps[r] for r in ranks])
    grads = {r: flat_grads(steps[r]) for r in ranks}
    gap = {r: distance(grads[r], reference) for r in ranks}
    sizes = {r: len(steps[r]["labels"]) for r in ranks}
    if max(gap.values()) < GRADIENT_TOLERANCE:
        close = f"within {max(gap.values()):.0e} of" if max(gap.values()) else "equal to"
        return holds(
            f"first step, {sum(sizes.values())} samples ({per_rank(sizes)}): every rank's"
            f" gradient {close} one process's on them all"
        )
    own = {r: distance(grads[r], gradient(net, [steps[r]])) for r in ranks}
    if max(own.values()) < GRADIENT_TOLERANCE:
        return fails(
            "each rank applied the gradient of its own batch alone at the first step: nothing"
            " averaged the ranks' gradients. Wrap the model in DDP and train the wrapped model"
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


def check_counts(t: Training) -> Verdict:
    """Every epoch line's counts are sums over the ranks: what the ranks drew together."""
    lines = t.run.epochs()
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
    trained = t.params().get(0)
    if trained is None:
        raise NotChecked("rank 0's trained weights were not recorded")
    if not all(map(torch.equal, model.parameters(), trained)):
        return fails("the saved weights are not the trained ones: save after the last epoch")
    return holds(
        f"written once, by rank 0; {len(state)} keys without 'module.' load into the script's"
        " Net and equal the trained weights"
    )


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


def check_accuracy(t: Training) -> Verdict:
    epochs = t.run.epochs()
    if len(epochs) < t.epochs:
        raise NotChecked(f"{len(epochs)} epoch lines for {t.epochs} epochs")
    accuracy = epochs[-1]["test_acc"]
    if accuracy < MIN_TEST_ACC:
        return fails(f"test accuracy after {t.epochs} epochs: {accuracy}%")
    return holds(f"{accuracy}% after {t.epochs} epochs")
