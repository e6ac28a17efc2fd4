"""The exercise files besides the autograder (test_exercises.py): the data writer, the diffs of
the starting point and the solutions (the six steps and nothing else), the job scripts, and the
bonus tools (all-reduce benchmark, scaling sweep)."""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torchvision
from autograder.run import LAUNCH_TIMEOUT, SOLUTIONS, STARTING_POINT
from conftest import PYTHON, REPO, TORCHRUN, launch
from mnist_data import TEST_DIGITS, TRAIN_DIGITS, mnist_root  # noqa: F401  (a fixture)

SERIAL = "exercises/mnist_classify.py"
SUBSET_WRITER = "exercises/get_mnist_subset.py"
JOB_SCRIPTS = [
    "job_serial.sbatch",
    "job_ddp_srun.sbatch",
    "job_ddp_torchrun.sbatch",
    "job_scaling.sbatch",
]
# The bonus tools' runs: 2 CPU ranks.
WORLD = 2


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
    """Runs of consecutive lines that `diff` shows as added, module docstrings apart. Blank
    lines inside a run stay in it, as "" (they end a tagged comment's block)."""

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
        elif added and previous_added and runs:
            runs[-1].append("")
        previous_added = added
    return runs


CLOSING = re.compile(r"[)\]}]+[:,]?\s*(#.*)?")


def untagged_lines(run: list[str], tag: str) -> list[str]:
    """Lines of a run that no `# step N` tag covers. A tag covers its own line and the lines
    nested deeper below it (a body, a continuation). A comment that carries the tag also
    covers the comment's further lines and the code right below it at the comment's indent
    (and what is nested in that code), up to the next blank line, the next comment or a
    dedent: a tag on its own line explains the statements under it. A line of closing
    brackets belongs to the statement it closes."""
    untagged: list[str] = []
    # indents of the tagged lines whose nested lines are covered, innermost last
    open_tags: list[int] = []
    # indent of the code a tagged comment covers; None when no such comment is open
    block: int | None = None
    in_comment = previous_covered = False
    for line in run:
        text = line.strip()
        if not text:
            block, in_comment = None, False
            continue
        indent = len(line) - len(line.lstrip())
        if CLOSING.fullmatch(text) and f"# {tag}" not in text:
            if not previous_covered:
                untagged.append(line)
            continue
        while open_tags and open_tags[-1] >= indent:
            open_tags.pop()
        comment = text.startswith("#")
        if block is not None and (indent < block or (comment and not in_comment)):
            block = None
        if f"# {tag}" in text:
            covered = True
            if comment:
                block, in_comment = indent, True
        elif block == indent:
            # the comment's further lines, or the code right below it
            covered = True
            in_comment = comment
        else:
            covered = bool(open_tags)
            in_comment = False
        if covered:
            if not comment:
                open_tags.append(indent)
        else:
            untagged.append(line)
        previous_covered = covered
    return untagged


def test_untagged_lines_follows_the_tagging_rule() -> None:
    tagged = [
        "    # step 3: a comment that tags",
        "    # and goes on",
        "    sampler = DistributedSampler(",
        "        train_set, world_size, rank",
        "    )",
        "    if rank == 0:",
        "        dist.barrier()",
        "    x = f(  # step 1",
        "        y",
        "    )",
    ]
    assert untagged_lines(tagged, "step") == []
    # a blank line, another comment or a dedent ends what a comment tags
    for end in ["", "    # a plain comment", "# dedent"]:
        run = ["    # step 3: tags", "    a = 1", end, "    b = 2"]
        assert untagged_lines(run, "step") == [line for line in [end, "    b = 2"] if line]
    assert untagged_lines(["    a = 1  # step 1", "    b = 2"], "step") == ["    b = 2"]
    untagged_call = ["    f(", "        y", "    )"]
    assert untagged_lines(untagged_call, "step") == untagged_call


def test_starting_point_is_the_serial_script_plus_todo_comments() -> None:
    diff = [line for run in added_runs(SERIAL, STARTING_POINT) for line in run]
    changed = [
        line
        for line in diff
        if line.strip() and "TODO(step" not in line and not line.strip().startswith("#")
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
    # The log where part 4's job scripts put theirs: <job name>-<job id>.out
    assert "#SBATCH --output=%x-%j.out" in text
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


# ---- the README's measured figures ----

# Points of test accuracy (1,000 test digits: 0.1 point is one digit). The runs are seeded, but
# a CPU sums a convolution's terms in an order that depends on its instructions and threads.
FIGURE_TOLERANCE = 0.5


def readme_accuracies(section: str) -> list[float]:
    """The test accuracies, epoch by epoch, that a section of exercises/README.md reports as
    measured: "test accuracy 93.3, 95.7, ..., **97.1%** after epochs 1 to 5"."""
    text = (REPO / "exercises/README.md").read_text().split(f"## {section}")[1].split("\n## ")[0]
    found = re.search(r"test accuracy ((?:\**[\d.]+%?\**,?\s+)+)after epochs 1 to", text)
    assert found, f"exercises/README.md, {section}: no measured test accuracy"
    return [float(x) for x in re.findall(r"[\d.]+", found[1])]


def test_exercise_readme_figures_come_out_again(
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Exercises 1 and 2 as the README runs them, for their first two epochs (the learning rate
    falls per epoch whatever --epochs says, so two epochs of a five-epoch run are a two-epoch
    run): the README's accuracies come out, within FIGURE_TOLERANCE. Exercise 2 runs the
    torchrun solution, which the README says gives the same figures as the srun one."""
    common = ["--epochs", "2", "--data-dir", str(mnist_root), "--checkpoint", ""]
    serial = [PYTHON, str(REPO / SERIAL), "--batch-size", "64", *common]
    ddp = [TORCHRUN, "--standalone", f"--nproc_per_node={WORLD}"]
    ddp += [str(REPO / "solutions/mnist_classify_ddp_torchrun.py"), "--batch-size", "32"]
    for section, command in [("Exercise 1", serial), ("Exercise 2", [*ddp, *common])]:
        run = launch(command, timeout=2 * LAUNCH_TIMEOUT, cwd=tmp_path)
        got = [e["test_acc"] for e in run.epochs()]
        want = readme_accuracies(section)[:2]
        assert got == pytest.approx(want, abs=FIGURE_TOLERANCE), (section, run.describe())


@pytest.mark.slow
def test_scaling_sweep_under_torchrun_writes_its_csv(
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The sweep without Slurm (torchrun), as Bonus 1 runs it: its CSV, and the test accuracies
    the README reports for 1 and 2 processes. test_slurm.py runs it under srun on two nodes and
    plots its CSV with the scaling notebook."""
    csv_path = tmp_path / "scaling.csv"
    sweep = [PYTHON, str(REPO / "solutions/scaling_sweep.py"), "--procs", "1", str(WORLD)]
    # The README's command as written: a loader process draws its seed from the global random
    # state, so --workers 0 would change the dropout masks and the figures.
    script_args = ["--epochs", "2"]
    script_args += ["--data-dir", str(mnist_root), "--checkpoint", ""]
    command = [*sweep, "--csv", str(csv_path), "--", *script_args]
    run = launch(command, timeout=2 * LAUNCH_TIMEOUT)
    rows = [line.split(",") for line in csv_path.read_text().splitlines()]
    assert rows[0] == ["processes", "launcher", "samples_per_s", "epoch_s", "test_acc"], rows
    runs = [(r[0], r[1]) for r in rows[1:]]
    assert runs == [("1", "torchrun"), (str(WORLD), "torchrun")], run.describe()
    for _, _, rate, seconds, _ in rows[1:]:
        assert float(rate) > 0 and float(seconds) > 0
        assert float(rate) * float(seconds) == pytest.approx(TRAIN_DIGITS, rel=0.02), (
            "samples/s x epoch_s = samples"
        )
    bonus = (REPO / "exercises/README.md").read_text().split("## Bonus 1")[1]
    fell = re.search(r"Accuracy\s+fell\s+from\s+([\d.]+)%\s+to\s+([\d.]+)%", bonus)
    assert fell, "exercises/README.md, Bonus 1: no measured accuracies"
    got = [float(r[4]) for r in rows[1:]]
    assert got == pytest.approx([float(x) for x in fell.groups()], abs=FIGURE_TOLERANCE), got
