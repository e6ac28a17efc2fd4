"""Failure behaviour: a killed worker is restarted by torchrun and the run ends with
the same weights as one that never stopped; a crash while a snapshot is written loses
nothing; a rank that raises ends the whole job; bad input gives one clear line, a non-zero
exit and no traceback. Faults are injected by the test probe (probe/sitecustomize.py), never
by the teaching scripts."""

from __future__ import annotations

import fcntl
import io
import json
import os
import random
import re
import runpy
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import timm
import torch
from conftest import (
    PYTHON,
    REPO,
    TINY_RUN,
    TORCHRUN,
    Probe,
    Run,
    import_script,
    launch,
    launch_at_once,
    png_size,
    with_environ,
)
from course_steps import BY_LABEL, PART1, STEP5, STEP6, STEPS

EPOCH_SNAPSHOT_SCRIPT = BY_LABEL["7"].script  # a snapshot at the end of each epoch
STEP_SNAPSHOT_SCRIPT = BY_LABEL["8"].script  # and within epochs: the loader's place
SNAPSHOT_SCRIPT = BY_LABEL["9"].script  # and each rank's random state: an exact resume
CHECKED_SNAPSHOT_SCRIPT = BY_LABEL["10"].script  # and a snapshot that belongs to its run
LOCKED_SNAPSHOT_SCRIPT = BY_LABEL["11"].script  # and one run at a time: a lock
# The chapter's figure of a killed and resumed run; its --record mode runs a command and keeps
# its output with the time of each line (the kill test's runs go through it).
RESUME_FIGURE = "part4_torchrun/fault_tolerance/figures/draw_resume.py"
# The scripts that check the GPU count: step 4 (device placement) and every script after it.
GPU_CHECKED = [s.script for s in STEPS if s.checks_gpus]
LAUNCH_TIMEOUT = (
    240  # seconds; a hang detector: a healthy run here takes 10-45 s, more while other tests run
)
FAILURE_DEADLINE = 30  # seconds from a rank's failure to the end of the whole job
# torchrun's workers share the launcher's key-value store across restarts and can read the previous
# attempt's addresses (pytorch/pytorch#135712): restarts need a fresh store per attempt.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# 330 images: 83 per rank of 4, 6 training batches of 16; the 66 test images split 17, 17, 16,
# 16 over 4 ranks, i.e. 2, 2, 1 and 1 test batches: evaluation must not need the ranks in step.
# Four ranks, not two: with more than two, the order in which gloo adds the ranks' gradients
# depends on DDP's bucket layout, which a resumed run must rebuild as the first run did.
EPOCHS, RANKS = 3, 4
RUN = [*TINY_RUN, "--fake-size", "330", "--epochs", str(EPOCHS)]
# Rank 1, second epoch (pass 1), fourth batch: mid-epoch, after the restarted run's snapshot at
# step 2 of that epoch (rank 1 could not draw batch 3 before rank 0 had saved it) and before the
# one at step 4.
KILL_AT = (1, 1, 3)
PER_EPOCH = 6  # steps
SNAPSHOT_EVERY = ["--snapshot-every", "2"]
TORCHRUN_2 = [TORCHRUN, "--standalone", "--nproc_per_node=2"]
TORCHRUN_4 = [TORCHRUN, "--standalone", f"--nproc_per_node={RANKS}"]
# A 2-rank training run under each launcher that starts its own processes.
TWO_RANKS = {
    "mp.spawn": [PYTHON, STEP5, "--nprocs", "2"],
    "torchrun": [*TORCHRUN_2, STEP6],
}


def assert_one_clear_line(stderr: str, *expected: str) -> None:
    """One `error:` line (the script's own, or argparse's after its usage), no traceback."""
    errors = [line for line in stderr.strip().splitlines() if "error: " in line]
    assert len(errors) == 1, f"want one 'error: ...' line, got:\n{stderr}"
    assert stderr.strip().splitlines()[-1] == errors[0], f"the error line comes last:\n{stderr}"
    assert "Traceback" not in stderr
    for text in expected:
        assert text in errors[0], f"{text!r} missing from: {errors[0]}"


def exit_message(exit: SystemExit) -> str:
    """What `python script.py` would print for this exit: sys.exit("error: ...") exits 1."""
    assert isinstance(exit.code, str), f"want sys.exit('error: ...'), got exit code {exit.code!r}"
    return exit.code + "\n"


def saved_lines(run: Run) -> list[str]:
    """The run's `saved snapshot` lines, each without its size, once that is checked: one
    decimal, in MB, the size of a snapshot of the tiny test model."""
    lines = [line for line in run.stdout.splitlines() if line.startswith("saved snapshot ")]
    sizes = [line.rpartition(" (")[2] for line in lines]
    assert all(re.fullmatch(r"\d\.\d MB\)", size) for size in sizes), lines
    return [line.rpartition(" (")[0] for line in lines]


def differing_tensors(a: dict, b: dict) -> list[str]:
    """Names of the tensors that differ in value, dtype or shape (bit for bit)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def fresh_state(module: ModuleType, epochs_done: int = 0) -> dict:
    """A model built by the script, with an optimizer and a scheduler that has counted
    `epochs_done` epochs: what an epoch's snapshot holds."""
    model = module.build_model("test_resnet")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
    for _ in range(epochs_done):
        optimizer.step()
        scheduler.step()
    return dict(model=model, optimizer=optimizer, scheduler=scheduler)


# ---- torchrun restarts a killed worker; the run resumes from the snapshot, bit-exactly ----------


@pytest.fixture(scope="module")
def restarted_and_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Run, Path, Probe]]:
    """Both runs at once: the restart's waits overlap the other run's work."""
    kill = {"DDP_PROBE_KILL_AT": ":".join(map(str, KILL_AT)), "LOGLEVEL": "INFO"}
    # Folders made here, not in the threads: pytest's first mktemp makes its base folder.
    out = {name: tmp_path_factory.mktemp(name) for name in ("reference", "restarted")}
    with ThreadPoolExecutor(2) as pool:
        # The reference's probe keeps each rank's first step: its random state and weights.
        first_step = {"DDP_PROBE_FIRST_STEP": "1"}
        reference = pool.submit(snapshot_run, out["reference"], first_step, TORCHRUN_4)
        restarted = pool.submit(
            snapshot_run, out["restarted"], kill, [*TORCHRUN_4, "--max-restarts=1"]
        )
        return {"reference": reference.result(), "restarted": restarted.result()}


def snapshot_run(out: Path, extra_env: dict, launcher: list[str]) -> tuple[Run, Path, Probe]:
    """One 4-rank torchrun run of the snapshot step into `out`, with the probe, through the
    figure's recorder: its output, unchanged, and out/transcript.txt (each line timed)."""
    # The reference runs with the defaults (no snapshot within an epoch): saving snapshots
    # must not change the training either.
    flags = SNAPSHOT_EVERY if "DDP_PROBE_KILL_AT" in extra_env else []
    (out / "probe").mkdir()
    command = [
        *launcher,
        SNAPSHOT_SCRIPT,
        *RUN,
        *flags,
        "--checkpoint",
        str(out / "model.pt"),
        "--snapshot",
        str(out / "snapshot.pt"),
    ]
    record = [PYTHON, RESUME_FIGURE, "--record", str(out / "transcript.txt"), "--"]
    run = launch(
        [*record, *command],
        timeout=LAUNCH_TIMEOUT,
        env={**FRESH_STORE, **extra_env},
        probe_dir=out / "probe",
    )
    return run, out, Probe.read(out / "probe")


@pytest.mark.slow  # two 4-rank torchrun runs, one of them restarted: about half of this file's time
def test_sigkill_mid_epoch_restarts_and_ends_bit_exact(restarted_and_reference) -> None:
    run, out, probe = restarted_and_reference["restarted"]
    reference, reference_out, reference_probe = restarted_and_reference["reference"]
    # Each rank draws its own crops and flips: a rank resumed with another rank's random state
    # would crop its images otherwise, and the weights below would differ.
    reference_probe.assert_own_crops(RANKS)
    killed = probe.events("killed")
    assert [e["rank"] for e in killed] == [KILL_AT[0]], (
        f"the probe should have killed rank 1 once\n{run.describe()}"
    )
    assert f"failed (exitcode: -9) local_rank: {KILL_AT[0]}" in run.stderr, (
        "torchrun saw the SIGKILL"
    )
    assert (
        "Worker group FAILED. 1/1 attempts left; will restart worker group" in run.stderr
    )  # LOGLEVEL=INFO
    # Resumed mid-epoch: from the snapshot at step 2 of epoch 2, not from the epoch's start.
    assert f"resumed from {out / 'snapshot.pt'}: 1/3 epochs, 2 steps done" in run.stdout, (
        run.describe()
    )
    epochs = [int(e["epoch"]) for e in run.epochs()]
    assert epochs == list(range(1, EPOCHS + 1)), (
        f"each epoch reported once, none repeated: {epochs}"
    )
    # The resumed epoch's line counts the steps trained after the resume: 4 of 6 per rank
    # (83 images each: batches of 16, 16, 16, 16, 16 and 3).
    assert [e["train_samples"] for e in run.epochs()] == [332, 204, 332], run.stdout
    same = [e["test_acc"] for e in run.epochs()], [e["test_acc"] for e in reference.epochs()]
    assert same[0] == same[1]
    for epoch in (0, 2):
        assert run.epochs()[epoch]["train_loss"] == reference.epochs()[epoch]["train_loss"]
    # Bit for bit: the final weights and buffers, and the last snapshot (momentum included).
    final, expected = (torch.load(d / "model.pt", weights_only=True) for d in (out, reference_out))
    assert not differing_tensors(final, expected), (
        f"final weights differ: {differing_tensors(final, expected)}"
    )
    snapshot, expected = (
        torch.load(d / "snapshot.pt", weights_only=True) for d in (out, reference_out)
    )
    # The scheduler counts the epochs done.
    where = [(s["scheduler"]["last_epoch"], s["step"]) for s in (snapshot, expected)]
    assert where == [(3, 0), (3, 0)]
    for key, value in snapshot["optimizer"]["state"].items():
        assert torch.equal(
            value["momentum_buffer"], expected["optimizer"]["state"][key]["momentum_buffer"]
        )
    assert snapshot["scheduler"] == expected["scheduler"]
    # Both ranks of the restarted attempt ended with those weights.
    finals = {e["rank"]: e["pid"] for e in probe.events("final")}
    assert sorted(finals) == list(range(RANKS))
    model = import_script(SNAPSHOT_SCRIPT).build_model("test_resnet")
    model.load_state_dict(final)
    for pid in finals.values():
        assert all(
            torch.equal(a, b) for a, b in zip(probe.params(pid), model.parameters(), strict=True)
        )


def test_epoch_snapshot_resumes_where_the_crash_left_it(tmp_path: Path) -> None:
    """Step 7 under python, a world of one: a crash while the second epoch's snapshot is
    renamed leaves the first one whole; started again, the run trains epoch 2 again exactly as
    the crashed attempt did (the snapshot holds no RNG: each epoch reseeds, the same crops)."""
    snapshot = tmp_path / "s.pt"
    command = [PYTHON, EPOCH_SNAPSHOT_SCRIPT, *TINY_RUN, "--epochs", "2"]
    command += ["--snapshot", str(snapshot), "--checkpoint", str(tmp_path / "model.pt")]
    runs = []
    for attempt, env in enumerate([{"DDP_PROBE_CRASH_AT_REPLACE": "2"}, {}]):
        probe_dir = tmp_path / f"probe{attempt}"
        probe_dir.mkdir()
        runs.append(
            launch(command, timeout=LAUNCH_TIMEOUT, env=env, probe_dir=probe_dir, check=False)
        )
    crashed, resumed = runs
    assert crashed.returncode == -9, f"the probe kills at the second rename\n{crashed.describe()}"
    assert [e["source"] for e in Probe.read(tmp_path / "probe0").events("crashed")] == [
        f"{snapshot}.tmp"
    ]
    assert [int(e["epoch"]) for e in crashed.epochs()] == [1, 2]
    # Each snapshot says where it stands, in the words a resume uses, and its size: the crash
    # at the second rename left the first, the last one its attempt said it saved.
    assert saved_lines(crashed) == [f"saved snapshot {snapshot}: 1/2 epochs done"], crashed.stdout
    assert resumed.returncode == 0, resumed.describe()
    assert f"resumed from {snapshot}: 1/2 epochs done" in resumed.stdout, resumed.describe()
    assert saved_lines(resumed) == [f"saved snapshot {snapshot}: 2/2 epochs done"], resumed.stdout
    assert [int(e["epoch"]) for e in resumed.epochs()] == [2], resumed.describe()
    # Epoch 2 again, as the crashed attempt trained it, to the printed digit: the weights and
    # momentum of epoch 1, the schedule and the random crops all came back.
    for key in ("train_loss", "train_acc", "test_acc"):
        assert resumed.epochs()[0][key] == crashed.epochs()[1][key], key


def test_step_snapshot_resumes_at_the_step_it_left_off(tmp_path: Path) -> None:
    """Step 8 under python, a world of one, 4 steps an epoch, a snapshot after every step: a
    crash while epoch 2's second step is saved leaves its first step's snapshot; started again,
    the run trains the 3 steps left of epoch 2, no image twice and none missed."""
    snapshot = tmp_path / "s.pt"
    command = [PYTHON, STEP_SNAPSHOT_SCRIPT, *TINY_RUN, "--epochs", "2", "--max-steps", "4"]
    command += ["--snapshot", str(snapshot), "--snapshot-every", "1", "--checkpoint", ""]
    runs = []
    # Renames: epoch 1's steps 1-3 and its end (4), then epoch 2's step 1 (5) and step 2 (6).
    for attempt, env in enumerate([{"DDP_PROBE_CRASH_AT_REPLACE": "6"}, {}]):
        (tmp_path / f"probe{attempt}").mkdir()
        run = launch(
            command,
            timeout=LAUNCH_TIMEOUT,
            env=env,
            probe_dir=tmp_path / f"probe{attempt}",
            check=False,
        )
        runs.append(run)
    crashed, resumed = runs
    assert crashed.returncode == -9, f"the probe kills at the sixth rename\n{crashed.describe()}"
    assert [int(e["train_samples"]) for e in crashed.epochs()] == [4 * 16], crashed.describe()
    said = f"resumed from {snapshot}: 1/2 epochs, 1 steps done"
    assert resumed.returncode == 0 and said in resumed.stdout, resumed.describe()
    # Each snapshot says the steps done in its epoch; the resume, those of the last one saved.
    done = ["0/2 epochs, 1", "0/2 epochs, 2", "0/2 epochs, 3", "1/2 epochs, 0", "1/2 epochs, 1"]
    said = [f"saved snapshot {snapshot}: {where} steps done" for where in done]
    assert saved_lines(crashed) == said, crashed.stdout
    done = ["1/2 epochs, 2", "1/2 epochs, 3", "2/2 epochs, 0"]
    said = [f"saved snapshot {snapshot}: {where} steps done" for where in done]
    assert saved_lines(resumed) == said, resumed.stdout
    assert [(int(e["epoch"]), int(e["train_samples"])) for e in resumed.epochs()] == [(2, 3 * 16)]
    # The loader's place came back: the resumed run draws the batch the crashed one drew second
    # in epoch 2 (the same shuffle, from the step the snapshot holds), then two more, and never
    # an image of the step the snapshot counts as done.
    first_try = Probe.read(tmp_path / "probe0").indices(0, epoch=1)
    again = Probe.read(tmp_path / "probe1").indices(0, epoch=1)
    assert len(first_try) == 2 * 16 and len(set(again)) == 3 * 16, (first_try, again)
    assert again[:16] == first_try[16:] and not set(again) & set(first_try[:16]), (first_try, again)


@pytest.mark.slow  # shares the runs above
def test_batchnorm_evaluation_with_uneven_batch_counts(restarted_and_reference) -> None:
    reference, _, probe = restarted_and_reference["reference"]
    test_batches = {
        rank: len(
            [
                e
                for e in probe.events("batch")
                if e["loader"] == 1 and e["rank"] == rank and e["pass"] == 0
            ]
        )
        for rank in range(RANKS)
    }
    assert test_batches == {0: 2, 1: 2, 2: 1, 3: 1}, "the test set splits into uneven batches"
    assert any(
        isinstance(m, torch.nn.BatchNorm2d) for m in timm.create_model("test_resnet").modules()
    )
    assert [e["test_samples"] for e in reference.epochs()] == [66] * EPOCHS, (
        "every test image scored once"
    )


@pytest.mark.slow  # shares the runs above
def test_the_resume_figure_shows_the_kill_and_the_resume(
    restarted_and_reference, tmp_path: Path
) -> None:
    """The chapter's figure (figures/draw_resume.py), parsed and drawn from the kill test's two
    runs: what its caption says holds in their output. The first attempt saved snapshots every 2
    steps, the kill came after its last one, the restart resumed at that snapshot's step, and
    the epochs trained whole (before the kill, and after the resumed one) printed the
    uninterrupted run's loss to the last digit."""
    figure = import_script(RESUME_FIGURE)
    data = {
        name: figure.parse(
            (restarted_and_reference[run][1] / "transcript.txt").read_text(), PER_EPOCH
        )
        for name, run in (("killed", "restarted"), ("reference", "reference"))
    }
    killed, reference = data["killed"], data["reference"]
    assert len(killed["attempts"]) == 2 and len(reference["attempts"]) == 1, killed
    first, second = killed["attempts"]
    steps = [step for _, step in first["points"]]
    assert steps == [0, 2, 4, 6, 8], f"every 2 steps, then the kill in epoch 2: {steps}"
    (saved_s, saved_step), (kill_s, rank) = first["points"][-1], killed["kill"]
    assert rank == KILL_AT[0] and saved_s < kill_s < second["start_s"], killed
    assert killed["resume"][1] == saved_step == PER_EPOCH + KILL_AT[2] - 1, killed
    assert killed["resumed_epoch"] == KILL_AT[1] + 1
    assert second["points"][-1][1] == EPOCHS * PER_EPOCH, "attempt 2 trains to the end"
    for epoch, (printed, _) in killed["losses"].items():
        if epoch != killed["resumed_epoch"]:
            assert printed == reference["losses"][epoch][0], (epoch, killed, reference)
    figure.draw(data, tmp_path / "resume.png")
    assert png_size(tmp_path / "resume.png") == (900, 480)
    committed = REPO / Path(RESUME_FIGURE).with_name("resume.png")
    assert png_size(committed) == (900, 480) and committed.stat().st_size < 150_000


# ---- a rank that raises ends the whole job -----------------------------------------------------


@pytest.mark.parametrize("launcher", ["mp.spawn", "torchrun"])
def test_a_raising_rank_ends_the_job(launcher: str, tmp_path: Path, probe_dir: Path) -> None:
    command = TWO_RANKS[launcher]
    env = {"DDP_PROBE_RAISE_AT": "1:0:1"}  # the job must end at once, not at a timeout
    run = launch(
        [*command, *TINY_RUN, "--epochs", "2", "--checkpoint", str(tmp_path / "model.pt")],
        timeout=LAUNCH_TIMEOUT,
        env=env,
        probe_dir=probe_dir,
        check=False,
    )
    ended = time.time()
    assert run.returncode != 0, run.describe()
    assert "RuntimeError: probe: rank 1 fails on purpose at batch 1" in run.stderr, run.describe()
    raised = Probe.read(probe_dir).events("raised")
    assert [e["rank"] for e in raised] == [1]
    assert ended - raised[0]["time"] < FAILURE_DEADLINE, (
        f"the job ran on for {ended - raised[0]['time']:.0f} s"
    )
    assert not (tmp_path / "model.pt").exists(), "no rank carried on to the end"


# ---- a hang ends at the test's timeout, and no process outlives it -----------------------------

# Seconds the test waits once both ranks stand in place (rank 1 hanging, rank 0 waiting for
# it): far below the collective timeout (PyTorch's default, 30 minutes), so only the test's own
# timeout can end the run. Getting in place may take long on a loaded machine (rank 0 of
# mp.spawn had not got there after 40 s at a load average of 15): up to IN_PLACE_WITHIN.
HANG_TIMEOUT, IN_PLACE_WITHIN = 10, 150


def hang(launcher: str, directory: Path) -> tuple[str, float, Probe]:
    """One launch whose rank 1 never reaches init_process_group: the failure report, the
    seconds from both ranks in place to the launch's end, and what the probe saw."""
    probe_dir = directory / "probe"
    probe_dir.mkdir()
    in_place = [0.0]

    def both_in_place() -> bool:
        events = {e["event"] for e in Probe.read(probe_dir).records}
        in_place[0] = time.monotonic()
        return {"hang", "waiting"} <= events

    with pytest.raises(pytest.fail.Exception) as failure:
        launch(
            [*TWO_RANKS[launcher], *TINY_RUN, "--checkpoint", str(directory / "model.pt")],
            timeout=HANG_TIMEOUT,
            env={"DDP_PROBE_HANG_RANK": "1"},
            probe_dir=probe_dir,
            in_place=both_in_place,
            in_place_within=IN_PLACE_WITHIN,
        )
    return str(failure.value), time.monotonic() - in_place[0], Probe.read(probe_dir)


def test_a_hang_ends_at_the_timeout_with_no_process_left(tmp_path: Path) -> None:
    """Rank 1 never reaches init_process_group, so rank 0 waits for it there. The launch's
    timeout must end the launcher and every process it started (torchrun's workers run in
    sessions of their own) within seconds, and the report must start with "timed out". Both
    launchers hang at the same time: the test waits once."""
    folders = {launcher: tmp_path / launcher for launcher in TWO_RANKS}
    for folder in folders.values():
        folder.mkdir()
    with ThreadPoolExecutor(len(folders)) as pool:
        futures = {name: pool.submit(hang, name, folder) for name, folder in folders.items()}
        results = {name: future.result() for name, future in futures.items()}
    for launcher, (report, seconds, probe) in results.items():
        assert report.startswith(f"timed out after {HANG_TIMEOUT} s in place"), (
            launcher,
            report[:500],
        )
        assert seconds < HANG_TIMEOUT + 10, f"{launcher}: it took {seconds:.0f} s in place to end"
        assert [e["rank"] for e in probe.events("hang")] == [1], (launcher, report)
        assert [e["rank"] for e in probe.events("waiting")] == [0], (
            f"{launcher}: rank 0 must wait for rank 1\n{report}"
        )
        survivors = probe.survivors()
        assert not survivors, f"{launcher}: processes left running after the timeout: {survivors}"


# ---- bad input: one clear line, a non-zero exit, no traceback ----------------------------------

# Runs scripts as `python script.py ARGS` would (run_name "__main__"), several in one process, so
# torch and timm are imported once; each case reports its exit code and what it wrote to stderr.
# After each, what the process's exit would do: its process group and its snapshot's lock go. A
# case with a "snapshot" may first write a file (a crash's half snapshot) or hold the snapshot's
# lock itself (another run), and reports the snapshot's digest (if it is a file) and its folder's
# files.
DRIVER = r"""
import contextlib, fcntl, hashlib, io, json, os, runpy, sys, traceback
import torch.distributed as dist
for case in json.loads(sys.argv[1]):
    script, args, snapshot = case["script"], case["args"], case.get("snapshot")
    if case.get("write"):
        with open(case["write"], "wb") as half:
            half.write(b"half a snapshot")
    held = os.open(snapshot + ".lock", os.O_CREAT | os.O_RDWR) if case.get("hold") else None
    if held is not None:
        fcntl.flock(held, fcntl.LOCK_EX)
    sys.argv, err = [script, *args], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exit:
            # sys.exit("error: ...") exits 1 and prints its text, as Python does at exit
            code = 1 if isinstance(exit.code, str) else exit.code
            err.write(exit.code + "\n" if isinstance(exit.code, str) else "")
        except BaseException:
            traceback.print_exc()
            code = "exception"
    if dist.is_initialized():
        dist.destroy_process_group()
    for fd in {int(fd) for fd in os.listdir("/proc/self/fd")} - {held}:
        with contextlib.suppress(OSError):
            if snapshot and os.readlink(f"/proc/self/fd/{fd}") == snapshot + ".lock":
                os.close(fd)
    if held is not None:
        os.close(held)
    result = {"script": script, "args": args, "code": code, "stderr": err.getvalue()}
    if snapshot and os.path.isfile(snapshot):
        result["digest"] = hashlib.sha256(open(snapshot, "rb").read()).hexdigest()
    if snapshot:
        result["files"] = sorted(os.listdir(os.path.dirname(snapshot)))
    print("CASE " + json.dumps(result), flush=True)
"""


def test_bad_input_gives_one_clear_line(tmp_path: Path) -> None:
    no_data = tmp_path / "no_data"
    # A path under a file: no folder can be made there, whoever runs the test (root included).
    a_file, made = tmp_path / "a_file", tmp_path / "made" / "for" / "the checkpoint"
    a_file.touch()
    cases = [  # (script, arguments, what the one line must say)
        (PART1, ["--epochs", "0"], ["--epochs", "must be positive"]),
        (PART1, ["--batch-size", "-4"], ["--batch-size", "must be positive"]),
        (PART1, ["--model", "resnet181"], ["unknown --model 'resnet181'"]),
        # The checkpoint's folder is made at start: it exists when the data turns out missing.
        (
            PART1,
            ["--data-dir", str(no_data), "--checkpoint", str(made / "m.pt")],
            [str(no_data), "--dataset fake"],
        ),
        (PART1, ["--checkpoint", str(a_file / "m.pt")], [f"cannot write to {a_file}: "]),
        (SNAPSHOT_SCRIPT, ["--snapshot", str(a_file / "s" / "s.pt")], [f"to {a_file}/s: "]),
        (SNAPSHOT_SCRIPT, ["--snapshot-every", "0"], ["--snapshot-every must be 1 or more"]),
        (
            STEP5,
            ["--model", "resnet181", "--nprocs", "2"],
            ["unknown --model"],
        ),  # before mp.spawn
        (STEP6, ["--batch-size", "0"], ["must be positive"]),
    ]
    # In the same launch: a snapshot from a finished run (3 epochs of 3) is said in one line,
    # and nothing trains: exit 0, no epoch line.
    module = import_script(EPOCH_SNAPSHOT_SCRIPT)
    finished = tmp_path / "finished.pt"
    module.save_snapshot(str(finished), fresh_state(module, epochs_done=3))
    rerun = [*TINY_RUN, "--epochs", "3", "--snapshot", str(finished)]
    rerun += ["--checkpoint", str(tmp_path / "model.pt")]
    offline = {
        "http_proxy": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "no_proxy": "",
    }  # refused at once
    run = launch(
        [
            PYTHON,
            "-c",
            DRIVER,
            json.dumps(
                [
                    *({"script": s, "args": a} for s, a, _ in cases),
                    {"script": EPOCH_SNAPSHOT_SCRIPT, "args": rerun},
                ]
            ),
        ],
        timeout=LAUNCH_TIMEOUT,
        env=offline,
    )
    results = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases) + 1, run.describe()
    assert results.pop()["code"] == 0, run.describe()
    said = f"resumed from {finished}: 3/3 epochs done: nothing to train (remove it or name another)"
    assert [line for line in run.stdout.splitlines() if "resumed" in line] == [said], run.describe()
    assert "epoch 1/3" not in run.stdout and "epoch 3/3" not in run.stdout, run.describe()
    for (script, args, expected), result in zip(cases, results, strict=True):
        assert result["code"] in (1, 2), (
            f"{script} {args}: exit {result['code']}\n{result['stderr']}"
        )
        assert_one_clear_line(result["stderr"], *expected)
    assert made.is_dir(), "the checkpoint's folder is made before the data is read"


def test_a_snapshot_belongs_to_its_run(tmp_path: Path) -> None:
    """Step 10: a snapshot records the run that wrote it. A run with another model, seed, batch
    size, number of epochs or world size stops in one line naming the setting and both values,
    and leaves the snapshot as it was. A file that torch.load cannot read (cut short, random
    bytes, empty, a directory) stops every rank in one line that names it and says why, and
    stays as it was. Step 11: a second run cannot use a snapshot whose run is still going (its
    lock); a crash's half-written file is removed at the next start. (One driver runs both
    scripts' cases, torch imported once.)"""
    snapshot, tmp = tmp_path / "s.pt", tmp_path / "s.pt.tmp"
    base = [*TINY_RUN, "--epochs", "1", "--max-steps", "2", "--snapshot", str(snapshot)]
    base += ["--checkpoint", ""]
    # arguments after the base (argparse keeps the last) -> the setting, its value in the
    # snapshot, its value in this run: the line says "NAME THERE there, HERE here"
    refused = {
        ("--batch-size", "8"): ("batch_size", 16, 8),
        ("--model", "resnet18"): ("model", "test_resnet", "resnet18"),
        ("--seed", "7"): ("seed", 0, 7),
        ("--epochs", "2"): ("epochs", 1, 2),
    }
    case = {"script": CHECKED_SNAPSHOT_SCRIPT, "args": base, "snapshot": str(snapshot)}
    cases = [case]  # trains, and leaves its snapshot
    cases += [{**case, "args": [*base, *extra]} for extra in refused]
    locked = {**case, "script": LOCKED_SNAPSHOT_SCRIPT}
    cases += [{**locked, "hold": True}]  # while another run holds the lock
    cases += [{**locked, "write": str(tmp)}]  # after a crash that left half a file: resumes
    # Damaged files, each at a path of its own -> what the line must say is wrong with it.
    whole = io.BytesIO()
    torch.save({"step": 0, "model": torch.nn.Linear(8, 2).state_dict()}, whole)
    damaged = tmp_path / "damaged"
    contents = {
        damaged / "cut.pt": whole.getvalue()[: len(whole.getvalue()) // 2],
        damaged / "random.pt": random.Random(0).randbytes(4096),
        damaged / "empty.pt": b"",
    }
    damaged.mkdir()
    for path, data in contents.items():
        path.write_bytes(data)
    (damaged / "folder.pt").mkdir()
    unreadable = {
        damaged / "cut.pt": "(RuntimeError: PytorchStreamReader failed reading zip archive",
        damaged / "random.pt": "(UnpicklingError: Weights only load failed)",
        damaged / "empty.pt": "(EOFError)",
        damaged / "folder.pt": "(IsADirectoryError: [Errno 21] Is a directory",
    }
    broken = [
        {**case, "args": [*base, "--snapshot", str(path)], "snapshot": str(path)}
        for path in unreadable
    ]
    run = launch([PYTHON, "-c", DRIVER, json.dumps(cases + broken)], timeout=LAUNCH_TIMEOUT)
    results = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases + broken), run.describe()
    results, unread = results[: len(cases)], results[len(cases) :]
    for (path, why), result in zip(unreadable.items(), unread, strict=True):
        assert result["code"] == 1, result
        assert_one_clear_line(result["stderr"], f"error: {path} is not a snapshot {why}")
        assert "weights_only" not in result["stderr"], result["stderr"]  # torch's advice
    assert all(path.read_bytes() == data for path, data in contents.items())
    assert not any((damaged / "folder.pt").iterdir())
    first, *others, locked, after_crash = results
    assert first["code"] == 0, first["stderr"]
    for (name, there, here), result in zip(refused.values(), others, strict=True):
        assert result["code"] == 1, result
        said = f"{snapshot} is another run's: {name} {there} there, {here} here"
        assert_one_clear_line(result["stderr"], said)
    assert locked["code"] == 1, locked
    assert_one_clear_line(locked["stderr"], f"another run is using {snapshot}")
    # Refused runs leave the snapshot as it was; the run after the crash found its own
    # (finished) snapshot, and the half file is gone.
    assert {r["digest"] for r in results} == {first["digest"]}, results
    resumed = f"resumed from {snapshot}: 1/1 epochs, 0 steps done: nothing to train"
    assert after_crash["code"] == 0 and resumed in run.stdout, run.describe()
    # The run that took the lock said so, once; the refused one did not.
    locked = [line for line in run.stdout.splitlines() if line.startswith("locked ")]
    assert locked == [f"locked {snapshot}: other runs stop until this one ends"], run.stdout
    assert "s.pt.tmp" not in after_crash["files"] and not tmp.exists(), after_crash["files"]
    # At once, under torchrun: step 10 with another world size, and step 11 with random bytes
    # and --max-restarts=2. Both ranks of step 10 stop, each in its line, and so does the job.
    # Step 11's refusal ends its job in its first attempt, where a retry would fail alike:
    # each rank's line (a rank that torchrun stops first says nothing), no traceback.
    garbled = ["--snapshot", str(damaged / "random.pt")]
    resume, garbled = launch_at_once(
        [
            [*TORCHRUN_2, CHECKED_SNAPSHOT_SCRIPT, *base],
            [*TORCHRUN_2, "--max-restarts=2", LOCKED_SNAPSHOT_SCRIPT, *base, *garbled],
        ],
        timeout=LAUNCH_TIMEOUT,
        check=False,
        envs=[None, FRESH_STORE],
    )
    assert resume.returncode != 0 and not resume.timed_out, resume.describe()
    said = f"error: {snapshot} is another run's: world_size 1 there, 2 here"
    assert said in resume.stdout + resume.stderr, resume.describe()
    assert "epoch 1/1" not in resume.stdout, resume.describe()
    output = garbled.stdout + garbled.stderr
    said = f"error: {damaged / 'random.pt'} is not a snapshot {unreadable[damaged / 'random.pt']}"
    refusals = [line for line in output.splitlines() if "error: " in line]
    assert refusals in ([said], [said] * 2), output
    assert garbled.returncode != 0 and "[rank" not in output, garbled.describe()
    assert_one_attempt(garbled)
    assert (damaged / "random.pt").read_bytes() == contents[damaged / "random.pt"]


def test_a_refused_run_ends_its_torchrun_job(tmp_path: Path) -> None:
    """Step 11 under `torchrun --max-restarts=2` while another run holds the snapshot's lock:
    rank 0 says so once and the job ends, not restarted (a restart would wait for the lock to
    free, then resume the other run's snapshot): a non-zero exit, no epoch, no process left.
    (A snapshot refused under --max-restarts=2: test_a_snapshot_belongs_to_its_run.)"""
    snapshot, mark = tmp_path / "s.pt", f"DDP_TEST_RUN={tmp_path}"
    command = [*TORCHRUN_2, "--max-restarts=2", LOCKED_SNAPSHOT_SCRIPT, *TINY_RUN]
    command += ["--epochs", "1", "--max-steps", "2", "--snapshot", str(snapshot)]
    held = os.open(f"{snapshot}.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run's rank 0
        env = {**FRESH_STORE, "DDP_TEST_RUN": str(tmp_path)}
        run = launch([*command, "--checkpoint", ""], timeout=LAUNCH_TIMEOUT, env=env, check=False)
    finally:
        os.close(held)
    output = run.stdout + run.stderr
    refusals = [line for line in output.splitlines() if "error: " in line]
    assert refusals == [f"error: another run is using {snapshot}"], run.describe()
    assert run.returncode != 0 and "epoch 1/1" not in run.stdout, run.describe()
    assert_one_attempt(run)
    assert not with_environ(mark), "processes of the refused job still run"
    assert not snapshot.exists(), run.describe()


def assert_one_attempt(run: Run) -> None:
    """A torchrun job that a refusing rank ended (step 11): torchrun stopped by its signal, in
    the first attempt (at most one rank-0 line: none when rank 0 stops before its process
    group), not failing after its restarts (no ChildFailedError report)."""
    assert "Received 15 death signal" in run.stderr, run.describe()
    assert run.stdout.count("rank 0/2 device=") <= 1, run.describe()
    assert "ChildFailedError" not in run.stdout + run.stderr, run.describe()


def test_a_wrong_argument_under_torchrun_is_said_once() -> None:
    """Every worker parses the command line; with --local-ranks-filter=0, as the part 4 README
    advises, the error shows once, and torchrun still fails the run."""
    command = [*TORCHRUN_2, "--local-ranks-filter=0", STEP6, "--batch-size", "0"]
    run = launch(command, timeout=LAUNCH_TIMEOUT, check=False)
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("train.py: error: ")]
    assert errors == ["train.py: error: --epochs, --batch-size and --fake-size must be positive"], (
        run.describe()
    )
    assert run.returncode != 0 and "ChildFailedError" in output, run.describe()


@pytest.mark.parametrize("script", GPU_CHECKED)
def test_more_processes_than_gpus_with_nccl(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    module = import_script(script)
    monkeypatch.setattr(
        torch.cuda, "is_available", lambda: True
    )  # a machine with one GPU, as NCCL would see it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # Rank 0 of 2 processes, both on this machine: checked before set_device and before
    # the process group (main stops there, so it needs no arguments).
    if "--nprocs" in (REPO / script).read_text():  # mp.spawn's main(rank, world_size, args)
        call = lambda: module.main(0, 2, None)  # noqa: E731
    else:  # a launcher's: the numbers come from torchrun's variables
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        call = lambda: module.main(None)  # noqa: E731
    with pytest.raises(SystemExit) as exit:
        call()
    assert_one_clear_line(exit_message(exit.value), "2 processes", "1 GPU(s)")


@pytest.mark.parametrize("script", [s.script for s in STEPS if s.checks_gpus and s.spine][:2])
def test_more_processes_than_gpus_under_mp_spawn_is_one_line(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 4 and 5 as `python script.py --nprocs 2` on a machine with one GPU: the parent
    refuses before mp.spawn starts anything, so the line is all a learner sees (a refusal in
    the processes alone would come with mp.spawn's traceback in the parent)."""
    assert "--nprocs" in (REPO / script).read_text(), f"{script} is not an mp.spawn step"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spawned = []
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *a, **k: spawned.append(a))
    monkeypatch.setattr("sys.argv", [script, "--dataset", "fake", "--nprocs", "2"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert_one_clear_line(exit_message(exit.value), "2 processes", "1 GPU(s)")
    assert not spawned, "no process may start"
