"""The course spine (parts 1-4): each script's quick run, under its real launcher on CPU/gloo,
shows what tests/course_steps.py claims for its step. One launch per script, every claim checked
on it. Part 2's run is compared with part 1's, and part 4 also runs under plain python. The lines
that steps 2, 3, 5 and 6 add to show their lesson (the weights' norm, the shards, the
checkpoint's keys, the launcher's variables) are checked against what the processes did."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import timm
import torch
from conftest import (
    PYTHON,
    REPO,
    TEST_SAMPLES,
    TINY_RUN,
    TORCHRUN,
    TRAIN_SAMPLES,
    Probe,
    Run,
    launch,
)
from course_steps import BY_LABEL, PART1, STEPS, Claim, Step

LAUNCH_TIMEOUT = 180  # seconds; a healthy 2-rank run here takes ~10 s
EPOCHS = 2
WORLD_SIZE = 2
# What a process may print on stdout; anything else means two lines were glued together.
OUTPUT_LINE_STARTS = (
    "device=",
    "DataParallel over",
    "rank ",
    "epoch ",
    "saved checkpoint",
    "checkpoint ",
    "launcher: ",
)
# The lesson lines: each rank's weights' norm (step 2 on), its shard (step 3 on); the
# checkpoint's keys (step 5 on); what the launcher set (step 6).
NORM_LINE = re.compile(r"^rank (\d+)/(\d+) weights' norm (\S+)$", re.MULTILINE)
SHARD_LINE = re.compile(r"^rank (\d+)/(\d+) shard=(\d+) shared=(\d+)$", re.MULTILINE)
LAUNCHER_LINE = re.compile(r"^launcher: (.*)$", re.MULTILINE)
# Slurm-looking variables, as when torchrun runs inside srun: torchrun's must win.
SLURM_LOOKALIKE = {
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_ID": "1",
}


@dataclass
class QuickRun:
    """One launch of a step's script, and what it left: output, checkpoint, probe records."""

    step: Step
    launcher: str
    run: Run
    checkpoint: Path
    probe: Probe
    folder: Path


# The latest quick run of each script in this session, for claims that compare two steps.
QUICK_RUNS: dict[str, QuickRun] = {}


@contextlib.contextmanager
def taken_port() -> Iterator[str]:
    """A MASTER_PORT that another program listens on: mp.spawn's scripts must pick a free one."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield str(taken.getsockname()[1])


def quick_run(step: Step, folder: Path, launcher: str | None = None) -> QuickRun:
    """The step's script on TINY_RUN for EPOCHS epochs, under its launcher: mp.spawn's steps with
    two processes and MASTER_PORT taken, torchrun with two and Slurm's variables set."""
    launcher = launcher or step.launcher
    checkpoint, probe_dir = folder / "ckpt" / "model.pt", folder / "probe"
    probe_dir.mkdir(parents=True)
    args = [step.script, *TINY_RUN, "--epochs", str(EPOCHS), "--checkpoint", str(checkpoint)]
    spawns = "--nprocs" in (REPO / step.script).read_text()
    with taken_port() as port:
        if launcher == "torchrun":
            command, env = [TORCHRUN, "--standalone", "--nproc_per_node=2", *args], SLURM_LOOKALIKE
        elif spawns:
            command, env = [PYTHON, *args, "--nprocs", str(WORLD_SIZE)], {"MASTER_PORT": port}
        else:
            command, env = [PYTHON, *args], {}
        if Claim.OWN_CROPS in step.claims:  # the probe keeps each rank's first step
            env = {**env, "DDP_PROBE_FIRST_STEP": "1"}
        run = launch(command, timeout=LAUNCH_TIMEOUT, probe_dir=probe_dir, env=env)
    QUICK_RUNS[step.script] = QuickRun(
        step, launcher, run, checkpoint, Probe.read(probe_dir), folder
    )
    return QUICK_RUNS[step.script]


def cores() -> int:
    return len(os.sched_getaffinity(0))


def bare_model() -> torch.nn.Module:
    return timm.create_model("test_resnet", num_classes=10)


def saved_state(q: QuickRun) -> dict[str, torch.Tensor]:
    return torch.load(q.checkpoint, weights_only=True)


def trained_params(q: QuickRun) -> list[torch.Tensor]:
    """Rank 0's parameters at the end of training (the only process when there is no group)."""
    pids = q.probe.ranks() or {0: q.probe.records[0]["pid"]}
    return q.probe.params(pids[0])


# ---- one check per claim ------------------------------------------------------------------------

CHECKS: dict[Claim, Callable[[QuickRun], None]] = {}


def check(claim: Claim):
    def register(function: Callable[[QuickRun], None]) -> Callable[[QuickRun], None]:
        CHECKS[claim] = function
        return function

    return register


@check(Claim.EPOCH_LINES)
def one_line_per_epoch(q: QuickRun) -> None:
    epochs = q.run.epochs()
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1)), "one line per epoch"
    for e in epochs:
        assert e["train_samples"] == TRAIN_SAMPLES, "train metrics cover the whole training set"
        assert e["test_samples"] == TEST_SAMPLES, "test accuracy covers every test image once"


@check(Claim.WHOLE_LINES)
def whole_lines(q: QuickRun) -> None:
    for line in q.run.stdout.splitlines():
        assert line.startswith(OUTPUT_LINE_STARTS), f"unexpected or glued output line: {line!r}"


@check(Claim.SAME_AS_PART1)
def same_as_part1(q: QuickRun) -> None:
    # DataParallel without GPUs calls the model itself. Equal losses of two runs also show that
    # one seed makes the whole run reproducible.
    part1 = QUICK_RUNS.get(PART1) or quick_run(BY_LABEL["Part 1"], q.folder / "part1")
    losses = [[e["train_loss"] for e in r.run.epochs()] for r in (part1, q)]
    assert losses[0] == losses[1], f"part 1's losses, then this run's: {losses}"


@check(Claim.SAYS_DEVICE)
def says_device(q: QuickRun) -> None:
    ranks = sorted(q.probe.ranks())
    world = [f"rank {r}/{len(ranks)} " for r in ranks] or [""]
    for prefix in world:
        assert f"\n{prefix}device=cpu threads=" in "\n" + q.run.stdout, f"no '{prefix}device='"


@check(Claim.DP_GPUS)
def dataparallel_says_its_gpus(q: QuickRun) -> None:
    assert f"DataParallel over {torch.cuda.device_count()} GPU(s)" in q.run.stdout


@check(Claim.BARE_LOAD)
def loads_into_a_bare_model(q: QuickRun) -> None:
    # strict: every key matches the unwrapped model
    bare_model().load_state_dict(saved_state(q))


@check(Claim.ONE_GROUP)
def one_group(q: QuickRun) -> None:
    joined = {(e["rank"], e["world_size"], e["backend"]) for e in q.probe.events("init")}
    assert joined == {(r, WORLD_SIZE, "gloo") for r in range(WORLD_SIZE)}, joined


@check(Claim.THREAD_SHARE)
def thread_share(q: QuickRun) -> None:
    threads = {e["rank"]: e["threads"] for e in q.probe.events("final")}
    share = max(1, cores() // WORLD_SIZE)
    assert threads == dict.fromkeys(range(WORLD_SIZE), share), "cores // local world size"


@check(Claim.OMP_KEPT)
def omp_threads_kept(q: QuickRun) -> None:
    assert {e["threads"] for e in q.probe.events("final")} == {1}, "torchrun sets 1; kept"


@check(Claim.WHOLE_DATA_EACH)
def whole_data_each(q: QuickRun) -> None:
    for rank in range(WORLD_SIZE):
        assert sorted(q.probe.indices(rank)) == list(range(TRAIN_SAMPLES)), f"rank {rank}"


@check(Claim.ONE_WRITER)
def one_writer(q: QuickRun) -> None:
    assert [p.name for p in q.checkpoint.parent.iterdir()] == [q.checkpoint.name], "one file"
    assert q.run.stdout.count("saved checkpoint") == 1, "only rank 0 writes"


@check(Claim.IN_SYNC)
def in_sync(q: QuickRun) -> None:
    ranks = q.probe.ranks()
    reference = q.probe.params(ranks[0])
    for rank in range(1, WORLD_SIZE):
        other = q.probe.params(ranks[rank])
        assert all(torch.equal(a, b) for a, b in zip(reference, other, strict=True)), (
            f"rank {rank}'s parameters differ from rank 0's after training: out of sync"
        )


@check(Claim.PREFIXED)
def prefixed(q: QuickRun) -> None:
    assert all(k.startswith("module.") for k in saved_state(q)), "DDP's keys before step 5"


@check(Claim.SHARDS)
def shards(q: QuickRun) -> None:
    for epoch in range(EPOCHS):
        union = [i for rank in range(WORLD_SIZE) for i in q.probe.indices(rank, epoch=epoch)]
        assert sorted(union) == list(range(TRAIN_SAMPLES)), f"epoch {epoch}: each sample once"
    first, second = q.probe.indices(0, epoch=0), q.probe.indices(0, epoch=1)
    assert first != second, "rank 0 drew the same order in epochs 0 and 1: set_epoch is not called"
    assert set(first) != set(second), "shuffling should move samples across ranks between epochs"


@check(Claim.OWN_CROPS)
def own_crops(q: QuickRun) -> None:
    q.probe.assert_own_crops(WORLD_SIZE)


@check(Claim.NO_PREFIX)
def no_prefix(q: QuickRun) -> None:
    state = saved_state(q)
    assert not [k for k in state if k.startswith("module.")], "keys without DDP's 'module.'"
    assert "loads into a bare test_resnet" in q.run.stdout
    model = bare_model()
    model.load_state_dict(state)
    trained = trained_params(q)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained, strict=True)), (
        "saved = trained weights"
    )


@check(Claim.SAME_NORM)
def same_norm(q: QuickRun) -> None:
    lines = NORM_LINE.findall(q.run.stdout)
    assert sorted((int(r), int(n)) for r, n, _ in lines) == [
        (r, WORLD_SIZE) for r in range(WORLD_SIZE)
    ], f"one norm line per rank: {lines}"
    assert len({norm for *_, norm in lines}) == 1, f"the ranks printed other norms: {lines}"
    # the norm of the weights rank 0 trained (the probe's copy; other threads here: rounding)
    trained = torch.nn.utils.get_total_norm([p.double() for p in trained_params(q)]).item()
    assert float(lines[0][2]) == pytest.approx(trained, rel=1e-10), (lines, trained)


@check(Claim.SHARD_LINE)
def shard_line(q: QuickRun) -> None:
    said = {
        int(r): (int(n), int(size), int(shared))
        for r, n, size, shared in SHARD_LINE.findall(q.run.stdout)
    }
    assert sorted(said) == list(range(WORLD_SIZE)), f"one shard line per rank: {said}"
    drawn = {rank: q.probe.indices(rank, epoch=0) for rank in range(WORLD_SIZE)}
    for rank, (world, size, shared) in said.items():
        others = {i for r, got in drawn.items() if r != rank for i in got}
        # what the rank trained on in epoch 0 (each rank half the set), and what of it another did
        assert (world, size) == (WORLD_SIZE, len(drawn[rank])) == (WORLD_SIZE, TRAIN_SAMPLES // 2)
        assert shared == len(set(drawn[rank]) & others) == 0, f"rank {rank}: {said[rank]}"


@check(Claim.KEYS_LINE)
def keys_line(q: QuickRun) -> None:
    keys = list(saved_state(q))
    assert not [k for k in keys[:3] if k.startswith("module.")], keys[:3]
    said = f"checkpoint keys: {keys[:3]} and {len(keys) - 3} more"
    assert said in q.run.stdout.splitlines(), f"no line {said!r}"


@check(Claim.LAUNCHER_LINE)
def launcher_line(q: QuickRun) -> None:
    # torchrun's variables, not the Slurm look-alikes set around it (SLURM_LOOKALIKE)
    said = sorted(LAUNCHER_LINE.findall(q.run.stdout))
    world = f"WORLD_SIZE={WORLD_SIZE} LOCAL_WORLD_SIZE={WORLD_SIZE}"
    assert said == [f"RANK={r} LOCAL_RANK={r} {world}" for r in range(WORLD_SIZE)], said


@check(Claim.RELEASED)
def released(q: QuickRun) -> None:
    q.probe.assert_groups_released()


@check(Claim.ALONE)
def alone(q: QuickRun) -> None:
    single = quick_run(q.step, q.folder / "python", "python")
    assert [(e["rank"], e["world_size"]) for e in single.probe.events("init")] == [(0, 1)]
    assert "rank 0/1 device=cpu" in single.run.stdout
    assert not LAUNCHER_LINE.search(single.run.stdout), "no launcher, nothing it set"
    one_line_per_epoch(single)
    loads_into_a_bare_model(single)


# ---- the specification, run ---------------------------------------------------------------------


def test_every_claim_has_one_check_and_a_step() -> None:
    claimed = {claim for step in STEPS for claim in step.claims}
    assert set(CHECKS) == set(Claim) == claimed


@pytest.mark.parametrize("step", [s for s in STEPS if s.claims], ids=lambda s: s.script)
def test_quick_run_shows_what_the_course_claims(step: Step, tmp_path: Path) -> None:
    q = quick_run(step, tmp_path)
    for claim in step.claims:
        try:
            CHECKS[claim](q)
        except AssertionError as error:
            pytest.fail(
                f"step {step.label}: not true that {claim.value}: {error}\n{q.run.describe()}"
            )
