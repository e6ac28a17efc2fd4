"""The GPU check: `python -m pytest -m gpu` on a machine with NVIDIA GPUs runs the course's
scripts under NCCL, one process per GPU, each with the command its README gives (as many
processes as GPUs in place of the README's 2), and asserts that each exits 0 without a warning
line, and that more processes than GPUs end in the course's one refusal line. Without CUDA every
test marked `gpu` skips with the reason; the two tests at the end check, on any machine, the
commands the GPU tests build and that skip."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO, TORCHRUN, launch
from course_steps import BEYOND_README, BEYOND_STEPS, STEPS
from test_readme import code_blocks

TIMEOUT = 240  # seconds per launch; one GPU runs each quick command in well under a minute
# What a clean run must not print: Python's warnings, the C++ warnings of torch and NCCL
# ("[rank0]:[W1128 ... ProcessGroupNCCL.cpp:...] Guessing device ID ..."), and torch's barrier
# warning ("barrier(): using the device under current context").
WARNING = re.compile(r"Warning\b|\[W\d{4} |Guessing device ID|device under current context")
# Known and harmless, each said where the course meets it: torchrun's note that it set
# OMP_NUM_THREADS (several workers per node; part 4's README), and torchdata 0.11 calling a
# function torch deprecated (the fault-tolerance chapter, step 8).
KNOWN = ("OMP_NUM_THREADS", "'set_vital' is deprecated")
# The GPU check as a learner runs it, on this file alone.
PYTEST_GPU = [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider"]
PYTEST_GPU.append("tests/test_gpu.py")
REFUSAL = re.compile(r"error: (\d+) processes, (\d+) GPU\(s\)")


def gpus() -> int:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: run `python -m pytest -m gpu` on a machine with one")
    return torch.cuda.device_count()


def readme_command(readme: str, script: str) -> list[str]:
    """The first command of the README's code blocks that runs the script, as words."""
    text = (REPO / readme).read_text()
    lines = [
        line.split("#")[0].strip()
        for block in code_blocks(text)
        for line in block.replace("\\\n", " ").splitlines()
    ]
    found = [line for line in lines if script in line and not line.startswith("diff ")]
    assert found, f"{readme} gives no command for {script}"
    return shlex.split(found[0])


def course_map_command(script: str) -> list[str]:
    """The quick command of the root README's course map for the script."""
    text = (REPO / "README.md").read_text().split("## The course map", 1)[1]
    for line in text.splitlines():
        if f"]({script})" in line:
            return shlex.split(line.split("|")[4].strip().strip("`"))
    raise AssertionError(f"the course map has no row for {script}")


def on_gpus(words: list[str], n: int, folder: Path) -> tuple[list[str], dict[str, str]]:
    """The README's command for n GPUs, writing into folder: torchrun with n workers per node,
    mp.spawn with n processes, files (snapshots, checkpoints) under folder."""
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):  # VARIABLE=value first
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    out = []
    for word in words:
        if word.startswith("--nproc_per_node="):
            word = f"--nproc_per_node={n}"
        elif word.startswith(("runs/", "data/")) and not word.startswith("data/mnist"):
            word = str(folder / word)
        out.append(word)
    launcher = {"python": PYTHON, "torchrun": TORCHRUN}
    out[0] = launcher.get(out[0], out[0])
    script = next(w for w in out if w.endswith(".py"))
    if "--nprocs" in (REPO / script).read_text():
        out += ["--nprocs", str(n)]
    if "--checkpoint" not in out and "--checkpoint" in (REPO / script).read_text():
        out += ["--checkpoint", str(folder / "checkpoint.pt")]
    return out, env


def warnings_in(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if WARNING.search(line) and not any(k in line for k in KNOWN)
    ]


COMMANDS = [
    *[(s.script, "README.md") for s in STEPS],
    *[(s.script, BEYOND_README) for s in BEYOND_STEPS],
]


@pytest.mark.gpu
@pytest.mark.parametrize(("script", "readme"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_quick_command_runs_clean_under_nccl(script: str, readme: str, tmp_path: Path) -> None:
    n = gpus()
    words = course_map_command(script) if readme == "README.md" else readme_command(readme, script)
    command, env = on_gpus(words, n, tmp_path)
    run = launch(command, timeout=TIMEOUT, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, run.describe()
    assert not warnings_in(output), f"warning lines: {warnings_in(output)}\n{run.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_more_processes_than_gpus_end_in_one_line(launcher: str, tmp_path: Path) -> None:
    """Step 5 under mp.spawn: the refusal line alone. Step 6 under torchrun: each worker's line,
    then only torchrun's own failure summary (no traceback from the script)."""
    n = gpus()
    spawn_step, torchrun_step = (s for s in STEPS if s.label in ("5", "6"))
    args = ["--dataset", "fake", "--epochs", "1", "--max-steps", "2"]
    args += ["--checkpoint", str(tmp_path / "model.pt")]
    if launcher == "python":
        command = [PYTHON, spawn_step.script, *args, "--nprocs", str(n + 1)]
    else:
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={n + 1}", torchrun_step.script]
        command += args
    run = launch(command, timeout=TIMEOUT)
    assert run.returncode != 0, run.describe()
    refusals = [m.groups() for m in REFUSAL.finditer(run.stderr)]
    assert refusals and set(refusals) == {(str(n + 1), str(n))}, run.describe()
    if launcher == "python":
        assert run.stderr.strip().splitlines() == [f"error: {n + 1} processes, {n} GPU(s)"], (
            run.describe()
        )
    else:
        assert len(refusals) == n + 1, "one line per worker"
        # torchrun's own report follows (its ChildFailedError); no frame of the script's
        assert "ChildFailedError" in run.stderr, run.describe()
        assert f'{torchrun_step.script}", line' not in run.stderr, run.describe()


# ---- on any machine: the GPU check's commands, and its skip ---------------------------------


def test_the_gpu_check_has_a_command_for_every_script(tmp_path: Path) -> None:
    """Each script's README command, made for 4 GPUs: torchrun with 4 workers, mp.spawn's steps
    with 4 processes, every file it writes under the test's folder."""
    for script, readme in COMMANDS:
        words = (
            course_map_command(script) if readme == "README.md" else readme_command(readme, script)
        )
        command, _ = on_gpus(words, 4, tmp_path)
        assert command[0] in (PYTHON, TORCHRUN), command
        assert script in command, command
        if command[0] == TORCHRUN:
            assert "--nproc_per_node=4" in command, command
        elif "--nprocs" in (REPO / script).read_text():
            assert command[command.index("--nprocs") + 1] == "4", command
        paths = [w for w in command if "/" in w and not w.endswith(".py") and w != command[0]]
        assert all(w.startswith(str(tmp_path)) for w in paths), f"writes outside: {command}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the GPU tests run instead")
def test_the_gpu_tests_skip_with_their_reason_without_cuda() -> None:
    run = launch(
        PYTEST_GPU,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.describe()
    assert "no CUDA GPU here: run `python -m pytest -m gpu`" in run.stdout, run.describe()
    assert re.search(r"^\d+ skipped, \d+ deselected", run.stdout, re.M), run.stdout
