"""The course spine (parts 1-4): each script runs under its real launcher on CPU/gloo, and
does what the course says it does. One launch per script, several claims per launch."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import timm
import torch
from conftest import PYTHON, TEST_SAMPLES, TINY_RUN, TORCHRUN, TRAIN_SAMPLES, Probe, Run, launch
from course_steps import BY_LABEL, PART1, STEP6, STEPS

LAUNCH_TIMEOUT = 180  # seconds; a healthy 2-rank run here takes ~16 s
EPOCHS = 2
# The mp.spawn steps of part 3, by number.
STEP_SCRIPTS = {int(s.label): s.script for s in STEPS if s.label in "12345"}
# What a process may print on stdout; anything else means two lines were glued together.
OUTPUT_LINE_STARTS = (
    "device=",
    "DataParallel over",
    "rank ",
    "epoch ",
    "saved checkpoint",
    "checkpoint ",
)


def cores() -> int:
    return len(os.sched_getaffinity(0))


def train(
    script: str,
    tmp_path: Path,
    *,
    launcher: list[str],
    probe_dir: Path | None = None,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[Run, Path]:
    checkpoint = tmp_path / "ckpt" / "model.pt"
    command = [
        *launcher,
        script,
        *TINY_RUN,
        "--epochs",
        str(EPOCHS),
        "--checkpoint",
        str(checkpoint),
        *extra,
    ]
    return launch(command, timeout=LAUNCH_TIMEOUT, probe_dir=probe_dir, env=env), checkpoint


def assert_whole_lines(run: Run) -> None:
    for line in run.stdout.splitlines():
        assert line.startswith(OUTPUT_LINE_STARTS), (
            f"unexpected or glued output line: {line!r}\n{run.describe()}"
        )


def assert_epochs_reported_once(
    run: Run, train_samples: int = TRAIN_SAMPLES
) -> list[dict[str, float]]:
    epochs = run.epochs()
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1)), (
        f"one line per epoch, rank 0 only\n{run.describe()}"
    )
    for e in epochs:
        assert e["train_samples"] == train_samples, (
            "train metrics must cover the whole training set"
        )
        assert e["test_samples"] == TEST_SAMPLES, (
            "test accuracy must cover the whole test set, each image once"
        )
    return epochs


def assert_ranks_in_sync(probe: Probe, world_size: int) -> None:
    ranks = probe.ranks()
    assert sorted(ranks) == list(range(world_size)), (
        f"ranks that joined the process group: {sorted(ranks)}"
    )
    reference = probe.params(ranks[0])
    for rank in range(1, world_size):
        other = probe.params(ranks[rank])
        assert all(torch.equal(a, b) for a, b in zip(reference, other, strict=True)), (
            f"rank {rank}'s parameters differ from rank 0's after training: out of sync"
        )


def assert_sampler_partitions(probe: Probe, world_size: int) -> None:
    for epoch in range(EPOCHS):
        shards = [probe.indices(rank, epoch=epoch) for rank in range(world_size)]
        union = [i for shard in shards for i in shard]
        assert sorted(union) == list(range(TRAIN_SAMPLES)), (
            f"epoch {epoch}: the ranks together must see every sample once"
        )
    first, second = probe.indices(0, epoch=0), probe.indices(0, epoch=1)
    assert first != second, "rank 0 drew the same order in epochs 0 and 1: set_epoch is not called"
    assert set(first) != set(second), "shuffling should move samples across ranks between epochs"


def bare_model() -> torch.nn.Module:
    return timm.create_model("test_resnet", num_classes=10)


def test_part1_single_device_trains_and_is_reproducible(tmp_path: Path) -> None:
    run, checkpoint = train(PART1, tmp_path, launcher=[PYTHON])
    rerun, _ = train(PART1, tmp_path / "again", launcher=[PYTHON])
    epochs = assert_epochs_reported_once(run)
    assert "device=cpu" in run.stdout
    assert_whole_lines(run)
    assert [e["train_loss"] for e in epochs] == [e["train_loss"] for e in rerun.epochs()], (
        "same seed, same result"
    )
    bare_model().load_state_dict(torch.load(checkpoint, weights_only=True))


def test_part2_dataparallel_runs_on_cpu_and_says_so(tmp_path: Path) -> None:
    run, checkpoint = train(BY_LABEL["Part 2"].script, tmp_path, launcher=[PYTHON])
    assert "DataParallel over 0 GPU(s)" in run.stdout
    assert_epochs_reported_once(run)
    bare_model().load_state_dict(
        torch.load(checkpoint, weights_only=True)
    )  # unwrapped before saving


def test_step1_every_rank_trains_on_the_whole_data_set(tmp_path: Path, probe_dir: Path) -> None:
    with socket.socket() as taken:
        # A MASTER_PORT that another program listens on: mp.spawn's script picks a free one.
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"MASTER_PORT": str(taken.getsockname()[1])}
        run, checkpoint = train(
            STEP_SCRIPTS[1],
            tmp_path,
            launcher=[PYTHON],
            probe_dir=probe_dir,
            env=env,
            extra=("--nprocs", "2"),
        )
    probe = Probe.read(probe_dir)
    assert {(e["rank"], e["world_size"], e["backend"]) for e in probe.events("init")} == {
        (0, 2, "gloo"),
        (1, 2, "gloo"),
    }
    for rank in (0, 1):
        assert sorted(probe.indices(rank)) == list(range(TRAIN_SAMPLES)), (
            "step 1 has no sampler: each rank sees it all"
        )
    threads = {e["rank"]: e["threads"] for e in probe.events("final")}
    assert threads == {0: max(1, cores() // 2), 1: max(1, cores() // 2)}, (
        "each rank gets cores // local world size"
    )
    assert_epochs_reported_once(run)
    assert "rank 0/2 device=cpu" in run.stdout and "rank 1/2 device=cpu" in run.stdout
    assert_whole_lines(run)
    assert checkpoint.exists()


def test_step2_ddp_keeps_ranks_in_sync(tmp_path: Path, probe_dir: Path) -> None:
    run, checkpoint = train(
        STEP_SCRIPTS[2], tmp_path, launcher=[PYTHON], probe_dir=probe_dir, extra=("--nprocs", "2")
    )
    assert_ranks_in_sync(Probe.read(probe_dir), 2)
    assert_epochs_reported_once(run)
    keys = torch.load(checkpoint, weights_only=True).keys()
    assert all(k.startswith("module.") for k in keys), (
        "before step 5 the DDP checkpoint has the 'module.' prefix"
    )


@pytest.mark.parametrize("step", [3, 4])
def test_steps_3_and_4_split_the_data_and_report_global_metrics(
    step: int, tmp_path: Path, probe_dir: Path
) -> None:
    run, _ = train(
        STEP_SCRIPTS[step],
        tmp_path,
        launcher=[PYTHON],
        probe_dir=probe_dir,
        extra=("--nprocs", "2"),
    )
    probe = Probe.read(probe_dir)
    assert_sampler_partitions(probe, 2)
    assert_ranks_in_sync(probe, 2)
    assert_epochs_reported_once(run)  # counts summed over ranks: every sample, once
    assert_whole_lines(run)


def assert_checkpoint_written_once_without_prefix(run: Run, checkpoint: Path, probe: Probe) -> None:
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name], (
        "exactly one checkpoint file"
    )
    assert run.stdout.count("saved checkpoint") == 1, "only rank 0 writes"
    state = torch.load(checkpoint, weights_only=True)
    assert not [k for k in state if k.startswith("module.")], (
        "keys must not carry DDP's 'module.' prefix"
    )
    model = bare_model()
    model.load_state_dict(state)  # strict: every key matches the unwrapped model
    trained = probe.params(probe.ranks()[0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), trained, strict=True)), (
        "saved = trained weights"
    )


def test_step5_checkpoint_once_without_prefix(tmp_path: Path, probe_dir: Path) -> None:
    run, checkpoint = train(
        STEP_SCRIPTS[5], tmp_path, launcher=[PYTHON], probe_dir=probe_dir, extra=("--nprocs", "2")
    )
    probe = Probe.read(probe_dir)
    assert_checkpoint_written_once_without_prefix(run, checkpoint, probe)
    probe.assert_groups_released()
    assert "loads into a bare test_resnet" in run.stdout
    assert_ranks_in_sync(probe, 2)
    assert_sampler_partitions(probe, 2)


def test_part4_under_torchrun_whose_variables_win_over_slurms(
    tmp_path: Path, probe_dir: Path
) -> None:
    # Slurm-looking variables, as when torchrun runs inside srun: torchrun's must win.
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}
    run, checkpoint = train(
        STEP6,
        tmp_path,
        probe_dir=probe_dir,
        env=slurm,
        launcher=[TORCHRUN, "--standalone", "--nproc_per_node=2"],
    )
    probe = Probe.read(probe_dir)
    assert_ranks_in_sync(probe, 2)
    assert_sampler_partitions(probe, 2)
    assert_epochs_reported_once(run)
    assert_checkpoint_written_once_without_prefix(run, checkpoint, probe)
    assert {e["threads"] for e in probe.events("final")} == {1}, (
        "torchrun sets OMP_NUM_THREADS=1; the script keeps it"
    )
    probe.assert_groups_released()


def test_part4_plain_python_is_a_world_of_one(tmp_path: Path, probe_dir: Path) -> None:
    run, checkpoint = train(STEP6, tmp_path, launcher=[PYTHON], probe_dir=probe_dir)
    assert [(e["rank"], e["world_size"]) for e in Probe.read(probe_dir).events("init")] == [(0, 1)]
    assert "rank 0/1 device=cpu" in run.stdout
    assert_epochs_reported_once(run)
    assert checkpoint.exists()
