"""Check a DDP run of any training script, without changing the script.

Put this command in front of the launch. It runs the launch with the recorder (sitecustomize.py,
beside this file) loaded into every process, then prints what the records prove: the replicas
ended equal (parameters and buffers), and so did every module DDP does not wrap (a frozen loss
network, a teacher, an EMA copy); no rank trained a copy of its own (what an optimizer stepped
outside DDP was averaged by a collective of the script's own, or the same on every rank); every
rank trained the same number of steps on inputs no other rank saw; each checkpoint file was
written by one rank, without the wrapper's 'module.' keys; and the ranks entered the same
collectives in the same order; and what it could not check.

    python part4_torchrun/your_script/checker/ddp_check.py \
        torchrun --standalone --nproc_per_node=2 my_script.py --epochs 1

Without torchrun on PATH, Python's module is the same launcher:

    python part4_torchrun/your_script/checker/ddp_check.py \
        python -m torch.distributed.run --standalone --nproc_per_node=2 my_script.py --epochs 1

Options, before the command:

    --deadline S  a rank waits at most S seconds in one collective: the recorder gives
                  init_process_group timeout=S when the script gives none (the script's own
                  stays); and the launch is ended once no process recorded anything for 2 x S
                  seconds (a hang outside any collective). Then the report says where each
                  rank waited.
    --draws       say whether the random draws inside each training forward (dropout, noise, a
                  VAE's sampling) came from a random state of each rank's own
    --keep DIR    record into DIR (kept), not a temporary folder

Ctrl-C or SIGTERM to this command ends the launch: SIGTERM to the launch's process group, and
after 5 seconds SIGKILL to every process of it left (torchrun starts each rank in a session of
its own); then the report, with where each rank was.

Or record with environment variables alone (an empty folder), and report later
(DDP_CHECK_DEADLINE=S and DDP_CHECK_DRAWS=1 do what the options do in the recorder; the end after
2 x S seconds without a record needs this command):

    PYTHONPATH=part4_torchrun/your_script/checker DDP_CHECK_DIR=runs/check \
        torchrun --standalone --nproc_per_node=2 my_script.py --epochs 1
    python part4_torchrun/your_script/checker/ddp_check.py --report runs/check

Exit status: 128 + the signal's number when a signal ended the launch (130 for Ctrl-C, 143 for
SIGTERM); 124 when --deadline ended it; else the launch's own when it failed; else 1 when a check
failed or none could be made; else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Seconds the launch has to end on a signal before SIGKILL.
GRACE = 5.0
# The exit status when --deadline ended the launch (as coreutils' timeout).
DEADLINE_STATUS = 124

NOT_CHECKED = [
    "what the script computes with its collectives: whether a metric or a decision is global"
    " (the collectives are listed, not understood); arguments are compared for all_reduce,"
    " reduce, broadcast and broadcast_object_list only",
    "DDP's own gradient all-reduce: it runs in C++ hooks, outside torch.distributed's functions",
    "inputs made inside forward; samples that random augmentation made look new (the loaders'"
    " indices cover map-style DataLoaders); without a DataLoader, repeats in different steps",
    "that dim 0 of forward's first input is the batch, and the order or continuity of a stream",
    "the optimizer's state (momentum), and tensors held by no module (a bare tensor; a bare"
    " parameter's gradient is checked when an optimizer steps it)",
]


@dataclass
class Check:
    status: str  # "ok", "FAIL", or "--" (could not check)
    name: str
    detail: str
    # the number of the model or loader the check is about, for a check of one
    subject: int | None = None

    def line(self) -> str:
        return f"{self.status:<5} {self.name}: {self.detail}"


@dataclass
class Rank:
    rank: int
    pid: int
    events: list[dict] = field(default_factory=list)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


class RecordsError(Exception):
    pass


# Collectives that combine the ranks' values: a sample scored on several ranks before one of
# them counts once per rank.
SUMMING = (
    *("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object"),
    *("gather", "gather_object", "reduce_scatter", "reduce_scatter_tensor"),
)
# Without --draws, or with it (init records it): what the report leaves out about random draws.
NOT_DRAWN = (
    "random draws inside forward (dropout, noise): --draws says whether each rank drew its own"
)
DRAWN = "random draws outside forward (augmentation, noise made before forward) and what they made"


def read(directory: Path) -> tuple[list[Rank], int | None]:
    """The processes that joined a process group, by rank, and the world size."""
    ranks: dict[int, Rank] = {}
    world_size = None
    # what loader worker processes recorded (no process group of their own): their rank's
    workers: list[dict] = []
    for path in sorted(directory.glob("*.jsonl")):
        events = []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        for number, line in enumerate(lines):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines) - 1:
                    raise
                # the last line of a process killed as it wrote it
        inits = [e for e in events if e["event"] == "init"]
        if not inits:
            # the launcher, a loader worker: no process group
            workers += [e for e in events if e["event"] == "dataset_draws"]
            continue
        rank = inits[0]["rank"]
        if rank in ranks:
            raise RecordsError(
                f"rank {rank} appears in two processes ({ranks[rank].pid}, {path.stem}): a restart,"
                " or an earlier run's records; give DDP_CHECK_DIR an empty folder"
            )
        ranks[rank] = Rank(rank, int(path.stem), events)
        world_size = inits[0]["world_size"]
    for e in workers:
        if e["rank"] in ranks:
            ranks[e["rank"]].events.append(e)
    return [ranks[r] for r in sorted(ranks)], world_size


def training_forwards(rank: Rank, model: int | None = None) -> list[dict]:
    return [
        e for e in rank.of("forward") if e["training"] and (model is None or e["model"] == model)
    ]


def compare(ranks: list[Rank], ends: dict[int, dict], key: str, saved: str):
    """The names of the tensors (`key`: params or buffers) of one model's end records, those
    that differ between ranks, and the largest difference among them (None when not saved)."""
    names = [n for n, _ in ends[ranks[0].rank][key]]
    digests = {rank: dict(map(tuple, e[key])) for rank, e in ends.items()}
    differing = [n for n in names if len({d.get(n) for d in digests.values()}) > 1]
    if not differing or not all(e.get(saved) for e in ends.values()):
        return names, differing, None
    # torch only here: reading the saved tensors (importing it takes seconds)
    import torch

    tensors = {rank: torch.load(e[saved], weights_only=True) for rank, e in ends.items()}
    reference = tensors[ranks[0].rank]
    drifts = [
        (held[n].double() - reference[n].double()).abs().max().item()
        for held in tensors.values()
        for n in differing
        if n in held and n in reference and held[n].shape == reference[n].shape
    ]
    return names, differing, max(drifts, default=None)


def ends_of(ranks: list[Rank]) -> tuple[dict[int, str], dict[int, dict[int, dict]]]:
    """model -> the wrapped module's class; model -> rank -> its end record."""
    ends: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in ranks:
        for e in r.of("end"):
            ends[e["model"]][r.rank] = e
    wrapped = {e["model"]: e["module"] for r in ranks for e in r.of("wrap")}
    return wrapped, ends


def let_go(records) -> str:
    """What the detail says when a rank's record was made as the script let the module go
    (no destroy_process_group(), and the module dropped before exit)."""
    if any(e.get("when") == "collected" for e in records):
        return " (recorded when the script let it go)"
    return ""


def check_replicas(ranks: list[Rank]) -> list[Check]:
    """Each wrapped module's parameters bit-equal on every rank, as recorded at
    destroy_process_group(), else at exit, else when the script let the module go."""
    wrapped, ends = ends_of(ranks)
    if not wrapped:
        return [Check("--", "replicas equal", "no module was wrapped in DistributedDataParallel")]
    checks = []
    for model, module in sorted(wrapped.items()):
        name = f"replicas equal (model {model}, {module})"
        missing = [r.rank for r in ranks if r.rank not in ends[model]]
        dropped = [r.rank for r in ranks for e in r.of("dropped") if e["model"] == model]
        if dropped:
            detail = (
                f"rank(s) {dropped} let the wrapped module go unrecorded (its class has a __del__"
                " of its own): keep a reference to it until destroy_process_group()"
            )
            checks.append(Check("--", name, detail, model))
            continue
        if missing:
            checks.append(
                Check(
                    "--",
                    name,
                    f"rank(s) {missing} recorded no parameters: they did not reach"
                    " destroy_process_group() or a normal exit",
                    model,
                )
            )
            continue
        names, differing, drift = compare(ranks, ends[model], "params", "saved")
        when = let_go(ends[model].values())
        if not differing:
            detail = (
                f"{len(names)} parameter tensors bit-equal on all {len(ranks)} ranks at the"
                f" end{when}"
            )
            checks.append(Check("ok", name, detail, model))
            continue
        measured = f"; max |difference| between ranks {drift:.4g}" if drift is not None else ""
        detail = (
            f"{len(differing)} of {len(names)} parameter tensors differ at the end{when}, first"
            f" {differing[0]!r}{measured}"
        )
        checks.append(Check("FAIL", name, detail, model))
    return checks


def check_buffers(ranks: list[Rank]) -> list[Check]:
    """Each wrapped module's buffers (BatchNorm's running statistics, its integer
    num_batches_tracked too) bit-equal on every rank at the end. A module without buffers gets
    no check; one without end records on every rank neither ("replicas equal" says why)."""
    wrapped, ends = ends_of(ranks)
    checks = []
    for model, module in sorted(wrapped.items()):
        if any(r.rank not in ends[model] for r in ranks):
            continue
        name = f"buffers equal (model {model}, {module})"
        names, differing, drift = compare(ranks, ends[model], "buffers", "saved_buffers")
        if not names:
            continue
        if not differing:
            detail = f"{len(names)} buffer tensors bit-equal on all {len(ranks)} ranks at the end"
            checks.append(Check("ok", name, detail, model))
            continue
        measured = f"; max |difference| between ranks {drift:.4g}" if drift is not None else ""
        detail = (
            f"{len(differing)} of {len(names)} buffer tensors differ at the end, first"
            f" {differing[0]!r}{measured}: make them agree before saving or evaluating:"
            " average them, or broadcast rank 0's"
        )
        checks.append(Check("FAIL", name, detail, model))
    return checks


def unwrapped(ranks: list[Rank]) -> dict[str, dict[int, dict]]:
    """key -> rank -> the last state record of each module DDP does not wrap."""
    last: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in ranks:
        for e in r.of("state"):
            last[e["key"]][r.rank] = e
    return last


def check_unwrapped(ranks: list[Rank]) -> list[Check]:
    """Each module that DDP does not wrap and no other module holds (a frozen loss network, a
    teacher, an EMA copy, a model trained without DDP), by its class and the line that built
    it: its parameters and buffers bit-equal on every rank, as last recorded (at the end, or
    when the script let it go). DDP never copies or compares such a module. One that some
    ranks did not record (rank 0's own copy to load a checkpoint into) is listed as not
    checked."""
    # the modules an optimizer stepped outside DDP: trained, not only built, on each rank
    trained = set(trainings(ranks))
    checks = []
    for key, per_rank in unwrapped(ranks).items():
        name = f"unwrapped module equal ({key})"
        if len(per_rank) < len(ranks):
            continue
        params, differing, drift = compare(ranks, per_rank, "params", "saved")
        buffers, differing_buffers, buffers_drift = compare(
            ranks, per_rank, "buffers", "saved_buffers"
        )
        differing += differing_buffers
        drifts = [d for d in (drift, buffers_drift) if d is not None]
        when = let_go(per_rank.values())
        if not differing:
            detail = (
                f"{len(params)} parameter and {len(buffers)} buffer tensors bit-equal on all"
                f" {len(ranks)} ranks at the end{when}"
            )
            checks.append(Check("ok", name, detail))
            continue
        measured = f"; max |difference| between ranks {max(drifts):.4g}" if drifts else ""
        if key in trained:
            fix = (
                "each rank trained it with its own gradients (see gradients averaged): wrap it"
                " in DistributedDataParallel"
            )
        else:
            fix = (
                "DDP neither copies nor compares a module it does not wrap: build or load it"
                " alike on every rank, before any seed of each rank's own, or broadcast rank"
                " 0's tensors"
            )
        detail = (
            f"{len(differing)} of {len(params) + len(buffers)} tensors differ at the end{when},"
            f" first {differing[0]!r}{measured}: {fix}"
        )
        checks.append(Check("FAIL", name, detail))
    return checks


def trainings(ranks: list[Rank]) -> dict[str, dict[int, list[dict]]]:
    """What optimizers trained outside DDP: the key of the module that holds the parameters
    (else the optimizer's number and class) -> rank -> its step records."""
    found: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in ranks:
        for e in r.of("step"):
            if e["outside"]:
                key = e.get("trains") or f"optimizer {e['optimizer']}, {e['kind']}"
                found[key][r.rank].append(e)
    return found


def check_gradients(ranks: list[Rank], world_size: int) -> list[Check]:
    """Each module trained outside DDP on several ranks (an optimizer stepped parameters no
    DDP-wrapped module holds): a collective between each backward and the step (gradients
    averaged by hand), or the same gradients on every rank at every step (each rank repeats
    one training: a reference); else each rank trained its own copy. No line for what DDP
    trains; training on some ranks alone is listed as not checked."""
    if world_size < 2:
        return []
    # a DDP model trained: a module trained outside it alike on every rank is a reference
    wrapped = any(training_forwards(r) for r in ranks)
    checks = []
    for key, per_rank in trainings(ranks).items():
        if len(per_rank) < len(ranks):
            continue
        name = f"gradients averaged ({key})"
        first = next(iter(per_rank.values()))[0]
        count = max(e["outside"] for es in per_rank.values() for e in es)
        held = (
            f"its optimizer ({first['kind']}) stepped {count} parameters that no DDP-wrapped"
            f" module holds (first {first['first']!r})"
        )
        alone = {rank: [e for e in es if not e["collectives"]] for rank, es in per_rank.items()}
        if not any(alone.values()):
            places = Counter(
                f"{e['name']} at {Path(e['file']).name}:{e['line']}"
                for e in ranks[0].of("collective")
                if e.get("window")
            )
            listed = ", ".join(f"{place} x{n}" for place, n in places.most_common(3))
            detail = (
                f"{held}; a collective ran between each backward and the step ({listed}):"
                " averaged by hand (what the collectives sum is not checked; unwrapped module"
                " equal compares the result)"
            )
            checks.append(Check("ok", name, detail))
            continue
        steps = [len(es) for es in per_rank.values()]
        differ = [
            k
            for k in range(min(steps))
            if None in {es[k].get("grads") for es in per_rank.values()}
            or len({es[k].get("grads") for es in per_rank.values()}) > 1
        ]
        same = not differ and len(set(steps)) == 1
        if same and wrapped:
            detail = (
                f"{held}, with no collective between the backward and the step, but the same"
                f" gradients on every rank at all {steps[0]} steps: each rank repeats one"
                " training beside the DDP model's (a one-process reference), not split between"
                " the ranks"
            )
            checks.append(Check("ok", name, detail))
            continue
        rank = next(rank for rank, es in alone.items() if es)
        nothing = "" if wrapped else "no DDP model trained: "
        if same:
            copies = (
                f"the same gradients on every rank at all {steps[0]} steps: each rank repeats"
                " the same training on the same data, as one process would"
            )
        else:
            copies = (
                f"other gradients on each rank, first at step {differ[0] + 1 if differ else 1}:"
                " each rank trained its own copy"
            )
        detail = (
            f"{nothing}{held}, with no collective between the backward and the step at"
            f" {len(alone[rank])} of {len(per_rank[rank])} steps on rank {rank}, and {copies}:"
            " wrap the model in DistributedDataParallel (or all-reduce those gradients before"
            " the step)"
        )
        checks.append(Check("FAIL", name, detail))
    return checks


def check_steps(ranks: list[Rank]) -> Check:
    models = sorted({e["model"] for r in ranks for e in training_forwards(r)})
    if not models:
        return Check("--", "same steps", "no training forward through a DDP-wrapped module")
    counts = {model: {r.rank: len(training_forwards(r, model)) for r in ranks} for model in models}
    unequal = {m: c for m, c in counts.items() if len(set(c.values())) > 1}
    if unequal:
        model, per_rank = next(iter(unequal.items()))
        return Check(
            "FAIL", "same steps", f"training forwards of model {model} per rank: {per_rank}"
        )
    total = ", ".join(f"model {m}: {next(iter(c.values()))}" for m, c in counts.items())
    return Check("ok", "same steps", f"training forwards on every rank ({total})")


def check_inputs(ranks: list[Rank], world_size: int) -> Check:
    """No row of a training input on two ranks in the same epoch: the same pass of the loader
    that handed out the last batch before it, or, without a loader, the same step. (Across
    epochs a sample may move to another rank: DistributedSampler reshuffles with set_epoch.)
    A DistributedSampler pads each pass with up to world_size - 1 samples again, each on another
    rank than its first copy: that many shared rows are allowed in a pass it drew.
    A row on two ranks that the loader handed each of them under other data-set indices (the
    loader's records pair each batch's indices with its rows) is a duplicate in the data set,
    not a shared sample: counted, not failed."""
    samplers = {e["loader"]: e["sampler"] for r in ranks for e in r.of("batch")}
    # (loader, pass) -> row -> rank -> the data-set indices it came under on that rank
    handed: dict[tuple, dict[str, dict[int, set[int]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(set))
    )
    for r in ranks:
        for e in r.of("batch"):
            rows = e.get("rows") or []
            if len(rows) == len(e["samples"]):
                for row, sample in zip(rows, e["samples"], strict=True):
                    handed[e["loader"], e["pass"]][row][r.rank].add(sample)
    holders: dict[tuple, dict[str, dict[int, int]]] = defaultdict(dict)
    distinct: set[str] = set()
    total = 0
    for r in ranks:
        for index, e in enumerate(training_forwards(r)):
            epoch = ("pass", *e["pass"]) if e.get("pass") else ("step", index)
            for row in e["rows"]:
                total += 1
                distinct.add(row)
                # rank -> its first training forward with this row, in this epoch
                holders[epoch].setdefault(row, {}).setdefault(r.rank, index)
    if not total:
        return Check("--", "inputs disjoint", "no training forward with a tensor input")

    def duplicate(epoch: tuple, row: str) -> bool:
        """Every rank holding the row had it from the loader, under indices no other had."""
        if epoch[0] != "pass":
            return False
        indices = handed.get((epoch[1], epoch[2]), {}).get(row, {})
        held = holders[epoch][row]
        if not all(rank in indices for rank in held):
            return False
        seen = [i for rank in held for i in indices[rank]]
        return len(seen) == len(set(seen))

    shared: dict[tuple, list[str]] = defaultdict(list)
    # row -> the data set the loader handed it from, under different indices on each rank
    duplicates: dict[str, str] = {}
    datasets = {e["loader"]: e["dataset"] for r in ranks for e in r.of("batch")}
    for epoch, rows in holders.items():
        for row, held in rows.items():
            if len(held) > 1:
                if duplicate(epoch, row):
                    duplicates[row] = datasets.get(epoch[1], "?")
                else:
                    shared[epoch].append(row)

    def padding(epoch: tuple) -> int:
        padded = epoch[0] == "pass" and samplers.get(epoch[1]) == "DistributedSampler"
        return world_size - 1 if padded else 0

    same = duplicates_note(duplicates, choosing(ranks))
    over = [epoch for epoch, rows in shared.items() if len(rows) > padding(epoch)]
    if not over:
        padded = max(map(len, shared.values()), default=0)
        note = f" (up to {padded} a pass: a DistributedSampler's padding)" if padded else ""
        return Check(
            "ok",
            "inputs disjoint",
            f"{len(distinct)} distinct rows (dim 0 of forward's first input) in {total}; none"
            f" went to two ranks in one epoch (a loader's pass, else a step){note}{same}",
        )
    rows = set().union(*(shared[epoch] for epoch in over))
    held = holders[over[0]][shared[over[0]][0]]
    (rank, index), (other, _) = sorted(held.items())[:2]
    return Check(
        "FAIL",
        "inputs disjoint",
        f"{len(rows)} of {len(distinct)} distinct rows went to more than one rank in one"
        f" epoch (first: rank {rank}'s training forward {index + 1}, also on rank {other}){same}",
    )


def duplicates_note(duplicates: dict[str, str], draws: dict[str, str]) -> str:
    """What the rows that came to several ranks under different indices may be: duplicates in
    the data set, or, from a data set that draws in __getitem__, one sample drawn twice."""
    drawn = [row for row, dataset in duplicates.items() if dataset in draws]
    note = ""
    if len(duplicates) > len(drawn):
        note += (
            f"; {len(duplicates) - len(drawn)} rows came to more than one rank under different"
            " data-set indices: possible duplicates in the data set, not shared samples"
        )
    if drawn:
        names = sorted({duplicates[row] for row in drawn})
        which = ", ".join(f"{name}, which drew from {draws[name]} in __getitem__" for name in names)
        note += (
            f"; {len(drawn)} rows came to more than one rank under different indices of {which}:"
            " the index does not choose the sample there, so each may be one sample drawn on"
            " two ranks"
        )
    return note


@dataclass
class Loader:
    """What one map-style DataLoader handed out: loaders are numbered in the order each process
    made them, so loader N is the same on every rank running the same script."""

    number: int
    dataset: str
    sampler: str
    # pass -> rank -> the data-set indices that rank drew in that pass
    passes: dict[int, dict[int, list[int]]]
    # pass -> rank -> its DistributedSampler's seed, shuffle, num_replicas, rank, epoch
    samplers: dict[int, dict[int, dict]] = field(default_factory=dict)

    def shared(self, number: int) -> int:
        """How many samples more than one rank drew in pass `number`."""
        return len(self.shared_samples(number))

    def shared_samples(self, number: int) -> set[int]:
        """The samples more than one rank drew in pass `number`."""
        per_rank = self.passes.get(number, {})
        counts = Counter(s for samples in per_rank.values() for s in set(samples))
        return {sample for sample, c in counts.items() if c > 1}

    def overlaps(self, world_size: int) -> dict[int, int]:
        """pass -> samples drawn by more than one rank, for the passes with more than a
        DistributedSampler's padding (it pads with up to world_size - 1 repeated samples)."""
        allowed = world_size - 1 if self.sampler == "DistributedSampler" else 0
        shared = {number: self.shared(number) for number in sorted(self.passes)}
        return {number: n for number, n in shared.items() if n > allowed}

    def hint(self, number: int, world_size: int) -> str:
        """What to do about samples shared in pass `number`: from the DistributedSampler's
        arguments on each rank when it has one."""
        per_rank = self.samplers.get(number)
        if not per_rank:
            return "give the loader a DistributedSampler, or each rank a Subset of its own"

        def listed(name: str) -> str:
            return ", ".join(f"rank {rank}: {a[name]}" for rank, a in sorted(per_rank.items()))

        def differ(name: str) -> bool:
            return len({repr(a[name]) for a in per_rank.values()}) > 1

        if differ("seed"):
            return (
                f"the DistributedSampler's seed differs between ranks ({listed('seed')}):"
                " agree the seed (broadcast rank 0's)"
            )
        wrong = {
            rank: a
            for rank, a in sorted(per_rank.items())
            if a["num_replicas"] != world_size or a["rank"] != rank
        }
        if wrong:
            given = ", ".join(
                f"rank {rank}: num_replicas={a['num_replicas']} rank={a['rank']}"
                for rank, a in wrong.items()
            )
            return (
                f"the DistributedSampler's num_replicas or rank is not the process group's"
                f" ({given}; world size {world_size}): leave them out, DistributedSampler(data)"
                " takes them from the process group"
            )
        if differ("shuffle"):
            return (
                f"the DistributedSampler's shuffle differs between ranks ({listed('shuffle')}):"
                " give every rank the same"
            )
        if differ("epoch"):
            return (
                f"the DistributedSampler's epoch differs between ranks ({listed('epoch')}):"
                " call sampler.set_epoch(epoch) with the same epoch on every rank"
            )
        return (
            "every rank's DistributedSampler had the same seed, shuffle and epoch and its own"
            " rank: the indices come from elsewhere (a subclass, a Subset made per rank)"
        )


def loaders(ranks: list[Rank]) -> list[Loader]:
    """Every loader that handed out a batch, by number."""
    found: dict[int, Loader] = {}
    for r in ranks:
        for e in r.of("batch"):
            loader = found.setdefault(
                e["loader"], Loader(e["loader"], e["dataset"], e["sampler"], defaultdict(dict))
            )
            loader.passes[e["pass"]].setdefault(r.rank, []).extend(e["samples"])
    for r in ranks:
        for e in r.of("pass"):
            if e["loader"] in found:
                found[e["loader"]].samplers.setdefault(e["pass"], {})[r.rank] = e["sampler"]
    return [found[number] for number in sorted(found)]


def training_loaders(ranks: list[Rank]) -> set[int]:
    """The loaders whose batch a training forward or an optimizer step came after."""
    return {
        e["pass"][0] for r in ranks for e in [*training_forwards(r), *r.of("step")] if e.get("pass")
    }


def choosing(ranks: list[Rank]) -> dict[str, str]:
    """Data set class -> 'random', 'numpy' or both: those whose fetches drew from python's
    random or numpy's global generator, a draw that may choose the sample (torch's alone is
    most often an augmentation)."""
    found: dict[str, set[str]] = defaultdict(set)
    for r in ranks:
        for e in r.of("dataset_draws"):
            found[e["dataset"]].update(set(e["generators"]) - {"torch"})
    return {name: " and ".join(sorted(gens)) for name, gens in found.items() if gens}


def index_caveat(dataset: str, draws: dict[str, str]) -> str:
    if dataset not in draws:
        return ""
    return (
        f"; {dataset} drew from {draws[dataset]} in __getitem__: the index alone does not"
        " choose its sample, so disjoint indices do not prove disjoint samples"
    )


def summed_after(ranks: list[Rank], loader: Loader, number: int) -> str | None:
    """Where a rank put samples that another rank scored too into a sum: the first combining
    collective after its last batch of pass `number` holding one, before its next training
    forward or step. None: every rank scored them after its all-reduce."""
    shared = loader.shared_samples(number)
    for r in ranks:
        holding = [
            i
            for i, e in enumerate(r.events)
            if e["event"] == "batch"
            and e["loader"] == loader.number
            and e["pass"] == number
            and shared & set(e["samples"])
        ]
        for e in r.events[holding[-1] + 1 :] if holding else []:
            if (e["event"] == "forward" and e["training"]) or e["event"] == "step":
                break
            if e["event"] == "collective" and e["name"] in SUMMING:
                return f"rank {r.rank}'s {e['name']} at {Path(e['file']).name}:{e['line']}"
    return None


def check_loaders(ranks: list[Rank], world_size: int) -> list[Check]:
    """Training loaders: no sample drawn by two ranks in one pass (a DistributedSampler's
    padding allowed). Evaluation loaders (no training forward or step came after their
    batches), grouped by data set and sampler: samples scored on several ranks are counted,
    not failed, and told apart: scored after the all-reduce (a tail each rank scores itself)
    or summed into it. Without training records every loader counts as a training one."""
    training = training_loaders(ranks)
    draws = choosing(ranks)
    checks = []
    evaluations: dict[tuple[str, str], list[Loader]] = defaultdict(list)
    for loader in loaders(ranks):
        if training and loader.number not in training:
            evaluations[loader.dataset, loader.sampler].append(loader)
            continue
        name = (
            f"loader samples disjoint (loader {loader.number}, {loader.dataset}, {loader.sampler})"
        )
        caveat = index_caveat(loader.dataset, draws)
        users = {rank for per_rank in loader.passes.values() for rank in per_rank}
        if len(users) < 2:
            detail = f"only rank {min(users)} drew from it{caveat}"
            checks.append(Check("ok", name, detail, loader.number))
            continue
        overlaps = loader.overlaps(world_size)
        if overlaps:
            worst = max(overlaps, key=overlaps.get)
            detail = (
                f"{overlaps[worst]} samples drawn by more than one rank in pass {worst}:"
                f" {loader.hint(worst, world_size)}"
            )
            checks.append(Check("FAIL", name, detail, loader.number))
            continue
        padded = max(loader.shared(number) for number in loader.passes)
        padding = f" ({padded} repeated: the sampler's padding)" if padded else ""
        detail = f"{samples(loader)} samples over {len(loader.passes)} pass(es){padding}{caveat}"
        checks.append(Check("ok", name, detail, loader.number))
    for (dataset, sampler), group in evaluations.items():
        checks.append(check_evaluation(ranks, group, dataset, sampler, world_size, draws))
    return checks


def samples(loader: Loader) -> int:
    """The distinct samples of each pass, summed over the passes."""
    return sum(
        len({s for samples in per_rank.values() for s in samples})
        for per_rank in loader.passes.values()
    )


def check_evaluation(
    ranks: list[Rank],
    group: list[Loader],
    dataset: str,
    sampler: str,
    world_size: int,
    draws: dict[str, str],
) -> Check:
    """The evaluation loaders of one data set and sampler (a loader made each epoch is one
    more): ok, with the samples scored on more than one rank counted and told apart."""
    numbers = [loader.number for loader in group]
    listed = ", ".join(map(str, numbers[:4])) + (", ..." if len(numbers) > 4 else "")
    which = f"loader {listed}" if len(numbers) == 1 else f"loaders {listed} ({len(numbers)})"
    name = f"loader samples disjoint ({which}, {dataset}, {sampler}, evaluation)"
    caveat = index_caveat(dataset, draws)
    users = {rank for loader in group for per_rank in loader.passes.values() for rank in per_rank}
    if len(users) < 2:
        return Check("ok", name, f"only rank {min(users)} drew from it{caveat}", numbers[0])
    passes = sum(len(loader.passes) for loader in group)
    counted = f"{sum(map(samples, group))} samples over {passes} pass(es)"
    overlaps = [
        (loader, number, n) for loader in group for number, n in loader.overlaps(world_size).items()
    ]
    if not overlaps:
        padded = max(loader.shared(number) for loader in group for number in loader.passes)
        padding = f" ({padded} repeated: the sampler's padding)" if padded else ""
        return Check("ok", name, f"{counted}{padding}{caveat}", numbers[0])
    shared = sum(n for _, _, n in overlaps)
    summed = next(
        (where for loader, number, _ in overlaps if (where := summed_after(ranks, loader, number))),
        None,
    )
    scored = f"{counted}; {shared} scored on more than one rank in {len(overlaps)} pass(es)"
    if summed is None:
        detail = (
            f"{scored}, none summed across the ranks after it: each rank scored them for itself"
            " (the whole set on every rank, or a tail after the all-reduce), not a failure"
        )
    else:
        detail = (
            f"{scored}, then summed ({summed}): each counts once per rank that scored it; right"
            " only when every rank scores every sample and divides by the all-reduced count,"
            " else score them after the all-reduce, or on one rank"
        )
    return Check("ok", name, detail + caveat, numbers[0])


def check_checkpoints(ranks: list[Rank]) -> list[Check]:
    """The files the ranks wrote with torch.save: each by one rank (ranks on different hosts
    may each write a file of their own there), none holding the DDP wrapper's 'module.' keys
    or the wrapper itself. No line when nothing was saved."""
    saves = [e for r in ranks for e in r.of("save")]
    if not saves:
        return []
    writers: dict[str, dict[int, str | None]] = defaultdict(dict)
    for e in saves:
        writers[e["path"]][e["rank"]] = e.get("host")
    problems = []
    raced = {path: by for path, by in writers.items() if max(Counter(by.values()).values()) > 1}
    if raced:
        path, by = next(iter(raced.items()))
        problems.append(
            f"{len(raced)} file(s) written by more than one rank (first {Path(path).name!r}, by"
            f" ranks {sorted(by)}): they write one file at once and a reader may find it half"
            " written; save on rank 0 alone (if rank == 0), and make the others wait"
            " (dist.barrier()) before they read it"
        )
    prefixed = [e for e in saves if e.get("module_keys")]
    if prefixed:
        e = prefixed[0]
        problems.append(
            f"{Path(e['path']).name!r} holds {e['module_keys']} keys that start with 'module.'"
            f" (first {e['first_key']!r}): the DDP wrapper's state_dict, which the bare model's"
            " load_state_dict refuses; save model.module.state_dict()"
        )
    pickled = [e for e in saves if e.get("wrapper")]
    if pickled:
        problems.append(
            f"{Path(pickled[0]['path']).name!r} holds the DDP wrapper itself (torch.save of the"
            " DDP model), which torch.load refuses by default; save model.module.state_dict()"
        )
    if problems:
        return [Check("FAIL", "checkpoints", "; ".join(problems))]
    hosts = [path for path, by in writers.items() if len(by) > 1]
    shared = (
        f"; {len(hosts)} written on several hosts, by one rank on each: one file if the folder"
        " is shared between them"
        if hosts
        else ""
    )
    by_rank = sorted({e["rank"] for e in saves})
    detail = (
        f"{len(writers)} file(s) written, each by one rank (rank(s) {by_rank}), none with"
        f" 'module.' keys{shared}"
    )
    return [Check("ok", "checkpoints", detail)]


def check_draws(ranks: list[Rank]) -> list[Check]:
    """With --draws: at the same training forward, each rank's random state before it; the
    forward drew when the state after it differs. Ranks that drew from equal states drew the
    same dropout masks, the same noise: one seed for all, without + rank."""
    if not any(e.get("draws") for r in ranks for e in r.of("init")):
        return []
    wrapped, _ = ends_of(ranks)
    checks = []
    for model, module in sorted(wrapped.items()):
        name = f"draws in forward (model {model}, {module})"
        per_rank = {r.rank: [e for e in r.of("draws") if e["model"] == model] for r in ranks}
        steps = min(map(len, per_rank.values()))
        if not steps:
            detail = "no training forward recorded on every rank"
            checks.append(Check("--", name, detail, model))
            continue
        drew = [
            k
            for k in range(steps)
            if any(draws[k]["before"] != draws[k]["after"] for draws in per_rank.values())
        ]
        if not drew:
            detail = f"none of {steps} training forwards drew from torch's random generators"
            checks.append(Check("ok", name, detail, model))
            continue
        same = [k for k in drew if len({d[k]["before"] for d in per_rank.values()}) < len(ranks)]
        if not same:
            detail = (
                f"independent: each rank drew from a random state of its own at all {len(drew)}"
                " training forwards that drew"
            )
            checks.append(Check("ok", name, detail, model))
            continue
        states = Counter(d[same[0]]["before"] for d in per_rank.values())
        alike = sorted(r for r, d in per_rank.items() if states[d[same[0]]["before"]] > 1)
        who = "every rank" if len(alike) == len(ranks) else f"ranks {alike}"
        detail = (
            f"the same random state on {who} at {len(same)} of {len(drew)} training forwards"
            f" that drew (first: forward {same[0] + 1}): a seed shared without + rank; seed"
            " each rank with seed + rank after building the model"
        )
        checks.append(Check("FAIL", name, detail, model))
    return checks


def where(event: dict | None) -> str:
    if event is None:
        return "none"
    if event["event"] == "forward":
        return (
            f"in or after training forward {event['count']} (its backward's gradient"
            " all-reduce included)"
        )
    place = f"{Path(event['file']).name}:{event['line']}"
    args = f"({event['args']})" if event.get("args") else ""
    return f"{event['name']}{args} at {place} after {event['forwards']} training forwards"


def check_collectives(ranks: list[Rank]) -> Check:
    """The ranks called the same collectives (and, where recorded, with the arguments every
    rank must pass alike) in the same order. The lines they called them from may differ: a
    rank-0-first pattern calls one barrier from two places; listed, not failed."""
    calls = {r.rank: r.of("collective") for r in ranks}
    keys = {rank: [(e["name"], e.get("args")) for e in es] for rank, es in calls.items()}
    longest = max(len(k) for k in keys.values())
    for i in range(longest):
        entered = {rank: k[i] if i < len(k) else None for rank, k in keys.items()}
        if len(set(entered.values())) > 1:
            described = "; ".join(
                f"rank {rank} {where(calls[rank][i] if i < len(calls[rank]) else None)}"
                for rank in entered
            )
            return Check("FAIL", "same collectives", f"collective {i + 1}: {described}")
    places = Counter(
        f"{e['name']} at {Path(e['file']).name}:{e['line']}" for e in calls[ranks[0].rank]
    )
    listed = ", ".join(f"{place} x{n}" for place, n in places.most_common(4))
    more = ", ..." if len(places) > 4 else ""
    detail = f"{longest} on every rank, in the same order" + (
        f" ({listed}{more})" if listed else ""
    )
    moved = [
        i
        for i in range(longest)
        if len({(es[i]["file"], es[i]["line"]) for es in calls.values()}) > 1
    ]
    if moved:
        first = moved[0]
        at: dict[str, list[int]] = defaultdict(list)
        for rank, es in calls.items():
            at[f"{Path(es[first]['file']).name}:{es[first]['line']}"].append(rank)
        sites = ", ".join(
            f"rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} at {place}"
            for place, rs in at.items()
        )
        detail += (
            f"; the same sequence from different lines at {len(moved)} of them (first:"
            f" collective {first + 1}, {calls[ranks[0].rank][first]['name']}: {sites})"
        )
    return Check("ok", "same collectives", detail)


def last_events(ranks: list[Rank]) -> list[str]:
    """Where each rank was when its records stop: the place a hang or a crash happened."""
    lines = []
    for r in ranks:
        last, count = None, 0
        for e in r.events:
            if e["event"] == "forward" and e["training"]:
                count += 1
                last = dict(e, count=count)
            elif e["event"] == "collective":
                last = e
        ended = "exited" if r.of("exit") else "was killed or is still running"
        lines.append(f"rank {r.rank} {ended}; its last record: {where(last)}")
    return lines


def deadline_line(ranks: list[Rank]) -> str | None:
    """What --deadline set, from the init records: None without it."""
    inits = [r.of("init")[0] for r in ranks]
    deadline = next((e["deadline"] for e in inits if e.get("deadline")), None)
    if deadline is None:
        return None
    given = [e for e in inits if e.get("timeout_by") == "deadline"]
    own = [e["timeout"] for e in inits if e.get("timeout_by") == "script"]
    values = ", ".join(f"{t:g}" for t in sorted(set(own)))
    kept = f", the script's own kept on {len(own)} ({values} s)" if own else ""
    return (
        f"deadline {deadline:g} s: init_process_group timeout {deadline:g} s on {len(given)} of"
        f" {len(inits)} ranks{kept}; the launch ends after {2 * deadline:g} s without a record"
    )


def few(found: dict[str, list[int]]) -> str:
    """'Net, built at a.py:3 (rank(s) [0]), ...': the first 3, and how many more."""
    named = [f"{key} (rank(s) {by})" for key, by in found.items()]
    more = f", and {len(named) - 3} more" if len(named) > 3 else ""
    return ", ".join(named[:3]) + more


def report(
    directory: Path, returncode: int = 0, ended: str | None = None
) -> tuple[list[str], list[Check]]:
    """The report's lines and its checks, from the records in `directory`; `ended`: why this
    command ended the launch itself (a signal, --deadline), None when it ended on its own."""
    ranks, world_size = read(directory)
    if not ranks:
        lines = ["no process joined a process group: nothing to check (is this a DDP run?)"]
        if ended:
            lines.append(f"ended the launch: {ended}")
        return lines, [Check("--", "process group", "none")]
    modules = sorted({f"{e['module']}" for r in ranks for e in r.of("wrap")})
    backend = ranks[0].of("init")[0]["backend"]
    lines = [
        f"{len(ranks)} of {world_size} ranks recorded, backend {backend}; wrapped in DDP:"
        f" {', '.join(modules) or 'nothing'}"
    ]
    if len(ranks) < world_size:
        lines.append("(some ranks left no records: they never reached init_process_group)")
    deadline = deadline_line(ranks)
    if deadline:
        lines.append(deadline)
    checks = [
        *check_replicas(ranks),
        *check_buffers(ranks),
        *check_unwrapped(ranks),
        *check_gradients(ranks, world_size),
        check_steps(ranks),
        check_inputs(ranks, world_size),
        *check_loaders(ranks, world_size),
        *check_checkpoints(ranks),
        check_collectives(ranks),
        *check_draws(ranks),
    ]
    lines += [c.line() for c in checks]
    if ended:
        lines.append(f"ended the launch: {ended}")
    if ended or returncode != 0 or not all(r.of("exit") for r in ranks):
        lines.append(f"the run failed (exit status {returncode}); where each rank stopped:")
        lines += ["  " + line for line in last_events(ranks)]
    drawn = any(e.get("draws") for r in ranks for e in r.of("init"))
    lines.append("not checked:")
    items = [*NOT_CHECKED, DRAWN if drawn else NOT_DRAWN]
    draws = choosing(ranks)
    if draws:
        named = ", ".join(f"{name} ({gens})" for name, gens in draws.items())
        items.append(
            f"what the data sets that draw in __getitem__ chose: {named}; where the draw"
            " chooses the sample, disjoint indices are not disjoint samples, and"
            " torch.manual_seed seeds neither python's random nor numpy outside the loader's"
            " worker processes (the DataLoader seeds all three in each worker)"
        )
    alone = {key: sorted(by) for key, by in unwrapped(ranks).items() if len(by) < len(ranks)}
    if alone:
        items.append(f"modules that DDP does not wrap, recorded on some ranks only: {few(alone)}")
    alone = {key: sorted(by) for key, by in trainings(ranks).items() if len(by) < len(ranks)}
    if alone and world_size > 1:
        items.append(f"training outside DDP on some ranks only: {few(alone)}")
    lines += ["  - " + item for item in items]
    return lines, checks


# ---- running the launch --------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            children[int(stat.read_text().rsplit(")", 1)[1].split()[1])].append(
                int(stat.parent.name)
            )
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def recording_into(directory: Path) -> list[int]:
    """Processes whose environment names this run's records folder: the launch's, orphans and
    loader workers included, whoever their parent is now."""
    entry = f"DDP_CHECK_DIR={directory}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError, ValueError):
            if (
                entry in environ.read_bytes().split(b"\0")
                and int(environ.parent.name) != os.getpid()
            ):
                found.append(int(environ.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def stop(process: subprocess.Popen, directory: Path, received: list[int]) -> None:
    """End the launch: SIGTERM to its process group (what every launcher takes as "end the job":
    torchrun passes it on to its ranks, srun to its tasks; a Ctrl-C would only make srun report),
    then, after GRACE seconds (or at one more signal), SIGKILL to every process of it left: the
    group, the processes below it (torchrun starts each rank in a session of its own: found
    before the launcher exits and orphans them) and those whose environment names the records
    folder."""
    victims = set(descendants(process.pid))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    waited, signals = time.monotonic() + GRACE, len(received)
    while process.poll() is None and time.monotonic() < waited and len(received) == signals:
        time.sleep(0.1)
    victims |= set(descendants(process.pid)) | set(recording_into(directory))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    # a killed process may still be running for a moment: its records are whole once it is gone
    waited = time.monotonic() + GRACE
    while any(map(alive, victims)) and time.monotonic() < waited:
        time.sleep(0.1)


def newest_record(directory: Path) -> float | None:
    """When a process last appended a record (None before the first)."""
    times = [e.stat().st_mtime for e in os.scandir(directory) if e.name.endswith(".jsonl")]
    return max(times, default=None)


def run(
    command: list[str], directory: Path, deadline: float | None = None, draws: bool = False
) -> tuple[int, str | None, int | None]:
    """Run the launch with the recorder: its exit status, why this command ended it (None when
    it ended on its own), and this command's exit status for that (None when it ended alone)."""
    env = dict(os.environ, DDP_CHECK_DIR=str(directory))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    if deadline:
        env["DDP_CHECK_DEADLINE"] = f"{deadline:g}"
    if draws:
        env["DDP_CHECK_DRAWS"] = "1"
    received: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum)) for s in signals}
    try:
        # A session of its own: a Ctrl-C reaches this process alone, which ends the launch's
        # processes together, then reports.
        process = subprocess.Popen(command, env=env, start_new_session=True)
        while process.poll() is None:
            if received:
                name = signal.Signals(received[0]).name
                stop(process, directory, received)
                return process.returncode, f"{name} to ddp_check", 128 + received[0]
            newest = newest_record(directory) if deadline else None
            if newest is not None and time.time() - newest > 2 * deadline:
                stop(process, directory, received)
                silent = f"no process recorded anything for {2 * deadline:g} s"
                return process.returncode, f"{silent} (--deadline {deadline:g})", DEADLINE_STATUS
            time.sleep(0.2)
        return process.returncode, None, None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def not_found(command: list[str]) -> str:
    """What to say when the launch's program is not found; for torchrun, the same launch
    through Python's module, which needs no torchrun on PATH."""
    program = command[0]
    if Path(program).name != "torchrun":
        return f"cannot run {program!r}: no such program (not on PATH)"
    # this command's own options and path, before the launch
    own = sys.argv[: len(sys.argv) - len(command)]
    torch = importlib.util.find_spec("torch") is not None
    python = sys.executable if torch else "python"
    same = shlex.join(["python", *own, python, "-m", "torch.distributed.run", *command[1:]])
    where = "" if torch else " (with a Python that has torch: this one has none)"
    return (
        f"cannot run {program!r}: not on PATH; Python's module is the same launcher: {same}{where}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage=(
            "%(prog)s [--keep DIR] [--deadline S] [--draws] COMMAND ... | %(prog)s --report DIR"
        ),
    )
    parser.add_argument("--report", type=Path, help="report on the records in DIR; run nothing")
    parser.add_argument("--keep", type=Path, help="record into DIR (kept), not a temporary one")
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="S",
        help="collective timeout S s (when the script gives none); end after 2 x S s unrecorded",
    )
    parser.add_argument(
        "--draws", action="store_true", help="record the random state around training forwards"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launch, e.g. torchrun ...")
    args = parser.parse_args()
    if bool(args.report) == bool(args.command):
        parser.error("give a command to run, or --report DIR")
    if args.report and (args.deadline or args.draws or args.keep):
        parser.error("--deadline, --draws and --keep go with a command, not --report")
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline {args.deadline:g}: give a number of seconds above 0")
    ended, status = None, None
    if args.report:
        if not args.report.is_dir():
            parser.error(f"--report {args.report}: no such folder")
        directory, returncode = args.report, 0
    else:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            if any(args.keep.iterdir()):
                parser.error(f"--keep {args.keep}: the folder must be empty")
        if shutil.which(args.command[0]) is None:
            parser.error(not_found(args.command))
        directory = (args.keep or Path(tempfile.mkdtemp(prefix="ddp_check_"))).resolve()
        try:
            returncode, ended, status = run(args.command, directory, args.deadline, args.draws)
        except OSError as error:
            parser.error(f"cannot run {args.command[0]!r}: {error.strerror}")
    try:
        lines, checks = report(directory, returncode, ended)
    except RecordsError as error:
        sys.stderr.write(f"ddp_check: error: {error}\n")
        return 2
    finally:
        if not (args.report or args.keep):
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()
    sys.stdout.write("".join(f"ddp_check: {line}\n" for line in lines))
    sys.stdout.flush()
    if status is not None:
        return status
    if returncode:
        return returncode
    # 1 when a check failed, or when none could be made
    failed = any(c.status == "FAIL" for c in checks)
    return 1 if failed or all(c.status == "--" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
