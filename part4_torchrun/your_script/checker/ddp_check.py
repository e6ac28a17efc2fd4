"""Check a DDP run of any training script, without changing the script.

Put this command in front of the launch. It runs the launch with the recorder (sitecustomize.py,
beside this file) loaded into every process, then prints what the records prove: the replicas
ended equal, every rank trained the same number of steps on inputs no other rank saw, and the
ranks entered the same collectives in the same order; and what it could not check.

    python part4_torchrun/your_script/checker/ddp_check.py \
        torchrun --standalone --nproc_per_node=2 my_script.py --epochs 1

Or record with environment variables alone (an empty folder), and report later:

    PYTHONPATH=part4_torchrun/your_script/checker DDP_CHECK_DIR=runs/check \
        torchrun --standalone --nproc_per_node=2 my_script.py --epochs 1
    python part4_torchrun/your_script/checker/ddp_check.py --report runs/check

Exit status: the launch's own when it failed; else 1 when a check failed or none could be made;
else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

NOT_CHECKED = [
    "what the script computes with its collectives: whether a metric or a decision is global"
    " (the collectives are listed, not understood)",
    "DDP's own gradient all-reduce: it runs in C++ hooks, outside torch.distributed's functions",
    "inputs made inside forward; samples that random augmentation made look new (the loaders'"
    " indices cover map-style DataLoaders); without a DataLoader, repeats in different steps",
    "that dim 0 of forward's first input is the batch, and the order or continuity of a stream",
    "the optimizer's state (momentum) and anything outside the DDP-wrapped modules",
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


def read(directory: Path) -> tuple[list[Rank], int | None]:
    """The processes that joined a process group, by rank, and the world size."""
    ranks: dict[int, Rank] = {}
    world_size = None
    for path in sorted(directory.glob("*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        inits = [e for e in events if e["event"] == "init"]
        if not inits:
            continue  # the launcher, a loader worker: no process group
        rank = inits[0]["rank"]
        if rank in ranks:
            raise RecordsError(
                f"rank {rank} appears in two processes ({ranks[rank].pid}, {path.stem}): a restart,"
                " or an earlier run's records; give DDP_CHECK_DIR an empty folder"
            )
        ranks[rank] = Rank(rank, int(path.stem), events)
        world_size = inits[0]["world_size"]
    return [ranks[r] for r in sorted(ranks)], world_size


def training_forwards(rank: Rank, model: int | None = None) -> list[dict]:
    return [
        e for e in rank.of("forward") if e["training"] and (model is None or e["model"] == model)
    ]


def check_replicas(ranks: list[Rank]) -> list[Check]:
    ends: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in ranks:
        for e in r.of("end"):
            ends[e["model"]][r.rank] = e
    wrapped = {e["model"]: e["module"] for r in ranks for e in r.of("wrap")}
    if not wrapped:
        return [Check("--", "replicas equal", "no module was wrapped in DistributedDataParallel")]
    checks = []
    for model, module in sorted(wrapped.items()):
        name = f"replicas equal (model {model}, {module})"
        missing = [r.rank for r in ranks if r.rank not in ends[model]]
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
        digests = {rank: dict(map(tuple, e["params"])) for rank, e in ends[model].items()}
        names = [n for n, _ in ends[model][ranks[0].rank]["params"]]
        differing = [n for n in names if len({d.get(n) for d in digests.values()}) > 1]
        if not differing:
            detail = (
                f"{len(names)} parameter tensors bit-equal on all {len(ranks)} ranks at the end"
            )
            checks.append(Check("ok", name, detail, model))
            continue
        # torch only here: reading the saved parameters (importing it takes seconds)
        import torch

        saved = {rank: torch.load(e["saved"], weights_only=True) for rank, e in ends[model].items()}
        reference = saved[ranks[0].rank]
        drift = max(
            (tensors[n].double() - reference[n].double()).abs().max().item()
            for tensors in saved.values()
            for n in differing
        )
        detail = (
            f"{len(differing)} of {len(names)} parameter tensors differ at the end, first"
            f" {differing[0]!r}; max |difference| between ranks {drift:.4g}"
        )
        checks.append(Check("FAIL", name, detail, model))
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
    rank than its first copy: that many shared rows are allowed in a pass it drew."""
    samplers = {e["loader"]: e["sampler"] for r in ranks for e in r.of("batch")}
    owners: dict[tuple, dict[str, tuple[int, int]]] = defaultdict(dict)
    shared: dict[tuple, set[str]] = defaultdict(set)
    distinct: set[str] = set()
    total, examples = 0, {}
    for r in ranks:
        for index, e in enumerate(training_forwards(r)):
            epoch = ("pass", *e["pass"]) if e.get("pass") else ("step", index)
            for row in e["rows"]:
                total += 1
                distinct.add(row)
                first = owners[epoch].setdefault(row, (r.rank, index))
                if first[0] != r.rank:
                    shared[epoch].add(row)
                    examples.setdefault(epoch, (first, r.rank))
    if not total:
        return Check("--", "inputs disjoint", "no training forward with a tensor input")

    def padding(epoch: tuple) -> int:
        padded = epoch[0] == "pass" and samplers.get(epoch[1]) == "DistributedSampler"
        return world_size - 1 if padded else 0

    over = [epoch for epoch, rows in shared.items() if len(rows) > padding(epoch)]
    if not over:
        padded = max(map(len, shared.values()), default=0)
        note = f" (up to {padded} a pass: a DistributedSampler's padding)" if padded else ""
        return Check(
            "ok",
            "inputs disjoint",
            f"{len(distinct)} distinct rows (dim 0 of forward's first input) in {total}; none"
            f" went to two ranks in one epoch (a loader's pass, else a step){note}",
        )
    rows = set().union(*(shared[epoch] for epoch in over))
    (rank, index), other = examples[over[0]]
    return Check(
        "FAIL",
        "inputs disjoint",
        f"{len(rows)} of {len(distinct)} distinct rows went to more than one rank in one"
        f" epoch (first: rank {rank}'s training forward {index + 1}, also on rank {other})",
    )


@dataclass
class Loader:
    """What one map-style DataLoader handed out: loaders are numbered in the order each process
    made them, so loader N is the same on every rank running the same script."""

    number: int
    dataset: str
    sampler: str
    # pass -> rank -> the data-set indices that rank drew in that pass
    passes: dict[int, dict[int, list[int]]]

    def shared(self, number: int) -> int:
        """How many samples more than one rank drew in pass `number`."""
        per_rank = self.passes.get(number, {})
        counts = Counter(s for samples in per_rank.values() for s in set(samples))
        return sum(1 for c in counts.values() if c > 1)

    def overlaps(self, world_size: int) -> dict[int, int]:
        """pass -> samples drawn by more than one rank, for the passes with more than a
        DistributedSampler's padding (it pads with up to world_size - 1 repeated samples)."""
        allowed = world_size - 1 if self.sampler == "DistributedSampler" else 0
        shared = {number: self.shared(number) for number in sorted(self.passes)}
        return {number: n for number, n in shared.items() if n > allowed}


def loaders(ranks: list[Rank]) -> list[Loader]:
    """Every loader that handed out a batch, by number."""
    found: dict[int, Loader] = {}
    for r in ranks:
        for e in r.of("batch"):
            loader = found.setdefault(
                e["loader"], Loader(e["loader"], e["dataset"], e["sampler"], defaultdict(dict))
            )
            loader.passes[e["pass"]].setdefault(r.rank, []).extend(e["samples"])
    return [found[number] for number in sorted(found)]


def check_loaders(ranks: list[Rank], world_size: int) -> list[Check]:
    checks = []
    for loader in loaders(ranks):
        name = (
            f"loader samples disjoint (loader {loader.number}, {loader.dataset}, {loader.sampler})"
        )
        users = {rank for per_rank in loader.passes.values() for rank in per_rank}
        if len(users) < 2:
            detail = f"only rank {min(users)} drew from it"
            checks.append(Check("ok", name, detail, loader.number))
            continue
        overlaps = loader.overlaps(world_size)
        if overlaps:
            worst = max(overlaps, key=overlaps.get)
            detail = (
                f"{overlaps[worst]} samples drawn by more than one rank in pass {worst}: give the"
                " loader a DistributedSampler, or each rank a Subset of its own"
            )
            checks.append(Check("FAIL", name, detail, loader.number))
            continue
        padded = max(loader.shared(number) for number in loader.passes)
        padding = f" ({padded} repeated: the sampler's padding)" if padded else ""
        total = sum(
            len({s for samples in per_rank.values() for s in samples})
            for per_rank in loader.passes.values()
        )
        detail = f"{total} samples over {len(loader.passes)} pass(es){padding}"
        checks.append(Check("ok", name, detail, loader.number))
    return checks


def where(event: dict | None) -> str:
    if event is None:
        return "none"
    if event["event"] == "forward":
        return f"in training forward {event['count']} (or in its backward's gradient all-reduce)"
    place = f"{Path(event['file']).name}:{event['line']}"
    return f"{event['name']} at {place} after {event['forwards']} training forwards"


def check_collectives(ranks: list[Rank]) -> Check:
    calls = {r.rank: r.of("collective") for r in ranks}
    keys = {rank: [(e["name"], e["file"], e["line"]) for e in es] for rank, es in calls.items()}
    longest = max(len(k) for k in keys.values())
    for i in range(longest):
        entered = {rank: k[i] if i < len(k) else None for rank, k in keys.items()}
        if len(set(entered.values())) > 1:
            described = "; ".join(
                f"rank {rank} {where(calls[rank][i] if i < len(calls[rank]) else None)}"
                for rank in entered
            )
            return Check("FAIL", "same collectives", f"collective {i + 1}: {described}")
    places = Counter(f"{name} at {Path(file).name}:{line}" for name, file, line in keys[0])
    listed = ", ".join(f"{place} x{n}" for place, n in places.most_common(4))
    more = ", ..." if len(places) > 4 else ""
    return Check(
        "ok",
        "same collectives",
        f"{longest} on every rank, in the same order" + (f" ({listed}{more})" if listed else ""),
    )


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


def report(directory: Path, returncode: int = 0) -> tuple[list[str], list[Check]]:
    """The report's lines and its checks, from the records in `directory`."""
    ranks, world_size = read(directory)
    if not ranks:
        lines = ["no process joined a process group: nothing to check (is this a DDP run?)"]
        return lines, [Check("--", "process group", "none")]
    modules = sorted({f"{e['module']}" for r in ranks for e in r.of("wrap")})
    backend = ranks[0].of("init")[0]["backend"]
    lines = [
        f"{len(ranks)} of {world_size} ranks recorded, backend {backend}; wrapped in DDP:"
        f" {', '.join(modules) or 'nothing'}"
    ]
    if len(ranks) < world_size:
        lines.append("(some ranks left no records: they never reached init_process_group)")
    checks = [
        *check_replicas(ranks),
        check_steps(ranks),
        check_inputs(ranks, world_size),
        *check_loaders(ranks, world_size),
        check_collectives(ranks),
    ]
    lines += [c.line() for c in checks]
    if returncode != 0 or not all(r.of("exit") for r in ranks):
        lines.append(f"the run failed (exit status {returncode}); where each rank stopped:")
        lines += ["  " + line for line in last_events(ranks)]
    lines.append("not checked:")
    lines += ["  - " + item for item in NOT_CHECKED]
    return lines, checks


def run(command: list[str], directory: Path) -> int:
    env = dict(os.environ, DDP_CHECK_DIR=str(directory))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the launch as well; torchrun stops its workers. Then report.
        return process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s [--keep DIR] COMMAND ... | %(prog)s --report DIR",
    )
    parser.add_argument("--report", type=Path, help="report on the records in DIR; run nothing")
    parser.add_argument("--keep", type=Path, help="record into DIR (kept), not a temporary one")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launch, e.g. torchrun ...")
    args = parser.parse_args()
    if bool(args.report) == bool(args.command):
        parser.error("give a command to run, or --report DIR")
    if args.report:
        if not args.report.is_dir():
            parser.error(f"--report {args.report}: no such folder")
        directory, returncode = args.report, 0
    else:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            if any(args.keep.iterdir()):
                parser.error(f"--keep {args.keep}: the folder must be empty")
        directory = args.keep or Path(tempfile.mkdtemp(prefix="ddp_check_"))
        try:
            returncode = run(args.command, directory)
        except FileNotFoundError as error:
            parser.error(f"cannot run {args.command[0]!r}: {error.strerror}")
    try:
        lines, checks = report(directory, returncode)
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
    if returncode:
        return returncode
    # 1 when a check failed, or when none could be made
    failed = any(c.status == "FAIL" for c in checks)
    return 1 if failed or all(c.status == "--" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
