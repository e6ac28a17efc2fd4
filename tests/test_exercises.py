"""The exercise autograder (tests/autograder/), specified by grading: the model solutions pass at
2 and 3 ranks, the starting point fails at step 1, and mistakes planted in a solution (from
grade_mutants.py's gallery) fail at their step with their cause in the report's first line.

To grade your own script instead (exercises/README.md, "The autograder"):

    DDP_EXERCISE_SCRIPT=exercises/mnist_classify_ddp.py \\
        python -m pytest tests/test_exercises.py -k autograde
    DDP_EXERCISE_SCRIPT=my_torchrun_version.py DDP_EXERCISE_LAUNCHER=torchrun \\
        DDP_EXERCISE_WORLD=3 python -m pytest tests/test_exercises.py -k autograde

The srun-style script runs outside Slurm too: the grader starts one process per task with the
variables srun would set (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS) plus MASTER_ADDR/PORT and
OMP_NUM_THREADS (the cores shared among the tasks), which the job script exports.
"""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from autograder.causes import collective_only_some_reach
from autograder.claims import failing, first_failure, grade
from autograder.report import report
from autograder.run import (
    GRADE_EPOCHS,
    SOLUTIONS,
    STARTING_POINT,
    Target,
    Training,
    graded_targets,
    train,
)
from conftest import REPO, Probe, checker, with_environ
from grade_mutants import MUTANTS, plant
from mnist_data import (  # noqa: F401  (the *_root names are pytest fixtures)
    SMALL_TEST,
    SMALL_TRAIN,
    grading_root,
    mnist_root,
    small_root,
)

SMALL = (SMALL_TRAIN, SMALL_TEST)


@pytest.mark.parametrize("target", graded_targets(), ids=str)
def test_autograde(
    target: Target,
    grading_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    """Every claim (autograder/claims.py) holds for the script, launched as a learner launches
    it. The report is printed (conftest.py shows it when grading a learner's script): every
    claim with its evidence, or the first failure, first and last."""
    t = train(target, grading_root, tmp_path, probe_dir, GRADE_EPOCHS, workers=target.workers)
    findings = grade(t)
    print(report(findings, t))
    failed = first_failure(findings)
    if failed:
        pytest.fail(failed.headline, pytrace=False)
    if target.workers is None:
        # Graded with the script's default loader settings: worker processes feed the training
        # batches, and neither loader forks them from the rank, whose threads may hold locks.
        workers = {e["workers"] for e in t.probe.events("batch") if e["loader"] == 0}
        assert workers and 0 not in workers, f"training loader worker processes: {workers}"
        starts = {e["loader"]: e["start"] for e in t.probe.events("batch")}
        assert "fork" not in starts.values(), f"start method of each loader's workers: {starts}"
    if target.script in SOLUTIONS.values():
        checker_agrees_with_the_probe(t)


def checker_agrees_with_the_probe(t: Training) -> None:
    """The course's checker (part4_torchrun/your_script/checker/), which recorded beside the
    probe, on the course's own solutions: every check holds (inputs disjoint too, with a
    DistributedSampler's padding on 3 ranks), and it counts what the probe counts."""
    assert {c.status for c in t.checks} == {"ok"}, [c.line() for c in t.checks]
    batches = {
        len([e for e in t.probe.events("batch") if e["rank"] == rank and e["loader"] == 0])
        for rank in range(t.world)
    }
    (steps,) = t.checked("same steps")
    assert len(batches) == 1 and steps.detail.endswith(f"(model 0: {batches.pop()})"), steps
    calls = [e for e in t.probe.events("collective") if e["rank"] == 0]
    (collectives,) = t.checked("same collectives")
    assert collectives.detail.startswith(f"{len(calls)} on every rank"), collectives
    (training,) = t.checked("loader samples disjoint (loader 0, MNIST, DistributedSampler)")
    assert training.detail.startswith(f"{t.epochs * t.train_digits} samples over"), training
    # The parameters each recorded for rank 0 at the end: the same tensors.
    ranks, _ = checker().read(t.check_dir)
    (end,) = ranks[0].of("end")
    saved = torch.load(end["saved"], weights_only=True)
    assert all(map(torch.equal, saved.values(), t.params()[0])), "the two recorders agree"


def test_the_solutions_build_their_loaders_alike() -> None:
    """What lets test_autograde grade the loaders' default worker processes on one solution:
    the torchrun solution builds its loaders with the srun one's code."""

    def build_loaders(script: str) -> str:
        text = (REPO / script).read_text()
        tree = ast.parse(text)
        (found,) = [n for n in tree.body if getattr(n, "name", None) == "build_loaders"]
        return ast.get_source_segment(text, found)

    assert build_loaders(SOLUTIONS["srun"]) == build_loaders(SOLUTIONS["torchrun"])


def test_starting_point_fails_at_step_1(
    small_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    """The unmodified exercise runs (serially, in both tasks): the report opens on step 1, and
    each claim a missing step breaks fails with that step's cause. (The first step's gradient
    is right: both processes draw the same first batch, so averaging would change nothing.)"""
    target = Target("srun", STARTING_POINT)
    t = train(target, small_root, tmp_path, probe_dir, 1, SMALL, workers=0)
    assert t.run.returncode == 0, t.run.describe()
    findings = grade(t)
    text = report(findings, t)
    assert text.startswith("step 1: no process called dist.init_process_group()"), text
    failed = failing(findings)
    broken = {"group", "printing", "in_sync", "shards", "test_shares", "counts", "checkpoint"}
    assert broken == failed.keys() - {"accuracy"}, text
    assert "no DistributedSampler" in failed["shards"].text, text
    assert "the whole test set" in failed["test_shares"].text, text
    assert "rank 0's own counts" in failed["counts"].text, text
    assert "by ranks [0, 1]" in failed["checkpoint"].text, text


# The suite's share of the mutant gallery (python tests/grade_mutants.py grades them all, each
# alone): a run per mistake that must open the report, with mistakes whose claims come later
# planted beside it (each must fail its own claim with its cause). A crash after the last epoch
# leaves every claim before it to check. ("every rank saves" is the starting point's own
# mistake.) On 400 digits for 2 epochs, with no loader workers, at the grader's batch per rank
# (32 on 2 ranks, 21 on 3): these runs show mistakes, they do not learn. The second half: what
# training computes, beside what DDP computes (an impossible figure, the batch asked for, train
# mode, one batch per step, the optimizer on the trained model), and causes that another
# rank's error or a later step's crash would hide.
PLANTED = {
    "loss divided by the world size": [
        "sampler seeded with the rank",
        "no set_epoch",
        "test set split by a DistributedSampler",
        "checkpoint of the DDP wrapper",
    ],
    "world size hard-coded in the sampler": [],
    "progress bar object on rank 0 only": [],
    "checkpoint read back with no barrier": [
        "training sampler with shuffle=False",
        "test set not split",
        "training counts not summed",
    ],
    "test counts not summed": ["loss all-reduced in place before backward()"],
    "batch split by the world size, lr scaled": [],
    "no model.train() in the epoch loop": ["scheduler stepped on rank 0 only"],
    "gradients of 2 batches summed per step": [],
    "optimizer built on another model": [],
    "evaluation and its all_reduce on rank 0 only": [],
    "no DDP wrap, the save unwraps": [],
    "ranks seeded apart, init_sync=False": [],
    # Causes named from what the records show (each opens its own report: a launch each).
    "zero_grad() between backward() and step()": [],
    "model wrapped twice": ["optimizer.step() on rank 0 only"],
    "correct predictions summed twice": [],
}

# Where a mistake is a race, rank 0's torch.save waits this long: a read that no barrier
# orders after it then loses the race every time.
SLOW_SAVE = {"DDP_PROBE_SAVE_DELAY_S": "3"}


@pytest.mark.parametrize("first", PLANTED)
def test_planted_mistakes_fail_at_their_step_with_their_cause(
    first: str,
    small_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    """The first mistake opens the report: its step, its cause and (for a crash) its
    exception, on the first line and only there, in ten lines; every mistake fails its own
    claim with its cause, and no other claim fails."""
    mutants = [MUTANTS[first], *(MUTANTS[name] for name in PLANTED[first])]
    edits = tuple(edit for mutant in mutants for edit in mutant.edits)
    script = plant(SOLUTIONS["srun"], edits, tmp_path / "planted.py")
    target = Target("srun", str(script), mutants[0].world)
    env = SLOW_SAVE if mutants[0].claim == "read_after_write" else None
    t = train(target, small_root, tmp_path, probe_dir, 2, SMALL, workers=0, env=env)
    findings = grade(t)
    text = report(findings, t)
    lines = text.splitlines()
    assert mutants[0].opens(lines[0]), text
    assert text.count(lines[0]) == 1 and len(lines) <= 10, text
    if env:
        # The read lost the race: the file was not there yet.
        assert "it crashed: FileNotFoundError" in lines[0], text
    failed = failing(findings)
    for mutant in mutants:
        assert mutant.says in failed[mutant.claim].text, text
    # Nothing else fails, but what a mistake breaks besides its claim; a crash fails the run.
    broken = {claim for m in mutants for claim in (m.claim, *m.also)}
    assert failed.keys() <= broken | {"run", "accuracy"}, text


# A test-loader worker of rank 1 that does not answer for 20 s (its worker_init_fn waits), as
# a worker forked while another thread of the rank held a lock does, forever. That loader
# alone has a worker process: the others start none, which spares the launch four processes.
STUCK_WORKER = (
    (
        "class Net(nn.Module):",
        "def stuck(worker_id):\n    end = time.time() + 60\n"
        "    while time.time() < end:\n        time.sleep(0.2)\n\n\nclass Net(nn.Module):",
    ),
    (
        "    train_loader = DataLoader(train_set, batch_size, sampler=sampler, **kwargs)",
        "    train_loader = DataLoader(train_set, batch_size, sampler=sampler)",
    ),
    (
        "    test_loader = DataLoader(test_set, 1000, **kwargs)",
        "    test_loader = DataLoader(test_set, 1000, **(kwargs if rank == 1 else {}),"
        " worker_init_fn=stuck if rank == 1 else None)",
    ),
)


@pytest.mark.slow
def test_grader_tells_a_hung_loader_worker_from_a_collective_some_ranks_skip(
    small_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    """A correct script whose loader worker hangs: rank 0 waits in the test all_reduce until
    its timeout. The report blames the worker, not the placement of the collective."""
    script = plant(SOLUTIONS["srun"], STUCK_WORKER, tmp_path / "stuck_worker.py")

    def stuck() -> bool:
        # In place: rank 1's last record is a batch handed to its worker, while rank 0 has
        # gone on to a collective that rank 1 has not reached. The job would not end by itself
        # in time here (it outlived 180 s): 5 s later the launch's timeout ends it, within the
        # stuck worker's 60 s.
        probe = Probe.read(probe_dir)
        records = {r: [e for e in probe.records if e["pid"] == p] for r, p in probe.ranks().items()}
        if len(records) < 2 or not records[1]:
            return False
        calls = {r: sum(e["event"] == "collective" for e in got) for r, got in records.items()}
        last = records[1][-1]
        return last["event"] == "batch" and bool(last["workers"]) and calls[0] > calls[1]

    target = Target("srun", str(script))
    t = train(
        target,
        small_root,
        tmp_path,
        probe_dir,
        1,
        SMALL,
        collective_timeout_s=10,
        launch_timeout=5,
        in_place=stuck,
    )
    text = report(grade(t), t)
    headline = text.splitlines()[0]
    assert headline.startswith("run: a DataLoader worker process hung (fork after threads)"), text
    assert 'multiprocessing_context="spawn"' in headline, text
    assert "if rank == 0" not in headline, text
    # Nothing of the run is left, the stuck worker included.
    left = with_environ(f"DDP_PROBE_DIR={probe_dir}")
    assert not left, f"processes left running: {left}\n{text}"


def test_a_line_goes_by_its_own_step_tag() -> None:
    """A crash or a hang is blamed on the step whose tag covers its line: the line's own tag,
    the tag comment right above it, or the first line of the statement it continues; a line
    added under a tagged `if` goes by its own line (no step), not by the tag above it."""
    script = plant(
        SOLUTIONS["srun"],
        MUTANTS["a barrier on rank 0 after the epoch line"].edits,
        Path(tempfile.mkdtemp()) / "planted.py",
    )
    t = Training.__new__(Training)
    t.__dict__["lines"] = script.read_text().splitlines()
    number = {text.strip(): n for n, text in enumerate(t.lines, 1)}
    barrier = next(n for n, text in enumerate(t.lines, 1) if text == "            dist.barrier()")
    assert t.step_of(barrier) is None
    assert t.step_of(number["dist.all_reduce(test_totals)  # step 3"]) == "step 3"
    # under a tag comment, and a statement's second line
    sampler = next(n for n, text in enumerate(t.lines, 1) if "DistributedSampler(train_set" in text)
    assert t.step_of(sampler) == "step 3"
    call = next(n for n, text in enumerate(t.lines, 1) if text.strip().startswith("totals = train"))
    assert t.step_of(call + 1) == t.step_of(call)
    # the epoch line itself: under `if rank == 0:`, whose comment has the tag
    assert t.step_of(barrier - 1) is None


def test_a_hang_names_every_rank_that_waits() -> None:
    """At 3 ranks, rank 0 in a barrier the others never reach: the report names the rank that
    called it and both that did not, each with where it was last (records built by hand)."""
    script = REPO / SOLUTIONS["srun"]
    lines = script.read_text().splitlines()
    barrier = lines.index("        dist.barrier()  # step 5") + 1
    reduce = lines.index("        dist.all_reduce(totals)") + 1

    def call(pid: int, line: int, name: str) -> dict:
        return {"event": "collective", "pid": pid, "name": name, "line": line, "file": str(script)}

    records = [call(10, reduce, "all_reduce"), call(10, barrier, "barrier")]
    records += [call(pid, reduce, "all_reduce") for pid in (11, 12) for _ in range(2)]
    t = SimpleNamespace(
        pids={0: 10, 1: 11, 2: 12},
        script=script,
        events=lambda pid: [r for r in records if r["pid"] == pid],
        where=lambda line: f"line {line} (`{lines[line - 1].strip()}`)",
    )
    text, line = collective_only_some_reach(t)
    assert line == barrier, text
    assert text.startswith("rank 0 called dist.barrier()"), text
    assert f"rank 1 (last in dist.all_reduce() at line {reduce})" in text, text
    assert f"rank 2 (last in dist.all_reduce() at line {reduce})" in text, text
