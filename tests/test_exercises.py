"""The exercises (exercises/, solutions/): an autograder for Exercise 2, and the bonus tools.

The autograder trains a DDP script with 2 ranks on CPU/gloo on real MNIST digits, under a
real launcher, and checks what the six steps promise, in step order. By default it grades the
two solutions; to grade your own script (srun-style, or torchrun-style):

    DDP_EXERCISE_SCRIPT=exercises/mnist_classify_ddp.py \
        python -m pytest tests/test_exercises.py -k autograde
    DDP_EXERCISE_SCRIPT=my_torchrun_version.py DDP_EXERCISE_LAUNCHER=torchrun \
        python -m pytest tests/test_exercises.py -k autograde

The srun-style script runs outside Slurm too: the test starts one process per task with the
variables srun would set (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS) plus MASTER_ADDR/PORT
and OMP_NUM_THREADS (cores // 2), which the job script exports.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import PYTHON, REPO, TORCHRUN, Probe, Run, free_port, launch

# mnist_root is a pytest fixture
from mnist_data import TEST_DIGITS, TRAIN_DIGITS, mnist_root  # noqa: F401

WORLD = 2
# Seconds for the whole 2-rank job; a healthy one takes ~20 s here.
LAUNCH_TIMEOUT = 180
# 2 epochs would do for the step checks (set_epoch); 3 give a meaningful accuracy.
GRADE_EPOCHS = 3
# After 3 epochs: 96.5% here; the README's 5-epoch run reaches 97.5%.
MIN_TEST_ACC = 95.0
TRAIN_ARGS = ["--batch-size", "32", "--lr", "1.0", "--workers", "0", "--seed", "0"]
SOLUTIONS = {
    "srun": "solutions/mnist_classify_ddp.py",
    "torchrun": "solutions/mnist_classify_ddp_torchrun.py",
}
STARTING_POINT = "exercises/mnist_classify_ddp.py"
SERIAL = "exercises/mnist_classify.py"
SUBSET_WRITER = "exercises/get_mnist_subset.py"
JOB_SCRIPTS = [
    "job_serial.sbatch",
    "job_ddp_srun.sbatch",
    "job_ddp_torchrun.sbatch",
    "job_scaling.sbatch",
]

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


def graded_targets() -> list[tuple[str, str]]:
    """(launcher, script) pairs to grade: the learner's script if named, else both solutions."""
    script = os.environ.get("DDP_EXERCISE_SCRIPT")
    if script:
        return [(os.environ.get("DDP_EXERCISE_LAUNCHER", "srun"), script)]
    return list(SOLUTIONS.items())


@dataclass
class Training:
    run: Run
    probe: Probe
    # task (the rank it should get) -> pid; empty when the launcher does not say
    tasks: dict[int, int]
    checkpoint: Path
    epochs: int


def threads_per_task() -> int:
    return max(1, len(os.sched_getaffinity(0)) // WORLD)


def train(
    launcher: str, script: str, data: Path, tmp_path: Path, probe_dir: Path, epochs: int
) -> Training:
    checkpoint = tmp_path / "ckpt" / "mnist_cnn.pt"
    script_args = [str(REPO / script), *TRAIN_ARGS, "--epochs", str(epochs)]
    script_args += ["--data-dir", str(data), "--checkpoint", str(checkpoint)]
    if launcher == "torchrun":
        command, env = [TORCHRUN, "--standalone", f"--nproc_per_node={WORLD}", *script_args], {}
    else:
        command = ["bash", "-c", FAKE_SRUN, "fake-srun", PYTHON, *script_args]
        # What the job script exports before srun: where to meet, and the threads per task.
        env = {
            "NTASKS": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": str(threads_per_task()),
        }
    run = launch(command, timeout=LAUNCH_TIMEOUT, env=env, probe_dir=probe_dir, check=False)
    announced = re.findall(r"^fake-srun: task (\d+) is pid (\d+)$", run.stderr, re.M)
    tasks = {int(task): int(pid) for task, pid in announced}
    return Training(run, Probe.read(probe_dir), tasks, checkpoint, epochs)


# ---- the grader: one finding per claim, in step order ----


@dataclass
class Finding:
    # "step N", or "run" / "result" for what no single step owns
    step: str
    claim: str
    # None: the claim holds
    problem: str | None


def pids_by_rank(t: Training) -> dict[int, int]:
    """rank -> pid; processes that never joined a process group count as their launcher's task."""
    return t.probe.ranks() or t.tasks


def train_shards(t: Training, epoch: int) -> dict[int, list[int]]:
    """rank -> training-set indices it drew in `epoch`, in order. The training loader is the one
    that drew the most samples (the test loader draws fewer), whatever order they were built in."""
    per_loader: dict[tuple[int, int], list[int]] = {}
    for record in t.probe.events("batch"):
        if record["pass"] == epoch:
            per_loader.setdefault((record["pid"], record["loader"]), []).extend(record["indices"])
    shards = {}
    for rank, pid in pids_by_rank(t).items():
        mine = [indices for (p, _), indices in per_loader.items() if p == pid]
        shards[rank] = max(mine, key=len, default=[])
    return shards


def check_runs(t: Training) -> str | None:
    if t.run.returncode != 0:
        return (
            f"the job failed (exit {t.run.returncode}); the end of its output:\n{t.run.describe()}"
        )
    return None


def check_process_group(t: Training) -> str | None:
    joined = sorted((e["rank"], e["world_size"], e["backend"]) for e in t.probe.events("init"))
    if not joined:
        return (
            "no process called dist.init_process_group():"
            " the processes trained alone, each on everything"
        )
    if joined != [(rank, WORLD, "gloo") for rank in range(WORLD)]:
        return (
            f"(rank, world size, backend) of the processes: {joined};"
            f" expected ranks 0..{WORLD - 1} of {WORLD} on gloo"
        )
    wrong = {task: pid for task, pid in t.tasks.items() if t.probe.ranks().get(task) != pid}
    if wrong:
        return (
            f"tasks {sorted(wrong)} did not get the rank srun gave them: read it from SLURM_PROCID"
        )
    left = sorted(e["rank"] for e in t.probe.events("final"))
    if left != list(range(WORLD)):
        return (
            f"only ranks {left} called dist.destroy_process_group() at the end; every rank should"
        )
    return None


def check_threads(t: Training, launcher: str) -> str | None:
    # The OMP_NUM_THREADS the launch set.
    expected = 1 if launcher == "torchrun" else threads_per_task()
    threads = {e["rank"]: e["threads"] for e in t.probe.events("final")}
    if any(n != expected for n in threads.values()):
        return (
            f"threads per rank {threads}: OMP_NUM_THREADS={expected} was set for {WORLD}"
            f" processes on {len(os.sched_getaffinity(0))} cores; an explicit OMP_NUM_THREADS"
            " should win"
        )
    return None


def check_rank0_prints(t: Training) -> str | None:
    if len(t.run.epochs()) != t.epochs:
        lines = len(t.run.epochs())
        return f"{lines} epoch lines for {t.epochs} epochs: only rank 0 should print them"
    return None


def check_in_sync(t: Training) -> str | None:
    params = {
        rank: t.probe.params(pid)
        for rank, pid in pids_by_rank(t).items()
        if (t.probe.directory / f"{pid}.params.pt").exists()
    }
    if len(params) < WORLD:
        return (
            "no parameters to compare: they are recorded at dist.destroy_process_group() (step 1)"
        )
    if not all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True)):
        return (
            "the ranks' parameters differ after training:"
            " wrap the model in DDP, which averages the gradients"
        )
    return None


def check_disjoint_halves(t: Training) -> str | None:
    shards = train_shards(t, epoch=0)
    if len(shards) < WORLD or not all(shards.values()):
        idle = sorted(rank for rank, shard in shards.items() if not shard)
        return f"no training batches recorded for ranks {idle}"
    shared = set(shards[0]) & set(shards[1])
    if shared:
        return (
            f"ranks 0 and 1 both trained on {len(shared)} of the same samples in epoch 1:"
            " give the training DataLoader a DistributedSampler (and no shuffle=True)"
        )
    if sorted(shards[0] + shards[1]) != list(range(TRAIN_DIGITS)):
        drawn = len(shards[0]) + len(shards[1])
        return f"together the ranks drew {drawn} samples, not each of the {TRAIN_DIGITS} once"
    return None


def check_set_epoch(t: Training) -> str | None:
    first, second = train_shards(t, epoch=0).get(0), train_shards(t, epoch=1).get(0)
    if first and first == second:
        return (
            "rank 0 drew the same samples in the same order in epochs 1 and 2:"
            " call train_loader.sampler.set_epoch(epoch)"
        )
    return None


def check_global_metrics(t: Training) -> str | None:
    for e in t.run.epochs():
        if (e["train_samples"], e["test_samples"]) != (TRAIN_DIGITS, TEST_DIGITS):
            return (
                f"epoch {int(e['epoch'])} reports train_samples={int(e['train_samples'])}"
                f" test_samples={int(e['test_samples'])}, not {TRAIN_DIGITS} and {TEST_DIGITS}:"
                " dist.all_reduce the totals"
            )
    return None


def load_net(script: str) -> torch.nn.Module:
    """The script's own model class, without running its main()."""
    spec = importlib.util.spec_from_file_location("graded_script", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def check_checkpoint(t: Training, script: str) -> str | None:
    saves = t.probe.events("save")
    writers = [e["rank"] for e in saves if e["path"] == os.path.abspath(t.checkpoint)]
    if writers != [0]:
        return (
            f"the checkpoint was written by {len(writers)} process(es), ranks {writers}:"
            " only rank 0 should write it"
        )
    state = torch.load(t.checkpoint, weights_only=True)
    if any(key.startswith("module.") for key in state):
        return (
            "the checkpoint's keys start with 'module.':"
            " save model.module.state_dict(), not the DDP wrapper's"
        )
    model = load_net(script)
    # strict: every key matches the bare model
    model.load_state_dict(state)
    pid = pids_by_rank(t)[0]
    if (t.probe.directory / f"{pid}.params.pt").exists():
        trained = t.probe.params(pid)
        if not all(torch.equal(a, b) for a, b in zip(model.parameters(), trained, strict=True)):
            return "the saved weights are not the trained ones: save after the last epoch"
    return None


def check_accuracy(t: Training) -> str | None:
    epochs = t.run.epochs()
    if not epochs or epochs[-1]["test_acc"] < MIN_TEST_ACC:
        reached = epochs[-1]["test_acc"] if epochs else None
        return (
            f"test accuracy after {t.epochs} epochs: {reached}%, expected at least {MIN_TEST_ACC}%"
        )
    return None


def grade(t: Training, launcher: str, script: str) -> list[Finding]:
    """Every claim, in step order. A claim whose evidence is missing (the job crashed) fails too."""
    claims = [
        ("run", "the job runs to the end on every rank", lambda: check_runs(t)),
        (
            "step 1",
            "every rank joins one gloo process group, with its launcher's rank, and leaves it",
            lambda: check_process_group(t),
        ),
        (
            "step 1",
            "each rank uses the threads its launch gave it (OMP_NUM_THREADS)",
            lambda: check_threads(t, launcher),
        ),
        ("step 1", "only rank 0 prints the epoch lines", lambda: check_rank0_prints(t)),
        (
            "step 2",
            "the model is wrapped in DDP: parameters are equal on every rank after training",
            lambda: check_in_sync(t),
        ),
        (
            "step 3",
            "each rank trains on its own half of the data",
            lambda: check_disjoint_halves(t),
        ),
        ("step 3", "the order changes between epochs (set_epoch)", lambda: check_set_epoch(t)),
        (
            "step 3",
            "the reported accuracy is global: counts summed over ranks",
            lambda: check_global_metrics(t),
        ),
        (
            "step 5",
            "only rank 0 writes the checkpoint; its keys have no 'module.' prefix",
            lambda: check_checkpoint(t, script),
        ),
        (
            "result",
            f"the {launcher}-launched job trains: test accuracy >= {MIN_TEST_ACC}%",
            lambda: check_accuracy(t),
        ),
    ]
    findings = []
    for step, claim, check in claims:
        # A missing file, wrong keys, a crashed import: a finding, not a test error.
        try:
            problem = check()
        except Exception as error:
            problem = f"could not check it: {type(error).__name__}: {error}"
        findings.append(Finding(step, claim, problem))
    return findings


def report(findings: list[Finding]) -> str:
    failed = [f for f in findings if f.problem]
    lines = [f"{failed[0].step}: {failed[0].problem}", "", "all claims, in step order:"]
    for f in findings:
        lines.append(f"  [{'FAIL' if f.problem else ' ok '}] {f.step}: {f.claim}")
        if f.problem and f is not failed[0]:
            lines.append(f"         {f.problem.splitlines()[0]}")
    return "\n".join(lines)


@pytest.mark.parametrize(("launcher", "script"), graded_targets(), ids=lambda value: str(value))
def test_autograde(
    launcher: str,
    script: str,
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    training = train(launcher, script, mnist_root, tmp_path, probe_dir, GRADE_EPOCHS)
    findings = grade(training, launcher, script)
    if any(f.problem for f in findings):
        pytest.fail(report(findings), pytrace=False)


def test_starting_point_fails_at_step_1(
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
    probe_dir: Path,
) -> None:
    """The unmodified exercise runs (serially, in both tasks) and the grader names step 1 first."""
    training = train("srun", STARTING_POINT, mnist_root, tmp_path, probe_dir, epochs=1)
    assert training.run.returncode == 0, training.run.describe()
    findings = grade(training, "srun", STARTING_POINT)
    first = next(f for f in findings if f.problem)
    assert first.step == "step 1" and "init_process_group" in first.problem, report(findings)
    assert "step 1: no process called dist.init_process_group()" in report(findings).splitlines()[0]
    failed_steps = {f.step for f in findings if f.problem}
    assert failed_steps >= {"step 1", "step 2", "step 3", "step 5"}, (
        f"each missing step should show:\n{report(findings)}"
    )


# ---- the data step ----


def test_get_mnist_subset_writes_what_torchvision_reads(tmp_path: Path) -> None:
    """The README's data step, as a learner runs it: real digits, stratified, no download."""
    root = tmp_path / "mnist-5k"
    run = launch([PYTHON, str(REPO / SUBSET_WRITER), str(root)], timeout=120)
    train_set = torchvision.datasets.MNIST(str(root), train=True)
    test_set = torchvision.datasets.MNIST(str(root), train=False)
    assert (len(train_set), len(test_set)) == (TRAIN_DIGITS, TEST_DIGITS), run.describe()
    assert torch.bincount(test_set.targets).tolist() == [TEST_DIGITS // 10] * 10
    train_images = {image.numpy().tobytes() for image in train_set.data}
    assert not any(image.numpy().tobytes() in train_images for image in test_set.data)
    usage = launch([PYTHON, str(REPO / SUBSET_WRITER)], timeout=60, check=False)
    assert usage.returncode == 2 and "usage:" in usage.stderr, usage.describe()


# ---- the exercise files: the diffs show the six steps and nothing else (no launches) ----


def added_runs(before: str, after: str) -> list[list[str]]:
    """Runs of consecutive lines that `diff` shows as added, module docstrings apart."""

    def code_lines(path: str) -> list[str]:
        source = (REPO / path).read_text()
        return source.splitlines()[ast.parse(source).body[0].end_lineno :]

    runs: list[list[str]] = []
    previous_added = False
    diff = difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=0)
    for line in diff:
        added = line.startswith("+") and not line.startswith("+++")
        if added and line[1:].strip():
            # (a run may start with blank added lines)
            if not previous_added or not runs:
                runs.append([])
            runs[-1].append(line[1:])
        previous_added = added
    return runs


def untagged_lines(run: list[str], tag: str) -> list[str]:
    """Lines neither tagged nor nested under a tagged line of the same run (a body or a
    continuation)."""
    untagged, tagged_indent = [], None
    for line in run:
        indent = len(line) - len(line.lstrip())
        if f"# {tag}" in line:
            tagged_indent = indent if tagged_indent is None else min(tagged_indent, indent)
        elif tagged_indent is None or indent <= tagged_indent:
            untagged.append(line)
    return untagged


def test_starting_point_is_the_serial_script_plus_todo_comments() -> None:
    diff = [line for run in added_runs(SERIAL, STARTING_POINT) for line in run]
    changed = [
        line for line in diff if "TODO(step" not in line and not line.strip().startswith("#")
    ]
    assert not changed, f"the starting point may only add comments to the serial script: {changed}"
    text = (REPO / STARTING_POINT).read_text()
    todo_steps = {int(n) for n in re.findall(r"TODO\(step (\d)", text)}
    assert todo_steps == {1, 2, 3, 4, 5, 6}, f"TODO markers for steps {sorted(todo_steps)}"


@pytest.mark.parametrize("solution", SOLUTIONS.values())
def test_solution_diff_shows_the_six_steps(solution: str) -> None:
    runs = added_runs(STARTING_POINT, solution)
    untagged = [line for run in runs for line in untagged_lines(run, "step")]
    assert not untagged, f"lines added without a '# step N' comment: {untagged}"
    steps = {int(n) for run in runs for line in run for n in re.findall(r"# step (\d)", line)}
    assert steps == {1, 2, 3, 4, 5, 6}, f"{solution}: steps shown in the diff: {sorted(steps)}"
    assert "TODO" not in (REPO / solution).read_text(), f"{solution}: TODO left over"


# ---- job scripts and bonus tools ----


@pytest.mark.parametrize("name", JOB_SCRIPTS)
def test_job_script_is_valid_bash_and_cluster_neutral(name: str) -> None:
    path = REPO / "solutions" / name
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    text = path.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    site_specific = [d for d in directives if re.search(r"gpu|gres|partition|account", d, re.I)]
    assert directives and not site_specific, (
        "GPUs, partition and account go on the sbatch command line, not in #SBATCH lines"
    )
    assert '"$@"' in text, "script arguments are passed through"
    assert "SLURM_CPUS_PER_TASK" in text and "OMP_NUM_THREADS" in text
    # In job_scaling.sbatch, scaling_sweep.py starts the srun steps.
    if name != "job_scaling.sbatch":
        assert "srun --kill-on-bad-exit=1" in text
    if name != "job_serial.sbatch":
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p' in text
        assert "SLURM_JOB_ID" in text


def test_allreduce_benchmark_on_two_cpu_ranks() -> None:
    script = str(REPO / "solutions/allreduce_benchmark.py")
    command = [TORCHRUN, "--standalone", f"--nproc_per_node={WORLD}", script]
    command += ["--min-bytes", "1K", "--max-bytes", "64K", "--factor", "4"]
    command += ["--warmup", "1", "--iters", "3"]
    run = launch(command, timeout=LAUNCH_TIMEOUT)
    assert f"world_size={WORLD} backend=gloo device=cpu" in run.stdout, run.describe()
    rows = [
        line.split()
        for line in run.stdout.splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert [int(r[0]) for r in rows] == [1024, 4096, 16384, 65536], run.describe()
    for size, count, time_us, algbw, busbw in ([float(x) for x in r] for r in rows):
        assert count == size / 4 and time_us > 0
        # algbw = bytes / time; busbw: nccl-tests' bus bandwidth
        assert algbw == pytest.approx(size / (time_us * 1e-6) / 1e9, rel=0.01, abs=2e-3)
        assert busbw == pytest.approx(algbw * 2 * (WORLD - 1) / WORLD, abs=2e-3)


@pytest.mark.slow
def test_scaling_sweep_csv_and_notebook_plot(
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_notebook,
) -> None:
    csv_path, png_path = tmp_path / "scaling.csv", tmp_path / "scaling.png"
    sweep = [PYTHON, str(REPO / "solutions/scaling_sweep.py"), "--procs", "1", str(WORLD)]
    script_args = ["--epochs", "1", "--batch-size", "64", "--workers", "0"]
    script_args += ["--data-dir", str(mnist_root), "--checkpoint", ""]
    command = [*sweep, "--csv", str(csv_path), "--", *script_args]
    run = launch(command, timeout=2 * LAUNCH_TIMEOUT)
    rows = [line.split(",") for line in csv_path.read_text().splitlines()]
    assert rows[0] == ["processes", "launcher", "samples_per_s", "epoch_s", "test_acc"], rows
    runs = [(r[0], r[1]) for r in rows[1:]]
    assert runs == [("1", "torchrun"), (str(WORLD), "torchrun")], run.describe()
    for _, _, rate, seconds, accuracy in rows[1:]:
        assert float(rate) > 0 and float(seconds) > 0
        assert float(rate) * float(seconds) == pytest.approx(TRAIN_DIGITS, rel=0.02), (
            "samples/s x epoch_s = samples"
        )
        assert float(accuracy) > 50, "one epoch already learns something"

    monkeypatch.setenv("SCALING_CSV", str(csv_path))
    monkeypatch.setenv("SCALING_PNG", str(png_path))
    notebook = run_notebook(REPO / "solutions/scaling_analysis.ipynb", cwd=REPO, timeout=120)
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert re.search(r"^\s+1 .* 1\.00\s+1\.00$", printed, re.M), (
        f"1 process: speedup 1, efficiency 1\n{printed}"
    )
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the notebook wrote a PNG"
