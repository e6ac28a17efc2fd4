"""The diff contract: `diff -u` between consecutive teaching scripts shows one step and nothing
else, and fits on a projector. No launches here: this file runs in about a second."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass

import pytest
from conftest import REPO


@dataclass(frozen=True)
class Step:
    before: str
    after: str
    tag: str  # the comment tag of the step: `# step 3`, `# speed`, ...
    # What the step is about: each must appear in its added lines, and every added hunk
    # (imports apart) must show one of them or the tag, so an off-topic change fails.
    apis: tuple[str, ...]
    budget: int  # most changed code lines (added + removed, the module docstring apart)


# Budgets are the measured size of each diff: they may only ever go down.
STEPS = [
    Step("part1_single/train.py", "part2_dp/train.py", "DP", ("DataParallel", "model.module"), 7),
    Step(
        "part1_single/train.py",
        "part3_ddp/step1_process_group.py",
        "step 1",
        (
            "init_process_group",
            "destroy_process_group",
            "mp.spawn",
            "set_device",
            "barrier",
            "gloo",
            "nccl",
            "MASTER_ADDR",
            "rank == 0",
        ),
        44,
    ),
    Step(
        "part3_ddp/step1_process_group.py",
        "part3_ddp/step2_ddp_wrap.py",
        "step 2",
        ("DDP(", "model.module"),
        5,
    ),
    Step(
        "part3_ddp/step2_ddp_wrap.py",
        "part3_ddp/step3_distributed_sampler.py",
        "step 3",
        ("DistributedSampler(", "set_epoch(", "all_reduce(", "Subset("),
        14,
    ),
    Step(
        "part3_ddp/step3_distributed_sampler.py",
        "part3_ddp/step4_device_placement.py",
        "step 4",
        ('f"cuda:{local_rank}"', "device_count()"),
        5,
    ),
    Step(
        "part3_ddp/step4_device_placement.py",
        "part3_ddp/step5_checkpoint.py",
        "step 5",
        ("model.module", "load_state_dict"),
        5,
    ),
    Step(
        "part3_ddp/step5_checkpoint.py",
        "part4_torchrun/train.py",
        "step 6",
        ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
        27,
    ),
    Step(
        "part4_torchrun/train.py",
        "part4_torchrun/train_fast.py",
        "speed",
        (
            "autocast",
            "GradScaler",
            "channels_last",
            "compile()",
            "num_workers",
            "pin_memory",
            "non_blocking",
            "speed",
        ),
        53,
    ),
    Step(
        "part4_torchrun/train.py",
        "part4_torchrun/train_snapshot.py",
        "step 7",
        (
            "os.replace(",
            "StatefulDataLoader(",
            "set_rng_state(",
            "load_state_dict(",
            "range(start_epoch",
            "range(first_step",
        ),
        87,
    ),
]
TEACHING_SCRIPTS = sorted({s.before for s in STEPS} | {s.after for s in STEPS})
SPINE = ["part1_single/train.py", *[s.after for s in STEPS[1:7]]]
MAX_LINES = 210  # per spine script: the longest has 210
MAX_LINES_AFTER_SPINE = 245  # the speed step: part 4 plus its lesson
# Step 7 resumes from any step, loader workers included: its lesson is the longest.
MAX_LINES_SNAPSHOT = 280
MAX_FLAGS = 11  # the mp.spawn steps: part 1's ten and --nprocs
MAX_WIDTH = 100


def code_lines(path: str) -> list[str]:
    """The script's lines after its module docstring."""
    source = (REPO / path).read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    return source.splitlines()[docstring_end:]


def hunks(step: Step) -> list[tuple[list[str], list[str]]]:
    """(removed, added) lines of each hunk of the diff, without context."""
    result: list[tuple[list[str], list[str]]] = []
    diff = difflib.unified_diff(code_lines(step.before), code_lines(step.after), lineterm="", n=0)
    for line in diff:
        if line.startswith("@@"):
            result.append(([], []))
        elif line.startswith(("-", "+")) and not line.startswith(("---", "+++")):
            result[-1][0 if line[0] == "-" else 1].append(line[1:])
    return result


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.after)
def test_each_diff_shows_its_step_and_nothing_else(step: Step) -> None:
    diff = hunks(step)
    added = [line for _, plus in diff for line in plus]
    assert added, f"{step.after} adds nothing to {step.before}"
    for api in step.apis:
        assert any(api in line for line in added), f"{step.tag}: the diff should show {api!r}"
    for _, plus in diff:
        code = [line for line in plus if not line.lstrip().startswith(("import ", "from "))]
        on_topic = any(
            f"# {step.tag}" in line or any(a in line for a in step.apis) for line in code
        )
        assert not code or on_topic, f"{step.tag}: a hunk off the step's topic: {code}"
    changed = sum(len(minus) + len(plus) for minus, plus in diff)
    assert changed <= step.budget, f"{step.tag} changes {changed} lines, budget {step.budget}"


def test_diffs_open_on_code() -> None:
    """Every teaching script has the same module docstring, so no diff opens on prose."""
    docstrings = {ast.get_docstring(ast.parse((REPO / s).read_text())) for s in TEACHING_SCRIPTS}
    assert len(docstrings) == 1, docstrings


@pytest.mark.parametrize("script", TEACHING_SCRIPTS)
def test_teaching_scripts_are_standalone_and_short(script: str) -> None:
    text = (REPO / script).read_text()
    tree = ast.parse(text)
    repo_packages = {p.name for p in REPO.iterdir() if p.is_dir()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{script}: relative import"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in repo_packages, f"{script} imports {name} from the repo"
    lines = text.splitlines()
    limit = MAX_LINES if script in SPINE else MAX_LINES_AFTER_SPINE
    limit = MAX_LINES_SNAPSHOT if script.endswith("train_snapshot.py") else limit
    assert len(lines) <= limit, f"{script}: {len(lines)} lines, keep it to {limit}"
    assert max(map(len, lines)) <= MAX_WIDTH, f"{script}: a line over {MAX_WIDTH} characters"
    if script in SPINE:
        flags = text.count("add_argument(")
        assert flags <= MAX_FLAGS, f"{script}: {flags} flags, at most {MAX_FLAGS}"


def test_scripts_share_function_order() -> None:
    """Same functions in the same order, so a diff never shows a function that merely moved."""

    def functions(path: str) -> list[str]:
        tree = ast.parse((REPO / path).read_text())
        return [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]

    base = functions("part1_single/train.py")
    for script in TEACHING_SCRIPTS:
        present = [name for name in functions(script) if name in base]
        assert present == base, f"{script}: part 1's functions missing or reordered: {present}"
