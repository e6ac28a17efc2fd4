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


@pytest.mark.slow
def test_scaling_sweep_under_torchrun_writes_its_csv(
    mnist_root: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The sweep without Slurm (torchrun); test_slurm.py runs it under srun on two nodes and
    plots its CSV with the scaling notebook."""
    csv_path = tmp_path / "scaling.csv"
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
