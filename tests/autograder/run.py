"""The launch, as a learner's job would run it, and what a training run left behind: the
probe's records and the course's checker's (part4_torchrun/your_script/checker/)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO, TORCHRUN, Probe, Run, checker, free_port, launch
from mnist_data import GRADED_TEST, TRAIN_DIGITS

SOLUTIONS = {
    "srun": "solutions/mnist_classify_ddp.py",
    "torchrun": "solutions/mnist_classify_ddp_torchrun.py",
}
STARTING_POINT = "exercises/mnist_classify_ddp.py"
# Seconds for a whole job; a healthy 2-rank grading takes ~20 s here.
LAUNCH_TIMEOUT = 180
# The scripts' collective timeout (DDP_TIMEOUT_S) while graded: a rank that waits for a
# collective the others never reach fails after this long.
COLLECTIVE_TIMEOUT_S = 30
# 2 epochs would do for the step checks (set_epoch); 3 give a meaningful accuracy.
GRADE_EPOCHS = 3
# Samples per optimizer step over all ranks: each rank's --batch-size is this over the world
# size (32 on 2 ranks, 21 on 3), so every world size solves nearly the same problem.
GLOBAL_BATCH = 64
# The --lr every grading passes (Adadelta's default).
LR = 1.0
# An epoch line as the solutions print it, its figures read whatever they hold (a negative
# loss, nan, a percentage above 100), so that the grader can tell an impossible one.
FIGURE = r"(-?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))"
EPOCH_LINE = re.compile(
    rf"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) train_loss={FIGURE} train_acc={FIGURE}%"
    rf" train_samples={FIGURE} test_acc={FIGURE}% test_samples={FIGURE}"
    rf"(?: samples/s={FIGURE} epoch_s={FIGURE})?[ \t]*$",
    re.MULTILINE,
)
FIGURES = ("train_loss", "train_acc", "train_samples", "test_acc", "test_samples")

# What `srun --ntasks=$NTASKS --kill-on-bad-exit=1` does on one node, for machines without
# Slurm: start every task with Slurm's variables; when one fails, end the others and fail.
FAKE_SRUN = r"""
pids=()
for ((task = 0; task < NTASKS; task++)); do
    SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NTASKS=$NTASKS "$@" &
    pids+=($!)
    echo "fake-srun: task $task is pid $!" >&2
done
# Each task is waited for by its pid once it has ended: `wait -n` can miss a task that ended
# before it was called and then report 127 for a job that succeeded.
left=("${pids[@]}")
while ((${#left[@]})); do
    running=()
    for pid in "${left[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            running+=("$pid")
            continue
        fi
        wait "$pid"
        status=$?
        if ((status)); then
            kill "${pids[@]}" 2>/dev/null
            exit "$status"
        fi
    done
    left=("${running[@]}")
    sleep 0.2
done
"""


@dataclass(frozen=True)
class Target:
    """What to grade: a script, how it is launched ("srun" or "torchrun"), on how many ranks."""

    launcher: str
    script: str
    world: int = 2
    # its --workers (DataLoader worker processes); None: the script's default
    workers: int | None = None

    def __str__(self) -> str:
        return f"{self.launcher}-{self.world}-{self.script}"


def graded_targets() -> list[Target]:
    """The learner's script if DDP_EXERCISE_SCRIPT names one (DDP_EXERCISE_LAUNCHER, default
    srun; DDP_EXERCISE_WORLD processes, default 2), with its default loader workers, else both
    solutions, at 2 and 3 ranks."""
    script = os.environ.get("DDP_EXERCISE_SCRIPT")
    if script:
        launcher = os.environ.get("DDP_EXERCISE_LAUNCHER", "srun")
        world = os.environ.get("DDP_EXERCISE_WORLD", "2")
        if not (REPO / script).is_file():
            raise pytest.UsageError(f"DDP_EXERCISE_SCRIPT={script}: no such file")
        if launcher not in SOLUTIONS:
            raise pytest.UsageError(f"DDP_EXERCISE_LAUNCHER={launcher}: srun or torchrun")
        if not world.isdigit() or int(world) < 2:
            raise pytest.UsageError(f"DDP_EXERCISE_WORLD={world}: a number of processes, 2 or more")
        return [Target(launcher, script, int(world))]
    # The torchrun solution builds its loaders as the srun one does (test_exercises.py checks
    # it): their default worker processes are graded once, and 6 processes fewer start.
    return [
        Target("srun", SOLUTIONS["srun"], 2),
        Target("torchrun", SOLUTIONS["torchrun"], 3, workers=0),
    ]


def batch_size(world: int) -> int:
    """The --batch-size a grading on `world` ranks passes: per process, GLOBAL_BATCH over all."""
    return max(1, GLOBAL_BATCH // world)


def threads_per_task(world: int) -> int:
    """The OMP_NUM_THREADS a job script exports: the cores shared among the tasks."""
    return max(1, len(os.sched_getaffinity(0)) // world)


@dataclass
class Training:
    target: Target
    run: Run
    probe: Probe
    # task (the rank its launcher gave it) -> pid; empty when the launcher does not say
    tasks: dict[int, int]
    checkpoint: Path
    epochs: int
    train_digits: int
    test_digits: int
    seconds: float
    timeout: float
    log: Path
    # the checker's records
    check_dir: Path

    @property
    def world(self) -> int:
        return self.target.world

    @property
    def script(self) -> Path:
        return REPO / self.target.script

    @property
    def failed(self) -> bool:
        return self.run.returncode != 0

    @property
    def batch_size(self) -> int:
        """The --batch-size passed: per process."""
        return batch_size(self.world)

    @cached_property
    def epoch_lines(self) -> list[dict[str, float]]:
        """The epoch lines printed, their figures as numbers, whatever they hold (nan, -1, 250):
        epoch, epochs, train_loss, train_acc, train_samples, test_acc, test_samples."""
        names = ("epoch", "epochs", *FIGURES, "samples_per_s", "epoch_s")
        return [
            {n: float(v) for n, v in zip(names, m.groups(), strict=True) if v is not None}
            for m in EPOCH_LINE.finditer(self.run.stdout)
        ]

    @cached_property
    def pids(self) -> dict[int, int]:
        """rank -> pid; processes that never joined a process group count as their task."""
        return self.probe.ranks() or self.tasks

    def rank_of(self, pid: int) -> int | None:
        return next((rank for rank, p in self.pids.items() if p == pid), None)

    @cached_property
    def module(self):
        """The graded script as a module, without running its main(): its Net, for one."""
        spec = importlib.util.spec_from_file_location("graded_script", self.script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    @cached_property
    def lines(self) -> list[str]:
        return self.script.read_text().splitlines()

    def where(self, line: int) -> str:
        """`line N (`source`)` of the graded script."""
        return f"line {line} (`{self.lines[line - 1].strip()}`)"

    def step_of(self, line: int) -> str | None:
        """The `# step N` tag that covers a script's line: its own; else that of the comment
        right above it at its indent (no blank line between); else, for a line inside a
        statement that spans several lines, the statement's first line's. A line under a
        tagged `if` or loop is not covered: a line the learner added goes by its own."""
        tag = re.compile(r"# step (\d)")

        def own_or_comment(n: int) -> str | None:
            found = tag.search(self.lines[n - 1])
            if found:
                return f"step {found.group(1)}"
            indent = len(self.lines[n - 1]) - len(self.lines[n - 1].lstrip())
            for text in reversed(self.lines[: n - 1]):
                stripped = text.lstrip()
                if not stripped.startswith("#") or len(text) - len(stripped) != indent:
                    return None
                found = tag.search(text)
                if found:
                    return f"step {found.group(1)}"
            return None

        # the first line of the innermost statement that holds `line`
        try:
            nodes = list(ast.walk(ast.parse("\n".join(self.lines))))
        except SyntaxError:
            nodes = []
        holding = [
            node.lineno
            for node in nodes
            if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or 0)
        ]
        start = max(holding, default=line)
        return own_or_comment(line) or (own_or_comment(start) if start != line else None)

    def events(self, pid: int) -> list[dict]:
        return [r for r in self.probe.records if r["pid"] == pid]

    @cached_property
    def batches(self) -> dict[int, list[dict]]:
        """pid -> the batch records of its loaders."""
        found: dict[int, list[dict]] = {}
        for r in self.probe.events("batch"):
            found.setdefault(r["pid"], []).append(r)
        return found

    def training_loader(self, pid: int) -> int | None:
        """The loader that drew the most in epoch 1, whatever the order they were built in."""
        drawn: dict[int, int] = {}
        for r in self.batches.get(pid, []):
            if r["pass"] == 0:
                drawn[r["loader"]] = drawn.get(r["loader"], 0) + len(r["samples"])
        return max(drawn, key=drawn.get) if drawn else None

    def draws(self, epoch: int, training: bool) -> dict[int, list[int]]:
        """rank -> data-set indices its training loader (or its other loaders: the test
        set's) drew in `epoch`, in order."""
        found = {}
        for rank, pid in self.pids.items():
            loader = self.training_loader(pid)
            found[rank] = [
                i
                for r in self.batches.get(pid, [])
                if r["pass"] == epoch and (r["loader"] == loader) == training
                for i in r["samples"]
            ]
        return found

    def samplers(self, epoch: int) -> dict[int, dict]:
        """rank -> its training sampler's class and settings in `epoch`."""
        found = {}
        for rank, pid in self.pids.items():
            loader = self.training_loader(pid)
            firsts = [
                r["sampler"]
                for r in self.batches.get(pid, [])
                if r["loader"] == loader and r["pass"] == epoch and "sampler" in r
            ]
            found[rank] = firsts[0] if firsts else {}
        return found

    @property
    def whole_epochs(self) -> int:
        """Epochs that every rank finished: all of them, unless the job failed; then those
        rank 0 printed (it prints after summing every rank's counts)."""
        return min(self.epochs, len(self.epoch_lines)) if self.failed else self.epochs

    def steps(self, pid: int, optimizer: int | None = 0) -> list[dict]:
        """The process's optimizer steps, in order (probe: step): of its `optimizer`-th built
        (0: the first, the one the probe's params.pt holds), or of every one (None)."""
        return [
            e
            for e in self.events(pid)
            if e["event"] == "step" and optimizer in (None, e["optimizer"])
        ]

    def epoch_of(self, pid: int, step: dict) -> int | None:
        """The epoch (0, 1, ...) of a step: the pass of the training loader it followed."""
        where = step.get("pass")
        if where and where[0] == self.training_loader(pid):
            return where[1]
        return None

    def first_steps(self) -> dict[int, dict]:
        """rank -> what its first optimizer step was made of (probe: record_first_step)."""
        steps = {}
        for rank, pid in self.pids.items():
            path = self.probe.directory / f"{pid}.first_step.pt"
            if path.exists():
                steps[rank] = torch.load(path, weights_only=True)
        return steps

    @cached_property
    def checks(self) -> list:
        """The checker's verdicts on the run (ddp_check.report's checks): replicas equal, loader
        samples disjoint, ...; only a check named "process group" when no rank joined one."""
        return checker().report(self.check_dir, self.run.returncode)[1]

    def checked(self, name: str) -> list:
        """The checker's checks whose name starts with `name` (a model's or a loader's is
        appended)."""
        return [c for c in self.checks if c.name.startswith(name)]

    def loader(self, training: bool):
        """The checker's record of the training loader (rank 0's, as `draws` picks it), or of
        another one (the test set's); None when rank 0 drew from none."""
        number = self.training_loader(self.pids[0]) if 0 in self.pids else None
        ranks, _ = checker().read(self.check_dir)
        found = [
            loader
            for loader in checker().loaders(ranks)
            if number is not None and (loader.number == number) == training
        ]
        return found[0] if found else None

    def params(self) -> dict[int, list[torch.Tensor]]:
        """rank -> its parameters at destroy_process_group(), for the ranks that got there."""
        return {
            rank: self.probe.params(pid)
            for rank, pid in self.pids.items()
            if (self.probe.directory / f"{pid}.params.pt").exists()
        }


def train(
    target: Target,
    data: Path,
    tmp_path: Path,
    probe_dir: Path,
    epochs: int,
    digits: tuple[int, int] = (TRAIN_DIGITS, GRADED_TEST),
    workers: int | None = None,
    env: dict[str, str] | None = None,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
    launch_timeout: int = LAUNCH_TIMEOUT,
    in_place: Callable[[], bool] | None = None,
) -> Training:
    """Launch `target` on `data` for `epochs` with the probe and the checker's recorder;
    workers=None keeps the script's default loader workers, as a learner runs it. in_place:
    for a run meant to hang, launch_timeout counts from when it holds (conftest.launch)."""
    checkpoint = tmp_path / "ckpt" / "mnist_cnn.pt"
    script = REPO / target.script
    batch = batch_size(target.world)
    script_args = [str(script), "--batch-size", str(batch), "--lr", str(LR), "--seed", "0"]
    script_args += ["--epochs", str(epochs), "--data-dir", str(data)]
    script_args += ["--checkpoint", str(checkpoint)]
    if workers is not None:
        script_args += ["--workers", str(workers)]
    env = {
        "DDP_TIMEOUT_S": str(collective_timeout_s),
        "DDP_PROBE_FIRST_STEP": "1",
        "DDP_PROBE_STEPS": "1",
        **(env or {}),
    }
    if target.launcher == "torchrun":
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={target.world}", *script_args]
    else:
        command = ["bash", "-c", FAKE_SRUN, "fake-srun", PYTHON, *script_args]
        # What the job script exports before srun: where to meet, and the threads per task.
        env |= {
            "NTASKS": str(target.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": str(threads_per_task(target.world)),
        }
    check_dir = tmp_path / "check"
    check_dir.mkdir()
    start = time.monotonic()
    run = launch(
        command,
        timeout=launch_timeout,
        env=env,
        probe_dir=probe_dir,
        check_dir=check_dir,
        check=False,
        fail_on_timeout=False,
        in_place=in_place,
    )
    seconds = time.monotonic() - start
    announced = re.findall(r"^fake-srun: task (\d+) is pid (\d+)$", run.stderr, re.M)
    tasks = {int(task): int(pid) for task, pid in announced}
    probe = Probe.read(probe_dir)
    log = tmp_path / "grade.log"
    return Training(
        target,
        run,
        probe,
        tasks,
        checkpoint,
        epochs,
        *digits,
        seconds,
        launch_timeout,
        log,
        check_dir,
    )
